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
# Neither touches a tensor. The model runner reads `request.block_table` and writes KV there; these modules only
# decide where. That makes them easy to study on their own: the first half of this lesson drives a
# `KVCacheManager` by hand with made-up token ids, no model at all. The second half runs the real engine: a
# shared system prompt and what the prefix cache saves. (Lesson 02 follows a step that fails halfway.)
#
# The three places a block can be (from the pool's docstring); every picture below colours blocks by them:
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
# The manager is built with a `StepJournal`, the undo log of an engine step (lesson 02). Outside a step it
# records nothing, so here it plays no part. A `Request` is plain data: the token ids, how many of them
# already have KV (`num_computed_tokens`) and the block table. We make them by hand; no tokenizer, no model.

# %%
kv = KVCacheManager(num_blocks=12, block_size=4, journal=StepJournal())
pool = kv.block_pool
print(f"{kv.num_blocks} blocks of {kv.block_size} tokens; free: {kv.num_free_blocks}")
print("clean-free:", list(pool.clean_free), " cached-free:", list(pool.cached_free))

SYSTEM = [101, 102, 103, 104, 105, 106, 107, 108]    # two full blocks' worth
greedy = SamplingParams(temperature=0)

a = Request("A", SYSTEM + [201, 202, 203], greedy)
print(a)

# %% [markdown]
# ## 2. Allocate, compute, commit
#
# Every engine step does the same things to a scheduled request, and we will do them by hand:
#
# 1. `schedule()`: `allocate_slots(request, n)` makes room for `n` more tokens after `num_computed_tokens`,
#    adding blocks to the block table as needed (all or nothing: `False`, and no change, if too few are free).
#    Nothing is hashed here: room is not KV yet;
# 2. the model runner writes the KV of those `n` tokens into the blocks;
# 3. `update_from_output()`: the step succeeded, so the scheduler (the only writer of `num_computed_tokens`)
#    moves it forward by `n` and calls `cache_blocks(request, num_computed_tokens)`, which hashes every block
#    now full and computed (section 3); the sampled token is appended, with no KV yet: the next step computes it.
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
assert a.block_table == [0, 1, 2, 3] and a.num_computed_tokens == 13 and kv.num_free_blocks == 8
assert [b.ref_count for b in pool.blocks[:5]] == [1, 1, 1, 1, 0]

# %% [markdown]
# Eleven prompt tokens took three blocks, the last one with a free slot. The first decode filled that slot; the
# second needed a new block. A request takes memory one block at a time as it grows, never more than
# `ceil(tokens with KV / block_size)` blocks. (The status stays `waiting`: only the scheduler changes it.)
#
# The picture: one cell per block (`draw_pool` in `lessons/plots.py`), in the colour of the request that holds
# it, with its ref count and the tokens whose KV it holds; a block held by several requests is hatched. Free
# blocks are grey: dark for cached-free (the tokens are still there and findable), light for clean-free.

# %%
req_colors = RequestColors()                     # request id -> palette colour, in order of first appearance


