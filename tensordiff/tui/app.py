"""The interactive TUI: ``tensordiff tui A B`` (or ``tensordiff diff A B --tui``).

It opens at once, runs the diff in a background worker thread (a progress bar shows how far it
is; keys pressed meanwhile are queued and replayed when it ends, never lost), shows in the heatmap
the rows the diff has compared so far (the rest drawn as pending, never as agreeing), then lands on
the first divergence. On a large pair, before the diff has aligned every token, it shows a
preview: the real metrics of the first tokens in one neutral colour, with no verdict (a verdict
needs the noise measured over the whole pair). Panes: the findings (the diff's, in forward order), a tree of tensors and
slots coloured by the findings on them, a token x slot heatmap of a per-token metric, and a
detail pane for the selected cell with the diff's sentence, identity candidates, the cell's
metrics, both token keys and small text plots of the two vectors.

The TUI never judges a tensor itself: every verdict it shows comes from
:func:`tensordiff.diff.diff_traces`. The heatmap reads the diff's per-token summary, written to a
temporary file that the app deletes on exit, in blocks; while the diff runs, the same file through
a :class:`tensordiff.tui.data.LiveSummary`, polled every 50 ms.

Where things live: this module is the app (layout, keys and actions, what the diff's messages
do, quit) and its entry points (:func:`run_tui`, :func:`save_screenshot`);
:mod:`tensordiff.tui.diff_thread` runs the diff in a thread that reports as :class:`DiffProgress` /
:class:`DiffEnded` messages; :mod:`tensordiff.tui.widgets` the widgets and screens;
:mod:`tensordiff.tui.data` the data layer (block cache, lookups, go-to, the cell reader) and
:mod:`tensordiff.tui.text` the text of the panes, neither of which imports textual. This module
is over 500 lines because it is one ``App`` class and the two functions that run it: Textual binds
keys, actions and message handlers to the app, and cutting the class into mixins would scatter
one state machine over several files.

Keys: see :data:`tensordiff.tui.widgets.HELP` (``?`` in the app) and docs/tui.md.

Why one module of this size: the app's layout, keys and actions (Textual's App is one class);
its widgets, panes' text and data layer are the sibling modules.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from typing import ClassVar

from rich.text import Text
from textual import events, on
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.widgets import Footer, Input, OptionList, ProgressBar, Static, Tree
from textual.widgets.option_list import Option
from textual.worker import Worker, WorkerState

from ..diff import DiffOptions, diff_traces
from ..errors import TensordiffError, UsageError
from ..findings import DiffResult
from ..fmt import progress_unit
from ..summary import SummaryReader, read_columns
from ..token_text import TokenText
from .diff_thread import PREVIEW_FROM, Cancelled, DiffEnded, DiffFn, DiffPreview, DiffProgress, DiffThread
from .preview_process import PreviewProcess
from .data import (
    GOTO_FORMS,
    METRICS,
    Column,
    LiveSummary,
    PreviewSummary,
    VectorSource,
    resolve_goto,
)
from .text import acceptance_lines, detail_lines, finding_prompt
from .widgets import DetailPane, GotoScreen, Heatmap, HelpScreen, TensorTree

EXIT_INTERRUPTED = 130   # quit before the diff finished: no verdict
WIDE = 110               # from this many columns the acceptance pane opens by itself (the -wide breakpoint)
ACCEPT_TEXT_W = 26       # the acceptance pane's text width (30 columns less border and padding)
LIVE_POLL_S = 0.05       # how often the heatmap looks for the first rows the running diff has compared
LIVE_REDRAW_S = 0.5      # ... and for more, once it shows some (each redraw takes the GIL from the diff)


# ----------------------------------------------------------------------------------------------
# The app
# ----------------------------------------------------------------------------------------------


class TensordiffApp(App[int]):
    """The tensordiff TUI. ``diff_fn`` (tests, benchmarks) replaces the diff that runs in the worker."""

    TITLE = "tensordiff"
    ENABLE_COMMAND_PALETTE = False   # not a tensordiff key; its footer entry would hide ours at 80 columns
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

    HORIZONTAL_BREAKPOINTS: ClassVar[list[tuple[int, str]]] = [(0, "-narrow"), (WIDE, "-wide")]
    VERTICAL_BREAKPOINTS: ClassVar[list[tuple[int, str]]] = [(0, "-short"), (32, "-tall")]

    BINDINGS: ClassVar[list] = [
        # in the footer in this order, short enough that all fit in 80 columns
        Binding("n", "next_finding", "next"),
        Binding("p", "prev_finding", "prev"),
        Binding("f", "first_divergence", "first"),
        Binding("g", "goto", "go to"),
        Binding("slash", "filter", "filter"),
        Binding("m", "toggle_metric", "metric"),
        Binding("left_square_bracket", "toggle_left", "panes"),
        Binding("question_mark", "help", "help"),
        Binding("s", "screenshot", "shot"),
        Binding("q", "quit", "quit"),
        Binding("a", "toggle_acceptance", "acceptance", show=False),   # in the help; the footer is full at 80 columns
        Binding("less_than_sign", "resize_left(-4)", "narrower", show=False),
        Binding("greater_than_sign", "resize_left(4)", "wider", show=False),
        Binding("escape", "close_filter", "close filter", show=False),
    ]

    def __init__(self, path_a: str, path_b: str, options: DiffOptions | None = None, *,
                 diff_fn: DiffFn | None = None, screenshot_dir: str | None = None,
                 block_rows: int = 256, max_blocks: int = 24, token_text: TokenText | None = None,
                 find_tokenizer: bool = True, preview_from: int | None = PREVIEW_FROM):
        # forked first, before Textual starts any thread: the preview is read on the other core
        # while the app starts up and draws its first frame
        self._preview_process = (PreviewProcess.start(os.fspath(path_a), os.fspath(path_b), preview_from)
                                 if preview_from is not None else None)
        super().__init__()
        self.path_a, self.path_b = os.fspath(path_a), os.fspath(path_b)
        self.options = options or DiffOptions()
        self.diff_fn = diff_fn or diff_traces
        self._diff: DiffThread | None = None
        self.screenshot_dir = screenshot_dir or os.getcwd()
        self.summary_path: str | None = self.options.summary_path
        self.summary: SummaryReader | None = None
        self.columns: list[Column] = []
        self.result: DiffResult | None = None
        self.diff_error: BaseException | None = None
        self.selected_finding: int | None = None
        self.pending: list[tuple[str, Callable[[], None]]] = []
        self.metric_index = 0
        self.first_paint_at: float | None = None
        self.first_rows_at: float | None = None          # the heatmap first showed real rows (preview or diff)
        self.first_live_rows_at: float | None = None     # ... rows the diff itself compared
        self.live: LiveSummary | None = None             # the summary while the diff writes it
        self.preview: PreviewSummary | None = None       # the preview's, until the diff streams rows
        self.preview_tokens = 0
        self._preview_from = preview_from
        self._live_timer = None
        self._live_drawn_at = 0.0
        self.mounted_at: float | None = None
        self.diff_seconds: float | None = None
        self.cell: tuple[int, int] | None = None        # (row, summary column) in the detail pane
        self.vectors_for: tuple[int, int] | None = None  # the cell whose vectors are shown
        self.vectors: tuple = (None, None, "")
        self.progress: tuple[str, int, int] = ("starting", 0, 1)   # the last DiffProgress shown
        self._filter_text = ""
        self._source = VectorSource(self.path_a, self.path_b)
        self._block_rows, self._max_blocks = block_rows, max_blocks
        self.detail_text = Text("")
        self.last_screenshot: str | None = None
        self.acceptance_lines: list[Text] = []
        self._left_hidden_for_acceptance = False
        self._findings_compact: bool | None = None   # the findings list's and tree's form (narrow screen)
        # token text: the tokenizer given (--tokenizer), else the model directory a trace records
        # (looked for once, in the detail worker: loading a tokenizer may take seconds)
        self.token_text = token_text
        self._find_tokenizer = find_tokenizer and token_text is None

    # -- layout ----------------------------------------------------------------------------

    def compose(self) -> ComposeResult:
        yield Static(self._title_text(), id="titlebar")
        yield Static(Text("running the diff...", style="bold"), id="headline")
        with Horizontal(id="progress-row"):
            yield ProgressBar(total=None, show_eta=False, id="progress")
            yield Static("starting", id="progress-label")
        with Horizontal(id="body"):
            with Vertical(id="left"):
                yield OptionList(id="findings")
                yield TensorTree("tensors", id="tree")
            with Vertical(id="right"):
                yield Input(placeholder="filter tensors: substrings, comma-separated (empty: all)", id="filter")
                with Horizontal(id="maprow"):
                    yield Heatmap(id="heatmap", block_rows=self._block_rows, max_blocks=self._max_blocks)
                    with VerticalScroll(id="acceptance"):
                        yield Static("", id="accept-text")
                with VerticalScroll(id="detail"):
                    yield DetailPane("", id="detail-text")
        yield Footer(compact=True)

    def _title_text(self) -> Text:
        a, b = os.path.basename(self.path_a), os.path.basename(self.path_b)
        if self.result is not None:
            a += self.result.side_tags()[0]
            b += self.result.side_tags()[1]
        return Text.assemble(("tensordiff  ", "bold"), a, "  vs  ", b)

    @property
    def heatmap(self) -> Heatmap:
        return self._w_heatmap

    @property
    def ready(self) -> bool:
        return self.result is not None and self.summary is not None

    def on_mount(self) -> None:
        self.mounted_at = time.perf_counter()
        # widgets of the main screen, kept so that a modal screen on top never hides them
        q = self.query_one
        self._w_findings, self._w_tree = q("#findings", OptionList), q("#tree", TensorTree)
        self._w_detail, self._w_headline = q("#detail-text", DetailPane), q("#headline", Static)
        self._w_left, self._w_detail_box = q("#left", Vertical), q("#detail", VerticalScroll)
        self._w_progress, self._w_progress_label = q("#progress", ProgressBar), q("#progress-label", Static)
        self._w_filter, self._w_titlebar, self._w_heatmap = q("#filter", Input), q("#titlebar", Static), q(Heatmap)
        self._w_accept, self._w_accept_text = q("#acceptance", VerticalScroll), q("#accept-text", Static)
        self._w_accept.border_title = "acceptance (a hides)"
        fl = self._w_findings
        fl.border_title = "findings"
        tree = self._w_tree
        tree.border_title = "tensors"
        tree.show_root = False
        self.heatmap.border_title = f"tokens x slots: {METRICS[0].title}"
        self._w_detail_box.border_title = "detail"
        self.heatmap.focus()
        self.call_after_refresh(self._after_first_paint)

    def _after_first_paint(self) -> None:
        self.first_paint_at = time.perf_counter()
        self._start_diff()

    # -- the diff worker -------------------------------------------------------------------

    def _start_diff(self) -> None:
        self._diff = DiffThread(self.path_a, self.path_b, self.options, self.diff_fn, self.post_message,
                                preview_from=self._preview_from, preview_process=self._preview_process)
        self._diff.start()
        self.summary_path = self._diff.summary_path
        self._live_timer = self.set_interval(LIVE_POLL_S, self._poll_live)

    def _poll_live(self) -> None:
        """Show the rows the running diff has compared (its LiveSummary sink says which)."""
        try:
            self._poll_live_once()
        except (OSError, KeyError, ValueError, TypeError) as e:
            # the file being written cannot be read here: no live rows, the diff goes on
            self._stop_live()
            hm = self.heatmap
            hm.summary, hm.blocks, hm.live = None, None, False
            hm.show_message("diff running... (the heatmap fills when it ends: "
                            f"cannot read the summary being written: {' '.join(str(e).split())[:120]})")

    def _poll_live_once(self) -> None:
        d = self._diff
        live = d.live if d is not None else None
        if live is None or not live.started or self.result is not None or self.diff_error is not None:
            return
        hm = self.heatmap
        if self.live is None:
            self.live = live
            self._close_preview()
            hm.attach(live, sorted(live.columns, key=lambda c: (c.order, c.tensor_a, c.slot)), live=True)
        now = time.perf_counter()
        if self.first_rows_at is not None and now - self._live_drawn_at < LIVE_REDRAW_S:
            return
        changed = live.changes()
        if changed is not None:
            self._live_drawn_at = now
            hm.rows_changed(*changed)
            if self.first_live_rows_at is None and live.has_rows:
                self.call_after_refresh(self._first_live_rows_painted)
            if self.cell is not None:
                self._render_live_detail()
        title = self._heatmap_title()
        if hm.border_title != title:     # setting it redraws the whole heatmap, even when unchanged
            hm.border_title = title

    @on(DiffPreview)
    def _diff_preview(self, event: DiffPreview) -> None:
        """Show the preview until the diff streams its own rows (or ends)."""
        if self.result is not None or self.diff_error is not None or self.live is not None:
            self._preview_shown()
            return
        try:
            pv = PreviewSummary(event.path)
        except TensordiffError:
            self._preview_shown()
            return
        self.preview, self.preview_tokens = pv, event.tokens
        hm = self.heatmap
        hm.attach(pv, read_columns(pv))
        hm.border_title = self._heatmap_title()
        self.call_after_refresh(self._preview_painted)
        if self.cell is not None:
            self._render_live_detail()

    def _preview_painted(self) -> None:
        self._first_rows_painted()
        self._preview_shown()

    def _preview_shown(self) -> None:
        """The diff thread may go on (it waits for the preview to be drawn)."""
        if self._diff is not None:
            self._diff.preview_shown.set()

    def _close_preview(self) -> None:
        if self.preview is not None:
            self.preview.close()
            self.preview = None

    def _first_rows_painted(self) -> None:
        if self.first_rows_at is None:
            self.first_rows_at = time.perf_counter()

    def _first_live_rows_painted(self) -> None:
        if self.first_live_rows_at is None:
            self.first_live_rows_at = time.perf_counter()
        self._first_rows_painted()

    def _stop_live(self) -> None:
        self._close_preview()
        if self._live_timer is not None:
            self._live_timer.stop()
            self._live_timer = None
        if self.live is not None:
            self.live.close_reader()   # before the finished file is opened (HDF5 shares open files)
            self.live = None

    @on(DiffEnded)
    def _diff_ended(self, event: DiffEnded) -> None:
        if event.error is not None:
            self._on_diff_error(event.error)
        else:
            self._on_diff_done(event.result)

    @on(DiffProgress)
    def _diff_progress(self, event: DiffProgress) -> None:
        self.progress = (event.stage, event.done, event.total)
        self._show_progress()

    def _show_progress(self) -> None:
        if self.result is not None or self.diff_error is not None:
            return
        stage, done, total = self.progress
        bar = self._w_progress
        if total > 1:
            bar.update(total=total, progress=done)
        label = f"{stage}: {done}/{total} {progress_unit(stage)}" if total > 1 else stage
        if self.pending:
            label += f"  ({len(self.pending)} key{'s' if len(self.pending) > 1 else ''} queued)"
        self._w_progress_label.update(label, layout=False)

    def on_worker_state_changed(self, event: Worker.StateChanged) -> None:
        w = event.worker
        if w.group == "detail" and event.state == WorkerState.SUCCESS and w.result is not None:
            key, va, vb, note = w.result
            if key == self.cell:
                self.vectors_for = key
                self.vectors = (va, vb, note)
                self._render_detail()

    def _on_diff_error(self, err: BaseException | None) -> None:
        if isinstance(err, Cancelled):
            return
        self.diff_error = err
        self._stop_live()
        self.heatmap.summary, self.heatmap.blocks = None, None
        self.heatmap.show_message("the diff failed: no verdict")
        msg = str(err) if isinstance(err, TensordiffError) else f"{type(err).__name__}: {err}"
        self._w_headline.update(Text(f"diff failed: {msg}", style="bold red"))
        self.exit(2)

    def _on_diff_done(self, res: DiffResult) -> None:
        self.diff_seconds = time.perf_counter() - self._diff.t0 if self._diff is not None else None
        self.result = res
        self._stop_live()
        try:
            self.summary = SummaryReader(self.summary_path) if self.summary_path else None
        except TensordiffError as e:
            self._on_diff_error(e)
            return
        self.columns = read_columns(self.summary) if self.summary else []
        self.add_class("done")
        self._w_titlebar.update(self._title_text())
        first = res.first_divergence
        self._w_headline.update(
            Text(("first divergence: " if first else "") + res.headline(), style="bold red" if first else "bold green"))
        fl = self._w_findings
        self._fill_findings()
        nd = len(res.divergences)
        fl.border_title = (f"findings: {nd} ✗, {len(res.findings) - nd} other" if self.size.width < WIDE   # whole
                           else f"findings: {nd} divergence{'s' if nd != 1 else ''}, {len(res.findings) - nd} other")
        self._w_tree.show(res, self.columns, compact=self.size.width < WIDE)
        if self.summary is not None:
            self.heatmap.attach(self.summary, self.columns)
            if self._filter_text:
                self.heatmap.set_filter(self._filter_text)
        self.heatmap.border_title = self._heatmap_title()
        self._show_acceptance(res)
        target = first or (res.findings[0] if res.findings else None)
        if target is not None:
            self._select_finding(target.index)
        else:
            self.heatmap.move_to(0, 0)
        queued, self.pending = self.pending, []
        for _what, fn in queued:
            fn()

    def _fill_findings(self) -> None:
        """The findings list: one line each on a wide screen; on a narrow one (80 columns) each
        wrapped, ``slot K of T`` as ``T[K]``, so that findings on different slots read apart."""
        if self.result is None:
            return
        compact = self.size.width < WIDE
        if compact == self._findings_compact:
            return
        self._findings_compact = compact
        fl = self._w_findings
        keep = fl.highlighted
        fl.set_options([Option(finding_prompt(f, compact)) for f in self.result.findings])
        if keep is not None and keep < fl.option_count:
            fl.highlighted = keep

    def on_resize(self, event: events.Resize) -> None:
        if self.ready and self.result is not None and (self.size.width < WIDE) != self._findings_compact:
            self._fill_findings()
            self._w_tree.show(self.result, self.columns, compact=self.size.width < WIDE)

    def _show_acceptance(self, res: DiffResult) -> None:
        """Fill the acceptance pane from the acceptance finding; shown at once on a wide screen,
        a key away (a) on a narrow one, absent when nothing about acceptance was recorded."""
        self.acceptance_lines = acceptance_lines(res, ACCEPT_TEXT_W)
        if not self.acceptance_lines:
            return
        self._w_accept_text.update(Text("\n").join(self.acceptance_lines))
        if self.size.width >= WIDE:
            self._w_accept.add_class("shown")
        else:
            self.notify("acceptance recorded: press a to show it beside the heatmap", timeout=4)

    def _heatmap_title(self) -> str:
        m = METRICS[self.metric_index]
        if self.preview is not None and self.live is None and self.result is None:
            return (f"tokens x slots: {m.title}  (preview: the first {self.preview.n} tokens' values, "
                    "no verdict yet; the diff is aligning every token)")
        if self.live is not None and self.result is None:
            done, ncols = self.live.columns_done(), len(self.live.columns)
            return (f"tokens x slots: {m.title}  (diff running: {done} of {ncols} columns compared, "
                    f"░░░ not yet; {self.live.n} tokens)")
        n = self.summary.n if self.summary is not None else 0
        shown = len(self.heatmap.shown)
        cols = f"{shown} of {len(self.columns)} columns" if shown != len(self.columns) else f"{len(self.columns)} columns"
        if self.size.width < WIDE:   # a title the narrow pane shows whole
            return f"{m.title}: {n} tokens, {cols}"
        return f"tokens x slots: {m.title}  ({n} tokens, {cols})"

    def _defer(self, what: str, fn: Callable[[], None]) -> bool:
        """Run ``fn`` now when the diff is done; otherwise queue it (it runs when the diff ends)
        and say so. Returns True when it ran."""
        if self.ready:
            fn()
            return True
        if self.diff_error is not None:
            self.notify(f"{what}: the diff failed", severity="error")
            return False
        self.pending.append((what, fn))
        _, done, total = self.progress
        pct = f" ({100 * done // total}% done)" if total > 1 else ""
        self.notify(f"{what}: queued until the diff finishes{pct}", timeout=3)
        self._show_progress()
        return False

    # -- findings and tree -----------------------------------------------------------------

    @on(Tree.NodeSelected, "#tree")
    def _tree_selected(self, event: Tree.NodeSelected) -> None:
        if event.node.data is None or not self.ready:
            return
        pos = self.heatmap.column_position(int(event.node.data))
        if pos is None:
            self.notify("that column is hidden by the filter (press / to change it)", severity="warning")
            return
        self.heatmap.move_to(col=pos)

    @on(OptionList.OptionHighlighted, "#findings")
    def _finding_highlighted(self, event: OptionList.OptionHighlighted) -> None:
        # a stale message (the list was moved again since) is ignored
        if (self.ready and event.option_index == self._w_findings.highlighted
                and event.option_index != self.selected_finding):
            self._select_finding(event.option_index)

    def _select_finding(self, index: int) -> None:
        assert self.result is not None
        f = self.result.findings[index]
        self.selected_finding = index
        fl = self._w_findings
        if fl.highlighted != index:
            fl.highlighted = index
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
        elif self.cell is None:
            hm.move_to(0, 0)   # a finding about no tensor (acceptance, pairing): the detail pane still has a cell
        else:
            self._render_detail()

    # -- cell detail -----------------------------------------------------------------------

    @on(Heatmap.CellSelected)
    def _cell_selected(self, event: Heatmap.CellSelected) -> None:
        self.cell = (event.row, event.column)
        if self.result is None and (self.live is not None or self.preview is not None):
            self._render_live_detail()
            return
        self._render_detail()
        self._request_vectors()

    def _render_live_detail(self) -> None:
        """The cell under the cursor while the diff runs: its streamed metrics, or pending; in the
        preview its metrics without a verdict."""
        live = self.live
        preview = self.preview if live is None else None
        if preview is not None:
            self._render_preview_detail(preview)
            return
        place = self._cursor_place(live.n) if live is not None else None
        if live is None or place is None:
            return
        row, col, where = place
        ci = col.index
        if live.pending(row, row + 1)[0, ci]:
            what = Text("not compared yet", style="bold")
        else:
            cos, rel, mx, fl = (float(live.block(row, row + 1, f)[0, ci]) for f in range(4))
            if fl != fl:   # NaN: the tensor has no row for that token
                what = Text("no row for this token in this tensor", style="dim")
            else:
                flags = int(fl)
                verdict = "NaN/Inf" if flags & 2 else ("fails tolerance" if flags & 1 else "within tolerance")
                what = Text(f"1 - cos {1.0 - cos:.3g}  rel {rel:.3g}  max abs {mx:.3g}  ({verdict})",
                            style="bold red" if flags else "")
        self.detail_text = Text("\n").join([
            Text.assemble((col.label, "bold"), "  ", where), what,
            Text("the diff is running: findings, the cell's sentence and its vectors come when it ends", style="dim")])
        self._w_detail.update(self.detail_text)

    def _cursor_place(self, n: int) -> tuple[int, Column, str] | None:
        """(row, column, "seq:pos token t (#row)") of the cell under the cursor while the heatmap
        shows streamed or preview rows (``n`` of them); None when there is no such cell."""
        hm = self.heatmap
        if self.cell is None or hm.blocks is None:
            return None
        row, ci = self.cell
        col = next((c for c in hm.columns if c.index == ci), None)
        if col is None or not 0 <= row < n:
            return None
        tok = hm.blocks.token(row)
        seqs = hm._seq_names
        seq = int(tok["seq_a"])
        return row, col, f"{seqs[seq] if 0 <= seq < len(seqs) else seq}:{int(tok['pos_a'])} token {int(tok['token'])} (#{row})"

    def _render_preview_detail(self, pv: PreviewSummary) -> None:
        place = self._cursor_place(pv.n)
        if place is None:
            return
        row, col, where = place
        cos, rel, mx, fl = (float(v) for v in pv.cell(row, col.index))
        if fl != fl:
            what = Text("no row for this token in this tensor", style="dim")
        elif int(fl) & 2:
            what = Text(f"1 - cos {1.0 - cos:.3g}  rel {rel:.3g}  max abs {mx:.3g}  (NaN/Inf)", style="bold red")
        else:
            what = Text(f"1 - cos {1.0 - cos:.3g}  rel {rel:.3g}  max abs {mx:.3g}  (no verdict yet)")
        self.detail_text = Text("\n").join([
            Text.assemble((col.label, "bold"), "  ", where), what,
            Text("preview of the first tokens, aligned among themselves: the tolerances, the verdict and the "
                 "rest of the tokens come as the diff goes on", style="dim")])
        self._w_detail.update(self.detail_text)

    def _request_vectors(self) -> None:
        if self.cell is None or self.summary is None:
            return
        row, ci = self.cell
        col = next(c for c in self.columns if c.index == ci)
        tok = self.heatmap.blocks.token(row) if self.heatmap.blocks is not None else self.summary.tokens(row, row + 1)[0]
        key = (row, ci)
        keys = (int(tok["seq_a"]), int(tok["pos_a"]), int(tok["seq_b"]), int(tok["pos_b"]), int(tok["token"]))

        def load():   # in a thread: opening the traces (and a tokenizer) may take a while
            if self._find_tokenizer:
                self._find_tokenizer = False
                self.token_text = self._source.recorded_token_text()
            return (key, *self._source.cell_vectors(col, *keys))

        self.run_worker(load, thread=True, group="detail", exclusive=True, exit_on_error=False)

    def _render_detail(self) -> None:
        if self.result is None or self.cell is None or self.summary is None:
            return
        row, ci = self.cell
        col = next(c for c in self.columns if c.index == ci)
        tok = self.heatmap.blocks.token(row) if self.heatmap.blocks is not None else self.summary.tokens(row, row + 1)[0]
        sel = self.result.findings[self.selected_finding] if self.selected_finding is not None else None
        vectors = self.vectors if self.vectors_for == self.cell else None
        pane = self._w_detail
        tstr = self.token_text(int(tok["token"])) if self.token_text is not None else ""
        pane.laid_width = pane.size.width
        lines = detail_lines(self.result, self.summary, col, row, tok, sel, vectors, max(40, pane.size.width), tstr)
        self.detail_text = Text("\n").join(lines)
        pane.update(self.detail_text)

    def on_detail_pane_resized(self, _event: DetailPane.Resized) -> None:
        """The detail pane's width changed: its lines (the value histograms) laid out again for it."""
        self._render_detail()

    # -- actions ---------------------------------------------------------------------------

    def _step_finding(self, step: int) -> None:
        """``n`` / ``p``: the next or previous divergence (every finding when there is none: the
        notes are a click or an arrow key away in the list)."""
        assert self.result is not None
        fs = self.result.findings
        if not fs:
            self.notify("no findings: the traces agree")
            return
        stops = [f.index for f in fs if f.severity == "divergence"] or [f.index for f in fs]
        what = "divergence" if self.result.divergences else "finding"
        cur = self.selected_finding if self.selected_finding is not None else -1
        ahead = [i for i in stops if i > cur] if step > 0 else [i for i in stops if i < cur]
        if not ahead:
            self.notify(f"last {what}" if step > 0 else f"first {what}", timeout=2)
            return
        self._select_finding(ahead[0] if step > 0 else ahead[-1])

    def action_next_finding(self) -> None:
        self._defer("next finding", lambda: self._step_finding(1))

    def action_prev_finding(self) -> None:
        self._defer("previous finding", lambda: self._step_finding(-1))

    def _first(self) -> None:
        assert self.result is not None
        f = self.result.first_divergence
        if f is None:
            self.notify("no divergence: the traces agree within tolerance")
            return
        self._select_finding(f.index)

    def action_first_divergence(self) -> None:
        self._defer("first divergence", self._first)

    def action_goto(self) -> None:
        def done(value: str | None) -> None:
            if value:
                self._defer(f"go to {value}", lambda: self.goto(value))

        seqs = self.summary.seq_a if self.summary is not None else []
        self.push_screen(GotoScreen(seqs[0] if seqs else None), done)

    def goto(self, spec: str) -> bool:
        """Move the cursor to a token: ``#INDEX``, ``SEQ:POS``, ``POS`` (current sequence) or
        ``t=TOKEN_ID`` (next row with that token id). Returns whether it moved."""
        assert self.summary is not None
        hm = self.heatmap
        seq = int(hm.blocks.token(hm.cursor_row)["seq_a"]) if hm.blocks is not None else 0
        row, note = resolve_goto(self.summary, spec, hm.cursor_row, seq, self.result.side_a if self.result else "A")
        if row is None:
            self.notify(note or f"cannot read {spec!r}: use {GOTO_FORMS}", severity="warning")
            return False
        if note:
            self.notify(note, timeout=3)
        hm.move_to(row, center=True)
        return True

    def action_filter(self) -> None:
        inp = self._w_filter
        inp.display = True
        inp.focus()

    @on(Input.Changed, "#filter")
    def _filter_changed(self, event: Input.Changed) -> None:
        self._filter_text = event.value
        if self.ready:
            shown = self.heatmap.set_filter(event.value)
            self.heatmap.border_title = self._heatmap_title()
            if shown == 0:
                self._w_detail.update(Text("no column matches the filter", style="dim"))

    @on(Input.Submitted, "#filter")
    def _filter_submitted(self, event: Input.Submitted) -> None:
        self.action_close_filter()

    def action_close_filter(self) -> None:
        inp = self._w_filter
        if inp.display:
            inp.display = False
            self.heatmap.focus()

    def _toggle_metric(self) -> None:
        self.metric_index = (self.metric_index + 1) % len(METRICS)
        self.heatmap.set_metric(METRICS[self.metric_index])
        self.heatmap.border_title = self._heatmap_title()

    def action_toggle_metric(self) -> None:
        self._defer("toggle metric", self._toggle_metric)

    def _toggle_acceptance(self) -> None:
        if not self.acceptance_lines:
            self.notify("no acceptance recorded: neither trace holds draft predictions or verify steps", timeout=3)
            return
        pane, left = self._w_accept, self._w_left
        pane.toggle_class("shown")
        if pane.has_class("shown"):
            # on a narrow screen the pane takes the left pane's room (the heatmap keeps its cells)
            if self.size.width < WIDE and not left.has_class("collapsed"):
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
        left = self._w_left
        left.toggle_class("collapsed")
        self._left_hidden_for_acceptance = False
        if left.has_class("collapsed") and self.focused is not None and left in self.focused.ancestors:
            self.heatmap.focus()

    def action_resize_left(self, step: int) -> None:
        """Make the left pane narrower or wider (it keeps at least 16 columns, the right pane 30)."""
        left = self._w_left
        if left.has_class("collapsed"):
            left.remove_class("collapsed")
        width = left.outer_size.width or 44
        left.styles.width = max(16, min(width + step, self.size.width - 30))

    def action_help(self) -> None:
        self.push_screen(HelpScreen())

    def action_screenshot(self) -> None:
        path = self.save_screenshot(path=self.screenshot_dir)
        self.last_screenshot = path
        self.notify(f"screenshot saved: {path}", timeout=4)

    def exit_code(self) -> int:
        if self.diff_error is not None:
            return 2
        if self.result is None:
            return EXIT_INTERRUPTED
        return self.result.exit_code

    async def action_quit(self) -> None:
        self.cancel_diff()
        self.exit(self.exit_code())

    def on_unmount(self) -> None:
        self.cancel_diff()
        self.cleanup()

    def cancel_diff(self) -> None:
        """The diff thread stops at its next progress report (and removes its summary)."""
        if self._diff is not None:
            self._diff.cancel.set()

    @property
    def diff_thread(self):
        return self._diff.thread if self._diff is not None else None

    def cleanup(self) -> None:
        self._stop_live()
        if self.summary is not None:
            self.summary.close()
            self.summary = None
        self._source.close()
        if self._diff is not None:
            self._diff.remove_summary()
        if self._preview_process is not None:   # the app may end before the diff thread started
            self._preview_process.remove()


