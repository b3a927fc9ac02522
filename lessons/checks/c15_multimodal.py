"""Lesson 15's checks: `fit`, the encoder cache's admission rule, on hand-made caches and plans with known answers,
against minivllm's own EncoderCacheManager.fit on random ones, and inside the real scheduler: workloads of image
prompts run step by step (some steps fail and are rolled back) with your function in place of the real one. Each
step must schedule the tokens and encode the images the real rule does, keep the scheduler's invariants, and every
request must finish."""

import copy
import random

import torch

from course import ExerciseFailed, expect_equal
from minivllm.core.encoder_cache_manager import EncoderCacheManager
from minivllm.core.journal import StepJournal
from minivllm.core.kv_cache_manager import KVCacheManager
from minivllm.core.request import Request
from minivllm.core.sampling_params import SamplingParams
from minivllm.core.scheduler import Scheduler
from minivllm.core.scheduler_output import SchedulerOutput
from minivllm.multimodal.inputs import MultiModalFeature

IMG = 99                    # the placeholder token of these prompts (any id: the core never reads it)
NO_PIXELS = torch.zeros(1)  # the core never looks at pixels either
REAL_FIT = EncoderCacheManager.fit      # minivllm's own rule (the scheduler run puts yours in its place)
WORKLOADS = 30


# ---------------------------------------------------------------------------------------------- building blocks
def _request(rid, layout, **kw):
    """A request whose prompt is `layout`: ints are runs of text tokens, (hash, rows) tuples are images."""
    prompt, images = [], []
    for part in layout:
        if isinstance(part, int):
            prompt += [1 + (len(prompt) + i) % 7 for i in range(part)]
        else:
            mm_hash, rows = part
            images.append(MultiModalFeature(mm_hash, len(prompt), rows, NO_PIXELS))
            prompt += [IMG] * rows
    return Request(rid, prompt, SamplingParams(max_tokens=kw.pop("max_tokens", 4)), mm_features=tuple(images), **kw)


def _manager(cache_size, held=(), freeable=()):
    """An EncoderCacheManager holding `held` ((hash, rows, request ids) each) and `freeable` ((hash, rows) each,
    least recently freed first)."""
    ecm = EncoderCacheManager(cache_size, StepJournal())
    for mm_hash, rows, refs in held:
        ecm.cached[mm_hash], ecm.sizes[mm_hash] = set(refs), rows
    for mm_hash, rows in freeable:
        ecm.freeable[mm_hash], ecm.sizes[mm_hash] = rows, rows
    ecm.num_free_slots = cache_size - sum(ecm.sizes.values())
    assert ecm.num_free_slots >= 0
    return ecm


def _output(plans=(), scheduled=()):
    """A step being planned: `plans` ((request id, [features]) each) made by earlier calls; the requests in
    `scheduled` are in the batch."""
    out = SchedulerOutput([], {rid: 1 for rid in scheduled})
    out.encoder_plan = {rid: list(images) for rid, images in plans}
    return out


def _copy_output(out):
    twin = SchedulerOutput([], dict(out.num_scheduled_tokens))
    twin.encoder_plan = {rid: list(images) for rid, images in out.encoder_plan.items()}
    return twin


def _names(images):
    return [f"{f.mm_hash}@{f.offset}" for f in images]


def _state(ecm):
    return (copy.deepcopy(ecm.cached), list(ecm.freeable.items()), dict(ecm.sizes), ecm.num_free_slots, ecm.evicted)


def _describe(ecm, req, start, num_tokens, out):
    held = ", ".join(f"{h} ({ecm.sizes[h]} rows, held by {sorted(r)})" for h, r in ecm.cached.items()) or "none"
    free = ", ".join(f"{h} ({n} rows)" for h, n in ecm.freeable.items()) or "none"
    images = ", ".join(f"{f.mm_hash} at [{f.offset}, {f.end})" for f in req.mm_features) or "none"
    plans = "; ".join(f"{rid}{'' if rid in out.num_scheduled_tokens else ' (not scheduled)'}: {_names(p)}"
                      for rid, p in out.encoder_plan.items()) or "empty"
    return (f"cache of {ecm.cache_size} rows, {ecm.num_free_slots} free; held: {held}; freeable: {free}; "
            f"plan so far: {plans}; request {req.request_id!r} of {req.num_tokens} tokens, images {images}; "
            f"chunk [{start}, {start + num_tokens})")


