"""The preview of a large pair: real heatmap rows of the first tokens before the diff has opened
and aligned the whole traces, with no verdict until the diff has one.

On traces of the trained tiny Llama (tests/trained.py) recorded by ``tensordiff record train``
in float32 and bfloat16 (a correct pair), and a copy of the bfloat16 one with a layer's values
scaled (a real bug). The preview is forced on these small traces (``preview_from=1``, a head of a
few sequences); the app runs through the real Textual Pilot with the real diff, held before it
starts so that the test can look at the preview, then let go.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import trained

from tensordiff.diff import diff_traces
from tensordiff.diff.preview import preview_summary
from tensordiff.summary import FLAG_BAD, SummaryReader, read_columns
from tensordiff.trace import TraceReader
from tensordiff.tui import diff_thread
from tensordiff.tui.app import TensordiffApp
from tensordiff.tui.data import METRICS, PENDING, UNJUDGED, PreviewSummary
from tensordiff.tui.widgets import UNJUDGED_GLYPH

from test_tui import SIZE
from test_tui_stream import screen_text, wait_for

pytestmark = [pytest.mark.torch]

HEAD = 40    # token rows of each side the preview reads in these tests


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("preview")


@pytest.fixture(scope="module")
def tr(root):
    return trained.traces(root)


@pytest.fixture(scope="module")
def bug(tr, root):
    """bfloat16 trace with layer5's values scaled by 1.5: a divergence from layer5 on."""
    return trained.edit(tr["bfloat16"], root / "scaled.h5", "layer5", lambda v, s, p: v * 1.5)


@pytest.fixture
def anyio_backend():
    return "asyncio"


def _keyed(summary: SummaryReader) -> dict[tuple[int, int, int, int, str], np.ndarray]:
    """{(seq_a key, pos_a, seq_b key, pos_b, column label): [cos, rel, maxabs, flags]} of every cell."""
    tok = summary.tokens(0, summary.n)
    out = {}
    for j, label in enumerate(summary.labels):
        col = summary.columns[j][:]
        for i, t in enumerate(tok):
            key = (summary.seq_a[int(t["seq_a"])], int(t["pos_a"]), summary.seq_b[int(t["seq_b"])], int(t["pos_b"]), label)
            out[key] = col[i]
    return out


def test_head_reader_is_the_prefix_of_the_whole_trace(tr):
    """TraceReader(head=K): the first K token rows, and each tensor's rows up to the first past them,
    with the values the whole trace holds for them."""
    path = tr["bfloat16"]
    with TraceReader(path) as full, TraceReader(path, head=HEAD) as head:
        assert len(head.tokens) == HEAD < len(full.tokens)
        assert np.array_equal(head.tokens, full.tokens[:HEAD])
        assert head.sequences == full.sequences[:len(head.sequences)]
        assert head.complete and head.recovered_note is None   # a head is not a recovered trace
        assert set(head.tensors) == set(full.tensors)
        for name, info in head.tensors.items():
            rows = head.token_rows(name)
            whole = full.token_rows(name)
            assert len(rows) == info.rows and np.array_equal(rows, whole[:len(rows)])
            assert (rows < HEAD).all()
            past = np.flatnonzero(whole >= HEAD)
            assert len(rows) == (int(past[0]) if len(past) else len(whole)), name
            if info.has_values and len(rows):
                idx = np.arange(len(rows))
                assert np.array_equal(head.read_values_at(name, idx), full.read_values_at(name, idx)), name


@pytest.mark.parametrize("which", ["correct", "bug"])
def test_preview_values_are_the_diffs_and_carry_no_verdict(tr, bug, tmp_path, which):
    """Every cell of the preview holds the metrics the whole diff computes for that token pair, bit
    for bit; no cell says it fails (the preview has no tolerance), even on the bug pair, where the
    whole diff flags those cells."""
    b = tr["bfloat16"] if which == "correct" else bug
    n = preview_summary(str(tr["float32"]), str(b), str(tmp_path / "p.h5"), HEAD)
    assert n > 0
    full_path = tmp_path / "s.h5"
    res = diff_traces(str(tr["float32"]), str(b), _opts(full_path))
    pv, full = SummaryReader(str(tmp_path / "p.h5")), SummaryReader(str(full_path))
    try:
        assert pv.n == n <= HEAD
        got, want = _keyed(pv), _keyed(full)
        assert got and set(got) <= set(want)
        flagged = 0
        for key, cell in got.items():
            ref = want[key]
            assert np.array_equal(cell[:3], ref[:3], equal_nan=True), key
            if not np.isnan(cell[3]):
                assert not int(cell[3]) & FLAG_BAD, key
                flagged += bool(int(ref[3]) & FLAG_BAD)
        assert (flagged > 0) == (which == "bug"), flagged
        assert (res.exit_code == 1) == (which == "bug")
    finally:
        pv.close()
        full.close()


def _opts(summary_path):
    from tensordiff.diff import DiffOptions
    return DiffOptions(summary_path=str(summary_path))


