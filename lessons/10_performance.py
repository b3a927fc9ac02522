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
# hardware allows, change one thing, measure again. This lesson does that once, on the CPU it runs on:
#
# 1. **measure first**: profile the engine's steps with `torch.profiler`: where does a decode step's time go?
# 2. **the ceiling**: time this machine's matmul rate and memory bandwidth (`minivllm/bench/roofline.py`),
#    turn them into a floor for each step, and place the engine's real steps on a *roofline* picture;
# 3. **two ways to write one op**: the CPU decode attention of `kernels/reference.py` beside a naive version:
#    the same output, both timed and profiled, alone and inside a whole decode step;
# 4. **what bounds a decode step here**, and what would move it (bf16, bigger batches, a GPU).
#
# Lesson 11 goes on from here: the host's share of a step, CUDA graphs and async scheduling. Read this one
# next to `minivllm/bench/roofline.py`, `bench/offline.py`, `kernels/reference.py` and `model/attention.py`.
# **Every number below is measured when the notebook runs**, on whatever machine
# runs it: the prose says what to look for, the printouts what this machine did (they wobble on a busy one).

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
import torch
import torch.nn.functional as F
from matplotlib.patches import Patch
from torch.profiler import ProfilerActivity, profile

from minivllm import LLM, SamplingParams
from minivllm.bench import roofline
from minivllm.bench.roofline import StepWork, step_work
from minivllm.bench.workload import Workload
from minivllm.model._kernels import kernels
from plots import draw_roofline

ref = kernels.reference      # the plain PyTorch kernels, the CPU serving path, reached as minivllm/model/attention.py does
torch.manual_seed(0)
torch.set_num_threads(1)     # every number below is one core's worth (python -m minivllm.bench --threads N)

# %% [markdown]
# ## 1. Measure first: where does a decode step's time go?
#
# An engine gets work shaped like the benchmark's (`Workload.random`, the generator `python -m minivllm.bench`
# uses): 32 requests of random token ids, greedy, `ignore_eos`, short prompts (16-64 tokens) so that the
# prefill takes only a few seconds. We drive it ourselves with `add_request` and `step()`, as in lesson 00.
#
# This lesson studies the **PyTorch reference path** (`attention_backend="torch"`, and the small layers in
# plain PyTorch: `MINIVLLM_CPU_KERNELS=0`, set in the first cell), the one you can read op by op. minivllm's
# CPU default runs the decode attention and the small layers as C++ kernels (`kernels/cpu_attention.cpp`,
# `kernels/cpu_layers.cpp`), which a profile shows as single ops.

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
# `torch.profiler` records every PyTorch op a piece of code runs and how long it took. We sort by *self* time
# (inside the op itself, not the ops it calls, so nothing counts twice). The wall-clock time left over is
# **time outside any op**: Python in the scheduler, the step's inputs, sampling's bookkeeping, detokenizing.
#
# The first step is the prefill of all 32 prompts; we only time it (its attention runs sequence by sequence,
# tens of thousands of small ops that take the profiler long to tally). The first decode step allocates
# attention's gather buffer, so we leave it out too; then we profile three decode steps.

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
MATMUL, ATTENTION = {"aten::mm", "aten::addmm", "mkldnn::_linear_pointwise"}, {"aten::index_select", "aten::index", "aten::bmm", "aten::_softmax"}


def op_color(name):
    return ("tab:blue" if name in MATMUL else "tab:orange" if name in ATTENTION or "scaled_dot_product" in name
            else "0.4" if name == "outside any op" else "0.75")


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
linear_ms = sum(ms for op, ms in decode_ops.items() if op in MATMUL)
print(f"the linear layers' share of this decode step: {linear_ms / (decode_wall * 1e3):.0%}")

