"""The dashboard's picture of the physical KV blocks: one cell per block, or per group of blocks in a large pool.

Owns: the request palette (which colour each live request is drawn in) and the pure render function that turns
a StepTrace plus a PoolSnapshot into HTML. It reads traces and snapshots only; it never touches the engine, and
it never decides anything about blocks: states and ref counts are the block pool's, as the snapshot says.

A cell's state is the block's place in the pool after the step (block_pool.py):

    used      ref 1        background: its owner's colour
    shared    ref > 1      hatched in its first two owners' colours, the ref count written inside
    cached    ref 0, KV kept in the prefix cache (cached-free; a later prompt with the same prefix takes it back)
    free      ref 0, nothing worth keeping

and what the latest step did to it, as markings on top of the state:

    mv-new       allocated in the step and held now (solid outline)
    mv-freed     its last holder let go of it in the step, and nobody took it back (dashed outline)
    mv-evicted   its cached KV was dropped in the step to make room (a red corner; usually also mv-new,
                 since eviction is how a fresh block is found when the clean ones run out)

A large pool (more blocks shown than `max_cells`, or markup over `max_bytes`) is drawn in groups of consecutive
blocks, each coloured by its mix of states (a bar: used, shared, cached, free from the bottom up), its title
counting them. `window` zooms in on a range of blocks, at one cell per block when that fits. The page re-sends
the grid after every step it sees, so its size is budgeted (max_bytes; the page passes a smaller budget than
MAX_BYTES): a 190,000-block pool with every group mixed comes to about 500 groups of about 400 blocks.
"""

from __future__ import annotations

import html
import itertools
import math
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from minivllm.core.block_pool import PoolSnapshot
from minivllm.engine.trace import RequestTrace, StepTrace

# Twelve colours from the Tableau 10, Okabe-Ito and Paul Tol sets (all designed for colour-blind readers), in an
# order where each entry is far from the next (CIELAB distance > 50, also under simulated deuteranopia and
# protanopia, wrapping around), since requests that arrive one after another get consecutive entries and tend to
# hold neighbouring blocks. None is close to the greys of free and cached blocks.
PALETTE: tuple[str, ...] = (
    "#4477aa",  # blue
    "#009e73",  # bluish green
    "#332288",  # indigo
    "#e15759",  # red
    "#aa4499",  # purple
    "#f0e442",  # yellow
    "#ff9da7",  # pink
    "#d55e00",  # vermillion
    "#66ccee",  # cyan
    "#999933",  # olive
    "#b07aa1",  # mauve
    "#117733",  # dark green
)
TONES = 3                # tone 0: plain; 1: dotted; 2: striped. 36 requests can be told apart at once.
UNKNOWN_OWNER = "#888"   # a held block whose holder the trace does not list (a snapshot newer than the trace)

# Group cells (a large pool) show the mix of states, not owners.
GROUP_COLORS = {"used": "#4f5d75", "shared": "#c0842d", "cached": "#bdbdbd", "free": "#e8e8e8"}

STATES = ("used", "shared", "cached", "free")
FREE, USED, SHARED, CACHED = 0, 1, 2, 3          # a block's state as one byte (see _state_codes)
LEGEND_REQUESTS = 24                             # request chips in the legend; the rest are counted
MAX_BYTES = 100_000                              # the grid is re-sent whenever a step changed it

