"""Lesson 01's checks: `longest_cached_prefix` on hand-made caches, then against the real KVCacheManager."""

import random

from course import ExerciseFailed, expect_equal, same_answer
from minivllm.core.block_pool import ROOT_HASH, hash_block_tokens
from minivllm.core.journal import StepJournal
from minivllm.core.kv_cache_manager import KVCacheManager
from minivllm.core.request import Request
from minivllm.core.sampling_params import SamplingParams


def _cache_of(prompts, block_size, evicted=()):
    """A lookup over the chained hashes of every full block of `prompts`, block ids 0, 1, ... in order; the block
    ids in `evicted` were evicted since (their hashes no longer answer, the blocks after them still do)."""
    table = {}
    for tokens in prompts:
        parent = ROOT_HASH
        for i in range(len(tokens) // block_size):
            chunk = tuple(tokens[i * block_size:(i + 1) * block_size])
            parent = hash_block_tokens(parent, chunk)
            table.setdefault(parent, (len(table), chunk))
    table = {h: entry for h, entry in table.items() if entry[0] not in evicted}
    return lambda h, chunk: table[h][0] if h in table and table[h][1] == chunk else None


def check_longest_cached_prefix(fn):
    bs = 4
    cached = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]]                    # blocks 0, 1, 2
    lookup = _cache_of(cached, bs)
    expect_equal(fn([50, 51, 52, 53, 54], bs, _cache_of([], bs)), [], "nothing cached")
    expect_equal(fn([1, 2, 3, 4, 5, 6, 7, 8, 60, 61], bs, lookup), [0, 1],
                 "a prompt sharing two full blocks, then different tokens")
    expect_equal(fn([1, 2, 3], bs, lookup), [], "a prompt shorter than one block")
    yield "hits stop where the prompt's tokens differ; only full blocks count"
    expect_equal(fn(list(range(1, 13)), bs, lookup), [0, 1],
                 "a prompt of exactly three cached blocks (its last token must still be computed, so the last "
                 "block cannot be a hit)")
    expect_equal(fn(list(range(1, 14)), bs, lookup), [0, 1, 2], "the same prompt plus one token")
    yield "never the whole prompt: at least one token is left to compute"
    # Block 1's tokens [5..8] are cached, but after [1, 2, 3, 4]; after [90, 91, 92, 93] they are another block.
    expect_equal(fn([90, 91, 92, 93, 5, 6, 7, 8, 9], bs, lookup), [],
                 "block 1's tokens after a different first block (the hash must chain the parent's hash)")
    two = _cache_of([[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 70, 71, 72, 73, 9, 10, 11, 12]], bs)
    expect_equal(fn([1, 2, 3, 4, 70, 71, 72, 73, 9, 10, 11, 12, 13], bs, two), [0, 2, 3],
                 "two cached prompts that share their first block")
    expect_equal(fn([1, 2, 3, 4, 99, 99, 99, 99, 9, 10, 11, 12, 13], bs, two), [0],
                 "a miss in the middle (a prefix ends at its first miss, even if later blocks look cached)")
    expect_equal(fn(list(range(1, 14)), bs, _cache_of(cached, bs, evicted={1})), [0],
                 "block 1 was evicted, blocks 0 and 2 are still cached: a hit after a miss does not count (the "
                 "prefix ends at its first miss: stop there, do not skip past it)")
    yield "hashes chain: a block is a hit only after the same whole prefix"
    # The real KVCacheManager: requests computed and committed through it, then random prompts compared with
    # its own get_computed_blocks, with your function reading the real pool's hash map.
    rng = random.Random(0)
    kv = KVCacheManager(num_blocks=64, block_size=bs, journal=StepJournal())
    params = SamplingParams(temperature=0)
    system = [rng.randrange(1000) for _ in range(10)]
    for i in range(4):
        req = Request(f"warm{i}", system[:rng.randrange(4, 11)] + [rng.randrange(1000) for _ in range(6)], params)
        assert kv.allocate_slots(req, req.num_tokens, kv.get_computed_blocks(req))
        req.num_computed_tokens = req.num_tokens
        kv.cache_blocks(req, req.num_computed_tokens)
    for i in range(30):
        prompt = system[:rng.randrange(0, 11)] + [rng.randrange(1000) for _ in range(rng.randrange(1, 9))]
        expected = kv.get_computed_blocks(Request(f"probe{i}", prompt, params))
        actual = fn(prompt, bs, kv.block_pool.lookup)
        if not same_answer(actual, expected):
            raise ExerciseFailed(f"against the real KVCacheManager, prompt {prompt}: expected the blocks "
                                 f"{expected}, got {actual}")
    yield "30 random prompts against the real KVCacheManager's get_computed_blocks"
