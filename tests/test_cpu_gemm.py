"""Prepacked CPU matmuls (platforms/cpu/gemm.py): oneDNN's, and minivllm's own kernel (kernels/cpu_gemm.cpp) on a CPU
with AVX-512 (fp32) and AVX-512 BF16 (bf16); same results as F.linear and float64, and really used by the model."""

import pytest
import torch
import torch.nn.functional as F

from minivllm.platforms.cpu import gemm as cpu_gemm
from minivllm.model.layers import (ColumnParallelLinear, MergedColumnParallelLinear, ParallelLMHead,
                                   RowParallelLinear, SiluAndMul, TPGroup)

pytestmark = pytest.mark.skipif(not cpu_gemm.onednn_available(), reason="this torch build has no oneDNN")


@pytest.mark.parametrize("dtype,rtol,atol", [(torch.float32, 1e-5, 1e-5), (torch.bfloat16, 1.6e-2, 2e-2)])
@pytest.mark.parametrize("rows", [1, 7, 32, 300])
def test_packed_gemm_equals_linear(dtype, rtol, atol, rows):
    if not cpu_gemm.packable(dtype):
        pytest.skip(f"this CPU's oneDNN cannot pack {dtype} (bf16 needs AVX-512): the model keeps F.linear")
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(960, 576, generator=g).to(dtype) / 24
    b = torch.randn(960, generator=g).to(dtype)
    x = torch.randn(rows, 576, generator=g).to(dtype)
    packed = cpu_gemm.prepack(w)
    assert packed is not None and packed.is_mkldnn != cpu_gemm.own_gemm(dtype)
    assert cpu_gemm.packed_dtype(packed) == dtype
    torch.testing.assert_close(cpu_gemm.gemm(x, w, b, packed), F.linear(x, w, b), rtol=rtol, atol=atol)
    torch.testing.assert_close(cpu_gemm.gemm(x, w, None, packed), F.linear(x, w), rtol=rtol, atol=atol)


def own_gemm(dtype):
    return pytest.param(dtype, marks=pytest.mark.skipif(
        not cpu_gemm.own_gemm(dtype), reason=f"minivllm's {dtype} matmul needs AVX-512 (bf16: AVX-512 BF16)"))


