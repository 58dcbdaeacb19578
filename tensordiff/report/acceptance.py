"""The acceptance section of the text report: per draft position, per regime, and A against B
(from the acceptance finding's details, :mod:`tensordiff.acceptance`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypedDict

from rich.box import Box
from rich.console import Console
from rich.table import Table

from ..findings import AcceptanceDetails, DiffResult, Kind
from ..fmt import number, percent


#: spaced so that a narrow table wraps the header by words instead of cutting it
KL = "KL(target || draft) >="


class TableStyle(TypedDict, total=False):
    """The keywords of a rich ``Table`` that its compact form sets."""

    box: Box | None
    padding: tuple[int, int]
    collapse_padding: bool
    header_style: str


#: a table without a box, one space between columns: the form a table takes where its boxed one is too wide
COMPACT: TableStyle = {"box": None, "padding": (0, 1), "collapse_padding": True, "header_style": "bold"}
BOXED: TableStyle = {}


def _table(console: Console, title: str, cols: tuple[str, ...], rows: Sequence[tuple[str, ...]]) -> Table:
    """The table, boxed where it fits the console, else without a box: a header is then wrapped by
    words, never cut."""
    from rich.measure import Measurement

    for compact in (False, True):
        t = Table(title=title, title_justify="left", show_edge=False,
                  **(COMPACT if compact else BOXED))
        for col in cols:
            t.add_column(col)
        for r in rows:
            t.add_row(*r)
        if Measurement.get(console, console.options, t).minimum <= console.width and (
                compact or Measurement.get(console, console.options.update_width(1 << 16), t).maximum <= console.width):
            break
    return t


def print_acceptance(res: DiffResult, console: Console) -> None:
    f = next((f for f in res.findings if f.kind == Kind.ACCEPTANCE), None)
    if f is None or not isinstance(f.details, AcceptanceDetails):
        return
    d = f.details
    if d.per_position:
        rows: list[tuple[str, ...]] = [
            (str(p["position"]), str(p["reached"]), str(p["accepted"]), percent(p["rate"]), percent(p["top1"]),
             number(p["target_logprob"]), percent(p.get("overlap")), number(p.get("kl_lb"))) for p in d.per_position]
        console.print(_table(console, f"acceptance by draft position ({d.side}: {d.steps} verify steps, mean acceptance "
                                      f"length {number(d.accept_length)})",
                             ("draft position", "steps reaching it", "accepted", "rate", "top-1 = target",
                              "target log-prob", "top-k overlap", KL), rows))
    for side, teach in ((d.side, d.teacher), (d.side_a if d.side == d.side_b else d.side_b, d.teacher_other)):
        if not teach:
            continue
        rows = [(reg, str(e["rows"]), percent(e["top1"]), percent(e["overlap"]), number(e["kl_lb"]))
                for reg, e in teach.items()]
        console.print(_table(console, f"draft vs target, teacher-forced (draft position 0) on {side}, by regime",
                             ("regime", "draft rows", "top-1 agree", "top-k overlap", KL), rows))
    if d.cross:
        console.print(f"{d.side_a} vs {d.side_b}: " + "; ".join(
            f"{name} top-1 equal on {percent(c['top1'])} of {c['tokens']} tokens, KL >= {number(c['kl_lb'])}"
            for name, c in d.cross.items()))
