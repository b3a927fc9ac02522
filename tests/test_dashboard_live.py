"""The live view of issue 43, without a browser: the engine thread publishes what a page reads (engine/live_view.py)
so a refresh never waits for a step; the latency panel's p50 / p90 / p99 agree with numpy's percentiles of the
requests' own timings; the charts are rates over a window on a time axis; a refresh resends only what changed,
within the payload targets (an idle tab <= 2 KB, under load at the default pool a median <= 100 KB)."""

from __future__ import annotations

import asyncio
import json
import re
import statistics
import threading
import time

import numpy as np
import pandas as pd
import pytest
import torch

from minivllm import SamplingParams
from minivllm.config import EngineConfig
from minivllm.core.sampling_params import RequestOutputKind
from minivllm.engine.async_llm import AsyncLLMEngine
from minivllm.engine.live_view import StepPoint
from minivllm.engine.llm_engine import LLMEngine
from minivllm.entrypoints.block_grid import RequestPalette
from minivllm.entrypoints.dashboard_charts import (
    LATENCIES,
    ChartFrames,
    PERCENTILES,
    POINT_S,
    RATE_WINDOW_S,
    kv_frame,
    latency_percentiles,
    render_latency_table,
    throughput_frame,
)
from minivllm.entrypoints.dashboard_refresh import OUTPUTS, refresh_page

PROMPT = "List the first ten prime numbers:"


@pytest.fixture(scope="module")
def async_engine(model_dir):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    engine = LLMEngine(EngineConfig(model=str(model_dir), device="cpu", dtype="float32", num_kv_blocks=64,
                                    block_size=16))
    ae = AsyncLLMEngine(engine)
    yield ae
    ae.shutdown()
    torch.set_num_threads(threads)


async def stream(ae: AsyncLLMEngine, request_id: str, max_tokens: int) -> list:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
    outs = []
    async for out in ae.generate(PROMPT, params, request_id=request_id):
        outs.append(out)
    return outs


def test_latency_percentiles_agree_with_numpy_on_the_requests_own_timings(async_engine):
    async def main():
        return await asyncio.gather(*(stream(async_engine, f"lat-{i}", 3 + 2 * i) for i in range(6)))

    results = asyncio.run(main())
    timings = {t.request_id: t for t in async_engine.live.finished()}
    expected: dict[str, list[float]] = {name: [] for name, _ in LATENCIES}
    for i, outs in enumerate(results):
        m, n = outs[-1].metrics, sum(len(o.outputs[0].token_ids) for o in outs)       # the request's own record
        assert n == 3 + 2 * i
        expected["queue"].append(m.first_scheduled_time - m.arrival_time)
        expected["TTFT"].append(m.first_token_time - m.arrival_time)
        expected["TPOT"].append((m.last_token_time - m.first_token_time) / (n - 1))
        expected["E2E"].append(m.finished_time - m.arrival_time)
        gaps = timings[f"lat-{i}"].itl_s               # every gap between two outputs, taken on the engine thread
        assert sum(gaps) == pytest.approx(m.last_token_time - m.first_token_time) and all(g >= 0 for g in gaps)
        expected["ITL"].extend(gaps)
    mine = [t for t in async_engine.live.finished() if t.request_id.startswith("lat-")]
    stats = latency_percentiles(mine)
    table = render_latency_table(mine)
    for name, values in expected.items():
        n, ps = stats[name]
        want = [float(np.percentile(values, p)) for p in PERCENTILES]
        assert n == len(values) and ps == pytest.approx(want, rel=1e-9, abs=1e-12), name
        row = re.search(rf'<tr data-metric="{name}" data-n="{n}"([^>]*)>', table)
        shown = {int(p): float(v) for p, v in re.findall(r'data-p(\d+)="([\d.]+)"', row[1])}
        assert [shown[p] for p in PERCENTILES] == pytest.approx(want, abs=1e-6), name


def test_a_refresh_never_waits_for_the_engine_thread(async_engine):
    """Once a page watches, the pool picture is published by the engine thread: a snapshot taken while the engine
    thread is busy (here: a 1.5 s command, standing in for a long step) comes back at once."""
    async_engine.snapshot(with_pool=True)                     # a page watches
    asyncio.run(stream(async_engine, "warm", 2))              # a step publishes the pool
    busy = async_engine.call(lambda e: time.sleep(1.5))
    time.sleep(0.1)
    start = time.perf_counter()
    snap = async_engine.snapshot(with_pool=True)
    took = time.perf_counter() - start
    assert not busy.done() and snap.pool is not None and took < 0.2, took
    busy.result(10)
    assert async_engine.live.last_step().step == async_engine.snapshot().stats.num_steps