# %% [markdown]
# Blue is the linear layers (`mkldnn::_linear_pointwise`, oneDNN's matmul on prepacked weights, or `aten::mm`:
# the q/k/v, o, gate/up and down projections and the LM head), orange attention (the K/V gather and SDPA;
# the embedding's one small `index_select` counts with it), grey everything else.
# Read the bars as shares of the step. A part can buy back at most its own share, however fast it gets
# (Amdahl's law): that says where to start optimising, and where not to.
#
# ### Prefill and decode: the same matmuls, a different kind of work
#
# A linear layer with an `(out, in)` weight, applied to `n` rows, does `2 * n * in * out` FLOPs (a multiply
# and an add per weight per row) and has to read the `in * out` weights once: in fp32 that is 4 bytes per
# weight, so about **`n / 2` FLOPs for every byte read**. That ratio is the *arithmetic intensity*.
#
# - **Prefill** runs every prompt token through the layers at once: `n` is in the thousands, each weight
#   read serves a thousand multiply-adds, and the arithmetic is the limit: prefill is **compute-bound**.
# - **Decode** runs one new token per request: `n` is the batch, 32 here. Every weight (and every cached K
#   and V of the batch) is read for a few rows; at a small enough batch the arithmetic units wait for
#   memory: decode is **memory-bound**. How small is "small enough" depends on the machine (section 2).
#
# The FLOPs and bytes of each step, counted as `roofline.step_floor_s` counts them (the same on every machine):

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
prefill_intensity = step_flops_bytes(prefill_work)[0] / step_flops_bytes(prefill_work)[1]
decode_intensity = step_flops_bytes(decode_work[0])[0] / step_flops_bytes(decode_work[0])[1]

# %% [markdown]
# ## 2. The hardware's ceiling, measured here
#
# A datasheet's peak is rarely what PyTorch gets on a given machine, so `roofline.py` measures the two rates
# that matter, in this process:
#
# - `measure_matmul_rate(cfg)`: FLOP/s of one decoder layer's four matmuls at 256 rows (the model's shapes),
#   for about a second: usually the best case (one layer's weights may even stay in the CPU's caches);
# - `measure_copy_bandwidth()`: bytes/s of a `copy_` of 256 MiB (read + written), far bigger than any cache.
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

# %% [markdown]
# With your function: this machine's floor at batch 32 and 300 tokens of context; then the decode steps
# against their floor, timed without the profiler's overhead (`StepTrace.duration_s`, as the bench does).

# %%
# NBVAL_IGNORE_OUTPUT
print(f"this machine ({bandwidth / 1e9:.1f} GB/s): a decode step at batch {NUM_REQUESTS} with 300 tokens of context "
      f"each needs at least {decode_memory_floor_ms(cfg, ITEMSIZE, NUM_REQUESTS, 300, bandwidth):.1f} ms in fp32, "
      f"{decode_memory_floor_ms(cfg, 2, NUM_REQUESTS, 300, bandwidth):.1f} ms in bf16")
with engine.record_traces() as traces:
    for _ in range(4):
        engine.step()
timed_work = [step_work(t) for t in traces]
for sw in timed_work:
    flops, nbytes = step_flops_bytes(sw)
    floor = roofline.step_floor_s(cfg, ITEMSIZE, rate, bandwidth, sw.num_tokens, sw.attention_pairs,
                                  sw.num_sampled, sw.kv_tokens_read)
    print(f"decode step, batch {sw.num_decode}: {sw.duration_s * 1e3:6.1f} ms measured "
          f"({flops / sw.duration_s / 1e9:5.1f} GFLOP/s); floors: memory {nbytes / bandwidth * 1e3:5.1f} ms, "
          f"compute {flops / rate * 1e3:5.1f} ms  ->  {sw.duration_s / floor:4.2f}x the roofline floor")
print(f"the prefill step: {prefill_work.duration_s * 1e3:.0f} ms, "
      f"{step_flops_bytes(prefill_work)[0] / prefill_work.duration_s / 1e9:.1f} GFLOP/s")
sw = timed_work[-1]
print(f"the same step's FLOPs at the {NUM_REQUESTS}-row matmul rate: {step_flops_bytes(sw)[0] / rate_batch * 1e3:.1f} ms")
side = "memory" if decode_intensity < ridge else "compute"
print(f"a decode step's intensity is {decode_intensity:.1f} FLOP/byte, the ridge {ridge:.1f}: "
      f"on this machine a batch-{NUM_REQUESTS} decode step is on the {side}-bound side")

# %% [markdown]
# The picture: the roof (the diagonal is bandwidth, the flat part the 256-row matmul rate, dashed the rate at
# the decode batch), the engine's steps at their intensity and achieved FLOP/s, and small crosses where a
# decode step would sit at other batches: about `B / 2` FLOP/byte in fp32 for the weights alone.

