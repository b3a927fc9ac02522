"""LLMEngine: add requests, then `step()` until none are left (vLLM v1's LLMEngine and EngineCore in one).

Owns: the request table and the step: schedule -> run the model -> sample -> update the core -> detokenize, as
one transaction. If any part raises (the plan, the forward, the sampler, the detokenizer, a Ctrl-C), the core
is rolled back to where it was before the step, the random state is restored, and the exception reaches the
caller with the step's request ids in `failed_request_ids`. The step is `execute_step`, or with batches in flight
`step_with_batch_queue`, picked once in __init__ as `step_fn`; `step()` only wraps it (Ctrl-C guard, trace).
The engine wires the scheduler, the executor and the output processor and never reaches into their internals.
"""

from __future__ import annotations

import collections
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from minivllm.config import EngineConfig
from minivllm.core.journal import SigintGuard, StepJournal
from minivllm.core.kv_cache_manager import KVCacheManager
from minivllm.core.request import Request, RequestFailedError, RequestMetrics, RequestStatus
from minivllm.core.sampling_params import SamplingParams
from minivllm.core.async_scheduler import AsyncScheduler
from minivllm.core.block_pool import BlockEvents
from minivllm.core.scheduler import Scheduler, SchedulerOutput
from minivllm.core.structured_output import StructuredOutputManager
from minivllm.engine.kv_events import make_kv_event_publisher
from minivllm.engine.trace import PipelineTrace, StepTrace, StepTracer, record_traces
from minivllm.engine.engine_stats import EngineQueues, EngineStats, QueuedRequest, RequestHistograms, engine_stats
from minivllm.engine.input_processor import InputProcessor, ProcessedRequest, PromptType
from minivllm.engine.output_processor import OutputProcessor
from minivllm.engine.parallel_sampling import ParentRequest
from minivllm.kv_transfer import make_kv_connectors
from minivllm.model.llama import ModelConfig
from minivllm.multimodal import make_multimodal
from minivllm.model.loader import check_checkpoint_files, load_tokenizer, resolve_device, resolve_model_path
from minivllm.outputs import RequestOutput
from minivllm.worker.distributed import check_tp_size, pp_layer_partition
from minivllm.worker.executor import InFlightBatch, make_executor

logger = logging.getLogger(__name__)

__all__ = ["EngineQueues", "EngineStats", "LLMEngine", "PromptType", "QueuedRequest"]


@dataclass
class _StepRecord:
    """What one committed step did: its outputs, and what its trace shows."""
    outputs: list[RequestOutput]
    issued: InFlightBatch | None            # the batch this step scheduled and sent, if any
    batch: InFlightBatch | None             # the batch whose tokens this step applied, if any came back
    pipe: tuple[InFlightBatch, ...]         # the batches in flight while it waited
    core_outputs: list
    finished: list[Request]
    events: BlockEvents

