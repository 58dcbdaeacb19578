"""Why is acceptance low: what the draft predicts against what the target predicts and accepts.

Reads the prediction tensors of :mod:`tensordiff.conventions` (``target_topk``, ``draft_topk``,
``spec_verify``; the numerics skip them, they are not states) and computes, pure numpy:

* per side, teacher-forced (draft row t, which consumed the target's states at t and token t+1,
  against the target's prediction at row t+1, both of token t+2), per regime of the draft row:
  top-1 agreement, top-k overlap and a lower bound of KL(target || draft) from the two top-k
  tables (:func:`kl_lower_bound`). This is draft position 0 of every verify step;
* per side with ``spec_verify`` (serve): per draft position j, the verify steps that reached it,
  the share accepted, the draft token's agreement with the target's top-1 and the target's mean
  log-probability of it; the mean acceptance length (1 + accepted drafts per step);
* across sides, on the aligned tokens: the target's and the draft's predictions of A against B.

and makes ONE finding (:class:`~tensordiff.details.AcceptanceDetails`): low acceptance tied to the
first divergence upstream of the draft's predictions (the diff's first divergence, or A's and B's
target or draft predictions disagreeing), or, when the draft input, the fc output and the
target's predictions were all compared and agree, that the draft itself disagrees with the
target (a training-quality problem, not wiring). When something upstream was not compared, it
says so and gives no wiring verdict.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray

from .align import RowMaps, TokenAlignment
from .conventions import (
    DRAFT_FC,
    DRAFT_TOPK,
    PREDICTION_ROLES,
    SPEC_CHAIN,
    SPEC_VERIFY,
    TARGET_TOPK,
    spec_verify_drafts,
    topk_k,
)
from .details import AcceptanceDetails
from .findings import MARGIN_NOISE_FACTOR, Finding, Kind, PairStats, Severity
from .findings import SIGN_Z as SIGN_Z_LIMIT
from .findings import UNEXPLAINED as UNEXPLAINED_LIMIT
from .tokens import token_code
from .trace import TensorInfo, TraceSource
from .vocab import REGIMES

__all__ = ["add_finding", "analyse", "is_prediction", "kl_lower_bound", "topk_compare"]

BLOCK = 65536
TOP1_AGREE = 0.99     # across sides, top-1 agreement at least this (ties flip under rounding) ...
KL_AGREE = 0.01       # ... and a mean KL lower bound at most this (nats): the predictions agree
TOP1_DIFFER = 0.95    # top-1 agreement below this, or ...
KL_DIFFER = 0.1       # ... a mean KL lower bound above this: they differ (between: close, no verdict)
LOW_AGREEMENT = 0.5   # a draft whose top-1 agrees with the target less often than this is "disagreeing"
UPSTREAM = ("draft_input", DRAFT_FC)  # what the draft's predictions depend on, besides the target's


def is_prediction(info: TensorInfo) -> bool:
    """A prediction tensor: compared here, not by the numerics."""
    return info.role in PREDICTION_ROLES or info.name in PREDICTION_ROLES


# ----------------------------------------------------------------------------------------------
# Top-k tables
# ----------------------------------------------------------------------------------------------


def _split(v: NDArray[np.float64]) -> tuple[NDArray[np.int64], NDArray[np.float64]]:
    k = topk_k(v.shape[1])
    return v[:, :k].astype(np.int64), v[:, k:2 * k].astype(np.float64)


def kl_lower_bound(p_ids: NDArray[np.int64], p_lp: NDArray[np.float64], q_ids: NDArray[np.int64],
                   q_lp: NDArray[np.float64], iterations: int = 60) -> NDArray[np.float64]:
    """A lower bound of KL(p || q) per row from each distribution's top-k ids and log-probs.

    Merging outcomes never increases a KL divergence (the log-sum inequality). Keep each token of
    p's top-k as its own outcome and merge every other token into one "rest". For the tokens also
    in q's top-k, q is known; for the others (U) q is unknown but at most q's k-th probability m
    (they are not in its list), and q's rest takes what is left. The bound is the minimum of the
    grouped KL over every q allowed by that: convex, reached at ``q_i = min(m, lambda p_i)``
    (i in U) and ``q_rest = lambda p_rest`` with lambda set by the total mass (found by
    bisection). It uses exact values only and is 0 when the two tables are equal."""
    match = p_ids[:, :, None] == q_ids[:, None, :]
    both = match.any(-1)
    q_at = np.where(match, q_lp[:, None, :], -np.inf).max(-1)
    pp = np.exp(p_lp)
    unknown = ~both
    known_term = np.where(both, pp * (p_lp - np.where(both, q_at, 0.0)), 0.0).sum(-1)
    c = np.clip(1.0 - np.where(both, np.exp(np.where(both, q_at, 0.0)), 0.0).sum(-1), 1e-300, 1.0)
    m = np.exp(q_lp.min(-1))
    p_rest = np.clip(1.0 - pp.sum(-1), 0.0, 1.0)
    pu = np.where(unknown, pp, 0.0)

    def mass(lam: NDArray[np.float64]) -> NDArray[np.float64]:
        total: NDArray[np.float64] = np.minimum(m[:, None], lam[:, None] * pu).sum(-1) + lam * p_rest
        return total

    all_at_m = (p_rest <= 0) & ((unknown * m[:, None]).sum(-1) <= c)
    hi = np.where(p_rest > 0, c / np.maximum(p_rest, 1e-300), m / np.maximum(np.where(unknown, pp, np.inf).min(-1), 1e-300))
    hi = np.where(np.isfinite(hi), hi, 1.0)
    lo = np.zeros_like(hi)
    for _ in range(iterations):
        mid = 0.5 * (lo + hi)
        under = mass(mid) < c
        lo, hi = np.where(under, mid, lo), np.where(under, hi, mid)
    lam = hi
    x = np.where(unknown, np.minimum(m[:, None], lam[:, None] * pu), 1.0)
    x = np.where(all_at_m[:, None] & unknown, m[:, None], x)
    with np.errstate(divide="ignore", invalid="ignore"):
        u_term = np.where(unknown & (pp > 0), pp * (p_lp - np.log(np.maximum(x, 1e-300))), 0.0).sum(-1)
        q_rest = np.maximum(c - np.where(unknown, x, 0.0).sum(-1), 1e-300)
        r_term = np.where(p_rest > 0, p_rest * (np.log(np.maximum(p_rest, 1e-300)) - np.log(q_rest)), 0.0)
    out: NDArray[np.float64] = np.maximum(known_term + u_term + r_term, 0.0)
    return out


def topk_compare(p: NDArray[np.float64], q: NDArray[np.float64]) -> dict[str, NDArray[Any]]:
    """Row-wise comparison of two top-k tables (p the reference): top-1 equal, overlap of the
    top-k id sets (share of the shorter list), KL(p || q) lower bound."""
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):   # NaN/Inf rows give NaN, counted apart
        pi, pl = _split(p)
        qi, ql = _split(q)
        overlap = (pi[:, :, None] == qi[:, None, :]).any(-1).sum(-1) / min(pi.shape[1], qi.shape[1])
        return {"top1": pi[:, 0] == qi[:, 0], "overlap": overlap, "kl": kl_lower_bound(pi, pl, qi, ql)}


class _Agg:
    def __init__(self) -> None:
        self.n = 0
        self.top1 = 0
        self.overlap = 0.0
        self.kl = 0.0

    def add(self, m: dict[str, NDArray[Any]], sel: NDArray[np.bool_] | None = None) -> None:
        if sel is None:
            sel = np.ones(len(m["top1"]), dtype=bool)
        self.n += int(sel.sum())
        self.top1 += int(m["top1"][sel].sum())
        self.overlap += float(m["overlap"][sel].sum())
        self.kl += float(m["kl"][sel].sum())

    def as_dict(self) -> dict[str, Any]:
        n = max(self.n, 1)
        return {"rows": self.n, "top1": self.top1 / n if self.n else None,
                "overlap": self.overlap / n if self.n else None, "kl_lb": self.kl / n if self.n else None}


# ----------------------------------------------------------------------------------------------
# One side: teacher-forced draft vs target, verify steps
# ----------------------------------------------------------------------------------------------


def _codes(r: TraceSource, name: str) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
    """(token code, token row) of each row of tensor ``name``."""
    trow = r.token_rows(name)
    t = r.tokens
    return token_code(t["seq"][trow], t["position"][trow]), trow


def teacher_forced(r: TraceSource) -> dict[str, dict[str, Any]] | None:
    """Draft row t against the target's row t+1 of the same sequence, per regime of the draft row
    (and ``all``). None when the side lacks either table."""
    if DRAFT_TOPK not in r.tensors or TARGET_TOPK not in r.tensors:
        return None
    dcode, dtrow = _codes(r, DRAFT_TOPK)
    tcode, _ = _codes(r, TARGET_TOPK)
    order = np.argsort(tcode, kind="stable")
    tsorted = tcode[order]
    want = dcode + 1  # the target row of the next position predicts the same token
    pos = np.searchsorted(tsorted, want)
    posc = np.minimum(pos, max(len(tsorted) - 1, 0))
    hit = (len(tsorted) > 0) & (tsorted[posc] == want) if len(tsorted) else np.zeros(len(want), bool)
    trows = np.where(hit, order[posc], -1)
    regimes = r.tokens["regime"][dtrow]
    aggs: dict[str, _Agg] = {"all": _Agg()}
    drows = np.flatnonzero(trows >= 0)
    for s in range(0, len(drows), BLOCK):
        blk = drows[s:s + BLOCK]
        m = topk_compare(r.part(TARGET_TOPK, "values").take(trows[blk]).astype(np.float64),
                         r.part(DRAFT_TOPK, "values").take(blk).astype(np.float64))
        aggs["all"].add(m)
        reg = regimes[blk]
        for code in np.unique(reg):
            aggs.setdefault(REGIMES[int(code)], _Agg()).add(m, reg == code)
    out = {k: a.as_dict() for k, a in aggs.items()}
    out["all"]["draft_rows"] = len(dcode)
    return out


def verify_steps(r: TraceSource) -> dict[str, Any] | None:
    """Per draft position j: steps that reached j (every earlier draft accepted), accepted, the
    draft token equal to the target's top-1, the target's mean log-prob of it."""
    info = r.tensors.get(SPEC_VERIFY)
    if info is None or info.rows == 0:
        return None
    K = spec_verify_drafts(info.width)
    reached = np.zeros(K, np.int64)
    accepted = np.zeros(K, np.int64)
    agree = np.zeros(K, np.int64)
    known = np.zeros(K, np.int64)
    lp_sum = np.zeros(K)
    lp_n = np.zeros(K, np.int64)
    steps = 0
    acc_sum = 0.0
    for s in range(0, info.rows, BLOCK):
        v = r.part(SPEC_VERIFY, "values").rows(s, s + BLOCK).astype(np.float64)
        a = v[:, 0]
        steps += len(v)
        acc_sum += float(a.sum())
        for j in range(K):
            at = a >= j
            reached[j] += int(at.sum())
            accepted[j] += int((a > j).sum())
            d, t, lp = v[:, 3 + j], v[:, 3 + K + j], v[:, 3 + 2 * K + j]
            ok = at & ~np.isnan(t)
            known[j] += int(ok.sum())
            agree[j] += int((d[ok] == t[ok]).sum())
            okl = at & np.isfinite(lp)
            lp_n[j] += int(okl.sum())
            lp_sum[j] += float(lp[okl].sum())
    per = [{"position": j, "reached": int(reached[j]), "accepted": int(accepted[j]),
            "rate": accepted[j] / reached[j] if reached[j] else None,
            "top1": agree[j] / known[j] if known[j] else None,
            "target_logprob": lp_sum[j] / lp_n[j] if lp_n[j] else None} for j in range(K)]
    _chain_stats(r, per)
    return {"steps": steps, "accept_length": 1.0 + acc_sum / max(steps, 1), "per_position": per}


def _chain_stats(r: TraceSource, per: list[dict[str, Any]]) -> None:
    """Top-k overlap and KL(target || draft) lower bound per draft position, over the steps that
    reached it, from ``spec_chain`` (the draft's and the target's top-k at each draft position)."""
    info = r.tensors.get(SPEC_CHAIN)
    if info is None or info.rows == 0:
        return
    K, dw, tw = (int(info.attrs.get(x) or 0) for x in ("K", "draft_width", "target_width"))
    if K != len(per) or K * (dw + tw) != info.width:
        return
    acc_of = dict(zip(r.token_rows(SPEC_VERIFY).tolist(),
                      r.part(SPEC_VERIFY, "values").rows()[:, 0].astype(np.int64).tolist()))
    crow = r.token_rows(SPEC_CHAIN)
    aggs = [_Agg() for _ in range(K)]
    for s in range(0, info.rows, BLOCK):
        v = r.part(SPEC_CHAIN, "values").rows(s, s + BLOCK).astype(np.float64)
        a = np.array([acc_of.get(int(t), -1) for t in crow[s:s + len(v)]])
        for j in range(K):
            draft = v[:, j * dw:(j + 1) * dw]
            target = v[:, K * dw + j * tw:K * dw + (j + 1) * tw]
            aggs[j].add(topk_compare(target, draft), a >= j)
    for j, agg in enumerate(aggs):
        d = agg.as_dict()
        per[j]["overlap"], per[j]["kl_lb"] = d["overlap"], d["kl_lb"]


# ----------------------------------------------------------------------------------------------
# Across sides
# ----------------------------------------------------------------------------------------------


def across(ra: TraceSource, rb: TraceSource, al: TokenAlignment, maps: RowMaps, name: str,
           state_error: tuple[str, float] | None = None) -> dict[str, Any] | None:
    """A's predictions (the reference) against B's on the aligned tokens both recorded, judged
    against the logit noise of the two sides (:func:`judge_predictions`); ``state_error``: the
    state the predictions are computed from and the 99th percentile of its relative error across
    the sides (the noise model's measurement), which bounds the logit noise honest numerics give."""
    ia, ib = ra.tensors.get(name), rb.tensors.get(name)
    if ia is None or ib is None or ia.token_offset != ib.token_offset:
        return None
    everything = np.arange(len(al))
    (ma,), (mb,) = maps.rows_at("a", name, [everything]), maps.rows_at("b", name, [everything])
    both = np.flatnonzero((ma >= 0) & (mb >= 0))
    agg = _Agg()
    parts: dict[str, list[NDArray[Any]]] = {}
    for s in range(0, len(both), BLOCK):
        blk = both[s:s + BLOCK]
        p = ra.part(name, "values").take(ma[blk]).astype(np.float64)
        q = rb.part(name, "values").take(mb[blk]).astype(np.float64)
        m = topk_compare(p, q)
        bad: NDArray[np.bool_] = np.asarray(~(np.isfinite(p).all(1) & np.isfinite(q).all(1)))
        m["kl"] = np.where(bad, np.nan, m["kl"])
        agg.add({k: np.where(bad, 0, v) if k != "top1" else v & ~bad for k, v in m.items()})
        per: dict[str, NDArray[Any]] = {**_margins(p, q), "top1": m["top1"], "kl": m["kl"], "nonfinite": bad}
        for k, v in per.items():
            parts.setdefault(k, []).append(v)
    d = agg.as_dict()
    d["tokens"] = d.pop("rows")
    if not d["tokens"]:
        d.update(agree=False, state="none")
        return d
    judge_predictions(d, {k: np.concatenate(v) for k, v in parts.items()}, state_error)
    return d


#: a top-1 flip, or a log-prob difference, counts only past this many times the logit noise (the
#: 99th percentile of how much the two sides move the reference's top-1/top-2 margin on the
#: tokens whose top-1 agrees): both sides' numerics can move a margin by that much
MARGIN_NOISE = MARGIN_NOISE_FACTOR
#: the mean KL an honest pair may show: a logit noise of ``x`` (margin noise, 99th percentile) moves
#: a two-outcome distribution by at most x^2 / 8 nats; the limit allows (MARGIN_NOISE x)^2 / 8
#: (several times what Gaussian noise of that 99th percentile gives on average)
#: past KL_JUMP x that limit the predictions differ (between: close, no verdict)
KL_JUMP = 10.0
#: a systematic change of the margins (a temperature, a logit scale or soft-capping on one side):
#: honest noise moves a margin up as often as down; a sign test past SIGN_Z standard errors, with
#: a median relative change past the noise, is a finding even while every top-1 agrees
SIGN_Z = SIGN_Z_LIMIT
#: ... and a median relative margin change past this: bf16's honest chosen-token log-prob error is
#: about 1% RMS (published), so a systematic logit scale under 1% is not told apart from it
MARGIN_SCALE_MIN = 0.01
#: the margin noise may be at most this many times what the final state's error propagates to
UNEXPLAINED = UNEXPLAINED_LIMIT
BF16_UNIT = 2.0 ** -9
#: the KL limit never under this (nats): the bound's own resolution on float32 log-probs (the rest
#: mass of a top-k table is 1 minus a sum of rounded probabilities): 6e-6 measured on a vLLM fp32
#: pair whose margins move by 9e-5 nats; 100x tighter than the fixed KL_AGREE
KL_FLOOR = 1e-4
#: the noise never under this (nats): the rounding of float32 log-probs of a few units
NOISE_FLOOR = 1e-5


def _lp_of(ids: NDArray[np.int64], lps: NDArray[np.float64], want: NDArray[np.int64]) -> NDArray[np.float64]:
    """Per row: the log-prob of token ``want`` in a top-k table (nan where absent)."""
    hit = ids == want[:, None]
    return np.where(hit.any(1), np.where(hit, lps, -np.inf).max(1), np.nan)


def _margins(p: NDArray[np.float64], q: NDArray[np.float64]) -> dict[str, NDArray[np.float64]]:
    """Per row: the reference's top-1/top-2 margin on A and on B (nan where B lacks one of the
    two), the margin change at a flip (A's top-1 against B's top-1: how far A prefers its own,
    plus how far B prefers its own; a token not in a table's top-k is taken at that table's k-th
    log-prob, which makes the change a lower bound), and the log-prob difference of A's top-1."""
    pi, pl = _split(p)
    qi, ql = _split(q)
    two = pl.shape[1] > 1
    margin_a = pl[:, 0] - pl[:, 1] if two else np.full(len(pl), np.inf)
    b1 = _lp_of(qi, ql, pi[:, 0])
    b2 = _lp_of(qi, ql, pi[:, 1]) if two else np.full(len(pl), np.nan)
    margin_b = b1 - b2
    a_of_b = _lp_of(pi, pl, qi[:, 0])
    a_of_b = np.where(np.isnan(a_of_b), pl[:, -1], a_of_b)
    b_of_a = np.where(np.isnan(b1), ql[:, -1], b1)
    change = (pl[:, 0] - a_of_b) + (ql[:, 0] - b_of_a)
    lse = p[:, -1]   # a top-k row ends with the logsumexp: logit = log-prob + logsumexp
    zsum = np.abs(pl[:, 0] + lse) + (np.abs(pl[:, 1] + lse) if two else 0.0)
    return {"margin_a": margin_a, "margin_b": margin_b, "flip_change": change, "lp_diff": b1 - pl[:, 0],
            "spread_a": pl[:, 0] - pl[:, -1], "logit_sum": zsum}


def judge_predictions(d: dict[str, Any], t: dict[str, NDArray[Any]],
                      state_error: tuple[str, float] | None = None) -> None:
    """The cross-side state of a prediction table (``agree``, ``close``, ``differ``) from its
    per-token arrays ``t``, every part judged against the same logit noise; adds the counts and
    the limits to ``d``. The noise is the 99th percentile of |margin change| on the tokens whose
    top-1 agrees; with fewer than 8 of them the fixed limits TOP1_AGREE / KL_AGREE / KL_DIFFER
    stand in (and ``noise_source`` says so)."""
    top1, ok_rows = t["top1"], ~t["nonfinite"]
    n = int(len(top1))
    d["nonfinite"] = int(t["nonfinite"].sum())
    dm = t["margin_b"] - t["margin_a"]
    agree_rows = top1 & ok_rows & np.isfinite(dm)
    flips = ~top1 & ok_rows
    kl = t["kl"][ok_rows]
    d["kl_lb"] = float(np.mean(kl)) if len(kl) else None
    d["flips"] = int(flips.sum())
    if int(agree_rows.sum()) < 8:
        d.update(flips_beyond_noise=d["flips"], logprob_noise=None, kl_limit=KL_AGREE, noise_source="fixed limits")
        noise = None
    else:
        noise = max(float(np.quantile(np.abs(dm[agree_rows]), 0.99)), NOISE_FLOOR)
        d.update(logprob_noise=noise, kl_limit=max((MARGIN_NOISE * noise) ** 2 / 8.0, KL_FLOOR),
                 noise_source="measured: margins of the tokens whose top-1 agrees")
        d["flips_beyond_noise"] = int((flips & (t["flip_change"] > MARGIN_NOISE * noise)).sum())
        lp = np.abs(t["lp_diff"])
        d["logprob_beyond_noise"] = int((ok_rows & np.isfinite(lp) & (lp > MARGIN_NOISE * noise)).sum())
        d["logprob_rms"] = float(np.sqrt(np.nanmean(t["lp_diff"][ok_rows] ** 2))) if ok_rows.any() else None
        # honest noise moves a margin up as often as down; a temperature or a logit scale moves
        # every margin the same way, in proportion to it
        rel = dm[agree_rows] / np.maximum(np.abs(t["margin_a"][agree_rows]), NOISE_FLOOR)
        big = np.abs(t["margin_a"][agree_rows]) > MARGIN_NOISE * noise   # margins the noise cannot flip
        up, m = int((rel[big] > 0).sum()), int(big.sum())
        z = (up - m / 2) / (np.sqrt(m) / 2) if m else 0.0
        med = float(np.median(rel[big])) if m else 0.0
        d["margin_scale"] = 1.0 + med
        d["margin_scale_z"] = float(z)
        d["margin_scaled"] = bool(m >= 8 and abs(z) > SIGN_Z and abs(med) > MARGIN_SCALE_MIN)
        # the logit noise is measured on the predictions themselves; what the states allow bounds
        # it: a margin m = (w1 - w2).h moves by about rel(h) x the logit scale (measured: the
        # margin noise is 0.9-1.1x the final state's 99th percentile relative error times the
        # median top-1/top-k log-prob spread, on the trained model and random-weight engine pairs,
        # bf16 vs fp32). Logits rounded to bf16 (an lm_head in bf16 on fp32 states) move a margin by
        # up to u = 2^-9 of the two logits' magnitudes (the row's logsumexp gives them). Past
        # UNEXPLAINED x that, the predictions move more than their inputs' noise can explain (a
        # logit scale, another lm_head, noise added after the final state)
        if state_error is not None:
            scale = float(np.median(t["spread_a"][ok_rows])) if ok_rows.any() else 0.0
            z = t["logit_sum"][ok_rows & np.isfinite(t["logit_sum"])]
            rounding = BF16_UNIT * float(np.quantile(z, 0.99)) if len(z) else 0.0
            bound = state_error[1] * scale + rounding
            d.update(final_state=state_error[0], state_rel99=state_error[1], logit_scale=scale,
                     propagated_noise=bound, unexplained=bool(noise > UNEXPLAINED * bound))
    beyond = d["flips_beyond_noise"] + d["nonfinite"]
    eff = 1.0 - beyond / max(1, n)
    kl_lim = float(d["kl_limit"])
    kl_mean = d["kl_lb"] if d["kl_lb"] is not None else 0.0
    lp_share = d.get("logprob_beyond_noise", 0) / max(1, n)
    d["agree"] = (eff >= TOP1_AGREE and kl_mean <= kl_lim and lp_share <= 1 - TOP1_AGREE
                  and not d.get("margin_scaled") and not d.get("unexplained") and not d["nonfinite"])
    differ_kl = KL_DIFFER if noise is None else KL_JUMP * kl_lim
    d["state"] = ("agree" if d["agree"] else
                  "differ" if (eff < TOP1_DIFFER or kl_mean > differ_kl or lp_share > 1 - TOP1_DIFFER
                               or d.get("margin_scaled") or d.get("unexplained") or d["nonfinite"]) else "close")


# ----------------------------------------------------------------------------------------------
# The finding
# ----------------------------------------------------------------------------------------------


def _diverges(f: Finding) -> bool:
    """A divergence, or one that ``--allow-failed`` turned into a warning (it still diverges)."""
    return f.severity == Severity.DIVERGENCE or f.allowed_by is not None


def _first_diverging(findings: Sequence[Finding]) -> Finding | None:
    """The first finding in forward order that diverges (or would, but for --allow-failed)."""
    return min((f for f in findings if _diverges(f)), key=lambda f: f.sort_key(), default=None)


def add_finding(ra: TraceSource, rb: TraceSource, al: TokenAlignment, maps: RowMaps, findings: Sequence[Finding],
                stats: Sequence[PairStats], state_error: tuple[str, float] | None = None) -> list[Finding]:
    """``findings`` with the acceptance finding added (a new list; none of them changed). Its
    ``upstream_index`` is the upstream finding's place in that list, which the diff's ordering
    (:func:`tensordiff.diff.order.order`) turns into its place in the order."""
    f = analyse(ra, rb, al, maps, findings, stats, state_error)
    return list(findings) + ([f] if f is not None else [])


def analyse(ra: TraceSource, rb: TraceSource, al: TokenAlignment, maps: RowMaps, findings: Sequence[Finding],
            stats: Sequence[PairStats], state_error: tuple[str, float] | None = None) -> Finding | None:
    """The acceptance finding of a diff (None when neither side recorded draft predictions or
    verify steps). ``findings`` the diff's findings in any order (an upstream one is named by its
    place in them); ``stats`` the compared tensor pairs."""
    teach = {"a": teacher_forced(ra), "b": teacher_forced(rb)}
    steps = {"a": verify_steps(ra), "b": verify_steps(rb)}
    if not any(teach.values()) and not any(steps.values()):
        return None
    # the side whose acceptance is measured: the one with verify steps (serve), in either argument
    # order; else the one with draft predictions, B first
    if steps["b"] or steps["a"]:
        side = "b" if steps["b"] else "a"
    else:
        side = "b" if teach["b"] else "a"
    reader = rb if side == "b" else ra
    cross = {n: c for n in (TARGET_TOPK, DRAFT_TOPK)
             if (c := across(ra, rb, al, maps, n, state_error if n == TARGET_TOPK else None)) is not None}
    compared = {p.name_a for p in stats if p.tokens} | {p.name_b for p in stats if p.tokens}
    not_compared = [n for n in UPSTREAM if n not in compared]
    if TARGET_TOPK not in cross or not cross[TARGET_TOPK]["tokens"]:
        not_compared.append(TARGET_TOPK)
    upstream = _first_diverging(findings)
    order = float((ra.num_layers or 0) + 0.99)
    t = teach[side] or {}
    d = AcceptanceDetails(side=reader.side, side_a=ra.side, side_b=rb.side, teacher=t, teacher_other=teach[
        "a" if side == "b" else "b"] or {}, cross=cross, not_compared=not_compared)
    vs = steps[side]
    if vs is not None:
        d.steps = vs["steps"]
        d.accept_length = vs["accept_length"]
        d.per_position = vs["per_position"]
    # the draft's own agreement with the target (teacher-forced): this side's, or where it recorded
    # no draft predictions (a serve engine that could not) the other side's, on the same inputs
    tt = t.get("all") or (teach["a" if side == "b" else "b"] or {}).get("all") or {}
    d.draft_top1 = tt.get("top1")
    d.draft_kl = tt.get("kl_lb")
    d.draft_disagrees = d.draft_top1 is not None and d.draft_top1 < LOW_AGREEMENT
    sev = Severity.WARNING
    if upstream is not None:
        place = next(i for i, g in enumerate(findings) if g is upstream)
        d.verdict, d.upstream, d.upstream_index = "upstream", upstream.message, place
        sev = Severity.INFO  # the divergence itself is the upstream finding
        input_ok = "draft_input" in compared and not any(_diverges(f) and f.tensor == "draft_input" for f in findings)
        if upstream.tensor == DRAFT_FC and input_ok:
            cos = getattr(upstream.details, "cos", None)
            d.upstream_note = ("draft_input agrees, so the draft transforms its input differently before or in fc"
                               + (" (the same direction, another per-token scale: a normalisation before fc, "
                                  "e.g. norm_before_fc or fc_norm on one side only)"
                                  if cos is not None and cos >= 0.9999 else " (fc weights, or a norm before fc)"))
    elif cross.get(TARGET_TOPK, {}).get("state") == "differ":
        d.verdict, d.upstream = "target", TARGET_TOPK
        sev = Severity.DIVERGENCE
    elif cross.get(DRAFT_TOPK, {}).get("state") == "differ" and DRAFT_FC in compared:
        d.verdict, d.upstream = "draft_after_fc", DRAFT_TOPK
        sev = Severity.DIVERGENCE
    elif any(c.get("state") == "close" for c in cross.values()):
        d.verdict = "close"
        d.upstream = next(n for n, c in cross.items() if c.get("state") == "close")
    elif not_compared:
        d.verdict = "incomplete"
    else:
        d.verdict = "agree"
        if not d.draft_disagrees:
            sev = Severity.INFO
    return Finding(Kind.ACCEPTANCE, sev, tensor=DRAFT_TOPK if DRAFT_TOPK in reader.tensors else SPEC_VERIFY,
                   order=order, details=d)
