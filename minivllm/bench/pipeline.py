"""`python -m minivllm.bench pipeline`: pipeline parallelism with one batch in flight vs several, on one workload.

Owns: three engines of the same model and seed, the same greedy random workload (workload.py) through each in
alternating rounds (a, b, c, a, b, c, ...; b's and c's engines are rebuilt for each turn, since a process
can be in one torch.distributed group at a time; every engine is warmed up, untimed), and the report:

    a  PP 1                                    the plain engine (one process, torch's threads)
    b  PP n, max_concurrent_batches 1          one batch goes through the stages at a time: the bubble
    c  PP n, max_concurrent_batches n          vLLM v1's batch queue: stage 0 runs batch k + 1 while later
                                               stages run batch k

n is `--pipeline-parallel-size` (2 if left at 1). It reports output tokens/s of each (median over rounds), the
ratios c / b and c / a, engine steps, and for b and c what each rank measured itself (the executor's
`record_stage_times`): its busy fraction (the sum of its stage intervals / the run's wall time) and the overlap
(how many of rank 0's batch intervals overlapped the last stage's interval of an earlier batch: 0 with one batch
in flight). Greedy outputs must be identical across a, b and c. The prefix cache is reset before each round.
`VLLM_PP_LAYER_PARTITION="a,b"` sets the layers per stage of b and c (the last stage also computes the LM head);
engine a is built without it.

Torch's thread count is process-wide and a multiproc executor sets the driver's to cores / ranks while it lives,
so each run sets the count its engine was built with: a's own threads, b's and c's per-rank threads.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass, field

import torch

from minivllm.bench.offline import host_info
from minivllm.bench.spec import run_round
from minivllm.bench.workload import Workload
from minivllm.config import EngineConfig
from minivllm.entrypoints.llm import LLM

CONFIGS = ("a", "b", "c")


@dataclass
class ConfigResult:
    """One configuration's rounds. Stage measures are empty for a (one process, no stages)."""
    label: str
    pipeline_parallel_size: int
    max_concurrent_batches: int
    torch_threads: int                  # of this (the driver) process during the runs
    wall_s: list[float] = field(default_factory=list)            # per round
    tokens_per_s: list[float] = field(default_factory=list)      # per round
    steps: list[int] = field(default_factory=list)               # engine steps per round
    busy_s: dict[int, list[float]] = field(default_factory=dict)     # rank -> per round: sum of its intervals
    batches: dict[int, list[int]] = field(default_factory=dict)      # rank -> per round: batch intervals recorded
    overlap: list[int] = field(default_factory=list)             # per round: rank 0 intervals overlapping (see above)

    @property
    def median_tokens_per_s(self) -> float:
        return statistics.median(self.tokens_per_s)

    @property
    def busy_fraction(self) -> dict[int, float]:
        """rank -> busy seconds over all rounds / wall seconds over all rounds."""
        return {rank: sum(busy) / sum(self.wall_s) for rank, busy in sorted(self.busy_s.items())}

    def to_json(self) -> dict:
        return {**asdict(self), "median_tokens_per_s": self.median_tokens_per_s,
                "busy_fraction": self.busy_fraction, "total_overlap": sum(self.overlap)}


def count_overlap(times: dict[int, list[tuple[int, float, float]]]) -> int:
    """How many of rank 0's batch intervals overlapped the last stage's interval of an earlier batch."""
    last = max(times)
    return sum(1 for b0, s0, e0 in times[0]
               if any(b1 < b0 and s1 < e0 and s0 < e1 for b1, s1, e1 in times[last]))


