"""Weight-only int8 / int4 / gguf on a CPU (platforms/cpu/quantization.py): the matmuls against the quantization math
written out, the engine really running on quantized weights, and how far greedy text moves from fp32."""

import pytest
import torch
import torch.nn.functional as F

from minivllm import LLM, SamplingParams
from minivllm.config import EngineConfig
from minivllm.platforms.cpu import gemm as cpu_gemm, quantization as quant
from minivllm.model.layers import ColumnParallelLinear, ParallelLMHead, RowParallelLinear, TPGroup
from tests.oracle import PROMPTS


def linear_with(weight: torch.Tensor) -> ColumnParallelLinear:
    layer = ColumnParallelLinear(weight.shape[1], weight.shape[0], False, TPGroup())
    layer.weight.data = weight.clone()
    return layer


def bf16_linear(x, w):
    """What the kernels compute: bf16 activations times the dequantized weight, fp32 sums, rounded to bf16."""
    return F.linear(x.bfloat16().float(), w).bfloat16().float()


@pytest.mark.parametrize("own_kernel", [True, False])
def test_int8_is_per_channel_symmetric_and_its_matmul_matches_the_math(own_kernel, monkeypatch):
    if own_kernel and not quant.own_quantized_kernels():
        pytest.skip("minivllm's int8 kernel needs AVX-512 BF16")
    monkeypatch.setattr(quant, "own_quantized_kernels", lambda: own_kernel)   # False: PyTorch's kernel
    w = torch.randn(96, 64, generator=torch.Generator().manual_seed(0))
    q, scale = quant.Int8WeightOnlyMethod.quantize(w)
    assert q.dtype == torch.int8 and q.shape == (96, 64) and scale.dtype == torch.float32
    assert (q.float() * scale[:, None] - w).abs().le(scale[:, None] * 0.5 + 1e-6).all()     # half a step
    layer = linear_with(w)
    method = quant.Int8WeightOnlyMethod()
    method.process_weights_after_loading(layer)
    # the own kernel's packed pairs and fp32 scales, or PyTorch's (out, in) int8 with bf16 scales
    assert layer.qweight.dtype == (torch.int16 if own_kernel else torch.int8)
    deq = q.float() * layer.qscale.float()[:, None]
    x = torch.randn(5, 64)
    torch.testing.assert_close(method.apply(layer, x, None).float(), bf16_linear(x, deq), rtol=2e-2, atol=5e-2)


