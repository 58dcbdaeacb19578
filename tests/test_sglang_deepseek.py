"""The founding case's own architecture: a tiny DeepSeek-V3 (MLA + MoE) inside real SGLang 0.5.23 on
the CPU, recorded on both sides.

Two engines, each started once by a module fixture in its own process (``serve_cli.record``; the
``intel_amx`` attention backend needs the AMX override of tests/sglang_support.py, and it is the
backend that runs MLA on a CPU: ``torch_native`` cannot take MLA's MHA prefill):

* EAGLE-3 in bfloat16 with a draft whose ids are ``[1, 2, 3]``: SGLang's DeepSeek loop adds 1
  (ids[0] == 1) and feeds the draft ``[layer2, layer3, layer4]``;
* capture-only in float32 with ids ``[0, 2, 3]``: taken as they are, slot 0 is the embedding.

The train side is the real ``tensordiff record train`` on HF ``DeepseekV3ForCausalLM`` (float32),
once with the seed's extractor bug (``--prepend-embed``: ``[embed, layer2, layer3]``) and once
wired correctly. The sgl_kernel ops SGLang calls here run in the test-only stand-in
(tests/sgl_kernel_stub); its MLA shapes are self-checked below.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

import deepseek_support as ds  # noqa: E402
import sglang_support as sup  # noqa: E402
import recordings as recs  # noqa: E402

EAGLE_IDS = [1, 2, 3]          # SGLang deepseek_v2: ids[0] == 1, so +1: layers_to_capture [2, 3, 4]
EAGLE_SLOTS = ["layer2", "layer3", "layer4"]
CAPTURE_IDS = [0, 2, 3]        # ids[0] != 1: as they are; 0 is the input of layer 0, the embedding
CAPTURE_SLOTS = ["embed", "layer2", "layer3"]
MOE_LAYERS = [1, 2, 3, 4]      # the first layer is dense
MAX_NEW = 4
CHUNK = 32

_rng = np.random.default_rng(7)
PROMPTS = {"A": _rng.integers(1, 256, 40).tolist(),   # 2 prefill chunks: MLA after a cached prefix too
           "B": _rng.integers(1, 256, 9).tolist()}
assert PROMPTS == recs.DEEPSEEK_PROMPTS    # what the recordings of this module were given

needs_sglang = pytest.mark.skipif(not sup.sglang_available(), reason="real SGLang (and torch) not installed")
engine_test = [pytest.mark.sglang, pytest.mark.slow, needs_sglang]


def _env() -> dict:
    env = dict(os.environ)
    env["SGLANG_USE_CPU_ENGINE"] = "1"
    rest = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join([str(sup.STUB_DIR), str(REPO), *rest])
    env["SGLANG_PLUGINS"] = "tensordiff"
    for k in list(env):
        if k.startswith("TENSORDIFF_"):
            del env[k]
    return env


def _load(run: dict) -> dict:
    outs = [json.loads(line) for line in Path(run["outputs"]).read_text().splitlines()]
    return {"trace": run["trace"], "outputs": {o["id"]: o for o in outs}, "stdout": Path(run["stdout"]).read_text(),
            "full": {o["id"]: o["input_ids"] + o["output_ids"] for o in outs}, "outputs_path": Path(run["outputs"])}


def _td(*args: str, check: bool = False) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tensordiff", *args], check=check, capture_output=True, text=True,
                          cwd=REPO, timeout=600)


@pytest.fixture(scope="module")
def models(recorded):
    m = recorded(recs.DEEPSEEK_MODELS)
    return {"target": Path(m["target"]), "draft": Path(m["draft"]), "hf": ds.load_hf_deepseek(m["target"])}


@pytest.fixture(scope="module")
def eagle_run(recorded):
    return _load(recorded(recs.DEEPSEEK_EAGLE))


@pytest.fixture(scope="module")
def capture_run(recorded):
    return _load(recorded(recs.DEEPSEEK_CAPTURE))


def _record_train(models, outputs: Path, out: Path, *extra: str, ids=EAGLE_IDS,
                  convention: str = "speculators-legacy") -> str:
    proc = _td("record", "train", "--model", str(models["target"]), "--from-serve", str(outputs), "--aux-ids",
               *map(str, ids), "--convention", convention, "--dtype", "float32", "--device", "cpu",
               "--no-progress", "--out", str(out), *extra)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return str(out)


@pytest.fixture(scope="module")
def trains(models, eagle_run, tmp_path_factory):
    """Train traces of exactly the sequences the engine saw: the seed's extractor bug
    ([embed, layer2, layer3]) and the correct wiring ([layer2, layer3, layer4])."""
    tmp = tmp_path_factory.mktemp("ds-train")
    src = eagle_run["outputs_path"]
    return {"bug": _record_train(models, src, tmp / "bug.h5", "--prepend-embed"),
            "ok": _record_train(models, src, tmp / "ok.h5")}


def _diff(a: str, b: str) -> tuple[int, str, dict]:
    text = _td("diff", a, b)
    js = _td("diff", a, b, "--json")
    assert text.returncode in (0, 1) and js.returncode == text.returncode, text.stderr[-2000:] + js.stderr[-2000:]
    return text.returncode, text.stdout, json.loads(js.stdout)


# ----------------------------------------------------------------------------------------------
# The founding bug and the correct wiring (bf16 serve vs fp32 train)
# ----------------------------------------------------------------------------------------------


@pytest.mark.sglang
@pytest.mark.slow
@needs_sglang
def test_deepseek_engine_feeds_the_draft_ids_plus_one(eagle_run):
    from tensordiff.trace import TraceReader

    with TraceReader(eagle_run["trace"]) as r:
        info = r.tensors["draft_input"]
        assert info.slot_labels == EAGLE_SLOTS and info.raw_ids == EAGLE_IDS and info.convention == "sglang-deepseek"
        assert r.model["architecture"] == "DeepseekV3ForCausalLM" and r.model["dtype"] == "bfloat16"
        stats = json.loads(r.f.attrs["tensordiff_sglang"])
        assert stats["layers_to_capture"] == [2, 3, 4] and stats["moe_routing_layers"] == len(MOE_LAYERS)
    assert "draft_input: slots [layer2, layer3, layer4] from draft ids [1, 2, 3] (sglang-deepseek)" in eagle_run["stdout"]


@pytest.mark.sglang
@pytest.mark.slow
@needs_sglang
def test_deepseek_founding_bug_is_named(trains, eagle_run):
    rc, text, d = _diff(trains["bug"], eagle_run["trace"])
    assert rc == 1
    assert text.splitlines()[0] == ("train feeds draft_input [embed, layer2, layer3], serve feeds"
                                       " [layer2, layer3, layer4]; the draft was trained on train's"), text[:800]
    assert [r["verdict"] for r in d["slot_table"]] == ["wrong state"] * 3


@pytest.mark.sglang
@pytest.mark.slow
@needs_sglang
@pytest.mark.parametrize("order", ["train-serve", "serve-train"])
def test_deepseek_correct_wiring_agrees_bf16_serve_fp32_train(trains, eagle_run, order):
    a, b = (trains["ok"], eagle_run["trace"]) if order == "train-serve" else (eagle_run["trace"], trains["ok"])
    rc, text, d = _diff(a, b)
    assert rc == 0, text[:2000]
    assert text.startswith("no divergence"), text[:800]
    assert [r["verdict"] for r in d["slot_table"]] == ["ok"] * 3


# ----------------------------------------------------------------------------------------------
# The embedding asked of SGLang's DeepSeek loop
# ----------------------------------------------------------------------------------------------


@pytest.mark.sglang
@pytest.mark.slow
@needs_sglang
def test_deepseek_id_zero_captures_the_embedding(models, capture_run):
    """ids [0, 2, 3] are taken as they are (ids[0] != 1) and slot 0 is the embedding, as
    record serve says before the engine starts; each slot equals HF's boundary and not its
    neighbours (float32 both sides)."""
    assert ("note: draft ids [0, 2, 3] become layers_to_capture [0, 2, 3] in SGLang's DeepSeek loop (ids[0] != 1: "
            "taken as they are); 0 is the input of decoder layer 0, so slot 0 holds the embedding") in capture_run["stdout"]
    tr = sup.RecordedTrace(capture_run["trace"], "tensordiff_sglang")
    try:
        info = tr.r.tensors["aux_hidden_states"]
        assert info.slot_labels == CAPTURE_SLOTS and info.convention == "sglang-deepseek"
        assert "slot 0 holds the embedding" in tr.stats["capture_note"]
        vals = tr.r.read_values("aux_hidden_states")
        _, seqs, pos = tr.rows("aux_hidden_states")
        hf = {k: sup.hf_boundary_states(models["hf"], v) for k, v in capture_run["full"].items()}
        h = info.slot_width
        labels = ["embed"] + [f"layer{b}" for b in range(1, ds.NUM_LAYERS + 1)]
        for k, lab in enumerate(CAPTURE_SLOTS):
            got = vals[:, k * h:(k + 1) * h]
            for other in labels:
                ref = np.stack([hf[s][other][p] for s, p in zip(seqs, pos)])
                cos = sup.row_cos(got, ref)
                if other == lab:
                    assert cos.min() > 0.9999, (lab, cos.min())
                else:
                    assert np.median(cos) < 0.99, (lab, other, np.median(cos))
    finally:
        tr.close()


@pytest.mark.sglang
@needs_sglang
def test_record_serve_says_what_sglang_deepseek_does_with_an_id_it_cannot_capture(models, tmp_path):
    """ids [-1, 2, 3] (the embedding in a "+1" pipeline's numbering) reach SGLang's DeepSeek loop as
    they are; -1 is no decoder layer, and SGLang 0.5.23 fails the first forward pass with
    "captured 2 of 3 aux hidden states" (seen running it). record serve says so in one line and
    does not start the engine."""
    draft = sup.make_tiny_eagle3_draft(tmp_path / "draft-m1", models["target"], aux_layer_ids=[-1, 2, 3])
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "A", "input_ids": PROMPTS["B"]}) + "\n")
    proc = _td("record", "serve", "--model", str(models["target"]), "--draft", str(draft), "--prompts", str(prompts),
               "--out", str(tmp_path / "s.h5"), "--device", "cpu")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert ("draft ids [-1, 2, 3] become layers_to_capture [-1, 2, 3] in SGLang's DeepSeek loop, which captures the "
            "input of decoder layers 0..4 only: -1 is never captured, and SGLang 0.5.23 fails the first forward pass "
            "(RuntimeError: captured 2 of 3 aux hidden states)") in err[0]
    assert not (tmp_path / "s.h5").exists()


def test_sglang_deepseek_capture_notes():
    from tensordiff.conventions import sglang_deepseek_capture_note as note

    assert note([1, 2, 3], 5) is None and note(None, 5) is None   # +1: layers 2, 3, 4 all exist
    text, fatal = note([0, 2, 3], 5)
    assert not fatal and "slot 0 holds the embedding" in text
    text, fatal = note([1, 2, 4], 5)  # +1: layers_to_capture [2, 3, 5]; 5 = N is no decoder layer's input
    assert fatal and "[2, 3, 5]" in text and ": 5 is never captured" in text
    text, fatal = note([-1, 0, 3], 5)
    assert fatal and "captured 2 of 3 aux hidden states" in text


# ----------------------------------------------------------------------------------------------
# MoE routing on both sides
# ----------------------------------------------------------------------------------------------


def _routing(path: str) -> dict:
    """{layer: {(seq, position): row}} of a trace's routing tensors."""
    from tensordiff import conventions as cv
    from tensordiff.trace import TraceReader

    out = {}
    with TraceReader(path) as r:
        t = r.tokens
        for layer in MOE_LAYERS:
            name = cv.moe_routing_name(layer)
            info = r.tensors[name]
            assert info.role == cv.MOE_ROUTING and info.width == 2 * ds.TOP_K and info.token_offset == 0
            rows = r.token_rows(name)
            vals = r.read_values(name, raw=True)
            out[layer] = {(r.sequences[int(t["seq"][tr])], int(t["position"][tr])): v for tr, v in zip(rows, vals)}
    return out


def _flips(a: dict, b: dict) -> dict:
    k = ds.TOP_K
    res = {}
    for layer in MOE_LAYERS:
        both = sorted(set(a[layer]) & set(b[layer]))
        res[layer] = (len(both), sum(bool((a[layer][x][:k] != b[layer][x][:k]).any()) for x in both))
    return res


@pytest.mark.sglang
@pytest.mark.slow
@needs_sglang
def test_deepseek_routing_recorded_on_both_sides_and_equal_in_float32(models, capture_run, tmp_path):
    """The same weights in float32 on both sides: SGLang's router picks HF's experts with HF's weights
    (ids ascending, weights summing to 1), and the diff's routing note counts the same. The train
    side packs [embed, layer2, layer3] as the engine captured it for ids [0, 2, 3]: the pair agrees."""
    train = _record_train(models, capture_run["outputs_path"], tmp_path / "train.h5", ids=CAPTURE_IDS,
                          convention="boundary")
    hf, sg = _routing(train), _routing(capture_run["trace"])
    counts = _flips(hf, sg)
    for layer in MOE_LAYERS:
        n, flips = counts[layer]
        assert n >= sum(len(v) for v in capture_run["full"].values()) - 2 and flips == 0, (layer, n, flips)
        for key, row in sg[layer].items():
            k = ds.TOP_K
            assert (np.diff(row[:k]) > 0).all() and 0 <= row[:k].min() and row[:k].max() < ds.NUM_EXPERTS
            np.testing.assert_allclose(row[k:], hf[layer][key][k:], atol=1e-4)
            np.testing.assert_allclose(row[k:].sum(), 1.0, atol=1e-5)
    rc, text, d = _diff(train, capture_run["trace"])
    assert rc == 0 and text.startswith("no divergence"), text[:1500]  # slot 0 holds the embedding on both
    assert [r["held_b"] for r in d["slot_table"]] == CAPTURE_SLOTS
    f = [f for f in d["findings"] if f["kind"] == "routing"]
    assert len(f) == 1 and f[0]["severity"] == "info"
    assert [(x["layer"], x["tokens"], x["flips"]) for x in f[0]["details"]["layers"]] == [
        (layer, *counts[layer]) for layer in MOE_LAYERS]
    total = sum(n for n, _ in counts.values())
    assert f[0]["message"] == (f"MoE routing agrees: train and serve pick the same experts for all {total} "
                               f"token-layer choices ({len(MOE_LAYERS)} MoE layers)")
    assert "MoE routing agrees" in " ".join(text.split())


@pytest.mark.sglang
@pytest.mark.slow
@needs_sglang
def test_deepseek_routing_flips_bf16_serve_counted_per_layer(trains, eagle_run):
    """bf16 serve against fp32 train: the diff counts, per MoE layer, the tokens whose expert set
    differs (counted here again from both traces) and shows the rates in one note."""
    a, b = _routing(trains["ok"]), _routing(eagle_run["trace"])
    counts = _flips(a, b)
    _, text, d = _diff(trains["ok"], eagle_run["trace"])
    f = [f for f in d["findings"] if f["kind"] == "routing"]
    assert len(f) == 1 and f[0]["severity"] == "info"
    det = f[0]["details"]
    assert [(x["layer"], x["tokens"], x["flips"]) for x in det["layers"]] == [
        (layer, *counts[layer]) for layer in MOE_LAYERS]
    assert det["tokens"] == sum(n for n, _ in counts.values()) > 0
    total = sum(fl for _, fl in counts.values())
    assert det["flips"] == total
    flat = " ".join(text.split())  # the text report wraps long sentences
    if total:
        assert f"MoE routing flips: {total} of {det['tokens']} token-layer choices" in flat
        assert "layer1 " in f[0]["message"] and "layer4 " in f[0]["message"]
    else:
        assert "MoE routing agrees" in flat


# ----------------------------------------------------------------------------------------------
# The stand-in's ops in MLA's shapes
# ----------------------------------------------------------------------------------------------


@pytest.mark.slow
@needs_sglang
def test_stub_attention_in_mla_shapes_matches_the_reference():
    code = ("import torch, sgl_kernel._selfcheck as s\n"
            "s.check_mla_attention(torch.Generator().manual_seed(0))\n"
            "print(s.CASES, s.FAILURES)\n"
            "raise SystemExit(1 if s.FAILURES or not s.CASES else 0)\n")
    env = _env()
    proc = subprocess.run([sys.executable, "-W", "ignore", "-c", code], check=False, capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stdout.strip().startswith("12 []"), proc.stdout
