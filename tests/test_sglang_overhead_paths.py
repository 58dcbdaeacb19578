"""The cheaper paths the SGLang plugin records through, checked against the paths they replace:

* ``topk_rows`` takes the logsumexp from the top-1 column instead of torch's own max pass: the
  same bits as ``torch.logsumexp`` (infinite and NaN rows included);
* ``serving.packed(rec, ..., remember=True)`` / ``(..., reuse=NAME)`` (the serve plugins' speed knobs): ``draft_input`` is the
  very tensor ``aux_hidden_states`` was recorded from, so its sketch is written again instead of
  computed again, bit for bit the sketch a second product gives; any difference (other rows, an
  in-place write, another tensor, other slots) computes it;
* ``collective_rpc("tensordiff_resume", topk=0 | K)``: predictions off and on in one run, and the
  plugin's seconds split by the top-k in force.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tensordiff.recorders import serving  # noqa: E402
from tensordiff.recorders.core import Recorder  # noqa: E402
from tensordiff.recorders.sglang import control  # noqa: E402
from tensordiff.recorders.sglang.config import Config  # noqa: E402
from tensordiff.recorders.sglang.state import STATE  # noqa: E402
from tensordiff.recorders.storage import _logsumexp_from_max, topk_rows  # noqa: E402
from tensordiff.trace import TraceReader  # noqa: E402

pytestmark = pytest.mark.torch

H = 64
LABELS = ["layer1", "layer2", "layer3"]


@pytest.mark.parametrize("n,v", [(1, 7), (5, 1024), (64, 1000), (3, 40000)])
def test_logsumexp_from_the_top1_column_is_torchs_bit_for_bit(n, v):
    torch.manual_seed(n)
    x = torch.randn(n, v) * 20
    x[0, 1] = float("inf")
    if n > 2:
        x[1] = float("-inf")
        x[2, 3] = float("nan")
    top = torch.topk(x, min(20, v), dim=-1).values[:, :1]
    want = torch.logsumexp(x, dim=-1, keepdim=True)
    got = _logsumexp_from_max(x, top)
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0))


def test_topk_rows_logsumexp_and_logprobs_as_before():
    torch.manual_seed(3)
    x = torch.randn(300, 500) * 4
    t = topk_rows(x, 10)
    v, i = torch.topk(x, 10, dim=-1)
    lse = torch.logsumexp(x, dim=-1, keepdim=True)
    want = torch.cat([i.double(), (v - lse).double(), lse.double()], dim=-1)
    assert torch.equal(t, want)


@pytest.mark.parametrize("own", [0, 1 << 30], ids=["logsumexp_from_max", "torch_logsumexp"])
@pytest.mark.parametrize("n,v,mapped", [(4100, 60, False), (37, 4, True), (0, 30, False)])
def test_topk_rows_filled_in_place_as_the_concatenated_columns(n, v, mapped, own, monkeypatch):
    """More rows than one fp32 block (the table is filled block by block), a draft's id map, no
    rows; the logsumexp from the top-1 column (large blocks) and torch's own (small ones)."""
    from tensordiff.recorders import storage

    monkeypatch.setattr(storage, "_TOPK_ROWS", 1000)
    monkeypatch.setattr(storage, "_OWN_MAX_ELEMENTS", own)
    torch.manual_seed(n)
    x = torch.randn(n, v) * 4
    m = torch.randperm(v) * 7 if mapped else None
    t = topk_rows(x, 20, m)
    k = min(20, v)
    vals, i = torch.topk(x, k, dim=-1)
    lse = torch.logsumexp(x, dim=-1, keepdim=True)
    want = torch.cat([(m[i] if mapped else i).double(), (vals - lse).double(), lse.double()], dim=-1)
    assert t.shape == (n, 2 * k + 1) and t.dtype == torch.float64
    assert torch.equal(t, want)


_STAGE = {"bytes": 0}


