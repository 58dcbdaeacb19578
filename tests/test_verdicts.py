"""Verdicts a user can trust, on real trace files of tiny HF Llamas, most of them
near-residual (consecutive boundaries at cos 0.99-0.9999, as in a trained deep model): each case
is a way the diff used to answer wrongly, and a false-alarm sweep of correctly wired pairs."""

from __future__ import annotations

import json

import pytest
import torch
from hf_traces import (
    near_residual_llama,
    prompts,
    shared_prefix_prompts,
    tiny_llama,
    write_trace,
)

from tensordiff.cli import main
from tensordiff.diff import diff_traces

pytestmark = pytest.mark.torch

TRAIN = ["embed", "layer3", "layer5"]


@pytest.fixture(scope="module")
def nr8():
    return near_residual_llama(8)


@pytest.fixture(scope="module")
def seqs():
    return prompts()


@pytest.fixture(scope="module")
def train8(tmp_path_factory, nr8, seqs):
    p = tmp_path_factory.mktemp("nr8") / "train.h5"
    write_trace(p, nr8, seqs, TRAIN, side="train")
    return str(p)


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def _valid(res):
    """The result's JSON matches the committed schema and round-trips."""
    import jsonschema

    from tensordiff.cli import jsonable
    from tensordiff.findings import DiffResult
    from tensordiff.report.text import diff_schema
    d = jsonable(res.to_dict())
    jsonschema.validate(d, diff_schema())
    assert jsonable(DiffResult.from_dict(json.loads(json.dumps(d))).to_dict()) == d


def _identity(res, slot):
    return [f for f in res.findings if f.kind == "slot_identity" and f.slot == slot]


def test_near_residual_model_looks_trained(nr8, seqs):
    """The construction does what the helper says: consecutive boundaries at cos 0.99-0.9999."""
    from hf_traces import states
    st = states(nr8, seqs[0])
    cos = [torch.nn.functional.cosine_similarity(st[f"layer{b}" if b else "embed"], st[f"layer{b + 1}"], dim=-1)
           for b in range(8)]
    c = torch.stack(cos)
    assert float(c.min()) > 0.99 and float(c.mean()) < 0.9999


# ----------------------------------------------------------------------------------------------
# identity


def test_absent_state_is_not_named_as_a_neighbour(tmp_path, nr8, seqs, train8):
    """A hook-point bug: slot 1 holds the mid-layer state h3 + attn3 (no catalog records it) and
    claims layer3. It used to read "holds layer4" (or layer3): a confident wrong sentence."""
    serve = tmp_path / "serve.h5"
    write_trace(serve, nr8, seqs, ["embed", "mid3", "layer5"], side="serve", claims=TRAIN)
    res = diff_traces(train8, str(serve))
    assert res.exit_code == 1
    (f,) = [f for f in _identity(res, 1) if f.severity == "divergence"]
    assert f.details.outcome == "no_state" and f.details.closest in ("layer3", "layer4")
    assert "but equal to no recorded state (1 - cos " in f.message and f.message.endswith("where layer3 was expected")
    assert res.headline() == f.message
    ev = f.details.evidence
    assert not ev.exact and not ev.within_floor and ev.cos > 0.99
    assert res.slot_table[1].verdict == "unknown state" and res.slot_table[1].held_b is None
    _valid(res)


@pytest.mark.parametrize("order", ["train_serve", "serve_train"])
def test_sides_that_each_hold_their_claim_are_said_to_feed_different_states(tmp_path, nr8, seqs, train8, order):
    """The founding bug: train's extractor feeds [embed, layer3, layer5] and says so, serve feeds
    [layer3, layer5, layer7] and says so. Neither trace is wrong about itself: the first line says
    what each side feeds and that the draft was trained on train's, in both argument orders (it
    used to read "slot 0 holds layer3 where embed was expected", as if serve were at fault)."""
    serve = tmp_path / "serve.h5"
    write_trace(serve, nr8, seqs, ["layer3", "layer5", "layer7"], side="serve")
    a, b = (train8, str(serve)) if order == "train_serve" else (str(serve), train8)
    res = diff_traces(a, b)
    assert res.exit_code == 1
    feeds = {"train": "[embed, layer3, layer5]", "serve": "[layer3, layer5, layer7]"}
    na, nb = ("train", "serve") if order == "train_serve" else ("serve", "train")
    assert res.headline() == f"{na} feeds draft_input {feeds[na]}, {nb} feeds {feeds[nb]}; the draft was trained on train's"
    f = res.first_divergence
    held = {"train": "embed", "serve": "layer3"}
    assert f.message == (f"slot 0 of draft_input: {na} feeds {held[na]}, {nb} feeds {held[nb]} "
                         "(each holds what it claims; the draft was trained on train's)")
    assert f.details.side_name_a == na
    _valid(res)


