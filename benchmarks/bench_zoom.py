"""Cost of a zoom (one decoder layer's sub-layer taps) over the plain train-side recording, as a
ratio measured in the same run.

An 8-layer Llama with random weights (built locally, never downloaded) runs a forward over
``--tokens`` tokens under :class:`HFExtractorRecorder`, writing a real trace each time (file
creation, flushes and close included): plain (the default catalog: sketches for every boundary,
values for the draft slots and final_norm), and with ``zoom=<layer>`` (the same plus the layer's 12
taps, full values). Both run once untimed (warm-up), then ``--repeats`` rounds run them in a random
order per round (seeded); the ratio zoom / plain is taken per round, then the median, so machine
noise hits both alike. Goal: under 2x.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_zoom.py [--tokens 2048] [--hidden 512] [--repeats 5] [--json FILE]
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
    ap.add_argument("--zoom", type=int, default=3, help="decoder layer whose taps are recorded")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--device", default="auto")
    ap.add_argument("--seed", type=int, default=0, help="seed of the per-round random order")
    ap.add_argument("--json", metavar="FILE", default=None, help="write the figures as one JSON object")
    args = ap.parse_args(argv)
    if args.repeats < 1 or args.tokens < 1 or args.layers < 8 or args.hidden < 64 or not 0 <= args.zoom < args.layers:
        print("bench_zoom: --repeats and --tokens must be positive, --layers >= 8, --hidden >= 64, "
              "0 <= --zoom < --layers", file=sys.stderr)
        return 2
    res = Result("bench_zoom", config={k: getattr(args, k) for k in (
        "tokens", "layers", "hidden", "zoom", "repeats", "dtype", "device", "seed")})
    try:
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError as e:
        print(f"bench_zoom: needs the torch extra (torch + transformers): {e}", file=sys.stderr)
        return 2

    from tensordiff.recorders.core import Recorder
    from tensordiff.recorders.hf import HFExtractorRecorder, model_info, plan_draft_input

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
    out_dir = tempfile.mkdtemp(prefix="td-bench-zoom-")

    def sync():
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    def recorded(zoom):
        def go() -> tuple[float, int, int]:
            path = os.path.join(out_dir, f"bench-{zoom}.h5")
            sync()
            t0 = time.perf_counter()
            rec = Recorder(path, side="train", model=model_info(model))
            hf = HFExtractorRecorder(model, rec, plan, zoom=zoom)
            hf.run("bench", ids)
            rec.close()
            sync()
            dt = time.perf_counter() - t0
            size, count = os.path.getsize(path), len(rec.defined)
            os.remove(path)
            return dt, size, count
        return go

    modes = {"plain": recorded(None), "zoom": recorded(args.zoom)}
    for fn in modes.values():  # warm-up
        fn()
    times: dict[str, list] = {k: [] for k in modes}
    order = random.Random(args.seed)
    for _ in range(args.repeats):
        for name in order.sample(list(modes), len(modes)):
            times[name].append(modes[name]())
    ratio = statistics.median(z[0] / p[0] for z, p in zip(times["zoom"], times["plain"]))
    figures = {"plain_s": statistics.median(t[0] for t in times["plain"]),
               "zoom_s": statistics.median(t[0] for t in times["zoom"]), "zoom_ratio": ratio,
               "plain_mb": times["plain"][-1][1] / 1e6, "zoom_mb": times["zoom"][-1][1] / 1e6,
               "goal_met": ratio < 2.0}
    res.config.update({"device": device, "threads": torch.get_num_threads(), "torch": torch.__version__})
    res.write(args.json, figures)
    print(f"load average: {os.getloadavg()[0]:.2f} at the end ({res.load_start:.2f} at the start)")
    print(f"zoom cost: {args.tokens} tokens, {n}-layer Llama, hidden {h}, {args.dtype} on {device}, "
          f"zoom layer{args.zoom}, median of {args.repeats} interleaved rounds")
    for name, ts in times.items():
        print(f"  {name:6s} median {statistics.median(t[0] for t in ts):.3f} s, trace {ts[-1][1] / 1e6:.1f} MB, "
              f"{ts[-1][2]} tensors")
    print(f"zoom / plain = {ratio:.2f}x (goal < 2x: {'met' if ratio < 2.0 else 'NOT met'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