def draw_tables(num_blocks, tables, ref_counts, cached_free, title, tokens=None, labels=None, cols=12, size=1.0):
    """The pool with these block tables on it. tables: {request_id: block table}; ref_counts: one per block;
    tokens: {block id: token ids} (optional); labels: {request_id: legend text} (optional)."""
    texts = {b: " ".join(map(str, t[:2])) + "\n" + " ".join(map(str, t[2:]))   # two tokens per line
             for b, t in (tokens or {}).items() if t}
    rows = -(-num_blocks // cols)
    fig, ax = plt.subplots(figsize=(cols * size, rows * size + 1.0))
    draw_pool(ax, num_blocks, tables, ref_counts, cached_free, req_colors, texts=texts, cols=cols, title=title)
    legend = pool_legend({(labels or {}).get(rid, f"held by {rid}"): req_colors(rid) for rid in tables})
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
#
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
# We can recompute the chain ourselves, and see that the same four tokens after a different prefix get a
# different hash, so they can never be confused:

# %%
h0 = hash_block_tokens(ROOT_HASH, (101, 102, 103, 104))
h1 = hash_block_tokens(h0, (105, 106, 107, 108))
h2 = hash_block_tokens(h1, (201, 202, 203, 301))
print("recomputed:", [h0, h1, h2] == [pool.blocks[b].block_hash for b in a.block_table[:3]],
      " hash map:", pool.hash_to_block == {h0: 0, h1: 1, h2: 2})
other_prefix = hash_block_tokens(hash_block_tokens(ROOT_HASH, (999, 102, 103, 104)), (105, 106, 107, 108))
print("same tokens, same parent:     ", hash_block_tokens(h0, (105, 106, 107, 108)) == h1)
print("same tokens, different parent:", other_prefix == h1)
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
# `check` runs your function on small hand-made caches, then on random prompts against the real
# `KVCacheManager`, and says which case failed and how. (The solutions are in `lessons/solutions/`; try first.)

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
# this very step computes, section 4):

# %%
print(inspect.getsource(KVCacheManager.get_computed_blocks))

# %% [markdown]
# Now allocate with the hits: they join B's block table first, the pool raises their ref counts
# (`pool.touch`), and the scheduler moves B's `num_computed_tokens` past them. Only the remaining 5 tokens
# need fresh blocks and model work.

# %%
run_step(kv, b_req, b_req.num_tokens - len(hits) * kv.block_size, 311, computed_blocks=hits)
print(b_req)
print("ref counts of blocks 0-5:", [blk.ref_count for blk in pool.blocks[:6]])

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
assert hits == [0, 1] and b_req.block_table[:2] == [0, 1]
assert pool.blocks[0].ref_count == pool.blocks[1].ref_count == 2
assert b_req.num_computed_tokens == 13 and b_req.num_cached_tokens == 0   # the scheduler sets num_cached_tokens
assert kv.get_computed_blocks(c_req) == [0]

# %% [markdown]
# ### Sharing within one step
#
# B found A's blocks because A's step had committed. Two requests with the same prefix admitted in the same
# step find nothing in the hash map: no KV exists yet. So after admitting a request the scheduler calls
# `register_pending(request, n)`, which **offers** the full blocks this step will compute for it in
# `kv.pending`; `get_computed_blocks` looks there after the hash map. In every layer the model runner stores the
# K and V of *all* the batch's tokens before it runs attention, so the second request reads what the first has
# just written. Lesson 02 shows offers and commits at work; section 9 shows the effect.
#
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
assert list(pool.cached_free) == [2, 4, 1, 0]
assert kv.num_free_blocks == kv.num_blocks and all(blk.ref_count == 0 for blk in pool.blocks)

# %%
# NBVAL_IGNORE_OUTPUT
draw(kv, [], "Everyone finished: the prefix cache keeps 4 blocks of KV")

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
a_again = Request("A2", SYSTEM + [201, 202, 203, 301, 302], greedy)
print("A's prompt again hits:", kv.get_computed_blocks(a_again))
assert events.evicted == [2] and list(pool.cached_free) == [4]
assert kv.get_computed_blocks(a_again) == [0, 1]
assert all(blk.block_hash != h2 for blk in pool.blocks)

# %% [markdown]
# Block 2 was freed before block 4, so it went first. Its hash is gone from the map: a request that repeated
# A's whole prompt now hits only the system-prompt blocks.

# %%
# NBVAL_IGNORE_OUTPUT
draw(kv, [d_req, e_req], "E evicted block 2, the least recently freed; block 4 is still cached")

# %% [markdown]
# A free list that keeps useful data until the space is really needed costs nothing: an evicted block is
# exactly as useful as a clean one. That is why cached-free blocks count as **free** in `num_free_blocks` and
# `usage`: the scheduler can always have them.
#
# ## 8. `check_integrity()`
#
# `kv.check_integrity(requests)`, given every request that may hold blocks, asserts that all of the above is
# consistent: each ref count equals the number of block tables that list the block, every block is in use or
# free (never both, never neither), every hash-map entry points at a block holding exactly those tokens, and
# every hashed block lies within its request's computed tokens. The tests call it after every random operation;
# the engine exposes it as `engine.check_integrity()`. Break one thing on purpose, a ref count one too high (a
# "leak": the block could never be freed), and the check names the block and the numbers:

# %%
kv.check_integrity([d_req, e_req])
pool.blocks[5].ref_count += 1
try:
    kv.check_integrity([d_req, e_req])
except AssertionError as err:
    print("AssertionError:", err)
pool.blocks[5].ref_count -= 1
kv.check_integrity([d_req, e_req])
kv.free(d_req)
kv.free(e_req)
kv.check_integrity([])
assert kv.num_free_blocks == kv.num_blocks

# %% [markdown]
# ## 9. The real engine: a shared system prompt
#
# Chat applications send the same system prompt with every conversation, often the longest part of the prompt.
# With prefix caching its KV is computed once and shared. A real engine with a 64-block pool (16 tokens per
# block), and a system prompt of about 60 tokens:

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

all_ids = [tokenizer.encode(tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True),
                            add_special_tokens=False) for c in conversations(FIRST + SECOND)]   # what llm.chat sends
