"""The CPU kernels, in C++ (`cpu_attention.cpp`, `cpu_layers.cpp`, `cpu_sampling.cpp`, `cpu_gemm.cpp`, and the
dtype conversions they include, `cpu_dtype.h`), built on first use with the machine's C++ compiler.

    paged_decode_attention   same signature as reference.paged_decode_attention / triton_ops'; reads K and V
                             straight from the paged cache (no gather), a sequence per work item
    prefill_attention        fresh prompts (no cached context), causal over this step's own K and V
    store_kv_cache           reference.store_kv_cache for a cache in the model's dtype, in one pass
    rms_norm                 layers.RMSNorm (with the residual add), one pass per row
    silu_and_mul             layers.SiluAndMul: silu(gate) * up
    rotary_embedding         layers.RotaryEmbedding's rotation of q and k
    argmax_rows              torch.argmax(logits, dim=-1) for the sampler's greedy rows
    packed_linear            F.linear in fp32 or bf16 from a weight packed once (pack_linear); AVX-512 only
    int8_linear, int4_linear the same from weight-only int8 / int4 (pack_int8_linear, pack_int4_linear);
                             AVX-512 BF16 only
    w8a8_linear              the same from int8 weights with x quantized to int8 per row (pack_w8a8_linear),
                             integer dot products; AVX-512 VNNI and BF16 only
    w4a8_linear              the same from int4 weights (groups of 32) with x quantized to int8 in groups of 32
                             (pack_w4a8_linear); AVX-512 VNNI and BF16 only

`load()` compiles the sources once per machine with torch's cpp_extension (about 12 s here; cached under
TORCH_EXTENSIONS_DIR, ~/.cache/torch_extensions by default) and registers `torch.ops.minivllm_cpu`.
With no compiler, or MINIVLLM_CPU_KERNELS=0, `available()` is False with the reason in `unavailable_reason()`,
and the serving path stays on the PyTorch reference (model/attention.py picks).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import platform
import shutil
from pathlib import Path

import torch

_SOURCES = [Path(__file__).with_name(name)
            for name in ("cpu_attention.cpp", "cpu_layers.cpp", "cpu_sampling.cpp", "cpu_gemm.cpp")]
# included by the sources; part of the build's name
_HEADERS = [Path(__file__).with_name(name) for name in ("cpu_dtype.h", "cpu_vec.h")]
# -ffast-math lets GCC vectorize expf (glibc's SIMD exp) and reorder fp32 sums; it is a compile flag only, never
# a link flag: linked into a shared library it would set flush-to-zero for the whole process (a test checks).
_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffast-math"]
_state: dict = {}          # "ops" (the loaded namespace) or "error" (why not), set by the first load()


def _build_name() -> str:
    """Extension name: changes when the source or the machine's CPU does, since it is built with -march=native."""
    flags = ""
    if Path("/proc/cpuinfo").exists():
        flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    key = b"".join(p.read_bytes() for p in _SOURCES + _HEADERS) + " ".join(_CFLAGS + [flags, platform.machine()]).encode()
    digest = hashlib.sha1(key).hexdigest()[:10]
    return f"minivllm_cpu_{digest}"


def load():
    """Builds (first time) and loads the extension; returns torch.ops.minivllm_cpu, or raises RuntimeError."""
    if "ops" in _state:
        return _state["ops"]
    if "error" in _state:
        raise RuntimeError(_state["error"])
    try:
        from minivllm import envs                  # the one reader of MINIVLLM_* variables
        if not envs.MINIVLLM_CPU_KERNELS:
            raise RuntimeError("MINIVLLM_CPU_KERNELS=0")
        if shutil.which(os.environ.get("CXX", "c++")) is None:
            raise RuntimeError("no C++ compiler on PATH (install g++, or set CXX)")
        from torch.utils import cpp_extension
        name = _build_name()
        build_dir = Path(cpp_extension._get_build_directory(name, verbose=False))
        with _build_lock(build_dir):
            cpp_extension.load(name=name, sources=[str(p) for p in _SOURCES], is_python_module=False,
                               extra_cflags=_CFLAGS, extra_ldflags=["-fopenmp"], build_directory=str(build_dir))
        _state["ops"] = torch.ops.minivllm_cpu
    except Exception as exc:     # noqa: BLE001 (any build failure means: serve with the reference instead)
        _state["error"] = f"the C++ CPU kernels could not be built: {exc}"
        raise RuntimeError(_state["error"]) from exc
    return _state["ops"]


@contextlib.contextmanager
def _build_lock(build_dir: Path):
    """One builder at a time, and no wait on a dead one. torch's own lock is a file that a build killed half way
    (Ctrl-C, a timeout) leaves behind, and every later load then waits for it forever. This lock is an flock, which
    the kernel drops when its holder dies; whoever holds it knows nobody is building, so a torch lock file found
    then is stale and is removed."""
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / "minivllm.build.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        (build_dir / "lock").unlink(missing_ok=True)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def available() -> bool:
    try:
        load()
    except RuntimeError:
        return False
    return True


def unavailable_reason() -> str | None:
    return None if available() else _state["error"]


