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
# token id ──> incremental detokenization ──> text    engine/detokenizer.py  detokenize_incrementally
# ```
#
# We take the real logits of the real default model, run the real functions on them, and look at what each
# one does. Then: logprobs, parallel sampling's shared blocks, a character split over several tokens, and a
# grammar's mask over the vocabulary. The code of each function is printed from the installed module
# (`inspect.getsource`), so what you read is what runs. (Those cells are not compared by the lesson's test,
# `# NBVAL_IGNORE_OUTPUT`: the code may change; what it does to the numbers below is what the test checks.)

# %%
import warnings

warnings.filterwarnings("ignore", message="IProgress not found")   # tqdm's notice when ipywidgets is absent

import inspect
import json

import matplotlib.pyplot as plt
import torch
from matplotlib.patches import Patch, Rectangle

from minivllm import LLM, SamplingParams, StructuredOutputsParams
from minivllm.core.request import Request
from minivllm.core.sampling_params import RequestOutputKind
from minivllm.core.structured_output import StructuredOutputManager
from minivllm.engine.detokenizer import DetokState, detokenize_incrementally
import minivllm.worker.logprobs as logprobs_module
from minivllm.worker.logprobs import compute_logprobs
from minivllm.worker.sampler import (Sampler, apply_grammar_bitmask, apply_min_p, apply_penalties_and_filters,
                                     apply_top_k_top_p)

torch.manual_seed(0)
torch.set_num_threads(1)   # one thread: faster on a busy 2-core CPU, and the same float sums everywhere

# %% [markdown]
# ## 1. The logits of one step
#
# `LLM()` loads the embedded SmolLM2-135M-Instruct (fp32 on a CPU). To see the logits the sampler gets, we
# hook the model's last layer, `lm_head`: `compute_logits` returns its output, one row per request that
# samples this step, and the executor hands that row to the sampler. A forward hook copies it on its way out;
# the engine runs unchanged.

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
      f"{captured[0].dtype}")
print("greedy next token:", repr(out.outputs[0].text))
top = probs.topk(8)
print("most likely:", ", ".join(f"{tokenizer.decode([i])!r} {p:.3f}" for p, i in zip(top.values.tolist(),
                                                                                      top.indices.tolist())))
entropy = -(probs * probs.clamp_min(1e-30).log2()).sum()
n90 = int((probs.sort(descending=True).values.cumsum(0) < 0.9).sum()) + 1
print(f"entropy {entropy:.2f} bits; the {n90} most likely tokens hold 90% of the probability")

# %% [markdown]
# A flat distribution: after "found a" many nouns and adjectives are plausible, and the most likely token has
# barely a tenth of the mass. Greedy decoding (`temperature=0`) would always take ` small`; sampling picks one
# at random with these probabilities, after the transformations below. To see them we draw the 30 most
# likely tokens as bars, labelled with their decoded text (`␣` is a leading space: most words in a byte-level
# BPE vocabulary come with the space before them).

# %%
TOP30 = probs.topk(30).indices                              # the x axis of every distribution plot below


def label(t):
    return repr(tokenizer.decode([int(t)]).replace(" ", "␣"))[1:-1]


def plot_dists(before, panels, title, ids=TOP30, red_labels=()):
    """Bars of the `ids` tokens: `before` probabilities in grey, each panel's `after` in colour; a token the
    transformation removed (probability 0) gets a red x. panels: [(title, after probabilities)];
    red_labels: token ids whose x label is drawn in red."""
    fig, axes = plt.subplots(len(panels), 1, figsize=(11, 2.3 * len(panels) + 0.6), sharex=True, squeeze=False)
    x = torch.arange(len(ids))
    for ax, (name, after), color in zip(axes[:, 0], panels, ["tab:blue", "tab:orange", "tab:green", "tab:purple"]):
        ax.bar(x - 0.2, before[ids], width=0.4, color="#b0b0b0", label="before")
        ax.bar(x + 0.2, after[ids], width=0.4, color=color, label="after")
        gone = (after[ids] == 0).nonzero()[:, 0]
        if len(gone):
            ax.plot(gone + 0.2, torch.zeros(len(gone)), "x", color="tab:red", ms=6, label="removed")
        ax.set_title(name, fontsize=10, loc="left")
        ax.set_ylabel("probability")
        ax.legend(fontsize=8, loc="upper right", ncol=3)
    axes[-1, 0].set_xticks(x, [label(t) for t in ids], rotation=60, ha="right", fontsize=9)
    for tick, t in zip(axes[-1, 0].get_xticklabels(), ids.tolist()):
        if t in red_labels:
            tick.set_color("tab:red")
    fig.suptitle(title)
    fig.tight_layout()
    plt.show()