common = min(next(i for i, (x, y) in enumerate(zip(all_ids[0], ids)) if x != y) for ids in all_ids[1:])
print(f"the 8 prompts have {min(map(len, all_ids))}-{max(map(len, all_ids))} tokens and share their first "
      f"{common}: {common // 16} full blocks of 16")

# %% [markdown]
# Send the first four conversations as one batch. `engine.record_traces()` is a context manager: every step
# run inside the `with` block appends its `StepTrace` to the list, and recording stops when the block ends.

# %%
def show(outputs):
    for out in outputs:
        print(f"{len(out.prompt_token_ids)} prompt tokens, {out.num_cached_tokens:2d} cached  {out.outputs[0].text!r}")


with engine.record_traces() as first_traces:
    first = llm.chat(conversations(FIRST), params, use_tqdm=False)
show(first)

# %% [markdown]
# The four requests arrived together and were admitted in the same step, yet only the first computed the
# shared prefix: the others found its 3 system-prompt blocks (48 tokens) in the cache. The last one, "What is
# greedy decoding?", found a fourth block as well: its tokens 48-63 (the end of the system prompt,
# `<|im_end|>`, the user-turn markup and "What is") are the same as in "What is a KV cache?". That is sharing
# within one step (section 4): the first request's full blocks were offered a moment before the scheduler
# looked up the others.
#
# Now the second batch, four new questions with the same system prompt, after the first batch has finished:

# %%
snapshots = []                   # the whole pool after each step (a trace lists only the blocks it touched)
take_snapshot = lambda trace: snapshots.append(engine.kv_cache_manager.block_pool.snapshot())   # noqa: E731
engine.add_trace_listener(take_snapshot)
with engine.record_traces() as second_traces:
    second = llm.chat(conversations(SECOND), params, use_tqdm=False)
engine.remove_trace_listener(take_snapshot)
show(second)
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
# The pool right after the first step of the second batch (a step's trace lists only the blocks it touched;
# the listener above took the whole pool's `block_pool.snapshot()` after every step):

# %%
# NBVAL_IGNORE_OUTPUT
t = second_traces[0]
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
assert all(same)
assert [o.num_cached_tokens for o in first] == [0, 48, 48, 64]       # shared within the first step
assert first_traces[0].step == 1 and sorted(set(first_traces[0].prefix_hit_blocks)) == [0, 1, 2, 3]
assert [o.num_cached_tokens for o in second] == [64, 48, 64, 48]
assert off_stats.num_prompt_tokens_computed - on_stats.num_prompt_tokens_computed == 160 + 224
assert on_stats.prefix_cache_hits == 384 and off_stats.prefix_cache_hits == 0
engine.check_integrity()

