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
# # Lesson 11: CUDA graphs and async scheduling
#
# Lesson 10 looked inside the model's forward. A step is more than its forward: the host plans the batch,
# builds its inputs, applies the sampled tokens to the core and turns them into text, and on a GPU it also
# launches every kernel of the forward one by one. This lesson measures the host's share of a step on the
# machine that runs it, then takes the two ways vLLM keeps the device from waiting for the host:
#
# 1. **A step, host and device**: a timeline of one engine's decode steps, every part timed.
# 2. **CUDA graphs**: record a decode step's kernel launches once, replay them with one call
#    (`minivllm/worker/cuda_graph.py`). You write the padding of a batch to its graph.
# 3. **Async scheduling**: plan and issue batch N + 1 while the device runs batch N
#    (`minivllm/core/async_scheduler.py`, `LLMEngine.step_with_batch_queue`). You write the plan of a request
#    whose batch is still in flight.
# 4. **What the forward itself is bound by on a CPU**: bytes or arithmetic, on a roofline drawn from this
#    machine's own copy bandwidth and matmul rate; and W8A8, which raises the arithmetic roof. You write the
#    rounding of a token's activations to int8.
#
# Every number is measured when the notebook runs, on whatever machine runs it; timings wobble on a busy one.

# %%
import os

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import warnings

warnings.filterwarnings("ignore", message="IProgress not found")   # tqdm's notice when ipywidgets is absent

import collections
import time

import matplotlib.pyplot as plt
import torch
from matplotlib.patches import Patch

from minivllm import LLM, SamplingParams
from minivllm.bench import roofline
from minivllm.bench.workload import Workload
from plots import STEP_PART_COLORS, draw_roofline, draw_spans

torch.manual_seed(0)
torch.set_num_threads(1)     # one core's worth, as in lesson 10

NUM_REQUESTS, MAX_TOKENS = 16, 8
PARAMS = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)

# %% [markdown]
# ## 1. A step, host and device
#
# An engine step (lesson 00) is a few calls, each timed here by wrapping the method on its object:
# `Scheduler.schedule` (the plan), `ModelRunner.prepare_inputs` (lesson 05's flat batch), `execute_model` (the
# forward), the sampler, `Scheduler.update_from_output` (tokens into the core) and the output processor's
# `process_outputs` and `apply` (text, stop strings, outputs). Each call records `(part, batch, start, end)`,
# the batch being the how-manieth call of that part. The forward and the sampler are the **device's** work
# (on a GPU, kernels); the rest is the **host's** (Python).

# %%
HOST_PARTS = ("schedule", "prepare inputs", "update core", "text")
SPIED = [("scheduler", "schedule", "schedule"), ("model_runner", "prepare_inputs", "prepare inputs"),
         ("model_runner", "execute_model", "forward"), ("model_runner", "sample_tokens", "sample"),
         ("model_runner", "sample_on_device", "sample"), ("scheduler", "update_from_output", "update core"),
         ("output_processor", "process_outputs", "text"), ("output_processor", "apply", "text")]


def spy_on(engine, spans):
    """Wrap each SPIED method of the engine's parts so that every call appends (part, batch, t0, t1) to spans.
    Returns a function that puts the original methods back."""
    calls, originals = collections.Counter(), []
    for owner, method, part in SPIED:
        obj = getattr(engine, owner)
        fn = getattr(obj, method)
        originals.append((obj, method, fn))

        def timed(*args, _fn=fn, _part=part, _method=method, **kwargs):
            t0 = time.perf_counter()
            result = _fn(*args, **kwargs)
            if _method == "schedule" and not result.scheduled:                  # nothing planned: no batch
                return result
            if _method != "sample_tokens" or not engine.async_scheduling:   # async: sampled when issued
                calls[_method] += 1
                spans.append((_part, calls[_method], t0, time.perf_counter()))
            return result
        setattr(obj, method, timed)
    return lambda: [setattr(obj, method, fn) for obj, method, fn in originals]


