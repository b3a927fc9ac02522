"""Lesson 04's exercise check (lessons/checks/c04_preemption.py) passes the solution, rejects the rest."""

import pytest

from tests.course_helpers import answering_in, empty, passes, rejects, solution

NAME = "04.preempt"


def _back_in_place(waiting, back):
    i = 0
    while i < len(waiting) and (waiting[i].priority, waiting[i].arrival) < (back.priority, back.arrival):
        i += 1
    return waiting[:i] + [back] + waiting[i:]


def latest_arrival_only(running, waiting):
    """Preempts the latest arrival, whatever the priorities."""
    victim = max(running, key=lambda s: s.arrival)
    back = victim._replace(status="preempted", num_computed_tokens=0, block_table=())
    return ([s for s in running if s.request_id != victim.request_id], _back_in_place(waiting, back),
            list(reversed(victim.block_table)))


def back_of_the_queue(running, waiting):
    """Right victim, but sent to the back of the waiting queue, behind requests that arrived after it."""
    victim = max(running, key=lambda s: (s.priority, s.arrival))
    back = victim._replace(status="preempted", num_computed_tokens=0, block_table=())
    return ([s for s in running if s.request_id != victim.request_id], waiting + [back],
            list(reversed(victim.block_table)))


def keeps_computed_tokens(running, waiting):
    """Frees the blocks but leaves num_computed_tokens: the request would skip tokens whose KV is gone."""
    victim = max(running, key=lambda s: (s.priority, s.arrival))
    back = victim._replace(status="preempted", block_table=())
    return ([s for s in running if s.request_id != victim.request_id], _back_in_place(waiting, back),
            list(reversed(victim.block_table)))


def empty_list_block_table(running, waiting):
    """The solution with `block_table=[]` for the victim instead of `()`: the same answer."""
    victim = max(running, key=lambda s: (s.priority, s.arrival))
    back = victim._replace(status="preempted", num_computed_tokens=0, block_table=[])
    return ([s for s in running if s.request_id != victim.request_id], _back_in_place(waiting, back),
            list(reversed(victim.block_table)))


def test_the_solution_passes():
    passes(NAME)


def test_block_table_as_an_empty_list_passes():
    passes(NAME, empty_list_block_table)


def test_the_solution_passes_answering_in_lists_or_tuples():
    passes(NAME, answering_in(list, solution(NAME)))
    passes(NAME, answering_in(tuple, solution(NAME)))


def test_an_empty_answer_is_told_to_write_code():
    rejects(empty, NAME, "not written yet")


WRONG_ANSWERS = [      # (a plausible wrong answer, what the check must say about it)
    (latest_arrival_only, r"A has priority 1: the lowest priority goes first.*the running queue "
                          r"after: expected \[B\(.*\), C\(.*\)\], got \[A\(.*\), B\(.*\)\]"),
    (back_of_the_queue, r"C \(arrival 2\) goes back between W1 \(arrival 1\) and W5 .*"
                        r"the waiting queue after: expected \[W1\(.*\), C\(.*\), W5\(.*\)\], "
                        r"got \[W1\(.*\), W5\(.*\), C\(.*\)\]"),
    (keeps_computed_tokens, r"equal priorities: the latest arrival, C, goes.*the waiting queue "
                            r"after: expected \[C\(priority 0, arrival 2, preempted, computed 0, "
                            r"blocks \(\)\)\], got \[C\(priority 0, arrival 2, preempted, computed 5,"),
]


@pytest.mark.parametrize("wrong, message", WRONG_ANSWERS,
                         ids=[wrong.__name__ for wrong, _ in WRONG_ANSWERS])
def test_plausible_wrong_answers_are_rejected_with_the_case(wrong, message):
    rejects(wrong, NAME, message)


def test_at_least_three_plausible_wrong_answers():
    assert len(WRONG_ANSWERS) >= 3
