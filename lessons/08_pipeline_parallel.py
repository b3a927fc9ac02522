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
# # Lesson 08: pipeline parallelism
#
# Lesson 07 cut every weight matrix across ranks (tensor parallelism, TP). **Pipeline parallelism** (PP) cuts
# the *stack* of layers instead. Stage 0 holds the first decoder layers, stage 1 the next ones, and so on; a
# token's hidden state goes through stage 0, is sent to stage 1, and so on to the last stage, which computes the
# logits. Each stage keeps the weights and the KV cache of its own layers only. `LLM(pipeline_parallel_size=2)`
# runs it; it combines with TP (`tensor_parallel_size=3, pipeline_parallel_size=2` is 6 ranks: a TP group of 3
# per stage). The modules, under `minivllm/`:
#
# ```
# worker/distributed.py    pp_layer_partition: which layers each stage holds
# model/llama.py           a stage's model: its layers, plus the embedding (first) or norm and LM head (last)
# worker/pipeline_stage.py _execute_stage: receive the hidden state, run the stage's layers, send it on
# worker/executor.py       the stage processes, and the batches in flight between them
# engine/llm_engine.py     step_with_batch_queue: several batches in the pipe at once
# ```
#
# The lesson: 1. which layers each stage holds (the exercise); 2. the engine on 2 stages: the same tokens, twice
# the KV blocks; 3. what crosses between ranks, PP against TP; 4. the pipeline bubble, drawn and then measured;
# 5. many machines with torchrun.

# %%
import os

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")   # the engine forks after using a tokenizer; it would warn

import warnings

warnings.filterwarnings("ignore", message="IProgress not found")   # tqdm's notice when ipywidgets is absent

import multiprocessing as mp
import time
from contextlib import contextmanager

import matplotlib.pyplot as plt
import torch
import torch.distributed as dist
from matplotlib.patches import Rectangle

from minivllm import LLM, SamplingParams
from minivllm.model.default_model import default_model_dir
from minivllm.model.layers import PPStage, TPGroup
from minivllm.model.llama import LlamaForCausalLM, ModelConfig
from minivllm.worker.distributed import pp_layer_partition

torch.manual_seed(0)
torch.set_num_threads(1)   # one thread: faster on a busy 2-core CPU, and the same float sums everywhere

cfg = ModelConfig.from_dir(default_model_dir())
PROMPTS = ["The capital of France is", "Once upon a time, in a small village,",
           "def fibonacci(n):", "The three primary colors are"]
DTYPE_BYTES = 4                                           # fp32 on a CPU
print(f"{cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, vocab {cfg.vocab_size}")

# %% [markdown]
# ## 1. Who holds which layers
#
# Every stage needs at least one layer, and the stages should be about equal, since a token waits for each in
# turn. When the layers do not divide, the *earlier* stages take one fewer, as vLLM does: the first stage also
# embeds and the last also runs the LM head, so the stages' work evens out a little.
#
# ### Exercise: the stages' layers
#
# `stage_layers(num_layers, pp_size)` returns one `(start, end)` per stage, stage s holding layers
# `start .. end - 1`: contiguous, in order, covering every layer; as even as possible, the earlier stages taking
# one fewer when they do not divide; and `ValueError` when `pp_size` is below 1 or above `num_layers`. `check`
# compares it with minivllm's `pp_layer_partition` on every size up to 64 layers and 8 stages, then builds
# SmolLM2-135M's stages from your bounds.

# %%
from course import check, exercise


@exercise("08.stage_layers")
def stage_layers(num_layers, pp_size):
    # your code here
    raise NotImplementedError


check(stage_layers)
print("SmolLM2-135M on 4 stages, by your function:", stage_layers(cfg.num_hidden_layers, 4))

# %% [markdown]
# minivllm's `pp_layer_partition` (`worker/distributed.py`) does the same, and also takes the counts from
# `VLLM_PP_LAYER_PARTITION="17,13"` (vLLM's variable) when it is set. Each stage's model skeleton, built on
# PyTorch's `meta` device (shapes only, no memory, nothing read), shows what else it holds:

# %%
def stage_skeleton(stage, pp_size):
    start, end = pp_layer_partition(cfg.num_hidden_layers, pp_size)[stage]
    with torch.device("meta"):
        return LlamaForCausalLM(cfg, TPGroup(), PPStage(stage, pp_size, start, end))


