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
# # Lesson 06: paged attention and the Triton kernels
#
# Lessons 01-05 showed *where* the KV cache lives: fixed-size blocks handed out by the KV cache manager, one
# block table per sequence, and the flat batch that carries them to the model. This lesson is about *reading*
# it: attention when a sequence's keys and values are scattered over the pool. We build it up the way the Triton
# tutorials do, one idea at a time, each checked against the one before: 1. the math for one contiguous
# sequence; 2. the naive paged version (gather through the block table); 3. **online softmax**, tile by tile;
# 4. **split-KV** (flash-decoding); 5. **GQA**; then **your exercise**, paged attention for one sequence; 6. the
# real Triton kernels of `kernels/triton_ops.py`, read line by line and run on the CPU under Triton's
# interpreter against `kernels/reference.py`; 7. the whole engine with `attention_backend="triton"`.
#
# Read it next to `minivllm/model/attention.py` (which backend runs) and `kernels/` (what they run).
#
# Triton normally compiles for a GPU. With `TRITON_INTERPRET=1` it runs the same kernel code on the CPU with
# NumPy, one program at a time: slow, but exact enough to test against, and it needs no GPU. The variable is
# read when `triton` is first imported, so it is the very first thing we set.

# %%
import os

os.environ["TRITON_INTERPRET"] = "1"   # before anything imports triton

import inspect
import math
import warnings

warnings.filterwarnings("ignore", message="IProgress not found")   # tqdm's notice when ipywidgets is absent

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
from matplotlib.patches import FancyArrowPatch, Rectangle

from minivllm import LLM, SamplingParams
from minivllm.model._kernels import kernels

ref = kernels.reference          # plain PyTorch: the CPU serving path and the kernels' oracle
torch.set_num_threads(1)
torch.manual_seed(0)

# %% [markdown]
# ## 1. The math, for one sequence
#
# At a decode step a sequence has one new query vector `q` per head, and `n` earlier tokens with keys
# `K` (n, d) and values `V` (n, d). Attention is a weighted average of the values (here one head, 10 tokens,
# head_dim 8):
#
# $$ s = K q \cdot \tfrac{1}{\sqrt d}, \qquad p = \mathrm{softmax}(s), \qquad o = p^\top V $$

# %%
n, d = 10, 8
scale = 1 / math.sqrt(d)
q = torch.randn(d)
K = torch.randn(n, d)
V = torch.randn(n, d)

s = K @ q * scale              # (n,)   one score per earlier token
p = torch.softmax(s, dim=0)    # (n,)   weights, summing to 1
o = p @ V                      # (d,)   the output: a mix of the value rows

print("weights:", [round(x, 3) for x in p.tolist()])
print("sum of weights:", round(p.sum().item(), 6))
# PyTorch's fused attention computes the same (it wants a batch of heads and of query rows: [None, None])
o_sdpa = F.scaled_dot_product_attention(q[None, None], K[None], V[None], scale=scale)[0, 0]
print("same as F.scaled_dot_product_attention:", torch.allclose(o, o_sdpa, atol=1e-6))

# %% [markdown]
# ## 2. Paged K/V: gather through the block table
#
# In the engine nothing is contiguous. The cache is one tensor of shape
# `(num_blocks, block_size, num_kv_heads, head_dim)` and a sequence owns whichever blocks the KV cache manager
# gave it, in any order. Its **block table** lists them: token `t` lives in
# `cache[block_table[t // block_size], t % block_size]`.
#
# Here is a pool of 8 blocks of 4 slots. Our 10-token sequence needs 3 blocks; we give it 3 random ones, and
# write each token's K/V into its slot with `reference.store_kv_cache` (the same call the engine makes with
# the new tokens of every step; `slot = block * block_size + offset`).

# %%
num_blocks, block_size = 8, 4
key_cache = torch.zeros(num_blocks, block_size, 1, d)        # 1 KV head
value_cache = torch.zeros_like(key_cache)

