"""The encoder cache's scheduler side (core/encoder_cache_manager.py), without a model: which images a step encodes,
where a chunk stops for an image that does not fit, sharing between equal images, eviction, preemption, rollback,
and the prefix cache keyed by images. The fake step is tests/test_kv_cache_properties.py's; the engine-level checks
against Hugging Face are in tests/test_multimodal.py."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from minivllm.core.encoder_cache_manager import EncoderCacheManager
from minivllm.core.journal import StepJournal
from minivllm.core.kv_cache_manager import KVCacheManager
from minivllm.core.request import Request, RequestStatus
from minivllm.core.sampling_params import SamplingParams
from minivllm.core.scheduler import Scheduler
from minivllm.multimodal.inputs import MultiModalFeature

IMG = 99                     # the placeholder token id of these fake prompts


def make_core(cache_size: int, num_blocks: int = 64, block_size: int = 4, budget: int = 64, threshold: int = 0,
              mode: str = "recompute") -> Scheduler:
    journal = StepJournal()
    kv = KVCacheManager(num_blocks, block_size, journal, True, 16 if mode == "swap" else 0)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=budget, max_model_len=4096, preemption_mode=mode,
                      long_prefill_token_threshold=threshold)
    sched.encoder_cache_manager = EncoderCacheManager(cache_size, journal)
    return sched


def image_request(rid: str, images: list[tuple[str, int]], text: int = 3, max_tokens: int = 4,
                  priority: int = 0) -> Request:
    """A prompt of `text` tokens, then each (hash, rows) image as that many placeholders, then `text` tokens."""
    prompt, features = [], []
    for mm_hash, rows in images:
        prompt += [1 + len(prompt) % 7] * text
        features.append(MultiModalFeature(mm_hash, len(prompt), rows, torch.zeros(1)))
        prompt += [IMG] * rows
    prompt += [5] * text
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens), priority=priority, mm_features=tuple(features))


def step(sched: Scheduler, fail: bool = False):
    """One fake step (commit, or raise and roll back when `fail`); returns the plan."""
    sched.begin_step()
    out = sched.schedule()
    sampled = {r.request_id: 7 for r in out.scheduled
               if r.num_computed_tokens + out.num_scheduled_tokens[r.request_id] >= r.num_tokens}
    sched.update_from_output(out, sampled)
    if fail:
        sched.rollback_step()
    else:
        sched.commit_step()
    sched.check_integrity()
    return out


def encoded(out) -> list[str]:
    return [f.mm_hash for f in out.encoder_inputs]


def test_equal_images_are_encoded_once_and_a_later_equal_image_reuses_the_kept_output():
    sched = make_core(cache_size=64)
    sched.add_request(image_request("a", [("cat", 8)]))
    sched.add_request(image_request("b", [("cat", 8)]))
    out = step(sched)
    assert encoded(out) == ["cat"]                    # two requests, one encoder run
    assert sched.encoder_cache_manager.cached == {}   # both prompts ran past the image: nobody needs it now
    assert "cat" in sched.encoder_cache_manager.freeable
    sched.add_request(image_request("c", [("cat", 8)], text=4))
    out = step(sched)
    assert out.scheduled and encoded(out) == []       # kept: not encoded again
    assert sched.encoder_cache_manager.num_encoder_inputs_scheduled == 1


def test_a_chunk_cut_through_an_image_encodes_it_once():
    sched = make_core(cache_size=64, threshold=3)
    req = image_request("a", [("dog", 8)])            # tokens 0-2 text, 3-10 image, 11-13 text
    sched.add_request(req)
    runs = []
    for _ in range(20):
        if req.num_output_tokens:
            break
        out = step(sched)
        runs += encoded(out)
        if req.num_computed_tokens <= 3:              # the image is not reached yet: nothing kept for it
            assert "dog" not in sched.encoder_cache_manager.sizes
    assert runs == ["dog"]


def test_a_chunk_stops_before_an_image_that_does_not_fit_and_runs_it_once_room_is_made():
    sched = make_core(cache_size=8, threshold=4)
    a, b = image_request("a", [("x", 8)], max_tokens=8), image_request("b", [("y", 8)], max_tokens=8)
    sched.add_request(a)
    sched.add_request(b)
    out = step(sched)
    # a: 3 text tokens and 1 image token (x is encoded); b: its 3 text tokens only, y waits for room
    assert out.num_scheduled_tokens == {"a": 4, "b": 3} and encoded(out) == ["x"]
    out = step(sched)
    assert out.num_scheduled_tokens.get("b", 0) == 0            # y still does not fit: b waits at its image
    for _ in range(20):
        if "y" in encoded(out):
            break
        out = step(sched)
    assert a.num_computed_tokens >= 3 + 8                       # only once a ran past x
    assert "x" not in sched.encoder_cache_manager.sizes         # evicted for y ...
    nxt = step(sched)
    assert nxt.free_encoder_hashes == ["x"]                     # ... and the worker hears of it with the next step


def test_preemption_gives_back_the_references_and_a_recompute_finds_the_kept_output():
    sched = make_core(cache_size=64, num_blocks=8, block_size=4, threshold=4)
    a = image_request("a", [("x", 8)], max_tokens=10)           # 14 + 10 tokens: 6 blocks of the 8
    sched.add_request(a)
    runs = encoded(step(sched))                                   # a: 4 tokens, x encoded and held by a
    assert sched.encoder_cache_manager.cached == {"x": {"a"}}
    b = image_request("b", [("z", 4)], text=2, max_tokens=16, priority=-1)    # 8 + 16 tokens: 6 blocks, first
    sched.add_request(b)
    for _ in range(100):
        if sched.num_preemptions:
            break
        runs += encoded(step(sched))
    assert a.status is RequestStatus.PREEMPTED
    assert "a" not in sched.encoder_cache_manager.cached.get("x", set())   # a holds nothing while it waits
    for _ in range(200):
        if a.is_finished and b.is_finished:
            break
        runs += encoded(step(sched))
    assert a.is_finished and b.is_finished
    assert runs.count("x") == 1 and runs.count("z") == 1      # x was kept (freeable) while a waited: no re-encode


def test_different_images_never_share_blocks_and_equal_images_do():
    sched = make_core(cache_size=64, block_size=4)
    first = image_request("a", [("red", 8)])
    sched.add_request(first)
    step(sched)
    kv = sched.kv_cache_manager
    same_tokens_other_image = image_request("b", [("blue", 8)])
    assert same_tokens_other_image.all_token_ids == first.all_token_ids[:first.num_prompt_tokens]
    assert kv.get_computed_blocks(same_tokens_other_image) == kv.get_computed_blocks(
        Request("t", first.prompt_token_ids[:3] + [0], SamplingParams()))[:0]    # no block with image tokens matches
    hits_b = kv.get_computed_blocks(same_tokens_other_image)
    assert len(hits_b) == 0                            # block 0 holds tokens 0-2 and the first image token
    equal = image_request("c", [("red", 8)])
    assert len(kv.get_computed_blocks(equal)) == (equal.num_tokens - 1) // 4   # every full block but the last


@pytest.mark.parametrize("seed", range(50))
def test_failed_steps_leave_the_encoder_cache_as_it_was_and_everything_is_free_at_the_end(seed):
    rng = random.Random(seed)
    sched = make_core(cache_size=rng.choice([8, 12, 24]), num_blocks=rng.choice([10, 20]), block_size=4,
                      budget=rng.choice([8, 16]), threshold=rng.choice([0, 3]), mode=rng.choice(["recompute", "swap"]))
    ecm = sched.encoder_cache_manager
    hashes = ["p", "q", "r", "s"]
    for i in range(6):
        images = [(rng.choice(hashes), 8 if rng.random() < 0.7 else 4) for _ in range(rng.randint(0, 2))]
        images = list({h: n for h, n in images}.items())          # one size per hash, as real images have
        sched.add_request(image_request(f"r{i}", [(h, 8) for h, _ in images], max_tokens=rng.randint(1, 6),
                                        priority=rng.randint(-1, 1)))
    worker: set[str] = set()     # the outputs the worker holds, as encoder_runner.py keeps them (a failed step's
    for _ in range(400):         # forward ran its encoder too: the failure came after it)
        if not sched.has_unfinished_requests():
            break
        if rng.random() < 0.3:
            before = (copy.deepcopy(ecm.cached), dict(ecm.freeable), list(ecm.freeable), dict(ecm.sizes),
                      ecm.num_free_slots, ecm.evicted, ecm.num_encoder_inputs_scheduled)
            out = step(sched, fail=True)
            after = (ecm.cached, dict(ecm.freeable), list(ecm.freeable), ecm.sizes, ecm.num_free_slots, ecm.evicted,
                     ecm.num_encoder_inputs_scheduled)
            assert after == before
        else:
            out = step(sched)
        worker = (worker - set(out.free_encoder_hashes)) | {f.mm_hash for f in out.encoder_inputs}
        to_drop = set(ecm.evicted) | set(ecm.orphans)          # what the next step tells the worker to drop
        assert set(ecm.sizes) <= worker <= set(ecm.sizes) | to_drop, "the worker holds an output nobody counts"
    assert not sched.has_unfinished_requests()
    assert ecm.cached == {} and ecm.num_free_slots + sum(ecm.freeable.values()) == ecm.cache_size
