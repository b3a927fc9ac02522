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
# # Lesson 03: the scheduler, continuous batching and chunked prefill
#
# Every engine step starts with one question: *which requests run now, and how many tokens each?*
# `minivllm/core/scheduler.py` answers it. This lesson drives the engine one step at a time, records what the
# scheduler decided, and draws it.
#
# The whole scheduler rests on one rule (vLLM v1's "unified" scheduler). Each scheduled request gets
#
# ```
# num_new_tokens = num_tokens - num_computed_tokens        capped by what is left of the step's token budget
# ```
#
# - For a request that was just admitted, that is its whole prompt: a **prefill**.
# - If the budget is short, it is only a piece of the prompt, and the rest comes next step: **chunked prefill**.
# - For a request that is generating, it is exactly 1 (the token sampled last step): a **decode**.
#
# There is no separate prefill phase; one flat batch mixes prefills and decodes. Within a step the order is:
#
# 1. running requests, decodes first, then unfinished prefill chunks;
# 2. waiting requests by `(priority, arrival)`, while the token budget (`max_num_batched_tokens`),
#    `max_num_seqs` and the free KV blocks allow.
#
# Finished requests leave at the end of any step and waiting ones join at the start of the next:
# **continuous batching**, as opposed to a static batch that waits for its slowest member.
#
# `schedule()` is only the plan. An engine step (`LLMEngine.step`, `minivllm/engine/llm_engine.py`) wraps it:
#
# ```
# scheduler.begin_step()                       open the step's journal
# plan = scheduler.schedule()                  who runs, how many tokens each; blocks allocated for them
# tokens = forward + sampler(plan)             the model runner computes their KV and samples
# scheduler.update_from_output(plan, tokens)   num_computed_tokens += scheduled tokens; newly full blocks
#                                              join the prefix cache; new tokens appended; EOS, a stop
#                                              token or max_tokens finishes a request
# detokenize; a stop string -> finish_request  the output processor (engine/output_processor.py)
# scheduler.commit_step()                      keep all of it (or rollback_step() if anything above raised)
# ```
#
# `update_from_output` is the only code that moves `num_computed_tokens` (as in vLLM v1): the planner never
# claims a token is computed before the forward pass has actually computed it.

# %%
import warnings

warnings.filterwarnings("ignore", message="IProgress not found")   # tqdm's notice when ipywidgets is absent

import matplotlib.pyplot as plt
import torch
from matplotlib.ticker import MaxNLocator

from minivllm import LLM, SamplingParams
from plots import STATE_COLORS, draw_lanes, state_legend

torch.manual_seed(0)
torch.set_num_threads(1)   # one thread: faster on a busy 2-core CPU, and the same float sums everywhere

# %% [markdown]
# ## 1. An engine with a small token budget
#
# `max_num_batched_tokens=64`: no step may run more than 64 tokens through the model. That is tiny (vLLM's
# default is several thousand), so that a 300-token prompt visibly takes several steps. The KV pool is large
# enough that nobody runs out of blocks (running out is lesson 04). We also switch the prefix cache off:
# every prompt token is then computed, and the token counts below add up without lesson 01's discounts.

# %%
BUDGET = 64
llm = LLM(num_kv_blocks=128, max_num_seqs=8, max_num_batched_tokens=BUDGET, enable_prefix_caching=False, seed=0)
engine = llm.llm_engine
tokenizer = llm.get_tokenizer()
print("token budget per step:", engine.scheduler.max_num_batched_tokens)
print("max requests per step:", engine.scheduler.max_num_seqs)

# %% [markdown]
# Four chat prompts of very different lengths: a summary of a long passage, of its first half, and two short
# questions. The fourth, `late`, will arrive while the others are already running.

