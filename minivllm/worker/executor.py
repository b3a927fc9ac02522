"""Executors: who runs each step's ModelInput, on how many ranks (vLLM's executor layer).

Owns: the ranks' lifecycles: start, send, collect, shut down. Rank 0's ModelRunner always lives in the engine's
process (the "driver"); it builds each step's ModelInput and samples (ModelRunner.sample_tokens). The executor gets
that input to the other ranks and makes sure they start together, agree on the KV cache size, and stop together,
leaving no process behind. It never samples: the step's carrying (issue / collect) is the base class's
(executor_base.py), the batch's data input_batch.py's; `make_executor` picks the subclass.

    UniProcExecutor           tp 1: one ModelRunner, no torch.distributed at all
    MultiprocExecutor         tp N on this machine: N - 1 spawned workers + the driver, one
                              process group (gloo on CPU, NCCL on CUDA) on a free port
    ExternalLauncherExecutor  tp N under torchrun: every rank runs the whole engine in lockstep
    RayDistributedExecutor    ranks 1.. as Ray actors in a placement group (ray_executor.py)

Under pipeline parallelism (PP stages of TP ranks each) a step is split in two, `issue` and `collect`, so that
the engine can keep up to PP batches in flight (vLLM v1's batch queue, engine/llm_engine.py):

    rank 0, stage 0:   [issue b1: stage 0] [issue b2: stage 0] [collect b1: sample] [issue b3] [collect b2] ...
    rank 1, stage 1:                       [b1: stage 1, logits -> rank 0] [b2: stage 1 ...]

Under async scheduling (one rank) `issue` also has the driver sample, on the device, without waiting
(ModelRunner.sample_on_device): the next batch's inputs read those tokens there (ModelRunner.prepare_inputs), and
`collect` only brings them to the host. On a GPU the host schedules, prepares and issues batch N + 1 and applies
batch N's tokens while the device runs:

    host:    [issue N] [schedule N+1, issue N+1] [collect N: tokens to host, update] [schedule N+2, issue N+2] ...
    device:  [forward N, sample N]     [forward N+1, sample N+1 (input: N's tokens)]  [forward N+2 ...]

MultiprocExecutor, one step with tp 3:

    driver (rank 0)                       worker 1                    worker 2
    scheduler -> prepare_inputs -> mi
    pipe.send(("execute_model", mi)) ---> pipe.recv()                 pipe.recv()
    execute_model(mi)                     execute_model(mi)           execute_model(mi)
       all-reduce in every layer  <====>     all-reduce   <========>     all-reduce
       all-gather of the logits   <====>     all-gather   <========>     all-gather
    sample_tokens(batch) -> tokens        (drops its logits)          (drops its logits)

Control messages go over multiprocessing pipes (an idle engine may wait for hours; a collective would
time out), tensors over torch.distributed. A worker's pipe closes when the driver dies, so a worker
never outlives it; the driver stops its workers on shutdown(), on garbage collection and at exit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing as mp
import os
import signal
import time
import traceback
import weakref

import torch
import torch.distributed as dist

from minivllm import envs
from minivllm.config import EngineConfig
from minivllm.worker.distributed import (destroy_distributed, get_open_port, init_distributed, launched_by_torchrun,
                                         make_groups, tp_device)
from minivllm.model.llama import ModelConfig
from minivllm.worker.executor_base import Executor, _cpu_threads_per_rank
from minivllm.worker.input_batch import InFlightBatch
from minivllm.worker.model_runner import ModelRunner

__all__ = ["Executor", "InFlightBatch", "UniProcExecutor", "MultiprocExecutor", "ExternalLauncherExecutor",
           "make_executor"]


class UniProcExecutor(Executor):
    def __init__(self, config: EngineConfig, model_path, model_cfg: ModelConfig, device: torch.device):
        super().__init__()
        self.driver = ModelRunner(config, model_path, model_cfg, device)
        self._allocate(self.driver.profile_num_blocks())
        if config.async_scheduling:          # one batch on the device while the next is scheduled
            self.async_scheduling, self.max_concurrent_batches = True, 2


def _multiproc_method() -> str:
    """fork, as vLLM does by default: workers start at once and a script needs no `if __name__ ==
    "__main__":` guard. spawn once CUDA is initialized in this process, since a forked child cannot
    use it (spawn re-imports the main module: guard your script). MINIVLLM_WORKER_MULTIPROC_METHOD overrides."""
    method = envs.MINIVLLM_WORKER_MULTIPROC_METHOD or None
    if method:
        return method
    return "spawn" if torch.cuda.is_initialized() else "fork"


def _worker_main(rank: int, tp_size: int, init_method: str, config: EngineConfig, model_path, model_cfg,
                 device: str, conn) -> None:
    """A worker rank's whole life: join the group, load its shard (its TP share of its pipeline stage's layers),
    run every step it is sent."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)     # Ctrl-C reaches the whole process group; the driver decides
    world = tp_size * config.pipeline_parallel_size
    dev = tp_device(torch.device(device), rank)
    if dev.type == "cpu":
        torch.set_num_threads(_cpu_threads_per_rank(world))
    try:
        init_distributed(rank, world, init_method, dev)
        tp, pp = make_groups(tp_size, config.pipeline_parallel_size, rank, model_cfg.num_hidden_layers)
        runner = ModelRunner(config, model_path, model_cfg, dev, tp, pp)
        conn.send(("ready", runner.profile_num_blocks()))
        while True:
            kind, payload = conn.recv()                  # EOFError once the driver is gone
            if kind == "execute_model":
                runner.execute_model(payload)
            elif kind == "allocate_kv_cache":
                runner.allocate_kv_cache(payload)
            elif kind == "record_stage_times":             # on (True) or off; the list starts empty
                runner.record_stage_times, runner.stage_times = payload, []
            elif kind == "stage_times":
                conn.send(("stage_times", runner.stage_times))
            elif kind == "shutdown":
                break
    except EOFError:
        pass
    except BaseException:
        try:
            conn.send(("error", traceback.format_exc()))
        except OSError:
            pass
    finally:
        destroy_distributed()
        conn.close()


