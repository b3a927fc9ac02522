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
# # Lesson 02: when a step fails
#
# Every engine step changes the core: the scheduler admits requests and moves them between queues, the KV cache
# manager hands out blocks and offers them for sharing, ref counts go up and down. Then the model runs. A step
# can fail halfway: the forward raises (out of memory, a bad kernel), the sampler raises, or someone presses
# Ctrl-C while `llm.generate` runs. By then the core has changed, but no KV was written.
#
# minivllm makes a step **all or nothing**: if anything raises between the start of `schedule()` and the
# moment the step's tokens are in, the core goes back exactly to where it was before the step, and the
# exception goes on to the caller. The engine keeps serving. The pieces, under `minivllm/`:
#
# ```
# core/journal.py          StepJournal: the undo log of one step (begin, record, commit, rollback)
# core/scheduler.py        begin_step / commit_step / rollback_step around each step
# core/kv_cache_manager.py pending offers (sharing within a step) and hashing only at commit
# engine/llm_engine.py     step(): opens the journal, runs the step, commits it or rolls it back
# ```
#
# The lesson goes from the mechanism to the engine: 1. the journal on its own; 2. what a step may promise
# before its KV exists (offers) and what it must not (hashes); 3. a step rolled back by hand; 4. the
# exercise: a journaled allocation; 5. the real engine, interrupted in the middle of a forward.

# %%
import warnings

warnings.filterwarnings("ignore", message="IProgress not found")   # tqdm's notice when ipywidgets is absent

import inspect
from collections import deque

import matplotlib.pyplot as plt
import torch
from matplotlib.patches import Patch

from minivllm import LLM, SamplingParams
from minivllm.core.journal import Journaled, StepJournal
from minivllm.core.kv_cache_manager import KVCacheManager
from minivllm.core.request import Request, RequestStatus
from plots import RequestColors, draw_pool, pool_legend

torch.manual_seed(0)
torch.set_num_threads(1)   # one thread: faster on a busy 2-core CPU, and the same float sums everywhere
greedy = SamplingParams(temperature=0)
req_colors = RequestColors()                     # request id -> palette colour, in order of first appearance


