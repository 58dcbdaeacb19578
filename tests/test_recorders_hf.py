"""The HF extractor recorder and `tensordiff record train`, on tiny local Llama and Qwen models with
random weights (never downloaded), against HF's own output_hidden_states, bit-exact in fp32."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tensordiff.recorders.core import Recorder
from tensordiff.recorders.hf import HFExtractorRecorder, model_info, plan_draft_input
from tensordiff.trace import TraceReader

pytestmark = pytest.mark.torch

N, H, V = 8, 64, 128


def tiny(arch: str = "llama", layers: int = N, seed: int = 0, dtype=torch.float32):
    torch.manual_seed(seed)
    common = {"vocab_size": V, "hidden_size": H, "intermediate_size": 128, "num_hidden_layers": layers,
                  "num_attention_heads": 4, "num_key_value_heads": 2, "initializer_range": 0.3, "max_position_embeddings": 256}
    if arch == "llama":
        cfg = transformers.LlamaConfig(**common)
        model = transformers.LlamaForCausalLM(cfg)
    elif arch == "qwen2":
        cfg = transformers.Qwen2Config(**common)
        model = transformers.Qwen2ForCausalLM(cfg)
    elif arch == "qwen3":
        cfg = transformers.Qwen3Config(head_dim=16, **common)
        model = transformers.Qwen3ForCausalLM(cfg)
    else:
        raise ValueError(arch)
    return model.to(dtype).eval()


def record(model, path, plan=None, seqs=None, values="all"):
    seqs = seqs if seqs is not None else {"s0": torch.randint(0, V, (17,), generator=torch.Generator().manual_seed(5))}
    outs = {}
    with Recorder(path, side="train", model=model_info(model)) as rec:
        hf = HFExtractorRecorder(model, rec, plan, values=values)
        for key, ids in seqs.items():
            with hf.capture(key, ids), torch.no_grad():
                outs[key] = model(ids[None], output_hidden_states=True)
    return outs


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_every_boundary_equals_hf_hidden_states_bit_exact(tmp_path, arch):
    model = tiny(arch)
    norm_in, head_in = [], []
    model.model.norm.register_forward_pre_hook(lambda m, a: norm_in.append(a[0].detach().clone()))
    model.lm_head.register_forward_pre_hook(lambda m, a: head_in.append(a[0].detach().clone()))
    p = tmp_path / "t.h5"
    out = record(model, p)["s0"]
    hs = out.hidden_states
    assert len(hs) == N + 1
    with TraceReader(p) as r:
        for b in range(N):
            name = "embed" if b == 0 else f"layer{b}"
            assert r.tensors[name].kind == "boundary" and r.tensors[name].boundary == b
            np.testing.assert_array_equal(r.read_values(name), hs[b][0].numpy(), err_msg=name)
        # transformers 5.x: HF index N is the POST-norm state; boundary N is the norm's input
        layer_n = r.read_values(f"layer{N}")
        np.testing.assert_array_equal(layer_n, norm_in[-1][0].numpy())
        assert not np.allclose(layer_n, hs[N][0].numpy())
        fn = r.read_values("final_norm")
        assert r.tensors["final_norm"].kind == "final_norm"
        np.testing.assert_array_equal(fn, hs[N][0].numpy())
        np.testing.assert_array_equal(fn, head_in[-1][0].numpy())  # final_norm is the lm_head input
        # per-token RMS tells post-norm (RMSNorm with unit weight: RMS 1) from pre-norm
        np.testing.assert_allclose(r.read_rms("final_norm"), 1.0, atol=0.01)
        assert not np.allclose(r.read_rms(f"layer{N}"), 1.0, atol=0.1)
        assert r.model["num_layers"] == N and r.model["hidden_size"] == H
        assert {i.role for i in r.tensors.values()} == {"catalog", "target_topk"}
        # the target's predictions: top-k ids / log-probs / logsumexp of the lm_head output
        logits = out.logits[0].double()
        tk = r.read_values("target_topk")
        assert tk.shape == (17, 41) and r.tensors["target_topk"].token_offset == 0
        lse = torch.logsumexp(logits, -1)
        top = torch.topk(logits, 20, dim=-1)
        np.testing.assert_array_equal(tk[:, :20], top.indices.numpy())
        np.testing.assert_allclose(tk[:, 20:40], (top.values - lse[:, None]).numpy(), atol=1e-5)
        np.testing.assert_allclose(tk[:, 40], lse.numpy(), rtol=1e-6)


# Expected boundaries stated by hand for an 8-layer target: what each pipeline's own code builds.
def _specforge(hs, ids, pre_n):  # SpecForge HF backend: cat([hidden_states[id + 1] for id in ids])
    return torch.cat([hs[i + 1] for i in ids], -1)


def _eagle(hs, ids, pre_n):  # SafeAILab/EAGLE: inputs of layers 2, N//2, N-3
    return torch.cat([hs[2], hs[N // 2], hs[N - 3]], -1)


def _spec_legacy(hs, ids, pre_n):  # speculators: list = [hs[id+1]...] + [last state]; cat(list[:-1])
    lst = [hs[i + 1] for i in ids] + [pre_n]
    return torch.cat(lst[:-1], -1)


def _spec_legacy_embed(hs, ids, pre_n):  # the legacy extractor bug: [hs[0]] + [hs[id+1] ...]; cat(list[:-1])
    lst = [hs[0]] + [hs[i + 1] for i in ids]
    return torch.cat(lst[:-1], -1)


CASES = [
    ("specforge", [1, 3, 5], {}, ["layer2", "layer4", "layer6"], None, _specforge),
    ("eagle", None, {}, ["layer2", "layer4", "layer5"], None, _eagle),
    ("speculators-legacy", [2, 4, 6], {}, ["layer3", "layer5", "layer7"], "layer8", _spec_legacy),
    ("speculators-legacy", [2, 4, 6], {"prepend_embed": True}, ["embed", "layer3", "layer5"], "layer7",
     _spec_legacy_embed),
]


@pytest.mark.parametrize("conv,ids,kw,fed,verifier,build", CASES, ids=[c[0] + ("+embed" if c[2] else "") for c in CASES])
def test_each_convention_packs_what_its_pipeline_builds(tmp_path, conv, ids, kw, fed, verifier, build):
    model = tiny()
    pre_n = []
    model.model.norm.register_forward_pre_hook(lambda m, a: pre_n.append(a[0]))
    plan = plan_draft_input(conv, ids, N, **kw)
    assert list(plan.fed) == fed and plan.verifier == verifier
    p = tmp_path / "t.h5"
    out = record(model, p, plan, values="slots")["s0"]
    expected = build(out.hidden_states, ids, pre_n[-1])[0, :-1]  # draft row t: state t, paired with token t+1
    with TraceReader(p) as r:
        d = r.tensors["draft_input"]
        assert (d.kind, d.role, d.token_offset, d.convention) == ("packed", "draft_input", 1, conv)
        assert d.slot_labels == fed
        assert d.raw_ids == (list(plan.raw_ids) if plan.raw_ids else None)
        assert d.attrs["draft_plan"]["fed"] == fed
        np.testing.assert_array_equal(r.read_values("draft_input"), expected.numpy())
        rows = r.token_rows("draft_input")
        assert r.tokens["position"][rows].tolist() == list(range(16))
        # full values for the captured states + final_norm, sketches for everything
        assert r.tensors["final_norm"].has_values and r.tensors["layer1"].has_sketch
        assert r.tensors["layer1"].has_values == ("layer1" in plan.captured)


def test_explicit_boundaries_and_hf_index_n(tmp_path):
    model = tiny()
    pre_n = []
    model.model.norm.register_forward_pre_hook(lambda m, a: pre_n.append(a[0]))
    plan = plan_draft_input("boundary", None, N, boundaries=["embed", 3, N, "final_norm"])
    assert list(plan.fed) == ["embed", "layer3", "layer8", "final_norm"] and plan.raw_ids is None
    assert list(plan_draft_input("hf", [1, N], N).fed) == ["layer1", "final_norm"]
    assert list(plan_draft_input("specforge", [1, N - 1], N).fed) == ["layer2", "layer8"]
    assert list(plan_draft_input("specforge", [1, N - 1], N, hf_index_n_post_norm=True).fed) == ["layer2", "final_norm"]
    p = tmp_path / "t.h5"
    out = record(model, p, plan, values="none")["s0"]
    hs = out.hidden_states
    with TraceReader(p) as r:
        v = r.read_values("draft_input")
        np.testing.assert_array_equal(v, torch.cat([hs[0], hs[3], pre_n[-1], hs[N]], -1)[0, :-1].numpy())
        assert not r.tensors["layer3"].has_values and r.tensors["layer3"].has_sketch
    with pytest.raises(ValueError, match="outside"):
        plan_draft_input("specforge", [1, N], N)
    with pytest.raises(ValueError, match="speculators-legacy"):
        plan_draft_input("specforge", [1, 3, 5], N, prepend_embed=True)


def test_bf16_model_is_recorded_in_bf16(tmp_path):
    model = tiny(layers=2, dtype=torch.bfloat16)
    p = tmp_path / "t.h5"
    out = record(model, p, plan_draft_input("boundary", None, 2, boundaries=[0, 1]))["s0"]
    with TraceReader(p) as r:
        assert r.tensors["layer1"].dtype == "bfloat16" and r.tensors["draft_input"].dtype == "bfloat16"
        bits = r.read_values("layer1", raw=True)
        np.testing.assert_array_equal(bits, out.hidden_states[1][0].view(torch.int16).numpy().view(np.uint16))


def test_padded_batch_in_a_user_loop(tmp_path):
    """capture() around the user's own batched call: padding is skipped, draft rows stop one short."""
    model = tiny(layers=4)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, V, (2, 7), generator=g)
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, 5:] = 0
    p = tmp_path / "t.h5"
    plan = plan_draft_input("specforge", [0, 2], 4)
    with Recorder(p, side="train", model=model_info(model)) as rec:
        hf = HFExtractorRecorder(model, rec, plan)
        with hf.capture(["a", "b"], ids, mask), torch.no_grad():
            out = model(ids, attention_mask=mask, output_hidden_states=True)
    hs = out.hidden_states
    with TraceReader(p) as r:
        assert r.tensors["embed"].rows == 12
        pos = r.tokens["position"][r.token_rows("draft_input")]
        assert pos.tolist() == list(range(6)) + list(range(4))
        want = torch.cat([hs[1], hs[3]], -1)
        np.testing.assert_array_equal(r.read_values("draft_input"),
                                      torch.cat([want[0, :6], want[1, :4]]).numpy())


