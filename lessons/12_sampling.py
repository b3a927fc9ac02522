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
# # Lesson 12: sampling and detokenization, from logits to text
#
# Every step, the model hands the engine one row of **logits** per request that samples: a score for each of
# the 49,152 tokens of SmolLM2's vocabulary. Everything between that row and the text a user reads is this
# lesson's subject. It all happens in three small modules:
#
# ```
# logits (rows, vocab) fp32                          model/llama.py      compute_logits
#   │ structured output: forbidden tokens -> -inf     worker/sampler.py   apply_grammar_bitmask (executor.py)
#   ├──> logprobs: log_softmax of this row (raw)      worker/logprobs.py  compute_logprobs
#   │ allowed_token_ids, bad_words, min_tokens,
#   │ logit_bias, repetition, frequency and presence  worker/sampler.py   apply_penalties_and_filters
#   │ greedy rows: argmax, done
#   │ / temperature, then min_p, top_k and top_p      worker/sampler.py   apply_min_p, apply_top_k_top_p
#   │ softmax, then one uniform per row: inverse CDF   worker/sampler.py   Sampler.sample, draw_from
#   ▼
# token id ──> incremental detokenization ──> text    engine/output_processor.py  detokenize_incrementally
# ```
#
# We run the real functions on the default model's real logits, then look at logprobs, parallel sampling's
# shared blocks, a character split over several tokens, and a grammar's mask. The code is printed from the
# installed modules (`inspect.getsource`), so what you read is what runs.

# %%
import warnings

warnings.filterwarnings("ignore", message="IProgress not found")   # tqdm's notice when ipywidgets is absent

import inspect

import matplotlib.pyplot as plt
import torch
from matplotlib.patches import Patch

from minivllm import LLM, SamplingParams, StructuredOutputsParams
from minivllm.core.request import Request
from minivllm.core.sampling_params import RequestOutputKind
from minivllm.core.structured_output import StructuredOutputManager
from minivllm.engine.output_processor import DetokState, detokenize_incrementally
from minivllm.worker.logprobs import compute_logprobs
from minivllm.worker.sampler import (Sampler, apply_grammar_bitmask, apply_min_p, apply_penalties_and_filters,
                                     apply_top_k_top_p)
from plots import draw_dists, draw_shared_tables

torch.manual_seed(0)
torch.set_num_threads(1)   # one thread: the same float sums everywhere

# %% [markdown]
# ## 1. The logits of one step
#
# To see the logits the sampler gets, we hook the model's last layer, `lm_head` (one row per request that
# samples this step): a forward hook copies its output on its way out; the engine runs unchanged.

# %%
llm = LLM(num_kv_blocks=64, max_num_seqs=8, seed=0)
engine = llm.llm_engine
tokenizer = llm.get_tokenizer()
VOCAB = engine.model_config.vocab_size

captured = []          # one (rows, vocab) tensor per forward that sampled
hook = engine.model_runner.model.lm_head.register_forward_hook(
    lambda module, args, output: captured.append(output.detach().clone()))


def chat_ids(text, system=None):
    """The token ids LLM.chat would send for one user message (the chat template, no extra special tokens)."""
    msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
    return tokenizer.encode(tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True),
                            add_special_tokens=False)


PROMPT = "I opened the box and found a"
captured.clear()
out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)[0]
logits = captured[0][0]                                   # (vocab,) the row the sampler saw
probs = logits.softmax(-1)
print(f"prompt {PROMPT!r}: {len(out.prompt_token_ids)} tokens; logits {tuple(captured[0].shape)} "
      f"{captured[0].dtype}; greedy next token: {out.outputs[0].text!r}")
top = probs.topk(8)
print("most likely:", ", ".join(f"{tokenizer.decode([i])!r} {p:.3f}" for p, i in zip(top.values.tolist(),
                                                                                      top.indices.tolist())))
entropy = -(probs * probs.clamp_min(1e-30).log2()).sum()
n90 = int((probs.sort(descending=True).values.cumsum(0) < 0.9).sum()) + 1
print(f"entropy {entropy:.2f} bits; the {n90} most likely tokens hold 90% of the probability")