def draw_tables(num_blocks, tables, ref_counts, cached_free, title, labels=None, cols=16, size=0.62,
                marked=(), marked_label=""):
    """The pool (`draw_pool` in lessons/plots.py) with these block tables on it: tables {request_id: block
    table}, a ref count per block, the cached-free set; marked blocks are outlined in dashes."""
    fig, ax = plt.subplots(figsize=(cols * size, -(-num_blocks // cols) * size + 1.0))
    draw_pool(ax, num_blocks, tables, ref_counts, cached_free, req_colors, marked=marked, cols=cols, title=title)
    legend = pool_legend({(labels or {}).get(rid, f"held by {rid}"): req_colors(rid) for rid in tables})
    if marked:
        legend.append(Patch(fill=False, edgecolor="black", lw=2, ls="--", label=marked_label))
    ax.legend(handles=legend, loc="upper center", bbox_to_anchor=(0.5, -0.01), ncol=3, fontsize=8, frameon=False)
    plt.show()


def draw(kv, requests, title, **kwargs):
    """The pool of a bare KVCacheManager with these requests' block tables."""
    snap = kv.block_pool.snapshot()          # a ref count per block, the cached-free set
    draw_tables(kv.num_blocks, {r.request_id: r.block_table for r in requests}, snap.ref_counts, snap.cached_free,
                title, **kwargs)


# %% [markdown]
# ## 1. The journal
#
# A `StepJournal` is a list of undo actions. `begin()` opens it; while it is open, every change to the core
# records how to undo itself; `commit()` throws the list away; `rollback()` runs it **newest first** and returns
# how many actions it replayed. Outside a step `record` does nothing: a change made between steps (a new
# request arriving) is final at once.
#
# Two kinds of change record their undo in two ways. An attribute of a core object stays a plain assignment,
# `req.num_computed_tokens = n`: the core's classes (`Request`, `Block`, ...) are `Journaled`, and their
# `__setattr__` records the old value itself when the attribute is one of the class's `JOURNALED` fields:

# %%
print(inspect.getsource(Journaled.__setattr__))
print("Request's journaled fields:", sorted(Request.JOURNALED))

# %% [markdown]
# A change to a container (a queue, a free list, a hash map) records its undo on the line after it, as
# `BlockPool.take_fresh` does: `block_id = self.clean_free.popleft()`, then
# `self.journal.record(lambda: self.clean_free.appendleft(block_id))`. Both kinds, on a request and a queue:

# %%
journal = StepJournal()
waiting, running = deque(["r"]), []
r = Request("r", [1, 2, 3, 4, 5], greedy)
r.journal = journal                              # the scheduler gives every request the core's journal

journal.begin()                                  # scheduler.begin_step()
waiting.popleft()                                # admit r: out of the waiting queue ...
journal.record(lambda: waiting.appendleft("r"))
running.append("r")                              # ... into the running list
journal.record(running.pop)
r.status = RequestStatus.RUNNING                 # journaled fields: plain assignments
r.num_computed_tokens = 5
r.num_computed_tokens = 6                        # a second write: a second undo
print("during the step:", list(waiting), running, r.status.name, r.num_computed_tokens)
print("undo actions replayed:", journal.rollback())
print("after rollback: ", list(waiting), running, r.status.name, r.num_computed_tokens)
r.num_computed_tokens = 9                        # no step open: final, nothing recorded
print("outside a step: ", r.num_computed_tokens)

# %%
assert list(waiting) == ["r"] and running == [] and r.status == RequestStatus.WAITING
assert not journal.is_open and r.num_computed_tokens == 9

# %% [markdown]
# Newest first matters: `num_computed_tokens` was written twice, 0 → 5 → 6; undoing the second write gives 5,
# and then undoing the first gives 0. Replayed oldest first, it would end on 5. Each undo restores only what
# its own change altered, so the reverse replay rebuilds the state one piece at a time.
#
# ## 2. What a step may promise before its KV exists
#
# Lesson 01 hashed a block only when the step that computed it committed (`cache_blocks` in
# `update_from_output`), and let requests admitted in the same step share blocks through **offers**
# (`register_pending`). Both are there for the failure case. A hashed block is a promise to every later request:
# "this block holds the KV of this prefix". If a step hashed its blocks when it allocated them and then failed,
# the hash map would list blocks whose KV was never written, and the next request with the same prompt would
# attend to garbage, with every check still passing. An offer is a smaller promise: it lives in `kv.pending`,
# only until the step ends, and only for requests of the same step, which run in the same forward or not at all.
#
# A pool of 8 blocks of 4 tokens. P and Q both start with the same 8 tokens and are admitted in the same step:

# %%
kv = KVCacheManager(num_blocks=8, block_size=4, journal=StepJournal())
pool = kv.block_pool
SHARED = [101, 102, 103, 104, 105, 106, 107, 108]
p = Request("P", SHARED + [231, 232, 233], greedy)
q = Request("Q", SHARED + [241, 242], greedy)

kv.journal.begin()                             # scheduler.begin_step()
# schedule(): admit P, then Q; the model has not run yet
assert kv.allocate_slots(p, p.num_tokens, kv.get_computed_blocks(p))
kv.register_pending(p, p.num_tokens)           # offer the full blocks this step computes for P
q_hits = kv.get_computed_blocks(q)
assert kv.allocate_slots(q, q.num_tokens - len(q_hits) * kv.block_size, q_hits)
q.num_computed_tokens = len(q_hits) * kv.block_size
kv.register_pending(q, q.num_tokens)
print("P:", p)
print("Q:", q, "  prefix hits:", q_hits)
print("offered:", {block: tokens for block, tokens in kv.pending.values()})
print("hashed: ", {b: pool.blocks[b].block_hash is not None for b in range(4)})

# %% [markdown]
# Q's `num_computed_tokens` is already 8, yet blocks 0 and 1 hold no KV so far: P's prefill computes them in
# this very step. P's 11 tokens and Q's 2 go through the model as one flat batch, and in every layer the model
# runner first stores the keys and values of *all* the batch's tokens and only then runs attention: when Q's
# tokens attend to positions 0-7, P has just written them. The step runs and commits; only now are blocks 0 and
# 1 hashed, and the offers end:

# %%
for req, sampled in [(p, 331), (q, 341)]:      # update_from_output(): one flat batch, P's 11 tokens and Q's 2
    req.num_computed_tokens = req.num_tokens
    kv.cache_blocks(req, req.num_computed_tokens)
    req.append_output_token(sampled)
kv.clear_pending()                             # scheduler.commit_step()
kv.journal.commit()
kv.check_integrity([p, q])
print("hashed: ", {b: pool.blocks[b].block_hash is not None for b in range(4)}, " offered:", kv.pending)

# %%
# NBVAL_IGNORE_OUTPUT
draw(kv, [p, q], "P and Q, admitted in the same step, share blocks 0 and 1", cols=8, size=1.0)

# %% [markdown]
# ### Room is not KV
#
# The scheduler may also make room for a request and then, in the same `schedule()` call, preempt it before its
# step runs (lesson 04). Since `allocate_slots` hashes nothing, there is nothing to take back: the blocks go back
# clean-free, and the prefix cache never heard of them. R gets room for its 9-token prompt, then is freed:

# %%
r = Request("R", [501, 502, 503, 504, 505, 506, 507, 508, 509], greedy)
twin = Request("R2", list(r.prompt_token_ids), greedy)       # the same prompt, to probe the cache
assert kv.allocate_slots(r, r.num_tokens)
print("R:", r, "  hashed:", [pool.blocks[b].block_hash is not None for b in r.block_table])
kv.free(r)                                     # preempted before its step ran
print("R's twin would hit:", kv.get_computed_blocks(twin))
print("after free(R): cached-free:", list(pool.cached_free), " clean-free:", list(pool.clean_free))

# %%
assert q_hits == [0, 1] and q.block_table[:2] == p.block_table[:2] == [0, 1]
assert pool.blocks[0].ref_count == pool.blocks[1].ref_count == 2
assert not kv.pending and set(pool.hash_to_block.values()) == {0, 1}
assert not pool.cached_free and kv.get_computed_blocks(twin) == []

# %% [markdown]
# ## 3. A step rolled back by hand
#
# Now a step that fails. P decodes one token (its third block has a free slot, so it needs no new block), and
# two new requests arrive with the same 8-token prefix: S shares P's two hashed blocks and gets fresh ones for
# the rest; T shares those two and S's third block, offered in this step. Then, before `update_from_output`, the
# forward raises: `rollback()`.

# %%
def pool_of(kv, requests):
    """Plain data: each request's block table and computed tokens, the pool's ref counts, free queues, hashes
    and offers."""
    pool = kv.block_pool
    return {"tables": {r.request_id: tuple(r.block_table) for r in requests},
            "computed": {r.request_id: r.num_computed_tokens for r in requests},
            "ref_counts": tuple(b.ref_count for b in pool.blocks), "clean_free": tuple(pool.clean_free),
            "cached_free": tuple(pool.cached_free), "hash_to_block": dict(pool.hash_to_block),
            "pending": dict(kv.pending)}


s = Request("S", SHARED + [251, 252, 253, 254, 255], greedy)
t = Request("T", SHARED + [251, 252, 253, 254, 255, 256], greedy)
before = pool_of(kv, [p, q, s, t])

kv.journal.begin()
assert kv.allocate_slots(p, 1)                             # P's decode
for req in (s, t):                                         # admit S, then T (T finds S's offer)
    hits = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, req.num_tokens - len(hits) * kv.block_size, hits)
    req.num_computed_tokens = len(hits) * kv.block_size
    kv.register_pending(req, req.num_tokens)
during = pool_of(kv, [p, q, s, t])
print("during: ", during["tables"], " ref counts:", during["ref_counts"])
print("         offered:", sorted(block for block, _ in kv.pending.values()))
undone = kv.journal.rollback()                             # the forward raised
after = pool_of(kv, [p, q, s, t])
print("after:  ", after["tables"], " ref counts:", after["ref_counts"])
print(f"{undone} undo actions replayed; the pool is as before the step: {after == before}")
kv.check_integrity([p, q, s, t])

# %%
# NBVAL_IGNORE_OUTPUT
draw_tables(kv.num_blocks, during["tables"], during["ref_counts"], set(during["cached_free"]),
            "During the failed step: S and T took blocks, T shares S's offered block", cols=8, size=1.0)

# %%
assert after == before and undone > 0 and during["tables"]["T"][:3] == during["tables"]["S"][:3]
assert s.block_table == [] and t.num_computed_tokens == 0 and not kv.pending

# %% [markdown]
# ## 4. Exercise: take blocks, and know how to give them back
#
# `BlockPool.take_fresh` and `KVCacheManager.allocate_slots` together move blocks from the front of the free
# queue into a request's block table, and journal each change. Write that move:
#
# - `take_blocks(free, table, n, journal)`: `free` is a `deque` of block ids, `table` a list (the block table);
#   move the first `n` of `free`, in order, to the end of `table`, both in place;
# - all or nothing, as `allocate_slots`: with fewer than `n` free, change nothing and return `False`; otherwise
#   return `True`;
# - after each change, `journal.record(undo)` with a function that undoes exactly that change, so that
#   `journal.rollback()` puts both back as they were, **in order** (the free queue's order is what eviction
#   and the tests rely on).
#
# `check` runs your function in open steps and rolls them back: alone, twice in one step, beside other
# journaled changes, with too few blocks, outside a step, and in 200 random steps.

# %%
from course import check, exercise


@exercise("02.take_blocks")
def take_blocks(free, table, n, journal):
    # your code here
    raise NotImplementedError


check(take_blocks)

# %% [markdown]
# Your function in one step, rolled back:

# %%
free, table, journal = deque([7, 3, 5, 0]), [2], StepJournal()
journal.begin()
print("took:", take_blocks(free, table, 3, journal), " free:", list(free), " table:", table)
journal.rollback()
print("rolled back: free:", list(free), " table:", table)
assert list(free) == [7, 3, 5, 0] and table == [2]

# %% [markdown]
# The real code is split in two: the pool journals the queue (`take_fresh`), and the block table is a journaled
# field of the request, so `allocate_slots` just assigns a new list:

# %%
print(inspect.getsource(pool.take_fresh))

# %% [markdown]
# ## 5. The real engine: Ctrl-C in the middle of a forward
#
# `LLMEngine.step` opens the journal (`scheduler.begin_step()`) before `schedule()` and commits it
# (`commit_step()`, which also ends the offers) after the step's tokens are in. If anything raises in between,
# `Scheduler.rollback_step()` replays the undos and the exception goes on to the caller. The rollback also
# distrusts the blocks the step handed out: the failed forward may have written into them, so a cached-free
# block among them loses its hash.
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
                labels=labels, **kwargs)


before = pool_state(small_engine)
print("before the step:")
show(before)

# %% [markdown]
# Now `small.generate([PROMPT, PROMPT])`, the same prompt twice. We replace the model runner's `execute_model`
# for one call with a function that looks at the pool and then raises `KeyboardInterrupt`, as if Ctrl-C arrived
# just as the forward began: the step's blocks are allocated, none of their KV is written. We also wrap the
# journal's `rollback` to count the undo actions it replays.

# %%
runner, journal = small_engine.model_runner, small_engine.scheduler.journal
seen = {}


def interrupted_forward(model_input):
    """Stands in for the model forward: record the pool mid-step, then fail before any KV is written."""
    kvm = small_engine.kv_cache_manager
    seen["state"] = pool_state(small_engine)
    seen["allocated"] = list(kvm.block_pool.events.allocated)              # handed out by this step
    seen["offered"] = sorted(block for block, _ in kvm.pending.values())   # offered within the step, not hashed
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
print("  offered within the step:", seen["offered"])

# %%
# NBVAL_IGNORE_OUTPUT
draw_state(seen["state"], f"During: the two copies share blocks {seen['offered']}, whose KV was never written",
           marked=seen["offered"], marked_label="offered within the step (not hashed)")

# %% [markdown]
# Both copies of the prompt were admitted with X's decode: the first got four fresh blocks, the second shared
# the first's three full ones (offered in this step) and got one of its own for its last token. Its
# `num_computed_tokens` already says 12, and nothing is hashed but X's two blocks: had the offered blocks been
# hashed at allocation, the prefix cache would now promise KV that does not exist. Then the forward failed, the
# engine rolled the step back and re-raised, and `generate` aborted its two requests and passed the
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
# prefix cache. X never noticed; the next request with the same prompt computes it from scratch and gives the
# reference text:

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
# > **How vLLM v1 does it differently.** vLLM's engine core does not survive a failed step: an exception in
# > `EngineCore.step` ends the engine process, and the front end reports the engine dead. That lets it hash
# > blocks in `allocate_slots` (`vllm/v1/core/kv_cache_manager.py`), before the forward, which also gives it
# > sharing within a step without a separate list of offers. minivllm pays for its rollback with a journal that
# > every core write goes through, and gets an engine that can lose one step (a Ctrl-C in a notebook, a request
# > whose input breaks the sampler) and carry on.

# %% [markdown]
# ## Check yourself
#
# Run this cell. It builds a fresh KV cache manager and checks that allocation hashes nothing, that a block is
# offered within the step that computes it, and that a rollback takes the allocation and the offer back; then a
# second interrupted `generate` leaves the small engine as it found it, and the prompt still gets the reference
# answer.

# %%
def self_check(small):
    kv = KVCacheManager(num_blocks=4, block_size=4, journal=StepJournal())
    u, v = Request("u", [1, 2, 3, 4, 5], greedy), Request("v", [1, 2, 3, 4, 6], greedy)
    kv.journal.begin()
    assert kv.allocate_slots(u, u.num_tokens)
    assert not kv.block_pool.hash_to_block, "allocation hashes nothing"
    kv.register_pending(u, u.num_tokens)
    assert kv.get_computed_blocks(v) == [0], "a block is offered within the step that computes it"
    assert kv.journal.rollback() > 0                                     # the forward raised
    assert u.block_table == [] and kv.num_free_blocks == 4 and kv.get_computed_blocks(v) == []
    kv.check_integrity([u, v])

    free, table, j = deque([1, 2, 3]), [], StepJournal()
    j.begin()
    assert take_blocks(free, table, 2, j) and table == [1, 2]
    j.rollback()
    assert list(free) == [1, 2, 3] and table == []

    state = pool_state(small.llm_engine)
    assert generate_interrupted([PROMPT, PROMPT]) == "KeyboardInterrupt"
    assert pool_state(small.llm_engine) == state, "a failed step leaves the pool as it found it"
    small.llm_engine.check_integrity()
    assert small.generate([PROMPT], short, use_tqdm=False)[0].outputs[0].text == reference
    return "all checks passed"


self_check(small)

# %% [markdown]
# ## Where next
#
# Lesson 03 is the scheduler: which requests run each step, how many tokens each, and long prompts cut into
# chunks; every change it makes goes through this journal. Lesson 04 is preemption, what happens when
# `allocate_slots` says no.
