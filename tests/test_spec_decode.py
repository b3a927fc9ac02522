"""Speculative decoding (speculative_config, n-gram proposer, exact verification).

Oracles: Hugging Face greedy (every greedy output equals it, token for token, with speculation on), the same engine
without speculation (logprobs, structured output, seeded sampling's distribution), and a chi-square test of the
rejection sampler against the target distribution (which also rejects a deliberately wrong acceptance rule).
Each test shows speculation fired: drafts were verified and some accepted.
"""

from __future__ import annotations

import json

import pytest
import torch
from scipy.stats import chi2_contingency, chisquare

from minivllm import LLM, SamplingParams, StructuredOutputsParams
from minivllm.core.request import Request
from minivllm.spec_decode.ngram_proposer import NgramProposer
from minivllm.worker.rejection_sampler import RejectionSampler
from minivllm.worker.sampler import Sampler
from tests.oracle import PROMPTS, hf_greedy

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
TEXT = ("The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step. "
        "def add(a, b):\n    return a + b\n")
# Prompts whose continuations repeat text from the prompt (lookup hits) and the shared parity prompts.
COPY = [f"Repeat this text exactly:\n{TEXT}\nRepeated:\n{TEXT[:40]}", f"{TEXT}\n{TEXT}\n{TEXT[:30]}"]
ALL = COPY + PROMPTS


def make_llm(model_dir, spec=True, **kw):
    kw.setdefault("num_kv_blocks", 256)
    return LLM(str(model_dir), device="cpu", dtype="float32", speculative_config=NGRAM if spec else None, **kw)


def greedy(n=32, **kw):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw)


def run(llm, prompts, params):
    outs = llm.generate(prompts, params, use_tqdm=False)
    engine = llm.llm_engine
    engine.check_integrity()
    assert engine.kv_cache_manager.num_free_blocks == engine.kv_cache_manager.num_blocks     # nothing leaked
    return outs


def fired(llm, since=None) -> tuple[int, int]:
    """Drafts verified and accepted (since the stats `since`, if given); asserts some were, of both."""
    s = llm.get_stats()
    drafts, accepted = s.num_spec_draft_tokens, s.num_spec_accepted_tokens
    if since is not None:
        drafts, accepted = drafts - since.num_spec_draft_tokens, accepted - since.num_spec_accepted_tokens
    assert drafts > 0 and accepted > 0, (drafts, accepted)
    return drafts, accepted


@pytest.fixture(scope="module")
def spec_llm(model_dir):
    return make_llm(model_dir)


@pytest.fixture(scope="module")
def plain_llm(model_dir):
    return make_llm(model_dir, spec=False)


@pytest.fixture(scope="module")
def reference(plain_llm):
    """Greedy token ids of every prompt without speculation (test_parity holds those to HF)."""
    return [o.outputs[0].token_ids for o in run(plain_llm, ALL, greedy())]


def test_greedy_equals_hugging_face_with_speculation(spec_llm, hf_model, tokenizer):
    for prompt in COPY + PROMPTS[:2]:
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        out = run(spec_llm, {"prompt_token_ids": ids}, greedy())[0]
        assert out.outputs[0].token_ids == hf_greedy(hf_model, ids, 32), prompt
    drafts, accepted = fired(spec_llm)
    assert accepted / drafts > 0.3, (drafts, accepted)              # the copy prompts are mostly accepted


@pytest.mark.slow
@pytest.mark.parametrize("kw", [
    dict(),                                                          # prefix caching on (default)
    dict(enable_prefix_caching=False),
    dict(max_num_batched_tokens=16, max_num_seqs=8),                 # chunked prefill; budget cuts drafts too
    dict(num_kv_blocks=24, block_size=8, preemption_mode="recompute"),
    dict(num_kv_blocks=24, block_size=8, preemption_mode="swap"),
], ids=["prefix-caching", "no-prefix-caching", "chunked-prefill", "preempt-recompute", "preempt-swap"])
def test_greedy_is_unchanged_by_speculation_with_every_memory_feature(model_dir, reference, kw):
    llm = make_llm(model_dir, **kw)
    outs = run(llm, ALL, greedy())
    assert [o.outputs[0].token_ids for o in outs] == reference
    fired(llm)
    if "preemption_mode" in kw:
        assert llm.get_stats().num_preemptions > 0
    if kw == {}:                                                     # again: prefix-cache hits, same tokens
        again = run(llm, ALL, greedy())
        assert [o.outputs[0].token_ids for o in again] == reference
        assert llm.get_stats().prefix_cache_hits > 0


