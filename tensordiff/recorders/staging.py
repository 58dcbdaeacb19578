"""Work a recorder does later, in batches: staged rows and top-k jobs.

A serving engine calls a recorder once or more per forward pass, and on the CPU most passes are
small (a decode or verify step: a few rows per request). Computing each call's RMS, sketch and
top-k table and appending its rows at once costs a fixed amount of Python, torch dispatch and
HDF5 calls per call, which dominates at those sizes. With staging on
(``Recorder(stage_bytes=...)``), a call does only what must happen while the engine's tensors are
valid: it checks and keys its rows and copies what it records into private memory. The rest is done
for every staged call at once when the staged bytes reach the bound, before the writer commits a
flush, and at ``flush``/``close``: one top-k per group of logits, one RMS and one sketch product
per tensor, one append per tensor. What is written is what the unstaged path writes, row for row,
in the same order per tensor: values, RMS and top-k tables bit for bit, sketches within the
float32 rounding of one larger product (tests/test_staging.py compares the two files).

* :class:`Staged`: one staged call of a tensor (its kept token rows and a private copy of its
  rows in the stored form, or a :class:`Later` table for rows that are not states).
* :class:`TopkJob`: the top-k table of some logits (or of some final hidden states times an
  lm_head weight), computed with the other jobs of its group on first use.
* :class:`Later`: a table computed on first use from other later values (a verify step's row from
  its jobs' tables), with its width known now.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .. import conventions
from ..dtypes import bf16_bits_to_f32
from .storage import topk_rows

__all__ = ["HEAD_CHUNK_ROWS", "Later", "Staged", "TopkJob", "compute_jobs", "host_copy", "host_f32", "same_bits"]

# rows whose logits a job computes from hidden states at once (bounded memory: this many x vocab)
HEAD_CHUNK_ROWS = 512


class Later:
    """A table of ``width`` columns computed on first use by ``fn()`` (a float64 array of
    ``rows`` x ``width``, or anything ``np.asarray`` turns into one)."""

    __slots__ = ("_fn", "_value", "width")

    def __init__(self, width: int, fn: Callable[[], Any]):
        self.width = int(width)
        self._fn: Callable[[], Any] | None = fn
        self._value: np.ndarray | None = None

    def value(self) -> np.ndarray:
        if self._value is None:
            assert self._fn is not None
            self._value = np.asarray(self._fn(), dtype=np.float64)
            self._fn = None  # drop what it held
        return self._value


@dataclass
class Staged:
    """One staged call of one tensor: its kept token ``rows``; for states, ``data`` (a private
    copy of the kept rows in the stored form, [n, width]) and, where an earlier call held the same
    bits (``Recorder._record(..., reuse=)``), ``same`` (that call: its RMS and sketch are reused);
    for rows that are not states, ``plain`` (a float64 array, or a :class:`Later` with ``keep``,
    the mask of the rows passed that are kept). ``ref``: the rows of the tensor's values source
    that hold these rows' values (the trace refers to them instead of storing them again)."""

    rows: np.ndarray
    data: np.ndarray | None = None
    same: Staged | None = None
    plain: Any = None
    keep: np.ndarray | None = None
    rms: np.ndarray | None = None
    sketch: np.ndarray | None = None
    first: int = 0                  # the tensor's row index of this call's first row
    ref: np.ndarray | None = None   # the source tensor's rows these rows take their values from

    @property
    def nbytes(self) -> int:
        n = self.rows.nbytes
        if self.data is not None and self.same is None:
            n += self.data.nbytes
        if isinstance(self.plain, np.ndarray):
            n += self.plain.nbytes
        return n


