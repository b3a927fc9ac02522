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
# # Lesson 07: tensor parallelism
#
# A model whose weights do not fit on one device has to be cut up. vLLM's main answer is **tensor
# parallelism** (TP), as introduced by Megatron-LM: every weight matrix is split across N processes
# (*ranks*), each rank multiplies with its own slice, and the ranks combine their results with *collectives*
# (an all-reduce, an all-gather) at a few places in every layer. Each rank then holds 1/N of the weights
# and 1/N of the KV cache, and all ranks work on every token together.
#
# minivllm does it for real, on a CPU: gloo ranks in separate processes (NCCL on GPUs). Three modules,
# under `minivllm/`:
#
# ```
# model/layers.py        how each weight is split: ColumnParallelLinear, RowParallelLinear (+ all-reduce),
#                        QKVParallelLinear, MergedColumnParallelLinear, VocabParallelEmbedding, ParallelLMHead
# worker/distributed.py  the process group: which TP sizes a model allows, joining (gloo / NCCL), a free port
# worker/executor.py     the processes: rank 0 in the engine, N - 1 workers; pipes for control, gloo for tensors
# ```
#
# From a matrix to the engine: 1. a linear layer split by columns and by rows in plain PyTorch, paired the
# Megatron way, and the split written by you (the exercise); 2. minivllm's parallel layers on 3 real gloo ranks;
# 3. which heads, MLP features and vocabulary rows each rank of SmolLM2-135M holds, and its KV cache; 4. the
# engine with `tensor_parallel_size=3`. Lesson 08 cuts the model the other way, into pipeline stages.

# %%
import os

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")   # we fork after using a tokenizer; it would warn

import warnings

warnings.filterwarnings("ignore", message="IProgress not found")   # tqdm's notice when ipywidgets is absent

import inspect
import math
import multiprocessing as mp
import pickle
import textwrap
from contextlib import contextmanager

import matplotlib.pyplot as plt
import torch
import torch.distributed as dist
import torch.nn.functional as F
from matplotlib.patches import Rectangle

from minivllm import LLM, SamplingParams
from minivllm.model import layers
from minivllm.model.default_model import default_model_dir
from minivllm.worker.distributed import check_tp_size, destroy_distributed, get_open_port, init_distributed
from minivllm.model.layers import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear, TPGroup
from minivllm.model.llama import LlamaForCausalLM, ModelConfig

torch.manual_seed(0)
torch.set_num_threads(1)   # one thread: faster on a busy 2-core CPU, and the same float sums everywhere

RANK_COLORS = ["tab:blue", "tab:orange", "tab:green"]

# %% [markdown]
# ## 1. Splitting a linear layer, on one process
#
# `F.linear(x, W)` computes `y = x @ W.T`, with `W` stored as (out_features, in_features). Megatron names the
# two splits after the matrix `A = W.T` of `y = x @ A`:
#
# - **column parallel**: rank r holds some *columns* of `A` (rows of `W`: some output features). From the
#   whole `x` it computes its slice of `y`'s features. The slices side by side are `y`: a concatenation, and
#   no rank needs anything from another to compute its part.
# - **row parallel**: rank r holds some *rows* of `A` (columns of `W`: some input features) and the matching
#   slice of `x`. It computes a full-width `y`, but only a *partial sum*: the dot products over its own input
#   features. The sum of the partials is `y`. Summing across processes, leaving the total on every one, is
#   the **all-reduce**.
#
# Three "ranks", simulated with a loop:

# %%
TP = 3
x = torch.randn(4, 6)                  # (num_tokens, in_features)
W = torch.randn(9, 6)                  # (out_features, in_features)
y = F.linear(x, W)                     # (4, 9): the unsharded layer

# column parallel: rank r holds output features [3r, 3r + 3), rows of W
W_col = W.chunk(TP, dim=0)                                   # 3 x (3, 6)
y_col = [F.linear(x, w) for w in W_col]                      # 3 x (4, 3): each rank's slice of y
y_cat = torch.cat(y_col, dim=-1)                             # (4, 9)

