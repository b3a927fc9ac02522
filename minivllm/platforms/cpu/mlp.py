"""A gated MLP on a CPU: SiLU inside the gate/up matmul, or the rows in slices that keep the activation in cache.

Owns: finding the model's gated MLPs (`mark_gated_mlps`), and how each runs once its weights are packed
(`bind_mlp_forwards`). A gated MLP is any module with vLLM's names: `gate_up_proj` (a
MergedColumnParallelLinear), `act_fn` (SiluAndMul) and `down_proj`; the modeling file's own forward is the
plain `down_proj(act_fn(gate_up_proj(x)))`, and stays the definition of what the MLP computes.

    SiLU in the matmul   where gemm.py or quantization.py packed gate/up in gate/up panels (`packed_silu_and_mul`):
                         the matmul's epilogue computes silu(gate) * up from its accumulators, so the
                         (rows, 2 * intermediate) activation is never written nor read again. Bit for bit the
                         separate pass's values (tests/test_cpu_gemm.py).
    rows in slices       elsewhere (SiLU a separate pass): a CPU's last-level cache is tens of MB, and a
                         4,096-token prefill's gate/up activation of the default model is 4,096 x 3,072 x 4 bytes
                         = 50 MB, written by one matmul and read back by the next from memory. In slices of at
                         most CPU_SLICE_BYTES it stays in the cache. The same rows and weights, so the same result
                         (tests/test_cpu_mlp_slices.py). Where SiLU is in the matmul there is no such activation,
                         and the whole batch is faster than slices.

vLLM does such fusions as graph rewrites under torch.compile (vllm/compilation/); minivllm, without a compiler,
binds the MLP's forward once when the weights are loaded. Must never: decide per call what the load decided,
or leave an MLP computing anything but its modeling file's forward (up to rounding).
"""

from __future__ import annotations

import torch
from torch import nn

from minivllm.model.layers import MergedColumnParallelLinear, SiluAndMul

CPU_SLICE_BYTES = 12 << 20


def cpu_slice_rows(x: torch.Tensor, width: int) -> int:
    """How many rows of x to run at a time when the widest activation has `width` columns of x's dtype: all of
    them off the CPU (a GPU's kernels want the whole batch), else the most rows, a multiple of 256, whose
    activation fits in CPU_SLICE_BYTES (and never fewer than 256)."""
    if x.device.type != "cpu":
        return x.shape[0]
    rows = CPU_SLICE_BYTES // (width * x.element_size())
    return max(256, rows // 256 * 256)


def gated_mlps(model: nn.Module) -> list[nn.Module]:
    """The modules of `model` that are gated MLPs (vLLM's names, see the module docstring)."""
    return [m for m in model.modules()
            if isinstance(getattr(m, "gate_up_proj", None), MergedColumnParallelLinear)
            and isinstance(getattr(m, "act_fn", None), SiluAndMul) and hasattr(m, "down_proj")]


def mark_gated_mlps(model: nn.Module) -> None:
    """Mark each gated MLP's gate/up layer as feeding SiluAndMul (where its shape allows), so packing may put its
    weight in gate/up panels. Before the weights are packed or quantized."""
    for mlp in gated_mlps(model):
        mlp.gate_up_proj.feeds_silu_and_mul = mlp.gate_up_proj.can_feed_silu_and_mul


class FusedSiluForward:
    """mlp.forward where gate/up sits in gate/up panels: x (n, hidden) -> down(silu(gate) * up) (n, hidden)."""

    def __init__(self, mlp: nn.Module):
        self.mlp = mlp

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.mlp.gate_up_proj
        act = gate_up.quant_method.apply(gate_up, x, None, silu_and_mul=True)      # (n, intermediate / tp)
        return self.mlp.down_proj(act)


class SlicedForward:
    """mlp.forward where SiLU is a separate pass: the modeling file's forward over row slices of x
    (`cpu_slice_rows`), concatenated; one call where the batch fits."""

    def __init__(self, mlp: nn.Module):
        self.mlp = mlp
        self.width = sum(mlp.gate_up_proj.out_sizes)        # gate_up: (rows, 2 * intermediate / tp)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        mlp = self.mlp
        rows = cpu_slice_rows(x, self.width)
        if rows >= x.shape[0]:
            return type(mlp).forward(mlp, x)
        return torch.cat([type(mlp).forward(mlp, part) for part in x.split(rows)])


def bind_mlp_forwards(model: nn.Module) -> None:
    """Give each gated MLP of `model` its CPU forward: SiLU in the matmul where its gate/up layer was packed so,
    else its rows in slices. After the weights are packed or quantized."""
    for mlp in gated_mlps(model):
        fused = getattr(mlp.gate_up_proj, "packed_silu_and_mul", False)
        mlp.forward = FusedSiluForward(mlp) if fused else SlicedForward(mlp)


def silu_and_mul(layer: MergedColumnParallelLinear, x: torch.Tensor) -> torch.Tensor:
    """x (..., in) -> silu(gate) * up (..., n) of a gate/up layer alone: in the matmul where it is packed in
    gate/up panels, else SiluAndMul after its product. For tests and lessons; the model's MLPs are bound once."""
    if not getattr(layer, "packed_silu_and_mul", False):
        return SiluAndMul()(layer(x))
    return layer.quant_method.apply(layer, x, None, silu_and_mul=True)
