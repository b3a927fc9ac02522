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
# # Lesson 00: a tour of minivllm
#
# minivllm is a small re-implementation of vLLM's core: the same names, the same moving parts, few enough
# lines to read in an afternoon. This tour runs it end to end on the CPU and opens the hood once:
#
# 1. load the default model (SmolLM2-135M-Instruct) and generate,
# 2. read what comes back (a `RequestOutput`),
# 3. look at the KV cache: one big tensor, cut into fixed-size **blocks**,
# 4. drive the engine one `step()` at a time and draw which request holds which block,
# 5. check that the pool is whole again when the work is done.
#
# Every later lesson zooms into one of the boxes below. When you call `LLM.generate`, each prompt becomes a
# `Request` inside the `LLMEngine`, and the engine loops:
#
# ```
# LLM.generate(prompts)                         entrypoints/llm.py
#   └─ LLMEngine.add_request(...)               engine/llm_engine.py        one Request per prompt
#      while unfinished: LLMEngine.step()       engine/llm_engine.py        one step, all or nothing
#      (LLMEngine.execute_step):
#        ├─ Scheduler.begin_step()              core/scheduler.py           open the step's journal
#        ├─ Scheduler.schedule()                core/scheduler.py           who runs, how many tokens each
#        │    └─ KVCacheManager.allocate_slots  core/kv_cache_manager.py    which KV blocks hold them
#        │         └─ BlockPool.take_fresh      core/block_pool.py          free blocks, ref counts, hashes
#        ├─ ModelRunner.execute_model           worker/model_runner.py      flat batch -> model -> logits
#        ├─ ModelRunner.sample_tokens           worker/model_runner.py      logits -> one token per request
#        ├─ Scheduler.update_from_output        core/scheduler.py           tokens in; full blocks cached
#        ├─ OutputProcessor.process_outputs     engine/output_processor.py  detokenize, find stop strings
#        ├─ Scheduler.commit_step()             core/scheduler.py           keep it all (or rollback_step)
#        └─ OutputProcessor.apply               engine/output_processor.py  -> RequestOutput
# ```
#
# If anything in a step raises (the model, the sampler, even a Ctrl-C), the scheduler rolls the step back and
# the engine is exactly as it was before it (lesson 02, "When a step fails"). `docs/architecture.md` follows one
# request through these files. Everything here is seeded and greedy, so the outputs you see are the outputs you
# will get.

# %% [markdown]
# ## 1. Load the model
#
# `LLM()` with no model loads the embedded SmolLM2-135M-Instruct. We ask for a deliberately tiny KV pool,
# 64 blocks, so that the whole pool fits in one picture later, and at most 8 requests per step.
# (By default the pool is sized from memory: 1 GiB on a CPU, most of the free memory on a GPU.)

# %%
import warnings

warnings.filterwarnings("ignore", message="IProgress not found")   # tqdm's notice when ipywidgets is absent

import matplotlib.pyplot as plt
import torch

from minivllm import LLM, SamplingParams
from plots import RequestColors, draw_held, draw_pool, pool_legend

torch.set_num_threads(1)   # see below
torch.manual_seed(0)
llm = LLM(num_kv_blocks=64, max_num_seqs=8, seed=0)

engine = llm.llm_engine
cfg = engine.model_config
print(f"model        {cfg.architecture}: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, "
      f"vocab {cfg.vocab_size}")
print(f"attention    {cfg.num_attention_heads} query heads, {cfg.num_key_value_heads} KV heads, "
      f"head_dim {cfg.head_dim}")
print(f"device/dtype {engine.device.type} / {engine.model_runner.dtype}")
print(f"KV pool      {engine.kv_cache_manager.num_blocks} blocks of {engine.kv_cache_manager.block_size} tokens")

# %% [markdown]
# A note on `torch.set_num_threads(1)`: a 135M model is too small to gain much from a second CPU thread, and
# on a busy 2-core machine two threads that wait for each other can make every step many times slower. One
# thread also keeps floating-point sums in the same order on every machine, so greedy outputs match exactly.
#
# Three KV heads serve nine query heads (grouped-query attention): each KV head is shared by three query
# heads, which makes the KV cache three times smaller than it would be otherwise. Keep that in mind when we
# measure a block below.