def stage_extras(model):
    return [name for name in ("embed_tokens", "norm", "lm_head") if hasattr(model, name)]


with torch.device("meta"):
    full = sum(p.numel() for p in LlamaForCausalLM(cfg, TPGroup()).parameters())   # one stage: the whole model
partitions = {pp: pp_layer_partition(cfg.num_hidden_layers, pp) for pp in (2, 3, 4)}
stage_params = {}
for pp, bounds in partitions.items():
    print(f"PP {pp}:")
    for stage, (start, end) in enumerate(bounds):
        model = stage_skeleton(stage, pp)
        stage_params[pp, stage] = sum(p.numel() for p in model.parameters())
        print(f"  stage {stage}: layers {start:>2}-{end - 1:>2} ({len(model.layers):>2} layers)"
              f"  + {', '.join(stage_extras(model)) or 'nothing else':26}  {stage_params[pp, stage] / 1e6:5.1f} M parameters")
print(f"PP 1: {full / 1e6:.1f} M parameters; PP 2 in all: {(stage_params[2, 0] + stage_params[2, 1]) / 1e6:.1f} M")

# %% [markdown]
# 30 layers divide by 2 and 3; for 4 stages the first two take 7 and the last two 8. The embedding lives on
# the first stage and the final norm and LM head on the last. This model *ties* its LM head to the embedding,
# so with one stage they are one tensor; with several, the last stage loads its own copy of the embedding as
# its head (`local_name` in `model/llama.py`), which is why PP 2 holds 28 M parameters more in all than PP 1.
# Unlike TP, any number of stages up to the number of layers works: nothing has to divide the heads.

# %%
assert partitions[2] == [(0, 15), (15, 30)] and partitions[3] == [(0, 10), (10, 20), (20, 30)]
assert [e - s for s, e in partitions[4]] == [7, 7, 8, 8] and partitions[4] == stage_layers(cfg.num_hidden_layers, 4)
assert stage_extras(stage_skeleton(0, 2)) == ["embed_tokens"] and stage_extras(stage_skeleton(1, 2)) == ["norm", "lm_head"]
assert stage_params[2, 0] + stage_params[2, 1] == full + cfg.vocab_size * cfg.hidden_size   # the head's own copy

# %% [markdown]
# ## 2. The engine with `pipeline_parallel_size=2`
#
# The same prompts, greedy, with one stage and with two, at the same KV memory budget per rank
# (`kv_cache_memory_gb`, and no `num_kv_blocks`, so each rank sizes its own pool). A small spy counts the
# point-to-point messages rank 0 sends and receives (`_execute_stage` in `worker/pipeline_stage.py`;
# sends are `isend`, non-blocking, for a reason the bubble section below explains):
#
# ```
# rank 0 (stage 0: embed, layers 0-14)  --hidden, residual-->  rank 1 (stage 1: layers 15-29, norm, LM head)
#        ^                                                                     |
#        +------------------------- logits (rows, vocab) -----------------------+
# ```

# %%
KV_GB = 0.05                                         # GiB of KV cache per rank
PP_PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

pp1 = LLM(seed=0, kv_cache_memory_gb=KV_GB)
pp1_tokens = [o.outputs[0].token_ids for o in pp1.generate(PROMPTS, PP_PARAMS, use_tqdm=False)]
pp1_blocks = [pp1.llm_engine.model_runner.kv_cache.shape[2]]           # one rank
pp1_layers = len(pp1.llm_engine.model_runner.model.layers)
del pp1


@contextmanager
def p2p_spy():
    """Record the shapes of the tensors rank 0 sends and receives point-to-point; undo on exit."""
    seen = {"isend": [], "recv": []}
    real = {name: getattr(dist, name) for name in seen}

    def recording(name):
        def p2p(tensor, *args, **kwargs):
            seen[name].append(tuple(tensor.shape))
            return real[name](tensor, *args, **kwargs)
        return p2p

    for name in real:
        setattr(dist, name, recording(name))
    try:
        yield seen
    finally:
        for name, fn in real.items():
            setattr(dist, name, fn)


