"""`tensordiff triage ... --tui`: the triage screen driven headless by Textual's Pilot on a real
triage of the trained tiny model (HF as the engine, tests/rl_support.py): an engine left with
layer 3's down_proj at the weights before the update. The cause sentence, the state rows with the
out-of-noise mark and the per-sequence log-prob sparkline are on screen, and j/k walk the
sequences."""

from __future__ import annotations

import copy
import re

import pytest

torch = pytest.importorskip("torch")

import rl_support as rs
import trained

from tensordiff import cli
from tensordiff.cli import main
from tensordiff.rl.triage import triage
from tensordiff.tui import triage_screen
from tensordiff.tui.triage_screen import TriageApp
from tensordiff.tui.triage_text import OUT_MARK, regime_rows, sequence_lines, sequences, state_rows

pytestmark = [pytest.mark.torch, pytest.mark.anyio]
PROMPTS = 4
NEW = 8
SIZE = (170, 90)


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture(scope="module")
def stale(tmp_path_factory):
    work = tmp_path_factory.mktemp("rltui")
    fp32 = trained.load_target(torch.float32)
    w1 = rs.updated(fp32)
    engine = copy.deepcopy(w1)
    engine.model.layers[3].mlp.down_proj.weight.data.copy_(fp32.model.layers[3].mlp.down_proj.weight.data)
    model_dir = rs.save(w1, work / "w1")
    r = rs.rollout(work / "stale.rollout.h5", engine, prompts=trained.prompts()[:PROMPTS], new_tokens=NEW,
                   weight_steps=[(fp32, "start"), (engine, "update_weights_from_tensor")])
    t = rs.train_from_serve(work / "stale.train.h5", r, model_dir)
    return str(t), str(r)


def _text(app, sel: str) -> str:
    w = app.query_one(sel)
    assert w.region.height > 0, f"{sel} is not on screen"
    return str(w.render())


async def test_headline_curve_rows_and_sequence_walk(stale):
    got = triage(*stale)
    assert got.cause == "weights", got.text()
    app = TriageApp(got)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        assert _text(app, "#headline").startswith("weights: layer3 mlp_out (model.layers.3.mlp.down_proj.weight) "
                                                  "is stale on the engine")
        states = _text(app, "#states").splitlines()
        # one row per state recorded on both sides, the stale layer's output marked out of the noise
        assert len(states) == len(got.noise_states) + 1
        marked = [r.split()[0] for r in states[1:] if OUT_MARK in r]
        assert marked and marked[0] == "layer4", states
        assert not any(OUT_MARK in r for r in states[1:4]), states   # the states before it are clean
        regimes = _text(app, "#regimes")
        # the first state out of the noise by regime, then the sampled tokens' log-probs by regime
        assert regimes.startswith("first state out of the noise: layer4\nprefill ")
        assert re.search(r"^decode +\d+ of \d+ tokens out of the noise", regimes, re.M), regimes
        assert re.search(r"^prefill +\d+ +[0-9.e-]+ +[0-9.e-]+$", regimes, re.M), regimes
        assert re.search(r"^decode +\d+ +[0-9.e-]+ +[0-9.e-]+$", regimes, re.M), regimes
        first = _text(app, "#tokens")
        assert first.startswith(f"sequence 0 (1 of {PROMPTS};") and "|d| " in first
        await pilot.press("j")
        second = _text(app, "#tokens")
        assert second.startswith(f"sequence 1 (2 of {PROMPTS};") and second != first
        await pilot.press("k", "k")
        assert _text(app, "#tokens").startswith(f"sequence {PROMPTS - 1} ({PROMPTS} of {PROMPTS};")
        await pilot.press("q")
    assert app.return_value == 1


async def test_80x24_shows_the_sequence_above_the_fold(stale):
    """At 80 x 24 the per-sequence sparkline is on the first screen, the states' header is one
    line, and the footer holds only triage keys."""
    app = TriageApp(triage(*stale))
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        tokens = app.query_one("#tokens")
        assert tokens.region.y + tokens.region.height <= 23, tokens.region   # above the footer, unscrolled
        header = _text(app, "#states").splitlines()[0]
        assert len(header) <= 78 and header.split()[-2:] == ["q50", "predicted"], header
        import os
        import sys
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
        import make_doc_images
        screen = "\n".join(make_doc_images.svg_text(app.export_screenshot()))
        assert "palette" not in screen and "next sequence" in screen, screen
        await pilot.press("q")


