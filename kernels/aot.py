"""Ahead-of-time compilation of the Triton kernels for NVIDIA GPUs, on a machine without one.

Why: on a CPU the kernels only ever run under Triton's interpreter, which executes the tile math in numpy
and checks none of what makes a GPU kernel fast or even compilable: register spills, shared memory over the
SM's limit, a dot too small for tensor cores. Triton can still compile for sm_80 / sm_90 here (its wheel
bundles ptxas, cuobjdump and nvdisasm) if a stub driver tells it which GPU to target.

    stub_driver(arch)           context manager: Triton's active driver is a stub whose target is
                                GPUTarget("cuda", arch, 32); the real one is restored afterwards
    compiling(arch)             stub_driver + every kernel of triton_ops compiles (warmup=True) instead of
                                launching; yields a recorder whose `infos` collect each call's KernelInfo
    compile_wrapper_calls(arch) the project's own wrappers over a grid of shapes -> [KernelInfo]: the tile
                                sizes compiled are exactly those the wrappers choose
    compile_stage_variants(arch) the attention kernels at num_stages 1, 2, 3 and as chosen (lesson 06)
    violations(info)            what is wrong with one compiled kernel (spill, stack, shared memory, a
                                fp16/bf16 dot without tensor-core instructions)
    python kernels/aot.py --arch 90 [--json FILE] [--stages]   the same in a process of its own (a table)

The wrappers' kernels must be JITFunctions, so TRITON_INTERPRET must not be "1" when triton is first
imported: the tests (whose conftest sets it on a CPU) call this module's command line in a subprocess, one
per architecture, which also keeps the stub driver out of their own process.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
import triton.language as tl

# Per-block shared memory an SM can grant (opt-in maximum), bytes: A100 163 KB, H100 227 KB.
SHARED_MEM_LIMIT = {80: 163 * 1024, 90: 227 * 1024}
# Kernels whose fp16/bf16 variants must use tensor cores (they do their math with tl.dot).
DOT_KERNELS = {"_paged_decode_kernel", "_paged_prefill_kernel"}
TENSOR_CORE_SASS = re.compile(r"\b(HMMA|HGMMA|IMMA|UTCHMMA|UTCQMMA)\b")
TENSOR_CORE_PTX = re.compile(r"\b(mma\.sync|wgmma\.mma_async|tcgen05\.mma)")


@dataclasses.dataclass
class KernelInfo:
    name: str                       # the @triton.jit function's name
    arch: int                       # 80 or 90
    case: str                       # which wrapper call (shape) produced it
    dtype: str                      # the cache's / query's dtype: float16, bfloat16, float32
    config: dict                    # constexprs and launch options (num_warps, num_stages)
    error: str | None = None        # compile error, else None
    registers: int = 0
    stack_bytes: int = 0            # cuobjdump STACK (spill stores land here)
    spill_store_bytes: int = 0      # from ptxas -v (only run when stack_bytes > 0; 0 otherwise by construction)
    spill_load_bytes: int = 0
    shared_bytes: int = 0           # Triton's metadata.shared (what the launch asks the SM for)
    uses_tensor_cores: bool = False
    tensor_core_instrs: str = ""    # e.g. "mma.sync", "wgmma.mma_async" (PTX); "HMMA" (SASS, read if PTX has none)
    uses_dot: bool = False

    @property
    def spill_bytes(self) -> int:
        return self.spill_store_bytes + self.spill_load_bytes

    def key(self) -> str:
        """A stable name for one compiled binary: kernel, arch, dtype and its compile-time configuration."""
        cfg = ",".join(f"{k}={v}" for k, v in sorted(self.config.items()))
        return f"sm_{self.arch}/{self.name}/{self.dtype}/{cfg}"


def violations(info: KernelInfo) -> list[str]:
    """The rules a compiled kernel must satisfy; an empty list means it does."""
    if info.error:
        return [f"compile error: {info.error.strip().splitlines()[-1][:300]}"]
    out = []
    if info.spill_bytes or info.stack_bytes:
        out.append(f"register spill: {info.spill_store_bytes} B stores, {info.spill_load_bytes} B loads, "
                   f"{info.stack_bytes} B stack ({info.registers} registers)")
    limit = SHARED_MEM_LIMIT[info.arch]
    if info.shared_bytes > limit:
        out.append(f"shared memory {info.shared_bytes} B > sm_{info.arch} limit {limit} B")
    if info.uses_dot and info.dtype.endswith(("float16", "bfloat16")) and not info.uses_tensor_cores:
        out.append("tl.dot on fp16/bf16 but no tensor-core instruction (mma/wgmma/HMMA) in PTX or SASS")
    return out


# ---------------------------------------------------------------------------------------------- the driver

def _tool(name: str) -> str:
    import triton
    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


def _stub_driver_class():
    from triton.backends.compiler import GPUTarget
    from triton.backends.driver import DriverBase

    class _Utils:
        def __init__(self, arch):
            self.arch = arch

        def get_device_properties(self, device):
            return {"max_shared_mem": SHARED_MEM_LIMIT[self.arch], "multiprocessor_count": 132,
                    "max_num_regs": 65536, "warpSize": 32, "sm_clock_rate": 0, "mem_clock_rate": 0,
                    "mem_bus_width": 0}

        def load_binary(self, *args, **kwargs):
            raise RuntimeError("the AOT stub driver compiles only; it cannot load or launch a kernel")

    class StubCudaDriver(DriverBase):
        """Compiles for `GPUTarget("cuda", arch, 32)`; cannot launch. The 'device' number is the arch, so
        JITFunction's per-device caches never mix two architectures' binaries in one process."""

        def __init__(self, arch: int):
            super().__init__()
            self.arch = arch
            self.utils = _Utils(arch)

        @classmethod
        def is_active(cls):
            return False

        def map_python_to_cpp_type(self, ty: str) -> str:
            return "void*" if ty.startswith("*") else ty

        def get_current_target(self):
            return GPUTarget("cuda", self.arch, 32)

        def get_active_torch_device(self):
            import torch
            return torch.device("cpu")

        def get_current_device(self):
            return self.arch

        def set_current_device(self, device):
            pass

        def get_current_stream(self, device=None):
            return 0

        def get_device_capability(self, device=None):
            return divmod(self.arch, 10)

        def get_benchmarker(self):
            raise RuntimeError("no benchmarking without a GPU")

    return StubCudaDriver


@contextlib.contextmanager
def stub_driver(arch: int):
    """Make Triton compile for sm_`arch` (80 or 90) inside the block; restore its active driver after."""
    from triton import knobs
    from triton.runtime.driver import driver
    saved = driver._active                # may be None (not yet created): restored as it was
    saved_log = knobs.nvidia.dump_ptxas_log
    driver.set_active(_stub_driver_class()(arch))
    knobs.nvidia.dump_ptxas_log = True    # ptxas -v's log (spill bytes) printed at each fresh compile
    try:
        yield driver.active
    finally:
        driver._active = saved
        knobs.nvidia.dump_ptxas_log = saved_log


# ---------------------------------------------------------------------------------------------- inspection

def _resource_usage(cubin: bytes) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([_tool("cuobjdump"), "--dump-resource-usage", f.name], check=True,
                              capture_output=True, text=True).stdout
    fields = dict(re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", text))
    return {k: int(v) for k, v in fields.items()}


def _sass(cubin: bytes) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([_tool("cuobjdump"), "-sass", f.name], check=True, capture_output=True,
                              text=True).stdout


_SPILL_LINE = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_spill_cache: dict[str, tuple[int, int]] = {}     # kernel hash -> ptxas -v's spill bytes, from its compile log


def _ptxas_spills(ptx: str, arch: int) -> tuple[int, int]:
    """Spill store / load bytes as `ptxas -v` reports them: the ptxas and flags Triton's make_cubin uses."""
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability
    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "k.ptx"
        src.write_text(ptx)
        run = subprocess.run([get_ptxas(arch).path, "-lineinfo", "-v", "--regAllocOptLevel=2",
                              f"--gpu-name={sm_arch_from_capability(arch)}", str(src), "-o", str(Path(d) / "k.o")],
                             capture_output=True, text=True)
    m = _SPILL_LINE.search(run.stderr)
    if run.returncode or not m:
        raise RuntimeError(f"ptxas -v failed or printed no spill line:\n{run.stderr[-2000:]}")
    return int(m.group(1)), int(m.group(2))


