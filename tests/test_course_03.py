"""Lesson 03's exercise check (lessons/checks/c03_scheduler.py) passes the solution, rejects the rest."""

from tests.course_helpers import empty, passes, rejects

NAME = "03.schedule_step"


def ignores_max_num_seqs(running, waiting, max_num_batched_tokens, max_num_seqs):
    """Admits waiting requests while the budget lasts, however many requests that makes."""
    budget, scheduled = max_num_batched_tokens, {}
    for request_id, need in sorted(running, key=lambda r: r[1] > 1) + list(waiting):
        if budget == 0:
            break
        scheduled[request_id] = min(need, budget)
        budget -= scheduled[request_id]
    return scheduled


def admits_only_whole_prompts(running, waiting, max_num_batched_tokens, max_num_seqs):
    """Chunks the running prefills, but admits a waiting request only if its whole prompt fits."""
    budget, scheduled = max_num_batched_tokens, {}
    for request_id, need in sorted(running, key=lambda r: r[1] > 1):
        if budget == 0:
            break
        scheduled[request_id] = min(need, budget)
        budget -= scheduled[request_id]
    seats = max_num_seqs - len(running)
    for request_id, need in waiting:
        if need > budget or seats == 0:
            break
        scheduled[request_id] = need
        budget -= need
        seats -= 1
    return scheduled


def queue_order(running, waiting, max_num_batched_tokens, max_num_seqs):
    """Serves the running queue in its own order: a prefill chunk ahead of a decode takes the decode's token."""
    budget, scheduled = max_num_batched_tokens, {}
    for request_id, need in running:
        if budget == 0:
            break
        scheduled[request_id] = min(need, budget)
        budget -= scheduled[request_id]
    seats = max_num_seqs - len(running)
    for request_id, need in waiting:
        if budget == 0 or seats == 0:
            break
        scheduled[request_id] = min(need, budget)
        budget -= scheduled[request_id]
        seats -= 1
    return scheduled


def test_the_solution_passes():
    passes(NAME)


def test_an_empty_answer_is_told_to_write_code():
    rejects(empty, NAME, "not written yet")


def test_plausible_wrong_answers_are_rejected_with_the_case():
    rejects(ignores_max_num_seqs, NAME, r"max_num_seqs=3 with two running: one seat left .*expected "
                                        r"\{'a': 1, 'b': 1, 'c': 3\}, got \{'a': 1, 'b': 1, 'c': 3, 'd': 3, 'e': 3\}")
    rejects(admits_only_whole_prompts, NAME, r"lesson 03's step 1: the second prompt gets what is left .*"
                                             r"expected \{'p': 37, 'q': 27\}, got \{'p': 37\}")
    rejects(queue_order, NAME, r"decodes are scheduled first.*expected \{'d': 1, 'long': 31\}, "
                               r"got \{'long': 32\}")
