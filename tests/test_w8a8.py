"""Integer dot products (platforms/cpu/quantization.py, kernels/cpu_gemm.cpp): quantization="w8a8_int8" (int8
weights per channel times int8 activations per token, w8a8_linear) and "w4a8_int8" (int4 weights in groups of 32
times int8 activations in groups of 32, w4a8_linear). The oracles: the quantization written out in PyTorch
(quantize_activations, quantize_activation_groups, the weight methods' own quantize) with exact integer sums, and
Hugging Face's fp32 model whose linear layers see the same roundings."""

import pytest
import torch
import torch.nn.functional as F

from minivllm import LLM, SamplingParams
from minivllm.platforms.cpu import quantization as quant
from minivllm.model.layers import ColumnParallelLinear, ParallelLMHead, RowParallelLinear, TPGroup
from tests.oracle import PROMPTS

own_kernel = pytest.mark.skipif(not quant.own_w8a8_kernel(), reason="w8a8_linear needs AVX-512 VNNI and BF16")


def ops():
    from minivllm.model._kernels import kernels
    return kernels.cpu_ops


def integer_reference(x, q, scale, bias=None):
    """float64 of s[r] scale[n] sum_k qx[r, k] q[n, k] (+ bias): the products and sums as exact integers."""
    qx, s = quant.quantize_activations(x)
    y = (qx.long() @ q.long().t()).double() * s.double()[:, None] * scale.double()
    return y if bias is None else y + bias.double()


def test_activations_are_rounded_per_row_to_nearest_even():
    x = torch.tensor([[127.0, 2.5, -3.5, 0.5, 1.5, -0.5, 0.0, 126.5],     # s = 1: ties go to the even integer
                      [0.0] * 8,                                          # all zero: s is the floor, q zero
                      [-2.0, 1.0, 0.25, 0.0, 0.0, 0.0, 0.0, 0.0]])
    q, s = quant.quantize_activations(x)
    assert q.dtype == torch.int8 and s.dtype == torch.float32
    assert q[0].tolist() == [127, 2, -4, 0, 2, 0, 0, 126]
    assert q[1].tolist() == [0] * 8 and s[1] == torch.tensor(1e-12)
    assert s[2] == torch.tensor(2.0) / 127 and q[2, 0] == -127
    assert ((q.float() * s[:, None] - x).abs() <= s[:, None] / 2 + 1e-6).all()      # half a step


