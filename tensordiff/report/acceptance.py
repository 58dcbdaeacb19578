"""The acceptance section of the text report: per draft position, per regime, and A against B
(from the acceptance finding's details, :mod:`tensordiff.acceptance`)."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from ..findings import AcceptanceDetails, DiffResult, Kind
from ..fmt import number, percent


def print_acceptance(res: DiffResult, console: Console) -> None:
    f = next((f for f in res.findings if f.kind == Kind.ACCEPTANCE), None)
    if f is None or not isinstance(f.details, AcceptanceDetails):
        return
    d = f.details
    if d.per_position:
        t = Table(title=f"acceptance by draft position ({d.side}: {d.steps} verify steps, mean acceptance length "
                        f"{number(d.accept_length)})", title_justify="left", show_edge=False)
        for col in ("draft position", "steps reaching it", "accepted", "rate", "top-1 = target", "target log-prob",
                    "top-k overlap", "KL(target||draft) >="):
            t.add_column(col)
        for p in d.per_position:
            t.add_row(str(p["position"]), str(p["reached"]), str(p["accepted"]), percent(p["rate"]), percent(p["top1"]),
                      number(p["target_logprob"]), percent(p.get("overlap")), number(p.get("kl_lb")))
        console.print(t)
    for side, teach in ((d.side, d.teacher), (d.side_a if d.side == d.side_b else d.side_b, d.teacher_other)):
        if not teach:
            continue
        t = Table(title=f"draft vs target, teacher-forced (draft position 0) on {side}, by regime", title_justify="left",
                  show_edge=False)
        for col in ("regime", "draft rows", "top-1 agree", "top-k overlap", "KL(target||draft) >="):
            t.add_column(col)
        for reg, e in teach.items():
            t.add_row(reg, str(e["rows"]), percent(e["top1"]), percent(e["overlap"]), number(e["kl_lb"]))
        console.print(t)
    if d.cross:
        console.print(f"{d.side_a} vs {d.side_b}: " + "; ".join(
            f"{name} top-1 equal on {percent(c['top1'])} of {c['tokens']} tokens, KL >= {number(c['kl_lb'])}"
            for name, c in d.cross.items()))
