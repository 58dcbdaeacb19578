"""The text of the TUI's panes: the detail pane's lines, its small plots, numbers (no textual).

Plain functions of the diff's result and the diff summary, returning rich ``Text``, so they are
tested without an app; the widgets in :mod:`tensordiff.tui.widgets` show them.
"""

from __future__ import annotations

import re

import itertools
import math
from typing import SupportsInt

import numpy as np
from rich.text import Text

from ..findings import DiffResult, Finding, IdentityDetails, Kind
from ..fmt import OK_GLYPH, SEVERITY_GLYPH, number, percent
from ..names import maybe_state
from ..report import opgraph
from ..summary import FLAG_BAD, FLAG_NONFINITE, Column, SummaryReader
from .data import BARS, N_LEVELS, column_findings, slot_row
from ..vocab import REGIMES

SEV_RANK = {"divergence": 3, "warning": 2, "info": 1}
GLYPH_RANK = {OK_GLYPH[0]: 0, "·": 1, "!": 2, "✗": 3}

#: a cell's two vectors as read for the detail pane, and a note on how they were read
Vectors = tuple["np.ndarray | None", "np.ndarray | None", str]



def column_verdict(res: DiffResult, col: Column) -> tuple[str, str, str]:
    """(glyph, style, words) from the diff's findings and slot table for one column."""
    fs = column_findings(res, col)
    worst = max(fs, key=lambda f: SEV_RANK.get(f.severity, 0), default=None)
    row = slot_row(res, col)
    if row is not None and row.held_b is not None and (row.held_b != row.expected or row.offset_b):
        words = f"holds {row.held_b}{f' ({row.offset_b:+d})' if row.offset_b else ''} {fmt(row.score_b, 2)}"
    elif row is not None and row.verdict != "ok":
        words = row.verdict
    elif row is not None:
        words = f"ok {fmt(row.score_b, 2)}"
    else:
        words = worst.kind if worst is not None else "ok"
    if worst is None:
        return OK_GLYPH[0], OK_GLYPH[1], words
    g, s = SEVERITY_GLYPH.get(worst.severity, ("?", ""))
    return g, s, words


_SLOT_OF = re.compile(r"\bslot (\d+) of ([^\s:;,()]+)")
#: the reason every "feeds" finding gives alike (the headline says it once)
_FEEDS_WHY = re.compile(r" \(each holds what it claims; [^)]*\)$")


def compact_sentence(message: str) -> str:
    """The sentence with ``slot K of T`` written ``T[K]``: on a narrow pane the words that tell
    two findings apart come first; the reason that slots fed differently share is left to the
    headline and the detail pane."""
    return _FEEDS_WHY.sub("", _SLOT_OF.sub(lambda m: f"{m.group(2)}[{m.group(1)}]", message))


def finding_prompt(f: Finding, compact: bool = False) -> Text:
    """One finding in the list: on one line cut at the pane's edge, or (``compact``, a narrow
    screen) wrapped over as many lines as it needs, ``slot K of T`` written ``T[K]``."""
    glyph, style = SEVERITY_GLYPH.get(f.severity, ("?", ""))
    t = Text(no_wrap=not compact, overflow="fold" if compact else "ellipsis")
    t.append(f"{glyph} ", style=style)
    t.append(f"#{f.index} ", style="dim")
    t.append(compact_sentence(f.message) if compact else f.message,
             style="bold" if f.severity == "divergence" and f.inherited_from is None else "")
    return t


# ----------------------------------------------------------------------------------------------
# The detail pane's lines
# ----------------------------------------------------------------------------------------------


