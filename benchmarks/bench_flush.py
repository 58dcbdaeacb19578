"""Write-rate cost of crash safety, as ratios against writing without it, measured in one run.

A recorder-shaped workload: ``--tensors`` bf16 states of width ``--hidden`` (boundaries, values +
RMS as the recorder gives them), appended ``--rows-per-append`` tokens per step with their
token-table rows, ~``--gib`` GiB in all, fsynced at the end. Variants (interleaved in a shuffled order,
after an untimed warm-up round, ``--repeat`` times, medians):

  none        TraceWriter(flush_rows=None, flush_seconds=None): nothing is written for safety;
              a killed process leaves an unreadable file. The baseline.
  policy      TraceWriter defaults (flush_rows=4096, flush_seconds=10): periodic two-phase flush
              with pinned metadata, what tensordiff ships.
  policy-256  the same policy flushing every 256 token rows (16x more often).
  swmr        the alternative: libver="latest", SWMR write mode switched on after every tensor
              is defined (SWMR forbids defining one later), ``f.flush()`` every 4096 rows.
  reopen      the alternative: close the file and reopen it (mode r+) every 4096 rows.
  journal     the alternative: an append-only sidecar of every row (os.write, the journal a
              reader would replay) beside a trace written without flushes.
  raw         numpy ``tofile`` of the same bytes + fsync (the ceiling; DESIGN budget: >= 80%).

Also printed: the time spent inside flush() per flush and as a share of the run ("in flush":
the cost of the policy measured within each run, which the drift of a shared machine does not
blur the way it blurs rate ratios between runs), and the file size of each variant.

    PYTHONPATH=. python benchmarks/bench_flush.py [--gib 1] [--tensors 8] [--hidden 4096]
        [--rows-per-append 16] [--repeat 3] [--variants none,policy,...] [--dir DIR] [--json FILE]

``--json FILE`` writes benchmarks/benchjson.py's object; its figures, per variant ``v`` measured
(``-`` in names becomes ``_``): ``<v>_vs_none`` (rate ratio), ``<v>_flush_share`` (time in flush()
/ run time) and ``<v>_ms_per_flush``.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time

import h5py
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tensordiff import trace as trace_mod  # noqa: E402
from tensordiff.dtypes import f32_to_bf16_bits  # noqa: E402
from tensordiff.trace import TraceWriter  # noqa: E402


from bench_write import fsync_path  # noqa: E402  (benchmarks/ is on sys.path when run as a script)
from benchjson import Result  # noqa: E402


class _ReopenWriter(TraceWriter):
    """Close-reopen instead of flush: every flush closes the file and opens it again (r+)."""

    def flush(self) -> None:
        super().flush()
        if self._closed:
            return
        self.f.close()
        self.f = h5py.File(self.path, "r+")
        for name, apps in self._tensors.items():
            for part, app in apps.items():
                app.ds = self.f["tensors"][name][part]
        self._tokens.ds = self.f["tokens"]


class _SwmrWriter(TraceWriter):
    """HDF5 SWMR: latest file format, SWMR write mode once every tensor is defined, then plain
    flushes (attributes cannot be written in SWMR mode, so no commit counts)."""

    def start(self) -> None:
        self.f.flush()
        self.f.swmr_mode = True

    def flush(self) -> None:
        if self._closed:
            return
        self._write_buffered()  # the writer's phase 1, without the commit-count attributes
        self._flushed_now()

    def close(self) -> None:  # no trimming or attribute writes in SWMR mode
        if self._closed:
            return
        self.flush()
        self.f.close()
        self._closed = True


def run(variant: str, data: np.ndarray, rms: np.ndarray, path: str, tensors: int, step_rows: int) -> dict:
    T, H = data.shape
    kw = dict(side="serve", model={"hidden_size": H, "num_layers": tensors}, flush_seconds=None)
    cls = TraceWriter
    journal = None
    if variant == "none":
        kw["flush_rows"] = None
    elif variant == "policy":
        kw.update(flush_rows=4096, flush_seconds=10.0)
    elif variant == "policy-256":
        kw["flush_rows"] = 256
    elif variant == "reopen":
        cls, kw["flush_rows"] = _ReopenWriter, 4096
    elif variant == "swmr":
        cls, kw["flush_rows"] = _SwmrWriter, 4096
    elif variant == "journal":
        kw["flush_rows"] = None
        journal = os.open(path + ".journal", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    flush_time = [0.0, 0]
    orig_file = h5py.File
    if variant == "swmr":
        trace_mod.h5py.File = lambda p, m, **k: orig_file(p, m, libver="latest", **k)
    t = time.perf_counter()
    try:
        w = cls(path, **kw)
    finally:
        trace_mod.h5py.File = orig_file
    if variant not in ("none", "journal"):
        inner = w.flush

        def timed_flush():
            t0 = time.perf_counter()
            inner()
            flush_time[0] += time.perf_counter() - t0
            flush_time[1] += 1
        w.flush = timed_flush
    names = [f"layer{b}" for b in range(tensors)]
    for b, name in enumerate(names):
        w.define_tensor(name, H, kind="boundary", boundary=b, dtype="bfloat16", sketch=False)
    if variant == "swmr":
        w.start()
    pending = 0
    for step, s in enumerate(range(0, T, step_rows)):
        blk = data[s:s + step_rows]
        rows = w.add_tokens("req-0", np.arange(s, s + len(blk)), np.zeros(len(blk), np.int64), "decode", step=step)
        for name in names:
            w.append(name, rows, blk, rms=rms[s:s + len(blk)])
            if journal is not None:
                os.write(journal, blk.tobytes())
        pending += len(blk)
    w.close()
    fsync_path(path)
    if journal is not None:
        os.fsync(journal)
        os.close(journal)
    secs = time.perf_counter() - t
    size = os.path.getsize(path) + (os.path.getsize(path + ".journal") if journal is not None else 0)
    return {"secs": secs, "flush_secs": flush_time[0], "flushes": flush_time[1], "size": size}


def raw(data: np.ndarray, path: str, tensors: int) -> dict:
    t = time.perf_counter()
    with open(path, "wb") as fh:
        for _ in range(tensors):
            data.tofile(fh)
    fsync_path(path)
    return {"secs": time.perf_counter() - t, "flush_secs": 0.0, "flushes": 0, "size": os.path.getsize(path)}


VARIANTS = ("none", "policy", "policy-256", "swmr", "reopen", "journal", "raw")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=1.0, help="bytes of tensor values written per variant")
    ap.add_argument("--tensors", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--rows-per-append", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--dir", default=None)
    ap.add_argument("--json", metavar="FILE", default=None, help="write the figures as one JSON object")
    a = ap.parse_args()
    variants = [v for v in a.variants.split(",") if v]
    bad = [v for v in variants if v not in VARIANTS]
    if bad or not variants or a.gib <= 0 or a.repeat < 1 or a.tensors < 1 or a.rows_per_append < 1:
        print(f"bench_flush: variants are {','.join(VARIANTS)} (got {a.variants!r}); sizes and --repeat must be "
              "positive", file=sys.stderr)
        sys.exit(2)
    result = Result("bench_flush", config={"gib": a.gib, "tensors": a.tensors, "hidden": a.hidden,
                                           "rows_per_append": a.rows_per_append, "repeat": a.repeat,
                                           "variants": variants})
    T = int(a.gib * (1 << 30)) // (a.hidden * 2 * a.tensors)
    rng = np.random.default_rng(0)
    block = f32_to_bf16_bits(rng.standard_normal((1024, a.hidden), dtype=np.float32))
    data = np.tile(block, (T // 1024 + 1, 1))[:T]
    rms = np.ones((T, 1), np.float32)
    nbytes = data.nbytes * a.tensors
    res: dict[str, list[dict]] = {v: [] for v in variants}
    order = random.Random(0)
    try:
        with tempfile.TemporaryDirectory(dir=a.dir) as d:
            for rnd in range(a.repeat + 1):  # round 0: an untimed warm-up of every variant
                # interleaved, in a new order each round, so drift of the shared machine and the
                # writeback of the previous variant's fsync hit all alike
                for v in order.sample(variants, len(variants)):
                    p = os.path.join(d, f"{v}.h5")
                    got = raw(data, p, a.tensors) if v == "raw" else run(v, data, rms, p, a.tensors, a.rows_per_append)
                    if rnd:
                        res[v].append(got)
                    for q in (p, p + ".journal"):
                        if os.path.exists(q):
                            os.remove(q)
    except OSError as e:
        print(f"bench_flush: cannot write the benchmark files: {e}", file=sys.stderr)
        sys.exit(2)
    med = {v: statistics.median(r["secs"] for r in rs) for v, rs in res.items()}
    base = med.get("none")
    print(f"workload: {a.tensors} tensors x {T} rows x {a.hidden} bf16 = {nbytes / (1 << 30):.2f} GiB, "
          f"{a.rows_per_append} token rows per step ({T // a.rows_per_append} steps); median of {a.repeat}")
    print(f"{'variant':<11} {'GB/s':>6} {'vs none':>8} {'vs raw':>7} {'flushes':>8} {'ms/flush':>9} "
          f"{'in flush':>9} {'file GiB':>9}")
    figures: dict[str, float | int | bool | None] = {}
    for v in variants:
        r = res[v]
        fl = statistics.median(x["flushes"] for x in r)
        ms = statistics.median(x["flush_secs"] / x["flushes"] * 1e3 if x["flushes"] else 0.0 for x in r)
        # time inside flush() as a share of the same run: the cost of the policy, immune to the
        # drift between runs that the rate ratios suffer on a shared machine
        share = statistics.median(x["flush_secs"] / x["secs"] for x in r)
        print(f"{v:<11} {nbytes / 1e9 / med[v]:>6.2f} "
              f"{(base / med[v]) if base else float('nan'):>8.2f} "
              f"{(med['raw'] / med[v]) if 'raw' in med else float('nan'):>7.2f} "
              f"{fl:>8.0f} {ms:>9.1f} {share:>9.1%} {r[0]['size'] / (1 << 30):>9.2f}")
        key = v.replace("-", "_")
        if base:
            figures[f"{key}_vs_none"] = base / med[v]
        if fl:
            figures[f"{key}_flush_share"] = share
            figures[f"{key}_ms_per_flush"] = ms
    print(f"load average at end: {os.getloadavg()[0]:.2f} (start {result.load_start:.2f})")
    result.write(a.json, figures)


if __name__ == "__main__":
    main()
