"""Greedy minivllm equals greedy Hugging Face transformers, token for token (fp32, CPU)."""

from __future__ import annotations

import pytest

from minivllm import SamplingParams
from tests.oracle import PROMPTS, hf_greedy

NUM_TOKENS = 32


@pytest.fixture(scope="module")
def hf_reference(hf_model, tokenizer):
    ids = [tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
    return ids, [hf_greedy(hf_model, p, NUM_TOKENS) for p in ids]


def greedy(n=NUM_TOKENS):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def test_batched_greedy_matches_hf_token_for_token(llm, hf_reference):
    prompt_ids, expected = hf_reference
    outs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids], greedy(), use_tqdm=False)
    for i, (out, exp) in enumerate(zip(outs, expected)):
        assert out.outputs[0].token_ids == exp, f"prompt {i} diverges from HF"
        assert out.outputs[0].finish_reason == "length"


@pytest.mark.slow
def test_each_prompt_alone_equals_the_batch(llm, hf_reference):
    prompt_ids, expected = hf_reference
    llm.llm_engine.kv_cache_manager.reset_prefix_cache()
    for p, exp in zip(prompt_ids, expected):
        out = llm.generate({"prompt_token_ids": p}, greedy(), use_tqdm=False)[0]
        assert out.outputs[0].token_ids == exp


def test_string_prompts_are_tokenized_like_hf(llm, tokenizer):
    out = llm.generate(PROMPTS[0], greedy(4), use_tqdm=False)[0]
    assert out.prompt_token_ids == tokenizer.encode(PROMPTS[0], add_special_tokens=False)
    assert out.prompt == PROMPTS[0]


@pytest.mark.slow
def test_chat_answers_paris(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"          # ended on <|im_end|>, not on length
    assert out.outputs[0].token_ids[-1] == 2
    assert "<|im_end|>" not in out.outputs[0].text


@pytest.mark.slow
def test_outputs_come_back_in_input_order_with_metrics(llm):
    prompts = ["One", "Two two two two two two two two two two two two", "Three three"]
    outs = llm.generate(prompts, [greedy(3), greedy(9), greedy(5)], use_tqdm=False)
    assert [o.prompt for o in outs] == prompts
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 9, 5]
    for o in outs:
        m = o.metrics
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
