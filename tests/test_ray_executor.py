"""distributed_executor_backend="ray": ranks 1.. as Ray actors on a local Ray cluster (CPU, gloo); the same greedy
tokens as one rank, a dying actor stops the engine naming its rank, and no actor process outlives the engine.

The oracle is the plain engine (itself checked against Hugging Face in test_parity.py).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from minivllm import LLM, SamplingParams  # noqa: E402
from tests.oracle import PROMPTS  # noqa: E402
from tests.test_tensor_parallel import alive, wait_gone  # noqa: E402

# Prefix caching, chunked prefill and preemption at once (a budget of 32 tokens, a pool of 14 blocks).
FEATURES = dict(device="cpu", dtype="float32", max_num_batched_tokens=32, max_num_seqs=32, num_kv_blocks=14)


def greedy(n=12):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def token_ids(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def raylets() -> set[int]:
    found = set()
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and alive(int(d.name)) and b"raylet" in (d / "cmdline").read_bytes().split(b"\0")[0]:
                found.add(int(d.name))
        except OSError:
            pass
    return found


@pytest.mark.slow
def test_an_engine_that_started_ray_stops_it(model_dir):
    """With no Ray running, the executor starts a local cluster and stops it with the engine: no raylet and no actor
    left. (Runs first, before this module starts the cluster that the other tests share.)"""
    if ray.is_initialized() or os.environ.get("RAY_ADDRESS"):
        pytest.skip("Ray is already running in this process")
    before = raylets()
    llm = LLM(str(model_dir), device="cpu", num_kv_blocks=32, pipeline_parallel_size=2,
              distributed_executor_backend="ray")
    try:
        assert ray.is_initialized()
        started = raylets() - before
        assert started, "ray.init started no raylet"
        pids = llm.llm_engine.executor.worker_pids
        assert llm.generate(["Hi"], greedy(2), use_tqdm=False)[0].outputs[0].token_ids
    finally:
        llm.shutdown()
    llm.shutdown()                                        # twice is fine
    assert not ray.is_initialized()
    assert wait_gone(pids) == [] and wait_gone(started) == []


@pytest.fixture(scope="module")
def ray_cluster():
    """One local Ray cluster for the module (ray.init takes ~8 s here); the executors join it and leave it running."""
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    if started:
        ray.shutdown()


@pytest.fixture(scope="module")
def plain(model_dir):
    return LLM(str(model_dir), **FEATURES)


@pytest.fixture(scope="module")
def prompt_ids(plain):
    tokenizer = plain.get_tokenizer()
    system = tokenizer.encode("You are a helpful assistant who answers in one sentence. " * 4,
                              add_special_tokens=False)
    return [{"prompt_token_ids": system + tokenizer.encode(p, add_special_tokens=False)} for p in PROMPTS]


@pytest.fixture(scope="module")
def reference(plain, prompt_ids):
    return token_ids(plain.generate(prompt_ids, greedy(), use_tqdm=False))


@pytest.mark.slow
@pytest.mark.parametrize("tp, pp", [(1, 2), (3, 1)], ids=["pp2", "tp3"])
def test_ray_actors_give_one_ranks_tokens_with_every_feature_on(ray_cluster, model_dir, prompt_ids, reference, tp, pp):
    with LLM(str(model_dir), distributed_executor_backend="ray", tensor_parallel_size=tp,
             pipeline_parallel_size=pp, **FEATURES) as llm:
        engine = llm.llm_engine
        executor = engine.executor
        assert type(executor).__name__ == "RayDistributedExecutor"
        # the other ranks really are Ray actors, in processes of their own
        assert len(executor.actors) == tp * pp - 1
        assert all(isinstance(a, ray.actor.ActorHandle) for a in executor.actors)
        pids = executor.worker_pids
        assert os.getpid() not in pids and len(set(pids)) == len(pids) and all(alive(p) for p in pids)
        assert {i["node_id"] for i in executor.worker_info} <= {n["NodeID"] for n in ray.nodes()}
        assert engine.max_concurrent_batches == pp
        executor.record_stage_times()
        got = token_ids(llm.generate(prompt_ids, greedy(), use_tqdm=False))
        stats = engine.get_stats()
        times = executor.stage_times()                      # (noted by pipeline stages only)
        assert sorted(times) == list(range(tp * pp))
        if pp > 1:                                          # every batch went through every stage
            assert times[0] and all([b for b, _, _ in times[r]] == [b for b, _, _ in times[0]] for r in times)
        assert got == reference
        assert stats.prefix_cache_hits > 0 and stats.num_preemptions > 0       # the features fired
        assert len(set(executor.num_kv_blocks_per_rank)) == 1                 # 14 blocks asked for, on every rank
        assert engine.kv_cache_manager.num_free_blocks == engine.kv_cache_manager.num_blocks
        assert executor._pending == [] or all(r >= 1 for r, _ in executor._pending)
    # shutdown: the actors' processes are gone and their placement group is removed
    assert wait_gone(pids) == []
    assert executor.actors == []
    assert all(pg["state"] == "REMOVED" for pg in ray.util.placement_group_table().values())


@pytest.mark.slow
def test_an_actor_killed_between_steps_stops_the_engine_naming_the_rank(ray_cluster, model_dir):
    llm = LLM(str(model_dir), device="cpu", num_kv_blocks=64, pipeline_parallel_size=2,
              distributed_executor_backend="ray")
    assert llm.generate(["Hello"], greedy(2), use_tqdm=False)[0].outputs[0].token_ids
    pids = llm.llm_engine.executor.worker_pids
    os.kill(pids[0], signal.SIGKILL)                     # rank 1, the last stage, dies between steps
    with pytest.raises(RuntimeError, match="a pipeline-parallel worker failed; the engine is shut down") as e:
        llm.generate(["Hello"], greedy(4), use_tqdm=False)
    assert "rank 1: its Ray actor died" in str(e.value), str(e.value)
    assert wait_gone(pids) == []
    assert llm.llm_engine.executor.actors == []
    with pytest.raises(RuntimeError, match="shut down"):        # the engine stays stopped
        llm.generate(["Hello"], greedy(2), use_tqdm=False)


@pytest.mark.slow
def test_an_actor_killed_mid_run_stops_the_engine_naming_the_rank(ray_cluster, model_dir):
    """ray.kill while the engine is generating: the driver's next collective or receive fails."""
    llm = LLM(str(model_dir), device="cpu", num_kv_blocks=256, tensor_parallel_size=3,
              distributed_executor_backend="ray")
    executor = llm.llm_engine.executor
    pids = executor.worker_pids
    victim = executor.actors[1]                          # rank 2
    steps_before = llm.llm_engine.num_steps

    def kill_once_running():
        deadline = time.monotonic() + 30
        while llm.llm_engine.num_steps < steps_before + 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        ray.kill(victim, no_restart=True)

    killer = threading.Thread(target=kill_once_running)
    killer.start()
    with pytest.raises(RuntimeError, match="a tensor-parallel worker failed; the engine is shut down") as e:
        llm.generate(PROMPTS, greedy(200), use_tqdm=False)
    killer.join()
    assert "rank 2: its Ray actor died" in str(e.value), str(e.value)
    assert wait_gone(pids) == []


