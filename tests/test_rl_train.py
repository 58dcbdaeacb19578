"""`record train --from-serve` writes what the RL triage compares: the trainer's log-prob of each
sampled token at the serve run's temperature, the weight fingerprints of the model it ran (with the
hashes of their bf16/fp16 casts) and the sampling attribute (the trained model; HF as the engine)."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import rl_support as rs
import trained

from tensordiff import conventions as cv
from tensordiff.cli import main
from tensordiff.trace import TraceReader
from tensordiff.trace.rl import read_sampling, read_weight_steps

pytestmark = pytest.mark.torch

NEW = 4


@pytest.fixture(scope="module")
def serve(tmp_path_factory):
    d = tmp_path_factory.mktemp("rltrain")
    return rs.rollout(d / "serve.h5", trained.load_target(torch.bfloat16), prompts=trained.prompts()[:3],
                      new_tokens=NEW, temperature=0.7)


def _logprobs(path):
    with TraceReader(str(path)) as r:
        rows = r.token_rows(cv.SAMPLED_LOGPROB)
        vals = r.read_at(cv.SAMPLED_LOGPROB, "values", np.arange(len(rows)))
        seq = np.asarray(r.tokens["seq"])[rows]
        pos = np.asarray(r.tokens["position"])[rows]
        return {(str(r.sequences[int(s)]), int(p)): tuple(v) for s, p, v in zip(seq, pos, vals)}


def test_from_serve_records_logprobs_weights_and_sampling(serve, tmp_path):
    out = rs.train_from_serve(tmp_path / "t.h5", serve)
    got, want = _logprobs(out), _logprobs(serve)
    # one row per generated token, on the row whose logits sampled it; the same token on both sides
    assert sorted(got) == sorted(want) and len(got) == 3 * NEW
    assert all(got[k][0] == want[k][0] for k in got)
    # the fp32 trainer at the serve run's temperature against a bf16 engine: close, not equal
    d = np.array([got[k][1] - want[k][1] for k in got])
    assert 0 < np.abs(d).max() < 0.2
    with TraceReader(str(out)) as r:
        assert read_sampling(r)["temperature"] == 0.7
        (step,) = read_weight_steps(r)
        assert (step.step, step.event) == (0, "train")
    with TraceReader(str(serve)) as r:
        (engine,) = read_weight_steps(r)
    # the bf16 engine's copy is the exact cast of the trainer's float32 parameter
    te = {e["key"]: e for e in step.doc["parameters"]}
    for e in engine.doc["parameters"]:
        assert e["dtype"] == "bfloat16" and te[e["key"]]["cast_sha256"]["bfloat16"] == e["sha256"]


def test_temperature_override_and_the_outputs_jsonl(serve, tmp_path):
    seqs = {}
    with TraceReader(str(serve)) as r:
        rows = r.token_rows(cv.SAMPLED_LOGPROB)
        first = {}
        for s, p in zip(np.asarray(r.tokens["seq"])[rows], np.asarray(r.tokens["position"])[rows]):
            key = str(r.sequences[int(s)])
            first[key] = min(first.get(key, 1 << 30), int(p) + 1)
    from tensordiff.recorders.train_cli import load_serve_sequences

    seqs = dict(load_serve_sequences(str(serve)))
    jsonl = tmp_path / "outputs.jsonl"
    jsonl.write_text("".join(json.dumps({"id": k, "input_ids": v[:first[k]], "output_ids": v[first[k]:]}) + "\n"
                             for k, v in seqs.items()))
    a = rs.train_from_serve(tmp_path / "jsonl.h5", jsonl, None, "--temperature", "1.0")
    b = rs.train_from_serve(tmp_path / "t1.h5", serve, None, "--temperature", "1.0")
    la, lb = _logprobs(a), _logprobs(b)
    assert la == lb and len(la) == 3 * NEW
    with TraceReader(str(a)) as r:
        assert read_sampling(r)["temperature"] == 1.0
    hot = _logprobs(rs.train_from_serve(tmp_path / "t07.h5", serve))
    assert all(hot[k][1] != la[k][1] for k in la)


@pytest.mark.parametrize("extra, message", [
    (["--temperature", "-1"], "--temperature must be a finite number >= 0"),
])
def test_bad_temperature_is_one_line(serve, tmp_path, capsys, extra, message):
    argv = ["record", "train", "--model", str(trained.target_dir()), "--from-serve", str(serve), "--no-progress",
            "--out", str(tmp_path / "x.h5"), *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]
    argv = ["record", "train", "--model", str(trained.target_dir()), "--prompts", str(trained.prompts_path()),
            "--temperature", "0.7", "--out", str(tmp_path / "y.h5")]
    assert main(argv) == 2
    assert "--temperature is for --from-serve" in capsys.readouterr().err


def test_weight_fingerprints_taken_beside_the_passes_match_the_model_and_their_failure_ends_the_run(
        serve, tmp_path, monkeypatch, capsys):
    """The fingerprints are taken in a thread while the passes run: the recorded document is the
    one the model gives directly, and a failure in that thread ends the recording with its error
    (the trace closed as failed, never a trace without its weights)."""
    from tensordiff.recorders import hooks

    out = rs.train_from_serve(tmp_path / "t.h5", serve)
    direct = hooks.weight_fingerprints(trained.load_target())
    with TraceReader(str(out)) as r:
        (step,) = read_weight_steps(r)
    assert [(e["key"], e["sha256"], e.get("cast_sha256")) for e in step.doc["parameters"]] == \
        [(e["key"], e["sha256"], e.get("cast_sha256")) for e in direct["parameters"]]

    from tensordiff.errors import RecordingError

    def broken(model, source=""):
        raise RecordingError("cannot fingerprint the weights (test)")

    monkeypatch.setattr(hooks, "weight_fingerprints", broken)
    bad = tmp_path / "bad.h5"
    argv = ["record", "train", "--model", str(trained.target_dir()), "--from-serve", str(serve),
            "--no-draft-input", "--no-progress", "--out", str(bad)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot fingerprint the weights (test)" in err[0], err
    with TraceReader(str(bad)) as r:
        assert not r.complete and not read_weight_steps(r)


def test_trainer_recorder_under_bf16_autocast(serve, tmp_path):
    """The trainer's forward inside ``torch.autocast(dtype=torch.bfloat16)`` (as verl, OpenRLHF and
    NeMo-RL run it) on CPU: recording neither breaks nor changes it (the logits are bit-equal to
    the same forward unrecorded), and the trace holds finite sketches and the log-probs of the
    sampled tokens from the bf16 logits."""
    from tensordiff.recorders.core import Recorder
    from tensordiff.recorders.hf import model_info
    from tensordiff.recorders.hooks import TrainerRecorder, trainer_logprobs
    from tensordiff.recorders.train_cli import load_serve_sequences

    model = trained.load_target(torch.float32)
    seqs = dict(load_serve_sequences(str(serve)))
    ps = trained.prompts()[:3]
    out = tmp_path / "autocast.train.h5"
    want, got = {}, {}
    for i in range(len(ps)):
        ids = torch.tensor(seqs[f"p{i}"])
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            want[i] = model(input_ids=ids[None]).logits
    with Recorder(str(out), side="train", model=model_info(model)) as rec:
        tr = TrainerRecorder(model, rec, temperature=0.7)
        for i, p in enumerate(ps):
            ids = torch.tensor(seqs[f"p{i}"])
            with tr.sequence(f"p{i}", ids, first_generated=len(p)), torch.no_grad(), \
                    torch.autocast("cpu", dtype=torch.bfloat16):
                got[i] = model(input_ids=ids[None]).logits
        tr.detach()
    for i in range(len(ps)):
        assert got[i].dtype == torch.bfloat16 and torch.equal(got[i], want[i])
    with TraceReader(str(out)) as r:
        layer = next(n for n in r.tensors if n.startswith("layer"))
        sk = r.read_at(layer, "sketch", np.arange(len(r.token_rows(layer))))
        assert sk.dtype == np.float32 and np.isfinite(sk).all()
    lp = _logprobs(out)
    ids = torch.tensor(seqs["p0"])
    first = len(ps[0])
    expect = trainer_logprobs(want[0][0, first - 1:-1], ids[first:], 0.7).double().numpy()
    np.testing.assert_array_equal([lp[("p0", q)][1] for q in range(first - 1, len(ids) - 1)], expect)


def test_the_autocast_region_a_state_was_produced_in_is_recorded(tmp_path):
    """A tensor recorded inside ``torch.autocast`` carries the region's dtype (also when only a later
    forward runs in one); one recorded outside carries none; the noise model takes the coarser of
    the stored and the compute dtype."""
    from tensordiff.conventions import AUTOCAST_ATTR
    from tensordiff.noise import compute_dtype
    from tensordiff.recorders.core import Recorder

    out = tmp_path / "ac.h5"
    x = torch.randn(3, 8)
    with Recorder(str(out), side="train", model={"num_layers": 2, "hidden_size": 8}) as rec:
        rows = rec.add_tokens("s", np.arange(3), np.arange(3))
        rec.record("plain", x, rows)
        rec.record("later", x, rows)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            rec.record("inside", x, rows)
        rows2 = rec.add_tokens("t", np.arange(3), np.arange(3))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            rec.record("later", x, rows2)
    with TraceReader(str(out)) as r:
        info = r.tensors
        assert AUTOCAST_ATTR not in info["plain"].attrs
        for name in ("inside", "later"):
            assert info[name].dtype == "float32"
            assert info[name].attrs[AUTOCAST_ATTR] == {"enabled": True, "dtype": "bfloat16", "device": "cpu"}
            assert compute_dtype(info[name].dtype, info[name].attrs) == "bfloat16"
        assert compute_dtype(info["plain"].dtype, info["plain"].attrs) == "float32"
        assert compute_dtype("bfloat16", {AUTOCAST_ATTR: {"enabled": True, "dtype": "float16"}}) == "bfloat16"
        assert compute_dtype("float32", {AUTOCAST_ATTR: {"enabled": False, "dtype": "bfloat16"}}) == "float32"
