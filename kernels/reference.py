"""Plain PyTorch paged attention and KV store: the readable version of every kernel.

This is the CPU serving path and the oracle the Triton kernels are tested against. Math is done in
fp32 whatever the input dtype, and the result is cast back, so low-precision kernels are compared
with an fp32 answer.

Paged KV: a sequence's KV lives in the blocks its block table lists, in order:
    token t of sequence i  ->  key_cache[block_tables[i, t // block_size], t % block_size]
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

# An fp8 KV cache (kv_cache_dtype="fp8", as vLLM names it) holds e4m3 values (4 exponent bits, 3 mantissa
# bits, no infinities; largest finite 448) and one scale per layer for K and one for V:
#     stored = fp8(clamp(x / scale, -448, 448))        x ~= float(stored) * scale
# The scales never touch an element on the way out: scores are q . k * (softmax_scale * k_scale), and the
# attention output is v_scale * (softmax weights . v). So reading fp8 costs one conversion per element.
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0


def quantize_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x / scale rounded to the nearest e4m3 value, saturating at +-448 (PyTorch's cast would give NaN)."""
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def store_kv_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                   value_cache: torch.Tensor, slot_mapping: torch.Tensor,
                   k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Write each new token's K and V into its cache slot; slots of -1 are padding and skipped.
    An fp8 cache stores K / k_scale and V / v_scale (quantize_fp8); other caches ignore the scales."""
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    slots = slot_mapping
    if bool((slot_mapping < 0).any()):
        keep = slot_mapping >= 0
        slots, key, value = slot_mapping[keep], key[keep], value[keep]
    if key_cache.dtype == FP8_DTYPE:
        # PyTorch has no index_copy_ for fp8 on a CPU: copy the same bytes as uint8.
        key_cache.view(torch.uint8).view(-1, num_kv_heads, head_dim).index_copy_(
            0, slots, quantize_fp8(key, k_scale).view(torch.uint8))
        value_cache.view(torch.uint8).view(-1, num_kv_heads, head_dim).index_copy_(
            0, slots, quantize_fp8(value, v_scale).view(torch.uint8))
        return
    key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, key.to(key_cache.dtype))
    value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, value.to(value_cache.dtype))


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first seq_len tokens of one sequence, contiguous: (seq_len, num_kv_heads, head_dim)."""
    block_size = cache.shape[1]
    num_blocks = -(-seq_len // block_size)
    blocks = cache[block_table[:num_blocks].long()]          # (num_blocks, block_size, kv_heads, head_dim)
    return blocks.flatten(0, 1)[:seq_len]


def paged_decode_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           seq_lens_cpu: list[int] | None = None,
                           kv_buffer: torch.Tensor | None = None,
                           compute_dtype: torch.dtype | None = torch.float32,
                           k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """One query token per sequence attends to all of its seq_len cached tokens.

    query (num_seqs, num_heads, head_dim) -> (num_seqs, num_heads, head_dim)
    Vectorized over the batch: gather every sequence's blocks up to the longest, mask the tail.
    Slots past a sequence's end hold stale but finite values (the cache starts zeroed), and the mask
    gives them zero weight. `kv_buffer`, if given, is where the gathered K and V go (any tensor of at
    least 2 * num_seqs * max_blocks * block_size * kv_heads * head_dim elements of the cache's dtype):
    the CPU path reuses one across layers and steps. (index_select into a flat buffer is what makes this
    gather fast; fancy indexing `key_cache[tables]` was 1.6-3.8x slower for the whole call, lesson 10.)
    `compute_dtype`: fp32 (the oracle's default) upcasts q, K and V first; None attends in the cache's own
    dtype, which the CPU serving path uses in bf16: PyTorch's CPU attention keeps its softmax statistics and
    sums in fp32 anyway, and skipping the upcast saves two copies of the gathered KV per layer.
    An fp8 cache is gathered as fp8 (a quarter of fp32's bytes) and attended in compute_dtype, or in the
    query's dtype when that is None; k_scale and v_scale fold into the softmax scale and the output.
    """
    num_seqs, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    max_len = max(seq_lens_cpu) if seq_lens_cpu is not None else int(seq_lens.max())
    max_blocks = -(-max_len // block_size)
    padded_len = max_blocks * block_size
    blocks = block_tables[:, :max_blocks].reshape(-1).long()                # (num_seqs * max_blocks,)
    n = blocks.numel() * block_size * num_kv_heads * head_dim
    if kv_buffer is None:
        kv_buffer = torch.empty(2 * n, dtype=key_cache.dtype, device=key_cache.device)
    k = kv_buffer.view(-1)[:n].view(-1, block_size, num_kv_heads, head_dim)
    v = kv_buffer.view(-1)[n:2 * n].view(-1, block_size, num_kv_heads, head_dim)
    torch.index_select(key_cache, 0, blocks, out=k)
    torch.index_select(value_cache, 0, blocks, out=v)
    k = k.view(num_seqs, padded_len, num_kv_heads, head_dim).transpose(1, 2)
    v = v.view(num_seqs, padded_len, num_kv_heads, head_dim).transpose(1, 2)
    # k, v: (num_seqs, kv_heads, padded_len, head_dim). GQA: the `group` query heads that share a KV head
    # become `group` query rows against it (heads are ordered so that head h reads KV head h // group).
    q = query.view(num_seqs, num_kv_heads, group, head_dim)
    pos = torch.arange(padded_len, device=query.device)
    past_end = pos[None, :] >= seq_lens.to(query.device)[:, None]          # (num_seqs, padded_len)
    # An additive mask (0 or -inf) rather than a boolean one: same result, and PyTorch's CPU attention takes
    # it about 10% faster at decode shapes (measured, batch 32, 192 slots).
    bias = torch.zeros(past_end.shape, dtype=torch.float32, device=query.device).masked_fill_(past_end, -math.inf)
    if compute_dtype is None and key_cache.dtype == FP8_DTYPE:
        compute_dtype = query.dtype                                       # no attention kernel takes fp8
    if compute_dtype is not None:
        q, k, v = q.to(compute_dtype), k.to(compute_dtype), v.to(compute_dtype)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias.to(q.dtype)[:, None, None, :],
                                         scale=scale * k_scale)           # (num_seqs, kv_heads, group, head_dim)
    if v_scale != 1.0:
        out = out * v_scale
    return out.reshape(num_seqs, num_heads, head_dim).to(query.dtype)     # (num_seqs, heads, head_dim)


def paged_prefill_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                            block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor,
                            scale: float, q_lens_cpu: list[int] | None = None,
                            seq_lens_cpu: list[int] | None = None,
                            k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """Causal attention for a flat batch of sequences, each with q_len new tokens at the end of its KV.

    query (num_tokens, num_heads, head_dim) -> (num_tokens, num_heads, head_dim)
    Sequence i's new tokens sit at positions seq_len_i - q_len_i ... seq_len_i - 1, so the cached
    context (prefix-cache hits, earlier chunks of a chunked prefill) is attended to in full.
    k_scale, v_scale: an fp8 cache's scales (see quantize_fp8), folded in as in paged_decode_attention.
    """
    num_heads = query.shape[1]
    num_kv_heads = key_cache.shape[2]
    if q_lens_cpu is None:
        q_lens_cpu = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).tolist()
    if seq_lens_cpu is None:
        seq_lens_cpu = seq_lens.tolist()
    out = torch.empty_like(query)
    start = 0
    for i, (q_len, seq_len) in enumerate(zip(q_lens_cpu, seq_lens_cpu)):
        q = query[start:start + q_len].float().transpose(0, 1)               # (num_heads, q_len, head_dim)
        k = gather_kv(key_cache, block_tables[i], seq_len).float().transpose(0, 1)    # (kv_heads, seq_len, d)
        v = gather_kv(value_cache, block_tables[i], seq_len).float().transpose(0, 1)
        # Query row r is at position seq_len - q_len + r and sees keys 0 .. that position.
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
        mask = torch.arange(seq_len, device=query.device)[None, :] <= q_pos[:, None]  # (q_len, seq_len)
        # 4-D (a batch of one): PyTorch's fused CPU kernel takes only 4-D inputs; 3-D falls back to plain math.
        o = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, scale=scale * k_scale,
                                           enable_gqa=num_heads != num_kv_heads)[0]  # (num_heads, q_len, d)
        out[start:start + q_len] = (o.transpose(0, 1) * v_scale).to(query.dtype)
        start += q_len
    return out
