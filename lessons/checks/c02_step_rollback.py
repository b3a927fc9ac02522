"""Lesson 02's checks: `take_blocks` inside an open StepJournal, alone, twice in one step, beside other journaled
changes, with too few blocks and outside a step; then random steps, each rolled back, against plain lists."""

import random
from collections import deque

from course import ExerciseFailed, expect_equal
from minivllm.core.journal import StepJournal


def _hint(free_after, free_before):
    """What a wrong free queue after a rollback suggests about the undo that made it."""
    if len(set(free_after)) < len(free_after):
        return (" (a block id appears twice: does each undo capture the block id when it is recorded, "
                "`lambda b=block_id: ...`, rather than the loop variable?)")
    if sorted(free_after) == sorted(free_before):
        return " (the right blocks in the wrong order: a taken block goes back to the front, where it came from)"
    return ""


def _step(fn, free, table, n, what, journal=None, between=None):
    """One step: take n blocks with fn, optionally another journaled change, then roll back. Returns fn's answer."""
    journal = journal or StepJournal()
    free_before, table_before = list(free), list(table)
    journal.begin()
    ok = fn(free, table, n, journal)
    if n <= len(free_before):
        expect_equal(ok, True, f"{what}: the return value with {len(free_before)} blocks free")
        expect_equal(list(table), table_before + free_before[:n], f"{what}: the block table after taking {n}")
        expect_equal(list(free), free_before[n:], f"{what}: the free queue after taking {n}")
    else:
        expect_equal(ok, False, f"{what}: the return value when {n} blocks are asked and {len(free_before)} are free")
        expect_equal((list(free), list(table)), (free_before, table_before),
                     f"{what}: (free queue, block table) after a refusal (all or nothing: nothing changes)")
    if between is not None:
        between(free, journal)
    journal.rollback()
    if list(free) != free_before:
        raise ExerciseFailed(f"{what}: the free queue after the rollback: expected {free_before}, got {list(free)}"
                             + _hint(list(free), free_before))
    expect_equal(list(table), table_before, f"{what}: the block table after the rollback")
    return ok


def _free_one(block_id):
    """Another change of the same step: a block freed to the back of the queue, journaled as BlockPool.free does."""
    def change(free, journal):
        free.append(block_id)
        journal.record(free.pop)
    return change


def check_take_blocks(fn):
    _step(fn, deque([3, 1, 4, 5, 9]), [], 2, "take 2 of 5 free blocks for a new request")
    _step(fn, deque([6, 2]), [7, 8], 1, "take 1 block for a request that holds [7, 8]")
    _step(fn, deque([5, 0, 2, 7]), [1], 4, "take every free block")
    yield "one call in a step, rolled back: the free queue and the block table as they were, in order"
    _step(fn, deque([4, 6, 2]), [9], 5, "ask for 5 blocks when 3 are free")
    _step(fn, deque(), [3], 1, "ask for 1 block when none is free")
    _step(fn, deque([8, 3]), [], 0, "take no block")
    yield "too few free blocks: False, and nothing changes"
    journal = StepJournal()
    free, table, other = deque([10, 11, 12, 13, 14]), [1], [2]
    journal.begin()
    fn(free, table, 2, journal)
    fn(free, other, 2, journal)
    fn(free, table, 1, journal)
    journal.rollback()
    expect_equal((list(free), table, other), ([10, 11, 12, 13, 14], [1], [2]),
                 "three calls in one step for two requests, then a rollback: (free queue, table 1, table 2)")
    _step(fn, deque([5, 6, 7]), [], 2, "take 2, then the same step frees block 9 to the back of the queue",
          between=_free_one(9))
    free, table = deque([4, 5, 6]), [1]
    ok = fn(free, table, 2, StepJournal())                 # no step open: record() does nothing
    expect_equal((ok, list(free), table), (True, [6], [1, 4, 5]), "outside a step, (return, free queue, table)")
    yield "several changes in one step are undone newest first; outside a step a change is final"
    rng = random.Random(0)
    for i in range(200):
        free = deque(rng.sample(range(64), rng.randrange(0, 12)))
        tables = [rng.sample(range(64, 80), rng.randrange(0, 3)) for _ in range(3)]
        journal = StepJournal()
        before = (list(free), [list(t) for t in tables])
        journal.begin()
        for _ in range(rng.randrange(1, 5)):
            t, n = rng.randrange(3), rng.randrange(0, 5)
            want_free, want_table = list(free)[n:], tables[t] + list(free)[:n]
            ok = fn(free, tables[t], n, journal)
            if ok:
                expect_equal((list(free), tables[t]), (want_free, want_table),
                             f"random step {i}: (free queue, block table) after taking {n}")
            if rng.random() < 0.3:
                _free_one(100 + i)(free, journal)
        journal.rollback()
        after = (list(free), [list(t) for t in tables])
        if after != before:
            raise ExerciseFailed(f"random step {i}, rolled back: (free queue, block tables): expected {before}, "
                                 f"got {after}" + _hint(after[0], before[0]))
    yield "200 random steps (several requests, other journaled changes), each rolled back to where it began"
