"""Pipeline parallelism on CPU (gloo, worker processes): each stage holds a slice of the layers and only their KV;
greedy tokens equal one rank's, alone and with tensor parallelism inside each stage.

The oracle is the plain engine (itself checked against Hugging Face in test_parity.py).
"""

from __future__ import annotations

import multiprocessing
import os
import signal

import pytest

from minivllm import LLM, SamplingParams
from minivllm.worker.distributed import pp_layer_partition
from tests.oracle import PROMPTS
from tests.test_tensor_parallel import wait_gone


def greedy(n=24):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def token_ids(outputs):
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def prompt_ids(tokenizer):
    system = tokenizer.encode("You are a helpful assistant who answers in one sentence. " * 4,
                              add_special_tokens=False)
    return [{"prompt_token_ids": system + tokenizer.encode(p, add_special_tokens=False)} for p in PROMPTS]


# Prefix caching, chunked prefill and preemption at once (a budget of 32 tokens, a pool of 14 blocks).
FEATURES = dict(device="cpu", dtype="float32", max_num_batched_tokens=32, max_num_seqs=32, num_kv_blocks=14)


@pytest.fixture(scope="module")
def reference(model_dir, prompt_ids):
    return token_ids(LLM(str(model_dir), **FEATURES).generate(prompt_ids, greedy(), use_tqdm=False))


@pytest.mark.slow
@pytest.mark.parametrize("tp, pp", [(1, 2), (1, 3), (3, 2)], ids=["pp2", "pp3", "tp3xpp2"])
def test_pipeline_stages_give_one_ranks_tokens_with_every_feature_on(model_dir, prompt_ids, reference, tp, pp):
    """With one batch per stage in flight (the default), as vLLM v1's batch queue."""
    with LLM(str(model_dir), tensor_parallel_size=tp, pipeline_parallel_size=pp, **FEATURES) as llm:
        engine = llm.llm_engine
        with engine.record_traces() as traces:
            got = token_ids(llm.generate(prompt_ids, greedy(), use_tqdm=False))
        stats = engine.get_stats()
        assert got == reference
        assert stats.prefix_cache_hits > 0 and stats.num_preemptions > 0       # the features fired
        assert engine.max_concurrent_batches == pp
        pipes = [t.pipeline.in_flight for t in traces if t.pipeline.collected is not None]
        assert max(len(p) for p in pipes) == pp                                 # the pipe was full
        for pipe in pipes:                                                      # no request in two batches at once
            ids = [rid for _, rids in pipe for rid in rids]
            assert len(ids) == len(set(ids)), pipe
        assert engine.kv_cache_manager.num_free_blocks == engine.kv_cache_manager.num_blocks
        runner = engine.model_runner                                           # rank 0: the first stage
        assert len(runner.model.layers) == pp_layer_partition(30, pp)[0][1]
        assert not hasattr(runner.model, "lm_head") and runner.kv_cache.shape[1] == len(runner.model.layers)


@pytest.mark.slow
def test_each_stage_holds_only_its_layers_so_more_blocks_fit(model_dir):
    """The same KV memory per rank holds PP times the blocks: a stage stores its own layers' KV only."""
    one = LLM(str(model_dir), device="cpu", kv_cache_memory_gb=0.05)
    with LLM(str(model_dir), device="cpu", kv_cache_memory_gb=0.05, pipeline_parallel_size=2) as two:
        blocks = two.llm_engine.executor.num_kv_blocks_per_rank
        single = one.llm_engine.kv_cache_manager.num_blocks
        assert blocks[0] == blocks[1] and 2 * single <= blocks[0] <= 2 * single + 1, (blocks, single)   # rounding
        assert two.llm_engine.kv_cache_manager.num_blocks == blocks[0]


def test_layer_partition(monkeypatch):
    assert pp_layer_partition(30, 2) == [(0, 15), (15, 30)]
    assert pp_layer_partition(30, 4) == [(0, 7), (7, 14), (14, 22), (22, 30)]     # the later stages take the extra
    assert pp_layer_partition(3, 3) == [(0, 1), (1, 2), (2, 3)]
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "20,10")
    assert pp_layer_partition(30, 2) == [(0, 20), (20, 30)]
    for bad in ("20,11", "30,0", "a,b", "10,10,10"):
        monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", bad)
        with pytest.raises(ValueError, match="VLLM_PP_LAYER_PARTITION"):
            pp_layer_partition(30, 2)


