"""The sampled tokens' log-probs of two traces compared: the number every RL framework logs, per
token, with the frameworks' own metric names, and what shape the difference has.

Both sides record ``sampled_logprob`` (:data:`tensordiff.conventions.SAMPLED_LOGPROB`; row t:
``[token t+1, its log-prob]``): the engine the log-prob it returned, the trainer its own
(``log_softmax(logits / T)``). On the aligned tokens both recorded (A the trainer, B the rollout;
the diff's alignment and row maps), this module computes, pure numpy:

* the per-token difference ``d = logp_B - logp_A`` and the metrics the frameworks log under their
  own names (:func:`metrics`): mean / max |logprob diff| (slime/miles
  ``train_rollout_logprob_abs_diff``, SkyRL ``rollout_train_logprobs_abs_diff``, TRL
  ``sampling_logp_difference``), verl ``rollout_probs_diff`` (|p_train - p_rollout|, mean / max /
  std), NeMo-RL ``token_mult_prob_error`` (mean of ``exp(|logp_train - logp_rollout|)``: 1.0 is a
  perfect match; NeMo-RL investigates above 1.05), and the k3 estimate of KL(rollout || train)
  (``mean(r - 1 - log r)``, ``r = p_train / p_rollout``);
* whether it is within the noise: ``noise`` is the median |d| expected of an honest pair (the
  caller predicts it from the states' noise, :func:`expected_noise`);
* a **systematic offset** (nearly every token moved the same way: a temperature applied on one
  side only, raw against processed log-probs), and, where a side recorded its raw top-k
  (``target_topk``, log-softmax of the logits, no temperature), whether one side's log-probs are
  the other's raw ones (:attr:`LogprobComparison.raw_match`);
* per regime of B's rows (prefill, decode) and per sequence (outlier sequences, the signature of
  a decode path that disagrees on some requests).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import NDArray

from ..align import RowMaps, TokenAlignment
from ..conventions import SAMPLED_LOGPROB, TARGET_TOPK
from ..noise import physical_default
from ..tokens import SEQ_BITS
from ..trace import TraceSource
from ..vocab import REGIMES

__all__ = ["LEVEL", "LP_PER_REL", "LogprobComparison", "compare", "expected_noise", "metrics"]

#: a median |logprob diff| past LEVEL x the expected one is out of the noise (the states' rule)
LEVEL = 3.0
#: median |logprob diff| of the sampled token per unit median relative error of final_norm:
#: 0.69 measured on the trained test model (a bf16 HF rollout, prefill + decode, against the fp32
#: trainer; 180 sampled tokens; docs/rl.md), rounded up
LP_PER_REL = 1.0
#: a systematic offset: at least this share of the tokens out of the noise moved the same way
SAME_WAY = 0.9
#: an outlier sequence: its mean |diff| over OUTLIER x the median sequence's, and out of the noise
OUTLIER = 10.0
BLOCK = 1 << 16


def expected_noise(final_norm_q50: float | None, dtype_a: str, dtype_b: str) -> float:
    """The median |logprob diff| an honest pair shows, from the median relative error of the
    last state before the head (``final_norm``, as the noise model measures or expects it);
    never under what one rounding of the coarser dtype does to a logit."""
    floor = physical_default(dtype_a, dtype_b, 0.0).q50
    return LP_PER_REL * max(float(final_norm_q50 or 0.0), floor)


def metrics(lp_train: NDArray[np.float64], lp_rollout: NDArray[np.float64]) -> dict[str, float | None]:
    """The frameworks' mismatch metrics of the sampled tokens, under their own names."""
    if not len(lp_train):
        return {k: None for k in ("mean_abs_logprob_diff", "max_abs_logprob_diff", "rollout_probs_diff_mean",
                                  "rollout_probs_diff_max", "rollout_probs_diff_std", "token_mult_prob_error",
                                  "kl_k3", "mean_logprob_diff")}
    d = lp_train - lp_rollout
    a = np.abs(d)
    dp = np.abs(np.exp(lp_train) - np.exp(lp_rollout))
    r = np.exp(np.clip(d, -50.0, 50.0))
    return {"mean_abs_logprob_diff": float(a.mean()), "max_abs_logprob_diff": float(a.max()),
            "rollout_probs_diff_mean": float(dp.mean()), "rollout_probs_diff_max": float(dp.max()),
            "rollout_probs_diff_std": float(dp.std()),
            "token_mult_prob_error": float(np.exp(np.minimum(a, 50.0)).mean()),
            "kl_k3": float((r - 1.0 - np.clip(d, -50.0, 50.0)).mean()),
            "mean_logprob_diff": float(d.mean())}


