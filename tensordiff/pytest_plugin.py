"""pytest plugin of tensordiff (entry point ``pytest11``): trace agreement as a test.

    def test_train_and_serve_agree(assert_traces_agree):
        assert_traces_agree("train.h5", "serve.h5")

The fixture ``assert_traces_agree`` is :func:`tensordiff.testing.assert_traces_agree` with the
defaults of the ini options ``tensordiff_tol`` (lines of ``NAME=MIN_COS,MAX_REL``),
``tensordiff_allow_failed`` (lines of patterns) and ``tensordiff_calibration`` (a file), and of
the command-line option ``--tensordiff-allow-failed PATTERN`` (repeatable); arguments given in
the call come first. When traces disagree, the failure report is the diff's headline and its
first findings, not a traceback through tensordiff.

Loading this plugin costs nothing in a session that does not use it: tensordiff's diff is
imported when the fixture is first used.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Generator, Iterable
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from _pytest._code.code import TracebackEntry
    from pluggy import Result

    from .findings import DiffResult
    from .testing import Tol


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("tensordiff")
    group.addoption("--tensordiff-allow-failed", action="append", default=[], metavar="PATTERN",
                    help="tensordiff: divergences on tensors matching PATTERN (glob, or re:REGEX) do not fail")
    parser.addini("tensordiff_tol", "tensordiff tolerance rules, one NAME=MIN_COS,MAX_REL per line", type="linelist")
    parser.addini("tensordiff_allow_failed", "tensordiff --allow-failed patterns, one per line", type="linelist")
    parser.addini("tensordiff_calibration", "tensordiff calibration file (from `tensordiff calibrate`)", default="")
    parser.addini("tensordiff_allow_incomplete", "tensordiff: traces that agree in what could be compared pass even "
                  "when some paired tensor could not be compared", type="bool", default=False)


@pytest.fixture
def assert_traces_agree(pytestconfig: pytest.Config) -> Callable[..., DiffResult]:
    """``assert_traces_agree(a, b, tol=..., allow=..., calibration=...)`` with the ini defaults."""
    from . import testing

    ini_tol = list(pytestconfig.getini("tensordiff_tol"))
    ini_allow = list(pytestconfig.getini("tensordiff_allow_failed")) + list(
        pytestconfig.getoption("tensordiff_allow_failed") or [])
    ini_cal = pytestconfig.getini("tensordiff_calibration") or None
    ini_incomplete = bool(pytestconfig.getini("tensordiff_allow_incomplete"))

    def check(a: str | os.PathLike[str], b: str | os.PathLike[str], *, tol: Tol = None,
              allow: Iterable[str] | str = (), calibration: str | os.PathLike[str] | None = None,
              max_findings: int = 5, allow_incomplete: bool | None = None) -> DiffResult:
        if tol is None or isinstance(tol, (str, dict, list, tuple)):
            # the call's rules first: the first rule that matches a tensor wins
            given = [tol] if isinstance(tol, str) else (
                [f"{k}={v[0]},{v[1]}" for k, v in tol.items()] if isinstance(tol, dict) else list(tol or []))
            tol = given + ini_tol
        pats = ([allow] if isinstance(allow, str) else list(allow)) + ini_allow
        return testing.assert_traces_agree(a, b, tol=tol, allow=pats, calibration=calibration or ini_cal,
                                           max_findings=max_findings,
                                           allow_incomplete=ini_incomplete if allow_incomplete is None else allow_incomplete)

    return check


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item,
                              call: pytest.CallInfo[None]) -> Generator[None, Result[pytest.TestReport], None]:
    outcome = yield
    testing = sys.modules.get("tensordiff.testing")
    if testing is None or call.excinfo is None:
        return
    from .errors import TensordiffError

    err = call.excinfo.value
    if isinstance(err, testing.TracesDisagree):
        words = str(err)
    elif isinstance(err, TensordiffError) and _raised_by_tensordiff(call.excinfo.traceback):
        # bad input (a missing or damaged trace): the CLI's one line, not a traceback through the reader
        from .safety import sanitize_for_terminal

        words = f"tensordiff: error: {sanitize_for_terminal(' '.join(str(err).split()))}"
    else:
        return
    report = outcome.get_result()
    # where in the test it was asserted (the last frame in the test's file), then the diff's words
    where = ""
    for entry in call.excinfo.traceback:
        if str(entry.path) == str(item.path):
            where = f"{item.path.name}:{entry.lineno + 1}: "
    report.longrepr = f"{where}{words}"


def _raised_by_tensordiff(tb: Iterable[TracebackEntry]) -> bool:
    """Whether the error came out of ``assert_traces_agree`` (a test's own use of tensordiff's
    classes keeps pytest's report)."""
    return any(entry.frame.code.name in ("assert_traces_agree", "check") and "tensordiff" in str(entry.path)
               for entry in tb)