# %%
# NBVAL_IGNORE_OUTPUT
def achieved(sw):
    flops, nbytes = step_flops_bytes(sw)
    return flops / nbytes, flops / sw.duration_s


mean_ctx = timed_work[0].kv_tokens_read // timed_work[0].num_decode
hypothetical = []                                     # decode steps at other batches, the same context each
for b in (1, 4, 16, 32, 128):
    flops, nbytes = step_flops_bytes(StepWork(0, b, b * mean_ctx, b, b * mean_ctx, b, True))
    hypothetical.append((f"B={b}", flops / nbytes))
fig, ax = plt.subplots(figsize=(8, 4.5))
draw_roofline(ax, rate, bandwidth, {f"prefill step ({prefill_work.num_tokens} tokens)": (*achieved(prefill_work), "o"),
                                    f"decode step (batch {NUM_REQUESTS}), median": (
                                        *sorted(achieved(sw) for sw in timed_work)[len(timed_work) // 2], "s")},
              extra_roofs=[(f"matmul rate at {NUM_REQUESTS} rows", rate_batch)], on_roof=hypothetical,
              title="where the engine's steps sit under this machine's roofline (fp32, one thread)")
plt.tight_layout()
plt.show()

# %% [markdown]
# How to read it: a step's distance *below* the roof is what better code could still win; its position
# *along* the x-axis is set by the workload and the dtype, and no code change moves it. A decode step far left
# of the ridge is stuck on the diagonal: it goes only as fast as memory delivers the weights.

# %% [markdown]
# ## 3. Two ways to write one op: the CPU decode attention
#
# In the decode profile, after the matmuls, come attention's ops: the K/V **gather** and **SDPA**. Their cost
# grows with the context, and with it their share of the step. `kernels/reference.py`'s
# `paged_decode_attention` (the CPU reference path; `TorchAttentionBackend` in `minivllm/model/attention.py`
# calls it for every decode step) makes two choices that a first version would not. Here is
# that naive version:

# %%
def paged_decode_attention_naive(query, key_cache, value_cache, block_tables, seq_lens, scale,
                                 seq_lens_cpu=None, kv_buffer=None, compute_dtype=torch.float32,
                                 k_scale=1.0, v_scale=1.0):
    """A naive decode path: fancy-index gather into fresh tensors, then SDPA with enable_gqa.
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
# And what the reference does instead (read `paged_decode_attention` in `kernels/reference.py` beside it):
#
# 1. **The gather.** `key_cache[tables]` is advanced indexing: PyTorch's general indexing kernel, into a new
#    tensor, tens of MB per layer at long contexts. The reference calls `torch.index_select(key_cache, 0,
#    blocks, out=k)`: a block is one contiguous run of `block_size * kv_heads * head_dim` numbers, copied
#    whole, into a buffer (`kv_buffer`) the backend allocates once and reuses for every layer and step.
# 2. **GQA.** SmolLM2 has 9 query heads and 3 KV heads (heads 0-2 read KV head 0, and so on). With
#    `enable_gqa=True` each query head stays its own one-row problem, so each KV head's K and V are walked
#    three times. The reference views a group's 3 query heads as **3 query rows** against their one KV head
#    (`query.view(num_seqs, kv_heads, group, head_dim)`): K and V are walked once, in one small matmul.
#
# Neither choice alters the math, so the outputs must agree. The test shape is a batch-32 decode of this
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

out_naive = paged_decode_attention_naive(*args, seq_lens_cpu=lens_cpu)
out_ref = ref.paged_decode_attention(*args, seq_lens_cpu=lens_cpu, kv_buffer=kv_buffer)
torch.testing.assert_close(out_ref, out_naive)
gathered_mb = kv_buffer.numel() * kv_buffer.element_size() / 1e6
print(f"{B} sequences, contexts {min(lens_cpu)}-{max(lens_cpu)} (padded to {max(blocks_per_seq) * BS}), "
      f"{num_blocks} blocks in the pool; gathered K and V: {gathered_mb:.1f} MB per layer")
print("naive and reference agree (assert_close)")

# %% [markdown]
# Now the stopwatch. Each runs back to back for about half a second; we keep the median time per call, which
# a neighbour's burst of work on a shared machine disturbs less than the mean.

# %%
# NBVAL_IGNORE_OUTPUT
def ops_in(fn):
    """The names of the ops one call of fn runs, from torch.profiler."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return {e.key for e in prof.key_averages()}


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
    "naive: index + enable_gqa": lambda: paged_decode_attention_naive(*args, seq_lens_cpu=lens_cpu),
    "reference: index_select into kv_buffer + GQA rows": lambda: ref.paged_decode_attention(
        *args, seq_lens_cpu=lens_cpu, kv_buffer=kv_buffer),
}
per_call = {name: time_per_call(fn) for name, fn in variants.items()}
t_naive, t_ref = per_call["naive: index + enable_gqa"], per_call["reference: index_select into kv_buffer + GQA rows"]
for name, t in per_call.items():
    print(f"{name:50} {t * 1e3:6.2f} ms per layer")
print(f"naive / reference time per call: {t_naive / t_ref:.2f}; over {cfg.num_hidden_layers} layers "
      f"{t_naive * cfg.num_hidden_layers * 1e3:.0f} ms -> {t_ref * cfg.num_hidden_layers * 1e3:.0f} ms of a step")
ops_naive, ops_ref = (ops_in(fn) for fn in variants.values())
print("the gather: naive", sorted(op for op in ops_naive if op.startswith("aten::index")),
      "| reference", sorted(op for op in ops_ref if op.startswith("aten::index")))

# %% [markdown]
# ### The whole decode step, with each
#
# A faster attention matters only as much as attention weighs in the step (Amdahl again). In the engine,
# `TorchAttentionBackend.forward` looks up `kernels.reference.paged_decode_attention` on every call, so
# replacing that attribute (back in a `finally`) swaps what every layer runs. We alternate naive, reference,
# naive, ..., one profiled decode step each, so that a neighbour's load hits both about equally.

# %%
reference_attention = ref.paged_decode_attention
step_profiles = {"naive": [], "reference": []}
try:
    for k in range(4):
        label = "naive" if k % 2 == 0 else "reference"
        ref.paged_decode_attention = paged_decode_attention_naive if label == "naive" else reference_attention
        ops, (trace,), wall = profile_steps(1)
        step_profiles[label].append((ops, wall, trace))
finally:
    ref.paged_decode_attention = reference_attention
print("steps profiled:", {label: [t.step for _, _, t in runs] for label, runs in step_profiles.items()},
      "| kernels.reference.paged_decode_attention restored:", ref.paged_decode_attention is reference_attention)


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
print(f"{'':20} {'naive':>9} {'reference':>9}   (ms per decode step, batch {NUM_REQUESTS})")
for part in breakdown["naive"]:
    print(f"{part:20} {breakdown['naive'][part]:9.1f} {breakdown['reference'][part]:9.1f}")
print(f"{'whole step':20} {step_ms['naive']:9.1f} {step_ms['reference']:9.1f}")
attn_share = (breakdown["naive"]["K/V gather"] + breakdown["naive"]["SDPA"]) / step_ms["naive"]
print(f"attention was {attn_share:.0%} of the naive step: no attention code, however fast, could take more off it")

fig, ax = plt.subplots(figsize=(8, 2.6))
colors = ["tab:blue", "tab:orange", "tab:red", "0.75", "0.4"]
for row, label in enumerate(["reference", "naive"]):
    left = 0.0
    for (part, ms), color in zip(breakdown[label].items(), colors):
        ax.barh(row, ms, left=left, color=color, label=part if row == 0 else None)
        left += ms
ax.set_yticks([0, 1], ["reference", "naive"])
ax.set_xlabel("ms per decode step")
ax.set_title("one decode step of the engine, profiled", fontsize=10)
fig.legend(fontsize=8, ncol=5, loc="lower center", frameon=False)
plt.tight_layout(rect=(0, 0.1, 1, 1))
plt.show()

# %% [markdown]
# The gather is `index` in one and `index_select` in the other (printed above); the matmuls (blue) are the
# same code in both. The engine's contexts here are short (16-64 prompt tokens plus a few generated); at
# the micro-benchmark's longer ones the K and V a step reads approach the weights' size, and so does
# attention's share of the step.

# %% [markdown]
# ## 4. What bounds a decode step here, and what would move it
#
# A decode step reads every weight (and the batch's KV) and does `2 * batch` FLOPs per weight: memory-bound
# at small batches on any hardware, and how far up the batch it stays so depends on the ridge (section 2
# printed this machine's). The gap between a measured step and its floor is what code could still win: the
# matmuls at a few dozen rows run below their 256-row rate, and Python runs around every step (lesson 11).
#
# This bounds the comparison with Hugging Face `generate` too: the same matmuls on the same weights share a
# floor at the same batch, so a serving engine's lead comes from less wasted work (no padding rows, no
# finished requests riding along) and a bigger batch, not from a faster matmul. What would move the floor:
#
# - **Fewer bytes**: bf16 weights halve the weight bytes, and so the memory floor. Whether a bf16 matmul is
#   also *fast* depends on the CPU's instructions (AVX-512 BF16, AMX); the cell below measures it here.
# - **Bigger batches**: every weight read serves more rows, so the floor *per token* falls until the step
#   turns compute-bound, and then it stays flat (also below). The KV cache's size limits the batch.
# - **A GPU**: many times a CPU core's bandwidth and a ridge of hundreds of FLOPs per byte: decode there is
#   firmly memory-bound, a race to the bandwidth floor (the Triton kernels of lesson 06; lesson 11).

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
# `python -m minivllm.bench --compare hf --threads 1` makes the same measurements around a whole run and prints
# them beside its throughput and HF's: the `matmul rate`, the `copy bandwidth`, the `roofline of the run`
# (each step at its own floor, summed), and the fullest decode steps against their memory floor. (Not run
# here: HF's run alone takes minutes.) Finally, leave the engine tidy, and check that the pool is whole.

# %%
for request_id in list(engine.requests):
    engine.abort_request(request_id)
engine.check_integrity()
stats = llm.get_stats()
print(f"running {stats.num_running}, waiting {stats.num_waiting}, KV usage {stats.kv_usage:.0%}, "
      f"steps {stats.num_steps}")

# %% [markdown]
# > **How vLLM does it differently.** vLLM's CPU backend does in C++ what this lesson measures in PyTorch ops:
# > its paged-attention kernels read the block table directly (no gather), and `torch.compile` (inductor)
# > fuses norms, rotary and activations into fewer loops; on a GPU it captures CUDA graphs (lesson 11) and its
# > attention backends (FlashAttention, FlashInfer, Triton) read the paged cache in the kernel. Its benchmark,
# > `vllm bench serve`, is the one `docs/benchmarks.md` uses to compare the two servers.

# %% [markdown]
# ## Check yourself
#
# It re-checks what the lesson counted and compared, never a speed (that is measured, not asserted): the two
# attentions agree, the FLOPs and bytes are `roofline.step_floor_s`'s, the patch is undone, the pool is whole.

# %%
def self_check():
    # 3. naive == reference, on the real decode shape
    torch.testing.assert_close(paged_decode_attention_naive(*args, seq_lens_cpu=lens_cpu),
                               ref.paged_decode_attention(*args, seq_lens_cpu=lens_cpu, kv_buffer=kv_buffer))
    assert ref.paged_decode_attention is reference_attention
    assert "aten::index" in ops_naive and "aten::index" not in ops_ref
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
    per_token = [floors[b] / b for b in sorted(floors)]
    assert all(a >= b * (1 - 1e-9) for a, b in zip(per_token, per_token[1:]))   # bigger batch: never dearer per token
    # the engine
    assert stats.num_running == stats.num_waiting == 0 and stats.kv_usage == 0
    assert engine.kv_cache_manager.num_free_blocks == engine.kv_cache_manager.num_blocks
    return "all checks passed"


self_check()

# %% [markdown]
# ## Where next
#
# The profile is the map: re-run section 1 after any change to minivllm; section 2's roofline says how much is
# left to win (`python -m minivllm.bench` for whole runs, `python -m minivllm.bench kernels` on a GPU).
# [Lesson 11](11_cuda_graphs_async.ipynb) goes on: the host's share of a step, CUDA graphs and async scheduling.
