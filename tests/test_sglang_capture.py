"""The SGLang plugin's capture (:mod:`tensordiff.recorders.sglang.capture`) without an engine: what
a hook snapshots, what it decides at capture (is the draft fed the target's very tensor, with the
same bits?), and when the queue of captured passes is recorded. The recorder is the real one,
writing real traces; the engine's objects are stand-ins (SimpleNamespace) with the attributes the
plugin reads. The real-engine check (a queued run records what a run recording every pass at once
records) is tests/test_sglang_serve.py::test_queued_passes_record_what_passes_recorded_at_once_record.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tensordiff.recorders.core import Recorder  # noqa: E402
from tensordiff.recorders.sglang import capture, forward  # noqa: E402
from tensordiff.recorders.sglang.config import Config  # noqa: E402
from tensordiff.recorders.sglang.state import STATE, Pass  # noqa: E402
from tensordiff.trace import TraceReader  # noqa: E402

pytestmark = pytest.mark.torch

H = 16
LABELS = ["layer1", "layer2", "layer3"]


class _Mode:
    def __init__(self, extend: bool):
        self.extend = extend
        self.name = "DRAFT_EXTEND" if extend else "DECODE"

    def is_extend(self):
        return self.extend

    def is_draft_extend_v2(self):
        return False

    def is_target_verify(self):
        return False


@pytest.fixture
def st(monkeypatch, tmp_path):
    rec = Recorder(tmp_path / "s.h5", side="serve", model={"num_layers": 4, "hidden_size": H}, sketch=False,
                   stage_bytes=1 << 20)
    for name, value in (("cfg", Config(path=str(tmp_path / "s.h5"), topk=0, stage_mb=1.0)), ("rec", rec),
                        ("labels", LABELS), ("raw_ids", [0, 1, 2]), ("convention", "sglang-llama"),
                        ("model", {"num_layers": 4, "hidden_size": H}), ("warned", set()), ("queue", []),
                        ("queue_bytes", 0), ("cap_aux", (None, None, None)), ("cap_seq", 0), ("cap_verify_seq", None),
                        ("fc_out", None), ("draft_logits", None),
                        ("last_target", None), ("closed", False), ("broken", False), ("paused", False),
                        ("draft_unmatched", 0), ("shift_checked", 0), ("shift_mismatched", 0), ("chain", {})):
        monkeypatch.setattr(STATE, name, value)
    yield STATE
    if not rec._closed:
        rec.close()


def _draft_fb(hs, ids):
    return SimpleNamespace(forward_mode=_Mode(True), rids=["r"], input_ids=torch.from_numpy(ids),
                           spec_info=SimpleNamespace(hidden_states=hs, num_accept_tokens=None))


@pytest.mark.parametrize("case", ["same_bits", "written_in_place", "another_tensor"])
def test_a_draft_extend_fed_the_targets_tensor_refers_to_its_rows_only_with_the_same_bits(st, tmp_path, case):
    """The target's aux states snapshotted; the draft fed the very tensor (same bits: its snapshot
    is the target's copy and the trace refers to the target's rows), the same tensor written in
    place since (its own copy: its own values), or another tensor (not the target's: not
    recorded, counted)."""
    n = 6
    live = torch.randn(n, 3 * H)
    ids = np.arange(n, dtype=np.int64) + 10
    rows = st.rec.add_tokens("r", np.arange(n), ids, regime="prefill")
    keys = capture.Keys(ids=ids, pos=np.arange(n), segs=[("r", 0, n)], regime="prefill", step=1, mode="EXTEND",
                        stash=[], private=True, seq=7)
    snap_t = capture.capture_target(None, SimpleNamespace(logits_output=SimpleNamespace(hidden_states=live)), keys,
                                    copy=True)
    aux_copy = snap_t.logits_output.hidden_states
    assert aux_copy is not live and st.cap_aux == (live, aux_copy, 7)
    p = Pass(hs=aux_copy, rows=rows, keys=(np.array(["r"] * n, dtype=object), np.arange(n), ids),
             segments=[("r", 0, n)], step=1, regime="prefill", committed=True, private=True, seq=7)
    st.last_target = p
    forward.record_aux(aux_copy, rows, private=True)
    want = live.clone()
    fed = live
    if case == "written_in_place":
        live[2, :H].neg_()
        want = live.clone()
    elif case == "another_tensor":
        fed = live.clone()
    snap = capture.capture_draft(_draft_fb(fed, np.append(ids[1:], 0)), copy=True)
    assert snap.tensordiff_matched == (case != "another_tensor")
    assert (snap.spec_info.hidden_states is aux_copy) == (case == "same_bits")
    live.zero_()  # the engine moves on: nothing recorded may change
    forward.record_draft(None, snap)
    st.rec.close()
    with TraceReader(tmp_path / "s.h5") as r:
        if case == "another_tensor":
            assert "draft_input" not in r.tensors and st.draft_unmatched == 1
            return
        got = r.read_values("draft_input")
        np.testing.assert_array_equal(got, want.numpy())
        ref = r.f["tensors/draft_input/values_ref"][()]
        if case == "same_bits":
            np.testing.assert_array_equal(ref, np.arange(n))  # stored once
        else:
            assert (ref == -1).all()
        np.testing.assert_array_equal(r.read_values("aux_hidden_states"), snap_t.logits_output.hidden_states.numpy())


def test_the_queue_records_at_its_byte_bound_its_age_and_a_flush(st, monkeypatch):
    done = []

    def fn(snap):
        done.append(snap.i)

    big = st.cfg.stage_bytes // 2 + 1
    st.later(fn, SimpleNamespace(i=0, nbytes=10), queue=True)
    assert done == [] and st.dirty
    st.later(fn, SimpleNamespace(i=1, nbytes=big), queue=True)  # past half the bound: recorded, in order
    assert done == [0, 1] and st.queue == []
    st.later(fn, SimpleNamespace(i=2, nbytes=10), queue=True)
    monkeypatch.setattr(st, "queue_since", time.monotonic() - st.cfg.flush_seconds - 1)
    flushes = st.rec.writer.flush_count
    st.later(fn, SimpleNamespace(i=3, nbytes=10), queue=True)  # the first is older than the flush interval:
    assert done == [0, 1, 2, 3] and st.rec.writer.flush_count == flushes + 1  # recorded and flushed
    st.later(fn, SimpleNamespace(i=4, nbytes=10), queue=True)
    st.flush()
    assert done == [0, 1, 2, 3, 4]
    st.later(fn, SimpleNamespace(i=5, nbytes=0), queue=False)  # nothing copied: recorded at once
    assert done[-1] == 5


def test_an_error_in_a_queued_pass_stops_recording_and_keeps_the_trace(st, tmp_path):
    rows = st.rec.add_tokens("r", np.arange(3), np.arange(3), regime="prefill")
    st.rec.record("s", torch.randn(3, H), rows)
    st.rec.flush()
    done = []

    def bad(snap):
        raise RuntimeError("boom")

    st.later(lambda s: done.append(1), SimpleNamespace(nbytes=0), queue=True)
    st.later(bad, SimpleNamespace(nbytes=0), queue=True)
    st.later(lambda s: done.append(3), SimpleNamespace(nbytes=0), queue=True)
    st.replay()
    assert done == [1] and st.broken and st.queue == []
    with TraceReader(tmp_path / "s.h5") as r:
        assert r.tensors["s"].rows == 3 and "RuntimeError: boom" in r.f.attrs["recording_error"]


def test_a_draft_extend_is_never_filed_under_another_pass(st):
    """A verify step whose target pass was not recorded (no request ids: not keyed): the draft
    extend after it is fed that step's states, not the last recorded pass's, and is not recorded
    on the last recorded pass's rows (the pass number, not the tensor's address, decides)."""
    n = 4
    live = torch.randn(n, 3 * H)
    st.cap_aux, st.cap_verify_seq = (live, live.clone(), 3), None  # pass 3 recorded; the next verify pass was not
    res, _, _ = capture.capture_verify(SimpleNamespace(accept_lens=torch.tensor([n]), accept_index=None,
                                                       logits_output=SimpleNamespace(hidden_states=live)),
                                       SimpleNamespace(reqs=[]), copy=True)
    assert st.cap_aux == (None, None, None) and res.logits_output.hidden_states is None
    snap = capture.capture_draft(_draft_fb(live, np.arange(n, dtype=np.int64)), copy=True)
    assert not snap.tensordiff_matched and snap.tensordiff_seq is None
    st.last_target = Pass(hs=live, rows=np.arange(n), keys=(None, np.arange(n), np.arange(n)), segments=[("r", 0, n)],
                          step=1, regime="target_verify", committed=True, seq=3)
    forward.record_draft(None, snap)
    assert st.draft_unmatched == 1
    # and a snapshot that names another pass than the last one recorded is refused the same way
    snap.tensordiff_matched, snap.tensordiff_seq = True, 4
    forward.record_draft(None, snap)
    assert st.draft_unmatched == 2


def test_a_verify_result_is_numpy_and_the_requests_limits_only(st):
    live = torch.randn(4, 3 * H)
    st.cap_aux, st.cap_verify_seq = (live, live.clone(), 5), 5
    req = SimpleNamespace(rid="r", origin_input_ids=[1] * 7, sampling_params=SimpleNamespace(max_new_tokens=3),
                          output_ids=[5, 6])
    result = SimpleNamespace(accept_lens=torch.tensor([2, 1]), accept_index=torch.tensor([[0, 1], [2, -1]]),
                             logits_output=SimpleNamespace(hidden_states=live))
    res, bat, nbytes = capture.capture_verify(result, SimpleNamespace(reqs=[req, object()]), copy=True)
    assert res.logits_output.hidden_states is st.cap_aux[1] and nbytes == 0  # the target's snapshot
    assert res.accept_lens.tolist() == [2, 1] and res.accept_index.tolist() == [0, 1, 2, -1]  # flat, as read
    result.accept_lens[0] = 9  # the engine's tensors may change: the snapshot does not
    assert res.accept_lens.tolist() == [2, 1]
    from tensordiff.recorders.sglang.verify import position_limit
    assert position_limit(bat.reqs[0]) == 10 and position_limit(bat.reqs[1]) is None
    other = torch.randn(4, 3 * H)  # re-laid out in another tensor: that one is copied
    st.cap_verify_seq = 6
    st.cap_aux = (live, live.clone(), 6)
    res, _, nbytes = capture.capture_verify(SimpleNamespace(accept_lens=torch.tensor([1]), accept_index=None,
                                                            logits_output=SimpleNamespace(hidden_states=other)),
                                            SimpleNamespace(reqs=[]), copy=True)
    assert nbytes == other.numel() * 4 and st.cap_aux[0] is other and st.cap_aux[2] == 6
    np.testing.assert_array_equal(res.logits_output.hidden_states.numpy(), other.numpy())


def test_slots_are_claimed_in_the_order_the_engine_packs_them(monkeypatch, tmp_path):
    """Draft ids out of order ([5, 1, 3]): SGLang sets layers_to_capture to [6, 2, 4] (id + 1) and
    its forward appends the aux states in layer order, so the packed tensor holds layer2, layer4,
    layer6; the plugin labelled the slots in config order (layer6, layer2, layer4)."""
    from tensordiff.recorders.sglang.startup import resolve_capture

    for name, value in (("capture_attrs", {}), ("labels", None), ("raw_ids", None), ("convention", None),
                        ("warned", set())):
        monkeypatch.setattr(STATE, name, value)
    ids, n = [5, 1, 3], 8
    ltc = [i + 1 for i in ids]   # what SGLang's set_eagle3_layers_to_capture sets
    hf = SimpleNamespace(num_hidden_layers=n, hidden_size=H, architectures=["LlamaForCausalLM"])
    runner = SimpleNamespace(model_config=SimpleNamespace(hf_config=hf),
                             model=SimpleNamespace(model=SimpleNamespace(layers_to_capture=ltc)),
                             spec_aux_config=SimpleNamespace(eagle_aux_hidden_state_layer_ids=ids),
                             server_args=SimpleNamespace(speculative_algorithm="EAGLE3"))
    resolve_capture(runner)
    packed = [f"layer{i}" for i in range(n) if i in ltc]   # the engine's forward loop
    assert STATE.labels == packed == ["layer2", "layer4", "layer6"], STATE.labels
    assert STATE.raw_ids == ids and STATE.capture_attrs["layers_to_capture"] == ltc
