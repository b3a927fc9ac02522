"""`python -m minivllm.bench spec`: speculative decoding off vs on, on the same workload, in one run.

Owns: two engines of the same model and seed, one without and one with `speculative_config` (default: n-gram
prompt lookup, k = 4, n-grams of 2-4 tokens), the same greedy workload (workload.py: `--workload random` or
`repeat`) through both in alternating rounds, and the report: output tokens/s of each, their ratio, the
acceptance rate and mean acceptance length (vLLM's definitions, from `get_stats()`), the median time of a
decode-only step by tokens fed (a plain 1-token decode vs a 1 + k-token verification: their ratio against the
mean acceptance length decides the speedup), and whether the greedy outputs were identical, as exact
verification promises. Rounds alternate (off, on, off, on, ...) so a neighbour's load on a shared machine falls
on both; the prefix cache is reset before each round, so every round computes every prompt. It uses only the public API (`LLM.generate`, `get_stats`, `reset_prefix_cache`).

    acceptance rate        = accepted draft tokens / draft tokens verified
    mean acceptance length = 1 + accepted draft tokens / verification steps (tokens a request gains per step)
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from dataclasses import asdict, dataclass
from typing import Callable

from minivllm.bench.offline import host_info
from minivllm.bench.workload import Workload, percentile
from minivllm.config import EngineConfig
from minivllm.entrypoints.llm import LLM

DEFAULT_SPECULATIVE_CONFIG = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
                              "prompt_lookup_max": 4}


@dataclass
class SpecResult:
    """The workload through both engines, `rounds` times each. Rates sum tokens and time over all rounds."""
    speculative_config: dict
    rounds: int
    off_wall_s: list[float]             # per round
    on_wall_s: list[float]
    output_tokens: int                  # per round (the same every round, in both engines, if outputs are equal)
    steps_off: int                      # engine steps over all rounds
    steps_on: int
    num_drafts: int                     # verification steps of a request with drafts, over all rounds
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_per_position: list[int]    # accepted drafts at position 1..k
    outputs_equal: bool                 # every round of both engines gave the same token ids
    # Decode-only steps (no prompt tokens), by tokens fed (decodes + drafts): [median ms, steps]. At batch 1,
    # off has only 1-token steps; on has 1-token steps (no draft found) and 1 + k-token verification steps.
    decode_step_ms_off: dict[int, list[float]]
    decode_step_ms_on: dict[int, list[float]]

    @property
    def off_tokens_per_s(self) -> float:
        return self.rounds * self.output_tokens / sum(self.off_wall_s)

    @property
    def on_tokens_per_s(self) -> float:
        return self.rounds * self.output_tokens / sum(self.on_wall_s)

    @property
    def speedup(self) -> float:
        return self.on_tokens_per_s / self.off_tokens_per_s

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


def run_round(llm: LLM, workload: Workload,
              decode_steps: dict[int, list[float]] | None = None) -> tuple[float, list[list[int]]]:
    """The whole workload through one engine, every request submitted at once: (wall seconds, token ids).
    Appends each decode-only step's seconds to `decode_steps[tokens fed]` if given."""
    def time_decode_steps(trace):
        if decode_steps is not None and trace.num_prefill_tokens == 0:
            decode_steps.setdefault(trace.num_decode_tokens, []).append(trace.duration_s)

    engine = llm.llm_engine
    engine.reset_prefix_cache()
    prompts = [{"prompt_token_ids": ids} for ids in workload.prompt_token_ids]
    engine.add_trace_listener(time_decode_steps)
    start = time.perf_counter()
    try:
        outputs = llm.generate(prompts, workload.sampling_params(), use_tqdm=False)
    finally:
        engine.remove_trace_listener(time_decode_steps)
    wall = time.perf_counter() - start
    return wall, [list(o.outputs[0].token_ids) for o in outputs]


