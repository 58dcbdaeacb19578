"""MoE routing of two traces compared: which tokens a router sends to other experts on one side.

Each side's recorder writes one ``moe_routing_layer<i>`` tensor per MoE layer (role
``moe_routing``; :data:`tensordiff.conventions.MOE_ROUTING`, docs/format.md): per token the k expert
ids, ascending, then their weights. Routing is discrete, so the numerics skip these tensors (they
are among :data:`~tensordiff.conventions.PREDICTION_ROLES`); here, on the tokens both sides
recorded, a *flip* is a token whose expert set differs. The result is one ``routing`` finding with
the flip rate per layer, a note: a flip is what bf16 against float32 (or another kernel's
summation order) does to a near-tie, and it is the quantity an RL training-vs-rollout triage
wants counted, not a wiring verdict.

A flip on a near-tie is the port's noise, not a bug: the token then runs through other experts and
its states leave the trend of the others from the next layer on. :func:`near_tie_flips` finds the
flips whose router margin lies within the noise the same layer's agreeing tokens show (the judge
sets those tokens apart from a state's verdict when they are all that fails there and says so in
this note); a flip past that noise (a wrong router) is never set apart.
"""

from __future__ import annotations

from dataclasses import dataclass
import re
from typing import TYPE_CHECKING, Any

import numpy as np

from .conventions import MOE_ROUTING, moe_routing_layer
from .findings import Finding, Kind, RoutingDetails, Severity

if TYPE_CHECKING:  # pragma: no cover
    from .align import RowMaps, TokenAlignment
    from .trace import TensorInfo, TraceSource

__all__ = ["SetApart", "add_finding", "compare", "near_tie_flips", "routing_layers"]

BLOCK = 1 << 16
MIN_AGREEING = 32   # tokens with the same expert set a layer needs before its router noise counts as measured


@dataclass(frozen=True)
class SetApart:
    """A state (``state``: its label, or ``slot i of <tensor>``) whose failing tokens (``tokens``
    of them) were all near-tie flips before it."""
    state: str
    tokens: int


_LAYER = re.compile(r"layer(\d+)")


def state_layer(state: str | None, num_layers: int | None) -> int | None:
    """The decoder layer a residual state enters (``layer<i>``: i; ``final_norm``: the number of
    layers); None for anything else (a routing flip is set apart from these states only)."""
    if state is None:
        return None
    m = _LAYER.fullmatch(state)
    if m:
        return int(m.group(1))
    return num_layers if state == "final_norm" and num_layers else None


def routing_layers(r: TraceSource) -> dict[int, TensorInfo]:
    """{decoder layer: routing tensor} of a trace."""
    out = {}
    for name, info in r.tensors.items():
        layer = moe_routing_layer(name)
        if info.role == MOE_ROUTING and layer is not None:
            out[layer] = info
    return out


def _layer(ra: TraceSource, rb: TraceSource, al: TokenAlignment, maps: RowMaps, layer: int, name_a: str,
           name_b: str) -> dict[str, Any] | None:
    ia, ib = ra.tensors[name_a], rb.tensors[name_b]
    if ia.width != ib.width or ia.width % 2:
        return None
    k = ia.width // 2
    everything = np.arange(len(al))
    (ma,), (mb,) = maps.rows_at("a", name_a, [everything]), maps.rows_at("b", name_b, [everything])
    both = np.flatnonzero((ma >= 0) & (mb >= 0))
    flips = 0
    wmax = 0.0
    first: dict[str, Any] | None = None
    for s in range(0, len(both), BLOCK):
        blk = both[s:s + BLOCK]
        va = ra.part(name_a, "values").take(ma[blk]).astype(np.float64)
        vb = rb.part(name_b, "values").take(mb[blk]).astype(np.float64)
        ids_a, ids_b = np.sort(va[:, :k], axis=1), np.sort(vb[:, :k], axis=1)
        flip = (ids_a != ids_b).any(axis=1)
        flips += int(flip.sum())
        same = ~flip
        if same.any():  # rows are stored with ids ascending: the weights pair up column by column
            wmax = max(wmax, float(np.abs(va[same, k:] - vb[same, k:]).max()))
        if first is None and flip.any():
            tr = int(ra.token_rows(name_a)[ma[int(blk[int(np.flatnonzero(flip)[0])])]])
            first = {"seq": str(ra.sequences[int(ra.tokens["seq"][tr])]), "position": int(ra.tokens["position"][tr])}
    n = len(both)
    return {"layer": layer, "tokens": n, "flips": flips, "rate": flips / n if n else None,
            "weight_max_abs": wmax, "first": first, "k": k}


def _spread(la: np.ndarray, lb: np.ndarray) -> np.ndarray:
    """Per token (rows with the same expert set): the largest change across the sides of a log
    weight ratio between two of its experts (a difference of router logits)."""
    d = la - lb
    return np.asarray(d.max(axis=1) - d.min(axis=1))


