"""`tensordiff drift DIR`: the trainer/rollout mismatch over training steps. Real recordings of the
trained tiny model: HF stands in for the engine (prefill + KV-cache decode, the engine-side RL
records: tests/rl_support.py), the trainer is TrainerRecorder over the rollout's sequences, and
each training step is one real Adam update of the trainer's weights. A stale parameter from step
2 on grows the mismatch steadily; a kernel bug from step 3 on is a jump; a correct bf16 run is
flat and exits 0; each in both roles' file orders (the roles come from the traces' sides)."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from tensordiff.cli import main
from tensordiff.rl.drift import StepRow, discover, read_steps, sparkline

PROMPTS = 4
NEW = 12
STEPS = 6


# ----------------------------------------------------------------------------------------------
# bad input: one line, exit 2 (no torch needed)
# ----------------------------------------------------------------------------------------------


def _one_line_exit_2(capsys, argv, words):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("tensordiff: error: "), err
    assert words in err, err
    assert "Traceback" not in err


def _touch(p: Path, text: str = "x") -> Path:
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)
    return p


def test_bad_directories_are_one_line_exit_2(tmp_path, capsys):
    d = tmp_path / "empty"
    d.mkdir()
    _one_line_exit_2(capsys, ["drift", str(d)], "no step traces here")
    _one_line_exit_2(capsys, ["drift", str(tmp_path / "nope")], "not a directory")
    half = tmp_path / "half"
    for k in range(3):
        _touch(half / f"train_{k}.h5")
        if k != 1:
            _touch(half / f"rollout_{k}.h5")
    _one_line_exit_2(capsys, ["drift", str(half)], "step 1 is half a pair: train_1.h5 has no rollout_1")
    sd = tmp_path / "stepdirs"
    for k in range(2):
        _touch(sd / f"step_{k:04d}" / "train.h5")
    _touch(sd / "step_0000" / "rollout.h5")
    _one_line_exit_2(capsys, ["drift", str(sd)], "half a pair: no rollout.h5")
    gap = tmp_path / "gap"
    for k in (0, 1, 3, 4):
        _touch(gap / f"train_{k}.h5")
        _touch(gap / f"rollout_{k}.h5")
    _one_line_exit_2(capsys, ["drift", str(gap)], "the step numbers have a gap: steps 0-4 lack 2")
    one = tmp_path / "one"
    _touch(one / "train_0.h5")
    _touch(one / "rollout_0.h5")
    _one_line_exit_2(capsys, ["drift", str(one)], "one step only")
    stray = tmp_path / "stray"
    for k in range(2):
        _touch(stray / f"train_{k}.h5")
        _touch(stray / f"rollout_{k}.h5")
    _touch(stray / "notes.txt")          # not a trace name: ignored
    _touch(stray / "weights.h5")         # a trace name of no step: refused
    _one_line_exit_2(capsys, ["drift", str(stray)], "weights.h5 is a trace of no step")
    mixed = tmp_path / "mixed"
    for k in range(2):
        _touch(mixed / f"train_{k}.h5")
        _touch(mixed / f"rollout_{k}.h5")
    _touch(mixed / "rollout.h5")
    _one_line_exit_2(capsys, ["drift", str(mixed)], "two layouts at once")
    twice = tmp_path / "twice"
    for n in ("train_1.h5", "train_01.h5", "rollout_1.h5", "train_2.h5", "rollout_2.h5"):
        _touch(twice / n)
    _one_line_exit_2(capsys, ["drift", str(twice)], "step 1 given twice")


def test_a_file_that_is_no_trace_is_one_line_exit_2(tmp_path, capsys):
    """Names of a good layout, contents not HDF5: the first open says so."""
    d = tmp_path / "junk"
    for k in range(2):
        _touch(d / f"train_{k}.h5", "not hdf5")
        _touch(d / f"rollout_{k}.h5", "not hdf5")
    assert main(["drift", str(d)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and ("train_0.h5" in err or "rollout_0.h5" in err), err


def test_layouts(tmp_path):
    a = tmp_path / "a"
    for k in (3, 4, 5):      # a run resumed at step 3: numbering need not start at 0
        _touch(a / f"step_{k}" / "train.h5")
        _touch(a / f"step_{k}" / "rollout.h5")
    layout, pairs = discover(str(a))
    assert layout == "pairs" and [p.step for p in pairs] == [3, 4, 5]
    assert pairs[0].train.endswith("step_3/train.h5") and pairs[0].rollout.endswith("step_3/rollout.h5")
    b = tmp_path / "b"
    _touch(b / "rollout.h5")
    for k in range(3):
        _touch(b / f"train_{k}.h5")
    layout, pairs = discover(str(b))
    assert layout == "engine" and {p.rollout for p in pairs} == {str(b / "rollout.h5")}


# ----------------------------------------------------------------------------------------------
# how the steps are read (the triages' rows as they come)
# ----------------------------------------------------------------------------------------------


def _rows(ms, causes, noise=1e-3):
    return [StepRow(k, "t", "r", c, f"{c}: step {k}", tokens=48, noise=noise,
                    metrics={"mean_abs_logprob_diff": m, "token_mult_prob_error": 1 + m})
            for k, (m, c) in enumerate(zip(ms, causes))]


def test_reading_the_steps():
    d = read_steps(_rows([0.004, 0.0041, 0.0039, 0.0042], ["agree"] * 4))
    assert d.exit_code == 0 and d.first is None and d.headline.startswith("no drift: every step's pair agrees")
    d = read_steps(_rows([0.004, 0.004, 0.01, 0.02, 0.03, 0.04], ["agree", "agree"] + ["weights"] * 4))
    assert (d.first, d.onset_cause, d.shape) == (2, "weights", "steady"), d.headline
    assert "a steady rise over 4 steps" in d.headline and "at step 2: weights: step 2" in d.headline
    d = read_steps(_rows([0.004, 0.004, 0.004, 0.05, 0.051, 0.05], ["agree"] * 3 + ["layer"] * 3))
    assert (d.first, d.shape) == (3, "jump") and "a jump at its first step out, 0.004 -> 0.05, then it stays" \
        in d.headline, d.headline
    # out from step 0 (an offset), a new cause appears at step 3 with the growth: that is the one named
    d = read_steps(_rows([0.3, 0.3, 0.3, 0.6, 0.9], ["logprobs"] * 3 + ["weights"] * 2))
    assert (d.first, d.onset, d.onset_cause) == (0, 3, "weights"), d.headline
    assert d.headline.startswith("drift: the pairs differ from step 0 on (logprobs), and the mismatch grows from step "
                                 "3 with a new cause"), d.headline
    assert "cause by step: steps 0-2 logprobs; steps 3-4 weights" in d.text()
    d = read_steps(_rows([0.3, 0.31, 0.3], ["logprobs"] * 3))
    assert d.shape == "constant" and d.exit_code == 1 and d.headline.startswith("no growth, but every step differs")
    assert sparkline([0.0, 0.5, 1.0, None]) == "▁▅█ "
    from tensordiff.rl.html import render_drift

    d = read_steps(_rows([0.004, 0.004, 0.01, 0.02, 0.03, 0.04], ["agree", "agree"] + ["weights"] * 4))
    page = render_drift(d)
    assert page.count("<svg") == 2 and page.count("<circle") == 12 and "<script" not in page and "href=" not in page
    assert 'fill="#d62728"><title>step 2: mean |logprob diff| 0.01 (out of the noise)' in page
    assert "<title>step 2: the first step out of the noise</title>" in page
    assert sparkline([0.01, 0.0101, 0.0099]) == "███"   # flat reads flat


# ----------------------------------------------------------------------------------------------
# real recordings
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The trainer's weights over STEPS training steps (one Adam optimizer, one update per step, of
    next-token loss on the prompts) and the prompts."""
    torch = pytest.importorskip("torch")
    import trained

    ws = [trained.load_target(torch.float32)]
    m = copy.deepcopy(ws[0]).train()
    opt = torch.optim.Adam(m.parameters(), lr=1e-3)      # one optimizer over the run: its moments carry on
    ids = [torch.tensor(p) for p in trained.prompts()]
    for _ in range(STEPS - 1):
        opt.zero_grad()
        loss = sum(m(input_ids=x[None], labels=x[None]).loss for x in ids) / len(ids)
        loss.backward()
        opt.step()
        ws.append(copy.deepcopy(m).eval())
    return {"ws": ws, "prompts": trained.prompts()[:PROMPTS], "root": tmp_path_factory.mktemp("drift")}


