# ruff: noqa: F811
"""The TUI as a newcomer meets it (through Textual's Pilot): at 80 x 24, numbering that matches
the text report, two runs of the same side, the go-to example."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import make_doc_images  # noqa: E402

import pytest
# the fixtures of test_tui.py, shared by importing them (a test's parameter then shadows the import)
from test_tui import anyio_backend, fixture_app, fixture_diff, fixture_pair, wait_ready  # noqa: F401

from tensordiff.tui.app import TensordiffApp
from tensordiff.tui.widgets import GotoScreen

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = (str(ROOT / "traces" / "train.h5"), str(ROOT / "traces" / "serve.h5"))

pytestmark = pytest.mark.anyio


async def test_goto_example_names_a_sequence_of_the_trace():
    """The example pair names its sequences p0..p3: the go-to example must not say s0."""
    app = TensordiffApp(*EXAMPLE, find_tokenizer=False)
    async with app.run_test(size=(120, 36)) as pilot:
        await wait_ready(app, pilot)
        await pilot.press("g")
        assert isinstance(app.screen, GotoScreen)
        placeholder = app.screen.query_one("#goto-input").placeholder
        assert "p0:" in placeholder and "s0:" not in placeholder, placeholder
        await pilot.press(*"p1:2", "enter")
        tok = app.summary.tokens(app.heatmap.cursor_row, app.heatmap.cursor_row + 1)[0]
        assert app.summary.seq_a[int(tok["seq_a"])] == "p1" and int(tok["pos_a"]) == 2


async def test_findings_numbered_in_the_order_shown_and_n_steps_over_divergences():
    app = TensordiffApp(*EXAMPLE, find_tokenizer=False)
    async with app.run_test(size=(120, 36)) as pilot:
        await wait_ready(app, pilot)
        res = app.result
        assert [f.index for f in res.findings] == list(range(len(res.findings)))
        fl = app.query_one("#findings")
        shown = [str(fl.get_option_at_index(i).prompt) for i in range(fl.option_count)]
        assert [s.split("#", 1)[1].split(" ", 1)[0] for s in shown] == [str(i) for i in range(len(shown))], shown
        divs = [f.index for f in res.findings if f.severity == "divergence"]
        assert len(divs) >= 2 and len(res.findings) > len(divs)
        assert app.selected_finding == divs[0]
        seen = [app.selected_finding]
        for _ in range(len(res.findings)):
            await pilot.press("n")
            await pilot.pause()
            seen.append(app.selected_finding)
        assert set(seen) == set(divs), seen   # never onto a note
        await pilot.press("p")
        await pilot.pause()
        assert app.selected_finding == divs[-2]


async def test_same_side_pair_says_a_and_b(tmp_path):
    """Two train runs: the TUI's header and detail pane say A and B, not train and train."""
    import re

    from tracegen import write_trace

    a, b = str(tmp_path / "run1.h5"), str(tmp_path / "run2.h5")
    write_trace(a, side="train")
    write_trace(b, side="train", seed=1, noise=1e-6, packed_labels=("layer2", "layer3"))
    app = TensordiffApp(a, b, find_tokenizer=False)
    async with app.run_test(size=(120, 36)) as pilot:
        await wait_ready(app, pilot)
        detail = app.detail_text.plain
        assert re.search(r"\bA: \S+ pos \d+", detail) and re.search(r"\bB: \S+ pos \d+", detail), detail
        shown = "\n".join(str(w.render()) for w in app.query("Static")) + detail
        side = (r"\btrain(?:'s| claims| holds| labels| has| positions| pairs| score| margin| keeps|: )|\[train\]"
                r"|\bon train\b|\bbetween train\b|\btrain and train\b|\btrain vs\b")
        assert not re.search(side, shown), shown
        assert "B holds layer2" in detail and "A holds layer1" in detail, detail


# ----------------------------------------------------------------------------------------------
# 80 x 24
# ----------------------------------------------------------------------------------------------


