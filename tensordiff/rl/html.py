"""The RL triage as one self-contained HTML file (``tensordiff triage ... --html OUT``): the cause
in the first sentence and the lines after it, the per-state error against the noise trend, the
regime split of the first state out of the noise, the per-token log-prob difference over
positions, the three-way table. Inline SVG, no script, no external resource. Pure: no numpy.
"""

from __future__ import annotations

import html
import math
from typing import Any

from .drift import Drift
from .logprobs import LEVEL
from .triage import Triage

__all__ = ["render", "render_drift"]

W, H, PAD = 720, 260, 48
COLORS = {"prefill": "#1f77b4", "decode": "#d62728", "train": "#2ca02c"}


def _esc(x: Any) -> str:
    return html.escape(str(x))


def _num(x: Any) -> str:
    return f"{x:.4g}" if isinstance(x, (int, float)) and math.isfinite(x) else "n/a"


def _axis(x0: float, x1: float, y0: float, y1: float, xlabel: str, ylabel: str, log: bool,
          xticks: bool = True) -> str:
    out = [f'<line x1="{PAD}" y1="{H - PAD}" x2="{W - 10}" y2="{H - PAD}" stroke="#444"/>',
           f'<line x1="{PAD}" y1="10" x2="{PAD}" y2="{H - PAD}" stroke="#444"/>',
           f'<text x="{W // 2}" y="{H - 8}" text-anchor="middle" font-size="12">{_esc(xlabel)}</text>',
           f'<text x="12" y="{H // 2}" font-size="12" transform="rotate(-90 12 {H // 2})" '
           f'text-anchor="middle">{_esc(ylabel)}</text>']
    for v, y in ((y0, H - PAD), (y1, 10)):
        lab = f"1e{v:.0f}" if log else f"{v:.3g}"
        out.append(f'<text x="{PAD - 4}" y="{y + 4}" text-anchor="end" font-size="10">{lab}</text>')
    for v, x in ((x0, PAD), (x1, W - 10)) if xticks else ():
        out.append(f'<text x="{x}" y="{H - PAD + 14}" text-anchor="middle" font-size="10">{v:.3g}</text>')
    return "".join(out)


def _scale(v: float, lo: float, hi: float, a: float, b: float) -> float:
    return a if hi <= lo else a + (v - lo) * (b - a) / (hi - lo)


def _noise_svg(states: list[dict[str, Any]]) -> str:
    pts = [s for s in states if s["q50"] > 0 or s["predicted"] > 0]
    if not pts:
        return "<p>No state recorded on both sides.</p>"
    ys = [math.log10(max(v, 1e-12)) for s in pts for v in (s["q50"], s["predicted"])]
    y0, y1 = math.floor(min(ys)), math.ceil(max(ys))
    x0, x1 = 0.0, float(max(len(pts) - 1, 1))

    def xy(i: int, v: float) -> tuple[float, float]:
        return (_scale(i, x0, x1, PAD + 10, W - 20),
                _scale(math.log10(max(v, 1e-12)), y0, y1, H - PAD, 10))

    trend = " ".join(f"{x:.1f},{y:.1f}" for x, y in (xy(i, s["predicted"]) for i, s in enumerate(pts)))
    body = [f'<polyline points="{trend}" fill="none" stroke="#999" stroke-dasharray="4 3"/>']
    for i, s in enumerate(pts):
        x, y = xy(i, s["q50"])
        color = "#2ca02c" if s["clean"] else "#d62728"
        body.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="4" fill="{color}"><title>{_esc(s["label"])}: median rel '
                    f'err {s["q50"]:.3g}, trend {s["predicted"]:.3g}</title></circle>')
        body.append(f'<text x="{x:.1f}" y="{H - PAD + 26}" font-size="9" text-anchor="middle">{_esc(s["label"])}</text>')
    axis = _axis(x0, x1, y0, y1, "", "median relative error", True, xticks=False)
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H + 14}" role="img" '
            f'aria-label="per-state error against the noise trend">{axis}{"".join(body)}</svg>'
            '<p class="legend">points: each state\'s median relative error (green in the trend, red out of it); '
            'dashed: what the clean states before it predict</p>')