# %%
PASSAGE = (
    "The lighthouse on the northern cape was built in 1871, after three ships were lost on the same reef in a "
    "single winter. Its first keeper, a retired sailor named Elias Brandt, kept a log of every storm, every "
    "passing ship and every repair. The lamp burned whale oil at first, then kerosene, and each change of fuel "
    "meant new wicks and weeks of soot on the lens. The lens itself came from Paris in forty wooden crates, and "
    "it took a whole summer to assemble its brass frame and glass prisms. In clear weather the light could be "
    "seen twenty miles out to sea. In fog it was useless, so a bell was hung beside the tower and rung by hand "
    "every thirty seconds, sometimes for two days without a break. Brandt's daughter, Marta, took over the light "
    "when he died in 1903. She kept the same log in the same careful hand, and she was the first to note that the "
    "sandbar at the eastern end of the reef grew a little every year. In 1921 the lighthouse was electrified and "
    "the bell was replaced by a horn. Today the tower is a museum, and visitors climb its one hundred and twelve "
    "steps to read the two logs under glass.")
SENTENCES = PASSAGE.split(". ")


def chat_prompt(text):
    """The chat template applied to one user message, as a string the engine can take."""
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                         add_generation_prompt=True)


def summarize(sentences):
    return chat_prompt("Summarize this passage in one sentence.\n\n" + ". ".join(sentences) + ".")


PROMPTS = {
    "short": chat_prompt("What is the capital of France?"),
    "long": summarize(SENTENCES),
    "medium": summarize(SENTENCES[:5]),
    "late": chat_prompt("Name three primary colors."),
}
params = SamplingParams(temperature=0, max_tokens=16)
for rid, prompt in PROMPTS.items():
    print(f"{rid:7} {len(tokenizer.encode(prompt, add_special_tokens=False)):3d} prompt tokens")

# %% [markdown]
# ## 2. Step by step
#
# We add three requests. Before running anything, we look at the plan of the first step.

# %%
for rid in ("short", "long", "medium"):
    engine.add_request(PROMPTS[rid], params, request_id=rid)

# %% [markdown]
# ### A step is a transaction
#
# Everything the scheduler and the KV cache manager change between `begin_step()` and `commit_step()` (queues,
# statuses, block tables, ref counts, hashes, `num_computed_tokens`) is written to a journal
# (`minivllm/core/journal.py`) together with how to undo it. If anything raises in between (the model, the
# sampler, the detokenizer, a Ctrl-C), the engine calls `rollback_step()`: the journal is replayed backwards and
# the scheduler and the KV cache are as they were before the step (except that the blocks the failed step handed
# out can no longer be trusted as prefix-cache hits: its forward may have written them), and the engine keeps
# serving. Lesson 02, "When a step fails", draws the blocks before, during and after a failed step.
# Here we use the same machinery to peek at the first step's plan and take it back:

# %%
scheduler = engine.scheduler


def queue_state(scheduler):
    return [(r.request_id, r.status.value, r.num_computed_tokens, tuple(r.block_table))
            for r in scheduler.running + scheduler.waiting]


before = queue_state(scheduler)
scheduler.begin_step()
plan = scheduler.schedule()
during = queue_state(scheduler)
scheduler.rollback_step()
after = queue_state(scheduler)
print("plan:", plan.num_scheduled_tokens)
for name, state in [("before", before), ("during", during), ("after", after)]:
    print(f"{name:6}", ", ".join(f"{rid} {status} computed={n} blocks={len(table)}"
                                 for rid, status, n, table in state))

# %%
assert after == before                                     # the plan is gone without a trace
assert all(n == 0 for _, _, n, _ in during)                # schedule() allocates blocks but computes nothing
engine.check_integrity()

# %% [markdown]
# Now the real run. `with engine.record_traces() as traces:` gives a list that every step run inside the `with`
# block appends a `StepTrace` to: plain data copied out of the engine (see `minivllm/engine/trace.py`). Recording
# stops when the block ends. We step until everything is done, adding `late` after step 4.

# %%
outputs = {}
with engine.record_traces() as traces:
    while engine.has_unfinished_requests():
        if engine.num_steps == 4:                          # 4 steps done: a new request arrives
            engine.add_request(PROMPTS["late"], params, request_id="late")
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out

print(len(traces), "steps")
for rid, out in outputs.items():
    print(f"{rid:7} {out.outputs[0].text!r}")

# %% [markdown]
# What did each step run? A `StepTrace` carries the step's totals (`num_prefill_tokens`,
# `num_decode_tokens`) and one `RequestTrace` per live request, with its `kind` ("prefill", "decode", or ""
# when it was not scheduled) and `num_scheduled_tokens`:

# %%
def describe(t):
    parts = [f"{r.request_id} {r.kind} {r.num_scheduled_tokens}" for r in t.requests if r.kind]
    waiting = [r.request_id for r in t.requests if not r.kind]
    return (f"step {t.step:2d}: {t.num_prefill_tokens:2d} prefill + {t.num_decode_tokens} decode = "
            f"{t.num_prefill_tokens + t.num_decode_tokens:2d} | " + ", ".join(parts)
            + (f" | waiting: {', '.join(waiting)}" if waiting else ""))


for t in traces:
    print(describe(t))

# %% [markdown]
# Read the first steps closely:
#
# - **Step 1.** `short` (37 tokens) fits whole; the remaining 27 tokens of budget go to the first chunk of
#   `long`. `medium` does not get a single token: the budget is spent, so it keeps waiting.
# - **Steps 2-5.** `short` decodes (1 token, scheduled first: decodes go before prefill chunks), and `long`
#   takes the other 63 tokens of each step.
# - A chunk that stops short of the end of its prompt samples nothing: the model runner computes logits only
#   for requests whose scheduled tokens reach their last token. `long` gets its first output token in step 6,
#   with its last chunk.
# - **Steps 5-8.** `late` arrived after step 4 and waits behind `medium` (the waiting queue is ordered by
#   arrival). `medium` is admitted in step 6 with what `long`'s last chunk left over; then, as a running
#   request, its chunks come before any waiting request, so `late` gets in only in step 9.
#
# ### The picture: what each step computed
#
# Each bar is one step, split into prefill tokens and decode tokens; the dashed line is the budget.

# %%
PREFILL, DECODE = STATE_COLORS["prefill"], STATE_COLORS["decode"]   # the same colours as the lanes below


def draw_steps(ax, traces, budget=None, title=""):
    steps = [t.step for t in traces]
    dec = [t.num_decode_tokens for t in traces]
    pre = [t.num_prefill_tokens for t in traces]
    ax.bar(steps, dec, color=DECODE, label="decode tokens")
    ax.bar(steps, pre, bottom=dec, color=PREFILL, label="prefill tokens")
    if budget:
        ax.axhline(budget, color="black", ls="--", lw=1, label=f"max_num_batched_tokens = {budget}")
    ax.set_xlabel("engine step")
    ax.set_ylabel("tokens computed")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_title(title)


# %%
# NBVAL_IGNORE_OUTPUT
fig, ax = plt.subplots(figsize=(10, 3))
draw_steps(ax, traces, BUDGET, "Tokens per step: prefill chunks fill the budget, decodes ride along")
ax.legend(loc="upper right", fontsize=8)
plt.show()

# %% [markdown]
# While prompts are being prefilled the steps are full; once every prompt is in, only decodes remain, one
# token per running request, and the steps are nearly empty. That imbalance is why chunked prefill exists:
# a long prompt never gets a step to itself, so the decodes of everybody else keep going while it is read in
# (instead of stalling for one huge step), and every step stays within a bounded size and time.

# %%
assert all(t.num_prefill_tokens + t.num_decode_tokens <= BUDGET for t in traces)     # the budget is never exceeded
assert {r.request_id: r.num_scheduled_tokens for r in traces[0].requests if r.kind} == plan.num_scheduled_tokens
assert sum(t.num_prefill_tokens for t in traces) == sum(
    len(tokenizer.encode(p, add_special_tokens=False)) for p in PROMPTS.values())    # every prompt token, once
assert sum(t.num_decode_tokens for t in traces) == sum(len(o.outputs[0].token_ids) - 1 for o in outputs.values())

# %% [markdown]
# The last check: every output token but the last costs one decode. The first output token comes from the
# prefill's last forward pass, and the last output token is sampled but never fed back.
#
# ### The picture: who ran in which step
#
# One lane per request: orange while its prompt is being prefilled (the number is the chunk size), blue for
# a decode, grey while it waits. The lane starts when the request arrives and stops when it finishes.

