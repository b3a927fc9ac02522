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
# # Lesson 07: tensor and pipeline parallelism
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
# The lesson goes from a matrix to the engine:
#
# 1. split a linear layer by columns and by rows in plain PyTorch, and pair them the Megatron way; then write
#    the split yourself, as minivllm's layers cut their weights (the exercise),
# 2. run minivllm's parallel layers on 3 real gloo ranks and check the all-reduce against one process,
# 3. see which heads, MLP features and vocabulary rows each rank of SmolLM2-135M holds, and its KV cache,
# 4. run the engine with `tensor_parallel_size=3`: the same greedy tokens as one rank,
# 5. pipeline parallelism: layers split into stages, what crosses between them, and the pipeline bubble.

# %%
import os

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")   # we fork after using a tokenizer; it would warn

import warnings

warnings.filterwarnings("ignore", message="IProgress not found")   # tqdm's notice when ipywidgets is absent

import inspect
import multiprocessing as mp
import pickle
import textwrap
import time
from contextlib import contextmanager

import matplotlib.pyplot as plt
import torch
import torch.distributed as dist
import torch.nn.functional as F
from matplotlib.lines import Line2D
from matplotlib.patches import Patch, Rectangle

from minivllm import LLM, SamplingParams
from minivllm.model import layers
from minivllm.model.default_model import default_model_dir
from minivllm.worker.distributed import (check_tp_size, destroy_distributed, get_open_port, init_distributed,
                                         pp_layer_partition)
from minivllm.model.layers import ColumnParallelLinear, PPStage, QKVParallelLinear, RowParallelLinear, TPGroup
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

# %%
# NBVAL_IGNORE_OUTPUT
def draw_matrix(ax, left, owner, label, rows, cols, cell=0.3, dy=0.0):
    """A rows x cols matrix as a grid of cells; owner(i, j) is the rank holding cell (i, j), None for all."""
    for i in range(rows):
        for j in range(cols):
            o = owner(i, j)
            ax.add_patch(Rectangle((left + j * cell, dy + (rows - 1 - i) * cell), cell, cell, edgecolor="white",
                                   facecolor="#bbbbbb" if o is None else RANK_COLORS[o]))
    ax.text(left + cols * cell / 2, -0.75, label, ha="center", va="top", fontsize=9)
    return left + cols * cell


def draw_product(ax, title, x_owner, a_owner, y_owners, y_label):
    right = draw_matrix(ax, 0, x_owner, "x (4, 6)", 4, 6)
    ax.text(right + 0.25, 0.6, "@", fontsize=14, va="center", ha="center")
    right = draw_matrix(ax, right + 0.5, a_owner, "A = W.T (6, 9)", 6, 9, dy=-0.6)
    ax.text(right + 0.25, 0.6, "=", fontsize=14, va="center", ha="center")
    left = right + 0.5
    for k, owner in enumerate(y_owners):                   # several y's: the stacked partial sums
        draw_matrix(ax, left + 0.15 * k, owner, y_label if k == 0 else "", 4, 9, dy=0.15 * k)
    ax.set_title(title, fontsize=10)
    ax.set_xlim(-0.2, left + 3.2)
    ax.set_ylim(-1.2, 1.9)
    ax.set_aspect("equal")
    ax.axis("off")


fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 2.6))
draw_product(ax1, "column parallel: each rank computes its columns of y",
             lambda i, j: None, lambda i, j: j // 3, [lambda i, j: j // 3], "y (4, 9): concatenated")
draw_product(ax2, "row parallel: each rank computes a partial y; all-reduce sums them",
             lambda i, j: j // 2, lambda i, j: i // 2, [lambda i, j, r=r: r for r in range(TP)],
             "3 partial y's: summed")
fig.legend(handles=[Patch(color=c, label=f"rank {r}") for r, c in enumerate(RANK_COLORS)]
           + [Patch(color="#bbbbbb", label="every rank")], loc="lower center", ncol=4, fontsize=8, frameon=False)
plt.tight_layout(rect=(0, 0.08, 1, 1))
plt.show()

# %% [markdown]
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

# %%
assert len(mlp_partials) == TP and all(p.shape == mlp.shape for p in mlp_partials)
assert gap > 0.01                                        # silu does not distribute over a sum

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
# Column parallel cuts dim 0, row parallel dim 1: your two kinds. (The row layer's `param.dim() == 2` test is
# for a bias, which is not split: every rank adds the whole bias once, after the all-reduce.) `QKVParallelLinear`
# is a column-parallel layer over three checkpoint tensors: it cuts q, k and v each with `_shard` and stacks this
# rank's pieces, `[its q rows | its k rows | its v rows]`. Contiguous blocks of head_dim rows are whole heads,
# and with grouped-query attention rank r's query heads are the ones that read rank r's KV head (section 3 shows
# it on the real model). `MergedColumnParallelLinear` (gate and up) does the same with two tensors.
#
# `_shard` takes `size // tp` rows per rank. If they did not divide, `size // tp` rows each would leave the last
# rows on no rank, silently, so it refuses instead:

# %%
even = [layers._shard(torch.arange(12), 0, r, 3).tolist() for r in range(3)]
print("12 rows on 3 ranks:", even)
try:
    layers._shard(torch.arange(10), 0, 0, 3)
except ValueError as e:
    print("10 rows on 3 ranks: ValueError:", e)
assert even == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]

# %% [markdown]
# The engine checks earlier still, before it loads anything: `check_tp_size` (`worker/distributed.py`, section 3)
# refuses a TP size that does not divide the heads, the MLP width or the vocabulary, with the sizes that would
# work, and your `tp_linear` refuses the same way.
#
# > **How vLLM v1 does it differently.** The same Megatron cut, in `vllm/model_executor/layers/linear.py`: each
# > layer's `weight_loader` narrows the checkpoint tensor to `tp_rank * shard_size` onward, and the sizes per
# > rank come from `divide()` (`vllm/distributed/utils.py`), which insists that they divide. The layers have
# > more options: `ColumnParallelLinear(gather_output=True)` all-gathers its output, `RowParallelLinear` can cut
# > its own input (`input_is_parallel=False`) or leave the all-reduce to its caller (`reduce_results=False`), and
# > a row-parallel bias is added on rank 0 only, before the all-reduce. `QKVParallelLinear` also accepts a TP
# > size larger than the number of KV heads: each KV head is then *replicated* on `tp_size / num_kv_heads` ranks
# > (`num_kv_head_replicas`), where minivllm refuses. Quantized checkpoints load through `weight_loader_v2` and the
# > parameter classes of `vllm/model_executor/parameter.py`, which also know how packed int4 weights are cut.

# %% [markdown]
# ## 2. Real ranks: an all-reduce across three processes
#
# Now three processes instead of a loop. `torch.distributed` connects them into a **process group**; the
# backend is **gloo** on CPUs (NCCL on GPUs). They meet at a rendezvous address, `tcp://127.0.0.1:<port>`;
# `get_open_port()` asks the OS for a free port, so two groups on one machine never collide.
# `init_distributed` is what minivllm's own workers call.
#
# Each rank builds minivllm's layers with its `TPGroup(rank, size)`. A layer is constructed with the *full*
# sizes and allocates only its shard; `weight_loader` cuts that shard out of the full tensor (in the engine
# the full tensor is a lazy safetensors slice, so a rank reads only its shard from disk). `RowParallelLinear`
# calls `dist.all_reduce` itself; `TPGroup.all_gather_last_dim` is the all-gather that `ParallelLMHead` uses.
#
# The function below is one rank's whole life. It runs in a child process: the `fork` start method copies
# this notebook's memory into each child, so a function defined here runs as is (with `spawn`, the default
# on Windows and macOS, it would have to live in an importable module).

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

# %%
# NBVAL_IGNORE_OUTPUT
print("this notebook:", os.getpid(), " the ranks were:", [p.pid for p in procs], " port:", get_open_port())

# %% [markdown]
# Each rank's three numbers before the all-reduce, and after (the same on every rank), against the MLP
# computed in one process:

# %%
# NBVAL_IGNORE_OUTPUT
fig, axes = plt.subplots(1, 5, figsize=(12, 2.2))
panels = [(f"rank {r}: partial", ranks[r]["partial"]) for r in range(TP)]
panels += [("all-reduced (any rank)", ranks[0]["y"]), ("one process", mlp)]
vmax = max(p.abs().max().item() for _, p in panels)
for ax, (title, m), op in zip(axes, panels, ["+", "+", "=", "==", ""]):
    ax.imshow(m, cmap="RdBu", vmin=-vmax, vmax=vmax)
    ax.set_title(title, fontsize=9)
    ax.set_xticks([])
    ax.set_yticks([])
    ax.text(1.12, 0.5, op, transform=ax.transAxes, fontsize=14, ha="center", va="center")
