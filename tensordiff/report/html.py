"""The HTML report: ``tensordiff report A B -o report.html``.

One self-contained file, for a CI artefact or a pull request: inline CSS, no script, no font or
image fetched at view time. It shows what the text report shows (the headline, the findings in
forward order, acceptance per draft position and per regime when the traces hold draft
predictions or verify steps, the slot table, per-tensor numerics, worst tokens, tokens and gaps) and the token
x slot heatmap as a PNG embedded as a data URI, written here with zlib and struct (no imaging
library). Every verdict and colour is the diff's (:func:`tensordiff.diff.diff_traces`): the
heatmap colours a cell by the per-token flags of the diff summary and shades it by the relative
error the diff computed. Numbers computed on sketches (``basis: sketch``) are marked ``≈``.
"""

from __future__ import annotations

import base64
import html
import math
import struct
import time
import zlib
from collections.abc import Callable
from collections.abc import Set as AbstractSet
from typing import TYPE_CHECKING, SupportsFloat

import numpy as np

from .. import __version__
from ..errors import UsageError
from ..findings import AcceptanceDetails, DiffResult, Finding, Kind, regime_words
from ..fmt import percent
from ..summary import (  # the TUI's column order
    FLAG_BAD,
    FLAG_NONFINITE,
    SummaryReader,
    read_columns,
)
from . import opgraph

if TYPE_CHECKING:
    from ..diff import DiffOptions

# ----------------------------------------------------------------------------------------------
# PNG (8-bit RGB, no interlace), with zlib and struct only
# ----------------------------------------------------------------------------------------------


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def png_bytes(rgb: np.ndarray) -> bytes:
    """A PNG file of an [h, w, 3] uint8 image (filter 0 on every row)."""
    rgb = np.ascontiguousarray(rgb, dtype=np.uint8)
    h, w, c = rgb.shape
    if c != 3 or h < 1 or w < 1:
        raise ValueError(f"expected an [h, w, 3] image, got {rgb.shape}")
    raw = np.concatenate([np.zeros((h, 1), np.uint8), rgb.reshape(h, w * 3)], axis=1).tobytes()
    return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
            + _chunk(b"IDAT", zlib.compress(raw, 9)) + _chunk(b"IEND", b""))


# ----------------------------------------------------------------------------------------------
# The heatmap image
# ----------------------------------------------------------------------------------------------

ABSENT = (236, 236, 236)
NONFINITE = (255, 64, 255)
OK_LO, OK_HI = (46, 125, 50), (192, 202, 51)          # within tolerance: dark to light green
FAIL_LO, FAIL_HI = (255, 183, 77), (255, 23, 68)      # fails tolerance: orange to red
REL_LO, REL_HI = -6.0, 1.0                            # log10 of the relative error at the two ends
CELL_W = 14                                           # pixels per column (1 of them a gap)


def _ramp(lo: tuple[int, int, int], hi: tuple[int, int, int], t: np.ndarray) -> np.ndarray:
    a, b = np.array(lo, np.float64), np.array(hi, np.float64)
    rgb: np.ndarray = np.rint(a + (b - a) * t[..., None]).astype(np.uint8)
    return rgb


