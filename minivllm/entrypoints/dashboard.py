"""The live dashboard: a Gradio page that chats with the engine and shows what the engine is doing.

Owns: the page, in two parts (build_layout: the components and where they sit; wire_events: what each control
does), and its style sheet. The panels are pure functions of one snapshot (dashboard_panels.py, block_grid.py,
dashboard_history.py, dashboard_charts.py), the refresh that sends only what changed is dashboard_refresh.py's,
and the chat and the traffic buttons are dashboard_chat.py's. The page reads the engine only through
`AsyncLLMEngine.snapshot()` and `async_engine.live` (both published by the engine thread after each step) and sends
work only through `generate()` and the pause controls: a browser can never block or corrupt a step.

The page, top to bottom (on a phone, in this order, so the engine's state is on the first screen):
    engine bar            step N and how long ago it ran, running / waiting, KV usage, paused (it stays at the
                          top of the window as the page scrolls); pause / single step / resume
    chat | engine         the chat, its status line and the traffic buttons | stats, parallelism, the physical
                          block grid (block_grid.py) with its zoom, and the queues
    charts                throughput (tokens/s over a 5 s window), KV usage, queue lengths over the last minutes
                          (gr.LinePlot: a time axis, units on the y axis, a legend)
    latency | events      p50 / p90 / p99 of queue time, TTFT, ITL, TPOT and end-to-end over the last minute |
                          the event log
    steps, timelines      a line per step, and each request's life in runs of steps
    block tables          each live request's logical -> physical blocks, shared ones hatched as in the grid
Every panel scrolls inside its own box when its content is wider than the screen.
"""

from __future__ import annotations

from dataclasses import dataclass

from minivllm.engine.async_llm import AsyncLLMEngine
from minivllm.entrypoints.block_grid import (  # noqa: F401  (re-exported for the page's tests)
    GRID_CSS,
    RequestPalette,
    block_owners,
    render_block_grid,
    request_color,
)
from minivllm.entrypoints.dashboard_charts import ChartFrames
from minivllm.entrypoints.dashboard_chat import DashboardChat
from minivllm.entrypoints.dashboard_colors import CHIP_CSS
from minivllm.entrypoints.dashboard_panels import (  # noqa: F401  (re-exported)
    render_block_tables,
    render_event_log,
    render_panels,
    render_parallelism,
    render_queues,
    render_stats,
)
from minivllm.entrypoints.dashboard_refresh import REFRESH_SECONDS, refresh_page

DASHBOARD_CSS = """
.mv-grid { display: grid; grid-template-columns: repeat(auto-fill, 18px); gap: 2px; }
.mv-blk { width: 18px; height: 18px; border-radius: 3px; font: 10px/18px monospace; text-align: center;
          color: #fff; box-sizing: border-box; }
.mv-blk[data-state="free"] { background: #e8e8e8; }
.mv-blk[data-state="cached"] { background: repeating-linear-gradient(45deg, #cfcfcf 0 3px, #f4f4f4 3px 6px);
                               color: #555; }
.mv-blk.mv-new { outline: 2px solid #222; outline-offset: -2px; }
.mv-legend span { display: inline-block; padding: 0 5px; margin: 1px; border-radius: 3px;
                  font: 11px/16px monospace; color: #fff; }
.mv-table { border-collapse: collapse; font: 12px monospace; }
.mv-table td, .mv-table th { border-bottom: 1px solid #ddd; padding: 2px 6px; text-align: left; white-space: nowrap; }
.mv-blocktables td:last-child { white-space: normal; min-width: 200px; }
.mv-queues { display: flex; flex-wrap: wrap; gap: 16px; font: 12px monospace; }
.mv-queues div { flex: 1; min-width: 140px; }
.mv-stats { font: 13px monospace; overflow-wrap: anywhere; }
.mv-bar { height: 10px; background: #e8e8e8; border-radius: 3px; overflow: hidden; width: 120px; max-width: 40%;
          display: inline-block; vertical-align: middle; }
.mv-bar > div { height: 100%; background: #59a14f; }
.mv-log { font: 11px/1.35 monospace; max-height: 260px; overflow: auto; white-space: pre-wrap; margin: 0;
          overflow-wrap: anywhere; }
.mv-steplog { max-height: 180px; white-space: pre; overflow-wrap: normal; }
.mv-scroll { max-width: 100%; overflow: auto; }
.mv-idle { background: #fff7e0; border: 1px solid #f0d58c; border-radius: 4px; padding: 4px 8px; }
.mv-chat-status { font: 12px monospace; margin: 2px 0; overflow-wrap: anywhere; }
.mv-chat-status[data-state="preempted"], .mv-chat-status[data-state="swapped"] { color: #b3261e; }
.mv-engine { font: 14px monospace; padding: 4px 0; overflow-wrap: anywhere; }
#mv-engine { position: sticky; top: 0; z-index: 5; background: var(--background-fill-primary, #fff); }
.mv-panel { overflow: auto !important; max-width: 100%; }
"""
PAGE_CSS = DASHBOARD_CSS + GRID_CSS + CHIP_CSS