# ----------------------------------------------------------------------------------------------
# `tensordiff record train`
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny-llama")
    tiny().save_pretrained(d)
    return d


def _cli(argv):
    from tensordiff.cli import main
    return main(argv)


def _prompts(path, n=3, L=12, text=False):
    g = torch.Generator().manual_seed(11)
    with open(path, "w") as f:
        f.writelines(json.dumps({"id": f"p{i}", "input_ids": torch.randint(0, V, (L + i,), generator=g).tolist()}) + "\n"
                     for i in range(n))
    return path


def test_record_train_the_example_pair_bug(tmp_path, model_dir, capsys):
    """The train side of traces/: the extractor prepended embed, [:-1] fed [embed, layer3, layer5]."""
    prompts = _prompts(tmp_path / "p.jsonl")
    out = tmp_path / "train.h5"
    rc = _cli(["record", "train", "--model", str(model_dir), "--prompts", str(prompts), "--aux-ids", "2", "4", "6",
               "--convention", "speculators-legacy", "--prepend-embed", "--out", str(out), "--dtype", "float32"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "draft_input slots [embed, layer3, layer5]" in text and "layer7" in text
    with TraceReader(out) as r:
        assert r.side == "train"
        d = r.tensors["draft_input"]
        assert d.slot_labels == ["embed", "layer3", "layer5"]
        assert d.raw_ids == [2, 4, 6] and d.convention == "speculators-legacy"
        assert d.attrs["draft_plan"]["captured"] == ["embed", "layer3", "layer5", "layer7"]
        assert d.attrs["draft_plan"]["intended"] == ["layer3", "layer5", "layer7"]
        names = set(r.tensors)
        assert names == {"embed", *(f"layer{b}" for b in range(1, N + 1)), "final_norm", "draft_input", "target_topk"}
        assert r.sequences == ["p0", "p1", "p2"]
        assert d.rows == 11 + 12 + 13


@pytest.mark.slow
def test_diff_names_the_shifted_slot(tmp_path, model_dir):
    """Correct speculators extractor (A) vs the embed-prepending one (B): the diff finds the divergence."""
    prompts = _prompts(tmp_path / "p.jsonl", n=2, L=24)
    a, b = tmp_path / "a.h5", tmp_path / "b.h5"
    base = ["record", "train", "--model", str(model_dir), "--prompts", str(prompts), "--aux-ids", "2", "4", "6",
            "--convention", "speculators-legacy", "--no-progress"]
    assert _cli(base + ["--out", str(a)]) == 0
    assert _cli(base + ["--prepend-embed", "--out", str(b)]) == 0
    assert _cli(["diff", str(a), str(a), "-q"]) == 0
    assert _cli(["diff", str(a), str(b), "-q"]) == 1


def test_record_train_text_prompts_sampling_and_no_tty(tmp_path, model_dir, capsys, monkeypatch):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    mdir = tmp_path / "m"
    mdir.mkdir()
    for f in os.listdir(model_dir):
        os.symlink(os.path.join(model_dir, f), mdir / f)
    words = ["the", "cat", "sat", "on", "a", "mat", "and", "dog", "ran", "far", "away"]
    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(words)}}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="[UNK]").save_pretrained(mdir)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"text": "the cat sat on a mat and the dog ran far away"}) + "\n"
                       + json.dumps("a dog sat") + "\n" + json.dumps([5, 6, 7, 8]) + "\n")
    out = tmp_path / "t.h5"
    monkeypatch.setenv("NO_COLOR", "1")
    rc = _cli(["record", "train", "--model", str(mdir), "--prompts", str(prompts), "--convention", "eagle",
               "--sample-every", "2", "--positions", "3", "--values", "none", "--out", str(out)])
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    assert "\x1b[" not in cap.out + cap.err  # not a terminal, NO_COLOR: no escape codes, no live bar
    with TraceReader(out) as r:
        assert r.sequences == ["prompt-0", "prompt-1", "prompt-2"]
        first = r.tokens[r.tokens["seq"] == 0]
        assert first["token"].tolist() == [1, 2, 3, 4, 5, 6, 7, 1, 8, 9, 10, 11]
        pos = r.tokens["position"][r.token_rows("layer2")]
        assert sorted(set(pos.tolist())) == [0, 2, 3, 4, 6, 8, 10]
        assert not r.tensors["layer2"].has_values and r.tensors["draft_input"].has_values
        assert r.tensors["draft_input"].slot_labels == ["layer2", "layer4", "layer5"]


