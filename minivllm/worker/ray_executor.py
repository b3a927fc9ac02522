"""RayDistributedExecutor: the other ranks as Ray actors (vLLM's `distributed_executor_backend="ray"`).

Owns: the Ray side of the ranks' lifecycles. As in MultiprocExecutor (executor.py), rank 0's ModelRunner (the
"driver") lives in the engine's process, builds each step's ModelInput and samples; ranks 1..world-1 are Ray
actors, one per bundle of a placement group, each with its own ModelRunner. The step itself is carried by the
Executor base class (executor_base.py); executor.py imports this module only for backend "ray", and this module
never imports executor.py. Tensors go over torch.distributed
(gloo on CPU, NCCL on CUDA) exactly as with 'mp'; only the control messages differ: a step is one
`execute_model.remote(mi)` call per actor instead of a pipe message.

    driver (rank 0, engine process)            actor rank 1 (Ray worker)      actor rank 2 ...
    mi = prepare_inputs(sched)
    actor.execute_model.remote(mi) ----------> execute_model(mi)  (returns None: the driver samples)
    driver.execute_model(mi)      <==========> collectives / stage sends <====> ...
    _check_workers(): finished calls forgotten, a failed one raises naming its rank

Ray runs a (single-threaded) actor's calls in the order they were submitted, so steps never reorder, and
submitting does not block: under pipeline parallelism the engine can issue the next batch while the actors work
on earlier ones. If Ray is not running, `ray.init()` starts a local cluster (or joins the one RAY_ADDRESS names);
a cluster this executor started is shut down with it, one the caller started is left alone.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import traceback
import weakref

import torch

from minivllm.config import EngineConfig
from minivllm.model.llama import ModelConfig
from minivllm.worker.distributed import (destroy_distributed, get_open_port, init_distributed, make_groups,
                                         tp_device)
from minivllm.worker.executor_base import Executor, _cpu_threads_per_rank
from minivllm.worker.model_runner import ModelRunner

try:
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
except ImportError:          # make_executor imports this module only for backend "ray"; the error says what to do
    ray = None

_STARTUP_TIMEOUT_S = 120.0     # placement group + actors importing torch and minivllm
_ERROR_WAIT_S = 5.0            # after a failed step: how long to wait for the workers' own errors


class WorkerFailed(RuntimeError):
    """A worker's call failed (its actor died or its step raised); `errors`: rank -> what happened."""

    def __init__(self, message: str, errors: dict[int, str]):
        super().__init__(message)
        self.errors = errors


class RayWorker:
    """One rank in a Ray actor (wrapped by `ray.remote` at run time, so this module imports without Ray)."""

    def __init__(self, rank: int, threads: int):
        self.rank = rank
        self.runner: ModelRunner | None = None
        if threads:
            torch.set_num_threads(threads)

    def info(self) -> dict:
        """Where this rank runs: pid, Ray node id and IP, GPU ids (also a cheap 'are you alive?')."""
        ctx = ray.get_runtime_context()
        return {"pid": os.getpid(), "node_id": ctx.get_node_id(), "ip": ray.util.get_node_ip_address(),
                "gpu_ids": ray.get_gpu_ids()}

    def init_runner(self, tp_size: int, init_method: str, config: EngineConfig, model_path, model_cfg: ModelConfig,
                    device: str) -> int:
        """Join the process group, load this rank's shard; returns how many KV blocks fit here."""
        dev = torch.device(device)
        if dev.type == "cuda":
            dev = torch.device("cuda", 0)        # Ray made the bundle's GPU the only visible one
        world = tp_size * config.pipeline_parallel_size
        init_distributed(self.rank, world, init_method, dev)
        tp, pp = make_groups(tp_size, config.pipeline_parallel_size, self.rank, model_cfg.num_hidden_layers)
        self.runner = ModelRunner(config, model_path, model_cfg, dev, tp, pp)
        return self.runner.profile_num_blocks()

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.runner.allocate_kv_cache(num_blocks)

    def execute_model(self, model_input) -> None:
        try:
            self.runner.execute_model(model_input)     # logits (last stage / TP) are dropped: the driver samples
        except BaseException:
            # The group is broken (a peer died, or this rank failed). Unlike an 'mp' worker this process would stay
            # alive with its sockets open, and a rank waiting on it in a collective would wait until gloo's timeout
            # (10 min): leave shortly after Ray has the error, so that every peer's socket to this rank closes.
            threading.Timer(1.0, os._exit, (1,)).start()
            raise
        return None

    def record_stage_times(self, on: bool) -> None:
        self.runner.record_stage_times, self.runner.stage_times = on, []

    def stage_times(self) -> list:
        return list(self.runner.stage_times)

    def shutdown(self) -> None:
        destroy_distributed()


