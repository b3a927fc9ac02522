"""Lesson 05's exercise check (lessons/checks/c05_flat_batch.py) passes the solution, rejects the rest."""

import pytest

from tests.course_helpers import answering_in, empty, passes, rejects, solution

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


@pytest.mark.slow
def test_the_solution_passes_answering_in_a_tuple():
    passes(NAME, answering_in(tuple, solution(NAME)))


def test_an_empty_answer_is_told_to_write_code():
    rejects(empty, NAME, "not written yet")


WRONG_ANSWERS = [      # (a plausible wrong answer, what the check must say about it)
    (no_block_table, r"a 3-token prompt in block 7 .*expected \[28, 29, 30\], got \[0, 1, 2\]"),
    (block_id_not_scaled, r"a 3-token prompt in block 7 .*expected \[28, 29, 30\], got \[7, 8, 9\]"),
    (contiguous_from_first_slot,
     r"positions 2\.\.5 run from block 7 into block 2 .*expected \[30, 31, 8, 9\], got \[30, 31, 32, 33\]"),
    (end_inclusive, r"a 3-token prompt in block 7 .*expected \[28, 29, 30\], got \[28, 29, 30, 31\]"),
]


@pytest.mark.parametrize("wrong, message", WRONG_ANSWERS,
                         ids=[wrong.__name__ for wrong, _ in WRONG_ANSWERS])
def test_plausible_wrong_answers_are_rejected_with_the_case(wrong, message):
    rejects(wrong, NAME, message)


def test_at_least_three_plausible_wrong_answers():
    assert len(WRONG_ANSWERS) >= 3
