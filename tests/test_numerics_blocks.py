"""BlockMetrics against a float64 reference: every stored dtype pairing (bf16 both sides takes
the paired conversion, a mixed pair the stored order), packed slots, NaN/Inf/overflow rows,
one or two lanes, sub-blocks of a few rows."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from tensordiff.dtypes import f32_to_bf16_bits, to_float32
from tensordiff.numerics import METRIC_FIELDS, BlockMetrics, rows_per_block

# every test on the compiled kernels and on their numpy versions (conftest.kernel_path)
pytestmark = pytest.mark.usefixtures("kernel_path")


def stored(x: np.ndarray, dtype: str) -> np.ndarray:
    return f32_to_bf16_bits(x) if dtype == "bfloat16" else x.astype({"float16": np.float16, "float32": np.float32,
                                                                        "float64": np.float64}[dtype])


def reference(a, da, b, db, k, w):
    x = to_float32(a, da)[:, :k * w].astype(np.float64).reshape(len(a), k, w)
    y = to_float32(b, db)[:, :k * w].astype(np.float64).reshape(len(b), k, w)
    out = {key: np.zeros((len(a), k)) for key in ("cos", "rel", "maxabs", "nonfinite_a", "nonfinite_b")}
    for i in range(len(a)):
        for s in range(k):
            u, v = x[i, s], y[i, s]
            fu, fv = np.isfinite(u), np.isfinite(v)
            out["nonfinite_a"][i, s], out["nonfinite_b"][i, s] = (~fu).sum(), (~fv).sum()
            ok = fu & fv
            u, v = u[ok], v[ok]
            if not ok.any():
                out["cos"][i, s] = out["rel"][i, s] = out["maxabs"][i, s] = np.nan
                continue
            nu, nv, nd = np.sqrt(u @ u), np.sqrt(v @ v), np.sqrt((u - v) @ (u - v))
            out["cos"][i, s] = (u @ v) / (nu * nv) if nu * nv > 0 else (1.0 if nu == nv == 0 else 0.0)
            out["rel"][i, s] = nd / nu if nu > 0 else (np.inf if nd > 0 else 0.0)
            out["maxabs"][i, s] = np.abs(u - v).max() if len(u) else 0.0
    return out


@pytest.mark.parametrize("da,db", [("bfloat16", "bfloat16"), ("float32", "bfloat16"), ("bfloat16", "float16"),
                                   ("float32", "float32"), ("float64", "float32")])
@pytest.mark.parametrize("k,w,extra", [(1, 256, 0), (3, 32, 5), (2, 7, 0)])
@pytest.mark.parametrize("lanes", [1, 2])
def test_block_metrics_match_float64(da, db, k, w, extra, lanes, monkeypatch):
    monkeypatch.setattr(BlockMetrics, "SUB_BYTES", 3 * k * w * 4)   # sub-blocks of 3 rows: many, and a short last one
    rng = np.random.default_rng(k * 100 + w)
    n = 40
    x = (rng.standard_normal((n, k * w + extra)) * rng.lognormal(0, 2, (n, 1))).astype(np.float32)
    y = x + (1e-2 * rng.standard_normal(x.shape)).astype(np.float32)
    y[3] = -x[3]
    x[5, 0], y[6, 1] = np.nan, np.inf
    y[7] = np.nan
    x[8] = y[8] = 0
    big = 6e4 if "float16" in (da, db) else 3e38        # float32 sums overflow: recomputed exactly
    x[9, :w], y[9, :w] = big, big * 0.6   # (cos from |a|^2 + |b|^2 - |a-b|^2 needs comparable norms)
    a, b = stored(x, da), stored(y, db)
    with ThreadPoolExecutor(1) as pool:
        got = BlockMetrics(k, w, pool=pool, lanes=lanes).compute_stored(a, da, b, db)
    ref = reference(a, da, b, db, k, w)
    for key in ("nonfinite_a", "nonfinite_b"):
        assert np.array_equal(getattr(got, key), ref[key]), key
    assert np.array_equal(got.nonfinite, (ref["nonfinite_a"] > 0) | (ref["nonfinite_b"] > 0))
    np.testing.assert_allclose(got.cos, ref["cos"], atol=2e-6, equal_nan=True)
    np.testing.assert_allclose(got.rel, ref["rel"], rtol=1e-4, atol=1e-7, equal_nan=True)
    np.testing.assert_allclose(got.maxabs, ref["maxabs"], rtol=1e-6, equal_nan=True)


def test_lanes_are_bit_identical_to_one_lane():
    """Lanes only share out sub-blocks: the pool backend's one-lane workers give the same bits."""
    rng = np.random.default_rng(0)
    a = f32_to_bf16_bits(rng.standard_normal((1000, 512)).astype(np.float32))
    b = f32_to_bf16_bits(rng.standard_normal((1000, 512)).astype(np.float32))
    one = BlockMetrics(1, 512).compute_stored(a, "bfloat16", b, "bfloat16")
    with ThreadPoolExecutor(3) as pool:
        four = BlockMetrics(1, 512, pool=pool, lanes=4).compute_stored(a, "bfloat16", b, "bfloat16")
    for key in METRIC_FIELDS:
        assert np.array_equal(getattr(one, key), getattr(four, key), equal_nan=True), key


def test_a_slow_lane_takes_fewer_sub_blocks_and_changes_no_bit():
    """Sub-blocks go to whichever lane is free: a lane that stalls (its core taken by the reader
    thread or another process) leaves the rest of the block to the others, and the figures are
    those of one lane."""
    import threading
    import time

    rng = np.random.default_rng(1)
    a = f32_to_bf16_bits(rng.standard_normal((640, 512)).astype(np.float32))
    b = f32_to_bf16_bits(rng.standard_normal((640, 512)).astype(np.float32))
    one = BlockMetrics(1, 512).compute_stored(a, "bfloat16", b, "bfloat16")
    done: dict[str, int] = {}

    class Slow(BlockMetrics):
        SUB_BYTES = 16 * 512 * 4   # 16 rows: 40 sub-blocks

        def _sub_block(self, *args):
            me = threading.current_thread().name
            done[me] = done.get(me, 0) + 1
            if me.startswith("slow"):
                time.sleep(0.02)
            super()._sub_block(*args)

    with ThreadPoolExecutor(1, thread_name_prefix="slow") as pool:
        got = Slow(1, 512, pool=pool, lanes=2).compute_stored(a, "bfloat16", b, "bfloat16")
    for key in METRIC_FIELDS:
        assert np.array_equal(getattr(one, key), getattr(got, key), equal_nan=True), key
    slow = sum(n for t, n in done.items() if t.startswith("slow"))
    assert sum(done.values()) == 40 and 1 <= slow < 20, done


def test_rows_per_block_is_sized_in_bytes():
    assert rows_per_block(8192, 4096) == 1024            # 8 MiB of 4096 bf16 rows
    assert rows_per_block(16, 4096) == 4096              # narrow rows: the row cap
    assert rows_per_block(64 << 20, 4096) == 1           # a row bigger than a block: one row
    assert rows_per_block(8192, 5) == 5


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_equal_rows_have_a_positive_zero_max_abs(dtype):
    """max(max(d), -min(d)) of an all-zero difference can be -0.0; the TUI printed "-0.000"."""
    x = np.random.default_rng(3).standard_normal((50, 64)).astype(np.float32)
    a = stored(x, dtype)
    m = BlockMetrics(1, 64).compute_stored(a, dtype, a.copy(), dtype)
    assert (m.maxabs == 0).all() and not np.signbit(m.maxabs).any()
