"""AsyncScheduler: the scheduler for an engine with batches in flight (vLLM v1's `AsyncScheduler`).

Owns: `in_flight`, the requests in a batch whose output has not come back, and what may happen to them. It plugs
into the base Scheduler (scheduler.py) at its named seams and changes nothing else: the base `schedule()` is the
whole algorithm, this class only says which running requests may join a batch, where their next tokens start, and
how many requests one batch takes. The engine picks it once, when it has batches in flight (llm_engine.py).

Batches in flight (pipeline parallelism, vLLM v1's batch queue): with `max_concurrent_batches` k > 1 the engine
schedules the next batch while up to k - 1 earlier ones are still in later pipeline stages. A request is in flight
from the schedule that puts it in a batch to the `update_from_output` of that batch: it is never scheduled again
or given new tokens in between (its next token is not known yet). It may be preempted, as in vLLM: the victim is
the lowest-priority, latest request, in flight or not; an in-flight victim is recomputed (never swapped: its batch
still reads its blocks in the later stages, before the next batch's stage writes there), waits until its batch is
back, and gets that batch's token then (the token is right: the batch read its KV before anyone else wrote it).
Each batch takes at most
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

"""

from __future__ import annotations

import dataclasses

from minivllm.core.kv_cache_manager import KVCacheManager
from minivllm.core.request import Request, RequestStatus
from minivllm.core.scheduler import EngineCoreOutput, Scheduler, SchedulerOutput


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


