"""The RL records of the SGLang plugin, in real SGLang 0.5.23 on the CPU with the trained tiny Llama.

Engine runs (each its own process, declared in tests/recordings.py and recorded once per cache key):

* ``rollout``: `tensordiff record serve` in bfloat16, sampled at temperature 1 (the RL default), the
  catalog on: the log-prob the engine returned for every sampled token, the sampling attribute,
  the weights it started with;
* ``replay``: `record serve --replay` of that rollout on the same engine: every rollout token
  computed again as a prefill;
* ``perturbed``: the same pair on an engine whose decode attention of decoder layer 3 is scaled by
  1.5 (a test-only SGLang plugin, ``tdperturb``, found through its own entry point): a
  decode-path bug that only rollout vs replay can localise without the trainer;
* ``updated``: an fp32 engine driven through ``sglang.Engine`` at temperature 0.7 with a weight
  update in between two generations (``update_weights_from_tensor`` in a ``begin_weight_update``
  session) that syncs layer 5 but not layer 3, as a trainer that changed both and lost one;
* ``raw``: an fp32 engine with ``SGLANG_RETURN_ORIGINAL_LOGPROB=1`` at temperature 0.7: the
  engine returns raw log-probs where a trainer divides by the temperature.

What each one must show is checked on the trace contents against HF transformers on the same
checkpoint, and with `tensordiff diff`.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

import recordings as recs
import sglang_support as sup

needs_sglang = pytest.mark.skipif(not sup.sglang_available(), reason="real SGLang (and torch) not installed")
pytestmark = [pytest.mark.sglang, pytest.mark.slow, needs_sglang]

MAX_NEW = 8
N_PROMPTS = 4
PERTURB_LAYER = 3          # decoder layer whose decode attention output the test plugin scales
PERTURB_SCALE = 1.5
STALE, SYNCED = 3, 5       # the trainer changed both layers' down_proj; the engine received layer 5 only


# ----------------------------------------------------------------------------------------------
# fixtures
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tm(recorded):
    return recorded(recs.RL_MODEL)


def _env(extra: dict | None = None, plugins: str = "tensordiff", path: list[str] = ()) -> dict:
    return sup.rl_engine_env(extra, plugins, path)


@pytest.fixture(scope="module")
def rollout(recorded):
    return recorded(recs.RL_ROLLOUT)


@pytest.fixture(scope="module")
def replay(recorded):
    return recorded(recs.RL_REPLAY)


@pytest.fixture(scope="module")
def perturbed(recorded):
    return recorded(recs.RL_PERTURBED)


def _down(layer: int) -> str:
    return f"model.layers.{layer}.mlp.down_proj.weight"


@pytest.fixture(scope="module")
def updated(recorded):
    return recorded(recs.RL_UPDATED)


@pytest.fixture(scope="module")
def raw(recorded):
    return recorded(recs.RL_RAW)


# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------


def _sampled(path: str) -> dict:
    """{(seq, position): (token id, log-prob)} of a trace's sampled_logprob rows, the token rows'
    regimes by (seq, position), and the reader's sampling attribute and weight steps."""
    from tensordiff import conventions as cv
    from tensordiff.trace.rl import read_sampling, read_weight_steps
    from tensordiff.vocab import REGIMES

    tr = sup.RecordedTrace(path)
    try:
        rows, seq, pos = tr.rows(cv.SAMPLED_LOGPROB)
        vals = tr.r.read_values(cv.SAMPLED_LOGPROB)
        got = {(s, int(p)): (int(v[0]), float(v[1])) for s, p, v in zip(seq, pos, vals)}
        regime = {(s, int(p)): REGIMES[int(g)] for s, p, g in zip(tr.seq, tr.pos, tr.regime)}
        tokens = {(s, int(p)): int(t) for s, p, t in zip(tr.seq, tr.pos, tr.tok)}
        return {"lp": got, "regime": regime, "tokens": tokens, "sampling": read_sampling(tr.r),
                "steps": read_weight_steps(tr.r), "attrs": dict(tr.r.f.attrs)}
    finally:
        tr.close()


@functools.lru_cache(maxsize=1)
def _hf(target):
    return sup.load_hf_model(target)