GRID_CSS = f"""
.mv-sw {{ display: inline-block; width: 12px; height: 12px; border-radius: 2px; margin-right: 3px;
         vertical-align: -2px; box-sizing: border-box; background: #9aa; }}
.mv-blk[data-state="shared"] {{ color: #111; font-weight: bold; text-shadow: 0 0 2px #fff, 0 0 2px #fff; }}
.mv-blk.mv-freed, .mv-sw-freed {{ outline: 2px dashed #444; outline-offset: -2px; }}
.mv-sw-new {{ outline: 2px solid #222; outline-offset: -2px; }}
.mv-blk.mv-evicted, .mv-sw-evicted {{ position: relative; }}
.mv-blk.mv-evicted::after, .mv-sw-evicted::after {{ content: ""; position: absolute; left: 0; top: 0;
    border-top: 7px solid #d62728; border-right: 7px solid transparent; }}
.mv-t1 {{ background-image: radial-gradient(circle, rgba(255,255,255,.85) 0 1.5px, transparent 2px) !important;
         background-size: 6px 6px; }}
.mv-t2 {{ background-image: repeating-linear-gradient(0deg, rgba(255,255,255,.7) 0 2px, transparent 2px 5px)
         !important; }}
.mv-grid.mv-agg {{ grid-template-columns: repeat(auto-fill, 9px); gap: 1px; }}
.mv-agg .mv-blk {{ width: 9px; height: 9px; border-radius: 1px; }}
.mv-agg .mv-blk.mv-new, .mv-agg .mv-blk.mv-freed {{ outline: none; }}
.mv-agg .mv-blk.mv-new, .mv-sw-gnew {{ box-shadow: inset 0 2px #111; }}
.mv-agg .mv-blk.mv-freed, .mv-sw-gfreed {{ box-shadow: inset 0 -2px #fff; }}
.mv-agg .mv-blk.mv-new.mv-freed {{ box-shadow: inset 0 2px #111, inset 0 -2px #fff; }}
.mv-agg .mv-blk.mv-evicted::after {{ border-top-width: 5px; border-right-width: 5px; }}
.mv-group[data-state="used"], .mv-sw-gused {{ background: {GROUP_COLORS["used"]}; }}
.mv-group[data-state="shared"], .mv-sw-gshared {{ background: {GROUP_COLORS["shared"]}; }}
.mv-group[data-state="mixed"] {{ background: linear-gradient(to top, {GROUP_COLORS["used"]} 0 var(--u),
    {GROUP_COLORS["shared"]} 0 var(--s), {GROUP_COLORS["cached"]} 0 var(--c), {GROUP_COLORS["free"]} 0); }}
.mv-caption {{ font: 12px monospace; margin: 4px 0; }}
.mv-legend .mv-key {{ color: #222; padding: 0 6px 0 0; }}
.mv-legend .mv-req {{ text-shadow: 0 0 2px #000; }}
.mv-sw-free {{ background: #e8e8e8; }}
.mv-sw-cached {{ background: repeating-linear-gradient(45deg, #cfcfcf 0 3px, #f4f4f4 3px 6px); }}
.mv-sw-shared {{ background: repeating-linear-gradient(45deg, {PALETTE[0]} 0 3px, {PALETTE[3]} 0 6px); }}
.mv-sw-used {{ background: {PALETTE[0]}; }}
"""


# ---------------------------------------------------------------------- which colour a request is drawn in
@dataclass(frozen=True)
class Swatch:
    color: str          # hex, from PALETTE
    tone: int = 0       # 0: plain; 1 dotted, 2 striped: a second (third) live request with the same colour


class RequestPalette:
    """Gives each live request a colour that stays its own for as long as it lives.

    A new request takes a colour no live request has, the one free the longest (so a colour just given back is
    not handed straight to the next arrival, which would look like the old request living on); at first, in
    PALETTE order. With more live requests than colours, the next ones take the colours again in tone 1 (dotted),
    then tone 2 (striped); past colours x tones, the least used (colour, tone) is shared.

    The n > 1 samples of one prompt (RequestTrace.parent_id) are requests like any other here: each gets its own
    colour, so the prompt blocks they share show up hatched in their colours, like any shared prefix.

    The palette is the one piece of state of the block picture: keep one per page, call `update` with the live
    request ids on every refresh (render_block_grid does), and read colours with `color` / `swatch`."""

    def __init__(self, colors: tuple[str, ...] = PALETTE, tones: int = TONES):
        if not colors or tones < 1:
            raise ValueError(f"a palette needs at least one colour and one tone (got {len(colors)}, {tones}).")
        self.colors = colors
        # free (tone, colour index) slots, the longest free first; holders of each slot in use
        self._free: OrderedDict[tuple[int, int], None] = OrderedDict(
            ((t, i), None) for t in range(tones) for i in range(len(colors)))
        self._holders: dict[tuple[int, int], int] = {}
        self._slot: dict[str, tuple[int, int]] = {}           # request id -> its slot

    def update(self, live_request_ids: Iterable[str]) -> None:
        """Release the colours of requests not in `live_request_ids`; give the new ones a colour, in order."""
        live = list(dict.fromkeys(live_request_ids))
        keep = set(live)
        for rid in [r for r in self._slot if r not in keep]:
            slot = self._slot.pop(rid)
            self._holders[slot] -= 1
            if not self._holders[slot]:
                del self._holders[slot]
                self._free[slot] = None                       # at the back: free the shortest
        for rid in live:
            self._assign(rid)

    def _assign(self, request_id: str) -> tuple[int, int]:
        slot = self._slot.get(request_id)
        if slot is None:
            if self._free:
                slot = min(self._free, key=lambda s: s[0])    # the lowest tone; within it, the longest free
                del self._free[slot]
            else:
                slot = min(self._holders, key=lambda s: (self._holders[s], s))
            self._slot[request_id] = slot
            self._holders[slot] = self._holders.get(slot, 0) + 1
        return slot

    def swatch(self, request_id: str) -> Swatch:
        """The request's colour and tone (a request not seen yet is given one now, until the next update)."""
        tone, i = self._assign(request_id)
        return Swatch(self.colors[i], tone)

    def color(self, request_id: str) -> str:
        return self.swatch(request_id).color

    @property
    def live(self) -> tuple[str, ...]:
        return tuple(self._slot)


