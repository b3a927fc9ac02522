"""The live dashboard: a Gradio page that chats with the engine and shows what the engine is doing.

Owns: the page, in three parts (build_layout: the components; wire_events: what each control does;
refresh_page: every panel from one snapshot), and the render functions that turn a StepTrace (or an
EngineSnapshot) into HTML. The chat, the bursts and the chat's status line are dashboard_chat.py's. The
render functions are pure (data in, an HTML string out), so tests can call them without a browser. The page
reads the engine only through `AsyncLLMEngine.snapshot()` and sends work only through `generate()` and the
pause controls: a browser can never block or corrupt a step.

Panels (refreshed by a gr.Timer, every one from a single EngineSnapshot):
    the physical block grid   one cell per KV block (a group of blocks in a large pool), by state and owner:
                              block_grid.py
    block tables              each live request's logical -> physical block mapping
    queues                    running, and the waiting queue with its preempted and swapped requests marked
                              (EngineQueues: the same definition the stats and /metrics count)
    stats                     KV usage, prefix-cache hit rate, preemptions, step and token counts
    tokens per step           the last steps' prefill and decode tokens, stacked
    event log                 admissions, finishes, preemptions, prefix hits, evictions, aborts
    parallelism               TP and PP sizes, and under PP which batch each pipeline stage holds
    the chat's status         queued / running / preempted and why / finished, for this page's own request:
                              dashboard_chat.py
    steps, timelines, plots   dashboard_history.py: a summary line per step, each request's life, live plots,
                              TTFT / ITL histograms
"""

from __future__ import annotations

import html
from dataclasses import dataclass

from minivllm.engine.async_llm import AsyncLLMEngine
from minivllm.engine.llm_engine import EngineQueues, QueuedRequest
from minivllm.engine.stats import EngineSnapshot
from minivllm.engine.trace import StepTrace
from minivllm.entrypoints.block_grid import (  # noqa: F401  (block_owners, request_color: re-exported)
    GRID_CSS,
    RequestPalette,
    block_owners,
    render_block_grid,
    request_color,
)
from minivllm.entrypoints.dashboard_chat import DashboardChat, render_chat_status
from minivllm.entrypoints.dashboard_history import (
    render_histogram,
    render_plots,
    render_step_log,
    render_timelines,
)

REFRESH_SECONDS = 0.5
STEPS_SHOWN = 60            # bars in the tokens-per-step chart
EVENTS_SHOWN = 40
PREFILL_COLOR, DECODE_COLOR = "#f28e2b", "#4e79a7"   # the lessons' matplotlib tab:orange / tab:blue

DASHBOARD_CSS = """
.mv-grid { display: grid; grid-template-columns: repeat(auto-fill, 18px); gap: 2px; }
.mv-blk { width: 18px; height: 18px; border-radius: 3px; font: 10px/18px monospace; text-align: center;
          color: #fff; box-sizing: border-box; }
.mv-blk[data-state="free"] { background: #e8e8e8; }
.mv-blk[data-state="cached"] { background: repeating-linear-gradient(45deg, #cfcfcf 0 3px, #f4f4f4 3px 6px);
                               color: #555; }
.mv-blk.mv-new { outline: 2px solid #222; outline-offset: -2px; }
.mv-legend span, .mv-chip { display: inline-block; padding: 0 5px; margin: 1px; border-radius: 3px;
                            font: 11px/16px monospace; color: #fff; }
.mv-table { border-collapse: collapse; font: 12px monospace; }
.mv-table td, .mv-table th { border-bottom: 1px solid #ddd; padding: 2px 6px; text-align: left; }
.mv-queues { display: flex; gap: 16px; font: 12px monospace; }
.mv-queues div { flex: 1; }
.mv-stats { font: 13px monospace; }
.mv-bar { height: 10px; background: #e8e8e8; border-radius: 3px; overflow: hidden; width: 220px;
          display: inline-block; vertical-align: middle; }
.mv-bar > div { height: 100%; background: #59a14f; }
.mv-log { font: 11px/1.35 monospace; max-height: 260px; overflow-y: auto; white-space: pre-wrap; margin: 0; }
.mv-steplog { max-height: 180px; white-space: pre; }
.mv-plots { display: flex; flex-wrap: wrap; gap: 8px; }
.mv-idle { background: #fff7e0; border: 1px solid #f0d58c; border-radius: 4px; padding: 4px 8px; }
.mv-chat-status { font: 12px monospace; margin: 2px 0; }
.mv-chat-status[data-state="preempted"], .mv-chat-status[data-state="swapped"] { color: #b3261e; }
"""


