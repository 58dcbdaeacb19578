"""The identity decision rule on plain arrays (no files): exact match, paired test, noise floor,
ties broken by scale, ambiguity, scaled states."""

from __future__ import annotations

import numpy as np

from tensordiff.identity import (
    CandidateRows,
    NoiseFloor,
    Target,
    clean,
    decide,
    paired_test,
)

N, W = 48, 32
FLOOR = NoiseFloor(1e-5, 5e-3, "test")


def _rms(x):
    return np.sqrt((x.astype(np.float64) ** 2).mean(1)).astype(np.float32)


def _target(x):
    return Target(clean(x), _rms(x))


def _cand(label, v, side="a", offset=0, exact_tol=None, ok=None):
    ok = np.ones(len(v), bool) if ok is None else ok
    return CandidateRows(label, side, offset, "values", ok, v[ok].astype(np.float32), _rms(v[ok]), exact_tol)


def _residual_chain(rng, layers=6, step=0.03):
    """States of a near-residual stream: each is the previous plus a small update (cos ~0.9995)."""
    h = [rng.standard_normal((N, W)).astype(np.float32)]
    for _ in range(layers):
        h.append(h[-1] + step * rng.standard_normal((N, W)).astype(np.float32))
    return {f"layer{b}" if b else "embed": x for b, x in enumerate(h)}


def floor(_label):
    return FLOOR


def test_exact_own_side_match_decides_between_near_neighbours():
    rng = np.random.default_rng(0)
    st = _residual_chain(rng)
    x = st["layer4"].copy()
    cands = [_cand(lab, v, side="b", exact_tol=1e-6) for lab, v in st.items()]
    v = decide(_target(x), cands, floor, N)
    assert v.outcome == "holds" and v.best == "layer4" and v.evidence.exact and v.evidence.decided_by == "exact"


def test_paired_test_names_the_state_across_sides_under_rounding_noise():
    rng = np.random.default_rng(1)
    st = _residual_chain(rng)
    x = st["layer3"] * (1 + 1e-3 * rng.standard_normal((N, W)).astype(np.float32))  # the other side's rounding
    v = decide(_target(x), [_cand(lab, val) for lab, val in st.items()], lambda _l: NoiseFloor(2e-6, 2e-3, "t"), N)
    assert v.outcome == "holds" and v.best == "layer3", v
    e = v.evidence
    assert e.decided_by == "paired test" and e.win_rate >= 0.75 and e.z >= 3 and e.within_floor
    assert e.runner_up in ("layer2", "layer4")


def test_a_state_between_two_recorded_ones_is_no_recorded_state():
    """h3 + half the update to h4 (a mid-layer state): close to both, equal to neither."""
    rng = np.random.default_rng(2)
    st = _residual_chain(rng)
    mid = (st["layer3"] + 0.5 * (st["layer4"] - st["layer3"])).astype(np.float32)
    cands = [_cand(lab, v, side="b", exact_tol=1e-6) for lab, v in st.items()]
    v = decide(_target(mid), cands, lambda _l: NoiseFloor(1e-7, 1e-4, "t"), N)
    assert v.outcome == "no_state" and v.best is None and v.closest in ("layer3", "layer4")
    assert v.evidence.cos > 0.999 and not v.evidence.within_floor


def test_two_states_too_close_to_tell_apart_are_ambiguous():
    rng = np.random.default_rng(3)
    base = rng.standard_normal((N, W)).astype(np.float32)
    a = base + 1e-3 * rng.standard_normal((N, W)).astype(np.float32)
    b = base + 1e-3 * rng.standard_normal((N, W)).astype(np.float32)
    x = base + 1e-3 * rng.standard_normal((N, W)).astype(np.float32)
    v = decide(_target(x), [_cand("layer3", a), _cand("layer4", b)], lambda _l: NoiseFloor(1e-5, 1e-2, "t"), N)
    assert v.outcome == "ambiguous" and v.best is None and set([v.closest] + v.tied) == {"layer3", "layer4"}


def test_tie_in_direction_is_broken_by_scale():
    """The pre-norm last boundary and final_norm (unit-weight RMSNorm) have the same direction."""
    rng = np.random.default_rng(4)
    h = (3.0 * rng.standard_normal((N, W))).astype(np.float32)
    normed = (h / _rms(h)[:, None]).astype(np.float32)
    v = decide(_target(h), [_cand("layer8", h), _cand("final_norm", normed)], floor, N)
    assert v.outcome == "holds" and v.best == "layer8" and v.evidence.decided_by == "scale"
    w = decide(_target(normed), [_cand("layer8", h), _cand("final_norm", normed)], floor, N)
    assert w.outcome == "holds" and w.best == "final_norm"


def test_right_state_wrong_scale_is_named_with_the_ratio():
    rng = np.random.default_rng(5)
    st = {k: 3 * v for k, v in _residual_chain(rng).items()}   # RMS ~3
    x = (st["layer2"] / _rms(st["layer2"])[:, None]).astype(np.float32)  # RMS-normalised: scale 1/rms
    v = decide(_target(x), [_cand(lab, val) for lab, val in st.items()], floor, N)
    assert v.outcome == "scaled" and v.best == "layer2"
    assert abs(v.scale - float(np.median(1 / _rms(st["layer2"])))) < 0.05 * v.scale


def test_paired_test_on_the_tokens_both_cover():
    rng = np.random.default_rng(6)
    st = _residual_chain(rng)
    x = st["layer2"]
    part = np.zeros(N, bool)
    part[:10] = True   # a partial catalog: rows at 10 of 48 tokens
    cands = [_cand("layer2", st["layer2"], side="b", exact_tol=1e-6, ok=part)] + \
            [_cand(lab, v) for lab, v in st.items() if lab != "layer2"]
    v = decide(_target(x), cands, floor, N)
    assert v.outcome == "holds" and v.best == "layer2" and v.evidence.tokens == 10
    from tensordiff.identity import _score
    n, win, z = paired_test(_score(_target(x), cands[0]), _score(_target(x), cands[3]))
    assert n == 10 and win == 1.0 and z > 3


def test_clean_with_norms_is_clean_then_row_norms_bit_for_bit():
    from tensordiff.identity import clean, clean_with_norms, row_norms

    rng = np.random.default_rng(0)
    x = (rng.standard_normal((40, 96)) * 1e3).astype(np.float32)
    x[3] = np.float32(3e38)   # the largest float32s: their float64 squares stay finite
    for bad in ([], [(5, 7, np.nan)], [(0, 0, np.inf), (9, 95, -np.inf), (9, 2, np.nan)]):
        y = x.copy()
        for i, j, v in bad:
            y[i, j] = v
        data, norms = clean_with_norms(y)
        want = clean(y)
        assert np.array_equal(data, want) and np.isfinite(data).all()
        assert np.array_equal(norms, row_norms(want))
