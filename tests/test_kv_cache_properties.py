"""Property tests of the core: random interleavings of scheduling, prefix sharing, preemption (both modes), aborts,
prefix-cache resets and steps that fail at any point never break an invariant of the scheduler, the KV cache manager,
the block pool or the swap space; a failed step leaves the core exactly as it was (or, where the failed step handed out
blocks that held live KV, as `KVCacheManager.distrust` documents); every block is free again once all requests are done.

No model runs here: a fake step does what the engine does around the model,

    scheduler.begin_step(); out = scheduler.schedule()
    scheduler.update_from_output(out, {request_id: token for the requests whose chunk ends their sequence})
    scheduler.commit_step()                    (or scheduler.rollback_step() when anything in between raised)

The oracle of a failed step is a fingerprint of the whole core taken before it (`core_state`), which
tests/test_fault_injection.py reuses on a real engine.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from minivllm.core.journal import StepJournal
from minivllm.core.kv_cache_manager import KVCacheManager
from minivllm.core.request import Request, RequestStatus
from minivllm.core.sampling_params import SamplingParams
from minivllm.core.scheduler import Scheduler

# A few shared prefixes so that prefix-cache hits (shared blocks, ref counts > 1) are common.
PREFIXES = [[7] * 12, [1, 2, 3, 4] * 4, list(range(100, 117))]
MAX_MODEL_LEN = 4096


class InjectedFault(Exception):
    """What a fake step raises on purpose."""


# ---------------------------------------------------------------------- the oracle of a failed step
def core_state(sched: Scheduler) -> dict:
    """Everything the core holds, as plain values (equal dicts mean equal states). Dict order is not state."""
    kv = sched.kv_cache_manager
    pool, swap = kv.block_pool, kv.swap_space
    live = sched.running + sched.waiting
    return {
        "running": [r.request_id for r in sched.running],
        "waiting": [r.request_id for r in sched.waiting],
        "requests": {r.request_id: {
            "status": r.status, "num_computed_tokens": r.num_computed_tokens, "block_table": tuple(r.block_table),
            "output_token_ids": tuple(r.output_token_ids), "all_token_ids": tuple(r.all_token_ids),
            "num_preemptions": r.num_preemptions, "num_cached_tokens": r.num_cached_tokens,
            "stop_reason": r.stop_reason} for r in live},
        "priority_keys": dict(sched._keys),
        "in_flight": {r.request_id: k for r, k in sched.in_flight.items()},     # request -> tokens in flight
        "blocks": tuple((b.ref_count, b.block_hash, b.token_ids) for b in pool.blocks),
        "clean_free": tuple(pool.clean_free),
        "cached_free": tuple(pool.cached_free.items()),     # (block, tick), LRU order
        "hash_to_block": dict(pool.hash_to_block),
        "num_cached_blocks": dict(kv.num_cached_blocks),
        "pending": (dict(kv.pending), dict(kv._pending_hash)),     # same-step offers: empty between steps
        "swap_tables": {rid: tuple(t) for rid, t in swap.tables.items()},
        "swap_free": tuple(swap.free),
        "events": pool.events.lengths(),
        "counters": {"prefix_cache_queries": kv.prefix_cache_queries, "prefix_cache_hits": kv.prefix_cache_hits,
                     "num_evictions": pool.num_evictions, "num_preemptions": sched.num_preemptions},
    }


def live_blocks(state: dict) -> set[int]:
    """Blocks that held KV someone could still use: held by a request, or cached-free."""
    return {b for b, (ref, _, _) in enumerate(state["blocks"]) if ref > 0} | {b for b, _ in state["cached_free"]}


def check_rolled_back(before: dict, after: dict, written: set[int], block_size: int) -> None:
    """`after` is what a failed step that handed out the blocks `written` must leave, given the state `before` it.

    If none of those blocks held live KV before the step, the state is exactly `before`. Otherwise (a block freed
    and handed out again within the step: a preempted request's, or an evicted cached-free one) the failed forward
    may have overwritten them, and `KVCacheManager.distrust` documents what changes: a cached-free one loses its
    hash (clean-free now); a request holding one keeps only the blocks before the first such one, its
    num_computed_tokens capped there. Nothing else moves.
    """
    if not written & live_blocks(before):
        assert after == before, _diff(before, after)
        return
    for key in ("running", "waiting", "priority_keys", "in_flight", "swap_tables", "swap_free", "counters",
                "pending"):
        assert after[key] == before[key], f"{key}: {before[key]} -> {after[key]}"
    cut: dict[str, int] = {}                       # request -> index of its first distrusted block
    tails: list[int] = []
    for rid, r0 in before["requests"].items():
        r1 = after["requests"][rid]
        table = r0["block_table"]
        bad = next((i for i, b in enumerate(table) if b in written), None)
        same = {k: v for k, v in r0.items() if k not in ("block_table", "num_computed_tokens")}
        assert {k: v for k, v in r1.items() if k not in ("block_table", "num_computed_tokens")} == same, rid
        if bad is None:
            assert r1 == r0, f"request {rid}: {r0} -> {r1}"
            continue
        cut[rid] = bad
        tails += table[bad:]
        assert r1["block_table"] == table[:bad], f"request {rid}: kept {r1['block_table']} of {table}, cut at {bad}"
        assert r1["num_computed_tokens"] == min(r0["num_computed_tokens"], bad * block_size), rid
    for rid, n in before["num_cached_blocks"].items():
        assert after["num_cached_blocks"].get(rid, 0) == (min(n, cut[rid]) if rid in cut else n), rid
    for b, (old, new) in enumerate(zip(before["blocks"], after["blocks"])):
        if b in written:
            assert new[1] is None, f"block {b} was handed out by the failed step but is still hashed"
        elif b in tails:
            assert new[0] == old[0] - tails.count(b), f"block {b}: ref count {old[0]} -> {new[0]}"
        else:
            assert new == old, f"block {b} (untouched by the failed step): {old} -> {new}"
    assert after["hash_to_block"] == {h: b for h, b in before["hash_to_block"].items() if b not in written}
    kept = tuple((b, t) for b, t in before["cached_free"] if b not in written)
    assert after["cached_free"][:len(kept)] == kept, "cached-free blocks lost their place in LRU order"
    assert {b for b, _ in after["cached_free"][len(kept):]} <= set(tails), "a block became cached-free"
    assert after["clean_free"][:len(before["clean_free"])] == before["clean_free"], "clean-free order changed"
    assert set(after["clean_free"][len(before["clean_free"]):]) <= written | set(tails), "a block became free"


def _diff(before: dict, after: dict) -> str:
    return "state changed: " + "; ".join(f"{k}: {before[k]} -> {after[k]}" for k in before if before[k] != after[k])


class Spy:
    """Routes `obj.name(...)` through a wrapper (an instance attribute) that records what each call returns and,
    once armed, raises at its n-th call; `remove()` puts back what was there."""

    def __init__(self, obj, name: str):
        self.obj, self.name, self.real = obj, name, getattr(obj, name)
        self.shadowed = obj.__dict__.get(name)         # an instance attribute this one hides, if any
        self.results: list = []
        self.fail_at: int | None = None
        self.exc: BaseException | None = None
        self.calls = 0
        setattr(obj, name, self)

    def arm(self, fail_at: int | None, exc: BaseException | None = None) -> None:
        """Forget the calls so far; raise `exc` (InjectedFault by default) at call `fail_at` (0-based) from now."""
        self.results, self.fail_at, self.exc, self.calls = [], fail_at, exc, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.fail_at is not None and self.calls > self.fail_at:
            self.fail_at = None
            raise self.exc if self.exc is not None else InjectedFault(f"{self.name} call {self.calls}")
        result = self.real(*args, **kwargs)
        self.results.append(result)
        return result

    def remove(self) -> None:
        if self.shadowed is not None:
            setattr(self.obj, self.name, self.shadowed)
        else:
            delattr(self.obj, self.name)


# ---------------------------------------------------------------------- the state machine
def fake_token(req: Request) -> int:
    return (len(req.all_token_ids) * 31) % 50


class CoreModel(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(6, 24), block_size=st.sampled_from([2, 4, 8]),
                caching=st.booleans(), mode=st.sampled_from(["recompute", "swap"]),
                budget=st.integers(4, 64), cpu_blocks=st.integers(0, 12))
    def setup(self, num_blocks, block_size, caching, mode, budget, cpu_blocks):
        self.kv = KVCacheManager(num_blocks, block_size, StepJournal(), caching, cpu_blocks)
        self.sched = Scheduler(self.kv, max_num_seqs=4, max_num_batched_tokens=budget, max_model_len=MAX_MODEL_LEN,
                               preemption_mode=mode)
        self.live: dict[str, Request] = {}
        self.ids = itertools.count()
        self.num_preempting_steps = 0                           # steps whose plan preempted (failed ones too)
        self.taken = Spy(self.kv.block_pool, "take_fresh")      # the blocks a step hands out
        # the core's writers, any of which a failing step may stop at its n-th call
        self.faults = [self.taken] + [Spy(obj, name) for obj, name in (
            (self.kv.block_pool, "touch"), (self.kv.block_pool, "free"), (self.kv.block_pool, "cache_block"),
            (self.kv.swap_space, "store"), (self.kv.swap_space, "release"), (self.sched, "_preempt"),
            (self.sched, "finish_request"))]

    @rule(prefix=st.sampled_from(PREFIXES), tail=st.lists(st.integers(0, 50), max_size=12),
          max_tokens=st.integers(1, 16), priority=st.integers(0, 2))
    def add(self, prefix, tail, max_tokens, priority):
        """Two rules add requests (this one and add_more), so the pool is often under pressure."""
        prompt = prefix[:max(1, len(prefix) - len(tail))] + tail
        # The engine refuses requests that could never fit in the pool; so do we.
        if self.kv.blocks_needed(len(prompt) + max_tokens) > self.kv.num_blocks:
            return
        i = next(self.ids)
        req = Request(str(i), prompt, SamplingParams(max_tokens=max_tokens), priority=priority, arrival_time=float(i))
        self.live[req.request_id] = req
        self.sched.add_request(req)

    @rule(prefix=st.sampled_from(PREFIXES), max_tokens=st.integers(4, 16))
    def add_more(self, prefix, max_tokens):
        self.add(prefix, [len(self.live)], max_tokens, 0)

    def _run_step(self, stop_one: bool = False, fail: str | None = None, only_if_it_preempts: bool = False) -> None:
        """One fake step; `fail` says where it raises: "after_schedule", "after_update" or None (never), in every
        step or `only_if_it_preempts`."""
        sched = self.sched
        sched.begin_step()
        out = sched.schedule()
        assert sum(out.num_scheduled_tokens.values()) <= sched.max_num_batched_tokens
        assert len(out.scheduled) <= sched.max_num_seqs
        if out.preempted:
            self.num_preempting_steps += 1
        if only_if_it_preempts and not out.preempted:
            fail = None
        sampled = {}
        for req in out.scheduled:                         # the model would write KV to these slots
            n = out.num_scheduled_tokens[req.request_id]
            assert self.kv.blocks_needed(req.num_computed_tokens + n) <= len(req.block_table)
            if req.num_computed_tokens + n == req.num_tokens:    # the chunk ends the sequence: it samples
                sampled[req.request_id] = fake_token(req)
        if fail == "after_schedule":
            raise InjectedFault(fail)
        outputs = sched.update_from_output(out, sampled)
        assert sorted(o.request.request_id for o in outputs) == sorted(sampled)
        for o in outputs:
            if stop_one and o.finish_status is None:      # as the engine does for a stop string
                sched.finish_request(o.request, RequestStatus.FINISHED_STOPPED, "stop")
                stop_one = False
        if fail == "after_update":
            raise InjectedFault(fail)
        sched.commit_step()
        for o in outputs:
            if o.request.is_finished:
                del self.live[o.request.request_id]

    @rule(stop_one=st.booleans(), fail_if_it_preempts=st.sampled_from([None, "after_schedule", "after_update"]))
    def step(self, stop_one, fail_if_it_preempts):
        """A step. One that preempts may fail (after its plan, or once its tokens are in): the failed step that
        handed a victim's blocks to another request, where the rollback must distrust them."""
        self._failing_step(fail_if_it_preempts, stop_one=stop_one, only_if_it_preempts=True)

    @rule(where=st.sampled_from(["in_core", "after_schedule", "after_update"]),
          fault=st.integers(0, 7), nth=st.integers(0, 3), stop_one=st.booleans())
    def failing_step(self, where, fault, nth, stop_one):
        """A step that raises at a random point: inside the core (at the nth call of one of its writers, in the plan
        or in update_from_output), after the plan, or after the tokens are in; it rolls back."""
        self._failing_step(where, fault, nth, stop_one)

    def _failing_step(self, where: str | None, fault: int = 0, nth: int = 0, stop_one: bool = False,
                      only_if_it_preempts: bool = False) -> None:
        before = core_state(self.sched)
        self.taken.arm(None)
        if where == "in_core":
            self.faults[fault].arm(nth)
        try:
            self._run_step(stop_one, None if where == "in_core" else where, only_if_it_preempts)
        except InjectedFault:
            self.sched.rollback_step()
        else:                      # it was not to fail, or the armed writer was not called often enough
            return
        finally:
            for spy in self.faults:
                spy.fail_at = None
        check_rolled_back(before, core_state(self.sched), set(self.taken.results), self.kv.block_size)

    @precondition(lambda self: any(r.status is RequestStatus.RUNNING for r in self.live.values()))
    @rule(data=st.data(), fail=st.booleans())
    def forced_preemption(self, data, fail):
        """Preempt a running request (swapped out or dropped, by the scheduler's mode) in a step of its own."""
        running = [r for r in self.sched.running]
        victim = data.draw(st.sampled_from(running))
        before = core_state(self.sched)
        self.sched.begin_step()
        self.sched._preempt(victim)
        if fail:
            self.sched.rollback_step()
            assert core_state(self.sched) == before
        else:
            self.sched.commit_step()
            assert victim.status in (RequestStatus.PREEMPTED, RequestStatus.SWAPPED)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def abort(self, data):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        self.sched.finish_request(self.live.pop(rid), RequestStatus.FINISHED_ABORTED)

    @rule()
    def reset_prefix_cache(self):
        """vLLM's rule: the cache is forgotten only while no request holds a block; otherwise nothing changes."""
        pool = self.kv.block_pool
        in_use, before = pool.num_free_blocks < pool.num_blocks, core_state(self.sched)
        assert self.kv.reset_prefix_cache() is not in_use
        if in_use:
            assert core_state(self.sched) == before
        else:
            assert not pool.cached_free and not pool.hash_to_block
            assert all(b.block_hash is None for b in pool.blocks)

    @invariant()
    def integrity(self):
        if hasattr(self, "kv"):
            self.sched.check_integrity()
            assert not self.kv.pending and not self.kv._pending_hash, "a same-step offer outlived its step"
            assert {r.request_id for r in self.sched.running + self.sched.waiting} == set(self.live)

    def teardown(self):
        if not hasattr(self, "kv"):
            return
        for _ in range(2000):                              # drain: everything must finish
            if not self.sched.has_unfinished_requests():
                break
            # every other step that preempts fails (a victim's blocks often went to another request), alternately
            # after the plan and after the tokens. Counted over the preempting steps, not all steps: failing every
            # step at odd i could fail *every* preempting step (a successful step recomputes what the last
            # failure distrusted, the next one must preempt), and then nothing can ever finish.
            n = self.num_preempting_steps
            self._failing_step(None if n % 2 else ("after_schedule", "after_update")[n // 2 % 2],
                               only_if_it_preempts=True)
            self.integrity()
        assert not self.sched.has_unfinished_requests(), "requests never finished (livelock)"
        assert self.kv.num_free_blocks == self.kv.num_blocks
        assert len(self.kv.swap_space.free) == self.kv.swap_space.num_cpu_blocks
        for spy in self.faults:
            spy.remove()


TestCoreModel = CoreModel.TestCase
TestCoreModel.pytestmark = [pytest.mark.slow]          # hundreds of generated runs
TestCoreModel.settings = settings(max_examples=300, stateful_step_count=50, deadline=None,
                                  suppress_health_check=[HealthCheck.too_slow])


# ---------------------------------------------------------------------- targeted cases
def make_core(num_blocks: int, block_size: int, **kw) -> tuple[KVCacheManager, Scheduler]:
    kv = KVCacheManager(num_blocks, block_size, StepJournal())
    return kv, Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=MAX_MODEL_LEN, **kw)


def step(sched: Scheduler):
    """One fake step that commits; returns the plan."""
    sched.begin_step()
    out = sched.schedule()
    sampled = {r.request_id: fake_token(r) for r in out.scheduled
               if r.num_computed_tokens + out.num_scheduled_tokens[r.request_id] == r.num_tokens}
    sched.update_from_output(out, sampled)
    sched.commit_step()
    return out


def request(rid: str, prompt: list[int], max_tokens: int = 16) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens))


