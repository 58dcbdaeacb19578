"""TUI benchmark: time to first paint, to the first compared rows, and memory on large trace pairs.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_tui.py            # 100k and 1M tokens x 8, 2000 x 4096
    PYTHONPATH=. .venv/bin/python benchmarks/bench_tui.py --tokens 100000 --repeat 1 --wide none
    PYTHONPATH=. .venv/bin/python benchmarks/bench_tui.py --json tui.json     # figures for benchmarks/goals.py

For each size it writes a synthetic train/serve pair with TraceWriter into a temporary directory
(catalog boundaries embed..layerL and final_norm, and a packed draft_input of 3 slots that holds
different states on the two sides; small hidden size, float16, so the files stay modest), then runs
the app headless (App.run_test, 140x40) in fresh processes and reports:

* first rows (the figure of the TUI goal in goals.py): seconds from the app's start until the heatmap has drawn
  real rows: on a pair of at least PREVIEW_FROM tokens the preview's (the real metrics of the
  first tokens, read and aligned without loading the whole traces, no verdict), else the first
  rows the diff has compared; ``first_live_rows``: the first rows the diff itself compared (it
  streams them: the rest of the heatmap is drawn as pending), and the stages of the diff before
  it (the preview written, opening the traces, aligning the tokens, the first block handed to the
  sinks), timed in the diff thread; the RSS when the diff's first rows are drawn, and the peak
  RSS from then until the diff has ended (``rss_growth``: peak minus RSS at those rows; the peak
  is reset then through /proc/self/clear_refs). The same diff without
  the streaming sink gives ``rss_growth_unstreamed``: what the diff itself allocates meanwhile.
  Median of ``--repeat`` runs of each, interleaved in random order per round after an untimed
  warm-up run. ``--wide TOKENSxHIDDEN`` adds a wide pair (few tokens, 4096
  wide: each tensor is one block of the diff).
* first paint: seconds from the app's start (and from the process start, imports included) to its
  first screen, and the process's peak RSS by then; and from the process start through the real
  ``tensordiff tui A B`` command line (``cli.main``, with ``run_tui`` swapped for a headless run),
  which validates both traces before it starts the app. The diff starts only after the first paint,
  in a worker thread, so first paint never waits for it. Median of ``--repeat`` runs, each of
  which quits right after the first paint.
* diff in the worker: seconds until the findings are on screen, and the process's peak RSS
  (this is the aligner's memory: token tables and row maps, which grow with the trace).
* browsing: after the diff, the cursor is driven over the whole heatmap (end, home, page downs,
  a metric toggle, 300 jumps to random rows); reports the RSS growth during it, the peak of what
  a second such walk allocates (tracemalloc, numpy included), the summary blocks held / read
  (the cache is bounded), and the mean time of one jump plus drawing every heatmap line on screen.
* readers: RSS and seconds to open the two TraceReaders the detail pane reads vectors through
  (opened once, on the first cell shown; TraceReader loads the token table and row indexes).
* quit: seconds from pressing q one second into the diff until the process has ended (the diff
  thread stops at its next progress report; the longest stretch without one is the aligner's
  token alignment and identity search).

Budget (DESIGN.md): first paint under 1 s, and TUI memory independent of the trace size.
"""

from __future__ import annotations

import argparse
import json
import random
import os
import statistics
import subprocess
import sys
import tempfile
import time

T_PROCESS = time.perf_counter()

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def rss_mb() -> float:
    return _status_kb("VmRSS") / 1024


def peak_mb() -> float:
    return _status_kb("VmHWM") / 1024


# ----------------------------------------------------------------------------------------------
# data
# ----------------------------------------------------------------------------------------------