def test_more_stages_than_layers_is_refused_before_any_process_starts(model_dir):
    before = {p.pid for p in multiprocessing.active_children()}
    with pytest.raises(ValueError, match="pipeline_parallel_size is 31 but the model has 30 layers"):
        LLM(str(model_dir), device="cpu", pipeline_parallel_size=31)
    with pytest.raises(ValueError, match="tensor_parallel_size 2 does not divide"):
        LLM(str(model_dir), device="cpu", tensor_parallel_size=2, pipeline_parallel_size=2)
    with pytest.raises(ValueError, match="draft_model' with pipeline_parallel_size > 1"):
        LLM(str(model_dir), device="cpu", pipeline_parallel_size=2,
            speculative_config={"method": "draft_model", "draft_num_layers": 2, "num_speculative_tokens": 2})
    assert {p.pid for p in multiprocessing.active_children()} == before


@pytest.mark.slow
def test_a_dying_stage_stops_the_engine_naming_the_rank(model_dir):
    llm = LLM(str(model_dir), device="cpu", num_kv_blocks=64, pipeline_parallel_size=3)
    pids = llm.llm_engine.executor.worker_pids
    os.kill(pids[1], signal.SIGKILL)                    # rank 2, the last stage, dies between steps
    with pytest.raises(RuntimeError, match="a pipeline-parallel worker failed") as e:
        llm.generate(["Hello"], greedy(4), use_tqdm=False)
    assert "rank 2" in str(e.value)
    assert wait_gone(pids) == []


@pytest.mark.slow
def test_n_gram_speculation_through_the_pipeline(model_dir):
    text = "The quick brown fox jumps over the lazy dog. " * 3
    kw = dict(device="cpu", dtype="float32", num_kv_blocks=64)
    want = token_ids(LLM(str(model_dir), **kw).generate([text], greedy(20), use_tqdm=False))
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 3}
    with LLM(str(model_dir), pipeline_parallel_size=2, speculative_config=spec, **kw) as llm:
        assert token_ids(llm.generate([text], greedy(20), use_tqdm=False)) == want
        assert llm.get_stats().num_spec_accepted_tokens > 0


@pytest.mark.slow
def test_torchrun_launch_with_tp_x_pp_matches_one_rank(llm):
    """torchrun starts every rank (as it would across machines); every rank runs the engine in lockstep, and the last
    stage broadcasts the logits so that every rank samples the same tokens. The README's command: TP 3 x PP 2, six
    processes (on 2 cores, one thread each)."""
    import subprocess
    import sys
    from pathlib import Path
    repo = Path(__file__).resolve().parents[1]
    prompt = "The capital of France is"
    expected = llm.generate([prompt], greedy(8), use_tqdm=False)[0].outputs[0].text
    env = {**os.environ, "PYTHONPATH": str(repo), "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "6",
                          "-m", "minivllm.generate", "--tensor-parallel-size", "3", "--pipeline-parallel-size", "2",
                          "--temperature", "0",
                          "--max-tokens", "8", "--ignore-eos", "--device", "cpu", "--num-kv-blocks", "64", prompt],
                         env=env, cwd=repo, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip() == expected.strip()          # printed once, by rank 0


# ---------------------------------------------------------------------- batches in flight
def overlaps(times: dict[int, list[tuple[int, float, float]]]) -> int:
    """How many times stage 0 (rank 0) worked on a batch while the last stage worked on an earlier one."""
    last = max(times)
    n = 0
    for b0, s0, e0 in times[0]:
        n += sum(1 for b1, s1, e1 in times[last] if b1 < b0 and s1 < e0 and s0 < e1)
    return n


