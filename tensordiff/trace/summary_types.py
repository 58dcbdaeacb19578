"""What ``tensordiff info`` shows of a trace, as typed plain data: the summary's shape, shared by
the readers that make it (:func:`tensordiff.trace.reader.trace_summary`), the protocol that
names it and the report that prints it (a module of its own, so none of them imports another
for a type)."""

from __future__ import annotations

from typing import Any, TypedDict


class SketchParams(TypedDict):
    seed: int
    dim: int


class TokenCounts(TypedDict):
    rows: int
    sequences: int
    regimes: dict[str, int]   # token rows per regime


class SequenceSpan(TypedDict):
    key: str
    rows: int
    positions: list[int]      # [first, last]


class _TensorEntryBase(TypedDict):
    name: str
    kind: str
    label: str
    dtype: str
    shape: list[int]          # [rows, width]
    order: float
    values: bool
    sketch: bool
    role: str


class TensorEntry(_TensorEntryBase, total=False):
    """A tensor as ``info`` lists it; the optional keys only where they say something."""

    sketch_derived: bool
    values_source: str
    slots: int
    slot_width: int
    slot_labels: list[str] | None
    raw_ids: list[int] | None
    convention: str | None
    token_offset: int
    attrs: dict[str, Any]


class _TraceSummaryBase(TypedDict):
    path: str
    schema: int
    side: str
    producer: str
    created: str
    complete: bool
    recovered: str | None
    model: dict[str, Any]
    versions: dict[str, Any]
    user_meta: dict[str, Any]
    sketch: SketchParams
    tokens: TokenCounts
    sequences: list[SequenceSpan]
    tensors: list[TensorEntry]


class TraceSummary(_TraceSummaryBase, total=False):
    """What ``tensordiff info`` shows (``--json`` prints it as it is)."""

    set: dict[str, Any]       # a trace set's index (:func:`tensordiff.traceset.index.set_index`)
