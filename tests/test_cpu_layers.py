"""The fused C++ layers (kernels/cpu_layers.cpp) against their PyTorch code in layers.py, and proof that the
model runs them on a CPU. Greedy parity with Hugging Face through them is tests/test_parity.py's (they are the
CPU default) and tests/test_cpu_attention.py's."""

from __future__ import annotations

import pytest
import torch

from minivllm.model import layers
from minivllm.model._kernels import kernels
from minivllm.model.custom_op import CustomOp
from minivllm.platforms.cpu import gemm as cpu_gemm

cpu_ops = kernels.cpu_ops
pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="no C++ compiler: the CPU kernels are not built")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _ulps(dtype):
    """fp32: sums in another order (about 1e-6); bf16/fp16: at most one rounding of the output apart."""
    return dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=torch.finfo(dtype).eps * 4,
                                                                          rtol=torch.finfo(dtype).eps * 2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_rms_norm_with_and_without_residual_equals_forward_native(dtype, rows):
    torch.manual_seed(rows)
    norm = layers.RMSNorm(576, 1e-5)
    norm.weight.data = torch.randn(576).to(dtype)
    x, residual = torch.randn(rows, 576).to(dtype), torch.randn(rows, 576).to(dtype)
    torch.testing.assert_close(cpu_ops.rms_norm(x, norm.weight, 1e-5), norm.forward_native(x), **_ulps(dtype))
    got, got_sum = cpu_ops.rms_norm(x, norm.weight, 1e-5, residual)
    want, want_sum = norm.forward_native(x, residual)
    assert torch.equal(got_sum, want_sum)                 # x + residual, in the model's dtype, exactly
    torch.testing.assert_close(got, want, **_ulps(dtype))


def test_bf16_rounding_is_pytorchs_on_every_bf16_value():
    """kernels/cpu_dtype.h rounds fp32 to bf16 with integer arithmetic (so loops vectorise), not c10's
    conversion. The residual add rounds x + residual once, so it shows that rounding bit for bit: every one of
    the 65,536 bf16 values (inf, NaN, subnormals included) plus residuals that make exact ties (round to even,
    both ways), overflow to inf and inf - inf."""
    every = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    residuals = torch.tensor([0.0, 2.0 ** -8, 3 * 2.0 ** -8, -(2.0 ** -9), 1e-40, 3.0e38, float("-inf"), 1.0],
                             dtype=torch.bfloat16)
    x = every.repeat(len(residuals)).view(len(residuals), -1).contiguous()       # rows: one residual each
    residual = residuals[:, None].expand_as(x).contiguous()
    _, got = cpu_ops.rms_norm(x, torch.ones(x.shape[1], dtype=torch.bfloat16), 1e-5, residual)
    want = (x.float() + residual.float()).to(torch.bfloat16)
    assert torch.equal(got.isnan(), want.isnan())
    assert want.isnan().any() and want.isinf().any() and (want.float().abs() < 1.2e-38).any()
    finite = ~want.isnan()
    assert torch.equal(got[finite].view(torch.int16), want[finite].view(torch.int16))   # bits, so -0 != +0
    rounded = (x.float() + residual.float()) != want.float()
    assert rounded.sum() > 10_000                              # the sums needed rounding, many times over


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 33])
def test_silu_and_mul_equals_forward_native(dtype, rows):
    x = (torch.randn(rows, 2 * 1536) * 4).to(dtype)
    torch.testing.assert_close(cpu_ops.silu_and_mul(x), layers.SiluAndMul.forward_native(x), **_ulps(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_rotary_on_strided_views_of_qkv_equals_forward_native(dtype, head_dim):
    """q and k are views into the fused qkv output (rows strided by the qkv width), as the model passes them."""
    rotary = layers.RotaryEmbedding(head_dim, 4096, 10000.0)
    tokens = 19
    qkv = torch.randn(tokens, (8 + 2 * 2) * head_dim).to(dtype)
    q, k, _ = qkv.split([8 * head_dim, 2 * head_dim, 2 * head_dim], dim=-1)
    q, k = q.view(tokens, 8, head_dim), k.view(tokens, 2, head_dim)
    positions = torch.randint(0, 4096, (tokens,))
    got_q, got_k = cpu_ops.rotary_embedding(positions, q, k, rotary.cos, rotary.sin)
    want_q, want_k = rotary.forward_native(positions, q, k)
    torch.testing.assert_close(got_q, want_q, **_ulps(dtype))
    torch.testing.assert_close(got_k, want_k, **_ulps(dtype))


@pytest.mark.slow
def test_the_model_runs_the_fused_layers_on_a_cpu(llm, monkeypatch):
    """Every RMSNorm, rotary and activation of a forward pass goes through the C++ ops (counted; the activation
    inside the gate/up matmul where the model's weights are packed for it), and turning them off
    (MINIVLLM_CPU_KERNELS=0 does it for a process) gives the same greedy tokens."""
    from minivllm import SamplingParams

    counts = {"rms_norm": 0, "silu_and_mul": 0, "rotary_embedding": 0, "packed_linear": 0}
    for name in counts:
        real = getattr(cpu_ops, name)
        monkeypatch.setattr(cpu_ops, name, lambda *a, _real=real, _name=name, **kw:
                            counts.__setitem__(_name, counts[_name] + (_name != "packed_linear" or
                                                                       kw.get("silu_and_mul", False)))
                            or _real(*a, **kw))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    fused = llm.generate(["The capital of France is"], params)[0].outputs[0].token_ids
    layers_n = llm.llm_engine.model_config.num_hidden_layers
    steps = 6
    gate_up = llm.llm_engine.model_runner.model.layers[0].mlp.gate_up_proj
    in_matmul = gate_up.packed_silu_and_mul
    assert in_matmul == cpu_gemm.own_gemm(gate_up.weight.dtype)          # packed so wherever the kernel runs
    assert counts == {"rms_norm": steps * (2 * layers_n + 1), "rotary_embedding": steps * layers_n,
                      "silu_and_mul": 0 if in_matmul else steps * layers_n,
                      "packed_linear": steps * layers_n if in_matmul else 0}
    model = llm.llm_engine.model_runner.model
    for op in model.modules():                  # every op on its PyTorch code, each MLP on the modeling file's
        if isinstance(op, CustomOp):
            monkeypatch.setattr(op, "forward", op.forward_native)
    for mlp in cpu_gemm.gated_mlps(model):
        monkeypatch.setattr(mlp, "forward", type(mlp).forward.__get__(mlp))
    native = llm.generate(["The capital of France is"], params)[0].outputs[0].token_ids
    assert list(fused) == list(native)
    assert counts["rms_norm"] == steps * (2 * layers_n + 1)     # the second run did not call them
    assert counts["silu_and_mul"] == (0 if in_matmul else steps * layers_n)


def test_silu_and_mul_matches_hf_activation():
    """An independent oracle: transformers' own SiLU (ACT2FN['silu']) times up."""
    from transformers.activations import ACT2FN
    x = torch.randn(5, 64)
    torch.testing.assert_close(cpu_ops.silu_and_mul(x), ACT2FN["silu"](x[:, :32]) * x[:, 32:], atol=1e-6, rtol=1e-5)