@pytest.mark.parametrize("order", ["train_serve", "serve_train"])
def test_a_side_that_does_not_hold_its_claim_is_still_named(tmp_path, nr8, seqs, train8, order):
    """Serve claims what train claims but feeds [layer3, layer5, layer7]: serve is wrong about
    itself, so the first line says what it holds where the claim was expected, not "feeds"."""
    serve = tmp_path / "serve.h5"
    write_trace(serve, nr8, seqs, ["layer3", "layer5", "layer7"], side="serve", claims=TRAIN)
    a, b = (train8, str(serve)) if order == "train_serve" else (str(serve), train8)
    res = diff_traces(a, b)
    assert res.exit_code == 1
    assert "feeds" not in res.headline()
    if order == "train_serve":
        assert res.headline() == "slot 0 of draft_input holds layer3 where embed was expected"
    else:   # A (serve) is wrong about its own slot, and B holds what A claims: A is at fault
        assert res.headline() == "serve labels slot 0 of draft_input embed but it holds layer3"
    assert all(f.details.side_name_a is None for f in res.findings if f.kind == "slot_identity")
    _valid(res)


def test_near_off_by_one_in_bf16_is_named(tmp_path):
    """32 layers with residual branches scaled by 0.0003 (consecutive boundaries at cos 0.9999+),
    serve in bf16 with slot 1 one layer off. The margin of mean scores (1e-4) was under the fixed
    0.002: "ambiguous", no finding, the slot "ok", exit 0."""
    m = near_residual_llama(32, alpha=0.0003)
    s = prompts()
    a, b = tmp_path / "a.h5", tmp_path / "b.h5"
    write_trace(a, m, s, ["embed", "layer10", "layer20"], side="train")
    write_trace(b, m, s, ["embed", "layer11", "layer20"], side="serve", dtype=torch.bfloat16,
                claims=["embed", "layer10", "layer20"])
    res = diff_traces(str(a), str(b))
    assert res.exit_code == 1
    assert res.headline() == "slot 1 of draft_input holds layer11 where layer10 was expected"
    f = res.first_divergence
    assert f.details.evidence.exact  # serve's own bf16 catalog holds exactly these values
    assert [r.verdict for r in res.slot_table] == ["ok", "wrong state", "ok"]
    # without a serve catalog, the paired test against train's fp32 catalog decides
    c = tmp_path / "c.h5"
    write_trace(c, m, s, ["embed", "layer11", "layer20"], side="serve", dtype=torch.bfloat16, catalog=False,
                claims=["embed", "layer10", "layer20"])
    res = diff_traces(str(a), str(c))
    assert res.headline() == "slot 1 of draft_input holds layer11 where layer10 was expected"
    ev = res.first_divergence.details.evidence
    assert ev.decided_by == "paired test" and ev.win_rate >= 0.75 and ev.z >= 3


def test_partial_serve_catalog_still_names_the_state(tmp_path, nr8, seqs, train8):
    """Serve's catalog covers 4 of 24 positions per sequence (catalog taps on eager passes only).
    It used to remove train's candidates of the same labels: "holds no recorded state"."""
    serve = tmp_path / "serve.h5"
    write_trace(serve, nr8, seqs, ["layer3", "layer5", "layer7"], side="serve", catalog_positions=4)
    res = diff_traces(train8, str(serve))
    assert res.headline() == ("train feeds draft_input [embed, layer3, layer5], serve feeds [layer3, layer5, layer7]; "
                              "the draft was trained on train's")
    assert [r.held_b for r in res.slot_table] == ["layer3", "layer5", "layer7"]


