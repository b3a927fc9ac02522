"""The engine's state as plain data: its counters (EngineStats), its two queues (EngineQueues), and vLLM's
per-request histograms (RequestHistograms).

Owns nothing live but the histograms' counts, which only the engine's step writes (LLMEngine._finish_step):
LLMEngine.get_stats / get_queues copy these out, and the stats recorder, /metrics and the dashboard read the
copies, never the engine.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field, fields

# vLLM's bucket upper bounds (v1/metrics/loggers.py), so a vLLM Grafana board reads these histograms unchanged.
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)                    # seconds
TIME_PER_OUTPUT_TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                                 10.0, 20.0, 40.0, 80.0)                           # seconds
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)


def build_1_2_5_buckets(max_value: int) -> tuple[int, ...]:
    """vLLM's buckets for token counts: 1, 2, 5, 10, 20, 50, ... up to `max_value` (max_model_len)."""
    buckets, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return tuple(buckets)
            buckets.append(m * scale)
        scale *= 10


@dataclass
class Histogram:
    """Prometheus-style: `counts[i]` observations <= buckets[i] (not cumulative), the last one for +Inf."""
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    sum: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def copy(self) -> Histogram:
        return Histogram(self.buckets, list(self.counts), self.sum, self.count)


@dataclass
class RequestHistograms:
    r"""vLLM's histograms of finished requests and of steps (`vllm:request_queue_time_seconds`, ...; /metrics names
    them, entrypoints/metrics.py). A request is observed when a step finishes it (stop or length; not when aborted),
    from its front-end times (core/request.py RequestMetrics), as vLLM's `FinishedRequestStats`:

        arrival ---queue--- first scheduled ---prefill--- first token ---decode--- last token
                                            \_______________inference_______________/
        time per output token = decode / (output tokens - 1)   (0 for a single token)

    An n > 1 request is n requests here, as in vLLM, but its `n` is observed once, when its last sample finishes."""
    queue_time: Histogram
    prefill_time: Histogram
    decode_time: Histogram
    inference_time: Histogram
    time_per_output_token: Histogram
    prompt_tokens: Histogram
    generation_tokens: Histogram
    max_tokens: Histogram             # the request's max_tokens parameter
    n: Histogram                      # the request's n parameter
    iteration_tokens: Histogram       # per step with a batch: prefill tokens computed + tokens generated

    @classmethod
    def empty(cls, max_model_len: int) -> "RequestHistograms":
        latency, tokens = REQUEST_LATENCY_BUCKETS, build_1_2_5_buckets(max_model_len)
        return cls(Histogram(latency), Histogram(latency), Histogram(latency), Histogram(latency),
                   Histogram(TIME_PER_OUTPUT_TOKEN_BUCKETS), Histogram(tokens), Histogram(tokens), Histogram(tokens),
                   Histogram(PARAMS_N_BUCKETS), Histogram(ITERATION_TOKENS_BUCKETS))

    def observe_step(self, num_tokens: int, finished: list) -> None:
        """A step that applied a batch: its tokens, and the requests it finished (the output processor's
        RequestStates, once the step's outputs are applied: every time in their metrics is set)."""
        self.iteration_tokens.observe(num_tokens)
        parents = {}
        for st in finished:
            req, m = st.request, st.metrics
            decode = m.last_token_time - m.first_token_time
            self.queue_time.observe(m.first_scheduled_time - m.arrival_time)
            self.prefill_time.observe(m.first_token_time - m.first_scheduled_time)
            self.decode_time.observe(decode)
            self.inference_time.observe(m.last_token_time - m.first_scheduled_time)
            self.time_per_output_token.observe(decode / (req.num_output_tokens - 1) if req.num_output_tokens > 1
                                               else 0.0)
            self.prompt_tokens.observe(req.num_prompt_tokens)
            self.generation_tokens.observe(req.num_output_tokens)
            self.max_tokens.observe(req.sampling_params.max_tokens)
            if st.parent is None:
                self.n.observe(1)
            elif st.parent.is_finished:                       # its last sample: the parent's n, once
                parents[st.parent.request_id] = st.parent.n
        for n in parents.values():
            self.n.observe(n)

    def copy(self) -> "RequestHistograms":
        return RequestHistograms(*(getattr(self, f.name).copy() for f in fields(self)))


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

    @classmethod
    def of(cls, running: list, waiting: list, external_id) -> "EngineQueues":
        """The queues of core Requests, copied; `external_id(request_id)` names an n > 1 sample's parent."""
        def entry(r) -> QueuedRequest:
            parent = external_id(r.request_id)
            return QueuedRequest(r.request_id, r.status.value, r.priority, r.num_prompt_tokens, r.num_output_tokens,
                                 r.num_preemptions, parent if parent != r.request_id else None)
        return cls(tuple(map(entry, running)), tuple(map(entry, waiting)))


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
    # Images (a vision-language model's encoder cache, core/encoder_cache_manager.py): its size and rows in use
    # (kept outputs, needed or freeable), outputs kept, and images sent to the encoder so far. 0 for a text model.
    encoder_cache_size: int = 0
    encoder_cache_used: int = 0
    num_encoder_outputs_kept: int = 0
    num_encoder_inputs_scheduled: int = 0
    histograms: RequestHistograms | None = None     # vLLM's per-request and per-step histograms, copied

    @property
    def spec_acceptance_rate(self) -> float:
        """Accepted draft tokens / draft tokens verified (0 when none were)."""
        return self.num_spec_accepted_tokens / self.num_spec_draft_tokens if self.num_spec_draft_tokens else 0.0

    @property
    def spec_mean_acceptance_length(self) -> float:
        """Tokens a request gets from one verification step: its accepted drafts plus the one the target adds."""
        return 1 + self.num_spec_accepted_tokens / self.num_spec_drafts if self.num_spec_drafts else 0.0


