"""`tensordiff import` on files the draft-training producers' own code wrote or read: SpecForge
0.2.0, speculators 0.9.0 (through vLLM 0.32.0's extract_hidden_states on the CPU) and
nvidia-modelopt 0.47.0, installed in .venv-producers by scripts/install-producers.sh. Each import
is diffed against `tensordiff record train` of the same model and tokens: correct wiring agrees,
and a producer run with the wrong aux ids is named in the diff's first sentence. What stands in for
a producer's part that cannot run here is said in tests/producers/*.py and docs/recorders.md."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

import sglang_support as ss  # noqa: E402
import vllm_support as vs  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.slow]

PRODUCERS_PY = REPO / ".venv-producers" / "bin" / "python"
N = vs.TINY_LLAMA_VLLM["num_hidden_layers"]
H = vs.TINY_LLAMA_VLLM["hidden_size"]
needs_producers = pytest.mark.skipif(not PRODUCERS_PY.exists(), reason="the producers' venv (.venv-producers) is not set up")
needs_vllm = pytest.mark.skipif(not vs.vllm_available(), reason="the vLLM venv (.venv-vllm) is not set up")


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TENSORDIFF_")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


def _run(python, script: str, *args, env=None, timeout=900) -> str:
    proc = subprocess.run([str(python), str(HERE / "producers" / script), *map(str, args)], cwd=REPO,
                          env=env or _env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{script} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc.stdout


def _td(capsys, *args) -> tuple[int, str, str]:
    from tensordiff.cli import main
    capsys.readouterr()
    rc = main([str(a) for a in args])
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("producers")


@pytest.fixture(scope="module")
def model_dir(work):
    # head_dim 64: vLLM's CPU attention refuses smaller heads; the same model for every producer
    return ss.make_tiny_llama(work / "model", **vs.TINY_LLAMA_VLLM)


@pytest.fixture(scope="module")
def prompts(work):
    g = torch.Generator().manual_seed(33)
    ps = [torch.randint(0, vs.TINY_LLAMA_VLLM["vocab_size"], (12 + 3 * i,), generator=g).tolist() for i in range(3)]
    (work / "prompts.json").write_text(json.dumps(ps))
    return ps


@pytest.fixture(scope="module")
def record(work, model_dir, prompts):
    """`tensordiff record train` of the model on the prompts, keyed as a producer keys its files."""
    made: dict = {}

    def rec(keys, *args):
        k = (tuple(keys), args)
        if k not in made:
            from tensordiff.cli import main
            jl = work / f"prompts{len(made)}.jsonl"
            jl.write_text("".join(json.dumps({"id": key, "input_ids": p}) + "\n" for key, p in zip(keys, prompts)))
            out = work / f"train{len(made)}.h5"
            assert main(["record", "train", "--model", str(model_dir), "--prompts", str(jl), *args, "--out", str(out),
                         "--dtype", "float32", "--no-progress"]) == 0
            made[k] = out
        return made[k]
    return rec


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0]


# ----------------------------------------------------------------------------------------------
# SpecForge 0.2.0
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def specforge_runs(work, model_dir, prompts):
    """Two preparations: the draft config's ids left to SpecForge's default, and a misconfigured
    draft config whose ids are one too high."""
    env = _env()  # the SGLang CPU engine and the sgl_kernel stand-in, for the subprocess only
    env["PYTHONPATH"] = os.pathsep.join([str(ss.STUB_DIR), env["PYTHONPATH"]])
    env["SGLANG_USE_CPU_ENGINE"] = "1"
    runs = {}
    for name, ids in (("ok", "default"), ("bad", "[2, 4, 5]")):
        out = work / f"specforge-{name}"
        info = json.loads(_run(PRODUCERS_PY, "specforge_write.py", model_dir, work / "prompts.json", out, ids,
                               env=env).strip().splitlines()[-1])
        runs[name] = (out, info)
    return runs


SF_KEYS = [f"rows_0-5000/data_{i}" for i in range(3)]


@needs_producers
def test_specforge_prepared_files_import_and_agree_with_record_train(work, specforge_runs, record, capsys):
    src, info = specforge_runs["ok"]
    assert info["capture_ids"] == [1, N // 2 - 1, N - 4]  # SpecForge's own default for an 8-layer target
    assert info["keys"] == ["aux_hidden_state", "hidden_state", "input_ids", "loss_mask"]
    out = work / "sf.h5"
    rc, text, err = _td(capsys, "import", src, "--aux-ids", "1", "3", "4", "--num-layers", N, "--out", out)
    assert rc == 0, err
    assert "specforge" in text and "['layer2', 'layer4', 'layer5']" in text, text
    from tensordiff.trace import TraceReader
    with TraceReader(out) as r:
        d = r.tensors["draft_input"]
        # SpecForge's convention, hidden_states[id + 1], named in the slot labels
        assert (d.slot_labels, d.raw_ids, d.convention) == (["layer2", "layer4", "layer5"], [1, 3, 4], "specforge")
        assert d.attrs["draft_plan"]["pipeline"] == "cat([hidden_states[id + 1] for id in ids])"
        assert d.attrs["checked_against"] == "specforge 0.2.0"
        assert r.sequences == SF_KEYS
        f = torch.load(src / "rows_0-5000" / "data_1.ckpt", weights_only=True)
        rows = np.flatnonzero(r.tokens["seq"][r.token_rows("draft_input")] == 1)
        np.testing.assert_array_equal(r.read_values_at("draft_input", rows), f["aux_hidden_state"][0, :-1].numpy())
    train = record(SF_KEYS, "--aux-ids", "1", "3", "4", "--convention", "specforge")
    rc, text, _ = _td(capsys, "diff", train, out)
    assert rc == 0, text
    assert _first_line(text).startswith("no divergence"), text


@needs_producers
def test_specforge_run_with_wrong_aux_ids_is_named_first(work, specforge_runs, record, capsys):
    src, info = specforge_runs["bad"]
    assert info["capture_ids"] == [2, 4, 5]
    out = work / "sf-bad.h5"
    # imported as the user believes it was prepared (ids 1 3 4)
    assert _td(capsys, "import", "specforge", src, "--aux-ids", "1", "3", "4", "--num-layers", N, "--out", out)[0] == 0
    train = record(SF_KEYS, "--aux-ids", "1", "3", "4", "--convention", "specforge")
    rc, text, _ = _td(capsys, "diff", train, out)
    assert rc == 1, text
    assert _first_line(text) == "slot 0 of draft_input holds layer3 where layer2 was expected", text


# ----------------------------------------------------------------------------------------------
# speculators 0.9.0 through vLLM 0.32.0
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def speculators_runs(work, model_dir, prompts):
    """vLLM launched as speculators launches it (aux ids + the last layer, N), and a misconfigured
    launch list that puts the embedding first ([0, 2, 4, 5]: the legacy extractor's shape, the
    verifier state then one of the aux layers); each finished by speculators' own code."""
    runs = {}
    for name, launch in (("ok", [2, N // 2, N - 3, N]), ("bad", [0, 2, 4, 5])):
        raw = work / f"vllm-{name}"
        raw.mkdir()
        env = vs.vllm_env()
        env["VLLM_LOGGING_LEVEL"] = "ERROR"
        out = _run(vs.vllm_python(), "vllm_extract.py", model_dir, work / "prompts.json", raw, json.dumps(launch), env=env)
        paths = [ln for ln in out.splitlines() if ln.startswith("PATHS ")][-1][len("PATHS "):]
        (work / f"paths-{name}.json").write_text(paths)
        data = work / f"speculators-{name}"
        _run(PRODUCERS_PY, "speculators_collect.py", work / f"paths-{name}.json", work / "prompts.json", data)
        runs[name] = data
    return runs


HS_KEYS = [f"hs_{i}" for i in range(3)]


@needs_producers
@needs_vllm
def test_speculators_generated_files_import_as_the_trainer_reads_them(work, speculators_runs, record, capsys):
    data = speculators_runs["ok"]
    hs = data / "tokens" / "hidden_states"
    assert sorted(p.name for p in hs.iterdir()) == ["hs_0.safetensors", "hs_1.safetensors", "hs_2.safetensors"]
    view = torch.load(data / "trainer_view.pt", weights_only=True)
    from tensordiff.trace import TraceReader
    # the draft's aux ids (the last layer added, as speculators launches vLLM), or the launch list itself
    for i, ids in enumerate((["2", "4", "5"], ["2", "4", "5", str(N)])):
        out = work / f"spec{i}.h5"
        rc, text, err = _td(capsys, "import", hs, "--aux-ids", *ids, "--num-layers", N, "--out", out)
        assert rc == 0, err
        assert text.startswith("imported 3 speculators file(s)"), text
        with TraceReader(out) as r:
            d = r.tensors["draft_input"]
            assert d.slot_labels == ["layer2", "layer4", "layer5"] and d.convention == "vllm"
            assert d.attrs["draft_plan"]["captured"] == ["layer2", "layer4", "layer5", f"layer{N}"]
            assert d.attrs["checked_against"] == "speculators 0.9.0 with vLLM 0.32.0"
            v = r.tensors["verifier_last"]
            assert (v.role, v.attrs["label"]) == ("verifier_target", f"layer{N}")
            assert r.sequences == HS_KEYS
            for s in range(3):
                rows = np.flatnonzero(r.tokens["seq"][r.token_rows("draft_input")] == s)
                # exactly what speculators' trainer packs (its row t pairs with token t+1: none for the last)
                np.testing.assert_array_equal(r.read_values_at("draft_input", rows),
                                              view[f"{s}.hidden_states"][:-1].numpy())
                vrows = np.flatnonzero(r.tokens["seq"][r.token_rows("verifier_last")] == s)
                np.testing.assert_array_equal(r.read_values_at("verifier_last", vrows),
                                              view[f"{s}.verifier_last_hidden_states"].numpy())
    train = record(HS_KEYS, "--aux-ids", "2", "4", "5", "--convention", "vllm")
    rc, text, _ = _td(capsys, "diff", train, work / "spec0.h5")
    assert rc == 0, text
    assert _first_line(text).startswith("no divergence"), text


@needs_producers
@needs_vllm
def test_speculators_embed_first_launch_is_labelled_and_named_first(work, speculators_runs, record, capsys):
    hs = speculators_runs["bad"] / "tokens" / "hidden_states"
    from tensordiff.trace import TraceReader
    # with the ids vLLM really ran, the labels say what the trainer was fed
    out = work / "spec-bad-true.h5"
    assert _td(capsys, "import", hs, "--aux-ids", "0", "2", "4", "5", "--out", out)[0] == 0
    with TraceReader(out) as r:
        assert r.tensors["draft_input"].slot_labels == ["embed", "layer2", "layer4"]
        assert r.tensors["verifier_last"].attrs["label"] == "layer5"
    # imported as the user believes it ran (aux ids 2 4 5 + the last layer): the diff names it
    out = work / "spec-bad.h5"
    assert _td(capsys, "import", "speculators", hs, "--aux-ids", "2", "4", "5", "--num-layers", N, "--out", out)[0] == 0
    train = record(HS_KEYS, "--aux-ids", "2", "4", "5", "--convention", "vllm")
    rc, text, _ = _td(capsys, "diff", train, out)
    assert rc == 1, text
    assert _first_line(text) == "slot 0 of draft_input holds embed where layer2 was expected", text


# ----------------------------------------------------------------------------------------------
# nvidia-modelopt 0.47.0
# ----------------------------------------------------------------------------------------------


def _modelopt_dump(d: Path, model_dir, prompts, indices, *, prenorm=False) -> list[Path]:
    """Dumps in the layout of Model-Optimizer's collect_hidden_states (HF script): per
    conversation ``input_ids``, ``aux_hidden_states`` = cat of HF ``hidden_states[i]`` for the
    sorted indices, ``hidden_states`` = HF ``hidden_states[-1]`` (post-norm in transformers 5), and
    ``conversation_id``; with ``prenorm`` the last layer's output before the norm and the flag."""
    from transformers import AutoModel
    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    d.mkdir(parents=True, exist_ok=True)
    pre: list = []
    hook = model.norm.register_forward_pre_hook(lambda m, a: pre.append(a[0]))
    files = []
    with torch.inference_mode():
        for i, p in enumerate(prompts):
            ids = torch.tensor([p])
            hs = model(input_ids=ids, output_hidden_states=True).hidden_states
            obj = {"input_ids": ids[0].clone(), "aux_hidden_states": torch.cat([hs[j][0] for j in indices], -1).clone(),
                   "hidden_states": (pre[-1][0] if prenorm else hs[-1][0]).clone(), "conversation_id": f"conv-{i}"}
            if prenorm:
                obj["hidden_states_prenorm"] = True
            files.append(d / f"conv-{i}.pt")
            torch.save(obj, files[-1])
    hook.remove()
    return files


MO_KEYS = [f"conv-{i}" for i in range(3)]


@needs_producers
def test_modelopt_dumps_read_by_modelopt_import_and_agree(work, model_dir, prompts, record, capsys):
    default = sorted({2, N // 2, N - 3})
    files = _modelopt_dump(work / "mo", model_dir, prompts, default)
    info = json.loads(_run(PRODUCERS_PY, "modelopt_read.py", work / "mo-view.pt", *files).strip().splitlines()[-1])
    assert info["base_hidden_prenorm"] == [False] * 3
    view = torch.load(work / "mo-view.pt", weights_only=True)
    out = work / "mo.h5"
    rc, text, err = _td(capsys, "import", work / "mo", "--num-layers", N, "--out", out)
    assert rc == 0 and "modelopt" in text, err
    from tensordiff.trace import TraceReader
    with TraceReader(out) as r:
        d = r.tensors["draft_input"]
        assert d.slot_labels == ["layer2", "layer4", "layer5"] and d.convention == "modelopt"
        assert d.attrs["checked_against"] == "nvidia-modelopt 0.47.0"
        assert r.tensors["final_norm"].kind == "final_norm"
        for s in range(3):
            k = r.sequences.index(f"conv-{s}")
            rows = np.flatnonzero(r.tokens["seq"][r.token_rows("draft_input")] == k)
            np.testing.assert_array_equal(r.read_values_at("draft_input", rows), view[f"{s}.aux_hidden_states"][:-1].numpy())
    train = record(MO_KEYS, "--convention", "modelopt")
    rc, text, _ = _td(capsys, "diff", train, out)
    assert rc == 0, text

    # a pre-norm dump: modelopt reads the flag; the state is boundary N, not final_norm
    files = _modelopt_dump(work / "mo-pre", model_dir, prompts, default, prenorm=True)
    info = json.loads(_run(PRODUCERS_PY, "modelopt_read.py", work / "mo-pre-view.pt", *files).strip().splitlines()[-1])
    assert info["base_hidden_prenorm"] == [True] * 3
    out = work / "mo-pre.h5"
    assert _td(capsys, "import", work / "mo-pre", "--num-layers", N, "--out", out)[0] == 0
    with TraceReader(out) as r:
        assert f"layer{N}" in r.tensors and "final_norm" not in r.tensors
    rc, text, _ = _td(capsys, "diff", train, out)
    assert rc == 0, text
    rc, _, err = _td(capsys, "import", work / "mo-pre", "--out", work / "mo-pre2.h5", "--aux-ids", "2", "4", "5")
    assert rc == 2 and "hidden_states_prenorm" in err and "--num-layers" in err, err

    # collected at the wrong indices, imported with the default ones: named first
    _modelopt_dump(work / "mo-bad", model_dir, prompts, [1, 3, 4])
    out = work / "mo-bad.h5"
    assert _td(capsys, "import", work / "mo-bad", "--num-layers", N, "--out", out)[0] == 0
    rc, text, _ = _td(capsys, "diff", train, out)
    assert rc == 1, text
    assert _first_line(text) == "slot 0 of draft_input holds layer1 where layer2 was expected", text


# ----------------------------------------------------------------------------------------------
# Layouts the importers do not know: one line, exit 2, no guess
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["specforge", "speculators-hs", "modelopt"])
def test_unknown_layout_is_refused_in_one_line(tmp_path, capsys, fmt):
    from safetensors.torch import save_file
    d = tmp_path / "src"
    d.mkdir()
    ids = torch.arange(6)
    if fmt == "specforge":
        torch.save({"input_ids": ids, "loss_mask": torch.ones(6), "aux_hidden_state": torch.zeros(1, 6, 24),
                    "hidden_state": torch.zeros(1, 6, 8), "target": torch.zeros(1, 6, 8)}, d / "data_0.ckpt")
        args, version = ["--aux-ids", "1", "3", "4"], "specforge 0.2.0"
    elif fmt == "speculators-hs":
        save_file({"hidden_states": torch.zeros(6, 4, 8), "token_ids": ids, "scale": torch.ones(1)},
                  str(d / "hs_0.safetensors"))
        args, version = ["--aux-ids", "2", "4", "5", "8"], "speculators 0.9.0"
    else:
        torch.save({"input_ids": ids, "hidden_states": torch.zeros(6, 8), "aux_hidden_states": torch.zeros(6, 24),
                    "aux_layer_ids": torch.tensor([2, 4, 5])}, d / "c.pt")
        args, version = ["--num-layers", "8"], "nvidia-modelopt 0.47.0"
    out = tmp_path / "o.h5"
    rc, _, err = _td(capsys, "import", d, *args, "--out", out)
    assert rc == 2, err
    assert err.count("\n") == 1 and "Traceback" not in err and version in err and "does not know" in err, err
    assert not out.exists()