def test_right_state_wrong_scale_is_named(tmp_path, nr8, seqs, train8):
    """A norm applied before the draft's fc (sglang#32334): slot 1 holds RMSNorm(layer3)."""
    serve = tmp_path / "serve.h5"
    write_trace(serve, nr8, seqs, ["embed", "norm(layer3)", "layer5"], side="serve", claims=TRAIN)
    res = diff_traces(train8, str(serve))
    f = res.first_divergence
    assert f.kind == "slot_identity" and f.slot == 1 and f.details.outcome == "scaled"
    assert f.message.startswith("slot 1 of draft_input holds layer3 scaled by ")
    assert "(RMS ratio) where layer3 was expected" in f.message
    assert res.slot_table[1].verdict == "scaled"
    _valid(res)


def test_train_side_label_error_names_train(tmp_path, nr8, seqs):
    """Train feeds layer2 but labels it layer5; serve feeds and labels layer5. The headline used to
    blame serve ("holds layer5 where layer2 was expected")."""
    a, b = tmp_path / "a.h5", tmp_path / "b.h5"
    write_trace(a, nr8, seqs, ["embed", "layer2", "layer7"], side="train", claims=["embed", "layer5", "layer7"])
    write_trace(b, nr8, seqs, ["embed", "layer5", "layer7"], side="serve")
    res = diff_traces(str(a), str(b))
    assert res.headline() == "train labels slot 1 of draft_input layer5 but it holds layer2"
    assert res.slot_table[1].verdict == "wrong label"
    _valid(res)


def test_shift_on_the_reference_side_is_named(tmp_path, nr8, seqs):
    """Train's draft rows hold the next token's states. It used to read "numeric drift" with
    "train holds layer3, serve holds layer3"; the same bug on serve was named."""
    a, b = tmp_path / "a.h5", tmp_path / "b.h5"
    write_trace(a, nr8, seqs, TRAIN, side="train", slot_shift=1)
    write_trace(b, nr8, seqs, TRAIN, side="serve")
    res = diff_traces(str(a), str(b))
    assert res.exit_code == 1
    assert res.headline() == "train labels slot 0 of draft_input embed but it holds embed of the token 1 position later"
    row = res.slot_table[0]
    assert row.offset_a == 1 and row.offset_b == 0
    _valid(res)
    # the same bug on the side under test, as before
    res = diff_traces(str(b), str(a))
    assert res.headline() == "slot 0 of draft_input holds embed of the token 1 position later where embed was expected"


# ----------------------------------------------------------------------------------------------
# tokens


def test_shared_prefix_with_a_radix_hit_pairs_the_right_sequences(tmp_path, nr8):
    """Three requests share a system prompt. Serve computed request 0 with 4 wrong tokens (its true
    partner) and request 1 from a prefix-cache hit (no rows for the prompt) and without its last
    token. It used to pair badly, call the corrupted partner a gap and exit 0."""
    s = shared_prefix_prompts(3, prefix=12, length=24)
    bad = list(s[0])
    for p in (14, 15, 16, 17):
        bad[p] = (bad[p] % 255) + 1
    a = tmp_path / "a.h5"
    write_trace(a, nr8, s, TRAIN, side="train")
    b = tmp_path / "b.h5"
    write_trace(b, nr8, [bad, s[1], s[2]], TRAIN, side="serve", drop=[0, 12, 0])
    res = diff_traces(str(a), str(b))
    pairs = {p.a: p.b for p in res.sequences}
    assert pairs == {"train-0": "serve-0", "train-1": "serve-1", "train-2": "serve-2"}
    assert res.exit_code == 1
    f = res.first_divergence
    assert f.kind == "token_mismatch" and f.details.count == 4 and f.details.positions == [[14, 17]]
    assert res.headline().startswith("token mismatch: 4 positions of sequence train-0")
    gap = [g for g in res.gaps if g.seq == "train-1"]
    assert [g.positions for g in gap] == [[[0, 11]]] and "prefix-cache" in gap[0].reason
    _valid(res)


