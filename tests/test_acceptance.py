"""tensordiff.acceptance: the KL bound from top-k tables, and the acceptance finding on small traces
written here with the trace writer (numpy only; the real-engine cases are in test_sglang_serve.py)."""

from __future__ import annotations

import numpy as np
import pytest

from tensordiff import conventions as cv
from tensordiff.acceptance import kl_lower_bound, topk_compare, verify_steps
from tensordiff.diff import diff_traces
from tensordiff.findings import Kind, Severity
from tensordiff.trace import SlotSpec, TraceReader, TraceWriter

V, H, N, K = 40, 8, 4, 2


def _table(logits: np.ndarray, k: int) -> np.ndarray:
    lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    ids = np.argsort(-logits, axis=-1, kind="stable")[:, :k]
    lp = np.take_along_axis(logits, ids, -1) - lse[:, None]
    return np.concatenate([ids, lp, lse[:, None]], -1)


def _kl(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    lp = p - np.log(np.exp(p).sum(-1, keepdims=True))
    lq = q - np.log(np.exp(q).sum(-1, keepdims=True))
    return (np.exp(lp) * (lp - lq)).sum(-1)


def test_kl_lower_bound_is_a_lower_bound_and_exact_with_the_whole_vocabulary():
    rng = np.random.default_rng(0)
    p, q = rng.normal(size=(500, V)) * 2, rng.normal(size=(500, V)) * 2
    exact = _kl(p, q)
    for k in (1, 3, 10):
        tp, tq = _table(p, k), _table(q, k)
        m = topk_compare(tp, tq)
        assert (m["kl"] <= exact + 1e-9).all() and (m["kl"] >= 0).all()
    tp, tq = _table(p, V), _table(q, V)
    np.testing.assert_allclose(kl_lower_bound(tp[:, :V].astype(np.int64), tp[:, V:2 * V], tq[:, :V].astype(np.int64),
                                              tq[:, V:2 * V]), exact, rtol=1e-9, atol=1e-12)
    same = topk_compare(_table(p, 5), _table(p, 5))
    assert same["top1"].all() and (same["overlap"] == 1).all() and np.allclose(same["kl"], 0)
    # disjoint top-k lists still bound it away from 0 (tokens outside q's list have q <= its k-th prob)
    far = topk_compare(_table(p, 5), _table(-p, 5))["kl"]
    assert (far > 0).all() and (far <= _kl(p, -p) + 1e-9).all() and far.mean() > 0.3


def _bf16(x: np.ndarray) -> np.ndarray:
    """``x`` rounded to bfloat16 (nearest even), as float64: what a bf16 engine's logits hold."""
    u = x.astype(np.float32).view(np.uint32)
    u = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)
    return u.view(np.float32).astype(np.float64)


