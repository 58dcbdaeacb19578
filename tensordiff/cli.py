"""The ``tensordiff`` command line. Exit codes: 0 agree / ok, 1 divergence found, 2 bad input.

Bad input never prints a traceback: one line on stderr and exit 2 (``TENSORDIFF_DEBUG=1`` shows
the traceback of an unexpected error, for bug reports).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from contextlib import contextmanager

from . import __version__
from .errors import IncompatibleTracesError, TensordiffError, UsageError

EXIT_OK, EXIT_DIVERGENCE, EXIT_BAD_INPUT = 0, 1, 2


def jsonable(x):
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


def _print_json(obj) -> None:
    sys.stdout.write(json.dumps(jsonable(obj), indent=2) + "\n")


@contextmanager
def progress_bar(enabled: bool):
    """A rich progress bar on stderr when it is a terminal; a no-op callback otherwise."""
    if not enabled or not sys.stderr.isatty():
        yield None
        return
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    prog = Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total} rows"),
                    TimeRemainingColumn(), console=Console(file=sys.stderr), transient=True)
    tasks: dict[str, int] = {}

    def update(stage: str, done: int, total: int) -> None:
        if stage not in tasks:
            tasks[stage] = prog.add_task(stage, total=total)
        prog.update(tasks[stage], completed=done, total=total)

    with prog:
        yield update


# ----------------------------------------------------------------------------------------------


def cmd_info(args) -> int:
    from .report import make_console, print_info
    from .trace import TraceReader, probe

    probe([args.trace])  # a file that hangs or crashes the HDF5 library meets a child process first
    with TraceReader(args.trace) as r:
        s = r.summary()
    if args.json:
        _print_json(s)
    else:
        print_info(s, make_console())
    return EXIT_OK


def _diff_options(args, summary_path=None):
    from .diff import DiffOptions
    from .tolerances import ToleranceBook

    book = ToleranceBook()
    for t in args.tol or []:
        name, tol = ToleranceBook.parse_override(t)
        book.overrides[name] = tol
    if args.calibration:
        book.load_calibration(args.calibration)
    return DiffOptions(tolerances=book, summary_path=summary_path)


def cmd_diff(args) -> int:
    if args.tui:
        return cmd_tui(args)
    from .diff import diff_traces
    from .report import make_console, print_diff
    from .trace import probe

    probe([args.a, args.b])
    opts = _diff_options(args, args.summary)
    with progress_bar(not args.quiet and not args.json) as cb:
        opts.progress = cb
        res = diff_traces(args.a, args.b, opts)
    if args.json:
        _print_json(res.to_dict())
    else:
        print_diff(res, make_console(), max_findings=args.max_findings)
    return res.exit_code


def cmd_calibrate(args) -> int:
    """Diff a noise-floor pair (same wiring, honest numeric differences) and write tolerances."""
    from .diff import Differ, DiffOptions
    from .tolerances import (
        Tolerance,
        ToleranceBook,
        calibrate_tolerance,
        calibration_file,
    )
    from .trace import probe

    probe([args.a, args.b])
    loose = ToleranceBook(overrides={"*": Tolerance(-1.0, math.inf, "calibration")})
    with Differ(args.a, args.b, DiffOptions(tolerances=loose)) as d:
        res = d.run()
    ids = [f for f in res.findings if f.kind in ("slot_identity", "token_shift", "pairing", "token_mismatch")
           and f.severity == "divergence"]
    if ids:
        raise IncompatibleTracesError(f"not a noise-floor pair: {ids[0].message}; calibrate on two runs of the same wiring")
    tols, warnings = {}, []
    for p in res.pairs:
        if not p.compared:
            warnings.append(f"{p.label}: not compared ({p.not_compared}); no tolerance written")
            continue
        for s in range(p.slots):
            key = f"{p.name_a}[{s}]" if p.slots > 1 else p.name_a
            tols[key], warn = calibrate_tolerance(key, p.cos_min[s], p.rel_max[s], p.dtype_a, p.dtype_b,
                                                  p.depth[s], args.margin)
            if warn:
                warnings.append(warn)
    out = calibration_file(args.a, args.b, args.margin, tols, warnings)
    with open(args.out, "w", encoding="utf-8") as fh:
        json.dump(jsonable(out), fh, indent=2)
    for w in warnings:
        sys.stderr.write(f"tensordiff: warning: {w}\n")
    print(f"wrote {len(tols)} calibrated tolerances to {args.out} (margin {args.margin}x the observed noise floor"
          + (f"; {len(warnings)} warnings" if warnings else "") + ")")
    return EXIT_OK


def cmd_tui(args) -> int:
    try:
        from .tui import run_tui
    except ImportError as e:  # textual is a core dependency; this guards a broken install
        raise UsageError(f"the TUI needs textual ({e})") from None
    from .trace import TraceReader, probe

    probe([args.a, args.b])  # fail fast on bad input, before the screen is taken over
    if os.environ.get("TENSORDIFF_NO_PROBE"):  # no child check: open them here instead
        for p in (args.a, args.b):
            TraceReader(p).close()
    opts = _diff_options(args, None)
    return run_tui(args.a, args.b, opts)


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (and exit 2) like every other bad input."""

    def error(self, message: str):
        raise UsageError(f"{message} (see `{self.prog} --help`)")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="tensordiff", description=(
        "Differential tensor-tracing debugger: record named tensors on two sides, align them by token "
        "and slot, and name the first divergence."))
    p.add_argument("--version", action="version", version=f"tensordiff {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    i = sub.add_parser("info", help="summarise a trace: metadata, tokens, tensors, slot labels")
    i.add_argument("trace")
    i.add_argument("--json", action="store_true", help="machine-readable output")
    i.set_defaults(func=cmd_info)

    def diff_args(d):
        d.add_argument("a", help="reference trace (what was expected; usually the train side)")
        d.add_argument("b", help="trace under test (usually the serve side)")
        d.add_argument("--tol", action="append", metavar="NAME=MIN_COS,MAX_REL",
                       help="tolerance override for a tensor (NAME, NAME[slot] or '*'); repeatable")
        d.add_argument("--calibration", metavar="FILE", help="tolerances from `tensordiff calibrate`")

    d = sub.add_parser("diff", help="compare two traces and name the first divergence (exit 1 if any)")
    diff_args(d)
    d.add_argument("--json", action="store_true", help="machine-readable output (same content)")
    d.add_argument("--summary", metavar="FILE", help="also write per-token metrics to this HDF5 file")
    d.add_argument("--max-findings", type=int, default=25, help="findings listed in the text report")
    d.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    d.add_argument("--tui", action="store_true", help="open the interactive TUI instead of printing")
    d.set_defaults(func=cmd_diff)

    t = sub.add_parser("tui", help="interactive TUI on the first divergence")
    diff_args(t)
    t.set_defaults(func=cmd_tui)

    c = sub.add_parser("calibrate", help="measure the noise floor of two traces of the same wiring and write tolerances")
    c.add_argument("a")
    c.add_argument("b")
    c.add_argument("--out", required=True, help="tolerances JSON for `diff --calibration`")
    c.add_argument("--margin", type=float, default=4.0, help="allowed multiple of the observed error")
    c.set_defaults(func=cmd_calibrate)

    from .recorders.cli import register
    register(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except UsageError as e:
        _err(str(e))
        return EXIT_BAD_INPUT
    except SystemExit as e:  # --help, --version
        return EXIT_BAD_INPUT if e.code not in (0, None) else EXIT_OK
    try:
        return args.func(args)
    except TensordiffError as e:
        _err(str(e))
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        _err("interrupted")
        return 130
    except BrokenPipeError:
        try:
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - stdout for the rest of the process
        except OSError:
            pass
        return EXIT_OK
    except MemoryError:
        _err("out of memory")
        return EXIT_BAD_INPUT
    except Exception as e:
        if os.environ.get("TENSORDIFF_DEBUG"):
            raise
        _err(f"unexpected {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''} "
             "(set TENSORDIFF_DEBUG=1 for a traceback)")
        return EXIT_BAD_INPUT


def _err(msg: str) -> None:
    msg = " ".join(msg.split())
    sys.stderr.write(f"tensordiff: error: {msg}\n")
    sys.stderr.flush()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
