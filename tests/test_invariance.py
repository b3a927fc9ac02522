"""Every memory and scheduling feature leaves greedy outputs unchanged, and provably fired.

The oracle is the same engine with the feature off (itself checked against Hugging Face in
test_parity.py): prefix caching, chunked prefill budgets, preemption in both modes, aborts.
"""

from __future__ import annotations

import random

import pytest

from minivllm import LLM, SamplingParams
from tests.oracle import PROMPTS

SYSTEM = ("You are a careful assistant. Answer in one short sentence, cite no sources, and never use lists. "
          "If you do not know, say so. ") * 3
MAX_TOKENS = 24


def make_llm(model_dir, **kw):
    return LLM(str(model_dir), device="cpu", dtype="float32", **kw)


def greedy(n=MAX_TOKENS):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module")
def prompt_ids(tokenizer):
    return [tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]


@pytest.fixture(scope="module")
def baseline(model_dir, prompt_ids):
    """Prefix caching off, a pool that never runs out, no chunking: the plain engine."""
    llm = make_llm(model_dir, enable_prefix_caching=False, num_kv_blocks=256)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids], greedy(), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def run(llm, prompt_ids, params=None):
    with llm.llm_engine.record_traces() as traces:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids], params or greedy(), use_tqdm=False)
    engine = llm.llm_engine
    assert engine.kv_cache_manager.num_free_blocks == engine.kv_cache_manager.num_blocks      # nothing leaked
    engine.check_integrity()
    return [o.outputs[0].token_ids for o in outs], traces


@pytest.mark.slow
def test_prefix_caching_changes_nothing_and_hits(model_dir, tokenizer, baseline, prompt_ids):
    shared = [tokenizer.encode(SYSTEM + p, add_special_tokens=False) for p in PROMPTS]
    off, _ = run(make_llm(model_dir, enable_prefix_caching=False, num_kv_blocks=256), shared)
    llm = make_llm(model_dir, enable_prefix_caching=True, num_kv_blocks=256)
    first, _ = run(llm, shared[:1])                              # fills the cache with the system prompt
    on, traces = run(llm, shared)
    assert on == off and first[0] == off[0]
    stats = llm.get_stats()
    assert stats.prefix_cache_hits > 0 and any(t.prefix_hit_blocks for t in traces)
    system_blocks = len(tokenizer.encode(SYSTEM, add_special_tokens=False)) // 16
    assert min(r.num_cached_tokens for r in traces[0].requests) >= system_blocks * 16


@pytest.mark.slow
@pytest.mark.parametrize("budget", [16, 64, None])
def test_chunked_prefill_budget_changes_nothing(model_dir, baseline, prompt_ids, budget):
    kw = {"max_num_batched_tokens": budget, "max_num_seqs": budget} if budget else {}
    llm = make_llm(model_dir, enable_prefix_caching=False, num_kv_blocks=256, **kw)
    out, traces = run(llm, prompt_ids)
    assert out == baseline
    chunks = {}
    for t in traces:
        assert t.num_prefill_tokens + t.num_decode_tokens <= (budget or 8192)
        for r in t.requests:
            if r.kind == "prefill":
                chunks[r.request_id] = chunks.get(r.request_id, 0) + 1
    if budget is not None:
        assert max(chunks.values()) > 1                           # some prompt really was split
        # decodes and prefill chunks shared a step
        assert any(t.num_prefill_tokens and t.num_decode_tokens for t in traces)
    else:
        assert max(chunks.values()) == 1


@pytest.mark.slow
@pytest.mark.parametrize("threshold", [8, 0])
def test_long_prefill_token_threshold_caps_each_prefill_chunk_and_changes_nothing(model_dir, baseline, prompt_ids,
                                                                                 threshold):
    """vLLM's long_prefill_token_threshold: no request computes more than that many tokens of its prompt in a step,
    whatever the budget left, so a long prompt shares its steps with the others' decodes. 0 turns it off."""
    llm = make_llm(model_dir, enable_prefix_caching=False, num_kv_blocks=256, long_prefill_token_threshold=threshold)
    assert llm.llm_engine.scheduler.long_prefill_token_threshold == threshold
    out, traces = run(llm, prompt_ids)
    assert out == baseline
    chunks = [r.num_scheduled_tokens for t in traces for r in t.requests if r.kind == "prefill"]
    if threshold:
        assert max(chunks) == threshold and len(chunks) > len(prompt_ids)       # capped, and some were split
        assert any(t.num_prefill_tokens and t.num_decode_tokens for t in traces)
    else:
        assert max(chunks) == max(map(len, prompt_ids)) and len(chunks) == len(prompt_ids)