@pytest.mark.parametrize("case", ["no-model", "bad-json", "oov", "bad-ids", "prepend-specforge", "range",
                                  "broken-model", "text-no-tokenizer", "no-out-dir"])
def test_record_train_bad_input_is_one_line_exit_2(tmp_path, model_dir, capsys, case):
    prompts = _prompts(tmp_path / "p.jsonl", n=1)
    model = str(model_dir)
    extra: list[str] = []
    out = str(tmp_path / "t.h5")
    if case == "no-model":
        model = str(tmp_path / "nope")
    elif case == "bad-json":
        prompts.write_text("[1, 2\n")
    elif case == "oov":
        prompts.write_text(json.dumps([1, 2, V + 5]) + "\n")
    elif case == "bad-ids":
        prompts.write_text(json.dumps({"input_ids": [1, "x"]}) + "\n")
    elif case == "prepend-specforge":
        extra = ["--prepend-embed"]
    elif case == "range":
        extra = ["--aux-ids", "1", str(N)]
    elif case == "broken-model":
        bad = tmp_path / "broken"
        bad.mkdir()
        (bad / "config.json").write_text("{not json")
        model = str(bad)
    elif case == "text-no-tokenizer":
        prompts.write_text(json.dumps({"text": "hello"}) + "\n")
    elif case == "no-out-dir":
        out = str(tmp_path / "missing" / "t.h5")
    rc = _cli(["record", "train", "--model", model, "--prompts", str(prompts), "--out", out, "--no-progress", *extra])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.startswith("tensordiff: error:") and err.count("\n") == 1, err
    assert "Traceback" not in err


