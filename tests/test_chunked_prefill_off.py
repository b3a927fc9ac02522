"""`enable_chunked_prefill=False`, as vLLM has it: a prompt's uncached tokens run whole in one step, or the request
waits (and, as in vLLM, so does everyone behind it in the waiting queue); never a chunk. Prefix-cache hits are not
computed, so only the uncached part must fit; a vision-language prompt waits whole for room for its images rather than
running its text before them. Greedy tokens are the same as with chunked prefill on, and as Hugging Face's.

The core-level cases need no model (the fake steps of tests/test_kv_cache_properties.py and
tests/test_encoder_cache.py); the engine-level ones read each step's trace."""

from __future__ import annotations

import pytest

from minivllm import LLM, SamplingParams
from minivllm.core.journal import StepJournal
from minivllm.core.kv_cache_manager import KVCacheManager
from minivllm.core.scheduler import Scheduler
from tests.oracle import PROMPTS, hf_greedy
from tests.test_encoder_cache import encoded, image_request
from tests.test_encoder_cache import make_core as make_image_core
from tests.test_encoder_cache import step as image_step
from tests.test_kv_cache_properties import request, step


def make_core(chunked: bool, budget: int = 64, threshold: int = 0) -> Scheduler:
    kv = KVCacheManager(64, 4, StepJournal())
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=budget, max_model_len=budget,
                      long_prefill_token_threshold=threshold)
    sched.enable_chunked_prefill = chunked
    return sched


# ---------------------------------------------------------------------- the scheduler alone
def test_a_prompt_that_does_not_fit_waits_whole_and_those_behind_it_wait_too():
    sizes = {"a": 40, "b": 40, "c": 10}
    plans = {}
    for chunked in (True, False):
        sched = make_core(chunked)
        for rid, n in sizes.items():
            base = 1000 * (ord(rid) - ord("a") + 1)              # no two prompts share a block
            sched.add_request(request(rid, list(range(base, base + n)), max_tokens=4))
        plans[chunked] = [step(sched).num_scheduled_tokens for _ in range(3)]
    assert plans[True][0] == {"a": 40, "b": 24}             # chunked: b's first 24 tokens fill the step
    assert plans[False][0] == {"a": 40}                     # off: b waits whole, and c (which would fit) behind it
    assert plans[False][1] == {"a": 1, "b": 40, "c": 10}
    for plan in plans[False]:
        for rid, n in plan.items():
            assert n in (1, sizes[rid])                     # a decode, or a whole prompt: never a chunk


def test_only_the_uncached_part_of_a_prompt_must_fit():
    sched = make_core(chunked=False)
    shared = list(range(1, 41))                             # 10 full blocks of 4
    sched.add_request(request("a", shared + [90], max_tokens=1))
    assert step(sched).num_scheduled_tokens == {"a": 41}    # a finishes: its 10 blocks stay cached
    sched.add_request(request("c", list(range(200, 250)), max_tokens=4))
    sched.add_request(request("b", shared + [91, 92], max_tokens=4))
    out = step(sched)
    # c takes 50 of 64; b's 42 tokens would not fit, but 40 are prefix-cache hits: its 2 others do
    assert out.num_scheduled_tokens == {"c": 50, "b": 2}
    assert sched.running[1].num_cached_tokens == 40


def test_the_threshold_never_cuts_a_prompt_when_chunked_prefill_is_off():
    """The engine passes threshold 0 with chunked prefill off (EngineConfig.long_prefill_token_threshold_on), and the
    config refuses one set explicitly; a scheduler given both still never runs a chunk: the prompt waits."""
    sched = make_core(chunked=False, threshold=16)
    sched.add_request(request("a", list(range(1, 41))))
    assert step(sched).num_scheduled_tokens == {}


def test_a_prompt_with_an_image_waits_whole_for_room_in_the_encoder_cache():
    plans = {}
    for chunked in (True, False):
        sched = make_image_core(cache_size=8)
        sched.enable_chunked_prefill = chunked
        a, b = image_request("a", [("x", 8)]), image_request("b", [("y", 8)])
        sched.add_request(a)
        sched.add_request(b)
        out1 = image_step(sched)
        out2 = image_step(sched)
        plans[chunked] = [(out1.num_scheduled_tokens, encoded(out1)), (out2.num_scheduled_tokens, encoded(out2))]
    # chunked: b runs its 3 text tokens, and stops at its image (x fills the encoder cache)
    assert plans[True][0] == ({"a": 14, "b": 3}, ["x"])
    # off: b waits whole; once a has run past x, x is evicted for y and b runs whole
    assert plans[False] == [({"a": 14}, ["x"]), ({"a": 1, "b": 14}, ["y"])]


# ---------------------------------------------------------------------- the engine
def long_prompts(tokenizer) -> list[list[int]]:
    """Six prompts of 20 to 120 tokens: the shared prompts, one after the other from the i-th on, cut to length."""
    ids = [tokenizer.encode(p) for p in PROMPTS]
    return [sum(2 * (ids[i:] + ids[:i]), [])[:n] for i, n in enumerate((20, 40, 60, 80, 100, 120))]


BUDGET = 128           # max_num_batched_tokens = max_model_len: the least chunked prefill off allows


def run(model_dir, prompts: list[list[int]], max_tokens: int, **kwargs):
    llm = LLM(str(model_dir), device="cpu", dtype="float32", num_kv_blocks=64, block_size=16, max_model_len=BUDGET,
              max_num_batched_tokens=BUDGET, max_num_seqs=8, **kwargs)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    with engine.record_traces() as traces:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    llm.shutdown()
    return [o.outputs[0].token_ids for o in outs], traces


def prefill_chunks(traces) -> dict[str, list[tuple[int, int, int]]]:
    """request id -> (tokens scheduled, tokens computed after the step, prompt tokens) of each step that prefilled it."""
    chunks: dict[str, list] = {}
    for t in traces:
        for r in t.requests:
            if r.kind == "prefill":
                chunks.setdefault(r.request_id, []).append((r.num_scheduled_tokens, r.num_computed_tokens,
                                                            r.num_prompt_tokens))
    return chunks


@pytest.mark.slow
def test_with_chunked_prefill_off_no_prompt_is_split_and_the_tokens_are_the_same(model_dir, tokenizer, hf_model):
    prompts = long_prompts(tokenizer)
    assert sum(map(len, prompts)) > 2 * BUDGET            # a step cannot take them all
    chunked, chunked_traces = run(model_dir, prompts, 6, long_prefill_token_threshold=32)
    whole, whole_traces = run(model_dir, prompts, 6, enable_chunked_prefill=False)
    spec, spec_traces = run(model_dir, prompts, 6, enable_chunked_prefill=False,
                            speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    assert whole == chunked == spec
    assert whole[5] == hf_greedy(hf_model, prompts[5], 6)  # the independent oracle, on the longest
    assert any(len(c) > 1 for c in prefill_chunks(chunked_traces).values())   # on: long prompts are split
    for traces in (whole_traces, spec_traces):
        chunks = prefill_chunks(traces)
        assert len(chunks) == len(prompts)
        for rid, steps in chunks.items():
            assert len(steps) == 1, f"request {rid} was prefilled in {len(steps)} steps: {steps}"
            (scheduled, computed, num_prompt), = steps
            assert computed == num_prompt                   # the whole prompt (less its cache hits) in one step
        waited = [t for t in traces if t.num_waiting and t.num_prefill_tokens + t.num_decode_tokens < BUDGET]
        assert waited, "no step left a prompt waiting for want of room: the test would not tell whole from chunked"