def run_timed(llm):
    """The workload through `llm`'s engine, step by step: (spans, [(t0, t1) of each step], traces, tokens)."""
    engine = llm.llm_engine
    workload = Workload.random(NUM_REQUESTS, input_len=(16, 32), output_len=(MAX_TOKENS, MAX_TOKENS),
                               vocab_size=engine.model_config.vocab_size, seed=0)
    for i, ids in enumerate(workload.prompt_token_ids):
        engine.add_request({"prompt_token_ids": ids}, PARAMS, request_id=f"r{i}")
    spans, steps, tokens = [], [], {}
    restore = spy_on(engine, spans)
    try:
        with engine.record_traces() as traces:
            while engine.has_unfinished_requests():
                t0 = time.perf_counter()
                for out in engine.step():
                    tokens[out.request_id] = out.outputs[0].token_ids
                steps.append((t0, time.perf_counter()))
    finally:
        restore()
    return spans, steps, traces, dict(sorted(tokens.items()))


llm = LLM(num_kv_blocks=256, seed=0)        # on a CPU async scheduling is off unless asked for
engine = llm.llm_engine
sync_spans, sync_steps, sync_traces, sync_tokens = run_timed(llm)
print(f"{len(sync_steps)} steps: 1 prefill of {sync_traces[0].num_prefill_tokens} tokens, then decode steps of "
      f"{sync_traces[1].num_decode_tokens} requests; parts timed: {sorted({s[0] for s in sync_spans})}")


# %%
# NBVAL_IGNORE_OUTPUT
def per_step_ms(spans, first_batch=2):
    """Mean ms per decode batch of each part (batches from `first_batch` on: the prefill is batch 1)."""
    total, batches = collections.Counter(), {s[1] for s in spans if s[1] >= first_batch}
    for part, batch, t0, t1 in spans:
        if batch >= first_batch:
            total[part] += (t1 - t0) * 1e3
    return {part: total[part] / len(batches) for part in STEP_PART_COLORS}


sync_ms = per_step_ms(sync_spans)
host_ms = sum(sync_ms[p] for p in HOST_PARTS)
device_ms = sync_ms["forward"] + sync_ms["sample"]
for part, ms in sync_ms.items():
    print(f"{part:15} {ms:8.2f} ms per decode step   ({'host' if part in HOST_PARTS else 'device'})")
print(f"the host's share of a decode step here: {host_ms / (host_ms + device_ms):.1%}")

# %% [markdown]
# The timeline of the decode steps, drawn to scale (left), and one boundary between two forwards, zoomed in so
# that the host's parts are wide enough to read (right). Each bar on the right says which batch it worked on:
# N is the batch whose forward ends where the zoom starts.

# %%
# NBVAL_IGNORE_OUTPUT
LANES = {p: "host" for p in HOST_PARTS} | {"forward": "device", "sample": "device"}
ROWS = {p: p for p in STEP_PART_COLORS}


def draw_step_timeline(spans, title, n=4):
    forwards = sorted((s for s in spans if s[0] == "forward" and s[1] >= 2), key=lambda s: s[2])
    first, last = forwards[0], forwards[min(n, len(forwards) - 1)]
    shown = [s for s in spans if first[2] <= s[2] <= last[2]]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.2), gridspec_kw={"width_ratios": [3, 2]})
    draw_spans(left, shown, LANES, origin=first[2], title=f"{title}: {n} decode steps to scale")
    gap_start, gap_end = forwards[1][3], forwards[2][2]           # after forward N, before forward N + 1
    pad = 0.15 * (gap_end - gap_start)
    zoom = [s for s in spans if s[3] >= gap_start - pad and s[2] <= gap_end + pad]
    draw_spans(right, zoom, ROWS, origin=gap_start, title="between two forwards, zoomed in",
               label_of=lambda part, b: "N" if b == forwards[1][1] else f"N{b - forwards[1][1]:+d}")
    right.set_xlim(-pad * 1e3, (gap_end - gap_start + pad) * 1e3)
    fig.legend(handles=[Patch(color=c, label=p) for p, c in STEP_PART_COLORS.items()], loc="lower center",
               ncol=6, fontsize=8, frameon=False)
    plt.tight_layout(rect=(0, 0.08, 1, 1))
    plt.show()


