"""The CPU runtime under the engine: which memory allocator and which OpenMP the process runs with, and which
pages hold the big tensors.

Owns: finding tcmalloc and Intel's OpenMP on this machine, re-starting a command-line entry point with them
preloaded (`LD_PRELOAD`), reporting what the running process really loaded, and asking Linux for 2 MB pages
under the tensors every step reads whole (the weights and the KV cache). vLLM's counterpart is
`vllm/platforms/cpu.py`, whose `check_and_update_config` puts tcmalloc and libiomp5 into `LD_PRELOAD` before it
starts its engine process.

Why tcmalloc: a step makes a few hundred PyTorch ops, each allocating its output (10-60 MB each in a
5,000-token prefill). glibc's malloc serves blocks that big with a fresh `mmap` and unmaps them when the
tensor dies, so every step page-faults and zeroes them again; tcmalloc keeps freed memory and reuses it.

Why Intel's OpenMP (`pip install intel-openmp`, a dependency on x86-64 Linux): it exports the GNU OpenMP entry
points, so torch's parallel regions and the C++ kernels' run on it unchanged. Offline it measured no faster
than GNU's; served online on 2 cores (the server's HTTP thread beside the two OpenMP threads) it lifted output
throughput by about a third. Why was not isolated: the two runtimes wait differently at the end of a parallel
region. It is preloaded unbound: binding (`KMP_AFFINITY`) pins the main thread to core 0, and every process it
starts (a tensor-parallel worker) inherits that mask. Measured numbers are in the README ("The CPU runtime",
"Online: the sampler's draw and Intel's OpenMP").

Why 2 MB pages: a decode step reads all the weights and the whole KV context, a few hundred MB. In 4 KB pages
that is tens of thousands of pages, far more than the CPU's TLB holds (a few thousand entries on current cores),
so reads keep waiting on page-table walks, and the hardware prefetcher stops at every 4 KB boundary. Linux backs
memory with 2 MB pages ("transparent huge pages") where a program asks with `madvise(MADV_HUGEPAGE)`, the default
setting on most distributions (`/sys/kernel/mm/transparent_hugepage/enabled` = madvise), or everywhere
(= always). `empty_on_huge_pages` hands out a 2 MB-aligned buffer with that advice, and `settle_on_huge_pages`
asks (`MADV_COLLAPSE`, Linux 6.1+) for pages already filled with 4 KB ones to be merged. Measured
(README, "Measured", twelfth session): 4-9% off each of a decode step's matmuls and attention.
`MINIVLLM_CPU_HUGE_PAGES=0` keeps plain pages.

Must never: re-start a process that did not come from the command line (a notebook, pytest, a caller of
`main(argv)`): only the `if __name__ == "__main__"` blocks of the entry points call `reexec_with_cpu_runtime`.
Nothing here changes a result: the same ops run, only where their memory comes from changes
(`tests/test_cpu_runtime.py` and `tests/test_cpu_huge_pages.py` check greedy output is identical with and
without). Nothing here imports torch at module level: `reexec_with_cpu_runtime` runs before torch is imported.
"""

from __future__ import annotations

import glob
import os
import sys

# Set in the re-started process, so it never re-starts again (and so a user can see it happened).
REEXEC_MARKER = "MINIVLLM_CPU_RUNTIME_PRELOADED"
# MINIVLLM_CPU_PRELOAD=0 turns the re-start off, =tcmalloc preloads tcmalloc alone (e.g. to measure each).
OPT_OUT = "MINIVLLM_CPU_PRELOAD"
# MINIVLLM_CPU_HUGE_PAGES=0: the weights and the KV cache stay on the allocator's plain 4 KB pages.
HUGE_PAGES_OPT_OUT = "MINIVLLM_CPU_HUGE_PAGES"
HUGE_PAGE_BYTES = 2 << 20
MADV_HUGEPAGE, MADV_COLLAPSE = 14, 25          # <linux/mman.h>; MADV_COLLAPSE since Linux 6.1


def _lib_dirs() -> list[str]:
    """Where shared libraries get installed: this environment's lib/ (pip and conda), the user's, the system's."""
    import site
    return [os.path.join(sys.prefix, "lib"), os.path.join(site.getuserbase(), "lib"), "/usr/lib/x86_64-linux-gnu",
            "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib"]


