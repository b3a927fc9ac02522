# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Lesson 10: performance, measured
#
# A fast engine is not written, it is measured into being: find where the time goes, work out what the
# hardware allows, change one thing, measure again. This lesson does that once, for real, on the CPU it runs
# on:
#
# 1. **measure first**: profile the engine's steps with `torch.profiler`: where does a prefill step's time
#    go, and where does a decode step's?
# 2. **the ceiling**: time this machine's matmul rate and memory bandwidth
#    (`minivllm/bench/roofline.py`), turn them into a floor for each step, and place the engine's real
#    steps on a *roofline* picture,
# 3. **before and after**: one optimisation that the profile pointed at, the CPU decode attention in
#    `kernels/reference.py`: the old version next to the new, the same output, both timed and profiled,
#    alone and inside a whole decode step,
# 4. **what bounds a decode step here**, and what would move it (bf16, bigger batches, a GPU), as
#    `python -m minivllm.bench` reports it.
#
# Lesson 11 goes on from here: CUDA graphs, and the changes that did (and did not) move a CPU decode step.
#
# Read it next to `minivllm/bench/roofline.py` (the ceilings), `minivllm/bench/offline.py` (the benchmark
# that prints them), `kernels/reference.py` and `minivllm/model/attention.py` (the decode attention of
# section 3).
#
# **Every number below is measured when the notebook runs**, on whatever machine runs it; none is typed in.
# So the prose talks about what to look for, and the printouts say what this machine did. On a busy shared
# machine the timings wobble from run to run; the shapes of the results (what dominates, what is bounded by
# what) are what to take away.

# %%
import os

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")   # the tokenizer would warn on stderr after a fork
os.environ.setdefault("KINETO_LOG_LEVEL", "6")   # silence the profiler's own log lines; read once, as torch loads
os.environ["MINIVLLM_CPU_KERNELS"] = "0"     # the PyTorch reference path, op by op (section 1 says why)

import warnings

warnings.filterwarnings("ignore", message="IProgress not found")   # tqdm's notice when ipywidgets is absent

import statistics
import time

import matplotlib.pyplot as plt
import numpy as np
import torch
import torch.nn.functional as F
from matplotlib.patches import Patch
from torch.profiler import ProfilerActivity, profile

from minivllm import LLM, SamplingParams
from minivllm.bench import roofline
from minivllm.bench.roofline import StepWork, step_work
from minivllm.bench.workload import Workload
from minivllm.model._kernels import kernels

ref = kernels.reference      # the plain PyTorch kernels, the CPU serving path, reached as minivllm/model/attention.py does
torch.manual_seed(0)
torch.set_num_threads(1)     # one thread: on a busy 2-core machine two threads stall each other, and every
                             # number below is then "one core's worth" (python -m minivllm.bench --threads N)

# %% [markdown]
# ## 1. Measure first: where does a decode step's time go?
#
# We build an engine and give it work shaped like the benchmark's: 32 requests of random token ids
# (`Workload.random` from `minivllm/bench/workload.py`, the generator `python -m minivllm.bench` uses),
# greedy, `ignore_eos` so that none stops early. Prompts are short (16-64 tokens) so that the prefill, the
# expensive part on a CPU, takes only a few seconds. We drive the engine ourselves with `add_request` and
# `step()`, as in lesson 00.
#
# This lesson studies the **PyTorch reference path** (`attention_backend="torch"`, and the small layers in
# plain PyTorch: `MINIVLLM_CPU_KERNELS=0`, set in the first cell), the one you can read op by op. minivllm's CPU default has since moved the decode attention
# and the small layers into C++ kernels (lesson 11, section 5), which the profiler shows as single ops;
# everything measured here still holds for the reference, and the lessons build on it.

# %%
llm = LLM(num_kv_blocks=256, seed=0, attention_backend="torch")
engine = llm.llm_engine
cfg = engine.model_config
NUM_REQUESTS = 32
workload = Workload.random(NUM_REQUESTS, input_len=(16, 64), output_len=(64, 64), vocab_size=cfg.vocab_size, seed=0)
PARAMS = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
for i, ids in enumerate(workload.prompt_token_ids):
    engine.add_request({"prompt_token_ids": ids}, PARAMS, request_id=f"r{i}")

print(f"model: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, {cfg.num_attention_heads} query heads, "
      f"{cfg.num_key_value_heads} KV heads, head_dim {cfg.head_dim}, {engine.model_runner.dtype}")
print(f"{workload.num_requests} requests, {workload.num_prompt_tokens} prompt tokens "
      f"({min(map(len, workload.prompt_token_ids))}-{max(map(len, workload.prompt_token_ids))} each)")

# %% [markdown]
# `torch.profiler` records every PyTorch op a piece of code runs and how long it took. We sort by *self*
# time: the time inside an op itself, not counting the ops it calls, so nothing is counted twice. What is
# left of the wall-clock time once every op's self time is subtracted is **time outside any op**: Python in
# the scheduler, building the step's inputs, sampling's bookkeeping, detokenizing.
#
# The first step is the prefill of all 32 prompts, one flat batch; we only time it (profiling works the same
# way, but the prefill's attention runs sequence by sequence, tens of thousands of small ops that take the
# profiler longer to tally than the step takes to run). The next step is the first decode step (it
# allocates attention's gather buffer, so we leave it out); then we profile three decode steps.

# %%
def profile_steps(n):
    """Run n engine steps under torch.profiler. Returns ({op: self ms per step}, [StepTrace], wall s per step)."""
    with engine.record_traces() as traces, profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(n):
            engine.step()
        wall = (time.perf_counter() - start) / n
    ops = {e.key: e.self_cpu_time_total / 1e3 / n for e in prof.key_averages()}   # microseconds -> ms
    return ops, traces, wall