# ---------------------------------------------------------------------- pure render functions
def render_block_tables(trace: StepTrace | None, color=request_color) -> str:
    """Each request of the step: status, what it ran, token counts, how it samples (n > 1 parent, logprobs, its
    grammar's state), and its block table as colored chips."""
    if trace is None or not trace.requests:
        return '<p class="mv-stats">no requests</p>'
    rows = []
    for r in trace.requests:
        chips = "".join(f'<span class="mv-chip" style="background:{color(r.request_id)}">{b}</span>'
                        for b in r.block_table) or "-"
        ran = f"{r.kind} {r.num_scheduled_tokens}" if r.kind else ""
        if r.num_draft_tokens:                    # speculative decoding: drafts verified, and how many were kept
            ran += f" ({r.num_accepted_tokens}/{r.num_draft_tokens} drafts accepted)"
        sampling = r.sampling + (f", sample of {r.parent_id}" if r.parent_id else "")
        rows.append(f"<tr><td>{html.escape(r.request_id)}</td><td>{r.status}</td><td>{ran}</td>"
                    f"<td>{r.num_prompt_tokens}</td><td>{r.num_output_tokens}</td><td>{r.num_computed_tokens}</td>"
                    f"<td>{r.num_cached_tokens}</td><td>{r.num_preemptions}</td><td>{html.escape(sampling)}</td>"
                    f"<td>{chips}</td></tr>")
    head = ("<tr><th>request</th><th>status</th><th>this step</th><th>prompt</th><th>output</th>"
            "<th>computed</th><th>cached</th><th>preempted</th><th>sampling</th><th>block table</th></tr>")
    return f'<table class="mv-table">{head}{"".join(rows)}</table>'


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


def render_tokens_per_step(traces: tuple[StepTrace, ...] | list[StepTrace], width: int = 600,
                           height: int = 140) -> str:
    """An SVG bar chart of the last steps: decode tokens (blue) under prefill tokens (orange)."""
    traces = list(traces)[-STEPS_SHOWN:]
    if not traces:
        return '<p class="mv-stats">no steps yet</p>'
    top = max(max(t.num_prefill_tokens + t.num_decode_tokens for t in traces), 1)
    bar = width / STEPS_SHOWN
    plot_h = height - 18
    rects = []
    for i, t in enumerate(traces):
        x = i * bar
        h_dec = plot_h * t.num_decode_tokens / top
        h_pre = plot_h * t.num_prefill_tokens / top
        tip = f"step {t.step}: {t.num_prefill_tokens} prefill + {t.num_decode_tokens} decode"
        rects.append(f'<g><title>{tip}</title>'
                     f'<rect x="{x:.1f}" y="{plot_h - h_dec:.1f}" width="{bar * 0.85:.1f}" height="{h_dec:.1f}" '
                     f'fill="{DECODE_COLOR}" data-kind="decode"/>'
                     f'<rect x="{x:.1f}" y="{plot_h - h_dec - h_pre:.1f}" width="{bar * 0.85:.1f}" '
                     f'height="{h_pre:.1f}" fill="{PREFILL_COLOR}" data-kind="prefill"/></g>')
    caption = (f'<text x="0" y="{height - 4}" font-size="11" font-family="monospace">steps {traces[0].step}-'
               f'{traces[-1].step}; tallest {top} tokens; '
               f'<tspan fill="{PREFILL_COLOR}">prefill</tspan> / <tspan fill="{DECODE_COLOR}">decode</tspan></text>')
    return (f'<svg width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
            f'xmlns="http://www.w3.org/2000/svg">{"".join(rects)}{caption}</svg>')


def render_parallelism(trace: StepTrace | None, tp: int, pp: int, max_batches: int, color=request_color) -> str:
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
                    + " ".join(f'<span class="mv-chip" style="background:{color(r)}">{html.escape(r)}</span>'
                               for r in rids[:12]) + (" ..." if len(rids) > 12 else ""))
        else:
            cell = f'<span data-stage="{stage}" data-batch="">idle</span>'
        rows.append(f"<tr><td>stage {stage} ({ranks})</td><td>{cell}</td></tr>")
    return head + '<table class="mv-table">' + "".join(rows) + "</table></div>"


def render_event_log(events: tuple[str, ...] | list[str], limit: int = EVENTS_SHOWN) -> str:
    """The newest events first."""
    lines = list(events)[-limit:][::-1]
    return f'<pre class="mv-log">{html.escape(chr(10).join(lines)) or "no events yet"}</pre>'