# row parallel: rank r holds input features [2r, 2r + 2), columns of W, and the same slice of x
W_row = W.chunk(TP, dim=1)                                   # 3 x (9, 2)
x_row = x.chunk(TP, dim=1)                                   # 3 x (4, 2)
partials = [F.linear(xr, wr) for xr, wr in zip(x_row, W_row)]   # 3 x (4, 9): full shape, partial sums
y_sum = sum(partials)                                        # (4, 9): what the all-reduce computes

print("column parallel: shards", [tuple(w.shape) for w in W_col], "-> outputs", [tuple(t.shape) for t in y_col],
      "-> concatenated", tuple(y_cat.shape))
print("row parallel:    shards", [tuple(w.shape) for w in W_row], "-> outputs", [tuple(t.shape) for t in partials],
      "-> summed", tuple(y_sum.shape))
torch.testing.assert_close(y_cat, y)
torch.testing.assert_close(y_sum, y)

# %% [markdown]
# The picture, in `y = x @ A` form with each cell coloured by the rank that holds it (grey: every rank). In
# the column split every rank needs all of `x` and produces a third of `y`; in the row split every rank
# needs a third of `x` and produces a whole `y`-shaped partial, which must be summed.
#
# ![column parallel: x (all ranks) @ A cut by columns = y cut by columns; row parallel: x cut by columns @ A
# cut by rows = three full-size partial y's, summed](images/tp_column_row_split.png)
#
# ### The Megatron pairing: column, then row
#
# A transformer MLP is two linears with a nonlinearity between: `down(silu(up(x)))`. Split `up` by columns
# and `down` by rows, and rank r's *output* slice of `up` is exactly the *input* slice its `down` shard
# needs. `silu` works element by element, so each rank applies it to its own slice. Nothing crosses between
# ranks until the end: **one all-reduce for the whole MLP**.

# %%
W_up = torch.randn(12, 6)              # 6 -> 12, column parallel
W_down = torch.randn(6, 12)            # 12 -> 6, row parallel
mlp = F.linear(F.silu(F.linear(x, W_up)), W_down)                     # (4, 6): one process

mlp_partials = [F.linear(F.silu(F.linear(x, up_r)), down_r)           # rank r: (4, 4) hidden slice -> (4, 6)
                for up_r, down_r in zip(W_up.chunk(TP, dim=0), W_down.chunk(TP, dim=1))]
torch.testing.assert_close(sum(mlp_partials), mlp)                    # one all-reduce, at the very end

# The other order would not work: a nonlinearity must see the *summed* value, not the partials.
gap = (sum(F.silu(p) for p in partials) - F.silu(sum(partials))).abs().max().item()
print(f"silu of the sum vs sum of silus: they differ by up to {gap:.2f}")
assert len(mlp_partials) == TP and all(p.shape == mlp.shape for p in mlp_partials)
assert gap > 0.01                                        # silu does not distribute over a sum

# %% [markdown]
# That is why every `RowParallelLinear` in `model/layers.py` ends with its all-reduce: after a row split, the
# next thing is usually nonlinear (a norm, an activation), so the sum cannot wait. A Llama decoder layer is
# two such pairs:
#
# ```
# attention   qkv_proj (column: each rank gets whole heads)  ->  attention, head by head  ->  o_proj (row)    all-reduce
# MLP         gate_up_proj (column)                           ->  silu(gate) * up          ->  down_proj (row) all-reduce
# ```
#
# Attention heads are independent of each other, like `silu`'s elements, so attention needs no
# communication either, as long as every rank holds whole heads. Two all-reduces per layer, plus one for the
# embedding and an all-gather for the logits (section 3). Everything between them (norms, residual adds)
# runs on the full hidden state, replicated on every rank.

# %% [markdown]
# ### Exercise: a tensor-parallel linear layer
#
# Write the split once, for any TP size. `tp_linear(x, weight, tp_size, kind)` plays all `tp_size` ranks of one
# linear layer in a loop, `kind` being `"column"` or `"row"`, and returns `(shards, y)`:
#
# - `shards[r]`: rank r's block of `weight` (out_features, in_features). Cut it as minivllm does: `tp_size` equal,
#   contiguous blocks, rank r taking the r-th (column parallel: a block of rows of `weight`, the output
#   features; row parallel: a block of its columns, the input features).
# - `y`: (num_tokens, out_features), each rank's result combined the way the real layer combines them, which
#   must equal `F.linear(x, weight)`. In the row split, rank r also gets only its slice of `x`.
# - A `tp_size` that does not divide the dimension being split: raise `ValueError` (below: why).
#
# The check compares your shards with minivllm's own cut (`_shard` in `model/layers.py`) and `y` with the
# dense layer, for TP 1 to 4; then it cuts layer 0 of SmolLM2-135M for 3 ranks with your function and
# compares every shard with what minivllm's layers load on each rank, q/k/v heads included.

