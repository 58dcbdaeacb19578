"""The diff as the TUI runs it: in a background thread that reports to the app with Textual
messages (:class:`DiffProgress`, :class:`DiffEnded`, written in :mod:`tensordiff.tui.messages`)
and stops at its next progress report once cancelled. It also hands the diff a
:class:`tensordiff.tui.data.LiveSummary` sink (``live``), through which the app's heatmap shows
the rows compared so far while the diff runs.

On a large pair it first writes a preview (:func:`tensordiff.diff.preview.preview_summary`: the
real metrics of the first tokens, read without loading the whole traces, with no verdict) and
posts :class:`DiffPreview`, so the heatmap shows real rows while the diff opens and aligns every
token. Where the app forked a :class:`~tensordiff.tui.preview_process.PreviewProcess` when it was
created, the thread takes that child's preview instead of making its own.

A plain thread rather than a Textual worker, so that the app can end (and restore the terminal)
while the diff is in a long stage: the thread stops at its next progress report, and
:func:`tensordiff.tui.app.run_tui` joins it. Not a daemon: a daemon thread frozen inside h5py at
interpreter exit would hold h5py's lock and deadlock the exit.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import replace

from textual.message import Message

from ..diff import DiffOptions, Stage
from ..diff.preview import PREVIEW_TOKENS, preview_summary
from ..findings import DiffResult
from .data import LiveSummary
from .messages import DiffEnded, DiffPreview, DiffProgress

__all__ = ["Cancelled", "DiffEnded", "DiffFn", "DiffPreview", "DiffProgress", "DiffThread", "PREVIEW_FROM"]
from .preview_process import PreviewProcess, stored_tokens

PROGRESS_INTERVAL_S = 0.05
#: the preview is made when either trace holds at least this many token rows (a smaller diff
#: shows its own first rows about as soon)
PREVIEW_FROM = 200_000
#: how long the diff waits for the app to draw the preview before it opens the traces (reading
#: a token table holds the GIL: the app could not draw meanwhile)
PREVIEW_WAIT_S = 1.0
#: how long the diff waits for a preview child (:class:`PreviewProcess`) that has not answered when
#: the diff thread starts; a child this late is killed, and the diff goes on without a preview
PREVIEW_CHILD_WAIT_S = 3.0

DiffFn = Callable[[str, str, DiffOptions], DiffResult]


class Cancelled(Exception):
    """Raised in the diff's progress callback once the app has quit."""


class DiffThread:
    """One diff of two traces, reported through ``post`` (the app's thread-safe ``post_message``).

    When ``options.summary_path`` is None the per-token summary goes to a private temporary
    directory, removed by :meth:`remove_summary` (and by the thread itself when cancelled: a diff
    still running then cannot create the file again, its directory is gone)."""

    def __init__(self, path_a: str, path_b: str, options: DiffOptions, diff_fn: DiffFn,
                 post: Callable[[Message], object], preview_from: int | None = PREVIEW_FROM,
                 preview_process: PreviewProcess | None = None):
        self.path_a, self.path_b = path_a, path_b
        self.options = options
        self.diff_fn = diff_fn
        self.post = post
        self.cancel = threading.Event()
        self.owns_summary = options.summary_path is None
        self.summary_path: str | None = options.summary_path
        self.summary_dir: str | None = None
        self.thread: threading.Thread | None = None
        self.t0 = 0.0
        self.live: LiveSummary | None = None     # set in the diff thread once the tokens are aligned
        self.live_at: float | None = None        # when (perf_counter)
        self.preview_from = preview_from         # None: no preview
        self.preview_dir: str | None = None
        self.preview_at: float | None = None     # when the preview was written (perf_counter)
        self.preview_shown = threading.Event()   # set by the app once it has drawn (or declined) it
        self.preview_process = preview_process   # a child making the preview (else this thread makes it)

    def start(self) -> None:
        if self.owns_summary:
            self.summary_dir = tempfile.mkdtemp(prefix="tensordiff-tui-")
            self.summary_path = os.path.join(self.summary_dir, "summary.h5")
        self.t0 = time.perf_counter()
        self.thread = threading.Thread(target=self.run, name="tensordiff-diff")
        self.thread.start()

    def run(self) -> None:
        """The thread's body (called directly by tests)."""
        last_stage: str | None = None   # stage and time of the last message posted
        last_at = 0.0

        def progress(stage: str, done: int, total: int) -> None:
            nonlocal last_stage, last_at
            if self.cancel.is_set():
                raise Cancelled()
            if stage == Stage.COMPARING and self.live is not None:
                self.live.commit()    # reported after every sink (the summary file too) has the block
            # a message per stage, per end of stage, and at most one per 50 ms in between: the
            # diff reports per block, and the UI need not redraw the bar more often than that
            now = time.perf_counter()
            if stage != last_stage or done >= total or now - last_at >= PROGRESS_INTERVAL_S:
                last_stage, last_at = stage, now
                self.post(DiffProgress(stage, done, total))

        def made(live: LiveSummary) -> None:
            self.live_at = time.perf_counter()
            self.live = live

        try:
            self._preview()
        except Cancelled:
            self.remove_summary()
            return

        sinks = list(self.options.sinks)
        if self.summary_path is not None:
            sinks.append(LiveSummary.factory(self.summary_path, made))
        opts = replace(self.options, summary_path=self.summary_path, progress=progress, sinks=sinks)
        try:
            res, err = self.diff_fn(self.path_a, self.path_b, opts), None
        except BaseException as e:  # noqa: B036 - reported on the UI thread, whatever it is
            res, err = None, e
        if self.cancel.is_set():
            self.remove_summary()
            return
        self.post(DiffEnded(res, err))

    def _preview(self) -> None:
        """The preview of a large pair, posted as :class:`DiffPreview`; nothing when the pair is
        small, a trace set, or its heads share nothing (the diff itself says why)."""
        def check() -> None:
            if self.cancel.is_set():
                raise Cancelled()

        if self.preview_from is None:
            return
        if self.preview_process is not None:
            self.preview_dir = self.preview_process.dir
            n, path = self.preview_process.result(PREVIEW_CHILD_WAIT_S, check), self.preview_process.path
        else:
            if max(stored_tokens(self.path_a), stored_tokens(self.path_b)) < self.preview_from:
                return
            self.preview_dir = tempfile.mkdtemp(prefix="tensordiff-tui-preview-")
            path = os.path.join(self.preview_dir, "preview.h5")
            try:
                n = preview_summary(self.path_a, self.path_b, path, PREVIEW_TOKENS, check)
            except Cancelled:
                raise
            except Exception:  # noqa: BLE001 - a preview that cannot be made is no preview; the diff reports
                return
        if n:
            self.preview_at = time.perf_counter()
            self.post(DiffPreview(path, n))
            end = self.preview_at + PREVIEW_WAIT_S
            while not self.preview_shown.wait(0.01) and time.perf_counter() < end:
                check()

    def remove_summary(self) -> None:
        if self.owns_summary and self.summary_dir:
            shutil.rmtree(self.summary_dir, ignore_errors=True)
        if self.preview_process is not None:
            self.preview_process.remove()
        if self.preview_dir:
            shutil.rmtree(self.preview_dir, ignore_errors=True)
