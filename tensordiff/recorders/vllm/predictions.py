"""Predictions inside vLLM: what the draft computes and what the target predicts, per token, and
where in the draft chain the target rejects (docs/recorders.md, "Predictions"; the SGLang plugin's
:mod:`tensordiff.recorders.sglang.predictions` records the same tensors).

Taps, installed at start-up (:func:`install_prediction_taps`):

* the draft's ``model.fc`` (a forward hook): inside ``propose`` its output is what
  ``combine_hidden_states`` made of ``draft_input``, recorded as ``draft_fc_output`` on the
  ``draft_input`` rows;
* the draft model itself (a forward hook): inside ``propose`` its first call is the pass over every
  ``draft_input`` row (teacher-forced: row t from the target's states at t and token t+1), its
  later calls are the draft decode steps, one row per request. The first call's rows give
  ``draft_topk`` (row t predicts token t+2); each request's sampled row of it (draft position 0)
  and its rows of the later calls (draft positions 1..K-1) are the draft's side of the request's
  next ``spec_chain`` row;
* the target: the final hidden states ``_model_forward`` returns (:mod:`.forward` keeps a
  reference until the step is sampled).

vLLM computes logits only for the rows it samples (a prefill's last row, every verify row, a
draft pass's sampled rows). The target's rows among them take vLLM's own logits: a wrapper of the
target model's ``compute_logits`` keeps a private copy of what it returns in a recorded step
(before the sampler scales or masks them in place), and at the commit the rows are mapped by the
sampler's ``logits_indices`` (:func:`logit_rows`). The plugin computes the logits of the other
rows it keeps itself (a prefill's rows, a step whose sampling was not seen,
``TENSORDIFF_REUSE_LOGITS=0``): the rows' final hidden states times the model's ``lm_head``
weight, cut to the vocabulary and scaled (and soft-capped) as vLLM's ``LogitsProcessor`` does;
both agree within float32 rounding of the product. Each table is a top-k job of the recorder
(:class:`~tensordiff.recorders.staging.TopkJob`): with staging on (the default on the CPU) it is
computed from a private copy of those rows with the other pending jobs at the next drain. A draft
with a reduced vocabulary has its ids mapped to the target's through its ``draft_id_to_target_id``
(``d2t``), as vLLM's ``compute_logits`` does. A vocab-sharded ``lm_head`` (tensor parallelism) is
gathered from the TP ranks once at start-up (:func:`gathered_head`), so every rank's file holds the
same tables at any TP size; a logits processor that takes logits as input gets no top-k tables,
with a warning.

At the commit of a target step (:mod:`.verify`) each verify segment whose first row is kept gets a
``spec_verify`` row (accepted drafts from the sampler's valid tokens, the first rejected
position, the draft tokens, the target's top-1 and log-prob of each draft token) and, when the
previous ``propose`` gave its chain, a ``spec_chain`` row.
"""

from __future__ import annotations

import os
import time

from ... import conventions
from .. import prediction_tables as tables
from ..prediction_tables import JoinedJob, PassTable
from .state import STATE

ENV_REUSE = "TENSORDIFF_REUSE_LOGITS"


def install_prediction_taps(runner, model) -> None:
    """The target's lm_head for ``target_topk`` and the tap on its ``compute_logits``; the draft's
    fc and forward hooks (an EAGLE-3 drafter only)."""
    st = STATE
    k = st.cfg.topk
    if k > 0:
        st.target_head = head_of(model, "target")
        if st.target_head is not None and reuse_logits() and callable(getattr(model, "compute_logits", None)):
            st.catalog_handles.append(InstancePatch(model, "compute_logits", _logits_tap(model.compute_logits)))
            st.prediction_taps += 1
    drafter = getattr(runner, "drafter", None)
    dm = getattr(drafter, "model", None)
    if dm is None or st.labels is None or not hasattr(dm, "register_forward_hook"):
        return
    fc = getattr(getattr(dm, "model", None), "fc", None)
    if fc is not None and hasattr(fc, "register_forward_hook"):
        st.catalog_handles.append(fc.register_forward_hook(_fc_hook))
        st.prediction_taps += 1
    else:
        st.warn_once("no-fc", "the draft model has no model.fc: no %s recorded", conventions.DRAFT_FC)
    if k <= 0:
        return
    head = head_of(dm, "draft")
    if head is None:
        return
    st.draft_head = head
    d2t = getattr(dm, "draft_id_to_target_id", None)
    if d2t is not None:
        import torch

        d2t = d2t.detach().reshape(-1).to("cpu", torch.int64)
        st.draft_id_map = d2t + torch.arange(len(d2t), dtype=torch.int64)
    st.catalog_handles.append(dm.register_forward_hook(_draft_hook))
    st.prediction_taps += 1
    if reuse_logits() and callable(getattr(dm, "compute_logits", None)):
        st.catalog_handles.append(InstancePatch(dm, "compute_logits", _draft_logits_tap(dm.compute_logits)))
        st.prediction_taps += 1