def test_prefix_hit_never_covers_the_whole_prompt():
    kv, sched = make_core(8, 4)
    sched.add_request(request("a", list(range(8))))
    step(sched)                                          # a's step fills both blocks: hashed as it commits
    assert kv.num_cached_blocks["a"] == 2
    assert len(kv.get_computed_blocks(request("b", list(range(8))))) == 1     # 2 full blocks cached, only 1 reused
    assert len(kv.get_computed_blocks(request("c", list(range(9))))) == 2


def test_hash_collision_cannot_hand_out_wrong_kv(monkeypatch):
    from minivllm.core import kv_cache_manager as kv_mod

    monkeypatch.setattr(kv_mod, "hash_block_tokens", lambda parent, tokens: 42)   # everything collides
    kv, sched = make_core(8, 4)
    sched.add_request(request("a", [1, 2, 3, 4, 5]))
    step(sched)
    assert kv.block_pool.hash_to_block == {42: sched.running[0].block_table[0]}
    assert kv.get_computed_blocks(request("b", [9, 9, 9, 9, 5])) == []    # same hash, other tokens: no hit


def test_evicts_least_recently_freed_and_tail_blocks_first():
    kv, sched = make_core(4, 2)
    a = request("a", [1, 2, 3, 4, 5], max_tokens=1)
    sched.add_request(a)
    step(sched)                                          # blocks 0, 1 hashed; block 2 partial; a finishes (freed)
    assert a.status is RequestStatus.FINISHED_LENGTH
    pool = kv.block_pool
    assert list(pool.cached_free) == [1, 0] and list(pool.clean_free) == [3, 2]
    b = request("b", [8, 8, 8, 8, 8, 8])
    sched.add_request(b)
    step(sched)                                          # takes the clean blocks, then evicts block 1
    assert b.block_table == [3, 2, 1] and pool.num_evictions == 1 and list(pool.cached_free) == [0]


