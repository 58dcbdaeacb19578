"""The plan of a diff, made before any tensor row is read: :func:`plan_diff` checks that the two
traces describe the same model, aligns their tokens (:mod:`tensordiff.align`), pairs their
tensors, and fixes for every pair what its numeric pass compares (:class:`PairJob`: basis,
slots, depths, tolerances, aligned rows, row maps, block size) or why it is not compared. The
findings the token tables alone give (shifts, mismatched tokens, gaps, recovered traces) are
part of it. Everything here is frozen: the stream reads it, the judge reads it, nobody edits it.

A is the reference (what was expected, usually the train side), B the side under test."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Protocol

import numpy as np
from numpy.typing import NDArray

from .. import acceptance, noise_io
from ..align import RowMaps, SideTokens, TokenAlignment, align_tokens, pair_tensors
from ..errors import IncompatibleTracesError
from ..findings import (
    Finding,
    GapDetails,
    Kind,
    MissingDetails,
    PairingDetails,
    RecoveredDetails,
    Severity,
    ShiftDetails,
    TokenMismatchDetails,
)
from ..names import maybe_state
from ..noise import NoiseModel, name_depth
from ..numerics import rows_per_block
from ..progress import Progress, Stage
from ..tolerances import NoiseTolerance, Tolerance, ToleranceBook
from ..trace import TensorInfo, TraceSource
from ..vocab import REGIMES, parse_label



class PlanOptions(Protocol):
    """What a plan takes from the run's options (:class:`tensordiff.diff.DiffOptions` is one)."""

    @property
    def tolerances(self) -> ToleranceBook: ...

    @property
    def block_rows(self) -> int: ...

Codes = NDArray[np.int64]
#: what a pair is compared on: full values, else the seeded sketches of both sides
Basis = Literal["values", "sketch"]


@dataclass(frozen=True, eq=False)
class PairJob:
    """One paired tensor (A's ``a``, B's ``b``) and what its numeric pass compares.

    ``rows_a`` / ``rows_b``: each aligned token's tensor row on that side (-1: none; shared by the
    tensors with the same token rows, read only); ``both`` the aligned tokens with a row on both
    sides and ``rows`` their indices, the tokens compared, in aligned order. ``basis`` None: not
    compared, ``findings`` ends with the warning that says why (``not_compared``)."""

    index: int                          # place among the diff's pairs (forward order)
    a: TensorInfo
    b: TensorInfo
    label: str
    slots: int
    depth: tuple[float | None, ...]     # per slot: how deep its state is (the default tolerance's)
    findings: tuple[Finding, ...]       # pairing checks; why not compared
    both: NDArray[np.bool_]
    rows: Codes
    rows_a: Codes
    rows_b: Codes
    basis: Basis | None
    not_compared: str = ""
    tolerances: tuple[Tolerance, ...] = ()
    width: int = 0                      # per slot: the hidden size (values) or the sketch dimension
    block_rows: int = 1                 # aligned tokens per block (every backend cuts the same blocks)

    @property
    def compared(self) -> bool:
        return self.basis is not None


@dataclass(frozen=True, eq=False)
class DiffPlan:
    """Everything the stream and the judge need before a row of a tensor is read."""

    a: TraceSource
    b: TraceSource
    alignment: TokenAlignment
    sides: tuple[SideTokens, SideTokens]
    maps: RowMaps
    notes: tuple[Finding, ...]           # tensors recorded on one side only
    token_findings: tuple[Finding, ...]  # shifts, mismatched tokens, gaps, recovered traces
    jobs: tuple[PairJob, ...]            # every pair, in forward order
    noise: NoiseModel = field(default_factory=lambda: NoiseModel("float32", "float32"))   # tensordiff.noise

    @property
    def compared(self) -> tuple[PairJob, ...]:
        """The pairs the numeric pass compares, in forward order."""
        return tuple(j for j in self.jobs if j.basis is not None)

    @property
    def total_rows(self) -> int:
        """What the progress of the numeric pass counts to (at least 1)."""
        n = len(self.alignment)
        return max(sum(min(j.a.rows, j.b.rows, n) for j in self.jobs), 1)

    def entry(self, ti: int) -> dict[str, Any]:
        """Where aligned token ``ti`` is on both sides, as plain data."""
        return self.alignment.entry(ti, self.a.sequences, self.b.sequences, REGIMES)

    def places(self, idx: NDArray[np.int64]) -> noise_io.Places:
        """Where aligned tokens ``idx`` are, as arrays: A's sequence name and position, B's regime
        and A's (what :meth:`entry` gives token by token)."""
        seq, pos, regime, regime_a = self.alignment.places(idx)
        names = np.asarray(self.a.sequences, dtype=object)
        words = np.asarray(REGIMES, dtype=object)
        return noise_io.Places(names[seq] if len(names) else np.empty(0, object), pos, words[regime], words[regime_a])

    def with_noise(self, model: NoiseModel, options: PlanOptions) -> DiffPlan:
        """A new plan: this one with the noise model measured and every pair's tolerances set by
        it (a plan made with ``measure_noise=False`` until its numeric pass has measured the noise)."""
        noise = noise_io.tolerance_fn(model)
        jobs = tuple(replace(j, tolerances=_tolerances(j, options, noise)) if j.basis is not None else j
                     for j in self.jobs)
        return replace(self, jobs=jobs, noise=model)