# %% [markdown]
# A flat distribution: after "found a" many nouns and adjectives are plausible. Greedy decoding takes the
# argmax; sampling picks at random with these probabilities, after the transformations below. The pictures
# show the 30 most likely tokens (`␣` is a leading space: most words of a byte-level BPE vocabulary carry one).

# %%
TOP30 = probs.topk(30).indices                              # the x axis of every distribution plot below


def label(t):
    return repr(tokenizer.decode([int(t)]).replace(" ", "␣"))[1:-1]


def plot_dists(before, panels, title, ids=TOP30, red_labels=()):
    """plots.draw_dists with this tokenizer's labels: before in grey, each (title, after) panel in colour."""
    draw_dists(before, panels, ids, [label(t) for t in ids], title, red_labels)


# %% [markdown]
# ## 2. The sampler, and temperature
#
# The whole `Sampler.sample`: the batch's logits and requests in, one token id per row out, as a tensor where
# the logits are (async scheduling, lesson 11, keeps them on the GPU as the next batch's inputs). Penalties and
# filters first (section 4), greedy rows done; the rest divided by temperature, filtered, drawn (section 5).

# %%
# NBVAL_IGNORE_OUTPUT
print(inspect.getsource(Sampler.sample))

# %% [markdown]
# **Temperature** divides the logits before the softmax: `softmax(logits / T)`. Below 1 it sharpens the
# distribution (`T -> 0` is the argmax: `temperature=0` means greedy), above 1 it flattens it. It removes no
# token and keeps their order (in fp32 a very unlikely token could underflow at a very low temperature).

# %%
by_temp = {t: (logits / t).softmax(-1) for t in (0.5, 1.0, 1.5)}
for t, p in by_temp.items():
    n = int((p.sort(descending=True).values.cumsum(0) < 0.9).sum()) + 1
    print(f"T={t}: top token {label(p.argmax())} {p.max():.3f}, tokens for 90% of the mass {n:4d}, "
          f"tokens with p > 0: {int((p > 0).sum())}")

# %%
# NBVAL_IGNORE_OUTPUT
plot_dists(probs, [("temperature 0.5: sharper", by_temp[0.5]), ("temperature 1.5: flatter", by_temp[1.5])],
           "Temperature reshapes the distribution and keeps every token")

# %% [markdown]
# ## 3. Filters: top-k, top-p, min-p
#
# The filters set the logits of the tokens they drop to `-inf`, so the softmax gives them exactly zero and
# renormalises the rest. **top-k** keeps the `k` most likely tokens; **top-p** (nucleus) keeps the smallest set
# of most likely tokens whose mass reaches `p` (a token stays if the mass *before* it is below `p`).

# %% [markdown]
# ### Exercise: top-p
#
# Write `top_p_filter(logits, top_p)`: `logits` is a `(rows, vocab)` tensor, `top_p` a list with one value per
# row. In each row keep the smallest set of most likely tokens whose probability reaches `top_p` and set every
# other logit to `-inf`; leave the kept logits unchanged. Hints: sort each row in descending order
# (`logits.sort(dim=-1, descending=True)` also gives you the order, to put the row back), take the softmax, and
# compare the mass of the tokens *before* each token with `top_p`; `scatter_` puts a sorted row back in
# vocabulary order.
#
# The check runs hand-made rows, then 30 random batches against Hugging Face transformers' `TopPLogitsWarper`
# (an independent implementation), and finally the real engine: its sampler runs with your filter, and the
# tokens it samples (temperature 1, fixed seeds) must be the ones it samples with its own.

# %%
from course import check, exercise


@exercise("12.top_p_filter")
def top_p_filter(logits, top_p):
    # your code here
    raise NotImplementedError


check(top_p_filter)

# %% [markdown]
# minivllm's own version does top-k in the same pass (both keep a prefix of the sorted row), and it sorts only
# the row's 1,024 most likely tokens (`topk`, a partial sort, far less work than sorting all 49,152). An LLM's
# distribution almost always holds `top_p` of its mass inside them; a row whose nucleus runs past them (a flat
# distribution) is decided again on its full sort, so the set is the same:

# %%
# NBVAL_IGNORE_OUTPUT
print(inspect.getsource(apply_top_k_top_p))