_INSPECTED = ("registers", "stack_bytes", "spill_store_bytes", "spill_load_bytes", "uses_tensor_cores",
              "tensor_core_instrs", "uses_dot")
_inspected: dict[str, dict] = {}      # kernel hash -> those fields: a cached binary is not disassembled again


def inspect_compiled(kernel, info: KernelInfo) -> KernelInfo:
    """Fill registers, stack, spills, shared memory and tensor-core use from a CompiledKernel."""
    info.shared_bytes = int(kernel.metadata.shared)
    if kernel.hash in _inspected:
        for k, v in _inspected[kernel.hash].items():
            setattr(info, k, v)
        return info
    cubin, ptx = kernel.asm["cubin"], kernel.asm["ptx"]
    usage = _resource_usage(cubin)
    info.registers = usage.get("REG", 0)
    info.stack_bytes = usage.get("STACK", 0) + usage.get("LOCAL", 0)
    if info.stack_bytes:                  # spills live in the stack frame: none without one
        spills = _spill_cache.get(kernel.hash)        # from this compile's log; a cached binary: ptxas again
        info.spill_store_bytes, info.spill_load_bytes = spills or _ptxas_spills(ptx, info.arch)
    info.uses_dot = "tt.dot" in kernel.asm.get("ttir", "")
    # The SASS (cuobjdump -sass, about 0.6 CPU-s a binary: most of the inspection's time) names the instructions
    # ptxas kept. Only a tl.dot on 16-bit (or fp8) operands can have tensor-core ones (fp32's dots are "ieee" FMA
    # loops), so the other binaries are read from their PTX alone, which has no mma either. A PTX that has an mma
    # already answers (ptxas lowers mma.sync to HMMA, wgmma to HGMMA, and drops neither): SASS is read only when
    # the PTX has none, to find any that ptxas made.
    ptx_mma = TENSOR_CORE_PTX.search(ptx)
    sass = _sass(cubin) if info.uses_dot and info.dtype != "float32" and not ptx_mma else ""
    found = sorted(set(TENSOR_CORE_SASS.findall(sass))) + sorted(set(TENSOR_CORE_PTX.findall(ptx)))
    info.uses_tensor_cores = bool(found)
    info.tensor_core_instrs = " ".join(found)
    _inspected[kernel.hash] = {k: getattr(info, k) for k in _INSPECTED}
    return info


