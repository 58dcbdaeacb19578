"""The typed data model every output reads: :class:`Finding` (with :class:`Kind`, :class:`Severity`
and one details record per kind), :class:`SlotRow`, :class:`PairStats` and :class:`DiffResult`,
their forward ordering and inheritance, their JSON form (``to_dict`` / ``from_dict``) and the one
place where a finding's sentence is made (:func:`render_sentence`).

The per-kind details records live in :mod:`tensordiff.details` (re-exported here).
Nothing here computes: the diff fills these records, the text report, the JSON and the TUI read
them. No numpy, no I/O.

Why one module of this size: every kind's sentence is rendered here beside its record, so text,
JSON, HTML and TUI say the same thing; splitting records from sentences would split that one place.
"""

from __future__ import annotations

import ast
import dataclasses
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Annotated, Any, ClassVar, Literal, Self, TypedDict

from .details import (
    AcceptanceDetails,
    Basis,
    Candidate,
    Details,
    GapDetails,
    IdentityDetails,
    LabelDetails,
    MissingDetails,
    NonfiniteDetails,
    NumericDetails,
    OneOf,
    PairingDetails,
    Ranges,
    Record,
    RecoveredDetails,
    ReplicaDetails,
    RoutingDetails,
    SignatureDetails,
    ShiftDetails,
    Side,
    TokenMismatchDetails,
    ToleranceRecord,
)
from .fmt import percent

__all__ = [
    "DETAILS",
    "SCHEMA_VERSION",
    "AcceptanceDetails",
    "Candidate",
    "Details",
    "DiffResult",
    "ErrorInfo",
    "ErrorJSON",
    "Finding",
    "Gap",
    "GapDetails",
    "IdentityDetails",
    "Kind",
    "LabelDetails",
    "MissingDetails",
    "NonfiniteDetails",
    "NumericDetails",
    "PairStats",
    "PairingDetails",
    "Record",
    "RecoveredDetails",
    "SeqPair",
    "ReplicaDetails",
    "RoutingDetails",
    "SignatureDetails",
    "Severity",
    "ShiftDetails",
    "SlotRow",
    "SlotVerdict",
    "TokenMismatchDetails",
    "Verdict",
    "display_names",
    "render_sentence",
    "regime_a_where_named",
    "regime_words",
    "where_token",
]

#: a diff's verdict: a divergence was found; every paired tensor compared and none diverges; or
#: no divergence in what could be compared, but not everything could be
Verdict = Literal["divergence", "agree", "incomplete"]
#: what the slot table says of a slot
SlotVerdict = Literal["ok", "wrong state", "wrong label", "scaled", "unknown state", "ambiguous", "numeric drift"]

#: version of the diff JSON (``tensordiff diff --json``); docs/json.md, schemas/diff.schema.json
SCHEMA_VERSION = 1
#: how acceptance.MARGIN_NOISE reads in a sentence
MARGIN_WORDS = "twice"
#: acceptance.MARGIN_NOISE: a prediction difference counts past this many times the logit noise
MARGIN_NOISE_FACTOR = 2.0
#: acceptance.SIGN_Z: a systematic margin change past this many standard errors of a sign test
SIGN_Z = 4.0
#: acceptance.UNEXPLAINED: the logit noise may be at most this many times what the final state's error moves
UNEXPLAINED = 10.0
#: start of the sentence of a divergence turned into a warning by ``--allow-failed``
ALLOWED_PREFIX = "allowed by --allow-failed"

