"""The dashboard's panels as pure functions of one EngineSnapshot (or of its StepTrace): data in, HTML out.

Owns: the engine bar (step, its age, queues, KV usage, pause state: the first thing on the page, also on a phone),
the stats, the queues, the block tables, the parallelism panel and the event log. Tests call these without a
browser; dashboard.py lays them out and dashboard_refresh.py calls them on every refresh.

Requests and blocks are drawn as chips (dashboard_colors.py) in the colours and tones the block grid gives them, a
block held by more than one request hatched in its holders' colours, as in the grid.
"""

from __future__ import annotations

import html
import re

from minivllm.engine.llm_engine import EngineQueues, QueuedRequest
from minivllm.engine.stats import EngineSnapshot
from minivllm.engine.trace import StepTrace
from minivllm.entrypoints.block_grid import (
    UNKNOWN_OWNER,
    RequestPalette,
    Swatch,
    block_owners,
    render_block_grid,
    request_color,
)
from minivllm.entrypoints.dashboard_colors import chip

EVENTS_SHOWN = 40
BLOCK_EVENT = re.compile(r"^(step (\d+): )(prefix hit on blocks|evict blocks) \[([\d, ]*)\]$")


def _default_swatch(request_id: str) -> Swatch:
    return Swatch(request_color(request_id))


def render_block_tables(trace: StepTrace | None, swatch=_default_swatch) -> str:
    """Each request of the step: status, what it ran, token counts, how it samples (n > 1 parent, logprobs, its
    grammar's state), and its block table as chips: a block in the request's colour and tone, a block that live
    requests share hatched in their colours with the holder count (data-shared), as in the grid."""
    if trace is None or not trace.requests:
        return '<p class="mv-stats">no requests</p>'
    owners = block_owners(trace)
    rows = []
    for r in trace.requests:
        chips = []
        for b in r.block_table:
            holders = owners.get(b, [r.request_id])
            if len(holders) > 1:
                chips.append(chip(str(b), [swatch(h) for h in holders]))       # data-shared: how many
            else:
                chips.append(chip(str(b), [swatch(r.request_id)]))
        ran = f"{r.kind} {r.num_scheduled_tokens}" if r.kind else ""
        if r.num_draft_tokens:                    # speculative decoding: drafts verified, and how many were kept
            ran += f" ({r.num_accepted_tokens}/{r.num_draft_tokens} drafts accepted)"
        sampling = r.sampling + (f", sample of {r.parent_id}" if r.parent_id else "")
        rows.append(f"<tr><td>{chip(r.request_id, [swatch(r.request_id)])}</td><td>{r.status}</td><td>{ran}</td>"
                    f"<td>{r.priority}</td><td>{r.num_prompt_tokens}</td><td>{r.num_output_tokens}</td>"
                    f"<td>{r.num_computed_tokens}</td><td>{r.num_cached_tokens}</td><td>{r.num_preemptions}</td>"
                    f"<td>{html.escape(sampling)}</td><td>{''.join(chips) or '-'}</td></tr>")
    head = ("<tr><th>request</th><th>status</th><th>this step</th><th>priority</th><th>prompt</th><th>output</th>"
            "<th>computed</th><th>cached</th><th>preempted</th><th>sampling</th><th>block table</th></tr>")
    return f'<div class="mv-scroll"><table class="mv-table mv-blocktables">{head}{"".join(rows)}</table></div>'


def render_queues(queues: EngineQueues) -> str:
    """The scheduler's queues as the engine holds them now (EngineQueues: one definition of each): running,
    and the waiting queue in its order, where preempted and swapped requests are marked as such."""
    def item(q: QueuedRequest) -> str:
        notes = [q.status] if q.status in ("preempted", "swapped") else []
        if q.num_preemptions and q.status not in ("preempted", "swapped"):
            notes.append(f"preempted x{q.num_preemptions}")
        if q.priority:
            notes.append(f"priority {q.priority}")
        note = f" ({', '.join(notes)})" if notes else ""
        return (f'<span data-request="{html.escape(q.request_id)}" data-status="{q.status}">'
                f"{html.escape(q.request_id)}{note}</span>")

    groups = {"running": queues.running, "waiting": queues.waiting}
    cols = "".join(f'<div data-queue="{name}"><b>{name} ({len(qs)})</b><br>'
                   f"{'<br>'.join(item(q) for q in qs) or '-'}</div>" for name, qs in groups.items())
    return (f'<div class="mv-queues" data-running="{len(queues.running)}" data-waiting="{len(queues.waiting)}" '
            f'data-preempted="{len(queues.with_status("preempted"))}" '
            f'data-swapped="{len(queues.with_status("swapped"))}">{cols}</div>')


