"""The engine loop: continuous batching, aborts, and streaming deltas."""

from __future__ import annotations

import pytest

from minivllm import SamplingParams
from minivllm.core.sampling_params import RequestOutputKind


def greedy(n):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def run_alone(llm, prompt, n):
    return llm.generate(prompt, greedy(n), use_tqdm=False)[0].outputs[0].token_ids


@pytest.mark.slow
def test_requests_join_and_leave_a_running_batch(llm):
    engine = llm.llm_engine
    a = engine.add_request("The sun rises in the", greedy(12))
    for _ in range(4):
        engine.step()
    b = engine.add_request("Water boils at", greedy(4))         # joins while a is decoding
    engine.step()
    assert {r.request_id for r in engine.scheduler.running} == {a.request_id, b.request_id}
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
                if out.request_id == b.request_id:              # b left first; a keeps running
                    assert [r.request_id for r in engine.scheduler.running] == [a.request_id]
    assert finished[a.request_id].outputs[0].token_ids == run_alone(llm, "The sun rises in the", 12)
    assert finished[b.request_id].outputs[0].token_ids == run_alone(llm, "Water boils at", 4)


def test_abort_frees_every_block_at_any_point(llm):
    engine = llm.llm_engine
    bm = engine.kv_cache_manager
    waiting = engine.add_request("never scheduled " * 10, greedy(50))
    assert engine.abort_request(waiting.request_id).outputs[0].finish_reason == "abort"
    running = engine.add_request("Tell me about the ocean " * 10, greedy(50))
    other = engine.add_request("Tell me about the desert", greedy(6))
    engine.step()
    engine.step()
    assert running.block_table and bm.num_free_blocks < bm.num_blocks
    out = engine.abort_request(running.request_id)
    assert out.finished and out.outputs[0].finish_reason == "abort"
    engine.check_integrity()
    while engine.has_unfinished_requests():
        engine.step()
    assert other.num_output_tokens == 6
    assert bm.num_free_blocks == bm.num_blocks
    assert engine.abort_request(running.request_id) is None      # unknown or finished: ignored


@pytest.mark.slow
@pytest.mark.parametrize("stop", [[], ["city,"], [" the"]])
def test_the_three_output_kinds_agree(llm, stop):
    """DELTA outputs add up to the CUMULATIVE ones, token for token and character for character; FINAL_ONLY gives
    just the last. With stop strings, text that could begin one is held back, never handed out and taken back."""
    engine = llm.llm_engine
    prompt = "Write a sentence about rivers and the sea:"
    outs = {}
    for kind in RequestOutputKind:
        req = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=24, stop=stop, output_kind=kind))
        outs[kind] = []
        while engine.has_unfinished_requests():
            outs[kind] += [o for o in engine.step() if o.request_id == req.request_id]
    cumulative, delta, final = outs[RequestOutputKind.CUMULATIVE], outs[RequestOutputKind.DELTA], \
        outs[RequestOutputKind.FINAL_ONLY]
    assert len(final) == 1 and final[0].finished and len(delta) == len(cumulative) > 1
    last = cumulative[-1].outputs[0]
    assert (final[0].outputs[0].text, final[0].outputs[0].token_ids) == (last.text, last.token_ids)
    assert "".join(o.outputs[0].text for o in delta) == last.text
    assert [t for o in delta for t in o.outputs[0].token_ids] == last.token_ids
    assert all(len(o.outputs[0].token_ids) == 1 for o in delta)
    for prev, cur in zip(cumulative, cumulative[1:]):                 # cumulative text only ever grows
        assert cur.outputs[0].text.startswith(prev.outputs[0].text)
    if stop:
        assert last.finish_reason == "stop" and last.stop_reason == stop[0] and stop[0] not in last.text


@pytest.mark.slow
def test_a_request_that_can_never_fit_fails_alone(model_dir):
    from minivllm import LLM

    llm = LLM(str(model_dir), device="cpu", dtype="float32", num_kv_blocks=8, max_model_len=200)
    engine = llm.llm_engine
    ok = [engine.add_request(p, greedy(6)) for p in ("The sky is", "Grass is")]
    with pytest.raises(ValueError) as too_long:
        engine.add_request({"prompt_token_ids": [42] * 220}, greedy(4))
    assert "prompt has 220 tokens" in str(too_long.value) and "max_model_len is 200" in str(too_long.value)
    with pytest.raises(ValueError) as too_big:                   # 100 + 60 tokens: 159 need KV, 10 blocks
        engine.add_request({"prompt_token_ids": [42] * 100}, greedy(60))
    assert "needs 10 KV blocks" in str(too_big.value) and "whole pool has 8 blocks" in str(too_big.value)
    while engine.has_unfinished_requests():
        engine.step()
    assert all(r.num_output_tokens == 6 for r in ok)
    assert engine.kv_cache_manager.num_free_blocks == 8


@pytest.mark.slow
def test_shutdown_gives_the_memory_back_and_later_steps_say_so(model_dir):
    """LLM.shutdown() (or leaving its with-block) drops the weights and the KV cache, so the next LLM in the
    process gets them (on a GPU the default budget is a fraction of what is free); using the old one afterwards
    is a clear error that leaves no request behind."""
    from minivllm import LLM
    with LLM(str(model_dir), device="cpu", num_kv_blocks=32) as llm:
        first = llm.generate(["Hi"], SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)
        runner = llm.llm_engine.model_runner
    assert runner.model is None and runner.kv_cache is None and runner.kv_caches == []
    with pytest.raises(RuntimeError, match="was shut down .* create a new LLM"):
        llm.generate(["Hi"], SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)
    stats = llm.get_stats()
    assert stats.num_running == stats.num_waiting == 0 and stats.num_free_blocks == stats.num_kv_blocks
    llm.shutdown()                                       # twice is fine
    assert len(first[0].outputs[0].token_ids) == 3


@pytest.mark.slow
def test_warm_up_runs_a_prefill_and_touches_no_state(llm, monkeypatch):
    """ModelRunner.warm_up (what `python app.py --warmup-tokens N` runs before serving): one dummy prefill through
    the model on a scratch cache; no counter moves, the KV cache keeps its bytes, and later output is unchanged."""
    import torch
    engine = llm.llm_engine
    runner = engine.model_runner
    want = run_alone(llm, "The warm-up leaves", 6)
    seen = []
    real = runner.backend.forward
    monkeypatch.setattr(runner.backend, "forward",
                        lambda q, *a, **kw: seen.append(q.shape[0]) or real(q, *a, **kw))
    stats, cache = engine.get_stats(), runner.kv_cache.clone()
    runner.warm_up(300, tokens_per_seq=128)
    assert seen == [300] * runner.num_layers                      # every layer, the 300 tokens in one batch
    assert engine.get_stats() == stats and torch.equal(runner.kv_cache, cache)
    assert run_alone(llm, "The warm-up leaves", 6) == want


def test_warm_up_refuses_tensor_and_pipeline_parallelism():
    from types import SimpleNamespace
    from minivllm.worker.model_runner import ModelRunner
    fake = SimpleNamespace(tp=SimpleNamespace(size=2), pp=SimpleNamespace(size=1))
    with pytest.raises(RuntimeError, match="single process only"):
        ModelRunner.warm_up(fake, 16)
