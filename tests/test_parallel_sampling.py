"""Parallel sampling (`SamplingParams(n > 1)`): one prompt, n samples that share the prompt's KV blocks.

Oracles: Hugging Face greedy (every greedy sample equals it), and the engine's own n=1 path with the same seeds
(sample i of a seeded request equals a single request with seed + i, as in vLLM).
"""

from __future__ import annotations

import asyncio

import pytest

from minivllm import LLM, SamplingParams
from minivllm.core.sampling_params import RequestOutputKind
from minivllm.engine.async_llm import AsyncLLMEngine

PROMPT = "The capital of France is a city where many people live and work"     # 13 tokens


@pytest.fixture(scope="module")
def small(model_dir):
    return LLM(str(model_dir), device="cpu", dtype="float32", num_kv_blocks=96, block_size=4)


@pytest.fixture
def engine(small):
    engine = small.llm_engine
    engine.reset_prefix_cache()
    yield engine
    engine.check_integrity()
    assert engine.kv_cache_manager.num_free_blocks == engine.kv_cache_manager.num_blocks


def test_greedy_samples_all_equal_hf_greedy(small, engine, hf_model):
    from tests.oracle import hf_greedy

    out = small.generate(PROMPT, SamplingParams(temperature=0, n=3, max_tokens=10, ignore_eos=True),
                         use_tqdm=False)[0]
    want = hf_greedy(hf_model, out.prompt_token_ids, 10)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(c.token_ids == want for c in out.outputs)


def test_seeded_samples_equal_single_requests_with_seed_plus_index(small, engine):
    params = SamplingParams(temperature=1.0, top_p=0.9, n=4, seed=7, max_tokens=12)
    outs = small.generate([PROMPT, "Hello there"], params, use_tqdm=False)
    for out, prompt in zip(outs, [PROMPT, "Hello there"]):
        alone = [small.generate(prompt, SamplingParams(temperature=1.0, top_p=0.9, seed=7 + i, max_tokens=12),
                                use_tqdm=False)[0].outputs[0] for i in range(4)]
        assert [c.token_ids for c in out.outputs] == [a.token_ids for a in alone]
        assert [c.text for c in out.outputs] == [a.text for a in alone]
    assert len({tuple(c.token_ids) for c in outs[0].outputs}) > 1          # they are different samples


def test_the_samples_share_the_prompts_blocks(small, engine):
    n, bs = 4, engine.kv_cache_manager.block_size
    with engine.record_traces() as traces:
        req = engine.add_request(PROMPT, SamplingParams(temperature=0.8, n=n, seed=0, max_tokens=4))
        engine.step()
    first = traces[0]
    full_blocks = len(req.prompt_token_ids) // bs
    assert [first.by_id[f"{i}_{req.request_id}"].num_cached_tokens for i in range(n)] == [0] + [full_blocks * bs] * 3
    prompt_blocks = -(-len(req.prompt_token_ids) // bs)
    assert len(first.blocks_allocated) == prompt_blocks + (n - 1) * (prompt_blocks - full_blocks)
    assert len(first.blocks_allocated) < n * prompt_blocks                  # the prompt's blocks are shared
    assert first.num_prefill_tokens == len(req.prompt_token_ids) + (n - 1) * (len(req.prompt_token_ids) % bs)
    # The trace records the fork: which blocks the samples share, a log line, and each sample's parent.
    shared = first.forks[req.request_id]
    assert shared == first.by_id[f"0_{req.request_id}"].block_table[:full_blocks]
    assert f"fork {req.request_id} into {n} samples sharing blocks {list(shared)}" in first.events
    assert {first.by_id[f"{i}_{req.request_id}"].parent_id for i in range(n)} == {req.request_id}
    assert first.by_id[f"0_{req.request_id}"].sampling == "T=0.8"
    while engine.has_unfinished_requests():
        engine.step()


@pytest.mark.parametrize("kind", list(RequestOutputKind))
def test_output_kinds_for_n_samples(small, engine, kind):
    params = dict(temperature=0.9, n=3, seed=3, max_tokens=8)
    final = small.generate(PROMPT, SamplingParams(**params), use_tqdm=False)[0]
    req = engine.add_request(PROMPT, SamplingParams(**params, output_kind=kind))
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert all(o.request_id == req.request_id for o in outs) and outs[-1].finished
    assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
    if kind is RequestOutputKind.FINAL_ONLY:
        assert len(outs) == 1
    if kind is RequestOutputKind.DELTA:
        texts, ids = {}, {}
        for o in outs:
            for c in o.outputs:
                texts[c.index] = texts.get(c.index, "") + c.text
                ids[c.index] = ids.get(c.index, []) + c.token_ids
        assert [texts[i] for i in range(3)] == [c.text for c in final.outputs]
        assert [ids[i] for i in range(3)] == [c.token_ids for c in final.outputs]
    else:
        assert [(c.text, c.token_ids) for c in outs[-1].outputs] == [(c.text, c.token_ids) for c in final.outputs]
    assert all(c.finish_reason == "length" for c in outs[-1].outputs) or kind is RequestOutputKind.DELTA


def test_aborting_the_request_aborts_every_sample(small, engine):
    req = engine.add_request(PROMPT, SamplingParams(temperature=0.8, n=3, max_tokens=50))
    engine.step()
    out = engine.abort_request(req.request_id)
    assert out.finished and [c.finish_reason for c in out.outputs] == ["abort"] * 3
    assert not engine.requests and engine.abort_request(req.request_id) is None


def test_a_failed_step_names_the_parent_once_and_changes_nothing(small, engine):
    want = small.generate(PROMPT, SamplingParams(temperature=0.8, n=2, seed=11, max_tokens=6), use_tqdm=False)[0]
    engine.reset_prefix_cache()
    req = engine.add_request(PROMPT, SamplingParams(temperature=0.8, n=2, seed=11, max_tokens=6))
    engine.step()
    real = engine.model_runner.execute_model

    def broken(mi):
        engine.model_runner.execute_model = real
        raise RuntimeError("injected")
    engine.model_runner.execute_model = broken
    with pytest.raises(RuntimeError):
        engine.step()
    assert engine.failed_request_ids == [req.request_id]
    engine.check_integrity()
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert outs[-1].finished
    assert [c.token_ids for c in outs[-1].outputs] == [c.token_ids for c in want.outputs]


def test_n_samples_stream_through_the_async_engine(small, engine):
    ae = AsyncLLMEngine(engine)
    params = SamplingParams(temperature=0.9, n=2, seed=4, max_tokens=8, output_kind=RequestOutputKind.DELTA)

    async def main():
        texts = {}
        async for out in ae.generate(PROMPT, params):
            for c in out.outputs:
                texts[c.index] = texts.get(c.index, "") + c.text
        return texts, out

    try:
        texts, last = asyncio.run(main())
    finally:
        ae.shutdown(shutdown_engine=False)
    want = small.generate(PROMPT, SamplingParams(temperature=0.9, n=2, seed=4, max_tokens=8), use_tqdm=False)[0]
    assert last.finished and [texts[0], texts[1]] == [c.text for c in want.outputs]


def test_n_is_checked():
    for bad in (0, -1, 129, 1.5, True):
        with pytest.raises(ValueError, match="n is"):
            SamplingParams(n=bad)
