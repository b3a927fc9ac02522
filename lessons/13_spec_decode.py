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
# # Lesson 13: speculative decoding, more than one token per step
#
# A decode step computes one new token per request, and to do it reads **every weight of the model**. If we
# had a good guess of the next few tokens, the same step could check them all: feed the last token *and* the
# guesses, get one row of logits per position, and keep every guess the model agrees with. That is
# speculative decoding. A cheap **proposer** guesses k draft tokens, the **target** model verifies them in one
# forward, and an exact **rejection rule** decides which to keep, so the output is the one the target alone
# would have produced (bit for bit when greedy, in distribution when sampling).
#
# ```
# step s ends:    proposer looks at the request's tokens          spec_decode/ngram_proposer.py  NgramProposer.propose
#                 -> drafts d1..dk for the next step              core/scheduler.py   update_draft_token_ids
# step s+1:       schedule the last token + d1..dk (1 + k tokens) core/scheduler.py   scheduled_spec_decode_tokens
#                 one flat batch, one row of logits per position  worker/model_runner.py  prepare_inputs
#                 keep the drafts the target agrees with, + one   worker/rejection_sampler.py  RejectionSampler
#                 num_computed_tokens covers only kept tokens     core/scheduler.py   update_from_output
# ```
#
# Turn it on with vLLM's `speculative_config`:
# `LLM(speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
# "prompt_lookup_max": 4})`. This lesson measures why checking k tokens costs little, watches the n-gram
# proposer copy from a real prompt, checks the rejection rule numerically, looks at what a rejection does to
# the KV blocks, compares speed and output with speculation off, and ends with a draft model as the proposer.
# Code printed with `inspect.getsource` is the installed module's (those cells are `# NBVAL_IGNORE_OUTPUT`; the
# numbers below are what the test checks).

# %%
import warnings

warnings.filterwarnings("ignore", message="IProgress not found")   # tqdm's notice when ipywidgets is absent

import inspect
import time

import matplotlib.pyplot as plt
import torch
from matplotlib.patches import Patch, Rectangle

from minivllm import LLM, SamplingParams
from minivllm.bench.roofline import linear_shapes, measure_copy_bandwidth, measure_matmul_rate
from minivllm.core.request import Request
from minivllm.core.scheduler import Scheduler
from minivllm.spec_decode.ngram_proposer import NgramProposer
from minivllm.worker.model_runner import ModelInput
from minivllm.worker.rejection_sampler import RejectionSampler
from minivllm.worker.sampler import Sampler

torch.manual_seed(0)
torch.set_num_threads(1)   # one thread: faster on a busy 2-core CPU, and the same float sums everywhere

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
plain = LLM(num_kv_blocks=64, max_num_seqs=4, seed=0)                          # speculation off
spec = LLM(num_kv_blocks=64, max_num_seqs=4, seed=0, speculative_config=SPEC)  # the same model, n-gram drafts
tokenizer = spec.get_tokenizer()
cfg = plain.llm_engine.model_config
BS = plain.llm_engine.kv_cache_manager.block_size

# %% [markdown]
# ## 1. Why verifying k tokens costs little: a decode step reads every weight
#
# A weight matrix is read once per step whatever the number of rows that multiply it. For one token per step
# the work per weight is tiny (2 FLOPs for every 4 bytes in fp32), so a decode step is limited by how fast the
# weights come from memory, not by arithmetic. First the bytes: every parameter of the model, counted from
# the loaded model itself.

# %%
runner = plain.llm_engine.model_runner
params = list(runner.model.parameters())
param_bytes = sum(p.numel() * p.element_size() for p in params)
num_params = sum(p.numel() for p in params)
linear_per_token = cfg.num_hidden_layers * sum(i * o for i, o in linear_shapes(cfg)) + cfg.hidden_size * cfg.vocab_size
print(f"{num_params / 1e6:.1f} M parameters in {runner.dtype}: {param_bytes / 2**20:.0f} MiB, read by every step")
print(f"embedding tied to the LM head: {cfg.tie_word_embeddings}; the LM head alone is "
      f"{cfg.hidden_size * cfg.vocab_size * runner.dtype.itemsize / 2**20:.0f} MiB")
print(f"FLOPs per token through the matmuls: 2 x {linear_per_token / 1e6:.1f} M = "
      f"{2 * linear_per_token / 1e9:.2f} GFLOP")

# %% [markdown]
# Now the real forward. We hand the model runner a batch we build ourselves (a `ModelInput`, what
# `prepare_inputs` makes from a `SchedulerOutput`): one request whose first 256 tokens are already in the KV
# cache, and `q` new tokens after them, with a row of logits for every new token, exactly the shape of a
# verification step with `q - 1` drafts. The blocks are those of this fresh engine's pool, which holds nothing
# yet (no request runs, nothing is cached). We time `execute_model` (the forward and the LM head) for q = 1 (a
# plain decode), 2, 3, 5 and 9, and a few larger q to see the trend, interleaved and repeated, keeping the
# fastest run of each (the least disturbed by other work on the machine).

# %%
CONTEXT = 256
table = list(range((CONTEXT + 64) // BS + 1))            # physical blocks 0.. of this engine's empty pool


def batch(start, q):
    """A ModelInput for one request: tokens at positions start..start+q-1 over a cached context of `start`."""
    pos = list(range(start, start + q))
    return ModelInput(input_ids=[1000 + p % 500 for p in pos], positions=pos,
                      slot_mapping=[table[p // BS] * BS + p % BS for p in pos], q_lens=[q], seq_lens=[start + q],
                      block_tables=[table], sample_rows=list(range(q)))


runner.execute_model(batch(0, CONTEXT))                  # prefill the context once
Q = [1, 2, 3, 5, 9, 17, 33]
times = {q: [] for q in Q}
for _ in range(5):
    for q in Q:
        start = time.perf_counter()
        logits_q, _ = runner.execute_model(batch(CONTEXT, q))
        times[q].append(time.perf_counter() - start)
        assert logits_q.shape == (q, cfg.vocab_size)     # one row per position: every draft is checked
best = {q: min(t) for q, t in times.items()}

bandwidth = measure_copy_bandwidth()                       # bytes/s this machine copies (read + write)
matmul_rate = measure_matmul_rate(cfg, min_time_s=0.5)     # FLOP/s of the model's matmul shapes at 256 rows
memory_floor = param_bytes / bandwidth
compute_per_token = 2 * linear_per_token / matmul_rate

# %%
# NBVAL_IGNORE_OUTPUT
for q in Q:
    print(f"q={q:2d} new tokens: {best[q] * 1e3:6.1f} ms per step = {best[q] / best[1]:4.2f} x one token, "
          f"{best[q] / q * 1e3:5.1f} ms per token")
print(f"weights / copy bandwidth {bandwidth / 1e9:.1f} GB/s: {memory_floor * 1e3:.1f} ms, the floor of any step")
print(f"matmuls at {matmul_rate / 1e9:.0f} GFLOP/s: {compute_per_token * 1e3:.1f} ms per token; equal to the "
      f"floor at {memory_floor / compute_per_token:.1f} tokens")

# %%
# NBVAL_IGNORE_OUTPUT
fig, axes = plt.subplots(1, 2, figsize=(11, 3.6))
qs = torch.arange(1, max(Q) + 1)
roof = torch.maximum(torch.full(qs.shape, memory_floor), qs * compute_per_token)
axes[0].plot(Q, [best[q] * 1e3 for q in Q], "o-", color="tab:blue", label="measured step (fastest of 5)")
axes[0].plot(qs, roof * 1e3, "--", color="tab:gray", label="roofline: max(weight bytes / bandwidth,\n"
             "q x FLOPs / matmul rate)")
axes[0].axhline(memory_floor * 1e3, color="tab:red", lw=0.8)
axes[0].text(max(Q), memory_floor * 1e3, "read every weight once", color="tab:red", ha="right", va="bottom",
             fontsize=8)
axes[0].set_xlabel("new tokens in the step (1 + drafts)")
axes[0].set_ylabel("ms per step")
axes[0].set_ylim(0, None)
axes[0].legend(fontsize=8, loc="upper left")
axes[0].set_title("time of one step", fontsize=10)
axes[1].plot(Q, [best[q] / q * 1e3 for q in Q], "o-", color="tab:green")
axes[1].set_xscale("log", base=2)
axes[1].set_xticks(Q, [str(q) for q in Q])
axes[1].set_xlabel("new tokens in the step")
axes[1].set_ylabel("ms per token")
axes[1].set_ylim(0, None)
axes[1].set_title("time per token (if every draft were accepted)", fontsize=10)
fig.suptitle(f"SmolLM2-135M on this CPU ({runner.dtype}, 1 thread), {CONTEXT} tokens of context")
fig.tight_layout()
plt.show()

# %% [markdown]
# Read the left plot against its roofline. A one-token step costs at least the time to stream every weight
# from memory (red line), however little arithmetic it does. The arithmetic grows with q, and on this CPU
# catches up with the memory floor after a handful of tokens: a CPU core does few FLOPs per byte it reads,
# and its matmul library is far slower at 2-9 rows than at 256 (the rate we measured), so the real steps sit
# above the roofline and more tokens do cost more here. Still, per token (right) the larger steps are much
# cheaper than a step of 1: a step that verifies drafts pays off as soon as enough of them are accepted.
#
# On a GPU the same arithmetic is far more lopsided. The model in bf16 is about half these bytes; an H100 reads
# about 3.35 TB/s and multiplies at about 990 TFLOP/s (dense bf16, the data sheet), so the step's weight read
# takes about a hundred microseconds and the matmuls of 9 tokens a few: the step is memory-bound up to
# hundreds of tokens, and checking 4 drafts is nearly free. (The numbers printed below are that arithmetic,
# not a measurement.) That is the bet of speculative decoding: the step is paid for anyway; every accepted
# draft is a token for free.

# %%
H100_BYTES_S, H100_FLOP_S = 3.35e12, 989e12          # data sheet: HBM3 bandwidth, dense bf16 tensor cores
bf16_bytes = num_params * 2
print(f"H100, bf16: weights {bf16_bytes / 2**20:.0f} MiB take {bf16_bytes / H100_BYTES_S * 1e6:.0f} us to read; "
      f"the matmuls of 9 tokens {9 * 2 * linear_per_token / H100_FLOP_S * 1e6:.1f} us; they catch up at "
      f"{bf16_bytes / H100_BYTES_S / (2 * linear_per_token / H100_FLOP_S):.0f} tokens")

# %% [markdown]
# ## 2. The n-gram proposer: prompt lookup
#
# The cheapest proposer needs no model at all. When the output copies or edits its prompt (a quoted
# passage, code being changed, a summary that reuses phrases), the next tokens are probably the ones that
# followed the same few tokens earlier. `NgramProposer.propose` takes the request's last n tokens (n from
# `prompt_lookup_max` down to `prompt_lookup_min`), finds their latest earlier occurrence in the prompt and
# output, and proposes the k tokens that followed it:

# %% [markdown]
# ### Exercise: prompt lookup
#
# Write `ngram_propose(token_ids, k, min_n, max_n)`: up to `k` draft tokens to follow the list `token_ids`. For
# `n` from `max_n` down to `min_n`, take the last `n` tokens (the suffix), find their **latest** earlier
# occurrence (one that starts before the suffix itself; it may overlap it), and return the up-to-`k` tokens that
# followed it. The first `n` that matches wins; no match at any `n` gives `[]`. Plain Python lists are enough.
#
# The check runs hand-made lists, then 300 random ones against minivllm's `NgramProposer`, and finally puts your
# function in place of the proposer of a real engine with n-gram speculation: the greedy output must not change,
# and the engine must verify and accept exactly the drafts it does with its own proposer.

# %%
from course import check, exercise


@exercise("13.ngram_propose")
def ngram_propose(token_ids, k, min_n, max_n):
    # your code here
    raise NotImplementedError


check(ngram_propose)

# %% [markdown]
# minivllm's version does the same search with NumPy: every window of n tokens compared with the suffix at once.

# %%
# NBVAL_IGNORE_OUTPUT
print(inspect.getsource(NgramProposer.propose))

# %% [markdown]
# > **How vLLM v1 does it differently.** `vllm/v1/spec_decode/ngram_proposer.py` does the lookup for the whole
# > batch in compiled code: the search is a Numba-jitted function (a KMP-style scan that finds the longest
# > matching n-gram between `prompt_lookup_min` and `prompt_lookup_max` in one pass instead of one pass per n),
# > run over the requests in parallel threads, on token ids kept in the persistent batch's NumPy arrays. The
# > verification (`vllm/v1/sample/rejection_sampler.py`) runs as Triton kernels on the GPU. minivllm keeps one
# > request at a time in plain NumPy, which is fast enough for a CPU step that takes tens of milliseconds.

# %% [markdown]
# A small model copies well when asked to. We ask SmolLM2 to copy a passage; to see the proposer at work we
# record what it gets and returns each time the engine calls it (a wrapper around this engine's proposer that
# calls the real method), and record the step traces, whose `RequestTrace` has `num_draft_tokens` (drafts
# verified in the step) and `num_accepted_tokens`. We step the engine by hand so that, after every step, we can
# also note which of the request's blocks are in the prefix cache (for section 4).

# %%
PASSAGE = ("Paris is the capital of France, and it is famous for the Eiffel Tower, the Louvre museum and its "
           "cafes. Every year, millions of tourists visit the city to enjoy its art, its food and its beautiful "
           "streets.")
messages = [{"role": "user", "content": "Copy this text word for word: " + PASSAGE}]
prompt_ids = tokenizer.encode(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                              add_special_tokens=False)
GREEDY = SamplingParams(temperature=0, max_tokens=80)

engine = spec.llm_engine
proposer = engine.model_runner.proposer
proposals = []                                          # (the tokens it was given, the drafts it returned)
propose = proposer.propose


def recording_propose(token_ids, max_tokens=None):
    drafts = propose(token_ids, max_tokens)
    proposals.append((list(token_ids), drafts))
    return drafts


proposer.propose = recording_propose
req = engine.add_request({"prompt_token_ids": prompt_ids}, GREEDY)   # the core's Request: tokens, blocks, ...
rid = req.request_id
pool = engine.kv_cache_manager.block_pool
after = []                                              # per step: what the request looked like after it
with engine.record_traces() as traces:
    while engine.has_unfinished_requests():
        engine.step()
        table = list(req.block_table) if not req.is_finished else after[-1]["table"]   # finishing frees them
        after.append(dict(num_computed=req.num_computed_tokens, tokens=list(req.all_token_ids), table=table,
                          cached={b: pool.blocks[b].token_ids for b in table if pool.blocks[b].block_hash is not None},
                          finished=req.is_finished))
del proposer.propose                                    # the engine's own method again
copy_ids = req.output_token_ids
print(f"prompt {len(prompt_ids)} tokens; output {len(copy_ids)} tokens in {len(traces)} steps "
      f"(1 prefill + {len(traces) - 1} decode steps)")
print(repr(tokenizer.decode(copy_ids)))
stats = engine.get_stats()
print(f"drafts: {stats.num_spec_drafts} verification steps, {stats.num_spec_draft_tokens} draft tokens, "
      f"{stats.num_spec_accepted_tokens} accepted: acceptance rate {stats.spec_acceptance_rate:.2f}, "
      f"mean acceptance length {stats.spec_mean_acceptance_length:.2f} tokens per verification step")

# %% [markdown]
# The copy is nearly faithful: the model capitalised "Museum", put in two commas and wrote "Paris" for
# "the city". At each of those the proposer's guess (the prompt's next tokens) is wrong. Here are the first
# steps: what the proposer matched, what it proposed, and what the target kept. To show the match we redo the
# proposer's search on the tokens it was given (`matched`, below) and check that the tokens after the match
# are the drafts it returned. The trace's `num_draft_tokens` and `num_accepted_tokens` give the verdict.


# %%
def matched(tokens, lo=SPEC["prompt_lookup_min"], hi=SPEC["prompt_lookup_max"]):
    """(n, start of the latest earlier occurrence of the last n tokens), n from hi down to lo; None if none."""
    for n in range(min(hi, len(tokens) - 1), lo - 1, -1):
        starts = [s for s in range(len(tokens) - n) if tokens[s:s + n] == tokens[-n:]]
        if starts:
            return n, starts[-1]
    return None


def show(ids):
    return repr(tokenizer.decode(ids))


by_step = []          # per decode step: (drafts verified, drafts accepted, tokens kept, the proposal before it)
for s, tr in enumerate(traces[1:], start=1):
    r = tr.by_id[rid]
    kept = after[s]["tokens"][len(after[s - 1]["tokens"]):]
    drafts = proposals[s - 1][1]                         # proposed after step s - 1, verified in step s
    na = r.num_accepted_tokens
    assert r.num_draft_tokens == len(drafts)
    assert kept[:na] == drafts[:min(na, len(kept))], "the accepted drafts are the tokens kept (up to a stop)"
    by_step.append((r.num_draft_tokens, na, kept, proposals[s - 1]))
for s, (nd, na, kept, (given, drafts)) in enumerate(by_step[:12], start=1):
    m = matched(given)
    if m is None:
        print(f"step {s:2d}: no n-gram of {SPEC['prompt_lookup_min']}+ tokens repeats: no drafts; kept {show(kept)}")
        continue
    n, at = m
    assert given[at + n:at + n + len(drafts)] == drafts, "the drafts are the tokens after the match"
    where = "prompt" if at + n <= len(prompt_ids) else "output"
    print(f"step {s:2d}: last {n} tokens {show(given[-n:]):18} seen at {at:3d} ({where}) -> drafts "
          f"{show(drafts):30} accepted {na}/{nd}, kept {show(kept)}")

# %% [markdown]
# Long stretches go four drafts at a time, and each such step gives five tokens: the four drafts and a
# **bonus** token the target predicts after the last one. A step with a wrong draft still gives one token, the
# target's **correction** at the first mismatch. The proposer can also look in the wrong place: after the
# model's extra comma, ", and" last occurred in the output itself (step 9), and " and its" last occurred in the
# prompt's second sentence (step 10), so it proposed text from the wrong spot; one longer n-gram later (step 11,
# " and its caf") it is back on track. The whole copy, step by step:

# %%
# NBVAL_IGNORE_OUTPUT
fig, ax = plt.subplots(figsize=(11, 3.0))
for s, (nd, na, kept, _) in enumerate(by_step, start=1):
    out = min(na, len(kept))                             # accepted drafts in the output (a stop can cut them)
    ax.bar(s, out, color="tab:green")
    ax.bar(s, len(kept) - out, bottom=out, color="tab:blue")
    ax.bar(s, na - out, bottom=len(kept), color="white", edgecolor="tab:green", hatch="...")
    ax.bar(s, nd - na, bottom=len(kept) + na - out, color="white", edgecolor="tab:red", hatch="///")
ax.set_xlabel("decode step")
ax.set_ylabel("tokens")
ax.set_xticks(range(1, len(by_step) + 1))
ax.legend(handles=[Patch(color="tab:green", label="accepted drafts (in the output)"),
                   Patch(color="tab:blue", label="the target's own token (correction or bonus)"),
                   Patch(facecolor="white", edgecolor="tab:green", hatch="...",
                         label="accepted drafts after the stop (counted, not output)"),
                   Patch(facecolor="white", edgecolor="tab:red", hatch="///",
                         label="rejected drafts (computed, dropped)")],
          fontsize=8, loc="upper right", ncol=2)
ax.set_ylim(0, SPEC["num_speculative_tokens"] + 3.2)
ax.set_title(f"{len(copy_ids)} tokens in {len(by_step)} decode steps: tokens kept per step (bar height) and "
             "drafts wasted (red)", fontsize=10)
fig.tight_layout()
plt.show()

# %%
gained = [len(kept) for _, _, kept, _ in by_step]
print("tokens kept per decode step:", gained)
print(f"{sum(gained)} tokens in {len(gained)} decode steps: {sum(gained) / len(gained):.2f} per step; "
      f"steps that verified drafts: {sum(nd > 0 for nd, *_ in by_step)}, of which all {SPEC['num_speculative_tokens']}"
      f" accepted: {sum(na == nd == SPEC['num_speculative_tokens'] for nd, na, *_ in by_step)}")
trace_accepted = sum(t.num_accepted_tokens for t in traces)
nd_last, na_last, kept_last, (_, drafts_last) = by_step[-1]
print(f"accepted drafts: {trace_accepted} in the step traces, {stats.num_spec_accepted_tokens} in the engine's counter")
print(f"last step: drafts {show(drafts_last)}, accepted {na_last}/{nd_last}, kept {show(kept_last)}")

# %% [markdown]
# The trace and the engine's counter agree: like vLLM's `spec_decode_num_accepted_tokens`, both count the drafts
# the verification accepted. At the last step that is all four, the newline after `<|im_end|>` included, though
# the stop then ends the output at `<|im_end|>` (the dotted bar in the picture).
#
# ## 3. Verification: greedy, and the rejection-sampling rule
#
# The rejection sampler gets the target's k + 1 rows of logits for a request with k drafts: row j is the
# target's prediction after the last token and d1..dj, so it judges d(j+1); the last row predicts the token
# after dk. **Greedy** is simple: keep d(j+1) while it equals the argmax of row j; at the first mismatch take
# the argmax instead and stop. The output is the one plain greedy decoding gives, token for token (section 5
# checks it).
#
# **Sampling** must keep the output *distribution* unchanged. With p the target's distribution at a position
# and q the proposer's (an n-gram draft is certain: q is all on the draft token), the rule accepts the draft d
# with probability min(1, p(d) / q(d)), and after a rejection draws from the **residual** max(p - q, 0),
# renormalised. Then P(token = x) = min(p(x), q(x)) + P(reject) · max(p(x) - q(x), 0) / Z = p(x), because
# Z = sum max(p - q, 0) = 1 - sum min(p, q) = P(reject).

# %%
# NBVAL_IGNORE_OUTPUT
print(inspect.getsource(RejectionSampler._sample))

# %% [markdown]
# The picture, on a made-up distribution over six tokens: the draft accepts where q overlaps p (the green
# mass, min(p, q), is the chance of accepting), and the residual puts the rest of p exactly where q had too
# little.

# %%
p = torch.tensor([0.05, 0.30, 0.25, 0.10, 0.20, 0.10])
q = torch.tensor([0.30, 0.10, 0.25, 0.25, 0.05, 0.05])
overlap = torch.minimum(p, q)
residual = (p - q).clamp_min(0)
print(f"P(accept) = sum min(p, q) = {overlap.sum():.2f}; residual mass = {residual.sum():.2f}; "
      f"residual renormalised: {[round(x, 3) for x in (residual / residual.sum()).tolist()]}")

# %%
# NBVAL_IGNORE_OUTPUT
fig, axes = plt.subplots(1, 3, figsize=(11, 2.9), sharey=True)
x = torch.arange(6)
axes[0].bar(x - 0.2, p, 0.4, color="tab:blue", label="target p")
axes[0].bar(x + 0.2, q, 0.4, color="tab:orange", label="draft q")
axes[0].set_title("the two distributions", fontsize=10)
axes[1].bar(x, overlap, color="tab:green", label="min(p, q): accepted")
axes[1].bar(x, residual, bottom=overlap, color="tab:purple", label="max(p - q, 0): residual")
axes[1].step(x, p, where="mid", color="tab:blue", lw=1, label="p")
axes[1].set_title("p = min(p, q) + max(p - q, 0)", fontsize=10)
axes[2].bar(x, residual / residual.sum(), color="tab:purple", label="residual, renormalised")
axes[2].set_title(f"drawn after a rejection (prob. {residual.sum():.2f})", fontsize=10)
for ax in axes:
    ax.set_xticks(x, [f"t{i}" for i in range(6)])
    ax.legend(fontsize=8, loc="upper right")
axes[0].set_ylabel("probability")
axes[0].set_ylim(0, 0.62)
fig.suptitle("The rejection-sampling rule: accept where q overlaps p, fill the rest from the residual")
fig.tight_layout()
plt.show()

# %% [markdown]
# Now the real `RejectionSampler` on it, many times at once: N = 20,000 requests (each a `Request` with
# `temperature=1`), one draft each drawn from q, the target's logits `log p` on both of each request's rows,
# and q passed as the draft's distribution. The kept first token should follow p. As a control, a deliberately
# wrong rule, "always accept the draft", keeps the drafts themselves, which follow q. A chi-square test
# against p tells them apart (the p-value is P(chi-square with 5 degrees of freedom > the statistic)).

# %%
N, V = 20_000, 6
gen = torch.Generator().manual_seed(0)
rejection_sampler = RejectionSampler(Sampler(seed=0))
requests = [Request(f"r{i}", [0], SamplingParams(temperature=1.0)) for i in range(N)]
drafts_q = torch.multinomial(q, N, replacement=True, generator=gen)               # (N,) one draft each, from q
logits_p = p.log().repeat(2 * N, 1)                                               # (2N, V): rows of p
kept = rejection_sampler(logits_p, requests, [[d] for d in drafts_q.tolist()], [q[None]] * N)
first = torch.tensor([k[0] for k in kept])


def chi_square(samples, probs):
    counts = torch.bincount(samples, minlength=len(probs)).double()
    expected = probs.double() * len(samples)
    stat = float(((counts - expected) ** 2 / expected).sum())
    dof = len(probs) - 1
    return stat, float(torch.special.gammaincc(torch.tensor(dof / 2.0), torch.tensor(stat / 2.0)))


rules = {"RejectionSampler (draft from q)": first, "always accept (wrong)": drafts_q}
# n-gram drafts are certain (q = one-hot): every request drafts t1 and passes no q
kept_ngram = rejection_sampler(logits_p, requests, [[1]] * N)
rules["RejectionSampler (n-gram draft t1)"] = torch.tensor([k[0] for k in kept_ngram])
results = {}
for name, samples in rules.items():
    freq = torch.bincount(samples, minlength=V) / N
    results[name] = chi_square(samples, p)
    print(f"{name:36} frequencies {[round(f, 3) for f in freq.tolist()]}  chi2 {results[name][0]:8.1f}  "
          f"p-value {results[name][1]:.3g}")
print(f"{'target p':36} {'':12}{[round(f, 3) for f in p.tolist()]}")
print(f"first draft accepted in {float((torch.tensor([len(k) for k in kept]) == 2).float().mean()):.3f} of the "
      f"requests; sum min(p, q) = {overlap.sum():.3f}")

# %% [markdown]
# The real rule's kept tokens pass the test (a p-value well above 0.001), for a draft drawn from q and for a
# certain n-gram draft alike; always accepting fails it by a huge margin: its tokens follow q, not p. The
# acceptance rate is min(p, q)'s mass, as the picture said: the better the proposer matches the target, the
# more drafts survive, but a bad proposer only costs speed, never correctness.
#
# ## 4. Rollback in the block picture
#
# A verification step writes KV for the last token and every draft: the scheduler allocated slots for all of
# them (`allocate_slots(req, 1 + k)`), and the model runner put the drafts after the last token in the flat
# batch. What happens to the slots of rejected drafts? Nothing needs to be undone. `update_from_output` sets
# `num_computed_tokens` to cover the last token and the accepted drafts only; the slot after them will get the
# KV of the target's own token next step (overwriting the rejected draft's), and the later ones when the
# request gets there. Attention reads only positions below the step's `seq_lens`, so the stale KV is never
# seen. And the prefix cache hashes a block only when every token in it is computed and kept.

# %%
# NBVAL_IGNORE_OUTPUT
source = inspect.getsource(Scheduler.update_from_output)
print(source[source.index("        outputs = []"):])

# %% [markdown]
# We pick a step of the copy where drafts were rejected and a rejected draft sat in a block's last slot: had
# the step kept it, that block would have been full and hashed.


# %%
def rejected_positions(s):
    """Positions whose KV step s wrote for drafts it then rejected."""
    before = after[s - 1]["num_computed"]                # = the position of the step's last token
    nd, na = by_step[s - 1][:2]
    return list(range(before + 1 + na, before + 1 + nd))


candidates = [s for s in range(1, len(by_step) + 1)
              if any(pos % BS == BS - 1 for pos in rejected_positions(s))]
S = candidates[0]
nd, na, kept_S, (given_S, drafts_S) = by_step[S - 1]
b, a = after[S - 1], after[S]
print(f"step {S}: last token {show(given_S[-1:])} at position {b['num_computed']}; drafts {show(drafts_S)} "
      f"at {b['num_computed'] + 1}..{b['num_computed'] + nd}; accepted {na}, kept {show(kept_S)}")
print(f"before: num_computed_tokens {b['num_computed']}, num_tokens {len(b['tokens'])}, block table {b['table']}")
print(f"after:  num_computed_tokens {a['num_computed']}, num_tokens {len(a['tokens'])}, block table {a['table']}")
print(f"KV written for positions {b['num_computed']}..{b['num_computed'] + nd}; kept "
      f"{b['num_computed']}..{a['num_computed'] - 1}; stale (rejected drafts) {rejected_positions(S)}")
print(f"blocks in the prefix cache before: {sorted(b['cached'])}, after: {sorted(a['cached'])}")
last_slot = next(pos for pos in rejected_positions(S) if pos % BS == BS - 1)
print(f"position {last_slot} is the last slot of block {a['table'][last_slot // BS]}: written, but holds a "
      f"rejected draft, so the block is not hashed")

# %%
# NBVAL_IGNORE_OUTPUT
first_block = b["num_computed"] // BS - 1                  # the block before, and the step's block(s)
blocks_shown = range(first_block, len(a["table"]))
H = 1.6                                                    # cell height: room for a token written sideways


def piece(ids, pos):
    return tokenizer.decode(ids[pos:pos + 1]).replace(" ", "␣").replace("\n", "↵") if pos < len(ids) else ""


def draw_row(ax, y, title, style_of):
    for i, blk in enumerate(blocks_shown):
        for j in range(BS):
            pos = blk * BS + j
            face, edge, text = style_of(pos)
            ax.add_patch(Rectangle((i * (BS + 0.8) + j, y), 0.92, H, facecolor=face, edgecolor=edge or face, lw=1))
            ax.text(i * (BS + 0.8) + j + 0.46, y + H / 2, text, ha="center", va="center", fontsize=7, rotation=90)
    ax.text(-0.4, y + H / 2, title, ha="right", va="center", fontsize=9)


scheduled_seq = b["tokens"] + drafts_S                     # what the step's flat batch held, by position


def style_before(pos):
    if pos < b["num_computed"]:
        return "#c8c8c8", None, piece(scheduled_seq, pos)
    if pos == b["num_computed"]:
        return "tab:blue", None, piece(scheduled_seq, pos)
    if pos <= b["num_computed"] + nd:
        return "tab:orange", None, piece(scheduled_seq, pos)
    return "white", None, ""


def style_after(pos):
    if pos < b["num_computed"]:
        return "#c8c8c8", None, piece(a["tokens"], pos)
    if pos < a["num_computed"]:
        return "tab:green", None, piece(a["tokens"], pos)
    if pos in rejected_positions(S):
        now = piece(a["tokens"], pos)
        return "#fbd5d5", "tab:red", (now + "\n" if now else "") + "(KV: " + piece(scheduled_seq, pos) + ")"
    return "white", None, ""


fig, ax = plt.subplots(figsize=(11, 4.2))
draw_row(ax, H + 0.5, "the step's input", style_before)
draw_row(ax, 0, "after the step", style_after)
for i, blk in enumerate(blocks_shown):
    state = "in the prefix cache" if a["table"][blk] in a["cached"] else "not hashed"
    ax.text(i * (BS + 0.8) + BS / 2, 2 * H + 0.7, f"block {a['table'][blk]} (positions {blk * BS}-{blk * BS + BS - 1}):"
            f" {state} after the step", ha="center", fontsize=9)
x_nc = (a["num_computed"] // BS - first_block) * (BS + 0.8) + a["num_computed"] % BS - 0.04
ax.plot([x_nc, x_nc], [-0.15, H + 0.1], color="black", lw=1.5)
ax.text(x_nc, -0.35, f"num_computed_tokens = {a['num_computed']}", ha="center", va="top", fontsize=8)
ax.set_xlim(-9, len(blocks_shown) * (BS + 0.8))
ax.set_ylim(-0.8, 2 * H + 1.0)
ax.axis("off")
fig.legend(handles=[Patch(color="#c8c8c8", label="computed before the step"),
                    Patch(color="tab:blue", label="last token (computed this step)"),
                    Patch(color="tab:orange", label="drafts (computed this step)"),
                    Patch(color="tab:green", label="kept: num_computed_tokens covers it"),
                    Patch(facecolor="#fbd5d5", edgecolor="tab:red",
                          label="rejected draft's KV: stale, overwritten later")],
           loc="lower center", ncol=3, fontsize=8, frameon=False)
fig.suptitle(f"Step {S}: {nd} drafts, {na} accepted; the rejected drafts' slots are not counted, their block "
             "is not hashed", fontsize=11)
fig.tight_layout(rect=(0, 0.1, 1, 1))
plt.show()

# %% [markdown]
# After the step the sequence has one new token, the target's correction (written above the stale KV in its
# slot): it has no KV yet, like every newest token, and the next step computes it into that slot. Block 6 had
# all sixteen slots written by the step, but only up to `num_computed_tokens` with kept tokens, so it was not
# hashed; it will be once the request's own tokens fill it.

# %% [markdown]
# The prefix cache after the whole copy: every hashed block holds exactly the request's final tokens at its
# positions, so no rejected draft ever made it into the cache.

# %%
final = after[-1]
cached_ok = all(tuple(final["tokens"][i * BS:(i + 1) * BS]) == final["cached"][blk]
                for i, blk in enumerate(final["table"]) if blk in final["cached"])
print(f"{len(final['cached'])} of the request's {len(final['table'])} blocks were hashed; each holds the "
      f"request's own tokens: {cached_ok}")
ever_cached = [(s, blk, toks) for s, st in enumerate(after) for blk, toks in st["cached"].items()]
consistent = all(toks == tuple(final["tokens"][final["table"].index(blk) * BS:(final["table"].index(blk) + 1) * BS])
                 for s, blk, toks in ever_cached)
print(f"after every step, every hashed block held final, kept tokens: {consistent}")

# %% [markdown]
# ## 5. Same output, fewer steps
#
# Greedy speculative decoding must give the tokens plain greedy decoding gives. The plain engine (no
# `speculative_config`) copies the same passage; we compare the tokens, then the steps and the time. (Times
# change from run to run and machine to machine; that cell is not compared by the test.)

# %%
plain_engine = plain.llm_engine
chat = [messages, [{"role": "user", "content": "Copy this sentence word for word: The Amazon rainforest covers much "
                    "of the Amazon basin of South America, and it is home to millions of species of insects, plants, "
                    "birds and other forms of life."}]]
runs = {}
for name, llm in (("plain", plain), ("speculative", spec)):
    engine_ = llm.llm_engine
    steps0, time0 = engine_.num_steps, []
    outs = []
    for conv in chat:                                   # one request at a time: a decode step of batch size 1
        start = time.perf_counter()
        outs.append(llm.chat(conv, GREEDY, use_tqdm=False)[0].outputs[0])
        time0.append(time.perf_counter() - start)
    runs[name] = dict(ids=[o.token_ids for o in outs], steps=engine_.num_steps - steps0, seconds=sum(time0))
for i in range(len(chat)):
    same = runs["plain"]["ids"][i] == runs["speculative"]["ids"][i]
    print(f"prompt {i}: {len(runs['plain']['ids'][i])} tokens, identical with and without speculation: {same}")
for name, r in runs.items():
    print(f"{name:11}: {sum(map(len, r['ids']))} tokens in {r['steps']} steps")

# %%
# NBVAL_IGNORE_OUTPUT
for name, r in runs.items():
    n_tok = sum(map(len, r["ids"]))
    print(f"{name:11}: {r['seconds']:.2f} s, {n_tok / r['seconds']:.1f} tokens/s")
print(f"speed-up {runs['plain']['seconds'] / runs['speculative']['seconds']:.2f}x")

# %% [markdown]
# Fewer than half the steps, each a little dearer on this CPU (section 1): the copy comes out faster. On a GPU,
# where a step of 5 tokens costs about what a step of 1 does, the speed-up approaches the step ratio. Where the
# output does not repeat its context (free writing), the n-gram proposer finds nothing, proposes nothing, and
# the step is a plain decode: speculation costs nothing there.
#
# ## 6. A draft model: a second, smaller model proposes
#
# Free writing needs a proposer that *predicts* text: vLLM's `draft_model` method, a smaller model with the
# target's tokenizer, `speculative_config={"method": "draft_model", "num_speculative_tokens": 3, "model": PATH}`
# (`spec_decode/draft_model.py`). The draft keeps its own KV cache under the target's block ids, so a request's
# block table serves both models, plus a few scratch blocks per request for the positions a proposal runs past
# the table. Each step, after the target's forward, the draft runs the same flat batch (`observe`), then
# `propose_batch` makes k batched one-token passes: the last token, then each draft in turn, each pass's argmax
# the next draft. Argmax drafts are certain (q is one-hot), so the verifier of section 3 keeps the output the
# target's. Instead of `model`, `draft_num_layers: N` keeps only the target's own first N layers (with its final
# norm and LM head): no second checkpoint to load.
#
# We try two drafts on a prompt with nothing to copy, against the plain engine's greedy output: the target
# itself as its own draft (the default model's directory as `model`), and its first 6 of 30 layers. A wrapper
# on `propose_batch` records each proposal with the tokens the target then produced at those positions.

# %%
from minivllm.model.default_model import default_model_dir

ocean = [{"role": "user", "content": "Write one sentence about the ocean."}]
FREE = SamplingParams(temperature=0, max_tokens=24)
reference = list(plain.chat(ocean, FREE, use_tqdm=False)[0].outputs[0].token_ids)
print("plain greedy:", show(reference))
drafters = {"the target itself": {"model": str(default_model_dir())},
            "its first 6 layers": {"draft_num_layers": 6}}
draft_runs = {}
for name, choice in drafters.items():
    llm = LLM(num_kv_blocks=64, max_num_seqs=4, seed=0,
              speculative_config={"method": "draft_model", "num_speculative_tokens": 3, **choice})
    draft_proposer = llm.llm_engine.model_runner.proposer
    batch_propose, guesses = draft_proposer.propose_batch, []

    def recording_propose_batch(requests, room, batch_propose=batch_propose, guesses=guesses):
        drafts = batch_propose(requests, room)
        guesses.extend((len(req.output_token_ids), d) for req, d in zip(requests, drafts))
        return drafts

    draft_proposer.propose_batch = recording_propose_batch
    with llm.llm_engine.record_traces() as draft_traces:
        out = llm.chat(ocean, FREE, use_tqdm=False)[0].outputs[0]
    st = llm.get_stats()
    draft_runs[name] = dict(same=list(out.token_ids) == reference, steps=len(draft_traces), guesses=guesses,
                            drafts=st.num_spec_draft_tokens, accepted=st.num_spec_accepted_tokens,
                            rate=st.spec_acceptance_rate,
                            trace_accepted=sum(t.num_accepted_tokens for t in draft_traces))
    print(f"{name:18}: {st.num_spec_accepted_tokens:2d} of {st.num_spec_draft_tokens:2d} drafts accepted, "
          f"acceptance rate {st.spec_acceptance_rate:.0%}; {len(out.token_ids)} tokens in {len(draft_traces)} "
          f"steps; output identical to plain greedy: {draft_runs[name]['same']}")
    del llm, draft_proposer

# %% [markdown]
# The target as its own draft proposes exactly what the target then chooses: every draft is accepted, each
# verification step gives k + 1 = 4 tokens, and the output is plain greedy's. (It is no faster: the draft costs
# as much as the target. It is the exactness check of the machinery.) The first-layers draft is cheap but
# almost always wrong. Its guesses next to the tokens the target produced at the same positions:

# %%
for n_out, drafts in draft_runs["its first 6 layers"]["guesses"][:6]:
    target_tokens = reference[n_out:n_out + len(drafts)]
    print(f"after {n_out:2d} output tokens: draft {show(drafts):32} target {show(target_tokens)}")

# %% [markdown]
# A truncated model's hidden state after layer 6 is not what the final norm and the LM head were trained on
# (they read layer 30's), so its argmax rarely is the target's and the acceptance rate above is low. Wrong
# drafts cost only speed: the output is still the target's. A useful draft must be a model trained to predict
# the next tokens: a small model of the same family with the same tokenizer, or, in vLLM, EAGLE-style heads
# trained on the target's own hidden states.
#
# ## Check yourself
#
# Run this cell. It replays the lesson's claims: a verification step returns one row per position; the n-gram
# proposer's drafts are the tokens after the latest earlier match; the trace's counts equal the engine's
# counters; a step keeps its accepted drafts plus one; the rejection sampler's kept tokens follow p and
# "always accept" does not; greedy verification stops at the first mismatch; rejected drafts' positions are
# never counted in `num_computed_tokens` nor hashed; greedy output is the same with and without speculation;
# and a draft model changes no token, the target as its own draft having every draft accepted.

# %%
assert param_bytes == sum(p.numel() * p.element_size() for p in runner.model.parameters()) and param_bytes > 5e8

toy = NgramProposer(num_speculative_tokens=3, prompt_lookup_min=2, prompt_lookup_max=4)
assert toy.propose([5, 6, 7, 8, 9, 5, 6, 7]) == [8, 9, 5], "the tokens after the longest match"
assert toy.propose([1, 2, 3, 4]) == [], "no repeat, no drafts"
assert toy.propose([1, 2, 9, 1, 2, 8, 1, 2]) == [8, 1, 2], "the latest earlier occurrence"

assert sum(nd for nd, *_ in by_step) == stats.num_spec_draft_tokens
assert sum(t.num_accepted_tokens for t in traces) == stats.num_spec_accepted_tokens, "the trace is the counter"
assert all(len(k) == na + 1 for (nd, na, k, _), st in zip(by_step, after[1:]) if nd and not st["finished"]), \
    "a verification step keeps its accepted drafts + 1 token"
assert all(k[:na] == prop[1][:min(na, len(k))] for nd, na, k, prop in by_step), "accepted tokens are the drafts"
assert sum(gained) == len(copy_ids) - 1 and len(by_step) < len(copy_ids) / 2, "fewer than half the steps"

assert results["RejectionSampler (draft from q)"][1] > 0.001, "the rejection rule's tokens follow p"
assert results["RejectionSampler (n-gram draft t1)"][1] > 0.001, "with a certain draft too"
assert results["always accept (wrong)"][1] < 1e-10, "always accepting gives q, not p"
assert abs(float((torch.tensor([len(k) for k in kept]) == 2).float().mean()) - float(overlap.sum())) < 0.02
assert RejectionSampler._greedy([4, 5, 6], [4, 5, 7, 9]) == [4, 5, 7], "greedy: stop at the first mismatch"
assert RejectionSampler._greedy([4, 5], [4, 5, 9]) == [4, 5, 9], "all accepted: a bonus token"

for s in range(1, len(after)):
    nd, na = by_step[s - 1][:2]
    if not after[s]["finished"]:
        assert after[s]["num_computed"] == after[s - 1]["num_computed"] + 1 + na, "only kept tokens are computed"
    for pos in rejected_positions(s):
        blk = after[s]["table"][pos // BS]
        assert blk not in after[s]["cached"], "a block with a rejected draft's slot was hashed"
assert cached_ok and consistent and len(final["cached"]) > 0

assert all(x == y for x, y in zip(runs["plain"]["ids"], runs["speculative"]["ids"])), "greedy output changed"
assert runs["speculative"]["steps"] < runs["plain"]["steps"]

itself, first_layers = draft_runs["the target itself"], draft_runs["its first 6 layers"]
assert itself["same"] and first_layers["same"], "a draft model changed the output"
assert itself["drafts"] > 0 and itself["accepted"] == itself["drafts"], "the target as its own draft: all kept"
assert first_layers["drafts"] > 0 and first_layers["rate"] < 0.5
assert all(r["trace_accepted"] == r["accepted"] for r in draft_runs.values()), "the trace is the counter"
print("all checks passed")