# %%
def draw_who_ran(ax, traces, order=None, labels=None, title=""):
    """Lanes (plots.draw_lanes): prefill with its chunk size, decode, or waiting, per request and step."""
    draw_lanes(ax, traces, lambda r: r.kind if r.kind in ("prefill", "decode") else "waiting", rows=order,
               labels=labels, text_of=lambda r: str(r.num_scheduled_tokens) if r.kind == "prefill" else None,
               title=title)
    ax.legend(handles=state_legend(["prefill", "decode", "waiting"], {"prefill": "prefill (chunk size)"}),
              loc="upper right", fontsize=8)


# %%
# NBVAL_IGNORE_OUTPUT
fig, ax = plt.subplots(figsize=(10, 2.6))
draw_who_ran(ax, traces, order=["short", "long", "medium", "late"], title="Which request ran what, step by step")
plt.show()

# %% [markdown]
# Things to notice:
#
# - `long`'s prompt is cut into chunks; the chunks are whatever budget is left after the decodes.
# - `short` decodes in every step from step 2 on, even while `long` and `medium` are prefilling: one batch
#   mixes both kinds.
# - `late` joins a batch that is already running (**continuous batching**): no one waits for the batch to
#   drain, and a finished request's place is taken the very next step.

# %%
by_step = {t.step: t.by_id for t in traces}
first_step = {rid: min(s for s, reqs in by_step.items() if rid in reqs and reqs[rid].kind) for rid in PROMPTS}
chunks = {rid: sum(1 for t in traces if t.by_id.get(rid) and t.by_id[rid].kind == "prefill") for rid in PROMPTS}
print("first scheduled in step:", first_step)
print("prefill chunks:         ", chunks)
print("steps mixing prefill and decode:", [t.step for t in traces if t.num_prefill_tokens and t.num_decode_tokens])

# %%
assert first_step["late"] > 4                              # it arrived after step 4 ...
assert any(r.kind == "decode" for r in by_step[first_step["late"]].values())   # ... and joined a running batch
assert chunks["long"] > 1 and chunks["short"] == 1         # the long prompt was split, the short one was not

# %% [markdown]
# ### Exercise: one scheduling step with a token budget
#
# Before reading `schedule()`, plan a step yourself. `schedule_step(running, waiting, max_num_batched_tokens,
# max_num_seqs)` returns `{request_id: tokens}`: how many tokens each scheduled request computes this step
# (a request that gets nothing is left out).
#
# - `running` is a list of `(request_id, tokens still to compute)` in the running queue's order, at most
#   `max_num_seqs` of them; `waiting` is a list of `(request_id, prompt tokens)` in the waiting queue's order
#   (priority, then arrival).
# - Running requests go first: those with exactly 1 token left (decodes) first, then the others (prefill
#   chunks), each group in queue order. Each takes what it still needs, cut to what is left of the budget;
#   once the budget is spent, the others get nothing this step.
# - Then waiting requests, in order, while some budget is left and fewer than `max_num_seqs` requests are
#   running (those running plus those admitted so far). A prompt longer than what is left of the budget is
#   admitted with a chunk of it, and the next request waits: the queue is never skipped.
# - The KV pool is large enough for everyone (running out is lesson 04), and there is no prefix cache, so an
#   admitted request computes its prompt from its first token.
#
# `check` runs your function on hand-made steps, then against a real `Scheduler` on 6 random workloads
# (requests arriving at random, the model's output faked), comparing your plan with `schedule()`'s before
# every step, and says which case failed and how. At the end your function plans step 1 of section 2.
# (In CI the lessons run with the solutions, from `lessons/solutions/`; try first.)

# %%
from course import check, exercise


@exercise("03.schedule_step")
def schedule_step(running, waiting, max_num_batched_tokens, max_num_seqs):
    budget = max_num_batched_tokens
    scheduled = {}
    # your code here
    raise NotImplementedError


check(schedule_step)
first = [(rid, len(tokenizer.encode(PROMPTS[rid], add_special_tokens=False))) for rid in ("short", "long", "medium")]
print("step 1, by your function:", schedule_step([], first, BUDGET, engine.scheduler.max_num_seqs))
print("step 1, by the scheduler:", plan.num_scheduled_tokens)