async def test_no_color_keeps_the_marks(stale, monkeypatch):
    """NO_COLOR: Textual drops the colours; the out-of-noise mark is a word and stays."""
    monkeypatch.setenv("NO_COLOR", "1")
    app = TriageApp(triage(*stale))
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        assert app.no_color
        assert OUT_MARK in _text(app, "#states")


def test_cli_tui_runs_the_screen(stale, monkeypatch, capsys):
    """`--tui` hands the triage to the screen (in this process); without a terminal it is one
    line and exit 2, before any trace is read."""
    assert main(["triage", *stale, "--tui"]) == 2
    err = capsys.readouterr().err.strip()
    assert "the TUI needs a terminal" in err and len(err.splitlines()) == 1
    assert main(["triage", *stale, "--tui", "--json"]) == 2
    assert "--tui and --json" in capsys.readouterr().err
    seen = []
    monkeypatch.setattr(cli, "_check_terminal", lambda: None)
    monkeypatch.setattr(triage_screen, "run", lambda t: seen.append(t) or t.exit_code)
    assert main(["triage", *stale, "--tui"]) == 1
    assert seen and seen[0].cause == "weights"
    assert capsys.readouterr().out == ""   # the screen, not the text report


def test_text_rows():
    rows = state_rows([{"label": "embed", "q50": 1e-7, "predicted": 0.0, "clean": True},
                       {"label": "layer1", "q50": 2e-7, "predicted": 1.5e-7, "clean": True},
                       {"label": "layer2", "q50": 1e-3, "predicted": 2e-7, "clean": False}])
    assert [OUT_MARK in r for r in rows] == [False, False, False, True]
    # the out-of-noise bar is longer than the clean ones, the prediction drawn where it falls
    assert rows[3].count("█") > rows[2].count("█") > 0 and "|" in rows[3]
    seqs = sequences({"seq": [1, 0, 0], "position": [5, 4, 3], "diff": [0.1, -0.2, 0.3],
                      "regime": ["decode", "decode", "prefill"]})
    assert [s.seq for s in seqs] == [0, 1] and seqs[0].position == [3, 4] and seqs[0].regime == ["prefill", "decode"]
    head, bars, reg = sequence_lines(seqs, 0, 1e-6, width=8)
    assert head.startswith("sequence 0 (1 of 2;") and "max |d| 0.3 at position 3" in head
    assert len(bars) == len("|d| ") + 8 and reg == "reg PPPPDDDD"   # 4 columns per token
    tw = [{"a": "prefill", "b": "decode", "token_mult_prob_error": 1.2, "agree": False},
          {"a": "trainer", "b": "prefill", "token_mult_prob_error": 1.0, "agree": True}]
    rows = regime_rows({"decode": {"tokens": 7.0, "token_mult_prob_error": 1.2, "mean_abs_logprob_diff": 0.01},
                        "prefill": {"tokens": 1.0, "token_mult_prob_error": 1.0, "mean_abs_logprob_diff": None}}, tw)
    assert rows[1].split()[:2] == ["prefill", "1"] and rows[1].endswith("n/a") and rows[2].startswith("decode")
    assert rows[-2].startswith("prefill vs decode") and rows[-2].endswith("NO") and rows[-1].endswith("yes")
    assert regime_rows({})[-1] == "no sampled-token log-probs on both sides"


async def test_decode_path_three_way_on_screen(tmp_path):
    """A decode-path bug (the engine's decode passes read a bf16 KV cache) with the prefill re-run:
    the regime rows put decode out of the noise and prefill in it, and the three-way table is on
    screen with prefill vs decode disagreeing and trainer vs prefill agreeing."""
    fp32 = trained.load_target(torch.float32)
    r = rs.rollout(tmp_path / "kv.rollout.h5", fp32, prompts=trained.prompts()[:PROMPTS], new_tokens=NEW,
                   kv_dtype=torch.bfloat16)
    t = rs.train_from_serve(tmp_path / "kv.train.h5", r)
    p = rs.replay(tmp_path / "kv.prefill.h5", fp32, r)
    got = triage(str(t), str(r), str(p))
    assert got.cause == "layer", got.text()
    app = TriageApp(got)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        assert _text(app, "#headline").startswith("the engine's decode path: its decode passes disagree")
        regimes = _text(app, "#regimes")
        assert re.search(r"^prefill vs decode +[0-9.e-]+  NO$", regimes, re.M), regimes
        assert re.search(r"^trainer vs prefill +[0-9.e-]+  yes$", regimes, re.M), regimes
        toks = _text(app, "#tokens").splitlines()
        assert toks[2].startswith("reg P") and "D" in toks[2]
