"""Numbers a reader can read in the text report, on frozen diff results (tests/golden, no diff run):
one convention for cosines (``1 - cos``) in the tables and the sentences, a cosine limit near 1
shown as the ``1 - cos`` it allows, headers never cut, no slot for a tensor without slots, and the
findings' sentences aligned whatever the width of their numbers."""

from __future__ import annotations

import json
import os
import re

import pytest
from rich.console import Console

from tensordiff.findings import DiffResult
from tensordiff.report.text import print_diff

GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden")


def _text(case: str, width: int) -> str:
    with open(os.path.join(GOLDEN, f"{case}.json"), encoding="utf-8") as f:
        res = DiffResult.from_dict(json.load(f))
    console = Console(width=width, record=True, file=open(os.devnull, "w"), color_system=None)
    print_diff(res, console)
    return "\n".join(line.rstrip() for line in console.export_text().splitlines())


@pytest.mark.parametrize("width", [80, 120, 200])
def test_cosines_read_one_way_and_a_limit_near_one_is_not_1(width):
    out = _text("example.ab", width)
    # the findings quote 1 - cos; the tables do too, never a cosine beside them
    flat = " ".join(out.split())
    assert "1 - cos 0.19 > 1.1e-13 allowed" in flat
    for old in ("cos min", "cos mean", "tol cos", "cos >="):
        assert not re.search(rf"(?<!1 - )(?<!1-){old}", flat), old
    assert "1-cos max" in out and "tol 1-cos" in out
    table = out.split("\ntensors\n", 1)[1].split("\n≈", 1)[0]
    fc = next(line for line in table.splitlines() if line.startswith(" draft_fc_output"))
    assert "≈0.6004" in fc.split(), fc                    # 1 - 0.3996, as the finding's 1 - cos reads
    # a limit of 1 - 2.9e-11 (or 1 - 1.1e-13) once printed as "1": its 1 - cos is shown, on every row
    assert not re.search(r"(^|\s)1 ?/ ", table), table
    assert sum(bool(re.search(r"\de-1\d /", line)) for line in table.splitlines()) == 14, table


@pytest.mark.parametrize("width", [80, 120])
def test_no_header_or_cell_is_cut(width):
    out = _text("example.ab", width)
    assert "…" not in out, [line for line in out.splitlines() if "…" in line]
    assert "KL(target" in out


def test_worst_tokens_name_no_slot_for_a_tensor_without_slots():
    out = _text("acceptance_fc.ab", 200)
    rows = [line.split("│") for line in out.split("\nworst tokens\n", 1)[1].splitlines()[2:] if "│" in line]
    assert rows and all(r[0].strip() == "draft_fc_output" for r in rows), rows
    assert all(r[1].strip() == "" for r in rows), rows   # draft_fc_output has no slots: no "0"
    out = _text("example.ab", 200)
    rows = [line.split("│") for line in out.split("\nworst tokens\n", 1)[1].splitlines()[2:] if "│" in line]
    assert rows and all(r[0].strip() == "draft_input" and r[1].strip() == "0" for r in rows), rows


def test_findings_ten_and_up_align_with_the_ones_below_ten():
    out = _text("example.ab", 120)
    lines = [line for line in out.splitlines() if re.match(r"^\s*[✗!·]\s+#\d+", line)]
    assert len(lines) >= 11, lines
    marks = {line.index(line.strip()[0]) for line in lines}
    starts = {re.match(r"^\s*[✗!·]\s+#\d+\s+", line).end() for line in lines}
    assert len(marks) == 1 and len(starts) == 1, lines
