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
# # Lesson 01: the KV cache manager, the block pool and prefix caching
#
# Lesson 00 showed that the KV cache is one big tensor cut into fixed-size **blocks**, and that each request
# owns a list of block ids, its **block table**. This lesson opens the two modules that decide which block goes
# to whom, split the way vLLM v1 splits them:
#
# - `minivllm/core/block_pool.py`, the **`BlockPool`**: the physical blocks. It owns every block's **ref count**
#   (how many block tables list it) and **hash**, the free queues, the **prefix cache** (a map from a block's
#   hash to the block that holds that KV) and eviction. It knows nothing about requests.
# - `minivllm/core/kv_cache_manager.py`, the **`KVCacheManager`**: which blocks each request holds (it alone
#   writes `request.block_table`), the prefix-cache lookup for a new request, allocation (all or nothing), and
#   hashing a request's full blocks once the step that computed them has committed.
#
# (A third module, `swap_space.py`, holds the CPU tier for swap preemption; that is lesson 04's.)
#
# Neither touches a tensor. The model runner reads `request.block_table` and writes KV there; these modules only
# decide where. That makes them easy to study on their own: the first half of this lesson drives a
# `KVCacheManager` by hand with made-up token ids, no model at all. The second half runs the real engine: a
# shared system prompt and what the prefix cache saves, then a step that fails halfway and what is left of it.
#
# The pool's docstring names the three places a block can be. Keep this table in mind; every picture below
# colours blocks by it:
#
# ```
# in use         ref_count > 0    in the block tables of ref_count running requests
# cached-free    ref_count == 0   still holds the KV of a full, computed block, listed in the hash map:
#                                 free to reuse, but a request with the same prefix can take it back
# clean-free     ref_count == 0   holds nothing worth keeping
# ```

# %%
import warnings

warnings.filterwarnings("ignore", message="IProgress not found")   # tqdm's notice when ipywidgets is absent

import inspect

import matplotlib.pyplot as plt
import torch
from matplotlib.patches import Patch

from minivllm import LLM, SamplingParams
from minivllm.core.block_pool import ROOT_HASH, hash_block_tokens
from minivllm.core.journal import StepJournal
from minivllm.core.kv_cache_manager import KVCacheManager
from minivllm.core.request import Request
from plots import RequestColors, draw_pool, pool_legend

torch.manual_seed(0)
torch.set_num_threads(1)   # one thread: faster on a busy 2-core CPU, and the same float sums everywhere

# %% [markdown]
# ## 1. A pool of twelve blocks
#
# A real pool has thousands of blocks of 16 tokens. Here: 12 blocks of 4 tokens, so every token fits in the
# picture. Token ids are made-up numbers: `101 ... 108` play the part of a system prompt that many requests
# share, `2xx` are the user's own words, `3xx` are generated tokens.
#
# The manager is built with a `StepJournal`, the undo log of an engine step (section 10). Outside a step it
# records nothing, so for now it plays no part.

# %%
kv = KVCacheManager(num_blocks=12, block_size=4, journal=StepJournal())
pool = kv.block_pool
print(f"{kv.num_blocks} blocks of {kv.block_size} tokens; free: {kv.num_free_blocks}")
print("clean-free:", list(pool.clean_free))
print("cached-free:", list(pool.cached_free))

# %% [markdown]
# A `Request` is plain data: the token ids, how many of them already have KV (`num_computed_tokens`) and the
# block table. We make them by hand; no tokenizer, no model.

# %%
SYSTEM = [101, 102, 103, 104, 105, 106, 107, 108]    # two full blocks' worth
greedy = SamplingParams(temperature=0)

a = Request("A", SYSTEM + [201, 202, 203], greedy)
print(a)

# %% [markdown]
# ## 2. Allocate, compute, commit
#
# Every engine step does the same things to a scheduled request, and we will do them by hand:
#
# 1. `schedule()`: the scheduler asks `allocate_slots(request, n)` for room for `n` more tokens after
#    `num_computed_tokens`; the manager adds blocks to the block table if the last one is full (all or
#    nothing: it returns `False` and changes nothing if there are not enough free blocks). Nothing is hashed
#    here: room is not KV yet;
# 2. the model runner writes the KV of those `n` tokens into the blocks;
# 3. `update_from_output()`: the step succeeded, so the scheduler moves `num_computed_tokens` forward by `n`
#    (it is the only writer of that field) and calls `cache_blocks(request, num_computed_tokens)`, which hashes
#    every block that is now full and computed (sections 3 and 4); the sampled token is appended. It has no KV
#    yet: the next step computes it.
#
# The first step of a request computes its whole prompt (the **prefill**); every later step computes the
# one token sampled last time (a **decode**).