def plan_diff(a: TraceSource, b: TraceSource, options: PlanOptions, progress: Progress | None = None, *,
              measure_noise: bool = True) -> DiffPlan:
    """The plan of diffing ``a`` (the reference) against ``b``. Raises
    :class:`~tensordiff.errors.IncompatibleTracesError` when they cannot be compared (other
    models, no common token, no common tensor, mismatched shapes). ``measure_noise=False``: the
    noise model is left to the numeric pass (:meth:`DiffPlan.with_noise`) and the tolerances
    are the defaults until then."""
    report = progress or _quiet
    check_models(a, b)
    report(Stage.ALIGNING, 0, 1)
    sides = (SideTokens(a), SideTokens(b))
    al = align_tokens(a, b, sides)
    report(Stage.ALIGNING, 1, 1)
    maps = RowMaps(al, a, b, *sides)
    pairs, notes = pair_tensors(a, b)
    # predictions (top-k tables, verify steps) are not states: tensordiff.acceptance compares them
    pairs = [(x, y) for x, y in pairs if not (acceptance.is_prediction(x) or acceptance.is_prediction(y))]
    notes = [f for f in notes if not (_prediction(a, f.tensor) or _prediction(b, f.tensor))]
    for ia, ib in pairs:
        if ia.width != ib.width and not (ia.kind == ib.kind == "packed" and ia.slot_width == ib.slot_width):
            raise IncompatibleTracesError(f"tensor {ia.name}: width {ia.width} in A but {ib.width} in B "
                                          "(mismatched shapes)")
    if not pairs:
        raise IncompatibleTracesError("the traces share no tensor to compare (no common names, boundaries or "
                                      "packed inputs)")
    # the noise model (measured where both sides recorded a catalog state) sets every token's
    # default tolerance before the numeric pass
    noise: NoiseTolerance | None = None
    if measure_noise:
        model = noise_io.measure(a, b, maps, pairs, lambda i, s: depth_of(a, b, i, s))
        noise = noise_io.tolerance_fn(model)
    else:
        model = NoiseModel(noise_io.side_dtype(a), noise_io.side_dtype(b))
    memo: dict[tuple[int, int], tuple[Codes, Codes, NDArray[np.bool_], Codes]] = {}
    jobs = tuple(_job(i, ia, ib, a, b, maps, options, memo, noise) for i, (ia, ib) in enumerate(pairs))
    return DiffPlan(a=a, b=b, alignment=al, sides=sides, maps=maps, notes=tuple(notes),
                    token_findings=tuple(token_findings(a, b, al)), jobs=jobs, noise=model)


def _quiet(stage: Stage, done: int, total: int) -> None:
    pass


def _prediction(r: TraceSource, name: str | None) -> bool:
    info = r.tensors.get(name) if name is not None else None
    return info is not None and acceptance.is_prediction(info)


def check_models(a: TraceSource, b: TraceSource) -> None:
    """The two traces record the same model (hidden size, layers), and every packed tensor's slots
    are of the hidden size."""
    ha, hb = a.hidden_size, b.hidden_size
    if ha is not None and hb is not None and ha != hb:
        raise IncompatibleTracesError(
            f"traces of models with different hidden sizes ({ha} in {os.path.basename(a.path)}, "
            f"{hb} in {os.path.basename(b.path)}): not the same model")
    na, nb = a.num_layers, b.num_layers
    if na is not None and nb is not None and na != nb:
        raise IncompatibleTracesError(f"traces of models with different layer counts ({na} vs {nb}): not the same model")
    for r in (a, b):
        h = r.hidden_size
        for i in r.tensors.values():
            if i.kind == "packed" and h:
                if i.width % h:
                    raise IncompatibleTracesError(f"packed tensor {i.name!r} has width {i.width}, not a multiple "
                                                  f"of the hidden size {h}", r.path)
                if i.slot_width != h:
                    raise IncompatibleTracesError(f"packed tensor {i.name!r} has slot width {i.slot_width} but the "
                                                  f"hidden size is {h}", r.path)