def test_n_samples_stop_strings_and_max_tokens(spec_llm, plain_llm):
    params = [SamplingParams(temperature=0, n=2, max_tokens=30),
              SamplingParams(temperature=0, max_tokens=40, stop=["single"]),
              SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[28])]
    for sp in params:
        want = run(plain_llm, COPY, sp)
        before = spec_llm.get_stats()
        got = run(spec_llm, COPY, sp)
        fired(spec_llm, before)
        for w, g in zip(want, got):
            assert [c.token_ids for c in g.outputs] == [c.token_ids for c in w.outputs], sp
            assert [c.text for c in g.outputs] == [c.text for c in w.outputs], sp
            assert [c.finish_reason for c in g.outputs] == [c.finish_reason for c in w.outputs], sp
            assert all(len(c.token_ids) <= sp.max_tokens for c in g.outputs)       # never more than asked


def test_logprobs_equal_without_speculation(spec_llm, plain_llm):
    sp = SamplingParams(temperature=0, max_tokens=24, logprobs=3)
    want = run(plain_llm, COPY, sp)
    before = spec_llm.get_stats()
    got = run(spec_llm, COPY, sp)
    fired(spec_llm, before)
    for w, g in zip(want, got):
        cw, cg = w.outputs[0], g.outputs[0]
        assert cg.token_ids == cw.token_ids and len(cg.logprobs) == len(cg.token_ids)
        for a, b in zip(cw.logprobs, cg.logprobs):
            assert list(a) == list(b)
            assert [x.logprob for x in a.values()] == pytest.approx([x.logprob for x in b.values()], abs=1e-4)
        assert cg.cumulative_logprob == pytest.approx(cw.cumulative_logprob, abs=1e-3)


def test_structured_output_with_speculation(spec_llm, plain_llm):
    schema = {"type": "object", "properties": {"text": {"type": "string", "maxLength": 60}}, "required": ["text"]}
    sp = SamplingParams(temperature=0, max_tokens=60, structured_outputs=StructuredOutputsParams(json=schema))
    prompt = [f'Put this text in a JSON object {{"text": ...}}: {TEXT[:44]}\n{{"text": "{TEXT[:44]}"}}\n']
    want = run(plain_llm, prompt, sp)[0].outputs[0]
    before = spec_llm.get_stats()
    got = run(spec_llm, prompt, sp)[0].outputs[0]
    fired(spec_llm, before)
    assert got.token_ids == want.token_ids
    json.loads(got.text)


@pytest.mark.slow
def test_a_request_with_penalties_gets_no_drafts_and_is_unchanged(model_dir, plain_llm):
    llm = make_llm(model_dir)
    sp = SamplingParams(temperature=0, max_tokens=24, repetition_penalty=1.3)
    assert [o.outputs[0].token_ids for o in run(llm, COPY, sp)] == [
        o.outputs[0].token_ids for o in run(plain_llm, COPY, sp)]
    assert llm.get_stats().num_spec_draft_tokens == 0


def test_the_trace_shows_drafts_and_only_accepted_tokens_are_computed(spec_llm):
    engine = spec_llm.llm_engine
    req = engine.add_request(COPY[0], greedy(40))
    with engine.record_traces() as traces:
        while engine.has_unfinished_requests():
            before = (req.num_computed_tokens, req.num_tokens)
            engine.step()
            if not req.is_finished:
                assert req.num_computed_tokens == req.num_tokens - 1      # only real tokens have KV
                assert req.num_tokens - before[1] >= 1
    verified = [t.by_id[req.request_id] for t in traces if t.by_id.get(req.request_id) and
                t.by_id[req.request_id].num_draft_tokens]
    assert verified and any(r.num_accepted_tokens > 0 for r in verified)
    assert any(r.num_accepted_tokens < r.num_draft_tokens for r in verified)   # some drafts were rejected
    engine.check_integrity()


def test_a_failed_step_with_drafts_rolls_back(spec_llm, plain_llm):
    engine = spec_llm.llm_engine
    want = run(plain_llm, COPY, greedy(30))
    reqs = [engine.add_request(p, greedy(30)) for p in COPY]
    real = engine.output_processor.process_outputs
    calls = {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] % 3 == 0:
            raise RuntimeError("injected")
        return real(*args, **kwargs)

    engine.output_processor.process_outputs = flaky
    tokens = {r.request_id: [] for r in reqs}
    before = engine.get_stats()
    try:
        while engine.has_unfinished_requests():
            state = [(r.num_computed_tokens, list(r.output_token_ids), list(r.spec_token_ids)) for r in reqs]
            counters = engine.get_stats()
            try:
                engine.step()
            except RuntimeError:
                assert [(r.num_computed_tokens, r.output_token_ids, r.spec_token_ids) for r in reqs] == state
                after = engine.get_stats()
                assert (after.num_spec_draft_tokens, after.num_spec_accepted_tokens) == (
                    counters.num_spec_draft_tokens, counters.num_spec_accepted_tokens)
                engine.check_integrity()
    finally:
        engine.output_processor.process_outputs = real
    fired(spec_llm, before)
    for r in reqs:
        tokens[r.request_id] = r.output_token_ids
    assert [tokens[r.request_id] for r in reqs] == [o.outputs[0].token_ids for o in want]


