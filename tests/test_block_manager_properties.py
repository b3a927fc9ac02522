"""Property tests: random interleavings of scheduling, prefix sharing, preemption and aborts never
break the block manager's invariants, and every block is free again once all requests are done.

No model runs here: a fake step advances `num_computed_tokens` and appends a token, exactly as the
engine does around the model.
"""

from __future__ import annotations

import itertools

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from minivllm.core.kv_cache_manager import BlockManager
from minivllm.core.request import Request, RequestStatus
from minivllm.core.sampling_params import SamplingParams
from minivllm.core.scheduler import Scheduler

# A few shared prefixes so that prefix-cache hits (shared blocks, ref counts > 1) are common.
PREFIXES = [[7] * 12, [1, 2, 3, 4] * 4, list(range(100, 117))]


class EngineModel(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(6, 24), block_size=st.sampled_from([2, 4, 8]),
                caching=st.booleans(), mode=st.sampled_from(["recompute", "swap"]),
                budget=st.integers(3, 64), cpu_blocks=st.integers(0, 12))
    def setup(self, num_blocks, block_size, caching, mode, budget, cpu_blocks):
        self.bm = BlockManager(num_blocks, block_size, caching, num_cpu_blocks=cpu_blocks)
        self.sched = Scheduler(self.bm, max_num_seqs=4, max_num_batched_tokens=budget, preemption_mode=mode)
        self.live: dict[str, Request] = {}
        self.ids = itertools.count()
        self.steps = 0

    @rule(prefix=st.sampled_from(PREFIXES), tail=st.lists(st.integers(0, 50), max_size=12),
          max_tokens=st.integers(1, 16), priority=st.integers(0, 2))
    def add(self, prefix, tail, max_tokens, priority):
        """Two rules add requests (this one and add_more), so the pool is often under pressure."""
        prompt = prefix[:max(1, len(prefix) - len(tail))] + tail
        # The engine refuses requests that could never fit in the pool; so do we.
        if self.bm.blocks_needed(len(prompt) + max_tokens) > self.bm.num_blocks:
            return
        req = Request(str(next(self.ids)), None, prompt, SamplingParams(max_tokens=max_tokens), priority=priority)
        self.live[req.request_id] = req
        self.sched.add_request(req)

    @rule(prefix=st.sampled_from(PREFIXES), max_tokens=st.integers(4, 16))
    def add_more(self, prefix, max_tokens):
        self.add(prefix, [len(self.live)], max_tokens, 0)

    @rule()
    def step(self):
        out = self.sched.schedule()
        assert sum(out.num_scheduled_tokens.values()) <= self.sched.max_num_batched_tokens
        assert len(out.scheduled) <= self.sched.max_num_seqs
        for req in out.scheduled:                         # the model would write KV to these slots
            n = out.num_scheduled_tokens[req.request_id]
            assert self.bm.blocks_needed(req.num_computed_tokens + n) <= len(req.block_table)
        self.sched.update_from_output(out)
        for req in out.scheduled:
            if req.num_computed_tokens == req.num_tokens:  # sampled a token
                req.append_output_token((len(req.all_token_ids) * 31) % 50)
                if req.num_output_tokens >= req.sampling_params.max_tokens:
                    self.sched.finish_request(req, RequestStatus.FINISHED_LENGTH)
                    del self.live[req.request_id]
        self.steps += 1

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def abort(self, data):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        self.sched.finish_request(self.live.pop(rid), RequestStatus.FINISHED_ABORTED)

    @rule()
    def evict_prefix_cache(self):
        self.bm.reset_prefix_cache()

    @invariant()
    def integrity(self):
        if hasattr(self, "bm"):
            self.bm.check_integrity(self.sched.running + self.sched.waiting)

    def teardown(self):
        if not hasattr(self, "bm"):
            return
        for _ in range(2000):                              # drain: everything must finish
            if not self.sched.has_unfinished_requests():
                break
            self.step()
            self.integrity()
        assert not self.sched.has_unfinished_requests(), "requests never finished (livelock)"
        assert self.bm.num_free_blocks == self.bm.num_blocks
        assert len(self.bm.cpu_free) == self.bm.num_cpu_blocks


TestEngineModel = EngineModel.TestCase
TestEngineModel.settings = settings(max_examples=300, stateful_step_count=50, deadline=None,
                                    suppress_health_check=[HealthCheck.too_slow])


def test_prefix_hit_never_covers_the_whole_prompt():
    bm = BlockManager(8, 4)
    a = Request("a", None, list(range(8)), SamplingParams())
    assert bm.allocate_slots(a, 8)                       # the step fills both blocks: hashed now
    b = Request("b", None, list(range(8)), SamplingParams())
    assert len(bm.get_computed_blocks(b)) == 1           # 2 full blocks cached, only 1 reused
    c = Request("c", None, list(range(9)), SamplingParams())
    assert len(bm.get_computed_blocks(c)) == 2


def test_hash_collision_cannot_hand_out_wrong_kv(monkeypatch):
    from minivllm.core import kv_cache_manager as bm_mod

    monkeypatch.setattr(bm_mod, "hash_block_tokens", lambda parent, tokens: 42)   # everything collides
    bm = BlockManager(8, 4)
    a = Request("a", None, [1, 2, 3, 4, 5], SamplingParams())
    assert bm.allocate_slots(a, 5)
    b = Request("b", None, [9, 9, 9, 9, 5], SamplingParams())
    assert bm.get_computed_blocks(b) == []               # same hash, other tokens: no hit


def test_evicts_least_recently_freed_and_tail_blocks_first():
    bm = BlockManager(4, 2)
    a = Request("a", None, [1, 2, 3, 4, 5], SamplingParams())
    assert bm.allocate_slots(a, 5)                       # blocks 0, 1 hashed; block 2 partial
    a.num_computed_tokens = 5                            # the step ran
    bm.free(a)
    assert list(bm.cached_free) == [1, 0] and list(bm.clean_free) == [3, 2]
    b = Request("b", None, [8, 8, 8, 8, 8, 8], SamplingParams())
    assert bm.allocate_slots(b, 6)                        # takes the clean blocks, then evicts block 1
    assert b.block_table == [3, 2, 1] and bm.num_evictions == 1 and list(bm.cached_free) == [0]


def test_same_step_sharing_and_uncomputed_blocks_are_never_cached():
    bm = BlockManager(8, 4)
    a = Request("a", None, list(range(9)), SamplingParams())
    assert bm.allocate_slots(a, 9)                       # hashed at allocation (KV written this step)
    b = Request("b", None, list(range(9)), SamplingParams())
    assert bm.allocate_slots(b, 1, bm.get_computed_blocks(b))     # admitted in the same step: shares 2
    assert b.num_computed_tokens == 8 and b.block_table[:2] == a.block_table[:2]
    bm.check_integrity([a, b])
    bm.free(b)
    bm.free(a)                                           # preempted before its step ran: nothing computed
    assert not bm.hash_to_block and not bm.cached_free   # so none of it may be hit later
    bm.check_integrity([])
