"""Penalties and filters (vLLM's): each checked against an independent oracle, and shown to have fired.

Oracles: Hugging Face `generate(repetition_penalty=...)` for the repetition penalty; a hand-written loop over
rows and tokens (vLLM's semantics, one request at a time) for the batched tensor code; a chi-square test for
min-p sampling; and end-to-end properties (only allowed ids, no bad words, at least min_tokens).
"""

from __future__ import annotations

import math

import pytest
import torch
from scipy.stats import chisquare

from minivllm import SamplingParams
from minivllm.core.request import Request
from minivllm.worker.sampler import Sampler, apply_min_p, apply_penalties_and_filters

VOCAB = 40
EOS = 2


def _request(prompt, output, bad_words_token_ids=(), **kw):
    r = Request("r", list(prompt), SamplingParams(**kw), eos_token_ids=frozenset({EOS}),
                bad_words_token_ids=[list(w) for w in bad_words_token_ids])
    for t in output:
        r.append_output_token(t)
    return r


def reference(logits: torch.Tensor, r: Request) -> torch.Tensor:
    """One row, token by token, in vLLM v1's order: allowed ids, bad words, min_tokens, logit bias, penalties."""
    p, row = r.sampling_params, logits.clone().tolist()
    out = r.output_token_ids
    for t in range(len(row)):
        if p.allowed_token_ids is not None and t not in p.allowed_token_ids:
            row[t] = -math.inf
    for word in r.bad_words_token_ids:
        prefix = word[:-1]
        if len(out) >= len(prefix) and (not prefix or out[-len(prefix):] == prefix):
            row[word[-1]] = -math.inf
    if len(out) < p.min_tokens:
        for t in set(p.stop_token_ids) | ({EOS} if not p.ignore_eos else set()):
            row[t] = -math.inf
    for t, b in (p.logit_bias or {}).items():
        row[t] += b
    for t in range(len(row)):
        if t in r.prompt_token_ids or t in out:                     # repetition: prompt and output
            row[t] = row[t] / p.repetition_penalty if row[t] > 0 else row[t] * p.repetition_penalty
        row[t] -= p.frequency_penalty * out.count(t)                 # frequency and presence: output only
        row[t] -= p.presence_penalty * (t in out)
    return torch.tensor(row)


CASES = [
    dict(),                                                          # plain: unchanged
    dict(repetition_penalty=1.7),
    dict(repetition_penalty=0.6),
    dict(presence_penalty=1.5),
    dict(frequency_penalty=0.7),
    dict(presence_penalty=-0.5, frequency_penalty=1.2, repetition_penalty=1.3),
    dict(logit_bias={3: 5.0, 7: -100.0, 11: 250.0}),                 # 250 is clamped to 100
    dict(allowed_token_ids=[1, 4, 9, 16]),
    dict(min_tokens=10, stop_token_ids=[5, 6]),                      # 6 outputs < 10: EOS, 5, 6 banned
    dict(min_tokens=3, stop_token_ids=[5]),                          # 6 outputs >= 3: nothing banned
    dict(min_tokens=10, stop_token_ids=[5], ignore_eos=True),        # EOS is not a stop with ignore_eos
    dict(temperature=0, frequency_penalty=0.4, logit_bias={0: 1.0}),
]
BAD_WORDS = [[12], [8, 13], [30, 8, 14], [9, 15]]   # [12] always; [8,13] and [30,8,14] match the tail; [9,15] not


def test_penalties_and_filters_match_a_row_by_row_reference():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(len(CASES) + 1, VOCAB, generator=g) * 3
    prompt, output = [3, 4, 20, 21, 3], [7, 7, 3, 30, 8, 30, 8]
    reqs = [_request(prompt, output, **kw) for kw in CASES]
    reqs.append(_request(prompt, output, bad_words_token_ids=BAD_WORDS, presence_penalty=0.1))
    got = apply_penalties_and_filters(logits, reqs)
    for i, r in enumerate(reqs):
        torch.testing.assert_close(got[i], reference(logits[i], r), rtol=1e-6, atol=1e-6)
    assert torch.equal(got[0], logits[0])                            # the plain row is untouched, bit for bit
    changed = (got != logits).any(dim=-1).tolist()
    assert changed == [i not in (0, 9) for i in range(len(reqs))]   # each feature fired; min_tokens=3 is met
    assert torch.isinf(got[10, 5]) and torch.isfinite(got[10, EOS])
    assert got[len(CASES), [12, 13, 14]].isinf().all() and torch.isfinite(got[len(CASES), 15])