def reuse_logits() -> bool:
    """Whether the tables take vLLM's own logits where it computed them (``TENSORDIFF_REUSE_LOGITS``,
    default on; 0: the plugin computes every row from the final hidden states)."""
    return (os.environ.get(ENV_REUSE) or "1").strip().lower() not in ("0", "false", "no", "off")


def head_of(model, what: str):
    """(lm_head weight, vocabulary, scale or None, soft cap or None) of a vLLM model, the
    ``head`` of a :meth:`~tensordiff.recorders.core.Recorder.topk_job`; None (with a warning)
    when the plugin cannot compute the logits the model would."""
    st = STATE
    lm = getattr(model, "lm_head", None)
    lp = getattr(model, "logits_processor", None)
    w = getattr(lm, "weight", None)
    name = conventions.DRAFT_TOPK if what == "draft" else conventions.TARGET_TOPK
    if w is None or lp is None or getattr(w, "dim", lambda: 0)() != 2:
        st.warn_once(f"no-head-{what}", "the %s model has no plain lm_head and logits_processor: no %s recorded",
                     what, name)
        return None
    vocab = int(getattr(lp, "org_vocab_size", 0) or getattr(lp, "vocab_size", 0) or w.shape[0])
    if getattr(lp, "logits_as_input", False):
        st.warn_once(f"shard-{what}", "the %s model's logits processor takes logits: no %s recorded", what, name)
        return None
    if int(getattr(lm, "tp_size", 1) or 1) > 1 or w.shape[0] < vocab:
        # each TP rank holds a shard of the padded vocabulary, even where one shard is as wide as
        # the vocabulary (a draft's small one): rank k's rows are other tokens, or padding
        w = gathered_head(lm, w, vocab, what, name)
        if w is None:
            return None
    scale = float(getattr(lp, "scale", 1.0) or 1.0)
    cap = getattr(lp, "soft_cap", None)
    if cap is not None and scale != 1.0:  # vLLM caps, then scales; the recorder's head scales, then caps
        st.warn_once(f"cap-{what}", "the %s model's logits are soft-capped and scaled: no %s recorded", what, name)
        return None
    return w, vocab, (None if scale == 1.0 else scale), (float(cap) if cap else None)


def gathered_head(lm, w, vocab: int, what: str, name: str):
    """The whole ``lm_head`` weight of a vocab-sharded head (tensor parallelism): every TP rank's
    shard, gathered once at start-up, cut to the vocabulary. vLLM pads the vocabulary to whole
    shards and gathers the logits of the shards in rank order (``LogitsProcessor._get_logits``),
    so the shards in rank order are the padded vocabulary. Every TP rank of the stage runs this at
    the same step (its first scheduled one), so the collective is matched. Costs one copy of the
    head per rank; None (with a warning) where the layout is not that plain."""
    st = STATE
    tp = int(getattr(lm, "tp_size", 1) or 1)
    if tp <= 1 or int(getattr(lm, "num_added_embeddings", 0) or 0) > 0 or w.shape[0] * tp < vocab:
        st.warn_once(f"shard-{what}", "the %s model's lm_head is vocab-sharded in a layout the recorder does not "
                     "gather (added vocabulary, or %d rows x %d ranks < %d): no %s recorded", what, w.shape[0], tp,
                     vocab, name)
        return None
    from vllm.distributed import tensor_model_parallel_all_gather

    full = tensor_model_parallel_all_gather(w.detach().contiguous(), dim=0)
    return full[:vocab]


