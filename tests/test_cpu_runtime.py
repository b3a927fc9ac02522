"""The CPU runtime (minivllm/platforms/cpu.py): entry points re-start with tcmalloc preloaded when it is installed,
the re-started process really runs with it (and on every core), and greedy output does not change."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from minivllm.platforms import cpu
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
    monkeypatch.setattr(cpu, "has_nvidia_driver", lambda: False)
    assert preload_plan(clean_env()) == ["/lib/libtcmalloc_minimal.so.4"]
    assert preload_plan(clean_env(LD_PRELOAD="/x/libtcmalloc.so.4")) == []        # already preloaded
    monkeypatch.setattr(cpu, "has_nvidia_driver", lambda: True)
    assert preload_plan(clean_env()) == []                                          # a GPU machine


PROBE = textwrap.dedent("""
    import json, os, sys
    from minivllm.platforms.cpu import REEXEC_MARKER, loaded_runtime, reexec_with_cpu_runtime
    reexec_with_cpu_runtime()
    import torch
    torch.ones(4096, 4096).sum()            # a parallel region: OpenMP is loaded and running
    print(json.dumps({"pid": os.getpid(), "marker": os.environ.get(REEXEC_MARKER),
                      "cores": sorted(os.sched_getaffinity(0)), **loaded_runtime()}))
""")


@needs_runtime
def test_the_restarted_process_really_runs_with_tcmalloc_on_every_core(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    out = subprocess.run([sys.executable, str(script)], env=clean_env(), capture_output=True, text=True,
                         timeout=300, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["marker"], "the probe did not re-start"
    assert got["malloc"] == "tcmalloc" and got["openmp"] == "GNU (libgomp)"
    # every core this test may use is still usable after the re-start (child processes inherit the mask)
    assert got["cores"] == sorted(os.sched_getaffinity(0))
    off = subprocess.run([sys.executable, str(script)], env=clean_env(**{OPT_OUT: "0"}), capture_output=True,
                         text=True, timeout=300, check=True)
    got_off = json.loads(off.stdout.strip().splitlines()[-1])
    assert got_off == {"pid": got_off["pid"], "marker": None, "cores": got["cores"], "malloc": "glibc",
                       "openmp": "GNU (libgomp)"}


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
    assert "malloc tcmalloc, OpenMP GNU (libgomp)" in runs["preloaded"][1]
