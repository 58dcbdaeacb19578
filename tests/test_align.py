"""The aligner and `tensordiff diff` on traces built from a real tiny HF Llama (random weights)."""

import json

import h5py
import numpy as np
import pytest
import torch
from hf_traces import N_LAYERS, prompts, tiny_llama, write_trace

from tensordiff.cli import main
from tensordiff.diff import diff_traces

pytestmark = pytest.mark.torch

TRAIN = ["embed", "layer3", "layer5"]
#: the first line of the founding bug: each side holds what it claims, and the claims differ
FOUNDING = ("train feeds draft_input [embed, layer3, layer5], serve feeds [layer3, layer5, layer7]; "
            "the draft was trained on train's")
HOLDS = " (each holds what it claims; the draft was trained on train's)"


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


@pytest.fixture(scope="module")
def seqs():
    return prompts()


@pytest.fixture(scope="module")
def train(tmp_path_factory, model, seqs):
    p = tmp_path_factory.mktemp("train") / "train.h5"
    write_trace(p, model, seqs, TRAIN, side="train")
    return str(p)


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_founding_bug_names_slot_zero(tmp_path, capsys, model, seqs, train):
    serve = tmp_path / "serve.h5"
    write_trace(serve, model, seqs, ["layer3", "layer5", "layer7"], side="serve")
    code, out, err = run(capsys, "diff", train, str(serve), "-q")
    assert code == 1, err
    assert out.splitlines()[0] == FOUNDING
    code, out, _ = run(capsys, "diff", train, str(serve), "--json")
    res = json.loads(out)
    assert res["exit_code"] == 1 and res["first_divergence"]["kind"] == "slot_identity"
    table = {r["slot"]: r for r in res["slot_table"]}
    assert [(table[s]["expected"], table[s]["held_b"]) for s in range(3)] == \
        [("embed", "layer3"), ("layer3", "layer5"), ("layer5", "layer7")]
    assert all(table[s]["score_b"] > 0.9999 and table[s]["margin_b"] > 0.01 for s in range(3))
    # the catalog boundaries themselves agree: only the wiring differs
    assert all(sum(p["failing"]) == 0 for p in res["tensors"] if p["name_a"] != "draft_input")


def test_fp32_vs_bf16_same_wiring_agrees(tmp_path, capsys, model, seqs, train):
    serve = tmp_path / "serve_bf16.h5"
    write_trace(serve, model, seqs, TRAIN, side="serve", dtype=torch.bfloat16)
    code, out, err = run(capsys, "diff", train, str(serve), "-q")
    assert code == 0, out + err
    with h5py.File(serve) as f:
        assert f["tensors/layer5/values"].attrs["dtype"] == "bfloat16"
    res = diff_traces(train, str(serve))
    # it is real bf16 noise, not zero, and the slots are still identified
    assert max(max(p.rel_max) for p in res.pairs) > 1e-3
    assert [r.held_b for r in res.slot_table] == TRAIN


def test_token_shift_of_one_is_a_shift_not_numeric(tmp_path, capsys, model, seqs, train):
    serve = tmp_path / "serve_shift.h5"
    write_trace(serve, model, seqs, TRAIN, side="serve", shift=1)
    res = diff_traces(train, str(serve))
    assert res.exit_code == 1
    first = res.first_divergence
    assert first.kind == "token_shift" and first.details.shift == 1
    assert res.headline().startswith("token shift of 1")
    assert not [f for f in res.findings if f.kind in ("numeric", "slot_identity", "nonfinite")]


def test_prefix_cache_gap_is_not_divergence(tmp_path, capsys, model, seqs, train):
    serve = tmp_path / "serve_gap.h5"
    write_trace(serve, model, seqs[:1], TRAIN, side="serve", drop=8)
    code, out, _ = run(capsys, "diff", train, str(serve), "-q")
    assert code == 0, out
    res = diff_traces(train, str(serve))
    gap = [g for g in res.gaps if g.side == "a" and g.positions == [[0, 7]]]
    assert gap and gap[0].count == 8 and "prefix-cache" in gap[0].reason
    assert "gap: 8 tokens" in out


