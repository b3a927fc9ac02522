"""Quantization of the linear layers on a CPU: weight-only `quantization="int8" | "int4" | "gguf"`, and
`"w8a8_int8"` / `"w4a8_int8"`, int8 or int4 weights times int8 activations.

Owns: turning each linear layer's (out, in) weight, once after loading, into fewer bytes, and the matmul
that reads them (`quant_method.apply(layer, x, bias)`, vLLM's name for the per-layer method object).

    int8   per output channel, symmetric:   w[n, :] ~ scale[n] * q[n, :],             q in [-128, 127]
    int4   per group of 32 inputs, with a minimum:  w[n, g] ~ d[n, g] * q + m[n, g],  q in [0, 15]
    w8a8_int8  int8's weights, and each row of x (a token) quantized as it arrives, symmetric:
               x[r, :] ~ s[r] * qx[r, :], s[r] = max|x[r, :]| / 127 (quantize_activations); the products are
               integer (AVX-512 VNNI's vpdpbusd, 64 multiply-adds an instruction, twice bf16's), so a matmul bound by
               arithmetic (a decode step at batch 32, a prefill) runs up to twice as fast; the rounding of x costs
               quality (perplexities below). vLLM's W8A8 int8 scheme with dynamic per-token activation scales
               (compressed-tensors), made from a full checkpoint at load; SGLang names the option w8a8_int8.
    w4a8_int8  int4's weights, and x rounded to int8 in groups of 32 along `in`, each with its own scale
               (quantize_activation_groups): llama.cpp's Q4_1 x Q8_1 arithmetic. q (0..15) and qx are exactly
               vpdpbusd's unsigned and signed operands; each group's exact int32 sum is then scaled by d s and
               m s sum(qx). Perplexity close to int4's (a group's scale follows its own values); AVX-512 VNNI only.
    gguf   int4 whose groups *are* the checkpoint's own: the embedded default model was shipped as a Q4_1
           GGUF (exactly the int4 format above: d and m per 32 weights) and dequantized to fp32 once, so its
           Q4_1 blocks come back exactly from the fp32 weights. A checkpoint whose weights are not Q4_1
           values is refused with an error (use int4 there).

Where the CPU has AVX-512 BF16 the matmuls are minivllm's own (`kernels/cpu_gemm.cpp`, `int8_linear` and
`int4_linear`): the weights are packed once into 48-column panels, and each quantized pair is widened to a bf16
pair in registers as it is read and multiplied with `vdpbf16ps` (int8: exact, the fp32 per-channel scale
applied to the sums; int4: q exact in bf16 too, each group's sums of x q scaled by d, plus m times the group's
sum of x). Elsewhere (or with MINIVLLM_CPU_OWN_GEMM=0) they are PyTorch's CPU kernels for packed integer
weights (`torch._weight_int8pack_mm`, `torch._weight_int4pack_mm_for_cpu`, bf16 scales). Both take bf16
activations, so the layer casts its input to bf16 and the result back to the model's dtype.

Measured on the CI machines (2 cores, AVX-512 BF16, Zen 4), one decode step's matmuls of the default model
(30 layers, weights from memory): int8 at 1 row 4.3-5.0 ms against bf16's 8.1-8.5 and PyTorch's 10.7, at 32
rows 21.1-21.7 against 22.2-24.0 and 64.5; int4 at 1 row 3.8 (PyTorch's 3.8), at 32 rows 25.4 (PyTorch's
42.7, which dequantizes per row block instead of feeding AVX-512 BF16 dot products). docs/benchmarks.md.

w8a8_int8 (cpu_gemm.cpp's `w8a8_linear`, AVX-512 VNNI): int8 weights in panels of 4 int8 a word, x rounded
per row in the call, `vpdpbusd` into int32 sums (exact), then one fp32 scaling; x and y in the model's dtype
(fp32 or bf16). The default model's matmuls at 32 rows 12.3 ms against bf16's 20.3; the engine's decode step
at batch 32 25.3 ms against bf16's 34.5, a 4,096-token prefill 1.5 s against 2.5-2.7 s; perplexity 49.04
against fp32's 45.81 (docs/benchmarks.md). Elsewhere `int8_matmul` on the same integers (quantize_activations,
then exact sums in float32 blocks). w4a8_int8 (`w4a8_linear`, VNNI only): int4's nibbles, two word rows a
192-byte chunk, each group's int32 sum scaled by d s and m s sum(qx); matmuls at 32 rows 15.7 ms,
at 1 row 4.3 (the fewest bytes); a decode step at batch 1 7.6-7.8 ms against bf16's 11.2-15.7, at batch 32
29-33 ms against 37.5-40 in one run; perplexity 47.87 against int4's 47.89.

The embedding keeps its full weight (a lookup reads one row per token); the LM head, tied to it in the
default model, gets its own quantized copy (it is 21% of the default model's weights and read every step).
Under gguf the head is int8: the GGUF stored the embedding in an 8-bit format (about 29 distinct values per
32 weights), not in Q4_1, and every linear layer's weights are exact Q4_1 values (checked at load).
CUDA: not implemented; the option is refused there with a message (minivllm/platforms/__init__.py).

Must never: keep a quantized linear layer's full weight (it is freed: only the quantized one can run), or
answer a gate/up layer's plain product in any column order but [gate | up] (`_in_order`).
"""

