"""`tensordiff locate` end to end on the trained tiny Llama (tests/trained.py): HF against an HF
port with one bug (the first line names the op, its kind and what the grafts showed), a correct
port (exit 0 after one diff, both orders), a user's `module:` port, Ctrl-C and --resume, and bad
input (one line, exit 2, before anything is recorded).

Recordings are shared through --resume: a run's traces are copied under the names locate gives
them into the next run's directory, so each test records only what is new to it."""

from __future__ import annotations

import json
import shutil
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import trained  # noqa: E402

from tensordiff.cli import main  # noqa: E402
from tensordiff.trace import TraceReader  # noqa: E402

pytestmark = pytest.mark.torch


def _variant(root, name, edit=None, config=None):
    return trained.edited_target(root, name, edit, config)


def _permute_q_heads_layer2(m):
    """Layer 2's query heads 0 and 1 exchanged in q_proj (a port that reads the heads in another order)."""
    w = m.model.layers[2].self_attn.q_proj.weight
    hd = m.config.head_dim
    w.copy_(torch.cat([w[hd:2 * hd], w[:hd], w[2 * hd:]]))


_PROMPTS: list = []


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """The module's directory, with the first 6 held-out prompts (of 12): every run records them,
    so fewer keep the tests cheap."""
    d = tmp_path_factory.mktemp("locate")
    lines = trained.prompts_path().read_text().splitlines()
    (d / "prompts.jsonl").write_text("\n".join(lines[:6]) + "\n")
    _PROMPTS[:] = [d / "prompts.jsonl"]
    return d


def _prompts():
    return _PROMPTS[0]


def _locate(capsys, out, a, b, *extra, seed=None, prompts=None):
    """(exit code, stdout lines, stderr) of `tensordiff locate A B`; ``seed``: {name: trace} copied
    into ``out`` first and resumed from; ``prompts``: the prompts file (default: this module's)."""
    argv = ["locate", str(a), str(b), "--prompts", str(prompts or _prompts()), "--no-progress", *extra]
    if seed:
        out.mkdir(parents=True, exist_ok=True)
        for name, src in seed.items():
            shutil.copyfile(src, out / f"{name}.h5")
        argv += ["--resume", str(out)]
    else:
        argv += ["--out", str(out)]
    capsys.readouterr()
    rc = main(argv)
    cap = capsys.readouterr()
    return rc, cap.out.splitlines(), cap.err


def test_correct_port_agrees_after_one_diff_both_orders(root, capsys):
    out = root / "correct"
    rc, lines, err = _locate(capsys, out, trained.target_dir(), trained.target_dir(), "--dtype-b", "bfloat16")
    assert rc == 0, "\n".join(lines)
    assert lines[0].startswith("A and B agree: no divergence"), lines[0]
    assert sorted(p.name for p in out.iterdir()) == ["a.h5", "b.h5"]   # one record each, one diff, nothing more
    assert err.count("$ tensordiff diff") == 1 and err.count("$ tensordiff record train") == 2, err
    # the other order: the same two traces swapped (resumed: only the diff runs)
    rc, lines, err = _locate(capsys, root / "correct-ba", trained.target_dir(), trained.target_dir(),
                             seed={"a": out / "b.h5", "b": out / "a.h5"})
    assert rc == 0 and lines[0].startswith("A and B agree"), lines[0]
    assert "$ tensordiff record" not in err, err
    # the Python API on the same traces (resumed: the diff only)
    import tensordiff
    res = tensordiff.locate(trained.target_dir(), trained.target_dir(), _prompts(), out, resume=True,
                            dtype_b="bfloat16")
    assert res.exit_code == 0 and res.verdict.startswith("A and B agree") and len(res.evidence) == 1, res.text()
    assert res.to_dict()["format"] == "tensordiff.locate/1"


def _head(lines):
    return lines[0]


def test_permuted_q_heads_in_one_layer_is_located_and_confirmed(root, capsys):
    port = _variant(root, "port-heads2", _permute_q_heads_layer2)
    rc, lines, err = _locate(capsys, root / "heads2", trained.target_dir(), port)
    head = _head(lines)
    assert rc == 1
    assert head.startswith("the cause is inside layer 2's attention: layer2.q (heads):"), head
    assert "confirmed by grafting layer3 from A: nothing after it diverges" in head, head
    assert "the weights of layer 2 differ: first at layer2 q " in head and "the configs are equal" in head, head
    d = json.loads(json.dumps(main_json(capsys, root / "heads2", trained.target_dir(), port)))
    assert (d["layer"], d["op"], d["kind"], d["confirmed"], d["weights_equal"]) == (2, "layer2.q", "heads", True, False)
    assert d["verdict"] == head
    # every link of the chain has its command, with real paths that exist
    cmds = [c for e in d["evidence"] for c in e["commands"]]
    assert any(c.startswith("tensordiff record train") and "--zoom layer2 --graft" in c for c in cmds), cmds
    for name in ("a.h5", "b.h5", "a-z2.h5", "b-z2-graft-layer2.h5", "b-z2-graft-layer3.h5"):
        assert (root / "heads2" / name).is_file(), name
        assert str(root / "heads2" / name) in " ".join(cmds)