def detail_lines(res: DiffResult, summary: SummaryReader, col: Column, row: int, tok: np.void,
                 selected: Finding | None, vectors: Vectors | None, width: int, token_str: str = "") -> list[Text]:
    """What the detail pane says about one cell: the finding on its column, both token keys, the
    cell's metrics and the diff's verdict on it, the slot's identity, the best candidates and,
    once read (``vectors`` = (a, b, note); None while reading), the plots of the two vectors.
    ``token_str``: the token as text, when a tokenizer is at hand. Numbers the diff computed
    on sketches (the pair's ``basis``) are marked ``≈``."""
    lines: list[Text] = []
    fs = column_findings(res, col)
    f: Finding | None
    if selected is not None and (selected in fs or selected.tensor is None or selected.kind == Kind.ACCEPTANCE):
        f = selected   # the selected finding, when it is about this column or about no column (acceptance)
    else:
        f = min(fs, key=lambda x: x.index) if fs else None
    if f is not None:
        g, s = SEVERITY_GLYPH.get(f.severity, ("?", ""))
        kind = "" if f.message.startswith(f"{f.kind}:") else f" {f.kind}:"   # not "gap: gap:"
        t = Text.assemble((f"{g} #{f.index}{kind} ", s), (f.message, "bold"))
        if f.inherited_from is not None:
            t.append(f"  (may be inherited from #{f.inherited_from})", style="dim")
        if len(fs) > 1 or (fs and f not in fs):
            t.append(f"  [{len(fs)} finding{'s' if len(fs) != 1 else ''} on {col.label}]", style="dim")
        lines.append(t)
    else:
        lines.append(Text.assemble(OK_GLYPH, (f" no finding on {col.label}", "")))
    # what the slot holds first: on a 24-line terminal it is shown without scrolling
    srow = slot_row(res, col)
    if srow is not None:
        held = srow.held_b or "?"
        if srow.offset_b:
            held += f" (position {srow.offset_b:+d})"
        lines.append(Text.assemble(
            ("slot ", "dim"), (srow.verdict, "bold red" if srow.verdict != "ok" else "green"),
            (": ", "dim"), (f"{res.side_b} ", "yellow"), f"holds {held} (claims {srow.claimed_b or '-'}), ",
            (f"{res.side_a} ", "cyan"), f"holds {srow.held_a or '?'} (claims {srow.claimed_a or '-'})",
            ("  score ", "dim"), fmt(srow.score_b, 3), ("  margin ", "dim"), fmt(srow.margin_b, 3)))
    cands = (f.details.candidates if f is not None and isinstance(f.details, IdentityDetails) else None) or \
        (srow.candidates_b if srow else None)
    if cands:
        t = Text("candidates ", style="dim")
        for i, c in enumerate(cands[:4]):
            if i:
                t.append(" · ", style="dim")
            off = c.offset or 0
            t.append(f"{c.label}{f' ({off:+d})' if off else ''}", style="bold" if i == 0 else "")
            t.append(f" {fmt(c.score, 3)} (1-cos {fmt(1.0 - c.cos if c.cos is not None else None, 3)}, "
                     f"rms {fmt(c.rms_agreement, 3)})")
        lines.append(t)
    sa, sb = int(tok["seq_a"]), int(tok["seq_b"])
    name_a = summary.seq_a[sa] if sa < len(summary.seq_a) else str(sa)
    name_b = summary.seq_b[sb] if sb < len(summary.seq_b) else str(sb)
    lines.append(Text.assemble(
        ("cell ", "dim"), (col.label, "bold"), ("  token ", "dim"), (str(int(tok["token"])), "bold"),
        (f" {token_str}" if token_str else "", "bold magenta"),
        ("  ", ""), (f"{res.side_a}: ", "cyan"), f"{name_a} pos {int(tok['pos_a'])} ({regime_name(tok['regime_a'])})",
        ("  ", ""), (f"{res.side_b}: ", "yellow"), f"{name_b} pos {int(tok['pos_b'])} ({regime_name(tok['regime_b'])})",
        ("  aligned #", "dim"), (str(row), "dim")))
    cos, rel, maxabs, flags = (float(x) for x in summary.cell(row, col.index))
    if np.isnan(flags):
        lines.append(Text("no row of this tensor for this token on one side", style="dim"))
    else:
        fl = int(flags)
        verdict = ("NaN/Inf" if fl & FLAG_NONFINITE else "fails tolerance" if fl & FLAG_BAD else "within tolerance")
        vstyle = "bold magenta" if fl & FLAG_NONFINITE else "bold red" if fl & FLAG_BAD else "green"
        pair = next((p for p in res.pairs if col.tensor_a in (p.name_a, p.label)), None)
        sk = "≈" if pair is not None and pair.basis == "sketch" else ""
        one_minus = 1.0 - cos if cos == cos else cos   # NaN stays NaN
        t = Text.assemble(("1 - cos ", "dim"), sk + fmt(one_minus), ("   rel err ", "dim"), sk + fmt(rel, 3),
                          ("   max abs ", "dim"), sk + fmt(maxabs, 3), ("   aligner: ", "dim"), (verdict, vstyle))
        if sk:
            t.append("  (≈ on sketches, not full values)", style="dim")
        lines.append(t)
    lines += op_graph_lines(res, col.label)
    if vectors is not None:
        va, vb, note = vectors
        lines += plot_lines(va, vb, res.side_a, res.side_b, width)
        if note:
            lines.append(Text(note, style="dim"))
    else:
        lines.append(Text("reading the two vectors...", style="dim"))
    return lines


_OP_STYLE = {"ok": "green", "note": "yellow", "diverges": "bold red", "first": "bold white on red", "missing": "dim"}