def write_pair(directory: str, n_tokens: int, hidden: int = 8, layers: int = 4, seq_len: int = 1000,
               block: int = 16384, seed: int = 0) -> tuple[str, str]:
    import numpy as np

    from tensordiff.trace import SlotSpec, TraceWriter
    from tensordiff.vocab import boundary_label

    slots = {"train": [0, 1, 3], "serve": [1, 3, 4]}
    paths = []
    for side in ("train", "serve"):
        path = os.path.join(directory, f"{side}.h5")
        paths.append(path)
        with TraceWriter(path, side=side, model={"num_layers": layers, "hidden_size": hidden},
                         flush_rows=None, flush_seconds=None) as w:
            for b in range(layers + 1):
                w.define_tensor(boundary_label(b), hidden, kind="boundary", boundary=b, role="catalog",
                                dtype="float16", sketch=False)
            w.define_tensor("final_norm", hidden, kind="final_norm", role="catalog", dtype="float16", sketch=False)
            w.define_tensor("draft_input", hidden * 3, kind="packed", role="draft_input", dtype="float16",
                            sketch=False, token_offset=1, slots=SlotSpec([boundary_label(b) for b in slots[side]]))
            tok_rng = np.random.default_rng(seed + 1)
            for s0 in range(0, n_tokens, block):
                n = min(block, n_tokens - s0)
                rng = np.random.default_rng([seed, s0])
                xs = [rng.standard_normal((n, hidden)).astype(np.float32) * 0.3]
                for _ in range(layers):
                    xs.append(xs[-1] + rng.standard_normal((n, hidden)).astype(np.float32))
                fn = xs[-1] / np.sqrt((xs[-1] ** 2).mean(1, keepdims=True))
                idx = np.arange(s0, s0 + n)
                seq = idx // seq_len
                toks = tok_rng.integers(0, 32000, n)
                rows = np.empty(n, np.int64)
                for sq in np.unique(seq):
                    sel = seq == sq
                    regime = "train" if side == "train" else "prefill"
                    rows[sel] = w.add_tokens(f"req-{sq}", idx[sel] % seq_len, toks[sel], regime)
                for b in range(layers + 1):
                    w.append(boundary_label(b), rows, xs[b])
                w.append("final_norm", rows, fn)
                w.append("draft_input", rows, np.concatenate([xs[b] for b in slots[side]], axis=1))
    return paths[0], paths[1]


# ----------------------------------------------------------------------------------------------
# child: one headless run of the app
# ----------------------------------------------------------------------------------------------


def child(path_a: str, path_b: str, mode: str) -> dict:
    import asyncio
    import random

    t_import = time.perf_counter()
    from tensordiff.tui.app import TensordiffApp

    out: dict = {"import_s": time.perf_counter() - t_import}

    class App(TensordiffApp):
        def _after_first_paint(self) -> None:
            # measured here, before the diff worker starts
            out["peak_mb_at_first_paint"] = peak_mb()
            out["rss_mb_at_first_paint"] = rss_mb()
            super()._after_first_paint()

        def _first_live_rows_painted(self) -> None:
            # memory from the diff's own first rows on (the preview, if any, came before the
            # diff opened the traces: the diff's whole memory would count as streaming's)
            super()._first_live_rows_painted()
            out["rss_mb_at_first_rows"] = rss_mb()
            out["peak_mb_at_first_rows"] = peak_mb()
            out["peak_reset"] = reset_peak()

    if mode in ("stream", "unstreamed"):
        return stream_child(App, path_a, path_b, mode, out)

    if mode == "cli":
        # the real command line: `tensordiff tui A B`, with run_tui swapped for a headless run
        from tensordiff.tui import app as tui
        from tensordiff.cli import main as cli_main

        def headless(a, b, opts, token_text=None) -> int:
            async def paint() -> None:
                app = App(a, b, opts)
                async with app.run_test(size=(140, 40)):
                    while app.first_paint_at is None:
                        await asyncio.sleep(0.001)
                    out["cli_first_paint_from_process_s"] = app.first_paint_at - T_PROCESS
                    app.simulate_key("q")
                    while app.is_running:
                        await asyncio.sleep(0.001)

            asyncio.run(paint())
            return 0

        tui.run_tui = headless
        assert cli_main(["tui", path_a, path_b]) == 0
        return out

    async def go() -> None:
        t_app = time.perf_counter()
        app = App(path_a, path_b)
        async with app.run_test(size=(140, 40)) as pilot:
            while app.first_paint_at is None:
                await asyncio.sleep(0.001)
            out["first_paint_s"] = app.first_paint_at - t_app
            out["first_paint_from_process_s"] = app.first_paint_at - T_PROCESS
            if mode == "paint":
                await pilot.press("q")
                return
            if mode == "quit":
                # quit while the diff runs: the worker stops at its next progress report
                await asyncio.sleep(1.0)
                out["progress_at_quit"] = list(app.progress) if not app.ready else "diff already done"
                out["t_quit_wall"] = time.time()
                app.simulate_key("q")   # not pilot.press: it waits for the process to go idle
                while app.is_running:
                    await asyncio.sleep(0.001)
                return
            while not app.ready:
                assert app.diff_error is None, app.diff_error
                await asyncio.sleep(0.01)
            out["diff_s"] = app.diff_seconds
            out["peak_mb_after_diff"] = peak_mb()
            while app.vectors_for != app.cell:
                await asyncio.sleep(0.01)
            hm = app.heatmap
            n = hm.n_rows
            out["tokens"] = n
            out["columns"] = len(app.columns)
            await pilot.pause()
            # the detail pane's two TraceReaders (open since the first cell was shown): their
            # token tables and row indexes are loaded at open, so they grow with the trace
            rss0 = rss_mb()
            t0 = time.perf_counter()
            src = type(app._source)(path_a, path_b)
            src.reader(0), src.reader(1)
            out["readers_open_s"] = time.perf_counter() - t0
            out["readers_mb"] = rss_mb() - rss0
            src.close()
            # the heatmap over the whole trace: bounded block cache
            rss0 = rss_mb()
            await pilot.press("end", "home", *(["pagedown"] * 20), "m")
            rng = random.Random(0)
            height = hm.scrollable_content_region.height
            jumps, t_render = 300, 0.0
            for i in range(jumps):
                row = rng.randrange(n)
                t0 = time.perf_counter()
                hm.move_to(row, center=True)
                for y in range(height):       # what the compositor asks for after a jump
                    hm.render_line(y)
                t_render += time.perf_counter() - t0
                if i % 30 == 0:
                    await pilot.pause()
            out["jump_render_ms"] = 1000 * t_render / jumps
            await pilot.press("end")
            await pilot.pause()
            out["browse_rss_growth_mb"] = rss_mb() - rss0
            # the same walk again under tracemalloc: what the heatmap allocates (numpy included)
            import tracemalloc

            tracemalloc.start()
            base = tracemalloc.get_traced_memory()[0]
            for _ in range(100):
                hm.move_to(rng.randrange(n), center=True)
                for y in range(height):
                    hm.render_line(y)
            out["heatmap_traced_peak_mb"] = (tracemalloc.get_traced_memory()[1] - base) / 2**20
            # ... and what the detail pane allocates for the 100 cells those moves selected
            # (its reads go through TraceReader; the row lookup scans the token table)
            tracemalloc.reset_peak()
            base = tracemalloc.get_traced_memory()[0]
            await pilot.pause()
            while app.vectors_for != app.cell:
                await asyncio.sleep(0.01)
            out["detail_traced_peak_mb"] = (tracemalloc.get_traced_memory()[1] - base) / 2**20
            tracemalloc.stop()
            out["blocks_read"] = hm.blocks.reads
            out["blocks_held"] = len(hm.blocks)
            out["block_rows"] = hm.blocks.block_rows
            await pilot.press("q")

    asyncio.run(go())
    return out


