"""The layers a Llama-family model is built from, with vLLM's names and Megatron-style sharding.

Owns: each layer's weights and how a full checkpoint tensor is cut into this rank's shard
(`weight_loader`). With tp_size == 1 every layer is an ordinary dense layer.

    ColumnParallelLinear   output features split across ranks:  y_r = x @ W_r.T       (no communication)
    RowParallelLinear      input features split across ranks:   y = sum_r x_r @ W_r.T  (all-reduce)
    QKVParallelLinear      fused q/k/v projection; each rank gets its own query and KV heads
    MergedColumnParallelLinear  fused gate/up projection
    VocabParallelEmbedding / ParallelLMHead   vocabulary split across ranks
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from minivllm.model._kernels import kernels
from minivllm.model.cpu_gemm import gate_up_gemm, gemm


@dataclass(frozen=True)
class TPGroup:
    """This process's place in the tensor-parallel group (rank 0 of 1 without TP). `group`: the torch.distributed
    group of this pipeline stage's TP ranks (None: the default group, when there is one stage)."""
    rank: int = 0
    size: int = 1
    group: object = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


@dataclass(frozen=True)
class PPStage:
    """This process's pipeline stage: decoder layers [start_layer, end_layer) of the model, and the global ranks of
    the same TP rank in the previous and next stages (None at the ends). One stage holds every layer."""
    rank: int = 0
    size: int = 1
    start_layer: int = 0
    end_layer: int | None = None          # None: to the last layer
    prev_rank: int | None = None
    next_rank: int | None = None
    driver_rank: int = 0                  # where the last stage sends the logits (rank 0 samples)
    broadcast_logits: bool = False        # torchrun: every rank samples, so every rank gets the logits

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.size - 1


CUSTOM_OP_NAMES = frozenset({"rms_norm"})      # the model's ops that have a fused CUDA kernel


def _custom_ops(spec: str) -> frozenset[str]:
    """MINIVLLM_CUSTOM_OPS, read as vLLM reads `custom_ops`: a comma list starting from "all" (the default,
    also when unset or empty) or "none", then "+op" turns one on and "-op" turns one off.

    On by default: on an H100 (2026-11-26) the fused RMSNorm took a CUDA-graph decode step at batch 64 from
    8.65 to 7.35 ms, and kept fp32 greedy tokens equal to HF's (tests/test_gpu.py). "none" or "-rms_norm"
    gives the plain PyTorch ops back. Only CUDA tensors use these kernels; a CPU has its own (_cpu_kernels).
    """
    names = [part.strip() for part in spec.split(",") if part.strip()]
    on = set() if "none" in names else set(CUSTOM_OP_NAMES)
    bad = [n for n in names if n not in ("all", "none") and (n[:1] not in "+-" or n[1:] not in CUSTOM_OP_NAMES)]
    if bad or ("all" in names and "none" in names):
        raise ValueError(f"MINIVLLM_CUSTOM_OPS is {spec!r}; give 'all' (the default) or 'none', then +op to turn "
                         f"one on or -op to turn one off, from: {', '.join(sorted(CUSTOM_OP_NAMES))}.")
    for n in names:
        if n[0] == "+":
            on.add(n[1:])
        elif n[0] == "-":
            on.discard(n[1:])
    return frozenset(on)


CUSTOM_OPS = _custom_ops(os.environ.get("MINIVLLM_CUSTOM_OPS", ""))    # read once, at import


def _cpu_kernels(x: torch.Tensor) -> bool:
    """On a CPU, the small layers run as fused C++ ops (kernels/cpu_layers.cpp) when they build (a C++
    compiler is there, MINIVLLM_CPU_KERNELS is not 0); else their PyTorch code (forward_native)."""
    if x.device.type != "cpu":
        return False
    return kernels.cpu_ops.available()


def _shard(loaded, dim: int, rank: int, size: int) -> torch.Tensor:
    """This rank's 1/size of `loaded` along `dim`. `loaded` is a tensor or a lazy safetensors slice
    (model_loader.py), so a rank reads only its own shard from disk."""
    shape = loaded.shape if isinstance(loaded, torch.Tensor) else loaded.get_shape()
    if shape[dim] % size:          # check_tp_size refuses such models first; never drop the remainder silently
        raise ValueError(f"a weight of shape {tuple(shape)} does not split into {size} equal shards along "
                         f"dimension {dim}; tensor_parallel_size must divide it.")
    n = shape[dim] // size
    return loaded[(slice(None),) * dim + (slice(rank * n, (rank + 1) * n),)]


class ColumnParallelLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup):
        super().__init__()
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(out_features // tp.size, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features // tp.size), requires_grad=False) if bias else None
        self.packed_weight: torch.Tensor | None = None     # CPU: `weight` in oneDNN's layout (cpu_gemm.py)
        self.quant_method = None                           # CPU: int8 / int4 weights instead (quantization.py)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        param.copy_(_shard(loaded, 0, self.tp.rank, self.tp.size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant_method is not None:
            return self.quant_method.apply(self, x, self.bias)
        return gemm(x, self.weight, self.bias, self.packed_weight)


class QKVParallelLinear(ColumnParallelLinear):
    """Rows of the fused weight: [q heads of this rank | k heads of this rank | v heads of this rank]."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool, tp: TPGroup):
        self.head_dim = head_dim
        self.num_heads = num_heads // tp.size          # per rank
        self.num_kv_heads = num_kv_heads // tp.size
        out = (num_heads + 2 * num_kv_heads) * head_dim
        super().__init__(hidden_size, out, bias, tp)

    def weight_loader(self, param, loaded, shard_id=None):
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        offset, size = {"q": (0, q_size), "k": (q_size, kv_size), "v": (q_size + kv_size, kv_size)}[shard_id]
        param.narrow(0, offset, size).copy_(_shard(loaded, 0, self.tp.rank, self.tp.size))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one matmul (gate_proj and up_proj).

    feeds_silu_and_mul: the outputs are a gated MLP's [gate | up], read only by SiluAndMul. A CPU may then pack
    the weight in gate/up panels (cpu_gemm.py, quantization.py set `packed_silu_and_mul`), and `silu_and_mul(x)`
    computes silu(gate) * up inside the matmul, in the tile's registers: the (rows, 2 * n) activation is never
    written, and the values are the unfused path's, bit for bit (tests/test_cpu_gemm.py).
    """

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool, tp: TPGroup,
                 feeds_silu_and_mul: bool = False):
        self.out_sizes = [s // tp.size for s in out_sizes]
        super().__init__(in_features, sum(out_sizes), bias, tp)
        self.feeds_silu_and_mul = feeds_silu_and_mul and not bias and len(out_sizes) == 2 and \
            out_sizes[0] == out_sizes[1]
        self.packed_silu_and_mul = False                   # CPU: the packed weight is in gate/up panels

    def weight_loader(self, param, loaded, shard_id=None):
        offset = sum(self.out_sizes[:shard_id])
        param.narrow(0, offset, self.out_sizes[shard_id]).copy_(
            _shard(loaded, 0, self.tp.rank, self.tp.size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.packed_silu_and_mul:
            return super().forward(x)
        # Direct callers only (tests, quantization.dequantize): the model calls silu_and_mul.
        y = self._gate_up(x, silu_and_mul=False)                  # (..., panels * 48): columns in panel order
        return y[..., kernels.cpu_ops.gate_up_columns(self.out_sizes[0])]      # (..., 2 * n): [gate | up]

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., in) -> silu(gate) * up, (..., n): in the matmul when packed so, else SiluAndMul after it."""
        if not self.packed_silu_and_mul:
            return SiluAndMul()(super().forward(x))
        return self._gate_up(x, silu_and_mul=True)

    def _gate_up(self, x: torch.Tensor, silu_and_mul: bool) -> torch.Tensor:
        if self.quant_method is not None:
            return self.quant_method.apply(self, x, None, silu_and_mul=silu_and_mul)
        return gate_up_gemm(x, self.packed_weight, self.out_sizes[0], silu_and_mul)


class RowParallelLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup):
        super().__init__()
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(out_features, in_features // tp.size), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.packed_weight: torch.Tensor | None = None     # CPU: `weight` in oneDNN's layout (cpu_gemm.py)
        self.quant_method = None                           # CPU: int8 / int4 weights instead (quantization.py)

    def weight_loader(self, param, loaded, shard_id=None):
        param.copy_(_shard(loaded, 1, self.tp.rank, self.tp.size) if param.dim() == 2 else loaded[:])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = (self.quant_method.apply(self, x, None) if self.quant_method is not None
             else gemm(x, self.weight, None, self.packed_weight))
        y = self.tp.all_reduce(y)                                  # partial sums from every rank
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """Each rank holds vocab_size / tp rows; tokens outside its range contribute zeros to the all-reduce."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup):
        super().__init__()
        self.tp = tp
        self.shard_size = vocab_size // tp.size
        self.vocab_start = tp.rank * self.shard_size
        self.weight = nn.Parameter(torch.empty(self.shard_size, hidden_size), requires_grad=False)

    def weight_loader(self, param, loaded, shard_id=None):
        param.copy_(_shard(loaded, 0, self.tp.rank, self.tp.size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        mine = (local >= 0) & (local < self.shard_size)
        y = F.embedding(local.clamp(0, self.shard_size - 1), self.weight) * mine.unsqueeze(-1)
        return self.tp.all_reduce(y)


class ParallelLMHead(VocabParallelEmbedding):
    """logits = hidden @ embedding.T, each rank computing its vocabulary slice, gathered for sampling."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup):
        super().__init__(vocab_size, hidden_size, tp)
        self.packed_weight: torch.Tensor | None = None     # CPU: `weight` in oneDNN's layout (cpu_gemm.py)
        self.quant_method = None                           # CPU: int8 / int4 weights instead (quantization.py)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = (self.quant_method.apply(self, hidden, None) if self.quant_method is not None
                  else gemm(hidden, self.weight, None, self.packed_weight))     # (num_seqs, vocab_size / tp)
        return self.tp.all_gather_last_dim(logits)              # (num_seqs, vocab_size)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """With `residual`: returns (norm(x + residual), x + residual), the fused pre-norm step.
        On CUDA one Triton kernel does it (vLLM's custom-op switch: on unless MINIVLLM_CUSTOM_OPS is "none" or
        "-rms_norm"); on a CPU one C++ pass per row (rows must be contiguous:
        Qwen3's per-head norm of a qkv view is not, and stays native); everywhere else, forward_native."""
        if x.is_cuda and "rms_norm" in CUSTOM_OPS:
            return kernels.triton_ops.rms_norm(x, self.weight, self.eps, residual)
        if x.is_contiguous() and _cpu_kernels(x):
            return kernels.cpu_ops.rms_norm(x, self.weight, self.eps, residual)
        return self.forward_native(x, residual)

    def forward_native(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is not None:
            x = x + residual
            residual = x
        dtype = x.dtype
        xf = x.float()
        y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(dtype) * self.weight
        return y if residual is None else (y, residual)


class SiluAndMul(nn.Module):
    """The gated MLP's activation: x (rows, 2 * n) = [gate | up] -> silu(gate) * up (rows, n). On a CPU one C++
    pass (kernels/cpu_layers.cpp); elsewhere forward_native."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _cpu_kernels(x):
            return kernels.cpu_ops.silu_and_mul(x)
        return self.forward_native(x)

    @staticmethod
    def forward_native(x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class RotaryEmbedding(nn.Module):
    """Rotary position embedding, Hugging Face's "rotate half" layout, with Llama 3 frequency scaling."""

    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: dict | None = None):
        super().__init__()
        # fp32 throughout, computed as Hugging Face does, so greedy outputs match it bit for bit.
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
        rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
        if rope_type == "llama3":
            inv_freq = _llama3_scale(inv_freq, scaling)
        elif rope_type not in ("default", None):
            raise ValueError(f"rope_scaling type {rope_type!r} is not supported; minivllm supports "
                             "'default' and 'llama3'.")
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)                              # (max_position, head_dim / 2)
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        # q (num_tokens, num_heads, head_dim), k (num_tokens, num_kv_heads, head_dim); on a CPU one C++ pass
        if _cpu_kernels(q):
            return kernels.cpu_ops.rotary_embedding(positions, q, k, self.cos, self.sin)
        return self.forward_native(positions, q, k)

    def forward_native(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        cos = self.cos[positions].unsqueeze(1)                         # (num_tokens, 1, head_dim / 2)
        sin = self.sin[positions].unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def _llama3_scale(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    factor, low, high = s["factor"], s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
    return torch.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)
