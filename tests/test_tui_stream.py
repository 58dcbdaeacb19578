"""The heatmap while the diff runs: rows arrive as the diff compares them, the rest is pending.

Driven through the real Textual Pilot on the seeded fixture pair of tests/test_tui.py, with the
real diff (small blocks, so each tensor pair streams in several) gated in its progress callback:
the test looks at the screen while the diff thread waits, then lets it finish.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading

import numpy as np
import pytest

from tensordiff.diff import DiffOptions, Stage, diff_traces
from tensordiff.summary import SummaryReader, read_columns
from tensordiff.tui import EXIT_INTERRUPTED, TensordiffApp
from tensordiff.tui_data import METRICS, PENDING, BlockCache, LiveSummary
from tensordiff.tui_widgets import GLYPHS, PENDING_GLYPH, VGLYPHS

from test_tui import SIZE, fixture_pair, wait_ready  # noqa: F401 - the session fixture

pytestmark = pytest.mark.anyio

BLOCK = 16      # rows per block: the fixture's 80 tokens stream in 5 blocks per tensor pair


@pytest.fixture
def anyio_backend():
    return "asyncio"


def gated(after_blocks: int, gate: threading.Event, reached: threading.Event):
    """The real diff, holding its thread after ``after_blocks`` compared blocks until ``gate``."""
    def diff(a, b, opts):
        inner, seen = opts.progress, [0]

        def progress(stage, done, total):
            inner(stage, done, total)       # the app's: commits the block, raises once it quit
            if stage == Stage.COMPARING:
                seen[0] += 1
                if seen[0] == after_blocks:
                    reached.set()
                    assert gate.wait(30), "the test never let the diff go on"
        return diff_traces(a, b, dataclasses.replace(opts, progress=progress))
    return diff


def screen_text(app) -> str:
    return "\n".join(s.text for s in app.screen._compositor.render_strips())


async def settled_screen(pilot, app, timeout: float = 20.0) -> str:
    """The screen once two renders 0.1 s apart agree: on a loaded machine the last layout pass (the
    panes' widths, so the value histogram's bins) can land after the app says it is ready."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    last = screen_text(app)
    while True:
        await pilot.pause(0.1)
        now = screen_text(app)
        if now == last:
            return now
        assert loop.time() < end, "the screen did not settle"
        last = now


