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
# "prompt_lookup_max": 4})`. Then: what checking k tokens costs, the n-gram proposer at work, the rejection
# rule checked numerically, a rejection in the KV blocks, speculation on vs off, and a draft model.

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
torch.set_num_threads(1)   # one thread: the same float sums everywhere

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
# the work per weight is tiny (2 FLOPs for every 4 bytes in fp32), so a one-token step is bound by how fast the
# weights come from memory (lesson 10's roofline). First the bytes, counted from the loaded model itself.

# %%
runner = plain.llm_engine.model_runner
params = list(runner.model.parameters())
param_bytes = sum(p.numel() * p.element_size() for p in params)
num_params = sum(p.numel() for p in params)
linear_per_token = cfg.num_hidden_layers * sum(i * o for i, o in linear_shapes(cfg)) + cfg.hidden_size * cfg.vocab_size
print(f"{num_params / 1e6:.1f} M parameters in {runner.dtype}: {param_bytes / 2**20:.0f} MiB, read by every step "
      f"(embedding tied to the LM head: {cfg.tie_word_embeddings})")
print(f"FLOPs per token through the matmuls: 2 x {linear_per_token / 1e6:.1f} M = "
      f"{2 * linear_per_token / 1e9:.2f} GFLOP")

# %% [markdown]
# Now the real forward, on a batch we build ourselves (a `ModelInput`, what `prepare_inputs` makes): one request
# with 256 tokens in the KV cache and `q` new tokens after them, a row of logits for each: the shape of a
# verification step with `q - 1` drafts. We time `execute_model` for q = 1 (a plain decode) up to 33,
# interleaved and repeated, keeping the fastest run of each (the least disturbed by other work).

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
fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.6))
qs = torch.arange(1, max(Q) + 1)
left.plot(Q, [best[q] * 1e3 for q in Q], "o-", label="measured step (fastest of 5)")
left.plot(qs, torch.maximum(torch.full(qs.shape, memory_floor), qs * compute_per_token) * 1e3, "--",
          color="tab:gray", label="roofline: max(weight bytes / bandwidth, q x FLOPs / matmul rate)")
left.axhline(memory_floor * 1e3, color="tab:red", lw=0.8, label="read every weight once")
left.set(xlabel="new tokens in the step (1 + drafts)", ylabel="ms per step", ylim=(0, None), title="one step")
left.legend(fontsize=7, loc="upper left")
right.plot(Q, [best[q] / q * 1e3 for q in Q], "o-", color="tab:green")
right.set_xscale("log", base=2)
right.set_xticks(Q, [str(q) for q in Q])
right.set(xlabel="new tokens in the step", ylabel="ms per token", ylim=(0, None),
          title="per token (if every draft were accepted)")
fig.suptitle(f"SmolLM2-135M on this CPU ({runner.dtype}, 1 thread), {CONTEXT} tokens of context")
fig.tight_layout()
plt.show()

# %% [markdown]
# Read the left plot against its roofline: a one-token step costs at least the time to stream every weight
# (red line), however little arithmetic it does, and the arithmetic grows with q until it overtakes that
# floor (where, on this machine, the printout above says). Below that point the extra rows of a verification
# step ride along with the weight read. On a GPU the ridge is in the hundreds of FLOPs per byte (lesson 11),
# so a step of 5 tokens costs about what a step of 1 does. That is the bet of speculative decoding: the step
# is paid for anyway; every accepted draft is a token for free.

# %% [markdown]
# ## 2. The n-gram proposer: prompt lookup
#
# The cheapest proposer needs no model. When the output copies or edits its prompt (a quoted passage, code
# being changed), the next tokens are probably the ones that followed the same few tokens earlier:
# `NgramProposer.propose` finds the latest earlier occurrence of the request's last n tokens and proposes the
# k tokens that followed it.

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
# > batch in compiled code (a Numba-jitted KMP-style scan that finds the longest matching n-gram in one pass,
# > the requests in parallel threads), and the verification (`vllm/v1/sample/rejection_sampler.py`) runs as
# > Triton kernels on the GPU. minivllm does one request at a time in plain NumPy.

# %% [markdown]
# A small model copies well when asked to. We ask SmolLM2 to copy a passage, record what the proposer gets and
# returns (a wrapper around this engine's proposer), and record the step traces (`num_draft_tokens`,
# `num_accepted_tokens` per request). Stepping by hand, we also note after every step which of the request's
# blocks are in the prefix cache (for section 4).

# %%
PASSAGE = ("Paris is the capital of France, and it is famous for the Eiffel Tower, the Louvre museum and its "
           "cafes. Every year, millions of tourists visit the city to enjoy its art, its food and its beautiful "
           "streets.")
messages = [{"role": "user", "content": "Copy this text word for word: " + PASSAGE}]
prompt_ids = tokenizer.encode(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                              add_special_tokens=False)
GREEDY = SamplingParams(temperature=0, max_tokens=80)

engine = spec.llm_engine
proposer, proposals = engine.model_runner.proposer, []     # proposals: (the tokens it got, the drafts it returned)
propose = proposer.propose


def recording_propose(token_ids, max_tokens=None):
    proposals.append((list(token_ids), propose(token_ids, max_tokens)))
    return proposals[-1][1]


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
      f"(1 prefill + {len(traces) - 1} decode steps): {tokenizer.decode(copy_ids)!r}")
stats = engine.get_stats()
print(f"drafts: {stats.num_spec_drafts} verification steps, {stats.num_spec_draft_tokens} draft tokens, "
      f"{stats.num_spec_accepted_tokens} accepted: acceptance rate {stats.spec_acceptance_rate:.2f}, "
      f"mean acceptance length {stats.spec_mean_acceptance_length:.2f} tokens per verification step")

# %% [markdown]
# The copy is nearly faithful: the model capitalised "Museum", put in two commas and wrote "Paris" for
# "the city", and at each of those the proposer's guess is wrong. The first steps: the request's last tokens,
# what the proposer proposed after them, and what the target kept.


# %%
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
    print(f"step {s:2d}: after {show(given[-3:]):18} drafts {show(drafts):30} accepted {na}/{nd}, kept {show(kept)}")

# %% [markdown]
# A step with four accepted drafts gives five tokens: the drafts and a **bonus** token the target predicts
# after the last one; a step with a wrong draft still gives one, the target's **correction**. The proposer can
# look in the wrong place: after the model's extra comma, ", and" last occurred in the output itself and
# " and its" in the prompt's second sentence, so it proposed text from the wrong spot, until a longer n-gram
# matched again. The whole copy, step by step:

# %%
# NBVAL_IGNORE_OUTPUT
fig, ax = plt.subplots(figsize=(11, 3.0))
for s, (nd, na, kept, _) in enumerate(by_step, start=1):
    out = min(na, len(kept))                             # accepted drafts in the output (a stop can cut them)
    ax.bar(s, out, color="tab:green")
    ax.bar(s, len(kept) - out, bottom=out, color="tab:blue")
    ax.bar(s, na - out, bottom=len(kept), color="white", edgecolor="tab:green", hatch="...")
    ax.bar(s, nd - na, bottom=len(kept) + na - out, color="white", edgecolor="tab:red", hatch="///")
ax.set(xlabel="decode step", ylabel="tokens", xticks=range(1, len(by_step) + 1))
ax.legend(handles=[Patch(facecolor=f, edgecolor=e, hatch=h, label=t) for f, e, h, t in (
    ("tab:green", None, None, "accepted drafts (in the output)"),
    ("tab:blue", None, None, "the target's own token (correction or bonus)"),
    ("white", "tab:green", "...", "accepted drafts after the stop (counted, not output)"),
    ("white", "tab:red", "///", "rejected drafts (computed, dropped)"))], fontsize=8, loc="upper right", ncol=2)
ax.set(ylim=(0, SPEC["num_speculative_tokens"] + 3.2), title=f"{len(copy_ids)} tokens in {len(by_step)} decode "
       "steps: tokens kept per step (bar height) and drafts wasted (red)")
fig.tight_layout()
plt.show()

# %%
gained = [len(kept) for _, _, kept, _ in by_step]
print(f"tokens kept per decode step: {gained}: {sum(gained) / len(gained):.2f} per step; "
      f"steps that verified drafts: {sum(nd > 0 for nd, *_ in by_step)}, of which all {SPEC['num_speculative_tokens']}"
      f" accepted: {sum(na == nd == SPEC['num_speculative_tokens'] for nd, na, *_ in by_step)}")
trace_accepted = sum(t.num_accepted_tokens for t in traces)
nd_last, na_last, kept_last, (_, drafts_last) = by_step[-1]
print(f"accepted drafts: {trace_accepted} in the step traces, {stats.num_spec_accepted_tokens} in the engine's "
      f"counter; last step: drafts {show(drafts_last)}, accepted {na_last}/{nd_last}, kept {show(kept_last)}")

# %% [markdown]
# The trace and the engine's counter agree (like vLLM's `spec_decode_num_accepted_tokens`, both count accepted
# drafts): at the last step all four, though the stop ends the output at `<|im_end|>` (the dotted bar).
#
# ## 3. Verification: greedy, and the rejection-sampling rule
#
# The rejection sampler gets k + 1 rows of logits for a request with k drafts: row j (the target's prediction
# after the last token and d1..dj) judges d(j+1); the last row predicts the token after dk. **Greedy**: keep
# d(j+1) while it equals row j's argmax; at the first mismatch take the argmax instead and stop.
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
fig, axes = plt.subplots(1, 3, figsize=(11, 2.9), sharey=True)
x = torch.arange(6)
axes[0].bar(x - 0.2, p, 0.4, color="tab:blue", label="target p")
axes[0].bar(x + 0.2, q, 0.4, color="tab:orange", label="draft q")
axes[1].bar(x, overlap, color="tab:green", label="min(p, q): accepted")
axes[1].bar(x, residual, bottom=overlap, color="tab:purple", label="max(p - q, 0): residual")
axes[2].bar(x, residual / residual.sum(), color="tab:purple", label="residual, renormalised")
for ax, title in zip(axes, ["the two distributions", "p = min(p, q) + max(p - q, 0)",
                            f"drawn after a rejection (prob. {residual.sum():.2f})"]):
    ax.set(xticks=x, xticklabels=[f"t{i}" for i in range(6)], ylim=(0, 0.62), title=title)
    ax.legend(fontsize=8, loc="upper right")
fig.suptitle("The rejection-sampling rule: accept where q overlaps p, fill the rest from the residual")
fig.tight_layout()
plt.show()

# %% [markdown]
# Now the real `RejectionSampler` on it: N = 20,000 requests at `temperature=1`, one draft each drawn from q,
# the target's logits `log p` on both rows, q passed as the draft's distribution. The kept first token should
# follow p; a wrong rule, "always accept the draft", keeps drafts that follow q. A chi-square test against p
# tells them apart (the p-value: P(chi-square with 5 degrees of freedom > the statistic)).

# %%
N, V = 20_000, 6
gen = torch.Generator().manual_seed(0)
rejection_sampler = RejectionSampler(Sampler(seed=0))
requests = [Request(f"r{i}", [0], SamplingParams(temperature=1.0)) for i in range(N)]
drafts_q = torch.multinomial(q, N, replacement=True, generator=gen)               # (N,) one draft each, from q
logits_p = p.log().repeat(2 * N, 1)                                               # (2N, V): rows of p
kept = rejection_sampler(logits_p, requests, [[d] for d in drafts_q.tolist()], [q[None]] * N)
kept_ngram = rejection_sampler(logits_p, requests, [[1]] * N)       # an n-gram draft is certain: t1, no q
rules = {"RejectionSampler (draft from q)": torch.tensor([k[0] for k in kept]), "always accept (wrong)": drafts_q,
         "RejectionSampler (n-gram draft t1)": torch.tensor([k[0] for k in kept_ngram])}
results = {}
for name, samples in rules.items():
    counts, expected = torch.bincount(samples, minlength=V).double(), p.double() * N
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    results[name] = chi2, float(torch.special.gammaincc(torch.tensor((V - 1) / 2.0), torch.tensor(chi2 / 2.0)))
    print(f"{name:36} frequencies {[round(f, 3) for f in (counts / N).tolist()]}  chi2 {chi2:8.1f}  "
          f"p-value {results[name][1]:.3g}")
print(f"{'target p':36} {'':12}{[round(f, 3) for f in p.tolist()]}; first draft accepted in "
      f"{sum(len(k) == 2 for k in kept) / N:.3f} of the requests; sum min(p, q) = {overlap.sum():.3f}")

# %% [markdown]
# The real rule's tokens pass the test, for a draft drawn from q and for a certain n-gram draft alike; always
# accepting fails it by a huge margin. The acceptance rate is min(p, q)'s mass: a better proposer keeps more
# drafts, and a bad one costs only speed, never correctness.
#
# ## 4. Rollback in the block picture
#
# A verification step writes KV for the last token and every draft (the scheduler allocated `1 + k` slots).
# What happens to the slots of rejected drafts? Nothing needs undoing: `update_from_output` sets
# `num_computed_tokens` to cover the last token and the accepted drafts only, so the next steps overwrite the
# rest; attention reads only positions below `seq_lens`, so the stale KV is never seen; and the prefix cache
# hashes a block only when every token in it is computed and kept.

# %%
# NBVAL_IGNORE_OUTPUT
source = inspect.getsource(Scheduler.update_from_output)
print(source[source.index("        outputs = []"):])

# %% [markdown]
# We pick a step of the copy where a rejected draft sat in a block's last slot: had the step kept it, that
# block would have been full and hashed.

# %%
def rejected_positions(s):
    """Positions whose KV step s wrote for drafts it then rejected."""
    before = after[s - 1]["num_computed"]                # = the position of the step's last token
    nd, na = by_step[s - 1][:2]
    return list(range(before + 1 + na, before + 1 + nd))


S = next(s for s in range(1, len(by_step) + 1) if any(pos % BS == BS - 1 for pos in rejected_positions(s)))
nd, na, kept_S, (given_S, drafts_S) = by_step[S - 1]
b, a = after[S - 1], after[S]
print(f"step {S}: last token {show(given_S[-1:])} at position {b['num_computed']}; drafts {show(drafts_S)} "
      f"at {b['num_computed'] + 1}..{b['num_computed'] + nd}; accepted {na}, kept {show(kept_S)}")
print(f"num_computed_tokens {b['num_computed']} -> {a['num_computed']}, num_tokens {len(b['tokens'])} -> "
      f"{len(a['tokens'])}, block table {a['table']}")
print(f"KV written for positions {b['num_computed']}..{b['num_computed'] + nd}; kept "
      f"{b['num_computed']}..{a['num_computed'] - 1}; stale (rejected drafts) {rejected_positions(S)}")
last_slot = next(pos for pos in rejected_positions(S) if pos % BS == BS - 1)
print(f"blocks in the prefix cache before: {sorted(b['cached'])}, after: {sorted(a['cached'])}; position "
      f"{last_slot}, the last slot of block {a['table'][last_slot // BS]}, holds a rejected draft: not hashed")

# %%
# NBVAL_IGNORE_OUTPUT
first_block = b["num_computed"] // BS - 1                  # the block before, and the step's block(s)
blocks_shown = range(first_block, len(a["table"]))
scheduled_seq = b["tokens"] + drafts_S                     # what the step's flat batch held, by position
rejected = set(rejected_positions(S))


def slot(pos):
    """(colour, text) of a KV slot after the step: the token whose KV the step left in it."""
    text = tokenizer.decode(scheduled_seq[pos:pos + 1]).replace(" ", "␣").replace("\n", "↵")
    if pos < b["num_computed"]:
        return "#c8c8c8", text
    if pos < a["num_computed"]:
        return "tab:green", text
    return ("#fbd5d5", text) if pos in rejected else ("white", "")


fig, ax = plt.subplots(figsize=(11, 2.9))
for i, blk in enumerate(blocks_shown):
    for j in range(BS):
        face, text = slot(blk * BS + j)
        x = i * (BS + 0.8) + j
        ax.add_patch(Rectangle((x, 0), 0.92, 1.6, facecolor=face, lw=1,
                               edgecolor="tab:red" if blk * BS + j in rejected else face))
        ax.text(x + 0.46, 0.8, text, ha="center", va="center", fontsize=7, rotation=90)
    ax.text(i * (BS + 0.8) + BS / 2, 1.8, f"block {a['table'][blk]}: "
            f"{'in the prefix cache' if a['table'][blk] in a['cached'] else 'not hashed'} after the step", ha="center")
x_nc = (a["num_computed"] // BS - first_block) * (BS + 0.8) + a["num_computed"] % BS - 0.04
ax.plot([x_nc, x_nc], [-0.15, 1.7], color="black", lw=1.5)
ax.text(x_nc, -0.3, f"num_computed_tokens = {a['num_computed']}", ha="center", va="top", fontsize=8)
ax.set(xlim=(-0.5, len(blocks_shown) * (BS + 0.8)), ylim=(-0.9, 2.2))
ax.axis("off")
fig.legend(handles=[Patch(color="#c8c8c8", label="computed before the step"),
                    Patch(color="tab:green", label="computed and kept (last token, accepted drafts)"),
                    Patch(facecolor="#fbd5d5", edgecolor="tab:red",
                          label="rejected draft's KV: stale, overwritten later")],
           loc="lower center", ncol=3, fontsize=8, frameon=False)
fig.suptitle(f"Step {S}: {nd} drafts, {na} accepted: the KV slots it wrote", fontsize=11)
fig.tight_layout(rect=(0, 0.1, 1, 1))
plt.show()

# %% [markdown]
# After the step the sequence has one new token, the target's correction: it has no KV yet, like every newest
# token, and the next step computes it into the first red slot. Block 6 had all sixteen slots written, its
# last by a rejected draft, but only those below `num_computed_tokens` hold kept tokens, so it was not hashed;
# it will be once the request's own tokens fill it.

# %%
final = after[-1]                      # the prefix cache after the whole copy: no rejected draft ever got in
final_block = {blk: tuple(final["tokens"][i * BS:(i + 1) * BS]) for i, blk in enumerate(final["table"])}
cached_ok = all(final_block[blk] == toks for blk, toks in final["cached"].items())
consistent = all(final_block[blk] == toks for st in after for blk, toks in st["cached"].items())
print(f"{len(final['cached'])} of the request's {len(final['table'])} blocks were hashed; each holds the "
      f"request's own tokens: {cached_ok}; so did every hashed block after every step: {consistent}")

# %% [markdown]
# ## 5. Same output, fewer steps
#
# Greedy speculative decoding must give plain greedy's tokens. The plain engine copies the same passages.

# %%
chat = [messages, [{"role": "user", "content": "Copy this sentence word for word: The Amazon rainforest covers much "
                    "of the Amazon basin of South America, and it is home to millions of species of insects, plants, "
                    "birds and other forms of life."}]]
runs = {}
for name, llm in (("plain", plain), ("speculative", spec)):
    steps0, start = llm.llm_engine.num_steps, time.perf_counter()
    ids = [llm.chat(conv, GREEDY, use_tqdm=False)[0].outputs[0].token_ids for conv in chat]   # one at a time
    runs[name] = dict(ids=ids, steps=llm.llm_engine.num_steps - steps0, seconds=time.perf_counter() - start)
    print(f"{name:11}: {sum(map(len, ids))} tokens in {runs[name]['steps']} steps")
print("identical with and without speculation:",
      [x == y for x, y in zip(runs["plain"]["ids"], runs["speculative"]["ids"])])

# %%
# NBVAL_IGNORE_OUTPUT
per_step = {name: r["seconds"] / r["steps"] for name, r in runs.items()}
print(f"speculative: {runs['speculative']['steps'] / runs['plain']['steps']:.2f} of the steps, "
      f"{runs['speculative']['seconds'] / runs['plain']['seconds']:.2f} of the time; one of its steps cost "
      f"{per_step['speculative'] / per_step['plain']:.2f} plain steps here")

# %% [markdown]
# Fewer steps, each dearer by what section 1 measured for its extra rows: whether the copy comes out faster
# depends on that price, which the last line printed for this machine. On a GPU, where a step of 5 tokens
# costs about what a step of 1 does, the speed-up approaches the step ratio. Where the output does not repeat
# its context (free writing), the n-gram proposer proposes nothing, and the step is a plain decode.
#
# ## 6. A draft model: a second, smaller model proposes
#
# Free writing needs a proposer that *predicts* text: vLLM's `draft_model` method, a smaller model with the
# target's tokenizer (`speculative_config={"method": "draft_model", "num_speculative_tokens": 3, "model": PATH}`,
# `spec_decode/draft_model.py`), its KV cache under the target's block ids. Each step the draft runs the same
# flat batch (`observe`), then `propose_batch` makes k batched one-token passes, each argmax the next draft
# (certain drafts: section 3's verifier keeps the target's output). `draft_num_layers: N` instead of `model`
# keeps the target's own first N layers. Two drafts on a prompt with nothing to copy: the target itself, and
# its first 6 of 30 layers; a wrapper on `propose_batch` records each proposal.

# %%
from minivllm.model.default_model import default_model_dir

ocean = [{"role": "user", "content": "Write one sentence about the ocean."}]
FREE = SamplingParams(temperature=0, max_tokens=24)
reference = list(plain.chat(ocean, FREE, use_tqdm=False)[0].outputs[0].token_ids)
print("plain greedy:", show(reference))
draft_runs = {}
for name, choice in {"the target itself": {"model": str(default_model_dir())},
                     "its first 6 layers": {"draft_num_layers": 6}}.items():
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
    draft_runs[name] = dict(same=list(out.token_ids) == reference, guesses=guesses, drafts=st.num_spec_draft_tokens,
                            accepted=st.num_spec_accepted_tokens, rate=st.spec_acceptance_rate,
                            trace_accepted=sum(t.num_accepted_tokens for t in draft_traces))
    print(f"{name:18}: {st.num_spec_accepted_tokens:2d} of {st.num_spec_draft_tokens:2d} drafts accepted, "
          f"acceptance rate {st.spec_acceptance_rate:.0%}; {len(out.token_ids)} tokens in {len(draft_traces)} "
          f"steps; output identical to plain greedy: {draft_runs[name]['same']}")
    del llm, draft_proposer
for n_out, drafts in draft_runs["its first 6 layers"]["guesses"][:4]:
    print(f"first 6 layers, after {n_out:2d} output tokens: draft {show(drafts):32} "
          f"target {show(reference[n_out:n_out + len(drafts)])}")

# %% [markdown]
# The target as its own draft proposes exactly what the target then chooses: every draft is accepted, each
# verification step gives k + 1 = 4 tokens, and the output is plain greedy's (no faster: the draft costs what
# the target does; it checks the machinery). The first-layers draft is cheap but mostly wrong: a hidden state
# after layer 6 is not what the final norm and LM head were trained on. Wrong drafts cost only speed. A useful
# draft is a model trained to predict the next tokens: a small model of the same family, or, in vLLM,
# EAGLE-style heads trained on the target's own hidden states.
#
# ## Check yourself
#
# Run this cell. It replays the lesson's claims: one row per position, the n-gram drafts, the trace equal to
# the counters, the rejection rule's distribution, rollback without hashing a rejected draft, the same greedy
# output with and without speculation, and draft models that change no token.

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
assert sum(gained) == len(copy_ids) - 1 and len(by_step) < len(copy_ids) / 2, "fewer than half the steps"
assert results["RejectionSampler (draft from q)"][1] > 0.001, "the rejection rule's tokens follow p"
assert results["RejectionSampler (n-gram draft t1)"][1] > 0.001, "with a certain draft too"
assert results["always accept (wrong)"][1] < 1e-10, "always accepting gives q, not p"
assert RejectionSampler._greedy([4, 5, 6], [4, 5, 7, 9]) == [4, 5, 7], "greedy: stop at the first mismatch"
assert RejectionSampler._greedy([4, 5], [4, 5, 9]) == [4, 5, 9], "all accepted: a bonus token"
for s in range(1, len(after)):
    if not after[s]["finished"]:
        assert after[s]["num_computed"] == after[s - 1]["num_computed"] + 1 + by_step[s - 1][1], "only kept tokens"
    assert all(after[s]["table"][pos // BS] not in after[s]["cached"] for pos in rejected_positions(s)), \
        "a block with a rejected draft's slot was hashed"
assert cached_ok and consistent and len(final["cached"]) > 0
assert all(x == y for x, y in zip(runs["plain"]["ids"], runs["speculative"]["ids"])), "greedy output changed"
assert runs["speculative"]["steps"] < runs["plain"]["steps"]
itself, first_layers = draft_runs["the target itself"], draft_runs["its first 6 layers"]
assert itself["same"] and first_layers["same"], "a draft model changed the output"
assert itself["drafts"] > 0 and itself["accepted"] == itself["drafts"], "the target as its own draft: all kept"
assert first_layers["drafts"] > 0 and first_layers["rate"] < 0.5
assert all(r["trace_accepted"] == r["accepted"] for r in draft_runs.values()), "the trace is the counter"
print("all checks passed")
