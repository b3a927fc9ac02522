"""Benchmarks: `python -m minivllm.bench [offline|prefix|kernels|serve] [--compare hf] [--json PATH]`.

Owns: building a seeded synthetic workload, timing minivllm on it, and (with `--compare hf`) timing
Hugging Face transformers' `generate` on the very same requests, side by side in one process.
It only uses the public API (`LLM.generate`, `RequestOutput.metrics`); it never reaches into the engine.

The offline workload is nano-vllm's: N requests of random token ids, prompt lengths U[a, b], output
lengths U[c, d], `ignore_eos=True` so every request produces exactly the tokens it asked for, greedy
decoding so both engines do the same work. Throughput counts only the tokens requests asked for:
HF's static batches run every row to the longest request of the batch, and those extra tokens are waste.

    minivllm (continuous batching):  a request leaves the moment it is done; a waiting one takes its place.
    HF (static batches of B):        [r0 r1 ... rB-1] all run max(out_len) steps, then the next batch.

The `kernels` mode (CUDA only) times the Triton paged-decode kernel against the device's own copy
bandwidth: decode reads every cached K and V once, so a memory-bound kernel is judged by how close its
bytes/s come to a plain `copy_` of a large tensor. It uses only the kernels' public wrappers.

The `serve` mode (bench_serve.py) is the online benchmark: it streams requests at Poisson arrival times
to a running OpenAI-compatible server and reports throughput, TTFT and inter-token latency percentiles.

The offline mode ends by measuring the hardware (roofline.py): the model's own matmul shapes and a large
copy, turned into a matmul ceiling for the workload and a roofline floor for each step of the run.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import time
from dataclasses import asdict, dataclass

from minivllm.config import EngineConfig, add_engine_args
from minivllm.entrypoints.llm import LLM
from minivllm.core.sampling_params import SamplingParams

# Random prompt ids are drawn from [TOKEN_ID_LOW, min(TOKEN_ID_HIGH, vocab_size)): SmolLM2's special
# tokens sit at the bottom of its vocabulary, and the top is left alone for checkpoints with added tokens.
TOKEN_ID_LOW = 100
TOKEN_ID_HIGH = 49_000


# ---------------------------------------------------------------------------------------------- workload
@dataclass(frozen=True)
class Workload:
    """The requests both engines run: prompt_token_ids[i] asks for exactly output_lens[i] tokens."""
    prompt_token_ids: list[list[int]]
    output_lens: list[int]
    seed: int

    @classmethod
    def random(cls, num_requests: int, input_len: tuple[int, int], output_len: tuple[int, int],
               vocab_size: int, seed: int = 0) -> "Workload":
        rng = random.Random(seed)
        low, high = TOKEN_ID_LOW, min(TOKEN_ID_HIGH, vocab_size)
        if high <= low:                                   # a toy vocabulary: use all of it
            low = 0
        prompts, outs = [], []
        for _ in range(num_requests):
            n = rng.randint(*input_len)                    # randint is inclusive at both ends: U[a, b]
            prompts.append([rng.randrange(low, high) for _ in range(n)])
            outs.append(rng.randint(*output_len))
        return cls(prompts, outs, seed)

    @property
    def num_requests(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)


# ---------------------------------------------------------------------------------------------- results
@dataclass
class ThroughputResult:
    """One engine's run over a workload. `output_tokens_per_request[i]` counts useful tokens only."""
    engine: str
    wall_s: float
    output_tokens_per_request: list[int]

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_tokens_per_request)

    @property
    def output_tokens_per_s(self) -> float:
        return self.num_output_tokens / self.wall_s


@dataclass
class LatencyResult:
    """Per-request latencies from RequestOutput.metrics, in seconds.

    TTFT counts from arrival, so it includes the time a request waited in the queue (all requests of
    an offline run arrive at once). TPOT is the mean gap between a request's later tokens.
    """
    ttft_p50: float
    ttft_p99: float
    tpot_p50: float
    tpot_p99: float


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between ranks, as numpy's default."""
    if not values:
        return float("nan")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


# ---------------------------------------------------------------------------------------------- minivllm
def greedy_params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0)


def warmup_minivllm(llm: LLM) -> None:
    """One tiny untimed generate: first calls pay for lazy imports, allocator growth and kernel choice."""
    prompts = [{"prompt_token_ids": list(range(TOKEN_ID_LOW, TOKEN_ID_LOW + n))} for n in (8, 12)]
    llm.generate(prompts, greedy_params(4), use_tqdm=False)


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