# ---------------------------------------------------------------------- sampling: the rule is exact
def _rejection_draws(p_rows: torch.Tensor, drafts: list[int], n: int, rule=None) -> list[list[int]]:
    """n seeded verifications of the same drafts against target probabilities p_rows (k + 1, vocab)."""
    logits = p_rows.log().repeat(n, 1)                             # temperature 1: softmax(log p) = p
    reqs = [Request(str(i), [1], SamplingParams(temperature=1.0, seed=i)) for i in range(n)]
    sampler = RejectionSampler(Sampler(0))
    if rule is not None:
        sampler._sample = rule.__get__(sampler)
    return sampler(logits, reqs, [drafts] * n)


P = torch.tensor([[0.45, 0.25, 0.15, 0.10, 0.05],       # row 0 checks draft 0
                  [0.10, 0.50, 0.20, 0.15, 0.05],       # row 1 (after draft 0) checks draft 1
                  [0.30, 0.30, 0.20, 0.10, 0.10]])      # row 2: the bonus token


def test_rejection_sampling_keeps_the_target_distribution():
    """Chi-square: the first kept token follows row 0's distribution; given that draft 0 was kept, the next token
    follows row 1's. 20,000 seeded verifications of n-gram drafts [2, 1]."""
    n = 20_000
    kept = _rejection_draws(P, [2, 1], n)
    first = torch.bincount(torch.tensor([k[0] for k in kept]), minlength=5)
    assert chisquare(first.double().numpy(), (P[0].double() * n).numpy()).pvalue > 1e-3
    second = torch.bincount(torch.tensor([k[1] for k in kept if k[0] == 2]), minlength=5)
    assert chisquare(second.double().numpy(), (P[1].double() * second.sum()).numpy()).pvalue > 1e-3
    assert all(len(k) == 3 for k in kept if k[:2] == [2, 1])                      # both kept: a bonus token


def test_the_test_rejects_a_wrong_rule():
    """Always accepting the drafts (a plausible bug) puts all of the first token's mass on the draft: caught."""
    def always_accept(self, req, drafts, p, q):
        return list(drafts) + [self._draw(p[len(drafts)], self.sampler.generator_for(req, p.device))]

    n = 4_000
    kept = _rejection_draws(P, [2, 1], n, rule=always_accept)
    first = torch.bincount(torch.tensor([k[0] for k in kept]), minlength=5)
    assert chisquare(first.double().numpy(), (P[0].double() * n).numpy()).pvalue < 1e-6


@pytest.mark.slow
def test_seeded_sampling_with_speculation_follows_the_same_distribution(spec_llm, plain_llm):
    """End to end: 300 seeded 3-token continuations (top_k 2) of a copy prompt with and without speculation are two
    samples of one distribution (chi-square on the contingency table of the continuations). The prompt is cut to
    4 blocks and one token, so that from the second request on the prefix cache holds all but its last token: a
    request prefills one token, not 78 (67 s -> 19 s of the suite, 2026-11-28)."""
    n = 300
    block_size = spec_llm.llm_engine.config.block_size
    ids = spec_llm.get_tokenizer().encode(COPY[1], add_special_tokens=False)[:4 * block_size + 1]
    prompt = {"prompt_token_ids": ids}
    counts = []
    before = spec_llm.get_stats()
    for llm in (plain_llm, spec_llm):
        params = [SamplingParams(temperature=1.0, top_k=2, seed=i, max_tokens=3, ignore_eos=True) for i in range(n)]
        outs = llm.generate([prompt] * n, params, use_tqdm=False)
        counts.append([tuple(o.outputs[0].token_ids) for o in outs])
    fired(spec_llm, before)
    keys = sorted(set(counts[0]) | set(counts[1]))
    table = [[c.count(k) for k in keys] for c in counts]
    assert chi2_contingency(table).pvalue > 1e-3, table


