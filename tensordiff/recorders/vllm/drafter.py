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
from .config import AUX, DRAFT, DRAFT_IDS
from .forward import to_numpy
from .predictions import record_draft_predictions
from .state import STATE, Step
from .verify import held_bytes

_PROPOSE_SIG: dict = {}


def hook_propose(original, proposer, *args, **kwargs):
    st = STATE
    if not st.active or st.last is None or st.labels is None:
        return original(proposer, *args, **kwargs)
    t0 = time.perf_counter()   # the plugin's own time: this part and the records after the pass
    ctx = None
    deferring = bool(st.queue) or st.last.rows is None  # the step it reads is recorded later: so is this pass
    if deferring:
        st.defer((None, None, _spend_chains))  # with the predictions (the chains are theirs)
    else:
        _spend_chains()
    try:
        import inspect

        if "target_hidden_states" in kwargs and "common_attn_metadata" in kwargs:
            b = kwargs  # vLLM's own call passes them by name: no signature binding
        else:
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
                   "qsl": qsl, "ids": None, "step": st.last, "fc": None, "outs": [], "logits": [],
                   "sample": None, "aligned": False}
    except Exception as e:  # noqa: BLE001
        st.fail("draft pass", e)
    st.draft_ctx = ctx
    st.add_seconds(time.perf_counter() - t0)
    try:
        return original(proposer, *args, **kwargs)
    finally:
        st.draft_ctx = None
        if ctx is not None and st.active:
            t0 = time.perf_counter()
            try:
                if deferring:
                    hold_draft_inputs(ctx)
                    st.defer(draft_phases(ctx), held_bytes(ctx["hs"], ctx["fc"], *ctx["outs"]))
                else:
                    with st.lock:
                        record_draft(ctx)
                st.last_activity = time.monotonic()
            except Exception as e:  # noqa: BLE001
                st.fail("draft pass", e)
            st.add_seconds(time.perf_counter() - t0)
        if st.queue_full():
            try:
                st.drain_queue()
            except Exception as e:  # noqa: BLE001
                st.fail("draft pass", e)


def _spend_chains() -> None:
    """This propose drafts the next verify step's tokens: the chains before are spent."""
    STATE.chain = {}


def hold_draft_inputs(ctx: dict) -> None:
    """Before the pass is recorded later: its positions and query starts as arrays of its own (vLLM
    slices them from buffers it fills again at the next step); the other tensors are the pass's
    own new ones (the draft's hidden states, fc and model outputs, the logits copies)."""
    import numpy as np

    n = ctx["hs"].shape[0]
    pos_t = ctx["pos"]
    if pos_t is not None and getattr(pos_t, "ndim", 1) == 2:
        pos_t = pos_t[0]
    ctx["pos"] = to_numpy(pos_t[:n]).astype(np.int64) if pos_t is not None else None
    ctx["qsl"] = to_numpy(ctx["qsl"]).astype(np.int64) if ctx["qsl"] is not None else None
    ctx["tok"] = None


def draft_phases(ctx: dict) -> tuple:
    """A deferred :func:`record_draft` in the phases of :meth:`State.run_queue`: none in the
    first (the token rows: the pass adds none), its states in the second (right after its step's
    aux states, whose bits ``draft_input`` may repeat), its predictions in the third (in order with
    the steps' own: each verify step reads the chain of the propose before it)."""
    st = STATE
    held: list = []

    def states() -> None:
        try:
            with st.lock:
                held.append(record_draft_states(ctx))
        except Exception as e:  # noqa: BLE001
            st.fail("draft pass", e)

    def predictions() -> None:
        try:
            with st.lock:
                if held and held[0] is not None:
                    record_draft_predictions(ctx, *held[0])
        except Exception as e:  # noqa: BLE001
            st.fail("draft pass", e)

    return None, states, predictions


def record_draft_later(ctx: dict) -> None:
    """:func:`draft_phases`, one after the other."""
    for phase in draft_phases(ctx)[1:]:
        if STATE.broken:
            return
        phase()


def hook_set_inputs_first_pass(out, proposer, *args, **kwargs) -> None:
    ctx = STATE.draft_ctx
    if ctx is None or ctx.get("seen"):
        return
    ctx["seen"] = True
    t0 = time.perf_counter()
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
    STATE.add_seconds(time.perf_counter() - t0)


def record_draft(ctx: dict) -> None:
    got = record_draft_states(ctx)
    if got is not None:
        record_draft_predictions(ctx, *got)


