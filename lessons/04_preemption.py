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
# # Lesson 04: preemption
#
# A request takes KV blocks one at a time as it grows (lesson 01), and the scheduler admits requests while
# there are free blocks *now* (lesson 03). Nobody knows how long an answer will be, so a full pool is normal:
# sooner or later a running request needs one more block and none is free. The scheduler then **preempts**
# someone: it takes a running request out of the batch, frees its blocks, and puts it back in the waiting
# queue to finish later.
#
# Whom? `Scheduler.schedule()` (`minivllm/core/scheduler.py`) picks the running request with the **highest
# `(priority, arrival)`**: the lowest priority (the largest number), and among equals the one that arrived
# last (it has had the least time invested in it), as vLLM does. That may be the very request that asked for
# the block.
#
# Preemption happens while the step is being planned, inside the step's transaction (lesson 03): if the step
# fails later, `rollback_step()` undoes the preemption too. The victim is running again with its blocks, cut
# back to before the first one the failed step handed to someone else (that step's forward may have
# overwritten it; lesson 02, "When a step fails").
#
# What happens to the victim's KV? vLLM's two answers, both in minivllm (`preemption_mode=`):
#
# ```
# recompute   drop the KV. When the request comes back, it runs its prompt and everything it had generated
#             so far as one prefill, and carries on. Costs model work.
# swap        copy its blocks to a CPU pool (swap_space GiB). When it comes back, copy them into fresh
#             device blocks and carry on decoding. Costs memory traffic, and CPU memory.
# ```
#
# Either way the answer must not change: preemption is invisible except in time. This lesson forces
# preemption with a tiny pool, draws it in both modes, counts what each mode pays, and checks the outputs.

# %%
import warnings

warnings.filterwarnings("ignore", message="IProgress not found")   # tqdm's notice when ipywidgets is absent

import matplotlib.pyplot as plt
import torch

from minivllm import LLM, SamplingParams
from plots import STATE_COLORS, RequestColors, draw_held, draw_lanes, state_legend

torch.manual_seed(0)
torch.set_num_threads(1)   # one thread: faster on a busy 2-core CPU, and the same float sums everywhere

# %% [markdown]
# ## 1. A workload that cannot fit
#
# Four short prompts, 40 greedy tokens each (`ignore_eos=True`, so every request really grows to its full
# length). Each ends at about 50 tokens, 3 or 4 blocks of 16: 15 blocks for all four. The pool has 10.

# %%
PROMPTS = {
    "A": "Once upon a time, in a small village by the sea, there lived",
    "B": "The best way to learn a new language is",
    "C": "In the year 2150, the first city on Mars",
    "D": "The recipe for a perfect cup of tea starts with",
}
PARAMS = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
NUM_BLOCKS = 10


def run(priority=None, **engine_kwargs):
    """Add the four requests (A first; `priority`: request id -> priority, 0 if absent), step until all
    finish; return the engine, outputs and step traces."""
    llm = LLM(seed=0, **engine_kwargs)
    engine = llm.llm_engine
    for rid, prompt in PROMPTS.items():
        engine.add_request(prompt, PARAMS, request_id=rid, priority=(priority or {}).get(rid, 0))
    outputs = {}
    with engine.record_traces() as traces:               # every step inside the block appends its StepTrace
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    outputs[out.request_id] = out.outputs[0].token_ids
    engine.check_integrity()
    return engine, outputs, traces


reference_engine, reference, reference_traces = run(num_kv_blocks=64)
tokenizer = reference_engine.tokenizer
for rid, prompt in PROMPTS.items():
    n = len(tokenizer.encode(prompt, add_special_tokens=False))
    print(f"{rid}: {n} prompt + 40 output tokens -> {-(-(n + 40 - 1) // 16)} blocks at the end")
print(f"with a 64-block pool: {len(reference_traces)} steps, "
      f"{reference_engine.get_stats().num_preemptions} preemptions")