# %% [markdown]
# The real one, `Scheduler.schedule`, is the same two loops, and the whole of it is printed below. What it adds to
# yours is memory: it asks for the blocks of every scheduled token (`_allocate`, the KV cache manager's
# `allocate_slots`) and preempts someone when there are none (`_choose_victim`, lesson 04), admits nobody in a
# step that preempted, brings back swapped requests (`_swap_in`, lesson 04), looks up a waiting prompt's prefix
# in the cache (`num_cached`, 0 here) and offers the blocks a step fills to the requests admitted after it
# (`_offer_blocks`, lesson 01), and caps one request's prefill chunk at `long_prefill_token_threshold` (`_chunk`:
# 96 tokens on a CPU, so a long prompt shares its steps with the others' decodes; with images, it also stops
# before an image whose encoder output has no room yet, lesson 15). The other modes plug in at the
# small methods it calls, and cost nothing when they are off: speculative decoding's drafts (`_drafts_to_verify`,
# lesson 13), and batches in flight (pipeline parallelism, async scheduling), which are a subclass,
# `AsyncScheduler`, overriding those methods (lesson 11).

# %%
import inspect

from minivllm.core.scheduler import Scheduler

print(inspect.getsource(Scheduler.schedule))

# %%
assert schedule_step([], first, BUDGET, engine.scheduler.max_num_seqs) == plan.num_scheduled_tokens

# %% [markdown]
# ## 3. Priorities
#
# `engine.add_request(..., priority=p)` (and `LLM.generate(..., priority=[...])`) orders the waiting queue:
# **lower runs first**, vLLM's convention; ties go by arrival. Three background jobs arrive with priority 1,
# then an urgent question with priority 0. The waiting queue is sorted at once:

# %%
jobs = {"job-1": SENTENCES[0:2], "job-2": SENTENCES[2:4], "job-3": SENTENCES[5:7]}
for rid, sentences in jobs.items():
    engine.add_request(summarize(sentences), params, request_id=rid, priority=1)
engine.add_request(chat_prompt("What is the capital of France?"), params, request_id="urgent", priority=0)
print("waiting queue, first to last:", [(r.request_id, r.priority) for r in engine.scheduler.waiting])

priority_outputs = {}
with engine.record_traces() as prio_traces:                # a new recording: steps of this run only
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                priority_outputs[out.request_id] = out
for t in prio_traces[:4]:
    print(describe(t))

# %%
# NBVAL_IGNORE_OUTPUT
fig, ax = plt.subplots(figsize=(10, 2.6))
draw_who_ran(ax, prio_traces, order=["urgent", "job-1", "job-2", "job-3"],
             labels={"urgent": "urgent (priority 0)", "job-1": "job-1 (priority 1)", "job-2": "job-2 (priority 1)",
                     "job-3": "job-3 (priority 1)"},
             title="The priority-0 request is admitted first, although it arrived last")
plt.show()

# %% [markdown]
# `urgent` arrived last but was admitted first and answered first. Priority only orders the *waiting* queue
# (and, in lesson 04, chooses whom to preempt when blocks run out): a running request is not interrupted
# because a more important one arrives.

# %%
urgent_first = min(t.step for t in prio_traces if t.by_id.get("urgent") and t.by_id["urgent"].kind)
assert prio_traces[0].by_id["urgent"].kind == "prefill" and urgent_first == prio_traces[0].step
assert [r.request_id for r in engine.scheduler.waiting] == []
assert "Paris" in priority_outputs["urgent"].outputs[0].text

# %% [markdown]
# ## 4. The budget changes the schedule, never the answer
#
# Chunking a prompt changes how its tokens are grouped into forward passes, not what is computed: each chunk
# attends to the KV of all earlier chunks in the cache, exactly as if the prompt had run in one piece. So
# greedy outputs must be the same token for token, whatever the budget. We run the four prompts of section 1
# together with budgets of 16, 64 and 8192 tokens (8192 is the default budget; `long_prefill_token_threshold=0`
# lifts a CPU's 96-token cap on one prompt's chunk, so that at 8192 every prompt runs in one piece).

