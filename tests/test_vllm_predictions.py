"""The vLLM plugin's prediction tables without an engine (the real-engine checks are in
test_vllm_serve.py): a target step committed after its sampling records ``target_topk`` on its
kept rows and a ``spec_verify`` / ``spec_chain`` row per verify segment, whose target columns come
from every draft position's row, rejected ones included; the draft's pass gives
``draft_fc_output``, ``draft_topk`` (ids through the draft's ``d2t``) and the chain of the next
verify; lm_heads the plugin cannot reproduce get no tables.

The plugin's hooks, ``commit`` and ``record_draft_predictions``, run as the engine runs them; the
recorder is the real one writing a real trace (staging on and off); torch's own top-k and
logsumexp are the reference.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tensordiff import conventions as cv  # noqa: E402
from tensordiff.recorders.core import Recorder  # noqa: E402
from tensordiff.recorders.vllm import predictions as pr  # noqa: E402
from tensordiff.recorders.vllm import verify  # noqa: E402
from tensordiff.recorders.vllm.config import Config  # noqa: E402
from tensordiff.recorders.vllm.state import STATE, Step  # noqa: E402
from tensordiff.trace import TraceReader  # noqa: E402

V, H, K, TOPK = 50, 16, 2, 5


def _head(seed=0, vocab=V, rows=None):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows or vocab, H, generator=g)


@pytest.fixture(params=[0, 1 << 20], ids=["at_once", "staged"])
def st(request, monkeypatch, tmp_path):
    """STATE with top-5 predictions, a target lm_head of V tokens and a real recorder."""
    path = tmp_path / "v.h5"
    rec = Recorder(path, side="serve", model={"num_layers": 4, "hidden_size": H}, stage_bytes=request.param)
    w = _head()
    for name, value in (("cfg", Config(path=str(path), topk=TOPK)), ("rec", rec), ("warned", set()),
                        ("model", {"num_layers": 4, "hidden_size": H}), ("labels", None), ("chain", {}),
                        ("chain_step", None), ("start_topk", None), ("seconds", 0.0), ("shift_checked", 0),
                        ("shift_mismatched", 0), ("raw_ids", None), ("convention", "vllm"),
                        ("spec_k", None), ("verify_steps", 0), ("rows_written", 0), ("rows_dropped", 0), ("logits_reused", 0),
                        ("target_head", (w, V, None, None)), ("draft_head", None), ("draft_id_map", None),
                        ("last", None), ("dirty", False), ("paused", False), ("closed", False), ("broken", False)):
        monkeypatch.setattr(STATE, name, value)
    yield SimpleNamespace(rec=rec, path=path, w=w)
    rec.close()  # (a no-op when the test closed it)


def _step(hidden):
    """Request p: a partial prefill chunk (positions 0..3 of a 10-token prompt); request v: a
    verify of its last token 40 and draft tokens 7, 9 at positions 20..22."""
    ids = np.array([11, 12, 13, 14, 40, 7, 9], dtype=np.int64)
    pos = np.array([0, 1, 2, 3, 20, 21, 22], dtype=np.int64)
    s = Step(1, [("p", 0, 4, 0, "p-1"), ("v", 4, 3, K, "v-1")], pos, ids, ["prefill", "target_verify"], [10, 5],
             [None, None])
    s.batch_idx = [0, 1]
    s.num_reqs = 2
    s.prompts = {0: list(range(11, 21))}
    s.hidden = hidden
    return s


def _tables(logits):
    lse = torch.logsumexp(logits.double(), -1)
    top = torch.topk(logits.double(), TOPK, -1)
    return top.indices.numpy(), (top.values - lse[:, None]).numpy(), lse.numpy()


def _read(path):
    with TraceReader(str(path)) as r:
        return {n: (r.token_rows(n), r.read_values(n, raw=True)) for n in r.tensors}, dict(r.tensors)


@pytest.mark.parametrize("accepted", [0, 1, 2])
def test_a_verify_step_records_its_kept_rows_and_every_draft_positions_target_columns(st, accepted):
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(9, H, generator=g)  # two rows of padding, as vLLM's padded batches have
    step = _step(hidden)
    chain_logits = torch.randn(2, V, generator=g)
    jobs = [st.rec.topk_job(TOPK, logits=chain_logits[i:i + 1]) for i in range(K)]
    STATE.chain = {"v": [(jobs[0], 0), (jobs[1], 0)], "gone": [(jobs[0], 0)]}
    STATE.chain_step = step.step - 1  # drafted by the propose right before this step
    sampled = np.full((2, K + 1), -1, dtype=np.int64)
    sampled[1, :accepted + 1] = 5  # the sampler's valid tokens: the accepted drafts and one more
    verify.commit(step, sampled)
    st.rec.close()
    got, info = _read(st.path)
    logits = hidden[:7] @ st.w.T
    ids, lp, lse = _tables(logits)
    kept = list(range(4)) + list(range(4, 4 + accepted + 1))
    rows, vals = got[cv.TARGET_TOPK]
    assert len(rows) == len(kept)
    np.testing.assert_array_equal(vals[:, :TOPK], ids[kept])
    np.testing.assert_allclose(vals[:, TOPK:2 * TOPK], lp[kept], atol=1e-5)
    np.testing.assert_allclose(vals[:, 2 * TOPK], lse[kept], rtol=1e-6)
    (srow,), (sv,) = got[cv.SPEC_VERIFY]
    assert srow == 4 and info[cv.SPEC_VERIFY].token_offset == 0
    assert list(sv[:5]) == [accepted, K, accepted if accepted < K else -1, 7, 9]
    # the target's top-1 at draft positions 0 and 1 (rows 4 and 5, whether kept or not) and its
    # log-prob of the draft tokens 7 and 9 there, in its top-k or not
    np.testing.assert_array_equal(sv[5:7], ids[[4, 5], 0])
    want_lp = (logits[[4, 5], [7, 9]].double() - torch.logsumexp(logits[[4, 5]].double(), -1)).numpy()
    np.testing.assert_allclose(sv[7:9], want_lp, atol=1e-5)
    (crow,), (ch,) = got[cv.SPEC_CHAIN]
    w = cv.topk_width(TOPK)
    assert crow == 4 and info[cv.SPEC_CHAIN].attrs["K"] == K and ch.shape == (2 * K * w,)
    np.testing.assert_array_equal(ch[:w], jobs[0].table[0])
    np.testing.assert_array_equal(ch[w:2 * w], jobs[1].table[0])
    np.testing.assert_allclose(ch[2 * w:3 * w], np.concatenate([ids[4], lp[4], [lse[4]]]), atol=1e-5)
    np.testing.assert_allclose(ch[3 * w:], np.concatenate([ids[5], lp[5], [lse[5]]]), atol=1e-5)
    assert STATE.verify_steps == 1 and "v" not in STATE.chain  # a chain is used by one verify step
    assert "gone" in STATE.chain  # a request this step does not verify: its chain is not written anywhere
    assert STATE.rows_dropped == K - accepted


def _engine_logits(hidden, w, rows):
    """What vLLM's compute_logits returns for the pass rows ``rows``, offset by 0.25 per row index
    so that a table shows which source it came from (log-probs do not move, logsumexp does)."""
    x = hidden[torch.as_tensor(rows)] @ w.T
    return x + 0.25 * (1 + torch.arange(len(rows), dtype=x.dtype))[:, None]


@pytest.mark.parametrize("mode", ["reused", "shape_mismatch", "no_mapping"])
def test_the_rows_vllm_sampled_from_take_its_own_logits_and_the_others_the_plugins_product(st, mode):
    """A verify step whose sampling was seen: the verify rows (4, 5, 6) and the prefill chunk's last
    row (3) take the logits vLLM computed (spec metadata's logits_indices); the prefill's other
    rows the plugin's product; spec_verify's log-prob of each draft token comes from the same
    logits as the row's table. Logits of another width, or no mapping: every row from the
    product, with a warning for the width."""
    g = torch.Generator().manual_seed(7)
    hidden = torch.randn(9, H, generator=g)
    step = _step(hidden)
    sampled_at = np.array([3, 4, 5, 6])
    logits = _engine_logits(hidden, st.w, sampled_at)
    if mode == "shape_mismatch":
        logits = torch.cat([logits, torch.zeros(len(sampled_at), 3)], dim=1)
    step.logits = pr._private_logits(logits)
    if mode != "no_mapping":
        step.logit_rows = pr.logit_rows(step, len(sampled_at), SimpleNamespace(logits_indices=torch.tensor(sampled_at)))
        assert list(step.logit_rows) == [3, 4, 5, 6]
    logits.fill_(float("nan"))  # the sampler changes its logits in place: the plugin's copy is its own
    verify.commit(step, np.array([[9, -1, -1], [7, 9, 5]], dtype=np.int64))  # both drafts accepted
    st.rec.close()
    got, _ = _read(st.path)
    ref = hidden[:7] @ st.w.T
    if mode == "reused":
        ref = ref.clone()
        ref[torch.as_tensor(sampled_at)] = _engine_logits(hidden, st.w, sampled_at)
    ids, lp, lse = _tables(ref)
    rows, vals = got[cv.TARGET_TOPK]
    assert list(rows) == list(range(7))
    np.testing.assert_array_equal(vals[:, :TOPK], ids)
    np.testing.assert_allclose(vals[:, TOPK:2 * TOPK], lp, atol=1e-5)
    np.testing.assert_allclose(vals[:, 2 * TOPK], lse, rtol=1e-6)
    (sv,) = got[cv.SPEC_VERIFY][1]
    want = (ref[[4, 5], [7, 9]].double() - torch.logsumexp(ref[[4, 5]].double(), -1)).numpy()
    np.testing.assert_allclose(sv[7:9], want, atol=1e-5)
    assert ("logits-shape" in STATE.warned) == (mode == "shape_mismatch")


def test_logit_rows_map_the_sampled_rows_of_a_step():
    """Without drafts: each request's last row in batch order (a request with no rows: -1); with
    drafts: the spec metadata's logits_indices; a count or a row that does not fit the step: None."""
    step = _step(None)
    step.num_reqs = 3  # a third request in the batch scheduled no rows
    assert list(pr.logit_rows(step, 3, None)) == [3, 6, -1]
    assert pr.logit_rows(step, 2, None) is None
    meta = SimpleNamespace(logits_indices=torch.tensor([3, 4, 5, 6]))
    assert list(pr.logit_rows(step, 4, meta)) == [3, 4, 5, 6]
    assert pr.logit_rows(step, 3, meta) is None
    assert pr.logit_rows(step, 1, SimpleNamespace(logits_indices=torch.tensor([7]))) is None
    assert pr.logit_rows(step, 1, SimpleNamespace(logits_indices=None)) is None


def test_the_compute_logits_tap_copies_a_recorded_steps_logits_only(st, monkeypatch):
    """The tap on the target model's compute_logits: a private copy while a recorded step waits for
    its sampling, nothing otherwise (no step, a step without hidden states, a second call); removing
    it brings the class's method back."""
    class Model:
        def compute_logits(self, h):
            return h @ st.w.T

    m = Model()
    patch = pr.InstancePatch(m, "compute_logits", pr._logits_tap(m.compute_logits))
    h = torch.randn(2, H)
    monkeypatch.setattr(STATE, "pending", None)
    m.compute_logits(h)  # a dummy run: no step
    step = _step(None)
    monkeypatch.setattr(STATE, "pending", step)
    m.compute_logits(h)
    assert step.logits is None  # predictions off for this step (no hidden states kept)
    step.hidden = torch.zeros(7, H)
    out = m.compute_logits(h)
    first = step.logits
    torch.testing.assert_close(first, h @ st.w.T)
    out.fill_(0.0)
    assert first.abs().sum() > 0  # its own copy
    m.compute_logits(h + 1)  # a later call in the same step (prompt log-probs): the step's stay
    assert step.logits is first
    patch.remove()
    assert "compute_logits" not in vars(m) and m.compute_logits(h).shape == (2, V)


@pytest.mark.parametrize("drafted", [None, -2, 0], ids=["no_propose", "older_propose", "this_steps_propose"])
def test_a_chain_not_drafted_right_before_the_verify_step_is_not_written(st, drafted):
    """Chains from a propose other than the one right before the step (a pause between, a step
    committed late, the chain of the step itself) would pair another step's draft distributions
    with this step's draft tokens: no spec_chain row; spec_verify is written."""
    step = _step(torch.randn(7, H, generator=torch.Generator().manual_seed(5)))
    job = st.rec.topk_job(TOPK, logits=torch.randn(1, V))
    STATE.chain = {"v": [(job, 0), (job, 0)]}
    STATE.chain_step = None if drafted is None else step.step + drafted
    verify.commit(step, np.array([[-1, -1, -1], [5, 5, -1]], dtype=np.int64))
    st.rec.close()
    got, _ = _read(st.path)
    assert cv.SPEC_CHAIN not in got and len(got[cv.SPEC_VERIFY][0]) == 1


def test_without_top_k_a_verify_step_keeps_its_counts(st, monkeypatch):
    """TENSORDIFF_TOPK=0: no target_topk or spec_chain; spec_verify keeps the accepted count, the
    first rejected position and the draft tokens, the target's columns NaN."""
    monkeypatch.setattr(STATE, "target_head", None)
    step = _step(None)
    sampled = np.array([[-1, -1, -1], [5, 5, -1]], dtype=np.int64)
    verify.commit(step, sampled)
    st.rec.close()
    got, _ = _read(st.path)
    assert cv.TARGET_TOPK not in got and cv.SPEC_CHAIN not in got
    (sv,) = got[cv.SPEC_VERIFY][1]
    assert list(sv[:5]) == [1, K, 1, 7, 9] and np.isnan(sv[5:]).all()


def test_an_unseen_sampling_result_records_no_verify_step(st):
    """A step committed without its sampling result (the next step came first): only the verify
    segment's first row is kept, with its prediction; no spec_verify row claims an acceptance."""
    step = _step(torch.randn(7, H, generator=torch.Generator().manual_seed(2)))
    verify.commit(step, None)
    st.rec.close()
    got, _ = _read(st.path)
    assert cv.SPEC_VERIFY not in got and len(got[cv.TARGET_TOPK][0]) == 5


@pytest.mark.parametrize("sampled_kept", [True, False], ids=["sampled_row_kept", "sampled_row_not_kept"])
def test_the_draft_pass_records_fc_output_draft_topk_and_the_next_chain(st, monkeypatch, sampled_kept):
    """Draft rows on the target rows of the same (request, position); the draft's ids mapped to the
    target's through d2t; each request's chain from its sampled row of the first pass and its
    rows of the decode steps."""
    g = torch.Generator().manual_seed(3)
    step = _step(None)
    verify.commit(step, np.array([[-1, -1, -1], [5, 5, 5]], dtype=np.int64))  # every draft accepted
    dv = 8
    wd = torch.randn(dv, H, generator=g)
    d2t = torch.tensor([3, 3, 5, 10, 10, 20, 30, 41])  # target id = draft id + d2t
    id_map = d2t + torch.arange(dv)
    monkeypatch.setattr(STATE, "draft_head", (wd, dv, None, None))
    monkeypatch.setattr(STATE, "draft_id_map", id_map)
    n = 7
    fc = torch.randn(n, H, generator=g)
    h0, h1 = torch.randn(n + 1, H, generator=g), torch.randn(3, H, generator=g)
    rows = step.rows.copy()
    if not sampled_kept:
        rows[6] = -1  # v's sampled row has no trace row (as a sampling that drops its position): no draft_topk row
    ctx = {"fc": fc, "outs": [h0, h1], "sample": np.array([3, 6]), "aligned": True, "step": step}
    pr.record_draft_predictions(ctx, rows, n, ["p", "v"])
    chain = STATE.chain
    assert sorted(chain) == ["p", "v"] and STATE.chain_step == step.step
    # position 0 is the draft_topk table's own row where that row is kept (no second product), a
    # job of the sampled rows not kept otherwise; position 1 is row 1 of the decode step's job
    assert [i for _, i in chain["v"]] == ([6, 1] if sampled_kept else [0, 1])
    assert (chain["v"][0][0] is chain["p"][0][0]) == sampled_kept
    for pos_, h in ((0, h0[6:7]), (1, h1[1:2])):  # v: its sampled row of the first pass (6), then decode row 1
        t = chain["v"][pos_][0].table[chain["v"][pos_][1]]
        want = h @ wd.T
        np.testing.assert_array_equal(t[:TOPK], id_map[torch.topk(want, TOPK, -1).indices[0]].numpy())
        np.testing.assert_allclose(t[2 * TOPK], torch.logsumexp(want.double(), -1).numpy()[0], rtol=1e-6)
    st.rec.close()
    got, info = _read(st.path)
    kept = rows >= 0
    np.testing.assert_array_equal(got[cv.DRAFT_FC][0], rows[kept])
    np.testing.assert_allclose(got[cv.DRAFT_FC][1], fc.numpy()[kept], rtol=1e-6)
    assert info[cv.DRAFT_FC].token_offset == 1 and info[cv.DRAFT_TOPK].token_offset == 1
    drows, dvals = got[cv.DRAFT_TOPK]
    np.testing.assert_array_equal(drows, rows[kept])
    logits = (h0[:n] @ wd.T)[torch.from_numpy(kept)]
    np.testing.assert_array_equal(dvals[:, :TOPK], id_map[torch.topk(logits, TOPK, -1).indices].numpy())
    np.testing.assert_allclose(dvals[:, 2 * TOPK], torch.logsumexp(logits.double(), -1).numpy(), rtol=1e-6)


def test_a_draft_pass_whose_rows_are_not_draft_inputs_gets_no_draft_predictions(st, monkeypatch):
    """Extra input slots in the draft pass (rows that are not draft_input's): the fc output is still
    recorded (it is computed on draft_input's rows), draft_topk and the chain are not."""
    step = _step(None)
    verify.commit(step, np.array([[-1, -1, -1], [5, 5, 5]], dtype=np.int64))
    monkeypatch.setattr(STATE, "draft_head", (_head(4, vocab=8), 8, None, None))
    STATE.chain = {"v": []}
    ctx = {"fc": torch.zeros(7, H), "outs": [torch.zeros(9, H)], "sample": np.array([3, 6]), "aligned": False,
           "step": step}
    pr.record_draft_predictions(ctx, step.rows.copy(), 7, ["p", "v"])
    assert STATE.chain == {}
    st.rec.close()
    got, _ = _read(st.path)
    assert cv.DRAFT_FC in got and cv.DRAFT_TOPK not in got


def _model(weight, **lp):
    defaults = {"org_vocab_size": V, "vocab_size": V, "scale": 1.0, "soft_cap": None, "logits_as_input": False}
    return SimpleNamespace(lm_head=SimpleNamespace(weight=weight), logits_processor=SimpleNamespace(**{**defaults, **lp}))


def test_lm_heads_the_plugin_cannot_reproduce_get_no_tables(monkeypatch):
    monkeypatch.setattr(STATE, "warned", set())
    w = _head(rows=V + 14)  # vLLM pads the vocabulary: the logits are cut to org_vocab_size
    assert pr.head_of(_model(w), "target") == (w, V, None, None)
    assert pr.head_of(_model(w, scale=0.5), "target")[2] == 0.5
    assert pr.head_of(_model(w, soft_cap=30.0), "target")[3] == 30.0
    assert pr.head_of(_model(_head(rows=V // 2)), "target") is None  # vocab-sharded (TP > 1)
    assert pr.head_of(_model(w, logits_as_input=True), "draft") is None
    assert pr.head_of(_model(w, scale=0.5, soft_cap=30.0), "draft") is None  # capped, then scaled
    assert pr.head_of(SimpleNamespace(), "draft") is None
    assert {"shard-target", "shard-draft", "cap-draft", "no-head-draft"} <= STATE.warned


def test_resume_turns_predictions_off_and_on_again_and_says_the_plugins_seconds(st, monkeypatch):
    """collective_rpc("tensordiff_resume", kwargs={"topk": 0 | k}): predictions off, then on again
    with the start-up k; another k is refused (a trace's top-k tables keep one width). Every RPC
    returns the Worker's plugin_seconds, which count the flush it asked for."""
    from tensordiff.recorders.vllm import control

    monkeypatch.setattr(STATE, "start_topk", None)
    monkeypatch.setattr(STATE, "seconds", 1.5)
    monkeypatch.setattr(STATE, "role", "record")
    resume, pause = control.rpc_method("tensordiff_resume"), control.rpc_method("tensordiff_pause")
    STATE.chain = {"v": []}
    out = resume(None, topk=0)
    assert STATE.cfg.topk == 0 and STATE.chain == {} and not STATE.paused
    assert out["topk"] == 0 and out["plugin_seconds"] == round(STATE.seconds, 6) and out["recording"]
    step = _step(torch.randn(7, H))
    verify.commit(step, np.array([[-1, -1, -1], [5, 5, -1]], dtype=np.int64))  # no top-k while off
    with pytest.raises(ValueError, match="only 0 or the start-up"):
        resume(None, topk=7)
    assert resume(None, topk=TOPK)["topk"] == TOPK
    step = _step(torch.randn(7, H))
    step.segments = [("q", 0, 4, 0, "q-1"), ("w", 4, 3, K, "w-1")]
    verify.commit(step, np.array([[-1, -1, -1], [5, 5, -1]], dtype=np.int64))
    before = STATE.seconds
    out = pause(None)
    assert STATE.paused and out["plugin_seconds"] > before  # the pause's flush wrote the staged rows, timed
    st.rec.close()
    got, _ = _read(st.path)
    tr = got[cv.TARGET_TOPK][0]
    assert list(tr) == list(range(6, 12))  # only the second step's kept rows (4 prefill, 2 verify)
    assert len(got[cv.SPEC_VERIFY][0]) == 2 and np.isnan(got[cv.SPEC_VERIFY][1][0, 5:]).all()


@pytest.mark.parametrize("same", [True, False], ids=["same_bits", "other_bits"])
def test_the_drafter_pass_maps_rows_checks_the_shift_and_stores_repeated_bits_once(st, monkeypatch, same):
    """drafter.record_draft as the propose hook runs it: draft row j on the target row of the same
    (request, position), the rejected draft's row dropped; the shift check against the next kept
    row's token, the next prompt token and the sampled token; draft_input rows that repeat the aux
    rows' bits refer to them (staging on), other bits are stored; draft_topk on the kept rows only."""
    import h5py

    from tensordiff.recorders.vllm import drafter

    g = torch.Generator().manual_seed(6)
    monkeypatch.setattr(STATE, "labels", ["layer1", "layer3"])
    monkeypatch.setattr(STATE, "raw_ids", [1, 3])
    monkeypatch.setattr(STATE, "draft_head", (_head(7, vocab=8), 8, None, None))
    step = _step(torch.randn(7, H, generator=g))
    step.aux = torch.randn(7, 2 * H, generator=g)
    verify.commit(step, np.array([[-1, -1, -1], [5, 5, -1]], dtype=np.int64))  # v: 1 draft accepted, row 6 dropped
    hs = step.aux.clone() if same else step.aux + 1
    # the drafter's ids: row t paired with the token at t+1 (p: prompt tokens 12..15; v: the
    # accepted draft 7, then the sampled 5); the last one is the rejected row's filler
    ids = np.array([12, 13, 14, 15, 7, 5, 99] if same else [12, 13, 14, 16, 7, 5, 99])
    ctx = {"hs": hs, "pos": torch.from_numpy(step.pos), "tok": None, "qsl": torch.tensor([0, 4, 7]), "ids": ids,
           "step": step, "fc": None, "outs": [torch.randn(7, H, generator=g), torch.randn(2, H, generator=g)],
           "sample": np.array([3, 5]), "aligned": True}
    drafter.record_draft(ctx)
    assert (STATE.shift_checked, STATE.shift_mismatched) == (6, 0 if same else 1)
    st.rec.close()
    got, info = _read(st.path)
    drows, dvals = got["draft_input"]
    np.testing.assert_array_equal(drows, np.arange(6))
    np.testing.assert_array_equal(dvals, hs[:6].numpy())
    np.testing.assert_array_equal(got[cv.DRAFT_TOPK][0], np.arange(6))
    np.testing.assert_array_equal(got["draft_input_ids"][1][:, 0], ids[:6])
    by_ref = info["draft_input"].values_source == "aux_hidden_states"
    with h5py.File(st.path) as f:
        refs = f["tensors/draft_input/values_ref"][()] if "values_ref" in f["tensors/draft_input"] else None
    if same and st.rec.stage_bytes:
        assert by_ref and (refs >= 0).all()
    else:
        assert refs is None or (refs < 0).all()


def _rows_and_next_tokens(step, rng, start, segs, pos):
    """A random step's target rows (about 30% not kept) and the next tokens it knows (70%)."""
    step.rows = np.arange(start, dtype=np.int64) + 10
    step.rows[rng.random(start) < 0.3] = -1
    for i, (key, *_) in enumerate(segs):
        if rng.random() < 0.7:
            step.next_tok[(key, int(pos[i][-1]) + 1)] = 77


@pytest.mark.parametrize("seed", range(6))
def test_draft_rows_of_a_whole_batch_equal_each_requests_own_mapping(seed):
    """drafter.draft_rows maps every request's draft rows at once; the per-request mapping
    (target_rows, which also handles positions that are not consecutive) is the reference: random
    batches of prefill chunks and verify segments, dropped rows, drafter rows outside the step,
    requests with no draft rows, and a request whose rows skip a position."""
    from tensordiff.recorders.vllm import drafter

    rng = np.random.default_rng(seed)
    segs, pos, ids, qsl_lens, dpos = [], [], [], [], []
    start = 0
    m = int(rng.integers(1, 6))
    for i in range(m):
        c = int(rng.integers(1, 6))
        p0 = int(rng.integers(0, 50))
        p = p0 + np.arange(c)
        if i == 2 and c > 2:
            p[2:] += 1  # a skipped position: the per-request path
        segs.append((f"r{i}", start, c, 0, f"r{i}-x"))
        pos.append(p)
        ids.append(rng.integers(0, 100, c))
        start += c
        n_d = int(rng.integers(0, c + 2))  # 0: no draft rows; c + 1: one past the step's rows
        qsl_lens.append(n_d)
        dpos.append(p0 + rng.integers(-1, c + 1, n_d))
    step = Step(1, segs, np.concatenate(pos), np.concatenate(ids), ["prefill"] * m, [100] * m, [None] * m)
    step.batch_idx = list(range(m))
    step.num_reqs = m
    _rows_and_next_tokens(step, rng, start, segs, pos)
    qsl = np.concatenate([[0], np.cumsum(qsl_lens)]).astype(np.int64)
    dp = np.concatenate(dpos).astype(np.int64) if dpos else np.zeros(0, np.int64)
    rows, want, owner = drafter.draft_rows(step, qsl, dp)
    for i, seg in enumerate(segs):
        a, z = qsl[i], qsl[i + 1]
        r, w = drafter.target_rows(step, seg, dp[a:z])
        np.testing.assert_array_equal(rows[a:z], r)
        np.testing.assert_array_equal(want[a:z], w)
        assert (owner[a:z] == i).all()


@pytest.mark.parametrize("seed", range(8))
def test_draft_rows_of_the_steps_own_layout_equal_each_requests_own_mapping(seed):
    """The drafter's usual batch: exactly the target step's rows (vLLM's padded drafter batch: the
    same requests, rows and positions, rejected drafts included), which draft_rows maps without a
    search; the per-request mapping is the reference, also where a request skips a position or
    repeats one (the searched path then), and where a request of the batch scheduled no rows."""
    from tensordiff.recorders.vllm import drafter

    rng = np.random.default_rng(100 + seed)
    segs, pos, ids, qsl_lens, batch_idx = [], [], [], [], []
    start = 0
    m = int(rng.integers(1, 7))
    bi = 0
    for i in range(m):
        if rng.random() < 0.2:
            qsl_lens.append(0)  # a request of the batch with no rows in this step
            bi += 1
        c = int(rng.integers(1, 6))
        p = int(rng.integers(0, 50)) + np.arange(c)
        if seed % 4 == 3 and i == 0 and c > 2:
            p[2:] += 1 if seed % 8 == 3 else -1  # a skipped (or repeated) position
        segs.append((f"r{i}", start, c, 2, f"r{i}-x"))
        pos.append(p)
        ids.append(rng.integers(0, 100, c))
        qsl_lens.append(c)
        batch_idx.append(bi)
        bi += 1
        start += c
    step = Step(1, segs, np.concatenate(pos), np.concatenate(ids), ["target_verify"] * m, [10] * m, [None] * m)
    step.batch_idx = batch_idx
    step.num_reqs = bi
    _rows_and_next_tokens(step, rng, start, segs, pos)
    qsl = np.concatenate([[0], np.cumsum(qsl_lens)]).astype(np.int64)
    dp = step.pos.copy()
    assert (drafter._same_layout(step, qsl, dp) is None) == (seed % 4 == 3 and segs[0][2] > 2)
    rows, want, owner = drafter.draft_rows(step, qsl, dp)
    for i, seg in enumerate(segs):
        a, z = qsl[batch_idx[i]], qsl[batch_idx[i] + 1]
        r, w = drafter.target_rows(step, seg, dp[a:z])
        np.testing.assert_array_equal(rows[a:z], r)
        np.testing.assert_array_equal(want[a:z], w)
        assert (owner[a:z] == i).all()


def _spread(x, id_map, vocab=V):
    """What an EAGLE-3 draft's compute_logits returns: its logits at the target ids, -inf elsewhere."""
    out = torch.full((x.shape[0], vocab), float("-inf"))
    out[:, id_map] = x
    return out


@pytest.mark.parametrize("tap", ["seen", "one_call_missing"])
def test_the_draft_tables_take_the_drafts_own_logits_where_vllm_computed_them(st, monkeypatch, tap):
    """The draft's compute_logits in propose (first call: the first pass's sampled rows; then one
    per decode step, spread over the target's vocabulary): draft_topk's sampled rows and every
    chain position come from them, the other kept rows from the plugin's product. A propose whose
    calls do not match its passes: every row from the product."""
    g = torch.Generator().manual_seed(9)
    step = _step(None)
    verify.commit(step, np.array([[-1, -1, -1], [5, 5, 5]], dtype=np.int64))
    dv = 8
    wd = torch.randn(dv, H, generator=g)
    id_map = torch.tensor([3, 3, 5, 10, 10, 20, 30, 41]) + torch.arange(dv)
    monkeypatch.setattr(STATE, "draft_head", (wd, dv, None, None))
    monkeypatch.setattr(STATE, "draft_id_map", id_map)
    n = 7
    h0, h1 = torch.randn(n + 1, H, generator=g), torch.randn(3, H, generator=g)
    sample = np.array([3, 6])
    # vLLM's logits, shifted per row so that a table shows its source (log-probs do not move)
    l0 = h0[sample] @ wd.T + torch.tensor([[1.5], [2.5]])
    l1 = h1[:2] @ wd.T + 3.5
    taps = [pr._draft_columns(_spread(l0, id_map)), pr._draft_columns(_spread(l1, id_map))]
    torch.testing.assert_close(taps[0], l0)
    if tap == "one_call_missing":
        taps = taps[:1]
    ctx = {"fc": None, "outs": [h0, h1], "sample": sample, "aligned": True, "step": step, "logits": taps}
    pr.record_draft_predictions(ctx, step.rows.copy(), n, ["p", "v"])
    reused = tap == "seen"
    want0 = (h0[:n] @ wd.T).clone()
    if reused:
        want0[torch.as_tensor(sample)] = l0
    want1 = l1 if reused else h1[:2] @ wd.T
    v0, v1 = STATE.chain["v"]
    np.testing.assert_allclose(v0[0].table[v0[1]][2 * TOPK], torch.logsumexp(want0[6].double(), -1).item(), rtol=1e-6)
    np.testing.assert_allclose(v1[0].table[v1[1]][2 * TOPK], torch.logsumexp(want1[1].double(), -1).item(), rtol=1e-6)
    assert (STATE.logits_reused > 0) == reused
    st.rec.close()
    got, _ = _read(st.path)
    drows, dvals = got[cv.DRAFT_TOPK]
    np.testing.assert_array_equal(drows, np.arange(n))
    np.testing.assert_array_equal(dvals[:, :TOPK], id_map[torch.topk(want0, TOPK, -1).indices].numpy())
    np.testing.assert_allclose(dvals[:, 2 * TOPK], torch.logsumexp(want0.double(), -1).numpy(), rtol=1e-6)


def test_the_draft_compute_logits_tap_copies_only_inside_a_propose_with_predictions_on(st, monkeypatch):
    """The draft's tap: each call's logits (its d2t columns) while a propose records; nothing outside
    one, nor with predictions off (collective_rpc resume with topk=0)."""
    wd = _head(4, vocab=8)
    id_map = torch.tensor([3, 3, 5, 10, 10, 20, 30, 41]) + torch.arange(8)
    monkeypatch.setattr(STATE, "draft_head", (wd, 8, None, None))
    monkeypatch.setattr(STATE, "draft_id_map", id_map)

    class Draft:
        def compute_logits(self, h):
            return _spread(h @ wd.T, id_map)

    d = Draft()
    pr.InstancePatch(d, "compute_logits", pr._draft_logits_tap(d.compute_logits))
    h = torch.randn(3, H)
    monkeypatch.setattr(STATE, "draft_ctx", None)
    d.compute_logits(h)  # outside a propose
    ctx = {"logits": []}
    monkeypatch.setattr(STATE, "draft_ctx", ctx)
    d.compute_logits(h)
    torch.testing.assert_close(ctx["logits"][0], h @ wd.T)
    monkeypatch.setattr(STATE.cfg, "topk", 0)
    d.compute_logits(h)
    assert len(ctx["logits"]) == 1


def _reference_commit_rows(step, sampled, rec):
    """The kept rows of a step as the plugin decided them request by request (one add_tokens
    each): the reference for verify.commit's one pass over the whole step."""
    T = len(step.pos)
    rows = np.full(T, -1, dtype=np.int64)
    spec, next_tok, sampled_rows, dropped = [], {}, [], 0
    for i, ((key, s, c, n_spec, _), regime) in enumerate(zip(step.segments, step.regimes)):
        keep = np.arange(s, s + c)
        bi = step.batch_idx[i]
        got = sampled[bi][sampled[bi] >= 0] if sampled is not None and bi < sampled.shape[0] else None
        if n_spec and regime == "target_verify":
            if got is not None:
                keep = keep[:max(1, len(got))]
                spec.append((key, s, n_spec, min(max(len(got) - 1, 0), n_spec)))
            else:
                keep = keep[:1]
        lim = step.limits[i]
        cut = False
        if lim is not None:
            within = step.pos[keep] < lim
            cut = not within.all()
            keep = keep[within]
        dropped += c - len(keep)
        if len(keep):
            rows[keep] = rec.add_tokens(key, step.pos[keep], step.ids[keep], regime=regime, step=step.step)
            last = int(step.pos[keep[-1]]) + 1
            if last < step.prompt_lens[i]:
                ids = step.prompts.get(i)
                if ids is not None and last < len(ids):
                    next_tok[(key, last)] = int(ids[last])
            elif got is not None and len(got) and not cut:
                next_tok[(key, last)] = int(got[-1])
                if regime != "target_verify":
                    sampled_rows.append((i, int(rows[keep[-1]]), int(got[0])))
    return rows, spec, next_tok, sampled_rows, dropped


@pytest.mark.parametrize("seed", range(10))
def test_commit_keeps_the_rows_each_request_keeps(st, monkeypatch, seed):
    """verify.commit decides every request's kept rows of a step at once: the same rows, token
    table, verify segments, next tokens and sampled rows as request by request, on random steps
    of prefill chunks, decodes and verify segments with accepted and rejected drafts, rows past
    max_tokens, requests the sampler gave no row and steps whose sampling was not seen."""
    rng = np.random.default_rng(seed)
    segs, pos, ids, regimes, plens, limits, bidx, prompts = [], [], [], [], [], [], [], {}
    start = 0
    bi = 0
    for i in range(int(rng.integers(1, 7))):
        bi += int(rng.random() < 0.2)  # a request of the batch with no rows in this step
        kind = rng.choice(["prefill", "decode", "target_verify"])
        plen = int(rng.integers(5, 30))
        if kind == "prefill":
            c = int(rng.integers(1, 8))
            p0 = int(rng.integers(0, plen))
            n_spec = 0
        else:
            n_spec = K if kind == "target_verify" else 0
            c = n_spec + 1
            p0 = plen + int(rng.integers(0, 10))
        p = p0 + np.arange(c)
        segs.append((f"r{i}", start, c, n_spec, f"r{i}-x"))
        pos.append(p)
        ids.append(rng.integers(0, V, c))
        regimes.append(str(kind))
        plens.append(plen)
        limits.append(plen + int(rng.integers(1, 15)) if rng.random() < 0.6 else None)
        bidx.append(bi)
        if kind == "prefill" and rng.random() < 0.8:
            prompts[i] = list(rng.integers(0, V, plen))
        bi += 1
        start += c

    def make():
        s = Step(3, list(segs), np.concatenate(pos), np.concatenate(ids), list(regimes), list(plens), list(limits))
        s.batch_idx, s.num_reqs, s.prompts = list(bidx), bi, dict(prompts)
        return s

    if seed % 5 == 4:
        sampled = None
    else:
        sampled = np.full((bi - int(rng.random() < 0.3), K + 1), -1, dtype=np.int64)  # maybe one row short
        for r in range(len(sampled)):
            n = int(rng.integers(0, K + 2))
            sampled[r, :n] = rng.integers(0, V, n)
    got_spec = []
    monkeypatch.setattr(verify, "commit_predictions", lambda step, spec, unseen=False: got_spec.append(spec))
    ref_rec = Recorder(st.path.with_name("ref.h5"), side="serve", model={"num_layers": 4, "hidden_size": H})
    want_rows, want_spec, want_next, want_sampled, want_dropped = _reference_commit_rows(make(), sampled, ref_rec)
    ref_rec.close()
    step = make()
    verify.commit(step, sampled)
    np.testing.assert_array_equal(step.rows, want_rows)
    assert got_spec == [[v for v in want_spec if want_rows[v[1]] >= 0]]
    assert step.next_tok == want_next
    assert step.sampled == want_sampled
    assert STATE.rows_dropped == want_dropped
    assert STATE.rows_written == int((want_rows >= 0).sum())
    st.rec.close()
    with TraceReader(str(st.path)) as a, TraceReader(str(st.path.with_name("ref.h5"))) as b:
        for col in ("seq", "position", "token", "regime", "step"):
            np.testing.assert_array_equal(np.asarray(a.tokens[col]), np.asarray(b.tokens[col]))


def _steps_through_hook_sample(path, queue, monkeypatch, stage_bytes):
    """Three target steps sampled through verify.hook_sample, the plugin's records made in the
    hook (queue 0) or deferred (queue 16) until the flush; returns what the queue held after the
    last hook."""
    from tensordiff.recorders.vllm.rl import RL

    rec = Recorder(path, side="serve", model={"num_layers": 4, "hidden_size": H}, stage_bytes=stage_bytes)
    monkeypatch.setattr(STATE, "rec", rec)
    monkeypatch.setattr(STATE, "queue_steps", queue)
    monkeypatch.setattr(STATE, "queue", [])
    monkeypatch.setattr(STATE, "queue_bytes", 0)
    monkeypatch.setattr(STATE, "rows_written", 0)
    monkeypatch.setattr(STATE, "chain", {})
    monkeypatch.setattr(RL, "enabled", True)
    g = torch.Generator().manual_seed(7)
    held = None
    for i in range(3):
        step = _step(torch.randn(7, H, generator=g))
        step.step = i + 1
        step.pos = step.pos + 10 * i
        step.limits = [None, 23 + 10 * i + i % 2]  # the last steps' verify rows cut by max_tokens
        at = torch.tensor([3, 4, 5, 6])  # the sampler's rows: p's last, v's three
        if i:  # vLLM's own logits of those rows (offset: each table shows its source)
            step.logits = (step.hidden[at] @ STATE.target_head[0].T + 0.5).contiguous()
        STATE.pending = step
        out = SimpleNamespace(sampled_token_ids=torch.tensor([[9, -1, -1], [7, 9, 5]][: 2 - (i == 2)]),
                              logprobs_tensors=None)
        verify.hook_sample(out, None, spec_decode_metadata=SimpleNamespace(logits_indices=at))
        held = len(STATE.queue)
        at.fill_(0)  # the engine fills its buffers again for the next step
        out.sampled_token_ids.fill_(-1)  # (a sampler output read late would keep one row of each verify)
    written_before = STATE.rows_written
    STATE.flush(force=True)
    rec.close()
    return held, written_before


@pytest.mark.parametrize("stage_bytes", [0, 1 << 20], ids=["at_once", "staged"])
def test_deferred_step_records_are_the_records_made_in_the_hook(tmp_path, monkeypatch, st, stage_bytes):
    """On the CPU the records of a step are made with the next steps' (State.defer, every
    TENSORDIFF_VLLM_QUEUE steps and at a flush): the same trace, bit for bit, as each step's
    records made in its hook; until then nothing of those steps is written."""
    a, b = tmp_path / "now.h5", tmp_path / "later.h5"
    held_now, written_now = _steps_through_hook_sample(a, 0, monkeypatch, stage_bytes)
    held_later, written_later = _steps_through_hook_sample(b, 16, monkeypatch, stage_bytes)
    assert held_now == 0 and written_now > 0
    assert held_later == 3 and written_later == 0
    ga, ia = _read(a)
    gb, ib = _read(b)
    assert sorted(ga) == sorted(gb) and {cv.TARGET_TOPK, cv.SPEC_VERIFY} <= set(ga)
    for name in ga:
        np.testing.assert_array_equal(ga[name][0], gb[name][0])
        assert ga[name][1].tobytes() == gb[name][1].tobytes(), name
    with TraceReader(str(a)) as x, TraceReader(str(b)) as y:
        assert x.tokens.tobytes() == y.tokens.tobytes()


def test_the_queue_is_made_in_order_and_a_step_with_sampled_log_probs_is_recorded_now(monkeypatch):
    """State.defer keeps the records in order and says when the queue is full (its steps or its
    bytes); run_queue makes them all; a failure empties it. A step is deferred only on the CPU
    and where no sampled log-probs are to be read from its sampler output."""
    from tensordiff.recorders.vllm import state as state_mod
    from tensordiff.recorders.vllm.rl import RL

    monkeypatch.setattr(STATE, "queue", [])
    monkeypatch.setattr(STATE, "queue_bytes", 0)
    monkeypatch.setattr(STATE, "queue_steps", 2)
    monkeypatch.setattr(STATE, "broken", False)
    done = []
    STATE.defer(lambda: done.append("a"), 10, step=True)
    STATE.defer(lambda: done.append("draft"))
    assert not STATE.queue_full()
    STATE.defer(lambda: done.append("b"), 10, step=True)
    assert STATE.queue_full()
    STATE.run_queue()
    assert done == ["a", "draft", "b"] and STATE.queue == [] and STATE.queue_bytes == 0
    STATE.defer(lambda: done.append("big"), state_mod.QUEUE_BYTES, step=True)
    assert STATE.queue_full()
    monkeypatch.setattr(STATE, "queue", [])
    step = _step(torch.zeros(7, H))
    monkeypatch.setattr(RL, "enabled", True)
    assert verify.deferrable(step, SimpleNamespace(logprobs_tensors=None))
    assert not verify.deferrable(step, SimpleNamespace(logprobs_tensors=object()))
    monkeypatch.setattr(RL, "enabled", False)
    assert verify.deferrable(step, SimpleNamespace(logprobs_tensors=object()))
    step.hidden = SimpleNamespace(device=SimpleNamespace(type="cuda"))
    assert not verify.deferrable(step, SimpleNamespace(logprobs_tensors=None))
    monkeypatch.setattr(STATE, "queue_steps", 1)
    assert not verify.deferrable(_step(torch.zeros(7, H)), SimpleNamespace(logprobs_tensors=None))


@pytest.mark.parametrize("value, want", [("", 16), ("0", 0), ("4", 4), ("-1", 16), ("many", 16)])
def test_the_queue_length_comes_from_the_environment(monkeypatch, value, want):
    from tensordiff.recorders.vllm.state import ENV_QUEUE, queue_steps_from_env

    monkeypatch.setenv(ENV_QUEUE, value)
    assert queue_steps_from_env() == want


def _steps_with_draft_passes(path, queue: bool, monkeypatch, stage_bytes, *, steps: int = 4, drain_every: int = 0,
                             writer_kwargs: dict | None = None):
    """Four target steps (or ``steps``), each followed by its drafter pass (draft_input with the
    aux rows' bits, fc output, the first pass and one decode step, the chain of the next verify),
    recorded as the hooks record them with the queue off (each record now) or on (every record
    queued, then the queue made in its phases, every ``drain_every`` steps or at the end);
    returns the order the queue ran its phases in."""
    from tensordiff.recorders.vllm import drafter

    rec = Recorder(path, side="serve", model={"num_layers": 4, "hidden_size": H}, stage_bytes=stage_bytes,
                   writer_kwargs=writer_kwargs)
    for name, value in (("rec", rec), ("queue", []), ("queue_bytes", 0), ("rows_written", 0), ("rows_dropped", 0),
                        ("chain", {}), ("chain_step", None), ("labels", ["layer1", "layer3"]), ("raw_ids", [1, 3]),
                        ("draft_head", (_head(7, vocab=8), 8, None, None)), ("draft_id_map", None),
                        ("shift_checked", 0), ("shift_mismatched", 0), ("verify_steps", 0), ("spec_k", None)):
        monkeypatch.setattr(STATE, name, value)
    g = torch.Generator().manual_seed(11)
    order = []

    def spied(fns, what):  # each phase's callable, noting (phase, record) when it runs
        return tuple(None if f is None else (lambda f=f, p=p: (order.append((p, what)), f())[1])
                     for p, f in enumerate(fns))

    samples = [[[9, -1, -1], [7, 9, 5]], [[9, -1, -1], [7, -1, -1]], [[9, -1, -1], [7, 9, -1]], [[9, -1, -1], [7, 9, 5]]]
    for i in range(steps):
        sampled = samples[i % len(samples)]
        step = _step(torch.randn(7, H, generator=g))
        step.step = i + 1
        step.pos = step.pos + 10 * i
        step.aux = torch.randn(7, 2 * H, generator=g)
        sampled = np.array(sampled, dtype=np.int64)
        if queue:
            STATE.last = step
            STATE.defer(spied(verify.commit_phases(step, sampled), f"step{i}"), step=True)
        else:
            verify.commit(step, sampled)
        ctx = {"hs": step.aux.clone(), "pos": torch.from_numpy(step.pos.copy()), "tok": None,
               "qsl": torch.tensor([0, 4, 7]), "ids": np.array([12, 13, 14, 15, 7, 9, 5]) + 0, "step": step,
               "fc": torch.randn(7, H, generator=g), "outs": [torch.randn(7, H, generator=g),
                                                             torch.randn(2, H, generator=g)],
               "sample": np.array([3, 6]), "aligned": True, "logits": []}
        if queue:
            STATE.defer(spied((None, None, drafter._spend_chains), f"spend{i}"))
            drafter.hold_draft_inputs(ctx)
            STATE.defer(spied(drafter.draft_phases(ctx), f"draft{i}"))
        else:
            drafter._spend_chains()
            drafter.record_draft(ctx)
        if queue and drain_every and (i + 1) % drain_every == 0:
            STATE.run_queue()
    STATE.run_queue()
    rec.close()
    return order


@pytest.mark.parametrize("stage_bytes", [0, 1 << 20], ids=["at_once", "staged"])
def test_queued_steps_and_draft_passes_made_phase_by_phase_are_the_records_made_at_once(tmp_path, monkeypatch, st,
                                                                                        stage_bytes):
    """The queue makes its records phase by phase (every queued step's token rows, then every
    step's and draft pass's states, then the predictions with the draft chains, each phase in
    order): the same trace, bit for bit, as each record made in its hook, with draft_input still
    stored by reference to the aux rows and each verify step's spec_chain from the propose before
    it."""
    import h5py

    a, b = tmp_path / "now.h5", tmp_path / "queued.h5"
    assert _steps_with_draft_passes(a, False, monkeypatch, stage_bytes) == []
    order = _steps_with_draft_passes(b, True, monkeypatch, stage_bytes)
    assert [p for p, _ in order] == sorted(p for p, _ in order)  # phase by phase
    assert [w for p, w in order if p == 0] == [f"step{i}" for i in range(4)]
    assert [w for p, w in order if p == 1] == [w for i in range(4) for w in (f"step{i}", f"draft{i}")]
    assert [w for p, w in order if p == 2] == [w for i in range(4) for w in (f"step{i}", f"spend{i}", f"draft{i}")]
    ga, ia = _read(a)
    gb, ib = _read(b)
    assert sorted(ga) == sorted(gb)
    assert {cv.TARGET_TOPK, cv.SPEC_VERIFY, cv.SPEC_CHAIN, cv.DRAFT_TOPK, cv.DRAFT_FC, "draft_input",
            "aux_hidden_states"} <= set(ga)
    assert len(ga[cv.SPEC_CHAIN][0]) == 3  # the verify steps after a propose
    for name in ga:
        np.testing.assert_array_equal(ga[name][0], gb[name][0])
        assert ga[name][1].tobytes() == gb[name][1].tobytes(), name
    with TraceReader(str(a)) as x, TraceReader(str(b)) as y:
        assert x.tokens.tobytes() == y.tokens.tobytes()
        for name in ga:
            assert x.read_rms(name).tobytes() == y.read_rms(name).tobytes(), name
    refs = []
    for p in (a, b):
        with h5py.File(p) as f:
            g = f["tensors/draft_input"]
            refs.append(g["values_ref"][()] if "values_ref" in g else None)
    if stage_bytes:
        assert refs[0] is not None and (refs[0] >= 0).all() and np.array_equal(refs[0], refs[1])


@pytest.mark.parametrize("flush_rows", [4, 10, 17, 40])
@pytest.mark.parametrize("queue", [False, True], ids=["now", "queued"])
@pytest.mark.parametrize("stage_bytes", [0, 1 << 20], ids=["at_once", "staged"])
def test_every_flush_commits_whole_steps_when_the_queue_adds_many_steps_token_rows_first(tmp_path, monkeypatch, st,
                                                                                        stage_bytes, queue,
                                                                                        flush_rows):
    """What every flush commits is whole steps (each tensor's rows of exactly the committed token
    rows): with a flush trigger reached while the queue adds its steps' token rows (its first
    phase) or between the two regimes of one step's token rows (prefill, then verify), staged or
    not, and tokens alone twice past a trigger inside the queue (4 rows). The trace is the same
    bits either way."""
    from tensordiff.trace import TraceReader

    states = []

    def on_flush(w):
        states.append((w.flushed["tokens"], dict(w.flushed["tensors"])))

    path = tmp_path / ("queued.h5" if queue else "now.h5")
    _steps_with_draft_passes(path, queue, monkeypatch, stage_bytes, steps=16, drain_every=3,
                             writer_kwargs={"flush_rows": flush_rows, "flush_seconds": None, "on_flush": on_flush})
    with TraceReader(str(path)) as r:
        n_all = len(r.tokens)
        rows = {name: r.token_rows(name) for name in r.tensors}
    inside = [(n, c) for n, c in states if 0 < n < n_all]
    assert inside   # flushes fell between the first and the last step
    for n_tok, counts in inside:
        for name, idx in rows.items():
            assert counts.get(name, 0) == int((idx < n_tok).sum()), (n_tok, name)
    other = tmp_path / ("now.h5" if queue else "queued.h5")
    _steps_with_draft_passes(other, not queue, monkeypatch, stage_bytes, steps=16, drain_every=3)
    ga, gb = _read(path), _read(other)
    assert sorted(ga[0]) == sorted(gb[0])
    for name in ga[0]:
        assert ga[0][name][1].tobytes() == gb[0][name][1].tobytes(), name


def test_the_draft_columns_of_a_whole_vocabulary_draft_and_a_verify_rows_logits_are_the_same_bits(monkeypatch):
    """The numpy paths on the CPU (a draft whose d2t is every column in order: a plain copy; the
    logit of each draft token: numpy's indexing) give the bits the general paths give, and the
    copy is the draft's own."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4, 8, generator=g)
    x[0, 3] = float("nan")
    x[1, 2] = -0.0
    monkeypatch.setattr(STATE, "draft_head", (torch.zeros(8, H), 8, None, None))
    monkeypatch.setattr(STATE, "draft_cols", None)
    for cols in (torch.arange(8), torch.tensor([0, 1, 2, 3, 4, 5, 7, 6])):
        monkeypatch.setattr(STATE, "draft_id_map", cols)
        got = pr._draft_columns(x)
        want = x.index_select(1, cols)
        assert got.numpy().tobytes() == want.numpy().tobytes() and got.data_ptr() != x.data_ptr()
        assert STATE.draft_cols[3] == bool((cols == torch.arange(8)).all())
    at, tok = np.array([0, 1, 2, 3, 0]), np.array([3, 2, 7, 0, 0])
    want = x[torch.from_numpy(at), torch.from_numpy(tok)].to(torch.float64).numpy()
    assert pr._logits_of(x, at, tok).tobytes() == want.tobytes()


@pytest.mark.parametrize("seed", range(6))
def test_a_pass_tables_refs_of_many_rows_are_each_rows_own_ref(seed):
    """PassTable.refs (one search for a drafter batch's sampled rows) equals ref row by row: rows
    computed, rows not, every row computed (need None), and no row computed."""
    from tensordiff.recorders.prediction_tables import PassTable

    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 30))
    need = None if seed == 0 else np.flatnonzero(rng.random(n) < (0.0 if seed == 1 else 0.6)).astype(np.int64)
    table = PassTable(object(), n, need)
    rs = rng.integers(0, n, int(rng.integers(1, 10))).astype(np.int64)
    assert table.refs(rs) == [table.ref(r) for r in rs.tolist()]


@pytest.mark.parametrize("seed", range(5))
def test_a_chains_draft_rows_taken_per_position_are_the_rows_stacked_one_by_one(seed):
    """chain_draft_rows (one index per draft position whose rows share a job) gives the bits of
    stacking every (job, row) of every chain one by one, where a position mixes jobs too."""
    from tensordiff.recorders.prediction_tables import chain_draft_rows

    rng = np.random.default_rng(seed)
    k, dw, m = 2, 2 * TOPK + 1, int(rng.integers(1, 9))
    jobs = [SimpleNamespace(table=rng.standard_normal((12, dw))) for _ in range(3)]
    jobs[0].table[0, 1] = np.nan
    chains = []
    for _ in range(m):
        first = jobs[int(rng.integers(0, 2))] if seed % 2 else jobs[0]  # position 0: one job, or two
        chains.append([(first, int(rng.integers(0, 12))), (jobs[2], int(rng.integers(0, 12)))])
    want = np.stack([np.stack([job.table[i] for job, i in ch]) for ch in chains]).reshape(m, -1)
    assert chain_draft_rows(chains, k, dw).tobytes() == want.tobytes()


class _Clock:
    """A fake ``time.perf_counter``: one second per reading, plus what ``spend`` adds."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        self.now += 1.0
        return self.now

    def spend(self, seconds):
        self.now += seconds


def test_the_drafter_hooks_count_their_own_time_and_not_the_engines(st, monkeypatch):
    """plugin_seconds is the plugin's whole time: the propose hook's set-up before vLLM's call and
    set_inputs_first_pass's copies count; the drafter's own run inside the hook does not."""
    import time as _time

    from tensordiff.recorders.vllm import drafter

    clock = _Clock()
    monkeypatch.setattr(_time, "perf_counter", clock)
    monkeypatch.setattr(STATE, "last", _step(torch.randn(7, H)))
    monkeypatch.setattr(STATE, "labels", ["layer1", "layer2", "layer3"])
    monkeypatch.setattr(STATE, "queue", [])
    monkeypatch.setattr(STATE, "queue_steps", 16)   # the pass is queued, not made here
    monkeypatch.setattr(STATE, "draft_ctx", None)

    def propose(proposer, target_hidden_states=None, common_attn_metadata=None):
        clock.spend(100.0)   # the engine's drafting
        return "drafted"

    before = STATE.seconds
    assert drafter.hook_propose(propose, object(), target_hidden_states=None, common_attn_metadata=None) == "drafted"
    assert STATE.seconds - before == 1.0   # its set-up (two readings), nothing of the engine's 100 s

    ctx = {"seen": False}
    monkeypatch.setattr(STATE, "draft_ctx", ctx)
    proposer = SimpleNamespace(input_ids=torch.arange(16), needs_extra_input_slots=False)
    before = STATE.seconds
    drafter.hook_set_inputs_first_pass((5, torch.tensor([1, 4])), proposer)
    assert STATE.seconds - before == 1.0
    assert ctx["ids"].tolist() == [0, 1, 2, 3, 4] and ctx["sample"].tolist() == [1, 4] and ctx["aligned"]
    drafter.hook_set_inputs_first_pass((5, None), proposer)   # a later pass of the same propose: nothing
    assert STATE.seconds - before == 1.0