# %% [markdown]
# That first run, with a pool of 64 blocks, is the reference: nobody was ever short of a block. (A finished
# request holds KV for all its tokens but the last, hence `n + 40 - 1`.)
#
# For the comparison below we switch the prefix cache off, so that recompute pays its full price; section 5
# turns it back on.
#
# ## 2. Recompute
#
# The same four requests, a 10-block pool, `preemption_mode="recompute"` (the default):

# %%
rc_engine, rc_out, rc_traces = run(num_kv_blocks=NUM_BLOCKS, preemption_mode="recompute",
                                   enable_prefix_caching=False)
print(f"{len(rc_traces)} steps, {rc_engine.get_stats().num_preemptions} preemptions")
for t in rc_traces:
    if t.preempted or any(e.startswith("admit") for e in t.events):
        print(f"step {t.step:2d}: {'; '.join(t.events)}")

# %% [markdown]
# The story, from the step traces (`StepTrace.preempted`, and each `RequestTrace.status`):
#
# - Step 1 admits all four: their prompts need one block each.
# - Each request takes a second block after 16 tokens and a third after 32. When D asks for its third, in
#   step 24, the pool is empty. D is the latest arrival, so the victim is D itself: its blocks are freed and
#   it goes back to the waiting queue with status `preempted`.
# - In step 36 the three survivors run out again, and now C is the latest arrival among the running: C goes.
# - When A and B finish, their blocks come back and C and D are admitted again, in their original arrival
#   order. Being recomputed, each re-runs **its prompt and all the tokens it had generated** as one prefill.
#
# The scheduler calls that a "prefill" like any other; the trace tells them apart with
# `RequestTrace.num_preemptions`, how many times the request has been preempted so far. A prefill by a
# request that has been preempted is a **recompute**, and we label it so:

# %%
def what_ran(r):
    """What a RequestTrace computed in its step: "prefill", "decode", "" (nothing), or "recompute"."""
    return "recompute" if r.kind == "prefill" and r.num_preemptions else r.kind


def status_of(traces, rid):
    """step -> (status, what ran, tokens scheduled) for one request, from the step traces."""
    return {t.step: (t.by_id[rid].status, what_ran(t.by_id[rid]), t.by_id[rid].num_scheduled_tokens)
            for t in traces if rid in t.by_id}


def tokens(n):
    return f"{n} token" + ("s" if n != 1 else "")


for rid in ("C", "D"):
    steps = status_of(rc_traces, rid)
    preempted_at = min(s for s, (status, _, _) in steps.items() if status == "preempted")
    back_at = min(s for s, (status, kind, _) in steps.items() if s > preempted_at and kind)
    print(f"{rid}: preempted in step {preempted_at}, back in step {back_at} with a "
          f"{steps[back_at][1]} of {tokens(steps[back_at][2])}")

# %% [markdown]
# ### The picture
#
# Top: blocks held by each request after every step, stacked, against the pool's 10 (black line); red ticks
# mark preemptions. Bottom: one lane per request, coloured by what it did in that step.

# %%
req_colors = RequestColors(PROMPTS)              # A, B, C, D: the first four palette colours


def draw_blocks(ax, traces, title, num_blocks=NUM_BLOCKS):
    """Blocks held per request after each step, the pool's size, blocks in the CPU pool, preemptions (red)."""
    steps = [t.step for t in traces]
    held = {rid: [len(t.by_id[rid].block_table) if rid in t.by_id else 0 for t in traces] for rid in PROMPTS}
    draw_held(ax, steps, held, req_colors, title)
    ax.axhline(num_blocks, color="black", lw=1)
    cpu = []                                          # blocks in the CPU pool: swapped out so far - swapped in
    for t in traces:
        cpu.append((cpu[-1] if cpu else 0) + len(t.blocks_swapped_out) - len(t.blocks_swapped_in))
    if any(cpu):
        ax.step(steps, cpu, where="post", color="tab:purple", ls="--", lw=1.5, label="in the CPU pool")
    for t in traces:
        if t.preempted:
            ax.axvline(t.step, color="tab:red", lw=1, ls=":")
    ax.set_ylim(0, num_blocks + 3.5)                  # headroom for the legend
    ax.legend(loc="upper left", fontsize=7, ncol=5, frameon=False)


