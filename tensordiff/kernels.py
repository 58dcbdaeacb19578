"""The per-row kernels, compiled or not: :mod:`tensordiff._kernels` (``tensordiff/_kernels.c``,
built by ``pip install -e .``) where it was built, numpy versions of the same calls where it was
not (an install without a C compiler: setup.py makes the extension optional).

The numpy sums make the same additions in the same order as the C code (element ``j`` of a row and
slot in lane ``j % 8``, each lane summed from the first element to the last, the lanes combined in
the same fixed tree; every element widened to float64 first, no fused multiply-add), so
``row_sums``, ``row_dots`` and ``row_dots_at`` give the same bits on either path, only slower.
``topk`` ranks as the C code does (NaN above every number, ties to the lower index). The trace writer's compiled appends
(``Rows``, ``put_rows``, ``put_tokens``) have no numpy twin: without the extension they take
nothing, and the writer's checked Python path writes every row.

``TENSORDIFF_NUMPY_KERNELS=1`` (read at import) uses the numpy path even where the extension is
built; :func:`use_numpy` switches the sums and the top-k at run time (the tests run both paths).
"""

from __future__ import annotations

import importlib
import os
import sys
from types import ModuleType
from typing import Any

import numpy as np

_compiled: ModuleType | None
try:
    _compiled = importlib.import_module("._kernels", __package__)
except ImportError:  # built without a C compiler, or a source checkout never built
    _compiled = None

LANES = 8   # the C code's partial sums per row and slot
CHUNK = 1 << 17   # elements per piece of the numpy sums
#: whether the compiled extension is importable at all
BUILT = _compiled is not None
_numpy = _compiled is None or bool(os.environ.get("TENSORDIFF_NUMPY_KERNELS"))
_noted = False


def compiled() -> bool:
    """Whether the sums and the top-k run the compiled code now."""
    return not _numpy


def use_numpy(flag: bool) -> bool:
    """Run the sums and the top-k on the numpy path (``flag``) or the compiled one (where built);
    returns the previous setting. The writer's appends keep what they bound at import."""
    global _numpy
    was = _numpy
    _numpy = bool(flag) or _compiled is None
    return was


def _note() -> None:
    global _noted
    if not _noted and _compiled is None:
        _noted = True
        sys.stderr.write("tensordiff: note: the compiled kernels are not built (no C compiler at install?); "
                         "using numpy: the same sums, slower\n")