class TopkJob:
    """The top-k table (:func:`~tensordiff.recorders.storage.topk_rows`: [m, 2k+1] float64, ids |
    log-probabilities | logsumexp) of ``m`` rows of logits, computed on first use of
    :attr:`table`, together with every other pending job of the same group (one top-k call and one
    logsumexp per group instead of one per pass; the lm_head product of ``hidden`` rows stays one
    per job, so its rounding never depends on which jobs were batched).

    ``logits`` [m, V]: a private float32 copy (the engine may overwrite its own). Or ``hidden``
    [m, H] with ``head`` = (lm_head weight [V', H], vocab V or None, logit scale or None, final
    soft-capping or None): the logits are ``hidden @ weight.T`` (cut to V columns), scaled and
    capped, as the engine's logits processor makes them; computed HEAD_CHUNK_ROWS rows at a time.
    ``id_map`` [V]: column id -> token id (a draft's reduced vocabulary)."""

    __slots__ = ("_table", "_width", "head", "hidden", "id_map", "k", "logits", "pending")

    def __init__(self, k: int, *, logits: torch.Tensor | None = None, hidden: torch.Tensor | None = None,
                 head: tuple | None = None, id_map: torch.Tensor | None = None,
                 pending: list[TopkJob] | None = None):
        self.k = int(k)
        self.logits = logits
        self.hidden = hidden
        self.head = head
        self.id_map = id_map
        self._table: np.ndarray | None = None
        if logits is not None:
            v = int(logits.shape[-1])
        else:
            assert hidden is not None and head is not None
            v = int(head[1]) if head[1] is not None else int(head[0].shape[0])
        self._width = conventions.topk_width(min(self.k, v))
        self.pending = pending  # the recorder's list of jobs not computed yet (None: none)
        if pending is not None:
            pending.append(self)

    @property
    def rows(self) -> int:
        x = self.logits if self.logits is not None else self.hidden
        return int(x.shape[0]) if x is not None else len(self._table) if self._table is not None else 0

    @property
    def width(self) -> int:
        """Columns of :attr:`table` (2k+1, k at most the vocabulary), known before it is computed."""
        return self._width

    @property
    def nbytes(self) -> int:
        x = self.logits if self.logits is not None else self.hidden
        return int(x.numel() * x.element_size()) if x is not None else 0

    @property
    def done(self) -> bool:
        return self._table is not None

    @property
    def table(self) -> np.ndarray:
        if self._table is None:
            compute_jobs(self.pending if self.pending is not None else [self])
        assert self._table is not None
        return self._table

    def group(self) -> tuple:
        """Jobs of one group are computed in one call: the same k, id map and logits source."""
        if self.logits is not None:
            return ("logits", self.k, int(self.logits.shape[-1]), self.logits.dtype, self.logits.device,
                    _ident(self.id_map))
        assert self.head is not None
        w, vocab, scale, cap = self.head
        return ("hidden", self.k, id(w), vocab, scale, cap, _ident(self.id_map))

    def _set(self, table: np.ndarray) -> None:
        self._table = table
        self.logits = self.hidden = None  # the inputs are no longer needed


def host_copy(t: torch.Tensor) -> torch.Tensor:
    """A private contiguous copy of a CPU tensor, same dtype, made with numpy (no torch op)."""
    x = t.detach()
    if x.dtype == torch.bfloat16:
        return torch.from_numpy(np.array(x.view(torch.int16).numpy())).view(torch.bfloat16)
    return torch.from_numpy(np.array(x.numpy()))


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two CPU tensors of one shape and dtype hold the same bits (NaN payloads included)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    x, y = a.detach(), b.detach()
    if x.dtype == torch.bfloat16:
        x, y = x.view(torch.int16), y.view(torch.int16)
    xa, ya = x.numpy(), y.numpy()
    u = f"u{xa.dtype.itemsize}"
    return bool((xa.view(u) == ya.view(u)).all())


def host_f32(t: torch.Tensor, rows: np.ndarray | None = None) -> torch.Tensor:
    """A private float32 copy of the rows ``rows`` (None: all) of a CPU tensor [n, d], made with
    numpy (no torch op: inside an engine each one pays for the intra-op thread pool)."""
    x = t.detach()
    if not x.is_contiguous():
        x = x.contiguous()
    if x.dtype == torch.bfloat16:
        bits = x.view(torch.int16).numpy().view(np.uint16)
        out = bf16_bits_to_f32(bits[rows] if rows is not None else bits)
    else:
        a = x.numpy()
        out = a[rows].astype(np.float32, copy=False) if rows is not None else a.astype(np.float32)
    return torch.from_numpy(out)


def _ident(t: Any) -> Any:
    return None if t is None else id(t)


