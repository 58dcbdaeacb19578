"""Forward capture: AROUND ``ModelRunner.forward``, on the target runner and the draft runner.

Target runner: the token key of every row of the pass (request id, absolute position, token id,
regime from the forward mode) and the packed aux hidden states the logits processor returns
(``logits_output.hidden_states``) as ``aux_hidden_states``. Prefill chunks and radix-cache hits
are keyed by the absolute positions SGLang computes (``forward_batch.positions``), so they need
nothing special. Target-verify passes are held back until the verify result says how many rows
each request accepted (:mod:`.verify`).

Draft runner, draft-extend passes: the exact ``forward_batch.spec_info.hidden_states`` the draft's
``fc`` consumes, as ``draft_input``, keyed by the target rows it came from (draft row t holds the
target's state at position t and is paired with the input id of token t+1: ``token_offset=1``),
and those shifted input ids as ``draft_input_ids``. Rows past a request's accept length are filler
and are dropped.
"""

from __future__ import annotations

from ...conventions import DRAFT_TOPK, TARGET_TOPK
from .. import serving
from ..serving import record_draft_ids
from .batch import same_tensor, to_numpy
from .config import AUX, DRAFT, DRAFT_IDS
from .predictions import (
    chain_start,
    chain_step,
    prediction_rows,
    record_fc,
    record_topk,
)
from .rl import note_rows
from .state import STATE, Pass



def hook_forward(original, runner, forward_batch, *args, **kwargs):
    """Around ``ModelRunner.forward``: capture the pass (:mod:`.capture`) and record it, now or
    when the queue of captured passes is replayed."""
    st = STATE
    if not st.active or forward_batch.forward_mode.is_idle():
        return original(runner, forward_batch, *args, **kwargs)
    import numpy as np

    from .capture import capture_draft, capture_keys, capture_target, copying

    if getattr(runner, "is_draft_worker", False):
        st.fc_out = st.draft_logits = None
        out = original(runner, forward_batch, *args, **kwargs)
        t0 = st.begin()
        try:
            copy = copying(forward_batch.input_ids)
            snap = capture_draft(forward_batch, copy)
            if snap is not None:
                st.later(replay_draft, snap, copy)
        except Exception as e:  # noqa: BLE001
            st.fail("draft pass", e)
        st.fc_out = st.draft_logits = None
        st.end(t0)
        return out
    t0 = st.begin()
    keys = pre = None
    copy = False
    try:
        keys = st.ctx_keys = capture_keys(runner, forward_batch)
        if keys is None:  # not recorded: no draft extend may be matched with an older pass
            st.cap_aux, st.cap_verify_seq = (None, None, None), None
        else:
            copy = copying(forward_batch.input_ids)
            if copy:  # catalog taps during the forward: kept until the pass is recorded
                st.ctx_rows = np.full(len(keys.ids), -1, dtype=np.int64)
                st.ctx_stash = keys.stash
            else:  # recorded in its hooks, as always: its rows now (a verify pass's stay -1)
                pre = start_pass(keys)
                st.ctx_rows = pre.rows
                st.ctx_stash = pre.stash if pre.regime == "target_verify" else None
    except Exception as e:  # noqa: BLE001
        st.fail("target pass", e)
        keys = None
    finally:
        st.end(t0)
    st.target_logits = None
    try:
        out = original(runner, forward_batch, *args, **kwargs)
    finally:
        st.ctx_rows = None
        st.ctx_stash = None
        st.ctx_keys = None
    t0 = st.begin()
    if keys is not None and st.active:
        try:
            snap = capture_target(forward_batch, out, keys, copy)
            if copy:
                st.later(replay_target, snap, True)
            else:
                st.later(lambda s: _finish_target(s, pre), snap, False)
        except Exception as e:  # noqa: BLE001
            st.fail("target pass", e)
    st.target_logits = None
    st.end(t0)
    return out


def start_pass(keys) -> Pass:
    """The pass of captured keys: its token rows added now, except a verify pass's (added once
    the verify result says which rows stay); the catalog values its forward stashed (a snapshotted
    pass's) recorded once its rows are known."""
    import numpy as np

    from .catalog import record_catalog

    st = STATE
    n = len(keys.ids)
    rid_rows = np.empty(n, dtype=object)
    for rid, s, c in keys.segs:
        rid_rows[s:s + c] = rid
    p = Pass(hs=None, rows=np.full(n, -1, dtype=np.int64), keys=(rid_rows, keys.pos, keys.ids), segments=keys.segs,
             step=keys.step, regime=keys.regime, stash=keys.stash, private=keys.private, seq=keys.seq)
    if keys.regime != "target_verify":
        p.rows[:] = st.rec.add_token_runs([rid for rid, _, _ in keys.segs], [c for _, _, c in keys.segs], keys.pos,
                                          keys.ids, regime=keys.regime, step=keys.step)
        p.committed = True
        st.dirty = True
        for kind, b, value in p.stash:
            record_catalog(kind, b, value, p.rows, private=p.private)
        p.stash = []
        note_rows(p)
    return p


