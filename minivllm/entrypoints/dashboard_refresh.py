"""The page's refresh: every panel from the latest published snapshot, and only what changed goes to the browser.

Owns: refresh_page (what the page's timer calls) and the per-tab record of what each output last sent. The
snapshot comes from `AsyncLLMEngine.snapshot(with_pool=True)` and `async_engine.live`, both published by the
engine thread after each step and read here by reference: a refresh never waits for the step under way, so the
page is as fresh as the last step. An output whose value equals what this tab last received is answered with
`gr.skip()`: an idle tab receives only the engine bar's "x.x s ago". The plots' points are POINT_S apart and
only complete ones are drawn (dashboard_charts.py), so under load they are resent every POINT_S, not every refresh.
"""

from __future__ import annotations

import hashlib
import time

import pandas as pd

from minivllm.engine.async_llm import AsyncLLMEngine
from minivllm.entrypoints.block_grid import RequestPalette
from minivllm.entrypoints.dashboard_charts import ChartFrames, render_latency_table
from minivllm.entrypoints.dashboard_chat import render_chat_status
from minivllm.entrypoints.dashboard_history import render_step_log, render_timelines
from minivllm.entrypoints.dashboard_panels import render_engine_bar, render_panels

REFRESH_SECONDS = 0.5
GRID_MAX_BYTES = 32_000     # the grid is the largest panel and changes with every step: groups beyond this
OUTPUTS = ("engine", "grid", "stats", "queues", "tables", "log", "parallel", "chat_status", "step_log", "timelines",
           "latency", "throughput", "kv", "queue_plot", "pause", "step", "resume")


def fingerprint(value) -> bytes:
    """A digest of an output's value: equal values, equal digests (a DataFrame by its content)."""
    if isinstance(value, pd.DataFrame):
        data = pd.util.hash_pandas_object(value, index=False).to_numpy().tobytes() + repr(list(value)).encode()
    else:
        data = repr(value).encode()
    return hashlib.blake2b(data, digest_size=16).digest()


def skip_unchanged(gr, values: dict, sent: dict) -> tuple:
    """`values` (name -> value, in OUTPUTS' order) with each one this tab already has replaced by gr.skip().
    `sent` (name -> fingerprint) is the tab's record; it is updated with what goes out."""
    out = []
    for name in OUTPUTS:
        value = values[name]
        digest = fingerprint(value)
        if sent.get(name) == digest:
            out.append(gr.skip())
        else:
            sent[name] = digest
            out.append(value)
    return tuple(out)


def zoom_window(zoom_from: float | None, zoom_to: float | None, num_blocks: int) -> tuple[int, int] | None:
    lo, hi = int(zoom_from or 0), int(zoom_to or 0)
    return (max(lo, 0), min(hi, num_blocks)) if 0 <= lo < hi else None     # 0..0: the whole pool


def panel_values(async_engine: AsyncLLMEngine, palette: RequestPalette, parallel: tuple[int, int, int],
                 chat_id: str | None, window_from: float | None, window_to: float | None,
                 charts: ChartFrames) -> dict:
    """Every output's value (plain data: HTML strings, DataFrames, and the three buttons' interactive flags)."""
    snap = async_engine.snapshot(with_pool=True)
    live = async_engine.live
    steps, last = live.steps(), live.last_step()
    window = zoom_window(window_from, window_to, snap.stats.num_kv_blocks)
    grid, stats, queues, tables, log, par = render_panels(snap, *parallel, palette=palette, window=window,
                                                          max_bytes=GRID_MAX_BYTES)
    has_work = snap.num_requests > 0
    throughput, kv, queue_plot = charts.frames(steps)
    return {"engine": render_engine_bar(snap, last.time if last else None, time.time()), "grid": grid,
            "stats": stats, "queues": queues, "tables": tables, "log": log, "parallel": par,
            "chat_status": render_chat_status(chat_id, snap), "step_log": render_step_log(snap.recent_traces),
            "timelines": render_timelines(snap.recent_traces), "latency": render_latency_table(live.finished()),
            "throughput": throughput, "kv": kv, "queue_plot": queue_plot,
            "pause": not snap.paused,                       # pause: only while running
            "step": snap.paused and has_work,               # single step: paused, with work
            "resume": snap.paused}                          # resume: only while paused


def refresh_page(gr, async_engine: AsyncLLMEngine, palette: RequestPalette, parallel: tuple[int, int, int],
                 sent: dict, chat_id: str | None, zoom_from: float | None, zoom_to: float | None,
                 charts: ChartFrames | None = None) -> tuple:
    """The timer's refresh: the outputs in OUTPUTS' order, gr.skip() for those this tab already shows. `charts`:
    the page's cache of the chart frames (None: computed afresh)."""
    values = panel_values(async_engine, palette, parallel, chat_id, zoom_from, zoom_to, charts or ChartFrames())
    out = list(skip_unchanged(gr, values, sent))
    for i, name in enumerate(OUTPUTS):
        if name in ("pause", "step", "resume") and isinstance(out[i], bool):
            out[i] = gr.Button(interactive=out[i])
    return tuple(out)
