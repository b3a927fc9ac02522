"""A long prefill's MLP runs in row slices on a CPU (model/llama.py, `cpu_slice_rows`): the same result as the whole
batch at once, proven on the default model's weights and end to end against Hugging Face."""

from __future__ import annotations

import pytest
import torch

from minivllm.model import llama

from oracle import hf_greedy


def test_slice_rows_keep_the_activation_within_the_budget():
    x = torch.empty(5000, 576)
    assert llama.cpu_slice_rows(x, 3072) == 1024                    # 1,024 x 3,072 x 4 bytes = 12 MiB
    assert llama.cpu_slice_rows(x.bfloat16(), 3072) == 2048         # half the bytes a row, twice the rows
    assert llama.cpu_slice_rows(x, 6144) == 512
    assert llama.cpu_slice_rows(x, 10 ** 6) == 256                  # never fewer than 256 rows
    assert llama.cpu_slice_rows(torch.empty(5000, 576, device="meta"), 3072) == 5000   # off the CPU: whole


def test_a_sliced_mlp_equals_the_whole_batch(llm, monkeypatch):
    """The default model's layer 0 MLP on 2,500 rows: three slices (1,024 + 1,024 + 452), the same numbers as one
    call over all rows (each output row depends on its input row only; the matmuls sum over the same K)."""
    mlp = llm.llm_engine.executor.driver.model.layers[0].mlp
    x = torch.randn(2500, mlp.gate_up_proj.weight.shape[1]) * 0.5
    calls = []
    real = mlp._forward
    monkeypatch.setattr(mlp, "_forward", lambda part: calls.append(part.shape[0]) or real(part))
    sliced = mlp(x)
    assert calls == [1024, 1024, 452]
    torch.testing.assert_close(sliced, real(x), rtol=1e-6, atol=1e-6)


@pytest.mark.slow
def test_a_prefill_in_slices_gives_hfs_greedy_tokens(llm, hf_model, tokenizer, monkeypatch):
    """One 1,300-token prompt prefilled in one step (two MLP slices in every layer), then decoded: HF's tokens."""
    from minivllm import SamplingParams
    text = " ".join(f"Item {i} of the list is the number {i * 7 % 97}." for i in range(120))
    ids = tokenizer.encode(text, add_special_tokens=False)[:1300]
    assert len(ids) == 1300
    slices = []
    real = llama.LlamaMLP._forward
    monkeypatch.setattr(llama.LlamaMLP, "_forward", lambda self, part: slices.append(part.shape[0]) or real(self, part))
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert slices[:2] == [1024, 276]                    # the prefill's first layer, in two slices
    assert list(out[0].outputs[0].token_ids) == hf_greedy(hf_model, ids, 8)
