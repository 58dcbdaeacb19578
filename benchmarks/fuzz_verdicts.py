"""A bug fuzzer with ground truth: scenarios drawn from seeds, judged on the verdict of
``tensordiff diff --json``.

    PYTHONPATH=. .venv/bin/python benchmarks/fuzz_verdicts.py [--seed S] [--n N] [--kinds K,K]
        [--models M,M] [--tier fast|slow] [--json F] [--no-progress]

Scenario ``i`` of a run is drawn from seed ``S + i`` alone (``--seed S+i --n 1`` replays it): a
model (the trained tiny Llama, a random-weight Llama, a Qwen3-style model with q/k norm, a tiny
Mixtral), a dtype pair (A/B: fp32/fp32, bf16/fp32, bf16/bf16, fp16/fp32; A runs eager attention,
B SDPA: a port), what is recorded (every catalog state with values, the catalog as sketches, the
packed draft input only), the argument order, a bug kind (benchmarks/fuzz/bugs.py: weights,
config, code, wiring, tokens, or none: a correct pair), a place (layer, projection, slot,
sequence, position) and a size drawn log-uniform from 0.3x to 30x the noise the scenario's own
correct pair shows at the place (kinds without a size knob have the size they have).

Ground truth (benchmarks/fuzz/scenario.py) comes from the generator: B recorded with and without
the bug, the first tensor whose bytes differ in forward order, its size in noise units. Outcomes:
``named`` (the first divergence is at that place, with a compatible kind), ``found_elsewhere``
(a divergence, later or of a less precise kind), ``agree`` (exit 0), ``wrong`` (a confident wrong
cause: upstream of the bug, or a wiring claim for a numeric bug), ``false_alarm`` (a pair with no
recorded difference exiting 1). A miss: wrong, a false alarm, or agree at 3x the noise or more.

Prints a table by kind and by depth, the detection limit per kind (the largest size still judged
``agree``: every bug of that kind above it was found), named_rate_at_3x and the seed of every miss.
``--json F`` writes the figures. Exit 0 whatever the figures; 2 on bad input (one line).
``--tier rl``: trainer/rollout pairs judged on ``tensordiff triage --json`` (benchmarks/fuzz/rl.py;
its kinds: catalog.RL_KINDS; replay a miss with ``--tier rl --seed SEED --n 1``).
``--tier slow``: the bug on the engine side of a real SGLang run on the CPU (a weight of the served
checkpoint, the served config's rope theta or norm eps, the served draft's aux ids), judged against
the HF train side recorded from the engine's outputs (benchmarks/fuzz/engine.py); one engine start
per bug, minutes each.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any, NoReturn

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

from fuzz import catalog as bugs  # noqa: E402
from fuzz.catalog import MODELS  # noqa: E402

OUTCOMES = ("named", "found_elsewhere", "agree", "wrong", "false_alarm")   # as fuzz.scenario judges

DEPTHS = ("shallow", "middle", "deep")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        _fail(message)


def _fail(message: str) -> NoReturn:
    """One line on stderr, exit 2; what came from an argument or a file escaped, a long one cut."""
    from tensordiff.safety import sanitize_for_terminal

    line = sanitize_for_terminal(" ".join(message.split()))
    print(f"fuzz_verdicts: error: {line if len(line) <= 500 else line[:500] + '...'}", file=sys.stderr)
    raise SystemExit(2)


def _names(arg: str | None, known: tuple[str, ...], what: str) -> tuple[str, ...]:
    if arg is None:
        return known
    got = tuple(x.strip() for x in arg.split(",") if x.strip())
    bad = [x for x in got if x not in known]
    if bad or not got:
        raise ValueError(f"unknown {what} {', '.join(bad) or repr(arg)} (one of: {', '.join(known)})")
    return got


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = _Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=None, help="the first scenario's seed (default: fresh, from the clock)")
    ap.add_argument("--n", type=int, default=50, help="scenarios (seeds SEED .. SEED+N-1)")
    ap.add_argument("--kinds", help=f"comma-separated bug kinds (default: all): {', '.join(bugs.KINDS)}; "
                                    f"or families: {', '.join(bugs.FAMILIES)}; with --tier rl: {', '.join(bugs.RL_KINDS)}")
    ap.add_argument("--models", help=f"comma-separated models (default: all): {', '.join(MODELS)}")
    ap.add_argument("--tier", choices=["fast", "slow", "rl"], default="fast",
                    help="fast: HF against HF; slow: HF against real SGLang on the CPU, the bug on the engine side; "
                         "rl: a trainer against its rollout, judged on `tensordiff triage` (benchmarks/fuzz/rl.py)")
    ap.add_argument("--json", help="write the figures and every scenario here")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--report", nargs="+", metavar="F", help="run nothing: print the tables of these --json files together")
    a = ap.parse_args(argv)
    if a.seed is not None and not 0 <= a.seed < 2**62:
        ap.error(f"--seed must be an integer in [0, 2^62), not {a.seed}")
    if a.n < 1:
        ap.error(f"--n must be at least 1, not {a.n}")
    try:
        kinds: tuple[str, ...] = ()
        if a.tier == "rl":
            kinds = _names(a.kinds, tuple(bugs.RL_KINDS), "kind")
        else:
            for k in _names(a.kinds, bugs.KINDS + tuple(f for f in bugs.FAMILIES if f not in bugs.KINDS), "kind"):
                kinds += bugs.FAMILIES.get(k, (k,))
        a.kinds = tuple(dict.fromkeys(kinds))
        a.models = _names(a.models, MODELS, "model")
    except ValueError as e:
        ap.error(str(e))
    if a.json and not Path(a.json).resolve().parent.is_dir():
        ap.error(f"--json: directory {Path(a.json).resolve().parent} does not exist")
    if a.tier == "slow":
        from fuzz.catalog import ENGINE_KINDS
        if a.models != MODELS:
            ap.error("--models: the slow tier runs the trained tiny Llama only (its EAGLE-3 draft is trained)")
        if _kinds_given(argv):
            off = [k for k in a.kinds if k not in ENGINE_KINDS]
            if off:
                ap.error(f"--tier slow injects {', '.join(ENGINE_KINDS)} on the engine side, not {', '.join(off)}")
        else:
            a.kinds = tuple(ENGINE_KINDS)
        import importlib.util
        if any(importlib.util.find_spec(m) is None for m in ("sglang", "torch", "transformers")):
            ap.error("--tier slow runs real SGLang on the CPU: sglang, torch and transformers must be installed "
                     "(scripts/install-sglang-cpu.sh)")
    return a


def _kinds_given(argv: list[str] | None) -> bool:
    return any(x == "--kinds" or x.startswith("--kinds=") for x in (sys.argv[1:] if argv is None else argv))


def _depth(r: dict[str, Any]) -> str:
    if r["family"] in ("wiring", "tokens", "none") or r["family"].startswith("rl-") or \
            r["kind"] in ("weight_stale", "rope_theta", "rotary_dims"):
        return "-"
    from fuzz.models import model
    n = model(r["model"]).layers
    return DEPTHS[min(2, 3 * int(r["layer"]) // n)]


def summarise(results: list[dict[str, Any]]) -> dict[str, Any]:
    counts = Counter(r["outcome"] for r in results)
    bugs_ = [r for r in results if r["kind"] != "none"]
    big = [r for r in bugs_ if r["truth"] == "tokens" or (r["x"] is not None and r["x"] >= 3)]
    per_kind: dict[str, Any] = {}
    for kind in dict.fromkeys(r["kind"] for r in results):
        ks = [r for r in results if r["kind"] == kind]
        c = Counter(r["outcome"] for r in ks)
        agree_x = [r["x"] for r in ks if r["outcome"] == "agree" and r["x"] is not None and r["truth"] != "-"]
        found_x = [r["x"] for r in ks if r["outcome"] in ("named", "found_elsewhere") and r["x"] is not None]
        kb = [r for r in ks if r in big]
        per_kind[kind] = {
            "family": ks[0]["family"], "scenarios": len(ks), **{o: c.get(o, 0) for o in OUTCOMES},
            "detection_limit": max(agree_x) if agree_x else None,
            "smallest_found": min(found_x) if found_x else None,
            "named_rate_at_3x": (sum(r["outcome"] == "named" for r in kb) / len(kb)) if kb else None,
            "misses": [r["seed"] for r in ks if r["miss"]],
        }
    return {
        "scenarios": len(results), **{o if o != "false_alarm" else "false_alarms": counts.get(o, 0) for o in OUTCOMES},
        "misses": sum(r["miss"] for r in results),
        "at_3x": len(big),
        "named_rate_at_3x": (sum(r["outcome"] == "named" for r in big) / len(big)) if big else None,
        "found_rate_at_3x": (sum(r["outcome"] in ("named", "found_elsewhere") for r in big) / len(big)) if big else None,
        "per_kind": per_kind,
        "per_depth": {d: dict(Counter(r["outcome"] for r in bugs_ if _depth(r) == d)) for d in DEPTHS},
    }


def _fx(x: float | None) -> str:
    return "-" if x is None else f"{x:.2g}x" if x < 10 else f"{x:.0f}x"


def print_tables(s: dict[str, Any], results: list[dict[str, Any]], seeds: str) -> None:
    print(f"\n## outcomes by kind ({s['scenarios']} scenarios, {seeds})\n")
    print("| family | kind | scenarios | named | found elsewhere | agree | wrong | false alarm | named at >= 3x "
          "| detection limit (largest x agreed) | smallest x found |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for kind, k in s["per_kind"].items():
        rate = "-" if k["named_rate_at_3x"] is None else f"{k['named_rate_at_3x']:.0%}"
        print(f"| {k['family']} | {kind} | {k['scenarios']} | {k['named']} | {k['found_elsewhere']} | {k['agree']} "
              f"| {k['wrong']} | {k['false_alarm']} | {rate} | {_fx(k['detection_limit'])} | {_fx(k['smallest_found'])} |")
    if any(s["per_depth"].values()):   # the RL tier's kinds have no depth
        print("\n## numeric bugs (weights, config, code) by depth of the injected layer\n")
        print("| depth | named | found elsewhere | agree | wrong |")
        print("|---|---|---|---|---|")
        for d, c in s["per_depth"].items():
            print(f"| {d} | {c.get('named', 0)} | {c.get('found_elsewhere', 0)} | {c.get('agree', 0)} "
                  f"| {c.get('wrong', 0)} |")
    rate = "-" if s["named_rate_at_3x"] is None else f"{s['named_rate_at_3x']:.1%}"
    found = "-" if s["found_rate_at_3x"] is None else f"{s['found_rate_at_3x']:.1%}"
    print(f"\nnamed_rate_at_3x {rate} of {s['at_3x']} bugs at 3x the noise or more (found at all: {found}); "
          f"wrong {s['wrong']}, false alarms {s['false_alarms']}, misses {s['misses']}")
    misses = [r for r in results if r["miss"]]
    if misses:
        tier = " --tier rl" if any(r["order"] in ("TR", "RT") for r in misses) else ""
        print(f"\n## misses (replay one: benchmarks/fuzz_verdicts.py{tier} --seed SEED --n 1)\n")
        for r in misses:
            print(f"- seed {r['seed']}: {r['outcome']} ({r['why']}): {r['kind']} layer {r['layer']} on {r['model']} "
                  f"{r['dtypes']} {r['mode']} {r['order']}, x {_fx(r['x'])}, truth {r['truth']}, "
                  f"first: {r['first'] or '-'}")


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def run(a: argparse.Namespace) -> dict[str, Any]:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    from fuzz import engine as E
    from fuzz import scenario as S
    torch.set_num_threads(1)   # tiny models: threads only contend
    engine = E.Engine() if a.tier == "slow" else None
    seed = a.seed if a.seed is not None else int(time.time() * 1000) % 10**9
    results: list[dict[str, Any]] = []
    t0 = time.monotonic()
    load0 = os.getloadavg()[0]
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    cols = (TextColumn("fuzz"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.description}"), TimeRemainingColumn())
    with Progress(*cols, disable=a.no_progress, transient=True) as bar:
        task = bar.add_task("", total=a.n)
        for i in range(a.n):
            if a.tier == "rl":
                from fuzz import rl as R
                rsc = R.draw(seed + i, a.kinds, a.models)
                kind, where = rsc.kind, rsc.model
                r = R.as_dict(R.execute(rsc))
            elif engine is not None:
                esc = E.draw(seed + i, a.kinds)
                kind, where = esc.kind, "SGLang"
                r = S.as_dict(engine.execute(esc))
            else:
                sc = S.draw(seed + i, a.kinds, a.models)
                kind, where = sc.kind, sc.model
                r = S.as_dict(S.execute(sc))
            results.append(r)
            miss = sum(x["miss"] for x in results)
            bar.update(task, advance=1, description=f"{kind} on {where}; misses {miss}")
            if a.json and (i + 1) % 50 == 0 and i + 1 < a.n:   # a long run killed early keeps what it judged
                Path(a.json).write_text(json.dumps(_finite({"partial": True, "seed": seed, "results": results})) + "\n")
    if engine is not None:
        engine.close()
    s = summarise(results)
    print_tables(s, results, f"seeds {seed}..{seed + a.n - 1}")
    seconds = time.monotonic() - t0
    print(f"\n{a.n} scenarios in {seconds:.0f} s at commit {_commit()}; load {load0:.2f} -> {os.getloadavg()[0]:.2f}")
    doc = {**s, "seed": seed, "n": a.n, "kinds": list(a.kinds), "models": list(a.models), "tier": a.tier,
           "commit": _commit(), "load": [load0, os.getloadavg()[0]], "seconds": seconds,
           "engine_runs": engine.engine_runs if engine is not None else 0,
           "miss_seeds": [r["seed"] for r in results if r["miss"]], "results": results}
    if a.json:
        Path(a.json).write_text(json.dumps(_finite(doc), indent=1) + "\n")
    return doc


def _finite(o: Any) -> Any:
    """NaN and Inf are not JSON: null."""
    if isinstance(o, float):
        return o if math.isfinite(o) else None
    if isinstance(o, dict):
        return {k: _finite(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_finite(v) for v in o]
    return o


def report(files: list[str]) -> dict[str, Any]:
    """The tables of earlier runs' --json files, their scenarios pooled."""
    results: list[dict[str, Any]] = []
    heads = []
    from tensordiff.errors import TensordiffError
    from tensordiff.safety import read_json_file, sanitize_for_terminal

    for f in files:
        try:   # bounded in size and nesting; a regular file only (a FIFO or /dev/zero: one line)
            doc = read_json_file(f, "--report", REPORT_BYTES)
            got = doc["results"]
            if not isinstance(got, list) or not got:
                raise TypeError("results is not a non-empty list")
            for r in got:
                _check_result(r)
        except TensordiffError as e:
            _fail(f"{e} (not a fuzz_verdicts --json file)")
        except (KeyError, TypeError, ValueError) as e:
            _fail(f"--report {f}: not a fuzz_verdicts --json file ({type(e).__name__}: {str(e)[:200]})")
        results += got
        heads.append(sanitize_for_terminal(f"seeds {str(doc.get('seed'))[:40]}..+{len(got) - 1} at "
                                           f"{str(doc.get('commit', '?'))[:40]}, load {str(doc.get('load'))[:60]}"))
    s = summarise(results)
    print("pooled: " + "; ".join(heads))
    print_tables(s, results, "pooled")
    return s