# %%
assert engine.kv_cache_manager.num_blocks == 64 and engine.kv_cache_manager.block_size == 16
assert engine.kv_cache_manager.num_free_blocks == 64        # nothing has run yet

# %% [markdown]
# ## 2. Generate
#
# `temperature=0` means greedy decoding: at every step the engine takes the most likely next token, so the
# answer is a pure function of the prompt. `llm.chat` applies the model's chat template first (the
# `<|im_start|>...<|im_end|>` markup SmolLM2 was trained with); `llm.generate` takes raw text.

# %%
greedy = SamplingParams(temperature=0, max_tokens=16)
question = [{"role": "user", "content": "What is the capital of France?"}]

answer = llm.chat(question, greedy, use_tqdm=False)[0]
print(answer.outputs[0].text)

# %% [markdown]
# Several prompts go in one call; they are batched together inside the engine (section 4 shows how).

# %%
prompts = ["The quick brown fox", "Once upon a time"]
for out in llm.generate(prompts, greedy, use_tqdm=False):
    print(f"{out.prompt!r:24} -> {out.outputs[0].text!r}  [{out.outputs[0].finish_reason}]")

# %% [markdown]
# The chat answer stopped by itself (`finish_reason="stop"`: the model produced its end-of-turn token);
# the two raw prompts ran into `max_tokens=16` (`finish_reason="length"`).

# %%
assert "Paris" in answer.outputs[0].text
assert answer.outputs[0].finish_reason == "stop"

# %% [markdown]
# ## 3. What comes back: `RequestOutput`
#
# Each prompt gives one `RequestOutput` (vLLM's name and fields). Its `repr` is a summary:

# %%
answer

# %% [markdown]
# `prompt_token_ids` is what the model actually saw. The chat template added a system prompt, so a
# six-word question became 37 tokens. Token 1 is `<|im_start|>`, token 2 is `<|im_end|>`:

# %%
tokenizer = llm.get_tokenizer()
ids = answer.prompt_token_ids
print(len(ids), "prompt tokens")
print(ids)
print(tokenizer.convert_ids_to_tokens(ids[-14:]))

# %% [markdown]
# `outputs[0]` is the generated completion (a `CompletionOutput`; vLLM can return `n` of them per prompt).
# `token_ids` keeps the end-of-turn token that stopped it, `text` leaves it out (`skip_special_tokens=True`).
# The `Ġ` in a token is how this byte-level tokenizer writes a leading space.

# %%
completion = answer.outputs[0]
for tid, piece in zip(completion.token_ids, tokenizer.convert_ids_to_tokens(completion.token_ids)):
    print(f"{tid:6d}  {piece!r}")
print("text:         ", repr(completion.text))
print("finish_reason:", completion.finish_reason)
print("stop_reason:  ", completion.stop_reason, "(set only for a stop string or stop_token_ids; EOS leaves it None)")

# %% [markdown]
# `metrics` holds wall-clock timestamps (`time.time()`) in vLLM's names. The useful numbers are differences:
# time to first token (TTFT: queueing plus the prompt's prefill) and the time per output token after it.
# They depend on your machine, so this cell's output is not checked.

# %%
# NBVAL_IGNORE_OUTPUT
m = answer.metrics
ttft = m.first_token_time - m.arrival_time
per_token = (m.last_token_time - m.first_token_time) / max(len(completion.token_ids) - 1, 1)
print(f"time to first token: {ttft * 1000:.0f} ms")
print(f"time per output token: {per_token * 1000:.0f} ms")

# %% [markdown]
# `num_cached_tokens` counts prompt tokens whose KV came from the **prefix cache** instead of being computed.
# It was 0 the first time. Ask again: the KV of the first two full 16-token blocks of this prompt is still
# in the pool, so only the last 5 tokens run through the model (lesson 01 is about this). The answer must
# not change.

# %%
again = llm.chat(question, greedy, use_tqdm=False)[0]
print("first time :", answer.num_cached_tokens, "cached prompt tokens")
print("second time:", again.num_cached_tokens, "cached prompt tokens")
print("same answer:", again.outputs[0].token_ids == answer.outputs[0].token_ids)