def test_two_train_traces_that_feed_different_states_name_a_as_the_reference(tmp_path, model, seqs, train):
    """Both traces are train traces (named A and B): no side is the one the draft was trained on,
    so the sentence says which is the reference."""
    fixed = tmp_path / "fixed.h5"
    write_trace(fixed, model, seqs, ["layer3", "layer5", "layer7"], side="train")
    res = diff_traces(str(fixed), train)
    assert res.headline() == "A feeds draft_input [layer3, layer5, layer7], B feeds [embed, layer3, layer5]; A is the reference"


def test_pre_norm_last_boundary_where_final_norm_expected(tmp_path, capsys, model, seqs):
    a, b = tmp_path / "a.h5", tmp_path / "b.h5"
    write_trace(a, model, seqs, ["layer2", "layer4", "final_norm"], side="train")
    write_trace(b, model, seqs, ["layer2", "layer4", f"layer{N_LAYERS}"], side="serve")
    res = diff_traces(str(a), str(b))
    assert res.headline() == ("train feeds draft_input [layer2, layer4, final_norm], serve feeds "
                              f"[layer2, layer4, layer{N_LAYERS}]; the draft was trained on train's")
    row = res.slot_table[2]
    assert row.held_a == "final_norm" and row.held_b == f"layer{N_LAYERS}"


def test_nan_at_one_boundary_is_first_divergence(tmp_path, model, seqs, train):
    serve = tmp_path / "serve_nan.h5"
    write_trace(serve, model, seqs, TRAIN, side="serve", nan_at=("layer4", 1, 10))
    res = diff_traces(train, str(serve))
    f = res.first_divergence
    assert (f.kind, f.tensor, f.position, f.token) == ("nonfinite", "layer4", 10, seqs[1][10])
    assert "NaN/Inf in layer4" in res.headline()


def test_permuted_slots_each_named(tmp_path, model, seqs, train):
    serve = tmp_path / "serve_perm.h5"
    write_trace(serve, model, seqs, ["layer5", "embed", "layer3"], side="serve")
    res = diff_traces(train, str(serve))
    assert [r.held_b for r in res.slot_table] == ["layer5", "embed", "layer3"]
    msgs = [f.message for f in res.divergences]
    assert msgs[:3] == ["slot 0 of draft_input: train feeds embed, serve feeds layer5" + HOLDS,
                        "slot 1 of draft_input: train feeds layer3, serve feeds embed" + HOLDS,
                        "slot 2 of draft_input: train feeds layer5, serve feeds layer3" + HOLDS]


def test_identity_from_sketches_when_serve_has_no_full_catalog(tmp_path, model, seqs, train):
    """Serve side keeps only sketches of its catalog; the slot is still identified (and its own
    catalog is preferred)."""
    serve = tmp_path / "serve_sk.h5"
    write_trace(serve, model, seqs, ["layer3", "layer5", "layer7"], side="serve", sketch_only=True)
    res = diff_traces(train, str(serve))
    assert res.headline() == FOUNDING
    assert res.slot_table[0].candidates_b[0].basis in ("values", "sketch")


def test_serve_without_catalog_uses_train_catalog(tmp_path, model, seqs, train):
    serve = tmp_path / "serve_nocat.h5"
    write_trace(serve, model, seqs, ["layer3", "layer5", "layer7"], side="serve", catalog=False)
    res = diff_traces(train, str(serve))
    assert res.headline() == FOUNDING
    assert res.slot_table[0].candidates_b[0].side == "a"


def test_calibration_from_noise_floor(tmp_path, capsys, model, seqs, train):
    bf = tmp_path / "bf.h5"
    write_trace(bf, model, seqs, TRAIN, side="serve", dtype=torch.bfloat16)
    tol = tmp_path / "tol.json"
    code, _out, err = run(capsys, "calibrate", train, str(bf), "--out", str(tol))
    assert code == 0, err
    data = json.loads(tol.read_text())["tolerances"]
    assert "draft_input[0]" in data and data["layer5"]["max_rel"] > 0
    # calibrated on bf16 noise, the same pair agrees; a wiring bug still fails
    assert run(capsys, "diff", train, str(bf), "-q", "--calibration", str(tol))[0] == 0
    wrong = tmp_path / "wrong.h5"
    write_trace(wrong, model, seqs, ["layer3", "layer5", "layer7"], side="serve", dtype=torch.bfloat16)
    assert run(capsys, "diff", train, str(wrong), "-q", "--calibration", str(tol))[0] == 1
    # calibrating on a wiring bug is refused
    code, _, err = run(capsys, "calibrate", train, str(wrong), "--out", str(tmp_path / "x.json"))
    assert code == 2 and "not a noise-floor pair" in err