def request_color(request_id: str) -> str:
    """The stateless fallback when no palette is given: a hue from the id's CRC32, the same in every refresh and
    every run (the dashboard's colouring before the palette; two requests may get close hues)."""
    hue = zlib.crc32(request_id.encode()) % 360
    return f"hsl({hue}, 62%, 45%)"


# ---------------------------------------------------------------------- what the picture is drawn from
def block_owners(trace: StepTrace, start: int = 0, stop: int | None = None) -> dict[int, list[str]]:
    """Physical block (of start..stop-1) -> the live requests whose block tables hold it, in the trace's order
    (more than one: a shared prefix)."""
    stop = trace.num_kv_blocks if stop is None else stop
    owners: dict[int, list[str]] = {}
    for r in trace.requests:
        if not r.status.startswith("finished"):
            for block_id in r.block_table:
                if start <= block_id < stop:
                    owners.setdefault(block_id, []).append(r.request_id)
    return owners


def pool_from_trace(trace: StepTrace) -> PoolSnapshot:
    """The pool as far as one trace knows it, when no BlockPool.snapshot() came with it: ref counts from the live
    requests' block tables (exact), cached-free only for the blocks the step touched (others show as free)."""
    refs = [0] * trace.num_kv_blocks
    for block_id, holders in block_owners(trace).items():
        refs[block_id] = len(holders)
    return PoolSnapshot(tuple(refs), frozenset(trace.cached_free_blocks))


def _state_codes(pool: PoolSnapshot, start: int, stop: int) -> bytearray:
    """One byte per block of start..stop-1: FREE, USED, SHARED or CACHED. (stop - start,)"""
    codes = bytearray(map(min, pool.ref_counts[start:stop], itertools.repeat(SHARED)))
    codes.extend(bytes(stop - start - len(codes)))            # a short snapshot: the rest is free
    for b in pool.cached_free:
        if start <= b < stop and not codes[b - start]:
            codes[b - start] = CACHED
    return codes


def step_marks(trace: StepTrace | None, pool: PoolSnapshot) -> tuple[set[int], set[int], set[int]]:
    """(new, freed, evicted) blocks of the latest step. A block freed and allocated again within the step is new
    only; one allocated and freed again (its request finished or was preempted later in the step) is freed."""
    if trace is None:
        return set(), set(), set()
    refs = pool.ref_counts
    held = lambda b: b < len(refs) and refs[b] > 0            # noqa: E731
    return ({b for b in trace.blocks_allocated if held(b)}, {b for b in trace.blocks_freed if not held(b)},
            set(trace.blocks_evicted))


