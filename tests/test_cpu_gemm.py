"""Prepacked CPU matmuls (model/cpu_gemm.py): oneDNN's, and minivllm's own bf16 kernel (kernels/cpu_gemm.cpp) on a
CPU with AVX-512 BF16; same results as F.linear, and really used by the model."""

import pytest
import torch
import torch.nn.functional as F

from minivllm.model import cpu_gemm
from minivllm.model.layers import ColumnParallelLinear, ParallelLMHead, RowParallelLinear, TPGroup

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
    own = dtype == torch.bfloat16 and cpu_gemm.own_bf16_gemm()
    assert packed is not None and (packed.dtype == torch.int32 if own else packed.is_mkldnn)
    torch.testing.assert_close(cpu_gemm.gemm(x, w, b, packed), F.linear(x, w, b), rtol=rtol, atol=atol)
    torch.testing.assert_close(cpu_gemm.gemm(x, w, None, packed), F.linear(x, w), rtol=rtol, atol=atol)


own_gemm = pytest.mark.skipif(not cpu_gemm.own_bf16_gemm(), reason="minivllm's bf16 matmul needs AVX-512 BF16")


# rows: one, a tile (8) and one over, more than a 512-row chunk; out: whole 48-column panels and a part panel.
@own_gemm
@pytest.mark.parametrize("rows", [1, 8, 9, 600])
@pytest.mark.parametrize("out_features,in_features", [(96, 64), (100, 576), (7, 1536)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_own_bf16_gemm_is_the_exact_product_rounded_once(rows, out_features, in_features, with_bias):
    """Exact products of bf16 values summed in fp32, plus the bias, rounded to bf16 once: within one bf16 rounding
    (and fp32's summation error) of the float64 answer, for every element."""
    from minivllm.model._kernels import kernels
    g = torch.Generator().manual_seed(rows * out_features)
    w = (torch.randn(out_features, in_features, generator=g) / in_features ** 0.5).bfloat16()
    x = torch.randn(rows, in_features, generator=g).bfloat16()
    b = torch.randn(out_features, generator=g).bfloat16() if with_bias else None
    packed = kernels.cpu_ops.pack_bf16_linear(w)
    assert packed.shape == (-(-out_features // 48), in_features // 2, 48)
    got = kernels.cpu_ops.bf16_linear(x, packed, out_features, b)
    exact = x.double() @ w.double().T + (b.double() if b is not None else 0)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, out_features)
    assert ((got.double() - exact).abs() <= 2 ** -8 * exact.abs() + 1e-5 * in_features ** 0.5).all()
    assert kernels.cpu_ops.bf16_linear(x[None, :1], packed, out_features, b).shape == (1, 1, out_features)


@own_gemm
def test_own_bf16_gemm_refuses_a_wrong_layout_with_a_clear_error():
    from minivllm.model._kernels import kernels
    packed = kernels.cpu_ops.pack_bf16_linear(torch.ones(96, 64, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match=r"is not pack_bf16_linear's layout of a \(96, 32\) weight"):
        kernels.cpu_ops.bf16_linear(torch.ones(2, 32, dtype=torch.bfloat16), packed, 96)
    with pytest.raises(RuntimeError, match="an even `in`"):
        kernels.cpu_ops.pack_bf16_linear(torch.ones(4, 5, dtype=torch.bfloat16))
    assert cpu_gemm.prepack(torch.ones(4, 5, dtype=torch.bfloat16)).is_mkldnn     # odd `in`: oneDNN's


@own_gemm
def test_every_linear_of_a_bf16_model_uses_the_own_kernel(monkeypatch):
    from minivllm import LLM, SamplingParams
    from minivllm.model._kernels import kernels

    llm = LLM(dtype="bfloat16", num_kv_blocks=64)
    model = llm.llm_engine.model_runner.model
    linears = [m for m in model.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear, ParallelLMHead))]
    assert all(m.packed_weight is not None and m.packed_weight.dtype == torch.int32 for m in linears)
    calls = []
    real = kernels.cpu_ops.bf16_linear
    monkeypatch.setattr(kernels.cpu_ops, "bf16_linear", lambda *a: calls.append(1) or real(*a))
    out = llm.generate([{"prompt_token_ids": [1, 2, 3, 4]}], SamplingParams(max_tokens=2, temperature=0),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2
    assert len(calls) == 2 * len(linears)                     # every linear, both steps


def test_own_bf16_gemm_switches_off_with_env(monkeypatch):
    monkeypatch.setenv("MINIVLLM_CPU_BF16_GEMM", "0")
    cpu_gemm.own_bf16_gemm.cache_clear()
    try:
        assert not cpu_gemm.own_bf16_gemm()
        packed = cpu_gemm.prepack(torch.ones(96, 64, dtype=torch.bfloat16))
        assert packed is None or packed.is_mkldnn                 # oneDNN's, or F.linear where it cannot pack
    finally:
        monkeypatch.undo()
        cpu_gemm.own_bf16_gemm.cache_clear()


def test_no_packing_for_other_dtypes_and_fallback_on_mismatch():
    w = torch.randn(8, 4)
    assert cpu_gemm.prepack(w.half()) is None                 # fp16 on a CPU: F.linear
    packed = cpu_gemm.prepack(w)
    x = torch.randn(3, 4, dtype=torch.bfloat16)               # a bf16 input to an fp32 packed weight
    torch.testing.assert_close(cpu_gemm.gemm(x, w.bfloat16(), None, packed), F.linear(x, w.bfloat16()))


def test_every_linear_of_the_model_is_packed_and_used(monkeypatch):
    from minivllm import LLM, SamplingParams

    llm = LLM(num_kv_blocks=64)
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
    cpu_gemm.own_bf16_gemm.cache_clear()
    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", refuse)
    monkeypatch.setenv("MINIVLLM_CPU_BF16_GEMM", "0")        # such a CPU has no AVX-512 BF16 for minivllm's either
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
        cpu_gemm.own_bf16_gemm.cache_clear()


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
