"""Trace write rate vs raw appends of the same bytes in the same pattern, measured in the same run.

Writes ~1 GiB of bf16 rows [T, 4096] through TraceWriter in decode-sized appends (a few tokens
per call, each with its token-table rows, as a recorder does), and the same bytes raw: once with
one numpy ``tofile`` and once appended to a plain file in the same row pattern (the baseline the
goal is stated against); all are fsynced. TraceWriter variants:

  recorder path          values + per-token RMS given, no sketch dataset (what a recorder hands
                         the writer with ``sketch=False``; the goal's figure, ``recorder_vs_raw``)
  recorder path, sketch  values + RMS + sketch given (a recorder's default: sketch and RMS computed
                         on the device); the sketch's bytes (6% more at d=128) are not in the baseline
  writer computes RMS    values only, no sketch dataset: the writer computes RMS per values block
  writer computes sketch values only, sketch dataset on: the writer computes sketch and RMS per
                         block (a CPU matmul of 2*4096*128 flops per row: slow by nature, so it
                         writes the first ``--sketch-gib`` only, against raw appends of those bytes
                         in the same rounds)

Each variant first runs once untimed (the first write of a run pays a page-cache stall that no
variant should be charged alone), then ``--repeat`` rounds run the variants in a random order per
round (seeded). Medians; ratios are throughput ratios against raw appends (>1: faster). The CPU
seconds of each variant (user + system of this process) are printed too: on a loaded machine
they say what the wall times cannot.

    python benchmarks/bench_write.py [--gib 1.0] [--rows-per-append 4] [--repeat 5] [--dir DIR]
        [--sketch-gib 0.125 | --no-writer-sketch] [--json FILE]
"""

from __future__ import annotations

import argparse
import os
import random
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchjson import Result  # noqa: E402  (benchmarks/ is on sys.path when run as a script)

