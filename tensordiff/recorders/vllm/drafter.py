"""Drafter input: AROUND ``SpecDecodeBaseProposer.propose`` and AFTER ``set_inputs_first_pass``.

``propose(target_hidden_states=...)`` is exactly what ``combine_hidden_states`` (the draft's
``fc``) consumes: recorded as ``draft_input``, each row keyed by the target row of the same
(request, position) in the committed step the drafter reads (``token_offset=1``). The input ids
the drafter actually got (its ``input_ids`` buffer after the shift) are recorded as
``draft_input_ids`` and checked against the target's tokens shifted by one. Rows whose target row
was dropped (rejected drafts in the padded drafter batch) are filler and are dropped.
"""

from __future__ import annotations

import time

from .. import serving
from .config import DRAFT, DRAFT_IDS
from .forward import to_numpy
from .predictions import record_draft_predictions
from .state import STATE, Step

_PROPOSE_SIG: dict = {}


def hook_propose(original, proposer, *args, **kwargs):
    st = STATE
    if not st.active or st.last is None or st.labels is None:
        return original(proposer, *args, **kwargs)
    ctx = None
    try:
        import inspect

        sig = _PROPOSE_SIG.get(original)
        if sig is None:
            sig = _PROPOSE_SIG[original] = inspect.signature(original)
        b = sig.bind(proposer, *args, **kwargs).arguments
        hs = b.get("target_hidden_states")
        h = st.model.get("hidden_size") or 0
        if hs is not None and hs.shape[-1] == len(st.labels) * h:
            cad = b.get("common_attn_metadata")
            qsl = getattr(cad, "query_start_loc_cpu", None)
            if qsl is None:
                qsl = getattr(cad, "query_start_loc", None)
            ctx = {"hs": hs, "pos": b.get("target_positions"), "tok": b.get("target_token_ids"),
                   "qsl": qsl, "ids": None, "step": st.last, "fc": None, "outs": [], "sample": None,
                   "aligned": False}
    except Exception as e:  # noqa: BLE001
        st.fail("draft pass", e)
    st.draft_ctx = ctx
    try:
        return original(proposer, *args, **kwargs)
    finally:
        st.draft_ctx = None
        if ctx is not None and st.active:
            t0 = time.perf_counter()
            try:
                with st.lock:
                    record_draft(ctx)
                st.last_activity = time.monotonic()
            except Exception as e:  # noqa: BLE001
                st.fail("draft pass", e)
            st.seconds += time.perf_counter() - t0


def hook_set_inputs_first_pass(out, proposer, *args, **kwargs) -> None:
    ctx = STATE.draft_ctx
    if ctx is None or ctx.get("seen"):
        return
    ctx["seen"] = True
    try:
        num_tokens = int(out[0])
        buf = getattr(proposer, "input_ids", None)
        if not getattr(proposer, "needs_extra_input_slots", False):  # the draft pass's rows are draft_input's
            ctx["aligned"] = True
            if out[1] is not None:  # token_indices_to_sample: each request's row its first draft token comes from
                ctx["sample"] = to_numpy(out[1]).copy()
            if buf is not None:
                ctx["ids"] = to_numpy(buf[:num_tokens]).copy()
    except Exception:  # noqa: BLE001
        ctx["ids"] = None


def record_draft(ctx: dict) -> None:
    import numpy as np

    st = STATE
    step: Step = ctx["step"]
    hs = ctx["hs"]
    n = hs.shape[0]
    pos_t = ctx["pos"]
    if pos_t is not None and getattr(pos_t, "ndim", 1) == 2:
        pos_t = pos_t[0]
    pos = to_numpy(pos_t[:n]).astype(np.int64)
    qsl = to_numpy(ctx["qsl"]).astype(np.int64)
    if len(qsl) - 1 != step.num_reqs or qsl[-1] > n:
        st.draft_unmatched += 1
        st.warn_once("draft-unmatched", "a drafter batch of %d requests does not match the target step's %d; "
                     "not recorded", len(qsl) - 1, step.num_reqs)
        return
    # draft row j -> the target row of the same (request, position) in the step the drafter reads
    by_key = {}
    for key, s, c, _, _ in step.segments:
        for j in range(s, s + c):
            by_key[(key, int(step.pos[j]))] = int(step.rows[j])
    rows = np.full(n, -1, dtype=np.int64)
    keys = [None] * n
    for seg, bi in zip(step.segments, step.batch_idx):
        key = seg[0]
        for j in range(int(qsl[bi]), int(qsl[bi + 1])):
            rows[j] = by_key.get((key, int(pos[j])), -1)
            keys[j] = key
    if not (rows >= 0).any():
        return
    ids = ctx["ids"]
    if ids is not None and len(ids) >= n:
        ids = ids[:n].astype(np.int64)
        for j in np.flatnonzero(rows >= 0):
            want = step.next_tok.get((keys[j], int(pos[j]) + 1))
            if want is None:
                continue
            st.shift_checked += 1
            if int(ids[j]) != want:
                st.shift_mismatched += 1
                st.warn_once("shift", "draft input ids are not the target's tokens shifted by one (request %s)", keys[j])
    else:
        ids = None
    got = st.rec.packed(DRAFT, hs[:n], rows, labels=st.labels, raw_ids=st.raw_ids, convention=st.convention,
                        token_offset=1, role="draft_input", values=st.cfg.wants_values(DRAFT),
                        attrs={"source": "drafter propose(target_hidden_states): the input of "
                                         "combine_hidden_states (the draft's fc)"})
    if got and ids is not None:
        record_draft_ids(ids, rows)
    if got:
        req_keys: list = [None] * (len(qsl) - 1)
        for seg, bi in zip(step.segments, step.batch_idx):
            req_keys[bi] = seg[0]
        record_draft_predictions(ctx, rows, n, req_keys)
    st.dirty = True


def record_draft_ids(ids, rows) -> None:
    serving.record_draft_ids(STATE, DRAFT_IDS, ids, rows,
                             "the input token id the drafter paired with each draft_input row (token t+1)")
