"""Lesson 05's checks: `slot_mapping` on hand-made cases, random cases against the formula, then against the real
ModelRunner.prepare_inputs on live engine steps, and finally inside the engine: its steps run on your slots."""

import dataclasses
import random

from course import ExerciseFailed, expect_equal

_ENGINE = {}          # one small engine for every run of this check (loading the model takes seconds)


def _case(fn, block_table, start, end, block_size, expected, what):
    actual = fn(list(block_table), start, end, block_size)
    expect_equal(actual, expected, f"{what} (block_table {block_table}, positions {start}..{end - 1}, "
                                   f"block_size {block_size})")


def _engine():
    """A float32 CPU engine with blocks of 4 tokens and a budget of 16 tokens a step (prompts are chunked), and
    its greedy tokens for a fixed workload, computed with the real slots."""
    if not _ENGINE:
        from minivllm import LLM, SamplingParams
        llm = LLM(device="cpu", dtype="float32", num_kv_blocks=48, block_size=4, max_num_seqs=4,
                  max_num_batched_tokens=16, seed=0)
        rng = random.Random(10)
        shared = [rng.randrange(100, 20000) for _ in range(9)]        # a shared prefix: prefix-cache hits
        prompts, params = [], []
        for i in range(7):
            own = [rng.randrange(100, 20000) for _ in range(rng.choice([2, 5, 11, 23, 37]))]
            prompts.append({"prompt_token_ids": (shared if i % 2 else []) + own})
            params.append(SamplingParams(temperature=0, max_tokens=rng.randrange(3, 9), ignore_eos=True))
        _ENGINE.update(llm=llm, prompts=prompts, params=params)
        _ENGINE["reference"] = _generate(llm, prompts, params)
    return _ENGINE


def _generate(llm, prompts, params):
    llm.llm_engine.reset_prefix_cache()                   # every run schedules the same steps from a clean cache
    return [out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)]


def check_slot_mapping(fn):
    _case(fn, [7], 0, 3, 4, [28, 29, 30], "a 3-token prompt in block 7")
    _case(fn, [3, 9], 20, 21, 16, [148], "a decode at position 20 (block 9, offset 4)")
    _case(fn, [5, 2], 0, 4, 4, [20, 21, 22, 23], "exactly one full block")
    yield "slot = block id * block_size + offset in the block"
    _case(fn, [7, 2], 2, 6, 4, [30, 31, 8, 9], "positions 2..5 run from block 7 into block 2")
    _case(fn, [5, 1, 6], 4, 9, 4, [4, 5, 6, 7, 24], "a chunk that starts at a block boundary (block 1)")
    _case(fn, [5, 1, 6], 8, 9, 4, [24], "a decode at the first position of a block")
    _case(fn, [4, 0, 3], 3, 8, 4, [19, 0, 1, 2, 3], "a chunk through block 0 (a block id like any other)")
    _case(fn, [2, 8], 6, 6, 4, [], "no positions (start == end)")
    yield "chunks that cross block boundaries, start at one, or are empty"
    rng = random.Random(0)
    for i in range(200):
        block_size = rng.choice([1, 2, 3, 4, 8, 16])
        table = rng.sample(range(64), rng.randrange(1, 9))
        end = rng.randrange(1, len(table) * block_size + 1)
        start = rng.randrange(0, end + 1)
        expected = [table[p // block_size] * block_size + p % block_size for p in range(start, end)]
        _case(fn, table, start, end, block_size, expected, f"random case {i}")
    yield "200 random block tables and ranges against block_table[p // block_size] * block_size + p % block_size"
    # A live engine. Every step, the real prepare_inputs builds the flat batch; its slot_mapping, cut per request,
    # is compared with yours, and the step then runs on your slots. The greedy tokens must not change.
    e = _engine()
    runner = e["llm"].llm_engine.model_runner
    real = runner.prepare_inputs
    mismatches, compared = [], []

    def prepare_inputs(out):
        mi, sampling = real(out)
        slots, row = [], 0
        for req in out.scheduled:
            n = out.num_scheduled_tokens[req.request_id]
            start, table = req.num_computed_tokens, list(req.block_table)
            mine = list(fn(list(table), start, start + n, runner.block_size))
            if mine != mi.slot_mapping[row:row + n] and not mismatches:
                mismatches.append(f"against the real ModelRunner.prepare_inputs, step {len(compared) + 1}, "
                                  f"request {req.request_id} (block_table {table}, positions {start}.."
                                  f"{start + n - 1}, block_size {runner.block_size}): expected "
                                  f"{mi.slot_mapping[row:row + n]}, got {mine}")
            slots += mine
            row += n
        compared.append(len(out.scheduled))
        return dataclasses.replace(mi, slot_mapping=slots), sampling

    runner.prepare_inputs = prepare_inputs
    try:
        tokens = _generate(e["llm"], e["prompts"], e["params"])
    except ExerciseFailed:
        raise
    except Exception as exc:
        if mismatches:
            raise ExerciseFailed(mismatches[0]) from None
        raise ExerciseFailed(f"the engine failed on your slots: {type(exc).__name__}: {exc}") from None
    finally:
        del runner.prepare_inputs                          # the class's method again
        for rid in list(e["llm"].llm_engine.requests):
            e["llm"].llm_engine.abort_request(rid)
        e["llm"].llm_engine.reset_prefix_cache()
    if mismatches:
        raise ExerciseFailed(mismatches[0])
    yield (f"{sum(compared)} requests' slots in {len(compared)} live engine steps (chunks, prefix-cache hits, "
           f"decodes) equal the real prepare_inputs'")
    for i, (want, got) in enumerate(zip(e["reference"], tokens)):
        expect_equal(got, want, f"request {i}'s greedy tokens with the engine writing K/V to your slots")
    yield "the engine ran every step on your slots: the same greedy tokens"
