"""The panes around the heatmap, each holding what it shows: the findings list, the progress
row, the acceptance pane and the cell detail (see :mod:`tensordiff.tui.diff_screen`, which
lays them out). Their text is made in :mod:`tensordiff.tui.text`; a choice of the user leaves a
pane as a message of :mod:`tensordiff.tui.messages`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from rich.text import Text
from textual import events, on
from textual.app import ComposeResult
from textual.containers import Horizontal, VerticalScroll
from textual.widgets import OptionList, ProgressBar, Static
from textual.widgets.option_list import Option
from textual.worker import Worker, WorkerState

from ..findings import DiffResult, Finding
from ..fmt import progress_unit
from ..summary import Column, SummaryReader
from ..token_text import TokenText
from .data import LiveSummary, PreviewSummary, VectorSource
from .messages import FindingPicked
from .text import Vectors, acceptance_lines, detail_lines, finding_prompt

ACCEPT_TEXT_W = 26   # the acceptance pane's text width (30 columns less border and padding)


class FindingsList(OptionList):
    """The diff's findings, in its order; ``selected`` is the one the other panes show. The user
    moving the list posts :class:`~tensordiff.tui.messages.FindingPicked`."""

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.result: DiffResult | None = None
        self.selected: int | None = None
        self._compact: bool | None = None   # the form the options were made in (narrow screen)

    def show(self, result: DiffResult, narrow: bool) -> None:
        self.result = result
        self.lay_out(narrow)
        nd = len(result.divergences)
        self.border_title = (f"findings: {nd} ✗, {len(result.findings) - nd} other" if narrow   # whole
                             else f"findings: {nd} divergence{'s' if nd != 1 else ''}, {len(result.findings) - nd} other")

    def lay_out(self, narrow: bool) -> bool:
        """One line each on a wide screen; on a narrow one (80 columns) each wrapped, ``slot K of
        T`` as ``T[K]``, so that findings on different slots read apart. Returns whether the
        form changed."""
        if self.result is None or narrow == self._compact:
            return False
        self._compact = narrow
        keep = self.highlighted
        self.set_options([Option(finding_prompt(f, narrow)) for f in self.result.findings])
        if keep is not None and keep < self.option_count:
            self.highlighted = keep
        return True

    def select(self, index: int) -> Finding:
        assert self.result is not None
        self.selected = index
        if self.highlighted != index:
            self.highlighted = index
        return self.result.findings[index]

    @property
    def finding(self) -> Finding | None:
        return self.result.findings[self.selected] if self.result is not None and self.selected is not None else None

    def step(self, step: int) -> int | None:
        """``n`` / ``p``: the next or previous divergence (every finding when there is none: the
        notes are a click or an arrow key away in the list); None (and a note) when there is none."""
        assert self.result is not None
        fs = self.result.findings
        if not fs:
            self.notify("no findings: the traces agree")
            return None
        stops = [f.index for f in fs if f.severity == "divergence"] or [f.index for f in fs]
        what = "divergence" if self.result.divergences else "finding"
        cur = self.selected if self.selected is not None else -1
        ahead = [i for i in stops if i > cur] if step > 0 else [i for i in stops if i < cur]
        if not ahead:
            self.notify(f"last {what}" if step > 0 else f"first {what}", timeout=2)
            return None
        return ahead[0] if step > 0 else ahead[-1]

    @on(OptionList.OptionHighlighted)
    def _highlighted(self, event: OptionList.OptionHighlighted) -> None:
        # a stale message (the list was moved again since) is ignored
        if self.result is not None and event.option_index == self.highlighted and event.option_index != self.selected:
            self.post_message(FindingPicked(event.option_index))


class ProgressRow(Horizontal):
    """How far the diff is, and how many keys wait for it to end."""

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.progress: tuple[str, int, int] = ("starting", 0, 1)   # the last progress shown

    def compose(self) -> ComposeResult:
        yield ProgressBar(total=None, show_eta=False, id="progress")
        yield Static("starting", id="progress-label")

    def show(self, queued: int, progress: tuple[str, int, int] | None = None) -> None:
        if progress is not None:
            self.progress = progress
        stage, done, total = self.progress
        if total > 1:
            self.query_one(ProgressBar).update(total=total, progress=done)
        label = f"{stage}: {done}/{total} {progress_unit(stage)}" if total > 1 else stage
        if queued:
            label += f"  ({queued} key{'s' if queued > 1 else ''} queued)"
        self.query_one("#progress-label", Static).update(label, layout=False)


class AcceptancePane(VerticalScroll):
    """Acceptance per draft position and regime, from the diff's acceptance finding."""

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.lines: list[Text] = []

    def compose(self) -> ComposeResult:
        yield Static("", id="accept-text")

    def on_mount(self) -> None:
        self.border_title = "acceptance (a hides)"

    def show(self, result: DiffResult, wide: bool) -> None:
        """Shown at once on a wide screen, a key away (a) on a narrow one, absent when nothing
        about acceptance was recorded."""
        self.lines = acceptance_lines(result, ACCEPT_TEXT_W)
        if not self.lines:
            return
        self.query_one("#accept-text", Static).update(Text("\n").join(self.lines))
        if wide:
            self.add_class("shown")
        else:
            self.notify("acceptance recorded: press a to show it beside the heatmap", timeout=4)


