"""Preemption with batches in flight (pipeline parallelism's batch queue), as vLLM does it: the victim is the
lowest-priority, latest request even when its batch has not come back; it is recomputed, waits for that batch, and
gets that batch's token. A step that fails after handing such a victim's blocks on leaves the core consistent, and
the victim's batch, when it returns, gives its token and no KV. No model runs: batches are issued and collected
by hand, as the engine's step_with_batch_queue does."""

from __future__ import annotations

import collections
import random

import pytest

from minivllm.core.async_scheduler import AsyncScheduler
from minivllm.core.journal import StepJournal
from minivllm.core.kv_cache_manager import KVCacheManager
from minivllm.core.request import Request, RequestStatus
from minivllm.core.sampling_params import SamplingParams


def token_of(req: Request) -> int:
    return (req.num_tokens * 7 + len(req.request_id)) % 50 + 1


def make(num_blocks=10, block_size=16, budget=100, batches=2, mode="recompute", cpu_blocks=0):
    kv = KVCacheManager(num_blocks, block_size, StepJournal(), True, cpu_blocks)
    return AsyncScheduler(kv, max_num_seqs=4, max_num_batched_tokens=budget, max_model_len=4096,
                          preemption_mode=mode, max_concurrent_batches=batches)


class Pipe:
    """The engine's batch queue: `issue` schedules a batch, `collect` applies the oldest one's tokens."""

    def __init__(self, sched: AsyncScheduler):
        self.sched, self.queue = sched, collections.deque()

    def issue(self):
        s = self.sched
        s.begin_step()
        out = s.schedule()
        s.commit_step()
        if out.scheduled:
            # what each request's row samples is fixed when the batch runs, so decide it now
            tokens = {r.request_id: token_of(r) for r in out.scheduled
                      if r.num_computed_tokens + out.num_scheduled_tokens[r.request_id] >= r.num_tokens}
            self.queue.append((out, tokens))
        return out

    def collect(self, fail: bool = False):
        s = self.sched
        out, tokens = self.queue[0]
        s.begin_step()
        self.queue.popleft()
        s.update_from_output(out, {rid: t for rid, t in tokens.items() if not s_finished(out, rid)})
        if fail:
            self.queue.appendleft((out, tokens))
            s.rollback_step()
        else:
            s.commit_step()
        s.check_integrity()


def s_finished(out, rid):
    return next(r for r in out.scheduled if r.request_id == rid).is_finished


def test_the_lowest_priority_request_is_preempted_even_with_its_batch_in_flight():
    """The issue's reproduction: 10 blocks of 16, budget 100, two batches in flight; a (priority 0, 80 tokens) then
    b (priority 10, 80 tokens). When a's batch is back and a needs a sixth block, b (in flight) is the victim."""
    sched = make()
    pipe = Pipe(sched)
    a = Request("a", list(range(1, 81)), SamplingParams(max_tokens=4), priority=0)
    b = Request("b", list(range(101, 181)), SamplingParams(max_tokens=4), priority=10)
    sched.add_request(a)
    sched.add_request(b)
    assert [r.request_id for r in pipe.issue().scheduled] == ["a"]
    assert [r.request_id for r in pipe.issue().scheduled] == ["b"]      # the pool is full: 5 + 5 blocks
    pipe.collect()                                                        # a's batch: a now needs a sixth block
    out = pipe.issue()
    assert [r.request_id for r in out.scheduled] == ["a"] and out.preempted == [b]
    assert b.status is RequestStatus.PREEMPTED and b in sched.in_flight and not b.block_table
    pipe.collect()                                                        # b's batch comes back: its token, no KV
    assert b.num_output_tokens == 1 and b.num_computed_tokens == 0 and b not in sched.in_flight
    for _ in range(60):
        if not sched.has_unfinished_requests():
            break
        pipe.issue()
        while pipe.queue and (len(pipe.queue) == 2 or not sched.has_unfinished_requests()
                              or not any(r.status is RequestStatus.RUNNING and r not in sched.in_flight
                                         for r in sched.running)):
            pipe.collect()
    assert a.is_finished and b.is_finished and a.num_output_tokens == b.num_output_tokens == 4
    assert sched.kv_cache_manager.num_free_blocks == sched.kv_cache_manager.num_blocks


def engine_step(sched: AsyncScheduler, queue: collections.deque, fail: bool) -> None:
    """LLMEngine.step_with_batch_queue without a model: schedule and issue a batch if there is room, then apply the
    oldest batch's tokens if the queue is full or nothing was issued; all one transaction. `fail`: it raises at the
    end (after the issue and the apply), so it rolls back: the batch it issued is forgotten, and the blocks it handed
    out are distrusted (their KV may have been written)."""
    sched.begin_step()
    issued = None
    if len(queue) < sched.max_concurrent_batches:
        out = sched.schedule()
        if out.scheduled:
            tokens = {r.request_id: token_of(r) for r in out.scheduled    # rows whose chunk ends the sequence
                      if r.num_computed_tokens + sched.in_flight[r] >= r.num_tokens}
            issued = (out, tokens)
            queue.append(issued)
    applied = None
    if queue and (issued is None or len(queue) == sched.max_concurrent_batches):
        applied = queue.popleft()
        out, tokens = applied
        sched.update_from_output(out, {rid: t for rid, t in tokens.items() if not s_finished(out, rid)})
    if fail:
        if applied is not None:
            queue.appendleft(applied)
        if issued is not None:
            queue.remove(issued)
        sched.rollback_step()
    else:
        sched.commit_step()
    sched.check_integrity()


def run_workload(seed: int) -> tuple[int, int]:
    """One random workload to the end; (victims preempted in flight, requests whose batch's KV a failed step lost)."""
    rng = random.Random(seed)
    mode = rng.choice(["recompute", "swap"])
    sched = make(num_blocks=rng.choice([6, 8]), block_size=4, budget=rng.choice([8, 16, 32]),
                 batches=rng.choice([2, 3]), mode=mode, cpu_blocks=8 if mode == "swap" else 0)
    queue: collections.deque = collections.deque()
    for i in range(8):
        sched.add_request(Request(f"r{i}", [rng.randint(1, 40) for _ in range(rng.randint(2, 12))],
                                  SamplingParams(max_tokens=rng.randint(4, 10)), priority=rng.randint(-1, 1)))
    preempted_in_flight, lost = 0, set()
    for _ in range(600):
        if not sched.has_unfinished_requests() and not queue:
            break
        before = {r for r in sched.waiting if r in sched.in_flight}
        engine_step(sched, queue, fail=rng.random() < 0.2)
        preempted_in_flight += len({r for r in sched.waiting if r in sched.in_flight} - before)
        lost |= sched.kv_lost
    assert not sched.has_unfinished_requests() and not queue
    assert sched.kv_cache_manager.num_free_blocks == sched.kv_cache_manager.num_blocks
    assert not sched.in_flight and not sched.kv_lost
    return preempted_in_flight, len(lost)


def test_random_workloads_with_failed_steps_finish_with_every_block_free():
    """100 workloads, every step checked (Scheduler.check_integrity); both new paths fire."""
    counts = [run_workload(seed) for seed in range(100)]
    assert sum(c[0] for c in counts) > 20 and sum(c[1] for c in counts) > 5, counts
