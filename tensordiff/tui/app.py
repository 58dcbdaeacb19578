"""The interactive TUI: ``tensordiff tui A B`` (or ``tensordiff diff A B --tui``).

It opens at once, runs the diff in a background worker thread (a progress bar shows how far it
is; keys pressed meanwhile are queued and replayed when it ends, never lost), shows in the heatmap
the rows the diff has compared so far (the rest drawn as pending, never as agreeing), then lands on
the first divergence. On a large pair, before the diff has aligned every token, it shows a
preview: the real metrics of the first tokens in one neutral colour, with no verdict (a verdict
needs the noise measured over the whole pair). Panes: the findings (the diff's, in forward
order), a tree of tensors and slots coloured by the findings on them, a token x slot heatmap of
a per-token metric, and a detail pane for the selected cell with the diff's sentence, identity
candidates, the cell's metrics, both token keys and small text plots of the two vectors.

The TUI never judges a tensor itself: every verdict it shows comes from
:func:`tensordiff.diff.diff_traces`. The heatmap reads the diff's per-token summary, written to a
temporary file that the app deletes on exit, in blocks; while the diff runs, the same file through
a :class:`tensordiff.tui.data.LiveSummary`, polled every 50 ms.

Where things live, as Textual apps split (toolong's, for one): this module is the app (the diff
thread, the files it owns, help, screenshot, quit and the exit code) and its entry points
(:func:`run_tui`, :func:`save_screenshot`); :mod:`tensordiff.tui.diff_screen` the screen of one
pair (layout, the keys that move among panes, what a choice in one pane does to the others);
:mod:`tensordiff.tui.panes` and :mod:`tensordiff.tui.widgets` the panes, each holding what it
shows; :mod:`tensordiff.tui.messages` what they post to each other (dataclasses);
:mod:`tensordiff.tui.diff_thread` the diff in a thread; :mod:`tensordiff.tui.data` the data layer
(block cache, lookups, go-to, the cell reader) and :mod:`tensordiff.tui.text` the text of the
panes, neither of which imports textual.

Keys: see :data:`tensordiff.tui.widgets.HELP` (``?`` in the app) and docs/tui.md.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import ClassVar

from textual import on
from textual.app import App
from textual.binding import Binding, BindingType
from textual.screen import Screen

from ..diff import DiffOptions, diff_traces
from ..errors import TensordiffError, UsageError
from ..findings import DiffResult
from ..summary import Column, SummaryReader, read_columns
from ..token_text import TokenText
from .data import METRICS, VectorSource
from .diff_screen import CSS as DIFF_CSS
from .diff_screen import DiffScreen
from .diff_thread import PREVIEW_FROM, Cancelled, DiffFn, DiffThread
from .messages import DiffEnded, DiffPreview, DiffProgress, PreviewDone, RowsPainted
from .preview_process import PreviewProcess
from .screenshot import svg_to_png
from .widgets import WIDE, HelpScreen

EXIT_INTERRUPTED = 130   # quit before the diff finished: no verdict


class TensordiffApp(App[int]):
    """The tensordiff TUI. ``diff_fn`` (tests, benchmarks) replaces the diff that runs in the worker."""

    TITLE = "tensordiff"
    ENABLE_COMMAND_PALETTE = False   # not a tensordiff key; its footer entry would hide ours at 80 columns
    CSS = DIFF_CSS
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (WIDE, "-wide")]
    VERTICAL_BREAKPOINTS = [(0, "-short"), (32, "-tall")]
    BINDINGS: ClassVar[list[BindingType]] = [   # in the footer after the screen's
        Binding("question_mark", "help", "help"),
        Binding("s", "screenshot", "shot"),
        Binding("q", "quit", "quit"),
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
        self._preview_from = preview_from
        self.screenshot_dir = screenshot_dir or os.getcwd()
        self.summary_path: str | None = self.options.summary_path
        self.summary: SummaryReader | None = None
        self.columns: list[Column] = []
        self.result: DiffResult | None = None
        self.diff_error: BaseException | None = None
        self.progress: tuple[str, int, int] = ("starting", 0, 1)   # the last DiffProgress
        self.first_paint_at: float | None = None
        self.first_rows_at: float | None = None          # the heatmap first showed real rows (preview or diff)
        self.first_live_rows_at: float | None = None     # ... rows the diff itself compared
        self.diff_seconds: float | None = None
        self.last_screenshot: str | None = None
        self._source = VectorSource(self.path_a, self.path_b)
        self.main = DiffScreen(self.path_a, self.path_b, self._source, token_text=token_text,
                               find_tokenizer=find_tokenizer, block_rows=block_rows, max_blocks=max_blocks)

    def get_default_screen(self) -> Screen[None]:
        return self.main

    @property
    def ready(self) -> bool:
        return self.result is not None and self.summary is not None

    def on_mount(self) -> None:
        self.call_after_refresh(self._after_first_paint)

    def _after_first_paint(self) -> None:
        """The first screen is drawn: the diff starts (benchmarks/bench_tui.py measures here)."""
        self.first_paint_at = time.perf_counter()
        self._diff = DiffThread(self.path_a, self.path_b, self.options, self.diff_fn, self.post_message,
                                preview_from=self._preview_from, preview_process=self._preview_process)
        self._diff.start()
        self.summary_path = self._diff.summary_path
        self.main.follow(self._diff)

    # -- what the diff thread and the screen report ----------------------------------------

    @on(DiffProgress)
    def _diff_progress(self, event: DiffProgress) -> None:
        self.progress = (event.stage, event.done, event.total)
        self.main.show_progress(self.progress)

    @on(DiffPreview)
    def _diff_preview(self, event: DiffPreview) -> None:
        self.main.show_preview(event.path)

    @on(PreviewDone)
    def _preview_done(self, _event: PreviewDone) -> None:
        """The diff thread may go on (it waits for the preview to be drawn)."""
        if self._diff is not None:
            self._diff.preview_shown.set()

    @on(RowsPainted)
    def _rows_painted(self, event: RowsPainted) -> None:
        if self.first_rows_at is None:
            self.first_rows_at = event.at
        if event.live and self.first_live_rows_at is None:
            self.first_live_rows_at = event.at
            self._first_live_rows_painted()

    def _first_live_rows_painted(self) -> None:
        """The diff's own first rows are on screen (benchmarks/bench_tui.py measures memory here)."""

    @on(DiffEnded)
    def _diff_ended(self, event: DiffEnded) -> None:
        if event.error is not None or event.result is None:
            self._failed(event.error or RuntimeError("the diff ended with no result"))
            return
        self.diff_seconds = time.perf_counter() - self._diff.t0 if self._diff is not None else None
        self.result = event.result
        self.main.stop_live()
        try:
            self.summary = SummaryReader(self.summary_path) if self.summary_path else None
        except TensordiffError as e:
            self._failed(e)
            return
        self.columns = read_columns(self.summary) if self.summary else []
        self.main.show_result(event.result, self.summary, self.columns)

    def _failed(self, err: BaseException) -> None:
        if isinstance(err, Cancelled):
            return
        self.diff_error = err
        self.main.show_failure(str(err) if isinstance(err, TensordiffError) else f"{type(err).__name__}: {err}")
        self.exit(2)

    # -- keys, and the end -----------------------------------------------------------------

    def action_help(self) -> None:
        self.push_screen(HelpScreen())

    def action_screenshot(self, filename: str | None = None, path: str | None = None) -> None:
        self.last_screenshot = self.save_screenshot(filename, path=path or self.screenshot_dir)
        self.notify(f"screenshot saved: {self.last_screenshot}", timeout=4)

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
    def diff_thread(self) -> threading.Thread | None:
        return self._diff.thread if self._diff is not None else None

    def cleanup(self) -> None:
        self.main.stop_live()
        if self.summary is not None:
            self.summary.close()
            self.summary = None
        self._source.close()
        if self._diff is not None:
            self._diff.remove_summary()
        if self._preview_process is not None:   # the app may end before the diff thread started
            self._preview_process.remove()

    # -- what the panes show, read by the tests, benchmarks and save_screenshot ------------
    heatmap = property(lambda self: self.main.heatmap)
    goto = property(lambda self: self.main.goto)
    pending = property(lambda self: self.main.pending)
    live = property(lambda self: self.main.heatmap.running)
    preview = property(lambda self: self.main.heatmap.preview)
    metric_index = property(lambda self: METRICS.index(self.main.heatmap.metric),
                            lambda self, i: self.main.heatmap.set_metric(METRICS[i]))
    selected_finding = property(lambda self: self.main.findings.selected)
    acceptance_lines = property(lambda self: self.main.acceptance.lines)
    _w_detail = property(lambda self: self.main.detail)
    cell = property(lambda self: self.main.detail.cell)
    vectors = property(lambda self: self.main.detail.vectors)
    vectors_for = property(lambda self: self.main.detail.vectors_for)
    detail_text = property(lambda self: self.main.detail.text)
    _render_detail = property(lambda self: self.main.detail.redraw)


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


if __name__ == "__main__":  # pragma: no cover - docs helper
    # python -m tensordiff.tui.app screenshot A B OUT.svg   (how docs/tui-example.svg is made)
    if len(sys.argv) == 5 and sys.argv[1] == "screenshot":
        save_screenshot(sys.argv[2], sys.argv[3], sys.argv[4])
        print(sys.argv[4])
    else:
        sys.stderr.write("usage: python -m tensordiff.tui.app screenshot A B OUT.svg\n")
        sys.exit(2)
