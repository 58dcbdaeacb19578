"""The RL records of a trace (tensordiff.trace.rl: sampling attribute, weight steps) and the pure
log-prob metrics (tensordiff.rl.logprobs): real HDF5, no torch."""

from __future__ import annotations

import json
import math

import h5py
import numpy as np
import pytest

from tensordiff.rl import logprobs
from tensordiff.errors import TraceFileError
from tensordiff.trace import TraceReader, TraceWriter
from tensordiff.trace.rl import (
    read_sampling,
    read_weight_steps,
    sampling_for,
    sampling_params,
    weights_at,
    write_sampling,
    write_weight_step,
)
from tensordiff.weights import FINGERPRINT_FORMAT


def _doc(sha: str = "00") -> dict:
    return {"format": FINGERPRINT_FORMAT, "num_layers": 1, "source": "t",
            "parameters": [{"key": "layer0.mlp_out.weight", "name": "model.layers.0.mlp.down_proj.weight",
                            "dtype": "float32", "shape": [2, 2], "sha256": sha, "norm": 1.0, "samples": []}]}


def _trace(path, sampling=None, steps=()):
    w = TraceWriter(str(path), side="serve", producer="test", model={"num_layers": 1, "hidden_size": 4})
    w.add_tokens("s", np.arange(4), np.arange(4), regime="decode")
    if sampling is not None:
        write_sampling(w, sampling)
    for k, doc, fwd, event in steps:
        write_weight_step(w, k, doc, forward_step=fwd, event=event)
    w.close()
    return str(path)


def test_sampling_round_trip_and_per_sequence(tmp_path):
    p = sampling_params(temperature=0.7, top_p=0.9, logprobs_mode="raw", engine="vllm",
                        per_sequence={"r1": {"temperature": 1.0}})
    with TraceReader(_trace(tmp_path / "a.h5", p)) as r:
        got = read_sampling(r)
    assert got == p
    assert sampling_for(got, "r0")["temperature"] == 0.7 and sampling_for(got, "r1")["temperature"] == 1.0
    with TraceReader(_trace(tmp_path / "none.h5")) as r:
        assert read_sampling(r) is None and read_weight_steps(r) == []
    with pytest.raises(ValueError):
        sampling_params(temperature=-1.0)
    with pytest.raises(ValueError):
        sampling_params(temperature=1.0, logprobs_mode="logits")


def test_weight_steps_round_trip_and_the_step_in_force(tmp_path):
    path = _trace(tmp_path / "w.h5", steps=[(0, _doc("aa"), 0, "start"), (1, _doc("bb"), 5, "update_weights_from_tensor")])
    with TraceReader(path) as r:
        steps = read_weight_steps(r)
    assert [(s.step, s.forward_step, s.event, s.rank) for s in steps] == [(0, 0, "start", None),
                                                                          (1, 5, "update_weights_from_tensor", None)]
    assert steps[1].doc["parameters"][0]["sha256"] == "bb"
    assert weights_at(steps, 4).step == 0 and weights_at(steps, 5).step == 1 and weights_at(steps, 99).step == 1
    ck = steps[0].checkpoint()
    assert list(ck.params) == ["layer0.mlp_out.weight"]
    with pytest.raises(ValueError):
        write_weight_step(h5py.File(tmp_path / "x.h5", "w"), 0, {"format": "other"}, forward_step=0, event="e")


@pytest.mark.parametrize("damage, message", [
    (lambda f: f["weights"].move("step_1", "step_x"), "named step_<k>"),
    (lambda f: f["weights/step_1"].attrs.__setitem__("step", 2), "its step attribute says 2"),
    (lambda f: (f["weights/step_1"].__delitem__("fingerprints"),
                f["weights/step_1"].create_dataset("fingerprints", data=np.frombuffer(b"{not json", np.uint8))),
     "is not valid JSON"),
    (lambda f: (f["weights/step_1"].__delitem__("fingerprints"),
                f["weights/step_1"].create_dataset("fingerprints", data=np.frombuffer(json.dumps(
                    {"format": FINGERPRINT_FORMAT, "parameters": [{"key": "k"}]}).encode(), np.uint8))),
     "lacks key/name"),
    (lambda f: f.attrs.__setitem__("sampling", json.dumps({"temperature": "hot"})), "temperature is 'hot'"),
    (lambda f: f.attrs.__setitem__("sampling", json.dumps({"logprobs_mode": "logits"})), "logprobs_mode"),
])
def test_damaged_records_are_refused_in_one_line(tmp_path, damage, message):
    path = _trace(tmp_path / "d.h5", sampling_params(temperature=1.0), steps=[(1, _doc(), 0, "start")])
    with h5py.File(path, "r+") as f:
        damage(f)
    with TraceReader(path) as r, pytest.raises(TraceFileError, match=message):
        read_sampling(r)
        read_weight_steps(r)


def test_metrics_under_the_frameworks_names():
    train = np.log(np.array([0.5, 0.25, 0.9]))
    roll = np.log(np.array([0.5, 0.5, 0.9]))
    m = logprobs.metrics(train, roll)
    d = np.abs(train - roll)
    assert m["mean_abs_logprob_diff"] == pytest.approx(d.mean())
    assert m["max_abs_logprob_diff"] == pytest.approx(math.log(2))
    assert m["rollout_probs_diff_mean"] == pytest.approx(0.25 / 3)
    # NeMo-RL: mean of exp(|logp_train - logp_rollout|) (docs/adding-new-models.md)
    assert m["token_mult_prob_error"] == pytest.approx((1 + 2 + 1) / 3)
    # k3 = r - 1 - log r, r = p_train / p_rollout: 0.5 - 1 + log 2 on the middle token
    assert m["kl_k3"] == pytest.approx((0.5 - 1 + math.log(2)) / 3)
    assert logprobs.metrics(np.zeros(0), np.zeros(0))["token_mult_prob_error"] is None


def test_expected_noise_is_never_under_one_rounding():
    assert logprobs.expected_noise(0.0, "float32", "float32") > 0
    assert logprobs.expected_noise(0.01, "bfloat16", "float32") == pytest.approx(logprobs.LP_PER_REL * 0.01)
