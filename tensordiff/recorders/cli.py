"""Wires ``tensordiff record train|serve`` and ``tensordiff import`` into the CLI.

No torch at import time: each handler module is imported only when its command runs, so
``tensordiff info`` and ``tensordiff diff`` work without torch installed.
"""

from __future__ import annotations

import argparse
import importlib

# command -> module with add_arguments(parser) and run(args) -> int
RECORD_COMMANDS = {
    "train": ("tensordiff.recorders.train_cli",
              "record the train side: an HF transformers model's boundaries and the packed draft input"),
    "serve": ("tensordiff.recorders.serve_cli",
              "record the serve side: run an offline SGLang engine (or vLLM, --engine vllm) with the tensordiff plugin"),
}
IMPORT_MODULE = "tensordiff.recorders.import_cli"


def _lazy(module: str):
    def run(args: argparse.Namespace) -> int:
        return importlib.import_module(module).run(args)
    return run


def register(sub: argparse._SubParsersAction) -> None:
    rec = sub.add_parser("record", help="record a trace (needs the torch extra)",
                         description="Record a trace on one side of a comparison.")
    rsub = rec.add_subparsers(dest="side", metavar="{train,serve}")
    rsub.required = True
    for name, (module, help_) in RECORD_COMMANDS.items():
        p = rsub.add_parser(name, help=help_, description=help_)
        p.set_defaults(func=_add_args(module, p))
    imp = sub.add_parser("import", help="convert files users already have (SpecForge, speculators, SGLang dumps) to a trace",
                         description="Convert SpecForge offline hidden states, speculators data files or an SGLang "
                                     "dumper directory into a tensordiff trace.")
    imp.set_defaults(func=_add_args(IMPORT_MODULE, imp))


def _add_args(module: str, parser: argparse.ArgumentParser):
    """Argument definitions live beside each handler, in a module that imports torch only in run().
    Returns the handler (one that explains the problem if the module cannot be imported)."""
    try:
        importlib.import_module(module).add_arguments(parser)
    except ImportError as e:
        parser.add_argument("rest", nargs=argparse.REMAINDER)
        reason = f"{e}"

        def unavailable(args: argparse.Namespace) -> int:
            from ..errors import UsageError
            raise UsageError(f"this command is unavailable in this install ({reason})")
        return unavailable
    return _lazy(module)
