"""Lesson 15's exercise check (lessons/checks/c15_multimodal.py) passes the solution, rejects the rest."""

import pytest

from minivllm.core.encoder_cache_manager import EncoderCacheManager
from tests.course_helpers import check, empty, passes, rejects

NAME = "15.fit"


def _in_chunk(req, start, num_tokens):
    """The request's images that overlap the chunk [start, start + num_tokens), in prompt order."""
    return [f for f in req.mm_features if f.offset < start + num_tokens and f.end > start]


def _planned(ecm, req, out, counts_every_plan=False):
    needed = {}
    for rid, images in out.encoder_plan.items():
        if counts_every_plan or rid == req.request_id or rid in out.num_scheduled_tokens:
            needed.update((f.mm_hash, f.length) for f in images)
    return needed


def _fits(ecm, needed, image, pinned_evictable=False):
    needed = needed | {image.mm_hash: image.length}
    new_rows = sum(rows for h, rows in needed.items() if h not in ecm.sizes)
    evictable = sum(rows for h, rows in ecm.freeable.items() if pinned_evictable or h not in needed)
    return new_rows <= ecm.num_free_slots + evictable


def never_cuts(ecm, req, start, num_tokens, out):
    """Plans every image of the chunk and lets the whole chunk run: the encoder cache overflows."""
    out.encoder_plan[req.request_id] = _in_chunk(req, start, num_tokens)
    return num_tokens


def _rule(cut=lambda image, start: max(image.offset - start, 0), plan_kept=True, counts_every_plan=False,
          pinned_evictable=False):
    """The admission rule with one piece changed."""
    def fit(ecm, req, start, num_tokens, out):
        mine = out.encoder_plan[req.request_id] = []
        for image in _in_chunk(req, start, num_tokens):
            needed = _planned(ecm, req, out, counts_every_plan)
            kept = image.mm_hash in needed or image.mm_hash in ecm.cached
            if not kept and not _fits(ecm, needed, image, pinned_evictable):
                return cut(image, start)
            if plan_kept or not kept:
                mine.append(image)
        return num_tokens
    return fit


cuts_after_the_image = _rule(cut=lambda image, start: image.end - start)
returns_zero_at_an_image_that_does_not_fit = _rule(cut=lambda image, start: 0)
does_not_plan_kept_outputs = _rule(plan_kept=False)
counts_pinned_freeable_outputs_as_evictable = _rule(pinned_evictable=True)
counts_the_plans_of_unscheduled_requests = _rule(counts_every_plan=True)


def ignores_what_the_plan_needs(ecm, req, start, num_tokens, out):
    """Checks each image alone: room for its own rows, as if nothing else were planned this step."""
    mine = out.encoder_plan[req.request_id] = []
    for image in _in_chunk(req, start, num_tokens):
        if image.mm_hash not in ecm.cached and not _fits(ecm, {}, image):
            return max(image.offset - start, 0)
        mine.append(image)
    return num_tokens


the_real_rule = EncoderCacheManager.fit      # taken now: the check puts the function it checks in its place


def test_the_solution_passes():
    passes(NAME)


def test_the_hand_cases_hold_for_minivllms_own_fit():
    """The hand cases' answers are written out in the check; the real method must give them too."""
    check(the_real_rule, NAME)


def test_an_empty_answer_is_told_to_write_code():
    rejects(empty, NAME, "not written yet")


WRONG_ANSWERS = [      # (a plausible wrong answer, what the check must say about it)
    (never_cuts, r"another request holds owl, which fills the cache: .*expected 3, got 25"),
    (cuts_after_the_image, r"another request holds owl, which fills the cache: .*expected 3, got 11"),
    (returns_zero_at_an_image_that_does_not_fit,
     r"another request holds owl, which fills the cache: .*expected 3, got 0"),
    (ignores_what_the_plan_needs, r"a cache of 8 rows: cat fits, then dog does not .*expected 14, got 25"),
    (does_not_plan_kept_outputs,
     r"another request holds cat: it costs no room, and it is planned .*images planned for 'r'.*"
     r"expected \['cat@3'\], got \[\]"),
    (counts_the_plans_of_unscheduled_requests, r"request b planned owl but was not scheduled .*expected 25, got 14"),
    (counts_pinned_freeable_outputs_as_evictable,
     r"cat's output is freeable: r takes it without room, which pins it.*expected 14, got 25"),
]


@pytest.mark.parametrize("wrong, message", WRONG_ANSWERS,
                         ids=[wrong.__name__ for wrong, _ in WRONG_ANSWERS])
def test_plausible_wrong_answers_are_rejected_with_the_case(wrong, message):
    rejects(wrong, NAME, message)


def test_at_least_three_plausible_wrong_answers():
    assert len(WRONG_ANSWERS) >= 3