@pytest.mark.slow
def test_on_a_cpu_a_long_prompt_is_prefilled_between_a_streams_decodes(model_dir):
    """Issue 49 item 3: with the CPU default, a 1,000-token prompt arriving while another request decodes is
    prefilled in chunks of CPU_LONG_PREFILL_TOKEN_THRESHOLD tokens, and the decoding request gets a token in every
    one of those steps (without the cap the whole prompt was one step, as long as that stream's wait)."""
    from minivllm.config import CPU_LONG_PREFILL_TOKEN_THRESHOLD
    engine = make_llm(model_dir, num_kv_blocks=256).llm_engine
    engine.add_request({"prompt_token_ids": [1000, 2000, 3000]}, greedy(200), request_id="stream")
    engine.step()
    engine.add_request({"prompt_token_ids": [1000 + (i * 7919) % 40000 for i in range(1000)]}, greedy(1),
                       request_id="long")
    with engine.record_traces() as traces:
        while "long" in engine.requests:
            engine.step()
    chunks = [r.num_scheduled_tokens for t in traces for r in t.requests if r.request_id == "long" and r.kind]
    assert chunks[:-1] == [CPU_LONG_PREFILL_TOKEN_THRESHOLD] * (len(chunks) - 1) and sum(chunks) == 1000
    assert all(any(r.request_id == "stream" and r.kind == "decode" for r in t.requests) for t in traces)


def test_the_long_prefill_token_threshold_defaults_by_platform():
    from minivllm.config import CPU_LONG_PREFILL_TOKEN_THRESHOLD, EngineConfig
    assert EngineConfig().long_prefill_token_threshold_on("cpu") == CPU_LONG_PREFILL_TOKEN_THRESHOLD
    assert EngineConfig().long_prefill_token_threshold_on("cuda") == 0
    assert EngineConfig(long_prefill_token_threshold=0).long_prefill_token_threshold_on("cpu") == 0
    for bad in (-1, 1.5, True, "8"):
        with pytest.raises(ValueError, match="long_prefill_token_threshold"):
            EngineConfig.from_kwargs(long_prefill_token_threshold=bad)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_changes_nothing_and_happens(model_dir, baseline, prompt_ids, mode):
    # 12 blocks of 16 tokens = 192 slots for 6 requests that grow to ~60 tokens each: preemption is forced.
    llm = make_llm(model_dir, num_kv_blocks=12, preemption_mode=mode, swap_space=0.05)
    out, traces = run(llm, prompt_ids)
    assert out == baseline
    assert llm.get_stats().num_preemptions > 0
    if mode == "swap":
        assert any(t.blocks_swapped_out for t in traces) and any(t.blocks_swapped_in for t in traces)
        assert llm.llm_engine.kv_cache_manager.swap_space.tables == {}
    else:
        assert any(r.status == "preempted" for t in traces for r in t.requests)


@pytest.mark.slow
def test_random_aborts_leave_the_others_unchanged(model_dir, baseline, prompt_ids):
    llm = make_llm(model_dir, num_kv_blocks=20, preemption_mode="swap", swap_space=0.05,
                   max_num_batched_tokens=32, max_num_seqs=32)
    engine = llm.llm_engine
    rng = random.Random(0)
    keep = {engine.add_request({"prompt_token_ids": p}, greedy()).request_id: i for i, p in enumerate(prompt_ids)}
    doomed = [engine.add_request({"prompt_token_ids": p[:rng.randint(3, len(p))]}, greedy(40)).request_id
              for p in prompt_ids]
    done, aborted = {}, 0
    while engine.has_unfinished_requests():
        if doomed and rng.random() < 0.3:
            aborted += engine.abort_request(doomed.pop(rng.randrange(len(doomed)))) is not None
            engine.check_integrity()
        for out in engine.step():
            if out.finished and out.request_id in keep:
                done[keep[out.request_id]] = out.outputs[0].token_ids
    assert [done[i] for i in range(len(prompt_ids))] == baseline
    assert aborted >= 3                                        # live requests really were aborted
    assert engine.kv_cache_manager.num_free_blocks == engine.kv_cache_manager.num_blocks
    assert not engine.kv_cache_manager.swap_space.tables
