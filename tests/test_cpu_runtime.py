"""The CPU runtime (minivllm/platforms/cpu/runtime.py): entry points re-start with tcmalloc and Intel's OpenMP preloaded
when they are installed, the re-started process really runs with them (on every core, with as many threads),
and greedy output does not change."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from minivllm.platforms.cpu import runtime as cpu
from minivllm.platforms.cpu import OPT_OUT, REEXEC_MARKER, preload_plan

needs_runtime = pytest.mark.skipif(cpu.find_tcmalloc() is None or not sys.platform.startswith("linux")
                                   or cpu.has_nvidia_driver(),
                                   reason="tcmalloc is not installed here (apt-get install libtcmalloc-minimal4), "
                                          "or this is not a CPU machine")


def clean_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", REEXEC_MARKER, OPT_OUT)}
    return dict(env, **extra)


def test_opting_out_plans_nothing():
    assert preload_plan(clean_env(**{OPT_OUT: "0"})) == []


def test_tcmalloc_is_planned_once(monkeypatch):
    monkeypatch.setattr(cpu, "find_tcmalloc", lambda: "/lib/libtcmalloc_minimal.so.4")
    monkeypatch.setattr(cpu, "find_iomp", lambda: None)
    monkeypatch.setattr(cpu, "has_nvidia_driver", lambda: False)
    assert preload_plan(clean_env()) == ["/lib/libtcmalloc_minimal.so.4"]
    assert preload_plan(clean_env(LD_PRELOAD="/x/libtcmalloc.so.4")) == []        # already preloaded
    monkeypatch.setattr(cpu, "has_nvidia_driver", lambda: True)
    assert preload_plan(clean_env()) == []                                          # a GPU machine


def test_intel_openmp_comes_with_tcmalloc_unless_asked_not_to(monkeypatch):
    monkeypatch.setattr(cpu, "find_tcmalloc", lambda: "/lib/libtcmalloc_minimal.so.4")
    monkeypatch.setattr(cpu, "find_iomp", lambda: "/env/lib/libiomp5.so")
    monkeypatch.setattr(cpu, "has_nvidia_driver", lambda: False)
    assert preload_plan(clean_env()) == ["/lib/libtcmalloc_minimal.so.4", "/env/lib/libiomp5.so"]
    assert preload_plan(clean_env(**{OPT_OUT: "tcmalloc"})) == ["/lib/libtcmalloc_minimal.so.4"]
    assert preload_plan(clean_env(LD_PRELOAD="/x/libiomp5.so")) == ["/lib/libtcmalloc_minimal.so.4"]
    assert preload_plan(clean_env(**{OPT_OUT: "0"})) == []
    monkeypatch.setattr(cpu, "find_tcmalloc", lambda: None)
    assert preload_plan(clean_env()) == []                   # one re-start for both, only with tcmalloc


# What the re-started process should report for OpenMP: Intel's when `intel-openmp` is installed here.
EXPECTED_OPENMP = "Intel (libiomp5)" if cpu.find_iomp() else "GNU (libgomp)"

PROBE = textwrap.dedent("""
    import json, os, sys
    from minivllm.platforms.cpu import REEXEC_MARKER, loaded_runtime, reexec_with_cpu_runtime
    reexec_with_cpu_runtime()
    import torch
    torch.ones(4096, 4096).sum()            # a parallel region: OpenMP is loaded and running
    print(json.dumps({"pid": os.getpid(), "marker": os.environ.get(REEXEC_MARKER), "threads": torch.get_num_threads(),
                      "cores": sorted(os.sched_getaffinity(0)), **loaded_runtime()}))
""")


@pytest.mark.slow
@needs_runtime
def test_the_restarted_process_really_runs_with_the_preload_on_every_core(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    out = subprocess.run([sys.executable, str(script)], env=clean_env(), capture_output=True, text=True,
                         timeout=300, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["marker"], "the probe did not re-start"
    assert got["malloc"] == "tcmalloc" and got["openmp"] == EXPECTED_OPENMP
    # every core this test may use is still usable after the re-start (child processes inherit the mask)
    assert got["cores"] == sorted(os.sched_getaffinity(0))
    off = subprocess.run([sys.executable, str(script)], env=clean_env(**{OPT_OUT: "0"}), capture_output=True,
                         text=True, timeout=300, check=True)
    got_off = json.loads(off.stdout.strip().splitlines()[-1])
    assert got_off == {"pid": got_off["pid"], "marker": None, "cores": got["cores"], "malloc": "glibc",
                       "openmp": "GNU (libgomp)", "threads": got["threads"]}     # as many torch threads either way


@pytest.mark.slow
@needs_runtime
def test_greedy_output_is_identical_with_and_without_the_preload():
    """The same CLI run twice (fp32, greedy, two prompts batched): the text and token counts are identical, and
    the summary line shows which runtime each run really had."""
    cmd = [sys.executable, "-m", "minivllm.generate", "--temperature", "0", "--max-tokens", "24", "--ignore-eos",
           "The capital of France is", "def fibonacci(n):"]
    runs = {}
    for name, env in (("plain", clean_env(**{OPT_OUT: "0"})), ("preloaded", clean_env())):
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, check=True)
        runs[name] = (p.stdout, p.stderr.strip().splitlines()[-1])
    assert runs["plain"][0] == runs["preloaded"][0] and runs["plain"][0].count("---") == 2
    assert "malloc glibc, OpenMP GNU (libgomp)" in runs["plain"][1]
    assert f"malloc tcmalloc, OpenMP {EXPECTED_OPENMP}" in runs["preloaded"][1]


def test_bf16_on_a_cpu_without_bf16_arithmetic_is_served_with_a_warning(monkeypatch, caplog):
    import logging

    import torch

    from minivllm.model import loader
    cpu_dev = torch.device("cpu")
    monkeypatch.setattr(loader, "has_bf16_arithmetic", lambda: False)
    with caplog.at_level(logging.WARNING, logger="minivllm.model.loader"):
        assert loader.resolve_dtype("bfloat16", None, cpu_dev) == torch.bfloat16
        assert loader.resolve_dtype("auto", None, cpu_dev) == torch.float32
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "bfloat16" in warnings[0] and "dtype='float32'" in warnings[0]
    caplog.clear()
    monkeypatch.setattr(loader, "has_bf16_arithmetic", lambda: True)      # AVX-512 BF16 / AMX: no warning
    with caplog.at_level(logging.WARNING, logger="minivllm.model.loader"):
        assert loader.resolve_dtype("bf16", None, cpu_dev) == torch.bfloat16
    assert not caplog.records
    with open("/proc/cpuinfo") as f:                                       # the probe reads this machine's flags
        flags = set(next(line for line in f if line.startswith("flags")).split(":", 1)[1].split())
    assert cpu.has_bf16_arithmetic() == bool({"avx512_bf16", "amx_bf16"} & flags)