# %%
assert answer.num_cached_tokens == 0
assert again.num_cached_tokens == 32                    # 2 full blocks of 16; the last partial block is not cached
assert again.outputs[0].token_ids == answer.outputs[0].token_ids

# %% [markdown]
# ## 4. The KV cache is one tensor, cut into blocks
#
# Attention needs, for every earlier token, its key and value vectors in every layer. Recomputing them each
# step would make decoding quadratic, so the engine keeps them: the KV cache. minivllm allocates the whole
# cache up front as one tensor:

# %%
kv = engine.model_runner.kv_cache
print(tuple(kv.shape), kv.dtype)

# %% [markdown]
# Read the shape from left to right:

# %%
meaning = {
    "2": "K and V: index 0 holds keys, 1 holds values",
    "num_layers": "one slab per decoder layer (each layer attends to its own K/V)",
    "num_blocks": "the pool: physical blocks, handed out by the block pool",
    "block_size": "token slots per block: a block holds the K/V of 16 consecutive tokens of one sequence",
    "kv_heads": "key/value heads (3, shared by 9 query heads)",
    "head_dim": "the size of one head's key or value vector",
}
for (name, text), size in zip(meaning.items(), kv.shape):
    print(f"{name:>10} = {size:3d}   {text}")

# %% [markdown]
# A sequence does not own a contiguous stretch of this tensor. It owns a list of block ids, its
# **block table**, and token `p` of the sequence lives at
#
# ```
# block  = block_table[p // block_size]     slot within the block = p % block_size
# key of token p in layer l = kv_cache[0, l, block, p % block_size]      # (kv_heads, head_dim)
# ```
#
# This is vLLM's PagedAttention idea, borrowed from virtual memory: blocks are pages, block tables are page
# tables. Memory is taken one block at a time as a sequence grows, so nothing is reserved for tokens that may
# never be generated, and freed blocks are reused by any other sequence.
#
# How much memory is one block? Every number in the shape except `num_blocks`:

# %%
L, B, H, D = cfg.num_hidden_layers, engine.kv_cache_manager.block_size, cfg.num_key_value_heads, cfg.head_dim
num_blocks = engine.kv_cache_manager.num_blocks
bytes_per_token = 2 * L * H * D * kv.element_size()    # K and V, all layers, all KV heads
bytes_per_block = bytes_per_token * B
print(f"one token : 2 x {L} layers x {H} heads x {D} dims x {kv.element_size()} bytes = {bytes_per_token / 1024:.0f} KiB")
print(f"one block : {B} tokens x {bytes_per_token / 1024:.0f} KiB = {bytes_per_block / 1024:.0f} KiB")
print(f"the pool  : {num_blocks} blocks = {kv.numel() * kv.element_size() / 2**20:.0f} MiB, "
      f"room for {num_blocks * B} tokens")

# %%
assert bytes_per_block == engine.model_runner.bytes_per_block
assert kv.numel() * kv.element_size() == num_blocks * bytes_per_block

# %% [markdown]
# 45 KiB per token in fp32 for a 135M-parameter model. The same arithmetic for a Llama-3-8B in bf16
# (32 layers, 8 KV heads, head_dim 128, 2 bytes) gives 128 KiB per token: serving is mostly a question of
# fitting KV, and the scheduler and the KV cache manager are what decide who gets it.

# %% [markdown]
# ## 5. Drive the engine by hand and watch the pool
#
# `LLM.generate` is a thin loop: add every request, then call `engine.step()` until nothing is left. Here we
# run that loop ourselves so we can stop in the middle and look. Three requests, two of them chat prompts
# that start with the same 24 tokens (system prompt and chat markup):

# %%
def chat_prompt(text):
    """The chat template applied to one user message, as a string the engine can take."""
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                         add_generation_prompt=True)


requests = {
    "colors": (chat_prompt("Name three primary colors."), SamplingParams(temperature=0, max_tokens=24)),
    "haiku": (chat_prompt("Write a haiku about autumn."), SamplingParams(temperature=0, max_tokens=32)),
    "story": ("Once upon a time, in a small village by the sea, there lived an old fisherman who",
              SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)),
}
for rid, (prompt, params) in requests.items():
    engine.add_request(prompt, params, request_id=rid)

