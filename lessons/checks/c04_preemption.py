"""Lesson 04's checks: `preempt` on hand-made queues, then against the real Scheduler's own preemptions."""

import random
from typing import NamedTuple

from course import ExerciseFailed, expect_equal
from minivllm.core.journal import StepJournal
from minivllm.core.kv_cache_manager import KVCacheManager
from minivllm.core.request import Request
from minivllm.core.sampling_params import SamplingParams
from minivllm.core.scheduler import Scheduler


class Seq(NamedTuple):
    """A request as the exercise sees it: plain data, compared field by field."""
    request_id: str
    priority: int                   # lower runs first
    arrival: int                    # arrival time: earlier is smaller
    status: str                     # "running", "waiting" (never ran) or "preempted"
    num_computed_tokens: int        # tokens with KV in the cache
    block_table: tuple[int, ...]    # the KV blocks it holds

    def __repr__(self) -> str:
        return (f"{self.request_id}(priority {self.priority}, arrival {self.arrival}, {self.status}, "
                f"computed {self.num_computed_tokens}, blocks {self.block_table})")


def _run(rid, priority, arrival, computed, blocks):
    return Seq(rid, priority, arrival, "running", computed, tuple(blocks))


def _compare(actual, expected, what):
    """A list or a tuple of three lists (or tuples) is the answer's form; a Seq's block_table may be a list too."""
    if not isinstance(actual, (tuple, list)) or len(actual) != 3:
        raise ExerciseFailed(f"expected three things, (running, waiting, freed), got {actual!r}: {what}")
    for part, got, due in zip(("the running queue after", "the waiting queue after", "the freed blocks, in order"),
                              actual, expected):
        expect_equal(got, list(due), f"{what}: {part}")


def _case(fn, running, waiting, expected, what):
    _compare(fn(list(running), list(waiting)), expected,
             f"{what} (running {running}, waiting {waiting})")


def _real_preemptions(fn, seed):
    """Run a real Scheduler (recompute mode, no prefix cache) on a random workload in a pool too small for it.
    At every preemption, snapshot both queues just before and just after, and compare `fn` on the "before".
    Returns how many preemptions were compared."""
    rng = random.Random(seed)
    kv = KVCacheManager(num_blocks=rng.randrange(8, 14), block_size=4, journal=StepJournal(),
                        enable_prefix_caching=False)
    sched = Scheduler(kv, max_num_seqs=rng.choice([4, 6, 8]), max_num_batched_tokens=rng.choice([16, 32]),
                      max_model_len=4096, preemption_mode="recompute")

    def seqs(queue):
        return [Seq(r.request_id, r.priority, r.arrival_time, r.status.value, r.num_computed_tokens,
                    tuple(r.block_table)) for r in queue]

    events = []
    real_preempt = sched._preempt

    def recorded(req):
        before = (seqs(sched.running), seqs(sched.waiting))
        num_freed = len(kv.block_pool.events.freed)
        swap_out = real_preempt(req)
        events.append((before, (seqs(sched.running), seqs(sched.waiting),
                                list(kv.block_pool.events.freed[num_freed:]))))
        return swap_out
    sched._preempt = recorded

    arrivals = 0
    for step in range(60):
        for _ in range(rng.choice([0, 0, 0, 1, 2])):
            params = SamplingParams(temperature=0, max_tokens=rng.randrange(4, 24), ignore_eos=True)
            prompt = [rng.randrange(1000) for _ in range(rng.randrange(1, 10))]
            sched.add_request(Request(f"r{arrivals}", prompt, params, priority=rng.choice([0, 0, 1, 2]),
                                      arrival_time=arrivals))
            arrivals += 1
        if not sched.has_unfinished_requests():
            continue
        sched.begin_step()
        out = sched.schedule()
        sampled = {r.request_id: rng.randrange(1000) for r in out.scheduled
                   if r.num_computed_tokens + out.num_scheduled_tokens[r.request_id] == r.num_tokens}
        sched.update_from_output(out, sampled)
        sched.commit_step()
    sched.check_integrity()
    for i, ((running, waiting), expected) in enumerate(events):
        _compare(fn(list(running), list(waiting)), expected,
                 f"against the real Scheduler (workload {seed}, preemption {i + 1}; running {running}, "
                 f"waiting {waiting})")
    return len(events)


def check_preempt(fn):
    a, b, c = _run("A", 0, 0, 20, [0, 1, 2, 3, 4]), _run("B", 0, 1, 9, [5, 6, 7]), _run("C", 0, 2, 5, [8, 9])
    c_back = Seq("C", 0, 2, "preempted", 0, ())
    _case(fn, [a, b, c], [], ([a, b], [c_back], [9, 8]), "equal priorities: the latest arrival, C, goes")
    _case(fn, [c, a, b], [], ([a, b], [c_back], [9, 8]),
          "the same three in another running order (the order of the queue does not choose)")
    a1 = a._replace(priority=1)
    _case(fn, [a1, b, c], [], ([b, c], [Seq("A", 1, 0, "preempted", 0, ())], [4, 3, 2, 1, 0]),
          "A has priority 1: the lowest priority goes first, although A arrived first")
    yield "the victim: lowest priority (largest number), then latest arrival"
    _case(fn, [c], [], ([], [c_back], [9, 8]), "the only running request (it preempts itself)")
    yield "after: status preempted, no KV (num_computed_tokens 0, no blocks), blocks freed tail first"
    w1, w5 = Seq("W1", 0, 1, "preempted", 0, ()), Seq("W5", 0, 5, "waiting", 0, ())
    _case(fn, [a, c], [w1, w5], ([a], [w1, c_back, w5], [9, 8]),
          "C (arrival 2) goes back between W1 (arrival 1) and W5 (arrival 5)")
    u = Seq("U", 0, 9, "waiting", 0, ())
    _case(fn, [a1, b], [u], ([b], [u, Seq("A", 1, 0, "preempted", 0, ())], [4, 3, 2, 1, 0]),
          "A (priority 1) goes back behind U (priority 0, arrival 9)")
    yield "back in the waiting queue at its place by (priority, arrival): usually the front"
    compared = sum(_real_preemptions(fn, seed) for seed in range(8))
    yield f"{compared} preemptions in 8 random workloads against the real Scheduler"
