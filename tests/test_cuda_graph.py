"""CUDA graphs for decode steps (minivllm/worker/cuda_graph.py).

Without a GPU nothing can be captured, so the CPU tests run the graphs' padded static-buffer path eagerly
(`capture=False`): the same bucketing, padding, buffer reuse and output slicing a replay uses, held
against Hugging Face greedy and the plain eager path. The GPU test captures for real.
"""

from __future__ import annotations

import pytest
import torch

from tests.oracle import PROMPTS, hf_greedy
from minivllm import LLM, SamplingParams
from minivllm.worker.cuda_graph import DecodeGraphs, capture_sizes


def test_capture_sizes_follow_vllm():
    assert capture_sizes(256) == [1, 2, 4] + list(range(8, 257, 8))
    assert capture_sizes(12) == [1, 2, 4, 8, 12]
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(1) == [1]
    assert capture_sizes(4096)[-1] == 512


def attach_emulated_graphs(llm: LLM, max_num_seqs: int) -> DecodeGraphs:
    runner = llm.llm_engine.model_runner
    graphs = DecodeGraphs(runner.forward, max_num_seqs, llm.llm_engine.max_model_len, runner.block_size,
                          runner.device, capture=False)
    runner.graphs = graphs
    return graphs


@pytest.mark.slow
def test_padded_static_decode_matches_hf_and_eager(llm, hf_model, tokenizer):
    """Six requests that finish one after another: decode batches of 6, 5, 4, 3, 2, 1 run in buckets of
    8, 8, 4, 4, 2, 1 with padding rows, block tables of changing widths, and prefill steps in between."""
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (3, 6, 9, 12, 16, 24)]
    requests = [{"prompt_token_ids": p} for p in prompts]
    eager = [o.outputs[0].token_ids for o in llm.generate(requests, params, use_tqdm=False)]
    runner = llm.llm_engine.model_runner
    assert runner.graphs is None                                  # never on a CPU by default
    graphs = attach_emulated_graphs(llm, max_num_seqs=16)
    try:
        static = [o.outputs[0].token_ids for o in llm.generate(requests, params, use_tqdm=False)]
    finally:
        runner.graphs = None
    assert static == eager
    for ids, prompt, p in zip(static, prompts, params):
        assert ids == hf_greedy(hf_model, prompt, p.max_tokens)
    # The feature fired: every decode step went through the static path, with padding, and the prefill did not.
    # Decode steps: 2 at batch 6 (size 8), 3 at 5 (8), 3 at 4 (4), 3 at 3 (4), 4 at 2 (2), 8 at 1 (1).
    assert graphs.stats.replays == 2 + 3 + 3 + 3 + 4 + 8
    assert graphs.stats.padded_rows == 2 * 2 + 3 * 3 + 3 * 1
    assert graphs.stats.eager_steps == 1
    assert llm.llm_engine.kv_cache_manager.num_free_blocks == llm.llm_engine.kv_cache_manager.num_blocks


def test_padded_rows_write_nothing(llm, tokenizer):
    """A decode batch padded from 3 to 4 rows leaves every cache slot outside its own 3 slots untouched."""
    runner = llm.llm_engine.model_runner
    graphs = DecodeGraphs(runner.forward, 8, 64, runner.block_size, runner.device, capture=False)
    bs = runner.block_size
    before = runner.kv_cache.clone()
    tables = [[5], [6, 7], [8]]
    seq_lens = [4, bs + 2, 1]
    slots = [tables[i][(n - 1) // bs] * bs + (n - 1) % bs for i, n in enumerate(seq_lens)]
    hidden = graphs.run([11, 12, 13], [n - 1 for n in seq_lens], slots, seq_lens, tables)
    assert hidden.shape == (3, runner.model_cfg.hidden_size) and torch.isfinite(hidden).all()
    changed = (runner.kv_cache != before).flatten(0, 1).flatten(3).any(-1)     # (2 * layers, blocks, bs)
    changed_slots = {b * bs + o for b, o in changed.any(0).nonzero().tolist()}
    assert changed_slots == set(slots)
    runner.kv_cache.copy_(before)
    assert graphs.stats.replays == 1 and graphs.stats.padded_rows == 1


def test_too_big_or_prefill_steps_are_not_for_graphs(llm):
    runner = llm.llm_engine.model_runner
    graphs = DecodeGraphs(runner.forward, 4, 64, runner.block_size, runner.device, capture=False)
    assert graphs.can_run([1, 1, 1, 1], [[0]] * 4)
    assert not graphs.can_run([1] * 5, [[0]] * 5)                  # above the largest capture size
    assert not graphs.can_run([3, 1], [[0], [0]])                  # a prefill (or mixed) step
    assert not graphs.can_run([], [])
    assert not graphs.can_run([1], [[0] * 5])                      # wider than max_model_len / block_size


def test_enforce_eager_is_validated():
    from minivllm.config import EngineConfig
    with pytest.raises(ValueError, match="enforce_eager is 'yes'; it must be True or False"):
        EngineConfig.from_kwargs(enforce_eager="yes")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graphs_on_a_gpu_match_eager(model_dir):
    prompts = PROMPTS
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    out = {}
    for eager in (True, False):
        with LLM(str(model_dir), device="cuda", dtype="float32", enforce_eager=eager, max_num_seqs=16) as llm:
            out[eager] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            graphs = llm.llm_engine.model_runner.graphs
            if eager:
                assert graphs is None
            else:
                assert graphs is not None and graphs.capture and graphs.stats.replays > 0
    assert out[True] == out[False]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="host syncs are a GPU matter")
@pytest.mark.parametrize("enforce_eager", [True, False])
def test_a_gpu_decode_step_does_not_sync_with_the_host(model_dir, enforce_eager):
    """The model's part of a step (inputs -> logits) queues GPU work without waiting for it; the one sync
    of a step is the sampler reading the tokens back."""
    with LLM(str(model_dir), device="cuda", enforce_eager=enforce_eager, max_num_seqs=8,
             async_scheduling=False) as llm:     # the plain step, run by hand (async: tests/test_async_scheduling.py)
        engine = llm.llm_engine
        for i, prompt in enumerate(PROMPTS[:4]):
            engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                               request_id=f"s{i}")
        engine.step()                                    # the prefill
        sched = engine.scheduler.schedule()              # the next step's plan, run by hand below
        runner = engine.model_runner
        mi, _ = runner.prepare_inputs(sched)
        assert max(mi.q_lens) == 1                       # a pure decode step
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            runner.execute_model(mi)
        finally:
            torch.cuda.set_sync_debug_mode(0)