def test_conventions_own_the_planning():
    """hf.plan_draft_input is conventions.plan_draft_input; labels and the legacy generator's
    verifier id are planned there too (the importers use both)."""
    from tensordiff import conventions
    from tensordiff.recorders import hf

    assert hf.plan_draft_input is conventions.plan_draft_input and hf.DraftPlan is conventions.DraftPlan
    p = conventions.plan_from_labels(["embed", "3", "layer5", "layer7"], verifier_last=True)
    assert (p.captured, p.fed, p.verifier) == (("embed", "layer3", "layer5", "layer7"),
                                               ("embed", "layer3", "layer5"), "layer7")
    assert conventions.plan_from_labels([0, 8]).fed == ("embed", "layer8")
    with pytest.raises(ValueError):
        conventions.plan_from_labels(["nope"])
    p = conventions.plan_draft_input("speculators-legacy", [2, 4, 6, 7], N, ids_name_verifier=True)
    assert (p.fed, p.verifier, p.raw_ids) == (("layer3", "layer5", "layer7"), "layer8", (2, 4, 6, 7))
    with pytest.raises(ValueError, match="ids_name_verifier"):
        conventions.plan_draft_input("specforge", [1, 3, 5], N, ids_name_verifier=True)
    assert conventions.planning_choices()[:4] == ("specforge", "eagle", "speculators-legacy", "boundary")
    assert set(conventions.CONVENTIONS) <= set(conventions.planning_choices())


