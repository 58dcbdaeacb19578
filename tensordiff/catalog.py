"""The catalogs of both sides and the identity search over them: for a slot at sampled aligned
tokens, read every recorded state's rows (at the same token and up to two positions away) and
hand them to :func:`tensordiff.identity.identify`, which scores and decides.

This module reads (through the trace reader and the aligner's row maps); the scoring and the
decision rule are pure numpy in :mod:`tensordiff.identity`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from .align import RowMaps
from .dtypes import EPS, to_float32
from .identity import (
    COS_SLACK,
    EXACT_EPS,
    FLOOR_FACTOR,
    MIN_TOKENS,
    OFFSETS,
    CandidateRows,
    IdentityVerdict,
    NoiseFloor,
    SlotStack,
    Target,
    _Scored,
    clean,
    clean_with_norms,
    decide_scored,
    one_class,
    pick_basis,
    row_norms,
    score_many,
)
from .numerics import row_dots_at
from .tolerances import coarser, default_tolerance
from .progress import Progress, Stage
from .sketch import sketch_np
from .trace import TensorInfo, TraceSource, gather, read_runs, slot_rms
from .vocab import parse_label

Codes = NDArray[np.int64]
BATCH_BYTES = 4 << 20  # candidate rows scored at once (see IdentitySearch.identify)
CLASS_SAMPLE = 256     # tokens read to tell whether two states are one class
#: two states' rows at the same tokens (full values or sketches), the per-token scale from the
#: first to the second (None: the ratio of the rows' norms), the coarser dtype, whether sketched
_ClassRows = tuple[NDArray[np.float32], NDArray[np.float32], "NDArray[np.float64] | None", str, bool]


@dataclass
class SlotScores:
    """What :meth:`IdentitySearch.score` found for the slots of one tensor: every candidate's
    per-token scores per slot (``scored``), or a verdict already (``verdicts``: nothing to score).
    No noise floor enters it: :meth:`IdentitySearch.decide` applies the floors, so a search may be
    scored while the numeric pass that measures them is still running."""

    slots: list[int]
    n_sample: int = 0
    scored: dict[int, list[tuple[int, int, _Scored]]] | None = None
    verdicts: dict[int, IdentityVerdict] | None = None


class Catalog:
    """Every boundary/final_norm state recorded on one side, by label."""

    def __init__(self, r: TraceSource, side: str):
        self.r = r
        self.side = side
        self.states: dict[str, TensorInfo] = {}
        for i in sorted(r.tensors.values(), key=lambda x: x.order):
            if i.kind in ("boundary", "final_norm") and i.label not in self.states:
                self.states[i.label] = i


@dataclass
class _Candidate:
    """A candidate's rows for :meth:`IdentitySearch.score`: ``data`` (float32 values, or the stored
    bfloat16 bits when ``bf16``) whose row ``at[i]`` is the i-th row asked for (None: row i),
    their per-token RMS and L2 norms (float64)."""

    data: np.ndarray
    at: Codes | None
    bf16: bool
    rms: NDArray[np.float32]
    norms: NDArray[np.float64]


#: value dtypes a candidate is scored in place in, and their stored form
_IN_PLACE = {"bfloat16": np.dtype(np.uint16), "float32": np.dtype(np.float32)}


class _Layout:
    """Where a candidate's rows lie at each offset of the sampled tokens: ``rows`` (tensor row
    per sampled token, -1: none), ``enough`` (it has rows at enough of them), ``oks`` (the
    tokens it has rows at), ``union`` (every row needed, ascending: read once) and ``pos``
    (where each offset's rows sit in ``union``). Shared by the candidates with one row map."""

    def __init__(self, rows: list[Codes], need: int):
        self.rows = rows
        self.oks = [r >= 0 for r in rows]
        self.enough = [int(ok.sum()) >= need for ok in self.oks]
        self.union = np.unique(np.concatenate([r[ok] for r, ok in zip(rows, self.oks)]))
        self.pos = [np.searchsorted(self.union, r[ok]) for r, ok in zip(rows, self.oks)]


class IdentitySearch:
    """Identity of slots against the catalogs of both sides of one diff."""

    def __init__(self, ra: TraceSource, rb: TraceSource, maps: RowMaps, progress: Progress):
        self.ra, self.rb, self.maps, self._progress = ra, rb, maps, progress
        self.cat_a, self.cat_b = Catalog(ra, "a"), Catalog(rb, "b")
        #: the cross-side noise floor of a state (set by the diff once the boundaries are compared)
        self.floor_of: Callable[[str], NoiseFloor] = lambda label: NoiseFloor(1e-3, 0.05, "none measured")
        # candidates are read in alternating directions: the trace reader keeps the last 64
        # datasets open (two per candidate), so a search that starts where the last one ended
        # finds the datasets it needs first still open (reopening one costs an HDF5 open and a first
        # chunk read); the order of the scores, and so every verdict, does not depend on it
        self._backwards = False
        #: held around every read of the traces (a diff that scores a search in another thread
        #: while its block reader runs sets one lock for both; reads are never concurrent)
        self.read_lock: contextlib.AbstractContextManager[object] = contextlib.nullcontext()
        #: (label, label) -> the reference side's rows of both states that tell whether they are one
        #: class (equal up to a per-token scale), judged under the floors when asked
        self._classes: dict[tuple[str, str], _ClassRows | None] = {}

    def _target(self, r: TraceSource, info: TensorInfo, rows: Codes, slot: int, basis: str) -> Target:
        """One slot's rows (full values or sketch), their per-token RMS and their norms."""
        with self.read_lock:
            raw = read_runs(r, info.name, "values" if basis == "values" else "sketch", rows)
            rms = slot_rms_at(r, info, rows, slot)
        if basis == "values":
            w = info.slot_width
            data = to_float32(raw, info.dtype)[:, slot * w:(slot + 1) * w]
        else:
            d = r.sketch_dim
            data = np.asarray(raw, np.float32)[:, slot * d:(slot + 1) * d]
        clean_data, norms = clean_with_norms(data)
        return Target(clean_data, rms, norms)

    def one_class(self, x: str, y: str, exact: bool = False) -> bool:
        """Whether catalog states ``x`` and ``y`` are equal up to a per-token scale on the reference
        side (A; B where A lacks either), at up to :data:`CLASS_SAMPLE` tokens both have
        (:func:`tensordiff.identity.one_class`): within rounding, or, where the scale is a rescale
        (a norm of the other), within the noise floor the search decides under (FLOOR_FACTOR x
        the larger of the two states' floors :attr:`floor_of` gives now) unless the match in
        question is ``exact`` (a state matched bit for bit is told apart from any state it is not
        equal to within rounding). On full values where that side recorded both, else on its
        sketches rescaled by its recorded RMS (a sketch of c*x is c times the sketch of x; full
        values of one and a sketch of the other: the values sketched as the trace sketches).
        False where neither side recorded both."""
        if x == y:
            return True
        key = (min(x, y), max(x, y))
        if key not in self._classes:
            self._classes[key] = self._class_rows(*key)
        rows = self._classes[key]
        if rows is None:
            return False
        vx, vy, scale, dtype, sketched = rows
        floor = 0.0 if exact else \
            FLOOR_FACTOR * max(self.floor_of(x).one_minus_cos, self.floor_of(y).one_minus_cos) + COS_SLACK
        return one_class(vx, vy, dtype, floor, scale, sketched)

    def _class_rows(self, x: str, y: str) -> _ClassRows | None:
        for cat in (self.cat_a, self.cat_b):
            ix, iy = cat.states.get(x), cat.states.get(y)
            if ix is None or iy is None:
                continue
            values = ix.has_values and iy.has_values and ix.slot_width == iy.slot_width
            if not values and not ((ix.has_sketch or ix.has_values) and (iy.has_sketch or iy.has_values)):
                continue
            mx, my = self.maps.inverse(cat.side, ix.name), self.maps.inverse(cat.side, iy.name)
            both = np.flatnonzero((mx >= 0) & (my >= 0))
            if len(both) < MIN_TOKENS:
                continue
            pick = both[np.linspace(0, len(both) - 1, min(len(both), CLASS_SAMPLE)).astype(np.int64)]
            got = []
            for info, m in ((ix, mx), (iy, my)):
                rows = np.sort(m[pick])
                with self.read_lock:
                    if values:
                        data = to_float32(read_runs(cat.r, info.name, "values", rows), info.dtype)[:, :info.slot_width]
                    elif info.has_sketch:
                        data = np.asarray(read_runs(cat.r, info.name, "sketch", rows), np.float32)[:, :cat.r.sketch_dim]
                    else:
                        raw = to_float32(read_runs(cat.r, info.name, "values", rows), info.dtype)[:, :info.slot_width]
                        data = sketch_np(raw, info.slot_width, cat.r.sketch_dim, cat.r.sketch_seed)
                    rms = slot_rms_at(cat.r, info, rows, 0)
                # rows in the order of their tokens on both (a side's rows follow its token order)
                back = np.argsort(np.argsort(m[pick]))
                got.append((data[back], np.asarray(rms, np.float64)[back]))
            (vx, rx), (vy, ry) = got
            scale = None if values else ry / np.where(rx > 0, rx, np.nan)
            return vx, vy, scale, coarser(ix.dtype, iy.dtype), not values
        return None

    def identify(self, side: str, info: TensorInfo, slots: list[int], sample: Codes) -> dict[int, IdentityVerdict]:
        """Which recorded state does each slot of ``info`` (on ``side``) hold at the sampled aligned
        tokens? :meth:`score`, then :meth:`decide` (under the noise floors of ``floor_of``)."""
        return self.decide(self.score(side, info, slots, sample))

    def decide(self, found: SlotScores) -> dict[int, IdentityVerdict]:
        """The verdict of each slot from its scores, under the noise floors :attr:`floor_of` gives now."""
        if found.verdicts is not None:
            return dict(found.verdicts)
        assert found.scored is not None
        out = {}
        for s in found.slots:
            # the order decide() gathers them in: offset by offset, own catalog first
            ordered = [x[2] for x in sorted(found.scored[s], key=lambda x: (x[0], x[1]))]
            out[s] = decide_scored(ordered, self.floor_of, found.n_sample)
        return out

    def score(self, side: str, info: TensorInfo, slots: list[int], sample: Codes,
              progress: Progress | None = None) -> SlotScores:
        """Which recorded state does each slot of ``info`` (on ``side``) hold at the sampled aligned
        tokens? Candidates: every catalog state of both sides (own side first), at the same token
        and, when nothing matches there, at tokens shifted by up to two positions.

        Streamed: a candidate's rows are read once for every offset and slot (one read per run of
        rows), gathered into a batch of up to :data:`BATCH_BYTES`, scored against every slot at
        once, and dropped; only the per-token scores stay. Memory: the slots' own rows plus one
        batch, whatever the catalog's size. Row maps come from :class:`RowMaps` (built once per
        tensor per diff), looked up at the sampled tokens only."""
        progress = progress or self._progress
        r_self = self.ra if side == "a" else self.rb
        (rows_self,) = self.maps.rows_at(side, info.name, [sample])
        use = rows_self >= 0
        sample, rows_self = sample[use], rows_self[use]
        if len(sample) == 0:
            return SlotScores(slots, verdicts={s: IdentityVerdict(reason="no sampled token") for s in slots})
        own_cat, other_cat = (self.cat_a, self.cat_b) if side == "a" else (self.cat_b, self.cat_a)
        # every recorded state of both sides, per (label, side): a partial catalog on one side
        # never hides the other side's record of the same state
        candidates: list[tuple[str, str, TensorInfo, TraceSource]] = []
        for cat in (own_cat, other_cat):
            for label, ci in cat.states.items():
                if cat.side == side and ci.name == info.name:
                    continue  # never the tensor itself: it would always match, hiding what it holds
                candidates.append((label, cat.side, ci, cat.r))
        if not candidates:
            return SlotScores(slots, verdicts={s: IdentityVerdict(reason="no catalog states recorded on either side")
                                               for s in slots})
        targets = [self.maps.offset_index(sample, o) for o in OFFSETS]
        need = min(MIN_TOKENS, max(1, len(sample)))
        # the candidates' rows at every offset: one layout per distinct row map (the tensors of a
        # trace usually share one, so the lookups, their union and its runs are computed once)
        layouts: dict[tuple[str, int], _Layout] = {}
        held_maps: list[Codes] = []   # keeps each keyed map alive, so its id stays its own
        cand_layout: list[_Layout] = []
        for i, (_label, cside, ci, _) in enumerate(candidates):
            # also a chance for a caller (the TUI's worker) to stop between candidates
            progress(Stage.IDENTIFYING, i, len(candidates))
            inv = self.maps.inverse(cside, ci.name)
            key = (cside, id(inv))
            lay = layouts.get(key)
            if lay is None:
                held_maps.append(inv)
                lay = layouts[key] = _Layout(self.maps.rows_at(cside, ci.name, targets), need)
            cand_layout.append(lay)

        def usable(ci: TensorInfo, cr: TraceSource, basis: str) -> bool:
            if basis == "values":
                return info.has_values and ci.has_values and ci.width == info.slot_width
            return (info.has_sketch and ci.has_sketch and cr.sketch_dim == r_self.sketch_dim
                    and cr.sketch_seed == r_self.sketch_seed)

        # the basis: the one more states can be scored in (decided before any row is read)
        count = {b: sum(1 for (_l, _s, ci, cr), lay in zip(candidates, cand_layout) if any(lay.enough)
                        and usable(ci, cr, b)) for b in ("values", "sketch")}
        basis = pick_basis(count)
        if count[basis] == 0:
            return SlotScores(slots, verdicts={s: IdentityVerdict(reason="no recorded state shares these tokens")
                                               for s in slots})
        # the slots' own rows in that basis, read once for every slot
        tgt = {s: self._target(r_self, info, rows_self, s, basis) for s in slots} if basis == "sketch" else \
            self._targets(r_self, info, rows_self, slots)
        stack = SlotStack([tgt[s] for s in slots])
        scored: dict[int, list[tuple[int, int, _Scored]]] = {s: [] for s in slots}
        # candidates are scored in batches of up to BATCH_BYTES of rows (at narrow widths many
        # candidates at once; at wide ones one): one pass of numpy calls per batch, not per
        # candidate and offset
        batch: list[tuple[int, int, CandidateRows]] = []
        held = 0

        def flush() -> None:
            # offset by offset: the candidates at one offset usually cover the same tokens, and
            # score_many reduces a run of equal-length segments in one call
            batch.sort(key=lambda b: b[0])
            for (oi, ci_idx, _), per_slot in zip(batch, score_many(stack, [c for *_, c in batch])):
                for s, sc in zip(slots, per_slot):
                    scored[s].append((oi, ci_idx, sc))
            batch.clear()

        order = range(len(candidates) - 1, -1, -1) if self._backwards else range(len(candidates))
        self._backwards = not self._backwards
        for ci_idx in order:
            (label, cside, ci, cr), lay = candidates[ci_idx], cand_layout[ci_idx]
            if not any(lay.enough) or not usable(ci, cr, basis):
                continue
            # a candidate's rows at every offset, read once (their union: one read per run of
            # rows and part), scored against every slot at every offset, dropped
            t = self._candidate(cr, ci, lay.union, basis)
            # the union's norms once (a row's norm does not depend on the rows around it); its
            # rows are scored in place at each offset (data[at]: no gather, no cast)
            rows, norms = t.data, t.norms
            row_bytes = rows.shape[1] * 4   # float32-equivalent: batches as large whatever the stored form
            exact_tol = None
            if cside == side:  # own side: the same data, up to the rounding of the coarser dtype
                eps = EPS.get(coarser(info.dtype, ci.dtype), EPS["float32"])
                exact_tol = EXACT_EPS * eps + (1e-5 if basis == "sketch" else 0.0)
            for oi, offset in enumerate(OFFSETS):
                if not lay.enough[oi]:
                    continue
                pos = lay.pos[oi]
                if batch and held + len(pos) * row_bytes > BATCH_BYTES:
                    flush()   # wide rows: a batch may be one offset of one candidate
                    held = 0
                at = pos if t.at is None else t.at[pos]
                batch.append((oi, ci_idx, CandidateRows(label, cside, offset, basis, lay.oks[oi], rows, t.rms[pos],
                                                        exact_tol, norms[pos], at, t.bf16)))
                held += len(pos) * row_bytes
        flush()
        return SlotScores(slots, len(sample), scored)

    def _candidate(self, r: TraceSource, info: TensorInfo, rows: Codes, basis: str) -> _Candidate:
        """A candidate state's rows at ``rows`` (ascending, unique), their RMS and norms: full
        values of bfloat16 or float32 where they lie (mapped in place, else gathered in their
        stored form: no conversion, no copy of the mapped rows); anything else, or rows with a
        NaN/Inf (zeroed on the float32 copy), as :meth:`_target` reads them. The same numbers
        either way: the kernel widens each stored element as the float32 copy holds it."""
        if basis == "values" and info.dtype in _IN_PLACE and len(rows):
            bf16 = info.dtype == "bfloat16"
            lo = int(rows[0])
            with self.read_lock:
                span = r.part(info.name, "values").map(np.arange(lo, int(rows[-1]) + 1))
                if isinstance(span, np.ndarray):
                    data, at = span, rows - lo
                else:
                    data = gather(span, rows - lo) if span is not None else read_runs(r, info.name, "values", rows)
                    at = None
                rms = slot_rms_at(r, info, rows, 0)
            if data.ndim == 2 and data.dtype == _IN_PLACE[info.dtype]:
                data = data[:, :info.slot_width]
                sq = row_dots_at(data, data, xi=at, ci=at, x_bf16=bf16, c_bf16=bf16)
                if np.isfinite(sq).all():
                    return _Candidate(data, at, bf16, rms, np.sqrt(sq))
        t = self._target(r, info, rows, 0, basis)
        return _Candidate(t.data, None, False, t.rms, t.norms if t.norms is not None else row_norms(t.data))

    def _targets(self, r: TraceSource, info: TensorInfo, rows: Codes, slots: list[int]) -> dict[int, Target]:
        """Every slot's full values at ``rows``, from one read of the tensor's rows."""
        w = info.slot_width
        with self.read_lock:
            raw = read_runs(r, info.name, "values", rows)
            rms = {s: slot_rms_at(r, info, rows, s) for s in slots}
        data = to_float32(raw, info.dtype)
        return {s: Target(clean(data[:, s * w:(s + 1) * w]), rms[s]) for s in slots}


def slot_rms_at(r: TraceSource, info: TensorInfo, rows: Codes, slot: int) -> NDArray[np.float32]:
    """Per-token RMS of one slot at tensor rows ``rows`` (ascending). A stored RMS is read at those
    rows only (a few chunks); without one, it is computed from the values of the contiguous span,
    so the span is read once."""
    if len(rows) == 0:
        return np.zeros(0, np.float32)
    if r.has_part(info.name, "rms"):
        picked: NDArray[np.float32] = np.asarray(read_runs(r, info.name, "rms", rows), np.float32)[:, slot]
        return picked
    lo, hi = int(rows.min()), int(rows.max()) + 1
    span = to_float32(r.part(info.name, "values").rows(lo, hi), info.dtype)
    out: NDArray[np.float32] = np.asarray(slot_rms(span, info.slot_width), np.float32)[rows - lo, slot]
    return out


def noise_floors(measured: dict[str, tuple[float, float, float, int]], num_layers: int | None, dtype_a: str,
                 dtype_b: str, capped: dict[str, str] | None = None) -> Callable[[str], NoiseFloor]:
    """``floor_of(label)`` for the identity search, from ``measured`` {label: (depth, 99th
    percentile of 1 - cos, of rel, tokens)} of the states recorded on both sides: a measured state
    its own; a state in between the larger of its nearest measured neighbours by depth; nothing
    measured, the default tolerance's allowance (so no finer distinction is claimed). ``capped``
    {label: tolerance source}: the measured states that diverge across the sides, whose floor is
    their tolerance's allowance (as ``measured`` gives it) rather than their spread."""
    L = num_layers
    capped = capped or {}

    def floor_of(label: str) -> NoiseFloor:
        if label in measured:
            _, oc, rel, n = measured[label]
            if label in capped:
                return NoiseFloor(oc, rel, f"{label}'s tolerance ({capped[label]}): {label} itself differs across "
                                  "the sides past it")
            return NoiseFloor(oc, rel, f"{label} recorded on both sides (99th percentile of {n} tokens)")
        try:
            b = parse_label(label)
            d = float(b if b is not None else (L or 0))
        except ValueError:
            d = float(L or 0)
        if measured:
            below = [m for m in measured.values() if m[0] <= d]
            above = [m for m in measured.values() if m[0] >= d]
            near = [max(below, key=lambda m: m[0])] if below else []
            near += [min(above, key=lambda m: m[0])] if above else []
            oc, rel = max(m[1] for m in near), max(m[2] for m in near)
            return NoiseFloor(oc, rel, "nearest states recorded on both sides")
        t = default_tolerance(dtype_a, dtype_b, d)
        return NoiseFloor((1 - t.min_cos) / FLOOR_FACTOR, t.max_rel / 4, "default tolerance (no state recorded on "
                          "both sides)")
    return floor_of