# %%
results, budget_traces = {}, {}
for budget in (16, 64, 8192):
    llm_b = LLM(num_kv_blocks=128, max_num_seqs=8, max_num_batched_tokens=budget, enable_prefix_caching=False,
                long_prefill_token_threshold=0, seed=0)
    with llm_b.llm_engine.record_traces() as tr:
        outs = llm_b.generate(list(PROMPTS.values()), params, use_tqdm=False)
    budget_traces[budget] = tr
    results[budget] = [o.outputs[0].token_ids for o in outs]
    del llm_b

for budget, tr in budget_traces.items():
    largest = max(t.num_prefill_tokens + t.num_decode_tokens for t in tr)
    print(f"budget {budget:5d}: {len(tr):2d} steps, largest step {largest:3d} tokens, "
          f"same tokens as budget 64: {results[budget] == results[64]}")
step_by_step = [outputs[rid].outputs[0].token_ids for rid in PROMPTS]
print("same as the step-by-step run of section 2:", results[64] == step_by_step)

# %%
# NBVAL_IGNORE_OUTPUT
fig, axes = plt.subplots(1, 3, figsize=(12, 3.2))
for ax, (budget, tr) in zip(axes, budget_traces.items()):
    draw_steps(ax, tr, budget if budget < 8192 else None, f"budget {budget}: {len(tr)} steps")
handles, names = axes[0].get_legend_handles_labels()
fig.legend(handles, ["max_num_batched_tokens", "decode tokens", "prefill tokens"], loc="lower center", ncol=3,
           fontsize=8, frameon=False)
plt.tight_layout(rect=(0, 0.08, 1, 1))
plt.show()

# %% [markdown]
# The same work, three shapes. With a budget of 8192 the first step reads all four prompts at once (more
# than 500 tokens) and everything after it is a decode; with 16 the prompts trickle in over dozens of steps.
# A server picks the budget to bound the time of one step, which bounds how long every running request waits
# for its next token.

# %%
assert results[16] == results[64] == results[8192] == step_by_step
assert max(t.num_prefill_tokens + t.num_decode_tokens for t in budget_traces[16]) <= 16
assert len(budget_traces[8192]) < len(budget_traces[64]) < len(budget_traces[16])

# %% [markdown]
# ## Check yourself
#
# Run this cell. On the lesson's engine it replays the claims: the budget holds in every step, a long prompt is
# split into chunks that add up to its length, the lower priority number is admitted first, and the answers
# do not depend on any of it.

# %%
def self_check(llm):
    engine = llm.llm_engine
    budget = engine.scheduler.max_num_batched_tokens
    engine.add_request(PROMPTS["long"], params, request_id="check-long", priority=1)
    engine.add_request(PROMPTS["short"], params, request_id="check-short", priority=0)
    assert engine.scheduler.waiting[0].request_id == "check-short", "priority 0 goes first"
    done = {}
    with engine.record_traces() as tr:
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0].token_ids
    assert not engine.trace_listeners, "the recording stopped with the with-block"
    assert all(t.num_prefill_tokens + t.num_decode_tokens <= budget for t in tr)
    long_chunks = [t.by_id["check-long"].num_scheduled_tokens for t in tr
                   if "check-long" in t.by_id and t.by_id["check-long"].kind == "prefill"]
    assert len(long_chunks) > 1 and sum(long_chunks) == len(tokenizer.encode(PROMPTS["long"], add_special_tokens=False))
    assert tr[0].by_id["check-short"].num_scheduled_tokens == tr[0].by_id["check-short"].num_prompt_tokens
    assert done["check-long"] == results[8192][1] and done["check-short"] == results[8192][0]
    assert engine.kv_cache_manager.num_free_blocks == engine.kv_cache_manager.num_blocks
    engine.check_integrity()
    return "all checks passed"


self_check(llm)

# %% [markdown]
# ## Where next
#
# Everything here had plenty of KV blocks. Lesson 04 shrinks the pool until a running request needs a block
# and none is free: the scheduler then **preempts** someone, either dropping its KV (recompute) or copying
# it to CPU memory (swap).