def _stop_workers(state: dict) -> None:
    """Kill the actors, free the placement group, leave the process group, restore the threads and, if this
    executor started Ray, stop it. Safe to call twice (also run by weakref.finalize at garbage collection/exit)."""
    if state.get("stopped"):
        return
    state["stopped"] = True
    actors = list(state["actors"])
    state["actors"].clear()                  # in place: it is the executor's own list
    pending = state.get("pending")
    if pending is not None:
        pending.clear()
    if ray is not None and ray.is_initialized():
        for actor in actors:
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
        pg, state["pg"] = state.get("pg"), None
        if pg is not None:
            with contextlib.suppress(Exception):
                remove_placement_group(pg)
    destroy_distributed()
    if state.get("saved_threads") is not None:
        torch.set_num_threads(state["saved_threads"])
    if state.get("started_ray") and ray is not None and ray.is_initialized():
        with contextlib.suppress(Exception):
            ray.shutdown()


class RayDistributedExecutor(Executor):
    def __init__(self, config: EngineConfig, model_path, model_cfg: ModelConfig, device: torch.device):
        super().__init__()
        if ray is None:
            raise ValueError("distributed_executor_backend 'ray' needs Ray: pip install ray")
        tp_size, pp_size = config.tensor_parallel_size, config.pipeline_parallel_size
        world = tp_size * pp_size                  # rank = pipeline stage x tp_size + TP rank; rank 0 drives
        self.tp_size = tp_size
        self.world_size = world
        self.actors: list = []                     # rank r is self.actors[r - 1]
        self.worker_info: list[dict] = []          # rank r's pid, node id, IP, GPU ids at self.worker_info[r - 1]
        self._pending: list[tuple[int, object]] = []     # (rank, ObjectRef) of calls not seen finished yet
        self._state = {"actors": self.actors, "pending": self._pending, "pg": None, "saved_threads": None,
                       "started_ray": False, "stopped": False}
        self._finalizer = weakref.finalize(self, _stop_workers, self._state)
        try:
            if not ray.is_initialized():
                # A local cluster, or the one RAY_ADDRESS names. Workers' output still reaches this terminal.
                # On a CPU-only local cluster every rank needs a CPU slot of the placement group, as many as the
                # 'mp' backend would start processes (they share the cores; torch threads are split below).
                local_cpu = device.type == "cpu" and not os.environ.get("RAY_ADDRESS")
                ray.init(**({"num_cpus": max(os.cpu_count() or 1, world - 1)} if local_cpu else {}))
                self._state["started_ray"] = True
            if device.type == "cpu" and world > 1:
                self._state["saved_threads"] = torch.get_num_threads()
                torch.set_num_threads(_cpu_threads_per_rank(world))
            threads = _cpu_threads_per_rank(world) if device.type == "cpu" else 0
            if world > 1:
                self._start_actors(world, device, threads)
            driver_ip = ray.util.get_node_ip_address()
            # The rendezvous is rank 0's TCP store on this node; the actors reach it at this node's IP.
            init_method = f"tcp://{driver_ip}:{get_open_port()}"
            sizes_refs = [a.init_runner.remote(tp_size, init_method, config, model_path, model_cfg, str(device))
                          for a in self.actors]
            init_distributed(0, world, init_method, tp_device(device, 0))
            tp, pp = make_groups(tp_size, pp_size, 0, model_cfg.num_hidden_layers)
            self.driver = ModelRunner(config, model_path, model_cfg, tp_device(device, 0), tp, pp)
            sizes = [self.driver.profile_num_blocks()] + self._get_each(sizes_refs, "while starting")
            self.num_kv_blocks_per_rank = sizes        # under PP each stage has its own layers' worth
            num_blocks = min(sizes)                    # every rank must have every block id
            self._get_each([a.allocate_kv_cache.remote(num_blocks) for a in self.actors], "allocating its KV cache")
            self._allocate(num_blocks)
            # Under PP, rank 0 is free once it has run stage 0: one batch per stage can be in flight.
            self.max_concurrent_batches = config.max_concurrent_batches or pp_size
        except BaseException:
            self.shutdown()
            raise

    def _start_actors(self, world: int, device: torch.device, threads: int) -> None:
        # An actor asks for one CPU (and on CUDA one GPU); its bundle must hold all of it.
        bundle = {"CPU": 1, "GPU": 1} if device.type == "cuda" else {"CPU": 1}
        # PACK keeps the ranks on as few nodes as possible; "SPREAD" (or a multi-node cluster) works the same, as
        # long as every node can reach the rendezvous address (this node's IP) and, on CUDA, NCCL's network.
        pg = placement_group([dict(bundle) for _ in range(world - 1)], strategy="PACK")
        self._state["pg"] = pg
        try:
            ray.get(pg.ready(), timeout=_STARTUP_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            raise RuntimeError(f"Ray could not place {world - 1} worker(s) of {bundle} within "
                               f"{_STARTUP_TIMEOUT_S:.0f} s (cluster resources: {ray.cluster_resources()}); "
                               f"start Ray with more CPUs/GPUs or lower the parallel sizes.") from None
        actor_cls = ray.remote(RayWorker)
        for rank in range(1, world):
            opts = dict(num_cpus=1, max_restarts=0,
                        scheduling_strategy=PlacementGroupSchedulingStrategy(
                            placement_group=pg, placement_group_bundle_index=rank - 1))
            if device.type == "cuda":
                opts["num_gpus"] = 1
            self.actors.append(actor_cls.options(**opts).remote(rank, threads))
        self.worker_info = self._get_each([a.info.remote() for a in self.actors], "while starting")
        if device.type == "cuda":
            mine = torch.cuda.current_device()
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            mine_id = visible.split(",")[mine] if visible else str(mine)
            here = ray.util.get_node_ip_address()
            clash = [r for r, info in enumerate(self.worker_info, start=1)
                     if info["ip"] == here and mine_id in [str(g) for g in info["gpu_ids"]]]
            if clash:
                raise RuntimeError(f"Ray gave rank {clash[0]} this process's GPU {mine_id}; start Ray without that "
                                   "GPU (e.g. CUDA_VISIBLE_DEVICES for the raylet) or run the engine on a free one.")

    def _get_each(self, refs: list, doing: str) -> list:
        """ray.get of one call per actor, naming the rank whose call failed."""
        out = []
        for rank, ref in enumerate(refs, start=1):
            try:
                out.append(ray.get(ref, timeout=_STARTUP_TIMEOUT_S))
            except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError) as e:
                raise RuntimeError(f"Ray worker rank {rank} failed {doing}:\n{e}") from e
        return out

    @property
    def worker_pids(self) -> list[int]:
        return [info["pid"] for info in self.worker_info]

    # ------------------------------------------------------------------ steps
    def _send_to_workers(self, model_input) -> None:
        """Submit the step to every actor; returns at once (the refs are checked later, by _check_workers)."""
        if self._state["stopped"]:
            raise RuntimeError("this engine's Ray workers were shut down; create a new engine.")
        self._check_workers()
        for rank, actor in enumerate(self.actors, start=1):
            self._pending.append((rank, actor.execute_model.remote(model_input)))

    def _check_workers(self) -> None:
        """Non-blocking: forget the worker calls that have finished; raise RuntimeError naming the rank of any that
        failed (its actor died or its step raised)."""
        if not self._pending:
            return
        refs = [ref for _, ref in self._pending]
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        if not done:
            return
        done = set(done)
        failed: dict[int, str] = {}
        for rank, ref in self._pending:
            if ref in done and rank not in failed:
                try:
                    ray.get(ref, timeout=0)
                except Exception as e:      # RayActorError (the actor died), RayTaskError (its step raised)
                    failed[rank] = _short(e)
        self._pending[:] = [(rank, ref) for rank, ref in self._pending if ref not in done]
        if failed:
            raise WorkerFailed(f"a {self._kind} worker failed:\n{_describe(failed)}", failed)

    @property
    def _kind(self) -> str:
        return "pipeline-parallel" if self.world_size > self.tp_size else "tensor-parallel"

    def _worker_errors(self) -> dict[int, str]:
        """After a failed step: which ranks failed or died. Waits a little for their pending calls and for a ping to
        each actor (a dead actor's ping fails at once; a live one stuck in a collective never answers)."""
        if not self.actors or self._state["stopped"]:
            return {}
        calls = list(self._pending) + [(rank, a.info.remote()) for rank, a in enumerate(self.actors, start=1)]
        self._pending.clear()
        deadline = time.monotonic() + _ERROR_WAIT_S
        failed: dict[int, str] = {}
        while calls and time.monotonic() < deadline:
            done, _ = ray.wait([ref for _, ref in calls], num_returns=len(calls), timeout=0.2)
            done = set(done)
            for rank, ref in calls:
                if ref in done and rank not in failed:
                    try:
                        ray.get(ref, timeout=0)
                    except Exception as e:
                        failed[rank] = _short(e)
                        deadline = min(deadline, time.monotonic() + 1.0)    # a little longer for the others
            calls = [(rank, ref) for rank, ref in calls if ref not in done and rank not in failed]
        return failed

    def _await_logits(self, batch):
        with self._failure_guard():
            super()._await_logits(batch)
            self._check_workers()

    def execute_model(self, sched, grammar_bitmask=None):
        with self._failure_guard():
            return super().execute_model(sched, grammar_bitmask)

    @contextlib.contextmanager
    def _failure_guard(self):
        if self._state.get("in_guard"):          # execute_model -> issue -> ...: the outermost guard decides
            yield
            return
        self._state["in_guard"] = True
        try:
            yield
        except BaseException as e:
            # A rank failed or we were interrupted midway: the others may be blocked in a collective that will never
            # complete, so the group is unusable. Stop everyone.
            errors = self._worker_errors() if isinstance(e, Exception) else {}
            if isinstance(e, WorkerFailed):
                errors = {**errors, **e.errors}
            self.shutdown()
            if errors:
                raise RuntimeError(f"a {self._kind} worker failed; the engine is shut down.\n"
                                   f"{_describe(errors)}") from e
            raise
        finally:
            self._state["in_guard"] = False

    # ------------------------------------------------------------------ pipeline timelines
    def record_stage_times(self, on: bool = True) -> None:
        """As MultiprocExecutor.record_stage_times: every rank notes (batch, start, end) of its stage's work."""
        self.driver.record_stage_times, self.driver.stage_times = on, []
        for actor in self.actors:
            actor.record_stage_times.remote(on)

    def stage_times(self) -> dict[int, list[tuple[int, float, float]]]:
        """rank -> [(batch, start, end)]; waits for each actor to finish what it was sent (calls run in order)."""
        return {0: list(self.driver.stage_times)} | dict(enumerate(
            self._get_each([a.stage_times.remote() for a in self.actors], "reporting its stage times"), start=1))

    def shutdown(self) -> None:
        self._finalizer()
        self.driver.release_memory()


def _describe(errors: dict[int, str]) -> str:
    return "\n".join(f" rank {rank}: {errors[rank]}" for rank in sorted(errors))


def _short(e: BaseException) -> str:
    """A Ray error's useful part: the worker's own traceback for a task error, the reason for a dead actor."""
    if ray is not None and isinstance(e, ray.exceptions.RayTaskError):
        lines = str(e).splitlines()               # "ray::RayWorker.execute_model() (pid=.., ip=..)", its traceback
        return "\n".join(lines if len(lines) <= 12 else [*lines[:1], "    ...", *lines[-8:]])
    if ray is not None and isinstance(e, ray.exceptions.RayActorError):
        return f"its Ray actor died ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    return "".join(traceback.format_exception_only(type(e), e)).strip()
