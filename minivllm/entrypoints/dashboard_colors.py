"""The dashboard's request chips: a request's colour and tone (as the block grid draws it) with readable text.

Owns: the text colour on a coloured chip (black or white, whichever contrasts more: WCAG 2 contrast is then at
least 4.58:1 on any background) and the markup of a chip, the same in the block tables, the parallelism panel
and anywhere else a request or a block is named in its colour. A colour that repeats (more live requests than
colours) carries the grid's tone mark (block_grid.py: mv-t1 dotted, mv-t2 striped) around the text, never
behind it. A block held by more than one request is hatched in its first two holders' colours, as in the grid,
with its text on a white label. Pure functions: data in, HTML out.
"""

from __future__ import annotations

import colorsys
import html
import re

from minivllm.entrypoints.block_grid import Swatch

SHARED_LABEL_BG, SHARED_LABEL_FG = "#ffffff", "#111111"     # the label on a hatched (shared) chip

CHIP_CSS = f"""
.mv-chip {{ display: inline-block; margin: 1px; border-radius: 3px; padding: 2px; font: 11px/14px monospace;
           vertical-align: middle; }}
.mv-chip > b {{ display: block; padding: 0 4px; border-radius: 2px; font-weight: normal; background-color: inherit; }}
.mv-chip.mv-shared {{ background: repeating-linear-gradient(45deg, var(--a) 0 3px, var(--b) 0 6px); }}
.mv-chip.mv-shared > b {{ background: {SHARED_LABEL_BG}; color: {SHARED_LABEL_FG}; font-weight: bold; }}
"""


def to_hex(color: str) -> str:
    """#rrggbb for a #rgb, #rrggbb or hsl(h, s%, l%) colour (the last is block_grid.request_color's)."""
    m = re.fullmatch(r"hsl\((\d+), *(\d+)%, *(\d+)%\)", color.strip())
    if m:
        r, g, b = colorsys.hls_to_rgb(int(m[1]) / 360, int(m[3]) / 100, int(m[2]) / 100)
        return "#" + "".join(f"{round(255 * v):02x}" for v in (r, g, b))
    return color


def relative_luminance(color: str) -> float:
    """WCAG 2's relative luminance of a colour (to_hex's forms), 0 (black) to 1 (white)."""
    h = to_hex(color).lstrip("#")
    if len(h) == 3:
        h = "".join(c * 2 for c in h)
    if not re.fullmatch(r"[0-9a-fA-F]{6}", h):
        raise ValueError(f"colour {color!r} is not #rrggbb or #rgb")
    def linear(c: int) -> float:
        s = c / 255
        return s / 12.92 if s <= 0.04045 else ((s + 0.055) / 1.055) ** 2.4
    r, g, b = (linear(int(h[i:i + 2], 16)) for i in (0, 2, 4))
    return 0.2126 * r + 0.7152 * g + 0.0722 * b


def contrast_ratio(a: str, b: str) -> float:
    """WCAG 2 contrast ratio of two colours, 1 to 21."""
    la, lb = sorted((relative_luminance(a), relative_luminance(b)), reverse=True)
    return (la + 0.05) / (lb + 0.05)


def text_color(background: str) -> str:
    """Black or white text on `background`, whichever contrasts more."""
    return "#000" if contrast_ratio(background, "#000") >= contrast_ratio(background, "#fff") else "#fff"


def chip(text: str, swatches: list[Swatch], title: str = "") -> str:
    """A chip in its holder's colour and tone; with two or more holders, hatched in the first two colours with the
    holder count (`data-shared`) and the text on a white label. `text` is escaped here. Markup:
    `<span class="mv-chip [mv-t1|mv-t2]" style="background:C"><b style="color:T">text</b></span>`, or
    `<span class="mv-chip mv-shared" data-shared=N style="--a:C1;--b:C2"><b>text</b></span>`."""
    title_attr = f' title="{html.escape(title)}"' if title else ""
    label = html.escape(text)
    if len(swatches) > 1:
        colors = list(dict.fromkeys(s.color for s in swatches))
        a, c = colors[0], colors[1] if len(colors) > 1 else "#fff"
        return (f'<span class="mv-chip mv-shared" data-shared="{len(swatches)}" style="--a:{a};--b:{c}"{title_attr}>'
                f"<b>{label}</b></span>")
    sw = swatches[0]
    tone = f" mv-t{sw.tone}" if sw.tone else ""
    return (f'<span class="mv-chip{tone}" style="background:{sw.color}"{title_attr}>'
            f'<b style="color:{text_color(sw.color)}">{label}</b></span>')
