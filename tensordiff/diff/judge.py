"""The judge: from a plan and its streamed blocks to a :class:`~tensordiff.findings.DiffResult`.

While the blocks stream, :class:`Tally` accumulates each pair's per-token metrics against its
tolerances (the tokens that fail, first failures, NaN/Inf, the error quantiles). Once every pair
is streamed, :func:`judge` measures the noise floors (how far the states recorded on both sides
drift apart), asks the identity search what each packed slot and each disagreeing boundary holds
(:mod:`tensordiff.catalog`, decided under those floors), turns it all into findings
(:mod:`tensordiff.slots`), applies ``--allow-failed``, runs the analyses that read the verdicts
(:mod:`.analyses`: routing, the residual rule, signatures, graft, acceptance) and orders
everything once, in forward order (:mod:`.order`).

This module decides; it never reads a tensor row itself (the identity search does, through the
plan's sources)."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import replace
import math
from typing import Any

import numpy as np
from numpy.typing import NDArray

from .. import noise, noise_io, routing
from ..align import sample_indices
from ..catalog import IdentitySearch, noise_floors
from ..errors import IncompatibleTracesError
from ..findings import (
    Details,
    DiffResult,
    Finding,
    IdentityDetails,
    Kind,
    NonfiniteDetails,
    NumericDetails,
    PairStats,
    ReplicaDetails,
    Severity,
    SlotRow,
)
from ..identity import FLOOR_FACTOR, IdentityVerdict, NoiseFloor
from ..numerics import PairAccumulator
from ..slots import judge_slot
from ..tolerances import allow_failed
from ..trace import ReplicaMismatch, TensorInfo, TraceSource
from .analyses import Acceptance, Analysis, Graft, ResidualRule, Routing, ZoomSignature
from .early import EarlyIdentity
from .options import BOUNDARY_SAMPLE, DiffOptions
from .order import order
from .plan import DiffPlan, PairJob, depth_of
from .stream import BlockResult


class Tally:
    """Each compared pair's blocks, accumulated against its tolerances as they stream."""

    def __init__(self, plan: DiffPlan):
        regime_b = plan.alignment.regime_b
        self._acc = {j.index: PairAccumulator(list(j.tolerances), regime_b) for j in plan.compared}

    def add(self, block: BlockResult) -> NDArray[np.bool_]:
        """Take one block; returns the [n, k] mask of its tokens that fail a tolerance or hold NaN/Inf."""
        bad: NDArray[np.bool_] = self._acc[block.job.index].add(block.rows, block.metrics)
        return bad

    def of(self, job: PairJob) -> PairAccumulator | None:
        return self._acc.get(job.index)

    def failing(self, job: PairJob) -> bool:
        """Whether some slot of the pair has failed so far."""
        acc = self._acc.get(job.index)
        return acc is not None and any(f is not None for f in acc.first_fail)


def replica_findings(source: TraceSource, found: Sequence[ReplicaMismatch]) -> list[Finding]:
    """Rows a trace set holds twice (TP copies, a PP overlap) that differ: never hidden."""
    return [Finding(Kind.REPLICA, Severity.DIVERGENCE, tensor=m.tensor, order=m.order, seq=m.seq, position=m.position,
                    token=m.token, regime=m.regime, details=ReplicaDetails(
                        side=source.side, axis=m.axis, primary=m.primary, replica=m.replica, part=m.part, rows=m.rows,
                        differing=m.differing, max_abs=m.max_abs, cos_min=m.cos_min))
            for m in found]


def pair_stats(job: PairJob, acc: PairAccumulator | None) -> PairStats:
    """The statistics of one pair (the JSON's ``tensors`` entry)."""
    st = PairStats(name_a=job.a.name, name_b=job.b.name, label=job.label, order=job.a.order, slots=job.slots,
                   dtype_a=job.a.dtype, dtype_b=job.b.dtype, depth=list(job.depth))
    if job.basis is None:
        st.compared = False
        st.not_compared = job.not_compared
        return st
    st.basis = job.basis
    if acc is not None:
        st.tokens = acc.tokens
        st.tolerance = [t.to_dict() for t in acc.tolerances]
        st.cos_min = [float(x) for x in acc.cos_min]
        st.cos_mean = acc.cos_mean()
        st.rel_max = [float(x) for x in acc.rel_max]
        st.maxabs = [float(x) for x in acc.maxabs]
        st.failing = [int(x) for x in acc.failing]
        st.nonfinite_a = [int(x) for x in acc.nonfinite_a]
        st.nonfinite_b = [int(x) for x in acc.nonfinite_b]
        st.by_regime = dict(acc.by_regime)
    return st