def render_stats(snap: EngineSnapshot) -> str:
    """KV usage as a bar, prefix-cache hit rate, preemptions, counts, and throughput over the recent steps."""
    s = snap.stats
    recent = snap.recent_traces
    busy = sum(t.duration_s for t in recent)
    tokens = sum(t.num_prefill_tokens + t.num_decode_tokens for t in recent)
    rate = f"{tokens / busy:.0f} tokens/s while stepping (last {len(recent)} steps)" if busy > 0 else "-"
    state = "PAUSED" if snap.paused else ("running" if snap.loop_alive else "STOPPED")
    finished = ", ".join(f"{k} {v}" for k, v in sorted(snap.finished.items())) or "-"
    q = snap.queues
    idle = ("" if s.num_steps or snap.num_requests else
            '<p class="mv-idle"><b>Idle.</b> Ask something in the chat, or press <b>Load demo traffic</b>: 24 '
            "requests that share a system prompt, so the prefix cache hits, the pool fills and the scheduler has "
            "to queue (and maybe preempt). Then <b>Pause</b> and <b>Single step</b> to watch one step at a "
            "time.</p>")
    return (
        f'<div class="mv-stats" data-paused="{int(snap.paused)}" data-in-flight="{snap.num_requests}">{idle}'
        f"engine: <b>{state}</b>, step {s.num_steps}, requests in flight {snap.num_requests}<br>"
        f'KV usage <span class="mv-bar"><div style="width:{100 * s.kv_usage:.1f}%"></div></span> '
        f"{100 * s.kv_usage:.1f}% ({s.num_kv_blocks - s.num_free_blocks} / {s.num_kv_blocks} blocks held)<br>"
        f"prefix-cache hit rate {100 * s.prefix_cache_hit_rate:.1f}% ({s.prefix_cache_hits} of "
        f"{s.prefix_cache_queries} prompt tokens)<br>"
        + (f'encoder cache <span class="mv-bar"><div style="width:'
           f'{100 * s.encoder_cache_used / s.encoder_cache_size:.1f}%"></div></span> {s.encoder_cache_used} / '
           f"{s.encoder_cache_size} rows ({s.num_encoder_outputs_kept} images kept); images encoded so far "
           f"{s.num_encoder_inputs_scheduled}<br>" if s.encoder_cache_size else "")
        + f"running {len(q.running)}, waiting {len(q.waiting)} (of which preempted "
        f"{len(q.with_status('preempted'))}, swapped {len(q.with_status('swapped'))}); "
        f"preemptions so far {s.num_preemptions}<br>"
        f"generated {s.num_generated_tokens} tokens, prefilled {s.num_prompt_tokens_computed}; {rate}<br>"
        + (f"speculative decoding: {s.num_spec_accepted_tokens} of {s.num_spec_draft_tokens} drafts accepted "
           f"({100 * s.spec_acceptance_rate:.1f}%), {s.spec_mean_acceptance_length:.2f} tokens per verification<br>"
           if s.num_spec_draft_tokens else "")
        + f"finished: {finished}</div>")


def render_parallelism(trace: StepTrace | None, tp: int, pp: int, max_batches: int, swatch=_default_swatch) -> str:
    """TP x PP and the ranks; under pipeline parallelism, which batch each stage holds as the engine last saw it,
    while it waited for the oldest batch: the last stage holds the oldest, each earlier stage the next newer one
    (stage pp - 1 - j holds batch j of the batches in flight, oldest first); a stage with no batch is idle (the
    bubble, with fewer batches in flight than stages)."""
    head = (f'<div class="mv-stats mv-parallel" data-tp="{tp}" data-pp="{pp}">tensor parallel <b>{tp}</b> x '
            f"pipeline parallel <b>{pp}</b> = {tp * pp} rank(s); up to {max_batches} batch(es) in flight")
    if pp == 1:
        return head + "</div>"
    pipe = trace.pipeline.in_flight if trace is not None and trace.pipeline is not None else ()
    rows = []
    for stage in range(pp):
        j = pp - 1 - stage
        ranks = f"ranks {stage * tp}-{stage * tp + tp - 1}" if tp > 1 else f"rank {stage}"
        if j < len(pipe):
            batch, rids = pipe[j]
            cell = (f'<span data-stage="{stage}" data-batch="{batch}">batch {batch}</span> '
                    + " ".join(chip(r, [swatch(r)]) for r in rids[:12]) + (" ..." if len(rids) > 12 else ""))
        else:
            cell = f'<span data-stage="{stage}" data-batch="">idle</span>'
        rows.append(f"<tr><td>stage {stage} ({ranks})</td><td>{cell}</td></tr>")
    return head + '<table class="mv-table">' + "".join(rows) + "</table></div>"


