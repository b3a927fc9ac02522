"""The dashboard's block picture (block_grid.py): the request palette, the states and markings of real engine
steps checked against the block pool's own snapshot, and a 190,000-block pool drawn in groups under 100 KB."""

from __future__ import annotations

import itertools
import math
import random
import re

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.core.block_pool import PoolSnapshot
from minivllm.engine.trace import RequestTrace, StepTrace
from minivllm.entrypoints.block_grid import (
    GRID_CSS,
    PALETTE,
    TONES,
    RequestPalette,
    Swatch,
    render_block_grid,
)
from tests.html_elements import Elements as BaseElements


class Elements(BaseElements):
    """The grid's group cells and legend too."""

    def groups(self) -> list[dict]:
        return [a for _, a, _ in self.found if "mv-group" in a.get("class", "")]

    def legend(self) -> list[tuple[str, dict, str]]:
        inside, out = False, []
        for tag, a, text in self.found:
            if "mv-legend" in a.get("class", ""):
                inside = True
            if inside:
                out.append((tag, a, text))
        return out


def classes(attrs: dict) -> set[str]:
    return set(attrs["class"].split())


def pool_state(pool: PoolSnapshot, b: int) -> str:
    """The oracle: a block's state straight from the pool's snapshot."""
    ref = pool.ref_counts[b]
    return "shared" if ref > 1 else "used" if ref == 1 else "cached" if b in pool.cached_free else "free"


# ---------------------------------------------------------------------- the palette
def srgb_to_lab(hex_color: str, cvd: list[list[float]] | None = None) -> tuple[float, float, float]:
    """CIELAB (D65) of an sRGB colour, optionally as seen with a colour-vision deficiency (Machado et al. 2009,
    severity 1, applied in linear RGB)."""
    rgb = [int(hex_color[i:i + 2], 16) / 255 for i in (1, 3, 5)]
    lin = [c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4 for c in rgb]
    if cvd is not None:
        lin = [min(1.0, max(0.0, sum(m * c for m, c in zip(row, lin)))) for row in cvd]
    r, g, b = lin
    x = (0.4124 * r + 0.3576 * g + 0.1805 * b) / 0.95047
    y = 0.2126 * r + 0.7152 * g + 0.0722 * b
    z = (0.0193 * r + 0.1192 * g + 0.9505 * b) / 1.08883
    f = lambda t: t ** (1 / 3) if t > 0.008856 else 7.787 * t + 16 / 116     # noqa: E731
    return 116 * f(y) - 16, 500 * (f(x) - f(y)), 200 * (f(y) - f(z))


DEUTERANOPIA = [[0.367322, 0.860646, -0.227968], [0.280085, 0.672501, 0.047413], [-0.011820, 0.042940, 1.968881]]
PROTANOPIA = [[0.152286, 1.052583, -0.204868], [0.114503, 0.786281, 0.099216], [-0.003882, -0.048116, 1.051998]]


@pytest.mark.parametrize("vision", [None, DEUTERANOPIA, PROTANOPIA], ids=["normal", "deuteranopia", "protanopia"])
def test_palette_neighbours_are_far_apart_also_for_colour_blind_eyes(vision):
    """Consecutive entries (requests that arrive one after another) differ by CIE76 delta E > 45, wrapping round;
    under normal vision any two entries by > 20, and every entry is far from the free / cached greys."""
    assert len(PALETTE) == len(set(PALETTE)) >= 10
    lab = [srgb_to_lab(c, vision) for c in PALETTE]
    neighbours = [math.dist(lab[i], lab[(i + 1) % len(lab)]) for i in range(len(lab))]
    assert min(neighbours) > 45, dict(zip(PALETTE, neighbours))
    if vision is None:
        assert min(math.dist(a, b) for a, b in itertools.combinations(lab, 2)) > 20
        for grey in ("#e8e8e8", "#bdbdbd", "#888888"):
            assert min(math.dist(c, srgb_to_lab(grey)) for c in lab) > 25


def test_palette_gives_twelve_live_requests_twelve_distinct_colours_in_palette_order():
    palette = RequestPalette()
    ids = [f"r{i}" for i in range(len(PALETTE))]
    palette.update(ids)
    assert [palette.swatch(r) for r in ids] == [Swatch(c, 0) for c in PALETTE]
    assert palette.live == tuple(ids)


