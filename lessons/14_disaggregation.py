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
# # Lesson 14: prefill/decode disaggregation, KV blocks that move between instances
#
# A request has two phases that want different machines. Its **prefill** runs the whole prompt through the
# model in one pass: many tokens per weight read, so it is limited by arithmetic. Its **decode** makes one
# token per step: every weight is read for a handful of tokens, so it is limited by memory bandwidth (lesson
# 10's roofline, lesson 13's first section). **Disaggregation** runs the two on separate engine instances: a
# *producer* computes the prompt and saves its KV blocks, a *consumer* loads those blocks into its own pool
# and decodes. Each side can then be sized and batched for its own bottleneck, and a long prompt never holds
# up the tokens of requests that are already decoding.
#
# ```
# client ─> proxy ─> producer  (kv_role "kv_producer")   prompt, max_tokens=1: computes the prompt,
#                                                          saves its blocks          kv_transfer/base.py
#                                   │ blocks, named by keys    store: files (SharedStorageConnector) or TCP
#                                   v
#                    consumer  (kv_role "kv_consumer")   the same request: loads the blocks, computes the
#                                                          last prompt token, streams the answer
# ```
#
# What moves is the KV of the prompt's tokens `[0, P-1)`; the consumer computes token `P-1` itself, since it
# needs that token's logits to sample the first output token. The proxy in front of both is
# `entrypoints/disagg_proxy.py`. This lesson measures the stall that mixing causes, reads the connector API
# and where the engine calls it, runs a producer and a consumer through a shared directory, weighs the
# transfer against the prefill it saves, breaks a block on purpose, and has you write the consumer's first
# question: how many prompt tokens can I load? Code printed with `inspect.getsource` is the installed
# module's (those cells are `# NBVAL_IGNORE_OUTPUT`).

# %%
import warnings

warnings.filterwarnings("ignore", message="IProgress not found")   # tqdm's notice when ipywidgets is absent

import atexit
import inspect
import logging
import re
import shutil
import tempfile
import time
from pathlib import Path

import matplotlib.pyplot as plt
import torch
from matplotlib.patches import ConnectionPatch, Patch, Rectangle

from minivllm import LLM, SamplingParams
from minivllm.core.scheduler import Scheduler
from minivllm.kv_transfer import KVConnectorBase_V1, block_keys, decode_block, encode_block
from minivllm.worker.model_runner import ModelRunner
from plots import CLEAN_FREE, RequestColors, contrast

torch.manual_seed(0)
torch.set_num_threads(1)   # one thread: faster on a busy 2-core CPU, and the same float sums everywhere

SHARED = Path(tempfile.mkdtemp(prefix="minivllm-lesson12-"))   # the store both instances read and write
atexit.register(shutil.rmtree, SHARED, ignore_errors=True)      # removed when the kernel stops


def transfer(role):
    """vLLM's kv_transfer_config for one side of the shared directory."""
    return {"kv_connector": "SharedStorageConnector", "kv_role": role,
            "kv_connector_extra_config": {"shared_storage_path": str(SHARED)}}


plain = LLM(num_kv_blocks=32, max_num_seqs=4, seed=0)                    # no connector: the reference
producer = LLM(num_kv_blocks=32, max_num_seqs=4, seed=0, kv_transfer_config=transfer("kv_producer"))
consumer = LLM(num_kv_blocks=32, max_num_seqs=4, seed=0, kv_transfer_config=transfer("kv_consumer"))
tokenizer = plain.get_tokenizer()
BS = plain.llm_engine.kv_cache_manager.block_size
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
print(f"three engines of the same model, 32 KV blocks of {BS} tokens each; the store is a temporary directory")

