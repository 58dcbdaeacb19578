"""The noise model of one diff: how far apart two honest records of the same state are, per depth,
measured from the two traces where both recorded the same catalog states, else a physical
default per dtype pair. Pure numpy, no I/O: :mod:`tensordiff.diff` hands it per-token errors.

Each catalog state recorded on both sides (a boundary, ``final_norm``) gives a **level**: over a
sample of its tokens the median and 99th percentile of the relative error ``||a-b|| / ||a||``,
the 99th percentile of ``1 - cos``, and the spread and median of the per-token log RMS ratio
``log(||b|| / ||a||)`` (honest rounding is unbiased: a systematic ratio is a finding).

Honest noise grows smoothly with depth; a bug introduces error at one place and the deeper states
inherit it. So the states are walked in depth order: each one's median error is **predicted** from
the clean states before it (the last clean level, grown by the per-layer growth the clean states
show); a state whose median error is over :data:`JUMP` x its prediction **leaves the trend** (it
is where a divergence is introduced) and is no longer used to predict. So does one whose 99th
percentile is over :data:`TOKEN` x its predicted one (a subset of tokens far out): the last clean
state's, grown by the trend, plus the fresh rounding of the layers between (in quadrature): per
layer the largest tail a clean layer added to the one before it, never under one rounding, and
the physical default's growth where no layer added any (states equal bit for bit); never more
than the default at its depth unless the trend itself is above it (a random-weight model's error
grows fast). The expected noise at any
depth (for a packed slot, for the tolerance of each token) comes from the clean states only.

Where no state was recorded on both sides, :func:`physical_default` stands in: ``u`` (unit
roundoff of the coarser dtype; bf16 2^-9) x 0.8 x sqrt(1 + 8 d) for the median relative error
at depth d (one rounding at the embedding, about eight rounded operations per layer, each
layer's error adding independently), x sqrt(2) when both sides round independently; fp32 pairs
take 16 u (summation order in wide reductions). Measured on the trained test model (bf16 vs fp32,
docs/diff.md): 0.82 u at the embedding, 2.0 u at layer1, 4.0 u at layer8; the default allows
0.8 u, 2.4 u and 6.5 u, and its verdicts say the limit is a default, not measured.

**The default is for where nothing was measured.** Where a clean computed state before the judged
one measured this pair's noise (:func:`measures`: not the embedding, a lookup both sides round
alike; its median not zero, the sides not bit for bit equal there, which says nothing of a layer
that computes differently; at least :data:`TREND_TOKENS` tokens; the same compute dtype pair, so
an autocast state never takes a float32 trend), the trend predicts the state and sets its
expectation, floored at one rounding of the dtype (:func:`one_rounding`, and never above the
default's first rounding), not at the default: an fp32 port (eager against SDPA attention) shows
one to four roundings where the fp32 default allows FP32_REDUCTION times more, so a bug at 3-30x
its noise read "agree". The first state, the first computed state after the embedding, and a
state after bit-identical ones keep the default.

**Packed slots.** Where no catalog state is measured (a serve engine that records the draft input
only), the slots of each packed tensor both sides recorded (one engine, one precision) measure
each other, walked in depth order (:func:`fit_slots`): the shallowest slot has nothing before it
and keeps the physical default; each deeper slot expects the default at its own depth scaled,
figure by figure, by how far the deepest clean slot before it sits above the default at that
slot's depth (never by less than 1 unless that slot measured the pair: :func:`default_scaled`,
its tokens apart and at least :data:`TREND_TOKENS` of them; then by less too, never under one
rounding). A slot is clean
while its median error, its worst token and its median RMS ratio stay within what its own
expectation allows, and no slot before it left; a slot never sets its own allowance nor that of a
slot before it, so a wrong state close to the claimed one is judged against what the shallower
slots measured. Measured on the random-weight tiny DeepSeek of the vLLM tests (bf16 against
fp32): the draft slots sit 2.2x, 2.8x and 3.5x the default at layer1..3, a false alarm against the
default alone; a slot moved toward its neighbour by 2x the correct pair's error is named there.
"""