def _pairs_dir(run, name, engine_at, *, swap=False):
    """``step_<k>/{train,rollout}.h5`` for every step: the engine ``engine_at(k, weights)`` serves the
    rollout, the trainer (its weights ``ws[k]``) runs its sequences. ``swap``: the two files'
    names exchanged (train.h5 holds the rollout), the roles left to the traces' sides."""
    import rl_support as rs

    d = run["root"] / name
    for k, w in enumerate(run["ws"]):
        s = d / f"step_{k}"
        s.mkdir(parents=True)
        r = rs.rollout(s / "rollout.h5", engine_at(k, w), prompts=run["prompts"], new_tokens=NEW, seed=k)
        rs.trainer(s / "train.h5", w, r, run["prompts"])
    return _swapped(d) if swap else d


def _swapped(d: Path) -> Path:
    out = d.with_name(d.name + "-swapped")
    for s in sorted(d.iterdir()):
        (out / s.name).mkdir(parents=True)
        shutil.copy(s / "train.h5", out / s.name / "rollout.h5")
        shutil.copy(s / "rollout.h5", out / s.name / "train.h5")
    return out


def _stale_from_2(run):
    ws = run["ws"]

    def engine(k, w):
        e = copy.deepcopy(w)
        if k >= 2:   # the sync misses layer 3's down_proj: it stays at step 1's values
            e.model.layers[3].mlp.down_proj.weight.data.copy_(ws[1].model.layers[3].mlp.down_proj.weight.data)
        return e
    return engine


