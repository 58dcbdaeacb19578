"""Human-readable reports (rich) for ``info`` and ``diff``. The first line of a diff report is the
first-divergence sentence, so ``tensordiff diff A B | head -1`` is a useful CI log line."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Mapping
from importlib import resources
from typing import IO, TYPE_CHECKING, Any, TextIO, cast

from rich.console import Console
from rich.table import Table
from rich.text import Text

from ..findings import DiffResult, Finding, RegimeStats, Severity, regime_words
from ..fmt import SEVERITY_GLYPH, number, one_minus_cos
from . import opgraph
from .acceptance import BOXED, COMPACT, print_acceptance
from ..safety import guard_console, guarded, sanitize_record, sanitize_tree

if TYPE_CHECKING:
    from ..token_text import TokenText
    from ..trace.summary_types import TraceSummary


def diff_schema() -> dict[str, Any]:
    """The JSON Schema of ``tensordiff diff --json`` (shipped as package data; docs/json.md)."""
    path = resources.files("tensordiff") / "schemas" / "diff.schema.json"
    schema: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return schema


class _Console(Console):
    def on_broken_pipe(self) -> None:
        """The reader left (``| head -1``): stop writing and let the caller keep its exit code
        (rich's own handler exits 1, which breaks pipelines under ``pipefail`` on an agreeing pair)."""
        self.quiet = True
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise BrokenPipeError


class _TrimmedLines:
    """A text file that drops the spaces rich pads each line with (table cells, wrapped text) before
    the line break: off a terminal a report is read by ``grep``, ``diff`` and CI logs, where that
    padding is noise. Text after the last line break waits for the next write or :meth:`flush`."""

    def __init__(self, file: TextIO):
        self._file = file
        self._tail = ""

    def write(self, text: str) -> int:
        head, sep, tail = (self._tail + text).rpartition("\n")
        self._tail = tail
        if sep:
            self._file.write("\n".join(line.rstrip(" ") for line in head.split("\n")) + "\n")
        return len(text)

    def flush(self) -> None:
        if self._tail:
            self._file.write(self._tail)
            self._tail = ""
        self._file.flush()

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        return self._file.fileno()

    @property
    def encoding(self) -> str:
        encoding: str = getattr(self._file, "encoding", "utf-8")
        return encoding


def make_console(file: TextIO | None = None) -> Console:
    given = file or sys.stdout
    tty = hasattr(given, "isatty") and given.isatty()
    # rich types its file as IO[str]; it calls only what _TrimmedLines has (write, flush, isatty,
    # fileno, encoding)
    out = given if tty else cast(IO[str], _TrimmedLines(given))
    # rich honours NO_COLOR itself; off a terminal we print plain text at a stable width
    width = None if tty else int(os.environ.get("COLUMNS", "120") or 120)
    # markup and emoji codes off: slot labels like [embed, layer3], paths and user metadata are data,
    # not rich markup (a directory named :smile: stays that name)
    console = _Console(file=out, width=width, no_color=bool(os.environ.get("NO_COLOR")) or None,
                       highlight=False, soft_wrap=False, force_terminal=None, markup=False, emoji=False)
    guard_console(console)  # no control character from a file reaches the terminal
    return console


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _sentence(f: Finding) -> str:
    """``kind: sentence``, without saying the kind twice when the sentence starts with it (gaps)."""
    return f.message if f.message.startswith(f"{f.kind}:") else f"{f.kind}: {f.message}"


def _fits(console: Console, table: Table) -> bool:
    """Whether the table's natural width (no cell cut or wrapped) fits the console."""
    from rich.measure import Measurement

    return Measurement.get(console, console.options.update_width(1 << 16), table).maximum <= console.width


def _slot_table(res: DiffResult) -> Table:
    t = Table(title="slots", title_justify="left", show_edge=False)
    for col in ("tensor", "slot", f"{res.side_a} claims", f"{res.side_a} holds", f"{res.side_b} claims",
                f"{res.side_b} holds", f"{res.side_b} score", f"{res.side_b} margin", "1-cos mean", "verdict"):
        t.add_column(col, no_wrap=True)
    for r in res.slot_table:
        held_b = (r.held_b or "?") + (f" (pos {r.offset_b:+d})" if r.offset_b else "")
        t.add_row(r.tensor, str(r.slot), r.claimed_a or "-", r.held_a or "?", r.claimed_b or "-", held_b,
                  number(r.score_b), number(r.margin_b), one_minus_cos(r.cos_mean),
                  Text(r.verdict, style="green" if r.verdict == "ok" else "red"))
    return t


def _slot_lines(res: DiffResult) -> Table:
    g = Table.grid(padding=(0, 1))
    g.add_column(no_wrap=True)
    g.add_column()
    for r in res.slot_table:
        held_b = (r.held_b or "?") + (f" (pos {r.offset_b:+d})" if r.offset_b else "")
        g.add_row(f" {r.tensor}[{r.slot}]", Text.assemble(
            (r.verdict, "green" if r.verdict == "ok" else "red"),
            f": {res.side_a} claims {r.claimed_a or '-'}, holds {r.held_a or '?'}; {res.side_b} claims "
            f"{r.claimed_b or '-'}, holds {held_b} ({res.side_b} score {number(r.score_b)}, margin "
            f"{number(r.margin_b)}); 1 - cos mean {one_minus_cos(r.cos_mean)}"))
    return g


def _tol_one_minus_cos(tol: Mapping[str, Any]) -> str:
    """A tolerance's cosine limit as ``1 - cos`` allowed: a floor of 0.99999237 printed as a
    cosine reads "1", as if no error were allowed."""
    return f"{max(0.0, 1.0 - float(tol.get('min_cos', 0))):.2g}"


def _tensor_table(res: DiffResult, narrow: bool) -> Table:
    """Per tensor and slot; ``narrow``: name[slot] in one column, short labels, no box."""
    t = Table(title="tensors", title_justify="left", show_edge=False,
              **(COMPACT if narrow else BOXED))
    sources = {str(tol.get("source")) for p in res.pairs for tol in p.tolerance if tol}
    shared = narrow and len(sources) == 1 and "default" not in sources   # said once, in the header
    tol_head = f"tol 1-cos / rel ({next(iter(sources))})" if shared else "tol 1-cos / rel"
    cols = ("tensor", "tokens", "1-cos max", "rel max", "max abs", "fail", "NaN A/B", tol_head) if narrow else (
        "tensor", "slot", "tokens", "1-cos max", "rel max", "max abs", "failing", "NaN A/B", tol_head)
    for col in cols:
        t.add_column(col, no_wrap=not col.startswith("tol"))
    sep = " / "   # spaced: a narrow column wraps between the two limits instead of cutting one
    for p in res.pairs:
        ap = "≈" if p.basis == "sketch" else ""   # computed on sketches, not full values
        for s in range(p.slots):
            fail = p.failing[s] if p.failing else 0
            tol = p.tolerance[s] if p.tolerance else {}
            name = ([f"{p.label}[{s}]" if p.slots > 1 else p.label] if narrow
                    else [p.label if s == 0 else "", str(s) if p.slots > 1 else ""])
            src = "" if not tol or tol.get("source") == "default" or shared else f" ({tol.get('source')})"
            t.add_row(*name, str(p.tokens),
                      ap + one_minus_cos(p.cos_min[s] if p.cos_min else None),
                      ap + number(p.rel_max[s] if p.rel_max else None),
                      ap + number(p.maxabs[s] if p.maxabs else None),
                      Text(str(fail), style="red" if fail else "green"),
                      f"{p.nonfinite_a[s] if p.nonfinite_a else 0}/{p.nonfinite_b[s] if p.nonfinite_b else 0}",
                      f"{_tol_one_minus_cos(tol)}{sep}{tol.get('max_rel', 0):.3g}{src}" if tol else "-")
    return t


def print_diff(res: DiffResult, console: Console, *, max_findings: int = 25, worst: int = 10,
               token_text: TokenText | None = None) -> None:
    """The text report. Readable at 80 columns: a table that does not fit becomes a compact one (the
    tensors) or one wrapped line per row (the slots: a held state is never cut); findings wrap by
    words under their mark. ``token_text``
    (a :class:`tensordiff.token_text.TokenText`) adds the tokens as text; numbers computed on
    sketches are marked ``≈``."""
    tt: Callable[[int | None], str] = token_text or (lambda _t: "")
    # the typed result with every string from the files (paths, sides, labels, sequence names) made
    # safe to print before any is laid out (a newline in a name must not start a line of its own),
    # and whatever reaches the console some other way escaped as it is rendered
    with guarded(console):
        _print_diff(sanitize_record(res), console, max_findings, worst, tt, bool(token_text))


def _print_diff(res: DiffResult, console: Console, max_findings: int, worst: int, tt: Callable[[int | None], str],
                token_text: bool) -> None:
    first = res.first_divergence
    style = "bold red" if first else ("bold green" if res.verdict == "agree" else "bold yellow")
    # into a pipe or a file the headline is one line whatever the width: the first line is what
    # `| head -1` and CI logs read; on a terminal it wraps by words like the rest
    console.print(Text(res.headline(), style=style), soft_wrap=not console.is_terminal)
    named = (res.side_a, res.side_b) == ("A", "B")   # two traces of one side, named apart
    console.print(f"verdict: {res.verdict.upper()} (exit {res.exit_code}); {res.compared} of {len(res.pairs)} tensors "
                  f"compared  A={res.path_a}{'' if named else f' [{res.side_a}]'}  "
                  f"B={res.path_b}{' (both traces of one side)' if named else f' [{res.side_b}]'}")
    if first is not None and first.tensor is not None and first.position is not None:
        console.print(f"first divergence at: tensor {first.tensor}"
                      + (f" slot {first.slot}" if first.slot is not None else "")
                      + f", seq {first.seq}, position {first.position}"
                      + (f" (B position {first.position_b})" if first.position_b not in (None, first.position) else "")
                      + f", token {first.token}" + (f" {tt(first.token)}" if tt(first.token) else "")
                      + f", regime {regime_words(first.regime, first.regime_a)}")
    for layer in opgraph.zoomed_layers(res):   # a zoomed layer, op by op (✓ agrees, ✗ diverges, ✗! the first)
        ln = opgraph.line(res, layer)
        if ln:
            console.print(Text(ln))

    if res.slot_table:
        t = _slot_table(res)
        if _fits(console, t):
            console.print(t)
        else:   # one wrapped line per slot: a held state is never cut
            console.print(Text("slots:", style="bold"))
            console.print(_slot_lines(res))

    divs = [f for f in res.findings if f.severity == Severity.DIVERGENCE]
    warns = [f for f in res.findings if f.severity == Severity.WARNING]
    infos = [f for f in res.findings if f.severity == Severity.INFO]
    counts = f"{_plural(len(divs), 'divergence')}, {_plural(len(warns), 'warning')}, {_plural(len(infos), 'note')}"
    if res.findings and max_findings <= 0:
        console.print(Text(f"findings: {counts} (none listed: --max-findings {max_findings}; see --json)", style="bold"))
    elif res.findings:
        # divergences first, then warnings, then notes, each in forward order: --max-findings
        # never hides a divergence behind notes
        console.print(Text(f"findings ({counts}), divergences first, each group in forward order:", style="bold"))
        g = Table.grid(padding=(0, 1))   # the sentence wraps by words, under itself
        g.add_column(no_wrap=True)       # the mark, in one column whatever the number's width
        g.add_column(no_wrap=True)
        g.add_column()
        for f in (divs + warns + infos)[:max_findings]:
            mark, style = SEVERITY_GLYPH[f.severity]
            note = res.inheritance_note(f)
            inh = f"  [{note}]" if note else ""
            g.add_row(Text(f"  {mark}", style=style), Text(f"#{f.index}", style=style),
                      Text(f"{_sentence(f)}{inh}", style=style))
        console.print(g)
        if len(res.findings) > max_findings > 0:
            console.print(f"   ... {len(res.findings) - max_findings} more (see --json)")

    print_acceptance(res, console)

    nseq = len(res.sequences)
    shift_txt = ", ".join(f"shift {k}: {v}" for k, v in sorted(res.shifts.items(), key=lambda kv: int(kv[0])))
    gap_tokens = sum(g.count for g in res.gaps)
    gaps = (f"gaps: {_plural(gap_tokens, 'token')} on one side only ({_plural(len(res.gaps), 'range')}), "
            "not counted as divergence") if res.gaps else "gaps: none"
    console.print(f"tokens: {res.tokens_aligned} aligned in {_plural(nseq, 'sequence pair')} ({shift_txt or 'none'}); "
                  + gaps)

    t = _tensor_table(res, narrow=False)
    console.print(t if _fits(console, t) else _tensor_table(res, narrow=True))
    if any(p.basis == "sketch" for p in res.pairs):
        console.print("≈ computed on the traces' sketches, not full values: 1 - cos close to the true one, max abs "
                      "and rel err of the sketch")

    regimes: dict[str, RegimeStats] = {}
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
        cols = ("tensor", "slot", "seq", "pos", "token") + (("text",) if token_text else ()) + ("regime", "rel", "1-cos")
        for col in cols:
            t.add_column(col, no_wrap=col != "text")
        sketch = {p.name_a for p in res.pairs if p.basis == "sketch"}
        slotted = {n for p in res.pairs if p.slots > 1 for n in (p.name_a, p.name_b, p.label)}
        for w in res.worst_tokens[:worst]:
            ap = "≈" if w["tensor"] in sketch else ""
            slot = str(w["slot"]) if w["tensor"] in slotted else ""   # a tensor without slots has none to name
            t.add_row(w["tensor"], slot, str(w["seq"]), str(w["position"]), str(w["token"]),
                      *((tt(w["token"]),) if token_text else ()), regime_words(w["regime"], w.get("regime_a")),
                      ap + number(w["rel"]), ap + one_minus_cos(w["cos"]))
        console.print(t)


def print_info(s: TraceSummary, console: Console) -> None:
    s = sanitize_tree(s)  # strings from the file made safe to print
    m = s["model"]
    console.print(Text(f"{s['path']}: tensordiff trace v{s['schema']}, side {s['side']}", style="bold"))
    if recovered := s.get("recovered"):
        console.print(Text(recovered, style="yellow"))
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
        if labels := e.get("slot_labels"):
            st = "[" + ", ".join(labels) + "]"
            if e.get("raw_ids") is not None:
                st += f" ids {e['raw_ids']}"
            if e.get("convention"):
                st += f" ({e['convention']})"
        else:
            st = e["label"]
        if e.get("token_offset"):
            st += f", row t ~ token t+{e['token_offset']}"
        stored = "+".join(x for x, on in (("values", e["values"]), ("sketch", e["sketch"])) if on)
        if e.get("values_source"):
            stored = stored.replace("values", f"values (by reference to {e['values_source']})", 1)
        if e.get("sketch_derived"):
            stored += " (sketch derived)"
        t.add_row(e["name"], e["kind"], st, "x".join(map(str, e["shape"])), e["dtype"], stored, e["role"] or "-")
    console.print(t)
