"""The noise model's reads: a sample of the tokens of every catalog state both sides recorded
(for :func:`tensordiff.noise.fit`), the per-slot judgement after the numeric pass, and the rows a
side recorded twice for the same token. numpy + the trace readers; the rule is in
:mod:`tensordiff.noise`."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from . import noise
from .cores import usable_cores
from .align import RowMaps, sample_indices
from .dtypes import to_float32
from .findings import Finding, Kind, NumericDetails, ReplicaDetails, Severity, regime_a_where_named
from .numerics import BlockMetrics, Metrics, PairAccumulator
from .tolerances import Tolerance, default_tolerance
from .trace import TensorInfo, TraceSource, read_runs

#: tokens sampled per catalog state to measure its noise level
SAMPLE = 1024
#: tokens of one tensor recorded twice, compared at most
DUPLICATES_MAX = 4096


def side_dtype(r: TraceSource) -> str:
    """The dtype a side's states are computed in (its catalog's, else its first tensor's; the
    autocast dtype where the recorder saw one in effect: :func:`tensordiff.noise.compute_dtype`)."""
    return next((noise.compute_dtype(i.dtype, i.attrs) for i in r.tensors.values() if i.kind in ("boundary", "final_norm")),
                next((noise.compute_dtype(i.dtype, i.attrs) for i in r.tensors.values()), "float32"))


#: a sampled catalog state: (A's, B's, basis, A's rows, B's rows, aligned tokens)
_SampleJob = tuple[TensorInfo, TensorInfo, str, NDArray[np.int64], NDArray[np.int64], NDArray[np.int64]]


def measure(ra: TraceSource, rb: TraceSource, maps: RowMaps, pairs: Sequence[tuple[TensorInfo, TensorInfo]],
            depth_of: Callable[[TensorInfo, int], float | None]) -> noise.NoiseModel:
    """The noise model of a diff: every catalog state recorded on both sides, measured on up to
    :data:`SAMPLE` aligned tokens, on full values where both sides kept them, else on the seeded
    sketches both sides share (a serve engine keeps its catalog as sketches). A sketch is a random
    projection that keeps norms and angles within about 1/sqrt(dim) per token, so the median
    error, the 1 - cos and the per-token RMS ratio it gives are those of the values (the per-token
    spread a little wider): the trend it measures is the one the values would show. The sampled
    rows are read here, before the numeric pass (:func:`measure_from` takes them from the pass)."""
    jobs = sample_jobs(ra, rb, maps, pairs)
    metrics = []
    for (ia, ib, part, *_), (a, b) in zip(jobs, _sample_reads(ra, rb, jobs)):
        if part == "values":
            m = BlockMetrics(1, ia.width).compute_stored(a, ia.dtype, b, ib.dtype)
        else:
            m = BlockMetrics(1, ra.sketch_dim).compute(a.astype(np.float32, copy=False), b.astype(np.float32, copy=False))
        metrics.append(m)
    return _fit(ra, rb, maps, pairs, jobs, metrics, depth_of)


def measure_from(ra: TraceSource, rb: TraceSource, maps: RowMaps, pairs: Sequence[tuple[TensorInfo, TensorInfo]],
                 depth_of: Callable[[TensorInfo, int], float | None],
                 metrics_at: Callable[[TensorInfo, TensorInfo, NDArray[np.int64]], Metrics | None]) -> noise.NoiseModel:
    """:func:`measure` from metrics the numeric pass already computed: ``metrics_at(ia, ib, idx)``
    the per-token metrics of the pair at aligned tokens ``idx`` (None: not computed). A token's
    metrics depend only on its own rows, so the model is the one :func:`measure` gives, bit for
    bit, without reading the sample a second time."""
    jobs, metrics = [], []
    for job in sample_jobs(ra, rb, maps, pairs):
        m = metrics_at(job[0], job[1], job[5])
        if m is not None:
            jobs.append(job)
            metrics.append(m)
    return _fit(ra, rb, maps, pairs, jobs, metrics, depth_of)


def _fit(ra: TraceSource, rb: TraceSource, maps: RowMaps, pairs: Sequence[tuple[TensorInfo, TensorInfo]],
         jobs: Sequence[_SampleJob], metrics: Sequence[Metrics],
         depth_of: Callable[[TensorInfo, int], float | None]) -> noise.NoiseModel:
    """The model from each sampled state's per-token metrics (one slot); where none is clean,
    the packed slots' trend (:func:`slot_levels`)."""
    measured: list[tuple[str, float, noise.Level]] = []
    dtypes: dict[str, tuple[str, str]] = {}
    for (ia, ib, *_), m in zip(jobs, metrics):
        with np.errstate(divide="ignore", invalid="ignore"):
            lr = np.log(m.ratio[:, 0].astype(np.float64)) if m.ratio is not None else np.zeros(len(m))
        lv = noise.level_of(m.rel[:, 0], 1.0 - m.cos[:, 0].astype(np.float64), lr)
        d = depth_of(ia, 0)
        if lv is not None and d is not None:
            measured.append((ia.label, float(d), lv))
            dtypes[ia.label] = (noise.compute_dtype(ia.dtype, ia.attrs), noise.compute_dtype(ib.dtype, ib.attrs))
    model = noise.fit(side_dtype(ra), side_dtype(rb), measured, dtypes,
                      lambda da, db, d: default_tolerance(da, db, d).max_rel)
    if not model.measured:   # nothing in the catalog to measure from: the packed slots measure each other
        noise.fit_slots(model, slot_levels(ra, rb, maps, pairs, depth_of))
    return model