def test_tolerance_override_makes_bf16_fail(tmp_path, capsys, model, seqs, train):
    bf = tmp_path / "bf2.h5"
    write_trace(bf, model, seqs, TRAIN, side="serve", dtype=torch.bfloat16)
    code, out, _ = run(capsys, "diff", train, str(bf), "-q", "--tol", "layer5=0.9999999,0.0001")
    assert code == 1 and out.splitlines()[0].startswith("layer5 diverges at token")


def _one_line_exit2(capsys, *argv):
    code, _out, err = run(capsys, *argv)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tensordiff: error:") and "Traceback" not in err
    return lines[0]


def test_no_common_tokens(tmp_path, capsys, model, train):
    other = tmp_path / "other.h5"
    write_trace(other, model, prompts(seed=99), TRAIN, side="serve")
    assert "no common tokens" in _one_line_exit2(capsys, "diff", train, str(other))


def test_packed_width_not_multiple_of_hidden(tmp_path, capsys, train):
    from tensordiff.trace import SlotSpec, TraceWriter
    bad = tmp_path / "bad.h5"
    with TraceWriter(bad, side="serve", model={"num_layers": N_LAYERS, "hidden_size": 64}) as w:
        w.define_tensor("draft_input", 120, kind="packed", slots=SlotSpec(["embed", "layer3"]), slot_width=60)
        w.append("draft_input", w.add_tokens("s", range(3), [1, 2, 3], "prefill"), np.zeros((3, 120), np.float32))
    msg = _one_line_exit2(capsys, "diff", train, str(bad))
    assert "width 120, not a multiple of the hidden size 64" in msg


def test_different_hidden_sizes(tmp_path, capsys, train):
    from tensordiff.trace import TraceWriter
    other = tmp_path / "h128.h5"
    with TraceWriter(other, side="serve", model={"num_layers": N_LAYERS, "hidden_size": 128}) as w:
        w.define_tensor("embed", 128, kind="boundary", boundary=0)
        w.append("embed", w.add_tokens("s", range(3), [1, 2, 3], "prefill"), np.zeros((3, 128), np.float32))
    assert "different hidden sizes" in _one_line_exit2(capsys, "diff", train, str(other))


def test_summary_file_has_per_token_metrics(tmp_path, model, seqs, train):
    from tensordiff.diff import DiffOptions
    from tensordiff.summary import SummaryReader
    serve = tmp_path / "s.h5"
    write_trace(serve, model, seqs, ["layer3", "layer5", "layer7"], side="serve")
    res = diff_traces(train, str(serve), DiffOptions(summary_path=str(tmp_path / "sum.h5")))
    s = SummaryReader(str(tmp_path / "sum.h5"))
    assert s.n == res.tokens_aligned == sum(len(q) for q in seqs)
    j = s.labels.index("draft_input[0]")
    rel = s.block(0, s.n, metric=1)[:, j]
    assert np.all(rel > 0.1) and np.all(s.block(0, s.n, 3)[:, j] >= 1)
    s.close()


def test_capture_only_aux_pairs_with_draft_input(tmp_path, model, seqs, train):
    """A capture-only serve trace has the target's aux states (role aux, row t paired with no
    draft token) where train has the draft input: same states at row t, so no pairing finding."""
    serve = tmp_path / "aux.h5"
    write_trace(serve, model, seqs, TRAIN, side="serve", packed=("aux_hidden_states", "aux", 0))
    res = diff_traces(train, str(serve))
    assert res.exit_code == 0, res.headline()
    assert [r.held_b for r in res.slot_table] == TRAIN
    wrong = tmp_path / "aux_wrong.h5"
    write_trace(wrong, model, seqs, ["layer3", "layer5", "layer7"], side="serve", packed=("aux_hidden_states", "aux", 0))
    res = diff_traces(train, str(wrong))
    assert res.headline() == FOUNDING.replace("draft_input", "aux_hidden_states")