from __future__ import annotations

import torch

from minivllm.model._kernels import kernels
from minivllm.model.layers import ColumnParallelLinear, ParallelLMHead, RowParallelLinear
from minivllm.platforms.cpu import gemm

METHODS = ("int8", "int4", "gguf", "w8a8_int8", "w4a8_int8")
GROUP_SIZE = 32            # int4 / Q4_1: weights per (scale, minimum) pair along the input dimension
ACT_DTYPE = torch.bfloat16


def own_quantized_kernels() -> bool:
    """int8 and int4 layers go to minivllm's kernels (kernels/cpu_gemm.cpp, int8_linear / int4_linear): they need
    what the bf16 one needs (AVX-512 BF16), and MINIVLLM_CPU_OWN_GEMM=0 switches them all off."""
    return gemm.own_gemm(torch.bfloat16)


def _in_order(layer: torch.nn.Module, y: torch.Tensor, silu_and_mul: bool) -> torch.Tensor:
    """A product from gate/up panels without silu_and_mul has its columns in panel order: [gate | up] again,
    as any linear layer answers (a direct caller: tests, `dequantize`). Everything else passes through."""
    if silu_and_mul or not getattr(layer, "packed_silu_and_mul", False):
        return y
    return y[..., kernels.cpu_ops.gate_up_columns(layer.out_sizes[0])]


class Int8WeightOnlyMethod:
    name = "int8"

    @staticmethod
    def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """w (out, in) -> q (out, in) int8 and scale (out,) fp32, w ~ scale[:, None] * q."""
        scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-12)
        return torch.round(w / scale[:, None]).clamp(-128, 127).to(torch.int8), scale

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        in_features = layer.weight.shape[1]
        if in_features % 2:
            # minivllm's kernel takes int8 pairs; PyTorch's _weight_int8pack_mm crashes the process on an odd
            # `in` (a segmentation fault in torch 2.13)
            raise ValueError(f"quantization='int8' needs in_features divisible by 2; a layer has {in_features}. "
                             "Leave quantization unset for this model.")
        q, scale = self.quantize(layer.weight.detach().float())
        if own_quantized_kernels():
            if getattr(layer, "packed_silu_and_mul", False):              # gate/up panels (quantize_linear_weights)
                q, scale = kernels.cpu_ops.interleave_gate_up(q), kernels.cpu_ops.interleave_gate_up(scale)
            layer.qweight = kernels.cpu_ops.pack_int8_linear(q)            # (panels, in / 2, 48) int16: int8 pairs
            layer.qscale = scale                                          # fp32, one per packed column
        else:
            layer.qweight, layer.qscale = q, scale.to(ACT_DTYPE)           # PyTorch's kernel: (out, in), bf16 scales
            layer.packed_silu_and_mul = False                             # it has no gate/up panels: SiLU separate

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None,
              silu_and_mul: bool = False) -> torch.Tensor:
        """y = x @ w.T + bias; with silu_and_mul (gate/up panels) silu(gate) * up (gemm.py's gated MLP)."""
        if layer.qweight.dim() == 3:                                      # packed for int8_linear
            out = layer.out_sizes[0] if silu_and_mul else layer.qscale.numel()
            y = kernels.cpu_ops.int8_linear(x.to(ACT_DTYPE), layer.qweight, layer.qscale, out, None, silu_and_mul)
            y = _in_order(layer, y, silu_and_mul)
        else:
            y = torch._weight_int8pack_mm(x.to(ACT_DTYPE), layer.qweight, layer.qscale)
        y = y.to(x.dtype)
        return y if bias is None else y + bias