def _stop_workers(procs: list, conns: list, polite: list[bool], saved_threads: int | None) -> None:
    """Ask the workers to exit, then terminate and kill whoever is left. Safe to call twice."""
    for conn in conns:
        if polite[0]:
            try:
                conn.send(("shutdown", None))
            except OSError:
                pass
    deadline = time.monotonic() + (5.0 if polite[0] else 0.0)
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()                     # a worker stuck in a collective whose partner is gone
    for p in procs:
        p.join(2.0)
        if p.is_alive():
            p.kill()
            p.join()
    for conn in conns:
        conn.close()
    procs.clear()
    conns.clear()
    destroy_distributed()
    if saved_threads is not None:
        torch.set_num_threads(saved_threads)


class MultiprocExecutor(Executor):
    def __init__(self, config: EngineConfig, model_path, model_cfg: ModelConfig, device: torch.device):
        super().__init__()
        tp_size, pp_size = config.tensor_parallel_size, config.pipeline_parallel_size
        world = tp_size * pp_size                  # rank = pipeline stage x tp_size + TP rank; rank 0 drives
        if device.type == "cuda" and world > torch.cuda.device_count():
            raise ValueError(f"tensor_parallel_size x pipeline_parallel_size is {world} but this machine has "
                             f"{torch.cuda.device_count()} GPU(s); lower them or launch across machines with torchrun.")
        self.tp_size = tp_size
        self.world_size = world
        self.procs: list = []
        self.conns: list = []
        self._polite = [True]        # False once a step broke midway: workers may be stuck in a collective
        saved_threads = None
        if device.type == "cpu" and world > 1:
            saved_threads = torch.get_num_threads()
            torch.set_num_threads(_cpu_threads_per_rank(world))
        self._finalizer = weakref.finalize(self, _stop_workers, self.procs, self.conns, self._polite, saved_threads)
        init_method = f"tcp://127.0.0.1:{get_open_port()}"
        ctx = mp.get_context(_multiproc_method())
        try:
            for rank in range(1, world):
                parent, child = ctx.Pipe()
                p = ctx.Process(target=_worker_main, name=f"minivllm-worker-{rank}", daemon=True,
                                args=(rank, tp_size, init_method, config, model_path, model_cfg, str(device), child))
                p.start()
                child.close()
                self.procs.append(p)
                self.conns.append(parent)
            init_distributed(0, world, init_method, tp_device(device, 0))
            tp, pp = make_groups(tp_size, pp_size, 0, model_cfg.num_hidden_layers)
            self.driver = ModelRunner(config, model_path, model_cfg, tp_device(device, 0), tp, pp)
            sizes = [self.driver.profile_num_blocks()] + [self._receive(rank, "ready") for rank in range(1, world)]
            self.num_kv_blocks_per_rank = sizes        # under PP each stage has its own layers' worth
            num_blocks = min(sizes)           # every rank must have every block id
            for conn in self.conns:
                conn.send(("allocate_kv_cache", num_blocks))
            self._allocate(num_blocks)
            # Under PP, rank 0 is free once it has run stage 0: one batch per stage can be in flight.
            self.max_concurrent_batches = config.max_concurrent_batches or pp_size
        except BaseException:
            self._polite[0] = False
            self.shutdown()
            raise

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def _receive(self, rank: int, expected: str):
        """Wait for a worker's message, noticing if it failed or died instead."""
        conn, proc = self.conns[rank - 1], self.procs[rank - 1]
        while not conn.poll(0.1):
            if not proc.is_alive():
                raise RuntimeError(f"tensor-parallel worker rank {rank} exited (code {proc.exitcode}) "
                                   "while starting; see its output above.")
        kind, payload = conn.recv()
        if kind == "error":
            raise RuntimeError(f"tensor-parallel worker rank {rank} failed:\n{payload}")
        assert kind == expected, (kind, expected)
        return payload

    def record_stage_times(self, on: bool = True) -> None:
        """Pipeline parallelism: every rank notes (batch, start, end) of its stage's work on each batch from now on
        (wall-clock seconds; the ranks share this machine's clock). Read them with `stage_times()`."""
        self.driver.record_stage_times, self.driver.stage_times = on, []
        for conn in self.conns:
            conn.send(("record_stage_times", on))

    def stage_times(self) -> dict[int, list[tuple[int, float, float]]]:
        """rank -> [(batch, start, end)] since `record_stage_times()`; waits for each rank to finish what it was sent."""
        for conn in self.conns:
            conn.send(("stage_times", None))
        return {0: list(self.driver.stage_times)} | {rank: self._receive(rank, "stage_times")
                                                      for rank in range(1, self.world_size)}

    def _worker_errors(self) -> str:
        msgs = []
        for rank, (conn, proc) in enumerate(zip(self.conns, self.procs), start=1):
            try:
                if conn.poll(0.5):
                    kind, payload = conn.recv()
                    if kind == "error":
                        msgs.append(f"rank {rank}:\n{payload}")
                        continue
            except (OSError, EOFError):
                pass
            proc.join(0.5)
            if not proc.is_alive():
                msgs.append(f"rank {rank} exited with code {proc.exitcode}")
        return "\n".join(msgs)

    def _send_to_workers(self, model_input) -> None:
        if not self.procs and self.world_size > 1:
            raise RuntimeError("this engine's tensor-parallel workers were shut down; create a new engine.")
        for conn in self.conns:
            conn.send(("execute_model", model_input))

    @contextlib.contextmanager
    def _failure_guard(self):
        try:
            yield
        except BaseException as e:
            # A rank failed or we were interrupted midway: the others may be blocked in a collective
            # that will never complete, so the group is unusable. Stop everyone.
            errors = self._worker_errors() if isinstance(e, Exception) else ""
            self._polite[0] = False
            self.shutdown()
            if errors:
                kind = "pipeline-parallel" if self.world_size > self.tp_size else "tensor-parallel"
                raise RuntimeError(f"a {kind} worker failed; the engine is shut down.\n{errors}") from e
            raise

    def shutdown(self) -> None:
        self._finalizer()
        self.driver.release_memory()