#: a --report file: a run of 100,000 scenarios writes ~60 MB
REPORT_BYTES = 256 << 20
#: the fields of a scenario the tables read, and their types (a value of any other type, or a name
#: the catalog does not know, is not this script's file)
_RESULT_FIELDS: dict[str, tuple[type, ...]] = {
    "seed": (int,), "kind": (str,), "family": (str,), "model": (str,), "dtypes": (str,), "mode": (str,),
    "order": (str,), "layer": (int,), "x": (int, float, type(None)), "truth": (str,), "outcome": (str,),
    "miss": (bool,), "first": (str, type(None)), "why": (str,)}


def _check_result(r: Any) -> None:
    """A scenario of a --report file, as :func:`summarise` and :func:`print_tables` read it."""
    if not isinstance(r, dict):
        raise TypeError(f"a scenario is {type(r).__name__}, not an object")
    for k, types in _RESULT_FIELDS.items():
        v = r.get(k)
        if not isinstance(v, types) or (isinstance(v, bool) and bool not in types):
            raise TypeError(f"a scenario's {k} is {type(v).__name__}")
    known = r["kind"] in bugs.FAMILY or r["kind"] in bugs.RL_FAMILY
    if not known or r["model"] not in MODELS or r["outcome"] not in OUTCOMES:
        raise ValueError("a scenario names a kind, model or outcome this catalog does not know")
    if not 0 <= r["layer"] < 10_000 or (isinstance(r["x"], float) and not math.isfinite(r["x"])):
        raise ValueError("a scenario's layer or x is out of range")
    for k in ("dtypes", "mode", "order", "truth", "first", "why", "family"):
        if isinstance(r[k], str) and len(r[k]) > 1000:
            raise ValueError(f"a scenario's {k} is longer than 1000 characters")
    r.update({k: _escaped(r[k]) for k in ("dtypes", "mode", "order", "truth", "first", "why", "family")})


def _escaped(v: Any) -> Any:
    from tensordiff.safety import sanitize_for_terminal

    return sanitize_for_terminal(v) if isinstance(v, str) else v


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    if a.report:
        report(a.report)
        return 0
    run(a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