@pytest.fixture(params=[0, 1 << 20], ids=["at_once", "staged"])
def stage(request, monkeypatch):
    """The reuse tests run twice: each call written at once, and staged (the serve plugins'
    default: the bits are compared with the staged copy of the remembered call)."""
    monkeypatch.setitem(_STAGE, "bytes", request.param)
    return request.param


def _rec(path):
    return Recorder(path, side="serve", model={"num_layers": 4, "hidden_size": H}, stage_bytes=_STAGE["bytes"])


def _pair(path, aux, draft, aux_rows, draft_rows, reuse: bool):
    """Record ``aux`` as aux_hidden_states and ``draft`` as draft_input, with or without reuse."""
    with _rec(path) as rec:
        rec.add_tokens("s", None, list(range(len(aux_rows) + 1)))  # one more: draft row t pairs with t+1
        serving.packed(rec, "aux_hidden_states", aux, aux_rows, labels=LABELS, token_offset=0, role="aux", remember=reuse)
        if callable(draft):
            draft = draft()
        serving.packed(rec, "draft_input", draft, draft_rows, labels=LABELS, token_offset=1,
                       reuse="aux_hidden_states" if reuse else None)
        stats = rec.stats
    with TraceReader(path) as r:
        return stats, {n: (r.read_values(n), r.read_sketch(n), r.read_rms(n), r.token_rows(n))
                       for n in ("aux_hidden_states", "draft_input")}


def _same(a, b):
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)


@pytest.mark.usefixtures("stage")
def test_draft_input_reuses_the_aux_sketch_bit_for_bit(tmp_path):
    torch.manual_seed(0)
    x = torch.randn(40, 3 * H)
    rows = np.arange(40)
    rows_d = rows.copy()
    rows_d[[5, 17]] = -1  # the same selection on both: padding rows the aux call drops too
    rows_a = rows_d.copy()
    stats, got = _pair(tmp_path / "a.h5", x, x, rows_a, rows_d, reuse=True)
    assert (stats.sketch_products, stats.sketch_reused) == (1, 1)
    base_stats, want = _pair(tmp_path / "b.h5", x, x, rows_a, rows_d, reuse=False)
    assert (base_stats.sketch_products, base_stats.sketch_reused) == (2, 0)
    for name in want:
        _same(got[name], want[name])
    np.testing.assert_array_equal(got["draft_input"][1], got["aux_hidden_states"][1])


@pytest.mark.usefixtures("stage")
def test_inference_tensors_reuse_too(tmp_path):
    with torch.inference_mode():
        x = torch.randn(8, 3 * H)
    stats, _ = _pair(tmp_path / "t.h5", x, x, np.arange(8), np.arange(8), reuse=True)
    assert (stats.sketch_products, stats.sketch_reused) == (1, 1)


@pytest.mark.usefixtures("stage")
@pytest.mark.parametrize("case", ["other_rows", "other_tensor", "other_slots", "not_remembered"])
def test_reuse_is_refused_unless_it_is_the_same_rows_of_the_same_tensor(tmp_path, case):
    torch.manual_seed(1)
    x = torch.randn(12, 3 * H)
    rows_d = np.arange(12)
    draft = x
    if case == "other_rows":
        rows_d = rows_d.copy()
        rows_d[3] = -1
    elif case == "other_tensor":
        draft = x.clone()  # the same values in another tensor: not known to be the same without reading it
    elif case == "other_slots":
        draft = x[:, [*range(H, 2 * H), *range(0, H), *range(2 * H, 3 * H)]]  # slots 0 and 1 swapped
    stats, got = _pair(tmp_path / "t.h5", x, draft, np.arange(12), rows_d, reuse=case != "not_remembered")
    assert (stats.sketch_products, stats.sketch_reused) == (2, 0)
    # the draft's sketch is its own: the one a recorder without reuse writes
    _, alone = _pair(tmp_path / "u.h5", x, draft, np.arange(12), rows_d, reuse=False)
    _same(got["draft_input"], alone["draft_input"])


