"""Lesson 14's solution: the consumer's question to the store, how many prompt tokens can be loaded."""

from minivllm.kv_transfer import block_keys


def get_num_new_matched_tokens(prompt_token_ids, num_computed_tokens, block_size, tag, has_block):
    """Prompt tokens past `num_computed_tokens` (whole blocks this instance already has) whose KV another
    instance left in the store: the leading blocks of the prompt's tokens [0, P-1) that `has_block`, the last
    one possibly partial, counted from the first block not computed here up to the first miss."""
    keys = block_keys(list(prompt_token_ids[:-1]), block_size, tag)     # token P-1 is never moved
    num_tokens = 0
    for key, n in keys[num_computed_tokens // block_size:]:
        if not has_block(key):
            break                                                        # a chain: nothing after a miss loads
        num_tokens += n
    return num_tokens