print("waiting:", [r.request_id for r in engine.scheduler.waiting])
print("running:", [r.request_id for r in engine.scheduler.running])

# %% [markdown]
# Nothing holds KV yet: requests wait until a `step()` schedules them. The first step admits all three and
# runs their whole prompts through the model in one flat batch (the **prefill**); every later step computes
# one new token per request (a **decode**). A small printer for the running requests:

# %%
def show_running(engine):
    for r in engine.scheduler.running:
        print(f"  {r.request_id:7} {r.num_prompt_tokens:3d} prompt + {r.num_output_tokens:2d} output tokens, "
              f"{r.num_computed_tokens:3d} with KV, block_table={r.block_table}")


finished = {}
for step in range(1, 7):
    for out in engine.step():
        if out.finished:
            finished[out.request_id] = out
    if step in (1, 2, 6):
        print(f"after step {step}:")
        show_running(engine)

# %% [markdown]
# ### Exercise: how many blocks does a request hold?
#
# Before reading on, work it out from the numbers printed above. `blocks_held(num_prompt_tokens,
# num_output_tokens, block_size)` returns how many blocks are in a running request's block table after the step
# that gave it its `num_output_tokens`-th token. Two things decide it:
#
# - which of its tokens have KV after the step: compare the "with KV" column with the prompt and output counts;
# - blocks are taken whole: a partly filled last block counts as one.
#
# `check` runs your function on hand-worked cases, then compares it with the block tables of a real engine (one
# of its own, with blocks of 8 tokens) after every step, and with which requests that engine accepts for its
# pool. It says which case failed and how. (In CI the lessons run with the solutions, from `lessons/solutions/`;
# try first.)

# %%
from course import check, exercise


@exercise("00.blocks_held")
def blocks_held(num_prompt_tokens, num_output_tokens, block_size):
    # your code here
    raise NotImplementedError


check(blocks_held)
for r in engine.scheduler.running:
    print(f"{r.request_id:7} holds {len(r.block_table)} blocks; blocks_held says "
          f"{blocks_held(r.num_prompt_tokens, r.num_output_tokens, engine.kv_cache_manager.block_size)}")

# %% [markdown]
# After a step, each request holds exactly the blocks its tokens with KV need: `ceil(with KV / 16)`.
# "With KV" trails the token count by one: the newest sampled token has no KV yet. The next step computes it,
# after taking a fresh block if the last one is full. That is `KVCacheManager.allocate_slots`, called by the
# scheduler for every request it schedules: `total` is the tokens that will have KV once the step has run, and
# only the blocks missing from the block table are taken from the pool:

# %%
import inspect

from minivllm.core.kv_cache_manager import KVCacheManager

print(inspect.getsource(KVCacheManager.blocks_needed))
print(inspect.getsource(KVCacheManager.allocate_slots))

# %% [markdown]
# The same count decides whether a request is accepted at all: `LLMEngine.validate_request` refuses one whose
# last step, with `prompt + max_tokens - 1` tokens with KV, would need more blocks than the whole pool has (the
# last group of checks above).
#
# Now the ref counts. `colors` and `haiku` have the same first block id: the first 16 tokens of both prompts
# are the same system-prompt tokens, the French question of section 3 left that block in the prefix cache,
# and both requests picked it up. (They would have shared it even without the French question. A block joins
# the prefix cache only when the step that computed it commits, but while a step is open the full blocks it is
# computing are offered to requests admitted later in the same step; lesson 01.) One physical block, two block
# tables, `ref_count == 2`.
#
# The block pool (`engine.kv_cache_manager.block_pool`, `core/block_pool.py`) owns the ref counts;
# `snapshot()` copies the whole pool's ref counts and prefix-cached free blocks at one moment:

# %%
kvm = engine.kv_cache_manager           # which request holds which blocks (core/kv_cache_manager.py)
pool = kvm.block_pool                   # the blocks themselves: ref counts, free queues, hashes
snap = pool.snapshot()
for b in sorted({b for r in engine.scheduler.running for b in r.block_table}):
    holders = [r.request_id for r in engine.scheduler.running if b in r.block_table]
    print(f"block {b:2d}: ref_count={snap.ref_counts[b]}  held by {holders}")