class InstancePatch:
    """A method replaced on one instance (``obj.name = fn``), undone by :meth:`remove` (the class's
    method shows through again), as a hook handle is."""

    def __init__(self, obj, name: str, fn):
        self.obj, self.name = obj, name
        setattr(obj, name, fn)

    def remove(self) -> None:
        try:
            delattr(self.obj, self.name)
        except AttributeError:
            pass


def _logits_tap(original):
    """The target's ``compute_logits``: in a recorded step (its forward done, its sampling not yet
    seen) a private float32 copy of the logits, taken before the sampler changes them in place
    (temperature, penalties, masks). Other calls (a dummy run, prompt log-probs after the sampling)
    pass through."""
    def compute_logits(*args, **kwargs):
        out = original(*args, **kwargs)
        st = STATE
        step = st.pending
        if step is None or step.hidden is None or step.logits is not None or not st.active or out is None:
            return out
        t0 = time.perf_counter()
        try:
            step.logits = _private_logits(out)
        except Exception as e:  # noqa: BLE001
            st.fail("target logits", e)
        st.add_seconds(time.perf_counter() - t0)
        return out
    return compute_logits


def _draft_logits_tap(original):
    """The draft's ``compute_logits`` inside ``propose``: a private copy of each call's logits, in
    the draft's own vocabulary (an EAGLE-3 draft with a reduced vocabulary returns them spread over
    the target's, -inf elsewhere: its ``d2t`` columns are taken back). The first call is the first
    pass's sampled rows (``token_indices_to_sample``), each later one a draft decode step."""
    def compute_logits(*args, **kwargs):
        out = original(*args, **kwargs)
        st = STATE
        ctx = st.draft_ctx
        if ctx is None or out is None or not st.active or st.cfg.topk <= 0:  # no tables: nothing to copy
            return out
        t0 = time.perf_counter()
        try:
            ctx.setdefault("logits", []).append(_draft_columns(out))
        except Exception as e:  # noqa: BLE001
            st.fail("draft logits", e)
        st.add_seconds(time.perf_counter() - t0)
        return out
    return compute_logits


def _draft_columns(x):
    """A private float32 copy of the draft's logits in its own vocabulary (None: not that shape)."""
    import torch

    st = STATE
    head, cols = st.draft_head, st.draft_id_map
    if head is None or x.dim() != 2:
        return None
    if cols is None:
        return _private_logits(x) if x.shape[-1] == head[1] else None
    got = st.draft_cols
    if got is None or got[0] is not cols:  # the map as numpy, its largest id and whether it is every column in order, once
        import numpy as np

        c = cols.numpy()
        got = st.draft_cols = (cols, c, int(cols.max()) if len(cols) else -1,
                               bool(np.array_equal(c, np.arange(len(c)))))
    if len(cols) != head[1] or got[2] >= x.shape[-1]:
        return None
    x = x.detach()
    if x.device.type == "cpu" and x.dtype == torch.float32:
        a = x.numpy()
        if got[3] and a.shape[-1] == len(got[1]):  # a draft over the whole vocabulary: every column, in order
            return torch.from_numpy(a.copy())
        return torch.from_numpy(a.take(got[1], axis=1))  # the draft's columns only, a copy of its own
    if x.device.type == "cpu":
        from ..staging import host_f32

        return host_f32(x.index_select(1, cols))
    return x.index_select(1, cols.to(x.device)).float()


def _private_logits(x):
    from ..staging import host_f32

    x = x.detach()
    if x.dim() != 2:
        return None
    return host_f32(x) if x.device.type == "cpu" else x.float().clone()


