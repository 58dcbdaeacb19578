"""Evidence records: the typed details of each kind of finding, and the candidates scored for a
slot. Plain dataclasses with a JSON form (``to_dict`` / ``from_dict``); no numpy, no I/O.
:mod:`tensordiff.findings` re-exports them."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Annotated, Any, TypedDict

if TYPE_CHECKING:  # pragma: no cover
    from typing_extensions import Self


# -- what a field's type does not say about its JSON (read by tensordiff.json_schema) -----------
# A field's annotation is its one definition: ``Annotated[str, OneOf(...)]`` is still a ``str`` to
# the type checker, and the JSON schema's enum of that field.


@dataclass(frozen=True)
class OneOf:
    """The values a field takes (the schema's ``enum``)."""

    values: tuple[Any, ...]


@dataclass(frozen=True)
class JsonShape:
    """The JSON of a field whose Python type is looser (a schema fragment)."""

    schema: dict[str, Any]


class ToleranceRecord(TypedDict):
    """A tolerance as the JSON gives it (``Tolerance.to_dict``)."""

    min_cos: float
    max_rel: float
    source: str


Side = Annotated[str, OneOf(("a", "b"))]
Basis = Annotated[str, OneOf(("values", "sketch"))]
#: inclusive position ranges [start, end]
Ranges = Annotated[list[list[int]], JsonShape({"type": "array", "items": {
    "type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 2}})]


def _plain(v: Any) -> Any:
    if isinstance(v, Record):
        return v.to_dict()
    if isinstance(v, Enum):
        return v.value
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in v.items()}
    return v


@dataclass
class Record:
    """A dataclass with a JSON form; its fields are read as attributes."""

    def to_dict(self) -> dict[str, Any]:
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Self:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


@dataclass
class Candidate(Record):
    """One recorded state scored against a slot: ``score = cos * rms_agreement`` on the sampled
    tokens, at the token ``offset`` positions away, from ``side``'s catalog, on ``basis``."""

    label: str = ""
    offset: int = 0
    score: float = 0.0
    cos: float = 0.0
    rms_agreement: float = 0.0
    side: Side = "b"
    basis: Basis = "values"


@dataclass
class Details(Record):
    """Base of the per-kind details. ``token_index``: the aligned token the finding is at (the
    TUI's heatmap row), None for findings about a whole tensor or the token tables."""

    token_index: int | None = None


@dataclass
class ShiftDetails(Details):
    shift: int = 0
    sequences: int = 0      # sequence pairs with this shift
    of: int = 0             # all sequence pairs
    side_a: str = "A"
    side_b: str = "B"


@dataclass
class PairingDetails(Details):
    # "slots": slot counts differ; "token_offset": rows pair with other tokens
    what: Annotated[str, OneOf(("slots", "token_offset"))] = "slots"
    value_a: int = 0
    value_b: int = 0
    side_a: str = "A"
    side_b: str = "B"


@dataclass
class GapDetails(Details):
    """Tokens on one side only, collapsed per (side, reason): ``count`` tokens in ``sequences``
    sequences; ``seq``/``positions``: the first one (inclusive ranges), ``seqs``: up to 8 keys."""

    seq: str = ""
    side: Side = "a"                # which side has the tokens
    side_name: str = ""
    positions: Ranges = field(default_factory=list)  # the first ranges
    count: int = 0
    reason: str = ""
    sequences: int = 1
    seqs: list[str] = field(default_factory=list)


@dataclass
class TokenMismatchDetails(Details):
    """Paired positions (present on both sides) whose token ids differ: their rows are not compared."""

    seq: str = ""
    seq_b: str = ""
    positions: Ranges = field(default_factory=list)  # A's positions
    count: int = 0
    tokens_a: list[int] = field(default_factory=list)          # the first few ids on each side
    tokens_b: list[int] = field(default_factory=list)
    side_a: str = "A"
    side_b: str = "B"


@dataclass
class MissingDetails(Details):
    reason: Annotated[str, OneOf(("one_side", "no_common_token", "no_basis"))] = "one_side"
    label: str = ""
    side: str = ""             # for one_side: "A" or "B"
    reason_text: str = ""      # for the others: both sides' rows, or what each keeps (values, sketch seed/dim)


@dataclass
class RecoveredDetails(Details):
    side: str = ""
    path: str = ""
    note: str = ""


@dataclass
class ReplicaDetails(Details):
    """Rows of a trace set recorded twice (by two TP ranks, or two PP stages) that differ: the
    diff read ``primary``'s; ``replica`` differs in ``differing`` of ``rows`` rows."""

    side: str = ""
    axis: Annotated[str, OneOf(("tp", "pp"))] = "tp"
    primary: str = ""
    replica: str = ""
    part: Basis = "values"
    rows: int = 0
    differing: int = 0
    max_abs: float = 0.0
    cos_min: float = 1.0
    rel_max: float | None = None       # rows only: the first differing pair's worst per-slot relative error
    cos_allowed: float | None = None   # ... and the limits it was judged against (cos >=, rel <=)
    rel_allowed: float | None = None
    limit_source: str = ""             # where those limits come from (the noise model's source)


@dataclass
class NonfiniteDetails(Details):
    subject: str = ""          # "slot 0 of draft_input" or a state label
    nonfinite_a: int = 0       # NaN/Inf values over the whole tensor (slot), side A
    nonfinite_b: int = 0
    row_a: int = 0             # ... in the first row that has any
    row_b: int = 0
    side_a: str = "A"
    side_b: str = "B"


@dataclass
class IdentityEvidence(Record):
    """Why the identity search decided what it did for one slot (docs/diff.md §3).

    ``cos``: mean per-token cosine of the best candidate on ``tokens`` sampled tokens; ``exact``:
    an own-side recorded state equal to the slot within ``exact_tol`` (per-token relative error,
    worst ``exact_rel``); ``runner_up`` and the paired test of best vs runner-up on the
    ``paired_tokens`` both cover: ``win_rate`` (share of tokens where the best is closer) and ``z``
    (mean / standard error of the per-token cosine differences); ``tied``: other states not
    significantly worse than the best; ``floor``: the 1 - cos the same state shows across the two
    sides (from ``floor_source``), ``within_floor`` whether the best is that close; ``rms_ratio``:
    median per-token RMS of the slot over the best's (``rms_lo``..``rms_hi``: 5th..95th percentile);
    ``decided_by``: exact | paired test | scale (a tie in direction broken by RMS) | none."""

    cos: float | None = None
    tokens: int = 0
    exact: bool = False
    exact_rel: float | None = None
    exact_tol: float | None = None
    runner_up: str | None = None
    runner_up_offset: int = 0
    runner_up_cos: float | None = None
    paired_tokens: int = 0
    win_rate: float | None = None
    z: float | None = None
    tied: list[str] = field(default_factory=list)
    floor: float | None = None
    floor_source: str = ""
    within_floor: bool = False
    rms_ratio: float | None = None
    rms_lo: float | None = None
    rms_hi: float | None = None
    decided_by: Annotated[str, OneOf(("exact", "paired test", "scale", "none"))] = "none"


@dataclass
class IdentityDetails(Details):
    """``outcome``: holds (a recorded state other than expected), scaled (a recorded state at
    another scale), no_state (closest to ``closest`` but equal to no recorded state), ambiguous
    (between ``tied``), mislabeled (the side ``side`` labels the slot ``claimed`` but holds
    ``held``: that side is at fault). ``side_name_a``: A's side name where each side holds what it
    claims and the claims differ (the sentence then says what each side feeds), else None."""

    outcome: Annotated[str, OneOf(("holds", "scaled", "no_state", "ambiguous", "mislabeled"))] = "holds"
    subject: str = ""          # "slot 0 of draft_input", or a tensor name for a boundary
    boundary_side: str | None = None  # a boundary's identity: the side whose tensor it is
    side: Side = "b"           # whose slot the sentence is about
    side_name: str = ""
    held: str | None = None
    expected: str | None = None
    claimed: str | None = None
    offset: int = 0
    scale: float | None = None
    score: float | None = None
    margin: float | None = None
    runner_up: str | None = None
    closest: str | None = None
    cos: float | None = None
    tied: list[str] = field(default_factory=list)
    claimed_a: str | None = None
    claimed_b: str | None = None
    held_a: str | None = None
    candidates: list[Candidate] = field(default_factory=list)
    evidence: IdentityEvidence | None = None
    side_name_a: str | None = None

    def __post_init__(self) -> None:
        self.candidates = [c if isinstance(c, Candidate) else Candidate.from_dict(c) for c in self.candidates]
        if isinstance(self.evidence, dict):
            self.evidence = IdentityEvidence.from_dict(self.evidence)

    def to_dict(self) -> dict[str, Any]:
        d = super().to_dict()
        if d["claimed"] is None:   # what the side the sentence is about labels the slot
            d["claimed"] = self.claimed_a if self.side == "a" else self.claimed_b
        return d


@dataclass
class LabelDetails(Details):
    claimed: str = ""
    held: str = ""
    side: str = ""


@dataclass
class NumericDetails(Details):
    subject: str = ""
    cos: float = 0.0
    rel: float = 0.0
    maxabs: float = 0.0
    failing: int = 0
    tokens: int = 0
    tolerance: Annotated[dict[str, Any], ToleranceRecord] = field(default_factory=dict)
    basis: Basis = "values"
    explained: bool = False    # a wrong state of the same slot explains it
    # judged against the noise model (tensordiff.noise): which part of the error failed
    # (tokens: single tokens past their tolerance; level: the median error; scale: a systematic
    # RMS ratio; rescaled: a per-token RMS ratio spread), the failing number, its limit, where
    # the limit comes from, and the state the slot holds
    part: str = ""
    metric: str = ""
    value: float | None = None
    limit: float | None = None
    limit_source: str = ""
    state: str | None = None
    ratio_lo: float | None = None
    ratio_hi: float | None = None
    failing_share: float | None = None
    # where the failing tokens are (tensordiff.noise_io.where_failing): sequences, positions,
    # regimes, and the channels that hold most of their error; empty when none fails
    where: dict[str, Any] = field(default_factory=dict)


@dataclass
class AcceptanceDetails(Details):
    """Why acceptance is low (tensordiff.acceptance): ``side`` the side measured (B when it has
    draft predictions or verify steps); ``verdict``: upstream (the diff's first divergence,
    ``upstream`` its sentence), target (A's and B's target predictions disagree), draft_after_fc
    (the draft's predictions disagree while its fc output agrees), close (A's and B's predictions
    agree only approximately: no verdict), agree (draft input, fc output and target predictions
    compared and agree), incomplete (``not_compared`` lists what was not)."""

    side: str = ""
    side_a: str = "A"
    side_b: str = "B"
    verdict: Annotated[str, OneOf(("upstream", "target", "draft_after_fc", "close", "agree", "incomplete"))] = "incomplete"
    upstream: str | None = None
    upstream_index: int | None = None
    upstream_note: str | None = None
    steps: int = 0
    accept_length: float | None = None
    per_position: list[dict[str, Any]] = field(default_factory=list)  # position, reached, accepted, rate, top1, target_logprob
    teacher: dict[str, dict[str, Any]] = field(default_factory=dict)  # regime -> rows, top1, overlap, kl_lb (draft vs target)
    teacher_other: dict[str, dict[str, Any]] = field(default_factory=dict)  # the same on the other side
    cross: dict[str, dict[str, Any]] = field(default_factory=dict)    # tensor -> tokens, top1, overlap, kl_lb, agree (A vs B)
    draft_top1: float | None = None
    draft_kl: float | None = None
    draft_disagrees: bool = False   # teacher-forced top-1 agreement with the target below one half
    not_compared: list[str] = field(default_factory=list)


@dataclass
class SignatureDetails(Details):
    """What kind of difference the first divergent op of a zoomed layer shows
    (tensordiff.signatures): ``op`` the tap (``layer3.mlp_up``), ``signature`` its kind (swap,
    rotary, rope_offset, heads, gqa, attn_scale, norm_eps, residual, activation, scale, per_channel,
    op), ``what`` it is, the ``evidence``, the
    ``cause`` to look at, and the fitted ``params``. ``graft``: a trace recorded with one state
    grafted from another (``record train --graft``), ``what`` says whether anything after it
    still diverges."""

    op: str = ""
    signature: Annotated[str, OneOf(("swap", "rotary", "heads", "gqa", "norm_eps", "scale", "per_channel", "op",
                                        "graft", "rope_offset", "attn_scale", "activation", "residual",
                                        "config"))] = "op"
    what: str = ""
    evidence: str = ""
    cause: str = ""
    layer: int | None = None
    params: dict[str, Any] = field(default_factory=dict)


@dataclass
class RoutingDetails(Details):
    """MoE routing of the two sides on the same tokens (tensordiff.routing): per MoE layer
    (``layers``: ``layer``, ``tokens`` compared, ``flips`` tokens whose expert set differs,
    ``rate``, ``weight_max_abs`` over the tokens whose sets agree, ``first`` flip as
    ``{seq, position}``, ``near_ties`` the flips on a near-tie), the totals, the layers only one
    side recorded, and ``set_apart``: the states whose failing tokens were all near-tie flips,
    set apart from their verdict (``{state, tokens}``)."""

    layers: list[dict[str, Any]] = field(default_factory=list)
    tokens: int = 0
    flips: int = 0
    only_a: list[int] = field(default_factory=list)
    only_b: list[int] = field(default_factory=list)
    side_a: str = "A"
    side_b: str = "B"
    set_apart: list[dict[str, Any]] = field(default_factory=list)
