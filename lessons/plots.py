"""The lessons' shared matplotlib pictures: request colours, the KV block-pool grid, per-step lanes, blocks held.

Owns: how a request, a block state and a step state look in every lesson. It only draws what it is given
(block tables, ref counts, traces); it never reads or changes an engine.

Request colours come from the dashboard's palette (minivllm/entrypoints/block_grid.py), handed out in order of
first appearance, so requests that arrive one after another get neighbouring entries, which are chosen to be
far apart. A block in the grid is drawn as:

    held       ref 1       its holder's colour
    shared     ref > 1     its first holder's colour, hatched, its ref count in bold
    cached     ref 0, KV kept in the prefix cache (cached-free): dark grey
    free       ref 0, nothing worth keeping (clean-free): light grey
"""

from matplotlib.colors import to_rgb
from matplotlib.patches import Patch, Rectangle
from matplotlib.patheffects import withStroke
from matplotlib.ticker import MaxNLocator

from minivllm.entrypoints.block_grid import PALETTE

CACHED_FREE, CLEAN_FREE = "#a9a9a9", "#ececec"     # greys far from every PALETTE entry
SHARED_HATCH = "//"
# What a request did in a step (lessons 03 and 04): one colour per state, separate from the request colours.
STATE_COLORS = {"prefill": "tab:orange", "recompute": "tab:brown", "decode": "tab:blue", "preempted": "tab:red",
                "swapped": "tab:purple", "waiting": "#dddddd"}
HALO = [withStroke(linewidth=2.5, foreground="white")]   # keeps black text readable on any colour


class RequestColors:
    """One PALETTE colour per request id, given in order of first appearance and kept for the whole lesson.

    colors = RequestColors(["A", "B"]); colors("A") -> PALETTE[0]; colors("C") -> PALETTE[2] (new, next entry).
    """

    def __init__(self, request_ids=()):
        self.assigned = {}                           # request id -> colour, in order of first appearance
        for rid in request_ids:
            self(rid)

    def __call__(self, request_id):
        if request_id not in self.assigned:
            self.assigned[request_id] = PALETTE[len(self.assigned) % len(PALETTE)]
        return self.assigned[request_id]


def contrast(color):
    """White or near-black, whichever stands out more on `color` (by its luminance)."""
    r, g, b = to_rgb(color)
    return "white" if 0.299 * r + 0.587 * g + 0.114 * b < 0.55 else "#222"


def pool_legend(held, cached=True, shared=True):
    """Legend handles for a pool grid: held = {legend text: colour}, then shared, cached-free and clean-free."""
    handles = [Patch(facecolor=c, label=text) for text, c in held.items()]
    if shared:
        handles.append(Patch(facecolor="#bbbbbb", edgecolor="#222", hatch=SHARED_HATCH,
                             label="shared (ref > 1): hatched, first holder's colour"))
    if cached:
        handles.append(Patch(facecolor=CACHED_FREE, label="cached-free (prefix cache)"))
    handles.append(Patch(facecolor=CLEAN_FREE, label="clean-free"))
    return handles


