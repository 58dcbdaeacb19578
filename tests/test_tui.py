"""The TUI, driven headless by Textual's Pilot (App.run_test): keys, clicks and the state they leave.

The pair under test is the example pair in traces/ (train.h5 + serve.h5) when it exists, otherwise a
seeded fixture pair built here with TraceWriter: catalog boundaries embed, layer1..layer8 and
final_norm, and a packed draft_input whose 3 slots hold [embed, layer3, layer5] on train but
[layer3, layer5, layer7] on serve. Snapshot tests always use the fixture pair (fixed data, fixed
terminal size); update them with ``pytest tests/test_tui.py --snapshot-update``.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import os
import shutil
import threading
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from tensordiff.diff import diff_traces
from tensordiff.errors import IncompatibleTracesError
from tensordiff.findings import DiffResult, Finding
from tensordiff.numerics import Metrics
from tensordiff.summary import SummaryWriter
from tensordiff.trace import SlotSpec, TraceWriter
from tensordiff.tui.app import EXIT_INTERRUPTED, TensordiffApp
from tensordiff.tui.data import METRICS
from tensordiff.tui.text import histograms, sparkline
from tensordiff.tui.widgets import (
    CELL_W,
    GUTTER_W,
    HEADER_H,
    GotoScreen,
    Heatmap,
    HelpScreen,
)
from tensordiff.vocab import boundary_label

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = (ROOT / "traces" / "train.h5", ROOT / "traces" / "serve.h5")
SIZE = (140, 40)

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"

# ----------------------------------------------------------------------------------------------
# fixture pair
# ----------------------------------------------------------------------------------------------


def _states(n_tok: int, hidden: int, layers: int, seed: int):
    rng = np.random.default_rng(seed)
    xs = [rng.standard_normal((n_tok, hidden)).astype(np.float32) * 0.3]
    for _ in range(layers):
        xs.append(xs[-1] + rng.standard_normal((n_tok, hidden)).astype(np.float32))
    fn = xs[-1] / np.sqrt((xs[-1] ** 2).mean(1, keepdims=True))
    return xs, fn


def write_side(path: Path, side: str, slots: list[int], *, hidden: int = 32, layers: int = 8,
               seqs: tuple[int, ...] = (48, 32), seed: int = 7) -> None:
    n_tok = sum(seqs)
    xs, fn = _states(n_tok, hidden, layers, seed)
    tok_rng = np.random.default_rng(seed + 1)
    with TraceWriter(path, side=side, model={"num_layers": layers, "hidden_size": hidden}) as w:
        rows = []
        for i, n in enumerate(seqs):
            toks = tok_rng.integers(0, 1000, n)
            rows.append(w.add_tokens(f"s{i}", np.arange(n), toks, "train" if side == "train" else "prefill"))
        rows = np.concatenate(rows)
        for b in range(layers + 1):
            w.define_tensor(boundary_label(b), hidden, kind="boundary", boundary=b, role="catalog")
            w.append(boundary_label(b), rows, xs[b])
        w.define_tensor("final_norm", hidden, kind="final_norm", role="catalog")
        w.append("final_norm", rows, fn)
        w.define_tensor("draft_input", hidden * len(slots), kind="packed", role="draft_input", token_offset=1,
                        slots=SlotSpec([boundary_label(b) for b in slots]))
        w.append("draft_input", rows, np.concatenate([xs[b] for b in slots], axis=1))


@pytest.fixture(scope="session")
def fixture_pair(tmp_path_factory) -> tuple[str, str]:
    d = tmp_path_factory.mktemp("tui_pair")
    a, b = d / "train.h5", d / "serve.h5"
    write_side(a, "train", [0, 3, 5])
    write_side(b, "serve", [3, 5, 7])
    return str(a), str(b)


@pytest.fixture(scope="session")
def fixture_diff(fixture_pair, tmp_path_factory):
    """A diff_fn replaying the aligner's result on the fixture pair (computed once per session),
    so that tests of keys and panes do not each re-run the same diff."""
    from tensordiff.diff import DiffOptions

    ref = tmp_path_factory.mktemp("fixture_ref") / "summary.h5"
    result = diff_traces(*fixture_pair, DiffOptions(summary_path=str(ref)))

    def replay(a, b, opts):
        assert (a, b) == fixture_pair
        shutil.copyfile(ref, opts.summary_path)
        opts.progress("comparing tensors", 1, 1)
        return dataclasses.replace(copy.deepcopy(result), summary_path=opts.summary_path)

    return replay


@pytest.fixture
def fixture_app(fixture_pair, fixture_diff):
    def make(**kw) -> TensordiffApp:
        return TensordiffApp(*fixture_pair, diff_fn=fixture_diff, **kw)

    return make


@pytest.fixture(scope="session")
def pair(fixture_pair) -> tuple[str, str]:
    """The example pair in traces/ when it exists, else the fixture pair."""
    if all(p.is_file() for p in EXAMPLE):
        return str(EXAMPLE[0]), str(EXAMPLE[1])
    return fixture_pair


@pytest.fixture(scope="session")
def pair_result(pair, tmp_path_factory) -> DiffResult:
    """The aligner's own verdict on the pair, to check the TUI shows it (never its own)."""
    from tensordiff.diff import DiffOptions

    out = tmp_path_factory.mktemp("ref") / "summary.h5"
    return diff_traces(*pair, DiffOptions(summary_path=str(out)))


