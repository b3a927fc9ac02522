"""The dashboard's views of the engine over time: a summary line per step, each request's timeline, live plots,
and the latency histograms.

Owns: pure render functions, data in (StepTraces, Histograms) and an HTML/SVG string out; the page
(dashboard.py) calls them on every refresh with the async engine's snapshot. Nothing here touches the engine.

    step log        one line per step in the style of SGLang's scheduler log: running, waiting, tokens in the
                    step (prefill / decode), KV usage, prefix-cache hit rate, throughput of the step
    timelines       the last N requests, one row each, one cell per step: waiting, prefill (a chunk), decode,
                    preempted, swapped, finished
    plots           throughput, KV usage and queue lengths over the recent steps
    histograms      time to first token and inter-token latency, from the async engine's Histograms
"""

from __future__ import annotations

import html
from collections.abc import Sequence

from minivllm.engine.trace import RequestTrace, StepTrace
from minivllm.engine.stats import Histogram

STEP_LOG_LINES = 30
TIMELINE_REQUESTS = 16

# One colour per phase of a request's life (the lessons' tab: colours; orange / blue as the tokens-per-step chart).
PHASE_COLORS = {
    "waiting": "#d9d9d9",      # in the waiting queue, not scheduled
    "prefill": "#f28e2b",      # computed a chunk of its prompt (or recomputed after a preemption)
    "decode": "#4e79a7",       # computed one token (plus verified drafts)
    "running": "#a0cbe8",      # holds blocks but was not scheduled this step (pipeline: in another stage)
    "preempted": "#e15759",    # its KV was dropped (recompute); back in the waiting queue
    "swapped": "#b07aa1",      # its KV is in the CPU pool
    "finished": "#59a14f",     # finished in this step
}


def step_summary(t: StepTrace) -> str:
    """One step in one line: `step 12 | running 4, waiting 2 | 37 tokens (33 prefill + 4 decode) | KV 23.4% |
    hit rate 41.0% | 2,113 tok/s`."""
    tokens = t.num_prefill_tokens + t.num_decode_tokens
    rate = f"{tokens / t.duration_s:,.0f} tok/s" if t.duration_s > 0 else "- tok/s"
    extra = f" | preempted {', '.join(t.preempted)}" if t.preempted else ""
    if t.num_draft_tokens:
        extra += f" | drafts {t.num_accepted_tokens}/{t.num_draft_tokens} accepted"
    return (f"step {t.step} | running {t.num_running}, waiting {t.num_waiting} | {tokens} tokens "
            f"({t.num_prefill_tokens} prefill + {t.num_decode_tokens} decode) | KV {100 * t.kv_usage:.1f}% | "
            f"hit rate {100 * t.prefix_cache_hit_rate:.1f}% | {rate} | {1000 * t.duration_s:.0f} ms{extra}")


def render_step_log(traces: Sequence[StepTrace], limit: int = STEP_LOG_LINES) -> str:
    """The summary lines of the last `limit` steps, newest first."""
    lines = [step_summary(t) for t in list(traces)[-limit:]][::-1]
    return (f'<pre class="mv-log mv-steplog" data-lines="{len(lines)}">'
            f'{html.escape(chr(10).join(lines)) or "no steps yet"}</pre>')


def phase(r: RequestTrace) -> str:
    """What request `r` did in its step: one of PHASE_COLORS."""
    if r.status.startswith("finished"):
        return "finished"
    if r.kind:
        return r.kind                                    # "prefill" or "decode"
    return r.status if r.status in PHASE_COLORS else "waiting"


def request_phases(traces: Sequence[StepTrace]) -> dict[str, list[tuple[int, str]]]:
    """request id -> [(step, phase), ...] over the given steps, for every request any of them lists. The ids are
    the engine's (an n > 1 sample has its own row). Preserves first-appearance order."""
    phases: dict[str, list[tuple[int, str]]] = {}
    for t in traces:
        for r in t.requests:
            phases.setdefault(r.request_id, []).append((t.step, phase(r)))
    return phases


def render_timelines(traces: Sequence[StepTrace], limit: int = TIMELINE_REQUESTS, width: int = 640) -> str:
    """The `limit` most recently active requests, in arrival order, one row each; a cell per step, coloured by
    what the request did there."""
    traces = list(traces)
    if not traces:
        return '<p class="mv-stats">no steps yet</p>'
    phases = request_phases(traces)
    # The `limit` requests that ran (prefill, decode) most recently; those that only ever waited come last.
    def last_active(item: tuple[str, list[tuple[int, str]]]) -> int:
        return max((step for step, p in item[1] if p != "waiting"), default=-1)
    chosen = set(r for r, _ in sorted(phases.items(), key=last_active, reverse=True)[:limit])
    rows = [(r, seen) for r, seen in phases.items() if r in chosen]
    first, last = traces[0].step, traces[-1].step
    label_w, row_h = 130, 14
    cell = (width - label_w) / max(last - first + 1, 1)
    parts = []
    for i, (request_id, seen) in enumerate(rows):
        y = i * row_h
        parts.append(f'<text x="0" y="{y + 10}" font-size="10" font-family="monospace">'
                     f'{html.escape(request_id[:18])}</text>')
        for step, p in seen:
            x = label_w + (step - first) * cell
            parts.append(f'<rect x="{x:.1f}" y="{y}" width="{max(cell - 0.5, 0.5):.1f}" height="{row_h - 3}" '
                         f'fill="{PHASE_COLORS[p]}" data-request="{html.escape(request_id)}" data-step="{step}" '
                         f'data-phase="{p}"><title>{html.escape(request_id)}, step {step}: {p}</title></rect>')
    height = len(rows) * row_h + 16
    legend_x, legend = label_w, []
    for name, color in PHASE_COLORS.items():
        legend.append(f'<rect x="{legend_x}" y="{height - 11}" width="9" height="9" fill="{color}"/>'
                      f'<text x="{legend_x + 12}" y="{height - 3}" font-size="10" font-family="monospace">{name}'
                      f'</text>')
        legend_x += 12 + 7 * len(name) + 10
    return (f'<svg class="mv-timelines" width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
            f'xmlns="http://www.w3.org/2000/svg" data-requests="{len(rows)}" data-steps="{first}-{last}">'
            f'{"".join(parts)}{"".join(legend)}</svg>')