class ExternalLauncherExecutor(Executor):
    """Under torchrun every rank runs the same program: the same prompts, the same scheduling and the
    same sampling (the gathered logits, broadcast from the last pipeline stage, and the seeds are identical),
    so no step inputs are sent at all; each rank just runs its share of every layer. Print from RANK 0 only."""

    def __init__(self, config: EngineConfig, model_path, model_cfg: ModelConfig, device: torch.device):
        super().__init__()
        if not launched_by_torchrun():
            raise ValueError("distributed_executor_backend 'external_launcher' needs RANK, WORLD_SIZE, "
                             "MASTER_ADDR and MASTER_PORT in the environment: start the program with torchrun.")
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        tp_size, pp_size = config.tensor_parallel_size, config.pipeline_parallel_size
        if world != tp_size * pp_size:
            raise ValueError(f"torchrun started {world} processes but tensor_parallel_size x pipeline_parallel_size "
                             f"is {tp_size * pp_size}; they must be equal (--nproc-per-node x --nnodes).")
        if (config.max_concurrent_batches or 1) > 1:
            raise ValueError(f"max_concurrent_batches is {config.max_concurrent_batches}, but under torchrun every rank "
                             "runs the engine in lockstep with one batch in flight; leave it unset (use "
                             "distributed_executor_backend 'mp' or 'ray' on one machine for batches in flight).")
        spec = config.speculative
        if spec is not None and spec.method == "draft_model" and world > 1:
            raise ValueError("speculative_config method 'draft_model' under torchrun is not implemented (every "
                             "rank would need the draft); use 'ngram'.")
        self.rank = rank
        dev = tp_device(device, int(os.environ.get("LOCAL_RANK", 0)))
        init_distributed(rank, world, "env://", dev)
        tp, pp = make_groups(tp_size, pp_size, rank, model_cfg.num_hidden_layers)
        # Every rank samples (in lockstep), so under PP the last stage sends the logits to every rank.
        pp = dataclasses.replace(pp, broadcast_logits=True)
        self.driver = ModelRunner(config, model_path, model_cfg, dev, tp, pp)
        n = torch.tensor([self.driver.profile_num_blocks()], device=dev)
        dist.all_reduce(n, op=dist.ReduceOp.MIN)
        self._allocate(int(n.item()))

    def shutdown(self) -> None:
        destroy_distributed()
        self.driver.release_memory()