def slot_levels(ra: TraceSource, rb: TraceSource, maps: RowMaps, pairs: Sequence[tuple[TensorInfo, TensorInfo]],
                depth_of: Callable[[TensorInfo, int], float | None]
                ) -> list[tuple[str, float, noise.Level, float, float]]:
    """Each slot of every packed tensor both sides recorded with values, of the same width and
    dtype pair as the model's: ``(label, depth, level, worst rel, worst 1 - cos)`` over up to
    :data:`SAMPLE` aligned tokens (:func:`tensordiff.noise.fit_slots`). Read here in both of the
    model's paths (the numeric pass keeps no per-slot sample), so either gives the same bits."""
    out: list[tuple[str, float, noise.Level, float, float]] = []
    dtypes = (side_dtype(ra), side_dtype(rb))
    for ia, ib in pairs:
        if (ia.kind != "packed" or ib.kind != "packed" or ia.width != ib.width or not ia.slot_width
                or not (ia.has_values and ib.has_values) or (ia.dtype, ib.dtype) != dtypes):
            continue
        ma, mb = maps.inverse("a", ia.name), maps.inverse("b", ib.name)
        idx = sample_indices((ma >= 0) & (mb >= 0), SAMPLE)
        if len(idx) < noise.MIN_TOKENS:
            continue
        k, w = ia.width // ia.slot_width, ia.slot_width
        a, b = ra.part(ia.name, "values").take(ma[idx]), rb.part(ib.name, "values").take(mb[idx])
        m = BlockMetrics(k, w).compute_stored(a, ia.dtype, b, ib.dtype)
        labels = ia.slot_labels or []
        for s in range(k):
            d = depth_of(ia, s)
            with np.errstate(divide="ignore", invalid="ignore"):
                lr = np.log(m.ratio[:, s].astype(np.float64)) if m.ratio is not None else np.zeros(len(m))
            c = 1.0 - m.cos[:, s].astype(np.float64)
            lv = noise.level_of(m.rel[:, s], c, lr)
            if lv is None or d is None:
                continue
            rel = m.rel[:, s].astype(np.float64)
            worst_rel = float(np.max(rel)) if np.isfinite(rel).all() else math.inf   # NaN/Inf: never clean
            worst_c = float(np.max(c)) if np.isfinite(c).all() else math.inf
            label = labels[s] if s < len(labels) else f"{ia.name}[{s}]"
            out.append((label, float(d), lv, worst_rel, worst_c))
    return out