def measured_floors(plan: DiffPlan, tally: Tally) -> Callable[[str], NoiseFloor]:
    """The 1 - cos (and rel) that each state recorded on both sides shows across them (99th
    percentile over its tokens), for the identity search; states in between take the larger
    of their nearest measured neighbours; none measured: the default tolerance's allowance."""
    a, b = plan.a, plan.b
    measured: dict[str, tuple[float, float, float, int]] = {}  # label -> (depth, 1-cos, rel, tokens)
    capped: dict[str, str] = {}
    for job in plan.jobs:
        ia, ib, acc = job.a, job.b, tally.of(job)
        if acc is None or ia.kind not in ("boundary", "final_norm") or ia.label != ib.label or acc.tokens == 0:
            continue
        oc, rel = acc.quantile(0, 0.99)
        if not np.isfinite(oc):
            continue
        if job.tolerances:
            # a state whose directions spread across the sides past its own tolerance diverges:
            # that spread is the bug, not the noise, and a floor that wide would let any state
            # look like any other (a port wrong in every layer would "hold" its neighbour); a
            # match to it must be as close as its tolerance allows. The rel floor, which only
            # widens the band of honest scale differences, stays as measured
            t = job.tolerances[0]
            if oc > 1.0 - t.min_cos:
                oc = (1.0 - t.min_cos) / FLOOR_FACTOR
                capped[ia.label] = t.source
        measured[ia.label] = (depth_of(a, b, ia, 0) or 0.0, oc, rel, acc.tokens)
    dtype_a = next((i.dtype for i in a.tensors.values()), "float32")
    dtype_b = next((i.dtype for i in b.tensors.values()), "float32")
    return noise_floors(measured, a.num_layers or b.num_layers, dtype_a, dtype_b, capped)


def final_state_error(plan: DiffPlan) -> tuple[str, float] | None:
    """The deepest state the noise model measured (final_norm, else the deepest boundary) and the
    99th percentile of its relative error across the sides: what the logits inherit."""
    states = plan.noise.states
    if not states:
        return None
    last = max(states, key=lambda s: (s.depth, s.label == "final_norm"))
    return last.label, last.level.q99


def judge(plan: DiffPlan, tally: Tally, search: IdentitySearch, options: DiffOptions, *,
          replicas: Sequence[Finding], worst: list[dict[str, Any]], early: EarlyIdentity | None = None) -> DiffResult:
    """The result of a streamed plan. ``replicas``: the replica findings of both sides; ``worst``:
    the worst tokens the stream saw; ``early``: identity searches scored during the stream."""
    # the search decided under the floors measured here: a copy (its caches shared), the one
    # given stays as it was
    search = copy.copy(search)
    search.floor_of = measured_floors(plan, tally)
    j = _Judge(plan, search, options, early)
    findings = list(plan.notes) + list(plan.token_findings) + list(replicas)
    stats: list[PairStats] = []
    for job in plan.jobs:
        acc = tally.of(job)
        st = pair_stats(job, acc)
        stats.append(st)
        findings += job.findings
        if acc is not None:
            findings += j.pair(job, st, acc)
    if early is not None:
        early.drain()
    compared = [p for p in stats if p.compared]
    if not compared:
        why = "; ".join(f"{p.label}: {p.not_compared}" for p in stats[:4])
        raise IncompatibleTracesError(f"nothing compared: none of the {len(stats)} paired tensors could be "
                                      f"compared ({why}{'; ...' if len(stats) > 4 else ''})")
    # a --tol rule matching nothing: exit 2
    options.tolerances.check_rules_used((t for job in plan.compared for t in job.tolerances), [p.label for p in stats])
    found: Sequence[Finding] = allow_failed(findings, stats, options.tolerances.allow_failed)
    for analysis in analyses(j, plan):
        found = analysis.findings(plan, stats, found)
    a, b, al = plan.a, plan.b, plan.alignment
    return DiffResult(
        path_a=a.path, path_b=b.path, side_a=a.side, side_b=b.side, findings=order(found), slot_table=j.slot_table,
        pairs=stats, sequences=list(al.seq_pairs), gaps=list(al.gaps),
        shifts={str(k): v for k, v in al.shifts.items()}, tokens_aligned=len(al), worst_tokens=worst,
        summary_path=options.summary_path, allow_incomplete=options.allow_incomplete,
    )


