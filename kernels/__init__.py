"""minivllm's kernels (imported as `minivllm_kernels`; see minivllm/model/_kernels.py for why not `kernels`).

    reference    plain PyTorch: the CPU serving path and the oracle every kernel is tested against
    triton_ops   Triton kernels with the same signatures (GPU, or CPU under TRITON_INTERPRET=1)
    cpu_ops      C++ kernels for the CPU (paged decode attention), built on first use (cpu_attention.cpp)

Layouts shared by both:
    key/value        (num_tokens, num_kv_heads, head_dim)       new tokens of a flat batch
    key/value_cache  (num_blocks, block_size, num_kv_heads, head_dim)
    slot_mapping     (num_tokens,) int64, slot = block_id * block_size + offset; -1 = skip
    block_tables     (num_seqs, max_blocks_per_seq) int32
    seq_lens         (num_seqs,) int32, KV length per sequence including the new tokens
    cu_seqlens_q     (num_seqs + 1,) int32, query row offsets of each sequence
"""

from __future__ import annotations

import importlib

from . import reference


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def __getattr__(name):
    if name in ("triton_ops", "cpu_ops"):   # imported lazily: triton is optional, cpu_ops compiles C++
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(name)
