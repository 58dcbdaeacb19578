"""The measured error a zoomed layer's MLP taps inherit from the residual add before them.

``mlp_norm`` normalises ``layer<b> + attn_out``; every MLP tap after it is computed from that.
Where ``attn_out`` carries a large relative error that adds to the residual within its noise (a
random-weight model's attention output nearly cancels: :func:`tensordiff.signatures.residual_noise`),
that error still moves the sum, and the MLP taps inherit it: their allowance from the depth trend
(the boundaries' noise) does not include it, and a correct pair read "mlp_norm diverges". The
allowance of such a tap must include what flows into it, measured: per token, the relative error
of the sum ``||d(layer<b>) + d(attn_out)|| / ||layer<b> + attn_out||`` on A. A tap whose median error
stays within :data:`tensordiff.noise.LEVEL` x that median (and within the trend's own limit added in
quadrature), and whose every token stays within :data:`tensordiff.noise.TOKEN` x its own inflow (the
same in quadrature with its tolerance), shows only the error its input carries: a note. A bug of
the MLP (an activation, a weight) moves its tap far past the error of its input and stands."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
from numpy.typing import NDArray

from .. import noise
from ..findings import Finding, Kind, NumericDetails, Severity
from ..names import maybe_state
from ..signatures import TapPair, pair_rows
from ..trace import TraceSource

#: the taps computed from the residual sum ``layer<b> + attn_out`` (the MLP half of a layer)
MLP_TAPS = ("mlp_norm", "router", "mlp_gate", "mlp_up", "mlp_act", "mlp_out")
#: the taps of the attention half, before ``attn_out``: none of them may diverge
ATTN_TAPS = ("attn_norm", "q", "k", "v", "q_rope", "k_rope")
#: tokens read per tap at most
ROWS = 4096

F64 = NDArray[np.float64]


def _rel_rows(a: F64, b: F64) -> F64:
    return np.asarray(np.linalg.norm(b - a, axis=1) / np.maximum(np.linalg.norm(a, axis=1), 1e-30), np.float64)


def inflow_notes(a: TraceSource, b: TraceSource, pairs: Sequence[TapPair], found: Sequence[Finding],
                 limits: Mapping[str, tuple[float, float]]) -> dict[int, str]:
    """The MLP taps' numeric divergences (by ``id``) that the measured error of their input
    explains, each with its note (module docstring). A layer qualifies only while its input
    boundary, its attention taps and its ``attn_out`` are no divergence (``attn_out`` a note at
    most): the error then flows from states within the noise. ``limits``: per tap label, its
    per-token max rel and its median's limit from the depth trend. A claim that such a tap holds
    another state (a slot identity: its numeric finding, out of the trend's noise, sent the
    search) is withdrawn too: within the inflow's noise it holds its own state, and a tap that
    dominates the boundary it feeds (``mlp_out`` of ``layer<b+1>``) is nearer to that boundary on
    the other side than the trend's noise tells apart."""
    divs = [f for f in found if f.severity == Severity.DIVERGENCE and f.tensor]
    out: dict[int, str] = {}
    by_label = {p.label: p for p in pairs}
    layers = {st.layer for f in divs if (st := maybe_state(f.tensor or "")) is not None and st.kind == "tap"
              and st.tap in MLP_TAPS and st.layer is not None and f.kind in (Kind.NUMERIC, Kind.SLOT_IDENTITY)}
    for layer in sorted(x for x in layers if x is not None):
        inp = "embed" if layer == 0 else f"layer{layer}"
        upstream = {inp, f"layer{layer}.attn_out", *(f"layer{layer}.{t}" for t in ATTN_TAPS)}
        if any(f.tensor in upstream for f in divs):
            continue
        pb, po = by_label.get(inp), by_label.get(f"layer{layer}.attn_out")
        if pb is None or po is None:
            continue
        common = np.intersect1d(pb.token_index, po.token_index)
        if len(common) > ROWS:
            common = common[np.linspace(0, len(common) - 1, ROWS).astype(np.int64)]
        hb, ho = pair_rows(a, b, pb, common), pair_rows(a, b, po, common)
        if hb is None or ho is None or hb[0].shape != ho[0].shape:
            continue
        r_in = _rel_rows(hb[0] + ho[0], hb[1] + ho[1])
        in50 = float(np.median(r_in))
        for f in divs:
            st = maybe_state(f.tensor or "")
            d = f.details
            if st is None or st.kind != "tap" or st.layer != layer or st.tap not in MLP_TAPS:
                continue
            numeric = f.kind == Kind.NUMERIC and isinstance(d, NumericDetails) and d.part in ("level", "tokens")
            if not numeric and not (f.kind == Kind.SLOT_IDENTITY and f.slot is None):
                continue
            lim = limits.get(f.tensor or "")
            if lim is None:
                continue
            p = by_label.get(f.tensor or "")
            if p is None or not np.isin(common, p.token_index).all():
                continue
            x = pair_rows(a, b, p, common)
            if x is None:
                continue
            r = _rel_rows(*x)
            tol, trend_limit = lim
            level_limit = math.hypot(trend_limit, noise.LEVEL * in50)
            med = float(np.median(r))
            token_limit = np.hypot(tol, noise.TOKEN * r_in)
            over = int((r > token_limit).sum())
            if med > level_limit or over:
                continue
            if not numeric:
                out[id(f)] = (f"{f.tensor}: the claim that B's holds another state is withdrawn: B's is A's "
                              f"within the error its input carries ({inp} + attn_out differ by median rel err "
                              f"{in50:.3g}; median rel err {med:.3g} <= {level_limit:.3g} allowed, each of {len(r)} "
                              f"tokens within {noise.TOKEN:g}x its own input's error)")
                continue
            out[id(f)] = (f"{f.tensor}: a median error past the depth trend's allowance, but it is the error its "
                          f"input carries: {inp} + attn_out differ by median rel err {in50:.3g} (attn_out within "
                          f"the noise of the residual); median rel err {med:.3g} <= {level_limit:.3g} allowed "
                          f"(measured inflow), each of {len(r)} tokens within {noise.TOKEN:g}x its own input's error")
    return out


