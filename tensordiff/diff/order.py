"""The order of a diff's findings, made once, when every analysis has run (:func:`order`):
divergences first, then warnings, then notes, each group in forward order; numbered in that
order (the ``#i`` every output shows, and the place in the JSON's list), each divergence marked
with the earlier one it may be inherited from.

Until then the findings are a list in the order the judge and the analyses made them; an
analysis that reads "the first divergence" reads :func:`in_order`, a sorted copy that numbers
nothing. A finding that names another by its place (the acceptance finding's upstream) names
its place in that list; :func:`order` turns it into the place in the order. Nothing here
changes a finding it is given: each comes back as a new one."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from ..findings import AcceptanceDetails, Finding, Kind, NumericDetails, Severity

_SEVERITY_RANK = {Severity.DIVERGENCE: 0, Severity.WARNING: 1, Severity.INFO: 2}


def in_order(findings: Sequence[Finding]) -> list[Finding]:
    """The findings sorted as :func:`order` shows them (divergences first, each group in forward
    order), the same objects, not numbered."""
    forward = sorted(findings, key=lambda f: f.sort_key())
    return sorted(forward, key=lambda f: _SEVERITY_RANK[f.severity])   # stable: forward order within a group


def order(findings: Sequence[Finding]) -> list[Finding]:
    """The findings as the result shows them: :func:`in_order`, numbered, inheritance marked, and
    the places findings name remapped from ``findings`` to the order."""
    place = {id(f): i for i, f in enumerate(findings)}
    forward = sorted(findings, key=lambda f: f.sort_key())   # forward order: what inheritance reads
    parent: dict[int, Finding] = {}
    divs: list[Finding] = []
    for f in forward:
        if f.severity != Severity.DIVERGENCE:
            continue
        for g in divs:
            if _inherits(f, g):
                parent[id(f)] = g
                break
        divs.append(f)
    # the order shown: --max-findings and a reader's eye never meet a note before a divergence
    shown = sorted(forward, key=lambda f: _SEVERITY_RANK[f.severity])
    index = {id(f): i for i, f in enumerate(shown)}
    at = {place[id(f)]: i for i, f in enumerate(shown)}   # place given -> place shown
    out = []
    for i, f in enumerate(shown):
        up = parent.get(id(f))
        d = f.details
        if isinstance(d, AcceptanceDetails) and d.upstream_index is not None and d.upstream_index in at:
            d = replace(d, upstream_index=at[d.upstream_index])
        out.append(replace(f, index=i, inherited_from=index[id(up)] if up is not None else None, details=d))
    return out


def _inherits(f: Finding, g: Finding) -> bool:
    """Whether divergence ``f`` may be inherited from ``g``, a divergence before it in forward order."""
    return g.kind in (Kind.TOKEN_SHIFT, Kind.PAIRING) or (g.kind == Kind.TOKEN_MISMATCH and g.seq == f.seq) or (
        f.kind in (Kind.NUMERIC, Kind.NONFINITE)
        and g.kind in (Kind.NUMERIC, Kind.NONFINITE, Kind.SLOT_IDENTITY, Kind.SIGNATURE)
        and g.order < f.order and (g.seq == f.seq and (g.position or 0) <= (f.position or 0) or _explains(g, f)))


def _share(f: Finding) -> float:
    """The share of its tokens a divergence affects (1 for a whole-state one: a wrong state, a
    median error or a scale out of the noise)."""
    d = f.details
    if isinstance(d, NumericDetails) and d.part in ("", "tokens") and d.tokens:
        return d.failing / d.tokens
    return 1.0


def _explains(g: Finding, f: Finding) -> bool:
    """A shallower divergence ``g`` explains a deeper ``f`` when it reaches as many of the tokens
    (within a factor 2), whichever sequence either fails first in: an error carried downstream
    reaches the same tokens, and honest growth does not make new ones fail."""
    return g.slot is None and _share(g) >= 0.5 * _share(f)   # a packed slot feeds no deeper state


__all__ = ["in_order", "order"]
