"""Verify acceptance: AFTER ``EAGLEWorkerV2.verify``.

Commits the held target-verify rows of accepted tokens (``j < accept_lens[i]``) and drops those of
rejected draft tokens, so a row never claims a token for a position that the request did not keep.
"""

from __future__ import annotations

import time

from .catalog import record_catalog
from .forward import record_aux, to_numpy
from .state import STATE, Pass


def hook_verify(result, worker, batch, *args, **kwargs):
    st = STATE
    p = st.pending_verify
    st.pending_verify = None
    if p is None or not st.active:
        return
    t0 = time.perf_counter()
    try:
        commit_verify(p, result, batch)
    except Exception as e:  # noqa: BLE001
        st.fail("verify result", e)
    st.seconds += time.perf_counter() - t0
    return


def commit_verify(p: Pass, result, batch) -> None:
    """Keep the verify rows of accepted tokens, drop the rest; then record the held tensors.

    ``result.accept_index`` holds, per request, the flat verify rows of the accepted path (with
    topk 1: the first ``accept_lens[i]`` rows of its block; with a tree: a path through it), -1
    padded. SGLang then moves that path to the front of each block of
    ``logits_output.hidden_states`` (an identity with topk 1), and the draft extend reads that
    tensor: the pass the draft is matched against is re-laid out the same way."""
    import numpy as np

    st = STATE
    acc = to_numpy(result.accept_lens).astype(np.int64)
    bs = len(p.segments)
    reqs = list(getattr(batch, "reqs", None) or [])
    if len(acc) != bs:
        st.warn_once("verify-bs", "verify result for %d requests, pass had %d; not recorded", len(acc), bs)
        return
    acc_index = getattr(result, "accept_index", None)
    if acc_index is not None:
        acc_index = to_numpy(acc_index).astype(np.int64).reshape(bs, -1)
    rid_rows, pos, ids = p.keys
    n = len(p.rows)
    # the pass as the draft extend sees it: row s + j = the j-th accepted row of the request whose
    # segment starts at row s
    view_rows = np.full(n, -1, dtype=np.int64)
    view_ids = np.zeros(n, dtype=np.int64)
    view_pos = np.zeros(n, dtype=np.int64)
    any_kept = False
    for i, (rid, s, c) in enumerate(p.segments):
        a = int(min(max(acc[i], 0), c))
        if acc_index is not None:
            path = acc_index[i][acc_index[i] >= 0][:a]
            if len(path) != a or (len(path) and (path.min() < s or path.max() >= s + c)):
                st.warn_once("accept-index", "accept_index does not match accept_lens; using the first rows")
                path = np.arange(s, s + a)
        else:
            path = np.arange(s, s + a)
        sel = path
        req = reqs[i] if i < len(reqs) and str(getattr(reqs[i], "rid", rid)) == rid else None
        if req is not None:  # a request stops at max_new_tokens: accepted rows past it are not its tokens
            limit = position_limit(req)
            if limit is not None:
                sel = sel[pos[sel] < limit]
        st.dropped_rows += c - len(sel)
        if len(sel):
            p.rows[sel] = st.rec.add_tokens(rid, pos[sel], ids[sel], regime="target_verify", step=p.step)
            any_kept = True
        view_rows[s:s + len(path)] = p.rows[path]
        view_ids[s:s + len(path)] = ids[path]
        view_pos[s:s + len(path)] = pos[path]
    p.committed = True
    st.dirty = True
    hs_after = getattr(getattr(result, "logits_output", None), "hidden_states", None)
    view = Pass(hs=hs_after, rows=view_rows, keys=(rid_rows, view_pos, view_ids), segments=p.segments,
                step=p.step, regime=p.regime, committed=True)
    st.last_target = view
    if not any_kept:
        p.stash.clear()
        return
    if p.hs is not None:
        record_aux(p.hs, p.rows)
    for kind, b, value in p.stash:
        record_catalog(kind, b, value, p.rows)
    p.stash.clear()


def position_limit(req) -> int | None:
    try:
        prompt = len(req.origin_input_ids)
        m = req.sampling_params.max_new_tokens
        return prompt + int(m) if m is not None else None
    except Exception:  # noqa: BLE001
        return None
