"""Asserting in a test suite that two traces agree: ``assert_traces_agree(a, b, tol=..., allow=...)``.

>>> from tensordiff.testing import assert_traces_agree
>>> assert_traces_agree("train.h5", "serve.h5")                       # doctest: +SKIP
>>> assert_traces_agree("train.h5", "serve.h5", tol={"layer*": (0.99, 0.05)},
...                     allow=["final_norm"])                          # doctest: +SKIP

It runs the same diff as ``tensordiff diff`` and raises :class:`TracesDisagree` (an
``AssertionError``) when it finds a divergence, with the diff's headline and its first findings as
the message; with the pytest plugin (:mod:`tensordiff.pytest_plugin`) that message is the whole
failure report, without a traceback through tensordiff. ``tol`` takes the CLI's ``--tol`` rules
(strings ``"NAME=MIN_COS,MAX_REL"``, or a mapping of NAME to ``(min_cos, max_rel)``); ``allow``
takes the CLI's ``--allow-failed`` patterns: divergences on matching tensors become notes and
do not fail. A pattern that matches no compared tensor is an error (a typo must not let a
failure through). Bad input (a damaged trace, traces that cannot be compared) raises the
:class:`tensordiff.errors.TensordiffError` it raises at the CLI, not ``TracesDisagree``.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from typing import TypeAlias

from .diff import DiffOptions, diff_traces
from .findings import DiffResult, Finding
from .tolerances import Rule, ToleranceBook, tolerance_book

__all__ = ["TracesDisagree", "assert_traces_agree", "failure_message"]

#: what ``tol`` takes: a book, one ``--tol`` string, NAME -> (min_cos, max_rel), or rules in order
Tol: TypeAlias = "ToleranceBook | str | Mapping[str, Sequence[float]] | Iterable[Rule] | None"


class TracesDisagree(AssertionError):
    """Two traces diverge. ``result`` is the diff (:class:`tensordiff.findings.DiffResult`)."""

    def __init__(self, message: str, result: DiffResult):
        super().__init__(message)
        self.result = result


def failure_message(res: DiffResult, divergences: list[Finding], max_findings: int = 5) -> str:
    """The headline, where it is, and the first divergences (then how many more)."""
    first = divergences[0]
    lines = [f"traces disagree: {first.message}",
             f"  A = {res.path_a}{res.side_tags()[0]}   B = {res.path_b}{res.side_tags()[1]}"]
    if first.tensor is not None and first.position is not None:
        lines.append(f"  first divergence at: tensor {first.tensor}" + (f" slot {first.slot}" if first.slot is not None else "")
                     + f", seq {first.seq}, position {first.position}, token {first.token}")
    lines.append(f"  {len(divergences)} divergence{'s' if len(divergences) != 1 else ''}, in forward order:")
    for f in divergences[:max_findings]:
        inh = f" (may be inherited from #{f.inherited_from})" if f.inherited_from is not None else ""
        lines.append(f"  ✗ #{f.index} {f.kind}: {f.message}{inh}")
    if len(divergences) > max_findings:
        lines.append(f"  ... {len(divergences) - max_findings} more (tensordiff diff {res.path_a} {res.path_b})")
    return "\n".join(lines)


def _book(tol: Tol, calibration: str | os.PathLike[str] | None, allow: Iterable[str] | str) -> ToleranceBook:
    """The CLI's rules: ``--tol`` strings (or a TOML file) and ``(pattern, (min_cos, max_rel))``
    items in order (the first rule that matches wins), then ``--allow-failed`` patterns."""
    allowed = [allow] if isinstance(allow, str) else list(allow)
    if isinstance(tol, ToleranceBook):
        # a copy: the caller's book may serve other diffs, which must not inherit this one's
        # calibration or --allow-failed patterns
        book = replace(tol, overrides=dict(tol.overrides), calibrated=dict(tol.calibrated), rules=list(tol.rules),
                       allow_failed=[*tol.allow_failed, *allowed])
        if calibration:
            book.load_calibration(os.fspath(calibration))
        return book
    items: list[Rule] = ([] if tol is None else [tol] if isinstance(tol, str)
                         else list(tol.items()) if isinstance(tol, Mapping) else list(tol))
    return tolerance_book(items, allow_failed=allowed, calibration=calibration)


def assert_traces_agree(a: str | os.PathLike[str], b: str | os.PathLike[str], *, tol: Tol = None,
                        allow: Iterable[str] | str = (), calibration: str | os.PathLike[str] | None = None,
                        max_findings: int = 5, allow_incomplete: bool = False) -> DiffResult:
    """Diff trace ``a`` (the reference) against ``b``; raise :class:`TracesDisagree` on a
    divergence that ``allow`` does not cover, and when some paired tensor could not be compared
    (verdict ``incomplete``) unless ``allow_incomplete``: "agree" is never said of data that was
    not compared. Returns the diff when they agree."""
    opts = DiffOptions(tolerances=_book(tol, calibration, allow), allow_incomplete=allow_incomplete)
    res = diff_traces(os.fspath(a), os.fspath(b), opts)
    if res.divergences:
        raise TracesDisagree(failure_message(res, res.divergences, max_findings), res)
    if res.verdict == "incomplete" and not allow_incomplete:
        raise TracesDisagree(incomplete_message(res, max_findings), res)
    return res


def incomplete_message(res: DiffResult, max_findings: int = 5) -> str:
    """The headline and the tensors that could not be compared, with why."""
    missing = [p for p in res.pairs if not p.compared]
    lines = [f"traces not fully compared: {res.headline()}",
             f"  A = {res.path_a}{res.side_tags()[0]}   B = {res.path_b}{res.side_tags()[1]}"]
    for p in missing[:max_findings]:
        name = p.name_a if p.name_a == p.name_b or not p.name_b else f"{p.name_a or '-'} vs {p.name_b}"
        lines.append(f"  ? {name}: {p.not_compared or 'not compared'}")
    if len(missing) > max_findings:
        lines.append(f"  ... {len(missing) - max_findings} more (tensordiff diff {res.path_a} {res.path_b})")
    lines.append("  (pass allow_incomplete=True, or ini tensordiff_allow_incomplete = true, when that is expected)")
    return "\n".join(lines)