def main_json(capsys, out, a, b):
    """The same run again as JSON: resumed from its traces (nothing recorded again)."""
    capsys.readouterr()
    rc = main(["locate", str(a), str(b), "--prompts", str(_prompts()), "--no-progress", "--json",
               "--resume", str(out)])
    cap = capsys.readouterr()
    assert rc == 1 and "$ tensordiff record" not in cap.err, cap.err
    return json.loads(cap.out)


@pytest.mark.slow
def test_permuted_q_heads_other_order(root, capsys):
    """The port as A and the reference as B: the same layer, op and kind; the graft confirms it."""
    port = _variant(root, "port-heads2", _permute_q_heads_layer2)
    seed = {"a": root / "heads2" / "b.h5", "b": root / "heads2" / "a.h5"} if (root / "heads2").is_dir() else None
    rc, lines, _ = _locate(capsys, root / "heads2-ba", port, trained.target_dir(), seed=seed)
    head = _head(lines)
    assert rc == 1
    assert head.startswith("the cause is inside layer 2's attention: layer2.q (heads):"), head
    assert "confirmed by grafting layer3 from A: nothing after it diverges" in head, head


@pytest.mark.slow
@pytest.mark.parametrize("name,config,op,kind,words", [
    ("rope_theta", {"rope_parameters": {"rope_theta": 20000.0, "rope_type": "default"}},
     "layer0.q_rope", "rotary", "rope theta: A 1e+04, B 2e+04"),
    ("norm_eps", {"rms_norm_eps": 1e-3}, "layer0.attn_norm", "norm_eps", "eps 0.001"),
])
def test_config_bug_in_every_layer_is_named_and_not_confirmed_in_one_layer(root, capsys, name, config, op, kind,
                                                                           words):
    """A config bug touches every layer: layer 0 holds the first op out of the noise, and the graft
    of layer1 says honestly that a cause lies after layer 0 as well (the same bug, next layer)."""
    port = _variant(root, f"port-{name}", config=config)
    seed = {}
    if (root / "heads2" / "a.h5").is_file():
        seed["a"] = root / "heads2" / "a.h5"
    rc, lines, _ = _locate(capsys, root / name, trained.target_dir(), port, seed=seed or None)
    head = _head(lines)
    assert rc == 1
    assert head.startswith(f"the cause is inside layer 0's attention: {op} ({kind}):"), head
    assert words in head, head
    assert "not confirmed inside layer 0 alone: with layer1 grafted from A" in head, head
    assert "the weights of layer 0 are equal" in head and "the configs differ: " in head, head


def test_module_port_is_located(root, capsys, monkeypatch):
    """A user's port given as module:locate_ports:FACTORY: recorded through its own callable, its
    weights compared as live fingerprints."""
    monkeypatch.syspath_prepend(str(trained.ROOT / "tests"))
    seed = {"a": root / "heads2" / "a.h5"} if (root / "heads2" / "a.h5").is_file() else None
    rc, lines, err = _locate(capsys, root / "module", trained.target_dir(), "module:locate_ports:gate_up_swapped_in_layer5",
                             seed=seed)
    head = _head(lines)
    assert rc == 1, head
    assert head.startswith("the cause is inside layer 5's MLP: layer5.mlp_gate (swap): B's mlp_gate holds A's mlp_up"), head
    assert "confirmed by grafting layer6 from A: nothing after it diverges" in head, head
    assert "the weights of layer 5 differ: first at layer5 mlp_gate" in head, head
    fp = root / "module" / "b-fingerprints.json"
    assert fp.is_file() and f"tensordiff weights {trained.target_dir()} {fp}" in "\n".join(lines)
    assert "--model module:locate_ports:gate_up_swapped_in_layer5" in err