def _real(ecm, req, start, num_tokens, out):
    twin = _copy_output(out)
    n = REAL_FIT(ecm, req, start, num_tokens, twin)
    return n, twin.encoder_plan.get(req.request_id, [])


def _case(fn, ecm, req, start, num_tokens, out, expected, what, expected_plan=None):
    """Run `fn` on one call; `expected`: the tokens that may run; `expected_plan`: the images planned for `req`
    (default: the real rule's)."""
    setup = _describe(ecm, req, start, num_tokens, out)
    if expected_plan is None:
        expected_plan = _real(ecm, req, start, num_tokens, out)[1]
    others = {rid: _names(p) for rid, p in out.encoder_plan.items() if rid != req.request_id}
    before = _state(ecm)
    actual = fn(ecm, req, start, num_tokens, out)
    if not isinstance(actual, int) or isinstance(actual, bool):
        raise ExerciseFailed(f"{what} ({setup}): expected a number of tokens (an int), got {actual!r}")
    if _state(ecm) != before:
        raise ExerciseFailed(f"{what} ({setup}): your function changed the encoder cache manager; fit only plans "
                             f"(out.encoder_plan), schedule_encoder makes the plan real")
    expect_equal(actual, expected, f"{what} ({setup}): the tokens that may run")
    plan = out.encoder_plan.get(req.request_id, [])
    expect_equal(_names(plan), _names(expected_plan), f"{what} ({setup}): the images planned for "
                                                       f"{req.request_id!r} (out.encoder_plan, hash@offset)")
    expect_equal({rid: _names(p) for rid, p in out.encoder_plan.items() if rid != req.request_id}, others,
                 f"{what} ({setup}): the plans of the other requests (yours to read, not to change)")