with engine.record_traces() as traces:
    engine.step()                                          # the prefill
    engine.step()                                          # the first decode step: warm-up, not profiled
prefill_trace = traces[0]
decode_ops, decode_traces, decode_wall = profile_steps(3)
for t in [prefill_trace] + decode_traces:
    print(f"step {t.step}: {t.num_prefill_tokens:4} prefill tokens, {t.num_decode_tokens:2} decode tokens")


# %%
# NBVAL_IGNORE_OUTPUT
def top_ops(ops, wall, k=7):
    """The k ops with the most self time, then the rest, then time outside any op: (name, ms) pairs."""
    ranked = sorted(ops.items(), key=lambda kv: -kv[1])
    rows = ranked[:k] + [("other ops", sum(ms for _, ms in ranked[k:]))]
    return rows + [("outside any op", wall * 1e3 - sum(ops.values()))]


print(f"one decode step, batch {NUM_REQUESTS}: {decode_wall * 1e3:.0f} ms (profiled)")
for name, ms in top_ops(decode_ops, decode_wall):
    print(f"    {name:50} {ms:7.1f} ms  {ms / (decode_wall * 1e3):6.1%}")

# %% [markdown]
# The same, drawn. Blue is the linear layers (`mkldnn::_linear_pointwise`, oneDNN's matmul on prepacked weights,
# or `aten::mm` where it is off: the q/k/v, o, gate/up and down projections and
# the LM head), orange is attention (the K/V gather, `index_select`, and SDPA; the embedding lookup's one
# small `index_select` per step is counted in with it), grey everything else.

# %%
# NBVAL_IGNORE_OUTPUT
MATMUL, ATTENTION = {"aten::mm", "aten::addmm", "mkldnn::_linear_pointwise"}, {"aten::index_select", "aten::index", "aten::bmm", "aten::_softmax"}


def op_color(name):
    if name in MATMUL:
        return "tab:blue"
    if name in ATTENTION or "scaled_dot_product" in name:
        return "tab:orange"
    return "0.4" if name == "outside any op" else "0.75"


fig, ax = plt.subplots(figsize=(8, 3.2))
rows = top_ops(decode_ops, decode_wall)[::-1]
ax.barh([n.replace("aten::", "") for n, _ in rows], [ms for _, ms in rows], color=[op_color(n) for n, _ in rows])
ax.set_title(f"one decode step, batch {NUM_REQUESTS}: {decode_wall * 1e3:.0f} ms", fontsize=10)
ax.set_xlabel("self time per step (ms)")
ax.tick_params(axis="y", labelsize=8)
fig.legend(handles=[Patch(color="tab:blue", label="linear layers"), Patch(color="tab:orange", label="attention"),
                    Patch(color="0.75", label="other ops"), Patch(color="0.4", label="outside any op (Python)")],
           loc="lower center", ncol=4, fontsize=8, frameon=False)
plt.tight_layout(rect=(0, 0.08, 1, 1))
plt.show()

# %% [markdown]
# The matmuls of the linear layers are most of the step. Attention, elementwise ops (RMSNorm, RoPE, SiLU),
# the greedy `argmax` over the vocabulary and Python are the rest. That already says where *not* to start
# optimising: a 2x faster sampler or scheduler cannot buy back much when it was a few percent of the step.
#
# ### Prefill and decode: the same matmuls, a different kind of work
#
# A linear layer with an `(out, in)` weight, applied to `n` rows, does `2 * n * in * out` FLOPs (a multiply
# and an add per weight per row) and has to read the `in * out` weights once: in fp32 that is 4 bytes per
# weight, so about **`n / 2` FLOPs for every byte read**. That ratio is the *arithmetic intensity*.
#
# - **Prefill** runs every prompt token through the layers at once: `n` is in the thousands here, so each
#   weight read from memory is used for a thousand multiply-adds. The processor's arithmetic is the limit:
#   prefill is **compute-bound**.
# - **Decode** runs one new token per request: `n` is the batch, 32 here. Every weight of the model is
#   read from memory for a few rows, and so is every cached K and V of the batch. At a small enough batch
#   the arithmetic units sit waiting for memory: decode is **memory-bound**. How small is "small enough"
#   depends on the machine: that is section 2.
#
# The FLOPs and bytes of each step, counted the way `roofline.step_floor_s` counts them (they depend only on
# the workload, so they are the same on every machine):

# %%
LINEAR_PARAMS = sum(i * o for i, o in roofline.linear_shapes(cfg))     # one decoder layer's fused matmuls
ITEMSIZE = engine.model_runner.dtype.itemsize                            # 4: fp32


def step_flops_bytes(sw: StepWork):
    """The two terms of roofline.step_floor_s for one step: FLOPs (matmuls, attention, LM head) and bytes
    (every weight once, plus every cached K and V the step's attention reads)."""
    L, H, D = cfg.num_hidden_layers, cfg.num_attention_heads, cfg.head_dim
    flops = (2 * L * LINEAR_PARAMS * sw.num_tokens + 4 * L * H * D * sw.attention_pairs
             + 2 * cfg.hidden_size * cfg.vocab_size * sw.num_sampled)
    nbytes = roofline.weight_bytes(cfg, ITEMSIZE) + roofline.kv_bytes_per_token(cfg, ITEMSIZE) * sw.kv_tokens_read
    return flops, nbytes