def run_tui(path_a: str, path_b: str, options: DiffOptions | None = None, *,
            token_text: TokenText | None = None) -> int:
    """Run the TUI; returns the exit code (1 divergence, 0 agree, 130 quit before the diff ended).
    A diff that fails re-raises its error after the screen is restored: bad input (a
    :class:`~tensordiff.errors.TensordiffError`) becomes the CLI's one line, anything else its
    "unexpected" line with the traceback hint."""
    app = TensordiffApp(path_a, path_b, options, token_text=token_text)
    try:
        code = app.run()
    finally:
        app.cancel_diff()
        app.cleanup()
        t = app.diff_thread
        if t is not None and t.is_alive():
            t.join(0.3)
            if t.is_alive():
                sys.stderr.write("tensordiff: stopping the diff (it stops at its next progress report)...\n")
                sys.stderr.flush()
                t.join()
    if app.diff_error is not None:
        raise app.diff_error
    return app.exit_code() if code is None else int(code)


def save_screenshot(path_a: str, path_b: str, out: str, size: tuple[int, int] = (140, 40), *,
                    options: DiffOptions | None = None, token_text: TokenText | None = None) -> int:
    """Open the TUI headless on a trace pair, wait for the diff and the detail pane, and save the
    screen as SVG (``out`` ending in .png: converted with rsvg-convert or headless chromium,
    whichever is installed). Returns the diff's exit code (1 divergence, 0 agree)."""
    import asyncio

    async def go() -> tuple[str, int]:
        app = TensordiffApp(path_a, path_b, options, token_text=token_text)
        async with app.run_test(size=size) as pilot:
            while not app.ready and app.diff_error is None:
                await pilot.pause(0.05)
            if app.diff_error is not None:
                raise app.diff_error   # as run_tui: a bug is not bad input
            while app.vectors_for != app.cell:
                await pilot.pause(0.05)
            await pilot.pause()
            return app.export_screenshot(title="tensordiff"), app.exit_code()

    svg, code = asyncio.run(go())
    if out.lower().endswith(".png"):
        svg_to_png(svg, out)
    else:
        try:
            with open(out, "w", encoding="utf-8") as fh:
                fh.write(svg)
        except OSError as e:
            raise UsageError(f"cannot write {out}: {e.strerror or e}") from None
    return code