def token_findings(a: TraceSource, b: TraceSource, al: TokenAlignment) -> list[Finding]:
    """Shifts, mismatched tokens, gaps and recovered traces: what the token tables say before any tensor."""
    out = []
    nonzero = {s: n for s, n in al.shifts.items() if s != 0}
    if nonzero:
        s, n = max(nonzero.items(), key=lambda kv: kv[1])
        pair = next(p for p in al.seq_pairs if p.shift == s)
        out.append(Finding(Kind.TOKEN_SHIFT, Severity.DIVERGENCE, seq=pair.a,
                           details=ShiftDetails(shift=s, sequences=n, of=sum(al.shifts.values()),
                                                side_a=a.side, side_b=b.side)))
    for m in al.mismatches:
        out.append(Finding(Kind.TOKEN_MISMATCH, Severity.DIVERGENCE, seq=m.seq, position=m.positions[0][0],
                           details=TokenMismatchDetails(
                               seq=m.seq, seq_b=m.seq_b, positions=m.positions, count=m.count,
                               tokens_a=m.tokens_a, tokens_b=m.tokens_b, side_a=a.side, side_b=b.side)))
    # gaps: one note per (side, reason), with counts (the JSON's "gaps" keeps every sequence)
    groups: dict[tuple[str, str], list[Any]] = {}
    for g in al.gaps:
        groups.setdefault((g.side, g.reason), []).append(g)
    for (side, reason), gs in groups.items():
        g0 = gs[0]
        out.append(Finding(Kind.GAP, Severity.INFO, seq=g0.seq, details=GapDetails(
            seq=g0.seq, side=side, side_name=a.side if side == "a" else b.side, positions=g0.positions,
            count=sum(g.count for g in gs), reason=reason, sequences=len(gs), seqs=[g.seq for g in gs[:8]])))
    # a trace recovered from a killed recording: say so (its missing tail shows up as gaps)
    for r in (a, b):
        note = r.recovered_note
        if note:
            out.append(Finding(Kind.RECOVERED, Severity.INFO, details=RecoveredDetails(side=r.side, path=r.path,
                                                                                        note=note)))
    return out


def depth_of(a: TraceSource, b: TraceSource, info: TensorInfo, slot: int) -> float | None:
    """How deep a tensor's state is (for the default tolerance): a boundary's index, the layer
    count for final_norm, a packed slot's claimed state; None when unknown."""
    L = a.num_layers if a.num_layers is not None else b.num_layers
    if info.kind == "boundary" and info.boundary is not None:
        return float(info.boundary)
    if info.kind == "final_norm":
        return float(L) if L is not None else None
    tap = maybe_state(info.name) if info.kind == "other" else None
    if tap is not None and tap.kind == "tap":  # a sub-layer tap of layer b: between boundaries b and b+1
        return tap.depth(L)
    labels = info.slot_labels or []
    if slot < len(labels):
        try:
            d = parse_label(labels[slot])
        except ValueError:
            return float(L) if L is not None else None
        return float(d if d is not None else (L or 0))
    named = name_depth(info.name) if info.kind == "other" else None   # a module hook's name
    if named is not None:
        return named if L is None else min(named, float(L))
    return float(L) if L is not None else None