async def wait_ready(app: TensordiffApp, pilot, timeout: float = 20.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not app.ready and app.diff_error is None:
        assert loop.time() < end, "the diff did not finish"
        await pilot.pause(0.02)
    while app.ready and app.cell is not None and app.vectors_for != app.cell:
        assert loop.time() < end, "the detail vectors were not read"
        await pilot.pause(0.02)
    await pilot.pause()


def column_of(app: TensordiffApp):
    hm = app.heatmap
    return hm.column


# ----------------------------------------------------------------------------------------------
# opening on the first divergence
# ----------------------------------------------------------------------------------------------


async def test_opens_on_first_divergence(pair, pair_result):
    first = pair_result.first_divergence
    assert first is not None, "the example pair must diverge"
    app = TensordiffApp(*pair)
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(app, pilot)
        assert app.selected_finding == first.index
        assert app.result.first_divergence.message == first.message
        col = column_of(app)
        if first.tensor is not None:
            assert col.matches(first.tensor, first.slot)
        if first.details.token_index is not None:
            assert app.heatmap.cursor_row == first.details.token_index
        detail = app.detail_text.plain
        assert first.message in detail
        assert "cos" in detail and "rel err" in detail and "max abs" in detail
        assert f"token {first.token}" in detail if first.token is not None else True
        headline = str(app.query_one("#headline").render())
        assert app.result.headline() in headline
        summary_path = app.summary_path
        assert summary_path and os.path.exists(summary_path)
        await pilot.press("q")
    assert app.return_value == 1
    assert not os.path.exists(summary_path), "the temporary summary must be deleted on exit"


async def test_detail_is_laid_out_again_when_its_width_changes(fixture_app):
    """The detail's value histograms are laid out for the pane's width: a resized terminal (or a
    scroll bar that comes once the lines are in) lays them out again; they kept the old width, and
    two runs that settled on the same screen held different detail text."""
    app = fixture_app()
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(app, pilot)
        pane = app._w_detail
        assert pane.laid_width == pane.size.width
        before = app.detail_text.plain
        await pilot.resize_terminal(SIZE[0] - 30, SIZE[1])
        for _ in range(50):
            await pilot.pause(0.05)
            if pane.laid_width == pane.size.width and app.detail_text.plain != before:
                break
        assert pane.laid_width == pane.size.width < SIZE[0] - 30
        hist = [line for line in app.detail_text.plain.splitlines() if "values in" in line]
        assert hist and all(len(line) <= max(40, pane.size.width) for line in hist), hist
        assert app.detail_text.plain != before


async def test_fixture_names_the_wrong_slot(fixture_app):
    app = fixture_app()
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(app, pilot)
        first = app.result.first_divergence
        assert first.message == ("slot 0 of draft_input: train feeds embed, serve feeds layer3 (each holds what it claims; "
                                 "the draft was trained on train's)")
        assert column_of(app).label == "draft_input[0]"
        detail = app.detail_text.plain
        assert "train feeds embed, serve feeds layer3" in " ".join(detail.split())
        assert "candidates layer3" in detail          # best identity match first, with its scores
        assert "train: s0 pos 0" in detail and "serve: s0 pos 0" in detail
        assert "|a-b|" in detail                      # the small plot of the two vectors
        va, vb, _ = app.vectors
        assert va is not None and vb is not None and va.shape == vb.shape == (32,)
        assert not np.allclose(va, vb)
        # the tree is coloured by the aligner's findings
        labels = [str(n.label) for n in app.query_one("#tree").root.children]
        assert any("draft_input" in lab and "✗" in lab for lab in labels)
        assert any("embed" in lab and "✓" in lab for lab in labels)


# ----------------------------------------------------------------------------------------------
# keys
# ----------------------------------------------------------------------------------------------


async def test_next_prev_first(pair, pair_result):
    n = len(pair_result.findings)
    first = pair_result.first_divergence.index
    app = TensordiffApp(*pair)
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(app, pilot)
        start = app.selected_finding
        assert start == first
        if first + 1 < n:
            await pilot.press("n")
            assert app.selected_finding == first + 1
            f = pair_result.findings[first + 1]
            assert app.query_one("#findings").highlighted == first + 1
            if f.tensor is not None:
                assert column_of(app).matches(f.tensor, f.slot)
            await pilot.press("p")
            assert app.selected_finding == first
        for _ in range(n + 2):
            await pilot.press("n")
        last = pair_result.divergences[-1].index if pair_result.divergences else n - 1
        assert app.selected_finding == last       # stops at the last divergence, not on a note
        await pilot.press("f")
        assert app.selected_finding == first
        for _ in range(n + 2):
            await pilot.press("p")
        assert app.selected_finding == 0          # divergences are listed first


async def test_next_moves_to_next_slot(fixture_app):
    app = fixture_app()
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(app, pilot)
        msgs = []
        for _ in range(len(app.result.findings) - 1):
            await pilot.press("n")
            f = app.result.findings[app.selected_finding]
            msgs.append(f.message)
            assert column_of(app).matches(f.tensor, f.slot)
        assert any(m.startswith("slot 1 of draft_input: train feeds layer3, serve feeds layer5") for m in msgs)
        assert column_of(app).label == "draft_input[2]"


async def test_goto(fixture_app):
    app = fixture_app()
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(app, pilot)
        hm = app.heatmap
        await pilot.press("g")
        assert isinstance(app.screen, GotoScreen)
        await pilot.press(*"s1:5", "enter")
        assert not isinstance(app.screen, GotoScreen)
        tok = app.summary.tokens(hm.cursor_row, hm.cursor_row + 1)[0]
        assert app.summary.seq_a[int(tok["seq_a"])] == "s1" and int(tok["pos_a"]) == 5
        assert hm.cursor_row == 48 + 5
        # a bare position stays in the current sequence; #INDEX is the aligned row
        for spec, row in (("20", 48 + 20), ("#7", 7)):
            await pilot.press("g")
            app.screen.query_one("#goto-input").value = spec
            await pilot.press("enter")
            assert hm.cursor_row == row, spec
        # token id: the next row holding it
        want = int(app.summary.tokens(30, 31)[0]["token"])
        app.goto("#29")
        assert app.goto(f"t={want}")
        assert int(app.summary.tokens(hm.cursor_row, hm.cursor_row + 1)[0]["token"]) == want
        assert hm.cursor_row >= 30
        # bad input is explained, the cursor stays
        before = hm.cursor_row
        for bad in ("nope:3", "s0:x", "#99999", "t=-5"):
            assert not app.goto(bad)
        assert hm.cursor_row == before
        await pilot.press("g", "escape")
        assert not isinstance(app.screen, GotoScreen)
        # the detail pane follows the cursor
        await wait_ready(app, pilot)
        assert f"aligned #{hm.cursor_row}" in app.detail_text.plain


async def test_heatmap_keys_filter_metric(fixture_app):
    app = fixture_app()
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(app, pilot)
        hm = app.heatmap
        assert app.focused is hm
        row, col = hm.cursor_row, hm.cursor_col
        await pilot.press("down", "down", "right")
        assert (hm.cursor_row, hm.cursor_col) == (row + 2, col + 1)
        assert app.cell == (row + 2, hm.column.index)
        await pilot.press("end")
        assert hm.cursor_row == app.summary.n - 1
        await pilot.press("home")
        assert hm.cursor_row == 0
        # metric toggle cycles through the metrics
        for i in range(1, len(METRICS) + 1):
            await pilot.press("m")
            assert app.metric_index == i % len(METRICS)
            assert hm.metric is METRICS[i % len(METRICS)]
        # filter tensors
        await pilot.press("slash")
        assert app.focused is app.query_one("#filter")
        await pilot.press(*"dr", "enter")
        assert [c.label for c in hm.shown] == ["draft_input[0]", "draft_input[1]", "draft_input[2]"]
        assert app.focused is hm
        assert len(app.columns) == 13
        await pilot.press("slash")
        app.query_one("#filter").value = "layer1,fin"
        await pilot.pause()
        assert [c.label for c in hm.shown] == ["layer1", "final_norm"]
        await pilot.press("escape")
        assert app.focused is hm
        await pilot.press("slash")
        app.query_one("#filter").value = ""
        await pilot.press("enter")
        assert len(hm.shown) == 13
        # letters typed into the filter did not fire the app's keys
        assert app.return_value is None and not isinstance(app.screen, HelpScreen)


async def test_mouse_selects_cell(fixture_app):
    app = fixture_app()
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(app, pilot)
        hm = app.heatmap
        sx, sy = hm.scroll_offset
        target_row, target_col = sy + 3, 2
        # +1: the heatmap's border
        x = 1 + GUTTER_W + target_col * CELL_W - sx + 1
        y = 1 + HEADER_H + (target_row - sy)
        assert await pilot.click(Heatmap, offset=(x, y))
        assert (hm.cursor_row, hm.cursor_col) == (target_row, target_col)
        assert app.cell == (target_row, hm.shown[target_col].index)
        await wait_ready(app, pilot)
        assert hm.shown[target_col].label in app.detail_text.plain
        # a click on the gutter picks the row, keeps the column
        assert await pilot.click(Heatmap, offset=(3, 1 + HEADER_H + 1))
        assert hm.cursor_row == sy + 1 and hm.cursor_col == target_col


async def test_tree_and_findings_navigation(fixture_app):
    app = fixture_app()
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(app, pilot)
        tree = app.query_one("#tree")
        tree.focus()
        await pilot.press("home", "enter")         # the first node: embed
        assert column_of(app).label == "embed"
        fl = app.query_one("#findings")
        fl.focus()
        await pilot.press("down")
        assert app.selected_finding == fl.highlighted


async def test_help_screenshot_quit(fixture_app, tmp_path):
    app = fixture_app(screenshot_dir=str(tmp_path))
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(app, pilot)
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        await pilot.press("escape")
        assert not isinstance(app.screen, HelpScreen)
        await pilot.press("s")
        shots = list(tmp_path.glob("*.svg"))
        assert len(shots) == 1 and app.last_screenshot == str(shots[0])
        assert "draft_input" in shots[0].read_text()
        await pilot.press("q")
    assert app.return_value == 1


# ----------------------------------------------------------------------------------------------
# a terminal of ordinary size: 80 x 24
# ----------------------------------------------------------------------------------------------


async def test_small_terminal_panes(fixture_app):
    app = fixture_app()
    async with app.run_test(size=(80, 24)) as pilot:
        await wait_ready(app, pilot)
        hm, left = app.heatmap, app.query_one("#left")
        assert left.outer_size.width == 28                    # narrower than at 120 columns (44)
        cells = (hm.scrollable_content_region.width - GUTTER_W) // CELL_W
        assert cells >= 5
        # [ hides the findings and the tree: every column of the fixture fits
        await pilot.press("left_square_bracket")
        assert not left.display or left.outer_size.width == 0
        await pilot.pause()
        assert (hm.scrollable_content_region.width - GUTTER_W) // CELL_W >= len(app.columns)
        await pilot.press("left_square_bracket")
        await pilot.pause()
        assert left.outer_size.width == 28
        # < and > resize it
        await pilot.press("less_than_sign")
        await pilot.pause()
        assert left.outer_size.width == 24
        await pilot.press("greater_than_sign", "greater_than_sign")
        await pilot.pause()
        assert left.outer_size.width == 32
        # the findings pane hidden while it has the focus: the heatmap gets it
        app.query_one("#findings").focus()
        await pilot.press("left_square_bracket")
        assert app.focused is hm


async def test_small_terminal_detail_wraps_and_scrolls(fixture_app):
    app = fixture_app()
    async with app.run_test(size=(80, 24)) as pilot:
        await wait_ready(app, pilot)
        box = app.query_one("#detail")
        first = app.result.first_divergence
        # nothing cut: the whole sentence is on screen, wrapped by words, with no ellipsis
        r = box.region
        lines = [s.text[r.x + 1:r.right - 2] for s in app.screen._compositor.render_strips()[r.y + 1:r.bottom - 1]]
        assert "…" not in "".join(lines)
        assert " ".join(" ".join(lines).split()).find(first.message) >= 0, lines
        assert box.max_scroll_y > 0, "the detail pane is taller than its box at 24 rows: it must scroll"
        box.focus()
        await pilot.press("down", "down")
        assert box.scroll_y == 2
        await pilot.press("end")
        assert box.scroll_y == box.max_scroll_y
        # the sentence of the first divergence is complete in the pane's text
        assert first.message in app.detail_text.plain


async def test_resize_keeps_cursor_in_view(fixture_app):
    app = fixture_app()
    async with app.run_test(size=(120, 36)) as pilot:
        await wait_ready(app, pilot)
        hm = app.heatmap
        app.goto("#30")
        await pilot.pause()
        assert hm.scroll_offset.y <= 30 < hm.scroll_offset.y + hm.page_rows
        await pilot.resize_terminal(80, 24)
        await pilot.pause()
        await pilot.pause()
        assert hm.page_rows < 20
        assert hm.scroll_offset.y <= 30 < hm.scroll_offset.y + hm.page_rows, (hm.scroll_offset, hm.page_rows)
        await pilot.press("end")
        await pilot.resize_terminal(140, 40)
        await pilot.pause()
        assert hm.scroll_offset.y <= hm.cursor_row < hm.scroll_offset.y + hm.page_rows


async def test_token_text_and_sketch_marks(fixture_pair, fixture_diff, tmp_path):
    from tensordiff.token_text import TokenText

    app = TensordiffApp(*fixture_pair, diff_fn=fixture_diff, token_text=TokenText(lambda i: f" tok{i}", "test"))
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(app, pilot)
        tok = int(app.summary.tokens(app.heatmap.cursor_row, app.heatmap.cursor_row + 1)[0]["token"])
        assert f"token {tok} ' tok{tok}'" in app.detail_text.plain
        assert "≈" not in app.detail_text.plain               # full values: no sketch mark
        # a pair compared on sketches is marked as such
        for p in app.result.pairs:
            p.basis = "sketch"
        app._render_detail()
        assert "≈" in app.detail_text.plain and "on sketches" in app.detail_text.plain


def test_recorded_model_directory_gives_token_text(tmp_path):
    from tokenizers import Tokenizer, models

    d = tmp_path / "model"
    d.mkdir()
    Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1}, unk_token="[UNK]")).save(str(d / "tokenizer.json"))
    a = tmp_path / "a.h5"
    with TraceWriter(a, side="train", model={"hidden_size": 4, "path": str(d)}) as w:
        w.define_tensor("embed", 4, kind="boundary", boundary=0)
        w.append("embed", w.add_tokens("s", np.arange(2), [1, 0], "train"), np.ones((2, 4), np.float32))
    from tensordiff.tui.data import VectorSource

    src = VectorSource(str(a), str(a))
    tt = src.recorded_token_text()
    assert tt is not None and tt(1) == "'hello'"
    src.close()


