"""Cost of ``tensordiff locate`` against one plain record-and-diff of both sides, as a ratio
measured in the same run.

The trained tiny Llama (scripts/train_tiny_models.py, through tests/trained.py; its 12 held-out
prompts) against a port whose layer 3 down projection is scaled by 1.05 (written once to a
temporary directory). Each is what a user runs, as processes on the command line:

- plain: ``tensordiff record train`` of A, of B (``--topk 0 --values all --no-draft-input``, what
  locate records), then ``tensordiff diff`` (three processes);
- locate: ``tensordiff locate A B`` (one process: record, diff, zoom, two grafts, weights).

With ``--in-process`` both run in this process instead (``tensordiff.cli.main``), torch and
transformers imported once: the ratio of the work alone, without the plain loop's three
interpreter start-ups.

Both run once untimed (warm-up), then ``--repeats`` rounds run them in a random order per round
(seeded); the ratio locate / plain is taken per round, then the median. Goal: at most 3x.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_locate.py [--repeats 3] [--in-process] [--json FILE]
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, ROOT)

from benchjson import Result  # noqa: E402  (benchmarks/ is on sys.path when run as a script)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0, help="seed of the per-round random order")
    ap.add_argument("--in-process", action="store_true", help="run both in this process (the work alone)")
    ap.add_argument("--json", metavar="FILE", default=None, help="write the figures as one JSON object")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        print("bench_locate: --repeats must be positive", file=sys.stderr)
        return 2
    try:
        import torch
        import trained
    except ImportError as e:
        print(f"bench_locate: needs the torch extra (torch + transformers): {e}", file=sys.stderr)
        return 2
    res = Result("bench_locate", config={"repeats": args.repeats, "seed": args.seed, "in_process": args.in_process})
    work = tempfile.mkdtemp(prefix="td-bench-locate-")
    port = os.path.join(work, "port-mlp3")
    m = trained.load_target()
    with torch.no_grad():
        m.model.layers[3].mlp.down_proj.weight.mul_(1.05)
    m.save_pretrained(port)
    gen = os.path.join(port, "generation_config.json")
    if os.path.exists(gen):
        os.remove(gen)
    ref, prompts = str(trained.target_dir()), str(trained.prompts_path())
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    td = [sys.executable, "-m", "tensordiff"]

    def run(cmd: list[str], ok: tuple[int, ...]) -> None:
        if args.in_process:
            import contextlib
            import io

            from tensordiff.cli import main as td_main

            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                rc = td_main(cmd[len(td):])
            if rc not in ok:
                raise SystemExit(f"bench_locate: {' '.join(cmd)} exited {rc}")
            return
        r = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if r.returncode not in ok:
            raise SystemExit(f"bench_locate: {' '.join(cmd)} exited {r.returncode}: {r.stderr.strip()[-400:]}")

    def plain() -> float:
        d = tempfile.mkdtemp(dir=work)
        rec = ["record", "train", "--prompts", prompts, "--topk", "0", "--values", "all", "--no-draft-input",
               "--no-progress"]
        t0 = time.perf_counter()
        run([*td, *rec, "--model", ref, "--out", os.path.join(d, "a.h5")], (0,))
        run([*td, *rec, "--model", port, "--out", os.path.join(d, "b.h5")], (0,))
        run([*td, "diff", "-q", os.path.join(d, "a.h5"), os.path.join(d, "b.h5")], (1,))
        dt = time.perf_counter() - t0
        shutil.rmtree(d)
        return dt

    def locate() -> float:
        d = os.path.join(tempfile.mkdtemp(dir=work), "out")
        t0 = time.perf_counter()
        run([*td, "locate", ref, port, "--prompts", prompts, "--out", d, "--no-progress"], (1,))
        dt = time.perf_counter() - t0
        shutil.rmtree(os.path.dirname(d))
        return dt

    modes = {"plain": plain, "locate": locate}
    for fn in modes.values():   # warm-up
        fn()
    times: dict[str, list[float]] = {k: [] for k in modes}
    order = random.Random(args.seed)
    for _ in range(args.repeats):
        for name in order.sample(list(modes), len(modes)):
            times[name].append(modes[name]())
    shutil.rmtree(work)
    ratio = statistics.median(loc / pl for loc, pl in zip(times["locate"], times["plain"]))
    figures = {"plain_s": statistics.median(times["plain"]), "locate_s": statistics.median(times["locate"]),
               "locate_ratio": ratio, "goal_met": ratio <= 3.0}
    res.config.update({"threads": torch.get_num_threads(), "torch": torch.__version__})
    res.write(args.json, figures)
    print(f"load average: {os.getloadavg()[0]:.2f} at the end ({res.load_start:.2f} at the start)")
    print(f"locate cost: the trained tiny Llama against a port with layer 3's down_proj x 1.05, "
          f"{len(trained.prompts())} prompts, {'in this process' if args.in_process else 'as command-line processes'}, "
          f"median of {args.repeats} interleaved rounds (commit {res.commit})")
    for name, ts in times.items():
        print(f"  {name:6s} median {statistics.median(ts):.2f} s  ({', '.join(f'{t:.2f}' for t in ts)})")
    print(f"locate / plain = {ratio:.2f}x (goal <= 3x: {'met' if ratio <= 3.0 else 'NOT met'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
