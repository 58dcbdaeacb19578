"""The data model and its outputs, without torch: typed findings, sentences, the versioned JSON
(validated against the committed JSON Schema, round-tripped through DiffResult.from_dict), the
calibration and summary files' versions, and the identity rule on plain arrays."""

from __future__ import annotations

import json
import os

import h5py
import jsonschema
import pytest
from tracegen import write_pair, write_trace

from tensordiff.cli import jsonable, main
from tensordiff.diff import DiffOptions, diff_traces
from tensordiff.findings import (
    SCHEMA_VERSION,
    Candidate,
    DiffResult,
    Finding,
    Kind,
    NumericDetails,
    Severity,
    ShiftDetails,
    render_sentence,
)
from tensordiff.report.text import diff_schema

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = (os.path.join(ROOT, "traces", "train.h5"), os.path.join(ROOT, "traces", "serve.h5"))


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return write_pair(str(tmp_path_factory.mktemp("pair")))


@pytest.fixture(scope="module")
def wrong(tmp_path_factory, pair):
    """B's draft input holds [layer2, layer3] where A's holds [layer1, layer2]."""
    d = tmp_path_factory.mktemp("wrong")
    p = str(d / "b.h5")
    write_trace(p, side="serve", seed=1, noise=1e-6, packed_labels=("layer2", "layer3"))
    return pair[0], p


def _results(pair, wrong):
    out = [diff_traces(*pair), diff_traces(*wrong), diff_traces(wrong[1], wrong[0])]
    if all(os.path.exists(p) for p in EXAMPLE):
        out.append(diff_traces(*EXAMPLE))
    return out


def test_kinds_and_severities_compare_as_strings():
    f = Finding(Kind.NUMERIC, Severity.WARNING)
    assert f.kind == "numeric" and f"{f.kind}" == "numeric" and str(f.severity) == "warning"
    assert {"warning": 1}[f.severity] == 1 and Severity.DIVERGENCE.glyph == "✗"
    # old-style construction: strings and a details dict are turned into the typed forms
    g = Finding("token_shift", "divergence", details={"shift": 1, "sequences": 2, "of": 3})
    assert g.kind is Kind.TOKEN_SHIFT and isinstance(g.details, ShiftDetails) and g.details.shift == 1
    assert g.message.startswith("token shift of 1: B positions are A positions +1 in 2 of 3 sequences")


def test_sentence_is_rendered_from_the_details():
    f = Finding(Kind.NUMERIC, Severity.DIVERGENCE, tensor="layer2", seq="s0", position=3, position_b=3, token=7,
                regime="prefill", details=NumericDetails(subject="layer2", cos=0.5, rel=0.8, failing=2, tokens=9,
                                                         tolerance={"min_cos": 0.97, "max_rel": 0.25}))
    assert render_sentence(f) == f.message == (
        "layer2 diverges at token 7 (seq s0, position 3, prefill): 1 - cos 0.5, rel err 0.8 "
        "(tolerance 1 - cos <= 0.03, rel <= 0.25); 2 of 9 tokens fail")
    f.details.explained = True
    assert f.message.endswith("(explained by the wrong state above)")


def test_json_validates_against_the_committed_schema(pair, wrong):
    schema = diff_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    v = jsonschema.Draft202012Validator(schema)
    for res in _results(pair, wrong):
        d = jsonable(res.to_dict())
        errors = [f"{e.json_path}: {e.message}" for e in v.iter_errors(d)]
        assert not errors, errors[:5]
        assert d["schema_version"] == SCHEMA_VERSION


def test_the_committed_schema_is_the_generated_one():
    """tensordiff/schemas/diff.schema.json is generated from the records (tensordiff.json_schema):
    a field added to a record without writing the schema again fails here."""
    from tensordiff import json_schema

    with open(json_schema.PATH, encoding="utf-8") as fh:
        assert fh.read() == json_schema.dumps(), "run: python -m tensordiff.json_schema"
    assert json_schema.main(["--check"]) == 0
    schema = json_schema.build()
    # one definition per record, each naming every field its to_dict writes
    from tensordiff.findings import DETAILS, PairStats, SlotRow

    for cls in (*DETAILS.values(), SlotRow):
        assert schema["$defs"][json_schema.NAMES[cls]]["required"] == list(cls().to_dict())
    assert schema["$defs"]["tensor"]["required"] == list(PairStats().to_dict())


