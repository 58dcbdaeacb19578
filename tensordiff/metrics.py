"""Per-token numerics between two blocks of rows, and the tolerances that judge them.

numpy only, float32 blocks, temporaries reused per block. NaN/Inf are counted, never raised.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import numpy as np

from .dtypes import EPS
from .errors import TraceError

# Metric columns of the per-token summary (also the TUI's metric toggle order).
METRICS = ("cos", "rel", "maxabs", "nonfinite")


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
    """Per-token, per-slot metrics of two aligned blocks [n, k*w]; buffers reused across calls."""

    def __init__(self, slots: int, width: int):
        self.k = slots
        self.w = width
        self._diff: np.ndarray | None = None

    def compute(self, a: np.ndarray, b: np.ndarray) -> dict[str, np.ndarray]:
        n = a.shape[0]
        k, w = self.k, self.w
        if self._diff is None or self._diff.shape[0] < n:
            self._diff = np.empty((max(n, 1), k * w), dtype=np.float32)
        a3 = a.reshape(n, k, w)
        b3 = b.reshape(n, k, w)
        fa = np.isfinite(a3)
        fb = np.isfinite(b3)
        nf_a = (~fa).sum(axis=2)
        nf_b = (~fb).sum(axis=2)
        nonfinite = (nf_a > 0) | (nf_b > 0)
        if nonfinite.any():
            # metrics over the finite elements; the NaN/Inf themselves are reported as counts
            both = fa & fb
            a3 = np.where(both, a3, 0)
            b3 = np.where(both, b3, 0)
        d = self._diff[:n].reshape(n, k, w)
        np.subtract(a3, b3, out=d)
        ab = np.einsum("nkw,nkw->nk", a3, b3, dtype=np.float64)
        aa = np.einsum("nkw,nkw->nk", a3, a3, dtype=np.float64)
        bb = np.einsum("nkw,nkw->nk", b3, b3, dtype=np.float64)
        dd = np.einsum("nkw,nkw->nk", d, d, dtype=np.float64)
        np.abs(d, out=d)
        maxabs = d.max(axis=2) if w else np.zeros((n, k), np.float32)
        with np.errstate(divide="ignore", invalid="ignore"):
            denom = np.sqrt(aa * bb)
            cos = np.where(denom > 0, ab / np.where(denom > 0, denom, 1), np.where((aa == 0) & (bb == 0), 1.0, 0.0))
            na = np.sqrt(aa)
            rel = np.where(na > 0, np.sqrt(dd) / np.where(na > 0, na, 1), np.where(dd > 0, np.inf, 0.0))
        return {
            "cos": np.clip(cos, -1, 1).astype(np.float32),
            "rel": rel.astype(np.float32),
            "maxabs": maxabs.astype(np.float32),
            "nonfinite_a": nf_a.astype(np.int64),
            "nonfinite_b": nf_b.astype(np.int64),
            "nonfinite": nonfinite,
        }


def cosine_matrix(x: np.ndarray, cands: np.ndarray) -> np.ndarray:
    """Mean-over-tokens cosine of x [n, w] against each candidate [c, n, w] -> [c].
    NaN/Inf rows are ignored; a candidate with no usable rows scores -inf."""
    x = np.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)
    cands = np.nan_to_num(cands, nan=0.0, posinf=0.0, neginf=0.0)
    dots = np.einsum("nw,cnw->cn", x, cands, dtype=np.float64)
    nx = np.sqrt(np.einsum("nw,nw->n", x, x, dtype=np.float64))
    nc = np.sqrt(np.einsum("cnw,cnw->cn", cands, cands, dtype=np.float64))
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