draw_step_timeline(sync_spans, "synchronous engine")

# %% [markdown]
# In the synchronous engine the step is a straight line: forward N, its tokens sampled, applied to the core,
# turned into text, then batch N + 1 planned and built, and only then forward N + 1. The device waits for the
# whole host share of every step. On this CPU the "device" is the same core that runs Python, and the
# forward is long; a GPU runs the same forward many times faster, while the host's Python stays as slow as it
# is here. The host's share grows with the device's speed-up:

# %%
# NBVAL_IGNORE_OUTPUT
for speedup in (1, 10, 100):
    share = host_ms / (host_ms + device_ms / speedup)
    print(f"a device {speedup:3}x this one's speed: the host's share of a synchronous step would be {share:.0%}")

# %% [markdown]
# ## 2. CUDA graphs: the launches, once
#
# On a GPU the forward has a host share of its own. Every PyTorch op is dispatched by the host (Python,
# then PyTorch's dispatcher) and, on a GPU, launched as a kernel; the device runs kernels only as fast as
# the host hands them out. How many ops does one decode step dispatch, and what does dispatching one cost
# here? `TorchDispatchMode` sees every op PyTorch runs, minivllm's C++ ops included; a loop of tiny adds
# measures the cost of one dispatch.

# %%
# NBVAL_IGNORE_OUTPUT
from torch.utils._python_dispatch import TorchDispatchMode


class CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


for i in range(4):
    engine.add_request({"prompt_token_ids": [100 + i] * 20}, PARAMS, request_id=f"count{i}")
engine.step()                                               # their prefill
runner = engine.model_runner
counter, execute_model = CountOps(), runner.execute_model


def counted(*args, **kwargs):
    with counter:
        return execute_model(*args, **kwargs)


runner.execute_model = counted
try:
    engine.step()                                           # one decode step of 4, every op counted
finally:
    runner.execute_model = execute_model
for request_id in [f"count{i}" for i in range(4)]:
    engine.abort_request(request_id)
num_ops = sum(counter.ops.values())
print(f"one decode step dispatches {num_ops} ops; the most frequent:", counter.ops.most_common(4))

# %%
# NBVAL_IGNORE_OUTPUT
a, b, c = torch.ones(4), torch.ones(4), torch.empty(4)
for _ in range(200):
    torch.add(a, b, out=c)
t0 = time.perf_counter()
for _ in range(20_000):
    torch.add(a, b, out=c)
dispatch_us = (time.perf_counter() - t0) / 20_000 * 1e6
print(f"one tiny op: {dispatch_us:.1f} us of host time; {num_ops} of them: at least "
      f"{num_ops * dispatch_us / 1e3:.1f} ms of host time per step before any arithmetic")

# %% [markdown]
# A **CUDA graph** records one step's kernel launches once and replays them with a single call
# (`minivllm/worker/cuda_graph.py`, on by default on CUDA; `enforce_eager=True` turns it off, as in vLLM).
# A replay repeats the recorded kernels on the same memory with the same shapes, which shapes the design:
#
# - one graph per **capture size** (vLLM's 1, 2, 4, 8, 16, 24, ...); a batch of 5 runs the graph of 8;
# - the inputs live in **static buffers**; each step copies its inputs in, and the 3 rows of padding get slot
#   -1 (the KV store skips them) and a context of 1 on block 0 (a harmless read); their outputs are dropped;
# - the block table has a fixed width (`max_model_len / block_size`), and the attention kernel reads each
#   sequence's length from device memory, so one graph serves every context length;
# - prefill and mixed steps run eagerly.
#
# There is nothing to capture on a CPU, but everything else can be rehearsed: `capture=False` runs the same
# padded, static-buffer path eagerly. Five requests that finish one after another make decode batches of
# 5, 4, 3, 2 and 1, which run in the graphs of 8, 4, 4, 2 and 1, and the tokens must be the eager path's.

