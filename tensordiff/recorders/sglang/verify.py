"""Verify acceptance: AFTER ``EAGLEWorkerV2.verify``.

Commits the held target-verify rows of accepted tokens (``j < accept_lens[i]``) and drops those of
rejected draft tokens, so a row never claims a token for a position that the request did not keep.
"""

from __future__ import annotations

from ...conventions import SPEC_VERIFY, TARGET_TOPK
from .. import prediction_tables as tables
from .catalog import record_catalog
from .forward import record_aux, to_numpy
from .predictions import record_topk
from .state import STATE, Pass


def hook_verify(result, worker, batch, *args, **kwargs):
    """After ``EAGLEWorkerV2.verify``: capture the verify result (:mod:`.capture`) and commit the
    held verify pass with it, now or when the queue of captured passes is replayed."""
    from .capture import capture_verify, copying

    st = STATE
    if not st.active:
        return
    t0 = st.begin()
    try:
        copy = copying(getattr(result, "accept_lens", None))
        res, bat, nbytes = capture_verify(result, batch, copy)
        snap = _Verify(res, bat, nbytes)
        st.later(replay_verify, snap, copy)
    except Exception as e:  # noqa: BLE001
        st.fail("verify result", e)
    st.end(t0)
    return


class _Verify:
    __slots__ = ("batch", "nbytes", "result")

    def __init__(self, result, batch, nbytes: int):
        self.result, self.batch, self.nbytes = result, batch, nbytes


def replay_verify(snap: _Verify) -> None:
    """Commit the verify pass held since its forward with its (captured) verify result."""
    st = STATE
    p = st.pending_verify
    st.pending_verify = None
    if p is not None:
        commit_verify(p, snap.result, snap.batch)


def commit_verify(p: Pass, result, batch) -> None:
    """Keep the verify rows of accepted tokens, drop the rest; then record the held tensors.

    ``result.accept_index`` holds, per request, the flat verify rows of the accepted path (with
    topk 1: the first ``accept_lens[i]`` rows of its block; with a tree: a path through it), -1
    padded. SGLang then moves that path to the front of each block of
    ``logits_output.hidden_states`` (an identity with topk 1), and the draft extend reads that
    tensor: the pass the draft is matched against is re-laid out the same way.

    The batch is handled with array operations over all its requests (one loop remains, the token
    rows each request adds: the trace keys them by request)."""
    import numpy as np

    st = STATE
    acc = to_numpy(result.accept_lens).astype(np.int64)
    bs = len(p.segments)
    reqs = list(getattr(batch, "reqs", None) or [])
    if len(acc) != bs:
        st.warn_once("verify-bs", "verify result for %d requests, pass had %d; not recorded", len(acc), bs)
        return
    starts, counts = p.bounds()
    acc = np.minimum(np.maximum(acc, 0), counts)
    path, req_of = accepted_paths(getattr(result, "accept_index", None), starts, counts, acc)
    rid_rows, pos, ids = p.keys
    n = len(p.rows)
    # a request stops at max_new_tokens: accepted rows past it are not its tokens
    limits = _position_limits(p.segments, reqs)
    keep = pos[path] < limits[req_of] if limits is not None else np.ones(len(path), dtype=bool)
    sel = path[keep]
    per_req = np.bincount(req_of[keep], minlength=bs)
    st.dropped_rows += int(counts.sum()) - len(sel)
    if len(sel):
        p.rows[sel] = st.rec.add_token_runs([rid for rid, _, _ in p.segments], per_req, pos[sel], ids[sel],
                                            regime="target_verify", step=p.step)
    # the pass as the draft extend sees it: row s + j = the j-th accepted row of the request whose
    # segment starts at row s
    view_rows = np.full(n, -1, dtype=np.int64)
    view_ids = np.zeros(n, dtype=np.int64)
    view_pos = np.zeros(n, dtype=np.int64)
    dest = np.repeat(starts, acc) + _ranks(acc)
    view_rows[dest] = p.rows[path]
    view_ids[dest] = ids[path]
    view_pos[dest] = pos[path]
    p.committed = True
    st.dirty = True
    hs_after = getattr(getattr(result, "logits_output", None), "hidden_states", None)
    view = Pass(hs=hs_after, rows=view_rows, keys=(rid_rows, view_pos, view_ids), segments=p.segments,
                step=p.step, regime=p.regime, committed=True, _bounds=p._bounds, private=p.private, seq=p.seq)
    st.last_target = view
    if not len(sel):
        p.stash.clear()
        return
    if p.hs is not None:
        record_aux(p.hs, p.rows, p.private)
    if p.pred is not None:
        record_topk(TARGET_TOPK, p.pred, p.rows, 0, "target logits (logits processor), accepted verify rows")
    if st.spec_chain:
        _steps_and_chains(p, starts, counts, acc)
    for kind, b, value in p.stash:
        record_catalog(kind, b, value, p.rows, private=True)  # the taps' own copies
    p.stash.clear()


