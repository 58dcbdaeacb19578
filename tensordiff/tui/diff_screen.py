"""The diff's screen: the panes of one trace pair laid out, their keys, and what a choice in one
pane does to the others.

The screen is told how far the diff is and how it ended by the app
(:meth:`DiffScreen.show_progress`, :meth:`~DiffScreen.show_preview`,
:meth:`~DiffScreen.show_result`, :meth:`~DiffScreen.show_failure`); while the diff runs it polls
the diff's :class:`~tensordiff.tui.data.LiveSummary` and shows the rows compared so far. The
panes post what the user picked (:mod:`tensordiff.tui.messages`) and the screen moves the others:
a finding moves the heatmap's cursor, the cursor moves the detail pane. It tells the app, by
message, when it first drew real rows and when the preview is drawn.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import ClassVar

from rich.text import Text
from textual import events, on
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import Screen
from textual.widgets import Footer, Input, Static

from ..findings import DiffResult
from ..summary import Column, SummaryReader
from ..token_text import TokenText
from .data import METRICS, VectorSource
from .diff_thread import DiffThread
from .messages import CellSelected, ColumnPicked, FindingPicked, RowsChanged
from .panes import AcceptancePane, CellView, DetailPane, FindingsList, ProgressRow
from .widgets import WIDE, GotoScreen, Heatmap, TensorTree

#: the app's stylesheet (set on the app, so that it overrides the widgets' own defaults)
CSS = """
Screen { layout: vertical; }
#titlebar { height: 1; background: $primary-background; color: $text; padding: 0 1; }
#headline { height: auto; max-height: 2; padding: 0 1; }
/* narrow: two lines from the start, so a first-divergence sentence fits and the panes stay put when it comes */
Screen.-narrow #headline { height: 2; }
#progress-row { height: 1; padding: 0 1; }
#progress-row ProgressBar { width: 48; }
#progress-label { width: 1fr; padding: 0 1; }
#body { height: 1fr; }
#left { width: 44; }
Screen.-narrow #left { width: 28; }
#left.collapsed { display: none; }
#findings { height: 45%; border: round $primary; text-wrap: nowrap; text-overflow: ellipsis; }
Screen.-narrow #findings { text-wrap: wrap; }
#tree { height: 1fr; border: round $primary; overflow-x: hidden; }   /* a line for a node, not a scrollbar */
#right { width: 1fr; }
#filter { display: none; height: 3; }
#maprow { height: 1fr; }
#heatmap { height: 1fr; border: round $primary; }
#acceptance { width: 30; height: 1fr; border: round $primary; padding: 0 1; display: none;
              scrollbar-size-vertical: 1; }
