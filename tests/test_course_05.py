"""Lesson 05's exercise check (lessons/checks/c05_flat_batch.py) passes the solution, rejects the rest."""

import pytest

from tests.course_helpers import empty, passes, rejects

NAME = "05.slot_mapping"


def no_block_table(block_table, start, end, block_size):
    """Takes the position for the slot, as if the KV cache were one contiguous array per request."""
    return list(range(start, end))


def block_id_not_scaled(block_table, start, end, block_size):
    """Adds the offset to the block id instead of to the block's first slot."""
    return [block_table[p // block_size] + p % block_size for p in range(start, end)]


def contiguous_from_first_slot(block_table, start, end, block_size):
    """Looks up the first position's slot and counts on from there: right until the chunk leaves that block."""
    first = block_table[start // block_size] * block_size + start % block_size
    return [first + i for i in range(end - start)]


def end_inclusive(block_table, start, end, block_size):
    """Off by one: includes position `end`."""
    return [block_table[p // block_size] * block_size + p % block_size
            for p in range(start, min(end + 1, len(block_table) * block_size))]


@pytest.mark.slow
def test_the_solution_passes():
    passes(NAME)


def test_an_empty_answer_is_told_to_write_code():
    rejects(empty, NAME, "not written yet")


def test_plausible_wrong_answers_are_rejected_with_the_case():
    rejects(no_block_table, NAME, r"a 3-token prompt in block 7 .*expected \[28, 29, 30\], got \[0, 1, 2\]")
    rejects(block_id_not_scaled, NAME, r"a 3-token prompt in block 7 .*expected \[28, 29, 30\], got \[7, 8, 9\]")
    rejects(contiguous_from_first_slot, NAME,
            r"positions 2\.\.5 run from block 7 into block 2 .*expected \[30, 31, 8, 9\], got \[30, 31, 32, 33\]")
    rejects(end_inclusive, NAME, r"a 3-token prompt in block 7 .*expected \[28, 29, 30\], got \[28, 29, 30, 31\]")
