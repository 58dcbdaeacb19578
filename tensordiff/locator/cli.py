"""``tensordiff locate A B --prompts FILE``: the arguments and the handler. Imports nothing heavy
at import time: the parser is built for every command."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys

__all__ = ["add_arguments", "register", "run"]

HELP = "run the whole diagnosis loop on two models: record, diff, zoom, graft, weights; name the op"
DESCRIPTION = (
    "Find where B departs from the reference A, down to the op: record both sides and diff; zoom into "
    "the layer before the first boundary out of the noise and name its op and the kind of difference; "
    "confirm by grafting A's states into B; compare that layer's weights and the configs. Each step is "
    "printed (on stderr) as the command that runs it alone; the report's first line is the final sentence. "
    "A and B: an HF model directory (run in transformers), an existing trace (used as it is), "
    "module:pkg.mod:factory, a user's port: a callable returning a torch.nn.Module called as an HF causal "
    "LM (the spec's form is checked before anything is imported), or sglang:DIR / vllm:DIR, the engine "
    "serving DIR (`tensordiff record serve --engine E` as a child process, vLLM by its venv's python: "
    ".venv-vllm or TENSORDIFF_VLLM_PYTHON), zoomed and grafted through TENSORDIFF_ZOOM and TENSORDIFF_GRAFT.")
EPILOG = ("exit codes: 0 A and B agree (after one diff), 1 a divergence found (the report says where), 2 bad "
          "input (one line on stderr), 130 interrupted (the traces written so far are complete; resume with "
          "--resume DIR)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("a", metavar="A", help="the reference: a model directory, a trace, or module:pkg.mod:factory")
    p.add_argument("b", metavar="B", help="the side under test (the port): the same kinds")
    p.add_argument("--prompts", required=True, metavar="FILE",
                   help="JSONL prompts as `record train` reads them (token ids, or text with a tokenizer)")
    p.add_argument("--out", metavar="DIR", help="where the traces go (default ./tensordiff-locate)")
    p.add_argument("--resume", metavar="DIR", help="continue an interrupted run in DIR: recordings whose traces "
                                                  "exist there are skipped")
    p.add_argument("--json", action="store_true", help="the report as JSON on stdout")
    p.add_argument("--html", metavar="FILE", help="also write the last diff's HTML report (as `tensordiff report`)")
    p.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="an engine argument for every sglang:/vllm: recording (as `record serve --engine-arg`); "
                        "repeatable")
    for s in ("a", "b"):
        p.add_argument(f"--dtype-{s}", choices=("float32", "bfloat16", "float16"),
                       help=f"load {s.upper()} in this dtype (default: its checkpoint's)")
    p.add_argument("--name-rule", action="append", default=[], metavar="REGEX=TAP",
                   help="name a module: port's modules for the zoom (as `record train --name-rule`); repeatable")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("locate", help=HELP, description=DESCRIPTION, epilog=EPILOG)
    add_arguments(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..errors import UsageError
    from .loop import LocateInterrupted, LocateOptions, run_locate

    if args.resume and args.out and os.path.abspath(args.resume) != os.path.abspath(args.out):
        raise UsageError("--resume DIR continues in DIR: give one of --out and --resume, or the same directory")
    out = args.resume or args.out or "tensordiff-locate"
    if args.resume and not os.path.isdir(args.resume):
        raise UsageError("--resume: no such directory", args.resume)

    from ..safety import sanitize_for_terminal

    def echo(line: str) -> None:   # commands quote paths, and a trace's model.path: escaped
        sys.stderr.write(sanitize_for_terminal(line) + "\n")
        sys.stderr.flush()

    opts = LocateOptions(a=args.a, b=args.b, prompts=args.prompts, out=os.path.abspath(out), dtype_a=args.dtype_a,
                         dtype_b=args.dtype_b, name_rules=tuple(args.name_rule), resume=bool(args.resume),
                         progress=not args.no_progress, echo=echo, engine_args=tuple(args.engine_arg),
                         html=args.html)
    try:
        res = run_locate(opts)
    except LocateInterrupted as e:
        again = ["tensordiff", "locate", args.a, args.b, "--prompts", args.prompts, "--resume", e.out]
        for flag, v in (("--dtype-a", args.dtype_a), ("--dtype-b", args.dtype_b)):
            if v:
                again += [flag, v]
        for r in args.name_rule:
            again += ["--name-rule", r]
        for r in args.engine_arg:
            again += ["--engine-arg", r]
        if args.html:
            again += ["--html", args.html]
        sys.stderr.write(("\r\x1b[2K" if sys.stderr.isatty() else "")
                         + f"tensordiff: error: interrupted during step '{e.step}'; the {len(e.done)} trace(s) "
                         f"written before it are complete in {e.out}; resume from that step with: "
                         f"{shlex.join(again)}\n")
        return 130
    if args.json:
        sys.stdout.write(json.dumps(res.to_dict(), indent=2) + "\n")
    else:
        # the configs' keys and values, paths and op names come from files: escaped, line breaks kept
        sys.stdout.write(sanitize_for_terminal(res.text(), keep="\n") + "\n")
    return res.exit_code
