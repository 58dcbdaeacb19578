"""Identity scoring from float32 rows, their float64 copies, or rows scored in place (data[at]):
the same numbers, to the bit, at any width. The sums come from the compiled kernel
(:func:`tensordiff.numerics.row_dots`), which widens every element to float64 itself and fixes
the order of the additions, so neither the input dtype nor the rows around a row change its sum
(einsum, used before, cast float32 rows in buffers of ``np.getbufsize()`` elements and summed
each separately, so rows wider than 8192 had other sums from float64 copies)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tensordiff.dtypes import f32_to_bf16_bits, to_float32
from tensordiff.identity import CandidateRows, SlotStack, clean, row_norms, score, score_many
from tensordiff.numerics import row_dots, row_dots_at
from test_identity_batch import _same, _targets

# every test on the compiled kernels and on their numpy versions (conftest.kernel_path)
pytestmark = pytest.mark.usefixtures("kernel_path")


@pytest.mark.parametrize("w", [1, 2, 3, 7, 8, 9, 100, 1000, 4095, 4096, 8192, 8193, 20000])
def test_float64_rows_sum_as_the_float32_rows(w):
    rng = np.random.default_rng(w)
    for n in (1, 5, 64):
        x = (rng.standard_normal((n, w)) * rng.lognormal(0, 2, (n, 1))).astype(np.float32)
        c = (rng.standard_normal((n, w)) * rng.lognormal(0, 2, (n, 1))).astype(np.float32)
        ref = row_dots(x, c)
        assert np.array_equal(ref, row_dots(x.astype(np.float64), c.astype(np.float64)))
        assert np.array_equal(ref, row_dots(x, c.astype(np.float64)))
        np.testing.assert_allclose(ref, (x.astype(np.float64) * c).sum(axis=1), rtol=1e-12, atol=1e-12)
        # rows at any 8-byte offset in memory (a gather, a slice of a larger buffer), one at a time
        buf = np.empty(n * w + 3, np.float64)
        for off in (1, 3):
            v = buf[off:off + n * w].reshape(n, w)
            v[...] = c
            assert np.array_equal(row_dots(x, v), ref)
        assert np.array_equal(np.concatenate([row_dots(x[i:i + 1], c[i:i + 1]) for i in range(n)]), ref)


def test_row_dots_converts_what_the_kernel_does_not_take():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((6, 40)).astype(np.float32)
    want = row_dots(x, x)
    assert np.array_equal(row_dots(x.astype(np.float16).astype(np.float32), x.astype(np.float16)),
                          row_dots(x.astype(np.float16).astype(np.float32), x.astype(np.float16).astype(np.float32)))
    assert np.array_equal(row_dots(np.asfortranarray(x), x[:, ::-1][:, ::-1]), want)   # strided rows: copied
    assert np.array_equal(row_dots(x.astype(">f4"), x), want)                             # byte-swapped: converted
    with pytest.raises(ValueError, match="differ"):
        row_dots(x, x[:, :39])
    with pytest.raises(ValueError, match=r"\[n, w\]"):
        row_dots(x[0], x[0])


@pytest.mark.parametrize("w", [1, 8, 64, 4096, 8192, 9000])
def test_float64_candidates_score_as_float32_ones(w):
    rng = np.random.default_rng(w + 7)
    n = 80 if w > 1000 else 200
    targets = _targets(rng, n, w, 2)
    c32, c64 = [], []
    for j in range(6):
        ok = rng.random(n) < (1.0 if j % 3 == 0 else 0.8)
        m = int(ok.sum())
        base = targets[j % 2].data[ok]
        data = base.copy() if j == 2 else clean(base + rng.standard_normal((m, w)).astype(np.float32) * 0.03 * (j + 1))
        rms = (targets[j % 2].rms[ok] * rng.uniform(0.7, 1.4, m)).astype(np.float32)
        tol = 3e-2 if j % 2 == 0 else None
        norms = row_norms(data) if j % 2 else None
        c32.append(CandidateRows(f"s{j}", "ab"[j % 2], (0, -1, 1, -2, 2, 0)[j], "values", ok, data, rms, tol, norms))
        c64.append(CandidateRows(f"s{j}", "ab"[j % 2], (0, -1, 1, -2, 2, 0)[j], "values", ok,
                                 data.astype(np.float64), rms, tol, norms))
    stack = SlotStack(targets)
    want = [[score(t, c) for t in targets] for c in c32]
    for group in (list(range(6)), [0], [3, 4], [5, 1, 0, 2], [2, 2]):
        for got_row, j in zip(score_many(stack, [c64[j] for j in group]), group):
            for got, ref in zip(got_row, want[j]):
                _same(got, ref)
    for c, row in zip(c64, want):   # one at a time, as well
        for t, ref in zip(targets, row):
            _same(score(t, c), ref)
    assert any(s.exact_rel < math.inf for s in score_many(stack, [c64[2]])[0])   # the exact path ran


@pytest.mark.parametrize("w", [8, 4096, 9000])
def test_rows_scored_in_place_score_as_gathered_ones(w):
    """A candidate given as data[at] (the catalog's union of rows and each offset's positions in
    it, runs of consecutive rows scored in place) scores as its gathered rows, float32 or float64."""
    rng = np.random.default_rng(w + 11)
    n = 64
    targets = _targets(rng, n, w, 2)
    union = clean(rng.standard_normal((n + 30, w)).astype(np.float32))
    gathered, in_place = [], []
    for j, at in enumerate((np.arange(n), np.arange(3, n + 3), np.sort(rng.choice(n + 30, n, replace=False)),
                            np.concatenate([np.arange(10, 40), np.arange(50, 84)]))):
        ok = np.ones(n, bool)
        if j == 3:
            ok[::5] = False
            at = at[:int(ok.sum())]
        data32 = union[at]
        rms = np.sqrt((data32.astype(np.float64) ** 2).mean(axis=1)).astype(np.float32)
        tol = 3e-2 if j % 2 == 0 else None
        gathered.append(CandidateRows(f"s{j}", "a", j - 1, "values", ok, data32, rms, tol, row_norms(data32)))
        in_place.append(CandidateRows(f"s{j}", "a", j - 1, "values", ok,
                                      union.astype(np.float64) if j % 2 else union, rms, tol, row_norms(union)[at], at))
    stack = SlotStack(targets)
    for got_row, ref_row in zip(score_many(stack, in_place), score_many(SlotStack(targets), gathered)):
        for got, ref in zip(got_row, ref_row):
            _same(got, ref)
    for c, g in zip(in_place, gathered):
        for t in targets:
            _same(score(t, c), score(t, g))


@pytest.mark.parametrize("w", [8, 4096, 9000])
def test_bfloat16_bits_scored_where_they_lie_score_as_their_float32_values(w):
    """A candidate given as its stored bfloat16 bits (a mapped block, rows picked by ``at``, in
    any order) scores as the float32 rows the old path converted and gathered, bit for bit, the
    exact rule included; its rows() are those float32 values."""
    rng = np.random.default_rng(w + 23)
    n = 64
    targets = _targets(rng, n, w, 2)
    span = f32_to_bf16_bits(rng.standard_normal((n + 40, w)).astype(np.float32))
    values = to_float32(span, "bfloat16")
    bits, floats = [], []
    for j, at in enumerate((np.arange(n), np.sort(rng.choice(n + 40, n, replace=False)), rng.permutation(n + 40)[:n])):
        ok = np.ones(n, bool)
        rows32 = values[at]
        rms = np.sqrt((rows32.astype(np.float64) ** 2).mean(axis=1)).astype(np.float32)
        tol = 3e-2 if j != 1 else None
        floats.append(CandidateRows(f"s{j}", "a", j - 1, "values", ok, rows32, rms, tol, row_norms(rows32)))
        norms = np.sqrt(row_dots_at(span, span, xi=at, ci=at, x_bf16=True, c_bf16=True))
        bits.append(CandidateRows(f"s{j}", "a", j - 1, "values", ok, span, rms, tol, norms, at, bf16=True))
        assert np.array_equal(bits[-1].rows(), rows32)
        assert np.array_equal(norms, row_norms(rows32))
    # a target equal to a candidate: the exact rule runs on the converted rows
    targets[0].data[:] = values[np.arange(n)]
    stack = SlotStack(targets)
    for got_row, ref_row in zip(score_many(stack, bits), score_many(SlotStack(targets), floats)):
        for got, ref in zip(got_row, ref_row):
            _same(got, ref)
    assert score_many(stack, bits[:1])[0][0].exact_rel == 0.0
    for c, g in zip(bits, floats):
        for t in targets:
            _same(score(t, c), score(t, g))


def test_row_dots_at_refuses_bfloat16_that_is_not_uint16_bits():
    with pytest.raises(ValueError, match="uint16"):
        row_dots_at(np.zeros((2, 8), np.float32), np.zeros((2, 8), np.float16), c_bf16=True)