# %% [markdown]
# ## 1. Why disaggregate: a prefill in the middle of decodes
#
# One instance serves two requests that are decoding, and a third arrives with a long prompt. Continuous
# batching puts the new prompt into the next steps beside the decodes: each such step does the decodes' work
# *and* a chunk of the prefill, and each decoding request waits for it to end before it sees its next token.
# On a CPU minivllm caps one request's prefill at `long_prefill_token_threshold` tokens a step (lesson 03's
# chunked prefill), so the stall is spread over several steps instead of one. We record every step with
# `record_traces` (lessons 03 and 04) and look at its length.

# %%
chat = [tokenizer.apply_chat_template([{"role": "user", "content": ask}], tokenize=False, add_generation_prompt=True)
        for ask in ("Name three colours.", "Count from one to ten.")]
long_prompt = " ".join(["The block manager hands out fixed-size blocks of KV cache to every request."] * 24)
engine = plain.llm_engine
with engine.record_traces() as traces:
    for i, prompt in enumerate(chat):
        engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), f"decode-{i}")
    for _ in range(6):
        engine.step()
    engine.add_request(long_prompt, SamplingParams(temperature=0, max_tokens=1), "long")
    while engine.has_unfinished_requests():
        engine.step()
steps = [(t.num_prefill_tokens, t.num_decode_tokens, t.duration_s) for t in traces]
print(f"long_prefill_token_threshold: {engine.scheduler.long_prefill_token_threshold} tokens")
for i, (prefill, decode, _) in enumerate(steps):
    print(f"step {i:2d}: {decode} decode tokens + {prefill:3d} prefill tokens")