def compute_jobs(jobs: list[TopkJob]) -> None:
    """Compute every job of ``jobs`` not computed yet, one batch per group, and empty the list
    (the recorder's pending list: every job in it gets its table)."""
    todo = [j for j in jobs if not j.done]
    jobs.clear()
    groups: dict[tuple, list[TopkJob]] = {}
    for j in todo:
        groups.setdefault(j.group(), []).append(j)
    for members in groups.values():
        first = members[0]
        if first.logits is None:
            _head_jobs(members)
            continue
        parts: Sequence[torch.Tensor] = [j.logits for j in members]  # type: ignore[misc]
        x = parts[0] if len(parts) == 1 else torch.cat(parts)
        table = _as_numpy(topk_rows(x, first.k, first.id_map))  # row by row: the same for any batch
        if len(members) == 1:
            first._set(table)
            continue
        start = 0
        for j in members:
            n = j.rows
            j._set(table[start:start + n].copy())  # its own rows only: a job held on keeps no batch alive
            start += n


def _as_numpy(t: torch.Tensor) -> np.ndarray:
    return t.numpy() if t.device.type == "cpu" else t.cpu().numpy()


# logits of hidden-row jobs ranked at once (float32 elements: bounded memory)
HEAD_BATCH_ELEMENTS = 8 << 20
# a product of at least this many rows (a prefill's) is ranked as it is: joining it to a batch
# would copy its logits only to save a few calls
HEAD_ALONE_ROWS = 128


def _head_logits(h: torch.Tensor, head: tuple) -> torch.Tensor:
    """``h @ weight.T`` cut to the vocabulary, scaled and soft-capped as the engine's logits
    processor does."""
    w, vocab, scale, cap = head
    x = h.to(w.dtype) @ w.T
    if vocab is not None and x.shape[-1] > int(vocab):
        x = x[:, : int(vocab)]  # padded vocabulary
    return head_scale(x, scale, cap)


def head_scale(x: torch.Tensor, scale: float | None, cap: float | None) -> torch.Tensor:
    """Logits ``x`` scaled and soft-capped as a ``head``'s logits processor does."""
    if scale is not None:
        x = x * scale
    if cap:
        x = torch.tanh(x / cap) * cap
    return x


def _head_jobs(members: list[TopkJob]) -> None:
    """Jobs of one lm_head whose logits come from hidden rows. The product is one per job, in
    chunks of HEAD_CHUNK_ROWS of its rows, as a job computed alone would make it (a BLAS rounds a
    row differently with the row count of the product, and which jobs share a drain depends on
    timing); the top-k of those logits runs once per HEAD_BATCH_ELEMENTS (row by row: the same in
    any batch), or alone for a product of HEAD_ALONE_ROWS rows or more (no copy into a batch)."""
    first = members[0]
    parts: dict[int, list[np.ndarray]] = {id(j): [] for j in members}
    pending: list[tuple[TopkJob, torch.Tensor]] = []
    held = 0

    def rank() -> None:
        x = pending[0][1] if len(pending) == 1 else torch.cat([c for _, c in pending])
        table = _as_numpy(topk_rows(x, first.k, first.id_map))
        start = 0
        for j, c in pending:
            parts[id(j)].append(table[start:start + len(c)])
            start += len(c)
        pending.clear()

    with torch.no_grad():
        for j in members:
            h = j.hidden
            assert h is not None
            for s in range(0, h.shape[0], HEAD_CHUNK_ROWS):
                x = _head_logits(h[s:s + HEAD_CHUNK_ROWS], first.head)  # type: ignore[arg-type]
                if x.shape[0] >= HEAD_ALONE_ROWS:
                    if pending:  # the rows before it first: every job's parts stay in order
                        rank()
                        held = 0
                    parts[id(j)].append(_as_numpy(topk_rows(x, first.k, first.id_map)))
                    continue
                pending.append((j, x))
                held += x.numel()
                if held >= HEAD_BATCH_ELEMENTS:
                    rank()
                    held = 0
        if pending:
            rank()
    for j in members:
        got = parts[id(j)]
        j._set(np.concatenate(got) if len(got) != 1 else got[0].copy())
