"""Lesson 03's checks: `schedule_step` on hand-made steps, then against the real Scheduler, step after step."""

import random

from course import ExerciseFailed, expect_equal, same_answer
from minivllm.core.journal import StepJournal
from minivllm.core.kv_cache_manager import KVCacheManager
from minivllm.core.request import Request
from minivllm.core.sampling_params import SamplingParams
from minivllm.core.scheduler import Scheduler


def _case(fn, running, waiting, budget, max_num_seqs, expected, what):
    actual = fn(list(running), list(waiting), budget, max_num_seqs)
    expect_equal(actual, expected, f"{what} (running {running}, waiting {waiting}, budget {budget}, "
                                   f"max_num_seqs {max_num_seqs})")


def _real_steps(fn, seed, budget, max_num_seqs, num_steps):
    """Drive a real Scheduler (a KV pool so big that memory never binds, no prefix cache) through `num_steps`
    steps with random arrivals; before each step, ask `fn` for the step's plan and compare. Returns the steps
    compared."""
    rng = random.Random(seed)
    kv = KVCacheManager(num_blocks=4096, block_size=16, journal=StepJournal(), enable_prefix_caching=False)
    sched = Scheduler(kv, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=4096)
    compared, arrivals = 0, 0

    def arrive():
        nonlocal arrivals
        params = SamplingParams(temperature=0, max_tokens=rng.randrange(1, 12), ignore_eos=True)
        prompt = [rng.randrange(1000) for _ in range(rng.choice([rng.randrange(1, 8), rng.randrange(8, 3 * budget)]))]
        sched.add_request(Request(f"r{arrivals}", prompt, params, arrival_time=float(arrivals)))
        arrivals += 1

    for step in range(num_steps):
        for _ in range(rng.choice([0, 0, 1, 1, 2, 4])):
            arrive()
        if not sched.has_unfinished_requests():
            continue
        running = [(r.request_id, r.num_tokens - r.num_computed_tokens) for r in sched.running]
        waiting = [(r.request_id, r.num_tokens) for r in sched.waiting]
        sched.begin_step()
        out = sched.schedule()
        expected = dict(out.num_scheduled_tokens)
        actual = fn(list(running), list(waiting), budget, max_num_seqs)
        if not same_answer(actual, expected):
            sched.rollback_step()
            raise ExerciseFailed(f"against the real Scheduler (budget {budget}, max_num_seqs {max_num_seqs}), "
                                 f"step {step + 1}, running {running}, waiting {waiting}: expected {expected}, "
                                 f"got {actual}")
        # The model's part, faked: a request whose scheduled tokens reach its last token samples one.
        sampled = {r.request_id: rng.randrange(1000) for r in out.scheduled
                   if r.num_computed_tokens + out.num_scheduled_tokens[r.request_id] == r.num_tokens}
        sched.update_from_output(out, sampled)
        sched.commit_step()
        compared += 1
    sched.check_integrity()
    return compared


def check_schedule_step(fn):
    _case(fn, [("a", 1), ("b", 1)], [("c", 10)], 64, 8, {"a": 1, "b": 1, "c": 10},
          "two decodes and a short prompt, everything fits")
    _case(fn, [], [("p", 37), ("q", 120), ("r", 80)], 64, 8, {"p": 37, "q": 27},
          "lesson 03's step 1: the second prompt gets what is left of the budget, the third nothing")
    _case(fn, [("a", 1), ("b", 1), ("c", 1)], [("d", 5)], 2, 8, {"a": 1, "b": 1},
          "more decodes than budget: the first two in queue order, nobody admitted")
    yield "each request takes what it still needs, cut to what is left of the budget"
    _case(fn, [("long", 100), ("d", 1)], [], 32, 8, {"d": 1, "long": 31},
          "a prefill chunk ahead of a decode in the queue (decodes are scheduled first)")
    _case(fn, [("p1", 20), ("d1", 1), ("p2", 20), ("d2", 1)], [], 30, 8, {"d1": 1, "d2": 1, "p1": 20, "p2": 8},
          "decodes first, then the prefill chunks in queue order")
    _case(fn, [("p1", 25), ("d1", 1), ("p2", 20)], [], 30, 8, {"d1": 1, "p1": 25, "p2": 4},
          "decodes first, then the prefill chunks in queue order, not by tokens left: p1 came first, so it takes "
          "its 25 and p2 the 4 left (sort by 'is it a decode', not by how much is left)")
    yield "running requests first: decodes, then prefill chunks"
    _case(fn, [("d", 1)], [("p", 50), ("q", 5)], 20, 8, {"d": 1, "p": 19},
          "a waiting prompt longer than what is left (it is admitted with a chunk; the next one waits)")
    _case(fn, [("a", 1), ("p", 40)], [("c", 3)], 41, 8, {"a": 1, "p": 40},
          "the running requests spend the whole budget (nobody is admitted with 0 tokens)")
    _case(fn, [("a", 1), ("b", 1)], [("c", 3), ("d", 3), ("e", 3)], 64, 3, {"a": 1, "b": 1, "c": 3},
          "max_num_seqs=3 with two running: one seat left")
    _case(fn, [("a", 1), ("b", 1), ("c", 1)], [("d", 3)], 64, 3, {"a": 1, "b": 1, "c": 1},
          "max_num_seqs=3 with three running: no seat left")
    yield "waiting requests in order, while budget and seats remain, chunked to fit"
    rng = random.Random(0)
    compared = 0
    for seed in range(6):
        budget, max_num_seqs = rng.choice([8, 16, 32, 64]), rng.choice([1, 2, 3, 4, 8])
        compared += _real_steps(fn, seed, budget, max_num_seqs, num_steps=40)
    yield f"{compared} steps of 6 random workloads against the real Scheduler's schedule()"