# ---------------------------------------------------------------------- the page
@dataclass
class DashboardPage:
    """The page's Gradio components that its events read or write."""
    chat_id: object                 # gr.State: the chat's latest request id, for its status line
    sent: object                    # gr.State: a digest of what this tab last received of each output
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
    """The Gradio Blocks page. Mount it with `mount_dashboard` (or `demo.launch(css=PAGE_CSS)`)."""
    import gradio as gr

    traffic = DashboardChat(async_engine)
    palette = RequestPalette()          # one per page, shared by its sessions: a request keeps its colour
    with gr.Blocks(title=title) as demo:
        page = build_layout(gr, async_engine)
        wire_events(gr, demo, page, async_engine, traffic, palette, ChartFrames())
    return demo


def build_layout(gr, async_engine: AsyncLLMEngine) -> DashboardPage:
    """The components, in place (see the module docstring for the order)."""
    snap0 = async_engine.snapshot()
    cfg = async_engine.engine.config
    panel = dict(elem_classes=["mv-panel"])
    gr.Markdown(f"## minivllm: live engine\n`{async_engine.engine.model_path.name}` on "
                f"`{async_engine.engine.device}`, {snap0.stats.num_kv_blocks} KV blocks of {cfg.block_size} "
                f"tokens; the OpenAI API is under `/v1`, metrics at `/metrics`.")
    chat_id, sent = gr.State(None), gr.State({})     # sent: what this tab last received of each output
    engine_bar = gr.HTML(elem_id="mv-engine", **panel)
    with gr.Row(equal_height=False):
        pause_btn = gr.Button("Pause", elem_id="mv-pause", size="sm", min_width=80)
        step_btn = gr.Button("Single step", elem_id="mv-step", interactive=False, size="sm", min_width=80)
        resume_btn = gr.Button("Resume", elem_id="mv-resume", interactive=False, size="sm", min_width=80)
    with gr.Row():
        with gr.Column(scale=2, min_width=300):
            chatbot = gr.Chatbot(label="chat", height=300, elem_id="mv-chatbot")
            chat_status = gr.HTML(elem_id="mv-chat-status", **panel)
            msg = gr.Textbox(placeholder="Ask something, press Enter", show_label=False, elem_id="mv-msg")
            with gr.Row():
                max_tokens = gr.Slider(1, 512, value=96, step=1, label="max_tokens", min_width=190)
                temperature = gr.Slider(0.0, 1.5, value=0.0, step=0.05, label="temperature (0 = greedy)",
                                        min_width=190)
                priority = gr.Slider(-10, 10, value=0, step=1, elem_id="mv-priority", min_width=190,
                                     label="priority (lower runs first, and is preempted last)")
            with gr.Row():
                burst_n = gr.Slider(1, 64, value=16, step=1, label="burst: requests", min_width=190)
                burst_btn = gr.Button("Burst N requests", elem_id="mv-burst", min_width=120)
                demo_btn = gr.Button("Load demo traffic", elem_id="mv-demo", variant="primary", min_width=120)
            burst_out = gr.Markdown()
        with gr.Column(scale=3, min_width=300):
            stats = gr.HTML(elem_id="mv-stats", **panel)
            parallelism = gr.HTML(elem_id="mv-parallel", **panel)
            gr.Markdown("**Physical KV blocks** (the legend below the grid says what each mark means)")
            grid = gr.HTML(elem_id="mv-grid", **panel)
            with gr.Row():
                zoom_from = gr.Number(0, precision=0, minimum=0, label="zoom: from block", elem_id="mv-zoom-from",
                                      min_width=120)
                zoom_to = gr.Number(0, precision=0, minimum=0, label="to block (0: the whole pool)",
                                    elem_id="mv-zoom-to", min_width=120)
            gr.Markdown("**Queues**, as the engine holds them now")
            queues = gr.HTML(elem_id="mv-queues", **panel)
    plot = dict(x="time", color="series", height=220, min_width=280, x_title="time (UTC)", x_axis_format="%H:%M:%S",
                color_title="", y_lim=None)
    with gr.Row():
        throughput = gr.LinePlot(y="tokens/s", title="Throughput, over the 5 s before each point",
                                 y_title="tokens/s", elem_id="mv-throughput", **plot)
        kv_plot = gr.LinePlot(y="% of blocks", title="KV usage", y_title="% of blocks held",
                              elem_id="mv-kv-plot", **{**plot, "y_lim": [0, 100]})
        queue_plot = gr.LinePlot(y="requests", title="Queues", y_title="requests", elem_id="mv-queue-plot", **plot)
    with gr.Row():
        with gr.Column(min_width=300):
            gr.Markdown("**Latency** over the last minute of finished requests")
            latency = gr.HTML(elem_id="mv-latency", **panel)
        with gr.Column(min_width=300):
            gr.Markdown("**Event log**, newest first")
            log = gr.HTML(elem_id="mv-log", **panel)
    gr.Markdown("**Steps**, newest first: one line per step (running: the requests the step ran)")
    step_log = gr.HTML(elem_id="mv-steplog", **panel)
    gr.Markdown("**Request timelines**: the last requests, one bar per run of steps in the same phase")
    timelines = gr.HTML(elem_id="mv-timelines", **panel)
    gr.Markdown("**Block tables**: each request's logical blocks, in order, and the physical block of each "
                "(hatched: shared with another request, as in the grid)")
    tables = gr.HTML(elem_id="mv-tables", **panel)
    outputs = [engine_bar, grid, stats, queues, tables, log, parallelism, chat_status, step_log, timelines, latency,
               throughput, kv_plot, queue_plot, pause_btn, step_btn, resume_btn]     # dashboard_refresh.OUTPUTS
    return DashboardPage(chat_id, sent, chatbot, msg, max_tokens, temperature, priority, burst_n, burst_btn,
                         demo_btn, burst_out, pause_btn, step_btn, resume_btn, zoom_from, zoom_to, outputs)


