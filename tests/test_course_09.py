"""Lesson 09's exercise check (lessons/checks/c09_serving.py) passes the solution, rejects the rest."""

import pytest

from tests.course_helpers import answering_in, empty, passes, rejects, solution

NAME = "09.stream_deltas"


def no_holdback(pieces, stop):
    """Sends every piece at once, cutting only the piece that completes a stop string."""
    deltas, text = [], ""
    for piece in pieces:
        sent, text = len(text), text + piece
        hits = [text.find(s) for s in stop if s in text]
        if hits:
            deltas.append(text[sent:min(hits)])
            return deltas
        deltas.append(piece)
    return deltas


def searches_the_new_piece_only(pieces, stop):
    """Holds back the right amount, but looks for stop strings in the new piece alone."""
    hold = max((len(s) for s in stop), default=1) - 1
    deltas, pending = [], ""
    for i, piece in enumerate(pieces):
        hits = [piece.find(s) for s in stop if s in piece]
        if hits:
            deltas.append(pending + piece[:min(hits)])
            return deltas
        window = pending + piece
        cut = len(window) if i == len(pieces) - 1 else max(len(window) - hold, 0)
        deltas.append(window[:cut])
        pending = window[cut:]
    return deltas


def holds_back_a_whole_stop_string(pieces, stop):
    """Holds back len(longest stop) characters, one more than can still start a stop string."""
    hold = max((len(s) for s in stop), default=0)
    deltas, pending = [], ""
    for i, piece in enumerate(pieces):
        window = pending + piece
        hits = [window.find(s) for s in stop if s in window]
        if hits:
            deltas.append(window[:min(hits)])
            return deltas
        cut = len(window) if i == len(pieces) - 1 else max(len(window) - hold, 0)
        deltas.append(window[:cut])
        pending = window[cut:]
    return deltas


@pytest.mark.slow
def test_the_solution_passes():
    passes(NAME)


@pytest.mark.slow
def test_the_solution_passes_answering_in_a_tuple():
    passes(NAME, answering_in(tuple, solution(NAME)))


def test_an_empty_answer_is_told_to_write_code():
    rejects(empty, NAME, "not written yet")


WRONG_ANSWERS = [      # (a plausible wrong answer, what the check must say about it)
    (no_holdback, r"stop=\['END'\], which never comes.*expected \['a', 'bc', 'd', 'efg'\], got "
                  r"\['abc', 'de', 'f', 'g'\]"),
    (searches_the_new_piece_only, r"a stop string split across two pieces"),
    (holds_back_a_whole_stop_string, r"stop=\['END'\], which never comes.*expected \['a', 'bc'"),
]


@pytest.mark.parametrize("wrong, message", WRONG_ANSWERS,
                         ids=[wrong.__name__ for wrong, _ in WRONG_ANSWERS])
def test_plausible_wrong_answers_are_rejected_with_the_case(wrong, message):
    rejects(wrong, NAME, message)


def test_at_least_three_plausible_wrong_answers():
    assert len(WRONG_ANSWERS) >= 3