# %% [markdown]
# > **How vLLM v1 does it differently.** `vllm/v1/sample/ops/topk_topp_sampler.py` keeps the same
# > sort-and-mask path as its PyTorch fallback, but on a GPU with FlashInfer it samples with FlashInfer's top-k /
# > top-p kernels, which never sort the vocabulary (they draw by rejection against a pivot). It skips the filter
# > when no request uses it, as minivllm does, and keeps per-request parameters as GPU tensors between steps.

# %% [markdown]
# **min-p** (`apply_min_p`, after temperature) scales with the model's confidence: it drops every token less
# likely than `min_p` times the most likely one. The real functions on the real row (a batch of one):

# %%
filtered = {
    "top_k=10": apply_top_k_top_p(logits[None], [10], [1.0])[0],
    "top_p=0.5": apply_top_k_top_p(logits[None], [-1], [0.5])[0],
    "min_p=0.2": apply_min_p(logits[None], [0.2])[0],
}
for name, f in filtered.items():
    kept = torch.isfinite(f)
    print(f"{name:10} keeps {int(kept.sum()):3d} tokens, which held {probs[kept].sum():.3f} of the mass; "
          f"the least likely kept: {label(probs.masked_fill(~kept, 1).argmin())} {probs[kept].min():.4f}")
print(f"min_p=0.2 threshold: 0.2 x {probs.max():.4f} = {0.2 * probs.max():.4f}")

# %%
# NBVAL_IGNORE_OUTPUT
plot_dists(probs, [(name, f.softmax(-1)) for name, f in filtered.items()],
           "Filters drop tokens (red x) and renormalise the rest")

# %% [markdown]
# ## 4. Penalties: presence, frequency, repetition
#
# Penalties make a request less likely to repeat itself, so they need a step in the middle of a generation.
# The model writes a poem greedily (the hook keeps every step's logits) and repeats itself: its fourth line
# is its second line again. We take the step that starts the fourth line.

# %%
poem_prompt = chat_ids("Write a poem about the sea.")
captured.clear()
poem = llm.generate({"prompt_token_ids": poem_prompt}, SamplingParams(temperature=0, max_tokens=38),
                    use_tqdm=False)[0].outputs[0]
steps = [c[0] for c in captured]                          # steps[j]: the logits that chose output token j
lines = poem.text.split("\n")
print(repr(poem.text), "| line 2 == line 4:", lines[1] == lines[3])
j = next(j for j in range(len(steps)) if tokenizer.decode(poem.token_ids[:j]).count("\n") == 3)
so_far = poem.token_ids[:j]
repeats = sum(int(t) in so_far for t in steps[j].topk(30).indices)
print(f"step {j}, after {tokenizer.decode(so_far)[-28:]!r}: the model's choice {label(poem.token_ids[j])} "
      f"starts the repeat; {repeats} of its 30 most likely tokens are already in the output")

# %% [markdown]
# With vLLM's semantics (`minivllm/worker/sampler.py` applies them in vLLM v1's order, on the raw logits):
#
# - `presence_penalty` subtracts a constant from every token that appears in the **output** at least once;
# - `frequency_penalty` subtracts a constant times the number of times it appears in the output;
# - `repetition_penalty` (Hugging Face's) looks at the **prompt and the output**: a positive logit is divided
#   by it, a negative one multiplied, so the token gets less likely either way.
#
# This is the part of `apply_penalties_and_filters` that does it (the part before it handles
# `allowed_token_ids`, `bad_words`, `min_tokens` and `logit_bias` the same batched way):

# %%
# NBVAL_IGNORE_OUTPUT
source = inspect.getsource(apply_penalties_and_filters)
print(source[source.index("    # Penalties."):])

# %%
def penalized(**penalty):
    """The penalties applied to step j's logits, for a request as the engine holds it then."""
    req = Request("poem", poem_prompt, SamplingParams(**penalty))
    for t in so_far:
        req.append_output_token(t)
    return apply_penalties_and_filters(steps[j][None], [req])[0]


raw = steps[j]
penalties = {"presence_penalty=1.0": penalized(presence_penalty=1.0),
             "frequency_penalty=0.5": penalized(frequency_penalty=0.5),
             "repetition_penalty=1.3": penalized(repetition_penalty=1.3)}
