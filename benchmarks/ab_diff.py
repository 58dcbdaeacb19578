#!/usr/bin/env python3
"""A/B of the in-process diff: two checkouts of tensordiff on one kept pair, in one run.

Each run is a fresh process of this venv's python with one checkout on ``PYTHONPATH``: it diffs
the pair once (the warm-up: imports, first reads, thread pools), then times one ``diff_traces`` +
``to_dict`` and reports its wall time and its CPU time (user + sys, ``getrusage``). The rounds run
every checkout once in a fresh random order (seeded), after one untimed round; medians are
printed with ``/proc/loadavg`` at the start and the end.

    PYTHONPATH=. .venv/bin/python benchmarks/ab_diff.py --pair DIR CHECKOUT [CHECKOUT ...]
        [--rounds 6] [--seed 0] [--json FILE] [--idle-wait SECONDS]

``--idle-wait`` starts each timed round only once the machine has been idle for 3 s (up to that
long): on a 2-core machine another job on one core turns the diff's two lanes into one.

``DIR`` holds ``a.h5`` and ``b.h5`` (``bench_diff.py --keep`` prints one). A checkout is a
directory with ``tensordiff/`` in it and its compiled kernel built (``python setup.py build_ext
--inplace``), e.g. ``git worktree add --detach /tmp/base <commit>``. Exit 2 when a run fails:
a checkout that cannot diff the pair is never left out silently.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time

_RUN = r"""
import json, resource, sys, time
from tensordiff.cli import jsonable
from tensordiff.diff import diff_traces
a, b = sys.argv[1], sys.argv[2]
diff_traces(a, b)
r0 = resource.getrusage(resource.RUSAGE_SELF)
t0 = time.perf_counter()
jsonable(diff_traces(a, b).to_dict())
wall = time.perf_counter() - t0
r1 = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"wall": wall, "cpu": r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime}))
"""


def _loadavg() -> str:
    try:
        with open("/proc/loadavg") as fh:
            return fh.read().strip()
    except OSError:
        return "unknown"


def _busy_ticks() -> int | None:
    """CPU time spent so far by every process on the machine (user + nice + system), in ticks."""
    try:
        with open("/proc/stat") as fh:
            f = fh.readline().split()
        return int(f[1]) + int(f[2]) + int(f[3])
    except (OSError, ValueError, IndexError):
        return None


def wait_idle(limit: float, quiet: float = 3.0) -> bool:
    """Wait (up to ``limit`` seconds) until the machine has been idle for ``quiet`` seconds: less
    than a third of a core busy in each second. A round that starts while another job has a core
    measures that job, not the checkouts (a diff's two lanes need both cores). False: never idle."""
    end = time.monotonic() + limit
    calm = 0.0
    hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    while time.monotonic() < end:
        t0 = _busy_ticks()
        time.sleep(1.0)
        t1 = _busy_ticks()
        if t0 is None or t1 is None:
            return False
        calm = calm + 1.0 if (t1 - t0) < hz / 3 else 0.0
        if calm >= quiet:
            return True
    return False


def run_once(checkout: str, a: str, b: str) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=checkout)
    out = subprocess.run([sys.executable, "-c", _RUN, a, b], cwd=checkout, env=env, capture_output=True, text=True,
                         timeout=900)
    if out.returncode != 0:
        tail = (out.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"{checkout}: the diff failed (exit {out.returncode}): {tail}")
    got: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return got


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pair", required=True, help="directory with a.h5 and b.h5")
    ap.add_argument("checkouts", nargs="+", help="tensordiff checkouts to compare")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", metavar="FILE")
    ap.add_argument("--idle-wait", type=float, default=0.0, metavar="SECONDS",
                    help="before each round, wait up to this long for the machine to be idle for 3 s "
                         "(a round that never found it idle is counted in the output)")
    args = ap.parse_args()
    a, b = os.path.join(args.pair, "a.h5"), os.path.join(args.pair, "b.h5")
    for p in (a, b):
        if not os.path.isfile(p):
            print(f"ab_diff: no {p}", file=sys.stderr)
            return 2
    trees = [os.path.abspath(c) for c in args.checkouts]
    for t in trees:
        if not os.path.isdir(os.path.join(t, "tensordiff")):
            print(f"ab_diff: {t} is not a tensordiff checkout", file=sys.stderr)
            return 2
    rng = random.Random(args.seed)
    times: dict[str, list[dict[str, float]]] = {t: [] for t in trees}
    load0 = _loadavg()
    busy_rounds = 0
    try:
        for r in range(args.rounds + 1):
            order = trees[:]
            rng.shuffle(order)
            if args.idle_wait > 0 and r and not wait_idle(args.idle_wait):
                busy_rounds += 1
            for t in order:
                got = run_once(t, a, b)
                if r:   # round 0 warms the page cache and the bytecode of every checkout
                    times[t].append(got)
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        print(f"ab_diff: {e}", file=sys.stderr)
        return 2
    load1 = _loadavg()
    fig = {}
    for t, xs in times.items():
        wall = statistics.median(x["wall"] for x in xs)
        cpu = statistics.median(x["cpu"] for x in xs)
        fig[t] = {"wall_s": wall, "cpu_s": cpu, "walls": [x["wall"] for x in xs]}
        print(f"{t}: median wall {wall:.3f} s, median CPU {cpu:.3f} s over {len(xs)} rounds")
    base = trees[0]
    for t in trees[1:]:
        print(f"{t} / {base}: wall {fig[t]['wall_s'] / fig[base]['wall_s']:.2f}x, "
              f"CPU {fig[t]['cpu_s'] / fig[base]['cpu_s']:.2f}x (lower is faster)")
    print(f"/proc/loadavg: {load0} at start, {load1} at end")
    if args.idle_wait > 0:
        print(f"rounds started without {args.idle_wait:g} s of waiting finding the machine idle: {busy_rounds}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"bench": "ab_diff", "pair": args.pair, "rounds": args.rounds, "load": [load0, load1],
                       "idle_wait": args.idle_wait, "busy_rounds": busy_rounds, "figures": fig}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
