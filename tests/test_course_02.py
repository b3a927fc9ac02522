"""Lesson 02's exercise check (lessons/checks/c02_step_rollback.py) passes the solution, rejects the rest."""

from tests.course_helpers import empty, passes, rejects

NAME = "02.take_blocks"


def loop_variable_in_the_undo(free, table, n, journal):
    """The undo closes over the loop variable: every undo puts back the last block taken."""
    if n > len(free):
        return False
    for _ in range(n):
        block_id = free.popleft()
        journal.record(lambda: free.appendleft(block_id))
        table.append(block_id)
        journal.record(table.pop)
    return True


def undo_to_the_back(free, table, n, journal):
    """Puts each block back at the end of the free queue: the right blocks, in the wrong order (LRU order lost)."""
    if n > len(free):
        return False
    for _ in range(n):
        block_id = free.popleft()
        journal.record(lambda b=block_id: free.append(b))
        table.append(block_id)
        journal.record(table.pop)
    return True


def forgets_the_table(free, table, n, journal):
    """Journals the free queue only: after a rollback the request still lists blocks that are free again."""
    if n > len(free):
        return False
    for _ in range(n):
        block_id = free.popleft()
        journal.record(lambda b=block_id: free.appendleft(b))
        table.append(block_id)
    return True


def takes_what_there_is(free, table, n, journal):
    """Not all or nothing: with too few free blocks it takes the ones there are."""
    for _ in range(min(n, len(free))):
        block_id = free.popleft()
        journal.record(lambda b=block_id: free.appendleft(b))
        table.append(block_id)
        journal.record(table.pop)
    return True


def extendleft_in_one_undo(free, table, n, journal):
    """One undo for the whole batch, with deque.extendleft, which puts the blocks back in reverse order."""
    if n > len(free):
        return False
    taken = [free.popleft() for _ in range(n)]
    table.extend(taken)

    def undo():
        del table[len(table) - n:]
        free.extendleft(taken)
    journal.record(undo)
    return True


def test_the_solution_passes():
    passes(NAME)


def test_an_empty_answer_is_told_to_write_code():
    rejects(empty, NAME, "not written yet")


def test_plausible_wrong_answers_are_rejected_with_the_case():
    rejects(loop_variable_in_the_undo, NAME,
            r"take 2 of 5 free blocks for a new request: the free queue after the rollback: expected "
            r"\[3, 1, 4, 5, 9\], got \[1, 1, 4, 5, 9\] \(a block id appears twice: .*lambda b=block_id")
    rejects(undo_to_the_back, NAME,
            r"take 2 of 5 free blocks for a new request: the free queue after the rollback: expected "
            r"\[3, 1, 4, 5, 9\], got \[4, 5, 9, 1, 3\] \(the right blocks in the wrong order")
    rejects(forgets_the_table, NAME,
            r"take 2 of 5 free blocks for a new request: the block table after the rollback: expected \[\], "
            r"got \[3, 1\]")
    rejects(takes_what_there_is, NAME,
            r"ask for 5 blocks when 3 are free: the return value when 5 blocks are asked and 3 are free: "
            r"expected False, got True")
    rejects(extendleft_in_one_undo, NAME,
            r"take 2 of 5 free blocks for a new request: the free queue after the rollback: expected "
            r"\[3, 1, 4, 5, 9\], got \[1, 3, 4, 5, 9\] \(the right blocks in the wrong order")