# %%
from minivllm.worker.cuda_graph import DecodeGraphs, capture_sizes

print("capture sizes for max_num_seqs=256:", capture_sizes(256))
graph_requests = [{"prompt_token_ids": [100 + i] * (8 + 4 * i)} for i in range(5)]   # prompts of 8-24 tokens
graph_params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (4, 8, 12, 16, 20)]
eager_tokens = [o.outputs[0].token_ids for o in llm.generate(graph_requests, graph_params, use_tqdm=False)]
graphs = DecodeGraphs(runner.forward, max_num_seqs=16, max_model_len=engine.max_model_len,
                      block_size=runner.block_size, device=runner.device, capture=False)
runner.graphs = graphs                          # what allocate_kv_cache does on CUDA, with capture=True
try:
    graph_tokens = [o.outputs[0].token_ids for o in llm.generate(graph_requests, graph_params, use_tqdm=False)]
finally:
    runner.graphs = None
print(f"same tokens as the eager path: {graph_tokens == eager_tokens}")
print(f"decode steps through the static buffers: {graphs.stats.replays}, padding rows run: "
      f"{graphs.stats.padded_rows}, steps run eagerly (prefill): {graphs.stats.eager_steps}")

# %% [markdown]
# Replayed kernels still cost the device a little each, so fewer kernels still pay: `kernels.triton_ops.rms_norm`
# does the residual add and RMSNorm in one launch (`MINIVLLM_CUSTOM_OPS=none`, vLLM's switch, turns it off).
#
# > **How vLLM v1 does it differently.** vLLM pads a batch up to the next capture size too
# > (`cudagraph_capture_sizes`), but by default it captures *piecewise*: the model is compiled with
# > `torch.compile`, split at the attention calls, and the pieces between them are graphed while attention runs
# > eagerly, so one set of graphs also serves prefill and mixed batches; full graphs that include attention are
# > an option for backends that support them (`cudagraph_mode`). minivllm graphs whole decode steps only.

# %% [markdown]
# ### Exercise: pad a decode batch to its graph
#
# The heart of the replay path is `DecodeGraphs._fill`: a batch of n decodes goes to the graph of the smallest
# capture size that holds it, and rows n.. are padding. Write `pad_decode_batch(input_ids, positions,
# slot_mapping, seq_lens, block_tables, sizes)` on plain lists: return `(size, input_ids, positions,
# slot_mapping, seq_lens, block_tables)` with the padding rows as the list above says (token 0, position 0,
# slot -1, a context of 1, a table of block 0) and every table padded with block 0 to the widest one.
#
# The check runs hand-made batches, 100 random ones against the static buffers `DecodeGraphs` fills, and then
# the engine: its decode steps go through the static-buffer path with your padding, and the greedy tokens must
# be the eager path's.

# %%
from course import check, exercise


@exercise("11.pad_decode_batch")
def pad_decode_batch(input_ids, positions, slot_mapping, seq_lens, block_tables, sizes):
    # your code here
    raise NotImplementedError


check(pad_decode_batch)

# %%
# NBVAL_IGNORE_OUTPUT
import inspect

print(inspect.getsource(DecodeGraphs._fill))