@own_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_quantizes_x_to_the_reference_bytes(dtype):
    """The identity as the weight (q = 127 on the diagonal, scale 1 / 127) hands back s * qx: dividing by s gives
    the kernel's integers, which must be quantize_activations' own, ties included (x / s at exactly .5)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(40, 64, generator=g) * torch.logspace(-3, 3, 40)[:, None]
    x[0, :8] = torch.tensor([127.0, 2.5, -3.5, 0.5, 1.5, -0.5, 4.5, -126.5])       # s = 1, ties
    x = x.to(dtype)
    eye_q, eye_scale = quant.Int8WeightOnlyMethod.quantize(torch.eye(64))
    packed, offset = ops().pack_w8a8_linear(eye_q)
    y = ops().w8a8_linear(x, packed, offset, eye_scale, 64).float()
    qx, s = quant.quantize_activations(x)
    got = torch.round(y / s[:, None])
    assert torch.equal(got, qx.float())
    assert qx[0, :8].tolist() == [127, 2, -4, 0, 2, 0, 4, -126]


@own_kernel
def test_packing_holds_four_int8_a_word_and_the_offsets():
    g = torch.Generator().manual_seed(2)
    q = torch.randint(-128, 128, (100, 64), generator=g, dtype=torch.int8)
    packed, offset = ops().pack_w8a8_linear(q)
    assert packed.shape == (3, 16, 48) and packed.dtype == torch.int32
    assert offset.shape == (3, 48) and offset.dtype == torch.int32
    words = packed.view(torch.int8).view(3, 16, 48, 4)                       # panel, word, column, byte
    assert torch.equal(words[1, 5, 7], q[48 + 7, 20:24])                      # column 55, k 20..23
    assert torch.equal(offset.flatten()[:100], -128 * q.int().sum(1))
    assert not offset.flatten()[100:].any()                                    # the last panel's padding
    with pytest.raises(RuntimeError, match="`in` a multiple of 4"):
        ops().pack_w8a8_linear(torch.zeros(4, 6, dtype=torch.int8))


@own_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 8, 9, 20, 600])
@pytest.mark.parametrize("out_features,in_features", [(96, 64), (100, 576), (7, 1536)])
def test_the_kernel_equals_the_integer_math(dtype, rows, out_features, in_features):
    """Exact integer sums, so the only roundings are the final fp32 scaling and, for bf16, one rounding of the
    result. Rows cover a partial tile, whole tiles, a tile and a row, and two 512-row chunks."""
    g = torch.Generator().manual_seed(rows * out_features)
    w = torch.randn(out_features, in_features, generator=g) / in_features ** 0.5
    q, scale = quant.Int8WeightOnlyMethod.quantize(w)
    x = torch.randn(rows, in_features, generator=g).to(dtype)
    b = torch.randn(out_features, generator=g).to(dtype)
    packed, offset = ops().pack_w8a8_linear(q)
    got = ops().w8a8_linear(x, packed, offset, scale, out_features, b)
    assert got.dtype == dtype and got.shape == (rows, out_features)
    want = integer_reference(x, q, scale, b)
    if dtype == torch.float32:
        torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)
    else:                                                     # one bf16 rounding (2^-8 relative) of the result
        assert ((got.double() - want).abs() <= want.abs() * 2 ** -8 + 1e-6).all()


@own_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 9, 600])
def test_silu_and_mul_in_the_w8a8_matmul_equals_the_separate_pass(dtype, rows):
    """Gate/up panels (interleave_gate_up of q and of the scales): silu(gate) * up of the plain product, as the
    layer would compute it after a separate pass, to the last bit in fp32 and to a bf16 rounding in bf16."""
    from minivllm.model.layers import SiluAndMul
    n = 100
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(2 * n, 576, generator=g) / 24
    q, scale = quant.Int8WeightOnlyMethod.quantize(w)
    x = torch.randn(rows, 576, generator=g).to(dtype)
    plain = ops().w8a8_linear(x, *ops().pack_w8a8_linear(q), scale, 2 * n)
    panels = ops().pack_w8a8_linear(ops().interleave_gate_up(q))
    fused = ops().w8a8_linear(x, *panels, ops().interleave_gate_up(scale), n, None, True)
    separate = SiluAndMul()(plain)
    if dtype == torch.float32:
        torch.testing.assert_close(fused, separate, rtol=1e-6, atol=1e-6)
    else:
        torch.testing.assert_close(fused.float(), separate.float(), rtol=2 ** -7, atol=1e-3)


def linear_with(weight: torch.Tensor) -> ColumnParallelLinear:
    layer = ColumnParallelLinear(weight.shape[1], weight.shape[0], False, TPGroup())
    layer.weight.data = weight.clone()
    return layer


@pytest.mark.parametrize("own", [True, False])
def test_the_layer_method_on_either_kernel_equals_the_integer_math(own, monkeypatch):
    """own=False: int8_matmul on the same integers (no AVX-512 VNNI, or MINIVLLM_CPU_OWN_GEMM=0)."""
    if own and not quant.own_w8a8_kernel():
        pytest.skip("w8a8_linear needs AVX-512 VNNI and BF16")
    monkeypatch.setattr(quant, "own_w8a8_kernel", lambda: own)
    g = torch.Generator().manual_seed(3)
    w = torch.randn(96, 64, generator=g)
    layer = linear_with(w)
    method = quant.W8A8Int8Method()
    method.process_weights_after_loading(layer)
    assert layer.qweight.dim() == (3 if own else 2) and layer.qweight.dtype == (torch.int32 if own else torch.int8)
    x = torch.randn(2, 3, 64, generator=g)
    q, scale = quant.Int8WeightOnlyMethod.quantize(w)
    got = method.apply(layer, x, None)
    assert got.shape == (2, 3, 96) and got.dtype == torch.float32
    torch.testing.assert_close(got.reshape(6, 96).double(), integer_reference(x.reshape(6, 64), q, scale),
                               rtol=1e-6, atol=1e-6)


def test_int8_matmul_gives_torch_int_mms_exact_integers_where_one_float32_sum_would_round():
    """The fallback's blocks of EXACT_K: at the extremes (127 * 127, odd, 2,500 times) the sum passes 2**24, where
    one float32 accumulator may round; the blocked sums are torch._int_mm's integers exactly."""
    g = torch.Generator().manual_seed(5)
    qx = torch.randint(-127, 128, (4, 2500), generator=g, dtype=torch.int8)
    q = torch.randint(-128, 128, (2500, 24), generator=g, dtype=torch.int8)
    qx[0], q[:, 0] = 127, 127                                  # row 0 x column 0: 2,500 x 16,129 = 40,322,500
    qx[1], q[:, 1] = -127, -128
    exact = torch._int_mm(qx, q)
    assert exact[0, 0] == 2500 * 127 * 127 > 2 ** 24            # past float32's exact integers (2**24 + 1 is not one)
    assert torch.equal(quant.int8_matmul(qx, q), exact)


