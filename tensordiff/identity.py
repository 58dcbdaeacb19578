"""What a slot holds: every recorded state of either side (the catalogs), per (label, side, token
offset), scored against the slot on the sampled tokens, and the rule that turns the scores into a
decision with evidence. docs/diff.md §3 states the rule; in short, in this order:

1. exact: an own-side state with full values equal to the slot within a few eps of the coarser
   dtype on every token -> ``holds`` it.
2. direction: candidates grouped by (label, offset), ranked by mean per-token cosine; the best is
   tested against every other with a paired per-token test (share of tokens where it is closer,
   and z = mean / standard error of the per-token cosine differences). Those it does not beat
   significantly are tied with it.
3. noise floor: the best must be as close as the same state is across the two sides (the 1 - cos
   that boundaries recorded on both sides show in this diff); else ``no_state`` (closest to X).
4. ties: broken by scale (the one tied state whose per-token RMS matches, e.g. the pre-norm last
   boundary vs ``final_norm``); otherwise ``ambiguous`` between the tied states.
5. scale: the chosen state's median RMS ratio far from 1 -> ``scaled`` (holds X scaled by r).

Pure numpy on arrays (:mod:`tensordiff.catalog` reads the rows), so it is tested without files.

Streamed: :func:`score` reduces one candidate to its per-token cosines and RMS ratios (and, for an
own-side state, whether it is the same data), after which its rows can be dropped; :func:`decide_scored`
decides from those scores alone. So a search holds a bounded batch of candidates' rows at a time,
whatever the catalog's size (:func:`score_many` scores a batch against every slot at once, to the
same bits); :func:`decide` (all candidates' rows at once) is the same rule on the same numbers.

Why one module of this size: the scoring and the decision rule are read together (docs/diff.md §3);
a rule split from the scores it reads is how a confident wrong sentence slips in.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import numpy as np
from numpy.typing import NDArray

from .details import Candidate, IdentityEvidence
from .dtypes import bf16_bits_to_f32
from .numerics import finite_or_zero, row_dots, row_dots_at

OFFSETS = (0, -1, 1, -2, 2)  # token offsets tried, the same token first
MIN_TOKENS = 4               # a candidate needs rows at this many sampled tokens (or all of them)
Z_MIN = 3.0                  # paired test: the best beats another when z >= Z_MIN ...
WIN_MIN = 0.75               # ... and it is closer on at least this share of the tokens
EXACT_EPS = 4.0              # exact: per-token relative error <= EXACT_EPS x eps of the coarser dtype
FLOOR_FACTOR = 4.0           # within the noise floor: 1 - cos <= FLOOR_FACTOR x floor + COS_SLACK
COS_SLACK = 2e-6             # slack for rows rounded to float32 (sketches, values); the sums are float64
SCALE_TOL = 0.05             # a median RMS ratio this far from 1 is a scale; closer when the measured
SCALE_MIN = 0.005            # noise is smaller (3 x its 99th-percentile rel err, at least SCALE_MIN)
DIFF_EPS = 1e-6              # per-token cosine differences this small are ties (float32-rounded rows)

F32 = NDArray[np.float32]
Rows = NDArray[Any]   # float32 values: float32 arrays, or their exact float64 copies (the same sums)
_NO_ROWS: F32 = np.zeros((0, 0), np.float32)
_NO_RMS: F32 = np.zeros(0, np.float32)


@dataclass
class Target:
    """The slot's own rows at the sampled tokens, in one basis (full values or sketches)."""

    data: F32            # [n, w], NaN/Inf already zeroed
    rms: F32             # [n]
    norms: NDArray[np.float64] | None = None   # the rows' row_norms, when computed with them