async def wait_for(pilot, cond, timeout: float = 20.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not cond():
        assert loop.time() < end, "timed out"
        await pilot.pause(0.02)


def all_codes(hm, metric) -> np.ndarray:
    return np.concatenate([hm.blocks.codes(r, metric)[0] for r in range(0, hm.n_rows, hm.blocks.block_rows)])


async def test_heatmap_shows_rows_before_the_diff_ends(fixture_pair):  # noqa: F811
    gate, reached = threading.Event(), threading.Event()
    app = TensordiffApp(*fixture_pair, DiffOptions(block_rows=BLOCK), diff_fn=gated(3, gate, reached))
    try:
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, reached.is_set)
            await wait_for(pilot, lambda: app.first_rows_at is not None)
            # the heatmap redraws at most every LIVE_REDRAW_S: wait until it has taken every commit
            await wait_for(pilot, lambda: app.live._dirty is None)
            await pilot.pause()
            hm = app.heatmap
            assert app.result is None and not app.ready, "the diff is still held"
            assert hm.live and hm.n_rows == 80
            live = app.live
            committed = live.committed()
            by_index = {c.index: c for c in hm.columns}
            started = [c for c in hm.columns if committed[c.index] > 0]
            # the first pair in the diff's order has 3 blocks in, the rest none
            first = live.columns[0].tensor_a
            assert {c.tensor_a for c in started} == {first}
            assert len(started) == sum(c.tensor_a == first for c in live.columns)
            front = int(committed[started[0].index])
            assert BLOCK * 2 < front <= BLOCK * 3 + 1 and front < hm.n_rows
            codes = all_codes(hm, METRICS[0])
            for ci, c in by_index.items():
                col = codes[:, ci]
                if c in started:
                    assert (col[:front] != PENDING).all() and (col[front:] == PENDING).all()
                    assert (col[:front] > 0).any(), "compared cells show the metric"
                else:
                    assert (col == PENDING).all(), f"{c.label} was not compared yet"
            # on screen: the compared cells have bars, every pending one the pending glyph
            assert PENDING_GLYPH not in GLYPHS[:PENDING] + VGLYPHS[:PENDING]
            text = screen_text(app)
            assert PENDING_GLYPH in text and "diff running: 0 of" in text
            pos = {c.index: hm.column_position(c.index) for c in hm.columns}
            for y in range(3, 3 + 5):
                strip = hm.render_line(y)
                row = y - 2
                cells = strip.text[22:]
                for ci, p in pos.items():
                    glyph = cells[p * 4:p * 4 + 3]
                    if row < front and by_index[ci] in started:
                        assert glyph != PENDING_GLYPH and glyph.strip()
                    else:
                        assert glyph == PENDING_GLYPH, (row, by_index[ci].label, glyph)
            # the cursor moves over the streamed rows; the detail pane says what it knows
            await pilot.press("down")
            assert hm.cursor_row == 1
            col0 = hm.column
            assert ("not compared yet" in app.detail_text.plain) == (col0 not in started)
            # keys needing the verdict still wait for it
            await pilot.press("n")
            assert [w for w, _ in app.pending] == ["next finding"]
            live_codes = codes.copy()
            gate.set()
            await wait_ready(app, pilot)
            assert app.live is None and not hm.live
            # what was streamed is what the finished summary holds
            final = all_codes(hm, METRICS[0])
            fcols = {(c.tensor_a, c.slot): c.index for c in app.columns}
            for c in started:
                j = fcols[(c.tensor_a, c.slot)]
                np.testing.assert_array_equal(live_codes[:front, c.index], final[:front, j])
            assert (final != PENDING).all()
            assert app.selected_finding == app.result.first_divergence.index + 1   # then "n"
    finally:
        gate.set()


async def test_final_state_is_todays(fixture_pair):  # noqa: F811
    """Streamed or not, the app lands on the same screen once the diff ends."""
    def unstreamed(a, b, opts):   # the diff as before: no live sink
        return diff_traces(a, b, dataclasses.replace(opts, sinks=[]))

    screens = []
    for fn in (diff_traces, unstreamed):
        app = TensordiffApp(*fixture_pair, DiffOptions(block_rows=BLOCK), diff_fn=fn)
        async with app.run_test(size=SIZE) as pilot:
            await wait_ready(app, pilot)
            hm = app.heatmap
            screens.append((await settled_screen(pilot, app), app.selected_finding, hm.cursor_row, hm.cursor_col,
                            app.detail_text.plain, [all_codes(hm, m).tolist() for m in METRICS]))
            await pilot.press("q")
    assert screens[0] == screens[1]


async def test_quit_while_streaming(fixture_pair):  # noqa: F811
    gate, reached = threading.Event(), threading.Event()
    app = TensordiffApp(*fixture_pair, DiffOptions(block_rows=BLOCK), diff_fn=gated(2, gate, reached))
    try:
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, lambda: app.first_rows_at is not None)
            await pilot.press("q")
    finally:
        gate.set()
    app.diff_thread.join(20)
    assert not app.diff_thread.is_alive()
    assert app.return_value == EXIT_INTERRUPTED
    assert app.summary_path is None or not __import__("os").path.exists(app.summary_path)


