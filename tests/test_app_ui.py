"""The dashboard: its pure render functions against real engine traces, and `python app.py` in a real
headless Chromium (Debian's package, driven by Playwright): chat, streamed text, a changing block grid."""

from __future__ import annotations

import html
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from minivllm import SamplingParams
from minivllm.entrypoints.block_grid import PALETTE, RequestPalette
from minivllm.entrypoints.dashboard import (
    render_block_grid,
    render_block_tables,
    render_event_log,
    render_queues,
    request_color,
)
from minivllm.engine.trace import RequestTrace, StepTrace
from minivllm.entrypoints.dashboard_colors import SHARED_LABEL_BG, SHARED_LABEL_FG, contrast_ratio, text_color
from minivllm.entrypoints.dashboard_chat import message_text
from tests.html_elements import Elements

REPO = Path(__file__).resolve().parent.parent
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run"]


# ---------------------------------------------------------------------- render functions, on real traces
SHARED = ("You are a careful assistant. Read the question, think about what it really asks, and then answer "
          "it in one short and friendly sentence that a child could follow. Use plain words, give one "
          "example if it helps, and never make anything up. Here is the question: ")


traces_queues: dict = {}        # the engine's queues at the `both` step (EngineQueues)


@pytest.fixture(scope="module")
def traces(llm):
    """Two requests sharing a prefix of several blocks, stepped until both run; then run to the end."""
    engine = llm.llm_engine
    engine.kv_cache_manager.reset_prefix_cache()      # the session's engine: start from a known cache
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with engine.record_traces() as recorded:
        engine.add_request(SHARED + "why is the sky blue?", params, request_id="sky")
        engine.step()
        engine.add_request(SHARED + "why is <grass> green?", params, request_id="<grass>")
        engine.step()
        both, pool_both = recorded[-1], engine.kv_cache_manager.block_pool.snapshot()
        traces_queues["both"] = engine.get_queues()
        while engine.has_unfinished_requests():
            engine.step()
    return both, pool_both, list(recorded), engine


def test_a_trace_costs_the_step_not_the_pool(traces):
    """The trace lists ref counts only for the blocks its step touched; the whole pool is a snapshot on demand."""
    both, pool_both, recorded, engine = traces
    touched = (set(both.blocks_allocated) | set(both.blocks_freed) | set(both.blocks_evicted)
               | set(both.prefix_hit_blocks))
    assert set(both.block_ref_counts) == touched and len(touched) < both.num_kv_blocks
    assert all(both.block_ref_counts[b] == pool_both.ref_counts[b] for b in touched)


def test_block_grid_shows_owners_shared_blocks_and_cached_free_blocks(traces):
    both, pool_both, recorded, engine = traces
    ref_counts = pool_both.ref_counts
    cells = Elements(render_block_grid(both, both.num_kv_blocks, pool_both)).cells()
    assert sorted(cells) == list(range(both.num_kv_blocks))
    tables = {r.request_id: r.block_table for r in both.requests}
    shared = set(tables["sky"]) & set(tables["<grass>"])
    assert len(shared) >= 2                                       # the common prefix is in shared blocks
    for b, (attrs, text) in cells.items():
        ref = ref_counts[b]                                       # the block manager's own count
        assert attrs["data-state"] == ("shared" if ref > 1 else "used" if ref == 1 else
                                       "cached" if b in pool_both.cached_free else "free")
        assert text == (str(ref) if ref > 1 else "")
        if ref:
            owner = "sky" if b in tables["sky"] else "<grass>"
            assert request_color(owner) in attrs["style"]
            assert owner in attrs["title"]
    assert {b for b, (a, _) in cells.items() if a["data-state"] == "shared"} == shared
    assert {b for b, (a, _) in cells.items() if "mv-new" in a["class"]} == set(both.blocks_allocated)

    after = recorded[-1]                                          # both finished: their full blocks stay cached
    pool_after = engine.kv_cache_manager.block_pool.snapshot()
    cells = Elements(render_block_grid(after, after.num_kv_blocks, pool_after)).cells()
    cached = {b for b, (a, _) in cells.items() if a["data-state"] == "cached"}
    assert cached == set(engine.kv_cache_manager.block_pool.cached_free) and cached >= shared
    assert all(a["data-state"] in ("cached", "free") for a, _ in cells.values())