from tensordiff.dtypes import bf16_bits_to_f32, f32_to_bf16_bits  # noqa: E402
from tensordiff.sketch import DEFAULT_SKETCH_DIM, DEFAULT_SKETCH_SEED, sketch_np  # noqa: E402
from tensordiff.trace import TraceWriter, slot_rms  # noqa: E402


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
                rms: np.ndarray | None = None, sketch: np.ndarray | None = None,
                with_sketch: bool = False) -> float:
    """rms/sketch given: supplied by the caller per append, as the torch recorders do (computed on
    the device); None: the writer computes them from the values, per block. ``with_sketch``: the
    tensor has a sketch dataset (implied when ``sketch`` is given)."""
    T, H = data.shape
    # a recorder has its batch's positions and token ids as arrays already: slices, not new arrays
    positions = np.arange(T, dtype=np.int64)
    token_ids = np.zeros(T, dtype=np.int64)
    t = time.perf_counter()
    with TraceWriter(path, side="serve", model={"hidden_size": H}, flush_rows=flush_rows, flush_seconds=None) as w:
        w.define_tensor("layer3", H, kind="boundary", boundary=3, dtype="bfloat16",
                        sketch=with_sketch or sketch is not None)
        for step, s in enumerate(range(0, T, rows_per_append)):
            e = s + rows_per_append
            blk = data[s:e]
            rows = w.add_tokens("req-0", positions[s:e], token_ids[s:e], "decode", step=step)
            w.append("layer3", rows, blk, rms=None if rms is None else rms[s:e],
                     sketch=None if sketch is None else sketch[s:e])
    fsync_path(path)
    return time.perf_counter() - t


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--rows-per-append", type=int, default=4)
    ap.add_argument("--flush-rows", type=int, default=4096)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--seed", type=int, default=0, help="seed of the per-round random order")
    ap.add_argument("--sketch-gib", type=float, default=0.125,
                    help="bytes the writer-computes-sketch variant writes (its raw baseline writes the same)")
    ap.add_argument("--no-writer-sketch", action="store_true",
                    help="leave out the variant where the writer computes sketches (the slowest)")
    ap.add_argument("--json", metavar="FILE", default=None, help="write the figures as one JSON object")
    a = ap.parse_args(argv)
    if a.gib <= 0 or a.sketch_gib <= 0 or a.hidden < 1 or a.rows_per_append < 1 or a.repeat < 1:
        print("bench_write: --gib, --sketch-gib, --hidden, --rows-per-append and --repeat must be positive",
              file=sys.stderr)
        return 2
    res = Result("bench_write", config={"gib": a.gib, "hidden": a.hidden, "rows_per_append": a.rows_per_append,
                                        "flush_rows": a.flush_rows, "repeat": a.repeat, "seed": a.seed,
                                        "writer_sketch": not a.no_writer_sketch,
                                        "sketch_gib": min(a.sketch_gib, a.gib)})
    T = int(a.gib * (1 << 30)) // (a.hidden * 2)
    rng = np.random.default_rng(0)
    # realistic activations (no denormals or NaN, which random bit patterns would be full of)
    block = f32_to_bf16_bits(rng.standard_normal((4096, a.hidden), dtype=np.float32))
    reps = T // 4096 + 1
    data = np.tile(block, (reps, 1))[:T]
    b32 = bf16_bits_to_f32(block)
    # what a recorder supplies, computed once for the repeating block
    rms = np.tile(slot_rms(b32, a.hidden), (reps, 1))[:T]
    sk = np.tile(sketch_np(b32, a.hidden, DEFAULT_SKETCH_DIM, DEFAULT_SKETCH_SEED), (reps, 1))[:T]
    del b32
    nbytes = data.nbytes
    rpa, fr = a.rows_per_append, a.flush_rows
    variants: dict[str, Callable[[str], float]] = {
        "raw numpy tofile": lambda p: raw_numpy(data, p),
        "raw appends": lambda p: raw_appends(data, p, rpa),
        "TraceWriter, recorder path": lambda p: trace_write(data, p, rpa, fr, rms=rms),
        "TraceWriter, recorder path + sketch": lambda p: trace_write(data, p, rpa, fr, rms=rms, sketch=sk),
        "TraceWriter, writer computes RMS": lambda p: trace_write(data, p, rpa, fr),
    }
    Ts = min(T, int(a.sketch_gib * (1 << 30)) // (a.hidden * 2))
    if not a.no_writer_sketch:
        data_s = data[:Ts]
        variants["raw appends, sketch-variant bytes"] = lambda p: raw_appends(data_s, p, rpa)
        variants["TraceWriter, writer computes sketch"] = lambda p: trace_write(data_s, p, rpa, fr, with_sketch=True)
    times: dict[str, list[float]] = {k: [] for k in variants}
    cpu: dict[str, list[float]] = {k: [] for k in variants}
    sizes: dict[str, int] = {}
    order_rng = random.Random(a.seed)
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} CPUs",
          flush=True)
    try:
        with tempfile.TemporaryDirectory(dir=a.dir) as d:
            path = os.path.join(d, "out.bin")
            for rnd in range(a.repeat + 1):  # round 0: the untimed warm-up of every variant
                order = list(variants)
                order_rng.shuffle(order)
                for name in order:
                    c0 = _cpu()
                    secs = variants[name](path)
                    c1 = _cpu()
                    sizes[name] = os.path.getsize(path)
                    os.remove(path)
                    if rnd:
                        times[name].append(secs)
                        cpu[name].append(c1 - c0)
    except OSError as e:
        print(f"bench_write: cannot write the benchmark files: {e}", file=sys.stderr)
        return 2
    med = {k: statistics.median(v) for k, v in times.items()}
    gb = nbytes / 1e9
    print(f"data: {T} rows x {a.hidden} bf16 = {nbytes / (1 << 30):.2f} GiB; appends of {rpa} rows "
          f"({T // rpa} calls), flush every {fr} rows"
          + ("" if a.no_writer_sketch else f"; the writer-computes-sketch variant and its raw baseline: the first "
             f"{Ts} rows ({Ts * a.hidden * 2 / (1 << 30):.3f} GiB)"))
    print(f"warm-up round, then {a.repeat} rounds in random order (seed {a.seed}); medians")
    base = med["raw appends"]
    print(f"{'variant':38s} {'GB/s':>6s} {'vs raw appends':>14s} {'median s':>9s} {'CPU s':>6s} {'file GiB':>8s}  all s")
    for k, v in med.items():
        small = k in ("raw appends, sketch-variant bytes", "TraceWriter, writer computes sketch")
        ratio = (med["raw appends, sketch-variant bytes"] if small else base) / v
        print(f"{k:38s} {(Ts * a.hidden * 2 / 1e9 if small else gb) / v:6.2f} {ratio:14.2f} {v:9.2f} "
              f"{statistics.median(cpu[k]):6.2f} "
              f"{sizes[k] / (1 << 30):8.2f}  {', '.join(f'{x:.2f}' for x in times[k])}")
    figures: dict[str, float | int | bool | None] = {
        "recorder_vs_raw": base / med["TraceWriter, recorder path"],
        "recorder_sketch_vs_raw": base / med["TraceWriter, recorder path + sketch"],
        "writer_rms_vs_raw": base / med["TraceWriter, writer computes RMS"],
        "recorder_vs_tofile": med["raw numpy tofile"] / med["TraceWriter, recorder path"],
        "raw_appends_s": base,
        "recorder_s": med["TraceWriter, recorder path"],
        "raw_appends_cpu_s": statistics.median(cpu["raw appends"]),
        "recorder_cpu_s": statistics.median(cpu["TraceWriter, recorder path"]),
    }
    if "TraceWriter, writer computes sketch" in med:
        figures["writer_sketch_vs_raw"] = med["raw appends, sketch-variant bytes"] / med["TraceWriter, writer computes sketch"]
        figures["writer_sketch_s_per_gib"] = med["TraceWriter, writer computes sketch"] / (Ts * a.hidden * 2 / (1 << 30))
    print(f"ratio recorder path / raw appends: {figures['recorder_vs_raw']:.2f}  (goal >= 0.80)")
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    res.write(a.json, figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
