"""`python -m minivllm.generate`: generate from the command line.

    python -m minivllm.generate --chat --temperature 0 --max-tokens 16 "What is the capital of France?"
    python -m minivllm.generate --prompts-file prompts.txt --max-tokens 64
    python -m minivllm.generate --stream "Once upon a time"
    python -m minivllm.generate --tensor-parallel-size 3 "Once upon a time"      (3 ranks, gloo on a CPU)
    torchrun --nproc-per-node 3 -m minivllm.generate --tensor-parallel-size 3 "Once upon a time"

Bad arguments print a usage error and exit with code 2, without a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import asdict

from minivllm.config import EngineConfig, add_engine_args
from minivllm.core.sampling_params import RequestOutputKind, SamplingParams
from minivllm.platforms.cpu import describe_runtime


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m minivllm.generate",
                                description="Generate text with minivllm (default model: SmolLM2-135M-Instruct).")
    p.add_argument("prompts", nargs="*", help="prompts (one request each)")
    p.add_argument("--prompts-file", help="a file with one prompt per line")
    p.add_argument("--chat", action="store_true", help="wrap each prompt as a user message in the chat template")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--seed", type=int, default=None,
                   help="each request's seed (reproducible sampling whatever the batch); also the engine's seed")
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--stream", action="store_true", help="print tokens as they are generated")
    add_engine_args(p, exclude=("seed",))           # --seed above seeds the requests and the engine
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    prompts = list(args.prompts)
    if args.prompts_file:
        try:
            with open(args.prompts_file) as f:
                prompts += [line.rstrip("\n") for line in f if line.strip()]
        except OSError as e:
            parser.error(f"--prompts-file: {e.strerror}: {args.prompts_file}")
    if not prompts:
        parser.error("give at least one prompt (as an argument or with --prompts-file)")
    try:
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                seed=args.seed, max_tokens=args.max_tokens, stop=args.stop,
                                ignore_eos=args.ignore_eos,
                                output_kind=RequestOutputKind.DELTA if args.stream else RequestOutputKind.FINAL_ONLY)
    except ValueError as e:
        parser.error(str(e))

    from minivllm.worker.distributed import launched_by_torchrun
    from minivllm.entrypoints.llm import LLM

    is_rank0 = not launched_by_torchrun() or int(os.environ["RANK"]) == 0
    if not is_rank0:
        sys.stdout = open(os.devnull, "w")      # every torchrun rank runs this; rank 0 prints
    try:
        llm = LLM(**asdict(EngineConfig.from_cli_args(args)))
    except (ValueError, FileNotFoundError) as e:
        parser.error(str(e))

    if args.chat:
        tok = llm.get_tokenizer()
        prompts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                           add_generation_prompt=True) for p in prompts]
    start = time.time()
    try:
        if args.stream:
            counts = _stream(llm, prompts, params)
        else:
            outputs = llm.generate(prompts, params, use_tqdm=len(prompts) > 1)
            counts = [(len(o.prompt_token_ids), len(o.outputs[0].token_ids)) for o in outputs]
    except ValueError as e:
        parser.error(str(e))
    except KeyboardInterrupt:
        print("\n[minivllm] interrupted", file=sys.stderr)
        return 130
    finally:
        llm.llm_engine.shutdown()        # stops tensor-parallel workers (they would also stop at exit)
    elapsed = time.time() - start
    if not args.stream:
        for i, out in enumerate(outputs):
            if len(outputs) > 1:
                print(f"--- [{i}] {out.outputs[0].finish_reason}")
            print(out.outputs[0].text)
    n_in, n_out = sum(c[0] for c in counts), sum(c[1] for c in counts)
    if is_rank0:
        print(f"\n[minivllm] {len(counts)} request(s), {n_in} prompt + {n_out} output tokens in {elapsed:.2f} s "
              f"({n_out / elapsed:.1f} output tokens/s; {describe_runtime()})", file=sys.stderr)
    return 0


def _stream(llm, prompts: list[str], params: SamplingParams) -> list[tuple[int, int]]:
    """Print each request's new text as soon as a step produces it (requests interleave if several).

    `params` asks for DELTA outputs: each holds only the new text and token ids. Returns each request's
    (prompt tokens, output tokens), in input order."""
    engine = llm.llm_engine
    requests = [engine.input_processor.process_inputs(p, params) for p in prompts]   # all checked before one runs
    ids = [engine.add_request(r).request_id for r in requests]
    counts = {i: [0, 0] for i in ids}
    while engine.has_unfinished_requests():
        for out in engine.step():
            o = out.outputs[0]
            counts[out.request_id][0] = len(out.prompt_token_ids)
            counts[out.request_id][1] += len(o.token_ids)
            if o.text:
                prefix = f"[{out.request_id}] " if len(prompts) > 1 else ""
                print(prefix + o.text if prefix else o.text, end="" if not prefix else "\n", flush=True)
    print()
    return [tuple(counts[i]) for i in ids]


if __name__ == "__main__":
    from minivllm.platforms.cpu import reexec_with_cpu_runtime
    reexec_with_cpu_runtime()
    sys.exit(main())