# ---------------------------------------------------------------------- proposer and config
def test_ngram_proposer_takes_the_latest_longest_match():
    p = NgramProposer(3, 2, 4)
    assert p.propose([1, 2, 3, 4, 5, 6, 1, 2, 3]) == [4, 5, 6]
    assert p.propose([7, 8, 9, 7, 8, 5, 7, 8]) == [5, 7, 8]                      # the latest occurrence of 7 8
    assert p.propose([1, 2, 3]) == []                                              # no earlier n-gram
    assert p.propose([1, 2, 1, 2, 1, 2], max_tokens=1) == [1]
    assert NgramProposer(2, 1, 1).propose([5, 6, 5]) == [6, 5]


@pytest.mark.parametrize("cfg, message", [
    ({"method": "eagle", "num_speculative_tokens": 2}, "method is 'eagle'"),
    ({"method": "ngram"}, "num_speculative_tokens is None"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "[1, 16]"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2},
     "prompt_lookup_min <= prompt_lookup_max"),
    ({"method": "ngram", "num_speculative_tokens": 2, "typo": 1}, "unknown key(s) ['typo']"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "needs 'model'"),
])
def test_bad_speculative_config(model_dir, cfg, message):
    with pytest.raises(ValueError) as e:
        LLM(str(model_dir), speculative_config=cfg)
    assert message in str(e.value)


@pytest.mark.slow
def test_speculation_under_tensor_parallelism(model_dir, reference):
    """TP 3 (worker processes, gloo): the drafts are in the flat batch every rank runs; rank 0 verifies."""
    llm = make_llm(model_dir, tensor_parallel_size=3, distributed_executor_backend="mp")
    try:
        outs = run(llm, COPY, greedy())
        assert [o.outputs[0].token_ids for o in outs] == reference[:len(COPY)]
        fired(llm)
    finally:
        llm.shutdown()


# ---------------------------------------------------------------------- the draft-model proposer
def draft_llm(model_dir, **spec):
    return LLM(str(model_dir), device="cpu", dtype="float32", num_kv_blocks=128,
               speculative_config={"method": "draft_model", "num_speculative_tokens": 3, **spec})


@pytest.mark.slow
def test_the_target_as_its_own_draft_accepts_every_proposal(model_dir, reference):
    llm = draft_llm(model_dir, model=str(model_dir))
    outs = run(llm, COPY + PROMPTS[:2], greedy())
    assert [o.outputs[0].token_ids for o in outs] == reference[:len(COPY) + 2]
    s = llm.get_stats()
    assert s.num_spec_draft_tokens > 0 and s.num_spec_accepted_tokens == s.num_spec_draft_tokens, s
    assert s.spec_mean_acceptance_length == 1 + s.num_spec_draft_tokens / s.num_spec_drafts      # every one kept


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["first-layers", "random-weights"])
def test_a_poor_draft_changes_nothing(model_dir, reference, tmp_path, kind):
    """The target's first 6 layers, or a tiny random-weights model with the same tokenizer: most drafts are
    rejected, and the greedy output is still the target's, token for token."""
    if kind == "first-layers":
        llm = draft_llm(model_dir, draft_num_layers=6)
    else:
        from minivllm.model.random_checkpoint import write_random_checkpoint
        write_random_checkpoint("tiny-qwen3", tmp_path / "draft", dtype="float32")
        llm = draft_llm(model_dir, model=str(tmp_path / "draft"))
    outs = run(llm, COPY + PROMPTS[:2], greedy())
    assert [o.outputs[0].token_ids for o in outs] == reference[:len(COPY) + 2]
    s = llm.get_stats()
    assert s.num_spec_draft_tokens > 0 and s.spec_acceptance_rate < 0.5, s


@pytest.mark.slow
def test_a_draft_with_another_vocabulary_is_refused(model_dir, tmp_path):
    from minivllm.model.random_checkpoint import write_random_checkpoint
    write_random_checkpoint("tiny-qwen3", tmp_path / "draft", dtype="float32")
    cfg = json.loads((tmp_path / "draft" / "config.json").read_text())
    cfg["vocab_size"] = 1000
    (tmp_path / "draft" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="share the target's tokenizer"):
        draft_llm(model_dir, model=str(tmp_path / "draft"))


@pytest.mark.slow
def test_long_prefill_token_threshold_caps_one_plus_the_drafts_as_in_vllm(model_dir, reference):
    """vLLM counts a request's drafts among its new tokens, so long_prefill_token_threshold caps 1 + drafts: at 3,
    at most 2 of the 4 drafts are verified in a step. Greedy tokens do not change."""
    llm = make_llm(model_dir, long_prefill_token_threshold=3)
    engine = llm.llm_engine
    with engine.record_traces() as traces:
        outs = run(llm, ALL, greedy())
    assert [o.outputs[0].token_ids for o in outs] == reference
    per_request = [r.num_draft_tokens for t in traces for r in t.by_id.values()]
    assert max(per_request) == 2                                   # the cap, reached
    fired(llm)
