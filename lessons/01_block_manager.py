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
# # Lesson 01: the block manager and prefix caching
#
# Lesson 00 showed that the KV cache is one big tensor cut into fixed-size **blocks**, and that each request
# owns a list of block ids, its **block table**. This lesson opens `minivllm/core/kv_cache_manager.py`, the module that
# decides which block goes to whom. It owns three things and nobody else touches them:
#
# - which blocks are free,
# - who holds each block (a **ref count** per block: how many block tables list it),
# - the **prefix cache**: a map from a block's hash to the block that holds that KV, so that a new request
#   whose prompt starts the same way can take the KV instead of computing it again.
#
# It never touches a tensor. The model runner reads `request.block_table` and writes KV there; the block
# manager only decides where. That makes it easy to study on its own: the first half of this lesson drives a
# `BlockManager` by hand with made-up token ids, no model at all. The second half runs the real engine with a
# shared system prompt and measures what the prefix cache saves.
#
# The module's docstring names the three places a block can be. Keep this table in mind; every picture below
# colours blocks by it:
#
# ```
# in use         ref_count > 0    in the block tables of ref_count running requests
# cached-free    ref_count == 0   still holds the KV of a full block, listed in the hash map:
#                                 free to reuse, but a request with the same prefix can take it back
# clean-free     ref_count == 0   holds nothing worth keeping
# ```

# %%
import warnings

warnings.filterwarnings("ignore", message="IProgress not found")   # tqdm's notice when ipywidgets is absent

import matplotlib.pyplot as plt
import torch
from matplotlib.patches import Patch, Rectangle

from minivllm import LLM, SamplingParams
from minivllm.core.kv_cache_manager import ROOT_HASH, BlockManager, hash_block_tokens
from minivllm.core.request import Request

torch.manual_seed(0)
torch.set_num_threads(1)   # one thread: faster on a busy 2-core CPU, and the same float sums everywhere

# %% [markdown]
# ## 1. A pool of twelve blocks
#
# A real pool has thousands of blocks of 16 tokens. Here: 12 blocks of 4 tokens, so every token fits in the
# picture. Token ids are made-up numbers: `101 ... 108` play the part of a system prompt that many requests
# share, `2xx` are the user's own words, `3xx` are generated tokens.

# %%
bm = BlockManager(num_blocks=12, block_size=4)
print(f"{bm.num_blocks} blocks of {bm.block_size} tokens; free: {bm.num_free_blocks}")
print("clean-free:", list(bm.clean_free))
print("cached-free:", list(bm.cached_free))

# %% [markdown]
# A `Request` is plain data: the token ids, how many of them already have KV (`num_computed_tokens`) and the
# block table. We make them by hand; no tokenizer, no model.

# %%
SYSTEM = [101, 102, 103, 104, 105, 106, 107, 108]    # two full blocks' worth
greedy = SamplingParams(temperature=0)

a = Request("A", None, SYSTEM + [201, 202, 203], greedy)
print(a)

# %% [markdown]
# ## 2. Allocate, compute, append
#
# Every engine step does the same three things to a scheduled request, and we will do them by hand:
#
# 1. the scheduler asks `allocate_slots(request, n)` for room for `n` more tokens after
#    `num_computed_tokens`; the block manager adds blocks to the block table if the last one is full
#    (all or nothing: it returns `False` and changes nothing if there are not enough free blocks), and gives
#    every block that these `n` tokens fill completely its hash, right away (more in sections 3 and 4);
# 2. the model writes the KV of those `n` tokens, and `num_computed_tokens` moves forward by `n`;
# 3. the sampler appends one new token. It has no KV yet: the next step computes it.
#
# The first step of a request computes its whole prompt (the **prefill**); every later step computes the
# one token sampled last time (a **decode**).

# %%
def run_step(bm, req, num_new_tokens, sampled_token, computed_blocks=None):
    """What the scheduler, the model runner and the engine do to one request in one step."""
    assert bm.allocate_slots(req, num_new_tokens, computed_blocks), "no free blocks"   # 1. room, blocks it fills hashed
    req.num_computed_tokens += num_new_tokens      # 2. the model wrote the KV of these tokens
    req.append_output_token(sampled_token)         # 3. the sampled token (no KV yet)


