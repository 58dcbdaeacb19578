#!/usr/bin/env python3
"""Recorder overhead inside real SGLang on this machine's CPU: generation time with and without
recording, as a ratio, in one run.

One engine is started with the tensordiff plugin (``TENSORDIFF_TRACE`` set). Each round generates
the same batch twice, once with recording paused (``engine.collective_rpc("tensordiff_pause")``:
the hooks stay installed and return at their first line) and once recording; the order alternates
between rounds, the radix cache is off so both runs do the same work, and a first untimed round
warms up (EAGLE's first generate compiles). Reported: the median of the per-round ratios
recorded / bare, the ratio of the fastest runs of each kind (the least disturbed by other load on a
shared machine), and the plugin's own time per round (seconds inside its hooks, catalog taps and
flushes, from the trace's ``tensordiff_sglang`` attribute) over the fastest bare generation
(``plugin_share``, the figure benchmarks/goals.py reads).

With predictions on (``--topk`` not 0) each round also generates the batch recording without them
(``engine.collective_rpc("tensordiff_resume", topk=0)``, in the same engine, in the round's random
order): ``plugin_share_no_topk`` is that generation's plugin time over the same fastest bare
generation, so the taps' cost is the difference of two figures measured side by side
(``--no-topk0`` leaves these rounds out).

    PYTHONPATH=. .venv/bin/python benchmarks/bench_sglang_overhead.py [--mode capture|eagle]
        [--hidden 512] [--layers 8] [--catalog] [--topk 20] [--no-topk0] [--rounds 5] [--json FILE]
        [--profile FILE] [--rl on|off]

``--json FILE`` writes one object per benchmarks/benchjson.py (bench, commit, dirty, load,
config, figures); ``--profile FILE`` sets ``TENSORDIFF_PROFILE`` (a cProfile stats file of the
plugin's own code in the scheduler process: ``python -m pstats FILE``). The order of the bare and
the recorded generation is random per round (seeded by ``--seed``).

Uses the test-only sgl_kernel stand-in and tiny random checkpoints of tests/sglang_support.py
(nothing is downloaded). Needs scripts/install-sglang-cpu.sh.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import engine_bench  # noqa: E402
import sglang_support as sup  # noqa: E402
from benchjson import Result  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=("capture", "eagle"), default="capture",
                    help="capture: target with aux capture; eagle: EAGLE-3 with a tiny draft")
    engine_bench.add_model_args(ap)
    ap.add_argument("--rounds", "--repeat", dest="rounds", type=int, default=7, help="timed rounds")
    ap.add_argument("--seed", type=int, default=0, help="seed of the per-round order")
    ap.add_argument("--topk", type=int, default=None, help="TENSORDIFF_TOPK (default: the plugin's, 20; 0: no predictions)")
    ap.add_argument("--no-topk0", action="store_true",
                    help="leave out the generation recorded without predictions (plugin_share_no_topk)")
    ap.add_argument("--profile", help="TENSORDIFF_PROFILE: write a cProfile stats file of the plugin's own code")
    ap.add_argument("--catalog", action="store_true", help="also record the per-boundary catalog (sketches)")
    ap.add_argument("--values", default=None,
                    help="TENSORDIFF_VALUES (default: the plugin's, aux_hidden_states,draft_input,draft_fc_output)")
    ap.add_argument("--rl", choices=("on", "off"), default="on",
                    help="the RL records (TENSORDIFF_RL: sampled token's log-prob, sampling, weight fingerprints); "
                         "every generation asks for log-probs either way, as an RL framework does, so the engine "
                         "does the same work and the difference of two runs is the records' cost")
    ap.add_argument("--workdir", help="where the checkpoints and the trace go (default: a temp dir)")
    ap.add_argument("--json", metavar="FILE", help="write the result as one JSON object (the benchmark contract)")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error("--rounds must be >= 1")
    load_start = os.getloadavg()[0]
    result = Result(Path(__file__).stem, {
        "mode": args.mode, "hidden": args.hidden, "layers": args.layers, "vocab": args.vocab, "batch": args.batch,
        "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "catalog": args.catalog,
        "values": args.values or "aux_hidden_states,draft_input,draft_fc_output",
        "topk": 20 if args.topk is None else args.topk, "rounds": args.rounds, "seed": args.seed,
        "topk0_rounds": not args.no_topk0 and args.topk != 0, "rl": args.rl})

    if not sup.sglang_available():
        print("bench_sglang_overhead: SGLang (and torch) are not installed (scripts/install-sglang-cpu.sh); "
              "nothing measured", file=sys.stderr)
        return 2
    sup.prepare_cpu_env()
    with tempfile.TemporaryDirectory(prefix="tensordiff-bench-sglang-") as tmp:
        root = Path(args.workdir or tmp)
        root.mkdir(parents=True, exist_ok=True)
        trace = root / "bench.h5"
        os.environ.update(SGLANG_PLUGINS="tensordiff", TENSORDIFF_TRACE=str(trace),
                          TENSORDIFF_CATALOG="1" if args.catalog else "0", TENSORDIFF_RL="1" if args.rl == "on" else "0")
        if args.values is not None:
            os.environ["TENSORDIFF_VALUES"] = args.values
        if args.topk is not None:
            os.environ["TENSORDIFF_TOPK"] = str(args.topk)
        if args.profile:
            os.environ["TENSORDIFF_PROFILE"] = str(Path(args.profile).resolve())
        built = engine_bench.build(root, args, draft=args.mode == "eagle")
        target, prompts, ids = built["target"], built["prompts"], built["ids"]
        common = dict(chunked_prefill_size=4096, max_total_tokens=max(4096, 2 * args.batch *
                                                                     (args.prompt_len + args.new_tokens)),
                      disable_radix_cache=True, log_level="error")
        if args.mode == "eagle":
            engine = sup.start_eagle3_engine(target, built["draft"], **common)
        else:
            engine = sup.start_capture_engine(target, ids, **common)
        sp = {"temperature": 0, "max_new_tokens": args.new_tokens}

        topk = 20 if args.topk is None else args.topk
        kinds = ["bare", "recorded"] + (["recorded_no_topk"] if not args.no_topk0 and topk else [])

        def gen(kind: str) -> float:
            if kind == "bare":
                engine.collective_rpc("tensordiff_pause")
            elif len(kinds) == 2:
                engine.collective_rpc("tensordiff_resume")
            else:  # predictions on and off in the same engine
                engine.collective_rpc("tensordiff_resume", topk=topk if kind == "recorded" else 0)
            t0 = time.perf_counter()
            engine.generate(input_ids=prompts, sampling_params=sp, return_logprob=True)
            return time.perf_counter() - t0

        try:
            for kind in ("recorded", *kinds[2:], "bare"):  # warm-up (EAGLE compiles on its first generate)
                gen(kind)
            rounds = []
            pick = random.Random(args.seed)
            for _ in range(args.rounds):
                order = list(kinds)
                pick.shuffle(order)
                t = {kind: gen(kind) for kind in order}
                rounds.append({"bare_s": t["bare"], "recorded_s": t["recorded"], "ratio": t["recorded"] / t["bare"],
                               **({"recorded_no_topk_s": t["recorded_no_topk"]} if len(kinds) == 3 else {})})
            engine.collective_rpc("tensordiff_close")
        finally:
            engine.shutdown()
        from tensordiff.trace import TraceReader

        with TraceReader(str(trace)) as r:
            stats = json.loads(r.f.attrs["tensordiff_sglang"])
            rows = int(len(r.tokens))
            tensors = sorted(r.tensors)
        size = trace.stat().st_size
    bare = [x["bare_s"] for x in rounds]
    recorded = [x["recorded_s"] for x in rounds]
    # the plugin time covers the warm-up round too: scale it to the timed rounds
    by_k = stats.get("plugin_seconds_by_topk", {})
    if len(kinds) == 3:
        plugin_s, plugin_s0 = by_k.get(str(topk), 0.0), by_k.get("0", 0.0)
    else:
        plugin_s, plugin_s0 = stats["plugin_seconds"], None
    plugin_per_round = plugin_s / (args.rounds + 1)
    res = {"mode": args.mode, "hidden": args.hidden, "layers": args.layers, "batch": args.batch,
           "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "catalog": args.catalog,
           "values": os.environ.get("TENSORDIFF_VALUES", "aux_hidden_states,draft_input,draft_fc_output"), "rounds": rounds,
           "median_ratio": statistics.median(x["ratio"] for x in rounds), "min_ratio": min(recorded) / min(bare),
           "plugin_seconds": plugin_s, "recorder_seconds": stats["recorder_seconds"],
           "plugin_share_of_bare": plugin_per_round / min(bare), "trace_rows": rows, "trace_bytes": size,
           "plugin_seconds_no_topk": plugin_s0, "sketch_products": stats.get("sketch_products"),
           "sketch_reused": stats.get("sketch_reused"),
           "tensors": tensors, "topk": int(os.environ.get("TENSORDIFF_TOPK", "20")),
           "rl_fingerprint_seconds": (stats.get("rl") or {}).get("fingerprint_seconds")}
    result.write(args.json, figures(args, res))
    print(f"SGLang {args.mode} on CPU: hidden {args.hidden}, {args.layers} layers, batch {args.batch} x "
          f"{args.prompt_len} prompt + {args.new_tokens} new tokens, catalog {'on' if args.catalog else 'off'}, "
          f"values {res['values']}, top-k {res['topk']}")
    for i, x in enumerate(rounds):
        no_topk = f", recorded without top-k {x['recorded_no_topk_s']:.3f} s" if "recorded_no_topk_s" in x else ""
        print(f"  round {i}: bare {x['bare_s']:.3f} s, recorded {x['recorded_s']:.3f} s, ratio {x['ratio']:.3f}"
              f"{no_topk}")
    print(f"recorded / bare generation time: median of rounds {res['median_ratio']:.3f}, "
          f"fastest recorded / fastest bare {res['min_ratio']:.3f}")
    print(f"plugin's own time (hooks, catalog taps, sketches, HDF5 writes and flushes): {plugin_per_round:.3f} s per "
          f"round = {100 * res['plugin_share_of_bare']:.1f}% of the fastest bare generation")
    if plugin_s0 is not None:
        p0 = plugin_s0 / (args.rounds + 1)
        print(f"  without top-k predictions (same engine, same rounds): {p0:.3f} s per round = "
              f"{100 * p0 / min(bare):.1f}% of the fastest bare generation")
    if res["rl_fingerprint_seconds"] is not None:
        print(f"RL records on: weight fingerprints at start {res['rl_fingerprint_seconds']:.3f} s (once per weight "
              "sync, not in the plugin's time per round)")
    print(f"sketch products {res['sketch_products']}, sketches reused {res['sketch_reused']}")
    print(f"trace: {rows} token rows, {len(tensors)} tensors, {size / 1e6:.1f} MB")
    print(f"load average (1 min): {load_start:.2f} at start, {os.getloadavg()[0]:.2f} at end")
    return 0


def figures(args, res: dict) -> dict:
    """The figures of the --json result: plugin_share (the goal's), the wall ratios and seconds."""
    bare = [x["bare_s"] for x in res["rounds"]]
    extra = {}
    if res["plugin_seconds_no_topk"] is not None:
        p0 = res["plugin_seconds_no_topk"] / (args.rounds + 1)
        extra = {"plugin_share_no_topk": p0 / min(bare), "plugin_s_per_round_no_topk": p0,
                 "recorded_no_topk_median_s": statistics.median(x["recorded_no_topk_s"] for x in res["rounds"])}
    return {"plugin_share": res["plugin_share_of_bare"], "median_ratio": res["median_ratio"],
            "min_ratio": res["min_ratio"], "plugin_s_per_round": res["plugin_seconds"] / (args.rounds + 1),
            "bare_min_s": min(bare), "bare_median_s": statistics.median(bare),
            "recorded_median_s": statistics.median(x["recorded_s"] for x in res["rounds"]),
            "trace_rows": res["trace_rows"], "trace_bytes": res["trace_bytes"],
            "rl_fingerprint_s": res["rl_fingerprint_seconds"], **extra}


if __name__ == "__main__":
    sys.exit(main())