def held(gate: threading.Event, entered: threading.Event):
    """The real diff, held before it starts (after the preview) until ``gate``."""
    def diff(a, b, opts):
        entered.set()
        assert gate.wait(60), "the test never let the diff go on"
        return diff_traces(a, b, opts)
    return diff




@pytest.mark.anyio
@pytest.mark.parametrize("which", ["correct", "bug"])
async def test_preview_rows_then_the_verdict(tr, bug, which):
    """The heatmap shows the preview's real rows while the diff is held (no verdict text, no
    verdict colour, the cells' values the diff's own), then the diff's result: the cursor on the
    first divergence of the bug pair; the correct pair never shows a divergence."""
    b = str(tr["bfloat16"] if which == "correct" else bug)
    gate, entered = threading.Event(), threading.Event()
    app = TensordiffApp(str(tr["float32"]), b, diff_fn=held(gate, entered), preview_from=1, find_tokenizer=False)
    seen_headlines: list[str] = []
    try:
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, lambda: app.preview is not None and app.first_rows_at is not None, timeout=60)
            await wait_for(pilot, entered.is_set, timeout=60)   # the diff waited for the preview to be drawn
            await pilot.pause()
            hm = app.heatmap
            assert app.result is None and app.live is None and not app.ready
            assert isinstance(hm.summary, PreviewSummary) and 0 < hm.n_rows <= diff_thread.PREVIEW_TOKENS
            pv = hm.summary
            for metric in METRICS:
                codes = hm.blocks.codes(0, metric)[0][:hm.n_rows]
                present = codes[codes > 0]
                assert len(present) and (present >= UNJUDGED).all(), metric.key   # no verdict colour
                assert not (present == PENDING).any()
            text = screen_text(app)
            assert "preview" in text and "no verdict yet" in text
            assert "divergence" not in text.lower() and "agree" not in text.lower()
            verdict_col = METRICS.index(next(m for m in METRICS if m.key == "verdict"))
            app.metric_index = verdict_col
            hm.metric = METRICS[verdict_col]
            hm.refresh()
            await pilot.pause()
            assert UNJUDGED_GLYPH in screen_text(app)
            # the cells shown are the real values: the first row's against the preview file
            cols = read_columns(pv)
            first = pv.block(0, 1, 1)[0]
            assert np.isfinite(first[[c.index for c in cols]]).any()
            seen_headlines.append(str(app.query_one("#headline").render()))
            gate.set()
            while not app.ready:
                seen_headlines.append(str(app.query_one("#headline").render()))
                await pilot.pause(0.02)
            await pilot.pause()
            assert app.preview is None and not isinstance(hm.summary, PreviewSummary)
            first_div = app.result.first_divergence
            if which == "bug":
                assert first_div is not None and app.result.exit_code == 1
                col = hm.column
                assert col is not None and col.tensor_a == first_div.tensor, (col, first_div.message)
                assert "first divergence" in str(app.query_one("#headline").render())
            else:
                assert first_div is None and app.result.exit_code == 0
            await pilot.press("q")
    finally:
        gate.set()
    # before the verdict the headline never named one
    assert all("divergence" not in h and "agree" not in h for h in seen_headlines), seen_headlines


@pytest.mark.anyio
async def test_small_pair_has_no_preview(tr):
    """Below PREVIEW_FROM token rows the diff's own first rows come about as soon: no preview."""
    app = TensordiffApp(str(tr["float32"]), str(tr["bfloat16"]), find_tokenizer=False)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.ready, timeout=60)
        assert app._diff.preview_at is None and app.first_live_rows_at is not None
        await pilot.press("q")


@pytest.mark.anyio
async def test_quit_on_the_preview(tr):
    """q while the preview is shown (the diff held): exit 130, the diff thread ends, and the
    preview's file and the summary are removed."""
    import os

    from tensordiff.diff import Stage
    from tensordiff.tui.app import EXIT_INTERRUPTED

    gate = threading.Event()

    def held_reporting(a, b, opts):   # reports progress while held: where a quit stops it
        while not gate.wait(0.01):
            opts.progress(Stage.ALIGNING, 0, 1)
        return diff_traces(a, b, opts)

    app = TensordiffApp(str(tr["float32"]), str(tr["bfloat16"]), diff_fn=held_reporting, preview_from=1,
                        find_tokenizer=False)
    try:
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, lambda: app.preview is not None and app.first_rows_at is not None, timeout=60)
            preview_dir = app._diff.preview_dir
            assert preview_dir and os.listdir(preview_dir)
            await pilot.press("q")
    finally:
        gate.set()
    app.diff_thread.join(20)
    assert not app.diff_thread.is_alive()
    assert app.return_value == EXIT_INTERRUPTED
    assert not os.path.exists(preview_dir)
    assert app.summary_path is None or not os.path.exists(app.summary_path)


def _children_of_this_process() -> set[int]:
    import psutil

    return {p.pid for p in psutil.Process().children() if p.status() != psutil.STATUS_ZOMBIE}


