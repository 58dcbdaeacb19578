"""Verify acceptance: AFTER ``EAGLEWorkerV2.verify``.

Commits the held target-verify rows of accepted tokens (``j < accept_lens[i]``) and drops those of
rejected draft tokens, so a row never claims a token for a position that the request did not keep.
"""

from __future__ import annotations

from ...conventions import (
    SPEC_CHAIN,
    SPEC_VERIFY,
    TARGET_TOPK,
    spec_verify_drafts,
    spec_verify_width,
)
from .catalog import record_catalog
from .forward import record_aux, to_numpy
from .predictions import record_topk
from .state import STATE, Pass


def hook_verify(result, worker, batch, *args, **kwargs):
    st = STATE
    p = st.pending_verify
    st.pending_verify = None
    if p is None or not st.active:
        return
    t0 = st.begin()
    try:
        commit_verify(p, result, batch)
    except Exception as e:  # noqa: BLE001
        st.fail("verify result", e)
    st.end(t0)
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
    steps = []  # spec_verify rows: (token row of the block's first row, values)
    chains = []  # spec_chain rows: (the same token row, the draft's and the target's top-k per draft position)
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
        if st.spec_chain and c > 1 and p.rows[s] >= 0:
            steps.append((int(p.rows[s]), _step_row(p, s, c, a)))
            chain = st.chain.pop(rid, None)
            if chain is not None and len(chain) == c - 1 and p.pred is not None:
                chains.append((int(p.rows[s]), _chain_row(chain, p.pred[s:s + c - 1])))
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
    if p.pred is not None:
        record_topk(TARGET_TOPK, p.pred, p.rows, 0, "target logits (logits processor), accepted verify rows")
    if steps:
        _record_steps(steps)
    if chains:
        _record_chains(chains)
    for kind, b, value in p.stash:
        record_catalog(kind, b, value, p.rows)
    p.stash.clear()


def _step_row(p: Pass, s: int, c: int, a: int):
    """One verify step of one request (topk 1: a chain of K = c - 1 draft tokens at rows s+1..):
    [accepted drafts, K, first rejected draft position or -1, draft tokens, the target's top-1 at
    each draft position, the target's log-prob of each draft token] (NaN where not known)."""
    import numpy as np

    k = c - 1
    acc = min(max(a - 1, 0), k)  # accept_lens counts the bonus token
    row = np.full(3 + 3 * k, np.nan)
    row[0], row[1], row[2] = acc, k, (acc if acc < k else -1)
    ids = p.keys[2]
    row[3:3 + k] = ids[s + 1:s + c]
    if p.pred is not None:
        row[3 + k:3 + 2 * k] = p.pred[s:s + k, 0]
    if p.lp_next is not None:
        row[3 + 2 * k:3 + 3 * k] = p.lp_next[s:s + k]
    return row


def _record_steps(steps) -> None:
    import numpy as np

    st = STATE
    if st.spec_k is None:
        st.spec_k = spec_verify_drafts(len(steps[0][1]))
    keep = [(r, v) for r, v in steps if len(v) == spec_verify_width(st.spec_k)]
    if len(keep) < len(steps):
        st.warn_once("spec-k", "a verify step with another number of draft tokens than %d; not recorded", st.spec_k)
    if not keep:
        return
    n = st.model.get("num_layers") or 0
    st.rec.plain(SPEC_VERIFY, np.stack([v for _, v in keep]), np.array([r for r, _ in keep]), role=SPEC_VERIFY,
                 order=n + 0.95,
                 attrs={"layout": "accepted, K, first_rejected (-1: none), draft_tokens[K], target_top1[K], "
                                  "target_logprob_of_draft[K]", "k": st.spec_k,
                        "what": "one row per verify step, on the token row of the step's first (verified) row"})
    st.verify_steps += len(keep)
    st.dirty = True


def _chain_row(chain, target_rows):
    """([draft top-k rows of positions 0..K-1 | target top-k rows of verify rows 0..K-1], flat;
    draft row width; target row width)."""
    import numpy as np

    flat = np.concatenate([np.stack(chain).reshape(-1), target_rows.reshape(-1)])
    return flat, int(chain[0].shape[0]), int(target_rows.shape[1])


def _record_chains(chains) -> None:
    import numpy as np

    st = STATE
    _, (v0, dw, tw) = chains[0]
    keep = [(r, v) for r, (v, d, t) in chains if (d, t, len(v)) == (dw, tw, len(v0))]
    n = st.model.get("num_layers") or 0
    st.rec.plain(SPEC_CHAIN, np.stack([v for _, v in keep]), np.array([r for r, _ in keep]), role=SPEC_CHAIN,
                 order=n + 0.96,
                 attrs={"layout": "K draft top-k rows (draft positions 0..K-1), then K target top-k rows (verify rows "
                                  "0..K-1); each row ids | logprobs | logsumexp",
                        "K": len(v0) // (dw + tw), "draft_width": dw, "target_width": tw,
                        "what": "one row per verify step, on the token row of its spec_verify row"})
    st.dirty = True


def position_limit(req) -> int | None:
    try:
        prompt = len(req.origin_input_ids)
        m = req.sampling_params.max_new_tokens
        return prompt + int(m) if m is not None else None
    except Exception:  # noqa: BLE001
        return None