def paged_decode_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """query (num_seqs, num_heads, head_dim) -> (num_seqs, num_heads, head_dim), as the reference's."""
    return load().paged_decode_attention(query.contiguous(), key_cache, value_cache,
                                         block_tables.to(torch.int32).contiguous(),
                                         seq_lens.to(torch.int32).contiguous(), float(scale),
                                         float(k_scale), float(v_scale))


def prefill_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, starts: list[int],
                      lens: list[int], scale: float) -> torch.Tensor:
    """Whole prompts attending causally to their own K and V (no cache): sequence s is rows starts[s] ...
    starts[s] + lens[s] - 1 of query (num_tokens, num_heads, head_dim) and key, value (num_tokens, num_kv_heads,
    head_dim), at positions 0 ... lens[s] - 1. Returns (num_tokens, num_heads, head_dim) in the query's dtype,
    fp32 inside; rows in no sequence are left unwritten."""
    return load().prefill_attention(query, key, value, torch.tensor(starts, dtype=torch.int64),
                                    torch.tensor(lens, dtype=torch.int64), float(scale))


def store_kv_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """As reference.store_kv_cache, for caches in key's dtype (an fp8 cache takes K and V already quantized:
    reference.quantize_fp8): slots of -1 are skipped."""
    load().store_kv_cache(key, value, key_cache, value_cache, slot_mapping.to(torch.int64).contiguous())


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """logits (rows, vocab) fp32 -> (rows,) int64, torch.argmax(logits, dim=-1)'s answer (first index of the
    maximum; a row with NaN gives its first NaN)."""
    return load().argmax_rows(logits)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """x (..., size) -> norm(x) * weight; with `residual`, (norm(x + residual) * weight, x + residual)."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if residual is None:
        return load().rms_norm(x2, weight, float(eps)).view(shape)
    out, added = load().fused_add_rms_norm(x2, residual.reshape(-1, shape[-1]).contiguous(), weight, float(eps))
    return out.view(shape), added.view(shape)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x (rows, 2 * n) -> silu(x[:, :n]) * x[:, n:], (rows, n)."""
    return load().silu_and_mul(x.contiguous())


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q (tokens, heads, d), k (tokens, kv_heads, d) rotated at `positions`; cos, sin fp32 (max_position, d / 2)."""
    return load().rotary_embedding(positions.long().contiguous(), q, k, cos, sin)


def packed_linear_available(dtype: torch.dtype) -> bool:
    """Whether packed_linear runs `dtype` in this build: the kernels load and the CPU has AVX-512F (fp32) or
    AVX-512 BF16 (bf16) (-march=native)."""
    if dtype not in (torch.float32, torch.bfloat16) or not available():
        return False
    return bool(load().bf16_linear_available() if dtype == torch.bfloat16 else load().fp32_linear_available())


def pack_linear(weight: torch.Tensor) -> torch.Tensor:
    """weight (out, in) fp32, or bf16 with an even `in` -> its packed layout for packed_linear: (panels, words,
    48), fp32 words, or int32 words holding bf16 pairs."""
    return load().pack_linear(weight)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, out_features: int,
                  bias: torch.Tensor | None = None, silu_and_mul: bool = False) -> torch.Tensor:
    """x (..., in) fp32 or bf16 -> x @ weight.T + bias, (..., out_features) in x's dtype, from pack_linear(weight).
    silu_and_mul: `packed` is pack_linear(interleave_gate_up(w)) of a gated MLP's w = [gate | up] (2 n, in), and
    the result is silu(x @ gate.T) * (x @ up.T), (..., n = out_features), rounded as silu_and_mul rounds it."""
    shape = x.shape
    y = load().packed_linear(x.reshape(-1, shape[-1]), packed, int(out_features), bias, silu_and_mul)
    return y.view(*shape[:-1], out_features)


PANEL_COLS = 48        # output columns per panel of the packed layouts (kPanelCols in cpu_gemm.cpp)


def gate_up_columns(n: int) -> torch.Tensor:
    """The packed columns (rows of interleave_gate_up's result) of gate columns 0 ... n - 1, then of up columns
    0 ... n - 1: panel p holds pairs 24 p ... 24 p + 23 as four runs of its 48 columns, so that each register of
    16 columns is whole for silu_and_mul: gate pairs 0-15 | up 0-15 | gate 16-23 | up 16-23."""
    half = PANEL_COLS // 2
    j = torch.arange(n)
    p, i = j // half, j % half
    gate = p * PANEL_COLS + i + 16 * (i >= 16)                       # 0-15, then 32-39
    up = p * PANEL_COLS + i + 16 + 8 * (i >= 16)                     # 16-31, then 40-47
    return torch.cat([gate, up])


def interleave_gate_up(t: torch.Tensor) -> torch.Tensor:
    """A gated MLP's rows t (2 n, ...) = [gate | up] (a weight, int8 q, scales, int4 q, d or m) -> (panels * 48,
    ...) in gate_up_columns' order, the one the kernels' silu_and_mul reads; zero rows pad the last panel. A
    plain product with it gives [gate | up] back through `y[..., gate_up_columns(n)]`."""
    n = t.shape[0] // 2
    panels = -(-n // (PANEL_COLS // 2))
    out = t.new_zeros((panels * PANEL_COLS,) + tuple(t.shape[1:]))
    out[gate_up_columns(n)] = t
    return out


def pack_int8_linear(qweight: torch.Tensor) -> torch.Tensor:
    """qweight (out, in) int8, `in` even -> its packed layout for int8_linear: (panels, in / 2, 48) int16 words,
    each a pair of int8 along `in`."""
    return load().pack_int8_linear(qweight)


def int8_linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, out_features: int,
                bias: torch.Tensor | None = None, silu_and_mul: bool = False) -> torch.Tensor:
    """x (..., in) bf16 -> x @ (scale[:, None] * qweight).T + bias, (..., out_features) bf16, from
    pack_int8_linear(qweight); scale (out,) fp32 per output channel, bias bf16 or None. silu_and_mul: as in
    packed_linear, with qweight and scale both interleave_gate_up's."""
    shape = x.shape
    y = load().int8_linear(x.reshape(-1, shape[-1]), packed, scale, int(out_features), bias, silu_and_mul)
    return y.view(*shape[:-1], out_features)


