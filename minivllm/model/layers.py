"""The layers a Llama-family model is built from, with vLLM's names and Megatron-style sharding.

Owns: each layer's weights and how a full checkpoint tensor is cut into this rank's shard
(`weight_loader`). With tp_size == 1 every layer is an ordinary dense layer.

    ColumnParallelLinear   output features split across ranks:  y_r = x @ W_r.T       (no communication)
    RowParallelLinear      input features split across ranks:   y = sum_r x_r @ W_r.T  (all-reduce)
    QKVParallelLinear      fused q/k/v projection; each rank gets its own query and KV heads
    MergedColumnParallelLinear  fused gate/up projection
    VocabParallelEmbedding / ParallelLMHead   vocabulary split across ranks
    RMSNorm, SiluAndMul, RotaryEmbedding      ops with a kernel per platform (custom_op.py)

Every linear layer multiplies through `self.quant_method.apply(self, x, bias)` (vLLM's name): here the plain
F.linear. A platform may give a layer another method once its weights are loaded (minivllm/platforms/cpu:
weights packed or quantized for its kernels); the layer never asks which one it has.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from minivllm.model._kernels import kernels
from minivllm.model.custom_op import CustomOp


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


class UnquantizedLinearMethod:
    """y = x @ weight.T + bias with F.linear: the matmul every linear layer starts with, on every device."""

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, layer.weight, bias)


UNQUANTIZED = UnquantizedLinearMethod()        # stateless: one for every layer


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
        self.quant_method = UNQUANTIZED

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        param.copy_(_shard(loaded, 0, self.tp.rank, self.tp.size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)                  # (rows, out / tp)


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

    feeds_silu_and_mul: the outputs are a gated MLP's [gate | up], read only by SiluAndMul, so a platform may
    compute the activation inside the matmul (minivllm/platforms/cpu/gemm.py says how, and marks the model's
    gated MLPs itself). The layer's own forward always answers [gate | up].
    """

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool, tp: TPGroup,
                 feeds_silu_and_mul: bool = False):
        self.out_sizes = [s // tp.size for s in out_sizes]
        super().__init__(in_features, sum(out_sizes), bias, tp)
        self.feeds_silu_and_mul = feeds_silu_and_mul and self.can_feed_silu_and_mul

    def weight_loader(self, param, loaded, shard_id=None):
        offset = sum(self.out_sizes[:shard_id])
        param.narrow(0, offset, self.out_sizes[shard_id]).copy_(
            _shard(loaded, 0, self.tp.rank, self.tp.size))

    @property
    def can_feed_silu_and_mul(self) -> bool:
        """Whether the outputs can be a gated MLP's [gate | up]: two halves of equal size, and no bias."""
        return self.bias is None and len(self.out_sizes) == 2 and self.out_sizes[0] == self.out_sizes[1]


class RowParallelLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup):
        super().__init__()
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(out_features, in_features // tp.size), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.quant_method = UNQUANTIZED

    def weight_loader(self, param, loaded, shard_id=None):
        param.copy_(_shard(loaded, 1, self.tp.rank, self.tp.size) if param.dim() == 2 else loaded[:])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.quant_method.apply(self, x, None)                 # (rows, out): this rank's partial sums
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
        self.quant_method = UNQUANTIZED

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.quant_method.apply(self, hidden, None)      # (num_seqs, vocab_size / tp)
        return self.tp.all_gather_last_dim(logits)              # (num_seqs, vocab_size)


class RMSNorm(CustomOp):
    name = "rms_norm"

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)

    # With `residual` every forward returns (norm(x + residual), x + residual), the fused pre-norm step.
    def forward_native(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is not None:
            x = x + residual
            residual = x
        dtype = x.dtype
        xf = x.float()
        y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(dtype) * self.weight
        return y if residual is None else (y, residual)

    def forward_cuda(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """One Triton kernel (vLLM's custom-op switch: on unless MINIVLLM_CUSTOM_OPS is "none" or "-rms_norm")."""
        return kernels.triton_ops.rms_norm(x, self.weight, self.eps, residual)

    def forward_cpu(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """One C++ pass per row; rows must be contiguous (Qwen3's per-head norm of a qkv view is not)."""
        if x.is_contiguous():
            return kernels.cpu_ops.rms_norm(x, self.weight, self.eps, residual)
        return self.forward_native(x, residual)


class SiluAndMul(CustomOp):
    """The gated MLP's activation: x (rows, 2 * n) = [gate | up] -> silu(gate) * up (rows, n)."""

    @staticmethod
    def forward_native(x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    @staticmethod
    def forward_cpu(x: torch.Tensor) -> torch.Tensor:
        return kernels.cpu_ops.silu_and_mul(x)                     # one C++ pass (kernels/cpu_layers.cpp)


class RotaryEmbedding(CustomOp):
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

    # q (num_tokens, num_heads, head_dim), k (num_tokens, num_kv_heads, head_dim) -> both rotated, same shapes
    def forward_native(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        cos = self.cos[positions].unsqueeze(1)                         # (num_tokens, 1, head_dim / 2)
        sin = self.sin[positions].unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)

    def forward_cpu(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        return kernels.cpu_ops.rotary_embedding(positions, q, k, self.cos, self.sin)     # one C++ pass


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
