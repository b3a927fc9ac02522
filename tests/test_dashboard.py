"""The dashboard's truth and history (issues 19 and 43), without a browser: its panels read one snapshot of a live
AsyncLLMEngine, list the waiting queue while the engine is paused, tell a preempted chat why, draw each step and
each request's life (in runs of steps) from the real engine's traces, give latency percentiles that numpy
computes alike from the requests' own timings, read the published snapshot without waiting for a step, and
resend only what changed. The browser half is in tests/test_app_ui.py and tests/test_dashboard_layout.py."""

from __future__ import annotations

import asyncio
import dataclasses
import re
import time

import pytest
import torch

from minivllm import SamplingParams
from minivllm.config import EngineConfig
from minivllm.core.sampling_params import RequestOutputKind
from minivllm.engine.async_llm import AsyncLLMEngine
from minivllm.engine.llm_engine import LLMEngine
from minivllm.entrypoints.dashboard import render_queues, render_stats
from minivllm.entrypoints.dashboard_chat import render_chat_status, request_status
from minivllm.entrypoints.dashboard_history import (
    PHASE_COLORS,
    num_scheduled,
    phase_runs,
    render_step_log,
    render_timelines,
    request_phases,
    step_summary,
)

BLOCK, BLOCKS = 4, 12          # 48 token slots: two 20-token prompts that generate 16 tokens each cannot both fit


@pytest.fixture(scope="module")
def engine(model_dir):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    engine = LLMEngine(EngineConfig(model=str(model_dir), device="cpu", dtype="float32", num_kv_blocks=BLOCKS,
                                    block_size=BLOCK))
    yield engine
    engine.shutdown()
    torch.set_num_threads(threads)


@pytest.fixture
def async_engine(engine):
    ae = AsyncLLMEngine(engine)
    yield ae
    ae.shutdown(shutdown_engine=False)
    assert not engine.has_unfinished_requests()
    engine.check_integrity()


def wait_until(predicate, timeout: float = 60.0) -> None:
    deadline = time.time() + timeout
    while not predicate():
        assert time.time() < deadline, "timed out"
        time.sleep(0.02)


def params(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY)


def test_paused_engine_lists_its_waiting_requests_in_queue_order(async_engine):
    """The queues panel and the stats come from one snapshot, with one definition of waiting."""
    async_engine.pause()

    async def main():
        streams = [await async_engine.add_request("Count: one, two,", params(3), request_id=rid, priority=prio)
                   for rid, prio in (("first", 0), ("second", 0), ("urgent", -1))]
        snap = async_engine.snapshot()
        assert snap.paused and snap.stats.num_steps == 0
        assert [q.request_id for q in snap.queues.waiting] == ["urgent", "first", "second"]   # priority, then age
        assert snap.stats.num_waiting == len(snap.queues.waiting) == 3 and not snap.queues.running
        panel = render_queues(snap.queues)
        listed = re.findall(r'data-request="([^"]+)" data-status="waiting"', panel)
        assert listed == ["urgent", "first", "second"] and 'data-waiting="3"' in panel
        assert "waiting 3 (of which preempted 0, swapped 0)" in render_stats(snap)
        assert "urgent (priority -1)" in panel
        assert request_status("second", snap) == ("queued", "queued: position 3 of 3 in the waiting queue "
                                                  "(priority 0)")
        async_engine.resume()
        for s in streams:
            async with s:
                async for _ in s:
                    pass

    asyncio.run(main())
    wait_until(lambda: async_engine.snapshot().num_requests == 0)
    snap = async_engine.snapshot()
    assert not snap.queues.waiting and not snap.queues.running and snap.stats.num_waiting == 0


def test_a_preempted_chat_is_told_it_was_preempted_and_why(async_engine):
    """Two requests outgrow the 12-block pool: the lower-priority one (the chat) is preempted, and its status
    says so, with the reason, while it waits; when it finishes, the status remembers the preemption."""
    prompt = "Write the numbers from one to twenty in words, separated by commas:"
    async_engine.pause()

    async def main():
        other = await async_engine.add_request(prompt, params(16), request_id="other", priority=0)
        chat = await async_engine.add_request(prompt + " ", params(16), request_id="chat-1", priority=1)
        seen = None
        for _ in range(40):                     # one step at a time until the pool runs out
            before = async_engine.snapshot().stats.num_steps
            async_engine.step_once()
            wait_until(lambda: async_engine.snapshot().stats.num_steps > before)
            snap = async_engine.snapshot()
            state, sentence = request_status("chat-1", snap)
            if state == "preempted":
                seen = (snap, sentence)
                break
        assert seen is not None, "chat-1 was never preempted"
        snap, sentence = seen
        assert "chat-1" in [q.request_id for q in snap.queues.with_status("preempted")]
        assert "lowest-priority" in sentence and "recomputed" in sentence
        html_status = render_chat_status("chat-1", snap)
        assert 'data-state="preempted"' in html_status and "preempted at step" in html_status
        assert 'data-status="preempted"' in render_queues(snap.queues)
        async_engine.resume()
        outs = []
        for s in (other, chat):
            async with s:
                async for out in s:
                    outs.append(out)
        return outs

    outs = asyncio.run(main())
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    wait_until(lambda: async_engine.snapshot().num_requests == 0)
    snap = async_engine.snapshot()
    state, sentence = request_status("chat-1", snap)
    assert state == "finished" and sentence.startswith("finished (length), preempted at step(s)")
    assert request_status("never-sent", async_engine.snapshot())[0] == "unknown"
    # A long request outlives the trace window (the last 120 steps): its preemption steps are still known.
    steps = [t.step for t in snap.recent_traces if "chat-1" in t.preempted]
    assert steps and list(snap.preempted_at["chat-1"]) == steps
    forgotten = dataclasses.replace(snap, recent_traces=())
    assert request_status("chat-1", forgotten) == ("finished", sentence)


