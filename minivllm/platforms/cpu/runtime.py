"""The CPU runtime under the engine: which memory allocator and which OpenMP the process runs with.

Owns: finding tcmalloc and Intel's OpenMP on this machine, re-starting a command-line entry point with them
preloaded (`LD_PRELOAD`), reporting what the running process really loaded, and what the CPU can do (bf16
arithmetic, an NVIDIA driver beside it). vLLM's counterpart is `vllm/platforms/cpu.py`, whose
`check_and_update_config` puts tcmalloc and libiomp5 into `LD_PRELOAD` before it starts its engine process.

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

Must never: re-start a process that did not come from the command line (a notebook, pytest, a caller of
`main(argv)`): only the `if __name__ == "__main__"` blocks of the entry points call `reexec_with_cpu_runtime`.
Nothing here changes a result: the same ops run, only where their memory comes from changes
(`tests/test_cpu_runtime.py` checks greedy output is identical with and without). Nothing here imports torch:
`reexec_with_cpu_runtime` runs before torch is imported.
"""

from __future__ import annotations

import glob
import os
import sys

from minivllm import envs
from minivllm.platforms.cpu.huge_pages import huge_page_bytes

# Set in the re-started process, so it never re-starts again (and so a user can see it happened).
REEXEC_MARKER = "MINIVLLM_CPU_RUNTIME_PRELOADED"
# MINIVLLM_CPU_PRELOAD=0 turns the re-start off, =tcmalloc preloads tcmalloc alone (e.g. to measure each).
OPT_OUT = "MINIVLLM_CPU_PRELOAD"


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
    choice = envs.read(OPT_OUT, env)
    env = os.environ if env is None else env
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
    if envs.MINIVLLM_CPU_RUNTIME_PRELOADED:
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
