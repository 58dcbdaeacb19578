"""Widgets and text plots of the TUI (see :mod:`tensordiff.tui`).

The heatmap is a Line-API :class:`~textual.scroll_view.ScrollView`: it renders only the lines on
screen, reading the diff summary (:class:`tensordiff.summary.SummaryReader`) in blocks of rows
through a bounded LRU cache, so neither its time to paint nor its memory grows with the trace.
Nothing here judges a tensor: colours and glyphs show the aligner's per-token flags (fails
tolerance, NaN/Inf) and the size of the metric it wrote.
"""

from __future__ import annotations

import json
import math
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
from rich.segment import Segment
from rich.style import Style
from rich.text import Text
from textual import events
from textual.binding import Binding
from textual.geometry import Size
from textual.message import Message
from textual.scroll_view import ScrollView
from textual.strip import Strip

from .summary import FLAG_BAD, FLAG_NONFINITE, SummaryReader
from .vocab import REGIMES

# ----------------------------------------------------------------------------------------------
# Metrics shown by the heatmap
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Metric:
    key: str
    field: int        # column of the summary's [n, 4] rows: 0 cos, 1 rel, 2 maxabs, 3 flags
    title: str
    lo: float         # log10 of the value drawn as the lowest bar
    hi: float         # log10 of the value drawn as the highest bar


METRICS = (
    Metric("rel", 1, "relative error", -6.0, 1.0),
    Metric("cos", 0, "1 - cosine", -7.0, 0.3),
    Metric("maxabs", 2, "max abs error", -6.0, 2.0),
    Metric("verdict", 3, "aligner verdict (fails tolerance / NaN)", 0.0, 1.0),
)

BARS = "▁▂▃▄▅▆▇█"
N_LEVELS = len(BARS)
CELL_W = 4          # three glyphs and a gap
HEADER_H = 2        # column header lines (sticky)
GUTTER_W = 22       # "seq:pos token" and a separator

# cell codes: 0 absent; otherwise category * N_LEVELS + level (+1 keeps 0 free)
CAT_OK, CAT_FAIL, CAT_NONFINITE = 0, 1, 2


def cell_codes(values: np.ndarray, flags: np.ndarray, metric: Metric) -> np.ndarray:
    """uint8 code of every cell of a block: 0 where the tensor has no row for that token,
    otherwise 1 + category * N_LEVELS + level (category from the aligner's flags)."""
    present = ~np.isnan(flags)
    fl = np.where(present, flags, 0).astype(np.int64)
    cat = np.where(fl & FLAG_NONFINITE, CAT_NONFINITE, np.where(fl & FLAG_BAD, CAT_FAIL, CAT_OK))
    if metric.key == "verdict":
        level = np.where(cat == CAT_OK, 0, N_LEVELS - 1)
    else:
        v = values.astype(np.float64)
        if metric.key == "cos":
            v = 1.0 - v
        with np.errstate(divide="ignore", invalid="ignore"):
            lg = np.log10(np.abs(v))
        frac = (lg - metric.lo) / (metric.hi - metric.lo)
        frac = np.where(np.isfinite(frac), frac, np.where(np.abs(v) > 0, 1.0, 0.0))
        frac = np.where(np.isnan(v), 1.0, frac)
        level = np.clip(np.floor(frac * N_LEVELS), 0, N_LEVELS - 1).astype(np.int64)
    codes = 1 + cat * N_LEVELS + level
    return np.where(present, codes, 0).astype(np.uint8)


def legend(metric: Metric) -> str:
    """One-line key of the heatmap's glyphs for a metric."""
    if metric.key == "verdict":
        return "··· ok  ███ fails"
    return f"{BARS[0]} {10 ** metric.lo:.0e} .. {BARS[-1]} {10 ** metric.hi:.0e}"


def _mix(c1: tuple[int, int, int], c2: tuple[int, int, int], t: float) -> str:
    r, g, b = (round(a + (b_ - a) * t) for a, b_ in zip(c1, c2))
    return f"#{r:02x}{g:02x}{b:02x}"


