#!/usr/bin/env python3
"""The compiled kernel's code paths against each other, in one run: ``row_sums`` (the numeric
pass) and ``row_dots_at`` (the identity search) on every path this CPU runs (portable, AVX2,
AVX-512), over blocks in memory and over the same bytes mapped from a file just written (in the
page cache; mapped afresh for each use, as a diff maps each block, so its page faults are timed;
how the page cache holds a file's pages changes that cost: a trace read back from disk may map
slower than this freshly written file).

Each round times every (path, source) once, in a fresh random order (seeded), after one untimed
round; medians are printed in GB/s of stored data (both sides) and as a ratio to the AVX2 path.
The sums are checked to be the same bits on every path. One thread: this measures a path, not
the lanes of a diff.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_kernels.py [--rows 2048] [--width 4096]
        [--blocks 8] [--rounds 7] [--seed 0] [--dir /tmp] [--pair DIR] [--json FILE]

``--pair DIR`` (a pair ``bench_diff.py --keep`` kept: ``a.h5``, ``b.h5``) also times ``row_sums``
over every bf16 tensor the two traces share, each mapped afresh through the trace reader as the
diff maps it (``map_rows``), one thread: the rate the numeric pass gets from a real trace's pages.

Exit 2 when the extension is not built (nothing to compare).
"""

from __future__ import annotations

import argparse
import mmap
import os
import random
import statistics
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from benchjson import Result  # noqa: E402


def paths(k) -> list[str]:
    out = []
    was = k.simd()
    try:
        for level in ("portable", "avx2", "avx512"):
            try:
                k.simd(level)
                out.append(level)
            except ValueError:
                pass
    finally:
        k.simd(was)
    return out


