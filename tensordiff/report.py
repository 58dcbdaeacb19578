"""Human-readable reports (rich) for ``info`` and ``diff``. The first line of a diff report is the
first-divergence sentence, so ``tensordiff diff A B | head -1`` is a useful CI log line."""

from __future__ import annotations

import json
import os
import sys
from importlib import resources

from rich.console import Console
from rich.table import Table
from rich.text import Text

from .findings import DiffResult, Severity
from .fmt import SEVERITY_GLYPH, number


def diff_schema() -> dict:
    """The JSON Schema of ``tensordiff diff --json`` (shipped as package data; docs/json.md)."""
    return json.loads((resources.files("tensordiff") / "schemas" / "diff.schema.json").read_text(encoding="utf-8"))


def make_console(file=None) -> Console:
    file = file or sys.stdout
    tty = hasattr(file, "isatty") and file.isatty()
    # rich honours NO_COLOR itself; off a terminal we print plain text at a stable width
    width = None if tty else int(os.environ.get("COLUMNS", "120") or 120)
    # markup off: slot labels like [embed, layer3] and user metadata are data, not rich markup
    return Console(file=file, width=width, no_color=bool(os.environ.get("NO_COLOR")) or None,
                   highlight=False, soft_wrap=False, force_terminal=None, markup=False)


def print_diff(res: DiffResult, console: Console, *, max_findings: int = 25, worst: int = 10) -> None:
    first = res.first_divergence
    style = "bold red" if first else ("bold green" if res.verdict == "agree" else "bold yellow")
    console.print(Text(res.headline(), style=style))
    console.print(f"verdict: {res.verdict.upper()} (exit {res.exit_code}); {res.compared} of {len(res.pairs)} tensors "
                  f"compared  A={res.path_a} [{res.side_a}]  B={res.path_b} [{res.side_b}]")
    if first is not None and first.tensor is not None and first.position is not None:
        console.print(f"first divergence at: tensor {first.tensor}"
                      + (f" slot {first.slot}" if first.slot is not None else "")
                      + f", seq {first.seq}, position {first.position}"
                      + (f" (B position {first.position_b})" if first.position_b not in (None, first.position) else "")
                      + f", token {first.token}, regime {first.regime}")

    if res.slot_table:
        t = Table(title="slots", title_justify="left", show_edge=False)
        for col in ("tensor", "slot", f"{res.side_a} claims", f"{res.side_a} holds", f"{res.side_b} claims",
                    f"{res.side_b} holds", "score", "margin", "cos mean", "verdict"):
            t.add_column(col)
        for r in res.slot_table:
            held_b = r.held_b or "?"
            if r.offset_b:
                held_b += f" (pos {r.offset_b:+d})"
            vstyle = "green" if r.verdict == "ok" else "red"
            t.add_row(r.tensor, str(r.slot), r.claimed_a or "-", r.held_a or "?", r.claimed_b or "-", held_b,
                      number(r.score_b), number(r.margin_b), number(r.cos_mean), Text(r.verdict, style=vstyle))
        console.print(t)

    divs = [f for f in res.findings if f.severity == Severity.DIVERGENCE]
    warns = [f for f in res.findings if f.severity == Severity.WARNING]
    infos = [f for f in res.findings if f.severity == Severity.INFO]
    if res.findings:
        # divergences first, then warnings, then notes, each in forward order: --max-findings
        # never hides a divergence behind notes
        console.print(Text(f"findings ({len(divs)} divergences, {len(warns)} warnings, {len(infos)} notes), "
                           "divergences first, each group in forward order:", style="bold"))
        for f in (divs + warns + infos)[:max_findings]:
            mark, style = SEVERITY_GLYPH[f.severity]
            note = res.inheritance_note(f)
            inh = f"  [{note}]" if note else ""
            console.print(f" {mark} #{f.index} {f.kind}: {f.message}{inh}", style=style)
        if len(res.findings) > max_findings:
            console.print(f"   ... {len(res.findings) - max_findings} more (see --json)")

    nseq = len(res.sequences)
    shift_txt = ", ".join(f"shift {k}: {v}" for k, v in sorted(res.shifts.items(), key=lambda kv: int(kv[0])))
    gap_tokens = sum(g["count"] for g in res.gaps)
    console.print(f"tokens: {res.tokens_aligned} aligned in {nseq} sequence pairs ({shift_txt or 'none'}); "
                  f"gaps: {gap_tokens} tokens on one side only ({len(res.gaps)} ranges), not counted as divergence")

    t = Table(title="tensors", title_justify="left", show_edge=False)
    for col in ("tensor", "slot", "tokens", "cos min", "rel max", "max abs", "failing", "NaN/Inf A/B", "tol cos / rel"):
        t.add_column(col)
    for p in res.pairs:
        for s in range(p.slots):
            fail = p.failing[s] if p.failing else 0
            tol = p.tolerance[s] if p.tolerance else {}
            t.add_row(p.label if s == 0 else "", str(s) if p.slots > 1 else "", str(p.tokens),
                      number(p.cos_min[s] if p.cos_min else None), number(p.rel_max[s] if p.rel_max else None),
                      number(p.maxabs[s] if p.maxabs else None),
                      Text(str(fail), style="red" if fail else "green"),
                      f"{p.nonfinite_a[s] if p.nonfinite_a else 0}/{p.nonfinite_b[s] if p.nonfinite_b else 0}",
                      f"{tol.get('min_cos', 0):g} / {tol.get('max_rel', 0):g}" + ("" if tol.get("source") == "default" else f" ({tol.get('source')})") if tol else "-")
    console.print(t)

    regimes: dict = {}
    for p in res.pairs:
        for name, e in p.by_regime.items():
            agg = regimes.setdefault(name, {"tokens": 0, "failing": 0, "rel_max": 0.0})
            agg["tokens"] += e["tokens"]
            agg["failing"] += e["failing"]
            agg["rel_max"] = max(agg["rel_max"], e["rel_max"])
    if len(regimes) > 1:
        console.print("by regime (B): " + "; ".join(
            f"{k}: {v['failing']}/{v['tokens']} rows failing, rel max {number(v['rel_max'])}" for k, v in regimes.items()))

    if res.worst_tokens and worst and (first is not None or any(w["rel"] > 0 for w in res.worst_tokens)):
        t = Table(title="worst tokens", title_justify="left", show_edge=False)
        for col in ("tensor", "slot", "seq", "pos", "token", "regime", "rel", "cos"):
            t.add_column(col)
        for w in res.worst_tokens[:worst]:
            t.add_row(w["tensor"], str(w["slot"]), str(w["seq"]), str(w["position"]), str(w["token"]), w["regime"],
                      number(w["rel"]), number(w["cos"]))
        console.print(t)