def _ranges(blocks: list[int]) -> str:
    """[3, 4, 5, 9] -> "3-5, 9" (each id once)."""
    out: list[list[int]] = []
    for b in sorted(set(blocks)):
        if out and b == out[-1][1] + 1:
            out[-1][1] = b
        else:
            out.append([b, b])
    return ", ".join(str(a) if a == z else f"{a}-{z}" for a, z in out)


def _holders(ids: list[str]) -> str:
    return ", ".join(ids) if len(ids) <= 3 else f"{ids[0]} and {len(ids) - 1} more"


def describe_block_event(line: str, traces: dict[int, StepTrace]) -> str:
    """A log line that lists block ids ("step 7: prefix hit on blocks [...]", "step 7: evict blocks [...]") as
    whose they are after that step, in ranges: "step 7: prefix hit on 12 block(s) (whose: chat-1 0-9; burst2-3
    and 5 more 10-11)". An evicted block belongs to the request that took it. A step outside the trace window,
    or a block held by nobody, gives "-"."""
    m = BLOCK_EVENT.match(line)
    if m is None:
        return line
    blocks = [int(b) for b in m[4].split(",") if b.strip()]
    trace = traces.get(int(m[2]))
    owners = block_owners(trace) if trace is not None else {}
    by_owner: dict[str, list[int]] = {}
    for b in dict.fromkeys(blocks):
        by_owner.setdefault(_holders(owners.get(b, ["-"])), []).append(b)
    what = "prefix hit on" if m[3].startswith("prefix") else "evict"
    hits = f", {len(blocks)} hits" if len(blocks) != len(set(blocks)) else ""
    return (f"{m[1]}{what} {len(set(blocks))} block(s){hits} ({'whose now' if what == 'evict' else 'whose'}: "
            + "; ".join(f"{who} {_ranges(bs)}" for who, bs in by_owner.items()) + ")")


def render_event_log(events: tuple[str, ...] | list[str], limit: int = EVENTS_SHOWN,
                     traces: tuple[StepTrace, ...] | list[StepTrace] = ()) -> str:
    """The newest events first; block lists say whose the blocks are (describe_block_event)."""
    by_step = {t.step: t for t in traces}
    lines = [describe_block_event(line, by_step) for line in list(events)[-limit:][::-1]]
    return f'<pre class="mv-log">{html.escape(chr(10).join(lines)) or "no events yet"}</pre>'


def render_engine_bar(snap: EngineSnapshot, last_step_time: float | None, now: float) -> str:
    """One line, first on the page: step N and how long ago it ran, the queues, KV usage and the pause state."""
    s, q = snap.stats, snap.queues
    state = "PAUSED" if snap.paused else ("running" if snap.loop_alive else "STOPPED")
    age = f", {max(now - last_step_time, 0.0):.1f} s ago" if last_step_time is not None and s.num_steps else ""
    return (f'<div class="mv-engine" data-step="{s.num_steps}" data-paused="{int(snap.paused)}">'
            f"<b>{state}</b> · step <b>{s.num_steps}</b>{age} · running {len(q.running)}, waiting "
            f"{len(q.waiting)} · KV {100 * s.kv_usage:.1f}% "
            f'<span class="mv-bar"><div style="width:{100 * s.kv_usage:.1f}%"></div></span></div>')


def render_panels(snap: EngineSnapshot, tp: int = 1, pp: int = 1, max_batches: int = 1,
                  palette: RequestPalette | None = None, window: tuple[int, int] | None = None,
                  max_bytes: int | None = None) -> tuple[str, str, str, str, str, str]:
    """The engine's panels, in the page's order: grid, stats, queues, tables, log, parallelism. The grid goes
    first: it updates `palette` with the live requests, whose colours and tones the tables then use."""
    extra = {} if max_bytes is None else {"max_bytes": max_bytes}
    grid = render_block_grid(snap.trace, snap.stats.num_kv_blocks, snap.pool, palette=palette, window=window,
                             **extra)
    swatch = _default_swatch
    if palette is not None:            # a finished request has given its colour back: grey, not a new colour
        live = set(palette.live)
        swatch = lambda rid: palette.swatch(rid) if rid in live else Swatch(UNKNOWN_OWNER)   # noqa: E731
    return (grid, render_stats(snap), render_queues(snap.queues), render_block_tables(snap.trace, swatch),
            render_event_log(snap.events, traces=snap.recent_traces),
            render_parallelism(snap.trace, tp, pp, max_batches, swatch))
