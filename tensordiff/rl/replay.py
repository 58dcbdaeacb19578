"""Routing replay ("R3") checked from the traces: did the trainer's experts get the rollout's
expert ids *and* their weights?

In MoE RL the trainer replays the rollout's routing so its experts are the ones the tokens were
sampled through. A replay that hands over the expert ids but lets the trainer's router recompute
the continuous gate weights from its own logits leaves a gap that does not close (miles#2722:
0.369 -> 0.139 MAE, not to zero). The trainer's recorder (:class:`~tensordiff.recorders.routing.
ExpertRoutingTaps`) writes what its experts were handed (``moe_routing_layer<i>``) and, where that
is not the router's own output, the router's own table (``moe_router_own_layer<i>``). So a replay
is seen in the trace, not assumed:

* replayed ids: the experts were handed the rollout's expert ids on every compared token, and the
  router's own choice differs from what the experts were handed somewhere (a replay is in effect);
* recomputed weights: where the router's own ids are the handed ones, the handed weights are
  bitwise the router's own, while they differ from the rollout's. A replayed weight is the
  rollout's value passed on (at most one cast), never bitwise the trainer's own recomputation
  unless the two routers compute bit for bit alike, which makes the replay moot.

Pure numpy: it reads the two traces' routing tables.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from ..conventions import MOE_ROUTER_OWN
from ..routing import BLOCK, routing_layers

if TYPE_CHECKING:  # pragma: no cover
    from ..align import RowMaps, TokenAlignment
    from ..trace import TraceSource

__all__ = ["ROUTER_OWN", "ReplayCheck", "check", "router_own_layer"]

ROUTER_OWN = MOE_ROUTER_OWN   # the name prefix the trainer's recorder writes (recorders.routing)
#: a replay recomputes the weights where at least this share of the tokens whose router chose the
#: handed ids were handed its own weights bit for bit (a replayed weight is the rollout's value)
RECOMPUTED_SHARE = 0.99
#: a replayed weight is the rollout's value through at most one cast: one bf16 rounding (relative
#: 2^-9) is the widest such a copy leaves; a median relative difference past twice that is no copy
CAST_REL = 2.0 ** -8


def router_own_layer(name: str) -> int | None:
    tail = name[len(ROUTER_OWN):] if name.startswith(ROUTER_OWN) else ""
    return int(tail) if tail.isdigit() else None


@dataclass
class ReplayCheck:
    """Per MoE layer where the replaying side recorded its router's own choice: ``tokens``
    compared with the other side, ``flips`` (handed ids other than the other side's), ``overridden``
    (tokens whose router chose other experts than it was handed), ``own_same`` (tokens whose router
    chose the handed ids) and of those ``recomputed`` (handed weights bitwise the router's own),
    ``median_w`` / ``max_w`` (|handed - other side's weights| on the tokens with the same ids)."""

    side: str                      # "a" or "b": which trace replays
    layers: list[dict[str, Any]] = field(default_factory=list)
    flips_elsewhere: int = 0       # flips in the MoE layers where the router's own choice was handed on
    moe_layers: int = 0            # MoE layers both sides recorded

    @property
    def ids_replayed(self) -> bool:
        return (bool(self.layers) and self.flips_elsewhere == 0
                and all(x["flips"] == 0 and x["tokens"] > 0 for x in self.layers))

    @property
    def weights_recomputed(self) -> list[dict[str, Any]]:
        """The layers whose handed weights are the router's own and not the other side's."""
        return [x for x in self.layers if x["median_w"] > 0 and (
            (x["own_same"] and x["recomputed"] >= RECOMPUTED_SHARE * x["own_same"]) or x["median_rel"] > CAST_REL)]

    def to_dict(self) -> dict[str, Any]:
        return {"side": self.side, "layers": self.layers, "flips_elsewhere": self.flips_elsewhere,
                "moe_layers": self.moe_layers, "ids_replayed": self.ids_replayed,
                "weights_recomputed": [x["layer"] for x in self.weights_recomputed]}


def _own_layers(r: TraceSource) -> dict[int, str]:
    out = {}
    for name in r.tensors:
        layer = router_own_layer(name)
        if layer is not None:
            out[layer] = name
    return out


def check(a: TraceSource, b: TraceSource, al: TokenAlignment, maps: RowMaps,
          layer_flips: dict[int, int] | None = None) -> ReplayCheck | None:
    """The replay seen in the traces (None: neither side's experts were handed other than its
    router's own choice); ``layer_flips``: {MoE layer: flips} of the routing comparison
    (:func:`tensordiff.routing.compare`), for the layers the replay left as they were."""
    own_a, own_b = _own_layers(a), _own_layers(b)
    if not own_a and not own_b:
        return None
    side, r, o, own = ("a", a, b, own_a) if own_a else ("b", b, a, own_b)
    other = "b" if side == "a" else "a"
    lr, lo = routing_layers(r), routing_layers(o)
    out = ReplayCheck(side, moe_layers=len(set(lr) & set(lo)))
    out.flips_elsewhere = sum(n for layer, n in (layer_flips or {}).items() if layer not in own)
    everything = np.arange(len(al))
    for layer in sorted(set(own) & set(lr) & set(lo)):
        hn, on, wn = lr[layer].name, lo[layer].name, own[layer]
        if not (r.tensors[hn].width == o.tensors[on].width == r.tensors[wn].width) or r.tensors[hn].width % 2:
            continue
        k = r.tensors[hn].width // 2
        (mh,), (mw,) = maps.rows_at(side, hn, [everything]), maps.rows_at(side, wn, [everything])
        (mo,) = maps.rows_at(other, on, [everything])
        both = np.flatnonzero((mh >= 0) & (mo >= 0))
        flips = overridden = own_same = recomputed = 0
        diffs: list[np.ndarray] = []
        rels: list[np.ndarray] = []
        for s in range(0, len(both), BLOCK):
            blk = both[s:s + BLOCK]
            vh = np.asarray(r.part(hn, "values").take(mh[blk]), dtype=np.float64)
            vo = np.asarray(o.part(on, "values").take(mo[blk]), dtype=np.float64)
            same = (vh[:, :k] == vo[:, :k]).all(axis=1)   # rows hold ids ascending on both sides
            flips += int((~same).sum())
            dw = np.abs(vh[same, k:] - vo[same, k:])
            diffs.append(dw.max(axis=1))
            with np.errstate(divide="ignore", invalid="ignore"):
                rels.append(np.nan_to_num((dw / np.abs(vo[same, k:])).max(axis=1), nan=0.0, posinf=np.inf))
            has = mw[blk] >= 0
            if has.any():
                vw = np.asarray(r.part(wn, "values").take(mw[blk][has]), dtype=np.float64)
                hh = vh[has]
                ids_own = (vw[:, :k] == hh[:, :k]).all(axis=1)
                overridden += int((~ids_own).sum())
                own_same += int(ids_own.sum())
                recomputed += int((ids_own & (vw[:, k:] == hh[:, k:]).all(axis=1)).sum())
        d = np.concatenate(diffs) if diffs else np.zeros(0)
        rel = np.concatenate(rels) if rels else np.zeros(0)
        out.layers.append({"layer": layer, "tokens": int(len(both)), "flips": flips, "overridden": overridden,
                           "own_same": own_same, "recomputed": recomputed,
                           "median_w": float(np.median(d)) if len(d) else 0.0,
                           "max_w": float(d.max()) if len(d) else 0.0,
                           "median_rel": float(np.median(rel)) if len(rel) else 0.0})
    return out if out.layers else None


def _who(c: ReplayCheck, a_role: str, b_role: str) -> tuple[str, str]:
    return (a_role, b_role) if c.side == "a" else (b_role, a_role)


def sentence(c: ReplayCheck, a_role: str = "trainer", b_role: str = "rollout") -> str | None:
    """The first sentence for a replay of ids whose weights are recomputed (None: not that)."""
    bad = c.weights_recomputed
    if not (c.ids_replayed and bad):
        return None
    who, whom = _who(c, a_role, b_role)
    worst = max(bad, key=lambda x: x["median_w"])
    over = sum(x["overridden"] for x in c.layers)
    n = sum(x["tokens"] for x in c.layers)
    where = ("MoE layer " if len(bad) == 1 else "MoE layers ") + ", ".join(str(x["layer"]) for x in bad)
    own = [x for x in bad if x["own_same"] and x["recomputed"] >= RECOMPUTED_SHARE * x["own_same"]]
    how = (f"the {who}'s own router weights bit for bit where it chose the same experts" if len(own) == len(bad) else
           f"weights a median {max(x['median_rel'] for x in bad):.3g} (relative) off the {whom}'s, more than a cast "
           "of them leaves")
    return (f"routing: the {who} replays the {whom}'s expert ids but recomputes their weights (layer "
            f"{worst['layer']}: median |w diff| {worst['median_w']:.3g}, max {worst['max_w']:.3g}; in {where} the "
            f"experts get the {whom}'s ids on all {n} token-layer choices, {over} of them not the {who}'s own "
            f"router's choice, and {how}, where a replayed weight is the {whom}'s): replay the routing weights too")


def note(c: ReplayCheck, a_role: str = "trainer", b_role: str = "rollout") -> str | None:
    """A line for a replay whose ids and weights both came from the other side."""
    if not c.ids_replayed or c.weights_recomputed:
        return None
    who, whom = _who(c, a_role, b_role)
    over = sum(x["overridden"] for x in c.layers)
    n = sum(x["tokens"] for x in c.layers)
    wmax = max(x["max_w"] for x in c.layers)
    return (f"  routing replayed: the {who}'s experts were handed the {whom}'s expert ids and weights on all {n} "
            f"token-layer choices ({over} not its own router's choice; max |w diff| {wmax:.3g})")