def op_graph_lines(res: DiffResult, label: str) -> list[Text]:
    """The zoomed layer of a tap's column, op by op, each coloured by what the diff says of it
    (:mod:`tensordiff.report.opgraph`); the column's own op underlined. Nothing for other columns."""
    st = maybe_state(label)
    if st is None or st.kind != "tap" or st.layer is None:
        return []
    ops = opgraph.ops(res, st.layer)
    if not ops:
        return []
    t = Text(f"layer {st.layer} ", style="dim")
    cols = sorted({o.col for o in ops})
    for i, c in enumerate(cols):
        if i:
            t.append(" → ", style="dim")
        for j, o in enumerate(sorted((o for o in ops if o.col == c), key=lambda o: o.row)):
            if j:
                t.append(" ")
            style = _OP_STYLE[o.state] + (" underline" if o.name == label else "")
            t.append(f"{o.label} {opgraph.GLYPH[o.state]}", style=style)
    return [t]


# ----------------------------------------------------------------------------------------------
# Numbers and text plots
# ----------------------------------------------------------------------------------------------


def fmt(x: object, nd: int = 4) -> str:
    """The project's number format (:func:`tensordiff.fmt.number`), with 3 digits in scientific form."""
    return number(x, nd, sci=3)


def regime_name(code: SupportsInt) -> str:
    try:
        return REGIMES[int(code)]
    except (IndexError, ValueError, TypeError):
        return str(code)


def sparkline(values: np.ndarray, width: int, top: float | None = None) -> str:
    """Values (>= 0) binned to ``width`` columns by their maximum, drawn as bars scaled to ``top``."""
    v = np.asarray(values, dtype=np.float64)
    if len(v) == 0 or width <= 0:
        return ""
    v = np.where(np.isfinite(v), v, np.nan)
    width = min(width, len(v))
    edges = np.linspace(0, len(v), width + 1).astype(np.int64)
    with np.errstate(all="ignore"):
        binned = np.array([np.nanmax(v[a:b]) if b > a and not np.all(np.isnan(v[a:b])) else np.nan
                           for a, b in itertools.pairwise(edges)])
    top = float(np.nanmax(binned)) if top is None and np.any(np.isfinite(binned)) else (top or 0.0)
    out = []
    for x in binned:
        if not np.isfinite(x):
            out.append("!")
        elif top <= 0 or x <= 0:
            out.append(" " if top > 0 else "▁")
        else:
            out.append(BARS[min(N_LEVELS - 1, int(x / top * N_LEVELS))])
    return "".join(out)


def histograms(a: np.ndarray, b: np.ndarray, bins: int) -> tuple[str, str, float, float]:
    """Histograms of two vectors over a common range, as two lines of bars scaled to the same
    count; returns (line a, line b, lo, hi)."""
    fa, fb = a[np.isfinite(a)], b[np.isfinite(b)]
    both = np.concatenate([fa, fb])
    if len(both) == 0:
        return "", "", math.nan, math.nan
    lo, hi = float(both.min()), float(both.max())
    if hi <= lo:
        hi = lo + 1.0
    ha, _ = np.histogram(fa, bins=bins, range=(lo, hi))
    hb, _ = np.histogram(fb, bins=bins, range=(lo, hi))
    top = max(int(ha.max(initial=0)), int(hb.max(initial=0)), 1)

    def bars(h: np.ndarray) -> str:
        return "".join(" " if c == 0 else BARS[min(N_LEVELS - 1, int(c / top * N_LEVELS))] for c in h)

    return bars(ha), bars(hb), lo, hi


def plot_lines(va: np.ndarray | None, vb: np.ndarray | None, side_a: str, side_b: str, width: int) -> list[Text]:
    """The detail pane's small plots: |a - b| per dimension, and the value histograms of both."""
    lab = max(len(side_a), len(side_b), 5) + 1
    w = max(8, width - lab - 28)
    out: list[Text] = []
    if va is None or vb is None:
        return out
    n = min(len(va), len(vb))
    d = np.abs(va[:n].astype(np.float64) - vb[:n].astype(np.float64))
    finite = d[np.isfinite(d)]
    mx = float(finite.max()) if len(finite) else math.nan
    at = int(np.nanargmax(np.where(np.isfinite(d), d, -1))) if len(finite) else -1
    line = Text("|a-b|".ljust(lab), style="bold")
    line.append(sparkline(d, w).ljust(min(w, n)), style="magenta")
    line.append(f"  max {fmt(mx)} @dim {at} of {n}", style="dim")
    out.append(line)
    ha, hb, lo, hi = histograms(va[:n], vb[:n], min(w, 64))
    for name, h, style in ((side_a, ha, "cyan"), (side_b, hb, "yellow")):
        t = Text(name[:lab - 1].ljust(lab), style="bold")
        t.append(h, style=style)
        t.append(f"  values in [{fmt(lo, 3)}, {fmt(hi, 3)}]", style="dim")
        out.append(t)
    return out