plt.tight_layout()
plt.show()

# %% [markdown]
# The partials look nothing like the answer, and their sum is the answer. Every rank ends up with *identical*
# bits, which matters: after the all-reduce every rank carries on from the same hidden state, so the ranks
# cannot drift apart over 30 layers.

# %%
for r in range(TP):
    torch.testing.assert_close(ranks[r]["up"], W_up[4 * r:4 * r + 4])          # its rows of the column split
    torch.testing.assert_close(ranks[r]["down"], W_down[:, 4 * r:4 * r + 4])   # its columns of the row split
    torch.testing.assert_close(ranks[r]["y"], mlp)                             # all-reduce == one process
    torch.testing.assert_close(ranks[r]["gathered"], F.linear(x, W_up))        # all-gather == one process
    assert torch.equal(ranks[r]["y"], ranks[0]["y"])                           # bit-identical on every rank
torch.testing.assert_close(sum(ranks[r]["partial"] for r in range(TP)), mlp)
assert all(p.exitcode == 0 and not p.is_alive() for p in procs)

# %% [markdown]
# ## 3. Who holds what: SmolLM2-135M on 3 ranks
#
# The default model has 9 query heads and 3 KV heads of 64 dimensions (grouped-query attention: every KV
# head serves 3 query heads), an MLP 1,536 wide and a vocabulary of 49,152. Under TP every one of those is
# split evenly:

# %%
cfg = ModelConfig.from_dir(default_model_dir())
print(f"{cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, {cfg.num_attention_heads} query heads, "
      f"{cfg.num_key_value_heads} KV heads, head_dim {cfg.head_dim}, intermediate {cfg.intermediate_size}, "
      f"vocab {cfg.vocab_size}, {cfg.torch_dtype}")

# %% [markdown]
# Which heads does a rank get? Ask the layer itself. Load a fake q/k/v weight whose rows hold their own head
# number into `QKVParallelLinear` on each rank, and read back the numbers that landed there:

# %%
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
# KV head r, which is also on rank r. So attention runs entirely inside a rank. (vLLM also handles TP larger
# than the number of KV heads by *replicating* KV heads; minivllm requires the KV heads to divide evenly.)
#
# The vocabulary is split too. `VocabParallelEmbedding`: each rank looks up only the token ids in its range
# and contributes zeros for the others, and an all-reduce assembles the embeddings. `ParallelLMHead` (tied to
# the embedding in this model): each rank computes the logits of its 16,384 tokens, and an all-gather gives
# every rank the full row of 49,152, which rank 0 samples from.

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


