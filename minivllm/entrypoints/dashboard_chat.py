"""The dashboard's chat and traffic: what the page sends to the engine, and where the chat's own request is now.

Owns: the chat (one streamed answer per message), bursts of requests and the demo traffic, the ids they get, and
the chat-status line. Everything reaches the engine through `AsyncLLMEngine.generate()` and is read back through
a snapshot; nothing here holds engine state or blocks a step. dashboard.py lays out the page and wires these in.
"""

from __future__ import annotations

import asyncio
import html
import itertools
import time
from collections import Counter

from minivllm.core.sampling_params import RequestOutputKind, SamplingParams
from minivllm.engine.async_llm import AsyncLLMEngine
from minivllm.engine.stats import EngineSnapshot

# Burst prompts share one system prompt, so the prefix cache visibly hits from the second request on.
BURST_SYSTEM = ("You are a patient teacher. Answer in two short sentences, in plain words, for a curious "
                "twelve-year-old who likes examples.")
BURST_QUESTIONS = [
    "Why is the sky blue?", "How do plants make food?", "What is a prime number?", "Why do we have seasons?",
    "How does a rainbow form?", "What makes a magnet stick?", "Why does ice float?", "What is gravity?",
    "How do bees make honey?", "Why is the sea salty?", "What is an atom?", "How do airplanes fly?",
]
DEMO_REQUESTS, DEMO_MAX_TOKENS = 24, 64
STATUS_ICONS = {"queued": "⏳", "running": "▶", "preempted": "⚠", "swapped": "⚠", "finished": "✔",
                "unknown": "·"}


class DashboardChat:
    """The page's event handlers that send work: one per page, so request ids never repeat within it."""

    def __init__(self, async_engine: AsyncLLMEngine):
        self.async_engine = async_engine
        self._ids = itertools.count(1)

    async def chat(self, message: str, history: list, max_tokens: int, temperature: float, priority: float):
        """Stream one assistant answer into the chat, a token at a time. Yields (textbox, history, request id)."""
        import gradio as gr

        history = history or []
        if not message.strip():
            yield "", history, gr.skip()
            return
        request_id = f"chat-{next(self._ids)}"
        messages = [{"role": m["role"], "content": message_text(m["content"])} for m in history]
        messages.append({"role": "user", "content": message})
        history = [*history, {"role": "user", "content": message}, {"role": "assistant", "content": ""}]
        yield "", history, request_id
        answer = ""
        try:
            params = SamplingParams(temperature=float(temperature), max_tokens=int(max_tokens),
                                    output_kind=RequestOutputKind.DELTA)
            async for out in self.async_engine.generate(self.async_engine.chat_prompt(messages), params,
                                                        request_id=request_id, priority=int(priority)):
                answer += out.outputs[0].text
                history[-1] = {"role": "assistant", "content": answer}
                yield "", history, request_id
        except Exception as e:      # a bad setting or a failed step: show it in the chat, keep the page alive
            history[-1] = {"role": "assistant", "content": f"{answer}\n\n[error: {e}]"}
            yield "", history, request_id

    async def burst(self, n: int, max_tokens: int):
        """Send n requests at once (one shared system prompt, different questions) and wait for all."""
        n, max_tokens = int(n), int(max_tokens)
        batch = next(self._ids)
        start = time.perf_counter()

        async def one(i: int) -> str:
            messages = [{"role": "system", "content": BURST_SYSTEM},
                        {"role": "user", "content": BURST_QUESTIONS[i % len(BURST_QUESTIONS)]}]
            params = SamplingParams(temperature=0.8, max_tokens=max_tokens, seed=i)
            final = None
            async for final in self.async_engine.generate(self.async_engine.chat_prompt(messages), params,
                                                          request_id=f"burst{batch}-{i}"):
                pass
            return final.outputs[0].finish_reason

        results = await asyncio.gather(*(one(i) for i in range(n)), return_exceptions=True)
        reasons = Counter(r if isinstance(r, str) else "error" for r in results)
        return (f"burst {batch}: {n} requests finished in {time.perf_counter() - start:.1f} s ("
                + ", ".join(f"{k} {v}" for k, v in sorted(reasons.items())) + ")")

    async def demo_traffic(self):
        return await self.burst(DEMO_REQUESTS, DEMO_MAX_TOKENS)


def message_text(content) -> str:
    """A chat message's text. Gradio 6 hands history content back as blocks [{"type": "text", "text": ...}]."""
    if isinstance(content, str):
        return content
    if isinstance(content, dict):
        return str(content.get("text", ""))
    if isinstance(content, (list, tuple)):
        return "".join(message_text(c) for c in content)
    return "" if content is None else str(content)


def request_status(request_id: str, snap: EngineSnapshot) -> tuple[str, str]:
    """Where request `request_id` (the caller's id; an n > 1 parent's samples count as it) is now, and why:
    (state, sentence). state: queued | running | preempted | swapped | finished | unknown."""
    mine = [q for q in snap.queues.running + snap.queues.waiting if request_id in (q.request_id, q.parent_id)]
    ids = {request_id} | {r.request_id for t in snap.recent_traces for r in t.requests if r.parent_id == request_id}
    ids |= {rid for rid in snap.preempted_at if rid.endswith("_" + request_id) and rid.split("_", 1)[0].isdigit()}
    # (an n > 1 parent's samples are "0_<id>", "1_<id>", ...: engine/parallel_sampling.py)
    preempted_at = sorted({step for rid in ids for step in snap.preempted_at.get(rid, ())})
    why = ("the KV pool had no free block for the running requests' next tokens, and the scheduler preempts the "
           "lowest-priority, latest-arrived running request first (give this chat a lower priority number to "
           "protect it)")
    if mine:
        q = mine[0]
        if q.status == "running":
            again = f", after {q.num_preemptions} preemption(s)" if q.num_preemptions else ""
            return "running", f"running: {q.num_output_tokens} tokens generated{again}"
        if q.status in ("preempted", "swapped"):
            where = (f" at step {preempted_at[-1]}" if preempted_at else "")
            how = ("its KV was dropped and is recomputed when it resumes" if q.status == "preempted"
                   else "its KV was copied to the CPU pool and comes back when blocks free up")
            return q.status, f"{q.status}{where}: {why}; {how}"
        position = next(i for i, w in enumerate(snap.queues.waiting) if w is q)
        return "queued", (f"queued: position {position + 1} of {len(snap.queues.waiting)} in the waiting queue "
                          f"(priority {q.priority})")
    reason = next((r for rid, r in reversed(snap.recent_finished) if rid == request_id), None)
    if reason is not None:
        note = f", preempted at step(s) {', '.join(map(str, preempted_at))} on the way" if preempted_at else ""
        return "finished", f"finished ({reason}){note}"
    return "unknown", "not known to the engine (not sent yet, or finished long ago)"


def render_chat_status(request_id: str | None, snap: EngineSnapshot) -> str:
    """The chat's own request: queued, running, preempted (and why) or finished."""
    if not request_id:
        return '<p class="mv-chat-status" data-state="none">no chat request yet</p>'
    state, sentence = request_status(request_id, snap)
    return (f'<p class="mv-chat-status" data-state="{state}" data-request="{html.escape(request_id)}">'
            f"{STATUS_ICONS[state]} <b>{html.escape(request_id)}</b>: {html.escape(sentence)}</p>")