def test_bad_words_longer_than_the_output_do_not_match():
    r = _request([1], [8], bad_words_token_ids=[[30, 8, 14], [8, 13]])
    got = apply_penalties_and_filters(torch.zeros(1, VOCAB), [r])[0]
    assert torch.isinf(got[13]) and torch.isfinite(got[14])


def test_min_p_keeps_tokens_within_min_p_of_the_top():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.5, 0.3, 0.15, 0.05], [0.4, 0.3, 0.2, 0.1]]))
    out = apply_min_p(logits, [0.35, 0.0, 1.0])
    assert torch.isfinite(out[0]).tolist() == [True, True, False, False]      # 0.15 < 0.35 * 0.5
    assert torch.isfinite(out[1]).all()
    assert torch.isfinite(out[2]).tolist() == [True, False, False, False]


def test_seeded_min_p_sampling_follows_the_filtered_distribution():
    """Chi-square: 20,000 draws with temperature 0.8 and min_p 0.2 follow softmax(logits / 0.8) renormalised
    over the tokens whose probability is at least 0.2 x the top one, and never pick the others."""
    logits = torch.tensor([2.0, 1.6, 1.0, 0.3, -0.5, -1.0])
    n = 20_000
    reqs = [Request(str(i), [1], SamplingParams(temperature=0.8, min_p=0.2, seed=i)) for i in range(n)]
    tokens = torch.tensor(Sampler(0)(logits.repeat(n, 1), reqs))
    probs = (logits / 0.8).softmax(-1)
    keep = probs >= 0.2 * probs.max()
    assert keep.tolist() == [True, True, True, False, False, False]             # the filter has work to do
    counts = torch.bincount(tokens, minlength=len(logits))
    assert counts[~keep].sum() == 0
    expected = (probs[keep].double() / probs[keep].double().sum() * n).numpy()
    assert chisquare(counts[keep].double().numpy(), expected).pvalue > 1e-3


def test_a_plain_batch_skips_the_processing(monkeypatch):
    import minivllm.worker.sampler as sampler_module

    def boom(*args):
        raise AssertionError("called on a plain batch")
    monkeypatch.setattr(sampler_module, "apply_penalties_and_filters", boom)
    logits = torch.randn(3, VOCAB)
    assert Sampler(0)(logits, [_request([1], [], temperature=0)] * 3) == logits.argmax(-1).tolist()


# ---------------------------------------------------------------- end to end, on the default model
def _greedy(llm, prompt, **kw):
    sp = SamplingParams(temperature=0, **kw)
    return llm.generate(prompt, sp, use_tqdm=False)[0].outputs[0]


@pytest.mark.slow
def test_greedy_repetition_penalty_and_min_tokens_match_hugging_face(llm, hf_model, tokenizer):
    """HF's RepetitionPenaltyLogitsProcessor and MinNewTokensLengthLogitsProcessor (EOS due at token 13 here)."""
    prompt = "A list of prime numbers: 2, 3, 5, 7,"
    ids = tokenizer.encode(prompt)
    ours = _greedy(llm, prompt, max_tokens=16, repetition_penalty=1.3, min_tokens=16).token_ids
    with torch.no_grad():
        hf = hf_model.generate(torch.tensor([ids]), do_sample=False, repetition_penalty=1.3, max_new_tokens=16,
                               min_new_tokens=16, pad_token_id=EOS)[0, len(ids):].tolist()
    assert ours == hf
    assert ours != _greedy(llm, prompt, max_tokens=16, ignore_eos=True).token_ids     # the penalty fired
    assert EOS in _greedy(llm, prompt, max_tokens=16, repetition_penalty=1.3).token_ids  # min_tokens fired


def test_allowed_token_ids_and_logit_bias_end_to_end(llm, tokenizer):
    allowed = tokenizer.encode(" yes no maybe", add_special_tokens=False)
    out = _greedy(llm, "The capital of France is", max_tokens=8, allowed_token_ids=allowed, ignore_eos=True)
    assert set(out.token_ids) <= set(allowed)
    plain = _greedy(llm, "The capital of France is", max_tokens=8, ignore_eos=True).token_ids
    assert not set(plain) <= set(allowed)                                         # the mask fired
    comma = tokenizer.encode(",", add_special_tokens=False)[0]
    biased = _greedy(llm, "The capital of France is", max_tokens=6, logit_bias={comma: 100.0}).token_ids
    assert biased == [comma] * 6 and comma not in plain