async def test_screenshot_from_help(fixture_app, tmp_path):
    app = fixture_app(screenshot_dir=str(tmp_path))
    async with app.run_test(size=(80, 24)) as pilot:
        await wait_ready(app, pilot)
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        await pilot.press("s")
        assert isinstance(app.screen, HelpScreen)            # the help stays open
        shots = list(tmp_path.glob("*.svg"))
        assert len(shots) == 1 and "tensordiff keys" in shots[0].read_text().replace("&#160;", " ")


# ----------------------------------------------------------------------------------------------
# the worker: keys while the diff runs, errors
# ----------------------------------------------------------------------------------------------


async def test_keys_during_scan_are_queued(fixture_pair, fixture_diff):
    gate = threading.Event()

    def slow_diff(a, b, opts):
        opts.progress("comparing tensors", 10, 100)
        assert gate.wait(20)
        return fixture_diff(a, b, opts)

    app = TensordiffApp(*fixture_pair, diff_fn=slow_diff)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause(0.2)
        assert not app.ready and app.first_paint_at is not None
        # progress reaches the app as DiffProgress messages posted by the diff thread
        assert app.progress == ("comparing tensors", 10, 100)
        assert "comparing tensors: 10/100" in str(app.query_one("#progress-label").render())
        await pilot.press("n", "m")
        assert [w for w, _ in app.pending] == ["next finding", "toggle metric"]
        assert "2 keys queued" in str(app.query_one("#progress-label").render())
        # the UI still answers: help opens and closes while the diff runs
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        await pilot.press("escape")
        gate.set()
        await wait_ready(app, pilot)
        first = app.result.first_divergence.index
        assert app.pending == []
        assert app.selected_finding == first + 1     # opened on the first divergence, then "n"
        assert app.metric_index == 1


