"""The set reader: :class:`TraceSet`, many trace files with the reader interface of one.

It opens the members (:mod:`.members`), unites their token tables (:mod:`.union`), joins their
tensors (:mod:`.join`) and delegates every read of set rows to the members that hold them; the
replica comparison is :mod:`.replicas`, the ``info`` index :mod:`.index`."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ..dtypes import to_float32
from ..errors import IncompatibleTracesError, UsageError
from ..progress import Progress, Stage
from ..trace import Pieces, RowSegment, TraceReader, TraceSource, slot_rms, trace_summary
from ..trace.source import TensorPart
from .index import set_index
from .join import PartShape, merge_tensors
from .members import Member, check_headers, check_layout, check_meta_ranks, host_of
from .paths import is_set_spec, member_sort_key, parse_ranks, set_paths
from .replicas import ReplicaMismatch, ReplicaPartial, ReplicaTask, compare_replica_rows, replica_mismatches, replica_tasks
from .union import merge_tokens

if TYPE_CHECKING:
    from typing_extensions import Self

    from ..trace.summary_types import TraceSummary


def open_trace(spec: str) -> TraceSource:
    """A :class:`TraceReader` for a file, a :class:`TraceSet` for a directory or a glob: either
    is a :class:`~tensordiff.trace.TraceSource`."""
    if is_set_spec(spec):
        return TraceSet(spec)
    return TraceReader(spec)


class TraceSet:
    """Many trace files read as one trace; see the package docstring for how they combine."""

    def __init__(self, spec: str | Sequence[str]):
        if isinstance(spec, (str, os.PathLike)):
            self.path = os.fspath(spec)
            paths = set_paths(self.path)
        else:
            paths = sorted((os.fspath(p) for p in spec), key=member_sort_key)
            if not paths:
                raise UsageError("an empty trace set (no files given)")
            self.path = os.path.commonpath(paths) if len(paths) > 1 else paths[0]
        self.members: list[Member] = []
        try:
            for i, p in enumerate(paths):
                base, ranks = parse_ranks(p)
                r = TraceReader(p)
                self.members.append(Member(i, p, r, ranks, shard="", host=host_of(r)))
                check_meta_ranks(self.members[-1])
                self.members[-1].shard = base + (f".dp{ranks['dp']}" if "dp" in ranks else "")
            check_headers(self.members, self.path)
            check_layout(self.members, self.path)
            self.sequences, self.tokens = merge_tokens(self.members, self.path)
            self.tensors, self._vt, self._ds = merge_tensors(self.members, self.path)
        except BaseException:
            self.close()
            raise
        self._rows_cache: dict[str, np.ndarray] = {}
        self._replica_result: list[ReplicaMismatch] | None = None

    # -- the reader interface ------------------------------------------------------------------

    @property
    def _r0(self) -> TraceReader:
        return self.members[0].reader

    @property
    def side(self) -> str:
        return self._r0.side

    @property
    def schema(self) -> int:
        return int(self._r0.schema)

    @property
    def sketch_seed(self) -> int:
        return int(self._r0.sketch_seed)

    @property
    def sketch_dim(self) -> int:
        return int(self._r0.sketch_dim)

    @property
    def model(self) -> dict[str, Any]:
        return dict(self._r0.model)

    @property
    def versions(self) -> dict[str, Any]:
        return dict(self._r0.versions)

    @property
    def user_meta(self) -> dict[str, Any]:
        """The metadata every member agrees on (rank facts and hosts differ: they are in the index)."""
        common = dict(self._r0.user_meta)
        for m in self.members[1:]:
            um = m.reader.user_meta
            common = {k: v for k, v in common.items() if k in um and um[k] == v}
        return common

    @property
    def producer(self) -> str:
        return "; ".join(dict.fromkeys(m.reader.producer for m in self.members if m.reader.producer))

    @property
    def created(self) -> str:
        c = [m.reader.created for m in self.members if m.reader.created]
        return min(c) if c else ""

    @property
    def complete(self) -> bool:
        return all(m.reader.complete for m in self.members)

    @property
    def recovered_note(self) -> str | None:
        notes = [(m, m.reader.recovered_note) for m in self.members if m.reader.recovered_note]
        if not notes:
            return None
        return (f"{len(notes)} of {len(self.members)} files were not closed cleanly: "
                + "; ".join(f"{m.name}: {n}" for m, n in notes))

    @property
    def file_size(self) -> int:
        return sum(int(m.reader.file_size) for m in self.members)

    @property
    def hidden_size(self) -> int | None:
        return self._r0.hidden_size

    @property
    def num_layers(self) -> int | None:
        return self._r0.num_layers

    def token_rows(self, name: str) -> np.ndarray:
        """Set token-table row of every (set) row of tensor ``name``."""
        rows = self._rows_cache.get(name)
        if rows is None:
            vt = self._vt[name]
            parts = []
            for seg in vt.segments:
                m = self.members[seg.member]
                tr = m.reader.token_rows(name)
                parts.append((tr if seg.sel is None else tr[seg.sel]) + m.tok_offset)
            rows = np.concatenate(parts) if parts else np.zeros(0, np.int64)
            self._rows_cache[name] = rows
        return rows

    @property
    def hosts(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(m.host for m in self.members if m.host))

    def segments(self, name: str, rows: np.ndarray) -> list[RowSegment]:
        """Where set rows ``rows`` of ``name`` live, one segment per member file that holds some."""
        out = []
        for mi, pos, mrows in self.locate(name, rows):
            m = self.members[mi]
            out.append(RowSegment(m.path, mrows, None if len(pos) == len(rows) else pos, m.host))
        return out

    def part(self, name: str, kind: str) -> TensorPart:
        """Part ``kind`` of ``name`` across the set: its merged shape and dtype, read through the
        members that hold its rows."""
        got: PartShape | None = self._ds.get(name, {}).get(kind)
        if got is None or kind == "rows":
            raise IncompatibleTracesError(f"tensor {name!r} has no {kind}", self.path)
        return TensorPart(name, kind, got.shape, got.dtype, self)

    def locate(self, name: str, idx: np.ndarray) -> list[tuple[int, np.ndarray, np.ndarray]]:
        """Where set rows ``idx`` of ``name`` live: (member index, positions in ``idx``, member rows),
        one entry per member, positions ascending."""
        vt = self._vt[name]
        idx = np.asarray(idx, dtype=np.int64)
        if len(idx) == 0:
            return []
        if len(idx) and (idx.min() < 0 or idx.max() >= vt.info.rows):
            raise IndexError(f"rows of {name} out of range")
        seg_of = np.searchsorted(vt.starts, idx, side="right") - 1
        if (seg_of == seg_of[0]).all():
            seg = vt.segments[int(seg_of[0])]
            return [(seg.member, np.arange(len(idx)), seg.member_rows(idx - seg.start))]
        out: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {}
        for si in np.unique(seg_of):
            seg = vt.segments[int(si)]
            pos = np.flatnonzero(seg_of == si)
            out.setdefault(seg.member, []).append((pos, seg.member_rows(idx[pos] - seg.start)))
        res = []
        for mi, lst in out.items():
            pos = np.concatenate([p for p, _ in lst])
            rows = np.concatenate([r for _, r in lst])
            order = np.argsort(pos, kind="stable")
            res.append((mi, pos[order], rows[order]))
        return res

    def map_rows(self, name: str, part: str, idx: np.ndarray) -> np.ndarray | Pieces | None:
        """Rows of one member in place (:meth:`TraceSource.map_rows`); None when they span members."""
        if self._ds[name].get(part) is None or part == "rows":
            raise IncompatibleTracesError(f"tensor {name!r} has no {part}", self.path)
        where = self.locate(name, np.asarray(idx, dtype=np.int64))
        if len(where) != 1 or not np.all(np.diff(where[0][1]) > 0):
            return None
        mi, _, rows = where[0]
        return self.members[mi].reader.map_rows(name, part, rows)

    def read_at(self, name: str, part: str, idx: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """Rows of ``name/part`` at set row indices (any order, repeats allowed), stored form;
        each member reads its own rows."""
        shape = self._ds[name].get(part)
        if shape is None or part == "rows":
            raise IncompatibleTracesError(f"tensor {name!r} has no {part}", self.path)
        idx = np.asarray(idx, dtype=np.int64)
        where = self.locate(name, idx)
        if len(where) == 1:
            mi, _, rows = where[0]
            return self.members[mi].reader.read_at(name, part, rows, out=out)
        n = len(idx)
        tail = tuple(shape.shape[1:])
        if out is not None and out.dtype == shape.dtype and out.size >= n * int(np.prod(tail, dtype=np.int64)):
            dest = out.reshape(-1)[:n * int(np.prod(tail, dtype=np.int64))].reshape((n,) + tail)
        else:
            dest = np.empty((n,) + tail, shape.dtype)
        for mi, pos, rows in where:
            dest[pos] = self.members[mi].reader.read_at(name, part, rows)
        return dest

    def read_range(self, name: str, part: str, lo: int, hi: int, out: np.ndarray | None = None) -> np.ndarray:
        """Set rows [lo, hi) of ``name/part``, stored form (each member reads its own)."""
        return self.read_at(name, part, np.arange(lo, max(lo, hi), dtype=np.int64), out=out)

    def read_values_at(self, name: str, idx: np.ndarray, *, raw: bool = False,
                       out: np.ndarray | None = None) -> np.ndarray:
        block = self.read_at(name, "values", idx)
        return block if raw else to_float32(block, self.tensors[name].dtype, out)

    def _range(self, name: str, start: int, stop: int | None) -> np.ndarray:
        n = self.tensors[name].rows
        lo, hi, _ = slice(start, stop).indices(n)
        return np.arange(lo, max(lo, hi), dtype=np.int64)

    def read_values(self, name: str, start: int = 0, stop: int | None = None, *, raw: bool = False) -> np.ndarray:
        return self.read_values_at(name, self._range(name, start, stop), raw=raw)

    def read_sketch(self, name: str, start: int = 0, stop: int | None = None) -> np.ndarray:
        return np.asarray(self.read_at(name, "sketch", self._range(name, start, stop)), dtype=np.float32)

    def read_rms(self, name: str, start: int = 0, stop: int | None = None) -> np.ndarray:
        if "rms" not in self._ds[name]:
            return slot_rms(self.read_values(name, start, stop), self.tensors[name].slot_width)
        return np.asarray(self.read_at(name, "rms", self._range(name, start, stop)), dtype=np.float32)

    def has_part(self, name: str, part: str) -> bool:
        return part in self._ds.get(name, {})

    def touch(self) -> None:
        for m in self.members:
            m.reader.touch()

    def close(self) -> None:
        for m in self.members:
            m.reader.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- replicas ------------------------------------------------------------------------------

    @property
    def replicated_rows(self) -> int:
        return sum(len(rp.rows_primary) for vt in self._vt.values() for rp in vt.replicated)

    def replica_tasks(self, block_rows: int = 1 << 16) -> list[ReplicaTask]:
        """The replica comparisons, in pieces of at most ``block_rows`` rows (for worker pools)."""
        return replica_tasks(self.members, self._vt, block_rows)

    def replica_mismatches(self, partials: Sequence[ReplicaPartial]) -> list[ReplicaMismatch]:
        """Merge partial comparisons (in any order) into one mismatch per (tensor, replica file)
        whose rows are not all bit-identical to the primary's, in forward order."""
        return replica_mismatches(self.members, self._vt, self.sequences, partials)

    def check_replicas(self, progress: Progress | None = None) -> list[ReplicaMismatch]:
        """Compare every replicated row (serially, in this process); cached."""
        if self._replica_result is None:
            readers = {m.path: m.reader for m in self.members}
            tasks = self.replica_tasks()
            partials = []
            for i, t in enumerate(tasks):
                if progress is not None:
                    progress(Stage.CHECKING_REPLICAS, i, len(tasks))
                partials.append(compare_replica_rows(t, readers.__getitem__))
            self._replica_result = self.replica_mismatches(partials)
        return self._replica_result

    # -- index and summary ---------------------------------------------------------------------

    def index(self) -> dict[str, Any]:
        """Which file holds which sequences, tensors, ranks, and the host that wrote it."""
        return set_index(self.members, self._vt, self.tokens)

    def summary(self) -> TraceSummary:
        """What ``tensordiff info`` shows: the reader's summary of the merged trace plus the index."""
        return {**trace_summary(self), "set": self.index()}