# ----------------------------------------------------------------------------------------------
# Predictions: --draft (the torch EAGLE-3 draft), --from-serve
# ----------------------------------------------------------------------------------------------


def _draft_dir(tmp_path, model_dir, norm_before_fc=False):
    import sys
    sys.path.insert(0, os.path.dirname(__file__))
    import sglang_support as sup

    d = sup.make_tiny_eagle3_draft(tmp_path / ("draft-norm" if norm_before_fc else "draft"), model_dir,
                                   aux_layer_ids=[1, 3, 5], draft_vocab=[3, 5, 7, 11])
    if norm_before_fc:
        cfg = json.loads((d / "config.json").read_text())
        cfg["eagle_config"]["norm_before_fc"] = True
        (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.mark.parametrize("norm", [False, True], ids=["plain", "norm_before_fc"])
def test_record_train_with_a_draft_records_fc_output_and_its_predictions(tmp_path, model_dir, norm):
    from safetensors.torch import load_file

    draft = _draft_dir(tmp_path, model_dir, norm)
    prompts = _prompts(tmp_path / "p.jsonl", n=2, L=10)
    out = tmp_path / "t.h5"
    assert _cli(["record", "train", "--model", str(model_dir), "--prompts", str(prompts), "--draft", str(draft),
                 "--topk", "3", "--no-progress", "--out", str(out)]) == 0
    w = load_file(str(draft / "model.safetensors"))
    with TraceReader(out) as r:
        d = r.tensors["draft_input"]
        assert d.raw_ids == [1, 3, 5] and d.slot_labels == ["layer2", "layer4", "layer6"]  # ids from the draft config
        fc, dt = r.tensors["draft_fc_output"], r.tensors["draft_topk"]
        assert (fc.token_offset, dt.token_offset, dt.width, r.tensors["target_topk"].width) == (1, 1, 7, 7)
        np.testing.assert_array_equal(r.token_rows("draft_fc_output"), r.token_rows("draft_input"))
        x = torch.from_numpy(r.read_values("draft_input")).double()
        if norm:  # RMSNorm (unit weight) over the whole packed row first
            x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        np.testing.assert_allclose(r.read_values("draft_fc_output"), (x @ w["fc.weight"].double().T).numpy(),
                                   rtol=1e-4, atol=1e-4)
        ids = r.read_values("draft_topk", raw=True)[:, :3]
        assert set(np.unique(ids).astype(int)) <= {3, 5, 7, 11}  # draft ids mapped to the target vocabulary
        lp = r.read_values("draft_topk", raw=True)[:, 3:6]
        assert (np.diff(lp, axis=1) <= 0).all() and (lp <= 0).all()


def test_from_serve_outputs_file_and_trace(tmp_path, model_dir):
    from tensordiff.recorders.train_cli import load_serve_sequences
    from tensordiff.trace import TraceWriter

    outs = tmp_path / "o.jsonl"
    outs.write_text(json.dumps({"id": "r1", "input_ids": [1, 2, 3], "output_ids": [4, 5]}) + "\n")
    assert load_serve_sequences(str(outs)) == [("r1", [1, 2, 3, 4, 5])]
    tr = tmp_path / "s.h5"
    w = TraceWriter(str(tr), side="serve", model={"hidden_size": 4})
    w.add_tokens("full", np.arange(4), [9, 8, 7, 6], "prefill")
    w.add_tokens("full", [2, 3], [7, 6], "target_verify")   # a position seen twice, same token
    w.add_tokens("cached", np.arange(3, 6), [1, 1, 1], "prefill")
    w.close()
    with pytest.raises(Exception, match="position 0 .*--outputs"):
        load_serve_sequences(str(tr))
    out = tmp_path / "t.h5"
    assert _cli(["record", "train", "--model", str(model_dir), "--from-serve", str(outs), "--no-progress",
                 "--out", str(out)]) == 0
    with TraceReader(out) as r:
        assert r.sequences == ["r1"] and r.tokens["token"].tolist() == [1, 2, 3, 4, 5]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "x", "input_ids": [1]}\n')
    assert _cli(["record", "train", "--model", str(model_dir), "--from-serve", str(bad), "--out", str(out)]) == 2
    assert _cli(["record", "train", "--model", str(model_dir), "--from-serve", str(tr), "--out", str(out)]) == 2
    assert _cli(["record", "train", "--model", str(model_dir), "--from-serve", str(outs), "--draft",
                 str(tmp_path / "nope"), "--out", str(out)]) == 2