#: where each metric is logged, for the report's lines
FRAMEWORK_NAMES = {
    "mean_abs_logprob_diff": "slime/miles train_rollout_logprob_abs_diff, SkyRL rollout_train_logprobs_abs_diff_mean, "
                             "TRL sampling_logp_difference mean",
    "max_abs_logprob_diff": "SkyRL rollout_train_logprobs_abs_diff_max, TRL sampling_logp_difference max",
    "rollout_probs_diff_mean": "verl rollout_probs_diff_mean",
    "rollout_probs_diff_max": "verl rollout_probs_diff_max",
    "rollout_probs_diff_std": "verl rollout_probs_diff_std",
    "token_mult_prob_error": "NeMo-RL token_mult_prob_error",
    "kl_k3": "k3 KL(rollout || train) (slime/miles train_rollout_kl)",
}


@dataclass
class LogprobComparison:
    """The sampled tokens' log-probs of A (the trainer) against B (the rollout)."""

    tokens: int
    index: NDArray[np.int64]            # aligned token index of each compared token
    lp_a: NDArray[np.float64]
    lp_b: NDArray[np.float64]
    regime_b: NDArray[np.uint8]
    noise: float                        # expected median |d| of an honest pair
    id_mismatch: int = 0                # rows whose recorded sampled token differs between the sides
    metrics: dict[str, float | None] = field(default_factory=dict)
    by_regime: dict[str, dict[str, float | None]] = field(default_factory=dict)
    offset: float = 0.0                 # median d
    same_way: float = 0.0               # share of the out-of-noise tokens on the median's side
    raw_match: str | None = None        # "b_raw" (B's log-probs are raw, A's are not) or "a_raw"
    raw_match_q50: float | None = None  # median |d| against the other side's raw log-probs
    outliers: list[dict[str, Any]] = field(default_factory=list)   # outlier sequences
    sequences: int = 0
    raw_from_topk: tuple[bool, bool] = (False, False)   # A's, B's log-probs taken raw from their target_topk

    @property
    def diff(self) -> NDArray[np.float64]:
        return self.lp_b - self.lp_a

    @property
    def q50(self) -> float:
        return float(np.median(np.abs(self.diff))) if self.tokens else 0.0

    @property
    def agree(self) -> bool:
        """Within the noise: the median |d| under LEVEL x the noise, and no outlier sequence."""
        return self.tokens > 0 and self.q50 <= LEVEL * self.noise and not self.outliers

    @property
    def systematic(self) -> bool:
        """Out of the noise with nearly every token moved the same way."""
        return self.tokens > 0 and abs(self.offset) > LEVEL * self.noise and self.same_way >= SAME_WAY

    def to_dict(self) -> dict[str, Any]:
        return {"tokens": self.tokens, "noise": self.noise, "median_abs_diff": self.q50, "agree": self.agree,
                "systematic": self.systematic, "offset": self.offset, "same_way": self.same_way,
                "raw_match": self.raw_match, "raw_match_median_abs_diff": self.raw_match_q50,
                "id_mismatch": self.id_mismatch, "metrics": self.metrics, "by_regime": self.by_regime,
                "outlier_sequences": self.outliers, "sequences": self.sequences,
                "raw_from_topk": list(self.raw_from_topk)}


def _rows(ra: TraceSource, rb: TraceSource, al: TokenAlignment, maps: RowMaps,
          name: str) -> tuple[NDArray[np.int64], NDArray[np.int64], NDArray[np.int64]]:
    everything = np.arange(len(al))
    (ma,), (mb,) = maps.rows_at("a", name, [everything]), maps.rows_at("b", name, [everything])
    both = np.flatnonzero((ma >= 0) & (mb >= 0)).astype(np.int64)
    return both, ma[both], mb[both]


def _read(r: TraceSource, name: str, rows: NDArray[np.int64]) -> NDArray[np.float64]:
    out = [np.asarray(r.part(name, "values").take(rows[s:s + BLOCK]), dtype=np.float64)
           for s in range(0, len(rows), BLOCK)]
    return np.concatenate(out) if out else np.zeros((0, 2))


def _raw_logprob(r: TraceSource, rows: NDArray[np.int64], ids: NDArray[np.int64]) -> NDArray[np.float64] | None:
    """The raw log-prob (log-softmax of the logits, no temperature) of ``ids`` at ``rows`` of
    ``sampled_logprob`` from the side's ``target_topk`` (nan where the token is not in its top-k;
    None when the side has no top-k on those rows)."""
    if TARGET_TOPK not in r.tensors:
        return None
    codes = r.token_rows(SAMPLED_LOGPROB)[rows]
    inv = np.full(int(r.token_rows(TARGET_TOPK).max(initial=-1)) + 2, -1, dtype=np.int64)
    tr = r.token_rows(TARGET_TOPK)
    inv[tr] = np.arange(len(tr))
    have = codes < len(inv) - 1
    at = np.where(have, inv[np.minimum(codes, len(inv) - 1)], -1)
    ok = at >= 0
    if not ok.any():
        return None
    tab = _read(r, TARGET_TOPK, at[ok].astype(np.int64))
    k = (tab.shape[1] - 1) // 2
    hit = tab[:, :k] == ids[ok, None]
    got = np.where(hit.any(1), np.where(hit, tab[:, k:2 * k], -np.inf).max(1), np.nan)
    out = np.full(len(rows), np.nan)
    out[ok] = got
    return out


