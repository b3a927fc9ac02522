"""What the hardware allows: a ceiling for the benchmark to be compared with, measured in the same run.

Owns: counting the work a workload needs (FLOPs on a CPU, bytes on a GPU) and timing the hardware doing
the same kind of work, so `python -m minivllm.bench` can print "x% of the ceiling" next to "y times HF".

CPU (compute-bound at these batch sizes): every token runs every linear layer once, so
    FLOPs = sum over tokens of  2 * linear_params_per_token  +  4 * context * heads * head_dim * layers
          + 2 * hidden * vocab for each sampled token (the LM head runs only on rows that sample)
and the ceiling is that many FLOPs at the rate of the model's own matmul shapes, timed here at a batch
of 256 tokens (the best case: decode steps have fewer rows and run slower).
    ceiling output tokens/s = output tokens / (FLOPs / measured FLOP/s)

Memory: a step must read every weight once and every cached K and V it attends to once, so at the
measured copy bandwidth a decode step (a few rows, every weight) cannot beat
    decode step floor = (weight bytes + KV bytes of the batch) / bandwidth
`step_floor_s` takes the larger of the two bounds for one step: the roofline of that step.

A run's steps reach it as `StepWork` (`step_work(trace)`: tokens, attention pairs, sampled rows, KV read);
`measure_hardware` puts a whole run against both ceilings and `print_hardware` reports it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from minivllm.bench.workload import ThroughputResult, Workload, percentile
from minivllm.model.llama import ModelConfig


def linear_shapes(cfg: ModelConfig) -> list[tuple[int, int]]:
    """(in_features, out_features) of one decoder layer's matmuls, fused as the model runs them."""
    h, d = cfg.hidden_size, cfg.head_dim
    return [(h, (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * d),   # qkv_proj
            (cfg.num_attention_heads * d, h),                                   # o_proj
            (h, 2 * cfg.intermediate_size),                                     # gate_up_proj
            (cfg.intermediate_size, h)]                                         # down_proj


def workload_flops(cfg: ModelConfig, prompt_lens: list[int], output_lens: list[int]) -> float:
    """FLOPs to prefill every prompt and decode every output token (the last one is sampled, never fed)."""
    per_token = 2 * cfg.num_hidden_layers * sum(i * o for i, o in linear_shapes(cfg))
    attn_per_ctx = 4 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim   # QK^T and PV
    lm_head = 2 * cfg.hidden_size * cfg.vocab_size
    total = 0.0
    for p, o in zip(prompt_lens, output_lens):
        fed = p + o - 1                                   # tokens that run through the layers
        total += fed * per_token
        total += attn_per_ctx * fed * (fed + 1) / 2       # token at position t attends to t + 1 keys
        total += o * lm_head
    return total


def measure_matmul_rate(cfg: ModelConfig, dtype=torch.float32, device="cpu", batch_tokens: int = 256,
                        min_time_s: float = 1.0) -> float:
    """FLOP/s of one decoder layer's four matmuls at `batch_tokens` rows, repeated for about min_time_s."""
    x = {i: torch.randn(batch_tokens, i, dtype=dtype, device=device) for i, _ in linear_shapes(cfg)}
    w = [torch.randn(o, i, dtype=dtype, device=device) * 0.02 for i, o in linear_shapes(cfg)]
    flops = 2 * batch_tokens * sum(i * o for i, o in linear_shapes(cfg))

    def layer():
        for (i, _), weight in zip(linear_shapes(cfg), w):
            F.linear(x[i], weight)

    layer()                                               # warm up (allocator, MKL's thread pool)
    reps, elapsed = 0, 0.0
    start = time.perf_counter()
    while elapsed < min_time_s:
        layer()
        reps += 1
        if device != "cpu":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
    return flops * reps / elapsed


QUANTIZED_TENSORS = ("qweight", "qscale", "qscales_zeros", "qoffset")   # what quant methods leave on a layer


def measure_quantized(cfg: ModelConfig, quantization: str, dtype=torch.bfloat16, batch_tokens: int = 256,
                      min_time_s: float = 1.0) -> tuple[float, int]:
    """For `quantization` (platforms/cpu/quantization.py) on a CPU: the FLOP/s of one decoder layer's four matmuls
    through that format's own kernels at `batch_tokens` rows of `dtype` x, and the bytes of every weight a decode step
    reads in that format (the quantized layers and LM head, the norms in `dtype`). Random weights of the model's
    shapes; gguf is timed as int4 layers with an int8 head, as it runs (random weights are not Q4_1 values)."""
    from minivllm.model.layers import ColumnParallelLinear, TPGroup
    from minivllm.platforms.cpu.quantization import get_quant_method

    def quantized(i: int, o: int, name: str) -> ColumnParallelLinear:
        layer = ColumnParallelLinear(i, o, False, TPGroup())
        layer.weight.data = torch.randn(o, i) * 0.02
        layer.quant_method = get_quant_method(name)
        layer.quant_method.process_weights_after_loading(layer)
        return layer

    def nbytes(layer: ColumnParallelLinear) -> int:
        return sum(getattr(layer, n).nbytes for n in QUANTIZED_TENSORS if hasattr(layer, n))

    layers = [quantized(i, o, "int4" if quantization == "gguf" else quantization) for i, o in linear_shapes(cfg)]
    head = quantized(cfg.hidden_size, cfg.vocab_size, "int8" if quantization == "gguf" else quantization)
    norms = (2 * cfg.num_hidden_layers + 1) * cfg.hidden_size * dtype.itemsize
    total_bytes = cfg.num_hidden_layers * sum(nbytes(layer) for layer in layers) + nbytes(head) + norms
    x = {i: torch.randn(batch_tokens, i, dtype=dtype) for i, _ in linear_shapes(cfg)}
    flops = 2 * batch_tokens * sum(i * o for i, o in linear_shapes(cfg))

    def layer_step():
        for (i, _), layer in zip(linear_shapes(cfg), layers):
            layer.quant_method.apply(layer, x[i], None)

    layer_step()                                          # warm up
    reps, elapsed, start = 0, 0.0, time.perf_counter()
    while elapsed < min_time_s:
        layer_step()
        reps += 1
        elapsed = time.perf_counter() - start
    return flops * reps / elapsed, total_bytes


def weight_bytes(cfg: ModelConfig, itemsize: int) -> int:
    """Bytes of every weight a decode step reads (the embedding table is only indexed, so left out;
    the LM head is read once whether or not it is tied)."""
    layers = cfg.num_hidden_layers * (sum(i * o for i, o in linear_shapes(cfg)) + 2 * cfg.hidden_size)
    return (layers + cfg.hidden_size * cfg.vocab_size + cfg.hidden_size) * itemsize


def kv_bytes_per_token(cfg: ModelConfig, itemsize: int) -> int:
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * itemsize


def step_floor_s(cfg: ModelConfig, itemsize: int, flops_per_s: float, bandwidth_bytes_s: float,
                 num_tokens: int, attention_pairs: int, num_sampled: int, kv_tokens_read: int,
                 weights: int | None = None) -> float:
    """The fastest one engine step can be: its FLOPs at the matmul rate or its bytes at the copy
    bandwidth, whichever takes longer (a roofline). Decode steps are memory-bound (every weight is read
    for a handful of rows); large prefills are compute-bound. `weights`: the bytes of the weights a step
    reads, if not `itemsize` each (a quantized model)."""
    flops = (2 * cfg.num_hidden_layers * sum(i * o for i, o in linear_shapes(cfg)) * num_tokens
             + 4 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * attention_pairs
             + 2 * cfg.hidden_size * cfg.vocab_size * num_sampled)
    weights = weight_bytes(cfg, itemsize) if weights is None else weights
    nbytes = weights + kv_bytes_per_token(cfg, itemsize) * kv_tokens_read
    return max(flops / flops_per_s, nbytes / bandwidth_bytes_s)


def measure_copy_bandwidth(device="cpu", nbytes: int = 256 * 2**20, reps: int = 10) -> float:
    """Bytes/s (read + written) of a large `copy_`: what a memory-bound step can hope for."""
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(reps):
        if device != "cpu":
            torch.cuda.synchronize()
        start = time.perf_counter()
        dst.copy_(src)
        if device != "cpu":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return 2 * nbytes / sorted(times)[len(times) // 2]


# ---------------------------------------------------------------------- one run against its ceilings
@dataclass(frozen=True)
class StepWork:
    """What one engine step computed, from its StepTrace: enough to give it a roofline floor."""
    duration_s: float
    num_tokens: int              # rows through the layers
    attention_pairs: int         # (query, key) pairs attended, summed over the new tokens
    num_sampled: int             # rows through the LM head
    kv_tokens_read: int          # cached tokens each layer's attention reads
    num_decode: int
    decode_only: bool


def step_work(trace) -> StepWork:
    pairs = kv = sampled = 0
    for r in trace.requests:
        if not r.kind:
            continue
        n, end = r.num_scheduled_tokens, r.num_computed_tokens        # new tokens end at position end - 1
        pairs += n * (2 * end - n + 1) // 2
        kv += end
        sampled += end == r.num_prompt_tokens + r.num_output_tokens - 1
    return StepWork(trace.duration_s, trace.num_prefill_tokens + trace.num_decode_tokens, pairs, sampled, kv,
                    trace.num_decode_tokens, trace.num_prefill_tokens == 0)


def measure_hardware(cfg, device, dtype, workload: Workload, steps: list[StepWork], skip: bool,
                     decode_batch: int | None = None, quantization: str | None = None) -> dict | None:
    """The ceilings, measured after the run on the same machine:
    - matmul: the workload's FLOPs at the model's matmul rate, as output tokens/s;
    - roofline: each step of this run at max(FLOPs / matmul rate, bytes / copy bandwidth), summed;
    - decode: the fullest decode-only steps against their memory floor.
    With `quantization`, the matmul rate is that format's own kernels' and the weight bytes its own
    (measure_quantized)."""
    if skip:
        return None
    dev = str(device)
    if quantization is None:
        rate, weights = measure_matmul_rate(cfg, dtype, dev), None
    else:
        rate, weights = measure_quantized(cfg, quantization, dtype)
    bandwidth = measure_copy_bandwidth(dev)
    flops = workload_flops(cfg, [len(p) for p in workload.prompt_token_ids], workload.output_lens)
    floors = [step_floor_s(cfg, dtype.itemsize, rate, bandwidth, st.num_tokens, st.attention_pairs,
                           st.num_sampled, st.kv_tokens_read, weights) for st in steps]
    hw = {"device": dev, "dtype": str(dtype), "quantization": quantization, "weight_bytes": weights,
          "matmul_flops_per_s": rate, "copy_bandwidth_bytes_per_s": bandwidth,
          "workload_flops": flops, "matmul_ceiling_output_tokens_per_s": workload.num_output_tokens / (flops / rate),
          "roofline_s": sum(floors), "roofline_output_tokens_per_s": workload.num_output_tokens / sum(floors),
          "num_steps": len(steps), "decode": None}
    decode = [(st, f) for st, f in zip(steps, floors) if st.decode_only]
    if decode:
        batches = sorted({st.num_decode for st, _ in decode})
        # the fullest decode steps of the run, or those closest to --decode-batch
        batch = batches[-1] if decode_batch is None else min(batches, key=lambda b: abs(b - decode_batch))
        full = [(st, f) for st, f in decode if st.num_decode == batch]
        hw["decode"] = {"batch": batch, "num_steps": len(full),
                        "median_step_s": percentile([st.duration_s for st, _ in full], 50),
                        "median_floor_s": percentile([f for _, f in full], 50),
                        "median_ratio_to_floor": percentile([st.duration_s / f for st, f in full], 50)}
    return hw


def print_hardware(hw: dict | None, mv: ThroughputResult, hf: ThroughputResult | None) -> None:
    if hw is None:
        return
    tps = mv.output_tokens_per_s
    kind = hw['dtype'] if not hw.get("quantization") else f"{hw['quantization']} on {hw['dtype']} x, its own kernels"
    print(f"matmul rate:          {hw['matmul_flops_per_s'] / 1e9:.1f} GFLOP/s ({kind}, the model's layer "
          f"matmuls at 256 tokens, {hw['device']})")
    if hw.get("weight_bytes"):
        print(f"weights read a step:  {hw['weight_bytes'] / 1e6:.0f} MB ({hw['quantization']})")
    print(f"copy bandwidth:       {hw['copy_bandwidth_bytes_per_s'] / 1e9:.1f} GB/s (read + write)")
    ceiling = hw["matmul_ceiling_output_tokens_per_s"]
    print(f"matmul ceiling:       {ceiling:.1f} output tokens/s ({hw['workload_flops'] / 1e12:.2f} TFLOP at the "
          f"matmul rate); minivllm at {tps / ceiling:.0%}"
          + (f", HF at {hf.output_tokens_per_s / ceiling:.0%}" if hf is not None else ""))
    roof = hw["roofline_output_tokens_per_s"]
    print(f"roofline of the run:  {roof:.1f} output tokens/s (each of its {hw['num_steps']} steps at max(FLOPs / "
          f"matmul rate, bytes / bandwidth)); minivllm at {tps / roof:.0%}")
    d = hw["decode"]
    if d is not None:
        print(f"decode steps:         batch {d['batch']}: median {d['median_step_s'] * 1000:.1f} ms vs a memory "
              f"floor of {d['median_floor_s'] * 1000:.1f} ms ({d['median_ratio_to_floor']:.2f}x), "
              f"{d['num_steps']} steps")