@pytest.mark.usefixtures("stage")
@pytest.mark.parametrize("edit", ["scale", "negate", "flip", "tiny"])
@pytest.mark.parametrize("inference", [False, True])
def test_an_inplace_write_between_the_calls_is_caught(tmp_path, inference, edit):
    """aux remembered from x itself, then x is rewritten in place: the version counter (or, for an
    inference tensor, which has none, the comparison with the remembered rows) refuses the stale
    sketch, and the draft's sketch is that of its new content. A sign flip, a permutation within a
    slot row and a change too small to move the row's float32 RMS keep every RMS: the rows' bits,
    not their RMS, decide."""
    torch.manual_seed(3)
    with torch.inference_mode(inference):
        x = torch.randn(12, 3 * H)
    before = x.clone()

    def draft():
        with torch.inference_mode(inference):
            if edit == "scale":
                x[4, :H].mul_(-3.0)
            elif edit == "negate":
                x[4, :H].neg_()
            elif edit == "flip":
                x[4, :H] = x[4, :H].flip(0)
            else:
                j = int(x[4, :H].abs().argmin())   # the smallest element, one ulp up: far below the RMS's rounding
                x[4, j] = float(np.nextafter(np.float32(x[4, j]), np.float32(np.inf)))
        return x

    if edit == "tiny":
        row = before[4, :H].numpy()
        kept = row.copy()
        j = int(np.abs(row).argmin())
        kept[j] = np.nextafter(row[j], np.float32(np.inf))
        rms = lambda r: np.sqrt(np.einsum("i,i->", r, r) / np.float32(H))   # noqa: E731 - the recorder's RMS
        assert rms(row) == rms(kept)     # the RMS alone could not tell
    stats, got = _pair(tmp_path / "t.h5", x, draft, np.arange(12), np.arange(12), reuse=True)
    assert (stats.sketch_products, stats.sketch_reused) == (2, 0)
    _, want_new = _pair(tmp_path / "n.h5", x, x, np.arange(12), np.arange(12), reuse=False)
    _, want_old = _pair(tmp_path / "o.h5", before, before, np.arange(12), np.arange(12), reuse=False)
    _same(got["draft_input"], want_new["draft_input"])
    _same(got["aux_hidden_states"], want_old["aux_hidden_states"])
    assert not np.array_equal(got["draft_input"][0], got["aux_hidden_states"][0])   # the values moved
    if edit != "tiny":   # one ulp of the smallest element moves no float32 sketch either
        assert not np.array_equal(got["draft_input"][1], got["aux_hidden_states"][1])


@pytest.mark.usefixtures("stage")
def test_a_large_call_is_not_remembered(tmp_path, monkeypatch):
    """Slot rows above REMEMBER_MAX_BYTES are sketched again rather than held twice."""
    from tensordiff.recorders import core

    monkeypatch.setattr(core, "REMEMBER_MAX_BYTES", 8 * 3 * H * 4 - 1)
    x = torch.randn(8, 3 * H)
    stats, _ = _pair(tmp_path / "t.h5", x, x, np.arange(8), np.arange(8), reuse=True)
    assert (stats.sketch_products, stats.sketch_reused) == (2, 0)
    monkeypatch.setattr(core, "REMEMBER_MAX_BYTES", 8 * 3 * H * 4)
    stats, _ = _pair(tmp_path / "u.h5", x, x, np.arange(8), np.arange(8), reuse=True)
    assert (stats.sketch_products, stats.sketch_reused) == (1, 1)


@pytest.fixture
def st(monkeypatch, tmp_path):
    monkeypatch.setattr(STATE, "cfg", Config(path=str(tmp_path / "s.h5"), topk=20))
    monkeypatch.setattr(STATE, "start_topk", 20)
    monkeypatch.setattr(STATE, "chain", {"r": [1]})
    monkeypatch.setattr(STATE, "seconds_by_topk", {})
    monkeypatch.setattr(STATE, "seconds", 0.0)
    monkeypatch.setattr(STATE, "profiler", None)
    monkeypatch.setattr(STATE, "paused", True)
    return STATE


