"""Trace write rate vs raw numpy, measured in the same run.

Writes ~1 GiB of bf16 rows [T, 4096] through TraceWriter in decode-sized appends (a few tokens
per call, each with its token-table rows, as a recorder does), and the same bytes raw: once with
one numpy ``tofile`` and once appended to a plain file in the same row pattern; all are fsynced.
Each variant first runs once untimed (the first write of a run pays a page-cache stall that no
variant should be charged alone), then ``--repeat`` rounds run the variants in a random order per
round. Prints every rate and the ratios (goal >= 0.8 against raw appends of the same pattern).

    python benchmarks/bench_write.py [--gib 1.0] [--rows-per-append 4] [--repeat 3] [--dir DIR]
"""

from __future__ import annotations

import argparse
import os
import random
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


def raw_appends(data: np.ndarray, path: str, rows_per_append: int) -> float:
    """The same bytes in the same row pattern, appended to a plain file: what a recorder's appends
    cost without any format."""
    t = time.perf_counter()
    with open(path, "wb") as fh:
        for s in range(0, len(data), rows_per_append):
            fh.write(data[s:s + rows_per_append].data)
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
    ap.add_argument("--seed", type=int, default=0, help="seed of the per-round random order")
    a = ap.parse_args()
    T = int(a.gib * (1 << 30)) // (a.hidden * 2)
    rng = np.random.default_rng(0)
    # realistic activations (no denormals or NaN, which random bit patterns would be full of)
    block = f32_to_bf16_bits(rng.standard_normal((4096, a.hidden), dtype=np.float32))
    data = np.tile(block, (T // 4096 + 1, 1))[:T]
    nbytes = data.nbytes
    rms = np.ones((T, 1), np.float32)
    variants = {
        "raw numpy tofile": lambda p: raw_numpy(data, p),
        "raw appends": lambda p: raw_appends(data, p, a.rows_per_append),
        "TraceWriter, recorder path": lambda p: trace_write(data, p, a.rows_per_append, a.flush_rows, rms),
        "TraceWriter, writer computes RMS": lambda p: trace_write(data, p, a.rows_per_append, a.flush_rows),
    }
    times: dict[str, list[float]] = {k: [] for k in variants}
    rng = random.Random(a.seed)
    size = 0
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} CPUs")
    with tempfile.TemporaryDirectory(dir=a.dir) as d:
        path = os.path.join(d, "out.bin")
        for rnd in range(a.repeat + 1):  # round 0: the untimed warm-up of every variant
            order = list(variants)
            rng.shuffle(order)
            for name in order:
                secs = variants[name](path)
                if name.startswith("TraceWriter"):
                    size = os.path.getsize(path)
                os.remove(path)
                if rnd:
                    times[name].append(secs)
    med = {k: statistics.median(v) for k, v in times.items()}
    gb = nbytes / 1e9
    print(f"data: {T} rows x {a.hidden} bf16 = {nbytes / (1 << 30):.2f} GiB; appends of {a.rows_per_append} rows "
          f"({T // a.rows_per_append} calls), flush every {a.flush_rows} rows; trace file {size / (1 << 30):.2f} GiB")
    print(f"warm-up round, then {a.repeat} rounds in random order (seed {a.seed}); medians")
    for k, v in med.items():
        print(f"{k:34s}: {gb / v:5.2f} GB/s (median {v:.2f} s; all {', '.join(f'{x:.2f}' for x in times[k])})")
    base = med["raw appends"]
    print(f"ratio TraceWriter recorder path / raw appends     : {base / med['TraceWriter, recorder path']:.2f}  (goal >= 0.80)")
    print(f"ratio TraceWriter writer-RMS / raw appends        : {base / med['TraceWriter, writer computes RMS']:.2f}")
    print(f"ratio TraceWriter recorder path / raw numpy tofile: "
          f"{med['raw numpy tofile'] / med['TraceWriter, recorder path']:.2f}")
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