from __future__ import annotations

import math
import re
import statistics
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import NDArray

from .conventions import AUTOCAST_ATTR
from .vocab import MAX_BOUNDARY

#: unit roundoff per dtype (half an ulp at 1)
UNIT = {"float64": 2.0 ** -53, "float32": 2.0 ** -24, "float16": 2.0 ** -11, "bfloat16": 2.0 ** -9}
#: fp32 pairs: reductions summed in another order differ by about sqrt(width) roundings
FP32_REDUCTION = 16.0
#: a state leaves the trend when its median error is over JUMP x the prediction from the states before it
JUMP = 3.0
#: per token: a token is out of the noise past TOKEN x the expected 99th percentile (rel), TOKEN^2 (1 - cos)
TOKEN = 4.0
#: a packed slot or a state: its median error past LEVEL x the expected median is a divergence
LEVEL = 3.0
#: growth per layer assumed when fewer than two clean states measure it; off the embedding (one
#: rounding) the first layer adds more (2.4x measured on the trained test model)
GROWTH_DEFAULT, GROWTH_FIRST = 1.5, 3.0
#: scale: a mean log RMS ratio past SCALE_Z standard errors and past SCALE x the noise's spread
SCALE_Z, SCALE = 4.0, 3.0
#: rescaled per token: a log-ratio spread past SPREAD x the noise's
SPREAD = 4.0
#: a computed state's 99th percentile relative error over its median, at most (measured: 10 at layer1
#: of the random-weight vLLM pair, bf16 vs fp32, its tokens of small norm; 2 on the trained model)
TAIL = 10.0
MIN_TOKENS = 8
#: a measured state sets the trend under the physical default only when measured on at least this
#: many tokens (a median and a 99th percentile of a few tokens wobble by more than JUMP allows)
TREND_TOKENS = 32


def compute_dtype(dtype: str, attrs: Mapping[str, Any] | None = None) -> str:
    """The dtype a recorded state was computed in: its stored dtype, or the dtype of the autocast
    region in effect while it was produced (``attrs[AUTOCAST_ATTR]``), whichever rounds coarser.
    A float32 residual stream of a forward under ``torch.autocast(dtype=torch.bfloat16)`` carries
    the bf16 rounding of every matmul that fed it: its noise is bf16's, not float32's."""
    ac = (attrs or {}).get(AUTOCAST_ATTR)
    if not isinstance(ac, Mapping) or ac.get("enabled") is not True:
        return dtype
    cd = ac.get("dtype")
    if not isinstance(cd, str) or cd not in UNIT:
        return dtype
    return cd if UNIT[cd] > UNIT.get(dtype, 0.0) else dtype


def unit(dtype_a: str, dtype_b: str) -> float:
    """The rounding unit of the coarser dtype of the pair."""
    return max(UNIT.get(dtype_a, UNIT["float32"]), UNIT.get(dtype_b, UNIT["float32"]))


@dataclass(frozen=True)
class Level:
    """Per-token error of one state across the two sides (or what is expected of it)."""

    q50: float          # median relative error
    q99: float          # 99th percentile relative error
    c99: float          # 99th percentile of 1 - cos
    sd: float           # robust spread of the per-token log RMS ratio
    bias: float = 0.0   # median per-token log RMS ratio
    n: int = 0          # tokens it was measured on (0: not measured, a default or an expectation)

    def scaled(self, g: float) -> Level:
        return Level(self.q50 * g, self.q99 * g, self.c99 * g * g, self.sd * g, self.bias, self.n)


def physical_default(dtype_a: str, dtype_b: str, depth: float | None) -> Level:
    """The noise a correct pair shows at ``depth`` from rounding alone (module docstring)."""
    d = max(0.0, float(depth or 0.0))
    u = unit(dtype_a, dtype_b)
    coarse = dtype_a if UNIT.get(dtype_a, 0) >= UNIT.get(dtype_b, 0) else dtype_b
    if coarse in ("float32", "float64"):
        u *= FP32_REDUCTION
    if dtype_a == dtype_b and coarse in ("bfloat16", "float16"):
        u *= math.sqrt(2.0)
    q50 = 0.8 * u * math.sqrt(1.0 + 8.0 * d)
    q99 = 2.5 * q50
    return Level(q50, q99, 0.5 * q99 * q99, q50)