def encoder_cache_stats(ecm) -> dict:
    """EngineStats' encoder cache fields from the scheduler's EncoderCacheManager (none for a text model)."""
    if ecm is None:
        return {}
    return dict(encoder_cache_size=ecm.cache_size, encoder_cache_used=ecm.cache_size - ecm.num_free_slots,
                num_encoder_outputs_kept=len(ecm.sizes), num_encoder_inputs_scheduled=ecm.num_encoder_inputs_scheduled)


def engine_stats(engine) -> EngineStats:
    """An LLMEngine's EngineStats: its scheduler's, KV cache's and own counters, and its histograms copied."""
    kv, sched, histograms = engine.kv_cache_manager, engine.scheduler, engine.request_histograms
    spec = sched.spec_decoding_stats
    return EngineStats(
        num_running=len(sched.running), num_waiting=len(sched.waiting), num_kv_blocks=kv.num_blocks,
        num_free_blocks=kv.num_free_blocks, kv_usage=kv.usage, prefix_cache_hit_rate=kv.prefix_cache_hit_rate,
        prefix_cache_hits=kv.prefix_cache_hits, prefix_cache_queries=kv.prefix_cache_queries,
        num_preemptions=sched.num_preemptions, num_swapped=kv.num_swapped, num_steps=engine.num_steps,
        num_prompt_tokens_computed=engine.num_prompt_tokens_computed, num_generated_tokens=engine.num_generated_tokens,
        num_failed_steps=engine.num_failed_steps, num_batches_in_flight=len(engine.batch_queue),
        num_spec_drafts=spec.num_drafts, num_spec_draft_tokens=spec.num_draft_tokens,
        num_spec_accepted_tokens=spec.num_accepted_tokens,
        num_spec_accepted_tokens_per_pos=tuple(spec.num_accepted_tokens_per_pos),
        **encoder_cache_stats(sched.encoder_cache_manager),
        histograms=None if histograms is None else histograms.copy())
