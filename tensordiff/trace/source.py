"""What the diff reads of a trace, whatever holds it: :class:`TraceSource`, the interface that
:class:`~tensordiff.trace.TraceReader` (one file) and :class:`~tensordiff.traceset.TraceSet`
(per-rank files read as one) both implement, and the records they report in it: where rows live
(:class:`RowSegment`) and rows they hold twice that differ (:class:`ReplicaMismatch`, found by
comparing :class:`ReplicaTask` pieces into :class:`ReplicaPartial` results).

A single file holds nothing twice; a set that holds rows twice is :class:`Replicated`."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np
from numpy.typing import NDArray

from ..progress import Progress
from .schema import TensorInfo

if TYPE_CHECKING:
    from typing_extensions import Self

    from .reads import Pieces
    from .summary_types import TraceSummary


class _PartReads(Protocol):
    """The reads a source gives its :class:`TensorPart` (a trace file's, or a set's that each
    member file answers)."""

    def read_at(self, name: str, part: str, idx: np.ndarray, out: np.ndarray | None = None) -> np.ndarray: ...

    def read_range(self, name: str, part: str, lo: int, hi: int, out: np.ndarray | None = None) -> np.ndarray: ...

    def map_rows(self, name: str, part: str, idx: np.ndarray) -> np.ndarray | Pieces | None: ...


@dataclass(frozen=True, eq=False)
class TensorPart:
    """One stored part of one tensor of a trace (``values`` in stored form, bf16 as bits;
    ``sketch``; ``rms``), whatever holds it: its shape and dtype as plain values, and its rows read
    by index (:meth:`take`), as a range (:meth:`rows`) or in place (:meth:`map`). What a caller
    holds is this, never an HDF5 object: the source keeps its files to itself."""

    name: str
    kind: str
    shape: tuple[int, ...]   # rows first: those the source reads (a recovered trace's committed ones)
    dtype: np.dtype[Any]
    reads: _PartReads = field(repr=False)

    @property
    def row_bytes(self) -> int:
        """Stored bytes of one row."""
        return int(np.prod(self.shape[1:], dtype=np.int64)) * self.dtype.itemsize

    def take(self, idx: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """Rows at row indices in any order and with repeats (``out``: a buffer of this part's
        dtype the rows may be read into)."""
        return self.reads.read_at(self.name, self.kind, idx, out=out)

    def rows(self, start: int = 0, stop: int | None = None, out: np.ndarray | None = None) -> np.ndarray:
        """Rows [start, stop) (``out``: as for :meth:`take`)."""
        lo, hi, _ = slice(start, stop).indices(self.shape[0])
        return self.reads.read_range(self.name, self.kind, lo, max(lo, hi), out=out)

    def map(self, idx: np.ndarray) -> np.ndarray | Pieces | None:
        """A run of rows in place in the file's pages, read-only, or None: :meth:`take` them
        (:meth:`tensordiff.trace.reads.RowReads.map_rows`)."""
        return self.reads.map_rows(self.name, self.kind, idx)


@dataclass(frozen=True, eq=False)
class RowSegment:
    """Rows of one file: ``pos`` (ascending; None: all, in order) are the places in the rows asked
    for, ``rows`` the file's own tensor rows, ``host`` the host that wrote it (None: not recorded)."""

    path: str
    rows: NDArray[np.int64]
    pos: NDArray[np.int64] | None = None
    host: str | None = None


@dataclass
class ReplicaMismatch:
    """Replicated rows of one tensor that are not bit-identical: what the diff turns into a finding.

    ``axis``: ``tp`` (TP replicas) or ``pp`` (two PP stages recorded the same tensor). ``primary``
    is the file whose rows the set uses; ``replica`` the one that differs from it."""

    tensor: str
    order: float
    axis: str
    primary: str
    replica: str
    part: str                 # values or sketch
    rows: int                 # replicated rows compared
    differing: int            # of them, not bit-identical
    seq: str
    position: int
    token: int
    regime: str
    max_abs: float
    cos_min: float

    def sentence(self, side: str) -> str:
        what = "TP replicas" if self.axis == "tp" else "PP stages"
        return (f"{what} of {side} disagree: {self.tensor} in {os.path.basename(self.replica)} differs from "
                f"{os.path.basename(self.primary)} (the one compared) in {self.differing} of {self.rows} replicated "
                f"rows, first at token {self.token} (seq {self.seq}, position {self.position}); max abs "
                f"{self.max_abs:.3g}, cos {self.cos_min:.6f}: the replicas are not equal, so this side's verdict "
                "depends on which one is read")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class ReplicaTask:
    """Replicated rows to compare, in member terms only (picklable: paths and row indices)."""

    tensor: str
    group: int                # which replicated (primary, replica) pair of files of this tensor
    part: str
    dtype: str
    primary: str
    replica: str
    rows_primary: np.ndarray
    rows_replica: np.ndarray
    start: int                # where these rows start in the group's replicated rows
    host: str | None = None   # the host that wrote the replica (for placement)