def _cell_tables(verdict_mode: bool) -> tuple[list[str], list[Style]]:
    glyphs = ["   "]
    styles = [Style()]
    for cat in (CAT_OK, CAT_FAIL, CAT_NONFINITE):
        for lvl in range(N_LEVELS):
            t = lvl / (N_LEVELS - 1)
            if cat == CAT_NONFINITE:
                glyphs.append("!!!")
                styles.append(Style(color="#ff40ff", bold=True))
                continue
            if verdict_mode:
                glyphs.append("···" if cat == CAT_OK else "███")
            else:
                glyphs.append(BARS[lvl] * 3)
            if cat == CAT_OK:
                styles.append(Style(color=_mix((46, 125, 50), (192, 202, 51), t)))
            else:
                styles.append(Style(color=_mix((255, 183, 77), (255, 23, 68), t), bold=lvl >= N_LEVELS - 2))
    return glyphs, styles


GLYPHS, STYLES = _cell_tables(False)
VGLYPHS, VSTYLES = _cell_tables(True)

# ----------------------------------------------------------------------------------------------
# Columns of the summary
# ----------------------------------------------------------------------------------------------


@dataclass
class Column:
    index: int            # column of the summary file
    label: str            # embed, layer3, draft_input[0]...
    tensor_a: str
    tensor_b: str
    slot: int
    order: float
    slot_label: str | None
    packed: bool

    @property
    def short(self) -> str:
        if self.packed:
            return f"[{self.slot}]"
        return short_label(self.label)

    def matches(self, tensor: str | None, slot: int | None) -> bool:
        if tensor is None or tensor not in (self.tensor_a, self.tensor_b):
            return False
        return (slot or 0) == self.slot


def short_label(label: str) -> str:
    if label == "embed":
        return "emb"
    if label == "final_norm":
        return "fn"
    if label.startswith("layer") and label[5:].isdigit():
        n = label[5:]
        return f"L{n}" if len(n) <= 2 else n[-3:]
    return label[:3]


def read_columns(summary: SummaryReader) -> list[Column]:
    """The summary's columns in forward order (by order, then slot)."""
    cols = []
    for j, ds in enumerate(summary.columns):
        a = ds.attrs
        label = str(a.get("label", summary.labels[j]))
        try:
            slot_label = json.loads(a.get("slot_label", "null"))
        except (TypeError, ValueError):
            slot_label = None
        ta = str(a.get("tensor_a", label))
        cols.append(Column(index=j, label=label, tensor_a=ta, tensor_b=str(a.get("tensor_b", ta)),
                           slot=int(a.get("slot", 0)), order=float(a.get("order", j)),
                           slot_label=slot_label, packed=label.endswith("]") and slot_label is not None))
    cols.sort(key=lambda c: (c.order, c.tensor_a, c.slot))
    return cols


# ----------------------------------------------------------------------------------------------
# Bounded block cache over a summary
# ----------------------------------------------------------------------------------------------


class BlockCache:
    """LRU cache of summary blocks: cell codes per (metric, block) and token rows per block.
    At most ``max_blocks`` blocks of each kind are held, whatever the trace size."""

    def __init__(self, summary: SummaryReader, block_rows: int = 256, max_blocks: int = 24):
        self.summary = summary
        self.block_rows = block_rows
        self.max_blocks = max_blocks
        self._codes: OrderedDict = OrderedDict()
        self._tokens: OrderedDict = OrderedDict()
        self.reads = 0

    def __len__(self) -> int:
        return len(self._codes) + len(self._tokens)

    def _get(self, cache: OrderedDict, key, load):
        hit = cache.get(key)
        if hit is not None:
            cache.move_to_end(key)
            return hit
        val = load()
        self.reads += 1
        cache[key] = val
        while len(cache) > self.max_blocks:
            cache.popitem(last=False)
        return val

    def codes(self, row: int, metric: Metric) -> tuple[np.ndarray, int]:
        """(codes block [rows, n_columns] uint8, row offset inside it)."""
        b, off = divmod(row, self.block_rows)
        start = b * self.block_rows

        def load():
            stop = min(start + self.block_rows, self.summary.n)
            flags = self.summary.block(start, stop, 3)
            vals = flags if metric.field == 3 else self.summary.block(start, stop, metric.field)
            return cell_codes(vals, flags, metric)

        return self._get(self._codes, (metric.key, b), load), off

    def token(self, row: int):
        b, off = divmod(row, self.block_rows)
        start = b * self.block_rows
        blk = self._get(self._tokens, b, lambda: self.summary.tokens(start, min(start + self.block_rows, self.summary.n)))
        return blk[off]

    def clear(self) -> None:
        self._codes.clear()
        self._tokens.clear()