# %% [markdown]
# ## 3. Async scheduling: the host's work behind the device's
#
# CUDA graphs take the launches out of the forward. What is left on the host is section 1's Python: plan,
# inputs, update, text. vLLM's answer is async scheduling (`--async-scheduling`, `LLM(async_scheduling=True)`):
# while batch N runs on the device, the host already plans and issues batch N + 1, and only then waits for N's
# tokens and applies them:
#
#     host:    [issue N] [plan N+1, issue N+1] [N's tokens -> host, update, text] [plan N+2, issue N+2] ...
#     device:  [forward N, sample N]           [forward N+1, sample N+1]          [forward N+2 ...]
#
# The catch: a request decoding in batch N needs, as batch N + 1's input, the very token N is sampling. So N is
# sampled on the device as it is issued, and N + 1's input for that request is read from N's sampled tokens on
# the device (`ModelInput.prev_token_rows`; the host writes a 0 there). The scheduler plans such a request
# without knowing its token: it starts after the tokens in flight, and counts the one being sampled as one more
# token to compute (vLLM calls it a placeholder). That plan is `plan_ahead` in
# `minivllm/core/async_scheduler.py`, and it is your exercise.
#
# Not every request may run ahead. One whose sampling reads its own output tokens (penalties, `bad_words`,
# `min_tokens`) or has a grammar would be sampled before the host knows its last token, so it waits for its
# batch; so does one that N's token would end by `max_tokens`. A request in flight is never preempted. A
# request that N's token stops (EOS, a stop string) has one wasted row in N + 1, dropped when it comes back.
#
# Left unset, vLLM turns it on wherever nothing in the configuration prevents it, and so does minivllm on CUDA
# with one rank and no speculative decoding (`EngineConfig.async_scheduling_on`). On a CPU minivllm leaves it
# off: the forward runs in the host's own thread, so there is nothing to hide the host's work behind.

# %% [markdown]
# ### Exercise: plan a request whose batch is in flight
#
# Write `plan_ahead(num_tokens, num_computed_tokens, num_in_flight)`: the request has `num_tokens` tokens
# (prompt and outputs the host knows), KV for `num_computed_tokens` of them, and `num_in_flight` tokens in a
# batch still on the device (0 when none). Return `(start, num_left)`: the position batch N + 1 starts at, and
# how many tokens the request has left to compute from there. If the batch in flight computes the whole
# sequence, it also samples the next token, and that token must be computed too.
#
# The check runs hand-made cases, 200 random ones against minivllm's own `plan_ahead`, then an async engine
# whose scheduler plans with your function: its greedy tokens must be the synchronous engine's.

# %%
@exercise("11.plan_ahead")
def plan_ahead(num_tokens, num_computed_tokens, num_in_flight):
    # your code here
    raise NotImplementedError


check(plan_ahead)

# %% [markdown]
# The same workload through an async engine, timed the same way, counting the decodes planned with a
# placeholder (their input token still "on the device").

# %%
async_llm = LLM(num_kv_blocks=256, seed=0, async_scheduling=True)
async_engine = async_llm.llm_engine
placeholders, schedule = [], async_engine.scheduler.schedule


def counting_schedule():
    out = schedule()
    placeholders.append(len(out.num_output_placeholders))
    return out


async_engine.scheduler.schedule = counting_schedule
async_spans, async_steps, async_traces, async_tokens = run_timed(async_llm)
print(f"same tokens as the synchronous engine: {async_tokens == sync_tokens}; "
      f"decodes planned with a placeholder: {sum(placeholders)}")
print(f"step function: synchronous {engine.step_fn.__name__}, async {async_engine.step_fn.__name__}")

# %% [markdown]
# The timeline, drawn as in section 1. Read the zoom's labels: between forward N and forward N + 1 the host now
# applies the tokens of N - 1, not N's: it plans, builds and issues N + 1 first, and applies N only after
# that. On a GPU the issue returns at once, and forward N + 1 runs on the device while the host applies N:
# the device no longer waits for the update and the text, only for the plan and the inputs.

# %%
# NBVAL_IGNORE_OUTPUT
draw_step_timeline(async_spans, "async scheduling")
async_ms = per_step_ms(async_spans)
hidden = async_ms["update core"] + async_ms["text"]
for name, ms in (("synchronous", sync_ms), ("async", async_ms)):
    print(f"{name:12} host {sum(ms[p] for p in HOST_PARTS):6.2f} ms, device {ms['forward'] + ms['sample']:7.2f} ms "
          f"per decode step")
print(f"on a device that runs the forward while the host works, async scheduling would hide the update and the "
      f"text ({hidden:.2f} ms of the host's {sum(async_ms[p] for p in HOST_PARTS):.2f} ms per step here)")

