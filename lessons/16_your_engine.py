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
# # Lesson 16: your engine
#
# Every lesson asked you to write the heart of one part of minivllm: the block-hash walk of the prefix cache,
# one scheduling step, a preemption, the slot of each new token, paged attention, top-p, n-gram drafts, and the
# rest. Each check ran your function on its own, and some ran it inside an engine for a moment. This lesson
# puts **all of them in one engine at once** and lets it serve the default model (SmolLM2-135M), then compares
# what it generates with minivllm's own engine, token for token.
#
# The switch is one context manager, `your_engine` (lessons/your_engine.py):
#
# ```python
# with your_engine(llm, longest_cached_prefix, slot_mapping, paged_attention_one, ...) as yours:
#     mine = llm.generate(prompts, params)      # the same engine, on your functions
# yours.compare(mine, reference)                # token for token, or an error that says where
# ```
#
# Inside the `with`, each function you pass takes its place at a **seam**: the method of the engine that asks
# the question your exercise answered. Leaving the `with` puts minivllm's own methods back. Two kinds of seams:
#
# - **Your function drives the engine**: its answer is the one the engine goes on with. Your hits are the blocks
#   a prompt starts with; K and V are written to your slots; each layer goes on with your attention; the sampler
#   draws from your top-p set; the target model verifies your drafts. If your answer is wrong, the tokens change.
# - **Your function is checked beside the engine**: its exercise took simpler inputs than the real method (the
#   scheduling step assumed the KV pool is never short, for one), so it cannot replace it. It runs on the same
#   inputs at every call, and the first disagreement stops the run and names the step.
#
# | exercise | seam in minivllm | your function |
# |---|---|---|
# | 00 `blocks_held` | each decoding request's block table after a step | checked beside |
# | 01 `longest_cached_prefix` | `KVCacheManager.get_computed_blocks` | drives |
# | 02 `take_blocks` | `KVCacheManager.allocate_slots`: its fresh blocks, and their rollback | checked beside |
# | 03 `schedule_step` | `Scheduler.schedule`: tokens per request, in the steps the exercise covers | checked beside |
# | 04 `preempt` | `Scheduler._choose_victim`, then `Scheduler._preempt` | drives the victim; the queues after: beside |
# | 05 `slot_mapping` | `ModelRunner.prepare_inputs`: the slot of each new token | drives |
# | 06 `paged_attention_one` | the attention backend's last query row of each sequence, every layer | drives |
# | 07 `tp_linear` | layer 0's QKV and output projections, as 3 simulated ranks, every step | checked beside |
# | 08 `stage_layers` | `pp_layer_partition` for this model, 1 to 4 pipeline stages | checked beside |
# | 09 `stream_deltas` | each finished streamed (DELTA) request with stop strings | checked beside |
# | 10 `decode_memory_floor_ms` | `bench/roofline.py`, for this engine's model | checked beside |
# | 11 `pad_decode_batch` | `DecodeGraphs._fill`: decode batches run padded to a graph's size | drives |
# | 11 `plan_ahead` | `async_scheduler.plan_ahead` (async scheduling) | drives |
# | 11 `quantize_activations` | the activations entering layer 0's QKV projection | checked beside |
# | 12 `top_p_filter` | `sampler.apply_top_k_top_p`: the top-p part | drives |
# | 13 `ngram_propose` | `NgramProposer.propose` (speculative decoding) | drives |
# | 14 `get_num_new_matched_tokens` | the KV connector's answer (disaggregation) | checked beside |
# | 15 `fit` | `EncoderCacheManager.fit` (images) | drives |
#
# A driving seam asks minivllm the same question too, and keeps the first disagreement, so that a wrong token
# comes with its cause. `pad_decode_batch` has no CUDA graph to fill on a CPU: the switch gives the engine the
# same static buffers without the capture, so every decode step runs through your padding.

# %%
import warnings

import torch
from IPython.display import HTML, display

from course import exercise
from minivllm import LLM, SamplingParams
from minivllm.core.sampling_params import RequestOutputKind
from minivllm.entrypoints.block_grid import GRID_CSS, RequestPalette, render_block_grid
from minivllm.entrypoints.dashboard import DASHBOARD_CSS, render_queues
from your_engine import NAMES, ROLES, YourEngineError, your_engine, written

warnings.filterwarnings("ignore", message="IProgress not found")   # tqdm's notice when ipywidgets is absent
torch.manual_seed(0)
torch.set_num_threads(1)   # one thread: faster on a busy 2-core CPU, and the same float sums everywhere