def _write(path, *, side, fc_scale=1.0, target_noise=0.0, draft_good=False, with_fc=True, steps=None, seed=0,
           with_draft=True, model_seed=7, peaked=False, bf16=False):
    """One sequence of 24 tokens: draft_input [layer1, layer3], draft_fc_output, target_topk at every
    row, draft_topk at rows 0..22 (row t predicts token t+2), and optionally spec_verify rows."""
    rng = np.random.default_rng(model_seed)
    L = 24
    toks = rng.integers(0, V, L)
    states = {b: rng.normal(size=(L, H)).astype(np.float32) for b in range(N + 1)}
    tlog = rng.normal(size=(L, V)) * 3
    if peaked:  # a trained model's logits: one confident token per row, by a margin that varies
        tlog[np.arange(L), rng.integers(0, V, L)] += rng.lognormal(1.5, 0.6, L)
    w = TraceWriter(str(path), side=side, model={"num_layers": N, "hidden_size": H})
    rows = w.add_tokens("s", np.arange(L), toks, "train" if side == "train" else "prefill")
    for b in range(N + 1):
        w.define_tensor(f"layer{b}" if b else "embed", H, kind="boundary", boundary=b)
        w.append(f"layer{b}" if b else "embed", rows, states[b])
    w.define_tensor("draft_input", 2 * H, kind="packed", slots=SlotSpec(labels=["layer1", "layer3"]),
                    token_offset=1, role="draft_input")
    w.append("draft_input", rows[:-1], np.concatenate([states[1], states[3]], -1)[:-1])
    if with_fc:
        fc = (np.concatenate([states[1], states[3]], -1) @ np.ones((2 * H, H), np.float32) * 0.1)[:-1] * fc_scale
        w.define_tensor(cv.DRAFT_FC, H, role=cv.DRAFT_FC, token_offset=1, order=N + 0.8)
        w.append(cv.DRAFT_FC, rows[:-1], fc.astype(np.float32))
    tl = tlog + np.random.default_rng(seed).normal(size=tlog.shape) * target_noise
    if bf16:
        tl = _bf16(tl)
    w.define_tensor(cv.TARGET_TOPK, cv.topk_width(5), dtype="float64", role=cv.TARGET_TOPK, sketch=False)
    w.append(cv.TARGET_TOPK, rows, _table(tl, 5), rms=np.zeros((L, 1), np.float32))
    # the draft at row t predicts token t+2: the target's row t+1
    dl = np.roll(tlog, -1, axis=0) if draft_good else np.random.default_rng(3).normal(size=tlog.shape) * 3
    if bf16:
        dl = _bf16(dl)
    if with_draft:
        w.define_tensor(cv.DRAFT_TOPK, cv.topk_width(5), dtype="float64", role=cv.DRAFT_TOPK, token_offset=1,
                        sketch=False)
        w.append(cv.DRAFT_TOPK, rows[:-1], _table(dl, 5)[:-1], rms=np.zeros((L - 1, 1), np.float32))
    if steps is not None:
        w.define_tensor(cv.SPEC_VERIFY, cv.spec_verify_width(K), dtype="float64", role=cv.SPEC_VERIFY, sketch=False)
        w.append(cv.SPEC_VERIFY, rows[:len(steps)], np.array(steps, dtype=np.float64),
                 rms=np.zeros((len(steps), 1), np.float32))
        # spec_chain: at each draft position the draft equals the target (position 0) or not (position 1)
        tl = _table(tlog[:len(steps)], 5)
        other = _table(np.random.default_rng(9).normal(size=(len(steps), V)) * 3, 5)
        w.define_tensor(cv.SPEC_CHAIN, 2 * K * cv.topk_width(5), dtype="float64", role=cv.SPEC_CHAIN, sketch=False,
                        attrs={"K": K, "draft_width": cv.topk_width(5), "target_width": cv.topk_width(5)})
        w.append(cv.SPEC_CHAIN, rows[:len(steps)], np.concatenate([tl, other, tl, tl], -1),
                 rms=np.zeros((len(steps), 1), np.float32))
    w.close()
    return str(path)


# accepted, K, first rejected, draft tokens, target top-1, target log-prob of the draft token
STEPS = [[0, K, 0, 5, 6, 7, 8, -3.0, -4.0], [1, K, 1, 5, 5, 5, 8, -0.1, -2.0], [2, K, -1, 1, 2, 1, 2, -0.2, -0.3],
         [0, K, 0, 3, 4, 0, 0, -5.0, -5.0]]


def _acceptance(res):
    found = [f for f in res.findings if f.kind == Kind.ACCEPTANCE]
    assert len(found) == 1
    return found[0]


def test_verify_steps_per_draft_position(tmp_path):
    p = _write(tmp_path / "s.h5", side="serve", steps=STEPS)
    with TraceReader(p) as r:
        s = verify_steps(r)
    assert s["steps"] == 4 and s["accept_length"] == pytest.approx(1 + 3 / 4)
    p0, p1 = s["per_position"]
    assert (p0["reached"], p0["accepted"], p1["reached"], p1["accepted"]) == (4, 2, 2, 1)
    assert p0["top1"] == pytest.approx(2 / 4) and p1["top1"] == pytest.approx(1 / 2)
    assert p0["target_logprob"] == pytest.approx((-3 - 0.1 - 0.2 - 5) / 4)
    # from spec_chain: position 0's draft equals the target, position 1's does not
    assert p0["kl_lb"] == pytest.approx(0, abs=1e-9) and p0["overlap"] == 1.0
    assert p1["kl_lb"] > 0.1 and p1["overlap"] < 1.0


