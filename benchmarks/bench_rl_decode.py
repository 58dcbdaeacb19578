"""Sensitivity of rollout against replay to a decode-only bug: an ROC, not a timed benchmark.

Real SGLang 0.5.23 on the CPU serves the trained tiny Llama (scripts/train_tiny_models.py) in
bfloat16, sampled at temperature 1 with the RL records on (`tensordiff record serve`), then
computes the same tokens again as prefill (`record serve --replay`). The prefill rows of the two
are the same computation; the decode rows differ by the engine's decode kernels only. A
test-only SGLang plugin (tests/sglang_support.py ``perturb_plugin``) scales one decoder layer's
attention output on decode passes: a decode-path bug that the replay never sees. Every pair is
diffed with ``tensordiff diff --json`` in both argument orders:

    PYTHONPATH=. .venv/bin/python benchmarks/bench_rl_decode.py [--scales 1.02 1.05 1.1 1.2 1.5]
        [--layers 3] [--seeds 7 8 9] [--dir D] [--keep] [--json FILE]
    PYTHONPATH=. .venv/bin/python benchmarks/bench_rl_decode.py --rediff D [--json FILE]

- correct pairs: one rollout and its replay per ``--seeds`` (other sampled tokens, other decode
  paths); every exit 1 is a false alarm;
- bugs: for each layer and scale, a rollout and replay on the perturbed engine (the first seed).
  Found = exit 1 with the first divergence at the output of that layer (``layer<L+1>``).
  Magnitude: the worst relative error of ``layer<L+1>``'s tokens in the bug's pair over the worst
  of the correct pairs at the same state (``x noise``).

``--rediff D`` diffs the pairs recorded in ``D`` (by an earlier ``--dir D --keep``) again with this
checkout's code: the same traces, judged by two versions of the noise model. Exit 0 whatever the
figures (2 when a recording fails).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path[:0] = [str(HERE), str(REPO / "tests")]

N_PROMPTS, MAX_NEW = 4, 8


def _record(root: Path, seeds: list[int], layers: list[int], scales: list[float]) -> list[dict[str, Any]]:
    import sglang_support as sup
    import trained

    target = trained.target_dir()
    prompts = {f"p{i}": p for i, p in enumerate(trained.prompts()[:N_PROMPTS])}
    pairs: list[dict[str, Any]] = []
    for seed in seeds:
        tmp = root / f"correct-seed{seed}"
        tmp.mkdir(parents=True, exist_ok=True)
        ro = sup.rl_serve(target, prompts, tmp, "rollout", max_new=MAX_NEW, seed=seed)
        rp = sup.rl_serve(target, prompts, tmp, "replay", max_new=MAX_NEW, replay=Path(ro["trace"]))
        pairs.append({"name": f"correct seed {seed}", "bug": None, "rollout": ro["trace"], "replay": rp["trace"]})
        print(f"recorded {pairs[-1]['name']}", flush=True)
    for layer in layers:
        for scale in scales:
            tmp = root / f"bug-l{layer}-x{scale:g}"
            tmp.mkdir(parents=True, exist_ok=True)
            pair = sup.rl_perturbed_pair(target, prompts, tmp, layer=layer, scale=scale, max_new=MAX_NEW, seed=seeds[0])
            pairs.append({"name": f"layer {layer} decode attention x{scale:g}", "bug": {"layer": layer, "scale": scale},
                          "rollout": pair["rollout"]["trace"], "replay": pair["replay"]["trace"]})
            print(f"recorded {pairs[-1]['name']}", flush=True)
    (root / "pairs.json").write_text(json.dumps(pairs, indent=1))
    return pairs


def _worst(doc: dict | None) -> dict[str, float]:
    """The worst relative error of each compared tensor, by label."""
    res = (doc or {}).get("result", doc or {})
    return {t["label"]: float(t["rel_max"][0]) for t in res.get("tensors", []) if t.get("label") and t.get("rel_max")}


def _judge(pairs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    import sglang_support as sup

    rows = []
    for p in pairs:
        for order in ("rollout,replay", "replay,rollout"):
            a, b = order.split(",")
            rc, doc, err = sup.diff_json(p[a], p[b])
            res = (doc or {}).get("result", doc or {})
            first = res.get("first_divergence") or {}
            rows.append({"pair": p["name"], "bug": p["bug"], "order": order, "exit": rc, "worst": _worst(doc),
                         "first": json.dumps(first)[:400], "headline": (res.get("headline") or err.strip())[:160]})
    correct = [r for r in rows if r["bug"] is None]
    for r in rows:
        if r["bug"] is None:
            continue
        label = f"layer{r['bug']['layer'] + 1}"
        noise = max((c["worst"].get(label, 0.0) for c in correct), default=0.0)
        moved = r["worst"].get(label, float("nan"))
        r["label"], r["x_noise"] = label, moved / noise if noise > 0 else float("inf")
        r["found"] = r["exit"] == 1 and re.search(rf"\b{label}\b", r["first"]) is not None
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scales", nargs="*", type=float, default=[1.02, 1.05, 1.1, 1.2, 1.5])
    ap.add_argument("--layers", nargs="*", type=int, default=[3])
    ap.add_argument("--seeds", nargs="*", type=int, default=[7, 8, 9])
    ap.add_argument("--dir", help="work directory (default: a temporary one)")
    ap.add_argument("--keep", action="store_true", help="keep the traces")
    ap.add_argument("--rediff", metavar="DIR", help="judge the pairs an earlier --dir DIR --keep recorded")
    ap.add_argument("--json", help="write the figures here (benchmarks/benchjson.py)")
    args = ap.parse_args(argv)
    if not args.rediff and not args.seeds:
        ap.error("--seeds needs at least one seed: the correct pairs are the bugs' noise reference")

    from benchjson import Result, machine_text

    res = Result("bench_rl_decode", config={"scales": args.scales, "layers": args.layers, "seeds": args.seeds,
                                            "rediff": bool(args.rediff)})
    print(f"machine: {machine_text(res.machine)}; commit {res.commit}{' (dirty)' if res.dirty else ''}", flush=True)
    if args.rediff:
        pairs = json.loads((Path(args.rediff) / "pairs.json").read_text())
        rows = _judge(pairs)
    else:
        keep = args.keep or bool(args.dir)
        root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="td-rl-decode-"))
        try:
            pairs = _record(root, args.seeds, args.layers, args.scales)
        except AssertionError as e:
            print(f"error: a recording failed: {str(e)[-1500:]}", file=sys.stderr)
            return 2
        rows = _judge(pairs)
        if keep:
            print(f"traces kept in {root} (judge them again with --rediff {root})", flush=True)
        else:
            import shutil

            shutil.rmtree(root, ignore_errors=True)

    print(f"\n{'pair':34s} {'order':15s} exit  {'x noise':>8s}  found  headline")
    for r in rows:
        xn = f"{r['x_noise']:8.1f}" if "x_noise" in r else " " * 8
        found = ("yes" if r["found"] else "NO") if r["bug"] else ("-" if r["exit"] == 0 else "FALSE ALARM")
        print(f"{r['pair']:34s} {r['order']:15s} {r['exit']:4d}  {xn}  {found:5s}  {r['headline'][:90]}")
    false_alarms = sum(1 for r in rows if r["bug"] is None and r["exit"] != 0)
    bugs = [r for r in rows if r["bug"]]
    print(f"\ncorrect pairs: {false_alarms} false alarms in {sum(1 for r in rows if r['bug'] is None)} diffs; "
          f"bugs: {sum(r['found'] for r in bugs)} of {len(bugs)} found at their layer")
    for b in sorted({(r["bug"]["layer"], r["bug"]["scale"]) for r in bugs}):
        rs = [r for r in bugs if (r["bug"]["layer"], r["bug"]["scale"]) == b]
        print(f"  layer {b[0]} x{b[1]:g}: {rs[0]['x_noise']:.1f}x noise, found in {sum(r['found'] for r in rs)} of "
              f"{len(rs)} orders")
    if args.json:
        figures: dict[str, float | int | bool | None] = {"false_alarms": false_alarms, "correct_diffs": len(rows) - len(bugs),
                                                         "found": sum(r["found"] for r in bugs), "bug_diffs": len(bugs)}
        for r in bugs:
            key = f"l{r['bug']['layer']}_x{r['bug']['scale']:g}_{r['order'].replace(',', '_vs_')}"
            figures[f"{key}_found"], figures[f"{key}_x_noise"] = bool(r["found"]), float(r["x_noise"])
        res.write(args.json, figures=figures)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
