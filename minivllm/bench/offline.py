"""`python -m minivllm.bench` (offline, the default mode): minivllm's throughput and latency on one batch.

Owns: running the seeded workload (workload.py) through `LLM.generate` with every request submitted at
once, and the offline report: output tokens/s, TTFT and TPOT percentiles, KV slot utilization, and, in the
same run, HF `generate` on the same requests (`--compare hf`, hf.py) and the hardware's ceilings
(roofline.py). It uses only the public API (`LLM.generate`, `RequestOutput.metrics`, trace listeners);
it never reaches into the scheduler or the KV cache.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from dataclasses import asdict

from minivllm.bench.hf import bench_hf, hf_generate_batch, load_hf_model
from minivllm.bench.roofline import StepWork, measure_hardware, print_hardware, step_work
from minivllm.platforms.cpu import describe_runtime
from minivllm.bench.workload import (TOKEN_ID_LOW, LatencyResult, ThroughputResult, Workload, greedy_params,
                                     percentile)
from minivllm.config import EngineConfig
from minivllm.entrypoints.llm import LLM


def warmup_minivllm(llm: LLM) -> None:
    """One tiny untimed generate: first calls pay for lazy imports, allocator growth and kernel choice."""
    prompts = [{"prompt_token_ids": list(range(TOKEN_ID_LOW, TOKEN_ID_LOW + n))} for n in (8, 12)]
    llm.generate(prompts, greedy_params(4), use_tqdm=False)


def bench_minivllm(llm: LLM, workload: Workload,
                   steps: list[StepWork] | None = None) -> tuple[ThroughputResult, LatencyResult, float]:
    """Submit every request at once and time `generate` until the last one finishes.

    Also returns the KV slot utilization: tokens with KV / block slots held, summed over every step
    (only each request's last block is partly empty, so it should stay close to 1), and appends each
    step's StepWork to `steps` if given.
    """
    prompts = [{"prompt_token_ids": ids} for ids in workload.prompt_token_ids]
    params = [greedy_params(n) for n in workload.output_lens]
    usage = [0, 0]

    def count_slots(trace):                       # cheap: two sums per step
        usage[0] += trace.kv_tokens_stored
        usage[1] += trace.kv_slots_allocated
        if steps is not None:
            steps.append(step_work(trace))

    engine = llm.llm_engine
    engine.add_trace_listener(count_slots)
    start = time.perf_counter()
    try:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        engine.remove_trace_listener(count_slots)
    wall = time.perf_counter() - start

    counts = [len(o.outputs[0].token_ids) for o in outputs]
    ttfts, tpots = [], []
    for o, n in zip(outputs, counts):
        m = o.metrics
        ttfts.append(m.first_token_time - m.arrival_time)
        if n > 1:
            tpots.append((m.last_token_time - m.first_token_time) / (n - 1))
    latency = LatencyResult(percentile(ttfts, 50), percentile(ttfts, 99),
                            percentile(tpots, 50), percentile(tpots, 99))
    return ThroughputResult("minivllm", wall, counts), latency, usage[0] / max(usage[1], 1)


def print_minivllm_report(workload: Workload, mv: ThroughputResult, latency: LatencyResult,
                          kv_utilization: float) -> None:
    ms = 1000
    print(f"requests:             {workload.num_requests}")
    print(f"prompt tokens:        {workload.num_prompt_tokens}")
    print(f"output tokens:        {mv.num_output_tokens} (asked for {workload.num_output_tokens})")
    print(f"minivllm wall time:   {mv.wall_s:.2f} s")
    print(f"minivllm throughput:  {mv.output_tokens_per_s:.1f} output tokens/s")
    print(f"TTFT p50 / p99:       {latency.ttft_p50 * ms:.0f} / {latency.ttft_p99 * ms:.0f} ms")
    print(f"TPOT p50 / p99:       {latency.tpot_p50 * ms:.1f} / {latency.tpot_p99 * ms:.1f} ms")
    print(f"KV slot utilization:  {kv_utilization:.3f} (tokens with KV / block slots held, over all steps)")


def print_hf_report(mv: ThroughputResult, hf: ThroughputResult) -> None:
    print(f"HF wall time:         {hf.wall_s:.2f} s")
    print(f"HF throughput:        {hf.output_tokens_per_s:.1f} useful output tokens/s")
    print(f"minivllm / HF:        {mv.output_tokens_per_s / hf.output_tokens_per_s:.2f}x")


def host_info() -> dict:
    """How busy the machine was (on a shared 2-core box a neighbour's job stalls a 2-thread torch run), and
    which allocator and OpenMP this process runs with (platforms/cpu/runtime.py: docs/benchmarks.md has what tcmalloc is worth)."""
    import torch

    from minivllm.platforms.cpu import loaded_runtime

    return {"cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "loadavg_1min": os.getloadavg()[0], "runtime": loaded_runtime()}


def throughput_json(r: ThroughputResult) -> dict:
    return {"wall_s": r.wall_s, "output_tokens": r.num_output_tokens, "output_tokens_per_s": r.output_tokens_per_s,
            "output_tokens_per_request": r.output_tokens_per_request}


def main_offline(args: argparse.Namespace, config: EngineConfig) -> int:
    host_start = host_info()
    try:
        llm = LLM(**asdict(config))
    except (ValueError, FileNotFoundError) as e:           # a bad model path or device is a usage error too
        args.parser.error(str(e))
    engine = llm.llm_engine
    model_dir, engine_config = engine.model_path, asdict(engine.config)
    workload = Workload.random(args.num_requests, (args.input_len_min, args.input_len_max),
                               (args.output_len_min, args.output_len_max),
                               engine.model_config.vocab_size, args.seed)

    warmup_minivllm(llm)
    before = llm.get_stats()
    steps: list[StepWork] = []
    mv, latency, kv_utilization = bench_minivllm(llm, workload, steps)
    after = llm.get_stats()
    graphs = engine.model_runner.graphs
    graph_note = (None if engine.device.type != "cuda" else
                  "off" if graphs is None else
                  f"on ({graphs.stats.replays} decode steps replayed, {graphs.stats.eager_steps} eager steps, "
                  f"{len(graphs.sizes)} batch sizes captured)")
    del graphs
    async_note = ("on" if engine.async_scheduling else "off") + (" (unset, so decided for this device: "
                                                                 "EngineConfig.async_scheduling_on)"
                                                                 if config.async_scheduling is None else "")
    llm.shutdown()                                         # workers, if any; frees the weights and the KV cache
    model_cfg, device, dtype = engine.model_config, engine.device, engine.model_runner.dtype
    # minivllm's part now, so a slow or failing baseline cannot take it along (HF at batch 64 on the GPU
    # workload took over 3 minutes on an H200)
    print_minivllm_report(workload, mv, latency, kv_utilization)
    if graph_note is not None:
        print(f"CUDA graphs:          {graph_note}", flush=True)
    print(f"async scheduling:     {async_note}", flush=True)

    hf = None
    if args.compare == "hf":
        del llm, engine                                    # free minivllm's weights and KV cache first
        gc.collect()
        model = load_hf_model(model_dir, dtype, device)
        hf_generate_batch(model, [[TOKEN_ID_LOW] * 8], 2)   # untimed warmup, like minivllm's
        hf = bench_hf(model, workload, args.hf_batch_size)
        del model
        gc.collect()
    hw = measure_hardware(model_cfg, device, dtype, workload, steps, args.no_ceiling, args.decode_batch,
                          config.quantization)
    host_end = host_info()

    if hf is not None:
        print_hf_report(mv, hf)
    print_hardware(hw, mv, hf)
    print(f"load average (1 min): {host_start['loadavg_1min']:.2f} at start, {host_end['loadavg_1min']:.2f} "
          f"at end, on {host_start['cpu_count']} CPUs, {host_start['torch_threads']} torch threads")
    print(f"CPU runtime:          {describe_runtime()}")
    if args.json:
        report = {
            "mode": args.mode,
            "workload": {"num_requests": workload.num_requests, "seed": workload.seed,
                         "num_prompt_tokens": workload.num_prompt_tokens,
                         "num_output_tokens": workload.num_output_tokens,
                         "prompt_lens": [len(p) for p in workload.prompt_token_ids],
                         "output_lens": workload.output_lens},
            "engine_config": engine_config,
            "host": {"start": host_start, "end": host_end},
            "cuda_graphs": graph_note,
            "async_scheduling": async_note,
            "minivllm": {**throughput_json(mv), **asdict(latency), "kv_slot_utilization": kv_utilization,
                         "num_steps": after.num_steps - before.num_steps,
                         "num_preemptions": after.num_preemptions - before.num_preemptions},
            "hf": None if hf is None else {**throughput_json(hf), "batch_size": args.hf_batch_size},
            "ratio_minivllm_over_hf": None if hf is None else mv.output_tokens_per_s / hf.output_tokens_per_s,
            "hardware": hw,
        }
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2, default=str)
    return 0