def logit_rows(step, n_logits: int, meta):
    """The pass row of each row of the logits vLLM sampled from (-1: a request scheduled no rows),
    or None where they do not match the step: with drafts scheduled, the spec metadata's
    ``logits_indices``; otherwise each request's last row, in batch order
    (``query_start_loc[1:] - 1``)."""
    import numpy as np

    if meta is not None:
        idx = getattr(meta, "logits_indices", None)
        if idx is None:
            return None
        if hasattr(idx, "detach"):
            idx = idx.detach()
            idx = idx.numpy() if idx.device.type == "cpu" else idx.cpu().numpy()
        got = np.array(idx, dtype=np.int64).reshape(-1)  # a copy: the step may be recorded later
    else:
        got = np.full(step.num_reqs, -1, dtype=np.int64)
        for (_, s, c, _, _), bi in zip(step.segments, step.batch_idx):
            if bi < len(got):
                got[bi] = s + c - 1
    T = len(step.pos)
    if len(got) != n_logits or (got >= T).any():
        return None
    return got


def _own(x):
    """``x``, or on an accelerator a copy: a CUDA graph's replay returns its output buffer, which
    the next replay overwrites before the propose is over (on the CPU every pass makes new
    tensors, and the recorder's jobs copy the rows they keep when they are made)."""
    return x if x.device.type == "cpu" else x.detach().clone()


def _fc_hook(module, args, output) -> None:
    ctx = STATE.draft_ctx
    if ctx is not None and ctx.get("fc") is None:
        ctx["fc"] = _own(output[0] if isinstance(output, (tuple, list)) else output)


def _draft_hook(module, args, output) -> None:
    ctx = STATE.draft_ctx
    if ctx is not None:
        ctx["outs"].append(_own(output[0] if isinstance(output, (tuple, list)) else output))


def record_draft_predictions(ctx: dict, rows, n: int, keys: list) -> None:
    """After ``draft_input`` is recorded on ``rows`` (the draft pass's first ``n`` rows): the fc
    output, the draft's top-k on the rows kept, and each request's chain for its next verify
    step (``keys``: the sequence key of each request of the drafter batch, None where none)."""
    import numpy as np

    st = STATE
    fc = ctx.get("fc")
    if fc is not None and fc.shape[0] >= n:
        tables.record_fc(st, fc[:n], rows, "draft model.fc output (combine_hidden_states) in propose")
    st.chain = {}
    outs = ctx["outs"]
    if st.draft_head is None or st.cfg.topk <= 0 or not ctx.get("aligned") or not outs or outs[0].shape[0] < n:
        return
    k = st.cfg.topk
    rec = st.rec
    head, id_map = st.draft_head, st.draft_id_map
    h0 = outs[0][:n]
    need = tables.kept_rows(rec, rows)
    sample = ctx.get("sample")
    if sample is not None:
        sample = np.asarray(sample, dtype=np.int64)
        if not len(sample) or sample.max() >= n or sample.min() < 0:
            sample = None
    # vLLM's own logits of the draft: the first pass's sampled rows, then each decode step's rows
    lg = ctx.get("logits") or []
    if len(lg) != len(outs) or any(x is None for x in lg) or sample is None or lg[0].shape[0] != len(sample):
        lg = []
    where = None
    if lg:
        where = np.full(n, -1, dtype=np.int64)
        where[sample] = np.arange(len(sample))
    table = None
    if len(need):
        job = _joined_job(h0, head, id_map, lg[0] if lg else None, where, need)
        table = PassTable(job, n, need)
        tables.record_topk(st, conventions.DRAFT_TOPK, table, rows, 1,
                           "draft model's final hidden states in propose times its lm_head, mapped to target ids; "
                           "the rows vLLM sampled from: its own logits (compute_logits)")
    if sample is None:
        return
    b = len(sample)
    if b != len(keys):
        return
    # draft position 0: each request's sampled row of the first pass, a draft_topk row where it is kept
    first = table.refs(sample) if table is not None else [None] * b
    missing = [i for i, ref in enumerate(first) if ref is None and keys[i] is not None]
    if missing:
        if lg:
            extra = rec.topk_job(k, logits=lg[0], id_map=id_map, rows=np.asarray(missing, dtype=np.int64))
            st.logits_reused += len(missing)
        else:
            extra = rec.topk_job(k, hidden=h0, head=head, id_map=id_map, rows=sample[missing])
        for j, i in enumerate(missing):
            first[i] = (extra, j)
    jobs = []
    for j, o in enumerate(outs[1:], 1):  # the draft decode steps: one row per request
        if o.shape[0] < b:
            st.warn_once("chain", "a draft decode step without one row per request; draft positions after 0 get "
                         "no distributions")
            return
        if lg and lg[j].shape[0] >= b:
            jobs.append(_logits_job(lg[j], id_map, np.arange(b)))
            st.logits_reused += b
        else:
            jobs.append(rec.topk_job(k, hidden=o[:b], head=head, id_map=id_map))
    st.chain = {key: [first[i]] + [(job, i) for job in jobs] for i, key in enumerate(keys) if key is not None}
    st.chain_step = ctx["step"].step


