"""`tensordiff weights A B`: two safetensors checkpoints (HF layout, or an engine's fused layout)
compared parameter by parameter in forward order, and the weight fingerprint format."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from hf_traces import near_residual_llama  # noqa: E402

from tensordiff.cli import main  # noqa: E402
from tensordiff import weights  # noqa: E402

pytestmark = pytest.mark.torch


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("weights")
    m = near_residual_llama(4)
    m.save_pretrained(root / "ref")
    m.save_pretrained(root / "same")
    with torch.no_grad():
        m.model.layers[2].mlp.up_proj.weight.mul_(1.05)
        m.model.layers[3].self_attn.q_proj.weight.add_(0.01)
    m.save_pretrained(root / "port")
    # an engine's fused layout of the reference, with layer 1's k projection changed
    from safetensors.torch import save_file
    ref = near_residual_llama(4).state_dict()
    fused = {}
    for k, v in ref.items():
        if ".self_attn.q_proj." in k:
            kk, vv = k.replace("q_proj", "k_proj"), k.replace("q_proj", "v_proj")
            kt = ref[kk].clone()
            if ".layers.1." in k:
                kt[0, 0] += 1.0
            fused[k.replace("q_proj", "qkv_proj")] = torch.cat([v, kt, ref[vv]])
        elif ".self_attn.k_proj." in k or ".self_attn.v_proj." in k or ".mlp.up_proj." in k:
            continue
        elif ".mlp.gate_proj." in k:
            fused[k.replace("gate_proj", "gate_up_proj")] = torch.cat([v, ref[k.replace("gate_proj", "up_proj")]])
        else:
            fused[k] = v.contiguous()
    (root / "engine").mkdir()
    save_file(fused, str(root / "engine" / "model.safetensors"))
    (root / "engine" / "config.json").write_text((root / "ref" / "config.json").read_text())
    return root


def test_identical_checkpoints_agree(ckpts, capsys):
    assert main(["weights", str(ckpts / "ref"), str(ckpts / "same")]) == 0
    out = capsys.readouterr().out
    assert out.startswith("weights agree:"), out


def test_the_first_parameter_that_differs_is_named_with_layer_and_op(ckpts, capsys):
    assert main(["weights", str(ckpts / "ref"), str(ckpts / "port")]) == 1
    first = capsys.readouterr().out.splitlines()[0]
    assert "layer2 mlp_up" in first and "model.layers.2.mlp.up_proj.weight" in first, first
    assert "rel diff 0.05" in first and "2 of " in first, first


def test_fused_engine_layout_is_split_and_compared(ckpts, capsys):
    assert main(["weights", str(ckpts / "ref"), str(ckpts / "engine")]) == 1
    first = capsys.readouterr().out.splitlines()[0]
    assert "layer1 k" in first and "model.layers.1.self_attn.qkv_proj.weight" in first, first
    assert "1 of " in first, first


def test_fingerprints_record_and_compare_the_same(ckpts, tmp_path, capsys):
    fp = tmp_path / "ref.json"
    assert main(["weights", str(ckpts / "ref"), "--fingerprint", str(fp)]) == 0
    doc = json.loads(fp.read_text())
    assert doc["format"] == weights.FINGERPRINT_FORMAT
    e = next(p for p in doc["parameters"] if p["key"] == "layer2.mlp_up.weight")
    assert set(e) >= {"key", "name", "dtype", "shape", "sha256", "norm", "samples"}
    assert main(["weights", str(fp), str(ckpts / "same")]) == 0
    capsys.readouterr()
    assert main(["weights", str(fp), str(ckpts / "port")]) == 1
    first = capsys.readouterr().out.splitlines()[0]
    assert "layer2 mlp_up" in first and "fingerprint" in first, first


@pytest.mark.parametrize("case", ["missing", "not-safetensors", "bad-header", "bad-fingerprint", "fifo"])
def test_bad_input_is_one_line_exit_2(ckpts, tmp_path, capsys, case):
    b = tmp_path / "b"
    b.mkdir()
    if case == "not-safetensors":
        (b / "model.safetensors").write_text("hello")
    elif case == "bad-header":
        (b / "model.safetensors").write_bytes((10**12).to_bytes(8, "little") + b"{}")
    target = str(tmp_path / "nope") if case == "missing" else str(b)
    if case == "bad-fingerprint":
        target = str(tmp_path / "fp.json")
        (tmp_path / "fp.json").write_text('{"format": "something else"}')
    elif case == "fifo":
        target = str(tmp_path / "pipe")
        os.mkfifo(target)
    assert main(["weights", str(ckpts / "ref"), target]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("tensordiff: error:"), err


def test_param_names_map_to_layer_and_op():
    assert weights.param_key("model.layers.3.self_attn.o_proj.weight") == ("layer3.attn_out", "weight")
    assert weights.param_key("model.layers.3.mlp.down_proj.weight") == ("layer3.mlp_out", "weight")
    assert weights.param_key("model.embed_tokens.weight") == ("embed", "weight")
    assert weights.param_key("model.norm.weight") == ("final_norm", "weight")
    assert weights.param_key("model.layers.0.input_layernorm.weight") == ("layer0.attn_norm", "weight")
    assert weights.param_key("lm_head.weight") == (None, "weight")
    assert os.path.basename(weights.__file__) == "weights.py"
    assert np is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_live_models_fingerprints_equal_its_checkpoints(tmp_path, dtype, capsys):
    """One format: fingerprinting the model in memory gives the hashes its saved safetensors give."""
    from tensordiff.recorders.weights_fp import model_fingerprints

    m = near_residual_llama(2).to(dtype)
    m.save_pretrained(tmp_path / "ck")
    doc = model_fingerprints(m)
    (tmp_path / "live.json").write_text(json.dumps(doc))
    disk = {p.key: p.fingerprint() for p in weights.load(str(tmp_path / "ck")).params.values()}
    live = {e["key"]: e for e in doc["parameters"] if e["key"] in disk}
    assert set(live) == set(disk)
    assert all(live[k]["sha256"] == disk[k]["sha256"] and live[k]["samples"] == disk[k]["samples"] for k in disk)
    assert main(["weights", str(tmp_path / "live.json"), str(tmp_path / "ck")]) == 0