def replay_target(snap) -> None:
    """Record a snapshotted target pass (:func:`.capture.capture_target`)."""
    _finish_target(snap, start_pass(snap.keys))


def _finish_target(snap, p: Pass) -> None:
    STATE.target_logits = snap.logits
    after_target(snap.keys.mode, snap, p)


def replay_draft(snap) -> None:
    """Record a captured draft pass (:func:`.capture.capture_draft`)."""
    st = STATE
    st.fc_out, st.draft_logits = snap.fc_out, snap.draft_logits
    try:
        record_draft(None, snap)
    finally:
        st.fc_out = st.draft_logits = None


def after_target(mode: str, out, p: Pass) -> None:
    """A target pass after its forward: its aux hidden states (``out.logits_output``), its top-k
    predictions; a verify pass waits for its verify result, the others are recorded."""
    st = STATE
    if getattr(out, "can_run_graph", False):
        st.graph_passes += 1
        if st.cfg.catalog:
            st.warn_once("graph-pass", "a %s pass ran as a CUDA graph: the catalog taps did not see it "
                         "(aux_hidden_states and draft_input are still recorded)", mode)
    lo = getattr(out, "logits_output", None)
    hs = getattr(lo, "hidden_states", None) if lo is not None else None
    if st.labels is not None:
        if hs is None:
            st.warn_once("no-aux", "a %s pass returned no aux hidden states (was --return-hidden-states-mode "
                         "changed?); its rows have token keys only", mode)
        elif hs.shape[0] != len(p.rows):
            st.warn_once("aux-rows", "aux hidden states have %d rows for %d tokens; not recorded",
                         hs.shape[0], len(p.rows))
            hs = None
        else:
            p.hs = hs
    st.last_target = p
    if st.cfg.topk > 0:
        _target_predictions(p)
    if p.regime == "target_verify":
        st.pending_verify = p
        return
    if p.hs is not None:
        record_aux(p.hs, p.rows, p.private)
    if p.pred is not None:
        record_topk(TARGET_TOPK, p.pred, p.rows, 0, "target logits (logits processor)")


def _target_predictions(p: Pass) -> None:
    """Top-k rows of the target's logits for the rows of the pass the recorder keeps (every row of
    a verify pass: which are kept is known only after the verify); on a verify pass also the
    logit the target gives each row's next input token (the draft token it verifies; its log-prob
    is that minus the row's logsumexp, taken when the step's row is written)."""
    import numpy as np
    import torch

    from .predictions import kept_rows

    st = STATE
    cap, st.target_logits = st.target_logits, None
    verify = p.regime == "target_verify"
    need = None if verify else kept_rows(p.rows)
    p.pred, logits = prediction_rows(cap, len(p.rows), TARGET_TOPK, need=need)
    if p.pred is None or logits is None or not verify:
        return
    ids = p.keys[2]
    n = len(ids)
    nxt = np.zeros(n, dtype=np.int64)
    nxt[:-1] = ids[1:]  # within a block, row j's next input is the draft token at row j + 1
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        g = logits.detach().numpy()[np.arange(n), nxt]  # numpy: no torch op (and no thread pool) for n values
    else:
        with torch.no_grad():
            sel = torch.from_numpy(nxt).to(logits.device)[:, None]
            g = logits.gather(1, sel)[:, 0].float().cpu().numpy()
    p.logit_next = g.astype(np.float64)


def record_aux(hs, rows, private: bool = False) -> None:
    """``aux_hidden_states`` rows (``private``: ``hs`` is a snapshot's copy, kept as it is)."""
    st = STATE
    width = hs.shape[-1]
    k = len(st.labels)
    h = st.model.get("hidden_size") or 0
    if k * h != width:
        st.warn_once("aux-width", "aux hidden states are %d wide, not %d slots x %d; not recorded", width, k, h)
        return
    serving.packed(st.rec, AUX, hs, rows, labels=st.labels, raw_ids=st.raw_ids, convention=st.convention,
                  token_offset=0, role="aux", values=st.cfg.wants_values(AUX), remember=True, private=private,
                  attrs={"source": "logits_output.hidden_states (target, packed aux capture)"})
    st.dirty = True