@pytest.mark.slow
def test_bad_words_never_appear(llm, tokenizer):
    prompt = "The capital of France is"
    assert "Paris" in _greedy(llm, prompt, max_tokens=12).text
    banned = ["Paris", "capital"]
    out = _greedy(llm, prompt, max_tokens=24, bad_words=banned)
    assert not any(w in out.text for w in banned), out.text
    sampled = llm.generate([prompt] * 4, SamplingParams(temperature=1.0, seed=3, max_tokens=24, bad_words=banned),
                           use_tqdm=False)
    assert not any(w in o.outputs[0].text for o in sampled for w in banned)


@pytest.mark.slow
def test_min_tokens_holds_off_eos(llm):
    chat = [{"role": "user", "content": "Say hi."}]
    plain = llm.chat(chat, SamplingParams(temperature=0, max_tokens=60))[0].outputs[0]
    assert plain.finish_reason == "stop" and len(plain.token_ids) < 30
    held = llm.chat(chat, SamplingParams(temperature=0, max_tokens=60, min_tokens=30))[0].outputs[0]
    assert len(held.token_ids) >= 30 and EOS not in held.token_ids[:29]
    assert held.token_ids[:len(plain.token_ids) - 1] == plain.token_ids[:-1]       # same text until EOS was due


@pytest.mark.slow
def test_plain_requests_in_a_penalized_batch_keep_their_outputs(llm):
    prompts = ["The capital of France is", "Hello, my name is", "A list of prime numbers: 2, 3, 5, 7,",
               "Once upon a time"]
    plain_sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    seeded_sp = SamplingParams(temperature=1.0, seed=11, max_tokens=12, ignore_eos=True)
    alone = [llm.generate(p, sp, use_tqdm=False)[0].outputs[0].token_ids
             for p, sp in zip(prompts[:2], (plain_sp, seeded_sp))]
    penalized = [SamplingParams(temperature=0, max_tokens=12, repetition_penalty=1.5, presence_penalty=1.0,
                                ignore_eos=True),
                 SamplingParams(temperature=0.9, seed=5, min_p=0.1, frequency_penalty=1.0, bad_words=["the"],
                                logit_bias={11: 3.0}, max_tokens=12, ignore_eos=True)]
    outs = llm.generate(prompts, [plain_sp, seeded_sp] + penalized, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs[:2]] == alone


@pytest.mark.parametrize("kw, words", [
    (dict(presence_penalty=2.5), ["presence_penalty", "2.5", "[-2, 2]"]),
    (dict(frequency_penalty=-3), ["frequency_penalty", "-3", "[-2, 2]"]),
    (dict(repetition_penalty=0), ["repetition_penalty", "> 0"]),
    (dict(min_p=1.5), ["min_p", "1.5", "[0, 1]"]),
    (dict(min_tokens=20, max_tokens=10), ["min_tokens", "20", "max_tokens=10"]),
    (dict(bad_words="Paris"), ["bad_words", "list of strings"]),
    (dict(bad_words=[""]), ["bad_words", "non-empty"]),
    (dict(allowed_token_ids=[]), ["allowed_token_ids", "non-empty"]),
    (dict(allowed_token_ids=[-1]), ["allowed_token_ids", "-1"]),
    (dict(logit_bias={"x": 1.0}), ["logit_bias", "'x'"]),
    (dict(logit_bias={3: float("nan")}), ["logit_bias[3]", "finite"]),
])
def test_bad_values_are_refused_with_the_limit(kw, words):
    with pytest.raises(ValueError) as e:
        SamplingParams(**kw)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_token_ids_outside_the_vocabulary_are_refused(llm):
    vocab = llm.llm_engine.model_config.vocab_size
    for kw in (dict(allowed_token_ids=[vocab]), dict(logit_bias={vocab + 5: 1.0})):
        with pytest.raises(ValueError, match=f"in \\[0, {vocab}\\)"):
            llm.llm_engine.add_request("hi", SamplingParams(**kw))
    assert SamplingParams(logit_bias={"17": 2}).logit_bias == {17: 2.0}          # JSON keys arrive as strings