# ---------------------------------------------------------------------------------------------- bad tiles

@triton.jit
def _short_k_dot_kernel(a_ptr, b_ptr, c_ptr, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr):
    """c = a @ b for one (M, K) x (K, N) tile: fine in the interpreter for any K; Triton 3.9 compiles M and N
    down to 1 (and N = 8 runs on mma.sync m16n8k16) but rejects K < 16 (one mma's reduction depth)."""
    m, n, k = tl.arange(0, M), tl.arange(0, N), tl.arange(0, K)
    a = tl.load(a_ptr + m[:, None] * K + k[None, :])
    b = tl.load(b_ptr + k[:, None] * N + n[None, :])
    tl.store(c_ptr + m[:, None] * N + n[None, :], tl.dot(a, b))


@triton.jit
def _wide_k_kernel(a_ptr, b_ptr, c_ptr, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr,
                   BLOCK_K: tl.constexpr):
    """c = a @ b in BLOCK_K slices: a (64, 512) + (512, 64) fp16 slice pair is 128 KB, and the software
    pipeline (num_stages 3) buffers it 2-3 times over: more shared memory than an SM has."""
    m, n, k = tl.arange(0, M), tl.arange(0, N), tl.arange(0, BLOCK_K)
    acc = tl.zeros([M, N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = tl.load(a_ptr + m[:, None] * K + (k0 + k)[None, :])
        b = tl.load(b_ptr + (k0 + k)[:, None] * N + n[None, :])
        acc += tl.dot(a, b)
    tl.store(c_ptr + m[:, None] * N + n[None, :], acc)


BAD_TILES = {   # tiles the interpreter runs correctly and a GPU cannot: (constexprs, the rule they break)
    "_short_k_dot_kernel": (dict(M=16, N=16, K=8), "compile error"),
    "_wide_k_kernel": (dict(M=64, N=64, K=2048, BLOCK_K=512), "shared memory"),
}


def bad_tile_operands(meta, seed=0):
    import torch
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(meta["M"], meta["K"], generator=g).half()
    b = torch.randn(meta["K"], meta["N"], generator=g).half()
    return a, b, torch.empty(meta["M"], meta["N"])


def compile_bad_tile(name: str, arch: int) -> KernelInfo:
    meta = BAD_TILES[name][0]
    return compile_call(globals()[name], bad_tile_operands(meta), (1,), arch, dtype="float16", **meta)


# ---------------------------------------------------------------------------------------------- the wrappers

def _triton_ops():
    try:
        import minivllm_kernels.triton_ops as ops
    except ImportError:                   # a bare checkout: load it the way minivllm does
        from minivllm.model._kernels import kernels
        ops = kernels.triton_ops
    from triton.runtime.jit import JITFunction
    if not isinstance(ops._paged_decode_kernel, JITFunction):
        raise RuntimeError("triton_ops was imported under TRITON_INTERPRET=1: its kernels are interpreted "
                           "functions and cannot be compiled; use compile_in_subprocess or `python kernels/aot.py`")
    return ops


KERNEL_NAMES = ("_store_kv_cache_kernel", "_paged_decode_kernel", "_merge_splits_kernel", "_paged_prefill_kernel",
                "_rms_norm_kernel")
ACTIVATION_KERNELS = {"_rms_norm_kernel"}     # work on activations only: no fp8 variant (fp8 is a KV cache dtype)


def _compile_call(run, fn, name, arch, args, grid, kwargs, case="", dtype="", inspect=True):
    """Compile one launch (`run` is JITFunction.run, bound) with warmup=True under the active (stub) driver."""
    # Compile-time configuration: the constexprs (passed by keyword here) and the integer arguments equal
    # to 1, which Triton specializes into constants (e.g. group_size 1, no GQA): each its own binary.
    config = {k: v for k, v in kwargs.items() if k not in ("num_warps", "num_stages")}
    config.update({k: 1 for k, v in zip(fn.arg_names, args) if type(v) is int and v == 1})
    info = KernelInfo(name, arch, case, dtype, config)
    log = io.StringIO()
    try:
        with contextlib.redirect_stdout(log):     # Triton prints ptxas -v's log here (a fresh compile only)
            kernel = run(*args, grid=grid, warmup=True, **kwargs)
    except Exception as e:                # a compile error is a finding, not a crash
        info.error = f"{type(e).__name__}: {e}"
        return info, None
    info.config.update(num_warps=kernel.metadata.num_warps, num_stages=kernel.metadata.num_stages)
    m = _SPILL_LINE.search(log.getvalue())
    if m:
        _spill_cache[kernel.hash] = (int(m.group(1)), int(m.group(2)))
    return (inspect_compiled(kernel, info) if inspect else info), kernel


def compile_call(fn, args, grid, arch: int, dtype: str = "", **kwargs) -> KernelInfo:
    """Compile any @triton.jit function for sm_`arch` as `fn[grid](*args, **kwargs)` would, and inspect it."""
    with stub_driver(arch):
        return _compile_call(fn.run, fn, fn.__name__, arch, args, grid, kwargs, dtype=dtype)[0]


class _Recorder:
    """What `compiling` yields: the KernelInfo of each compile so far, and the case/dtype to tag them with."""

    def __init__(self):
        self.infos: list[KernelInfo] = []
        self.seen: set[str] = set()
        self.case = ""
        self.dtype = ""


@contextlib.contextmanager
def compiling(arch: int, inspect: bool = True):
    """Inside: the stub driver is active and each launch of a triton_ops kernel compiles instead
    (warmup=True, nothing runs), appending a KernelInfo to the yielded recorder's `infos`."""
    ops = _triton_ops()
    rec = _Recorder()

    def recorder(fn, name):
        original = fn.run

        def run(*args, grid, warmup, **kwargs):
            info, kernel = _compile_call(original, fn, name, arch, args, grid, kwargs, rec.case, rec.dtype,
                                         inspect=False)
            if info.key() not in rec.seen:        # the same binary from another case: inspected once
                rec.seen.add(info.key())
                rec.infos.append(inspect_compiled(kernel, info) if inspect and kernel is not None else info)
            return kernel
        return run

    patched = []
    with stub_driver(arch):
        try:
            for name in KERNEL_NAMES:
                fn = getattr(ops, name)
                fn.run = recorder(fn, name)          # an instance attribute shadows JITFunction.run
                patched.append(fn)
            yield rec
        finally:
            for fn in patched:
                del fn.run


# The grid: head dims x GQA ratios x cache block sizes x dtypes, each through the shapes the wrappers see.
HEAD_DIMS = (64, 128)
GQA_RATIOS = (1, 4)
BLOCK_SIZES = (16, 32)
DTYPES = ("float16", "bfloat16", "float32", "fp8-bfloat16", "fp8-float16")
NUM_HEADS = 16
# fp32 at one GQA ratio: fp32's dots are FMA loops (no tensor cores) and its 64-row prompt tiles spill by
# design; fp32 is the oracle a GPU check compares against, not the fast path. At GQA 1 (group_size specialized
# to the constant 1) its kernels are the same loops with one index fixed, and the head_dim 128 prompt tile
# alone took 44 s of ptxas on one core (an 82 KB spill), a fifth of sm_80's grid. So fp32 is compiled at the
# grid's last GQA ratio only; the 16-bit and fp8 dtypes, the fast paths, at every ratio.


def _cache_and_query_dtypes(dtype_name: str):
    """"float16" -> (fp16 cache, fp16 queries); "fp8-bfloat16" -> (an fp8 e4m3 cache, bf16 queries and K/V)."""
    import torch
    if dtype_name.startswith("fp8-"):
        return torch.float8_e4m3fn, getattr(torch, dtype_name.removeprefix("fp8-"))
    return getattr(torch, dtype_name), getattr(torch, dtype_name)


def wrapper_cases(head_dims=HEAD_DIMS, gqa_ratios=GQA_RATIOS, block_sizes=BLOCK_SIZES, dtypes=DTYPES):
    """(case name, dtype, callable) for every wrapper call of the grid; each callable builds CPU tensors of
    the real shapes and calls the wrapper, which picks its tiles as it would on a GPU."""
    import torch
    ops = _triton_ops()
    cases = []
    for dtype_name in dtypes:
        cache_dtype, dtype = _cache_and_query_dtypes(dtype_name)
        if not dtype_name.startswith("fp8-"):
            def norm(rows, width, residual, dtype=dtype):
                x = torch.zeros(rows, width, dtype=dtype)
                ops.rms_norm(x, torch.ones(width, dtype=dtype), 1e-6, torch.zeros_like(x) if residual else None)

            cases += [
                ("rms_norm hidden 1024 + residual", dtype_name, lambda f=norm: f(64, 1024, True)),
                ("rms_norm hidden 4096 + residual", dtype_name, lambda f=norm: f(64, 4096, True)),  # 8 warps
                ("rms_norm per head 128", dtype_name, lambda f=norm: f(64 * 16, 128, False)),       # q_norm
            ]
        for head_dim in head_dims:
            for gqa in gqa_ratios:
                if dtype_name == "float32" and gqa != gqa_ratios[-1]:
                    continue    # fp32 at one GQA ratio (the note above wrapper_cases)
                kv_heads = NUM_HEADS // gqa
                for bs in block_sizes:
                    if bs != block_sizes[0] and dtype_name != dtypes[0]:
                        continue    # block size only changes index math: other sizes in the first dtype only
                    tag = f"hd{head_dim}/gqa{gqa}/bs{bs}"

                    def cache(num_blocks, bs=bs, kv_heads=kv_heads, head_dim=head_dim, dtype=cache_dtype):
                        return torch.zeros(num_blocks, bs, kv_heads, head_dim, dtype=dtype)

                    def store(num_tokens, cache=cache, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype):
                        # the model's fused qkv projection: key/value are strided views of one buffer
                        qkv = torch.zeros(num_tokens, NUM_HEADS + 2 * kv_heads, head_dim, dtype=dtype)
                        k, v = qkv[:, NUM_HEADS:NUM_HEADS + kv_heads], qkv[:, NUM_HEADS + kv_heads:]
                        kc, vc = cache(64), cache(64)
                        ops.store_kv_cache(k, v, kc, vc, torch.arange(num_tokens, dtype=torch.int64))

                    def decode(num_seqs, context, cache=cache, head_dim=head_dim, dtype=dtype, bs=bs):
                        width = -(-context // bs)
                        q = torch.zeros(num_seqs, NUM_HEADS, head_dim, dtype=dtype)
                        ops.paged_decode_attention(
                            q, cache(8), cache(8), torch.zeros(num_seqs, width, dtype=torch.int32),
                            torch.full((num_seqs,), context, dtype=torch.int32), head_dim ** -0.5)

                    def prefill(q_len, cache=cache, head_dim=head_dim, dtype=dtype, bs=bs):
                        num_seqs = 2
                        q = torch.zeros(num_seqs * q_len, NUM_HEADS, head_dim, dtype=dtype)
                        width = -(-(q_len + 64) // bs)
                        ops.paged_prefill_attention(
                            q, cache(8), cache(8), torch.zeros(num_seqs, width, dtype=torch.int32),
                            torch.arange(num_seqs + 1, dtype=torch.int32) * q_len,
                            torch.full((num_seqs,), q_len + 64, dtype=torch.int32), head_dim ** -0.5,
                            max_q_len=q_len)

                    cases += [
                        (f"store decode {tag}", dtype_name, lambda f=store: f(8)),
                        (f"store prefill {tag}", dtype_name, lambda f=store: f(512)),
                        (f"decode batch {tag}", dtype_name, lambda f=decode: f(128, 1024)),     # 1 split
                        (f"decode long {tag}", dtype_name, lambda f=decode: f(1, 8192)),        # split-KV + merge
                        (f"prefill chunk {tag}", dtype_name, lambda f=prefill: f(8)),           # BLOCK_M 16
                        (f"prefill prompt {tag}", dtype_name, lambda f=prefill: f(512)),        # BLOCK_M 64
                    ]
    return cases


def compile_wrapper_calls(arch: int, cases=None, inspect: bool = True) -> list[KernelInfo]:
    """Compile every kernel the wrappers launch over the grid, for sm_`arch`; one KernelInfo per distinct
    binary (kernel x dtype x compile-time configuration), in first-seen order. Needs TRITON_INTERPRET unset."""
    from triton import knobs
    if cases is None:                  # Triton has no e4m3 before sm_89: fp8 caches compile for sm_90 only
        cases = wrapper_cases(dtypes=[d for d in DTYPES if arch >= 89 or not d.startswith("fp8-")])
    saved = Path(knobs.cache.dir) / f"minivllm_aot_sm{arch}.json"   # inspections of the cached binaries
    if saved.exists():
        _inspected.update(json.loads(saved.read_text()))
    with compiling(arch, inspect=inspect) as rec:
        for case, dtype, call in cases:
            rec.case, rec.dtype = case, dtype
            call()
    saved.parent.mkdir(parents=True, exist_ok=True)
    tmp = saved.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(_inspected))
    tmp.replace(saved)
    return rec.infos


def compile_stage_variants(arch: int, head_dim: int = 128, dtype: str = "float16") -> list[KernelInfo]:
    """The decode kernel (a batch) and the prefill kernel (a full 64-row prompt tile) at one shape (GQA 4,
    blocks of 16), each compiled with num_stages forced to 1, 2 and 3, then as the wrapper chooses. What
    `choose_num_stages` in triton_ops.py was decided from; lesson 06 shows this table."""
    ops = _triton_ops()
    cases = [c for c in wrapper_cases(head_dims=(head_dim,), gqa_ratios=(4,), block_sizes=(16,), dtypes=(dtype,))
             if c[0].startswith(("decode batch", "prefill prompt"))]
    infos = []
    for stages in (1, 2, 3, None):                       # None: the wrapper's own choice
        with compiling(arch) as rec:
            for name in ("_paged_decode_kernel", "_paged_prefill_kernel"):
                fn = getattr(ops, name)
                chosen = fn.run                             # compiling()'s recorder

                def run(*args, grid, warmup, _chosen=chosen, **kwargs):
                    if stages is not None:
                        kwargs["num_stages"] = stages
                    return _chosen(*args, grid=grid, warmup=warmup, **kwargs)
                fn.run = run
            for case, case_dtype, call in cases:
                rec.case = case if stages is not None else case + " (wrapper's choice)"
                rec.dtype = case_dtype
                call()
        infos += [i for i in rec.infos if i.name in ("_paged_decode_kernel", "_paged_prefill_kernel")]
    return infos


def compile_in_subprocess(arch: int, extra_env: dict | None = None, timeout: float = 900,
                          stages: bool = False) -> list[KernelInfo]:
    """compile_wrapper_calls(arch) in a fresh Python with TRITON_INTERPRET unset; the caller's process and
    its Triton driver are untouched."""
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(root), *filter(None, [env.get("PYTHONPATH")])])
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")        # Triton 3.9's default, stated (silences a warning)
    env.update(extra_env or {})
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "infos.json"
        subprocess.run([sys.executable, str(Path(__file__).resolve()), "--arch", str(arch), "--json", str(out)]
                       + (["--stages"] if stages else []), check=True, env=env, timeout=timeout, cwd=str(root))
        return [KernelInfo(**row) for row in json.loads(out.read_text())]


def format_table(infos: list[KernelInfo]) -> str:
    rows = [f"{'arch':6} {'kernel':24} {'dtype':9} {'regs':>4} {'spill':>6} {'stack':>6} {'smem':>7} "
            f"{'TC':3} config"]
    for i in infos:
        cfg = {k: v for k, v in i.config.items() if k != "UPCAST"}
        rows.append(f"sm_{i.arch:<3} {i.name:24} {i.dtype:9} {i.registers:4} {i.spill_bytes:6} "
                    f"{i.stack_bytes:6} {i.shared_bytes:7} {'yes' if i.uses_tensor_cores else 'no':3} "
                    f"{cfg}{'  ERROR ' + i.error.splitlines()[-1][:120] if i.error else ''}")
    return "\n".join(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", type=int, choices=sorted(SHARED_MEM_LIMIT), required=True)
    p.add_argument("--json", help="write the KernelInfo list here")
    p.add_argument("--stages", action="store_true",
                   help="only the attention kernels at head_dim 128, fp16, at num_stages 1, 2, 3 and the wrappers' choice")
    args = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        p.error("unset TRITON_INTERPRET: interpreted kernels cannot be compiled")
    infos = compile_stage_variants(args.arch) if args.stages else compile_wrapper_calls(args.arch)
    if args.json:
        Path(args.json).write_text(json.dumps([dataclasses.asdict(i) for i in infos]))
    else:
        print(format_table(infos))
    return 0


if __name__ == "__main__":
    sys.exit(main())
