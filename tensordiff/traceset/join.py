"""The PP join and replica detection: each tensor of a set as segments of member rows.

Members that hold a tensor are taken in member order (DP rank, PP stage, TP rank). Within one
token shard, a row for a (sequence, position) that a lower-ranked member already holds is a
*replica*: it is left out of the set's rows (a :class:`Segment` then selects the member's other
rows) and recorded as :class:`Replicated` for the comparison in :mod:`.replicas` (axis ``tp``
for TP ranks of one stage, ``pp`` for a tensor two PP stages both recorded)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import IncompatibleTracesError
from ..trace import TensorInfo
from .members import Member
from .union import last_per_code

# tensor attributes that every member holding a tensor must agree on
_INFO_KEYS = ("kind", "dtype", "width", "slot_count", "slot_width", "slot_labels", "raw_ids", "convention",
              "boundary", "token_offset", "role", "has_values", "has_sketch", "order")


@dataclass
class Segment:
    """Consecutive set rows of a tensor that one member holds."""

    member: int
    start: int                      # first virtual row of this segment
    rows: int
    sel: np.ndarray | None          # member rows (None: all of them, in order)

    def member_rows(self, local: np.ndarray) -> np.ndarray:
        return local if self.sel is None else self.sel[local]


@dataclass
class Replicated:
    """Rows of a tensor a member holds twice over a lower-ranked one of its shard (the primary)."""

    primary: int
    replica: int
    axis: str
    rows_primary: np.ndarray
    rows_replica: np.ndarray
    codes: np.ndarray               # set code of each replicated row (for the first mismatch)


@dataclass
class PartShape:
    """Shape and dtype of a tensor part across the set."""

    shape: tuple[int, ...]
    dtype: np.dtype[Any]


class VirtualTensor:
    """One tensor of the set: its merged info, where its rows live, its replicas, its part shapes."""

    def __init__(self, info: TensorInfo, segments: list[Segment], replicated: list[Replicated],
                 parts: dict[str, PartShape]):
        self.info = info
        self.segments = segments
        self.starts = np.array([s.start for s in segments], np.int64)
        self.replicated = replicated
        self.parts = parts


def merge_tensors(members: Sequence[Member], path: str
                  ) -> tuple[dict[str, TensorInfo], dict[str, VirtualTensor], dict[str, dict[str, PartShape]]]:
    """Every tensor of the set: its merged info, its view (segments, replicas) and part shapes."""
    names: dict[str, list[Member]] = {}
    for m in members:
        for name in m.reader.tensors:
            names.setdefault(name, []).append(m)
    tensors: dict[str, TensorInfo] = {}
    vts: dict[str, VirtualTensor] = {}
    ds: dict[str, dict[str, PartShape]] = {}
    for name, holders in names.items():
        vt = virtual_tensor(name, holders, members, path)
        vts[name] = vt
        tensors[name] = vt.info
        ds[name] = vt.parts
    return tensors, vts, ds


def virtual_tensor(name: str, holders: list[Member], members: Sequence[Member], path: str) -> VirtualTensor:
    """The set's view of tensor ``name``, held by ``holders`` (in member order)."""
    first = holders[0]
    i0 = first.reader.tensors[name]
    for m in holders[1:]:
        i = m.reader.tensors[name]
        for key in _INFO_KEYS:
            va, vb = getattr(i0, key), getattr(i, key)
            if va != vb:
                raise IncompatibleTracesError(f"tensor {name!r} differs between {first.name} and {m.name} ({key} "
                                              f"{va!r} vs {vb!r}): not one recording", path)
    segments: list[Segment] = []
    replicated: list[Replicated] = []
    # per shard: codes already held (sorted) and where the primary row of each lives
    held: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
    start = 0
    for m in holders:
        r = m.reader
        trow = r.token_rows(name)
        codes = m.codes[trow] if len(trow) else np.zeros(0, np.int64)
        prev = held.get(m.shard)
        sel: np.ndarray | None = None
        if prev is not None and len(codes):
            pc, pm, pr = prev
            pos = np.searchsorted(pc, codes)
            pos_c = np.minimum(pos, max(len(pc) - 1, 0))
            dup = (pc[pos_c] == codes) if len(pc) else np.zeros(len(codes), bool)
            if dup.any():
                # the replica's last row per code against the primary's last row per code
                dup_idx = np.flatnonzero(dup)
                uc, last = last_per_code(codes[dup_idx])
                rep_rows = dup_idx[last]
                ppos = np.searchsorted(pc, uc)
                prim_members, prim_rows = pm[ppos], pr[ppos]
                for pmi in np.unique(prim_members):
                    s = prim_members == pmi
                    pmem = members[int(pmi)]
                    axis = "tp" if pmem.ranks.get("pp", 0) == m.ranks.get("pp", 0) else "pp"
                    replicated.append(Replicated(int(pmi), m.index, axis, prim_rows[s], rep_rows[s], uc[s]))
                sel = np.flatnonzero(~dup)
        n = len(codes) if sel is None else len(sel)
        if n:
            segments.append(Segment(m.index, start, n, sel))
            start += n
        # what this member now holds for its shard
        mine = codes if sel is None else codes[sel]
        mine_rows = np.arange(len(codes), dtype=np.int64) if sel is None else sel
        if len(mine):
            uc, last = last_per_code(mine)
            new = (uc, np.full(len(uc), m.index, np.int64), mine_rows[last])
            if prev is None:
                held[m.shard] = new
            else:
                c = np.concatenate([prev[0], new[0]])
                order = np.argsort(c, kind="stable")
                held[m.shard] = (c[order], np.concatenate([prev[1], new[1]])[order],
                                 np.concatenate([prev[2], new[2]])[order])
    # a sketch stored by some members and derived from the values by others reads alike; the set's
    # is derived (not all stored) when any member derives it
    derived = any(m.reader.tensors[name].sketch_derived for m in holders)
    # likewise values by reference: the members' reads resolve them; the set names a source if any does
    source = next((m.reader.tensors[name].values_source for m in holders if m.reader.tensors[name].values_source), None)
    info = dataclasses.replace(i0, rows=start, sketch_derived=derived, values_source=source)
    parts: dict[str, PartShape] = {}
    for part in ("values", "sketch", "rms"):
        if all(m.reader.has_part(name, part) for m in holders):
            p0 = holders[0].reader.part(name, part)
            parts[part] = PartShape((start,) + tuple(p0.shape[1:]), p0.dtype)
    parts["rows"] = PartShape((start,), np.dtype(np.int64))
    return VirtualTensor(info, segments, replicated, parts)