def bench_spec(engine_kw: dict, speculative_config: dict, make_workload: Callable[[LLM], Workload],
               rounds: int) -> tuple[Workload, SpecResult]:
    """Build both engines, the workload (`make_workload` gets the first engine, for its tokenizer and
    vocabulary), then run it `rounds` times through each, alternating."""
    # Both schedule one batch at a time: speculation needs each step's tokens on the host, and the plain engine
    # would otherwise schedule ahead on a GPU (async_scheduling unset), so the two would differ in more than drafts.
    engine_kw = {**engine_kw, "async_scheduling": False}
    engines = {False: LLM(**{**engine_kw, "speculative_config": None}),
               True: LLM(**{**engine_kw, "speculative_config": speculative_config})}
    workload = make_workload(engines[False])
    # Untimed warmup on the workload's first prompt: lazy imports, allocator growth, the verification shapes.
    warm = Workload(workload.prompt_token_ids[:1], [min(16, workload.output_lens[0])], workload.seed,
                    workload.name, workload.ignore_eos)
    for llm in engines.values():
        run_round(llm, warm)
    before = {spec: llm.get_stats() for spec, llm in engines.items()}
    walls: dict[bool, list[float]] = {False: [], True: []}
    steps: dict[bool, dict[int, list[float]]] = {False: {}, True: {}}
    reference, equal = None, True
    for _ in range(rounds):
        for spec in (False, True):
            wall, ids = run_round(engines[spec], workload, steps[spec])
            walls[spec].append(wall)
            reference = ids if reference is None else reference
            equal = equal and ids == reference
    after = {spec: llm.get_stats() for spec, llm in engines.items()}
    for llm in engines.values():
        llm.shutdown()
    del engines
    gc.collect()
    off0, off1, on0, on1 = before[False], after[False], before[True], after[True]
    k = len(on1.num_spec_accepted_tokens_per_pos)
    per_pos0 = list(on0.num_spec_accepted_tokens_per_pos) + [0] * (k - len(on0.num_spec_accepted_tokens_per_pos))
    return workload, SpecResult(
        speculative_config, rounds, walls[False], walls[True], sum(len(t) for t in reference),
        off1.num_steps - off0.num_steps, on1.num_steps - on0.num_steps,
        on1.num_spec_drafts - on0.num_spec_drafts, on1.num_spec_draft_tokens - on0.num_spec_draft_tokens,
        on1.num_spec_accepted_tokens - on0.num_spec_accepted_tokens,
        [b - a for a, b in zip(per_pos0, on1.num_spec_accepted_tokens_per_pos)], equal,
        *({n: [1000 * percentile(ts, 50), len(ts)] for n, ts in sorted(steps[spec].items())} for spec in (False, True)))


def make_workload(args: argparse.Namespace, llm: LLM) -> Workload:
    """The workload `--workload` names, for this engine's tokenizer (repeat) or vocabulary (random)."""
    if args.workload == "repeat":
        return Workload.repeat(llm.get_tokenizer(), args.num_requests, args.output_len_max, args.seed)
    return Workload.random(args.num_requests, (args.input_len_min, args.input_len_max),
                           (args.output_len_min, args.output_len_max),
                           llm.llm_engine.model_config.vocab_size, args.seed)


def main_spec(args: argparse.Namespace, config: EngineConfig) -> int:
    host_start = host_info()
    kw = asdict(config)
    spec_config = kw.pop("speculative_config") or DEFAULT_SPECULATIVE_CONFIG
    try:
        workload, r = bench_spec(kw, spec_config, lambda llm: make_workload(args, llm), args.rounds)
    except (ValueError, FileNotFoundError) as e:
        args.parser.error(str(e))
    host_end = host_info()
    ends = "stops at EOS" if not workload.ignore_eos else "ignore_eos"
    print(f"workload:               {workload.name}, {workload.num_requests} requests, {workload.num_prompt_tokens} "
          f"prompt tokens, {workload.num_output_tokens} output tokens asked for (greedy, {ends})")
    print(f"batch:                  max_num_seqs {config.max_num_seqs}, all requests submitted at once")
    print(f"speculative_config:     {json.dumps(r.speculative_config)}")
    for i, (off, on) in enumerate(zip(r.off_wall_s, r.on_wall_s)):
        print(f"round {i + 1} off / on:       {r.output_tokens / off:.1f} / {r.output_tokens / on:.1f} output tokens/s")
    print(f"output tokens:          {r.output_tokens} per round")
    print(f"spec off:               {r.off_tokens_per_s:.1f} output tokens/s ({r.rounds} rounds, "
          f"{sum(r.off_wall_s):.1f} s, {r.steps_off} steps)")
    print(f"spec on:                {r.on_tokens_per_s:.1f} output tokens/s ({r.rounds} rounds, "
          f"{sum(r.on_wall_s):.1f} s, {r.steps_on} steps)")
    print(f"spec on / off:          {r.speedup:.2f}x")
    print(f"acceptance rate:        {r.acceptance_rate:.1%} ({r.num_accepted_tokens} of {r.num_draft_tokens} draft "
          f"tokens, {r.num_drafts} verification steps with drafts)")
    print(f"mean acceptance length: {r.mean_acceptance_length:.2f} tokens per verification step "
          f"(accepted at positions 1..k: {r.accepted_per_position})")
    for label, by_len in (("off", r.decode_step_ms_off), ("on", r.decode_step_ms_on)):
        cells = ", ".join(f"{n} tokens {ms:.1f} ms ({count} steps)" for n, (ms, count) in by_len.items())
        print(f"decode steps, spec {label + ':':4s} {cells} (median, by tokens fed per step)")
    print(f"greedy outputs equal:   {r.outputs_equal}")
    print(f"load average (1 min):   {host_start['loadavg_1min']:.2f} at start, {host_end['loadavg_1min']:.2f} "
          f"at end, on {host_start['cpu_count']} CPUs, {host_start['torch_threads']} torch threads")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"mode": "spec", "workload": workload.name, "num_requests": workload.num_requests,
                       "max_num_seqs": config.max_num_seqs, **asdict(r),
                       "off_tokens_per_s": r.off_tokens_per_s, "on_tokens_per_s": r.on_tokens_per_s,
                       "speedup": r.speedup, "acceptance_rate": r.acceptance_rate,
                       "mean_acceptance_length": r.mean_acceptance_length,
                       "host": {"start": host_start, "end": host_end}}, f, indent=2)
    return 0
