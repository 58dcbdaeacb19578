"""Per-token numerics between two blocks of rows, and the tolerances that judge them.

numpy only, float32 blocks, temporaries reused per block. NaN/Inf are counted, never raised.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import numpy as np

from .dtypes import EPS, to_float32
from .errors import TraceError


@dataclass(frozen=True)
class Tolerance:
    """A token passes when cos >= min_cos and rel <= max_rel (and it has no NaN/Inf that the
    reference lacks). ``rel`` = ||a - b|| / ||a||, cos = <a, b> / (||a|| ||b||)."""

    min_cos: float
    max_rel: float
    source: str = "default"

    def to_dict(self) -> dict:
        return {"min_cos": self.min_cos, "max_rel": self.max_rel, "source": self.source}


# Defaults per the coarser dtype of the two sides: wide enough for honest kernel/rounding
# differences through a few layers, far tighter than any wiring bug (different states of the same
# token have cos well below 0.99 and rel near 1).
_DEFAULTS = {
    "float64": Tolerance(1 - 1e-9, 1e-6),
    "float32": Tolerance(1 - 1e-6, 2e-3),
    "float16": Tolerance(0.99, 0.1),
    "bfloat16": Tolerance(0.97, 0.25),
}


def coarser(a: str, b: str) -> str:
    return a if EPS.get(a, 0) >= EPS.get(b, 0) else b


@dataclass
class ToleranceBook:
    """Default per-dtype tolerances, overridden per tensor (``--tol NAME=min_cos,max_rel``) or by a
    calibration file measured on a noise-floor pair (``tensordiff calibrate``)."""

    overrides: dict[str, Tolerance] = field(default_factory=dict)
    calibrated: dict[str, Tolerance] = field(default_factory=dict)

    def for_tensor(self, name: str, dtype_a: str, dtype_b: str, slot: int | None = None) -> Tolerance:
        key = f"{name}[{slot}]" if slot is not None else name
        for book in (self.overrides, self.calibrated):
            if key in book:
                return book[key]
            if name in book:
                return book[name]
            if "*" in book:
                return book["*"]
        d = coarser(dtype_a, dtype_b)
        return _DEFAULTS.get(d, _DEFAULTS["float32"])

    @staticmethod
    def parse_override(text: str) -> tuple[str, Tolerance]:
        try:
            name, vals = text.split("=", 1)
            c, r = (float(x) for x in vals.split(","))
        except ValueError:
            raise TraceError(f"--tol {text!r}: expected NAME=MIN_COS,MAX_REL (NAME may be '*' or name[slot])") from None
        if not (-1 <= c <= 1) or not r >= 0:
            raise TraceError(f"--tol {text!r}: MIN_COS must be in [-1, 1] and MAX_REL >= 0")
        return name, Tolerance(c, r, "override")

    def load_calibration(self, path: str) -> None:
        try:
            with open(path, encoding="utf-8") as fh:
                data = json.load(fh)
            for k, v in data["tolerances"].items():
                self.calibrated[str(k)] = Tolerance(float(v["min_cos"]), float(v["max_rel"]), f"calibrated:{os.path.basename(path)}")
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise TraceError(f"cannot read calibration file ({type(e).__name__}: {e})", path) from None


def calibrated_tolerance(worst_cos: float, worst_rel: float, dtype: str, margin: float = 4.0) -> Tolerance:
    """Tolerance from a noise floor: allow ``margin`` times the observed error, never tighter
    than the dtype's rounding."""
    eps = EPS.get(dtype, EPS["float32"])
    rel = max(worst_rel * margin, 8 * eps)
    one_minus = max((1 - worst_cos) * margin * margin, eps * eps)
    return Tolerance(max(-1.0, 1 - one_minus), rel, "calibrated")