def screen_lines(app) -> list[str]:
    """The screen as text lines, from the app's own SVG screenshot (what a snapshot stores), read
    as the docs' screenshot check reads it."""
    return make_doc_images.svg_text(app.export_screenshot())


async def test_80x24_findings_tree_and_headers_readable(fixture_app):
    app = fixture_app()
    async with app.run_test(size=(80, 24)) as pilot:
        await wait_ready(app, pilot)
        lines = screen_lines(app)
        text = "\n".join(lines)
        # the three divergences are told apart: each names its slot
        for k in range(3):
            assert f"draft_input[{k}]" in text, text
        # the tree keeps what the wrong slot holds
        assert "holds layer3" in text and "holds layer5" in text, text
        # the heatmap's header names the packed tensor and each of its slots in full
        header = next(x for x in lines if "[0]" in x and "[2]" in x and "L5" in x)
        assert "[0] [1] [2]" in header, header
        assert any("draft_input" in x for x in lines[lines.index(header) - 1:lines.index(header)]), text


async def test_80x24_titles_whole_and_the_held_state_without_scrolling(fixture_app):
    """At 80 x 24 every pane's title is whole, the headline is whole (on two lines), the heatmap's
    columns other than layers are spelled out above their short labels, and the detail pane shows
    what the slot holds on each side and the best candidates without scrolling."""
    app = fixture_app()
    async with app.run_test(size=(80, 24)) as pilot:
        await wait_ready(app, pilot)
        lines = screen_lines(app)
        text = "\n".join(lines)
        titles = [x for x in lines if "╭─" in x]
        assert titles and not any("…" in x for x in titles), titles
        assert "findings: 3 ✗, 3 other" in text and "relative error: 80 tokens, 13 columns" in text, text
        flat = " ".join(" ".join(x.strip("│╭╮╰╯─ ") for x in lines[:4]).split())
        assert app.result.headline() in flat, flat
        detail = lines[next(i for i, x in enumerate(lines) if "─ detail " in x):]
        body = " ".join(" ".join(x.split("││", 1)[-1].strip("│ ") for x in detail).split())
        assert "serve holds layer3 (claims layer3), train holds embed (claims embed)" in body, body
        assert "candidates layer3 1.000" in body, body


async def test_80x24_help_fits(fixture_app):
    app = fixture_app()
    async with app.run_test(size=(80, 24)) as pilot:
        await wait_ready(app, pilot)
        await pilot.press("question_mark")
        await pilot.pause()
        text = "\n".join(screen_lines(app))
        for key in ("n / p", "f", "g", "/", "m", "a", "[", "< >", "s", "?", "q"):
            assert key in text, text
        for words in ("quit", "screenshot", "hide", "this help", "Esc closes"):
            assert words in text, text


def test_snapshot_80x24(snap_compare, fixture_app):
    async def ready(pilot):
        await wait_ready(pilot.app, pilot)

    assert snap_compare(fixture_app(), terminal_size=(80, 24), run_before=ready)


def test_snapshot_80x24_help(snap_compare, fixture_app):
    async def ready(pilot):
        await wait_ready(pilot.app, pilot)

    assert snap_compare(fixture_app(), press=["question_mark"], terminal_size=(80, 24), run_before=ready)


def test_heatmap_labels_of_states_that_are_not_layers_are_spelled_out():
    """``fn`` and ``dra`` read as nothing: final_norm is ``nrm``, the draft's fc output ``fc``, and
    the header line above a run of unpacked columns writes the names those labels stand for."""
    from tensordiff.summary import Column, short_label
    from tensordiff.tui.widgets import CELL_W, run_names

    assert [short_label(x) for x in ("embed", "layer3", "final_norm", "draft_fc_output", "draft_mystery_state")] == \
        ["emb", "L3", "nrm", "fc", "dms"]
    cols = [Column(i, label, label, label, 0, float(i), None, False)
            for i, label in enumerate(["layer6", "layer7", "layer8", "final_norm", "draft_fc_output"])]
    line = run_names(cols)
    assert len(line) == len(cols) * CELL_W and line == "     final_norm draf", line   # each name from its column on
