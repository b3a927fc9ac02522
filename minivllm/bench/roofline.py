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
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

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


def weight_bytes(cfg: ModelConfig, itemsize: int) -> int:
    """Bytes of every weight a decode step reads (the embedding table is only indexed, so left out;
    the LM head is read once whether or not it is tied)."""
    layers = cfg.num_hidden_layers * (sum(i * o for i, o in linear_shapes(cfg)) + 2 * cfg.hidden_size)
    return (layers + cfg.hidden_size * cfg.vocab_size + cfg.hidden_size) * itemsize


def kv_bytes_per_token(cfg: ModelConfig, itemsize: int) -> int:
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * itemsize


def step_floor_s(cfg: ModelConfig, itemsize: int, flops_per_s: float, bandwidth_bytes_s: float,
                 num_tokens: int, attention_pairs: int, num_sampled: int, kv_tokens_read: int) -> float:
    """The fastest one engine step can be: its FLOPs at the matmul rate or its bytes at the copy
    bandwidth, whichever takes longer (a roofline). Decode steps are memory-bound (every weight is read
    for a handful of rows); large prefills are compute-bound."""
    flops = (2 * cfg.num_hidden_layers * sum(i * o for i, o in linear_shapes(cfg)) * num_tokens
             + 4 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * attention_pairs
             + 2 * cfg.hidden_size * cfg.vocab_size * num_sampled)
    nbytes = weight_bytes(cfg, itemsize) + kv_bytes_per_token(cfg, itemsize) * kv_tokens_read
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