def draw_pool(ax, num_blocks, tables, ref_counts, cached_free, colors, *, texts=None, filled=None, marked=(),
              cols=16, title=""):
    """One square per block, block i at row i // cols, column i % cols.

    tables: {request_id: block table}; ref_counts: one int per block; cached_free: the cached-free block ids;
    colors: a RequestColors; texts: {block id: text} written in the middle of the cell (optional); filled:
    {block id: share of its slots that hold KV, 0..1}, drawn as a full-colour part over a light cell (optional);
    marked: blocks outlined in black dashes. The caller adds the legend (pool_legend).
    """
    holders = {}                                     # block id -> request ids holding it, in table order
    for rid, table in tables.items():
        for b in table:
            holders.setdefault(b, []).append(rid)
    rows = -(-num_blocks // cols)
    for b in range(num_blocks):
        x, y = b % cols, rows - 1 - b // cols
        if b in holders:
            color = colors(holders[b][0])            # a shared block: its first holder's colour
            share = filled.get(b, 1.0) if filled else 1.0
            ax.add_patch(Rectangle((x, y), 0.92, 0.92, facecolor=color, alpha=0.35 if share < 1 else 1.0, lw=0))
            if 0 < share < 1:
                ax.add_patch(Rectangle((x, y), 0.92 * share, 0.92, facecolor=color, lw=0))
            if ref_counts[b] > 1:                   # hatch lines over the colour, light on dark, dark on light
                ax.add_patch(Rectangle((x, y), 0.92, 0.92, fill=False, hatch=SHARED_HATCH, hatch_linewidth=1.5,
                                       edgecolor=contrast(color), lw=0))
                ax.add_patch(Rectangle((x, y), 0.92, 0.92, fill=False, edgecolor="#222", lw=1.2))
        else:
            ax.add_patch(Rectangle((x, y), 0.92, 0.92, facecolor=CACHED_FREE if b in cached_free else CLEAN_FREE,
                                   lw=0))
        if b in marked:
            ax.add_patch(Rectangle((x + 0.04, y + 0.04), 0.84, 0.84, fill=False, edgecolor="black", lw=3, ls="--"))
        ax.text(x + 0.06, y + 0.86, str(b), ha="left", va="top", fontsize=8, fontweight="bold", path_effects=HALO)
        if ref_counts[b] > 0:
            shared = ref_counts[b] > 1
            ax.text(x + 0.86, y + 0.06, f"ref {ref_counts[b]}", ha="right", va="bottom",
                    fontsize=7 if shared else 6, fontweight="bold" if shared else "normal", path_effects=HALO)
        if texts and texts.get(b):
            ax.text(x + 0.46, y + 0.48, texts[b], ha="center", va="center", fontsize=7, family="monospace",
                    path_effects=HALO)
    ax.set_xlim(0, cols)
    ax.set_ylim(0, rows)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title(title)


def draw_lanes(ax, traces, state_of, *, rows=None, labels=None, text_of=None, title=""):
    """One lane per request, one cell per step, coloured by STATE_COLORS[state_of(request trace)].

    traces: StepTraces; state_of(r) -> a STATE_COLORS key, or None for no cell; rows: lane order, top first
    (default: order of first appearance); labels: {request_id: lane label}; text_of(r) -> text in the cell.
    """
    rows = rows or list(dict.fromkeys(r.request_id for t in traces for r in t.requests))
    labels = labels or {}
    for t in traces:
        for r in t.requests:
            state = state_of(r)
            if state is None:
                continue
            y = len(rows) - 1 - rows.index(r.request_id)
            ax.barh(y, 0.9, left=t.step - 0.45, height=0.7, color=STATE_COLORS[state])
            if text_of and text_of(r):
                ax.text(t.step, y, text_of(r), ha="center", va="center", fontsize=7)
    ax.set_yticks(range(len(rows)), [labels.get(rid, rid) for rid in reversed(rows)])
    ax.set_xlabel("engine step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_title(title)


def state_legend(states, labels=None):
    """Legend handles for lanes: one patch per state in `states`, labelled labels[state] or the state's name."""
    labels = labels or {}
    return [Patch(color=STATE_COLORS[s], label=labels.get(s, s)) for s in states]


def draw_held(ax, steps, held, colors, title=""):
    """Blocks held per request after each step, stacked. held: {request_id: [blocks held, one per step]}."""
    ax.stackplot(steps, *held.values(), labels=list(held), colors=[colors(rid) for rid in held], alpha=0.85,
                 step="post")
    ax.set_ylabel("KV blocks")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_title(title)


# What a step's time went to (lesson 11): one colour per part of a step, host parts warm, the model's cool.
STEP_PART_COLORS = {"schedule": "tab:purple", "prepare inputs": "tab:pink", "forward": "tab:blue",
                    "sample": "tab:cyan", "update core": "tab:green", "text": "tab:orange"}


def draw_spans(ax, spans, row_of, *, origin=0.0, label_of=None, colors=STEP_PART_COLORS, title=""):
    """A timeline: each span (part, batch, t0, t1) in seconds is a bar on row row_of[part] (row 0 at the top),
    in ms since `origin`, coloured colors[part]; label_of(part, batch) -> text written on the bar (optional)."""
    names = list(dict.fromkeys(row_of.values()))
    for part, batch, t0, t1 in spans:
        y = len(names) - 1 - names.index(row_of[part])
        left, width = (t0 - origin) * 1e3, (t1 - t0) * 1e3
        ax.barh(y, width, left=left, height=0.7, color=colors[part])
        if label_of is not None and label_of(part, batch):
            ax.text(left + width / 2, y, label_of(part, batch), ha="center", va="center", fontsize=7,
                    color=contrast(colors[part]), clip_on=True)
    ax.set_yticks(range(len(names)), names[::-1])
    ax.set_xlabel("ms")
    ax.set_title(title, fontsize=10)


def draw_roofline(ax, rate, bandwidth, points, *, extra_roofs=(), on_roof=(), title=""):
    """A roofline: min(rate, I x bandwidth) in GFLOP/s over arithmetic intensity I (FLOP per byte), log-log.
    points: {label: (intensity, FLOP/s, marker)}; extra_roofs: (label, FLOP/s) drawn as dashed flat lines;
    on_roof: (label, intensity) pairs marked with a small cross on the roof itself."""
    import numpy as np
    xs = [p[0] for p in points.values()] + [rate / bandwidth] + [i for _, i in on_roof]
    x = np.logspace(np.log10(min(xs) / 4), np.log10(max(xs) * 4), 200)
    for text, i in on_roof:
        y = min(rate, i * bandwidth) / 1e9
        ax.plot(i, y, "x", color="tab:green")
        ax.annotate(text, (i, y), textcoords="offset points", xytext=(-8, 6), fontsize=7, color="tab:green")
    ax.loglog(x, np.minimum(rate, x * bandwidth) / 1e9, color="k", lw=2,
              label=f"roof: min({rate / 1e9:.0f} GFLOP/s, I x {bandwidth / 1e9:.1f} GB/s)")
    for (text, r), ls in zip(extra_roofs, ("--", "-.", ":")):
        ax.axhline(r / 1e9, color="0.3", ls=ls, lw=1, label=text)
    ax.axvline(rate / bandwidth, color="0.6", ls=":", lw=1)
    for text, (i, flops, marker) in points.items():
        ax.plot(i, flops / 1e9, marker, ms=8, label=text)
    low = min([x[0] * bandwidth] + [p[1] for p in points.values()] + [r for _, r in extra_roofs]) / 1e9 / 1.5
    ax.set_ylim(low, rate / 1e9 * 4)
    ax.text(rate / bandwidth * 1.08, low * 1.1, f"ridge {rate / bandwidth:.1f} FLOP/B", fontsize=8, color="0.4")
    ax.set_xlabel("arithmetic intensity (FLOP per byte read)")
    ax.set_ylabel("GFLOP/s")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="upper left")


def draw_dists(before, panels, ids, labels, title, red_labels=()):
    """Lesson 12's distributions: bars of the tokens `ids`, `before` probabilities in grey and each panel's
    `after` in colour, a red x on a token the transformation removed (probability 0). panels: [(title, after)];
    labels: one x label per id; red_labels: token ids whose x label is drawn in red."""
    import matplotlib.pyplot as plt
    import torch
    fig, axes = plt.subplots(len(panels), 1, figsize=(11, 2.3 * len(panels) + 0.6), sharex=True, squeeze=False)
    x = torch.arange(len(ids))
    for ax, (name, after), color in zip(axes[:, 0], panels, ["tab:blue", "tab:orange", "tab:green", "tab:purple"]):
        ax.bar(x - 0.2, before[ids], width=0.4, color="#b0b0b0", label="before")
        ax.bar(x + 0.2, after[ids], width=0.4, color=color, label="after")
        gone = (after[ids] == 0).nonzero()[:, 0]
        if len(gone):
            ax.plot(gone + 0.2, torch.zeros(len(gone)), "x", color="tab:red", ms=6, label="removed")
        ax.set_title(name, fontsize=10, loc="left")
        ax.set_ylabel("probability")
        ax.legend(fontsize=8, loc="upper right", ncol=3)
    axes[-1, 0].set_xticks(x, labels, rotation=60, ha="right", fontsize=9)
    for tick, t in zip(axes[-1, 0].get_xticklabels(), ids.tolist()):
        if t in red_labels:
            tick.set_color("tab:red")
    fig.suptitle(title)
    fig.tight_layout()
    plt.show()


def draw_shared_tables(ax, tables, title="", colors=("tab:blue", "tab:orange", "tab:green", "tab:red")):
    """Block tables one row each (request id on the left, physical block ids in the cells): the blocks every
    table holds in dark grey, each row's own blocks in its colour from `colors`. tables: {request_id: [block]}."""
    common = set.intersection(*(set(t) for t in tables.values()))
    for row, (rid, table) in enumerate(tables.items()):
        y = len(tables) - 1 - row
        for col, b in enumerate(table):
            face = "#5a5a5a" if b in common else colors[row % len(colors)]
            ax.add_patch(Rectangle((col, y), 0.92, 0.85, color=face, alpha=0.9 if b in common else 0.75))
            ax.text(col + 0.46, y + 0.42, str(b), ha="center", va="center", fontsize=10, color="white",
                    fontweight="bold")
        ax.text(-0.15, y + 0.42, rid, ha="right", va="center", fontsize=9)
    ax.set_xlim(-1.4, max(len(t) for t in tables.values()))
    ax.set_ylim(-0.1, len(tables))
    ax.axis("off")
    ax.set_title(title, fontsize=10)
