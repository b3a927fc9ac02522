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
# # Lesson 15: images in a prompt, a vision-language model (LLaVA)
#
# A LLaVA model is a Llama that reads some rows of its input from a **vision encoder** instead of its token
# table. The prompt holds a run of placeholder tokens where the image goes; the encoder turns the image into as
# many vectors as there are placeholders, and those vectors take the placeholders' places before the first
# layer. From there on the language model cannot tell: attention, the KV cache and sampling are the ones of
# lessons 01-05.
#
# ```
# "USER: <image>\nWhat is in this picture? ASSISTANT:"
#   tokenizer            one <image> token (49152)
#   MultiModalProcessor  <image> -> 16 placeholder tokens, and a MultiModalFeature   multimodal/processor.py
#                        (the image's hash, its offset in the prompt, 16 rows, its pixel values)
#   scheduler            chunks of the prompt; EncoderCacheManager.fit decides      core/encoder_cache_manager.py
#                        where a chunk must stop for an image
#   worker               runs the encoder on the step's new images, writes its      worker/encoder_runner.py
#                        rows over the placeholders' embeddings
#   model                CLIP tower + projector, then the Llama forward of text     model/llava.py
# ```
#
# For the engine an image brings two new questions, and they are the subject of this lesson. The encoder's
# output must be kept somewhere until every chunk of the prompt that needs it has run: that is the **encoder
# cache**, with a budget of rows, and the scheduler may run a chunk only if the images in it fit (sections 3
# and 5, where you write that rule). And two prompts with the same tokens but different pictures must not
# share KV blocks: the **prefix cache** has to see the image (section 4).
#
# The model is a tiny LLaVA with random weights (`tests/llava_checkpoint.py`: a 2-layer Llama, a 3-layer CLIP
# tower, 32x32 images in 16 patches), written to a temporary directory below in a few seconds. Its answers are
# meaningless tokens, but every mechanism is the one a real LLaVA-1.5 goes through (576 placeholders per image
# there, 16 here). Hugging Face transformers loads the same directory and is the oracle.

# %%
import warnings

warnings.filterwarnings("ignore", message="IProgress not found")   # tqdm's notice when ipywidgets is absent

import atexit
import importlib.util
import inspect
import shutil
import tempfile
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import torch
import transformers
from matplotlib.patches import Patch, Rectangle
from PIL import Image

import course
from minivllm import LLM, SamplingParams
from minivllm.core.encoder_cache_manager import EncoderCacheManager
from minivllm.core.journal import StepJournal
from minivllm.core.kv_cache_manager import KVCacheManager
from minivllm.core.request import Request
from minivllm.core.scheduler import Scheduler
from plots import CLEAN_FREE, RequestColors, contrast

torch.manual_seed(0)
torch.set_num_threads(1)   # one thread: faster on a busy 2-core CPU, and the same float sums everywhere
transformers.logging.set_verbosity_error()       # the oracle's notices and progress bars stay off stderr
transformers.logging.disable_progress_bar()