# %%
from course import check, exercise


@exercise("07.tp_linear")
def tp_linear(x, weight, tp_size, kind):
    """y = F.linear(x, weight) computed by tp_size simulated ranks. x: (num_tokens, in_features);
    weight: (out_features, in_features); kind: "column" or "row". Returns (shards, y)."""
    # your code here
    raise NotImplementedError


check(tp_linear)

# %% [markdown]
# Your function on this section's `x` (4, 6) and `W` (9, 6), three ranks:

# %%
for kind in ("column", "row"):
    shards, y_tp = tp_linear(x, W, TP, kind)
    print(f"{kind:>6} parallel: shards {[tuple(s.shape) for s in shards]} -> y {tuple(y_tp.shape)}")
    torch.testing.assert_close(y_tp, y)
    torch.testing.assert_close(shards[1], W[3:6] if kind == "column" else W[:, 2:4])

# %% [markdown]
# ### The real code: one cut, in each layer's `weight_loader`
#
# In minivllm no process sees all ranks: each layer knows its own rank (`TPGroup`) and, when the loader hands
# it a full checkpoint tensor, keeps its block. All of them cut with one helper:

# %%
print(inspect.getsource(layers._shard))
for cls in (ColumnParallelLinear, RowParallelLinear, QKVParallelLinear):
    print(f"# {cls.__name__}.weight_loader")
    print(textwrap.dedent(inspect.getsource(cls.weight_loader)))

# %% [markdown]
# Column parallel cuts dim 0, row parallel dim 1: your two kinds. (A row layer's bias is not split: every rank
# adds it once, after the all-reduce.) `QKVParallelLinear` cuts q, k and v each with `_shard` and stacks this
# rank's pieces, `[its q rows | its k rows | its v rows]`: contiguous blocks of head_dim rows are whole heads
# (section 3). `MergedColumnParallelLinear` (gate and up) does the same with two tensors. If the sizes did not
# divide, `size // tp` rows each would leave the last rows on no rank, silently, so `_shard` raises
# `ValueError`, as your `tp_linear` does; the engine checks earlier still (`check_tp_size`, section 3).

# %% [markdown]
# ## 2. Real ranks: an all-reduce across three processes
#
# Now three processes instead of a loop. `torch.distributed` connects them into a **process group** (backend
# **gloo** on CPUs, NCCL on GPUs) at a rendezvous address, `tcp://127.0.0.1:<port>`, with a free port from
# `get_open_port()`; `init_distributed` is what minivllm's own workers call. Each rank builds minivllm's layers
# with its `TPGroup(rank, size)`: a layer is constructed with the *full* sizes, allocates only its shard, and
# `weight_loader` cuts that shard out of the full tensor (in the engine a lazy safetensors slice, so a rank reads
# only its shard from disk). `RowParallelLinear` calls `dist.all_reduce` itself; `TPGroup.all_gather_last_dim`
# is the all-gather that `ParallelLMHead` uses. The function below is one rank's whole life, in a child process
# (`fork` copies this notebook's memory into it, so a function defined here runs as is).