def print_info(s: dict, console: Console) -> None:
    m = s["model"]
    console.print(Text(f"{s['path']}: tensordiff trace v{s['schema']}, side {s['side']}", style="bold"))
    if s.get("recovered"):
        console.print(Text(s["recovered"], style="yellow"))
    console.print(f"producer: {s['producer'] or '-'}   created: {s['created'] or '-'}   complete: {s['complete']}")
    console.print("model: " + (", ".join(f"{k}={v}" for k, v in m.items()) or "-"))
    if s["versions"]:
        console.print("versions: " + ", ".join(f"{k} {v}" for k, v in s["versions"].items()))
    if s["user_meta"]:
        console.print("meta: " + ", ".join(f"{k}={v}" for k, v in s["user_meta"].items()))
    tk = s["tokens"]
    console.print(f"tokens: {tk['rows']} rows in {tk['sequences']} sequences; regimes: "
                  + (", ".join(f"{k} {v}" for k, v in tk["regimes"].items()) or "-")
                  + f"; sketches: d={s['sketch']['dim']} seed={s['sketch']['seed']}")
    seqs = s["sequences"]
    if seqs:
        shown = ", ".join(f"{q['key']} ({q['rows']} rows, pos {q['positions'][0]}-{q['positions'][1]})" for q in seqs[:5])
        more = f" ... +{len(seqs) - 5} more" if len(seqs) > 5 else ""
        console.print(f"sequences: {shown}{more}")
    t = Table(title="tensors (forward order)", title_justify="left", show_edge=False)
    for col in ("name", "kind", "state / slots", "shape", "dtype", "stored", "role"):
        t.add_column(col)
    for e in s["tensors"]:
        if e.get("slot_labels"):
            st = "[" + ", ".join(e["slot_labels"]) + "]"
            if e.get("raw_ids") is not None:
                st += f" ids {e['raw_ids']}"
            if e.get("convention"):
                st += f" ({e['convention']})"
        else:
            st = e["label"]
        if e.get("token_offset"):
            st += f", row t ~ token t+{e['token_offset']}"
        stored = "+".join(x for x, on in (("values", e["values"]), ("sketch", e["sketch"])) if on)
        t.add_row(e["name"], e["kind"], st, "x".join(map(str, e["shape"])), e["dtype"], stored, e["role"] or "-")
    console.print(t)