@pytest.mark.slow
def test_history_views_draw_the_real_steps(async_engine):
    check_history_views(async_engine, first_token_with_the_prefill=True)


@pytest.mark.slow
def test_history_views_draw_the_real_steps_with_async_scheduling(model_dir):
    """The same views over an engine that schedules ahead (the default on a GPU): a token reaches the host one
    step after the batch that computed it, so a request's last step only collects its last token."""
    engine = LLMEngine(EngineConfig(model=str(model_dir), device="cpu", dtype="float32", num_kv_blocks=BLOCKS,
                                    block_size=BLOCK, async_scheduling=True))
    ae = AsyncLLMEngine(engine)
    try:
        check_history_views(ae, first_token_with_the_prefill=False)
        traces = ae.snapshot().recent_traces
        assert any(t.pipeline is not None and len(t.pipeline.in_flight) == 2 for t in traces)   # it did run ahead
    finally:
        ae.shutdown()
    engine.check_integrity()


def check_history_views(async_engine: AsyncLLMEngine, first_token_with_the_prefill: bool) -> None:
    async def main():
        await asyncio.gather(*(collect(async_engine, f"h{i}", 4 + 2 * i) for i in range(3)))

    asyncio.run(main())
    wait_until(lambda: async_engine.snapshot().num_requests == 0)
    snap = async_engine.snapshot()
    traces = [t for t in snap.recent_traces if any(r.request_id.startswith("h") for r in t.requests)]
    assert traces

    line = step_summary(traces[0])
    t0 = traces[0]
    # running: the requests the step ran, counted as it began (one that finished in the step counts)
    assert line.startswith(f"step {t0.step} | running {num_scheduled(t0)}, waiting {t0.num_waiting} | "
                           f"{t0.num_prefill_tokens + t0.num_decode_tokens} tokens ({t0.num_prefill_tokens} "
                           f"prefill + {t0.num_decode_tokens} decode) | KV {100 * t0.kv_usage:.1f}%")
    assert all(num_scheduled(t) > 0 for t in traces if t.num_prefill_tokens + t.num_decode_tokens)
    log = render_step_log(traces)
    assert log.index(f"step {traces[-1].step} |") < log.index(f"step {traces[0].step} |")      # newest first

    phases = request_phases(traces)
    for i in range(3):
        seen = [p for _, p in phases[f"h{i}"]]
        assert seen[0] in ("waiting", "prefill") and "prefill" in seen
        # synchronous: the first token comes with the prefill, and the step that computes the last one shows it
        # finished; ahead: every token comes a step later, and the step that brings the last one computes nothing
        assert seen.count("decode") + seen.count("finished") == 4 + 2 * i - first_token_with_the_prefill
        assert seen[-1] == "finished" and set(seen) <= set(PHASE_COLORS)
    svg = render_timelines(traces)
    runs = re.findall(r'data-request="(h\d)" data-first="(\d+)" data-last="(\d+)" data-phase="(\w+)"', svg)
    drawn = [(rid, step, p) for rid, a, z, p in runs for step in range(int(a), int(z) + 1)]
    assert sorted(drawn) == sorted((rid, step, p) for rid, seen in phases.items() if rid.startswith("h")
                                   for step, p in seen)                 # every step of every request, once
    for rid in ("h0", "h1", "h2"):                                       # one bar per run: neighbours differ
        mine = [(int(a), int(z), p) for r, a, z, p in runs if r == rid]
        assert all(p != q or z + 1 != a for (_, z, p), (a, _, q) in zip(mine, mine[1:]))
        assert len(mine) < len(phases[rid])                             # decode steps were merged


def test_phase_runs_merge_consecutive_steps_of_one_phase():
    seen = [(3, "waiting"), (4, "prefill"), (5, "decode"), (6, "decode"), (7, "decode"), (9, "decode"),
            (10, "finished")]
    assert phase_runs(seen) == [(3, 3, "waiting"), (4, 4, "prefill"), (5, 7, "decode"), (9, 9, "decode"),
                                (10, 10, "finished")]                   # step 8 missing: a new run


async def collect(ae: AsyncLLMEngine, request_id: str, n: int):
    stream = await ae.add_request("The alphabet starts with", params(n), request_id=request_id)
    async with stream:
        async for out in stream:
            pass
    return out