class Int4WeightOnlyMethod:
    """Groups of 32 along the input: q = round((w - m) / d) with m the group's minimum and d = range / 15."""

    name = "int4"
    FALLBACK = "int8"          # what the error suggests where a layer's `in` is not a multiple of 32

    def weight_groups(self, layer: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The layer's weight as q (out, in) and d, m (out, in / 32) (quantize_groups), `in` checked first."""
        w = layer.weight.detach().float()
        out_features, in_features = w.shape
        if in_features % GROUP_SIZE:
            raise ValueError(f"quantization={self.name!r} needs in_features divisible by {GROUP_SIZE}; a layer "
                             f"has {in_features}. Use quantization={self.FALLBACK!r} for this model.")
        q, d, m = self.quantize_groups(w.view(out_features, in_features // GROUP_SIZE, GROUP_SIZE))
        return q.view(out_features, in_features), d, m

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        q, d, m = self.weight_groups(layer)
        if own_quantized_kernels():
            if getattr(layer, "packed_silu_and_mul", False):              # gate/up panels (quantize_linear_weights)
                q, d, m = (kernels.cpu_ops.interleave_gate_up(t) for t in (q, d, m))
            # (panels, in / 2, 48) nibble pairs; (panels, groups, 2, 48) fp32 d and m
            layer.qweight, layer.qscales_zeros = kernels.cpu_ops.pack_int4_linear(q.to(torch.uint8), d, m)
            layer.qout = q.shape[0]                                       # packed columns
            return
        layer.qweight = torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
        # PyTorch's int4 matmul computes w = (q - 8) * scale + zero, so zero = m + 8 d.      (groups, out, 2)
        layer.qscales_zeros = torch.stack([d, m + 8 * d], dim=-1).transpose(0, 1).contiguous().to(ACT_DTYPE)

    def quantize_groups(self, w: torch.Tensor):
        """w (out, groups, 32) -> q (out, groups, 32) in [0, 15], d and m (out, groups)."""
        m = w.amin(dim=-1)
        d = ((w.amax(dim=-1) - m) / 15).clamp(min=1e-12)
        q = torch.round((w - m[..., None]) / d[..., None]).clamp(0, 15)
        return q, d, m

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None,
              silu_and_mul: bool = False) -> torch.Tensor:
        """y = x @ w.T + bias; with silu_and_mul (gate/up panels) silu(gate) * up (gemm.py's gated MLP)."""
        if layer.qweight.dim() == 3:                                      # packed for int4_linear
            out = layer.out_sizes[0] if silu_and_mul else layer.qout
            y = kernels.cpu_ops.int4_linear(x.to(ACT_DTYPE), layer.qweight, layer.qscales_zeros, out, None,
                                            silu_and_mul)
            y = _in_order(layer, y, silu_and_mul)
        else:
            y = torch._weight_int4pack_mm_for_cpu(x.to(ACT_DTYPE), layer.qweight, GROUP_SIZE, layer.qscales_zeros)
        y = y.to(x.dtype)
        return y if bias is None else y + bias


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (rows, in) -> q (rows, in) int8 and s (rows,) fp32 with x ~ s[:, None] * q: per row, symmetric, from this
    x (dynamic). s = max(max|x| / 127, 1e-12), q = round(x / s) to nearest even, in fp32: the same operations as
    w8a8_linear's quantize_rows (cpu_gemm.cpp), so the same bytes (it stores q + 128)."""
    xf = x.float()
    s = (xf.abs().amax(dim=-1) / 127).clamp(min=1e-12)
    return torch.round(xf / s[..., None]).to(torch.int8), s


class W8A8Int8Method:
    """int8 weights per output channel (Int8WeightOnlyMethod.quantize) and int8 activations per row; the products
    and their sums are exact integers, so y = s[r] * scale[n] * sum_k qx[r, k] q[n, k] rounds only in the end."""

    name = "w8a8_int8"
    MULTIPLE = 16              # `in` a multiple of 16: the kernel quantizes x 16 lanes at a time

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        in_features = layer.weight.shape[1]
        if in_features % self.MULTIPLE:
            raise ValueError(f"quantization='w8a8_int8' needs in_features divisible by {self.MULTIPLE}; a layer has "
                             f"{in_features}. Use quantization='int8' for this model.")
        q, scale = Int8WeightOnlyMethod.quantize(layer.weight.detach().float())
        if own_w8a8_kernel():
            if getattr(layer, "packed_silu_and_mul", False):              # gate/up panels (quantize_linear_weights)
                q, scale = kernels.cpu_ops.interleave_gate_up(q), kernels.cpu_ops.interleave_gate_up(scale)
            # (panels, in / 4, 48) int32: 4 int8 along `in`; (panels, 48) int32: -128 sum_k q per column
            layer.qweight, layer.qoffset = kernels.cpu_ops.pack_w8a8_linear(q)
        else:
            layer.qweight = q.t().contiguous()                            # (in, out) for int8_matmul
            layer.packed_silu_and_mul = False
        layer.qscale = scale                                              # fp32, one per (packed) column

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None,
              silu_and_mul: bool = False) -> torch.Tensor:
        """y = x @ w.T + bias with x rounded per row to int8; silu_and_mul (gate/up panels): silu(gate) * up."""
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if layer.qweight.dim() == 3:                                      # packed for w8a8_linear
            out = layer.out_sizes[0] if silu_and_mul else layer.qscale.numel()
            xin = x2 if x2.dtype in (torch.float32, torch.bfloat16) else x2.float()
            y = kernels.cpu_ops.w8a8_linear(xin, layer.qweight, layer.qoffset, layer.qscale, out, None, silu_and_mul)
            y = _in_order(layer, y, silu_and_mul)
        else:                                                             # PyTorch: the same integers, exact sums
            qx, s = quantize_activations(x2)
            y = int8_matmul(qx, layer.qweight).float() * s[:, None] * layer.qscale
        y = y.to(x.dtype).view(*shape[:-1], y.shape[-1])
        return y if bias is None else y + bias


# |qx q| <= 127 * 128, so a float32 sum of up to EXACT_K such products stays below 2**24 in every partial sum:
# each is an integer float32 holds exactly, whatever order the matmul adds them in.
EXACT_K = 1024


def int8_matmul(qx: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """qx (rows, in) int8 @ q (in, out) int8 -> (rows, out) int32, the exact integer sums (torch._int_mm's). On a
    CPU without AVX-512 VNNI torch._int_mm is a slow loop (2026-11-28, AMD EPYC, AVX2: 1,000 rows x 576 x 49,152
    in 86 s); float32 BLAS over blocks of EXACT_K along `in` gives the same integers in 0.85 s."""
    y = None
    for k in range(0, qx.shape[1], EXACT_K):
        block = (qx[:, k:k + EXACT_K].float() @ q[k:k + EXACT_K].float()).to(torch.int32)
        y = block if y is None else y + block
    return y


def quantize_activation_groups(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x (rows, in), `in` a multiple of 32 -> qx (rows, in) int8, s and s_sum (rows, in / 32) fp32, per group of 32
    along `in`: s = max(max|x| / 127, 1e-12), qx = round(x / s) to nearest even, s_sum = s * sum(qx), in fp32 (the
    operations of w4a8_linear's quantize_groups in cpu_gemm.cpp, so the same bytes)."""
    rows, cols = x.shape
    xg = x.float().view(rows, cols // GROUP_SIZE, GROUP_SIZE)
    s = (xg.abs().amax(dim=-1) / 127).clamp(min=1e-12)
    qx = torch.round(xg / s[..., None]).to(torch.int8)
    return qx.view(rows, cols), s, s * qx.sum(dim=-1).float()


class W4A8Int8Method(Int4WeightOnlyMethod):
    """int4 weights (Int4WeightOnlyMethod's groups) times x rounded to int8 per group of 32 (Q4_1 x Q8_1):
    y[r, n] = sum_g s[r, g] (d[n, g] sum_{k in g} q[n, k] qx[r, k] + m[n, g] sum_{k in g} qx[r, k])."""

    name = "w4a8_int8"
    FALLBACK = "w8a8_int8"

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        if not own_w8a8_kernel():
            raise ValueError("quantization='w4a8_int8' runs on minivllm's kernel only, which needs AVX-512 VNNI and "
                             "BF16 (and MINIVLLM_CPU_OWN_GEMM not 0); this CPU or setting has none. Use "
                             "quantization='int4' (the same weights, bf16 activations) or 'w8a8_int8'.")
        q, d, m = self.weight_groups(layer)
        if getattr(layer, "packed_silu_and_mul", False):                  # gate/up panels (quantize_linear_weights)
            q, d, m = (kernels.cpu_ops.interleave_gate_up(t) for t in (q, d, m))
        # (panels, in / 8, 192) nibbles of two word rows; (panels, groups, 2, 48) fp32 d and m
        layer.qweight, layer.qscales_zeros = kernels.cpu_ops.pack_w4a8_linear(q.to(torch.uint8), d, m)
        layer.qout = q.shape[0]                                           # packed columns

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None,
              silu_and_mul: bool = False) -> torch.Tensor:
        """y = x @ w.T + bias with x rounded to int8 per group; silu_and_mul (gate/up panels): silu(gate) * up."""
        out = layer.out_sizes[0] if silu_and_mul else layer.qout
        xin = x if x.dtype in (torch.float32, torch.bfloat16) else x.float()
        y = kernels.cpu_ops.w4a8_linear(xin, layer.qweight, layer.qscales_zeros, out, None, silu_and_mul)
        y = _in_order(layer, y, silu_and_mul).to(x.dtype)
        return y if bias is None else y + bias


def own_w8a8_kernel() -> bool:
    """w8a8_int8 and w4a8_int8 layers go to minivllm's kernels (cpu_gemm.cpp's w8a8_linear, w4a8_linear) where the
    CPU has AVX-512 VNNI and BF16 and MINIVLLM_CPU_OWN_GEMM is not 0; elsewhere w8a8_int8 goes to int8_matmul
    (int8 x int8 -> int32, exact) after quantize_activations, and w4a8_int8 is refused."""
    return gemm.own_gemm(torch.bfloat16) and kernels.cpu_ops.w8a8_linear_available()


class GGUFQ4_1Method(Int4WeightOnlyMethod):
    """int4 that must reproduce the weights exactly (up to fp32 rounding): the checkpoint's own Q4_1 blocks."""

    name = "gguf"
    TOLERANCE = 1e-5           # relative to each group's range: Q4_1 values come back to fp32 rounding

    def quantize_groups(self, w):
        q, d, m = super().quantize_groups(w)
        error = ((q * d[..., None] + m[..., None]) - w).abs().amax(dim=-1) / (15 * d)     # (out, groups)
        worst = float(error.max())
        if worst > self.TOLERANCE:
            raise ValueError(f"quantization='gguf' needs weights that are Q4_1 values (a checkpoint converted from "
                             f"a Q4_1 GGUF, like the embedded default model); this one is off by up to {worst:.2g} "
                             "of a group's range. Use quantization='int4' (or 'int8') to quantize it.")
        return q, d, m


def dequantize(layer: torch.nn.Module) -> torch.Tensor:
    """The (out, in) weight a quantized layer multiplies by, as its own kernel sees it: the kernel applied to
    the identity (rounded to bf16, the kernel's output dtype). For tests and quality reports."""
    in_features = layer.weight.shape[1] if layer.weight.numel() else layer.in_features
    eye = torch.eye(in_features, dtype=ACT_DTYPE)
    y = layer.quant_method.apply(layer, eye, None)                    # (in, out); gate/up: [gate | up]
    return y.float().t()


def get_quant_method(name: str):
    methods = {"int8": Int8WeightOnlyMethod, "int4": Int4WeightOnlyMethod, "gguf": GGUFQ4_1Method,
               "w8a8_int8": W8A8Int8Method, "w4a8_int8": W4A8Int8Method}
    if name not in methods:
        raise ValueError(f"quantization is {name!r}; choose one of {', '.join(METHODS)} or leave it unset.")
    return methods[name]()


def quantize_linear_weights(model: torch.nn.Module, name: str, device: torch.device,
                            dtype: torch.dtype = ACT_DTYPE) -> int:
    """Give every linear layer (and the LM head) `name`'s quant method and quantized weights; the plain
    weight of a linear layer is then freed. Returns how many layers were quantized. A gated MLP's gate/up
    layer of a bf16 model (`dtype`, the model's) is packed in gate/up panels for the activation in the matmul
    (gemm.fuse_silu_and_mul); another dtype keeps the separate pass, which computes silu in that dtype."""
    if device.type != "cpu":
        raise ValueError(f"quantization={name!r} is implemented for the CPU only (PyTorch's packed-int CPU "
                         "kernels); on a GPU use dtype='bfloat16' and leave quantization unset.")
    method = get_quant_method(name)
    count = 0
    for module in model.modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear, ParallelLMHead)):
            # gguf: the default model's GGUF stores its embedding (= the LM head) in an 8-bit format, not Q4_1
            this = Int8WeightOnlyMethod() if name == "gguf" and isinstance(module, ParallelLMHead) else method
            if isinstance(this, (W8A8Int8Method, W4A8Int8Method)):    # these answer in the model's dtype
                module.packed_silu_and_mul = (dtype in (torch.float32, ACT_DTYPE) and own_w8a8_kernel()
                                              and gemm.fuse_silu_and_mul(module, ACT_DTYPE))
            else:
                module.packed_silu_and_mul = dtype == ACT_DTYPE and gemm.fuse_silu_and_mul(module, ACT_DTYPE)
            this.process_weights_after_loading(module)
            module.quant_method = this
            module.in_features = module.weight.shape[1]
            if not isinstance(module, ParallelLMHead):            # the head's weight is the embedding's
                module.weight.data = torch.empty(0, dtype=module.weight.dtype)
            count += 1
    return count