# ---------------------------------------------------------------------- the picture
def render_block_grid(trace: StepTrace | None, num_blocks: int, pool: PoolSnapshot | None = None,
                      palette: RequestPalette | None = None, window: tuple[int, int] | None = None,
                      max_cells: int = 4096, max_bytes: int | None = MAX_BYTES) -> str:
    """The physical KV blocks after `trace`'s step as HTML: a `<div class="mv-grid" data-step=N>` of cells, a
    caption saying what is shown, and a legend (`<div class="mv-legend">`) of every state, marking and live
    request colour. Style it with GRID_CSS after DASHBOARD_CSS.

    pool      BlockPool.snapshot(): every block's ref count and the cached-free set; without it, pool_from_trace
    palette   request colours, stable across calls; it is updated with the trace's live requests. Without one,
              colours come from `request_color` (a hash of the id)
    window    (start, stop): show blocks start..stop-1 only (stop is clipped to the pool)
    max_cells at most this many cells: beyond it, each cell is a group of ceil(shown / max_cells) blocks
    max_bytes and the whole string under this many bytes (None: no limit): the cells are grouped, or the groups
              grown, until it fits. A block's cell costs about 120 bytes and a group's about 200, so 100 KB
              holds a window of about 800 blocks at one cell per block, or about 500 groups

    One cell per block: `<div class="mv-blk [mv-new|mv-freed] [mv-evicted] [mv-t1|mv-t2]" data-state="used|shared|
    cached|free" data-block=B [style="background:..."] title="...">ref count if shared</div>`.
    A group: `<div class="mv-blk mv-group ..." data-first=a data-last=b data-state="used|shared|cached|free|mixed"
    [style="--u:..;--s:..;--c:.."] title="blocks a-b: x used, y shared, z cached, w free">` (zero counts left out)."""
    n = trace.num_kv_blocks if trace is not None else num_blocks
    start, stop = window if window is not None else (0, n)
    stop = min(stop, n)
    if not 0 <= start < stop:
        raise ValueError(f"window {window} shows no block of a pool of {n:,}: give (start, stop) with "
                         f"0 <= start < stop <= {n:,}.")
    if pool is None:
        pool = pool_from_trace(trace) if trace is not None else PoolSnapshot((0,) * n, frozenset())
    codes = _state_codes(pool, start, stop)                   # (stop - start,)
    marks = step_marks(trace, pool)
    live = [r for r in trace.requests if not r.status.startswith("finished")] if trace is not None else []
    if palette is not None:
        palette.update(r.request_id for r in live)
        swatch = palette.swatch
    else:
        swatch = lambda rid: Swatch(request_color(rid))     # noqa: E731

    step = trace.step if trace is not None else 0
    refs = pool.ref_counts
    free_refs = refs.count(0) + n - len(refs)
    used, cached = refs.count(1), len(pool.cached_free)
    summary = (f"{n - free_refs:,} in use ({n - free_refs - used:,} shared), {cached:,} cached-free, "
               f"{free_refs - cached:,} free of {n:,}" + (f" (after step {step})" if trace is not None else
                                                          " (no step yet)"))
    holders = [r for r in live if r.block_table]

    size = max(1, math.ceil((stop - start) / max(1, max_cells)))
    while True:
        if size == 1:
            owners = block_owners(trace, start, stop) if trace is not None else {}
            cells = "".join(_block_cell(b, codes[b - start], refs, owners.get(b, ()), marks, swatch)
                            for b in range(start, stop))
            shown = f"blocks {start:,}-{stop - 1:,}, one cell each"
        else:
            cells = "".join(_group_cells(codes, start, stop, size, marks))
            num_cells = math.ceil((stop - start) / size)
            shown = f"blocks {start:,}-{stop - 1:,} in {num_cells:,} cells of {size:,} blocks"
        agg = " mv-agg" if size > 1 else ""
        legend = _legend(holders if size == 1 else [], swatch, grouped=size > 1)
        out = (f'<div class="mv-grid{agg}" data-step="{step}" data-first="{start}" data-last="{stop - 1}" '
               f'data-group="{size}">{cells}</div><p class="mv-caption">{shown}; {summary}</p>{legend}')
        nbytes = len(out.encode()) if max_bytes is not None else 0
        if max_bytes is None or nbytes <= max_bytes or size >= stop - start:
            return out
        # Fewer, larger groups: cells cost about the same each, so scale the group by the overshoot.
        room = max(max_bytes - (nbytes - len(cells.encode())), max_bytes // 10)
        size = max(size + 1, math.ceil(size * len(cells.encode()) / room * 1.02))


def _block_cell(b: int, code: int, refs: tuple[int, ...], holders: list[str] | tuple[()],
                marks: tuple[set[int], set[int], set[int]], swatch: Callable[[str], Swatch]) -> str:
    """One block's cell: its state, its owners' colours, the step's markings, and a title saying all of it."""
    new, freed, evicted = marks
    cls, style, label = "mv-blk", "", ""
    if code in (USED, SHARED):
        ref = refs[b]
        sw = [swatch(rid) for rid in holders]
        if code == USED:
            state = "used"
            color = sw[0].color if sw else UNKNOWN_OWNER
            style = f' style="background:{color}"'
            if sw and sw[0].tone:
                cls += f" mv-t{sw[0].tone}"
            title = f"block {b}: ref 1, {', '.join(holders) or 'owner not in this step'}"
        else:
            state, label = "shared", str(ref)
            colors = list(dict.fromkeys(s.color for s in sw)) or [UNKNOWN_OWNER]
            a, c = colors[0], colors[1] if len(colors) > 1 else "#fff"
            style = f' style="background:repeating-linear-gradient(45deg,{a} 0 3px,{c} 0 6px)"'
            title = f"block {b}: ref {ref}, shared by {', '.join(holders) or 'requests not in this step'}"
    elif code == CACHED:
        state, title = "cached", f"block {b}: cached-free (prefix cache, ref 0)"
    else:
        state, title = "free", f"block {b}: free"
    if b in new:
        cls, title = cls + " mv-new", title + "; new this step"
    elif b in freed:
        cls, title = cls + " mv-freed", title + "; freed this step"
    if b in evicted:
        cls, title = cls + " mv-evicted", title + "; evicted this step"
    return (f'<div class="{cls}" data-state="{state}" data-block="{b}"{style} '
            f'title="{html.escape(title)}">{label}</div>')


def _group_cells(codes: bytearray, start: int, stop: int, size: int,
                 marks: tuple[set[int], set[int], set[int]]) -> Iterable[str]:
    """One cell per `size` consecutive blocks from `start` (the last may be shorter), coloured by its state mix.
    codes: (stop - start,) from _state_codes."""
    marked: dict[int, list[int]] = {}                       # group index -> [new, freed, evicted]
    for k, blocks in enumerate(marks):
        for b in blocks:
            if start <= b < stop:
                marked.setdefault((b - start) // size, [0, 0, 0])[k] += 1
    for g, a in enumerate(range(start, stop, size)):
        z = min(a + size, stop)
        chunk = codes[a - start:z - start]
        u, s, c = chunk.count(USED), chunk.count(SHARED), chunk.count(CACHED)
        nums = (u, s, c, (z - a) - u - s - c)
        present = [name for name, x in zip(STATES, nums) if x]
        title = f"blocks {a}-{z - 1}: " + ", ".join(f"{x} {name}" for name, x in zip(STATES, nums) if x)
        cls, style = "mv-blk mv-group", ""
        if len(present) > 1:
            state = "mixed"
            total = z - a
            style = (f' style="--u:{100 * u // total}%;--s:{100 * (u + s) // total}%;'
                     f'--c:{100 * (u + s + c) // total}%"')
        else:
            state = present[0]
        m = marked.get(g)
        if m:
            for k, word in enumerate(("new", "freed", "evicted")):
                if m[k]:
                    cls += f" mv-{word}"
            title += "; " + ", ".join(f"{x} {w}" for x, w in zip(m, ("new", "freed", "evicted")) if x)
        yield (f'<div class="{cls}" data-first="{a}" data-last="{z - 1}" data-state="{state}"{style} '
               f'title="{title}"></div>')


def _legend(holders: list[RequestTrace], swatch: Callable[[str], Swatch], grouped: bool) -> str:
    """Every state and marking, then the colours of the live requests that hold blocks (full resolution only)."""
    def key(cls: str, text: str) -> str:
        return f'<span class="mv-key"><i class="mv-sw {cls}"></i>{text}</span>'

    if grouped:
        keys = [key("mv-sw-gused", "used"), key("mv-sw-gshared", "shared"),
                key("mv-sw-cached", "cached-free"), key("mv-sw-free", "free"),
                '<span class="mv-key">(a cell is a group of blocks, filled from the bottom by its mix of states; '
                'a window shows owners)</span><br>',
                key("mv-sw-free mv-sw-gnew", "holds blocks new this step"),
                key("mv-sw-gused mv-sw-gfreed", "freed this step"),
                key("mv-sw-free mv-sw-evicted", "evicted this step")]
    else:
        keys = [key("mv-sw-used", "used (ref 1): the owner's colour"),
                key("mv-sw-shared", "shared (ref &gt; 1, written inside): the owners' colours hatched"),
                key("mv-sw-cached", "cached-free (ref 0, kept for prefix hits)"), key("mv-sw-free", "free"),
                key("mv-sw-free mv-sw-new", "new this step"), key("mv-sw-free mv-sw-freed", "freed this step"),
                key("mv-sw-free mv-sw-evicted", "evicted this step")]
    chips = []
    tones = set()
    for r in holders[:LEGEND_REQUESTS]:
        sw = swatch(r.request_id)
        tones.add(sw.tone)
        tone = f" mv-t{sw.tone}" if sw.tone else ""
        chips.append(f'<span class="mv-req{tone}" style="background:{sw.color}">{html.escape(r.request_id)}</span>')
    if len(holders) > LEGEND_REQUESTS:
        chips.append(f'<span class="mv-key">and {len(holders) - LEGEND_REQUESTS:,} more requests</span>')
    if tones - {0}:
        keys.append('<span class="mv-key">dotted / striped: a second / third request with the same colour</span>')
    return f'<div class="mv-legend">{"".join(keys)}<br>{"".join(chips)}</div>'