def test_block_grid_before_any_step_is_all_free():
    cells = Elements(render_block_grid(None, 12)).cells()
    assert sorted(cells) == list(range(12)) and {a["data-state"] for a, _ in cells.values()} == {"free"}


CHIP = re.compile(r'<span class="mv-chip([^"]*)"( data-shared="(\d+)")? style="([^"]*)"[^>]*><b( style="([^"]*)")?>'
                  r'([^<]*)</b>')


def chips_of(markup: str) -> list[dict]:
    """Every chip: its classes, holders (data-shared), style, the label's style and text."""
    return [dict(cls=c.split(), shared=int(n) if n else 1, style=st, label_style=ls, text=html.unescape(t))
            for c, _, n, st, _, ls, t in CHIP.findall(markup)]


def test_block_tables_and_queues_list_every_request(traces):
    both, _, recorded, _ = traces
    table = render_block_tables(both)
    rows = re.findall(r"<tr><td>(.*?)</td>(.*?)</tr>", table)
    chips = {chips_of(rid)[0]["text"]: [int(c["text"]) for c in chips_of(rest)] for rid, rest in rows}
    assert chips == {r.request_id: list(r.block_table) for r in both.requests}
    assert "<grass>" not in table and "&lt;grass&gt;" in table               # ids are escaped
    queues = render_queues(traces_queues["both"])
    assert "running (2)" in queues and "waiting (0)" in queues
    assert re.findall(r'data-request="([^"]+)" data-status="running"', queues) == ["sky", "&lt;grass&gt;"]


def test_block_tables_mark_shared_blocks_as_the_grid_does(traces):
    """A block in both requests' tables is hatched in both colours with its holder count, in the tables as in
    the grid; every other block is in its request's colour."""
    both, pool_both, _, _ = traces
    palette = RequestPalette()
    grid = Elements(render_block_grid(both, both.num_kv_blocks, pool_both, palette=palette)).cells()
    table = render_block_tables(both, palette.swatch)
    shared_in_grid = {b for b, (a, _) in grid.items() if a["data-state"] == "shared"}
    for row in re.findall(r"<tr><td>.*?</td>(.*?)</tr>", table):
        for c in chips_of(row):
            b = int(c["text"])
            if b in shared_in_grid:
                assert "mv-shared" in c["cls"] and c["shared"] == pool_both.ref_counts[b]
                assert palette.color("sky") in c["style"] and palette.color("<grass>") in c["style"]
            else:
                assert "mv-shared" not in c["cls"]
    assert shared_in_grid and {int(c["text"]) for c in chips_of(table) if "mv-shared" in c["cls"]} == shared_in_grid


def test_chip_text_contrast_and_tones_follow_the_grid():
    """WCAG 2 contrast of every chip's text on its colour is >= 4.5:1 (white text on yellow, pink or cyan was
    1.3-2.0:1); past the palette's 12 colours, a chip carries the same tone class as the request's grid cells."""
    palette = RequestPalette()
    ids = [f"r{i}" for i in range(2 * len(PALETTE) + 3)]
    palette.update(ids)
    reqs = tuple(RequestTrace(rid, "running", 0, 4, 1, 5, 0, 1, "decode", (i,), 0) for i, rid in enumerate(ids))
    trace = StepTrace(1, 0.01, 0, len(ids), reqs, (), (), (), (), (), (), (), (), 0, len(ids), 0, 64, 64 - len(ids),
                      0.5, 0.0, 0, {}, (), 0, 0)
    table = render_block_tables(trace, palette.swatch)
    grid = Elements(render_block_grid(trace, 64, palette=palette)).cells()
    for c in chips_of(table):
        if c["label_style"]:
            fg = re.search(r"color:(#[0-9a-f]+)", c["label_style"])[1]
            bg = re.search(r"background:(#[0-9a-f]+)", c["style"])[1]
        else:                                                           # a shared block: the white label
            fg, bg = SHARED_LABEL_FG, SHARED_LABEL_BG
        assert contrast_ratio(fg, bg) >= 4.5, (c, contrast_ratio(fg, bg))
    for c in chips_of(table):
        if c["text"].isdigit():                                         # block b is request r{b}'s
            tone = [k for k in grid[int(c["text"])][0]["class"].split() if k in ("mv-t1", "mv-t2")]
            assert [k for k in c["cls"] if k in ("mv-t1", "mv-t2")] == tone
    assert any("mv-t1" in c["cls"] for c in chips_of(table)) and any("mv-t2" in c["cls"] for c in chips_of(table))
    for color in PALETTE:                                               # the palette itself, either text colour
        assert contrast_ratio(text_color(color), color) >= 4.5


