"""The Executor base class: the engine's view of the ranks (vLLM v1's `v1/executor/abstract.py`).

Owns: carrying each step to the ranks and back, in order. `issue` builds the batch on rank 0's ModelRunner (the
"driver", in the engine's process), sends its ModelInput to the other ranks and runs rank 0's share; `collect` waits
for its logits and has the driver sample them (ModelRunner.sample_tokens). It never samples, masks or scores a
logit itself, and never touches a request: what becomes of the logits is the runner's, what becomes of the tokens
the engine's. Subclasses (executor.py, ray_executor.py) decide where the other ranks live and how they stop; this
module imports neither of them.

    engine                          executor                              driver (ModelRunner, rank 0)
    issue(sched, prev, masks)  -->  prepare_inputs, send to the ranks,    execute_model(mi) -> logits
                                    (async scheduling) sample_on_device
    collect(batch, masks)      -->  receive older logits first (PP)  -->  sample_tokens(batch) -> requests, tokens,
                                                                                                   logprobs
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os

from minivllm.core.request import Request
from minivllm.core.scheduler import SchedulerOutput
from minivllm.worker.input_batch import GrammarBitmaskFn, InFlightBatch
from minivllm.worker.logprobs import StepLogprobs
from minivllm.worker.model_runner import ModelRunner


def _cpu_threads_per_rank(tp_size: int) -> int:
    """Ranks on one CPU share its cores: more threads than cores makes every collective wait."""
    return max(1, (os.cpu_count() or 1) // tp_size)


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
        driver samples this batch too (with the grammars' masks), and on a GPU this returns before any of it ran."""
        with self._failure_guard():
            batch = self._issue(sched, prev)
        if self.async_scheduling and batch.logits is not None:
            self.driver.sample_on_device(batch, grammar_bitmask)
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
        """Sample an issued batch: wait for its logits (receiving any older ones first), then the driver's
        `sample_tokens` (see execute_model). Safe to call again on the same batch after a failed step: with batches
        in flight its logits are kept intact for that.

        `grammar_bitmask(sampling_requests, drafts)` (structured output, core/structured_output.py) is called after
        the forward is issued: on a GPU the kernels are still running while the CPU fills the grammars' masks."""
        self._await_logits(batch)
        return self.driver.sample_tokens(batch, grammar_bitmask, keep_logits=self.max_concurrent_batches > 1)

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

    def propose_draft_token_ids(self, requests: list[Request], max_model_len: int) -> dict[str, list[int]]:
        """Speculative decoding: the next step's drafts for these (running, just sampled) requests, by request id
        ({} when speculation is off); the driver's proposer makes them (ModelRunner.propose_draft_token_ids)."""
        return self.driver.propose_draft_token_ids(requests, max_model_len)

    def _send_to_workers(self, model_input) -> None:
        pass

    def _allocate(self, num_kv_blocks: int) -> None:
        self.driver.allocate_kv_cache(num_kv_blocks)
        self.num_kv_blocks, self.num_cpu_blocks = num_kv_blocks, self.driver.num_cpu_blocks

    def shutdown(self) -> None:
        self.driver.release_memory()