# ---------------------------------------------------------------------------------------------- prefix
@dataclass
class PrefixResult:
    """The shared-prefix workload with prefix caching off and on, in one run."""
    num_requests: int
    shared_len: int
    prefill_tokens_off: int             # prompt tokens run through the model, caching off
    prefill_tokens_on: int              # ... caching on
    shared_tokens_computed_on: int      # of the shared prefix, how many tokens caching on still computed
    hit_rate_on: float
    outputs_equal: bool

    @property
    def shared_reduction(self) -> float:
        """1 - (shared-prefix tokens computed with caching) / (without): at least 0.9 is the goal."""
        return 1 - self.shared_tokens_computed_on / (self.num_requests * self.shared_len)


def bench_prefix(engine_kw: dict, num_requests: int, shared_len: int, seed: int) -> PrefixResult:
    """N requests behind one shared system prompt (random ids) with unique tails of 16-64 tokens."""
    rng = random.Random(seed)
    shared = [rng.randrange(TOKEN_ID_LOW, TOKEN_ID_HIGH) for _ in range(shared_len)]
    prompts = [{"prompt_token_ids": shared + [rng.randrange(TOKEN_ID_LOW, TOKEN_ID_HIGH)
                                              for _ in range(rng.randint(16, 64))]} for _ in range(num_requests)]
    results = {}
    for caching in (False, True):
        llm = LLM(**{**engine_kw, "enable_prefix_caching": caching})
        outs = llm.generate(prompts, greedy_params(8), use_tqdm=False)
        stats = llm.get_stats()
        results[caching] = ([o.outputs[0].token_ids for o in outs], stats)
        llm.shutdown()
        del llm
        gc.collect()
    (ids_off, off), (ids_on, on) = results[False], results[True]
    unique = off.num_prompt_tokens_computed - num_requests * shared_len     # the tails, computed either way
    return PrefixResult(num_requests, shared_len, off.num_prompt_tokens_computed, on.num_prompt_tokens_computed,
                        on.num_prompt_tokens_computed - unique, on.prefix_cache_hit_rate, ids_off == ids_on)


# ---------------------------------------------------------------------------------------------- kernels
KERNEL_DTYPES = {"bf16": "bfloat16", "fp16": "float16"}
COPY_BYTES = 1 << 30                      # per buffer: far larger than any GPU's L2, so the copy hits DRAM
KERNEL_WARMUP = 5
KERNEL_REPS = 20
DECODE_BATCHES = (1, 16, 64)
DECODE_CONTEXTS = (512, 2048, 8192)
DECODE_HEADS = ((32, 8), (32, 32), (32, 4))     # (query heads, KV heads): GQA 4, MHA, GQA 8
DECODE_HEAD_DIM = 128
DECODE_BLOCK_SIZE = 16
TARGET = {"batch": 64, "context": 2048, "num_heads": 32, "num_kv_heads": 8, "head_dim": 128}
TARGET_FRACTION = 0.70                    # the target row should reach 70% of the measured copy bandwidth


def decode_bytes(batch: int, context: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 itemsize: int) -> int:
    """Bytes one decode call must move at least: all cached K and V once, plus the query read and output written.

    Block tables and seq_lens (under 0.1% at these shapes) are left out.
    """
    kv = 2 * batch * context * num_kv_heads * head_dim * itemsize
    q_and_out = 2 * batch * num_heads * head_dim * itemsize
    return kv + q_and_out


def median_cuda_time(fn, warmup: int = KERNEL_WARMUP, reps: int = KERNEL_REPS) -> float:
    """Median seconds of fn() over `reps` calls after `warmup` calls, each call timed with CUDA events."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)          # elapsed_time is in ms
    return percentile(times, 50)


@dataclass
class CopyResult:
    """The device's copy bandwidth: bytes read + written by one large `copy_`, over its median time."""
    bytes_moved: int
    time_s: float

    @property
    def bandwidth_gbs(self) -> float:
        return self.bytes_moved / self.time_s / 1e9


