"""What runs after the verdicts of every pair: one :class:`Analysis` each, read in turn by the
judge (:func:`tensordiff.diff.judge.judge`) over what the pairs and the analyses before it found.

- :class:`Routing`: the MoE routers' expert choices compared (:mod:`tensordiff.routing`);
- :class:`ResidualRule`: a residual tap's divergence within the next boundary's noise is a note;
  so is an MLP tap's divergence that only carries its input's measured error;
- :class:`ZoomSignature`: what kind of difference the first divergence shows, when a recorded
  config difference or a zoomed layer's taps say it (:mod:`tensordiff.signatures`);
- :class:`Graft`: what a run recorded with a state grafted from another trace says;
- :class:`Acceptance`: why the draft's acceptance is what it is (:mod:`tensordiff.acceptance`).

An analysis returns the findings as it leaves them: those it was given, with its own added or
some replaced by new ones; it changes none it was given (findings are frozen). None orders or
numbers them: :func:`tensordiff.diff.order.order` does, once, after the last."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import numpy as np

from .. import acceptance, model_config, noise, routing, signatures
from ..findings import Finding, Kind, PairStats, Severity, SignatureDetails
from . import inflow
from .order import in_order
from .plan import DiffPlan


class Analysis(Protocol):
    """One analysis of a judged diff."""

    def findings(self, plan: DiffPlan, pairs: Sequence[PairStats], found: Sequence[Finding]) -> Sequence[Finding]:
        """``found`` (the diff's findings so far, in no particular order) as this analysis leaves
        them: with its own added, or some replaced by new ones. ``pairs``: every paired tensor's
        statistics."""
        ...


@dataclass(frozen=True)
class Routing:
    """The routing note (when either side recorded routing): ``flips`` the near-tie flips per
    layer, ``set_apart`` the states whose failing tokens the judge set apart for them."""

    flips: Mapping[int, np.ndarray]
    set_apart: Sequence[routing.SetApart]

    def findings(self, plan: DiffPlan, pairs: Sequence[PairStats], found: Sequence[Finding]) -> Sequence[Finding]:
        return routing.add_finding(plan.a, plan.b, plan.alignment, plan.maps, list(found), dict(self.flips),
                                   list(self.set_apart))


@dataclass(frozen=True)
class ResidualRule:
    """A divergence of a tap added to the residual stream whose every token adds no more to the
    next boundary than that boundary's per-token noise allows becomes a note
    (:func:`tensordiff.signatures.residual_noise`), unless the next boundary diverges and no other
    op of the layer does: then it is the one candidate, and stands. With ``attn_out`` within the
    noise (a note, or no divergence), the MLP taps' divergences that only carry the measured error
    of their input (``layer<b> + attn_out``) are notes too (:mod:`tensordiff.diff.inflow`); they
    are not "another op of the layer" that keeps ``attn_out`` a note."""

    def findings(self, plan: DiffPlan, pairs: Sequence[PairStats], found: Sequence[Finding]) -> Sequence[Finding]:
        taps = [f for f in found if f.kind == Kind.NUMERIC and f.severity == Severity.DIVERGENCE
                and (f.tensor or "").endswith(signatures.RESIDUAL_TAPS)]
        mlp = any(f.kind in (Kind.NUMERIC, Kind.SLOT_IDENTITY) and f.severity == Severity.DIVERGENCE
                  and (f.tensor or "").endswith(inflow.MLP_TAPS) for f in found)
        if not taps and not mlp:
            return found
        tap_pairs = tap_pairs_of(plan)
        limits = {j.label: j.tolerances[0].max_rel for j in plan.jobs if j.tolerances and j.slots == 1}
        notes = {id(f): t for f in taps
                 if (t := signatures.residual_noise(plan.a, plan.b, tap_pairs, f, limits)) is not None}
        # the MLP taps' inflow, as if every residual note stood (:func:`_inflow` keys by position)
        flows = _inflow(plan, tap_pairs, [replace(f, severity=Severity.INFO) if id(f) in notes else f for f in found]) \
            if mlp else {}
        divs = [f for f in found if f.severity == Severity.DIVERGENCE and f.tensor]
        explained = {id(found[i]) for i in flows}
        noted: dict[int, str] = {}
        standing: set[str] = set()
        for f in taps:
            if id(f) not in notes:
                continue
            layer = (f.tensor or "").split(".", 1)[0]
            nxt = f"layer{int(layer[5:]) + 1}" if layer[5:].isdigit() else ""
            # the next boundary diverges and nothing else of this layer stays a divergence (an MLP
            # tap that only carries its input's error is not one): this op is the only candidate
            # for it, and the finding stands
            others = [g for g in divs if (g.tensor or "").startswith(layer + ".") and id(g) not in notes
                      and id(g) not in explained]
            if any(g.tensor == nxt for g in divs) and not others:
                standing.add(layer)
                continue
            noted[id(f)] = notes[id(f)]
        for i, text in flows.items():
            f = found[i]
            if (f.tensor or "").split(".", 1)[0] not in standing:   # its input's error flows from a divergence
                noted[id(f)] = text
        return [replace(f, severity=Severity.INFO, text=noted[id(f)]) if id(f) in noted else f for f in found]


def _inflow(plan: DiffPlan, tap_pairs: Sequence[signatures.TapPair], found: Sequence[Finding]) -> dict[int, str]:
    """:func:`tensordiff.diff.inflow.inflow_notes` of ``found``, keyed by position in it; each MLP
    tap's per-token max rel and its median's limit from the depth trend, from the plan."""
    limits = {}
    for j in plan.jobs:
        if j.slots == 1 and j.tolerances and (j.label or "").endswith(inflow.MLP_TAPS):
            e = plan.noise.expected(j.depth[0] if j.depth else None, (j.a.dtype, j.b.dtype))
            limits[j.label] = (j.tolerances[0].max_rel, noise.LEVEL * e.q50)
    by_id = inflow.inflow_notes(plan.a, plan.b, tap_pairs, found, limits)
    return {i: by_id[id(f)] for i, f in enumerate(found) if id(f) in by_id}


@dataclass(frozen=True)
class ZoomSignature:
    """The finding that leads a diff whose first divergence a recorded config difference explains
    (:func:`tensordiff.signatures.config_finding`), whatever the traces recorded (full values or
    sketches only), or, of a tap of a zoomed layer, what kind of difference its first op shows
    (:func:`tensordiff.signatures.zoom_finding`, on the tap pairs compared on full values). A
    difference nothing downstream shows makes every divergence a note."""

    def findings(self, plan: DiffPlan, pairs: Sequence[PairStats], found: Sequence[Finding]) -> Sequence[Finding]:
        ordered = in_order(found)
        taps = tap_pairs_of(plan)
        if taps:
            sig = signatures.zoom_finding(plan.a, plan.b, plan.alignment.code_a, taps, ordered)
        else:   # no tap compared on full values: a recorded config difference is still named first
            first = next((f for f in ordered if f.severity == Severity.DIVERGENCE), None)
            sig = None
            if first is not None and first.kind in (Kind.NUMERIC, Kind.NONFINITE) and first.tensor is not None:
                sig = signatures.config_finding(first, signatures.config_differences(plan.a, plan.b, first.tensor),
                                                plan.a.num_layers or plan.b.num_layers)
        if sig is None and not any(f.severity == Severity.DIVERGENCE for f in found):
            sig = config_unseen(plan, pairs)
        if sig is None:
            return found
        if signatures.absorbed(sig):
            found = [replace(f, severity=Severity.INFO) if f.severity == Severity.DIVERGENCE else f for f in found]
        return [*found, sig]


def config_unseen(plan: DiffPlan, pairs: Sequence[PairStats]) -> Finding | None:
    """A divergence for a recorded config difference no compared state showed past its allowance
    (None without one). The two sides provably compute different functions (a rope theta, a norm
    eps, an activation that differs: :func:`tensordiff.model_config.explains`; never the dtype),
    and a difference spread over every layer and token can stay under an allowance that nothing
    before it measured: an "agree" there would be a verdict on a real bug. It sits at the first
    compared state the difference acts on, with that state's largest error as the evidence."""
    # measured settings only: a label (a rope type, an activation's name) is spelled differently by
    # engines that compute the same thing ("yarn" and "deepseek_yarn"), so alone it proves nothing;
    # beside a divergence it is still named (the zoom signature's config finding)
    config = [d for d in model_config.differences(model_config.read(getattr(plan.a, "model", None)),
                                                  model_config.read(getattr(plan.b, "model", None)))
              if _measured(d[1]) and _measured(d[2])]
    for p in sorted((p for p in pairs if p.compared), key=lambda p: p.order):
        here = [d for d in config if model_config.explains(d[0], p.label)]
        if not here:
            continue
        worst = max((r for r in p.rel_max if np.isfinite(r)), default=0.0)
        det = SignatureDetails(op=p.label, signature="config",
                               what="the models' recorded configs differ, and every decoder layer runs with it",
                               evidence=(f"{p.label} moved {worst:.3g} relative at most, within its allowance: "
                                         "the difference is under what these traces tell from noise, not absent"),
                               cause=model_config.sentence(here), layer=None,
                               params={"config": {k: [va, vb] for k, va, vb in here}})
        return Finding(Kind.SIGNATURE, Severity.DIVERGENCE, tensor=p.label, order=p.order - 1e-9, details=det)
    # none of the states it shows at first was compared (a packed draft input alone): a setting every
    # decoder layer runs with moves every state past layer 0, so the first compared one says it
    every = [d for d in config if model_config.explains(d[0], "layer1")]
    for p in sorted((p for p in pairs if p.compared), key=lambda p: p.order) if every else ():
        deep = [s for s, d in enumerate(p.depth) if d is not None and d >= 1]
        if not deep:
            continue
        s = min(deep, key=lambda s: p.depth[s] or 0.0)
        worst = p.rel_max[s] if s < len(p.rel_max) and np.isfinite(p.rel_max[s]) else 0.0
        where = p.label if p.slots == 1 else f"slot {s} of {p.label}"
        det = SignatureDetails(op=p.label, signature="config",
                               what="the models' recorded configs differ, and every decoder layer runs with it",
                               evidence=(f"{where} moved {worst:.3g} relative at most, within its allowance, the first "
                                         "compared state after layer 0: the difference is under what these traces "
                                         "tell from noise, not absent"),
                               cause=model_config.sentence(every), layer=None,
                               params={"config": {k: [va, vb] for k, va, vb in every}})
        return Finding(Kind.SIGNATURE, Severity.DIVERGENCE, tensor=p.label, slot=s if p.slots > 1 else None,
                       order=p.order - 1e-9, details=det)
    return None


def _measured(v: object) -> bool:
    """A number or a list of numbers (a setting's value, not its name)."""
    if isinstance(v, list):
        return bool(v) and all(_measured(x) for x in v)
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclass(frozen=True)
class Graft:
    """The note of a diff where one side was recorded with a state grafted from another trace
    (:func:`tensordiff.signatures.graft_finding`)."""

    def findings(self, plan: DiffPlan, pairs: Sequence[PairStats], found: Sequence[Finding]) -> Sequence[Finding]:
        graft = signatures.graft_finding(plan.a, plan.b, in_order(found))
        return found if graft is None else [*found, graft]


@dataclass(frozen=True)
class Acceptance:
    """The acceptance finding (when either side recorded draft predictions or verify steps);
    ``state_error``: the deepest state's error, what the logits inherit."""

    state_error: tuple[str, float] | None = None

    def findings(self, plan: DiffPlan, pairs: Sequence[PairStats], found: Sequence[Finding]) -> Sequence[Finding]:
        return acceptance.add_finding(plan.a, plan.b, plan.alignment, plan.maps, found, pairs, self.state_error)


def tap_pairs_of(plan: DiffPlan) -> list[signatures.TapPair]:
    """The one-slot pairs compared on full values, as the signatures read them."""
    return [signatures.TapPair(j.label, j.a.name, j.b.name, j.rows_a, j.rows_b, j.rows)
            for j in plan.jobs if j.basis == "values" and j.slots == 1]


__all__ = ["Acceptance", "Analysis", "Graft", "ResidualRule", "Routing", "ZoomSignature", "tap_pairs_of"]