def test_reset_prefix_cache_refuses_while_blocks_are_held_and_forgets_everything_once_free(caplog):
    """vLLM's BlockPool.reset_prefix_cache: False (a warning, nothing changed) while a request holds a block, shared
    or not; True once every block is free, and then no block keeps a hash, nothing hits, and AllBlocksCleared."""
    kv, sched = make_core(12, 4)
    pool = kv.block_pool
    a, b = request("a", list(range(9))), request("b", list(range(9)) + [50, 51])
    for r in (a, b):
        sched.add_request(r)
    step(sched)                                          # b shares a's two full blocks: hashed, ref count 2
    pool.pop_events()
    before = core_state(sched)
    assert kv.reset_prefix_cache() is False
    assert core_state(sched) == before and pool.hash_to_block and not pool.events.kv_cache
    assert "Failed to reset prefix cache because some blocks (4) are not freed yet" in caplog.text
    sched.finish_request(a, RequestStatus.FINISHED_ABORTED)
    assert kv.reset_prefix_cache() is False              # b still holds the shared blocks and its own
    sched.finish_request(b, RequestStatus.FINISHED_ABORTED)
    assert len(pool.cached_free) == 2
    assert kv.reset_prefix_cache() is True
    assert not pool.hash_to_block and not pool.cached_free and all(x.block_hash is None for x in pool.blocks)
    assert pool.events.kv_cache[-1] == ("AllBlocksCleared",) and kv.num_free_blocks == kv.num_blocks
    assert kv.get_computed_blocks(request("c", list(range(9)))) == []
    sched.check_integrity()
    with pytest.raises(AssertionError, match="between steps"):      # never inside a step
        sched.begin_step()
        try:
            kv.reset_prefix_cache()
        finally:
            sched.rollback_step()


