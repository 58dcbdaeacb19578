"""The interactive TUI: ``tensordiff tui A B`` (or ``tensordiff diff A B --tui``).

It opens at once, runs the diff in a background worker thread (a progress bar shows how far it
is; keys pressed meanwhile are queued and replayed when it ends, never lost), then lands on the
first divergence. Panes: the findings (the aligner's, in forward order), a tree of tensors and
slots coloured by the findings on them, a token x slot heatmap of a per-token metric, and a
detail pane for the selected cell with the aligner's sentence, identity candidates, the cell's
metrics, both token keys and small text plots of the two vectors.

The TUI never judges a tensor itself: every verdict it shows comes from
:class:`tensordiff.align.Differ`. The heatmap reads the diff's per-token summary, written to a
temporary file that the app deletes on exit, in blocks (see :mod:`tensordiff.tui_widgets`).

Keys: see :data:`HELP` (``?`` in the app) and docs/tui.md.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import replace
from typing import Callable

import numpy as np
from rich.text import Text
from textual import on
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.message import Message
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Footer, Input, OptionList, ProgressBar, Static, Tree
from textual.widgets.option_list import Option
from textual.worker import Worker, WorkerState

from .align import DiffOptions, DiffResult, Differ, Finding, SlotRow
from .errors import TraceError
from .summary import FLAG_BAD, FLAG_NONFINITE, SummaryReader
from .tui_widgets import (METRICS, Column, Heatmap, find_position, find_token_id, fmt, plot_lines, read_columns,
                          regime_name)

EXIT_INTERRUPTED = 130   # quit before the diff finished: no verdict

HELP = [
    ("n / p", "next / previous finding"),
    ("f", "jump to the first divergence"),
    ("g", "go to a token: #INDEX (aligned row), SEQ:POS, POS (in the current sequence) or t=TOKEN_ID"),
    ("/", "filter tensors: comma-separated substrings of column labels (empty: all); Enter or Esc closes"),
    ("m", "toggle the heatmap metric: relative error, 1 - cosine, max abs error, aligner verdict"),
    ("arrows, PgUp/PgDn, Home/End", "move the heatmap cursor (click a cell with the mouse, too)"),
    ("Tab / Shift+Tab", "move between findings, tensors and heatmap; Enter picks"),
    ("s", "save a screenshot (SVG) in the current directory"),
    ("?", "this help"),
    ("q", "quit (exit code: 1 divergence, 0 agree, 130 quit before the diff finished)"),
]

SEVERITY_GLYPH = {"divergence": ("✗", "bold red"), "warning": ("!", "yellow"), "info": ("·", "blue")}
OK_GLYPH = ("✓", "green")
_SEV_RANK = {"divergence": 3, "warning": 2, "info": 1}

DiffFn = Callable[[str, str, DiffOptions], DiffResult]


class _Cancelled(Exception):
    """Raised in the diff worker's progress callback once the app quits."""


class DiffEnded(Message):
    """Posted by the diff thread: the result, or the error it raised."""

    def __init__(self, result: DiffResult | None, error: BaseException | None) -> None:
        self.result = result
        self.error = error
        super().__init__()


def run_diff(path_a: str, path_b: str, options: DiffOptions) -> DiffResult:
    with Differ(path_a, path_b, options) as d:
        return d.run()


# ----------------------------------------------------------------------------------------------
# Screens
# ----------------------------------------------------------------------------------------------


class HelpScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape,q,question_mark,enter", "dismiss", "close")]
    DEFAULT_CSS = """
    HelpScreen { align: center middle; }
    HelpScreen > Static { width: 96; height: auto; border: round $accent; padding: 1 2; background: $panel; }
    """

    def compose(self) -> ComposeResult:
        from rich.console import Group
        from rich.table import Table

        table = Table(box=None, show_header=False, padding=(0, 2, 0, 0), expand=True)
        table.add_column(style="bold cyan", no_wrap=True, justify="right")
        table.add_column(ratio=1)
        for k, what in HELP:
            table.add_row(k, what)
        legend = Text("Colours and glyphs are the aligner's: red / ✗ a divergence, yellow / ! a warning, "
                      "green / ✓ nothing found. Heatmap bars grow with the metric (log scale); in verdict "
                      "mode ··· is ok and ███ fails tolerance; !!! NaN/Inf; blank: no row for that token. "
                      "Esc closes.", style="dim")
        yield Static(Group(Text("tensordiff keys\n", style="bold"), table, Text(""), legend))

    def action_dismiss(self) -> None:  # type: ignore[override]
        self.dismiss(None)


