"""The engine loop: continuous batching, aborts, and streaming deltas."""

from __future__ import annotations

import pytest

from minivllm import SamplingParams


def greedy(n):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def run_alone(llm, prompt, n):
    return llm.generate(prompt, greedy(n), use_tqdm=False)[0].outputs[0].token_ids


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


def test_stream_deltas_add_up_to_the_final_text(llm):
    engine = llm.llm_engine
    req = engine.add_request("Write a sentence about rivers:", SamplingParams(temperature=0, max_tokens=24,
                                                                              stop=["sea"]))
    text, ids, final = "", [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            text += out.delta_text
            ids += out.delta_token_ids
            final = out
    assert final.finished and text == final.outputs[0].text and ids == final.outputs[0].token_ids
    assert req.request_id == final.request_id


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
