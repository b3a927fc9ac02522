"""LLMEngine: add requests, then `step()` until none are left (vLLM's LLMEngine / EngineCore).

Owns: the request table and the loop schedule -> run model -> sample -> update the core -> detokenize, as one
transaction: if any part raises (the plan, the forward, the sampler, the detokenizer, a Ctrl-C), the scheduler rolls
the core back to where it was before the step, the sampler's random state is restored, and the exception reaches
the caller with the step's request ids in `failed_request_ids`. The scheduler decides what runs, the KV cache manager
where KV goes, the model runner computes, the output processor makes text; the engine wires them and never reaches
into their internals.

Continuous batching falls out of the loop: finished requests leave at the end of any step and
waiting ones join at the start of the next.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from minivllm.config import EngineConfig
from minivllm.core.journal import StepJournal
from minivllm.core.kv_cache_manager import KVCacheManager
from minivllm.core.request import Request, RequestMetrics, RequestStatus
from minivllm.core.sampling_params import SamplingParams
from minivllm.core.scheduler import Scheduler, SchedulerOutput
from minivllm.core.structured_output import StructuredOutputManager
from minivllm.core.trace import PipelineTrace, StepTrace, StepTracer
from minivllm.engine.output_processor import OutputProcessor
from minivllm.engine.parallel_sampling import ParentRequest
from minivllm.engine.sigint import SigintGuard
from minivllm.model.llama import ModelConfig
from minivllm.model.loader import check_checkpoint_files, load_tokenizer, resolve_device, resolve_model_path
from minivllm.outputs import RequestOutput
from minivllm.worker.distributed import check_tp_size, pp_layer_partition
from minivllm.worker.executor import InFlightBatch, make_executor

logger = logging.getLogger(__name__)

PromptType = str | dict | list


@dataclass(frozen=True)
class QueuedRequest:
    """One live request as the queues hold it: what the dashboard's queue panel lists."""
    request_id: str
    status: str                      # running | waiting | preempted | swapped (RequestStatus.value)
    priority: int                    # lower runs first
    num_prompt_tokens: int
    num_output_tokens: int
    num_preemptions: int
    parent_id: str | None = None     # n > 1: the id the caller knows; None when it is this request's own


