"""Triton kernels for paged attention and the KV store, with their Python wrappers.

Each kernel follows the same arc: the math in plain PyTorch (`reference.py`, also the test oracle) -> the
kernel here -> its wrapper here (same signature as the reference) -> `tests/test_kernels.py` (kernel vs
reference on awkward shapes, on CPU under TRITON_INTERPRET=1) -> `python -m minivllm.bench kernels` (GPU).

    store_kv_cache           key/value (num_tokens, num_kv_heads, head_dim) -> their cache slots.
                             A few tokens per program; slot -1 (padding) writes nothing.
    paged_decode_attention   one query token per sequence against its seq_len cached tokens.
                             One program per (sequence, KV head, split): it holds the whole group of query
                             heads sharing that KV head (GQA), so each KV tile is read once per group.
                             With num_splits > 1 (flash-decoding) each program covers a slice of the context
                             and writes a partial (max, sum, acc); `_merge_splits_kernel` combines them.
    paged_prefill_attention  causal attention for a flat batch; sequence i's q_len_i new tokens are its last
                             q_len_i positions, so prefix-cached context and chunked prefill need nothing extra.
                             One program per (query tile, query head, sequence).
    rms_norm                 x (+ residual) -> RMSNorm, one row per program: the 8 small PyTorch kernels
                             of an add + RMSNorm in one launch (layers.RMSNorm uses it on CUDA unless
                             MINIVLLM_CUSTOM_OPS is "none" or "-rms_norm"; on an H100 it took a graph-
                             replayed decode step at batch 64 from 8.65 to 7.35 ms).

Layouts (as in kernels/__init__.py; the last dimension of every tensor must be contiguous):
    key_cache, value_cache   (num_blocks, block_size, num_kv_heads, head_dim), same strides
    block_tables             (num_seqs, max_blocks_per_seq) int32: token t of sequence i lives in
                             cache[block_tables[i, t // block_size], t % block_size]
    seq_lens                 (num_seqs,) int32, KV length including the new tokens
    cu_seqlens_q             (num_seqs + 1,) int32, query row offsets

fp8 KV cache (kv_cache_dtype="fp8"): the cache is torch.float8_e4m3fn and the store writes x / scale; the
attention kernels convert each loaded K/V tile to the query's dtype (exact: every e4m3 value is an fp16 and
a bf16 value) and fold k_scale into the score scale and v_scale into the output, as reference.py does.

Precision: softmax statistics and accumulators are fp32; scores use exp2 with scale * log2(e) folded in.
Dots take the cache's dtype (fp16/bf16 tensor cores on a GPU, fp32 accumulation); fp32 dots are exact
("ieee", not tf32). bf16 is wrong in Triton's CPU interpreter, so there bf16 loads are upcast to fp32 first.

On a CPU the kernels run under Triton's interpreter: TRITON_INTERPRET=1 must be set before triton is first
imported (@triton.jit, triton's own library included, reads it when decorating). The wrappers call no
CUDA-only API, so the same code serves CPU tensors there and CUDA tensors on a GPU.

Tile sizes are chosen by a rule, not @triton.autotune (which needs a GPU). head_dim need not be a power of
two: tiles are padded to one and masked. Slots past seq_len are never read: even NaN there is harmless.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634        # exp(x) == exp2(x * log2(e))
MIN_TOKENS_PER_SPLIT = 256          # a split-KV slice shorter than this costs more in merging than it saves
MAX_SPLITS = 32


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _pow2(n: int, at_least: int = 1) -> int:
    return max(at_least, triton.next_power_of_2(n))


def _check_cache(key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    if key_cache.shape != value_cache.shape or key_cache.stride() != value_cache.stride():
        raise ValueError(f"key_cache {tuple(key_cache.shape)} / {key_cache.stride()} and value_cache "
                         f"{tuple(value_cache.shape)} / {value_cache.stride()} must share one layout.")
    if key_cache.stride(-1) != 1:
        raise ValueError(f"the caches' head_dim must be contiguous (stride {key_cache.stride(-1)}).")


def _upcast(dtype: torch.dtype) -> bool:
    """Load as fp32 before any math: only needed for bf16 under the CPU interpreter (FACTS.md)."""
    return dtype == torch.bfloat16 and _interpreting()


# ---------------------------------------------------------------------------------------------- KV store

@triton.jit
def _round_to_e4m3_grid(x):
    """x (fp32, already within +-448) rounded to the nearest e4m3 value (ties to even), in fp32 arithmetic.

    Only under the CPU interpreter: its fp32 -> fp8 cast rounds half up and loses the carry when rounding
    crosses a power of two (31.0 -> 16, where a GPU's cvt gives 32). After this rounding the cast is exact.
    e4m3 keeps 3 mantissa bits: the spacing of its values near x is 2^(exponent(x) - 3), never below 2^-9
    (the subnormals, under 2^-6)."""
    exponent = ((x.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127            # floor(log2 |x|); -127 for 0
    step = ((tl.maximum(exponent, -6) - 3 + 127) << 23).to(tl.float32, bitcast=True)   # 2^(e - 3), exact
    r = x / step                                                                 # exact: step is a power of 2
    r = (r + 12582912.0) - 12582912.0                                            # round to an integer, ties even
    return r * step                                                              # (1.5 * 2^23 trick, |r| <= 16)


@triton.jit
def _store_kv_cache_kernel(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_mapping_ptr,
    stride_k_tok, stride_k_head, stride_v_tok, stride_v_head,
    stride_c_block, stride_c_slot, stride_c_head,
    num_tokens, num_kv_heads, head_dim, k_scale, v_scale,
    BLOCK_SIZE: tl.constexpr, BLOCK_T: tl.constexpr, HEADS_P2: tl.constexpr, HEAD_DIM_P2: tl.constexpr,
    KV_FP8: tl.constexpr, ROUND_IN_FP32: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)                  # this program's tokens
    slot = tl.load(slot_mapping_ptr + t, mask=t < num_tokens, other=-1).to(tl.int64)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    h = tl.arange(0, HEADS_P2)
    d = tl.arange(0, HEAD_DIM_P2)
    t3, h3, d3 = t[:, None, None], h[None, :, None], d[None, None, :]        # (BLOCK_T, HEADS_P2, HEAD_DIM_P2)
    mask = (slot >= 0)[:, None, None] & (h3 < num_kv_heads) & (d3 < head_dim)   # slot -1: padding, skipped
    k = tl.load(key_ptr + t3 * stride_k_tok + h3 * stride_k_head + d3, mask=mask)
    v = tl.load(value_ptr + t3 * stride_v_tok + h3 * stride_v_head + d3, mask=mask)
    if KV_FP8:                       # as reference.quantize_fp8: scale, saturate at e4m3's largest value
        k = tl.clamp(k.to(tl.float32) / k_scale, -448.0, 448.0)
        v = tl.clamp(v.to(tl.float32) / v_scale, -448.0, 448.0)
        if ROUND_IN_FP32:
            k = _round_to_e4m3_grid(k)
            v = _round_to_e4m3_grid(v)
    dst = (block[:, None, None] * stride_c_block + offset[:, None, None] * stride_c_slot
           + h3 * stride_c_head + d3)
    tl.store(key_cache_ptr + dst, k.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(value_cache_ptr + dst, v.to(value_cache_ptr.dtype.element_ty), mask=mask)


def store_kv_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                   value_cache: torch.Tensor, slot_mapping: torch.Tensor,
                   k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Write each new token's K and V into its cache slot; slots of -1 are padding and skipped.

    key, value (num_tokens, num_kv_heads, head_dim), any token/head strides; caches are written in place.
    An fp8 (e4m3) cache stores K / k_scale and V / v_scale, saturated at +-448; other caches ignore the scales.
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    _check_cache(key_cache, value_cache)
    if key.stride(-1) != 1 or value.stride(-1) != 1:
        raise ValueError("key and value must be contiguous along head_dim.")
    if key_cache.shape[2:] != (num_kv_heads, head_dim):
        raise ValueError(f"key has {num_kv_heads} heads of {head_dim}; the cache holds "
                         f"{tuple(key_cache.shape[2:])}.")
    if key_cache.dtype == torch.float8_e4m3fn:
        check_fp8_supported(key.device)
    if num_tokens == 0:
        return
    heads_p2, head_dim_p2 = _pow2(num_kv_heads), _pow2(head_dim)
    block_t = min(_pow2(num_tokens), max(1, 4096 // (heads_p2 * head_dim_p2)))   # ~4096 elements a program
    _store_kv_cache_kernel[(triton.cdiv(num_tokens, block_t),)](
        key, value, key_cache, value_cache, slot_mapping.contiguous(),
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        num_tokens, num_kv_heads, head_dim, float(k_scale), float(v_scale),
        BLOCK_SIZE=key_cache.shape[1], BLOCK_T=block_t, HEADS_P2=heads_p2, HEAD_DIM_P2=head_dim_p2,
        KV_FP8=key_cache.dtype == torch.float8_e4m3fn, ROUND_IN_FP32=_interpreting(),
    )


# ---------------------------------------------------------------------------------------------- decode

@triton.jit
def _paged_decode_kernel(
    out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr,
    q_ptr, key_cache_ptr, value_cache_ptr, block_tables_ptr, seq_lens_ptr,
    scale_log2e, v_scale,
    stride_q_seq, stride_q_head, stride_o_seq, stride_o_head,
    stride_c_block, stride_c_slot, stride_c_head, stride_bt_seq,
    num_heads, group_size, head_dim,
    BLOCK_SIZE: tl.constexpr, GROUP_P2: tl.constexpr, HEAD_DIM_P2: tl.constexpr,
    BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, UPCAST: tl.constexpr, KV_FP8: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    # This program's slice of the context, whole BLOCK_N tiles; a split past seq_len is empty.
    tokens_per_split = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, seq_len)

    g = tl.arange(0, GROUP_P2)                       # query heads of this KV head, padded
    d = tl.arange(0, HEAD_DIM_P2)
    head = kv_head * group_size + g
    g_mask = g < group_size
    d_mask = d < head_dim
    q = tl.load(q_ptr + seq.to(tl.int64) * stride_q_seq + head[:, None] * stride_q_head + d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)           # (GROUP_P2, HEAD_DIM_P2)
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([GROUP_P2], float("-inf"), tl.float32)                    # running max (log2 units)
    l_i = tl.zeros([GROUP_P2], tl.float32)                                  # running sum of exp2
    acc = tl.zeros([GROUP_P2, HEAD_DIM_P2], tl.float32)                     # running sum of p * v
    block_table = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq
    for tile_start in range(start, end, BLOCK_N):
        tok = tile_start + tl.arange(0, BLOCK_N)
        t_mask = tok < end
        block = tl.load(block_table + tok // BLOCK_SIZE, mask=t_mask, other=0).to(tl.int64)
        kv_off = (block[:, None] * stride_c_block + (tok % BLOCK_SIZE)[:, None] * stride_c_slot
                  + kv_head * stride_c_head + d[None, :])                    # (BLOCK_N, HEAD_DIM_P2)
        kv_mask = t_mask[:, None] & d_mask[None, :]
        k = tl.load(key_cache_ptr + kv_off, mask=kv_mask, other=0.0)
        v = tl.load(value_cache_ptr + kv_off, mask=kv_mask, other=0.0)    # masked: unwritten slots may be NaN
        if KV_FP8:                   # e4m3 -> fp16 is one instruction on sm_89+ and exact (so is fp16 -> bf16)
            k = k.to(tl.float16)
            v = v.to(tl.float16)
        k = k.to(q.dtype)            # -> the query's dtype; bf16 -> fp32 when UPCAST; else a no-op
        v = v.to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale_log2e    # (GROUP_P2, BLOCK_N)
        s = tl.where(t_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)                                         # rescales the old sums
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new

    # v_scale: an fp8 cache's V scale (1.0 otherwise), applied once per row with the softmax's 1 / l
    if NUM_SPLITS == 1:
        out = acc * (v_scale / tl.where(l_i == 0.0, 1.0, l_i))[:, None]
        tl.store(out_ptr + seq.to(tl.int64) * stride_o_seq + head[:, None] * stride_o_head + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])
    else:
        # Partials (num_seqs, num_heads, NUM_SPLITS[, head_dim]), contiguous; acc is not yet divided by l.
        row = (seq.to(tl.int64) * num_heads + head) * NUM_SPLITS + split    # (GROUP_P2,)
        tl.store(part_m_ptr + row, m_i, mask=g_mask)
        tl.store(part_l_ptr + row, l_i, mask=g_mask)
        tl.store(part_acc_ptr + row[:, None] * head_dim + d[None, :], acc * v_scale,       # (linear: merges as is)
                 mask=g_mask[:, None] & d_mask[None, :])


@triton.jit
def _merge_splits_kernel(
    out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr,
    stride_o_seq, stride_o_head, num_heads, head_dim,
    NUM_SPLITS: tl.constexpr, SPLITS_P2: tl.constexpr, HEAD_DIM_P2: tl.constexpr,
):
    """Softmax over the whole context from per-split partials (m_s in log2 units, acc_s not yet divided):
    out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s,  M = max_s m_s."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, SPLITS_P2)
    d = tl.arange(0, HEAD_DIM_P2)
    s_mask = s < NUM_SPLITS
    d_mask = d < head_dim
    row = (seq.to(tl.int64) * num_heads + head) * NUM_SPLITS + s             # (SPLITS_P2,)
    m = tl.load(part_m_ptr + row, mask=s_mask, other=float("-inf"))
    l = tl.load(part_l_ptr + row, mask=s_mask, other=0.0)
    acc = tl.load(part_acc_ptr + row[:, None] * head_dim + d[None, :],
                  mask=s_mask[:, None] & d_mask[None, :], other=0.0)         # (SPLITS_P2, HEAD_DIM_P2)
    m_max = tl.max(m, axis=0)
    w = tl.where(m == float("-inf"), 0.0, tl.exp2(m - m_max))               # an empty split weighs nothing
    l_total = tl.sum(w * l, axis=0)
    out = tl.sum(w[:, None] * acc, axis=0) / tl.where(l_total == 0.0, 1.0, l_total)
    tl.store(out_ptr + seq.to(tl.int64) * stride_o_seq + head * stride_o_head + d,
             out.to(out_ptr.dtype.element_ty), mask=d_mask)


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132       # off a GPU (the interpreter), choose as an H100 would


def _target_arch(device: torch.device) -> int:
    """The compute capability the kernels are compiled for, as 80, 90, ...: the GPU's own for a CUDA tensor;
    off a GPU, the target of a driver someone made active (aot.py's stub, compiling for sm_80 or sm_90), else
    90 (choose as an H100 would, like _num_sms)."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return 10 * major + minor
    from triton.runtime.driver import driver
    active = driver._active                   # never create one here: off a GPU that raises
    arch = getattr(active.get_current_target(), "arch", None) if active is not None else None
    return arch if isinstance(arch, int) else 90


def choose_num_stages(kernel: str, head_dim_p2: int, block_m: int | None, arch: int, dtype: torch.dtype,
                      query_dtype: torch.dtype | None = None) -> int:
    """Software pipelining depth of the loop over KV tiles (Triton's num_stages; its default is 3).

    With 2 stages the loop keeps two K/V tiles in shared memory: while tile j is multiplied and
    softmaxed, the asynchronous copy (cp.async on sm_80, TMA-less async copies on sm_90) of tile j+1 is in
    flight. That overlap is what a memory-bound decode loop needs. Compiled ahead of time (kernels/aot.py,
    fp16, GQA 4, block size 16), a third stage adds no third K/V buffer, only a 256 B prefetch of block-table
    entries, while costing registers (sm_80 decode, head_dim 128: 96 registers at 2 stages, 113 at 3), so 2.
    One exception: sm_80's full prefill tile at head_dim 128 (BLOCK_M 64) holds a 64 x 128 fp32 accumulator,
    64 x 64 scores and the Q fragments in registers (mma.sync) and spills 96-120 B at 2-3 stages; with 1
    stage it does not spill (255 registers, 40 KB of shared memory). That tile is compute-bound, so losing
    the copy overlap costs less there than spilling in the inner loop. sm_90 keeps 2 (wgmma takes its
    operands from shared memory and does not spill). The lesson on paged attention shows these numbers.
    An fp32 cache keeps Triton's default, 3: its dots are FMA loops over operands in registers (no tensor
    cores), it is the GPU's correctness oracle rather than its fast path, and its known spills were measured
    at 3 (tests/test_kernels_aot.py lists them).
    An fp8 cache (`dtype` is the cache's; sm_89 and newer: Triton has no e4m3 before) under fp16 queries keeps 2
    (no spill at 1, 2 or 3 stages on sm_90). Under bf16 queries, where each tile goes e4m3 -> fp16 -> bf16,
    ptxas held most tiles to 128 registers and spilled 16-28 B in some configuration at 2 stages and at 3
    (decode and the 16-row prefill tile, head_dim 64 and 128), and in none at 1: so 1 there. Its tiles are
    a quarter of fp32's bytes, so one buffer is still 12 KB of K and V a step of the loop.
    """
    if dtype == torch.float32:
        return 3
    if dtype == torch.float8_e4m3fn and query_dtype == torch.bfloat16:
        return 1
    if kernel == "prefill" and block_m == 64 and head_dim_p2 >= 128 and arch < 90:
        return 1
    return 2


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_context: int, device: torch.device) -> int:
    """Split the context only when (sequence, KV head) programs alone leave the GPU's SMs idle.

    Aim for about two programs per SM, with slices of at least MIN_TOKENS_PER_SPLIT tokens.
    """
    programs = num_seqs * num_kv_heads
    want = triton.cdiv(2 * _num_sms(device), programs)
    most = triton.cdiv(max_context, MIN_TOKENS_PER_SPLIT)
    return max(1, min(want, most, MAX_SPLITS))


def check_fp8_supported(device: torch.device) -> None:
    """Triton has e4m3 (its fp8e4nv) only from compute capability 8.9 (Ada, Hopper): an A100 cannot hold an fp8
    cache here. (Off a GPU, the interpreter and the sm_90 compile both can.)"""
    arch = _target_arch(device)
    if arch < 89:
        raise ValueError(f"kv_cache_dtype='fp8' needs a GPU of compute capability 8.9 or newer for the Triton "
                         f"kernels (Triton has no e4m3 type on sm_{arch}); use kv_cache_dtype='auto' on this GPU.")


def _check_attention_inputs(query: torch.Tensor, key_cache: torch.Tensor,
                            value_cache: torch.Tensor) -> tuple[int, int]:
    """Shared checks of both attention wrappers; returns (block_size, num_kv_heads)."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    _check_cache(key_cache, value_cache)
    if key_cache.dtype == torch.float8_e4m3fn:
        check_fp8_supported(query.device)
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not divide into {num_kv_heads} KV heads.")
    if key_cache.shape[3] != head_dim or query.stride(-1) != 1:
        raise ValueError(f"query head_dim {head_dim} (stride {query.stride(-1)}) must match the cache's "
                         f"{key_cache.shape[3]} and be contiguous.")
    return block_size, num_kv_heads


def paged_decode_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           num_splits: int | None = None, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """One query token per sequence attends to all of its seq_len cached tokens.

    query (num_seqs, num_heads, head_dim) -> (num_seqs, num_heads, head_dim)
    num_splits: slices of the context per (sequence, KV head); None picks one with `choose_num_splits`
    from block_tables' width (an upper bound on the context that needs no device sync).
    k_scale, v_scale: an fp8 cache's scales, folded into the score scale and the output (no per-element work).
    """
    num_seqs, num_heads, head_dim = query.shape
    block_size, num_kv_heads = _check_attention_inputs(query, key_cache, value_cache)
    group_size = num_heads // num_kv_heads
    out = torch.empty((num_seqs, num_heads, head_dim), dtype=query.dtype, device=query.device)
    if num_seqs == 0:
        return out
    block_tables = block_tables.contiguous()
    seq_lens = seq_lens.contiguous()
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs, num_kv_heads, block_tables.shape[1] * block_size,
                                       query.device)
    head_dim_p2 = _pow2(head_dim, 16)                # tl.dot needs every dimension >= 16
    block_n = 64 if head_dim_p2 <= 128 else 32
    if num_splits > 1:
        part_m = torch.empty((num_seqs, num_heads, num_splits), dtype=torch.float32, device=query.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty((num_seqs, num_heads, num_splits, head_dim), dtype=torch.float32,
                               device=query.device)
    else:
        part_m = part_l = part_acc = out             # unused
    _paged_decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        out, part_m, part_l, part_acc,
        query, key_cache, value_cache, block_tables, seq_lens,
        scale * k_scale * LOG2E, float(v_scale),
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), block_tables.stride(0),
        num_heads, group_size, head_dim,
        BLOCK_SIZE=block_size, GROUP_P2=_pow2(group_size, 16), HEAD_DIM_P2=head_dim_p2,
        BLOCK_N=block_n, NUM_SPLITS=num_splits, UPCAST=_upcast(query.dtype),
        KV_FP8=key_cache.dtype == torch.float8_e4m3fn, num_warps=4,
        num_stages=choose_num_stages("decode", head_dim_p2, None, _target_arch(query.device), key_cache.dtype,
                                     query.dtype),
    )
    if num_splits > 1:
        _merge_splits_kernel[(num_seqs, num_heads)](
            out, part_m, part_l, part_acc,
            out.stride(0), out.stride(1), num_heads, head_dim,
            NUM_SPLITS=num_splits, SPLITS_P2=_pow2(num_splits), HEAD_DIM_P2=head_dim_p2, num_warps=4,
        )
    return out