def _curve_svg(curve: dict[str, list[Any]], noise: float) -> str:
    pos, diff, reg = curve.get("position", []), curve.get("diff", []), curve.get("regime", [])
    if not pos:
        return "<p>No sampled-token log-probs on both sides.</p>"
    x0, x1 = float(min(pos)), float(max(pos))
    lim = max(max(abs(d) for d in diff), 3 * noise, 1e-12)
    body = []
    for p, d, r in zip(pos, diff, reg):
        x, y = _scale(p, x0, x1, PAD + 4, W - 14), _scale(d, -lim, lim, H - PAD, 10)
        body.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="2.5" fill="{COLORS.get(r, "#555")}" fill-opacity="0.7">'
                    f'<title>position {p} ({_esc(r)}): {d:+.3g}</title></circle>')
    for v in (3 * noise, -3 * noise):
        y = _scale(v, -lim, lim, H - PAD, 10)
        body.append(f'<line x1="{PAD}" x2="{W - 10}" y1="{y:.1f}" y2="{y:.1f}" stroke="#999" stroke-dasharray="4 3"/>')
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" role="img" '
            f'aria-label="per-token log-prob difference over positions">'
            f'{_axis(x0, x1, -lim, lim, "position", "logp rollout - logp trainer", False)}{"".join(body)}</svg>'
            '<p class="legend">blue: prefill rows (the first generated token), red: decode; dashed: the limit on the '
            'median |diff| (3 x what an honest pair shows)</p>')


STYLE = ("body{font-family:sans-serif;max-width:60em;margin:2em auto;color:#222}pre{background:#f6f6f6;"
         "padding:1em;white-space:pre-wrap}.headline{font-size:1.15em;font-weight:bold}.legend{font-size:.85em;"
         "color:#555}table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:.2em .5em;font-size:.9em}")


def _steps_svg(steps: list[int], series: list[tuple[str, list[float | None], str, str]], first: int | None,
               out: list[bool], ylabel: str, floor: float = 0.0) -> str:
    """Metrics per training step on a linear scale from ``floor`` (as the frameworks' dashboards
    plot them: a rise reads as a rise): each series ``(name, values, colour, dash)``, the first
    one's points green within the noise and red out of it, a band at ``first``, a tick per step."""
    def ok(v: float | None) -> bool:
        return isinstance(v, (int, float)) and math.isfinite(v)

    vals = [float(v) for _, ys, _, _ in series for v in ys if v is not None and ok(v)]
    if not vals or not steps:
        return "<p>No sampled-token log-probs on both sides.</p>"
    y0 = min(floor, min(vals))
    y1 = y0 + (max(vals) - y0) * 1.08 if max(vals) > y0 else y0 + 1.0
    x0, x1 = float(steps[0]), float(max(steps[-1], steps[0] + 1))

    def xy(k: int, v: float) -> tuple[float, float]:
        return _scale(k, x0, x1, PAD + 10, W - 20), _scale(v, y0, y1, H - PAD, 10)

    body = []
    every = max(1, math.ceil(len(steps) / 30))
    for k in steps[::every]:
        x, _ = xy(k, y0)
        body.append(f'<text x="{x:.1f}" y="{H - PAD + 14}" text-anchor="middle" font-size="10">{k}</text>')
    if first is not None:
        x, _ = xy(first, y0)
        body.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="10" y2="{H - PAD}" stroke="#d62728" stroke-opacity="0.3" '
                    f'stroke-width="6"><title>step {first}: the first step out of the noise</title></line>')
    for n, (name, ys, color, dash) in enumerate(series):
        pts = [(k, float(v), o) for k, v, o in zip(steps, ys, out) if v is not None and ok(v)]
        line = " ".join(f"{x:.1f},{y:.1f}" for x, y in (xy(k, v) for k, v, _ in pts))
        da = f' stroke-dasharray="{dash}"' if dash else ""
        body.append(f'<polyline points="{line}" fill="none" stroke="{color}" stroke-width="{2 if n == 0 else 1.2}"'
                    f'{da}><title>{_esc(name)}</title></polyline>')
        for k, v, o in pts if n == 0 else ():
            x, y = xy(k, v)
            body.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="4" fill="{"#d62728" if o else "#2ca02c"}">'
                        f'<title>step {k}: {_esc(name)} {v:.4g}{" (out of the noise)" if o else ""}</title></circle>')
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" role="img" '
            f'aria-label="{_esc(ylabel)} per training step">'
            f'{_axis(x0, x1, y0, y1, "training step", ylabel, False, xticks=False)}{"".join(body)}</svg>')


