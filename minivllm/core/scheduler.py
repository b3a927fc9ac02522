"""Scheduler: which requests run this step, and how many tokens each (vLLM v1's unified scheduler).

Owns: the waiting and running queues, request status, and advancing `num_computed_tokens`. It asks the
block manager for KV blocks and never touches ref counts itself. It never runs the model.

There is no separate "prefill phase": every step, each scheduled request gets
    num_new_tokens = num_tokens - num_computed_tokens   (capped by the step's token budget)
which is the whole prompt for a new request, a chunk of it when the budget is short (chunked prefill),
and 1 for a request that is decoding. So one flat batch mixes prefills and decodes.

Order within a step:
  1. running requests, decodes first, then unfinished prefill chunks;
     a request that needs a block when none is free preempts the lowest-priority, latest-arrived
     running request (possibly itself);
  2. waiting requests by (priority, arrival), while the token budget, max_num_seqs and the free blocks
     allow; skipped in a step that preempted (the pool is full, admitting more would thrash).
     Preempted requests re-enter this queue by their original arrival, so they come back first.

Preemption modes (vLLM's names):
    recompute  drop the KV; the request re-runs its prompt + outputs as one prefill when it returns
               (its full blocks stay in the prefix cache, so it often hits them)
    swap       copy its blocks to a CPU pool; copy them back when it returns (falls back to recompute
               when the CPU pool is full)
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass, field

from minivllm.core.kv_cache_manager import BlockManager
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

    @property
    def is_empty(self) -> bool:
        """Nothing to run and nothing to copy."""
        return not (self.scheduled or self.blocks_to_swap_out or self.blocks_to_swap_in)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 preemption_mode: str = "recompute"):
        if preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode is {preemption_mode!r}; choose 'recompute' or 'swap'.")
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.preemption_mode = preemption_mode
        self.waiting: list[Request] = []     # sorted by (priority, arrival_time, admission order)
        self.running: list[Request] = []
        self.num_preemptions = 0
        self._swap_out: list[tuple[int, int]] = []     # filled by _preempt during schedule()
        self._order = itertools.count()
        self._keys: dict[str, tuple] = {}

    # ------------------------------------------------------------------ queues
    def add_request(self, request: Request) -> None:
        self._keys[request.request_id] = (request.priority, request.arrival_time, next(self._order))
        self._push_waiting(request)

    def _push_waiting(self, request: Request) -> None:
        bisect.insort(self.waiting, request, key=lambda r: self._keys[r.request_id])

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ the step
    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        scheduled: dict[Request, int] = {}
        preempted: list[Request] = []
        self._swap_out: list[tuple[int, int]] = []
        swap_in: list[tuple[int, int]] = []

        # 1. Running requests: decodes (1 token left to compute) before prefill chunks.
        for req in sorted(self.running, key=lambda r: r.num_tokens - r.num_computed_tokens > 1):
            if budget == 0:
                break
            if req.status is not RequestStatus.RUNNING:      # preempted earlier in this loop
                continue
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self.block_manager.allocate_slots(req, n):
                victim = max(self.running, key=lambda r: self._keys[r.request_id][:2])
                if victim in scheduled:                         # give back its share of this step
                    budget += scheduled.pop(victim)
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
            else:
                scheduled[req] = n
                budget -= n

        # 2. Waiting requests, in priority then arrival order.
        admitted: list[str] = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not preempted:
            req = self.waiting[0]
            if req.status is RequestStatus.SWAPPED:              # its KV is in the CPU pool: bring it back
                n = min(req.num_tokens - req.num_computed_tokens, budget)
                if not self.block_manager.can_swap_in(req, n):
                    break
                swap_in += self.block_manager.swap_in(req)
                allocated = self.block_manager.allocate_slots(req, n)
                assert allocated, "can_swap_in promised room for the new tokens"
            else:
                computed = self.block_manager.get_computed_blocks(req)
                n = min(req.num_tokens - req.num_computed_tokens - len(computed) * self.block_manager.block_size,
                        budget)
                if not self.block_manager.allocate_slots(req, n, computed):
                    break                                        # no room: it waits, in order
            self.waiting.pop(0)
            if req.status is RequestStatus.WAITING:              # first admission: record prefix hits
                req.num_cached_tokens = len(computed) * self.block_manager.block_size
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            admitted.append(req.request_id)
            scheduled[req] = n
            budget -= n

        out = SchedulerOutput(scheduled=list(scheduled),
                              num_scheduled_tokens={r.request_id: n for r, n in scheduled.items()},
                              preempted=preempted, newly_admitted=admitted,
                              blocks_to_swap_out=self._swap_out, blocks_to_swap_in=swap_in)
        for req, n in scheduled.items():
            # A decode computes the one token sampled last step; anything else is (a chunk of) a prefill,
            # including a preempted request recomputing its prompt and outputs.
            is_decode = n == 1 and req.num_output_tokens > 0 and req.num_computed_tokens == req.num_tokens - 1
            out.kinds[req.request_id] = "decode" if is_decode else "prefill"
            if is_decode:
                out.num_decode_tokens += n
            else:
                out.num_prefill_tokens += n
        return out

    def _preempt(self, req: Request) -> None:
        """Send a running request back to the waiting queue, its KV swapped out or dropped."""
        self.running.remove(req)
        if self.preemption_mode == "swap" and self.block_manager.can_swap_out(req):
            self._swap_out += self.block_manager.swap_out(req)
            req.status = RequestStatus.SWAPPED
        else:
            self.block_manager.free(req)      # also resets num_computed_tokens to 0
            req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self._push_waiting(req)

    def update_from_output(self, out: SchedulerOutput) -> None:
        """After the model ran: the scheduled tokens now have KV."""
        for req in out.scheduled:
            req.num_computed_tokens += out.num_scheduled_tokens[req.request_id]

    # ------------------------------------------------------------------ leaving
    def finish_request(self, req: Request, status: RequestStatus) -> None:
        """Remove a request wherever it is and free its blocks. Safe to call in any state."""
        assert status.finished
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        if req.status is RequestStatus.SWAPPED:
            self.block_manager.free_swapped(req)
        self.block_manager.free(req)
        req.status = status
        self._keys.pop(req.request_id, None)