# %% [markdown]
# ## 1. Bring your functions
#
# Paste the body of each function you wrote into its cell below (copy it from the lesson's notebook: the
# signature is the same). A function still ending in `raise NotImplementedError` is left out, and minivllm's
# own method answers at its seam; `written(...)` sorts them. (When the course's CI runs this notebook,
# `MINIVLLM_LESSON_SOLUTIONS=1` makes each `@exercise` hand in the course's solution instead.)

# %%
from minivllm.core.block_pool import ROOT_HASH, hash_block_tokens   # noqa: F401  (lesson 01 uses them)


@exercise("00.blocks_held")
def blocks_held(num_prompt_tokens, num_output_tokens, block_size):
    raise NotImplementedError


@exercise("01.longest_cached_prefix")
def longest_cached_prefix(token_ids, block_size, lookup):
    raise NotImplementedError


@exercise("02.take_blocks")
def take_blocks(free, table, n, journal):
    raise NotImplementedError


@exercise("03.schedule_step")
def schedule_step(running, waiting, max_num_batched_tokens, max_num_seqs):
    raise NotImplementedError


@exercise("04.preempt")
def preempt(running, waiting):
    raise NotImplementedError


# %%
@exercise("05.slot_mapping")
def slot_mapping(block_table, start, end, block_size):
    raise NotImplementedError


@exercise("06.paged_attention_one")
def paged_attention_one(q, key_cache, value_cache, block_table, seq_len, scale):
    raise NotImplementedError


@exercise("07.tp_linear")
def tp_linear(x, weight, tp_size, kind):
    raise NotImplementedError


@exercise("08.stage_layers")
def stage_layers(num_layers, pp_size):
    raise NotImplementedError


@exercise("10.decode_memory_floor_ms")
def decode_memory_floor_ms(cfg, itemsize, batch, context, bandwidth):
    raise NotImplementedError


@exercise("11.pad_decode_batch")
def pad_decode_batch(input_ids, positions, slot_mapping, seq_lens, block_tables, sizes):
    raise NotImplementedError


@exercise("11.plan_ahead")
def plan_ahead(num_tokens, num_computed_tokens, num_in_flight):
    raise NotImplementedError


@exercise("11.quantize_activations")
def quantize_activations(x):
    raise NotImplementedError


# %%
from minivllm.kv_transfer import block_keys   # noqa: F401  (lesson 14 uses it)


@exercise("09.stream_deltas")
def stream_deltas(pieces, stop):
    raise NotImplementedError


@exercise("12.top_p_filter")
def top_p_filter(logits, top_p):
    raise NotImplementedError


@exercise("13.ngram_propose")
def ngram_propose(token_ids, k, min_n, max_n):
    raise NotImplementedError


@exercise("14.get_num_new_matched_tokens")
def get_num_new_matched_tokens(prompt_token_ids, num_computed_tokens, block_size, tag, has_block):
    raise NotImplementedError


@exercise("15.fit")
def fit(ecm, req, start, num_tokens, out):
    raise NotImplementedError


# %%
ALL = [blocks_held, longest_cached_prefix, take_blocks, schedule_step, preempt, slot_mapping, paged_attention_one,
       tp_linear, stage_layers, stream_deltas, decode_memory_floor_ms, pad_decode_batch, plan_ahead,
       quantize_activations, top_p_filter, ngram_propose, get_num_new_matched_tokens, fit]
YOURS = written(ALL)
mine_names = [fn.__name__ for fn in YOURS]
print(f"{len(YOURS)} of {len(ALL)} functions written; they go into the engine:")
for name in NAMES:
    print(f"  {name:28} {'yours, ' + ROLES.get(name, 'drives') if name in mine_names else 'minivllm own'}")

# %% [markdown]
# ## 2. The held prompts, on minivllm's own engine
#
# One engine, small on purpose so that every part has work to do: blocks of 8 tokens and a pool of only 16 of
# them (128 tokens of KV), at most 4 requests and 32 tokens a step (longer prompts are chunked). Five chat
# prompts share a system message: their first 20 tokens are the same, two full blocks for the prefix cache. Each
# may generate up to 28 tokens; four running requests need more blocks than the pool has, so requests are
# **preempted** and recomputed later. Greedy decoding, so the tokens are a function of the prompts alone. This
# first run uses minivllm's own functions: it is the reference.