async def test_quit_during_scan(fixture_pair):
    gate = threading.Event()

    def slow_diff(a, b, opts):
        while not gate.wait(0.01):
            opts.progress("comparing tensors", 1, 100)   # raises once the app has quit
        return diff_traces(a, b, opts)

    app = TensordiffApp(*fixture_pair, diff_fn=slow_diff)
    try:
        async with app.run_test(size=SIZE) as pilot:
            await pilot.pause(0.1)
            await pilot.press("q")
    finally:
        gate.set()
    assert app.return_value == EXIT_INTERRUPTED
    assert app.summary_path is None or not os.path.exists(app.summary_path)


async def test_diff_error_exits_2(fixture_pair):
    def bad(a, b, opts):
        raise IncompatibleTracesError("no common tokens: nothing matches")

    app = TensordiffApp(*fixture_pair, diff_fn=bad)
    async with app.run_test(size=SIZE) as pilot:
        for _ in range(100):
            if app.diff_error is not None:
                break
            await pilot.pause(0.02)
    assert isinstance(app.diff_error, IncompatibleTracesError)
    assert app.return_value == 2


@pytest.mark.parametrize("debug", [False, True])
def test_a_bug_in_the_diff_is_unexpected_not_bad_input(monkeypatch, capsys, tmp_path, fixture_pair, debug):
    """An error of tensordiff's own (not a TensordiffError) under the TUI takes the CLI's
    "unexpected" path with its traceback hint (TENSORDIFF_DEBUG=1: the original traceback), never
    the one line of bad input; bad input under the TUI stays one line."""
    from tensordiff import cli
    from tensordiff.tui import app as tui

    def buggy(a, b, opts):
        raise RuntimeError("boom in the diff")

    monkeypatch.setattr(tui, "diff_traces", buggy)
    monkeypatch.delenv("TENSORDIFF_DEBUG", raising=False)
    out = str(tmp_path / "s.svg")
    if debug:
        monkeypatch.setenv("TENSORDIFF_DEBUG", "1")
        with pytest.raises(RuntimeError, match="boom in the diff"):
            cli.main(["tui", *fixture_pair, "--screenshot", out])
        return
    assert cli.main(["tui", *fixture_pair, "--screenshot", out]) == cli.EXIT_INTERNAL == 3
    err = capsys.readouterr().err
    assert "unexpected RuntimeError: boom in the diff" in err and "TENSORDIFF_DEBUG=1" in err, err

    def bad(a, b, opts):
        raise IncompatibleTracesError("no common tokens: nothing matches")

    monkeypatch.setattr(tui, "diff_traces", bad)
    assert cli.main(["tui", *fixture_pair, "--screenshot", out]) == 2
    err = capsys.readouterr().err
    assert "no common tokens: nothing matches" in err and "unexpected" not in err and len(err.strip().splitlines()) == 1, err