def commit_predictions(step, spec: list, unseen: bool = False) -> None:
    """At the commit of ``step`` (its ``rows`` set): ``target_topk`` on the kept rows, and the
    ``spec_verify`` / ``spec_chain`` rows of the verify segments ``spec`` = [(sequence key, first
    row, K, accepted drafts)] (segments whose first row is kept and whose sampling was seen).
    ``unseen``: the step's sampling result was not seen (it is committed late)."""
    import numpy as np

    st = STATE
    rec = st.rec
    rows = step.rows
    T = len(rows)
    hidden, step.hidden = step.hidden, None
    logits, step.logits = step.logits, None
    if hidden is not None and unseen and hidden.device.type != "cpu":
        hidden = None  # committed late (its sampling unseen): the engine's buffer may hold a later pass
    pred = None
    where = None  # pass row -> row of vLLM's logits (-1: none)
    if st.target_head is not None and st.cfg.topk > 0 and hidden is not None and hidden.shape[0] >= T:
        need = tables.kept_rows(rec, rows)
        extra = [np.arange(s, s + K, dtype=np.int64) for _, s, K, _ in spec]
        allneed = np.union1d(need, np.concatenate(extra)) if extra else need
        where = _logits_map(step, logits, T)
        if len(allneed):
            pred = PassTable(_joined_job(hidden[:T], st.target_head, None, logits, where, allneed), T, allneed)
            if len(need):
                tables.record_topk(st, conventions.TARGET_TOPK, pred, rows, 0,
                                   "target final hidden states (_model_forward) times its lm_head, rows kept; "
                                   "the rows vLLM sampled from: its own logits (compute_logits)")
    by_k: dict[int, list] = {}
    for seg in spec:
        if seg[2] > 0:
            by_k.setdefault(seg[2], []).append(seg)
    for K, segs in sorted(by_k.items()):
        _steps_and_chains(step, K, segs, pred, hidden, logits, where)


def _logits_map(step, logits, T: int):
    """Pass row -> row of ``logits`` (vLLM's, -1 where it computed none), or None where they
    cannot be used (none kept, another vocabulary, rows that do not match the step)."""
    import numpy as np

    st = STATE
    lr = step.logit_rows
    if logits is None or lr is None:
        return None
    if logits.shape[-1] != st.target_head[1] or logits.shape[0] != len(lr):
        st.warn_once("logits-shape", "vLLM's logits are %s for %d sampled rows and a vocabulary of %d: the plugin "
                     "computes every row's logits itself", tuple(logits.shape), len(lr), st.target_head[1])
        return None
    where = np.full(T, -1, dtype=np.int64)
    ok = lr >= 0
    where[lr[ok]] = np.flatnonzero(ok)
    return where


def _joined_job(hidden, head, id_map, logits, where, allneed):
    """The top-k job of the pass rows ``allneed``: vLLM's ``logits`` where it computed them
    (``where``: pass row -> its row there, -1: none; None: no logits), the plugin's product of the
    final hidden states and the lm_head ``head`` elsewhere (one job each, joined)."""
    import numpy as np

    st = STATE
    rec, k = st.rec, st.cfg.topk
    if where is None or logits is None:
        return rec.topk_job(k, hidden=hidden, head=head, id_map=id_map, rows=allneed)
    src = where[allneed]
    got = src >= 0
    st.logits_reused += int(np.count_nonzero(got))
    if got.all():
        return _logits_job(logits, id_map, src)
    if not got.any():
        return rec.topk_job(k, hidden=hidden, head=head, id_map=id_map, rows=allneed)
    a = _logits_job(logits, id_map, src[got])
    b = rec.topk_job(k, hidden=hidden, head=head, id_map=id_map, rows=allneed[~got])
    return JoinedJob([(a, np.flatnonzero(got)), (b, np.flatnonzero(~got))], len(allneed))