def sample_jobs(ra: TraceSource, rb: TraceSource, maps: RowMaps, pairs: Sequence[tuple[TensorInfo, TensorInfo]]
                ) -> list[_SampleJob]:
    """The catalog states the noise is measured on: (A's, B's, basis, A's rows, B's rows, aligned
    tokens), up to :data:`SAMPLE` tokens each, in the pairs' order."""
    jobs: list[_SampleJob] = []
    for ia, ib in pairs:
        if ia.kind not in ("boundary", "final_norm") or ia.label != ib.label or ia.width != ib.width:
            continue
        part = _basis(ra, rb, ia, ib)
        if part is None:
            continue
        ma, mb = maps.inverse("a", ia.name), maps.inverse("b", ib.name)
        idx = sample_indices((ma >= 0) & (mb >= 0), SAMPLE)
        if len(idx) >= noise.MIN_TOKENS:
            jobs.append((ia, ib, part, ma[idx], mb[idx], idx))
    return jobs


def _sample_reads(ra: TraceSource, rb: TraceSource, jobs: Sequence[_SampleJob]
                  ) -> Iterator[tuple[NDArray[Any], NDArray[Any]]]:
    """Each job's sampled rows of both sides, in job order, each valid until the next but one is
    read (two buffers a side, reused: the reads allocate nothing per state). With a second core,
    A's and B's rows are read in a thread of their own each (one thread per reader: a reader is
    never read by two threads at once) one state ahead, so the reads (which release the GIL)
    overlap the metrics of the state before."""
    bufs: dict[str, list[NDArray[np.uint8]]] = {"a": [np.empty(0, np.uint8)] * 2, "b": [np.empty(0, np.uint8)] * 2}

    def read(side: str, i: int) -> NDArray[Any]:
        ia, ib, part, rows_a, rows_b, _ = jobs[i]
        r, name, rows = (ra, ia.name, rows_a) if side == "a" else (rb, ib.name, rows_b)
        p = r.part(name, part)
        shape = (len(rows),) + tuple(p.shape[1:])
        need = len(rows) * p.row_bytes
        if bufs[side][i % 2].size < need:
            bufs[side][i % 2] = np.empty(need, np.uint8)
        out = bufs[side][i % 2][:need].view(p.dtype).reshape(shape)
        return p.take(rows, out=out)

    if usable_cores() < 2 or len(jobs) < 2:
        for i in range(len(jobs)):
            yield read("a", i), read("b", i)
        return
    with ThreadPoolExecutor(1, "tensordiff-noise-a") as pa, ThreadPoolExecutor(1, "tensordiff-noise-b") as pb:
        def submit(i: int) -> tuple[Future[NDArray[Any]], Future[NDArray[Any]]]:
            return pa.submit(read, "a", i), pb.submit(read, "b", i)

        ahead = submit(0)
        try:
            for i in range(len(jobs)):
                fa, fb = ahead
                if i + 1 < len(jobs):
                    ahead = submit(i + 1)   # into the other buffers: state i's stay as they are
                try:
                    a = fa.result()
                finally:
                    b = fb.result()   # waited for even when A's read failed, so no read outlives the diff
                yield a, b
        finally:
            for f in ahead:
                f.cancel()


def _basis(ra: TraceSource, rb: TraceSource, ia: TensorInfo, ib: TensorInfo) -> str | None:
    """What a catalog state's noise is measured on: its values, else both sides' sketches of one
    seed and dimension (stored, or derived from the values on a side that kept them)."""
    if ia.has_values and ib.has_values:
        return "values"
    if ia.has_sketch and ib.has_sketch and ra.sketch_seed == rb.sketch_seed and ra.sketch_dim == rb.sketch_dim:
        return "sketch"
    return None


