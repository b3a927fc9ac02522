"""Lesson 00's checks: `blocks_held` on hand-worked cases, then against a real engine's block tables, step by step,
and against which requests the real engine accepts for its pool."""

import functools

from course import ExerciseFailed, expect_equal


@functools.cache
def _engine():
    """A small real engine, built once: 64 blocks of 8 tokens, so block boundaries come every few steps."""
    from minivllm import LLM
    return LLM(num_kv_blocks=64, block_size=8, max_num_seqs=8, seed=0).llm_engine


def check_blocks_held(fn):
    expect_equal(fn(5, 1, 16), 1, "a 5-token prompt after its first step (block size 16)")
    expect_equal(fn(16, 1, 16), 1, "a 16-token prompt after its first step (block size 16: the prompt's 16 tokens "
                                   "have KV, the sampled token not yet)")
    expect_equal(fn(17, 1, 16), 2, "a 17-token prompt after its first step (block size 16)")
    expect_equal(fn(1, 1, 16), 1, "a 1-token prompt after its first step (block size 16)")
    yield "after the prefill: the prompt's tokens have KV, the first sampled token not yet"
    expect_equal(fn(16, 2, 16), 2, "a 16-token prompt with 2 output tokens (block size 16: 17 tokens have KV)")
    expect_equal(fn(10, 7, 16), 1, "a 10-token prompt with 7 output tokens (block size 16: 16 tokens have KV)")
    expect_equal(fn(10, 8, 16), 2, "a 10-token prompt with 8 output tokens (block size 16: 17 tokens have KV)")
    yield "decoding: one more token with KV per step, a fresh block when the last one is full"
    expect_equal(fn(7, 3, 4), 3, "a 7-token prompt with 3 output tokens, block size 4")
    expect_equal(fn(8, 1, 4), 2, "an 8-token prompt with 1 output token, block size 4")
    expect_equal(fn(1, 1, 1), 1, "a 1-token prompt with 1 output token, block size 1")
    expect_equal(fn(100, 50, 32), 5, "a 100-token prompt with 50 output tokens, block size 32")
    yield "other block sizes"
    # A real engine: requests whose prompts end just before, on and just after block boundaries, stepped to the end;
    # after every step each running request's block table is compared with your function.
    from minivllm import SamplingParams
    engine = _engine()
    bs = engine.kv_cache_manager.block_size
    params = SamplingParams(temperature=0, max_tokens=18, ignore_eos=True)
    ids = [engine.add_request(list(range(100, 100 + n)), params).request_id for n in (1, 7, 8, 9, 15, 16, 17)]
    compared = 0
    try:
        while engine.has_unfinished_requests():
            engine.step()
            for r in engine.scheduler.running:
                actual = fn(r.num_prompt_tokens, r.num_output_tokens, bs)
                if actual != len(r.block_table):
                    raise ExerciseFailed(
                        f"against the real engine, a {r.num_prompt_tokens}-token prompt with {r.num_output_tokens} "
                        f"output tokens (block size {bs}): its block table holds {len(r.block_table)} blocks, your "
                        f"function says {actual}")
                compared += 1
    finally:
        for rid in ids:                                         # leave the engine empty, whatever happened
            engine.abort_request(rid)
    yield f"{compared} block tables of a real engine (7 requests, block size {bs}, every step to the end)"
    # A request is accepted only if its last step fits in the whole pool: the engine checks it when it is added.
    num_blocks = engine.kv_cache_manager.num_blocks
    for prompt_len in (1, 50, 100, 257):
        last = num_blocks * bs - prompt_len + 1                   # the largest max_tokens that fits
        for max_tokens in (last - 1, last, last + 1, last + bs):
            try:
                engine.validate_request(list(range(100, 100 + prompt_len)), SamplingParams(max_tokens=max_tokens))
                accepted = True
            except ValueError:
                accepted = False
            peak = fn(prompt_len, max_tokens, bs)
            if (peak <= num_blocks) != accepted:
                raise ExerciseFailed(
                    f"against the real engine, a {prompt_len}-token prompt with max_tokens={max_tokens} and a pool of "
                    f"{num_blocks} blocks of {bs}: the engine {'accepts' if accepted else 'refuses'} it, but your "
                    f"function says its last step holds {peak} blocks")
    yield f"which requests fit a pool of {num_blocks} blocks: your function's peak agrees with the real engine"
