"""Copy a recorded trace with a bug injected into it: the sensitivity benchmark's (bench_sensitivity.py)
way of putting an error of known size into a trace a real recorder wrote. Not a benchmark itself.

:func:`copy_trace` reads every token row and tensor of a trace with the real reader and writes them
again with the real writer, in the same row order (so row indices stay valid), after ``edit`` had
its say on each tensor's values. Values by reference are written as plain values. A tensor that
keeps values gets its sketch and RMS computed by the writer from the (edited) values; a sketch-only
tensor keeps its stored sketch and RMS. ``duplicates`` adds a second token row for some tokens, at
the end of the token table, with rows of the given tensors: what a recorder that writes one token
twice leaves behind.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import h5py  # type: ignore[import-untyped, unused-ignore]
import numpy as np

from tensordiff.dtypes import f32_to_bf16_bits, storage_dtype, to_float32
from tensordiff.trace import SlotSpec, TraceReader, TraceWriter
from tensordiff.vocab import REGIMES

# root attributes the writer sets itself; every other one of the source is copied as it is
_WRITER_ATTRS = {"tensordiff_schema", "side", "producer", "created", "model", "versions", "user_meta",
                 "sketch_seed", "sketch_dim", "complete", "flushed_tokens"}

Edit = Callable[[str, np.ndarray, np.ndarray], "np.ndarray | None"]


@dataclass
class Duplicates:
    """Second rows for the token rows ``token_rows`` (indices in the source's token table): each
    gets a new token row (same sequence, position, token, regime) and, for every tensor in
    ``values``, the row given there (float32, one per token row, in order)."""

    token_rows: np.ndarray
    values: dict[str, np.ndarray] = field(default_factory=dict)


def as_float(stored: np.ndarray, dtype: str) -> np.ndarray:
    return np.array(to_float32(stored, dtype), dtype=np.float32, copy=True)


def as_stored(x: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        return f32_to_bf16_bits(x)
    return np.ascontiguousarray(x).astype(storage_dtype(dtype))


def read_state(path: str, name: str) -> tuple[np.ndarray, np.ndarray, TraceReader]:
    """(token rows, float32 values) of tensor ``name`` and the open reader (the caller closes it)."""
    r = TraceReader(path)
    info = r.tensors[name]
    return r.token_rows(name).copy(), as_float(r.read_values(name, raw=True), info.dtype), r


def copy_trace(src: str, dst: str, edit: Edit | None = None, duplicates: Duplicates | None = None) -> None:
    """Write ``dst``: ``src`` with ``edit(name, token_rows, float32 values)`` applied to each tensor
    that keeps values (it returns new float32 values, or None to keep them) and ``duplicates`` added."""
    with TraceReader(src) as r:
        extra = {k: r.f.attrs[k] for k in r.f.attrs if k not in _WRITER_ATTRS}
        w = TraceWriter(dst, side=r.side, producer=r.producer, model=r.model, meta=r.user_meta,
                        sketch_dim=r.sketch_dim, sketch_seed=r.sketch_seed, versions=r.versions,
                        flush_rows=None, flush_seconds=None)
        try:
            for k, v in extra.items():
                w.f.attrs[k] = v
            infos = sorted(r.tensors.values(), key=lambda i: i.order)
            for info in infos:
                slots = (SlotSpec(list(info.slot_labels), raw_ids=info.raw_ids, convention=info.convention)
                         if info.kind == "packed" and info.slot_labels else None)
                w.define_tensor(info.name, info.width, kind=info.kind, dtype=info.dtype, boundary=info.boundary,
                                slots=slots, slot_width=info.slot_width, order=info.order,
                                token_offset=info.token_offset, role=info.role, values=info.has_values,
                                sketch=info.stored_sketch or not info.has_values, attrs=info.attrs)
            tok = r.tokens[()]
            n = len(tok)
            if n:
                # one add_tokens per run of rows of one sequence, regime and step, in file order
                key = np.stack([tok["seq"].astype(np.int64), tok["regime"].astype(np.int64),
                                tok["step"].astype(np.int64)], 1)
                cut = np.flatnonzero((key[1:] != key[:-1]).any(1)) + 1
                for lo, hi in zip(np.r_[0, cut], np.r_[cut, n]):
                    t0 = tok[lo]
                    w.add_tokens(r.sequences[int(t0["seq"])], tok["position"][lo:hi].astype(np.int64),
                                 tok["token"][lo:hi].astype(np.int64), REGIMES[int(t0["regime"])], int(t0["step"]))
            dup_rows = np.empty(0, np.int64)
            if duplicates is not None and len(duplicates.token_rows):
                dup_rows = np.empty(len(duplicates.token_rows), np.int64)
                for i, t in enumerate(np.asarray(duplicates.token_rows, np.int64)):
                    row = tok[t]
                    dup_rows[i] = w.add_tokens(r.sequences[int(row["seq"])], np.array([row["position"]], np.int64),
                                               np.array([row["token"]], np.int64), REGIMES[int(row["regime"])],
                                               int(row["step"]))[0]
            for info in infos:
                rows = r.token_rows(info.name).copy()
                if not info.has_values:
                    if len(rows):
                        w.append(info.name, rows, sketch=r.read_sketch(info.name), rms=r.read_rms(info.name))
                    continue
                stored = r.read_values(info.name, raw=True)
                if edit is not None and info.dtype != "float64":
                    new = edit(info.name, rows, as_float(stored, info.dtype))
                    if new is not None:
                        stored = as_stored(new, info.dtype)
                if len(rows):
                    w.append(info.name, rows, np.ascontiguousarray(stored))
                if duplicates is not None and info.name in duplicates.values and len(dup_rows):
                    w.append(info.name, dup_rows, as_stored(duplicates.values[info.name], info.dtype))
        except BaseException:
            w.close()
            raise
        w.close()


def root_attrs(path: str) -> dict[str, object]:
    with h5py.File(path, "r") as f:
        return dict(f.attrs)