def test_event_log_is_newest_first_and_escaped():
    log = render_event_log(["step 1: admit a", "step 2: finish <b> (length)"])
    assert log.index("finish &lt;b&gt;") < log.index("admit a") and "<b>" not in log


def test_event_log_says_whose_blocks_it_lists(traces):
    """A prefix hit names the requests that hold the blocks after the step, and lists the ids as ranges."""
    _, _, recorded, _ = traces
    hit = next(t for t in recorded if t.prefix_hit_blocks)
    line = f"step {hit.step}: prefix hit on blocks {list(hit.prefix_hit_blocks)}"
    log = html.unescape(render_event_log([line], traces=recorded))
    blocks = sorted(hit.prefix_hit_blocks)
    assert blocks == list(range(blocks[0], blocks[-1] + 1))            # one run of ids: one range
    assert f"prefix hit on {len(blocks)} block(s) (whose: sky, <grass> {blocks[0]}-{blocks[-1]})" in log, log
    assert render_event_log([line]) == render_event_log([line], traces=()) and "whose: - " in html.unescape(
        render_event_log([line]))                                       # the step's trace is gone: unknown


def test_message_text_reads_gradio_6_content_blocks():
    assert message_text([{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]) == "Hello there"
    assert message_text("plain") == "plain" and message_text(None) == ""


# ---------------------------------------------------------------------- `python app.py` in a browser
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_app(tmp_path, *args: str):
    """`python app.py ARGS` on a free port; yields (url, process) once /health answers, then stops it cleanly."""
    port = free_port()
    env = dict(os.environ, GRADIO_ANALYTICS_ENABLED="False", OMP_NUM_THREADS="1")
    log = open(tmp_path / "app.log", "w")
    proc = subprocess.Popen([sys.executable, "app.py", "--port", str(port), "--threads", "1", *args], cwd=REPO,
                            env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while True:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            pytest.fail("app.py did not come up:\n" + (tmp_path / "app.log").read_text())
        time.sleep(0.25)
    yield url, proc
    proc.terminate()            # SIGTERM: uvicorn shuts down gracefully (the engine too), then re-raises it
    try:
        code = proc.wait(timeout=30)
    finally:
        proc.kill()
        log.close()
    text = (tmp_path / "app.log").read_text()
    assert code in (0, -signal.SIGTERM) and "engine shut down" in text, text
    assert "Traceback" not in text, text


@pytest.fixture
def app_process(tmp_path):
    yield from start_app(tmp_path, "--num-kv-blocks", "128")


@pytest.mark.slow
def test_the_dashboard_streams_a_chat_and_the_block_grid_changes(app_process, tmp_path):
    if not shutil.which(CHROMIUM):
        pytest.fail(f"{CHROMIUM} is missing: install Debian's chromium (apt-get install -y chromium).")
    from playwright.sync_api import sync_playwright

    url, _ = app_process
    # app.py serves the OpenAI API beside the page.
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list().data] == ["SmolLM2-135M-Instruct"]

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1100})
            page.goto(url + "/")
            page.wait_for_selector("#mv-grid .mv-blk", timeout=60_000)
            grid = page.locator("#mv-grid .mv-blk")
            assert grid.count() == 128
            assert page.locator('#mv-grid .mv-blk[data-state="free"]').count() == 128     # nothing ran yet

            box = page.locator("#mv-msg textarea")
            box.fill("Write a short poem about the sea.")
            box.press("Enter")
            answer = page.locator('#mv-chatbot [data-testid="bot"]')
            answer.first.wait_for(timeout=60_000)
            lengths = []
            deadline = time.time() + 90
            while time.time() < deadline:          # watch the answer grow, token by token
                lengths.append(len(answer.last.inner_text()))
                if len(set(lengths)) >= 4 and lengths[-1] > 40:
                    break
                time.sleep(0.05)
            grown = sorted({n for n in lengths if n})
            assert len(grown) >= 3, f"the answer did not stream: lengths seen {lengths}"

            # The timer-refreshed grid now shows blocks held by (or cached for) the chat's request.
            page.wait_for_selector('#mv-grid .mv-blk:not([data-state="free"])', timeout=30_000)
            held = page.locator('#mv-grid .mv-blk[data-state="used"], #mv-grid .mv-blk[data-state="cached"]')
            assert held.count() > 0
            assert "chat-1" in page.locator("#mv-tables").inner_text() + page.locator("#mv-grid").inner_text()
            assert page.locator('#mv-parallel [data-tp="1"][data-pp="1"]').count() == 1     # the ranks, said

            # A second turn: the history (Gradio 6 content blocks) goes back through the chat template.
            page.wait_for_selector('#mv-stats [data-in-flight="0"]', timeout=90_000)     # the answer is done
            box.fill("Now say it in one word.")
            box.press("Enter")
            page.wait_for_function(
                "() => { const m = document.querySelectorAll('#mv-chatbot [data-testid=\"bot\"]');"
                " return m.length === 2 && m[1].innerText.trim().length > 0; }", timeout=90_000)
            page.locator("#mv-tables").get_by_text("chat-2").wait_for(timeout=30_000)   # a new request

            page.locator("#mv-pause").click()
            page.wait_for_selector('#mv-stats [data-paused="1"]', timeout=30_000)
            page.locator("#mv-resume").click()
            page.wait_for_selector('#mv-stats [data-paused="0"]', timeout=30_000)

            shot = tmp_path / "dashboard.png"
            page.screenshot(path=str(shot), full_page=True)
            assert shot.stat().st_size > 20_000
        finally:
            browser.close()