block_table = torch.randperm(num_blocks)[:3].int()           # logical block i -> physical block block_table[i]
positions = torch.arange(n)
slot_mapping = block_table[positions // block_size].long() * block_size + positions % block_size
ref.store_kv_cache(K[:, None], V[:, None], key_cache, value_cache, slot_mapping)

print("block table:  ", block_table.tolist())
print("slot mapping: ", slot_mapping.tolist())

# %% [markdown]
# The picture: the sequence's three logical blocks (top) point into the pool (bottom). The last block is only
# half full: 10 tokens = 4 + 4 + 2.

# %%
# NBVAL_IGNORE_OUTPUT
fig, ax = plt.subplots(figsize=(9, 3))
for i, phys in enumerate(block_table.tolist()):
    used = min(block_size, n - i * block_size)
    for j in range(block_size):
        for left, y in ((2.5 + i * 1.3, 2), (phys * 1.3, 0)):       # the logical block and its physical block
            ax.add_patch(Rectangle((left + j * 0.25, y), 0.25, 0.6, ec="k",
                                   fc=f"C{i}" if j < used else "white", alpha=0.8 if j < used else 1))
    ax.text(2.5 + i * 1.3 + 0.5, 2.75, f"logical {i}", ha="center")
    ax.add_patch(FancyArrowPatch((2.5 + i * 1.3 + 0.5, 2), (phys * 1.3 + 0.5, 0.6),
                                 arrowstyle="->", mutation_scale=15, color=f"C{i}"))
for b in range(num_blocks):
    if b not in block_table.tolist():
        for j in range(block_size):
            ax.add_patch(Rectangle((b * 1.3 + j * 0.25, 0), 0.25, 0.6, ec="0.6", fc="0.92"))
    ax.text(b * 1.3 + 0.5, -0.35, f"phys {b}", ha="center")
ax.text(-0.3, 2.3, "sequence", ha="right", va="center")
ax.text(-0.3, 0.3, "KV pool", ha="right", va="center")
ax.set_xlim(-1.6, num_blocks * 1.3)
ax.set_ylim(-0.7, 3.1)
ax.axis("off")
ax.set_title("block table: logical blocks of one sequence -> physical blocks of the pool")
plt.show()

# %% [markdown]
# The naive paged attention undoes the scattering: `reference.gather_kv` indexes the cache with the block
# table, flattens the blocks and cuts at `seq_len`. That gives back `K` and `V` exactly, and then step 1 applies;
# `reference.paged_decode_attention` does this for a whole batch (padding to the longest sequence, masking the
# tail).

# %%
print(inspect.getsource(ref.gather_kv))
K_g = ref.gather_kv(key_cache, block_table, n)[:, 0]      # (n, d), head 0
V_g = ref.gather_kv(value_cache, block_table, n)[:, 0]
print("gathered K == K:", torch.equal(K_g, K), "  gathered V == V:", torch.equal(V_g, V))

o_paged = ref.paged_decode_attention(q[None, None], key_cache, value_cache, block_table[None],
                                     torch.tensor([n], dtype=torch.int32), scale)[0, 0]
print("reference.paged_decode_attention matches step 1:", torch.allclose(o_paged, o, atol=1e-6))

# %% [markdown]
# On a GPU the gather is the problem: it copies the whole context into a new tensor before reading it once.
# A kernel should read each block **in place**, straight from the pool. But then it sees the context one
# tile at a time, and softmax needs the maximum and the sum over the *whole* row before it can weigh any
# value. The next idea removes that need.
#
# ## 3. Online softmax: one tile at a time
#
# Softmax is computed stably as `exp(s - m) / l` with `m = max(s)` and `l = sum(exp(s - m))`. Walk the scores
# tile by tile keeping the max `m`, the sum `l` of `exp(s - m)` and the unnormalised output
# `acc = sum exp(s - m) v` so far. When a tile raises the max to `m_new`, what was accumulated is scaled by
# `exp(-m)` and should be by `exp(-m_new)`: multiply it by `alpha = exp(m - m_new)`, then add the tile; at the
# end, `o = acc / l`. This is the loop in `_paged_decode_kernel` (which uses `exp2`, with `log2(e)` folded into the
# scale). 48 tokens, tiles of 8; later tokens get larger scores so the max keeps moving.

# %%
n_long, tile = 48, 8
q3 = torch.randn(d)
K3 = torch.randn(n_long, d) + 0.05 * torch.arange(n_long)[:, None] * q3 / q3.norm()   # drift towards q
V3 = torch.randn(n_long, d)
s3 = K3 @ q3 * scale

def online_softmax_attention(s, V, tile):
    """Returns o and the (m, l) after each tile."""
    m = torch.tensor(float("-inf"))
    l = torch.tensor(0.0)
    acc = torch.zeros(V.shape[1])
    history = []
    for start in range(0, len(s), tile):
        s_t, V_t = s[start:start + tile], V[start:start + tile]
        m_new = torch.maximum(m, s_t.max())
        alpha = torch.exp(m - m_new)              # exp(-inf) = 0 on the first tile
        p_t = torch.exp(s_t - m_new)
        l = l * alpha + p_t.sum()
        acc = acc * alpha + p_t @ V_t
        m = m_new
        history.append((m.item(), l.item()))
    return acc / l, history

o_online, history = online_softmax_attention(s3, V3, tile)
o_full = torch.softmax(s3, dim=0) @ V3
print("running (max, sum) after each tile:", [(round(m_i, 3), round(l_i, 3)) for m_i, l_i in history])
print(f"the full row's (max, sum): ({s3.max().item():.3f}, {torch.exp(s3 - s3.max()).sum().item():.3f})")
print("online result equals the full softmax:", torch.allclose(o_online, o_full, atol=1e-6))

# %% [markdown]
# The running sum does not only grow: each time the max rises, the old sum is rescaled down by `alpha` before
# the new tile is added. After the last tile both equal the full row's, and `acc / l` is the exact average.

# %%
# NBVAL_IGNORE_OUTPUT
ms, ls = zip(*history)
tiles = range(len(history))
fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.2))
a1.plot(range(n_long), s3, ".", color="0.6", label="scores s")
a1.hlines(ms, [i * tile - 0.5 for i in tiles], [(i + 1) * tile - 0.5 for i in tiles], color="C0",
           label="running max m after the tile")