class GotoScreen(ModalScreen[str | None]):
    BINDINGS = [Binding("escape", "cancel", "cancel")]
    DEFAULT_CSS = """
    GotoScreen { align: center middle; }
    GotoScreen > Vertical { width: 72; height: auto; border: round $accent; padding: 0 1; background: $panel; }
    """

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Static("go to token: #INDEX, SEQ:POS, POS or t=TOKEN_ID")
            yield Input(placeholder="e.g. 120, s0:120, #5000, t=42", id="goto-input")

    def on_mount(self) -> None:
        self.query_one(Input).focus()

    @on(Input.Submitted)
    def _submit(self, event: Input.Submitted) -> None:
        self.dismiss(event.value.strip() or None)

    def action_cancel(self) -> None:
        self.dismiss(None)


# ----------------------------------------------------------------------------------------------
# Reading the two vectors of a cell (detail pane), off the UI thread
# ----------------------------------------------------------------------------------------------


class VectorSource:
    """Opens the two traces lazily (in the detail worker) and reads one slot of one token."""

    def __init__(self, path_a: str, path_b: str):
        self.paths = (path_a, path_b)
        self._readers: list = [None, None]
        self._lock = threading.Lock()

    def reader(self, side: int):
        with self._lock:
            if self._readers[side] is None:
                from .trace import TraceReader

                self._readers[side] = TraceReader(self.paths[side])
            return self._readers[side]

    @staticmethod
    def row_of(r, name: str, seq: int, pos: int, token: int) -> int | None:
        """The tensor row recorded for (sequence index, position) with this token id (the last one
        wins, as in the aligner's row maps)."""
        tok = r.tokens
        cand = np.flatnonzero((tok["seq"] == seq) & (tok["position"] == pos) & (tok["token"] == token))
        if len(cand) == 0:
            return None
        trow = r.token_rows(name)
        hits = np.flatnonzero(np.isin(trow, cand))
        return int(hits[-1]) if len(hits) else None

    def read(self, side: int, name: str, slot: int, seq: int, pos: int, token: int) -> tuple[np.ndarray | None, str]:
        r = self.reader(side)
        info = r.tensors.get(name)
        if info is None:
            return None, f"{name} not in the trace"
        if not info.has_values:
            return None, f"{name} has no full values (sketch only)"
        row = self.row_of(r, name, seq, pos, token)
        if row is None:
            return None, f"{name} has no row for this token"
        w = info.slot_width
        v = r.read_values_at(name, np.array([row]))[0, slot * w:(slot + 1) * w]
        return v, ""

    def close(self) -> None:
        with self._lock:
            for r in self._readers:
                if r is not None:
                    r.close()
            self._readers = [None, None]


# ----------------------------------------------------------------------------------------------
# The app
# ----------------------------------------------------------------------------------------------