@dataclass
class CandidateRows:
    """One recorded state at the sampled tokens shifted by ``offset``: ``ok`` [n] marks the
    sampled tokens where it has a row; ``data``/``rms`` hold those rows only (``data``: float32
    values, as float32 or as their exact float64 copy: every sum widens each element to float64
    first, so the numbers are the same either way). ``exact_tol``: for
    an own-side state in the same basis, the per-token relative error under which it is the same
    data (None: the exact rule does not apply). ``norms``: the rows' L2 norms as
    :func:`per_token_cos` computes them, when a caller scores the same rows against several slots."""

    label: str
    side: str            # "a" or "b": whose catalog
    offset: int
    basis: str           # "values" or "sketch"
    ok: NDArray[np.bool_]
    data: Rows
    rms: F32
    exact_tol: float | None = None
    norms: NDArray[np.float64] | None = None
    at: NDArray[np.int64] | None = None   # the rows are data[at] (None: data itself)
    #: ``data`` holds bfloat16 bits (uint16), e.g. the stored rows mapped in place: scored as
    #: they lie (the kernel widens them as the float32 copy would be), converted only by rows()
    bf16: bool = False

    def rows(self) -> Rows:
        """The candidate's rows at the tokens of ``ok`` (float32 values)."""
        r = self.data if self.at is None else self.data[self.at]
        return bf16_bits_to_f32(r) if self.bf16 else r


@dataclass
class NoiseFloor:
    """How far apart the same state is across the two sides: 99th percentile of per-token
    1 - cos (and of rel) of a boundary both recorded, or a fallback (``source`` says which)."""

    one_minus_cos: float
    rel: float
    source: str


#: what the identity search decided a slot holds (none: it could not decide, see ``reason``)
Outcome = Literal["holds", "scaled", "no_state", "ambiguous", "none"]


@dataclass
class IdentityVerdict:
    """The decision for one slot. ``outcome``: holds | scaled | no_state | ambiguous | none.
    ``best``: the state it holds (holds / scaled only); ``closest``: the top-ranked state either way."""

    outcome: Outcome = "none"
    best: str | None = None
    closest: str | None = None
    offset: int = 0
    side: str | None = None
    score: float | None = None
    margin: float | None = None
    runner_up: str | None = None
    scale: float | None = None
    tied: list[str] = field(default_factory=list)
    candidates: list[Candidate] = field(default_factory=list)
    evidence: IdentityEvidence = field(default_factory=IdentityEvidence)
    reason: str | None = None

    @property
    def held(self) -> tuple[str, int] | None:
        """(label, offset) when the slot holds a recorded state (at its scale or not)."""
        return (self.best, self.offset) if self.best is not None else None


def clean(x: NDArray[np.float32]) -> F32:
    """Contiguous float32 with NaN/Inf zeroed (the form the scoring expects)."""
    out: F32 = finite_or_zero(np.ascontiguousarray(x, dtype=np.float32))
    return out


def clean_with_norms(x: NDArray[np.float32]) -> tuple[F32, NDArray[np.float64]]:
    """:func:`clean` and the :func:`row_norms` of its result, in one pass over rows that are
    finite (a float32 row's sum of squares in float64 cannot overflow, so it is finite exactly
    when every element is); rows with a NaN/Inf are zeroed there and measured again."""
    data = np.ascontiguousarray(x, dtype=np.float32)
    sq = row_dots(data, data)
    if np.isfinite(sq).all():
        return data, np.sqrt(sq)
    data = clean(data)
    return data, row_norms(data)


def row_norms(x: Rows) -> NDArray[np.float64]:
    """L2 norm of each row, accumulated in float64 (the norms :func:`per_token_cos` uses)."""
    out: NDArray[np.float64] = np.sqrt(row_dots(x, x))
    return out