def reset_peak() -> bool:
    """Reset this process's peak RSS (VmHWM) to its current RSS (Linux: clear_refs 5)."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def stream_child(App, path_a: str, path_b: str, mode: str, out: dict) -> dict:
    """Until the diff has ended: when the first compared rows are drawn, the diff's stages before
    them (timed in its thread), and the RSS growth from then on. ``unstreamed``: the same diff
    without the streaming sink (what the diff allocates by itself)."""
    import asyncio
    import dataclasses
    import threading

    from tensordiff.diff import diff_traces

    marks: dict = {}

    def timed(a, b, opts):
        inner = opts.progress

        def progress(stage, done, total):
            marks.setdefault(f"{stage} start", time.perf_counter())
            if done >= total:
                marks[f"{stage} end"] = time.perf_counter()
            inner(stage, done, total)

        class First:
            def write(self, *args) -> None:
                marks.setdefault("first block", time.perf_counter())

            def close(self) -> None:
                pass

        sinks = [lambda al, ra, rb: (marks.setdefault("tokens aligned", time.perf_counter()), First())[1]]
        sinks += [] if mode == "unstreamed" else list(opts.sinks)
        return diff_traces(a, b, dataclasses.replace(opts, progress=progress, sinks=sinks))

    async def go() -> None:
        t_app = time.perf_counter()
        app = App(path_a, path_b, diff_fn=timed)
        async with app.run_test(size=(140, 40)) as pilot:
            if mode == "unstreamed":      # no first rows to wait for: reset the peak at the first block
                done = threading.Event()

                def watch() -> None:
                    while not done.is_set() and "first block" not in marks:
                        time.sleep(0.001)
                    out["rss_mb_at_first_rows"] = rss_mb()
                    out["peak_reset"] = reset_peak()
                threading.Thread(target=watch, daemon=True).start()
            while not app.ready:
                assert app.diff_error is None, app.diff_error
                await asyncio.sleep(0.005)
            out["peak_mb_after_diff"] = peak_mb()
            if mode == "unstreamed":
                done.set()
            t0 = app._diff.t0
            out["diff_s"] = app.diff_seconds
            out["stages"] = {k: round(v - t0, 3) for k, v in sorted(marks.items(), key=lambda kv: kv[1])}
            if app.first_rows_at is not None:
                out["first_rows_s"] = app.first_rows_at - t_app
                out["first_rows_from_process_s"] = app.first_rows_at - T_PROCESS
            if app.first_live_rows_at is not None:
                out["first_live_rows_s"] = app.first_live_rows_at - t_app
                out["first_rows_after_first_block_s"] = app.first_live_rows_at - marks["first block"]
            out["preview"] = app._diff.preview_at is not None
            if app._diff.preview_at is not None:
                out["stages"]["preview written"] = round(app._diff.preview_at - t0, 3)
            out["first_paint_s"] = app.first_paint_at - t_app
            out["rss_growth_mb"] = out["peak_mb_after_diff"] - out.get("rss_mb_at_first_rows", float("nan"))
            await pilot.press("q")

    asyncio.run(go())
    return out


def run_child(a: str, b: str, mode: str) -> dict:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, os.path.abspath(__file__), "--_child", mode, a, b],
                       capture_output=True, text=True, env=env, timeout=3600, check=False)
    end = time.time()
    if p.returncode != 0:
        sys.stderr.write(f"bench_tui.py: a measuring run failed ({p.returncode}):\n{p.stderr[-4000:]}\n")
        sys.exit(2)
    out = json.loads(p.stdout.strip().splitlines()[-1])
    if "t_quit_wall" in out:   # q pressed -> the child process has ended
        out["quit_s"] = end - out.pop("t_quit_wall")
    return out


# ----------------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[100_000, 1_000_000])
    ap.add_argument("--hidden", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3, help="first-paint runs per size (median)")
    ap.add_argument("--wide", default="2000x4096",
                    help="also a wide pair, TOKENSxHIDDEN (first rows and memory only); 'none': skip")
    ap.add_argument("--stream-only", action="store_true",
                    help="only the first-rows runs (no first paint, CLI, browsing and quit runs)")
    ap.add_argument("--dir", help="keep the generated traces here (default: a temporary directory)")
    ap.add_argument("--json", metavar="FILE", help="write the figures as one JSON object (benchmarks/goals.py)")
    ap.add_argument("--_child", nargs=3, metavar=("MODE", "A", "B"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._child:
        mode, a, b = args._child
        print(json.dumps(child(a, b, mode)))
        return
    from benchjson import Result

    res = Result("bench_tui", config={"tokens": args.tokens, "hidden": args.hidden, "wide": args.wide,
                                      "repeat": args.repeat, "stream_only": args.stream_only})
    load_start = res.load_start
    sizes = [(n, args.hidden, 4) for n in args.tokens]
    if args.wide != "none":
        try:
            wn, wh = (int(x) for x in args.wide.lower().split("x"))
        except ValueError:
            sys.stderr.write(f"bench_tui.py: --wide {args.wide!r}: use TOKENSxHIDDEN, e.g. 2000x4096, or none\n")
            sys.exit(2)
        sizes.append((wn, wh, 4))

    rows, streams = [], []
    with tempfile.TemporaryDirectory(prefix="tensordiff-bench-tui-") as tmp:
        for n, hidden, layers in sizes:
            d = os.path.join(args.dir or tmp, f"pair-{n}" + (f"x{hidden}" if hidden != 8 else ""))
            os.makedirs(d, exist_ok=True)
            t0 = time.perf_counter()
            if not all(os.path.isfile(os.path.join(d, f)) for f in ("train.h5", "serve.h5", "done")):
                a, b = write_pair(d, n, hidden=hidden, layers=layers)
                open(os.path.join(d, "done"), "w").close()
            a, b = os.path.join(d, "train.h5"), os.path.join(d, "serve.h5")
            gen_s = time.perf_counter() - t0
            size_mb = (os.path.getsize(a) + os.path.getsize(b)) / 2**20
            print(f"{n} tokens x {hidden}: the pair in {gen_s:.1f} s ({size_mb:.0f} MiB)", flush=True)
            # streamed and unstreamed interleaved, in random order per round, after an untimed warm-up
            run_child(a, b, "unstreamed")
            runs, bares = [], []
            order = random.Random(n)
            for _ in range(args.repeat):
                for mode in order.sample(["stream", "unstreamed"], 2):
                    (runs if mode == "stream" else bares).append(run_child(a, b, mode))
            bare = {k: statistics.median(r[k] for r in bares) for k in ("rss_growth_mb", "diff_s")}
            med = {k: statistics.median(r[k] for r in runs) for k in (
                "first_rows_s", "first_rows_from_process_s", "first_live_rows_s", "first_rows_after_first_block_s",
                "rss_mb_at_first_rows",
                "peak_mb_at_first_rows", "rss_growth_mb", "diff_s")}
            mid = sorted(runs, key=lambda r: r["first_rows_s"])[len(runs) // 2]
            st = {"tokens": n, "hidden": hidden, "files_mib": size_mb, **med, "stages": mid["stages"],
                  "preview": all(r["preview"] for r in runs),
                  "rss_growth_unstreamed_mb": bare["rss_growth_mb"], "diff_unstreamed_s": bare["diff_s"],
                  "peak_reset": all(r["peak_reset"] for r in runs)}
            streams.append(st)
            print(json.dumps(st), flush=True)
            if args.stream_only or hidden != args.hidden:
                continue
            paints = [run_child(a, b, "paint") for _ in range(args.repeat)]
            clis = [run_child(a, b, "cli") for _ in range(args.repeat)]
            full = run_child(a, b, "full")
            quit_ = run_child(a, b, "quit")
            fp = statistics.median(p["first_paint_s"] for p in paints)
            fpp = statistics.median(p["first_paint_from_process_s"] for p in paints)
            pk = statistics.median(p["peak_mb_at_first_paint"] for p in paints)
            cli = statistics.median(c["cli_first_paint_from_process_s"] for c in clis)
            row = {"tokens": n, "files_mib": size_mb, "first_paint_s": fp, "first_paint_from_process_s": fpp,
                   "cli_first_paint_from_process_s": cli,
                   "peak_mb_at_first_paint": pk, **{k: full[k] for k in (
                       "diff_s", "peak_mb_after_diff", "jump_render_ms", "browse_rss_growth_mb", "heatmap_traced_peak_mb",
                       "blocks_read",
                       "blocks_held", "columns", "readers_open_s", "readers_mb", "detail_traced_peak_mb")},
                   "quit_during_diff_s": quit_["quit_s"], "progress_at_quit": quit_["progress_at_quit"]}
            rows.append(row)
            print(json.dumps(row), flush=True)
    load = os.getloadavg()[0]
    print()
    print(f"tensordiff TUI benchmark: first compared rows ({os.cpu_count()} CPUs, load average "
          f"{load_start:.1f} -> {load:.1f}; 140x40 headless; median of {args.repeat})")
    print(f"{'tokens':>9} {'wide':>5} {'files':>7} {'1st rows':>9} {'(process)':>10} {'live':>7} {'aligned':>8} "
          f"{'1st block':>10} "
          f"{'RSS@rows':>9} {'growth':>7} {'(no stream)':>11} {'diff':>6}")
    for r in streams:
        sg = r["stages"]
        print(f"{r['tokens']:>9} {r['hidden']:>5} {r['files_mib']:>5.0f}Mi {r['first_rows_s']:>8.2f}s "
              f"{r['first_rows_from_process_s']:>9.2f}s {r['first_live_rows_s']:>6.2f}s "
              f"{sg.get('tokens aligned', float('nan')):>7.2f}s "
              f"{sg.get('first block', float('nan')):>9.2f}s {r['rss_mb_at_first_rows']:>7.0f}MB "
              f"{r['rss_growth_mb']:>5.0f}MB {r['rss_growth_unstreamed_mb']:>9.0f}MB {r['diff_s']:>5.1f}s")
    print("1st rows: app start -> the heatmap has drawn real rows (a large pair's preview, else the first rows the "
          "diff compared; process: from the interpreter's start); live: the first rows the diff compared; "
          "aligned / 1st block: from the diff thread's start, the tokens aligned (sinks made) "
          "and the first block handed to the sinks; RSS@rows: RSS then; growth: peak RSS from then to the diff's "
          "end minus RSS@rows; (no stream): the same without the streaming sink; diff: until the findings show.")
    if args.json:
        def key(n: int) -> str:
            if n % 1_000_000 == 0:
                return f"{n // 1_000_000}m"
            return f"{n // 1000}k" if n % 1000 == 0 else str(n)
        figures: dict = {}
        for r in streams:
            sfx = key(r["tokens"]) + ("" if r["hidden"] == args.hidden else f"_x{r['hidden']}")
            figures[f"first_rows_s_{sfx}"] = r["first_rows_s"]
            figures[f"first_live_rows_s_{sfx}"] = r["first_live_rows_s"]
            figures[f"preview_{sfx}"] = r["preview"]
            figures[f"rss_growth_mb_{sfx}"] = r["rss_growth_mb"]
            figures[f"rss_growth_unstreamed_mb_{sfx}"] = r["rss_growth_unstreamed_mb"]
            # what streaming rows to the heatmap adds to the diff's own memory: flat when it does not grow with tokens
            figures[f"stream_rss_extra_mb_{sfx}"] = r["rss_growth_mb"] - r["rss_growth_unstreamed_mb"]
            figures[f"aligned_s_{sfx}"] = r["stages"].get("tokens aligned", float("nan"))
            figures[f"first_block_s_{sfx}"] = r["stages"].get("first block", float("nan"))
            figures[f"opened_s_{sfx}"] = r["stages"].get("aligning tokens start", float("nan"))
            figures[f"diff_s_{sfx}"] = r["diff_s"]
            figures[f"diff_unstreamed_s_{sfx}"] = r["diff_unstreamed_s"]
            figures[f"rss_mb_at_first_rows_{sfx}"] = r["rss_mb_at_first_rows"]
        for r in rows:
            figures[f"first_paint_s_{key(r['tokens'])}"] = r["first_paint_s"]
        res.write(args.json, figures)
    if not rows:
        return
    print()
    print(f"tensordiff TUI benchmark ({os.cpu_count()} CPUs, load average {load:.1f}; 140x40 headless)")
    hdr = (f"{'tokens':>9} {'files':>7} {'1st paint':>10} {'(process)':>10} {'(CLI)':>7} {'RSS@paint':>10} "
           f"{'diff':>6} {'peak diff':>10} {'jump+draw':>10} {'heatmap':>8} {'blocks':>9} {'detail':>7} "
           f"{'readers':>13} {'quit':>6}")
    print(hdr)
    for r in rows:
        print(f"{r['tokens']:>9} {r['files_mib']:>5.0f}Mi {r['first_paint_s']:>9.3f}s {r['first_paint_from_process_s']:>9.3f}s "
              f"{r['cli_first_paint_from_process_s']:>6.2f}s "
              f"{r['peak_mb_at_first_paint']:>8.0f}MB {r['diff_s']:>5.1f}s {r['peak_mb_after_diff']:>8.0f}MB "
              f"{r['jump_render_ms']:>8.1f}ms {r['heatmap_traced_peak_mb']:>6.1f}MB {r['blocks_held']:>3}/{r['blocks_read']:<5}"
              f" {r['detail_traced_peak_mb']:>5.1f}MB {r['readers_mb']:>5.0f}MB {r['readers_open_s']:>5.2f}s"
              f" {r['quit_during_diff_s']:>5.2f}s" + ("" if isinstance(r["progress_at_quit"], list) else "*"))
    print("1st paint: app start -> first screen (process: from interpreter start, imports included; "
          "CLI: the same through `tensordiff tui A B`, which first probes and opens both traces); "
          "RSS@paint: peak RSS by then; diff: in the worker, until the findings show; peak diff: peak RSS "
          "(the aligner's); jump+draw: one random jump and every heatmap line drawn; heatmap / detail: "
          "tracemalloc peak of 100 such jumps / of the detail pane showing those cells; blocks: summary "
          "blocks held / read; readers: RSS and time to open the two TraceReaders of the detail pane; "
          "quit: q pressed 1 s into the diff until the process has ended (* the diff had already ended).")
    ok = all(r["first_paint_s"] < 1.0 for r in rows)
    print(f"first paint under 1 s on every size: {'yes' if ok else 'NO'}")
    if len(rows) > 1:
        grow = rows[-1]["peak_mb_at_first_paint"] - rows[0]["peak_mb_at_first_paint"]
        print(f"peak RSS at first paint, largest minus smallest trace: {grow:+.1f} MB "
              f"({rows[-1]['tokens'] // rows[0]['tokens']}x the tokens)")


if __name__ == "__main__":
    main()