# ---------------------------------------------------------------------------------------------- prefill

@triton.jit
def _paged_prefill_kernel(
    out_ptr, q_ptr, key_cache_ptr, value_cache_ptr, block_tables_ptr, cu_seqlens_q_ptr, seq_lens_ptr,
    scale_log2e, v_scale,
    stride_q_tok, stride_q_head, stride_o_tok, stride_o_head,
    stride_c_block, stride_c_slot, stride_c_head, stride_bt_seq,
    group_size, head_dim,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM_P2: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr, KV_FP8: tl.constexpr,
):
    tile = tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.program_id(2)
    q_start = tl.load(cu_seqlens_q_ptr + seq).to(tl.int64)
    q_len = (tl.load(cu_seqlens_q_ptr + seq + 1) - q_start).to(tl.int32)
    if tile * BLOCK_M >= q_len:                      # this sequence has fewer query tiles than the longest
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context = seq_len - q_len                        # tokens cached before this step's new ones
    kv_head = head // group_size

    r = tile * BLOCK_M + tl.arange(0, BLOCK_M)      # query rows of this tile, within the sequence
    d = tl.arange(0, HEAD_DIM_P2)
    r_mask = r < q_len
    d_mask = d < head_dim
    pos = context + r                                # each row's position: it sees keys 0 .. pos
    q_off = (q_start + r)[:, None] * stride_q_tok + head * stride_q_head + d[None, :]
    q = tl.load(q_ptr + q_off, mask=r_mask[:, None] & d_mask[None, :], other=0.0)  # (BLOCK_M, HEAD_DIM_P2)
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P2], tl.float32)
    kv_end = tl.minimum(seq_len, context + (tile + 1) * BLOCK_M)    # the tile's last row sees up to here
    block_table = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq
    for tile_start in range(0, kv_end, BLOCK_N):
        tok = tile_start + tl.arange(0, BLOCK_N)
        t_mask = tok < kv_end
        block = tl.load(block_table + tok // BLOCK_SIZE, mask=t_mask, other=0).to(tl.int64)
        kv_off = (block[:, None] * stride_c_block + (tok % BLOCK_SIZE)[:, None] * stride_c_slot
                  + kv_head * stride_c_head + d[None, :])                    # (BLOCK_N, HEAD_DIM_P2)
        kv_mask = t_mask[:, None] & d_mask[None, :]
        k = tl.load(key_cache_ptr + kv_off, mask=kv_mask, other=0.0)
        v = tl.load(value_cache_ptr + kv_off, mask=kv_mask, other=0.0)
        if KV_FP8:                   # as in the decode kernel
            k = k.to(tl.float16)
            v = v.to(tl.float16)
        k = k.to(q.dtype)
        v = v.to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale_log2e    # (BLOCK_M, BLOCK_N)
        causal = t_mask[None, :] & (tok[None, :] <= pos[:, None])
        s = tl.where(causal, s, float("-inf"))      # every row sees key 0, so each row's max is finite
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new

    out = acc * (v_scale / tl.where(l_i == 0.0, 1.0, l_i))[:, None]            # v_scale: as in the decode kernel
    o_off = (q_start + r)[:, None] * stride_o_tok + head * stride_o_head + d[None, :]
    tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=r_mask[:, None] & d_mask[None, :])


