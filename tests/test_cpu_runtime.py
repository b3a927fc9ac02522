"""The CPU runtime (minivllm/platforms/cpu.py): entry points re-start with tcmalloc and Intel OpenMP when they are
installed, the re-started process really runs with them, and greedy output does not change."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from minivllm.platforms import cpu
from minivllm.platforms.cpu import IOMP_ENV, OPT_OUT, REEXEC_MARKER, preload_plan

HAVE_RUNTIME = cpu.find_tcmalloc() is not None or cpu.find_iomp() is not None
needs_runtime = pytest.mark.skipif(not HAVE_RUNTIME or not sys.platform.startswith("linux")
                                   or cpu.has_nvidia_driver(),
                                   reason="neither tcmalloc nor libiomp5 is installed here (or not a CPU machine)")


def clean_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", REEXEC_MARKER, OPT_OUT, *IOMP_ENV)}
    return dict(env, **extra)


def test_opting_out_plans_nothing():
    assert preload_plan(clean_env(**{OPT_OUT: "0"})) == ([], {})


def test_a_library_already_preloaded_is_not_added_again(monkeypatch):
    monkeypatch.setattr(cpu, "find_tcmalloc", lambda: "/lib/libtcmalloc_minimal.so.4")
    monkeypatch.setattr(cpu, "find_iomp", lambda: "/env/lib/libiomp5.so")
    monkeypatch.setattr(cpu, "has_nvidia_driver", lambda: False)
    assert preload_plan(clean_env()) == (["/lib/libtcmalloc_minimal.so.4", "/env/lib/libiomp5.so"], IOMP_ENV)
    libs, extra = preload_plan(clean_env(LD_PRELOAD="/x/libtcmalloc.so.4"))
    assert libs == ["/env/lib/libiomp5.so"]
    # another OpenMP already preloaded (e.g. torch's libgomp, as vLLM does): Intel's would be a second one
    libs, extra = preload_plan(clean_env(LD_PRELOAD="/x/libgomp.so.1"))
    assert libs == ["/lib/libtcmalloc_minimal.so.4"] and extra == {}
    # a KMP setting the user chose is kept
    assert preload_plan(clean_env(KMP_BLOCKTIME="0"))[1] == {"KMP_AFFINITY": IOMP_ENV["KMP_AFFINITY"]}


PROBE = textwrap.dedent("""
    import json, os, sys
    from minivllm.platforms.cpu import REEXEC_MARKER, loaded_runtime, reexec_with_cpu_runtime
    reexec_with_cpu_runtime()
    import torch
    torch.ones(4096, 4096).sum()            # a parallel region: OpenMP is loaded and running
    print(json.dumps({"pid": os.getpid(), "marker": os.environ.get(REEXEC_MARKER), **loaded_runtime()}))
""")


@needs_runtime
def test_the_restarted_process_really_runs_with_the_libraries(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    out = subprocess.run([sys.executable, str(script)], env=clean_env(), capture_output=True, text=True,
                         timeout=300, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["marker"], "the probe did not re-start"
    if cpu.find_tcmalloc():
        assert got["malloc"] == "tcmalloc"
    if cpu.find_iomp():
        assert got["openmp"] == "Intel (libiomp5)"
    off = subprocess.run([sys.executable, str(script)], env=clean_env(**{OPT_OUT: "0"}), capture_output=True,
                         text=True, timeout=300, check=True)
    got_off = json.loads(off.stdout.strip().splitlines()[-1])
    assert got_off == {"pid": got_off["pid"], "marker": None, "malloc": "glibc", "openmp": "GNU (libgomp)"}


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
    if cpu.find_tcmalloc():
        assert "malloc tcmalloc" in runs["preloaded"][1]
    if cpu.find_iomp():
        assert "OpenMP Intel (libiomp5)" in runs["preloaded"][1]
