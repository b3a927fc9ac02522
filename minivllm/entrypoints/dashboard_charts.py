"""The dashboard's charts and latency percentiles, from what the engine thread publishes (engine/live_view.py).

Owns: the data behind the page's plots (pandas DataFrames for Gradio's gr.LinePlot: a wall-clock time axis, a
value column named with its unit, a series column for the legend) and the latency table. Pure functions: the
published steps and request timings in, frames and HTML out. Nothing here touches the engine.

    throughput   tokens/s, prefill and decode, each a rate over the RATE_WINDOW_S seconds before the point
    KV usage     % of the pool's blocks held, at the last step before each point
    queues       running and waiting requests, at the last step before each point
    latency      queue time, TTFT, inter-token latency, time per output token and end-to-end latency: p50, p90
                 and p99 (numpy's percentile, linear) over the requests that finished in the LATENCY_WINDOW_S
                 seconds up to the latest finish

The points are POINT_S apart over the last HISTORY_S seconds up to the latest step, aligned to multiples of
POINT_S: while the engine is idle the frames stay equal, and the page does not resend them.
"""

from __future__ import annotations

import bisect
import html
import math
from collections.abc import Sequence

import numpy as np
import pandas as pd

from minivllm.engine.live_view import RequestTiming, StepPoint

RATE_WINDOW_S = 5.0
POINT_S = 2.0
HISTORY_S = 300.0                 # 5 minutes: 150 points a series
LATENCY_WINDOW_S = 60.0
PERCENTILES = (50, 90, 99)
LATENCIES = (                     # (name, what it measures), in the order of a request's life
    ("queue", "queue time: arrival to first scheduled"),
    ("TTFT", "time to first token: arrival to first token"),
    ("ITL", "inter-token latency: between two outputs of a stream"),
    ("TPOT", "time per output token: (last token - first token) / (output tokens - 1)"),
    ("E2E", "end-to-end: arrival to finished"),
)


def sample_times(steps: Sequence[StepPoint]) -> np.ndarray:
    """The chart's points (seconds since the epoch), oldest first: every POINT_S up to the latest step. A point
    after the latest step would still change as steps come in: it is left out until a step passes it."""
    if not steps:
        return np.zeros(0)
    last = math.floor(steps[-1].time / POINT_S) * POINT_S
    first = max(last - HISTORY_S, math.floor(steps[0].time / POINT_S) * POINT_S)
    return np.arange(first, last + POINT_S / 2, POINT_S)


def recent(steps: Sequence[StepPoint]) -> Sequence[StepPoint]:
    """The steps a chart needs: those of its time span and rate window, and the one before them (its values
    hold until the next step)."""
    if not steps:
        return steps
    cutoff = steps[-1].time - HISTORY_S - RATE_WINDOW_S - POINT_S
    return steps[max(bisect.bisect_left(steps, cutoff, key=lambda s: s.time) - 1, 0):]


def _frame(times: np.ndarray, series: dict[str, np.ndarray], unit: str) -> pd.DataFrame:
    """Long format: one row per (point, series), which gr.LinePlot draws as one line per series with a legend."""
    stamps = pd.to_datetime(np.tile(times, len(series)), unit="s", utc=True).tz_convert(None)
    values = np.concatenate([np.round(v, 3) for v in series.values()]) if series else np.zeros(0)
    names = np.repeat(list(series), len(times))
    return pd.DataFrame({"time": stamps, unit: values, "series": names})


def throughput_frame(steps: Sequence[StepPoint]) -> pd.DataFrame:
    """Prefill and decode tokens/s at each point: the tokens of the steps in (t - RATE_WINDOW_S, t], over the
    window's length."""
    steps = recent(steps)
    times = sample_times(steps)
    t = np.array([s.time for s in steps])
    series = {}
    for name, attr in (("prefill", "num_prefill_tokens"), ("decode", "num_decode_tokens")):
        cum = np.concatenate([[0], np.cumsum([getattr(s, attr) for s in steps])])
        hi = np.searchsorted(t, times, side="right")
        lo = np.searchsorted(t, times - RATE_WINDOW_S, side="right")
        series[name] = (cum[hi] - cum[lo]) / RATE_WINDOW_S
    return _frame(times, series, "tokens/s")


