"""`record train --graft OTHER.h5:STATE` on the trained tiny Llama: one state replaced by the other
side's recorded values during the forward; the diff of the grafted run says whether anything after
it still diverges, and so where the cause is."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import trained  # noqa: E402

from tensordiff.cli import main  # noqa: E402
from tensordiff.diff import diff_traces  # noqa: E402
from tensordiff.trace import TraceReader  # noqa: E402

pytestmark = pytest.mark.torch


def _rec(out, model, *extra, values="all"):
    argv = ["record", "train", "--model", str(model), "--prompts", str(trained.prompts_path()), "--out", str(out),
            "--no-progress", "--topk", "0", "--values", values, "--dtype", "float32", *extra]
    return main(argv)


@pytest.fixture(scope="module")
def w(tmp_path_factory):
    """The reference, a port whose layer 3 MLP output is scaled by 1.05, and their traces."""
    root = tmp_path_factory.mktemp("graft")
    m = trained.load_target()
    with torch.no_grad():
        m.model.layers[3].mlp.down_proj.weight.mul_(1.05)
    m.save_pretrained(root / "port")
    (root / "port" / "generation_config.json").unlink(missing_ok=True)
    assert _rec(root / "ref.h5", trained.target_dir()) == 0
    assert _rec(root / "ref-z3.h5", trained.target_dir(), "--zoom", "layer3") == 0
    assert _rec(root / "port.h5", root / "port") == 0
    return root


def _graft_note(res):
    return next(f for f in res.findings if f.kind == "signature" and f.details.signature == "graft")


def test_graft_of_the_layers_output_removes_every_divergence_after_it(w, tmp_path):
    plain = diff_traces(str(w / "ref.h5"), str(w / "port.h5"))
    assert plain.first_divergence.tensor == "layer4", plain.headline()
    out = tmp_path / "g4.h5"
    assert _rec(out, w / "port", "--graft", f"{w / 'ref.h5'}:layer4") == 0
    with TraceReader(str(out)) as r:
        assert r.user_meta["graft"] == {"from": str(w / "ref.h5"), "state": "layer4"}
    res = diff_traces(str(w / "ref.h5"), str(out))
    assert res.exit_code == 0, res.headline()
    note = _graft_note(res)
    assert note.severity == "info"
    assert res.headline() == note.message   # an agreeing grafted run says what the graft showed first
    assert note.message.startswith("with layer4 taken from A"), note.message
    assert "nothing after it diverges" in note.message and "inside decoder layer 3" in note.message, note.message
    # the grafted state is the reference's, bit for bit
    a = next(p for p in res.pairs if p.label == "layer4")
    assert a.rel_max[0] == 0.0


def test_graft_before_the_cause_leaves_the_divergence(w, tmp_path):
    out = tmp_path / "g3.h5"
    assert _rec(out, w / "port", "--graft", f"{w / 'ref.h5'}:layer3") == 0
    res = diff_traces(str(w / "ref.h5"), str(out))
    assert res.exit_code == 1
    assert res.first_divergence.tensor == "layer4"
    note = _graft_note(res)
    assert "still diverge" in note.message and "layer4" in note.message, note.message


def test_graft_of_a_tap(w, tmp_path):
    """Zoomed into layer 3, the MLP's output taken from the reference: the taps before it still
    differ where the port differs (none: the bug is in down_proj, whose output is grafted), and
    nothing after it diverges."""
    out = tmp_path / "gt.h5"
    assert _rec(out, w / "port", "--zoom", "layer3", "--graft", f"{w / 'ref-z3.h5'}:layer3.mlp_out") == 0
    res = diff_traces(str(w / "ref-z3.h5"), str(out))
    assert res.exit_code == 0, res.headline()
    assert "nothing after it diverges" in _graft_note(res).message
    # the JSON carries it
    d = json.loads(json.dumps(res.to_dict()))
    assert any(f["kind"] == "signature" and f["details"]["signature"] == "graft" for f in d["findings"])


def test_bad_grafts_are_one_line(w, tmp_path, capsys):
    other = tmp_path / "other.jsonl"
    ids = [json.loads(ln)["input_ids"] for ln in trained.prompts_path().read_text().splitlines()]
    other.write_text("".join(json.dumps({"id": f"p{i}", "input_ids": list(reversed(x))}) + "\n"
                             for i, x in enumerate(ids)))
    sketch_only = tmp_path / "s.h5"
    assert _rec(sketch_only, trained.target_dir(), values="slots") == 0
    capsys.readouterr()
    cases = [
        (f"{tmp_path / 'none.h5'}:layer4", "cannot read"),
        (f"{w / 'ref.h5'}:layer3.q_rope", "rotary"),
        (f"{w / 'ref.h5'}:layer3.mlp_out", "no tensor layer3.mlp_out"),
        (f"{w / 'ref.h5'}:nonsense", "not a state name"),
        (f"{sketch_only}:layer7", "sketches only"),
        ("layer4", "OTHER.h5:STATE"),
    ]
    for spec, words in cases:
        assert _rec(tmp_path / "x.h5", w / "port", "--graft", spec) == 2, spec
        err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
        assert len(err) == 1 and words in err[0] and "--graft" in err[0], (spec, err)
    argv = ["record", "train", "--model", str(w / "port"), "--prompts", str(other), "--out", str(tmp_path / "y.h5"),
            "--no-progress", "--topk", "0", "--graft", f"{w / 'ref.h5'}:layer4"]
    assert main(argv) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and "not the same tokens" in err[0], err
