"""No stage of a diff writes into what it was given, and the stages run once each, in order.

The example pair and every golden case (tests/golden/) are diffed with the traces behind views
that refuse any attribute write, and the options compared byte for byte (pickled) before and
after; the result's own JSON is the golden one, and printing it changes nothing of it. The call
path of ``tensordiff diff`` on the example pair, from the CLI to its first sentence, is traced
(``sys.setprofile``): plan, stream, judge, analyses, order, report, each entered once, in that
order."""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import sys
from typing import Any

import pytest

from tensordiff.diff import DiffOptions, diff_sources, open_pair
from tensordiff.findings import Severity

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOLDEN = os.path.join(ROOT, "tests", "golden")
sys.path.insert(0, GOLDEN)

from make_golden import CASES, golden_path, normalise, variant_paths, write_pair  # noqa: E402

TRAIN, SERVE = os.path.join(ROOT, "traces", "train.h5"), os.path.join(ROOT, "traces", "serve.h5")


class Written(AssertionError):
    pass


class _Frozen:
    """A trace seen through a view that refuses every attribute write (reads go through)."""

    def __init__(self, source: Any):
        object.__setattr__(self, "_source", source)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(object.__getattribute__(self, "_source"), name)

    def __setattr__(self, name: str, value: Any) -> None:
        raise Written(f"a stage set {name!r} on a trace it was given")

    def __delattr__(self, name: str) -> None:
        raise Written(f"a stage deleted {name!r} of a trace it was given")


def _diff_frozen(a: str, b: str, options: dict[str, Any]):
    """The diff of ``a`` and ``b`` with the traces frozen; asserts the options and the traces'
    names unchanged, and that printing the result changes nothing of it."""
    from tensordiff.cli import jsonable
    from tensordiff.report.text import make_console, print_diff

    opts = DiffOptions(**options)
    before = pickle.dumps(opts)
    with open_pair(a, b) as (ra, rb):
        sides = (ra.side, rb.side)
        res = diff_sources(_Frozen(ra), _Frozen(rb), opts)
        assert (ra.side, rb.side) == sides   # two traces of one side are named apart in the result only
    assert pickle.dumps(opts) == before, "the diff changed its options"
    import json
    text = json.dumps(jsonable(res.to_dict()), indent=2) + "\n"
    kept = pickle.dumps(res)
    print_diff(res, make_console(io.StringIO()))
    assert pickle.dumps(res) == kept, "the report changed the result it printed"
    if res.findings:
        with pytest.raises(dataclasses.FrozenInstanceError):
            res.findings[0].severity = Severity.INFO   # type: ignore[misc]
    return res, text


def test_the_example_pair_is_diffed_without_a_write_to_anything_given():
    res, _ = _diff_frozen(TRAIN, SERVE, {})
    assert res.exit_code == 1 and res.findings
    res, _ = _diff_frozen(SERVE, TRAIN, {})
    assert res.exit_code == 1


def test_two_traces_of_one_side_are_named_apart_without_renaming_them():
    res, _ = _diff_frozen(TRAIN, TRAIN, {})
    assert (res.side_a, res.side_b) == ("A", "B") and res.exit_code == 0


def _params():
    for c in CASES:
        yield pytest.param(c, id=c.name, marks=[pytest.mark.torch] if c.torch else [])


@pytest.mark.parametrize("case", list(_params()))
def test_a_golden_case_is_diffed_without_a_write_to_anything_given(case, tmp_path):
    if case.torch:
        pytest.importorskip("torch")
        pytest.importorskip("transformers")
    d = str(tmp_path)
    a, b = write_pair(case, d)
    for order, (x, y) in (("ab", (a, b)), ("ba", (b, a))):
        _, text = _diff_frozen(x, y, case.options)
        got = normalise(text, d)
        with open(golden_path(case.name, order), encoding="utf-8") as f:
            want = f.read()
        assert got == want or any(open(p, encoding="utf-8").read() == got for p in variant_paths(case.name, order)), \
            f"{case.name} ({order}): the frozen diff's JSON is not the golden one"


# -- the call path -------------------------------------------------------------------------------

#: each stage's entry point, by module and function (qualified name)
STAGES = (
    ("plan", "tensordiff.diff.plan", ("plan_diff",)),
    ("stream", "tensordiff.diff.stream", ("stream",)),
    ("judge", "tensordiff.diff.judge", ("judge",)),
    ("analyses", "tensordiff.diff.analyses", ("Routing.findings", "ResidualRule.findings", "ZoomSignature.findings",
                                              "Graft.findings", "Acceptance.findings")),
    ("order", "tensordiff.diff.order", ("order",)),
    ("report", "tensordiff.report.text", ("print_diff",)),
)


def test_the_diff_from_the_cli_to_its_first_sentence_enters_each_stage_once_in_order(monkeypatch, capsys):
    from tensordiff import cli

    monkeypatch.setenv("TENSORDIFF_NO_PROBE", "1")   # the diff in this process, where it can be traced
    monkeypatch.setenv("COLUMNS", "120")
    entries: dict[str, str] = {}
    for stage, module, names in STAGES:
        for n in names:
            entries[f"{module}:{n}"] = stage
    seen: list[tuple[str, str]] = []   # (stage, entry point), once per frame (a generator resumed is one)
    frames: set[int] = set()
    live: list[Any] = []

    def profile(frame, event, arg):
        if event != "call":
            return
        code = frame.f_code
        key = f"{frame.f_globals.get('__name__')}:{code.co_qualname}"
        stage = entries.get(key)
        if stage is not None and id(frame) not in frames:
            frames.add(id(frame))
            live.append(frame)   # kept alive: an id is not reused while the test runs
            seen.append((stage, key))

    sys.setprofile(profile)
    try:
        code = cli.main(["diff", TRAIN, SERVE])
    finally:
        sys.setprofile(None)
    out = capsys.readouterr().out
    assert code == 1
    # each entry point entered once
    keys = [k for _, k in seen]
    assert len(keys) == len(set(keys)), keys
    assert set(keys) == set(entries), sorted(set(entries) - set(keys))
    # the stages in order, each a run of its own
    order = [s for i, (s, _) in enumerate(seen) if i == 0 or seen[i - 1][0] != s]
    assert order == [s for s, _, _ in STAGES], order
    # and what the report printed first is the diff's first sentence
    from tensordiff.diff import diff_traces
    assert out.splitlines()[0] == diff_traces(TRAIN, SERVE).headline()
