"""The noise model's rule on plain numbers (tensordiff/noise.py): a trend of honest levels stays
clean, a jump, a subset of far-off tokens or a shifted RMS ratio leaves it, and what follows is
not used to predict; module-hook names get the depth they point at."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tensordiff import noise
from tensordiff.noise import Level, fit, name_depth


def _lv(q50, q99=None, sd=None, bias=0.0):
    q99 = 2 * q50 if q99 is None else q99
    return Level(q50, q99, 0.5 * q99 * q99, q50 / 3 if sd is None else sd, bias)


# bf16 vs fp32 levels of the trained test model (docs/diff.md), median rel err per boundary
TRAINED = [0.0016, 0.0038, 0.0044, 0.0053, 0.0057, 0.0061, 0.0066, 0.0072, 0.0076]


def _states(levels):
    return [("embed" if b == 0 else f"layer{b}", float(b), lv) for b, lv in enumerate(levels)]


def test_honest_trend_is_clean_and_sets_the_expected_noise():
    m = fit("float32", "bfloat16", _states([_lv(x) for x in TRAINED]))
    assert all(s.clean for s in m.states) and m.measured and m.source == "measured trend"
    assert m.expected(5).q50 >= TRAINED[5]
    c, r = noise.tolerance(m, 5)
    assert 4 * TRAINED[5] < r < 0.1 and 0.99 < c < 1


def test_a_jump_is_where_the_divergence_starts_and_the_rest_does_not_predict():
    lv = [_lv(x) for x in TRAINED]
    lv[4:] = [_lv(5 * x) for x in TRAINED[4:]]
    m = fit("float32", "bfloat16", _states(lv))
    first = m.first_jump
    assert first is not None and first.label == "layer4" and first.why == "level"
    assert [s.clean for s in m.states] == [True] * 4 + [False] * 5
    assert m.expected(8).q50 < 3 * TRAINED[8]   # extrapolated from the clean states, not the bug


def test_a_subset_of_tokens_and_a_scale_leave_the_trend_too():
    lv = [_lv(x) for x in TRAINED]
    lv[3] = _lv(TRAINED[3], q99=0.4)            # a few tokens far off: the median keeps the trend
    m = fit("float32", "bfloat16", _states(lv))
    assert m.first_jump.label == "layer3" and m.first_jump.why == "tokens"
    lv = [_lv(x) for x in TRAINED]
    lv[1] = _lv(TRAINED[1], bias=math.log(0.987))  # a norm eps: the RMS ratio moves first
    m = fit("float32", "bfloat16", _states(lv))
    assert m.first_jump.label == "layer1" and m.first_jump.why == "scale"


# rollout against replay of one bf16 engine: prefill rows equal bit for bit (every median 0), the
# decode rows a fraction of a percent apart (99th percentiles of the SGLang RL test's states)
DECODE_ONLY = [0.0, 0.00097, 0.0016, 0.0026, 0.0036, 0.0047, 0.006]


def test_a_subset_of_tokens_far_past_a_measured_trend_leaves_it_under_the_default():
    """A bug on the decode rows moves them 25x the measured trend, yet under TOKEN x the bf16
    default's 99th percentile at that depth: the allowance is the trend plus the tail the layers
    before added per layer (at least one rounding), not the default's whole depth, so the state
    leaves the trend and cannot loosen the tolerance of every state after it."""
    lv = [_lv(0.0, q99=x) for x in DECODE_ONLY]
    lv[4] = _lv(0.0, q99=0.097)
    assert 0.097 < noise.TOKEN * noise.physical_default("bfloat16", "bfloat16", 4.0).q99
    m = fit("bfloat16", "bfloat16", _states(lv))
    assert [s.clean for s in m.states[:4]] == [True] * 4
    assert m.first_jump is not None and m.first_jump.label == "layer4" and m.first_jump.why == "tokens"
    assert noise.tolerance(m, 6)[1] < 0.097   # the deeper states are judged by the clean trend
    # the honest decode rows keep it, and so does the same subset moved by twice one rounding (the
    # states before add a fraction of one rounding per layer: one rounding is what a layer may add)
    lv[4] = _lv(0.0, q99=DECODE_ONLY[4])
    assert all(s.clean for s in fit("bfloat16", "bfloat16", _states(lv)).states)
    one = noise.physical_default("bfloat16", "bfloat16", 0.0).q99
    assert noise.fresh_rounding99("bfloat16", "bfloat16", 3.0, 4.0, measured=0.002) == one
    lv[4] = _lv(0.0, q99=2 * one)
    assert all(s.clean for s in fit("bfloat16", "bfloat16", _states(lv)).states)
    # the subset moved 10x the trend (layer 3 x1.2 of benchmarks/bench_rl_decode.py) leaves it
    lv[4] = _lv(0.0, q99=0.039)
    assert fit("bfloat16", "bfloat16", _states(lv)).first_jump.label == "layer4"


@pytest.mark.parametrize("depth", [1, 3, 6])
def test_fresh_rounding_after_states_equal_bit_for_bit_keeps_the_trend(depth):
    """Two engines equal bit for bit up to a layer whose kernel differs (a dense prefix, then MoE):
    that layer's honest rounding appears all at once; one layer's rounding at the default stays in
    the trend, ten layers' worth does not."""
    one = noise.fresh_rounding99("bfloat16", "bfloat16", depth - 1.0, float(depth))
    for q99, clean in ((one, True), (10 * one, False)):
        lv = [_lv(0.0, q99=0.0) for _ in range(depth)] + [_lv(0.25 * q99, q99=q99)]
        m = fit("bfloat16", "bfloat16", _states(lv))
        assert m.states[-1].clean is clean, (q99, m.states[-1])


