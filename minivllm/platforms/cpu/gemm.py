"""CPU matmuls with weights packed once at load, as vLLM's CPU backend does for unquantized layers.

Owns: turning each linear layer's (out, in) weight into a packed layout at load time (`prepack_linear_weights`),
the linear methods that multiply by it (`PackedLinearMethod`, `GateUpPanelsMethod`: the layer's `quant_method`,
vLLM's name for the per-layer matmul), the one matmul they call (`gemm`), and the plain weights' layout where
nothing packs them (`use_column_major_linear_weights`), and how each gated MLP runs (below). Must never: change a
layer's `weight` (the checkpoint loader, TP tests and lessons read it), decide anything per call that the load
could decide, or leave an MLP computing anything but its modeling file's forward (up to rounding).

Why: a decode step on a CPU multiplies a few rows (the batch) by every weight of the model. `F.linear` hands
the plain weight to MKL on every call, which re-reads it in a layout chosen for no particular shape. oneDNN's
`_reorder_linear_weight` rewrites it once into the tiles its AVX-512 kernel streams through (and, for bf16,
into the pairs `vdpbf16ps` consumes). Measured on the CI machines (2 cores, AVX-512 BF16), one decode step's
matmuls of the default model at batch 32: fp32 85 -> 45 ms, bf16 31 -> 25 ms; the packed weight is chosen
for 32 rows but is as fast or faster than `F.linear` from 1 row to 512 (prefill chunks).

vLLM's counterpart: `dispatch_cpu_unquantized_gemm` in vllm/model_executor/layers/utils.py (oneDNN through its
own C++ ops). Here the ops are PyTorch's own (`torch.ops.mkldnn`, the ones inductor's freezing pass uses).

The plain weight stays on the layer (the checkpoint loader, TP tests and lessons read it): the packed copy
costs one more copy of the linear weights in memory. Results equal `F.linear`'s to rounding (about 1e-6
relative in fp32: a different summation order), so greedy outputs match Hugging Face's as before; the parity
tests run with packing on.

On a CPU with AVX-512, fp32 and bf16 weights are packed for minivllm's own kernel instead (kernels/cpu_gemm.cpp,
packed_linear: 48-column panels of 32-bit words, one fp32 weight or a bf16 pair each, streamed in storage
order; bf16 needs AVX-512 BF16 for vdpbf16ps). oneDNN ran a 32-row decode step's matmuls at about 60-70% of
this CPU's peak with the weights coming from memory; this runs them 10-25% faster, and 1-row steps at the
memory's bandwidth (docs/benchmarks.md). MINIVLLM_CPU_OWN_GEMM=0 keeps oneDNN.

The gated MLP (`mark_gated_mlps` before packing, `bind_mlp_forwards` after): any module with vLLM's names
`gate_up_proj` (a MergedColumnParallelLinear), `act_fn` (SiluAndMul) and `down_proj`. Its modeling file's forward,
`down_proj(act_fn(gate_up_proj(x)))`, stays the definition of what it computes; on a CPU it runs one of two ways,
bound once at load (vLLM does such fusions as graph rewrites under torch.compile, vllm/compilation/):

    SiLU in the matmul   where gate/up was packed in gate/up panels (`fuse_silu_and_mul`; here or in
                         quantization.py): the matmul's epilogue computes silu(gate) * up from its accumulators,
                         so the (rows, 2 * intermediate) activation is never written nor read again. Bit for bit
                         the separate pass's values (tests/test_cpu_gemm.py). MINIVLLM_CPU_FUSED_SILU=0 turns it off.
    rows in slices       elsewhere: a CPU's last-level cache is tens of MB, and a 4,096-token prefill's gate/up
                         activation of the default model is 4,096 x 3,072 x 4 bytes = 50 MB, written by one matmul
                         and read back by the next from memory. In slices of at most CPU_SLICE_BYTES it stays in
                         the cache. The same rows and weights, so the same result (tests/test_cpu_mlp_slices.py).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from minivllm import envs
from minivllm.model._kernels import kernels
from torch import nn

from minivllm.model.layers import (ColumnParallelLinear, MergedColumnParallelLinear, ParallelLMHead,
                                  RowParallelLinear, SiluAndMul)

PACKED_DTYPES = (torch.float32, torch.bfloat16)
BATCH_HINT = 32          # the rows oneDNN tunes the layout for (a full decode batch); any row count works


def onednn_available() -> bool:
    """oneDNN's packed linear is in this torch build, and not switched off (MINIVLLM_CPU_PREPACK=0)."""
    if not envs.MINIVLLM_CPU_PREPACK:
        return False
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
         packed: torch.Tensor | None) -> torch.Tensor:
    """y = x @ weight.T + bias. x (rows, in) -> (rows, out); `packed` is `prepack(weight)`: oneDNN's layout (the
    weight's dtype), minivllm's panels (`pack_linear`'s), or None."""
    if packed is None or x.dtype != packed_dtype(packed):
        return F.linear(x, weight, bias)
    if not packed.is_mkldnn:
        return kernels.cpu_ops.packed_linear(x, packed, weight.shape[0], bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def gate_up_gemm(x: torch.Tensor, packed: torch.Tensor, n: int, silu_and_mul: bool) -> torch.Tensor:
    """A gated MLP's gate/up matmul from `packed` in gate/up panels (`prepack_linear_weights`): silu(gate) * up
    (rows, n) with silu_and_mul, else the (rows, panels * 48) product in the panels' column order."""
    out = n if silu_and_mul else packed.shape[0] * kernels.cpu_ops.PANEL_COLS
    return kernels.cpu_ops.packed_linear(x, packed, out, None, silu_and_mul=silu_and_mul)


def fuse_silu_and_mul(module: torch.nn.Module, dtype: torch.dtype) -> bool:
    """Whether `module` (its outputs feeding SiluAndMul) gets its `dtype` weight packed in gate/up panels: the
    kernels run that dtype here and MINIVLLM_CPU_FUSED_SILU is not 0."""
    return getattr(module, "feeds_silu_and_mul", False) and own_gemm(dtype) and envs.MINIVLLM_CPU_FUSED_SILU


def packed_dtype(packed: torch.Tensor) -> torch.dtype:
    """The dtype of the weight `packed` came from: minivllm's bf16 panels are int32 words (bf16 pairs)."""
    return torch.bfloat16 if packed.dtype == torch.int32 else packed.dtype


@functools.lru_cache(maxsize=None)
def own_gemm(dtype: torch.dtype) -> bool:
    """`dtype` weights go to kernels/cpu_gemm.cpp: its build runs that dtype (fp32: AVX-512F, bf16: AVX-512 BF16),
    and MINIVLLM_CPU_OWN_GEMM is not 0."""
    if not envs.MINIVLLM_CPU_OWN_GEMM:
        return False
    return kernels.cpu_ops.packed_linear_available(dtype)


@functools.lru_cache(maxsize=None)
def packable(dtype: torch.dtype) -> bool:
    """Whether this CPU's oneDNN packs `dtype`: bf16 needs AVX-512 (BW/VL/DQ) or AVX-NE-CONVERT, and an AMD
    EPYC with only AVX2 (seen among these machines) refuses it with a RuntimeError. Probed once per dtype
    on a tiny weight, packed and multiplied; a refusal means that dtype keeps F.linear."""
    if not onednn_available() or dtype not in PACKED_DTYPES:
        return False
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(torch.ones(16, 16, dtype=dtype), BATCH_HINT)
        torch.ops.mkldnn._linear_pointwise(torch.ones(2, 16, dtype=dtype), packed, None, "none", [], "")
    except RuntimeError:
        return False
    return True


def prepack(weight: torch.Tensor) -> torch.Tensor | None:
    """A (out, in) CPU weight's packed layout: minivllm's panels (fp32, or bf16 with an even `in`, where
    `own_gemm(dtype)`), else oneDNN's; None where packing does not apply (not a CPU fp32/bf16 matrix, or a dtype
    this CPU's oneDNN cannot pack)."""
    if weight.device.type != "cpu" or weight.dim() != 2:
        return None
    if weight.dtype in PACKED_DTYPES and own_gemm(weight.dtype) and (
            weight.dtype == torch.float32 or weight.shape[1] % 2 == 0):
        return kernels.cpu_ops.pack_linear(weight.detach())
    if not packable(weight.dtype):
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), BATCH_HINT)