def svg_to_png(svg: str, out: str) -> None:
    """Rasterise an SVG screenshot with rsvg-convert, else headless chromium; a UsageError when
    neither is installed or the conversion fails."""
    import re
    import subprocess

    m = re.search(r'viewBox="0 0 ([0-9.]+) ([0-9.]+)"', svg)
    w, h = (int(float(m.group(1)) + 0.5), int(float(m.group(2)) + 0.5)) if m else (1400, 900)
    with tempfile.TemporaryDirectory(prefix="tensordiff-shot-") as d:
        src = os.path.join(d, "screen.svg")
        with open(src, "w", encoding="utf-8") as fh:
            fh.write(svg)
        if shutil.which("rsvg-convert"):
            cmd = ["rsvg-convert", "-o", out, src]
        elif shutil.which("chromium") or shutil.which("chromium-browser"):
            exe = shutil.which("chromium") or shutil.which("chromium-browser")
            cmd = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--hide-scrollbars",
                   f"--window-size={w},{h}", f"--screenshot={os.path.abspath(out)}", "file://" + src]
        else:
            raise UsageError(f"{out}: a PNG needs rsvg-convert (librsvg2-bin) or chromium; save as .svg instead")
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False, cwd=d,
                           env=dict(os.environ, HOME=d))
        if p.returncode != 0 or not os.path.isfile(out):
            tail = " ".join((p.stderr or "").split())[-200:]
            raise UsageError(f"could not convert the screenshot to {out} ({cmd[0]} exit {p.returncode}: {tail})")


if __name__ == "__main__":  # pragma: no cover - docs helper
    # python -m tensordiff.tui.app screenshot A B OUT.svg   (how docs/tui-example.svg is made)
    if len(sys.argv) == 5 and sys.argv[1] == "screenshot":
        save_screenshot(sys.argv[2], sys.argv[3], sys.argv[4])
        print(sys.argv[4])
    else:
        sys.stderr.write("usage: python -m tensordiff.tui.app screenshot A B OUT.svg\n")
        sys.exit(2)