def _drift_json(capsys, d, code):
    assert main(["drift", str(d), "--json", "-q"]) == code
    return json.loads(capsys.readouterr().out)


@pytest.mark.torch
def test_a_stale_parameter_grows_the_mismatch_steadily(run, capsys):
    """From step 2 on the engine's sync misses layer 3's down_proj: steps 0-1 agree, step 2 is the
    first out of the noise, its cause the weights (layer3 mlp_out), and the mismatch rises steadily
    (the parameter falls one more update behind every step); the same with the file names
    exchanged."""
    d = _pairs_dir(run, "stale", _stale_from_2(run))
    for where in (d, _swapped(d)):
        got = _drift_json(capsys, where, 1)
        lp = [s["mean_abs_logprob_diff"] for s in got["steps"]]
        assert (got["first"], got["onset_cause"], got["shape"]) == (2, "weights", "steady"), (got["headline"], lp)
        assert [s["cause"] for s in got["steps"]] == ["agree", "agree"] + ["weights"] * (STEPS - 2)
        assert got["headline"].startswith("drift: the pairs agree up to step 1 and leave the noise at step 2 "
                                          "(mean |logprob diff| "), got["headline"]
        assert ": a steady rise over 4 steps" in got["headline"]
        assert "at step 2: weights: layer3 mlp_out (model.layers.3.mlp.down_proj.weight) differs" in got["headline"]
        lp = [s["mean_abs_logprob_diff"] for s in got["steps"]]
        assert lp[2] > 10 * max(lp[:2]) and lp[-1] > 2 * lp[2], lp
        assert all(s["train"].endswith("rollout.h5") == (where != d) for s in got["steps"])  # roles from the sides
    assert main(["drift", str(d), "-q"]) == 1
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith("drift: the pairs agree up to step 1")
    assert "  mean |logprob diff|" in out and "  <- first out of the noise" in out
    assert "cause by step: steps 0-1 agree; steps 2-5 weights" in out


