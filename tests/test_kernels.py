"""The compiled kernel (tensordiff/_kernels.c): float64 sums of stored rows, the same bits on the
AVX2 and the portable path, exact against a float64 reference, strict about the buffers it takes;
its numpy versions (tensordiff.kernels, an install without a C compiler) give the same bits; an
install without a C compiler succeeds and says once that it runs on numpy."""

from __future__ import annotations

import numpy as np
import pytest

from tensordiff import _kernels, kernels
from tensordiff.dtypes import f32_to_bf16_bits, to_float32

KINDS = {0: "float32", 1: "bfloat16"}


def stored(x: np.ndarray, kind: int) -> np.ndarray:
    return f32_to_bf16_bits(x) if kind == 1 else x


def _runs(level: str) -> bool:
    was = _kernels.simd()
    try:
        _kernels.simd(level)
        return True
    except ValueError:
        return False
    finally:
        _kernels.simd(was)


#: the vector code paths this CPU runs (each must give the portable path's bits)
LEVELS = [lv for lv in ("avx2", "avx512") if _runs(lv)]


def sums(a, ka, b, kb, k, w, *, simd: bool | str):
    was = _kernels.simd(simd)
    try:
        n = a.shape[0]
        out = [np.zeros((n, k)), np.zeros((n, k)), np.zeros((n, k)), np.zeros((n, k), np.float32)]
        _kernels.row_sums(a, ka, b, kb, k, w, *out)
    finally:
        _kernels.simd(was)
    return out


@pytest.fixture(scope="module")
def rng():
    return np.random.default_rng(7)


def test_the_best_code_path_is_the_default_and_a_bad_one_is_refused():
    assert _kernels.simd() == (LEVELS[-1] if LEVELS else "portable")
    assert _kernels.simd(True) == _kernels.simd()   # True: the best this CPU runs
    with pytest.raises(ValueError, match="code path"):
        _kernels.simd("avx1024")


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("ka,kb", [(0, 0), (1, 1), (0, 1), (1, 0)])
@pytest.mark.parametrize("n,k,w,extra", [(64, 1, 4096, 0), (30, 3, 37, 5), (20, 2, 7, 0), (9, 4, 8, 3), (5, 1, 0, 2)])
def test_simd_and_portable_give_the_same_bits(rng, level, ka, kb, n, k, w, extra):
    x = (rng.standard_normal((n, k * w + extra)) * rng.lognormal(0, 3, (n, 1))).astype(np.float32)
    y = (x + 1e-3 * rng.standard_normal(x.shape)).astype(np.float32)
    if x.size:
        x.flat[0], y.flat[-1] = np.nan, np.inf
        x.flat[min(3, x.size - 1)], y.flat[min(3, x.size - 1)] = -0.0, 0.0
    a, b = stored(x, ka), stored(y, kb)
    fast, port = sums(a, ka, b, kb, k, w, simd=level), sums(a, ka, b, kb, k, w, simd=False)
    for p, q in zip(fast, port):
        assert np.array_equal(p.view(np.uint8), q.view(np.uint8))   # every bit, NaN payloads and signs too


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


# -- the numpy path (tensordiff.kernels without the extension) ---------------------------------