class _StrEnum(str, Enum):
    """A str-valued enum that prints as its value (``f"{Kind.NUMERIC}"`` is ``numeric``) and
    compares equal to it (``f.kind == "numeric"``)."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)


class Kind(_StrEnum):
    TOKEN_SHIFT = "token_shift"        # side B's positions are side A's plus a constant
    TOKEN_MISMATCH = "token_mismatch"  # paired positions with different token ids on the two sides
    PAIRING = "pairing"                # a tensor pairs rows with tokens differently, or has other slots
    GAP = "gap"                        # tokens present on one side only
    MISSING = "missing"                # a tensor not compared (one side only, no common token, no basis)
    RECOVERED = "recovered"            # a trace recovered from a killed recording
    NONFINITE = "nonfinite"            # NaN/Inf in the data
    SLOT_IDENTITY = "slot_identity"    # a slot (or boundary) holds another state than expected
    LABEL_MISMATCH = "label_mismatch"  # a side's own label of a slot disagrees with what it holds
    NUMERIC = "numeric"                # drift past tolerance
    REPLICA = "replica"                # copies in a trace set (TP replicas, PP overlap) that are not equal
    ACCEPTANCE = "acceptance"          # why the draft's acceptance is what it is (tensordiff.acceptance)
    ROUTING = "routing"                # MoE routers' expert choices compared (tensordiff.routing)
    SIGNATURE = "signature"            # what kind of difference a zoomed layer's first op shows (tensordiff.signatures)


class Severity(_StrEnum):
    DIVERGENCE = "divergence"  # sets exit code 1
    WARNING = "warning"
    INFO = "info"

    @property
    def glyph(self) -> str:
        return {"divergence": "✗", "warning": "!", "info": "·"}[self.value]


#: what the token tables say comes before any tensor's finding, in this order
_TOKEN_RANK = {Kind.RECOVERED: 0, Kind.TOKEN_SHIFT: 1, Kind.TOKEN_MISMATCH: 2, Kind.GAP: 3}
# at the same place in forward order, the explanation comes before its symptoms
_KIND_RANK = {Kind.TOKEN_SHIFT: 0, Kind.TOKEN_MISMATCH: 0, Kind.PAIRING: 1, Kind.REPLICA: 1, Kind.GAP: 2,
              Kind.MISSING: 3, Kind.NONFINITE: 4, Kind.SLOT_IDENTITY: 5, Kind.LABEL_MISMATCH: 6,
              Kind.SIGNATURE: 6, Kind.NUMERIC: 7, Kind.ACCEPTANCE: 8, Kind.ROUTING: 8}


DETAILS: dict[Kind, type[Details]] = {
    Kind.TOKEN_SHIFT: ShiftDetails, Kind.TOKEN_MISMATCH: TokenMismatchDetails, Kind.PAIRING: PairingDetails, Kind.GAP: GapDetails,
    Kind.MISSING: MissingDetails, Kind.RECOVERED: RecoveredDetails, Kind.NONFINITE: NonfiniteDetails,
    Kind.SLOT_IDENTITY: IdentityDetails, Kind.LABEL_MISMATCH: LabelDetails, Kind.NUMERIC: NumericDetails,
    Kind.REPLICA: ReplicaDetails,
    Kind.ACCEPTANCE: AcceptanceDetails,
    Kind.ROUTING: RoutingDetails,
    Kind.SIGNATURE: SignatureDetails,
}




# ----------------------------------------------------------------------------------------------
# Findings and their sentences
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Finding:
    """One conclusion of a diff. ``severity``: divergence (sets exit code 1), warning, info.

    The sentence (:attr:`message`) is rendered from the kind and the details; ``text`` is only for
    findings made outside the diff (a test, another tool) that bring their own sentence.
    ``order`` (forward order of the tensor; unused by the token tables' findings) and ``index``
    (place in the sorted list, :func:`tensordiff.diff.order.order`) are internal.

    Frozen: a stage that changes a finding (a divergence allowed, set apart or explained) makes a
    new one (``dataclasses.replace``), so no stage changes what another one handed it."""

    kind: Kind
    severity: Severity
    text: str | None = None
    tensor: str | None = None
    slot: int | None = None
    order: float = -1.0
    seq: str | None = None
    position: int | None = None
    position_b: int | None = None
    token: int | None = None
    regime: str | None = None
    regime_a: str | None = None
    details: Details = field(default_factory=Details)
    inherited_from: int | None = None
    index: int = 0
    #: the ``--allow-failed`` pattern that turned this divergence into a warning (it still diverges)
    allowed_by: str | None = None

    LOCATION: ClassVar[tuple[str, ...]] = ("tensor", "slot", "seq", "position", "position_b", "token", "regime",
                                           "regime_a")

    def __post_init__(self) -> None:
        # the enums and details record from plain values (a test, the JSON): a frozen record sets them once here
        object.__setattr__(self, "kind", Kind(self.kind))
        object.__setattr__(self, "severity", Severity(self.severity))
        d: object = self.details
        if isinstance(d, dict):
            object.__setattr__(self, "details", DETAILS.get(self.kind, Details).from_dict(d))

    @property
    def message(self) -> str:
        sentence = self.text if self.text is not None else render_sentence(self)
        return sentence if self.allowed_by is None else f"{ALLOWED_PREFIX} {self.allowed_by!r}: {sentence}"

    @property
    def token_index(self) -> int | None:
        return self.details.token_index

    def sort_key(self) -> tuple[int, float, int, int, int]:
        """Where the finding goes in the report: the token tables' findings first (recovered
        traces, shifts, mismatched tokens, gaps), then by the tensor's forward order, slot, kind
        (an explanation before its symptoms) and first token."""
        ti = -1 if self.details.token_index is None else self.details.token_index
        rank = _TOKEN_RANK.get(self.kind)
        if rank is not None:
            return (0, float(rank), -1, 0, ti)
        return (1, self.order, -1 if self.slot is None else self.slot, _KIND_RANK.get(self.kind, 9), ti)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"kind": self.kind.value, "severity": self.severity.value, "message": self.message}
        for k in self.LOCATION:
            v = getattr(self, k)
            if v is not None:
                d[k] = v
        d["details"] = self.details.to_dict()
        if self.inherited_from is not None:
            d["inherited_from"] = self.inherited_from
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any], index: int = 0) -> Finding:
        kind = Kind(d["kind"])
        where: dict[str, Any] = {k: d.get(k) for k in cls.LOCATION}
        message = d.get("message")
        allowed = _allowed_by(str(message)) if message is not None else None
        f = cls(kind, Severity(d["severity"]), details=DETAILS.get(kind, Details).from_dict(d.get("details") or {}),
                inherited_from=d.get("inherited_from"), index=index, allowed_by=allowed and allowed[0], **where)
        if message is not None and message != f.message:   # written by another version: keep its sentence
            f = replace(f, text=allowed[1] if allowed else str(message))
        return f


def _allowed_by(message: str) -> tuple[str, str] | None:
    """The pattern and the sentence of an allowed divergence's message as the JSON writes it
    (``allowed by --allow-failed 'PATTERN': SENTENCE``, the pattern as Python quotes it), or None:
    the JSON has no field of its own for it."""
    head = ALLOWED_PREFIX + " "
    if not message.startswith(head):
        return None
    rest = message[len(head):]
    k = rest.find(": ")
    while k > 0:
        quoted = rest[:k]
        try:
            pattern = ast.literal_eval(quoted)
        except (ValueError, SyntaxError):
            pattern = None
        if isinstance(pattern, str) and repr(pattern) == quoted:
            return pattern, rest[k + 2:]
        k = rest.find(": ", k + 1)
    return None


def regime_a_where_named(regime_a: str, regime_b: str) -> str | None:
    """A's regime where a location names it beside B's: both sides are engines that computed the
    token in different regimes (a rollout's decode row that its replay recomputed as prefill).
    Otherwise B's regime says it: the same on both sides, or one side is a training forward, which
    has no engine regime to name."""
    return regime_a if regime_a != regime_b and "train" not in (regime_a, regime_b) else None


def regime_words(regime: str | None, regime_a: str | None) -> str:
    """``prefill``, or ``decode on A, prefill on B`` where the two engines' regimes differ."""
    return f"{regime}" if regime_a is None else f"{regime_a} on A, {regime} on B"


def where_token(f: Finding) -> str:
    """``token 5 (seq s0, position 3, prefill)``: where a token finding is, in words."""
    s = f"token {f.token} (seq {f.seq}, position {f.position}"
    if f.position_b != f.position:
        s += f"; position {f.position_b} on B"
    return s + f", {regime_words(f.regime, f.regime_a)})"


def _offset_words(off: int) -> str:
    n = abs(off)
    return f"of the token {n} position{'s' if n > 1 else ''} {'earlier' if off < 0 else 'later'}"


def _state_words(label: str | None, offset: int, scale: float | None = None) -> str:
    s = f"{label}" if not offset else f"{label} {_offset_words(offset)}"
    return s + (f" scaled by {scale:.3g} (RMS ratio)" if scale is not None else "")


def trained_on(name_a: str, name_b: str) -> str:
    """What the sentence about two sides that feed different states adds: the side the draft was
    trained on where one side is a training trace, else which side is the reference."""
    if "train" in (name_a, name_b):
        return "the draft was trained on train's"
    return "A is the reference" if name_a == "A" else f"A ({name_a}) is the reference"


def _feeds(d: IdentityDetails) -> str:
    """``slot 0 of draft_input: train feeds embed, serve feeds layer3 (...)``."""
    a = d.side_name_a or "A"
    return (f"{d.subject}: {a} feeds {d.claimed_a}, {d.side_name} feeds {d.claimed_b} "
            f"(each holds what it claims; {trained_on(a, d.side_name)})")


def _identity(f: Finding, d: IdentityDetails) -> str:
    if d.side_name_a is not None and d.outcome == "holds":
        return _feeds(d)
    who = d.subject if d.boundary_side is None else f"{d.subject} on {d.boundary_side}"
    if d.side == "a" and d.boundary_side is None and d.outcome != "mislabeled":
        who = f"{d.side_name}'s {who}"
    where = f" where {d.expected} was expected" if d.expected else ""
    if d.outcome == "mislabeled":
        return f"{d.side_name} labels {d.subject} {d.claimed} but it holds {_state_words(d.held, d.offset, d.scale)}"
    if d.outcome == "no_state":
        if d.cos is None:  # written before the closest state's cosine was recorded
            hint = f" (closest: {d.closest}, score {d.score:.3f})" if d.closest and d.score is not None else ""
            return f"{who} holds no recorded state{hint}{where}"
        ev = d.evidence
        if ev is not None and ev.floor is not None and not ev.within_floor and 1.0 - d.cos > ev.floor:
            # the number that failed against its limit: 1 - cos past the noise floor of that state
            a, b = separated(1.0 - d.cos, ev.floor)
            src = f", {ev.floor_source}" if ev.floor_source else ""
            return (f"{who} is closest to {_state_words(d.closest, d.offset)} but equal to no recorded state "
                    f"(1 - cos {a} > {b} allowed (noise floor{src})){where}")
        return (f"{who} is closest to {_state_words(d.closest, d.offset)} but equal to no recorded state "
                f"(1 - cos {1.0 - d.cos:.2g}){where}")
    if d.outcome == "ambiguous":
        tie = " and ".join([_state_words(d.closest, d.offset)] + list(d.tied[:1]))
        if f.severity == Severity.DIVERGENCE:
            return f"{who} is ambiguous between {tie}{where}"
        return f"{who} is ambiguous between {tie} (recorded states too close to tell apart on these tokens){where}"
    return f"{who} holds {_state_words(d.held, d.offset, d.scale)}{where}"


def separated(x: float, limit: float, digits: int = 2) -> tuple[str, str]:
    """``x`` and ``limit`` printed with the fewest significant digits (at least ``digits``) at
    which they differ, so a failing number never reads as equal to its limit."""
    for n in range(digits, 9):
        a, b = f"{x:.{n}g}", f"{limit:.{n}g}"
        if a != b:
            return a, b
    return f"{x:.9g}", f"{limit:.9g}"


def _limit_source(d: NumericDetails) -> str:
    src = d.limit_source or str(d.tolerance.get("source", "default"))
    return {"default": "dtype default"}.get(src, src)


def where_failing(d: NumericDetails) -> str:
    """Where a slot's failing tokens are, when they are a subset: their sequences, positions and
    regimes, and the channels that hold most of their error."""
    w = d.where
    if not w or d.failing >= d.tokens:
        return ""
    names = ", ".join(w.get("sequence_names", []))
    more = ", ..." if w.get("sequences", 0) > len(w.get("sequence_names", [])) else ""
    regimes = ", ".join(sorted(w.get("regimes", {})))
    if w.get("regimes_a"):
        regimes = f"{', '.join(sorted(w['regimes_a']))} on A, {regimes} on B"
    parts = [f"in {w.get('sequences')} of {w.get('of_sequences')} sequences ({names}{more})",
             f"positions {w.get('positions')}", regimes]
    if w.get("channels"):
        ch = w["channels"]
        parts.append(f"{'channels' if len(ch) > 1 else 'channel'} {', '.join(map(str, ch))} "
                     f"{'hold' if len(ch) > 1 else 'holds'} {percent(w.get('channel_share'), 0)} of their error")
    return f" ({'; '.join(p for p in parts if p)}), while the other {d.tokens - d.failing} agree"


def _numeric(f: Finding, d: NumericDetails) -> str:
    t = d.tolerance
    on = " (on sketches)" if d.basis == "sketch" else ""   # numbers of the sketches, not of full values
    src = _limit_source(d)
    tail = " (explained by the wrong state above)" if d.explained else ""
    state = d.state or "its state"
    if d.part == "scale" and d.value is not None and d.limit is not None:
        lv, ll = separated(abs(math.log(d.value)), d.limit)
        held = "is" if d.subject == d.state else f"holds {state}"
        return (f"{d.subject} {held} scaled by {d.value:.3g} (RMS ratio {d.value:.4f} on {d.tokens} tokens; "
                f"|log ratio| {lv} > {ll} allowed ({src}), while the direction agrees){on}{tail}")
    if d.part == "rescaled" and d.value is not None and d.limit is not None:
        lv, ll = separated(d.value, d.limit)
        held = "is" if d.subject == d.state else f"holds {state}"
        # a packed slot may have been normalised on its way into the pack; a state of its own was not packed
        hint = ": a norm applied before packing?" if f.slot is not None else ""
        return (f"{d.subject} {held} rescaled per token (RMS ratio {d.ratio_lo or 0:.2f}-{d.ratio_hi or 0:.2f} "
                f"over {d.tokens} tokens; spread of log ratio {lv} > {ll} allowed ({src}), while the direction "
                f"agrees{hint}){on}{tail}")
    if d.part == "level" and d.value is not None and d.limit is not None:
        lv, ll = separated(d.value, d.limit)
        return (f"{d.subject} diverges from {where_token(f)} on: median rel err {lv} > {ll} allowed ({src}) "
                f"over {d.tokens} tokens, {d.failing} of them past their own tolerance{on}{tail}")
    if d.part:   # tokens past their tolerance: the metric that failed, against its limit
        one_minus = 1.0 - d.cos
        lim_om = 1.0 - float(t.get("min_cos", 1.0))
        if one_minus > lim_om:
            a, b = separated(one_minus, lim_om)
            what = f"1 - cos {a} > {b} allowed"
            other = f"rel err {d.rel:.3g}"
        else:
            a, b = separated(d.rel, float(t.get("max_rel", 0.0)))
            what = f"rel err {a} > {b} allowed"
            other = f"1 - cos {one_minus:.2g}"
        return (f"{d.subject} diverges at {where_token(f)}: {what} ({src}); {other}{on}; "
                f"{d.failing} of {d.tokens} tokens fail{where_failing(d)}{tail}")
    s = (f"{d.subject} diverges at {where_token(f)}: 1 - cos {1.0 - d.cos:.2g}, rel err {d.rel:.3g}{on} "
         f"(tolerance 1 - cos <= {1.0 - float(t.get('min_cos', 0)):.2g}, rel <= {t.get('max_rel', 0):g}); "
         f"{d.failing} of {d.tokens} tokens fail")
    return s + tail


def _nonfinite(f: Finding, d: NonfiniteDetails) -> str:
    na, nb = d.row_a, d.row_b
    side_txt = (f"{d.side_b} has {nb} NaN/Inf" if nb and not na else
                f"{d.side_a} has {na} NaN/Inf" if na and not nb else
                f"both sides have NaN/Inf ({na} / {nb})")
    return f"NaN/Inf in {d.subject} at {where_token(f)}: {side_txt} values in that row"


def _shift(f: Finding, d: ShiftDetails) -> str:
    what = "a missing BOS or an off-by-one in positions" if abs(d.shift) == 1 else "an offset in positions"
    sign = f"+{d.shift}" if d.shift > 0 else str(d.shift)
    return (f"token shift of {d.shift}: {d.side_b} positions are {d.side_a} positions {sign} in {d.sequences} of "
            f"{d.of} sequences (token ids match only when shifted; {what})")


def _pairing(f: Finding, d: PairingDetails) -> str:
    if d.what == "slots":
        return f"{f.tensor} has {d.value_a} slots on {d.side_a} but {d.value_b} on {d.side_b}"
    return f"{f.tensor}: {d.side_a} pairs row t with token t+{d.value_a}, {d.side_b} with token t+{d.value_b}"


def _rng(positions: list[list[int]]) -> str:
    return ", ".join(f"{a}-{b}" if a != b else str(a) for a, b in positions)


def _gap(f: Finding, d: GapDetails) -> str:
    if d.sequences <= 1:
        return (f"gap: {d.count} tokens of sequence {d.seq} only on {d.side_name} (positions {_rng(d.positions)}): "
                f"{d.reason}")
    return (f"gap: {d.count} tokens in {d.sequences} sequences only on {d.side_name}: {d.reason} "
            f"(e.g. sequence {d.seq}, positions {_rng(d.positions)})")


def _mismatch(f: Finding, d: TokenMismatchDetails) -> str:
    seq = d.seq if d.seq == d.seq_b else f"{d.seq} ({d.side_b} {d.seq_b})"
    first = f"{d.tokens_a[0]} vs {d.tokens_b[0]}" if d.tokens_a and d.tokens_b else ""
    return (f"token mismatch: {d.count} positions of sequence {seq} exist on both sides with different token ids "
            f"(positions {_rng(d.positions)}; first {first}): the two sides were not fed the same tokens, and "
            "those rows are not compared")


def _missing(f: Finding, d: MissingDetails) -> str:
    if d.reason == "one_side":
        return f"{f.tensor} is recorded only on {d.side}; not compared"
    if d.reason == "no_common_token":
        return f"{d.label}: recorded on both sides but on no common token"
    return f"{d.label}: no comparable values or sketches (different sketch seeds?)"


def _recovered(f: Finding, d: RecoveredDetails) -> str:
    return f"{d.side} trace {os.path.basename(d.path)}: {d.note}"


def _label(f: Finding, d: LabelDetails) -> str:
    return f"{d.side} labels slot {f.slot} of {f.tensor} as {d.claimed}, but it holds {d.held}"


def _replica_limit(d: ReplicaDetails) -> str:
    """The duplicate pair's failing number against its limit, at a precision that separates them."""
    if d.cos_allowed is None or d.rel_allowed is None or d.rel_max is None:
        return f"max abs {d.max_abs:.3g}, cos {d.cos_min:.6f}"
    src = f"; limits: {d.limit_source}" if d.limit_source else ""
    if not (math.isfinite(d.rel_max) and math.isfinite(d.cos_min)):
        return f"non-finite values in one copy, max abs {d.max_abs:.3g}{src}"
    if d.rel_max > d.rel_allowed:
        return f"rel err {d.rel_max:.3g} > {d.rel_allowed:.3g} allowed, max abs {d.max_abs:.3g}{src}"
    return f"1 - cos {1.0 - d.cos_min:.3g} > {1.0 - d.cos_allowed:.3g} allowed, max abs {d.max_abs:.3g}{src}"


def _replica(f: Finding, d: ReplicaDetails) -> str:
    if d.axis == "rows":   # one trace holds two rows for one (sequence, position, regime)
        where = f"sequence {f.seq}, position {f.position}"
        if d.differing:
            return (f"{d.side} records {d.rows} token rows of {f.tensor} twice (same sequence, position and regime) "
                    f"and {d.differing} of the pairs differ beyond the noise: first {d.primary} and {d.replica} "
                    f"({where}; {_replica_limit(d)}); which copy is compared decides the result")
        return (f"{d.side} records {d.rows} token rows of {f.tensor} twice (same sequence, position and regime; "
                f"e.g. {d.primary} and {d.replica}, {where}); the copies are equal")
    what = "TP replicas" if d.axis == "tp" else "PP stages"
    return (f"{what} of {d.side} disagree: {f.tensor} in {os.path.basename(d.replica)} differs from "
            f"{os.path.basename(d.primary)} (the one compared) in {d.differing} of {d.rows} replicated rows, first at "
            f"token {f.token} (seq {f.seq}, position {f.position}); max abs {d.max_abs:.3g}, cos {d.cos_min:.6f}: "
            "this side's result depends on which copy is read")


def _routing(f: Finding, d: RoutingDetails) -> str:
    def pct(flips: int, n: int) -> str:
        return f"{100.0 * flips / n:.1f}%" if n else "-"

    only = "".join(f"; recorded on {side} only: {', '.join(f'layer{i}' for i in ls)}"
                   for side, ls in ((d.side_a, d.only_a), (d.side_b, d.only_b)) if ls)
    if not d.layers:
        return f"MoE routing not compared{only}"
    if not d.tokens:
        return f"MoE routing not compared: no token recorded by both sides{only}"
    per = ", ".join(f"layer{x['layer']} {pct(x['flips'], x['tokens'])}" for x in d.layers)
    if not d.flips:
        return (f"MoE routing agrees: {d.side_a} and {d.side_b} pick the same experts for all {d.tokens} "
                f"token-layer choices ({len(d.layers)} MoE layers){only}")
    first = next((x for x in d.layers if x.get("first")), None)
    at = (f"; first at sequence {first['first']['seq']} position {first['first']['position']}, layer{first['layer']}"
          if first else "")
    near = sum(int(x.get("near_ties", 0)) for x in d.layers)
    apart = ""
    if d.set_apart:
        states = ", ".join(f"{x['state']} ({x['tokens']})" for x in d.set_apart)
        apart = (f"; {near} of them on near-ties (the router's margin within the noise of the tokens whose experts "
                 f"agree): those tokens took other experts (a routing flip), set apart from the verdict of {states}")
    elif near:
        apart = f"; {near} of them on near-ties (the router's margin within the noise of the tokens whose experts agree)"
    return (f"MoE routing flips: {d.flips} of {d.tokens} token-layer choices pick other experts on {d.side_b} than "
            f"on {d.side_a} ({pct(d.flips, d.tokens)}; by layer: {per}){at}{apart}{only}")


def prediction_evidence(c: dict[str, Any]) -> str:
    """What makes two sides' prediction tables differ, each part against its limit and the
    limit's source (tensordiff.acceptance.judge_predictions): top-1 flips past the logit noise,
    log-prob differences past it, the mean KL, a systematic margin scale, NaN/Inf rows."""
    n = int(c.get("tokens") or 0)
    parts = [f"top-1 equal on {percent(c.get('top1'), 0, '?')} of {n} tokens"]
    noise = c.get("logprob_noise")
    src = c.get("noise_source") or "fixed limits"
    if c.get("nonfinite"):
        parts.append(f"{c['nonfinite']} rows with NaN/Inf log-probs")
    if noise is not None:
        lim = MARGIN_NOISE_FACTOR * noise
        beyond = int(c.get("flips_beyond_noise") or 0)
        parts.append(f"{beyond} of the {c.get('flips', 0)} flips change the top-1/top-2 margin by more than "
                     f"{lim:.2g} nats ({MARGIN_WORDS} the logit noise {noise:.2g}, {src})")
        lpb = int(c.get("logprob_beyond_noise") or 0)
        if lpb:
            parts.append(f"the log-prob of the reference's top-1 moves by more than {lim:.2g} nats on {lpb} tokens "
                         f"(RMS {c.get('logprob_rms') or 0:.2g})")
        if c.get("unexplained"):
            a, b = separated(float(noise), UNEXPLAINED * float(c.get("propagated_noise") or 0.0))
            parts.append(f"the margins move by {a} nats > {b} allowed ({UNEXPLAINED:g}x what {c.get('final_state')}'s "
                         f"error, rel {float(c.get('state_rel99') or 0):.2g} at the 99th percentile (measured), moves "
                         f"logits of scale {float(c.get('logit_scale') or 0):.2g}): the predictions change after "
                         f"{c.get('final_state')}")
        if c.get("margin_scaled"):
            parts.append(f"every margin scaled by {c.get('margin_scale', 1.0):.3g} (sign test z "
                         f"{c.get('margin_scale_z', 0.0):.1f} beyond +-{SIGN_Z:g}: a temperature or a logit scale on "
                         "one side?)")
    kl, lim_kl = c.get("kl_lb"), c.get("kl_limit")
    if kl is not None and lim_kl is not None:
        a, b = separated(float(kl), float(lim_kl))
        parts.append(f"mean KL >= {a} nats {'>' if kl > lim_kl else '<='} {b} allowed ({src})")
    elif kl is not None:
        parts.append(f"KL >= {float(kl):.3g} nats")
    return "; ".join(parts)


def _acceptance(f: Finding, d: AcceptanceDetails) -> str:
    def pct(x: float | None) -> str:
        return percent(x, 0, "?")
    if d.accept_length is not None:
        pos = ", ".join(f"position {p['position']} {pct(p['rate'])}" for p in d.per_position[:3])
        head = (f"acceptance {d.accept_length:.2f} on {d.side} over {d.steps} verify steps "
                f"(draft tokens accepted by position: {pos})")
    else:
        rows = (d.teacher.get("all") or {}).get("rows", 0)
        head = f"the draft's top-1 agrees with the target's on {pct(d.draft_top1)} of {rows} draft rows on {d.side}"
    kl = "" if d.draft_kl is None else f", KL >= {d.draft_kl:.2f} nats"
    if d.verdict == "upstream":
        note = f"; {d.upstream_note}" if d.upstream_note else ""
        return f"{head}; first divergence upstream: {d.upstream}{note}"
    if d.verdict == "target":
        c = d.cross.get("target_topk", {})
        return (f"{head}; first divergence upstream: the target's predictions differ between {d.side_a} and "
                f"{d.side_b} ({prediction_evidence(c)})")
    if d.verdict == "draft_after_fc":
        c = d.cross.get("draft_topk", {})
        return (f"{head}; the draft's predictions differ between {d.side_a} and {d.side_b} (top-1 equal on "
                f"{pct(c.get('top1'))} of {c.get('tokens', 0)} tokens) while its input and fc output agree: "
                "the draft after fc differs (weights, attention, norms)")
    if d.verdict == "close":
        c = d.cross.get(d.upstream or "", {})
        return (f"{head}; {d.upstream} of {d.side_a} and {d.side_b} agree only approximately "
                f"({prediction_evidence(c)}): no verdict on the wiring")
    if d.verdict == "incomplete":
        return f"{head}; not compared: {', '.join(d.not_compared)}; no verdict on the wiring"
    agree = (f"{head}: the draft input, fc output and target predictions agree between {d.side_a} and "
             f"{d.side_b}, and the draft")
    if d.draft_disagrees:
        return (f"{agree} itself disagrees with the target (top-1 {pct(d.draft_top1)} at draft position 0{kl}): "
                "a training-quality problem, not wiring")
    return f"{agree} agrees with the target (top-1 {pct(d.draft_top1)} at draft position 0{kl})"


def _signature(f: Finding, d: SignatureDetails) -> str:
    if d.signature == "graft":
        return f"{d.what}: {d.cause} ({d.evidence})"
    if d.signature == "config":
        return f"{d.cause}: {d.what}; {d.evidence}"
    where = f"in layer {d.layer}" if d.layer is not None else "in its layer"
    if isinstance(d.params.get("absorbed"), str):
        return (f"{d.op} differs in layer {d.layer}, but nothing after it does ({d.params['absorbed']} and every "
                f"later state agree): {d.what} ({d.evidence}); a difference with no effect downstream: {d.cause}")
    return f"{d.op} is the first op out of the noise {where}: {d.what} ({d.evidence}); look at {d.cause}"


_RENDER: dict[Kind, tuple[type[Details], Callable[[Finding, Any], str]]] = {
    Kind.SLOT_IDENTITY: (IdentityDetails, _identity), Kind.NUMERIC: (NumericDetails, _numeric),
    Kind.NONFINITE: (NonfiniteDetails, _nonfinite), Kind.TOKEN_SHIFT: (ShiftDetails, _shift),
    Kind.PAIRING: (PairingDetails, _pairing), Kind.GAP: (GapDetails, _gap),
    Kind.TOKEN_MISMATCH: (TokenMismatchDetails, _mismatch), Kind.MISSING: (MissingDetails, _missing),
    Kind.RECOVERED: (RecoveredDetails, _recovered), Kind.LABEL_MISMATCH: (LabelDetails, _label),
    Kind.REPLICA: (ReplicaDetails, _replica),
    Kind.ACCEPTANCE: (AcceptanceDetails, _acceptance),
    Kind.ROUTING: (RoutingDetails, _routing),
    Kind.SIGNATURE: (SignatureDetails, _signature),
}


def render_sentence(f: Finding) -> str:
    """The one sentence of a finding, made from its kind, location and details."""
    typ, fn = _RENDER[f.kind]
    if not isinstance(f.details, typ):
        return f"{f.kind} in {f.tensor or 'tokens'}"
    return fn(f, f.details)


def display_names(side_a: str, side_b: str) -> tuple[str, str]:
    """The names the two sides go by in every sentence, table and header: their own, except two
    traces of the same side (two train runs: a regression check), named ``A`` and ``B``: "train
    claims layer2; train holds layer1" says nothing. The traces themselves keep their names."""
    return ("A", "B") if side_a == side_b else (side_a, side_b)


# ----------------------------------------------------------------------------------------------
# Tables and the result
# ----------------------------------------------------------------------------------------------


# -- the diff's records that are plain dicts, as the JSON gives them -----------------------------


class RegimeStats(TypedDict):
    """A tensor pair's figures on the tokens of one regime (``PairStats.by_regime``)."""

    tokens: int
    failing: int
    rel_max: float


class SideRecord(TypedDict):
    path: str
    side: str


class _FrozenRecord:
    """A frozen dataclass with a JSON form (a frozen dataclass cannot inherit :class:`Record`)."""

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = dataclasses.asdict(self)  # type: ignore[call-overload]
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Self:
        names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        return cls(**{k: v for k, v in d.items() if k in names})


@dataclass(frozen=True)
class SeqPair(_FrozenRecord):
    """Sequence ``a`` of side A paired with sequence ``b`` of side B, B's positions A's plus ``shift``
    (``DiffResult.sequences``): ``tokens`` positions with equal token ids, ``mismatched`` on both
    sides with other ids, ``only_a`` / ``only_b`` on one side only."""

    a: str
    b: str
    shift: int
    tokens: int
    only_a: int
    only_b: int
    mismatched: int = 0   # a JSON written before the count was kept has none


@dataclass(frozen=True)
class Gap(_FrozenRecord):
    """Positions of one sequence present on one side only, for one reason (``DiffResult.gaps``;
    ``positions``: the first ranges, ``count``: all of them)."""

    seq: str
    side: Side
    positions: Ranges
    count: int
    reason: str


class _WorstTokenWhereNamed(TypedDict, total=False):
    regime_a: str   # only where both engines' regimes differ (regime_a_where_named)


class WorstToken(_WorstTokenWhereNamed):
    """One of the worst tokens of the diff (``DiffResult.worst_tokens``)."""

    seq: str
    position: int
    seq_b: str
    position_b: int
    token: int
    regime: str
    token_index: int
    tensor: str
    rel: float
    slot: int
    cos: float


@dataclass
class SlotRow(Record):
    """One row of the slot table: what a slot of a paired tensor holds on each side."""

    tensor: str = ""
    slot: int = 0
    claimed_a: str | None = None
    claimed_b: str | None = None
    held_a: str | None = None
    held_b: str | None = None
    score_b: float | None = None
    margin_b: float | None = None
    offset_b: int = 0
    candidates_b: list[Candidate] = field(default_factory=list)
    expected: str | None = None
    cos_mean: float | None = None
    rel_max: float | None = None
    verdict: SlotVerdict = "ok"
    offset_a: int = 0
    # the identity search's outcome on each side (identity.IdentityVerdict)
    outcome_a: Annotated[str | None, OneOf((None, "holds", "scaled", "no_state", "ambiguous", "none"))] = None
    outcome_b: Annotated[str | None, OneOf((None, "holds", "scaled", "no_state", "ambiguous", "none"))] = None

    def __post_init__(self) -> None:
        self.candidates_b = [c if isinstance(c, Candidate) else Candidate.from_dict(c) for c in self.candidates_b]


@dataclass
class PairStats(Record):
    """Per-slot statistics of one compared tensor pair (lists have one entry per slot)."""

    name_a: str = ""
    name_b: str = ""
    label: str = ""
    order: float = 0.0
    slots: int = 1
    tokens: int = 0
    basis: Basis = "values"
    tolerance: list[Annotated[dict[str, Any], ToleranceRecord]] = field(default_factory=list)
    cos_min: list[float] = field(default_factory=list)
    cos_mean: list[float] = field(default_factory=list)
    rel_max: list[float] = field(default_factory=list)
    maxabs: list[float] = field(default_factory=list)
    failing: list[int] = field(default_factory=list)
    nonfinite_a: list[int] = field(default_factory=list)
    nonfinite_b: list[int] = field(default_factory=list)
    by_regime: dict[str, Annotated[dict[str, Any], RegimeStats]] = field(default_factory=dict)
    dtype_a: str = ""
    dtype_b: str = ""
    depth: list[float | None] = field(default_factory=list)   # per slot, for the default tolerance
    compared: bool = True
    not_compared: str = ""        # why not, when not compared

    #: internal fields the JSON leaves out (it lists tensors in forward order already)
    JSON_OMIT: ClassVar[tuple[str, ...]] = ("order",)

    def to_dict(self) -> dict[str, Any]:
        d = super().to_dict()
        for k in self.JSON_OMIT:
            del d[k]
        return d


class ErrorInfo(TypedDict):
    """What went wrong, in an error object (``ErrorJSON``)."""

    #: the kind of error: TraceFileError, TraceBusyError, SourceFileError, IncompatibleTracesError,
    #: UsageError, RecordingError, Interrupted, MemoryError or UnexpectedError (a bug of tensordiff's)
    type: str
    #: the line printed on stderr after 'tensordiff: error: '
    message: str


class ErrorJSON(TypedDict):
    """What ``tensordiff diff --json`` prints instead of a result on bad input (exit 2), an
    interrupt (exit 130) or an error of its own (exit 3): the same line as on stderr, as JSON."""

    schema_version: Annotated[int, OneOf((SCHEMA_VERSION,))]
    error: ErrorInfo
    exit_code: Annotated[int, OneOf((2, 3, 130))]


class DiffJSON(TypedDict):
    """What :meth:`DiffResult.to_dict` gives (``tensordiff diff --json``): the schema's top level."""

    schema_version: Annotated[int, OneOf((SCHEMA_VERSION,))]
    a: SideRecord
    b: SideRecord
    verdict: Verdict
    tensors_compared: int
    exit_code: Annotated[int, OneOf((0, 1))]
    headline: str
    first_divergence: Finding | None
    findings: list[Finding]
    slot_table: list[SlotRow]
    tensors: list[PairStats]
    tokens_aligned: int
    sequences: list[SeqPair]
    gaps: list[Gap]
    shifts: dict[str, int]
    worst_tokens: list[WorstToken]
    summary_path: str | None


@dataclass
class DiffResult:
    path_a: str
    path_b: str
    side_a: str
    side_b: str
    findings: list[Finding]
    slot_table: list[SlotRow]
    pairs: list[PairStats]
    sequences: list[SeqPair]
    gaps: list[Gap]
    shifts: dict[str, int]
    tokens_aligned: int
    worst_tokens: list[Annotated[dict[str, Any], WorstToken]]
    summary_path: str | None = None
    allow_incomplete: bool = False  # `--allow-incomplete`: an incomplete verdict exits 0

    def side_tags(self) -> tuple[str, str]:
        """`` [train]``, `` [serve]`` after each path; nothing when the two traces are of one side
        and named A and B (:func:`display_names`): the path already says A= and B=."""
        if (self.side_a, self.side_b) == ("A", "B"):
            return "", ""
        return f" [{self.side_a}]", f" [{self.side_b}]"

    @property
    def divergences(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == Severity.DIVERGENCE]

    @property
    def first_divergence(self) -> Finding | None:
        d = self.divergences
        return d[0] if d else None

    @property
    def exit_code(self) -> int:
        if self.divergences:
            return 1
        return 1 if self.verdict == "incomplete" and not self.allow_incomplete else 0

    @property
    def compared(self) -> int:
        """How many of the paired tensors were compared (on common tokens, in a common basis)."""
        return sum(1 for p in self.pairs if p.compared)

    @property
    def verdict(self) -> Verdict:
        """divergence; agree (every paired tensor compared, none diverges); incomplete (no
        divergence in the tensors compared, but some could not be compared)."""
        if self.divergences:
            return "divergence"
        return "agree" if self.compared == len(self.pairs) else "incomplete"

    def headline(self) -> str:
        f = self.first_divergence
        if f is not None:
            return self._feeds_headline(f) or f.message
        graft = next((g for g in self.findings if g.kind == Kind.SIGNATURE), None)   # a grafted run says so first
        if graft is not None:
            return graft.message
        allowed = sum(1 for g in self.findings if g.allowed_by is not None)
        n, k = len(self.pairs), self.compared
        tensors = f"{n} tensor{'' if n == 1 else 's'}"
        if k < n:
            return (f"no divergence in the {k} of {n} tensors compared ({self.tokens_aligned} tokens); {n - k} could "
                    "not be compared (see the warnings)"
                    + (f"; {allowed} divergences allowed by --allow-failed" if allowed else ""))
        if allowed:
            return (f"no divergence outside the {allowed} allowed by --allow-failed: {self.tokens_aligned} tokens in "
                    f"{tensors} compared")
        routed = next((g.details for g in self.findings if isinstance(g.details, RoutingDetails) and g.details.set_apart),
                      None)
        if routed is not None:   # tokens set apart from some state's verdict: not "every token agrees"
            near = sum(int(x.get("near_ties", 0)) for x in routed.layers)
            return (f"no divergence: {self.tokens_aligned} tokens in {tensors} agree within tolerance, but for {near} "
                    "MoE routing flip(s) on near-ties, set apart (see the routing note)")
        return f"no divergence: {self.tokens_aligned} tokens in {tensors} agree within tolerance"

    def _feeds_headline(self, f: Finding) -> str | None:
        """``train feeds draft_input [embed, layer3, layer5], serve feeds [layer3, layer5, layer7];
        the draft was trained on train's``: where the first divergence is a slot that each side fills with what it claims, and
        every slot of that tensor holds its side's claim, the whole tensor in one sentence."""
        d = f.details
        if not (f.kind == Kind.SLOT_IDENTITY and isinstance(d, IdentityDetails) and d.side_name_a is not None):
            return None
        rows = sorted((r for r in self.slot_table if r.tensor == d.subject.rsplit(" of ", 1)[-1]),
                      key=lambda r: r.slot)
        if not rows or any(r.claimed_a is None or r.claimed_b is None or r.held_a != r.claimed_a
                           or r.held_b != r.claimed_b or r.offset_a or r.offset_b
                           or r.outcome_a != "holds" or r.outcome_b != "holds" for r in rows):
            return None
        a, b = d.side_name_a, d.side_name
        fa = ", ".join(str(r.claimed_a) for r in rows)
        fb = ", ".join(str(r.claimed_b) for r in rows)
        return f"{a} feeds {rows[0].tensor} [{fa}], {b} feeds [{fb}]; {trained_on(a, b)}"

    def inheritance_note(self, f: Finding) -> str | None:
        """``may be inherited from finding #3 (numeric in layer4)`` for an inherited divergence."""
        if f.inherited_from is None or not 0 <= f.inherited_from < len(self.findings):
            return None
        g = self.findings[f.inherited_from]
        return f"may be inherited from finding #{g.index} ({g.kind} in {g.tensor or 'tokens'})"

    def to_dict(self) -> dict[str, Any]:
        first = self.first_divergence
        return {
            "schema_version": SCHEMA_VERSION,
            "a": {"path": self.path_a, "side": self.side_a},
            "b": {"path": self.path_b, "side": self.side_b},
            "verdict": self.verdict,
            "tensors_compared": self.compared,
            "exit_code": self.exit_code,
            "headline": self.headline(),
            "first_divergence": first.to_dict() if first is not None else None,
            "findings": [f.to_dict() for f in self.findings],
            "slot_table": [r.to_dict() for r in self.slot_table],
            "tensors": [p.to_dict() for p in self.pairs],
            "tokens_aligned": self.tokens_aligned,
            "sequences": [p.to_dict() for p in self.sequences],
            "gaps": [g.to_dict() for g in self.gaps],
            "shifts": self.shifts,
            "worst_tokens": self.worst_tokens,
            "summary_path": self.summary_path,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DiffResult:
        version = d.get("schema_version")
        if version != SCHEMA_VERSION:
            raise ValueError(f"diff JSON schema_version {version!r}; this tensordiff reads {SCHEMA_VERSION}")
        pairs = [PairStats.from_dict(p) for p in d["tensors"]]
        for i, p in enumerate(pairs):
            p.order = float(i)
        return cls(path_a=d["a"]["path"], path_b=d["b"]["path"], side_a=d["a"]["side"], side_b=d["b"]["side"],
                   findings=[Finding.from_dict(f, i) for i, f in enumerate(d["findings"])],
                   slot_table=[SlotRow.from_dict(r) for r in d["slot_table"]], pairs=pairs,
                   sequences=[SeqPair.from_dict(p) for p in d["sequences"]],
                   gaps=[Gap.from_dict(g) for g in d["gaps"]], shifts=dict(d["shifts"]),
                   tokens_aligned=int(d["tokens_aligned"]), worst_tokens=list(d["worst_tokens"]),
                   summary_path=d.get("summary_path"))