def _at_points(steps: Sequence[StepPoint], times: np.ndarray, value) -> np.ndarray:
    """value(step) of the last step at or before each point (0 before the first step)."""
    t = np.array([s.time for s in steps])
    vals = np.array([0.0] + [value(s) for s in steps])
    return vals[np.searchsorted(t, times, side="right")]


def kv_frame(steps: Sequence[StepPoint]) -> pd.DataFrame:
    steps = recent(steps)
    times = sample_times(steps)
    return _frame(times, {"KV usage": _at_points(steps, times, lambda s: 100 * s.kv_usage)}, "% of blocks")


def queues_frame(steps: Sequence[StepPoint]) -> pd.DataFrame:
    steps = recent(steps)
    times = sample_times(steps)
    return _frame(times, {"running": _at_points(steps, times, lambda s: s.num_running),
                          "waiting": _at_points(steps, times, lambda s: s.num_waiting)}, "requests")


class ChartFrames:
    """The three charts' frames, one page's cache: they depend only on the steps up to their latest point, so they
    are computed again only when a step passes a new point (every POINT_S under load), not on every refresh."""

    def __init__(self):
        self._key: tuple | None = None
        self._frames: tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame] | None = None

    def frames(self, steps: Sequence[StepPoint]) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
        """(throughput_frame, kv_frame, queues_frame) of `steps`."""
        key = (math.floor(steps[-1].time / POINT_S), steps[0].step) if steps else None
        if self._frames is None or key != self._key:
            self._key, self._frames = key, (throughput_frame(steps), kv_frame(steps), queues_frame(steps))
        return self._frames


def latency_window(finished: Sequence[RequestTiming]) -> list[RequestTiming]:
    """The requests that finished in the LATENCY_WINDOW_S seconds up to the latest finish."""
    if not finished:
        return []
    end = max(r.finished_time for r in finished)
    return [r for r in finished if r.finished_time > end - LATENCY_WINDOW_S]


def latency_samples(window: Sequence[RequestTiming]) -> dict[str, list[float]]:
    """Each latency's observations (seconds) over the window's requests; ITL has one per gap."""
    return {"queue": [r.queue_s for r in window], "TTFT": [r.ttft_s for r in window],
            "ITL": [g for r in window for g in r.itl_s],
            "TPOT": [r.tpot_s for r in window if r.tpot_s is not None], "E2E": [r.e2e_s for r in window]}


def latency_percentiles(finished: Sequence[RequestTiming]) -> dict[str, tuple[int, tuple[float, ...] | None]]:
    """name -> (observations, (p50, p90, p99) in seconds, or None without observations)."""
    out = {}
    for name, values in latency_samples(latency_window(finished)).items():
        out[name] = (len(values), tuple(float(np.percentile(values, p)) for p in PERCENTILES) if values else None)
    return out


def render_latency_table(finished: Sequence[RequestTiming]) -> str:
    """The latency panel: a row per latency, its p50 / p90 / p99 in ms over the window (data-p50 etc. in s)."""
    window = latency_window(finished)
    if not window:
        return '<p class="mv-stats" data-requests="0">latency: no request has finished yet</p>'
    stats = latency_percentiles(finished)
    head = "<tr><th>latency</th><th>n</th>" + "".join(f"<th>p{p} (ms)</th>" for p in PERCENTILES) + "</tr>"
    rows = []
    for name, meaning in LATENCIES:
        n, ps = stats[name]
        attrs = "".join(f' data-p{p}="{v:.6f}"' for p, v in zip(PERCENTILES, ps)) if ps else ""
        cells = "".join(f"<td>{1000 * v:,.1f}</td>" for v in ps) if ps else "<td>-</td>" * len(PERCENTILES)
        rows.append(f'<tr data-metric="{name}" data-n="{n}"{attrs} title="{html.escape(meaning)}">'
                    f"<td>{name}</td><td>{n}</td>{cells}</tr>")
    end = max(r.finished_time for r in window)
    when = pd.Timestamp(end, unit="s", tz="UTC").strftime("%H:%M:%S UTC")
    return (f'<div class="mv-scroll"><table class="mv-table mv-latency" data-requests="{len(window)}">{head}'
            f'{"".join(rows)}</table><p class="mv-caption">the {len(window)} requests that finished (stop or '
            f"length) in the {LATENCY_WINDOW_S:.0f} s up to {when}; ITL counts every gap between two outputs of a "
            f"streamed request</p></div>")