def test_live_summary_commits_only_what_the_file_holds(fixture_pair, tmp_path):  # noqa: F811
    """At every commit, the last row below each column's frontier is in the summary file (it is
    a compared row by construction); planned columns are the file's columns. Guards the order
    the live sink relies on: the diff reports progress after every sink has the block."""
    path = str(tmp_path / "summary.h5")
    lives: list[LiveSummary] = []
    checks = [0]

    def check() -> None:
        live = lives[0]
        front = live.committed()
        for c in np.flatnonzero((front > 0) & (front < live.n)):
            flags = live.block(int(front[c]) - 1, int(front[c]), 3)[0, c]
            assert not np.isnan(flags), f"column {live.columns[c].label} committed before it was written"
            checks[0] += 1
        pend = live.pending(0, live.n)
        assert (pend == (np.arange(live.n)[:, None] >= front[None, :])).all()

    def progress(stage, done, total):
        if stage == Stage.COMPARING and lives:
            lives[0].commit()
            check()

    class Between:
        """A sink after the live one and before the summary file's: the block is not written yet."""

        def write(self, *args) -> None:
            check()

        def close(self) -> None:
            pass

    opts = DiffOptions(block_rows=BLOCK, summary_path=path, progress=progress,
                       sinks=[LiveSummary.factory(path, lives.append), lambda al, ra, rb: Between()])
    diff_traces(*fixture_pair, opts)
    live = lives[0]
    assert checks[0] > 10
    changed = live.changes()
    assert changed is not None and changed[0] >= 0
    assert live.changes() is None, "changes are handed out once"
    assert live.columns_done() >= len(live.columns) - 3    # the last pair's tail waits for the end
    live.close_reader()
    with_file = SummaryReader(path)
    try:
        assert sorted(c.label for c in read_columns(with_file)) == sorted(c.label for c in live.columns)
    finally:
        with_file.close()


def test_block_cache_invalidates_only_changed_blocks(fixture_pair, tmp_path):  # noqa: F811
    ref = str(tmp_path / "s.h5")
    diff_traces(*fixture_pair, DiffOptions(summary_path=ref))
    s = SummaryReader(ref)
    try:
        cache = BlockCache(s, block_rows=16, max_blocks=8)
        for r in range(0, 80, 16):
            cache.codes(r, METRICS[0])
        cache.invalidate(20, 40)
        assert sorted(b for _, b in cache._codes) == [0, 3, 4]
    finally:
        s.close()


async def test_unreadable_live_file_leaves_the_heatmap_to_the_end(fixture_pair, monkeypatch):  # noqa: F811
    """When the summary being written cannot be read, the heatmap says so and fills at the end."""
    def broken(self):
        raise OSError("unable to open (test)")

    monkeypatch.setattr(LiveSummary, "_file", broken)
    gate, reached = threading.Event(), threading.Event()
    app = TensordiffApp(*fixture_pair, DiffOptions(block_rows=BLOCK), diff_fn=gated(2, gate, reached))
    try:
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, reached.is_set)
            await wait_for(pilot, lambda: "cannot read the summary being written" in screen_text(app))
            assert app.live is None and app.first_rows_at is None and not app.heatmap.live
            gate.set()
            await wait_ready(app, pilot)
            assert app.result.first_divergence is not None and app.heatmap.n_rows == 80
    finally:
        gate.set()


def test_live_summary_frontiers_without_a_file():
    """Frontiers from the blocks alone: committed one block late (or at commit), earlier pairs
    done when a later one streams, a block out of order keeps its column pending to the end."""
    from types import SimpleNamespace

    from tensordiff.summary import Column

    def col(i, name, slot=0):
        return Column(index=i, label=name, tensor_a=name, tensor_b=name, slot=slot, order=float(i),
                      slot_label=None, packed=False)

    live = LiveSummary("unused.h5", 100, [col(0, "a"), col(1, "b"), col(2, "c")], [0, 1, 2])
    info = {n: SimpleNamespace(name=n) for n in "abcz"}

    def write(name, lo, hi, step=1):
        live.write(info[name], info[name], 1, np.arange(lo, hi, step), {}, np.zeros((0, 1), bool))

    write("a", 0, 10)
    assert live.started and not live.has_rows, "the summary file has not written the block yet"
    write("a", 12, 30, 2)                  # rows 10, 11 have no row in a: blank, not pending
    assert list(live.committed()) == [10, 0, 0]
    live.commit()
    assert list(live.committed()) == [29, 0, 0] and live.changes() == (0, 29)
    write("z", 0, 5)                       # a tensor not planned: ignored until the diff ends
    write("b", 0, 50)
    live.commit()
    assert list(live.committed()) == [100, 50, 0] and live.columns_done() == 1
    write("b", 40, 60)                     # out of order: b pending to the end
    live.close()
    assert list(live.committed()) == [100, 0, 0]
    assert live.pending(0, 100)[:, 1].all() and not live.pending(0, 100)[:, 0].any()