def test_cli_routes_to_tui(monkeypatch, fixture_pair):
    from tensordiff import cli
    from tensordiff.tui import app as tui

    seen = []
    monkeypatch.setattr(tui, "run_tui", lambda a, b, opts, token_text=None: seen.append((a, b, opts)) or 1)
    monkeypatch.setattr(cli, "_check_terminal", lambda: None)   # pytest's stdin is not a terminal
    assert cli.main(["tui", *fixture_pair]) == 1
    assert cli.main(["diff", *fixture_pair, "--tui"]) == 1
    assert [s[:2] for s in seen] == [fixture_pair, fixture_pair]
    assert all(s[2].summary_path is None for s in seen)   # the app makes (and deletes) its own


async def test_no_color(monkeypatch, fixture_app):
    monkeypatch.setenv("NO_COLOR", "1")
    app = fixture_app()
    assert app.no_color
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(app, pilot)
        await pilot.press("m", "m", "m")                # verdict metric: glyphs, not colours, tell
        assert app.heatmap.metric.key == "verdict"
        text = "\n".join(s.text for s in app.screen._compositor.render_strips())
        assert "███" in text and "···" in text


# ----------------------------------------------------------------------------------------------
# a 100k-token summary: lazy, bounded
# ----------------------------------------------------------------------------------------------


