"""Streamed per-token numerics of two aligned blocks of rows: cosine, relative and max abs error,
NaN/Inf counts (:class:`BlockMetrics`), their per-pair accumulation against tolerances
(:class:`PairAccumulator`), and the worst tokens of a diff (:class:`WorstTokens`).

numpy and the compiled per-row sums of ``tensordiff/_kernels.c`` (float64, a fixed order of
additions); buffers reused per block. NaN/Inf are counted, never raised.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import NDArray

from .dtypes import to_float32
from .tolerances import Tolerance
from .trace import Pieces, block_rows
from .vocab import REGIMES

from . import kernels as _kernels

WORST_TOKENS = 20
BLOCK_BYTES = 8 << 20   # stored bytes per side of one diff block (see rows_per_block)
# stored dtype -> the kernel's kind for blocks it reads as they are (native byte order)
_KERNEL_KINDS = {"float32": (0, np.dtype(np.float32)), "bfloat16": (1, np.dtype(np.uint16))}
_NO_BUFFERS = (np.empty(0, np.float32), np.empty(0, np.float32))
# per-token 1 - cos and rel are histogrammed on a log scale (for the noise floor's quantiles)
_LOG_BINS = np.linspace(-12.0, 1.0, 261)
#: failing tokens whose aligned index a slot keeps (where they are: positions, regimes, channels)
FAIL_KEEP = 4096
_LR_BINS = np.linspace(-2.0, 2.0, 2001)   # log RMS ratio, 0.002 wide


@dataclass(frozen=True, eq=False)
class Metrics:
    """Per-token, per-slot metrics of one block of aligned rows, each [n, k]: cosine, relative
    error and max abs error over the values finite on both sides (nan where none is), and the
    NaN/Inf counts of each side."""

    cos: NDArray[np.float32]
    rel: NDArray[np.float32]
    maxabs: NDArray[np.float32]
    nonfinite_a: NDArray[np.int64]
    nonfinite_b: NDArray[np.int64]
    nonfinite: NDArray[np.bool_]          # either side has a NaN/Inf in the row's slot
    ratio: NDArray[np.float32] | None = None   # per-token RMS ratio ||b|| / ||a|| (nan: not measured)

    def __len__(self) -> int:
        return int(self.cos.shape[0])

    def copy(self) -> Metrics:
        """Its own arrays (a backend's buffers are reused for the next block)."""
        return Metrics(cos=np.array(self.cos), rel=np.array(self.rel), maxabs=np.array(self.maxabs),
                       nonfinite_a=np.array(self.nonfinite_a), nonfinite_b=np.array(self.nonfinite_b),
                       nonfinite=np.array(self.nonfinite), ratio=None if self.ratio is None else np.array(self.ratio))


METRIC_FIELDS = ("cos", "rel", "maxabs", "nonfinite_a", "nonfinite_b", "nonfinite")


class BlockMetrics:
    """Per-token, per-slot metrics of two aligned blocks [n, k*w]; buffers reused across calls.

    The sums come from the compiled kernel (``tensordiff/_kernels.c``): one pass over each
    element, with bf16 read from its bits, every element widened to float64, and per row and
    slot sum a^2, sum b^2, sum (a-b)^2 and max |a-b|; ``<a,b>`` comes from
    ``(|a|^2 + |b|^2 - |a-b|^2) / 2``. The order of every addition is fixed by the kernel (eight
    interleaved partial sums, a fixed tree), so the figures are the same bits whichever CPU path
    (AVX2 or portable), lane or backend measured a row. float16 and float64 blocks are converted
    to float32 first (float64 is narrowed, as everywhere in the diff). A block is cut into
    sub-blocks of about :data:`SUB_BYTES` shared between this thread and ``pool`` (the kernel
    releases the GIL: ``lanes`` cores work on one block). Rows whose sums are not finite (NaN,
    Inf) are recomputed exactly over their finite elements, from the stored rows."""

    SUB_BYTES = 2 << 20   # float32-equivalent bytes per side of one sub-block (the lanes' unit of work)

    def __init__(self, slots: int, width: int, *, pool: Executor | None = None, lanes: int = 1):
        self.k = slots
        self.w = width
        self._pool = pool
        self._lanes = max(1, lanes if pool is not None else 1)
        self._bufs: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def compute_stored(self, a: np.ndarray | Pieces, dtype_a: str, b: np.ndarray | Pieces, dtype_b: str) -> Metrics:
        """Metrics of two blocks in their stored form (bf16 as bits): each row is read from
        memory once. A block may come in :class:`~tensordiff.trace.Pieces` (runs of chunks
        mapped in place): no sub-block crosses from one piece to the next."""
        return self._run(a, dtype_a, b, dtype_b)

    def compute(self, a: np.ndarray, b: np.ndarray) -> Metrics:
        """Metrics of two float32 blocks."""
        return self._run(a, "float32", b, "float32")

    # -- the passes ----------------------------------------------------------------------------

    def _run(self, a: np.ndarray | Pieces, dtype_a: str, b: np.ndarray | Pieces, dtype_b: str) -> Metrics:
        n = a.shape[0]
        k, w = self.k, self.w
        width = k * w
        aa = np.zeros((n, k), np.float64)
        bb = np.zeros((n, k), np.float64)
        dd = np.zeros((n, k), np.float64)
        maxabs = np.zeros((n, k), np.float32)
        if n and w:
            sub = max(1, self.SUB_BYTES // max(1, width * 4))
            cuts = {c for x in (a, b) if isinstance(x, Pieces) for c in x.cuts}
            starts = sorted(set(range(0, n, sub)) | cuts)
            lanes = min(self._lanes, len(starts))
            # sub-blocks are taken from one counter as each lane gets to them, not dealt out in
            # advance: a lane that loses its core for a while (to the reader thread, or another
            # process) does not hold the block up. Each sub-block writes only its own rows, so
            # the figures do not depend on which lane measured it
            taken = itertools.count()

            def lane(j: int) -> None:
                bufs = self._lane_buffers(j, sub * width, dtype_a, dtype_b)
                for i in taken:
                    if i >= len(starts):
                        return
                    s0 = starts[i]
                    s1 = starts[i + 1] if i + 1 < len(starts) else n
                    self._sub_block(block_rows(a, s0, s1)[:, :width], dtype_a, block_rows(b, s0, s1)[:, :width], dtype_b,
                                    bufs, aa[s0:s1], bb[s0:s1], dd[s0:s1], maxabs[s0:s1])

            futs = [self._pool.submit(lane, j) for j in range(1, lanes)] if self._pool is not None else []
            try:
                lane(0)
            finally:
                for f in futs:
                    f.result()
        return self._finish(a, dtype_a, b, dtype_b, aa, bb, dd, maxabs)

    def _lane_buffers(self, j: int, size: int, dtype_a: str, dtype_b: str) -> tuple[np.ndarray, np.ndarray]:
        """float32 buffers for the sides the kernel cannot read as stored (allocated on need)."""
        if dtype_a in _KERNEL_KINDS and dtype_b in _KERNEL_KINDS:
            return _NO_BUFFERS
        bufs = self._bufs.get(j)
        if bufs is None or bufs[0].size < size:
            bufs = self._bufs[j] = (np.empty(size, np.float32), np.empty(size, np.float32))
        return bufs

    def _sub_block(self, a: np.ndarray, dtype_a: str, b: np.ndarray, dtype_b: str,
                   bufs: tuple[np.ndarray, np.ndarray], aa: np.ndarray, bb: np.ndarray,
                   dd: np.ndarray, maxabs: np.ndarray) -> None:
        xa, ka = _kernel_input(a, dtype_a, bufs[0])
        xb, kb = _kernel_input(b, dtype_b, bufs[1])
        _kernels.row_sums(xa, ka, xb, kb, self.k, self.w, aa, bb, dd, maxabs)

    def _finish(self, a: np.ndarray | Pieces, dtype_a: str, b: np.ndarray | Pieces, dtype_b: str, aa: np.ndarray, bb: np.ndarray,
                dd: np.ndarray, maxabs: np.ndarray) -> Metrics:
        n, k, w = a.shape[0], self.k, self.w
        nf_a = np.zeros((n, k), dtype=np.int64)
        nf_b = np.zeros((n, k), dtype=np.int64)
        suspect = ~(np.isfinite(aa) & np.isfinite(bb) & np.isfinite(dd))
        empty = np.zeros((n, k), dtype=bool)   # no value finite on both sides: nothing to measure
        if suspect.any():
            for i, s in zip(*np.nonzero(suspect)):
                cols = slice(s * w, (s + 1) * w)
                x = to_float32(block_rows(a, i, i + 1)[:, cols], dtype_a)[0].astype(np.float64)
                y = to_float32(block_rows(b, i, i + 1)[:, cols], dtype_b)[0].astype(np.float64)
                fx, fy = np.isfinite(x), np.isfinite(y)
                nf_a[i, s], nf_b[i, s] = (~fx).sum(), (~fy).sum()
                both = fx & fy
                x, y = x[both], y[both]
                empty[i, s] = not both.any()
                dv = x - y
                aa[i, s], bb[i, s], dd[i, s] = x @ x, y @ y, dv @ dv
                maxabs[i, s] = np.abs(dv).max() if len(dv) else 0.0
        ab = (aa + bb - dd) / 2
        with np.errstate(divide="ignore", invalid="ignore"):
            denom = np.sqrt(aa * bb)
            cos = np.where(denom > 0, ab / np.where(denom > 0, denom, 1), np.where((aa == 0) & (bb == 0), 1.0, 0.0))
            na = np.sqrt(aa)
            rel = np.where(na > 0, np.sqrt(dd) / np.where(na > 0, na, 1), np.where(dd > 0, np.inf, 0.0))
        cos[empty], rel[empty], maxabs[empty] = np.nan, np.nan, np.nan   # an all-NaN row is nan, not cos 1
        with np.errstate(divide="ignore", invalid="ignore"):
            # per-token RMS ratio ||b|| / ||a||: the scale part of the error (tensordiff.noise)
            ratio = np.where((aa > 0) & (bb > 0), np.sqrt(bb / np.where(aa > 0, aa, 1.0)), np.nan)
        ratio[empty] = np.nan
        return Metrics(cos=np.clip(cos, -1, 1).astype(np.float32), rel=rel.astype(np.float32),
                       maxabs=maxabs.astype(np.float32), nonfinite_a=nf_a, nonfinite_b=nf_b,
                       nonfinite=(nf_a > 0) | (nf_b > 0), ratio=ratio.astype(np.float32))


def _kernel_input(block: np.ndarray, dtype: str, buf: np.ndarray) -> tuple[np.ndarray, int]:
    """A stored sub-block [m, k*w] as the kernel reads it: bf16 bits or float32 as they are
    when their rows are contiguous, anything else converted to float32 into ``buf``."""
    kind = _KERNEL_KINDS.get(dtype)
    if kind is not None and block.dtype == kind[1] and _kernel_rows(block):
        return block, kind[0]
    out = buf[:block.size].reshape(block.shape) if buf.size >= block.size else np.empty(block.shape, np.float32)
    to_float32(block, dtype, out)
    return out, 0


def row_dots(x: np.ndarray, c: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Per-row dot products of two [n, w] arrays in float64 (``out`` [n], float64, written):
    each element widened to float64 (float32 and float64 rows give the same sums), the order of
    the additions fixed by the kernel, so a row's sum depends only on its own values."""
    x, c = _float_rows(x), _float_rows(c)
    if x.shape != c.shape:
        raise ValueError(f"row_dots: shapes {x.shape} and {c.shape} differ")
    if out is None:
        out = np.empty(x.shape[0], np.float64)
    _kernels.row_dots(x, c, out)
    return out


def row_dots_at(x: np.ndarray, c: np.ndarray, *, xi: np.ndarray | None = None, ci: np.ndarray | None = None,
                x_bf16: bool = False, c_bf16: bool = False, out: np.ndarray | None = None) -> np.ndarray:
    """``row_dots(x[xi], c[ci])`` without gathering the rows (None: every row in order), the same
    bits: each row is read where it lies, e.g. in a block mapped in place. A side flagged
    ``*_bf16`` holds bfloat16 bits (uint16), widened as the diff widens them; any other side is
    float32 or float64 (else converted, as :func:`row_dots` converts). Every index is checked."""
    xk, x = _dot_kind(x, x_bf16)
    ck, c = _dot_kind(c, c_bf16)
    xi = None if xi is None else np.ascontiguousarray(xi, np.int64)
    ci = None if ci is None else np.ascontiguousarray(ci, np.int64)
    if out is None:
        out = np.empty(x.shape[0] if xi is None else len(xi), np.float64)
    _kernels.row_dots_at(x, xk, xi, c, ck, ci, out)
    return out


def _dot_kind(x: np.ndarray, bf16: bool) -> tuple[int, np.ndarray]:
    x = np.asarray(x)
    if x.ndim != 2:
        raise ValueError(f"row_dots_at: expected [n, w] rows, got shape {x.shape}")
    if bf16:
        if x.dtype != np.uint16:
            raise ValueError(f"row_dots_at: bfloat16 rows are uint16 bits, got {x.dtype}")
        return 1, (x if _kernel_rows(x) else np.ascontiguousarray(x))
    x = _float_rows(x)
    return (2 if x.dtype == np.float64 else 0), x


def _float_rows(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x)
    if x.ndim != 2:
        raise ValueError(f"row_dots: expected [n, w] rows, got shape {x.shape}")
    if x.dtype not in (np.float32, np.float64) or not x.dtype.isnative:
        x = x.astype(np.float64)
    return x if _kernel_rows(x) else np.ascontiguousarray(x)


def _kernel_rows(x: np.ndarray) -> bool:
    """Whether the kernel reads ``x`` as it is: 2-D native, aligned elements contiguous within
    each row, any non-negative whole-element row stride (what _kernels.c checks again)."""
    return (x.ndim == 2 and x.dtype.isnative and x.flags.aligned and x.strides[1] == x.itemsize
            and x.strides[0] >= 0 and x.strides[0] % x.itemsize == 0)


def rows_per_block(row_bytes: int, cap: int, block_bytes: int | None = None) -> int:
    """Rows in one diff block: about :data:`BLOCK_BYTES` of stored data per side (``row_bytes``
    the larger side's), at most ``cap`` rows. The serial diff and every backend cut blocks with
    this, so their per-block sums (and so their JSON) are the same."""
    size = BLOCK_BYTES if block_bytes is None else block_bytes
    return max(1, min(int(cap), size // max(1, int(row_bytes))))


def finite_or_zero(x: np.ndarray) -> np.ndarray:
    """x with NaN/Inf replaced by 0, copying only when there are any (one cheap pass)."""
    if np.isfinite(x.sum(dtype=np.float64)):
        return x
    out: np.ndarray = np.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)
    return out


# ----------------------------------------------------------------------------------------------
# Accumulation over the blocks of one tensor pair
# ----------------------------------------------------------------------------------------------


@dataclass
class FirstHit:
    """The first aligned token (in aligned order) where a slot failed, with its metrics."""

    token_index: int
    cos: float = 0.0
    rel: float = 0.0
    maxabs: float = 0.0
    nonfinite_a: int = 0
    nonfinite_b: int = 0


def _finite(x: np.ndarray) -> np.ndarray:
    return np.where(np.isfinite(x), x, 0)


@dataclass
class PairAccumulator:
    """Per-slot statistics of one tensor pair, accumulated block by block: a token fails a slot
    when its cos or rel is past that slot's tolerance; NaN/Inf rows are counted apart."""

    tolerances: list[Tolerance]
    regime_of: np.ndarray                     # aligned index -> regime code (side B)
    tokens: int = 0
    cos_min: np.ndarray = field(init=False)
    cos_sum: np.ndarray = field(init=False)
    cos_count: np.ndarray = field(init=False)
    rel_max: np.ndarray = field(init=False)
    maxabs: np.ndarray = field(init=False)
    failing: np.ndarray = field(init=False)
    nonfinite_a: np.ndarray = field(init=False)
    nonfinite_b: np.ndarray = field(init=False)
    first_fail: list[FirstHit | None] = field(init=False)
    first_nonfinite: list[FirstHit | None] = field(init=False)
    fail_idx: list[list[np.ndarray]] = field(init=False)   # per slot: aligned indices of failing tokens (the first FAIL_KEEP)
    by_regime: dict[str, dict[str, Any]] = field(default_factory=dict)
    hist_cos: np.ndarray = field(init=False)   # [k, bins] counts of log10(1 - cos)
    hist_rel: np.ndarray = field(init=False)   # [k, bins] counts of log10(rel)
    lr_sum: np.ndarray = field(init=False)     # per slot: sum, sum of squares and count of the
    lr_sq: np.ndarray = field(init=False)      # per-token log RMS ratio log(||b|| / ||a||)
    lr_n: np.ndarray = field(init=False)
    hist_lr: np.ndarray = field(init=False)    # [k, bins] counts of the log RMS ratio

    def __post_init__(self) -> None:
        k = len(self.tolerances)
        self.cos_min = np.full(k, np.inf)
        self.cos_sum = np.zeros(k)
        self.cos_count = np.zeros(k, dtype=np.int64)
        self.rel_max = np.zeros(k)
        self.maxabs = np.zeros(k)
        self.failing = np.zeros(k, dtype=np.int64)
        self.nonfinite_a = np.zeros(k, dtype=np.int64)
        self.nonfinite_b = np.zeros(k, dtype=np.int64)
        self.first_fail = [None] * k
        self.first_nonfinite = [None] * k
        self.fail_idx = [[] for _ in range(k)]
        self.hist_cos = np.zeros((k, len(_LOG_BINS) + 1), np.int64)
        self.hist_rel = np.zeros((k, len(_LOG_BINS) + 1), np.int64)
        self.lr_sum = np.zeros(k)
        self.lr_sq = np.zeros(k)
        self.lr_n = np.zeros(k, dtype=np.int64)
        self.hist_lr = np.zeros((k, len(_LR_BINS) + 1), np.int64)

    def add(self, blk: np.ndarray, m: Metrics) -> np.ndarray:
        """Take one block's metrics (aligned indices ``blk``); returns the [n, k] mask of tokens
        that fail a tolerance or hold NaN/Inf (the summary file's flags)."""
        k = len(self.tolerances)
        off = np.zeros_like(m.nonfinite)
        for s, t in enumerate(self.tolerances):
            off[:, s] = (m.cos[:, s] < t.min_cos) | (m.rel[:, s] > t.max_rel)
        bad = off | m.nonfinite
        self.tokens += len(blk)
        self.cos_min = np.fmin(self.cos_min, np.fmin.reduce(m.cos, axis=0))   # fmin: nan rows (no finite
        self.cos_sum += np.nansum(m.cos, axis=0, dtype=np.float64)         # value) are not measured
        self.cos_count += (~np.isnan(m.cos)).sum(axis=0)
        self.rel_max = np.maximum(self.rel_max, _finite(m.rel).max(axis=0))
        self.maxabs = np.fmax(self.maxabs, np.fmax.reduce(m.maxabs, axis=0))
        self.failing += off.sum(axis=0)
        self.nonfinite_a += m.nonfinite_a.sum(axis=0)
        self.nonfinite_b += m.nonfinite_b.sum(axis=0)
        for s in range(k):
            kept = sum(len(x) for x in self.fail_idx[s])
            if kept < FAIL_KEEP and bad[:, s].any():
                self.fail_idx[s].append(np.asarray(blk)[bad[:, s]][:FAIL_KEEP - kept])
            if self.first_fail[s] is None and off[:, s].any():
                j = int(np.argmax(off[:, s]))
                self.first_fail[s] = FirstHit(int(blk[j]), float(m.cos[j, s]), float(m.rel[j, s]),
                                              float(m.maxabs[j, s]))
            if self.first_nonfinite[s] is None and m.nonfinite[:, s].any():
                j = int(np.argmax(m.nonfinite[:, s]))
                self.first_nonfinite[s] = FirstHit(int(blk[j]), nonfinite_a=int(m.nonfinite_a[j, s]),
                                                   nonfinite_b=int(m.nonfinite_b[j, s]))
        with np.errstate(divide="ignore", invalid="ignore"):
            lc = np.log10(np.maximum(1.0 - m.cos.astype(np.float64), 1e-300))
            lr = np.log10(np.maximum(_finite(m.rel).astype(np.float64), 1e-300))
        fin = ~m.nonfinite
        for s in range(k):
            self.hist_cos[s] += np.bincount(np.searchsorted(_LOG_BINS, lc[fin[:, s], s]), minlength=len(_LOG_BINS) + 1)
            self.hist_rel[s] += np.bincount(np.searchsorted(_LOG_BINS, lr[fin[:, s], s]), minlength=len(_LOG_BINS) + 1)
        ratio = m.ratio   # absent from metrics made without it
        if ratio is not None:
            with np.errstate(divide="ignore", invalid="ignore"):
                llr = np.log(ratio.astype(np.float64))
            for s in range(k):
                x = llr[:, s][np.isfinite(llr[:, s]) & fin[:, s]]
                self.lr_sum[s] += float(x.sum())
                self.lr_sq[s] += float((x * x).sum())
                self.lr_n[s] += len(x)
                self.hist_lr[s] += np.bincount(np.searchsorted(_LR_BINS, x), minlength=len(_LR_BINS) + 1)
        regs = self.regime_of[blk]
        for rc in np.unique(regs):
            sel = regs == rc
            e = self.by_regime.setdefault(REGIMES[int(rc)], {"tokens": 0, "failing": 0, "rel_max": 0.0})
            e["tokens"] += int(sel.sum())
            e["failing"] += int(bad[sel].any(axis=1).sum())
            e["rel_max"] = max(e["rel_max"], float(np.nanmax(_finite(m.rel[sel]))))
        return bad

    def quantile(self, slot: int, q: float) -> tuple[float, float]:
        """(1 - cos, rel) at quantile ``q`` over the finite tokens of a slot (upper bin edges)."""
        out = []
        for h in (self.hist_cos[slot], self.hist_rel[slot]):
            total = int(h.sum())
            if total == 0:
                out.append(float("nan"))
                continue
            j = int(np.searchsorted(np.cumsum(h), q * total))
            edge = _LOG_BINS[min(j, len(_LOG_BINS) - 1)]
            out.append(0.0 if j == 0 else float(10.0 ** edge))
        return out[0], out[1]

    def failing_tokens(self, slot: int) -> np.ndarray:
        """Aligned indices of the slot's failing (or NaN/Inf) tokens, the first FAIL_KEEP."""
        parts = self.fail_idx[slot]
        return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)

    def log_ratio(self, slot: int) -> tuple[float, float, int]:
        """(mean, standard deviation, tokens) of the per-token log RMS ratio of a slot."""
        n = int(self.lr_n[slot])
        if n == 0:
            return 0.0, 0.0, 0
        mean = float(self.lr_sum[slot] / n)
        var = max(0.0, float(self.lr_sq[slot] / n) - mean * mean) * n / max(1, n - 1)
        return mean, math.sqrt(var), n

    def ratio_quantile(self, slot: int, q: float) -> float:
        """The per-token RMS ratio at quantile ``q`` (bin centre; 1.0 when nothing was measured)."""
        h = self.hist_lr[slot]
        total = int(h.sum())
        if total == 0:
            return 1.0
        j = int(np.searchsorted(np.cumsum(h), q * total))
        lo = _LR_BINS[max(0, min(j - 1, len(_LR_BINS) - 1))]
        hi = _LR_BINS[min(j, len(_LR_BINS) - 1)]
        return float(math.exp((lo + hi) / 2))

    def cos_mean(self) -> list[float]:
        return [float(x) for x in self.cos_sum / np.maximum(self.cos_count, 1)]


class WorstTokens:
    """The ``limit`` tokens with the largest relative error over a whole diff, kept in a heap;
    each block offers only its own top candidates (a partition, no full sort)."""

    def __init__(self, limit: int = WORST_TOKENS):
        self.limit = limit
        self._heap: list[tuple[float, int, dict[str, Any]]] = []
        self._tiebreak = itertools.count()

    def offer(self, tensor: str, blk: np.ndarray, m: Metrics,
              entry: Callable[[int], dict[str, Any]]) -> None:
        rel = _finite(m.rel)
        rel_tok = rel.max(axis=1)
        top = np.argpartition(-rel_tok, self.limit)[:self.limit] if len(rel_tok) > self.limit \
            else np.arange(len(rel_tok))
        heap = self._heap
        for j in top:
            r = float(rel_tok[j])
            if len(heap) >= self.limit and r <= heap[0][0]:
                continue
            e = entry(int(blk[j]))
            sl = int(np.argmax(rel[j]))
            # nan where no value was finite on both sides (not the 0 that ranked it)
            e.update(tensor=tensor, rel=float(m.rel[j, sl]), slot=sl, cos=float(np.fmin.reduce(m.cos[j])))
            item = (r, next(self._tiebreak), e)
            if len(heap) < self.limit:
                heapq.heappush(heap, item)
            else:
                heapq.heapreplace(heap, item)

    def items(self) -> list[dict[str, Any]]:
        return [w[2] for w in sorted(self._heap, key=lambda w: (-w[0], w[2]["token_index"]))]