@pytest.mark.parametrize("ka,kb", [(0, 0), (1, 1), (0, 1), (1, 0)])
@pytest.mark.parametrize("n,k,w,extra", [(64, 1, 4096, 0), (30, 3, 37, 5), (20, 2, 7, 0), (9, 4, 8, 3), (5, 1, 0, 2)])
def test_numpy_row_sums_give_the_compiled_bits(rng, ka, kb, n, k, w, extra):
    x = (rng.standard_normal((n, k * w + extra)) * rng.lognormal(0, 3, (n, 1))).astype(np.float32)
    y = (x + 1e-3 * rng.standard_normal(x.shape)).astype(np.float32)
    if x.size:
        x.flat[0], y.flat[-1], x.flat[x.size // 2] = np.nan, np.inf, 3e38
    a, b = stored(x, ka), stored(y, kb)
    compiled = sums(a, ka, b, kb, k, w, simd=True)
    out = [np.zeros((n, k)), np.zeros((n, k)), np.zeros((n, k)), np.zeros((n, k), np.float32)]
    kernels._np_row_sums(a[1:], ka, b[1:], kb, k, w, *[o[1:] for o in out])   # a view with a row stride
    kernels._np_row_sums(a[:1], ka, b[:1], kb, k, w, *[o[:1] for o in out])
    for p, q in zip(compiled, out):
        assert p.dtype == q.dtype and np.array_equal(p, q, equal_nan=True)


@pytest.mark.parametrize("w", [1, 7, 8, 1000, 8193])
@pytest.mark.parametrize("dx,dc", [(np.float32, np.float32), (np.float32, np.float64), (np.float64, np.float64)])
def test_numpy_row_dots_give_the_compiled_bits(rng, w, dx, dc):
    x = (rng.standard_normal((40, w)) * rng.lognormal(0, 4, (40, 1))).astype(dx)
    c = rng.standard_normal((40, w)).astype(dc)
    x[0, 0] = -0.0
    c[1, :] = -0.0
    x[2], c[2] = np.abs(x[2]), -0.0     # products of -0.0 alone: the sum is +0.0
    want, got = np.empty(40), np.empty(40)
    _kernels.row_dots(x, c, want)
    kernels._np_row_dots(x, c, got)
    assert np.array_equal(want.view(np.uint64), got.view(np.uint64))


def _as_kind(x: np.ndarray, kind: int) -> np.ndarray:
    return f32_to_bf16_bits(x) if kind == 1 else x.astype(np.float64) if kind == 2 else x


def _as_f64(x: np.ndarray, kind: int) -> np.ndarray:
    return to_float32(x, "bfloat16").astype(np.float64) if kind == 1 else x.astype(np.float64)


@pytest.mark.parametrize("w", [1, 7, 8, 1000, 8193])
@pytest.mark.parametrize("kx,kc", [(0, 0), (0, 1), (1, 1), (1, 0), (0, 2), (2, 1), (2, 2)])
def test_row_dots_at_gives_row_dots_bits_on_every_path(rng, w, kx, kc):
    """Rows picked by index where they lie, of any stored kind, sum as row_dots sums the gathered
    rows converted to float64 (exact): the identity search scores mapped bfloat16 rows in place."""
    x = _as_kind((rng.standard_normal((30, w)) * rng.lognormal(0, 4, (30, 1))).astype(np.float32), kx)
    c = _as_kind(rng.standard_normal((50, w)).astype(np.float32), kc)
    xi = rng.integers(0, 30, 45)
    ci = np.concatenate([rng.permutation(50)[:40], [0, 0, 49, 7, 7]])   # unsorted, repeated
    want = np.empty(45)
    _kernels.row_dots(_as_f64(x, kx)[xi], _as_f64(c, kc)[ci], want)
    outs = []
    for level in ["portable"] + LEVELS:
        was = _kernels.simd(level)
        try:
            got = np.empty(45)
            _kernels.row_dots_at(x, kx, xi, c, kc, ci, got)
            outs.append(got)
        finally:
            _kernels.simd(was)
    got = np.empty(45)
    kernels._np_row_dots_at(x, kx, xi, c, kc, ci, got)
    outs.append(got)
    for got in outs:
        assert np.array_equal(want.view(np.uint64), got.view(np.uint64))
    ref = np.empty(30)
    _kernels.row_dots(_as_f64(x, kx), _as_f64(x, kx), ref)
    norms = np.empty(45)
    _kernels.row_dots(_as_f64(c, kc)[ci], _as_f64(c, kc)[ci], norms)
    for level in ["portable"] + LEVELS:   # a row against itself: its squares, read once
        was = _kernels.simd(level)
        try:
            every = np.empty(30)   # no index: every row in order
            _kernels.row_dots_at(x, kx, None, x, kx, None, every)
            assert np.array_equal(every.view(np.uint64), ref.view(np.uint64))
            got = np.empty(45)
            _kernels.row_dots_at(c, kc, ci, c, kc, ci, got)
            assert np.array_equal(got.view(np.uint64), norms.view(np.uint64))
        finally:
            _kernels.simd(was)


def test_row_dots_at_checks_every_index_and_buffer():
    x = np.zeros((4, 8), np.float32)
    c = np.zeros((6, 8), np.uint16)
    out = np.zeros(3)
    ok = np.array([0, 1, 2])
    for xi, ci, err in ((np.array([0, 4, 1]), ok, IndexError), (ok, np.array([0, -1, 2]), IndexError),
                        (ok, np.array([0, 6, 2]), IndexError), (ok.astype(np.int32), ok, ValueError),
                        (ok, np.array([0, 1]), ValueError)):
        with pytest.raises(err):
            _kernels.row_dots_at(x, 0, xi, c, 1, ci, out)
        with pytest.raises(err):
            kernels._np_row_dots_at(x, 0, xi, c, 1, ci, out)
    with pytest.raises(ValueError):
        _kernels.row_dots_at(x, 0, ok, c, 0, ok, out)       # kind 0 is float32, c is uint16 bits
    with pytest.raises(ValueError):
        _kernels.row_dots_at(x, 3, ok, c, 1, ok, out)       # no kind 3
    with pytest.raises(ValueError):
        _kernels.row_dots_at(x, 0, ok, c[:, :4], 1, ok, out)   # widths differ
    with pytest.raises(ValueError):
        _kernels.row_dots_at(x, 0, ok, c, 1, ok, np.zeros(4))   # out of another length


def test_numpy_topk_ranks_as_the_compiled_one(rng):
    base = [1.0, 3.0, 3.0, 2.0, 3.0, np.nan, 0.0, np.nan, -np.inf, np.inf, -0.0, 0.0, -np.inf]
    rows = [base, [np.nan] * 13, [5.0] * 13, [-np.inf] * 13, [-0.0, 0.0] * 6 + [0.0]]
    for x in (np.array(rows, np.float32), rng.integers(0, 4, (6, 1000)).astype(np.float32),
              rng.standard_normal((5, 3000)).astype(np.float32)):
        for k in (1, 4, 13):
            v, i = ktopk(x, k)
            nv, ni = np.full_like(v, 7.0), np.full_like(i, -1)
            kernels._np_topk(x, k, nv, ni)
            assert same_bits(v, nv) and np.array_equal(i, ni), k


def test_use_numpy_switches_the_sums(rng):
    from tensordiff.numerics import row_dots

    x = rng.standard_normal((3, 20)).astype(np.float32)
    was = kernels.use_numpy(True)
    try:
        assert not kernels.compiled()
        numpy_sums = row_dots(x, x)
    finally:
        kernels.use_numpy(was)
    assert kernels.compiled() and np.array_equal(row_dots(x, x), numpy_sums)


def test_an_install_without_a_c_compiler_works_on_numpy(tmp_path):
    """setup.py builds the extension as optional: with no working compiler the build succeeds
    without it; tensordiff then diffs on the numpy path, says so once on stderr, and its --json is
    the compiled path's, byte for byte."""
    import os
    import shutil
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    shutil.copy(os.path.join(repo, "setup.py"), tmp_path)
    shutil.copy(os.path.join(repo, "pyproject.toml"), tmp_path)
    shutil.copy(os.path.join(repo, "README.md"), tmp_path)
    shutil.copytree(os.path.join(repo, "tensordiff"), tmp_path / "tensordiff",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    env = dict(os.environ, CC="false", PYTHONPATH=str(tmp_path))
    r = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert not list((tmp_path / "tensordiff").glob("_kernels*.so"))
    # the shared venv's editable install would still find a built extension elsewhere: the run
    # "without it" hides tensordiff._kernels from the import system instead
    a, b = os.path.join(repo, "traces", "train.h5"), os.path.join(repo, "traces", "serve.h5")
    run = ("import sys\n{hide}from tensordiff.cli import main\n"
           f"sys.exit(main(['diff', {a!r}, {b!r}, '--json']))\n")
    env = dict(os.environ, PYTHONPATH=repo)
    env.pop("TENSORDIFF_NUMPY_KERNELS", None)
    bare = subprocess.run([sys.executable, "-c", run.format(hide="sys.modules['tensordiff._kernels'] = None\n")],
                          cwd=repo, env=env, capture_output=True, text=True, timeout=300)
    built = subprocess.run([sys.executable, "-c", run.format(hide="")], cwd=repo, env=env, capture_output=True,
                           text=True, timeout=300)
    assert bare.returncode == built.returncode and bare.returncode in (0, 1), bare.stderr[-2000:]
    assert bare.stdout == built.stdout
    notes = [ln for ln in bare.stderr.splitlines() if "compiled kernels are not built" in ln]
    assert len(notes) == 1 and "compiled kernels" not in built.stderr, bare.stderr


# -- topk: the recorders' top-k of float32 rows -------------------------------------------------


def topk_ref(x: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The order topk promises: NaN first, then by value, ties (0.0 == -0.0) by the lower index."""
    vals, idx = [], []
    for row in x:
        key = np.where(np.isnan(row), -np.inf, -row.astype(np.float64))  # NaN above +inf
        nan_first = ~np.isnan(row)  # False (NaN) sorts first
        order = np.lexsort((np.arange(len(row)), key, nan_first))[:k]
        vals.append(row[order])
        idx.append(order)
    return np.array(vals, np.float32).reshape(len(x), k), np.array(idx, np.int64).reshape(len(x), k)


def ktopk(x: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    v = np.full((x.shape[0], k), 7.0, np.float32)
    i = np.full((x.shape[0], k), -1, np.int64)
    _kernels.topk(x, k, v, i)
    return v, i


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.mark.parametrize("n,V,k", [(24, 1024, 20), (8, 4, 4), (3, 17, 5), (5, 33, 1), (2, 16, 16), (4, 5000, 20),
                                   (1, 1, 1)])
def test_topk_order_values_and_indices(rng, n, V, k):
    x = rng.standard_normal((n, V)).astype(np.float32)
    v, i = ktopk(x, k)
    rv, ri = topk_ref(x, k)
    assert same_bits(v, rv) and np.array_equal(i, ri)
    assert np.array_equal(x[np.arange(n)[:, None], i].view(np.uint32), v.view(np.uint32))  # copied, not computed


def test_topk_ties_nan_inf_and_signed_zeros(rng):
    """Ties by the lower index (the argmax's pick), NaN above +inf, +inf above numbers, -inf
    last, 0.0 and -0.0 equal (each keeps its own bits), rows of all-equal and all-NaN values."""
    base = [1.0, 3.0, 3.0, 2.0, 3.0, np.nan, 0.0, np.nan, -np.inf, np.inf, -0.0, 0.0, -np.inf]
    rows = [base, [np.nan] * 13, [5.0] * 13, [-np.inf] * 13, [-0.0, 0.0] * 6 + [0.0]]
    x = np.array(rows, np.float32)
    for k in (1, 4, 13):
        v, i = ktopk(x, k)
        rv, ri = topk_ref(x, k)
        assert same_bits(v, rv) and np.array_equal(i, ri), k
    v, i = ktopk(x[:1], 6)
    assert i.tolist() == [[5, 7, 9, 1, 2, 4]]
    # integer-valued rows: ties everywhere, including across the 16-element blocks the scan skips
    x = rng.integers(0, 4, (6, 1000)).astype(np.float32)
    v, i = ktopk(x, 20)
    rv, ri = topk_ref(x, 20)
    assert same_bits(v, rv) and np.array_equal(i, ri)
    assert (i[:, 0] == np.argmax(x, axis=1)).all()


def test_topk_worst_case_ascending_rows_and_late_nans(rng):
    """Every element enters the top-k (ascending rows), and a NaN after the scan has started
    skipping blocks is still found."""
    x = np.sort(rng.standard_normal((3, 3000)).astype(np.float32), axis=1)
    x[1, 2999] = np.nan
    x[2, 1777] = np.nan
    v, i = ktopk(x, 20)
    rv, ri = topk_ref(x, 20)
    assert same_bits(v, rv) and np.array_equal(i, ri)


@pytest.mark.parametrize("V,k", [(1024, 20), (1000, 20), (320, 20), (319, 20), (321, 20), (48, 3), (17, 1),
                                 (16, 1), (33, 2), (4096, 64), (130, 8)])
def test_topk_two_pass_rows_equal_the_single_scan_at_the_threshold(rng, V, k):
    """Rows without NaN and with at least k blocks of 16 take two passes (block maxima, then only
    the blocks that reach the k-th largest of them): ties at that threshold, in the blocks it
    skips and in the last partial block, signed zeros, infinities and constant rows must rank
    exactly as the single scan ranks them (topk_ref)."""
    rows = [rng.standard_normal(V), np.sort(rng.standard_normal(V)), np.sort(rng.standard_normal(V))[::-1],
            rng.integers(0, 3, V), rng.integers(-2, 2, V) * 0.0, np.full(V, -np.inf), np.full(V, 2.5),
            np.where(rng.random(V) < 0.5, np.inf, -np.inf), rng.standard_normal(V) * 1e-30]
    peaks = rng.standard_normal(V)
    peaks[rng.choice(V, min(V, 3 * k), replace=False)] = 4.0  # more equal best values than k, anywhere
    rows.append(peaks)
    tail = rng.standard_normal(V)
    tail[-(V % 16 or 16):] = 9.0  # the best values all in the last (maybe partial) block
    rows.append(tail)
    x = np.array(rows, np.float32)
    x[4] = np.where(rng.random(V) < 0.5, np.float32(-0.0), np.float32(0.0))
    v, i = ktopk(x, k)
    rv, ri = topk_ref(x, k)
    assert same_bits(v, rv) and np.array_equal(i, ri)
    for trial in range(30):  # random rows with few distinct values: many ties around the threshold
        y = (rng.integers(0, 1 + trial, (4, V)) - trial / 2).astype(np.float32)
        v, i = ktopk(y, k)
        rv, ri = topk_ref(y, k)
        assert same_bits(v, rv) and np.array_equal(i, ri), trial


def test_topk_a_nan_anywhere_in_a_two_pass_row_is_ranked_first(rng):
    """A row holding NaN ranks NaN first whichever block holds it (the block maxima cannot order
    it, so that row takes the single scan)."""
    for at in (0, 15, 16, 500, 1023):
        x = rng.standard_normal((3, 1024)).astype(np.float32)
        x[1, at] = np.nan
        v, i = ktopk(x, 20)
        rv, ri = topk_ref(x, 20)
        assert same_bits(v, rv) and np.array_equal(i, ri), at
        assert i[1, 0] == at


def test_topk_reads_rows_with_a_stride_and_is_strict_about_its_buffers(rng):
    full = rng.standard_normal((6, 130)).astype(np.float32)
    x = full[:, :100]  # a padded vocabulary: rows 130 apart, elements contiguous
    v, i = ktopk(x, 10)
    rv, ri = topk_ref(np.ascontiguousarray(x), 10)
    assert same_bits(v, rv) and np.array_equal(i, ri)
    v = np.empty((6, 10), np.float32)
    i = np.empty((6, 10), np.int64)
    with pytest.raises(ValueError):
        _kernels.topk(x, 0, v[:, :0], i[:, :0])  # k < 1
    with pytest.raises(ValueError):
        _kernels.topk(x, 101, v, i)  # k > V
    with pytest.raises(ValueError):
        _kernels.topk(x.astype(np.float64), 10, v, i)  # float64 rows
    with pytest.raises(ValueError):
        _kernels.topk(full[:, ::2], 10, v, i)  # elements not contiguous
    with pytest.raises(ValueError):
        _kernels.topk(x, 10, np.empty((6, 9), np.float32), i)  # vals the wrong shape
    with pytest.raises(ValueError):
        _kernels.topk(x, 10, v, np.empty((6, 10), np.int32))  # idx not int64


# -- Rows, put_rows, put_tokens: the trace writer's appends -------------------------------------


def _snapshot(*rows_and_bufs):
    return [(r.fill, r.dirty, b.copy()) for r, b in rows_and_bufs]


def _same_state(a, b) -> bool:
    return all(x[0] == y[0] and x[1] == y[1] and np.array_equal(x[2], y[2]) for x, y in zip(a, b))


def test_put_rows_copies_every_buffer_or_none(rng):
    vb = np.zeros((8, 5), np.uint16)
    rb = np.zeros((8, 2), np.float32)
    ib = np.zeros(8, np.int64)
    V, R, X = _kernels.Rows(vb), _kernels.Rows(rb), _kernels.Rows(ib)
    vals = rng.integers(0, 2**16, (3, 5)).astype(np.uint16)
    rms = rng.standard_normal((3, 2)).astype(np.float32)
    idx = np.array([4, 0, 9], np.int64)
    assert _kernels.put_rows(10, X, idx, V, vals, R, rms) is True
    assert (V.fill, R.fill, X.fill) == (3, 3, 3) and V.dirty and R.dirty and X.dirty
    assert np.array_equal(vb[:3], vals) and np.array_equal(rb[:3], rms) and np.array_equal(ib[:3], idx)
    before = _snapshot((V, vb), (R, rb), (X, ib))
    refused = [
        (10, idx, vals, rms[:, :1]),                  # rms of the wrong width
        (10, idx, vals.astype(np.int16), rms),        # another element format
        (10, idx, vals.astype(np.float32), rms),      # another element size
        (10, idx, vals[:2], rms),                     # row counts differ
        (10, idx, np.asfortranarray(vals), rms),      # not C-contiguous
        (9, idx, vals, rms),                          # an index past the token table
        (10, np.array([1, -1, 2]), vals, rms),        # a negative index
        (10, idx.astype(np.int32), vals, rms),        # indices not int64
        (10, idx[:0], vals[:0], rms[:0]),             # no rows
        (10, [4, 0, 9], vals, rms),                   # not a buffer
        (10, idx, vals.tolist(), rms),
    ]
    for limit, ix, va, rm in refused:
        assert _kernels.put_rows(limit, X, ix, V, va, R, rm) is False
        assert _same_state(_snapshot((V, vb), (R, rb), (X, ib)), before)
    # room: a call that would fill a buffer is left to the writer (it writes the chunk)
    assert _kernels.put_rows(10, X, idx, V, vals, R, rms) is True       # fill 6 of 8
    assert _kernels.put_rows(10, X, idx[:2], V, vals[:2], R, rms[:2]) is False  # would make 8
    assert _kernels.put_rows(10, X, idx[:1], V, vals[:1], R, rms[:1]) is True   # 7 of 8
    assert V.fill == 7
    V.fill = 0
    V.dirty = False
    assert (V.fill, V.dirty) == (0, False)
    with pytest.raises(ValueError):
        V.fill = 9
    with pytest.raises(TypeError):
        _kernels.put_rows(10, X, idx, "not rows", vals)
    with pytest.raises(TypeError):
        _kernels.put_rows(10, X)
    with pytest.raises(ValueError):
        _kernels.Rows(np.zeros((4, 4), np.float32)[:, ::2])  # not C-contiguous
    with pytest.raises(ValueError):
        _kernels.Rows(np.zeros((0, 4), np.float32))
    with pytest.raises(ValueError):
        _kernels.put_rows(10, X, idx, X, idx)  # the same Rows twice would overflow it
    # a failed re-initialisation leaves a Rows that holds nothing and takes nothing
    again = _kernels.Rows(np.zeros(8, np.int64))
    with pytest.raises(ValueError):
        again.__init__(np.zeros((16, 4), np.int64)[:, ::2])
    assert again.fill == 0 and _kernels.put_rows(10, again, idx) is False
    with pytest.raises(BufferError):
        _kernels.Rows(np.zeros(4, np.float32).tobytes())  # read-only


def test_put_tokens_interleaves_and_keeps_one_run_per_call(rng):
    pairs = np.zeros((6, 2), np.int64)
    runs = np.zeros((6, 4), np.int64)
    P, R = _kernels.Rows(pairs), _kernels.Rows(runs)
    pos = np.array([5, 6, 7], np.int64)
    tok = np.array([50, 60, 70], np.int64)
    assert _kernels.put_tokens(P, R, pos, tok, 2, 1, -9) == 0
    assert _kernels.put_tokens(P, R, pos[:1], tok[:1], 0, 3, 2**31 - 1) == 3
    assert pairs[:4].tolist() == [[5, 50], [6, 60], [7, 70], [5, 50]]
    assert runs[:2].tolist() == [[3, 2, 1, -9], [1, 0, 3, 2**31 - 1]]
    assert (P.fill, R.fill) == (4, 2)
    before = (pairs.copy(), runs.copy())
    for p, t in [(pos[:2], tok[:2]),        # would fill the chunk (4 + 2 = 6)
                 (pos[:1], tok[:2]),        # lengths differ
                 (pos[:0], tok[:0]),        # no rows
                 (pos[:1].astype(np.int32), tok[:1]),
                 (pos[::2], tok[::2]),      # not contiguous
                 ([5], [50])]:
        assert _kernels.put_tokens(P, R, p, t, 0, 0, 0) == -1
        assert np.array_equal(pairs, before[0]) and np.array_equal(runs, before[1]) and (P.fill, R.fill) == (4, 2)
    with pytest.raises(ValueError):
        _kernels.put_tokens(R, P, pos, tok, 0, 0, 0)  # the buffers swapped
    with pytest.raises(ValueError):
        _kernels.put_tokens(P, P, pos, tok, 0, 0, 0)