def record_draft_states(ctx: dict):
    """:func:`record_draft` but its predictions: ``draft_input`` and its ids. Returns what
    :func:`~tensordiff.recorders.vllm.predictions.record_draft_predictions` takes after it (rows,
    the pass's rows, each request's sequence key), or None where nothing was recorded."""
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
        return None
    # draft row j -> the target row of the same (request, position) in the step the drafter reads,
    # and the token the target has at the next position (the draft shift check): array operations
    # per request
    rows, want, owner = draft_rows(step, qsl, pos)
    if not (rows >= 0).any():
        return None
    ids = ctx["ids"]
    if ids is not None and len(ids) >= n:
        ids = ids[:n].astype(np.int64)
        check = (rows >= 0) & (want >= 0)
        bad = np.flatnonzero(check & (ids != want))
        st.shift_checked += int(np.count_nonzero(check))
        if len(bad):
            st.shift_mismatched += len(bad)
            st.warn_once("shift", "draft input ids are not the target's tokens shifted by one (request %s)",
                         step.segments[int(owner[bad[0]])][0])
    else:
        ids = None
    src, reuse = hs[:n], None
    aux = step.aux
    if aux is not None and st.rec.stage_bytes > 0 and aux.shape == src.shape and np.array_equal(rows, step.rows):
        from ..staging import same_bits

        if src.device.type == "cpu" and same_bits(src, aux):
            # the draft is fed the very bits of the target's aux rows: the trace stores them once
            # (draft_input's rows refer to aux_hidden_states' rows; the reader resolves them)
            src, reuse = aux, AUX
    step.aux = None
    got = serving.packed(st.rec, DRAFT, src, rows, labels=st.labels, raw_ids=st.raw_ids, convention=st.convention,
                        token_offset=1, role="draft_input", values=st.cfg.wants_values(DRAFT), reuse=reuse,
                        private=reuse is not None,  # then ``src`` is the step's own aux snapshot (verify.record_aux)
                        attrs={"source": "drafter propose(target_hidden_states): the input of "
                                         "combine_hidden_states (the draft's fc)"})
    if got and ids is not None:
        record_draft_ids(ids, rows)
    st.dirty = True
    if not got:
        return None
    req_keys: list = [None] * (len(qsl) - 1)
    for seg, bi in zip(step.segments, step.batch_idx):
        req_keys[bi] = seg[0]
    return rows, n, req_keys


def draft_rows(step: Step, qsl, pos):
    """For every draft row (request i's rows ``qsl[b_i]:qsl[b_i + 1]`` at positions ``pos``): the
    trace row of the target row at the same (request, position) in ``step`` (-1: none or dropped),
    the target's token at the next position (-1: not known) and the segment it belongs to (-1:
    none). One set of array operations for every request whose rows in ``step`` are consecutive
    positions (always, in vLLM 0.32); :func:`target_rows` for any other."""
    import numpy as np

    n = len(pos)
    got = _same_layout(step, qsl, pos)
    if got is not None:
        return got
    rows = np.full(n, -1, dtype=np.int64)
    want = np.full(n, -1, dtype=np.int64)
    owner = np.full(n, -1, dtype=np.int64)
    m = len(step.segments)
    if not m:
        return rows, want, owner
    seg = np.array([(s, c) for _, s, c, _, _ in step.segments], dtype=np.int64).reshape(m, 2)
    S, C = seg[:, 0], seg[:, 1]
    b = np.asarray(step.batch_idx, dtype=np.int64)
    j0, j1 = qsl[b], qsl[b + 1]
    lens = np.maximum(j1 - j0, 0)
    if not lens.sum():
        return rows, want, owner
    # a request's rows are consecutive positions when no step inside it is other than +1
    breaks = np.concatenate([[0], np.cumsum(np.diff(step.pos) != 1)])
    last = np.maximum(S + C - 1, S)
    plain = (C > 0) & (breaks[last] == breaks[S])
    sel = np.flatnonzero(plain & (lens > 0))
    if len(sel):
        own = np.repeat(sel, lens[sel])
        j = np.concatenate([np.arange(a, z) for a, z in zip(j0[sel], j1[sel])]) if len(sel) > 1 else \
            np.arange(j0[sel[0]], j1[sel[0]])
        s_, c_ = S[own], C[own]
        idx = pos[j] - step.pos[s_]
        inside = (idx >= 0) & (idx < c_)
        rows[j] = np.where(inside, step.rows[s_ + np.clip(idx, 0, c_ - 1)], -1)
        nxt = s_ + np.clip(idx + 1, 0, c_ - 1)
        want[j] = np.where(inside & (idx + 1 < c_) & (step.rows[nxt] >= 0), step.ids[nxt], -1)
        owner[j] = own
    for i in np.flatnonzero(~plain & (lens > 0)).tolist():
        a, z = int(j0[i]), int(j1[i])
        rows[a:z], want[a:z] = target_rows(step, step.segments[i], pos[a:z])
        owner[a:z] = i
    # the token after a request's last kept row: noted at the commit (the next prompt token of a
    # partial prefill, or the token the target sampled)
    for t in np.flatnonzero((rows >= 0) & (want < 0) & (owner >= 0)).tolist():
        tok = step.next_tok.get((step.segments[int(owner[t])][0], int(pos[t]) + 1))
        if tok is not None:
            want[t] = tok
    return rows, want, owner


