"""Narrow tensors (goal: >= 1M tokens/s per tensor pair at 1M tokens x 8 wide).

Writes a seeded pair (benchmarks/model_pair.py): ``--layers`` boundaries x ``--tokens`` tokens x
``--hidden`` wide, bf16, sequences of 1024 tokens, side B with +-1 ulp noise and one corrupted
boundary. Then, interleaved after an untimed warm-up of each, ``--repeat`` rounds in random order:

1. ``in-process``: ``diff_traces(A, B)`` in a process that has imported tensordiff (timed inside);
2. ``CLI``: ``python -m tensordiff diff A B --json -q --backend serial`` end to end, peak RSS
   from ``os.wait4``.

``tokens_per_s`` = tokens x tensor pairs / in-process seconds (median): the rate at which each
pair's tokens are aligned, compared and judged, fixed costs (open, alignment) included. Also
``cli_tokens_per_s`` and ``rss_mb`` (CLI). Each run must exit 1 and name the corrupted boundary.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_narrow.py [--tokens 1000000] [--hidden 8]
        [--layers 8] [--repeat 3] [--seed 0] [--dir /tmp] [--keep] [--json FILE]

Exit 0 when it measured, 2 when it could not.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from benchjson import Result  # noqa: E402
from model_pair import PairSpec, child_rss, tensordiff_env, write_pair  # noqa: E402

INPROC = """
import json, sys, time
t0 = time.perf_counter()
from tensordiff.diff import diff_traces
r = diff_traces(sys.argv[1], sys.argv[2])
print(json.dumps({"seconds": time.perf_counter() - t0, "first": r.first_divergence.tensor if r.first_divergence else None}))
"""


def inproc(a: str, b: str) -> tuple[float, str | None]:
    """Seconds of diff_traces in a fresh process, timed after the import."""
    pre = "import tensordiff.diff\n"   # imported before the clock starts
    p = subprocess.run([sys.executable, "-c", pre + INPROC, a, b], capture_output=True, text=True,
                       env=tensordiff_env(), check=False)
    if p.returncode != 0:
        raise RuntimeError(f"in-process diff failed: {p.stderr[-400:]}")
    doc = json.loads(p.stdout.strip().splitlines()[-1])
    return float(doc["seconds"]), doc["first"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=1_000_000)
    ap.add_argument("--hidden", type=int, default=8)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args()
    corrupt = min(5, args.layers - 1)
    spec = PairSpec(boundaries=args.layers, tokens=args.tokens, hidden=args.hidden, seq_len=1024, corrupt=corrupt,
                    seed=args.seed)
    res = Result("bench_narrow", {"tokens": args.tokens, "hidden": args.hidden, "layers": args.layers,
                                  "repeat": args.repeat, "seq_len": 1024, "corrupt": corrupt})
    d = tempfile.mkdtemp(prefix="bench_narrow_", dir=args.dir)
    try:
        a, b, made = write_pair(d, spec)
        argv = [sys.executable, "-m", "tensordiff", "diff", a, b, "--json", "-q", "--backend", "serial"]
        want = f"layer{corrupt}"
        times: dict[str, list[float]] = {"in-process": [], "CLI": []}
        rss: list[float] = []
        named = True
        rng = random.Random(args.seed)
        for rnd in range(args.repeat + 1):   # round 0: the untimed warm-up
            order = ["in-process", "CLI"]
            rng.shuffle(order)
            for what in order:
                if what == "in-process":
                    t, first = inproc(a, b)
                else:
                    rc, t, r, out = child_rss(argv, tensordiff_env())
                    first = (json.loads(out).get("first_divergence") or {}).get("tensor") if rc == 1 else None
                    rss.append(r)
                named = named and first == want
                if rnd:
                    times[what].append(t)
    except (OSError, RuntimeError, ValueError) as e:
        print(f"could not prepare or measure: {e}", file=sys.stderr)
        return 2
    finally:
        if not args.keep:
            shutil.rmtree(d, ignore_errors=True)
    pairs = args.layers
    med = {k: statistics.median(v) for k, v in times.items()}
    tps = args.tokens * pairs / med["in-process"]
    cli_tps = args.tokens * pairs / med["CLI"]
    print(f"{args.layers} pairs x {args.tokens} tokens x {args.hidden} wide ({made['bytes'] / 1e9:.2f} GB both sides)")
    print(f"{'run':12} {'median s':>9} {'tokens/s per pair':>18}   runs")
    for k, t in med.items():
        print(f"{k:12} {t:9.2f} {args.tokens * pairs / t:18.3g}   {', '.join(f'{x:.2f}' for x in times[k])}")
    print(f"peak RSS (CLI) {max(rss):.0f} MB; names {want} first: {'yes' if named else 'NO'}")
    res.write(args.json, {"tokens_per_s": round(tps), "cli_tokens_per_s": round(cli_tps), "rss_mb": round(max(rss), 1),
                          "inproc_s": round(med["in-process"], 3), "cli_s": round(med["CLI"], 3), "names_corrupt": named})
    return 0


if __name__ == "__main__":
    sys.exit(main())