for i in tiles:
    a1.axvline(i * tile - 0.5, color="0.9", zorder=0)
a1.set_xlabel("token"); a1.set_title("running max after each tile"); a1.legend(loc="upper left")
a2.plot([i + 1 for i in tiles], ls, "o-", color="C1", label="running sum l")
a2.axhline(torch.exp(s3 - s3.max()).sum().item(), ls="--", color="k", label="full-row sum")
a2.set_xlabel("tiles processed"); a2.set_title("running sum (relative to the running max)"); a2.legend()
plt.tight_layout()
plt.show()

# %% [markdown]
# ## 4. Split-KV (flash-decoding): slices in parallel, then merge
#
# A decode step has one query row per sequence. If a GPU runs one program per (sequence, KV head), a batch of
# 2 sequences with 3 KV heads keeps 6 programs busy on a GPU with 132 SMs; the rest idle while each program
# walks its whole long context. Flash-decoding cuts the context into `num_splits` slices, runs step 3 on each
# slice **in parallel**, and writes a *partial* `(m_s, l_s, acc_s)` per slice (`acc_s` not yet divided).
# A second small kernel, `_merge_splits_kernel`, combines them with the same rescaling trick:
#
# $$ M = \max_s m_s,\qquad o = \frac{\sum_s e^{m_s - M}\,\mathrm{acc}_s}{\sum_s e^{m_s - M}\, l_s} $$
#
# (An empty slice, past a short sequence's end, has `m_s = -inf` and weighs nothing.)

# %%
def partial(s, V):
    """(m, l, acc) of one slice: full softmax statistics, acc not divided by l."""
    if len(s) == 0:
        return torch.tensor(float("-inf")), torch.tensor(0.0), torch.zeros(V.shape[1])
    m = s.max()
    p = torch.exp(s - m)
    return m, p.sum(), p @ V

num_splits = 4
per_split = math.ceil(n_long / num_splits)
partials = [partial(s3[i * per_split:(i + 1) * per_split], V3[i * per_split:(i + 1) * per_split])
            for i in range(num_splits)]
print("each split's (m, l):", [(round(m_s.item(), 3), round(l_s.item(), 3)) for m_s, l_s, _ in partials])

M = torch.stack([m_s for m_s, _, _ in partials]).max()
w = torch.stack([torch.exp(m_s - M) for m_s, _, _ in partials])
o_split = sum(w_s * acc_s for w_s, (_, _, acc_s) in zip(w, partials)) / sum(
    w_s * l_s for w_s, (_, l_s, _) in zip(w, partials))
print("merge weights:", [round(x, 4) for x in w.tolist()])
print("merged result equals the full softmax:", torch.allclose(o_split, o_full, atol=1e-6))

# The kernel splits only when the (sequence, KV head) programs alone would leave the GPU's SMs idle, and never
# into slices shorter than 256 tokens, since merging costs something too:
cho = kernels.triton_ops.choose_num_splits
cpu = torch.device("cpu")
print("8 sequences x 3 KV heads, context 256 :", cho(8, 3, 256, cpu), "split(s)")
print("2 sequences x 3 KV heads, context 4096:", cho(2, 3, 4096, cpu), "split(s)")
print("1 sequence  x 3 KV heads, context 32k :", cho(1, 3, 32768, cpu), "split(s)")