def test_palette_colour_is_stable_for_as_long_as_the_request_lives():
    """Random arrivals and departures: a live request never changes colour, and while at most colours x tones
    are live no two share a (colour, tone)."""
    rng = random.Random(0)
    palette, live, seen, fresh = RequestPalette(), [], {}, itertools.count()
    for _ in range(300):
        live = [r for r in live if rng.random() > 0.2] + [f"q{next(fresh)}" for _ in range(rng.randint(0, 6))]
        live = live[:len(PALETTE) * TONES]
        palette.update(live)
        now = {r: palette.swatch(r) for r in live}
        assert len(set(now.values())) == len(live)
        for r, sw in now.items():
            assert seen.setdefault(r, sw) == sw, f"{r} changed colour while live"
        assert set(palette.live) == set(live)                     # those that left gave their colour back


def test_palette_hands_a_new_request_the_colour_free_the_longest():
    palette = RequestPalette()
    ids = [f"r{i}" for i in range(len(PALETTE))]
    palette.update(ids)
    palette.update([r for r in ids if r != "r3"])                 # r3 leaves first, then r7
    palette.update([r for r in ids if r not in ("r3", "r7")])
    palette.update([r for r in ids if r not in ("r3", "r7")] + ["new1"])
    assert palette.color("new1") == PALETTE[3] and palette.swatch("new1").tone == 0
    palette.update([r for r in ids if r not in ("r3", "r7")] + ["new1", "new2"])
    assert palette.color("new2") == PALETTE[7]
    assert palette.color("r0") == PALETTE[0]                      # the others kept theirs


def test_palette_beyond_its_colours_reuses_them_in_a_second_tone():
    palette = RequestPalette()
    ids = [f"r{i}" for i in range(len(PALETTE) + 5)]
    palette.update(ids)
    extra = [palette.swatch(r) for r in ids[len(PALETTE):]]
    assert extra == [Swatch(c, 1) for c in PALETTE[:5]]           # same colours, told apart by the tone
    many = [f"m{i}" for i in range(len(PALETTE) * TONES + 7)]    # more than colours x tones: least-used slots
    palette.update(many)
    slots = [palette.swatch(r) for r in many]
    assert max(slots.count(s) for s in set(slots)) == 2 and len(set(slots)) == len(PALETTE) * TONES


# ---------------------------------------------------------------------- states and markings of a real engine
BLOCK, NUM_BLOCKS = 4, 16
PREFIX = list(range(100, 116))             # 16 tokens: four full blocks that A and B share


