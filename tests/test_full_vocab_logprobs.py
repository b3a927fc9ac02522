"""The engine's max_logprobs (vLLM's ModelConfig.max_logprobs, `--max-logprobs`): a request may ask for at most that
many logprobs per token, and with -1 (no limit) `logprobs=-1` / `prompt_logprobs=-1` return the whole vocabulary at
each position: Hugging Face's own log_softmax of its logits, every token of it (fp32, CPU, to 1e-4). Over the limit,
the input processor refuses the request, naming the value, the limit and the fix."""

from __future__ import annotations

import pytest
import torch

from minivllm import LLM, BeamSearchParams, SamplingParams
from minivllm.config import EngineConfig

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def unlimited(model_dir):
    """An engine started as `--max-logprobs -1`."""
    return LLM(str(model_dir), dtype="float32", device="cpu", num_kv_blocks=64, max_logprobs=-1)


def as_vector(entry: dict, vocab: int) -> torch.Tensor:
    """A {token id: Logprob} of the whole vocabulary as a (vocab,) tensor of logprobs."""
    assert sorted(entry) == list(range(vocab))
    out = torch.empty(vocab)
    out[list(entry)] = torch.tensor([lp.logprob for lp in entry.values()])
    return out


@pytest.mark.slow
def test_minus_one_returns_the_whole_vocabularys_log_softmax_as_hf_computes_it(unlimited, hf_model):
    out = unlimited.generate(PROMPT, SamplingParams(temperature=0, max_tokens=2, logprobs=-1, prompt_logprobs=-1),
                             use_tqdm=False)[0]
    ids, c = out.prompt_token_ids, out.outputs[0]
    vocab = hf_model.config.vocab_size
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids + c.token_ids])).logits[0].float().log_softmax(dim=-1)   # (tokens, vocab)
    assert len(c.logprobs) == len(c.token_ids) == 2
    for step, (token, entry) in enumerate(zip(c.token_ids, c.logprobs)):
        row = ref[len(ids) - 1 + step]
        assert len(entry) == vocab and list(entry)[0] == token            # the sampled token first, then all
        torch.testing.assert_close(as_vector(entry, vocab), row, atol=1e-4, rtol=0)
        assert sorted(lp.rank for lp in entry.values()) == list(range(1, vocab + 1))     # every rank, once
        top = row.topk(3).indices.tolist()
        assert [entry[t].rank for t in top] == [1, 2, 3]
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    for i in range(1, len(ids)):
        torch.testing.assert_close(as_vector(out.prompt_logprobs[i], vocab), ref[i - 1], atol=1e-4, rtol=0)
    # a request asking for a few, in the same engine, still gets a few
    few = unlimited.generate(PROMPT, SamplingParams(temperature=0, max_tokens=2, logprobs=3), use_tqdm=False)[0]
    assert all(len(e) <= 4 for e in few.outputs[0].logprobs) and few.outputs[0].token_ids == c.token_ids


def test_a_request_over_max_logprobs_is_refused_naming_the_value_the_limit_and_the_fix(llm):
    assert llm.llm_engine.config.max_logprobs == 20                        # vLLM's default
    for params, says in [(dict(logprobs=-1), "logprobs is -1, which asks for every token of the vocabulary (49152)"),
                         (dict(logprobs=21), "logprobs is 21"), (dict(prompt_logprobs=-1), "prompt_logprobs is -1"),
                         (dict(prompt_logprobs=50), "prompt_logprobs is 50")]:
        with pytest.raises(ValueError, match=r"at most 20 logprobs per token \(max_logprobs=20\)") as e:
            llm.generate(PROMPT, SamplingParams(max_tokens=1, **params), use_tqdm=False)
        assert says in str(e.value) and "--max-logprobs" in str(e.value) and "LLM(max_logprobs=" in str(e.value)
    assert not llm.llm_engine.has_unfinished_requests()
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=1, logprobs=20, prompt_logprobs=20),
                       use_tqdm=False)[0]
    assert len(out.outputs[0].logprobs[0]) in (20, 21)                     # the limit itself is allowed


@pytest.mark.slow        # builds the unlimited engine when run alone
def test_no_limit_still_stops_at_the_vocabulary_and_bad_values_are_refused(unlimited):
    with pytest.raises(ValueError, match="logprobs is 49153; the vocabulary has 49152 tokens"):
        unlimited.generate(PROMPT, SamplingParams(max_tokens=1, logprobs=49153), use_tqdm=False)
    with pytest.raises(ValueError, match="logprobs is -2; it must be >= 0"):
        SamplingParams(logprobs=-2)
    with pytest.raises(ValueError, match="max_logprobs is -2; it must be an int >= 0, or -1"):
        EngineConfig(max_logprobs=-2).validate()


@pytest.mark.slow        # builds the unlimited engine when run alone
def test_beam_search_keeps_its_width_cap_and_an_engine_allowing_fewer_refuses_wider_beams(unlimited, monkeypatch):
    with pytest.raises(ValueError, match=r"beam_width is 11; it must be in \[1, 10\]"):
        BeamSearchParams(beam_width=11, max_tokens=1)                      # 10 even with no limit (vLLM's default)
    monkeypatch.setattr(unlimited.llm_engine.input_processor, "max_logprobs", 4)     # as --max-logprobs 4
    with pytest.raises(ValueError, match="beam_width is 3; each step asks for the 2 .* = 6 most likely tokens, and "
                                         "this engine's max_logprobs is 4. Lower beam_width to at most 2"):
        unlimited.beam_search([PROMPT], BeamSearchParams(beam_width=3, max_tokens=1))
    out = unlimited.beam_search([PROMPT], BeamSearchParams(beam_width=2, max_tokens=1))
    assert len(out[0].sequences) == 2
