"""Rows read straight from the file (RowReads._direct_rows, os.preadv at the chunks' byte
offsets) are the bytes h5py reads, and only datasets fit for it take that path: compressed
ones, sparse chunks and patched views go through h5py."""

from __future__ import annotations

import os

import h5py
import numpy as np
import pytest

from tensordiff.dtypes import f32_to_bf16_bits
from tensordiff.trace import TraceReader, TraceWriter
from tensordiff.trace.reads import RowReads


def write(path, compression=None, rows=1000, width=96):
    rng = np.random.default_rng(0)
    with TraceWriter(path, side="train", model={"num_layers": 2, "hidden_size": width},
                     compression=compression) as w:
        w.define_tensor("layer0", width, kind="boundary", boundary=0, dtype="bfloat16", sketch=False)
        w.define_tensor("layer1", width, kind="boundary", boundary=1, dtype="float32", sketch=False)
        r = w.add_tokens("s0", np.arange(rows), rng.integers(3, 1000, rows), "train")
        for i in range(0, rows, 7):   # many small appends: chunks filled in pieces
            x = rng.standard_normal((min(7, rows - i), width)).astype(np.float32)
            w.append("layer0", r[i:i + 7], f32_to_bf16_bits(x))
            w.append("layer1", r[i:i + 7], x)
    return path


@pytest.mark.parametrize("name", ["layer0", "layer1"])
def test_direct_rows_are_the_bytes_h5py_reads(tmp_path, name):
    p = write(str(tmp_path / "t.h5"))
    with TraceReader(p) as r:
        ds = r._ds[name]["values"]
        rows = ds.shape[0]
        rng = np.random.default_rng(1)
        spans = [(0, rows), (0, 1), (rows - 1, rows)] + [tuple(sorted(rng.integers(0, rows, 2))) for _ in range(40)]
        for lo, hi in spans:
            if hi <= lo:
                continue
            got = np.empty((hi - lo,) + ds.shape[1:], ds.dtype)
            assert r._direct_rows(ds, int(lo), int(hi), got), (lo, hi)
            assert np.array_equal(got, ds[lo:hi]), (lo, hi)
            out = np.empty((rows,) + ds.shape[1:], ds.dtype)
            assert np.array_equal(r.read_at(name, "values", np.arange(lo, hi), out=out), ds[lo:hi])


def test_compressed_datasets_go_through_h5py(tmp_path):
    p = write(str(tmp_path / "z.h5"), compression="gzip")
    with TraceReader(p) as r:
        ds = r._ds["layer0"]["values"]
        buf = np.empty((10,) + ds.shape[1:], ds.dtype)
        assert not r._direct_rows(ds, 0, 10, buf)
        assert np.array_equal(r.read_at("layer0", "values", np.arange(0, 10), out=buf), ds[0:10])


def test_unallocated_chunk_goes_through_h5py(tmp_path):
    """A chunk never written (HDF5 gives its fill value) has no byte offset: h5py reads it."""
    p = str(tmp_path / "sparse.h5")
    with h5py.File(p, "w") as f:
        ds = f.create_dataset("v", shape=(12, 8), chunks=(4, 8), dtype="<u2")
        ds[0:4] = 1
        ds[8:12] = 3   # rows 4..7: a chunk never written
    r = RowReads.__new__(RowReads)
    r._reset_reads()
    r.f = h5py.File(p, "r")
    r.file_size = os.path.getsize(p)
    try:
        ds = r.f["v"]
        buf = np.empty((12, 8), np.uint16)
        assert not r._direct_rows(ds, 0, 12, buf)
        assert r._direct_rows(ds, 8, 12, buf[:4]) and (buf[:4] == 3).all()
    finally:
        r.f.close()


def _count_preadv(monkeypatch):
    """Bytes and calls of every os.preadv the reader makes."""
    seen = {"bytes": 0, "calls": 0}
    real = os.preadv

    def counted(fd, bufs, offset, *rest):
        n = real(fd, bufs, offset, *rest)
        seen["bytes"] += n
        seen["calls"] += 1
        return n

    monkeypatch.setattr(os, "preadv", counted)
    return seen


@pytest.mark.parametrize("name", ["layer0", "layer1"])
def test_runs_of_rows_read_only_their_rows(tmp_path, monkeypatch, name):
    """A sample made of a few runs of consecutive rows (the noise model's, an identity search's)
    reads those rows straight into the result, not the whole span between them."""
    p = write(str(tmp_path / "t.h5"), rows=4000, width=512)
    with TraceReader(p) as r:
        ds = r._ds[name]["values"]
        row_bytes = ds.dtype.itemsize * ds.shape[1]
        full = ds[()]
        idx = np.concatenate([np.arange(s, s + 64) for s in (0, 900, 1700, 2900, 3936)])
        seen = _count_preadv(monkeypatch)
        got = r.read_at(name, "values", idx)
        assert np.array_equal(got, full[idx])
        assert seen["bytes"] == len(idx) * row_bytes   # the rows asked for, nothing between them
        out = np.empty((len(idx) + 10,) + ds.shape[1:], ds.dtype)
        got = r.read_at(name, "values", idx, out=out)
        assert np.array_equal(got, full[idx]) and np.shares_memory(got, out)


def test_runs_in_any_order_and_repeats_still_read_right(tmp_path):
    p = write(str(tmp_path / "t.h5"), rows=3000, width=256)
    with TraceReader(p) as r:
        full = r._ds["layer0"]["values"][()]
        rng = np.random.default_rng(3)
        for _ in range(30):
            parts = [np.arange(s, s + int(rng.integers(1, 200))) for s in rng.integers(0, 2800, int(rng.integers(1, 9)))]
            idx = np.concatenate(parts)
            if rng.random() < 0.5:
                idx = idx[::-1].copy()
            assert np.array_equal(r.read_at("layer0", "values", idx), full[idx])


def test_a_slice_without_a_buffer_reads_straight_from_the_file(tmp_path, monkeypatch):
    p = write(str(tmp_path / "t.h5"), rows=2000, width=256)
    with TraceReader(p) as r:
        full = r._ds["layer1"]["values"][()]
        seen = _count_preadv(monkeypatch)
        got = r.read_values("layer1", 100, 1500, raw=True)
        assert np.array_equal(got, full[100:1500]) and seen["bytes"] == 1400 * 256 * 4
