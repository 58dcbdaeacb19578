"""Signatures: once the taps of one decoder layer are compared (``record ... --zoom layer<b>``) and
the first divergence is one of them, what kind of difference that op shows, from the numbers of
both sides:

* ``swap``: B's op equals A's other op of the same layer (gate and up swapped);
* ``rotary``: in ``q_rope``/``k_rope`` only (q and k agree), the error is nothing at position 0
  and grows with position; the rotary that reproduces each side's values from its q/k is fitted
  (rotate-half or interleaved layout, theta, a linear position scaling) and named;
* ``heads``: the op's heads match across the sides only after a permutation (given);
* ``gqa``: the attention output differs while q, k and v agree, and it is reproduced when each
  query head reads another key/value head (the repeat order: ``h // rep`` vs ``h % kv_heads``);
* ``rope_offset``: in ``q_rope``/``k_rope``, each side is its q/k rotated at ``position + d`` and
  the offsets d differ (a query rotated at p+1);
* ``attn_scale``: the attention output differs while q, k and v agree, and it is reproduced by
  another softmax scale (1/head_dim for 1/sqrt(head_dim)); both scales are fitted;
* ``norm_eps``: a norm's output differs by a per-token ratio that depends on its input's RMS, as
  ``sqrt((ms + eps_A) / (ms + eps_B))`` does; the eps that explains it is fitted;
* ``residual``: ``mlp_norm``'s input on B is not ``layer<b> + attn_out`` (both agreeing) but
  another sum, fitted (the residual taken after the norm, the attention output not added);
* ``activation``: ``mlp_act`` = act(gate) * up with another standard activation on each side;
* ``scale`` / ``per_channel``: B is A times one constant, or times one factor per channel;
* ``op``: none of these; everything upstream agrees, so that op's weights or kernel differ: the
  kinds tried and how far each missed, and the weights command with the traces' model directories.

A difference that nothing downstream shows (every divergence a tap of the block before its
output, which agrees, as does everything after it) is a note (:func:`absorbed_by`).

Each explanation must reproduce B within the noise that the agreeing taps upstream show (or a
small floor), so a signature is a measured claim, not a guess. The math is on plain arrays
(:func:`classify`); :func:`zoom_finding` reads the taps of the layer of a diff's first divergence
from the two traces and makes the finding that leads the report.

Also here, as they read the same tap pairs under the same noise rule: :func:`residual_noise`
(a residual tap judged by what it adds to the next boundary) and :func:`graft_finding` (what a
grafted run's diff says); that is why this module is over 800 lines.

Pure numpy: no torch (the diff calls it)."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np
from numpy.typing import NDArray

from . import model_config
from .findings import Finding, Kind, NumericDetails, Severity, SignatureDetails
from .names import TAPS, maybe_state, parse_state
from .tokens import POS_MASK, SEQ_BITS
from .dtypes import to_float32
from .trace import TraceSource

F64 = NDArray[np.float64]

__all__ = ["LayerInfo", "Signature", "TapRows", "classify", "rope", "zoom_finding"]

#: the smallest noise a fit is held to (float32 arithmetic on both sides)
NOISE_FLOOR = 2e-6
#: how much worse than the upstream noise a fit may be and still explain B
FIT_FACTOR = 4.0
#: how closely A's attention output must be linear in the attention it is fitted with (its o_proj
#: fitted), or within the fit tolerance where that is wider: a bf16 A reproduces its own output
#: only within its rounding, which the noise measured upstream of it shows
FIT_A = 1e-3


def _values(r: TraceSource, name: str, rows: NDArray[np.int64]) -> NDArray[np.float32]:
    """Full values of tensor ``name`` at tensor rows ``rows``, as float32."""
    return to_float32(r.part(name, "values").take(rows), r.tensors[name].dtype)


@dataclass(frozen=True)
class LayerInfo:
    """What the fits need about the layer (from the taps' recorded attributes; None: unknown)."""

    heads: int | None = None
    kv_heads: int | None = None
    head_dim: int | None = None
    eps: float | None = None          # the norms' eps on side A
    eps_b: float | None = None        # on side B (said beside the fitted one, never used to fit)
    rope_theta: float | None = None   # side A's configured theta


@dataclass(frozen=True)
class Signature:
    """What kind of difference ``op`` shows: ``kind`` (see the module doc), ``what`` (a short
    phrase), ``evidence`` (the numbers that show it), ``cause`` (what to look at)."""

    op: str
    kind: str
    what: str
    evidence: str
    cause: str
    params: dict[str, Any] = field(default_factory=dict)


def _rel(a: F64, b: F64) -> float:
    """||b - a|| / ||a|| over everything."""
    na = float(np.linalg.norm(a))
    return float(np.linalg.norm(b - a)) / max(na, 1e-30)


def _rel_rows(a: F64, b: F64) -> F64:
    na = np.linalg.norm(a, axis=1)
    return np.asarray(np.linalg.norm(b - a, axis=1) / np.maximum(na, 1e-30), dtype=np.float64)


def _spearman(x: F64, y: F64) -> float:
    if len(x) < 3:
        return 0.0
    rx = np.argsort(np.argsort(x)).astype(np.float64)
    ry = np.argsort(np.argsort(y)).astype(np.float64)
    rx -= rx.mean()
    ry -= ry.mean()
    d = math.sqrt(float((rx * rx).sum() * (ry * ry).sum()))
    return float((rx * ry).sum()) / d if d > 0 else 0.0


def _g(x: float) -> str:
    return f"{x:.3g}"


# ----------------------------------------------------------------------------------------------
# The rotary embedding, in both layouts
# ----------------------------------------------------------------------------------------------


def rope(x: F64, positions: F64, head_dim: int, theta: float, layout: str = "half", scale: float = 1.0) -> F64:
    """``x`` [n, heads*head_dim] rotated at ``positions`` / ``scale`` with frequencies
    ``theta ** (-2j / head_dim)``: ``half`` pairs channel j with j + head_dim/2 (HF's
    ``rotate_half``), ``interleaved`` pairs 2j with 2j+1 (the original Llama / GPT-J layout)."""
    n = x.shape[0]
    half = head_dim // 2
    xv = x.reshape(n, -1, head_dim)
    inv = theta ** (-np.arange(half, dtype=np.float64) * 2.0 / head_dim)
    ang = (np.asarray(positions, np.float64) / scale)[:, None] * inv[None, :]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    if layout == "half":
        x1, x2 = xv[..., :half], xv[..., half:]
        out = np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    else:
        x1, x2 = xv[..., 0::2], xv[..., 1::2]
        out = np.empty_like(xv)
        out[..., 0::2] = x1 * cos - x2 * sin
        out[..., 1::2] = x2 * cos + x1 * sin
    return np.asarray(out.reshape(n, -1), dtype=np.float64)


@dataclass(frozen=True)
class RopeFit:
    layout: str
    theta: float
    scale: float
    residual: float   # rel err of the fitted rotary against the recorded values


def fit_rope(pre: F64, post: F64, positions: F64, head_dim: int, theta_hint: float | None = None) -> RopeFit:
    """The standard rotary (layout, theta, linear scale) that best maps ``pre`` to ``post``: theta
    on a log grid then refined, both layouts; a linear position scale around ``theta_hint``."""
    best = RopeFit("half", 1e4, 1.0, math.inf)

    def score(layout: str, theta: float, scale: float = 1.0) -> RopeFit:
        return RopeFit(layout, theta, scale, _rel(post, rope(pre, positions, head_dim, theta, layout, scale)))

    for layout in ("half", "interleaved"):
        grid = np.logspace(1.0, 8.0, 141)
        fits = [score(layout, float(t)) for t in grid]
        i = int(np.argmin([f.residual for f in fits]))
        lo, hi = math.log(float(grid[max(i - 1, 0)])), math.log(float(grid[min(i + 1, len(grid) - 1)]))
        for _ in range(40):   # golden section on log theta between the grid neighbours
            m1, m2 = hi - 0.618 * (hi - lo), lo + 0.618 * (hi - lo)
            if score(layout, math.exp(m1)).residual < score(layout, math.exp(m2)).residual:
                hi = m2
            else:
                lo = m1
        cand = min([fits[i], score(layout, math.exp((lo + hi) / 2))], key=lambda f: f.residual)
        if theta_hint is not None:
            for s in (0.25, 0.5, 2.0, 4.0, 8.0, 16.0, 32.0):
                f = score(layout, theta_hint, s)
                if f.residual < cand.residual * 0.5:
                    cand = f
        if cand.residual < best.residual:
            best = cand
    return _round_theta(best, pre, post, positions, head_dim)


def _round_theta(f: RopeFit, pre: F64, post: F64, positions: F64, head_dim: int) -> RopeFit:
    """A fitted theta of 9999.7 is 10000 when the round number fits as well (within 10%)."""
    for digits in (1, 2, 3):
        r = float(f"{f.theta:.{digits}g}")
        res = _rel(post, rope(pre, positions, head_dim, r, f.layout, f.scale))
        if res <= f.residual * 1.1 + NOISE_FLOOR:
            return RopeFit(f.layout, r, f.scale, res)
    return f


def _rope_words(f: RopeFit) -> str:
    lay = "rotate-half" if f.layout == "half" else "interleaved"
    s = f"{lay}, theta {_g(f.theta)}"
    return s + (f", positions / {_g(f.scale)}" if f.scale != 1.0 else "")


# ----------------------------------------------------------------------------------------------
# Attention from the recorded q_rope, k_rope, v (for the GQA repeat order)
# ----------------------------------------------------------------------------------------------


def attention(q: F64, k: F64, v: F64, seqs: NDArray[np.int64], positions: NDArray[np.int64], heads: int,
              kv_heads: int, head_dim: int, kv_of: Sequence[int], scale: float | None = None) -> F64:
    """Causal softmax attention per sequence, query head h reading key/value head ``kv_of[h]``,
    the scores scaled by ``scale`` (None: ``1/sqrt(head_dim)``); [n, heads*head_dim] in the
    input's row order."""
    n = q.shape[0]
    sm = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    out = np.zeros((n, heads, head_dim))
    qv, kvv, vv = q.reshape(n, heads, head_dim), k.reshape(n, kv_heads, head_dim), v.reshape(n, kv_heads, head_dim)
    for s in np.unique(seqs):
        idx = np.flatnonzero(seqs == s)
        idx = idx[np.argsort(positions[idx], kind="stable")]
        p = positions[idx]
        mask = p[None, :] <= p[:, None]
        kh, vh = kvv[idx][:, list(kv_of)], vv[idx][:, list(kv_of)]   # [t, heads, head_dim]
        sc = np.einsum("ihd,jhd->hij", qv[idx], kh) * sm
        sc = np.where(mask[None], sc, -np.inf)
        sc -= sc.max(axis=2, keepdims=True)
        w = np.exp(sc)
        w /= w.sum(axis=2, keepdims=True)
        out[idx] = np.einsum("hij,jhd->ihd", w, vh)
    return out.reshape(n, -1)


def _gqa_maps(heads: int, kv_heads: int) -> dict[str, list[int]]:
    rep = heads // kv_heads
    return {"h // rep": [h // rep for h in range(heads)], "h % kv_heads": [h % kv_heads for h in range(heads)]}


# ----------------------------------------------------------------------------------------------
# The classifier
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TapRows:
    """One tap of the layer on the compared tokens: A's and B's values [n, width] (float64)."""

    tap: str
    a: F64
    b: F64


def classify(layer: int, first: str, taps: Mapping[str, TapRows], positions: NDArray[np.int64],
             seqs: NDArray[np.int64], info: LayerInfo, norm_ms: F64 | None = None, *,
             boundary: TapRows | None = None, next_step: str | None = None) -> Signature:
    """The signature of ``first`` (a tap name, e.g. ``mlp_up``) of decoder ``layer``: ``taps`` all
    the layer's taps both sides recorded on the same tokens (rows in the same order), ``positions``
    and ``seqs`` of those tokens, ``norm_ms``: the mean square of ``first``'s input per token when
    ``first`` is a norm (None: unknown), ``boundary``: the layer's input (boundary ``layer<b>``) on
    both sides when recorded with full values (the residual add's fit needs it), ``next_step``: the
    command to run when no kind fits (default: a generic weights comparison).

    Where no kind fits, the ``op`` signature lists each kind that was tried and how far its best
    fit missed (``params["tried"]``: kind -> residual)."""
    op = f"layer{layer}.{first}"
    x = taps[first]
    up = [t for t in TAPS[: TAPS.index(first)] if t in taps]
    noise = max([float(np.quantile(_rel_rows(taps[t].a, taps[t].b), 0.99)) for t in up] + [NOISE_FLOOR])
    tol = FIT_FACTOR * noise
    err = _rel(x.a, x.b)
    ups = f"{', '.join(up)} agree" if up else "its input agrees"
    tried: dict[str, float] = {}   # each kind tried: the relative error its best fit left

    # swapped with another op of the layer
    others = {t: _rel(o.a, x.b) for t, o in taps.items() if t != first and o.a.shape == x.b.shape}
    for t, other in taps.items():
        if t in others and others[t] <= min(tol, err / 4):
            back = f"; B's {t} holds A's {first}" if _rel(x.a, other.b) <= tol else ""
            return Signature(op, "swap", f"B's {first} holds A's {t}",
                             f"rel err {_g(others[t])} against A's {t}{back}; {ups}",
                             f"{first} and {t} swapped (the weights' names or the fused layout's order)",
                             {"holds": t})
    if others:
        tried["swap"] = min(others.values())

    sig: Signature | None = None
    if first in ("q_rope", "k_rope"):
        sig = _rotary(op, first, x, taps, positions, info, tol, ups, tried) or \
            _rotary_offset(op, first, x, taps, positions, info, tol, ups, tried)
    if sig is None and first in ("q", "k", "v", "q_rope", "k_rope") and info.head_dim:
        sig = _heads(op, x, info.head_dim, tol, ups, tried)
    if sig is None and first == "attn_out" and all(t in taps for t in ("q_rope", "k_rope", "v")) and info.heads \
            and info.kv_heads and info.head_dim:
        if info.heads != info.kv_heads:
            sig = _gqa(op, taps, positions, seqs, info, tol, tried)
        if sig is None:
            sig = _attn_scale(op, taps, positions, seqs, info, tol, tried)
    if sig is None and first in ("attn_norm", "mlp_norm") and norm_ms is not None and info.eps is not None:
        sig = _eps(op, x, norm_ms, info, tol, ups, tried)
    if sig is None and first == "mlp_norm" and boundary is not None and "attn_out" in taps:
        sig = _residual(op, layer, x, taps, boundary, info, tol, tried)
    if sig is None and first == "mlp_act" and "mlp_gate" in taps and "mlp_up" in taps:
        sig = _activation(op, x, taps, tol, ups, tried)
    if sig is None:
        sig = _ratio(op, x, tol, ups, tried)
    if sig is not None:
        return sig
    missed = ", ".join(f"{k} {_g(v)}" for k, v in tried.items())
    return Signature(op, "op", "its output differs while everything upstream agrees and no kind of difference fits",
                     f"rel err {_g(err)}; {ups} (noise {_g(noise)}); no kind reproduces B within {_g(tol)}, "
                     f"each kind's best fit left rel err: {missed}",
                     f"that op's weights or kernel ({next_step or 'compare the two models: tensordiff weights DIR_A DIR_B'})",
                     {"tried": dict(tried), "tolerance": tol})


def _rotary(op: str, first: str, x: TapRows, taps: Mapping[str, TapRows], positions: NDArray[np.int64],
            info: LayerInfo, tol: float, ups: str, tried: dict[str, float]) -> Signature | None:
    e = _rel_rows(x.a, x.b)
    pos = positions.astype(np.float64)
    at0 = e[positions == 0]
    # every rotary is the identity at position 0: a q_rope that differs from its agreeing q
    # everywhere but there is a rotary difference, whether it grows with position (theta,
    # scaling) or is large from position 1 on (another layout)
    if not len(at0) or float(at0.max()) > tol or float(np.median(e[positions > 0])) <= tol:
        if len(at0):
            tried["rotary"] = float(at0.max())   # what a rotary leaves at position 0: nothing
        return None
    hi = int(positions.max())
    ev = (f"rel err {_g(float(at0.max()))} at position 0, {_g(float(np.median(e[positions == 1])))} at position 1, "
          f"{_g(float(np.median(e[positions == hi])))} at position {hi}")
    rho = _spearman(pos, e)
    ev += f" (rank correlation with position {rho:.2f}); {ups}"
    params: dict[str, Any] = {}
    pre = taps.get(first[0])   # q or k, before the rotary
    cause = "rope theta, scaling or layout (interleaved vs rotate-half)"
    what = ("a rotary difference: none at position 0, growing with position" if rho >= 0.5 else
            "a rotary difference: none at position 0, large from position 1 on")
    if pre is not None and info.head_dim and _rel(pre.a, pre.b) <= tol:
        fa = fit_rope(pre.a, x.a, pos, info.head_dim, info.rope_theta)
        fb = fit_rope(pre.b, x.b, pos, info.head_dim, fa.theta)
        if fa.residual <= tol and fb.residual <= tol:
            params = {"a": _rope_words(fa), "b": _rope_words(fb), "theta_a": fa.theta, "theta_b": fb.theta,
                      "layout_a": fa.layout, "layout_b": fb.layout, "scale_b": fb.scale}
            if fa.layout != fb.layout:
                cause = f"the rotary layout: A {_rope_words(fa)}, B {_rope_words(fb)}"
            elif fa.scale != fb.scale:
                cause = f"rope scaling: A {_rope_words(fa)}, B {_rope_words(fb)}"
            else:
                cause = f"rope theta: A {_g(fa.theta)}, B {_g(fb.theta)}"
            cause += f" (each reproduces its side to rel err {_g(max(fa.residual, fb.residual))})"
        else:
            tried["rotary"] = max(fa.residual, fb.residual)
            cause += f" (no standard rotary reproduces {'A' if fa.residual > tol else 'B'} from its {first[0]})"
    return Signature(op, "rotary", what, ev, cause, params)


def _heads(op: str, x: TapRows, hd: int, tol: float, ups: str, tried: dict[str, float]) -> Signature | None:
    n, w = x.a.shape
    if w % hd or w // hd < 2:
        return None
    nh = w // hd
    av, bv = x.a.reshape(n, nh, hd), x.b.reshape(n, nh, hd)
    perm = []
    for j in range(nh):   # B's head j: the closest head of A
        errs = [_rel(av[:, i], bv[:, j]) for i in range(nh)]
        perm.append(int(np.argmin(errs)))
    if sorted(perm) != list(range(nh)) or perm == list(range(nh)):
        return None
    if _rel(av[:, perm].reshape(n, -1), x.b) > tol:
        tried["heads"] = _rel(av[:, perm].reshape(n, -1), x.b)
        return None
    return Signature(op, "heads", f"its heads match only after a permutation: B's head j is A's head {perm}[j]",
                     f"rel err {_g(_rel(x.a, x.b))}, {_g(_rel(av[:, perm].reshape(n, -1), x.b))} after the permutation; {ups}",
                     "the head order of the projection's weights (a fused or converted checkpoint's layout)",
                     {"permutation": perm})


def _gqa(op: str, taps: Mapping[str, TapRows], positions: NDArray[np.int64], seqs: NDArray[np.int64],
         info: LayerInfo, tol: float, tried: dict[str, float]) -> Signature | None:
    assert info.heads and info.kv_heads and info.head_dim
    q, k, v, out = taps["q_rope"], taps["k_rope"], taps["v"], taps["attn_out"]
    if any(_rel(t.a, t.b) > tol for t in (q, k, v)):
        return None
    width = info.heads * info.head_dim
    if out.a.shape[0] < 2 * width:   # too few tokens to fit o_proj from the recorded output
        return None
    maps = _gqa_maps(info.heads, info.kv_heads)
    ctx = {m: attention(q.a, k.a, v.a, seqs, positions, info.heads, info.kv_heads, info.head_dim, kv)
           for m, kv in maps.items()}
    fits = {}
    for m, c in ctx.items():   # o_proj fitted on A: which repeat order makes A's attention linear in it
        w, *_ = np.linalg.lstsq(c, out.a, rcond=None)
        fits[m] = (w, _rel(out.a, c @ w))
    ma = min(fits, key=lambda m: fits[m][1])
    w, res_a = fits[ma]
    if res_a > max(FIT_A, tol):
        tried["gqa"] = res_a
        return None
    tried["gqa"] = min(_rel(out.b, c @ w) for mb, c in ctx.items() if mb != ma)
    for mb, c in ctx.items():
        if mb == ma:
            continue
        res_b = _rel(out.b, c @ w)
        if res_b <= max(tol, 2 * res_a):
            return Signature(op, "gqa", "the key/value heads each query head reads differ (the GQA repeat order)",
                             f"q, k and v agree; A's attention output is reproduced with query head h reading "
                             f"kv head {ma} (rel err {_g(res_a)}), B's with kv head {mb} (rel err {_g(res_b)}), "
                             f"{info.heads} query heads over {info.kv_heads} kv heads",
                             f"the repeat of the key/value heads: A {ma} = {maps[ma]}, B {mb} = {maps[mb]}",
                             {"a": maps[ma], "b": maps[mb]})
    return None


def _eps(op: str, x: TapRows, ms: F64, info: LayerInfo, tol: float, ups: str,
         tried: dict[str, float]) -> Signature | None:
    assert info.eps is not None
    ra, rb = np.linalg.norm(x.a, axis=1), np.linalg.norm(x.b, axis=1)
    ok = (ra > 0) & (rb > 0) & (ms > 0)
    if ok.sum() < 3:
        return None
    r = rb[ok] / ra[ok]
    m = ms[ok]
    cos = (x.a[ok] * x.b[ok]).sum(1) / (ra[ok] * rb[ok])
    if float(1 - cos.min()) > tol:   # a norm's eps changes the length, never the direction
        tried["norm_eps"] = float(1 - cos.min())
        return None
    eps_b = float(np.median((m + info.eps) / r ** 2 - m))
    if not eps_b > -info.eps:   # not a physical eps
        return None
    pred = np.sqrt((m + info.eps) / (m + eps_b))
    res = float(np.quantile(np.abs(pred / r - 1), 0.99))
    spread = float(np.log(r).std())
    tried["norm_eps"] = res
    if res > tol or spread <= tol or abs(_spearman(m, np.abs(np.log(r)))) < 0.5:
        return None
    said = f" (B's recorded eps: {_g(info.eps_b)})" if info.eps_b is not None else ""
    return Signature(op, "norm_eps", "a norm eps difference: the ratio to A depends on the token's RMS",
                     f"RMS ratio {_g(float(r.min()))}-{_g(float(r.max()))}, largest at the smallest inputs "
                     f"(input RMS {_g(math.sqrt(float(m.min())))}-{_g(math.sqrt(float(m.max())))}), direction "
                     f"agrees; {ups}",
                     f"the norm's eps: B's output is explained by eps {_g(eps_b)} (A {_g(info.eps)}) to "
                     f"{_g(res)} per token{said}", {"eps_a": info.eps, "eps_b": eps_b})


def _golden(f: Any, lo: float, hi: float, steps: int = 40) -> float:
    """The x in [lo, hi] that minimises ``f`` (unimodal there), by golden section (one new
    evaluation per step)."""
    r = (math.sqrt(5) - 1) / 2
    m1, m2 = hi - r * (hi - lo), lo + r * (hi - lo)
    f1, f2 = f(m1), f(m2)
    for _ in range(steps):
        if f1 < f2:
            hi, m2, f2 = m2, m1, f1
            m1 = hi - r * (hi - lo)
            f1 = f(m1)
        else:
            lo, m1, f1 = m1, m2, f2
            m2 = lo + r * (hi - lo)
            f2 = f(m2)
    return (lo + hi) / 2


#: the position offsets the rotary fit tries (a port that counts positions from 1, or adds one twice)
ROPE_OFFSETS = tuple(range(-4, 5))


def _rotary_offset(op: str, first: str, x: TapRows, taps: Mapping[str, TapRows], positions: NDArray[np.int64],
                   info: LayerInfo, tol: float, ups: str, tried: dict[str, float]) -> Signature | None:
    """A rotary given other positions on one side: each side's values reproduced from its agreeing
    q/k by the same rotary (layout, theta) at ``position + offset``, the offsets differing. The
    plain rotary check does not see it: the error is not nothing at position 0."""
    pre = taps.get(first[0])
    if pre is None or not info.head_dim or _rel(pre.a, pre.b) > tol or info.head_dim % 2:
        return None
    hd = info.head_dim
    pos = positions.astype(np.float64)
    theta = info.rope_theta or 1e4

    def best(pre_v: F64, post: F64) -> tuple[float, str, int]:
        fits = [(_rel(post, rope(pre_v, pos + d, hd, theta, lay)), lay, d) for lay in ("half", "interleaved")
                for d in ROPE_OFFSETS]
        return min(fits)

    ra, lay_a, da = best(pre.a, x.a)
    rb, lay_b, db = best(pre.b, x.b)
    tried["rope_offset"] = max(ra, rb)
    if ra > tol or rb > tol or da == db or lay_a != lay_b:
        return None
    e = _rel_rows(x.a, x.b)
    at0 = e[positions == 0]
    words = "rotate-half" if lay_a == "half" else "interleaved"

    def at(d: int) -> str:
        return "position p" if d == 0 else f"position p{d:+d}"

    return Signature(op, "rope_offset", f"B's {first[0]} is rotated at {at(db)} where A's is at {at(da)}",
                     f"rel err {_g(float(at0.max())) if len(at0) else '?'} at position 0 (a rotary at the same "
                     f"positions leaves none there); the {words} rotary with theta {_g(theta)} at {at(da)} "
                     f"reproduces A to rel err {_g(ra)}, at {at(db)} B to {_g(rb)}; {ups}",
                     f"the positions given to the rotary of {first[0]}: B's are offset by {db - da:+d} from A's "
                     "(position ids counted from 1, or an offset added twice)",
                     {"offset_a": da, "offset_b": db, "layout": lay_a, "theta": theta})


def _attn_scale(op: str, taps: Mapping[str, TapRows], positions: NDArray[np.int64], seqs: NDArray[np.int64],
                info: LayerInfo, tol: float, tried: dict[str, float]) -> Signature | None:
    """The softmax scale of the attention scores: q, k and v agree; A's output is linear (its
    ``o_proj``, fitted) in the attention computed from the recorded q_rope, k_rope and v at a
    fitted scale, and B's output is reproduced by that ``o_proj`` only at another scale. A weight
    scaled after the attention changes the output's length at every token alike, which no softmax
    scale does: it is not mistaken for one."""
    assert info.heads and info.kv_heads and info.head_dim
    q, k, v, out = taps["q_rope"], taps["k_rope"], taps["v"], taps["attn_out"]
    if any(_rel(t.a, t.b) > tol for t in (q, k, v)):
        return None
    if out.a.shape[0] < 2 * info.heads * info.head_dim or info.heads % info.kv_heads:
        return None
    heads, kv_heads, hd = info.heads, info.kv_heads, info.head_dim
    kv = [h // (heads // kv_heads) for h in range(heads)]
    cache: dict[float, F64] = {}

    def ctx(log_s: float) -> F64:
        if log_s not in cache:
            cache[log_s] = attention(q.a, k.a, v.a, seqs, positions, heads, kv_heads, hd, kv,
                                     scale=math.exp(log_s))
        return cache[log_s]

    def proj(c: F64) -> F64:   # o_proj fitted on A: least squares by the normal equations (small, fast)
        try:
            return np.asarray(np.linalg.solve(c.T @ c, c.T @ out.a), dtype=np.float64)
        except np.linalg.LinAlgError:
            return np.asarray(np.linalg.lstsq(c, out.a, rcond=None)[0], dtype=np.float64)

    def fit_a(log_s: float) -> float:
        c = ctx(log_s)
        return _rel(out.a, c @ proj(c))

    named = {"1/sqrt(head_dim)": 1 / math.sqrt(hd), "1/head_dim": 1 / hd, "1": 1.0}
    grid = sorted({*np.linspace(math.log(0.25 / hd), math.log(4.0), 11).tolist(),
                   *(math.log(v) for v in named.values())})

    def search(f: Any) -> float:
        vals = [f(g) for g in grid]
        i = int(np.argmin(vals))
        lo, hi = grid[max(i - 1, 0)], grid[min(i + 1, len(grid) - 1)]
        r = _golden(f, lo, hi, 30)
        return r if f(r) < vals[i] else grid[i]

    la = search(fit_a)
    c = ctx(la)
    w = proj(c)
    res_a = _rel(out.a, c @ w)
    if res_a > max(FIT_A, tol):
        tried["attn_scale"] = res_a
        return None

    def fit_b(log_s: float) -> float:
        return _rel(out.b, ctx(log_s) @ w)

    lb = search(fit_b)
    res_b = fit_b(lb)
    tried["attn_scale"] = res_b
    if res_b > max(tol, 2 * res_a) or abs(lb - la) < 0.01 or fit_b(la) <= max(tol, 2 * res_a):
        return None

    def say(log_s: float) -> str:
        s = math.exp(log_s)
        for name, val in named.items():
            if abs(math.log(s / val)) < 0.01:
                return f"{name} = {s:.4g}"
        return f"{s:.4g}"

    sa, sb = say(la), say(lb)
    return Signature(op, "attn_scale", "the attention's softmax scale differs",
                     f"q, k and v agree; A's attention output is reproduced with scores scaled by {sa} (rel err "
                     f"{_g(res_a)}), B's by {sb} with the same o_proj (rel err {_g(res_b)}; {_g(fit_b(la))} at "
                     "A's scale)",
                     f"the attention's softmax scale: A {sa}, B {sb} (head_dim {hd})",
                     {"scale_a": math.exp(la), "scale_b": math.exp(lb)})


def _erf(x: F64) -> F64:
    return np.asarray(np.frompyfunc(math.erf, 1, 1)(x), dtype=np.float64)


#: the activations the MLP fit tries: name -> act(gate) (transformers' ``hidden_act`` names)
ACTIVATIONS: dict[str, Any] = {
    "silu": lambda g: g / (1 + np.exp(-g)),
    "gelu": lambda g: 0.5 * g * (1 + _erf(g / math.sqrt(2))),
    "gelu_pytorch_tanh": lambda g: 0.5 * g * (1 + np.tanh(math.sqrt(2 / math.pi) * (g + 0.044715 * g ** 3))),
    "quick_gelu": lambda g: g / (1 + np.exp(-1.702 * g)),
    "relu": lambda g: np.maximum(g, 0.0),
}


def _activation(op: str, x: TapRows, taps: Mapping[str, TapRows], tol: float, ups: str,
                tried: dict[str, float]) -> Signature | None:
    """``mlp_act`` = act(gate) * up: gate and up agree; each side is reproduced by one standard
    activation, and they differ."""
    g, u = taps["mlp_gate"], taps["mlp_up"]
    if g.a.shape != x.a.shape or u.a.shape != x.a.shape or _rel(g.a, g.b) > tol or _rel(u.a, u.b) > tol:
        return None
    with np.errstate(over="ignore"):
        fa = {n: _rel(x.a, f(g.a) * u.a) for n, f in ACTIVATIONS.items()}
        fb = {n: _rel(x.b, f(g.b) * u.b) for n, f in ACTIVATIONS.items()}
    na, nb = min(fa, key=lambda n: fa[n]), min(fb, key=lambda n: fb[n])
    tried["activation"] = max(fa[na], fb[nb])
    if fa[na] > tol or fb[nb] > tol or na == nb:
        return None
    return Signature(op, "activation", f"the MLP's activation differs: A {na}, B {nb}",
                     f"mlp_act = act(mlp_gate) * mlp_up reproduces A with {na} (rel err {_g(fa[na])}; {nb}: "
                     f"{_g(fa[nb])}) and B with {nb} (rel err {_g(fb[nb])}; {na}: {_g(fb[na])}); {ups}",
                     f"the activation: A {na}, B {nb} (the config's hidden_act, or the kernel the port calls)",
                     {"a": na, "b": nb})


def _residual(op: str, layer: int, x: TapRows, taps: Mapping[str, TapRows], boundary: TapRows, info: LayerInfo,
              tol: float, tried: dict[str, float]) -> Signature | None:
    """The residual add before ``mlp_norm``: its input is ``layer<b> + attn_out``. One side's output
    is that sum normalised (per-channel weight fitted on it); the other's is not, and is reproduced
    with that weight from another sum: ``layer<b> + c * attn_out`` (c fitted; 0: the attention
    output not added), ``attn_norm + attn_out`` (the residual taken after the norm) or ``attn_out``
    alone. A norm weight or eps that differs is reproduced by none of them: it is not mistaken for
    an add."""
    o = taps["attn_out"]
    if boundary.a.shape != o.a.shape or _rel(o.a, o.b) > tol or _rel(boundary.a, boundary.b) > tol:
        return None
    eps = info.eps if info.eps is not None else 1e-6
    inp = "embed" if layer == 0 else f"layer{layer}"
    normed = taps.get("attn_norm")

    def nrm(h: F64) -> F64:
        return np.asarray(h / np.sqrt((h * h).mean(1, keepdims=True) + eps), dtype=np.float64)

    def fit(ref: str) -> tuple[float, float, dict[str, float], float] | None:
        """(ref's residual, the other's with ref's sum, the other's candidates, c) or None."""
        other = "b" if ref == "a" else "a"
        xr, xo = getattr(x, ref), getattr(x, other)
        bo, oo = getattr(boundary, other), getattr(o, other)
        nr = nrm(getattr(boundary, ref) + getattr(o, ref))
        den = (nr * nr).sum(0)
        w = np.where(den > 0, (nr * xr).sum(0) / np.where(den > 0, den, 1.0), 0.0)
        res_ref = _rel(xr, nr * w)
        if res_ref > tol:
            tried["residual"] = min(tried.get("residual", math.inf), res_ref)
            return None

        def with_c(c: float) -> float:
            return _rel(xo, nrm(bo + c * oo) * w)

        grid = np.linspace(-3.0, 4.0, 29).tolist()
        vals = [with_c(c) for c in grid]
        i = int(np.argmin(vals))
        c = _golden(with_c, grid[max(i - 1, 0)], grid[min(i + 1, len(grid) - 1)], 40)
        c = round(c) if abs(c - round(c)) < 1e-3 else c
        cands = {(f"{inp} alone (attn_out not added)" if c == 0 else f"{inp} + {_g(c)} x attn_out"): with_c(c)}
        if normed is not None and normed.a.shape == o.a.shape:
            cands["attn_norm + attn_out (the residual taken after the norm)"] = _rel(
                xo, nrm(getattr(normed, other) + oo) * w)
        cands["attn_out alone (the residual not added)"] = _rel(xo, nrm(oo) * w)
        tried["residual"] = min(cands.values())
        return res_ref, with_c(1.0), cands, c

    for ref in ("a", "b"):
        got = fit(ref)
        if got is None:
            continue
        res_ref, res_o1, cands, c = got
        best = min(cands, key=lambda n: cands[n])
        if cands[best] > tol or res_o1 <= tol or abs(c - 1) < 1e-3 and best.startswith(inp):
            continue
        r, w_ = ref.upper(), "B" if ref == "a" else "A"
        return Signature(op, "residual", f"the residual add before mlp_norm differs: {w_} normalises {best}",
                         f"{inp} and attn_out agree; {r}'s mlp_norm is the norm of {inp} + attn_out (rel err "
                         f"{_g(res_ref)}), {w_}'s is not (rel err {_g(res_o1)}) and is the norm of {best} with {r}'s "
                         f"weight (rel err {_g(cands[best])})",
                         f"the residual add after the attention (the input of mlp_norm): {r} {inp} + attn_out, "
                         f"{w_} {best}",
                         {"a" if ref == "b" else "b": best, "c": c if best.startswith(inp) else None})
    return None


def _ratio(op: str, x: TapRows, tol: float, ups: str, tried: dict[str, float]) -> Signature | None:
    den = (x.a * x.a).sum(0)
    use = den > 0
    if not use.any():
        return None
    c = np.where(use, (x.a * x.b).sum(0) / np.where(use, den, 1.0), 1.0)
    c_all = float((x.a * x.b).sum() / (x.a * x.a).sum())
    err = _rel(x.a, x.b)
    tol = min(tol, err / 4)   # an explanation must remove most of the difference, not a sliver of it
    if abs(c_all - 1) > tol and _rel(x.a * c_all, x.b) <= tol:
        return Signature(op, "scale", f"it is scaled by {c_all:.4g} at every token and channel",
                         f"B / A = {c_all:.4g} (rel err {_g(_rel(x.a * c_all, x.b))} after it); {ups}",
                         "a scale in that op's weights or a constant factor after it", {"scale": c_all})
    if _rel(x.a * c, x.b) <= tol:
        cu = c[use]
        return Signature(op, "per_channel", f"it differs by a per-channel ratio ({_g(float(cu.min()))}-"
                         f"{_g(float(cu.max()))} over {int(use.sum())} channels)",
                         f"rel err {_g(_rel(x.a, x.b))}, {_g(_rel(x.a * c, x.b))} after the per-channel ratio; {ups}",
                         "that op's weight per channel (a norm weight, or a row scale of the projection)",
                         {"ratio_min": float(cu.min()), "ratio_max": float(cu.max())})
    tried["scale"] = _rel(x.a * c_all, x.b)
    tried["per_channel"] = _rel(x.a * c, x.b)
    return None


# ----------------------------------------------------------------------------------------------
# From a diff: the zoomed layer's taps read from the two traces
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class TapPair:
    """A compared tensor of the diff: its label, its name on each side, and the tensor rows of the
    compared tokens on each side (aligned order, ``token_index`` the aligned tokens). The rows are
    taken from each side's row map (tensor row per aligned token) when first asked for: a diff
    has one pair per compared tensor and the signatures read the zoomed layer's few, while every
    pair's rows at 1M tokens would be 16 MB each."""

    label: str
    name_a: str
    name_b: str
    row_map_a: NDArray[np.int64]
    row_map_b: NDArray[np.int64]
    token_index: NDArray[np.int64]

    @cached_property
    def rows_a(self) -> NDArray[np.int64]:
        rows: NDArray[np.int64] = self.row_map_a[self.token_index]
        return rows

    @cached_property
    def rows_b(self) -> NDArray[np.int64]:
        rows: NDArray[np.int64] = self.row_map_b[self.token_index]
        return rows


def _info(a: TraceSource, b: TraceSource, names_a: Sequence[str], names_b: Sequence[str]) -> LayerInfo:
    def attr(src: TraceSource, names: Sequence[str], key: str) -> Any:
        for n in names:
            v = src.tensors[n].attrs.get(key) if n in src.tensors else None
            if v is not None:
                return v
        return None

    def num(v: Any, kind: type) -> Any:
        try:
            return kind(v) if v is not None else None
        except (TypeError, ValueError):
            return None

    return LayerInfo(heads=num(attr(a, names_a, "heads"), int), kv_heads=num(attr(a, names_a, "kv_heads"), int),
                     head_dim=num(attr(a, names_a, "head_dim"), int), eps=num(attr(a, names_a, "eps"), float),
                     eps_b=num(attr(b, names_b, "eps"), float), rope_theta=num(attr(a, names_a, "rope_theta"), float))


def zoom_finding(a: TraceSource, b: TraceSource, code_a: NDArray[np.int64], pairs: Sequence[TapPair],
                 ordered: Sequence[Finding], max_rows: int = 4096) -> Finding | None:
    """The signature finding of a diff whose first divergence (``ordered``: its findings in order)
    is a tap of a zoomed layer, or None. ``pairs``: every compared tensor (with full values on both
    sides; the layer's taps among them), ``code_a``: the aligned tokens' codes on side A. A
    signature whose ``params["absorbed"]`` names a tap (a difference nothing after it shows) is a
    note, and so is every divergence of the diff: the caller makes them notes (:func:`absorbed`)."""
    first = next((f for f in ordered if f.severity == Severity.DIVERGENCE), None)
    if first is None or first.kind not in (Kind.NUMERIC, Kind.NONFINITE) or first.tensor is None:
        return None
    config = config_differences(a, b, first.tensor)
    st = maybe_state(first.tensor)
    if st is None or st.kind != "tap" or st.tap is None or st.layer is None:
        return config_finding(first, config, a.num_layers or b.num_layers)
    layer = st.layer
    mine = [p for p in pairs if (s := maybe_state(p.label)) is not None and s.kind == "tap" and s.layer == layer]
    if not any(p.label == first.tensor for p in mine):
        return config_finding(first, config, a.num_layers or b.num_layers)
    common = mine[0].token_index
    for p in mine[1:]:
        common = np.intersect1d(common, p.token_index)
    if len(common) > max_rows:
        common = common[np.linspace(0, len(common) - 1, max_rows).astype(np.int64)]
    taps: dict[str, TapRows] = {}
    try:
        for p in mine:
            s = maybe_state(p.label)
            assert s is not None and s.tap is not None
            at = np.searchsorted(p.token_index, common)
            va = _values(a, p.name_a, p.rows_a[at]).astype(np.float64)
            vb = _values(b, p.name_b, p.rows_b[at]).astype(np.float64)
            if np.isfinite(va).all() and np.isfinite(vb).all():
                taps[s.tap] = TapRows(s.tap, va, vb)
    except (KeyError, ValueError, OSError):
        # a tap without full values: no signature, the numeric finding stands
        return config_finding(first, config, a.num_layers or b.num_layers)
    if st.tap not in taps:
        return config_finding(first, config, a.num_layers or b.num_layers)
    codes = code_a[common]
    positions = (codes & POS_MASK).astype(np.int64)
    seqs = (codes >> SEQ_BITS).astype(np.int64)
    info = _info(a, b, [p.name_a for p in mine], [p.name_b for p in mine])
    ms = _norm_ms(a, pairs, layer, st.tap, common, taps)
    inp = _boundary_rows(a, b, pairs, layer, common) if st.tap == "mlp_norm" else None
    sig = classify(layer, st.tap, taps, positions, seqs, info, ms, boundary=inp, next_step=weights_command(a, b))
    params = {k: v for k, v in sig.params.items()}
    cause = sig.cause
    if config:   # the recorded configs name the cause; the fit is its evidence
        cause = f"the models' configs: {model_config.sentence(config)} ({sig.cause})"
        params["config"] = {k: [va, vb] for k, va, vb in config}
    consumer = absorbed_by(first, ordered, pairs, a.num_layers or b.num_layers)
    if consumer is not None:
        # nothing the op feeds differs: the difference cancels (q and k rotated at the same
        # offset, whose attention depends only on their distance), a note, not a divergence
        params["absorbed"] = consumer
        if sig.kind == "rope_offset" and st.tap == "q_rope" and "k_rope" in taps:
            ks = classify(layer, "k_rope", taps, positions, seqs, info)
            d = (sig.params["offset_b"] - sig.params["offset_a"], ks.params.get("offset_b", 0) - ks.params.get("offset_a", 0))
            if ks.kind == "rope_offset" and d[0] == d[1]:
                cause = (f"q and k both rotated at positions offset by {d[0]:+d} on B: attention depends only on "
                         f"the distance of their positions ({cause})")
    det = SignatureDetails(token_index=first.details.token_index, op=sig.op, signature=sig.kind, what=sig.what,
                           evidence=sig.evidence, cause=cause, layer=layer, params=params)
    return Finding(Kind.SIGNATURE, Severity.INFO if consumer is not None else Severity.DIVERGENCE, tensor=sig.op,
                   order=first.order, seq=first.seq, position=first.position, position_b=first.position_b,
                   token=first.token, regime=first.regime, regime_a=first.regime_a, details=det)


def absorbed(sig: Finding) -> bool:
    """Whether a signature says its difference has no effect downstream (every divergence a note)."""
    return isinstance(sig.details, SignatureDetails) and isinstance(sig.details.params.get("absorbed"), str)


def config_differences(a: TraceSource, b: TraceSource, state: str) -> list[tuple[str, Any, Any]]:
    """The differences of the two traces' recorded model configs (:mod:`tensordiff.model_config`,
    validated) that can cause a first divergence at ``state``."""
    diffs = model_config.differences(model_config.read(getattr(a, "model", None)),
                                     model_config.read(getattr(b, "model", None)))
    return [d for d in diffs if model_config.explains(d[0], state)]


def config_finding(first: Finding, config: Sequence[tuple[str, Any, Any]], num_layers: int | None) -> Finding | None:
    """The finding that leads a diff whose first divergence a recorded config difference explains
    (None without one): the difference, then where it shows."""
    if not config or first.tensor is None:
        return None
    st = maybe_state(first.tensor)
    where = ("every decoder layer runs with it (layer 0 shows it first)" if st is None or st.kind != "boundary"
             or st.layer != 0 else "the embedding is where it acts")
    det = SignatureDetails(token_index=first.details.token_index, op=first.tensor, signature="config",
                           what=f"the models' recorded configs differ, and {where}", evidence=first.message,
                           cause=model_config.sentence(list(config)), layer=None,
                           params={"config": {k: [va, vb] for k, va, vb in config}})
    # just before the divergence it explains: that one and every later one read as inherited from it
    return Finding(Kind.SIGNATURE, Severity.DIVERGENCE, tensor=first.tensor, order=first.order - 1e-9, seq=first.seq,
                   position=first.position, position_b=first.position_b, token=first.token, regime=first.regime,
                   regime_a=first.regime_a, details=det)


#: the tap of a layer that every earlier tap of its block feeds: a difference there or nowhere
_CONSUMER = {**{t: "attn_out" for t in ("attn_norm", "q", "k", "v", "q_rope", "k_rope")},
             **{t: "mlp_out" for t in ("mlp_norm", "router", "mlp_gate", "mlp_up", "mlp_act")}}


def absorbed_by(first: Finding, ordered: Sequence[Finding], pairs: Sequence[TapPair],
                num_layers: int | None) -> str | None:
    """The tap that absorbs the difference of ``first`` (a divergent tap of a zoomed layer), or
    None: every divergence of the diff is a tap of that layer's block before the block's output
    (``attn_out`` for the attention's taps, ``mlp_out`` for the MLP's), that output and the next
    boundary were compared and neither diverges, nor does anything after them. A difference no
    later state shows has no effect downstream."""
    st = maybe_state(first.tensor or "")
    if st is None or st.tap not in _CONSUMER or st.layer is None or first.kind != Kind.NUMERIC:
        return None
    out = f"layer{st.layer}.{_CONSUMER[st.tap]}"
    labels = {p.label for p in pairs}
    if out not in labels or f"layer{st.layer + 1}" not in labels:
        return None
    at = parse_state(out).order(num_layers)
    for f in ordered:
        if f.severity != Severity.DIVERGENCE:
            continue
        fs = maybe_state(f.tensor or "")
        if f.kind != Kind.NUMERIC or fs is None or fs.kind != "tap" or fs.layer != st.layer or fs.order(num_layers) >= at:
            return None
    return out


def _boundary_rows(a: TraceSource, b: TraceSource, pairs: Sequence[TapPair], layer: int,
                   common: NDArray[np.int64]) -> TapRows | None:
    """Boundary ``layer<b>`` (the layer's input) on both sides at the compared tokens, when both
    recorded its full values."""
    label = "embed" if layer == 0 else f"layer{layer}"
    p = next((p for p in pairs if p.label == label), None)
    if p is None or not np.isin(common, p.token_index).all():
        return None
    got = pair_rows(a, b, p, common)
    return None if got is None else TapRows(label, *got)


def pair_rows(a: TraceSource, b: TraceSource, p: TapPair,
              common: NDArray[np.int64]) -> tuple[NDArray[np.float64], NDArray[np.float64]] | None:
    """A tap pair's full values on both sides at the compared tokens (``common``, all in
    ``p.token_index``), as float64; None where a side cannot read them, their shapes differ, or a
    value is not finite."""
    at = np.searchsorted(p.token_index, common)
    try:
        va = _values(a, p.name_a, p.rows_a[at]).astype(np.float64)
        vb = _values(b, p.name_b, p.rows_b[at]).astype(np.float64)
    except (KeyError, ValueError, OSError):
        return None
    if va.shape != vb.shape or not (np.isfinite(va).all() and np.isfinite(vb).all()):
        return None
    return va, vb


#: the longest model directory a trace's ``model.path`` may give for a printed command
_MAX_PATH = 4096


def model_dir(src: TraceSource) -> str | None:
    """The model directory a trace recorded (``model.path``), or None: read as hostile input: a
    string of printable characters, not too long."""
    v = getattr(src, "model", {}).get("path") if isinstance(getattr(src, "model", None), dict) else None
    if not isinstance(v, str) or not v or len(v) > _MAX_PATH or not v.isprintable():
        return None
    return v


def weights_command(a: TraceSource, b: TraceSource) -> str:
    """The command that compares the two sides' weights, with the model directories the traces
    recorded (shell-quoted), or what is missing to make it."""
    import shlex

    da, db = model_dir(a), model_dir(b)
    if da is None or db is None:
        which = " and ".join(s for s, d in (("A", da), ("B", db)) if d is None)
        return (f"compare the two models' weights: tensordiff weights DIR_A DIR_B; {which} recorded no model "
                "directory")
    cmd = f"tensordiff weights {shlex.quote(da)} {shlex.quote(db)}"
    gone = [d for d in (da, db) if not os.path.exists(d)]
    if gone:
        return f"compare the weights: {cmd} (not on this machine: {', '.join(shlex.quote(d) for d in gone)})"
    if os.path.realpath(da) == os.path.realpath(db):
        return f"both traces recorded the model {shlex.quote(da)}: the weights are the same; the op's kernel or code"
    return f"compare the weights: {cmd}"


def _norm_ms(a: TraceSource, pairs: Sequence[TapPair], layer: int, tap: str, common: NDArray[np.int64],
             taps: Mapping[str, TapRows]) -> F64 | None:
    """The mean square of a norm's input per token (side A): boundary ``layer<b>``'s RMS for
    ``attn_norm``; boundary + ``attn_out`` for ``mlp_norm`` (needs the boundary's values)."""
    if tap not in ("attn_norm", "mlp_norm"):
        return None
    label = "embed" if layer == 0 else f"layer{layer}"
    p = next((p for p in pairs if p.label == label), None)
    if p is None or not np.isin(common, p.token_index).all():
        return None
    rows = p.rows_a[np.searchsorted(p.token_index, common)]
    try:
        if tap == "attn_norm":
            if a.has_part(p.name_a, "rms"):
                return np.asarray(a.part(p.name_a, "rms").take(rows), np.float64).reshape(len(rows), -1)[:, 0] ** 2
            v = _values(a, p.name_a, rows).astype(np.float64)
            return np.asarray((v * v).mean(1), dtype=np.float64)
        if "attn_out" not in taps or not a.has_part(p.name_a, "values"):
            return None
        h = _values(a, p.name_a, rows).astype(np.float64) + taps["attn_out"].a
        return np.asarray((h * h).mean(1), dtype=np.float64)
    except (KeyError, ValueError, OSError):
        return None


#: the taps whose output is added to the residual stream (the next boundary is input + their sum)
RESIDUAL_TAPS = ("attn_out", "mlp_out")


def residual_noise(a: TraceSource, b: TraceSource, pairs: Sequence[TapPair], f: Finding,
                   boundary_rel: Mapping[str, float]) -> str | None:
    """For a numeric finding of a tap that is added to the residual stream (``attn_out``,
    ``mlp_out``): the sentence saying that each token's error stays within the measured per-token
    noise of the boundary it is added into (``||B - A|| / ||layer<b+1>||`` against that boundary's
    ``max_rel``), else None (the finding stands). An op whose output nearly cancels (an attention
    output averaging values of both signs) shows a large relative error, or a spread of its RMS
    ratio, on a few tokens in honest rounding or another kernel's summation order, while what it
    adds to the residual is as small as the rest of the layer's. The caller keeps the finding
    when the boundary diverges and no other op of the layer explains it."""
    st = maybe_state(f.tensor or "")
    if st is None or st.kind != "tap" or st.tap not in RESIDUAL_TAPS or st.layer is None:
        return None
    d = f.details
    if not isinstance(d, NumericDetails):
        return None
    out_label = f"layer{st.layer + 1}"
    tap = next((p for p in pairs if p.label == f.tensor), None)
    res = next((p for p in pairs if p.label == out_label), None)
    limit = boundary_rel.get(out_label)
    if tap is None or res is None or limit is None:
        return None
    common = np.intersect1d(tap.token_index, res.token_index)
    if len(common) < len(tap.token_index):
        return None
    it, ir = np.searchsorted(tap.token_index, common), np.searchsorted(res.token_index, common)
    try:
        va = _values(a, tap.name_a, tap.rows_a[it]).astype(np.float64)
        vb = _values(b, tap.name_b, tap.rows_b[it]).astype(np.float64)
        if a.has_part(res.name_a, "rms"):
            rms = np.asarray(a.part(res.name_a, "rms").take(res.rows_a[ir]), np.float64).reshape(len(common), -1)[:, 0]
            norm = rms * math.sqrt(va.shape[1])
        else:
            norm = np.linalg.norm(_values(a, res.name_a, res.rows_a[ir]).astype(np.float64), axis=1)
    except (KeyError, ValueError, OSError):
        return None
    if not np.isfinite(va).all() or not np.isfinite(vb).all() or va.shape[1] != int(a.tensors[res.name_a].slot_width or 0):
        return None
    share = np.linalg.norm(vb - va, axis=1) / np.maximum(norm, 1e-30)
    worst = float(share.max())
    if worst > limit:
        return None
    what = {"scale": "a scale", "rescaled": "a per-token rescaling", "level": "a median error"}.get(
        d.part, f"{d.failing} of {len(common)} tokens")
    return (f"{f.tensor}: {what} past its own tolerance, but what it adds to the residual is within the "
            f"noise: ||B - A|| / ||{out_label}|| at most {_g(worst)} <= {_g(limit)} "
            f"allowed per token at {out_label} ({d.limit_source or 'its tolerance'})")


# ----------------------------------------------------------------------------------------------
# A grafted run (record train --graft OTHER.h5:STATE): does anything after the graft diverge?
# ----------------------------------------------------------------------------------------------


def graft_finding(a: TraceSource, b: TraceSource, ordered: Sequence[Finding]) -> Finding | None:
    """The note of a diff where one side was recorded with a state grafted from another trace:
    whether anything after that state still diverges, and what that says of the cause."""
    found = None
    for side, src, other in (("B", b, a), ("A", a, b)):
        meta = getattr(src, "user_meta", None)
        g = meta.get("graft") if isinstance(meta, dict) else None
        if isinstance(g, dict) and isinstance(g.get("state"), str):
            found = (side, other, g)
            break
    if found is None:
        return None
    side, other, g = found
    state = str(g["state"])
    st = maybe_state(state)
    if st is None:
        return None
    n = a.num_layers or b.num_layers
    at = st.order(n)
    origin = str(g.get("from", "?"))
    same = origin == getattr(other, "path", None) or _same_file(origin, str(getattr(other, "path", "")))
    whose = f"{other.side} ({origin})" if same else origin
    divs = [f for f in ordered if f.severity == Severity.DIVERGENCE]
    after = [f for f in divs if f.order > at and f.kind not in (Kind.ACCEPTANCE,)]
    before = [f for f in divs if f.order < at]
    if after:
        what = f"with {state} taken from {whose} in {side}, {len(after)} finding(s) after it still diverge"
        cause = (f"a cause after {state} as well (the first after it: {after[0].tensor}); the graft does not "
                 "remove it")
    else:
        what = f"with {state} taken from {whose} in {side}, nothing after it diverges"
        if before:
            cause = f"the cause is before {state}: the first divergence is {before[0].tensor}"
        elif st.kind == "boundary" and st.layer is not None and st.layer >= 1:
            prev = "embed" if st.layer == 1 else f"layer{st.layer - 1}"
            cause = (f"the cause is inside decoder layer {st.layer - 1} (between {prev}, which agrees, and {state})"
                     f"; zoom into it: --zoom layer{st.layer - 1}")
        else:
            cause = f"the cause is at or before {state}"
    ev = f"{len(divs)} divergence(s) in all; {len(before)} before {state}, {len(after)} after"
    det = SignatureDetails(op=state, signature="graft", what=what, evidence=ev, cause=cause, layer=st.layer,
                           params={"state": state, "from": origin, "side": side, "after": len(after),
                                   "before": len(before)})
    return Finding(Kind.SIGNATURE, Severity.INFO, tensor=state, order=at, details=det)


def _same_file(x: str, y: str) -> bool:
    try:
        return bool(x) and bool(y) and os.path.samefile(x, y)
    except OSError:
        return False