def render_panels(snap: EngineSnapshot, tp: int = 1, pp: int = 1, max_batches: int = 1,
                  palette: RequestPalette | None = None, window: tuple[int, int] | None = None
                  ) -> tuple[str, str, str, str, str, str, str]:
    """Everything the timer refreshes, in the page's order: grid, stats, queues, tables, chart, log, parallelism.
    The grid goes first: it updates `palette` with the live requests, whose colours the tables then use."""
    grid = render_block_grid(snap.trace, snap.stats.num_kv_blocks, snap.pool, palette=palette, window=window)
    color = palette.color if palette is not None else request_color
    return (grid, render_stats(snap), render_queues(snap.queues), render_block_tables(snap.trace, color),
            render_tokens_per_step(snap.recent_traces), render_event_log(snap.events),
            render_parallelism(snap.trace, tp, pp, max_batches, color))


# ---------------------------------------------------------------------- the page
@dataclass
class DashboardPage:
    """The page's Gradio components that its events read or write."""
    chat_id: object                 # gr.State: the chat's latest request id, for its status line
    chatbot: object
    msg: object
    max_tokens: object
    temperature: object
    priority: object
    burst_n: object
    burst_btn: object
    demo_btn: object
    burst_out: object
    pause_btn: object
    step_btn: object
    resume_btn: object
    zoom_from: object
    zoom_to: object
    outputs: list                   # what refresh_page fills, in its order


def build_dashboard(async_engine: AsyncLLMEngine, title: str = "minivllm"):
    """The Gradio Blocks page. Mount it with `mount_dashboard` (or `demo.launch(css=DASHBOARD_CSS)`)."""
    import gradio as gr

    traffic = DashboardChat(async_engine)
    palette = RequestPalette()          # one per page, shared by its sessions: a request keeps its colour
    with gr.Blocks(title=title) as demo:
        page = build_layout(gr, async_engine)
        wire_events(gr, demo, page, async_engine, traffic, palette)
    return demo


def build_layout(gr, async_engine: AsyncLLMEngine) -> DashboardPage:
    """The components, in place: the chat and controls on the left, the engine's panels on the right and below."""
    snap0 = async_engine.snapshot()
    cfg = async_engine.engine.config
    gr.Markdown(f"## minivllm: live engine\nmodel `{async_engine.engine.model_path.name}` on "
                f"`{async_engine.engine.device}`, {snap0.stats.num_kv_blocks} KV blocks of {cfg.block_size} "
                f"tokens. The OpenAI API is served beside this page under `/v1` (e.g. the `openai` client "
                f"with `base_url=http://<this host>/v1`).")
    chat_id = gr.State(None)
    with gr.Row():
        with gr.Column(scale=2):
            chatbot = gr.Chatbot(label="chat", height=330, elem_id="mv-chatbot")
            chat_status = gr.HTML(elem_id="mv-chat-status")
            msg = gr.Textbox(placeholder="Ask something, press Enter", show_label=False, elem_id="mv-msg")
            with gr.Row():
                max_tokens = gr.Slider(1, 512, value=96, step=1, label="max_tokens")
                temperature = gr.Slider(0.0, 1.5, value=0.0, step=0.05, label="temperature (0 = greedy)")
                priority = gr.Slider(-10, 10, value=0, step=1, elem_id="mv-priority",
                                     label="priority (lower runs first, and is preempted last)")
            with gr.Row():
                burst_n = gr.Slider(1, 64, value=16, step=1, label="burst: requests")
                burst_btn = gr.Button("Burst N requests", elem_id="mv-burst")
                demo_btn = gr.Button("Load demo traffic", elem_id="mv-demo", variant="primary")
            burst_out = gr.Markdown()
            with gr.Row():
                pause_btn = gr.Button("Pause", elem_id="mv-pause")
                step_btn = gr.Button("Single step", elem_id="mv-step", interactive=False)
                resume_btn = gr.Button("Resume", elem_id="mv-resume", interactive=False)
        with gr.Column(scale=3):
            stats = gr.HTML(elem_id="mv-stats")
            parallelism = gr.HTML(elem_id="mv-parallel")
            gr.Markdown("**Physical KV blocks** (the legend below the grid says what each mark means)")
            grid = gr.HTML(elem_id="mv-grid")
            with gr.Row():
                zoom_from = gr.Number(0, precision=0, minimum=0, label="zoom: from block", elem_id="mv-zoom-from")
                zoom_to = gr.Number(0, precision=0, minimum=0, label="to block (0: the whole pool)",
                                    elem_id="mv-zoom-to")
            gr.Markdown("**Queues**, as the engine holds them now")
            queues = gr.HTML(elem_id="mv-queues")
    with gr.Row():
        with gr.Column():
            gr.Markdown("**Tokens per step**: prefill (orange) on top of decode (blue)")
            chart = gr.HTML(elem_id="mv-chart")
        with gr.Column():
            gr.Markdown("**Event log**, newest first")
            log = gr.HTML(elem_id="mv-log")
    gr.Markdown("**Steps**, newest first: one line per step")
    step_log = gr.HTML(elem_id="mv-steplog")
    with gr.Row():
        with gr.Column():
            gr.Markdown("**Request timelines**: the last requests, one cell per step")
            timelines = gr.HTML(elem_id="mv-timelines")
        with gr.Column():
            gr.Markdown("**Over time**, and the latency histograms")
            plots = gr.HTML(elem_id="mv-plots")
            hists = gr.HTML(elem_id="mv-hists")
    gr.Markdown("**Block tables**: each request's logical blocks, in order, and the physical block of each")
    tables = gr.HTML(elem_id="mv-tables")
    outputs = [grid, stats, queues, tables, chart, log, parallelism, chat_status, step_log, timelines, plots,
               hists, pause_btn, step_btn, resume_btn]
    return DashboardPage(chat_id, chatbot, msg, max_tokens, temperature, priority, burst_n, burst_btn, demo_btn,
                         burst_out, pause_btn, step_btn, resume_btn, zoom_from, zoom_to, outputs)