def _find(patterns: tuple[str, ...]) -> str | None:
    for d in _lib_dirs():
        for pattern in patterns:
            hits = sorted(glob.glob(os.path.join(d, pattern)))
            if hits:
                return hits[0]
    return None


def find_tcmalloc() -> str | None:
    """tcmalloc's shared library (Debian/Ubuntu: `apt-get install libtcmalloc-minimal4`; conda: gperftools)."""
    return _find(("libtcmalloc_minimal.so*", "libtcmalloc.so*"))


def find_iomp() -> str | None:
    """Intel's OpenMP runtime (pip or conda: `intel-openmp`, which installs lib/libiomp5.so)."""
    return _find(("libiomp5.so",))


def loaded_runtime() -> dict[str, str]:
    """What this process really runs with, read from its memory map: {"malloc": ..., "openmp": ...}."""
    try:
        with open("/proc/self/maps") as f:
            libs = {line.split()[-1].rsplit("/", 1)[-1] for line in f if ".so" in line}
    except OSError:                                            # not Linux
        return {"malloc": "unknown", "openmp": "unknown"}
    malloc = "tcmalloc" if any(lib.startswith("libtcmalloc") for lib in libs) else "glibc"
    if any(lib.startswith("libiomp5") for lib in libs):
        openmp = "Intel (libiomp5)"
    elif any(lib.startswith("libgomp") for lib in libs):
        openmp = "GNU (libgomp)"
    else:
        openmp = "not loaded yet"
    return {"malloc": malloc, "openmp": openmp}


def describe_runtime() -> str:
    """One line for a CLI's summary, e.g. 'malloc tcmalloc, OpenMP GNU (libgomp), 2 MB pages 612 MB'."""
    rt = loaded_runtime()
    return f"malloc {rt['malloc']}, OpenMP {rt['openmp']}, 2 MB pages {huge_page_bytes() >> 20} MB"


def huge_pages_available() -> bool:
    """Whether this process may ask for 2 MB pages: Linux, transparent huge pages not `never`, no opt-out."""
    if os.environ.get(HUGE_PAGES_OPT_OUT, "1") == "0" or not sys.platform.startswith("linux"):
        return False
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def _madvise(address: int, length: int, advice: int) -> bool:
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc.madvise(address, length, advice) == 0


def empty_on_huge_pages(nbytes: int):
    """A (nbytes,) uint8 CPU tensor, uninitialised, starting on a 2 MB boundary, whose pages Linux is asked to
    make 2 MB ones when they are first written (a plain tensor when huge pages are unavailable). View it as the
    dtype and shape you need; fill it, then call settle_on_huge_pages."""
    import torch
    if not huge_pages_available():
        return torch.empty(nbytes, dtype=torch.uint8)
    raw = torch.empty(nbytes + HUGE_PAGE_BYTES, dtype=torch.uint8)
    start = -raw.data_ptr() % HUGE_PAGE_BYTES
    buf = raw[start:start + nbytes]                 # keeps `raw`'s storage alive
    _madvise(buf.data_ptr(), nbytes - nbytes % HUGE_PAGE_BYTES, MADV_HUGEPAGE)
    return buf


def settle_on_huge_pages(buf) -> None:
    """After filling a buffer from empty_on_huge_pages: merges into 2 MB pages what still sits in 4 KB ones
    (memory the allocator had touched before it was advised). Best effort: an older kernel refuses, and then
    the advice alone applies."""
    if huge_pages_available():
        _madvise(buf.data_ptr(), buf.numel() - buf.numel() % HUGE_PAGE_BYTES, MADV_COLLAPSE)


