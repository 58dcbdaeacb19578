"""tensordiff.signatures on plain arrays: each kind of difference a port shows inside one layer is
named, with the parameter that explains it, and a bug of another kind is not mistaken for it."""

from __future__ import annotations

import numpy as np
import pytest

from tensordiff.signatures import LayerInfo, TapRows, attention, classify, rope

H, KV, HD = 4, 2, 16
N_SEQ, L = 6, 40


def _tokens():
    seqs = np.repeat(np.arange(N_SEQ), L).astype(np.int64)
    pos = np.tile(np.arange(L), N_SEQ).astype(np.int64)
    return seqs, pos


def _noise(x, rng, rel=1e-7):
    return x + rel * np.abs(x).mean() * rng.standard_normal(x.shape)


def _silu(g):
    return g / (1 + np.exp(-g))


def _gelu_tanh(g):
    return 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g ** 3)))


def _layer(rng, *, theta_b=1e4, layout_b="half", kv_b=None, eps_b=1e-5, up_scale=1.0, swap=False, head_perm=None,
           q_off=0, k_off=0, scale_b=None, act_b=_silu, residual_b=None, o_scale=1.0, mlp_eps_b=1e-5,
           mlp_w_b=None, with_boundary=False):
    """A layer's taps on both sides, B built with one difference (``residual_b(x, attn_norm,
    attn_out)``: the input of B's mlp_norm)."""
    seqs, pos = _tokens()
    n = len(pos)
    rms = np.exp(rng.uniform(np.log(0.003), np.log(1.0), n))
    x = rng.standard_normal((n, 64)) * rms[:, None]
    w_norm = 1 + 0.1 * rng.standard_normal(64)

    def norm(eps):
        return x / np.sqrt((x * x).mean(1, keepdims=True) + eps) * w_norm

    wq, wk, wv = (rng.standard_normal((64, w)) / 8 for w in (H * HD, KV * HD, KV * HD))
    wo = rng.standard_normal((H * HD, 64)) / 8
    wg, wu = rng.standard_normal((64, 128)) / 8, rng.standard_normal((64, 128)) / 8
    w_mlp = 1 + 0.1 * rng.standard_normal(64)
    block = [h // (H // KV) for h in range(H)]

    def side(eps, theta, layout, kv, scale, swap_gu, perm, qo, ko, sm, act, resid, osc, meps, mw):
        t = {}
        t["attn_norm"] = norm(eps)
        t["q"], t["k"], t["v"] = t["attn_norm"] @ wq, t["attn_norm"] @ wk, t["attn_norm"] @ wv
        if perm is not None:
            t["q"] = t["q"].reshape(n, H, HD)[:, perm].reshape(n, -1)
        t["q_rope"] = rope(t["q"], pos + qo, HD, theta, layout)
        t["k_rope"] = rope(t["k"], pos + ko, HD, theta, layout)
        t["attn_out"] = attention(t["q_rope"], t["k_rope"], t["v"], seqs, pos, H, KV, HD, kv, scale=sm) @ wo * osc
        h = resid(x, t["attn_norm"], t["attn_out"]) if resid is not None else x + t["attn_out"]
        t["mlp_norm"] = h / np.sqrt((h * h).mean(1, keepdims=True) + meps) * (w_mlp if mw is None else mw)
        g, u = t["mlp_norm"] @ wg, t["mlp_norm"] @ wu * scale
        t["mlp_gate"], t["mlp_up"] = (u, g) if swap_gu else (g, u)
        t["mlp_act"] = act(t["mlp_gate"]) * t["mlp_up"]
        return t

    ta = side(1e-5, 1e4, "half", block, 1.0, False, None, 0, 0, None, _silu, None, 1.0, 1e-5, None)
    tb = side(eps_b, theta_b, layout_b, kv_b or block, up_scale, swap, head_perm, q_off, k_off, scale_b, act_b,
              residual_b, o_scale, mlp_eps_b, mlp_w_b)
    taps = {k: TapRows(k, ta[k], _noise(tb[k], rng)) for k in ta}
    if with_boundary:
        return taps, pos, seqs, (x * x).mean(1), TapRows("layer2", x, _noise(x, rng))
    return taps, pos, seqs, (x * x).mean(1)


INFO = LayerInfo(heads=H, kv_heads=KV, head_dim=HD, eps=1e-5, rope_theta=1e4)


def _first(taps):
    return next(t for t in taps if np.linalg.norm(taps[t].b - taps[t].a) / np.linalg.norm(taps[t].a) > 1e-5)


def test_rope_theta_is_fitted():
    taps, pos, seqs, ms = _layer(np.random.default_rng(0), theta_b=20000.0)
    assert _first(taps) == "q_rope"
    s = classify(2, "q_rope", taps, pos, seqs, INFO)
    assert s.kind == "rotary", s
    assert s.params["theta_a"] == 10000 and s.params["theta_b"] == 20000, s.params
    assert "rope theta: A 1e+04, B 2e+04" in s.cause, s.cause


def test_rope_layout_is_named():
    taps, pos, seqs, _ = _layer(np.random.default_rng(1), layout_b="interleaved")
    s = classify(2, "q_rope", taps, pos, seqs, INFO)
    assert s.kind == "rotary" and s.params["layout_b"] == "interleaved" and s.params["layout_a"] == "half", s
    assert "layout" in s.cause


def test_gqa_repeat_order_is_named():
    taps, pos, seqs, _ = _layer(np.random.default_rng(2), kv_b=[h % KV for h in range(H)])
    assert _first(taps) == "attn_out"
    s = classify(2, "attn_out", taps, pos, seqs, INFO)
    assert s.kind == "gqa", s
    assert s.params == {"a": [0, 0, 1, 1], "b": [0, 1, 0, 1]}


def test_norm_eps_is_fitted():
    taps, pos, seqs, ms = _layer(np.random.default_rng(3), eps_b=1e-3)
    assert _first(taps) == "attn_norm"
    s = classify(2, "attn_norm", taps, pos, seqs, INFO, norm_ms=ms)
    assert s.kind == "norm_eps", s
    assert s.params["eps_b"] == pytest.approx(1e-3, rel=0.02)


def test_scale_swap_and_head_permutation():
    taps, pos, seqs, _ = _layer(np.random.default_rng(4), up_scale=1.05)
    s = classify(2, "mlp_up", taps, pos, seqs, INFO)
    assert s.kind == "scale" and s.params["scale"] == pytest.approx(1.05, rel=1e-5), s
    taps, pos, seqs, _ = _layer(np.random.default_rng(5), swap=True)
    s = classify(2, "mlp_gate", taps, pos, seqs, INFO)
    assert s.kind == "swap" and s.params == {"holds": "mlp_up"} and "B's mlp_up holds A's mlp_gate" in s.evidence, s
    taps, pos, seqs, _ = _layer(np.random.default_rng(6), head_perm=[1, 0, 3, 2])
    s = classify(2, "q", taps, pos, seqs, INFO)
    assert s.kind == "heads" and s.params["permutation"] == [1, 0, 3, 2], s


def test_other_differences_are_not_mistaken():
    """A random weight perturbation of the up projection: no scale, no rotary, no eps: 'op'. A
    per-channel ratio is one, not a constant scale."""
    rng = np.random.default_rng(7)
    taps, pos, seqs, ms = _layer(rng)
    up = taps["mlp_up"]
    bad = TapRows("mlp_up", up.a, up.a + 0.02 * rng.standard_normal(up.a.shape) * np.abs(up.a).mean())
    s = classify(2, "mlp_up", {**taps, "mlp_up": bad}, pos, seqs, INFO)
    assert s.kind == "op", s
    ch = TapRows("mlp_up", up.a, up.a * (1 + 0.05 * rng.standard_normal(up.a.shape[1])))
    s = classify(2, "mlp_up", {**taps, "mlp_up": ch}, pos, seqs, INFO)
    assert s.kind == "per_channel", s
    # a rotary-looking tap whose error does not start at nothing at position 0 is not a rotary
    q = taps["q_rope"]
    off = TapRows("q_rope", q.a, q.a * 1.01)
    s = classify(2, "q_rope", {**taps, "q_rope": off}, pos, seqs, INFO)
    assert s.kind == "scale", s
    # an eps-looking norm whose ratio does not follow the input's RMS is a scale
    nrm = taps["attn_norm"]
    s = classify(2, "attn_norm", {**taps, "attn_norm": TapRows("attn_norm", nrm.a, nrm.a * 1.02)}, pos, seqs, INFO,
                 norm_ms=ms)
    assert s.kind == "scale", s


def test_the_judges_tap_pairs_take_their_rows_only_when_read(tmp_path):
    """Every compared one-slot tensor becomes a tap pair for the signatures, which read the zoomed
    layer's few: a pair's rows are taken from the row maps when first read (at 1M tokens x 32
    tensors, taking them all at once held ~0.5 GB), and are the rows of the compared tokens."""
    from tensordiff.diff import DiffOptions
    from tensordiff.diff.analyses import tap_pairs_of
    from tensordiff.diff.plan import plan_diff
    from tensordiff.diff.run import open_pair
    from tensordiff.trace import TraceWriter

    paths = []
    for side in ("train", "serve"):
        p = str(tmp_path / f"{side}.h5")
        with TraceWriter(p, side=side, model={"num_layers": 3, "hidden_size": 16}) as w:
            for b in range(3):
                w.define_tensor(f"layer{b}", 16, kind="boundary", boundary=b, dtype="float32")
            rows = w.add_tokens("s", np.arange(40), np.arange(40) + 3, "train" if side == "train" else "prefill")
            for b in range(3):
                w.append(f"layer{b}", rows, np.random.default_rng(b).standard_normal((40, 16), dtype=np.float32))
        paths.append(p)
    with open_pair(*paths) as (a, b):
        plan = plan_diff(a, b, DiffOptions(), lambda *x: None, measure_noise=False)
        pairs = tap_pairs_of(plan)
        assert len(pairs) == 3
        assert all("rows_a" not in p.__dict__ and "rows_b" not in p.__dict__ for p in pairs)
        for p, j in zip(pairs, [j for j in plan.jobs if j.basis == "values" and j.slots == 1]):
            assert np.array_equal(p.rows_a, j.rows_a[j.rows]) and np.array_equal(p.rows_b, j.rows_b[j.rows])
            assert p.rows_a is p.rows_a   # taken once


def test_attention_scale_is_fitted_and_a_scaled_output_is_not_one():
    """1/head_dim for 1/sqrt(head_dim) (both orders); the o_proj scaled by 1.05 is a scale."""
    taps, pos, seqs, _ = _layer(np.random.default_rng(10), scale_b=1.0 / HD)
    assert _first(taps) == "attn_out"
    s = classify(2, "attn_out", taps, pos, seqs, INFO)
    assert s.kind == "attn_scale", s
    assert s.params["scale_a"] == pytest.approx(0.25, rel=1e-3) and s.params["scale_b"] == pytest.approx(1 / 16, rel=1e-3)
    assert "A 1/sqrt(head_dim) = 0.25, B 1/head_dim = 0.0625" in s.cause, s.cause
    rev = {k: TapRows(k, t.b, t.a) for k, t in taps.items()}
    s = classify(2, "attn_out", rev, pos, seqs, INFO)
    assert s.kind == "attn_scale" and "A 1/head_dim = 0.0625, B 1/sqrt(head_dim) = 0.25" in s.cause, s.cause
    taps, pos, seqs, _ = _layer(np.random.default_rng(11), o_scale=1.05)
    s = classify(2, "attn_out", taps, pos, seqs, INFO)
    assert s.kind == "scale", s
    assert s.params == {"scale": pytest.approx(1.05, rel=1e-5)}


def test_activation_is_named_and_an_act_scale_or_gate_eps_is_not_one():
    taps, pos, seqs, _ = _layer(np.random.default_rng(12), act_b=_gelu_tanh)
    assert _first(taps) == "mlp_act"
    s = classify(2, "mlp_act", taps, pos, seqs, INFO)
    assert s.kind == "activation" and s.params == {"a": "silu", "b": "gelu_pytorch_tanh"}, s
    rev = {k: TapRows(k, t.b, t.a) for k, t in taps.items()}
    assert classify(2, "mlp_act", rev, pos, seqs, INFO).params == {"a": "gelu_pytorch_tanh", "b": "silu"}
    # SiLU of a slightly shifted gate (no standard activation of the recorded gate): not an activation
    taps, pos, seqs, _ = _layer(np.random.default_rng(13), act_b=lambda g: _silu(g * 1.01))
    s = classify(2, "mlp_act", taps, pos, seqs, INFO)
    assert s.kind == "op" and s.params["tried"]["activation"] > s.params["tolerance"], s


def test_residual_add_is_named_and_a_norm_eps_or_weight_is_not_one():
    # the residual taken after the norm, the attention output not added, added twice
    for resid, words in ((lambda x, n, o: n + o, "attn_norm + attn_out"), (lambda x, n, o: x, "layer2 alone"),
                         (lambda x, n, o: x + 2 * o, "layer2 + 2 x attn_out")):
        taps, pos, seqs, ms, bd = _layer(np.random.default_rng(14), residual_b=resid, with_boundary=True)
        assert _first(taps) == "mlp_norm"
        s = classify(2, "mlp_norm", taps, pos, seqs, INFO, boundary=bd)
        assert s.kind == "residual" and s.params["b"].startswith(words), s
        rev = {k: TapRows(k, t.b, t.a) for k, t in taps.items()}
        s = classify(2, "mlp_norm", rev, pos, seqs, INFO, boundary=TapRows("layer2", bd.b, bd.a))
        assert s.kind == "residual" and s.params["a"].startswith(words), s   # the wrong sum on A
        assert f"A normalises {words}" in s.what and "B's mlp_norm is the norm of layer2 + attn_out" in s.evidence
    taps, pos, seqs, ms, bd = _layer(np.random.default_rng(15), mlp_eps_b=1e-2, with_boundary=True)
    s = classify(2, "mlp_norm", taps, pos, seqs, INFO, boundary=bd)
    assert s.kind != "residual" and s.params.get("tried", {}).get("residual", 1.0) > 1e-5, s
    w = 1 + 0.1 * np.random.default_rng(99).standard_normal(64)
    taps, pos, seqs, ms, bd = _layer(np.random.default_rng(15), mlp_w_b=w, with_boundary=True)
    s = classify(2, "mlp_norm", taps, pos, seqs, INFO, boundary=bd)
    assert s.kind == "per_channel", s   # a norm weight, not an add


def test_rotary_position_offset_is_fitted_and_another_theta_is_not_one():
    taps, pos, seqs, _ = _layer(np.random.default_rng(16), q_off=1)
    assert _first(taps) == "q_rope"
    s = classify(2, "q_rope", taps, pos, seqs, INFO)
    assert s.kind == "rope_offset" and (s.params["offset_a"], s.params["offset_b"]) == (0, 1), s
    assert "offset by +1" in s.cause
    rev = {k: TapRows(k, t.b, t.a) for k, t in taps.items()}
    s = classify(2, "q_rope", rev, pos, seqs, INFO)
    assert s.kind == "rope_offset" and (s.params["offset_a"], s.params["offset_b"]) == (1, 0), s
    # theta 20000 (position 0 unchanged) stays a rotary; theta 20000 at p+1: neither fits
    taps, pos, seqs, _ = _layer(np.random.default_rng(17), theta_b=2e4)
    assert classify(2, "q_rope", taps, pos, seqs, INFO).kind == "rotary"
    taps, pos, seqs, _ = _layer(np.random.default_rng(17), theta_b=2e4, q_off=1)
    s = classify(2, "q_rope", taps, pos, seqs, INFO)
    assert s.kind == "op" and {"rotary", "rope_offset"} <= set(s.params["tried"]), s


def test_no_fit_names_each_kind_tried_and_its_miss():
    rng = np.random.default_rng(7)
    taps, pos, seqs, ms = _layer(rng)
    up = taps["mlp_up"]
    bad = TapRows("mlp_up", up.a, up.a + 0.02 * rng.standard_normal(up.a.shape) * np.abs(up.a).mean())
    s = classify(2, "mlp_up", {**taps, "mlp_up": bad}, pos, seqs, INFO, next_step="compare the weights: X")
    assert s.kind == "op"
    assert set(s.params["tried"]) == {"swap", "scale", "per_channel"}, s.params
    for k, v in s.params["tried"].items():
        assert f"{k} {v:.3g}" in s.evidence and v > s.params["tolerance"], s.evidence
    assert "compare the weights: X" in s.cause


def _bf16(x):
    """x rounded to bfloat16 (round to nearest even on the float32 bits), back as float64."""
    u = np.asarray(x, dtype=np.float32).view(np.uint32)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & np.uint32(0xFFFF0000)
    return u.view(np.float32).astype(np.float64)


def _rounded(taps, order="AB"):
    """B's taps (the side with the bug) rounded to bfloat16, A's in full: a bf16 recording
    against an fp32 one, in ``order`` (BA: the bf16 side with the bug is A)."""
    out = {k: TapRows(k, t.a, _bf16(t.b)) for k, t in taps.items()}
    return out if order == "AB" else {k: TapRows(k, t.b, t.a) for k, t in out.items()}


def test_attention_scale_and_gqa_are_fitted_when_the_side_with_the_bug_is_a_bf16_a():
    """A bf16 side with the bug against an fp32 one, in both orders: with the bf16 side as A, A's
    own output is reproduced only within its rounding (~2e-3, over a fixed 1e-3 before), which the
    noise measured upstream (q, k, v rounded alike) allows; the bug is named in both orders, and
    the o_proj scaled by 1.05 is still no softmax scale."""
    for rng, kw, kind in ((20, dict(scale_b=1.0 / HD), "attn_scale"), (21, dict(kv_b=[h % KV for h in range(H)]), "gqa")):
        base, pos, seqs, _ = _layer(np.random.default_rng(rng), **kw)
        for order in ("AB", "BA"):
            s = classify(2, "attn_out", _rounded(base, order), pos, seqs, INFO)
            assert s.kind == kind, (order, s)
    want = {"AB": (0.25, 1 / 16), "BA": (1 / 16, 0.25)}
    base, pos, seqs, _ = _layer(np.random.default_rng(20), scale_b=1.0 / HD)
    for order, (sa, sb) in want.items():
        s = classify(2, "attn_out", _rounded(base, order), pos, seqs, INFO)
        assert s.params["scale_a"] == pytest.approx(sa, rel=1e-2) and s.params["scale_b"] == pytest.approx(sb, rel=1e-2)
    base, pos, seqs, _ = _layer(np.random.default_rng(11), o_scale=1.05)
    for order in ("AB", "BA"):
        s = classify(2, "attn_out", _rounded(base, order), pos, seqs, INFO)
        assert s.kind not in ("attn_scale", "gqa"), (order, s)