def _flip_margin(ids_a: np.ndarray, ids_b: np.ndarray, la: np.ndarray, lb: np.ndarray) -> np.ndarray:
    """Per flipped token: how far the log ratio of a swapped expert to a shared one on A is from
    that of the expert taking its place on B (paired by rank). On a near-tie the two experts had
    the same logit, so this is the noise of the router's logits; inf where no expert is shared."""
    shared_a = (ids_a[:, :, None] == ids_b[:, None, :]).any(axis=2)
    shared_b = (ids_b[:, :, None] == ids_a[:, None, :]).any(axis=2)
    # the shared experts' log weight change, A minus B: rows hold ids ascending on both sides, so
    # the shared ones, moved to the front in their order, pair up expert by expert
    fa = np.argsort(~shared_a, axis=1, kind="stable")
    fb = np.argsort(~shared_b, axis=1, kind="stable")
    sa = np.take_along_axis(np.where(shared_a, la, np.nan), fa, axis=1)
    sb = np.take_along_axis(np.where(shared_b, lb, np.nan), fb, axis=1)
    d = sa - sb
    oa = -np.sort(-np.where(shared_a, -np.inf, la), axis=1)
    ob = -np.sort(-np.where(shared_b, -np.inf, lb), axis=1)
    c = np.where(np.isfinite(oa) & np.isfinite(ob), oa - ob, np.nan)
    out = np.full(len(ids_a), np.inf)
    ok = np.isfinite(d).any(axis=1) & np.isfinite(c).any(axis=1)
    if ok.any():
        dmax, dmin = np.nanmax(d[ok], axis=1), np.nanmin(d[ok], axis=1)
        cmax, cmin = np.nanmax(c[ok], axis=1), np.nanmin(c[ok], axis=1)
        out[ok] = np.maximum(cmax - dmin, dmax - cmin)
    return out


def near_tie_flips(ra: TraceSource, rb: TraceSource, al: TokenAlignment, maps: RowMaps) -> dict[int, np.ndarray]:
    """{MoE layer: aligned indices of the tokens whose expert set flipped on a near-tie}: the
    flip's margin (:func:`_flip_margin`) is no larger than the router noise, the largest log
    weight ratio change that the tokens with the same expert set show in a layer, the smallest
    over the MoE layers: a wrong router widens the spread of its own layer (a scaled expert row
    shifts every ratio it enters), so its own spread never sets its flips apart. Layers with too
    few agreeing tokens measure nothing; fewer than two measured: nothing is set apart (one layer's
    spread has no other to be held against)."""
    la_, lb_ = routing_layers(ra), routing_layers(rb)
    limits: list[float] = []
    flipped: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    for layer in sorted(set(la_) & set(lb_)):
        name_a, name_b = la_[layer].name, lb_[layer].name
        ia, ib = ra.tensors[name_a], rb.tensors[name_b]
        if ia.width != ib.width or ia.width % 2:
            continue
        k = ia.width // 2
        everything = np.arange(len(al))
        (ma,), (mb,) = maps.rows_at("a", name_a, [everything]), maps.rows_at("b", name_b, [everything])
        both = np.flatnonzero((ma >= 0) & (mb >= 0))
        noise_max, agreeing = 0.0, 0
        cand: list[np.ndarray] = []
        margin: list[np.ndarray] = []
        for s in range(0, len(both), BLOCK):
            blk = both[s:s + BLOCK]
            va = ra.part(name_a, "values").take(ma[blk]).astype(np.float64)
            vb = rb.part(name_b, "values").take(mb[blk]).astype(np.float64)
            with np.errstate(divide="ignore", invalid="ignore"):
                la, lb = np.log(va[:, k:]), np.log(vb[:, k:])
                flip = (va[:, :k] != vb[:, :k]).any(axis=1)
                same = ~flip & np.isfinite(la).all(axis=1) & np.isfinite(lb).all(axis=1)
                if same.any():
                    noise_max = max(noise_max, float(_spread(la[same], lb[same]).max()))
                    agreeing += int(same.sum())
                if flip.any():
                    cand.append(blk[flip])
                    margin.append(_flip_margin(va[flip, :k], vb[flip, :k], la[flip], lb[flip]))
        if agreeing >= MIN_AGREEING:
            limits.append(noise_max)
        if cand:
            flipped[layer] = (np.concatenate(cand), np.concatenate(margin))
    if len(limits) < 2:
        return {}
    limit = min(limits)
    out = {layer: idx[m <= limit].astype(np.int64) for layer, (idx, m) in flipped.items()}
    return {layer: idx for layer, idx in out.items() if len(idx)}


def compare(ra: TraceSource, rb: TraceSource, al: TokenAlignment, maps: RowMaps) -> RoutingDetails | None:
    """Routing of A against B per MoE layer (None: neither side recorded any)."""
    la, lb = routing_layers(ra), routing_layers(rb)
    if not la and not lb:
        return None
    rows = []
    for layer in sorted(set(la) & set(lb)):
        got = _layer(ra, rb, al, maps, layer, la[layer].name, lb[layer].name)
        if got is not None:
            rows.append(got)
    return RoutingDetails(layers=rows, tokens=sum(x["tokens"] for x in rows), flips=sum(x["flips"] for x in rows),
                          only_a=sorted(set(la) - set(lb)), only_b=sorted(set(lb) - set(la)),
                          side_a=ra.side, side_b=rb.side)


def add_finding(ra: TraceSource, rb: TraceSource, al: TokenAlignment, maps: RowMaps,
                findings: list[Finding], near: dict[int, np.ndarray] | None = None,
                set_apart: list[SetApart] | None = None) -> list[Finding]:
    """``findings`` with the routing note added (when either side recorded routing); ``near``:
    the near-tie flips per layer (:func:`near_tie_flips`), ``set_apart``: the states the judge
    set their tokens apart from."""
    d = compare(ra, rb, al, maps)
    if d is None:
        return findings
    for row in d.layers:
        row["near_ties"] = len((near or {}).get(row["layer"], ()))
    d.set_apart = [{"state": x.state, "tokens": x.tokens} for x in set_apart or ()]
    order = float(min((x["layer"] for x in d.layers), default=0)) + 0.5
    return findings + [Finding(Kind.ROUTING, Severity.INFO, order=order, details=d)]