def per_token_cos(x: F32, c: Rows, nx: NDArray[np.float64] | None = None,
                  nc: NDArray[np.float64] | None = None) -> NDArray[np.float64]:
    """Cosine of each row of x with the same row of c; 1 where both rows are zero, 0 where one is.
    ``nx``/``nc``: the rows' :func:`row_norms`, when the caller has them (the same numbers)."""
    dots = row_dots(x, c)
    nx = row_norms(x) if nx is None else nx
    nc = row_norms(c) if nc is None else nc
    den = nx * nc
    out: NDArray[np.float64] = np.where(den > 0, dots / np.where(den > 0, den, 1.0),
                                        np.where((nx == 0) & (nc == 0), 1.0, 0.0))
    return np.clip(out, -1.0, 1.0)


def _nz(x: NDArray[np.floating]) -> NDArray[np.floating]:
    """``np.nan_to_num(x)`` (the same values), without its passes when everything is finite."""
    return x if np.isfinite(x).all() else np.nan_to_num(x)


def _rms_ratio(rx: F32, rc: F32) -> NDArray[np.float64]:
    rx64, rc64 = _nz(rx.astype(np.float64)), _nz(rc.astype(np.float64))
    out: NDArray[np.float64] = np.where(rc64 > 0, rx64 / np.where(rc64 > 0, rc64, 1.0),
                                        np.where(rx64 > 0, np.inf, 1.0))
    return out


@dataclass
class _Scored:
    cand: CandidateRows
    cos_t: NDArray[np.float64]      # per-token cosine on cand.ok
    ratio_t: NDArray[np.float64]    # per-token RMS ratio slot / candidate
    cos: float
    record: Candidate
    exact_rel: float = math.inf     # own-side states: max per-token relative error (inf: not exact)

    @property
    def key(self) -> tuple[str, int]:
        return (self.cand.label, self.cand.offset)

    def median_ratio(self) -> float:
        r = self.ratio_t[np.isfinite(self.ratio_t)]
        return float(np.median(r)) if len(r) else math.nan


def _score(target: Target, cand: CandidateRows) -> _Scored:
    x = target.data[cand.ok]
    c = cand.rows()
    cos_t = per_token_cos(x, c, None, cand.norms)
    rx = target.rms[cand.ok]
    ratio_t = _rms_ratio(rx, cand.rms)
    rxn, rcn = _nz(rx), _nz(cand.rms)
    hi = np.maximum(rxn, rcn).astype(np.float64)
    lo = np.minimum(rxn, rcn).astype(np.float64)
    agree = float(np.mean(np.where(hi > 0, lo / np.where(hi > 0, hi, 1.0), 1.0))) if len(hi) else 0.0
    cos = float(cos_t.mean()) if len(cos_t) else -1.0
    rec = Candidate(label=cand.label, offset=cand.offset, score=round(cos * agree, 6), cos=round(cos, 6),
                    rms_agreement=round(agree, 6), side=cand.side, basis=cand.basis)
    s = _Scored(cand, cos_t, ratio_t, cos, rec)
    if cand.exact_tol is not None and not _surely_not_exact(cos_t, cand.exact_tol, x.shape[1] if x.ndim == 2 else 0):
        s.exact_rel = _exact_rel(x, c)
    return s


def score(target: Target, cand: CandidateRows) -> _Scored:
    """One candidate's scores against one slot; the candidate's rows are not kept (a search scores
    many at once with :func:`score_many`, to the same numbers)."""
    s = _score(target, cand)
    s.cand = replace(cand, data=_NO_ROWS, rms=_NO_RMS, norms=None, at=None, bf16=False)
    return s


