"""ModuleHookRecorder writes canonical names when it knows the model, so its traces compare with
`record train` traces (real tiny HF Llama, real HDF5 traces, the real diff)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tensordiff.diff import diff_traces  # noqa: E402
from tensordiff.recorders.core import Recorder  # noqa: E402
from tensordiff.recorders.hf import HFExtractorRecorder, model_info  # noqa: E402
from tensordiff.recorders.hooks import ModuleHookRecorder  # noqa: E402
from tensordiff.trace import TraceReader  # noqa: E402

from hf_traces import near_residual_llama  # noqa: E402

pytestmark = pytest.mark.torch


def _seqs():
    g = torch.Generator().manual_seed(3)
    return {f"s{i}": torch.randint(0, 256, (20 + i,), generator=g) for i in range(3)}


def _train(model, path, seqs):
    with Recorder(str(path), side="train", model=model_info(model)) as rec:
        hf = HFExtractorRecorder(model, rec, None, values="all", topk=0)
        for k, ids in seqs.items():
            hf.run(k, ids)


def _hooked(model, path, seqs, scale_layer=None):
    handle = None
    if scale_layer is not None:  # the "port": one decoder layer's output scaled by 1.05
        handle = model.model.layers[scale_layer].register_forward_hook(lambda m, a, out: out * 1.05)
    try:
        with Recorder(str(path), side="other", model=model_info(model)) as rec, \
                ModuleHookRecorder(model, rec, ["model.embed_tokens", "model.layers.*", "model.norm"],
                                   capture="both") as hooks:
            for k, ids in seqs.items():
                hooks.tokens(k, ids)
                with torch.no_grad():
                    model(ids[None], use_cache=False)
        return hooks
    finally:
        if handle is not None:
            handle.remove()


@pytest.fixture(scope="module")
def model():
    return near_residual_llama(6)


def test_hook_trace_has_canonical_names_and_keeps_the_module_path(tmp_path, model):
    seqs = _seqs()
    hooks = _hooked(model, tmp_path / "h.h5", seqs)
    assert hooks.implementation == "hf"
    with TraceReader(str(tmp_path / "h.h5")) as r:
        names = set(r.tensors)
        assert {"embed", *(f"layer{b}" for b in range(1, 7)), "final_norm"} <= names
        l4 = r.tensors["layer4"]
        assert l4.kind == "boundary" and l4.boundary == 4
        assert l4.attrs["module_path"] in ("model.layers.3.output", "model.layers.4.input")
        assert r.tensors["final_norm"].kind == "final_norm"
        assert r.tensors["final_norm"].attrs["module_path"] == "model.norm.output"


def test_hook_trace_agrees_with_record_train(tmp_path, model):
    seqs = _seqs()
    _train(model, tmp_path / "t.h5", seqs)
    _hooked(model, tmp_path / "h.h5", seqs)
    res = diff_traces(str(tmp_path / "t.h5"), str(tmp_path / "h.h5"))
    assert res.exit_code == 0, res.headline()
    compared = {p.label for p in res.pairs} if hasattr(res, "pairs") else None
    assert compared is None or {"embed", "layer3", "final_norm"} <= compared


def test_a_scaled_layer_is_named(tmp_path, model):
    seqs = _seqs()
    _train(model, tmp_path / "t.h5", seqs)
    _hooked(model, tmp_path / "h.h5", seqs, scale_layer=3)
    res = diff_traces(str(tmp_path / "t.h5"), str(tmp_path / "h.h5"))
    assert res.exit_code == 1
    f = res.first_divergence
    assert f is not None and "layer4" in f.message, f.message    # the output of decoder layer 3
    assert f.message.startswith("layer4 diverges") and "rel err 0.05" in f.message, f.message
    # judged like a `record train` pair: the depth-aware tolerance of boundary 4, not a path's
    assert f.tensor == "layer4"


def test_unknown_model_keeps_module_paths(tmp_path):
    m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
    with Recorder(str(tmp_path / "u.h5"), side="other", model={"hidden_size": 8}) as rec, \
            ModuleHookRecorder(m, rec, ["0"]) as hooks:
        hooks.tokens("s", torch.arange(5))
        m(torch.randn(5, 8))
    assert hooks.implementation is None
    with TraceReader(str(tmp_path / "u.h5")) as r:
        assert set(r.tensors) == {"0.output"}


# ----------------------------------------------------------------------------------------------
# `record train` on a small model: default aux ids that collide warn in one line
# ----------------------------------------------------------------------------------------------


def test_colliding_default_aux_ids_warn_in_one_line(tmp_path, model, capsys):
    import json

    from tensordiff.cli import main

    d = tmp_path / "m"
    model.save_pretrained(d)
    p = tmp_path / "p.jsonl"
    p.write_text(json.dumps({"id": "a", "input_ids": list(range(1, 9))}) + "\n")
    assert main(["record", "train", "--model", str(d), "--prompts", str(p), "--out", str(tmp_path / "t.h5"),
                 "--no-progress", "--topk", "0", "--convention", "specforge"]) == 0
    err = [ln for ln in capsys.readouterr().err.splitlines() if "collide" in ln]
    assert len(err) == 1, err
    assert "[layer2, layer3, layer3]" in err[0] and "default" in err[0] and "--aux-ids" in err[0]
    # ids given that do not collide: no warning
    assert main(["record", "train", "--model", str(d), "--prompts", str(p), "--out", str(tmp_path / "u.h5"),
                 "--no-progress", "--topk", "0", "--aux-ids", "0", "2", "4"]) == 0
    assert "collide" not in capsys.readouterr().err


@pytest.mark.parametrize("layers", [2, 6])
def test_record_train_without_draft_flags_records_no_draft_input(tmp_path, capsys, layers):
    """No --draft, --aux-ids or other draft flag: the catalog only, no slots and no warning about
    them (the default ids of a 2-layer model were "boundary must be >= 0, got -1")."""
    import json

    from tensordiff.cli import main

    d = tmp_path / "m"
    near_residual_llama(layers).save_pretrained(d)
    p = tmp_path / "p.jsonl"
    p.write_text(json.dumps({"id": "a", "input_ids": list(range(1, 9))}) + "\n")
    out = tmp_path / "t.h5"
    assert main(["record", "train", "--model", str(d), "--prompts", str(p), "--out", str(out), "--no-progress",
                 "--topk", "0"]) == 0, capsys.readouterr().err
    assert "warning" not in capsys.readouterr().err
    with TraceReader(str(out)) as r:
        assert not [t for t in r.tensors.values() if t.kind == "packed"], list(r.tensors)
        assert {"embed", f"layer{layers}", "final_norm"} <= set(r.tensors)


def test_collision_note_is_pure():
    from tensordiff.conventions import collision_note, plan_draft_input

    note = collision_note(plan_draft_input("specforge", None, 6))
    assert note is not None and "layer3" in note
    assert collision_note(plan_draft_input("specforge", [1, 3, 5], 32)) is None
