"""The diff as the TUI runs it: in a background thread that reports to the app with Textual
messages (:class:`DiffProgress`, :class:`DiffEnded`) and stops at its next progress report once
cancelled. It also hands the diff a :class:`tensordiff.tui_data.LiveSummary` sink (``live``),
through which the app's heatmap shows the rows compared so far while the diff runs.

A plain thread rather than a Textual worker, so that the app can end (and restore the terminal)
while the diff is in a long stage: the thread stops at its next progress report, and
:func:`tensordiff.tui_run.run_tui` joins it. Not a daemon: a daemon thread frozen inside h5py at
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

from .diff import DiffOptions, Stage
from .findings import DiffResult
from .tui_data import LiveSummary

PROGRESS_INTERVAL_S = 0.05

DiffFn = Callable[[str, str, DiffOptions], DiffResult]


class Cancelled(Exception):
    """Raised in the diff's progress callback once the app has quit."""


class DiffProgress(Message):
    """Posted by the diff thread: how far the diff is (a stage of the aligner, done of total)."""

    def __init__(self, stage: str, done: int, total: int) -> None:
        self.stage = stage
        self.done = done
        self.total = total
        super().__init__()


class DiffEnded(Message):
    """Posted by the diff thread: the result, or the error it raised."""

    def __init__(self, result: DiffResult | None, error: BaseException | None) -> None:
        self.result = result
        self.error = error
        super().__init__()


class DiffThread:
    """One diff of two traces, reported through ``post`` (the app's thread-safe ``post_message``).

    When ``options.summary_path`` is None the per-token summary goes to a private temporary
    directory, removed by :meth:`remove_summary` (and by the thread itself when cancelled: a diff
    still running then cannot create the file again, its directory is gone)."""

    def __init__(self, path_a: str, path_b: str, options: DiffOptions, diff_fn: DiffFn,
                 post: Callable[[Message], object]):
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

    def start(self) -> None:
        if self.owns_summary:
            self.summary_dir = tempfile.mkdtemp(prefix="tensordiff-tui-")
            self.summary_path = os.path.join(self.summary_dir, "summary.h5")
        self.t0 = time.perf_counter()
        self.thread = threading.Thread(target=self.run, name="tensordiff-diff")
        self.thread.start()

    def run(self) -> None:
        """The thread's body (called directly by tests)."""
        last: list = [None, 0.0]   # stage and time of the last message posted

        def progress(stage: str, done: int, total: int) -> None:
            if self.cancel.is_set():
                raise Cancelled()
            if stage == Stage.COMPARING and self.live is not None:
                self.live.commit()    # reported after every sink (the summary file too) has the block
            # a message per stage, per end of stage, and at most one per 50 ms in between: the
            # aligner reports per block, and the UI need not redraw the bar more often than that
            now = time.perf_counter()
            if stage != last[0] or done >= total or now - last[1] >= PROGRESS_INTERVAL_S:
                last[0], last[1] = stage, now
                self.post(DiffProgress(stage, done, total))

        def made(live: LiveSummary) -> None:
            self.live_at = time.perf_counter()
            self.live = live

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

    def remove_summary(self) -> None:
        if self.owns_summary and self.summary_dir:
            shutil.rmtree(self.summary_dir, ignore_errors=True)