def tolerance_fn(model: noise.NoiseModel) -> Callable[[float | None, str, str], Tolerance]:
    def tol(depth: float | None, dtype_a: str, dtype_b: str) -> Tolerance:
        c, r = noise.tolerance(model, depth, dtype_a, dtype_b)
        return Tolerance(c, float(f"{r:.3g}"), model.source)
    return tol


def judge(model: noise.NoiseModel, acc: PairAccumulator, slot: int, depth: float | None,
          dtypes: tuple[str, str] | None = None) -> noise.SlotJudgement:
    """The noise model's judgement of one compared slot from its accumulated statistics."""
    _, q50 = acc.quantile(slot, 0.5)
    c99, _ = acc.quantile(slot, 0.99)
    mean, sd, n = acc.log_ratio(slot)
    if not (math.isfinite(q50) and math.isfinite(c99)):
        return noise.SlotJudgement()
    return noise.judge(model, depth, q50, c99, mean, sd, n, acc.ratio_quantile(slot, 0.05),
                       acc.ratio_quantile(slot, 0.95), dtypes)


def annotate(d: NumericDetails, model: noise.NoiseModel, j: noise.SlotJudgement, state: str | None,
             label: str) -> None:
    """Fill a numeric finding's noise fields: which part failed and against what."""
    d.state = state
    d.limit_source = str(d.tolerance.get("source", model.source))
    if j.part:
        d.part, d.value, d.limit = j.part, j.value, j.limit
        d.ratio_lo, d.ratio_hi = j.ratio_lo, j.ratio_hi
        d.metric = {"scale": "log RMS ratio", "rescaled": "spread of log RMS ratio", "level": "median rel err"}[j.part]
        jump = boundary_jump(model, label)
        if jump is not None and jump.first and j.part == jump.why:
            d.limit_source = "default allowance: no state before it to measure a trend from"
        elif jump is not None and jump.why == "level" and j.part == "level":
            d.limit_source = f"measured trend: {noise.JUMP:g}x what the states before it predict"
        elif jump is not None and jump.why == "scale" and j.part == "scale":
            d.limit_source = "measured trend: the RMS ratios of the states before it"
        else:
            d.limit_source = model.source
    else:
        d.part = "tokens"
    d.failing_share = d.failing / d.tokens if d.tokens else None


def boundary_jump(model: noise.NoiseModel, label: str) -> noise.StateNoise | None:
    """The measured state ``label`` when it leaves the trend of the states before it."""
    first = model.first_jump
    return first if first is not None and first.label == label else None


# ----------------------------------------------------------------------------------------------
# Where the failing tokens of a slot are

#: failing rows read to find the channels the error sits in
CHANNEL_SAMPLE = 256
#: channels named when this few hold ...
CHANNELS_NAMED = 8
#: ... at least this share of the failing tokens' error energy (spread evenly it would be 8 / width)
CHANNEL_SHARE = 0.5
#: the channels named: the fewest of those that hold this share
CHANNELS_COVER = 0.9


def _ranges(xs: Sequence[int] | NDArray[np.int64], most: int = 4) -> str:
    """Sorted distinct integers as ranges, e.g. "0-5, 9, 30-39" (the first ``most`` ranges)."""
    v = np.unique(np.asarray(xs, dtype=np.int64))
    if not len(v):
        return ""
    cut = np.flatnonzero(np.diff(v) != 1) + 1
    starts, ends = np.concatenate([[0], cut]), np.concatenate([cut, [len(v)]]) - 1
    out = [(int(v[a]), int(v[b])) for a, b in zip(starts[:most], ends[:most])]
    text = ", ".join(f"{a}-{b}" if a != b else str(a) for a, b in out)
    return text + (", ..." if len(starts) > most else "")


