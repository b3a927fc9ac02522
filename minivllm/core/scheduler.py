"""Scheduler: which requests run this step, and how many tokens each (vLLM v1's unified scheduler).

Owns: the waiting and running queues, request status, and `num_computed_tokens`: it is the only writer of that
field, as in vLLM v1. It asks the KV cache manager for blocks and never touches ref counts itself, nor runs the
model. It owns the step's transaction: `begin_step()` opens the journal, `commit_step()` keeps what the step did,
`rollback_step()` undoes all of it (see journal.py).

There is no separate "prefill phase": every step, each scheduled request gets
    num_new_tokens = num_tokens - num_computed_tokens   (capped by the budget left and long_prefill_token_threshold)
which is the whole prompt for a new request, a chunk of it when a cap is lower (chunked prefill; with it off,
a prompt that does not fit whole waits), and 1 for a request that is decoding: one flat batch mixes both.

Order within a step:
  1. running requests, decodes first, then unfinished prefill chunks;
     a request that needs a block when none is free preempts the lowest-priority running request, and among
     equals the latest to arrive (possibly itself), as vLLM does;
  2. waiting requests by (priority, arrival), while the token budget, max_num_seqs and the free blocks allow;
     none in a step that preempted (the pool is full, admitting more would thrash). Preempted requests re-enter
     this queue by their original arrival, so they come back first.

A step: begin_step -> schedule -> (the model runs) -> update_from_output -> finish_request -> commit_step (or rollback)

Other modes plug in at named seams and cost this file nothing when they are off:
    batches in flight (async scheduling, pipeline parallelism)   AsyncScheduler, a subclass (async_scheduler.py)
    speculative decoding                           _drafts_to_verify, update_draft_token_ids, spec_decoding_stats
    structured output                                            _advance_grammar
    swap preemption (recompute drops the KV; swap copies it to a CPU pool and back)  _preempt, _swap_in
    KV transfer between instances (prefill/decode disaggregation)  `connector` (kv_transfer/)
    images (a vision-language model's encoder cache)               `encoder_cache_manager`, in _chunk
    chunked prefill off (a prompt runs whole or waits)             `enable_chunked_prefill`, in _chunk
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Mapping
from types import MappingProxyType

from minivllm.core.invariants import check_scheduler
from minivllm.core.journal import Journaled
from minivllm.core.kv_cache_manager import KVCacheManager
from minivllm.core.request import Request, RequestFailedError, RequestStatus
from minivllm.core.scheduler_output import EngineCoreOutput, SchedulerOutput
from minivllm.spec_decode.metrics import SpecDecodingStats

__all__ = ["EngineCoreOutput", "Scheduler", "SchedulerOutput"]

class Scheduler(Journaled):
    JOURNALED = frozenset({"num_preemptions"})      # a counter a failed step must not move (journal.py)
    async_scheduling = False
    # Requests in a batch whose output has not come back -> their tokens in such batches: none here, every batch
    # comes back within its step (AsyncScheduler keeps batches in flight).
    in_flight: Mapping[Request, int] = MappingProxyType({})
    connector = None         # KV transfer's scheduler side (kv_transfer/base.py), set by the engine; None: no transfer
    encoder_cache_manager = None    # images: the encoder cache (encoder_cache_manager.py), set by the engine for a VLM
    enable_chunked_prefill = True   # False (set by the engine): a prompt runs whole in one step or waits (_chunk)

    def __init__(self, kv_cache_manager: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, preemption_mode: str = "recompute", long_prefill_token_threshold: int = 0):
        if preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode is {preemption_mode!r}; choose 'recompute' or 'swap'.")
        self.kv_cache_manager = kv_cache_manager
        self.journal, self.block_size = kv_cache_manager.journal, kv_cache_manager.block_size
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.long_prefill_token_threshold = long_prefill_token_threshold     # 0: a prefill takes what the budget has
        self.max_model_len, self.preemption_mode = max_model_len, preemption_mode
        self.waiting: list[Request] = []     # sorted by (priority, arrival_time, admission order)
        self.running: list[Request] = []     # in admission order
        self.num_preemptions = 0
        self.spec_decoding_stats = SpecDecodingStats(self.journal)      # speculative decoding's counters
        self._order, self._keys = itertools.count(), {}    # admissions counted; request_id -> (priority, arrival, n)
        self._events_at_begin: tuple[int, ...] = ()

    # ------------------------------------------------------------------ queues
    def add_request(self, request: Request) -> None:
        """Queue a new request (between steps only: final at once)."""
        assert not self.journal.is_open, "requests are added between steps"
        request.journal = self.journal
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
        """Undo everything since `begin_step()`; the blocks the step handed out may hold its KV: distrust them."""
        events = self.kv_cache_manager.block_pool.events
        written = set(events.allocated[self._events_at_begin[0]:])
        self.journal.rollback()
        events.truncate(self._events_at_begin)
        for req, num_tokens in self.kv_cache_manager.distrust(written, self.running).items():
            req.num_computed_tokens = min(req.num_computed_tokens, num_tokens)

    # ------------------------------------------------------------------ the step
    def schedule(self) -> SchedulerOutput:
        """This step's batch: which requests run and how many tokens each. Allocates their blocks (preempting
        when the pool is full); `num_computed_tokens` moves only when the output comes back (update_from_output)."""
        kv = self.kv_cache_manager
        out = SchedulerOutput([], {})
        budget = self.max_num_batched_tokens          # tokens this step may compute, prefills and decodes together
        max_batch = self._max_batch_size()
        # 1. Running requests: decodes (one token left to compute) first, then the next chunks of long prompts.
        for req in sorted(self._runnable(), key=lambda r: self._num_tokens_left(r) > 1):
            if budget == 0 or len(out.scheduled) == max_batch:
                break
            n = self._chunk(req, self._num_tokens_left(req), budget, out)  # a whole prompt, a chunk, or 1 to decode
            if req.status is not RequestStatus.RUNNING or n == 0:  # preempted earlier in this step, or no room yet
                continue
            drafts = self._drafts_to_verify(req, n, budget)    # speculative decoding: checked in the same pass
            while not self._allocate(req, n + len(drafts)):
                victim = self._choose_victim(req)              # no free block: the lowest priority, latest
                if victim is None:
                    break
                budget += self._take_from_batch(out, victim)   # give back its share of this step
                out.blocks_to_swap_out += self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            else:
                self._add_to_batch(out, req, n, drafts)
                budget -= n + len(drafts)
        self._offer_blocks(out, out.scheduled)                 # same-step prefix sharing with the admissions below
        # 2. Waiting requests by (priority, arrival), while room is left; none after a preemption (the pool is full).
        while (self.waiting and budget > 0 and len(self.running) < self.max_num_seqs
               and len(out.scheduled) < max_batch and not out.preempted):
            req = self.waiting[0]
            if req.status is RequestStatus.SWAPPED:            # its KV is in the CPU pool: bring it back
                n = self._swap_in(req, budget, out)
            else:
                computed = kv.get_computed_blocks(req)         # prefix-cache hits: whole blocks, from the start
                num_cached = len(computed) * self.block_size
                # KV transfer: prompt tokens past the hits that another instance computed, loaded instead
                num_external = self.connector.get_num_new_matched_tokens(req, num_cached) if self.connector else 0
                n = self._chunk(req, req.num_tokens - num_cached - num_external, budget, out)
                if n == 0 or not kv.allocate_slots(req, num_external + n, computed):
                    n = 0
                else:
                    req.num_computed_tokens = num_cached + num_external
                    if req.status is RequestStatus.WAITING:    # first admission: record its prefix hits
                        req.num_cached_tokens = num_cached + num_external
                    if num_external:
                        self.connector.update_state_after_alloc(req, num_external)
            if n == 0:
                break                                          # no room: it waits, and everyone behind it
            self._remove(self.waiting, req)
            req.status = RequestStatus.RUNNING
            self._append_running(req)
            out.newly_admitted.append(req.request_id)
            self._add_to_batch(out, req, n, [])
            budget -= n
            self._offer_blocks(out, [req])
        self._update_after_schedule(out)
        return out

    # The seams of schedule(): AsyncScheduler (async_scheduler.py) overrides them for batches in flight.
    def _runnable(self) -> list[Request]:
        """The running requests that may join this batch: all of them."""
        return self.running

    def _max_batch_size(self) -> int:
        return self.max_num_seqs

    def _num_tokens_left(self, req: Request) -> int:
        """Tokens the request still has to run through the model: 1 when it is decoding."""
        return req.num_tokens - req.num_computed_tokens

    def _chunk(self, req: Request, num_tokens_left: int, budget: int, out: SchedulerOutput) -> int:
        """What it has left, within the budget and (vLLM's rule) long_prefill_token_threshold when that is set;
        with images, up to the first one whose encoder output can be neither had nor made room for (0: none).
        With chunked prefill off, all it has left or nothing."""
        n = min(num_tokens_left, budget, self.long_prefill_token_threshold or num_tokens_left)
        if self.encoder_cache_manager is not None and req.mm_features:
            n = self.encoder_cache_manager.fit(req, req.num_tokens - num_tokens_left, n, out)
        return n if self.enable_chunked_prefill or n == num_tokens_left else 0

    def _drafts_to_verify(self, req: Request, n: int, budget: int) -> list[int]:
        """Speculative decoding: drafts to verify with a decoding request's last token (vLLM's caps on 1 + drafts)."""
        if n == 1 and req.num_computed_tokens == req.num_tokens - 1:
            return req.spec_token_ids[:min(budget, self.long_prefill_token_threshold or budget) - n]
        return []

    @staticmethod
    def _add_to_batch(out: SchedulerOutput, req: Request, num_tokens: int, drafts: list[int]) -> None:
        """Put `req` in the batch with `num_tokens` tokens to compute, then its `drafts` to verify."""
        out.scheduled.append(req)
        out.num_scheduled_tokens[req.request_id] = num_tokens + len(drafts)
        if drafts:
            out.scheduled_spec_decode_tokens[req.request_id] = list(drafts)

    @staticmethod
    def _take_from_batch(out: SchedulerOutput, req: Request) -> int:
        """Take `req` out of the batch (preempted after it was scheduled); the tokens it gives back."""
        if req not in out.scheduled:
            return 0
        out.scheduled.remove(req)
        out.scheduled_spec_decode_tokens.pop(req.request_id, None)
        return out.num_scheduled_tokens.pop(req.request_id)

    def _allocate(self, req: Request, num_tokens: int) -> bool:
        return self.kv_cache_manager.allocate_slots(req, num_tokens)

    def _choose_victim(self, req: Request) -> Request | None:
        """Who is preempted when `req` finds no free block: the lowest priority, latest (possibly `req`)."""
        return max(self.running, key=lambda r: self._keys[r.request_id])

    def _offer_blocks(self, out: SchedulerOutput, requests: list[Request]) -> None:
        """Offer the full blocks these requests compute this step to later admissions (not a draft's block)."""
        for req in requests:
            num_drafts = len(out.scheduled_spec_decode_tokens.get(req.request_id, ()))
            self.kv_cache_manager.register_pending(
                req, req.num_computed_tokens + out.num_scheduled_tokens[req.request_id] - num_drafts)

    def _update_after_schedule(self, out: SchedulerOutput) -> None:
        """Label each scheduled request: a decode computes the token sampled last step; anything else is a prefill."""
        for req in out.scheduled:
            rid = req.request_id
            num_drafts = len(out.scheduled_spec_decode_tokens.get(rid, ()))
            n = out.num_scheduled_tokens[rid] - num_drafts
            p = out.num_output_placeholders.get(rid, 0)
            start = req.num_computed_tokens + out.num_computed_ahead.get(rid, 0)
            is_decode = n == 1 and req.num_output_tokens + p > 0 and start == req.num_tokens + p - 1
            out.kinds[rid] = "decode" if is_decode else "prefill"
            if is_decode:
                out.num_decode_tokens += n + num_drafts
            else:
                out.num_prefill_tokens += n
        if self.connector is not None:                         # KV transfer: this step's loads and saves
            out.kv_connector_metadata = self.connector.build_connector_meta(out)
        if self.encoder_cache_manager is not None:             # images: what the encoder runs, what the worker drops
            out.encoder_inputs, out.free_encoder_hashes = self.encoder_cache_manager.schedule_encoder(
                out.scheduled, out.encoder_plan)

    # ------------------------------------------------------------------ preemption
    def _preempt(self, req: Request) -> list[tuple[int, int]]:
        """Send a running request back to the waiting queue, its KV swapped out or dropped. Returns the block copies
        a swap needs, (device block, CPU block) pairs, for the model runner to do before the next forward."""
        kv = self.kv_cache_manager
        swap_out: list[tuple[int, int]] = []
        self._remove(self.running, req)
        self._release_encoder_outputs(req)
        if self.preemption_mode == "swap" and req not in self.in_flight and kv.can_swap_out(req):
            swap_out = kv.swap_out(req)
            req.status = RequestStatus.SWAPPED
        else:
            kv.free(req)
            req.num_computed_tokens = 0
            req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self._push_waiting(req)
        return swap_out

    def _swap_in(self, req: Request, budget: int, out: SchedulerOutput) -> int:
        """Bring a swapped request's KV back and make room for its next tokens; how many it computes (0: no room)."""
        kv = self.kv_cache_manager
        n = self._chunk(req, req.num_tokens - req.num_computed_tokens, budget, out)
        if n == 0 or not kv.can_swap_in(req, n):
            return 0
        out.blocks_to_swap_in += kv.swap_in(req)
        allocated = kv.allocate_slots(req, n)
        assert allocated, "can_swap_in promised room for the new tokens"
        return n

    def _release_encoder_outputs(self, req: Request, consumed_only: bool = False) -> None:
        if self.encoder_cache_manager is not None and req.mm_features:    # images: outputs it needs no more
            self.encoder_cache_manager.release(req, consumed_only)

    # ------------------------------------------------------------------ the step's output
    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, list[int] | int]) -> list[EngineCoreOutput]:
        """After the model ran: the scheduled tokens now have KV (their full blocks join the prefix cache), and each
        request in `sampled` (request_id -> tokens: one, or with speculative decoding its accepted drafts and one
        more) gets its new tokens, and its grammar (structured output) accepts them. Stops what must stop: EOS, a
        stop token, max_tokens, max_model_len; the tokens after the stop are dropped (never more than asked).
        Stop strings are the output processor's to find (it calls finish_request). With drafts, only the accepted
        drafts' KV is kept (num_computed_tokens covers them): the rejected ones' slots are overwritten next step."""
        outputs = []
        for req in out.scheduled:
            num_scheduled = out.num_scheduled_tokens[req.request_id]
            tokens = sampled.get(req.request_id)
            if tokens is None:                              # a prefill chunk that does not end the prompt
                req.num_computed_tokens += num_scheduled
                self.kv_cache_manager.cache_blocks(req, req.num_computed_tokens)
                self._release_encoder_outputs(req, consumed_only=True)
                continue
            if isinstance(tokens, int):
                tokens = [tokens]
            drafts = out.scheduled_spec_decode_tokens.get(req.request_id)
            accepted = self.spec_decoding_stats.observe_draft(drafts, tokens) if drafts else 0
            status, kept = None, []
            for token in tokens:
                status = self._append_token(req, token)
                kept.append(token)
                if status is not None:
                    break
            # KV is valid for every token but the newest (accepted drafts included, rejected ones not).
            req.num_computed_tokens = min(req.num_computed_tokens + num_scheduled, req.num_tokens - 1)
            self.kv_cache_manager.cache_blocks(req, req.num_computed_tokens)
            self._release_encoder_outputs(req, consumed_only=True)
            if req.spec_token_ids:
                req.spec_token_ids = []                     # verified (or dropped): the proposer makes new ones
            if status is not None:
                self.finish_request(req, status)
            outputs.append(EngineCoreOutput(req, kept, status, accepted))
        return outputs

    def _append_token(self, req: Request, token: int) -> RequestStatus | None:
        """Append one new token (journaled), advance the grammar; the status it ends the request with, if any."""
        req.append_output_token(token)
        self.journal.record(req.pop_output_token)
        grammar_done = self._advance_grammar(req, token)
        sp = req.sampling_params
        early = req.num_output_tokens < sp.min_tokens         # vLLM: before min_tokens only a length limit stops it
        if not early and not sp.ignore_eos and token in req.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if grammar_done:                                      # ignore_eos: nothing may follow the grammar
            return RequestStatus.FINISHED_STOPPED
        if not early and token in sp.stop_token_ids:
            req.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
        if req.num_output_tokens >= sp.max_tokens or req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _advance_grammar(self, req: Request, token: int) -> bool:
        """Structured output: the grammar accepts `token` (journaled); True once it is complete (False: none)."""
        grammar = req.grammar
        if grammar is None:
            return False
        if not grammar.is_terminated:
            if not grammar.accept(token):        # the bitmask allowed only tokens the grammar accepts
                raise RequestFailedError(req.request_id, f"request {req.request_id}: token {token} was sampled but "
                                         f"its grammar ({grammar.describe()}) does not accept it")
            self.journal.record(grammar.rollback)
        return grammar.is_terminated

    def update_draft_token_ids(self, drafts: dict[str, list[int]]) -> None:
        """The proposer's drafts for the next step (request_id -> tokens), journaled; grammars filter them."""
        for req in self.running:
            tokens = drafts.get(req.request_id)
            if tokens and req.grammar is not None:
                tokens = req.grammar.validate_tokens(tokens)
            if tokens:
                req.spec_token_ids = list(tokens)

    def drop_output_tokens(self, req: Request, num_tokens: int) -> None:
        """Take back tokens past a stop string (speculative decoding adds several per step). Journaled."""
        for _ in range(num_tokens):
            token = req.output_token_ids[-1]
            req.pop_output_token()
            self.journal.record(lambda t=token: req.append_output_token(t))

    # ------------------------------------------------------------------ leaving
    def finish_request(self, req: Request, status: RequestStatus, stop_reason: int | str | None = None) -> None:
        """Remove a request wherever it is and free its blocks. Safe to call in any state."""
        assert status.finished
        kv = self.kv_cache_manager
        if req.status is RequestStatus.RUNNING:
            self._remove(self.running, req)
        elif not req.is_finished:
            self._remove(self.waiting, req)
        if req.status is RequestStatus.SWAPPED:
            kv.free_swapped(req)
        kv.free(req)
        req.status = status
        if stop_reason is not None:
            req.stop_reason = stop_reason
        if self.connector is not None:
            self.connector.request_finished(req)
        self._release_encoder_outputs(req)
        key = self._keys.pop(req.request_id, None)
        if key is not None:
            self.journal.record(lambda: self._keys.__setitem__(req.request_id, key))

    # ------------------------------------------------------------------ introspection
    def check_integrity(self) -> None:
        """Assert the scheduler's and the KV cache's invariants (core/invariants.py). For tests and debug runs."""
        check_scheduler(self)
