"""`TENSORDIFF_ZOOM=layer3` in the SGLang plugin: the trained tiny Llama served by real SGLang on
the CPU (EAGLE-3, its draft) records layer 3's taps through the engine's own modules (fused
qkv_proj and gate_up_proj split, the rotary module's (q, k)); `record train --from-serve --zoom
layer3` records the same sequences through HF. Same weights: they agree, op by op. A weight changed
in the engine's copy: the diff names that op and its signature."""

from __future__ import annotations

import subprocess
import sys

import pytest

import sglang_support as sup

from tensordiff.names import TAPS

pytestmark = [pytest.mark.slow, pytest.mark.sglang, pytest.mark.torch,
              pytest.mark.skipif(not sup.sglang_available(), reason="SGLang not installed")]

LAYER = 3


def _serve(target, draft, prompts, out_dir, name):
    """record_eagle_serve with TENSORDIFF_ZOOM set for the engine (float32, full values)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    pfile = sup.write_prompts(out_dir / f"{name}-prompts.jsonl", prompts)
    trace, outputs = out_dir / f"{name}.h5", out_dir / f"{name}.jsonl"
    argv = [sys.executable, "-c", sup.EAGLE_RUNNER.format(tests=str(sup.HERE)), "--model", str(target),
            "--draft", str(draft), "--prompts", str(pfile), "--out", str(trace), "--outputs", str(outputs),
            "--max-new-tokens", "4", "--batch-size", "2", "--device", "cpu", "--dtype", "float32",
            "--chunked-prefill-size", "32", "--mem-fraction-static", "0.3", "--max-total-tokens", "2048",
            "--log-level", "error", "--attention-backend", "intel_amx", "--catalog", "--values", "all"]
    env = {**sup.engine_env(), "TENSORDIFF_ZOOM": f"layer{LAYER}"}
    proc = subprocess.run(argv, check=False, capture_output=True, text=True, env=env, cwd=sup.REPO, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"SGLang serve run failed ({proc.returncode}): {proc.stdout[-2000:]}{proc.stderr[-3000:]}")
    return sup.load_serve_run(trace, outputs)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    got = sup.trained_models(0)
    if got is None:
        pytest.skip("no trained model (scripts/train_tiny_models.py)")
    root = tmp_path_factory.mktemp("zoom-sglang")
    prompts = dict(list(got["prompts"].items())[:4])
    # the engine's copy with one weight changed: layer 3's up projection x 1.05
    changed = sup.scaled_weight_copy(got["target"], root / "changed", f"model.layers.{LAYER}.mlp.up_proj.weight", 1.05)
    return {**got, "prompts": prompts, "root": root, "changed": changed}


def _pair(models, target, name):
    root = models["root"]
    run = _serve(target, models["draft"], models["prompts"], root, name)
    train = sup.record_train_from_serve(models["target"], run["outputs"], root / f"{name}-train.h5", models["draft"],
                                        "sglang-llama", extra=("--values", "all", "--zoom", f"layer{LAYER}"))
    return str(train), run["trace"]


def test_sglang_zoom_records_the_layers_taps_and_agrees_with_hf(models):
    train, serve = _pair(models, models["target"], "same")
    sup.assert_zoom_taps_agree(train, serve, LAYER, TAPS)


def test_sglang_zoom_names_a_weight_changed_in_the_engine(models):
    train, serve = _pair(models, models["changed"], "changed")
    rc, doc, err = sup.diff_json(train, serve)
    assert doc is not None, err
    head = doc["headline"]
    print(head)
    assert rc == 1
    first = doc["first_divergence"]
    assert first["tensor"] == f"layer{LAYER}.mlp_up", head
    assert first["kind"] == "signature" and first["details"]["signature"] == "scale", head
    assert "scaled by 1.05" in head, head


@pytest.mark.parametrize("value, want", [("layer3", 3), ("5", 5), ("", None)])
def test_zoom_env_is_read(value, want):
    from tensordiff.recorders.sglang.config import Config

    cfg = Config.from_env({"TENSORDIFF_TRACE": "/tmp/x.h5", "TENSORDIFF_ZOOM": value})
    assert cfg is not None and cfg.zoom == want


def test_bad_zoom_env_is_one_clear_error():
    from tensordiff.recorders.sglang.config import Config

    with pytest.raises(ValueError, match="TENSORDIFF_ZOOM='embed'"):
        Config.from_env({"TENSORDIFF_TRACE": "/tmp/x.h5", "TENSORDIFF_ZOOM": "embed"})