# %%
for b in range(kvm.num_blocks):
    held_by = sum(b in r.block_table for r in engine.scheduler.running)
    assert snap.ref_counts[b] == held_by                # a ref count is exactly the number of block tables
engine.check_integrity()                                # the core's own invariant check

# %% [markdown]
# ### The picture
#
# The whole pool, one square per block. A block held by a request has that request's colour, filled in
# proportion to how many of its 16 slots already hold KV, and shows its ref count. A shared block (`ref 2`,
# in bold) is hatched over its first holder's colour. Free blocks are grey: light grey ones are empty, darker
# grey ones still hold the KV of a finished request's full block (the prefix cache: free to reuse, but worth
# keeping until the space is needed).

# %%
req_colors = RequestColors(["colors", "haiku", "story"])   # request id -> palette colour, in order of arrival


def draw_engine_pool(engine, title, cols=16):
    """The engine's whole pool now: each running request's blocks in its colour, filled as far as KV is written."""
    kvm, bs = engine.kv_cache_manager, engine.kv_cache_manager.block_size
    snap = kvm.block_pool.snapshot()                    # the whole pool at this moment
    running = engine.scheduler.running
    filled = {}                                         # block id -> share of its 16 slots that hold KV
    for r in running:
        for i, b in enumerate(r.block_table):
            filled[b] = max(filled.get(b, 0), min(max(r.num_computed_tokens - i * bs, 0), bs) / bs)
    rows = -(-kvm.num_blocks // cols)
    fig, ax = plt.subplots(figsize=(cols * 0.55, rows * 0.6 + 1.1))
    draw_pool(ax, kvm.num_blocks, {r.request_id: r.block_table for r in running}, snap.ref_counts,
              snap.cached_free, req_colors, filled=filled, cols=cols, title=title)
    legend = pool_legend({r.request_id: req_colors(r.request_id) for r in running})
    ax.legend(handles=legend, loc="upper center", bbox_to_anchor=(0.5, -0.02), ncol=3, fontsize=8, frameon=False)
    plt.show()


# %%
# NBVAL_IGNORE_OUTPUT
draw_engine_pool(engine, "KV block pool after 6 steps")

# %% [markdown]
# Things to notice:
#
# - A request's blocks need not be adjacent or in order; the block table is the only link between them.
# - Only the last block of each request is partly empty. That tail is all the memory paging wastes: at most
#   15 slots per request, instead of a reservation for `max_tokens` that may never be used.
# - The grey blocks from sections 2 and 3 are free. The darker ones still hold full blocks of KV that a
#   future prompt with the same prefix can reuse, as `colors` and `haiku` did with block 0.
#
# ### Run to the end
#
# Keep stepping, and record how many blocks each request holds after every step:

# %%
held = [{r.request_id: len(r.block_table) for r in engine.scheduler.running}]   # per step: request -> blocks
in_use = [kvm.num_blocks - kvm.num_free_blocks]
while engine.has_unfinished_requests():
    for out in engine.step():
        if out.finished:
            finished[out.request_id] = out
    held.append({r.request_id: len(r.block_table) for r in engine.scheduler.running})
    in_use.append(kvm.num_blocks - kvm.num_free_blocks)

for rid, out in finished.items():
    print(f"{rid:7} {len(out.outputs[0].token_ids):2d} tokens [{out.outputs[0].finish_reason}] "
          f"{out.outputs[0].text!r}")

# %% [markdown]
# Blocks held per request from step 6 to the end, stacked. Each request takes one more block every 16 tokens
# and gives everything back the step it finishes; in a server, a waiting request would take that space in the
# very next step (continuous batching, lesson 03). The black line is what the pool really lends out: block 0
# is in two stacks but is one block, until `colors` finishes and its ref count drops to 1.

# %%
# NBVAL_IGNORE_OUTPUT
steps = range(6, 6 + len(held))
fig, ax = plt.subplots(figsize=(9, 2.8))
draw_held(ax, steps, {rid: [h.get(rid, 0) for h in held] for rid in req_colors.assigned},
          req_colors, "Blocks held per request, stacked")
ax.set_xlabel("engine step")
ax.step(steps, in_use, where="post", color="black", lw=1.2, label="blocks in use (shared counted once)")
ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8, frameon=False)
plt.show()