@dataclass
class ReplicaPartial:
    """What comparing one :class:`ReplicaTask` found (picklable)."""

    tensor: str
    group: int
    rows: int
    differing: int
    first: int                # index into the group's replicated rows of the first differing one, -1 if none
    max_abs: float
    cos_min: float


class TraceSource(Protocol):
    """One side of a diff: its metadata (token table, sequences, tensors, model), the parts of its
    tensors (:meth:`part`, a :class:`TensorPart` that reads their rows), its summary; opened and
    closed as a context manager. A source whose rows lie in several files is also
    :class:`Sharded`; one that holds rows twice is also :class:`Replicated`."""

    @property
    def path(self) -> str: ...

    @property
    def side(self) -> str: ...

    @property
    def tokens(self) -> np.ndarray: ...

    @property
    def sequences(self) -> Sequence[str]: ...

    @property
    def tensors(self) -> Mapping[str, TensorInfo]: ...

    @property
    def model(self) -> dict[str, Any]: ...

    @property
    def sketch_seed(self) -> int: ...

    @property
    def sketch_dim(self) -> int: ...

    @property
    def hidden_size(self) -> int | None: ...

    @property
    def num_layers(self) -> int | None: ...

    @property
    def recovered_note(self) -> str | None: ...

    def token_rows(self, name: str) -> NDArray[np.int64]: ...

    def part(self, name: str, kind: str) -> TensorPart:
        """Part ``kind`` (values, sketch, rms) of tensor ``name``; raises
        :class:`~tensordiff.errors.TensordiffError` when it has none (:meth:`has_part` asks)."""
        ...

    def has_part(self, name: str, part: str) -> bool: ...

    def summary(self) -> TraceSummary:
        """Everything ``tensordiff info`` shows, as plain data."""
        ...

    def close(self) -> None: ...

    def __enter__(self) -> Self: ...

    def __exit__(self, *exc: object) -> None: ...


@runtime_checkable
class Sharded(Protocol):
    """A source whose rows lie in several files (a trace set): which file holds rows, so that
    worker processes open only those, and the hosts its files record having been written on,
    where they record them (placement)."""

    @property
    def hosts(self) -> tuple[str, ...]: ...

    def segments(self, name: str, rows: NDArray[np.int64]) -> list[RowSegment]:
        """Where tensor rows ``rows`` live, one segment per file that holds some of them."""
        ...


def segments_of(source: TraceSource, name: str, rows: NDArray[np.int64]) -> list[RowSegment]:
    """Where tensor rows ``rows`` of a source live: a set's segments, or the one file's."""
    if isinstance(source, Sharded):
        return source.segments(name, rows)
    return [RowSegment(source.path, np.asarray(rows, np.int64))]


def hosts_of(source: TraceSource) -> tuple[str, ...]:
    """The hosts a source's files record having been written on (none for one file)."""
    return source.hosts if isinstance(source, Sharded) else ()


@runtime_checkable
class Replicated(Protocol):
    """A source that holds some rows twice (a trace set: TP replicas, PP stages that recorded the
    same tensor), compared bit for bit: :meth:`replica_tasks` the rows to compare, in picklable
    pieces any process can do, :meth:`replica_mismatches` what their results mean. A single file
    holds every row once and is not one."""

    def replica_tasks(self) -> list[ReplicaTask]: ...

    def replica_mismatches(self, partials: Sequence[ReplicaPartial]) -> list[ReplicaMismatch]: ...

    def check_replicas(self, progress: Progress | None = None) -> list[ReplicaMismatch]:
        """Every replica comparison, in this process."""
        ...


__all__ = ["Replicated", "ReplicaMismatch", "ReplicaPartial", "ReplicaTask", "RowSegment", "Sharded", "TensorPart",
           "TraceSource", "hosts_of", "segments_of"]