def heatmap_bins(summary: SummaryReader, columns: list[int], max_rows: int = 480,
                 chunk_rows: int = 65536) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Reduce the summary to at most ``max_rows`` bins of consecutive aligned tokens, streamed in
    chunks (memory does not grow with the trace). Returns (bin edges [n_bins + 1],
    category [n_bins, n_cols]: -1 absent, 0 ok, 1 fails, 2 NaN/Inf, the worst in the bin;
    log10 relative error [n_bins, n_cols], the largest in the bin)."""
    n = summary.n
    n_bins = max(1, min(n, max_rows))
    edges = np.linspace(0, n, n_bins + 1).round().astype(np.int64)
    cat = np.full((n_bins, len(columns)), -1, np.int8)
    lrel = np.full((n_bins, len(columns)), -np.inf)
    if n == 0:
        return edges, cat, lrel
    b0 = 0
    while b0 < n_bins:
        b1 = b0 + 1
        while b1 < n_bins and edges[b1 + 1] - edges[b0] <= chunk_rows:
            b1 += 1
        lo, hi = int(edges[b0]), int(edges[b1])
        offs = edges[b0:b1] - lo
        for j, c in enumerate(columns):
            vals = summary.columns[c][lo:hi]
            flags, rel = vals[:, 3], vals[:, 1].astype(np.float64)
            present = ~np.isnan(flags)
            fl = np.where(present, flags, 0).astype(np.int64)
            k = np.where(~present, -1, np.where(fl & FLAG_NONFINITE, 2, np.where(fl & FLAG_BAD, 1, 0)))
            with np.errstate(divide="ignore", invalid="ignore"):
                lr = np.log10(np.abs(rel))
            lr = np.where(present, np.where(np.isnan(rel), np.inf, lr), -np.inf)   # NaN error: the top
            cat[b0:b1, j] = np.maximum.reduceat(k, offs)
            lrel[b0:b1, j] = np.maximum.reduceat(lr, offs)
        b0 = b1
    return edges, cat, lrel


def heatmap_rgb(cat: np.ndarray, lrel: np.ndarray, cell_w: int = CELL_W) -> np.ndarray:
    """[n_bins, n_cols * cell_w, 3]: each column ``cell_w - 1`` pixels wide and a white gap."""
    t = np.clip((np.where(np.isfinite(lrel), lrel, np.where(lrel > 0, REL_HI, REL_LO)) - REL_LO)
                / (REL_HI - REL_LO), 0.0, 1.0)
    rgb = np.empty(cat.shape + (3,), np.uint8)
    rgb[:] = ABSENT
    ok, fail, nf = cat == 0, cat == 1, cat == 2
    rgb[ok] = _ramp(OK_LO, OK_HI, t[ok])
    rgb[fail] = _ramp(FAIL_LO, FAIL_HI, t[fail])
    rgb[nf] = NONFINITE
    img = np.repeat(rgb, cell_w, axis=1)
    img[:, cell_w - 1::cell_w] = 255
    return img


# ----------------------------------------------------------------------------------------------
# HTML
# ----------------------------------------------------------------------------------------------

CSS = """
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; margin: 24px; color: #1b1f24; max-width: 1200px; }
h1 { font-size: 20px; margin: 0 0 4px; } h2 { font-size: 16px; margin: 28px 0 8px; border-bottom: 1px solid #ddd; }
.meta { color: #57606a; font-size: 12px; } code, td.num, .mono { font-family: ui-monospace, Menlo, Consolas, monospace; }
.verdict { padding: 12px 16px; border-radius: 6px; margin: 14px 0; font-size: 16px; }
.verdict.div { background: #ffebe9; border: 1px solid #ff8182; } .verdict.ok { background: #dafbe1; border: 1px solid #4ac26b; }
.verdict b { display: block; font-size: 13px; letter-spacing: .05em; }
table { border-collapse: collapse; font-size: 13px; }
th, td { padding: 3px 8px; border-bottom: 1px solid #eee; text-align: left; vertical-align: top; }
th { background: #f6f8fa; } td.num { text-align: right; white-space: nowrap; }
.sev-divergence { color: #cf222e; } .sev-warning { color: #9a6700; } .sev-info { color: #57606a; }
.bad { color: #cf222e; font-weight: 600; } .good { color: #1a7f37; } .note { color: #57606a; font-size: 12px; }
.hm { display: flex; gap: 8px; align-items: flex-start; }
.hm-axis { position: relative; font: 11px ui-monospace, monospace; color: #57606a; width: 110px; text-align: right; }
.hm-axis span { position: absolute; right: 0; transform: translateY(-50%); white-space: nowrap; }
.hm-cols { display: flex; height: 96px; align-items: flex-end; }
.hm-cols span { writing-mode: vertical-rl; transform: rotate(180deg); font: 11px ui-monospace, monospace;
               overflow: hidden; white-space: nowrap; }
.hm img { image-rendering: pixelated; image-rendering: crisp-edges; display: block; border: 1px solid #ccc; }
.bar { display: inline-block; width: 120px; height: 10px; background: #eaeef2; border-radius: 2px; vertical-align: middle;
       margin-right: 6px; } .bar span { display: block; height: 100%; border-radius: 2px; }
.bar .hi { background: #2da44e; } .bar .lo { background: #cf222e; }
.legend span { display: inline-block; width: 12px; height: 12px; vertical-align: middle; margin: 0 3px 0 10px;
               border: 1px solid #ccc; }
"""

_MARK = {"divergence": "✗", "warning": "!", "info": "·"}


def _e(x: object) -> str:
    return html.escape("" if x is None else str(x), quote=True)


def _one_minus(cos: SupportsFloat | str | None, approx: bool = False) -> str:
    """A cosine as ``1 - cos`` (the report's one convention for cosines)."""
    if cos is None:
        return "-"
    try:
        v = float(cos)
    except (TypeError, ValueError):
        return _e(cos)
    return _num(v if math.isnan(v) else max(0.0, 1.0 - v), approx=approx)


def _num(x: SupportsFloat | str | None, nd: int = 4, approx: bool = False) -> str:
    if x is None:
        return "-"
    try:
        v = float(x)
    except (TypeError, ValueError):
        return _e(x)
    if math.isnan(v):
        s = "nan"
    elif v in (float("inf"), float("-inf")):
        s = "inf" if v > 0 else "-inf"
    elif v != 0 and (abs(v) >= 1e4 or abs(v) < 1e-3):
        s = f"{v:.2e}"
    else:
        s = f"{v:.{nd}f}"
    return ("≈" + s) if approx else s


def _rgb_css(c: tuple[int, int, int]) -> str:
    return f"#{c[0]:02x}{c[1]:02x}{c[2]:02x}"


def _table(head: list[str], rows: list[list[str]], num_cols: AbstractSet[int] = frozenset()) -> str:
    out = ["<table><thead><tr>", *(f"<th>{h}</th>" for h in head), "</tr></thead><tbody>"]
    for r in rows:
        out.append("<tr>" + "".join(f'<td class="num">{c}</td>' if i in num_cols else f"<td>{c}</td>"
                                    for i, c in enumerate(r)) + "</tr>")
    out.append("</tbody></table>")
    return "".join(out)


def _where(f: Finding, text: Callable[[int | None], str] | None) -> str:
    if f.tensor is None or f.position is None:
        return ""
    s = f"tensor <code>{_e(f.tensor)}</code>" + (f" slot {f.slot}" if f.slot is not None else "")
    s += f", seq <code>{_e(f.seq)}</code>, position {f.position}"
    if f.position_b not in (None, f.position):
        s += f" (B position {f.position_b})"
    s += f", token {f.token}"
    if text is not None and f.token is not None:
        s += f" <code>{_e(text(f.token))}</code>"
    return s + f", regime {_e(regime_words(f.regime, f.regime_a))}"


def _heatmap_section(res: DiffResult, summary: SummaryReader | None, text: Callable[[int | None], str] | None) -> str:
    if summary is None or summary.n == 0 or not summary.columns:
        return '<p class="note">no per-token summary (nothing aligned)</p>'

    cols = read_columns(summary)
    edges, cat, lrel = heatmap_bins(summary, [c.index for c in cols])
    img = heatmap_rgb(cat, lrel)
    n_bins = len(edges) - 1
    scale = max(1, 240 // n_bins)                 # short traces: taller rows
    height = n_bins * scale
    uri = "data:image/png;base64," + base64.b64encode(png_bytes(img)).decode("ascii")
    labels = "".join(f'<span style="width:{CELL_W}px" title="{_e(c.label)}">{_e(c.label)}</span>' for c in cols)
    # row axis: where each sequence starts (at most 16 ticks)
    toks = summary.tokens_ds
    ticks = []
    starts = [0]
    step = max(1, n_bins // 16)
    for b in range(0, n_bins, step):
        starts.append(int(edges[b]))
    seen = set()
    for row in sorted(set(starts)):
        t = toks[row]
        name = summary.seq_a[int(t["seq_a"])] if int(t["seq_a"]) < len(summary.seq_a) else str(int(t["seq_a"]))
        label = f"{name}:{int(t['pos_a'])}"
        if label in seen:
            continue
        seen.add(label)
        b = int(np.searchsorted(edges, row, side="right") - 1)
        ticks.append(f'<span style="top:{(b + 0.5) * scale:.1f}px">{_e(label)}</span>')
    legend = (f'<span style="background:{_rgb_css(OK_LO)}"></span>within tolerance (darker: smaller rel err)'
              f'<span style="background:{_rgb_css(FAIL_HI)}"></span>fails tolerance'
              f'<span style="background:{_rgb_css(NONFINITE)}"></span>NaN/Inf'
              f'<span style="background:{_rgb_css(ABSENT)}"></span>no row for that token')
    binned = (f"{summary.n} aligned tokens in {n_bins} rows of about {summary.n / n_bins:.1f} tokens each "
              "(a row shows the worst token of its bin)") if n_bins < summary.n else f"{summary.n} aligned tokens, one per row"
    return (f'<div class="hm"><div class="hm-axis" style="height:{height}px;margin-top:96px">{"".join(ticks)}</div>'
            f'<div><div class="hm-cols">{labels}</div>'
            f'<img id="heatmap" alt="token x slot heatmap" src="{uri}" width="{img.shape[1]}" height="{height}"></div></div>'
            f'<p class="legend note">{legend}</p><p class="note">{binned}; columns in forward order.</p>')


def _bar(frac: SupportsFloat | None) -> str:
    """A bar filled to ``frac`` (0..1) beside its percentage; green from one half, red below."""
    if frac is None:
        return "-"
    f = max(0.0, min(1.0, float(frac)))
    return (f'<span class="bar" data-frac="{f:.6f}"><span class="{"hi" if f >= 0.5 else "lo"}" '
            f'style="width:{100 * f:.2f}%"></span></span>{percent(f)}')


def _acceptance_section(res: DiffResult) -> str:
    """Acceptance per draft position and per regime, and A against B, from the acceptance
    finding's details (:class:`tensordiff.details.AcceptanceDetails`); empty without one."""
    f = next((x for x in res.findings if x.kind == Kind.ACCEPTANCE and isinstance(x.details, AcceptanceDetails)), None)
    d = f.details if f is not None else None
    if f is None or not isinstance(d, AcceptanceDetails):
        return ""
    out = ['<h2 id="acceptance-title">Acceptance</h2><div id="acceptance">',
           f'<p id="acceptance-finding" class="sev-{_e(f.severity)}">{_MARK.get(f.severity, "·")} #{f.index} '
           f"{_e(f.message)}</p>"]
    if d.per_position:
        out.append(f'<p>by draft position on <b>{_e(d.side)}</b>: {d.steps} verify steps, mean acceptance length '
                   f'<b id="accept-length">{_num(d.accept_length, 2)}</b></p>')
        rows = [[str(p["position"]), str(p["reached"]), str(p["accepted"]), _bar(p.get("rate")), percent(p.get("top1")),
                 _num(p.get("target_logprob"), 3), percent(p.get("overlap")), _num(p.get("kl_lb"), 3)]
                for p in d.per_position]
        out.append(_table(["draft position", "steps reaching it", "accepted", "accepted share", "top-1 = target",
                           "target log-prob", "top-k overlap", "KL(target‖draft) ≥"], rows, {1, 2, 4, 5, 6, 7})
                   .replace("<table>", '<table id="acceptance-positions">', 1))
    other = d.side_a if d.side == d.side_b else d.side_b
    for side, teach, tid in ((d.side, d.teacher, "acceptance-regimes"), (other, d.teacher_other, "acceptance-regimes-other")):
        if not teach:
            continue
        out.append(f"<p>the draft against the target, teacher-forced (draft position 0), on <b>{_e(side)}</b>, by regime</p>")
        rows = [[_e(reg), str(e.get("rows", 0)), _bar(e.get("top1")), percent(e.get("overlap")), _num(e.get("kl_lb"), 3)]
                for reg, e in teach.items()]
        out.append(_table(["regime", "draft rows", "top-1 agree", "top-k overlap", "KL(target‖draft) ≥"], rows, {1, 3, 4})
                   .replace("<table>", f'<table id="{tid}">', 1))
    if d.cross:
        out.append(f"<p>{_e(d.side_a)} against {_e(d.side_b)} on the aligned tokens</p>")
        rows = [[f"<code>{_e(name)}</code>", str(c.get("tokens", 0)), percent(c.get("top1")), percent(c.get("overlap")),
                 _num(c.get("kl_lb"), 3)] for name, c in d.cross.items()]
        out.append(_table(["predictions", "tokens", "top-1 equal", "top-k overlap", "KL ≥"], rows, {1, 2, 3, 4})
                   .replace("<table>", '<table id="acceptance-cross">', 1))
    if d.not_compared:
        out.append(f'<p class="note">not compared: {_e(", ".join(d.not_compared))}</p>')
    out.append('<p class="note">accepted share: of the verify steps that reached a draft position (every earlier '
               "draft token accepted), the share that accepted its token. KL is a lower bound from the two top-k "
               "tables (tensordiff.acceptance).</p></div>")
    return "".join(out)


def render_html(res: DiffResult, summary: SummaryReader | None = None, *,
                token_text: Callable[[int | None], str] | None = None, max_findings: int = 200, worst: int = 20) -> str:
    """The report as one HTML string (see the module docstring)."""
    first = res.first_divergence
    text = token_text
    head = (f"<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>tensordiff: {_e(res.headline())}"
            f"</title><style>{CSS}</style></head><body>")
    tag_a, tag_b = res.side_tags()
    meta = (f"<h1>tensordiff report</h1><p class=\"meta\">A = <code>{_e(res.path_a)}</code>{_e(tag_a)} · "
            f"B = <code>{_e(res.path_b)}</code>{_e(tag_b)} · tensordiff {_e(__version__)} · "
            f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}</p>")
    parts = [head, meta]
    cls = "div" if first else "ok"
    verdict = "DIVERGENCE" if first else "AGREE"
    parts.append(f'<div class="verdict {cls}" id="verdict"><b>{verdict} (exit {res.exit_code})</b>'
                 f'<span id="headline">{_e(res.headline())}</span>')
    if first is not None and _where(first, text):
        parts.append(f'<div class="note">first divergence at: {_where(first, text)}</div>')
    parts.append("</div>")

    parts.append("<h2>Token × slot heatmap</h2>")
    parts.append(_heatmap_section(res, summary, text))

    nd = len(res.divergences)
    parts.append(f"<h2>Findings ({nd} divergence{'s' if nd != 1 else ''}, {len(res.findings) - nd} other), "
                 "divergences first, each group in forward order</h2>")
    if res.findings:
        rows = []
        for f in res.findings[:max_findings]:
            inh = f"may be inherited from #{f.inherited_from}" if f.inherited_from is not None else ""
            rows.append([f'<span class="sev-{_e(f.severity)}">{_MARK.get(f.severity, "·")}</span>', str(f.index),
                         _e(f.kind), f'<span class="sev-{_e(f.severity)}">{_e(f.message)}</span>', _e(inh)])
        parts.append(_table(["", "#", "kind", "finding", "note"], rows))
        if len(res.findings) > max_findings:
            parts.append(f'<p class="note">... {len(res.findings) - max_findings} more '
                         '(see <code>tensordiff diff --json</code>)</p>')
    else:
        parts.append("<p>none</p>")

    parts.append(_acceptance_section(res))

    for layer in opgraph.zoomed_layers(res):   # a zoomed layer: its ops coloured by error
        graph = opgraph.svg(res, layer)
        if graph:
            parts.append(f'<h2 id="opgraph-{layer}">Decoder layer {layer}, op by op</h2><div class="opgraph">{graph}</div>'
                         '<p class="note">green: agrees; amber: a note; red: diverges; outlined dark red: the first op '
                         "out of the noise; hollow: recorded on one side only. Hover an op for its numbers; the dashed "
                         "line is the residual stream.</p>")

    if res.slot_table:
        parts.append("<h2>Slots</h2>")
        rows = []
        for r in res.slot_table:
            held_b = _e(r.held_b or "?") + (f" (pos {r.offset_b:+d})" if r.offset_b else "")
            v = f'<span class="{"good" if r.verdict == "ok" else "bad"}">{_e(r.verdict)}</span>'
            rows.append([f"<code>{_e(r.tensor)}</code>", str(r.slot), _e(r.claimed_a or "-"), _e(r.held_a or "?"),
                         _e(r.claimed_b or "-"), held_b, _num(r.score_b), _num(r.margin_b), _one_minus(r.cos_mean), v])
        parts.append(_table(["tensor", "slot", f"{_e(res.side_a)} claims", f"{_e(res.side_a)} holds",
                             f"{_e(res.side_b)} claims", f"{_e(res.side_b)} holds", f"{_e(res.side_b)} score",
                             f"{_e(res.side_b)} margin", "1-cos mean", "verdict"], rows, {6, 7, 8}))
        parts.append(f'<p class="note">score and margin: the identity match of what {_e(res.side_b)} holds in the '
                     "slot, against the runner-up.</p>")

    parts.append("<h2>Tensors</h2>")
    rows = []
    any_sketch = False
    for p in res.pairs:
        sk = p.basis == "sketch"
        any_sketch |= sk
        for s in range(p.slots):
            fail = p.failing[s] if p.failing else 0
            tol = p.tolerance[s] if p.tolerance else {}
            tol_txt = (f"{max(0.0, 1.0 - float(tol.get('min_cos', 0))):.3g} / {tol.get('max_rel', 0):.3g}"
                       + ("" if tol.get("source") == "default" else f" ({_e(tol.get('source'))})")) if tol else "-"
            rows.append([f"<code>{_e(p.label)}</code>" if s == 0 else "", str(s) if p.slots > 1 else "", str(p.tokens),
                         _one_minus(p.cos_min[s] if p.cos_min else None, approx=sk),
                         _num(p.rel_max[s] if p.rel_max else None, approx=sk),
                         _num(p.maxabs[s] if p.maxabs else None, approx=sk),
                         f'<span class="{"bad" if fail else "good"}">{fail}</span>',
                         f"{p.nonfinite_a[s] if p.nonfinite_a else 0}/{p.nonfinite_b[s] if p.nonfinite_b else 0}",
                         tol_txt, "sketch" if sk else "values"])
    parts.append(_table(["tensor", "slot", "tokens", "1-cos max", "rel max", "max abs", "failing", "NaN/Inf A/B",
                         "tol 1-cos / rel", "basis"], rows, {2, 3, 4, 5}))
    if any_sketch:
        parts.append('<p class="note">≈ computed on the traces\' random-projection sketches, not on full values: '
                     "1 - cos is close to the true one, max abs and relative error are of the sketch.</p>")

    if res.worst_tokens and worst:
        parts.append("<h2>Worst tokens</h2>")
        sketch = {p.name_a for p in res.pairs if p.basis == "sketch"}
        slotted = {n for p in res.pairs if p.slots > 1 for n in (p.name_a, p.name_b, p.label)}
        rows = []
        for w in res.worst_tokens[:worst]:
            sk = w.get("tensor") in sketch
            slot = _e(w.get("slot")) if w.get("tensor") in slotted else ""   # a tensor without slots names none
            rows.append([f"<code>{_e(w.get('tensor'))}</code>", slot, _e(w.get("seq")), _e(w.get("position")),
                         _e(w.get("token")), f"<code>{_e(text(w.get('token')))}</code>" if text else "",
                         _e(regime_words(w.get("regime"), w.get("regime_a"))), _num(w.get("rel"), approx=sk),
                         _one_minus(w.get("cos"), approx=sk)])
        parts.append(_table(["tensor", "slot", "seq", "pos", "token", "text", "regime", "rel", "1-cos"], rows, {7, 8}))

    parts.append("<h2>Tokens</h2>")
    shift_txt = ", ".join(f"shift {k}: {v}" for k, v in sorted(res.shifts.items(), key=lambda kv: int(kv[0])))
    gap_tokens = sum(g.count for g in res.gaps)
    nseq = len(res.sequences)
    parts.append(f"<p>{res.tokens_aligned} aligned in {nseq} sequence pair{'s' if nseq != 1 else ''} "
                 f"({_e(shift_txt or 'no shift')}); {gap_tokens} token{'s' if gap_tokens != 1 else ''} on one side only "
                 f"({len(res.gaps)} range{'s' if len(res.gaps) != 1 else ''}), not counted as divergence.</p>")
    if text is not None:
        parts.append(f'<p class="note">token text from {_e(getattr(text, "source", "the tokenizer"))}</p>')
    parts.append("</body></html>\n")
    return "".join(parts)


def write_html(res: DiffResult, out: str, summary_path: str | None = None, *,
               token_text: Callable[[int | None], str] | None = None, max_findings: int = 200, worst: int = 20) -> str:
    """Write the report to ``out`` (reading the per-token summary at ``summary_path``, if any)."""
    summary = SummaryReader(summary_path) if summary_path else None
    try:
        doc = render_html(res, summary, token_text=token_text, max_findings=max_findings, worst=worst)
    finally:
        if summary is not None:
            summary.close()
    try:
        with open(out, "w", encoding="utf-8") as fh:
            fh.write(doc)
    except OSError as e:
        raise UsageError(f"cannot write {out}: {e.strerror or e}") from None
    return out


def make_report(path_a: str, path_b: str, out: str, options: DiffOptions | None = None, *,
                tokenizer: str | None = None) -> DiffResult:
    """Diff two traces and write the HTML report (``tensordiff report A B -o OUT``): the per-token
    summary goes to a temporary file, removed afterwards. Token text from ``tokenizer`` (a
    directory) or from the model directory a trace records, when it has a tokenizer."""
    import dataclasses
    import os
    import shutil
    import tempfile

    from ..diff import DiffOptions, diff_traces
    from ..token_text import recorded_model_dirs, resolve

    real = os.path.realpath(out)
    if real in (os.path.realpath(path_a), os.path.realpath(path_b)):
        raise UsageError(f"-o {out} would overwrite an input trace")
    if not os.path.isdir(os.path.dirname(real)):
        raise UsageError(f"-o {out}: no directory {os.path.dirname(real)}")
    token_text = resolve(tokenizer, () if tokenizer else recorded_model_dirs(path_a, path_b))
    tmp = tempfile.mkdtemp(prefix="tensordiff-report-")
    try:
        opts = dataclasses.replace(options or DiffOptions(), summary_path=os.path.join(tmp, "summary.h5"))
        res = diff_traces(path_a, path_b, opts)
        write_html(res, out, opts.summary_path, token_text=token_text)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dataclasses.replace(res, summary_path=None)