# %%
llm = LLM(device="cpu", dtype="float32", num_kv_blocks=16, block_size=8, max_num_seqs=4, max_num_batched_tokens=32,
          seed=0)
engine = llm.llm_engine
tokenizer = llm.get_tokenizer()
QUESTIONS = ["What is the capital of France?", "Why is the sky blue?", "How do bees make honey?",
             "What is a prime number?", "Who wrote Hamlet?"]
PROMPTS = [tokenizer.apply_chat_template([{"role": "system", "content": "You are a helpful assistant. Answer in one "
                                           "short sentence."}, {"role": "user", "content": q}],
                                         tokenize=False, add_generation_prompt=True) for q in QUESTIONS]
GREEDY = SamplingParams(temperature=0, max_tokens=28)


def run(prompts, params):
    """Generate from a clean prefix cache, with the steps' traces; (outputs, traces)."""
    engine.reset_prefix_cache()
    with engine.record_traces() as traces:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    return outputs, traces


def summary(traces):
    preempted = [(t.step - traces[0].step + 1, t.preempted) for t in traces if t.preempted]
    hits = sum(len(t.prefix_hit_blocks) for t in traces)
    return f"{len(traces)} steps, {hits} prefix-cache block hits, preemptions (step, request): {preempted}"


reference, ref_traces = run(PROMPTS, GREEDY)
print("reference:", summary(ref_traces))
for q, out in zip(QUESTIONS, reference):
    print(f"  {q!r:34} -> {out.outputs[0].text!r}")

# %% [markdown]
# ## 3. The same engine, on your functions
#
# The same `llm`, the same prompts, inside the switch. A trace listener also keeps, after every step, a copy of
# the block pool and the queues, for the picture in section 4. `yours.compare` raises `YourEngineError` unless
# every request's tokens equal the reference's and no driving function disagreed with minivllm's;
# `yours.report()` counts the calls your functions answered.

# %%
views = []                                   # (trace, pool snapshot, queues) after each step of your run


def keep_view(trace):
    views.append((trace, engine.kv_cache_manager.block_pool.snapshot(), engine.get_queues()))


totals = {}                                  # your function -> calls, over every run of this lesson


def tally(yours):
    for name in yours.functions:
        totals[name] = totals.get(name, 0) + yours.calls[name]


engine.add_trace_listener(keep_view)
try:
    with your_engine(llm, *YOURS) as yours:
        mine, my_traces = run(PROMPTS, GREEDY)
finally:
    engine.remove_trace_listener(keep_view)
yours.compare(mine, reference, "the held greedy prompts")
tally(yours)
print("your engine:", summary(my_traces))
print(f"the same {sum(len(o.outputs[0].token_ids) for o in mine)} tokens as the reference, token for token\n")
print(yours.report())

# %% [markdown]
# The report counts what the engine asked: `longest_cached_prefix` each time a waiting request came up for
# admission (again after a step whose pool had no room for it), `take_blocks` at each allocation of clean
# blocks, `schedule_step` at each step it can judge, `preempt` at each preemption, `slot_mapping` once per
# request per step, `paged_attention_one` for every sequence in every one of the 30 layers at every step, and
# `pad_decode_batch` for each decode-only step, which then runs on the padded static batch; `tp_linear` (twice)
# and `quantize_activations` at each step, on layer 0's activations. The others have nothing to do here yet:
# greedy decoding never filters by top-p and `generate` does not stream (section 5), and this engine has no
# speculation, no KV connector, no async scheduling and no images (sections 6 to 8).

# %% [markdown]
# ## 4. Watching your engine: the live view
#
# The dashboard of `python app.py` (lesson 09) draws the block pool and the queues twice a second while the
# server runs. The same render functions draw them here, from the copies taken after the step in which your
# `preempt` chose its victim: one cell per KV block, in the colour of the request holding it, the system
# message's shared blocks hatched with their ref counts; below, the running and waiting queues, the victim back in
# the waiting queue.

# %%
step = next(i for i, (t, _, _) in enumerate(views) if t.preempted)
trace, pool, queues = views[step]
print(f"step {trace.step - my_traces[0].step + 1} of your run (engine step {trace.step}): request "
      f"{trace.preempted[0]} preempted; {trace.num_running} running, {trace.num_waiting} waiting, "
      f"{trace.num_free_blocks} of {trace.num_kv_blocks} blocks free")

