"""Predictions: what the draft computes and what the target predicts, per token.

Taps (module hooks installed at start-up, on the target's and the draft's models):

* the draft's ``fc``: its output on a draft-extend pass is ``draft_fc_output`` [T, H], the same
  rows as ``draft_input`` (``token_offset=1``);
* each model's ``logits_processor``: its final hidden states and lm_head. Top-k rows are computed
  only for the rows the recorder keeps (a trace row at a position the sampling keeps; on a verify
  pass every row, since which rows are accepted is known only after the verify; on a draft extend
  also each request's last accepted row, draft position 0 of its next verify step). Where SGLang
  computed logits for every row (decode, target verify, draft decode) they are used as they are;
  where it kept only some rows (a prefill's last token, a draft extend's last accepted row), the
  plugin computes the needed rows itself with the same lm_head weight, 512 rows at a time (bounded
  memory; only when that weight holds the whole vocabulary, i.e. not vocab-sharded across TP
  ranks; otherwise those rows get no predictions, and a warning says so). The top-k ids,
  log-probabilities and logsumexp of every row are recorded as ``target_topk`` (row t predicts
  token t+1) and ``draft_topk`` (row t predicts token t+2; draft ids mapped to the target
  vocabulary through the draft's hot-token map), layouts in :mod:`tensordiff.conventions`.

The hooks keep references only (a snapshotted pass, :mod:`.capture`, copies of the logits or the
final hidden states); the work happens when the pass is recorded: each table is a top-k job of
the recorder (:class:`~tensordiff.recorders.staging.TopkJob`), which with staging on (the plugin's
default on the CPU) is computed in one batch with the other passes' jobs when the recorder drains
its staged work.
"""

from __future__ import annotations

from ... import conventions
from .. import prediction_tables as tables
from ..prediction_tables import PassTable
from .state import STATE


def install_prediction_taps(runner, draft: bool) -> None:
    """Hooks on the model's logits processor (and, for the draft, its fc)."""
    st = STATE
    if st.cfg.topk <= 0 and not draft:
        return
    model = runner.model
    lp = getattr(model, "logits_processor", None)
    if lp is not None and hasattr(lp, "register_forward_hook") and st.cfg.topk > 0:
        st.catalog_handles.append(lp.register_forward_hook(_logits_hook(draft), with_kwargs=True))
    elif st.cfg.topk > 0:
        st.warn_once(f"no-lp-{draft}", "no logits_processor on the %s model: no %s recorded",
                     "draft" if draft else "target", conventions.DRAFT_TOPK if draft else conventions.TARGET_TOPK)
    if draft:
        fc = getattr(getattr(model, "model", None), "fc", None)
        if fc is None or not hasattr(fc, "register_forward_hook"):
            st.warn_once("no-fc", "the draft model has no model.fc: no %s recorded", conventions.DRAFT_FC)
            return
        st.catalog_handles.append(fc.register_forward_hook(_fc_hook))
        hot = getattr(model, "hot_token_id", None)
        st.draft_id_map = hot


def _fc_hook(module, args, output):
    if STATE.active:
        STATE.fc_out = output


def _logits_hook(draft: bool):
    def hook(module, args, kwargs, output):
        st = STATE
        if not st.active:
            return
        hs = args[1] if len(args) > 1 else kwargs.get("hidden_states")
        head = args[2] if len(args) > 2 else kwargs.get("lm_head")
        setattr(st, "draft_logits" if draft else "target_logits", (module, hs, head, output))
    return hook


def kept_rows(rows):
    """Indices of the rows of a pass the recorder will keep (:func:`..prediction_tables.kept_rows`)."""
    return tables.kept_rows(STATE.rec, rows)