# %% [markdown]
# How it plugs in. The base `Scheduler.schedule()` (lesson 03) never mentions batches in flight: it calls a
# few small methods, and `AsyncScheduler` overrides exactly those (which requests may run, how many tokens are
# left, with your `plan_ahead`, where their blocks go, who may be preempted). The engine picks its scheduler
# and its step once, when it is built: `execute_step` or `step_with_batch_queue` (printed above).

# %%
from minivllm.core.async_scheduler import AsyncScheduler
from minivllm.core.scheduler import Scheduler

overrides = [n for n, v in vars(AsyncScheduler).items() if callable(v) and not n.startswith("__") and n in vars(Scheduler)]
print("AsyncScheduler overrides:", ", ".join(overrides))
print(f"schedulers: {type(engine.scheduler).__name__}, {type(async_engine.scheduler).__name__}")

# %% [markdown]
# > **How vLLM v1 does it differently.** vLLM's `AsyncScheduler` moves `num_computed_tokens` forward when it
# > schedules (minivllm moves it when the tokens come back, so that a failed step can roll back) and keeps
# > `num_output_placeholders` on the request; its GPU model runner keeps the last step's sampled token ids on the
# > device and scatters them into the next input ids. Its detokenization also runs in another process, the
# > front end, beside the engine core. Newer versions let speculative decoding and structured output run ahead
# > too; minivllm keeps those requests waiting.

# %% [markdown]
# ## 4. What a CPU forward is bound by: bytes or arithmetic
#
# With the host's share out of the way, a step costs its forward. A decode step reads every weight once and
# does `2 x batch` FLOPs per weight, plus attention over the batch's cached K and V. Whichever takes longer
# on this machine, moving the bytes at the memory's bandwidth or doing the arithmetic at the matmul rate, is
# the step's floor (lesson 10 counts both). Both rates are measured here, each the best of a few tries: a
# large `copy_` (read + written), and the engine's own linear layers (those of decoder layer 0, the kernels
# its forward runs) at 256 rows and at the decode batch.

# %%
# NBVAL_IGNORE_OUTPUT
cfg = engine.model_config
ITEMSIZE = engine.model_runner.dtype.itemsize                                       # 4: fp32


def engine_matmul_rate(rows, rounds=5, round_s=0.1):
    """FLOP/s of the engine's own qkv, o, gate/up and down projections (decoder layer 0) at `rows` rows: the
    best of a few short rounds, since a ceiling is what the machine can do when nothing else is running."""
    layer = engine.model_runner.model.layers[0]
    linears = [layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj]
    xs = [torch.randn(rows, i) for i, _ in roofline.linear_shapes(cfg)]             # (rows, in) each
    flops, best = 2 * rows * sum(i * o for i, o in roofline.linear_shapes(cfg)), 0.0
    with torch.inference_mode():
        [linear(x) for linear, x in zip(linears, xs)]                               # warm up
        for _ in range(rounds):
            reps, start = 0, time.perf_counter()
            while time.perf_counter() - start < round_s:
                [linear(x) for linear, x in zip(linears, xs)]
                reps += 1
            best = max(best, flops * reps / (time.perf_counter() - start))
    return best


bandwidth = max(roofline.measure_copy_bandwidth() for _ in range(3))               # bytes/s, the best of 3
rate, rate_batch = engine_matmul_rate(256), engine_matmul_rate(NUM_REQUESTS)       # FLOP/s
print(f"copy bandwidth {bandwidth / 1e9:.1f} GB/s; the engine's matmuls {rate / 1e9:.1f} GFLOP/s at 256 rows, "
      f"{rate_batch / 1e9:.1f} GFLOP/s at {NUM_REQUESTS} rows (fp32, one thread)")