def test_same_step_sharing_and_uncomputed_blocks_are_never_cached():
    """A block joins the prefix cache only when the step that computed it commits. Within the step, two identical
    prompts admitted together share the full blocks the step is computing (a pending offer, never in the hash map);
    a step that fails caches nothing and shares nothing; a third prompt in a later step hits the cache."""
    kv, sched = make_core(12, 4)
    pool = kv.block_pool
    a, b = request("a", list(range(9))), request("b", list(range(9)))
    sched.add_request(a)
    sched.add_request(b)
    before = core_state(sched)
    sched.begin_step()
    out = sched.schedule()                               # a takes 3 blocks; b shares a's 2 full ones, 1 of its own
    assert out.newly_admitted == ["a", "b"] and out.num_scheduled_tokens == {"a": 9, "b": 1}
    assert b.num_computed_tokens == 8 and b.block_table[:2] == a.block_table[:2]
    assert not pool.hash_to_block                        # nothing computed yet, nothing cached
    sched.rollback_step()                                # the forward failed
    assert core_state(sched) == before and not kv.pending
    assert not pool.hash_to_block and not pool.cached_free and not a.block_table and not b.block_table
    sched.check_integrity()

    out = step(sched)                                    # this time the step commits
    assert out.num_scheduled_tokens == {"a": 9, "b": 1} and not kv.pending
    assert set(pool.hash_to_block.values()) == set(a.block_table[:2])
    c = request("c", list(range(9)))
    sched.add_request(c)
    out = step(sched)                                    # the next step: c hits a's two blocks in the cache
    assert out.num_scheduled_tokens["c"] == 1 and c.num_cached_tokens == 8
    assert c.block_table[:2] == a.block_table[:2] and [pool.blocks[x].ref_count for x in a.block_table[:2]] == [3, 3]
    sched.check_integrity()
    cached = a.block_table[:2]
    for r in (a, b, c):
        sched.finish_request(r, RequestStatus.FINISHED_ABORTED)
    assert sorted(pool.cached_free) == sorted(cached)    # the partial blocks are clean-free
    sched.check_integrity()
    assert kv.num_free_blocks == kv.num_blocks