class AsyncScheduler(Scheduler):
    def __init__(self, kv_cache_manager: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, preemption_mode: str = "recompute", max_concurrent_batches: int = 1,
                 async_scheduling: bool = False, long_prefill_token_threshold: int = 0):
        super().__init__(kv_cache_manager, max_num_seqs, max_num_batched_tokens, max_model_len, preemption_mode,
                         long_prefill_token_threshold)
        self.max_concurrent_batches = max_concurrent_batches
        self.async_scheduling = async_scheduling
        self.in_flight: dict[Request, int] = {}
        # In flight, and a failed step handed its blocks on (rollback_step): its batch's KV is lost, its token is not
        self.kv_lost: set[Request] = set()

    # ------------------------------------------------------------------ the seams of schedule()
    def _runnable(self) -> list[Request]:
        """Not those in flight, unless async scheduling lets them run ahead of their batch."""
        return [r for r in self.running if r not in self.in_flight or self._can_run_ahead(r, self.in_flight[r])]

    def _max_batch_size(self) -> int:
        """The k batches in flight share the unfinished requests evenly, so every pipeline stage has work."""
        return -(-min(len(self.running) + len(self.waiting), self.max_num_seqs) // self.max_concurrent_batches)

    def _num_tokens_left(self, req: Request) -> int:
        """Counting what its batch in flight computes, and the token that batch samples (plan_ahead)."""
        return plan_ahead(req.num_tokens, req.num_computed_tokens, self.in_flight.get(req, 0))[1]

    def _drafts_to_verify(self, req: Request, n: int, budget: int) -> list[int]:
        return [] if req in self.in_flight else super()._drafts_to_verify(req, n, budget)

    def _allocate(self, req: Request, num_tokens: int) -> bool:
        """Room after the tokens its batch in flight computes."""
        return self.kv_cache_manager.allocate_slots(req, self.in_flight.get(req, 0) + num_tokens)

    def _chunk(self, req: Request, num_tokens_left: int, budget: int, out: SchedulerOutput) -> int:
        """A request preempted while in flight is admitted again only once its batch is back (with its token)."""
        if req in self.in_flight and req.status is not RequestStatus.RUNNING:
            return 0
        return super()._chunk(req, num_tokens_left, budget, out)

    def _choose_victim(self, req: Request) -> Request | None:
        """The lowest-priority, latest request, in flight or not (vLLM's rule). Under async scheduling a request in
        flight is never the victim, and one running ahead of its batch that finds no room waits instead."""
        if req in self.in_flight:
            return None
        candidates = [r for r in self.running if r not in self.in_flight] if self.async_scheduling else self.running
        return max(candidates, key=lambda r: self._keys[r.request_id])

    def _offer_blocks(self, out: SchedulerOutput, requests: list[Request]) -> None:
        """Not under async scheduling: the step ends with its batch still in flight, and a request admitted on such
        a block would count as computed tokens whose KV is not there yet (vLLM v1 shares no blocks within a step
        either)."""
        if not self.async_scheduling:
            super()._offer_blocks(out, requests)

    def _update_after_schedule(self, out: SchedulerOutput) -> None:
        """Record where each request runs ahead of its batch in flight, then put the new batch's tokens in flight."""
        for req in out.scheduled:
            k = self.in_flight.get(req, 0)
            if k:
                start, left = plan_ahead(req.num_tokens, req.num_computed_tokens, k)
                out.num_computed_ahead[req.request_id] = k
                if start + left > req.num_tokens:           # its batch in flight samples this batch's input
                    out.num_output_placeholders[req.request_id] = start + left - req.num_tokens
        super()._update_after_schedule(out)
        for req in out.scheduled:
            self._set_in_flight(req, self.in_flight.get(req, 0) + out.num_scheduled_tokens[req.request_id])

    def _can_run_ahead(self, req: Request, k: int) -> bool:
        """May a request whose batch in flight computes `k` of its tokens join the next batch? The rest of a prompt
        may (its tokens are known). A token still being sampled may be the next input only under async scheduling,
        if the request's sampling reads no output tokens of its own, and that token cannot end it by length."""
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

    # ------------------------------------------------------------------ outputs and leaving
    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, list[int] | int]) -> list[EngineCoreOutput]:
        """A batch came back: its tokens leave `in_flight` (a later batch may still hold more of a request's), and
        the requests that finished (aborted) while it was in flight are skipped. A request preempted while in
        flight (or whose blocks a failed step handed on) gets its token only: its KV is gone, it is recomputed."""
        live = [r for r in out.scheduled if r in self.in_flight]
        for req in live:
            self._set_in_flight(req, self.in_flight[req] - out.num_scheduled_tokens[req.request_id])
        lost = [r for r in live if r.status is not RequestStatus.RUNNING or r in self.kv_lost]
        outputs = [self._token_only(req, sampled[req.request_id]) for req in lost if req.request_id in sampled]
        for req in lost:
            if req.status is RequestStatus.RUNNING:     # its KV was handed on by a failed step: recompute it now
                self._preempt(req)
        kept = dataclasses.replace(out, scheduled=[r for r in live if r not in lost])
        return super().update_from_output(kept, sampled) + outputs

    def _token_only(self, req: Request, tokens: list[int] | int) -> EngineCoreOutput:
        """Apply a batch's sampled token(s) to a request whose KV is gone: its output grows, nothing is computed."""
        kept, status = [], None
        for token in [tokens] if isinstance(tokens, int) else tokens:
            status = self._append_token(req, token)
            kept.append(token)
            if status is not None:
                self.finish_request(req, status)
                break
        return EngineCoreOutput(req, kept, status)

    def _preempt(self, req: Request) -> list[tuple[int, int]]:
        self._forget_lost(req)
        return super()._preempt(req)

    def _forget_lost(self, req: Request) -> None:
        if req in self.kv_lost:
            self.kv_lost.discard(req)
            self.journal.record(lambda: self.kv_lost.add(req))

    def rollback_step(self) -> None:
        """As the base, and then: a request in flight whose blocks the failed step may have written (it had preempted
        the request and handed them on; `distrust` cut its table) cannot keep what its batch computes. It stays as it
        is until that batch is back, then gets its token and is recomputed (update_from_output)."""
        super().rollback_step()
        kv = self.kv_cache_manager
        self.kv_lost |= {r for r, k in self.in_flight.items() if r.status is RequestStatus.RUNNING
                         and kv.blocks_needed(r.num_computed_tokens + k) > len(r.block_table)}

    def finish_request(self, req: Request, status: RequestStatus, stop_reason: int | str | None = None) -> None:
        if req in self.in_flight:                       # its batches' outputs will be dropped
            self._set_in_flight(req, 0)
        self._forget_lost(req)
        super().finish_request(req, status, stop_reason)

    def check_integrity(self) -> None:
        super().check_integrity()
        for req in self.in_flight:
            assert req.status is RequestStatus.RUNNING or (req.status is RequestStatus.PREEMPTED and req in self.waiting), (
                f"{req} is in flight but neither running nor preempted while in flight")
        assert self.kv_lost <= set(self.in_flight), "a request whose batch's KV is lost is not in flight"
