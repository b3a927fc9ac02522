"""StepTrace: a plain-data snapshot of one engine step, for the Gradio app, the lessons and the tests.

Owns: copying what happened in a step out of the engine's live objects, so a listener can keep,
render or assert on it without ever touching engine state. Built only when someone listens:
`engine.add_trace_listener(fn)` / `remove_trace_listener(fn)`, or `with engine.record_traces() as traces:`
for a list that fills up while the block runs.

A trace costs in proportion to the step, never to the size of the KV pool: it lists the live requests (a block
table is copied only when it changed: the KV cache manager replaces a request's list instead of editing it) and the
ref counts of the blocks the step touched. The whole pool's picture is `BlockPool.snapshot()`, taken on demand.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from minivllm.core.block_pool import BlockEvents
from minivllm.core.request import Request
from minivllm.core.scheduler import Scheduler, SchedulerOutput


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
    parent_id: str | None = None   # n > 1: the id of the request this is one sample of
    sampling: str = ""             # what shapes its tokens: "greedy" / "T=0.8", "logprobs=3", the grammar's state
    num_draft_tokens: int = 0      # speculative decoding: drafts verified in this step
    num_accepted_tokens: int = 0   # of those, accepted (the step also added one token of the target's own)


@dataclass(frozen=True)
class PipelineTrace:
    """The batches of one step (they matter under pipeline parallelism, where several can be in flight). The
    executor numbers batches as they are issued; with one batch in flight a step issues and collects the same one."""
    issued: int | None                      # the batch this step scheduled and sent into stage 0
    collected: int | None                   # the batch whose tokens this step applied
    # the batches in flight while the step waited for `collected`, oldest first: (batch, its request ids)
    in_flight: tuple[tuple[int, tuple[str, ...]], ...] = ()


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
    block_ref_counts: dict[int, int]        # ref count after the step of each block the step touched
    cached_free_blocks: tuple[int, ...]     # of those, the ones left cached-free (ref 0, still in the prefix cache)
    kv_tokens_stored: int                   # tokens with KV, summed over running requests
    kv_slots_allocated: int                 # block slots held by running requests (blocks x block_size)
    forks: dict[str, tuple[int, ...]] = field(default_factory=dict)   # n > 1 parent id -> blocks its samples share
    num_draft_tokens: int = 0               # speculative decoding: drafts verified in this step, all requests
    num_accepted_tokens: int = 0            # of those, accepted
    events: list[str] = field(default_factory=list)   # human-readable log lines
    pipeline: PipelineTrace | None = None
    kv_cache_events: tuple[tuple, ...] = ()   # the prefix cache's changes (BlockEvents.kv_cache; engine/kv_events.py)

    @property
    def by_id(self) -> dict[str, RequestTrace]:
        return {r.request_id: r for r in self.requests}


class StepTracer:
    """Builds the StepTraces of one engine. Keeps each live request's block table as a tuple, rebuilt only when
    the KV cache manager gave the request a new list, so a decode step copies no unchanged table."""

    def __init__(self) -> None:
        self._tables: dict[str, tuple[list[int], tuple[int, ...]]] = {}   # request id -> (list, as a tuple)

    def _table(self, r: Request, tables: dict) -> tuple[int, ...]:
        cached = self._tables.get(r.request_id)
        if cached is None or cached[0] is not r.block_table:
            cached = (r.block_table, tuple(r.block_table))
        tables[r.request_id] = cached
        return cached[1]

    def build(self, step: int, duration_s: float, sched: SchedulerOutput, events: BlockEvents,
              scheduler: Scheduler, finished: list[Request],
              parent_of: Callable[[str], str] = lambda request_id: request_id,
              accepted: dict[str, int] | None = None, pipeline: PipelineTrace | None = None) -> StepTrace:
        """`parent_of(request_id)`: the id the caller knows (an n > 1 sample's parent id; the output processor's).
        `accepted`: request id -> drafts accepted this step (speculative decoding)."""
        tables: dict[str, tuple[list[int], tuple[int, ...]]] = {}
        live = scheduler.running + scheduler.waiting
        accepted = accepted or {}
        requests = tuple(_request_trace(r, sched, self._table(r, tables), parent_of(r.request_id),
                                        accepted.get(r.request_id, 0))
                         for r in live + finished)
        self._tables = tables           # the finished and aborted drop out here
        return _step_trace(step, duration_s, sched, events, scheduler, finished, requests, pipeline)


def _request_trace(r: Request, sched: SchedulerOutput, block_table: tuple[int, ...], parent: str,
                   accepted: int = 0) -> RequestTrace:
    sp = r.sampling_params
    sampling = ["greedy" if sp.greedy else f"T={sp.temperature:g}"]
    if sp.logprobs is not None:
        sampling.append(f"logprobs={sp.logprobs}")
    if r.grammar is not None:
        sampling.append(r.grammar.describe())
    return RequestTrace(r.request_id, r.status.value, r.priority, r.num_prompt_tokens, r.num_output_tokens,
                        r.num_computed_tokens, r.num_cached_tokens, sched.num_scheduled_tokens.get(r.request_id, 0),
                        sched.kinds.get(r.request_id, ""), block_table, r.num_preemptions,
                        parent if parent != r.request_id else None, ", ".join(sampling),
                        len(sched.scheduled_spec_decode_tokens.get(r.request_id, ())), accepted)


def _forks(requests: tuple[RequestTrace, ...]) -> dict[str, tuple[int, ...]]:
    """For each n > 1 parent: the blocks held by more than one of its samples (the prompt's, prefilled once)."""
    tables: dict[str, list[tuple[int, ...]]] = {}
    for r in requests:
        if r.parent_id is not None and r.block_table:
            tables.setdefault(r.parent_id, []).append(r.block_table)
    forks = {}
    for parent, held in tables.items():
        seen: dict[int, int] = {}
        for table in held:
            for b in table:
                seen[b] = seen.get(b, 0) + 1
        forks[parent] = tuple(b for b in held[0] if seen[b] > 1)
    return forks


def _step_trace(step: int, duration_s: float, sched: SchedulerOutput, events: BlockEvents, scheduler: Scheduler,
                finished: list[Request], requests: tuple[RequestTrace, ...],
                pipeline: PipelineTrace | None = None) -> StepTrace:
    kv = scheduler.kv_cache_manager
    pool = kv.block_pool
    touched = set(events.allocated) | set(events.freed) | set(events.evicted) | set(events.prefix_hit_blocks)
    touched |= {src for src, _ in events.swap_out} | {dst for _, dst in events.swap_in}
    log = []
    for rid in sched.newly_admitted:
        log.append(f"admit {rid}")
    forks = _forks(requests)
    admitted = set(sched.newly_admitted)
    for parent, shared in forks.items():
        samples = [r.request_id for r in requests if r.parent_id == parent]
        if admitted & set(samples):
            log.append(f"fork {parent} into {len(samples)} samples sharing blocks {list(shared)}")
    for r in sched.preempted:
        log.append(f"preempt {r.request_id} ({r.status.value})")
    for r in finished:
        log.append(f"finish {r.request_id} ({r.status.finish_reason})")
    if events.prefix_hit_blocks:
        log.append(f"prefix hit on blocks {events.prefix_hit_blocks}")
    if events.evicted:
        log.append(f"evict blocks {events.evicted}")
    if pipeline is not None and pipeline.issued != pipeline.collected:    # batches overlap: say which is which
        if pipeline.issued is not None:
            log.append(f"issue batch {pipeline.issued} ({len(sched.scheduled)} requests) into stage 0")
        if pipeline.collected is not None:
            log.append(f"batch {pipeline.collected} back from the last stage")
        log.append(f"{len(pipeline.in_flight)} batch(es) in flight: {[b for b, _ in pipeline.in_flight]}")
    running = scheduler.running
    return StepTrace(
        step=step, duration_s=duration_s,
        num_prefill_tokens=sched.num_prefill_tokens, num_decode_tokens=sched.num_decode_tokens,
        requests=requests,
        preempted=tuple(r.request_id for r in sched.preempted),
        finished=tuple(r.request_id for r in finished),
        blocks_allocated=tuple(events.allocated), blocks_freed=tuple(events.freed),
        blocks_evicted=tuple(events.evicted), prefix_hit_blocks=tuple(events.prefix_hit_blocks),
        blocks_swapped_out=tuple(events.swap_out), blocks_swapped_in=tuple(events.swap_in),
        num_waiting=sum(r.status.value in ("waiting", "preempted") for r in scheduler.waiting),
        num_running=len(running),
        num_swapped=scheduler.kv_cache_manager.num_swapped,
        num_kv_blocks=pool.num_blocks, num_free_blocks=pool.num_free_blocks, kv_usage=pool.usage,
        prefix_cache_hit_rate=kv.prefix_cache_hit_rate, num_preemptions_total=scheduler.num_preemptions,
        block_ref_counts={b: pool.blocks[b].ref_count for b in sorted(touched)},
        cached_free_blocks=tuple(b for b in sorted(touched) if b in pool.cached_free),
        kv_tokens_stored=sum(r.num_computed_tokens for r in running),
        kv_slots_allocated=sum(len(r.block_table) for r in running) * kv.block_size,
        forks=forks, events=log, pipeline=pipeline, kv_cache_events=tuple(events.kv_cache),
        num_draft_tokens=sum(r.num_draft_tokens for r in requests),
        num_accepted_tokens=sum(r.num_accepted_tokens for r in requests),
    )


@contextlib.contextmanager
def record_traces(engine) -> Iterator[list[StepTrace]]:
    """`with engine.record_traces() as traces:` every step inside the block appends its StepTrace (LLMEngine's)."""
    traces: list[StepTrace] = []
    engine.add_trace_listener(traces.append)
    try:
        yield traces
    finally:
        engine.remove_trace_listener(traces.append)