def _f64(x: np.ndarray, kind: int) -> np.ndarray:
    """Stored rows as float64: kind 0 float32, kind 1 bfloat16 bits (uint16)."""
    if kind == 1:
        return (np.ascontiguousarray(x, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return np.asarray(x, dtype=np.float32).astype(np.float64)


def _lane_sums(v: np.ndarray) -> np.ndarray:
    """[..., w] float64 -> [...]: the C code's order (lane j % 8, first to last, the fixed tree).
    The padding adds +0.0 to a lane, which changes no sum (a lane's sum starts at +0.0)."""
    w = v.shape[-1]
    pad = (-w) % LANES
    if pad:
        v = np.concatenate([v, np.zeros(v.shape[:-1] + (pad,), np.float64)], axis=-1)
    shape: tuple[int, ...] = v.shape[:-1] + (-1, LANES)
    v = v.reshape(shape)
    s: np.ndarray
    if v.shape[-2] == 0:
        s = np.zeros(v.shape[:-2] + (LANES,), np.float64)
    else:
        # a running sum adds in order, first to last (numpy's sum may add pairwise); the C code
        # starts each lane at +0.0, which only a lane of -0.0 alone tells apart: the + 0.0
        s = np.add.accumulate(v, axis=-2)[..., -1, :] + 0.0
    return ((s[..., 0] + s[..., 1]) + (s[..., 2] + s[..., 3])) + ((s[..., 4] + s[..., 5]) + (s[..., 6] + s[..., 7]))


def _chunks(m: int, width: int) -> range:
    """Row starts of pieces of about CHUNK elements: numpy's temporaries stay small (fast)."""
    return range(0, m, max(1, CHUNK // max(1, width)))


def _np_row_sums(a: np.ndarray, ka: int, b: np.ndarray, kb: int, k: int, w: int, aa: np.ndarray, bb: np.ndarray,
                 dd: np.ndarray, maxabs: np.ndarray) -> None:
    _note()
    m = a.shape[0]
    step = max(1, CHUNK // max(1, k * w))
    for r in _chunks(m, k * w):
        e = min(m, r + step)
        x = _f64(a[r:e, :k * w], ka).reshape(e - r, k, w)
        y = _f64(b[r:e, :k * w], kb).reshape(e - r, k, w)
        d = x - y
        aa[r:e] = _lane_sums(x * x)
        bb[r:e] = _lane_sums(y * y)
        dd[r:e] = _lane_sums(d * d)
        ad = np.abs(d)
        ad[np.isnan(ad)] = 0.0   # the C code's max skips NaN (a comparison with NaN is false)
        maxabs[r:e] = ad.max(axis=-1, initial=0.0)


def _np_row_dots(x: np.ndarray, c: np.ndarray, out: np.ndarray) -> None:
    _note()
    if x.shape != c.shape:
        raise ValueError("row_dots: x and c have different shapes")
    n, w = x.shape
    step = max(1, CHUNK // max(1, w))
    for r in _chunks(n, w):
        e = min(n, r + step)
        out[r:e] = _lane_sums(np.asarray(x[r:e], np.float64) * np.asarray(c[r:e], np.float64))


def _np_topk(x: np.ndarray, k: int, vals: np.ndarray, idx: np.ndarray) -> None:
    _note()
    if x.ndim != 2 or x.dtype != np.float32 or not 1 <= k <= x.shape[1]:
        raise ValueError("topk: x is float32 [n, V] and 1 <= k <= V")
    nan = np.isnan(x)
    # stable sort on (not NaN, -value): NaN first, then the largest, ties in index order
    order = np.lexsort((np.where(nan, 0.0, -x.astype(np.float64)), ~nan), axis=-1)[:, :k]
    idx[...] = order
    vals[...] = np.take_along_axis(x, order, axis=-1)


def row_sums(a: np.ndarray, ka: int, b: np.ndarray, kb: int, k: int, w: int, aa: np.ndarray, bb: np.ndarray,
             dd: np.ndarray, maxabs: np.ndarray) -> None:
    """Per row and slot: sum x^2, sum y^2, sum (x - y)^2 (float64) and max |x - y| (NaN skipped)."""
    if _numpy:
        _np_row_sums(a, ka, b, kb, k, w, aa, bb, dd, maxabs)
    else:
        assert _compiled is not None
        _compiled.row_sums(a, ka, b, kb, k, w, aa, bb, dd, maxabs)


def row_dots(x: np.ndarray, c: np.ndarray, out: np.ndarray) -> None:
    """Per-row float64 dot products of two [n, w] float32 or float64 arrays into ``out`` [n]."""
    if _numpy:
        _np_row_dots(x, c, out)
    else:
        assert _compiled is not None
        _compiled.row_dots(x, c, out)


def _np_rows_f64(x: np.ndarray, kind: int, idx: np.ndarray | None) -> np.ndarray:
    rows = x if idx is None else x[idx]
    if kind == 2:
        return np.asarray(rows, np.float64)
    return _f64(rows, kind)


def _np_row_dots_at(x: np.ndarray, kx: int, xi: np.ndarray | None, c: np.ndarray, kc: int, ci: np.ndarray | None,
                    out: np.ndarray) -> None:
    _note()
    if x.ndim != 2 or c.ndim != 2 or x.shape[1] != c.shape[1]:
        raise ValueError("row_dots_at: x and c are 2-D rows of one width")
    for name, idx, m in (("xi", xi, x.shape[0]), ("ci", ci, c.shape[0])):
        if idx is not None and (idx.ndim != 1 or idx.dtype != np.int64):
            raise ValueError(f"row_dots_at: {name}: expected a 1-D int64 index")
        if idx is not None and len(idx) and (int(idx.min()) < 0 or int(idx.max()) >= m):
            raise IndexError(f"row_dots_at: {name} outside [0, {m})")
    n = x.shape[0] if xi is None else len(xi)
    if n != (c.shape[0] if ci is None else len(ci)):
        raise ValueError("row_dots_at: x and c index different numbers of rows")
    step = max(1, CHUNK // max(1, x.shape[1]))
    for r in range(0, n, step):
        e = min(n, r + step)
        part_x = _np_rows_f64(x, kx, np.arange(r, e) if xi is None else xi[r:e])
        part_c = _np_rows_f64(c, kc, np.arange(r, e) if ci is None else ci[r:e])
        out[r:e] = _lane_sums(part_x * part_c)


def row_dots_at(x: np.ndarray, kind_x: int, xi: np.ndarray | None, c: np.ndarray, kind_c: int,
                ci: np.ndarray | None, out: np.ndarray) -> None:
    """``out[t] = sum_j x[xi[t], j] * c[ci[t], j]`` in float64, in :func:`row_dots`' order: rows
    of kind 0 float32, 1 bfloat16 bits (uint16) or 2 float64, picked by int64 indices (None:
    every row in order; every index is checked)."""
    if _numpy:
        _np_row_dots_at(x, kind_x, xi, c, kind_c, ci, out)
    else:
        assert _compiled is not None
        _compiled.row_dots_at(x, kind_x, xi, c, kind_c, ci, out)


def topk(x: np.ndarray, k: int, vals: np.ndarray, idx: np.ndarray) -> None:
    """The top ``k`` of each float32 row, best first, into ``vals`` (float32) and ``idx`` (int64)."""
    if _numpy:
        _np_topk(x, k, vals, idx)
    else:
        assert _compiled is not None
        _compiled.topk(x, k, vals, idx)


class _Rows:
    """The writer's chunk buffer without the extension: its fill and dirty flag only."""

    def __init__(self, buf: np.ndarray):
        _note()
        self.buf = buf
        self.fill = 0
        self.dirty = False


def _put_rows(*args: Any) -> bool:
    return False   # every append takes the writer's checked Python path


def _put_tokens(*args: Any) -> int:
    return -1


Rows: Any
put_rows: Any
put_tokens: Any
if _numpy:
    Rows, put_rows, put_tokens = _Rows, _put_rows, _put_tokens
else:
    assert _compiled is not None
    Rows, put_rows, put_tokens = _compiled.Rows, _compiled.put_rows, _compiled.put_tokens
