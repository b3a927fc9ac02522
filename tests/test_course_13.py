"""Lesson 13's exercise check (lessons/checks/c13_spec_decode.py) passes the solution, rejects the rest."""

import pytest

from tests.course_helpers import answering_in, empty, passes, rejects, solution

NAME = "13.ngram_propose"


def _search(token_ids, k, ns, starts):
    """Try each n of `ns` in order; for each, the candidate starts `starts(n)` in order; the first match wins."""
    for n in ns:
        if n < 1 or n >= len(token_ids):
            continue
        for start in starts(n):
            if token_ids[start:start + n] == token_ids[-n:]:
                return token_ids[start + n:start + n + k]
    return []


def first_occurrence(token_ids, k, min_n, max_n):
    """Takes the earliest occurrence instead of the latest."""
    return _search(token_ids, k, range(max_n, min_n - 1, -1), lambda n: range(0, len(token_ids) - n))


def matches_the_suffix_itself(token_ids, k, min_n, max_n):
    """Lets the search start at the suffix: it always matches itself, and nothing follows it."""
    return _search(token_ids, k, range(max_n, min_n - 1, -1), lambda n: range(len(token_ids) - n, -1, -1))


def only_max_n(token_ids, k, min_n, max_n):
    """Tries n = max_n only."""
    return _search(token_ids, k, [max_n], lambda n: range(len(token_ids) - n - 1, -1, -1))


def shortest_n_first(token_ids, k, min_n, max_n):
    """Tries n from min_n up: a short, common suffix wins over a longer, more telling one."""
    return _search(token_ids, k, range(min_n, max_n + 1), lambda n: range(len(token_ids) - n - 1, -1, -1))


@pytest.mark.slow
def test_the_solution_passes():
    passes(NAME)


@pytest.mark.slow
def test_the_solution_passes_answering_in_a_tuple():
    passes(NAME, answering_in(tuple, solution(NAME)))


def test_an_empty_answer_is_told_to_write_code():
    rejects(empty, NAME, "not written yet")


WRONG_ANSWERS = [      # (a plausible wrong answer, what the check must say about it)
    (first_occurrence, r"the latest occurrence wins .*expected \[2, 7\], got \[1, 7\]"),
    (matches_the_suffix_itself, r"\[7, 8\] occurred at the start .*expected \[9, 7, 8\], got \[\]"),
    (only_max_n, r"no 3-token match, so n=2.*expected \[1, 9\], got \[\]"),
    (shortest_n_first, r"the longest n wins .*expected \[9, 9\], got \[1, 5\]"),
]


@pytest.mark.parametrize("wrong, message", WRONG_ANSWERS,
                         ids=[wrong.__name__ for wrong, _ in WRONG_ANSWERS])
def test_plausible_wrong_answers_are_rejected_with_the_case(wrong, message):
    rejects(wrong, NAME, message)


def test_at_least_three_plausible_wrong_answers():
    assert len(WRONG_ANSWERS) >= 3