def test_json_has_no_internal_fields(pair, wrong):
    res = diff_traces(*wrong)
    d = res.to_dict()
    text = json.dumps(jsonable(d))
    assert "_tok_index" not in text
    for f in d["findings"]:
        assert "order" not in f and "index" not in f
    assert all("order" not in t for t in d["tensors"])
    assert all("index" not in w and "token_index" in w for w in d["worst_tokens"])


def test_json_round_trips(pair, wrong):
    for res in _results(pair, wrong):
        d = jsonable(res.to_dict())
        back = DiffResult.from_dict(json.loads(json.dumps(d)))
        assert jsonable(back.to_dict()) == d
        assert [f.message for f in back.findings] == [f.message for f in res.findings]
        assert all(f.text is None for f in back.findings)  # every sentence re-rendered from the details
        assert [f.index for f in back.findings] == list(range(len(res.findings)))
        assert back.headline() == res.headline() and back.exit_code == res.exit_code


@pytest.mark.parametrize("pattern", ["draft_input", "re:draft_input(': )?"])
def test_an_allowed_divergence_names_its_pattern_in_a_field(wrong, pattern):
    """--allow-failed marks the finding (``allowed_by``), not only its sentence; the JSON keeps the
    sentence as it was, and reading it back gives the field again (a pattern with quotes and ': ')."""
    from tensordiff.tolerances import tolerance_book

    res = diff_traces(*wrong, DiffOptions(tolerances=tolerance_book(allow_failed=[pattern])))
    allowed = [f for f in res.findings if f.allowed_by is not None]
    assert len(allowed) == 2 and res.exit_code == 0
    assert all(f.allowed_by == pattern and f.severity == Severity.WARNING and f.text is None for f in allowed)
    assert allowed[0].message == f"allowed by --allow-failed {pattern!r}: {render_sentence(allowed[0])}"
    d = json.loads(json.dumps(jsonable(res.to_dict())))
    back = DiffResult.from_dict(d)
    assert [f.allowed_by for f in back.findings] == [f.allowed_by for f in res.findings]
    assert all(f.text is None for f in back.findings)
    assert back.headline() == res.headline() and back.headline().startswith("no divergence outside the 2 allowed")
    assert jsonable(back.to_dict()) == d


def test_from_dict_refuses_another_schema_version(pair):
    d = diff_traces(*pair).to_dict()
    d["schema_version"] = 99
    with pytest.raises(ValueError, match="schema_version"):
        DiffResult.from_dict(d)


def test_wrong_slots_named_with_typed_evidence(wrong):
    res = diff_traces(*wrong)
    ids = [f for f in res.divergences if f.kind == Kind.SLOT_IDENTITY]
    holds = " (each holds what it claims; the draft was trained on train's)"
    assert [f.message for f in ids] == ["slot 0 of draft_input: train feeds layer1, serve feeds layer2" + holds,
                                        "slot 1 of draft_input: train feeds layer2, serve feeds layer3" + holds]
    d = ids[0].details
    assert d.held == "layer2" and d.expected == "layer1" and isinstance(d.candidates[0], Candidate)
    assert ids[0].details.token_index is not None and ids[0].token_index == d.token_index


def test_calibration_and_summary_files_are_versioned(tmp_path, capsys, pair):
    out = tmp_path / "tol.json"
    assert main(["calibrate", *pair, "--out", str(out)]) == 0
    assert json.loads(out.read_text())["schema_version"] == 1
    s = tmp_path / "sum.h5"
    diff_traces(*pair, DiffOptions(summary_path=str(s)))
    with h5py.File(s) as f:
        assert int(f.attrs["schema_version"]) == 1
    capsys.readouterr()


