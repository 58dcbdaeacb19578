"""`record train --zoom layer<b>`: the taps inside one decoder layer, canonical names, on a real tiny
HF Llama; the diff names the first op that differs."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from hf_traces import near_residual_llama  # noqa: E402

from tensordiff.cli import main  # noqa: E402
from tensordiff.diff import diff_traces  # noqa: E402
from tensordiff.names import TAPS  # noqa: E402
from tensordiff.trace import TraceReader  # noqa: E402

pytestmark = pytest.mark.torch

DENSE_TAPS = [t for t in TAPS if t != "router"]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("zoom")
    m = near_residual_llama(6)
    m.save_pretrained(root / "ref")
    with torch.no_grad():   # the "port": layer 3's up projection scaled by 1.05
        m.model.layers[3].mlp.up_proj.weight.mul_(1.05)
    m.save_pretrained(root / "port")
    r = near_residual_llama(6)   # another "port": rope theta 10000 -> 20000
    r.config.rope_parameters["rope_theta"] = 20000.0
    r.save_pretrained(root / "rope")
    g = torch.Generator().manual_seed(7)
    p = root / "p.jsonl"
    p.write_text("".join(json.dumps({"id": f"p{i}", "input_ids": torch.randint(0, 256, (16 + i,), generator=g).tolist()})
                         + "\n" for i in range(2)))
    return root


def _record(dirs, which, out, *extra):
    return main(["record", "train", "--model", str(dirs / which), "--prompts", str(dirs / "p.jsonl"), "--out", str(out),
                 "--no-progress", "--topk", "0", "--aux-ids", "0", "2", "4", "--dtype", "float32", *extra])


def test_zoom_records_the_layers_taps_only(dirs, tmp_path):
    out = tmp_path / "z.h5"
    assert _record(dirs, "ref", out, "--zoom", "layer3") == 0
    with TraceReader(str(out)) as r:
        taps = sorted((n for n in r.tensors if "." in n), key=lambda n: r.tensors[n].order)
        assert taps == [f"layer3.{t}" for t in DENSE_TAPS]
        assert all(3 < r.tensors[n].order < 4 for n in taps)
        assert r.tensors["layer3.q"].attrs["module_path"] == "model.layers.3.self_attn.q_proj.output"
        assert r.tensors["layer3.q"].width == 64 and r.tensors["layer3.k"].width == 32
    # the recorded values are the model's: q_rope against HF's own rotary applied by hand
    from transformers.models.llama import modeling_llama as ml
    m = near_residual_llama(6)
    ids = torch.tensor(json.loads((dirs / "p.jsonl").read_text().splitlines()[0])["input_ids"])
    seen = {}
    h = m.model.layers[3].self_attn.register_forward_pre_hook(
        lambda mod, a, kw: seen.update(x=kw.get("hidden_states", a[0] if a else None), pe=kw["position_embeddings"]),
        with_kwargs=True)
    with torch.no_grad():
        m(ids[None], use_cache=False)
        h.remove()
        attn = m.model.layers[3].self_attn
        q = attn.q_proj(seen["x"]).view(1, len(ids), -1, 16).transpose(1, 2)
        k = attn.k_proj(seen["x"]).view(1, len(ids), -1, 16).transpose(1, 2)
        qr, _ = ml.apply_rotary_pos_emb(q, k, *seen["pe"])
    want = qr.transpose(1, 2).reshape(len(ids), -1).numpy()
    with TraceReader(str(out)) as r:
        got = r.read_values("layer3.q_rope")[: len(ids)]
    assert abs(got - want).max() < 1e-5


def test_zoom_names_the_first_op_that_differs(dirs, tmp_path):
    a, b = tmp_path / "a.h5", tmp_path / "b.h5"
    assert _record(dirs, "ref", a, "--zoom", "layer3") == 0
    assert _record(dirs, "port", b, "--zoom", "layer3") == 0
    res = diff_traces(str(a), str(b))
    assert res.exit_code == 1
    f = res.first_divergence
    assert f.tensor == "layer3.mlp_up", f.message
    same = diff_traces(str(a), str(a))
    assert same.exit_code == 0


def test_zoom_bad_layer_is_one_line(dirs, tmp_path, capsys):
    for bad in ("layer9", "embed", "x"):
        assert _record(dirs, "ref", tmp_path / "x.h5", "--zoom", bad) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "--zoom" in err[0], err


def test_zoom_into_layer0_names_the_rotary_of_a_rope_theta_port(dirs, tmp_path):
    """Every layer's attention uses the rotary: boundary layer1 diverges first; zoomed into layer 0,
    q and k agree and q_rope is the first op out of the noise."""
    a, b = tmp_path / "a.h5", tmp_path / "b.h5"
    assert _record(dirs, "ref", a, "--zoom", "layer0") == 0
    assert _record(dirs, "rope", b, "--zoom", "layer0") == 0
    res = diff_traces(str(a), str(b))
    assert res.exit_code == 1
    assert res.first_divergence.tensor == "layer0.q_rope", res.first_divergence.message


@pytest.mark.parametrize("arch", ["qwen3", "mixtral"])
def test_zoom_covers_qwen3_and_moe_layouts(tmp_path, arch):
    import transformers

    from tensordiff.recorders.core import Recorder
    from tensordiff.recorders.hf import HFExtractorRecorder, model_info

    common = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    if arch == "qwen3":
        m = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(head_dim=16, **common)).eval()
        want = DENSE_TAPS
    else:
        m = transformers.MixtralForCausalLM(transformers.MixtralConfig(num_local_experts=4, num_experts_per_tok=2,
                                                                       **common)).eval()
        want = [t for t in TAPS if t not in ("mlp_gate", "mlp_up", "mlp_act")]   # experts are not one MLP
    with Recorder(str(tmp_path / "z.h5"), side="train", model=model_info(m)) as rec:
        HFExtractorRecorder(m, rec, None, topk=0, zoom=2).run("s", torch.arange(10))
    with TraceReader(str(tmp_path / "z.h5")) as r:
        taps = sorted((n for n in r.tensors if "." in n), key=lambda n: r.tensors[n].order)
        assert taps == [f"layer2.{t}" for t in want]
        if arch == "mixtral":
            assert r.tensors["layer2.router"].width == 4


def test_name_rules_zoom_into_a_layout_the_table_does_not_know(tmp_path, capsys):
    """GPT-2 (transformer.h.<b>, fused c_attn): user rules name its taps; without rules the zoom
    refuses it in one line."""
    import transformers

    torch.manual_seed(0)
    m = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=128, n_embd=64, n_layer=3, n_head=4,
                                                             n_positions=64)).eval()
    d = tmp_path / "gpt2"
    m.save_pretrained(d)
    p = tmp_path / "p.jsonl"
    p.write_text(json.dumps({"id": "a", "input_ids": list(range(1, 12))}) + "\n")
    base = ["record", "train", "--model", str(d), "--prompts", str(p), "--no-progress", "--topk", "0",
            "--no-draft-input", "--zoom", "layer1"]
    assert main([*base, "--out", str(tmp_path / "x.h5")]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("tensordiff")]
    assert len(err) == 1 and "--name-rule" in err[0], err
    rules = [r"transformer\.h\.(\d+)\.ln_1=attn_norm", r"transformer\.h\.(\d+)\.attn=attn_out",
             r"transformer\.h\.(\d+)\.ln_2=mlp_norm", r"transformer\.h\.(\d+)\.mlp=mlp_out"]
    out = tmp_path / "g.h5"
    assert main([*base, "--out", str(out), *(x for r in rules for x in ("--name-rule", r))]) == 0
    with TraceReader(str(out)) as r:
        taps = sorted((n for n in r.tensors if "." in n), key=lambda n: r.tensors[n].order)
        assert taps == ["layer1.attn_norm", "layer1.attn_out", "layer1.mlp_norm", "layer1.mlp_out"]
        assert r.tensors["layer1.mlp_out"].attrs["module_path"] == "transformer.h.1.mlp.output"