# %%
# NBVAL_IGNORE_OUTPUT
fig, ax = plt.subplots(figsize=(11, 2.8))
ax.bar(range(30), probs[TOP30], color="tab:blue")
ax.set_xticks(range(30), [label(t) for t in TOP30], rotation=60, ha="right", fontsize=9)
ax.set_ylabel("probability")
ax.set_title(f"The next token after {PROMPT!r}: the 30 most likely of {VOCAB:,} "
             f"(together {probs[TOP30].sum():.2f} of the mass)")
fig.tight_layout()
plt.show()

# %% [markdown]
# ## 2. The sampler, and temperature
#
# Here is the whole `Sampler.sample`: it gets the batch's logits and the requests, one row each, and
# returns one token id per row, as a tensor where the logits are (`Sampler.__call__` returns them as a list;
# async scheduling, lesson 11, keeps them on the GPU as the next batch's inputs). Penalties and filters first (section 4), then greedy rows are done; the others
# are divided by their temperature, cut by min-p, top-k and top-p, and drawn (section 5).

# %%
# NBVAL_IGNORE_OUTPUT
print(inspect.getsource(Sampler.sample))

# %% [markdown]
# **Temperature** divides the logits before the softmax: `softmax(logits / T)`. Below 1 it sharpens the
# distribution (the likely get likelier; `T -> 0` is the argmax, which is why `temperature=0` means greedy),
# above 1 it flattens it. It removes no token and keeps their order: `exp` of a finite logit is positive (in
# fp32 a very unlikely token could still underflow to 0 at a very low temperature; not at these).

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
# renormalises the rest. Both sort-based ones live in one function, as in vLLM:
#
# - **top-k** keeps the `k` most likely tokens;
# - **top-p** (nucleus) keeps the smallest set of most likely tokens whose mass reaches `p`: a token stays if
#   the mass of the tokens *before* it is below `p`, so the most likely token always stays.

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
# the row's 1,024 most likely tokens (`topk`, a partial sort: about 9 ms for 32 rows here, against 67 ms for
# sorting all 49,152). An LLM's distribution almost always holds `top_p` of its mass inside them; a row whose
# nucleus runs past them (a flat distribution) is decided again on its full sort, so the set is the same:

# %%
# NBVAL_IGNORE_OUTPUT
print(inspect.getsource(apply_top_k_top_p))

# %% [markdown]
# > **How vLLM v1 does it differently.** `vllm/v1/sample/ops/topk_topp_sampler.py` (`TopKTopPSampler`) keeps
# > the same sort-and-mask path as its PyTorch fallback (it sorts ascending and drops the tail whose mass is at
# > most `1 - p`, which keeps the same set), but on a GPU with FlashInfer installed it samples with FlashInfer's
# > top-k / top-p kernels, which never sort the vocabulary: they draw by rejection against a pivot
# > probability. When no request in the batch uses top-k or top-p it skips the filter altogether, as minivllm
# > does. Its sampler (`vllm/v1/sample/sampler.py`) also works on the whole persistent batch at once, with the
# > per-request parameters kept as GPU tensors between steps rather than rebuilt from Python lists.

# %% [markdown]
# **min-p** scales with the model's confidence: it drops every token less likely than `min_p` times the most
# likely one. A confident step keeps few tokens, a flat one keeps many. It runs after temperature.

# %%
# NBVAL_IGNORE_OUTPUT
print(inspect.getsource(apply_min_p))

# %% [markdown]
# The real functions on the real row (batched functions: a row is a batch of one, `logits[None]`):

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
# Penalties make a request less likely to repeat itself. They look at tokens the request already has, so
# they need a step in the middle of a generation. We let the model write a poem greedily and keep the logits
# of every step (the hook sees one row per step). Small greedy models love to repeat themselves, and this one
# does: its fourth line is its second line again. We take the step that starts the fourth line.

# %%
poem_prompt = chat_ids("Write a poem about the sea.")
captured.clear()
poem = llm.generate({"prompt_token_ids": poem_prompt}, SamplingParams(temperature=0, max_tokens=38),
                    use_tqdm=False)[0].outputs[0]
steps = [c[0] for c in captured]                          # steps[j]: the logits that chose output token j
print(repr(poem.text))


