"""The JSON Schema of ``tensordiff diff --json``, generated from the records the JSON is made of.

Each field is defined once, in its record: :mod:`tensordiff.details` and :mod:`tensordiff.findings`
(dataclasses, and TypedDicts for the parts of the result that are plain dicts). A field's Python
type gives its JSON type; ``Annotated[..., OneOf(...)]`` its values, ``Annotated[..., JsonShape]``
or ``Annotated[dict, SomeTypedDict]`` the shape of a looser type. Every float may be null (NaN and
Inf are written as null). A record's JSON holds every field (``to_dict``) but those in its
``JSON_OMIT``; a finding's holds its location fields only where they are set.

``tensordiff/schemas/diff.schema.json`` is this module's output, committed and shipped:
``python -m tensordiff.json_schema`` writes it again, ``--check`` fails when it differs (a test
runs the check).
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
import sys
import types
from typing import Annotated, Any, Literal, Union, get_args, get_origin, get_type_hints

from .details import Candidate, IdentityEvidence, JsonShape, OneOf, ToleranceRecord
from .findings import (
    DETAILS,
    SCHEMA_VERSION,
    DiffJSON,
    ErrorInfo,
    ErrorJSON,
    Finding,
    Gap,
    PairStats,
    RegimeStats,
    SeqPair,
    SideRecord,
    SlotRow,
    WorstToken,
)

PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "schemas", "diff.schema.json")

#: the name of each record's definition in the schema
NAMES: dict[Any, str] = {
    SideRecord: "side", Candidate: "candidate", ToleranceRecord: "tolerance", Finding: "finding",
    SlotRow: "slot_row", PairStats: "tensor", SeqPair: "sequence_pair", Gap: "gap",
    WorstToken: "worst_token", IdentityEvidence: "identity_evidence", RegimeStats: "regime_stats",
    DiffJSON: "result", ErrorJSON: "error", ErrorInfo: "error_info",
    **{cls: f"details_{kind.value}" for kind, cls in DETAILS.items()},
}
_PRIMITIVES = {str: "string", int: "integer", bool: "boolean", float: "number"}


def _is_record(tp: Any) -> bool:
    return tp in NAMES


def _nullable(s: dict[str, Any]) -> dict[str, Any]:
    if "enum" in s:
        return s if None in s["enum"] else {**s, "enum": [*s["enum"], None]}
    t = s.get("type")
    if isinstance(t, str) and t in ("string", "integer", "boolean", "number") and len(s) == 1:
        return {"type": [t, "null"]}
    if isinstance(t, list) and "null" in t:
        return s
    return {"oneOf": [{"type": "null"}, s]}


def _schema(tp: Any) -> dict[str, Any]:
    """The JSON Schema of a value of type ``tp`` (records by reference)."""
    origin = get_origin(tp)
    if origin is Annotated:
        base, *meta = get_args(tp)
        out = _schema(base)
        for m in meta:
            if isinstance(m, OneOf):
                out = {"const": m.values[0]} if len(m.values) == 1 else {"enum": list(m.values)}
            elif isinstance(m, JsonShape):
                out = dict(m.schema)
            elif _is_record(m):
                out = {"$ref": f"#/$defs/{NAMES[m]}"}
        return out
    if origin is Literal:
        values = get_args(tp)
        return {"const": values[0]} if len(values) == 1 else {"enum": list(values)}
    if origin in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        inner = _schema(args[0]) if len(args) == 1 else {"anyOf": [_schema(a) for a in args]}
        return _nullable(inner) if type(None) in get_args(tp) else inner
    if tp is float:
        return {"type": ["number", "null"]}   # NaN and Inf are written as null
    if tp in _PRIMITIVES:
        return {"type": _PRIMITIVES[tp]}
    if tp is Any:
        return {}
    if origin is list:
        return {"type": "array", "items": _schema(get_args(tp)[0])}
    if origin is dict:
        value = _schema(get_args(tp)[1])
        return {"type": "object", "additionalProperties": value} if value else {"type": "object"}
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return {"enum": [m.value for m in tp]}
    if _is_record(tp):
        return {"$ref": f"#/$defs/{NAMES[tp]}"}
    raise TypeError(f"no JSON schema for {tp!r}")


def _fields(cls: Any) -> dict[str, Any]:
    return get_type_hints(cls, include_extras=True)


def _object(props: dict[str, dict[str, Any]], required: list[str]) -> dict[str, Any]:
    return {"type": "object", "required": required, "properties": props, "additionalProperties": False}


def _record(cls: Any) -> dict[str, Any]:
    """A dataclass record: every field but ``JSON_OMIT``, all of them present; or a TypedDict."""
    hints = _fields(cls)
    if dataclasses.is_dataclass(cls):
        omit = set(getattr(cls, "JSON_OMIT", ()))
        names = [f.name for f in dataclasses.fields(cls) if f.name not in omit]
        return _object({n: _schema(hints[n]) for n in names}, names)
    names = list(hints)
    required = [n for n in names if n in cls.__required_keys__]
    return _object({n: _schema(hints[n]) for n in names}, required)


def _finding() -> dict[str, Any]:
    """A finding (``Finding.to_dict``): kind, severity, the sentence, the location fields that are
    set, the details of its kind and the finding it is inherited from, if any."""
    hints = _fields(Finding)
    props: dict[str, dict[str, Any]] = {"kind": _schema(hints["kind"]), "severity": _schema(hints["severity"]),
                                        "message": {"type": "string"}}
    for k in Finding.LOCATION:   # written only where set: never null
        props[k] = _schema(get_args(hints[k])[0] if get_origin(hints[k]) in (Union, types.UnionType) else hints[k])
    props["details"] = {"type": "object"}
    props["inherited_from"] = {"type": "integer"}
    out = _object(props, ["kind", "severity", "message", "details"])
    out["allOf"] = [{"if": {"properties": {"kind": {"const": kind.value}}},
                     "then": {"properties": {"details": {"$ref": f"#/$defs/{NAMES[cls]}"}}}}
                    for kind, cls in DETAILS.items()]
    return out


def build() -> dict[str, Any]:
    """The schema, with one definition per record, in the order of :data:`NAMES`."""
    defs = {name: (_finding() if cls is Finding else _record(cls)) for cls, name in NAMES.items()}
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": "https://tensordiff.invalid/schemas/diff.schema.json",
        "title": "tensordiff diff --json",
        "description": f"The output of `tensordiff diff --json`, schema_version {SCHEMA_VERSION}: the result of a diff, "
                       "or, on bad input (exit 2), an error of tensordiff's own (exit 3) or an interrupt (exit 130), an "
                       "error object. Field by field in docs/json.md. Generated from the records "
                       "(python -m tensordiff.json_schema): do not edit.",
        "oneOf": [{"$ref": "#/$defs/result"}, {"$ref": "#/$defs/error"}],
        "$defs": defs,
    }


def dumps() -> str:
    return json.dumps(build(), indent=1, ensure_ascii=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    text = dumps()
    if args == ["--check"]:
        with open(PATH, encoding="utf-8") as fh:
            same = fh.read() == text
        if not same:
            sys.stderr.write(f"{PATH} differs from the records: python -m tensordiff.json_schema\n")
        return 0 if same else 1
    with open(PATH, "w", encoding="utf-8") as fh:
        fh.write(text)
    print(PATH)
    return 0


if __name__ == "__main__":
    sys.exit(main())

__all__ = ["NAMES", "PATH", "build", "dumps", "main"]