def test_prefix_gap_is_recognised_when_the_tail_is_missing_too(tmp_path, nr8, seqs, train8):
    serve = tmp_path / "serve.h5"
    write_trace(serve, nr8, seqs, TRAIN, side="serve", drop=8, drop_tail=1)
    res = diff_traces(train8, str(serve))
    assert res.exit_code == 0, res.headline()
    reasons = {g.reason.split(" (")[0]: g for g in res.gaps if g.seq == "train-0"}
    assert reasons["leading positions absent on B"].positions == [[0, 7]]
    assert reasons["trailing positions absent on B"].positions == [[23, 23]]


def test_gaps_collapse_and_divergences_come_first(tmp_path, capsys):
    """40 requests, 25 of them prefix-cache hits, and one wiring bug: the divergence is the first
    finding listed, and the gaps are one line per reason."""
    m = tiny_llama()
    s = prompts(40, length=10, seed=5)
    a, b = tmp_path / "a.h5", tmp_path / "b.h5"
    write_trace(a, m, s, TRAIN, side="train")
    write_trace(b, m, s, ["layer3", "layer3", "layer5"], side="serve", drop=[2] * 25 + [0] * 15)
    code, out, _ = run(capsys, "diff", a, b, "-q", "--max-findings", "2")
    lines = out.splitlines()
    assert code == 1 and lines[0] == ("train feeds draft_input [embed, layer3, layer5], serve feeds [layer3, layer3, layer5]; "
                                   "the draft was trained on train's")
    i = next(j for j, line in enumerate(lines) if line.startswith("findings ("))
    assert lines[i + 1].lstrip().startswith("✗") and "train feeds embed, serve feeds layer3" in lines[i + 1]
    res = diff_traces(str(a), str(b))
    gap_findings = [f for f in res.findings if f.kind == "gap"]
    assert len(gap_findings) == 1 and gap_findings[0].details.sequences == 25 and gap_findings[0].details.count == 50
    assert "50 tokens in 25 sequences only on train" in gap_findings[0].message


# ----------------------------------------------------------------------------------------------
# coverage and tolerances


def test_nothing_compared_is_bad_input(tmp_path, capsys, nr8, seqs):
    """Sketch-only traces with different sketch seeds: nothing can be compared. It used to say
    "no divergence: ... agree" and exit 0."""
    a, b = tmp_path / "a.h5", tmp_path / "b.h5"
    write_trace(a, nr8, seqs, TRAIN, side="train", sketch_only=True, packed_values=False)
    write_trace(b, nr8, seqs, TRAIN, side="serve", sketch_only=True, packed_values=False, sketch_seed=7)
    code, _out, err = run(capsys, "diff", a, b, "-q")
    assert code == 2 and "nothing compared" in err and "seed 7" in err and "seed 20260" in err


def test_partial_coverage_is_not_agree(tmp_path, capsys, nr8, seqs, train8):
    """Serve's draft input shares no token with train's: the other tensors agree, the verdict says
    10 of 11 compared and the warning says why."""
    a, b = tmp_path / "a.h5", tmp_path / "b.h5"
    write_trace(a, nr8, seqs, TRAIN, side="train", packed_seqs=[0])
    write_trace(b, nr8, seqs, TRAIN, side="serve", packed_seqs=[1, 2])
    res = diff_traces(str(a), str(b))
    assert res.verdict == "incomplete" and res.exit_code == 1   # exit 0 means compared and agree
    assert res.headline().startswith("no divergence in the 10 of 11 tensors compared")
    (w,) = [f for f in res.findings if f.kind == "missing" and f.severity == "warning"]
    assert "none in common" in w.details.reason_text
    _valid(res)
    code, out, _ = run(capsys, "diff", a, b, "--json", "--allow-incomplete")   # the opt-in
    assert code == 0
    d = json.loads(out)
    assert d["verdict"] == "incomplete" and d["tensors_compared"] == 10 and d["exit_code"] == 0
    # without a flag it fails, and the JSON says the exit code it sets
    code, out, _ = run(capsys, "diff", a, b, "--json")
    d = json.loads(out)
    assert code == 1 and d["verdict"] == "incomplete" and d["exit_code"] == 1
    code, out, _ = run(capsys, "diff", a, b, "-q")
    assert code == 1 and "10 of 11 tensors compared" in out
    code, _, _ = run(capsys, "report", a, b, "-o", str(tmp_path / "r.html"))
    assert code == 1
    # --require-complete asked for the default and is gone: one line, exit 2, no flag of the opposite sense offered
    for cmd in (["diff", a, b, "-q"], ["report", a, b, "-o", str(tmp_path / "r2.html")]):
        code, _, err = run(capsys, *cmd, "--require-complete")
        assert code == 2 and err.count("\n") == 1 and "unrecognized arguments: --require-complete" in err, err
        assert "did you mean" not in err
    # the testing API never calls it agreement unless told to
    from tensordiff.testing import TracesDisagree, assert_traces_agree
    with pytest.raises(TracesDisagree) as ei:
        assert_traces_agree(a, b)
    msg = str(ei.value)
    assert msg.startswith("traces not fully compared: no divergence in the 10 of 11") and "none in common" in msg
    assert assert_traces_agree(a, b, allow_incomplete=True).verdict == "incomplete"