def bench_pipeline(engine_kw: dict, pp: int, make_workload, rounds: int
                   ) -> tuple[Workload, dict[str, ConfigResult], bool]:
    """Build engine a and the workload (`make_workload` gets engine a, for its vocabulary), then run the workload
    `rounds` times through a, b and c, alternating. Returns (workload, label -> result, outputs identical).

    A process may be in one torch.distributed group at a time, so b's and c's engines cannot live side by side:
    each is built (and warmed up, untimed) for its turn in a round and shut down after it."""
    settings = {"a": (1, None), "b": (pp, 1), "c": (pp, pp)}
    results: dict[str, ConfigResult] = {}
    plain: LLM | None = None

    def build(label: str) -> LLM:
        size, batches = settings[label]
        # VLLM_PP_LAYER_PARTITION names the PP n stages' layers; PP 1 has one stage of all of them.
        hidden = os.environ.pop("VLLM_PP_LAYER_PARTITION", None) if size == 1 else None
        try:
            # async_scheduling off at PP 1 too (unset, a GPU would turn it on there only): rows differ in stages alone
            llm = LLM(**{**engine_kw, "pipeline_parallel_size": size, "max_concurrent_batches": batches,
                         "async_scheduling": False})
        finally:
            if hidden is not None:
                os.environ["VLLM_PP_LAYER_PARTITION"] = hidden
        if label not in results:
            results[label] = ConfigResult(label, size, llm.llm_engine.max_concurrent_batches, torch.get_num_threads())
        return llm

    def warm_up(label: str, llm: LLM) -> LLM:
        """Untimed, on the workload's first prompt: lazy imports, allocator growth, the pipes' first sends."""
        torch.set_num_threads(results[label].torch_threads)
        run_round(llm, Workload(workload.prompt_token_ids[:1], [min(8, workload.output_lens[0])], workload.seed,
                                workload.name, workload.ignore_eos))
        return llm

    try:
        plain = build("a")
        workload = make_workload(plain)
        warm_up("a", plain)
        reference, identical = None, True
        for _ in range(rounds):
            for label in CONFIGS:
                llm = plain if label == "a" else warm_up(label, build(label))
                try:
                    r = results[label]
                    torch.set_num_threads(r.torch_threads)
                    executor = llm.llm_engine.executor
                    staged = r.pipeline_parallel_size > 1
                    if staged:
                        executor.record_stage_times()
                    steps0 = llm.get_stats().num_steps
                    wall, ids = run_round(llm, workload)
                    r.steps.append(llm.get_stats().num_steps - steps0)
                    r.wall_s.append(wall)
                    r.tokens_per_s.append(sum(len(t) for t in ids) / wall)
                    if staged:
                        times = executor.stage_times()
                        for rank, intervals in times.items():
                            r.busy_s.setdefault(rank, []).append(sum(e - s for _, s, e in intervals))
                            r.batches.setdefault(rank, []).append(len(intervals))
                        r.overlap.append(count_overlap(times))
                finally:
                    if llm is not plain:
                        llm.shutdown()
                        gc.collect()
                reference = ids if reference is None else reference
                identical = identical and ids == reference
    finally:
        if plain is not None:
            plain.shutdown()
        gc.collect()
    return workload, results, identical


def main_pipeline(args: argparse.Namespace, config: EngineConfig) -> int:
    host_start = host_info()
    kw = asdict(config)
    pp = config.pipeline_parallel_size if config.pipeline_parallel_size > 1 else 2
    threads = torch.get_num_threads()
    try:
        workload, results, identical = bench_pipeline(
            kw, pp, lambda llm: Workload.random(args.num_requests, (args.input_len_min, args.input_len_max),
                                                (args.output_len_min, args.output_len_max),
                                                llm.llm_engine.model_config.vocab_size, args.seed), args.rounds)
    except (ValueError, FileNotFoundError) as e:
        args.parser.error(str(e))
    finally:
        torch.set_num_threads(threads)
    host_end = host_info()
    a, b, c = (results[label] for label in CONFIGS)
    partition = os.environ.get("VLLM_PP_LAYER_PARTITION", "default")
    print(f"workload:               {workload.name}, {workload.num_requests} requests, {workload.num_prompt_tokens} "
          f"prompt tokens, {workload.num_output_tokens} output tokens (greedy, ignore_eos), {args.rounds} rounds "
          f"alternating a, b, c")
    print(f"layer partition:        VLLM_PP_LAYER_PARTITION={partition}")
    print(f"{'config':40s} {'tok/s':>8s} {'steps/round':>11s} {'threads':>7s}  busy fraction by rank   overlap")
    names = {"a": "a  PP 1", "b": f"b  PP {pp}, 1 batch in flight",
             "c": f"c  PP {pp}, {c.max_concurrent_batches} batches in flight"}
    for label in CONFIGS:
        r = results[label]
        busy = " ".join(f"{rank}:{f:.2f}" for rank, f in r.busy_fraction.items()) or "-"
        overlap = (f"{sum(r.overlap)} of {sum(r.batches[0])}" if r.overlap else "-")
        print(f"{names[label]:40s} {r.median_tokens_per_s:8.1f} {sum(r.steps) / len(r.steps):11.0f} "
              f"{r.torch_threads:7d}  {busy:22s} {overlap}")
    for i in range(args.rounds):
        print(f"round {i + 1} a / b / c:       " + " / ".join(f"{results[x].tokens_per_s[i]:.1f}" for x in CONFIGS)
              + " output tokens/s")
    c_over_b, c_over_a = c.median_tokens_per_s / b.median_tokens_per_s, c.median_tokens_per_s / a.median_tokens_per_s
    print(f"c / b:                  {c_over_b:.2f}x (batches in flight vs the bubble)")
    print(f"c / a:                  {c_over_a:.2f}x (pipeline vs one process)")
    print(f"identical greedy outputs: {'yes' if identical else 'no'}")
    print(f"load average (1 min):   {host_start['loadavg_1min']:.2f} at start, {host_end['loadavg_1min']:.2f} "
          f"at end, on {host_start['cpu_count']} CPUs")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"mode": "pipeline", "workload": workload.name, "num_requests": workload.num_requests,
                       "output_tokens": workload.num_output_tokens, "rounds": args.rounds,
                       "pipeline_parallel_size": pp, "layer_partition": partition,
                       "configs": {label: results[label].to_json() for label in CONFIGS},
                       "c_over_b": c_over_b, "c_over_a": c_over_a, "outputs_identical": identical,
                       "host": {"start": host_start, "end": host_end}}, f, indent=2)
    return 0
