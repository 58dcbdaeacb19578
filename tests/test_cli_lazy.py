"""The CLI parses a diff (or info, tui, report, calibrate) without importing the recorders'
argument modules, and every other command line still sees them."""

from __future__ import annotations

import subprocess
import sys

from tensordiff.cli import CORE_COMMANDS, build_parser


def _choices(parser):
    sub = next(a for a in parser._actions if a.dest == "command")
    return set(sub.choices)


def test_a_core_command_parses_without_the_recorders():
    code = ("import sys; from tensordiff.cli import build_parser\n"
            "p = build_parser('diff'); a = p.parse_args(['diff', 'x.h5', 'y.h5', '--json'])\n"
            "assert a.command == 'diff' and a.json\n"
            "print(sorted(m for m in sys.modules if m.startswith('tensordiff.recorders')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]"


def test_other_command_lines_keep_every_command():
    for first in (None, "record", "import", "--help", "dif"):
        assert {"record", "import"} | set(CORE_COMMANDS) <= _choices(build_parser(first))
    for first in CORE_COMMANDS:
        assert set(CORE_COMMANDS) <= _choices(build_parser(first))
    a = build_parser("import").parse_args(["info", "t.h5"])
    assert a.command == "info"


def test_a_serial_diff_imports_neither_the_pool_nor_rich_emoji_codes(tmp_path):
    """A diff under the pool's threshold runs in this process: the pool's modules (multiprocessing,
    concurrent.futures) are start-up it does not need; nor does a report without emoji codes."""
    from tracegen import write_verdict_pairs

    a, b = write_verdict_pairs(tmp_path)["wrong"]
    code = ("import sys, contextlib, io\nfrom tensordiff.cli import main\n"
            f"with contextlib.redirect_stdout(io.StringIO()):\n    rc = main(['diff', {a!r}, {b!r}])\n"
            "print(rc, sorted(m for m in ('tensordiff.parallel', 'multiprocessing', 'concurrent.futures.process', "
            "'rich._emoji_codes') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "1 []", out
