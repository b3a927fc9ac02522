"""What the scheduler hands on: a step's plan (`SchedulerOutput`) and one request's result (`EngineCoreOutput`).

Plain data, no methods (vLLM v1's `v1/core/sched/output.py` and `v1/engine/__init__.py`): the model runner reads the
plan to build its inputs, the step trace and the tests read it too; nobody but the scheduler writes one
(Scheduler._add_to_batch, _take_from_batch).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from minivllm.core.request import Request, RequestStatus


@dataclass
class SchedulerOutput:
    """One step's plan: plain data the model runner, the trace and the tests read."""
    scheduled: list[Request]                 # batch order
    num_scheduled_tokens: dict[str, int]     # request_id -> tokens to compute this step
    kinds: dict[str, str] = field(default_factory=dict)      # request_id -> "prefill" | "decode"
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    preempted: list[Request] = field(default_factory=list)
    newly_admitted: list[str] = field(default_factory=list)   # request ids moved waiting -> running
    # KV copies the model runner does before the forward, as (src block, dst block):
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)   # device -> CPU pool
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)    # CPU pool -> device
    # Speculative decoding: request_id -> the draft tokens scheduled after its last token (verified this step;
    # num_scheduled_tokens counts them).
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # Async scheduling: request_id -> tokens the batch still in flight computes for it (this batch starts at
    # num_computed_tokens + that), and -> 1 when that batch also samples its next token (this batch's input for it
    # is that token, read on the device). Empty without async scheduling.
    num_computed_ahead: dict[str, int] = field(default_factory=dict)
    num_output_placeholders: dict[str, int] = field(default_factory=dict)
    kv_connector_metadata: object = None     # KV transfer: the blocks this step loads and saves (kv_transfer/)
    # Images (encoder_cache_manager.py): request_id -> the images its tokens this step need (planning); the images
    # the encoder runs this step (MultiModalFeature); outputs the worker drops before it runs them.
    encoder_plan: dict[str, list] = field(default_factory=dict)
    encoder_inputs: list = field(default_factory=list)
    free_encoder_hashes: list[str] = field(default_factory=list)


@dataclass
class EngineCoreOutput:
    """What one request got from a committed step (vLLM v1's name): the new tokens (one, or with speculative
    decoding the accepted drafts and one more), and how it ended if it did."""
    request: Request
    new_token_ids: list[int]
    finish_status: RequestStatus | None = None      # FINISHED_* when the core stopped it (EOS, stop token, length)
    num_accepted_drafts: int = 0                    # speculative decoding: drafts the verification accepted