@pytest.fixture(scope="module")
def steps(model_dir):
    """A and B share a four-block prefix; A finishes first (its own blocks freed, the prefix stays B's); then E,
    a long prompt of other tokens, finds too few clean blocks and evicts cached ones. Yields every step as
    (trace, the pool's snapshot right after it), and the palette the page would keep."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    llm = LLM(str(model_dir), dtype="float32", device="cpu", num_kv_blocks=NUM_BLOCKS, block_size=BLOCK)
    engine = llm.llm_engine
    pool = engine.kv_cache_manager.block_pool
    recorded: list[tuple[StepTrace, PoolSnapshot]] = []
    listener = lambda trace: recorded.append((trace, pool.snapshot()))     # noqa: E731
    engine.add_trace_listener(listener)
    try:
        engine.add_request(PREFIX + list(range(200, 206)), SamplingParams(temperature=0, max_tokens=4,
                                                                          ignore_eos=True), request_id="A")
        engine.step()
        engine.add_request(PREFIX + list(range(300, 306)), SamplingParams(temperature=0, max_tokens=8,
                                                                          ignore_eos=True), request_id="B")
        while engine.has_unfinished_requests():
            engine.step()
        engine.add_request(list(range(1000, 1044)), SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                           request_id="E")
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        engine.remove_trace_listener(listener)
        torch.set_num_threads(threads)
    engine.check_integrity()
    yield recorded
    engine.shutdown()


def test_every_cell_has_the_pool_state_and_the_step_markings(steps):
    """On every step: the state is the snapshot's; "mv-new" exactly on blocks allocated and held now; "mv-freed"
    on blocks freed and not taken back (never also "mv-new"); "mv-evicted" on the evicted ones."""
    palette = RequestPalette()
    for trace, pool in steps:
        cells = Elements(render_block_grid(trace, NUM_BLOCKS, pool, palette)).cells()
        assert sorted(cells) == list(range(NUM_BLOCKS))
        held = {b for b in range(NUM_BLOCKS) if pool.ref_counts[b]}
        for b, (attrs, _) in cells.items():
            assert attrs["data-state"] == pool_state(pool, b)
            cls = classes(attrs)
            assert ("mv-new" in cls) == (b in trace.blocks_allocated and b in held)
            assert ("mv-freed" in cls) == (b in trace.blocks_freed and b not in held)
            assert not {"mv-new", "mv-freed"} <= cls
            assert ("mv-evicted" in cls) == (b in trace.blocks_evicted)


def test_shared_blocks_are_hatched_in_both_owners_colours_with_the_ref_count(steps):
    palette = RequestPalette()
    both = next((t, p) for t, p in steps if {"A", "B"} <= {r.request_id for r in t.requests if r.block_table})
    trace, pool = both
    cells = Elements(render_block_grid(trace, NUM_BLOCKS, pool, palette)).cells()
    tables = {r.request_id: set(r.block_table) for r in trace.requests}
    shared = tables["A"] & tables["B"]
    assert len(shared) == len(PREFIX) // BLOCK
    assert {b for b, (a, _) in cells.items() if a["data-state"] == "shared"} == shared
    colours = palette.color("A"), palette.color("B")
    assert colours[0] != colours[1]
    for b in shared:
        attrs, text = cells[b]
        assert "repeating-linear-gradient" in attrs["style"] and all(c in attrs["style"] for c in colours)
        assert text == "2" == str(pool.ref_counts[b])
        assert "ref 2" in attrs["title"] and "A" in attrs["title"] and "B" in attrs["title"]
    for b in (tables["A"] | tables["B"]) - shared:                 # a block of one request: its colour, solid
        attrs, text = cells[b]
        owner = "A" if b in tables["A"] else "B"
        assert attrs["style"] == f"background:{palette.color(owner)}" and text == ""


def test_a_finished_request_s_blocks_show_as_freed_in_the_step_that_freed_them(steps):
    palette = RequestPalette()
    a_blocks = set()
    for trace, pool in steps:
        a = trace.by_id.get("A")
        if a is not None and a.status == "running":
            a_blocks = set(a.block_table)
        if "A" in trace.finished:
            break
    only_a = {b for b in a_blocks if pool.ref_counts[b] == 0}     # the prefix stays with B
    assert only_a and only_a <= set(trace.blocks_freed) and a_blocks - only_a
    cells = Elements(render_block_grid(trace, NUM_BLOCKS, pool, palette)).cells()
    for b in only_a:
        attrs, _ = cells[b]
        assert "mv-freed" in classes(attrs) and "mv-new" not in classes(attrs)
        assert attrs["data-state"] in ("cached", "free") and "freed this step" in attrs["title"]
    for b in a_blocks - only_a:                                   # still held (by B): not freed
        assert "mv-freed" not in classes(cells[b][0]) and cells[b][0]["data-state"] == "used"


def test_evicted_blocks_are_marked_evicted(steps):
    """E's prompt needs more blocks than are clean: the pool evicts cached ones and gives them to E."""
    evicting = [(t, p) for t, p in steps if t.blocks_evicted and "E" in t.by_id]
    assert evicting, "the pool never ran out of clean blocks: the test no longer forces an eviction"
    trace, pool = evicting[0]
    cells = Elements(render_block_grid(trace, NUM_BLOCKS, pool, RequestPalette())).cells()
    for b in trace.blocks_evicted:
        attrs, _ = cells[b]
        assert "mv-evicted" in classes(attrs) and "evicted this step" in attrs["title"]
        assert "mv-new" in classes(attrs) and attrs["data-state"] == "used"
        assert b in trace.by_id["E"].block_table


