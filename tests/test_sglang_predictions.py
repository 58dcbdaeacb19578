"""The SGLang plugin's prediction tables without an engine: top-k rows are computed only for the
rows the recorder keeps (``need``), from the logits SGLang computed where it computed them for every
row and from the final hidden states and the lm_head weight otherwise, and come to the host as one
float64 table per pass with NaN in the rows not computed, which :func:`record_topk` never writes.

The logits processor, its output and the recorder are stand-ins (SimpleNamespace); the top-k
itself is the recorder core's ``topk_rows``, checked against ``torch.topk`` / ``logsumexp``.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tensordiff.recorders.sampling import Sampling  # noqa: E402
from tensordiff.recorders.sglang import predictions as pr  # noqa: E402
from tensordiff.recorders.sglang.config import Config  # noqa: E402
from tensordiff.recorders.sglang.state import STATE  # noqa: E402

K = 5


@pytest.fixture
def state(monkeypatch, tmp_path):
    """STATE with top-5 predictions and a stand-in recorder keeping even positions (``every``
    set per test) whose ``plain`` calls are collected."""
    calls = []
    positions = np.arange(100, dtype=np.int64) + 7

    def plain(name, values, rows, **kw):
        calls.append((name, np.asarray(values), np.asarray(rows), kw))
        return int((np.asarray(rows) >= 0).sum())

    rec = SimpleNamespace(sample=Sampling(), positions_of=lambda r: positions[np.asarray(r)], plain=plain)
    monkeypatch.setattr(STATE, "cfg", Config(path=str(tmp_path / "s.h5"), topk=K))
    monkeypatch.setattr(STATE, "rec", rec)
    monkeypatch.setattr(STATE, "warned", set())
    monkeypatch.setattr(STATE, "model", {"num_layers": 4})
    return SimpleNamespace(rec=rec, calls=calls, positions=positions)


def _expected(logits):
    top = torch.topk(logits.double(), K, dim=-1)
    lse = torch.logsumexp(logits.double(), dim=-1)
    return top.indices.numpy(), (top.values - lse[:, None]).numpy(), lse.numpy()


def _check(table, logits, rows):
    ids, lp, lse = _expected(logits[rows])
    np.testing.assert_array_equal(table[rows, :K], ids)
    np.testing.assert_allclose(table[rows, K:2 * K], lp, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(table[rows, 2 * K], lse, rtol=1e-5)


def test_sglang_logits_for_every_row_are_used_for_the_needed_rows_only(state):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 40, generator=g)
    out = SimpleNamespace(next_token_logits=logits)
    need = np.array([1, 4])
    table, used = pr.prediction_rows((None, None, None, out), 6, "target_topk", need=need)
    assert used is logits and isinstance(table, np.ndarray) and table.dtype == np.float64
    assert table.shape == (6, 2 * K + 1)
    _check(table, logits, need)
    others = np.setdiff1d(np.arange(6), need)
    assert np.isnan(table[others]).all()
    full, _ = pr.prediction_rows((None, None, None, out), 6, "target_topk")
    _check(full, logits, np.arange(6))
    assert pr.prediction_rows((None, None, None, out), 6, "target_topk", need=np.array([], dtype=np.int64)) == (
        None, None)


def test_rows_sglang_computed_no_logits_for_come_from_the_lm_head(state, monkeypatch):
    """A prefill: SGLang kept the last row only; the plugin multiplies the needed rows' hidden
    states by the lm_head weight (padded vocabulary trimmed, in chunks), never the others."""
    monkeypatch.setattr(pr, "CHUNK_ROWS", 2)
    g = torch.Generator().manual_seed(1)
    hs = torch.randn(7, 16, generator=g)
    w = torch.randn(48, 16, generator=g)  # 40 real tokens + 8 padding rows
    module = SimpleNamespace(config=SimpleNamespace(vocab_size=40), logit_scale=None, final_logit_softcapping=None)
    head = SimpleNamespace(weight=w)
    out = SimpleNamespace(next_token_logits=(hs @ w.T)[-1:, :40])
    logits = (hs @ w.T)[:, :40]
    need = np.array([0, 2, 3, 6])
    table, used = pr.prediction_rows((module, hs, head, out), 7, "target_topk", need=need)
    assert used is None
    _check(table, logits, need)
    assert np.isnan(table[[1, 4, 5]]).all()
    assert (table[need, :K] < 40).all()


def test_kept_rows_are_trace_rows_the_sampling_keeps(state):
    rows = np.array([0, 1, -1, 3, 4, 5])
    np.testing.assert_array_equal(pr.kept_rows(rows), [0, 1, 3, 4, 5])
    state.rec.sample = Sampling(every=2)
    # positions are row + 7: odd rows sit at even positions
    np.testing.assert_array_equal(pr.kept_rows(rows), [1, 3, 5])


def test_record_topk_never_writes_a_row_that_was_not_computed(state):
    table = np.arange(4 * (2 * K + 1), dtype=np.float64).reshape(4, -1)
    table[[1, 2]] = np.nan
    pr.record_topk("target_topk", table, np.array([10, 11, 12, -1]), 0, "test")
    (name, values, rows, kw), = state.calls
    assert name == "target_topk" and kw["token_offset"] == 0
    np.testing.assert_array_equal(rows, [10, -1, -1, -1])
    assert kw["attrs"]["k"] == K


def test_profile_setting_and_the_profiler_covers_only_the_plugins_sections(tmp_path, monkeypatch):
    import pstats

    assert Config.from_env({"TENSORDIFF_TRACE": "s.h5"}).profile is None
    assert Config.from_env({"TENSORDIFF_TRACE": "s.h5", "TENSORDIFF_PROFILE": " p.prof "}).profile == "p.prof"
    monkeypatch.setattr(STATE, "profiler", None)
    monkeypatch.setattr(STATE, "profile_path", None)
    monkeypatch.setattr(STATE, "seconds", 0.0)
    path = tmp_path / "plugin.prof"
    STATE.start_profile(str(path))

    def inside():
        return sum(range(1000))

    def outside():
        return sum(range(1000))

    t0 = STATE.begin()
    inside()
    STATE.end(t0)
    outside()
    STATE.dump_profile()
    names = {fn for (_, _, fn) in pstats.Stats(str(path)).stats}
    assert "inside" in names and "outside" not in names
    assert STATE.seconds > 0