def test_nan_calibration_is_refused(tmp_path, capsys, nr8, seqs, train8):
    """A calibration file with NaN tolerances used to turn a divergence into exit 0."""
    wrong = tmp_path / "wrong.h5"
    write_trace(wrong, nr8, seqs, ["layer3", "layer5", "layer7"], side="serve")
    cal = tmp_path / "cal.json"
    cal.write_text('{"schema_version": 1, "tolerances": {"*": {"min_cos": NaN, "max_rel": NaN}}}')
    code, _, err = run(capsys, "diff", train8, wrong, "-q", "--calibration", cal)
    assert code == 2 and "min_cos nan" in err and err.count("\n") == 1


def test_calibrate_clamps_and_warns(tmp_path, capsys):
    """A "noise pair" whose noise is far past what the dtype explains: calibrate clamps the
    tolerance and says so (it used to write min_cos 0.73 silently)."""
    m = tiny_llama(layers=8)
    m2 = tiny_llama(seed=0, layers=8)
    with torch.no_grad():
        for p in m2.model.layers[5].parameters():
            p.add_(0.05 * torch.randn_like(p))   # honest-looking but large numeric differences from layer 6 on
    s = prompts()
    a, b = tmp_path / "a.h5", tmp_path / "b.h5"
    write_trace(a, m, s, TRAIN, side="train")
    write_trace(b, m2, s, TRAIN, side="serve")
    out = tmp_path / "tol.json"
    code, _, err = run(capsys, "calibrate", a, b, "--out", out)
    assert code == 0 and "clamped" in err
    data = json.loads(out.read_text())
    assert data["warnings"] and any(t["source"] == "calibrated (clamped)" for t in data["tolerances"].values())
    assert min(t["min_cos"] for t in data["tolerances"].values()) > 0.9


@pytest.mark.parametrize("layers", [8, 32, 61])
def test_false_alarm_sweep_bf16_vs_fp32(tmp_path, capsys, layers):
    """Correctly wired bf16-vs-fp32 pairs of near-residual models exit 0, in both argument orders."""
    m = near_residual_llama(layers, hidden=64)
    s = prompts(6, length=24, seed=11)
    slots = ["embed", f"layer{layers // 2}", f"layer{layers}"]
    a, b = tmp_path / "a.h5", tmp_path / "b.h5"
    write_trace(a, m, s, slots, side="train")
    write_trace(b, m, s, slots, side="serve", dtype=torch.bfloat16)
    for x, y in ((a, b), (b, a)):
        res = diff_traces(str(x), str(y))
        assert res.exit_code == 0 and res.verdict == "agree", [f.message for f in res.findings if f.severity != "info"]
        assert [r.held_b for r in res.slot_table] == slots
        assert not [f for f in res.findings if f.severity == "warning"]


def test_false_alarm_random_model_many_tokens(tmp_path):
    """The random-weight 8-layer model, bf16 vs fp32, 18 prompts (432 tokens): the default bf16
    tolerance used to be crossed at one token."""
    m = tiny_llama()
    s = prompts(18, length=24, seed=2)
    a, b = tmp_path / "a.h5", tmp_path / "b.h5"
    write_trace(a, m, s, TRAIN, side="train")
    write_trace(b, m, s, TRAIN, side="serve", dtype=torch.bfloat16)
    for x, y in ((a, b), (b, a)):
        res = diff_traces(str(x), str(y))
        assert res.exit_code == 0, res.headline()