def prediction_rows(captured, n_rows: int, what: str, id_map=None, need=None):
    """(the :class:`PassTable` of the pass's top-k rows, or None (nothing needed, or with a
    warning); the logits SGLang computed for every row, or None when the plugin computes them).

    ``need``: the row indices whose predictions are kept (None: every row). Logits SGLang computed
    are used as they are; for the other rows the plugin multiplies the needed rows' final hidden
    states by the lm_head weight (scaled and soft-capped as the logits processor does),
    :data:`~tensordiff.recorders.staging.HEAD_CHUNK_ROWS` rows at a time. Either is a top-k job
    of the recorder: with staging (the plugin's default on the CPU) it is computed with every
    other pending job at the next drain."""
    st = STATE
    k = st.cfg.topk
    if captured is None:
        return None, None
    module, hs, head, out = captured
    if need is not None and len(need) == n_rows:
        need = None
    if need is not None and not len(need):
        return None, None
    logits = getattr(out, "next_token_logits", None)
    if logits is not None and logits.shape[0] == n_rows:
        job = st.rec.topk_job(k, logits=logits, id_map=id_map, rows=need,
                              private=bool(getattr(out, "tensordiff_private", False)))
        return PassTable(job, n_rows, need), logits
    if hs is None or hs.shape[0] != n_rows:
        st.warn_once(f"logits-rows-{what}", "%s: the logits processor saw %s rows for %d tokens; not recorded", what,
                     None if hs is None else hs.shape[0], n_rows)
        return None, None
    w = getattr(head, "weight", None)
    vocab = getattr(getattr(module, "config", None), "vocab_size", None)
    if w is None or w.dim() != 2 or (vocab is not None and w.shape[0] < int(vocab)):
        st.warn_once(f"logits-shard-{what}", "%s: the lm_head is vocab-sharded (or not a plain weight); rows whose "
                     "logits SGLang does not compute itself (prefill) are not recorded", what)
        return None, None
    scale = getattr(module, "logit_scale", None)
    cap = getattr(module, "final_logit_softcapping", None)
    job = st.rec.topk_job(k, hidden=hs, head=(w, None if vocab is None else int(vocab), scale, cap),
                          id_map=id_map, rows=need)
    return PassTable(job, n_rows, need), None


def chain_start(segments, last_rows, pred: PassTable) -> None:
    """Draft position 0 of each request's next verify step: the draft-extend row of its last
    accepted token (the row SGLang samples the first draft token from)."""
    st = STATE
    for (rid, _, _), r in zip(segments, last_rows):
        ref = pred.ref(r) if r >= 0 else None
        if ref is not None:
            st.chain[rid] = [ref]


def chain_step(fb) -> None:
    """A draft decode step: the draft's top-k at the next draft position of each request (a
    top-k job of the recorder; its rows are read when the verify step's chain is written)."""
    st = STATE
    cap, st.draft_logits = st.draft_logits, None
    if not st.chain or cap is None or st.cfg.topk <= 0:
        return
    logits = getattr(cap[3], "next_token_logits", None)
    rids = getattr(fb, "rids", None)
    if rids is None and st.last_target is not None:
        rids = [rid for rid, _, _ in st.last_target.segments]
    if logits is None or rids is None or logits.shape[0] != len(rids):
        st.warn_once("chain", "a draft decode step without one row per request; draft positions after 0 get "
                     "no distributions")
        st.chain.clear()
        return
    m = st.draft_id_map
    if m is not None and m.device != logits.device:
        m = st.draft_id_map = m.to(logits.device)
    job = st.rec.topk_job(st.cfg.topk, logits=logits, id_map=m,
                          private=bool(getattr(cap[3], "tensordiff_private", False)))
    for i, rid in enumerate(rids):
        c = st.chain.get(str(rid))
        if c is not None:
            c.append((job, i))


def record_topk(name: str, table: PassTable, rows, token_offset: int, source: str) -> None:
    """Append the top-k rows of ``table`` (from :func:`prediction_rows`) for the pass's token
    ``rows`` (-1 skipped; rows whose predictions were not computed are not recorded)."""
    tables.record_topk(STATE, name, table, rows, token_offset, source)


def record_fc(fc_out, rows, private: bool = False) -> None:
    tables.record_fc(STATE, fc_out, rows, "draft model.fc output on draft-extend passes", private)