@pytest.mark.slow
@pytest.mark.parametrize("k", [1, 2])
def test_with_two_batches_in_flight_the_stages_work_at_the_same_time(model_dir, prompt_ids, reference, k):
    """Measured, not inferred: each rank notes when it works on which batch. With one batch in flight stage 0 waits
    for the last stage to finish every batch (the bubble); with two, stage 0 runs batch b + 1 while the last stage
    runs batch b. The tokens are the same either way."""
    with LLM(str(model_dir), pipeline_parallel_size=2, max_concurrent_batches=k, **FEATURES) as llm:
        executor = llm.llm_engine.executor
        executor.record_stage_times()
        assert token_ids(llm.generate(prompt_ids, greedy(), use_tqdm=False)) == reference
        times = executor.stage_times()
        assert len(times[0]) == len(times[1]) > 10
        if k == 1:
            assert overlaps(times) == 0
        else:
            assert overlaps(times) >= len(times[0]) // 2, times


@pytest.mark.slow
def test_a_step_that_fails_with_two_batches_in_flight_rolls_back_and_serving_goes_on(model_dir, prompt_ids, reference):
    """The sampler raises while one batch is being applied and the next is already in the pipe. The step rolls back:
    the batch it issued is forgotten (its requests are scheduled again) and the batch it was applying stays in flight
    with its logits; the next steps finish every request with the tokens of a clean run, and no block is lost."""
    with LLM(str(model_dir), pipeline_parallel_size=2, **FEATURES) as llm:
        engine = llm.llm_engine
        sampler = engine.model_runner.sampler
        real = type(sampler).__call__
        calls, failed_with = [0], []

        def flaky(self, logits, requests):
            calls[0] += 1
            if calls[0] in (4, 9):      # two failures, with the pipe full (and during preemptions, at 9)
                failed_with.append(len(engine.batch_queue) + 1)   # + the batch being applied
                raise RuntimeError("injected sampler failure")
            return real(self, logits, requests)
        type(sampler).__call__ = flaky
        try:
            reqs = [engine.add_request(p, greedy()) for p in prompt_ids]
            failures = 0
            while engine.has_unfinished_requests():
                before = (engine.scheduler.num_preemptions, engine.num_generated_tokens,
                          [(r.num_computed_tokens, len(r.output_token_ids)) for r in reqs])
                try:
                    engine.step()
                except RuntimeError as e:
                    assert "injected" in str(e)
                    failures += 1
                    assert engine.failed_request_ids
                    after = (engine.scheduler.num_preemptions, engine.num_generated_tokens,
                             [(r.num_computed_tokens, len(r.output_token_ids)) for r in reqs])
                    assert after == before                      # nothing moved
                engine.check_integrity()
        finally:
            type(sampler).__call__ = real
        assert failures == 2 and failed_with == [2, 2]
        assert [r.output_token_ids for r in reqs] == reference
        assert engine.kv_cache_manager.num_free_blocks == engine.kv_cache_manager.num_blocks
        assert not engine.batch_queue or all(r.is_finished for b in engine.batch_queue for r in b.sched.scheduled)


@pytest.mark.slow
def test_aborting_a_request_whose_batch_is_in_flight(model_dir, prompt_ids, reference):
    """An abort between steps frees the request at once; when its batch comes back, its row is dropped. The other
    requests' tokens are unchanged."""
    with LLM(str(model_dir), pipeline_parallel_size=2, **FEATURES) as llm:
        engine = llm.llm_engine
        reqs = [engine.add_request(p, greedy()) for p in prompt_ids]
        victim = None
        while victim is None:
            engine.step()
            in_flight = [r for b in engine.batch_queue for r in b.sched.scheduled if r.num_output_tokens > 0]
            victim = in_flight[0] if in_flight else None
        engine.abort_request(victim.request_id)
        engine.check_integrity()
        while engine.has_unfinished_requests():
            engine.step()
            engine.check_integrity()
        for i, r in enumerate(reqs):
            if r is not victim:
                assert r.output_token_ids == reference[i]
        assert victim.status.value == "finished_aborted"
        assert engine.kv_cache_manager.num_free_blocks == engine.kv_cache_manager.num_blocks


def test_batches_in_flight_need_pipeline_stages():
    from minivllm.config import EngineConfig
    with pytest.raises(ValueError, match="max_concurrent_batches is 2 but pipeline_parallel_size is 1"):
        EngineConfig.from_kwargs(max_concurrent_batches=2)
    with pytest.raises(ValueError, match="max_concurrent_batches is 0"):
        EngineConfig.from_kwargs(max_concurrent_batches=0, pipeline_parallel_size=2)