def state_in_step(r):
    """What a request did in a step (a STATE_COLORS key), or None for no cell."""
    state = what_ran(r) or ("waiting" if r.status == "waiting" else r.status)
    return state if state in STATE_COLORS else None


def draw_runs(runs):
    """For each run {title: traces}: blocks held on top, one lane per request below."""
    fig, axes = plt.subplots(2, len(runs), figsize=(6 * len(runs), 4.6), sharex=True, squeeze=False,
                             gridspec_kw={"height_ratios": [1.4, 1]})
    for col, (title, traces) in enumerate(runs.items()):
        draw_blocks(axes[0, col], traces, title)
        draw_lanes(axes[1, col], traces, state_in_step, rows=list(PROMPTS))
    fig.legend(handles=state_legend(STATE_COLORS), loc="lower center", ncol=len(STATE_COLORS), fontsize=8,
               frameon=False)
    plt.tight_layout(rect=(0, 0.06, 1, 1))
    plt.show()


# %%
# NBVAL_IGNORE_OUTPUT
draw_runs({"recompute, 10 blocks": rc_traces})

# %% [markdown]
# The pool runs full from the moment the third blocks are needed. A preempted request holds nothing at all
# while it waits (red lane), and when it returns its lane shows a recompute (brown): a second prefill of
# everything it had.

# %%
assert rc_out == reference                                         # the answers did not change
assert [t.preempted for t in rc_traces if t.preempted] == [("D",), ("C",)]
assert sorted(r.request_id for t in rc_traces for r in t.requests if what_ran(r) == "recompute") == ["C", "D"]
assert all(t.num_kv_blocks - t.num_free_blocks <= NUM_BLOCKS for t in rc_traces)
assert sum(r.num_scheduled_tokens for t in rc_traces for r in t.requests if r.kind == "prefill") == \
    rc_engine.get_stats().num_prompt_tokens_computed

# %% [markdown]
# ### Priority comes before arrival
#
# The same run, but A, the first to arrive, has priority 1 (lower runs first, so A is now the least
# important) and the others keep the default 0. A moves to the back of the waiting queue (step 1 still admits
# all four, A last) and becomes the first victim, although it arrived first; among the others, the latest
# arrival (D) goes next.

# %%
_, prio_out, prio_traces = run(priority={"A": 1}, num_kv_blocks=NUM_BLOCKS, enable_prefix_caching=False)
for t in prio_traces:
    if t.preempted or any(e.startswith("admit") for e in t.events):
        print(f"step {t.step:2d}: {'; '.join(t.events)}")

# %%
assert [t.preempted for t in prio_traces if t.preempted] == [("A",), ("D",)]
assert prio_out == reference                                       # priorities change the order, not the answers

# %% [markdown]
# ### Exercise: choosing a victim and recomputing
#
# Write one recompute preemption yourself, on plain data. A request is a `Seq` (from the lesson's checks), a
# named tuple of `request_id`, `priority`, `arrival`, `status`, `num_computed_tokens` and `block_table`.
# `preempt(running, waiting)` takes both queues in order (`waiting` is sorted by `(priority, arrival)`) and
# returns `(running, waiting, freed)` after one preemption:
#
# - the victim is the running request with the largest `(priority, arrival)`: the largest priority number,
#   and among equals the latest arrival. The order of the running queue plays no part;
# - it leaves `running` (the others keep their order) and goes into `waiting` at its place by
#   `(priority, arrival)`, behind every request with a smaller key and before the others. With equal
#   priorities that puts it ahead of every request that has never run (they all arrived after it), behind
#   only earlier victims that arrived before it;
# - recompute drops its KV: its `status` becomes `"preempted"`, `num_computed_tokens` 0 and `block_table`
#   empty (`seq._replace(status=..., ...)` makes the changed copy);
# - `freed` is its blocks in the order they are freed: the last block first, as `KVCacheManager.free` does
#   (with the prefix cache on, the tail of a sequence is then evicted before its head).
#
# `check` runs your function on hand-made queues, then on every preemption of a real `Scheduler` in 8 random
# workloads (a pool too small for them, the model's output faked): each is recorded with both queues just
# before and just after `Scheduler._preempt`. At the end your function picks the victims of the two runs above, from
# their step traces.