def wire_events(gr, demo, page: DashboardPage, async_engine: AsyncLLMEngine, traffic: DashboardChat,
                palette: RequestPalette) -> None:
    """What the page does: chat and traffic (DashboardChat), the pause controls, and the timer's refresh."""
    cfg = async_engine.engine.config
    parallel = (cfg.tensor_parallel_size, cfg.pipeline_parallel_size, async_engine.engine.max_concurrent_batches)

    def refresh(chat_id: str | None, zoom_from: float | None, zoom_to: float | None):
        return refresh_page(gr, async_engine, palette, parallel, chat_id, zoom_from, zoom_to)

    p = page
    # concurrency_limit=None: Gradio would otherwise run one chat at a time, and batching never shows.
    p.msg.submit(traffic.chat, [p.msg, p.chatbot, p.max_tokens, p.temperature, p.priority],
                 [p.msg, p.chatbot, p.chat_id], concurrency_limit=None, api_visibility="private")
    p.burst_btn.click(traffic.burst, [p.burst_n, p.max_tokens], p.burst_out, concurrency_limit=None,
                      api_visibility="private")
    p.demo_btn.click(traffic.demo_traffic, None, p.burst_out, concurrency_limit=None, api_visibility="private")
    for button, action in ((p.pause_btn, async_engine.pause), (p.step_btn, async_engine.step_once),
                           (p.resume_btn, async_engine.resume)):
        button.click(lambda action=action: action(), None, None, queue=False, api_visibility="private")
    inputs = [p.chat_id, p.zoom_from, p.zoom_to]
    timer = gr.Timer(REFRESH_SECONDS)
    timer.tick(refresh, inputs, p.outputs, show_progress="hidden", api_visibility="private")
    demo.load(refresh, inputs, p.outputs, api_visibility="private")


def refresh_page(gr, async_engine: AsyncLLMEngine, palette: RequestPalette, parallel: tuple[int, int, int],
                 chat_id: str | None, zoom_from: float | None, zoom_to: float | None) -> tuple:
    """Every panel from one snapshot, in DashboardPage.outputs' order, and which pause controls may be pressed."""
    snap = async_engine.snapshot(with_pool=True)
    n = snap.stats.num_kv_blocks
    lo, hi = int(zoom_from or 0), int(zoom_to or 0)
    window = (max(lo, 0), min(hi, n)) if 0 <= lo < hi else None     # 0..0: the whole pool
    has_work = snap.num_requests > 0
    controls = (gr.Button(interactive=not snap.paused),                  # pause: only while running
                gr.Button(interactive=snap.paused and has_work),         # single step: paused, with work
                gr.Button(interactive=snap.paused))                      # resume: only while paused
    return (*render_panels(snap, *parallel, palette=palette, window=window), render_chat_status(chat_id, snap),
            render_step_log(snap.recent_traces), render_timelines(snap.recent_traces),
            render_plots(snap.recent_traces),
            render_histogram("TTFT", snap.ttft) + render_histogram("ITL", snap.itl), *controls)


def mount_dashboard(app, async_engine: AsyncLLMEngine, path: str = "/", api_key: str | None = None):
    """Mount the dashboard on a FastAPI app (after its own routes, which keep priority). With an API key the
    page asks for a login: any user name, the API key as password. Gradio's own "Use via API" footer link is
    left out: every event of the page is private, and the OpenAI API under /v1 is the documented route."""
    import gradio as gr

    auth = (lambda _user, password: password == api_key) if api_key else None
    return gr.mount_gradio_app(app, build_dashboard(async_engine), path=path, css=DASHBOARD_CSS + GRID_CSS,
                               auth=auth, footer_links=["gradio", "settings"])
