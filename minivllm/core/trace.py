"""StepTrace: a plain-data snapshot of one engine step, for the Gradio app, the lessons and the tests.

Owns: copying what happened in a step out of the engine's live objects, so a listener can keep,
render or assert on it without ever touching engine state. Built only when someone listens:
`engine.add_trace_listener(fn)` / `remove_trace_listener(fn)`, or `with engine.record_traces() as traces:`
for a list that fills up while the block runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from minivllm.core.kv_cache_manager import BlockEvents
from minivllm.core.request import Request
from minivllm.core.scheduler import SchedulerOutput


@dataclass(frozen=True)
class RequestTrace:
    request_id: str
    status: str                    # waiting | running | preempted | swapped | finished_*
    priority: int
    num_prompt_tokens: int
    num_output_tokens: int
    num_computed_tokens: int       # tokens with KV in the cache after this step
    num_cached_tokens: int         # prompt tokens that came from the prefix cache
    num_scheduled_tokens: int      # computed in this step (0 if not scheduled)
    kind: str                      # "prefill", "decode", or "" when not scheduled
    block_table: tuple[int, ...]
    num_preemptions: int           # a "prefill" after a preemption is a recompute


@dataclass(frozen=True)
class StepTrace:
    step: int
    duration_s: float
    num_prefill_tokens: int
    num_decode_tokens: int
    requests: tuple[RequestTrace, ...]      # every live request plus those that finished this step
    preempted: tuple[str, ...]
    finished: tuple[str, ...]
    blocks_allocated: tuple[int, ...]
    blocks_freed: tuple[int, ...]
    blocks_evicted: tuple[int, ...]
    prefix_hit_blocks: tuple[int, ...]
    blocks_swapped_out: tuple[tuple[int, int], ...]
    blocks_swapped_in: tuple[tuple[int, int], ...]
    num_waiting: int
    num_running: int
    num_swapped: int
    num_kv_blocks: int
    num_free_blocks: int
    kv_usage: float
    prefix_cache_hit_rate: float
    num_preemptions_total: int
    block_ref_counts: tuple[int, ...]       # per physical block
    cached_free_blocks: tuple[int, ...]     # ref count 0 but still holding a prefix-cache entry
    kv_tokens_stored: int                   # tokens with KV, summed over running requests
    kv_slots_allocated: int                 # block slots held by running requests (blocks x block_size)
    events: list[str] = field(default_factory=list)   # human-readable log lines

    @property
    def by_id(self) -> dict[str, RequestTrace]:
        return {r.request_id: r for r in self.requests}


def build_step_trace(step: int, duration_s: float, sched: SchedulerOutput, events: BlockEvents,
                     live: list[Request], finished: list[Request], block_manager, num_preemptions: int) -> StepTrace:
    bm = block_manager

    def trace(r: Request) -> RequestTrace:
        return RequestTrace(r.request_id, r.status.value, r.priority, r.num_prompt_tokens, r.num_output_tokens,
                            r.num_computed_tokens, r.num_cached_tokens,
                            sched.num_scheduled_tokens.get(r.request_id, 0), sched.kinds.get(r.request_id, ""),
                            tuple(r.block_table), r.num_preemptions)

    running = [r for r in live if r.status.value == "running"]
    log = []
    for rid in sched.newly_admitted:
        log.append(f"admit {rid}")
    for r in sched.preempted:
        log.append(f"preempt {r.request_id} ({r.status.value})")
    for r in finished:
        log.append(f"finish {r.request_id} ({r.status.finish_reason})")
    if events.prefix_hit_blocks:
        log.append(f"prefix hit on blocks {events.prefix_hit_blocks}")
    if events.evicted:
        log.append(f"evict blocks {events.evicted}")
    return StepTrace(
        step=step, duration_s=duration_s,
        num_prefill_tokens=sched.num_prefill_tokens, num_decode_tokens=sched.num_decode_tokens,
        requests=tuple(trace(r) for r in live + finished),
        preempted=tuple(r.request_id for r in sched.preempted),
        finished=tuple(r.request_id for r in finished),
        blocks_allocated=tuple(events.allocated), blocks_freed=tuple(events.freed),
        blocks_evicted=tuple(events.evicted), prefix_hit_blocks=tuple(events.prefix_hit_blocks),
        blocks_swapped_out=tuple(events.swap_out), blocks_swapped_in=tuple(events.swap_in),
        num_waiting=sum(r.status.value in ("waiting", "preempted") for r in live),
        num_running=len(running),
        num_swapped=sum(r.status.value == "swapped" for r in live),
        num_kv_blocks=bm.num_blocks, num_free_blocks=bm.num_free_blocks, kv_usage=bm.usage,
        prefix_cache_hit_rate=bm.prefix_cache_hit_rate, num_preemptions_total=num_preemptions,
        block_ref_counts=tuple(b.ref_count for b in bm.blocks),
        cached_free_blocks=tuple(bm.cached_free),
        kv_tokens_stored=sum(r.num_computed_tokens for r in running),
        kv_slots_allocated=sum(len(r.block_table) for r in running) * bm.block_size,
        events=log,
    )
