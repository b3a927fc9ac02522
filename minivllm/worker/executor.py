"""Executors: who runs each step's ModelInput, on how many ranks (vLLM's executor layer).

Owns: the ranks' lifecycles. Rank 0's ModelRunner always lives in the engine's process (the "driver");
it builds each step's ModelInput and samples. The executor gets that input to the other ranks and
makes sure they start together, agree on the KV cache size, and stop together, leaving no process behind.

    UniProcExecutor           tp 1: one ModelRunner, no torch.distributed at all
    MultiprocExecutor         tp N on this machine: N - 1 spawned workers + the driver, one
                              process group (gloo on CPU, NCCL on CUDA) on a free port
    ExternalLauncherExecutor  tp N under torchrun: every rank runs the whole engine in lockstep
    RayDistributedExecutor    ranks 1.. as Ray actors in a placement group (ray_executor.py)

Under pipeline parallelism (PP stages of TP ranks each) a step is split in two, `issue` and `collect`, so that
the engine can keep up to PP batches in flight (vLLM v1's batch queue, engine/llm_engine.py):

    rank 0, stage 0:   [issue b1: stage 0] [issue b2: stage 0] [collect b1: sample] [issue b3] [collect b2] ...
    rank 1, stage 1:                       [b1: stage 1, logits -> rank 0] [b2: stage 1 ...]

Under async scheduling (one rank) `issue` also samples, on the device, without waiting: the next batch's inputs
read those tokens there (ModelRunner.prepare_inputs), and `collect` only brings them to the host. On a GPU the
host schedules, prepares and issues batch N + 1 and applies batch N's tokens while the device runs:

    host:    [issue N] [schedule N+1, issue N+1] [collect N: tokens to host, update] [schedule N+2, issue N+2] ...
    device:  [forward N, sample N]     [forward N+1, sample N+1 (input: N's tokens)]  [forward N+2 ...]

MultiprocExecutor, one step with tp 3:

    driver (rank 0)                       worker 1                    worker 2
    scheduler -> prepare_inputs -> mi
    pipe.send(("execute_model", mi)) ---> pipe.recv()                 pipe.recv()
    execute_model(mi)                     execute_model(mi)           execute_model(mi)
       all-reduce in every layer  <====>     all-reduce   <========>     all-reduce
       all-gather of the logits   <====>     all-gather   <========>     all-gather
    sampler(logits) -> tokens             (drops its logits)          (drops its logits)

Control messages go over multiprocessing pipes (an idle engine may wait for hours; a collective would
time out), tensors over torch.distributed. A worker's pipe closes when the driver dies, so a worker
never outlives it; the driver stops its workers on shutdown(), on garbage collection and at exit.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import multiprocessing as mp
import os
import signal
import time
import traceback
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from minivllm.config import EngineConfig
from minivllm.worker.distributed import (destroy_distributed, get_open_port, init_distributed, launched_by_torchrun,
                                         make_groups, tp_device)
from minivllm.model.layers import TPGroup
from minivllm.model.llama import ModelConfig
from minivllm.worker.logprobs import (RowScores, StepLogprobs, compute_logprobs, compute_prompt_logprobs, prompt_targets,
                                      score_rows, split_by_span, unpack_scores)
from minivllm.worker.model_runner import ModelInput, ModelRunner
from minivllm.worker.sampler import apply_grammar_bitmask
from minivllm.core.request import Request
from minivllm.core.scheduler import SchedulerOutput

GrammarBitmaskFn = Callable[[list[Request], dict[str, list[int]]], "torch.Tensor | None"]


@dataclass
class InFlightBatch:
    """A batch sent into the ranks whose output has not been used yet (vLLM v1's batch queue holds these).

    Its logits arrive once (`Executor.collect` receives them in the order the batches went in) and are kept, so a
    step that fails after receiving them and is rolled back can sample them again."""
    step_id: int
    sched: SchedulerOutput
    model_input: ModelInput
    sampling_requests: list[Request]            # row order
    logits: torch.Tensor | None = None          # (sampling rows, vocab) fp32, once received
    prompt_logits: torch.Tensor | None = None   # (prompt-logprob rows, vocab) fp32, once received
    received: bool = False
    sampled: torch.Tensor | None = None         # async scheduling: (sampling rows,) int64 tokens, on the device
    logprobs_ahead: LogprobsAhead | None = None     # ... and the logprobs asked for, scored there too
    host: list[torch.Tensor] | None = None      # ... both copied to the host (pinned): [sampled, *scores' tensors]
    ready: "torch.cuda.Event | None" = None     # ... recorded right after that copy (None on a CPU: nothing to wait)


@dataclass
class LogprobsAhead:
    """Async scheduling: a batch's logprobs, scored on the device when it was sampled (`Executor.issue`), so that
    reading them waits for that batch alone, as reading its tokens does."""
    rows: list[int]                   # rows of sampling_requests that asked for logprobs
    num_logprobs: list[int]           # ... and their k
    sample: RowScores | None          # their scores, or None if no row asked
    prompt_tokens: list[int]          # the prompt tokens scored by the batch's prompt-logprob rows
    prompt_ks: list[int]
    prompt: RowScores | None          # their scores, or None if the batch has no prompt-logprob rows

    def tensors(self) -> list[torch.Tensor]:
        return [t for s in (self.sample, self.prompt) if s is not None for t in s.tensors()]

    def with_tensors(self, tensors: list[torch.Tensor]) -> "LogprobsAhead":
        """The same scores read from `tensors` (the host's copies, in tensors()' order)."""
        it = iter(tensors)
        sample = RowScores(*(next(it) for _ in range(4))) if self.sample is not None else None
        prompt = RowScores(*(next(it) for _ in range(4))) if self.prompt is not None else None
        return dataclasses.replace(self, sample=sample, prompt=prompt)


class Executor:
    """The engine's view of the ranks: `issue(sched)` sends a batch in, `collect(batch)` -> (sampling requests,
    tokens, logprobs); `execute_model(sched)` does both at once."""

    driver: ModelRunner          # rank 0's runner, in this process
    num_kv_blocks: int           # the same on every rank
    num_cpu_blocks: int
    max_concurrent_batches: int = 1     # batches that may be in flight at once (pipeline stages; see issue())
    async_scheduling: bool = False      # issue() samples on the device; the next batch reads those tokens there

    def __init__(self) -> None:
        self._next_step_id = 0
        # Issued batches whose logits have not arrived, oldest first. A batch whose step was rolled back stays here
        # until its logits are received and dropped: the pipe returns batches in the order they went in.
        self._unreceived: collections.deque[InFlightBatch] = collections.deque()

    def execute_model(self, sched: SchedulerOutput, grammar_bitmask: GrammarBitmaskFn | None = None
                      ) -> tuple[list[Request], list[list[int]], StepLogprobs | None]:
        """The requests that sample this step, their new tokens (one each, or with speculative decoding the accepted
        drafts and one more), and (when any request asked for sample or prompt logprobs) the step's logprobs by
        request id (logprobs.py)."""
        return self.collect(self.issue(sched, None, grammar_bitmask), grammar_bitmask)

    @property
    def pipelined(self) -> bool:
        """Pipeline stages whose logits come back to rank 0 later: rank 0 runs stage 0 of a batch and is free."""
        return self.driver.pp.size > 1 and not self.driver.pp.broadcast_logits

    def issue(self, sched: SchedulerOutput, prev: InFlightBatch | None = None,
              grammar_bitmask: GrammarBitmaskFn | None = None) -> InFlightBatch:
        """Send one batch into the ranks. With pipeline stages this returns once rank 0 has run stage 0 and passed
        the hidden states on: the later stages work on it while the engine schedules and issues the next batch
        (up to `max_concurrent_batches` at once). Otherwise the whole forward is done here.

        Async scheduling: `prev` is the batch still in flight, whose sampled tokens are inputs of this one; the
        batch is sampled here too (with the grammars' masks), and on a GPU this returns before any of it ran."""
        with self._failure_guard():
            batch = self._issue(sched, prev)
        if self.async_scheduling and batch.logits is not None:
            logits = batch.logits
            if grammar_bitmask is not None:
                bitmask = grammar_bitmask(batch.sampling_requests, {})          # (rows, vocab / 32)
                if bitmask is not None:
                    logits = apply_grammar_bitmask(logits, bitmask)
            batch.sampled = self.driver.sampler.sample(logits, batch.sampling_requests)
            batch.logprobs_ahead = self._score_ahead(batch, logits)
            extra = batch.logprobs_ahead.tensors() if batch.logprobs_ahead is not None else []
            batch.host, batch.ready = _copy_to_host([batch.sampled] + extra)
        return batch

    def _failure_guard(self) -> contextlib.AbstractContextManager:
        """Around the ranks' share of a step (issue, and waiting for logits). Executors with workers stop them all
        when it raises: a rank may be stuck in a collective whose partner is gone."""
        return contextlib.nullcontext()

    def _issue(self, sched: SchedulerOutput, prev: InFlightBatch | None = None) -> InFlightBatch:
        if self.driver.model is None:
            raise RuntimeError("this engine was shut down (LLM.shutdown() or the end of its with-block) and gave "
                               "its weights and KV cache back; create a new LLM.")
        if prev is None:          # (the plain call stays plain: lessons and tests hook these two with one argument)
            model_input, sampling_requests = self.driver.prepare_inputs(sched)
        else:                     # async scheduling: where each request's row is in the batch in flight
            prev_rows = {r.request_id: i for i, r in enumerate(prev.sampling_requests)}
            model_input, sampling_requests = self.driver.prepare_inputs(sched, prev_rows)
        self._next_step_id += 1
        model_input = dataclasses.replace(model_input, step_id=self._next_step_id)
        batch = InFlightBatch(self._next_step_id, sched, model_input, sampling_requests)
        self._send_to_workers(model_input)
        # (sample rows, vocab), (prompt rows, vocab); async scheduling: some inputs are the previous batch's tokens
        logits, prompt_logits = (self.driver.execute_model(model_input, prev.sampled) if model_input.prev_token_rows
                                 else self.driver.execute_model(model_input))
        if self.pipelined:
            self._unreceived.append(batch)
        else:
            batch.logits, batch.prompt_logits, batch.received = logits, prompt_logits, True
        if self.driver.proposer is not None:
            self.driver.proposer.observe(model_input)      # a draft model runs the same batch (spec_decode/)
        return batch

    def collect(self, batch: InFlightBatch, grammar_bitmask: GrammarBitmaskFn | None = None
                ) -> tuple[list[Request], list[list[int]], StepLogprobs | None]:
        """Sample an issued batch: wait for its logits (receiving any older ones first), apply the grammars' masks and
        sample (see execute_model). Safe to call again on the same batch after a failed step.

        `grammar_bitmask(sampling_requests, drafts)` (structured output, core/structured_output.py) is called after
        the forward is issued: on a GPU the kernels are still running while the CPU fills the grammars' masks."""
        self._await_logits(batch)
        sched, sampling_requests = batch.sched, batch.sampling_requests
        drafts = [sched.scheduled_spec_decode_tokens.get(r.request_id, []) for r in sampling_requests]
        logits = batch.logits
        if batch.sampled is not None:           # async scheduling: sampled when issued; now to the host (waits)
            if batch.ready is not None:
                batch.ready.synchronize()       # for this batch's tokens only, not for the batch issued after it
            tokens = batch.host[0].tolist()
            logprobs = self._logprobs_ahead(batch, tokens)
            keep = [i for i, r in enumerate(sampling_requests) if not r.is_finished]   # stopped or aborted since:
            sampling_requests, tokens = [sampling_requests[i] for i in keep], [[tokens[i]] for i in keep]  # dropped
            return sampling_requests, tokens, logprobs
        if any(r.is_finished for r in sampling_requests):       # aborted while the batch was in flight: drop its rows
            first_row = [0]
            for d in drafts:
                first_row.append(first_row[-1] + len(d) + 1)
            keep = [i for i, r in enumerate(sampling_requests) if not r.is_finished]
            logits = logits[[row for i in keep for row in range(first_row[i], first_row[i + 1])]]
            sampling_requests, drafts = [sampling_requests[i] for i in keep], [drafts[i] for i in keep]
        elif logits is not None and self.max_concurrent_batches > 1:
            logits = logits.clone()             # kept intact for a retry: the masks and the sampler write in place
        if grammar_bitmask is not None and sampling_requests:
            bitmask = grammar_bitmask(sampling_requests, sched.scheduled_spec_decode_tokens)   # (rows, vocab / 32)
            if bitmask is not None:
                logits = apply_grammar_bitmask(logits, bitmask)
        tokens = self._sample(logits, sampling_requests, drafts) if sampling_requests else []
        return sampling_requests, tokens, self._logprobs(sched, batch.model_input, sampling_requests, drafts, tokens,
                                                         logits, batch.prompt_logits)

    @staticmethod
    def _score_ahead(batch: InFlightBatch, logits: torch.Tensor) -> LogprobsAhead | None:
        """Async scheduling: score the batch's logprobs on the device right after it is sampled (no host sync), from
        the logits it sampled (grammar masks applied, as the synchronous path scores). None if nobody asked."""
        requests, spans = batch.sampling_requests, batch.model_input.prompt_logprob_spans
        asked = [r.sampling_params.logprobs for r in requests]
        rows = [i for i, k in enumerate(asked) if k is not None]
        if not rows and not spans:
            return None
        sample = None
        if rows:
            index = torch.tensor(rows).to(logits.device, non_blocking=True)     # (no sync)
            sample = score_rows(logits[index], batch.sampled[index], max(asked[i] for i in rows))
        prompt_tokens, prompt_ks, prompt = [], [], None
        if spans:
            reqs = {r.request_id: r for r in batch.sched.scheduled}
            prompt_tokens, prompt_ks = prompt_targets(
                spans, [reqs[s.request_id].prompt_token_ids for s in spans],
                [reqs[s.request_id].sampling_params.prompt_logprobs for s in spans])
            targets = torch.tensor(prompt_tokens).to(logits.device, non_blocking=True)         # (prompt rows,)
            prompt = score_rows(batch.prompt_logits, targets, max(prompt_ks))
        return LogprobsAhead(rows, [asked[i] for i in rows], sample, prompt_tokens, prompt_ks, prompt)

    @staticmethod
    def _logprobs_ahead(batch: InFlightBatch, tokens: list[int]) -> StepLogprobs | None:
        """The StepLogprobs of a batch scored when it was sampled, read from the host's copies. `tokens`: the batch's
        sampled tokens, by row. Requests that finished since it was issued get none."""
        ahead = batch.logprobs_ahead
        if ahead is None:
            return None
        ahead = ahead.with_tensors(batch.host[1:])
        requests = batch.sampling_requests
        sample = {}
        if ahead.sample is not None:
            scored = unpack_scores(ahead.sample, [tokens[i] for i in ahead.rows], ahead.num_logprobs)
            sample = {requests[i].request_id: [lp] for i, lp in zip(ahead.rows, scored)
                      if not requests[i].is_finished}
        prompt = {}
        if ahead.prompt is not None:
            prompt = split_by_span(batch.model_input.prompt_logprob_spans,
                                   unpack_scores(ahead.prompt, ahead.prompt_tokens, ahead.prompt_ks))
        return StepLogprobs(sample, prompt)

    def discard(self, batch: InFlightBatch) -> None:
        """An issued batch nobody will sample (its step was rolled back): wait for its logits and drop them."""
        self._await_logits(batch)
        batch.logits = batch.prompt_logits = None

    def _await_logits(self, batch: InFlightBatch) -> None:
        """Wait until the batch's logits are here, receiving those of older batches first."""
        with self._failure_guard():
            while not batch.received:
                older = self._unreceived.popleft()
                older.logits, older.prompt_logits = self.driver.receive_logits(older.model_input)
                older.received = True

    def _sample(self, logits: torch.Tensor, requests: list[Request], drafts: list[list[int]]) -> list[list[int]]:
        """Plain rows through the sampler, rows with drafts through the rejection sampler."""
        sampler = self.driver.sampler
        if not any(drafts):
            return [[t] for t in sampler(logits, requests)]
        first_row = [0]
        for d in drafts:
            first_row.append(first_row[-1] + len(d) + 1)
        plain = [i for i, d in enumerate(drafts) if not d]
        spec = [i for i, d in enumerate(drafts) if d]
        out: list[list[int]] = [[] for _ in requests]
        if plain:
            for i, t in zip(plain, sampler(logits[[first_row[i] for i in plain]], [requests[i] for i in plain])):
                out[i] = [t]
        rows = [r for i in spec for r in range(first_row[i], first_row[i + 1])]
        for i, kept in zip(spec, self.driver.rejection_sampler(logits[rows], [requests[i] for i in spec],
                                                               [drafts[i] for i in spec])):
            out[i] = kept
        return out

    @staticmethod
    def _logprobs(sched: SchedulerOutput, model_input, sampling_requests: list[Request], drafts: list[list[int]],
                  tokens: list[list[int]], logits: torch.Tensor | None, prompt_logits: torch.Tensor | None
                  ) -> StepLogprobs | None:
        """The new tokens' logprobs (requests with `logprobs`; a kept token is scored on the row that chose it) and
        this step's prompt-logprob chunks (requests with `prompt_logprobs`), by request id; None, at no cost, when
        no request asked for either."""
        asked = [r.sampling_params.logprobs for r in sampling_requests]
        spans = model_input.prompt_logprob_spans
        if not spans and all(k is None for k in asked):
            return None                                  # nobody asked: nothing computed
        sample = {}
        if any(k is not None for k in asked):
            rows, row_tokens, row_k, owners = [], [], [], []
            first = 0
            for req, d, kept, k in zip(sampling_requests, drafts, tokens, asked):
                if k is not None:
                    rows += range(first, first + len(kept))
                    row_tokens += kept
                    row_k += [k] * len(kept)
                    owners += [req.request_id] * len(kept)
                first += len(d) + 1
            for rid, lp in zip(owners, compute_logprobs(logits[rows], row_tokens, row_k)):
                sample.setdefault(rid, []).append(lp)
        prompt = {}
        if spans:
            reqs = {r.request_id: r for r in sched.scheduled}
            prompt = compute_prompt_logprobs(prompt_logits, spans,
                                             [reqs[s.request_id].prompt_token_ids for s in spans],
                                             [reqs[s.request_id].sampling_params.prompt_logprobs for s in spans])
        return StepLogprobs(sample, prompt)

    def propose_draft_token_ids(self, requests: list[Request], max_model_len: int) -> dict[str, list[int]]:
        """Speculative decoding: the next step's drafts for these (running, just sampled) requests, from the
        driver's proposer; {} when speculation is off. A request gets at most the tokens it may still generate
        less one (the step that verifies k drafts makes up to k + 1), and none if its logits processing depends
        on the tokens before it (penalties, bad_words, min_tokens): the rejection sampler does not replay that."""
        proposer = self.driver.proposer
        if proposer is None:
            return {}
        asking, room = [], []
        for req in requests:
            sp = req.sampling_params
            if req.is_finished or sp.uses_logits_processing:
                continue
            r = min(sp.max_tokens - req.num_output_tokens, max_model_len - req.num_tokens) - 1
            if r > 0:
                asking.append(req)
                room.append(r)
        return {req.request_id: tokens for req, tokens in zip(asking, proposer.propose_batch(asking, room))
                if tokens}

    def _send_to_workers(self, model_input) -> None:
        pass

    def _allocate(self, num_kv_blocks: int) -> None:
        self.driver.allocate_kv_cache(num_kv_blocks)
        self.num_kv_blocks, self.num_cpu_blocks = num_kv_blocks, self.driver.num_cpu_blocks

    def shutdown(self) -> None:
        self.driver.release_memory()


def _copy_to_host(tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], "torch.cuda.Event | None"]:
    """Start copying a batch's sampled tokens (and scores) to the host without waiting: (pinned host tensors, the
    event recorded after the copies) on a GPU, (the tensors themselves, None) on a CPU. The copies are queued right
    behind the sampling and ahead of the next batch's forward, so waiting for the event waits for this batch alone;
    `tokens.tolist()` would wait for everything queued on the stream by then, the next batch's forward included
    (vLLM copies on a stream of its own for the same reason)."""
    if not tensors or tensors[0].device.type != "cuda":
        return tensors, None
    hosts = []
    for t in tensors:
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        hosts.append(host)
    ready = torch.cuda.Event()
    ready.record()
    return hosts, ready


class UniProcExecutor(Executor):
    def __init__(self, config: EngineConfig, model_path, model_cfg: ModelConfig, device: torch.device):
        super().__init__()
        self.driver = ModelRunner(config, model_path, model_cfg, device)
        self._allocate(self.driver.profile_num_blocks())
        if config.async_scheduling:          # one batch on the device while the next is scheduled
            self.async_scheduling, self.max_concurrent_batches = True, 2


def _cpu_threads_per_rank(tp_size: int) -> int:
    """Ranks on one CPU share its cores: more threads than cores makes every collective wait."""
    return max(1, (os.cpu_count() or 1) // tp_size)


def _multiproc_method() -> str:
    """fork, as vLLM does by default: workers start at once and a script needs no `if __name__ ==
    "__main__":` guard. spawn once CUDA is initialized in this process, since a forked child cannot
    use it (spawn re-imports the main module: guard your script). MINIVLLM_WORKER_MULTIPROC_METHOD overrides."""
    method = os.environ.get("MINIVLLM_WORKER_MULTIPROC_METHOD")
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
