"""Capture: what each hook takes from the engine, so that the pass can be recorded later.

Between two forward passes of a CPU engine the plugin's Python runs with the caches the model just
filled (and the engine's OpenMP workers spinning on the other cores): every numpy call of the
recording costs several times what it costs in a loop of its own. So on the CPU a hook records
nothing while the engine waits. It takes a *snapshot* of its pass: the token keys, accept lengths
and request limits as numpy, private copies of the tensors the pass is recorded from (the aux
hidden states, the logits or the final hidden states behind them, the draft's fc output). Then it
queues the snapshot (:meth:`.state.State.later`). The queued passes are recorded one after
another, by the same functions as before and in the same order, when:

* the scheduler goes idle;
* an RPC flushes, pauses or closes;
* the queue holds half of ``TENSORDIFF_STAGE_MB``;
* or its first pass is older than ``TENSORDIFF_FLUSH_SECONDS``.

What the hooks decide from identity (is the draft fed the very tensor the target returned?) is
decided here, at capture. Where it is, the bits are compared with the copy too, and the draft's
snapshot then holds that same copy, so the recorder stores the rows once.

A snapshot quacks like the engine object it stands for: the record functions read the same
attributes. Where the engine runs on an accelerator, or with ``TENSORDIFF_STAGE_MB=0``, nothing is
copied and each pass is recorded in its own hooks (catalog taps included), as before the queue.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from .state import STATE, log


def copying(t) -> bool:
    """Whether passes on tensor ``t``'s device are snapshotted and queued (CPU, staging on)."""
    return STATE.cfg.stage_bytes > 0 and (t is None or t.device.type == "cpu")


def _nbytes(*ts) -> int:
    return sum(int(t.numel() * t.element_size()) for t in ts if t is not None and hasattr(t, "numel"))


def _np_ids(t):
    """int64 numpy copy of a token-id / position / count tensor (or None)."""
    if t is None:
        return None
    import numpy as np

    if getattr(t, "device", None) is not None:  # a torch tensor
        t = (t if t.device.type == "cpu" else t.cpu()).detach().numpy()
    return np.array(t, dtype=np.int64).reshape(-1)  # a copy, always


class Keys(SimpleNamespace):
    """A target pass's keys, taken before the forward: ``ids``, ``pos`` (int64), ``segs``
    [(rid, first row, rows)], ``regime``, ``step``, ``mode`` (the forward mode's name) and
    ``stash`` (catalog tap values of the pass: recorded once its rows are known), ``private``
    (the pass is snapshotted: its tensors are copies), ``seq`` (its number: a draft extend is
    matched with the pass it was fed by)."""


def capture_keys(runner, fb) -> Keys | None:
    """The keys of a target pass (None: a pass without request ids or row counts, not recorded)."""
    from .batch import regime_of, segments

    st = STATE
    ids = _np_ids(fb.input_ids)
    pos = _np_ids(fb.positions) if fb.positions is not None else None
    n = len(ids)
    segs = segments(fb, n)
    if segs is None or pos is None or len(pos) != n:
        st.unkeyed_passes += 1  # e.g. a warm-up pass without requests: nothing to key its rows by
        log.debug("tensordiff: a %s pass without request ids or row counts; not recorded", fb.forward_mode.name)
        return None
    step = int(getattr(runner, "forward_pass_id", 0)) + 1  # the id ModelRunner.forward is about to take
    st.cap_seq += 1
    return Keys(ids=ids, pos=pos, segs=segs, regime=regime_of(fb.forward_mode), step=step,
                mode=fb.forward_mode.name, stash=[], private=copying(fb.input_ids), seq=st.cap_seq)


def logits_snapshot(captured, n_rows: int | None, copy: bool):
    """What a logits-processor tap captured (module, final hidden states, lm_head, output), with the
    part :func:`.predictions.prediction_rows` reads copied: the logits where the engine computed
    them for every row (``n_rows`` None: whatever rows it computed), else the final hidden states
    (the plugin computes the logits it needs from them and the lm_head weight, which the engine
    does not change)."""
    if captured is None or not copy:
        return captured
    from ..staging import host_copy, host_f32

    module, hs, head, out = captured
    logits = getattr(out, "next_token_logits", None)
    if logits is not None and (n_rows is None or logits.shape[0] == n_rows):  # float32: what the top-k reads
        return module, None, head, SimpleNamespace(next_token_logits=host_f32(logits), tensordiff_private=True)
    return module, (host_copy(hs) if hs is not None else None), head, SimpleNamespace(next_token_logits=None)


def capture_target(fb, out, keys: Keys, copy: bool) -> SimpleNamespace:
    """A target pass after its forward: the keys, whether it ran as a graph, its aux hidden states
    (copied) and what its logits tap captured. Remembers the aux tensor a draft extend is matched
    against (``STATE.cap_aux``: (the engine's tensor, the snapshot's))."""
    from ..staging import host_copy

    st = STATE
    lo = getattr(out, "logits_output", None)
    hs = getattr(lo, "hidden_states", None) if lo is not None else None
    aux = host_copy(hs) if copy and hs is not None else hs
    valid = hs is not None and st.labels is not None and hs.shape[0] == len(keys.ids)
    st.cap_aux = (hs, aux, keys.seq) if valid else (None, None, None)
    st.cap_verify_seq = keys.seq if keys.regime == "target_verify" else None
    n = len(keys.ids)
    logits = logits_snapshot(st.target_logits, n, copy) if st.cfg.topk > 0 else None  # no predictions: no copy
    st.target_logits = None
    snap = SimpleNamespace(keys=keys, can_run_graph=bool(getattr(out, "can_run_graph", False)),
                           logits_output=SimpleNamespace(hidden_states=aux), logits=logits)
    snap.nbytes = _nbytes(aux, *(_logit_parts(logits)), *(v for _, _, v in keys.stash)) if copy else 0
    return snap


