"""Identity search time (goal: <= 0.5 s at 100k tokens, <= 2 s at 1M tokens, with 62 catalog
states per side and a 3-slot packed tensor).

Writes a seeded pair (benchmarks/model_pair.py): 60 layers, boundaries embed..layer60 plus
final_norm (62 catalog states per side), bf16, ``--hidden`` wide (default 8: the search's cost
is per candidate and per token, and a 62-state catalog at 1M tokens is 1.7 GB per side at width
8), sequences of 1024 tokens, and a packed draft input [T, 3 x H] whose train slots hold
``embed, layer3, layer31`` and whose serve slots hold ``layer3, layer31, layer59`` (the founding
EAGLE-3 case). Then, in one process, as ``tensordiff diff`` does it: open, align, row maps of
every paired tensor (built once per diff; the numeric pass builds them before identity runs:
timed apart as ``maps_s``), and the identity of every slot of both sides (124 candidates x 5
offsets x 3 slots per side): an untimed warm-up, then ``--repeat`` timed runs, median.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_identity.py [--tokens 100000,1000000] [--hidden 8]
        [--repeat 5] [--dir /tmp] [--keep] [--json FILE]

Checks every verdict: serve's slot k holds its state (layer3, layer31, layer59), train's its own.
Figures: ``seconds_100k``, ``seconds_1m`` (and ``maps_s_*``, ``verdicts_ok_*``). Exit 0 when it
measured, 2 when it could not.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from benchjson import Result  # noqa: E402
from model_pair import PairSpec, write_pair  # noqa: E402

HELD_A = ["embed", "layer3", "layer31"]
HELD_B = ["layer3", "layer31", "layer59"]


def key(tokens: int) -> str:
    return f"{tokens // 1_000_000}m" if tokens % 1_000_000 == 0 else f"{tokens // 1000}k"


def measure(tokens: int, hidden: int, repeat: int, root: str, keep: bool) -> dict:
    from tensordiff.align import RowMaps, SideTokens, align_tokens, pair_tensors, sample_indices
    from tensordiff.catalog import IdentitySearch
    from tensordiff.diff import IDENTITY_SAMPLE
    from tensordiff.trace import TraceReader

    d = tempfile.mkdtemp(prefix=f"bench_identity_{key(tokens)}_", dir=root)
    try:
        spec = PairSpec(boundaries=61, num_layers=60, final_norm=True, tokens=tokens, hidden=hidden, seq_len=1024,
                        packed_a=HELD_A, packed_b=HELD_B)
        a, b, made = write_pair(d, spec)
        with TraceReader(a) as ra, TraceReader(b) as rb:
            sa, sb = SideTokens(ra), SideTokens(rb)
            al = align_tokens(ra, rb, (sa, sb))
            maps = RowMaps(al, ra, rb, sa, sb)
            pairs, _ = pair_tensors(ra, rb)
            everything = np.arange(len(al))
            t0 = time.perf_counter()
            for ia, ib in pairs:   # what the numeric pass does first
                maps.rows_at("a", ia.name, [everything])
                maps.rows_at("b", ib.name, [everything])
            maps_s = time.perf_counter() - t0
            ia, ib = next((x, y) for x, y in pairs if x.kind == "packed")
            (ma,), (mb,) = maps.rows_at("a", ia.name, [everything]), maps.rows_at("b", ib.name, [everything])
            sample = sample_indices((ma >= 0) & (mb >= 0), IDENTITY_SAMPLE)
            search = IdentitySearch(ra, rb, maps, lambda *_: None)
            times, ok = [], True
            for i in range(repeat + 1):
                t0 = time.perf_counter()
                va = search.identify("a", ia, [0, 1, 2], sample)
                vb = search.identify("b", ib, [0, 1, 2], sample)
                if i:
                    times.append(time.perf_counter() - t0)
                ok = ok and all(va[s].outcome == "holds" and va[s].best == HELD_A[s] for s in range(3)) \
                    and all(vb[s].outcome == "holds" and vb[s].best == HELD_B[s] for s in range(3))
            return {"seconds": statistics.median(times), "all": times, "maps_s": maps_s, "maps_built": maps.built,
                    "ok": ok, "bytes": made["bytes"], "candidates": len(search.cat_a.states) + len(search.cat_b.states)}
    finally:
        if not keep:
            shutil.rmtree(d, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="100000,1000000")
    ap.add_argument("--hidden", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args()
    try:
        sizes = [int(x) for x in args.tokens.split(",") if x]
    except ValueError:
        print("--tokens: comma-separated integers", file=sys.stderr)
        return 2
    res = Result("bench_identity", {"tokens": sizes, "hidden": args.hidden, "repeat": args.repeat,
                                    "states_per_side": 62, "slots": 3, "seq_len": 1024})
    figures: dict[str, float | int | bool | None] = {}
    print(f"{'tokens':>9} {'identity s (median)':>20} {'row maps s':>11} {'maps built':>10} verdicts")
    try:
        for n in sizes:
            m = measure(n, args.hidden, args.repeat, args.dir, args.keep)
            print(f"{n:9d} {m['seconds']:20.3f} {m['maps_s']:11.3f} {m['maps_built']:10d} "
                  f"{'ok' if m['ok'] else 'WRONG'}   (runs: {', '.join(f'{t:.3f}' for t in m['all'])})")
            k = key(n)
            figures[f"seconds_{k}"] = round(m["seconds"], 4)
            figures[f"maps_s_{k}"] = round(m["maps_s"], 4)
            figures[f"verdicts_ok_{k}"] = m["ok"]
    except OSError as e:
        print(f"could not prepare or measure: {e}", file=sys.stderr)
        return 2
    res.write(args.json, figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