with LLM(seed=0, kv_cache_memory_gb=KV_GB, pipeline_parallel_size=2) as pp2:
    engine = pp2.llm_engine
    pp2_blocks = engine.executor.num_kv_blocks_per_rank
    pp2_driver = {"layers": len(engine.model_runner.model.layers), "extras": stage_extras(engine.model_runner.model),
                  "kv_cache": tuple(engine.model_runner.kv_cache.shape)}
    with p2p_spy() as p2p:
        pp2_tokens = [o.outputs[0].token_ids for o in pp2.generate(PROMPTS, PP_PARAMS, use_tqdm=False)]
    pp2_batches = engine.executor._next_step_id              # batches sent into the pipe (they are numbered)

print("PP 1 greedy tokens == PP 2:", pp1_tokens == pp2_tokens)
print(f"rank 0 under PP 2 holds {pp2_driver['layers']} layers + {pp2_driver['extras']}, kv_cache {pp2_driver['kv_cache']}")
print(f"KV blocks at kv_cache_memory_gb={KV_GB}: PP 1 ({pp1_layers} layers) {pp1_blocks}, "
      f"PP 2 (per rank) {pp2_blocks}: {pp2_blocks[0] / pp1_blocks[0]:.2f}x")
print(f"{pp2_batches} batches; rank 0 sent {len(p2p['isend'])} tensors (hidden, residual per batch) and received "
      f"{len(p2p['recv'])} (the logits, or a one-number 'done' for a batch that samples nothing); the first "
      "batch's:", p2p["isend"][:2], p2p["recv"][:1])

# %% [markdown]
# The same tokens. Each stage's KV cache covers half the layers, so a block costs it half as much and the same
# budget holds twice the blocks (one fewer or more, from rounding down): PP, like TP, multiplies the KV cache
# by the number of ranks. The engine uses the smallest count, since every rank must have every block id.
#
# ## 3. What crosses between ranks, per step
#
# TP all-reduces (num_tokens, hidden) twice per layer, plus once for the embedding, and all-gathers the
# logits rows. PP sends (hidden, residual), each (num_tokens, hidden), once per *stage boundary*, and the last
# stage sends the logits rows to rank 0. The sizes, computed for this model (hidden 576, 30 layers, fp32)
# for a decode step of 32 requests and a prefill of one 512-token prompt (one row sampled):

# %%
def step_bytes(num_tokens, num_rows, tp=1, pp=1):
    """(bytes in hidden-state messages, in logits, number of messages) of one step: tensor sizes, fp32."""
    row = cfg.hidden_size * DTYPE_BYTES
    logits = num_rows * cfg.vocab_size * DTYPE_BYTES
    if tp > 1:
        n = 1 + 2 * cfg.num_hidden_layers                # embedding + (o_proj, down_proj) per layer
        return n * num_tokens * row, logits, n + 1
    n = 2 * (pp - 1)                                     # hidden and residual per boundary
    return n * num_tokens * row, logits, n + 1


traffic = {}
print(f"{'step':<24}{'parallelism':<12}{'messages':>9}{'hidden states':>15}{'logits':>11}{'total':>11}")
for step, (num_tokens, num_rows) in {"decode, 32 requests": (32, 32), "prefill, 512 tokens": (512, 1)}.items():
    for name, kw in {"TP 3": {"tp": 3}, "PP 2": {"pp": 2}, "PP 4": {"pp": 4}}.items():
        hidden_b, logits_b, msgs = traffic[step, name] = step_bytes(num_tokens, num_rows, **kw)
        print(f"{step:<24}{name:<12}{msgs:>9}{hidden_b / 2**20:>12.2f} MiB{logits_b / 2**20:>7.2f} MiB"
              f"{(hidden_b + logits_b) / 2**20:>7.2f} MiB")
ratio = {step: traffic[step, "TP 3"][0] / traffic[step, "PP 2"][0] for step, _ in traffic}
print("TP 3 / PP 2 hidden-state bytes:", {step: round(r, 1) for step, r in ratio.items()})

