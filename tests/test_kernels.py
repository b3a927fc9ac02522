"""The Triton kernels equal the plain PyTorch reference (the fp32 oracle) on awkward shapes.

With no GPU the kernels run on CPU tensors through Triton's interpreter (TRITON_INTERPRET=1), in fp32 and
fp16 (bf16 is wrong in the interpreter); on a GPU they run natively, in bf16 too. Every case uses randn
inputs, a shuffled block table (a random permutation of the physical blocks) and a cache whose unused
slots hold NaN, so a kernel that lets one slot too many into its sums fails loudly. (The reference is a
masked matmul, where 0 * NaN is still NaN: it gets the same cache with those NaNs replaced by 0.)

Tolerances against the fp32 reference: fp32 1e-5; fp16 2e-3 (the output itself is rounded to fp16, and
P is rounded to fp16 before the P @ V dot); bf16 1.6e-2.
"""

from __future__ import annotations

import os
import re
import time

import pytest
import torch

if not torch.cuda.is_available():
    # @triton.jit reads this when it decorates, so it must be set before triton is first imported:
    # tests/conftest.py sets it; this line covers running the module on its own.
    os.environ["TRITON_INTERPRET"] = "1"
triton = pytest.importorskip("triton")

from minivllm.model._kernels import kernels  # noqa: E402
from tests.oracle import PROMPTS  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"
if INTERPRET:
    from triton.runtime.interpreter import InterpretedFunction
    if not isinstance(triton.language.max, InterpretedFunction):
        pytest.skip("triton was imported before TRITON_INTERPRET=1 was set, so its kernels cannot run on the "
                    "CPU interpreter in this process; set it first (tests/conftest.py, or the environment).",
                    allow_module_level=True)
ops = kernels.triton_ops
ref = kernels.reference

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
TOL = {F32: 1e-5, F16: 2e-3, BF16: 1.6e-2}
# Low-precision dtypes the device can run: the interpreter gets bf16 wrong.
LOW = [F16] if INTERPRET else [F16, BF16]


def dtype_id(dtype):
    return str(dtype).removeprefix("torch.")


def close(actual, expected, dtype):
    tol = TOL[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=tol)