def paged_prefill_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                            block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor,
                            scale: float, max_q_len: int | None = None,
                            k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """Causal attention for a flat batch of sequences, each with q_len new tokens at the end of its KV.

    query (num_tokens, num_heads, head_dim) -> (num_tokens, num_heads, head_dim)
    The new tokens' K/V must already be in the cache (store_kv_cache first). max_q_len, the longest q_len,
    sizes the grid; pass it from the host to avoid a device sync. k_scale, v_scale: as paged_decode_attention.
    """
    num_tokens, num_heads, head_dim = query.shape
    block_size, num_kv_heads = _check_attention_inputs(query, key_cache, value_cache)
    num_seqs = cu_seqlens_q.shape[0] - 1
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=query.dtype, device=query.device)
    if num_tokens == 0 or num_seqs == 0:
        return out
    if max_q_len is None:
        max_q_len = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())     # a device sync
    head_dim_p2 = _pow2(head_dim, 16)
    block_m = min(64, _pow2(max_q_len, 16))          # a short chunk does not pay for a 64-row tile
    block_n = 64 if head_dim_p2 <= 128 else 32
    block_tables = block_tables.contiguous()
    grid = (triton.cdiv(max_q_len, block_m), num_heads, num_seqs)
    _paged_prefill_kernel[grid](
        out, query, key_cache, value_cache, block_tables, cu_seqlens_q.contiguous(), seq_lens.contiguous(),
        scale * k_scale * LOG2E, float(v_scale),
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), block_tables.stride(0),
        num_heads // num_kv_heads, head_dim,
        BLOCK_SIZE=block_size, HEAD_DIM_P2=head_dim_p2, BLOCK_M=block_m, BLOCK_N=block_n,
        UPCAST=_upcast(query.dtype), KV_FP8=key_cache.dtype == torch.float8_e4m3fn, num_warps=4,
        num_stages=choose_num_stages("prefill", head_dim_p2, block_m, _target_arch(query.device),
                                     key_cache.dtype, query.dtype),
    )
    return out