def compare(ra: TraceSource, rb: TraceSource, al: TokenAlignment, maps: RowMaps, noise: float,
            temperature_a: float | None = None, temperature_b: float | None = None,
            raw: tuple[bool, bool] = (False, False)) -> LogprobComparison | None:
    """A's ``sampled_logprob`` (the trainer) against B's (the rollout) on the aligned tokens both
    recorded; None when either side has none. ``noise``: the expected median |d|
    (:func:`expected_noise`). ``temperature_*``: what each side says it divided by (its
    ``sampling`` attribute), to test raw against processed. ``raw``: for A and B, whether to
    take that side's raw log-prob of the sampled token from its ``target_topk`` instead of the one
    it recorded (two sides whose recorded log-probs are of other temperatures compared as raw
    log-probs; tokens outside a side's top-k are left out)."""
    if SAMPLED_LOGPROB not in ra.tensors or SAMPLED_LOGPROB not in rb.tensors:
        return None
    idx, ma, mb = _rows(ra, rb, al, maps, SAMPLED_LOGPROB)
    va, vb = _read(ra, SAMPLED_LOGPROB, ma), _read(rb, SAMPLED_LOGPROB, mb)
    for flag, r, rows, v in ((raw[0], ra, ma, va), (raw[1], rb, mb, vb)):
        if flag and len(v):
            got = _raw_logprob(r, rows, np.asarray(v[:, 0], dtype=np.int64))
            v[:, 1] = got if got is not None else np.nan
    same = va[:, 0] == vb[:, 0] if len(va) else np.zeros(0, dtype=bool)
    ok = same & np.isfinite(va[:, 1]) & np.isfinite(vb[:, 1]) if len(va) else same
    c = LogprobComparison(tokens=int(ok.sum()), index=idx[ok], lp_a=va[ok, 1], lp_b=vb[ok, 1],
                          regime_b=al.regime_b[idx[ok]], noise=float(noise), id_mismatch=int((~same).sum()),
                          raw_from_topk=(bool(raw[0]), bool(raw[1])))
    c.metrics = metrics(c.lp_a, c.lp_b)
    if not c.tokens:
        return c
    for code in np.unique(c.regime_b):
        m = c.regime_b == code
        c.by_regime[REGIMES[int(code)]] = {"tokens": int(m.sum()), **metrics(c.lp_a[m], c.lp_b[m])}
    d = c.diff
    c.offset = float(np.median(d))
    out = np.abs(d) > LEVEL * noise
    if out.any() and c.offset != 0.0:
        c.same_way = float((np.sign(d[out]) == math.copysign(1.0, c.offset)).mean())
    if not any(raw):
        _raw(c, ra, rb, ma[ok], mb[ok], temperature_a, temperature_b)
    _outliers(c, ra, al)
    return c


def _raw(c: LogprobComparison, ra: TraceSource, rb: TraceSource, ma: NDArray[np.int64], mb: NDArray[np.int64],
         ta: float | None, tb: float | None) -> None:
    """Whether one side's log-probs are the other side's raw ones (no temperature): the sign of
    a temperature applied on one side only."""
    if c.agree:
        return
    ids = np.asarray(_read(ra, SAMPLED_LOGPROB, ma)[:, 0], dtype=np.int64)
    best: tuple[float, str] | None = None
    for which, other, rows, lp, t_other in (("b_raw", ra, ma, c.lp_b, ta), ("a_raw", rb, mb, c.lp_a, tb)):
        if t_other is not None and (t_other == 0 or math.isclose(t_other, 1.0)):
            continue   # the other side divides by no temperature: its raw log-probs are its own, no sign of one
        raw = _raw_logprob(other, rows, ids)
        if raw is None:
            continue
        m = np.isfinite(raw)
        if int(m.sum()) < max(8, c.tokens // 4):
            continue
        q = float(np.median(np.abs(lp[m] - raw[m])))
        if best is None or q < best[0]:
            best = (q, which)
    if best is not None and best[0] <= LEVEL * c.noise and best[0] * LEVEL < c.q50:
        c.raw_match_q50, c.raw_match = best


def _outliers(c: LogprobComparison, r: TraceSource, al: TokenAlignment) -> None:
    """Sequences whose mean |d| is OUTLIER x the median sequence's and out of the noise."""
    seq = (al.code_a[c.index] >> np.int64(SEQ_BITS)).astype(np.int64)
    keys = np.unique(seq)
    c.sequences = len(keys)
    if len(keys) < 3:
        return
    a = np.abs(c.diff)
    means = np.array([a[seq == s].mean() for s in keys])
    typical = float(np.median(means))
    limit = max(OUTLIER * typical, LEVEL * c.noise)
    for s, mval in zip(keys, means):
        if mval > limit:
            m = seq == s
            c.outliers.append({"seq": str(r.sequences[int(s)]), "tokens": int(m.sum()), "mean_abs_diff": float(mval),
                               "times_typical": float(mval / typical) if typical > 0 else None,
                               "token_mult_prob_error": float(np.exp(np.minimum(a[m], 50.0)).mean())})
