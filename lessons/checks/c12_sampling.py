"""Lesson 12's checks: `top_p_filter` on hand-made rows with known answers, against Hugging Face transformers'
TopPLogitsWarper (an independent implementation) on random batches, and inside the real engine: its sampler
runs with your filter, and the sampled tokens must be the ones it draws with its own."""

import random

import torch

from course import ExerciseFailed, expect_equal

_ENGINE = {}          # one engine for every run of this check (loading the model takes a second or two)


def _kept(fn, logits, top_p, what):
    """The kept token ids of each row of fn(logits, top_p), after checking shape and values."""
    out = fn(logits.clone(), list(top_p))
    if not isinstance(out, torch.Tensor) or out.shape != logits.shape:
        raise ExerciseFailed(f"{what}: expected a tensor of shape {tuple(logits.shape)}, got "
                             f"{getattr(out, 'shape', type(out).__name__)}")
    finite = torch.isfinite(out)
    if not torch.equal(out[finite], logits[finite]):
        for r in range(logits.shape[0]):
            row = out[r][finite[r]]
            if torch.equal(row, logits[r][finite[r]]):
                continue
            if torch.equal(row, logits[r].sort(descending=True).values[:row.numel()]):
                raise ExerciseFailed(f"{what}: row {r} is not in the original (vocabulary) order but sorted, most "
                                     f"likely first: did you scatter the filtered logits back (scatter with the "
                                     f"indices the sort gave)?")
            raise ExerciseFailed(f"{what}: row {r}: a kept token's logit changed; top-p only drops tokens (sets "
                                 f"them to -inf) and leaves the others as they were")
    if not torch.all(out[~finite] == float("-inf")):
        raise ExerciseFailed(f"{what}: a dropped token must be -inf (NaN or +inf found)")
    return [sorted(torch.nonzero(row).flatten().tolist()) for row in finite]


def _rows(probs):
    """Logits whose softmax is exactly the given probabilities (rows of positive numbers summing to 1)."""
    return torch.tensor(probs, dtype=torch.float64).log()


def _hf_kept(logits, top_p):
    from transformers import TopPLogitsWarper
    rows = []
    for row, p in zip(logits, top_p):
        if p >= 1.0:
            rows.append(list(range(logits.shape[1])))
            continue
        out = TopPLogitsWarper(top_p=p)(None, row[None].clone())[0]
        rows.append(sorted(torch.nonzero(torch.isfinite(out)).flatten().tolist()))
    return rows


PROMPTS = ["Once upon a time", "The three best things about the sea are", "A recipe for pancakes:"]
TOP_P = [0.5, 0.9, 0.97]


def _params():
    from minivllm import SamplingParams
    return [SamplingParams(temperature=1.0, top_p=p, max_tokens=12, seed=7 + i, ignore_eos=True)
            for i, p in enumerate(TOP_P)]


def _engine():
    """The engine, and the tokens it samples for PROMPTS with its own filter (seeded: the same every run)."""
    if not _ENGINE:
        from minivllm import LLM
        llm = LLM(device="cpu", dtype="float32", num_kv_blocks=64, seed=0)
        _ENGINE.update(llm=llm, expected=_sample(llm, PROMPTS, _params()))
    return _ENGINE


def _sample(llm, prompts, params):
    return [out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)]


def check_top_p_filter(fn):
    probs = [[0.5, 0.2, 0.15, 0.1, 0.05]]
    expect_equal(_kept(fn, _rows(probs), [1.0], "top_p=1.0"), [[0, 1, 2, 3, 4]],
                 "top_p=1.0 on probabilities [0.5, 0.2, 0.15, 0.1, 0.05]: the kept tokens")
    expect_equal(_kept(fn, _rows(probs), [1e-6], "top_p=1e-6"), [[0]],
                 "top_p=1e-6 on probabilities [0.5, 0.2, 0.15, 0.1, 0.05]: the kept tokens (the most likely "
                 "token always stays)")
    expect_equal(_kept(fn, _rows(probs), [0.6], "top_p=0.6"), [[0, 1]],
                 "top_p=0.6 on probabilities [0.5, 0.2, 0.15, 0.1, 0.05]: the kept tokens (0.5 < 0.6, so the "
                 "0.2 token, which crosses 0.6, stays too)")
    shuffled = [[0.1, 0.05, 0.5, 0.15, 0.2]]
    expect_equal(_kept(fn, _rows(shuffled), [0.8], "top_p=0.8, shuffled"), [[2, 3, 4]],
                 "top_p=0.8 on probabilities [0.1, 0.05, 0.5, 0.15, 0.2] (not sorted): the kept token ids")
    yield "keeps the smallest set of the most likely tokens that reaches top_p, in vocabulary order"
    batch = [[0.5, 0.2, 0.15, 0.1, 0.05], [0.05, 0.1, 0.15, 0.2, 0.5], [0.3, 0.3, 0.2, 0.1, 0.1]]
    expect_equal(_kept(fn, _rows(batch), [0.3, 0.9, 1.0], "a batch"), [[0], [1, 2, 3, 4], [0, 1, 2, 3, 4]],
                 "a batch of 3 rows with top_p [0.3, 0.9, 1.0] (each row its own top_p): the kept tokens")
    yield "each row of a batch uses its own top_p"
    rng = random.Random(0)
    gen = torch.Generator().manual_seed(0)
    for i in range(30):
        rows, vocab = rng.randrange(1, 5), rng.choice([7, 50, 1000])
        logits = torch.randn(rows, vocab, generator=gen, dtype=torch.float64) * rng.choice([0.5, 2.0, 5.0])
        top_p = [rng.choice([0.05, 0.3, 0.5, 0.8, 0.95, 0.999]) for _ in range(rows)]
        expect_equal(_kept(fn, logits, top_p, f"random case {i}"), _hf_kept(logits, top_p),
                     f"random case {i} ({rows} rows x {vocab} tokens, top_p {top_p}): the kept tokens, as Hugging "
                     f"Face's TopPLogitsWarper keeps them")
    yield "30 random batches keep what Hugging Face's TopPLogitsWarper keeps"

    import minivllm.worker.sampler as sampler
    e = _engine()
    llm, prompts, params, expected = e["llm"], PROMPTS, _params(), e["expected"]
    real = sampler.apply_top_k_top_p
    calls = []

    def yours(logits, top_k, top_p):                     # top-k by the engine's own function, then your top-p
        calls.append(len(top_p))
        rows = logits.shape[0]
        return fn(real(logits, top_k, [1.0] * rows), list(top_p))

    sampler.apply_top_k_top_p = yours
    try:
        actual = _sample(llm, prompts, params)
    except ExerciseFailed:
        raise
    except Exception as exc:
        _ENGINE.clear()                                       # a step failed midway: the next run builds anew
        raise ExerciseFailed(f"inside the engine, a step failed with your filter: {type(exc).__name__}: "
                             f"{exc}") from None
    finally:
        sampler.apply_top_k_top_p = real
    if not calls:
        raise ExerciseFailed("the engine never called the top-p filter (a bug of the check, not yours)")
    for prompt, p, a, want in zip(prompts, TOP_P, actual, expected):
        expect_equal(a, want, f"the engine sampling {prompt!r} at temperature 1, top_p {p}, seed fixed: its tokens "
                           f"with your filter")
    yield f"inside the engine: {sum(calls)} rows filtered over {len(calls)} steps, the same sampled tokens"