@dataclass(frozen=True, eq=False)
class CellView:
    """What the detail pane shows of a cell once the diff has ended."""

    result: DiffResult
    summary: SummaryReader
    column: Column
    row: int
    token: np.void   # the cell's row of the summary's token table
    finding: Finding | None


class DetailPane(Static):
    """The cell under the cursor (``cell``: row, summary column): the diff's sentence, the
    candidates, the metrics, both token keys and small plots of the two vectors, read in a
    worker from ``source``. Its lines are laid out for its width (the value histograms' bins),
    so a change of width (the terminal resized, or its scroll container's bar coming or going
    once the lines are in) lays them out again."""

    def __init__(self, source: VectorSource, token_text: TokenText | None, find_tokenizer: bool,
                 *, id: str | None = None) -> None:
        super().__init__("", id=id)
        self.source = source
        # token text: the tokenizer given (--tokenizer), else the model directory a trace records
        # (looked for once, in the vectors' worker: loading a tokenizer may take seconds)
        self.token_text = token_text
        self._find_tokenizer = find_tokenizer and token_text is None
        self.cell: tuple[int, int] | None = None
        self.vectors_for: tuple[int, int] | None = None  # the cell whose vectors are held
        self.vectors: Vectors = (None, None, "")
        self.text = Text("")
        self.laid_width = -1   # the width the current lines were laid out for
        self._view: CellView | None = None

    def show(self, view: CellView) -> None:
        self._view = view
        self.redraw()

    def redraw(self) -> None:
        v = self._view
        if v is None:
            return
        vectors = self.vectors if self.vectors_for == self.cell else None
        tstr = self.token_text(int(v.token["token"])) if self.token_text is not None else ""
        self.laid_width = self.size.width
        self._put(detail_lines(v.result, v.summary, v.column, v.row, v.token, v.finding, vectors,
                               max(40, self.size.width), tstr))

    def fetch_vectors(self, view: CellView) -> None:
        """Read the cell's two vectors (and a recorded tokenizer, the first time) in a thread."""
        key, col, tok = (view.row, view.column.index), view.column, view.token
        keys = (int(tok["seq_a"]), int(tok["pos_a"]), int(tok["seq_b"]), int(tok["pos_b"]), int(tok["token"]))

        def load() -> tuple[tuple[int, int], object, object, str]:
            if self._find_tokenizer:
                self._find_tokenizer = False
                self.token_text = self.source.recorded_token_text()
            return (key, *self.source.cell_vectors(col, *keys))

        self.run_worker(load, thread=True, group="detail", exclusive=True, exit_on_error=False)

    def on_worker_state_changed(self, event: Worker.StateChanged) -> None:
        w = event.worker
        if w.group == "detail" and event.state == WorkerState.SUCCESS and w.result is not None:
            key, va, vb, note = w.result
            if key == self.cell:
                self.vectors_for = key
                self.vectors = (va, vb, note)
                self.redraw()

    def on_resize(self, event: events.Resize) -> None:
        if self.laid_width >= 0 and event.size.width != self.laid_width:
            self.redraw()

    def show_live(self, live: LiveSummary, column: Column, row: int, where: str) -> None:
        """A cell while the diff runs: its streamed metrics, or pending."""
        ci = column.index
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
        self._put([Text.assemble((column.label, "bold"), "  ", where), what,
                   Text("the diff is running: findings, the cell's sentence and its vectors come when it ends",
                        style="dim")])

    def show_preview(self, preview: PreviewSummary, column: Column, row: int, where: str) -> None:
        """A cell of the preview: its metrics, without a verdict."""
        cos, rel, mx, fl = (float(v) for v in preview.cell(row, column.index))
        if fl != fl:
            what = Text("no row for this token in this tensor", style="dim")
        elif int(fl) & 2:
            what = Text(f"1 - cos {1.0 - cos:.3g}  rel {rel:.3g}  max abs {mx:.3g}  (NaN/Inf)", style="bold red")
        else:
            what = Text(f"1 - cos {1.0 - cos:.3g}  rel {rel:.3g}  max abs {mx:.3g}  (no verdict yet)")
        self._put([Text.assemble((column.label, "bold"), "  ", where), what,
                   Text("preview of the first tokens, aligned among themselves: the tolerances, the verdict and the "
                        "rest of the tokens come as the diff goes on", style="dim")])

    def say(self, text: Text) -> None:
        """A line instead of a cell (no column matches the filter); the text of the cell is kept."""
        self.update(text)

    def _put(self, lines: list[Text]) -> None:
        self.text = Text("\n").join(lines)
        self.update(self.text)