class TensordiffApp(App[int]):
    """The tensordiff TUI. ``diff_fn`` (tests, benchmarks) replaces the diff that runs in the worker."""

    TITLE = "tensordiff"
    CSS = """
    Screen { layout: vertical; }
    #titlebar { height: 1; background: $primary-background; color: $text; padding: 0 1; }
    #headline { height: 1; padding: 0 1; }
    #progress-row { height: 1; padding: 0 1; }
    #progress-row ProgressBar { width: 48; }
    #progress-label { width: 1fr; padding: 0 1; }
    #body { height: 1fr; }
    #left { width: 44; }
    #findings { height: 45%; border: round $primary; text-wrap: nowrap; text-overflow: ellipsis; }
    #tree { height: 1fr; border: round $primary; }
    #right { width: 1fr; }
    #filter { display: none; height: 3; }
    #heatmap { height: 1fr; border: round $primary; }
    #detail { height: 11; border: round $primary; padding: 0 1; text-wrap: nowrap; text-overflow: ellipsis; }
    .done #progress-row { display: none; }
    """

    BINDINGS = [
        Binding("n", "next_finding", "next"),
        Binding("p", "prev_finding", "prev"),
        Binding("f", "first_divergence", "first div."),
        Binding("g", "goto", "go to token"),
        Binding("slash", "filter", "filter"),
        Binding("m", "toggle_metric", "metric"),
        Binding("question_mark", "help", "help"),
        Binding("s", "screenshot", "screenshot"),
        Binding("q", "quit", "quit"),
        Binding("escape", "close_filter", "close filter", show=False),
    ]

    def __init__(self, path_a: str, path_b: str, options: DiffOptions | None = None, *,
                 diff_fn: DiffFn | None = None, screenshot_dir: str | None = None,
                 block_rows: int = 256, max_blocks: int = 24):
        super().__init__()
        self.path_a, self.path_b = os.fspath(path_a), os.fspath(path_b)
        self.options = options or DiffOptions()
        self.diff_fn = diff_fn or run_diff
        self.screenshot_dir = screenshot_dir or os.getcwd()
        self._owns_summary = self.options.summary_path is None
        self.summary_path: str | None = self.options.summary_path
        self.summary: SummaryReader | None = None
        self.columns: list[Column] = []
        self.result: DiffResult | None = None
        self.diff_error: BaseException | None = None
        self.selected_finding: int | None = None
        self.pending: list[tuple[str, Callable[[], None]]] = []
        self.metric_index = 0
        self.first_paint_at: float | None = None
        self.mounted_at: float | None = None
        self.diff_seconds: float | None = None
        self.cell: tuple[int, int] | None = None        # (row, summary column) in the detail pane
        self.vectors_for: tuple[int, int] | None = None  # the cell whose vectors are shown
        self.vectors: tuple = (None, None, "")
        self._progress = ("starting", 0, 1)
        self._cancel = threading.Event()
        self._filter_text = ""
        self._source = VectorSource(self.path_a, self.path_b)
        self._block_rows, self._max_blocks = block_rows, max_blocks
        self._diff_t0 = 0.0
        self._diff_thread: threading.Thread | None = None
        self._summary_dir: str | None = None
        self.detail_text = Text("")
        self.last_screenshot: str | None = None

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
                yield Tree("tensors", id="tree")
            with Vertical(id="right"):
                yield Input(placeholder="filter tensors: substrings, comma-separated (empty: all)", id="filter")
                yield Heatmap(id="heatmap", block_rows=self._block_rows, max_blocks=self._max_blocks)
                yield Static("", id="detail")
        yield Footer()

    def _title_text(self) -> Text:
        a, b = os.path.basename(self.path_a), os.path.basename(self.path_b)
        if self.result is not None:
            a += f" [{self.result.side_a}]"
            b += f" [{self.result.side_b}]"
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
        self._w_findings, self._w_tree = q("#findings", OptionList), q("#tree", Tree)
        self._w_detail, self._w_headline = q("#detail", Static), q("#headline", Static)
        self._w_progress, self._w_progress_label = q("#progress", ProgressBar), q("#progress-label", Static)
        self._w_filter, self._w_titlebar, self._w_heatmap = q("#filter", Input), q("#titlebar", Static), q(Heatmap)
        fl = self._w_findings
        fl.border_title = "findings"
        tree = self._w_tree
        tree.border_title = "tensors"
        tree.show_root = False
        self.heatmap.border_title = f"tokens x slots: {METRICS[0].title}"
        self._w_detail.border_title = "detail"
        self.heatmap.focus()
        self.call_after_refresh(self._after_first_paint)

    def _after_first_paint(self) -> None:
        self.first_paint_at = time.perf_counter()
        self._start_diff()

    # -- the diff worker -------------------------------------------------------------------

    def _start_diff(self) -> None:
        if self._owns_summary:
            # in a private directory, removed on exit: a diff thread still running then cannot
            # create the file again (its directory is gone)
            self._summary_dir = tempfile.mkdtemp(prefix="tensordiff-tui-")
            self.summary_path = os.path.join(self._summary_dir, "summary.h5")
        self._diff_t0 = time.perf_counter()
        self.set_interval(0.1, self._poll_progress, name="progress")
        # A plain thread rather than a Textual worker, so that the app can end (and restore the
        # terminal) while the diff is in a long stage: the thread stops at its next progress
        # report, and run_tui joins it. Not a daemon: a daemon thread frozen inside h5py at
        # interpreter exit would hold h5py's lock and deadlock the exit.
        self._diff_thread = threading.Thread(target=self._run_diff, name="tensordiff-diff")
        self._diff_thread.start()

    def _run_diff(self) -> None:
        def progress(stage: str, done: int, total: int) -> None:
            if self._cancel.is_set():
                raise _Cancelled()
            self._progress = (stage, done, total)

        opts = replace(self.options, summary_path=self.summary_path, progress=progress)
        try:
            res, err = self.diff_fn(self.path_a, self.path_b, opts), None
        except BaseException as e:  # noqa: BLE001 - reported on the UI thread
            res, err = None, e
        if self._cancel.is_set():
            self._remove_summary()
            return
        self.post_message(DiffEnded(res, err))   # thread-safe

    @on(DiffEnded)
    def _diff_ended(self, event: DiffEnded) -> None:
        if event.error is not None:
            self._on_diff_error(event.error)
        else:
            self._on_diff_done(event.result)

    def _poll_progress(self) -> None:
        if self.result is not None or self.diff_error is not None:
            return
        stage, done, total = self._progress
        bar = self._w_progress
        if total > 1:
            bar.update(total=total, progress=done)
        label = f"{stage}: {done}/{total} rows" if total > 1 else stage
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
        if isinstance(err, _Cancelled):
            return
        self.diff_error = err
        msg = str(err) if isinstance(err, TraceError) else f"{type(err).__name__}: {err}"
        self._w_headline.update(Text(f"diff failed: {msg}", style="bold red"))
        self.exit(2)

    def _on_diff_done(self, res: DiffResult) -> None:
        self.diff_seconds = time.perf_counter() - self._diff_t0
        self.result = res
        try:
            self.summary = SummaryReader(self.summary_path) if self.summary_path else None
        except TraceError as e:
            self._on_diff_error(e)
            return
        self.columns = read_columns(self.summary) if self.summary else []
        self.add_class("done")
        self._w_titlebar.update(self._title_text())
        first = res.first_divergence
        self._w_headline.update(
            Text(("first divergence: " if first else "") + res.headline(), style="bold red" if first else "bold green"))
        fl = self._w_findings
        fl.set_options([Option(self._finding_prompt(f)) for f in res.findings])
        nd = len(res.divergences)
        fl.border_title = f"findings: {nd} divergence{'s' if nd != 1 else ''}, {len(res.findings) - nd} other"
        self._build_tree()
        if self.summary is not None:
            self.heatmap.attach(self.summary, self.columns)
            if self._filter_text:
                self.heatmap.set_filter(self._filter_text)
        self.heatmap.border_title = self._heatmap_title()
        target = first or (res.findings[0] if res.findings else None)
        if target is not None:
            self._select_finding(target.index)
        else:
            self.heatmap.move_to(0, 0)
        queued, self.pending = self.pending, []
        for _what, fn in queued:
            fn()

    def _heatmap_title(self) -> str:
        m = METRICS[self.metric_index]
        n = self.summary.n if self.summary is not None else 0
        shown = len(self.heatmap.shown)
        cols = f"{shown} of {len(self.columns)} columns" if shown != len(self.columns) else f"{len(self.columns)} columns"
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
        stage, done, total = self._progress
        pct = f" ({100 * done // total}% done)" if total > 1 else ""
        self.notify(f"{what}: queued until the diff finishes{pct}", timeout=3)
        self._poll_progress()
        return False

    # -- findings and tree -----------------------------------------------------------------

    @staticmethod
    def _finding_prompt(f: Finding) -> Text:
        glyph, style = SEVERITY_GLYPH.get(f.severity, ("?", ""))
        t = Text(no_wrap=True, overflow="ellipsis")
        t.append(f"{glyph} ", style=style)
        t.append(f"#{f.index} ", style="dim")
        t.append(f.message, style="bold" if f.severity == "divergence" and f.inherited_from is None else "")
        return t

    def _column_findings(self, col: Column) -> list[Finding]:
        if self.result is None:
            return []
        return [f for f in self.result.findings if col.matches(f.tensor, f.slot)]

    def _slot_row(self, col: Column) -> SlotRow | None:
        if self.result is None:
            return None
        for r in self.result.slot_table:
            if r.tensor in (col.tensor_a, col.tensor_b) and r.slot == col.slot:
                return r
        return None

    def _verdict(self, col: Column) -> tuple[str, str, str]:
        """(glyph, style, words) from the aligner's findings and slot table for one column."""
        fs = self._column_findings(col)
        worst = max(fs, key=lambda f: _SEV_RANK.get(f.severity, 0), default=None)
        row = self._slot_row(col)
        if row is not None and row.held_b is not None and (row.held_b != row.expected or row.offset_b):
            words = f"holds {row.held_b}{f' ({row.offset_b:+d})' if row.offset_b else ''} {fmt(row.score_b, 2)}"
        elif row is not None and row.verdict != "ok":
            words = row.verdict
        elif row is not None:
            words = f"ok {fmt(row.score_b, 2)}"
        else:
            words = worst.kind if worst is not None else "ok"
        if worst is None:
            return OK_GLYPH[0], OK_GLYPH[1], words
        g, s = SEVERITY_GLYPH.get(worst.severity, ("?", ""))
        return g, s, words

    def _build_tree(self) -> None:
        tree = self._w_tree
        tree.clear()
        groups: dict[str, list[Column]] = {}
        for c in self.columns:
            groups.setdefault(c.tensor_a, []).append(c)
        for name, cols in groups.items():
            verdicts = [self._verdict(c) for c in cols]
            if len(cols) == 1 and not cols[0].packed:
                g, s, words = verdicts[0]
                tree.root.add_leaf(Text.assemble((g, s), " ", cols[0].label, (f"  {words}", "dim")), data=cols[0].index)
                continue
            rank = {OK_GLYPH[0]: 0, "·": 1, "!": 2, "✗": 3}
            g, s, _ = max(verdicts, key=lambda v: rank.get(v[0], 0))
            node = tree.root.add(Text.assemble((g, s), " ", name, (f"  {len(cols)} slots", "dim")),
                                 data=cols[0].index, expand=True)
            for c, (g2, s2, words) in zip(cols, verdicts):
                claim = f" = {c.slot_label}" if c.slot_label else ""
                node.add_leaf(Text.assemble((g2, s2), f" slot {c.slot}{claim}", (f"  {words}", "dim")), data=c.index)

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
        row = f.details.get("token_index") if f.details else None
        if row is None or row < 0:
            row = None
        if row is not None or col_pos is not None:
            hm.move_to(row, col_pos, center=True)
        else:
            self._render_detail()

    # -- cell detail -----------------------------------------------------------------------

    @on(Heatmap.CellSelected)
    def _cell_selected(self, event: Heatmap.CellSelected) -> None:
        self.cell = (event.row, event.column)
        self._render_detail()
        self._request_vectors()

    def _request_vectors(self) -> None:
        if self.cell is None or self.summary is None:
            return
        row, ci = self.cell
        col = next(c for c in self.columns if c.index == ci)
        tok = self.heatmap.blocks.token(row) if self.heatmap.blocks is not None else self.summary.tokens(row, row + 1)[0]
        key = (row, ci)
        args = (int(tok["seq_a"]), int(tok["pos_a"]), int(tok["seq_b"]), int(tok["pos_b"]), int(tok["token"]))

        def load():
            sa, pa, sb, pb, token = args
            try:
                va, na = self._source.read(0, col.tensor_a, col.slot, sa, pa, token)
                vb, nb = self._source.read(1, col.tensor_b, col.slot, sb, pb, token)
            except Exception as e:  # noqa: BLE001 - a damaged trace must not take the UI down
                return key, None, None, f"cannot read the values: {' '.join(str(e).split())[:200]}"
            return key, va, vb, "; ".join(x for x in (na, nb) if x)

        self.run_worker(load, thread=True, group="detail", exclusive=True, exit_on_error=False)

    def _render_detail(self) -> None:
        pane = self._w_detail
        if self.result is None or self.cell is None or self.summary is None:
            return
        res = self.result
        row, ci = self.cell
        col = next(c for c in self.columns if c.index == ci)
        lines: list[Text] = []
        fs = self._column_findings(col)
        sel = res.findings[self.selected_finding] if self.selected_finding is not None else None
        if sel is not None and (sel in fs or sel.tensor is None):
            f = sel   # the selected finding, when it is about this column or about no tensor
        else:
            f = min(fs, key=lambda x: x.index) if fs else None
        if f is not None:
            g, s = SEVERITY_GLYPH.get(f.severity, ("?", ""))
            t = Text.assemble((f"{g} #{f.index} {f.kind}: ", s), (f.message, "bold"))
            if f.inherited_from is not None:
                t.append(f"  (may be inherited from #{f.inherited_from})", style="dim")
            if len(fs) > 1 or (fs and f not in fs):
                t.append(f"  [{len(fs)} finding{'s' if len(fs) != 1 else ''} on {col.label}]", style="dim")
            lines.append(t)
        else:
            lines.append(Text.assemble(OK_GLYPH, (f" no finding on {col.label}", "")))
        tok = self.heatmap.blocks.token(row) if self.heatmap.blocks is not None else self.summary.tokens(row, row + 1)[0]
        sa, sb = int(tok["seq_a"]), int(tok["seq_b"])
        name_a = self.summary.seq_a[sa] if sa < len(self.summary.seq_a) else str(sa)
        name_b = self.summary.seq_b[sb] if sb < len(self.summary.seq_b) else str(sb)
        lines.append(Text.assemble(
            ("cell ", "dim"), (col.label, "bold"), ("  token ", "dim"), (str(int(tok["token"])), "bold"),
            ("  ", ""), (f"{res.side_a}: ", "cyan"), f"{name_a} pos {int(tok['pos_a'])} ({regime_name(tok['regime_a'])})",
            ("  ", ""), (f"{res.side_b}: ", "yellow"), f"{name_b} pos {int(tok['pos_b'])} ({regime_name(tok['regime_b'])})",
            ("  aligned #", "dim"), (str(row), "dim")))
        cell = self.summary.cell(row, ci)
        cos, rel, maxabs, flags = (float(x) for x in cell)
        if np.isnan(flags):
            lines.append(Text("no row of this tensor for this token on one side", style="dim"))
        else:
            fl = int(flags)
            verdict = ("NaN/Inf" if fl & FLAG_NONFINITE else "fails tolerance" if fl & FLAG_BAD else "within tolerance")
            vstyle = "bold magenta" if fl & FLAG_NONFINITE else "bold red" if fl & FLAG_BAD else "green"
            lines.append(Text.assemble(("cos ", "dim"), fmt(cos), ("   rel err ", "dim"), fmt(rel, 3),
                                       ("   max abs ", "dim"), fmt(maxabs, 3), ("   aligner: ", "dim"), (verdict, vstyle)))
        srow = self._slot_row(col)
        if srow is not None:
            held = srow.held_b or "?"
            if srow.offset_b:
                held += f" (position {srow.offset_b:+d})"
            lines.append(Text.assemble(
                ("slot ", "dim"), (srow.verdict, "bold red" if srow.verdict != "ok" else "green"),
                (": ", "dim"), (f"{res.side_b} ", "yellow"), f"holds {held} (claims {srow.claimed_b or '-'}), ",
                (f"{res.side_a} ", "cyan"), f"holds {srow.held_a or '?'} (claims {srow.claimed_a or '-'})",
                ("  score ", "dim"), fmt(srow.score_b, 3), ("  margin ", "dim"), fmt(srow.margin_b, 3)))
        cands = (f.details.get("candidates") if f is not None and f.details else None) or (srow.candidates_b if srow else None)
        if cands:
            t = Text("candidates ", style="dim")
            for i, c in enumerate(cands[:4]):
                if i:
                    t.append(" · ", style="dim")
                off = c.get("offset") or 0
                t.append(f"{c.get('label')}{f' ({off:+d})' if off else ''}", style="bold" if i == 0 else "")
                t.append(f" {fmt(c.get('score'), 3)} (cos {fmt(c.get('cos'), 3)}, rms {fmt(c.get('rms_agreement'), 3)})")
            lines.append(t)
        if self.vectors_for == self.cell:
            va, vb, note = self.vectors
            width = max(40, pane.size.width - 2)
            lines += plot_lines(va, vb, res.side_a, res.side_b, width)
            if note:
                lines.append(Text(note, style="dim"))
        else:
            lines.append(Text("reading the two vectors...", style="dim"))
        self.detail_text = Text("\n").join(lines)
        pane.update(self.detail_text, layout=False)

    # -- actions ---------------------------------------------------------------------------

    def _step_finding(self, step: int) -> None:
        assert self.result is not None
        n = len(self.result.findings)
        if n == 0:
            self.notify("no findings: the traces agree")
            return
        cur = self.selected_finding if self.selected_finding is not None else -1
        nxt = cur + step
        if not 0 <= nxt < n:
            self.notify("last finding" if step > 0 else "first finding", timeout=2)
            return
        self._select_finding(nxt)

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

        self.push_screen(GotoScreen(), done)

    def goto(self, spec: str) -> bool:
        """Move the cursor to a token: ``#INDEX``, ``SEQ:POS``, ``POS`` (current sequence) or
        ``t=TOKEN_ID`` (next row with that token id). Returns whether it moved."""
        assert self.summary is not None
        s = spec.strip()
        n = self.summary.n
        hm = self.heatmap
        try:
            if s.startswith("#"):
                row = int(s[1:])
                if not 0 <= row < n:
                    self.notify(f"no aligned row {row} (0..{n - 1})", severity="warning")
                    return False
            elif s.lower().startswith("t="):
                tid = int(s[2:])
                found = find_token_id(self.summary, tid, (hm.cursor_row + 1) % max(n, 1))
                if found is None:
                    self.notify(f"token id {tid} is not among the aligned tokens", severity="warning")
                    return False
                row = found
            else:
                if ":" in s:
                    seq_name, pos_txt = s.rsplit(":", 1)
                    if seq_name not in self.summary.seq_a:
                        self.notify(f"no sequence {seq_name!r} on {self.result.side_a if self.result else 'A'}",
                                    severity="warning")
                        return False
                    seq = self.summary.seq_a.index(seq_name)
                else:
                    pos_txt = s
                    seq = int(hm.blocks.token(hm.cursor_row)["seq_a"]) if hm.blocks is not None else 0
                pos = int(pos_txt)
                row = find_position(self.summary, seq, pos)
                tok = self.summary.tokens(row, row + 1) if row < n else None
                if tok is None or len(tok) == 0 or int(tok[0]["seq_a"]) != seq:
                    self.notify(f"position {pos} is past the aligned tokens of that sequence", severity="warning")
                    return False
                if int(tok[0]["pos_a"]) != pos:
                    self.notify(f"position {pos} is not aligned (a gap); went to position {int(tok[0]['pos_a'])}",
                                timeout=3)
        except ValueError:
            self.notify(f"cannot read {spec!r}: use #INDEX, SEQ:POS, POS or t=TOKEN_ID", severity="warning")
            return False
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
        self._cancel.set()
        self.exit(self.exit_code())

    def on_unmount(self) -> None:
        self._cancel.set()
        self._cleanup()

    def _cleanup(self) -> None:
        if self.summary is not None:
            self.summary.close()
            self.summary = None
        self._source.close()
        self._remove_summary()

    def _remove_summary(self) -> None:
        if self._owns_summary and self._summary_dir:
            shutil.rmtree(self._summary_dir, ignore_errors=True)