@pytest.mark.torch
def test_a_kernel_bug_from_step_3_is_a_jump(run, capsys):
    """From step 3 on the engine's layer-3 MLP output is x1.5 (its weights synced): steps 0-2 agree,
    step 3 leaves the noise with the first state after it named, at once (a jump)."""
    import rl_support as rs

    def engine(k, w):
        e = copy.deepcopy(w)
        if k >= 3:
            rs.scaled_output(e.model.layers[3].mlp, 1.5)
        return e
    d = _pairs_dir(run, "jump", engine)
    got = _drift_json(capsys, d, 1)
    assert (got["first"], got["onset_cause"], got["shape"]) == (3, "layer", "jump"), got["headline"]
    assert "at step 3: states: the first state out of the noise trend is layer4" in got["headline"], got["headline"]
    assert "a jump at its first step out" in got["headline"]


@pytest.mark.torch
def test_a_correct_bf16_run_is_flat_and_exits_0(run, capsys, tmp_path):
    """A bf16 engine synced correctly every step against the fp32 trainer: every step within the
    noise, exit 0, in both file orders; --html writes a page with the plot (inline SVG, nothing
    fetched)."""
    torch = pytest.importorskip("torch")
    d = _pairs_dir(run, "flat", lambda k, w: copy.deepcopy(w).to(torch.bfloat16))
    for where in (d, _swapped(d)):
        got = _drift_json(capsys, where, 0)
        assert got["first"] is None and got["shape"] == "flat", got["headline"]
        assert got["headline"].startswith("no drift: every step's pair agrees within the noise, steps 0-5")
        lp = [s["mean_abs_logprob_diff"] for s in got["steps"]]
        assert all(x is not None and 0 < x < 0.05 for x in lp), lp
    page = tmp_path / "flat.html"
    assert main(["drift", str(d), "--html", str(page), "-q"]) == 0
    capsys.readouterr()
    html = page.read_text()
    assert html.count("<svg") == 2 and "<polyline" in html and "<script" not in html
    assert "src=" not in html and "href=" not in html


# ----------------------------------------------------------------------------------------------
# one engine trace over every weight update
# ----------------------------------------------------------------------------------------------


def _engine_over_steps(out: Path, engines, prompts, *, temperature: float = 0.7) -> Path:
    """One engine trace over every training step: weight step k (update_weights_from_tensor after
    the start) in force from forward step k, each step's requests ``s<k>-p<i>`` served under it."""
    import torch
    import trained
    from transformers import DynamicCache

    from tensordiff import conventions as cv
    from tensordiff.recorders.core import Recorder
    from tensordiff.recorders.hf import HFExtractorRecorder, model_info
    from tensordiff.recorders.hooks import record_weights, trainer_logprobs
    from tensordiff.trace.rl import sampling_params, write_sampling

    gen = torch.Generator().manual_seed(0)
    info = model_info(engines[0])
    info["path"] = str(trained.target_dir())
    with Recorder(str(out), side="serve", producer="tests.test_rl_drift (HF as the engine, many updates)",
                  model=info) as rec:
        write_sampling(rec.writer, sampling_params(temperature=temperature, engine="hf-rollout"))
        for k, model in enumerate(engines):
            record_weights(rec, model, k, forward_step=k, event="start" if k == 0 else "update_weights_from_tensor")
            hf = HFExtractorRecorder(model, rec, None, values="all", topk=20)
            for i, ids in enumerate(prompts):
                cache, toks = DynamicCache(), list(ids)
                feed, pos, regime = toks, list(range(len(toks))), "prefill"
                for _ in range(NEW):
                    x = torch.tensor(feed)
                    with hf.capture(f"s{k}-p{i}", x, positions=pos, regime=regime, step=k) as rows, \
                            torch.inference_mode():
                        o = model(input_ids=x[None], position_ids=torch.tensor(pos)[None], past_key_values=cache,
                                  use_cache=True)
                    cache = o.past_key_values
                    z = o.logits[0, -1].float()
                    nxt = int(torch.multinomial(torch.softmax(z / temperature, -1), 1, generator=gen))
                    lp = trainer_logprobs(z[None], torch.tensor([nxt]), temperature)
                    rec.plain(cv.SAMPLED_LOGPROB, np.array([[nxt, float(lp[0])]]), rows[0, -1:],
                              role=cv.SAMPLED_LOGPROB)
                    toks.append(nxt)
                    feed, pos, regime = [nxt], [len(toks) - 1], "decode"
            hf.detach()
    return out