class SlotStack:
    """Several slots (each a :class:`Target` on the same sampled tokens) for :func:`score_many`:
    per slot the rows at the tokens of a list of masks, concatenated, and stacked [slots, rows]
    their norms (as :func:`row_norms`, computed once per slot) and RMS. A mask's rows are gathered
    once (up to ``limit_bytes`` of them kept per slot, as for one slot before; a mask of every
    token is the slot's own rows): at wide rows a fresh gather costs more than its arithmetic."""

    def __init__(self, targets: list[Target], limit_bytes: int = 32 << 20):
        self.targets = targets
        limit_bytes *= max(1, len(targets))
        self._norms = np.stack([row_norms(t.data) for t in targets]) if targets else np.zeros((0, 0))
        self._rms = np.stack([t.rms for t in targets]) if targets else np.zeros((0, 0), np.float32)
        self._cache: dict[bytes, list[F32]] = {}
        self._room = limit_bytes

    def _rows(self, ok: NDArray[np.bool_]) -> list[F32]:
        if ok.all():
            return [t.data for t in self.targets]
        key = ok.tobytes()
        hit = self._cache.get(key)
        if hit is None:
            hit = [t.data[ok] for t in self.targets]
            size = sum(x.nbytes for x in hit)
            if size <= self._room:
                self._room -= size
                self._cache[key] = hit
        return hit

    def rows(self, ok: NDArray[np.bool_]) -> list[F32]:
        """Per slot its rows at the tokens of ``ok``."""
        return self._rows(ok)

    def norms_rms_at(self, oks: list[NDArray[np.bool_]]) -> tuple[NDArray[np.float64], F32]:
        """The norms and RMS [slots, rows] of :meth:`at`, without gathering the rows."""
        at = np.concatenate([np.flatnonzero(ok) for ok in oks]) if len(oks) > 1 else np.flatnonzero(oks[0])
        return self._norms[:, at], self._rms[:, at]


def _runs(lens: list[int]) -> list[tuple[int, int, int, int]]:
    """(first segment, segments, their length, first row) of each run of consecutive segments of
    equal length."""
    out = []
    k = row = 0
    while k < len(lens):
        j = k + 1
        while j < len(lens) and lens[j] == lens[k]:
            j += 1
        out.append((k, j - k, lens[k], row))
        row += (j - k) * lens[k]
        k = j
    return out