def test_a_layer_whose_in_features_the_kernel_cannot_take_is_refused():
    with pytest.raises(ValueError, match="w8a8_int8' needs in_features divisible by 16; a layer has 40. Use "
                                         "quantization='int8'"):
        quant.W8A8Int8Method().process_weights_after_loading(linear_with(torch.randn(8, 40)))
    if quant.own_w8a8_kernel():
        with pytest.raises(ValueError, match="w4a8_int8' needs in_features divisible by 32; a layer has 48. Use "
                                             "quantization='w8a8_int8'"):
            quant.W4A8Int8Method().process_weights_after_loading(linear_with(torch.randn(8, 48)))


def q4_groups(w):
    """Int4WeightOnlyMethod's groups of w (out, in): q (out, in) uint8, d and m (out, in / 32)."""
    out_features, in_features = w.shape
    q, d, m = quant.Int4WeightOnlyMethod().quantize_groups(w.view(out_features, in_features // 32, 32))
    return q.view(out_features, in_features).to(torch.uint8), d, m


def w4a8_reference(x, q, d, m, bias=None):
    """float64 of sum_g s[r, g] (d[n, g] sum_k q qx + m[n, g] sum_k qx): the group sums as exact integers."""
    qx, s, s_sum = quant.quantize_activation_groups(x)
    rows, groups = s.shape
    dots = torch.einsum("rgk,ngk->rng", qx.view(rows, groups, 32).double(), q.view(-1, groups, 32).double())
    y = (dots * s.double()[:, None] * d.double()[None] + m.double()[None] * s_sum.double()[:, None]).sum(-1)
    return y if bias is None else y + bias.double()


def test_activation_groups_are_rounded_each_with_its_own_scale():
    x = torch.zeros(1, 64)
    x[0, :8] = torch.tensor([127.0, 2.5, -3.5, 0.5, 1.5, -0.5, 0.0, 126.5])      # group 0: s = 1, ties
    x[0, 32:35] = torch.tensor([-2.0, 1.0, 0.25])                                # group 1: s = 2 / 127
    qx, s, s_sum = quant.quantize_activation_groups(x)
    assert qx.dtype == torch.int8 and s.shape == s_sum.shape == (1, 2)
    assert qx[0, :8].tolist() == [127, 2, -4, 0, 2, 0, 0, 126] and qx[0, 32:35].tolist() == [-127, 64, 16]
    assert s[0, 0] == 1 and s[0, 1] == torch.tensor(2.0) / 127
    assert s_sum[0, 0] == 253 and s_sum[0, 1] == s[0, 1] * (-127 + 64 + 16)


@own_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_w4a8_kernel_quantizes_x_to_the_reference_bytes(dtype):
    """An identity weight in int4 groups (q = 15, d = 1 / 15 where the 1 is; d = 1e-12 and q = 0 elsewhere) hands
    back s[r, g] * qx: dividing by each group's s gives the kernel's integers, ties included."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(40, 64, generator=g) * torch.logspace(-3, 3, 40)[:, None]
    x[0, :8] = torch.tensor([127.0, 2.5, -3.5, 0.5, 1.5, -0.5, 4.5, -126.5])
    x = x.to(dtype)
    q, d, m = q4_groups(torch.eye(64))
    y = ops().w4a8_linear(x, *ops().pack_w4a8_linear(q, d, m), 64).float()
    qx, s, _ = quant.quantize_activation_groups(x)
    assert torch.equal(torch.round(y / s.repeat_interleave(32, dim=1)), qx.float())
    assert qx[0, :8].tolist() == [127, 2, -4, 0, 2, 0, 4, -126]


@own_kernel
def test_w4a8_packing_holds_two_word_rows_a_chunk():
    g = torch.Generator().manual_seed(5)
    q = torch.randint(0, 16, (100, 64), generator=g, dtype=torch.uint8)
    d, m = torch.rand(100, 2, generator=g), torch.randn(100, 2, generator=g)
    packed, dm = ops().pack_w4a8_linear(q, d, m)
    assert packed.shape == (3, 8, 192) and packed.dtype == torch.uint8 and dm.shape == (3, 2, 2, 48)
    chunk = packed[1, 2].view(48, 4)                                           # panel 1, word rows 4 and 5
    assert torch.equal(chunk[7] & 15, q[55, 16:20]) and torch.equal(chunk[7] >> 4, q[55, 20:24])
    assert dm[1, 1, 0, 7] == d[55, 1] and dm[1, 1, 1, 7] == m[55, 1] and not dm[2, :, :, 4:].any()
    with pytest.raises(RuntimeError, match="values must be 0..15"):
        ops().pack_w4a8_linear(q + 1, d, m)


@own_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 4, 5, 9, 600])
@pytest.mark.parametrize("out_features,in_features", [(96, 64), (100, 576), (7, 1536)])
def test_the_w4a8_kernel_equals_the_integer_math(dtype, rows, out_features, in_features):
    """Rows cover a partial 4-row tile, one tile, a tile and a row, and two 512-row chunks."""
    g = torch.Generator().manual_seed(rows * out_features + 1)
    q, d, m = q4_groups(torch.randn(out_features, in_features, generator=g) / in_features ** 0.5)
    x = torch.randn(rows, in_features, generator=g).to(dtype)
    b = torch.randn(out_features, generator=g).to(dtype)
    got = ops().w4a8_linear(x, *ops().pack_w4a8_linear(q, d, m), out_features, b)
    assert got.dtype == dtype and got.shape == (rows, out_features)
    want = w4a8_reference(x, q, d, m, b)
    if dtype == torch.float32:
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    else:
        assert ((got.double() - want).abs() <= want.abs() * 2 ** -8 + 1e-5).all()


@own_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_in_the_w4a8_matmul_equals_the_separate_pass(dtype):
    from minivllm.model.layers import SiluAndMul
    n = 100
    g = torch.Generator().manual_seed(6)
    q, d, m = q4_groups(torch.randn(2 * n, 576, generator=g) / 24)
    x = torch.randn(9, 576, generator=g).to(dtype)
    plain = ops().w4a8_linear(x, *ops().pack_w4a8_linear(q, d, m), 2 * n)
    interleaved = [ops().interleave_gate_up(t) for t in (q, d, m)]
    fused = ops().w4a8_linear(x, *ops().pack_w4a8_linear(*interleaved), n, None, True)
    separate = SiluAndMul()(plain)
    if dtype == torch.float32:
        torch.testing.assert_close(fused, separate, rtol=1e-6, atol=1e-6)
    else:
        torch.testing.assert_close(fused.float(), separate.float(), rtol=2 ** -7, atol=1e-3)


def test_w4a8_without_vnni_is_refused_with_the_alternatives(monkeypatch):
    monkeypatch.setattr(quant, "own_w8a8_kernel", lambda: False)
    with pytest.raises(ValueError, match="needs AVX-512 VNNI and BF16 .* Use quantization='int4'"):
        quant.W4A8Int8Method().process_weights_after_loading(linear_with(torch.randn(8, 64)))


METHODS = {"w8a8_int8": quant.W8A8Int8Method, "w4a8_int8": quant.W4A8Int8Method}


@pytest.fixture(scope="module", params=list(METHODS))
def scheme(request, model_dir):
    """(name, minivllm's fp32 model under it, HF's fp32 model with the same roundings)."""
    name = request.param
    if name == "w4a8_int8" and not quant.own_w8a8_kernel():
        pytest.skip("w4a8_int8 needs AVX-512 VNNI and BF16")
    return (name, LLM(str(model_dir), dtype="float32", quantization=name, num_kv_blocks=256),
            hf_with_rounding(model_dir, name, torch.float32))


def hf_with_rounding(model_dir, name, dtype=torch.float64):
    """Hugging Face's model (in `dtype`) with every linear layer (the LM head too) computing F.linear of x rounded
    to int8 by torch's own ops (w8a8_int8: per row; w4a8_int8: per group of 32) and of the quantized weight,
    dequantized (w8a8_int8: int8 per channel; w4a8_int8: d q + m per group of 32): an independent statement of
    the same roundings, with float products in place of integer ones."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    group = 32 if name == "w4a8_int8" else None

    def rounded(x):
        xg = x if group is None else x.unflatten(-1, (-1, group))
        s = (xg.abs().amax(-1, keepdim=True) / 127).clamp(min=1e-12)
        return (torch.round(xg / s) * s).flatten(-2) if group else torch.round(xg / s) * s

    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            w = module.weight.detach()
            if group is None:
                scale = (w.abs().amax(1, keepdim=True) / 127).clamp(min=1e-12)
                wq = torch.round(w / scale).clamp(-128, 127) * scale
            else:
                wg = w.unflatten(1, (-1, group))
                lo = wg.amin(-1, keepdim=True)
                d = ((wg.amax(-1, keepdim=True) - lo) / 15).clamp(min=1e-12)
                wq = (torch.round((wg - lo) / d).clamp(0, 15) * d + lo).flatten(1)
            module.forward = lambda x, wq=wq: F.linear(rounded(x), wq)
    return model


@pytest.mark.slow
def test_every_linear_layer_runs_the_scheme(scheme):
    name, llm, _ = scheme
    model = llm.llm_engine.model_runner.model
    layers = [m for m in model.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear, ParallelLMHead))]
    assert len(layers) == 30 * 4 + 1
    assert all(type(m.quant_method) is METHODS[name] for m in layers)
    if quant.own_w8a8_kernel():
        assert all(m.qweight.dim() == 3 for m in layers)
        assert [m.packed_silu_and_mul for m in layers if hasattr(m, "feeds_silu_and_mul")] == [True] * 30