# %%
from course import check, exercise
from checks.c04_preemption import Seq


@exercise("04.preempt")
def preempt(running, waiting):
    # your code here
    raise NotImplementedError


check(preempt)


def queues_after(trace):
    """The running and waiting queues after a traced step, as Seq (arrival: A is 0, ..., D is 3)."""
    seqs = [Seq(r.request_id, r.priority, list(PROMPTS).index(r.request_id), r.status, r.num_computed_tokens,
                r.block_table) for r in trace.requests]
    running = [s for s in seqs if s.status == "running"]
    waiting = sorted((s for s in seqs if s.status in ("waiting", "preempted")), key=lambda s: (s.priority, s.arrival))
    return running, waiting


victims = {}
for name, traces in [("recompute", rc_traces), ("priority", prio_traces)]:
    by_step = {t.step: t for t in traces}
    for t in traces:
        if t.preempted:
            running, waiting = queues_after(by_step[t.step - 1])
            left = preempt(running, waiting)[0]
            victims[name, t.step] = ([s.request_id for s in running if s not in left], list(t.preempted))
            print(f"{name} run, step {t.step}: your victim {victims[name, t.step][0]}, "
                  f"the scheduler's {victims[name, t.step][1]}")

# %% [markdown]
# In the scheduler the choice is a loop of `schedule()`: when `_allocate` finds no free block, `_choose_victim`
# takes the `max` of the running requests by `self._keys[...]`, which is `(priority, arrival_time, the order
# of add_request)` (the last breaks ties between equal arrival times), and the loop preempts it until the
# request that asked has its blocks, or is itself the victim:

# %%
import inspect

from minivllm.core.scheduler import Scheduler

source = inspect.getsource(Scheduler.schedule).splitlines()
start = next(i for i, line in enumerate(source) if "while not self._allocate" in line)
print("\n".join(source[start:start + 9]))
print(inspect.getsource(Scheduler._choose_victim))

# %% [markdown]
# `_preempt` does the rest, for both modes: out of `running`, the KV freed (recompute) or copied to the CPU
# pool (swap, whose block copies it returns for the model runner), back into `waiting` at its place
# (`_push_waiting` keeps the queue sorted), every change undone by the step's journal if the step fails.

# %%
print(inspect.getsource(Scheduler._preempt))

# %%
assert len(victims) == 4 and all(mine == real for mine, real in victims.values())

# %% [markdown]
# ## 3. Swap
#
# Now `preemption_mode="swap"` with `swap_space=0.05` (GiB): a CPU pool of the same block layout, big
# enough here for about 70 blocks. A victim's blocks are copied there before the next forward pass
# (`StepTrace.blocks_swapped_out`, pairs of (device block, CPU block)), its device blocks are freed, and its
# status is `swapped`. It keeps `num_computed_tokens`: the KV is not lost, only moved. When it comes back,
# its blocks are copied into fresh device blocks (`blocks_swapped_in`) and it simply decodes on.

# %%
sw_engine, sw_out, sw_traces = run(num_kv_blocks=NUM_BLOCKS, preemption_mode="swap", swap_space=0.05,
                                   enable_prefix_caching=False)
print(f"CPU pool: {sw_engine.kv_cache_manager.swap_space.num_cpu_blocks} blocks")
print(f"{len(sw_traces)} steps, {sw_engine.get_stats().num_preemptions} preemptions")
for t in sw_traces:
    if t.blocks_swapped_out or t.blocks_swapped_in:
        print(f"step {t.step:2d}: {'; '.join(t.events)}  swapped out {list(t.blocks_swapped_out)}"
              f"  in {list(t.blocks_swapped_in)}")