def score_many(stack: SlotStack, cands: list[CandidateRows]) -> list[list[_Scored]]:
    """``[[score(t, c) for t in stack.targets] for c in cands]``, the same numbers to the bit,
    computed at once: every candidate's per-token dot products against every slot in one array,
    every slot stacked. Bit for bit because each number comes from the same operations on the same
    values: the dot products and norms are the same kernel sum per row (:func:`row_dots`: a row's
    sum depends neither on the rows around it nor on float32 vs float64 input), everything else
    is elementwise, and each mean or maximum runs along one contiguous row of values (a segment
    of equal-length segments viewed [slots, segments, length]), which numpy reduces as it does a
    1-D array (tests/test_identity_batch.py pins it)."""
    if not cands:
        return []
    lens = [int(c.ok.sum()) for c in cands]
    w = cands[0].data.shape[1] if cands[0].data.ndim == 2 else -1
    if min(lens) == 0 or any(c.data.ndim != 2 or c.data.shape[1] != w or c.at is not None and len(c.at) != n
                             for c, n in zip(cands, lens)):
        return [[score(t, c) for t in stack.targets] for c in cands]
    one = len(cands) == 1
    rc = cands[0].rms if one else np.concatenate([c.rms for c in cands])
    given = [c.norms for c in cands if c.norms is not None]
    S = len(stack.targets)
    # each candidate against each slot's rows at its tokens, no concatenation, no casting (the
    # kernel widens every element to float64 itself); rows given as data[at] are read where they
    # lie (bfloat16 bits included), one call per candidate and slot
    nx, rx = stack.norms_rms_at([c.ok for c in cands])
    x_of: Callable[[int, int], F32] = lambda i, j: stack.rows(cands[j].ok)[i]  # noqa: E731
    dots = np.empty((S, sum(lens)))
    _candidate_dots(stack, cands, lens, dots)
    nc: NDArray[np.float64] = (given[0] if one else np.concatenate(given)) if len(given) == len(cands) \
        else np.concatenate([row_norms(c.rows()) for c in cands])
    bounds = np.cumsum([0] + lens).tolist()
    segs = [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:])]
    den = nx * nc
    cos_t = np.clip(np.where(den > 0, dots / np.where(den > 0, den, 1.0), np.where((nx == 0) & (nc == 0), 1.0, 0.0)),
                    -1.0, 1.0)
    ratio_t = _rms_ratio(rx, rc)
    rxn, rcn = _nz(rx), _nz(rc)
    hi = np.maximum(rxn, rcn).astype(np.float64)
    lo = np.minimum(rxn, rcn).astype(np.float64)
    agree_t = np.where(hi > 0, lo / np.where(hi > 0, hi, 1.0), 1.0)
    exact = [c.exact_tol is not None for c in cands]
    miss = 1.0 - cos_t * cos_t if any(exact) else None  # see _surely_not_exact
    K = len(cands)
    cos_m, agree_m, worst_m = np.empty((S, K)), np.empty((S, K)), np.full((S, K), np.inf)
    for k, cnt, n, first in _runs(lens):
        block = slice(first, first + cnt * n)
        cos_m[:, k:k + cnt] = cos_t[:, block].reshape(S, cnt, n).mean(axis=2)
        agree_m[:, k:k + cnt] = agree_t[:, block].reshape(S, cnt, n).mean(axis=2)
        if miss is not None:
            worst_m[:, k:k + cnt] = miss[:, block].reshape(S, cnt, n).max(axis=2)
    cos_l, agree_l, worst_l = cos_m.T.tolist(), agree_m.T.tolist(), worst_m.T.tolist()
    out = []
    for j, c in enumerate(cands):
        seg = segs[j]
        cos, agree, worst = cos_l[j], agree_l[j], worst_l[j]
        stripped = replace(c, data=_NO_ROWS, rms=_NO_RMS, norms=None, at=None, bf16=False)
        bound = _exact_bound(c.exact_tol, w) if c.exact_tol is not None else 0.0
        row = []
        for i in range(S):
            co, ag = cos[i], agree[i]
            rec = Candidate(label=c.label, offset=c.offset, score=round(co * ag, 6), cos=round(co, 6),
                            rms_agreement=round(ag, 6), side=c.side, basis=c.basis)
            sc = _Scored(stripped, cos_t[i, seg], ratio_t[i, seg], co, rec)
            if exact[j] and not worst[i] > bound:
                sc.exact_rel = _exact_rel(x_of(i, j), c.rows())
            row.append(sc)
        out.append(row)
    return out


def _candidate_dots(stack: SlotStack, cands: list[CandidateRows], lens: list[int], dots: NDArray[np.float64]) -> None:
    """``dots[i, segment of c]``: each candidate's per-token dot products against slot ``i``'s
    rows at its tokens. The candidates that score rows of one array in place (a state at its
    offsets) take one kernel call per slot, the slot's rows and theirs picked by index; the others
    one call per candidate and slot on the slot's gathered rows. Each dot product is the kernel's
    sum over one pair of rows whatever else the call holds, so both give the same bits."""
    starts = np.cumsum([0] + lens[:-1]).tolist()
    groups: dict[tuple[int, bool], list[int]] = {}
    for j, c in enumerate(cands):
        if c.at is not None:
            groups.setdefault((id(c.data), c.bf16), []).append(j)
        else:
            for i, x in enumerate(stack.rows(c.ok)):
                row_dots_at(x, c.data, ci=c.at, c_bf16=c.bf16, out=dots[i, starts[j]:starts[j] + lens[j]])
    for members in groups.values():
        first = cands[members[0]]
        xi = np.concatenate([np.flatnonzero(cands[j].ok) for j in members])
        ci = np.concatenate([np.asarray(cands[j].at, np.int64) for j in members])
        where = np.concatenate([np.arange(starts[j], starts[j] + lens[j]) for j in members])
        for i, t in enumerate(stack.targets):
            dots[i, where] = row_dots_at(t.data, first.data, xi=xi, ci=ci, c_bf16=first.bf16)


