"""Logprobs (`SamplingParams(logprobs=k)`): each output token's log-probability and rank, and the k most likely
tokens, against Hugging Face's own `log_softmax` of its logits along the same tokens (fp32, CPU, to 1e-4)."""

from __future__ import annotations

import pytest
import torch

from minivllm import SamplingParams
from minivllm.core.sampling_params import RequestOutputKind

PROMPT = "The capital of France is"


def hf_logprobs(hf_model, prompt_ids: list[int], output_ids: list[int]) -> torch.Tensor:
    """(len(output_ids), vocab): HF's log-softmax at each position that predicted an output token."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt_ids + output_ids])).logits[0].float()
    return logits[len(prompt_ids) - 1:len(prompt_ids) + len(output_ids) - 1].log_softmax(dim=-1)


@pytest.mark.slow
@pytest.mark.parametrize("params", [dict(temperature=0), dict(temperature=1.0, top_k=20, seed=3, repetition_penalty=1.2)],
                         ids=["greedy", "sampled_with_penalty"])
def test_logprobs_are_hfs_log_softmax_before_any_sampling_transformation(llm, hf_model, params):
    k = 5
    out = llm.generate(PROMPT, SamplingParams(max_tokens=8, logprobs=k, **params), use_tqdm=False)[0]
    c = out.outputs[0]
    ref = hf_logprobs(hf_model, out.prompt_token_ids, c.token_ids)
    assert len(c.logprobs) == len(c.token_ids) == 8
    total = 0.0
    for step, (token, entry) in enumerate(zip(c.token_ids, c.logprobs)):
        row = ref[step]
        top_lp, top_ids = row.topk(k)
        assert list(entry)[0] == token                                     # the sampled token comes first
        assert entry[token].logprob == pytest.approx(row[token].item(), abs=1e-4)
        assert entry[token].rank == int((row > row[token]).sum()) + 1
        for rank, (tid, lp) in enumerate(zip(top_ids.tolist(), top_lp.tolist()), start=1):
            assert entry[tid].logprob == pytest.approx(lp, abs=1e-4) and entry[tid].rank == rank
        assert set(entry) == set(top_ids.tolist()) | {token}
        total += row[token].item()
    assert c.cumulative_logprob == pytest.approx(total, abs=1e-3)
    if params["temperature"] == 0:
        assert all(entry[t].rank == 1 for t, entry in zip(c.token_ids, c.logprobs))


def test_logprobs_zero_gives_the_sampled_token_only_and_none_costs_nothing(llm, tokenizer):
    c = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=3, logprobs=0), use_tqdm=False)[0].outputs[0]
    assert [list(e) for e in c.logprobs] == [[t] for t in c.token_ids]
    assert c.logprobs[0][c.token_ids[0]].decoded_token == tokenizer.decode([c.token_ids[0]])
    plain = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0].outputs[0]
    assert plain.logprobs is None and plain.cumulative_logprob is None and plain.token_ids == c.token_ids


def test_delta_outputs_carry_each_tokens_logprobs_once(llm):
    engine = llm.llm_engine
    engine.add_request(PROMPT, SamplingParams(temperature=0, max_tokens=6, logprobs=2,
                                              output_kind=RequestOutputKind.DELTA))
    pieces = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            pieces += out.outputs[0].logprobs
    final = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=6, logprobs=2),
                         use_tqdm=False)[0].outputs[0]
    assert pieces == final.logprobs


def test_logprobs_are_checked():
    for bad in (-2, 1.5, True):
        with pytest.raises(ValueError, match="logprobs is"):
            SamplingParams(logprobs=bad)
    # -1 (the whole vocabulary) and any k are a request's to make: the engine's max_logprobs bounds them
    # (test_full_vocab_logprobs.py)
    assert SamplingParams(logprobs=-1, prompt_logprobs=21).logprobs == -1
