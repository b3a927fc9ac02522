"""Scheduler: which requests run this step, and how many tokens each (vLLM v1's unified scheduler).

Owns: the waiting and running queues, request status, and `num_computed_tokens`: it is the only writer of that
field, as in vLLM v1. It asks the KV cache manager for blocks and never touches ref counts itself. It never runs
the model. It also owns the step's transaction: `begin_step()` opens the journal, `commit_step()` keeps what the
step did, `rollback_step()` undoes all of it (see journal.py).

There is no separate "prefill phase": every step, each scheduled request gets
    num_new_tokens = num_tokens - num_computed_tokens   (capped by the step's token budget)
which is the whole prompt for a new request, a chunk of it when the budget is short (chunked prefill),
and 1 for a request that is decoding. So one flat batch mixes prefills and decodes.

Order within a step:
  1. running requests, decodes first, then unfinished prefill chunks;
     a request that needs a block when none is free preempts the lowest-priority running request, and among
     equals the latest to arrive (possibly itself), as vLLM does;
  2. waiting requests by (priority, arrival), while the token budget, max_num_seqs and the free blocks
     allow; skipped in a step that preempted (the pool is full, admitting more would thrash).
     Preempted requests re-enter this queue by their original arrival, so they come back first.

A step's life:  begin_step -> schedule -> (model forward, sampling: not here) -> update_from_output
                -> finish_request for stop strings -> commit_step        (or rollback_step if anything raised)

Batches in flight (pipeline parallelism, vLLM v1's batch queue): with `max_concurrent_batches` k > 1 the engine
schedules the next batch while up to k - 1 earlier ones are still in later pipeline stages. A request is in flight
from the schedule that puts it in a batch to the `update_from_output` of that batch: it is never scheduled again,
preempted or given new tokens in between (its next token is not known yet). Each batch takes at most
ceil(n / k) requests, n being the unfinished requests (at most max_num_seqs): the k batches share them evenly,
so every stage has work (one batch would take them all, and the next would find none).

    k = 2, four decoding requests:   batch 7 = [A B]  (in stage 1)     batch 8 = [C D]  (in stage 0)
                                     A, B come back with batch 7's tokens; batch 9 takes them again

Async scheduling (vLLM's `async_scheduling`): the engine schedules batch N + 1 while batch N is still on the
device, so the host's work (this plan, the inputs, applying batch N's tokens, the text) overlaps the device's. A
request of batch N may then be scheduled again before N's token is known: `num_computed_ahead` says how many of
its tokens batch N computes (the next batch starts after them), and `num_output_placeholders` that batch N samples
one token for it, which the model runner takes from batch N's device tensor as the next input. Only a request
whose sampling does not read its own output tokens (no penalties, bad words, min_tokens, grammar) and that cannot
reach max_tokens with the pending token runs ahead; it is never preempted while in flight. If batch N's token
stops it, its token from batch N + 1 is dropped (one wasted row, as in vLLM).

    async, decoding A:   batch 7 = [A: position 20]   batch 8 = [A: position 21, input = batch 7's token for A]
                         A is in flight in both; batch 7's output moves num_computed_tokens to 21, batch 8's to 22

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

from minivllm.core.kv_cache_manager import KVCacheManager
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

    @property
    def is_empty(self) -> bool:
        """Nothing to run and nothing to copy."""
        return not (self.scheduled or self.blocks_to_swap_out or self.blocks_to_swap_in)


@dataclass
class EngineCoreOutput:
    """What one request got from a committed step (vLLM v1's name): the new tokens (one, or with speculative
    decoding the accepted drafts and one more), and how it ended if it did."""
    request: Request
    new_token_ids: list[int]
    finish_status: RequestStatus | None = None      # FINISHED_* when the core stopped it (EOS, stop token, length)
    num_accepted_drafts: int = 0                    # speculative decoding: drafts the verification accepted


def plan_ahead(num_tokens: int, num_computed_tokens: int, num_in_flight: int) -> tuple[int, int]:
    """Where a running request's next batch starts, and how many tokens it has left to compute from there:
    (start, num_left). `num_in_flight`: its tokens in a batch whose output has not come back (async scheduling;
    0 otherwise). The next batch starts after them; if that batch computes the whole sequence, it also samples
    the next token, which the next batch must compute too (its placeholder: num_left counts it).

        prompt of 10, 4 computed, a chunk of 6 in flight:   start 10, 1 left (the token that chunk samples)
        prompt of 10, 4 computed, a chunk of 3 in flight:   start 7, 3 left (the rest of the prompt)
        decoding, 20 of 21 computed, nothing in flight:     start 20, 1 left"""
    start = num_computed_tokens + num_in_flight
    placeholder = int(num_in_flight > 0 and start >= num_tokens)
    return start, num_tokens + placeholder - start


class Scheduler:
    def __init__(self, kv_cache_manager: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, preemption_mode: str = "recompute", max_concurrent_batches: int = 1,
                 async_scheduling: bool = False):
        if preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode is {preemption_mode!r}; choose 'recompute' or 'swap'.")
        self.kv_cache_manager = kv_cache_manager
        self.journal = kv_cache_manager.journal
        self.block_size = kv_cache_manager.block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.preemption_mode = preemption_mode
        self.max_concurrent_batches = max_concurrent_batches
        self.async_scheduling = async_scheduling
        # Running requests in a batch whose output has not come back -> their tokens scheduled in such batches.
        self.in_flight: dict[Request, int] = {}
        self.waiting: list[Request] = []     # sorted by (priority, arrival_time, admission order)
        self.running: list[Request] = []
        self.num_preemptions = 0
        # Speculative decoding (vLLM's spec-decode counters): steps with drafts, draft tokens verified, accepted;
        # accepted per draft position.
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_accepted_tokens_per_pos: list[int] = []
        self._swap_out: list[tuple[int, int]] = []     # filled by _preempt during schedule()
        self._order = itertools.count()
        self._keys: dict[str, tuple] = {}
        self._events_at_begin: tuple[int, ...] = ()

    # ------------------------------------------------------------------ queues
    def add_request(self, request: Request) -> None:
        """Queue a new request. Called between steps only: it is final at once."""
        assert not self.journal.is_open, "requests are added between steps"
        self._keys[request.request_id] = (request.priority, request.arrival_time, next(self._order))
        self._push_waiting(request)

    def _push_waiting(self, request: Request) -> None:
        bisect.insort(self.waiting, request, key=lambda r: self._keys[r.request_id])
        self.journal.record(lambda: self.waiting.remove(request))

    def _remove(self, queue: list[Request], request: Request) -> None:
        i = queue.index(request)
        del queue[i]
        self.journal.record(lambda: queue.insert(i, request))

    def _append_running(self, request: Request) -> None:
        self.running.append(request)
        self.journal.record(self.running.pop)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ the transaction
    def begin_step(self) -> None:
        self.journal.begin()
        self._events_at_begin = self.kv_cache_manager.block_pool.events.lengths()

    def commit_step(self) -> None:
        self.journal.commit()
        self.kv_cache_manager.clear_pending()       # same-step offers end with their step

    def rollback_step(self) -> None:
        """Undo everything since `begin_step()`. Then, because the failed forward may have written the KV of
        every block the step handed out, no cache entry and no request keeps trusting those blocks."""
        events = self.kv_cache_manager.block_pool.events
        written = set(events.allocated[self._events_at_begin[0]:])
        self.journal.rollback()
        events.truncate(self._events_at_begin)
        for req, num_tokens in self.kv_cache_manager.distrust(written, self.running).items():
            req.num_computed_tokens = min(req.num_computed_tokens, num_tokens)

    # ------------------------------------------------------------------ the step
    def schedule(self) -> SchedulerOutput:
        kv, j = self.kv_cache_manager, self.journal
        budget = self.max_num_batched_tokens
        scheduled: dict[Request, int] = {}
        preempted: list[Request] = []
        self._swap_out = []
        swap_in: list[tuple[int, int]] = []
        spec: dict[str, list[int]] = {}

        ahead: dict[str, int] = {}
        placeholders: dict[str, int] = {}

        cap = -(-min(len(self.running) + len(self.waiting), self.max_num_seqs) // self.max_concurrent_batches)
        # 1. Running requests: decodes (1 token left to compute) before prefill chunks; not those in flight (unless
        #    async scheduling lets them run ahead).
        for req in sorted(self.running, key=lambda r: self._tokens_left(r) > 1):
            if budget == 0 or len(scheduled) == cap:
                break
            if req.status is not RequestStatus.RUNNING:            # preempted in this step
                continue
            k = self.in_flight.get(req, 0)
            if k and not self._can_run_ahead(req, k):
                continue
            start, left = plan_ahead(req.num_tokens, req.num_computed_tokens, k)
            p = start + left - req.num_tokens                # 1: the batch in flight samples its next input
            n = min(left, budget)
            drafts = req.spec_token_ids if n == 1 and req.num_computed_tokens == req.num_tokens - 1 and not k else []
            drafts = drafts[:budget - n]                 # a decode verifies its drafts in the same step
            n += len(drafts)
            if k:          # in flight: room after the tokens its batch computes, or it waits (never preempted)
                if kv.allocate_slots(req, k + n):
                    scheduled[req] = n
                    budget -= n
                    ahead[req.request_id] = k
                    if p:
                        placeholders[req.request_id] = p
                continue
            while not kv.allocate_slots(req, n):
                victim = max((r for r in self.running if r not in self.in_flight),     # lowest priority, latest
                             key=lambda r: self._keys[r.request_id])
                if victim in scheduled:                         # give back its share of this step
                    budget += scheduled.pop(victim)
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
            else:
                scheduled[req] = n
                budget -= n
                if drafts:
                    spec[req.request_id] = list(drafts)

        # Offer the blocks this step completes to requests admitted below (same-step prefix sharing); a draft is
        # not a token of the request yet, so its block is not offered. Not under async scheduling: the step ends
        # with its batch still in flight, and a request admitted on such a block would count as computed tokens
        # whose KV is not there yet (vLLM v1 shares no blocks within a step either).
        for req, n in scheduled.items():
            if not self.async_scheduling:
                kv.register_pending(req, req.num_computed_tokens + n - len(spec.get(req.request_id, ())))

        # 2. Waiting requests, in priority then arrival order.
        admitted: list[str] = []
        while (self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and len(scheduled) < cap
               and not preempted):
            req = self.waiting[0]
            if req.status is RequestStatus.SWAPPED:              # its KV is in the CPU pool: bring it back
                n = min(req.num_tokens - req.num_computed_tokens, budget)
                if not kv.can_swap_in(req, n):
                    break
                swap_in += kv.swap_in(req)
                allocated = kv.allocate_slots(req, n)
                assert allocated, "can_swap_in promised room for the new tokens"
            else:
                computed = kv.get_computed_blocks(req)
                num_cached = len(computed) * self.block_size
                n = min(req.num_tokens - num_cached, budget)
                if not kv.allocate_slots(req, n, computed):
                    break                                        # no room: it waits, in order
                j.set(req, "num_computed_tokens", num_cached)
                if req.status is RequestStatus.WAITING:          # first admission: record prefix hits
                    j.set(req, "num_cached_tokens", num_cached)
            self._remove(self.waiting, req)
            j.set(req, "status", RequestStatus.RUNNING)
            self._append_running(req)
            admitted.append(req.request_id)
            scheduled[req] = n
            budget -= n
            if not self.async_scheduling:
                kv.register_pending(req, req.num_computed_tokens + n)

        out = SchedulerOutput(scheduled=list(scheduled),
                              num_scheduled_tokens={r.request_id: n for r, n in scheduled.items()},
                              preempted=preempted, newly_admitted=admitted,
                              blocks_to_swap_out=self._swap_out, blocks_to_swap_in=swap_in,
                              scheduled_spec_decode_tokens=spec, num_computed_ahead=ahead,
                              num_output_placeholders=placeholders)
        for req, n in scheduled.items():
            self._set_in_flight(req, self.in_flight.get(req, 0) + n)
        for req, n in scheduled.items():
            # A decode computes the one token sampled last step (and verifies its drafts, if any); anything else is
            # (a chunk of) a prefill, including a preempted request recomputing its prompt and outputs.
            n -= len(spec.get(req.request_id, ()))
            p = placeholders.get(req.request_id, 0)
            start = req.num_computed_tokens + ahead.get(req.request_id, 0)
            is_decode = n == 1 and req.num_output_tokens + p > 0 and start == req.num_tokens + p - 1
            out.kinds[req.request_id] = "decode" if is_decode else "prefill"
            if is_decode:
                out.num_decode_tokens += n + len(spec.get(req.request_id, ()))
            else:
                out.num_prefill_tokens += n
        return out

    def _tokens_left(self, req: Request) -> int:
        """Tokens the request still has to run through the model, counting what its batch in flight computes."""
        return plan_ahead(req.num_tokens, req.num_computed_tokens, self.in_flight.get(req, 0))[1]

    def _can_run_ahead(self, req: Request, k: int) -> bool:
        """Async scheduling: may a request whose batch in flight computes `k` of its tokens join the next batch?
        The rest of a prompt may (its tokens are known). A token still being sampled may be the next input only if
        the request's sampling reads no output tokens of its own, and that token cannot end it by length."""
        if not self.async_scheduling:
            return False
        if req.num_computed_tokens + k < req.num_tokens:          # its batch computes a prefill chunk, samples nothing
            return True
        sp = req.sampling_params
        return (not sp.uses_logits_processing and req.grammar is None
                and req.num_output_tokens + 1 < sp.max_tokens and req.num_tokens + 1 < self.max_model_len)

    def _set_in_flight(self, req: Request, k: int) -> None:
        """in_flight[req] = k (0 removes it), journaled."""
        old = self.in_flight.get(req, 0)
        if k:
            self.in_flight[req] = k
        else:
            self.in_flight.pop(req, None)

        def undo() -> None:
            if old:
                self.in_flight[req] = old
            else:
                self.in_flight.pop(req, None)
        self.journal.record(undo)

    def _preempt(self, req: Request) -> None:
        """Send a running request back to the waiting queue, its KV swapped out or dropped."""
        kv, j = self.kv_cache_manager, self.journal
        self._remove(self.running, req)
        if req in self.in_flight:             # (never chosen by schedule(); its batch's output would be dropped)
            self._set_in_flight(req, 0)
        if self.preemption_mode == "swap" and kv.can_swap_out(req):
            self._swap_out += kv.swap_out(req)
            j.set(req, "status", RequestStatus.SWAPPED)
        else:
            kv.free(req)
            j.set(req, "num_computed_tokens", 0)
            j.set(req, "status", RequestStatus.PREEMPTED)
        j.set(req, "num_preemptions", req.num_preemptions + 1)
        j.set(self, "num_preemptions", self.num_preemptions + 1)
        self._push_waiting(req)

    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, list[int] | int]) -> list[EngineCoreOutput]:
        """After the model ran: the scheduled tokens now have KV (their full blocks join the prefix cache), and each
        request in `sampled` (request_id -> tokens: one, or with speculative decoding its accepted drafts and one
        more) gets its new tokens, and its grammar (structured output) accepts them. Stops what must stop: EOS, a
        stop token, max_tokens, max_model_len; the tokens after the stop are dropped (never more than asked).
        Stop strings are the output processor's to find (it calls finish_request).

        With drafts: the step computed KV for the last token and every draft; only the accepted drafts' KV is kept
        (num_computed_tokens covers them), the rejected ones' slots are overwritten by the next step, and the
        prefix cache only ever hashes blocks of accepted tokens."""
        j = self.journal
        outputs = []
        for req in out.scheduled:
            if req not in self.in_flight:                   # finished (aborted) while its batch was in flight
                continue
            num_scheduled = out.num_scheduled_tokens[req.request_id]
            self._set_in_flight(req, self.in_flight[req] - num_scheduled)   # > 0: a later batch runs ahead of it
            tokens = sampled.get(req.request_id)
            if tokens is None:                              # a prefill chunk that does not end the prompt
                j.set(req, "num_computed_tokens", req.num_computed_tokens + num_scheduled)
                self.kv_cache_manager.cache_blocks(req, req.num_computed_tokens)
                continue
            if isinstance(tokens, int):
                tokens = [tokens]
            drafts = out.scheduled_spec_decode_tokens.get(req.request_id)
            accepted = self._count_accepted(drafts, tokens) if drafts else 0
            status, kept = None, []
            for token in tokens:
                status = self._append_token(req, token)
                kept.append(token)
                if status is not None:
                    break
            # KV is valid for every token but the newest (accepted drafts included, rejected ones not).
            j.set(req, "num_computed_tokens", min(req.num_computed_tokens + num_scheduled, req.num_tokens - 1))
            self.kv_cache_manager.cache_blocks(req, req.num_computed_tokens)
            if req.spec_token_ids:
                j.set(req, "spec_token_ids", [])            # verified (or dropped): the proposer makes new ones
            if status is not None:
                self.finish_request(req, status)
            outputs.append(EngineCoreOutput(req, kept, status, accepted))
        return outputs

    def _append_token(self, req: Request, token: int) -> RequestStatus | None:
        """Append one new token (journaled), advance the grammar; the status it ends the request with, if any."""
        j = self.journal
        req.append_output_token(token)
        j.record(req.pop_output_token)
        grammar = req.grammar
        if grammar is not None and not grammar.is_terminated:
            if not grammar.accept(token):        # the bitmask allowed only tokens the grammar accepts
                raise RuntimeError(f"request {req.request_id}: token {token} was sampled but its grammar "
                                   f"({grammar.describe()}) does not accept it")
            j.record(grammar.rollback)
        sp = req.sampling_params
        if not sp.ignore_eos and token in req.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if grammar is not None and grammar.is_terminated:     # ignore_eos: nothing may follow the grammar
            return RequestStatus.FINISHED_STOPPED
        if token in sp.stop_token_ids:
            j.set(req, "stop_reason", token)
            return RequestStatus.FINISHED_STOPPED
        if req.num_output_tokens >= sp.max_tokens or req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _count_accepted(self, drafts: list[int], tokens: list[int]) -> int:
        """vLLM's spec-decode counters: the accepted drafts are the leading tokens that equal the drafts (counted
        as verified, also past a stop that then drops them). Returns how many."""
        j = self.journal
        accepted = 0
        while accepted < min(len(drafts), len(tokens) - 1) and tokens[accepted] == drafts[accepted]:
            accepted += 1
        j.set(self, "num_drafts", self.num_drafts + 1)
        j.set(self, "num_draft_tokens", self.num_draft_tokens + len(drafts))
        j.set(self, "num_accepted_tokens", self.num_accepted_tokens + accepted)
        per_pos = list(self.num_accepted_tokens_per_pos) + [0] * (len(drafts) - len(self.num_accepted_tokens_per_pos))
        for i in range(accepted):
            per_pos[i] += 1
        j.set(self, "num_accepted_tokens_per_pos", per_pos)
        return accepted

    def update_draft_token_ids(self, drafts: dict[str, list[int]]) -> None:
        """The proposer's drafts for the next step (request_id -> tokens), journaled. A request with a grammar keeps
        only the drafts its grammar accepts; a finished or non-running request gets none."""
        for req in self.running:
            tokens = drafts.get(req.request_id)
            if not tokens:
                continue
            if req.grammar is not None:
                tokens = req.grammar.validate_tokens(tokens)
            if tokens:
                self.journal.set(req, "spec_token_ids", list(tokens))

    def drop_output_tokens(self, req: Request, num_tokens: int) -> None:
        """Take back the last `num_tokens` output tokens of a request that is about to finish on a stop string
        (speculative decoding can add tokens past it in the same step). Journaled."""
        for _ in range(num_tokens):
            token = req.output_token_ids[-1]
            req.pop_output_token()
            self.journal.record(lambda t=token: req.append_output_token(t))

    # ------------------------------------------------------------------ leaving
    def finish_request(self, req: Request, status: RequestStatus, stop_reason: int | str | None = None) -> None:
        """Remove a request wherever it is and free its blocks. Safe to call in any state."""
        assert status.finished
        kv, j = self.kv_cache_manager, self.journal
        if req.status is RequestStatus.RUNNING:
            self._remove(self.running, req)
            if req in self.in_flight:                       # its batch's output will be dropped
                self._set_in_flight(req, 0)
        elif not req.is_finished:
            self._remove(self.waiting, req)
        if req.status is RequestStatus.SWAPPED:
            kv.free_swapped(req)
        kv.free(req)
        j.set(req, "status", status)
        if stop_reason is not None:
            j.set(req, "stop_reason", stop_reason)
        key = self._keys.pop(req.request_id, None)
        if key is not None:
            j.record(lambda: self._keys.__setitem__(req.request_id, key))

    # ------------------------------------------------------------------ introspection
    @property
    def num_swapped(self) -> int:
        return len(self.kv_cache_manager.swap_space.tables)

    def check_integrity(self) -> None:
        """Assert the scheduler's and the KV cache's invariants. For tests and debug runs."""
        assert not self.journal.is_open, "a step is still open"
        for req in self.running:
            assert req.status is RequestStatus.RUNNING, f"{req} is in the running queue"
            assert len(req.block_table) >= self.kv_cache_manager.blocks_needed(req.num_computed_tokens), (
                f"{req}: fewer blocks than computed tokens")
        for req in self.waiting:
            assert req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED, RequestStatus.SWAPPED), req
            assert not req.block_table, f"{req} waits while holding blocks"
            assert (req.request_id in self.kv_cache_manager.swap_space.tables) == (
                req.status is RequestStatus.SWAPPED), f"{req}: swapped status and CPU blocks disagree"
            assert req.status is RequestStatus.SWAPPED or req.num_computed_tokens == 0, (
                f"{req} waits with {req.num_computed_tokens} computed tokens but no KV")
        assert set(self.in_flight) <= set(self.running), "a request in flight is not running"
        live = self.running + self.waiting
        assert len(set(live)) == len(live), "a request is queued twice"
        assert {r.request_id for r in live} == set(self._keys), "the queues and the priority keys disagree"
        self.kv_cache_manager.check_integrity(live)
