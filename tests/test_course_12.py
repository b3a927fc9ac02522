"""Lesson 12's exercise check (lessons/checks/c12_sampling.py) passes the solution, rejects the rest."""

import pytest
import torch

from tests.course_helpers import empty, passes, rejects

NAME = "12.top_p_filter"


def _filter(logits, keep_sorted):
    """Apply a keep-mask computed over the descending-sorted row, back in vocabulary order."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    sorted_logits = sorted_logits.masked_fill(~keep_sorted(sorted_logits.softmax(dim=-1)), float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def drops_the_crossing_token(logits, top_p):
    """Keeps a token only while the mass *including* it is below top_p: the token that reaches top_p is lost
    (even at top_p=1.0, the last token)."""
    p = torch.tensor(top_p, dtype=logits.dtype)[:, None]
    return _filter(logits, lambda probs: probs.cumsum(-1) < p)


def sorts_ascending(logits, top_p):
    """Accumulates from the least likely token up: keeps the tail instead of the nucleus."""
    sorted_logits, order = logits.sort(dim=-1)
    probs = sorted_logits.softmax(dim=-1)
    p = torch.tensor(top_p, dtype=logits.dtype)[:, None]
    sorted_logits = sorted_logits.masked_fill(probs.cumsum(-1) - probs >= p, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def first_row_top_p_for_all(logits, top_p):
    """Right for one row, but uses the first row's top_p for the whole batch."""
    p = torch.full((logits.shape[0], 1), top_p[0], dtype=logits.dtype)
    return _filter(logits, lambda probs: probs.cumsum(-1) - probs < p)


def not_scattered_back(logits, top_p):
    """Filters the sorted row right, but returns it sorted (most likely first) instead of in vocabulary order."""
    sorted_logits, _ = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    p = torch.tensor(top_p, dtype=logits.dtype)[:, None]
    return sorted_logits.masked_fill(probs.cumsum(-1) - probs >= p, float("-inf"))


@pytest.mark.slow
def test_the_solution_passes():
    passes(NAME)


def test_an_empty_answer_is_told_to_write_code():
    rejects(empty, NAME, "not written yet")


WRONG_ANSWERS = [      # (a plausible wrong answer, what the check must say about it)
    (drops_the_crossing_token, r"top_p=1.0 .*expected \[\[0, 1, 2, 3, 4\]\], got \[\[0, 1, 2, 3\]\]"),
    (sorts_ascending, r"top_p=1e-6 .*expected \[\[0\]\], got \[\[4\]\]"),
    (not_scattered_back, r"^top_p=0.8, shuffled: row 0 is not in the original \(vocabulary\) order but "
                         r"sorted, most likely first: did you scatter the filtered logits back"),
    (first_row_top_p_for_all,
     r"a batch of 3 rows with top_p \[0.3, 0.9, 1.0\].*expected \[\[0\], \[1, 2, 3, 4\], \[0, 1, 2, 3, 4\]\], "
     r"got \[\[0\], \[4\], \[0(, 1)?\]\]"),
]


@pytest.mark.parametrize("wrong, message", WRONG_ANSWERS,
                         ids=[wrong.__name__ for wrong, _ in WRONG_ANSWERS])
def test_plausible_wrong_answers_are_rejected_with_the_case(wrong, message):
    rejects(wrong, NAME, message)


def test_at_least_three_plausible_wrong_answers():
    assert len(WRONG_ANSWERS) >= 3