prefill_work, decode_work = step_work(prefill_trace), [step_work(t) for t in decode_traces]
for name, sw in [("prefill", prefill_work), ("decode", decode_work[0])]:
    flops, nbytes = step_flops_bytes(sw)
    print(f"{name:8} {sw.num_tokens:5} rows, {sw.kv_tokens_read:5} cached tokens read: {flops / 1e9:6.1f} GFLOP, "
          f"{nbytes / 1e6:5.0f} MB  ->  {flops / nbytes:5.1f} FLOP/byte")

# %% [markdown]
# How fast each step actually computed, in FLOP/s: the same matmul code runs far faster per FLOP in the
# prefill, because there it has enough rows to keep the arithmetic busy.

# %%
# NBVAL_IGNORE_OUTPUT
for name, sw in [("prefill", prefill_work)] + [("decode", w) for w in decode_work]:
    flops, _ = step_flops_bytes(sw)
    print(f"{name:8} {sw.duration_s * 1e3:7.1f} ms  ->  {flops / sw.duration_s / 1e9:6.1f} GFLOP/s achieved")

# %%
assert prefill_trace.num_prefill_tokens == workload.num_prompt_tokens and prefill_trace.num_decode_tokens == 0
assert all(t.num_decode_tokens == NUM_REQUESTS and t.num_prefill_tokens == 0 for t in decode_traces)
prefill_intensity = step_flops_bytes(prefill_work)[0] / step_flops_bytes(prefill_work)[1]
decode_intensity = step_flops_bytes(decode_work[0])[0] / step_flops_bytes(decode_work[0])[1]
assert prefill_intensity > 10 * decode_intensity

# %% [markdown]
# ## 2. The hardware's ceiling, measured here
#
# A datasheet's peak numbers are rarely what PyTorch gets on a given machine, so `roofline.py` measures the
# two that matter, in the same process, with the same settings:
#
# - `measure_matmul_rate(cfg)`: FLOP/s of one decoder layer's four matmuls at 256 rows, the model's own
#   shapes, repeated for about a second. It is the best case: at 32 rows (a decode step) the same matmuls
#   run slower, and one layer's weights may stay in the CPU's caches where the engine streams all of them.
# - `measure_copy_bandwidth()`: bytes per second of a `copy_` of a 256 MiB tensor (read + written), far
#   bigger than any cache: what a step that streams memory can hope for.
#
# Together they make a **roofline** (Williams, Waterman and Patterson, 2009): a step of intensity `I`
# FLOP/byte can run at most at `min(matmul rate, I * bandwidth)` FLOP/s. The *ridge point*, `rate /
# bandwidth`, is where the two meet: left of it a step is memory-bound, right of it compute-bound. From that
# comes the floor of a step, which `roofline.step_floor_s` computes:
#
# ```
# step floor = max( FLOPs / matmul rate ,  (weight bytes + KV bytes read) / bandwidth )
# ```
#
# For a decode step the second term is the **decode-step memory floor**: however clever the code, every
# weight and every cached K/V of the batch must come from memory once per step.

# %%
# NBVAL_IGNORE_OUTPUT
rate = roofline.measure_matmul_rate(cfg, min_time_s=1.0)                          # FLOP/s at 256 rows
rate_batch = roofline.measure_matmul_rate(cfg, batch_tokens=NUM_REQUESTS, min_time_s=0.5)   # at the decode batch
bandwidth = roofline.measure_copy_bandwidth()                                       # bytes/s, read + written
weights = roofline.weight_bytes(cfg, ITEMSIZE)
ridge = rate / bandwidth
print(f"matmul rate:     {rate / 1e9:6.1f} GFLOP/s at 256 rows, {rate_batch / 1e9:6.1f} GFLOP/s at "
      f"{NUM_REQUESTS} rows (fp32, one thread)")
print(f"copy bandwidth:  {bandwidth / 1e9:6.1f} GB/s")
print(f"ridge point:     {ridge:6.1f} FLOP/byte")
print(f"weights:         {weights / 1e6:6.0f} MB read by every step "
      f"(KV: {roofline.kv_bytes_per_token(cfg, ITEMSIZE) / 1e3:.1f} kB per cached token)")

# %% [markdown]
# ### Exercise: the decode-step memory floor
#
# Count those bytes yourself. Write `decode_memory_floor_ms(cfg, itemsize, batch, context, bandwidth)`: the
# milliseconds a decode step needs at least, if it reads each of its bytes once at `bandwidth` bytes/s:
#
# - every weight of the model once: per layer the fused `qkv_proj` (hidden x (heads + 2 kv_heads) x
#   head_dim), `o_proj`, the fused `gate_up_proj` (hidden x 2 x intermediate), `down_proj`, and two RMSNorm
#   weights; then the final norm and the LM head (vocab x hidden). The embedding table is only *indexed* (one
#   row per token), so it does not count; the default model ties it to the LM head, which is read whole;
# - the K and V of `context` cached tokens for each of the `batch` sequences, in every layer;
# - `itemsize` bytes an element (4 for fp32, 2 for bf16).
#
# `cfg` is `engine.model_config` (fields `hidden_size`, `head_dim`, `num_attention_heads`,
# `num_key_value_heads`, `intermediate_size`, `num_hidden_layers`, `vocab_size`). The check compares your
# count with the loaded model's own parameter bytes and with `roofline.py`'s formula on other shapes.

# %%
from course import check, exercise


@exercise("10.decode_memory_floor_ms")
def decode_memory_floor_ms(cfg, itemsize, batch, context, bandwidth):
    # your code here
    raise NotImplementedError


check(decode_memory_floor_ms)

