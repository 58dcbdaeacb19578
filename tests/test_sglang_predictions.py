"""The SGLang plugin's prediction tables without an engine: top-k rows are computed only for the
rows the recorder keeps (``need``), from the logits SGLang computed where it computed them for every
row and from the final hidden states and the lm_head weight otherwise, as top-k jobs of the
recorder (computed at its next drain with staging on, at once with it off); :func:`record_topk`
writes the computed rows only.

The logits processor and its output are stand-ins (SimpleNamespace); the recorder is the real
one, writing a real trace; the top-k itself is the recorder core's ``topk_rows``, checked against
``torch.topk`` / ``logsumexp``.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tensordiff.recorders import staging  # noqa: E402
from tensordiff.recorders.core import Recorder  # noqa: E402
from tensordiff.recorders.sampling import Sampling  # noqa: E402
from tensordiff.recorders.sglang import predictions as pr  # noqa: E402
from tensordiff.recorders.sglang.config import Config  # noqa: E402
from tensordiff.recorders.sglang.state import STATE  # noqa: E402
from tensordiff.trace import TraceReader  # noqa: E402

K = 5


@pytest.fixture(params=[0, 1 << 20], ids=["at_once", "staged"])
def state(request, monkeypatch, tmp_path):
    """STATE with top-5 predictions and a real recorder (staging off or on) holding one sequence
    of 100 token rows at positions 7..106; its ``plain`` calls are also collected."""
    calls = []
    rec = Recorder(tmp_path / "s.h5", side="serve", model={"num_layers": 4, "hidden_size": 16},
                   stage_bytes=request.param)
    positions = np.arange(100, dtype=np.int64) + 7
    rec.add_tokens("s", positions, np.zeros(100, dtype=np.int64), regime="prefill")
    plain = rec.plain

    def spy(name, values, rows, **kw):
        calls.append((name, values, np.asarray(rows).copy(), kw))
        return plain(name, values, rows, **kw)

    monkeypatch.setattr(rec, "plain", spy)
    monkeypatch.setattr(STATE, "cfg", Config(path=str(tmp_path / "s.h5"), topk=K))
    monkeypatch.setattr(STATE, "rec", rec)
    monkeypatch.setattr(STATE, "warned", set())
    monkeypatch.setattr(STATE, "model", {"num_layers": 4})
    yield SimpleNamespace(rec=rec, calls=calls, positions=positions, path=tmp_path / "s.h5")
    rec.close()


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
    assert used is logits and isinstance(table, pr.PassTable) and table.width == 2 * K + 1
    assert table.job.done == (state.rec.stage_bytes == 0)  # staged: computed at the drain
    logits_then = logits.clone()
    logits.mul_(-1)  # the engine may overwrite its logits: the job holds its own copy
    full = table.full()
    assert full.dtype == np.float64 and full.shape == (6, 2 * K + 1)
    _check(full, logits_then, need)
    others = np.setdiff1d(np.arange(6), need)
    assert np.isnan(full[others]).all()
    assert table.ref(4) == (table.job, 1) and table.ref(2) is None
    every, _ = pr.prediction_rows((None, None, None, out), 6, "target_topk")
    _check(every.full(), logits, np.arange(6))
    assert pr.prediction_rows((None, None, None, out), 6, "target_topk", need=np.array([], dtype=np.int64)) == (
        None, None)


def test_rows_sglang_computed_no_logits_for_come_from_the_lm_head(state, monkeypatch):
    """A prefill: SGLang kept the last row only; the plugin multiplies the needed rows' hidden
    states by the lm_head weight (padded vocabulary trimmed, in chunks), never the others; with
    staging, two passes' rows share one batch."""
    monkeypatch.setattr(staging, "HEAD_CHUNK_ROWS", 2)
    g = torch.Generator().manual_seed(1)
    hs = torch.randn(7, 16, generator=g)
    w = torch.randn(48, 16, generator=g)  # 40 real tokens + 8 padding rows
    module = SimpleNamespace(config=SimpleNamespace(vocab_size=40), logit_scale=None, final_logit_softcapping=None)
    head = SimpleNamespace(weight=w)
    out = SimpleNamespace(next_token_logits=(hs @ w.T)[-1:, :40])
    logits = (hs @ w.T)[:, :40]
    need = np.array([0, 2, 3, 6])
    table, used = pr.prediction_rows((module, hs, head, out), 7, "target_topk", need=need)
    again, _ = pr.prediction_rows((module, hs, head, out), 7, "target_topk", need=np.array([1, 5]))
    assert used is None
    full = table.full()
    _check(full, logits, need)
    assert np.isnan(full[[1, 4, 5]]).all()
    assert (full[need, :K] < 40).all()
    assert table.full() is full   # made once: a verify pass's spec_verify and spec_chain rows both read it
    _check(again.full(), logits, np.array([1, 5]))


def test_kept_rows_are_trace_rows_the_sampling_keeps(state):
    rows = np.array([0, 1, -1, 3, 4, 5])
    np.testing.assert_array_equal(pr.kept_rows(rows), [0, 1, 3, 4, 5])
    state.rec.sample = Sampling(every=2)
    # positions are row + 7: odd rows sit at even positions
    np.testing.assert_array_equal(pr.kept_rows(rows), [1, 3, 5])


def test_record_topk_never_writes_a_row_that_was_not_computed(state):
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(4, 40, generator=g)
    out = SimpleNamespace(next_token_logits=logits)
    table, _ = pr.prediction_rows((None, None, None, out), 4, "target_topk", need=np.array([0, 3]))
    pr.record_topk("target_topk", table, np.array([10, 11, 12, -1]), 0, "test")
    (name, values, rows, kw), = state.calls
    assert name == "target_topk" and kw["token_offset"] == 0
    np.testing.assert_array_equal(rows, [10, -1])  # the computed rows only; -1 is dropped by the recorder
    assert kw["attrs"]["k"] == K
    state.rec.close()
    with TraceReader(str(state.path)) as r:
        np.testing.assert_array_equal(r.token_rows("target_topk"), [10])
        got = r.read_values("target_topk")
    want = torch.topk(logits[0], K)
    np.testing.assert_array_equal(got[0, :K], want.indices.numpy())


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