@pytest.mark.slow
def test_the_dashboard_shows_which_batch_each_stage_holds(model_dir, prompt_ids):
    """The engine view's parallelism panel, drawn from real steps: with two batches in flight the last stage holds
    the older one and stage 0 the newer; with one, stage 0 is idle while the last stage works (the bubble)."""
    from minivllm.entrypoints.dashboard import render_parallelism
    for k in (2, 1):
        with LLM(str(model_dir), pipeline_parallel_size=2, max_concurrent_batches=k, **FEATURES) as llm:
            with llm.llm_engine.record_traces() as traces:
                llm.generate(prompt_ids[:4], greedy(6), use_tqdm=False)
        trace = next(t for t in traces if t.pipeline.collected is not None and len(t.pipeline.in_flight) == k)
        page = render_parallelism(trace, 1, 2, k)
        assert 'data-tp="1" data-pp="2"' in page and f"up to {k} batch(es) in flight" in page
        pipe = trace.pipeline.in_flight
        assert f'data-stage="1" data-batch="{pipe[0][0]}"' in page                  # the oldest, in the last stage
        if k == 2:
            assert f'data-stage="0" data-batch="{pipe[1][0]}"' in page and pipe[1][0] > pipe[0][0]
        else:
            assert 'data-stage="0" data-batch="">idle' in page
        assert all(rid in page for rid in pipe[0][1])


@pytest.mark.slow
def test_aborting_a_prompt_logprobs_request_during_its_prefill_in_flight(model_dir, prompt_ids, reference):
    """Its batch comes back with prompt-logprob rows for a request that is gone: they are dropped."""
    with LLM(str(model_dir), pipeline_parallel_size=2, **FEATURES) as llm:
        engine = llm.llm_engine
        asks = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=2)
        victim = engine.add_request(prompt_ids[0], asks)
        others = [engine.add_request(p, greedy()) for p in prompt_ids[1:3]]
        engine.step()                                           # issued, not collected: the pipe is not full yet
        assert victim in engine.scheduler.in_flight
        engine.abort_request(victim.request_id)
        while engine.has_unfinished_requests():
            engine.step()
            engine.check_integrity()
        assert [r.output_token_ids for r in others] == reference[1:3]
        assert engine.kv_cache_manager.num_free_blocks == engine.kv_cache_manager.num_blocks


@pytest.mark.slow
def test_tp2_x_pp2_on_a_tiny_llama_with_every_feature_on(tmp_path, model_dir):
    """TP 2 x PP 2 (four ranks: two stages of two TP ranks) on a tiny Llama whose heads TP 2 divides, with prefix
    caching, chunked prefill and preemption, two batches in flight; the oracle is the plain engine (which
    test_model_loading.py checks against Hugging Face on the same kind of checkpoint)."""
    from tests.test_model_loading import write_tiny_checkpoint
    write_tiny_checkpoint(tmp_path, "LlamaForCausalLM", model_dir, num_attention_heads=4, num_key_value_heads=2)
    shared = list(range(100, 148))                                    # three full blocks shared by every prompt
    prompts = [{"prompt_token_ids": shared + p} for p in ([5, 17, 42, 7, 99], [9, 8, 7], list(range(40, 70)), [3])]
    kw = dict(device="cpu", dtype="float32", max_num_batched_tokens=32, max_num_seqs=8, num_kv_blocks=10)
    expected = token_ids(LLM(str(tmp_path), **kw).generate(prompts, greedy(24), use_tqdm=False))
    with LLM(str(tmp_path), tensor_parallel_size=2, pipeline_parallel_size=2, **kw) as llm:
        with llm.llm_engine.record_traces() as traces:
            assert token_ids(llm.generate(prompts, greedy(24), use_tqdm=False)) == expected
        stats = llm.get_stats()
        assert len(llm.llm_engine.executor.worker_pids) == 3
        assert stats.prefix_cache_hits > 0 and stats.num_preemptions > 0
        assert max(len(t.pipeline.in_flight) for t in traces) == 2