run_step(bm, a, a.num_tokens, 301)                 # prefill: 11 prompt tokens -> 3 blocks
print("after the prefill:", a)
run_step(bm, a, 1, 302)                            # decode: token 301 fills slot 12, the last of block 2
print("after a decode:   ", a)
run_step(bm, a, 1, 303)                            # decode: token 302 needs a 4th block
print("after a decode:   ", a)
print("free blocks:", bm.num_free_blocks)

# %% [markdown]
# (The status stays `waiting`: only the scheduler changes it, and we are standing in for the scheduler.)
#
# Eleven prompt tokens took three blocks, the last one with a free slot. The first decode filled that slot;
# the second needed a new block. A request takes memory one block at a time as it grows, never more than
# `ceil(tokens with KV / block_size)` blocks.
#
# ### The picture
#
# A drawing function we will reuse: one cell per block, coloured by the request that holds it (one band per
# holder when several do), with the ref count and the tokens whose KV it holds. Free blocks are grey: dark
# grey for cached-free (the tokens are still there and still findable), light grey for clean-free.

# %%
PALETTE = ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown"]
COLORS = {"A": "tab:blue", "B": "tab:orange", "D": "tab:green", "E": "tab:red"}   # one colour per request


def draw_pool(num_blocks, tables, ref_counts, cached_free, title, tokens=None, labels=None, cols=12, size=1.0):
    """One cell per block. tables: {request_id: block table}; tokens: {block id: token ids} (optional);
    labels: {request_id: legend text} (optional). Small cells show the ref count only where it is > 0."""
    colors = {rid: COLORS.get(rid, PALETTE[i % len(PALETTE)]) for i, rid in enumerate(tables)}
    holders = {}
    for rid, table in tables.items():
        for b in table:
            holders.setdefault(b, []).append(rid)
    rows = -(-num_blocks // cols)
    fig, ax = plt.subplots(figsize=(cols * size, rows * size + 0.8))
    for b in range(num_blocks):
        x, y = b % cols, rows - 1 - b // cols
        if b in holders:                                  # one horizontal band per holder
            band = 0.92 / len(holders[b])
            for k, rid in enumerate(holders[b]):
                ax.add_patch(Rectangle((x, y + 0.92 - (k + 1) * band), 0.92, band, color=colors[rid], alpha=0.55))
        else:
            ax.add_patch(Rectangle((x, y), 0.92, 0.92, color="#a9a9a9" if b in cached_free else "#ececec"))
        ax.text(x + 0.06, y + 0.84, f"{b}", ha="left", va="top", fontsize=8, fontweight="bold")
        if size >= 0.9 or ref_counts[b] > 0:
            ax.text(x + 0.86, y + 0.84 if size >= 0.9 else y + 0.12, f"ref {ref_counts[b]}", ha="right",
                    va="top" if size >= 0.9 else "bottom", fontsize=7)
        if tokens and tokens.get(b):
            t = tokens[b]
            ax.text(x + 0.46, y + 0.3, " ".join(map(str, t[:2])) + "\n" + " ".join(map(str, t[2:])),
                    ha="center", va="center", fontsize=7, family="monospace")
    labels = labels or {}
    legend = [Patch(color=c, alpha=0.55, label=labels.get(rid, f"held by {rid}")) for rid, c in colors.items()]
    legend += [Patch(color="#a9a9a9", label="cached-free"), Patch(color="#ececec", label="clean-free")]
    ax.legend(handles=legend, loc="upper center", bbox_to_anchor=(0.5, -0.01), ncol=3 if labels else len(legend),
              fontsize=8, frameon=False)
    ax.set_xlim(0, cols)
    ax.set_ylim(0, rows)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title(title)
    plt.show()


def block_tokens(bm, requests):
    """Which tokens' KV each block holds: from a holder's token list, or the block's own record when free."""
    out = {b.block_id: b.token_ids for b in bm.blocks if b.token_ids}
    for r in requests:
        for i, b in enumerate(r.block_table):
            out[b] = tuple(r.all_token_ids[i * bm.block_size:min((i + 1) * bm.block_size, r.num_computed_tokens)])
    return out


def draw(bm, requests, title, **kwargs):
    draw_pool(bm.num_blocks, {r.request_id: r.block_table for r in requests},
              [b.ref_count for b in bm.blocks], set(bm.cached_free), title, tokens=block_tokens(bm, requests),
              **kwargs)


# %%
# NBVAL_IGNORE_OUTPUT
draw(bm, [a], "A after its prefill and two decodes")

# %% [markdown]
# Block 3 holds only token 302: the newest token, 303, has no KV yet. Every block but the last is full.

# %%
assert a.block_table == [0, 1, 2, 3] and a.num_computed_tokens == 13
assert [b.ref_count for b in bm.blocks[:5]] == [1, 1, 1, 1, 0]
assert bm.num_free_blocks == 8

# %% [markdown]
# ## 3. Chained block hashes
#
# When `allocate_slots` makes room for the tokens that fill a block, it gives the block a hash and enters it in
# the hash map (`hash_to_block`) at once, before the model has run (section 4 shows why that is useful and why
# it is safe). The hash is **chained**: it covers the block's own tokens *and* the hash of the block before it,
#
# ```
# hash(block 0) = hash_block_tokens(ROOT_HASH,      tokens of block 0)
# hash(block i) = hash_block_tokens(hash(block i-1), tokens of block i)
# ```
#
# so two blocks have the same hash only if the whole prefix up to and including them is the same. That is
# exactly the condition for reusing KV: the key and value of a token depend on every token before it, not only
# on the tokens in its own block.

# %%
for i, b in enumerate(a.block_table):
    blk = bm.blocks[b]
    print(f"block {b}: tokens {blk.token_ids!s:22} hash {blk.block_hash}")

# %% [markdown]
# Blocks 0 to 2 are full and hashed: 0 and 1 by the prefill's `allocate_slots`, 2 by the first decode's, the
# one that made room for token 301 in its last slot. Block 3 is not full, so it has no hash yet and cannot be
# shared. We can recompute the chain ourselves:

# %%
h0 = hash_block_tokens(ROOT_HASH, (101, 102, 103, 104))
h1 = hash_block_tokens(h0, (105, 106, 107, 108))
h2 = hash_block_tokens(h1, (201, 202, 203, 301))
print([h0, h1, h2] == [bm.blocks[b].block_hash for b in a.block_table[:3]])
print("hash map:", {h: b for h, b in bm.hash_to_block.items()} == {h0: 0, h1: 1, h2: 2})

# %% [markdown]
# The same four tokens after a different prefix get a different hash, so they can never be confused:

# %%
other_prefix = hash_block_tokens(hash_block_tokens(ROOT_HASH, (999, 102, 103, 104)), (105, 106, 107, 108))
print("same tokens, same parent:     ", hash_block_tokens(h0, (105, 106, 107, 108)) == h1)
print("same tokens, different parent:", other_prefix == h1)

# %%
assert [bm.blocks[b].block_hash for b in a.block_table] == [h0, h1, h2, None]
assert other_prefix != h1

# %% [markdown]
# Python's hash of a tuple of ints is the same in every process (string hashing is randomised per process,
# int hashing is not), so these numbers are stable from run to run. A 64-bit hash can still collide in
# principle, so a hit also compares the block's stored token ids: a collision can cost a miss, never hand a
# request someone else's KV.
#
# ## 4. A second request with the same prefix
#
# Request B starts with the same 8 system tokens and then asks something else. Before allocating, the
# scheduler calls `get_computed_blocks(B)`: walk B's full blocks from the start, hash each, and stop at the
# first hash that is not in the map. That is the longest cached prefix. It changes nothing yet.

# %%
b_req = Request("B", None, SYSTEM + [211, 212, 213, 214, 215], greedy)
hits = bm.get_computed_blocks(b_req)
print("B's cached prefix:", hits, f"= {len(hits) * bm.block_size} tokens")

# %% [markdown]
# Now allocate with the hits: they join B's block table first, their ref counts go up, and B's
# `num_computed_tokens` jumps past them. Only the remaining 5 tokens need fresh blocks and model work.

# %%
run_step(bm, b_req, b_req.num_tokens - len(hits) * bm.block_size, 311, computed_blocks=hits)
print(b_req)
for blk in bm.blocks[:6]:
    print(f"block {blk.block_id}: ref_count={blk.ref_count}")

# %%
# NBVAL_IGNORE_OUTPUT
draw(bm, [a, b_req], "B shares A's two system-prompt blocks (ref 2)")

# %% [markdown]
# One physical block, two block tables, `ref_count == 2`: the KV of the system prompt exists once. Sharing
# is safe because nobody ever writes into a full block again; new tokens always go to a block of their own.
#
# ### Never the whole prompt
#
# What if a prompt is *entirely* cached? Request C is exactly the 8 system tokens, both blocks in the map.
# The model still has to run on at least one token: the logits for the first output token come from the last
# prompt token's forward pass. So `get_computed_blocks` stops one block short (it considers only the first
# `(num_tokens - 1) // block_size` blocks), and C recomputes its last block.

# %%
c_req = Request("C", None, list(SYSTEM), greedy)
print("C's cached prefix:", bm.get_computed_blocks(c_req), "of its", c_req.num_tokens // bm.block_size,
      "full blocks")

# %%
assert hits == [0, 1] and b_req.block_table[:2] == [0, 1]
assert bm.blocks[0].ref_count == bm.blocks[1].ref_count == 2
assert b_req.num_computed_tokens == 13 and b_req.num_cached_tokens == 0   # num_cached_tokens is set by the scheduler
assert bm.get_computed_blocks(c_req) == [0]

# %% [markdown]
# (`num_cached_tokens`, the count that ends up in `RequestOutput`, is recorded by the scheduler when it
# admits a request; we bypassed the scheduler here.)
#
# ### Sharing within one step
#
# B found A's blocks because A had run a step earlier. What if two requests with the same prefix arrive
# together and are admitted in the same step? Within one `schedule()` call the scheduler admits waiting
# requests one after the other, `get_computed_blocks` then `allocate_slots` for each. Since `allocate_slots`
# hashes the blocks that this step's tokens will fill, the first request's blocks are already in the hash map
# when the scheduler looks up the second, although no KV has been computed yet (vLLM v1 does the same).
#
# A fresh pool of 8 blocks. P and Q both start with the 8 system tokens and are admitted in the same step:

# %%
bm2 = BlockManager(num_blocks=8, block_size=4)
p = Request("P", None, SYSTEM + [231, 232, 233], greedy)
q = Request("Q", None, SYSTEM + [241, 242], greedy)

# schedule(): admit P, then Q; the model has not run yet
assert bm2.allocate_slots(p, p.num_tokens, bm2.get_computed_blocks(p))
q_hits = bm2.get_computed_blocks(q)
assert bm2.allocate_slots(q, q.num_tokens - len(q_hits) * bm2.block_size, q_hits)
print("P:", p)
print("Q:", q, "  prefix hits:", q_hits)
print("hashed:", {b: bm2.blocks[b].block_hash is not None for b in range(4)})

# %% [markdown]
# Q's `num_computed_tokens` is already 8, yet blocks 0 and 1 hold no KV so far: P's prefill computes them in
# this very step. That works because of how a step runs: P's 11 tokens and Q's 2 go through the model as one
# flat batch, and in every layer the model runner first stores the keys and values of *all* the batch's
# tokens in the cache and only then runs attention. When Q's two tokens attend to positions 0-7 in a layer,
# P has just written them. Now the step runs:

# %%
for req, sampled in [(p, 331), (q, 341)]:      # one flat batch: P's 11 tokens and Q's 2
    req.num_computed_tokens = req.num_tokens
    req.append_output_token(sampled)
bm2.check_integrity([p, q])
print("P:", p)
print("Q:", q)

# %%
# NBVAL_IGNORE_OUTPUT
draw(bm2, [p, q], "P and Q, admitted in the same step, share blocks 0 and 1", cols=8)

# %% [markdown]
# ### A step that never runs
#
# Hashing ahead has one risk: a block can be hashed for a step that then never computes its tokens. The
# scheduler may preempt a request it has already made room for in the same `schedule()` call (preemption is
# lesson 03), and then its hashed blocks hold nothing. `free()` checks for this: a block at or past
# `num_computed_tokens // block_size` never got its KV, so when its ref count reaches 0 its hash is dropped
# and it goes clean-free, not cached-free. Once a step is over, every block in the hash map holds computed KV.
#
# R gets room for its 9-token prompt (blocks 4 and 5 are hashed), then is freed before any step computes it:

# %%
r = Request("R", None, [501, 502, 503, 504, 505, 506, 507, 508, 509], greedy)
twin = Request("R2", None, list(r.prompt_token_ids), greedy)       # the same prompt, to probe the cache
assert bm2.allocate_slots(r, r.num_tokens)
print("R:", r, "  hashed:", [bm2.blocks[b].block_hash is not None for b in r.block_table])
print("R's twin would hit:", bm2.get_computed_blocks(twin))
bm2.free(r)                                    # preempted before its step ran: num_computed_tokens is 0
print("after free(R): hashed:", [bm2.blocks[b].block_hash is not None for b in (4, 5, 6)],
      " cached-free:", list(bm2.cached_free), " clean-free:", list(bm2.clean_free))
print("R's twin would hit:", bm2.get_computed_blocks(twin))

# %%
assert q_hits == [0, 1] and q.block_table[:2] == p.block_table[:2] == [0, 1]
assert bm2.blocks[0].ref_count == bm2.blocks[1].ref_count == 2
assert not bm2.cached_free and bm2.get_computed_blocks(twin) == []
assert all(bm2.blocks[b].block_hash is None for b in (4, 5, 6))
bm2.check_integrity([p, q])

# %% [markdown]
# ## 5. Freeing: in use → cached-free or clean-free
#
# When A finishes, `free(A)` drops its hold on every block in its table. A block whose ref count reaches 0
# leaves "in use":
#
# - if it is full, hashed and computed (and it is the block the hash map points to) it becomes
#   **cached-free**: free, but its KV stays and can be found again;
# - otherwise (the partial last block, or a block whose KV was never computed) it becomes **clean-free**.
#
# Blocks 0 and 1 are still held by B, so they only drop to ref count 1.

# %%
bm.free(a)
print("A's block table:", a.block_table)
print("ref counts:  ", [blk.ref_count for blk in bm.blocks])
print("cached-free: ", list(bm.cached_free))
print("clean-free:  ", list(bm.clean_free))

# %%
# NBVAL_IGNORE_OUTPUT
draw(bm, [b_req], "A finished: its own full block is cached-free, its tail block clean-free")

# %% [markdown]
# Now B finishes too. `free` walks the block table **from the tail**, so a request's last blocks enter the
# cached-free list first. That list is kept in least-recently-freed order and eviction takes from its front,
# so the tail of a sequence is forgotten before its head: the head (the system prompt here) is what other
# requests are most likely to share.

# %%
bm.free(b_req)
print("cached-free, evicted first -> last:", list(bm.cached_free))
print("clean-free:                        ", list(bm.clean_free))

# %%
# NBVAL_IGNORE_OUTPUT
draw(bm, [], "Everyone finished: the prefix cache keeps 4 blocks of KV")

# %%
assert list(bm.cached_free) == [2, 4, 1, 0]
assert bm.num_free_blocks == bm.num_blocks and all(blk.ref_count == 0 for blk in bm.blocks)

# %% [markdown]
# ## 6. A hit revives a cached-free block
#
# Request D arrives with the system prompt again. Nobody holds blocks 0 and 1 now, but their KV is still in
# the pool, so D gets them back: they leave the cached-free list and their ref count goes 0 → 1.

# %%
d_req = Request("D", None, SYSTEM + [221, 222, 223, 224, 225, 226], greedy)
hits = bm.get_computed_blocks(d_req)
run_step(bm, d_req, d_req.num_tokens - len(hits) * bm.block_size, 321, computed_blocks=hits)
print("D:", d_req)
print("cached-free:", list(bm.cached_free))

# %%
assert d_req.block_table[:2] == [0, 1] and list(bm.cached_free) == [2, 4]

# %% [markdown]
# ## 7. Eviction, least recently freed first
#
# Fresh blocks come from the clean-free list first. Only when it is empty does the block manager **evict** a
# cached-free block: take the front of the LRU list, delete its hash from the map (its KV can no longer be
# found) and hand it out. Request E has nothing in common with anyone and needs 7 blocks; only 6 are
# clean-free, so one cached block has to go. `pop_events()` returns what happened to blocks since it was
# last called (the engine's step trace is built from it).

# %%
bm.pop_events()                                          # start a fresh record
e_req = Request("E", None, list(range(400, 428)), greedy)   # 28 tokens = 7 blocks
print("clean-free before:", len(bm.clean_free), " cached-free before:", list(bm.cached_free))
run_step(bm, e_req, e_req.num_tokens, 331)
events = bm.pop_events()
print("allocated:", events.allocated)
print("evicted:  ", events.evicted)
print("cached-free after:", list(bm.cached_free))

# %%
# NBVAL_IGNORE_OUTPUT
draw(bm, [d_req, e_req], "E evicted block 2, the least recently freed; block 4 is still cached")

# %% [markdown]
# Block 2 was freed before block 4, so it went first. Its hash is gone from the map: a request that repeated
# A's whole prompt now hits only the system-prompt blocks.

# %%
a_again = Request("A2", None, SYSTEM + [201, 202, 203, 301, 302], greedy)
print("A's prompt again hits:", bm.get_computed_blocks(a_again))
print("evictions so far:", bm.num_evictions)

# %%
assert events.evicted == [2] and list(bm.cached_free) == [4]
assert bm.get_computed_blocks(a_again) == [0, 1]
assert all(blk.block_hash != h2 for blk in bm.blocks)

# %% [markdown]
# A free list that keeps useful data until the space is really needed costs nothing: an evicted block is
# exactly as useful as a clean one. That is why cached-free blocks count as **free** in `num_free_blocks` and
# `usage`: the scheduler can always have them.
#
# ## 8. `check_integrity()`
#
# Everything above must stay consistent: each ref count equals the number of block tables that list the
# block, every block is either in use or free (never both, never neither), every hash-map entry points at a
# block holding exactly those tokens, and so on. `check_integrity(requests)` asserts all of it, given every
# request that may hold blocks. The tests call it after every random operation; the engine exposes it as
# `engine.check_integrity()`.

# %%
bm.check_integrity([d_req, e_req])
print("consistent")

# %% [markdown]
# Break one thing on purpose, a ref count one too high (a "leak": the block could never be freed), and the
# check names the block and the numbers:

# %%
bm.blocks[5].ref_count += 1
try:
    bm.check_integrity([d_req, e_req])
except AssertionError as err:
    print("AssertionError:", err)
bm.blocks[5].ref_count -= 1
bm.check_integrity([d_req, e_req])

# %%
bm.free(d_req)
bm.free(e_req)
bm.check_integrity([])
assert bm.num_free_blocks == bm.num_blocks

# %% [markdown]
# ## 9. The real engine: a shared system prompt
#
# Chat applications send the same system prompt with every conversation, and it is often the longest part of
# the prompt. With prefix caching its KV is computed once and shared by everyone.
#
# A real engine with a 64-block pool (16 tokens per block), and a system prompt of about 60 tokens:

# %%
llm = LLM(num_kv_blocks=64, max_num_seqs=8, seed=0)
engine = llm.llm_engine
tokenizer = llm.get_tokenizer()

SYSTEM_PROMPT = ("You are a patient tutor in a course on how large language models are served. "
                 "Answer every question in one or two plain sentences, without lists, and say so when you are "
                 "not sure. Prefer everyday words to jargon, and give a concrete example when it helps.")


def conversations(questions):
    return [[{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": q}] for q in questions]


FIRST = ["What is a KV cache?", "Why are prompts processed in parallel?", "What does a tokenizer do?",
         "What is greedy decoding?"]
SECOND = ["What is a block table?", "Why share memory between requests?", "What is an attention head?",
          "What limits the batch size?"]
params = SamplingParams(temperature=0, max_tokens=16)



def prompt_ids(conversation):
    """The token ids llm.chat will send: the chat template applied, then tokenized."""
    text = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


all_ids = [prompt_ids(c) for c in conversations(FIRST + SECOND)]
common = min(next(i for i, (x, y) in enumerate(zip(all_ids[0], ids)) if x != y) for ids in all_ids[1:])
print(f"the 8 prompts have {min(map(len, all_ids))}-{max(map(len, all_ids))} tokens and share their first "
      f"{common}: {common // 16} full blocks of 16")

# %% [markdown]
# Send the first four conversations as one batch. `engine.record_traces()` is a context manager: every step
# run inside the `with` block appends its `StepTrace` to the list, and recording stops when the block ends.

# %%
with engine.record_traces() as first_traces:
    first = llm.chat(conversations(FIRST), params, use_tqdm=False)
for out in first:
    print(f"{len(out.prompt_token_ids)} prompt tokens, {out.num_cached_tokens:2d} cached  "
          f"{out.outputs[0].text!r}")

# %% [markdown]
# The four requests arrived together and were admitted in the same step, yet only the first computed the
# shared prefix: the others found its 3 system-prompt blocks (48 tokens) in the cache. The last one, "What is
# greedy decoding?", found a fourth block as well: its tokens 48-63 (the end of the system prompt,
# `<|im_end|>`, the user-turn markup and "What is") are the same as in "What is a KV cache?". That is section
# 4's rule at work in the real engine. The first request's blocks were hashed when the scheduler allocated them, a moment before
# it looked up the second request; in the forward pass that followed, every layer stored the KV of all four
# prompts before any attention read it. The first step's trace:

# %%
t1 = first_traces[0]
print(f"step {t1.step}: {'; '.join(t1.events)}")
print("ref counts of the hit blocks:", [t1.block_ref_counts[b] for b in sorted(set(t1.prefix_hit_blocks))])

# %% [markdown]
# Now the second batch, four new questions with the same system prompt, after the first batch has finished:

# %%
with engine.record_traces() as second_traces:
    second = llm.chat(conversations(SECOND), params, use_tqdm=False)
for out in second:
    print(f"{len(out.prompt_token_ids)} prompt tokens, {out.num_cached_tokens:2d} cached  "
          f"{out.outputs[0].text!r}")
stats = llm.get_stats()
print(f"prefix cache over both batches: {stats.prefix_cache_hits} of {stats.prefix_cache_queries} prompt tokens "
      f"looked up were hits, prefix_cache_hit_rate = {stats.prefix_cache_hit_rate:.3f}")

# %% [markdown]
# Every request of the second batch found the 3 system-prompt blocks (48 tokens), cached-free since the first
# batch finished, and computed only the rest. Two found the fourth block too: "What is a block table?" and
# "What is an attention head?" also begin their user turn with "What is". The cache knows nothing about system
# prompts or user turns; any shared run of full blocks from the start of a prompt is a hit.
# `prefix_cache_hit_rate` is vLLM's definition: cached prompt tokens over prompt tokens looked up, over the
# engine's life (both batches here).
#
# The first step of the second batch, from its trace: which blocks were hits, and the pool right after:

# %%
t = second_traces[0]
print(f"step {t.step}: prefix hit on blocks {t.prefix_hit_blocks}")
print("events:", t.events)
print("ref counts of the hit blocks:", [t.block_ref_counts[b] for b in sorted(set(t.prefix_hit_blocks))])

# %%
# NBVAL_IGNORE_OUTPUT
questions = {out.request_id: out.prompt.split("user\n")[1].split("<|im_end|>")[0] for out in second}
draw_pool(t.num_kv_blocks, {r.request_id: list(r.block_table) for r in t.requests if r.block_table},
          t.block_ref_counts, set(t.cached_free_blocks),
          f"Step {t.step}: four requests share 3 system-prompt blocks (ref 4)", labels=questions, cols=16, size=0.62)

# %% [markdown]
# The three shared blocks carry all four colours and `ref 4`, block 3 two. The dark grey blocks are
# cached-free leftovers of the first batch: the full blocks of its questions and answers. There is a single
# copy of the system prompt in the whole pool: only the very first request computed it, and everyone since
# has shared it.
#
# ### Same outputs, less work
#
# Prefix caching must never change an answer: the cached KV is the KV the model would have computed. A second
# engine with `enable_prefix_caching=False` runs the same two batches; the token ids must match exactly.

# %%
llm_off = LLM(num_kv_blocks=64, max_num_seqs=8, seed=0, enable_prefix_caching=False)
first_off = llm_off.chat(conversations(FIRST), params, use_tqdm=False)
second_off = llm_off.chat(conversations(SECOND), params, use_tqdm=False)

same = [on.outputs[0].token_ids == off.outputs[0].token_ids
        for on, off in zip(first + second, first_off + second_off)]
print("identical token ids:", same)
on_stats, off_stats = llm.get_stats(), llm_off.get_stats()
print(f"prompt tokens run through the model: {off_stats.num_prompt_tokens_computed} without the prefix cache, "
      f"{on_stats.num_prompt_tokens_computed} with it")
print(f"prefix cache hit rate: {off_stats.prefix_cache_hit_rate:.0%} without, "
      f"{on_stats.prefix_cache_hit_rate:.0%} with")

# %% [markdown]
# 0 + 48 + 48 + 64 = 160 prompt tokens of the first batch and 64 + 48 + 64 + 48 = 224 of the second were not
# computed: 384 of 593. With a 1,000-token system prompt and thousands of conversations, this is most of the
# prefill work of a chat server.

# %%
assert all(same)
assert [o.num_cached_tokens for o in first] == [0, 48, 48, 64]       # shared within the first step
assert first_traces[0].step == 1 and sorted(set(first_traces[0].prefix_hit_blocks)) == [0, 1, 2, 3]
assert [o.num_cached_tokens for o in second] == [64, 48, 64, 48]
assert off_stats.num_prompt_tokens_computed - on_stats.num_prompt_tokens_computed == 160 + 224
assert on_stats.prefix_cache_hits == 384 and off_stats.prefix_cache_hits == 0
engine.check_integrity()

# %% [markdown]
# ## Check yourself
#
# Run this cell. It rebuilds the lesson's claims from scratch on fresh block managers (sharing, chaining,
# never the whole prompt, tail-first freeing, LRU eviction, hashing at allocation and un-hashing a block
# whose step never ran), then asks the engine once more: a repeated conversation hits the cache and answers
# the same.

# %%
def self_check(llm):
    bm = BlockManager(num_blocks=6, block_size=4)
    x = Request("x", None, [1, 2, 3, 4, 5, 6, 7, 8, 9], greedy)
    run_step(bm, x, x.num_tokens, 10)
    assert x.block_table == [0, 1, 2] and [bm.blocks[b].ref_count for b in range(3)] == [1, 1, 1]
    assert bm.blocks[1].block_hash == hash_block_tokens(hash_block_tokens(ROOT_HASH, (1, 2, 3, 4)), (5, 6, 7, 8))
    y = Request("y", None, [1, 2, 3, 4, 5, 6, 7, 8], greedy)           # fully cached prompt
    hit = bm.get_computed_blocks(y)
    assert hit == [0], "the last block of a fully cached prompt is recomputed"
    run_step(bm, y, y.num_tokens - 4, 11, computed_blocks=hit)
    assert bm.blocks[0].ref_count == 2
    bm.check_integrity([x, y])
    bm.free(x)
    bm.free(y)
    assert list(bm.cached_free)[:2] == [1, 0], "x's tail-side block is freed (and evicted) before its head"
    z = Request("z", None, list(range(50, 74)), greedy)                 # 24 tokens: all 6 blocks
    run_step(bm, z, z.num_tokens, 12)
    assert bm.pop_events().evicted == [1, 0]
    bm.free(z)
    bm.check_integrity([])

    bm = BlockManager(num_blocks=4, block_size=4)                       # hashed at allocation
    u, v = Request("u", None, [1, 2, 3, 4, 5], greedy), Request("v", None, [1, 2, 3, 4, 6], greedy)
    assert bm.allocate_slots(u, u.num_tokens)
    assert bm.get_computed_blocks(v) == [0], "a block can be shared in the step that allocates it"
    bm.free(u)                                                          # u's step never ran
    assert bm.get_computed_blocks(v) == [] and not bm.cached_free, "a block without KV is not cached"
    bm.check_integrity([])

    sp = SamplingParams(temperature=0, max_tokens=8)
    conv = conversations(["What is a KV cache?"])
    before = llm.get_stats().prefix_cache_hits
    again = llm.chat(conv, sp, use_tqdm=False)[0]
    assert again.num_cached_tokens >= 48 and llm.get_stats().prefix_cache_hits > before
    assert again.outputs[0].token_ids == first[0].outputs[0].token_ids[:8]
    eng = llm.llm_engine
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
    eng.check_integrity()
    return "all checks passed"


self_check(llm)

# %% [markdown]
# ## Where next
#
# Lesson 02 moves one level up, to the scheduler: each step it decides which requests run and how many tokens
# each, asks this block manager for room, and splits long prompts into chunks. Lesson 03 is what happens when
# `allocate_slots` says no.