for rid in ("C", "D"):
    steps = status_of(sw_traces, rid)
    preempted_at = min(s for s, (status, _, _) in steps.items() if status == "swapped")
    back_at = min(s for s, (status, kind, _) in steps.items() if s > preempted_at and kind)
    print(f"{rid}: swapped out in step {preempted_at}, back in step {back_at} with a "
          f"{steps[back_at][1]} of {tokens(steps[back_at][2])}")

# %% [markdown]
# The pairs read (source, destination): (device block, CPU block) going out, (CPU block, device block)
# coming back. The blocks come back into whatever device blocks are free, not the ones they left: the block
# table is updated, and nothing else cares where a block lives.
#
# Side by side: the same preemptions at the same steps (the victims are chosen the same way), but the
# swapped requests come back decoding (blue), with no second prefill. The dashed purple line counts blocks
# waiting in the CPU pool.

# %%
# NBVAL_IGNORE_OUTPUT
draw_runs({"recompute, 10 blocks": rc_traces, "swap, 10 blocks": sw_traces})

# %% [markdown]
# On a real GPU a swap crosses PCIe, far slower than the GPU's own memory, and a swapped request ties up CPU
# memory. vLLM v1 dropped swapping: with prefix caching (section 5) recompute is often cheap, and it needs
# no second pool. minivllm keeps both so you can compare.

# %%
assert sw_out == reference
assert [t.preempted for t in sw_traces if t.preempted] == [("D",), ("C",)]
assert all(r.status != "preempted" for t in sw_traces for r in t.requests)      # nobody was recomputed ...
assert not any(what_ran(r) == "recompute" for t in sw_traces for r in t.requests)   # ... and nothing re-ran
assert sw_engine.kv_cache_manager.swap_space.tables == {}                        # the CPU pool is empty again

# %% [markdown]
# ## 4. What each mode paid
#
# Recompute pays in model work: prefill tokens computed a second time. Swap pays in copies: every block of
# a victim goes out and comes back. From the traces:

# %%
bytes_per_block = sw_engine.model_runner.bytes_per_block


def cost(traces):
    prefill = sum(t.num_prefill_tokens for t in traces)
    copies = sum(len(t.blocks_swapped_out) + len(t.blocks_swapped_in) for t in traces)
    return prefill, copies


print(f"{'':20} {'steps':>5} {'prefill tokens':>15} {'blocks copied':>14} {'MiB copied':>11}")
for name, traces in [("64 blocks", reference_traces), ("recompute, 10", rc_traces), ("swap, 10", sw_traces)]:
    prefill, copies = cost(traces)
    print(f"{name:20} {len(traces):5d} {prefill:15d} {copies:14d} {copies * bytes_per_block / 2**20:11.1f}")

# %%
# NBVAL_IGNORE_OUTPUT
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 2.6))
names = ["64 blocks", "recompute", "swap"]
costs = [cost(tr) for tr in (reference_traces, rc_traces, sw_traces)]
ax1.bar(names, [c[0] for c in costs], color=["grey", "tab:orange", "tab:purple"])
ax1.set_title("prefill tokens computed")
ax2.bar(names, [c[1] for c in costs], color=["grey", "tab:orange", "tab:purple"])
ax2.set_title("KV blocks copied (out + in)")
plt.tight_layout()
plt.show()

# %% [markdown]
# Where recompute's extra prefill tokens went, request by request:

# %%
for rid in PROMPTS:
    steps = status_of(rc_traces, rid)
    prefills = [n for status, kind, n in steps.values() if kind == "prefill"]
    recomputes = [n for status, kind, n in steps.values() if kind == "recompute"]
    prompt_len = len(tokenizer.encode(PROMPTS[rid], add_special_tokens=False))
    print(f"{rid}: prompt {prompt_len}, prefill {sum(prefills)}, recomputes {recomputes}: "
          f"{sum(prefills) + sum(recomputes) - prompt_len} tokens computed twice")

