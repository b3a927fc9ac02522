"""The CPU runtime under the engine: which memory allocator and which OpenMP the process runs with.

Owns: finding tcmalloc and Intel's OpenMP on this machine, re-starting a command-line entry point with them
preloaded (`LD_PRELOAD`), and reporting what the running process really loaded. vLLM's counterpart is
`vllm/platforms/cpu.py`, whose `check_and_update_config` puts tcmalloc (and an OpenMP) into `LD_PRELOAD`
before it starts its engine process; its CPU install guide asks users to preload tcmalloc and `libiomp5.so`.

Why it matters on a CPU: a step makes a few hundred PyTorch ops, each allocating its output, and runs every
matmul, norm and attention as an OpenMP parallel region. glibc's malloc returns big freed blocks to the
kernel and page-faults them back in on the next step; tcmalloc keeps them. Intel's OpenMP binds its threads
to cores (`KMP_AFFINITY`) and spins briefly between regions (`KMP_BLOCKTIME`), so a step's hundreds of
regions do not each wake sleeping threads. Measured numbers are in the README ("The CPU runtime").

Must never: re-start a process that did not come from the command line (a notebook, pytest, a caller of
`main(argv)`): only the `if __name__ == "__main__"` blocks of the entry points call `reexec_with_cpu_runtime`.
Nothing here changes a result: the same ops run, only where their memory and threads come from changes
(`tests/test_cpu_runtime.py` checks greedy output is identical with and without).
"""

from __future__ import annotations

import glob
import os
import sys

# Set in the re-started process, so it never re-starts again (and so a user can see it happened).
REEXEC_MARKER = "MINIVLLM_CPU_RUNTIME_PRELOADED"
# MINIVLLM_CPU_PRELOAD=0 turns the re-start off (e.g. to measure the difference).
OPT_OUT = "MINIVLLM_CPU_PRELOAD"

# Intel OpenMP's settings, as vLLM's CPU guide and Intel's PyTorch tuning guide give them: each thread bound
# to one core, compactly; a thread spins 1 ms after a parallel region before it sleeps.
IOMP_ENV = {"KMP_AFFINITY": "granularity=fine,compact,1,0", "KMP_BLOCKTIME": "1"}


def find_tcmalloc() -> str | None:
    """tcmalloc's shared library (Debian/Ubuntu: `apt-get install libtcmalloc-minimal4`; conda: gperftools)."""
    dirs = [os.path.join(sys.prefix, "lib"), "/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu",
            "/usr/lib64", "/usr/lib", "/usr/local/lib"]
    for d in dirs:
        for pattern in ("libtcmalloc_minimal.so*", "libtcmalloc.so*"):
            hits = sorted(glob.glob(os.path.join(d, pattern)))
            if hits:
                return hits[0]
    return None


def find_iomp() -> str | None:
    """Intel's OpenMP runtime (`pip install intel-openmp` puts libiomp5.so in the environment's lib/)."""
    for d in (os.path.join(sys.prefix, "lib"), os.path.join(sys.base_prefix, "lib"), "/usr/lib/x86_64-linux-gnu"):
        path = os.path.join(d, "libiomp5.so")
        if os.path.exists(path):
            return path
    return None


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
    """One line for a CLI's summary, e.g. 'malloc tcmalloc, OpenMP Intel (libiomp5)'."""
    rt = loaded_runtime()
    return f"malloc {rt['malloc']}, OpenMP {rt['openmp']}"


def has_nvidia_driver() -> bool:
    return os.path.exists("/proc/driver/nvidia")


def preload_plan(env: dict | None = None) -> tuple[list[str], dict[str, str]]:
    """The libraries to add to LD_PRELOAD and the environment to add, for this machine; ([], {}) if none.

    Nothing is planned off Linux, on a machine with an NVIDIA driver (the engine runs on the GPU there; vLLM
    preloads only on its CPU platform), when the user opted out, or for libraries already in LD_PRELOAD."""
    env = os.environ if env is None else env
    if not sys.platform.startswith("linux") or env.get(OPT_OUT, "1") == "0" or has_nvidia_driver():
        return [], {}
    current = env.get("LD_PRELOAD", "")
    libs, extra = [], {}
    tcmalloc = find_tcmalloc()
    if tcmalloc and "libtcmalloc" not in current:
        libs.append(tcmalloc)
    iomp = find_iomp()
    if iomp and not any(name in current for name in ("libiomp", "libgomp", "libomp")):
        libs.append(iomp)
        extra = {k: v for k, v in IOMP_ENV.items() if k not in env}
    return libs, extra


def reexec_with_cpu_runtime() -> None:
    """Re-start this command with tcmalloc and Intel OpenMP preloaded, if they are installed and not loaded.

    A library in LD_PRELOAD is only honoured when a process starts, so the command re-runs itself (same
    interpreter, same arguments, same PID: `os.execve`) before it imports torch. Returns (and the command
    goes on as it is) when there is nothing to preload or it already re-started once."""
    if os.environ.get(REEXEC_MARKER):
        return
    libs, extra = preload_plan()
    if not libs:
        return
    env = dict(os.environ, **extra)
    env["LD_PRELOAD"] = ":".join(libs + ([env["LD_PRELOAD"]] if env.get("LD_PRELOAD") else []))
    env[REEXEC_MARKER] = ":".join(libs)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


def main() -> int:
    """`python -m minivllm.platforms.cpu`: what is installed, and the line that preloads it for any command."""
    tcmalloc, iomp = find_tcmalloc(), find_iomp()
    print(f"tcmalloc:     {tcmalloc or 'not found (apt-get install libtcmalloc-minimal4, or conda gperftools)'}")
    print(f"Intel OpenMP: {iomp or 'not found (pip install intel-openmp; x86-64 only)'}")
    libs, extra = preload_plan(dict(os.environ, LD_PRELOAD=""))
    if libs:
        settings = " ".join(f"{k}={v}" for k, v in {**IOMP_ENV, **extra}.items()) if iomp else ""
        print(f"for a notebook or your own script, start it with:\n  LD_PRELOAD={':'.join(libs)} {settings} ...")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
