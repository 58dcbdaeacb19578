"""The numeric pass on worker processes: serial vs process pool vs Ray, on this machine, one run.

Writes a seeded pair (``--layers`` boundaries x ``--tokens`` x ``--hidden`` bf16 per side; side B =
A with 1-ulp noise in a quarter of the elements and one corrupted layer), side B also as a trace
set of two DP ranks (``serve.dp0.h5``, ``serve.dp1.h5``, each recording a host). Then, after one
untimed warm-up pass of each, one timed pass of each configuration in random order:

- ``serial``: the diff's own loop (a reader thread one block ahead of the metrics);
- ``pool-1``: one worker process (the per-core rate the scaling model in docs/distributed.md
  uses: a worker reads and computes in one thread);
- ``pool-2``: two worker processes (the speed-up with 2 workers);
- ``pool-2 cold``: the same with a new pool for the pass (what one CLI diff pays: start-up of the
  workers included);
- ``ray-2``: Ray tasks on a local Ray instance with 2 CPUs (already started), B read as the trace
  set, tasks asking for node affinity by the set's hosts;
- ``ray start-up``: ``ray.init`` of a new local instance plus the first task's round trip.

Each figure is printed with the 1-minute load average when it was taken (the machine is shared:
figures from a loaded machine), and every configuration's JSON result is checked identical to the
serial one (a benchmark that got a different answer is not a measurement).

    PYTHONPATH=. .venv/bin/python benchmarks/bench_parallel.py [--layers 16] [--tokens 8192]
        [--hidden 1024] [--seed 0] [--dir /tmp] [--no-ray] [--keep]

Exit status 0 when every configuration agreed with serial, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)


def write_pair(d: str, layers: int, tokens: int, hidden: int, seed: int) -> dict:
    from tensordiff.trace import TraceWriter

    rng = np.random.default_rng(seed)
    model = {"num_layers": layers, "hidden_size": hidden, "architecture": "Bench", "dtype": "bfloat16"}
    paths = {"a": os.path.join(d, "train.h5"), "b": os.path.join(d, "serve.h5")}
    set_dir = os.path.join(d, "serve_set")
    os.makedirs(set_dir, exist_ok=True)
    shards = [os.path.join(set_dir, f"serve.dp{k}.h5") for k in range(2)]
    seqs = 8
    per = tokens // seqs
    ids = rng.integers(1, 30000, tokens)
    ws = {"a": TraceWriter(paths["a"], side="train", model=model, flush_rows=None, flush_seconds=None),
          "b": TraceWriter(paths["b"], side="serve", model=model, flush_rows=None, flush_seconds=None)}
    for k, p in enumerate(shards):
        ws[f"s{k}"] = TraceWriter(p, side="serve", model=model, flush_rows=None, flush_seconds=None,
                                  meta={"ranks": {"dp_rank": k, "dp_size": 2}, "host": f"bench-host-{k}"})
    for w in ws.values():
        for b in range(layers):
            w.define_tensor(f"layer{b}" if b else "embed", hidden, kind="boundary", boundary=b, dtype="bfloat16",
                            sketch=False)
    rows = {}
    for s in range(seqs):
        sl = slice(s * per, (s + 1) * per)
        for key, w in ws.items():
            if key.startswith("s") and int(key[1]) != (s * 2) // seqs:
                continue
            rows.setdefault(key, []).append(w.add_tokens(f"r{s}", np.arange(per), ids[sl], "prefill"))
    x = rng.standard_normal((tokens, hidden), dtype=np.float32)
    for b in range(layers):
        x += 0.1 * rng.standard_normal((tokens, hidden), dtype=np.float32)
        bits_a = (x.view(np.uint32) >> 16).astype(np.uint16)
        bits_b = bits_a.copy()
        flip = rng.random(bits_b.shape) < 0.25
        bits_b[flip] ^= 1                                   # 1-ulp noise in a quarter of the elements
        if b == layers // 2:                                # one corrupted layer
            y = x + 0.5 * rng.standard_normal(x.shape, dtype=np.float32)
            bits_b = (y.view(np.uint32) >> 16).astype(np.uint16)
        name = f"layer{b}" if b else "embed"
        ws["a"].append(name, np.concatenate(rows["a"]), bits_a)
        ws["b"].append(name, np.concatenate(rows["b"]), bits_b)
        half = tokens // 2
        ws["s0"].append(name, np.concatenate(rows["s0"]), bits_b[:half])
        ws["s1"].append(name, np.concatenate(rows["s1"]), bits_b[half:])
    for w in ws.values():
        w.close()
    return {"a": paths["a"], "b": paths["b"], "set": set_dir, "bytes": 2 * layers * tokens * hidden * 2}


def load() -> float:
    return os.getloadavg()[0]


def timed(fn):
    la = load()
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, la, out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--no-ray", action="store_true")
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()

    from tensordiff.cli import jsonable
    from tensordiff.diff import DiffOptions, diff_traces
    from tensordiff.parallel import PoolBackend

    d = tempfile.mkdtemp(prefix="bench-parallel-", dir=args.dir)
    try:
        t0 = time.perf_counter()
        data = write_pair(d, args.layers, args.tokens, args.hidden, args.seed)
        mb = data["bytes"] / 1e6
        print(f"data: {args.layers} x {args.tokens} x {args.hidden} bf16 per side, {mb:.0f} MB both sides, "
              f"written in {time.perf_counter() - t0:.1f} s; cores {os.cpu_count()}; load {load():.2f}")

        def result(b_path: str, backend=None) -> str:
            res = diff_traces(data["a"], b_path, DiffOptions(backend=backend))
            d_ = jsonable(res.to_dict())
            for side in ("a", "b"):
                d_[side].pop("path")
            return json.dumps(d_)

        pools = {1: PoolBackend(1), 2: PoolBackend(2)}
        ray_backend = None
        ray_startup = None
        if not args.no_ray:
            import ray

            from tensordiff.ray_backend import RayBackend

            os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a local instance only: no token file
            os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
            la = load()
            t0 = time.perf_counter()
            # one node holding both shards' hosts: every task asks for (soft) affinity to it
            ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _temp_dir=os.path.join(d, "ray"),
                     resources={"host:bench-host-0": 1, "host:bench-host-1": 1})
            init_s = time.perf_counter() - t0
            ray_backend = RayBackend()
            t1 = time.perf_counter()
            ray.get(ray.remote(lambda: 1).remote())
            ray_startup = (init_s, time.perf_counter() - t1, la)

        configs = {
            "serial": lambda: result(data["b"]),
            "pool-1": lambda: result(data["b"], pools[1]),
            "pool-2": lambda: result(data["b"], pools[2]),
            "pool-2 cold": lambda: _cold(result, data["b"]),
        }
        if ray_backend is not None:
            configs["ray-2 (set)"] = lambda: result(data["set"], ray_backend)
            configs["serial (set)"] = lambda: result(data["set"])
        ref = {}
        for name, fn in configs.items():          # warm-up (page cache, pools started, imports)
            ref[name] = fn()
        order = list(configs)
        random.Random(args.seed).shuffle(order)
        timings = {}
        for name in order:
            timings[name] = timed(configs[name])
        base = timings["serial"][0]
        ok = True
        print(f"{'configuration':<16} {'seconds':>8} {'MB/s':>8} {'vs serial':>10} {'load':>6}  same result")
        for name in configs:
            s, la, out = timings[name]
            same = out == (ref["serial (set)"] if "set" in name else ref["serial"]) == ref[name]
            ok &= same
            print(f"{name:<16} {s:8.2f} {mb / s:8.0f} {base / s:9.2f}x {la:6.2f}  {'yes' if same else 'NO'}")
        if ray_startup is not None:
            init_s, first_s, la = ray_startup
            print(f"ray start-up: ray.init of a local instance {init_s:.2f} s, first task round trip {first_s:.2f} s "
                  f"(load {la:.2f})")
            pl = ray_backend.placements
            print(f"ray placements: {len(pl)} tasks, {sum(p.node is not None for p in pl)} with soft node affinity "
                  f"(hosts {sorted({str(p.host) for p in pl})})")
        pool1 = timings["pool-1"][0]
        print(f"per-core rate (pool-1): {mb / pool1:.0f} MB/s of both sides' stored bytes, "
              f"{args.tokens * args.layers / pool1:.0f} token rows/s at hidden {args.hidden}")
        print("figures from a loaded, shared machine; one run; load = 1-minute load average when each was taken")
        for p in pools.values():
            p.close()
        if ray_backend is not None:
            ray_backend.close()
            import ray

            ray.shutdown()
        return 0 if ok else 1
    finally:
        if not args.keep:
            shutil.rmtree(d, ignore_errors=True)


def _cold(result, b_path: str) -> str:
    from tensordiff.parallel import PoolBackend

    with PoolBackend(2) as p:
        return result(b_path, p)


if __name__ == "__main__":
    sys.exit(main())