def test_uncomputed_blocks_of_a_preempted_request_are_never_cached():
    """A request preempted before its step ran leaves nothing in the prefix cache."""
    kv, sched = make_core(12, 4)
    a = request("a", list(range(9)))
    sched.add_request(a)
    sched.begin_step()
    sched.schedule()
    sched._preempt(a)                                    # before its tokens are in
    sched.commit_step()
    assert a.status is RequestStatus.PREEMPTED and a.num_computed_tokens == 0
    assert not kv.block_pool.hash_to_block and not kv.block_pool.cached_free
    sched.check_integrity()


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_failed_step_that_reused_a_preempted_requests_blocks_distrusts_them(mode):
    """The step preempts b, hands b's blocks to a, then fails: the rollback gives b its blocks back, but the
    forward may have written them, so b keeps only what comes before them and recomputes the rest."""
    kv = KVCacheManager(4, 2, StepJournal(), num_cpu_blocks=4 if mode == "swap" else 0)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=MAX_MODEL_LEN, preemption_mode=mode)
    a, b = request("a", [1, 2, 3, 4], max_tokens=3), request("b", [5, 6, 7, 8], max_tokens=3)
    sched.add_request(a)
    sched.add_request(b)
    step(sched)                                          # 2 blocks each (4 prompt tokens): the pool is full
    assert kv.num_free_blocks == 0
    before = core_state(sched)
    taken = Spy(kv.block_pool, "take_fresh")
    sched.begin_step()
    out = sched.schedule()                               # a needs a 3rd block: b (the later arrival) is preempted
    assert out.preempted == [b] and set(taken.results) <= set(before["requests"]["b"]["block_table"])
    sched.rollback_step()
    taken.remove()
    written = set(taken.results)
    check_rolled_back(before, core_state(sched), written, kv.block_size)
    table = before["requests"]["b"]["block_table"]
    bad = min(table.index(x) for x in written)
    assert b.block_table == list(table[:bad]) and b.num_computed_tokens == bad * 2
    assert a.block_table == list(before["requests"]["a"]["block_table"]) and a.num_computed_tokens == 4
    sched.check_integrity()
    while sched.has_unfinished_requests():
        step(sched)
        sched.check_integrity()
    assert kv.num_free_blocks == kv.num_blocks


def test_the_drain_finishes_when_failed_preempting_steps_cost_recomputation():
    """The state machine's shrunk counterexample from a CI run (2026-11-26): 12 blocks of 2, a 4-token budget,
    two 12-token prompts. A failed step whose plan preempted request 1 and gave its blocks to request 0 makes
    request 1 recompute 4 tokens; the next step does only that, and the one after must preempt again. When
    every such step failed (the old drain) nothing could finish; with every other one failing, all do."""
    m = CoreModel()
    m.setup(num_blocks=12, block_size=2, caching=False, mode="recompute", budget=4, cpu_blocks=0)
    m.add_more(max_tokens=4, prefix=[7] * 12)
    for _ in range(3):
        m.step(fail_if_it_preempts=None, stop_one=False)
    m.add(max_tokens=4, prefix=[7] * 12, priority=0, tail=[])
    m.step(fail_if_it_preempts=None, stop_one=False)
    m.sched.begin_step()
    m.sched._preempt(m.sched.running[0])
    m.sched.commit_step()
    before = m.num_preempting_steps
    m.teardown()
    assert not m.sched.has_unfinished_requests() and m.kv.num_free_blocks == 12
    assert m.num_preempting_steps - before >= 2            # it did preempt (and fail) on the way