def test_the_legend_explains_every_state_and_marking_and_the_live_requests(steps):
    palette = RequestPalette()
    trace, pool = next((t, p) for t, p in steps if {"A", "B"} <= {r.request_id for r in t.requests
                                                                  if r.block_table})
    markup = render_block_grid(trace, NUM_BLOCKS, pool, palette)
    legend = Elements(markup).legend()
    text = " ".join(t for _, _, t in legend)
    for word in ("used", "shared", "cached-free", "free", "new this step", "freed this step", "evicted this step"):
        assert word in text
    chips = {t: a["style"] for _, a, t in legend if "mv-req" in a.get("class", "")}
    assert chips == {"A": f"background:{palette.color('A')}", "B": f"background:{palette.color('B')}"}
    # A browser test counts `.mv-blk[data-state=...]` in the grid's panel: the legend must add none.
    assert not any("data-state" in a or "data-block" in a or "mv-blk" in a.get("class", "") for _, a, _ in legend)
    for cls in ("mv-freed", "mv-evicted", "mv-group", "mv-t1", "mv-t2", "mv-legend", "mv-sw"):
        assert cls in GRID_CSS


def test_without_a_pool_snapshot_the_trace_alone_gives_the_held_blocks(steps):
    trace, pool = next((t, p) for t, p in steps if {"A", "B"} <= {r.request_id for r in t.requests
                                                                  if r.block_table})
    cells = Elements(render_block_grid(trace, NUM_BLOCKS)).cells()
    for b, (attrs, _) in cells.items():
        expected = pool_state(pool, b)
        if expected == "cached" and b not in trace.cached_free_blocks:
            expected = "free"                                      # not touched by the step: unknown to it
        assert attrs["data-state"] == expected


# ---------------------------------------------------------------------- a large pool, in groups
N_LARGE = 190_000


def large_pool(seed: int = 0) -> tuple[StepTrace, PoolSnapshot]:
    """A busy 190,000-block pool: 300 running requests over 20 shared system prompts of 64 blocks, 150 to 650 own
    blocks each, 30,000 cached-free blocks, all scattered (a pool after hours of churn: no two neighbours alike),
    and a step that allocated, freed and evicted a few hundred blocks."""
    rng = random.Random(seed)
    order = list(range(N_LARGE))
    rng.shuffle(order)
    take = iter(order)
    prefixes = [[next(take) for _ in range(64)] for _ in range(20)]
    requests, refs = [], [0] * N_LARGE
    for i in range(300):
        table = prefixes[i % 20] + [next(take) for _ in range(rng.randint(150, 650))]
        for b in table:
            refs[b] += 1
        requests.append(RequestTrace(f"req-{i}", "running", 0, 64 * 16, 100, len(table) * 16, 64 * 16, 1, "decode",
                                     tuple(table), 0))
    cached = frozenset(next(take) for _ in range(30_000))
    allocated = tuple(r.block_table[-1] for r in requests)
    freed = tuple(b for b in order[-300:])                          # free now
    evicted = allocated[:40]
    trace = StepTrace(
        step=12_345, duration_s=0.05, num_prefill_tokens=0, num_decode_tokens=300, requests=tuple(requests),
        preempted=(), finished=(), blocks_allocated=allocated, blocks_freed=freed, blocks_evicted=evicted,
        prefix_hit_blocks=(), blocks_swapped_out=(), blocks_swapped_in=(), num_waiting=0, num_running=300,
        num_swapped=0, num_kv_blocks=N_LARGE, num_free_blocks=refs.count(0), kv_usage=1 - refs.count(0) / N_LARGE,
        prefix_cache_hit_rate=0.3, num_preemptions_total=0, block_ref_counts={}, cached_free_blocks=(),
        kv_tokens_stored=0, kv_slots_allocated=0)
    return trace, PoolSnapshot(tuple(refs), cached)


@pytest.fixture(scope="module")
def large():
    return large_pool()


COUNT = re.compile(r"(\d+) (used|shared|cached|free|new|freed|evicted)\b")


def test_a_190_000_block_pool_is_drawn_in_groups_under_100_kb(large):
    trace, pool = large
    markup = render_block_grid(trace, N_LARGE, pool, RequestPalette())
    size = len(markup.encode())
    groups = Elements(markup).groups()
    print(f"\n190,000 blocks: {size:,} bytes in {len(groups):,} cells of "
          f"{int(groups[0]['data-last']) - int(groups[0]['data-first']) + 1} blocks")
    assert size < 100_000
    assert not Elements(markup).cells()                           # no per-block cells at this size
    ranges = [(int(g["data-first"]), int(g["data-last"])) for g in groups]
    assert ranges[0][0] == 0 and ranges[-1][1] == N_LARGE - 1       # 0..189,999, each block exactly once
    assert all(b[0] == a[1] + 1 and b[0] <= b[1] for a, b in zip(ranges, ranges[1:]))
    m = re.search(r"blocks 0-189,999 in ([\d,]+) cells of ([\d,]+) blocks", markup)
    assert m and int(m[1].replace(",", "")) == len(groups)
    assert int(m[2].replace(",", "")) == ranges[0][1] + 1 >= math.ceil(N_LARGE / 4096)