def test_a_trend_growing_fast_keeps_its_own_tail():
    """A random-weight model's error doubles per layer: its tail grows with it, above the default."""
    lv = [_lv(0.002 * 2 ** b, q99=0.006 * 2 ** b) for b in range(9)]
    assert all(s.clean for s in fit("float32", "bfloat16", _states(lv)).states)


def test_nothing_measured_is_the_physical_default_and_says_so():
    m = fit("float32", "bfloat16", [])
    assert not m.measured and m.source == "default for fp32 vs bf16, not measured"
    u = 2.0 ** -9
    assert math.isclose(m.expected(0).q50, 0.8 * u) and math.isclose(m.expected(1).q50, 0.8 * u * 3)


def test_judge_names_the_part_that_failed():
    m = fit("float32", "bfloat16", _states([_lv(x) for x in TRAINED]))
    e = m.expected(5)
    ok = noise.judge(m, 5, e.q50, e.c99, 0.0, e.sd, 400, 0.99, 1.01)
    assert ok.part == ""
    scale = noise.judge(m, 5, 0.05, e.c99, math.log(1.05), e.sd, 400, 1.04, 1.06)
    assert scale.part == "scale" and math.isclose(scale.value, 1.05)
    spread = noise.judge(m, 5, 0.1, e.c99, 0.0, 0.15, 400, 0.78, 1.25)
    assert spread.part == "rescaled"
    level = noise.judge(m, 5, 0.05, 1e-3, 0.0, e.sd, 400, 0.99, 1.01)
    assert level.part == "level" and level.limit < 0.05


def test_module_hook_names_point_at_their_depth():
    assert name_depth("model.layers.3.mlp") == 4.0 and name_depth("transformer.h.11") == 12.0
    assert name_depth("model.embed_tokens") == 0.0
    assert name_depth("draft_fc_output") is None and name_depth("lm_head") is None


class _Tokens:
    """A side's token table, all that noise_io.Duplicates reads of a source."""

    def __init__(self, seq, position, regime):
        from tensordiff.trace.schema import TOKEN_DTYPE

        self.tokens = np.zeros(len(seq), TOKEN_DTYPE)
        self.tokens["seq"], self.tokens["position"], self.tokens["regime"] = seq, position, regime


