"""MoE routing of two traces compared: which tokens a router sends to other experts on one side.

Each side's recorder writes one ``moe_routing_layer<i>`` tensor per MoE layer (role
``moe_routing``; :data:`tensordiff.conventions.MOE_ROUTING`, docs/format.md): per token the k expert
ids, ascending, then their weights. Routing is discrete, so the numerics skip these tensors (they
are among :data:`~tensordiff.conventions.PREDICTION_ROLES`); here, on the tokens both sides
recorded, a *flip* is a token whose expert set differs. The result is one ``routing`` finding with
the flip rate per layer, a note: a flip is what bf16 against float32 (or another kernel's
summation order) does to a near-tie, and it is the quantity an RL training-vs-rollout triage
wants counted, not a wiring verdict.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from .conventions import MOE_ROUTING, moe_routing_layer
from .findings import Finding, Kind, RoutingDetails, Severity

if TYPE_CHECKING:  # pragma: no cover
    from .align import RowMaps, TokenAlignment
    from .trace import TensorInfo, TraceSource

__all__ = ["add_finding", "compare", "routing_layers"]

BLOCK = 1 << 16


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
        va = ra.read_at(name_a, "values", ma[blk]).astype(np.float64)
        vb = rb.read_at(name_b, "values", mb[blk]).astype(np.float64)
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
                findings: list[Finding]) -> list[Finding]:
    """``findings`` with the routing note added (when either side recorded routing)."""
    d = compare(ra, rb, al, maps)
    if d is None:
        return findings
    order = float(min((x["layer"] for x in d.layers), default=0)) + 0.5
    return findings + [Finding(Kind.ROUTING, Severity.INFO, order=order, details=d)]