def wire_events(gr, demo, page: DashboardPage, async_engine: AsyncLLMEngine, traffic: DashboardChat,
                palette: RequestPalette, charts: ChartFrames) -> None:
    """What the page does: chat and traffic (DashboardChat), the pause controls, and the timer's refresh."""
    cfg = async_engine.engine.config
    parallel = (cfg.tensor_parallel_size, cfg.pipeline_parallel_size, async_engine.engine.max_concurrent_batches)

    def refresh(sent: dict, chat_id: str | None, zoom_from: float | None, zoom_to: float | None):
        return refresh_page(gr, async_engine, palette, parallel, sent, chat_id, zoom_from, zoom_to, charts)

    def first_refresh(sent: dict, chat_id: str | None, zoom_from: float | None, zoom_to: float | None):
        sent.clear()                                  # a (re)loaded page has nothing yet
        return refresh(sent, chat_id, zoom_from, zoom_to)

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
    inputs = [p.sent, p.chat_id, p.zoom_from, p.zoom_to]
    timer = gr.Timer(REFRESH_SECONDS)
    timer.tick(refresh, inputs, p.outputs, show_progress="hidden", api_visibility="private")
    demo.load(first_refresh, inputs, p.outputs, show_progress="hidden", api_visibility="private")


def mount_dashboard(app, async_engine: AsyncLLMEngine, path: str = "/", api_key: str | None = None):
    """Mount the dashboard on a FastAPI app (after its own routes, which keep priority). With an API key the
    page asks for a login: any user name, the API key as password. Gradio's own "Use via API" footer link is
    left out: every event of the page is private, and the OpenAI API under /v1 is the documented route."""
    import gradio as gr

    auth = (lambda _user, password: password == api_key) if api_key else None
    return gr.mount_gradio_app(app, build_dashboard(async_engine), path=path, css=PAGE_CSS,
                               auth=auth, footer_links=["gradio", "settings"])