# %%
# NBVAL_IGNORE_OUTPUT
print(f"this machine ({bandwidth / 1e9:.1f} GB/s): a decode step at batch {NUM_REQUESTS} with 300 tokens of context "
      f"each needs at least {decode_memory_floor_ms(cfg, ITEMSIZE, NUM_REQUESTS, 300, bandwidth):.1f} ms in fp32, "
      f"{decode_memory_floor_ms(cfg, 2, NUM_REQUESTS, 300, bandwidth):.1f} ms in bf16")

# %% [markdown]
# Now the decode steps against their floor. The profiled steps above carry the profiler's overhead, so
# we time a few more without it (`StepTrace.duration_s`, what `python -m minivllm.bench` uses too).

# %%
# NBVAL_IGNORE_OUTPUT
with engine.record_traces() as traces:
    for _ in range(4):
        engine.step()
timed_work = [step_work(t) for t in traces]
for sw in timed_work:
    flops, nbytes = step_flops_bytes(sw)
    floor = roofline.step_floor_s(cfg, ITEMSIZE, rate, bandwidth, sw.num_tokens, sw.attention_pairs,
                                  sw.num_sampled, sw.kv_tokens_read)
    print(f"decode step, batch {sw.num_decode}: {sw.duration_s * 1e3:6.1f} ms measured; floors: memory "
          f"{nbytes / bandwidth * 1e3:5.1f} ms, compute {flops / rate * 1e3:5.1f} ms  ->  "
          f"{sw.duration_s / floor:4.2f}x the roofline floor")
sw = timed_work[-1]
print(f"the same step's FLOPs at the {NUM_REQUESTS}-row matmul rate: {step_flops_bytes(sw)[0] / rate_batch * 1e3:.1f} ms")
side = "memory" if decode_intensity < ridge else "compute"
print(f"a decode step's intensity is {decode_intensity:.1f} FLOP/byte, the ridge {ridge:.1f}: "
      f"on this machine a batch-{NUM_REQUESTS} decode step is on the {side}-bound side")

# %% [markdown]
# The picture: the roof (the diagonal is bandwidth, the flat part the 256-row matmul rate; the dashed line is
# the matmul rate at the decode batch), with the engine's real steps placed at their intensity and the FLOP/s
# they achieved. The small crosses on the roof are where a decode step would sit at other batch sizes: a
# decode step's intensity grows with its batch, about `B / 2` FLOP/byte in fp32 for the weights alone (less
# once the KV reads are counted, since they grow with the batch too), while a prefill's is hundreds.

# %%
# NBVAL_IGNORE_OUTPUT
def achieved(sw):
    flops, nbytes = step_flops_bytes(sw)
    return flops / nbytes, flops / sw.duration_s


mean_ctx = timed_work[0].kv_tokens_read // timed_work[0].num_decode
x = np.logspace(-1, 3.3, 200)
fig, ax = plt.subplots(figsize=(8, 4.5))
ax.loglog(x, np.minimum(rate, x * bandwidth) / 1e9, color="k", lw=2, label="roofline: min(matmul rate, I x bandwidth)")
ax.axhline(rate_batch / 1e9, color="k", ls="--", lw=1, label=f"matmul rate at {NUM_REQUESTS} rows")
ax.axvline(ridge, color="0.6", ls=":", lw=1)
ax.text(ridge * 1.1, rate / 1e9 * 0.08, f"ridge\n{ridge:.0f} FLOP/B", fontsize=8, color="0.4")
for b in (1, 4, 16, 32, 128):                              # hypothetical decode steps, same context per request
    flops, nbytes = step_flops_bytes(StepWork(0, b, b * mean_ctx, b, b * mean_ctx, b, True))
    i = flops / nbytes
    ax.plot(i, min(rate, i * bandwidth) / 1e9, "x", color="tab:green")
    ax.annotate(f"B={b}", (i, min(rate, i * bandwidth) / 1e9), textcoords="offset points", xytext=(-8, 6),
                fontsize=7, color="tab:green")
pi, pf = achieved(prefill_work)
ax.plot(pi, pf / 1e9, "o", color="tab:red", ms=8, label=f"prefill step ({prefill_work.num_tokens} tokens)")
for k, sw in enumerate(timed_work):
    di, df = achieved(sw)
    ax.plot(di, df / 1e9, "s", color="tab:blue", ms=6, label=f"decode steps (batch {sw.num_decode})" if k == 0 else None)
ax.set_ylim(top=rate / 1e9 * 2)
ax.set_xlabel("arithmetic intensity (FLOP per byte read)")
ax.set_ylabel("GFLOP/s")
ax.set_title("where the engine's steps sit under this machine's roofline (fp32, one thread)", fontsize=10)
ax.legend(fontsize=8, loc="lower right")
plt.tight_layout()
plt.show()

# %% [markdown]
# How to read it: a step's distance *below* the roof is what better code could still win; its position
# *along* the x-axis is set by the workload and the dtype, and no code change moves it. A decode step at a
# batch far left of the ridge is stuck on the diagonal: it can only go as fast as memory delivers the
# weights. Note also the gap between the two flat lines: at a decode batch the matmul routines themselves
# run well below their big-matrix rate, even in that measurement, where one layer's weights can sit in the
# CPU's caches.

# %%
for sw in timed_work:
    floor = roofline.step_floor_s(cfg, ITEMSIZE, rate, bandwidth, sw.num_tokens, sw.attention_pairs,
                                  sw.num_sampled, sw.kv_tokens_read)
    flops, nbytes = step_flops_bytes(sw)
    assert abs(floor - max(flops / rate, nbytes / bandwidth)) <= 1e-9 * floor   # our helper = roofline.py
    assert floor > 0     # (how close a step comes to it is measured by the bench, not asserted: the machine drifts)