def run_tui(path_a: str, path_b: str, options: DiffOptions | None = None) -> int:
    """Run the TUI; returns the exit code (1 divergence, 0 agree, 130 quit before the diff ended).
    A diff that fails on bad input re-raises its TraceError after the screen is restored."""
    app = TensordiffApp(path_a, path_b, options)
    try:
        code = app.run()
    finally:
        app._cancel.set()
        app._cleanup()
        t = app._diff_thread
        if t is not None and t.is_alive():
            t.join(0.3)
            if t.is_alive():
                sys.stderr.write("tensordiff: stopping the diff (it stops at its next progress report)...\n")
                sys.stderr.flush()
                t.join()
    if app.diff_error is not None:
        if isinstance(app.diff_error, TraceError):
            raise app.diff_error
        raise TraceError(f"the diff failed: {type(app.diff_error).__name__}: {app.diff_error}")
    return app.exit_code() if code is None else int(code)


def save_screenshot(path_a: str, path_b: str, out: str, size: tuple[int, int] = (140, 40)) -> str:
    """Open the TUI headless on a trace pair, wait for the diff and write an SVG screenshot."""
    import asyncio

    async def go() -> str:
        app = TensordiffApp(path_a, path_b)
        async with app.run_test(size=size) as pilot:
            while not app.ready and app.diff_error is None:
                await pilot.pause(0.05)
            if app.diff_error is not None:
                raise app.diff_error
            while app.vectors_for != app.cell:
                await pilot.pause(0.05)
            await pilot.pause()
            svg = app.export_screenshot(title="tensordiff")
        with open(out, "w", encoding="utf-8") as fh:
            fh.write(svg)
        return out

    return asyncio.run(go())


if __name__ == "__main__":  # pragma: no cover - docs helper
    # python -m tensordiff.tui screenshot A B OUT.svg   (how docs/tui-example.svg is made)
    if len(sys.argv) == 5 and sys.argv[1] == "screenshot":
        print(save_screenshot(sys.argv[2], sys.argv[3], sys.argv[4]))
    else:
        sys.stderr.write("usage: python -m tensordiff.tui screenshot A B OUT.svg\n")
        sys.exit(2)