# %%
def tp_rank(rank, world_size, port, x, W_up, W_down, results):
    """One rank: join the group, load its shards of the MLP, run it, send back what it computed."""
    torch.set_num_threads(1)
    init_distributed(rank, world_size, f"tcp://127.0.0.1:{port}", torch.device("cpu"))   # gloo
    try:
        tp = TPGroup(rank, world_size)
        up = ColumnParallelLinear(6, 12, bias=False, tp=tp)             # holds (12 / 3, 6)
        down = RowParallelLinear(12, 6, bias=False, tp=tp)              # holds (6, 12 / 3)
        up.weight_loader(up.weight, W_up)                               # rows [4r, 4r + 4) of W_up
        down.weight_loader(down.weight, W_down)                         # columns [4r, 4r + 4) of W_down
        with torch.no_grad():
            h = F.silu(up(x))                     # (4, 4): this rank's slice of the hidden features
            partial = F.linear(h, down.weight)    # (4, 6): its partial sum, before any communication
            y = down(h)                           # (4, 6): the same, all-reduced: equal on every rank
            gathered = tp.all_gather_last_dim(up(x))   # (4, 12): every rank's column slice, gathered
        # numpy, not tensors: torch would pass tensors through shared memory, tied to this process's life
        results.put((rank, {"up": up.weight.numpy(), "down": down.weight.numpy(), "partial": partial.numpy(),
                            "y": y.numpy(), "gathered": gathered.numpy()}))
    finally:
        destroy_distributed()


def run_ranks(world_size, *args):
    """Start world_size processes running tp_rank, collect what each sends back, join them all."""
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    port = get_open_port()
    procs = [ctx.Process(target=tp_rank, args=(rank, world_size, port, *args, results))
             for rank in range(world_size)]
    for p in procs:
        p.start()
    try:
        out = dict(results.get(timeout=120) for _ in procs)
    finally:
        for p in procs:                    # always join; stop a rank that hangs rather than orphan it
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
                p.join()
    return {rank: {k: torch.from_numpy(v) for k, v in d.items()} for rank, d in sorted(out.items())}, procs


ranks, procs = run_ranks(TP, x, W_up, W_down)
for rank, r in ranks.items():
    print(f"rank {rank}: up.weight {tuple(r['up'].shape)}, down.weight {tuple(r['down'].shape)}, "
          f"partial {tuple(r['partial'].shape)}, all-reduced {tuple(r['y'].shape)}, gathered {tuple(r['gathered'].shape)}")
print("exit codes:", [p.exitcode for p in procs], " still alive:", [p.is_alive() for p in procs])

# %% [markdown]
# The first row of each rank's partial sum, and of the all-reduced result, against the MLP computed in one
# process:

# %%
for r in range(TP):
    print(f"rank {r}'s partial: {[round(v, 3) for v in ranks[r]['partial'][0].tolist()]}")
print(f"all-reduced:      {[round(v, 3) for v in ranks[0]['y'][0].tolist()]}")
print(f"one process:      {[round(v, 3) for v in mlp[0].tolist()]}")
for r in range(TP):
    torch.testing.assert_close(ranks[r]["up"], W_up[4 * r:4 * r + 4])          # its rows of the column split
    torch.testing.assert_close(ranks[r]["down"], W_down[:, 4 * r:4 * r + 4])   # its columns of the row split
    torch.testing.assert_close(ranks[r]["y"], mlp)                             # all-reduce == one process
    torch.testing.assert_close(ranks[r]["gathered"], F.linear(x, W_up))        # all-gather == one process
    assert torch.equal(ranks[r]["y"], ranks[0]["y"])                           # bit-identical on every rank
torch.testing.assert_close(sum(ranks[r]["partial"] for r in range(TP)), mlp)
assert all(p.exitcode == 0 and not p.is_alive() for p in procs)

# %% [markdown]
# The partials look nothing like the answer, and their sum is the answer. Every rank ends up with *identical*
# bits, which matters: after the all-reduce every rank carries on from the same hidden state, so the ranks
# cannot drift apart over 30 layers.

# %% [markdown]
# ## 3. Who holds what: SmolLM2-135M on 3 ranks
#
# The default model has 9 query heads and 3 KV heads of 64 dimensions (grouped-query attention: every KV
# head serves 3 query heads), an MLP 1,536 wide and a vocabulary of 49,152. Under TP every one of those is
# split evenly. Which heads does a rank get? Ask the layer itself: load a fake q/k/v weight whose rows hold
# their own head number into `QKVParallelLinear` on each rank, and read back the numbers that landed there:

# %%
cfg = ModelConfig.from_dir(default_model_dir())