# %% [markdown]
# Counted as tensor sizes: a ring all-reduce moves about twice that per rank, so TP's real traffic is
# larger still. TP moves the hidden state 61 times per step, PP once per boundary (30x fewer bytes at PP 2),
# and every TP all-reduce is a point where all ranks wait for each other, 61 of them per step. PP's cost is
# elsewhere: a step has to pass through the stages one after another, so PP does not make a step faster; each
# rank just has fewer layers to store. The logits are the same for both, and for a 32-request decode step
# they outweigh the hidden states. Hence the usual rule, vLLM's too: **TP within a machine**, where NVLink
# makes its many all-reduces cheap and it cuts each step's time; **PP across machines**, where links are
# slower and a few messages per step is all they can afford (or when the TP size cannot divide the heads).
# Both: TP inside each node, PP between nodes.
#
# ## 4. The bubble: one batch in flight, or several
#
# With one batch in flight, stage 1 can only start once stage 0 is done, and stage 0 waits for the logits to
# come back before the next step can be scheduled: at any moment only one stage works. The schedule diagram
# below (an idealised picture; the measurement follows) shows 3 stages and 4 batches, one time unit per stage:
# on top, each batch passes all stages before the next starts; below, a new batch enters stage 0 as soon as
# the previous one moves on, so after a warm-up of PP - 1 units the pipe is full.

# %%
PP_STAGES, MICRO_BATCHES = 3, 4


def schedule(in_flight):
    """{(stage, batch): time slot} with one batch in flight, or one per stage (the pipe kept full)."""
    return {(s, b): (b * PP_STAGES + s if in_flight == 1 else b + s)
            for s in range(PP_STAGES) for b in range(MICRO_BATCHES)}


schedules = {"1 batch in flight": schedule(1), f"{PP_STAGES} batches in flight": schedule(PP_STAGES)}
idle = {}
for name, slots in schedules.items():
    span = max(slots.values()) + 1
    idle[name] = (span - MICRO_BATCHES) / span            # each stage is busy MICRO_BATCHES slots of span
    print(f"{name:<36} {span:>2} time units, each stage idle {idle[name]:.0%} of them")
print(f"one batch in flight: idle (PP - 1) / PP = {(PP_STAGES - 1) / PP_STAGES:.0%} for any number of batches; "
      f"full pipe: (PP - 1) / (batches + PP - 1), toward 0 as batches keep coming")

# %%
# NBVAL_IGNORE_OUTPUT
BATCH_COLORS = ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown"]
fig, axes = plt.subplots(2, 1, figsize=(12, 3.8), sharex=True)
for ax, (name, slots) in zip(axes, schedules.items()):
    for (s, b), t in slots.items():
        ax.add_patch(Rectangle((t, PP_STAGES - 1 - s - 0.35), 0.95, 0.7, facecolor=BATCH_COLORS[b], edgecolor="black", lw=0.5))
        ax.text(t + 0.475, PP_STAGES - 1 - s, f"batch {b}", ha="center", va="center", color="white", fontsize=8)
    ax.set_yticks(range(PP_STAGES), [f"stage {s}" for s in reversed(range(PP_STAGES))])
    ax.set_ylim(-0.6, PP_STAGES - 0.4)
    ax.set_title(f"{name}: each stage idle {idle[name]:.0%} of the time (white: the bubble)", fontsize=10)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
axes[1].set_xlim(0, max(schedules["1 batch in flight"].values()) + 1)
axes[1].set_xlabel("time (one unit = one stage's share of a step)")
fig.suptitle("schedule diagram (idealised): 3 stages x 4 batches", fontsize=11)
plt.tight_layout()
plt.show()

# %% [markdown]
# ### Measured
#
# minivllm does the second schedule, as vLLM v1 does with its *batch queue* (`LLMEngine.step` in
# `engine/llm_engine.py`): a step schedules and **issues** a new batch (rank 0 runs stage 0 and sends the
# hidden states on), and only when `max_concurrent_batches` batches (default: one per stage) are in flight does
# it wait for the oldest one's logits, sample them and update the requests. The scheduler never schedules a
# request whose batch is still in flight (its next token is not known yet), so the batches hold different
# requests, and each takes at most `ceil(requests / batches)` of them: otherwise the first batch would take
# every request and the second would find none.
#
# Two details make this work. Sends are non-blocking (`dist.isend`, waited for at the stage's next batch):
# rank 0 sends batch b + 1's hidden states while the last stage is about to send batch b's logits back, and two
# blocking sends facing each other would wait forever. And the last stage always answers, with a one-number
# "done" when a batch samples nothing, so "in flight" means "some stage still works on it".
#
# Each rank can note when it works on which batch (`executor.record_stage_times()`, then `stage_times()`: wall
# clock, one machine). 32 requests decode 24 tokens each, with one batch in flight and with two. The last stage
# also computes the LM head (576 x 49,152 weights), so for this measurement stage 0 takes two more layers
# (`VLLM_PP_LAYER_PARTITION="17,13"`) to even out the stages' work.