@pytest.mark.parametrize("serve_first", [False, True], ids=["train_serve", "serve_train"])
def test_wiring_agrees_and_the_draft_disagrees(tmp_path, serve_first):
    """In either argument order: the acceptance measured is the side with verify steps (serve),
    even when the other side (train) holds draft predictions too."""
    a = _write(tmp_path / "a.h5", side="train")
    b = _write(tmp_path / "b.h5", side="serve", steps=STEPS)
    res = diff_traces(b, a) if serve_first else diff_traces(a, b)
    f = _acceptance(res)
    assert res.exit_code == 0 and f.severity == Severity.WARNING and f.details.verdict == "agree"
    assert "training-quality problem, not wiring" in f.message and "acceptance 1.75 on serve" in f.message
    assert f.details.steps == len(STEPS) and f.details.side == "serve"
    assert f.details.cross[cv.TARGET_TOPK]["top1"] == 1.0 and f.details.draft_disagrees
    # prediction tensors are not compared as states
    assert not {p.name_a for p in res.pairs} & {cv.TARGET_TOPK, cv.DRAFT_TOPK, cv.SPEC_VERIFY}


@pytest.mark.parametrize("serve_first", [False, True], ids=["train_serve", "serve_train"])
def test_a_serve_side_without_draft_predictions_takes_the_other_sides_draft_agreement(tmp_path, serve_first):
    """Serve recorded verify steps but no draft_topk (an engine whose lm_head the plugin could not
    reproduce): the draft's teacher-forced agreement comes from the train side, on the same inputs,
    so a draft that disagrees is still named as the cause, never an 'agree' note."""
    a = _write(tmp_path / "a.h5", side="train")
    b = _write(tmp_path / "b.h5", side="serve", steps=STEPS, with_draft=False)
    f = _acceptance(diff_traces(b, a) if serve_first else diff_traces(a, b))
    assert f.details.verdict == "agree" and f.details.side == "serve" and f.details.steps == len(STEPS)
    assert f.details.draft_disagrees and f.severity == Severity.WARNING
    assert "training-quality problem, not wiring" in f.message


def test_a_good_draft_is_said_to_agree(tmp_path):
    a = _write(tmp_path / "a.h5", side="train", draft_good=True)
    b = _write(tmp_path / "b.h5", side="serve", draft_good=True)
    f = _acceptance(diff_traces(a, b))
    assert f.severity == Severity.INFO and f.details.draft_top1 == 1.0 and "agrees with the target" in f.message


def test_fc_output_divergence_is_the_upstream_cause(tmp_path):
    a = _write(tmp_path / "a.h5", side="train")
    b = _write(tmp_path / "b.h5", side="serve", fc_scale=0.5, steps=STEPS)
    res = diff_traces(a, b)
    f = _acceptance(res)
    assert res.exit_code == 1 and res.first_divergence.tensor == cv.DRAFT_FC
    assert f.details.verdict == "upstream" and f.details.upstream_index == res.first_divergence.index
    # the fc output is the same direction at another scale: named as such
    assert "first divergence upstream: draft_fc_output is scaled by 0.5" in f.message
    assert "normalisation before fc" in f.message  # same direction, another scale


def test_target_predictions_that_differ_are_the_cause(tmp_path):
    a = _write(tmp_path / "a.h5", side="train")
    b = _write(tmp_path / "b.h5", side="serve", target_noise=3.0, steps=STEPS)
    res = diff_traces(a, b)
    f = _acceptance(res)
    assert f.details.verdict == "target" and f.severity == Severity.DIVERGENCE and res.exit_code == 1
    assert "the target's predictions differ between train and serve" in f.message