def _surely_not_exact(cos_t: NDArray[np.float64], tol: float, width: int) -> bool:
    """True when some token's direction alone puts its relative error past ``tol``: for cos >= 0,
    |x - c| / |c| >= sin(angle), so 1 - cos^2 > tol^2 rules the state out (the margin covers the
    float64 rounding of the cosine, ~width x 1e-16). Saves the float64 pass on every state that
    is merely close."""
    if not len(cos_t):
        return False
    return float(np.max(1.0 - cos_t * cos_t)) > _exact_bound(tol, width)


def _exact_bound(tol: float, width: int) -> float:
    return tol * tol + 1e-9 + 1e-14 * width


def _exact_rel(x32: F32, c32: Rows) -> float:
    x = x32.astype(np.float64)
    c = c32.astype(np.float64)
    num = np.sqrt(((x - c) ** 2).sum(axis=1))
    den = np.sqrt((c ** 2).sum(axis=1))
    rel = np.where(den > 0, num / np.where(den > 0, den, 1.0), np.where(num > 0, np.inf, 0.0))
    return float(rel.max()) if len(rel) else math.inf


def paired_test(best: _Scored, other: _Scored) -> tuple[int, float | None, float | None]:
    """(tokens both cover, win rate of ``best``, z) on the per-token cosine differences."""
    ok_b, ok_o = best.cand.ok, other.cand.ok
    both = ok_b & ok_o
    n = int(both.sum())
    if n == 0:
        return 0, None, None
    # per-token values of each, restricted to the tokens both cover
    cb = best.cos_t[both[ok_b]]
    co = other.cos_t[both[ok_o]]
    d = cb - co
    d = np.where(np.abs(d) <= DIFF_EPS, 0.0, d)
    win = float((d > 0).mean())
    mean = float(d.mean())
    sd = float(d.std(ddof=1)) if n > 1 else 0.0
    if sd == 0.0:
        z = math.inf if mean > 0 else (0.0 if mean == 0 else -math.inf)
    else:
        z = mean / (sd / math.sqrt(n))
    return n, win, z


def _beats(n: int, win: float | None, z: float | None) -> bool:
    return n >= min(MIN_TOKENS, 2) and win is not None and z is not None and win >= WIN_MIN and z >= Z_MIN


def decide(target: Target, candidates: list[CandidateRows], floor_of: Callable[[str], NoiseFloor],
           n_sample: int) -> IdentityVerdict:
    """The decision for one slot (module docstring). ``floor_of(label)``: the cross-side noise
    floor of that state; ``n_sample``: sampled tokens the slot has rows at."""
    need = min(MIN_TOKENS, max(1, n_sample))
    return decide_scored([_score(target, c) for c in candidates if int(c.ok.sum()) >= need], floor_of, n_sample)


