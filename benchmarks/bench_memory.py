"""Peak memory of ``tensordiff diff`` (goal: <= 300 MB whatever the tensor count, width or
token count).

Each case writes a seeded pair (benchmarks/model_pair.py: a trained-looking residual stream, bf16,
side B with +-1 ulp noise and one corrupted boundary), runs a fresh
``python -m tensordiff diff A B --json -q --backend serial`` and reads its peak RSS from
``os.wait4``'s ru_maxrss; then deletes the pair. Cases (figure keys):

- ``rss_mb_default``: 32 boundaries x 2048 tokens x 4096 (the bench_diff pair, 1.07 GB);
- ``rss_mb_64_layers``: 64 boundaries x 2048 x 4096 (2.1 GB);
- ``rss_mb_packed_3x4096``: the default pair plus a packed [2048, 3 x 4096] draft input on both
  sides whose serve slots hold other states (identity runs on every slot of both sides);
- ``rss_mb_1m_narrow``: 32 boundaries x 1M tokens x 8 wide, sequences of 1024 tokens (1.9 GB).

    PYTHONPATH=. .venv/bin/python benchmarks/bench_memory.py [--only default,64_layers,...]
        [--dir /tmp] [--keep] [--json FILE]

Each case also checks that the diff exits 1 and names the corrupted boundary first. Exit status 0
when it measured (the goal is judged by benchmarks/goals.py), 2 when it could not.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from benchjson import Result  # noqa: E402
from model_pair import PairSpec, child_rss, tensordiff_env, write_pair  # noqa: E402

CASES = {
    "default": PairSpec(boundaries=32, tokens=2048, hidden=4096, corrupt=20),
    "64_layers": PairSpec(boundaries=64, tokens=2048, hidden=4096, corrupt=20),
    "packed_3x4096": PairSpec(boundaries=32, tokens=2048, hidden=4096, corrupt=20,
                              packed_a=["embed", "layer3", "layer29"], packed_b=["layer3", "layer29", "layer31"]),
    "1m_narrow": PairSpec(boundaries=32, tokens=1_000_000, hidden=8, seq_len=1024, corrupt=20),
}


def measure(name: str, spec: PairSpec, root: str, keep: bool) -> dict:
    d = tempfile.mkdtemp(prefix=f"bench_memory_{name}_", dir=root)
    try:
        a, b, made = write_pair(d, spec)
        argv = [sys.executable, "-m", "tensordiff", "diff", a, b, "--json", "-q", "--backend", "serial"]
        rc, wall, rss, out = child_rss(argv, tensordiff_env())
        try:
            first = (json.loads(out).get("first_divergence") or {}).get("tensor")
        except ValueError:
            first = None
        return {"rss_mb": rss, "wall_s": wall, "exit": rc, "first": first, "bytes": made["bytes"],
                "names_corrupt": rc == 1 and first == f"layer{spec.corrupt}"}
    finally:
        if not keep:
            shutil.rmtree(d, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default=",".join(CASES), help="comma-separated cases (default: all)")
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args()
    names = [n for n in args.only.split(",") if n]
    bad = [n for n in names if n not in CASES]
    if bad:
        print(f"unknown case(s) {bad}; one of {list(CASES)}", file=sys.stderr)
        return 2
    res = Result("bench_memory", {n: vars(CASES[n]) for n in names})
    figures: dict[str, float | int | bool | None] = {}
    print(f"{'case':16} {'trace GB':>9} {'peak RSS MB':>12} {'wall s':>7} exit  names corrupt")
    try:
        for n in names:
            m = measure(n, CASES[n], args.dir, args.keep)
            print(f"{n:16} {m['bytes'] / 1e9:9.2f} {m['rss_mb']:12.0f} {m['wall_s']:7.1f} {m['exit']:4}  "
                  f"{'yes' if m['names_corrupt'] else 'NO (' + str(m['first']) + ')'}")
            figures[f"rss_mb_{n}"] = round(m["rss_mb"], 1)
            figures[f"wall_s_{n}"] = round(m["wall_s"], 2)
            figures[f"names_corrupt_{n}"] = m["names_corrupt"]
    except OSError as e:
        print(f"could not prepare or run a case: {e}", file=sys.stderr)
        return 2
    res.write(args.json, figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