@pytest.mark.skipif(not quant.own_quantized_kernels(), reason="minivllm's int8 kernel needs AVX-512 BF16")
@pytest.mark.parametrize("rows", [1, 8, 9, 20, 600])
@pytest.mark.parametrize("out_features,in_features", [(96, 64), (100, 576), (7, 1536)])
def test_own_int8_kernel_is_within_one_bf16_rounding_of_float64(rows, out_features, in_features):
    """int8 values are exact in bf16 and their products with bf16 x exact in fp32: the result is the float64
    answer to fp32's summation error plus one bf16 rounding, for every element. Rows cover the first tile
    alone (it widens the panel in registers), later tiles (they read the widened copy) and two 512-row chunks."""
    from minivllm.model._kernels import kernels
    g = torch.Generator().manual_seed(rows * out_features)
    w = torch.randn(out_features, in_features, generator=g) / in_features ** 0.5
    q, scale = quant.Int8WeightOnlyMethod.quantize(w)
    x = torch.randn(rows, in_features, generator=g).bfloat16()
    b = torch.randn(out_features, generator=g).bfloat16()
    packed = kernels.cpu_ops.pack_int8_linear(q)
    assert packed.shape == (-(-out_features // 48), in_features // 2, 48) and packed.dtype == torch.int16
    got = kernels.cpu_ops.int8_linear(x, packed, scale, out_features, b)
    deq = q.double() * scale.double()[:, None]
    exact = x.double() @ deq.T + b.double()
    magnitude = x.double().abs() @ deq.abs().T + b.double().abs()
    assert got.dtype == torch.bfloat16 and got.shape == (rows, out_features)
    assert ((got.double() - exact).abs() <= (in_features + 2) * 2 ** -24 * magnitude + 2 ** -8 * exact.abs()).all()
    with pytest.raises(RuntimeError, match=r"is not pack_int8_linear's layout of a \(96, 32\) weight"):
        kernels.cpu_ops.int8_linear(x[:, :32], kernels.cpu_ops.pack_int8_linear(q[:96, :64]), scale[:96], 96)


@pytest.mark.parametrize("own_kernel", [True, False])
def test_int4_groups_of_32_with_a_minimum_and_its_matmul_matches_the_math(own_kernel, monkeypatch):
    if own_kernel and not quant.own_quantized_kernels():
        pytest.skip("minivllm's int4 kernel needs AVX-512 BF16")
    monkeypatch.setattr(quant, "own_quantized_kernels", lambda: own_kernel)   # False: PyTorch's kernel
    w = torch.randn(64, 96, generator=torch.Generator().manual_seed(1))
    layer = linear_with(w)
    method = quant.Int4WeightOnlyMethod()
    method.process_weights_after_loading(layer)
    q, d, m = method.quantize_groups(w.view(64, 3, 32))
    assert q.min() >= 0 and q.max() <= 15
    if own_kernel:          # minivllm's: w = d q + m with fp32 d and m
        deq = (q * d[..., None] + m[..., None]).view(64, 96)
    else:                   # PyTorch's: w = (q - 8) * scale + zero, with scale and zero in bf16
        scale, zero = d.bfloat16().float(), (m + 8 * d).bfloat16().float()
        deq = ((q - 8) * scale[..., None] + zero[..., None]).view(64, 96)
    assert (deq - w).abs().max() < 0.6 * d.max() + 0.05
    x = torch.randn(7, 96)
    torch.testing.assert_close(method.apply(layer, x, None).float(), bf16_linear(x, deq), rtol=2e-2, atol=5e-2)
    layer.quant_method = method
    torch.testing.assert_close(quant.dequantize(layer), deq.bfloat16().float(), rtol=1e-2, atol=2e-2)


@pytest.mark.skipif(not quant.own_quantized_kernels(), reason="minivllm's int4 kernel needs AVX-512 BF16")
@pytest.mark.parametrize("rows", [1, 8, 9, 20, 600])
@pytest.mark.parametrize("out_features,in_features", [(96, 64), (100, 576), (7, 1536)])
def test_own_int4_kernel_is_within_fp32_summation_error_of_float64(rows, out_features, in_features):
    """q is exact in bf16 and its products with bf16 x exact in fp32; each group's sum is scaled by d, plus m
    times the group's sum of x: every element within fp32's summation bound and one bf16 rounding of the float64
    product with w = d q + m. Rows cover the first tile alone (it widens the nibbles in registers), later tiles
    (the widened copy) and two 512-row chunks; 100 and 7 columns a part panel."""
    from minivllm.model._kernels import kernels
    g = torch.Generator().manual_seed(rows * out_features + 1)
    w = torch.randn(out_features, in_features, generator=g) / in_features ** 0.5
    groups = in_features // 32
    q, d, m = quant.Int4WeightOnlyMethod().quantize_groups(w.view(out_features, groups, 32))
    x = torch.randn(rows, in_features, generator=g).bfloat16()
    b = torch.randn(out_features, generator=g).bfloat16()
    packed, dm = kernels.cpu_ops.pack_int4_linear(q.view(out_features, in_features).to(torch.uint8), d, m)
    panels = -(-out_features // 48)
    assert packed.shape == (panels, in_features // 2, 48) and packed.dtype == torch.uint8
    assert dm.shape == (panels, groups, 2, 48) and dm.dtype == torch.float32
    got = kernels.cpu_ops.int4_linear(x, packed, dm, out_features, b)
    dq, mm = q.double() * d.double()[..., None], m.double()[..., None].expand_as(q)
    weight = (dq + mm).view(out_features, in_features)
    exact = x.double() @ weight.T + b.double()
    magnitude = x.double().abs() @ (dq.abs() + mm.abs()).view(out_features, in_features).T + b.double().abs()
    assert got.dtype == torch.bfloat16 and got.shape == (rows, out_features)
    assert ((got.double() - exact).abs() <= (in_features + 2) * 2 ** -24 * magnitude + 2 ** -8 * exact.abs()).all()
    with pytest.raises(RuntimeError, match=r"is not pack_int4_linear's d and m"):
        kernels.cpu_ops.int4_linear(x, packed, dm[:, :1], out_features)
    with pytest.raises(RuntimeError, match="values must be 0..15"):
        kernels.cpu_ops.pack_int4_linear(torch.full((2, 32), 16, dtype=torch.uint8), d[:2, :1], m[:2, :1])


@pytest.mark.skipif(not quant.own_quantized_kernels(), reason="minivllm's int8/int4 kernels need AVX-512 BF16")
@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("rows", [1, 9, 600])
@pytest.mark.parametrize("n", [1536, 100])
def test_quantized_gate_up_panels_give_the_separate_silu_pass_bit_for_bit(method, rows, n):
    """A gated MLP's gate/up layer of a bf16 model, quantized and packed in gate/up panels: silu_and_mul in the
    matmul equals silu_and_mul of the plain quantized product, and forward (and dequantize) the plain layer's."""
    from minivllm.model.layers import MergedColumnParallelLinear, SiluAndMul
    g = torch.Generator().manual_seed(rows + n)
    w = torch.randn(2 * n, 576, generator=g) / 24
    x = torch.randn(rows, 576, generator=g).bfloat16()
    layers = []
    for panels in (False, True):
        layer = MergedColumnParallelLinear(576, [n, n], False, TPGroup(), feeds_silu_and_mul=True)
        layer.weight.data = w.clone()
        layer.packed_silu_and_mul = panels                    # as quantize_linear_weights sets it for bf16
        layer.quant_method = quant.get_quant_method(method)
        layer.quant_method.process_weights_after_loading(layer)
        layers.append(layer)
    plain, fused = layers
    assert torch.equal(fused(x), plain(x))
    assert torch.equal(cpu_gemm.silu_and_mul(fused, x), SiluAndMul()(plain(x)))
    if rows == 1:
        assert torch.equal(quant.dequantize(fused), quant.dequantize(plain))


def test_an_int8_gate_up_on_pytorchs_kernel_keeps_silu_separate(monkeypatch):
    """Where PyTorch's int8 kernel runs the layer (no AVX-512 BF16), it has no gate/up panels: the
    layer drops the flag, and silu_and_mul runs SiLU after the plain product."""
    from minivllm.model.layers import MergedColumnParallelLinear, SiluAndMul
    monkeypatch.setattr(quant, "own_quantized_kernels", lambda: False)
    layer = MergedColumnParallelLinear(64, [40, 40], False, TPGroup(), feeds_silu_and_mul=True)
    layer.weight.data = torch.randn(80, 64, generator=torch.Generator().manual_seed(5))
    layer.packed_silu_and_mul = True                          # as if quantize_linear_weights had asked for panels
    layer.quant_method = quant.Int8WeightOnlyMethod()
    layer.quant_method.process_weights_after_loading(layer)
    assert not layer.packed_silu_and_mul and layer.qweight.dim() == 2
    x = torch.randn(3, 64).bfloat16()
    assert layer(x).shape == (3, 80)
    assert torch.equal(cpu_gemm.silu_and_mul(layer, x), SiluAndMul()(layer(x)))


def test_int8_refuses_an_odd_in_features_with_a_clear_error():
    """PyTorch's int8 kernel crashes the process on an odd `in`, and minivllm's takes pairs: a clear error instead."""
    with pytest.raises(ValueError, match="in_features divisible by 2; a layer has 33"):
        quant.Int8WeightOnlyMethod().process_weights_after_loading(linear_with(torch.randn(8, 33)))


def test_gguf_refuses_weights_that_are_not_q4_1_values():
    layer = linear_with(torch.randn(32, 64))
    with pytest.raises(ValueError, match="Q4_1 values.*int4"):
        quant.GGUFQ4_1Method().process_weights_after_loading(layer)


def test_bad_values_and_devices_are_refused_with_the_choices():
    with pytest.raises(ValueError, match="quantization is 'fp4'; choose one of int8, int4, gguf, w8a8_int8, w4a8_int8"):
        EngineConfig(quantization="fp4").validate()
    with pytest.raises(ValueError, match="CPU only"):
        quant.quantize_linear_weights(linear_with(torch.randn(8, 32)), "int8", torch.device("cuda"))


@pytest.fixture(scope="module")
def fp32_tokens(llm, tokenizer):
    prompts = [tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    return prompts, [o.outputs[0].token_ids for o in outs]


# Measured on the default model (6 prompts x 16 greedy tokens): how many tokens each keeps before it first
# parts from fp32, summed (of 96): int8 76, int4 36, gguf 80 (exact Q4_1 groups, int8 head); on the Zen 4
# machine of 2026-11-27 with minivllm's int8/int4 kernels, int8 74, int4 36, gguf 84 (with PyTorch's: 80, 28,
# 80; perplexities docs/benchmarks.md). bf16 models (2026-11-27, the activation in the gate/up matmul): int8
# 80, int4 28, gguf 86. Floors below those.
@pytest.mark.slow
@pytest.mark.parametrize("method,floor,dtype", [("int8", 60, "float32"), ("int4", 24, "float32"),
                                               ("gguf", 64, "float32"), ("gguf", 64, "bfloat16"),
                                               ("int8", 60, "bfloat16"), ("int4", 20, "bfloat16")])
def test_engine_runs_on_quantized_weights(method, floor, dtype, fp32_tokens, model_dir):
    """gguf on a bf16 model too: the weights are quantized from the checkpoint's fp32 values (in bf16 they would
    no longer be Q4_1 values, and gguf refused them), then the embedding and norms are cast to bf16."""
    llm = LLM(str(model_dir), quantization=method, dtype=dtype, num_kv_blocks=256)
    model = llm.llm_engine.model_runner.model
    assert all(p.dtype == getattr(torch, dtype) for p in model.parameters())
    layers = [m for m in model.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear, ParallelLMHead))]
    assert len(layers) == 30 * 4 + 1
    for m in layers:
        assert m.quant_method is not None
        if not isinstance(m, ParallelLMHead):
            assert m.weight.numel() == 0               # the full weight is gone: only the quantized one can run
    gate_ups = [m for m in layers if hasattr(m, "feeds_silu_and_mul")]
    in_matmul = dtype == "bfloat16" and quant.own_quantized_kernels()     # bf16: the activation in the matmul
    assert [m.packed_silu_and_mul for m in gate_ups] == [in_matmul] * 30
    if method == "int8":               # minivllm's packed int8 pairs (AVX-512 BF16), or PyTorch's (out, in) int8
        assert layers[0].qweight.dtype == (torch.int16 if quant.own_quantized_kernels() else torch.int8)
    else:                              # minivllm's nibble pairs (AVX-512 BF16), or PyTorch's int4 packing
        assert layers[0].qweight.numel() * layers[0].qweight.element_size() == 960 * 576 // 2
    head = model.lm_head.quant_method
    assert head.name == ("int8" if method in ("int8", "gguf") else "int4")
    prompts, expected = fp32_tokens
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    kept = 0
    for out, exp in zip(outs, expected):
        mine = out.outputs[0].token_ids
        assert len(mine) == 16
        kept += next((i for i, (a, b) in enumerate(zip(mine, exp)) if a != b), 16)
    assert kept >= floor, f"{method}: {kept} of {16 * len(prompts)} tokens before parting from fp32"
    print(f"{method}: {kept} of {16 * len(prompts)} greedy tokens agree with fp32 before the first difference")
