"""The scheduler's invariants, asserted by `Scheduler.check_integrity` (tests and debug runs): every queue holds
requests in the states it may hold, a waiting request holds no device blocks, and the KV cache agrees."""

from __future__ import annotations

from minivllm.core.request import RequestStatus


def check_scheduler(scheduler) -> None:
    assert not scheduler.journal.is_open, "a step is still open"
    for req in scheduler.running:
        assert req.status is RequestStatus.RUNNING, f"{req} is in the running queue"
        assert len(req.block_table) >= scheduler.kv_cache_manager.blocks_needed(req.num_computed_tokens), (
            f"{req}: fewer blocks than computed tokens")
    for req in scheduler.waiting:
        assert req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED, RequestStatus.SWAPPED), req
        assert not req.block_table, f"{req} waits while holding blocks"
        assert (req.request_id in scheduler.kv_cache_manager.swap_space.tables) == (
            req.status is RequestStatus.SWAPPED), f"{req}: swapped status and CPU blocks disagree"
        assert req.status is RequestStatus.SWAPPED or req.num_computed_tokens == 0, (
            f"{req} waits with {req.num_computed_tokens} computed tokens but no KV")
    live = scheduler.running + scheduler.waiting
    assert len(set(live)) == len(live), "a request is queued twice"
    assert {r.request_id for r in live} == set(scheduler._keys), "the queues and the priority keys disagree"
    scheduler.kv_cache_manager.check_integrity(live)
    if scheduler.encoder_cache_manager is not None:
        scheduler.encoder_cache_manager.check_integrity({r.request_id for r in live})