# %%
# NBVAL_IGNORE_OUTPUT
os.environ["VLLM_PP_LAYER_PARTITION"] = "17,13"
BUBBLE_PROMPTS = [f"{p} (take {i})" for i in range(32) for p in PROMPTS][:32]
BUBBLE_PARAMS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
measured = {}
for k in (1, 2):
    with LLM(seed=0, num_kv_blocks=256, pipeline_parallel_size=2, max_concurrent_batches=k) as llm:
        llm.generate(BUBBLE_PROMPTS[:2], SamplingParams(max_tokens=2), use_tqdm=False)          # warm up
        llm.llm_engine.executor.record_stage_times()
        start = time.perf_counter()
        outs = llm.generate(BUBBLE_PROMPTS, BUBBLE_PARAMS, use_tqdm=False)
        wall = time.perf_counter() - start
        times = llm.llm_engine.executor.stage_times()
    t0 = min(s for spans in times.values() for _, s, _ in spans)
    measured[k] = {"wall": wall, "tokens": [o.outputs[0].token_ids for o in outs],
                   "spans": {rank: [(b, s - t0, e - t0) for b, s, e in spans] for rank, spans in times.items()},
                   "busy": {rank: sum(e - s for _, s, e in spans) / wall for rank, spans in times.items()}}
del os.environ["VLLM_PP_LAYER_PARTITION"]
for k, m in measured.items():
    n_tokens = sum(len(t) for t in m["tokens"])
    print(f"{k} batch(es) in flight: {n_tokens / m['wall']:5.1f} tokens/s, {len(m['spans'][0])} batches; busy: "
          + ", ".join(f"rank {r} {b:.0%}" for r, b in m["busy"].items()))
gain = measured[1]["wall"] / measured[2]["wall"]
print(f"on this machine, this run: two batches in flight gave {gain:.2f}x the throughput of one "
      f"({'faster' if gain > 1 else 'not faster'}), rank 0 busy {measured[2]['busy'][0]:.0%} of the time instead of "
      f"{measured[1]['busy'][0]:.0%}; greedy tokens identical:", measured[1]["tokens"] == measured[2]["tokens"])