@dataclass(frozen=True)
class EngineQueues:
    """The scheduler's two queues at one moment, in their order. One definition everywhere (the dashboard, the
    stats, /metrics): `waiting` is the waiting queue, which holds new requests and the preempted and swapped ones
    (their `status` says which); `running` holds blocks and is scheduled every step."""
    running: tuple[QueuedRequest, ...]
    waiting: tuple[QueuedRequest, ...]

    def with_status(self, status: str) -> tuple[QueuedRequest, ...]:
        return tuple(q for q in self.running + self.waiting if q.status == status)


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int                 # waiting, preempted and swapped requests: all in the waiting queue
    num_kv_blocks: int
    num_free_blocks: int
    kv_usage: float                  # fraction of blocks held by requests
    prefix_cache_hit_rate: float     # cached prompt tokens / prompt tokens looked up
    prefix_cache_hits: int           # tokens
    prefix_cache_queries: int        # tokens
    num_preemptions: int
    num_swapped: int                 # requests whose KV is in the CPU pool right now
    num_steps: int
    num_prompt_tokens_computed: int  # prefill tokens that ran through the model (recomputes included)
    num_generated_tokens: int
    num_failed_steps: int            # steps that raised and were rolled back
    num_batches_in_flight: int = 0   # pipeline parallelism: batches issued whose tokens are not applied yet
    # Speculative decoding (vLLM's spec-decode counters): verification steps of a request with drafts, draft
    # tokens verified, drafts accepted, and accepted drafts by position (0 = the first draft of a step).
    num_spec_drafts: int = 0
    num_spec_draft_tokens: int = 0
    num_spec_accepted_tokens: int = 0
    num_spec_accepted_tokens_per_pos: tuple[int, ...] = ()

    @property
    def spec_acceptance_rate(self) -> float:
        """Accepted draft tokens / draft tokens verified (0 when none were)."""
        return self.num_spec_accepted_tokens / self.num_spec_draft_tokens if self.num_spec_draft_tokens else 0.0

    @property
    def spec_mean_acceptance_length(self) -> float:
        """Tokens a request gets from one verification step: its accepted drafts plus the one the target adds."""
        return 1 + self.num_spec_accepted_tokens / self.num_spec_drafts if self.num_spec_drafts else 0.0


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.model_path = resolve_model_path(config.model)
        self.model_config = ModelConfig.from_dir(self.model_path)
        check_checkpoint_files(self.model_path)
        self.device = resolve_device(config.device)
        self.tokenizer = load_tokenizer(self.model_path)
        self.max_model_len = config.max_model_len or self.model_config.max_position_embeddings
        if self.max_model_len > self.model_config.max_position_embeddings:
            raise ValueError(f"max_model_len is {self.max_model_len}, above the model's "
                             f"max_position_embeddings of {self.model_config.max_position_embeddings}.")
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
        # ahead of the one on the device, scheduler.py), so the scheduler plans as for one.
        self.async_scheduling = self.executor.async_scheduling
        self.scheduler = Scheduler(self.kv_cache_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   self.max_model_len, config.preemption_mode,
                                   1 if self.async_scheduling else self.max_concurrent_batches,
                                   self.async_scheduling)
        self.output_processor = OutputProcessor(self.tokenizer)
        eos = set(self.model_config.eos_token_id)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        self.structured_output_manager = StructuredOutputManager(self.tokenizer, self.model_config.vocab_size,
                                                                 self.eos_token_ids)
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self.num_steps = 0
        self.num_failed_steps = 0
        self.failed_request_ids: list[str] = []    # the requests of the last step that raised
        self.num_prompt_tokens_computed = 0
        self.num_generated_tokens = 0
        self.trace_listeners: list[Callable[[StepTrace], None]] = []
        self._tracer = StepTracer()
        self._sigint = SigintGuard()

    # ------------------------------------------------------------------ requests in
    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """A prompt is a string, {"prompt_token_ids": [...]} (optionally with "prompt"), or a list of ids.
        Strings are tokenized with the tokenizer's default special tokens (a BOS where the model expects one),
        as vLLM does; chat prompts already carry theirs from the chat template (LLM.chat)."""
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            unknown = set(prompt) - {"prompt", "prompt_token_ids"}
            if unknown:
                raise ValueError(f"prompt dict has unknown key(s) {sorted(unknown)}; "
                                 "use 'prompt_token_ids' (and optionally 'prompt').")
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return self.tokenize(prompt["prompt"])
            raise ValueError("prompt dict needs 'prompt' or 'prompt_token_ids'.")
        if isinstance(prompt, (list, tuple)):
            return None, list(prompt)
        raise ValueError(f"prompt is a {type(prompt).__name__}; pass a string or "
                         "{'prompt_token_ids': [...]}.")

    def validate_request(self, token_ids: list[int], params: SamplingParams, priority: int = 0) -> None:
        """Raise ValueError, naming the value and the limit, for a request that can never run."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params is a {type(params).__name__}; pass SamplingParams.")
        if isinstance(priority, bool) or not isinstance(priority, int) or abs(priority) >= 2 ** 63:
            raise ValueError(f"priority is {priority!r} ({type(priority).__name__}); it must be an int "
                             "(lower runs first; 0 is the default).")
        n = len(token_ids)
        if n == 0:
            raise ValueError("prompt is empty (0 tokens); give at least one token.")
        vocab = self.model_config.vocab_size
        bad = [t for t in token_ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt_token_ids contains {bad[:3]}; token ids must be ints in [0, {vocab}).")
        for name, ids in (("allowed_token_ids", params.allowed_token_ids), ("logit_bias", params.logit_bias)):
            outside = [t for t in ids or () if t >= vocab]
            if outside:
                raise ValueError(f"{name} has token id(s) {outside[:3]}; token ids must be in [0, {vocab}).")
        if n >= self.max_model_len:
            raise ValueError(f"prompt has {n} tokens; max_model_len is {self.max_model_len}, which leaves no "
                             f"room for output. Shorten the prompt or raise max_model_len.")
        # The longest the sequence can get: the KV of all but the last token must fit in the whole pool.
        longest = min(n + params.max_tokens, self.max_model_len) - 1
        kv = self.kv_cache_manager
        need = kv.blocks_needed(longest)
        if need > kv.num_blocks:
            raise ValueError(
                f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) needs {need} KV blocks of "
                f"{self.config.block_size} tokens, but the whole pool has {kv.num_blocks} "
                f"blocks ({kv.num_blocks * self.config.block_size} tokens). Lower max_tokens, "
                "shorten the prompt, or raise num_kv_blocks.")

    def bad_words_token_ids(self, params: SamplingParams) -> list[list[int]]:
        """Each bad word as token ids, as vLLM tokenizes them: as written (leading spaces stripped), and with one
        leading space when that gives a different first token and as many tokens (the word inside a text)."""
        out: list[list[int]] = []
        for word in params.bad_words or []:
            out.append(self.tokenizer.encode(word.lstrip(), add_special_tokens=False))
            spaced = self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            if spaced[0] != out[-1][0] and len(spaced) == len(out[-1]):
                out.append(spaced)
        return out

    def add_request(self, prompt: PromptType, sampling_params: SamplingParams | None = None,
                    request_id: str | None = None, priority: int = 0) -> Request | ParentRequest:
        """Validate and queue a request. All or nothing: if it raises, the engine holds no trace of it.
        With `n > 1` the request fans out into n core requests (parallel_sampling.py); the ParentRequest returned
        carries the id its outputs come back under."""
        params = sampling_params or SamplingParams()
        text, token_ids = self.tokenize(prompt)
        self.validate_request(token_ids, params, priority)
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        parent = None
        if params.n > 1:
            parent = ParentRequest(request_id, text, token_ids, params, RequestMetrics(time.time()))
        ids = [request_id] if parent is None else parent.child_ids
        if any(i in self.requests for i in ids) or request_id in self.output_processor.parents:
            raise ValueError(f"request_id {request_id!r} is already in use.")
        structured = params.structured_outputs
        reqs = [Request(rid, token_ids, params if parent is None else parent.child_params(i),
                        eos_token_ids=self.eos_token_ids, priority=priority,
                        bad_words_token_ids=self.bad_words_token_ids(params),
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

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request (or all samples of an n > 1 request) at any point and free everything it held.
        Unknown or finished ids are ignored."""
        parent = self.output_processor.parents.get(request_id)
        ids = [request_id] if parent is None else parent.child_ids
        live = [req for rid in ids if (req := self.requests.pop(rid, None)) is not None and not req.is_finished]
        if not live:
            return None
        for req in live:
            self.scheduler.finish_request(req, RequestStatus.FINISHED_ABORTED)
        return self.output_processor.abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # ------------------------------------------------------------------ the step
    def step(self, ahead: bool = True) -> list[RequestOutput]:
        """One engine iteration. Returns an output for every request that has one (see RequestOutputKind).

        All or nothing: if anything in it raises, the core is rolled back (journal.py) and the exception is
        re-raised; `failed_request_ids` then lists the requests of the batch that failed.

        With one batch in flight (no pipeline stages) a step schedules a batch, runs it and applies its tokens. With
        pipeline stages it is vLLM v1's batch-queue step: schedule and issue the next batch if fewer than
        `max_concurrent_batches` are in flight; then, if the queue is full or nothing new could be scheduled, wait
        for the oldest batch and apply its tokens. A failed step leaves the batches issued by earlier steps in
        flight (the one whose tokens it was applying keeps its logits, to be sampled again) and forgets the batch it
        issued itself: its requests are scheduled again, and its blocks are not trusted (Scheduler.rollback_step).

        Async scheduling is the same step with two batches and one stage: the next batch is scheduled and issued
        (sampled on the device, its inputs read from the batch before) and then the older batch's tokens come to the
        host and are applied, while the device runs the newer one. A failed step also puts back the random state the
        batch it issued drew from.

        ahead=False (the server's single steps while paused, async_llm.py): nothing is left in flight. A step with
        batches in flight only finishes the oldest; one with none schedules a batch and waits for it, as a
        synchronous engine's step does."""
        start = time.perf_counter()
        scheduler, sampler, queue, j = self.scheduler, self.model_runner.sampler, self.batch_queue, self.journal
        sched, issued, batch, rng_state = None, None, None, None
        pipe: tuple[InFlightBatch, ...] = ()      # the batches in flight while this step waited (the trace's)
        core_outputs: list = []
        with self._sigint:                  # Ctrl-C waits for a consistent point, except in the forward (sigint.py)
            scheduler.begin_step()
            try:
                if len(queue) < self.max_concurrent_batches and (ahead or not queue):
                    sched = scheduler.schedule()
                    if not sched.is_empty:
                        prev = None
                        if self.async_scheduling:      # it samples as it is issued, reading the batch before
                            rng_state = sampler.get_rng_state(sched.scheduled)
                            prev = queue[-1] if queue else None
                        with self._sigint.open():
                            issued = self.executor.issue(sched, prev, self.structured_output_manager.grammar_bitmask)
                        queue.append(issued)
                        j.record(queue.pop)
                if not queue:
                    scheduler.commit_step()
                    return []
                pipe = tuple(queue)
                if issued is None or len(queue) == self.max_concurrent_batches or not ahead:
                    # The oldest batch's tokens: wait for its logits, sample, update the core.
                    batch = queue.popleft()
                    j.record(lambda: queue.appendleft(batch))
                    if not self.async_scheduling:      # (async: sampled when it was issued)
                        rng_state = sampler.get_rng_state(batch.sched.scheduled)
                    with self._sigint.open():
                        sampling_reqs, tokens, logprobs = self.executor.collect(
                            batch, self.structured_output_manager.grammar_bitmask)
                    sampled = {req.request_id: toks for req, toks in zip(sampling_reqs, tokens)}
                    core_outputs = scheduler.update_from_output(batch.sched, sampled)
                    update = self.output_processor.process_outputs(core_outputs, logprobs)
                    for req, stop_string, num_dropped in update.stop_strings:
                        scheduler.drop_output_tokens(req, num_dropped)      # speculative tokens after the stop string
                        scheduler.finish_request(req, RequestStatus.FINISHED_STOPPED, stop_string)
                    # Speculative decoding: the next step's drafts, from the tokens as they now stand.
                    scheduler.update_draft_token_ids(self.executor.propose_draft_token_ids(sampling_reqs,
                                                                                           self.max_model_len))
                self._sigint.raise_if_held()    # the last point a held Ctrl-C can still fail the step
                scheduler.commit_step()
            except BaseException:
                scheduler.rollback_step()
                if rng_state is not None:
                    sampler.set_rng_state(rng_state)
                if issued is not None and not issued.received:
                    self._drain(issued)
                self.num_failed_steps += 1
                if batch is not None:
                    blamed = batch.sched.scheduled
                elif sched is not None:
                    blamed = sched.scheduled
                else:   # the plan itself failed: blame what it was working on, so no caller retries forever
                    blamed = self.scheduler.running or self.scheduler.waiting[:1]
                self.failed_request_ids = list(dict.fromkeys(   # parents' ids for n > 1; not those that ended
                    self.output_processor.external_id(r.request_id) for r in blamed if not r.is_finished))
                raise
            # committed: the front end's share of the step (a Ctrl-C held until here is raised on leaving the guard)
            now = time.time()
            if issued is not None:
                self.output_processor.mark_scheduled(sched.scheduled, now)
            outputs, finished = [], []
            if batch is not None:
                outputs = self.output_processor.apply(update, now)
                finished = [co.request for co in core_outputs if co.request.is_finished]
                for req in finished:
                    del self.requests[req.request_id]
                self.num_prompt_tokens_computed += batch.sched.num_prefill_tokens
                self.num_generated_tokens += sum(len(co.new_token_ids) for co in core_outputs)
            self.num_steps += 1
            events = self.kv_cache_manager.block_pool.pop_events()
        if self.trace_listeners:
            accepted = {co.request.request_id: co.num_accepted_drafts for co in core_outputs}
            pipeline = PipelineTrace(issued.step_id if issued else None, batch.step_id if batch else None,
                                     tuple((b.step_id, tuple(r.request_id for r in b.sched.scheduled)) for b in pipe))
            trace = self._tracer.build(self.num_steps, time.perf_counter() - start,
                                       sched if issued is not None else SchedulerOutput([], {}), events,
                                       self.scheduler, finished, self.output_processor.external_id, accepted,
                                       pipeline)
            for listener in self.trace_listeners:
                try:
                    listener(trace)
                except Exception:       # a listener's bug must not lose the step's outputs
                    logger.exception("step trace listener %r failed", listener)
        return outputs

    def _drain(self, batch: InFlightBatch) -> None:
        """A rolled-back step issued `batch` into the pipe: wait until every stage is done with it and drop its logits,
        so the pipe holds exactly the batches in the queue (each stage's next message is the next one's)."""
        try:
            self.executor.discard(batch)
        except BaseException as e:    # the executor stopped its ranks (it says why); the step's own error goes up
            logger.warning("could not drain batch %d from the pipeline: %s", batch.step_id, e)

    def add_trace_listener(self, listener: Callable[[StepTrace], None]) -> None:
        """Call `listener(StepTrace)` after every step (see trace.py). Costs nothing while there are none."""
        self.trace_listeners.append(listener)

    def remove_trace_listener(self, listener: Callable[[StepTrace], None]) -> None:
        self.trace_listeners.remove(listener)

    @contextlib.contextmanager
    def record_traces(self) -> Iterator[list[StepTrace]]:
        """`with engine.record_traces() as traces:` every step inside the block appends its StepTrace."""
        traces: list[StepTrace] = []
        self.add_trace_listener(traces.append)
        try:
            yield traces
        finally:
            self.remove_trace_listener(traces.append)

    # ------------------------------------------------------------------ introspection
    def get_stats(self) -> EngineStats:
        kv = self.kv_cache_manager
        return EngineStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            num_kv_blocks=kv.num_blocks, num_free_blocks=kv.num_free_blocks, kv_usage=kv.usage,
            prefix_cache_hit_rate=kv.prefix_cache_hit_rate, prefix_cache_hits=kv.prefix_cache_hits,
            prefix_cache_queries=kv.prefix_cache_queries, num_preemptions=self.scheduler.num_preemptions,
            num_swapped=self.scheduler.num_swapped,
            num_steps=self.num_steps, num_prompt_tokens_computed=self.num_prompt_tokens_computed,
            num_generated_tokens=self.num_generated_tokens, num_failed_steps=self.num_failed_steps,
            num_batches_in_flight=len(self.batch_queue),
            num_spec_drafts=self.scheduler.num_drafts, num_spec_draft_tokens=self.scheduler.num_draft_tokens,
            num_spec_accepted_tokens=self.scheduler.num_accepted_tokens,
            num_spec_accepted_tokens_per_pos=tuple(self.scheduler.num_accepted_tokens_per_pos))

    def get_queues(self) -> EngineQueues:
        """The running and waiting queues, copied (O(live requests)); taken with get_stats, they agree."""
        def entry(r: Request) -> QueuedRequest:
            parent = self.output_processor.external_id(r.request_id)
            return QueuedRequest(r.request_id, r.status.value, r.priority, r.num_prompt_tokens, r.num_output_tokens,
                                 r.num_preemptions, parent if parent != r.request_id else None)
        return EngineQueues(tuple(map(entry, self.scheduler.running)), tuple(map(entry, self.scheduler.waiting)))

    def reset_prefix_cache(self) -> None:
        """Forget every cached-free block (vLLM's `reset_prefix_cache`). Between steps only."""
        self.kv_cache_manager.reset_prefix_cache()

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers (if any) and leave the process group. Also happens on garbage
        collection and at exit; safe to call twice. The engine cannot run steps afterwards."""
        self.executor.shutdown()

    def check_integrity(self) -> None:
        """Assert every invariant of the core (scheduler.py, kv_cache_manager.py, block_pool.py) and that the
        request table, the queues and the output processor agree."""
        self.scheduler.check_integrity()
        ahead: dict = collections.Counter()       # request -> its tokens in the batches of the queue
        for b in self.batch_queue:
            for r in b.sched.scheduled:
                if not r.is_finished:
                    ahead[r] += b.sched.num_scheduled_tokens[r.request_id]
        assert ahead == self.scheduler.in_flight, "the requests in flight and the batches in the queue disagree"
        if not self.async_scheduling:       # only async scheduling puts a request in two batches at once
            in_queue = [r for b in self.batch_queue for r in b.sched.scheduled if not r.is_finished]
            assert len(in_queue) == len(set(in_queue)), "a request is in two batches in flight"
        live = {r.request_id for r in self.scheduler.running + self.scheduler.waiting}
        assert live == set(self.requests), f"request table {sorted(self.requests)} but queues {sorted(live)}"
        assert live == set(self.output_processor.states), "the output processor tracks other requests"