#acceptance.shown { display: block; }
#accept-text { width: 1fr; }
#detail { height: 11; border: round $primary; padding: 0 1; scrollbar-size-vertical: 1; }
Screen.-short #detail { height: 12; }
#detail-text { width: 1fr; }
.done #progress-row { display: none; }
"""


class DiffScreen(Screen[None]):
    """Findings, tree, heatmap, acceptance and detail of one pair; keys for moving among them
    (the app's own, help, screenshot and quit, follow these in the footer)."""

    BINDINGS: ClassVar[list[BindingType]] = [
        # in the footer in this order, with the app's, short enough that all fit in 80 columns
        Binding("n", "next_finding", "next"),
        Binding("p", "prev_finding", "prev"),
        Binding("f", "first_divergence", "first"),
        Binding("g", "goto", "go to"),
        Binding("slash", "filter", "filter"),
        Binding("m", "toggle_metric", "metric"),
        Binding("left_square_bracket", "toggle_left", "panes"),
        Binding("a", "toggle_acceptance", "acceptance", show=False),   # in the help; the footer is full at 80 columns
        Binding("less_than_sign", "resize_left(-4)", "narrower", show=False),
        Binding("greater_than_sign", "resize_left(4)", "wider", show=False),
        Binding("escape", "close_filter", "close filter", show=False),
    ]

    def __init__(self, path_a: str, path_b: str, source: VectorSource, *, token_text: TokenText | None,
                 find_tokenizer: bool, block_rows: int, max_blocks: int) -> None:
        super().__init__()
        self._names = os.path.basename(path_a), os.path.basename(path_b)
        self._source, self._token_text, self._find_tokenizer = source, token_text, find_tokenizer
        self._block_rows, self._max_blocks = block_rows, max_blocks
        self.result: DiffResult | None = None
        self.summary: SummaryReader | None = None
        self.columns: list[Column] = []
        self.failed = False
        self.pending: list[tuple[str, Callable[[], object]]] = []   # keys pressed before the diff ended
        self._filter_text = ""
        self._left_hidden_for_acceptance = False

    # -- layout ----------------------------------------------------------------------------

    def compose(self) -> ComposeResult:
        yield Static(self._title_text(), id="titlebar")
        yield Static(Text("running the diff...", style="bold"), id="headline")
        yield ProgressRow(id="progress-row")
        with Horizontal(id="body"):
            with Vertical(id="left"):
                yield FindingsList(id="findings")
                yield TensorTree("tensors", id="tree")
            with Vertical(id="right"):
                yield Input(placeholder="filter tensors: substrings, comma-separated (empty: all)", id="filter")
                with Horizontal(id="maprow"):
                    yield Heatmap(id="heatmap", block_rows=self._block_rows, max_blocks=self._max_blocks)
                    yield AcceptancePane(id="acceptance")
                with VerticalScroll(id="detail"):
                    yield DetailPane(self._source, self._token_text, self._find_tokenizer, id="detail-text")
        yield Footer(compact=True)

    def on_mount(self) -> None:
        # the panes, kept so that a modal screen on top never hides them from a query
        q = self.query_one
        self.findings, self.tensors, self.heatmap = q(FindingsList), q(TensorTree), q(Heatmap)
        self.detail, self.acceptance, self.progress_row = q(DetailPane), q(AcceptancePane), q(ProgressRow)
        self._left, self._filter = q("#left", Vertical), q("#filter", Input)
        self.findings.border_title = "findings"
        self.tensors.border_title = "tensors"
        self.tensors.show_root = False
        self.heatmap.border_title = f"tokens x slots: {METRICS[0].title}"
        q("#detail", VerticalScroll).border_title = "detail"
        self.heatmap.focus()

    def _title_text(self) -> Text:
        a, b = self._names
        if self.result is not None:
            a += self.result.side_tags()[0]
            b += self.result.side_tags()[1]
        return Text.assemble(("tensordiff  ", "bold"), a, "  vs  ", b)

    @property
    def narrow(self) -> bool:
        return self.app.size.width < WIDE

    @property
    def ready(self) -> bool:
        return self.result is not None and self.summary is not None

    def on_resize(self, event: events.Resize) -> None:
        if self.ready and self.result is not None and self.findings.lay_out(self.narrow):
            self.tensors.show(self.result, self.columns, compact=self.narrow)

    # -- the diff, as the app reports it ---------------------------------------------------

    def follow(self, diff: DiffThread) -> None:
        """Show the rows the running diff compares (its LiveSummary sink says which)."""
        self.heatmap.follow(lambda: diff.live)

    def show_preview(self, path: str) -> None:
        self.heatmap.show_preview(path)

    def stop_live(self) -> None:
        """The diff has ended: no more preview or live rows (the app may end before it mounted us)."""
        for hm in self.query(Heatmap):
            hm.stop_feed(ended=True)

    @on(RowsChanged)
    def _rows_changed(self, _event: RowsChanged) -> None:
        if self.result is None and self.detail.cell is not None:
            self._show_running_cell()

    def show_progress(self, progress: tuple[str, int, int] | None = None) -> None:
        if self.result is None and not self.failed:
            self.progress_row.show(len(self.pending), progress)

    def show_failure(self, message: str) -> None:
        self.failed = True
        self.heatmap.stop_feed(ended=True)
        self.heatmap.summary, self.heatmap.blocks = None, None
        self.heatmap.show_message("the diff failed: no verdict")
        self.query_one("#headline", Static).update(Text(f"diff failed: {message}", style="bold red"))

    def show_result(self, res: DiffResult, summary: SummaryReader | None, columns: list[Column]) -> None:
        """The diff ended: its findings, tree and summary shown, the cursor on its first
        divergence, and the keys pressed meanwhile replayed."""
        self.result, self.summary, self.columns = res, summary, columns
        self.add_class("done")
        self.query_one("#titlebar", Static).update(self._title_text())
        first = res.first_divergence
        self.query_one("#headline", Static).update(
            Text(("first divergence: " if first else "") + res.headline(), style="bold red" if first else "bold green"))
        self.findings.show(res, self.narrow)
        self.tensors.show(res, columns, compact=self.narrow)
        hm = self.heatmap
        if summary is not None:
            hm.attach(summary, columns)
            if self._filter_text:
                hm.set_filter(self._filter_text)
        hm.update_title()
        self.acceptance.show(res, wide=not self.narrow)
        target = first or (res.findings[0] if res.findings else None)
        if target is not None:
            self.select_finding(target.index)
        else:
            hm.move_to(0, 0)
        queued, self.pending = self.pending, []
        for _what, fn in queued:
            fn()

    def _defer(self, what: str, fn: Callable[[], object]) -> None:
        """Run ``fn`` now when the diff is done; otherwise queue it (it runs when the diff ends)
        and say so."""
        if self.ready:
            fn()
            return
        if self.failed:
            self.notify(f"{what}: the diff failed", severity="error")
            return
        self.pending.append((what, fn))
        _, done, total = self.progress_row.progress
        pct = f" ({100 * done // total}% done)" if total > 1 else ""
        self.notify(f"{what}: queued until the diff finishes{pct}", timeout=3)
        self.show_progress()

    # -- what a pane's choice does to the others -------------------------------------------

    @on(ColumnPicked)
    def _column_picked(self, event: ColumnPicked) -> None:
        if not self.ready:
            return
        pos = self.heatmap.column_position(event.column)
        if pos is None:
            self.notify("that column is hidden by the filter (press / to change it)", severity="warning")
            return
        self.heatmap.move_to(col=pos)

    @on(FindingPicked)
    def _finding_picked(self, event: FindingPicked) -> None:
        if self.ready and event.index != self.findings.selected:
            self.select_finding(event.index)

    def select_finding(self, index: int) -> None:
        f = self.findings.select(index)
        hm = self.heatmap
        col_pos = None
        for c in self.columns:
            if c.matches(f.tensor, f.slot):
                col_pos = hm.column_position(c.index)
                if col_pos is None:
                    self.notify(f"{c.label} is hidden by the filter", severity="warning", timeout=3)
                break
        row = f.details.token_index if f.details else None
        if row is None or row < 0:
            row = None
        if row is not None or col_pos is not None:
            hm.move_to(row, col_pos, center=True)
        elif self.detail.cell is None:
            hm.move_to(0, 0)   # a finding about no tensor (acceptance, pairing): the detail pane still has a cell
        else:
            view = self._cell_view()
            if view is not None:
                self.detail.show(view)

    @on(CellSelected)
    def _cell_selected(self, event: CellSelected) -> None:
        self.detail.cell = (event.row, event.column)
        if self.result is None and (self.heatmap.running is not None or self.heatmap.preview is not None):
            self._show_running_cell()
            return
        view = self._cell_view()
        if view is not None:
            self.detail.show(view)
            self.detail.fetch_vectors(view)

    def _cell_view(self) -> CellView | None:
        cell = self.detail.cell
        if self.result is None or cell is None or self.summary is None:
            return None
        row, ci = cell
        col = next(c for c in self.columns if c.index == ci)
        blocks = self.heatmap.blocks
        tok = blocks.token(row) if blocks is not None else self.summary.tokens(row, row + 1)[0]
        return CellView(self.result, self.summary, col, row, tok, self.findings.finding)

    def _show_running_cell(self) -> None:
        """The cell under the cursor while the diff runs: its streamed metrics, or pending; in the
        preview its metrics without a verdict."""
        cell, live = self.detail.cell, self.heatmap.running
        preview = self.heatmap.preview if live is None else None
        shown = preview if preview is not None else live
        place = self.heatmap.place(*cell, shown.n) if cell is not None and shown is not None else None
        if cell is None or place is None:
            return
        if preview is not None:
            self.detail.show_preview(preview, place[0], cell[0], place[1])
        elif live is not None:
            self.detail.show_live(live, place[0], cell[0], place[1])

    # -- keys ------------------------------------------------------------------------------

    def _step(self, step: int) -> None:
        index = self.findings.step(step)
        if index is not None:
            self.select_finding(index)

    def action_next_finding(self) -> None:
        self._defer("next finding", lambda: self._step(1))

    def action_prev_finding(self) -> None:
        self._defer("previous finding", lambda: self._step(-1))

    def _first(self) -> None:
        assert self.result is not None
        f = self.result.first_divergence
        if f is None:
            self.notify("no divergence: the traces agree within tolerance")
            return
        self.select_finding(f.index)

    def action_first_divergence(self) -> None:
        self._defer("first divergence", self._first)

    def action_goto(self) -> None:
        def done(value: str | None) -> None:
            if value:
                self._defer(f"go to {value}", lambda: self.goto(value))

        seqs = self.summary.seq_a if self.summary is not None else []
        self.app.push_screen(GotoScreen(seqs[0] if seqs else None), done)

    def goto(self, spec: str) -> bool:
        """Move the cursor to a token (:meth:`Heatmap.goto`). Returns whether it moved."""
        return self.heatmap.goto(spec, self.result.side_a if self.result else "A")

    def action_filter(self) -> None:
        self._filter.display = True
        self._filter.focus()

    @on(Input.Changed, "#filter")
    def _filter_changed(self, event: Input.Changed) -> None:
        self._filter_text = event.value
        if self.ready:
            shown = self.heatmap.set_filter(event.value)
            self.heatmap.update_title()
            if shown == 0:
                self.detail.say(Text("no column matches the filter", style="dim"))

    @on(Input.Submitted, "#filter")
    def _filter_submitted(self, event: Input.Submitted) -> None:
        self.action_close_filter()

    def action_close_filter(self) -> None:
        if self._filter.display:
            self._filter.display = False
            self.heatmap.focus()

    def _toggle_metric(self) -> None:
        self.heatmap.next_metric()
        self.heatmap.update_title()

    def action_toggle_metric(self) -> None:
        self._defer("toggle metric", self._toggle_metric)

    def _toggle_acceptance(self) -> None:
        if not self.acceptance.lines:
            self.notify("no acceptance recorded: neither trace holds draft predictions or verify steps", timeout=3)
            return
        pane, left = self.acceptance, self._left
        pane.toggle_class("shown")
        if pane.has_class("shown"):
            # on a narrow screen the pane takes the left pane's room (the heatmap keeps its cells)
            if self.narrow and not left.has_class("collapsed"):
                left.add_class("collapsed")
                self._left_hidden_for_acceptance = True
                if self.focused is not None and left in self.focused.ancestors:
                    self.heatmap.focus()
            return
        if self._left_hidden_for_acceptance:
            self._left_hidden_for_acceptance = False
            left.remove_class("collapsed")
        if self.focused is not None and pane in self.focused.ancestors_with_self:
            self.heatmap.focus()

    def action_toggle_acceptance(self) -> None:
        """Show or hide the acceptance pane beside the heatmap (per draft position and regime)."""
        self._defer("acceptance", self._toggle_acceptance)

    def action_toggle_left(self) -> None:
        """Hide or show the findings and tensors (more room for the heatmap on a small terminal)."""
        left = self._left
        left.toggle_class("collapsed")
        self._left_hidden_for_acceptance = False
        if left.has_class("collapsed") and self.focused is not None and left in self.focused.ancestors:
            self.heatmap.focus()

    def action_resize_left(self, step: int) -> None:
        """Make the left pane narrower or wider (it keeps at least 16 columns, the right pane 30)."""
        left = self._left
        if left.has_class("collapsed"):
            left.remove_class("collapsed")
        width = left.outer_size.width or 44
        left.styles.width = max(16, min(width + step, self.app.size.width - 30))