def _nothing_to_run(sched: SchedulerOutput) -> bool:
    """A plan with no request to run and no KV to copy: the step issues no batch."""
    return not (sched.scheduled or sched.blocks_to_swap_out or sched.blocks_to_swap_in)


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.model_path = resolve_model_path(config.model)
        self.model_config = ModelConfig.from_dir(self.model_path)
        check_checkpoint_files(self.model_path)
        self.device = resolve_device(config.device)
        self.tokenizer = load_tokenizer(self.model_path)
        self.max_model_len = config.max_model_len_for(self.model_config.max_position_embeddings)
        check_tp_size(self.model_config, config.tensor_parallel_size)
        pp_layer_partition(self.model_config.num_hidden_layers, config.pipeline_parallel_size)   # raises if bad
        # Rank 0's ModelRunner lives here; the executor starts the other ranks, if any (executor.py).
        self.executor = make_executor(config, self.model_path, self.model_config, self.device)
        self.model_runner = self.executor.driver
        self.journal = StepJournal()        # one undo log for the whole core (journal.py)
        self.kv_cache_manager = KVCacheManager(self.executor.num_kv_blocks, config.block_size, self.journal,
                                               config.enable_prefix_caching, self.executor.num_cpu_blocks)
        # Pipeline parallelism: up to one batch per stage in flight (vLLM v1's batch queue), oldest first.
        self.max_concurrent_batches = self.executor.max_concurrent_batches
        self.batch_queue: collections.deque[InFlightBatch] = collections.deque()
        # Async scheduling: two batches in the queue too, but each may hold every request (the next one runs
        # ahead of the one on the device, async_scheduler.py), so the scheduler plans as for one.
        self.async_scheduling = self.executor.async_scheduling
        threshold = config.long_prefill_token_threshold_on(self.device.type)
        if self.async_scheduling or self.max_concurrent_batches > 1:
            self.scheduler: Scheduler = AsyncScheduler(
                self.kv_cache_manager, config.max_num_seqs, config.max_num_batched_tokens, self.max_model_len,
                config.preemption_mode, 1 if self.async_scheduling else self.max_concurrent_batches,
                self.async_scheduling, threshold)
            self.step_fn = self.step_with_batch_queue
        else:
            self.scheduler = Scheduler(self.kv_cache_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                       self.max_model_len, config.preemption_mode, threshold)
            self.step_fn = self.execute_step
        self.scheduler.enable_chunked_prefill = config.enable_chunked_prefill
        if config.kv_transfer is not None:          # prefill/decode disaggregation: KV from or to other instances
            self.scheduler.connector, self.model_runner.kv_connector = make_kv_connectors(
                config.kv_transfer, self.model_path, self.model_runner, self.journal)
        self.input_processor = InputProcessor(self.tokenizer, self.model_config.vocab_size, self.max_model_len,
                                              self.kv_cache_manager, config.max_logprobs)
        self.input_processor.mm_processor, self.scheduler.encoder_cache_manager = make_multimodal(
            config, self.model_path, self.model_config, self.journal)      # images: (None, None) for a text model
        self.output_processor = OutputProcessor(self.tokenizer)
        self.eos_token_ids = frozenset(self.model_config.eos_token_id) | ({self.tokenizer.eos_token_id} - {None})
        self.structured_output_manager = StructuredOutputManager(self.tokenizer, self.model_config.vocab_size,
                                                                 self.eos_token_ids)
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self.num_steps = self.num_failed_steps = self.num_prompt_tokens_computed = self.num_generated_tokens = 0
        self.failed_request_ids: list[str] = []    # the requests of the last step that raised
        self.request_histograms = (None if config.disable_log_stats       # vLLM's, for /metrics
                                   else RequestHistograms.empty(self.max_model_len))
        self._scheduled_at = 0.0                   # when the step under way scheduled: first_scheduled_time
        self.trace_listeners: list[Callable[[StepTrace], None]] = []
        self._tracer = StepTracer()
        self._sigint = SigintGuard()
        self.kv_event_publisher = make_kv_event_publisher(config.kv_events_config, config.block_size)
        if self.kv_event_publisher is not None:     # KV cache events for a router (kv_events.py): a trace listener
            self.add_trace_listener(self.kv_event_publisher)

    # ------------------------------------------------------------------ requests in
    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """(text, token ids) of a prompt (InputProcessor.tokenize)."""
        return self.input_processor.tokenize(prompt)

    def validate_request(self, token_ids: list[int], params: SamplingParams, priority: int = 0) -> None:
        """ValueError, naming the value and the limit, for a request that can never run (InputProcessor)."""
        self.input_processor.validate_request(token_ids, params, priority)

    def add_request(self, prompt: PromptType | ProcessedRequest, sampling_params: SamplingParams | None = None,
                    request_id: str | None = None, priority: int = 0) -> Request | ParentRequest:
        """Check and queue a request. All or nothing: if it raises, the engine holds no trace of it. A ProcessedRequest
        (InputProcessor.process_inputs, as LLM.generate makes them) is queued without being checked again: its
        parameters and priority are its own. With `n > 1` the request fans out into n core requests
        (parallel_sampling.py); the ParentRequest returned carries the id its outputs come back under."""
        if not isinstance(prompt, ProcessedRequest):
            prompt = self.input_processor.process_inputs(prompt, sampling_params or SamplingParams(), priority)
        text, token_ids, params, priority = prompt.prompt, prompt.prompt_token_ids, prompt.params, prompt.priority
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        parent = None
        if params.n > 1:
            parent = ParentRequest(request_id, text, token_ids, params, RequestMetrics(time.time()))
        ids = [request_id] if parent is None else parent.child_ids
        if any(i in self.requests for i in ids) or request_id in self.output_processor.parents:
            raise ValueError(f"request_id {request_id!r} is already in use.")
        structured = params.structured_outputs
        reqs = [Request(rid, token_ids, params if parent is None else parent.child_params(i),
                        eos_token_ids=self.eos_token_ids, priority=priority, cache_salt=prompt.cache_salt,
                        bad_words_token_ids=prompt.bad_words_token_ids, mm_features=prompt.mm_features,
                        grammar=structured and self.structured_output_manager.grammar_for(structured))
                for i, rid in enumerate(ids)]
        added = []
        try:
            for req in reqs:                        # the only step that can refuse; nothing recorded before it
                self.scheduler.add_request(req)
                added.append(req)
        except BaseException:
            for req in added:
                self.scheduler.finish_request(req, RequestStatus.FINISHED_ABORTED)
            raise
        for i, req in enumerate(reqs):
            self.output_processor.add_request(req, text, parent, i)
            self.requests[req.request_id] = req
        return reqs[0] if parent is None else parent

    def abort_request(self, request_id: str, status=RequestStatus.FINISHED_ABORTED) -> RequestOutput | None:
        """Stop a request (or all samples of an n > 1 request) at any point and free everything it held.
        Unknown or finished ids are ignored. (`status` FINISHED_ERROR: it failed on its own, see `step`.)"""
        parent = self.output_processor.parents.get(request_id)
        ids = [request_id] if parent is None else parent.child_ids
        live = [req for rid in ids if (req := self.requests.pop(rid, None)) is not None and not req.is_finished]
        if not live:
            return None
        for req in live:
            self.scheduler.finish_request(req, status)
        return self.output_processor.abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # ------------------------------------------------------------------ the step
    def step(self, ahead: bool = True) -> list[RequestOutput]:
        """One engine iteration: an output for every request that has one (see RequestOutputKind).

        All or nothing: if anything in it raises, the core is rolled back (journal.py) and the exception is
        re-raised with the batch's requests in `failed_request_ids` (a RequestFailedError instead ends its one
        request with "error"). The step is `step_fn`, picked once in __init__ as vLLM's EngineCore does:
        `execute_step`, or `step_with_batch_queue` when batches stay in flight (pipeline stages, async scheduling).
        Here it is wrapped: Ctrl-C waits for a consistent point (journal.py SigintGuard), the trace goes to listeners.
        `ahead=False` (the server's single steps while paused): leave no batch in flight."""
        start = time.perf_counter()
        try:
            with self._sigint:
                record = self.step_fn(ahead)
        except RequestFailedError as e:         # one request's own error (rolled back): it ends, the rest go on
            logger.warning("%s; it ends with finish_reason 'error'", e)
            out = self.abort_request(self.output_processor.external_id(e.request_id), RequestStatus.FINISHED_ERROR)
            return [out] if out is not None else []
        if record is not None and self.trace_listeners:
            self._publish_trace(record, time.perf_counter() - start)
        return record.outputs if record is not None else []

    def execute_step(self, ahead: bool = True) -> _StepRecord | None:
        """The synchronous step, one transaction: schedule, run the model, sample, update the core, make the text.
        None when there was nothing to run."""
        scheduler = self.scheduler
        sched, batch, rng_state = None, None, None
        scheduler.begin_step()
        self._scheduled_at = time.time()
        try:
            sched = scheduler.schedule()
            if _nothing_to_run(sched):
                scheduler.commit_step()
                return None
            rng_state = self.model_runner.get_rng_state(sched.scheduled)     # a failed step draws again
            with self._sigint.open():               # the forward is the one place a Ctrl-C stops at once
                batch = self.executor.issue(sched, None, self._grammar_bitmask)
                sampling_reqs, tokens, logprobs = self.executor.collect(batch, self._grammar_bitmask)
            core_outputs, update = self._update_core(batch, sampling_reqs, tokens, logprobs)
            self._sigint.raise_if_held()            # the last point a held Ctrl-C can still fail the step
            scheduler.commit_step()
        except BaseException:
            self._fail_step(rng_state, batch, sched.scheduled if sched is not None else None)
            raise
        return self._finish_step(batch, batch, core_outputs, update, (batch,))

    def step_with_batch_queue(self, ahead: bool = True) -> _StepRecord | None:
        """The overlapped step (vLLM v1's batch queue), one transaction too. Schedule and issue the next batch if
        fewer than `max_concurrent_batches` are in flight; then, if the queue is full or nothing new could be issued
        (or `ahead` is False), wait for the oldest batch and apply its tokens. A failed step leaves the batches
        issued by earlier steps in flight (the one whose tokens it was applying keeps its logits, to be sampled
        again) and forgets the batch it issued itself (Scheduler.rollback_step distrusts its blocks).

        Async scheduling is this step with two batches and one stage: the next batch is issued (sampled on the
        device, its inputs read from the batch before) and then the older batch's tokens come to the host and are
        applied while the device runs the newer one. Its random state is saved before the issue, which samples."""
        scheduler, queue, runner = self.scheduler, self.batch_queue, self.model_runner
        sched, issued, batch, rng_state = None, None, None, None
        core_outputs, update = [], None
        scheduler.begin_step()
        self._scheduled_at = time.time()
        try:
            if len(queue) < self.max_concurrent_batches and (ahead or not queue):
                sched = scheduler.schedule()
                if not _nothing_to_run(sched):
                    if self.async_scheduling:
                        rng_state = runner.get_rng_state(sched.scheduled)
                    with self._sigint.open():
                        issued = self.executor.issue(sched, queue[-1] if queue and self.async_scheduling else None,
                                                     self._grammar_bitmask)
                    queue.append(issued)
                    self.journal.record(queue.pop)
            if not queue:
                scheduler.commit_step()
                return None
            pipe = tuple(queue)
            if issued is None or len(queue) == self.max_concurrent_batches or not ahead:
                batch = queue.popleft()                 # the oldest batch: wait for it, sample, update the core
                self.journal.record(lambda: queue.appendleft(batch))
                if not self.async_scheduling:           # (async: sampled when it was issued)
                    rng_state = runner.get_rng_state(batch.sched.scheduled)
                with self._sigint.open():
                    sampling_reqs, tokens, logprobs = self.executor.collect(batch, self._grammar_bitmask)
                core_outputs, update = self._update_core(batch, sampling_reqs, tokens, logprobs)
            self._sigint.raise_if_held()
            scheduler.commit_step()
        except BaseException:
            blamed = batch.sched.scheduled if batch is not None else sched.scheduled if sched is not None else None
            self._fail_step(rng_state, issued, blamed)
            raise
        return self._finish_step(issued, batch, core_outputs, update, pipe)

    # The pieces both steps share.
    def _grammar_bitmask(self, requests: list[Request], drafts: dict[str, list[int]]):
        """Structured output's seam: the allowed tokens of the rows that have a grammar (None: no row has one)."""
        if not any(req.grammar is not None for req in requests):
            return None
        return self.structured_output_manager.grammar_bitmask(requests, drafts)

    def _update_core(self, batch: InFlightBatch, sampling_reqs: list[Request], tokens: list, logprobs) -> tuple:
        """Inside the transaction: a batch's tokens go to the core, the output processor finds stop strings (and
        the core stops those requests), and the proposer drafts the next step's tokens (speculative decoding)."""
        scheduler = self.scheduler
        sampled = {req.request_id: toks for req, toks in zip(sampling_reqs, tokens)}
        core_outputs = scheduler.update_from_output(batch.sched, sampled)
        update = self.output_processor.process_outputs(core_outputs, logprobs)
        for req, stop_string, num_dropped in update.stop_strings:
            scheduler.drop_output_tokens(req, num_dropped)      # speculative tokens after the stop string
            scheduler.finish_request(req, RequestStatus.FINISHED_STOPPED, stop_string)
        scheduler.update_draft_token_ids(self.executor.propose_draft_token_ids(sampling_reqs, self.max_model_len))
        return core_outputs, update

    def _fail_step(self, rng_state, issued: InFlightBatch | None, blamed: list[Request] | None) -> None:
        """A step raised: undo the core, put back the random state, drain the batch it issued from the ranks, and name
        the requests it was working on (if the plan itself failed, what it was planning: no caller retries forever)."""
        self.scheduler.rollback_step()
        if rng_state is not None:
            self.model_runner.set_rng_state(rng_state)
        if issued is not None and not issued.received:
            try:        # wait until every stage is done with it: the pipe then holds exactly the queue's batches
                self.executor.discard(issued)
            except BaseException as e:    # the executor stopped its ranks (it says why); the step's error goes up
                logger.warning("could not drain batch %d from the pipeline: %s", issued.step_id, e)
        self.num_failed_steps += 1
        if blamed is None:
            blamed = self.scheduler.running or self.scheduler.waiting[:1]
        self.failed_request_ids = list(dict.fromkeys(   # parents' ids for n > 1; not those that ended
            self.output_processor.external_id(r.request_id) for r in blamed if not r.is_finished))

    def _finish_step(self, issued: InFlightBatch | None, batch: InFlightBatch | None, core_outputs: list,
                     update, pipe: tuple[InFlightBatch, ...]) -> _StepRecord:
        """Committed: the front end's share of the step (timestamps, the outputs, the request table, counters)."""
        now = time.time()
        if issued is not None:
            self.output_processor.mark_scheduled(issued.sched.scheduled, self._scheduled_at)
        outputs, finished = [], []
        if batch is not None:
            states = self.output_processor.states      # (a finished request's state leaves it in apply)
            ended = [states[co.request.request_id] for co in core_outputs if co.request.is_finished]
            outputs = self.output_processor.apply(update, now)
            finished = [st.request for st in ended]
            for req in finished:
                del self.requests[req.request_id]
            num_generated = sum(len(co.new_token_ids) for co in core_outputs)
            self.num_prompt_tokens_computed += batch.sched.num_prefill_tokens
            self.num_generated_tokens += num_generated
            if self.request_histograms is not None:
                self.request_histograms.observe_step(batch.sched.num_prefill_tokens + num_generated, ended)
        self.num_steps += 1
        return _StepRecord(outputs, issued, batch, pipe, core_outputs, finished,
                           self.kv_cache_manager.block_pool.pop_events())

    def _publish_trace(self, record: _StepRecord, elapsed: float) -> None:
        issued, batch = record.issued, record.batch
        accepted = {co.request.request_id: co.num_accepted_drafts for co in record.core_outputs}
        pipeline = PipelineTrace(issued.step_id if issued else None, batch.step_id if batch else None,
                                 tuple((b.step_id, tuple(r.request_id for r in b.sched.scheduled))
                                       for b in record.pipe))
        trace = self._tracer.build(self.num_steps, elapsed, issued.sched if issued else SchedulerOutput([], {}),
                                   record.events, self.scheduler, record.finished, self.output_processor.external_id,
                                   accepted, pipeline)
        for listener in self.trace_listeners:
            try:
                listener(trace)
            except Exception:       # a listener's bug must not lose the step's outputs
                logger.exception("step trace listener %r failed", listener)

    def add_trace_listener(self, listener: Callable[[StepTrace], None]) -> None:
        """Call `listener(StepTrace)` after every step (see trace.py). Costs nothing while there are none."""
        self.trace_listeners.append(listener)

    def remove_trace_listener(self, listener: Callable[[StepTrace], None]) -> None:
        self.trace_listeners.remove(listener)

    record_traces = record_traces       # `with engine.record_traces() as traces:` (trace.py)

    # ------------------------------------------------------------------ introspection
    def get_stats(self) -> EngineStats:
        """The engine's counters now (engine_stats.py), copied: what LLM.get_stats, the dashboard and /metrics read."""
        return engine_stats(self)

    def get_queues(self) -> EngineQueues:
        """The running and waiting queues, copied (O(live requests)); taken with get_stats, they agree."""
        return EngineQueues.of(self.scheduler.running, self.scheduler.waiting, self.output_processor.external_id)

    def reset_prefix_cache(self) -> bool:
        """Forget the prefix cache (vLLM's): True once done; False, with a warning and nothing changed, while any
        request holds blocks (running, or in a batch in flight). Between steps only."""
        return self.kv_cache_manager.reset_prefix_cache()

    def shutdown(self) -> None:
        """Stop the workers and connectors; safe to call twice (also at exit). No steps afterwards."""
        self.executor.shutdown()
        if self.scheduler.connector is not None:
            self.scheduler.connector.close()
        if self.kv_event_publisher is not None:
            self.kv_event_publisher.close()

    def check_integrity(self) -> None:
        """Assert the core's invariants, and that the request table, queues and output processor agree."""
        self.scheduler.check_integrity()
        ahead: dict = collections.Counter()       # request -> its tokens in the batches of the queue
        for b in self.batch_queue:
            num = b.sched.num_scheduled_tokens
            ahead.update({r: num[r.request_id] for r in b.sched.scheduled if not r.is_finished})
        assert ahead == self.scheduler.in_flight, "the requests in flight and the batches in the queue disagree"
        if not self.async_scheduling:       # only async scheduling puts a request in two batches at once
            in_queue = [r for b in self.batch_queue for r in b.sched.scheduled if not r.is_finished]
            assert len(in_queue) == len(set(in_queue)), "a request is in two batches in flight"
        live = {r.request_id for r in self.scheduler.running + self.scheduler.waiting}
        assert live == set(self.requests), f"request table {sorted(self.requests)} but queues {sorted(live)}"
        assert live == set(self.output_processor.states), "the output processor tracks other requests"
