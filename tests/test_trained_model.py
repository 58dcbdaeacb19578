"""The trained test model looks trained (scripts/train_tiny_models.py, tests/trained.py): the
reference for noise must not be a random-weight model whose bf16 error explodes with depth."""

from __future__ import annotations

import numpy as np
import pytest
import trained

from tensordiff.trace import TraceReader

pytestmark = pytest.mark.torch


def _cos(x, y):
    return (x * y).sum(1) / np.sqrt((x * x).sum(1) * (y * y).sum(1))


def test_trained_model_is_residual_dominated_and_its_bf16_noise_is_small():
    import torch
    a = trained.boundary_states(torch.float32)
    b = trained.boundary_states(torch.bfloat16)
    labels = ["embed"] + [f"layer{i}" for i in range(1, trained.N_LAYERS)]
    neighbour = [float(np.median(_cos(a[x], a[y]))) for x, y in zip(labels[1:], labels[2:])]
    # neighbouring layers: residual-dominated, but far from equal (a random model with tiny
    # residual branches would sit at 0.9999)
    assert 0.85 < min(neighbour) and max(neighbour) < 0.995, neighbour
    rel = [float(np.median(np.linalg.norm(a[x] - b[x], axis=1) / np.linalg.norm(a[x], axis=1))) for x in labels]
    # bf16 noise: about one rounding (2^-9) at the embedding, a few per mille deeper, growing
    # smoothly after layer1 (each layer at most 1.6x the one before: no explosion; layer1, which
    # writes most of the stream over the embedding, adds 2.4x)
    assert 0.001 < rel[0] < 0.003 and max(rel) < 0.02, rel
    assert all(r1 < 1.6 * r0 for r0, r1 in zip(rel[1:], rel[2:])), rel


def test_traces_of_the_trained_model_are_recorded_by_the_train_recorder(tmp_path_factory):
    t = trained.traces(tmp_path_factory.mktemp("trained"))
    for dt, p in t.items():
        with TraceReader(p) as r:
            assert r.tensors["draft_input"].slot_labels == list(trained.SLOTS)
            assert {"embed", "layer8", "final_norm", "target_topk", "draft_topk", "draft_fc_output"} <= set(r.tensors)
            assert r.tensors["layer4"].dtype == dt and r.tensors["layer4"].has_values