# ---------------------------------------------------------------------------------------------- RMSNorm

@triton.jit
def _rms_norm_kernel(
    out_ptr, residual_out_ptr, x_ptr, residual_ptr, weight_ptr,
    stride_x, stride_r, n_cols, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, UPCAST: tl.constexpr,
):
    """One row: [x += residual; residual_out = x]; out = (x / rms(x)).to(dtype) * weight. The same roundings
    as layers.RMSNorm: the sum in the input dtype, the statistics in fp32, the scaled row rounded to the input
    dtype before the weight multiplies it."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        x = x + tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        tl.store(residual_out_ptr + row * n_cols + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    if UPCAST:          # bf16 under the CPU interpreter: round through fp32 explicitly
        y = (xf * inv_rms).to(x.dtype).to(tl.float32) * w.to(tl.float32)
    else:
        y = (xf * inv_rms).to(x.dtype) * w
    tl.store(out_ptr + row * n_cols + cols, y.to(x.dtype), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """layers.RMSNorm's forward in one kernel. x (..., n) with a contiguous last dimension; weight (n,).
    Returns norm(x), or with `residual` (same shape as x) the pre-norm pair (norm(x + residual), x + residual)."""
    n = x.shape[-1]
    if weight.shape != (n,) or x.stride(-1) != 1 or (residual is not None and residual.shape != x.shape):
        raise ValueError(f"rms_norm: x {tuple(x.shape)} (last stride {x.stride(-1)}), weight "
                         f"{tuple(weight.shape)}, residual {None if residual is None else tuple(residual.shape)}: "
                         "weight must be (x.shape[-1],), x's last dimension contiguous, residual x's shape.")
    x2 = x.reshape(-1, n)                    # a view when x's rows are evenly strided
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    rows = x2.shape[0]
    if residual is not None:
        r2 = residual.reshape(-1, n)
        if r2.stride(-1) != 1:
            r2 = r2.contiguous()
        residual_out = torch.empty_like(out)
    else:
        r2 = residual_out = out              # unused
    if rows:
        block = _pow2(n, 16)
        _rms_norm_kernel[(rows,)](
            out, residual_out, x2, r2, weight, x2.stride(0), r2.stride(0), n, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=block, UPCAST=_upcast(x.dtype),
            num_warps=4 if block <= 1024 else 8,
        )
    out = out.view(x.shape)
    return out if residual is None else (out, residual_out.view(x.shape))