def one_rounding(dtype_a: str, dtype_b: str, depth: float | None) -> Level:
    """The lowest level honest noise can be at ``depth`` for a state of these dtypes: one rounding
    of the coarser dtype, growing as independent roundings add (never zero: fp32 pairs that match
    bit for bit still allow a rounding)."""
    d = max(0.0, float(depth or 0.0))
    u = unit(dtype_a, dtype_b)
    return Level(u, 2 * u, 2 * u * u, u).scaled(math.sqrt(1.0 + d) if d else 1.0)


def fresh_rounding99(dtype_a: str, dtype_b: str, depth_from: float, depth_to: float, measured: float = 0.0,
                     trend: bool = False) -> float:
    """The 99th percentile relative error the layers between two depths may add (their fresh
    rounding, adding independently). ``measured``: the largest per-layer increment the clean states
    before showed (0: none measured, or every state equal bit for bit); then that per layer, never
    under one rounding, else the physical default's growth. Never more than the default's growth,
    never under one rounding: with ``trend`` (a computed state before measured the pair's noise)
    one rounding of the dtype (:func:`one_rounding`), else the physical default's first rounding
    (for fp32 pairs, :data:`FP32_REDUCTION` of them)."""
    one = (one_rounding if trend else physical_default)(dtype_a, dtype_b, 0.0).q99
    hi, lo = physical_default(dtype_a, dtype_b, depth_to).q99, physical_default(dtype_a, dtype_b, depth_from).q99
    default = max(math.sqrt(max(hi * hi - lo * lo, 0.0)), one)
    if measured <= 0:
        return default
    return min(default, max(measured, one) * math.sqrt(max(1.0, depth_to - depth_from)))


def level_of(rel: NDArray[np.floating], one_minus_cos: NDArray[np.floating],
             log_ratio: NDArray[np.floating]) -> Level | None:
    """The level of per-token errors (finite tokens only); None with fewer than MIN_TOKENS."""
    ok = np.isfinite(rel) & np.isfinite(one_minus_cos) & np.isfinite(log_ratio)
    if int(ok.sum()) < MIN_TOKENS:
        return None
    r, c, lr = rel[ok].astype(np.float64), one_minus_cos[ok].astype(np.float64), log_ratio[ok].astype(np.float64)
    med = order_stats(lr, (0.5,))[0]
    r50, r99 = order_stats(r, (0.5, 0.99))
    return Level(r50, r99, order_stats(np.maximum(c, 0.0), (0.99,))[0],
                 float(1.4826 * order_stats(np.abs(lr - med), (0.5,))[0]), med, int(ok.sum()))