def _hf_logprobs(target, full: list[int], temperature: float) -> tuple[np.ndarray, np.ndarray]:
    """(raw, divided by the temperature) log-probs of token t+1 at row t of ``full``, HF fp32."""
    import torch

    m = _hf(str(target))
    with torch.no_grad():
        logits = m(torch.tensor([full])).logits[0].double()
    nxt = torch.tensor(full[1:])
    raw = torch.log_softmax(logits[:-1], -1).gather(1, nxt[:, None])[:, 0].numpy()
    hot = torch.log_softmax(logits[:-1] / temperature, -1).gather(1, nxt[:, None])[:, 0].numpy()
    return raw, hot


def _diff(a: str, b: str) -> tuple[int, dict | None, str]:
    return sup.diff_json(a, b)


def _train(model, source: str, out: Path, *extra: str) -> Path:
    """`tensordiff record train --from-serve SOURCE` in float32 (the trainer)."""
    proc = subprocess.run([sys.executable, "-m", "tensordiff", "record", "train", "--model", str(model), "--from-serve",
                           source, "--no-draft-input", "--values", "all", "--dtype", "float32", "--device", "cpu",
                           "--no-progress", "--out", str(out), *extra],
                          check=False, capture_output=True, text=True, env=sup.tensordiff_env(), cwd=REPO, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return out


def _triage(*paths) -> tuple[int, str]:
    """`tensordiff triage TRAIN ROLLOUT [PREFILL]`: (exit code, output)."""
    proc = subprocess.run([sys.executable, "-m", "tensordiff", "triage", *map(str, paths)], check=False,
                          capture_output=True, text=True, env=sup.tensordiff_env(), cwd=REPO, timeout=900)
    return proc.returncode, proc.stdout + proc.stderr


# ----------------------------------------------------------------------------------------------
# the rollout's records
# ----------------------------------------------------------------------------------------------


def test_sampled_logprob_is_what_the_engine_returned(tm, rollout):
    """One row per generated token at the row that sampled it (the last prompt token's for the
    first), holding the token and exactly the log-prob the engine handed the request; the token
    table says which rows ran as prefill and which as decode."""
    got = _sampled(rollout["trace"])
    n = 0
    for key, o in rollout["by_id"].items():
        plen = len(o["input_ids"])
        assert len(o["output_ids"]) == MAX_NEW and len(o["output_logprobs"]) == MAX_NEW
        for j, (tok, lp) in enumerate(zip(o["output_ids"], o["output_logprobs"])):
            assert got["lp"][(key, plen + j - 1)] == (tok, lp), (key, j)
            n += 1
        assert got["regime"][(key, plen - 1)] == "prefill"
        assert {got["regime"][(key, p)] for p in range(plen, plen + MAX_NEW - 1)} == {"decode"}
    assert len(got["lp"]) == n
    s = got["sampling"]
    assert (s["temperature"], s["top_p"], s["top_k"], s["logprobs_mode"], s["engine"]) == (1.0, 1.0, -1, "processed",
                                                                                          "sglang")


def test_weights_at_start_are_the_checkpoint_served_in_bf16(tm, rollout):
    """Step 0 fingerprints every parameter of the engine (the fused qkv/gate_up split back into the
    checkpoint's keys), with the hashes of the checkpoint cast to bfloat16."""
    import torch
    from safetensors.torch import load_file

    from tensordiff import weights
    from tensordiff.recorders.weights_fp import _stored

    steps = _sampled(rollout["trace"])["steps"]
    assert [(s.step, s.event) for s in steps] == [(0, "start")]
    cfg = json.loads((Path(tm["target"]) / "config.json").read_text())
    params = []
    for name, t in load_file(str(Path(tm["target"]) / "model.safetensors")).items():
        dtype, arr = _stored(t.to(torch.bfloat16))
        params.extend(weights.params_of(name, dtype, arr, cfg))
    ck = weights.checkpoint_from_doc(weights.fingerprints_doc(params, cfg["num_hidden_layers"], "ckpt"), "ckpt")
    res = weights.compare(ck, steps[0].checkpoint())
    assert (res.diffs, res.only_a, res.only_b) == ([], [], []), res.lines()
    assert res.compared == len(params) and res.compared > 8 * 9


def test_correct_pair_engine_bf16_vs_trainer_fp32_agrees_both_orders(tm, rollout, tmp_path):
    """The bf16 engine and `record train --from-serve` in fp32 on the very tokens served: no
    finding and no cause, either order."""
    train = _train(tm["target"], rollout["outputs"], tmp_path / "train.h5")
    for a, b in ((train, rollout["trace"]), (rollout["trace"], train)):
        rc, doc, err = _diff(str(a), str(b))
        assert rc == 0, (a, b, err[-2000:], json.dumps(doc)[:3000] if doc else None)
    for a, b in ((train, rollout["trace"]), (rollout["trace"], train)):   # each trace says which side it is
        rc, out = _triage(a, b)
        assert rc == 0 and out.startswith("no cause"), out[-3000:]


# ----------------------------------------------------------------------------------------------
# replay: decode vs prefill inside the engine
# ----------------------------------------------------------------------------------------------


def test_replay_recomputes_every_rollout_token_as_prefill(rollout, replay):
    ro, rp = _sampled(rollout["trace"]), _sampled(replay["trace"])
    attr = json.loads(rp["attrs"]["replay"])
    assert attr["rollout"] == os.path.abspath(rollout["trace"]) and attr["regime"] == "prefill"
    assert (attr["max_tokens"], attr["prefix_cache"], attr["sequences"]) == (1, False, N_PROMPTS)
    assert "replay" not in ro["attrs"]
    for key, full in rollout["full"].items():   # every rollout token, each computed as a prefill
        for p, t in enumerate(full[:-1]):
            assert rp["tokens"][(key, p)] == t and rp["regime"][(key, p)] == "prefill", (key, p)
    # the prefill's log-prob of every sampled token, at the rollout's rows
    assert set(rp["lp"]) == set(ro["lp"])
    assert all(rp["lp"][k][0] == ro["lp"][k][0] for k in ro["lp"])
    assert rp["sampling"]["logprobs_mode"] == "raw" and rp["sampling"]["temperature"] == 1.0


def _logprob_gap(pair: dict) -> np.ndarray:
    ro, rp = _sampled(pair["rollout"]["trace"]), _sampled(pair["replay"]["trace"])
    keys = sorted(ro["lp"])
    return np.array([abs(ro["lp"][k][1] - rp["lp"][k][1]) for k in keys])


def test_replay_of_a_correct_engine_agrees(rollout, replay):
    for a, b in ((rollout, replay), (replay, rollout)):
        rc, doc, err = _diff(a["trace"], b["trace"])
        assert rc == 0, (err[-2000:], json.dumps(doc)[:3000] if doc else None)


def test_a_decode_only_bug_is_found_by_rollout_vs_replay(tm, rollout, replay, perturbed, tmp_path):
    """Layer 3's decode attention scaled by 1.5: the rollout (decode rows) leaves its own replay (prefill)
    first at the output of decoder layer 3, and the log-probs of the sampled tokens move far
    more than decode vs prefill of the correct engine, in both argument orders. (The decode rows of
    layer4 move under the bf16 default's allowance at depth 4; the noise model allows them the
    measured trend plus fresh rounding, tests/test_noise_model.py.)"""
    for a, b in (("rollout", "replay"), ("replay", "rollout")):
        rc, doc, err = _diff(perturbed[a]["trace"], perturbed[b]["trace"])
        assert rc == 1, (a, b, err[-2000:], json.dumps(doc)[:3000] if doc else None)
        first = json.dumps(doc["result"]["first_divergence"]) if "result" in doc else json.dumps(doc)
        assert f"layer{PERTURB_LAYER + 1}" in first, (a, b, first[:3000])
    bad = _logprob_gap(perturbed)
    good = _logprob_gap({"rollout": rollout, "replay": replay})
    assert bad.mean() > 5 * good.mean(), (bad.mean(), good.mean())
    # with the trainer (correct) and the re-run: the first state out of the noise is layer4, on decode
    # rows only, and the three-way table puts it in the engine (prefill vs decode differ, the trainer
    # agrees with the prefill)
    train = _train(tm["target"], perturbed["rollout"]["outputs"], tmp_path / "train.h5")
    rc, out = _triage(train, perturbed["rollout"]["trace"], perturbed["replay"]["trace"])
    first, states = out.splitlines()[:2]
    assert rc == 1 and first.startswith("the engine's decode path: "), out[-3000:]
    assert f"layer{PERTURB_LAYER + 1}" in states and "prefill: 0 of" in states, out[-3000:]
    three = {ln.split("token_mult_prob_error")[0].strip(): ln for ln in out.splitlines() if "token_mult_prob_error " in ln}
    assert " differ" in three["prefill vs decode"] and " agree" in three["trainer vs prefill"], out[-3000:]


@pytest.fixture(scope="module")
def perturbed_hot(tm, tmp_path_factory):
    """The decode-path bug at temperature 0.7: the rollout's log-probs processed, its replay's raw."""
    tmp = tmp_path_factory.mktemp("rl-perturbed-hot")
    return sup.rl_perturbed_pair(tm["target"], tm["prompts"], tmp, layer=PERTURB_LAYER, scale=PERTURB_SCALE,
                                 max_new=MAX_NEW, temperature=0.7)


def test_a_decode_only_bug_at_temperature_is_named_against_a_raw_replay(tm, perturbed_hot, tmp_path):
    """At T 0.7 the rollout returns processed log-probs and its prefill re-run raw ones: the
    three-way table compares them raw (from the rollout's top-k), so the decode path is named in
    both orders; the trainer that divides by nothing is named as raw against processed."""
    ro, rp = perturbed_hot["rollout"], perturbed_hot["replay"]
    assert _sampled(rp["trace"])["sampling"]["logprobs_mode"] == "raw"
    hot = _train(tm["target"], ro["outputs"], tmp_path / "train07.h5", "--temperature", "0.7")
    for a, b in ((hot, ro["trace"]), (ro["trace"], hot)):
        rc, out = _triage(a, b, rp["trace"])
        assert rc == 1 and out.startswith("the engine's decode path: "), out[-3000:]
        three = {ln.split("token_mult_prob_error")[0].strip(): ln for ln in out.splitlines()
                 if "token_mult_prob_error " in ln}
        assert "compared raw" in three["prefill vs decode"] and " agree" in three["trainer vs prefill"], out[-3000:]
    cold = _train(tm["target"], ro["outputs"], tmp_path / "train1.h5")
    for a, b in ((cold, ro["trace"]), (ro["trace"], cold)):
        rc, out = _triage(a, b)
        assert rc == 1 and out.startswith("sampling: the rollout's log-probs are processed, at temperature 0.7"), out


# ----------------------------------------------------------------------------------------------
# weight updates
# ----------------------------------------------------------------------------------------------


def _variant(tm, root: Path, scale: dict[int, float]) -> Path:
    """A copy of the trained target with ``down_proj`` of the given layers scaled: the trainer's
    weights after its update."""
    import shutil

    from safetensors.torch import load_file, save_file

    out = root / "trainer-model"
    if not out.exists():
        shutil.copytree(tm["target"], out)
        sd = load_file(str(out / "model.safetensors"))
        for layer, f in scale.items():
            sd[_down(layer)] = sd[_down(layer)] * f
        save_file(sd, str(out / "model.safetensors"))
    return out


@pytest.fixture(scope="module")
def updated_triage(tm, updated, tmp_path_factory):
    """`tensordiff triage` of the trainer that changed layers 3 and 5 (p0, p1 from the outputs
    JSONL: the requests served after the sync) against the updated engine's trace."""
    tmp = tmp_path_factory.mktemp("rl-updated-triage")
    model = _variant(tm, tmp, {STALE: 1.25, SYNCED: 1.25})
    train = _train(model, updated["jsonl"], tmp / "train.h5", "--temperature", "0.7")
    got = _triage(train, updated["trace"])
    back = _triage(updated["trace"], train)      # the rollout named first: the same verdict
    assert back[0] == got[0] and back[1].splitlines()[0] == got[1].splitlines()[0], back[1][-3000:]
    return got


def test_weight_update_is_a_new_step_and_the_stale_layer_is_named(tm, updated, updated_triage):
    """Step 1 after the session that synced layer 5: it differs from step 0 at layer 5's
    down_proj only, the passes before it (p3) are at earlier forward steps than it and the passes
    after it (p0, p1) at later ones; against the trainer that changed layers 3 and 5 the triage's
    first sentence is about weights and names the stale layer 3, not the synced layer 5."""
    from tensordiff import weights

    got = _sampled(updated["trace"])
    steps = got["steps"]
    assert [(s.step, s.event) for s in steps] == [(0, "start"), (1, "update_weights_from_tensor")]
    res = weights.compare(steps[0].checkpoint(), steps[1].checkpoint())
    assert [d.name_a for d in res.diffs] == [_down(SYNCED)], res.lines()
    tr = sup.RecordedTrace(updated["trace"])
    try:
        step = {s: tr.step[tr.seq == s] for s in ("p3", "p0", "p1")}
    finally:
        tr.close()
    assert steps[0].forward_step <= step["p3"].min() and step["p3"].max() < steps[1].forward_step
    assert steps[1].forward_step <= min(step["p0"].min(), step["p1"].min())
    rc, out = updated_triage
    first = out.splitlines()[0]
    assert rc == 1 and first.startswith("weights:"), out[-3000:]
    assert f"model.layers.{STALE}.mlp.down_proj.weight" in first and f"layers.{SYNCED}." not in first, first


def test_the_stale_layer_is_named_stale_after_the_update(updated_triage):
    rc, out = updated_triage
    first = out.splitlines()[0]
    assert "stale" in first and "step 1" in first, first


# ----------------------------------------------------------------------------------------------
# temperature: processed vs raw log-probs
# ----------------------------------------------------------------------------------------------


def _against_hf(target, run: dict, temperature: float) -> tuple[float, float]:
    """Mean |engine - HF raw| and |engine - HF / T| over the generated tokens of a driven run (HF
    fp32 with the weights the engine served, ``target``)."""
    got = _sampled(run["trace"])
    d_raw, d_hot = [], []
    for key, o in run["outputs"].items():
        full = o["input_ids"] + o["output_ids"]
        raw, hot = _hf_logprobs(target, full, temperature)
        plen = len(o["input_ids"])
        for j, tok in enumerate(o["output_ids"]):
            t, lp = got["lp"][(key, plen + j - 1)]
            assert t == tok and lp == o["output_logprobs"][j]
            d_raw.append(abs(lp - raw[plen + j - 1]))
            d_hot.append(abs(lp - hot[plen + j - 1]))
    return float(np.mean(d_raw)), float(np.mean(d_hot))


def test_processed_logprobs_are_divided_by_the_temperature(tm, updated, tmp_path):
    """SGLang's default: log_softmax(logits / T) of the weights it served (layer 5 updated)."""
    got = _sampled(updated["trace"])
    assert got["sampling"]["logprobs_mode"] == "processed" and got["sampling"]["temperature"] == pytest.approx(0.7)
    served = _variant(tm, tmp_path, {SYNCED: 1.25})
    d_raw, d_hot = _against_hf(served, updated, 0.7)
    assert d_hot < 1e-3 < d_raw, (d_raw, d_hot)


def test_raw_logprobs_are_recorded_as_raw_and_triaged_as_the_temperature(tm, raw, tmp_path):
    """SGLANG_RETURN_ORIGINAL_LOGPROB: the engine returns log_softmax(logits) at temperature 0.7;
    the sampling attribute says raw, the values are the raw ones, and against a trainer that
    divides by the temperature the triage names raw against processed log-probs."""
    got = _sampled(raw["trace"])
    assert got["sampling"]["logprobs_mode"] == "raw" and got["sampling"]["temperature"] == pytest.approx(0.7)
    d_raw, d_hot = _against_hf(tm["target"], raw, 0.7)
    assert d_raw < 1e-3 < d_hot, (d_raw, d_hot)
    train = _train(tm["target"], raw["jsonl"], tmp_path / "train.h5", "--temperature", "0.7")
    rc, out = _triage(train, raw["trace"])
    first = out.splitlines()[0]
    assert rc == 1 and first.startswith("log-probs:") and "raw" in first, out[-3000:]
