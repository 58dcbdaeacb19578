"""Overhead of the train-side HF recorder, as a ratio of the bare forward measured in the same run.

An 8-layer Llama with random weights (built locally, never downloaded) runs a forward over
2,048 tokens; the same forward is then run under :class:`HFExtractorRecorder` with several value
policies, writing a real trace each time (file creation, flushes and close included). Every mode
runs once untimed (warm-up), then ``--repeats`` rounds run the bare forward and every mode in a
random order per round (seeded); ratios are taken per round against that round's bare forward,
then the median, so machine noise hits all of them alike.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_recorder_overhead.py            # defaults
    PYTHONPATH=. .venv/bin/python benchmarks/bench_recorder_overhead.py --hidden 1024 --repeats 5 --json FILE

Printed per mode: median wall time, overhead = (recorded - bare) / bare, the recorder's own time
(inside its calls: sketch matmul, RMS, host copies, HDF5 appends, close) / bare, and trace size.
``--json FILE`` writes benchmarks/benchjson.py's object; its figures are, per mode key
(``sketches``, ``default``, ``all_values``), ``<key>_overhead`` and ``<key>_recorder_share``.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchjson import Result  # noqa: E402  (benchmarks/ is on sys.path when run as a script)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--device", default="auto")
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    ap.add_argument("--dir", default=None, help="where traces are written (default: a temp dir)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the per-round random order")
    ap.add_argument("--json", metavar="FILE", default=None, help="write the figures as one JSON object")
    args = ap.parse_args(argv)
    if args.repeats < 1 or args.tokens < 1 or args.layers < 8 or args.hidden < 64:
        print("bench_recorder_overhead: --repeats and --tokens must be positive, --layers >= 8, --hidden >= 64",
              file=sys.stderr)
        return 2
    res = Result("bench_recorder_overhead", config={k: getattr(args, k) for k in (
        "tokens", "layers", "hidden", "repeats", "dtype", "device", "threads", "seed")})

    try:
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM
        from transformers.utils import logging as hf_logging
    except ImportError as e:
        print(f"bench_recorder_overhead: needs the torch extra (torch + transformers): {e}", file=sys.stderr)
        return 2

    from tensordiff.recorders.core import Recorder
    from tensordiff.recorders.hf import HFExtractorRecorder, model_info, plan_draft_input

    hf_logging.disable_progress_bar()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    h = args.hidden
    cfg = LlamaConfig(vocab_size=4096, hidden_size=h, intermediate_size=int(h * 2.75) // 64 * 64,
                      num_hidden_layers=args.layers, num_attention_heads=max(1, h // 64),
                      num_key_value_heads=max(1, h // 256), initializer_range=0.3,
                      max_position_embeddings=max(4096, args.tokens))
    model = LlamaForCausalLM(cfg).to(getattr(torch, args.dtype)).to(device).eval()
    ids = torch.randint(0, cfg.vocab_size, (args.tokens,), generator=torch.Generator().manual_seed(1))
    n = args.layers
    plan = plan_draft_input("specforge", [1, n // 2 - 1, n - 4], n)

    def sync():
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    def bare() -> tuple[float, float, int]:
        sync()
        t0 = time.perf_counter()
        with torch.inference_mode():
            model(input_ids=ids[None].to(device), use_cache=False)
        sync()
        return time.perf_counter() - t0, 0.0, 0

    out_dir = args.dir or tempfile.mkdtemp(prefix="td-bench-")

    def recorded(values: str):
        def go() -> tuple[float, float, int]:
            path = os.path.join(out_dir, f"bench-{values}.h5")
            sync()
            t0 = time.perf_counter()
            rec = Recorder(path, side="train", model=model_info(model))
            hf = HFExtractorRecorder(model, rec, plan, values=values)
            hf.run("bench", ids)
            rec.close()
            sync()
            dt = time.perf_counter() - t0
            size = os.path.getsize(path)
            os.remove(path)
            return dt, rec.stats.seconds, size
        return go

    modes = {"bare forward": bare,
             "record, sketches only (+ draft_input values)": recorded("none"),
             "record, default (values for draft slots + final_norm)": recorded("slots"),
             "record, full values for every boundary": recorded("all")}
    keys = {"record, sketches only (+ draft_input values)": "sketches",
            "record, default (values for draft slots + final_norm)": "default",
            "record, full values for every boundary": "all_values"}
    for fn in modes.values():  # warm-up: allocator, kernels, first-touch of memory, first trace files
        fn()
    times: dict[str, list] = {k: [] for k in modes}
    order = random.Random(args.seed)
    for _ in range(args.repeats):
        for name in order.sample(list(modes), len(modes)):
            times[name].append(modes[name]())
    bare_t = [t[0] for t in times["bare forward"]]
    rows = []
    for name, ts in times.items():
        # ratios are taken per round against that round's bare forward, then the median: drift of
        # a shared machine between rounds cancels
        over = [(t[0] - b) / b for t, b in zip(ts, bare_t)]
        own = [t[1] / b for t, b in zip(ts, bare_t)]
        rows.append({"mode": name, "median_s": statistics.median(t[0] for t in ts), "min_s": min(t[0] for t in ts),
                     "overhead_ratio": statistics.median(over), "recorder_time_ratio": statistics.median(own),
                     "trace_mb": ts[-1][2] / 1e6})
    setup = {"tokens": args.tokens, "layers": n, "hidden": h, "dtype": args.dtype, "device": device,
             "threads": torch.get_num_threads(), "repeats": args.repeats, "torch": torch.__version__,
             "draft_plan": list(plan.fed)}
    figures: dict[str, float | int | bool | None] = {"bare_s": statistics.median(bare_t)}
    for r in rows:
        if r["mode"] in keys:
            figures[f"{keys[r['mode']]}_overhead"] = r["overhead_ratio"]
            figures[f"{keys[r['mode']]}_recorder_share"] = r["recorder_time_ratio"]
    res.config.update(setup)
    res.write(args.json, figures)
    print(f"load average: {os.getloadavg()[0]:.2f} at the end ({res.load_start:.2f} at the start)")
    print(f"recorder overhead: {args.tokens} tokens, {n}-layer Llama, hidden {h}, {args.dtype} on {device} "
          f"({setup['threads']} threads), median of {args.repeats}")
    print(f"{'mode':56s} {'median s':>9s} {'min s':>7s} {'overhead':>9s} {'recorder/bare':>14s} {'trace MB':>9s}")
    for r in rows:
        print(f"{r['mode']:56s} {r['median_s']:9.3f} {r['min_s']:7.3f} {r['overhead_ratio']:9.1%} "
              f"{r['recorder_time_ratio']:14.1%} {r['trace_mb']:9.1f}")
    print("overhead = (recorded - bare) / bare per round, median; recorder/bare = time inside the recorder's calls "
          "(sketch matmul, RMS, host copies, HDF5 appends, close) / bare forward of the same round")
    return 0


if __name__ == "__main__":
    sys.exit(main())