# %% [markdown]
# ## 5. GQA: one KV head serves a group of query heads
#
# Grouped-query attention keeps fewer KV heads than query heads (SmolLM2-135M: 9 query heads, 3 KV heads).
# Query head `h` reads KV head `h // group_size`. Written out, that is `repeat_interleave` of K and V along
# the head axis; PyTorch's `enable_gqa=True` does the same without the copy.

# %%
num_heads, num_kv_heads = 4, 2
group_size = num_heads // num_kv_heads
qg = torch.randn(num_heads, 1, d)                # (heads, 1 query row, d)
Kg = torch.randn(num_kv_heads, n, d)
Vg = torch.randn(num_kv_heads, n, d)

print("query head -> KV head:", {h: h // group_size for h in range(num_heads)})
o_repeat = F.scaled_dot_product_attention(qg, Kg.repeat_interleave(group_size, 0),
                                          Vg.repeat_interleave(group_size, 0), scale=scale)
o_gqa = F.scaled_dot_product_attention(qg, Kg, Vg, scale=scale, enable_gqa=True)
o_loop = torch.stack([torch.softmax(qg[h] @ Kg[h // group_size].T * scale, -1) @ Vg[h // group_size]
                      for h in range(num_heads)])
print("repeat_interleave == enable_gqa == per-head loop:",
      torch.allclose(o_repeat, o_gqa, atol=1e-6) and torch.allclose(o_loop, o_gqa, atol=1e-6))

# %% [markdown]
# The decode kernel turns this into a saving: one program per (sequence, **KV** head, split) loads the whole
# group of query heads as a small matrix `(group, head_dim)`, so each K/V tile is read from memory once per
# group, not once per query head, and the scores are one `tl.dot` of `(group, d) x (d, BLOCK_N)`.
#
# ## Exercise: paged attention for one sequence
#
# Put steps 2 and 5 together. Write the attention of **one** decode query over its sequence's paged K/V:
#
# ```
# paged_attention_one(q, key_cache, value_cache, block_table, seq_len, scale) -> (num_heads, head_dim)
#     q                        (num_heads, head_dim)        the new token's query, one row per head
#     key_cache, value_cache   (num_blocks, block_size, num_kv_heads, head_dim)   the whole pool
#     block_table              (>= ceil(seq_len / block_size),) int32 tensor: logical block i -> physical block
#     seq_len                  int: the sequence's tokens, all attended to (no causal mask at decode)
#     scale                    float: 1 / sqrt(head_dim)
# ```
#
# - token `t` is in `cache[block_table[t // block_size], t % block_size]`; the block table may be longer than
#   the sequence needs (the engine pads each row with 0s up to the batch's widest), and the last block may be
#   only partly the sequence's: its other slots hold stale values that must get no weight;
# - GQA: query head `h` reads KV head `h // (num_heads // num_kv_heads)`;
# - only read the cache; compute in fp32.
#
# `check` compares your function with `F.scaled_dot_product_attention` over the same K/V kept contiguous (one
# block, a partial last block, a scrambled block table, GQA, random cases), then in the real engine: at every
# step and layer it reads the engine's KV cache, must give the reference backend's answer, and is then used.

# %%
from course import check, exercise


@exercise("06.paged_attention_one")
def paged_attention_one(q, key_cache, value_cache, block_table, seq_len, scale):
    # q (num_heads, head_dim); caches (num_blocks, block_size, num_kv_heads, head_dim) -> (num_heads, head_dim)
    # your code here
    raise NotImplementedError


check(paged_attention_one)

o_mine = paged_attention_one(q[None], key_cache, value_cache, block_table, n, scale)[0]     # (1, d) -> (d,)
print("your function on step 2's pool (3 random blocks) matches step 1:", torch.allclose(o_mine, o, atol=1e-6))

# %% [markdown]
# The real one, `reference.paged_decode_attention`, is the same computation for a whole batch of sequences at
# once. It gathers every sequence's blocks up to the longest (`index_select` into one reused buffer), keeps the
# stale tail of each row out with an additive `-inf` mask instead of cutting at `seq_len`, and does GQA without
# copying K/V per query head: the `group` query heads of a KV head become `group` query rows against it.

# %%
print(inspect.getsource(ref.paged_decode_attention))

# %% [markdown]
# ## 6. The real kernels
#
# ### Reading the decode kernel
#
# `paged_decode_attention` in `kernels/triton_ops.py` checks shapes, picks tile sizes and `num_splits`, and
# launches `_paged_decode_kernel` on a grid of (sequences, KV heads, splits) programs, each computing what your
# `paged_attention_one` does for the query heads of one KV head (or one slice of the context). The kernel as
# Triton runs it (a `@triton.jit` function keeps the plain Python function in `.fn`), with numbered lines:

# %%
def numbered(jitted):
    """The kernel's source, lines numbered from 1 (the `@triton.jit` line)."""
    for i, line in enumerate(inspect.getsource(jitted.fn).splitlines(), 1):
        print(f"{i:3} {line}")


def explain(jitted, notes):
    """For each (markers, note): the kernel lines that contain the markers, with their numbers, then the note."""
    lines = inspect.getsource(jitted.fn).splitlines()
    for k, (markers, note) in enumerate(notes, 1):
        found = []
        for marker in markers:
            hits = [i for i, line in enumerate(lines, 1) if marker in line]
            assert hits, f"{jitted.fn.__name__} has no line with {marker!r}: the kernel changed, update the notes"
            found.append(hits[0])
        print(f"{k:2}. {note}")
        for i in found:
            print(f"    {i:3} | {lines[i - 1].strip()}")


numbered(kernels.triton_ops._paged_decode_kernel)
print("\nLine by line against the PyTorch version (the reference and your function):")
explain(kernels.triton_ops._paged_decode_kernel, [
    (["seq = tl.program_id(0)", "kv_head = tl.program_id(1)", "split = tl.program_id(2)"],
     "which work this program does: one (sequence, KV head, slice). PyTorch has no such loop: the reference\n"
     "    batches every sequence and head into one scaled_dot_product_attention call."),
    (["seq_len = tl.load(seq_lens_ptr + seq)", "start = split * tokens_per_split",
      "end = tl.minimum(start + tokens_per_split, seq_len)"],
     "the tokens [start, end) this program reads; with one split, all of 0 .. seq_len - 1 (your [:seq_len])."),
    (["head = kv_head * group_size + g", "q = tl.load(q_ptr"],
     "GQA: the query heads h with h // group_size == kv_head, loaded as one (group, head_dim) tile\n"
     "    (your repeat_interleave; the reference's query.view(num_seqs, num_kv_heads, group, head_dim))."),
    (["m_i = tl.full(", "l_i = tl.zeros(", "acc = tl.zeros("],
     "the online softmax state of step 3, one per query head: running max, running sum, unnormalised output."),
    (["for tile_start in range(start, end, BLOCK_N):", "t_mask = tok < end"],
     "walk the tokens BLOCK_N at a time; t_mask is False past the end (the tail of the last tile)."),
    (["block = tl.load(block_table + tok // BLOCK_SIZE"],
     "THE BLOCK-TABLE LOOKUP: block_table[t // block_size] for each token t of the tile."),
    (["kv_off = (block[:, None] * stride_c_block", "+ kv_head * stride_c_head"],
     "the address of cache[block, t % block_size, kv_head, :]: gather_kv as pointer arithmetic, nothing copied."),
    (["k = tl.load(key_cache_ptr + kv_off", "v = tl.load(value_cache_ptr + kv_off"],
     "load the K and V tiles straight from the pool; the mask keeps slots past seq_len unread."),
    (["s = tl.dot(q, tl.trans(k)", 's = tl.where(t_mask[None, :], s, float("-inf"))'],
     "scores q . k * scale (times log2(e), so exp2 below is exp); past the end -inf: weight 0, the reference's\n"
     "    additive -inf mask."),
    (["m_new = tl.maximum(m_i", "alpha = tl.exp2(m_i - m_new)", "p = tl.exp2(s - m_new[:, None])",
      "l_i = l_i * alpha + tl.sum(p, axis=1)", "acc = acc * alpha[:, None] + tl.dot("],
     "THE ONLINE SOFTMAX, step 3's loop line for line: rescale the old sums by alpha, add this tile."),
    (["if NUM_SPLITS == 1:", "out = acc * (v_scale / tl.where(l_i == 0.0"],
     "one split: o = acc / l, softmax's division done once at the end (v_scale is 1 unless the cache is fp8)."),
    (["tl.store(part_m_ptr + row, m_i", "tl.store(part_l_ptr + row, l_i", "tl.store(part_acc_ptr"],
     "SPLIT-KV: with several slices, store this slice's partial (m, l, acc), step 4's partial(), for the merge."),
])

# %% [markdown]
# ### The merge kernel, and what the prefill kernel changes
#
# With `num_splits > 1` a second kernel, one program per (sequence, query head), combines the slices' partials
# (step 4's merge). The prefill kernel, `_paged_prefill_kernel`, has the decode kernel's loop (block-table
# lookup, loads, online softmax); what changes is who a program serves and which keys each query row may see:

# %%
explain(kernels.triton_ops._merge_splits_kernel, [
    (["m_max = tl.max(m, axis=0)"], "merge: M = max_s m_s over every slice's partial (m_s, l_s, acc_s)."),
    (['w = tl.where(m == float("-inf"), 0.0, tl.exp2(m - m_max))'],
     "merge: the weights e^(m_s - M) (exp2: m is in log2 units); an empty slice gets 0."),
    (["l_total = tl.sum(w * l, axis=0)", "out = tl.sum(w[:, None] * acc, axis=0)"],
     "merge: o = sum_s w_s acc_s / sum_s w_s l_s."),
])
explain(kernels.triton_ops._paged_prefill_kernel, [
    (["tile = tl.program_id(0)", "head = tl.program_id(1)", "seq = tl.program_id(2)"],
     "prefill: one program per (tile of BLOCK_M query rows, query head, sequence)."),
    (["context = seq_len - q_len", "pos = context + r"],
     "the new rows are the sequence's last q_len positions; earlier ones are cached context (prefix hits, chunks)."),
    (["kv_end = tl.minimum(seq_len, context + (tile + 1) * BLOCK_M)"],
     "the tile's last row sees keys up to here, so the loop stops there: the causal mask also saves reads."),
    (["causal = t_mask[None, :] & (tok[None, :] <= pos[:, None])", "s = tl.where(causal, s, float(\"-inf\"))"],
     "the causal mask: row at position pos sees keys 0 .. pos (the reference's mask in paged_prefill_attention)."),
])

# %% [markdown]
# ### Running them under the interpreter
#
# Now the production kernels against the reference. A tiny batch in fp32 (bf16 is wrong in the interpreter;
# fp16 and fp32 are fine): 3 sequences of 1, 17 and 37 tokens, 4 query heads over 2 KV heads, head_dim 32,
# blocks of 16, random blocks from a pool of 12. Unowned slots hold NaN: the kernels must never read them (the
# reference, a masked matmul over gathered blocks, would turn a NaN into NaN, so it gets a copy with zeros).

# %%
triton_ops = kernels.triton_ops
seq_lens_list = [1, 17, 37]
H, KVH, D, BS, NB = 4, 2, 32, 16, 12
dtype = torch.float32

blocks_needed = [math.ceil(L / BS) for L in seq_lens_list]
perm = torch.randperm(NB).tolist()
tables = [perm[sum(blocks_needed[:i]):sum(blocks_needed[:i + 1])] for i in range(len(seq_lens_list))]
block_tables = torch.tensor([t + [0] * (max(blocks_needed) - len(t)) for t in tables], dtype=torch.int32)
seq_lens = torch.tensor(seq_lens_list, dtype=torch.int32)
print("block tables:", tables)

# Every token's K/V, written into its slot by the Triton store kernel.
slots = torch.cat([block_tables[i, torch.arange(L) // BS].long() * BS + torch.arange(L) % BS
                   for i, L in enumerate(seq_lens_list)])
k_new = torch.randn(len(slots), KVH, D, dtype=dtype)
v_new = torch.randn(len(slots), KVH, D, dtype=dtype)
kc = torch.full((NB, BS, KVH, D), float("nan"), dtype=dtype)
vc = torch.full_like(kc, float("nan"))
triton_ops.store_kv_cache(k_new, v_new, kc, vc, slots)
kc_ref, vc_ref = kc.nan_to_num(0.0), vc.nan_to_num(0.0)   # the reference's NaN-free copy
print("NaN slots left (unowned):", int(kc.isnan().any(-1).any(-1).sum()), "of", NB * BS)

# %% [markdown]
# **Decode**: one query token per sequence. `num_splits=1` is one program per (sequence, KV head): 3 x 2 = 6
# programs; `num_splits=4` runs 24 programs of slices, then the merge kernel (sequence 0 has one token: three of
# its four slices are empty). **Prefill**: a flat batch of query rows, causally masked; the sequences bring 1, 7
# and 37 *new* tokens, so sequence 1 had 10 tokens cached already (a prefix hit, or an earlier chunk) and its 7
# query rows sit at positions 10-16. `cu_seqlens_q` marks where each sequence's rows start.

# %%
q_dec = torch.randn(len(seq_lens_list), H, D, dtype=dtype)
scale32 = 1 / math.sqrt(D)
out_ref = ref.paged_decode_attention(q_dec, kc_ref, vc_ref, block_tables, seq_lens, scale32)
out_s1 = triton_ops.paged_decode_attention(q_dec, kc, vc, block_tables, seq_lens, scale32, num_splits=1)
out_s4 = triton_ops.paged_decode_attention(q_dec, kc, vc, block_tables, seq_lens, scale32, num_splits=4)
mine_dec = torch.stack([paged_attention_one(q_dec[i], kc_ref, vc_ref, block_tables[i], L, scale32)
                        for i, L in enumerate(seq_lens_list)])        # (3, H, D): your function, one sequence a call

q_lens_list = [1, 7, 37]
cu_seqlens_q = torch.tensor([0] + torch.tensor(q_lens_list).cumsum(0).tolist(), dtype=torch.int32)
q_pre = torch.randn(sum(q_lens_list), H, D, dtype=dtype)
print("cu_seqlens_q:", cu_seqlens_q.tolist(), " seq_lens:", seq_lens.tolist())
pre_ref = ref.paged_prefill_attention(q_pre, kc_ref, vc_ref, block_tables, cu_seqlens_q, seq_lens, scale32)
pre_tri = triton_ops.paged_prefill_attention(q_pre, kc, vc, block_tables, cu_seqlens_q, seq_lens, scale32,
                                             max_q_len=max(q_lens_list))
errors = {"decode, num_splits=1": (out_s1 - out_ref).abs().max().item(),
          "decode, num_splits=4": (out_s4 - out_ref).abs().max().item(),
          "your paged_attention_one vs the kernel": (mine_dec - out_s1).abs().max().item(),
          "prefill": (pre_tri - pre_ref).abs().max().item()}

# %% [markdown]
# The errors are a few units in the last place of fp32: the kernels add in another order (tile by tile, slice
# by slice) than PyTorch. The exact values can differ between machines; the assert at the end checks the bound.

# %%
# NBVAL_IGNORE_OUTPUT
for name, err in errors.items():
    print(f"{name}: max abs error {err:.1e}")

# %% [markdown]
# How many tiles a kernel keeps in flight (`num_stages`: with 2, the copy of tile j+1 overlaps the math on tile
# j) is chosen per kernel by `triton_ops.choose_num_stages`, and checked without a GPU: `kernels/aot.py` compiles
# every kernel for sm_80 and sm_90 and reports its registers, shared memory and spills
# (`tests/test_kernels_aot.py` asserts that no chosen configuration spills).
#
# ### An fp8 cache: one byte per element
#
# Decode reads the whole context's K and V every step, so the cache's bytes are the step's bytes.
# `kv_cache_dtype="fp8"` (vLLM's option, and minivllm's) stores each element as **e4m3**: a sign, 4 exponent and
# 3 mantissa bits, the largest finite value 448, neighbours 6-12% apart at every size. A per-layer **scale**
# picks the window of magnitudes: the cache holds `x / scale` (`quantize_fp8` in `kernels/reference.py`), with
# each layer's scale set so the largest |K| (or |V|) of a calibration prompt lands at 224
# (`minivllm/worker/kv_scales.py`).
#
# Below, the e4m3 values; then the real decode kernel on this section's K/V stored as fp8. It converts each
# loaded tile to the query's dtype (exact: every e4m3 value is an fp16 and a bf16 value); `k_scale` joins the
# softmax scale and `v_scale` multiplies the output once. Compared with fp32 attention over the **dequantized**
# cache (the same numbers) and over the original cache (the price of one byte per element); and, when it is
# built, the C++ CPU kernel (`kernels/cpu_attention.cpp`) on the same fp8 cache.

# %%
e4m3 = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
e4m3 = e4m3[e4m3.isfinite()].unique()
print(f"{len(e4m3)} finite e4m3 values up to {e4m3.max():g}; from 1 to 2:", e4m3[(e4m3 >= 1) & (e4m3 <= 2)].tolist())
x = torch.tensor([0.3, 1.06, 31.0, 100.0, 1000.0])
print(x.tolist(), "as e4m3:", ref.quantize_fp8(x, 1.0).float().tolist(), "(1000 saturates at 448)")

k_scale = kc_ref.abs().max().item() / 224
v_scale = vc_ref.abs().max().item() / 224
kc8 = ref.quantize_fp8(kc_ref, k_scale)          # (NB, BS, KVH, D) torch.float8_e4m3fn: 1 byte an element
vc8 = ref.quantize_fp8(vc_ref, v_scale)
out_fp8 = triton_ops.paged_decode_attention(q_dec, kc8, vc8, block_tables, seq_lens, scale32,
                                            k_scale=k_scale, v_scale=v_scale)
out_dequant = ref.paged_decode_attention(q_dec, kc8.float() * k_scale, vc8.float() * v_scale, block_tables,
                                         seq_lens, scale32)
err_fp8_kernel = (out_fp8 - out_dequant).abs().max().item()
err_fp8_format = (out_fp8 - out_ref).abs().max().item()
print(f"cache bytes: fp32 {kc_ref.nbytes + vc_ref.nbytes:,}, fp8 {kc8.nbytes + vc8.nbytes:,}")

# %%
# NBVAL_IGNORE_OUTPUT
print(f"fp8 kernel vs fp32 attention over the dequantized cache: max abs error {err_fp8_kernel:.1e}")
print(f"fp8 kernel vs fp32 attention over the original cache:    max abs error {err_fp8_format:.1e}")
if kernels.cpu_ops.available():
    out_cpu = kernels.cpu_ops.paged_decode_attention(q_dec.contiguous(), kc8, vc8, block_tables.int(), seq_lens.int(),
                                                     scale32, k_scale=k_scale, v_scale=v_scale)
    err_cpu = (out_cpu.float() - out_dequant).abs().max().item()
    print(f"C++ CPU kernel vs fp32 attention over the dequantized cache: max abs error {err_cpu:.1e}")
    assert err_cpu < 1e-5

# %% [markdown]
# What the format costs on the real model (perplexity with an fp8 cache against without) is measured by
# `tests/test_kv_cache_fp8.py` and recorded in `docs/benchmarks.md`. Triton has e4m3 only from compute
# capability 8.9 (H100, L4), so an A100 cannot hold an fp8 cache here.
#
# ## 7. The whole engine on the Triton backend
#
# `attention_backend="triton"` makes every layer's attention call the kernels above (`TritonAttentionBackend`
# in `minivllm/model/attention.py`); `"torch"` calls the reference. One prompt, 4 greedy tokens, both backends,
# fp32 on the CPU: slow under the interpreter (30 layers x 5 steps of kernels run by NumPy), hence the tiny pool
# and short answer. On a GPU leave `attention_backend="auto"`, which picks Triton there.

# %%
greedy = SamplingParams(temperature=0, max_tokens=4)
prompt = "The capital of France is"
tokens = {}
for backend in ["torch", "triton"]:
    llm = LLM(device="cpu", dtype="float32", attention_backend=backend, num_kv_blocks=32, seed=0)
    out = llm.generate([prompt], greedy, use_tqdm=False)[0]
    tokens[backend] = out.outputs[0].token_ids
    print(f"{backend:6} {out.outputs[0].token_ids}  {out.outputs[0].text!r}")
    del llm

# %% [markdown]
# Same tokens: a strong check, since a wrong block index or a broken mask would change the logits far more than
# fp32 rounding does.
#
# > **How vLLM v1 does it differently.** Its default GPU backend is FlashAttention
# > (`vllm/v1/attention/backends/flash_attn.py`): one varlen call with a `block_table` serves prefills and decodes
# > together. Its Triton backend (`triton_attn.py`) runs one unified kernel for both, whose 3-D variant splits the
# > context into segments merged by `reduce_segments`, as `_merge_splits_kernel` does here. Around the same inner
# > loop it adds sliding windows, ALiBi, soft-capping, attention sinks and per-(token, head) fp8 scales.
#
# ## Check yourself
#
# Change something (the tile size in step 3, `num_splits` in step 4 or 6, the lengths in step 6) and run this.

# %%
assert torch.allclose(o, o_sdpa, atol=1e-6) and torch.allclose(o_paged, o, atol=1e-6)
assert torch.equal(K_g, K) and torch.equal(V_g, V)
assert torch.allclose(o_online, o_full, atol=1e-6)
assert abs(history[-1][0] - s3.max().item()) < 1e-6                       # the running max ends at the max
assert abs(history[-1][1] - torch.exp(s3 - s3.max()).sum().item()) < 1e-4
assert torch.allclose(o_split, o_full, atol=1e-6)
assert torch.allclose(o_gqa, o_loop, atol=1e-6)
assert torch.allclose(o_mine, o, atol=1e-6)                                       # your paged_attention_one
assert not out_s1.isnan().any() and not out_s4.isnan().any() and not pre_tri.isnan().any()
assert all(err < 1e-5 for err in errors.values())
assert err_fp8_kernel < 1e-5 and 1e-3 < err_fp8_format < 0.2     # exact over its own values; fp8 costs a little
assert kc8.nbytes * 4 == kc_ref.nbytes
assert tokens["torch"] == tokens["triton"]
print("all checks passed")