def decide_scored(scored: list[_Scored], floor_of: Callable[[str], NoiseFloor], n_sample: int) -> IdentityVerdict:
    """:func:`decide` on candidates already scored (:func:`score`), in the order :func:`identify`
    gathers them (offset by offset, own catalog first); each must cover enough tokens."""
    need = min(MIN_TOKENS, max(1, n_sample))
    if not scored:
        return IdentityVerdict(reason="no recorded state shares these tokens")
    # one representative per (label, offset): the side closer in direction
    groups: dict[tuple[str, int], _Scored] = {}
    for s in scored:
        g = groups.get(s.key)
        if g is None or s.cos > g.cos:
            groups[s.key] = s
    ranked = sorted(groups.values(), key=lambda s: (-s.cos, abs(s.cand.offset)))
    # the candidates shown: one per (label, offset), the side closer in direction
    records = [g.record for g in sorted(groups.values(), key=lambda s: (-s.record.score, abs(s.cand.offset)))][:5]
    ev = IdentityEvidence()

    # 1. exact
    exact = []
    for s in scored:
        if s.cand.exact_tol is not None:
            rel = s.exact_rel
            if rel <= s.cand.exact_tol:
                exact.append((rel, abs(s.cand.offset), s))
    if exact:
        exact.sort(key=lambda e: (e[0], e[1]))
        rel, _, best = exact[0]
        same = {e[2].key for e in exact}
        ev.exact, ev.exact_rel, ev.exact_tol = True, rel, best.cand.exact_tol
        ev.decided_by = "exact"
        if len(same) > 1:  # two recorded states hold the same data: equal, so either is right
            ev.tied = sorted(lbl for lbl, _ in same if (lbl, _) != best.key)
        return _finish(best, ranked, ev, records, floor_of, outcome="holds")

    # 2. direction: paired tests of the best against every other (label, offset)
    best = ranked[0]
    tied: list[_Scored] = []
    for other in ranked[1:]:
        n, win, z = paired_test(best, other)
        if other is ranked[1]:
            ev.runner_up, ev.runner_up_offset, ev.runner_up_cos = other.cand.label, other.cand.offset, other.cos
            ev.paired_tokens, ev.win_rate, ev.z = n, win, z
        if n >= need and not _beats(n, win, z):
            tied.append(other)
    ev.decided_by = "paired test"

    # 3. ties broken by scale
    if tied:
        contenders = [best] + tied
        unscaled = [s for s in contenders if abs(s.median_ratio() - 1) <= _scale_tol(floor_of(s.cand.label))]
        if len(unscaled) == 1:
            best = unscaled[0]
            ev.decided_by = "scale"
            tied = []
    ev.tied = [f"{s.cand.label}" + (f"{s.cand.offset:+d}" if s.cand.offset else "") for s in tied]
    return _finish(best, ranked, ev, records, floor_of, outcome="ambiguous" if tied else "holds")


def _scale_tol(floor: NoiseFloor) -> float:
    # the band shrinks with the measured noise: a median ratio is far steadier than one token's
    # error, so 3x the 99th percentile of the per-token error bounds honest scale differences
    # (a floor past the fixed band, e.g. one measured on a state that itself diverges, keeps the
    # wider band it always had)
    small = 3 * floor.rel
    return max(SCALE_MIN, small) if small < SCALE_TOL else max(SCALE_TOL, 4 * floor.rel)


def _unscaled_match(s: _Scored, floor_of: Callable[[str], NoiseFloor]) -> bool:
    fl = floor_of(s.cand.label)
    if not len(s.cos_t) or abs(s.median_ratio() - 1) > _scale_tol(fl):
        return False
    return float(np.quantile(1 - s.cos_t, 0.9)) <= FLOOR_FACTOR * fl.one_minus_cos + COS_SLACK


def _finish(best: _Scored, ranked: list[_Scored], ev: IdentityEvidence,
            records: list[Candidate], floor_of: Callable[[str], NoiseFloor], outcome: Outcome) -> IdentityVerdict:
    label, offset = best.key
    fl = floor_of(label)
    q90 = float(np.quantile(1 - best.cos_t, 0.9)) if len(best.cos_t) else math.inf
    ev.cos, ev.tokens = best.cos, len(best.cos_t)
    ev.floor, ev.floor_source = fl.one_minus_cos, fl.source
    ev.within_floor = ev.exact or q90 <= FLOOR_FACTOR * fl.one_minus_cos + COS_SLACK
    r = best.ratio_t[np.isfinite(best.ratio_t)]
    if len(r):
        ev.rms_ratio = float(np.median(r))
        ev.rms_lo, ev.rms_hi = float(np.quantile(r, 0.05)), float(np.quantile(r, 0.95))
    others = [s for s in ranked if s.key != best.key]
    margin = round(best.cos - others[0].cos, 6) if others else None
    v = IdentityVerdict(closest=label, offset=offset, side=best.cand.side, score=best.record.score, margin=margin,
                        runner_up=ev.runner_up, tied=list(ev.tied), candidates=records, evidence=ev)
    if not ev.within_floor:
        v.outcome = "no_state"
    elif outcome == "ambiguous":
        v.outcome = "ambiguous"
    elif ev.rms_ratio is not None and abs(ev.rms_ratio - 1) > _scale_tol(fl) and not ev.exact:
        # a state at another scale only when no state at the slot's own scale matches as well:
        # "holds X" beats "holds Y scaled by r" whenever X is within its noise floor
        alt = next((s for s in ranked if s.key != best.key and _unscaled_match(s, floor_of)), None)
        if alt is not None:
            ev.decided_by = "scale"
            ev.tied = []
            return _finish(alt, ranked, ev, records, floor_of, outcome="holds")
        v.outcome, v.best, v.scale = "scaled", label, ev.rms_ratio
    else:
        v.outcome, v.best = "holds", label
    return v