def pack_int4_linear(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q (out, in) uint8 values 0..15 (`in` a multiple of 32), d and m (out, in / 32) fp32 -> (packed, dm) for
    int4_linear: packed (panels, in / 2, 48) uint8, a pair of q along `in` per byte (low nibble first); dm
    (panels, in / 32, 2, 48) fp32, each group's d and m."""
    return load().pack_int4_linear(q, d, m)


def int4_linear(x: torch.Tensor, packed: torch.Tensor, dm: torch.Tensor, out_features: int,
                bias: torch.Tensor | None = None, silu_and_mul: bool = False) -> torch.Tensor:
    """x (..., in) bf16 -> x @ w.T + bias, w[n][k] = d[n][k // 32] q[n][k] + m[n][k // 32]; (..., out_features)
    bf16, from pack_int4_linear(q, d, m). silu_and_mul: as in packed_linear, with q, d and m interleave_gate_up's."""
    shape = x.shape
    y = load().int4_linear(x.reshape(-1, shape[-1]), packed, dm, int(out_features), bias, silu_and_mul)
    return y.view(*shape[:-1], out_features)


def w8a8_linear_available() -> bool:
    """Whether w8a8_linear runs in this build: the kernels load and the CPU has AVX-512 VNNI and BF16."""
    return available() and bool(load().vnni_linear_available())


def pack_w8a8_linear(qweight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """qweight (out, in) int8, `in` a multiple of 4 -> (packed, offset) for w8a8_linear: packed (panels, in / 4,
    48) int32 words, each 4 int8 along `in`; offset (panels, 48) int32, -128 times each column's sum of q."""
    return load().pack_w8a8_linear(qweight)


def w8a8_linear(x: torch.Tensor, packed: torch.Tensor, offset: torch.Tensor, scale: torch.Tensor,
                out_features: int, bias: torch.Tensor | None = None, silu_and_mul: bool = False) -> torch.Tensor:
    """x (..., in) fp32 or bf16 (`in` a multiple of 16) -> x8 @ (scale[:, None] * qweight).T + bias in x's dtype,
    where x8 is x quantized per row to int8 (minivllm.platforms.cpu.quantization.quantize_activations), from
    pack_w8a8_linear(qweight); scale (out,) fp32. silu_and_mul: as in packed_linear, with qweight and scale both
    interleave_gate_up's."""
    shape = x.shape
    y = load().w8a8_linear(x.reshape(-1, shape[-1]), packed, offset, scale, int(out_features), bias, silu_and_mul)
    return y.view(*shape[:-1], out_features)


def pack_w4a8_linear(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q (out, in) uint8 values 0..15 (`in` a multiple of 32), d and m (out, in / 32) fp32 -> (packed, dm) for
    w4a8_linear: packed (panels, in / 8, 192) uint8, two word rows of 48 columns x 4 k a chunk (low nibbles, then
    high); dm (panels, in / 32, 2, 48) fp32, each group's d and m."""
    return load().pack_w4a8_linear(q, d, m)


def w4a8_linear(x: torch.Tensor, packed: torch.Tensor, dm: torch.Tensor, out_features: int,
                bias: torch.Tensor | None = None, silu_and_mul: bool = False) -> torch.Tensor:
    """x (..., in) fp32 or bf16 -> x8 @ w.T + bias in x's dtype, w[n][k] = d[n][k // 32] q[n][k] + m[n][k // 32]
    from pack_w4a8_linear(q, d, m), x8 = x rounded to int8 in groups of 32
    (minivllm.platforms.cpu.quantization.quantize_activation_groups). silu_and_mul: as in packed_linear, with q, d and m
    interleave_gate_up's."""
    shape = x.shape
    y = load().w4a8_linear(x.reshape(-1, shape[-1]), packed, dm, int(out_features), bias, silu_and_mul)
    return y.view(*shape[:-1], out_features)
