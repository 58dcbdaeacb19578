"""Trace write rate vs raw numpy, measured in the same run.

Writes ~1 GiB of bf16 rows [T, 4096] through TraceWriter in decode-sized appends (a few tokens
per call, each with its token-table rows, as a recorder does) and the same bytes with one raw
numpy ``tofile``; both are fsynced. Prints both rates and their ratio (goal >= 0.8).

    python benchmarks/bench_write.py [--gib 1.0] [--rows-per-append 4] [--repeat 3] [--dir DIR]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import numpy as np

from tensordiff.dtypes import f32_to_bf16_bits
from tensordiff.trace import TraceWriter


def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def raw_numpy(data: np.ndarray, path: str) -> float:
    t = time.perf_counter()
    data.tofile(path)
    fsync_path(path)
    return time.perf_counter() - t


def trace_write(data: np.ndarray, path: str, rows_per_append: int, flush_rows: int | None,
                rms: np.ndarray | None = None) -> float:
    """rms given: per-token RMS supplied by the caller, as the torch recorders do (computed on the
    device beside the sketch); None: the writer computes it from the values, in batches."""
    T, H = data.shape
    t = time.perf_counter()
    with TraceWriter(path, side="serve", model={"hidden_size": H}, flush_rows=flush_rows, flush_seconds=None) as w:
        w.define_tensor("layer3", H, kind="boundary", boundary=3, dtype="bfloat16", sketch=False)
        for step, s in enumerate(range(0, T, rows_per_append)):
            blk = data[s:s + rows_per_append]
            rows = w.add_tokens("req-0", np.arange(s, s + len(blk)), np.zeros(len(blk), np.int64), "decode", step=step)
            w.append("layer3", rows, blk, rms=None if rms is None else rms[s:s + rows_per_append])
    fsync_path(path)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--rows-per-append", type=int, default=4)
    ap.add_argument("--flush-rows", type=int, default=4096)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default=None)
    a = ap.parse_args()
    T = int(a.gib * (1 << 30)) // (a.hidden * 2)
    rng = np.random.default_rng(0)
    # realistic activations (no denormals or NaN, which random bit patterns would be full of)
    block = f32_to_bf16_bits(rng.standard_normal((4096, a.hidden), dtype=np.float32))
    data = np.tile(block, (T // 4096 + 1, 1))[:T]
    nbytes = data.nbytes
    rms = np.ones((T, 1), np.float32)
    raw_t, tr_t, tr2_t = [], [], []
    with tempfile.TemporaryDirectory(dir=a.dir) as d:
        for _ in range(a.repeat):  # interleaved, so drift hits both alike
            p1, p2 = os.path.join(d, "raw.bin"), os.path.join(d, "trace.h5")
            raw_t.append(raw_numpy(data, p1))
            os.remove(p1)
            tr_t.append(trace_write(data, p2, a.rows_per_append, a.flush_rows, rms))
            size = os.path.getsize(p2)
            os.remove(p2)
            tr2_t.append(trace_write(data, p2, a.rows_per_append, a.flush_rows))
            os.remove(p2)
    raw_m, tr_m, tr2_m = statistics.median(raw_t), statistics.median(tr_t), statistics.median(tr2_t)
    gb = nbytes / 1e9
    print(f"data: {T} rows x {a.hidden} bf16 = {nbytes / (1 << 30):.2f} GiB; appends of {a.rows_per_append} rows "
          f"({T // a.rows_per_append} calls), flush every {a.flush_rows} rows; trace file {size / (1 << 30):.2f} GiB")
    print(f"raw numpy tofile+fsync : {gb / raw_m:.2f} GB/s (median of {a.repeat}: {raw_m:.2f} s)")
    print(f"TraceWriter, recorder path (RMS from the device): {gb / tr_m:.2f} GB/s (median {tr_m:.2f} s)")
    print(f"TraceWriter, RMS computed by the writer         : {gb / tr2_m:.2f} GB/s (median {tr2_m:.2f} s)")
    print(f"ratio trace/raw, recorder path : {raw_m / tr_m:.2f}  (goal >= 0.80)")
    print(f"ratio trace/raw, writer RMS    : {raw_m / tr2_m:.2f}")


if __name__ == "__main__":
    main()