def make_paged_kv(seq_lens, num_kv_heads, head_dim, block_size, dtype, seed=0):
    """A cache holding each sequence's first seq_len K/V (written by the reference store) at shuffled blocks.

    Returns key_cache, value_cache (num_blocks, block_size, kv_heads, head_dim) and block_tables
    (num_seqs, max_blocks) int32, padded with 0; every slot no sequence owns holds NaN.
    """
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3                         # a few blocks nobody owns
    perm = torch.randperm(num_blocks, generator=g)
    block_tables = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int32)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.full(shape, float("nan"), dtype=dtype)
    value_cache = torch.full(shape, float("nan"), dtype=dtype)
    used = 0
    for i, (n, nb) in enumerate(zip(seq_lens, blocks_per_seq)):
        block_tables[i, :nb] = perm[used:used + nb].int()
        used += nb
        pos = torch.arange(n)
        slots = block_tables[i, pos // block_size].long() * block_size + pos % block_size
        k = torch.randn(n, num_kv_heads, head_dim, generator=g).to(dtype)
        v = torch.randn(n, num_kv_heads, head_dim, generator=g).to(dtype)
        ref.store_kv_cache(k, v, key_cache, value_cache, slots)
    return key_cache.to(DEVICE), value_cache.to(DEVICE), block_tables.to(DEVICE)


def finite(cache):
    """The reference's copy of a cache: fp32 on the CPU, unowned slots 0 (as the engine's zeroed cache)."""
    return cache.cpu().float().nan_to_num(0.0)


# --------------------------------------------------------------------------------------- store_kv_cache

@pytest.mark.parametrize("num_kv_heads, head_dim, block_size, dtype", [
    (3, 64, 16, F32), (2, 64, 32, F16), (1, 32, 16, F32), (4, 128, 32, F16), (3, 80, 16, F32),
], ids=["kv3_d64_bs16_f32", "kv2_d64_bs32_f16", "kv1_d32_bs16_f32", "kv4_d128_bs32_f16", "kv3_d80_bs16_f32"])
def test_store_kv_cache_writes_each_slot_and_skips_padding(num_kv_heads, head_dim, block_size, dtype):
    g = torch.Generator().manual_seed(1)
    num_tokens, num_blocks = 37, 5
    # K and V as the model makes them: non-contiguous views of one fused projection.
    kv = torch.randn(num_tokens, 2, num_kv_heads, head_dim, generator=g).to(dtype)
    key, value = kv[:, 0], kv[:, 1]
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    slots[[0, 5, 36]] = -1                                      # padding
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    expected_k = torch.full(shape, float("nan"), dtype=dtype)
    expected_v = expected_k.clone()
    ref.store_kv_cache(key, value, expected_k, expected_v, slots)
    key_cache, value_cache = (torch.full(shape, float("nan"), dtype=dtype, device=DEVICE) for _ in range(2))
    ops.store_kv_cache(key.to(DEVICE), value.to(DEVICE), key_cache, value_cache, slots.to(DEVICE))
    # A copy is exact; slots nobody wrote (the -1 tokens' included) still hold NaN.
    torch.testing.assert_close(key_cache.cpu(), expected_k, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(value_cache.cpu(), expected_v, atol=0, rtol=0, equal_nan=True)
    assert int(key_cache.isnan().any(-1).any(-1).sum()) == num_blocks * block_size - (num_tokens - 3)


# --------------------------------------------------------------------------------------- decode

# (seq_lens, num_heads, num_kv_heads, head_dim, block_size, num_splits): a pruned cross of the axes.
# Splits of 4 and 8 over lengths 1 and 17 leave some splits with no tokens at all.
DECODE_CASES = [
    ([1, 17, 37, 300], 4, 4, 64, 16, 1),        # GQA 1
    ([1, 17, 37, 300], 4, 4, 64, 16, 4),
    ([1, 17, 37, 300], 9, 3, 64, 32, 1),        # GQA 3, the default model's shape
    ([1, 17, 37, 300], 9, 3, 64, 32, 3),
    ([300, 37], 8, 2, 64, 16, 8),               # GQA 4
    ([17, 300], 8, 2, 64, 32, None),            # the default rule
    ([37, 5], 4, 2, 32, 16, 2),                 # head_dim 32
    ([37, 1], 4, 1, 128, 16, 2),                # head_dim 128
    ([17], 2, 1, 80, 16, 1),                    # head_dim not a power of two: padded and masked
]


def _decode_id(case):
    seq_lens, h, kvh, d, bs, splits = case
    return f"lens{'-'.join(map(str, seq_lens))}_gqa{h // kvh}_d{d}_bs{bs}_splits{splits}"


@pytest.mark.parametrize("dtype", [F32, *LOW], ids=dtype_id)
@pytest.mark.parametrize("case", DECODE_CASES, ids=_decode_id)
def test_paged_decode_attention_matches_reference(case, dtype):
    seq_lens, num_heads, num_kv_heads, head_dim, block_size, num_splits = case
    key_cache, value_cache, block_tables = make_paged_kv(seq_lens, num_kv_heads, head_dim, block_size, dtype)
    query = torch.randn(len(seq_lens), num_heads, head_dim, generator=torch.Generator().manual_seed(2))
    query = query.to(dtype).to(DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    scale = head_dim ** -0.5
    out = ops.paged_decode_attention(query, key_cache, value_cache, block_tables, lens, scale,
                                     num_splits=num_splits)
    assert out.shape == query.shape and out.dtype == dtype
    expected = ref.paged_decode_attention(query.cpu().float(), finite(key_cache), finite(value_cache),
                                          block_tables.cpu(), lens.cpu(), scale)
    close(out.cpu(), expected, dtype)


def test_split_rule_splits_only_small_batches_with_long_contexts():
    cpu = torch.device("cpu")
    assert ops.choose_num_splits(1, 8, 4096, cpu) > 1             # 8 programs leave the GPU idle
    assert ops.choose_num_splits(1, 8, 100, cpu) == 1              # too short to be worth a merge
    assert ops.choose_num_splits(64, 8, 4096, cpu) == 1            # 512 programs fill it already
    assert ops.choose_num_splits(1, 1, 10 ** 6, cpu) == ops.MAX_SPLITS


# --------------------------------------------------------------------------------------- prefill

# (q_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size): one flat batch each.
# seq_len > q_len is cached context (a prefix-cache hit, or the earlier chunks of a chunked prefill).
PREFILL_CASES = [
    ([1, 17, 37], [1, 17, 37], 4, 4, 64, 16),                   # plain prefills, GQA 1
    ([5, 37, 1], [300, 37, 17], 9, 3, 64, 32),                  # prefix context; a decode rides along
    ([64, 17, 3, 1], [300, 81, 40, 1], 8, 2, 64, 16),           # chunked: different q_len, GQA 4
    ([300], [300], 2, 1, 64, 32),                               # one long prompt: many query tiles
    ([20, 7], [37, 7], 4, 2, 32, 16),                           # head_dim 32
    ([9, 17], [17, 40], 4, 1, 128, 32),                         # head_dim 128
]


def _prefill_id(case):
    q_lens, seq_lens, h, kvh, d, bs = case
    return f"q{'-'.join(map(str, q_lens))}_kv{'-'.join(map(str, seq_lens))}_gqa{h // kvh}_d{d}_bs{bs}"


@pytest.mark.parametrize("dtype", [F32, *LOW], ids=dtype_id)
@pytest.mark.parametrize("case", PREFILL_CASES, ids=_prefill_id)
def test_paged_prefill_attention_matches_reference(case, dtype):
    q_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size = case
    key_cache, value_cache, block_tables = make_paged_kv(seq_lens, num_kv_heads, head_dim, block_size, dtype)
    query = torch.randn(sum(q_lens), num_heads, head_dim, generator=torch.Generator().manual_seed(3))
    query = query.to(dtype).to(DEVICE)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    scale = head_dim ** -0.5
    # Half the dtypes pass max_q_len from the host, half let the wrapper find it.
    max_q_len = max(q_lens) if dtype == F32 else None
    out = ops.paged_prefill_attention(query, key_cache, value_cache, block_tables, cu, lens, scale,
                                      max_q_len=max_q_len)
    assert out.shape == query.shape and out.dtype == dtype
    expected = ref.paged_prefill_attention(query.cpu().float(), finite(key_cache), finite(value_cache),
                                           block_tables.cpu(), cu.cpu(), lens.cpu(), scale)
    close(out.cpu(), expected, dtype)


# --------------------------------------------------------------------------------------- RMSNorm

RMS_CASES = {"hidden+residual": ((5, 576), True), "hidden": ((5, 576), False), "odd width+residual": ((3, 1000), True),
             "per-head (q_norm)": ((7, 16, 128), False), "strided per-head": ((7, 16, 128), "strided")}


@pytest.mark.parametrize("dtype", [F32] + LOW, ids=dtype_id)
@pytest.mark.parametrize("case", list(RMS_CASES))
def test_rms_norm_equals_the_models_own_rmsnorm(case, dtype):
    """The fused kernel against layers.RMSNorm.forward_native (the PyTorch code the model runs otherwise)."""
    from minivllm.model.layers import RMSNorm

    shape, residual = RMS_CASES[case]
    gen = torch.Generator().manual_seed(0)
    norm = RMSNorm(shape[-1], 1e-6)
    norm.weight.data = 1 + 0.1 * torch.randn(shape[-1], generator=gen)
    norm = norm.to(DEVICE, dtype)
    if residual == "strided":     # a view into a wider buffer, as q is a slice of the fused qkv projection
        x = (3 * torch.randn(shape[0], shape[1] + 8, shape[2], generator=gen)).to(DEVICE, dtype)[:, :shape[1]]
        residual = None
    else:
        x = (3 * torch.randn(shape, generator=gen)).to(DEVICE, dtype)
    r = (3 * torch.randn(shape, generator=gen)).to(DEVICE, dtype) if residual else None
    got = ops.rms_norm(x, norm.weight, norm.eps, r)
    expected = norm.forward_native(x, r)
    if r is None:
        got, expected = (got,), (expected,)
    for g, e in zip(got, expected):
        assert g.shape == e.shape and g.dtype == e.dtype
        torch.testing.assert_close(g, e, atol=TOL[dtype], rtol=TOL[dtype])


def test_rms_norm_refuses_mismatched_shapes():
    x = torch.zeros(4, 64, device=DEVICE)
    with pytest.raises(ValueError, match=r"weight must be \(x.shape\[-1\],\)"):
        ops.rms_norm(x, torch.ones(32, device=DEVICE), 1e-6)


def test_custom_ops_switch_reads_as_vllms_custom_ops():
    from minivllm.model.custom_op import _custom_ops
    assert _custom_ops("") == _custom_ops("all") == _custom_ops("+rms_norm") == {"rms_norm"}    # on by default
    assert _custom_ops("none") == _custom_ops("-rms_norm") == _custom_ops("all,-rms_norm") == frozenset()
    assert _custom_ops("none,+rms_norm") == {"rms_norm"}
    for bad in ("rms_norm", "+layer_norm", "all,none"):
        with pytest.raises(ValueError, match=rf"MINIVLLM_CUSTOM_OPS is '{re.escape(bad)}'; give 'all' \(the default\) or "
                                             r"'none', then \+op to turn one on or -op to turn one off, from: rms_norm"):
            _custom_ops(bad)


# --------------------------------------------------------------------------------------- the engine

@pytest.mark.slow
def test_engine_with_triton_backend_gives_the_torch_backends_greedy_tokens(model_dir):
    """30 layers under the interpreter: 2 prompts x 4 tokens (a prefill step and three decode steps) takes
    about 20 s on 2 CPU cores."""
    from minivllm import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompts = PROMPTS[:2]

    def greedy_tokens(backend):
        llm = LLM(str(model_dir), device=DEVICE, dtype="float32", attention_backend=backend, num_kv_blocks=64)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    expected = greedy_tokens("torch")
    start = time.perf_counter()
    got = greedy_tokens("triton")
    print(f"triton backend: 2 prompts x 4 tokens in {time.perf_counter() - start:.1f} s")
    assert got == expected