out_tokens, seen_tokens = set(so_far), set(so_far) | set(poem_prompt)
for name, pen in penalties.items():
    changed = set((pen != raw).nonzero()[:, 0].tolist())
    print(f"{name:22} changed {len(changed):3d} logits; all in the output: {changed <= out_tokens}, "
          f"in prompt or output: {changed <= seen_tokens}; most likely: {label(raw.argmax())} "
          f"{raw.softmax(-1).max():.2f} -> {label(pen.argmax())} {pen.softmax(-1).max():.2f}")
print(f"the output so far has {len(out_tokens)} distinct tokens; prompt and output together {len(seen_tokens)}")
counts = torch.bincount(torch.tensor(so_far), minlength=VOCAB)
most = counts.argmax()
print(f"frequency: {label(most)} appears {int(counts[most])} times, so its logit drops by "
      f"{raw[most] - penalties['frequency_penalty=0.5'][most]:.2f} = 0.5 x {int(counts[most])}")

# %%
# NBVAL_IGNORE_OUTPUT
top_j = raw.topk(30).indices
plot_dists(raw.softmax(-1), [(name, pen.softmax(-1)) for name, pen in penalties.items()],
           f"Penalties at step {j} of the poem (red labels: tokens the poem already used)", ids=top_j,
           red_labels=out_tokens)

# %% [markdown]
# Presence and frequency touched only the output's tokens, repetition only the prompt's or the output's (the
# chat template's markup included); every other logit is the model's, bit for bit. Repetition *divides* the
# logit, so what a token loses grows with its logit; presence subtracts the same 1.0 from every used token.

# %% [markdown]
# ## 5. The draw: one uniform per row, searched in the cumulative distribution
#
# After the filters the sampler draws one token with probabilities `softmax(logits)` by the **inverse CDF**:
# one `u ~ U[0, 1)` per row, and the first token whose cumulative probability exceeds `u` (`draw_from`: a
# `cumsum` and a `searchsorted`). Token `i` owns the interval `[cdf(i-1), cdf(i))` of length `probs_i`, so `u`
# lands in it with exactly that probability; a token of probability 0 owns an empty interval (the sum runs in
# fp64). A seeded request draws its `u` from its own `torch.Generator`, whatever else is in the batch.
#
# vLLM draws by the **exponential race**, exact too: one `E_i ~ Exp(1)` per token and `argmax(probs_i / E_i)`.
# On a GPU the noise is nearly free; on a CPU it is a vocabulary of random numbers per row from a sequential
# generator, where the inverse CDF needs one.
#
# The empirical check: 2,000 draws of the real `Sampler` at `temperature=0.8, top_p=0.9` on section 1's row,
# against `softmax(apply_top_k_top_p(logits / 0.8))`. The filtering is deterministic, so we filter once and
# give the Sampler the *filtered* rows with the defaults (the same draws: the filter is the Sampler's own).