SCREENSHOT_DIR = os.environ.get("MINIVLLM_SCREENSHOTS")      # where CI keeps the screenshots (a test artifact)
LESSON_SCREENSHOT = REPO / "lessons" / "images" / "dashboard_preempted.png"


def keep_screenshot(page, tmp_path, name: str) -> Path:
    """A full-page screenshot in tmp_path, copied to $MINIVLLM_SCREENSHOTS when it is set."""
    shot = tmp_path / name
    page.screenshot(path=str(shot), full_page=True)
    if SCREENSHOT_DIR:
        Path(SCREENSHOT_DIR).mkdir(parents=True, exist_ok=True)
        shutil.copy(shot, Path(SCREENSHOT_DIR) / name)
    return shot


@pytest.fixture
def small_pool_app(tmp_path):
    """24 blocks of 16 tokens: the demo traffic fills it, so requests queue and a running one is preempted."""
    yield from start_app(tmp_path, "--num-kv-blocks", "24", "--max-num-seqs", "8")


@pytest.mark.slow
def test_the_dashboard_shows_the_queue_a_preempted_chat_and_the_history(small_pool_app, tmp_path):
    """Issue 19's browser checks: waiting requests listed while paused, shared blocks drawn as shared, the chat
    told it was preempted (it asked for priority 5, so it is the victim), the timelines, plots, step log and
    latency percentiles populated after the demo traffic, the buttons enabled only when they do something, and no
    "Use via API" link."""
    if not shutil.which(CHROMIUM):
        pytest.fail(f"{CHROMIUM} is missing: install Debian's chromium (apt-get install -y chromium).")
    from playwright.sync_api import sync_playwright

    url, _ = small_pool_app
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1100})
            page.goto(url + "/")
            page.wait_for_selector("#mv-stats .mv-idle", timeout=60_000)          # a newcomer is told what to do
            assert page.get_by_text("Use via API").count() == 0
            assert page.locator("button#mv-resume").is_disabled()   # not paused yet
            assert page.locator("button#mv-step").is_disabled()

            # The chat asks for priority 5 (lower runs first): it runs while the engine is idle, then waits on
            # the pause with 24 demo requests queued behind it.
            priority = page.locator("#mv-priority input[type=number]")
            priority.fill("5")
            priority.press("Enter")
            box = page.locator("#mv-msg textarea")
            box.fill("Tell me a long story about a lighthouse keeper and her cat.")
            box.press("Enter")
            page.wait_for_selector('#mv-chat-status [data-state="running"]', timeout=60_000)
            page.locator("button#mv-pause").click()
            page.wait_for_selector('#mv-stats [data-paused="1"]', timeout=30_000)
            assert page.locator("button#mv-pause").is_disabled() and not page.locator("button#mv-resume").is_disabled()
            page.locator("button#mv-demo").click()
            page.wait_for_selector('#mv-queues [data-waiting="24"]', timeout=60_000)
            waiting = page.locator('#mv-queues [data-queue="waiting"] [data-status="waiting"]')
            assert waiting.count() == 24
            assert page.locator('#mv-queues [data-queue="running"] [data-request="chat-1"]').count() == 1
            assert not page.locator("button#mv-step").is_disabled()                # paused, with work to step
            keep_screenshot(page, tmp_path, "dashboard_paused_queue.png")

            # One step, then run: the pool runs out, and the chat (priority 5, the worst) is the victim.
            page.locator("button#mv-step").click()
            page.wait_for_function("() => Number(document.querySelector('#mv-queues .mv-queues')"
                                   ".dataset.waiting) < 24", timeout=60_000)
            page.locator("button#mv-resume").click()
            page.wait_for_selector('#mv-chat-status [data-state="preempted"]', timeout=180_000)
            status = page.locator("#mv-chat-status").inner_text()
            assert "preempted at step" in status and "lowest-priority" in status, status
            assert page.locator('#mv-queues [data-status="preempted"]').count() >= 1
            page.wait_for_selector('#mv-grid [data-state="shared"]', timeout=60_000)  # the shared system prompt
            shot = keep_screenshot(page, tmp_path, "dashboard_preempted.png")
            if os.environ.get("MINIVLLM_UPDATE_LESSON_SCREENSHOT") == "1":    # the serving lesson shows this one
                LESSON_SCREENSHOT.parent.mkdir(exist_ok=True)
                shutil.copy(shot, LESSON_SCREENSHOT)

            # Afterwards: the history views are populated.
            page.wait_for_selector('#mv-chat-status [data-state="finished"]', timeout=300_000)
            assert "preempted at step(s)" in page.locator("#mv-chat-status").inner_text()
            page.wait_for_selector('#mv-latency tr[data-metric="TTFT"][data-p50]', timeout=30_000)
            assert page.locator('#mv-timelines rect[data-phase="decode"]').count() > 0
            assert page.locator('#mv-timelines rect[data-phase="preempted"]').count() > 0
            for plot in ("#mv-throughput", "#mv-kv-plot", "#mv-queue-plot"):     # Gradio's LinePlot (Vega-Lite)
                page.wait_for_selector(f"{plot} .vega-embed", timeout=30_000)
            assert int(page.locator("#mv-steplog pre").get_attribute("data-lines")) > 0
            keep_screenshot(page, tmp_path, "dashboard_demo.png")
        finally:
            browser.close()