class BlockMetrics:
    """Per-token, per-slot metrics of two aligned blocks [n, k*w]; buffers reused across calls.

    Fast path: five passes over the data (difference, three float32 dot products, |diff| max);
    ``<a,b>`` comes from ``(|a|^2 + |b|^2 - |a-b|^2) / 2``. Rows whose sums are not finite (NaN,
    Inf, or float32 overflow) are recomputed exactly over their finite elements."""

    SUB_BYTES = 512 << 10  # sub-blocks small enough that every pass runs in cache

    def __init__(self, slots: int, width: int):
        self.k = slots
        self.w = width
        self._diff: np.ndarray | None = None
        self._fa: np.ndarray | None = None
        self._fb: np.ndarray | None = None
        self._dirty: set[int] = set()

    def compute_stored(self, a: np.ndarray, dtype_a: str, b: np.ndarray, dtype_b: str) -> dict[str, np.ndarray]:
        """Metrics of two blocks in their stored form (bf16 as bits), converted to float32 a
        cache-sized sub-block at a time: each row is read from memory once."""
        n = a.shape[0]
        width = self.k * self.w
        sub = max(1, self.SUB_BYTES // max(1, width * 4))
        if n <= sub:
            return self.compute(to_float32(a[:, :width], dtype_a), to_float32(b[:, :width], dtype_b))
        if self._fa is None:
            # bf16 -> f32 is "bits into the high half": keep the low halves zero once, then each
            # sub-block only writes the high halves (a quarter faster than a widening shift)
            self._fa = np.zeros((sub, width, 2), np.uint16)
            self._fb = np.zeros((sub, width, 2), np.uint16)
        parts = []
        for s0 in range(0, n, sub):
            fa = self._convert(a[s0:s0 + sub, :width], dtype_a, self._fa)
            fb = self._convert(b[s0:s0 + sub, :width], dtype_b, self._fb)
            parts.append(self.compute(fa, fb))
        return {key: np.concatenate([p[key] for p in parts]) for key in parts[0]}

    def _convert(self, block: np.ndarray, dtype: str, buf: np.ndarray) -> np.ndarray:
        m = block.shape[0]
        dirty = self._dirty
        if dtype == "bfloat16":
            if id(buf) in dirty:  # a non-bf16 block used the buffer before: re-zero once
                buf[:, :, 0] = 0
                dirty.discard(id(buf))
            buf[:m, :, 1] = block
            return buf[:m].view(np.float32)[..., 0]
        dirty.add(id(buf))
        out = buf[:m].view(np.float32)[..., 0]
        np.copyto(out, block, casting="unsafe")
        return out

    def compute(self, a: np.ndarray, b: np.ndarray) -> dict[str, np.ndarray]:
        n = a.shape[0]
        k, w = self.k, self.w
        if self._diff is None or self._diff.shape[0] < n:
            self._diff = np.empty((max(n, 1), k * w), dtype=np.float32)
        a3 = a.reshape(n, k, w)
        b3 = b.reshape(n, k, w)
        d = self._diff[:n].reshape(n, k, w)
        with np.errstate(over="ignore", invalid="ignore"):
            np.subtract(a3, b3, out=d)
            aa = np.einsum("nkw,nkw->nk", a3, a3).astype(np.float64)
            bb = np.einsum("nkw,nkw->nk", b3, b3).astype(np.float64)
            dd = np.einsum("nkw,nkw->nk", d, d).astype(np.float64)
            np.abs(d, out=d)
            maxabs = d.max(axis=2) if w else np.zeros((n, k), np.float32)
        nf_a = np.zeros((n, k), dtype=np.int64)
        nf_b = np.zeros((n, k), dtype=np.int64)
        suspect = ~(np.isfinite(aa) & np.isfinite(bb) & np.isfinite(dd))
        if suspect.any():
            for i, s in zip(*np.nonzero(suspect)):
                x, y = a3[i, s].astype(np.float64), b3[i, s].astype(np.float64)
                fx, fy = np.isfinite(x), np.isfinite(y)
                nf_a[i, s], nf_b[i, s] = (~fx).sum(), (~fy).sum()
                both = fx & fy
                x, y = x[both], y[both]
                dv = x - y
                aa[i, s], bb[i, s], dd[i, s] = x @ x, y @ y, dv @ dv
                maxabs[i, s] = np.abs(dv).max() if len(dv) else 0.0
        ab = (aa + bb - dd) / 2
        with np.errstate(divide="ignore", invalid="ignore"):
            denom = np.sqrt(aa * bb)
            cos = np.where(denom > 0, ab / np.where(denom > 0, denom, 1), np.where((aa == 0) & (bb == 0), 1.0, 0.0))
            na = np.sqrt(aa)
            rel = np.where(na > 0, np.sqrt(dd) / np.where(na > 0, na, 1), np.where(dd > 0, np.inf, 0.0))
        return {
            "cos": np.clip(cos, -1, 1).astype(np.float32),
            "rel": rel.astype(np.float32),
            "maxabs": maxabs.astype(np.float32),
            "nonfinite_a": nf_a,
            "nonfinite_b": nf_b,
            "nonfinite": (nf_a > 0) | (nf_b > 0),
        }


def finite_or_zero(x: np.ndarray) -> np.ndarray:
    """x with NaN/Inf replaced by 0, copying only when there are any (one cheap pass)."""
    if np.isfinite(x.sum(dtype=np.float64)):
        return x
    return np.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)


def cosine_matrix(x: np.ndarray, cands: np.ndarray, *, clean: bool = True) -> np.ndarray:
    """Mean-over-tokens cosine of x [n, w] against each candidate [c, n, w] -> [c].
    NaN/Inf rows are ignored; a candidate with no usable rows scores -inf."""
    if clean:  # callers that pass already-cleaned data skip this
        x, cands = finite_or_zero(x), finite_or_zero(cands)
    dots = np.einsum("nw,cnw->cn", x, cands).astype(np.float64)
    nx = np.sqrt(np.einsum("nw,nw->n", x, x).astype(np.float64))
    nc = np.sqrt(np.einsum("cnw,cnw->cn", cands, cands).astype(np.float64))
    den = nx[None, :] * nc
    ok = den > 0
    cos = np.where(ok, dots / np.where(ok, den, 1), 0.0)
    cnt = ok.sum(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        out = np.where(cnt > 0, cos.sum(axis=1) / np.maximum(cnt, 1), -np.inf)
    return out


def rms_agreement(rx: np.ndarray, rc: np.ndarray) -> np.ndarray:
    """How well per-token RMS agrees: mean of min/max ratio, rx [n], rc [c, n] -> [c] in [0, 1].
    Separates pre-norm boundaries from the post-norm final_norm output, whose cosine can be ~1."""
    rx = np.nan_to_num(rx)[None, :]
    rc = np.nan_to_num(rc)
    hi = np.maximum(rx, rc)
    lo = np.minimum(rx, rc)
    with np.errstate(invalid="ignore", divide="ignore"):
        r = np.where(hi > 0, lo / np.where(hi > 0, hi, 1), 1.0)
    return r.mean(axis=1)