# %%
DRAWS, T, TOP_P = 2000, 0.8, 0.9
filtered_row = apply_top_k_top_p((logits / T)[None], [-1], [TOP_P])[0]       # (vocab,) -inf outside the nucleus
expected = filtered_row.softmax(-1)                                           # what the draws should follow
draw_req = Request("draw", out.prompt_token_ids, SamplingParams(temperature=1.0))   # unseeded: the Sampler's own
sampler, rows = Sampler(seed=1), filtered_row.expand(500, VOCAB).contiguous()          # 500 rows at a time
draws = torch.tensor([t for _ in range(DRAWS // 500) for t in sampler(rows, [draw_req] * 500)])
observed = torch.bincount(draws, minlength=VOCAB).double() / DRAWS
kept = expected > 0
print(f"top_p={TOP_P} at T={T} keeps {int(kept.sum())} tokens; the draws hit {len(set(draws.tolist()))} "
      f"distinct tokens, {int((~kept[draws]).sum())} of them outside the kept set")

tv = 0.5 * float((observed - expected.double()).abs().sum())
tv_mean = 0.5 * float(((expected * (1 - expected)).double() / DRAWS).sqrt().sum())   # a bound on E[TV]
print(f"total variation between draws and filtered distribution: {tv:.3f} "
      f"(sampling noise alone gives at most {tv_mean:.3f} on average)")

# %%
# NBVAL_IGNORE_OUTPUT
plot_dists(expected, [(f"{DRAWS} draws of the Sampler", observed.float())],
           f"temperature={T}, top_p={TOP_P}: softmax(top-p(logits / T)) in grey, what the Sampler drew in colour",
           ids=expected.topk(30).indices)

# %% [markdown]
# ## 6. Logprobs
#
# `SamplingParams(logprobs=k)` returns, for every output token, `{token_id: Logprob(logprob, rank,
# decoded_token)}` for the sampled token and the `k` most likely. The values are the model's own `log_softmax`,
# taken *before* penalties, temperature and filters (vLLM's default, "raw" logprobs), in one batched call:

# %%
# NBVAL_IGNORE_OUTPUT
print(inspect.getsource(compute_logprobs))

# %% [markdown]
# A real generation at `temperature=0.7` with `logprobs=3`, the hook still recording each step's logits:

# %%
captured.clear()
lp_params = SamplingParams(temperature=0.7, top_p=0.95, seed=3, max_tokens=8, logprobs=3)
sample = llm.generate(PROMPT, lp_params, use_tqdm=False)[0].outputs[0]
for step, (tid, entry) in enumerate(zip(sample.token_ids, sample.logprobs)):
    top3 = "  ".join(f"{lp.decoded_token!r} {lp.logprob:6.3f}" for lp in sorted(entry.values(), key=lambda lp: lp.rank)
                     if lp.rank <= 3)
    print(f"step {step}: {entry[tid].decoded_token!r:10} logprob {entry[tid].logprob:6.3f} rank {entry[tid].rank:2d} "
          f"| top 3: {top3}")
print(f"{sample.text!r}: cumulative_logprob {sample.cumulative_logprob:.3f}")   # 3 decimals: the 4th varies by CPU

# %%
# each value against log_softmax of its step's raw logits, and against log_softmax(logits / 0.7) ("processed")
raw_lp = [c[0].log_softmax(-1) for c in captured]                          # one (vocab,) per step
err = max(abs(lp.logprob - float(raw_lp[s][t])) for s, entry in enumerate(sample.logprobs) for t, lp in entry.items())
tempered = max(abs(entry[t].logprob - float((captured[s][0] / 0.7).log_softmax(-1)[t]))
               for s, (t, entry) in enumerate(zip(sample.token_ids, sample.logprobs)))
rank_ok = all(entry[t].rank == int((raw_lp[s] > raw_lp[s][t]).sum()) + 1
              for s, (t, entry) in enumerate(zip(sample.token_ids, sample.logprobs)))
print(f"largest difference from log_softmax(raw logits): {err:.1e}; from log_softmax(logits / T): {tempered:.2f}; "
      f"ranks = 1 + number of tokens with a higher logprob: {rank_ok}")

# %% [markdown]
# ## 7. Parallel sampling: n samples, one prompt's blocks
#
# `SamplingParams(n=4)` asks for four samples of one prompt. The engine fans the request out into four child
# requests (`minivllm/engine/parallel_sampling.py`, vLLM's `ParentRequest`; ids `0_<id>` ... `3_<id>`, seeds
# `seed + i`). The children have the same prompt, so the prefix cache does the rest: admitted in the same step,
# the later children take the prompt's **full** blocks the first child is computing (lesson 01). Only the
# prompt's last, partial block is each child's own. We drive the engine by hand on a prompt of a few blocks.

# %%
SYSTEM = ("You are a poet of the sea. You answer every request with a short poem of three lines, full of waves, "
          "salt, wind and light, and you never explain the poem afterwards.")
haiku_ids = chat_ids("Write a haiku about the harbour at dawn.", system=SYSTEM)
BS = engine.kv_cache_manager.block_size
n = 4
parent = engine.add_request({"prompt_token_ids": haiku_ids},
                            SamplingParams(n=n, temperature=0.8, seed=0, max_tokens=24), request_id="haiku")
print(f"prompt: {len(haiku_ids)} tokens = {len(haiku_ids) // BS} full blocks of {BS} + {len(haiku_ids) % BS} "
      f"tokens; children: {parent.child_ids}")

kv = engine.kv_cache_manager


def snapshot():
    """The children's block tables, the blocks in use and the ref counts of the children's blocks, now."""
    tabs = {rid: list(r.block_table) for rid, r in engine.requests.items()}
    refs = {b: kv.block_pool.blocks[b].ref_count for t in tabs.values() for b in t}
    return tabs, kv.num_blocks - kv.num_free_blocks, refs


children = {}                                  # sample index -> its latest CompletionOutput
with engine.record_traces() as traces:
    engine.step()                              # step 1: the prefill of all four children
snapshots, step = {1: snapshot()}, 1
while engine.has_unfinished_requests():
    children.update({c.index: c for o in engine.step() for c in o.outputs})
    step += 1
    snapshots.update({20: snapshot()} if step == 20 else {})
print("\n".join(f"sample {i}: {c.text!r}" for i, c in sorted(children.items())))

# %%
prompt_blocks = -(-len(haiku_ids) // BS)
for step, (tabs, used, refs) in snapshots.items():
    shared = sorted(set.intersection(*(set(t) for t in tabs.values())))
    print(f"after step {step}: {tabs}; shared by all {n}: {shared} (ref counts {[refs[b] for b in shared]}); "
          f"blocks in use: {used}")
first_tables, first_used, _ = snapshots[1]
print(f"{n} separate requests would hold {n} x {prompt_blocks} = {n * prompt_blocks} blocks after their prefill; "
      f"the {n} children held {first_used}")
print(f"prompt tokens computed in step 1: {traces[0].num_prefill_tokens} for {n} x {len(haiku_ids)}; "
      f"taken from the prefix cache: {[r.num_cached_tokens for r in traces[0].requests]}")

# %% [markdown]
# The prompt's three full blocks (7, 8, 9) are in all four block tables, with ref count 4: one copy in memory.
# The first child computed them; the other three found them in the prefix cache in the same step and computed
# only the 14 tokens of the prompt's last block, each its own: 62 + 3 x 14 = 104 prompt tokens instead of
# 4 x 62 = 248. The picture: one row per child, one cell per block table entry (the physical block id).

# %%
# NBVAL_IGNORE_OUTPUT
CHILD_COLORS = ["tab:blue", "tab:orange", "tab:green", "tab:red"]     # neighbouring rows differ clearly
fig, axes = plt.subplots(1, 2, figsize=(11, 2.9))
for ax, (step, (tabs, used, refs)) in zip(axes, snapshots.items()):
    draw_shared_tables(ax, tabs, f"block tables after step {step} ({used} blocks in use)", CHILD_COLORS)
fig.legend(handles=[Patch(color="#5a5a5a", label=f"shared prompt block (ref count {n})")]
           + [Patch(color=c, alpha=0.75, label=f"own block of sample {i}") for i, c in enumerate(CHILD_COLORS)],
           loc="lower center", ncol=5, fontsize=8, frameon=False)
fig.suptitle(f"n={n}: the prompt's full blocks are computed once and shared", fontsize=11)
fig.tight_layout(rect=(0, 0.08, 1, 1))
plt.show()

# %% [markdown]
# ## 8. Incremental detokenization: a character over several tokens
#
# SmolLM2's tokenizer is byte-level BPE: a token is a sequence of **bytes**, not characters. A character
# outside ASCII is two to four UTF-8 bytes, and a rare one can be split over several tokens. Asked to
# translate "sea" into Chinese, the model answers with (wrong, but real) Chinese characters, three tokens each:

# %%
captured.clear()
zh = llm.generate({"prompt_token_ids": chat_ids("Translate 'sea' into Chinese.")},
                  SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0].outputs[0]
zh_ids = zh.token_ids
print("tokens:", zh_ids, "| byte-level symbols:", tokenizer.convert_ids_to_tokens(zh_ids))
print("each token decoded alone:", [tokenizer.decode([t]) for t in zh_ids], "| decoded together:",
      repr(tokenizer.decode(zh_ids)), "| its first character's UTF-8 bytes:", tokenizer.decode(zh_ids)[0].encode())

# %% [markdown]
# Decoded alone, each of the first six tokens is an incomplete UTF-8 sequence, and the decoder writes
# `'\ufffd'` (`�`, the replacement character) for it. A streaming server that sent each token's own text
# would send `���` where the user should see `水`. `detokenize_incrementally` decodes a short window twice,
# without and with the new tokens, emits the difference, and emits nothing while the text ends in `'\ufffd'`:

# %%
# NBVAL_IGNORE_OUTPUT
print(inspect.getsource(detokenize_incrementally))

# %% [markdown]
# Fed one token at a time, as the output processor does after every step:

# %%
state, pieces = DetokState(), []
for k in range(1, len(zh_ids) + 1):
    new, state = detokenize_incrementally(tokenizer, zh_ids[:k], state)
    pieces.append(new)
    print(f"token {zh_ids[k - 1]:5d} alone {tokenizer.decode([zh_ids[k - 1]])!r:6} -> emits {new!r:8} "
          f"state (prefix_offset={state.prefix_offset}, read_offset={state.read_offset})")
print("joined:", repr("".join(pieces)))

# %% [markdown]
# While a character is incomplete, the state does not move, so the next call decodes the held-back bytes again
# with the new token. The same request through the engine with `output_kind=DELTA` (what a streaming server
# uses) comes back as one output per token, its deltas exactly the pieces above. (Two decodes per request per
# step are host work, lesson 11: the output processor calls the Rust tokenizer's own `decode` directly,
# `fast_decoder`, wherever its text is the same.)

# %%
deltas = []
engine.add_request({"prompt_token_ids": chat_ids("Translate 'sea' into Chinese.")},
                   SamplingParams(temperature=0, max_tokens=8, output_kind=RequestOutputKind.DELTA), request_id="zh")
while engine.has_unfinished_requests():
    deltas += [(o.outputs[0].token_ids, o.outputs[0].text) for o in engine.step()]
print(deltas)

# %% [markdown]
# ## 9. Structured output: a grammar's mask over the vocabulary
#
# `SamplingParams(structured_outputs=StructuredOutputsParams(...))` (vLLM's names: `json=` a JSON schema,
# `regex=`, `choice=[...]`, `grammar=` EBNF or Lark, `json_object=True`) forces the text into a language. The
# engine never samples a token and then checks it; it masks the logits first. `minivllm/core/structured_output.py`
# compiles the constraint with [xgrammar](https://xgrammar.mlc.ai) when the request is added and keeps one
# matcher per request, moved forward with every committed token. Every step the matcher says which tokens may
# come next, as a **bitmask** (one bit per token, 32 to an `int32` word), which the executor applies to the
# logits before logprobs, penalties and sampling:

# %%
# NBVAL_IGNORE_OUTPUT
print(inspect.getsource(StructuredOutputManager.grammar_bitmask))
print(inspect.getsource(apply_grammar_bitmask))

# %% [markdown]
# To see the masks, we wrap this engine's `grammar_bitmask` to record what it returns at each step, while the
# `lm_head` hook keeps recording the raw logits. First a choice between two words, on a real review:

# %%
manager = engine.structured_output_manager
masks = []                        # one (rows, ceil(vocab / 32)) int32 bitmask per step, None without a grammar
fill_bitmask = manager.grammar_bitmask


def recording_bitmask(requests, drafts=None):      # drafts: speculative decoding's (none here)
    bitmask = fill_bitmask(requests, drafts)
    masks.append(None if bitmask is None else bitmask.clone())
    return bitmask


manager.grammar_bitmask = recording_bitmask
review_ids = chat_ids("Is this review positive or negative? 'The soup was cold and the waiter was rude.'")


def constrained(structured):
    """Generate greedily under a constraint; the output, the raw logits and the bitmask of every step."""
    captured.clear()
    masks.clear()
    params = SamplingParams(temperature=0, max_tokens=32, structured_outputs=structured)
    output = llm.generate({"prompt_token_ids": review_ids}, params, use_tqdm=False)[0].outputs[0]
    return output, [c[0] for c in captured], [m[0] for m in masks]


choice, choice_logits, choice_masks = constrained(StructuredOutputsParams(choice=["positive", "negative"]))
print(f"text {choice.text!r}, tokens {choice.token_ids}, finish reason {choice.finish_reason}")
review_probs = choice_logits[0].softmax(-1)                                   # the model, unconstrained
masked = apply_grammar_bitmask(choice_logits[0][None], choice_masks[0][None])[0]   # what the sampler saw
allowed = torch.isfinite(masked).nonzero()[:, 0]
masked_probs = masked.softmax(-1)
print(f"step 0: bitmask {tuple(choice_masks[0].shape)} {choice_masks[0].dtype}, {int(allowed.numel())} of "
      f"{VOCAB:,} tokens allowed: {[tokenizer.decode([t]) for t in allowed.tolist()]}")
per_step = [int(torch.isfinite(apply_grammar_bitmask(l[None], m[None])).sum())
            for l, m in zip(choice_logits, choice_masks)]                         # allowed tokens at each step
print(f"the model, unconstrained: {label(review_probs.argmax())} {review_probs.max():.3f}; the allowed tokens "
      f"held {review_probs[allowed].sum():.4f} of its probability; allowed at each step: {per_step}")
del manager.grammar_bitmask                   # the engine's own method again, unwrapped

# %% [markdown]
# Unconstrained, the model would start a sentence. The grammar allows only the tokens that begin one of the two
# words (whole words and their prefixes: a byte-level vocabulary can spell a word in several ways), and among
# those the model's own preferences decide, renormalised. Once a word is written the language is complete,
# and the only token left is the end of sequence. A JSON schema (`json=schema`) works the same way: its mask
# is wide where the schema leaves a choice (any whitespace between tokens) and one token where it does not.

# %%
# NBVAL_IGNORE_OUTPUT
plot_dists(review_probs, [(f"after the mask: {len(allowed)} tokens allowed", masked_probs)],
           'choice=["positive", "negative"]: the grammar\'s bitmask at the first step',
           ids=torch.tensor(list(dict.fromkeys(review_probs.topk(15).indices.tolist() + allowed.tolist()))))

# %% [markdown]
# ## Check yourself
#
# Run this cell: it replays each section's claim, most of them on fresh data.

# %%
row = steps[5]                                             # another real step of the poem
for k in (1, 7, 50):
    assert int(torch.isfinite(apply_top_k_top_p(row[None], [k], [1.0])).sum()) == k, "top-k keeps exactly k"
p_sorted = row.softmax(-1).sort(descending=True).values
for p in (0.3, 0.8, 0.95):
    kept_n = int(torch.isfinite(apply_top_k_top_p(row[None], [-1], [p])).sum())
    assert p_sorted[:kept_n].sum() >= p - 1e-6 and p_sorted[:kept_n - 1].sum() < p, "top-p: smallest set >= p"
for name, pen in penalties.items():
    changed = set((pen != raw).nonzero()[:, 0].tolist())
    assert changed and changed <= (seen_tokens if name.startswith("repetition") else out_tokens), name
assert torch.allclose(raw - penalties["frequency_penalty=0.5"], 0.5 * counts.float()), "frequency: -0.5 x count"
assert bool(kept[draws].all()) and tv < 3 * tv_mean, "the draws follow the filtered distribution"
assert err < 1e-4 and tempered > 0.01 and rank_ok, "logprobs are the raw log_softmax"
shared = sorted(set.intersection(*(set(t) for t in first_tables.values())))
assert len(shared) == len(haiku_ids) // BS and first_used == len(shared) + n, "children share the prompt's blocks"
assert traces[0].num_prefill_tokens == len(haiku_ids) + (n - 1) * (len(haiku_ids) % BS), "the prompt computed once"
for ids_ in (zh_ids, tokenizer.encode("Waves 🌊 and 海 at dawn", add_special_tokens=False)):
    st, text = DetokState(), ""
    for k in range(1, len(ids_) + 1):
        new, st = detokenize_incrementally(tokenizer, ids_[:k], st)
        assert "\ufffd" not in new, "the detokenizer emitted a replacement character"
        text += new
    assert text == tokenizer.decode(ids_), "incremental text differs from decoding the whole sequence"
assert "".join(d for _, d in deltas) == tokenizer.decode(zh_ids), "the engine's deltas add up to the text"
bits = [int(choice_masks[0][t // 32]) >> (t % 32) & 1 for t in range(VOCAB)]   # the bitmask read bit by bit
assert [t for t in range(VOCAB) if bits[t]] == allowed.tolist(), "apply_grammar_bitmask reads the bits as xgrammar"
assert choice.token_ids == [int(apply_grammar_bitmask(l[None], m[None]).argmax())
                            for l, m in zip(choice_logits, choice_masks)], "greedy under a grammar: masked argmax"
print("all checks passed")