def make_executor(config: EngineConfig, model_path, model_cfg: ModelConfig, device: torch.device) -> Executor:
    if config.data_parallel_size > 1:
        raise ValueError(f"data_parallel_size is {config.data_parallel_size}, but one engine is one replica: serve "
                         "replicas with `python app.py --data-parallel-size N` (entrypoints/dp_router.py), or run one "
                         "LLM per process with data_parallel_size 1.")
    config = dataclasses.replace(config, async_scheduling=config.async_scheduling_on(device.type))   # None decided
    backend = config.distributed_executor_backend
    world = config.tensor_parallel_size * config.pipeline_parallel_size
    if backend == "auto":
        if world == 1:
            backend = "uni"
        else:
            backend = "external_launcher" if launched_by_torchrun() else "mp"
    if backend == "uni":
        if world != 1:
            raise ValueError(f"distributed_executor_backend 'uni' runs one rank, but tensor_parallel_size is "
                             f"{config.tensor_parallel_size} and pipeline_parallel_size {config.pipeline_parallel_size}"
                             f" ({world} ranks); use 'mp' or 'auto'.")
        return UniProcExecutor(config, model_path, model_cfg, device)
    if config.async_scheduling:
        raise ValueError(f"async_scheduling runs in one process; distributed_executor_backend {backend!r} starts "
                         "ranks elsewhere. Use 'uni' or 'auto' with one rank, or turn async_scheduling off.")
    if backend == "mp":
        return MultiprocExecutor(config, model_path, model_cfg, device)
    if backend == "ray":
        from minivllm.worker.ray_executor import RayDistributedExecutor     # Ray is imported only when asked for
        return RayDistributedExecutor(config, model_path, model_cfg, device)
    return ExternalLauncherExecutor(config, model_path, model_cfg, device)