def _timed(fn, blocks: np.ndarray) -> float:
    t0 = time.perf_counter()
    fn(blocks)
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--blocks", type=int, default=8, help="blocks per side (each rows x width bf16)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--pair", metavar="DIR", help="also time row_sums over this pair's tensors, mapped as the diff maps them")
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args()
    try:
        from tensordiff import _kernels as k
    except ImportError:
        print("bench_kernels: the compiled kernels are not built (python setup.py build_ext --inplace)", file=sys.stderr)
        return 2
    res = Result("bench_kernels", config=vars(args).copy())
    n, w, nb = args.rows, args.width, args.blocks
    rng = np.random.default_rng(args.seed)
    block_bytes = n * w * 2
    sides = []
    for s in range(2):
        data = (rng.standard_normal((nb, n, w)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
        if s:
            data ^= 1   # the last bit of every element: small differences, as a diff sees
        sides.append(data)
    fd, path = tempfile.mkstemp(prefix="bench-kernels-", suffix=".bin", dir=args.dir)
    try:
        with os.fdopen(fd, "wb") as fh:
            for data in sides:
                fh.write(data.tobytes())
        with open(path, "rb") as fh:
            fh.read()   # into the page cache
        mf = open(path, "rb")

        def on_blocks(source: str, fn):
            """``fn`` of the blocks: the array in memory, or the file mapped afresh (as a diff
            maps each block: its page faults are part of what is timed), unmapped after."""
            if source == "memory":
                return fn(memory)
            m = mmap.mmap(mf.fileno(), 0, access=mmap.ACCESS_READ)
            try:
                return fn(np.frombuffer(m, np.uint16).reshape(2, nb, n, w))
            finally:
                m.close()

        idx = np.sort(rng.choice(n, 320, replace=False)).astype(np.int64)
        x = rng.standard_normal((len(idx), w)).astype(np.float32)
        outs = [np.empty((n, 1)), np.empty((n, 1)), np.empty((n, 1)), np.empty((n, 1), np.float32)]
        dots = np.empty(len(idx))

        def sums(src: np.ndarray) -> list[np.ndarray]:
            got = []
            for b in range(nb):
                k.row_sums(src[0][b], 1, src[1][b], 1, 1, w, *outs)
                got.append(outs[2].copy())
            return got

        def search(src: np.ndarray) -> np.ndarray:
            # the identity search's pattern: scattered rows scored against float32 rows, and
            # their norms
            for b in range(nb):
                k.row_dots_at(x, 0, None, src[0][b], 1, idx, dots)
                k.row_dots_at(src[0][b], 1, idx, src[0][b], 1, idx, dots)
            return dots.copy()

        levels = paths(k)
        memory = np.stack(sides)
        tasks = [(lv, what) for lv in levels for what in ("memory", "mapped")]
        ref_sums, ref_dots = None, None
        for lv, what in tasks:   # the untimed round: every path gives the same bits
            was = k.simd(lv)
            try:
                s = on_blocks(what, sums)
                d = on_blocks(what, search)
            finally:
                k.simd(was)
            if ref_sums is None:
                ref_sums, ref_dots = s, d
            elif not (all(np.array_equal(a, b) for a, b in zip(s, ref_sums)) and np.array_equal(d, ref_dots)):
                print(f"bench_kernels: the {lv} path gave other bits", file=sys.stderr)
                return 2
        times: dict[tuple[str, str, str], list[float]] = {}
        order = random.Random(args.seed)
        for _ in range(args.rounds):
            order.shuffle(tasks)
            for lv, what in tasks:
                was = k.simd(lv)
                try:
                    for kern, fn in (("row_sums", sums), ("row_dots_at", search)):
                        t = on_blocks(what, lambda blocks, fn=fn: _timed(fn, blocks))
                        times.setdefault((lv, what, kern), []).append(t)
                finally:
                    k.simd(was)
        mf.close()
    finally:
        os.unlink(path)
    figures: dict[str, float | int | bool | None] = {}
    print(f"{n} x {w} bf16, {nb} blocks a side; {args.rounds} rounds, medians; /proc/loadavg at the end "
          f"{os.getloadavg()[0]:.2f}")
    print(f"{'kernel':<12} {'source':<7} " + " ".join(f"{lv:>16}" for lv in levels))
    for kern in ("row_sums", "row_dots_at"):
        for what in ("memory", "mapped"):
            cells = []
            base = statistics.median(times[("avx2", what, kern)]) if "avx2" in levels else None
            for lv in levels:
                t = statistics.median(times[(lv, what, kern)])
                if kern == "row_sums":
                    rate = 2 * nb * block_bytes / t / 1e9
                    figures[f"{kern}_{what}_{lv}_gb_s"] = rate
                    cell = f"{rate:6.2f} GB/s"
                else:
                    rate = nb * 2 * len(idx) * w / t / 1e9
                    figures[f"{kern}_{what}_{lv}_gmac_s"] = rate
                    cell = f"{rate:5.2f} GMAC/s"
                ratio = base / t if base else float("nan")
                figures[f"{kern}_{what}_{lv}_vs_avx2"] = ratio
                cells.append(f"{cell} {ratio:4.2f}x")
            print(f"{kern:<12} {what:<7} " + " ".join(f"{c:>16}" for c in cells))
    if args.pair:
        got = pair_rates(k, args.pair, levels, args.rounds, args.seed)
        if got is None:
            return 2
        for lv, rate in got.items():
            figures[f"row_sums_pair_{lv}_gb_s"] = rate
        print(f"row_sums     {'pair':<7} " + " ".join(f"{got[lv]:6.2f} GB/s {got[lv] / got.get('avx2', got[lv]):4.2f}x"
                                                for lv in levels) + f"   ({args.pair}, mapped by the trace reader)")
    res.write(args.json, figures)
    return 0


def pair_rates(k, pair: str, levels: list[str], rounds: int, seed: int) -> dict[str, float] | None:
    """GB/s (both sides) of ``row_sums`` over every bf16 tensor both traces of ``pair`` hold, each
    mapped afresh by the trace reader, per code path: medians of interleaved rounds."""
    from tensordiff.trace import TraceReader

    paths_ = [os.path.join(pair, f) for f in ("a.h5", "b.h5")]
    if not all(os.path.isfile(p) for p in paths_):
        print(f"bench_kernels: no a.h5 and b.h5 in {pair}", file=sys.stderr)
        return None
    with TraceReader(paths_[0]) as ra, TraceReader(paths_[1]) as rb:
        names = sorted(n for n, i in ra.tensors.items() if i.has_values and i.dtype == "bfloat16"
                       and n in rb.tensors and rb.tensors[n].rows == i.rows and rb.tensors[n].width == i.width)
        if not names:
            print(f"bench_kernels: {pair} has no bf16 tensor on both sides", file=sys.stderr)
            return None

        def one() -> tuple[float, int]:
            total, t = 0, 0.0
            for name in names:
                idx = np.arange(ra.tensors[name].rows)
                w = ra.tensors[name].width
                out = [np.empty((len(idx), 1)), np.empty((len(idx), 1)), np.empty((len(idx), 1)),
                       np.empty((len(idx), 1), np.float32)]
                t0 = time.perf_counter()
                xa, xb = ra.map_rows(name, "values", idx), rb.map_rows(name, "values", idx)
                if not isinstance(xa, np.ndarray) or not isinstance(xb, np.ndarray):
                    raise RuntimeError(f"{name} is not mapped in one piece")
                k.row_sums(xa, 1, xb, 1, 1, w, *out)
                del xa, xb
                t += time.perf_counter() - t0
                total += 2 * len(idx) * w * 2
            return t, total

        times: dict[str, list[float]] = {lv: [] for lv in levels}
        order = random.Random(seed)
        tasks = list(levels)
        for r in range(rounds + 1):
            order.shuffle(tasks)
            for lv in tasks:
                was = k.simd(lv)
                try:
                    t, total = one()
                finally:
                    k.simd(was)
                if r:   # the first round warms up
                    times[lv].append(t)
    return {lv: total / statistics.median(ts) / 1e9 for lv, ts in times.items()}


if __name__ == "__main__":
    sys.exit(main())