@pytest.mark.parametrize("layout", ["sglang", "speculators", "draft_keys"])
def test_record_train_with_a_draft_as_model_is_one_line_before_any_load(tmp_path, model_dir, capsys, monkeypatch,
                                                                       layout):
    """An easy mix-up: the draft passed as --model. One line, exit 2, before transformers loads anything."""
    from tensordiff.recorders import train_cli

    if layout == "sglang":
        d = _draft_dir(tmp_path, model_dir)
        why = "architecture LlamaForCausalLMEagle3"
        assert "LlamaForCausalLMEagle3" in json.loads((d / "config.json").read_text())["architectures"]
    else:
        d = tmp_path / layout
        d.mkdir()
        cfg = ({"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3", "hidden_size": H}
               if layout == "speculators" else
               {"architectures": ["LlamaForCausalLM"], "draft_vocab_size": 32, "num_hidden_layers": 1, "hidden_size": H})
        (d / "config.json").write_text(json.dumps(cfg))
        why = "architecture Eagle3Speculator" if layout == "speculators" else "draft_vocab_size and one decoder layer"

    def no_load(*a, **k):
        raise AssertionError("the model (or its config) was loaded")

    monkeypatch.setattr(train_cli, "_load_config", no_load)
    monkeypatch.setattr(train_cli, "_load_model", no_load)
    prompts = _prompts(tmp_path / "p.jsonl", n=1)
    rc = _cli(["record", "train", "--model", str(d), "--prompts", str(prompts), "--out", str(tmp_path / "t.h5"),
               "--no-progress"])
    cap = capsys.readouterr()
    assert rc == 2 and cap.out == ""
    assert cap.err == (f"tensordiff: error: {d}: is an EAGLE-3 draft ({why}); --model takes the target model, "
                       "pass the draft with --draft\n")
    # a target model's config is not taken for a draft
    assert train_cli.eagle3_draft_reason(json.loads((model_dir / "config.json").read_text())) is None
    assert train_cli.eagle3_draft_reason({"eagle_config": {}, "num_hidden_layers": 32}) is None


def test_record_train_never_overwrites_its_prompts(tmp_path, model_dir, capsys):
    """--out naming the prompts file is refused with one line before any work; the prompts stay."""
    prompts = _prompts(tmp_path / "p.jsonl", n=1)
    before = prompts.read_bytes()
    rc = _cli(["record", "train", "--model", str(model_dir), "--prompts", str(prompts), "--out", str(prompts),
               "--no-progress"])
    cap = capsys.readouterr()
    assert rc == 2 and "would overwrite an input" in cap.err, cap.err
    assert len(cap.err.strip().splitlines()) == 1, cap.err
    assert prompts.read_bytes() == before