# %%
# NBVAL_IGNORE_OUTPUT
# (a picture: its markup and style are the dashboard's, and change with it)
display(HTML(f"<style>{DASHBOARD_CSS}{GRID_CSS}</style>"
             + render_block_grid(trace, trace.num_kv_blocks, pool, palette=RequestPalette())
             + render_queues(queues)))

# %% [markdown]
# To watch it live, start the server with the dashboard (`python app.py`, then open the page it prints) and send
# a few chats at once: the grid fills and empties as requests come and go. The server runs minivllm's own
# functions: the switch plugs yours into an `LLM` you step yourself, as in this notebook, not into a server's
# engine, which steps on a thread of its own.

# %% [markdown]
# ## 5. Sampling by seed, and streams with stop strings
#
# Random sampling can be compared token for token too: each request has its own seed, so its draws do not depend
# on the rest of the batch. Three prompts at temperature 1 with top-p 0.5, 0.9 and 0.97: the sampler draws from
# the set your `top_p_filter` kept.
#
# Then streaming: requests added with `RequestOutputKind.DELTA` send only their new text at each step, and hold
# back what could still become a stop string (lesson 09). The engine's own output processor streams them; your
# `stream_deltas` is checked beside it on the detokenizer's pieces of each finished stream.

# %%
STORIES = ["Once upon a time", "The three best things about the sea are", "A recipe for pancakes:"]
SAMPLED = [SamplingParams(temperature=1.0, top_p=p, max_tokens=16, seed=7 + i, ignore_eos=True)
           for i, p in enumerate([0.5, 0.9, 0.97])]
ref_sampled, _ = run(STORIES, SAMPLED)
with your_engine(llm, *YOURS) as yours:
    mine_sampled, _ = run(STORIES, SAMPLED)
yours.compare(mine_sampled, ref_sampled, "the sampled prompts")
tally(yours)
for p, out in zip(SAMPLED, mine_sampled):
    print(f"top_p {p.top_p}: {out.outputs[0].text!r}")
print(f"the same sampled tokens; your top_p_filter filtered {yours.calls['top_p_filter']} times")

STREAMS = {"paris": ("The capital of France is", ["answer"]), "story": ("Once upon a time", ["zebra", "city"])}


def stream(requests):
    """{name: (token ids, the texts streamed)} for `requests` ({name: (prompt, stop strings)}), step by step."""
    got = {name: ([], []) for name in requests}
    for name, (prompt, stop) in requests.items():
        engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=20, stop=stop,
                                                  output_kind=RequestOutputKind.DELTA), request_id=name)
    while engine.has_unfinished_requests():
        for out in engine.step():
            got[out.request_id][0].extend(out.outputs[0].token_ids)
            got[out.request_id][1].append(out.outputs[0].text)
    return got


ref_streams = stream(STREAMS)
with your_engine(llm, *YOURS) as yours:
    my_streams = stream(STREAMS)
tally(yours)
assert my_streams == ref_streams, "the streams differ"
for name, (_, texts) in my_streams.items():
    print(f"{name}, stop={STREAMS[name][1]}: {texts}")
print(f"the same streams; your stream_deltas was checked on {yours.calls['stream_deltas']} of them")

# %% [markdown]
# ## 6. Speculative decoding, and KV blocks from another instance
#
# A second engine, with n-gram speculation (lesson 13: up to 4 drafts a step) and a KV connector in the
# `kv_both` role (lesson 14): it saves every prompt's blocks to a shared folder and, for a new prompt, loads the
# blocks it finds there instead of computing them. The reference run fills the folder; your run, from a clean
# local prefix cache, loads those blocks: your `get_num_new_matched_tokens` is asked how many tokens, and your
# `ngram_propose` makes the drafts the model verifies.

# %%
import atexit
import shutil
import tempfile

store = tempfile.mkdtemp(prefix="minivllm-lesson16-")
atexit.register(shutil.rmtree, store, ignore_errors=True)     # removed when the kernel stops
spec_llm = LLM(device="cpu", dtype="float32", num_kv_blocks=32, block_size=8, max_num_seqs=4, seed=0,
               speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
                                   "prompt_lookup_max": 4},
               kv_transfer_config={"kv_connector": "SharedStorageConnector", "kv_role": "kv_both",
                                   "kv_connector_extra_config": {"shared_storage_path": store}})
spec_engine = spec_llm.llm_engine
PASSAGE = "The quick brown fox jumps over the lazy dog, and the lazy dog sleeps in the warm sun all afternoon."
CHATS = [tokenizer.apply_chat_template([{"role": "user", "content": ask}], tokenize=False, add_generation_prompt=True)
         for ask in ("Copy this text word for word: " + PASSAGE, "Count from one to twenty in words.")]