def _fake_diff(n: int, k_plain: int = 9):
    """A diff_fn writing a synthetic n-token summary (no trace reading): for the heatmap only."""

    def diff(a, b, opts):
        al = SimpleNamespace(code_a=np.arange(n, dtype=np.int64), code_b=np.arange(n, dtype=np.int64),
                             token=np.arange(n, dtype=np.int64) % 1000, regime_a=np.zeros(n, np.uint8),
                             regime_b=np.ones(n, np.uint8))
        al.__len__ = lambda: n
        r = SimpleNamespace(sequences=["s0"], path=a, side="train")
        rb = SimpleNamespace(sequences=["s0"], path=b, side="serve")

        class AL(SimpleNamespace):
            def __len__(self):
                return n

        w = SummaryWriter(opts.summary_path, AL(**al.__dict__), r, rb)
        infos = [SimpleNamespace(name=f"layer{i}", label=f"layer{i}", kind="boundary", order=float(i), slot_labels=None)
                 for i in range(k_plain)]
        packed = SimpleNamespace(name="draft_input", label="draft_input", kind="packed", order=k_plain + 0.5,
                                 slot_labels=["embed", "layer3", "layer5"])
        rng = np.random.default_rng(0)
        for s0 in range(0, n, 16384):
            blk = np.arange(s0, min(n, s0 + 16384))
            for info, k in [(i, 1) for i in infos] + [(packed, 3)]:
                rel = rng.random((len(blk), k)).astype(np.float32) * (1e-4 if k == 1 else 2.0)
                none = np.zeros((len(blk), k), np.int64)
                m = Metrics(cos=1 - rel, rel=rel, maxabs=rel * 3, nonfinite_a=none, nonfinite_b=none,
                            nonfinite=none > 0)
                w.write(info, info, k, blk, m, rel > 1.0)
        w.close()
        return DiffResult(path_a=a, path_b=b, side_a="train", side_b="serve",
                          findings=[Finding("numeric", "divergence", "slot 0 of draft_input diverges", tensor="draft_input",
                                            slot=0, order=k_plain + 0.5, details={"token_index": 77_777}, index=0)],
                          slot_table=[], pairs=[], sequences=[], gaps=[], shifts={}, tokens_aligned=n, worst_tokens=[],
                          summary_path=opts.summary_path)

    return diff


async def test_large_summary_scrolls_lazily(tmp_path):
    n = 120_000
    app = TensordiffApp(str(tmp_path / "a.h5"), str(tmp_path / "b.h5"), diff_fn=_fake_diff(n),
                        block_rows=256, max_blocks=8)
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(app, pilot)
        hm = app.heatmap
        assert hm.n_rows == n
        assert hm.cursor_row == 77_777 and hm.column.label == "draft_input[0]"
        _, sy = hm.scroll_offset
        assert sy <= 77_777 < sy + hm.page_rows
        await pilot.press("end")
        assert hm.cursor_row == n - 1
        await pilot.press("pageup", "pageup", "up")
        assert hm.cursor_row == n - 2 - 2 * hm.page_rows
        await pilot.press("g", *"#1000", "enter")
        assert hm.cursor_row == 1000
        app.goto("#60000")
        await pilot.press("home")
        await pilot.pause()
        assert hm.cursor_row == 0
        # bounded cache: at most max_blocks blocks of codes and of tokens, whatever n is
        assert len(hm.blocks._codes) <= 8 and len(hm.blocks._tokens) <= 8
        assert hm.blocks.reads < 200
        # missing traces: the detail pane says so, the UI stays up
        await wait_ready(app, pilot)
        assert "cannot read the values" in app.detail_text.plain


# ----------------------------------------------------------------------------------------------
# the data layer, without an app
# ----------------------------------------------------------------------------------------------