# %% [markdown]
# 0 + 48 + 48 + 64 = 160 prompt tokens of the first batch and 64 + 48 + 64 + 48 = 224 of the second were not
# computed: 384 of 593. With a 1,000-token system prompt and thousands of conversations, this is most of the
# prefill work of a chat server.
#
# > **How vLLM v1 does it differently.** The same design, with more cases: `vllm/v1/core/block_pool.py` keeps
# > the free blocks in a doubly linked list (`FreeKVCacheBlockQueue`) so a hit can take a block out of the
# > middle in O(1), and evicts from its front, as here. Its block hash (`vllm/v1/core/kv_cache_utils.py`)
# > covers the parent hash, the tokens and *extra keys* (LoRA adapter, multimodal inputs, a cache salt), with a
# > choice of hash function (`--prefix-caching-hash-algo`: SHA-256 or Python's builtin), and blocks are hashed
# > in `allocate_slots`, before the forward, not at commit (lesson 02 says why minivllm waits). A model with
# > several kinds of attention layers (sliding window, full, Mamba) gets one block table per *KV cache group*,
# > coordinated by `KVCacheCoordinator`; minivllm has one group.

# %% [markdown]
# ## Check yourself
#
# Run this cell. It rebuilds the lesson's claims on a fresh KV cache manager (chaining, sharing, never the whole
# prompt, tail-first freeing, LRU eviction); then a repeated conversation hits the cache and answers the same.

# %%
def self_check(llm):
    kv = KVCacheManager(num_blocks=6, block_size=4, journal=StepJournal())
    pool = kv.block_pool
    x, y = Request("x", [1, 2, 3, 4, 5, 6, 7, 8, 9], greedy), Request("y", [1, 2, 3, 4, 5, 6, 7, 8], greedy)
    run_step(kv, x, x.num_tokens, 10)
    assert x.block_table == [0, 1, 2] and [pool.blocks[b].ref_count for b in range(3)] == [1, 1, 1]
    assert pool.blocks[1].block_hash == hash_block_tokens(hash_block_tokens(ROOT_HASH, (1, 2, 3, 4)), (5, 6, 7, 8))
    hit = kv.get_computed_blocks(y)                                     # y's prompt is entirely cached
    assert hit == [0], "the last block of a fully cached prompt is recomputed"
    run_step(kv, y, y.num_tokens - 4, 11, computed_blocks=hit)
    assert pool.blocks[0].ref_count == 2
    kv.check_integrity([x, y])
    kv.free(x), kv.free(y)
    assert list(pool.cached_free)[:2] == [1, 0], "x's tail-side block is freed (and evicted) before its head"
    z = Request("z", list(range(50, 74)), greedy)                       # 24 tokens: all 6 blocks
    run_step(kv, z, z.num_tokens, 12)
    assert pool.pop_events().evicted == [1, 0]

    again = llm.chat(conversations(["What is a KV cache?"]), SamplingParams(temperature=0, max_tokens=8),
                     use_tqdm=False)[0]
    assert again.num_cached_tokens >= 48 and again.outputs[0].token_ids == first[0].outputs[0].token_ids[:8]
    assert llm.llm_engine.kv_cache_manager.num_free_blocks == llm.llm_engine.kv_cache_manager.num_blocks
    llm.llm_engine.check_integrity()
    return "all checks passed"


self_check(llm)

# %% [markdown]
# ## Where next
#
# Lesson 02 follows a step that fails halfway, and the undo log that puts every block back. Lesson 03 is the
# scheduler: which requests run each step, how many tokens each, and long prompts cut into chunks. Lesson 04 is
# what happens when `allocate_slots` says no.