CHAT_PARAMS = SamplingParams(temperature=0, max_tokens=40)


def spec_run():
    """(outputs, drafts verified, drafts accepted, prompt tokens loaded from the folder) of one run."""
    spec_engine.reset_prefix_cache()
    before, loaded = spec_engine.get_stats(), spec_engine.scheduler.connector.num_loaded_tokens
    outputs = spec_llm.generate(CHATS, CHAT_PARAMS, use_tqdm=False)
    after = spec_engine.get_stats()
    return (outputs, after.num_spec_draft_tokens - before.num_spec_draft_tokens,
            after.num_spec_accepted_tokens - before.num_spec_accepted_tokens,
            spec_engine.scheduler.connector.num_loaded_tokens - loaded)


ref_spec, *ref_counts = spec_run()
with your_engine(spec_llm, *YOURS) as yours:
    my_spec, *my_counts = spec_run()
yours.compare(my_spec, ref_spec, "the speculative chats")
tally(yours)
print(f"reference: {ref_counts[0]} drafts verified, {ref_counts[1]} accepted, {ref_counts[2]} prompt tokens loaded")
print(f"yours:     {my_counts[0]} drafts verified, {my_counts[1]} accepted, {my_counts[2]} prompt tokens loaded")
for out in my_spec:
    print(f"  {out.outputs[0].text!r}")
spec_engine.shutdown()

# %% [markdown]
# The reference run found the folder empty and computed every prompt token; yours loaded the prompts' blocks from
# it (the tokens your `get_num_new_matched_tokens` counted, each checked against the connector's own answer), and
# its drafts came from your `ngram_propose`. The same greedy text either way: loading a block or computing it
# gives the same K and V, and a verified draft is a token the model would have chosen.
#
# ## 7. Async scheduling
#
# A third engine schedules each step while the one before is still running (lesson 11): a request whose last
# batch is still in flight gets its next batch planned from where that batch will leave it, by your `plan_ahead`.
# On a CPU there is no device to overlap with, but the plan is the same one a GPU would use.

# %%
async_llm = LLM(device="cpu", dtype="float32", num_kv_blocks=32, block_size=8, max_num_seqs=4,
                max_num_batched_tokens=16, seed=0, async_scheduling=True)
ASYNC_PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):"]
ASYNC_PARAMS = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
ref_async = async_llm.generate(ASYNC_PROMPTS, ASYNC_PARAMS, use_tqdm=False)
async_llm.llm_engine.reset_prefix_cache()
with your_engine(async_llm, *YOURS) as yours:
    my_async = async_llm.generate(ASYNC_PROMPTS, ASYNC_PARAMS, use_tqdm=False)
yours.compare(my_async, ref_async, "the async-scheduled prompts")
tally(yours)
print(f"the same tokens; your plan_ahead planned {yours.calls['plan_ahead']} times")
async_llm.llm_engine.shutdown()

# %% [markdown]
# ## 8. Images
#
# The last engine serves a vision-language model: the tiny random-weight LLaVA of lesson 15 (a 2-layer Llama
# behind a small image encoder, written to a temporary folder; its text is noise, but it is the same noise with
# your functions). Its encoder cache holds one image's output (16 rows), so when three requests each bring an
# image, your `fit` decides how far each prompt's chunk may run before an image that has no room yet.

# %%
import importlib.util
from pathlib import Path

import numpy as np
import transformers
from PIL import Image

import course