@pytest.mark.slow
def test_it_is_as_far_from_fp32_as_hf_with_the_same_rounding_is(scheme, hf_model):
    """Teacher-forced over 1,000 tokens of the bench's passages. As with the fp8 cache (tests/test_kv_cache_fp8.py),
    two runs of the same rounding cannot agree bit for bit: a 1e-6 difference between two fp32 sums moves an
    activation across a rounding boundary now and then, and such flips are most of the error. Measured
    2026-11-27, mean |log-prob error| against fp32 and mean NLL (fp32's 2.578): w8a8_int8 minivllm 0.271 and
    2.662, the oracle 0.266 and 2.645 (in float64 0.266 and 2.651, with x scaled by 1 + 1e-6 0.279 and 2.648,
    and as far from minivllm, 0.27-0.30, as from fp32); w4a8_int8 minivllm 0.243 and 2.637, the oracle 0.253
    and 2.643. So the claim is statistical: as far from fp32 as HF with the same rounding, the same mean NLL."""
    from minivllm.bench.passages import PASSAGES
    from tests.test_kv_cache_fp8 import _hf_logprobs, _prompt_logprobs
    name, llm, oracle_model = scheme
    ids = llm.get_tokenizer().encode(" ".join(PASSAGES.values()))[:1000]
    rows, targets = torch.arange(len(ids) - 1), torch.tensor(ids[1:])
    mine = torch.tensor(_prompt_logprobs(llm, ids))
    oracle = _hf_logprobs(oracle_model, ids)[rows, targets]
    exact = _hf_logprobs(hf_model, ids)[rows, targets]
    mine_error, oracle_error = float((mine - exact).abs().mean()), float((oracle - exact).abs().mean())
    print(f"{name}: mean |log-prob error|: minivllm {mine_error:.4f}, HF with the same rounding {oracle_error:.4f}; "
          f"mean NLL {-float(mine.mean()):.4f} against {-float(oracle.mean()):.4f} (fp32 {-float(exact.mean()):.4f})")
    assert 0.85 * oracle_error <= mine_error <= 1.15 * oracle_error, (mine_error, oracle_error)
    assert abs(float(mine.mean() - oracle.mean())) < 0.04                  # the same mean NLL
    assert oracle_error > 0.1                                              # the rounding does matter


