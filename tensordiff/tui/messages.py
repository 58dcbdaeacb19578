"""What the TUI's parts tell each other: Textual messages, as dataclasses of what they carry.

The diff thread tells the app how far the diff is and how it ended; the panes tell the diff
screen what the user picked (a cell, a finding, a column), and the heatmap tells the app when it
first drew real rows. A pane never reaches into another: it posts one of these, and the screen
(or the app) acts on it.
"""

from __future__ import annotations

from dataclasses import dataclass

from textual.message import Message

from ..findings import DiffResult


@dataclass
class DiffProgress(Message):
    """Posted by the diff thread: how far the diff is (a stage of the diff, done of total)."""

    stage: str
    done: int
    total: int


@dataclass
class DiffPreview(Message):
    """Posted by the diff thread: the preview's summary file (``tokens`` aligned tokens) is written."""

    path: str
    tokens: int


@dataclass
class DiffEnded(Message):
    """Posted by the diff thread: the result, or the error it raised."""

    result: DiffResult | None
    error: BaseException | None


@dataclass
class CellSelected(Message):
    """The heatmap's cursor moved to (row, column); ``column`` is a summary column index."""

    row: int
    column: int


@dataclass
class FindingPicked(Message):
    """The user moved the findings list to the finding at ``index``."""

    index: int


@dataclass
class ColumnPicked(Message):
    """The user picked a tensor or slot in the tree: summary column ``column``."""

    column: int


@dataclass
class RowsPainted(Message):
    """The heatmap drew real rows for the first time: the preview's, or (``live``) rows the
    running diff itself compared; ``at``: when (``time.perf_counter``)."""

    live: bool
    at: float


@dataclass
class RowsChanged(Message):
    """The heatmap shows new rows of the running diff (or the preview): the cell under the
    cursor may have changed."""


@dataclass
class PreviewDone(Message):
    """The preview is drawn, or will not be: the diff thread may go on (it waits for it)."""