def _rpc(method, **params):
    req = SimpleNamespace(method=method, parameters=params)
    out = []

    class _Out:
        def __init__(self, success, message):
            out.append((success, message))

    import sys
    import types
    mod = types.ModuleType("sglang.srt.managers.io_struct")
    mod.RpcReqOutput = _Out
    saved = {k: sys.modules.get(k) for k in ("sglang", "sglang.srt", "sglang.srt.managers",
                                             "sglang.srt.managers.io_struct")}
    try:
        for k in saved:
            if k != "sglang.srt.managers.io_struct" and saved[k] is None:
                sys.modules[k] = types.ModuleType(k)
        sys.modules["sglang.srt.managers.io_struct"] = mod
        control.hook_rpc(lambda *a, **k: pytest.fail("passed through"), SimpleNamespace(), req)
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v
    return out[0]


def test_resume_with_topk_switches_predictions_and_splits_the_seconds(st):
    assert _rpc("tensordiff_resume", topk=0) == (True, "")
    assert st.cfg.topk == 0 and not st.paused and st.chain == {}
    t0 = st.begin()
    st.end(t0 - 0.5)  # half a second with predictions off
    ok, msg = _rpc("tensordiff_resume", topk=7)
    assert not ok and "only 0 or the start-up TENSORDIFF_TOPK (20)" in msg and st.cfg.topk == 0
    assert _rpc("tensordiff_resume", topk=20) == (True, "")
    t0 = st.begin()
    st.end(t0 - 0.25)
    assert st.cfg.topk == 20
    assert st.seconds_by_topk[0] >= 0.5 and 0.25 <= st.seconds_by_topk[20] < 0.5
    assert st.seconds == pytest.approx(st.seconds_by_topk[0] + st.seconds_by_topk[20])
    assert _rpc("tensordiff_resume") == (True, "") and st.cfg.topk == 20  # no parameter: k unchanged


@pytest.mark.parametrize("stage_bytes", [0, 1 << 20])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_verify_logprob_of_the_next_token_without_a_torch_gather(monkeypatch, tmp_path, dtype, stage_bytes):
    from tensordiff.recorders.sglang import forward
    from tensordiff.recorders.sglang.state import Pass

    torch.manual_seed(2)
    n, v = 6, 50
    logits = (torch.randn(n, v) * 3).to(dtype)
    ids = np.array([3, 7, 1, 9, 4, 0])
    monkeypatch.setattr(STATE, "cfg", Config(path=str(tmp_path / "s.h5"), topk=4))
    monkeypatch.setattr(STATE, "warned", set())
    monkeypatch.setattr(STATE, "target_logits", (None, None, None, SimpleNamespace(next_token_logits=logits)))
    rec = Recorder(tmp_path / "t.h5", side="serve", model={"num_layers": 4, "hidden_size": H}, stage_bytes=stage_bytes)
    monkeypatch.setattr(STATE, "rec", rec)
    p = Pass(hs=None, rows=np.arange(n), keys=(None, np.arange(n), ids), segments=[("r", 0, n)], step=1,
             regime="target_verify")
    forward._target_predictions(p)
    nxt = np.append(ids[1:], 0)
    lse = torch.logsumexp(logits.float(), dim=-1).double().numpy()
    logit = logits.float().gather(1, torch.from_numpy(nxt)[:, None])[:, 0].double().numpy()
    np.testing.assert_array_equal(p.logit_next, logit)
    # the log-prob the step's row gets: the logit minus the row's logsumexp from the pass's top-k job
    np.testing.assert_array_equal(p.logit_next - p.pred.full()[:, -1], logit - lse)
    rec.close()


def test_topk_rows_of_a_one_column_view_with_any_stride():
    """torch calls a [n, 1] column of any stride contiguous; the CPU path copies it to rows the
    kernel reads."""
    x = torch.randn(1, 5).t()
    t = topk_rows(x, 3)
    lse = torch.logsumexp(x, dim=-1, keepdim=True)
    want = torch.cat([torch.zeros(5, 1, dtype=torch.float64), (x - lse).double(), lse.double()], dim=-1)
    assert torch.equal(t, want)
