"""Lesson 00's exercise check (lessons/checks/c00_tour.py) passes the solution, rejects the rest."""

import pytest

from tests.course_helpers import empty, passes, rejects

NAME = "00.blocks_held"


def every_token(num_prompt_tokens, num_output_tokens, block_size):
    """Counts the newest token as if it had KV already (it gets it only in the next step)."""
    return -(-(num_prompt_tokens + num_output_tokens) // block_size)


def full_blocks_only(num_prompt_tokens, num_output_tokens, block_size):
    """Rounds down: forgets the partly filled last block."""
    return (num_prompt_tokens + num_output_tokens - 1) // block_size


def prompt_only(num_prompt_tokens, num_output_tokens, block_size):
    """Counts the prompt's blocks only: forgets that every output token but the newest has KV too."""
    return -(-num_prompt_tokens // block_size)


@pytest.mark.slow
def test_the_solution_passes():
    passes(NAME)


def test_an_empty_answer_is_told_to_write_code():
    rejects(empty, NAME, "not written yet")


WRONG_ANSWERS = [      # (a plausible wrong answer, what the check must say about it)
    (every_token, r"a 16-token prompt after its first step .*expected 1, got 2"),
    (full_blocks_only, r"a 5-token prompt after its first step .*expected 1, got 0"),
    (prompt_only, r"a 16-token prompt with 2 output tokens \(block size 16: 17 tokens have KV\): "
                  r"expected 2, got 1"),
]


@pytest.mark.parametrize("wrong, message", WRONG_ANSWERS,
                         ids=[wrong.__name__ for wrong, _ in WRONG_ANSWERS])
def test_plausible_wrong_answers_are_rejected_with_the_case(wrong, message):
    rejects(wrong, NAME, message)


def test_at_least_three_plausible_wrong_answers():
    assert len(WRONG_ANSWERS) >= 3