def _job(index: int, ia: TensorInfo, ib: TensorInfo, a: TraceSource, b: TraceSource, maps: RowMaps,
         options: PlanOptions, memo: dict[tuple[int, int], tuple[Codes, Codes, NDArray[np.bool_], Codes]],
         noise: NoiseTolerance | None) -> PairJob:
    """Pairing checks and the basis of one tensor pair, and what its numerics need."""
    # the row maps' shared inverses (read only), and one ``both`` mask and index per pair of them:
    # per-pair copies would cost tens of MB a pair at a million tokens
    ma, mb = maps.inverse("a", ia.name), maps.inverse("b", ib.name)
    hit = memo.get((id(ma), id(mb)))
    if hit is None or hit[0] is not ma or hit[1] is not mb:
        both_new = (ma >= 0) & (mb >= 0)
        hit = memo[(id(ma), id(mb))] = (ma, mb, both_new, np.flatnonzero(both_new))
    both, rows = hit[2], hit[3]
    k = min(ia.slot_count, ib.slot_count)
    label = ia.label if ia.name == ib.name else f"{ia.name} ~ {ib.name}"
    depth = tuple(depth_of(a, b, ia, s) for s in range(k))
    findings = _pairing_findings(a, b, ia, ib)
    basis, missing = _basis(a, b, ia, ib, ma, mb, both, label)
    if basis is None:
        assert missing is not None and isinstance(missing.details, MissingDetails)
        return PairJob(index, ia, ib, label, k, depth, tuple(findings + [missing]), both, rows, ma, mb, None,
                       not_compared=missing.details.reason_text or "not comparable")
    pa, pb = a.part(ia.name, basis), b.part(ib.name, basis)
    job = PairJob(index, ia, ib, label, k, depth, tuple(findings), both, rows, ma, mb, basis,
                  width=ia.slot_width if basis == "values" else a.sketch_dim,
                  block_rows=rows_per_block(max(pa.row_bytes, pb.row_bytes), options.block_rows))
    return replace(job, tolerances=_tolerances(job, options, noise))


def _tolerances(job: PairJob, options: PlanOptions, noise: NoiseTolerance | None) -> tuple[Tolerance, ...]:
    """Each compared slot's tolerance, from the options' book (``noise``: the noise model's, where
    no rule, override or calibration sets one; None: the dtype default)."""
    k, ia, ib = job.slots, job.a, job.b
    return tuple(options.tolerances.for_tensor(ia.name, ia.dtype, ib.dtype, s if k > 1 else None, job.depth[s], noise)
                 for s in range(k))


def _pairing_findings(a: TraceSource, b: TraceSource, ia: TensorInfo, ib: TensorInfo) -> list[Finding]:
    out = []
    sa, sb = a.side, b.side
    if ia.slot_count != ib.slot_count:
        out.append(Finding(Kind.PAIRING, Severity.DIVERGENCE, tensor=ia.name, order=ia.order,
                           details=PairingDetails(what="slots", value_a=ia.slot_count, value_b=ib.slot_count,
                                                  side_a=sa, side_b=sb)))
    # the token pairing of a draft's input matters only against another draft input: a target's
    # aux capture (role "aux", offset 0) holds the same states at row t as a draft input does
    if ia.token_offset != ib.token_offset and ia.role == ib.role:
        out.append(Finding(Kind.PAIRING, Severity.DIVERGENCE, tensor=ia.name, order=ia.order,
                           details=PairingDetails(what="token_offset", value_a=ia.token_offset,
                                                  value_b=ib.token_offset, side_a=sa, side_b=sb)))
    return out


def _basis(a: TraceSource, b: TraceSource, ia: TensorInfo, ib: TensorInfo, ma: Codes, mb: Codes,
           both: NDArray[np.bool_], label: str) -> tuple[Basis | None, Finding | None]:
    """What the pair is compared on (full values, else sketches), or None with a warning that
    says why not, naming both sides' rows or sketch settings."""
    basis: Basis = "values" if (ia.has_values and ib.has_values) else "sketch"
    reason = text = None
    if not both.any():
        reason = "no_common_token"
        text = (f"{a.side} has rows at {int((ma >= 0).sum())} aligned tokens, {b.side} at "
                f"{int((mb >= 0).sum())}, none in common")
    elif basis == "sketch" and not (ia.has_sketch and ib.has_sketch and a.sketch_seed == b.sketch_seed
                                    and a.sketch_dim == b.sketch_dim):
        reason = "no_basis"

        def kept(r: TraceSource, i: TensorInfo) -> str:
            what = "full values" if i.has_values else "no full values"
            sk = f"sketches (seed {r.sketch_seed}, dim {r.sketch_dim})" if i.has_sketch else "no sketches"
            return f"{r.side} keeps {what} and {sk}"
        text = f"{kept(a, ia)}; {kept(b, ib)}"
    if reason is None:
        return basis, None
    return None, Finding(Kind.MISSING, Severity.WARNING, tensor=ia.name, order=ia.order,
                         details=MissingDetails(reason=reason, label=label, reason_text=text or ""))


__all__ = ["Basis", "DiffPlan", "PairJob", "check_models", "depth_of", "plan_diff", "token_findings"]
