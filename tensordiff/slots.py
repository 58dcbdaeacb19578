"""From what each side's slot holds (two :class:`~tensordiff.identity.IdentityVerdict`) and what
each side claims (its slot labels) to the slot table row and the findings, naming the side at fault.

- A's slot is the reference: what it holds is what was expected (else what A claims).
- When A's data disagree with A's own label and B holds what A claims, A is at fault: "train
  labels slot 0 of draft_input layer5 but it holds layer2" (a divergence that names A).
- When each side holds what it claims and the claims differ, the finding says what each side
  feeds (the sides disagree; neither trace is wrong about itself).
- Otherwise B is judged against the expectation: another state (``holds``), the right or another
  state at another scale (``scaled``), no recorded state (``no_state``), or no way to tell the
  closest states apart (``ambiguous``: a warning while the expected state is one of them, a
  divergence when it is not). A side's label that disagrees with its data is a warning.

No I/O; :mod:`tensordiff.diff` calls :func:`judge_slot` with a factory that places findings.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from .details import IdentityDetails, LabelDetails
from .findings import Finding, Kind, Severity, SlotRow
from .identity import IdentityVerdict

#: (kind, tensor side "a"/"b", details, severity) -> a Finding at the slot's first failing token
Place = Callable[[Kind, str, IdentityDetails, Severity], Finding]


@dataclass
class SlotJudgement:
    row: SlotRow
    identity: Finding | None = None          # the finding that explains the slot's numerics, if any
    findings: list[Finding] = field(default_factory=list)


def _held(v: IdentityVerdict | None) -> tuple[str, int] | None:
    return v.held if v is not None else None


def _details(v: IdentityVerdict, side: str, side_name: str, subject: str, **kw: object) -> IdentityDetails:
    d = IdentityDetails(outcome=v.outcome, subject=subject, side=side, side_name=side_name, held=v.best,
                        offset=v.offset, scale=v.scale, score=v.score, margin=v.margin, runner_up=v.runner_up,
                        closest=v.closest, cos=v.evidence.cos, tied=list(v.tied), candidates=list(v.candidates),
                        evidence=v.evidence)
    for k, val in kw.items():
        setattr(d, k, val)
    return d


def judge_slot(tensor_b: str, slot: int, claimed_a: str | None, claimed_b: str | None,
               ida: IdentityVerdict | None, idb: IdentityVerdict, sides: tuple[str, str], failing: bool,
               cos_mean: float | None, rel_max: float | None, place: Place, order_a: float, order_b: float,
               tensor_a: str) -> SlotJudgement:
    ha, hb = _held(ida), _held(idb)
    expected = ha[0] if ha else claimed_a
    subject = f"slot {slot} of {tensor_b}"
    row = SlotRow(tensor=tensor_b, slot=slot, claimed_a=claimed_a, claimed_b=claimed_b, held_a=ha[0] if ha else None,
                  held_b=hb[0] if hb else None, score_b=idb.score, margin_b=idb.margin, offset_b=hb[1] if hb else 0,
                  candidates_b=list(idb.candidates), expected=expected, cos_mean=cos_mean, rel_max=rel_max,
                  offset_a=ha[1] if ha else 0, outcome_a=ida.outcome if ida else None, outcome_b=idb.outcome)
    j = SlotJudgement(row)
    common = {"claimed_a": claimed_a, "claimed_b": claimed_b, "held_a": row.held_a}
    a_scaled = ida is not None and ida.outcome == "scaled"
    b_ok_for_claim = claimed_a is not None and hb == (claimed_a, 0) and idb.outcome == "holds"
    a_wrong = ida is not None and ha is not None and claimed_a is not None and (ha != (claimed_a, 0) or a_scaled)
    if a_wrong and b_ok_for_claim and ida is not None:
        # A's data disagree with A's label, and B holds what A claims: A is at fault
        row.verdict, row.expected = "wrong label", claimed_a
        j.identity = place(Kind.SLOT_IDENTITY, "a", _details(ida, "a", sides[0], subject, outcome="mislabeled",
                                                            claimed=claimed_a, expected=claimed_a, **common),
                           Severity.DIVERGENCE)
        j.findings.append(j.identity)
        return j
    expected_key = (ha if ha is not None else ((claimed_a, 0) if claimed_a else None))
    b_matches = hb is not None and hb == expected_key and idb.outcome == "holds" and not a_scaled
    if expected_key is not None and not b_matches and idb.outcome != "none":
        sev = Severity.DIVERGENCE
        if idb.outcome == "holds" or idb.outcome == "scaled":
            row.verdict = "scaled" if idb.outcome == "scaled" and hb == expected_key else "wrong state"
        elif idb.outcome == "no_state":
            row.verdict = "unknown state"
            if ida is not None and ida.outcome == "no_state":
                sev = Severity.WARNING  # both sides hold the same unrecorded state: numerics decide
        else:  # ambiguous
            row.verdict = "ambiguous"
            tie = {idb.closest, *[t for t in idb.tied]}
            if expected in tie:
                sev = Severity.WARNING
        det = _details(idb, "b", sides[1], subject, expected=expected, **common)
        if (ida is not None and ida.outcome == "holds" and ha == (claimed_a, 0) and idb.outcome == "holds"
                and hb == (claimed_b, 0) and claimed_b is not None):
            # each side holds what it claims and the claims differ: neither trace is wrong about
            # itself, the two pipelines feed different states; say what each feeds
            det.side_name_a = sides[0]
        f = place(Kind.SLOT_IDENTITY, "a", det, sev)
        j.findings.append(f)
        if sev == Severity.DIVERGENCE:
            j.identity = f
    elif failing:
        row.verdict = "numeric drift"
    # A's own slot: a problem of the reference that is not B's fault is said, as a warning
    if ida is not None and ida.outcome in ("no_state", "ambiguous", "scaled") and j.identity is None:
        j.findings.append(place(Kind.SLOT_IDENTITY, "a", _details(ida, "a", sides[0], subject, expected=claimed_a,
                                                                 **common), Severity.WARNING))
    for name, claimed, held, tname, order in ((sides[0], claimed_a, ha, tensor_a, order_a),
                                              (sides[1], claimed_b, hb, tensor_b, order_b)):
        if claimed and held and claimed != held[0]:
            j.findings.append(Finding(Kind.LABEL_MISMATCH, Severity.WARNING, tensor=tname, slot=slot, order=order,
                                      details=LabelDetails(claimed=claimed, held=held[0], side=name)))
    return j