# %%
def flops_and_bytes(sw):
    """The two terms of roofline.step_floor_s for one step (lesson 10): FLOPs, and bytes read."""
    flops = roofline.step_floor_s(cfg, ITEMSIZE, 1.0, float("inf"), sw.num_tokens, sw.attention_pairs,
                                  sw.num_sampled, sw.kv_tokens_read)       # FLOPs at 1 FLOP/s, bytes for free
    nbytes = roofline.weight_bytes(cfg, ITEMSIZE) + roofline.kv_bytes_per_token(cfg, ITEMSIZE) * sw.kv_tokens_read
    return flops, nbytes


decode_work = [roofline.step_work(t) for t in sync_traces if t.num_decode_tokens and not t.num_prefill_tokens]
prefill_work = roofline.step_work(sync_traces[0])
flops, nbytes = flops_and_bytes(decode_work[0])
print(f"a decode step of {decode_work[0].num_decode}: {flops / 1e9:.2f} GFLOP, {nbytes / 1e6:.0f} MB "
      f"-> {flops / nbytes:.1f} FLOP per byte")

# %%
# NBVAL_IGNORE_OUTPUT
forward_s = {b: t1 - t0 for part, b, t0, t1 in sync_spans if part == "forward"}      # batch -> forward seconds
decode_forward_s = sorted(forward_s[b] for b in range(2, 2 + len(decode_work)))[len(decode_work) // 2]
points = {f"decode steps (batch {decode_work[0].num_decode}), median forward": (
              flops / nbytes, flops / decode_forward_s, "s"),
          f"prefill step ({prefill_work.num_tokens} tokens)": (
              flops_and_bytes(prefill_work)[0] / flops_and_bytes(prefill_work)[1],
              flops_and_bytes(prefill_work)[0] / forward_s[1], "o")}
fig, ax = plt.subplots(figsize=(8, 4.2))
draw_roofline(ax, rate, bandwidth, points, extra_roofs=[(f"matmul rate at {NUM_REQUESTS} rows", rate_batch)],
              title="this machine's roofline, and the engine's steps under it (fp32, one thread)")
plt.tight_layout()
plt.show()
byte_ms, math_ms = nbytes / bandwidth * 1e3, flops / rate_batch * 1e3
bound = "the bytes" if byte_ms >= math_ms else "the arithmetic"
print(f"a decode step of {NUM_REQUESTS}: its bytes take {byte_ms:.1f} ms at the bandwidth, its FLOPs {math_ms:.1f} ms "
      f"at the {NUM_REQUESTS}-row matmul rate -> bound by {bound} here; its forward took "
      f"{decode_forward_s * 1e3:.1f} ms")
print(f"the ridge is at {rate / bandwidth:.1f} FLOP/byte: a decode step crosses it at a batch of about "
      f"{2 * rate / bandwidth:.0f} (fp32: about batch / 2 FLOP per byte of weights)")

# %% [markdown]
# How to read it: a point's distance below the roof is what better code could still win; its place along the
# x-axis is set by the batch and the dtype. Left of the ridge only fewer bytes help (bf16, int8 or int4
# weights: `quantization="int8"`); right of it only faster arithmetic does. A CPU core's ridge is low (the
# figure shows this one's), so a decode batch of a few dozen can sit right of it; a datacenter GPU's is in
# the hundreds, so there decode stays left of it and the race is to the bandwidth (lesson 06's kernels).
#
# When the arithmetic bounds the step, AVX-512 VNNI offers more of it: `vpdpbusd` multiplies 4 unsigned bytes
# by 4 signed bytes and adds them into a 32-bit lane, twice the multiply-adds of bf16's `vdpbf16ps` per
# instruction. To use it the activations must be integers too: `quantization="w8a8_int8"` rounds each row
# of x (one token) to int8 with its own scale s = max|x| / 127 as it reaches a layer (vLLM's W8A8 scheme
# with dynamic per-token scales). The sums of integer products are exact, and only the end rounds:
# y = s[r] scale[n] sum_k qx[r][k] q[n][k]. The kernel is `minivllm/platforms/cpu/quantization.py`'s
# (`kernels/cpu_gemm.cpp`, where the CPU has VNNI; `int8_matmul` elsewhere). Its rate on the same shapes,
# here:

# %%
# NBVAL_IGNORE_OUTPUT
from minivllm.platforms.cpu import quantization

w8a8_rate, w8a8_bytes = roofline.measure_quantized(cfg, "w8a8_int8", dtype=torch.float32,
                                                   batch_tokens=NUM_REQUESTS, min_time_s=0.5)
print(f"at {NUM_REQUESTS} rows: fp32 {rate_batch / 1e9:.1f} GFLOP/s, w8a8_int8 {w8a8_rate / 1e9:.1f} GFLOP/s "
      f"({'minivllm kernel' if quantization.own_w8a8_kernel() else 'int8_matmul'}); weights "
      f"{roofline.weight_bytes(cfg, ITEMSIZE) / 1e6:.0f} MB -> {w8a8_bytes / 1e6:.0f} MB")

# %% [markdown]
# ### Exercise: round each token's activations to int8
#
# Write `quantize_activations(x)`: x (rows, in), fp32 or bf16, to `(q, s)` with q (rows, in) int8 and s (rows,)
# fp32, such that x ~ s[:, None] * q, per row:
#
# - s = max|x[r]| / 127 in fp32, but never below 1e-12 (a row of zeros must not divide by zero);
# - q = x / s rounded to the nearest integer, ties to the even one (`torch.round`; C's `round` goes away from
#   zero).
#
# The check runs hand-made rows (ties, a row of zeros, two rows of different scales), 100 random matrices
# against minivllm's bytes, and then the engine: with `quantization="w8a8_int8"` on its PyTorch path
# (`int8_matmul`), every linear layer rounds x with your function, and the greedy tokens must be minivllm's.

# %%
@exercise("11.quantize_activations")
def quantize_activations(x):
    # your code here
    raise NotImplementedError


check(quantize_activations)

# %% [markdown]
# ## Check yourself

# %%
def self_check():
    # 1. every part of every step was timed, host and device
    assert set(s[0] for s in sync_spans) == set(STEP_PART_COLORS)
    assert all(t1 >= t0 for _, _, t0, t1 in sync_spans + async_spans)
    # 2. the CUDA graphs' static path: same tokens, and it ran (with padding)
    assert graph_tokens == eager_tokens and graphs.stats.replays > 0 and graphs.stats.padded_rows > 0
    assert capture_sizes(12) == [1, 2, 4, 8, 12] and num_ops > 0
    # 3. async scheduling: the same tokens, and decodes really ran ahead of their batch
    assert async_tokens == sync_tokens and sum(placeholders) > 0
    assert engine.step_fn.__name__ == "execute_step" and async_engine.step_fn.__name__ == "step_with_batch_queue"
    # 4. the roofline's terms are roofline.py's, and a decode step reads every weight
    sw = decode_work[0]
    assert abs(max(flops / rate, nbytes / bandwidth) - roofline.step_floor_s(
        cfg, ITEMSIZE, rate, bandwidth, sw.num_tokens, sw.attention_pairs, sw.num_sampled, sw.kv_tokens_read)) \
        <= 1e-9 * nbytes / bandwidth
    assert nbytes > roofline.weight_bytes(cfg, ITEMSIZE)
    q, s = quantize_activations(torch.tensor([[127.0, 2.5, -3.5], [1.0, 0.0, 0.5]]))
    assert q.tolist() == [[127, 2, -4], [127, 0, 64]] and s.shape == (2,)
    # the engines let go of every block
    for e in (engine, async_engine):
        assert e.kv_cache_manager.num_free_blocks == e.kv_cache_manager.num_blocks
    return "all checks passed"


self_check()

# %% [markdown]
# ## Where next
#
# On a GPU, `python -m minivllm.bench` prints how many decode steps were replayed from CUDA graphs; run it again
# with `--enforce-eager`, and with `--no-async-scheduling`, to measure what each is worth there. On a CPU,
# `--dtype bfloat16`, `--quantization int8` or `--quantization w8a8_int8` move section 4's points in whole runs.
