"""A long prefill's MLP runs in row slices on a CPU where SiLU is a separate pass (platforms/cpu/gemm.py,
`cpu_slice_rows`): the same result as the whole batch at once, proven on the default model's weights and end to
end against Hugging Face."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from minivllm.model import llama
from minivllm.platforms.cpu import gemm as cpu_gemm

from oracle import hf_greedy


def test_slice_rows_keep_the_activation_within_the_budget():
    x = torch.empty(5000, 576)
    assert cpu_gemm.cpu_slice_rows(x, 3072) == 1024                    # 1,024 x 3,072 x 4 bytes = 12 MiB
    assert cpu_gemm.cpu_slice_rows(x.bfloat16(), 3072) == 2048         # half the bytes a row, twice the rows
    assert cpu_gemm.cpu_slice_rows(x, 6144) == 512
    assert cpu_gemm.cpu_slice_rows(x, 10 ** 6) == 256                  # never fewer than 256 rows
    assert cpu_gemm.cpu_slice_rows(torch.empty(5000, 576, device="meta"), 3072) == 5000   # off the CPU: whole


def _plain_mlp(mlp, monkeypatch):
    """A copy of `mlp` with its weights packed plainly (MINIVLLM_CPU_FUSED_SILU=0): SiLU as a separate pass, so
    its forward slices rows; where SiLU runs in the matmul (the CPU default with AVX-512) the MLP is whole."""
    from minivllm.model.layers import TPGroup
    from minivllm.platforms.cpu.loading import process_weights_after_loading
    cfg = SimpleNamespace(hidden_size=mlp.gate_up_proj.weight.shape[1], intermediate_size=mlp.gate_up_proj.out_sizes[0])
    plain = llama.LlamaMLP(cfg, TPGroup())
    plain.gate_up_proj.weight.data = mlp.gate_up_proj.weight.data.clone()
    plain.down_proj.weight.data = mlp.down_proj.weight.data.clone()
    monkeypatch.setenv("MINIVLLM_CPU_FUSED_SILU", "0")
    process_weights_after_loading(plain, plain.gate_up_proj.weight.dtype)
    assert not plain.gate_up_proj.packed_silu_and_mul
    return plain


def test_a_sliced_mlp_equals_the_whole_batch(llm, monkeypatch):
    """The default model's layer 0 MLP on 2,500 rows: three slices (1,024 + 1,024 + 452), the same numbers as one
    call over all rows (each output row depends on its input row only; the matmuls sum over the same K). The
    model's own MLP, SiLU in its gate/up matmul, runs the rows whole and agrees."""
    mlp = llm.llm_engine.executor.driver.model.layers[0].mlp
    x = torch.randn(2500, mlp.gate_up_proj.weight.shape[1]) * 0.5
    plain = _plain_mlp(mlp, monkeypatch)
    calls = []
    real = llama.LlamaMLP.forward.__get__(plain)                  # the modeling file's forward, whole
    monkeypatch.setattr(llama.LlamaMLP, "forward", lambda self, part: calls.append(part.shape[0]) or real(part))
    sliced = plain(x)
    assert calls == [1024, 1024, 452]
    torch.testing.assert_close(sliced, real(x), rtol=1e-6, atol=1e-6)
    if mlp.gate_up_proj.packed_silu_and_mul:
        whole = []
        real_model = mlp.forward
        monkeypatch.setattr(mlp, "forward", lambda part: whole.append(part.shape[0]) or real_model(part))
        torch.testing.assert_close(mlp(x), sliced, rtol=1e-5, atol=1e-5)
        assert whole == [2500]


@pytest.mark.slow
def test_a_prefill_in_slices_gives_hfs_greedy_tokens(model_dir, hf_model, tokenizer, monkeypatch):
    """One 1,300-token prompt prefilled in one step (two MLP slices in every layer, SiLU as a separate pass), then
    decoded: HF's tokens."""
    from minivllm import LLM, SamplingParams
    monkeypatch.setenv("MINIVLLM_CPU_FUSED_SILU", "0")
    llm = LLM(str(model_dir), dtype="float32", device="cpu", num_kv_blocks=256,
              long_prefill_token_threshold=0)          # the whole prompt in one step (a CPU caps it at 96)
    text = " ".join(f"Item {i} of the list is the number {i * 7 % 97}." for i in range(120))
    ids = tokenizer.encode(text, add_special_tokens=False)[:1300]
    assert len(ids) == 1300
    slices = []
    real = llama.LlamaMLP.forward
    monkeypatch.setattr(llama.LlamaMLP, "forward", lambda self, part: slices.append(part.shape[0]) or real(self, part))
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert slices[:2] == [1024, 276]                    # the prefill's first layer, in two slices
    assert list(out[0].outputs[0].token_ids) == hf_greedy(hf_model, ids, 8)