def analyses(j: _Judge, plan: DiffPlan) -> tuple[Analysis, ...]:
    """What runs after the verdicts, in this order (:mod:`.analyses`): the routing note first (the
    judge set tokens apart for it), the residual rule before the signature that reads the first
    divergence it leaves, the graft note, and the acceptance finding last (it names the first
    divergence upstream of the draft's predictions, whatever came before)."""
    return (Routing(j.flips, tuple(j.set_apart)), ResidualRule(), ZoomSignature(), Graft(),
            Acceptance(final_state_error(plan)))


class _Judge:
    """The findings of each pair: what its slots hold, NaN/Inf, drift past tolerance."""

    def __init__(self, plan: DiffPlan, search: IdentitySearch, options: DiffOptions, early: EarlyIdentity | None):
        self.plan, self.search, self.options, self.early = plan, search, options, early
        self.slot_table: list[SlotRow] = []
        # MoE tokens whose expert choice flipped on a near-tie (tensordiff.routing): a state whose
        # failing tokens are all among those flipped before it is set apart, not judged
        self.flips = routing.near_tie_flips(plan.a, plan.b, plan.alignment, plan.maps)
        self.set_apart: list[routing.SetApart] = []

    def pair(self, job: PairJob, st: PairStats, acc: PairAccumulator) -> list[Finding]:
        """Identity of the slots (packed tensors, both sides) and every slot's findings."""
        ia, ib, k = job.a, job.b, job.slots
        identity_a: dict[int, IdentityVerdict] = {}
        identity_b: dict[int, IdentityVerdict] = {}
        if ia.kind == "packed" or ib.kind == "packed":
            sample = sample_indices(job.both, self.options.identity_sample)
            identity_a = self.search.identify("a", ia, list(range(k)), sample)
            identity_b = self.search.identify("b", ib, list(range(k)), sample)
        out: list[Finding] = []
        for s in range(k):
            out += self._slot(job, st, s, acc, identity_a, identity_b)
        return out

    def _slot(self, job: PairJob, st: PairStats, s: int, acc: PairAccumulator,
              identity_a: dict[int, IdentityVerdict], identity_b: dict[int, IdentityVerdict]) -> list[Finding]:
        """The findings of one slot: NaN/Inf, what it holds, labels, numerics."""
        ia, ib, k = job.a, job.b, job.slots
        a, b = self.plan.a, self.plan.b
        out: list[Finding] = []
        slotted = k > 1 or ib.kind == "packed"
        subject = f"slot {s} of {ib.name}" if slotted else ib.label
        slot_arg = s if slotted else None
        nf = acc.first_nonfinite[s]
        if nf is not None:
            out.append(self._token_finding(Kind.NONFINITE, ia, slot_arg, nf.token_index, NonfiniteDetails(
                subject=subject, nonfinite_a=int(acc.nonfinite_a[s]), nonfinite_b=int(acc.nonfinite_b[s]),
                row_a=nf.nonfinite_a, row_b=nf.nonfinite_b, side_a=a.side, side_b=b.side)))
        ff = acc.first_fail[s]
        at = ff.token_index if ff is not None else int(np.flatnonzero(job.both)[0])
        identity_finding = None
        if s in identity_b:
            claimed_a = ia.slot_labels[s] if ia.slot_labels else (ia.label if ia.kind != "packed" else None)
            claimed_b = ib.slot_labels[s] if ib.slot_labels else (ib.label if ib.kind != "packed" else None)
            ida = self._as_class(identity_a.get(s), claimed_a)
            expected = ida.best if ida is not None and ida.best else claimed_a   # as judge_slot takes it
            identity_a, identity_b = dict(identity_a), dict(identity_b)
            if ida is not None:
                identity_a[s] = ida
            # each side's own claim first: two claims that differ within one class (a draft fed
            # final_norm on one side, the last layer on the other) are two inputs, not one
            identity_b[s] = self._as_class(identity_b[s], claimed_b if claimed_b is not None else expected) \
                or identity_b[s]

            def place(kind: Kind, side: str, det: IdentityDetails, sev: Severity) -> Finding:
                return replace(self._token_finding(kind, ia, s, at, det), severity=sev)
            j = judge_slot(ib.name, s, claimed_a, claimed_b, identity_a.get(s), identity_b[s], (a.side, b.side),
                           bool(acc.failing[s]), st.cos_mean[s], st.rel_max[s], place, ia.order, ib.order, ia.name)
            self.slot_table.append(j.row)
            out += j.findings
            identity_finding = j.identity
        tol = acc.tolerances[s]
        model = self.plan.noise
        judged = noise.SlotJudgement()
        sibling = False
        if tol.source == model.source and st.basis == "values":   # not a --tol rule or calibration
            judged = noise_io.judge(model, acc, s, job.depth[s] if s < len(job.depth) else None, (ia.dtype, ib.dtype))
            jump = noise_io.boundary_jump(model, ia.label) if ia.kind in ("boundary", "final_norm") else None
            if jump is not None and jump.why == "scale":   # this state leaves the trend of the states before it
                judged = noise.SlotJudgement("scale", float(np.exp(jump.level.bias)), jump.bias_limit)
            elif jump is not None and jump.why == "level":
                judged = noise.SlotJudgement("level", jump.level.q50, noise.JUMP * jump.predicted)
            elif jump is not None:   # a subset of its tokens: they fail their own tolerance
                judged = noise.SlotJudgement()
            sib = _sibling_level(job, acc, s, model) if not judged.part else None
            if sib is not None:   # far above the deeper slots of its own tensor
                judged, sibling = sib, True
        if (acc.failing[s] and ff is not None) or judged.part:
            state = ia.slot_labels[s] if ia.slot_labels and s < len(ia.slot_labels) else ia.label
            if self._near_tie_only(state, subject, s, acc, judged):
                return out
            det = NumericDetails(
                subject=subject, cos=ff.cos if ff else float(st.cos_min[s]), rel=ff.rel if ff else float(st.rel_max[s]),
                maxabs=ff.maxabs if ff else float(st.maxabs[s]), failing=int(acc.failing[s]), tokens=acc.tokens,
                tolerance=tol.to_dict(), basis=st.basis)
            noise_io.annotate(det, model, judged, state, ia.label)
            if sibling:
                det.limit_source = f"measured: {noise.JUMP:g}x the deeper slots of {ib.name}"
            if acc.failing[s] or acc.nonfinite_a[s] or acc.nonfinite_b[s]:
                det.where = noise_io.where_failing(a, b, ia, ib, s, k, acc.failing_tokens(s), job.rows_a, job.rows_b,
                                                   job.rows, self.plan.places, st.basis or "values")
            f = self._token_finding(Kind.NUMERIC, ia, slot_arg, ff.token_index if ff else at, det)
            if identity_finding is not None:
                placed = f.details
                assert isinstance(placed, NumericDetails)
                f = replace(f, severity=Severity.INFO, details=replace(placed, explained=True))
            elif ia.kind != "packed":
                f = self._boundary_identity(job, ff.token_index if ff else at) or f
            out.append(f)
        return out

    def _near_tie_only(self, state: str | None, subject: str, s: int, acc: PairAccumulator, judged: noise.SlotJudgement) -> bool:
        """Whether a state's failing tokens are all tokens an MoE router sent to other experts on a
        near-tie in a layer before it (then they are set apart and noted, the state not judged).
        Only single failing tokens qualify: a shift of the level or scale of the whole state, or
        NaN/Inf, is judged as ever."""
        depth = routing.state_layer(state, self.plan.a.num_layers or self.plan.b.num_layers)
        if (not self.flips or depth is None or judged.part not in ("", "tokens") or not acc.failing[s]
                or acc.nonfinite_a[s] or acc.nonfinite_b[s]):
            return False
        failing = acc.failing_tokens(s)
        if len(failing) != int(acc.failing[s]):   # more than were kept: not all seen
            return False
        before = [idx for layer, idx in self.flips.items() if layer < depth]
        if not before or not np.isin(failing, np.concatenate(before)).all():
            return False
        self.set_apart.append(routing.SetApart(subject, len(failing)))
        return True

    def _as_class(self, v: IdentityVerdict | None, label: str | None) -> IdentityVerdict | None:
        """``v`` with ``label`` for the state it holds where that state and ``label`` are one class
        (equal up to a per-token scale): neither is ever named for the other."""
        if (v is None or label is None or v.outcome not in ("holds", "scaled") or v.best is None or v.best == label
                or v.offset or not self.search.one_class(v.best, label, v.evidence.exact)):
            return v
        return replace(v, outcome="holds", best=label, closest=label, scale=None)

    def _boundary_identity(self, job: PairJob, at: int) -> Finding | None:
        """A boundary that disagrees: does it hold another recorded state?"""
        ia, ib = job.a, job.b
        sample = sample_indices(job.both, BOUNDARY_SAMPLE)
        found = self.early.scores(ia, ib, sample) if self.early is not None else None
        idt = (self.search.decide(found) if found is not None else self.search.identify("b", ib, [0], sample))[0]
        if idt.outcome not in ("holds", "scaled") or (idt.best == ia.label and idt.outcome == "holds" and not idt.offset):
            return None
        if not idt.offset and idt.best is not None and self.search.one_class(idt.best, ia.label, idt.evidence.exact):
            return None   # equal up to a per-token scale (a norm of it) on the reference side: one identity
        return self._token_finding(Kind.SLOT_IDENTITY, ib, None, at, IdentityDetails(
            outcome=idt.outcome, subject=ib.name, boundary_side=self.plan.b.side, held=idt.best, expected=ia.label,
            offset=idt.offset, scale=idt.scale, score=idt.score, margin=idt.margin, runner_up=idt.runner_up,
            closest=idt.closest, cos=idt.evidence.cos, candidates=idt.candidates, evidence=idt.evidence))

    def _token_finding(self, kind: Kind, info: TensorInfo, slot: int | None, ti: int, details: Details) -> Finding:
        e = self.plan.entry(ti)
        return Finding(kind, Severity.DIVERGENCE, tensor=info.name, slot=slot, order=info.order, seq=e["seq"],
                       position=e["position"], position_b=e["position_b"], token=e["token"], regime=e["regime"],
                       regime_a=e.get("regime_a"), details=replace(details, token_index=ti))


