"""The diff's ``--json`` output, byte for byte, against outputs frozen in tests/golden/ (both
argument orders, paths normalised): a change of the diff's internals must not change a verdict,
a number or the order of anything. A deliberate change regenerates them with
``.venv/bin/python tests/golden/make_golden.py [CASE ...]`` and the diff of the files is reviewed.

A few cases' numbers depend on the kind of machine (the float32 rounding of its matrix products:
tests/golden/make_golden.py); their outputs on other kinds of machine are frozen too, as variants,
and the output must equal the main file or one of them."""

from __future__ import annotations

import difflib
import os
import sys

import pytest

GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden")
sys.path.insert(0, GOLDEN)

from make_golden import CASES, ORDERS, golden_path, outputs, variant_paths  # noqa: E402


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
        if got[order] == want:
            continue
        variants = variant_paths(case.name, order)
        if any(_read(p) == got[order] for p in variants):
            continue
        delta = "".join(list(difflib.unified_diff(want.splitlines(True), got[order].splitlines(True),
                                                  f"golden/{case.name}.{order}.json", "now", n=2))[:80])
        also = f" (nor any of its variants: {', '.join(os.path.relpath(p, GOLDEN) for p in variants)})" if variants else ""
        pytest.fail(f"{case.name} ({order}): the diff's JSON changed{also}:\n{delta}")


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def test_a_variant_differs_from_its_main_file_and_names_a_case():
    """Variants hold only outputs that differ from the main file, of cases that exist: a stale
    variant equal to the main file, or of a renamed case, would be a reference nobody reviews."""
    from make_golden import CASES_BY_NAME, VARIANTS
    seen = 0
    for tag in sorted(os.listdir(VARIANTS)) if os.path.isdir(VARIANTS) else []:
        for fn in sorted(os.listdir(os.path.join(VARIANTS, tag))):
            name, order, ext = fn.rsplit(".", 2)
            assert ext == "json" and name in CASES_BY_NAME and order in ORDERS, fn
            assert _read(os.path.join(VARIANTS, tag, fn)) != _read(golden_path(name, order)), f"{tag}/{fn}"
            seen += 1
    assert seen > 0