def test_group_titles_count_every_block_of_the_pool(large):
    trace, pool = large
    groups = Elements(render_block_grid(trace, N_LARGE, pool)).groups()
    totals = dict.fromkeys(("used", "shared", "cached", "free", "new", "freed", "evicted"), 0)
    for g in groups:
        counts = {word: int(n) for n, word in COUNT.findall(g["title"])}
        first, last = int(g["data-first"]), int(g["data-last"])
        assert g["title"].startswith(f"blocks {first}-{last}: ")
        states = {k: v for k, v in counts.items() if k in ("used", "shared", "cached", "free")}
        assert sum(states.values()) == last - first + 1
        assert g["data-state"] == (next(iter(states)) if len(states) == 1 else "mixed")
        for word in ("new", "freed", "evicted"):
            assert (f"mv-{word}" in classes(g)) == (word in counts)
        for k, v in counts.items():
            totals[k] += v
    oracle = {"used": sum(r == 1 for r in pool.ref_counts), "shared": sum(r > 1 for r in pool.ref_counts),
              "cached": len(pool.cached_free)}
    oracle["free"] = N_LARGE - sum(oracle.values())
    assert {k: totals[k] for k in oracle} == oracle
    assert (totals["new"], totals["freed"], totals["evicted"]) == (
        len(set(trace.blocks_allocated)), len(set(trace.blocks_freed)), len(set(trace.blocks_evicted)))


def test_a_window_is_drawn_one_cell_per_block(large):
    trace, pool = large
    palette = RequestPalette()
    markup = render_block_grid(trace, N_LARGE, pool, palette, window=(1000, 1500))
    cells = Elements(markup).cells()
    assert sorted(cells) == list(range(1000, 1500)) and not Elements(markup).groups()
    assert "blocks 1,000-1,499, one cell each" in markup and len(markup.encode()) < 100_000
    owners = {}
    for r in trace.requests:
        for b in r.block_table:
            owners.setdefault(b, []).append(r.request_id)
    for b, (attrs, text) in cells.items():
        assert attrs["data-state"] == pool_state(pool, b)
        if attrs["data-state"] == "used":                         # 300 live requests: colours x tones reused
            sw = palette.swatch(owners[b][0])
            assert attrs["style"] == f"background:{sw.color}"
            assert {c for c in classes(attrs) if c.startswith("mv-t")} == ({f"mv-t{sw.tone}"} if sw.tone else set())
        if attrs["data-state"] == "shared":
            assert text == str(pool.ref_counts[b]) and palette.color(owners[b][0]) in attrs["style"]
    # max_cells alone would draw 4,096 blocks one by one; the byte budget groups them unless it is lifted.
    full = Elements(render_block_grid(trace, N_LARGE, pool, palette, window=(0, 4096), max_bytes=None))
    assert sorted(full.cells()) == list(range(4096))
    budgeted = Elements(render_block_grid(trace, N_LARGE, pool, palette, window=(0, 4096)))
    assert budgeted.groups() and not budgeted.cells()
    wide = render_block_grid(trace, N_LARGE, pool, palette, window=(50_000, 150_000))
    assert "blocks 50,000-149,999 in " in wide and len(wide.encode()) < 100_000
    groups = Elements(wide).groups()
    assert int(groups[0]["data-first"]) == 50_000 and int(groups[-1]["data-last"]) == 149_999


def test_no_step_yet_and_bad_windows():
    cells = Elements(render_block_grid(None, 12)).cells()
    assert sorted(cells) == list(range(12)) and {a["data-state"] for a, _ in cells.values()} == {"free"}
    assert 'data-state="free"' in render_block_grid(None, N_LARGE)
    with pytest.raises(ValueError, match="window"):
        render_block_grid(None, 12, window=(12, 20))
