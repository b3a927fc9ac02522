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
# # Lesson 05: from a scheduling step to one flat batch
#
# Lesson 03 ended with a plan: a `SchedulerOutput` that says which requests run this step and how many tokens
# each. Lesson 06 starts from tensors: queries, a paged KV cache, block tables. This lesson is the bridge
# between them, `ModelRunner.prepare_inputs` in `minivllm/worker/model_runner.py`: how one step's plan becomes
# **one flat batch**, with no padding, that prefill chunks and decodes share.
#
# For every scheduled request the runner knows three things: its block table, `num_computed_tokens` (the
# positions whose K/V are already in the cache) and `n`, the tokens it computes this step. Its new tokens are
# the positions `start = num_computed_tokens` .. `end - 1`, with `end = start + n`. From those it builds:
#
# | field | one per | what it is |
# |---|---|---|
# | `input_ids` | token | the token at each new position |
# | `positions` | token | `start .. end - 1`: what the rotary embedding rotates by |
# | `slot_mapping` | token | the cache slot each token's K and V are written to: `block_table[p // bs] * bs + p % bs` |
# | `q_lens` (-> `cu_seqlens_q`) | request | `n`; their prefix sum says which rows of the batch are whose |
# | `seq_lens` | request | `end`: how many keys the request's queries attend to (cached context + new tokens) |
# | `block_tables` | request | where to read those keys from, padded with 0 to the longest table |
# | `sample_rows` | sampling request | the row of each request's last token, if the step reaches its end |
#
# (Older vLLM versions called `seq_lens` `context_lens`; vLLM v1 calls `cu_seqlens_q` `query_start_loc`.)
#
# We build a real engine, let it run until one step mixes two decodes with the middle chunk of a long prompt,
# catch that step's plan and flat batch, and take them apart field by field.

# %%
import inspect
import warnings

warnings.filterwarnings("ignore", message="IProgress not found")   # tqdm's notice when ipywidgets is absent

import matplotlib.pyplot as plt
import torch
from matplotlib.colors import ListedColormap, to_rgba
from matplotlib.patches import Patch, Rectangle

from minivllm import LLM, SamplingParams
from minivllm.model._kernels import kernels
from minivllm.model.attention import TorchAttentionBackend
from minivllm.model.attention import model_input_tensors
from minivllm.worker.model_runner import ModelRunner
from plots import HALO, SHARED_HATCH, RequestColors

torch.manual_seed(0)
torch.set_num_threads(1)   # one thread: faster on a busy 2-core CPU, and the same float sums everywhere

# %% [markdown]
# ## 1. An engine whose steps mix chunks and decodes
#
# Blocks of 4 tokens (so that block boundaries come often), 32 of them, and a budget of 16 tokens a step, so a
# 33-token prompt is cut into chunks of at most 16 minus the decodes running beside it. float32 on the CPU,
# with the PyTorch reference attention.

# %%
llm = LLM(device="cpu", dtype="float32", num_kv_blocks=32, block_size=4, max_num_seqs=4,
          max_num_batched_tokens=16, seed=0)
engine = llm.llm_engine
runner = engine.model_runner
BS = runner.block_size
params = SamplingParams(temperature=0, max_tokens=8)
PROMPTS = {
    "A": "The capital city of France is called",
    "B": "Paged attention stores keys in",
    "C": ("A lighthouse keeper writes in her log every night: the wind, the ships that passed, the state of the "
          "lamp and the weather at dawn. Tonight she writes"),
}
for rid, text in PROMPTS.items():
    print(rid, len(engine.tokenize(text)[1]), "prompt tokens")
print("block size", BS, "| token budget", engine.scheduler.max_num_batched_tokens, "| backend", runner.backend.name)

# %% [markdown]
# To see a step's flat batch we wrap the runner's `prepare_inputs` for the duration of one `engine.step()`: the
# wrapper calls the real method and keeps a copy of what went in (each scheduled request's block table,
# `num_computed_tokens` and `n`, copied *before* the step moves them on) and what came out (the `ModelInput`).
# Nothing else changes: the step runs as it always does.

