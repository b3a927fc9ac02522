"""`python -m minivllm.bench long-prompt`: how long a running stream waits while a long prompt is prefilled.

Owns: one engine, a request that decodes (the stream), then a prompt of --long-prompt-len random ids arriving
behind it; run with long_prefill_token_threshold 0 (the whole prompt in one step, as far as the budget allows)
and at the engine's setting (the platform's default unless --long-prefill-token-threshold is given), in
alternating rounds. For each: the long prompt's prefill time, and the stream's gaps between tokens while it was
prefilled (each step gives the stream one token, so a gap is a step): p50, p99 and the longest. The greedy
tokens of both requests must be the same in both settings (chunking changes the schedule, never the answer;
the stream's are compared as far as the shortest round took it).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import time
from dataclasses import dataclass

from minivllm.bench.workload import TOKEN_ID_HIGH, TOKEN_ID_LOW, greedy_params
from minivllm.config import EngineConfig
from minivllm.engine.llm_engine import LLMEngine


@dataclass
class LongPromptRound:
    threshold: int
    prefill_s: float              # from the long prompt's arrival to its first token
    steps: int                    # steps that prefilled it
    gap_p50_s: float              # the stream's gaps between tokens meanwhile
    gap_p99_s: float
    gap_max_s: float
    tokens: list[list[int]]       # greedy tokens: the stream's, the long prompt's


def run_round(engine: LLMEngine, threshold: int, long_ids: list[int], stream_ids: list[int]) -> LongPromptRound:
    engine.scheduler.long_prefill_token_threshold = threshold
    engine.reset_prefix_cache()                    # every round computes the whole prompt
    stream = engine.add_request({"prompt_token_ids": stream_ids}, greedy_params(4096), request_id="stream")
    for _ in range(3):
        engine.step()
    long = engine.add_request({"prompt_token_ids": long_ids}, greedy_params(8), request_id="long")
    start, gaps = time.perf_counter(), []
    while long.num_output_tokens == 0:
        t = time.perf_counter()
        engine.step()
        gaps.append(time.perf_counter() - t)
    prefill_s = time.perf_counter() - start
    while long.request_id in engine.requests:
        engine.step()
    tokens = [list(stream.output_token_ids), list(long.output_token_ids)]
    engine.abort_request("stream")
    gaps.sort()
    return LongPromptRound(threshold, prefill_s, len(gaps), statistics.median(gaps),
                           gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))], gaps[-1], tokens)


def main_long_prompt(args: argparse.Namespace, config: EngineConfig) -> int:
    engine = LLMEngine(config)
    setting = engine.scheduler.long_prefill_token_threshold
    rng = random.Random(args.seed)
    long_ids = [rng.randrange(TOKEN_ID_LOW, TOKEN_ID_HIGH) for _ in range(args.long_prompt_len)]
    stream_ids = [rng.randrange(TOKEN_ID_LOW, TOKEN_ID_HIGH) for _ in range(16)]
    rounds = [run_round(engine, threshold, long_ids, stream_ids)
              for _ in range(args.rounds) for threshold in (0, setting)]
    print(f"a stream decoding while a {args.long_prompt_len}-token prompt arrives ({engine.model_runner.dtype}, "
          f"{engine.device.type}), {args.rounds} alternating rounds:")
    for r in rounds:
        print(f"  long_prefill_token_threshold {r.threshold:5d}: prefill {r.prefill_s:6.1f} s in {r.steps:3d} steps; "
              f"the stream's gaps p50 {r.gap_p50_s:.2f} s, p99 {r.gap_p99_s:.2f} s, longest {r.gap_max_s:.2f} s")
    n = min(len(r.tokens[0]) for r in rounds)       # the stream decoded as many steps as the prefill took
    same = all(r.tokens[1] == rounds[0].tokens[1] and r.tokens[0][:n] == rounds[0].tokens[0][:n] for r in rounds)
    print(f"same greedy tokens in every round: {same}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([dataclasses.asdict(r) | {"tokens": None} for r in rounds], f, indent=1)
    engine.shutdown()
    return 0 if same else 1
