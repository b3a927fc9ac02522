"""Paged attention for one flat batch: the metadata, and the backends that compute it.

Owns: `AttentionMetadata` (where each token's K/V goes, which blocks each sequence reads) and the choice
of backend. The reference backend is plain PyTorch from `minivllm_kernels.reference` (the kernels' test
oracle); the cpu backend is the reference with decode attention in C++ (`minivllm_kernels.cpu_ops`, the CPU
serving path when a compiler is there); the Triton backend runs `minivllm_kernels`' Triton kernels (GPU).

A flat batch mixes prefills and decodes with no padding. For sequence i:
    its new tokens are query rows  cu_seqlens_q[i] : cu_seqlens_q[i+1]   (q_len_i of them)
    its KV length is               seq_lens[i]  (cached context + the q_len_i new tokens)
    its new tokens sit at positions seq_lens[i] - q_len_i ... seq_lens[i] - 1, causally masked.
A decode is just q_len_i == 1.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from minivllm.model._kernels import kernels

logger = logging.getLogger(__name__)


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor     # (num_tokens,) int64: flat cache slot of each new token; -1 = skip
    cu_seqlens_q: torch.Tensor     # (num_seqs + 1,) int32: query row offsets
    seq_lens: torch.Tensor         # (num_seqs,) int32: KV length of each sequence after this step
    block_tables: torch.Tensor     # (num_seqs, max_blocks_per_seq) int32, padded with 0
    max_q_len: int                 # longest q_len in the batch (1 for a pure decode batch)
    max_seq_len: int
    # Host copies, so the reference path can slice without device syncs.
    q_lens_cpu: list[int]
    seq_lens_cpu: list[int]

    @property
    def is_pure_decode(self) -> bool:
        return self.max_q_len == 1


def model_input_tensors(mi, device: torch.device):
    """(input_ids, positions, AttentionMetadata) of a ModelInput (worker/input_batch.py: one step's flat batch as
    lists), on `device`: what every rank runs its forward on. cu_seqlens_q is the prefix sum of
    q_lens: request i's tokens are rows cu[i] .. cu[i + 1] - 1 of the flat batch."""
    def t(x, dtype):
        return torch.tensor(x, dtype=dtype).to(device, non_blocking=True)

    cu = [0]
    for q in mi.q_lens:
        cu.append(cu[-1] + q)
    meta = AttentionMetadata(
        slot_mapping=t(mi.slot_mapping, torch.int64), cu_seqlens_q=t(cu, torch.int32),
        seq_lens=t(mi.seq_lens, torch.int32), block_tables=t(mi.block_tables, torch.int32),
        max_q_len=max(mi.q_lens), max_seq_len=max(mi.seq_lens), q_lens_cpu=mi.q_lens, seq_lens_cpu=mi.seq_lens)
    return t(mi.input_ids, torch.int64), t(mi.positions, torch.int64), meta


class AttentionBackend:
    """Stores the new K/V into the paged cache, then attends each sequence's queries to its KV."""

    name = "base"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                key_cache: torch.Tensor, value_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
        # q (num_tokens, num_heads, head_dim); k, v (num_tokens, num_kv_heads, head_dim)
        # key_cache, value_cache (num_blocks, block_size, num_kv_heads, head_dim), the model's dtype or fp8
        # k_scale, v_scale: an fp8 cache holds K / k_scale and V / v_scale (kernels/reference.py: quantize_fp8)
        raise NotImplementedError


