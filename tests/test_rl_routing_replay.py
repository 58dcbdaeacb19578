"""Routing replay (R3) in MoE RL: the trainer's experts handed the rollout's expert ids, with the
rollout's weights or with weights its own router recomputes. Real HF MoE models on both sides
(tiny Mixtral and Qwen2-MoE built here, random weights: no CPU engine runs a trained MoE here), the
rollout a bf16 copy served with prefill + KV-cache decode passes (tests/rl_support.py), the trainer
a float32 forward under :class:`TrainerRecorder` with a replay hook on each router, as a user's
R3 puts it there."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import rl_support as rs  # noqa: E402

from tensordiff.conventions import moe_routing_layer  # noqa: E402
from tensordiff.recorders.core import Recorder  # noqa: E402
from tensordiff.recorders.hf import model_info  # noqa: E402
from tensordiff.recorders.hooks import TrainerRecorder  # noqa: E402
from tensordiff.recorders.train_cli import load_serve_sequences  # noqa: E402
from tensordiff.rl.triage import triage  # noqa: E402
from tensordiff.trace import TraceReader  # noqa: E402

pytestmark = pytest.mark.torch

NEW, PROMPTS, T = 10, 3, 0.7


def _model(kind: str):
    import transformers

    common = {"vocab_size": 256, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 256, "tie_word_embeddings": False, "num_hidden_layers": 4}
    torch.manual_seed(7)
    if kind == "mixtral":
        cfg = transformers.MixtralConfig(**common, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2)
        return transformers.MixtralForCausalLM(cfg).eval()
    cfg = transformers.Qwen2MoeConfig(**common, intermediate_size=64, moe_intermediate_size=32, num_experts=4,
                                      num_experts_per_tok=2, shared_expert_intermediate_size=32, norm_topk_prob=False)
    return transformers.Qwen2MoeForCausalLM(cfg).eval()


def _prompts():
    rng = np.random.default_rng(5)
    return [rng.integers(1, 256, 20).tolist() for _ in range(PROMPTS)]


def rollout_tables(serve: Path) -> dict[int, dict[tuple[str, int], np.ndarray]]:
    """{MoE layer: {(sequence, position): the rollout's routing row}} from its trace."""
    out: dict[int, dict[tuple[str, int], np.ndarray]] = {}
    with TraceReader(str(serve)) as r:
        for name in r.tensors:
            layer = moe_routing_layer(name)
            if layer is None:
                continue
            tr = np.asarray(r.token_rows(name))
            vals = np.asarray(r.read_at(name, "values", np.arange(len(tr))))
            seq, pos = np.asarray(r.tokens["seq"])[tr], np.asarray(r.tokens["position"])[tr]
            out[layer] = {(str(r.sequences[int(s)]), int(p)): v for s, p, v in zip(seq, pos, vals)}
    return out


def replay_hooks(model, tables, state: dict, mode: str):
    """A user's R3 on each MoE router: the rollout's expert ids for the tokens it served (the
    last token, never fed back, keeps its own); ``mode`` "ids": the weights recomputed from this
    router's own probabilities at those ids (renormalised as the router does), "ids+weights": the
    rollout's weights; "ids, renormalised": recomputed and renormalised over the top k whatever the
    router does (another normalisation than the rollout's where the router does not renormalise)."""
    handles = []
    for i, layer in enumerate(model.model.layers):
        gate = getattr(layer.mlp, "gate", None)
        if gate is None or i not in tables:
            continue

        def hook(mod, args, out, i=i):
            logits, w, ids = out
            k = ids.shape[-1]
            rows = [tables[i].get((state["seq"], p)) for p in range(ids.shape[0])]
            ids2, w2 = ids.clone(), w.clone()
            probs = torch.softmax(logits.float(), dim=-1)
            for p, row in enumerate(rows):
                if row is None:
                    continue
                ids2[p] = torch.as_tensor(row[:k], dtype=ids.dtype)
                if mode == "ids+weights":
                    w2[p] = torch.as_tensor(row[k:], dtype=w.dtype)
                else:
                    got = probs[p].gather(0, ids2[p])
                    if mode == "ids, renormalised" or getattr(mod, "norm_topk_prob", True):
                        got = got / got.sum()
                    w2[p] = got.to(w.dtype)
            return logits, w2, ids2
        handles.append(gate.register_forward_hook(hook))
    return handles


def trainer(out: Path, model, serve: Path, mode: str | None) -> Path:
    seqs = dict(load_serve_sequences(str(serve)))
    state: dict = {}
    handles = replay_hooks(model, rollout_tables(serve), state, mode) if mode else []
    with Recorder(str(out), side="train", model=model_info(model)) as rec:
        tr = TrainerRecorder(model, rec, temperature=T)
        for i, p in enumerate(_prompts()):
            key = f"p{i}"
            state["seq"] = key
            ids = torch.tensor(seqs[key])
            with tr.sequence(key, ids, first_generated=len(p)), torch.no_grad():
                model(input_ids=ids[None])
        tr.detach()
    for h in handles:
        h.remove()
    return out


@pytest.fixture(scope="module", params=["mixtral", "qwen2_moe"])
def moe(request, tmp_path_factory):
    """(rollout trace, {replay mode: trainer trace}) of one MoE model."""
    work = tmp_path_factory.mktemp(f"replay_{request.param}")
    master = _model(request.param)
    md = work / "model"
    master.save_pretrained(md, safe_serialization=True)
    import copy

    engine = copy.deepcopy(master).to(torch.bfloat16)
    r = rs.rollout(work / "rollout.h5", engine, prompts=_prompts(), new_tokens=NEW, model_path=md, temperature=T)
    tr = {mode or "none": trainer(work / f"train_{mode}.h5", copy.deepcopy(master), r, mode)
          for mode in (None, "ids", "ids+weights", "ids, renormalised")}
    return r, tr


@pytest.mark.parametrize("order", ["TR", "RT"])
def test_replayed_ids_with_recomputed_weights_are_named(moe, order):
    r, tr = moe
    t = tr["ids"]
    got = triage(*((str(t), str(r)) if order == "TR" else (str(r), str(t))))
    assert got.exit_code == 1, got.text()
    assert got.cause == "routing", got.text()
    assert got.headline.startswith("routing: the trainer replays the rollout's expert ids but recomputes their "
                                   "weights (layer "), got.text()
    assert got.headline.endswith("): replay the routing weights too"), got.headline
    rep = got.routing["replay"]
    assert rep["ids_replayed"] and rep["weights_recomputed"]
    assert sum(x["overridden"] for x in rep["layers"]) >= 0
    print(got.headline)


def test_recomputed_with_another_normalisation_is_named(moe):
    """Qwen2-MoE without norm_topk_prob: the replay's weights renormalised over the top k are no
    cast of the rollout's (and not the router's own bit for bit); Mixtral renormalises anyway:
    its own weights, bit for bit. Named either way."""
    r, tr = moe
    got = triage(str(tr["ids, renormalised"]), str(r))
    assert got.exit_code == 1 and got.cause == "routing", got.text()
    assert got.headline.startswith("routing: the trainer replays the rollout's expert ids but recomputes their "
                                   "weights (layer "), got.text()
    qwen = "qwen" in str(r)
    assert ("(relative) off the rollout's, more than a cast of them leaves" in got.headline) == qwen, got.headline
    print(got.headline)


@pytest.mark.parametrize("order", ["TR", "RT"])
def test_replayed_ids_and_weights_agree(moe, order):
    r, tr = moe
    t = tr["ids+weights"]
    got = triage(*((str(t), str(r)) if order == "TR" else (str(r), str(t))))
    assert got.exit_code == 0, got.text()
    assert got.headline.startswith("no cause: "), got.text()
    assert any(line.startswith("  routing replayed: the trainer's experts were handed the rollout's expert ids and "
                               "weights on all ") for line in got.lines), got.text()
    rep = got.routing["replay"]
    assert rep["ids_replayed"] and not rep["weights_recomputed"]
    assert all(x["max_w"] == 0.0 for x in rep["layers"]), rep


def test_no_replay_is_the_routing_comparison(moe):
    """Without a replay the trainer's router is its own: no router-own table is written and the
    replay sentence never appears (flips, if any, are the routing note or cause as before)."""
    r, tr = moe
    t = tr["none"]
    with TraceReader(str(t)) as x:
        assert not [n for n in x.tensors if n.startswith("moe_router_own_layer")]
        assert [n for n in x.tensors if moe_routing_layer(n) is not None]
    got = triage(str(t), str(r))
    assert "replays the rollout's expert ids" not in got.text()
    assert (got.routing or {}).get("replay") is None
    print(got.cause, got.headline)
