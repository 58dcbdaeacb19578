"""Per-token metric summaries of a diff, streamed to an HDF5 side file.

The TUI's heatmap reads them in blocks, so its memory does not grow with the trace. Layout::

    attrs              schema_version, a, b, side_a, side_b
    /tokens            [n] compound: seq_a, pos_a, seq_b, pos_b, token, regime_a, regime_b
    /sequences_a, /sequences_b   sequence keys
    /columns/<j>       [n, 4] f4: cos, rel, maxabs, flags (bit 0: fails tolerance, bit 1: NaN/Inf);
                       NaN where the tensor has no row for that token. attrs: tensor_a, tensor_b,
                       slot, label, order
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

import h5py
import numpy as np

from .errors import TraceFileError
from .safety import parse_json
from .tokens import code_position, code_seq

if TYPE_CHECKING:  # pragma: no cover
    from .align import TokenAlignment
    from .numerics import Metrics
    from .trace import TensorInfo, TraceSource

#: version of the summary file layout (the ``schema_version`` attribute of its root)
SUMMARY_VERSION = 1
ALIGNED_DTYPE = np.dtype([("seq_a", "<i4"), ("pos_a", "<i8"), ("seq_b", "<i4"), ("pos_b", "<i8"),
                          ("token", "<i8"), ("regime_a", "u1"), ("regime_b", "u1")])
COLUMN_FIELDS = ("cos", "rel", "maxabs", "flags")
FLAG_BAD, FLAG_NONFINITE = 1, 2


def column_label(ia: TensorInfo, slot: int, k: int) -> str:
    """The label of the summary column of slot ``slot`` of a pair compared on ``k`` slots."""
    return ia.label if k == 1 and ia.kind != "packed" else f"{ia.name}[{slot}]"


class SummaryWriter:
    """A :class:`tensordiff.diff.DiffSink`: the diff hands it every compared block."""

    def __init__(self, path: str, al: TokenAlignment, ra: TraceSource, rb: TraceSource):
        self.f = h5py.File(path, "w")
        self.n = len(al)
        tok = np.empty(self.n, ALIGNED_DTYPE)
        tok["seq_a"] = code_seq(al.code_a)
        tok["pos_a"] = code_position(al.code_a)
        tok["seq_b"] = code_seq(al.code_b)
        tok["pos_b"] = code_position(al.code_b)
        tok["token"] = al.token
        tok["regime_a"] = al.regime_a
        tok["regime_b"] = al.regime_b
        self.f.create_dataset("tokens", data=tok, chunks=(min(max(self.n, 1), 65536),))
        st = h5py.string_dtype("utf-8")
        self.f.create_dataset("sequences_a", data=np.array(ra.sequences, dtype=object), dtype=st)
        self.f.create_dataset("sequences_b", data=np.array(rb.sequences, dtype=object), dtype=st)
        self.f.attrs["schema_version"] = SUMMARY_VERSION
        self.f.attrs["a"] = ra.path
        self.f.attrs["b"] = rb.path
        self.f.attrs["side_a"] = ra.side
        self.f.attrs["side_b"] = rb.side
        self.cols = self.f.create_group("columns")
        self._col: dict[tuple[str, int], h5py.Dataset] = {}

    def _column(self, ia: TensorInfo, ib: TensorInfo, slot: int, k: int) -> h5py.Dataset:
        key = (ia.name, slot)
        ds = self._col.get(key)
        if ds is None:
            j = len(self._col)
            ds = self.cols.create_dataset(str(j), shape=(self.n, 4), dtype="<f4", chunks=(min(max(self.n, 1), 8192), 4),
                                          fillvalue=np.nan)
            ds.attrs.update({"tensor_a": ia.name, "tensor_b": ib.name, "slot": slot, "label": column_label(ia, slot, k),
                             "order": ia.order, "slot_label": json.dumps(ia.slot_labels[slot] if ia.slot_labels else None)})
            self._col[key] = ds
        return ds

    def write(self, ia: TensorInfo, ib: TensorInfo, k: int, blk: np.ndarray, m: Metrics, bad: np.ndarray) -> None:
        lo, hi = int(blk[0]), int(blk[-1]) + 1
        dense = hi - lo == len(blk)
        for s in range(k):
            ds = self._column(ia, ib, s, k)
            vals = np.empty((len(blk), 4), np.float32)
            vals[:, 0] = m.cos[:, s]
            vals[:, 1] = m.rel[:, s]
            vals[:, 2] = m.maxabs[:, s]
            vals[:, 3] = bad[:, s] * FLAG_BAD + m.nonfinite[:, s] * FLAG_NONFINITE
            if dense:
                ds[lo:hi] = vals
            else:
                full = ds[lo:hi]
                full[blk - lo] = vals
                ds[lo:hi] = full

    def close(self) -> None:
        self.f.close()


class SummaryReader:
    """Block reads of a summary file (the TUI's data source)."""

    def __init__(self, path: str):
        try:
            self.f = h5py.File(path, "r", locking=False)
            version = int(self.f.attrs.get("schema_version", SUMMARY_VERSION))
            if version > SUMMARY_VERSION:
                self.f.close()
                raise TraceFileError(f"diff summary schema_version {version} is newer than this tensordiff "
                                     f"reads ({SUMMARY_VERSION})", path)
            self.tokens_ds = self.f["tokens"]
            self.seq_a = list(self.f["sequences_a"].asstr()[()])
            self.seq_b = list(self.f["sequences_b"].asstr()[()])
            cols = self.f["columns"]
            self.columns = [cols[str(j)] for j in range(len(cols))]
        except (OSError, KeyError, ValueError, TypeError) as e:
            raise TraceFileError(f"not a tensordiff diff summary ({e})", path) from None
        self.n = self.tokens_ds.shape[0]
        self.labels = [str(c.attrs["label"]) for c in self.columns]

    def tokens(self, start: int, stop: int) -> np.ndarray:
        rows: np.ndarray = self.tokens_ds[start:stop]
        return rows

    def block(self, start: int, stop: int, metric: int = 1) -> np.ndarray:
        """[stop-start, n_columns] of one metric (0 cos, 1 rel, 2 maxabs, 3 flags)."""
        out = np.empty((max(0, min(stop, self.n) - start), len(self.columns)), np.float32)
        for j, c in enumerate(self.columns):
            out[:, j] = c[start:stop, metric]
        return out

    def cell(self, row: int, col: int) -> np.ndarray:
        got: np.ndarray = self.columns[col][row]
        return got

    def close(self) -> None:
        self.f.close()


# ----------------------------------------------------------------------------------------------
# The columns of a summary, in forward order (the TUI's heatmap and the HTML report's image)
# ----------------------------------------------------------------------------------------------


@dataclass
class Column:
    index: int            # column of the summary file
    label: str            # embed, layer3, draft_input[0]...
    tensor_a: str
    tensor_b: str
    slot: int
    order: float
    slot_label: str | None
    packed: bool

    @property
    def short(self) -> str:
        if self.packed:
            return f"[{self.slot}]"
        return short_label(self.label)

    def matches(self, tensor: str | None, slot: int | None) -> bool:
        if tensor is None or tensor not in (self.tensor_a, self.tensor_b):
            return False
        return (slot or 0) == self.slot


#: the heatmap's three-character column labels of the states that are not layers
SHORT_LABELS = {"embed": "emb", "final_norm": "nrm", "draft_fc_output": "fc", "draft_hidden": "dh",
                "target_topk": "tgt", "draft_topk": "dtk", "logits": "lgt"}


def short_label(label: str) -> str:
    """A column's label in three characters: ``L3`` for layer3, ``nrm`` for final_norm, ``fc`` for
    the draft's fc output; another name by the initials of its words (``draft_foo_bar``: ``dfb``),
    which the heatmap's legend line spells out."""
    if label in SHORT_LABELS:
        return SHORT_LABELS[label]
    if label.startswith("layer") and label[5:].isdigit():
        n = label[5:]
        return f"L{n}" if len(n) <= 2 else n[-3:]
    words = [w for w in label.replace(".", "_").split("_") if w]
    return "".join(w[0] for w in words)[:3] if len(words) > 1 else label[:3]


def read_columns(summary: SummaryReader) -> list[Column]:
    """The summary's columns in forward order (by order, then slot)."""
    cols = []
    for j, ds in enumerate(summary.columns):
        a = ds.attrs
        label = str(a.get("label", summary.labels[j]))
        try:
            slot_label = parse_json(a.get("slot_label", "null"), "slot_label", error=TraceFileError)
        except (TraceFileError, TypeError):
            slot_label = None
        ta = str(a.get("tensor_a", label))
        cols.append(Column(index=j, label=label, tensor_a=ta, tensor_b=str(a.get("tensor_b", ta)),
                           slot=int(a.get("slot", 0)), order=float(a.get("order", j)),
                           slot_label=slot_label, packed=label.endswith("]") and slot_label is not None))
    cols.sort(key=lambda c: (c.order, c.tensor_a, c.slot))
    return cols