def record_draft(runner, fb) -> None:
    """A draft pass (``fb``: the engine's forward batch, or its snapshot; ``runner`` unused)."""
    import numpy as np

    st = STATE
    mode = fb.forward_mode
    if not (mode.is_extend() or mode.is_draft_extend_v2()) or mode.is_target_verify():
        if not mode.is_target_verify():
            chain_step(fb)  # a draft decode step: the draft's distribution at the next draft position
        return  # draft decode steps feed the draft its own state, not the target's
    spec = getattr(fb, "spec_info", None)
    hs = getattr(spec, "hidden_states", None)
    if hs is None or st.labels is None:
        return
    h = st.model.get("hidden_size") or 0
    if hs.shape[-1] != len(st.labels) * h:
        return  # not the target's packed aux states
    p = st.last_target
    if getattr(fb, "tensordiff_private", False):  # a snapshot: matched at capture (copies cannot tell)
        matched = bool(getattr(fb, "tensordiff_matched", False))
    else:
        matched = p is not None and p.hs is not None and same_tensor(hs, p.hs)
    seq = getattr(fb, "tensordiff_seq", None)
    if seq is not None and (p is None or p.seq != seq):
        matched = False  # fed the states of another pass than the last one recorded
    if p is None or p.hs is None or not matched or not p.committed:
        st.draft_unmatched += 1
        st.warn_once("draft-unmatched", "a draft-extend pass whose hidden states are not the last target pass's; "
                     "not recorded")
        return
    rows = p.rows.copy()
    ids = to_numpy(fb.input_ids).astype(np.int64)
    if len(ids) != len(rows):
        st.warn_once("draft-rows", "draft pass has %d input ids for %d hidden-state rows; not recorded", len(ids), len(rows))
        return
    n_acc = getattr(spec, "num_accept_tokens", None)
    starts, counts = p.bounds()
    acc = None
    if n_acc is not None and p.regime == "target_verify":
        acc = counts.copy()
        got = to_numpy(n_acc).astype(np.int64)[:len(acc)]
        acc[:len(got)] = np.minimum(np.maximum(got, 0), counts[:len(got)])
        rows[np.arange(len(rows)) - np.repeat(starts, counts) >= np.repeat(acc, counts)] = -1  # filler past the accept length
    # the shift check: draft row t's input id is token t+1 of the same request (where the target
    # pass holds that token too)
    tok = p.keys[2]
    if len(rows) > 1:
        same = np.ones(len(rows) - 1, dtype=bool)
        nxt = starts[1:] - 1
        same[nxt[(nxt >= 0) & (nxt < len(same))]] = False  # row t + 1 starts the next request
        t = np.flatnonzero(same & (rows[:-1] >= 0) & (rows[1:] >= 0))
        st.shift_checked += len(t)
        bad = t[ids[t] != tok[t + 1]]
        if len(bad):
            st.shift_mismatched += len(bad)
            st.warn_once("shift", "draft input ids are not the target's tokens shifted by one (request %s)",
                         p.keys[0][bad[0]])
    rec = st.rec
    private = bool(getattr(fb, "tensordiff_private", False))  # a snapshot's copies, kept as they are
    n = serving.packed(rec, DRAFT, hs, rows, labels=st.labels, raw_ids=st.raw_ids, convention=st.convention,
                   token_offset=1, role="draft_input", values=st.cfg.wants_values(DRAFT), reuse=AUX, private=private,
                   attrs={"source": "draft runner forward_batch.spec_info.hidden_states (the fc input)"})
    if n:
        _record_draft_ids(ids, rows)
        fc = st.fc_out
        if fc is not None and fc.shape[0] == len(rows):
            record_fc(fc, rows, private)
        elif fc is not None:
            st.warn_once("fc-rows", "draft fc output has %d rows for %d draft rows; not recorded", fc.shape[0], len(rows))
        if st.cfg.topk > 0:
            _draft_predictions(hs, rows, p, acc)
    st.fc_out = st.draft_logits = None
    st.dirty = True


def _draft_predictions(hs, rows, p: Pass, acc) -> None:
    """``draft_topk`` of the draft-extend rows the recorder keeps, and draft position 0 of each
    request's next verify step (the row of its last accepted token). ``acc``: the accept length of
    each request on a verify pass (clipped to its block), or None."""
    import numpy as np

    from .predictions import kept_rows

    st = STATE
    m = st.draft_id_map
    if m is not None and m.device != hs.device:
        m = st.draft_id_map = m.to(hs.device)  # once: the hot-token map lives on the draft's device
    last = last_accepted_rows(p, acc)
    need = np.union1d(kept_rows(rows), last) if st.spec_chain else kept_rows(rows)
    pred, _ = prediction_rows(st.draft_logits, len(rows), DRAFT_TOPK, m, need=need)
    if pred is not None:
        record_topk(DRAFT_TOPK, pred, rows, 1, "draft logits (logits processor), mapped to target ids")
        chain_start(p.segments, last, pred)


def last_accepted_rows(p: Pass, acc):
    """The row of each request's last accepted token (at least its first row; the last row of its
    block where no accept length is known): draft position 0 of its next verify step."""
    import numpy as np

    starts, counts = p.bounds()
    return starts + (counts if acc is None else np.maximum(acc, np.minimum(counts, 1))) - 1


def _record_draft_ids(ids, rows) -> None:
    """The input id each draft row was paired with (token t+1), as a one-column float64 tensor."""
    record_draft_ids(STATE, DRAFT_IDS, ids, rows, "the input token id paired with each draft_input row (token t+1)")