def _ranks(lengths):
    """0..lengths[i]-1 for every i, concatenated."""
    import numpy as np

    total = int(lengths.sum())
    return np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(lengths) - lengths, lengths)


def accepted_paths(acc_index, starts, counts, acc):
    """(the flat verify rows of every request's accepted path, in batch order; the request of
    each): from ``accept_index`` (per request its first ``acc[i]`` rows that are not -1), or the
    first ``acc[i]`` rows of each block where it is absent. A request whose ``accept_index`` row
    does not give ``acc[i]`` rows inside its block takes the first rows of its block (with a
    warning)."""
    import numpy as np

    bs = len(starts)
    if not bs:
        return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64)
    req_of = np.repeat(np.arange(bs, dtype=np.int64), acc)
    first = np.repeat(starts, acc) + _ranks(acc)
    if acc_index is None:
        return first, req_of
    ai = to_numpy(acc_index).astype(np.int64).reshape(bs, -1)
    valid = ai >= 0
    take = valid & (np.cumsum(valid, axis=1) <= acc[:, None])
    ent = ai[take]  # row-major: each request's entries in order, requests in batch order
    got = np.count_nonzero(take, axis=1)
    owner = np.repeat(np.arange(bs, dtype=np.int64), got)
    outside = (ent < starts[owner]) | (ent >= starts[owner] + counts[owner])
    bad = (got != acc) | (np.bincount(owner[outside], minlength=bs) > 0)
    if not bad.any():
        return ent, req_of
    STATE.warn_once("accept-index", "accept_index does not match accept_lens; using the first rows")
    good_ent = ~bad[owner]
    parts = np.where(bad[req_of], first, 0)
    parts[~bad[req_of]] = ent[good_ent]
    return parts, req_of


def _position_limits(segments, reqs):
    """Per request, the position its tokens stop before (prompt + max_new_tokens), or None when no
    request of the batch states one."""
    import numpy as np

    limits = None
    for i, (rid, _, _) in enumerate(segments):
        req = reqs[i] if i < len(reqs) else None
        if req is None or str(getattr(req, "rid", rid)) != rid:
            continue
        lim = position_limit(req)
        if lim is not None:
            if limits is None:
                limits = np.full(len(segments), np.iinfo(np.int64).max, dtype=np.int64)
            limits[i] = lim
    return limits


def _steps_and_chains(p: Pass, starts, counts, acc) -> None:
    """``spec_verify`` and ``spec_chain`` rows of the requests whose block is a chain of draft
    tokens (c > 1) and whose first verify row was kept. The columns that come from top-k tables
    (the target's top-1 and log-prob at each draft position, the chains' rows) are filled when the
    rows are written, from the pass's and the draft steps' top-k jobs."""
    import numpy as np

    from ..staging import Later

    st = STATE
    bs = len(starts)
    c = int(counts[0])
    if c <= 1 or not (counts == c).all():
        if (counts > 1).any():
            st.warn_once("verify-blocks", "verify blocks of different lengths; no %s rows", SPEC_VERIFY)
        return
    first_rows = p.rows[starts]
    which = np.flatnonzero(first_rows >= 0)
    if not len(which):
        return
    k = c - 1
    # [accepted drafts, K, first rejected draft position or -1, draft tokens, the target's top-1 at
    # each draft position, the target's log-prob of each draft token] (NaN where not known)
    a = np.minimum(np.maximum(acc[which] - 1, 0), k)  # accept_lens counts the bonus token
    steps = np.full((len(which), 3 + 3 * k), np.nan)
    steps[:, 0] = a
    steps[:, 1] = k
    steps[:, 2] = np.where(a < k, a, -1)
    steps[:, 3:3 + k] = p.keys[2].reshape(bs, c)[which, 1:]
    pred, logit_next = p.pred, p.logit_next
    rows = first_rows[which]
    chains = [st.chain.pop(p.segments[i][0], None) for i in which.tolist()]
    if pred is None:
        _record_steps(rows, steps, steps.shape[1])
        return

    def blocks():
        """The target's top-k rows at the chosen requests' draft positions [len(which), k, width]."""
        return pred.full().reshape(bs, c, -1)[which, :k]

    def step_rows():
        b = blocks()
        steps[:, 3 + k:3 + 2 * k] = b[:, :, 0]
        if logit_next is not None:
            steps[:, 3 + 2 * k:] = logit_next.reshape(bs, c)[which, :k] - b[:, :, -1]
        return steps

    _record_steps(rows, Later(steps.shape[1], step_rows), steps.shape[1])
    tables.record_chain_rows(STATE, rows, chains, blocks, pred.width, k)


def _record_steps(rows, steps, width: int) -> None:
    tables.record_steps(STATE, rows, steps, width)


def position_limit(req) -> int | None:
    try:
        prompt = len(req.origin_input_ids)
        m = req.sampling_params.max_new_tokens
        return prompt + int(m) if m is not None else None
    except Exception:  # noqa: BLE001
        return None