def test_duplicates_found_in_any_row_order_and_once_per_rows_array():
    """Rows recorded twice for one (sequence, position, regime) are found whether the rows are in
    key order or interleaved (a serve batch); a token-rows array shared by tensors is looked at once."""
    from tensordiff.noise_io import Duplicates

    # token table: seq 0 positions 0-4, seq 1 positions 0-4 (prefill), plus seq 0 position 2 again
    src = _Tokens([0] * 5 + [1] * 5 + [0], [0, 1, 2, 3, 4] * 2 + [2], [1] * 11)
    d = Duplicates(src)
    ordered = np.arange(10, dtype=np.int64)
    assert [len(x) for x in d.pairs(ordered)] == [0, 0]
    interleaved = np.array([0, 5, 1, 6, 2, 7, 3, 8, 4, 9], np.int64)
    assert [len(x) for x in d.pairs(interleaved)] == [0, 0]
    twice = np.array([5, 0, 1, 2, 10, 3, 4], np.int64)   # row 4 holds token row 10: seq 0 position 2 again
    first, second = d.pairs(twice)
    assert sorted([int(first[0]), int(second[0])]) == [3, 4]
    same_row = np.array([0, 1, 1, 2], np.int64)           # one token row recorded twice
    first, second = d.pairs(same_row)
    assert (int(first[0]), int(second[0])) == (1, 2)
    # the same array again: the memo answers, and it is the array itself, not an equal one, that counts
    assert d.pairs(twice) is d.pairs(twice)
    assert d.pairs(twice.copy()) is not d.pairs(twice)
    # another regime is another token
    d2 = Duplicates(_Tokens([0, 0], [3, 3], [1, 2]))
    assert [len(x) for x in d2.pairs(np.array([1, 0], np.int64))] == [0, 0]