lines = poem.text.split("\n")
print("line 2 == line 4:", lines[1] == lines[3])
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

# %% [markdown]
# The function reads the request, so we build one by hand, as the engine holds it at step `j`: the poem's
# prompt, the tokens generated so far, and the penalty in its `SamplingParams`.


# %%
def penalized(**penalty):
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
# The presence and frequency penalties touched only the output's tokens, the repetition penalty only tokens
# of the prompt or the output (the chat template's markup included); every other logit is bit for bit what the
# model produced. Tokens the poem has not used yet gain probability only through the renormalisation.
#
# The repetition penalty hit hardest, although 1.3 looks mild: it *divides* the logit, so what a token
# loses grows with its logit, where the presence penalty subtracts the same 1.0 from every used token:

# %%
A = poem.token_ids[j]
for name, pen in penalties.items():
    print(f"{name:22} logit of {label(A)}: {raw[A]:6.2f} -> {pen[A]:6.2f} (-{raw[A] - pen[A]:.2f}), "
          f"probability {raw.softmax(-1)[A]:.3f} -> {pen.softmax(-1)[A]:.3f}")
#
# ## 5. The draw: one uniform per row, searched in the cumulative distribution
#
# After the filters, `probs = softmax(logits)` and the sampler needs one token drawn with these
# probabilities. It uses the **inverse CDF**, the textbook method: draw one `u ~ U[0, 1)` per row and take the
# first token whose cumulative probability exceeds `u` (`draw_from`: a `cumsum` and a `searchsorted`). It is
# exact: token `i` owns the interval `[cdf(i-1), cdf(i))`, whose length is `probs_i`, and `u` lands in it
# with exactly that probability. A token of probability 0 owns an empty interval, so it is never drawn (the
# sum runs in fp64, where adding 0 changes nothing). A seeded request draws its `u` from its own
# `torch.Generator`, so its tokens do not depend on what else is in the batch.
#
# vLLM draws differently, by the **exponential race**: one `E_i ~ Exp(1)` per token and `argmax(probs_i /
# E_i)`, exact too (`E_i / probs_i` is exponential with rate `probs_i`, and the smallest of independent
# exponentials is token `i` with probability `probs_i`). On a GPU the noise is nearly free. On a CPU it is a
# vocabulary of random numbers per row, and minivllm drew it that way until this was measured: the cell below
# times both draws for a batch of 32 rows.

# %%
# NBVAL_IGNORE_OUTPUT
import time
from minivllm.worker.sampler import draw_from
probs32 = logits.softmax(-1).expand(32, VOCAB).contiguous()
g = torch.Generator().manual_seed(0)

def best_ms(fn, reps=5):
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * min(times)

race_ms = best_ms(lambda: (probs32 / torch.empty_like(probs32).exponential_(generator=g)).argmax(-1))
icdf_ms = best_ms(lambda: draw_from(probs32, torch.rand(32, dtype=torch.float64, generator=g)))
print(f"32 rows x {VOCAB} tokens: exponential race {race_ms:.1f} ms, inverse CDF {icdf_ms:.1f} ms")

# %% [markdown]
# On the 2-core machine this lesson was written on it printed about 37 ms against 11 ms on this lesson's one
# thread; with two threads, once the 12 MB of the fp64 sum is memory the allocator reuses, the inverse CDF took
# 1.5 ms and the race 40 ms: 40 ms of a 105 ms decode step spent generating noise, one core at a time
# (PyTorch's CPU generator is sequential). It
# did not show offline, where benchmarks decode greedily, but every request a server gets without a
# `temperature` samples (the OpenAI default is 1): served online to `vllm bench serve`, which sends none, the
# inverse CDF brought the inter-token latency (p50) from about 215 ms down to about 170 ms.
#
# The empirical check: 2,000 draws from the real `Sampler` at `temperature=0.8, top_p=0.9` on the row of
# section 1, against the distribution the filters say it should follow, `softmax(apply_top_k_top_p(logits /
# 0.8))`. The filter costs more on a CPU than the draw (a partial sort of every row), so we split the work
# where the Sampler itself splits it: the filtering is deterministic, only the draw is random. We filter
# once, then give the Sampler 2,000 rows of the *filtered* logits with `temperature=1.0` and no top-p, so that
# it only draws. First, on 100 rows, the proof that this split changes nothing: a Sampler with the same seed
# draws the very same tokens from the raw logits with `temperature=0.8, top_p=0.9` as from the filtered logits
# with the defaults.

# %%
DRAWS, T, TOP_P = 2000, 0.8, 0.9
filtered_row = apply_top_k_top_p((logits / T)[None], [-1], [TOP_P])[0]       # (vocab,) -inf outside the nucleus
expected = filtered_row.softmax(-1)                                           # what the draws should follow
raw_req = Request("draw", out.prompt_token_ids, SamplingParams(temperature=T, top_p=TOP_P))   # unseeded: the
draw_req = Request("draw", out.prompt_token_ids, SamplingParams(temperature=1.0))           # Sampler's generator
same = (Sampler(seed=0)(logits.expand(100, VOCAB).contiguous(), [raw_req] * 100)
        == Sampler(seed=0)(filtered_row.expand(100, VOCAB).contiguous(), [draw_req] * 100))
print("same 100 tokens whether the Sampler filters or we filtered first:", same)

sampler = Sampler(seed=1)
draws = []
for _ in range(DRAWS // 500):
    draws += sampler(filtered_row.expand(500, VOCAB).contiguous(), [draw_req] * 500)
draws = torch.tensor(draws)
observed = torch.bincount(draws, minlength=VOCAB).double() / DRAWS
kept = expected > 0
print(f"top_p={TOP_P} at T={T} keeps {int(kept.sum())} tokens; the draws hit {len(set(draws.tolist()))} "
      f"distinct tokens, {int((~kept[draws]).sum())} of them outside the kept set")

# chi-square: bins of tokens expected >= 5 times, the rest of the kept set merged into one bin
e_counts, o_counts = expected.double() * DRAWS, observed * DRAWS
big = e_counts >= 5
bins_e = torch.cat([e_counts[big], e_counts[kept & ~big].sum()[None]])
bins_o = torch.cat([o_counts[big], o_counts[kept & ~big].sum()[None]])
chi2 = float(((bins_o - bins_e) ** 2 / bins_e).sum())
dof = len(bins_e) - 1
p_value = float(torch.special.gammaincc(torch.tensor(dof / 2.0), torch.tensor(chi2 / 2.0)))   # P(chi2_dof > chi2)
tv = 0.5 * float((observed - expected.double()).abs().sum())
tv_mean = 0.5 * float(((expected * (1 - expected)).double() / DRAWS).sqrt().sum())   # a bound on E[TV]
print(f"chi-square {chi2:.1f} on {dof} degrees of freedom: p = {p_value:.2f}")
print(f"total variation between draws and filtered distribution: {tv:.3f} "
      f"(sampling noise alone gives at most {tv_mean:.3f} on average)")

# %%
# NBVAL_IGNORE_OUTPUT
fig, ax = plt.subplots(figsize=(11, 2.8))
ids = expected.topk(30).indices
ax.bar(torch.arange(30) - 0.2, expected[ids], width=0.4, color="#b0b0b0", label="softmax(top-p(logits / T))")
ax.bar(torch.arange(30) + 0.2, observed[ids], width=0.4, color="tab:blue", label=f"{DRAWS} draws of the Sampler")
ax.set_xticks(range(30), [label(t) for t in ids], rotation=60, ha="right", fontsize=9)
ax.set_ylabel("probability")
ax.legend(fontsize=8)
ax.set_title(f"temperature={T}, top_p={TOP_P}: what the Sampler drew vs what it should draw")
fig.tight_layout()
plt.show()

# %% [markdown]
# ## 6. Logprobs
#
# `SamplingParams(logprobs=k)` returns, for every output token, a dict `{token_id: Logprob(logprob, rank,
# decoded_token)}`: the sampled token and the `k` most likely ones. The values are the model's own
# `log_softmax` of the logits, taken *before* penalties, temperature and the filters (vLLM's default, "raw"
# logprobs): they say what the model predicted, not what the sampler did with it. The executor computes them
# for the rows that ask, in one batched call:

# %%
# NBVAL_IGNORE_OUTPUT
print(logprobs_module.__doc__)
print(inspect.getsource(compute_logprobs))

# %% [markdown]
# A real generation at `temperature=0.7` with `logprobs=3`, with the hook still recording the logits of each
# step:

# %%
captured.clear()
lp_params = SamplingParams(temperature=0.7, top_p=0.95, seed=3, max_tokens=8, logprobs=3)
sample = llm.generate(PROMPT, lp_params, use_tqdm=False)[0].outputs[0]
print(repr(sample.text))
for step, (tid, entry) in enumerate(zip(sample.token_ids, sample.logprobs)):
    chosen = entry[tid]
    top3 = "  ".join(f"{lp.decoded_token!r} {lp.logprob:6.3f}" for lp in sorted(entry.values(), key=lambda lp: lp.rank)
                     if lp.rank <= 3)
    print(f"step {step}: {chosen.decoded_token!r:10} logprob {chosen.logprob:6.3f} rank {chosen.rank:2d} | "
          f"top 3: {top3}")
print(f"cumulative_logprob {sample.cumulative_logprob:.3f}")               # 3 decimals: the 4th differs between CPUs

# %% [markdown]
# The check: each value against `log_softmax` of the captured raw logits of its step, computed here. And
# against `log_softmax(logits / 0.7)`, what a "processed" logprob would be, to see that they are not that.

# %%
raw_lp = [c[0].log_softmax(-1) for c in captured]                          # one (vocab,) per step
err = max(abs(lp.logprob - float(raw_lp[s][t])) for s, entry in enumerate(sample.logprobs) for t, lp in entry.items())
tempered = max(abs(entry[t].logprob - float((captured[s][0] / 0.7).log_softmax(-1)[t]))
               for s, (t, entry) in enumerate(zip(sample.token_ids, sample.logprobs)))
rank_ok = all(entry[t].rank == int((raw_lp[s] > raw_lp[s][t]).sum()) + 1
              for s, (t, entry) in enumerate(zip(sample.token_ids, sample.logprobs)))
print(f"largest difference from log_softmax(raw logits): {err:.1e}")
print(f"largest difference from log_softmax(logits / T): {tempered:.2f}")
print("ranks = 1 + number of tokens with a higher logprob:", rank_ok)
print(f"sum of the sampled tokens' logprobs {sum(e[t].logprob for t, e in zip(sample.token_ids, sample.logprobs)):.3f}")

# %% [markdown]
# ## 7. Parallel sampling: n samples, one prompt's blocks
#
# `SamplingParams(n=4)` asks for four samples of one prompt. The engine fans the request out into four child
# requests (`minivllm/engine/parallel_sampling.py`, vLLM's `ParentRequest`; ids `0_<id>` ... `3_<id>`, seeds
# `seed + i`). The children have the same prompt, so the prefix cache does the rest: admitted in the same step,
# the later children take the prompt's **full** blocks the first child is computing (lesson 01). Only the
# prompt's last, partial block is each child's own: the children write different tokens into it.
#
# We drive the engine by hand, with a prompt of a few blocks (a system prompt and a question), and look at the
# block tables the KV cache manager gave the children.

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
snapshots = {1: snapshot()}
for step in range(2, 21):
    for o in engine.step():
        children.update({c.index: c for c in o.outputs})
snapshots[20] = snapshot()
while engine.has_unfinished_requests():
    for o in engine.step():
        children.update({c.index: c for c in o.outputs})
for i, c in sorted(children.items()):
    print(f"sample {i}: {c.text!r}")

# %%
prompt_blocks = -(-len(haiku_ids) // BS)
for step, (tabs, used, refs) in snapshots.items():
    shared = sorted(set.intersection(*(set(t) for t in tabs.values())))
    print(f"after step {step}:")
    for rid, t in tabs.items():
        print(f"  {rid}: block table {t}")
    print(f"  shared by all {n}: {shared} (ref counts {[refs[b] for b in shared]}); blocks in use: {used}")
first_tables, first_used, _ = snapshots[1]
print(f"{n} separate requests would hold {n} x {prompt_blocks} = {n * prompt_blocks} blocks after their prefill; "
      f"the {n} children held {first_used}")
print(f"prompt tokens computed in step 1: {traces[0].num_prefill_tokens} for {n} x {len(haiku_ids)}; "
      f"taken from the prefix cache: {[r.num_cached_tokens for r in traces[0].requests]}")

# %% [markdown]
# The prompt's three full blocks (7, 8, 9) are in all four block tables, with ref count 4: one copy in
# memory. The first child computed them; the other three found them in the prefix cache in the same step and
# computed only the 14 tokens of the prompt's last block, which each child holds on its own (it will fill it
# with its own tokens): 62 + 3 x 14 = 104 prompt tokens computed instead of 4 x 62 = 248. From then on every
# child decodes on its own and takes a new block every 16 tokens.
#
# The picture: one row per child, one cell per entry of its block table, with the physical block id. The
# shared blocks appear in every row but are one block each in memory; each child's own blocks have its
# colour.

# %%
# NBVAL_IGNORE_OUTPUT
CHILD_COLORS = ["tab:blue", "tab:orange", "tab:green", "tab:red"]     # neighbouring rows differ clearly
fig, axes = plt.subplots(1, 2, figsize=(11, 2.9))
for ax, (step, (tabs, used, refs)) in zip(axes, snapshots.items()):
    common = set.intersection(*(set(t) for t in tabs.values()))
    for row, (rid, table) in enumerate(tabs.items()):
        y = len(tabs) - 1 - row
        for col, b in enumerate(table):
            face = "#5a5a5a" if b in common else CHILD_COLORS[row % len(CHILD_COLORS)]
            ax.add_patch(Rectangle((col, y), 0.92, 0.85, color=face, alpha=0.9 if b in common else 0.75))
            ax.text(col + 0.46, y + 0.42, str(b), ha="center", va="center", fontsize=10,
                    color="white", fontweight="bold")
        ax.text(-0.15, y + 0.42, rid, ha="right", va="center", fontsize=9)
    width = max(len(t) for t in tabs.values())
    ax.set_xlim(-1.4, width)
    ax.set_ylim(-0.1, len(tabs))
    ax.axis("off")
    ax.set_title(f"block tables after step {step} ({used} blocks in use)", fontsize=10)
fig.legend(handles=[Patch(color="#5a5a5a", label=f"shared prompt block (ref count {n})")]
           + [Patch(color=c, alpha=0.75, label=f"own block of sample {i}") for i, c in enumerate(CHILD_COLORS)],
           loc="lower center", ncol=5, fontsize=8, frameon=False)
fig.suptitle(f"n={n}: the prompt's full blocks are computed once and shared", fontsize=11)
fig.tight_layout(rect=(0, 0.08, 1, 1))
plt.show()

# %% [markdown]
# ## 8. Incremental detokenization: a character over several tokens
#
# SmolLM2's tokenizer is byte-level BPE: a token is a sequence of **bytes**, not of characters. Common words
# are one token, but a character outside ASCII is two to four UTF-8 bytes, and a rare one (most CJK
# characters, most emoji) can be split over several tokens. Asked to translate "sea" into Chinese, the
# model answers with (wrong, but real) Chinese characters, three bytes and three tokens each:

# %%
captured.clear()
zh = llm.generate({"prompt_token_ids": chat_ids("Translate 'sea' into Chinese.")},
                  SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0].outputs[0]
zh_ids = zh.token_ids
print("tokens:", zh_ids)
print("byte-level symbols:", tokenizer.convert_ids_to_tokens(zh_ids))
print("each token decoded alone:", [tokenizer.decode([t]) for t in zh_ids])
print("decoded together:", repr(tokenizer.decode(zh_ids)))
print("the UTF-8 bytes of its first character:", tokenizer.decode(zh_ids)[0].encode())

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
# While a character is incomplete, the state does not move (`read_offset` stays at the last token that
# completed text), so the next call decodes the held-back bytes again together with the new token. The engine
# does this for every request after every step. The same request, stepped by hand with
# `output_kind=DELTA` (what a streaming server uses), comes back as one output per token, and its deltas are
# exactly the pieces above: empty while a character is incomplete, the whole character when it is done.
#
# Two decodes per request per step add up: at batch 256 transformers' `tokenizer.decode` spent 2.5 of its
# 3.4 us a call in Python around the Rust tokenizer. The output processor therefore decodes through
# `fast_decoder(tokenizer)`, the Rust tokenizer's own `decode`, wherever its text is the same (no space clean-up,
# no model-specific decode): 1.8 instead of 3.2 ms of a step at batch 256, time a GPU would otherwise wait.

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
# matcher per request, which the scheduler moves forward with every committed token. Every step, for the rows
# that sample, the matcher says which tokens of the vocabulary may come next, as a **bitmask**: one bit per
# token, 32 tokens to an `int32` word. The executor asks for it right after it has issued the forward (on a
# GPU the CPU fills the masks while the model runs) and applies it to the logits, before logprobs, penalties
# and sampling:

# %%
# NBVAL_IGNORE_OUTPUT
print(inspect.getsource(StructuredOutputManager.grammar_bitmask))
print(inspect.getsource(apply_grammar_bitmask))

# %% [markdown]
# To see the masks, we record what the engine's `grammar_bitmask` returns at each step (a wrapper on this
# engine's manager, which calls the real method), while the `lm_head` hook keeps recording the raw logits.
# First a choice between two words, on a real review:

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
print(f"text {choice.text!r}, tokens {choice.token_ids} ({[tokenizer.decode([t]) for t in choice.token_ids]}), "
      f"finish reason {choice.finish_reason}")
review_probs = choice_logits[0].softmax(-1)                                   # the model, unconstrained
masked = apply_grammar_bitmask(choice_logits[0][None], choice_masks[0][None])[0]   # what the sampler saw
allowed = torch.isfinite(masked).nonzero()[:, 0]
print(f"step 0: bitmask {tuple(choice_masks[0].shape)} {choice_masks[0].dtype}, {int(allowed.numel())} of "
      f"{VOCAB:,} tokens allowed: {[tokenizer.decode([t]) for t in allowed.tolist()]}")
print(f"the model, unconstrained: {label(review_probs.argmax())} {review_probs.max():.3f}; the allowed tokens "
      f"held {review_probs[allowed].sum():.4f} of its probability")
masked_probs = masked.softmax(-1)
order = allowed[masked_probs[allowed].argsort(descending=True)]              # the allowed tokens, most likely first
print("after the mask:", ", ".join(f"{label(t)} {masked_probs[t]:.3f}" for t in order.tolist()))
print("allowed at each step:", [int(torch.isfinite(apply_grammar_bitmask(l[None], m[None])).sum())
                                for l, m in zip(choice_logits, choice_masks)])

# %% [markdown]
# Unconstrained, the model would start a sentence ("The review is..."). The grammar allows only the tokens
# that begin one of the two words: whole words and their prefixes, since a byte-level vocabulary can spell a
# word in several ways. Among those, the model's own preferences decide, renormalised. Once `negative` is
# written the language is complete, and the only token left is the end of sequence.

# %%
# NBVAL_IGNORE_OUTPUT
fig, axes = plt.subplots(1, 2, figsize=(11, 2.9), gridspec_kw={"width_ratios": [3, 2]})
top15 = review_probs.topk(15).indices
axes[0].bar(range(15), review_probs[top15], color="#b0b0b0")
axes[0].set_xticks(range(15), [label(t) for t in top15], rotation=60, ha="right", fontsize=9)
axes[0].set_title("unconstrained: the 15 most likely tokens", fontsize=10)
axes[1].bar(range(len(order)), masked_probs[order], color="tab:green")
axes[1].set_xticks(range(len(order)), [label(t) for t in order], rotation=60, ha="right", fontsize=9)
axes[1].set_title(f"after the mask: the {len(order)} allowed tokens", fontsize=10)
axes[0].set_ylabel("probability")
fig.suptitle('choice=["positive", "negative"]: the grammar\'s bitmask at the first step')
fig.tight_layout()
plt.show()

# %% [markdown]
# A JSON schema, the same way. The mask is wide where the schema leaves a choice (JSON allows any whitespace
# between tokens, and the vocabulary has many whitespace tokens) and a single token where it does not:

# %%
schema = {"type": "object", "properties": {"sentiment": {"enum": ["positive", "negative"]}}, "required": ["sentiment"]}
js, js_logits, js_masks = constrained(StructuredOutputsParams(json=schema))
num_allowed = []
for step, (tid, l, m) in enumerate(zip(js.token_ids + [None], js_logits, js_masks)):
    step_masked = apply_grammar_bitmask(l[None], m[None])[0]
    num_allowed.append(int(torch.isfinite(step_masked).sum()))
    print(f"step {step:2d}: {num_allowed[-1]:5d} allowed; the model wanted {label(l.argmax()):9} -> "
          f"{label(step_masked.argmax())}")
print("text:", repr(js.text), "| finish reason:", js.finish_reason)
print("parsed:", json.loads(js.text))
del manager.grammar_bitmask                   # the engine's own method again, unwrapped

# %% [markdown]
# ## Check yourself
#
# Run this cell. It replays the lesson's claims on fresh data: top-k keeps exactly k tokens and top-p the
# smallest set reaching p, min-p keeps exactly the tokens above its threshold, temperature removes nothing,
# each penalty changes only the tokens it should, the Sampler never draws a filtered token and matches its
# distribution, logprobs are the raw log-softmax, the n children share the prompt's full blocks, the
# detokenizer never emits `'\ufffd'` and loses no text, the grammar's bitmask allows exactly the tokens of its
# set bits, and greedy decoding under a grammar takes the argmax of the masked logits.

# %%
row = steps[5]                                             # another real step of the poem
for k in (1, 7, 50):
    assert int(torch.isfinite(apply_top_k_top_p(row[None], [k], [1.0])).sum()) == k, "top-k keeps exactly k"
p_sorted = row.softmax(-1).sort(descending=True).values
for p in (0.3, 0.8, 0.95):
    kept_n = int(torch.isfinite(apply_top_k_top_p(row[None], [-1], [p])).sum())
    assert p_sorted[:kept_n].sum() >= p - 1e-6 and p_sorted[:kept_n - 1].sum() < p, "top-p: smallest set >= p"
m = apply_min_p(row[None], [0.1])[0]
assert torch.equal(torch.isfinite(m), row.softmax(-1) >= 0.1 * row.softmax(-1).max()), "min-p's threshold"
for t in (0.5, 2.0):
    p_t = (row / t).softmax(-1)
    assert bool((p_t > 0).all()) and bool((p_t[row.argsort(descending=True)].diff() <= 0).all()), \
        "temperature keeps every token and their order"

for name, pen in penalties.items():
    changed = set((pen != raw).nonzero()[:, 0].tolist())
    may_change = seen_tokens if name.startswith("repetition") else out_tokens
    assert changed and changed <= may_change, f"{name} changed a token it should not have"
assert torch.allclose(raw - penalties["presence_penalty=1.0"],
                      torch.zeros(VOCAB).index_fill_(0, torch.tensor(sorted(out_tokens)), 1.0)), "presence: -1 each"
assert torch.allclose(raw - penalties["frequency_penalty=0.5"], 0.5 * counts.float()), "frequency: -0.5 x count"

assert bool(kept[draws].all()), "a draw outside the top-p set"
assert p_value > 0.001 and tv < 3 * tv_mean, "the draws do not follow the filtered distribution"

assert err < 1e-4 and tempered > 0.01 and rank_ok, "logprobs are the raw log_softmax"
assert abs(sample.cumulative_logprob - sum(e[t].logprob for t, e in zip(sample.token_ids, sample.logprobs))) < 1e-5

shared = sorted(set.intersection(*(set(t) for t in first_tables.values())))
assert len(shared) == len(haiku_ids) // BS and first_used < n * prompt_blocks, "children share the prompt"
assert all(t[:len(shared)] == shared for t in first_tables.values()), "the shared blocks come first"
assert first_used == len(shared) + n, "one own block per child for the prompt's last, partial block"
assert traces[0].num_prefill_tokens == len(haiku_ids) + (n - 1) * (len(haiku_ids) % BS), "the prompt computed once"

emoji = tokenizer.encode("Waves 🌊 and 海 at dawn", add_special_tokens=False)
for ids_ in (zh_ids, emoji):
    st, text = DetokState(), ""
    for k in range(1, len(ids_) + 1):
        new, st = detokenize_incrementally(tokenizer, ids_[:k], st)
        assert "\ufffd" not in new, "the detokenizer emitted a replacement character"
        text += new
    assert text == tokenizer.decode(ids_), "incremental text differs from decoding the whole sequence"
assert "".join(d for _, d in deltas) == tokenizer.decode(zh_ids), "the engine's deltas add up to the text"
assert sum("\ufffd" in tokenizer.decode([t]) for t in zh_ids) == 6, "six tokens are incomplete characters alone"
mask0 = choice_masks[0]
bits = [int(mask0[t // 32]) >> (t % 32) & 1 for t in range(VOCAB)]              # the bitmask read bit by bit
assert [t for t in range(VOCAB) if bits[t]] == allowed.tolist(), "apply_grammar_bitmask reads the bits as xgrammar"
assert {tokenizer.decode([t]) for t in allowed.tolist()} <= {w[:i] for w in ("positive", "negative")
                                                            for i in range(1, 9)}, "only prefixes of the choices"
for out_, logits_, masks_ in ((choice, choice_logits, choice_masks), (js, js_logits, js_masks)):
    assert out_.token_ids == [int(apply_grammar_bitmask(l[None], m[None]).argmax()) for l, m in zip(logits_, masks_)], \
        "greedy under a grammar: the argmax of the masked logits"
assert choice.text in ("positive", "negative") and json.loads(js.text)["sentiment"] in ("positive", "negative")
print("all checks passed")
