"""The triage screen's text: the per-state error against the noise trend as bars, the regime
split as rows, the per-token log-prob difference of one sequence as a sparkline. Plain strings
(no colour: a state out of the noise is marked with a word, so NO_COLOR loses nothing)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from .text import sparkline

BAR_W = 32
OUT_MARK = "OUT of noise"


@dataclass
class SeqCurve:
    """One sequence's sampled tokens: their positions, log-prob differences and regimes."""

    seq: int
    position: list[int]
    diff: list[float]
    regime: list[str]


def _num(x: float | None) -> str:
    return "n/a" if x is None or not math.isfinite(x) else f"{x:.3g}"


def _col(x: float, lo: float, hi: float, width: int) -> int:
    """Column of ``x`` on a log scale from ``lo`` to ``hi`` (errors span decades)."""
    if not (x > 0 and math.isfinite(x)) or hi <= lo:
        return 0
    f = (math.log10(x) - math.log10(lo)) / (math.log10(hi) - math.log10(lo))
    return max(0, min(width - 1, round(f * (width - 1))))


def state_rows(states: list[dict[str, Any]], width: int = BAR_W) -> list[str]:
    """One row per state: label, a bar to its measured median error, ``|`` where the noise trend
    predicts it, the two numbers, and the mark when it is out of the noise."""
    vals = [float(v) for s in states for v in (s.get("q50"), s.get("predicted"))
            if v is not None and math.isfinite(float(v)) and float(v) > 0]
    if not states:
        return ["no state recorded on both sides"]
    lo, hi = (min(vals) / 2, max(vals)) if vals else (1.0, 1.0)
    lab = max(len(str(s["label"])) for s in states)
    # the header as wide as the rows, so that 80 columns hold it on one line
    rows = [f"{'state':<{lab}}  {'█ measured, | predicted (log)'[:width]:<{width}}  {'q50':>9} {'predicted':>9}"]
    for s in states:
        q, p = float(s.get("q50") or 0.0), float(s.get("predicted") or 0.0)
        cells = [" "] * width
        for i in range(_col(q, lo, hi, width) + 1 if q > 0 else 0):
            cells[i] = "█"
        if p > 0:
            cells[_col(p, lo, hi, width)] = "|"
        mark = "" if s.get("clean", True) else f"  {OUT_MARK}"
        rows.append(f"{s['label']:<{lab}}  {''.join(cells)}  {_num(q):>9} {_num(p):>9}{mark}")
    return rows


def regime_rows(by_regime: dict[str, dict[str, float | None]],
                three_way: list[dict[str, Any]] | None = None,
                layer: dict[str, Any] | None = None) -> list[str]:
    """The first state out of the noise by regime (when a state is), the sampled tokens' log-prob
    metrics by regime (prefill vs decode), then the three-way table if any."""
    rows = []
    if layer and layer.get("by_regime"):
        rows.append(f"first state out of the noise: {layer.get('tensor')}")
        for reg in sorted(layer["by_regime"], key=lambda r: (r != "prefill", r)):
            v = layer["by_regime"][reg]
            rows.append(f"{reg:<8} {int(v.get('failing', 0))} of {int(v.get('tokens', 0))} tokens out of the noise, "
                        f"max rel err {_num(v.get('rel_max'))}")
        rows.append("")
    start = len(rows)
    rows.append(f"{'regime':<8} {'tokens':>6} {'token_mult_prob_error':>22} {'mean |logprob diff|':>20}")
    for reg in sorted(by_regime, key=lambda r: (r != "prefill", r)):
        m = by_regime[reg]
        tok = m.get("tokens")
        rows.append(f"{reg:<8} {int(tok or 0):>6} {_num(m.get('token_mult_prob_error')):>22} "
                    f"{_num(m.get('mean_abs_logprob_diff')):>20}")
    if len(rows) == start + 1:
        rows.append("no sampled-token log-probs on both sides")
    if three_way:
        rows.append("")
        rows.append(f"{'pair':<20} {'token_mult_prob_error':>22}  agree")
        for r in three_way:
            rows.append(f"{r['a'] + ' vs ' + r['b']:<20} {_num(r.get('token_mult_prob_error')):>22}  "
                        f"{'yes' if r.get('agree') else 'NO'}")
    return rows


def sequences(curve: dict[str, list[Any]]) -> list[SeqCurve]:
    """The curve's tokens grouped by sequence, each in position order."""
    seqs: dict[int, list[tuple[int, float, str]]] = {}
    for s, p, d, r in zip(curve.get("seq", []), curve.get("position", []), curve.get("diff", []),
                          curve.get("regime", []), strict=False):
        seqs.setdefault(int(s), []).append((int(p), float(d), str(r)))
    out = []
    for s in sorted(seqs):
        toks = sorted(seqs[s])
        out.append(SeqCurve(s, [t[0] for t in toks], [t[1] for t in toks], [t[2] for t in toks]))
    return out


def sequence_lines(seqs: list[SeqCurve], i: int, noise: float, width: int = 64) -> list[str]:
    """Sequence ``i`` of ``seqs``: a header, |log-prob diff| over its positions as a sparkline
    (scaled to the largest in all sequences, so the sequences compare by eye), the regime of each
    token (P prefill, D decode) and the worst token."""
    if not seqs:
        return ["no sampled tokens compared"]
    s = seqs[i]
    d = np.abs(np.asarray(s.diff, dtype=np.float64))
    top = max(float(np.max(np.abs(np.asarray(x.diff)))) for x in seqs if x.diff)
    w = min(width, len(d))
    worst = int(np.argmax(d)) if len(d) else 0
    reg = "".join((r[:1].upper() or "?") for r in s.regime)
    head = (f"sequence {s.seq} ({i + 1} of {len(seqs)}; j/k or n/p to walk): {len(d)} tokens, "
            f"positions {s.position[0]}..{s.position[-1]}, mean |d| {_num(float(np.mean(d)))}, "
            f"max |d| {_num(float(d[worst]))} at position {s.position[worst]}, noise {_num(noise)}")
    # a short sequence gets several columns per token, so its bars and regimes stay readable
    k = max(1, width // max(1, len(d)))
    return [head, f"|d| {''.join(c * k for c in sparkline(d, w, top))}", f"reg {''.join(c * k for c in reg[:w])}"]