def order_stats(x: NDArray[np.float64], qs: Sequence[float]) -> list[float]:
    """``np.quantile(x, q)`` (its default, linear method; 0.5 as ``np.median``) of a finite 1-D
    float64 array for each ``q``, the same bits, from one partial sort of a copy: numpy's own
    functions cost more in their argument handling than in the sort at a few thousand values.
    A zero comes out as +0.0: which of -0.0 and 0.0 numpy returns depends on where its own
    partition leaves equal values (and a later division by the figure must not turn on it)."""
    n = len(x)
    if n == 0:
        raise ValueError("order statistics of an empty array")
    at: list[tuple[int, int, float]] = []
    for q in qs:
        if q == 0.5:   # np.median: the middle value, or the mean of the two middle ones
            at.append((n // 2 - 1 if n % 2 == 0 else n // 2, n // 2, -1.0))
            continue
        v = (n - 1) * q   # numpy's virtual index for the linear method
        lo = math.floor(v)
        at.append((lo, lo, 0.0) if v >= n - 1 else (lo, lo + 1, v - lo))
    part = np.partition(x, sorted({k for a, b, _ in at for k in (a, b)}))
    out = []
    for lo, hi, g in at:
        a, b = float(part[lo]), float(part[hi])
        if g < 0:
            v = a if lo == hi else (a + b) / 2
        else:   # numpy's _lerp, its two branches
            d = b - a
            v = b - d * (1 - g) if g >= 0.5 else a + d * g
        out.append(v + 0.0)   # a zero as +0.0 (see the docstring)
    return out


@dataclass
class StateNoise:
    """One catalog state recorded on both sides: its level, the prediction from the clean states
    before it, and whether it leaves the trend."""

    label: str
    depth: float
    level: Level
    predicted: float = 0.0     # predicted median relative error (from the states before)
    clean: bool = True
    why: str = ""              # how it leaves the trend: level (median error), tokens (its 99th
                               # percentile: a subset of tokens) or scale (median log RMS ratio)
    bias_limit: float = 0.0    # the largest median log RMS ratio the states before it allow
    predicted99: float = 0.0   # predicted 99th percentile relative error
    first: bool = False        # no clean state before it: its limits are the dtype default's
    dtypes: tuple[str, str] = ("", "")   # the dtype pair it was computed in

    @property
    def jump(self) -> float:
        return self.level.q50 / self.predicted if self.predicted > 0 else math.inf


def measures(s: StateNoise, dtypes: tuple[str, str]) -> bool:
    """Whether the clean state ``s`` measured the noise of this pair for a deeper state of
    ``dtypes``: a computed state (not the embedding, a lookup both sides round alike), most of
    its tokens apart (a median of zero: the sides match bit for bit there, which says nothing of
    a layer that computes differently), measured on at least :data:`TREND_TOKENS` tokens, of the
    same dtype pair. Then its trend sets the expectation, floored at one rounding of the dtype;
    else the physical default floors it."""
    return (s.clean and s.depth > 0 and s.level.q50 > 0 and s.level.n >= TREND_TOKENS
            and s.dtypes == tuple(dtypes))


@dataclass
class SlotNoise:
    """One slot of a packed tensor both sides recorded (module docstring, "Packed slots"): its
    level, the worst of its sampled tokens, what the clean slots before it expect of it, and
    whether it stays within that expectation."""

    label: str
    depth: float
    level: Level
    worst_rel: float           # the largest relative error of its sampled tokens
    worst_c: float             # the largest 1 - cos of its sampled tokens
    expected: Level | None = None
    clean: bool = True


@dataclass
class NoiseModel:
    dtype_a: str
    dtype_b: str
    states: list[StateNoise] = field(default_factory=list)
    slots: list[SlotNoise] = field(default_factory=list)

    @property
    def measured(self) -> bool:
        return any(s.clean for s in self.states)

    @property
    def slot_scaled(self) -> bool:
        """Whether a slot's expectation stands above the physical default because a clean slot
        before it measured more noise than the default allows (no catalog state measured)."""
        return not self.measured and any(_above_default(self.dtype_a, self.dtype_b, s) for s in self.slots)

    @property
    def source(self) -> str:
        if self.measured:
            return "measured trend"
        if self.slot_scaled:
            return f"default for {_pair(self.dtype_a, self.dtype_b)} scaled to the slots before it"
        return f"default for {_pair(self.dtype_a, self.dtype_b)}, not measured"

    @property
    def first_jump(self) -> StateNoise | None:
        return next((s for s in self.states if not s.clean), None)

    def floor(self, depth: float | None) -> Level:
        """The lowest level honest noise can be (never zero: fp32 pairs that match bit for bit
        still allow a rounding)."""
        return one_rounding(self.dtype_a, self.dtype_b, depth)

    def expected(self, depth: float | None, dtypes: tuple[str, str] | None = None) -> Level:
        """The noise expected at ``depth``: from the clean measured states at or before it only
        (the nearest, grown to ``depth`` by the trend of the clean states up to it; the worst of
        those within a layer below), never under the floor; with none at or before it, the
        physical default. A state deeper than ``depth`` never sets its allowance: a bug there
        that stays inside the trend would otherwise widen the allowance of every state before it
        (and a bit-identical state would take a deeper layer's noise)."""
        d = max(0.0, float(depth or 0.0))
        if not self.measured:
            return self.slot_expected(d) or physical_default(self.dtype_a, self.dtype_b, d)
        dt = dtypes or (self.dtype_a, self.dtype_b)
        below = [s for s in self.states if s.clean and s.depth <= d]
        if below:
            ref = below[-1]
            lv = ref.level.scaled(_grown(self.growth(d), d - ref.depth))
        else:   # shallower than every measured state: nothing before it measures its noise
            lv = physical_default(self.dtype_a, self.dtype_b, d)
        # the worst of the clean states within a layer below (percentiles of a few hundred
        # tokens wobble)
        near = [s.level for s in below if d - s.depth <= 1.0]
        # never under one rounding of a state of these dtypes where the nearest clean state
        # measured this pair's noise (:func:`measures`); else never under the physical default's
        # first rounding: a trend of states that match bit for bit, or of another dtype pair (an
        # autocast state, a coarser tensor), says nothing of the noise of this one. The floor is
        # never above the default's first rounding (a measured trend only ever tightens it)
        fl = physical_default(*dt, 0.0)
        if below and measures(below[-1], dt):
            fl = _lowest(fl, one_rounding(*dt, 0.0))
        return Level(max([lv.q50, fl.q50] + [x.q50 for x in near]), max([lv.q99, fl.q99] + [x.q99 for x in near]),
                     max([lv.c99, fl.c99] + [x.c99 for x in near]), max([lv.sd, fl.sd] + [x.sd for x in near]),
                     max([abs(lv.bias)] + [abs(x.bias) for x in near]))

    def slot_expected(self, depth: float) -> Level | None:
        """The noise expected at ``depth`` from the clean packed slots strictly before it (the
        deepest of them): the physical default at ``depth`` scaled by how far that slot's
        measured level sits above the default at its own depth, never under the default; None
        where no clean slot lies before ``depth`` (or a catalog state was measured: the trend of
        the catalog rules)."""
        if self.measured:
            return None
        ref = next((s for s in reversed(self.slots) if s.clean and s.depth < depth), None)
        if ref is None:
            return None
        # a slot that measured this pair's noise (a computed state, its tokens apart, enough of
        # them) rules below the default too, floored at one rounding of the dtype
        trend = ref.depth > 0 and ref.level.q50 > 0 and ref.level.n >= TREND_TOKENS
        return default_scaled(self.dtype_a, self.dtype_b, ref.depth, ref.level, depth, trend)

    def growth(self, depth: float | None = None) -> float:
        """Per-layer growth of the median error among consecutive clean states (at least 1), of
        those at or before ``depth`` (None: all)."""
        clean = [s for s in self.states if s.clean and s.depth >= 1 and (depth is None or s.depth <= depth)]
        rs = [(b.level.q50 / a.level.q50) ** (1.0 / (b.depth - a.depth)) for a, b in zip(clean, clean[1:])
              if a.level.q50 > 0 and b.depth > a.depth]
        return max(1.0, statistics.median(rs)) if rs else GROWTH_DEFAULT   # np.median's bits, without its overhead

    def describe(self, depth: float | None) -> str:
        return self.source


def _lowest(x: Level, y: Level) -> Level:
    """Each figure the lower of the two."""
    return Level(min(x.q50, y.q50), min(x.q99, y.q99), min(x.c99, y.c99), min(x.sd, y.sd), min(x.bias, y.bias))


def default_scaled(dtype_a: str, dtype_b: str, ref_depth: float, ref: Level, depth: float,
                   trend: bool = False) -> Level:
    """The physical default at ``depth``, each figure scaled by how far the measured level
    ``ref`` at ``ref_depth`` sits above the default there (never by less than 1): the noise
    of this engine pair beyond rounding alone, carried to a deeper state along the default's
    own growth with depth. With ``trend`` (``ref`` measured this pair's noise) it is scaled
    below the default too where ``ref`` sits under it (an fp32 port's noise is a few roundings,
    the default's FP32_REDUCTION more), never under one rounding of the dtype at ``depth``."""
    p0, p = physical_default(dtype_a, dtype_b, ref_depth), physical_default(dtype_a, dtype_b, depth)
    lo = one_rounding(dtype_a, dtype_b, depth)

    def k(measured: float, default: float) -> float:
        if not (default > 0 and math.isfinite(measured)):
            return 1.0
        return measured / default if trend else max(1.0, measured / default)

    if not trend:
        return Level(p.q50 * k(ref.q50, p0.q50), p.q99 * k(ref.q99, p0.q99), p.c99 * k(ref.c99, p0.c99),
                     p.sd * k(ref.sd, p0.sd), abs(ref.bias))
    return Level(max(lo.q50, p.q50 * k(ref.q50, p0.q50)), max(lo.q99, p.q99 * k(ref.q99, p0.q99)),
                 max(lo.c99, p.c99 * k(ref.c99, p0.c99)), max(lo.sd, p.sd * k(ref.sd, p0.sd)), abs(ref.bias))


def _above_default(dtype_a: str, dtype_b: str, s: SlotNoise) -> bool:
    """Whether a slot's expectation is not the default's: above it, or below it where the slot
    before it measured less."""
    e, p = s.expected, physical_default(dtype_a, dtype_b, s.depth)
    return e is not None and (e.q50 != p.q50 or e.q99 != p.q99 or e.c99 != p.c99 or e.sd != p.sd
                              or e.bias > max(p.sd, p.q50 / 4))   # a bias only where it moves the scale limit


def fit_slots(model: NoiseModel, slots: Sequence[tuple[str, float, Level, float, float]]) -> NoiseModel:
    """The packed slots both sides recorded, ``(label, depth, level, worst rel, worst 1 - cos)``,
    walked in depth order into ``model.slots`` (module docstring, "Packed slots"): each slot's
    expectation comes from the clean slots before it only (the shallowest: the physical default);
    a slot is clean while its median error, its worst token's relative error and 1 - cos and its
    median RMS ratio all stay within what that expectation allows (a slot that would itself be
    judged a divergence measures nothing), and no slot before it left the trend (a deeper slot
    inherits the error of a shallower one). Used only where no catalog state was measured."""
    model.slots = []
    left = False
    for label, depth, lv, worst_rel, worst_c in sorted(slots, key=lambda x: x[1]):
        s = SlotNoise(label, depth, lv, worst_rel, worst_c)
        s.expected = model.slot_expected(depth)
        e = s.expected or physical_default(model.dtype_a, model.dtype_b, depth)
        within = (lv.q50 <= LEVEL * e.q50 and worst_rel <= TOKEN * e.q99 and worst_c <= TOKEN * TOKEN * e.c99
                  and abs(lv.bias) <= SCALE * max(e.sd, abs(e.bias), e.q50 / 4))
        s.clean = within and not left
        left = left or not within
        model.slots.append(s)
    return model


def _pair(a: str, b: str) -> str:
    short = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float64": "fp64"}
    return f"{short.get(a, a)} vs {short.get(b, b)}"


def fit(dtype_a: str, dtype_b: str, measured: Sequence[tuple[str, float, Level]],
        dtypes: dict[str, tuple[str, str]] | None = None,
        first_limit: Callable[[str, str, float], float] | None = None) -> NoiseModel:
    """The noise model from the levels of the states both sides recorded, ``(label, depth, level)``.
    ``dtypes``: each state's own dtype pair (default: the model's); ``first_limit(dtype_a,
    dtype_b, depth)``: the largest median error the shallowest measured state may show (it has
    no state before it to predict it; the dtype default's allowance), default JUMP x the physical
    default."""
    model = NoiseModel(dtype_a, dtype_b)
    clean: list[StateNoise] = []
    increments: list[float] = []
    for label, depth, lv in sorted(measured, key=lambda m: (m[1], m[0] == "final_norm")):
        da, db = (dtypes or {}).get(label, (dtype_a, dtype_b))
        s = StateNoise(label, depth, lv, dtypes=(da, db))
        # rounding alone can do this much where nothing before measured this pair's noise; where a
        # computed state before did, its trend rules, floored at one rounding of the dtype (the
        # default's FP32_REDUCTION roundings sit 3 to 30x above an fp32 port's measured noise)
        trend = bool(clean) and measures(clean[-1], (da, db))
        lowest = one_rounding(da, db, depth)
        phys = physical_default(da, db, depth).q50
        fl = max(model.floor(depth).q50, lowest.q50 if trend else phys)
        phys99 = physical_default(da, db, depth).q99
        floor99 = lowest.q99 if trend else phys99
        if not clean:
            # the shallowest state has nothing before it to predict it: honest noise there depends
            # on the model and the engines (a TF32 matmul, a random-weight model's growth), so it
            # leaves the trend only past the dtype default's allowance
            limit = first_limit(da, db, depth) if first_limit is not None else JUMP * phys
            pred = max(limit / JUMP, fl)
            s.first = True
            s.predicted99 = max(limit, phys99)
        else:
            ref = clean[-1]
            g = model.growth() if len(clean) >= 2 else (GROWTH_FIRST if ref.depth == 0 else GROWTH_DEFAULT)
            pred = max(ref.level.q50, model.floor(ref.depth).q50) * _grown(g, max(1.0, depth - ref.depth
                                                                                  if depth > ref.depth else 1.0))
            steps = max(1.0, depth - ref.depth if depth > ref.depth else 1.0)
            trend99 = ref.level.q99 * _grown(g, steps)
            if depth == ref.depth:   # final_norm beside the last boundary: a norm rescales, same depth
                pred = max(ref.level.q50, fl) * GROWTH_FIRST
                s.predicted99 = max(ref.level.q99 * GROWTH_FIRST, floor99)
            elif depth > 0 and all(c.depth == 0 for c in clean):
                # the first computed state after the embedding: the embedding is a lookup rounded once,
                # so its tail (99th percentile about 1.3x its median) says nothing of the tail of a
                # computed state, whose tokens of small norm carry a larger relative error; its tail
                # may be TAIL x its predicted median (its median and RMS ratio are still predicted
                # from the embedding)
                s.predicted99 = max(trend99, phys99, TAIL * max(pred, fl))
            else:
                # a computed state measured before it: its tail is the trend's plus the fresh rounding
                # of the layers in between (what the clean layers added, at least one rounding), not
                # the default's whole depth, which can sit far above a measured trend: a subset of
                # tokens (decode rows) moved by a bug far past the trend would stay under it, keep the
                # trend and loosen every deeper state's tolerance
                fresh = fresh_rounding99(da, db, ref.depth, depth, max(increments, default=0.0), trend)
                s.predicted99 = max(trend99, min(phys99, math.hypot(trend99, fresh)))
        s.predicted = max(pred, fl)
        # honest rounding is unbiased: a median RMS ratio past what the states before show (their
        # spread and bias) is a scale introduced here, even while the median error keeps the trend
        ref_lv = clean[-1].level if clean else physical_default(dtype_a, dtype_b, depth)
        s.bias_limit = SCALE * max(ref_lv.sd * GROWTH_FIRST, abs(ref_lv.bias), s.predicted / 4)
        if model.first_jump is not None:
            s.clean = False
        elif lv.q50 > JUMP * s.predicted:
            s.clean, s.why = False, "level"
        elif lv.q99 > TOKEN * s.predicted99:   # a subset of its tokens far outside the noise
            s.clean, s.why = False, "tokens"
        elif abs(lv.bias) > s.bias_limit:
            s.clean, s.why = False, "scale"
        model.states.append(s)
        if s.clean:
            if clean and depth > clean[-1].depth:
                # the tail this layer added to the one before, per layer (quadrature: independent)
                lo = clean[-1].level.q99
                increments.append(math.sqrt(max(lv.q99 * lv.q99 - lo * lo, 0.0) / (depth - clean[-1].depth)))
            clean.append(s)
    return model


def tolerance(model: NoiseModel, depth: float | None, dtype_a: str | None = None,
              dtype_b: str | None = None) -> tuple[float, float]:
    """(min_cos, max_rel) a token of a state of these dtypes must meet at ``depth``."""
    e = model.expected(depth, (dtype_a, dtype_b) if dtype_a and dtype_b else None)
    return max(-1.0, 1.0 - TOKEN * TOKEN * e.c99), TOKEN * e.q99


@dataclass
class SlotJudgement:
    """What the noise model says of one compared state or slot beyond its tokens' tolerance."""

    part: str = ""            # "" (within the noise) | level | scale | rescaled
    value: float = 0.0        # the failing number (median rel err, RMS ratio, ratio spread)
    limit: float = 0.0        # its limit
    ratio_lo: float = 1.0     # 5th / 95th percentile of the per-token RMS ratio
    ratio_hi: float = 1.0


def judge(model: NoiseModel, depth: float | None, q50: float, c99: float, lr_mean: float, lr_sd: float,
          n: int, ratio_lo: float, ratio_hi: float, dtypes: tuple[str, str] | None = None) -> SlotJudgement:
    """A state or slot's distribution against the expected noise at its depth: a systematic
    scale (mean log RMS ratio), a per-token rescaling (its spread), else a median error out of
    the noise. ``c99``: 99th percentile of 1 - cos (the direction must agree, on all but a few
    tokens, for a scale: a subset of corrupted tokens is not a rescaling)."""
    e = model.expected(depth, dtypes)
    j = SlotJudgement(ratio_lo=ratio_lo, ratio_hi=ratio_hi)
    if n < MIN_TOKENS:
        return j
    direction_ok = c99 <= TOKEN * TOKEN * e.c99
    se = lr_sd / math.sqrt(n) if n > 1 else math.inf
    scale_lim = SCALE * max(e.sd, abs(e.bias), e.q50 / 4)
    if direction_ok and abs(lr_mean) > scale_lim and abs(lr_mean) > SCALE_Z * se:
        j.part, j.value, j.limit = "scale", math.exp(lr_mean), scale_lim
        return j
    spread_lim = SPREAD * max(e.sd, e.q50 / 4)
    if direction_ok and lr_sd > spread_lim:
        j.part, j.value, j.limit = "rescaled", lr_sd, spread_lim
        return j
    if q50 > LEVEL * e.q50:
        j.part, j.value, j.limit = "level", q50, LEVEL * e.q50
    return j


_LAYER_IN_NAME = re.compile(r"(?:^|[._/])(?:layers?|h|blocks?|decoder_layers?)[._/](\d+)(?:[._/]|$)")
_EMBED_IN_NAME = re.compile(r"(?:^|[._/])(?:embed_tokens|embed|wte|word_embeddings|tok_embeddings)(?:[._/]|$)")


def _grown(g: float, steps: float) -> float:
    """``g ** steps``, saturating at the largest float: a state far deeper than the measured ones
    (a label or name from a file) must not overflow the expectation."""
    try:
        return float(g ** steps)
    except OverflowError:
        return sys.float_info.max


def name_depth(name: str) -> float | None:
    """The depth a module-hook name points at, when it names one: inside decoder layer i (its
    output is boundary i + 1: ``model.layers.3.mlp`` -> 4), the embedding (0); None otherwise. A
    tensor with no boundary index is otherwise judged at the deepest layer's noise, which would
    hide an embedding's error under the last layer's."""
    m = _LAYER_IN_NAME.search(name)
    if m:
        i = int(m.group(1)) if len(m.group(1)) <= 6 else MAX_BOUNDARY
        return float(i + 1) if i < MAX_BOUNDARY else None   # no model is that deep: not a layer index
    if _EMBED_IN_NAME.search(name):
        return 0.0
    return None