def _line_chart(name: str, xs: list[int], series: dict[str, tuple[list[float], str]], unit: str,
                width: int, height: int) -> str:
    """A small SVG line chart: one polyline per series (values >= 0), the y axis from 0 to the largest value."""
    top = max((max(v) for v, _ in series.values() if v), default=0.0) or 1.0
    span = max(xs[-1] - xs[0], 1)
    plot_h = height - 34                     # the title above (to y 12), the steps caption below (from height - 14)
    lines = []
    for label, (values, color) in series.items():
        pts = " ".join(f"{width * (x - xs[0]) / span:.1f},{16 + plot_h * (1 - v / top):.1f}"
                       for x, v in zip(xs, values))
        lines.append(f'<polyline points="{pts}" fill="none" stroke="{color}" stroke-width="1.5" '
                     f'data-series="{html.escape(label)}"/>')
    keys = ", ".join(f'<tspan fill="{c}">{html.escape(k)}</tspan>' for k, (_, c) in series.items())
    last = ", ".join(f"{html.escape(k)} {v[-1]:,.3g}" for k, (v, _) in series.items() if v)
    return (f'<svg class="mv-plot" data-plot="{name}" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}" xmlns="http://www.w3.org/2000/svg">'
            f'<text x="0" y="10" font-size="11" font-family="monospace">{keys} ({unit}; max {top:,.3g}; '
            f'now {last})</text>{"".join(lines)}'
            f'<text x="0" y="{height - 3}" font-size="10" font-family="monospace">steps {xs[0]}-{xs[-1]}</text>'
            f'</svg>')


def render_plots(traces: Sequence[StepTrace], width: int = 280, height: int = 110) -> str:
    """Throughput (tokens/s of each step), KV usage (%) and queue lengths over the recent steps."""
    traces = list(traces)
    if len(traces) < 2:
        return '<p class="mv-stats">plots appear after two steps</p>'
    xs = [t.step for t in traces]
    rate = [(t.num_prefill_tokens + t.num_decode_tokens) / t.duration_s if t.duration_s > 0 else 0.0
            for t in traces]
    return ('<div class="mv-plots">'
            + _line_chart("throughput", xs, {"tokens/s": (rate, "#4e79a7")}, "per step", width, height)
            + _line_chart("kv", xs, {"KV usage": ([100 * t.kv_usage for t in traces], "#59a14f")}, "%", width,
                          height)
            + _line_chart("queues", xs, {"running": ([t.num_running for t in traces], "#4e79a7"),
                                          "waiting": ([t.num_waiting for t in traces], "#e15759")},
                          "requests", width, height)
            + "</div>")


def _bucket_label(upper: float) -> str:
    return f"{1000 * upper:g}ms" if upper < 1 else f"{upper:g}s"


def render_histogram(name: str, h: Histogram, width: int = 300, height: int = 110) -> str:
    """One latency histogram as bars, one per bucket (the last is +Inf), with the count and mean."""
    if h.count == 0:
        return f'<p class="mv-stats" data-hist="{name}">{name}: no observations yet</p>'
    bar = width / len(h.counts)
    top = max(h.counts)
    plot_h = height - 30
    labels = [f"<= {_bucket_label(b)}" for b in h.buckets] + [f"> {_bucket_label(h.buckets[-1])}"]
    rects = []
    for i, (count, label) in enumerate(zip(h.counts, labels)):
        bh = plot_h * count / top
        rects.append(f'<rect x="{i * bar:.1f}" y="{14 + plot_h - bh:.1f}" width="{bar * 0.85:.1f}" '
                     f'height="{bh:.1f}" fill="#76b7b2" data-count="{count}"><title>{label}: {count}</title></rect>')
    return (f'<svg class="mv-hist" data-hist="{name}" data-count="{h.count}" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}" xmlns="http://www.w3.org/2000/svg">'
            f'<text x="0" y="10" font-size="11" font-family="monospace">{name}: {h.count} observed, mean '
            f'{1000 * h.sum / h.count:,.0f} ms</text>{"".join(rects)}'
            f'<text x="0" y="{height - 3}" font-size="10" font-family="monospace">{labels[0]} ... {labels[-1]}'
            f'</text></svg>')