@pytest.mark.anyio
@pytest.mark.parametrize("maker", ["child", "thread"])
async def test_the_preview_is_the_same_from_the_forked_child_and_from_the_thread(tr, bug, maker, monkeypatch):
    """The app forks the preview's child when it is created (the preview is read while Textual
    starts); where there is no fork, the diff thread makes it. Either way the heatmap shows the
    same rows, and the child is gone once it answered."""
    from tensordiff.tui import preview_process

    if maker == "thread":
        monkeypatch.setattr(preview_process.PreviewProcess, "start", classmethod(lambda cls, *a: None))
    gate, entered = threading.Event(), threading.Event()
    app = TensordiffApp(str(tr["float32"]), str(bug), diff_fn=held(gate, entered), preview_from=1, find_tokenizer=False)
    assert (app._preview_process is not None) == (maker == "child")
    try:
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, lambda: app.preview is not None and app.first_rows_at is not None, timeout=60)
            if maker == "child":
                assert app._diff.preview_dir == app._preview_process.dir
                assert app._preview_process.pid not in _children_of_this_process()   # reaped
            pv = app.heatmap.summary
            got = {c.label: pv.block(0, pv.n, 1)[:, c.index] for c in read_columns(pv)}
            ref = app._diff.preview_dir + "/ref.h5"
            assert preview_summary(str(tr["float32"]), str(bug), ref, diff_thread.PREVIEW_TOKENS) == pv.n
            want_pv = PreviewSummary(ref)
            try:
                want = {c.label: want_pv.block(0, want_pv.n, 1)[:, c.index] for c in read_columns(want_pv)}
            finally:
                want_pv.close()
            assert got.keys() == want.keys()
            for k in got:
                np.testing.assert_array_equal(got[k], want[k], err_msg=k)
            gate.set()
            await wait_for(pilot, lambda: app.ready, timeout=60)
            assert app.result.first_divergence is not None
            await pilot.press("q")
    finally:
        gate.set()


@pytest.mark.anyio
async def test_a_preview_child_that_never_answers_is_killed_and_the_diff_goes_on(tr, monkeypatch):
    """A child stuck in its preview: the diff thread waits PREVIEW_CHILD_WAIT_S at most, kills and
    reaps it, and runs the diff without a preview; its directory is removed at the end."""
    import os
    import time

    from tensordiff.tui import preview_process

    monkeypatch.setattr(preview_process, "preview_summary", lambda *a, **k: time.sleep(600))
    monkeypatch.setattr(diff_thread, "PREVIEW_CHILD_WAIT_S", 0.5)
    app = TensordiffApp(str(tr["float32"]), str(tr["bfloat16"]), preview_from=1, find_tokenizer=False)
    child = app._preview_process
    assert child is not None and child.pid in _children_of_this_process()
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.ready, timeout=60)
        assert app._diff.preview_at is None and app.preview is None and app.first_live_rows_at is not None
        assert child.pid not in _children_of_this_process()
        assert app.result.exit_code == 0
        await pilot.press("q")
    assert not os.path.exists(child.dir)


@pytest.mark.anyio
@pytest.mark.parametrize("how", ["fails", "dies"])
async def test_a_preview_child_that_fails_or_dies_is_no_preview(tr, how, monkeypatch):
    """A child whose preview raises, or that is killed, reports no preview at once (the diff does
    not wait out PREVIEW_CHILD_WAIT_S), and the diff's own rows come."""
    import os
    import signal
    import time

    from tensordiff.tui import preview_process

    def broken(*a, **k):
        if how == "dies":
            os.kill(os.getpid(), signal.SIGKILL)
        raise OSError("cannot read")

    monkeypatch.setattr(preview_process, "preview_summary", broken)
    monkeypatch.setattr(diff_thread, "PREVIEW_CHILD_WAIT_S", 30.0)
    app = TensordiffApp(str(tr["float32"]), str(tr["bfloat16"]), preview_from=1, find_tokenizer=False)
    t0 = time.perf_counter()
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.ready, timeout=60)
        assert app._diff.preview_at is None and app.first_live_rows_at is not None
        assert app.first_live_rows_at - t0 < 20
        await pilot.press("q")
    assert app._preview_process.pid not in _children_of_this_process()


def test_a_preview_child_dies_with_its_parent(tmp_path):
    """A parent killed by SIGKILL cannot kill its preview child: the child is killed with it
    (Linux: PR_SET_PDEATHSIG) instead of going on with a preview nobody will read."""
    import subprocess
    import sys
    import time

    import psutil

    a, b = tmp_path / "a", tmp_path / "b"
    a.write_bytes(b"x")
    b.write_bytes(b"x")
    script = (
        "import os, signal, sys, time\n"
        "import tensordiff.tui.preview_process as pp\n"
        "pp.preview_summary = lambda *a, **k: time.sleep(600)\n"
        f"p = pp.PreviewProcess.start({str(a)!r}, {str(b)!r}, 0)\n"
        "print(p.pid, flush=True)\n"
        "time.sleep(0.5)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr
    child = int(proc.stdout.split()[0])
    end = time.monotonic() + 10
    while psutil.pid_exists(child) and psutil.Process(child).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < end, "the preview child outlived its parent"
        time.sleep(0.05)