# %% [markdown]
# ## 6. The pool is whole again
#
# Every block went back: nothing is running, and every block is free. The ones holding full, hashed blocks
# stay in the prefix cache (dark grey) until fresh blocks run out and they are evicted. `llm.get_stats()`
# returns an `EngineStats` of counters over the engine's life; we print a few of them. The 64 prefix-cache
# hits are the 32 tokens of section 3's repeated question plus block 0 for both `colors` and `haiku`.

# %%
print("running:", engine.scheduler.running, " waiting:", engine.scheduler.waiting)
print(f"free blocks: {kvm.num_free_blocks} of {kvm.num_blocks} "
      f"({len(pool.snapshot().cached_free)} of them prefix-cached)")
stats = llm.get_stats()
print(f"over the engine's life: {stats.num_steps} steps, {stats.num_prompt_tokens_computed} prompt tokens computed, "
      f"{stats.num_generated_tokens} tokens generated")
print(f"prefix cache: {stats.prefix_cache_hits} of {stats.prefix_cache_queries} prompt tokens looked up were hits "
      f"({stats.prefix_cache_hit_rate:.0%}); preemptions: {stats.num_preemptions}")

# %%
# NBVAL_IGNORE_OUTPUT
draw_engine_pool(engine, "KV block pool after the run")

# %%
assert engine.kv_cache_manager.num_free_blocks == engine.kv_cache_manager.num_blocks
assert set(engine.kv_cache_manager.block_pool.snapshot().ref_counts) == {0}
assert stats.prefix_cache_hits == 32 + 16 + 16 and stats.num_preemptions == 0
engine.check_integrity()

# %% [markdown]
# ## Check yourself
#
# Run this cell. It repeats the lesson's claims from scratch on the same engine: the greedy answer names
# Paris, greedy decoding gives the same tokens every time (with or without the prefix cache helping), and
# a finished batch leaves every block free.

# %%
def self_check(llm):
    sp = SamplingParams(temperature=0, max_tokens=16)
    q = [{"role": "user", "content": "What is the capital of France?"}]
    first = llm.chat(q, sp, use_tqdm=False)[0]
    assert "Paris" in first.outputs[0].text, first.outputs[0].text
    repeats = [llm.chat(q, sp, use_tqdm=False)[0] for _ in range(2)]
    assert all(r.outputs[0].token_ids == first.outputs[0].token_ids for r in repeats), "greedy is not deterministic"
    batch = llm.generate(["The quick brown fox", "Once upon a time"], sp, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in batch] == [16, 16]
    kvm = llm.llm_engine.kv_cache_manager
    assert kvm.num_free_blocks == kvm.num_blocks, f"{kvm.num_blocks - kvm.num_free_blocks} blocks still held"
    assert not llm.llm_engine.has_unfinished_requests()
    llm.llm_engine.check_integrity()
    return "all checks passed"


self_check(llm)

# %% [markdown]
# ## Where next
#
# Each box in the diagram at the top has its own lesson, next to the module of the same name:
#
# - **01 block manager & prefix caching**: ref counts, chained block hashes, eviction, and what a failed step
#   leaves behind (`core/kv_cache_manager.py`, `core/block_pool.py`).
# - **02 scheduler & chunked prefill**: one token budget per step, prefills and decodes in one batch, a step
#   as a transaction (`core/scheduler.py`).
# - **03 preemption**: what happens when the pool runs out mid-generation (`core/scheduler.py`).
# - **04 paged attention & Triton kernels**: reading K/V through a block table (`model/attention.py`, `kernels/`).
# - **05 tensor parallelism**: splitting heads and MLPs across devices (`model/layers.py`).
# - **06 serving**: streaming, an OpenAI-compatible API and a chat UI (`engine/async_llm.py`,
#   `entrypoints/api_server.py`).