# ----------------------------------------------------------------------------------------------
# The acceptance pane (beside the heatmap): the acceptance finding's details as bars
# ----------------------------------------------------------------------------------------------

HBARS = " ▏▎▍▌▋▊▉█"   # eighths of a cell, for horizontal bars


def hbar(frac: float | None, width: int) -> str:
    """A horizontal bar of ``width`` cells filled to ``frac`` (0..1) in eighths; blank for None."""
    if frac is None or not math.isfinite(frac) or width <= 0:
        return " " * max(width, 0)
    eighths = round(max(0.0, min(1.0, frac)) * width * 8)
    full, part = divmod(eighths, 8)
    return ("█" * full + (HBARS[part] if part else "")).ljust(width)


def _bar(frac: float | None, width: int, style: str) -> Text:
    """``hbar`` with the unfilled part drawn as a dim track (a 0% bar is still seen as a bar)."""
    b = hbar(frac, width)
    filled = b.rstrip(" ") if frac is not None else ""
    return Text.assemble((filled, style), ("·" * (width - len(filled)), "dim"))


def acceptance_finding(res: DiffResult | None) -> Finding | None:
    """The diff's acceptance finding, when it has one with its details."""
    from ..findings import AcceptanceDetails

    if res is None:
        return None
    return next((f for f in res.findings if f.kind == Kind.ACCEPTANCE and isinstance(f.details, AcceptanceDetails)),
                None)


_VERDICT_WORDS = {"upstream": ("a divergence upstream", "bold red"), "target": ("the target's predictions differ", "bold red"),
                  "draft_after_fc": ("the draft after fc differs", "bold red"),
                  "close": ("predictions close: no verdict", "yellow"), "incomplete": ("not all compared: no verdict", "yellow")}


def acceptance_lines(res: DiffResult | None, width: int) -> list[Text]:
    """The acceptance pane: the mean acceptance length, a bar per draft position (share of the
    verify steps reaching it that accepted its token), a bar per regime of the draft's
    teacher-forced top-1 agreement with the target, and the verdict in a few words. All from the
    acceptance finding's details (:class:`tensordiff.details.AcceptanceDetails`); [] without one."""
    from ..findings import AcceptanceDetails

    f = acceptance_finding(res)
    d = f.details if f is not None else None
    if f is None or res is None or not isinstance(d, AcceptanceDetails):
        return []
    g, s = SEVERITY_GLYPH.get(f.severity, ("?", ""))
    bar_w = max(4, width - 15)
    out = [Text.assemble((f"{g} ", s), (f"finding #{f.index} on ", "dim"), (d.side, "bold"))]
    if d.accept_length is not None:
        out.append(Text.assemble(("length ", "dim"), (f"{d.accept_length:.2f}", "bold"), (f" / {d.steps} steps", "dim")))
    if d.per_position:
        out.append(Text("accepted by draft pos.", style="bold"))
        for p in d.per_position:
            rate = p.get("rate")
            style = "green" if rate is not None and rate >= 0.5 else "red"
            out.append(Text.assemble(f"{p['position']:>2} ", _bar(rate, bar_w, style),
                                     f" {percent(rate, 0):>4}", (f" {p['accepted']}/{p['reached']}", "dim"), no_wrap=True))
    if d.teacher:
        out.append(Text("draft top-1 = target", style="bold"))
        out.append(Text(f"teacher-forced, {d.side}", style="dim"))
        lab = max(len(r) for r in d.teacher)
        lab = min(lab, 9)
        w = max(4, width - lab - 7)
        for reg, e in d.teacher.items():
            top1 = e.get("top1")
            style = "green" if top1 is not None and top1 >= 0.5 else "red"
            out.append(Text.assemble(f"{reg[:lab]:<{lab}} ", _bar(top1, w, style), f" {percent(top1, 0):>4}", no_wrap=True))
    if d.cross:
        out.append(Text(f"{res.side_a} vs {res.side_b} top-1", style="bold"))
        for name, c in d.cross.items():
            out.append(Text.assemble(f"{name:<12}", f" {percent(c.get('top1'), 0):>4}",
                                     (f" {c.get('tokens', 0)} tok", "dim"), no_wrap=True))
    if d.verdict == "agree":
        words, style = (("wiring agrees; the draft disagrees", "bold yellow") if d.draft_disagrees
                        else ("wiring and draft agree", "green"))
    else:
        words, style = _VERDICT_WORDS.get(d.verdict, (d.verdict, ""))
        if d.verdict == "upstream" and d.upstream_index is not None:
            words += f" (#{d.upstream_index})"
    out.append(Text(words, style=style))
    return out