# %%
# NBVAL_IGNORE_OUTPUT
fig, axes = plt.subplots(2, 1, figsize=(12, 3.6), sharex=True)
for ax, (k, m) in zip(axes, measured.items()):
    spans = m["spans"]
    mid = spans[0][len(spans[0]) // 2][1]                      # a window in the steady middle of the run
    for rank, rank_spans in spans.items():
        for b, s, e in rank_spans:
            if mid <= s <= mid + 0.8:
                ax.add_patch(Rectangle((s - mid, 1 - rank - 0.35), e - s, 0.7, facecolor=BATCH_COLORS[b % 6],
                                       edgecolor="black", lw=0.5))
                ax.text((s + e) / 2 - mid, 1 - rank, str(b), ha="center", va="center", color="white", fontsize=8)
    ax.set_yticks([0, 1], ["stage 1 (rank 1)", "stage 0 (rank 0)"])
    ax.set_ylim(-0.6, 1.6)
    ax.set_title(f"measured, {k} batch(es) in flight: rank 0 busy {m['busy'][0]:.0%}, rank 1 busy {m['busy'][1]:.0%} "
                 "of the run (white: idle)", fontsize=10)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
axes[1].set_xlim(0, 0.8)
axes[1].set_xlabel("seconds (0.8 s from the middle of each run); the number is the batch")
plt.tight_layout()
plt.show()

# %% [markdown]
# On top, one batch in flight: a batch goes through stage 0, then stage 1, and each rank waits for the other
# (the gaps are the bubble, plus rank 0's own work between batches: sampling, scheduling, detokenizing). Below,
# two in flight: while rank 1 runs batch b, rank 0 can already run batch b + 1. How much of the bubble that
# fills depends on the machine (the line above the figure says what it did here: on a CPU the two ranks share
# its cores and its memory bandwidth, on GPUs each stage has its own). It needs enough concurrent requests to
# fill the batches: with one request there is one batch, and the bubble returns.

# %%
assert pp1_tokens == pp2_tokens and pp2_driver["layers"] == 15 and pp2_driver["kv_cache"][1] == 15
assert all(2 * pp1_blocks[0] <= n <= 2 * pp1_blocks[0] + 1 for n in pp2_blocks)
assert len(p2p["isend"]) == 2 * pp2_batches and len(p2p["recv"]) == pp2_batches
assert ratio["decode, 32 requests"] == (1 + 2 * cfg.num_hidden_layers) / 2
assert abs(idle["1 batch in flight"] - (PP_STAGES - 1) / PP_STAGES) < 1e-12
assert measured[1]["tokens"] == measured[2]["tokens"]
assert not mp.active_children() and not dist.is_initialized()

# %% [markdown]
# ## 5. Across machines: torchrun
#
# The stage processes above are children of the engine, so they live on its machine. For GPUs on several
# machines, minivllm does what vLLM does: let PyTorch's launcher start the ranks. The usual layout is TP inside a
# machine and PP between machines:
#
# ```bash
# # two machines x 2 GPUs: TP 2 inside each machine, PP 2 across; run on each with its own --node-rank
# torchrun --nnodes 2 --nproc-per-node 2 --node-rank 0 --master-addr HOST_OF_RANK_0 --master-port 29500 \
#     -m minivllm.generate --tensor-parallel-size 2 --pipeline-parallel-size 2 --model /models/Llama-3.1-8B "Hello"
# ```
#
# torchrun starts every rank itself and gives each one `RANK`, `WORLD_SIZE`, `MASTER_ADDR` and `MASTER_PORT`
# in its environment. The engine notices them and uses `ExternalLauncherExecutor`: there is no driver and no
# pipe, because **every rank runs the whole engine in lockstep**. Each tokenizes the same prompts, schedules
# the same batch, runs its part of the model, receives the same logits (broadcast from the last stage) and
# samples the same token with the same seed, so they never disagree about what comes next. Only rank 0 prints.
# (`tests/test_tensor_parallel.py` and `tests/test_pipeline_parallel.py` run it and compare with one process.)
#
# > **How vLLM v1 does it differently.** The same split and the same batch queue (`step_with_batch_queue` in
# > `vllm/v1/engine/core.py`, `max_concurrent_batches` from the executor). Its stages exchange
# > `IntermediateTensors` (hidden states and residual) through `get_pp_group()` (`vllm/distributed/parallel_state.py`),
# > with NCCL on GPUs, and the multi-node launcher is usually Ray (`--distributed-executor-backend ray`).

# %% [markdown]
# ## Check yourself
#
# Run this cell. It re-checks the lesson's claims: the stages split the 30 layers evenly and contiguously; PP 2
# produced PP 1's greedy tokens with twice the KV blocks per rank and sends the hidden state far less often than
# TP; one batch in flight leaves each of 3 stages idle two thirds of the time; two batches in flight gave the
# same tokens as one, and left no process behind.

# %%
def self_check():
    for pp, bounds in partitions.items():
        assert bounds[0][0] == 0 and bounds[-1][1] == cfg.num_hidden_layers and len(bounds) == pp
        assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))                # contiguous, no gaps
        assert max(e - s for s, e in bounds) - min(e - s for s, e in bounds) <= 1   # as even as possible
        assert bounds == stage_layers(cfg.num_hidden_layers, pp)
    assert pp1_tokens == pp2_tokens and len(pp2_tokens) == len(PROMPTS)
    assert min(pp2_blocks) >= 2 * pp1_blocks[0]
    assert all(traffic[step, "PP 2"][0] < traffic[step, "TP 3"][0] for step, _ in traffic)
    assert idle[f"{PP_STAGES} batches in flight"] < idle["1 batch in flight"]
    assert abs(idle["1 batch in flight"] - 2 / 3) < 1e-12
    assert measured[1]["tokens"] == measured[2]["tokens"]
    assert not mp.active_children() and not dist.is_initialized()
    return "all checks passed"


self_check()

# %% [markdown]
# ## Where next
#
# Lessons 00-08 drove the engine from a notebook. Lesson 09 puts it behind a server: an async engine that
# streams tokens to many clients at once, and an OpenAI-compatible API.