# ---------------------------------------------------------------------------------------------- the check
def check_fit(fn):
    # r: 3 text tokens, cat at [3, 11), 3 text tokens, dog at [14, 22), 3 text tokens: 25 tokens
    r = _request("r", [3, ("cat", 8), 3, ("dog", 8), 3])
    cat, dog = r.mm_features
    _case(fn, _manager(16), r, 0, 3, _output(), 3, "the chunk holds text only")
    _case(fn, _manager(16), r, 0, 25, _output(), 25, "both images fit in an empty cache of 16 rows",
          [cat, dog])
    _case(fn, _manager(16, held=[("cat", 8, {"r"})]), r, 11, 3, _output(), 3,
          "the chunk lies between the images (the prompt ran past cat already)", [])
    yield "text runs; every image in the chunk that fits is planned"
    owl = [("owl", 16, {"other"})]
    _case(fn, _manager(16, held=owl), r, 0, 25, _output(), 3,
          "another request holds owl, which fills the cache: the chunk stops before cat, its 3 text tokens run", [])
    _case(fn, _manager(8), r, 0, 25, _output(), 14,
          "a cache of 8 rows: cat fits, then dog does not after the 8 rows cat needs: the chunk stops before dog",
          [cat])
    _case(fn, _manager(8, held=[("cat", 8, {"other"})]), r, 11, 14, _output(), 3,
          "the prompt ran past cat; another request holds it and fills the cache: the chunk stops before dog", [])
    _case(fn, _manager(16, held=owl), r, 3, 8, _output(), 0,
          "the chunk starts at cat, which does not fit: nothing runs", [])
    yield "a chunk stops before the first image that does not fit, and the tokens before it run"
    _case(fn, _manager(8, held=[("cat", 8, {"other"})]), r, 0, 14, _output(), 14,
          "another request holds cat: it costs no room, and it is planned (schedule_encoder takes a reference)",
          [cat])
    _case(fn, _manager(8, held=[("cat", 8, {"r"})]), r, 5, 6, _output(), 6,
          "an earlier chunk cut cat in two, and r holds it: the rest of cat runs", [cat])
    twice = _request("r", [3, ("cat", 8), 3, ("cat", 8), 3])
    _case(fn, _manager(8), twice, 0, 25, _output(), 25,
          "the same image twice in one prompt: the second is in the plan already", list(twice.mm_features))
    a = _request("a", [2, ("cat", 8)])
    _case(fn, _manager(8), r, 0, 25, _output([("a", a.mm_features)], ["a"]), 14,
          "request a, scheduled earlier in this step, plans cat: r shares it, but then dog does not fit", [cat])
    yield "an output that is kept or already planned costs no room, and is planned all the same"
    b = _request("b", [2, ("owl", 8)])
    _case(fn, _manager(16), r, 0, 25, _output([("b", b.mm_features)], ["b"]), 14,
          "request b, scheduled earlier in this step, plans owl (8 new rows): after it only cat fits", [cat])
    _case(fn, _manager(16), r, 0, 25, _output([("b", b.mm_features)]), 25,
          "request b planned owl but was not scheduled (no KV blocks for it): its plan needs nothing", [cat, dog])
    _case(fn, _manager(16, held=[("owl", 8, {"other"})], freeable=[("old", 8)]), r, 0, 14, _output(), 14,
          "no row is free, but old is freeable (kept, needed by nobody): evicting it makes room for cat", [cat])
    _case(fn, _manager(16, held=[("owl", 8, {"other"})], freeable=[("cat", 8)]), r, 0, 25, _output(), 14,
          "cat's output is freeable: r takes it without room, which pins it, so it cannot be evicted to make "
          "room for dog: the chunk stops before dog", [cat])
    _case(fn, _manager(8), r, 0, 14, _output([("r", [dog])]), 14,
          "out.encoder_plan['r'] holds a plan from an earlier call: this call's plan replaces it", [cat])
    yield ("room = free rows + freeable outputs the plan does not pin, after the new rows the step's plan already "
           "needs (this request's images so far, and those of the requests scheduled before it)")
    rng = random.Random(0)
    for i in range(300):
        ecm, req, start, num_tokens, out = _random_case(rng)
        expected, plan = _real(ecm, req, start, num_tokens, out)
        _case(fn, ecm, req, start, num_tokens, out, expected, f"random case {i}: as minivllm's EncoderCacheManager",
              plan)
    yield "300 random caches, plans and chunks: what minivllm's EncoderCacheManager.fit answers"
    steps = _inside_the_scheduler(fn)
    yield (f"inside the real scheduler: {WORKLOADS} workloads, {steps} steps (some failed and rolled back), the same "
           f"batches and encoder runs as the real rule, the invariants kept, every request finished")


def _random_case(rng):
    rows = {h: rng.choice([4, 8]) for h in "pqstu"}
    ecm = _manager(rng.choice([8, 12, 16, 24]))
    for h in rng.sample(sorted(rows), rng.randint(0, 4)):
        if rows[h] <= ecm.num_free_slots:
            if rng.random() < 0.5:
                ecm.cached[h] = {rng.choice(["x", "y"])}
            else:
                ecm.freeable[h] = rows[h]
            ecm.sizes[h] = rows[h]
            ecm.num_free_slots -= rows[h]

    def layout():
        parts = [rng.randint(0, 4)]
        for _ in range(rng.randint(0, 3)):
            h = rng.choice(sorted(rows))
            parts += [(h, rows[h]), rng.randint(0, 3)]
        return parts or [1]

    out = SchedulerOutput([], {})
    for rid in ("a", "b"):                       # requests planned earlier in the step, by the real rule
        if rng.random() < 0.6:
            other = _request(rid, layout() + [1])
            n = REAL_FIT(ecm, other, 0, other.num_tokens, out)
            if n and rng.random() < 0.8:
                out.num_scheduled_tokens[rid] = n
    req = _request("r", layout() + [1])
    if rng.random() < 0.15:
        out.encoder_plan["r"] = list(req.mm_features[:1])      # left by an earlier call
    start = rng.randrange(req.num_tokens)
    return ecm, req, start, rng.randint(1, req.num_tokens - start), out