# %%
def step_and_capture(engine):
    """Run one engine step; return (its plan as plain rows, its ModelInput, the step's outputs)."""
    runner, seen = engine.model_runner, {}

    def prepare_inputs(out):
        seen["plan"] = [dict(request_id=r.request_id, kind=out.kinds[r.request_id], start=r.num_computed_tokens,
                             n=out.num_scheduled_tokens[r.request_id], num_tokens=r.num_tokens,
                             block_table=list(r.block_table)) for r in out.scheduled]
        seen["mi"], sampling = ModelRunner.prepare_inputs(runner, out)
        return seen["mi"], sampling

    runner.prepare_inputs = prepare_inputs
    try:
        outputs = engine.step()
    finally:
        del runner.prepare_inputs                 # the class's method again
    return seen["plan"], seen["mi"], outputs


def show_plan(plan):
    for r in plan:
        print(f"  {r['request_id']}: {r['kind']:7}  computed {r['start']:2d}  n {r['n']:2d}  "
              f"-> positions {r['start']}..{r['start'] + r['n'] - 1:<3d} block table {r['block_table']}")


engine.add_request(PROMPTS["A"], params, request_id="A")
engine.add_request(PROMPTS["B"], params, request_id="B")
plan, mi, _ = step_and_capture(engine)
print("step 1:")
show_plan(plan)
engine.add_request(PROMPTS["C"], params, request_id="C")      # C arrives while A and B decode
plan, mi, _ = step_and_capture(engine)
print("step 2:")
show_plan(plan)
plan, mi, _ = step_and_capture(engine)
print("step 3:")
show_plan(plan)

# %% [markdown]
# Step 1 prefilled A and B whole (7 + 6 tokens). In step 2 they decode (one token each) and C, just arrived,
# gets the 14 tokens left of the budget: positions 0..13. **Step 3 is our batch**: A and B decode again, and C
# computes its second chunk, positions 14..27, with positions 0..13 already in the cache from step 2.
#
# The block tables grew before the step: `schedule()` allocates the blocks a step will write before the model
# runs. A's decode at position 8 needed a third block (positions 8..11) and got block 8; C's chunk needed three
# more (positions 16..27) and got 9, 10 and 11, after A's, because decodes are scheduled first. C's last 5
# prompt tokens come in step 4.
#
# ## 2. The flat batch, field by field
#
# Here is the real `prepare_inputs`. One loop over the scheduled requests, in the plan's order (decodes first,
# then prefill chunks), appending to plain Python lists:

# %%
print(inspect.getsource(ModelRunner.prepare_inputs))

# %% [markdown]
# And what it built for step 3. Each line below is one field of the `ModelInput` (a frozen dataclass of plain
# lists: under tensor parallelism it is pickled to every rank, which makes its own tensors).

# %%
rows_of = {}                     # request id -> its rows in the flat batch
row = 0
for r in plan:
    rows_of[r["request_id"]] = range(row, row + r["n"])
    row += r["n"]
print("rows         ", {rid: f"{rows.start}..{rows.stop - 1}" for rid, rows in rows_of.items()})
print("input_ids    ", mi.input_ids)
print("positions    ", mi.positions)
print("slot_mapping ", mi.slot_mapping)
print("q_lens       ", mi.q_lens)
print("seq_lens     ", mi.seq_lens)
print("block_tables ", mi.block_tables)
print("sample_rows  ", mi.sample_rows)

# %% [markdown]
# Read it request by request:
#
# - **A** (row 0) decodes: its one new token is the one it sampled in step 2, at position 8 (its 7 prompt tokens
#   are positions 0..6, its first output token 7). `q_len` 1, `seq_len` 9: one query over 9 keys. Position 8 is
#   the first of its third block, block 8: slot 8 * 4 + 0 = 32.
# - **B** (row 1) is the same with a prompt one token shorter: position 7, the last slot of its second block (3).
# - **C** (rows 2..15): 14 prompt tokens at positions 14..27; `q_len` 14, `seq_len` 28, so its queries see the
#   14 cached keys of step 2 and the 14 they write now. Positions 14 and 15 finish block 7 (slots 30, 31);
#   position 16 starts C's fifth block, which is block 9, so the slots jump from 31 to 36: the slot of a token
#   comes from the block table, not from its position alone.
# - `block_tables` is a rectangle: A's and B's tables are padded with 0 to C's 7 entries. The padding is never
#   read: `seq_lens` says how far each table is valid.
# - `sample_rows` lists rows 0 and 1 only: A and B sample their next token. C's chunk does not reach the end of
#   its prompt, so nothing is sampled for it, and the LM head does not even run on its rows (it runs on the
#   sampled rows alone).
#
# The slots can be checked by hand with the formula of the table above:

