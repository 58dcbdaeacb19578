"""A LoRA (PEFT) trainer against an engine serving its adapter. The served side is HF transformers
with the adapter merged into the trained tiny Llama (PEFT's own ``merge_and_unload``, or by hand
where the bug is in the merge), in bf16, generating with prefill + KV-cache decode passes
(tests/rl_support.py); the trainer is the float32 PEFT model under :class:`TrainerRecorder`. The
adapter is trained here (Adam steps on the prompts), so its delta is a trained one."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

import rl_support as rs  # noqa: E402
import trained  # noqa: E402

from tensordiff.recorders.peft_names import canonical, canonical_module  # noqa: E402
from tensordiff.rl.triage import triage  # noqa: E402

pytestmark = pytest.mark.torch

NEW, PROMPTS, T = 12, 3, 0.7
R, ALPHA = 4, 16


def _prompts():
    return trained.prompts()[:PROMPTS]


def peft_model(rslora: bool = False):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    cfg = LoraConfig(r=R, lora_alpha=ALPHA, lora_dropout=0.0, use_rslora=rslora,
                     target_modules=["q_proj", "v_proj", "o_proj", "down_proj"])
    return get_peft_model(trained.load_target(torch.float32), cfg)


def train(p, steps: int, lr: float = 1e-2):
    """``steps`` Adam steps of next-token loss on the prompts (the adapter's parameters only)."""
    p.train()
    opt = torch.optim.Adam([x for x in p.parameters() if x.requires_grad], lr=lr)
    ids = [torch.tensor(x) for x in _prompts()]
    for _ in range(steps):
        opt.zero_grad()
        loss = sum(p(input_ids=x[None], labels=x[None]).loss for x in ids) / len(ids)
        loss.backward()
        opt.step()
    return p.eval()


def merged(p, scaling: float | None = None):
    """The served model: the adapter merged into a copy of the base, bf16. ``scaling``: merged by
    hand with this scaling instead of PEFT's (None: PEFT's ``merge_and_unload``)."""
    q = copy.deepcopy(p)
    if scaling is None:
        return q.merge_and_unload().to(torch.bfloat16).eval()
    with torch.no_grad():
        for _, mod in q.named_modules():
            if hasattr(mod, "base_layer") and hasattr(mod, "lora_A") and "default" in mod.lora_A:
                a, b = mod.lora_A["default"].weight, mod.lora_B["default"].weight
                mod.base_layer.weight += scaling * (b @ a)
    return q.unload().to(torch.bfloat16).eval()


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("lora")


@pytest.fixture(scope="module")
def adapters():
    """(step 0's PEFT model, step 1's: one more Adam step, the adapter a sync sends)."""
    p0 = train(peft_model(), 2)
    p1 = train(copy.deepcopy(p0), 1)
    return p0, p1


def _pair(work, name, trainer_model, engine, *, steps=None):
    r = rs.rollout(work / f"{name}.rollout.h5", engine, prompts=_prompts(), new_tokens=NEW, temperature=T,
                   weight_steps=steps)
    t = rs.trainer(work / f"{name}.train.h5", trainer_model, r, _prompts(), temperature=T)
    return str(t), str(r)


def _both(t, r):
    return triage(t, r), triage(r, t)


def test_canonical_names_through_the_adapter_wrappers():
    assert canonical("base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight") == \
        "model.layers.0.self_attn.q_proj.weight"
    assert canonical("base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight") is None
    assert canonical("model.layers.0.mlp.down_proj.weight") == "model.layers.0.mlp.down_proj.weight"
    assert canonical_module("base_model.model.model.layers.3.self_attn.q_proj") == "model.layers.3.self_attn.q_proj"
    assert canonical_module("base_model.model.model.layers.3.self_attn.q_proj.base_layer") is None


def test_peft_trainer_fingerprints_are_the_served_merged_weights(adapters):
    """The PEFT trainer's fingerprints are keyed as the served model's, and each adapted weight's
    bf16 cast hash is that of PEFT's own merge served in bf16."""
    from tensordiff.recorders.hooks import weight_fingerprints

    p0, _ = adapters
    doc = weight_fingerprints(p0)
    eng = weight_fingerprints(merged(p0))
    te, ee = {e["key"]: e for e in doc["parameters"]}, {e["key"]: e for e in eng["parameters"]}
    assert set(te) == set(ee)
    adapted = [k for k, e in te.items() if "lora" in e]
    assert len(adapted) == 4 * trained.load_target(torch.float32).config.num_hidden_layers
    assert all(te[k]["cast_sha256"]["bfloat16"] == ee[k]["sha256"] for k in te), \
        [k for k in te if te[k]["cast_sha256"]["bfloat16"] != ee[k]["sha256"]]


def test_correct_merge_agrees(work, adapters):
    p0, _ = adapters
    for got in _both(*_pair(work, "ok", p0, merged(p0))):
        assert got.exit_code == 0, got.text()
        assert got.headline.startswith("no cause: weights, tokens and states agree"), got.text()


def test_engine_scales_by_alpha_instead_of_alpha_over_r(work, adapters):
    p0, _ = adapters
    for got in _both(*_pair(work, "alpha", p0, merged(p0, scaling=ALPHA))):
        assert got.exit_code == 1 and got.cause == "weights", got.text()
        assert got.headline.startswith(f"weights: the engine scales the LoRA adapter by alpha ({ALPHA}) where the "
                                       f"trainer scales it by alpha/r ({ALPHA / R:g}; r {R}, alpha {ALPHA}): its "
                                       "merged delta is 4"), got.headline
        print(got.headline)


def test_trainer_rslora_engine_alpha_over_r(work):
    """The reverse direction: the trainer scales by alpha/sqrt(r) (rsLoRA), the engine by alpha/r."""
    p = train(peft_model(rslora=True), 2)
    for got in _both(*_pair(work, "rslora", p, merged(p, scaling=ALPHA / R))):
        assert got.exit_code == 1 and got.cause == "weights", got.text()
        assert got.headline.startswith(f"weights: the engine scales the LoRA adapter by alpha/r ({ALPHA / R:g}) "
                                       f"where the trainer scales it by alpha/sqrt(r) ({ALPHA / R ** 0.5:g}; r {R}, "
                                       f"alpha {ALPHA}): its merged delta is 0.5"), got.headline
        print(got.headline)


def test_stale_adapter_after_a_sync(work, adapters):
    """The sync of step 1's adapter does not reach the engine: it keeps serving step 0's merge."""
    p0, p1 = adapters
    e0 = merged(p0)
    steps = [(e0, "start"), (copy.deepcopy(e0), "update_weights_from_tensor")]
    for got in _both(*_pair(work, "stale", p1, e0, steps=steps)):
        assert got.exit_code == 1 and got.cause == "weights", got.text()
        assert got.headline.startswith(
            "weights: the engine serves the previous step's LoRA adapter: after weight update step 1 "
            "(update_weights_from_tensor) its 32 adapted weights (of 32: layer0.q.weight, layer0.v.weight, "
            "layer0.attn_out.weight, ...) still hold step 0's merged values"), got.headline
        print(got.headline)


def test_synced_adapter_agrees(work, adapters):
    p0, p1 = adapters
    steps = [(merged(p0), "start"), (merged(p1), "update_weights_from_tensor")]
    for got in _both(*_pair(work, "synced", p1, merged(p1), steps=steps)):
        assert got.exit_code == 0, got.text()
        assert got.headline.startswith("no cause: weights, tokens and states agree"), got.text()


def test_engine_without_the_adapter(work, adapters):
    """The engine serves the base model (the adapter never loaded): its adapted weights are the base
    ones and its states leave the trainer's."""
    p0, _ = adapters
    base = copy.deepcopy(p0).unload().to(torch.bfloat16).eval()
    for got in _both(*_pair(work, "noadapter", p0, base)):
        assert got.exit_code == 1 and got.cause == "weights", got.text()
        assert got.headline.startswith("weights: the engine serves the base weights without the LoRA adapter: its "
                                       "32 adapted weights (of 32) are the base weights"), got.headline


def test_unmerged_adapter_recording_base_weights_is_no_cause(work, adapters):
    """An engine applying the adapter beside its linears (as vLLM's LoRA does) records its base
    weights only: its outputs agree with the trainer's, so the base weights are a note, not a cause."""
    p0, _ = adapters
    serving = copy.deepcopy(p0).to(torch.bfloat16).eval()
    base = copy.deepcopy(p0).unload().to(torch.bfloat16).eval()
    for got in _both(*_pair(work, "unmerged", p0, serving, steps=[(base, "start")])):
        assert got.exit_code == 0, got.text()
        assert any(line.startswith("  LoRA: the engine's recorded weights are the base weights") for line in got.lines), \
            got.text()