def _where_by_entry(failing, compared, entry):
    """where_failing's summary of sequences, positions and regimes, token by token (the reference)."""
    ents = [entry(int(t)) for t in failing]
    regimes: dict[str, int] = {}
    for e in ents:
        regimes[e["regime"]] = regimes.get(e["regime"], 0) + 1
    seqs = sorted({e["seq"] for e in ents})
    every = {entry(int(t))["seq"] for t in compared[:: max(1, len(compared) // 4096)]}
    pos = sorted({int(e["position"]) for e in ents})
    return seqs, max(len(every), len(seqs)), regimes, pos


@pytest.mark.parametrize("seed", range(6))
def test_where_failing_summarises_the_tokens_as_token_by_token(seed):
    """The sequences, positions and regimes of the failing tokens, taken as arrays, are what the
    token-by-token entries give: the same names, the same counts, the regimes in the order they
    first fail (the JSON keeps that order)."""
    from tensordiff.noise_io import Places, _ranges, where_failing

    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 9000))
    names = np.array([f"req-{i}" for i in range(int(rng.integers(1, 7)))], dtype=object)
    regimes = np.array(["prefill", "decode", "verify", "train"], dtype=object)
    seq = rng.integers(0, len(names), n)
    position = rng.integers(0, 3000, n) if seed % 2 else np.sort(rng.integers(0, 50, n))
    regime = rng.integers(0, len(regimes), n)
    # A's regimes: the same as B's (seeds 0, 3), train on A (1, 4), or drawn (2, 5)
    regime_a = (regime if seed % 3 == 0 else np.full(n, 3) if seed % 3 == 1 else rng.integers(0, len(regimes), n))
    compared = np.arange(n)
    failing = np.sort(rng.choice(n, int(rng.integers(1, min(n, 600) + 1)), replace=False))

    def places(idx):
        return Places(names[seq[idx]], position[idx].astype(np.int64), regimes[regime[idx]], regimes[regime_a[idx]])

    def entry(t):
        return {"seq": str(names[seq[t]]), "position": int(position[t]), "regime": str(regimes[regime[t]]),
                "regime_a": str(regimes[regime_a[t]])}

    got = where_failing(None, None, None, None, 0, 1, failing, compared, compared, compared, places, "sketch")
    seqs, of, by_regime, pos = _where_by_entry(failing, compared, entry)
    assert got["sequence_names"] == seqs[:4] and got["sequences"] == len(seqs) and got["of_sequences"] == of
    assert list(got["regimes"].items()) == list(by_regime.items())
    # A's regimes only where two engines computed a failing token in different regimes
    named = any(entry(int(t))["regime"] != entry(int(t))["regime_a"] and "train" not in
                (entry(int(t))["regime"], entry(int(t))["regime_a"]) for t in failing)
    assert ("regimes_a" in got) == named == (seed % 3 == 2)
    if named:
        _, _, by_regime_a, _ = _where_by_entry(failing, compared, lambda t: {**entry(t), "regime": entry(t)["regime_a"]})
        assert list(got["regimes_a"].items()) == list(by_regime_a.items())
    assert got["positions"] == _ranges(pos) and got["kept"] == len(failing)
    runs = [(a, b) for a, b in zip(pos, pos[1:]) if b != a + 1]
    assert got["positions"].endswith(", ...") == (len(runs) + 1 > 4)


def test_ranges_of_integers():
    from tensordiff.noise_io import _ranges

    assert _ranges([]) == ""
    assert _ranges([5]) == "5"
    assert _ranges([3, 1, 2, 2, 9, 30, 31, 32, 7]) == "1-3, 7, 9, 30-32"
    assert _ranges([0, 2, 4, 6, 8]) == "0, 2, 4, 6, ..."
    assert _ranges(np.arange(10, 20)) == "10-19"


def test_order_stats_are_numpys_median_and_quantiles_to_the_bit():
    """The level's percentiles come from one partial sort; they are np.median's and np.quantile's
    (linear) values bit for bit, on odd and even sizes, ties, one value, q at 0 and 1."""
    rng = np.random.default_rng(11)
    qs = (0.5, 0.99, 0.9, 0.05, 0.0, 1.0)
    for t in range(3000):
        n = int(rng.integers(1, 12)) if t % 3 == 0 else int(rng.integers(12, 3000))
        x = rng.standard_normal(n) * 10.0 ** rng.uniform(-9, 3)
        if t % 4 == 0:
            x = np.round(x, 2) + 0.0   # ties (and no -0.0: its sign is not numpy's, see below)
        want = [float(np.median(x))] + [float(np.quantile(x, q)) for q in qs[1:]]
        assert np.array(noise.order_stats(x, qs)).tobytes() == np.array(want).tobytes(), (n, t)
    for x in ([-0.0], [-0.0, -0.0], [-0.0, 0.0], [0.0, -0.0], [-0.0] * 3, [-1.0, -0.0], [-0.0, 1.0], [-0.0] * 9,
              [-2.0, -0.0, -0.0, 3.0], [-1e-9, -0.0, 0.0, 1e-9] * 50):
        # signed zeros: numpy's value with a zero as +0.0, whichever zero its partition left there
        a = np.array(x)
        want = [float(np.median(a))] + [float(np.quantile(a, q)) for q in qs[1:]]
        got = noise.order_stats(a, qs)
        assert np.array(got).tobytes() == (np.array(want) + 0.0).tobytes(), x
        assert all(math.copysign(1.0, v) > 0 for v in got if v == 0.0)
    with pytest.raises(ValueError):
        noise.order_stats(np.zeros(0), (0.5,))


# ----------------------------------------------------------------------------------------------
# Packed slots measure each other where no catalog state was measured


def _slot(label, depth, k, dtypes=("float32", "bfloat16")):
    """A slot whose every figure is k x the physical default at its depth, its worst token 1.5x
    its 99th percentile."""
    p = noise.physical_default(*dtypes, depth)
    lv = Level(p.q50 * k, p.q99 * k, p.c99 * k * k, p.sd * k)
    return (label, float(depth), lv, 1.5 * lv.q99, 2.25 * lv.c99)


def test_the_shallowest_slot_has_the_default_and_deeper_ones_its_excess():
    m = noise.fit_slots(fit("float32", "bfloat16", []), [_slot("layer3", 3, 2.0), _slot("layer1", 1, 2.0)])
    assert [s.label for s in m.slots] == ["layer1", "layer3"] and all(s.clean for s in m.slots)
    p1, p3 = noise.physical_default("float32", "bfloat16", 1), noise.physical_default("float32", "bfloat16", 3)
    assert m.expected(1) == p1 and m.slots[0].expected is None   # nothing before it: the default
    assert m.expected(3).q50 == pytest.approx(2 * p3.q50) and m.expected(3).q99 == pytest.approx(2 * p3.q99)
    assert not m.measured and m.source == "default for fp32 vs bf16 scaled to the slots before it"


def test_a_slot_under_the_default_never_lowers_it():
    m = noise.fit_slots(fit("float32", "bfloat16", []), [_slot("layer1", 1, 0.3), _slot("layer3", 3, 0.3)])
    assert m.expected(3) == noise.physical_default("float32", "bfloat16", 3)
    assert m.source == "default for fp32 vs bf16, not measured"


def test_a_slot_out_of_its_expectation_measures_nothing_and_nor_does_any_after_it():
    # layer1 at 4x the default (past LEVEL x the default): it is a divergence, so neither it nor the
    # slots after it (which inherit its error) scale anything
    m = noise.fit_slots(fit("float32", "bfloat16", []),
                        [_slot("layer1", 1, 4.0), _slot("layer2", 2, 4.0), _slot("layer3", 3, 4.0)])
    assert [s.clean for s in m.slots] == [False, False, False]
    assert m.expected(3) == noise.physical_default("float32", "bfloat16", 3)


def test_a_deeper_slot_never_sets_the_allowance_of_a_shallower_one():
    honest = noise.fit_slots(fit("float32", "bfloat16", []), [_slot("layer1", 1, 2.0), _slot("layer3", 3, 2.0)])
    bug = noise.fit_slots(fit("float32", "bfloat16", []), [_slot("layer1", 1, 2.0), _slot("layer3", 3, 8.0)])
    assert not bug.slots[1].clean
    for d in (0, 1, 2, 3):
        assert bug.expected(d) == honest.expected(d)


def test_a_worst_token_past_the_tolerance_keeps_a_slot_from_measuring():
    label, depth, lv, _, worst_c = _slot("layer1", 1, 2.0)
    m = noise.fit_slots(fit("float32", "bfloat16", []),
                        [(label, depth, lv, 5 * noise.TOKEN * lv.q99, worst_c), _slot("layer3", 3, 2.0)])
    assert not m.slots[0].clean and m.expected(3) == noise.physical_default("float32", "bfloat16", 3)


def test_a_measured_catalog_rules_over_the_slots():
    m = noise.fit_slots(fit("float32", "bfloat16", _states([_lv(x) for x in TRAINED])),
                        [_slot("layer1", 1, 2.0), _slot("layer3", 3, 2.0)])
    assert m.slot_expected(3) is None and m.source == "measured trend"


# ----------------------------------------------------------------------------------------------
# A measured trend rules under the physical default; the default where nothing measured the pair

U32 = 2.0 ** -24
# fp32 eager vs SDPA attention on the trained test model (median rel err per boundary, measured):
# one to four roundings, where the fp32 default allows FP32_REDUCTION x 0.8 sqrt(1 + 8 d) of them
PORT32 = [0.0, 1.12e-07, 1.19e-07, 1.51e-07, 1.62e-07, 1.70e-07, 2.05e-07, 2.29e-07, 2.44e-07]


def _n(lv, n=480):
    return Level(lv.q50, lv.q99, lv.c99, lv.sd, lv.bias, n)


def _port(levels, n=480, dtypes=None):
    return fit("float32", "float32", _states([_n(_lv(x), n) for x in levels]), dtypes)


def test_an_fp32_port_trend_rules_under_the_default_and_a_jump_past_it_leaves():
    m = _port(PORT32)
    assert all(s.clean for s in m.states) and m.source == "measured trend"
    p5 = noise.physical_default("float32", "float32", 5)
    assert m.expected(5).q50 < p5.q50 / 5 and m.expected(5).q50 >= noise.one_rounding("float32", "float32", 0).q50
    # layer4 at 8x the port's noise there (a perturbed weight of layer 3): under the default, off the trend
    lv = list(PORT32)
    lv[4:] = [8 * x for x in PORT32[4:]]
    m = _port(lv)
    assert m.first_jump is not None and m.first_jump.label == "layer4" and m.first_jump.why == "level"
    assert 8 * PORT32[4] < p5.q50   # the default alone would have let it pass


def test_the_default_rules_where_nothing_before_measured_the_pair():
    p = noise.physical_default("float32", "float32", 4)
    # bit for bit equal before it (every median 0): a layer that computes differently may add any
    # rounding; the default, not one rounding, is its allowance
    m = _port([0.0, 0.0, 0.0, 0.0, 8 * PORT32[4], 8 * PORT32[5]])
    assert all(s.clean for s in m.states) and m.expected(4).q50 >= noise.physical_default("float32", "float32", 0).q50
    # levels of few tokens: their medians wobble past JUMP
    m = _port(PORT32[:4] + [8 * PORT32[4]], n=noise.TREND_TOKENS - 1)
    assert m.first_jump is None and m.states[4].predicted >= p.q50
    # another dtype pair before it (the states before computed in bf16 under autocast): says
    # nothing of a float32 state's noise
    dts = {f"layer{b}": ("bfloat16", "bfloat16") for b in range(1, 4)}
    m = _port(PORT32[:4] + [8 * PORT32[4]], dtypes=dts)
    assert m.first_jump is None and m.states[4].predicted >= p.q50
    # the first computed state has only the embedding (a lookup) before it
    m = _port([0.0, 20 * PORT32[1]])
    assert m.first_jump is None


def test_the_floor_under_a_trend_is_never_above_the_default_first_rounding():
    for da, db in (("bfloat16", "bfloat16"), ("float32", "bfloat16"), ("float16", "float32"), ("float32", "float32")):
        m = fit(da, db, _states([_n(_lv(x)) for x in [0.0, 1e-9, 1e-9, 1e-9]]))
        p0 = noise.physical_default(da, db, 0)
        for d in (1, 3, 8):
            e = m.expected(d)
            assert e.q50 <= max(p0.q50, 1e-9 * 1.5 ** 8) and e.q99 <= max(p0.q99, 2e-9 * 1.5 ** 8), (da, db, d)


def test_packed_slots_that_measured_the_pair_rule_under_the_default():
    # fp32 port, no catalog: slot layer1 measured at a tenth of the default; layer3 expects that,
    # grown along the default, never under one rounding
    p1, p3 = noise.physical_default("float32", "float32", 1), noise.physical_default("float32", "float32", 3)
    lv1 = _n(Level(p1.q50 / 10, p1.q99 / 10, p1.c99 / 100, p1.sd / 10))
    honest = _n(Level(p3.q50 / 10, p3.q99 / 10, p3.c99 / 100, p3.sd / 10))
    m = noise.fit_slots(fit("float32", "float32", []), [("layer1", 1.0, lv1, 1.5 * lv1.q99, 0.0),
                                                        ("layer3", 3.0, honest, 1.5 * honest.q99, 0.0)])
    assert all(s.clean for s in m.slots) and m.expected(3).q50 == pytest.approx(p3.q50 / 10)
    assert m.source == "default for fp32 vs fp32 scaled to the slots before it"
    bug = _n(Level(p3.q50 / 2, p3.q99 / 2, p3.c99 / 4, p3.sd / 2))   # 5x the honest slot, half the default
    m = noise.fit_slots(fit("float32", "float32", []), [("layer1", 1.0, lv1, 1.5 * lv1.q99, 0.0),
                                                        ("layer3", 3.0, bug, 1.5 * bug.q99, 0.0)])
    assert not m.slots[1].clean
    # measured on few tokens, the slot before keeps the default
    few = Level(*[getattr(lv1, f) for f in ("q50", "q99", "c99", "sd", "bias")], noise.TREND_TOKENS - 1)
    m = noise.fit_slots(fit("float32", "float32", []), [("layer1", 1.0, few, 1.5 * few.q99, 0.0),
                                                        ("layer3", 3.0, bug, 1.5 * bug.q99, 0.0)])
    assert m.slots[1].clean and m.expected(3) == p3