# %%
for r in plan:
    rid, start, n, table = r["request_id"], r["start"], r["n"], r["block_table"]
    by_hand = [table[p // BS] * BS + p % BS for p in range(start, start + n)]
    print(f"{rid}: positions {start}..{start + n - 1} -> blocks {[table[p // BS] for p in range(start, start + n)]}")
    print(f"   slots {by_hand}   (from prepare_inputs: {mi.slot_mapping[rows_of[rid].start:rows_of[rid].stop]})")
    assert by_hand == mi.slot_mapping[rows_of[rid].start:rows_of[rid].stop]

# %% [markdown]
# ## 3. The tensors, and where each one goes
#
# On each rank, `model_input_tensors` (in `model/attention.py`, beside the `AttentionMetadata` it builds) turns
# the lists into tensors on the device and adds the one field that is derived rather than stored: `cu_seqlens_q`,
# the prefix sum of `q_lens`. Request i's queries are rows `cu_seqlens_q[i] .. cu_seqlens_q[i + 1] - 1`.

# %%
input_ids, positions, meta = model_input_tensors(mi, torch.device("cpu"))
print("input_ids   ", tuple(input_ids.shape), input_ids.dtype)
print("positions   ", tuple(positions.shape), positions.dtype)
for name in ("slot_mapping", "cu_seqlens_q", "seq_lens", "block_tables"):
    t = getattr(meta, name)
    print(f"{name:13}", tuple(t.shape), t.dtype, t.tolist() if t.dim() == 1 else "")
print("max_q_len   ", meta.max_q_len, "| max_seq_len", meta.max_seq_len, "| is_pure_decode", meta.is_pure_decode)
print("q_lens_cpu  ", meta.q_lens_cpu, "| seq_lens_cpu", meta.seq_lens_cpu, "(host copies: no device sync to read)")

# %% [markdown]
# Where each goes in `ModelRunner.execute_model` -> `LlamaModel.forward` (`minivllm/model/llama.py`):
#
# | tensor | read by |
# |---|---|
# | `input_ids` | the embedding, once, at the bottom of the model |
# | `positions` | the rotary embedding of q and k, in every layer |
# | `slot_mapping` | `store_kv_cache` in every layer's attention: the new K and V go to these slots *before* attention reads |
# | `cu_seqlens_q`, `q_lens_cpu` | attention: which query rows belong to which sequence |
# | `seq_lens`, `block_tables` | attention: which blocks to read, and how many keys of them are valid |
# | `max_q_len` | the backend's choice: 1 means a pure decode step (the decode kernel); above 1, the prefill path |
# | `sample_rows` | after the last layer: `compute_logits(hidden[sample_rows])`, then the sampler |
#
# Only attention ever sees the boundaries between requests. Every other layer (the projections, the MLP, the
# norms) works row by row, so for them the flat batch is just a `(16, hidden)` matrix: that is why no padding
# is needed.
#
# ## 4. The mask of a chunk over its cached prefix
#
# Sequence i's `q_len` new tokens are the *last* `q_len` of its `seq_len` keys. So query row r sits at position
# `seq_len - q_len + r` and may see every key at a position up to its own. This is the mask
# `paged_prefill_attention` in `kernels/reference.py` builds, one sequence at a time:

# %%
src = inspect.getsource(kernels.reference.paged_prefill_attention)
print(src[src.index("        # Query row r"):src.index("        # 4-D")])

# %% [markdown]
# For C's chunk (`q_len` 14, `seq_len` 28), with `#` for a key the query sees:

# %%
def chunk_mask(q_len, seq_len):
    """(q_len, seq_len) bool, as in kernels/reference.py: query row r sees keys 0 .. seq_len - q_len + r."""
    q_pos = torch.arange(seq_len - q_len, seq_len)
    return torch.arange(seq_len)[None, :] <= q_pos[:, None]


c = rows_of["C"]
mask_c = chunk_mask(len(c), mi.seq_lens[2])
print(" " * 13 + "keys 0..13 (cached in step 2)   keys 14..27 (this chunk)")
for r, line in enumerate(mask_c.tolist()):
    cells = "".join("#" if x else "." for x in line)
    print(f"pos {mi.positions[c.start + r]:2d} (row {c.start + r:2d})  {cells[:14]}   {cells[14:]}")

# %% [markdown]
# The left half is all `#`: the cached prefix is visible to every query of the chunk. The right half is the
# ordinary causal triangle. A decode is the one-row case: `q_len` 1, so its one query sees all `seq_len` keys
# and needs no mask at all beyond `seq_len`. A whole prompt computed at once is the case with no cached prefix
# (the left part has zero columns). The same formula covers all three, which is what lets one batch hold them.
#
# ## 5. A picture of the whole step
#
# Left: the 16 rows of the flat batch, one colour per request, with each row's position and the slot it writes.
# Middle: the KV pool's first 16 blocks of 4 slots (the other 16 are free); a request's blocks in its light
# colour, the slots written in this step in its full colour. Right: C's mask, cached prefix and chunk.
# (A block on two requests' tables would be hatched; these three prompts share none.)

# %%
# NBVAL_IGNORE_OUTPUT
req_colors = RequestColors(PROMPTS)                       # A, B, C: the first three palette colours
fig, (ax_rows, ax_pool, ax_mask) = plt.subplots(1, 3, figsize=(16, 6.2), gridspec_kw={"width_ratios": [1, 1.2, 1.6]})

n_rows = len(mi.input_ids)
rid_of_row = {i: rid for rid, rows in rows_of.items() for i in rows}
for i in range(n_rows):
    rid = rid_of_row[i]
    ax_rows.add_patch(Rectangle((0, n_rows - 1 - i), 1, 1, color=req_colors(rid), alpha=0.75))
    sample = "  sample" if i in mi.sample_rows else ""
    ax_rows.text(0.03, n_rows - 0.5 - i, f"row {i:2d}  {rid}  pos {mi.positions[i]:2d}  slot {mi.slot_mapping[i]:3d}{sample}",
                 va="center", family="monospace", fontsize=9, path_effects=HALO)
for boundary in meta.cu_seqlens_q.tolist()[1:-1]:
    ax_rows.axhline(n_rows - boundary, color="black", lw=2)
ax_rows.set(xlim=(0, 1), ylim=(0, n_rows), xticks=[], yticks=[],
            title=f"flat batch: cu_seqlens_q = {meta.cu_seqlens_q.tolist()}")

COLS, SHOWN = 4, 16                                        # blocks per row of the picture; blocks 16..31 are free
written = {s: rid_of_row[i] for i, s in enumerate(mi.slot_mapping)}
holders = {}                                               # block id -> request ids whose table lists it
for r in plan:
    for b in r["block_table"]:
        holders.setdefault(b, []).append(r["request_id"])
assert max(holders) < SHOWN
for b in range(SHOWN):
    bx, by = (b % COLS) * (BS + 1), -(b // COLS) * 2
    for k in range(BS):
        slot = b * BS + k
        if slot in written:
            face, alpha = req_colors(written[slot]), 0.9
        elif b in holders:
            face, alpha = req_colors(holders[b][0]), 0.25
        else:
            face, alpha = "white", 1.0
        ax_pool.add_patch(Rectangle((bx + k, by), 1, 1, facecolor=face, alpha=alpha, edgecolor="grey", lw=0.5))
        ax_pool.text(bx + k + 0.5, by + 0.5, str(slot), ha="center", va="center", fontsize=7, path_effects=HALO)
    if len(holders.get(b, ())) > 1:                        # a shared block (ref > 1): hatched
        ax_pool.add_patch(Rectangle((bx, by), BS, 1, fill=False, hatch=SHARED_HATCH, edgecolor="#333", lw=0))
    ax_pool.text(bx + BS / 2, by + 1.3, f"block {b}", ha="center", fontsize=8)
ax_pool.set(xlim=(-0.5, COLS * (BS + 1) - 0.5), ylim=(-(SHOWN // COLS) * 2 + 1.5, 2), xticks=[], yticks=[],
            aspect="equal", title="KV pool, blocks 0..15 (slot numbers)\nlight: the request's blocks; dark: written now")
legend = [Patch(color=req_colors(rid), label=rid) for rid in PROMPTS]
legend.append(Patch(facecolor="white", edgecolor="#333", hatch=SHARED_HATCH, label="shared (ref > 1)"))
ax_pool.legend(handles=legend, loc="upper center", ncol=4, bbox_to_anchor=(0.5, 0.0))

grid = torch.zeros(mask_c.shape)
cached = mi.seq_lens[2] - len(c)
grid[:, :cached] = mask_c[:, :cached].float() * 1.0
grid[:, cached:] = mask_c[:, cached:].float() * 2.0
c_light = to_rgba(req_colors("C"), 0.35)                  # C's colour, light: the cached prefix
ax_mask.imshow(grid, cmap=ListedColormap(["white", c_light, req_colors("C")]), vmin=0, vmax=2)
ax_mask.axvline(cached - 0.5, color="black", lw=1.5)
ax_mask.set_xticks(range(0, mi.seq_lens[2], 2))
ax_mask.set_yticks(range(len(c)), [f"row {c.start + r} (pos {mi.positions[c.start + r]})" for r in range(len(c))],
                   fontsize=8)
ax_mask.set(xlabel="key position", title="C's mask: cached prefix (light) + its own chunk (causal)")
fig.tight_layout()
plt.show()

# %% [markdown]
# ## 6. One backend call for the mixed step
#
# `TorchAttentionBackend.forward` (`minivllm/model/attention.py`; the engine here runs its subclass
# `CpuAttentionBackend`, backend `cpu`, which differs only in sending the decode rows to a C++ kernel) first stores every row's K and V at its slot
# (one `index_copy_` over the whole batch). Then, because `max_q_len` is 14, the step is not a pure decode. In a
# mixed step it splits the rows: sequences with `q_len == 1` (A and B) go together through the batched decode
# path, the others (C) through `paged_prefill_attention`, and the results are put back in the flat batch's rows.
# That split is only an optimisation: a decode *is* a chunk of length 1, so the prefill function alone gives
# the same answer for the whole batch. On a copy of layer 0's cache, with random queries, keys and values:

# %%
# NBVAL_IGNORE_OUTPUT
torch.manual_seed(0)
cfg = runner.model_cfg
heads, kv_heads, head_dim = cfg.num_attention_heads, runner.num_kv_heads, cfg.head_dim
q = torch.randn(n_rows, heads, head_dim)
k, v = torch.randn(n_rows, kv_heads, head_dim), torch.randn(n_rows, kv_heads, head_dim)
key_cache, value_cache = (x.clone() for x in runner.kv_caches[0])
scale = head_dim ** -0.5
backend = TorchAttentionBackend()       # the reference; a fresh one (its buffers belong to the engine's steps)
mixed = backend.forward(q, k, v, key_cache, value_cache, meta, scale)        # stores K/V, then attends
as_prefills = kernels.reference.paged_prefill_attention(q, key_cache, value_cache, meta.block_tables,
                                                        meta.cu_seqlens_q, meta.seq_lens, scale)
print("max difference, decode path + prefill path vs prefill path alone:", f"{(mixed - as_prefills).abs().max():.1e}")
assert torch.allclose(mixed, as_prefills, atol=1e-5)
assert torch.equal(key_cache.view(-1, kv_heads, head_dim)[mi.slot_mapping], k)        # each row's K at its slot

# %% [markdown]
# ### Exercise: the slots of one request
#
# Write the line of `prepare_inputs` that decides where each new K and V goes.
# `slot_mapping(block_table, start, end, block_size)` returns the flat cache slot of each position
# `start .. end - 1` of one request, in order:
#
# - position p is in the block the table lists at index `p // block_size`,
# - at offset `p % block_size` in that block,
# - and block b's slots are `b * block_size .. b * block_size + block_size - 1` (the cache is viewed as one
#   long array of slots: `key_cache.view(-1, kv_heads, head_dim)`).
#
# `check` runs it on hand-made cases (a chunk crossing a block boundary, one starting at a boundary, an empty
# range), on 200 random cases, then on a live engine: every step, your slots for each scheduled request are
# compared with the real `prepare_inputs`' and the engine then runs on *your* slots; its greedy tokens must be
# the ones it gives with its own. (In CI the lessons run with the solutions, from `lessons/solutions/`; try
# first.)

# %%
from course import check, exercise


@exercise("05.slot_mapping")
def slot_mapping(block_table, start, end, block_size):
    # your code here
    raise NotImplementedError


check(slot_mapping)
for r in plan:
    mine = slot_mapping(r["block_table"], r["start"], r["start"] + r["n"], BS)
    print(f"step 3, {r['request_id']}: your slots {mine}")
    assert mine == mi.slot_mapping[rows_of[r["request_id"]].start:rows_of[r["request_id"]].stop]

# %% [markdown]
# ### How vLLM does it differently
#
# vLLM v1 builds the same flat batch in `GPUModelRunner._prepare_inputs` (`vllm/v1/worker/gpu_model_runner.py`),
# but not from Python lists rebuilt every step:
#
# - The requests' state lives in a persistent `InputBatch`: token ids, `num_computed_tokens` and block tables in
#   preallocated CPU tensors, read and written through NumPy views, and updated incrementally as requests join,
#   leave or grow: a step only writes what changed.
# - The per-token fields are computed with NumPy over the whole batch at once: a request index per token
#   (`np.repeat`), positions as `num_computed_tokens[req_index] + offset`, token ids gathered from the flat
#   token array with those indices.
# - `query_start_loc` is its `cu_seqlens_q`; `seq_lens` is `num_computed_tokens + num_scheduled_tokens`, as here.
# - `slot_mapping` is computed from the block tables by the block table object itself, once per **KV cache
#   group** (models whose layers keep different kinds of cache, such as sliding-window and full attention, have
#   one block table per group).
# - The finished CPU buffers (pinned memory) are copied to persistent GPU buffers once per step, without
#   blocking, and each attention backend's metadata builder turns them into its own metadata. Batches are
#   padded up to a captured CUDA graph's size where graphs are used, and some backends reorder the batch so
#   that decodes come first.
#
# minivllm rebuilds the batch every step in one loop of list appends: the same numbers, less machinery.
#
# ## Check yourself
#
# Run this cell. It replays the lesson's claims on the next steps of the same engine (C's last chunk, then
# decodes), checking every field of every flat batch against the rules of section 2 and C's mask against
# section 4.

# %%
def self_check(engine):
    bs = engine.model_runner.block_size
    while engine.has_unfinished_requests():
        plan, mi, _ = step_and_capture(engine)
        row, cu = 0, [0]
        for r in plan:
            start, n, end, table = r["start"], r["n"], r["start"] + r["n"], r["block_table"]
            rows = slice(row, row + n)
            assert mi.positions[rows] == list(range(start, end))
            assert mi.slot_mapping[rows] == [table[p // bs] * bs + p % bs for p in range(start, end)]
            assert all(s // bs in table for s in mi.slot_mapping[rows])       # a request writes its own blocks only
            assert len(table) * bs >= end                                     # allocated before the step
            assert (row + n - 1 in mi.sample_rows) == (end == r["num_tokens"])
            assert (r["kind"] == "decode") == (n == 1 and start >= r["num_tokens"] - 1)
            row += n
            cu.append(row)
        assert mi.q_lens == [r["n"] for r in plan] and row == len(mi.input_ids)
        assert mi.seq_lens == [r["start"] + r["n"] for r in plan]
        assert all(len(t) == max(len(r["block_table"]) for r in plan) for t in mi.block_tables)
        assert model_input_tensors(mi, torch.device("cpu"))[2].cu_seqlens_q.tolist() == cu
    m = chunk_mask(14, 28)
    assert m[:, :14].all() and torch.equal(m[:, 14:], torch.ones(14, 14, dtype=torch.bool).tril())
    assert chunk_mask(1, 7).all()                                             # a decode sees its whole context
    assert engine.kv_cache_manager.num_free_blocks == engine.kv_cache_manager.num_blocks
    engine.check_integrity()
    return "all checks passed"


self_check(engine)

# %% [markdown]
# ## Where next
#
# The flat batch is what the kernels of lesson 06 consume: `slot_mapping` for the KV store, `block_tables`,
# `cu_seqlens_q` and `seq_lens` for paged attention. Lesson 10 measures where a decode step's time goes, and
# lesson 13's speculative decoding puts draft tokens into the same batch: a request verifying k drafts is a
# chunk of k + 1 rows, masked exactly like C's, with a sampled row for each.