# ---------------------------------------------------------------------------------------------- inside the scheduler
def _workload(seed):
    """A scheduler with an encoder cache, and its requests, for workload `seed` (the same twice for one seed)."""
    rng = random.Random(seed)
    journal = StepJournal()
    mode = rng.choice(["recompute", "swap"])
    kv = KVCacheManager(rng.choice([10, 20]), 4, journal, True, 16 if mode == "swap" else 0)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=rng.choice([8, 16]), max_model_len=4096,
                      preemption_mode=mode, long_prefill_token_threshold=rng.choice([0, 3]))
    sched.encoder_cache_manager = EncoderCacheManager(rng.choice([8, 12, 24]), journal)
    rows = {h: rng.choice([4, 8]) for h in "pqst"}
    for i in range(6):
        layout = [rng.randint(1, 3)]
        for h in rng.sample(sorted(rows), rng.randint(0, 2)):
            layout += [(h, rows[h]), rng.randint(1, 3)]
        sched.add_request(_request(f"r{i}", layout, max_tokens=rng.randint(1, 6), priority=rng.randint(-1, 1),
                                   arrival_time=float(i)))
    return sched, rng


def _run(sched, rng, on_step):
    """Steps until every request finished (at most 400); `on_step(index, out, failed)` after each."""
    ecm = sched.encoder_cache_manager
    for i in range(400):
        if not sched.has_unfinished_requests():
            return i
        fail = rng.random() < 0.3
        before = _state(ecm)
        sched.begin_step()
        out = sched.schedule()
        sampled = {r.request_id: 7 for r in out.scheduled
                   if r.num_computed_tokens + out.num_scheduled_tokens[r.request_id] >= r.num_tokens}
        sched.update_from_output(out, sampled)
        if fail:
            sched.rollback_step()
            if _state(ecm) != before:
                raise ExerciseFailed(f"step {i} failed and was rolled back, but the encoder cache manager did not "
                                     f"come back as it was: fit must only plan (out.encoder_plan), never change "
                                     f"the manager")
        else:
            sched.commit_step()
        sched.check_integrity()
        on_step(i, out, fail)
    return None


def _record(out):
    return ({r.request_id: out.num_scheduled_tokens[r.request_id] for r in out.scheduled},
            [f.mm_hash for f in out.encoder_inputs], list(out.free_encoder_hashes))


def _inside_the_scheduler(fn):
    total = 0
    for seed in range(WORKLOADS):
        sched, rng = _workload(seed)
        expected = []
        assert _run(sched, rng, lambda i, out, failed: expected.append(_record(out))) is not None
        sched, rng = _workload(seed)

        def compare(i, out, failed):
            if i >= len(expected):
                raise ExerciseFailed(f"inside the scheduler, workload {seed}: step {i} ran, but with the real rule "
                                     f"every request had finished after {len(expected)} steps")
            want, got = expected[i], _record(out)
            what = f"inside the scheduler, workload {seed}, step {i}"
            if failed:
                what += " (it fails and is rolled back)"
            expect_equal(got[0], want[0], f"{what}: tokens scheduled per request")
            expect_equal(got[1], want[1], f"{what}: the images encoded")
            expect_equal(got[2], want[2], f"{what}: the outputs the worker drops first")

        EncoderCacheManager.fit = lambda self, req, start, num_tokens, out: fn(self, req, start, num_tokens, out)
        try:
            steps = _run(sched, rng, compare)
        except ExerciseFailed:
            raise
        except StopIteration as e:      # _acquire found nothing left to evict
            raise ExerciseFailed(f"inside the scheduler, workload {seed}: schedule_encoder had to make room for an "
                                 f"image your function let in, and nothing was left to evict: it did not fit") from e
        except Exception as e:
            raise ExerciseFailed(f"inside the scheduler, workload {seed}: the step raised "
                                 f"{type(e).__name__}: {e}") from e
        finally:
            EncoderCacheManager.fit = REAL_FIT
        if steps is None:
            raise ExerciseFailed(f"inside the scheduler, workload {seed}: requests still unfinished after 400 steps "
                                 f"(a chunk that never runs: does your function ever let a waiting image in?)")
        total += steps
    return total