# %%
def run_step(kv, req, num_new_tokens, sampled_token, computed_blocks=()):
    """What the scheduler and the model runner do to one request in one step."""
    # 1. schedule(): room for the new tokens, after the prefix-cache hits (which join the block table first)
    assert kv.allocate_slots(req, num_new_tokens, computed_blocks), "no free blocks"
    req.num_computed_tokens += len(computed_blocks) * kv.block_size   # the hits' KV is already there
    # 2. the model runner writes the KV of the new tokens
    # 3. update_from_output(): the step committed
    req.num_computed_tokens += num_new_tokens
    kv.cache_blocks(req, req.num_computed_tokens)      # blocks now full and computed join the prefix cache
    req.append_output_token(sampled_token)             # the sampled token (no KV yet)


run_step(kv, a, a.num_tokens, 301)                 # prefill: 11 prompt tokens -> 3 blocks
print("after the prefill:", a)
run_step(kv, a, 1, 302)                            # decode: token 301 fills slot 12, the last of block 2
print("after a decode:   ", a)
run_step(kv, a, 1, 303)                            # decode: token 302 needs a 4th block
print("after a decode:   ", a)
print("free blocks:", kv.num_free_blocks)

# %% [markdown]
# (The status stays `waiting`: only the scheduler changes it, and we are standing in for the scheduler.)
#
# Eleven prompt tokens took three blocks, the last one with a free slot. The first decode filled that slot;
# the second needed a new block. A request takes memory one block at a time as it grows, never more than
# `ceil(tokens with KV / block_size)` blocks.
#
# ### The picture
#
# A drawing function we will reuse (the grid itself is `draw_pool` in `lessons/plots.py`): one cell per
# block, in the colour of the request that holds it, with its ref count and the tokens whose KV it holds. A
# block held by several requests (ref > 1) is hatched over its first holder's colour. Free blocks are grey: dark
# grey for cached-free (the tokens are still there and still findable), light grey for clean-free.

# %%
req_colors = RequestColors()                     # request id -> palette colour, in order of first appearance


