"""The zoomed layer as a small op graph: the taps of decoder layer b (``record ... --zoom layer<b>``)
between boundaries ``layer<b>`` and ``layer<b+1>``, laid out as the layer computes them, each op
coloured by its error against its tolerance (agrees, a note, diverges, the first op out of the
noise), for the HTML report (:func:`svg`) and the text front ends (:func:`line`).

Only what both traces compared is drawn; an op neither recorded is left out, one recorded on a
side only is drawn hollow."""

from __future__ import annotations

import html
from dataclasses import dataclass

from ..findings import DiffResult, Kind, Severity
from ..names import maybe_state

#: (tap, column, row) in the layer's forward order: the attention branch, then the MLP branch
LAYOUT: tuple[tuple[str, int, float], ...] = (
    ("in", 0, 1.0), ("attn_norm", 1, 1.0), ("q", 2, 0.0), ("k", 2, 1.0), ("v", 2, 2.0),
    ("q_rope", 3, 0.0), ("k_rope", 3, 1.0), ("attn_out", 4, 1.0), ("mlp_norm", 5, 1.0),
    ("router", 6, -0.2), ("mlp_gate", 6, 0.6), ("mlp_up", 6, 1.4), ("mlp_act", 7, 1.0), ("mlp_out", 8, 1.0),
    ("out", 9, 1.0),
)
EDGES: tuple[tuple[str, str], ...] = (
    ("in", "attn_norm"), ("attn_norm", "q"), ("attn_norm", "k"), ("attn_norm", "v"), ("q", "q_rope"),
    ("k", "k_rope"), ("q_rope", "attn_out"), ("k_rope", "attn_out"), ("v", "attn_out"), ("attn_out", "mlp_norm"),
    ("mlp_norm", "router"), ("mlp_norm", "mlp_gate"), ("mlp_norm", "mlp_up"), ("mlp_gate", "mlp_act"),
    ("mlp_up", "mlp_act"), ("mlp_act", "mlp_out"), ("mlp_out", "out"), ("in", "out"),
)
#: node fill per state
COLOURS = {"ok": "#2e7d32", "note": "#f9a825", "diverges": "#c62828", "first": "#7f0000", "missing": "#9e9e9e"}
GLYPH = {"ok": "✓", "note": "·", "diverges": "✗", "first": "✗!", "missing": "?"}


@dataclass(frozen=True)
class Op:
    """One drawn op: its canonical ``name``, the short ``label``, its place, ``state`` (ok, note,
    diverges, first, missing) and numbers (worst rel err against the tolerance's, failing tokens)."""

    name: str
    tap: str
    label: str
    col: int
    row: float
    state: str
    rel_max: float | None = None
    max_rel: float | None = None
    failing: int = 0
    tokens: int = 0


def zoomed_layers(res: DiffResult) -> list[int]:
    """The decoder layers with at least one compared tap, in order."""
    out = {st.layer for p in res.pairs if (st := maybe_state(p.label)) is not None and st.kind == "tap"
           and st.layer is not None}
    return sorted(x for x in out if x is not None)


def ops(res: DiffResult, layer: int) -> list[Op]:
    """The layer's ops with what the diff says of each."""
    stats = {p.label: p for p in res.pairs}
    div = {f.tensor for f in res.findings if f.severity == Severity.DIVERGENCE and f.tensor}
    note = {f.tensor for f in res.findings if f.severity != Severity.DIVERGENCE and f.tensor and f.kind == Kind.NUMERIC}
    first = res.first_divergence
    first_name = first.tensor if first is not None else None
    out: list[Op] = []
    for tap, col, row in LAYOUT:
        name = (f"layer{layer}" if layer else "embed") if tap == "in" else f"layer{layer + 1}" if tap == "out" \
            else f"layer{layer}.{tap}"
        label = name if tap in ("in", "out") else tap
        p = stats.get(name)
        if p is None:
            if tap in ("in", "out", "router"):
                continue
            state = "missing"
            out.append(Op(name, tap, label, col, row, state))
            continue
        state = ("first" if name == first_name else "diverges" if name in div else "note" if name in note else "ok")
        if not p.compared:
            state = "missing"
        tol = p.tolerance[0] if p.tolerance else {}
        out.append(Op(name, tap, label, col, row, state, p.rel_max[0] if p.rel_max else None,
                      float(tol.get("max_rel", 0.0)) or None, p.failing[0] if p.failing else 0, p.tokens))
    if not any(o.name.startswith(f"layer{layer}.") and o.state != "missing" for o in out):
        return []
    return out


