"""`TENSORDIFF_ZOOM=layer3` in the SGLang plugin: the trained tiny Llama served by real SGLang on
the CPU (EAGLE-3, its draft) records layer 3's taps through the engine's own modules (fused
qkv_proj and gate_up_proj split, the rotary module's (q, k)); `record train --from-serve --zoom
layer3` records the same sequences through HF. Same weights: they agree, op by op. A weight changed
in the engine's copy: the diff names that op and its signature."""

from __future__ import annotations

import pytest

import recordings as recs
import sglang_support as sup

from tensordiff.names import TAPS

pytestmark = [pytest.mark.slow, pytest.mark.sglang, pytest.mark.torch,
              pytest.mark.skipif(not sup.sglang_available(), reason="SGLang not installed")]

LAYER = 3


@pytest.fixture(scope="module")
def trained():
    if sup.trained_models(0) is None:
        pytest.skip("no trained model (scripts/train_tiny_models.py)")


def _pair(recorded, serve, train):
    """A serve run with TENSORDIFF_ZOOM=layer3 for the engine (float32, full values) and `record train
    --from-serve --zoom layer3` of its outputs through the unchanged target."""
    return recorded(train)["trace"], recorded(serve)["trace"]


def test_sglang_zoom_records_the_layers_taps_and_agrees_with_hf(trained, recorded):
    train, serve = _pair(recorded, recs.ZOOM_SAME, recs.ZOOM_SAME_TRAIN)
    sup.assert_zoom_taps_agree(train, serve, LAYER, TAPS)


def test_sglang_zoom_names_a_weight_changed_in_the_engine(trained, recorded):
    train, serve = _pair(recorded, recs.ZOOM_CHANGED, recs.ZOOM_CHANGED_TRAIN)
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
