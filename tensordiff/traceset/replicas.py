"""The replica comparison: replicated rows (:mod:`.join`) compared bit for bit with the rows the
set reads, in picklable pieces that a worker pool or Ray can run (:func:`compare_replica_rows`),
merged into one :class:`ReplicaMismatch` per (tensor, replica file) that differs."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np

from ..dtypes import to_float32
from ..tokens import POS_MASK, SEQ_BITS
from ..trace import TraceReader
from ..trace.source import ReplicaMismatch, ReplicaPartial, ReplicaTask
from ..vocab import REGIMES
from .join import VirtualTensor
from .members import Member

REPLICA_BLOCK_ROWS = 4096

__all__ = ["REPLICA_BLOCK_ROWS", "ReplicaMismatch", "ReplicaPartial", "ReplicaTask", "compare_replica_rows",
           "replica_mismatches", "replica_tasks"]


def compare_replica_rows(task: ReplicaTask, open_reader: Callable[[str], TraceReader]) -> ReplicaPartial:
    """Compare the stored bits of replicated rows; the size of any difference in float32."""
    rp, rr = open_reader(task.primary), open_reader(task.replica)
    differing, first, max_abs, cos_min = 0, -1, 0.0, 1.0
    n = len(task.rows_primary)
    for s0 in range(0, n, REPLICA_BLOCK_ROWS):
        ip = task.rows_primary[s0:s0 + REPLICA_BLOCK_ROWS]
        ir = task.rows_replica[s0:s0 + REPLICA_BLOCK_ROWS]
        a = np.ascontiguousarray(rp.read_at(task.tensor, task.part, ip))
        b = np.ascontiguousarray(rr.read_at(task.tensor, task.part, ir))
        uint = np.dtype(f"u{a.dtype.itemsize}")
        bad = (a.view(uint) != b.view(uint)).reshape(len(a), -1).any(axis=1)
        if not bad.any():
            continue
        if first < 0:
            first = task.start + s0 + int(np.argmax(bad))
        differing += int(bad.sum())
        if task.part == "values":
            fa, fb = to_float32(a[bad], task.dtype), to_float32(b[bad], task.dtype)
        else:
            fa, fb = np.asarray(a[bad], np.float32), np.asarray(b[bad], np.float32)
        with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
            d = np.abs(fa.astype(np.float64) - fb.astype(np.float64))
            fin = np.isfinite(d)
            if fin.any():
                max_abs = max(max_abs, float(d[fin].max()))
            num = np.einsum("ij,ij->i", fa.astype(np.float64), fb.astype(np.float64))
            den = np.sqrt(np.einsum("ij,ij->i", fa.astype(np.float64), fa.astype(np.float64))
                          * np.einsum("ij,ij->i", fb.astype(np.float64), fb.astype(np.float64)))
            cos = np.where(den > 0, num / np.where(den > 0, den, 1.0), np.where(num == 0, 1.0, 0.0))
            cos = np.where(np.isfinite(cos), cos, -1.0)
        cos_min = min(cos_min, float(cos.min()))
    return ReplicaPartial(task.tensor, task.group, n, differing, first, max_abs, cos_min)


def replica_tasks(members: Sequence[Member], vts: Mapping[str, VirtualTensor],
                  block_rows: int = 1 << 16) -> list[ReplicaTask]:
    """The replica comparisons, in pieces of at most ``block_rows`` rows (for worker pools)."""
    tasks = []
    for name, vt in vts.items():
        info = vt.info
        part = "values" if info.has_values else "sketch"
        for g, rp in enumerate(vt.replicated):
            n = len(rp.rows_primary)
            for s0 in range(0, n, block_rows):
                tasks.append(ReplicaTask(name, g, part, info.dtype, members[rp.primary].path,
                                         members[rp.replica].path, rp.rows_primary[s0:s0 + block_rows],
                                         rp.rows_replica[s0:s0 + block_rows], s0,
                                         members[rp.replica].host))
    return tasks


def replica_mismatches(members: Sequence[Member], vts: Mapping[str, VirtualTensor], sequences: Sequence[str],
                       partials: Sequence[ReplicaPartial]) -> list[ReplicaMismatch]:
    """Merge partial comparisons (in any order) into one mismatch per (tensor, replica file)
    whose rows are not all bit-identical to the primary's, in forward order."""
    groups: dict[tuple[str, int], list[ReplicaPartial]] = {}
    for p in partials:
        groups.setdefault((p.tensor, p.group), []).append(p)
    out: list[ReplicaMismatch] = []
    for (name, g), mine in groups.items():
        differing = sum(p.differing for p in mine)
        if not differing:
            continue
        vt = vts[name]
        rp = vt.replicated[g]
        first = min(p.first for p in mine if p.first >= 0)
        code = int(rp.codes[first])
        m = members[rp.replica]
        tok = m.reader.tokens
        trow = int(m.reader.token_rows(name)[int(rp.rows_replica[first])])
        out.append(ReplicaMismatch(
            tensor=name, order=vt.info.order, axis=rp.axis, primary=members[rp.primary].path,
            replica=m.path, part="values" if vt.info.has_values else "sketch",
            rows=sum(p.rows for p in mine), differing=differing, seq=sequences[code >> SEQ_BITS],
            position=code & POS_MASK, token=int(tok["token"][trow]), regime=REGIMES[int(tok["regime"][trow])],
            max_abs=max(p.max_abs for p in mine), cos_min=min(p.cos_min for p in mine)))
    out.sort(key=lambda x: (x.order, x.tensor, x.replica))
    return out