# The tiny checkpoint's writer lives with the tests (tests/llava_checkpoint.py); load it from its file.
ROOT = Path(course.__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("llava_checkpoint", ROOT / "tests" / "llava_checkpoint.py")
llava_checkpoint = importlib.util.module_from_spec(spec)
spec.loader.exec_module(llava_checkpoint)

CKPT = Path(tempfile.mkdtemp(prefix="minivllm-lesson13-"))
atexit.register(shutil.rmtree, CKPT, ignore_errors=True)      # removed when the kernel stops
llava_checkpoint.make_tiny_llava(CKPT)
# Small budgets, so that the pictures stay readable: 8-token blocks, at most 16 tokens a step and 8 per prompt,
# and an encoder cache of 16 rows, one image.
llm = LLM(model=str(CKPT), block_size=8, num_kv_blocks=64, max_num_seqs=4, max_num_batched_tokens=16,
          long_prefill_token_threshold=8, encoder_cache_size=16, seed=0)
engine = llm.llm_engine
tokenizer = llm.get_tokenizer()
processor = engine.input_processor.mm_processor
cfg = engine.model_config
print(f"{cfg.architecture}: a {cfg.num_hidden_layers}-layer Llama of hidden size {cfg.hidden_size}; vision: "
      f"{cfg.vision['image_size']}x{cfg.vision['image_size']} images in {cfg.vision['patch_size']}x"
      f"{cfg.vision['patch_size']} patches, {cfg.vision['num_image_tokens']} image tokens, image token id "
      f"{cfg.vision['image_token_id']}")

# %% [markdown]
# Two pictures of 32x32 pixels, made of numbers so that they are the same everywhere: a red disc and blue and
# yellow stripes.

# %%
yy, xx = np.mgrid[0:32, 0:32]
disc = np.full((32, 32, 3), 255, np.uint8)
disc[(yy - 15.5) ** 2 + (xx - 15.5) ** 2 < 100] = (220, 30, 30)
stripes = np.zeros((32, 32, 3), np.uint8)
stripes[:] = (20, 40, 160)
stripes[(xx // 4) % 2 == 1] = (250, 210, 40)
images = {"disc": Image.fromarray(disc), "stripes": Image.fromarray(stripes)}
PROMPT = "USER: <image>\nWhat is in this picture? ASSISTANT:"
print(f"images: {', '.join(f'{name} {im.size[0]}x{im.size[1]} {im.mode}' for name, im in images.items())}")

# %% [markdown]
# ## 1. Why images are tokens
#
# The scheduler counts tokens: its budget, the chunks of a prompt, the KV blocks are all in tokens. An image
# becomes tokens too. The tokenizer sees `<image>` as one token (id 49152 in this checkpoint); the
# multimodal processor replaces it with **as many placeholder tokens as the encoder gives rows** for one image,
# and records where they are. Here is the real `MultiModalProcessor.process` on the prompt:

# %%
IMAGE_TOKEN = processor.image_token_id
ids = tokenizer.encode(PROMPT)
expanded, (feature,) = processor.process(ids, {"image": images["disc"]})
print(f"the tokenizer: {len(ids)} tokens, <image> = token {IMAGE_TOKEN} at position {ids.index(IMAGE_TOKEN)}")
print(f"the processor: {len(expanded)} tokens, token {IMAGE_TOKEN} at positions "
      f"{[i for i, t in enumerate(expanded) if t == IMAGE_TOKEN]}")
print(f"its feature: offset {feature.offset}, length {feature.length}, hash {feature.mm_hash[:12]}..., "
      f"pixel values {tuple(feature.pixel_values.shape)}")
print(f"num_image_tokens: {processor.num_image_tokens} = (32 / 8)^2 patches of 8x8 pixels")

# %% [markdown]
# Each placeholder stands for one patch of the picture. The encoder (a vision transformer) sees the image as a
# sequence of 8x8-pixel patches; its output has one row per patch, in reading order, and row `k` goes to the
# prompt's position `offset + k`:

# %%
# NBVAL_IGNORE_OUTPUT
colors = RequestColors(["A", "B"])
IMAGE_COLOR = colors("A")
fig, (ax_im, ax_tok) = plt.subplots(1, 2, figsize=(13, 2.6), gridspec_kw={"width_ratios": [1, 7.5]})
ax_im.imshow(images["disc"], extent=(0, 32, 32, 0))
for k in range(16):
    x, y = (k % 4) * 8, (k // 4) * 8
    ax_im.add_patch(Rectangle((x, y), 8, 8, fill=False, edgecolor="#444", lw=0.8))
    ax_im.text(x + 4, y + 4, str(k), ha="center", va="center", fontsize=7)
ax_im.set_axis_off()
ax_im.set_title("16 patches", fontsize=9)
for i, t in enumerate(expanded):
    is_image = feature.offset <= i < feature.end
    ax_tok.add_patch(Rectangle((i, 0), 0.94, 1, facecolor=IMAGE_COLOR if is_image else CLEAN_FREE, lw=0))
    label = str(i - feature.offset) if is_image else repr(tokenizer.decode([t]))[1:-1].replace(" ", "␣")
    ax_tok.text(i + 0.47, 0.5, label, ha="center", va="center", fontsize=7, rotation=0 if is_image else 90,
                color=contrast(IMAGE_COLOR) if is_image else "#222")
    ax_tok.text(i + 0.47, -0.15, str(i), ha="center", va="top", fontsize=6, color="#666")
ax_tok.annotate("", (feature.offset, 1.25), (feature.end - 0.06, 1.25),
                arrowprops=dict(arrowstyle="<->", color="#444"))
ax_tok.text((feature.offset + feature.end) / 2, 1.35,
            f"token {IMAGE_TOKEN} x {feature.length}: rows 0-15 of the encoder's output", ha="center",
            va="bottom", fontsize=8)
ax_tok.set_xlim(0, len(expanded))
ax_tok.set_ylim(-0.6, 1.9)
ax_tok.set_axis_off()
ax_tok.set_title(f"the prompt after the processor: {len(expanded)} tokens (position under each)", fontsize=9)
plt.tight_layout()
plt.show()

# %% [markdown]
# So a prompt with one image is 15 tokens of text to the user and 30 tokens to the engine. A real LLaVA-1.5
# takes 336x336 images in 14x14 patches: 576 placeholders for every image, more than most questions asked about
# it. The images dominate the prompt, which is why the rest of the lesson is about not doing their work twice.
#
# ## 2. The encoder and the language model
#
# `embed_multimodal` runs the vision side on a batch of images: the patch convolution and a CLS row, the CLIP
# layers up to `vision_feature_layer` (-2: all but the last), the CLS row dropped, and a two-layer projector
# from the encoder's width to the language model's hidden size.

# %%
model = engine.model_runner.model
with torch.inference_mode():
    rows = model.embed_multimodal(feature.pixel_values[None])                 # (images, rows, hidden)
    table = model.embed_input_ids(torch.tensor(expanded))                     # the token table's rows
print(f"pixel values {tuple(feature.pixel_values[None].shape)} -> encoder output {tuple(rows.shape)}: "
      f"{rows.shape[1]} rows of the language model's hidden size {model.cfg.hidden_size}")
placeholder_rows = table[feature.offset:feature.end]
print(f"the token table gives all 16 placeholders one and the same row: "
      f"{bool((placeholder_rows == placeholder_rows[0]).all())}")
print(f"the encoder gives 16 different rows: {len({tuple(r.tolist()) for r in rows[0]}) == 16}")

# %% [markdown]
# The model runner embeds the step's tokens with the token table, then the encoder runner
# (`worker/encoder_runner.py`) writes the encoder's rows over the placeholders' rows: a chunk that holds only
# part of an image takes the rows of its part (`image_spans`). The rest is the Llama forward, unchanged.
#
# Is it right? The oracle is Hugging Face's `LlavaForConditionalGeneration` on the same checkpoint, with its own
# processor. Greedy decoding, ten tokens, each picture:

# %%
hf_processor = transformers.LlavaProcessor.from_pretrained(CKPT)
hf_model = transformers.LlavaForConditionalGeneration.from_pretrained(CKPT, dtype=torch.float32).eval()
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
ours, theirs = {}, {}
for name, image in images.items():
    out = llm.generate([{"prompt": PROMPT, "multi_modal_data": {"image": image}}], GREEDY, use_tqdm=False)
    ours[name] = list(out[0].outputs[0].token_ids)
    batch = hf_processor(text=PROMPT, images=[image], return_tensors="pt")
    with torch.inference_mode():
        generated = hf_model.generate(**batch, max_new_tokens=10, do_sample=False)
    theirs[name] = generated[0, batch["input_ids"].shape[1]:].tolist()
    print(f"{name:8s} minivllm {ours[name]}\n{'':8s} HF       {theirs[name]}  equal: {ours[name] == theirs[name]}")
print(f"the two pictures give different tokens: {ours['disc'] != ours['stripes']}")

# %% [markdown]
# Same tokens, with the prompt run in chunks of at most 8 tokens (`long_prefill_token_threshold=8`): the image's
# 16 placeholders were cut over three steps, and each step took the encoder rows of its part.
#
# ## 3. The encoder budget
#
# The encoder runs once per image, in the step whose chunk first reaches the image's placeholders. Its output
# must then stay until the last chunk that covers the image has run: with chunked prefill that can be several
# steps later. The scheduler's `EncoderCacheManager` (as vLLM v1's) keeps these outputs under a budget of
# `encoder_cache_size` rows and answers one question for every request it schedules: how many of the tokens
# the step wants to run may run? `Scheduler._chunk` asks it once the token budget has given its answer:

# %%
# NBVAL_IGNORE_OUTPUT
print(inspect.getsource(Scheduler._chunk))

# %% [markdown]
# The manager keeps every output in one of two states: **held** (`cached`: hash -> the requests that still
# need it, because their prompt has not run past the image) or **freeable** (`freeable`, in least-recently-freed
# order: needed by nobody now, kept in case an equal image comes, evicted when a new output needs the room).
# `sizes` lists the rows of every kept output, and `num_free_slots` is what is left of the budget. During
# `schedule()` nothing changes: `fit` only *plans*, in `out.encoder_plan`, and `schedule_encoder` makes the
# plan of the requests that were really scheduled real at the end of the step (references taken, evictions
# done, new images sent to the encoder). You will write `fit` yourself in section 5 (minivllm's own is printed after
# the exercise); here is its rule in words.

# %% [markdown]
# The rule has three parts. An image that is **held** or **already in the step's plan** costs no room: its
# output is (or will be) there. Any other image must **fit**: the new rows the whole plan needs with it must not
# exceed the free rows plus the freeable outputs that the plan does not pin (an output the plan takes again
# cannot also be evicted to make room). And when an image does not fit, the chunk stops **before** it: the
# text before the image still runs, and the request waits at the image until room is made. An encoder's
# attention is bidirectional, so an image is encoded whole or not at all; a chunk can cut its *placeholders*,
# never its encoding.
#
# Now two requests, A with the disc and B with the stripes, behind the same question, and an encoder cache of
# 16 rows: one image. The scheduler is the real one, driven by hand as in lessons 03 and 04: each step is
# planned, its prompt chunks count as computed, a finished prompt gets a made-up token. No model runs; the
# features are the real processor's.


# %%
def processed(image, text=PROMPT, max_tokens=4):
    """The real input processor's output for a prompt with one image: (token ids, features, params)."""
    p = engine.input_processor.process_inputs({"prompt": text, "multi_modal_data": {"image": image}},
                                              SamplingParams(temperature=0, max_tokens=max_tokens))
    return p.prompt_token_ids, p.mm_features, p.params


def make_scheduler(encoder_cache_size):
    """The real Scheduler, KVCacheManager and EncoderCacheManager, with the engine's budgets (no model)."""
    journal = StepJournal()
    kv = KVCacheManager(64, 8, journal, True, 0)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=512,
                      long_prefill_token_threshold=8)
    sched.encoder_cache_manager = EncoderCacheManager(encoder_cache_size, journal)
    return sched


def run(encoder_cache_size):
    """A and B through fake steps; one record per step: what each request ran, what fit answered, what the
    encoder ran, what the worker was told to drop, and the encoder cache after the step."""
    sched, names = make_scheduler(encoder_cache_size), {}
    ecm = sched.encoder_cache_manager
    requests = []
    for i, (rid, name) in enumerate((("A", "disc"), ("B", "stripes"))):
        token_ids, features, params = processed(images[name])
        names[features[0].mm_hash] = name
        requests.append(Request(rid, token_ids, params, mm_features=features, arrival_time=float(i)))
        sched.add_request(requests[-1])
    asked = []                                      # (request, start, tokens asked, tokens given) of this step

    def recorded(self, req, start, num_tokens, out):
        n = EncoderCacheManager.fit(self, req, start, num_tokens, out)
        asked.append((req.request_id, start, num_tokens, n))
        return n

    ecm.fit = recorded.__get__(ecm)                 # this manager only: the class keeps the real method
    steps = []
    while sched.has_unfinished_requests():
        asked.clear()
        sched.begin_step()
        out = sched.schedule()
        starts = {r.request_id: r.num_computed_tokens for r in out.scheduled}
        sampled = {r.request_id: 7 for r in out.scheduled
                   if r.num_computed_tokens + out.num_scheduled_tokens[r.request_id] >= r.num_tokens}
        sched.update_from_output(out, sampled)
        sched.commit_step()
        sched.check_integrity()
        steps.append({"ran": {rid: (starts[rid], n) for rid, n in out.num_scheduled_tokens.items()},
                      "fit": list(asked), "encoded": [names[f.mm_hash] for f in out.encoder_inputs],
                      "dropped": [names[h] for h in out.free_encoder_hashes],
                      "held": {names[h]: sorted(refs) for h, refs in ecm.cached.items()},
                      "freeable": [names[h] for h in ecm.freeable]})
    return steps, requests


steps, (req_a, req_b) = run(encoder_cache_size=16)
image_range = {r.request_id: (r.mm_features[0].offset, r.mm_features[0].end) for r in (req_a, req_b)}
print(f"A and B: {req_a.num_prompt_tokens} prompt tokens each, the image at {image_range['A']}; "
      f"an encoder cache of 16 rows")
print(f"{'step':>4}  {'A runs':14s}  {'B runs':26s}  {'encoder':8s}  {'worker drops':12s}  cache after the step")
for i, s in enumerate(steps):
    cells = []
    for rid in "AB":
        start, n = s["ran"].get(rid, (None, 0))
        cut = next(((st, want, got) for r, st, want, got in s["fit"] if r == rid and got < want), None)
        text = f"[{start}, {start + n})" if n else ""
        if cut:
            text += f" fit: {cut[2]} of {cut[1]}" if n else f"waits at {cut[0]}: fit 0 of {cut[1]}"
        cells.append(text or ("done" if s is not steps[0] and rid not in s["ran"] else ""))
    cache = [f"{h} held by {','.join(r)}" for h, r in s["held"].items()] + [f"{h} freeable" for h in s["freeable"]]
    print(f"{i:>4}  {cells[0]:14s}  {cells[1]:26s}  {','.join(s['encoded']) or '-':8s}  "
          f"{','.join(s['dropped']) or '-':12s}  {'; '.join(cache) or 'empty'}")

# %% [markdown]
# Step 0: A's first chunk reaches the disc, which fits, and the encoder runs it. B's chunk of 8 would reach the
# stripes, which need 16 new rows beside the disc's 16, so `fit` cuts it to the 3 text tokens before the
# image. B then waits at its image for two steps while A's chunks consume the disc. At the end of step 2 A's
# prompt has run past the disc: its output becomes freeable. In step 3 `fit` counts it as evictable, the
# stripes fit, and `schedule_encoder` evicts the disc to make room. The worker hears of the eviction with the
# next step (`free_encoder_hashes`), so that a step that fails and is rolled back never leaves it without an
# output the restored state still counts on. The picture:

# %%
# NBVAL_IGNORE_OUTPUT
fig, axes = plt.subplots(1, 3, figsize=(13, 3.8), sharey=True, gridspec_kw={"width_ratios": [4, 4, 2.2]})
for ax, req in zip(axes, (req_a, req_b)):
    rid, (lo, hi) = req.request_id, image_range[req.request_id]
    ax.axvspan(lo, hi, color=colors(rid), alpha=0.15, lw=0)
    ax.axvline(req.num_prompt_tokens, color="#888", lw=0.8, ls=":")
    for i, s in enumerate(steps):
        if rid in s["ran"]:
            start, n = s["ran"][rid]
            ax.barh(i, n, left=start, height=0.6, color=colors(rid), edgecolor="white")
        if rid == "A" and "disc" in s["encoded"] or rid == "B" and "stripes" in s["encoded"]:
            ax.plot(lo, i, marker="*", ms=13, color="black", mec="white", zorder=3)
        for r, start, want, got in s["fit"]:
            if r == rid and got < want:
                ax.plot([start + got] * 2, [i - 0.4, i + 0.4], color="tab:red", lw=3)
                ax.text(start + got + 0.4, i, f"stops: {want - got} tokens wait", color="tab:red", va="center",
                        fontsize=7)
    ax.set_xlim(0, req.num_tokens + 4)
    ax.set_xlabel("position in the sequence")
    ax.set_title(f"request {rid}: the image at [{lo}, {hi}) shaded; prompt ends at the dotted line", fontsize=9)
ax_cache = axes[2]
for i, s in enumerate(steps):
    kept = [(h, False) for h in s["held"]] + [(h, True) for h in s["freeable"]]
    for j, (h, freeable) in enumerate(kept):
        color = colors("A" if h == "disc" else "B")
        ax_cache.barh(i, 16, left=16 * j, height=0.6, color=color, alpha=0.45 if freeable else 1.0,
                      hatch="//" if freeable else None, edgecolor="white")
        holders = "freeable" if freeable else "held by " + ",".join(s["held"][h])
        ax_cache.text(16 * j + 8, i, f"{h} ({holders})", ha="center", va="center", fontsize=7)
    if not kept:
        ax_cache.barh(i, 16, height=0.6, color=CLEAN_FREE)
ax_cache.set_xlim(0, 16)
ax_cache.set_xlabel("encoder cache rows")
ax_cache.set_title("the cache after each step", fontsize=9)
axes[0].set_yticks(range(len(steps)))
axes[0].set_ylabel("engine step")
axes[0].invert_yaxis()
axes[1].legend(handles=[plt.Line2D([], [], marker="*", ls="", color="black", ms=10, label="the encoder runs"),
                        plt.Line2D([], [], color="tab:red", lw=3, label="fit cuts the chunk here")],
               loc="upper right", fontsize=8)
plt.tight_layout()
plt.show()

# %% [markdown]
# The price of a small cache is B's wait. With room for both images, nothing waits:

# %%
roomy, _ = run(encoder_cache_size=32)
print(f"encoder cache of 16 rows: {len(steps)} steps, B cut or held back in "
      f"{sum(any(r == 'B' and got < want for r, _, want, got in s['fit']) for s in steps)} of them")
print(f"encoder cache of 32 rows: {len(roomy)} steps, B cut or held back in "
      f"{sum(any(r == 'B' and got < want for r, _, want, got in s['fit']) for s in roomy)} of them")

# %% [markdown]
# vLLM's default, which minivllm follows, makes the cache as large as the step's token budget
# (`max_num_batched_tokens`), and never smaller than one image, so that every image can run once the outputs
# before it are freed; `encoder_cache_size` sets it (as here, one image).
#
# > **How vLLM does it differently.** vLLM's scheduler asks the same question in `_try_schedule_encoder_inputs`
# > (`vllm/v1/core/sched/scheduler.py`), with `EncoderCacheManager.can_allocate`
# > (`vllm/v1/core/encoder_cache_manager.py`), and also keeps a second budget: how many encoder input tokens may
# > be *computed* in one step, so that a batch of new images cannot make one step long. With
# > `disable_chunked_mm_input` a chunk never cuts an image's placeholders: it stops before an image it cannot
# > take whole. And the front end keeps a cache of processed images, so an image sent again is not
# > preprocessed again.
#
# ## 4. An image's blocks in the prefix cache
#
# The prefix cache names a block by its tokens and everything before them (lesson 01). But every image's
# placeholders are the same token, 49152: by tokens alone, "USER: <disc>\nWhat is..." and "USER: <stripes>\n
# What is..." are the same prompt, and the second would read the first one's KV. So a block that holds image
# tokens carries the image in its key:

# %%
# NBVAL_IGNORE_OUTPUT
print(inspect.getsource(Request.block_key))

# %%
BS = engine.kv_cache_manager.block_size
names = {}


def core_request(request_id, image, text=PROMPT):
    """A Request as the engine queues it (the real processor's tokens and features), not queued."""
    token_ids, features, params = processed(image, text, max_tokens=1)
    names[features[0].mm_hash] = [n for n, im in images.items() if im is image][0]
    return Request(request_id, token_ids, params, mm_features=features)


first = core_request("first", images["disc"])
print(f"a prompt of {first.num_tokens} tokens in blocks of {BS}; the disc at [{first.mm_features[0].offset}, "
      f"{first.mm_features[0].end})")
for i in range(-(-first.num_tokens // BS)):
    key = first.block_key(i, BS)
    extra = [f"({names[h]}, {offset})" for h, offset in key[BS:]] if len(key) > BS else []
    tokens = key[:BS] if extra else key
    print(f"block {i}: {len(tokens)} token ids" + (f" + {', '.join(extra)}: the image, and where the block "
                                                   f"starts relative to it" if extra else ": text only"))

# %% [markdown]
# Now the engine's own `KVCacheManager`. We run the prompt with the disc once (its full blocks join the prefix
# cache), then ask `get_computed_blocks`, the lookup that admission makes, for the same text with the stripes and
# with the disc again, and run both to see the hits the engine reports:

# %%
kv = engine.kv_cache_manager
engine.reset_prefix_cache()
ONE = SamplingParams(temperature=0, max_tokens=1)
llm.generate([{"prompt": PROMPT, "multi_modal_data": {"image": images["disc"]}}], ONE, use_tqdm=False)
hits = {name: kv.get_computed_blocks(core_request(name, images[name])) for name in ("stripes", "disc")}
outs = llm.generate([{"prompt": PROMPT, "multi_modal_data": {"image": images[name]}} for name in hits], ONE,
                    use_tqdm=False)
for (name, blocks), o in zip(hits.items(), outs):
    print(f"the same text with the {name}: {len(blocks)} cached blocks, the engine reports "
          f"{o.num_cached_tokens} prompt tokens from the prefix cache")

# %% [markdown]
# The stripes share nothing: the image starts in block 0, so every block differs from the disc's. The disc again
# shares every full block (the lookup always leaves at least one prompt token to compute, for the logits; here
# the last block is partial anyway). Blocks wholly before the first image are plain text and are shared whatever
# the picture. A system prompt in front shows it:

# %%
SYSTEM = "A chat between a curious user and an artificial intelligence assistant. "
engine.reset_prefix_cache()
llm.generate([{"prompt": SYSTEM + PROMPT, "multi_modal_data": {"image": images["disc"]}}], ONE, use_tqdm=False)
for name in ("stripes", "disc"):
    req = core_request(name, images[name], SYSTEM + PROMPT)
    print(f"system prompt + the {name} ({req.num_tokens} tokens, the image at {req.mm_features[0].offset}): "
          f"{len(kv.get_computed_blocks(req))} cached blocks of the {(req.num_tokens - 1) // BS} the lookup may "
          f"return")

# %% [markdown]
# With the stripes, the two blocks before the image are hits and the first block that touches the image is the
# first miss: the prefix chain breaks there, as it would at a different token.
#
# > **How vLLM does it differently.** vLLM puts the same information into the block hash as "extra keys"
# > (`generate_block_hash_extra_keys` in `vllm/v1/core/kv_cache_utils.py`): for a block that holds part of an
# > image, the image's hash, beside a LoRA adapter's name and a request's cache salt when there are any.
#
# ## 5. Exercise: the admission rule
#
# Write `fit(ecm, req, start, num_tokens, out)`, the method of section 3 as a function (`ecm` is the
# `EncoderCacheManager`). It returns how many of the `num_tokens` tokens from position `start` of `req` may run
# this step, and plans the images it lets in.
#
# - The images are `req.mm_features`, in prompt order; an image `f` covers positions `[f.offset, f.end)` and
#   needs `f.length` rows. Only the images that overlap `[start, start + num_tokens)` matter.
# - Start a fresh plan for the request: `out.encoder_plan[req.request_id] = []` (the cell does it), and append
#   every image you let in, in prompt order, **kept ones too** (`schedule_encoder` takes a reference on them).
# - An image costs no room when its output is held (`f.mm_hash in ecm.cached`) or its hash is already in the
#   step's plan: the plan of this request so far, and the plans of the requests already in the batch
#   (`rid in out.num_scheduled_tokens`; a request planned but then not scheduled needs nothing).
# - Any other image must fit: take the rows of every hash the plan needs, with this image added (one entry per
#   hash); the new rows are those of the hashes not in `ecm.sizes`; they must not exceed `ecm.num_free_slots`
#   plus the rows of the `ecm.freeable` outputs that are not among those hashes.
# - At the first image that does not fit, return the number of tokens before it (0 if the chunk starts inside
#   or at it). If every image fits, return `num_tokens`. Never change `ecm`.
#
# The check runs hand-made caches and plans with known answers, then 300 random ones against minivllm's
# `EncoderCacheManager.fit`, and then puts your function in the real scheduler's place for 30 workloads of
# image prompts (recompute and swap preemption, steps that fail and are rolled back): each step must schedule
# and encode what the real rule does, the scheduler's invariants must hold, and every request must finish.

# %%
from course import check, exercise


@exercise("15.fit")
def fit(ecm, req, start, num_tokens, out):
    mine = out.encoder_plan[req.request_id] = []       # the images this call lets in, in prompt order
    # your code here
    raise NotImplementedError


check(fit)

# %% [markdown]
# Now yours inside the engine: the tiny model, a cache of one image, the two pictures at once. Every chunk the
# engine runs was admitted by your function; the tokens must still be Hugging Face's.

# %%
cuts = []


def yours_counted(self, req, start, num_tokens, out):
    n = fit(self, req, start, num_tokens, out)
    if n < num_tokens:
        cuts.append((req.request_id, start, num_tokens, n))
    return n


real_fit = EncoderCacheManager.fit
EncoderCacheManager.fit = yours_counted
try:
    encoded_before = engine.scheduler.encoder_cache_manager.num_encoder_inputs_scheduled
    engine.reset_prefix_cache()
    yours = llm.generate([{"prompt": PROMPT, "multi_modal_data": {"image": images[name]}} for name in images],
                         GREEDY, use_tqdm=False)
    encoded = engine.scheduler.encoder_cache_manager.num_encoder_inputs_scheduled - encoded_before
finally:
    EncoderCacheManager.fit = real_fit
yours = {name: list(o.outputs[0].token_ids) for name, o in zip(images, yours)}
for name in images:
    print(f"{name}: your fit in the engine gives Hugging Face's tokens: {yours[name] == theirs[name]}")
print(f"your function cut {len(cuts)} chunks (it was asked for {sorted({c[2] for c in cuts})} tokens and "
      f"gave {sorted({c[3] for c in cuts})}); the encoder ran {encoded} image(s): the disc's output was still "
      f"kept (freeable) from section 4, and was taken again")

# %% [markdown]
# minivllm's own `EncoderCacheManager.fit`, to compare with yours:

# %%
# NBVAL_IGNORE_OUTPUT
print(inspect.getsource(EncoderCacheManager.fit))

# %% [markdown]
# ## Check yourself
#
# Run this cell. It replays the lesson's claims: the placeholder became 16 tokens at its offset; the encoder
# gave one row per placeholder in the language model's width; minivllm's greedy tokens are Hugging Face's for
# both pictures, and the pictures matter; with one image of cache B's first chunk stopped before its image, the
# stripes were encoded only once A had consumed the disc, and the eviction reached the worker one step later;
# different pictures share no block with image tokens, equal ones share every full block; and your function,
# inside the engine, cut chunks and gave the same tokens.

# %%
assert len(expanded) == len(ids) - 1 + 16 and feature.offset == ids.index(IMAGE_TOKEN) and feature.length == 16
assert tuple(rows.shape) == (1, 16, model.cfg.hidden_size)
assert ours == theirs and ours["disc"] != ours["stripes"], "minivllm's greedy tokens are HF's; the image matters"
assert steps[0]["ran"]["B"] == (0, 3) and steps[0]["encoded"] == ["disc"], "B's first chunk stops before its image"
first_stripes = next(i for i, s in enumerate(steps) if "stripes" in s["encoded"])
assert steps[first_stripes - 1]["freeable"] == ["disc"], "the stripes wait until the disc is freeable"
assert steps[first_stripes + 1]["dropped"] == ["disc"], "the worker drops the disc one step after its eviction"
assert not any(got < want for s in roomy for _, _, want, got in s["fit"]), "room for both: nothing waits"
assert len(hits["stripes"]) == 0 and len(hits["disc"]) == (len(expanded) - 1) // BS
assert outs[0].num_cached_tokens == 0 and outs[1].num_cached_tokens == len(hits["disc"]) * BS
assert yours == theirs and cuts and encoded == 1, "your fit inside the engine: Hugging Face's tokens"
print("all checks passed")

# %% [markdown]
# ## Where next
#
# Send images to the server: `python app.py --model DIR` with a LLaVA checkpoint takes OpenAI chat messages whose
# content has `{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}` parts
# (`minivllm/entrypoints/chat_utils.py`), and local files with `--allowed-local-media-path DIR`. Lesson 09 shows
# the server; the path from a message to the placeholders is the one of section 1.
