"""Sampling: seeded reproducibility, batch independence, and the sampler's distribution."""

from __future__ import annotations

import pytest
import torch

from minivllm import SamplingParams
from minivllm.core.request import Request
from minivllm.worker.sampler import Sampler, apply_top_k_top_p


def test_seeded_sampling_repeats_across_runs(llm):
    sp = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=16, ignore_eos=True)
    a = llm.generate("Tell me a story about a cat", sp, use_tqdm=False)[0].outputs[0].token_ids
    b = llm.generate("Tell me a story about a cat", sp, use_tqdm=False)[0].outputs[0].token_ids
    assert a == b


@pytest.mark.slow
def test_seeded_sampling_ignores_batch_composition(llm):
    sp = SamplingParams(temperature=1.0, seed=7, max_tokens=16, ignore_eos=True)
    alone = llm.generate("My favourite food is", sp, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=n, ignore_eos=True) for n in (5, 20, 11)]
    outs = llm.generate(["Dogs are", "My favourite food is", "Rain falls", "Numbers: 1, 2,"],
                        [others[0], sp, others[1], others[2]], use_tqdm=False)
    assert outs[1].outputs[0].token_ids == alone
    different_seed = llm.generate("My favourite food is", SamplingParams(temperature=1.0, seed=8, max_tokens=16,
                                  ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids
    assert different_seed != alone          # the seed matters


@pytest.mark.slow
def test_top_k_1_and_tiny_top_p_equal_greedy(llm):
    prompt = "The three primary colors are"
    greedy = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0].token_ids
    for sp in (SamplingParams(temperature=1.5, top_k=1, seed=3, max_tokens=12, ignore_eos=True),
               SamplingParams(temperature=1.5, top_p=1e-6, seed=3, max_tokens=12, ignore_eos=True)):
        assert llm.generate(prompt, sp, use_tqdm=False)[0].outputs[0].token_ids == greedy


def _requests(n, **kw):
    return [Request(str(i), [1], SamplingParams(**kw)) for i in range(n)]


def test_sampler_draws_from_softmax_of_scaled_logits():
    """Frequencies over 20,000 draws match softmax(logits / T) within 4 standard errors."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]]).repeat(20_000, 1)
    sampler = Sampler(seed=0)
    tokens = torch.tensor(sampler(logits, _requests(20_000, temperature=0.7)))
    freq = torch.bincount(tokens, minlength=5).float() / len(tokens)
    expected = (logits[0] / 0.7).softmax(-1)
    stderr = (expected * (1 - expected) / len(tokens)).sqrt()
    assert torch.all((freq - expected).abs() < 4 * stderr + 1e-4), (freq, expected)


def test_top_k_top_p_keep_the_right_sets():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.5, 0.3, 0.15, 0.05]]))
    out = apply_top_k_top_p(logits, top_k=[2, -1], top_p=[1.0, 0.79])
    assert torch.isfinite(out[0]).tolist() == [True, True, False, False]      # top-2
    assert torch.isfinite(out[1]).tolist() == [True, True, False, False]      # 0.5 + 0.3 reaches 0.79
    out = apply_top_k_top_p(logits, top_k=[-1, -1], top_p=[0.81, 1.0])
    assert torch.isfinite(out[0]).tolist() == [True, True, True, False]
    assert torch.isfinite(out[1]).all()


def test_sampler_mixes_greedy_and_random_rows():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    reqs = _requests(3, temperature=0) + _requests(3, temperature=1.0, seed=1)
    out = Sampler(0)(logits, reqs)
    assert out[:3] == logits[:3].argmax(-1).tolist()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="device-side noise is a GPU matter")
def test_on_a_gpu_noise_is_drawn_there_and_seeds_still_repeat():
    logits = torch.randn(4, 1000, generator=torch.Generator().manual_seed(0)).cuda()
    reqs = _requests(2, temperature=1.0, seed=5) + _requests(2, temperature=1.0)
    a = Sampler(0)(logits, reqs)
    assert all(r.generator.device.type == "cuda" for r in reqs[:2])
    b = Sampler(0)(logits, _requests(2, temperature=1.0, seed=5) + _requests(2, temperature=1.0))
    assert a == b


def test_a_seeded_request_keeps_its_cpu_generator_on_a_cpu():
    reqs = _requests(1, temperature=1.0, seed=5)
    g = reqs[0].generator
    Sampler(0)(torch.randn(1, 50), reqs)
    assert reqs[0].generator is g                  # no new generator: the same random stream as before


def test_draw_from_never_picks_a_zero_weight_token_even_at_the_ends_of_u():
    """The inverse CDF: u = 0 takes the first token with weight, u just below 1 the last one; weight-0 tokens
    (first, middle and last of the row) are never drawn, and unnormalised rows draw as their normalised selves."""
    from minivllm.worker.sampler import draw_from
    weights = torch.tensor([[0.0, 0.25, 0.0, 0.5, 0.25, 0.0],
                            [0.0, 0.0, 3.0, 0.0, 1.0, 0.0]])
    lowest, highest = torch.zeros(2, dtype=torch.float64), torch.full((2,), 1 - 2 ** -53, dtype=torch.float64)
    assert draw_from(weights, lowest).tolist() == [1, 2]
    assert draw_from(weights, highest).tolist() == [4, 4]
    assert draw_from(weights, torch.tensor([0.3, 0.74], dtype=torch.float64)).tolist() == [3, 2]   # 0.25 <= u < 0.75
    assert draw_from(weights, torch.tensor([0.76, 0.76], dtype=torch.float64)).tolist() == [4, 4]
    many = draw_from(weights[1:].expand(10_000, 6), torch.rand(10_000, dtype=torch.float64,
                                                                generator=torch.Generator().manual_seed(0)))
    assert set(many.tolist()) == {2, 4}
    assert abs(float((many == 2).double().mean()) - 0.75) < 4 * (0.75 * 0.25 / 10_000) ** 0.5


def _kept_sets_are_the_definition(logits, top_k, top_p):
    """The kept set of every row is the definition's: top-k's prefix of the sorted row, then the smallest prefix of
    that (renormalised) reaching top_p; rows asking for neither keep everything, their logits untouched."""
    from minivllm.worker.sampler import apply_top_k_top_p
    out = apply_top_k_top_p(logits, top_k, top_p)
    vocab = logits.shape[1]
    for row, k, p, filtered in zip(logits, top_k, top_p, out):
        kept = torch.isfinite(filtered)
        if k <= 0 and p >= 1:
            assert torch.equal(filtered, row)
            continue
        order = row.argsort(descending=True)
        n = int(kept.sum())
        assert bool(kept[order[:n]].all()), "the kept set is a prefix of the sorted row"
        assert torch.equal(filtered[kept], row[kept])
        k_set = row[order[:k if 0 < k < vocab else vocab]].double().softmax(-1)
        if p < 1:
            assert float(k_set[:n].sum()) >= p - 1e-5 and (n == 1 or float(k_set[:n - 1].sum()) < p + 1e-5)
        else:
            assert n == min(k if k > 0 else vocab, vocab)
    return out


def test_top_k_top_p_partial_sort_keeps_the_defined_sets_on_peaked_and_flat_rows():
    """Peaked rows (an LLM's) are decided among the TOP_CANDIDATES most likely tokens; flat rows, whose nucleus is
    longer than that, are decided again on the full sort (the fired fallback shows in their kept count)."""
    from minivllm.worker import sampler
    g = torch.Generator().manual_seed(0)
    vocab = 8192
    peaked = -1.5 * torch.rand(6, vocab, generator=g).log().neg().log()        # Gumbel(0, 1.5): an LLM-like tail
    flat = 0.1 * torch.randn(4, vocab, generator=g)
    logits = torch.cat([peaked, flat])
    top_k = [-1, 40, -1, 3000, -1, -1, -1, -1, 200, -1]
    top_p = [0.9, 0.95, 0.5, 1.0, 1.0, 0.3, 0.9, 0.5, 0.9, 1.0]
    out = _kept_sets_are_the_definition(logits, top_k, top_p)
    kept = torch.isfinite(out).sum(-1)
    assert int(kept[6]) > sampler.TOP_CANDIDATES and int(kept[7]) > sampler.TOP_CANDIDATES   # the fallback fired
    assert int(kept[3]) == 3000                                  # a top_k above the candidates widens them
    full = sampler.TOP_CANDIDATES
    try:
        sampler.TOP_CANDIDATES = vocab                           # every row fully sorted: the same result
        assert torch.equal(sampler.apply_top_k_top_p(logits, top_k, top_p), out)
    finally:
        sampler.TOP_CANDIDATES = full


def test_top_p_one_keeps_every_token_in_a_batch_that_filters():
    """A row with top_p=1 beside a row that filters keeps its whole row: the fp32 running sum reaches 1.0 before
    the end of a 49,152-token row, and a plain `mass_before >= p` would drop the tail."""
    logits = torch.randn(2, 49152, generator=torch.Generator().manual_seed(1)) * 3
    _kept_sets_are_the_definition(logits, [-1, -1], [1.0, 0.9])


def test_greedy_and_logits_processing_are_derived_when_params_are_built_and_again_by_replace():
    import dataclasses
    sp = SamplingParams(temperature=0.7)
    assert not sp.greedy and not sp.uses_logits_processing
    changed = dataclasses.replace(sp, temperature=0, repetition_penalty=1.2)
    assert changed.greedy and changed.uses_logits_processing
    assert not sp.greedy and not sp.uses_logits_processing          # the original is untouched
    assert SamplingParams(temperature=1e-6).greedy                  # below 1e-5 is greedy (vLLM's rule)
    assert SamplingParams(logit_bias={3: 1.0}).uses_logits_processing
    assert SamplingParams(min_tokens=2).uses_logits_processing
    assert "greedy" not in {f.name for f in dataclasses.fields(SamplingParams)}   # derived, not a field to pass