# %% [markdown]
# Every mode computed each prompt once, and recompute added the recomputes of C and D: prompt plus every
# token generated before the preemption. Swap computed nothing twice and copied 5 blocks out and 5
# back instead, at 720 KiB per block for this model in fp32. Which is cheaper depends on the hardware: a
# prefill token costs a forward pass of the model, a block copy costs bandwidth.

# %%
recomputed = sum(r.num_scheduled_tokens for t in rc_traces for r in t.requests if what_ran(r) == "recompute")
assert cost(rc_traces)[0] - cost(reference_traces)[0] == recomputed > 0
assert cost(sw_traces) == (cost(reference_traces)[0], 10)            # swap: no extra prefill, 5 blocks out, 5 in
assert rc_out == sw_out == reference

# %% [markdown]
# ## 5. Recompute with the prefix cache
#
# The default engine has prefix caching on. Then a recomputed request's full blocks are not really lost: when
# it is preempted they go to the cached-free list like any finished request's blocks (lesson 01), and if
# nobody has evicted them by the time it returns, its "recompute" is mostly a prefix-cache hit. Only blocks
# whose KV exists are in the cache: a block is hashed when the step that computed it commits
# (`update_from_output`), so the blocks a victim was given earlier in the step that preempts it were never
# hashed, and they go back as empty blocks.

# %%
rcp_engine, rcp_out, rcp_traces = run(num_kv_blocks=NUM_BLOCKS, preemption_mode="recompute")
for t in rcp_traces:
    if t.preempted or t.blocks_evicted or t.prefix_hit_blocks:
        print(f"step {t.step:2d}: {'; '.join(t.events)}")
for rid in ("C", "D"):
    steps = status_of(rcp_traces, rid)
    preempted_at = min(s for s, (status, _, _) in steps.items() if status == "preempted")
    back_at = min(s for s, (status, kind, _) in steps.items() if s > preempted_at and kind)
    print(f"{rid}: back in step {back_at} with a {steps[back_at][1]} of {tokens(steps[back_at][2])}")
print(f"prefill tokens computed: {cost(rcp_traces)[0]} (without the prefix cache: {cost(rc_traces)[0]}, "
      f"without preemption: {cost(reference_traces)[0]})")

# %% [markdown]
# The two victims fared very differently:
#
# - **C** was preempted in step 36 and came back in step 41. Its three full blocks (the KV of 48 of its 49
#   tokens) were still in the prefix cache, so only one token was left to compute, and a single new token
#   with everything before it in the cache *is* a decode: C resumed as if nothing had happened.
# - **D** was preempted in step 24. Its freed blocks were the least recently freed when A, B and C needed
#   fresh blocks, so they were evicted (steps 25 and 35), and D recomputed all 33 tokens.
#
# So with the prefix cache, recompute costs depend on how long the victim waits and how busy the pool is.
# That, and needing no second pool, is why vLLM v1 only recomputes.

# %%
assert rcp_out == reference
assert cost(reference_traces)[0] < cost(rcp_traces)[0] < cost(rc_traces)[0]
assert status_of(rcp_traces, "C")[41][1:] == ("decode", 1) and status_of(rcp_traces, "D")[41][1:] == ("recompute", 33)

# %% [markdown]
# ## 6. A request that can never fit
#
# Preemption frees room by making *other* requests wait. It cannot help a request that would not fit even
# alone: a prompt plus `max_tokens` whose KV needs more blocks than the whole pool has. Such a request would
# preempt everyone and then itself, forever. So the engine refuses it up front: `add_request` raises a
# `ValueError` that names the numbers and the fixes, and nothing about the engine changes.

# %%
engine = rc_engine                                   # the 10-block engine of section 2, now idle
ok = [engine.add_request(PROMPTS[rid], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                         request_id=f"fits-{rid}") for rid in ("A", "B")]
try:
    engine.add_request("Write a very long essay about the sea.", SamplingParams(max_tokens=200),
                       request_id="too-big")
