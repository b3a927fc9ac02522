"""The engine's state as plain data: its counters (EngineStats) and its two queues (EngineQueues).

Owns nothing live: LLMEngine.get_stats / get_queues copy these out, and the stats recorder, /metrics and the
dashboard read the copies, never the engine.
"""

from __future__ import annotations

from dataclasses import dataclass


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