def draw_tables(num_blocks, tables, ref_counts, cached_free, title, tokens=None, labels=None, cols=12, size=1.0,
                marked=(), marked_label=""):
    """The pool with these block tables on it. tables: {request_id: block table}; ref_counts: one per block;
    tokens: {block id: token ids} (optional); labels: {request_id: legend text} (optional); marked: blocks to
    outline in black dashes (legend text marked_label)."""
    texts = {b: " ".join(map(str, t[:2])) + "\n" + " ".join(map(str, t[2:]))   # two tokens per line
             for b, t in (tokens or {}).items() if t}
    rows = -(-num_blocks // cols)
    fig, ax = plt.subplots(figsize=(cols * size, rows * size + 1.0))
    draw_pool(ax, num_blocks, tables, ref_counts, cached_free, req_colors, texts=texts, marked=marked, cols=cols,
              title=title)
    labels = labels or {}
    legend = pool_legend({labels.get(rid, f"held by {rid}"): req_colors(rid) for rid in tables})
    if marked:
        legend.append(Patch(fill=False, edgecolor="black", lw=2, ls="--", label=marked_label))
    ax.legend(handles=legend, loc="upper center", bbox_to_anchor=(0.5, -0.01), ncol=3, fontsize=8, frameon=False)
    plt.show()


def block_tokens(kv, requests):
    """Which tokens' KV each block holds: from a holder's token list, or the block's own record when free."""
    out = {b.block_id: b.token_ids for b in kv.block_pool.blocks if b.token_ids}
    for r in requests:
        for i, b in enumerate(r.block_table):
            out[b] = tuple(r.all_token_ids[i * kv.block_size:min((i + 1) * kv.block_size, r.num_computed_tokens)])
    return out


def draw(kv, requests, title, **kwargs):
    """The pool of a bare KVCacheManager with these requests' block tables, and the tokens each block holds."""
    snap = kv.block_pool.snapshot()          # the whole pool: a ref count per block, the cached-free set
    draw_tables(kv.num_blocks, {r.request_id: r.block_table for r in requests}, snap.ref_counts, snap.cached_free,
              title, tokens=block_tokens(kv, requests), **kwargs)


# %%
# NBVAL_IGNORE_OUTPUT
draw(kv, [a], "A after its prefill and two decodes")

# %% [markdown]
# Block 3 holds only token 302: the newest token, 303, has no KV yet. Every block but the last is full.

# %%
assert a.block_table == [0, 1, 2, 3] and a.num_computed_tokens == 13
assert [b.ref_count for b in pool.blocks[:5]] == [1, 1, 1, 1, 0]
assert kv.num_free_blocks == 8

# %% [markdown]
# ## 3. Chained block hashes
#
# When the step that filled a block commits, `cache_blocks` gives the block a hash and enters it in the pool's
# hash map (`pool.hash_to_block`). The hash is **chained**: it covers the block's own tokens *and* the hash of
# the block before it,
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
    blk = pool.blocks[b]
    print(f"block {b}: tokens {blk.token_ids!s:22} hash {blk.block_hash}")
print("leading blocks hashed:", kv.num_cached_blocks["A"])

# %% [markdown]
# Blocks 0 to 2 are full and hashed: 0 and 1 when the prefill committed, 2 when the first decode did (it wrote
# the KV of token 301, in the block's last slot). Block 3 is not full, so it has no hash yet and cannot be
# shared. `num_cached_blocks` remembers how many leading blocks of each request are hashed, so the next
# `cache_blocks` starts there: hashing costs O(new blocks) per step, not a walk over the whole block table.
# We can recompute the chain ourselves:

# %%
h0 = hash_block_tokens(ROOT_HASH, (101, 102, 103, 104))
h1 = hash_block_tokens(h0, (105, 106, 107, 108))
h2 = hash_block_tokens(h1, (201, 202, 203, 301))
print([h0, h1, h2] == [pool.blocks[b].block_hash for b in a.block_table[:3]])
print("hash map:", {h: b for h, b in pool.hash_to_block.items()} == {h0: 0, h1: 1, h2: 2})

# %% [markdown]
# The same four tokens after a different prefix get a different hash, so they can never be confused:

# %%
other_prefix = hash_block_tokens(hash_block_tokens(ROOT_HASH, (999, 102, 103, 104)), (105, 106, 107, 108))
print("same tokens, same parent:     ", hash_block_tokens(h0, (105, 106, 107, 108)) == h1)
print("same tokens, different parent:", other_prefix == h1)

# %%
assert [pool.blocks[b].block_hash for b in a.block_table] == [h0, h1, h2, None]
assert other_prefix != h1 and kv.num_cached_blocks["A"] == 3

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
b_req = Request("B", SYSTEM + [211, 212, 213, 214, 215], greedy)
hits = kv.get_computed_blocks(b_req)
print("B's cached prefix:", hits, f"= {len(hits) * kv.block_size} tokens")

# %% [markdown]
# ### Exercise: find the longest cached prefix
#
# Before reading on, write that walk yourself. `longest_cached_prefix(token_ids, block_size, lookup)` returns
# the block ids of the longest run of cached **full** blocks that starts `token_ids`:
#
# - hash block i's tokens (a tuple) with `hash_block_tokens(parent, tokens)`, where `parent` is block i-1's
#   hash, and `ROOT_HASH` for block 0;
# - `lookup(block_hash, tokens)` (here the pool's own `pool.lookup`) gives the cached block id, or None;
# - stop at the first miss, and never take the whole prompt: at least one token must be left to compute,
#   because the step needs its logits to sample the next token.
#
# `check` runs your function on small hand-made caches, then on 30 random prompts against the real
# `KVCacheManager`, and says which case failed and how. (In CI the lessons run with the solutions, from
# `lessons/solutions/`; try first.)

# %%
from course import check, exercise


@exercise("01.longest_cached_prefix")
def longest_cached_prefix(token_ids, block_size, lookup):
    hits = []
    # your code here
    raise NotImplementedError


check(longest_cached_prefix)
print("B's cached prefix, by your function:", longest_cached_prefix(b_req.all_token_ids, kv.block_size, pool.lookup))

# %% [markdown]
# The real one, `KVCacheManager.get_computed_blocks`, does the same walk, and also looks in `pending` (blocks
# this very step computes, explained below):

# %%
print(inspect.getsource(KVCacheManager.get_computed_blocks))

# %% [markdown]
# Now allocate with the hits: they join B's block table first, the pool raises their ref counts
# (`pool.touch`), and the scheduler moves B's `num_computed_tokens` past them. Only the remaining 5 tokens
# need fresh blocks and model work.

# %%
run_step(kv, b_req, b_req.num_tokens - len(hits) * kv.block_size, 311, computed_blocks=hits)
print(b_req)
for blk in pool.blocks[:6]:
    print(f"block {blk.block_id}: ref_count={blk.ref_count}")

# %%
# NBVAL_IGNORE_OUTPUT
draw(kv, [a, b_req], "B shares A's two system-prompt blocks (ref 2)")

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
c_req = Request("C", list(SYSTEM), greedy)
print("C's cached prefix:", kv.get_computed_blocks(c_req), "of its", c_req.num_tokens // kv.block_size,
      "full blocks")

# %%
assert hits == [0, 1] and b_req.block_table[:2] == [0, 1]
assert pool.blocks[0].ref_count == pool.blocks[1].ref_count == 2
assert b_req.num_computed_tokens == 13 and b_req.num_cached_tokens == 0   # num_cached_tokens is set by the scheduler
assert kv.get_computed_blocks(c_req) == [0]

# %% [markdown]
# (`num_cached_tokens`, the count that ends up in `RequestOutput`, is recorded by the scheduler when it
# admits a request; we bypassed the scheduler here.)
#
# ### Sharing within one step
#
# B found A's blocks because A's step had committed. What if two requests with the same prefix arrive
# together and are admitted in the same step? Within one `schedule()` call the scheduler admits waiting
# requests one after the other, `get_computed_blocks` then `allocate_slots` for each. When it looks up the
# second, the first one's blocks are not in the hash map: their step has not even run.
#
# So after admitting a request the scheduler calls `register_pending(request, n)`: the full blocks that this
# step will compute for it are **offered** in `kv.pending` (hash → block), and `get_computed_blocks` looks
# there after the hash map. An offer lives only as long as the open step: `clear_pending()` at commit, and the
# journal takes it back if the step fails. (vLLM v1 gets the same sharing by hashing blocks in
# `allocate_slots`, before the forward; it can, because a failed step ends its engine. Section 10 shows why
# minivllm does not.)
#
# A fresh pool of 8 blocks. P and Q both start with the 8 system tokens and are admitted in the same step:

# %%
kv2 = KVCacheManager(num_blocks=8, block_size=4, journal=StepJournal())
pool2 = kv2.block_pool
p = Request("P", SYSTEM + [231, 232, 233], greedy)
q = Request("Q", SYSTEM + [241, 242], greedy)

kv2.journal.begin()                            # scheduler.begin_step()
# schedule(): admit P, then Q; the model has not run yet
assert kv2.allocate_slots(p, p.num_tokens, kv2.get_computed_blocks(p))
kv2.register_pending(p, p.num_tokens)          # offer the full blocks this step computes for P
q_hits = kv2.get_computed_blocks(q)
assert kv2.allocate_slots(q, q.num_tokens - len(q_hits) * kv2.block_size, q_hits)
q.num_computed_tokens = len(q_hits) * kv2.block_size
kv2.register_pending(q, q.num_tokens)
print("P:", p)
print("Q:", q, "  prefix hits:", q_hits)
print("offered:", {block: tokens for block, tokens in kv2.pending.values()})
print("hashed: ", {b: pool2.blocks[b].block_hash is not None for b in range(4)})

# %% [markdown]
# Q's `num_computed_tokens` is already 8, yet blocks 0 and 1 hold no KV so far: P's prefill computes them in
# this very step. That works because of how a step runs: P's 11 tokens and Q's 2 go through the model as one
# flat batch, and in every layer the model runner first stores the keys and values of *all* the batch's
# tokens in the cache and only then runs attention. When Q's two tokens attend to positions 0-7 in a layer,
# P has just written them. Now the step runs and commits, and only then are blocks 0 and 1 hashed:

# %%
for req, sampled in [(p, 331), (q, 341)]:      # update_from_output(): one flat batch, P's 11 tokens and Q's 2
    req.num_computed_tokens = req.num_tokens
    kv2.cache_blocks(req, req.num_computed_tokens)
    req.append_output_token(sampled)
kv2.clear_pending()                            # scheduler.commit_step()
kv2.journal.commit()
kv2.check_integrity([p, q])
print("P:", p)
print("Q:", q)
print("hashed: ", {b: pool2.blocks[b].block_hash is not None for b in range(4)}, " offered:", kv2.pending)

# %%
# NBVAL_IGNORE_OUTPUT
draw(kv2, [p, q], "P and Q, admitted in the same step, share blocks 0 and 1", cols=8)

# %% [markdown]
# ### Room is not KV
#
# The scheduler may make room for a request and then, in the same `schedule()` call, preempt it before its
# step runs (preemption is lesson 04). Since `allocate_slots` hashes nothing, there is nothing to take back:
# the request's blocks go back clean-free, and the prefix cache never heard of them. (The old block manager
# hashed blocks when it allocated them, and its `free()` had to guess from `num_computed_tokens` which hashed
# blocks really held KV. Section 10 shows a case where that guess went wrong.)
#
# R gets room for its 9-token prompt, then is freed before any step computes it:

# %%
r = Request("R", [501, 502, 503, 504, 505, 506, 507, 508, 509], greedy)
twin = Request("R2", list(r.prompt_token_ids), greedy)       # the same prompt, to probe the cache
assert kv2.allocate_slots(r, r.num_tokens)
print("R:", r, "  hashed:", [pool2.blocks[b].block_hash is not None for b in r.block_table])
print("R's twin would hit:", kv2.get_computed_blocks(twin))
kv2.free(r)                                    # preempted before its step ran
print("after free(R): cached-free:", list(pool2.cached_free), " clean-free:", list(pool2.clean_free))

# %%
assert q_hits == [0, 1] and q.block_table[:2] == p.block_table[:2] == [0, 1]
assert pool2.blocks[0].ref_count == pool2.blocks[1].ref_count == 2
assert not kv2.pending and set(pool2.hash_to_block.values()) == {0, 1}
assert not pool2.cached_free and kv2.get_computed_blocks(twin) == []
assert all(pool2.blocks[b].block_hash is None for b in (4, 5, 6))
kv2.check_integrity([p, q])

# %% [markdown]
# ## 5. Freeing: in use → cached-free or clean-free
#
# When A finishes, `free(A)` drops its hold on every block in its table. A block whose ref count reaches 0
# leaves "in use":
#
# - if it is hashed (so full and computed: only a committed step hashes) and it is the block the hash map
#   points to, it becomes **cached-free**: free, but its KV stays and can be found again;
# - otherwise (the partial last block, or a duplicate of a block already in the map) it becomes **clean-free**.
#
# Blocks 0 and 1 are still held by B, so they only drop to ref count 1.

# %%
kv.free(a)
print("A's block table:", a.block_table)
print("ref counts:  ", [blk.ref_count for blk in pool.blocks])
print("cached-free: ", list(pool.cached_free))
print("clean-free:  ", list(pool.clean_free))

# %%
# NBVAL_IGNORE_OUTPUT
draw(kv, [b_req], "A finished: its own full block is cached-free, its tail block clean-free")

# %% [markdown]
# Now B finishes too. `free` walks the block table **from the tail**, so a request's last blocks enter the
# cached-free list first. That list is kept in least-recently-freed order and eviction takes from its front,
# so the tail of a sequence is forgotten before its head: the head (the system prompt here) is what other
# requests are most likely to share.

# %%
kv.free(b_req)
print("cached-free, evicted first -> last:", list(pool.cached_free))
print("clean-free:                        ", list(pool.clean_free))

# %%
# NBVAL_IGNORE_OUTPUT
draw(kv, [], "Everyone finished: the prefix cache keeps 4 blocks of KV")

# %%
assert list(pool.cached_free) == [2, 4, 1, 0]
assert kv.num_free_blocks == kv.num_blocks and all(blk.ref_count == 0 for blk in pool.blocks)

# %% [markdown]
# ## 6. A hit revives a cached-free block
#
# Request D arrives with the system prompt again. Nobody holds blocks 0 and 1 now, but their KV is still in
# the pool, so D gets them back: they leave the cached-free list and their ref count goes 0 → 1.

# %%
d_req = Request("D", SYSTEM + [221, 222, 223, 224, 225, 226], greedy)
hits = kv.get_computed_blocks(d_req)
run_step(kv, d_req, d_req.num_tokens - len(hits) * kv.block_size, 321, computed_blocks=hits)
print("D:", d_req)
print("cached-free:", list(pool.cached_free))

# %%
assert d_req.block_table[:2] == [0, 1] and list(pool.cached_free) == [2, 4]

# %% [markdown]
# ## 7. Eviction, least recently freed first
#
# Fresh blocks come from the clean-free list first. Only when it is empty does the pool **evict** a
# cached-free block (`pool.take_fresh`): take the front of the LRU list, delete its hash from the map (its KV
# can no longer be found) and hand it out. Request E has nothing in common with anyone and needs 7 blocks;
# only 6 are clean-free, so one cached block has to go. `pool.pop_events()` returns what happened to blocks
# since it was last called (the engine's step trace is built from it).

# %%
pool.pop_events()                                        # start a fresh record
e_req = Request("E", list(range(400, 428)), greedy)      # 28 tokens = 7 blocks
print("clean-free before:", len(pool.clean_free), " cached-free before:", list(pool.cached_free))
run_step(kv, e_req, e_req.num_tokens, 331)
events = pool.pop_events()
print("allocated:", events.allocated)
print("evicted:  ", events.evicted)
print("cached-free after:", list(pool.cached_free))

# %%
# NBVAL_IGNORE_OUTPUT
draw(kv, [d_req, e_req], "E evicted block 2, the least recently freed; block 4 is still cached")

# %% [markdown]
# Block 2 was freed before block 4, so it went first. Its hash is gone from the map: a request that repeated
# A's whole prompt now hits only the system-prompt blocks.

# %%
a_again = Request("A2", SYSTEM + [201, 202, 203, 301, 302], greedy)
print("A's prompt again hits:", kv.get_computed_blocks(a_again))
print("evictions so far:", pool.num_evictions)

# %%
assert events.evicted == [2] and list(pool.cached_free) == [4]
assert kv.get_computed_blocks(a_again) == [0, 1]
assert all(blk.block_hash != h2 for blk in pool.blocks)

# %% [markdown]
# A free list that keeps useful data until the space is really needed costs nothing: an evicted block is
# exactly as useful as a clean one. That is why cached-free blocks count as **free** in `num_free_blocks` and
# `usage`: the scheduler can always have them.
#
# ## 8. `check_integrity()`
#
# Everything above must stay consistent: each ref count equals the number of block tables that list the
# block, every block is either in use or free (never both, never neither), every hash-map entry points at a
# block holding exactly those tokens, and every hashed block of a request lies within its computed tokens
# (a hashed block is a computed block). `kv.check_integrity(requests)` asserts all of it, given every request
# that may hold blocks; the pool checks its own part. The tests call it after every random operation; the
# engine exposes it as `engine.check_integrity()`.

# %%
kv.check_integrity([d_req, e_req])
print("consistent")

# %% [markdown]
# Break one thing on purpose, a ref count one too high (a "leak": the block could never be freed), and the
# check names the block and the numbers:

# %%
pool.blocks[5].ref_count += 1
try:
    kv.check_integrity([d_req, e_req])
except AssertionError as err:
    print("AssertionError:", err)
pool.blocks[5].ref_count -= 1
kv.check_integrity([d_req, e_req])

# %%
kv.free(d_req)
kv.free(e_req)
kv.check_integrity([])
assert kv.num_free_blocks == kv.num_blocks

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
# 4's rule at work in the real engine: the first request's full blocks were offered (`register_pending`) a
# moment before the scheduler looked up the second request, and in the forward pass that followed, every layer
# stored the KV of all four prompts before any attention read it. The first step's trace:

# %%
t1 = first_traces[0]
print(f"step {t1.step}: {'; '.join(t1.events)}")
print("ref counts of the hit blocks:", [t1.block_ref_counts[b] for b in sorted(set(t1.prefix_hit_blocks))])

# %% [markdown]
# Now the second batch, four new questions with the same system prompt, after the first batch has finished:

# %%
snapshots = []                   # the whole pool after each step (a trace lists only the blocks it touched)


def take_snapshot(trace):
    snapshots.append(engine.kv_cache_manager.block_pool.snapshot())


engine.add_trace_listener(take_snapshot)
with engine.record_traces() as second_traces:
    second = llm.chat(conversations(SECOND), params, use_tqdm=False)
engine.remove_trace_listener(take_snapshot)
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
# The first step of the second batch, from its trace: which blocks were hits, and the pool right after (the
# trace's `block_ref_counts` covers only the blocks the step touched; for the whole pool, the listener above
# took `block_pool.snapshot()` after every step):

# %%
t = second_traces[0]
print(f"step {t.step}: prefix hit on blocks {t.prefix_hit_blocks}")
print("events:", t.events)
print("ref counts of the hit blocks:", [t.block_ref_counts[b] for b in sorted(set(t.prefix_hit_blocks))])

# %%
# NBVAL_IGNORE_OUTPUT
questions = {out.request_id: out.prompt.split("user\n")[1].split("<|im_end|>")[0] for out in second}
draw_tables(t.num_kv_blocks, {r.request_id: list(r.block_table) for r in t.requests if r.block_table},
            snapshots[0].ref_counts, snapshots[0].cached_free,
            f"Step {t.step}: four requests share 3 system-prompt blocks (ref 4)", labels=questions, cols=16, size=0.62)

# %% [markdown]
# The three shared blocks are hatched and say `ref 4`, block 3 `ref 2`. The dark grey blocks are
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
# ## 10. When a step fails
#
# A step can fail halfway: the model raises (out of memory, a bad kernel), the sampler raises, or someone
# presses Ctrl-C while `llm.generate` runs. By then the scheduler has admitted requests, given them blocks and
# offered their full blocks for sharing, but the forward has not written their KV.
#
# The old block manager hashed blocks when it allocated them, so after such a failure the hash map listed
# blocks whose KV was never written, and its `free()` kept them cached whenever a request's
# `num_computed_tokens` said they were computed (a request admitted on a prefix hit says so before its step
# runs). The next request with the same prompt hit those blocks and attended to garbage, and `check_integrity()`
# saw nothing wrong. (On the core before this rewrite, the scenario below ends with our prompt answered
# `' the past.'`, from 12 "cached" prompt tokens, instead of `' Germany.\n\nThe capital of France'`.)
#
# Now every change the core makes during a step (the scheduler's queues, `num_computed_tokens`, block tables,
# ref counts, free queues, pending offers) is recorded in the step's `StepJournal` (`core/journal.py`) along
# with its undo. A write to an attribute stays a plain assignment, `req.num_computed_tokens = n`: the classes of
# the core (`Request`, `Block`, ...) are `Journaled`, and record the undo themselves while a step is open; a
# change to a queue or a free list records its undo on the line after it. `LLMEngine.step` opens the journal before `schedule()` and commits it after the step's tokens
# are in; if anything raises in between, `Scheduler.rollback_step()` replays the undos newest first and the
# exception goes on to the caller. Blocks are hashed only at commit, so a rolled-back step has hashed nothing.
#
# A small engine, 16 blocks of 4 tokens so the whole pool fits in one row. First the reference answer for our
# prompt; then `reset_prefix_cache()` so that the failing step below has to compute that prompt's blocks:

# %%
small = LLM(device="cpu", dtype="float32", num_kv_blocks=16, block_size=4, max_num_seqs=4, seed=0)
small_engine = small.llm_engine
short = SamplingParams(temperature=0, max_tokens=8)
PROMPT = "Paris is the capital of France, and Berlin is the capital of"   # 13 tokens: 3 full blocks and 1

reference = small.generate([PROMPT], short, use_tqdm=False)[0].outputs[0].text
small_engine.reset_prefix_cache()
print("reference:", repr(reference))

# X runs first, so that a request is already running (with hashed blocks) when the failure comes
small_engine.add_request("Paged attention stores the KV cache in", short, request_id="X")
small_engine.step()


def pool_state(engine):
    """Plain data: the running requests' blocks and computed tokens, and the whole pool."""
    pool = engine.kv_cache_manager.block_pool
    snap = pool.snapshot()
    return {"tables": {r.request_id: tuple(r.block_table) for r in engine.scheduler.running},
            "computed": {r.request_id: r.num_computed_tokens for r in engine.scheduler.running},
            "ref_counts": snap.ref_counts, "cached_free": snap.cached_free,
            "hashed": frozenset(pool.hash_to_block.values())}


def show(state):
    for rid, table in state["tables"].items():
        print(f"  request {rid}: blocks {list(table)}, {state['computed'][rid]} tokens computed")
    print(f"  hashed (in the prefix cache): {sorted(state['hashed'])}   cached-free: {sorted(state['cached_free'])}")


def draw_state(state, title, **kwargs):
    """The pool as pool_state recorded it."""
    labels = {rid: "X" if rid == "X" else f"request {rid}: the prompt" for rid in state["tables"]}
    draw_tables(len(state["ref_counts"]), state["tables"], state["ref_counts"], state["cached_free"], title,
                labels=labels, cols=16, size=0.62, **kwargs)


before = pool_state(small_engine)
print("before the step:")
show(before)

# %%
# NBVAL_IGNORE_OUTPUT
draw_state(before, f"Before: X holds blocks {list(before['tables']['X'])}, of which {sorted(before['hashed'])} are hashed")

# %% [markdown]
# Now `small.generate([PROMPT, PROMPT])`, the same prompt twice, as in the bug report. We replace the model
# runner's `execute_model` for one call with a function that looks at the pool and then raises
# `KeyboardInterrupt`, as if Ctrl-C arrived just as the forward began: the step's blocks are allocated, none of
# their KV is written. We also wrap the journal's `rollback` to count the undo actions it replays.

# %%
runner, journal = small_engine.model_runner, small_engine.scheduler.journal
seen = {}


def interrupted_forward(model_input):
    """Stands in for the model forward: record the pool mid-step, then fail before any KV is written."""
    kvm = small_engine.kv_cache_manager
    seen["state"] = pool_state(small_engine)
    seen["allocated"] = list(kvm.block_pool.events.allocated)              # handed out by this step
    seen["offered"] = sorted(block for block, _ in kvm.pending.values())   # the old code hashed these already
    raise KeyboardInterrupt


def counting_rollback():
    seen["undone"] = StepJournal.rollback(journal)
    return seen["undone"]


def generate_interrupted(prompts):
    """llm.generate, with Ctrl-C arriving in the first step's forward. Returns what reached the caller."""
    runner.execute_model = interrupted_forward     # instance attributes shadow the methods, for this call only
    journal.rollback = counting_rollback
    try:
        small.generate(prompts, short, use_tqdm=False)
        return "no exception"
    except KeyboardInterrupt:
        return "KeyboardInterrupt"
    finally:
        del runner.execute_model, journal.rollback


print("caller got:", generate_interrupted([PROMPT, PROMPT]))
print("during the failed step:")
show(seen["state"])
print("  blocks this step allocated:", seen["allocated"])
print("  offered for same-step sharing (the old code had already hashed them):", seen["offered"])

# %%
# NBVAL_IGNORE_OUTPUT
draw_state(seen["state"], f"During: the two copies share blocks {seen['offered']}, whose KV was never written",
           marked=seen["offered"], marked_label="hashed at allocation by the old code")

# %% [markdown]
# Both copies of the prompt were admitted with X's decode: the first got four fresh blocks, the second shared the
# first's three full ones (offered in this step) and got one of its own for its last token. Its
# `num_computed_tokens` already says 12, and nothing is hashed but X's two blocks. The blocks outlined in dashes
# are the ones the old code would have put in the hash map at that moment, with no KV in them. Then the forward
# failed, the engine rolled the step back and re-raised, and `generate` aborted its two requests and passed the
# `KeyboardInterrupt` on. After:

# %%
after = pool_state(small_engine)
show(after)
print("identical to before:", after == before)
print("undo actions replayed:", seen["undone"])
print("failed steps:", small_engine.get_stats().num_failed_steps, "  their requests:", small_engine.failed_request_ids)
small_engine.check_integrity()
print("integrity holds")

# %%
# NBVAL_IGNORE_OUTPUT
draw_state(after, "After the rollback: exactly as before")

# %% [markdown]
# Every block the step took is clean-free again, X is back where it was, and nothing of the prompt is in the
# prefix cache. (If the failed step had evicted cached-free blocks, the rollback would put them back, but
# without their hashes: the failed forward may have written into them, so they are no longer trusted.)
# X never noticed; the next request with the same prompt computes it from scratch and gives the reference text:

# %%
again = small.generate([PROMPT], short, use_tqdm=False)[0]
print(repr(again.outputs[0].text), f" ({again.num_cached_tokens} prompt tokens from the prefix cache)")
while small_engine.has_unfinished_requests():        # let X finish too
    small_engine.step()
small_engine.check_integrity()

# %%
assert after == before and seen["undone"] > 0
assert seen["offered"] and not set(seen["offered"]) & seen["state"]["hashed"], "nothing hashed before commit"
assert small_engine.failed_request_ids == ["X", "1", "2"] and small_engine.get_stats().num_failed_steps == 1
assert again.outputs[0].text == reference and again.num_cached_tokens == 0

# %% [markdown]
# > **How vLLM v1 does it differently.** The same design, with more cases: `vllm/v1/core/block_pool.py` keeps
# > the free blocks in a doubly linked list (`FreeKVCacheBlockQueue`) so a hit can take a block out of the
# > middle in O(1), and evicts from its front, as here. Its block hash (`vllm/v1/core/kv_cache_utils.py`)
# > covers the parent hash, the tokens and *extra keys* (LoRA adapter, multimodal inputs, a cache salt), with a
# > choice of hash function (`--prefix-caching-hash-algo`: SHA-256 or Python's builtin), and blocks are hashed
# > in `allocate_slots`, before the forward, not at commit. A model with several kinds of attention layers
# > (sliding window, full, Mamba) gets one block table per *KV cache group*, coordinated by
# > `KVCacheCoordinator`; minivllm has one group.

# %% [markdown]
# ## Check yourself
#
# Run this cell. It rebuilds the lesson's claims from scratch on fresh KV cache managers (sharing, chaining,
# never the whole prompt, tail-first freeing, LRU eviction, nothing hashed before a step commits, same-step
# offers that a rollback takes back), then asks the engines once more: a repeated conversation hits the cache
# and answers the same, and a second interrupted `generate` leaves the small engine as it found it.

# %%
def self_check(llm, small):
    kv = KVCacheManager(num_blocks=6, block_size=4, journal=StepJournal())
    pool = kv.block_pool
    x = Request("x", [1, 2, 3, 4, 5, 6, 7, 8, 9], greedy)
    run_step(kv, x, x.num_tokens, 10)
    assert x.block_table == [0, 1, 2] and [pool.blocks[b].ref_count for b in range(3)] == [1, 1, 1]
    assert pool.blocks[1].block_hash == hash_block_tokens(hash_block_tokens(ROOT_HASH, (1, 2, 3, 4)), (5, 6, 7, 8))
    y = Request("y", [1, 2, 3, 4, 5, 6, 7, 8], greedy)                 # fully cached prompt
    hit = kv.get_computed_blocks(y)
    assert hit == [0], "the last block of a fully cached prompt is recomputed"
    run_step(kv, y, y.num_tokens - 4, 11, computed_blocks=hit)
    assert pool.blocks[0].ref_count == 2
    kv.check_integrity([x, y])
    kv.free(x)
    kv.free(y)
    assert list(pool.cached_free)[:2] == [1, 0], "x's tail-side block is freed (and evicted) before its head"
    z = Request("z", list(range(50, 74)), greedy)                       # 24 tokens: all 6 blocks
    run_step(kv, z, z.num_tokens, 12)
    assert pool.pop_events().evicted == [1, 0]
    kv.free(z)
    kv.check_integrity([])

    kv = KVCacheManager(num_blocks=4, block_size=4, journal=StepJournal())   # a step that fails
    u, v = Request("u", [1, 2, 3, 4, 5], greedy), Request("v", [1, 2, 3, 4, 6], greedy)
    kv.journal.begin()
    assert kv.allocate_slots(u, u.num_tokens)
    assert not kv.block_pool.hash_to_block, "allocation hashes nothing"
    kv.register_pending(u, u.num_tokens)
    assert kv.get_computed_blocks(v) == [0], "a block is offered within the step that computes it"
    assert kv.journal.rollback() > 0                                     # the forward raised
    assert u.block_table == [] and kv.num_free_blocks == 4 and kv.get_computed_blocks(v) == []
    kv.check_integrity([u, v])

    sp = SamplingParams(temperature=0, max_tokens=8)
    conv = conversations(["What is a KV cache?"])
    before = llm.get_stats().prefix_cache_hits
    again = llm.chat(conv, sp, use_tqdm=False)[0]
    assert again.num_cached_tokens >= 48 and llm.get_stats().prefix_cache_hits > before
    assert again.outputs[0].token_ids == first[0].outputs[0].token_ids[:8]
    eng = llm.llm_engine
    assert eng.kv_cache_manager.num_free_blocks == eng.kv_cache_manager.num_blocks
    eng.check_integrity()

    state = pool_state(small.llm_engine)
    assert generate_interrupted([PROMPT, PROMPT]) == "KeyboardInterrupt"
    assert pool_state(small.llm_engine) == state, "a failed step leaves the pool as it found it"
    small.llm_engine.check_integrity()
    assert small.generate([PROMPT], short, use_tqdm=False)[0].outputs[0].text == reference
    return "all checks passed"


self_check(llm, small)

# %% [markdown]
# ## Where next
#
# Lesson 03 moves one level up, to the scheduler: each step it decides which requests run and how many tokens
# each, asks the KV cache manager for room, and splits long prompts into chunks. Lesson 04 is what happens when
# `allocate_slots` says no.
