"""Shared fixtures. The default model is loaded once per test session (about a second from the cache).
The shared prompts and the HF greedy oracle live in tests/oracle.py, which test files import."""

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