def _logit_parts(cap) -> tuple:
    if cap is None:
        return ()
    return cap[1], getattr(cap[3], "next_token_logits", None)


def capture_verify(result, batch, copy: bool) -> tuple[Any, Any, int]:
    """(result, batch, bytes) of a verify step: accept lengths and index as numpy, the hidden states
    the draft extend will read (the target pass's snapshot where they are the same tensor), and per
    request what its position limit needs."""
    from .batch import same_tensor

    st = STATE
    hs_after = getattr(getattr(result, "logits_output", None), "hidden_states", None)
    seq, st.cap_verify_seq = st.cap_verify_seq, None
    live, aux, _ = st.cap_aux
    if seq is None or live is None:  # no verify pass recorded for it: a draft extend after it is not matched
        st.cap_aux = (None, None, None)
        hs_after = None
    if not copy:
        if hs_after is not None and not same_tensor(hs_after, live):
            st.cap_aux = (hs_after, hs_after, seq)
        return result, batch, 0
    from ..staging import host_copy

    nbytes = 0
    if hs_after is not None:
        if same_tensor(hs_after, live):
            hs_after = aux
        else:  # SGLang laid the accepted paths out in another tensor: the draft reads that one
            copied = host_copy(hs_after)
            st.cap_aux = (hs_after, copied, seq)
            hs_after, nbytes = copied, _nbytes(copied)
    acc_index = getattr(result, "accept_index", None)
    res = SimpleNamespace(accept_lens=_np_ids(result.accept_lens),
                          accept_index=None if acc_index is None else _np_ids(acc_index),
                          logits_output=SimpleNamespace(hidden_states=hs_after))
    reqs = [_req(r) for r in (getattr(batch, "reqs", None) or [])]
    return res, SimpleNamespace(reqs=reqs), nbytes


def _req(r):
    """What :func:`.verify.position_limit` reads of a request: its id, prompt length, max_new_tokens."""
    try:
        sp = SimpleNamespace(max_new_tokens=r.sampling_params.max_new_tokens)
        return SimpleNamespace(rid=r.rid, origin_input_ids=range(len(r.origin_input_ids)), sampling_params=sp)
    except Exception:  # noqa: BLE001 - no limit known (position_limit says None)
        return SimpleNamespace(rid=getattr(r, "rid", None))


def capture_draft(fb, copy: bool) -> SimpleNamespace | None:
    """A draft pass after its forward (None: a pass the plugin does not record). A decode step: its
    request ids and its logits. An extend: its hidden states (the target's snapshot itself where the
    draft was fed the very tensor the target returned and its bits are still the same, else a copy),
    input ids, accept lengths, fc output and logits; ``tensordiff_matched`` says whether it was fed
    the target's tensor (decided now: the record function cannot tell copies apart)."""
    from ..staging import host_copy, same_bits
    from .batch import same_tensor

    st = STATE
    mode = fb.forward_mode
    rids = getattr(fb, "rids", None)
    rids = list(rids) if rids is not None else None
    if not (mode.is_extend() or mode.is_draft_extend_v2()) or mode.is_target_verify():
        if mode.is_target_verify() or st.cfg.topk <= 0 or not st.spec_chain:
            return None  # a draft decode step is recorded only as a chain position's distribution
        logits = logits_snapshot(st.draft_logits, None, copy)
        snap = SimpleNamespace(forward_mode=mode, rids=rids, draft_logits=logits, fc_out=None,
                               tensordiff_private=copy)
        snap.nbytes = _nbytes(*_logit_parts(logits)) if copy else 0
        return snap
    spec = getattr(fb, "spec_info", None)
    hs = getattr(spec, "hidden_states", None)
    if hs is None or st.labels is None:
        return None
    h = st.model.get("hidden_size") or 0
    if hs.shape[-1] != len(st.labels) * h:
        return None  # not the target's packed aux states
    live, aux, seq = st.cap_aux
    matched = live is not None and same_tensor(hs, live)
    fc = st.fc_out
    n_acc = getattr(spec, "num_accept_tokens", None)
    ids = fb.input_ids
    logits = st.draft_logits if st.cfg.topk > 0 else None
    nbytes = 0
    if copy and matched:
        if aux is not None and same_bits(hs, aux):
            hs = aux  # stored once: the recorder refers to the target's rows
        else:
            hs = host_copy(hs)
            nbytes += _nbytes(hs)
        fc = host_copy(fc) if fc is not None else None
        n_acc = _np_ids(n_acc)
        ids = _np_ids(ids)
        logits = logits_snapshot(logits, len(ids), copy)
    elif copy:  # not fed the last target pass's states: recorded as unmatched, nothing to copy
        fc = logits = None
        n_acc, ids = _np_ids(n_acc), _np_ids(ids)
    snap = SimpleNamespace(forward_mode=mode, rids=rids, input_ids=ids, tensordiff_matched=matched,
                           tensordiff_private=copy, tensordiff_seq=seq if matched else None,
                           spec_info=SimpleNamespace(hidden_states=hs, num_accept_tokens=n_acc),
                           fc_out=fc, draft_logits=logits)
    snap.nbytes = nbytes + _nbytes(fc, *_logit_parts(logits)) if copy else 0
    return snap