@dataclass
class Places:
    """Where some aligned tokens are: A's sequence name and position, B's regime and A's, per token."""

    seq: NDArray[np.object_]
    position: NDArray[np.int64]
    regime: NDArray[np.object_]
    regime_a: NDArray[np.object_]


def _counted(regimes: NDArray[np.object_]) -> dict[str, int]:
    """How many tokens of each regime, in the order each regime first comes."""
    names, first, counts = np.unique(regimes.astype(str), return_index=True, return_counts=True)
    return {str(names[i]): int(counts[i]) for i in np.argsort(first, kind="stable")}


def where_failing(ra: TraceSource, rb: TraceSource, ia: TensorInfo, ib: TensorInfo, slot: int, slots: int,
                  failing: NDArray[np.int64], rows_a: NDArray[np.int64], rows_b: NDArray[np.int64],
                  compared: NDArray[np.int64], places: Callable[[NDArray[np.int64]], Places],
                  basis: str) -> dict[str, Any]:
    """Which tokens of a slot fail (``failing``: aligned indices, the first numerics.FAIL_KEEP),
    among ``compared`` (every aligned token compared): their sequences, positions and regimes,
    and on full values the channels that hold most of their error (a corrupted subset of
    channels: a partial write, a wrong stride). Empty when no token fails."""
    if not len(failing):
        return {}
    at = places(failing)
    seqs = sorted({str(x) for x in at.seq.tolist()})
    all_seqs = ({str(x) for x in places(compared[:: max(1, len(compared) // 4096)]).seq.tolist()}
                if len(compared) else set())
    out: dict[str, Any] = {"kept": len(failing), "sequences": len(seqs), "of_sequences": max(len(all_seqs), len(seqs)),
                           "sequence_names": seqs[:4], "positions": _ranges(at.position),
                           "regimes": _counted(at.regime), "channels": [], "channel_share": None}
    if any(regime_a_where_named(str(x), str(y)) is not None for x, y in set(zip(at.regime_a.tolist(), at.regime.tolist()))):
        out["regimes_a"] = _counted(at.regime_a)   # A's, where both engines' regimes differ
    if basis == "values":
        pick = failing[:: max(1, len(failing) // CHANNEL_SAMPLE)][:CHANNEL_SAMPLE]
        ok = (rows_a[pick] >= 0) & (rows_b[pick] >= 0)
        pick = pick[ok]
        if len(pick):
            w = ia.width // max(1, slots)
            # the sampled rows only, gathered where they lie (not the span between them)
            cols = slice(slot * w, (slot + 1) * w)
            a = to_float32(read_runs(ra, ia.name, "values", rows_a[pick])[:, cols], ia.dtype).astype(np.float64)
            b = to_float32(read_runs(rb, ib.name, "values", rows_b[pick])[:, cols], ib.dtype)
            with np.errstate(invalid="ignore", over="ignore"):
                err = (b.astype(np.float64) - a) ** 2
            # a NaN or Inf error (a square is never -Inf) weighs as much as the whole finite rest
            energy = np.where(np.isfinite(err), err, np.finfo(np.float64).max / (4 * err.size)).sum(0)
            total = float(energy.sum())
            if total > 0 and w > CHANNELS_NAMED * 4:
                top = np.argsort(-energy)[:CHANNELS_NAMED]
                share = float(energy[top].sum() / total)
                if share >= CHANNEL_SHARE:
                    cum = np.cumsum(energy[top]) / total
                    n = min(len(top), int(np.searchsorted(cum, CHANNELS_COVER) + 1))
                    out["channels"] = sorted(int(c) for c in top[:n])
                    out["channel_share"] = float(cum[n - 1])
    return out


# ----------------------------------------------------------------------------------------------
# Rows recorded twice


class Duplicates:
    """Which rows of a side's tensors were recorded twice for one token, found once per token-rows
    array: the tensors a recorder writes together share one array (the reader keeps one copy), so
    their (sequence, position, regime) keys are gathered and ordered once, not once per tensor.
    Rows in key order (what a recorder writes) have no duplicate and are told apart in one pass
    without sorting."""

    def __init__(self, r: TraceSource):
        self.r = r
        self._keys: NDArray[np.int64] | None = None
        # id of a token-rows array -> (that array, kept alive so that its id stays its own; pairs)
        self._memo: dict[int, tuple[NDArray[np.int64], tuple[NDArray[np.int64], NDArray[np.int64]]]] = {}

    def _token_keys(self) -> NDArray[np.int64]:
        if self._keys is None:
            t = self.r.tokens
            self._keys = ((t["seq"].astype(np.int64) << 40) | (t["position"].astype(np.int64) << 8)
                          | t["regime"].astype(np.int64))
        return self._keys

    def pairs(self, trow: NDArray[np.int64]) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
        """(first, second): rows of a tensor with these token rows that hold one token, each
        pair adjacent in key order, at most :data:`DUPLICATES_MAX`."""
        hit = self._memo.get(id(trow))
        if hit is not None and hit[0] is trow:
            return hit[1]
        key = self._token_keys()[trow]
        none = np.zeros(0, np.int64)
        if len(key) < 2 or bool((key[1:] > key[:-1]).all()):
            out = (none, none)
        else:
            order = np.argsort(key, kind="stable")
            ks = key[order]
            dup = np.flatnonzero(ks[1:] == ks[:-1])
            out = (order[dup][:DUPLICATES_MAX], order[dup + 1][:DUPLICATES_MAX]) if len(dup) else (none, none)
        self._memo[id(trow)] = (trow, out)
        return out


def duplicate_findings(r: TraceSource, side: str, info: TensorInfo, model: noise.NoiseModel,
                       depth: float | None, sequences: Sequence[str], found: Duplicates | None = None) -> list[Finding]:
    """Rows of ``info`` that one side recorded twice for the same (sequence, position, regime):
    a divergence naming both rows when the copies differ beyond the noise, a note when equal.
    ``found``: the side's :class:`Duplicates` (shared by the calls for one side)."""
    if not info.has_values or info.rows < 2:
        return []
    trow = r.token_rows(info.name)
    t = r.tokens
    first, second = (found if found is not None else Duplicates(r)).pairs(trow)
    if not len(first):
        return []
    a = r.part(info.name, "values").take(first)
    b = r.part(info.name, "values").take(second)
    k = max(1, info.slot_count)
    m = BlockMetrics(k, info.width // k).compute_stored(np.ascontiguousarray(a), info.dtype,
                                                         np.ascontiguousarray(b), info.dtype)
    # copies of one computation: equal, or at most a rounding apart (a recompute in another
    # batch); anything past the cross-side token tolerance is another state
    cmin, rmax = noise.tolerance(model, depth, info.dtype, info.dtype)
    bad = ((m.cos < cmin) | (m.rel > rmax) | m.nonfinite).any(axis=1)
    differing = int(bad.sum())
    j = int(np.argmax(bad)) if differing else 0
    s = int(t["seq"][trow[first[j]]])
    det = ReplicaDetails(side=side, axis="rows", primary=f"row {int(first[j])}", replica=f"row {int(second[j])}",
                         part=info.name, rows=len(first), differing=differing,
                         max_abs=float(np.nanmax(m.maxabs[j])) if len(first) else 0.0,
                         cos_min=float(np.nanmin(m.cos[j])) if len(first) else 1.0,
                         rel_max=float(np.nanmax(m.rel[j])) if len(first) else None,
                         cos_allowed=float(cmin), rel_allowed=float(rmax), limit_source=model.source)
    return [Finding(Kind.REPLICA, Severity.DIVERGENCE if differing else Severity.INFO, tensor=info.name,
                    order=info.order, seq=sequences[s] if 0 <= s < len(sequences) else str(s),
                    position=int(t["position"][trow[first[j]]]), token=int(t["token"][trow[first[j]]]),
                    details=det)]