LINEAR_LAYERS = (ColumnParallelLinear, RowParallelLinear, ParallelLMHead)


class PackedLinearMethod:
    """A linear layer's matmul from `layer.packed_weight` (`prepack`'s): minivllm's panels or oneDNN's layout."""

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return gemm(x, layer.weight, bias, layer.packed_weight)


class GateUpPanelsMethod:
    """A gated MLP's gate/up matmul from `layer.packed_weight` in gate/up panels (`interleave_gate_up`):
    with silu_and_mul, silu(gate) * up (rows, n) straight from the matmul (the gated MLP calls it so); without,
    [gate | up] (rows, 2 * n) as any linear layer answers, the panels' columns put back in order."""

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None,
              silu_and_mul: bool = False) -> torch.Tensor:
        n = layer.out_sizes[0]
        y = gate_up_gemm(x, layer.packed_weight, n, silu_and_mul)
        return y if silu_and_mul else y[..., kernels.cpu_ops.gate_up_columns(n)]


PACKED, GATE_UP_PANELS = PackedLinearMethod(), GateUpPanelsMethod()        # stateless: one for every layer


def prepack_linear_weights(model: torch.nn.Module) -> int:
    """Give every linear layer its packed weight (`packed_weight`, None where packing does not apply) and the
    method that multiplies by it. Returns how many were packed (0 when oneDNN is unavailable or switched off:
    the layers then keep F.linear)."""
    layers = [m for m in model.modules() if isinstance(m, LINEAR_LAYERS)]
    for module in layers:
        module.packed_weight, module.packed_silu_and_mul = None, False
    if not onednn_available():
        return 0
    for module in layers:
        weight = module.weight
        if fuse_silu_and_mul(module, weight.dtype) and (weight.dtype == torch.float32 or weight.shape[1] % 2 == 0):
            module.packed_weight = kernels.cpu_ops.pack_linear(kernels.cpu_ops.interleave_gate_up(weight.detach()))
            module.packed_silu_and_mul = True
            module.quant_method = GATE_UP_PANELS
        else:
            module.packed_weight = prepack(weight)
            if module.packed_weight is not None:
                module.quant_method = PACKED
    return sum(m.packed_weight is not None for m in layers)


def use_column_major_linear_weights(model: torch.nn.Module) -> None:
    """Store each linear weight (out, in) column-major, i.e. as a contiguous (in, out) matrix seen through
    .t(). Same shape and values; F.linear(x, W) computes x @ W.t(), which is then a plain row-major matmul,
    and on a CPU MKL's kernel for that is 1.4-2x faster at decode's few rows than the transposed one
    (equal at prefill sizes). The tied embedding / LM head keeps row-major rows, which the embedding lookup
    gathers. float32 only: PyTorch's bf16 / fp16 matmul on a CPU without bf16 arithmetic (AVX2) has a fast
    path for row-major weights alone, and is 15-20x slower column-major (2026-11-28, AMD EPYC, AVX2: a
    576 x 3072 bf16 layer at 6 rows 2.0 ms row-major, 23.7 ms column-major; at 512 rows 105 ms and 2.1 s)."""
    for module in model.modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)) and module.weight.dtype == torch.float32:
            module.weight.data = module.weight.data.t().contiguous().t()


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