def _sibling_level(job: PairJob, acc: PairAccumulator, s: int, model: noise.NoiseModel) -> noise.SlotJudgement | None:
    """Slot ``s`` of a packed tensor against its deeper siblings: the slots of one tensor are made
    by one engine at one precision, and honest noise grows with depth, so a deeper slot's median
    error bounds a shallower one's. A slot whose median error is over JUMP x the smallest of its
    deeper siblings' (never under the floor at its depth) leaves that trend: a "level" judgement
    against that limit; None otherwise (not packed, no deeper sibling, within the trend)."""
    if job.slots < 2 or len(job.depth) != job.slots or job.depth[s] is None:
        return None
    d = float(job.depth[s] or 0.0)
    deeper = [acc.quantile(t, 0.5)[1] for t in range(job.slots)
              if t != s and job.depth[t] is not None and float(job.depth[t] or 0.0) > d]
    deeper = [x for x in deeper if math.isfinite(x)]
    q50 = acc.quantile(s, 0.5)[1]
    if not deeper or not math.isfinite(q50) or acc.tokens < noise.MIN_TOKENS:
        return None
    limit = noise.JUMP * max(min(deeper), model.floor(d).q50)
    return noise.SlotJudgement("level", q50, limit) if q50 > limit else None


__all__ = ["Tally", "final_state_error", "judge", "measured_floors", "pair_stats", "replica_findings"]
