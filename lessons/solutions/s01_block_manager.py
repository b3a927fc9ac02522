"""Lesson 01's solution: the longest cached prefix of a prompt, by chained block hashes."""

from minivllm.core.block_pool import ROOT_HASH, hash_block_tokens


def longest_cached_prefix(token_ids, block_size, lookup):
    """The block ids of the longest run of cached full blocks that starts `token_ids`. `lookup(hash, tokens)`
    gives the cached block with that hash and those tokens, or None. At least one token is left to compute."""
    hits = []
    parent = ROOT_HASH
    for i in range((len(token_ids) - 1) // block_size):       # full blocks, never the whole sequence
        chunk = tuple(token_ids[i * block_size:(i + 1) * block_size])
        parent = hash_block_tokens(parent, chunk)                # chained: covers every token before too
        block_id = lookup(parent, chunk)
        if block_id is None:
            break                                                # a prefix ends at its first miss
        hits.append(block_id)
    return hits