except ValueError as err:
    print("ValueError:", err)
print("waiting:", [r.request_id for r in engine.scheduler.waiting])

# %% [markdown]
# The refused request never entered the queue; the two others run as usual:

# %%
done = {}
while engine.has_unfinished_requests():
    for out in engine.step():
        if out.finished:
            done[out.request_id] = out
for rid, out in done.items():
    print(f"{rid}: {len(out.outputs[0].token_ids)} tokens [{out.outputs[0].finish_reason}] {out.outputs[0].text!r}")

# %%
assert set(done) == {"fits-A", "fits-B"} and all(o.outputs[0].finish_reason == "length" for o in done.values())
assert done["fits-A"].outputs[0].token_ids == reference["A"][:20]
assert engine.kv_cache_manager.num_free_blocks == NUM_BLOCKS
engine.check_integrity()

# %% [markdown]
# `LLM.generate` checks every prompt of a batch the same way *before* anything runs, so one impossible prompt
# fails the whole call at once (naming the prompt's index) instead of half-way through.
#
# ## Check yourself
#
# Run this cell. It checks the lesson's claims on the runs above (re-run the lesson first if you change the
# prompts, `PARAMS` or `NUM_BLOCKS`): both modes really preempted, recompute re-ran prefills and copied
# nothing, swap copied blocks out and back and re-ran nothing, the pool never over-committed, every answer
# equals the 64-block reference, and an impossible request is refused without disturbing the engine.

# %%
def self_check():
    base_prefill = cost(reference_traces)[0]
    for mode, engine, outputs, traces in [("recompute", rc_engine, rc_out, rc_traces),
                                          ("swap", sw_engine, sw_out, sw_traces)]:
        assert outputs == reference, f"{mode}: outputs changed"
        assert any(t.preempted for t in traces), f"{mode}: nothing was preempted"
        for t in traces:                 # every block in use belongs to one running request; never more than the pool
            held = [b for r in t.requests if r.status == "running" for b in r.block_table]
            assert len(held) == len(set(held)) == t.num_kv_blocks - t.num_free_blocks <= NUM_BLOCKS, (
                f"{mode}, step {t.step}: the running requests hold {len(held)} blocks ({len(set(held))} distinct), "
                f"the pool counts {t.num_kv_blocks - t.num_free_blocks} in use of {NUM_BLOCKS}")
        assert any(t.num_free_blocks == 0 for t in traces), f"{mode}: the pool never ran full"
        statuses = {r.status for t in traces for r in t.requests}
        prefill, copies = cost(traces)
        recomputes = [r for t in traces for r in t.requests if what_ran(r) == "recompute"]
        if mode == "recompute":
            assert "preempted" in statuses and "swapped" not in statuses
            assert prefill > base_prefill and copies == 0, "recompute re-runs prefills and copies nothing"
            assert recomputes and all(r.num_preemptions > 0 for r in recomputes)
        else:
            assert "swapped" in statuses and "preempted" not in statuses
            assert prefill == base_prefill and copies > 0, "swap copies blocks and re-runs nothing"
            assert not recomputes
            assert sum(len(t.blocks_swapped_out) for t in traces) == sum(len(t.blocks_swapped_in) for t in traces)
        kvm = engine.kv_cache_manager
        try:
            engine.add_request("x", SamplingParams(max_tokens=kvm.num_blocks * kvm.block_size + 1))
            raise AssertionError("an impossible request was accepted")
        except ValueError as err:
            assert f"whole pool has {kvm.num_blocks} blocks" in str(err)
        assert not engine.has_unfinished_requests()
        assert kvm.num_free_blocks == kvm.num_blocks and not kvm.swap_space.tables
        engine.check_integrity()
    return "all checks passed"


self_check()

# %% [markdown]
# ## Where next
#
# Lessons 01-04 were bookkeeping: who holds which block, who runs, who waits. Lesson 05 turns a step's plan into one flat batch, and lesson 06 goes inside the
# forward pass, to paged attention: how a kernel reads K and V through a block table.