def gather_on_huge_pages(tensors: list) -> list:
    """Copies of `tensors` (CPU, contiguous) side by side in one buffer on 2 MB pages, each starting on a 4 KB
    boundary; the same tensors when huge pages are unavailable."""
    import torch
    if not huge_pages_available() or not tensors:
        return list(tensors)
    offsets, total = [], 0
    for t in tensors:
        if t.device.type != "cpu" or t.layout != torch.strided or not t.is_contiguous():
            raise ValueError(f"gather_on_huge_pages takes contiguous (strided) CPU tensors, got one of shape "
                             f"{tuple(t.shape)} on {t.device}, layout {t.layout}"
                             + ("" if t.layout != torch.strided else f", contiguous: {t.is_contiguous()}"))
        offsets.append(total)
        total += -(-t.numel() * t.element_size() // 4096) * 4096
    buf = empty_on_huge_pages(total)
    out = []
    for t, off in zip(tensors, offsets):
        view = buf[off:off + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
        view.copy_(t)
        out.append(view)
    settle_on_huge_pages(buf)
    return out


def huge_page_bytes(tensor=None) -> int:
    """Bytes of this process's memory on transparent huge pages (/proc/self/smaps); with `tensor`, of the
    memory mappings that hold it. 0 off Linux."""
    try:
        with open("/proc/self/smaps_rollup" if tensor is None else "/proc/self/smaps") as f:
            lines = f.read().splitlines()
    except OSError:
        return 0
    lo = hi = None
    if tensor is not None:
        lo = tensor.data_ptr()
        hi = lo + tensor.numel() * tensor.element_size()
    total, inside = 0, tensor is None
    for line in lines:
        head = line.split(maxsplit=1)[0]
        if "-" in head and not head.endswith(":"):                 # a mapping's first line: start-end perms ...
            if tensor is not None:
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start < hi and end > lo
        elif inside and head == "AnonHugePages:":
            total += int(line.split()[1]) * 1024
    return total


def has_bf16_arithmetic() -> bool | None:
    """Whether this CPU multiplies bf16 natively (AVX-512 BF16 or AMX); None where /proc/cpuinfo is unreadable.
    Without it oneDNN converts bf16 to fp32 in its inner loops: measured on an AVX2-only AMD EPYC, a bf16
    matmul ran at 11 GFLOP/s against 79 in fp32 (README, "The C++ CPU kernels")."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), None)
    except OSError:
        return None
    return None if flags is None else bool({"avx512_bf16", "amx_bf16"} & set(flags))


def has_nvidia_driver() -> bool:
    return os.path.exists("/proc/driver/nvidia")


def preload_plan(env: dict | None = None) -> list[str]:
    """The libraries to add to LD_PRELOAD on this machine, tcmalloc then Intel's OpenMP; [] if none.

    Nothing is planned off Linux, on a machine with an NVIDIA driver (the engine runs on the GPU there; vLLM
    preloads only on its CPU platform), or when the user opted out; a library already preloaded is not planned
    again. Intel's OpenMP only comes with tcmalloc (the re-start happens once, for both)."""
    env = os.environ if env is None else env
    choice = env.get(OPT_OUT, "1")
    if not sys.platform.startswith("linux") or choice == "0" or has_nvidia_driver():
        return []
    tcmalloc = find_tcmalloc()
    if tcmalloc is None or "libtcmalloc" in env.get("LD_PRELOAD", ""):
        return []
    iomp = None if choice == "tcmalloc" or "libiomp5" in env.get("LD_PRELOAD", "") else find_iomp()
    return [tcmalloc] + ([iomp] if iomp else [])


def reexec_with_cpu_runtime() -> None:
    """Re-start this command with tcmalloc (and Intel's OpenMP) preloaded, if installed and not loaded.

    A library in LD_PRELOAD is only honoured when a process starts, so the command re-runs itself (same
    interpreter, same arguments, same PID: `os.execve`) before it imports torch. Returns (and the command
    goes on as it is) when there is nothing to preload or it already re-started once."""
    if os.environ.get(REEXEC_MARKER):
        return
    libs = preload_plan()
    if not libs:
        return
    env = dict(os.environ)
    env["LD_PRELOAD"] = ":".join(libs + ([env["LD_PRELOAD"]] if env.get("LD_PRELOAD") else []))
    env[REEXEC_MARKER] = ":".join(libs)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


def main() -> int:
    """`python -m minivllm.platforms.cpu`: what is installed, and the line that preloads it for any command."""
    tcmalloc, iomp = find_tcmalloc(), find_iomp()
    print(f"tcmalloc: {tcmalloc or 'not found (apt-get install libtcmalloc-minimal4, or conda gperftools)'}")
    print(f"Intel OpenMP: {iomp or 'not found (pip install intel-openmp)'}")
    print(f"this process: {describe_runtime()}")
    libs = [lib for lib in (tcmalloc, iomp) if lib]
    if libs:
        print(f"for a notebook server or your own script, start it with:\n  LD_PRELOAD={':'.join(libs)} ...")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
