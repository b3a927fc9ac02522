"""Lesson 03's exercise check (lessons/checks/c03_scheduler.py) passes the solution, rejects the rest."""

import pytest

from minivllm.core.journal import StepJournal
from minivllm.core.kv_cache_manager import KVCacheManager
from minivllm.core.request import Request
from minivllm.core.sampling_params import SamplingParams
from minivllm.core.scheduler import Scheduler
from tests.course_helpers import empty, passes, rejects, solution

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


def sorted_by_tokens_left(running, waiting, max_num_batched_tokens, max_num_seqs):
    """The one-liner for "decodes first": sorts the running requests by tokens left, which also reorders the
    prefill chunks (the shortest jumps the queue)."""
    budget, scheduled = max_num_batched_tokens, {}
    for request_id, need in sorted(running, key=lambda r: r[1]):
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


def admits_one_too_many(running, waiting, max_num_batched_tokens, max_num_seqs):
    """Off by one on the seats: counts them as max_num_seqs - len(running) + 1."""
    budget, scheduled = max_num_batched_tokens, {}
    for request_id, need in sorted(running, key=lambda r: r[1] > 1):
        if budget == 0:
            break
        scheduled[request_id] = min(need, budget)
        budget -= scheduled[request_id]
    seats = max_num_seqs - len(running) + 1
    for request_id, need in waiting:
        if budget == 0 or seats == 0:
            break
        scheduled[request_id] = min(need, budget)
        budget -= scheduled[request_id]
        seats -= 1
    return scheduled


def test_the_unequal_chunks_case_is_what_the_real_scheduler_does():
    """The check's case p1 (25 left), d1 (a decode), p2 (20 left), budget 30: the real Scheduler, brought to that
    state, schedules {'d1': 1, 'p1': 25, 'p2': 4}, as the solution does."""
    kv = KVCacheManager(num_blocks=64, block_size=4, journal=StepJournal(), enable_prefix_caching=False)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=12, max_model_len=256,
                      long_prefill_token_threshold=5)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for i, (rid, n) in enumerate([("p1", 30), ("d1", 2), ("p2", 25)]):
        sched.add_request(Request(rid, list(range(10, 10 + n)), params, arrival_time=float(i)))
    sched.begin_step()
    out = sched.schedule()                          # p1 5 of 30, d1 its whole prompt of 2, p2 5 of 25
    sched.update_from_output(out, {"d1": 7})
    sched.commit_step()
    running = [(r.request_id, r.num_tokens - r.num_computed_tokens) for r in sched.running]
    assert running == [("p1", 25), ("d1", 1), ("p2", 20)]
    sched.max_num_batched_tokens, sched.long_prefill_token_threshold = 30, 0
    sched.begin_step()
    expected = dict(sched.schedule().num_scheduled_tokens)
    sched.rollback_step()
    assert expected == {"d1": 1, "p1": 25, "p2": 4}
    assert solution(NAME)(running, [], 30, 8) == expected
    assert sorted_by_tokens_left(running, [], 30, 8) == {"d1": 1, "p2": 20, "p1": 9}


def test_the_solution_passes():
    passes(NAME)


def test_an_empty_answer_is_told_to_write_code():
    rejects(empty, NAME, "not written yet")


WRONG_ANSWERS = [      # (a plausible wrong answer, what the check must say about it)
    (ignores_max_num_seqs, r"max_num_seqs=3 with two running: one seat left .*expected "
                           r"\{'a': 1, 'b': 1, 'c': 3\}, got \{'a': 1, 'b': 1, 'c': 3, 'd': 3, 'e': 3\}"),
    (admits_only_whole_prompts, r"lesson 03's step 1: the second prompt gets what is left .*"
                                r"expected \{'p': 37, 'q': 27\}, got \{'p': 37\}"),
    (queue_order, r"decodes are scheduled first.*expected \{'d': 1, 'long': 31\}, "
                  r"got \{'long': 32\}"),
    (sorted_by_tokens_left, r"not by tokens left: p1 came first.*expected \{'d1': 1, 'p1': 25, "
                            r"'p2': 4\}, got \{'d1': 1, 'p2': 20, 'p1': 9\}"),
    (admits_one_too_many, r"max_num_seqs=3 with two running: one seat left .*expected "
                          r"\{'a': 1, 'b': 1, 'c': 3\}, got \{'a': 1, 'b': 1, 'c': 3, 'd': 3\}"),
]


@pytest.mark.parametrize("wrong, message", WRONG_ANSWERS,
                         ids=[wrong.__name__ for wrong, _ in WRONG_ANSWERS])
def test_plausible_wrong_answers_are_rejected_with_the_case(wrong, message):
    rejects(wrong, NAME, message)


def test_at_least_three_plausible_wrong_answers():
    assert len(WRONG_ANSWERS) >= 3