def test_sinks_receive_every_block(pair):
    seen = []

    class Sink:
        def write(self, ia, ib, k, blk, m, bad):
            seen.append((ia.name, k, len(blk), bad.shape))

        def close(self):
            seen.append("closed")

    res = diff_traces(*pair, DiffOptions(sinks=[lambda al, ra, rb: Sink()], block_rows=5))
    assert seen[-1] == "closed"
    per_tensor: dict = {}
    for name, k, n, shape in seen[:-1]:
        assert shape == (n, k)
        per_tensor[name] = per_tensor.get(name, 0) + n
    assert per_tensor == {p.name_a: p.tokens for p in res.pairs}


@pytest.mark.parametrize("body,expect", [
    ('{"tolerances": {"x": {"min_cos": 2, "max_rel": 0.1}}}', "min_cos 2.0"),
    ('{"tolerances": {"x": {"min_cos": 0.9, "max_rel": -1}}}', "max_rel -1.0"),
    ('{"tolerances": {"x": {"min_cos": 0.9, "max_rel": Infinity}}}', "max_rel inf"),
    ('{"schema_version": 9, "tolerances": {}}', "schema_version 9"),
])
def test_calibration_files_are_validated(tmp_path, body, expect):
    from tensordiff.errors import SourceFileError
    from tensordiff.tolerances import ToleranceBook
    p = tmp_path / "cal.json"
    p.write_text(body)
    with pytest.raises(SourceFileError, match=expect.replace(".", r"\.")):
        ToleranceBook().load_calibration(str(p))


def test_default_tolerance_grows_with_depth_to_a_cap():
    from tensordiff.tolerances import default_tolerance
    t = [default_tolerance("float32", "bfloat16", d) for d in (0, 8, 61, 500)]
    assert t[0].min_cos > t[1].min_cos > t[2].min_cos == t[3].min_cos >= 0.9
    assert t[0].max_rel < t[1].max_rel < t[2].max_rel == t[3].max_rel <= 0.6
    assert default_tolerance("bfloat16", "bfloat16", 8).max_rel > t[1].max_rel   # both sides round
    assert default_tolerance("float32", "float32", 0).min_cos == 1 - 1e-6


def test_token_table_findings_come_first_whatever_a_tensors_order():
    """The sort key ranks what the token tables say (recovered, shift, mismatch, gap) before any
    tensor's finding, even one recorded with a negative forward order."""
    from tensordiff.diff.order import order as order_findings
    from tensordiff.findings import GapDetails, RecoveredDetails, TokenMismatchDetails
    gap = Finding(Kind.GAP, Severity.INFO, seq="s0", details=GapDetails(seq="s0"))
    shift = Finding(Kind.TOKEN_SHIFT, Severity.DIVERGENCE, seq="s0", details=ShiftDetails(shift=1))
    mismatch = Finding(Kind.TOKEN_MISMATCH, Severity.DIVERGENCE, seq="s0", details=TokenMismatchDetails(seq="s0"))
    recovered = Finding(Kind.RECOVERED, Severity.INFO, details=RecoveredDetails(side="serve"))
    early = Finding(Kind.NUMERIC, Severity.DIVERGENCE, tensor="embed", order=-5.0, details=NumericDetails())
    forward = sorted([early, gap, mismatch, shift, recovered], key=lambda f: f.sort_key())
    assert [f.kind for f in forward] == [Kind.RECOVERED, Kind.TOKEN_SHIFT, Kind.TOKEN_MISMATCH, Kind.GAP, Kind.NUMERIC]
    # shown divergences first, then notes, each group in that forward order, numbered as shown
    got = order_findings([early, gap, mismatch, shift, recovered])
    assert [f.kind for f in got] == [Kind.TOKEN_SHIFT, Kind.TOKEN_MISMATCH, Kind.NUMERIC, Kind.RECOVERED, Kind.GAP]
    assert [f.index for f in got] == [0, 1, 2, 3, 4]