def _trainer_of_step(out: Path, model, serve: Path, k: int, prompts, temperature: float = 0.7,
                     prefix: str = "") -> Path:
    import torch

    from tensordiff.recorders.core import Recorder
    from tensordiff.recorders.hf import model_info
    from tensordiff.recorders.hooks import TrainerRecorder
    from tensordiff.recorders.train_cli import load_serve_sequences

    seqs = dict(load_serve_sequences(str(serve)))
    with Recorder(str(out), side="train", model=model_info(model)) as rec:
        tr = TrainerRecorder(model, rec, temperature=temperature)
        for i, p in enumerate(prompts):
            key = f"s{k}-p{i}"
            with tr.sequence(prefix + key, torch.tensor(seqs[key]), first_generated=len(p)), torch.no_grad():
                model(input_ids=torch.tensor(seqs[key])[None])
        tr.detach()
    return out


@pytest.mark.torch
def test_one_engine_trace_over_many_updates(run, capsys):
    """One engine trace over every weight update (its /weights/step_<k> records), one trainer trace
    per step: each trainer's sequences are triaged under the engine weight step in force for them;
    the sync that misses layer 3's down_proj from update 2 on is named as stale after update 2
    (the engine's own records say it still holds step 1's values) and grows steadily; the same
    engine synced correctly exits 0."""
    ws, ps = run["ws"], run["prompts"]
    engine = _stale_from_2(run)
    for name, engines, code in (("engine-stale", [engine(k, w) for k, w in enumerate(ws)], 1),
                                ("engine-ok", [copy.deepcopy(w) for w in ws], 0)):
        d = run["root"] / name
        d.mkdir()
        r = _engine_over_steps(d / "rollout.h5", engines, ps)
        for k, w in enumerate(ws):
            _trainer_of_step(d / f"train_{k}.h5", w, r, k, ps)
        got = _drift_json(capsys, d, code)
        assert got["layout"] == "engine"
        assert [s["engine_weight_steps"] for s in got["steps"]] == [[k] for k in range(STEPS)], got["steps"]
        if code == 0:
            assert got["headline"].startswith("no drift"), got["headline"]
            continue
        assert (got["first"], got["onset_cause"], got["shape"]) == (2, "weights", "steady"), got["headline"]
        assert "  cause by step: steps 0-1 agree; steps 2-5 weights" in got["lines"]
        assert ("at step 2: weights: layer3 mlp_out (model.layers.3.mlp.down_proj.weight) is stale on the engine "
                "after weight update step 2 (update_weights_from_tensor): it still holds step 1's values") \
            in got["headline"], got["headline"]
    # trainer traces of requests the engine never served (another job's ids): one line, exit 2
    other = run["root"] / "engine-other"
    other.mkdir()
    shutil.copy(run["root"] / "engine-ok" / "rollout.h5", other / "rollout.h5")
    for k in range(2):
        _trainer_of_step(other / f"train_{k}.h5", ws[k], other / "rollout.h5", k, ps, prefix="job2-")
    assert main(["drift", str(other), "-q"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "train_0.h5: shares no sequence with rollout.h5" in err, err