def heads_held(rank, tp_size):
    """(query heads, KV heads) that QKVParallelLinear's weight_loader gives `rank` of `tp_size`."""
    qkv = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads,
                            False, TPGroup(rank, tp_size))
    for shard_id, n in (("q", cfg.num_attention_heads), ("k", cfg.num_key_value_heads),
                        ("v", cfg.num_key_value_heads)):
        labels = torch.arange(n, dtype=torch.float32).repeat_interleave(cfg.head_dim)   # row -> its head number
        qkv.weight_loader(qkv.weight, labels[:, None].expand(-1, cfg.hidden_size), shard_id)
    q, k, v = qkv.weight[:, 0].split([qkv.num_heads * cfg.head_dim, qkv.num_kv_heads * cfg.head_dim,
                                      qkv.num_kv_heads * cfg.head_dim])
    return q.int().unique().tolist(), k.int().unique().tolist()


group = cfg.num_attention_heads // cfg.num_key_value_heads            # query heads per KV head
mlp_rows, vocab_rows = cfg.intermediate_size // TP, cfg.vocab_size // TP
held = {r: heads_held(r, TP) for r in range(TP)}
print(f"{'rank':>4}  {'query heads':>11}  {'KV heads':>8}  {'MLP features':>13}  {'vocabulary rows':>16}")
for r, (q_heads, kv_heads) in held.items():
    print(f"{r:>4}  {str(q_heads):>11}  {str(kv_heads):>8}  {f'{r * mlp_rows}-{(r + 1) * mlp_rows - 1}':>13}  "
          f"{f'{r * vocab_rows}-{(r + 1) * vocab_rows - 1}':>16}")