assert rate > 0 and rate_batch > 0 and bandwidth > 0

# %% [markdown]
# ## 3. Before and after: the CPU decode attention
#
# In the decode profile, after the matmuls, the next ops were attention's: the K/V **gather** and **SDPA**.
# Their cost grows with the context, and with it their share of the step. `kernels/reference.py`'s
# `paged_decode_attention` (the CPU serving path; `TorchAttentionBackend` in `minivllm/model/attention.py`
# calls it for every decode step) was changed in two ways. Here is the old version, re-implemented inline:

# %%
def paged_decode_attention_before(query, key_cache, value_cache, block_tables, seq_lens, scale,
                                  seq_lens_cpu=None, kv_buffer=None, compute_dtype=torch.float32,
                                  k_scale=1.0, v_scale=1.0):
    """The old reference decode path: fancy-index gather into fresh tensors, then SDPA with enable_gqa.
    query (num_seqs, num_heads, head_dim) -> (num_seqs, num_heads, head_dim). kv_buffer and compute_dtype
    (fp32 here: this lesson's engine runs in fp32) are ignored, and so are an fp8 cache's scales (1.0 here)."""
    num_seqs, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    max_len = max(seq_lens_cpu) if seq_lens_cpu is not None else int(seq_lens.max())
    max_blocks = -(-max_len // block_size)
    padded_len = max_blocks * block_size
    tables = block_tables[:, :max_blocks].long()                              # (num_seqs, max_blocks)
    k = key_cache[tables].view(num_seqs, padded_len, num_kv_heads, head_dim).transpose(1, 2)
    v = value_cache[tables].view(num_seqs, padded_len, num_kv_heads, head_dim).transpose(1, 2)
    # k, v: (num_seqs, kv_heads, padded_len, head_dim), newly allocated on every call
    pos = torch.arange(padded_len, device=query.device)
    valid = pos[None, :] < seq_lens.to(query.device)[:, None]                  # (num_seqs, padded_len)
    q = query.view(num_seqs, num_heads, 1, head_dim)                            # one row per query head
    out = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=valid[:, None, None, :],
                                         scale=scale, enable_gqa=num_heads != num_kv_heads)
    return out.view(num_seqs, num_heads, head_dim).to(query.dtype)            # (num_seqs, heads, head_dim)


# %% [markdown]
# And what changed (read `paged_decode_attention` in `kernels/reference.py` beside it):
#
# 1. **The gather.** `key_cache[tables]` is advanced indexing: it goes through PyTorch's general indexing
#    kernel and returns a new tensor, tens of MB per layer at long contexts. The new code calls
#    `torch.index_select(key_cache, 0, blocks, out=k)`: a block of the cache is one contiguous run of
#    `block_size * kv_heads * head_dim` numbers, and `index_select` along dim 0 copies whole runs, into a
#    buffer (`kv_buffer`) that the backend allocates once and reuses for every layer and step.
# 2. **GQA.** SmolLM2 has 9 query heads and 3 KV heads: heads 0-2 read KV head 0, and so on.
#    `enable_gqa=True` lets SDPA do that mapping, but each query head remains its own one-row attention
#    problem, so each KV head's keys and values are walked three times, once per query head. The new code
#    views the 3 query heads of a group as **3 query rows** against their one KV head:
#    `query.view(num_seqs, kv_heads, group, head_dim)`, so K and V are walked once and the scores of the
#    three heads come out of one small matrix product.
#
# Neither change alters the math, so the outputs must agree. The test shape is a batch-32 decode of this
# model (9 heads, 3 KV heads, head_dim 64, blocks of 16 tokens) with contexts from 32 to 512 tokens, each
# sequence's blocks scattered over the pool as the KV cache manager would leave them.

