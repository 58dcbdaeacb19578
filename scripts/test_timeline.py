"""Where the test suite's time goes, per worker: reads the JSON lines that tests/conftest.py writes
with TENSORDIFF_TEST_TIMELINE=FILE and prints each worker's modules in the order it ran them, its
busy time and how long it sat idle at the end, and the modules by total time (the sum over both
workers is the suite's work: what two workers share).

    TENSORDIFF_TEST_TIMELINE=/tmp/tl.jsonl bash scripts/test.sh tests
    python scripts/test_timeline.py /tmp/tl.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict


def module_of(nodeid: str) -> str:
    return os.path.splitext(os.path.basename(nodeid.split("::")[0]))[0]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("timeline", help="the JSON lines file TENSORDIFF_TEST_TIMELINE named")
    args = ap.parse_args(argv)
    rows = [json.loads(line) for line in open(args.timeline) if line.strip()]
    if not rows:
        print("no tests in the timeline", file=sys.stderr)
        return 2
    t0 = min(r["start"] for r in rows)
    t1 = max(r["end"] for r in rows)
    per_module: dict[str, float] = defaultdict(float)
    runs: dict[str, list[list]] = defaultdict(list)   # worker -> [[module, first start, last end, seconds]]
    for r in sorted(rows, key=lambda r: r["start"]):
        m, took = module_of(r["test"]), r["end"] - r["start"]
        per_module[m] += took
        seq = runs[r["worker"]]
        if seq and seq[-1][0] == m:
            seq[-1][2] = r["end"]
            seq[-1][3] += took
        else:
            seq.append([m, r["start"], r["end"], took])
    print(f"wall {(t1 - t0) / 60:.1f} min, {len(rows)} tests, work {sum(per_module.values()) / 60:.1f} min")
    for w in sorted(runs):
        busy = sum(s[3] for s in runs[w])
        last = max(s[2] for s in runs[w])
        print(f"\n{w}: busy {busy / 60:.1f} min, done at {(last - t0) / 60:.1f} min, "
              f"idle at the end {(t1 - last) / 60:.1f} min")
        for m, start, end, took in runs[w]:
            print(f"  {(start - t0) / 60:6.1f}-{(end - t0) / 60:6.1f} min  {took:7.1f} s  {m}")
    print("\nmodules by total time:")
    for m, took in sorted(per_module.items(), key=lambda kv: -kv[1])[:30]:
        print(f"  {took:7.1f} s  {m}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BrokenPipeError:   # (piped into head): the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(0)