def find_position(summary: SummaryReader, seq: int, pos: int) -> int:
    """Aligned index of (A sequence index, A position), or of the next aligned token after it
    (the summary's rows are sorted by A sequence, then position). Binary search: ~log2(n) reads."""
    lo, hi = 0, summary.n
    ds = summary.tokens_ds
    while lo < hi:
        mid = (lo + hi) // 2
        r = ds[mid]
        if (int(r["seq_a"]), int(r["pos_a"])) < (seq, pos):
            lo = mid + 1
        else:
            hi = mid
    return lo


def find_token_id(summary: SummaryReader, token: int, start: int, block: int = 65536) -> int | None:
    """First aligned index at or after ``start`` (wrapping) whose token id is ``token``."""
    n = summary.n
    for base in list(range(start, n, block)) + list(range(0, start, block)):
        stop = min(base + block, n if base >= start else start)
        hit = np.flatnonzero(summary.tokens_ds.fields("token")[base:stop] == token)
        if len(hit):
            return base + int(hit[0])
    return None


# ----------------------------------------------------------------------------------------------
# The heatmap
# ----------------------------------------------------------------------------------------------


class Heatmap(ScrollView, can_focus=True):
    """token x slot heatmap: one line per aligned token, one cell per tensor/slot column."""

    BINDINGS = [
        Binding("up", "move(-1, 0)", "up", show=False),
        Binding("down", "move(1, 0)", "down", show=False),
        Binding("left", "move(0, -1)", "left", show=False),
        Binding("right", "move(0, 1)", "right", show=False),
        Binding("pageup", "page(-1)", "page up", show=False),
        Binding("pagedown", "page(1)", "page down", show=False),
        Binding("home", "edge(0)", "first token", show=False),
        Binding("end", "edge(1)", "last token", show=False),
    ]

    DEFAULT_CSS = """
    Heatmap { background: $surface; width: 1fr; height: 1fr; }
    """

    class CellSelected(Message):
        """The cursor moved to (row, column); ``column`` is a summary column index."""

        def __init__(self, row: int, column: int) -> None:
            self.row = row
            self.column = column
            super().__init__()

    def __init__(self, *, block_rows: int = 256, max_blocks: int = 24, **kw) -> None:
        super().__init__(**kw)
        self.block_rows = block_rows
        self.max_blocks = max_blocks
        self.summary: SummaryReader | None = None
        self.blocks: BlockCache | None = None
        self.columns: list[Column] = []       # all, forward order
        self.shown: list[Column] = []       # after the filter
        self.metric = METRICS[0]
        self.cursor_row = 0
        self.cursor_col = 0                   # index into self.shown
        self.message_lines: list[str] = ["diff running..."]
        self._seq_names: list[str] = []

    # -- data ------------------------------------------------------------------------------

    def attach(self, summary: SummaryReader, columns: list[Column]) -> None:
        self.summary = summary
        self.blocks = BlockCache(summary, self.block_rows, self.max_blocks)
        self.columns = list(columns)
        self.shown = list(columns)
        self._seq_names = list(summary.seq_a)
        self.cursor_row = 0
        self.cursor_col = 0
        self._update_virtual()
        self.refresh()

    def show_message(self, *lines: str) -> None:
        self.message_lines = list(lines)
        self.refresh()

    def _update_virtual(self) -> None:
        n = self.summary.n if self.summary is not None else 0
        # one blank cell of padding: the last column shows whole at the rightmost scroll
        self.virtual_size = Size(GUTTER_W + (len(self.shown) + 1) * CELL_W, n + HEADER_H)

    @property
    def n_rows(self) -> int:
        return self.summary.n if self.summary is not None else 0

    @property
    def column(self) -> Column | None:
        return self.shown[self.cursor_col] if self.shown else None

    def set_filter(self, text: str) -> int:
        """Show only columns whose label contains one of the comma-separated terms (case-blind);
        an empty filter shows all. Returns the number of visible columns."""
        terms = [t.strip().lower() for t in text.split(",") if t.strip()]
        current = self.column
        if terms:
            self.shown = [c for c in self.columns
                            if any(t in c.label.lower() or t in (c.slot_label or "").lower() for t in terms)]
        else:
            self.shown = list(self.columns)
        if current is not None and current in self.shown:
            self.cursor_col = self.shown.index(current)
        else:
            self.cursor_col = 0
        self._update_virtual()
        self.refresh()
        if self.shown:
            self._scroll_into_view()
            self._post()
        return len(self.shown)

    def set_metric(self, metric: Metric) -> None:
        self.metric = metric
        self.refresh()

    def column_position(self, summary_column: int) -> int | None:
        for i, c in enumerate(self.shown):
            if c.index == summary_column:
                return i
        return None

    # -- cursor ----------------------------------------------------------------------------

    def move_to(self, row: int | None = None, col: int | None = None, *, center: bool = False) -> None:
        """Put the cursor on (row, visible column); None keeps that coordinate."""
        if self.summary is None or not self.shown:
            return
        old_row, old_offset = self.cursor_row, self.scroll_offset
        if row is not None:
            self.cursor_row = max(0, min(int(row), self.n_rows - 1))
        if col is not None:
            self.cursor_col = max(0, min(int(col), len(self.shown) - 1))
        self._scroll_into_view(center=center)
        if self.scroll_offset == old_offset:
            # only the lines that show the cursor change: old and new row, the column header
            sy = self.scroll_offset.y
            self.refresh_line(old_row + HEADER_H)
            self.refresh_line(self.cursor_row + HEADER_H)
            self.refresh_line(sy + HEADER_H - 1)
        else:
            self.refresh()
        self._post()

    def _post(self) -> None:
        if self.column is not None:
            self.post_message(self.CellSelected(self.cursor_row, self.column.index))

    @property
    def page_rows(self) -> int:
        return max(1, self.scrollable_content_region.height - HEADER_H)

    def _scroll_into_view(self, center: bool = False) -> None:
        sx, sy = self.scroll_offset
        h = self.page_rows
        r = self.cursor_row
        y = sy
        if center and not (sy <= r < sy + h):
            y = r - h // 2
        elif r < sy:
            y = r
        elif r >= sy + h:
            y = r - h + 1
        w = max(1, self.scrollable_content_region.width - GUTTER_W)
        cx = self.cursor_col * CELL_W
        x = sx
        if cx < sx:
            x = cx
        elif cx + CELL_W > sx + w:
            x = -(-(cx + CELL_W - w) // CELL_W) * CELL_W   # whole cells at the left edge
        max_y = max(0, self.n_rows + HEADER_H - self.scrollable_content_region.height)
        max_x = max(0, GUTTER_W + (len(self.shown) + 1) * CELL_W - self.scrollable_content_region.width)
        max_x -= max_x % CELL_W
        y = max(0, min(y, max_y))
        x = max(0, min(x, max_x))
        if (x, y) != (sx, sy):
            self.scroll_to(x=x, y=y, animate=False, immediate=True, force=True)

    def action_move(self, drow: int, dcol: int) -> None:
        self.move_to(self.cursor_row + drow, self.cursor_col + dcol)

    def action_page(self, direction: int) -> None:
        self.move_to(self.cursor_row + direction * self.page_rows)

    def action_edge(self, end: int) -> None:
        self.move_to(self.n_rows - 1 if end else 0)

    def cell_at(self, x: int, y: int) -> tuple[int | None, int | None]:
        """(row, visible column) under a content-relative point; None where it is not a cell."""
        sx, sy = self.scroll_offset
        row = sy + y - HEADER_H if y >= HEADER_H else None
        col = (x - GUTTER_W + sx) // CELL_W if x >= GUTTER_W else None
        if row is not None and not 0 <= row < self.n_rows:
            row = None
        if col is not None and not 0 <= col < len(self.shown):
            col = None
        return row, col

    async def on_click(self, event: events.Click) -> None:
        off = event.get_content_offset(self)
        if off is None or self.summary is None:
            return
        row, col = self.cell_at(off.x, off.y)
        if row is None and col is None:
            return
        self.focus()
        self.move_to(row, col)

    # -- rendering -------------------------------------------------------------------------

    def render_line(self, y: int) -> Strip:
        width = self.scrollable_content_region.width
        base = self.rich_style
        if self.summary is None or not self.shown:
            lines = self.message_lines if self.summary is None else ["no column matches the filter (press / to change it)"]
            text = lines[y] if y < len(lines) else ""
            return Strip([Segment(text[:width].ljust(width), base)], width)
        sx, sy = self.scroll_offset
        cells_w = max(0, width - GUTTER_W)
        c0 = sx // CELL_W
        c1 = min(len(self.shown), c0 + cells_w // CELL_W + 2)
        if y < HEADER_H:
            gutter, cells = self._header_line(y, c0, c1, base)
        else:
            row = sy + y - HEADER_H
            if row >= self.n_rows:
                return Strip.blank(width, base)
            gutter, cells = self._row_line(row, c0, c1, base)
        strip = Strip(cells).crop(sx - c0 * CELL_W, sx - c0 * CELL_W + cells_w)
        return Strip(gutter + list(strip)).adjust_cell_length(width, base)

    def _header_line(self, y: int, c0: int, c1: int, base: Style) -> tuple[list[Segment], list[Segment]]:
        hstyle = base + Style(bold=True)
        cur = base + Style(bold=True, reverse=True)
        if y == 0:
            title = " " + legend(self.metric)
            gutter = [Segment(title[:GUTTER_W - 1].ljust(GUTTER_W - 1) + "│", hstyle)]
            segs: list[Segment] = []
            i = c0
            while i < c1:
                c = self.shown[i]
                if not c.packed:
                    segs.append(Segment(" " * CELL_W, base))
                    i += 1
                    continue
                j = i
                while j < c1 and self.shown[j].packed and self.shown[j].tensor_a == c.tensor_a:
                    j += 1
                span = (j - i) * CELL_W
                segs.append(Segment(c.tensor_a[:span - 1].ljust(span), hstyle))
                i = j
            return gutter, segs
        gutter = [Segment("seq:pos".rjust(14) + " " + "token".rjust(6) + "│", hstyle)]
        segs = []
        for i in range(c0, c1):
            c = self.shown[i]
            segs.append(Segment(c.short[:CELL_W - 1].ljust(CELL_W), cur if i == self.cursor_col else hstyle))
        return gutter, segs

    def _row_line(self, row: int, c0: int, c1: int, base: Style) -> tuple[list[Segment], list[Segment]]:
        assert self.blocks is not None
        tok = self.blocks.token(row)
        seq = int(tok["seq_a"])
        name = self._seq_names[seq] if 0 <= seq < len(self._seq_names) else str(seq)
        pos = str(int(tok["pos_a"]))
        room = 14 - len(pos) - 1
        key = (name if len(name) <= room else "…" + name[-(room - 1):]) + ":" + pos if room > 1 else pos[-14:]
        is_cur = row == self.cursor_row
        gstyle = base + (Style(reverse=True, bold=True) if is_cur else Style(dim=True))
        gutter = [Segment(key.rjust(14)[-14:] + " " + str(int(tok["token"])).rjust(6)[-6:], gstyle),
                  Segment("│", base + Style(dim=True))]
        codes, off = self.blocks.codes(row, self.metric)
        line = codes[off]
        glyphs, styles = (VGLYPHS, VSTYLES) if self.metric.key == "verdict" else (GLYPHS, STYLES)
        segs = []
        for i in range(c0, c1):
            code = int(line[self.shown[i].index])
            st = base + styles[code]
            if is_cur and i == self.cursor_col:
                st = st + Style(reverse=True, bold=True)
                glyph = glyphs[code] if code else "[ ]"
            else:
                glyph = glyphs[code]
            segs.append(Segment(glyph, st))
            segs.append(Segment(" ", base))
        return gutter, segs


# ----------------------------------------------------------------------------------------------
# Text plots for the detail pane
# ----------------------------------------------------------------------------------------------


def sparkline(values: np.ndarray, width: int, top: float | None = None) -> str:
    """Values (>= 0) binned to ``width`` columns by their maximum, drawn as bars scaled to ``top``."""
    v = np.asarray(values, dtype=np.float64)
    if len(v) == 0 or width <= 0:
        return ""
    v = np.where(np.isfinite(v), v, np.nan)
    width = min(width, len(v))
    edges = np.linspace(0, len(v), width + 1).astype(np.int64)
    with np.errstate(all="ignore"):
        binned = np.array([np.nanmax(v[a:b]) if b > a and not np.all(np.isnan(v[a:b])) else np.nan
                           for a, b in zip(edges[:-1], edges[1:])])
    top = float(np.nanmax(binned)) if top is None and np.any(np.isfinite(binned)) else (top or 0.0)
    out = []
    for x in binned:
        if not np.isfinite(x):
            out.append("!")
        elif top <= 0 or x <= 0:
            out.append(" " if top > 0 else "▁")
        else:
            out.append(BARS[min(N_LEVELS - 1, int(x / top * N_LEVELS))])
    return "".join(out)


def histograms(a: np.ndarray, b: np.ndarray, bins: int) -> tuple[str, str, float, float]:
    """Histograms of two vectors over a common range, as two lines of bars scaled to the same
    count; returns (line a, line b, lo, hi)."""
    fa, fb = a[np.isfinite(a)], b[np.isfinite(b)]
    both = np.concatenate([fa, fb])
    if len(both) == 0:
        return "", "", math.nan, math.nan
    lo, hi = float(both.min()), float(both.max())
    if hi <= lo:
        hi = lo + 1.0
    ha, _ = np.histogram(fa, bins=bins, range=(lo, hi))
    hb, _ = np.histogram(fb, bins=bins, range=(lo, hi))
    top = max(int(ha.max(initial=0)), int(hb.max(initial=0)), 1)

    def bars(h):
        return "".join(" " if c == 0 else BARS[min(N_LEVELS - 1, int(c / top * N_LEVELS))] for c in h)

    return bars(ha), bars(hb), lo, hi


def fmt(x, nd: int = 4) -> str:
    if x is None:
        return "-"
    try:
        x = float(x)
    except (TypeError, ValueError):
        return str(x)
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    if x != 0 and (abs(x) >= 1e4 or abs(x) < 1e-3):
        return f"{x:.3e}"
    return f"{x:.{nd}f}"


def regime_name(code) -> str:
    try:
        return REGIMES[int(code)]
    except (IndexError, ValueError, TypeError):
        return str(code)


def plot_lines(va: np.ndarray | None, vb: np.ndarray | None, side_a: str, side_b: str, width: int) -> list[Text]:
    """The detail pane's small plots: |a - b| per dimension, and the value histograms of both."""
    lab = max(len(side_a), len(side_b), 5) + 1
    w = max(8, width - lab - 28)
    out: list[Text] = []
    if va is None or vb is None:
        return out
    n = min(len(va), len(vb))
    d = np.abs(va[:n].astype(np.float64) - vb[:n].astype(np.float64))
    finite = d[np.isfinite(d)]
    mx = float(finite.max()) if len(finite) else math.nan
    at = int(np.nanargmax(np.where(np.isfinite(d), d, -1))) if len(finite) else -1
    line = Text("|a-b|".ljust(lab), style="bold")
    line.append(sparkline(d, w).ljust(min(w, n)), style="magenta")
    line.append(f"  max {fmt(mx)} @dim {at} of {n}", style="dim")
    out.append(line)
    ha, hb, lo, hi = histograms(va[:n], vb[:n], min(w, 64))
    for name, h, style in ((side_a, ha, "cyan"), (side_b, hb, "yellow")):
        t = Text(name[:lab - 1].ljust(lab), style="bold")
        t.append(h, style=style)
        t.append(f"  values in [{fmt(lo, 3)}, {fmt(hi, 3)}]", style="dim")
        out.append(t)
    return out