def wire_bytes(gr, out: tuple) -> int:
    """What a refresh sends: each output as Gradio serializes it (a plot's frame through LinePlot.postprocess)."""
    total = 0
    for value in out:
        if isinstance(value, pd.DataFrame):
            value = gr.LinePlot(x="time", y=list(value)[1], color="series").postprocess(value).model_dump()
        elif isinstance(value, gr.Button):
            value = {"__type__": "update", "interactive": value.interactive}
        total += len(json.dumps(value))
    return total


def is_skip(gr, value) -> bool:
    return isinstance(value, dict) and value == gr.skip()


def test_an_idle_tab_is_sent_only_what_changed(async_engine):
    import gradio as gr

    asyncio.run(stream(async_engine, "idle", 4))
    sent: dict = {}
    first = refresh_page(gr, async_engine, RequestPalette(), (1, 1, 1), sent, None, 0, 0)
    assert not any(is_skip(gr, v) for v in first)                              # a new tab gets everything
    again = refresh_page(gr, async_engine, RequestPalette(), (1, 1, 1), sent, None, 0, 0)
    changed = [name for name, v in zip(OUTPUTS, again) if not is_skip(gr, v)]
    assert set(changed) <= {"engine"}, changed                                  # at most "x.x s ago"
    assert wire_bytes(gr, again) <= 2_000
    bar = first[OUTPUTS.index("engine")]
    assert f'data-step="{async_engine.snapshot().stats.num_steps}"' in bar and re.search(r"\d+\.\d s ago", bar)


def test_throughput_is_a_rate_over_a_window_on_a_time_axis():
    t0 = 1_800_000_000.0
    steps = [StepPoint(t0 + 0.25 * i, i, 10 if i < 4 else 0, 2, i / 100, 1, 0) for i in range(100)]
    frame = throughput_frame(steps)
    assert list(frame) == ["time", "tokens/s", "series"] and set(frame["series"]) == {"prefill", "decode"}
    assert pd.api.types.is_datetime64_any_dtype(frame["time"])
    decode = frame[frame["series"] == "decode"]
    for stamp, rate in zip(decode["time"], decode["tokens/s"]):
        t = stamp.timestamp()
        assert t % POINT_S == 0 and t <= steps[-1].time                        # complete points only
        tokens = sum(s.num_decode_tokens for s in steps if t - RATE_WINDOW_S < s.time <= t)
        assert rate == pytest.approx(tokens / RATE_WINDOW_S, abs=1e-3)
    charts = ChartFrames()                      # the page's cache: computed again only when a point completes
    first = charts.frames(steps)
    assert first[0].equals(frame) and first[1].equals(kv_frame(steps))
    later = steps + [StepPoint(steps[-1].time + 0.1, 100, 0, 2, 0.5, 1, 0)]            # before the next point
    assert charts.frames(later) is first
    passed = later + [StepPoint(t + POINT_S + 0.1, 101, 0, 2, 0.5, 1, 0)]
    assert charts.frames(passed) is not first and charts.frames(passed)[0].equals(throughput_frame(passed))
    kv = kv_frame(steps)
    assert kv["% of blocks"].iloc[-1] == pytest.approx(100 * max(s.kv_usage for s in steps if s.time <= t),
                                                       abs=1e-3)


@pytest.mark.slow
def test_refresh_payload_under_load_at_the_default_pool(model_dir):
    """24 requests sharing a system prompt (the demo traffic) on the default pool, a refresh every 0.5 s: the
    median refresh carries <= 100 KB and shows a step at most 2 behind the engine at p90."""
    import gradio as gr

    from minivllm.entrypoints.dashboard_chat import DashboardChat

    ae = AsyncLLMEngine(LLMEngine(EngineConfig(model=str(model_dir), device="cpu", dtype="float32")))
    try:
        sent, palette, charts = {}, RequestPalette(), ChartFrames()        # as the page keeps them
        refresh_page(gr, ae, palette, (1, 1, 1), sent, None, 0, 0, charts)
        loop = asyncio.new_event_loop()
        traffic = threading.Thread(target=lambda: loop.run_until_complete(DashboardChat(ae).demo_traffic()))
        traffic.start()
        sizes, trail = [], []
        while traffic.is_alive():
            time.sleep(0.5)
            out = refresh_page(gr, ae, palette, (1, 1, 1), sent, None, 0, 0, charts)
            now = ae.snapshot().stats.num_steps
            sizes.append(wire_bytes(gr, out))
            bar = out[OUTPUTS.index("engine")]
            if not is_skip(gr, bar):
                trail.append(now - int(re.search(r'data-step="(\d+)"', bar)[1]))
        traffic.join()
        assert len(sizes) >= 5 and statistics.median(sizes) <= 100_000, sizes
        assert sorted(trail)[int(0.9 * (len(trail) - 1))] <= 2, trail
        print(f"payload median {statistics.median(sizes) / 1000:.1f} KB, max {max(sizes) / 1000:.1f} KB over "
              f"{len(sizes)} refreshes; trail p90 {sorted(trail)[int(0.9 * (len(trail) - 1))]} steps")
    finally:
        ae.shutdown()