def _same_layout(step: Step, qsl, pos):
    """:func:`draft_rows` where the drafter batch is the step's own rows (vLLM's padded drafter
    batch: every request's rows of the step, in the step's order, at its positions, each request's
    positions consecutive): draft row j is target row j, no search. None where the batch is laid
    out otherwise."""
    import numpy as np

    T = len(step.pos)
    m = len(step.segments)
    if not m or len(pos) != T or int(qsl[-1]) != T:
        return None
    lay = step.layout
    if lay is None:
        seg = np.array([(s, c) for _, s, c, _, _ in step.segments], dtype=np.int64).reshape(m, 2)
        owner = np.repeat(np.arange(m, dtype=np.int64), seg[:, 1])
        # j and j + 1 are consecutive positions of one request
        nxt = (owner[1:] == owner[:-1]) & (step.pos[1:] == step.pos[:-1] + 1)
        plain = len(owner) == T and int(np.count_nonzero(nxt)) == T - m
        lay = step.layout = (seg[:, 0], seg[:, 0] + seg[:, 1], np.asarray(step.batch_idx, dtype=np.int64), owner,
                             nxt, plain)
    S, E, b, owner, nxt, plain = lay
    if not plain or len(b) != m or int(b[-1]) + 1 >= len(qsl) or not np.array_equal(qsl[b], S) \
            or not np.array_equal(qsl[b + 1], E) or not np.array_equal(pos, step.pos):
        return None
    rows = step.rows.copy()
    want = np.full(T, -1, dtype=np.int64)
    ok = nxt & (rows[1:] >= 0)
    want[:-1][ok] = step.ids[1:][ok]
    # the token after a request's last kept row: noted at the commit
    for t in np.flatnonzero((rows >= 0) & (want < 0)).tolist():
        tok = step.next_tok.get((step.segments[int(owner[t])][0], int(pos[t]) + 1))
        if tok is not None:
            want[t] = tok
    return rows, want, owner.copy()


def target_rows(step: Step, seg, dpos):
    """For draft rows of request ``seg`` at positions ``dpos``: (the trace row of the target row at
    the same position in ``step``, -1 where none or dropped; the target's token at the next
    position, -1 where not known). The next token is the kept target row's input id there, or the
    token after the last kept row (:func:`~tensordiff.recorders.vllm.verify.commit` notes it: the
    next prompt token of a partial prefill, or the token the target sampled)."""
    import numpy as np

    key, s, c = seg[0], seg[1], seg[2]
    sp = step.pos[s:s + c]
    m = len(dpos)
    if c and (np.diff(sp) == 1).all():  # a request's rows of a step are consecutive positions
        idx = dpos - sp[0]
        inside = (idx >= 0) & (idx < c)
        at = s + np.clip(idx, 0, c - 1)
        rows = np.where(inside, step.rows[at], -1)
        nxt = s + np.clip(idx + 1, 0, c - 1)
        want = np.where(inside & (idx + 1 < c) & (step.rows[nxt] >= 0), step.ids[nxt], -1)
    else:
        where = {int(p): s + x for x, p in enumerate(sp)}
        rows = np.full(m, -1, dtype=np.int64)
        want = np.full(m, -1, dtype=np.int64)
        for t, p in enumerate(dpos.tolist()):
            x = where.get(p)
            if x is not None:
                rows[t] = step.rows[x]
            y = where.get(p + 1)
            if y is not None and step.rows[y] >= 0:
                want[t] = step.ids[y]
    for t in np.flatnonzero((rows >= 0) & (want < 0)):
        tok = step.next_tok.get((key, int(dpos[t]) + 1))
        if tok is not None:
            want[t] = tok
    return rows, want


def record_draft_ids(ids, rows) -> None:
    serving.record_draft_ids(STATE, DRAFT_IDS, ids, rows,
                             "the input token id the drafter paired with each draft_input row (token t+1)")