# rows: one, a tile (8) and one over, more than a 512-row chunk; out: whole 48-column panels and a part panel.
@pytest.mark.parametrize("dtype", [own_gemm(torch.float32), own_gemm(torch.bfloat16)])
@pytest.mark.parametrize("rows", [1, 8, 9, 600])
@pytest.mark.parametrize("out_features,in_features", [(96, 64), (100, 576), (7, 1536)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_own_gemm_is_within_fp32_summation_error_of_float64(dtype, rows, out_features, in_features, with_bias):
    """Products summed in fp32 (bf16: products of bf16 values, exact in fp32), plus the bias; bf16 results rounded
    once. Every element within fp32's summation bound (K u sum |x w|) of the float64 answer, plus one bf16
    rounding for bf16."""
    from minivllm.model._kernels import kernels
    g = torch.Generator().manual_seed(rows * out_features)
    w = (torch.randn(out_features, in_features, generator=g) / in_features ** 0.5).to(dtype)
    x = torch.randn(rows, in_features, generator=g).to(dtype)
    b = torch.randn(out_features, generator=g).to(dtype) if with_bias else None
    packed = kernels.cpu_ops.pack_linear(w)
    words = in_features // (2 if dtype == torch.bfloat16 else 1)
    assert packed.shape == (-(-out_features // 48), words, 48) and cpu_gemm.packed_dtype(packed) == dtype
    got = kernels.cpu_ops.packed_linear(x, packed, out_features, b)
    exact = x.double() @ w.double().T + (b.double() if b is not None else 0)
    magnitude = x.double().abs() @ w.double().abs().T + (b.double().abs() if b is not None else 0)
    bound = (in_features + 1) * 2 ** -24 * magnitude + (2 ** -8 * exact.abs() if dtype == torch.bfloat16 else 0)
    assert got.dtype == dtype and got.shape == (rows, out_features)
    assert ((got.double() - exact).abs() <= bound).all()
    assert kernels.cpu_ops.packed_linear(x[None, :1], packed, out_features, b).shape == (1, 1, out_features)


@pytest.mark.parametrize("dtype", [own_gemm(torch.float32), own_gemm(torch.bfloat16)])
def test_own_gemm_refuses_a_wrong_layout_with_a_clear_error(dtype):
    from minivllm.model._kernels import kernels
    packed = kernels.cpu_ops.pack_linear(torch.ones(96, 64, dtype=dtype))
    with pytest.raises(RuntimeError, match=r"is not pack_linear's layout of a .* \(96, 32\) weight"):
        kernels.cpu_ops.packed_linear(torch.ones(2, 32, dtype=dtype), packed, 96)
    if dtype == torch.bfloat16:
        with pytest.raises(RuntimeError, match="an even `in`"):
            kernels.cpu_ops.pack_linear(torch.ones(4, 5, dtype=dtype))
        assert cpu_gemm.prepack(torch.ones(4, 5, dtype=dtype)).is_mkldnn     # odd `in`: oneDNN's


@pytest.mark.parametrize("dtype", [own_gemm(torch.float32), own_gemm(torch.bfloat16)])
def test_every_linear_of_the_model_uses_the_own_kernel(monkeypatch, dtype):
    from minivllm import LLM, SamplingParams
    from minivllm.model._kernels import kernels

    llm = LLM(dtype=dtype, num_kv_blocks=64)
    model = llm.llm_engine.model_runner.model
    linears = [m for m in model.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear, ParallelLMHead))]
    assert len(linears) == 30 * 4 + 1                         # qkv, o, gate_up, down per layer + the LM head
    assert all(m.packed_weight is not None and not m.packed_weight.is_mkldnn for m in linears)
    assert [m.packed_silu_and_mul for m in linears if isinstance(m, MergedColumnParallelLinear)] == [True] * 30
    calls = []
    real = kernels.cpu_ops.packed_linear
    monkeypatch.setattr(kernels.cpu_ops, "packed_linear", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    out = llm.generate([{"prompt_token_ids": [1, 2, 3, 4]}], SamplingParams(max_tokens=2, temperature=0),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2
    assert len(calls) == 2 * len(linears)                     # every linear, both steps


# n: whole panels of 24 pairs (1536: the default model's intermediate size), a part panel, fewer than 16 pairs.
@pytest.mark.parametrize("dtype", [own_gemm(torch.float32), own_gemm(torch.bfloat16)])
@pytest.mark.parametrize("rows", [1, 9, 600])
@pytest.mark.parametrize("n", [1536, 100, 7])
def test_silu_and_mul_in_the_matmul_equals_the_separate_pass_bit_for_bit(dtype, rows, n):
    """packed_linear(silu_and_mul=True) on interleave_gate_up's panels gives exactly silu_and_mul of the plain
    product (the same roundings, in the same order); the plain product with the interleaved weight gives back
    [gate | up] through gate_up_columns; and both are HF's SiLU of F.linear within the matmul's rounding."""
    from transformers.activations import ACT2FN

    from minivllm.model._kernels import kernels
    ops = kernels.cpu_ops
    g = torch.Generator().manual_seed(rows + n)
    w = (torch.randn(2 * n, 576, generator=g) / 8).to(dtype)
    x = torch.randn(rows, 576, generator=g).to(dtype)
    plain, panels = ops.pack_linear(w), ops.pack_linear(ops.interleave_gate_up(w))
    assert panels.shape[0] == -(-n // 24)
    gate_up = ops.packed_linear(x, plain, 2 * n)
    fused = ops.packed_linear(x, panels, n, silu_and_mul=True)
    assert fused.shape == (rows, n) and torch.equal(fused, ops.silu_and_mul(gate_up))
    back = ops.packed_linear(x, panels, panels.shape[0] * 48)[:, ops.gate_up_columns(n)]
    assert torch.equal(back, gate_up)
    hf = F.linear(x.float(), w.float())
    want = (ACT2FN["silu"](hf[:, :n]) * hf[:, n:])
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(fused.float(), want, **tol)
    with pytest.raises(RuntimeError, match=r"is not pack_linear's layout .* with gate/up panels"):
        ops.packed_linear(x, panels, n + 24, silu_and_mul=True)         # 24 more outputs need one more panel
    with pytest.raises(RuntimeError, match="silu_and_mul takes no bias"):
        ops.packed_linear(x, panels, n, torch.zeros(n, dtype=dtype), silu_and_mul=True)


def test_the_gate_up_layer_in_panels_computes_what_the_plain_layer_does(monkeypatch):
    """A MergedColumnParallelLinear packed in gate/up panels: forward gives [gate | up] as the plain layer does,
    silu_and_mul equals SiluAndMul of it; MINIVLLM_CPU_FUSED_SILU=0 packs it plainly instead."""
    if not cpu_gemm.own_gemm(torch.float32):
        pytest.skip("minivllm's fp32 matmul needs AVX-512")
    layer = MergedColumnParallelLinear(64, [40, 40], False, TPGroup(), feeds_silu_and_mul=True)
    layer.weight.data = torch.randn(80, 64, generator=torch.Generator().manual_seed(3))
    x = torch.randn(5, 64)
    cpu_gemm.prepack_linear_weights(layer)
    assert layer.packed_silu_and_mul
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight), rtol=1e-5, atol=1e-5)
    assert torch.equal(cpu_gemm.silu_and_mul(layer, x), SiluAndMul()(layer(x)))
    monkeypatch.setenv("MINIVLLM_CPU_FUSED_SILU", "0")
    plain = MergedColumnParallelLinear(64, [40, 40], False, TPGroup(), feeds_silu_and_mul=True)
    plain.weight.data = layer.weight.data.clone()
    cpu_gemm.prepack_linear_weights(plain)
    assert not plain.packed_silu_and_mul and plain.packed_weight.shape[0] == 2      # 80 columns: 2 plain panels
    assert torch.equal(cpu_gemm.silu_and_mul(plain, x), cpu_gemm.silu_and_mul(layer, x))


def test_own_gemm_switches_off_with_env(monkeypatch):
    monkeypatch.setenv("MINIVLLM_CPU_OWN_GEMM", "0")
    cpu_gemm.own_gemm.cache_clear()
    try:
        for dtype in (torch.float32, torch.bfloat16):
            assert not cpu_gemm.own_gemm(dtype)
            packed = cpu_gemm.prepack(torch.ones(96, 64, dtype=dtype))
            assert packed is None or packed.is_mkldnn             # oneDNN's, or F.linear where it cannot pack
    finally:
        monkeypatch.undo()
        cpu_gemm.own_gemm.cache_clear()


def test_no_packing_for_other_dtypes_and_fallback_on_mismatch():
    w = torch.randn(8, 4)
    assert cpu_gemm.prepack(w.half()) is None                 # fp16 on a CPU: F.linear
    packed = cpu_gemm.prepack(w)
    x = torch.randn(3, 4, dtype=torch.bfloat16)               # a bf16 input to an fp32 packed weight
    torch.testing.assert_close(cpu_gemm.gemm(x, w.bfloat16(), None, packed), F.linear(x, w.bfloat16()))


@pytest.mark.slow
def test_every_linear_of_the_model_is_packed_for_onednn_and_used(monkeypatch):
    from minivllm import LLM, SamplingParams

    with monkeypatch.context() as env:
        env.setenv("MINIVLLM_CPU_OWN_GEMM", "0")             # oneDNN's layout for every dtype
        cpu_gemm.own_gemm.cache_clear()
        llm = LLM(num_kv_blocks=64)
    cpu_gemm.own_gemm.cache_clear()
    model = llm.llm_engine.model_runner.model
    linears = [m for m in model.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear, ParallelLMHead))]
    assert len(linears) == 30 * 4 + 1                         # qkv, o, gate_up, down per layer + the LM head
    assert all(m.packed_weight is not None and m.packed_weight.is_mkldnn for m in linears)
    calls = []
    real = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(cpu_gemm, "torch", _CountingTorch(real, calls))
    out = llm.generate([{"prompt_token_ids": [1, 2, 3, 4]}], SamplingParams(max_tokens=2, temperature=0),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2
    assert len(calls) == 2 * len(linears)                     # every linear, both steps, went through oneDNN


def test_a_dtype_the_cpu_cannot_pack_keeps_f_linear(monkeypatch):
    """An AVX2-only CPU (an AMD EPYC among these machines) makes oneDNN refuse bf16 with a RuntimeError: the
    probe says so once, prepack gives None, and the layer's matmul is F.linear's, with the same result."""
    def refuse(*args, **kwargs):
        raise RuntimeError("mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx_ne_convert or "
                           "avx512bw, avx512vl and avx512dq")
    cpu_gemm.packable.cache_clear()
    cpu_gemm.own_gemm.cache_clear()
    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", refuse)
    monkeypatch.setenv("MINIVLLM_CPU_OWN_GEMM", "0")         # such a CPU has no AVX-512 for minivllm's either
    try:
        assert not cpu_gemm.packable(torch.bfloat16)
        layer = ColumnParallelLinear(16, 8, False, TPGroup()).to(torch.bfloat16)
        layer.weight.data.normal_()                 # torch.empty: whatever was in memory, NaN included
        assert cpu_gemm.prepack_linear_weights(layer) == 0 and layer.packed_weight is None
        x = torch.randn(3, 16, dtype=torch.bfloat16)
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight))
    finally:
        monkeypatch.undo()
        cpu_gemm.packable.cache_clear()
        cpu_gemm.own_gemm.cache_clear()


def test_switch_off_with_env(monkeypatch):
    monkeypatch.setenv("MINIVLLM_CPU_PREPACK", "0")
    layer = ColumnParallelLinear(4, 8, False, TPGroup())
    assert cpu_gemm.prepack_linear_weights(layer) == 0 and layer.packed_weight is None


class _CountingTorch:
    """Stands in for the `torch` module inside cpu_gemm, counting calls of oneDNN's packed linear."""

    def __init__(self, real_op, calls):
        self._real_op, self._calls = real_op, calls

    def __getattr__(self, name):
        if name == "ops":
            return self
        if name == "mkldnn":
            return self
        if name == "_linear_pointwise":
            def counted(*args):
                self._calls.append(1)
                return self._real_op(*args)
            return counted
        return getattr(torch, name)