# %%
# NBVAL_IGNORE_OUTPUT
pure = sorted(d for p, n, d in steps if p == 0)
mixed = [d for p, n, d in steps if p > 0 and n > 0]
typical = pure[len(pure) // 2]
print(f"a decode-only step: {typical * 1e3:.0f} ms (median); the {len(mixed)} steps with a chunk of the long "
      f"prompt: {sum(mixed) / len(mixed) * 1e3:.0f} ms each, {sum(mixed) / len(mixed) / typical:.1f} x longer")
print(f"the decoding requests got {len(mixed)} tokens in {sum(mixed) * 1e3:.0f} ms instead of "
      f"{len(mixed) * typical * 1e3:.0f} ms")
fig, ax = plt.subplots(figsize=(9, 2.8))
ax.bar(range(len(steps)), [d * 1e3 for _, _, d in steps],
       color=["tab:orange" if p else "tab:blue" for p, _, _ in steps])
ax.set_xlabel("engine step")
ax.set_ylabel("step time (ms)")
ax.set_title("one instance: the decoding requests wait out every step that prefills a chunk of the long prompt")
ax.legend(handles=[Patch(color="tab:orange", label="step with prefill tokens"),
                   Patch(color="tab:blue", label="decode-only step")])
plt.tight_layout()
plt.show()

# %% [markdown]
# The first step prefills the two short prompts; the orange run later is the long prompt, chunk by chunk, and
# while it lasts both decoding requests get their tokens several times slower. A smaller cap makes each step
# shorter but adds steps; no cap makes one long step. Either way, decodes pay for prefills. On separate
# instances they do not: the producer's steps are all prefills, the consumer's nearly all decodes. The price
# is moving the prompt's KV from one to the other, which the rest of the lesson looks at.

# %% [markdown]
# ## 2. The connector API: two sides, called at four places
#
# minivllm follows vLLM v1's `KVConnectorBase_V1` (`vllm/distributed/kv_transfer/kv_connector/v1/base.py`;
# here `kv_transfer/base.py`). Every instance with a `kv_transfer_config` builds a connector twice, once for the
# scheduler and once for the worker, in the same class:
#
# | side | method | called | it |
# |---|---|---|---|
# | scheduler | `get_num_new_matched_tokens(req, n)` | `schedule`, admitting | tokens past `n` local hits it can load |
# | scheduler | `update_state_after_alloc(req, n_ext)` | then, blocks allocated | plans the load into those blocks |
# | scheduler | `build_connector_meta(sched)` | at the end of `schedule` | lists the step's loads and saves |
# | scheduler | `request_finished(req)` | as a request ends | may hold its blocks until sent |
# | worker | `start_load_kv(meta, kv_cache)` | `execute_model`, first | copies loaded blocks into the pool |
# | worker | `wait_for_layer_load(layer)` | (in vLLM: in each attention layer) | waits for one layer's blocks |
# | worker | `save_kv_layer(layer, k, v)` | after the forward, per layer | copies out the blocks to save |
# | worker | `wait_for_save()` | after the last layer | writes or sends them to the store |
#
# The scheduler side decides (it never touches a tensor), the worker side moves bytes, and the metadata
# is all that passes between them, exactly as a `SchedulerOutput` is all that passes from scheduler to worker.
# Here is where the scheduler asks, in the waiting-queue loop of `Scheduler.schedule`, and where the model
# runner moves the blocks:


# %%
def show(fn, word, around=2):
    """The lines of `fn`'s source that mention `word`, with `around` lines of context."""
    lines = inspect.getsource(fn).splitlines()
    keep = sorted({j for i, line in enumerate(lines) if word in line
                   for j in range(max(0, i - around), min(len(lines), i + around + 1))})
    last = None
    for j in keep:
        if last is not None and j != last + 1:
            print("    ...")
        print(lines[j])
        last = j


# %%
# NBVAL_IGNORE_OUTPUT
show(Scheduler.schedule, "connector", around=3)
print("\n# ... and at the end of every schedule(), in _update_after_schedule:")
show(Scheduler._update_after_schedule, "connector", around=0)

# %%
# NBVAL_IGNORE_OUTPUT
show(ModelRunner.execute_model, "kv_connector", around=1)

# %% [markdown]
# Three things to notice in the scheduler. The connector is asked *after* the local prefix cache
# (`num_cached` tokens in whole blocks): only what this instance lacks is loaded. The loaded tokens count as
# computed (`num_computed_tokens = num_cached + num_external`), so the chunk `n` the step runs is only what is
# left of the prompt, and the request's blocks for both are allocated in one call. And with no connector the
# line costs nothing: `self.connector` is `None`.
#
# > **How vLLM does it differently.** In vLLM the worker-side hooks run *inside* each attention layer
# > (`wait_for_layer_load` before it reads the cache, `save_kv_layer` after it writes), so a layer's transfer
# > overlaps the next layer's compute on the GPU's copy engines. `get_num_new_matched_tokens` also returns
# > whether the load is asynchronous; the request then waits in its own state while the blocks arrive and is
# > scheduled later. Production connectors (`NixlConnector` for GPU-to-GPU RDMA, `LMCacheConnectorV1`,
# > `P2pNcclConnector`) move blocks straight between GPU memories. minivllm calls the worker hooks before and
# > after the whole forward, and loads synchronously: on a CPU there is nothing to overlap with.
#
# How do producer and consumer agree on which block is which without talking? The same way the prefix cache
# does (lesson 01): each block of `[0, P-1)` is named by a **key**, a SHA-256 chain over a tag for the model
# and cache layout, the block's tokens and every block before it (`block_keys`). Equal keys mean equal
# prefixes of the same model, so equal KV:

# %%
prompt_ids = tokenizer.encode(long_prompt, add_special_tokens=False)[:41]
tag = producer.llm_engine.scheduler.connector.tag
for i, (key, n) in enumerate(block_keys(prompt_ids[:-1], BS, tag)):
    print(f"block {i}: tokens [{i * BS}, {i * BS + n}) -> key {key[:16]}...  ({n} tokens)")
print(f"token {len(prompt_ids) - 1} (P-1) is not in any block that moves")
print(f"tag: {tag.split('|', 1)[1]} (dtype, then layers x block_size x KV heads x head size) after a hash of "
      f"the checkpoint")

# %% [markdown]
# ## 3. Run it: a producer, a consumer and a directory between them
#
# Three prompts of different lengths. The producer runs them with `max_tokens=1`, which is what the proxy asks
# of it; as each prompt's blocks are computed, its connector saves them. To see what each side decided, we keep
# the `KVConnectorMetadata` its scheduler side builds every step: the producer's lists the blocks to save
# (`BlockSave`: block ids and keys), the consumer's the blocks to load (`BlockLoad`: block ids and the checked
# tensors).


# %%
def keep_metadata(connector):
    """Wrap the scheduler side's build_connector_meta to keep every step's metadata in a list."""
    metas, build = [], connector.build_connector_meta

    def recorded(sched):
        meta = build(sched)
        metas.append(meta)
        return meta

    connector.build_connector_meta = recorded
    return metas


prompts = ["Paged attention stores the keys and values of each token in fixed-size blocks, and a block table "
           "maps a request's positions to them. When a request finishes, its blocks",
           "The quick brown fox jumps over the lazy dog. " * 3 + "Then the fox",
           "Disaggregated serving splits a request in two:"]
ids = [tokenizer.encode(p, add_special_tokens=False) for p in prompts]
saver, loader = producer.llm_engine.scheduler.connector, consumer.llm_engine.scheduler.connector
saved, loaded_meta = keep_metadata(saver), keep_metadata(loader)
producer.generate(prompts, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
files = sorted(SHARED.rglob("*.kv"))
for p in ids:
    print(f"prompt of {len(p)} tokens: [0, {len(p) - 1}) moves, blocks: {-(-(len(p) - 1) // BS)}")
print(f"the producer saved {saver.num_saved_blocks} blocks; the directory holds {len(files)} block files")

# %% [markdown]
# The consumer gets the same prompts and generates. Its connector finds every block in the store, so the
# only prompt token each request computes is its last one. The reference is the plain engine (no connector)
# computing everything itself: the greedy tokens must be the same.

# %%
consumer_engine = consumer.llm_engine
order = [2, 0, 1]                          # the consumer gets them in another order: block ids are local
with consumer_engine.record_traces() as consumer_traces:
    got = consumer.generate([prompts[i] for i in order], GREEDY, use_tqdm=False)
got = {i: list(o.outputs[0].token_ids) for i, o in zip(order, got)}
consumer_computed, consumer_loaded = consumer_engine.num_prompt_tokens_computed, loader.num_loaded_tokens
plain.llm_engine.reset_prefix_cache()
want = [list(o.outputs[0].token_ids) for o in plain.generate(prompts, GREEDY, use_tqdm=False)]
print(f"consumer: {consumer_computed} prompt tokens computed for {len(ids)} requests, {consumer_loaded} loaded "
      f"(the sum of P-1: {sum(len(p) - 1 for p in ids)})")
for i in range(len(ids)):
    print(f"prompt {i}: the same greedy tokens as the plain engine: {got[i] == want[i]}; "
          f"{tokenizer.decode(got[i])!r}")

# %% [markdown]
# Now the picture of the first prompt: the blocks of the producer's pool it was saved from, the keys it was
# saved under, and the blocks of the consumer's pool it was loaded into. The block ids differ (each pool hands
# out its own); the keys are what connect them. The last block is partial: it holds the tokens up to `P-2`,
# and each side writes token `P-1`'s KV into its next slot itself.

# %%
first = ids[0]
keys = block_keys(first[:-1], BS, tag)
save = next(s for m in saved for s in m.saves if s.keys[0] == keys[0][0])
load = next(ld for m in loaded_meta for ld in m.loads if len(ld.blocks) == len(keys))
consumer_rid = next(r.request_id for t in consumer_traces for r in t.requests if r.num_prompt_tokens == len(first))
assert load.request_id == consumer_rid
producer_table, consumer_table = save.block_ids, load.block_ids
print(f"prompt 0: {len(first)} tokens; saved from producer blocks {producer_table}, "
      f"loaded into consumer blocks {consumer_table}")
print(f"keys: {[k[:8] for k in save.keys]}, tokens per key {save.num_tokens}; "
      f"the same keys as block_keys: {save.keys == [k for k, _ in keys]}")

# %%
# NBVAL_IGNORE_OUTPUT
color = RequestColors(["prompt 0"])("prompt 0")
fig, (ax_p, ax_s, ax_c) = plt.subplots(1, 3, figsize=(12, 3.6), gridspec_kw={"width_ratios": [4, 2.4, 4]})
TOP = 5.6                                            # room above the pools for the arrows


def pool(ax, table, title):
    """An 8-column pool of 32 blocks, the request's blocks coloured with the tokens each carries; returns the
    top middle of every block (where the arrows start and end)."""
    tops = {}
    for b in range(32):
        x, y = b % 8, 3 - b // 8
        held = b in table
        ax.add_patch(Rectangle((x, y), 0.92, 0.92, facecolor=color if held else CLEAN_FREE, lw=0))
        ax.text(x + 0.06, y + 0.86, str(b), ha="left", va="top", fontsize=7, color=contrast(color) if held else "#222")
        tops[b] = (x + 0.46, y + 0.92)
    for i, b in enumerate(table):
        ax.text(tops[b][0], tops[b][1] - 0.62, f"{keys[i][1]}/{BS}", ha="center", fontsize=7, color=contrast(color))
    ax.set_xlim(0, 8)
    ax.set_ylim(0, TOP)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.text(4, -0.35, title, ha="center", va="top", fontsize=10)
    return tops


p_tops = pool(ax_p, producer_table, "producer's pool: the blocks prompt 0 was saved from")
c_tops = pool(ax_c, consumer_table, "consumer's pool: the blocks it was loaded into")
ax_s.set_xlim(0, 2.4)
ax_s.set_ylim(0, TOP)
ax_s.axis("off")
ax_s.text(1.2, 4.3, "the store: one file per key", ha="center", va="bottom", fontsize=10)
ends = []
for i, (key, n) in enumerate(keys):
    y = 3.3 - i * 1.3
    ax_s.add_patch(Rectangle((0.2, y), 2.0, 0.8, facecolor="white", edgecolor=color, lw=2))
    ax_s.text(1.2, y + 0.4, f"{key[:10]}….kv\n{n} tokens", ha="center", va="center", fontsize=7, family="monospace")
    ends.append(((0.2, y + 0.4), (2.2, y + 0.4)))
for i in range(len(keys)):
    for src_ax, src, dst_ax, dst in [(ax_p, p_tops[producer_table[i]], ax_s, ends[i][0]),
                                     (ax_s, ends[i][1], ax_c, c_tops[consumer_table[i]])]:
        fig.add_artist(ConnectionPatch(src, dst, "data", "data", axesA=src_ax, axesB=dst_ax, arrowstyle="-|>",
                                       connectionstyle="arc3,rad=-0.25", color="#444", lw=1))
fig.suptitle(f"prompt 0 ({len(first)} tokens): the KV of [0, P-1) in blocks; each block shows the tokens it "
             f"carries, of {BS}", fontsize=10)
plt.show()

# %% [markdown]
# ## 4. The cost: moving the KV against computing it
#
# A block carries the K and V of every layer for its tokens. For this model in fp32 that is a lot of bytes per
# token, the same for every token whatever the prompt:

# %%
shape = loader.block_shape                      # (2, layers, block_size, KV heads, head size)
bytes_per_token = 2 * shape[1] * shape[3] * shape[4] * loader.dtype.itemsize
block_bytes = torch.Size(shape).numel() * loader.dtype.itemsize
print(f"one block: K and V x {shape[1]} layers x {shape[2]} tokens x {shape[3]} KV heads x {shape[4]} = "
      f"{block_bytes / 2**10:.0f} KiB, {bytes_per_token / 2**10:.0f} KiB per token ({loader.dtype})")
print(f"a block file: {files[0].stat().st_size / 2**10:.1f} KiB (a digest and a small JSON header added)")

# %% [markdown]
# We time the transfer's two halves for the blocks of the three prompts: the producer's save
# (`encode_block` and a file written and renamed) and the consumer's load (read, digest checked,
# `decode_block`, copied into the pool), and set them beside the prefill the consumer did not have to run
# (the plain engine's prefill of the same prompts, fastest of three).

# %%
kv_cache = consumer_engine.model_runner.kv_cache
all_keys = [k for p in ids for k in block_keys(p[:-1], BS, tag)]
blocks = {key: decode_block(loader.store.get(key), key, shape, loader.dtype) for key, _ in all_keys}
scratch = Path(tempfile.mkdtemp(prefix="minivllm-lesson12-timing-"))
atexit.register(shutil.rmtree, scratch, ignore_errors=True)
from minivllm.kv_transfer.shared_storage_connector import FileBlockStore  # noqa: E402

timing_store = FileBlockStore(scratch)


def save_all():
    for key, n in all_keys:
        timing_store.put(key, encode_block(key, n, blocks[key]))


landing = torch.empty_like(kv_cache[:, :, :len(all_keys)])   # blocks shaped as the pool's, outside it


def load_all():
    for i, (key, _) in enumerate(all_keys):
        block = decode_block(timing_store.get(key), key, shape, loader.dtype)
        landing.view(torch.uint8)[:, :, i] = block.view(torch.uint8)


def prefill_all():
    plain.llm_engine.reset_prefix_cache()
    plain.generate(prompts, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)


def fastest(fn, repeat=3):
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


t_save, t_load, t_prefill = fastest(save_all), fastest(load_all), fastest(prefill_all)
moved = sum(n for _, n in all_keys)

# %%
# NBVAL_IGNORE_OUTPUT
print(f"{len(all_keys)} blocks, {moved} tokens, {moved * bytes_per_token / 2**20:.1f} MiB")
print(f"save {t_save * 1e3:.1f} ms + load {t_load * 1e3:.1f} ms = {(t_save + t_load) * 1e3:.1f} ms; "
      f"the prefill they replace: {t_prefill * 1e3:.0f} ms ({t_prefill / (t_save + t_load):.0f} x more)")
per_token = t_prefill / moved
print(f"prefill here: {per_token * 1e3:.2f} ms per token; moving the KV costs less while the link carries more "
      f"than {bytes_per_token / per_token / 1e6:.0f} MB/s")

# %% [markdown]
# The last line is the one that carries over to other machines: the transfer wins while
# `bytes per token / link bandwidth` is below `prefill time per token`. Both grow with the prompt (the prefill a
# little faster, since attention over a longer prompt costs more per token), so the ratio is mostly a property
# of the model, the hardware and the link. On a GPU the prefill per token is hundreds of times shorter than on
# this CPU, which is why disaggregated deployments move KV over RDMA or NVLink, not files, and keep it in bf16
# or fp8 (half or a quarter of these bytes). A shared directory is the simplest store that shows the API; the
# TCP connector (`kv_transfer/tcp_connector.py`) pushes the same frames over a socket.

# %% [markdown]
# ## 5. When a block is broken: load what checks out, compute the rest
#
# Every frame carries a SHA-256 digest of its contents, and the scheduler side reads and checks each block
# before it promises it. We flip one byte in block 1 of the first prompt. The keys are a chain, so a broken
# block also cuts off every block after it: the consumer loads block 0, computes the rest of the prompt, and
# its output must not change.

# %%
bad_key = keys[1][0]
bad_file = next(SHARED.rglob(f"{bad_key}.kv"))
data = bytearray(bad_file.read_bytes())
data[-5] ^= 0xFF                                    # one byte of the block's V, last layer
bad_file.write_bytes(bytes(data))


class Collect(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(re.sub(r"[0-9a-f]{12}…", "<key>…", record.getMessage()))


warned = Collect()
log = logging.getLogger("minivllm.kv_transfer.base")
log.addHandler(warned)
log.propagate = False                               # the warning goes to our list, not to stderr
consumer_engine.reset_prefix_cache()
again = list(consumer.generate([prompts[0]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids)
log.removeHandler(warned)
log.propagate = True
bad_computed = consumer_engine.num_prompt_tokens_computed - consumer_computed
bad_loaded = loader.num_loaded_tokens - consumer_loaded
print("the connector warned:", warned.messages)
print(f"prompt 0 ({len(first)} tokens): {bad_loaded} tokens loaded (block 0), {bad_computed} computed; "
      f"the same greedy tokens: {again == want[0]}")

# %% [markdown]
# Nothing else had to be told: a block that is missing (the producer was down, the file was cleaned away), half
# written, corrupt, or made by another model or cache layout (its key differs) is simply not a hit, and the
# consumer falls back to what any engine does with a prompt it has never seen. A disaggregated deployment can
# lose its producer and still answer, only more slowly; the proxy does exactly that when the prefill instance
# fails.

# %% [markdown]
# ### Exercise: how many prompt tokens can the consumer load?
#
# Write the heart of the scheduler side's `get_num_new_matched_tokens`, as plain values:
# `get_num_new_matched_tokens(prompt_token_ids, num_computed_tokens, block_size, tag, has_block)`.
#
# - The blocks that move are those of the prompt's tokens `[0, P-1)`, named by
#   `block_keys(tokens, block_size, tag)` (imported above): a list of `(key, number of tokens)`, the last block
#   possibly partial.
# - `num_computed_tokens` tokens (whole blocks) are already computed here, from the local prefix cache: skip
#   their blocks.
# - From the first block not computed here, count the tokens of the blocks for which `has_block(key)` is true,
#   and stop at the first one for which it is false. Return that number of tokens (an `int`).
#
# The check runs hand-made prompts and stores with known answers, then 200 random ones against minivllm's
# connector, and finally asks your function inside a real `kv_both` engine (it saves its prompts' blocks and
# loads them back): with a cold and a warm local prefix cache, and with a corrupt block in the store, the
# greedy output, the prompt tokens computed and the tokens loaded must be the real connector's.

# %%
from course import check, exercise


@exercise("14.get_num_new_matched_tokens")
def get_num_new_matched_tokens(prompt_token_ids, num_computed_tokens, block_size, tag, has_block):
    # your code here
    raise NotImplementedError


check(get_num_new_matched_tokens)

# %% [markdown]
# The real method does the same walk and, for every block it counts, reads the frame and checks it
# (`decode_block`): the blocks it promises are already in memory, staged for `update_state_after_alloc`, so a
# file that disappears between the count and the load cannot leave a hole in the KV.

# %%
# NBVAL_IGNORE_OUTPUT
print(inspect.getsource(KVConnectorBase_V1.get_num_new_matched_tokens))

# %% [markdown]
# > **How vLLM does it differently.** vLLM's `SharedStorageConnector`
# > (`vllm/distributed/kv_transfer/kv_connector/v1/shared_storage_connector.py`) is an example connector that
# > writes each layer of a request's KV as a safetensors file in a folder named by a hash of the prompt's
# > tokens, so it matches whole prompts only. Keying every block by a chain, as the prefix cache does, lets a
# > consumer take the blocks of a shared prefix (a system prompt) that another request left, and stop cleanly
# > at the first missing one.
#
# ## 6. The other way past one engine: data parallelism, routed by load
#
# Disaggregation splits each request over two instances. Data parallelism splits the *requests* over whole-model
# replicas: `python app.py --data-parallel-size 2` starts two engines in their own processes and puts a router in
# front (`minivllm/entrypoints/dp_router.py`; vLLM's front end balances its engine cores the same way). The
# router's decision is one small function, `Router.pick`: the replica with the fewest requests in flight (counted
# by the router from routing to the last byte of the answer), then the emptiest KV cache, then the one routed to
# least. With prefix-aware routing, a prompt whose first blocks the router has sent somewhere before goes there
# again, where the prefix cache holds them, unless that replica is much busier. Here it is on two replicas that
# exist only as records (no processes: `pick` reads nothing else):

# %%
from minivllm.entrypoints.dp_replicas import Replica  # noqa: E402
from minivllm.entrypoints.dp_router import Router  # noqa: E402

replicas = [Replica(0, "http://replica-0"), Replica(1, "http://replica-1")]
router = Router(replicas, "prefix", plain.get_tokenizer())
system = "You are a careful assistant. Answer in one short sentence, and say when you are not sure. " * 3
route = []
for i, user in enumerate(["What is a KV cache?", "What is a block table?", "Hello!", "What is paging?"]):
    prompt = system + user if i != 2 else user
    r = router.pick({"prompt": prompt}, "/v1/completions")
    r.in_flight += 1                                   # it is running there now
    route.append(r.index)
    print(f"request {i} ({'shared system prompt' if i != 2 else 'no shared prefix'}): replica {r.index}, "
          f"in flight now {[x.in_flight for x in replicas]}")

# %% [markdown]
# Requests 0, 1 and 3 share a system prompt, so they all go to the replica that computed it first, even while it
# is the busier one: its prefix cache saves their prefill. Request 2 shares nothing and goes by load alone. With
# `--dp-routing load` (the default) all four would alternate. The tests run two real replicas behind the router
# (`tests/test_data_parallel.py`): six requests at once go three and three, each answer equals Hugging Face's, and
# a replica killed mid-run is routed around.
#
# ## Check yourself
#
# Run this cell. It replays the lesson's claims: the long prompt shared a step with the decodes; the producer
# saved one block per `[0, P-1)` block; the consumer computed one prompt token per request and loaded the rest,
# with the plain engine's greedy output; its block table is as long as the producer's but made of its own block
# ids; a corrupt block left only the blocks before it to load, the output unchanged; and your function counts
# the blocks that would load.

# %%
assert any(p > 0 and n > 0 for p, n, _ in steps), "the long prompt ran beside the decodes"
assert saver.num_saved_blocks == sum(-(-(len(p) - 1) // BS) for p in ids) == len(files)
assert consumer_computed == len(ids), "one prompt token per request: the last"
assert consumer_loaded == sum(len(p) - 1 for p in ids), "every token but the last, loaded"
assert all(got[i] == want[i] for i in range(len(ids))), "the consumer's greedy output is the plain engine's"
assert len(producer_table) == len(consumer_table) == -(-len(first) // BS)
assert bad_loaded == BS and bad_computed == len(first) - BS and again == want[0], "corrupt block 1: block 0 loads"
assert len(warned.messages) == 1 and "does not check out" in warned.messages[0]
stored = {k for k, _ in all_keys} - {bad_key}
assert get_num_new_matched_tokens(first, 0, BS, tag, stored.__contains__) == BS
assert get_num_new_matched_tokens(first, BS, BS, tag, stored.__contains__) == 0
assert get_num_new_matched_tokens(ids[2], 0, BS, tag, stored.__contains__) == len(ids[2]) - 1
assert route == [route[0], route[0], 1 - route[0], route[0]], "a shared prefix follows its replica; the rest by load"
print("all checks passed")

# %% [markdown]
# ## Where next
#
# Run the two instances and the proxy as separate servers, with the TCP connector: the commands are at the top
# of `minivllm/entrypoints/disagg_proxy.py` (two `python app.py --kv-transfer-config '{...}'`, one producer and
# one consumer, then `python -m minivllm.entrypoints.disagg_proxy --prefill URL --decode URL`),
# then point any OpenAI client at the proxy. `"kv_role": "kv_both"` makes one instance do both: other
# instances' saved blocks then act as a prefix cache shared between instances.