print(f"query head h reads KV head h // {group}:",
      {r: [h // group for h in q_heads] for r, (q_heads, _) in held.items()})

# %% [markdown]
# The split lines up with grouped-query attention: rank r's query heads 3r..3r+2 are exactly the ones that read
# KV head r, which is also on rank r. So attention runs entirely inside a rank.
#
# The vocabulary is split too. `VocabParallelEmbedding`: each rank looks up the token ids in its range, zeros
# for the others, and an all-reduce assembles the embeddings. `ParallelLMHead` (tied to the embedding here): each
# rank computes the logits of its 16,384 tokens, and an all-gather gives every rank the full row of 49,152.

# %%
# NBVAL_IGNORE_OUTPUT
fig, axes = plt.subplots(3, 1, figsize=(10, 4.2), gridspec_kw={"height_ratios": [1.6, 0.5, 0.5]})
ax = axes[0]
for h in range(cfg.num_attention_heads):                                 # query heads, top row
    r = next(r for r, (q, _) in held.items() if h in q)
    ax.add_patch(Rectangle((h, 1), 0.8, 0.6, color=RANK_COLORS[r]))
    ax.text(h + 0.4, 1.3, f"q{h}", ha="center", va="center", color="white", fontsize=9)
    ax.plot([h + 0.4, (h // group) * 3 + 1.4], [1, 0.6], color="grey", lw=0.8)   # to the KV head it reads
for kv in range(cfg.num_key_value_heads):                                # KV heads, bottom row, centred on their group
    r = next(r for r, (_, k) in held.items() if kv in k)
    ax.add_patch(Rectangle((kv * 3 + 1, 0), 0.8, 0.6, color=RANK_COLORS[r]))
    ax.text(kv * 3 + 1.4, 0.3, f"kv{kv}", ha="center", va="center", color="white", fontsize=9)
ax.set_xlim(-0.2, cfg.num_attention_heads)
ax.set_ylim(-0.1, 1.7)
ax.axis("off")
ax.set_title("attention heads (lines: the KV head each query head reads)", fontsize=10)
for ax, total, name in [(axes[1], cfg.intermediate_size, "MLP features (gate_up_proj rows, down_proj columns)"),
                        (axes[2], cfg.vocab_size, "vocabulary (embedding and LM head rows)")]:
    for r in range(TP):
        ax.barh(0, total / TP, left=r * total / TP, color=RANK_COLORS[r])
        ax.text((r + 0.5) * total / TP, 0, f"rank {r}: {r * total // TP}-{(r + 1) * total // TP - 1}",
                ha="center", va="center", color="white", fontsize=9)
    ax.set_xlim(0, total)
    ax.axis("off")
    ax.set_title(name, fontsize=10)
plt.tight_layout()
plt.show()

# %% [markdown]
# ### Each rank's share of the weights and of the KV cache
#
# Build the model's skeleton for one rank on PyTorch's `meta` device (shapes only, no memory, nothing read)
# and count its parameters. The RMSNorm weights are replicated on every rank; everything else is a third:

# %%
def num_params(tp_size, rank=0):
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, TPGroup(rank, tp_size))
    return sum(p.numel() for p in model.parameters())          # the tied embedding / LM head counted once


full, per_rank = num_params(1), num_params(TP)
replicated = (2 * cfg.num_hidden_layers + 1) * cfg.hidden_size  # two norms per layer and the final one
print(f"TP 1: {full:,} parameters ({full * 4 / 2**20:.0f} MiB in fp32)")
print(f"TP 3: {per_rank:,} per rank ({per_rank * 4 / 2**20:.0f} MiB), of which {replicated:,} replicated norm weights")

# %% [markdown]
# The KV cache follows the KV heads. Each rank allocates one tensor (`ModelRunner.allocate_kv_cache`):
#
# ```
# (2, num_layers, num_blocks, block_size, num_kv_heads / tp, head_dim)
#  K/V                                    this rank's KV heads
# ```
#
# Every rank has the *same* blocks (the same block ids and slots: the KV cache manager on rank 0 hands out
# block ids, and every rank writes token t of a request to the same slot), only for different heads. So a
# block costs each rank a third of what it costs a single process, and a memory budget per rank
# (`kv_cache_memory_gb` on a CPU, `gpu_memory_utilization` on a GPU) holds three times as many blocks: the
# second reason to use TP, after fitting the weights.

# %%
NUM_BLOCKS, BLOCK_SIZE, DTYPE_BYTES = 64, 16, 4          # the engine below: 64 blocks of 16 tokens, fp32 on a CPU


def kv_cache_shape(tp_size):        # (K/V, layers, blocks, block_size, this rank's KV heads, head_dim)
    return (2, cfg.num_hidden_layers, NUM_BLOCKS, BLOCK_SIZE, cfg.num_key_value_heads // tp_size, cfg.head_dim)


def bytes_per_block(tp_size):
    return math.prod(kv_cache_shape(tp_size)) // NUM_BLOCKS * DTYPE_BYTES


for tp_size in (1, TP):
    print(f"TP {tp_size}: KV cache per rank {kv_cache_shape(tp_size)}, {bytes_per_block(tp_size) // 1024} KiB "
          f"per block per rank, {NUM_BLOCKS * bytes_per_block(tp_size) / 2**20:.0f} MiB for {NUM_BLOCKS} blocks")

# %% [markdown]
# ### A TP size that does not divide
#
# Whole heads per rank means the TP size must divide the query heads, the KV heads, the vocabulary and the MLP
# width. For this model that leaves 1 and 3 (9 and 3 heads). The engine checks before it starts any process
# (`check_tp_size` in `worker/distributed.py`), and the error says which numbers failed and what would work:

# %%
try:
    LLM(tensor_parallel_size=2, num_kv_blocks=NUM_BLOCKS)
except ValueError as err:
    tp2_error = str(err)
    print("ValueError:", err)
print("child processes started:", mp.active_children())
assert all(held[r] == (list(range(3 * r, 3 * r + 3)), [r]) for r in range(TP))
assert all(h // group in kv for q, kv in held.values() for h in q)        # attention stays inside a rank
assert per_rank == (full - replicated) // TP + replicated
assert bytes_per_block(TP) * TP == bytes_per_block(1) == 720 * 1024
assert "sizes that work for this model: 1, 3" in tp2_error and not mp.active_children()
check_tp_size(cfg, 3)                                                      # no error

# %% [markdown]
# ## 4. The engine with `tensor_parallel_size=3`
#
# `LLM(tensor_parallel_size=3)` hands the ranks to a `MultiprocExecutor` (`worker/executor.py`). It starts 2
# worker processes (ranks 1 and 2, forked like ours in section 2) and makes this process rank 0, the *driver*.
# All three join one gloo group on a free port and load only their own shards; then each says how many KV
# blocks it can hold and all allocate the smallest answer. One step:
#
# ```
# driver (rank 0)                       worker 1                    worker 2
# scheduler -> prepare_inputs -> mi
# pipe.send(("execute_model", mi)) ---> pipe.recv()                 pipe.recv()
# execute_model(mi)                     execute_model(mi)           execute_model(mi)
#    all-reduce in every layer  <====>     all-reduce   <========>     all-reduce
#    all-gather of the logits   <====>     all-gather   <========>     all-gather
# sampler(logits) -> tokens             (drops its logits)          (drops its logits)
# ```
#
# Only rank 0 has a scheduler, a KV cache manager and a sampler. What it sends is a `ModelInput`
# (`worker/model_runner.py`): the step's flat batch as plain lists (token ids, positions, slots, block
# tables), pickled through a `multiprocessing` pipe. Control goes over pipes and tensors over gloo: a pipe can
# wait for hours while the engine is idle, where a collective would time out.
#
# First the reference, one process:

# %%
PROMPTS = ["The capital of France is", "Once upon a time, in a small village,",
           "def fibonacci(n):", "The three primary colors are"]
PARAMS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

tp1 = LLM(seed=0, num_kv_blocks=NUM_BLOCKS)
tp1_out = tp1.generate(PROMPTS, PARAMS, use_tqdm=False)
reference = [o.outputs[0].token_ids for o in tp1_out]
print("\n".join(f"{o.prompt!r:42} -> {o.outputs[0].text!r}" for o in tp1_out))

# %% [markdown]
# Now three ranks, with a small spy that records the `ModelInput`s the driver sends to its workers and counts
# the driver's collectives by wrapping `torch.distributed`'s functions.

# %%
@contextmanager
def spy(executor):
    """Record the ModelInputs the driver sends and count its all-reduces and all-gathers; undo on exit."""
    seen = {"sent": [], "all_reduce": 0, "all_gather": 0}
    real_send, real = executor._send_to_workers, {name: getattr(dist, name) for name in ("all_reduce", "all_gather")}

    def send(model_input):
        seen["sent"].append(model_input)
        real_send(model_input)

    def counting(name):
        def collective(*args, **kwargs):
            seen[name] += 1
            return real[name](*args, **kwargs)
        return collective

    executor._send_to_workers = send
    for name in real:
        setattr(dist, name, counting(name))
    try:
        yield seen
    finally:
        del executor._send_to_workers      # back to the class's method
        for name, fn in real.items():
            setattr(dist, name, fn)


with LLM(seed=0, num_kv_blocks=NUM_BLOCKS, tensor_parallel_size=TP) as tp3:
    engine = tp3.llm_engine
    worker_pids = engine.executor.worker_pids
    children_during = sorted(p.pid for p in mp.active_children())     # the workers are this process's children
    runner = engine.model_runner                      # rank 0's ModelRunner, in this process
    attn = runner.model.layers[0].self_attn
    driver_view = {"heads": (attn.num_heads, attn.num_kv_heads), "kv_cache": tuple(runner.kv_cache.shape),
                   "bytes_per_block": runner.bytes_per_block, "lm_head": tuple(runner.model.lm_head.weight.shape)}
    with spy(engine.executor) as seen:
        tp3_out = tp3.generate(PROMPTS, PARAMS, use_tqdm=False)
    num_steps = engine.num_steps

tp3_tokens = [o.outputs[0].token_ids for o in tp3_out]
print("worker processes while the engine ran:", len(worker_pids), " running:", children_during == sorted(worker_pids))
print("rank 0 holds: (query heads, KV heads) =", driver_view["heads"], " kv_cache", driver_view["kv_cache"],
      f" {driver_view['bytes_per_block'] // 1024} KiB per block", " lm_head", driver_view["lm_head"])
print("greedy tokens equal to TP 1:", tp3_tokens == reference)
print("after the with block, child processes:", mp.active_children())

# %% [markdown]
# The same tokens. Here three ranks share a few CPU cores and every layer waits twice for all of them: this run
# shows how TP works, not what it is for. On GPUs each rank reads a third of the weights with its own memory
# bandwidth, and pays in all-reduces, which is why TP stays within a machine's fast links; and first of all, TP
# runs a model that does not fit on one device.
#
# What crossed the pipes, and what crossed gloo:

# %%
last = seen["sent"][-1]
print(f"the last step's ModelInput ({len(pickle.dumps(last)):,} bytes pickled):", last)
per_step = 1 + 2 * cfg.num_hidden_layers
print(f"{num_steps} steps, {len(seen['sent'])} ModelInputs sent to each worker, "
      f"{seen['all_reduce']} all-reduces (= {num_steps} x {per_step}), {seen['all_gather']} all-gathers")
reduced = per_step * len(last.input_ids) * cfg.hidden_size * 4            # fp32 (num_tokens, hidden) each time
gathered = len(last.sample_rows) * cfg.vocab_size * 4                     # fp32 (num_sampling, vocab)
print(f"a decode step of {len(last.input_ids)} sequences: {per_step} all-reduces of ({len(last.input_ids)}, "
      f"{cfg.hidden_size}) = {reduced // 1024} KiB, one all-gather of ({len(last.sample_rows)}, {cfg.vocab_size}) "
      f"logits = {gathered // 1024} KiB")

# %% [markdown]
# Per step: one all-reduce for the embedding, two per layer (`o_proj`, `down_proj`), and one all-gather of the
# logits (counted on rank 0; every rank makes the same calls in the same order, or the collectives would hang).
# The control message is a few hundred bytes; the collectives carry over a MiB per decode step even for 4
# sequences, and it grows with the batch. Hence the two channels.
#
# Leaving the `with` block called `LLM.shutdown()`: the driver sent each worker `"shutdown"`, joined it, and
# left the process group. Workers also stop if the engine is garbage-collected, if a step fails, or if the
# driver dies (their pipe closes); `tests/test_tensor_parallel.py` checks each case for leftover processes.

# %%
assert tp3_tokens == reference
assert len(worker_pids) == TP - 1 and children_during == sorted(worker_pids) and not mp.active_children()
assert driver_view == {"heads": (3, 1), "kv_cache": kv_cache_shape(TP), "bytes_per_block": bytes_per_block(TP),
                       "lm_head": (cfg.vocab_size // TP, cfg.hidden_size)}
assert seen["all_reduce"] == num_steps * per_step and seen["all_gather"] == num_steps == len(seen["sent"])
assert not dist.is_initialized()                                   # the process group is gone too


# %% [markdown]
# > **How vLLM v1 does it differently.** The same Megatron cut (`vllm/model_executor/layers/linear.py`), with
# > more options: `ColumnParallelLinear(gather_output=True)`, `RowParallelLinear(reduce_results=False)` (the caller
# > all-reduces), a row-parallel bias added on rank 0 only, and a TP size larger than the number of KV heads, each
# > KV head then *replicated* on `tp_size / num_kv_heads` ranks, where minivllm refuses.
#
# ## Check yourself
#
# Column shards concatenate and row shards sum to the dense layer; real ranks all-reduce to the one-process answer,
# bit for bit; each rank holds 3 query heads and their KV head; TP 2 is refused; TP 3 gave TP 1's greedy tokens.

# %%
def self_check():
    torch.testing.assert_close(torch.cat([F.linear(x, w) for w in W.chunk(TP, 0)], -1), F.linear(x, W))
    torch.testing.assert_close(sum(F.linear(a, b) for a, b in zip(x.chunk(TP, 1), W.chunk(TP, 1))), F.linear(x, W))
    for r in range(TP):
        assert torch.equal(ranks[r]["y"], ranks[0]["y"]) and ranks[r]["up"].shape == (12 // TP, 6)
        q_heads, kv_heads = heads_held(r, TP)
        assert len(q_heads) == cfg.num_attention_heads // TP and {h // group for h in q_heads} == set(kv_heads)
    torch.testing.assert_close(ranks[0]["y"], mlp)
    assert bytes_per_block(TP) == bytes_per_block(1) // TP and "9 query heads" in tp2_error
    assert tp3_tokens == reference and not mp.active_children() and not dist.is_initialized()
    return "all checks passed"


self_check()

# %% [markdown]
# ## Where next
#
# Lesson 08 cuts the model into pipeline stages instead: layers, not matrices, and what crosses between them.