@pytest.mark.parametrize("serve_first", [False, True], ids=["train_serve", "serve_train"])
def test_false_alarm_sweep_trained_looking_predictions_with_bf16_logits_never_diverge(tmp_path, serve_first):
    """Correct wiring, 20 models whose logits look trained (one confident token per row, margins
    that vary), the serve side's predictions rounded to bf16: never a divergence, never a verdict on
    the wiring that blames the target or the draft; mostly 'agree', and where a bf16 rounding flips
    a close top-1 'close' (no verdict) at most."""
    verdicts = []
    for m in range(20):
        kw = {"model_seed": 100 + m, "peaked": True, "draft_good": True}
        a = _write(tmp_path / f"a{m}.h5", side="train", **kw)
        b = _write(tmp_path / f"b{m}.h5", side="serve", steps=STEPS, bf16=True, **kw)
        res = diff_traces(b, a) if serve_first else diff_traces(a, b)
        f = _acceptance(res)
        assert res.exit_code == 0 and f.severity != Severity.DIVERGENCE, (m, f.message)
        assert f.details.verdict in ("agree", "close"), (m, f.message)
        assert f.details.side == "serve" and f.details.steps == len(STEPS)
        assert f.details.cross[cv.TARGET_TOPK]["kl_lb"] > 0  # the bf16 rounding is there to be seen
        verdicts.append(f.details.verdict)
    assert verdicts.count("agree") >= 15, verdicts


def test_target_predictions_that_move_more_than_their_states_allow_are_the_cause(tmp_path):
    """Every state equal on both sides, the target's logits 0.3 apart: a small KL (0.01-0.1 nats,
    which fixed limits read as 'close', no verdict), but no honest noise of the states can move a
    logit at all, so the predictions change after the last state: the target is the cause."""
    a = _write(tmp_path / "a.h5", side="train")
    b = _write(tmp_path / "b.h5", side="serve", target_noise=0.3, steps=STEPS)
    for res in (diff_traces(a, b), diff_traces(b, a)):
        f = _acceptance(res)
        c = f.details.cross[cv.TARGET_TOPK]
        assert 0.01 < c["kl_lb"] <= 0.1 and c["unexplained"] and c["final_state"] == "layer4", c
        assert f.details.verdict == "target" and res.exit_code == 1, f.message
        assert "the predictions change after layer4" in f.message, f.message


def test_nothing_is_said_to_agree_that_was_not_compared(tmp_path):
    a = _write(tmp_path / "a.h5", side="train", with_fc=False)
    b = _write(tmp_path / "b.h5", side="serve", steps=STEPS)
    f = _acceptance(diff_traces(a, b))
    assert f.details.verdict == "incomplete" and f.details.not_compared == [cv.DRAFT_FC]
    assert "not compared: draft_fc_output; no verdict on the wiring" in f.message
    assert "agree" not in f.message.split(";", 1)[1]


def test_no_predictions_no_acceptance_finding(tmp_path):
    from tensordiff.trace import TraceWriter as W

    paths = []
    for name in ("a", "b"):
        w = W(str(tmp_path / f"{name}.h5"), model={"hidden_size": H})
        w.define_tensor("embed", H, kind="boundary", boundary=0)
        w.append("embed", w.add_tokens("s", np.arange(4), [1, 2, 3, 4], "train"), np.ones((4, H), np.float32))
        w.close()
        paths.append(str(tmp_path / f"{name}.h5"))
    res = diff_traces(*paths)
    assert not [f for f in res.findings if f.kind == Kind.ACCEPTANCE]


def test_acceptance_finding_round_trips_and_validates(tmp_path):
    import jsonschema

    from tensordiff.findings import DiffResult
    from tensordiff.report.text import diff_schema

    a = _write(tmp_path / "a.h5", side="train")
    b = _write(tmp_path / "b.h5", side="serve", steps=STEPS)
    res = diff_traces(a, b)
    d = res.to_dict()
    jsonschema.Draft202012Validator(diff_schema()).validate(d)
    back = DiffResult.from_dict(d)
    f = _acceptance(back)
    assert f.message == _acceptance(res).message and f.details.per_position[0]["reached"] == 4
