"""What the diff reads of a trace, whatever holds it: :class:`TraceSource`, the interface that
:class:`~tensordiff.trace.TraceReader` (one file) and :class:`~tensordiff.traceset.TraceSet`
(per-rank files read as one) both implement, and the records they report in it: where rows live
(:class:`RowSegment`) and rows they hold twice that differ (:class:`ReplicaMismatch`, found by
comparing :class:`ReplicaTask` pieces into :class:`ReplicaPartial` results).

A single file holds nothing twice: its replica tasks and mismatches are empty."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
from numpy.typing import NDArray

from ..progress import Progress
from .schema import TensorInfo

if TYPE_CHECKING:
    from typing_extensions import Self

    from .reads import Pieces
    from .summary_types import TraceSummary


class Part(Protocol):
    """A stored part of a tensor (``values``, ``sketch``, ``rms``) as far as a diff sizes its reads
    by it: its shape and dtype (an h5py dataset, a part the reader computes, a set's merged view)."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def dtype(self) -> np.dtype[Any]: ...


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
    """One side of a diff: its token table, its tensors, and reads of their rows.

    Rows are read in stored form (bf16 as bits) by :meth:`read_at` at any row indices, or as runs
    by :meth:`read_values` / :meth:`read_sketch` / :meth:`read_rms`. :meth:`segments` says which
    file holds rows (worker processes open only those), :meth:`replica_tasks` which rows it holds
    twice (compared bit for bit, anywhere), :meth:`replica_mismatches` what those comparisons mean."""

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

    @property
    def hosts(self) -> tuple[str, ...]:
        """The hosts its files record having been written on, where a set records them (placement)."""
        ...

    def token_rows(self, name: str) -> NDArray[np.int64]: ...

    def dataset(self, name: str, part: str) -> Part:
        """A part of a tensor (raises :class:`~tensordiff.errors.TraceFileError` when it has none)."""
        ...

    def has_part(self, name: str, part: str) -> bool: ...

    def read_at(self, name: str, part: str, idx: np.ndarray, out: np.ndarray | None = None) -> np.ndarray: ...

    def map_rows(self, name: str, part: str, idx: np.ndarray) -> np.ndarray | Pieces | None:
        """A run of rows in place in the file's pages, read-only, or None: read them
        (:meth:`tensordiff.trace.reads.RowReads.map_rows`)."""
        ...

    def read_values(self, name: str, start: int = 0, stop: int | None = None, *, raw: bool = False) -> np.ndarray: ...

    def read_values_at(self, name: str, idx: np.ndarray, *, raw: bool = False,
                       out: np.ndarray | None = None) -> np.ndarray: ...

    def read_sketch(self, name: str, start: int = 0, stop: int | None = None) -> np.ndarray: ...

    def read_rms(self, name: str, start: int = 0, stop: int | None = None) -> np.ndarray: ...

    def segments(self, name: str, rows: NDArray[np.int64]) -> list[RowSegment]:
        """Where tensor rows ``rows`` live, one segment per file that holds some of them."""
        ...

    def replica_tasks(self) -> list[ReplicaTask]: ...

    def replica_mismatches(self, partials: Sequence[ReplicaPartial]) -> list[ReplicaMismatch]: ...

    def check_replicas(self, progress: Progress | None = None) -> list[ReplicaMismatch]:
        """Every replica comparison, in this process."""
        ...

    def summary(self) -> TraceSummary:
        """Everything ``tensordiff info`` shows, as plain data."""
        ...

    def close(self) -> None: ...

    def __enter__(self) -> Self: ...

    def __exit__(self, *exc: object) -> None: ...


__all__ = ["Part", "ReplicaMismatch", "ReplicaPartial", "ReplicaTask", "RowSegment", "TraceSource"]