# %%
g = torch.Generator().manual_seed(0)
B, H, KV_H, D, BS = NUM_REQUESTS, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, 16
seq_lens = torch.randint(32, 513, (B,), generator=g, dtype=torch.int32)           # (B,) contexts
blocks_per_seq = [-(-n // BS) for n in seq_lens.tolist()]
num_blocks = sum(blocks_per_seq) + 1                                               # block 0 only pads tables
key_cache = torch.randn(num_blocks, BS, KV_H, D, generator=g)                      # (blocks, 16, 3, 64)
value_cache = torch.randn(num_blocks, BS, KV_H, D, generator=g)
shuffled = (torch.randperm(num_blocks - 1, generator=g) + 1).int()                 # scattered, as in a real pool
block_tables = torch.zeros(B, max(blocks_per_seq), dtype=torch.int32)              # (B, max_blocks), 0-padded
start = 0
for i, nb in enumerate(blocks_per_seq):
    block_tables[i, :nb] = shuffled[start:start + nb]
    start += nb
query = torch.randn(B, H, D, generator=g)                                          # (B, 9, 64): one token each
scale = D ** -0.5
args = (query, key_cache, value_cache, block_tables, seq_lens, scale)
lens_cpu = seq_lens.tolist()
kv_buffer = torch.empty(2 * B * max(blocks_per_seq) * BS * KV_H * D)              # the size TorchAttentionBackend asks for

out_before = paged_decode_attention_before(*args, seq_lens_cpu=lens_cpu)
out_after = ref.paged_decode_attention(*args, seq_lens_cpu=lens_cpu, kv_buffer=kv_buffer)
out_after_fresh = ref.paged_decode_attention(*args, seq_lens_cpu=lens_cpu)          # no buffer: allocates per call
torch.testing.assert_close(out_after, out_before)
gathered_mb = kv_buffer.numel() * kv_buffer.element_size() / 1e6
print(f"{B} sequences, contexts {min(lens_cpu)}-{max(lens_cpu)} (padded to {max(blocks_per_seq) * BS}), "
      f"{num_blocks} blocks in the pool; gathered K and V: {gathered_mb:.1f} MB per layer")
print("before and after agree (assert_close); with and without the buffer identical:",
      torch.equal(out_after, out_after_fresh))

# %% [markdown]
# Now the stopwatch. Each variant runs back to back for about half a second; we keep the median time per
# call, which a neighbour's burst of work on a shared machine disturbs less than the mean. The middle
# variant, the new code without a buffer, separates the two effects: the new ops, and not allocating.

# %%
# NBVAL_IGNORE_OUTPUT
def time_per_call(fn, min_time_s=0.5):
    """Median seconds per call over about min_time_s of back-to-back calls, after one warm-up call."""
    fn()
    times, end = [], time.perf_counter() + min_time_s
    while time.perf_counter() < end or len(times) < 5:
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


variants = {
    "before: index + enable_gqa": lambda: paged_decode_attention_before(*args, seq_lens_cpu=lens_cpu),
    "after, no buffer": lambda: ref.paged_decode_attention(*args, seq_lens_cpu=lens_cpu),
    "after: index_select into kv_buffer + GQA rows": lambda: ref.paged_decode_attention(
        *args, seq_lens_cpu=lens_cpu, kv_buffer=kv_buffer),
}
per_call = {name: time_per_call(fn) for name, fn in variants.items()}
t_before, t_after = per_call["before: index + enable_gqa"], per_call["after: index_select into kv_buffer + GQA rows"]
for name, t in per_call.items():
    print(f"{name:48} {t * 1e3:6.2f} ms per layer")
print(f"after is {t_before / t_after:.2f}x faster per call; over {cfg.num_hidden_layers} layers that is "
      f"{t_before * cfg.num_hidden_layers * 1e3:.0f} ms -> {t_after * cfg.num_hidden_layers * 1e3:.0f} ms of a step")

# %% [markdown]
# Which op got faster? Ten calls of each under the profiler:

# %%
# NBVAL_IGNORE_OUTPUT
def profile_calls(fn, n=10):
    """{op: self ms per call} for n calls of fn."""
    fn()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(n):
            fn()
    return {e.key: e.self_cpu_time_total / 1e3 / n for e in prof.key_averages()}


attn_before = profile_calls(variants["before: index + enable_gqa"])
attn_after = profile_calls(variants["after: index_select into kv_buffer + GQA rows"])
shown = sorted(set(sorted(attn_before, key=attn_before.get)[-2:]) | set(sorted(attn_after, key=attn_after.get)[-2:]),
               key=lambda op: -max(attn_before.get(op, 0), attn_after.get(op, 0)))
print(f"{'op':52} {'before':>8} {'after':>8}   (ms per call)")
for op in shown:
    print(f"{op:52} {attn_before.get(op, 0):8.2f} {attn_after.get(op, 0):8.2f}")

fig, ax = plt.subplots(figsize=(8, 2.2))
y = np.arange(len(shown))
ax.barh(y - 0.2, [attn_before.get(op, 0) for op in shown], height=0.4, color="tab:gray", label="before")
ax.barh(y + 0.2, [attn_after.get(op, 0) for op in shown], height=0.4, color="tab:orange", label="after")
ax.set_yticks(y, [op.replace("aten::", "") for op in shown], fontsize=8)
ax.invert_yaxis()
ax.set_xlabel("self time per call (ms)")
ax.set_title(f"decode attention, batch {B}, contexts {min(lens_cpu)}-{max(lens_cpu)}: one layer", fontsize=10)
ax.legend(fontsize=8)
plt.tight_layout()
plt.show()

# %% [markdown]
# Both changes show up: the gather (`index` before, `index_select` after) and the attention itself (the same
# CPU flash-attention op, called with a third of the query heads and three rows each). Compare the "no
# buffer" timing above with the buffered one to see how much the reused buffer itself adds on this machine;
# PyTorch's allocator and the C library often hand the same memory back, so the kernels can matter more than
# the allocation.
#
# ### The whole decode step, before and after
#
# A faster attention matters only as much as attention weighed in the step. To see the effect inside the
# engine, we swap the old function in for the new one: `TorchAttentionBackend.forward` looks up
# `kernels.reference.paged_decode_attention` on every call, so replacing that attribute (and putting it back
# in a `finally`) changes what every layer runs. We alternate, before, after, before, ..., one profiled
# decode step each, so that a neighbour's load on the machine hits both about equally.

# %%
new_paged_decode_attention = ref.paged_decode_attention
step_profiles = {"before": [], "after": []}
try:
    for k in range(4):
        label = "before" if k % 2 == 0 else "after"
        ref.paged_decode_attention = paged_decode_attention_before if label == "before" else new_paged_decode_attention
        ops, (trace,), wall = profile_steps(1)
        step_profiles[label].append((ops, wall, trace))
finally:
    ref.paged_decode_attention = new_paged_decode_attention
print("steps profiled:", {label: [t.step for _, _, t in runs] for label, runs in step_profiles.items()})
print("kernels.reference.paged_decode_attention restored:", ref.paged_decode_attention is new_paged_decode_attention)


# %%
# NBVAL_IGNORE_OUTPUT
def step_breakdown(runs):
    """Mean ms per step in five parts: matmuls, the K/V gather, SDPA, other ops, outside any op."""
    parts = {"linear layers (mm)": 0.0, "K/V gather": 0.0, "SDPA": 0.0, "other ops": 0.0, "outside any op": 0.0}
    for ops, wall, _ in runs:
        for op, ms in ops.items():
            part = ("linear layers (mm)" if op in MATMUL else "K/V gather" if op in ("aten::index", "aten::index_select")
                    else "SDPA" if "scaled_dot_product" in op else "other ops")
            parts[part] += ms / len(runs)
        parts["outside any op"] += (wall * 1e3 - sum(ops.values())) / len(runs)
    return parts


breakdown = {label: step_breakdown(runs) for label, runs in step_profiles.items()}
step_ms = {label: sum(parts.values()) for label, parts in breakdown.items()}
print(f"{'':20} {'before':>8} {'after':>8}   (ms per decode step, batch {NUM_REQUESTS})")
for part in breakdown["before"]:
    print(f"{part:20} {breakdown['before'][part]:8.1f} {breakdown['after'][part]:8.1f}")
print(f"{'whole step':20} {step_ms['before']:8.1f} {step_ms['after']:8.1f}   "
      f"({1 - step_ms['after'] / step_ms['before']:.1%} less)")

fig, ax = plt.subplots(figsize=(8, 2.6))
colors = ["tab:blue", "tab:orange", "tab:red", "0.75", "0.4"]
for row, label in enumerate(["after", "before"]):
    left = 0.0
    for (part, ms), color in zip(breakdown[label].items(), colors):
        ax.barh(row, ms, left=left, color=color, label=part if row == 0 else None)
        left += ms
ax.set_yticks([0, 1], ["after", "before"])
ax.set_xlabel("ms per decode step")
ax.set_title("one decode step of the engine, profiled", fontsize=10)
fig.legend(fontsize=8, ncol=5, loc="lower center", frameon=False)
plt.tight_layout(rect=(0, 0.1, 1, 1))
plt.show()

# %% [markdown]
# Honestly, then: per call the new attention is faster (by the factor printed above, which varies with the
# machine's load), but a whole step gains only what attention lost. At these contexts (the engine's requests
# hold 16-64 prompt tokens plus a few generated) attention is a small slice of the step; the matmuls, the bulk
# of it, did not change at all (compare the blue bars). The micro-benchmark's longer contexts show where the
# change pays: there the K and V a step reads approach the size of the weights, and attention's share of the
# step grows with them. Against the matmul time of a step just measured:

# %%
# NBVAL_IGNORE_OUTPUT
mm_ms = breakdown["after"]["linear layers (mm)"]
for name, t in [("before", t_before), ("after", t_after)]:
    attn_ms = t * cfg.num_hidden_layers * 1e3
    print(f"contexts {min(lens_cpu)}-{max(lens_cpu)}, {name:6}: attention {attn_ms:5.0f} ms per step "
          f"({cfg.num_hidden_layers} layers) vs the matmuls' {mm_ms:4.0f} ms")
kv_mb = roofline.kv_bytes_per_token(cfg, ITEMSIZE) * sum(lens_cpu) / 1e6
print(f"KV bytes such a step reads: {kv_mb:.0f} MB, weights: {weights / 1e6:.0f} MB")

# %%
assert ref.paged_decode_attention is new_paged_decode_attention                     # restored
assert "aten::index" in attn_before and "aten::index_select" in attn_after and "aten::index" not in attn_after
assert len(step_profiles["before"]) == len(step_profiles["after"]) == 2

# %% [markdown]
# ## 4. What bounds a decode step here, and what would move it
#
# Put the pieces together. A decode step reads every weight (and the batch's KV) from memory, and does
# `2 * batch` FLOPs per weight. At small batches that is memory-bound on any hardware; how far up the batch
# stays memory-bound depends on the ridge point, and a CPU core's ridge is low (section 2 printed this
# one's): a batch of a few dozen rows can already be near it. Section 2 also printed which side of the ridge
# a batch-32 step sits on here, and how far above its floor the measured step is. The rest of the gap is
# mostly the matmul routines running below their big-matrix rate at a few dozen rows, plus the Python around
# every step.
#
# This bounds the comparison with Hugging Face `generate` too. Both run the same matmuls on the same
# weights, so at the same batch size they share the same floor; minivllm's lead comes from less wasted work
# (continuous batching: no padding rows, no finished requests riding along in a static batch) and from its
# batch size, not from a faster matmul. On this hardware in fp32, no scheduler can take a step below the
# floor of section 2. What would move the floor itself:
#
# - **Fewer bytes**: bf16 weights halve the weight bytes, and so the memory floor. Whether a bf16 matmul is
#   also *fast* depends on the CPU (instructions such as AMX make it so; without them PyTorch may run it
#   slower than fp32). The cell below measures it here.
# - **Bigger batches**: every weight read serves more rows; the intensity climbs towards the ridge and the
#   floor *per token* falls, until the step turns compute-bound and it stays flat (also below). The KV
#   cache's size limits how big the batch can get.
# - **A GPU**: a datacenter GPU has many times a CPU core's bandwidth and a ridge of hundreds of FLOPs per
#   byte, so decode there is firmly memory-bound, and the race is to come close to the bandwidth floor:
#   the Triton kernels (lesson 06), and CUDA graphs, which record a decode step's thousands of kernel
#   launches once per batch size and replay them without Python in the way.

# %%
# NBVAL_IGNORE_OUTPUT
rate_bf16 = roofline.measure_matmul_rate(cfg, dtype=torch.bfloat16, batch_tokens=NUM_REQUESTS, min_time_s=0.5)
print(f"matmul rate at {NUM_REQUESTS} rows: fp32 {rate_batch / 1e9:.1f} GFLOP/s, bf16 {rate_bf16 / 1e9:.1f} GFLOP/s")
print(f"weight bytes: fp32 {weights / 1e6:.0f} MB, bf16 {roofline.weight_bytes(cfg, 2) / 1e6:.0f} MB "
      f"-> memory floor {weights / bandwidth * 1e3:.1f} ms vs {roofline.weight_bytes(cfg, 2) / bandwidth * 1e3:.1f} ms")
print(f"\nthe roofline floor of a decode step, fp32, {mean_ctx} cached tokens per request:")
floors = {}
for b in (1, 8, 32, 128):
    floors[b] = roofline.step_floor_s(cfg, ITEMSIZE, rate, bandwidth, b, b * mean_ctx, b, b * mean_ctx)
    flops, nbytes = step_flops_bytes(StepWork(0, b, b * mean_ctx, b, b * mean_ctx, b, True))
    bound = "memory" if nbytes / bandwidth >= flops / rate else "compute"
    print(f"    batch {b:3}: {floors[b] * 1e3:6.1f} ms per step, {floors[b] / b * 1e3:6.2f} ms per token "
          f"({bound}-bound)")

# %% [markdown]
# `python -m minivllm.bench` makes the same measurements around a full benchmark run, so the ratio to HF and
# the distance to the hardware are printed side by side:
#
# ```bash
# python -m minivllm.bench --compare hf --threads 1
# ```
#
# It prints throughput, TTFT and TPOT, then HF's throughput and the `minivllm / HF` ratio, then the
# `matmul rate` and `copy bandwidth`, the `matmul ceiling` (the whole workload's FLOPs at the matmul rate,
# as output tokens/s), the `roofline of the run` (each of its steps at its own floor, summed), and for the
# fullest decode steps their median time against their memory floor. (It is not run here: HF's run alone
# takes minutes.)
#
# Finally, leave the engine tidy: abort the requests still running, and check that the pool is whole.

# %%
for request_id in list(engine.requests):
    engine.abort_request(request_id)
engine.check_integrity()
stats = llm.get_stats()
print(f"running {stats.num_running}, waiting {stats.num_waiting}, KV usage {stats.kv_usage:.0%}, "
      f"steps {stats.num_steps}")

# %% [markdown]
# > **How vLLM does it differently.** vLLM's CPU backend does in C++ what this lesson measures in PyTorch ops:
# > its own paged-attention kernels read the block table directly (no gather), and the model is compiled with
# > `torch.compile` (inductor) so norms, rotary and activations fuse into fewer loops; on a GPU, vLLM captures
# > CUDA graphs for a list of batch sizes (lesson 11) and its attention backends (FlashAttention,
# > FlashInfer, Triton) read the paged cache in the kernel. Its benchmark, `vllm bench serve`, is the one
# > `docs/benchmarks.md` uses to compare the two servers.

# %% [markdown]
# ## Check yourself
#
# Run this cell. It re-checks the lesson's claims: the old and new decode attention agree; the FLOPs and
# bytes we charged each step are `roofline.step_floor_s`'s; prefill is far more intense than decode; no step
# ran below its roofline floor; both hardware rates were measured; the linear layers' matmuls were the
# biggest op of a decode step; the profile saw the gather change from `index` to `index_select`; the patched
# function is back; and the engine let go of every block.

# %%
def self_check():
    # 3. before == after, on the real decode shape
    torch.testing.assert_close(paged_decode_attention_before(*args, seq_lens_cpu=lens_cpu),
                               ref.paged_decode_attention(*args, seq_lens_cpu=lens_cpu, kv_buffer=kv_buffer))
    assert torch.equal(out_after, out_after_fresh)
    assert ref.paged_decode_attention is new_paged_decode_attention
    assert "aten::index" in attn_before and "aten::index" not in attn_after
    # 2. the ceiling
    assert rate > 0 and bandwidth > 0 and rate_batch > 0
    for sw in timed_work + decode_work:
        floor = roofline.step_floor_s(cfg, ITEMSIZE, rate, bandwidth, sw.num_tokens, sw.attention_pairs,
                                      sw.num_sampled, sw.kv_tokens_read)
        flops, nbytes = step_flops_bytes(sw)
        assert abs(floor - max(flops / rate, nbytes / bandwidth)) <= 1e-9 * floor
        assert floor > 0
    assert nbytes > weights                                # a decode step reads every weight, and KV on top
    # 1. the profile
    assert prefill_intensity > 10 * decode_intensity
    assert max(decode_ops, key=decode_ops.get) in MATMUL
    per_token = [floors[b] / b for b in sorted(floors)]
    assert all(a >= b * (1 - 1e-9) for a, b in zip(per_token, per_token[1:]))   # bigger batch: never dearer per token
    assert per_token[0] > per_token[-1]
    # the engine
    assert stats.num_running == stats.num_waiting == 0 and stats.kv_usage == 0
    assert engine.kv_cache_manager.num_free_blocks == engine.kv_cache_manager.num_blocks
    return "all checks passed"


self_check()

# %% [markdown]
# ## Where next
#
# The profile is the map: re-run section 1 after any change you make to minivllm, and the roofline of
# section 2 tells you how much is left to win. `python -m minivllm.bench` does the same for whole runs, and
# `python -m minivllm.bench kernels` for the Triton decode kernel against a GPU's copy bandwidth.
# [Lesson 11](11_beyond_the_floor.ipynb) goes on: CUDA graphs, rehearsed on this CPU, and what did and did not
# move a CPU decode step once this lesson's floor was known.
