"""The compiled kernel (tensordiff/_kernels.c): float64 sums of stored rows, the same bits on the
AVX2 and the portable path, exact against a float64 reference, strict about the buffers it takes."""

from __future__ import annotations

import numpy as np
import pytest

from tensordiff import _kernels
from tensordiff.dtypes import f32_to_bf16_bits, to_float32

KINDS = {0: "float32", 1: "bfloat16"}


def stored(x: np.ndarray, kind: int) -> np.ndarray:
    return f32_to_bf16_bits(x) if kind == 1 else x


def sums(a, ka, b, kb, k, w, *, simd: bool):
    was = _kernels.simd(simd)
    try:
        n = a.shape[0]
        out = [np.zeros((n, k)), np.zeros((n, k)), np.zeros((n, k)), np.zeros((n, k), np.float32)]
        _kernels.row_sums(a, ka, b, kb, k, w, *out)
    finally:
        _kernels.simd(was == "avx2")
    return out


@pytest.fixture(scope="module")
def rng():
    return np.random.default_rng(7)


@pytest.mark.parametrize("ka,kb", [(0, 0), (1, 1), (0, 1), (1, 0)])
@pytest.mark.parametrize("n,k,w,extra", [(64, 1, 4096, 0), (30, 3, 37, 5), (20, 2, 7, 0), (9, 4, 8, 3), (5, 1, 0, 2)])
def test_simd_and_portable_give_the_same_bits(rng, ka, kb, n, k, w, extra):
    x = (rng.standard_normal((n, k * w + extra)) * rng.lognormal(0, 3, (n, 1))).astype(np.float32)
    y = (x + 1e-3 * rng.standard_normal(x.shape)).astype(np.float32)
    if x.size:
        x.flat[0], y.flat[-1] = np.nan, np.inf
    a, b = stored(x, ka), stored(y, kb)
    fast, port = sums(a, ka, b, kb, k, w, simd=True), sums(a, ka, b, kb, k, w, simd=False)
    for p, q in zip(fast, port):
        assert np.array_equal(p, q, equal_nan=True)


@pytest.mark.parametrize("ka,kb", [(0, 0), (1, 1), (0, 1)])
def test_sums_match_a_float64_reference(rng, ka, kb):
    n, k, w = 50, 2, 1000
    x = (rng.standard_normal((n, k * w)) * rng.lognormal(0, 3, (n, 1))).astype(np.float32)
    y = (x * (1 + 1e-3 * rng.standard_normal(x.shape))).astype(np.float32)
    x[3] = 3e38   # float32 sums would overflow; float64 ones do not
    a, b = stored(x, ka), stored(y, kb)
    aa, bb, dd, mx = sums(a, ka, b, kb, k, w, simd=True)
    u = to_float32(a, KINDS[ka]).astype(np.float64).reshape(n, k, w)
    v = to_float32(b, KINDS[kb]).astype(np.float64).reshape(n, k, w)
    np.testing.assert_allclose(aa, (u * u).sum(2), rtol=1e-14)
    np.testing.assert_allclose(bb, (v * v).sum(2), rtol=1e-14)
    np.testing.assert_allclose(dd, ((u - v) ** 2).sum(2), rtol=1e-13)
    assert np.array_equal(mx, np.abs(u - v).max(2).astype(np.float32))
    assert np.isfinite(aa).all()


def test_rows_with_a_stride_and_a_wider_block(rng):
    """A sub-block is a view [rows, :k*w] of a wider stored block: the row stride is the block's."""
    x = rng.standard_normal((12, 100)).astype(np.float32)
    y = x + np.float32(0.5)
    a, b = f32_to_bf16_bits(x), f32_to_bf16_bits(y)
    view = sums(a[2:9, :64], 1, b[2:9, :64], 1, 2, 32, simd=True)
    copy = sums(np.ascontiguousarray(a[2:9, :64]), 1, np.ascontiguousarray(b[2:9, :64]), 1, 2, 32, simd=True)
    for p, q in zip(view, copy):
        assert np.array_equal(p, q)


def test_bad_buffers_are_refused():
    a = np.zeros((4, 16), np.uint16)
    out = [np.zeros((4, 1)), np.zeros((4, 1)), np.zeros((4, 1)), np.zeros((4, 1), np.float32)]
    with pytest.raises(ValueError, match="contiguous within a row"):
        _kernels.row_sums(a[:, ::2], 1, a[:, :8], 1, 1, 8, *out)           # strided elements
    with pytest.raises(ValueError, match="at least 16 wide"):
        _kernels.row_sums(a[:, :8], 1, a[:, :8], 1, 1, 16, *out)           # narrower than k*w
    with pytest.raises(ValueError, match="2-byte elements"):
        _kernels.row_sums(a.view(np.float32), 1, a, 1, 1, 8, *out)        # kind and itemsize disagree
    with pytest.raises(ValueError, match="different row counts"):
        _kernels.row_sums(a, 1, a[:3], 1, 1, 16, *out)
    with pytest.raises(ValueError, match="C-contiguous"):
        _kernels.row_sums(a, 1, a, 1, 1, 16, np.zeros((4, 2))[:, :1], *out[1:])
    with pytest.raises(ValueError):
        _kernels.row_sums(a, 1, a, 1, 1, 16, np.zeros((4, 1), np.float32), *out[1:])   # float32 for a float64 sum
    with pytest.raises(ValueError, match="kinds"):
        _kernels.row_sums(a, 2, a, 1, 1, 16, *out)
    with pytest.raises(BufferError):
        _kernels.row_sums(a, 1, a, 1, 1, 16, *out[:3], bytes(16))          # a read-only output