def bench_copy(dtype, device, nbytes: int = COPY_BYTES) -> CopyResult:
    import torch

    src = torch.empty(nbytes // dtype.itemsize, dtype=dtype, device=device).fill_(1)
    dst = torch.empty_like(src)
    t = median_cuda_time(lambda: dst.copy_(src))
    result = CopyResult(2 * src.numel() * dtype.itemsize, t)
    del src, dst
    torch.cuda.empty_cache()
    return result


@dataclass
class DecodeRow:
    """paged_decode_attention on one shape: the Triton kernel and the PyTorch reference on the same inputs."""
    batch: int
    context: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str
    num_splits: int                     # what the wrapper picks (choose_num_splits)
    bytes_moved: int                    # decode_bytes(...)
    triton_s: float
    torch_s: float | None               # None: the reference ran out of memory at this shape
    copy_bandwidth_gbs: float

    @property
    def bandwidth_gbs(self) -> float:
        return self.bytes_moved / self.triton_s / 1e9

    @property
    def fraction_of_copy(self) -> float:
        return self.bandwidth_gbs / self.copy_bandwidth_gbs

    @property
    def speedup_over_torch(self) -> float | None:
        return None if self.torch_s is None else self.torch_s / self.triton_s

    @property
    def is_target(self) -> bool:
        return all(getattr(self, k) == v for k, v in TARGET.items())

    def to_json(self) -> dict:
        return {**asdict(self), "bandwidth_gbs": self.bandwidth_gbs, "fraction_of_copy": self.fraction_of_copy,
                "speedup_over_torch": self.speedup_over_torch, "is_target": self.is_target}


def bench_decode(batch: int, context: int, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                 dtype, device, copy: CopyResult, seed: int = 0) -> DecodeRow:
    """Every sequence holds `context` tokens in blocks scattered by a shuffled block table."""
    import torch

    from minivllm.model._kernels import kernels

    triton_ops, reference = kernels.triton_ops, kernels.reference
    gen = torch.Generator(device=device).manual_seed(seed)
    blocks_per_seq = -(-context // block_size)
    num_blocks = batch * blocks_per_seq
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.randn(cache_shape, dtype=dtype, device=device, generator=gen)
    value_cache = torch.randn(cache_shape, dtype=dtype, device=device, generator=gen)
    query = torch.randn((batch, num_heads, head_dim), dtype=dtype, device=device, generator=gen)
    block_tables = (torch.randperm(num_blocks, device=device, generator=gen)
                    .view(batch, blocks_per_seq).to(torch.int32))
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    seq_lens_cpu = [context] * batch
    scale = head_dim ** -0.5

    triton_s = median_cuda_time(lambda: triton_ops.paged_decode_attention(
        query, key_cache, value_cache, block_tables, seq_lens, scale))
    try:
        torch_s = median_cuda_time(lambda: reference.paged_decode_attention(
            query, key_cache, value_cache, block_tables, seq_lens, scale, seq_lens_cpu=seq_lens_cpu),
            warmup=2, reps=5)
    except torch.cuda.OutOfMemoryError:              # the reference gathers fp32 copies of the whole context
        torch_s = None
    num_splits = triton_ops.choose_num_splits(batch, num_kv_heads, blocks_per_seq * block_size, device)
    del key_cache, value_cache, query, block_tables, seq_lens
    torch.cuda.empty_cache()
    return DecodeRow(batch, context, num_heads, num_kv_heads, head_dim, block_size, str(dtype).split(".")[-1],
                     num_splits, decode_bytes(batch, context, num_heads, num_kv_heads, head_dim, dtype.itemsize),
                     triton_s, torch_s, copy.bandwidth_gbs)


def print_kernels_report(device_name: str, copy: CopyResult, rows: list[DecodeRow]) -> None:
    print(f"device:          {device_name}")
    print(f"copy bandwidth:  {copy.bandwidth_gbs:.0f} GB/s ({copy.bytes_moved / 2**30:.0f} GiB read + written "
          f"in {copy.time_s * 1e3:.2f} ms)")
    print(f"paged_decode_attention, {rows[0].dtype}, head_dim {rows[0].head_dim}, block_size "
          f"{rows[0].block_size}, shuffled block tables; bandwidth = KV + q + out bytes / median time")
    header = (f"{'q/kv heads':>10} {'batch':>5} {'context':>7} {'splits':>6} {'MB moved':>9} {'triton us':>10} "
              f"{'GB/s':>7} {'% copy':>7} {'torch us':>10} {'speedup':>8}")
    print(header)
    print("-" * len(header))
    for r in rows:
        torch_us = "OOM" if r.torch_s is None else f"{r.torch_s * 1e6:.1f}"
        speedup = "-" if r.speedup_over_torch is None else f"{r.speedup_over_torch:.1f}x"
        mark = ""
        if r.is_target:
            verdict = "met" if r.fraction_of_copy >= TARGET_FRACTION else "NOT met"
            mark = f"  <- target: >= {TARGET_FRACTION:.0%} of copy ({verdict})"
        print(f"{f'{r.num_heads}/{r.num_kv_heads}':>10} {r.batch:>5} {r.context:>7} {r.num_splits:>6} "
              f"{r.bytes_moved / 1e6:>9.1f} {r.triton_s * 1e6:>10.1f} {r.bandwidth_gbs:>7.0f} "
              f"{r.fraction_of_copy:>7.1%} {torch_us:>10} {speedup:>8}{mark}")


def main_kernels(args: argparse.Namespace) -> int:
    import torch

    from minivllm.model._kernels import kernels

    if not torch.cuda.is_available():
        args.parser.error("the kernels benchmark needs a CUDA GPU; torch.cuda.is_available() is False here. "
                          "On a CPU the kernels are only checked for correctness, under Triton's interpreter: "
                          "python -m pytest tests/test_kernels.py")
    if not kernels.triton_available():
        args.parser.error("the kernels benchmark needs the triton package: pip install triton")
    if os.environ.get("TRITON_INTERPRET") == "1":
        args.parser.error("TRITON_INTERPRET=1 is set: the kernels would run in Triton's CPU interpreter. "
                          "Unset it to time them on the GPU.")
    device = torch.device("cuda")
    dtype = getattr(torch, KERNEL_DTYPES[args.kernel_dtype])
    copy = bench_copy(dtype, device)
    rows = [bench_decode(batch, context, heads, kv_heads, DECODE_HEAD_DIM, DECODE_BLOCK_SIZE, dtype, device, copy,
                         seed=args.seed)
            for heads, kv_heads in DECODE_HEADS for batch in DECODE_BATCHES for context in DECODE_CONTEXTS]
    device_name = torch.cuda.get_device_name(device)
    print_kernels_report(device_name, copy, rows)
    if args.json:
        report = {"mode": "kernels", "device": device_name, "torch": torch.__version__,
                  "triton": __import__("triton").__version__, "dtype": args.kernel_dtype,
                  "warmup": KERNEL_WARMUP, "reps": KERNEL_REPS, "target": {**TARGET, "fraction": TARGET_FRACTION},
                  "copy": {**asdict(copy), "bandwidth_gbs": copy.bandwidth_gbs},
                  "decode": [r.to_json() for r in rows]}
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


# ---------------------------------------------------------------------------------------------- HF
def load_hf_model(model_dir, dtype=None, device=None):
    """HF's model on the same device and in the same dtype as minivllm's run (fp32 on a CPU, bf16 on a GPU)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype or torch.float32)
    return model.to(device or "cpu").eval()


def hf_generate_batch(model, prompts: list[list[int]], max_new_tokens: int) -> list[int]:
    """Greedy `generate` on one left-padded static batch, every row forced to run max_new_tokens steps.

    Returns how many new tokens each row got (all of them equal max_new_tokens).
    """
    import torch

    cfg = model.generation_config
    eos = cfg.eos_token_id if cfg.eos_token_id is not None else model.config.eos_token_id
    eos = eos[0] if isinstance(eos, list) else eos
    pad = cfg.pad_token_id if cfg.pad_token_id is not None else eos
    pad = 0 if pad is None else pad                       # a checkpoint with neither: any id will do
    width = max(len(p) for p in prompts)
    # Left padding: the last column is every row's last prompt token, so new tokens line up.
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=model.device)  # (batch, width)
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device)
    with torch.inference_mode():
        out = model.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=False,
                             max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                             pad_token_id=pad)                                    # (batch, width + new)
    return [out.shape[1] - width] * len(prompts)


def bench_hf(model, workload: Workload, batch_size: int) -> ThroughputResult:
    """Static batches in request order; each runs to its longest request, only asked-for tokens count."""
    counts = []
    start = time.perf_counter()
    for b in range(0, workload.num_requests, batch_size):
        prompts = workload.prompt_token_ids[b:b + batch_size]
        asked = workload.output_lens[b:b + batch_size]
        got = hf_generate_batch(model, prompts, max(asked))
        counts += [min(g, a) for g, a in zip(got, asked)]
    return ThroughputResult("hf", time.perf_counter() - start, counts)


# ---------------------------------------------------------------------------------------------- CLI
def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive int")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m minivllm.bench",
                                description="Benchmark minivllm (optionally against Hugging Face transformers).")
    p.add_argument("mode", nargs="?", default="offline", choices=["offline", "prefix", "kernels", "serve"],
                   help="offline: throughput and latency of one batch of synthetic requests (default); "
                        "prefix: prefill tokens computed for requests behind one shared system prompt, "
                        "prefix caching off vs on; kernels (CUDA GPU only): the Triton paged-decode kernel's "
                        "time and bandwidth vs the device's copy bandwidth and the PyTorch reference; serve: "
                        "Poisson-timed streaming requests to a running OpenAI-compatible server (python app.py)")
    w = p.add_argument_group("workload")
    w.add_argument("--num-requests", type=positive_int, default=32)
    w.add_argument("--input-len-min", type=positive_int, default=32)
    w.add_argument("--input-len-max", type=positive_int, default=256)
    w.add_argument("--output-len-min", type=positive_int, default=32)
    w.add_argument("--output-len-max", type=positive_int, default=256)
    w.add_argument("--seed", type=int, default=0, help="seeds the workload and the engine (default 0)")
    w.add_argument("--shared-prefix-len", type=positive_int, default=200, help="prefix mode: shared tokens")
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
    c.add_argument("--compare", choices=["hf"], help="also run Hugging Face generate on the same requests")
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
    for name in ("input_len", "output_len"):
        lo, hi = getattr(args, f"{name}_min"), getattr(args, f"{name}_max")
        if lo > hi:
            flag = name.replace("_", "-")
            parser.error(f"--{flag}-min is {lo}, above --{flag}-max ({hi}).")
    args.parser = parser
    return args


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    try:
        return EngineConfig.from_cli_args(args)
    except ValueError as e:                                # a bad engine option is a usage error too
        args.parser.error(str(e))


def print_report(workload: Workload, mv: ThroughputResult, latency: LatencyResult,
                 hf: ThroughputResult | None, kv_utilization: float) -> None:
    ms = 1000
    print(f"requests:             {workload.num_requests}")
    print(f"prompt tokens:        {workload.num_prompt_tokens}")
    print(f"output tokens:        {mv.num_output_tokens} (asked for {workload.num_output_tokens})")
    print(f"minivllm wall time:   {mv.wall_s:.2f} s")
    print(f"minivllm throughput:  {mv.output_tokens_per_s:.1f} output tokens/s")
    print(f"TTFT p50 / p99:       {latency.ttft_p50 * ms:.0f} / {latency.ttft_p99 * ms:.0f} ms")
    print(f"TPOT p50 / p99:       {latency.tpot_p50 * ms:.1f} / {latency.tpot_p99 * ms:.1f} ms")
    print(f"KV slot utilization:  {kv_utilization:.3f} (tokens with KV / block slots held, over all steps)")
    if hf is not None:
        print(f"HF wall time:         {hf.wall_s:.2f} s")
        print(f"HF throughput:        {hf.output_tokens_per_s:.1f} useful output tokens/s")
        print(f"minivllm / HF:        {mv.output_tokens_per_s / hf.output_tokens_per_s:.2f}x")


def measure_hardware(cfg, device, dtype, workload: Workload, steps: list[StepWork], skip: bool,
                     decode_batch: int | None = None) -> dict | None:
    """The ceilings, measured after the run on the same machine (roofline.py):
    - matmul: the workload's FLOPs at the model's matmul rate, as output tokens/s;
    - roofline: each step of this run at max(FLOPs / matmul rate, bytes / copy bandwidth), summed;
    - decode: the fullest decode-only steps against their memory floor."""
    if skip:
        return None
    from minivllm.bench import roofline

    dev = str(device)
    rate = roofline.measure_matmul_rate(cfg, dtype, dev)
    bandwidth = roofline.measure_copy_bandwidth(dev)
    flops = roofline.workload_flops(cfg, [len(p) for p in workload.prompt_token_ids], workload.output_lens)
    floors = [roofline.step_floor_s(cfg, dtype.itemsize, rate, bandwidth, st.num_tokens, st.attention_pairs,
                                    st.num_sampled, st.kv_tokens_read) for st in steps]
    hw = {"device": dev, "dtype": str(dtype), "matmul_flops_per_s": rate, "copy_bandwidth_bytes_per_s": bandwidth,
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
    print(f"matmul rate:          {hw['matmul_flops_per_s'] / 1e9:.1f} GFLOP/s ({hw['dtype']}, the model's layer "
          f"matmuls at 256 tokens, {hw['device']})")
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


def host_info() -> dict:
    """How busy the machine was: on a shared 2-core box a neighbour's job stalls a 2-thread torch run."""
    import torch

    return {"cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "loadavg_1min": os.getloadavg()[0]}


def throughput_json(r: ThroughputResult) -> dict:
    return {"wall_s": r.wall_s, "output_tokens": r.num_output_tokens, "output_tokens_per_s": r.output_tokens_per_s,
            "output_tokens_per_request": r.output_tokens_per_request}


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads is not None:
        import torch
        torch.set_num_threads(args.threads)
    if args.mode == "prefix":
        return main_prefix(args)
    if args.mode == "kernels":
        return main_kernels(args)
    if args.mode == "serve":
        return main_serve(args)
    host_start = host_info()
    try:
        llm = LLM(**asdict(config_from_args(args)))
    except (ValueError, FileNotFoundError) as e:           # a bad engine option is a usage error too
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
    llm.shutdown()                                         # tensor-parallel workers, if any
    model_cfg, device, dtype = engine.model_config, engine.device, engine.model_runner.dtype

    hf = None
    if args.compare == "hf":
        del llm, engine                                    # free minivllm's weights and KV cache first
        gc.collect()
        model = load_hf_model(model_dir, dtype, device)
        hf_generate_batch(model, [[TOKEN_ID_LOW] * 8], 2)   # untimed warmup, like minivllm's
        hf = bench_hf(model, workload, args.hf_batch_size)
        del model
        gc.collect()
    hw = measure_hardware(model_cfg, device, dtype, workload, steps, args.no_ceiling, args.decode_batch)
    host_end = host_info()

    print_report(workload, mv, latency, hf, kv_utilization)
    if graph_note is not None:
        print(f"CUDA graphs:          {graph_note}")
    print_hardware(hw, mv, hf)
    print(f"load average (1 min): {host_start['loadavg_1min']:.2f} at start, {host_end['loadavg_1min']:.2f} "
          f"at end, on {host_start['cpu_count']} CPUs, {host_start['torch_threads']} torch threads")
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


def main_prefix(args: argparse.Namespace) -> int:
    kw = asdict(config_from_args(args))
    kw.pop("enable_prefix_caching")                        # the mode runs with it off, then on
    try:
        r = bench_prefix(kw, args.num_requests, args.shared_prefix_len, args.seed)
    except (ValueError, FileNotFoundError) as e:
        args.parser.error(str(e))
    print(f"requests:                      {r.num_requests} behind one {r.shared_len}-token shared prefix")
    print(f"prefill tokens, caching off:   {r.prefill_tokens_off}")
    print(f"prefill tokens, caching on:    {r.prefill_tokens_on} (hit rate {r.hit_rate_on:.1%})")
    print(f"shared-prefix tokens computed: {r.num_requests * r.shared_len} off, {r.shared_tokens_computed_on} on "
          f"({r.shared_reduction:.1%} fewer)")
    print(f"greedy outputs equal:          {r.outputs_equal}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"mode": "prefix", **asdict(r), "shared_reduction": r.shared_reduction}, f, indent=2)
    return 0


def main_serve(args: argparse.Namespace) -> int:
    """Output lengths U[--output-len-min, --output-len-max] (ignore_eos); prompts of --input-len-min..max words."""
    import asyncio

    import httpx

    from minivllm.bench.serve import print_serve_report, run_serve_benchmark

    if args.request_rate <= 0:
        args.parser.error(f"--request-rate is {args.request_rate}; it must be > 0 (or inf).")
    try:
        rep = asyncio.run(run_serve_benchmark(args.base_url, args.num_requests, args.request_rate,
                                              (args.output_len_min, args.output_len_max),
                                              (args.input_len_min, args.input_len_max),
                                              args.seed, args.served_model, args.api_key))
    except (OSError, httpx.HTTPError) as e:
        args.parser.error(f"cannot reach {args.base_url} ({type(e).__name__}: {e}); start the server first: "
                          "python app.py")
    print_serve_report(rep)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"mode": "serve", "base_url": args.base_url, **rep.to_json()}, f, indent=2)
    return 0 if rep.num_ok == rep.num_requests else 1


if __name__ == "__main__":
    sys.exit(main())