def test_ctrl_c_leaves_complete_traces_and_resume_finishes(root, capsys, monkeypatch):
    """Interrupted in the middle of a recording (B zoomed into layer 2, its third sequence): exit
    130, the traces before it open and complete, no partial file left, the message names the step
    and the command that resumes; the resumed run records only what is missing and reaches the
    same verdict. (The first traces are the heads test's, copied in: only the rest is recorded.)"""
    from tensordiff.recorders import hf

    port = _variant(root, "port-heads2", _permute_q_heads_layer2)
    out = root / "interrupted"
    src = root / "heads2"
    seed = {n: src / f"{n}.h5" for n in ("a", "b", "a-z2")} if src.is_dir() else None
    calls = {"n": 0}
    orig = hf.HFExtractorRecorder.run
    before = 0 if seed else 3 * len(_prompts().read_text().splitlines())

    def run(self, *a, **k):
        calls["n"] += 1
        if calls["n"] == before + 3:
            raise KeyboardInterrupt
        return orig(self, *a, **k)

    monkeypatch.setattr(hf.HFExtractorRecorder, "run", run)
    rc, lines, err = _locate(capsys, out, trained.target_dir(), port, seed=seed)
    assert rc == 130 and lines == [], lines
    msg = [ln for ln in err.splitlines() if ln.startswith("tensordiff: error:")]
    assert len(msg) == 1 and "interrupted during step 'record B zoomed into layer2, layer2 from A'" in msg[0], err
    assert f"--resume {out}" in msg[0], msg
    assert sorted(p.name for p in out.iterdir()) == ["a-z2.h5", "a.h5", "b.h5"]
    for name in ("a.h5", "b.h5", "a-z2.h5"):
        with TraceReader(str(out / name)) as r:
            assert "layer3" in r.tensors
    monkeypatch.setattr(hf.HFExtractorRecorder, "run", orig)
    capsys.readouterr()
    rc = main(["locate", str(trained.target_dir()), str(port), "--prompts", str(_prompts()),
               "--no-progress", "--resume", str(out)])
    cap = capsys.readouterr()
    assert rc == 1
    assert cap.out.startswith("the cause is inside layer 2's attention: layer2.q (heads):"), cap.out
    assert cap.err.count("skipped:") == 3 and cap.err.count("$ tensordiff record train") == 2, cap.err


def test_bad_input_is_one_line_before_anything_is_recorded(root, capsys, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"x": 1}\n')
    t = str(trained.target_dir())
    p = str(trained.prompts_path())
    cases = [
        (["module:pkg..mod:f", t, "--prompts", p], "is not module:pkg.mod:factory"),
        (["module:never_imported_mod", t, "--prompts", p], "is not module:pkg.mod:factory"),
        ([str(tmp_path / "missing"), t, "--prompts", p], "A: no such file or directory"),
        ([t, str(tmp_path), "--prompts", p], "B: a directory without config.json"),
        ([t, t, "--prompts", str(bad)], "line 1: expected token ids"),
        ([t, t, "--prompts", str(tmp_path / "none.jsonl")], "--prompts: no such file"),
        ([f"sglang:{tmp_path / 'missing'}", t, "--prompts", p], "A: sglang:DIR needs a local model directory"),
        ([t, f"vllm:{tmp_path}", "--prompts", p], "B: vllm:DIR needs a local model directory"),
    ]
    for argv, words in cases:
        out = tmp_path / "out"
        capsys.readouterr()
        assert main(["locate", *argv, "--out", str(out), "--no-progress"]) == 2, argv
        err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
        assert len(err) == 1 and words in err[0], (argv, err)
        assert not out.exists() or not any(out.iterdir()), argv
    assert "never_imported_mod" not in sys.modules and "pkg" not in sys.modules
    capsys.readouterr()
    assert main(["locate", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "module:pkg.mod:factory" in text and "checked before anything is imported" in text, text
    assert "exit codes: 0 A and B agree" in text and "130 interrupted" in text, text
    # record train takes the same spec, checked the same way
    for spec, words in (("module:pkg..mod:f", "is not module:pkg.mod:factory"),
                        ("module:no_such_port_module:f", "cannot import no_such_port_module")):
        capsys.readouterr()
        assert main(["record", "train", "--model", spec, "--prompts", p, "--out", str(tmp_path / "r.h5"),
                     "--no-progress"]) == 2
        err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
        assert len(err) == 1 and words in err[0], err


def test_traces_as_sides(root, capsys, tmp_path):
    """Traces used as they are: ones `record train` wrote from a model directory are recorded again
    from it for the zoom (here resumed from the heads test's traces: only the diffs run); one that
    names no model to record again (here its recorded command edited away, as an engine's trace
    has none) stops after the first diff with the recipe."""
    import h5py

    src = root / "heads2"
    if not (src / "a-z2.h5").is_file():
        pytest.skip("needs the heads test's traces")
    out = root / "traces"
    rc, lines, err = _locate(capsys, out, src / "a.h5", src / "b.h5",
                             seed={n: src / f"{n}.h5" for n in ("a-z2", "b-z2-graft-layer2", "b-z2-graft-layer3")})
    assert rc == 1 and lines[0].startswith("the cause is inside layer 2's attention: layer2.q (heads):"), lines[0]
    assert "confirmed by grafting layer3 from A" in lines[0] and "$ tensordiff record" not in err, err
    engine = tmp_path / "engine.h5"
    shutil.copyfile(src / "b.h5", engine)
    with h5py.File(engine, "r+") as f:
        meta = json.loads(f.attrs["user_meta"])
        meta["command"] = "an engine"
        f.attrs["user_meta"] = json.dumps(meta)
    rc, lines, err = _locate(capsys, tmp_path / "out", src / "a.h5", engine)
    assert rc == 1
    assert lines[0].startswith("the cause is inside decoder layer 2 (its output layer3 is the first state out of "
                               "the noise); B is a trace that names no model"), lines[0]
    assert "TENSORDIFF_ZOOM" in lines[0] and "$ tensordiff record" not in err, err
