"""MoE routing tables: the recorder's row layout and the diff's flip count (real traces, no engine)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tensordiff import conventions as cv
from tensordiff.diff import diff_traces
from tensordiff.recorders.core import Recorder
from tensordiff.recorders.routing import ids_and_weights, routing_table
from tensordiff.trace import TraceReader

pytestmark = pytest.mark.torch

H, T, E = 16, 12, 8


def test_routing_rows_sort_pairs_by_expert_id():
    ids = torch.tensor([[5, 1], [0, 7]])
    w = torch.tensor([[0.25, 0.75], [0.5, 0.125]])
    np.testing.assert_array_equal(routing_table(ids, w).numpy(), [[1, 5, 0.75, 0.25], [0, 7, 0.5, 0.125]])
    # HF's (router_logits, topk_weights, topk_ids) and an object with topk_ids / topk_weights
    got = ids_and_weights((torch.zeros(2, E), w, ids))
    assert got is not None and got[0] is ids and got[1] is w
    assert ids_and_weights(torch.zeros(2, 2)) is None


def _trace(path, side: str, ids: torch.Tensor, w: torch.Tensor, layers=(1, 2)):
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(0))
    with Recorder(path, side=side, model={"num_layers": 3, "hidden_size": H}) as rec:
        rows = rec.add_tokens("s", None, list(range(T)))
        rec.boundary(1, x, rows)
        for layer in layers:
            rec.plain(cv.moe_routing_name(layer), routing_table(ids, w), rows, role=cv.MOE_ROUTING)
    return str(path)


def test_diff_counts_routing_flips_per_layer(tmp_path):
    g = torch.Generator().manual_seed(1)
    ids = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(T)])
    w = torch.rand(T, 2, generator=g)
    a = _trace(tmp_path / "a.h5", "train", ids, w)
    flipped = ids.clone()
    flipped[4, 0] = next(e for e in range(E) if e not in ids[4].tolist())  # token 4: another expert
    b = _trace(tmp_path / "b.h5", "serve", flipped, w, layers=(1, 2, 3))
    with TraceReader(a) as r:
        info = r.tensors[cv.moe_routing_name(1)]
        assert (info.role, info.width, info.token_offset) == (cv.MOE_ROUTING, 4, 0)
    res = diff_traces(a, b)
    assert not res.divergences  # routing is a note, never a divergence
    (f,) = [f for f in res.findings if f.kind == "routing"]
    d = f.details
    assert [(x["layer"], x["tokens"], x["flips"]) for x in d.layers] == [(1, T, 1), (2, T, 1)]
    assert d.layers[0]["first"] == {"seq": "s", "position": 4} and d.only_b == [3]
    assert f.message == ("MoE routing flips: 2 of 24 token-layer choices pick other experts on serve than on train "
                         "(8.3%; by layer: layer1 8.3%, layer2 8.3%); first at sequence s position 4, layer1; "
                         "recorded on serve only: layer3")
    same = diff_traces(a, _trace(tmp_path / "c.h5", "serve", ids, w))
    (f,) = [f for f in same.findings if f.kind == "routing"]
    assert f.message == "MoE routing agrees: train and serve pick the same experts for all 24 token-layer choices (2 MoE layers)"


# -- near-tie flips on a real MoE port: a tiny Mixtral, side A eager attention, side B SDPA, both bf16 --


@pytest.fixture(scope="module")
def mixtral_pair(tmp_path_factory):
    """The fuzzer's tiny Mixtral (4 layers, 4 experts, top-2) recorded as a correct bf16 port and as
    the port with a wrong router (expert 0's row of layer 1's router scaled by 1.3)."""
    pytest.importorskip("transformers")
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks.fuzz import models as M

    m = M.model("mixtral")
    d = tmp_path_factory.mktemp("mixtral")

    def wrong_router(net):
        net.model.layers[1].mlp.gate.weight[0] *= 1.3

    a = M.record(m, M.side_model(m, "bfloat16", "eager"), d / "a.h5", "full")
    b = M.record(m, M.side_model(m, "bfloat16", "sdpa"), d / "b.h5", "full", side="serve")
    bug = M.record(m, M.side_model(m, "bfloat16", "sdpa", wrong_router), d / "bug.h5", "full", side="serve")
    return str(a), str(b), str(bug)


@pytest.mark.parametrize("order", ["AB", "BA"])
def test_near_tie_routing_flips_are_set_apart_not_a_divergence(mixtral_pair, order):
    """Two tokens take another second expert at layer 2 on a near-tie between eager and SDPA: they
    and only they leave the trend at layer3 (their margin is within the router noise), so they are
    set apart from that state's verdict and said so, not a divergence."""
    a, b, _ = mixtral_pair
    x, y = (a, b) if order == "AB" else (b, a)
    res = diff_traces(x, y)
    assert not res.divergences, res.headline()
    (f,) = [f for f in res.findings if f.kind == "routing"]
    d = f.details
    assert [(r["layer"], r["flips"], r["near_ties"]) for r in d.layers] == [(0, 0, 0), (1, 0, 0), (2, 2, 2), (3, 1, 1)]
    assert {"state": "layer3", "tokens": 2} in d.set_apart
    assert "set apart from the verdict of layer3 (2)" in f.message
    assert "but for 3 MoE routing flip(s) on near-ties, set apart" in res.headline()


@pytest.mark.parametrize("order", ["AB", "BA"])
def test_a_wrong_router_is_found_where_it_acts(mixtral_pair, order):
    """A router row scaled flips tokens at layer 1 by more than the router noise: never set apart,
    the first divergence is the state after it (layer2)."""
    a, _, bug = mixtral_pair
    x, y = (a, bug) if order == "AB" else (bug, a)
    res = diff_traces(x, y)
    first = res.first_divergence
    assert first is not None and first.kind == "numeric" and first.tensor == "layer2", res.headline()
    (f,) = [f for f in res.findings if f.kind == "routing"]
    assert f.details.layers[1]["flips"] > f.details.layers[1]["near_ties"]
    assert not any(x["state"] == "layer2" for x in f.details.set_apart)