class TorchAttentionBackend(AttentionBackend):
    """The readable reference: gathers each sequence's blocks and calls PyTorch attention."""

    name = "torch"

    def __init__(self):
        self.kv_buffer: torch.Tensor | None = None     # decode's gathered K and V, reused by every layer
        # (saves an allocation per layer; lesson 10 measures it: the gain is small, the win is index_select)

    def _buffer(self, numel: int, like: torch.Tensor) -> torch.Tensor:
        if self.kv_buffer is None or self.kv_buffer.numel() < numel or self.kv_buffer.dtype != like.dtype:
            self.kv_buffer = torch.empty(int(numel * 1.25), dtype=like.dtype, device=like.device)   # room to grow
        return self.kv_buffer

    def forward(self, q, k, v, key_cache, value_cache, meta, scale, k_scale=1.0, v_scale=1.0):
        self._store_kv(k, v, key_cache, value_cache, meta.slot_mapping, k_scale, v_scale)
        scales = dict(k_scale=k_scale, v_scale=v_scale)
        if meta.is_pure_decode:
            return self._decode(q, key_cache, value_cache, meta.block_tables, meta.seq_lens, meta.seq_lens_cpu,
                                scale, **scales)
        singles = [i for i, n in enumerate(meta.q_lens_cpu) if n == 1]
        if not singles:
            return self._prefill(q, k, v, key_cache, value_cache, meta.block_tables, meta.cu_seqlens_q,
                                 meta.seq_lens, scale, meta.q_lens_cpu, meta.seq_lens_cpu, **scales)
        # A mixed step (decodes beside prefill chunks, as chunked prefill and a busy server make): the
        # sequences with one new token are decodes, whatever their context, so they go through the batched
        # decode path together rather than one by one through the prefill loop. Rows are the flat batch's.
        multis = [i for i, n in enumerate(meta.q_lens_cpu) if n > 1]
        starts = [0]
        for n in meta.q_lens_cpu:
            starts.append(starts[-1] + n)
        single_rows = torch.tensor([starts[i] for i in singles], device=q.device)
        multi_rows = torch.tensor([r for i in multis for r in range(starts[i], starts[i + 1])], device=q.device)
        single_seqs = torch.tensor(singles, device=q.device)
        multi_seqs = torch.tensor(multis, device=q.device)
        out = torch.empty_like(q)
        out[single_rows] = self._decode(q[single_rows], key_cache, value_cache, meta.block_tables[single_seqs],
                                        meta.seq_lens[single_seqs], [meta.seq_lens_cpu[i] for i in singles], scale,
                                        **scales)
        multi_q_lens = [meta.q_lens_cpu[i] for i in multis]
        cu = torch.tensor([0] + multi_q_lens, device=q.device).cumsum(0).to(torch.int32)
        out[multi_rows] = self._prefill(
            q[multi_rows], k[multi_rows], v[multi_rows], key_cache, value_cache, meta.block_tables[multi_seqs], cu,
            meta.seq_lens[multi_seqs], scale, multi_q_lens, [meta.seq_lens_cpu[i] for i in multis], **scales)
        return out

    @staticmethod
    def _store_kv(k, v, key_cache, value_cache, slot_mapping, k_scale, v_scale):
        """This step's K and V (num_tokens, num_kv_heads, head_dim) into their slots (-1: padding, skipped)."""
        kernels.reference.store_kv_cache(k, v, key_cache, value_cache, slot_mapping, k_scale, v_scale)

    def _prefill(self, q, k, v, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, scale, q_lens_cpu,
                 seq_lens_cpu, k_scale, v_scale):
        """Prefill chunks (q_len > 1): each sequence's queries against its whole KV, read from the cache
        (k, v (num_tokens, num_kv_heads, head_dim) are this step's, already stored)."""
        return kernels.reference.paged_prefill_attention(q, key_cache, value_cache, block_tables, cu_seqlens_q,
                                                         seq_lens, scale, q_lens_cpu=q_lens_cpu,
                                                         seq_lens_cpu=seq_lens_cpu, k_scale=k_scale, v_scale=v_scale)

    def _decode(self, q, key_cache, value_cache, block_tables, seq_lens, seq_lens_cpu, scale, k_scale, v_scale):
        block_size = key_cache.shape[1]
        max_blocks = -(-max(seq_lens_cpu) // block_size)
        numel = 2 * len(seq_lens_cpu) * max_blocks * key_cache[0].numel()
        return kernels.reference.paged_decode_attention(q, key_cache, value_cache, block_tables, seq_lens, scale,
                                                        seq_lens_cpu=seq_lens_cpu,
                                                        kv_buffer=self._buffer(numel, key_cache),
                                                        compute_dtype=self.compute_dtype(key_cache.dtype),
                                                        k_scale=k_scale, v_scale=v_scale)

    @staticmethod
    def compute_dtype(cache_dtype: torch.dtype) -> torch.dtype | None:
        """bf16 attends in bf16 (fp32 softmax inside PyTorch's CPU kernel; tests/test_bf16.py holds it to HF's
        own bf16 error); fp16 is upcast (PyTorch's CPU attention in fp16 is slow), fp32 is fp32; an fp8 cache
        is attended in the model's dtype (None: the query's)."""
        if cache_dtype in (torch.bfloat16, kernels.reference.FP8_DTYPE):
            return None
        return torch.float32


class CpuAttentionBackend(TorchAttentionBackend):
    """The CPU serving path: the KV store in one pass, decode attention in C++ reading K and V straight from the
    paged cache (no per-layer gather of the context), and fresh prompts attended in C++ from this step's own K
    and V (no gather, no mask), all in kernels/cpu_attention.cpp; prefill with cached context stays the
    reference's."""

    name = "cpu"

    def forward(self, q, k, v, key_cache, value_cache, meta, scale, k_scale=1.0, v_scale=1.0):
        if key_cache.dtype == kernels.reference.FP8_DTYPE and k.dtype != key_cache.dtype:
            # An fp8 cache: this step's K and V rounded once, to the bytes the cache will hold (the reference's
            # quantize_fp8). The C++ store copies them, and fresh prompts attend to them as they would read them
            # back (_prefill), so no prompt gathers its own blocks back from the cache.
            k, v = kernels.reference.quantize_fp8(k, k_scale), kernels.reference.quantize_fp8(v, v_scale)
        return super().forward(q, k, v, key_cache, value_cache, meta, scale, k_scale, v_scale)

    @staticmethod
    def _store_kv(k, v, key_cache, value_cache, slot_mapping, k_scale, v_scale):
        """The same copies as the reference's, in one C++ pass with no host sync (the reference asks the host
        whether any slot is -1, per layer). An fp8 cache gets K and V already quantized (forward)."""
        kernels.cpu_ops.store_kv_cache(k, v, key_cache, value_cache, slot_mapping)

    def _decode(self, q, key_cache, value_cache, block_tables, seq_lens, seq_lens_cpu, scale, k_scale, v_scale):
        return kernels.cpu_ops.paged_decode_attention(q, key_cache, value_cache, block_tables, seq_lens, scale,
                                                      k_scale=k_scale, v_scale=v_scale)

    def _prefill(self, q, k, v, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, scale, q_lens_cpu,
                 seq_lens_cpu, k_scale, v_scale):
        """Sequences with no cached context (fresh prompts: q_len == seq_len) attend causally to this step's own K and
        V: the same values the cache holds, without gathering their blocks back or building a mask, all of them in
        one C++ call (kernels/cpu_attention.cpp, prefill_attention: register tiles, fp32 inside; only the order of
        the sums differs from the reference). With an fp8 cache, k and v are the cache's bytes (forward): widened
        to the model's dtype (exact), with k_scale in the softmax scale and v_scale on the output, as the
        reference reads the cache. Sequences with context (a prefix-cache hit, a later chunk) take the
        reference's path."""
        fp8 = k.dtype != q.dtype
        starts = [0]
        for q_len in q_lens_cpu[:-1]:
            starts.append(starts[-1] + q_len)
        fresh = [i for i, (q_len, seq_len) in enumerate(zip(q_lens_cpu, seq_lens_cpu)) if q_len == seq_len]
        if fresh:
            kq, vq = (k.to(q.dtype), v.to(q.dtype)) if fp8 else (k, v)
            out = kernels.cpu_ops.prefill_attention(q, kq, vq, [starts[i] for i in fresh],
                                                    [q_lens_cpu[i] for i in fresh], scale * k_scale if fp8 else scale)
            if fp8 and v_scale != 1.0:
                out = out * v_scale
        else:
            out = torch.empty_like(q)
        for i, (start, q_len, seq_len) in enumerate(zip(starts, q_lens_cpu, seq_lens_cpu)):
            if q_len != seq_len:
                rows = slice(start, start + q_len)
                cu = torch.tensor([0, q_len], dtype=torch.int32, device=q.device)
                out[rows] = super()._prefill(q[rows], k[rows], v[rows], key_cache, value_cache,
                                             block_tables[i:i + 1], cu, seq_lens[i:i + 1], scale, [q_len],
                                             [seq_len], k_scale, v_scale)
        return out


class TritonAttentionBackend(AttentionBackend):
    """The production path: Triton kernels for the KV store and paged attention."""

    name = "triton"

    def forward(self, q, k, v, key_cache, value_cache, meta, scale, k_scale=1.0, v_scale=1.0):
        ops = kernels.triton_ops
        ops.store_kv_cache(k, v, key_cache, value_cache, meta.slot_mapping, k_scale=k_scale, v_scale=v_scale)
        if meta.is_pure_decode:
            return ops.paged_decode_attention(q, key_cache, value_cache, meta.block_tables, meta.seq_lens, scale,
                                              k_scale=k_scale, v_scale=v_scale)
        return ops.paged_prefill_attention(q, key_cache, value_cache, meta.block_tables, meta.cu_seqlens_q,
                                           meta.seq_lens, scale, max_q_len=meta.max_q_len,
                                           k_scale=k_scale, v_scale=v_scale)


def get_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    """auto: Triton on CUDA; on a CPU the C++ decode kernel when it builds (a C++ compiler is there), else the
    PyTorch reference (logged once, with the reason). Triton on a CPU needs TRITON_INTERPRET=1."""
    import os

    choices = ("auto", "torch", "triton", "cpu")
    if name not in choices:
        raise ValueError(f"attention_backend is {name!r}; choose one of {choices}.")
    if name == "auto":
        if device.type == "cuda":
            name = "triton" if kernels.triton_available() else "torch"
        elif device.type == "cpu" and kernels.cpu_ops.available():
            name = "cpu"
        else:
            if device.type == "cpu":
                logger.info("attention: the PyTorch reference (%s)", kernels.cpu_ops.unavailable_reason())
            name = "torch"
    if name == "cpu":
        if device.type != "cpu":
            raise ValueError(f"attention_backend='cpu' runs on a CPU, not {device.type!r}; use 'auto'.")
        if not kernels.cpu_ops.available():
            raise ValueError(f"attention_backend='cpu': {kernels.cpu_ops.unavailable_reason()}. "
                             "Use attention_backend='torch' (the PyTorch reference).")
        return CpuAttentionBackend()
    if name == "triton":
        if not kernels.triton_available():
            raise ValueError("attention_backend='triton' needs the triton package: pip install triton")
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(f"attention_backend='triton' on device {device.type!r} needs Triton's "
                             "interpreter: set TRITON_INTERPRET=1 (slow; for tests and lessons), "
                             "or use attention_backend='torch'.")
        return TritonAttentionBackend()
    return TorchAttentionBackend()