def test_without_ray_the_error_names_the_fix(model_dir, monkeypatch):
    import minivllm.worker.ray_executor as ray_executor
    monkeypatch.setattr(ray_executor, "ray", None)
    with pytest.raises(ValueError, match="needs Ray: pip install ray"):
        LLM(str(model_dir), device="cpu", num_kv_blocks=16, pipeline_parallel_size=2,
            distributed_executor_backend="ray")


@pytest.mark.slow
def test_data_parallel_replicas_as_ray_actors_give_the_hf_tokens(ray_cluster, hf_model, tokenizer):
    """data_parallel_backend "ray" (entrypoints/dp_router.py): two replicas in actors behind the router."""
    import concurrent.futures

    from minivllm.config import EngineConfig
    from minivllm.entrypoints.api_server import run_server_in_thread
    from minivllm.entrypoints.dp_replicas import start_replicas
    from minivllm.entrypoints.dp_router import build_dp_router
    from tests.oracle import hf_greedy
    from tests.test_data_parallel import NUM_TOKENS, _complete

    replicas = start_replicas(EngineConfig(num_kv_blocks=96, device="cpu", dtype="float32", data_parallel_size=2,
                                           data_parallel_backend="ray"))
    assert all(isinstance(r.actor, ray.actor.ActorHandle) and r.process is None for r in replicas)
    srv = run_server_in_thread(build_dp_router(replicas))      # its shutdown stops the actors
    try:
        with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
            texts = list(pool.map(lambda p: _complete(srv.url, p), PROMPTS))
        for prompt, text in zip(PROMPTS, texts):
            ids = tokenizer.encode(prompt, add_special_tokens=False)
            assert text == tokenizer.decode(hf_greedy(hf_model, ids, NUM_TOKENS))
        assert all(r.num_routed >= 2 for r in replicas)
    finally:
        srv.stop()