def render_drift(d: Drift) -> str:
    """The drift page: the headline, the metrics per step against the noise (plotted), the table,
    each step's own first sentence."""
    steps = [r.step for r in d.rows]
    out = [r.out for r in d.rows]
    limit = [LEVEL * r.noise if r.noise is not None else None for r in d.rows]
    lp = _steps_svg(steps, [("mean |logprob diff|", d.series("mean_abs_logprob_diff"), "#1f77b4", ""),
                            ("median |logprob diff|", d.series("median_abs_logprob_diff"), "#444", "2 2"),
                            ("noise limit on the median", limit, "#999", "4 3")], d.first, out,
                    "|logp train - logp rollout|")
    tme = _steps_svg(steps, [("token_mult_prob_error", d.series("token_mult_prob_error"), "#9467bd", "")], d.first,
                     out, "token_mult_prob_error", floor=1.0)
    rows = "".join(f"<tr><td>{r.step}</td><td>{r.tokens}</td><td>{_num(r.metrics.get('mean_abs_logprob_diff'))}</td>"
                   f"<td>{_num(r.metrics.get('median_abs_logprob_diff'))}</td><td>{_num(r.noise)}</td>"
                   f"<td>{_num(r.metrics.get('token_mult_prob_error'))}</td><td>{_num(r.metrics.get('kl_k3'))}</td>"
                   f"<td>{_num(r.metrics.get('rollout_probs_diff_mean'))}</td><td>{_esc(r.cause)}</td></tr>"
                   for r in d.rows)
    each = "".join(f"<li>step {r.step}: {_esc(r.headline)}</li>" for r in d.rows)
    lines = "\n".join(_esc(x) for x in d.lines[:next((i for i, x in enumerate(d.lines) if not x), len(d.lines))])
    parts = [f"<h1>tensordiff drift: {'steps ' + str(steps[0]) + '-' + str(steps[-1]) if steps else 'no steps'}</h1>",
             f"<p class=\"headline\">{_esc(d.headline)}</p>", f"<pre>{lines}</pre>",
             "<h2>Sampled tokens' |log-prob difference| per step</h2>", lp,
             '<p class="legend">blue: mean |logprob diff| (slime/miles train_rollout_logprob_abs_diff), its points '
             'green within the noise and red out of it (the step\'s triage); dark dotted: the median; grey dashed: the '
             f'noise limit on the median ({LEVEL:g} x what an honest pair shows); the red band: the first step out of '
             'the noise.</p>',
             "<h2>token_mult_prob_error per step</h2>", tme,
             '<p class="legend">NeMo-RL token_mult_prob_error (1 is a perfect match).</p>',
             "<h2>Steps</h2><table><tr><th>step</th><th>tokens</th><th>mean |d|</th><th>median |d|</th>"
             "<th>noise</th><th>token_mult_prob_error</th><th>kl_k3</th><th>rollout_probs_diff_mean</th><th>cause</th>"
             f"</tr>{rows}</table>", f"<h2>Each step's triage</h2><ul>{each}</ul>"]
    return ("<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>tensordiff drift</title>"
            f"<style>{STYLE}</style></head><body>{''.join(parts)}</body></html>\n")


def render(t: Triage) -> str:
    """The page."""
    lines = "\n".join(_esc(x) for x in t.lines)
    c = t.logprobs
    parts = [f"<h1>tensordiff triage: {_esc(t.cause)}</h1>",
             f"<p class=\"files\">trainer {_esc(t.train)}<br>rollout {_esc(t.rollout)}</p>",
             f"<p class=\"headline\">{_esc(t.headline)}</p>", f"<pre>{lines}</pre>",
             "<h2>Error per state against the noise trend</h2>", _noise_svg(t.noise_states)]
    if t.layer and t.layer.get("by_regime"):
        rows = "".join(f"<tr><td>{_esc(r)}</td><td>{v['tokens']}</td><td>{v['failing']}</td><td>{v['rel_max']:.3g}"
                       "</td></tr>" for r, v in t.layer["by_regime"].items())
        parts += [f"<h2>{_esc(t.layer['tensor'])} by regime</h2>",
                  f"<table><tr><th>regime</th><th>tokens</th><th>out of the noise</th><th>max rel err</th></tr>{rows}"
                  "</table>"]
    parts += ["<h2>Sampled tokens' log-prob difference over positions</h2>",
              _curve_svg(t.curve, c.noise if c is not None else 0.0)]
    if t.three_way:
        rows = "".join(f"<tr><td>{_esc(r['a'])} vs {_esc(r['b'])}</td><td>{_num(r['token_mult_prob_error'])}</td>"
                       f"<td>{_num(r['mean_abs_logprob_diff'])}</td><td>{'agree' if r['agree'] else 'differ'}</td>"
                       f"<td>{_esc(r['first_divergence'])}</td></tr>" for r in t.three_way)
        parts += ["<h2>Three-way: decode vs prefill vs trainer</h2>",
                  "<table><tr><th>pair</th><th>token_mult_prob_error</th><th>mean_abs_logprob_diff</th><th></th>"
                  f"<th>first divergence</th></tr>{rows}</table>"]
    style = STYLE
    return ("<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>tensordiff triage</title>"
            f"<style>{style}</style></head><body>{''.join(parts)}</body></html>\n")