def test_data_layer_imports_no_textual():
    import subprocess
    import sys

    code = ("import sys, tensordiff.tui.data, tensordiff.tui.text\n"
            "print(','.join(sorted(m for m in sys.modules if m.split('.')[0] == 'textual')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "", f"the TUI's data layer pulled in {out}"


def test_progress_messages_are_throttled(fixture_pair):
    from tensordiff.diff import DiffOptions
    from tensordiff.tui.diff_thread import DiffEnded, DiffProgress, DiffThread

    posted = []

    def chatty(a, b, opts):
        for i in range(2000):
            opts.progress("comparing tensors", i, 2000)
        opts.progress("comparing tensors", 2000, 2000)
        opts.progress("identifying slots", 0, 3)
        raise IncompatibleTracesError("stop here")

    t = DiffThread(*fixture_pair, DiffOptions(), chatty, posted.append)
    t.run()
    prog = [(m.stage, m.done, m.total) for m in posted if isinstance(m, DiffProgress)]
    assert prog[0] == ("comparing tensors", 0, 2000)
    assert ("comparing tensors", 2000, 2000) in prog and prog[-1] == ("identifying slots", 0, 3)
    assert len(prog) < 100, "one message per progress call would flood the UI"
    assert isinstance(posted[-1], DiffEnded) and str(posted[-1].error) == "stop here"


def test_goto_and_filter_without_app(fixture_diff, fixture_pair, tmp_path):
    from tensordiff.diff import DiffOptions
    from tensordiff.summary import SummaryReader, read_columns
    from tensordiff.tui.data import filter_columns, resolve_goto

    opts = DiffOptions(summary_path=str(tmp_path / "s.h5"), progress=lambda *a: None)
    fixture_diff(*fixture_pair, opts)
    s = SummaryReader(opts.summary_path)
    try:
        assert resolve_goto(s, "s1:5", 0, 0) == (48 + 5, None)
        assert resolve_goto(s, "7", 0, 1) == (48 + 7, None)
        assert resolve_goto(s, "#3", 0, 0) == (3, None)
        row, why = resolve_goto(s, "#999", 0, 0)
        assert row is None and "no aligned row 999" in why
        row, why = resolve_goto(s, "s0:99", 0, 0)
        assert row is None and "past the aligned tokens" in why
        assert resolve_goto(s, "x:1", 0, 0, "train") == (None, "no sequence 'x' on train")
        assert resolve_goto(s, "s0:?", 0, 0)[1].startswith("cannot read")
        cols = read_columns(s)
        assert [c.label for c in filter_columns(cols, " DRAFT ")] == [f"draft_input[{i}]" for i in range(3)]
        assert filter_columns(cols, "") == cols
        assert [c.label for c in filter_columns(cols, "layer5")] == ["layer5", "draft_input[2]"]   # by claimed label
    finally:
        s.close()


def test_vector_source_reads_the_aligned_row(fixture_pair):
    from tensordiff.trace import TraceReader
    from tensordiff.tui.data import VectorSource

    src = VectorSource(*fixture_pair)
    try:
        r = src.reader(1)
        tok = r.tokens
        i = 48 + 3                                        # s1, position 3
        seq, pos, token = int(tok["seq"][i]), int(tok["position"][i]), int(tok["token"][i])
        v, note = src.read(1, "draft_input", 2, seq, pos, token)
        assert note == ""
        with TraceReader(fixture_pair[1]) as ref:
            # the row by a plain scan of the token table: the last tensor row of that token
            cand = np.flatnonzero((ref.tokens["seq"] == seq) & (ref.tokens["position"] == pos))
            row = int(np.flatnonzero(np.isin(ref.token_rows("draft_input"), cand))[-1])
            assert src.row_of(1, "draft_input", seq, pos, token) == row
            want = ref.read_values_at("draft_input", np.array([row]))[0, 64:96]
        np.testing.assert_array_equal(v, want)
        assert src.read(1, "draft_input", 0, seq, pos, token + 1) == (None, "draft_input has no row for this token")
        assert src.read(1, "nope", 0, seq, pos, token) == (None, "nope not in the trace")
    finally:
        src.close()


# ----------------------------------------------------------------------------------------------
# text plots
# ----------------------------------------------------------------------------------------------


def test_text_plots():
    assert sparkline(np.array([0, 1, 2, 4.0]), 4) == " ▃▅█"
    assert len(sparkline(np.arange(1000.0), 40)) == 40
    assert sparkline(np.array([1.0, np.nan]), 2)[1] == "!"
    ha, hb, lo, hi = histograms(np.zeros(10), np.ones(10), 8)
    assert (lo, hi) == (0.0, 1.0) and ha[0] == "█" and hb[-1] == "█"


# ----------------------------------------------------------------------------------------------
# acceptance beside the heatmap (a pair with draft predictions and verify steps)
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def acceptance_pair(tmp_path_factory) -> tuple[str, str]:
    """The pair of tests/test_acceptance.py: the wiring agrees, the draft disagrees with the target;
    serve holds 4 verify steps (position 0: 2 of 4 accepted, position 1: 1 of 2)."""
    from test_acceptance import STEPS, _write

    d = tmp_path_factory.mktemp("tui_acceptance")
    return _write(d / "train.h5", side="train"), _write(d / "serve.h5", side="serve", steps=STEPS)


def _pane_screen_lines(app, pane) -> list[str]:
    r = pane.region
    return [s.text[r.x:r.right] for s in app.screen._compositor.render_strips()[r.y:r.bottom]]


async def test_acceptance_pane_per_draft_position_and_regime(acceptance_pair):
    from tensordiff.findings import Kind

    app = TensordiffApp(*acceptance_pair, find_tokenizer=False)
    async with app.run_test(size=(120, 36)) as pilot:
        await wait_ready(app, pilot)
        f = next(x for x in app.result.findings if x.kind == Kind.ACCEPTANCE)
        d = f.details
        assert [(p["accepted"], p["reached"]) for p in d.per_position] == [(2, 4), (1, 2)]
        pane, hm = app.query_one("#acceptance"), app.heatmap
        assert pane.display and pane.outer_size.width == 30          # wide screen: open beside the heatmap
        assert hm.region.right <= pane.region.x                         # beside it, not over it
        shown = "\n".join(_pane_screen_lines(app, pane))
        assert "acceptance" in shown and "length 1.75 / 4 steps" in shown
        assert " 0 █████▌·····  50% 2/4" in shown and " 1 █████▌·····  50% 1/2" in shown
        teach = d.teacher
        for reg, e in teach.items():
            line = next(x for x in shown.splitlines() if x.strip("│ ").startswith(f"{reg} "))
            assert f"{100 * e['top1']:.0f}%" in line, (reg, line)
        assert "draft top-1 = target" in shown and "teacher-forced, serve" in shown
        words = " ".join(x.strip("│ ") for x in shown.splitlines())
        assert "wiring agrees; the draft disagrees" in words, shown           # the finding's verdict, in words
        assert "train vs serve top-1" in shown and "target_topk  100% 24 tok" in shown, shown
        assert d.verdict == "agree" and d.draft_disagrees
        # the finding is selected: the detail pane says it in full, on the cell the cursor is on
        assert app.selected_finding == f.index and app.cell is not None and f.message in app.detail_text.plain
        # a hides it (the heatmap takes the room back) and shows it again
        width = hm.outer_size.width
        await pilot.press("a")
        await pilot.pause()
        assert not pane.display and hm.outer_size.width == width + 30
        await pilot.press("a")
        await pilot.pause()
        assert pane.display and hm.outer_size.width == width


async def test_acceptance_pane_at_80x24(acceptance_pair):
    app = TensordiffApp(*acceptance_pair, find_tokenizer=False)
    async with app.run_test(size=(80, 24)) as pilot:
        await wait_ready(app, pilot)
        pane, left, hm = app.query_one("#acceptance"), app.query_one("#left"), app.heatmap
        assert not pane.display and left.display                       # narrow: a key away, said so
        assert any("press a" in n.message for n in app._notifications)
        cells = (hm.scrollable_content_region.width - GUTTER_W) // CELL_W
        await pilot.press("a")
        await pilot.pause()
        # the pane takes the left pane's room: the heatmap keeps its cells
        assert pane.display and not left.display
        assert (hm.scrollable_content_region.width - GUTTER_W) // CELL_W >= max(5, cells)
        shown = "\n".join(_pane_screen_lines(app, pane))
        assert "length 1.75 / 4 steps" in shown and " 1 █████▌·····  50% 1/2" in shown
        assert "…" not in shown
        await pilot.press("a")
        await pilot.pause()
        assert not pane.display and left.display and left.outer_size.width == 28


async def test_no_acceptance_no_pane(fixture_app):
    app = fixture_app()
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(app, pilot)
        pane = app.query_one("#acceptance")
        assert not pane.display and app.acceptance_lines == []
        await pilot.press("a")
        await pilot.pause()
        assert not pane.display
        assert any("no acceptance recorded" in n.message for n in app._notifications)


# ----------------------------------------------------------------------------------------------
# snapshots (fixture pair, fixed size)
# ----------------------------------------------------------------------------------------------


def _snap_app(fixture_app) -> TensordiffApp:
    return fixture_app()


def test_snapshot_first_divergence(snap_compare, fixture_app):
    async def ready(pilot):
        await wait_ready(pilot.app, pilot)

    assert snap_compare(_snap_app(fixture_app), terminal_size=(120, 36), run_before=ready)


def test_snapshot_verdict_metric_filtered(snap_compare, fixture_app):
    async def ready(pilot):
        await wait_ready(pilot.app, pilot)
        await pilot.press("n", "n", "m", "m", "m", "slash")
        pilot.app.query_one("#filter").value = "draft,layer"
        await pilot.press("enter", "down")
        await wait_ready(pilot.app, pilot)

    assert snap_compare(_snap_app(fixture_app), terminal_size=(120, 36), run_before=ready)


def test_snapshot_small_terminal(snap_compare, fixture_app):
    """80 x 24: the left pane narrower, the detail pane wrapped (and scrollable), all keys in the footer."""
    async def ready(pilot):
        await wait_ready(pilot.app, pilot)

    assert snap_compare(_snap_app(fixture_app), terminal_size=(80, 24), run_before=ready)


def test_snapshot_help(snap_compare, fixture_app):
    async def ready(pilot):
        await wait_ready(pilot.app, pilot)

    assert snap_compare(_snap_app(fixture_app), press=["question_mark"], terminal_size=(120, 36), run_before=ready)


def test_snapshot_acceptance(snap_compare, acceptance_pair):
    """A pair with verify steps at 120 x 36: the acceptance pane beside the heatmap."""
    async def ready(pilot):
        await wait_ready(pilot.app, pilot)

    app = TensordiffApp(*acceptance_pair, find_tokenizer=False)
    assert snap_compare(app, terminal_size=(120, 36), run_before=ready)
