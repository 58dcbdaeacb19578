"""The heatmap, the tree and the modal screens of the TUI (laid out by
:mod:`tensordiff.tui.diff_screen`; the other panes are in :mod:`tensordiff.tui.panes`); their
data is in :mod:`tensordiff.tui.data`.

The heatmap is a Line-API :class:`~textual.scroll_view.ScrollView`: it renders only the lines on
screen, reading the diff summary (:class:`tensordiff.summary.SummaryReader`) in blocks of rows
through a bounded LRU cache, so neither its time to paint nor its memory grows with the trace.
Nothing here judges a tensor: colours and glyphs show the diff's per-token flags (fails
tolerance, NaN/Inf) and the size of the metric it wrote.

Why one module of this size: the Line-API widgets share their glyphs, geometry and cache rules.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import ClassVar

from rich.segment import Segment
from rich.style import Style
from rich.text import Text
from textual import events, on
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical, VerticalScroll
from textual.geometry import Size
from textual.screen import ModalScreen
from textual.scroll_view import ScrollView
from textual.strip import Strip
from textual.timer import Timer
from textual.widgets import Input, Static, Tree

from ..errors import TensordiffError
from ..findings import DiffResult
from ..safety import sanitize_for_terminal
from ..summary import Column, SummaryReader, read_columns
from .data import (
    BARS,
    CAT_FAIL,
    CAT_NONFINITE,
    CAT_OK,
    GOTO_FORMS,
    METRICS,
    N_LEVELS,
    PENDING,
    UNJUDGED,
    BlockCache,
    LiveSummary,
    Metric,
    PreviewSummary,
    filter_columns,
    legend,
    resolve_goto,
)
from .messages import CellSelected, ColumnPicked, PreviewDone, RowsChanged, RowsPainted
from .text import GLYPH_RANK, column_verdict

CELL_W = 4          # three glyphs and a gap
UNJUDGED_GLYPH = " ? "  # the verdict of a preview's cell: not known yet
PENDING_GLYPH = "░░░"   # a cell the running diff has not compared yet: no bar, no verdict colour
HEADER_H = 2        # column header lines (sticky)
GUTTER_W = 22       # "seq:pos token" and a separator
WIDE = 110          # from this many columns a screen is wide (the -wide breakpoint): full titles
LIVE_POLL_S = 0.05  # how often the heatmap looks for the first rows the running diff has compared
LIVE_REDRAW_S = 0.5  # ... and for more, once it shows some (each redraw takes the GIL from the diff)

# ----------------------------------------------------------------------------------------------
# Glyphs and colours of the heatmap's cells (indexed by data.cell_codes)
# ----------------------------------------------------------------------------------------------


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
    assert len(glyphs) == PENDING
    glyphs.append(PENDING_GLYPH)
    styles.append(Style(color="#6c7a89", dim=True))
    assert len(glyphs) == UNJUDGED
    for lvl in range(N_LEVELS):   # a preview's values: bars in one neutral colour, no verdict
        glyphs.append(UNJUDGED_GLYPH if verdict_mode else BARS[lvl] * 3)
        styles.append(Style(color=_mix((84, 110, 122), (176, 190, 197), lvl / (N_LEVELS - 1))))
    return glyphs, styles


GLYPHS, STYLES = _cell_tables(False)
VGLYPHS, VSTYLES = _cell_tables(True)


# ----------------------------------------------------------------------------------------------
# The heatmap
# ----------------------------------------------------------------------------------------------


class Heatmap(ScrollView, can_focus=True):
    """token x slot heatmap: one line per aligned token, one cell per tensor/slot column.

    Before the diff ends it shows the diff's preview (:meth:`show_preview`), then the rows the
    running diff has compared (:meth:`follow`: it polls the diff's LiveSummary), until the app
    attaches the finished summary; it posts :class:`~tensordiff.tui.messages.RowsPainted` when it
    first draws real rows and :class:`~tensordiff.tui.messages.RowsChanged` when new ones come."""

    BINDINGS: ClassVar[list[BindingType]] = [
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

    def __init__(self, *, block_rows: int = 256, max_blocks: int = 24, id: str | None = None) -> None:
        super().__init__(id=id)
        self.block_rows = block_rows
        self.max_blocks = max_blocks
        self.summary: SummaryReader | LiveSummary | None = None
        self.blocks: BlockCache | None = None
        self.columns: list[Column] = []       # all, forward order
        self.shown: list[Column] = []       # after the filter
        self.metric = METRICS[0]
        self.cursor_row = 0
        self.cursor_col = 0                   # index into self.shown
        self.message_lines: list[str] = ["diff running..."]
        self._seq_names: list[str] = []
        self.live = False                     # showing a summary the diff is still writing
        self.running: LiveSummary | None = None   # that summary, while the diff writes it
        self.preview: PreviewSummary | None = None   # the preview's, until the diff streams rows
        self._live_of: Callable[[], LiveSummary | None] | None = None
        self._timer: Timer | None = None
        self._drawn_at = 0.0
        self._painted = self._live_painted = False   # real rows drawn: any, the diff's own
        self._ended = False

    # -- data ------------------------------------------------------------------------------

    def attach(self, summary: SummaryReader | LiveSummary, columns: list[Column], *, live: bool = False) -> None:
        """Show a summary: the finished one, or (``live``) the one the diff is writing, whose
        cells not compared yet are drawn as pending (``░░░``)."""
        self.live = live
        self.summary = summary
        self.blocks = BlockCache(summary, self.block_rows, self.max_blocks)
        self.columns = list(columns)
        self.shown = list(columns)
        self._seq_names = list(summary.seq_a)
        self.cursor_row = 0
        self.cursor_col = 0
        self._update_virtual()
        self.refresh()

    # -- before the diff ends: the preview, then the rows it has compared ------------------

    def follow(self, live_of: Callable[[], LiveSummary | None]) -> None:
        """Show the rows the running diff compares (``live_of``: its LiveSummary sink, once made)."""
        self._live_of = live_of
        self._timer = self.set_interval(LIVE_POLL_S, self._poll)

    def _poll(self) -> None:
        try:
            self._poll_once()
        except (OSError, KeyError, ValueError, TypeError) as e:
            # the file being written cannot be read here: no live rows, the diff goes on
            self.stop_feed()
            self.summary, self.blocks, self.live = None, None, False
            self.show_message("diff running... (the heatmap fills when it ends: "
                              f"cannot read the summary being written: {' '.join(str(e).split())[:120]})")

    def _poll_once(self) -> None:
        live = self._live_of() if self._live_of is not None else None
        if live is None or not live.started or self._ended:
            return
        if self.running is None:
            self.running = live
            self._close_preview()
            self.attach(live, sorted(live.columns, key=lambda c: (c.order, c.tensor_a, c.slot)), live=True)
        now = time.perf_counter()
        if self._painted and now - self._drawn_at < LIVE_REDRAW_S:
            return
        changed = live.changes()
        if changed is not None:
            self._drawn_at = now
            self.rows_changed(*changed)
            if not self._live_painted and live.has_rows:
                self.call_after_refresh(self._rows_painted, True)
            self.post_message(RowsChanged())
        self.update_title()

    def _rows_painted(self, live: bool) -> None:
        if not self._painted or (live and not self._live_painted):
            self.post_message(RowsPainted(live, time.perf_counter()))
        self._painted, self._live_painted = True, self._live_painted or live

    def show_preview(self, path: str) -> None:
        """Show the preview until the diff streams its own rows (or ends)."""
        if self._ended or self.running is not None:
            self.post_message(PreviewDone())
            return
        try:
            pv = PreviewSummary(path)
        except TensordiffError:
            self.post_message(PreviewDone())
            return
        self.preview = pv
        self.attach(pv, read_columns(pv))
        self.update_title()
        self.call_after_refresh(self._preview_painted)
        self.post_message(RowsChanged())

    def _preview_painted(self) -> None:
        self._rows_painted(False)
        self.post_message(PreviewDone())

    def _close_preview(self) -> None:
        if self.preview is not None:
            self.preview.close()
            self.preview = None

    def stop_feed(self, ended: bool = False) -> None:
        """No more preview or live rows (``ended``: the diff has ended)."""
        self._ended = self._ended or ended
        self._close_preview()
        if self._timer is not None:
            self._timer.stop()
            self._timer = None
        if self.running is not None:
            self.running.close_reader()   # before the finished file is opened (HDF5 shares open files)
            self.running = None

    def on_unmount(self) -> None:
        self.stop_feed(ended=True)

    def rows_changed(self, lo: int, hi: int) -> None:
        """The running diff has compared more cells in rows lo..hi-1: redraw them."""
        if self.blocks is not None:
            self.blocks.invalidate(lo, hi)
            sy = self.scroll_offset.y
            if lo < sy + self.page_rows and hi > sy:
                self.refresh()

    def show_message(self, *lines: str) -> None:
        self.message_lines = list(lines)
        self.refresh()

    def on_resize(self, event: events.Resize) -> None:
        # a smaller window must not leave the cursor row (or column) out of view
        if self.summary is not None and self.shown:
            self._scroll_into_view()

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
        current = self.column
        self.shown = filter_columns(self.columns, text)
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

    def next_metric(self) -> None:
        """Show the next metric (``m``), after the last the first."""
        self.set_metric(METRICS[(METRICS.index(self.metric) + 1) % len(METRICS)])

    def update_title(self) -> None:
        """The border title: the metric and what is shown (the preview, the rows the running diff
        has compared, or the diff's summary), set only when it changed: setting it redraws the
        whole heatmap, even when unchanged. On a narrow screen a title the pane shows whole."""
        m, s, narrow = self.metric, self.summary, self.app.size.width < WIDE
        if isinstance(s, PreviewSummary):
            title = (f"tokens x slots: {m.title}  (preview: the first {s.n} tokens' values, "
                     "no verdict yet; the diff is aligning every token)")
        elif isinstance(s, LiveSummary):
            title = (f"tokens x slots: {m.title}  (diff running: {s.columns_done()} of {len(s.columns)} columns "
                     f"compared, ░░░ not yet; {s.n} tokens)")
        else:
            n, shown, total = (s.n if s is not None else 0), len(self.shown), len(self.columns)
            cols = f"{shown} of {total} columns" if shown != total else f"{total} columns"
            title = f"{m.title}: {n} tokens, {cols}" if narrow else f"tokens x slots: {m.title}  ({n} tokens, {cols})"
        if self.border_title != title:
            self.border_title = title

    def place(self, row: int, column: int, n: int) -> tuple[Column, str] | None:
        """The column and ``seq:pos token t (#row)`` of cell (row, summary column) while the
        heatmap shows streamed or preview rows (``n`` of them); None when there is no such cell."""
        col = next((c for c in self.columns if c.index == column), None)
        if self.blocks is None or col is None or not 0 <= row < n:
            return None
        tok = self.blocks.token(row)
        seqs, seq = self._seq_names, int(tok["seq_a"])
        return col, f"{seqs[seq] if 0 <= seq < len(seqs) else seq}:{int(tok['pos_a'])} token {int(tok['token'])} (#{row})"

    def goto(self, spec: str, side: str) -> bool:
        """Move the cursor to a token: ``#INDEX``, ``SEQ:POS``, ``POS`` (current sequence) or
        ``t=TOKEN_ID`` (next row with that token id); ``side`` names the trace whose keys these
        are. Returns whether it moved."""
        assert isinstance(self.summary, SummaryReader)
        seq = int(self.blocks.token(self.cursor_row)["seq_a"]) if self.blocks is not None else 0
        row, note = resolve_goto(self.summary, spec, self.cursor_row, seq, side)
        if row is None:
            self.notify(note or f"cannot read {spec!r}: use {GOTO_FORMS}", severity="warning")
            return False
        if note:
            self.notify(note, timeout=3)
        self.move_to(row, center=True)
        return True

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
            self.post_message(CellSelected(self.cursor_row, self.column.index))

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
        g0, g1 = self._group_of(self.cursor_col)
        if (g1 - g0) * CELL_W <= w:   # the cursor's packed tensor whole: its header and every slot readable
            if g1 * CELL_W > x + w:
                x = -(-(g1 * CELL_W - w) // CELL_W) * CELL_W
            x = min(x, g0 * CELL_W)
        max_y = max(0, self.n_rows + HEADER_H - self.scrollable_content_region.height)
        max_x = max(0, GUTTER_W + (len(self.shown) + 1) * CELL_W - self.scrollable_content_region.width)
        max_x -= max_x % CELL_W
        y = max(0, min(y, max_y))
        x = max(0, min(x, max_x))
        if (x, y) != (sx, sy):
            self.scroll_to(x=x, y=y, animate=False, immediate=True, force=True)

    def _group_of(self, col: int) -> tuple[int, int]:
        """The shown columns [g0, g1) of the packed tensor column ``col`` belongs to (itself alone
        when it is not packed)."""
        if not 0 <= col < len(self.shown) or not self.shown[col].packed:
            return col, col + 1
        name = self.shown[col].tensor_a
        g0, g1 = col, col + 1
        while g0 > 0 and self.shown[g0 - 1].packed and self.shown[g0 - 1].tensor_a == name:
            g0 -= 1
        while g1 < len(self.shown) and self.shown[g1].packed and self.shown[g1].tensor_a == name:
            g1 += 1
        return g0, g1

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
                if not c.packed:   # a run of unpacked columns: the names their short labels stand for
                    j = i
                    while j < c1 and not self.shown[j].packed:
                        j += 1
                    segs.append(Segment(run_names(self.shown[i:j]), hstyle))
                    i = j
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
# The tree of tensors and slots
# ----------------------------------------------------------------------------------------------


class TensorTree(Tree[int]):
    """Every compared tensor, packed ones with a child per slot, marked from the diff's findings.
    A node picked posts :class:`~tensordiff.tui.messages.ColumnPicked` with its summary column."""

    @on(Tree.NodeSelected)
    def _node_selected(self, event: Tree.NodeSelected[int]) -> None:
        if event.node.data is not None:
            self.post_message(ColumnPicked(int(event.node.data)))

    def show(self, res: DiffResult, columns: list[Column], compact: bool = False) -> None:
        """``compact`` (a narrow screen): a slot's line says what it holds first (``✗ 0 holds
        layer3 (embed)``), so the pane's edge cuts the claim, not the finding."""
        tree = self
        tree.clear()
        groups: dict[str, list[Column]] = {}
        for c in columns:
            groups.setdefault(c.tensor_a, []).append(c)
        for name, cols in groups.items():
            verdicts = [column_verdict(res, c) for c in cols]
            if len(cols) == 1 and not cols[0].packed:
                g, s, words = verdicts[0]
                tree.root.add_leaf(Text.assemble((g, s), " ", cols[0].label, (f"  {words}", "dim")), data=cols[0].index)
                continue
            g, s, _ = max(verdicts, key=lambda v: GLYPH_RANK.get(v[0], 0))
            node = tree.root.add(Text.assemble((g, s), " ", name, (f"  {len(cols)} slots", "dim")),
                                 data=cols[0].index, expand=True)
            for c, (g2, s2, words) in zip(cols, verdicts):
                if compact:
                    claim = f" ({c.slot_label})" if c.slot_label else ""
                    node.add_leaf(Text.assemble((g2, s2), f" {c.slot} ", (words, s2 or ""), (claim, "dim")),
                                  data=c.index)
                    continue
                claim = f" = {c.slot_label}" if c.slot_label else ""
                node.add_leaf(Text.assemble((g2, s2), f" slot {c.slot}{claim}", (f"  {words}", "dim")), data=c.index)


# ----------------------------------------------------------------------------------------------
# Screens
# ----------------------------------------------------------------------------------------------


HELP = [
    ("n / p", "next / previous divergence (every finding when there is none)"),
    ("f", "jump to the first divergence"),
    ("g", "go to a token: #INDEX (aligned row), SEQ:POS, POS (in the current sequence) or t=TOKEN_ID"),
    ("/", "filter tensors: comma-separated substrings of column labels (empty: all); Enter or Esc closes"),
    ("m", "toggle the heatmap metric: relative error, 1 - cosine, max abs error, aligner verdict"),
    ("a", "show or hide the acceptance pane (accepted share per draft position, the draft's top-1 per regime)"),
    ("arrows, PgUp/PgDn, Home/End", "move the heatmap cursor (click a cell with the mouse, too)"),
    ("Tab / Shift+Tab", "move between findings, tensors and heatmap; Enter picks"),
    ("[  /  < >", "hide or show the findings and tensors / make them narrower or wider"),
    ("s", "save a screenshot (SVG) in the current directory (also from this help)"),
    ("?", "this help"),
    ("q", "quit (exit code: 1 divergence, 0 agree, 130 quit before the diff finished)"),
]


#: the keys in a few words, two to a line: the help of a small screen (80 x 24) fits without scrolling
HELP_SHORT = [
    ("n / p", "next / prev divergence"),
    ("f", "first divergence"),
    ("g", "go to #ROW, SEQ:POS, t=ID"),
    ("/", "filter columns"),
    ("m", "heatmap metric"),
    ("a", "acceptance pane"),
    ("arrows PgUp/Dn", "move the cursor"),
    ("Tab / Enter", "next pane / pick"),
    ("[ / < >", "hide / resize panes"),
    ("s", "screenshot (SVG)"),
    ("?", "this help"),
    ("q", "quit"),
]


class HelpScreen(ModalScreen[None]):
    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape,q,question_mark,enter", "dismiss", "close"),
                                Binding("s", "app.screenshot", "screenshot")]
    DEFAULT_CSS = """
    HelpScreen { align: center middle; }
    HelpScreen > VerticalScroll { width: 96; max-width: 100%; height: auto; max-height: 100%; border: round $accent;
                                  padding: 1 2; background: $panel; }
    """

    def compose(self) -> ComposeResult:
        from rich.console import Group
        from rich.table import Table

        small = self.app.size.height < 32 or self.app.size.width < 100
        table = Table(box=None, show_header=False, padding=(0, 1 if small else 2, 0, 0), expand=True)
        if small:   # two keys to a line, in a few words each
            for _ in range(2):
                table.add_column(style="bold cyan", no_wrap=True, justify="right")
                table.add_column(ratio=1)
            half = (len(HELP_SHORT) + 1) // 2
            for (k1, w1), right in zip(HELP_SHORT[:half], [*HELP_SHORT[half:], ("", "")]):
                table.add_row(k1, w1, *right)
            legend = Text("Esc closes. red ✗ divergence, yellow ! warning, green ✓ ok; bars grow with the "
                          "metric (log scale); !!! NaN/Inf; ░░░ not compared yet (docs/tui.md).", style="dim")
        else:
            table.add_column(style="bold cyan", no_wrap=True, justify="right")
            table.add_column(ratio=1)
            for k, what in HELP:
                table.add_row(k, what)
            legend = Text("Colours and glyphs are the aligner's: red / ✗ a divergence, yellow / ! a warning, "
                          "green / ✓ nothing found. Heatmap bars grow with the metric (log scale); in verdict "
                          "mode ··· is ok and ███ fails tolerance; !!! NaN/Inf; blank: no row for that token; "
                          "░░░ (while the diff runs) not compared yet. "
                          "Esc closes.", style="dim")
        with VerticalScroll():
            yield Static(Group(Text("tensordiff keys\n", style="bold"), table, Text(""), legend))

    def action_dismiss(self) -> None:  # type: ignore[override]
        self.dismiss(None)


class GotoScreen(ModalScreen[str | None]):
    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape", "cancel", "cancel")]
    DEFAULT_CSS = """
    GotoScreen { align: center middle; }
    GotoScreen > Vertical { width: 72; height: auto; border: round $accent; padding: 0 1; background: $panel; }
    """

    def __init__(self, seq: str | None = None) -> None:
        super().__init__()
        # the example names a sequence of the trace (``p0:12``), not one it does not have
        self.seq = sanitize_for_terminal(seq)[:24] if seq else "SEQ"

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Static(f"go to token: {GOTO_FORMS}")
            yield Input(placeholder=f"e.g. 12, {self.seq}:12, #50, t=42", id="goto-input")

    def on_mount(self) -> None:
        self.query_one(Input).focus()

    @on(Input.Submitted)
    def _submit(self, event: Input.Submitted) -> None:
        self.dismiss(event.value.strip() or None)

    def action_cancel(self) -> None:
        self.dismiss(None)


def run_names(cols: list[Column]) -> str:
    """The header line above a run of unpacked columns: each name that its three-character label
    abbreviates (``nrm`` for final_norm, ``fc`` for draft_fc_output) written from its column on,
    where it fits before the next such name; layers (``L3``) and ``emb`` need none."""
    width = len(cols) * CELL_W
    out = [" "] * width
    named = [(k, c.label) for k, c in enumerate(cols) if c.short not in (c.label, "emb") and not c.short.startswith("L")
             and not c.label.startswith("layer")]
    free = 0   # the first cell not yet written
    for n, (k, label) in enumerate(named):
        end = named[n + 1][0] * CELL_W - 1 if n + 1 < len(named) else width   # room to the right
        start = k * CELL_W
        if start + len(label) > end:   # too long for the room to its right: end it above its column
            start = max(free, min(start, k * CELL_W + CELL_W - 1 - len(label)))
        text = label[:max(0, end - start)]
        out[start:start + len(text)] = text
        free = start + len(text) + 1
    return "".join(out)
