"""`TENSORDIFF_ZOOM=layer3` in the vLLM plugin: real vLLM on the CPU (EAGLE-3) records layer 3's
taps through the engine's own modules; `record train --from-serve --zoom layer3` records the same
sequences through HF. Same weights: they agree, op by op; a weight changed in the engine's copy is
named with its signature. The model is the vLLM tests' random 8-layer shape with head size 64
(vLLM's CPU attention refuses the trained model's 16), recorded in float32 on both sides."""

from __future__ import annotations

import pytest

import sglang_support as sup
import vllm_support as vsup
import recordings as recs

from tensordiff.names import TAPS

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.torch,
              pytest.mark.skipif(not vsup.vllm_available(), reason="the vLLM venv (.venv-vllm) is not installed")]

LAYER = 3


def _pair(recorded, serve, train):
    """A serve run with TENSORDIFF_ZOOM=layer3 for the engine (float32, full values) and `record train
    --from-serve --zoom layer3` of its outputs through the unchanged target."""
    return recorded(train)["trace"], recorded(serve)["trace"]


def test_vllm_zoom_records_the_layers_taps_and_agrees_with_hf(recorded):
    train, serve = _pair(recorded, recs.VLLM_ZOOM_SAME, recs.VLLM_ZOOM_SAME_TRAIN)
    sup.assert_zoom_taps_agree(train, serve, LAYER, TAPS)


def test_vllm_zoom_names_a_weight_changed_in_the_engine(recorded):
    train, serve = _pair(recorded, recs.VLLM_ZOOM_CHANGED, recs.VLLM_ZOOM_CHANGED_TRAIN)
    rc, doc, err = sup.diff_json(train, serve)
    assert doc is not None, err
    head = doc["headline"]
    print(head)
    assert rc == 1
    first = doc["first_divergence"]
    assert first["tensor"] == f"layer{LAYER}.mlp_up", head
    assert first["kind"] == "signature" and first["details"]["signature"] == "scale", head
    assert "scaled by 1.05" in head, head