def line(res: DiffResult, layer: int) -> str:
    """``layer3: layer3 ✓ → attn_norm ✓ → q ✓ k ✓ v ✓ → ...``: the graph as one line of text."""
    cols: dict[int, list[Op]] = {}
    for o in ops(res, layer):
        cols.setdefault(o.col, []).append(o)
    if not cols:
        return ""
    return f"layer {layer}: " + " → ".join(
        " ".join(f"{o.label} {GLYPH[o.state]}" for o in sorted(cols[c], key=lambda o: o.row)) for c in sorted(cols))


def svg(res: DiffResult, layer: int) -> str:
    """The graph as inline SVG (empty when the layer has no compared tap)."""
    nodes = ops(res, layer)
    if not nodes:
        return ""
    w, h, dx, dy, x0, y0 = 104, 26, 118, 40, 8, 20
    at = {o.name: (x0 + o.col * dx, y0 + (o.row + 0.2) * dy) for o in nodes}
    by_tap = {o.tap: o for o in nodes}
    parts = []
    width, height = x0 * 2 + 9 * dx + w, int(y0 * 2 + 3.2 * dy + h)
    parts.append(f'<svg xmlns="http://www.w3.org/2000/svg" class="opgraph" width="{width}" height="{height}" '
                 f'viewBox="0 0 {width} {height}" font-family="monospace" font-size="11">')
    for a, b in EDGES:
        oa, ob = by_tap.get(a), by_tap.get(b)
        if oa is None or ob is None:
            continue
        (xa, ya), (xb, yb) = at[oa.name], at[ob.name]
        if a == "in" and b == "out":   # the residual stream, under the ops
            ybot = y0 + 3.0 * dy + h
            parts.append(f'<path d="M{xa + w / 2},{ya + h} V{ybot} H{xb + w / 2} V{yb + h}" fill="none" '
                         'stroke="#90a4ae" stroke-dasharray="4 3"/>')
            continue
        parts.append(f'<line x1="{xa + w}" y1="{ya + h / 2}" x2="{xb}" y2="{yb + h / 2}" stroke="#90a4ae"/>')
    for o in nodes:
        x, y = at[o.name]
        fill = COLOURS[o.state]
        hollow = o.state == "missing"
        stroke = "#000" if o.state == "first" else fill
        nums = ""
        if o.rel_max is not None:
            nums = f"rel max {o.rel_max:.3g}"
            if o.max_rel:
                nums += f" (tolerance {o.max_rel:.3g})"
            nums += f"; {o.failing} of {o.tokens} tokens fail"
        title = html.escape(f"{o.name}: {o.state}" + (f"; {nums}" if nums else ""))
        parts.append(f'<g class="op op-{o.state}" data-op="{html.escape(o.name)}"><title>{title}</title>'
                     f'<rect x="{x}" y="{y}" width="{w}" height="{h}" rx="5" fill="{"#fff" if hollow else fill}" '
                     f'stroke="{stroke}" stroke-width="{3 if o.state == "first" else 1}"/>'
                     f'<text x="{x + w / 2}" y="{y + h / 2 + 4}" text-anchor="middle" '
                     f'fill="{"#333" if hollow else "#fff"}">{html.escape(o.label)}</text></g>')
    parts.append("</svg>")
    return "".join(parts)
