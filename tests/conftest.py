"""Shared fixtures. The default model is loaded once per test session (about a second from the cache)."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
if not torch.cuda.is_available():
    # Without a GPU the Triton kernels run on Triton's CPU interpreter; @triton.jit reads this when it
    # decorates, so it must be set before anything imports triton (notebook kernels inherit it too).
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Six prompts of different lengths and styles, shared by the parity and invariance tests.
PROMPTS = [
    "The capital of France is",
    "Hello, my name is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "In 1969, the first humans to walk on the Moon were",
    "A list of prime numbers: 2, 3, 5, 7,",
    "Once upon a time, in a kingdom far away, there lived a young princess who loved to read books about "
    "dragons, wizards and distant lands. Every evening she",
]


@pytest.fixture(scope="session")
def model_dir():
    from minivllm.model.default_model import default_model_dir
    return default_model_dir()


@pytest.fixture(scope="session")
def llm(model_dir):
    from minivllm import LLM
    return LLM(str(model_dir), dtype="float32", device="cpu", num_kv_blocks=512)


@pytest.fixture(scope="session")
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def tokenizer(llm):
    return llm.get_tokenizer()


def hf_greedy(hf_model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Hugging Face transformers' greedy continuation, EOS included: the independent oracle.

    A plain argmax loop over HF's forward with its own KV cache (generate's min_new_tokens would
    mask EOS, which is not greedy)."""
    tokens: list[int] = []
    with torch.no_grad():
        out = hf_model(torch.tensor([prompt_ids]), use_cache=True)
        for _ in range(max_new_tokens):
            tok = int(out.logits[0, -1].argmax())
            tokens.append(tok)
            out = hf_model(torch.tensor([[tok]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens
