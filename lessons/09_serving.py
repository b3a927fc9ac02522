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
# # Lesson 09: serving: the async engine, streaming, and the OpenAI API
#
# Until now we drove the engine by hand: `add_request`, then `step()` in a loop until nothing is left. A
# server cannot work like that. Clients arrive whenever they like, each wants its tokens *as they are made*,
# some hang up halfway, and some send nonsense. Yet `LLMEngine` is a plain, single-threaded object: one
# `step()` at a time, and nothing else may touch it while a step runs.
#
# `minivllm/engine/async_llm.py` (vLLM's `AsyncLLMEngine`) squares that circle with one rule: **only one
# thread ever calls the engine**. Everybody else talks to that thread through a command queue and gets outputs
# back through per-request streams:
#
# ```
# asyncio loop (HTTP handlers, the dashboard)           engine thread
# add_request() ── command ──> command queue ─────────> engine.add_request(...)
# stream  <── RequestOutput ── call_soon_threadsafe <── engine.step() outputs
# client gone: stream closed ── command ─────────────> engine.abort_request(id)
# dashboard <── snapshot() <── lock ────────────────── a StepTrace per step, stats
# ```
#
# The engine thread's loop: run every queued command (add, abort, pause, ...), then one step, and sleep on
# the queue when there is nothing to step. Continuous batching needs nothing more: a request added between
# two steps simply joins the next one. That is also why the HTTP routes take a single trip to the engine thread
# per request (`add_requests(build)`: tokenize, size `max_tokens` from the prompt, add, all in one command):
# every command waits for the step in flight, so a tokenize command and then an add command would make each
# request sit out one whole step before it joins. If a step raises (in the model, the sampler, the detokenizer), the
# engine rolls it back, so the scheduler and the KV cache are exactly as they were before it; only the
# requests that step had scheduled end, with an error (the API answers them with a 500), and the rest keep
# being served.
#
# On top of it, `minivllm/entrypoints/api_server.py` is an OpenAI-compatible HTTP server (its request bodies are
# read in `minivllm/entrypoints/protocol.py`, and run and answered by `serving_completion.py` and `serving_chat.py`
# on `serving_engine.py`, as vLLM names them), and `minivllm/entrypoints/dashboard.py` a
# Gradio page; `python app.py` runs both on one engine. This lesson uses the async engine directly, then
# starts the HTTP server inside the notebook and talks to it with the official `openai` client.

# %%
import warnings

warnings.filterwarnings("ignore", message="IProgress not found")   # tqdm's notice when ipywidgets is absent

import asyncio
import json

import httpx
import matplotlib.pyplot as plt
import openai
import torch
from IPython.display import HTML, display
from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator

from minivllm import SamplingParams
from minivllm.core.sampling_params import RequestOutputKind
from minivllm.engine.async_llm import AsyncLLMEngine
from minivllm.entrypoints.api_server import build_api_server, run_server_in_thread
from minivllm.entrypoints.block_grid import GRID_CSS, RequestPalette, render_block_grid
from minivllm.entrypoints.dashboard import DASHBOARD_CSS, render_queues
from minivllm.entrypoints.dashboard_history import PHASE_COLORS, render_step_log, render_timelines, request_phases

torch.manual_seed(0)
torch.set_num_threads(1)   # one thread: faster on a busy 2-core CPU, and the same float sums everywhere

# %% [markdown]
# ## 1. An engine with a thread of its own
#
# `AsyncLLMEngine.from_engine_args(...)` builds an `LLMEngine` (any `EngineConfig` field) and starts the
# engine thread. A small pool (64 blocks) keeps the block pictures readable.

# %%
async_engine = AsyncLLMEngine.from_engine_args(num_kv_blocks=64, seed=0)
tokenizer = async_engine.tokenizer
snap = async_engine.snapshot()
print("engine thread running:", async_engine.is_running)
print("KV blocks:", snap.stats.num_kv_blocks, "free:", snap.stats.num_free_blocks)

# %% [markdown]
# ### Streaming one request
#
# `async_engine.generate(prompt, params)` is an async generator: one `RequestOutput` per step that made a
# token; the last has `finished=True`. What each output carries is `SamplingParams.output_kind`, as in vLLM:
# `CUMULATIVE` (the default: everything so far), `DELTA` (only what is new since the previous output) or
# `FINAL_ONLY` (one output at the end, what `LLM.generate` uses). Streaming uses `DELTA`, as vLLM's server
# does: then `out.outputs[0].text` and `out.outputs[0].token_ids` hold just the new piece. A notebook cell
# can `await` directly, so `async for` works at the top level.

# %%
question = async_engine.chat_prompt([{"role": "user", "content": "What is the capital of France?"}])
greedy = SamplingParams(temperature=0, max_tokens=16, output_kind=RequestOutputKind.DELTA)

deltas = []
async for out in async_engine.generate(question, greedy):
    deltas.append(out.outputs[0].text)
print(deltas)
print("finish reason:", out.outputs[0].finish_reason)

# %% [markdown]
# Each delta is one token's worth of text (a token that completes no character yet would give an empty
# delta, and text that might still turn into a stop string is held back: the exercise below). The last one is
# empty: its token is the end-of-sequence token `<|im_end|>`, which ends the request and, as in vLLM, is
# left out of the text. Joined, the deltas are exactly the text that the default, `CUMULATIVE`, outputs end
# with: that is all a streaming client has to do.
#
# Why deltas: streaming n tokens as deltas hands out each token once, O(n) in time and memory, where
# cumulative outputs copy the whole answer so far at every token, 1 + 2 + ... + n tokens in all, O(n^2)
# (`tests/test_streaming_cost.py` measures it). The text is the same either way:

# %%
cumulative = [out.outputs[0].text async for out in async_engine.generate(
    question, SamplingParams(temperature=0, max_tokens=16))]
print("the last cumulative output:", repr(cumulative[-1]))
copied = sum(len("".join(deltas[:i + 1])) for i in range(len(deltas)))
print(f"characters these {len(deltas)} outputs carry: {sum(map(len, deltas))} as deltas, "
      f"{copied} if each were cumulative")

# %%
assert "".join(deltas) == cumulative[-1] and out.finished

# %% [markdown]
# ### Exercise: hold back what may become a stop string
#
# With stop strings a delta is not simply one token's text. `SamplingParams(stop=[...])` ends a request at the
# first stop string and leaves the stop string out of the text. But a stop string can span tokens: when the text
# so far ends in `" Par"`, nobody knows yet whether `" Paris"` is coming, and text once streamed cannot be taken
# back. So the output processor (`engine/output_processor.py`) holds back the end of the text that could still
# be the start of a stop string, and sends it with a later delta.
#
# Write what it does. `stream_deltas(pieces, stop)` takes `pieces`, the new text of each step's token as the
# detokenizer gives it (`""` for a token that completes no character yet, or for the end-of-sequence token),
# and the list of stop strings `stop`; it returns the text of each step's DELTA output, one per step:
#
# - keep the text not sent yet; each step, add the new piece to it;
# - if a stop string occurs in that text, the step's delta is the text before it (the earliest occurrence of
#   any of them) and the stream ends there, whatever pieces are left;
# - otherwise send all but the last `max(len(s) for s in stop) - 1` characters (a stop string not complete yet
#   can only have started there) and keep those;
# - the last piece (the request ended by length or end-of-sequence) sends everything still held back.
#
# With no stop strings nothing is held back, and the deltas are the pieces. `check` runs your function on
# hand-made pieces, then on 16 streams of a real engine of its own, with stop strings cut from its own answers
# (inside a token, across two tokens, one that never comes, several at once), comparing your deltas with the
# ones the engine streamed. (In CI the lessons run with the solutions, from `lessons/solutions/`; try first.)

# %%
from course import check, exercise


@exercise("09.stream_deltas")
def stream_deltas(pieces, stop):
    deltas, pending = [], ""
    # your code here
    raise NotImplementedError


check(stream_deltas)

# %% [markdown]
# The answer of section 1 again, now with `stop=[" Paris"]`: streamed by the engine, and predicted by your
# function from the pieces streamed above without a stop string (then each delta is one token's piece). The
# first token's text waits whole; the stream ends before `" Paris"`.

# %%
stop_params = SamplingParams(temperature=0, max_tokens=16, stop=[" Paris"], output_kind=RequestOutputKind.DELTA)
held_back = [out.outputs[0].text async for out in async_engine.generate(question, stop_params)]
predicted = stream_deltas(deltas, [" Paris"])
print("stream_deltas:", predicted)
print("the engine sent:", repr("".join(held_back)))


def boundaries(parts):
    """Where each delta ends in the joined text."""
    ends, n = set(), 0
    for p in parts:
        n += len(p)
        ends.add(n)
    return ends


# The same text, cut at the same places. (The async stream merges the DELTA outputs a slow reader has not
# taken yet into one, so the engine's cuts may be fewer than the prediction's, never others.)
assert "".join(held_back) == "".join(predicted) and boundaries(held_back) <= boundaries(predicted)

# %% [markdown]
# The real code is a few lines of `OutputProcessor.process_outputs`. `window` is the text held back plus the new
# piece; `find_stop_string` looks only where the new piece could have completed a stop string, since anything
# earlier was searched in an earlier step; `cut` is where what is sent ends, and `max_holdback` is the
# number of characters held back:

# %%
import inspect

from minivllm.engine.output_processor import OutputProcessor, RequestState

print(inspect.getsource(RequestState.max_holdback.fget))
lines = inspect.getsource(OutputProcessor.process_outputs).splitlines()
start = next(i for i, line in enumerate(lines) if "window = st.pending" in line)
print("\n".join(lines[start - 1:start + 9]))

# %% [markdown]
# ## 2. Many clients, one step at a time
#
# The engine thread steps as fast as it can, so whom a step batches depends on when requests arrive. To
# look at it calmly we use the dashboard's teaching controls: `pause()` stops stepping (commands still run),
# `step_once()` runs exactly one step, `resume()` lets it go. (With async scheduling, on by default on a GPU, a
# step normally leaves the next batch running on the device; a paused engine first finishes it, and its single
# steps run one batch all the way, so what you see is all there is.)
#
# Three clients ask three questions behind the same system prompt. Each `add_request` validates and queues a
# request and returns its `RequestStream`; nothing runs while the engine is paused.

# %%
SYSTEM = ("You are a patient teacher. Answer in one short sentence, in plain words, for a curious child who "
          "likes examples.")
QUESTIONS = {"sky": "Why is the sky blue?", "ice": "Why does ice float?", "bees": "How do bees make honey?"}


def chat(text):
    return async_engine.chat_prompt([{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}])


async def wait_for_step(n, engine=async_engine):
    while engine.snapshot().stats.num_steps < n:
        await asyncio.sleep(0.01)


async_engine.pause()
streams = {rid: await async_engine.add_request(chat(q), greedy, request_id=rid) for rid, q in QUESTIONS.items()}
await asyncio.sleep(0.2)
snap = async_engine.snapshot()
print("paused:", snap.paused, "| steps so far:", snap.stats.num_steps, "| waiting:", snap.stats.num_waiting)

# %% [markdown]
# Now one step. The snapshot is what the dashboard reads: a copy taken under a lock, so another thread can
# read it while the engine keeps going. Its `trace` is the last step's `StepTrace` (lessons 03 and 04).


# %%
def describe(t):
    ran = ", ".join(f"{r.request_id} {r.kind} {r.num_scheduled_tokens}" for r in t.requests if r.kind)
    return f"step {t.step}: {ran} | blocks held {t.num_kv_blocks - t.num_free_blocks}"


first_step = async_engine.snapshot().stats.num_steps + 1
async_engine.step_once()
await wait_for_step(first_step)
trace = async_engine.snapshot().trace
print(describe(trace))
print("prefix hits on blocks:", trace.prefix_hit_blocks)

# %% [markdown]
# All three prompts ran as one prefill batch. They share the system prompt, so the second and third found its
# full blocks in the prefix cache *within the same step* (lesson 01). The dashboard draws the pool as a grid:
# one cell per block, in the colour of the request holding it; a block several requests share is hatched in
# their colours, with the ref count written in it. A trace lists only the blocks its step touched, so for the
# whole pool the dashboard asks for `snapshot(with_pool=True)`, which adds the block pool's ref counts, copied on
# the engine thread between two steps. The snapshot also holds the queues (`snap.queues`), taken at the same
# moment as the counts, so the panels never disagree with each other. The same render functions, in the
# notebook:

# %%
snap = async_engine.snapshot(with_pool=True)
palette = RequestPalette()                       # the page keeps one: a request keeps its colour while it lives
display(HTML(f"<style>{DASHBOARD_CSS}{GRID_CSS}</style>"
             + render_block_grid(snap.trace, snap.stats.num_kv_blocks, snap.pool, palette=palette)
             + render_queues(snap.queues)))
shared = {b: n for b, n in enumerate(snap.pool.ref_counts) if n > 1}
print("blocks held by more than one request (block: ref count):", shared)
assert shared and all(n == len(streams) for n in shared.values())      # the system prompt's blocks, held by all

# %% [markdown]
# Two more single steps: every request decodes one token per step.

# %%
for n in (first_step + 1, first_step + 2):
    async_engine.step_once()
    await wait_for_step(n)
    print(describe(async_engine.snapshot().trace))

# %% [markdown]
# Now let the engine run and read the three streams at once. Each stream already holds the outputs of the
# steps we took: nothing is lost while nobody reads, and nothing piles up either. A stream keeps at most one
# unread output (vLLM's `RequestOutputCollector`): a new delta is merged into it (a new cumulative output
# replaces it), so a reader that falls behind gets the missed text in one piece.


# %%
async def read(stream):
    text = ""
    async with stream:                 # leaving this block early would abort the request
        async for out in stream:
            text += out.outputs[0].text    # a DELTA output: only the new text
    return text, out.outputs[0].finish_reason


async_engine.resume()
answers = dict(zip(streams, await asyncio.gather(*(read(s) for s in streams.values()))))
for rid, (text, reason) in answers.items():
    print(f"{rid:5} {reason:6} {text!r}")
section2_steps = async_engine.snapshot().recent_traces          # kept for the dashboard's views in section 5

# %% [markdown]
# ## 3. A client that hangs up
#
# A client that stops reading must not leave its request running: it would spend steps and hold blocks for
# nobody. Leaving `async for` early (with `break`, an exception or a cancelled task) closes the generator, and
# closing it sends an abort command; the engine thread frees the request's blocks before its next step.

# %%
long_params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
gen = async_engine.generate(chat("Tell me a very long story about the sea."), long_params, request_id="story")
async for out in gen:
    if len(out.outputs[0].token_ids) >= 3:   # CUMULATIVE (long_params' default): all tokens so far
        break
await gen.aclose()                      # what the HTTP server does when the connection drops

while async_engine.snapshot().num_requests:
    await asyncio.sleep(0.01)
snap = async_engine.snapshot()
print("story ended with:", async_engine.finish_reason_of("story"))
print("free blocks:", snap.stats.num_free_blocks, "of", snap.stats.num_kv_blocks)
print("last event:", snap.events[-1].split(": ", 1)[1])

# %% [markdown]
# ## 4. The OpenAI-compatible API
#
# `build_api_server(async_engine)` returns a FastAPI app with `GET /v1/models`, `POST /v1/completions`,
# `POST /v1/chat/completions` (streamed or not), `GET /health` and `GET /metrics`. `python app.py` serves it
# with uvicorn on port 8000; here we run uvicorn on a thread, on a free port, against the engine we already
# have.
#
# Between the HTTP handlers and the engine sits a front end (`entrypoints/renderer.py`, vLLM's API server does the
# same in its own process): chat templates are rendered and prompts tokenized in a worker thread of its own, so
# neither the event loop (every client's handler) nor the engine thread (every client's next token) ever waits
# for one request's text. It also refuses what no request should cost: a body over 8 MiB (413), a prompt with
# more characters than `max_model_len` tokens can hold (400, before tokenizing), a request's own chat template
# unless the server trusts them, a structured-output schema nested too deep. And a long prompt is prefilled in
# chunks of `long_prefill_token_threshold` tokens (96 on a CPU), so the streams already running keep getting a
# token every step.

# %%
# NBVAL_IGNORE_OUTPUT
server = run_server_in_thread(build_api_server(async_engine))
print("serving on", server.url)

# %% [markdown]
# The official `openai` client needs only the base URL. Any API key will do: this server was started without
# `api_key=` (with one, every `/v1` route wants `Authorization: Bearer <key>`, as vLLM's `--api-key`).

# %%
client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
print([m.id for m in client.models.list().data])

response = client.chat.completions.create(
    model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": "What is the capital of France?"}],
    max_tokens=16, temperature=0)
print(response.choices[0].message.content)
print(response.choices[0].finish_reason, response.usage.prompt_tokens, response.usage.completion_tokens)

# %% [markdown]
# With `stream=True` the server answers with server-sent events: one `data: {...}` line per chunk, and a
# final `data: [DONE]`. The client turns them into chunk objects. `stream_options={"include_usage": True}`
# adds a last chunk with the token counts and no choices.

# %%
stream = client.chat.completions.create(
    model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": "Name three primary colors."}],
    max_tokens=24, temperature=0, stream=True, stream_options={"include_usage": True})
pieces = []
for chunk in stream:
    if chunk.choices:
        pieces.append(chunk.choices[0].delta.content or "")
        reason = chunk.choices[0].finish_reason
    else:
        usage = chunk.usage
print(pieces)
print("finish reason:", reason, "| completion tokens:", usage.completion_tokens)

# %% [markdown]
# The same thing without a client library: the raw events of a completion (`curl -N` shows the same).

# %%
body = {"model": "SmolLM2-135M-Instruct", "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0,
        "stream": True}
with httpx.stream("POST", server.url + "/v1/completions", json=body) as r:
    for line in r.iter_lines():
        if line:
            data = line.removeprefix("data: ")
            print(data if data == "[DONE]" else {k: v for k, v in json.loads(data)["choices"][0].items()
                                                 if k in ("text", "finish_reason")})

# %% [markdown]
# ### Bad requests
#
# Everything a client sends is checked before the engine sees it. A bad value is a 400 with OpenAI's error
# body, which the client raises as `BadRequestError`; the engine never notices.

# %%
for bad in ({"temperature": -1}, {"top_p": 1.5}, {"n": 0}, {"max_tokens": 0}):
    try:
        client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": "hi"}],
                                       **bad)
    except openai.BadRequestError as e:
        print(e.status_code, e.body["param"], "|", e.body["message"])

# %% [markdown]
# ### Sixteen clients at once
#
# Sixteen clients stream at the same time, each with its own HTTP connection. The server turns every one into
# an engine request, and the engine batches whoever is there at each step. We record the steps (a trace
# listener added *on the engine thread*, through `call`) and count the requests running in each.

# %%
traces = []
async_engine.call(lambda engine: engine.add_trace_listener(traces.append)).result()


async def one_client(aclient, i):
    stream = await aclient.completions.create(model="SmolLM2-135M-Instruct", prompt=f"A fun fact about the number {i}:",
                                              max_tokens=12, temperature=0, stream=True)
    return "".join([chunk.choices[0].text async for chunk in stream])


async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none") as aclient:
    texts = await asyncio.gather(*(one_client(aclient, i) for i in range(16)))
async_engine.call(lambda engine: engine.remove_trace_listener(traces.append)).result()
print(len(texts), "answers; the first two:", texts[:2])

# %%
# NBVAL_IGNORE_OUTPUT
phases = request_phases(traces)                 # request id -> [(step, what it did there)], dashboard_history.py
steps = [t.step for t in traces]
fig, (lanes, tokens) = plt.subplots(1, 2, figsize=(11, 3.6), gridspec_kw={"width_ratios": [3, 2]})
for row, (rid, seen) in enumerate(phases.items()):
    for step, phase in seen:
        lanes.barh(row, 1, left=step - 0.5, color=PHASE_COLORS[phase], edgecolor="white", linewidth=0.5)
lanes.set_yticks(range(len(phases)), [f"client {i}" for i in range(len(phases))], fontsize=7)
lanes.invert_yaxis()
lanes.set_xlabel("engine step")
lanes.set_title("each client's request, step by step")
lanes.legend(handles=[Patch(color=c, label=p) for p, c in PHASE_COLORS.items() if p != "running"],
             fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=6, frameon=False)
prefill = [t.num_prefill_tokens for t in traces]
decode = [t.num_decode_tokens for t in traces]
tokens.bar(steps, decode, color=PHASE_COLORS["decode"], label="decode tokens")
tokens.bar(steps, prefill, bottom=decode, color=PHASE_COLORS["prefill"], label="prefill tokens")
tokens.set_xlabel("engine step")
tokens.set_title("tokens computed per step")
tokens.legend(fontsize=7)
for ax in (lanes, tokens):
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
plt.tight_layout()
plt.show()
print("largest batch:", max(t.num_running for t in traces), "requests;", len(traces), "steps for 16 x 12 tokens")

# %%
assert len(phases) == 16 and all(seen[-1][1] == "finished" for seen in phases.values())
assert max(sum(1 for r in t.requests if r.kind) for t in traces) > 1    # clients shared steps

# %% [markdown]
# The left panel is the dashboard's timeline view, drawn with matplotlib: a row per client, a cell per step.
# The requests arrive a few milliseconds apart. If a step starts before the last of them is in, it runs the
# early ones and the rest join at the next step; either way they are soon all in one batch, and they finish
# together (unless one stops early, at EOS). That is the point of serving through one engine: sixteen clients
# cost little more per step than one.
#
# ### /metrics
#
# `GET /metrics` is the Prometheus text format, with vLLM's metric names wherever vLLM has the same metric:
# queue lengths, KV usage, prefix-cache hits, preemptions, finished requests by reason, and histograms of
# time-to-first-token and inter-token latency. A Prometheus server scrapes it every few seconds.

# %%
metrics = httpx.get(server.url + "/metrics").text
for line in metrics.splitlines():
    if line.startswith(("vllm:num_requests_running", "vllm:num_free_kv_blocks", 'vllm:request_success_total')):
        print(line)

# %% [markdown]
# ## 5. The dashboard
#
# `python app.py` serves this API and, at `/`, the Gradio dashboard: a chat that streams tokens, a "burst N
# requests" button, and panels refreshed twice a second from `async_engine.snapshot()`: the block grid above,
# each request's block table, the queues, KV usage and prefix-cache hit rate, tokens per step, the event log,
# a summary line per step and each request's timeline, with Pause / Single step / Resume buttons that call the
# methods used in section 2. The panels are pure functions (`minivllm/entrypoints/dashboard.py`,
# `block_grid.py`, `dashboard_history.py`), so you can render any snapshot yourself. Section 2's steps, as the
# dashboard's step log and timelines draw them:

# %%
display(HTML(render_step_log(section2_steps, limit=8) + render_timelines(section2_steps, limit=8)))

# %% [markdown]
# And the page itself, as the browser test (`tests/test_app_ui.py`) photographs it during "Load demo traffic" on
# a 24-block pool: 24 requests behind one system prompt (its blocks hatched: shared), a queue, and the chat, sent
# with priority 5, told that it was preempted and why.
#
# ![the dashboard during the demo traffic](images/dashboard_preempted.png)
#
# ```bash
# python app.py --num-kv-blocks 256           # then open http://127.0.0.1:8000/
# curl http://127.0.0.1:8000/v1/chat/completions -H "Content-Type: application/json" \
#      -d '{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 16}'
# ```
#
# Done with the server: stop uvicorn, then the engine thread.

# %%
server.stop()
async_engine.shutdown()
print("engine thread running:", async_engine.is_running)

# %% [markdown]
# ## Check yourself
#
# Run this cell. It starts a fresh async engine and server and replays the lesson's claims: streamed deltas
# add up to the answer, a paused engine runs exactly the steps it is given, a client that leaves early is
# aborted and its blocks come back, the API answers a streamed chat and refuses a bad one with a 400, and
# concurrent clients share steps.


# %%
async def self_check():
    ae = AsyncLLMEngine.from_engine_args(num_kv_blocks=64, seed=0)
    srv = run_server_in_thread(build_api_server(ae))
    try:
        outs = [o async for o in ae.generate(question, greedy)]
        assert "".join(o.outputs[0].text for o in outs) == answer_text and outs[-1].finished

        ae.pause()
        s = await ae.add_request(chat(QUESTIONS["sky"]), greedy, request_id="check")
        steps = ae.snapshot().stats.num_steps
        ae.step_once()
        await wait_for_step(steps + 1, ae)
        await asyncio.sleep(0.2)
        assert ae.snapshot().stats.num_steps == steps + 1, "a paused engine runs only the steps it is given"
        ae.resume()
        async with s:
            async for o in s:
                break                                   # leave early: aborted
        while ae.snapshot().num_requests:
            await asyncio.sleep(0.01)
        assert ae.finish_reason_of("check") == "abort"
        assert ae.snapshot().stats.num_free_blocks == 64

        c = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="none")
        chunks = [ch async for ch in await c.chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": "Name three primary colors."}],
            max_tokens=24, temperature=0, stream=True)]
        assert [ch.choices[0].delta.content or "" for ch in chunks] == pieces
        try:
            await c.completions.create(model="SmolLM2-135M-Instruct", prompt="hi", top_p=0)
            raise AssertionError("top_p=0 must be refused")
        except openai.BadRequestError as e:
            assert e.status_code == 400 and e.body["param"] == "top_p"

        recorded = []
        ae.call(lambda engine: engine.add_trace_listener(recorded.append)).result()
        await asyncio.gather(*(c.completions.create(model="SmolLM2-135M-Instruct", prompt=f"Fact {i}:",
                                                    max_tokens=12, temperature=0) for i in range(8)))
        assert max(sum(1 for r in t.requests if r.kind) for t in recorded) >= 4, "concurrent clients share steps"
        await c.close()
        ae.call(lambda engine: engine.check_integrity()).result()
    finally:
        srv.stop()
        ae.shutdown()
    return "all checks passed"


answer_text = "".join(deltas)
await self_check()