#: unit roundoff per dtype (half an ulp at 1): two states are one class when, rescaled per token,
#: they are this many roundings apart at most
_UNIT = {"float64": 2.0 ** -53, "float32": 2.0 ** -24, "float16": 2.0 ** -11, "bfloat16": 2.0 ** -9}
#: share of the tokens that must be that close (a token of near-zero norm rounds worse)
CLASS_SHARE = 0.99


def one_class(x: Rows, y: Rows, dtype: str, floor: float = 0.0, scale: NDArray[np.float64] | None = None,
              sketched: bool = False) -> bool:
    """Whether two states' rows at the same tokens are equal up to a per-token scale on
    :data:`CLASS_SHARE` of the tokens: ``y`` against ``x`` rescaled by ``scale`` (per token; None:
    the ratio of the rows' norms), within the rounding of ``dtype`` (the coarser of the two) or, as
    1 - cos, within ``floor`` (the resolution the search decides under) where the scale is a
    rescale (off 1 by over :data:`SCALE_TOL` on most tokens). A final norm is the last layer rescaled per token up to its
    weight's spread, and such states are one identity (neither may be named for the other). The
    rows may be full values or sketches (a sketch of c*x is c times the sketch of x, and ``scale``
    is then the ratio of the recorded RMS; ``sketched`` allows the float32 sum of a sketch, as the
    search does). Rows of zero norm are left out; none left: False."""
    x64, y64 = np.asarray(x, np.float64), np.asarray(y, np.float64)
    nx, ny = np.linalg.norm(x64, axis=1), np.linalg.norm(y64, axis=1)
    c = ny / np.where(nx > 0, nx, 1.0) if scale is None else np.asarray(scale, np.float64)
    ok = (nx > 0) & (ny > 0) & np.isfinite(nx) & np.isfinite(ny) & np.isfinite(c) & (c > 0)
    if not ok.any():
        return False
    # the relative error of x rescaled to y: 2 sin(angle / 2) with the norms' ratio
    rel = np.linalg.norm(y64[ok] - c[ok, None] * x64[ok], axis=1) / ny[ok]
    tol = EXACT_EPS * _UNIT.get(dtype, _UNIT["float32"]) + (1e-5 if sketched else 0.0)
    within = rel <= tol
    # the floor only between states that differ by a rescale (over SCALE_TOL on most tokens: a norm
    # of the other), whose directions the search cannot tell apart under it; states at one scale
    # that differ in direction (a layer and the next, a residual of 3e-4 apart) are told apart by
    # the paired test, below the floor
    if float(np.median(np.abs(c[ok] - 1.0))) > SCALE_TOL:
        within |= 0.5 * rel * rel <= floor
    return bool(float(within.mean()) >= CLASS_SHARE)


def pick_basis(count: dict[str, int]) -> str:
    """The basis a slot is decided in: the one more recorded states can be scored in (``count``:
    states per basis with rows at enough sampled tokens); full values on a tie. Every candidate of
    one decision is scored alike, on one basis."""
    return "values" if count.get("values", 0) >= count.get("sketch", 0) else "sketch"
