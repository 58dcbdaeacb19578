"""`TENSORDIFF_ZOOM=layer3` in the vLLM plugin: real vLLM on the CPU (EAGLE-3) records layer 3's
taps through the engine's own modules; `record train --from-serve --zoom layer3` records the same
sequences through HF. Same weights: they agree, op by op; a weight changed in the engine's copy is
named with its signature. The model is the vLLM tests' random 8-layer shape with head size 64
(vLLM's CPU attention refuses the trained model's 16), recorded in float32 on both sides."""

from __future__ import annotations

import subprocess

import pytest

import sglang_support as sup
import vllm_support as vsup

from tensordiff.names import TAPS

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.torch,
              pytest.mark.skipif(not vsup.vllm_available(), reason="the vLLM venv (.venv-vllm) is not installed")]

LAYER = 3


def _serve(target, draft, prompts, out_dir, name):
    out_dir.mkdir(parents=True, exist_ok=True)
    draft = vsup.full_vocab_draft(draft, out_dir / f"{name}-draft")
    pfile = sup.write_prompts(out_dir / f"{name}-prompts.jsonl", prompts)
    trace, outputs = out_dir / f"{name}.h5", out_dir / f"{name}.jsonl"
    argv = [str(vsup.vllm_python()), "-m", "tensordiff", "record", "serve", "--engine", "vllm", "--model", str(target),
            "--draft", str(draft), "--prompts", str(pfile), "--out", str(trace), "--outputs", str(outputs),
            "--max-new-tokens", "4", "--batch-size", "2", "--device", "cpu", "--dtype", "float32",
            "--chunked-prefill-size", "32", "--speculative-num-steps", "2", "--log-level", "warning",
            "--catalog", "--values", "all"]
    for a in vsup.CPU_ENGINE_ARGS:
        argv += ["--engine-arg", a]
    env = {**vsup.vllm_env(), "TENSORDIFF_ZOOM": f"layer{LAYER}"}
    proc = subprocess.run(argv, check=False, capture_output=True, text=True, env=env, cwd=vsup.REPO, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"vLLM serve run failed ({proc.returncode}): {proc.stdout[-2000:]}{proc.stderr[-3000:]}")
    return sup.load_serve_run(trace, outputs)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    import torch

    root = tmp_path_factory.mktemp("zoom-vllm")
    target = sup.make_tiny_llama(root / "target", **vsup.TINY_LLAMA_VLLM)
    draft = sup.make_tiny_eagle3_draft(root / "draft", target, aux_layer_ids=[2, 4, 6], draft_vocab=[1, 2])
    rng = torch.Generator().manual_seed(3)
    prompts = {k: torch.randint(1, 256, (n,), generator=rng).tolist() for k, n in (("A", 40), ("B", 24))}
    changed = sup.scaled_weight_copy(target, root / "changed", f"model.layers.{LAYER}.mlp.up_proj.weight", 1.05)
    return {"target": target, "draft": draft, "prompts": prompts, "root": root, "changed": changed}


def _pair(models, target, name):
    root = models["root"]
    run = _serve(target, models["draft"], models["prompts"], root, name)
    train = sup.record_train_from_serve(models["target"], run["outputs"], root / f"{name}-train.h5", models["draft"],
                                        "vllm", extra=("--values", "all", "--zoom", f"layer{LAYER}"))
    return str(train), run["trace"]


def test_vllm_zoom_records_the_layers_taps_and_agrees_with_hf(models):
    train, serve = _pair(models, models["target"], "same")
    sup.assert_zoom_taps_agree(train, serve, LAYER, TAPS)


def test_vllm_zoom_names_a_weight_changed_in_the_engine(models):
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
