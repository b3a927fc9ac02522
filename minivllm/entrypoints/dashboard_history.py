"""The dashboard's views of the recent steps: a summary line per step and each request's timeline.

Owns: pure render functions, data in (StepTraces) and an HTML/SVG string out; the page (dashboard.py) calls them
with the async engine's snapshot. Nothing here touches the engine. (The charts over time and the latency
percentiles are dashboard_charts.py's.)

    step log        one line per step in the style of SGLang's scheduler log: the requests the step ran, those
                    left waiting, tokens in the step (prefill / decode), KV usage, prefix-cache hit rate, throughput
    timelines       the last N requests, one row each, one bar per run of steps in the same phase: waiting,
                    prefill (chunks), decode, preempted, swapped, finished
"""

from __future__ import annotations

import html
from collections.abc import Sequence

from minivllm.engine.trace import RequestTrace, StepTrace

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


def num_scheduled(t: StepTrace) -> int:
    """The requests the step ran (counted as the step began: a request that finished in it counts)."""
    return sum(1 for r in t.requests if r.kind)


def step_summary(t: StepTrace) -> str:
    """One step in one line: `step 12 | running 4, waiting 2 | 37 tokens (33 prefill + 4 decode) | KV 23.4% |
    hit rate 41.0% | 2,113 tok/s`: running is what the step ran, waiting what it left waiting."""
    tokens = t.num_prefill_tokens + t.num_decode_tokens
    rate = f"{tokens / t.duration_s:,.0f} tok/s" if t.duration_s > 0 else "- tok/s"
    extra = f" | preempted {', '.join(t.preempted)}" if t.preempted else ""
    if t.num_draft_tokens:
        extra += f" | drafts {t.num_accepted_tokens}/{t.num_draft_tokens} accepted"
    return (f"step {t.step} | running {num_scheduled(t)}, waiting {t.num_waiting} | {tokens} tokens "
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


def phase_runs(seen: list[tuple[int, str]]) -> list[tuple[int, int, str]]:
    """[(step, phase), ...] (steps increasing) as runs [(first step, last step, phase), ...]: a run ends where the
    phase changes or a step is missing."""
    runs: list[list] = []
    for step, p in seen:
        if runs and runs[-1][2] == p and runs[-1][1] == step - 1:
            runs[-1][1] = step
        else:
            runs.append([step, step, p])
    return [tuple(r) for r in runs]


def render_timelines(traces: Sequence[StepTrace], limit: int = TIMELINE_REQUESTS, width: int = 640) -> str:
    """The `limit` most recently active requests, in arrival order, one row each; one bar per run of steps in
    the same phase, coloured by it (`data-first`, `data-last`: its steps)."""
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
        rid = html.escape(request_id)
        parts.append(f'<text x="0" y="{y + 10}" font-size="10" font-family="monospace">'
                     f'{html.escape(request_id[:18])}</text>')
        for a, z, p in phase_runs(seen):
            x = label_w + (a - first) * cell
            steps = f"step {a}" if a == z else f"steps {a}-{z}"
            parts.append(f'<rect x="{x:.1f}" y="{y}" width="{max((z - a + 1) * cell - 0.5, 0.5):.1f}" '
                         f'height="{row_h - 3}" fill="{PHASE_COLORS[p]}" data-request="{rid}" data-first="{a}" '
                         f'data-last="{z}" data-phase="{p}"><title>{rid}, {steps}: {p}</title></rect>')
    height = len(rows) * row_h + 16
    legend_x, legend = label_w, []
    for name, color in PHASE_COLORS.items():
        legend.append(f'<rect x="{legend_x}" y="{height - 11}" width="9" height="9" fill="{color}"/>'
                      f'<text x="{legend_x + 12}" y="{height - 3}" font-size="10" font-family="monospace">{name}'
                      f'</text>')
        legend_x += 12 + 7 * len(name) + 10
    return (f'<div class="mv-scroll"><svg class="mv-timelines" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}" xmlns="http://www.w3.org/2000/svg" data-requests="{len(rows)}" '
            f'data-steps="{first}-{last}">{"".join(parts)}{"".join(legend)}</svg></div>')