transformers.logging.set_verbosity_error()
transformers.logging.disable_progress_bar()
ROOT = Path(course.__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("llava_checkpoint", ROOT / "tests" / "llava_checkpoint.py")
llava_checkpoint = importlib.util.module_from_spec(spec)
spec.loader.exec_module(llava_checkpoint)
CKPT = Path(tempfile.mkdtemp(prefix="minivllm-lesson16-llava-"))
atexit.register(shutil.rmtree, CKPT, ignore_errors=True)
llava_checkpoint.make_tiny_llava(CKPT)
vlm = LLM(model=str(CKPT), block_size=8, num_kv_blocks=64, max_num_seqs=4, max_num_batched_tokens=16,
          long_prefill_token_threshold=8, encoder_cache_size=16, seed=0)

yy, xx = np.mgrid[0:32, 0:32]
disc = np.full((32, 32, 3), 255, np.uint8)
disc[(yy - 15.5) ** 2 + (xx - 15.5) ** 2 < 100] = (220, 30, 30)
stripes = np.zeros((32, 32, 3), np.uint8)
stripes[:] = (20, 40, 160)
stripes[(xx // 4) % 2 == 1] = (250, 210, 40)
PICTURES = [Image.fromarray(disc), Image.fromarray(stripes), Image.fromarray(255 - disc)]
VLM_PROMPTS = [{"prompt": "USER: <image>\nWhat is in this picture? ASSISTANT:", "multi_modal_data": {"image": im}}
               for im in PICTURES]
VLM_PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
ref_vlm = vlm.generate(VLM_PROMPTS, VLM_PARAMS, use_tqdm=False)
vlm.llm_engine.reset_prefix_cache()
with your_engine(vlm, *YOURS) as yours:
    my_vlm = vlm.generate(VLM_PROMPTS, VLM_PARAMS, use_tqdm=False)
yours.compare(my_vlm, ref_vlm, "the image prompts")
tally(yours)
print(f"the same tokens for {len(my_vlm)} image prompts; your fit admitted chunks {yours.calls['fit']} times")
vlm.llm_engine.shutdown()

# %% [markdown]
# ## 9. What your engine ran on
#
# Every run above gave the reference's tokens. Over all of them, how often the engines asked each of your
# functions:

# %%
print(f"{'your function':28} {'role':7} {'calls':>7}")
for name, calls in totals.items():
    print(f"{name:28} {ROLES.get(name, 'drives'):7} {calls:7}")
never = [name for name, calls in totals.items() if calls == 0]
print("every one of your functions was called" if not never else f"never called: {never}")

# %% [markdown]
# That is the engine of this course, running on your code: the prefix cache finds hits with your hash walk, K and
# V land in your slots, attention reads them through your block tables, preemption picks your victim, decode
# batches are padded your way, the sampler draws from your nucleus, drafts are yours, and images are admitted by
# your rule. Beside it, your block counts, journaled allocations, scheduling steps, tensor-parallel shards,
# pipeline stages, streams, roofline, W8A8 rounding and connector answers were held to the real ones at every
# call.
#
# What a wrong function looks like: here a `slot_mapping` that puts every token one slot too far. The engine
# writes K and V to those slots, attention reads the right ones, and the tokens change; the switch says which
# function disagreed first.

# %%
def one_slot_off(block_table, start, end, block_size):
    return [block_table[p // block_size] * block_size + p % block_size + 1 for p in range(start, end)]


caught = None
try:
    with your_engine(llm, slot_mapping=one_slot_off) as wrong:
        wrong_out, _ = run(PROMPTS[:2], GREEDY)
    wrong.compare(wrong_out, reference[:2], "the first two prompts")
except YourEngineError as e:
    caught = e
    print(f"YourEngineError: {e}")

# %% [markdown]
# ## Check yourself
#
# The claims of this lesson, as asserts: the outputs of every run equal the reference's, every function you
# wrote was called, and the switch left the engine as it found it (its own methods back, its pool whole).

# %%
for a, b in [(mine, reference), (mine_sampled, ref_sampled), (my_spec, ref_spec), (my_async, ref_async),
             (my_vlm, ref_vlm)]:
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
assert my_streams == ref_streams
assert caught is not None and "slot_mapping" in str(caught)     # the wrong slots were caught and named
assert set(totals) == set(mine_names) and all(totals.values()), totals
assert any(t.preempted for t in my_traces) and sum(len(t.prefix_hit_blocks) for t in my_traces) > 0
assert my_counts[2] > 0 and my_counts[1] > 0                # blocks loaded from the folder; drafts accepted
for obj in (engine, engine.scheduler, engine.kv_cache_manager, engine.model_runner, engine.model_runner.backend):
    assert not set(vars(obj)) & {"step", "schedule", "_preempt", "_choose_victim", "get_computed_blocks",
                                 "allocate_slots", "prepare_inputs", "forward"}, f"{type(obj).__name__} still patched"
attention = engine.model_runner.model.layers[0].self_attn
assert not (attention.qkv_proj._forward_pre_hooks or attention.qkv_proj._forward_hooks
            or attention.o_proj._forward_hooks)
assert engine.model_runner.graphs is None
engine.check_integrity()
assert engine.kv_cache_manager.num_free_blocks == engine.kv_cache_manager.num_blocks
print("all checks passed")