def _logits_job(logits, id_map, rows):
    """The top-k job of rows ``rows`` of ``logits``, a private copy the tap made (nobody writes it):
    where they are all of its rows in order, the job keeps it as it is (no second copy)."""
    import numpy as np

    st = STATE
    n = logits.shape[0]
    if len(rows) == n and np.array_equal(rows, np.arange(n)):
        return st.rec.topk_job(st.cfg.topk, logits=logits, id_map=id_map, private=True)
    return st.rec.topk_job(st.cfg.topk, logits=logits, id_map=id_map, rows=rows)


def _steps_and_chains(step, K: int, segs: list, pred, hidden, logits=None, where=None) -> None:
    import numpy as np

    from ..staging import Later

    st = STATE
    m = len(segs)
    starts = np.array([s for _, s, _, _ in segs], dtype=np.int64)
    acc = np.array([a for _, _, _, a in segs], dtype=np.int64)
    steps = np.full((m, 3 + 3 * K), np.nan)
    steps[:, 0] = acc
    steps[:, 1] = K
    steps[:, 2] = np.where(acc < K, acc, -1)
    at = starts[:, None] + np.arange(K, dtype=np.int64)[None, :]  # verify rows 0..K-1 of each segment
    steps[:, 3:3 + K] = step.ids[at + 1]  # the draft tokens: the inputs of verify rows 1..K
    rows = step.rows[starts]
    # a chain is the propose's right before this step (the one that drafted its tokens), or none
    fresh = st.chain_step is not None and st.chain_step == step.step - 1
    chains = [st.chain.pop(key, None) if fresh else None for key, _, _, _ in segs]
    if pred is None:
        tables.record_steps(st, rows, steps, steps.shape[1])
        return
    flat, tokens = at.reshape(-1), steps[:, 3:3 + K].reshape(-1).astype(np.int64)
    if where is not None and (where[flat] >= 0).all():  # the same logits as the row's top-k table
        logit_next = _logits_of(logits, where[flat], tokens)
    else:
        logit_next = _logits_at(hidden, flat, tokens, st.target_head)

    def blocks():
        """The target's top-k rows at each segment's draft positions [m, K, width]."""
        return pred.full()[at]

    def step_rows():
        b = blocks()
        steps[:, 3 + K:3 + 2 * K] = b[:, :, 0]
        steps[:, 3 + 2 * K:] = logit_next.reshape(m, K) - b[:, :, -1]
        return steps

    tables.record_steps(st, rows, Later(steps.shape[1], step_rows), steps.shape[1])
    tables.record_chain_rows(st, rows, chains, blocks, pred.width, K)


def _logits_at(hidden, at, tokens, head):
    """The logit of token ``tokens[i]`` at pass row ``at[i]`` (float64), as the recorder's head
    computes a row's logits (the log-prob of each draft token, in or out of the top-k)."""
    import numpy as np
    import torch

    from ..staging import head_scale

    w, vocab, scale, cap = head
    if not len(at) or tokens.max() >= vocab or tokens.min() < 0:
        return np.full(len(at), np.nan)
    dev = hidden.device
    h = hidden.index_select(0, torch.from_numpy(at).to(dev)).to(w.dtype).float()  # the head's input dtype
    x = (h * w.index_select(0, torch.from_numpy(tokens).to(w.device)).float()).sum(-1)
    return head_scale(x, scale, cap).detach().to("cpu", torch.float64).numpy()


def _logits_of(logits, at, tokens):
    """The logit of token ``tokens[i]`` in row ``at[i]`` of vLLM's logits (float64)."""
    import numpy as np
    import torch

    if not len(at) or tokens.max() >= logits.shape[-1] or tokens.min() < 0:
        return np.full(len(at), np.nan)
    if logits.device.type == "cpu" and logits.dtype == torch.float32:  # numpy's indexing: no torch op
        return logits.detach().numpy()[at, tokens].astype(np.float64)
    dev = logits.device
    x = logits[torch.from_numpy(at).to(dev), torch.from_numpy(tokens).to(dev)]
    return x.detach().to("cpu", torch.float64).numpy()