@pytest.mark.slow
def test_decode_steps_match_hf_with_the_same_rounding(scheme, hf_model, model_dir):
    """Decode steps (the batched decode path): minivllm's log-probs of its own greedy tokens against HF's, teacher-
    forced on the same tokens. Greedy text cannot be the check: on this 135M model a single rounding flip moves
    a log-prob by about 0.1, and HF with w8a8_int8's rounding in fp32 and in float64 part at the first token on
    3 of the 6 prompts (2026-11-27). So: minivllm is as near the oracle as the oracle in float64 is (w8a8_int8:
    0.116 against 0.112; w4a8_int8, whose groups' scales make smaller steps: 0.032 against 0.039), and as far
    from the unrounded model as the oracle is (0.123 against 0.102; 0.173 against 0.169)."""
    name, llm, oracle_model = scheme
    tok = llm.get_tokenizer()
    prompts = [tok.encode(p, add_special_tokens=False) for p in PROMPTS]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=0), use_tqdm=False)
    oracle64 = hf_with_rounding(model_dir, name, torch.float64)
    mine, lps = [], {"oracle": [], "oracle64": [], "fp32": []}
    for p, out in zip(prompts, outs):
        tokens = out.outputs[0].token_ids
        mine += [out.outputs[0].logprobs[j][t].logprob for j, t in enumerate(tokens)]
        for key, model in (("oracle", oracle_model), ("oracle64", oracle64), ("fp32", hf_model)):
            with torch.no_grad():
                lp = torch.log_softmax(model(torch.tensor([p + list(tokens)])).logits[0].double(), -1)
            lps[key] += [float(lp[len(p) - 1 + j, t]) for j, t in enumerate(tokens)]
    mine, lps = torch.tensor(mine), {k: torch.tensor(v) for k, v in lps.items()}

    def apart(a, b):
        return float((a - b).abs().mean())

    print(f"{name}: mean |log-prob difference|: minivllm-oracle {apart(mine, lps['oracle']):.4f}, oracle-oracle64 "
          f"{apart(lps['oracle'], lps['oracle64']):.4f}; minivllm-fp32 {apart(mine, lps['fp32']):.4f}, "
          f"oracle-fp32 {apart(lps['oracle'], lps['fp32']):.4f}")
    assert apart(mine, lps["oracle"]) <= 1.5 * apart(lps["oracle"], lps["oracle64"]) + 0.01
    assert apart(mine, lps["fp32"]) >= 0.5 * apart(lps["oracle"], lps["fp32"])      # the rounding did happen
    assert apart(lps["oracle"], lps["fp32"]) > 0.02


@pytest.mark.slow
@pytest.mark.parametrize("name", list(METHODS))
def test_a_request_gets_the_same_tokens_alone_and_in_a_batch(model_dir, name):
    """Each row (w8a8_int8) or each row's group (w4a8_int8) is rounded with its own scale and the integer sums are
    exact, so a request's tokens do not depend on what it is batched with (a bf16 model here: every rounding in
    the path is per row)."""
    if name == "w4a8_int8" and not quant.own_w8a8_kernel():
        pytest.skip("w4a8_int8 needs AVX-512 VNNI and BF16")
    llm = LLM(str(model_dir), dtype="bfloat16", quantization=name, num_kv_blocks=256)
    tok = llm.get_tokenizer()
    prompts = [{"prompt_token_ids": tok.encode(p, add_special_tokens=False)} for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    alone = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    assert together == alone
