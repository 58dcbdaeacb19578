"""The diff's ``--json`` output, byte for byte, against outputs frozen in tests/golden/ (both
argument orders, paths normalised): a change of the diff's internals must not change a verdict,
a number or the order of anything. A deliberate change regenerates them with
``.venv/bin/python tests/golden/make_golden.py [CASE ...]`` and the diff of the files is reviewed."""

from __future__ import annotations

import difflib
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden"))

from make_golden import CASES, ORDERS, golden_path, outputs  # noqa: E402


def _params():
    for c in CASES:
        marks = [pytest.mark.torch] if c.torch else []
        yield pytest.param(c, id=c.name, marks=marks)


@pytest.mark.parametrize("case", list(_params()))
def test_diff_json_is_unchanged(case):
    if case.torch:
        pytest.importorskip("torch")
        pytest.importorskip("transformers")
    got = outputs(case)
    for order in ORDERS:
        with open(golden_path(case.name, order), encoding="utf-8") as f:
            want = f.read()
        if got[order] != want:
            delta = "".join(list(difflib.unified_diff(want.splitlines(True), got[order].splitlines(True),
                                                      f"golden/{case.name}.{order}.json", "now", n=2))[:80])
            pytest.fail(f"{case.name} ({order}): the diff's JSON changed:\n{delta}")