def kv_cache_shape(tp_size):
    return (2, cfg.num_hidden_layers, NUM_BLOCKS, BLOCK_SIZE, cfg.num_key_value_heads // tp_size, cfg.head_dim)


def bytes_per_block(tp_size):
    _, layers, _, block_size, kv_heads, head_dim = kv_cache_shape(tp_size)
    return 2 * layers * block_size * kv_heads * head_dim * DTYPE_BYTES


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

# %%
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

t0 = time.perf_counter()
tp1 = LLM(seed=0, num_kv_blocks=NUM_BLOCKS)
t1 = time.perf_counter()
tp1_out = tp1.generate(PROMPTS, PARAMS, use_tqdm=False)
times = {"TP 1": (t1 - t0, time.perf_counter() - t1)}
reference = [o.outputs[0].token_ids for o in tp1_out]
for o in tp1_out:
    print(f"{o.prompt!r:42} -> {o.outputs[0].text!r}")

# %% [markdown]
# Now three ranks. Two small spies show what happens inside: one records the `ModelInput`s the driver sends
# to its workers, the other counts the driver's collectives by wrapping `torch.distributed`'s functions
# (the workers make the same calls; they have to, or the collectives would never complete).

# %%
def alive(pid):
    try:
        os.kill(pid, 0)                    # signal 0: only asks whether the process exists
        return True
    except ProcessLookupError:
        return False


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


t0 = time.perf_counter()
with LLM(seed=0, num_kv_blocks=NUM_BLOCKS, tensor_parallel_size=TP) as tp3:
    t1 = time.perf_counter()
    engine = tp3.llm_engine
    worker_pids = engine.executor.worker_pids
    alive_during = [alive(pid) for pid in worker_pids]
    runner = engine.model_runner                      # rank 0's ModelRunner, in this process
    attn = runner.model.layers[0].self_attn
    driver_view = {"heads": (attn.num_heads, attn.num_kv_heads), "kv_cache": tuple(runner.kv_cache.shape),
                   "bytes_per_block": runner.bytes_per_block, "lm_head": tuple(runner.model.lm_head.weight.shape)}
    with spy(engine.executor) as seen:
        tp3_out = tp3.generate(PROMPTS, PARAMS, use_tqdm=False)
    times["TP 3"] = (t1 - t0, time.perf_counter() - t1)
    num_steps = engine.num_steps
alive_after = [alive(pid) for pid in worker_pids]

tp3_tokens = [o.outputs[0].token_ids for o in tp3_out]
print("worker processes while the engine ran:", len(worker_pids), "alive:", alive_during)
print("rank 0 holds: (query heads, KV heads) =", driver_view["heads"], " kv_cache", driver_view["kv_cache"],
      f" {driver_view['bytes_per_block'] // 1024} KiB per block", " lm_head", driver_view["lm_head"])
print("greedy tokens equal to TP 1:", tp3_tokens == reference)
print("after the with block, workers alive:", alive_after, " children:", mp.active_children())

# %%
# NBVAL_IGNORE_OUTPUT
print("worker pids:", worker_pids)
for name, (start, gen) in times.items():
    print(f"{name}: start {start:.1f} s, generate {gen:.1f} s "
          f"({len(PROMPTS) * PARAMS.max_tokens / gen:.0f} tokens/s)")

# %% [markdown]
# Same tokens, and slower. That is expected here: this machine has 2 CPU cores for 3 ranks, and every layer
# waits twice for all of them to meet. On real hardware each rank has its own GPU with its own memory
# bandwidth, and TP wins because a decode step is memory-bound: each GPU reads a third of the weights. Even
# there the all-reduces cost time, which is why TP stays within a machine's fast links where it can. On a CPU,
# as here, it is for learning how it works; its real purpose is running a model that does not fit on one
# device.
#
# What crossed the pipes, and what crossed gloo:

# %%
first, last = seen["sent"][0], seen["sent"][-1]
for name, mi in [("first step (prefill)", first), ("last step (decode)", last)]:
    print(f"{name}: {len(mi.input_ids)} tokens, pickled ModelInput {len(pickle.dumps(mi)):,} bytes")
print("the last step's ModelInput:", last)
per_step = 1 + 2 * cfg.num_hidden_layers
print(f"{num_steps} steps, {len(seen['sent'])} ModelInputs sent to each worker, "
      f"{seen['all_reduce']} all-reduces (= {num_steps} x {per_step}), {seen['all_gather']} all-gathers")
reduced = per_step * len(last.input_ids) * cfg.hidden_size * 4            # fp32 (num_tokens, hidden) each time
gathered = len(last.sample_rows) * cfg.vocab_size * 4                     # fp32 (num_sampling, vocab)
print(f"a decode step of {len(last.input_ids)} sequences: {per_step} all-reduces of ({len(last.input_ids)}, "
      f"{cfg.hidden_size}) = {reduced // 1024} KiB, one all-gather of ({len(last.sample_rows)}, {cfg.vocab_size}) "
      f"logits = {gathered // 1024} KiB")

# %% [markdown]
# Per step: one all-reduce for the embedding, two per layer (`o_proj`, `down_proj`), and one all-gather of
# the logits. The control message is a few hundred bytes; the collectives carry over a MiB per decode step
# even for 4 sequences, and it grows with the batch. Hence the two channels. (The count above is rank 0's: section 2's
# `tp_rank` shows why every rank must make the same calls in the same order.)
#
# ### The step, drawn
#
# Schematic (not to scale): boxes are compute, vertical lines are collectives where every rank waits for the
# slowest.

# %%
# NBVAL_IGNORE_OUTPUT
fig, ax = plt.subplots(figsize=(12, 2.6))
lane = {0: 2, 1: 1, 2: 0}
light = ["#aec7e8", "#ffbb78", "#98df8a"]


def box(rank, x0, width, text, color):
    ax.add_patch(Rectangle((x0, lane[rank] - 0.3), width, 0.6, facecolor=color, edgecolor="black", lw=0.5))
    ax.text(x0 + width / 2, lane[rank], text, ha="center", va="center", fontsize=8)


box(0, 0, 2.0, "schedule,\nprepare_inputs", "#dddddd")
for r in (1, 2):
    ax.annotate("", xy=(2.5, lane[r] + 0.3), xytext=(2.0, lane[0] - 0.3), arrowprops=dict(arrowstyle="->"))
ax.text(1.2, 0.9, "pipe:\nModelInput", fontsize=8, ha="center")
x0 = 2.5
for name, collective in [("embed", "all_reduce"), ("attn 1", "all_reduce"), ("mlp 1", "all_reduce"),
                         ("...", None), ("attn 30", "all_reduce"), ("mlp 30", "all_reduce"),
                         ("lm_head", "all_gather")]:
    width = 0.6 if name == "..." else 1.0
    for r in range(TP):
        box(r, x0, width, name, light[r])
    x0 += width
    if collective:
        ax.plot([x0, x0], [-0.4, 2.4], color="tab:red" if collective == "all_reduce" else "tab:purple", lw=2)
box(0, x0 + 0.1, 1.2, "sample", "#dddddd")
for r in (1, 2):
    box(r, x0 + 0.1, 1.2, "drop logits", "white")
ax.set_yticks([2, 1, 0], ["rank 0 (driver)", "rank 1 (worker)", "rank 2 (worker)"])
ax.set_xlim(-0.1, x0 + 1.4)
ax.set_ylim(-0.5, 2.5)
ax.set_xticks([])
for side in ("top", "right", "bottom"):
    ax.spines[side].set_visible(False)
ax.legend(handles=[Line2D([], [], color="tab:red", lw=2, label="all-reduce"),
                   Line2D([], [], color="tab:purple", lw=2, label="all-gather")],
          loc="upper center", bbox_to_anchor=(0.5, -0.02), ncol=2, fontsize=8, frameon=False)
plt.tight_layout()
plt.show()

# %% [markdown]
# The `with` block called `LLM.shutdown()` on the way out: the driver sent each worker `"shutdown"`, joined
# it (terminating any that hang), and left the process group, so another TP engine can start in this
# process. Workers also stop if the engine is garbage-collected, if a step fails, or if the driver dies (their
# pipe closes); `tests/test_tensor_parallel.py` checks each case for leftover processes.

# %%
assert tp3_tokens == reference
assert len(worker_pids) == TP - 1 and all(alive_during) and not any(alive_after) and not mp.active_children()
assert driver_view == {"heads": (3, 1), "kv_cache": kv_cache_shape(TP), "bytes_per_block": bytes_per_block(TP),
                       "lm_head": (cfg.vocab_size // TP, cfg.hidden_size)}
assert seen["all_reduce"] == num_steps * per_step and seen["all_gather"] == num_steps == len(seen["sent"])
assert not dist.is_initialized()                                   # the process group is gone too

# %% [markdown]
# ### Across machines: torchrun
#
# The workers above are children of the engine, so they live on its machine. For a model that needs GPUs on
# several machines, minivllm does what vLLM does: let PyTorch's launcher start the ranks.
#
# ```bash
# torchrun --standalone --nproc-per-node 3 -m minivllm.generate --tensor-parallel-size 3 "Once upon a time"
# # two machines x 2 GPUs = TP 4; run on each machine with its own --node-rank
# torchrun --nnodes 2 --nproc-per-node 2 --node-rank 0 --master-addr HOST_OF_RANK_0 --master-port 29500 \
#     -m minivllm.generate --tensor-parallel-size 4 --model /models/Llama-3.1-8B-Instruct "Hello"
# ```
#
# torchrun starts every rank itself and gives each one `RANK`, `WORLD_SIZE`, `MASTER_ADDR` and `MASTER_PORT`
# in its environment. The engine notices them and uses `ExternalLauncherExecutor`: there is no driver and no
# pipe, because **every rank runs the whole engine in lockstep**. Each tokenizes the same prompts, schedules
# the same batch, runs its shard of the model, receives the same gathered logits and samples the same token
# with the same seed, so they never disagree about what comes next. Only rank 0 prints.
# (`tests/test_tensor_parallel.py` runs it with 2 ranks and compares with one. It is not run here: on this
# machine a 3-rank torchrun takes about 20 seconds, most of it three fresh Python processes importing torch.)

# %% [markdown]
# ## 5. Pipeline parallelism
#
# TP cuts every layer across ranks; **pipeline parallelism** (PP) cuts the *stack* of layers instead. Stage 0
# holds the first few decoder layers, stage 1 the next few, and so on; a token's hidden state goes through
# stage 0, is sent to stage 1, and so on to the last stage, which computes the logits. Each stage keeps the
# weights and the KV cache of its own layers only. `LLM(pipeline_parallel_size=2)` runs it; it combines with TP
# (`tensor_parallel_size=3, pipeline_parallel_size=2` is 6 ranks: a TP group of 3 per stage).
#
# ### Who holds which layers
#
# `pp_layer_partition(num_layers, pp_size)` (`worker/distributed.py`) splits the layers as evenly as it can;
# when they do not divide, the *earlier* stages take one fewer, as vLLM does, because the first stage also
# embeds and the last also runs the LM head. Each stage's model skeleton, built on the `meta` device as in
# section 3, shows what else it holds:

# %%
def stage_skeleton(stage, pp_size):
    start, end = pp_layer_partition(cfg.num_hidden_layers, pp_size)[stage]
    with torch.device("meta"):
        return LlamaForCausalLM(cfg, TPGroup(), PPStage(stage, pp_size, start, end))


def stage_extras(model):
    return [name for name in ("embed_tokens", "norm", "lm_head") if hasattr(model, name)]


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
#
# ### The engine with `pipeline_parallel_size=2`
#
# The same prompts, greedy, with one stage and with two, at the same KV memory budget per rank
# (`kv_cache_memory_gb`, and no `num_kv_blocks`, so each rank sizes its own pool). A small spy counts the
# point-to-point messages rank 0 sends and receives (`ModelRunner._execute_stage` in `worker/model_runner.py`;
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
# ### What crosses between ranks, per step
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
# ### The bubble: one batch in flight, or several
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
# ### The bubble, measured
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
# also computes the LM head (576 x 49152, as heavy as 4 layers here), so for this measurement the split gives
# stage 0 two more layers (`VLLM_PP_LAYER_PARTITION="17,13"`, vLLM's variable) and the stages take about as long.

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
print(f"2 in flight / 1 in flight: {measured[1]['wall'] / measured[2]['wall']:.2f}x the throughput; "
      "greedy tokens identical:", measured[1]["tokens"] == measured[2]["tokens"])

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
# On top, the staircase of the first diagram, for real: a batch goes through stage 0, then stage 1, and each
# rank waits for the other (the gaps are the bubble, plus rank 0's own work between batches: sampling,
# scheduling, detokenizing). Below, while rank 1 runs batch b, rank 0 already runs batch b + 1: both ranks are
# busy most of the time. On these 2 cores that turns PP 2 from slower than one process (each rank has one
# core and half the time nothing to do) into about as fast; on GPUs across machines it is what makes PP
# worth its memory. It needs enough concurrent requests to fill the batches: with one request there is one
# batch, and the bubble returns.

# %%
assert partitions[2] == [(0, 15), (15, 30)] and partitions[3] == [(0, 10), (10, 20), (20, 30)]
assert [e - s for s, e in partitions[4]] == [7, 7, 8, 8]
assert stage_extras(stage_skeleton(0, 2)) == ["embed_tokens"] and stage_extras(stage_skeleton(1, 2)) == ["norm", "lm_head"]
assert stage_params[2, 0] + stage_params[2, 1] == full + cfg.vocab_size * cfg.hidden_size   # the head's own copy
assert pp1_tokens == pp2_tokens and pp2_driver["layers"] == 15 and pp2_driver["kv_cache"][1] == 15
assert all(2 * pp1_blocks[0] <= n <= 2 * pp1_blocks[0] + 1 for n in pp2_blocks)
assert len(p2p["isend"]) == 2 * pp2_batches and len(p2p["recv"]) == pp2_batches
assert ratio["decode, 32 requests"] == (1 + 2 * cfg.num_hidden_layers) / 2
assert abs(idle["1 batch in flight"] - (PP_STAGES - 1) / PP_STAGES) < 1e-12
assert measured[1]["tokens"] == measured[2]["tokens"]
assert not mp.active_children() and not dist.is_initialized()

# %% [markdown]
# ## Check yourself
#
# Run this cell. It re-checks the lesson's claims: column shards concatenate and row shards sum to the
# unsharded layer; a column-then-row MLP needs one sum; on real gloo ranks the all-reduce gives every rank
# the one-process answer, bit-identical across ranks; each rank of SmolLM2 holds 3 query heads, the 1 KV
# head they read, a third of the weights and a third of each KV block; TP 2 is refused; and the engine on 3
# ranks produced TP 1's greedy tokens and left no process behind; the pipeline stages split the 30 layers
# evenly, PP 2 produced PP 1's greedy tokens with twice the KV blocks per rank, sends the hidden state far
# less often than TP, and one batch in flight leaves each of 3 stages idle two thirds of the time; measured, two
# batches in flight give the same tokens with the stages working at the same time.

# %%
def self_check():
    # 1. one process
    torch.testing.assert_close(torch.cat([F.linear(x, w) for w in W.chunk(TP, 0)], -1), F.linear(x, W))
    torch.testing.assert_close(sum(F.linear(a, b) for a, b in zip(x.chunk(TP, 1), W.chunk(TP, 1))), F.linear(x, W))
    torch.testing.assert_close(sum(mlp_partials), mlp)
    # 2. real ranks
    assert sorted(ranks) == list(range(TP))
    for r in range(TP):
        torch.testing.assert_close(ranks[r]["y"], mlp)
        assert torch.equal(ranks[r]["y"], ranks[0]["y"])
        assert ranks[r]["up"].shape == (12 // TP, 6) and ranks[r]["down"].shape == (6, 12 // TP)
    assert all(p.exitcode == 0 for p in procs)
    # 3. shares
    for r in range(TP):
        q_heads, kv_heads = heads_held(r, TP)
        assert len(q_heads) == cfg.num_attention_heads // TP and {h // group for h in q_heads} == set(kv_heads)
    assert heads_held(0, 1) == (list(range(cfg.num_attention_heads)), list(range(cfg.num_key_value_heads)))
    assert per_rank < full / 2 and bytes_per_block(TP) == bytes_per_block(1) // TP
    try:
        check_tp_size(cfg, 2)
        raise AssertionError("TP 2 was accepted")
    except ValueError as err:
        assert "9 query heads" in str(err) and "3 KV heads" in str(err)
    # 4. the engine
    assert tp3_tokens == reference and len(reference) == len(PROMPTS)
    assert all(len(t) == PARAMS.max_tokens for t in reference)
    assert not any(alive(pid) for pid in worker_pids) and not mp.active_children() and not dist.is_initialized()
    # 5. pipeline parallelism
    for pp, bounds in partitions.items():
        assert bounds[0][0] == 0 and bounds[-1][1] == cfg.num_hidden_layers and len(bounds) == pp
        assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))                # contiguous, no gaps
        assert max(e - s for s, e in bounds) - min(e - s for s, e in bounds) <= 1   # as even as possible
    assert pp1_tokens == pp2_tokens and len(pp2_tokens) == len(PROMPTS)
    assert min(pp2_blocks) >= 2 * pp1_blocks[0]
    assert all(traffic[step, "PP 2"][0] < traffic[step, "TP 3"][0] for step, _ in traffic)
    assert idle[f"{PP_STAGES} batches in flight"] < idle["1 batch in flight"]
    assert abs(idle["1 batch in flight"] - 2 / 3) < 1e-12
    # measured: the same tokens; with two batches in flight the stages overlap and both ranks are busier
    assert measured[1]["tokens"] == measured[2]["tokens"]
    overlap = [(b0, b1) for b0, s0, e0 in measured[2]["spans"][0] for b1, s1, e1 in measured[2]["spans"][1]
               if b1 < b0 and s1 < e0 and s0 < e1]
    assert len(overlap) >= len(measured[2]["spans"][0]) // 2
    assert min(measured[2]["busy"].values()) > max(measured[1]["busy"].values())
    return "all checks passed"


self_check()

# %% [markdown]
# ## Where next
#
# Lessons 00-07 drove the engine from a notebook. Lesson 09 puts it behind a server: an async engine that
# streams tokens to many clients at once, and an OpenAI-compatible API.
