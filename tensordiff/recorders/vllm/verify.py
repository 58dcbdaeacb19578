"""Verify acceptance: AFTER ``GPUModelRunner._sample``, the sampled / accepted tokens decide which
rows of the held target step are kept, then they are written.

A verify segment (a request with scheduled draft tokens) keeps rows ``j < number of valid sampled
tokens`` (its last token and the accepted drafts); rows of rejected drafts are dropped, as are rows
past ``max_tokens``. Prefill and decode segments keep every row (up to ``max_tokens``). Then the
step's ``aux_hidden_states`` and catalog stash are recorded on the kept rows, and the step becomes
the one the drafter reads.
"""

from __future__ import annotations

import time

from .. import serving
from .config import AUX
from .predictions import commit_predictions, logit_rows
from .rl import record_sampled
from .state import STATE, Step


def hook_sample(out, runner, *args, **kwargs) -> None:
    st = STATE
    step = st.pending
    if step is None or not st.active:
        return
    st.pending = None
    t0 = time.perf_counter()
    try:
        sampled = getattr(out, "sampled_token_ids", None)
        sampled = to_numpy_2d(sampled) if sampled is not None else None
        meta = None
        if step.logits is not None:  # vLLM's logits of the step: which pass row each one is
            meta = kwargs.get("spec_decode_metadata", args[1] if len(args) > 1 else None)
        if deferrable(step, out):
            # the engine may reuse the sampler's buffers: the step keeps its own copies
            sampled = sampled.copy() if sampled is not None else None
            meta = HeldIndices(meta) if meta is not None else None
            st.last = step  # the drafter's pass reads this step (its records are made first, in order)
            st.defer(commit_phases(step, sampled, meta), held_bytes(step.aux, step.hidden, step.logits), step=True)
        else:
            if step.logits is not None:
                step.logit_rows = logit_rows(step, step.logits.shape[0], meta)
            with st.lock:
                st.run_queue()
                commit(step, sampled)
                record_sampled(step, out, runner)
    except Exception as e:  # noqa: BLE001
        st.fail("target step", e)
    st.add_seconds(time.perf_counter() - t0)
    try:
        st.flush()  # when due (it times itself)
        st.last_activity = time.monotonic()
    except Exception as e:  # noqa: BLE001
        st.fail("target step", e)


def deferrable(step: Step, out) -> bool:
    """Whether the step's records may be made later (:meth:`State.defer`): every tensor it holds
    is its own on the CPU (the forward's new hidden states, the plugin's copies of logits and of
    the catalog and zoom taps' values; an accelerator's buffers are replayed over by the next
    step), and no sampled log-probs are to be read from this step's sampler output (the RL
    records read it now)."""
    st = STATE
    if st.queue_steps <= 1:
        return False
    for t in (step.aux, step.hidden, step.logits):
        if t is not None and t.device.type != "cpu":
            return False
    for _, _, t in step.stash:
        if t.device.type != "cpu":
            return False
    from .rl import RL

    return not RL.enabled or getattr(out, "logprobs_tensors", None) is None


def held_bytes(*ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts if t is not None)


class HeldIndices:
    """The spec metadata's ``logits_indices`` of a deferred step, a copy of its own."""

    __slots__ = ("logits_indices",)

    def __init__(self, meta):
        import numpy as np

        idx = getattr(meta, "logits_indices", None)
        if idx is not None and hasattr(idx, "detach"):
            idx = idx.detach()
            idx = idx.numpy() if idx.device.type == "cpu" else idx.cpu().numpy()
        self.logits_indices = np.array(idx, dtype=np.int64).reshape(-1) if idx is not None else None


def commit_phases(step: Step, sampled, meta=None) -> tuple:
    """A deferred :func:`commit` (no RL log-probs to record: :func:`deferrable`) in its three
    phases (:meth:`State.run_queue` runs each phase of every queued step before the next phase):
    the kept rows to the token table, the held states, the predictions. ``meta``: the
    :class:`HeldIndices` of its logits."""
    st = STATE
    held: list = []

    def rows() -> None:
        try:
            with st.lock:
                if step.logits is not None:
                    step.logit_rows = logit_rows(step, step.logits.shape[0], meta)
                held.append(commit_rows(step, sampled))
        except Exception as e:  # noqa: BLE001
            st.fail("target step", e)

    def states() -> None:
        try:
            with st.lock:
                commit_states(step)
        except Exception as e:  # noqa: BLE001
            st.fail("target step", e)

    def predictions() -> None:
        try:
            with st.lock:
                commit_step_predictions(step, held[0], sampled is None)
        except Exception as e:  # noqa: BLE001
            st.fail("target step", e)

    return rows, states, predictions


def commit_later(step: Step, sampled, meta=None) -> None:
    """:func:`commit_phases`, one after the other."""
    for phase in commit_phases(step, sampled, meta):
        if STATE.broken:
            return
        phase()


def to_numpy_2d(t):
    import torch

    if isinstance(t, torch.Tensor):
        x = t.detach().cpu().numpy()
        return x.reshape(x.shape[0], -1)
    return None


def commit(step: Step, sampled) -> None:
    """Write the rows of a step that the request keeps, then its held tensors and its predictions.
    ``sampled``: the sampler's token ids per batch row (-1 padded), or None when the sampling
    result was not seen."""
    spec = commit_rows(step, sampled)
    commit_states(step)
    commit_step_predictions(step, spec, sampled is None)


def commit_rows(step: Step, sampled) -> list:
    """The first phase of :func:`commit`: the rows the requests keep to the token table (their
    trace rows in ``step.rows``, what the drafter reads of them). Returns the verify segments whose
    sampling was seen: [(sequence key, first row, K, accepted drafts)]."""
    import numpy as np

    st = STATE
    T = len(step.pos)
    step.rows = np.full(T, -1, dtype=np.int64)
    spec = []  # verify segments whose sampling was seen: (key, first row, K, accepted drafts)
    # each request's sampled tokens (-1 padding dropped) and how many rows of its segment it keeps
    # before max_tokens: plain ints, one pass over the step's arrays for the rest
    got_of = sampled.tolist() if sampled is not None else None
    gots, counts, lims, S, C = [], [], [], [], []
    for i, ((key, s, c, n_spec, _), regime) in enumerate(zip(step.segments, step.regimes)):
        bi = step.batch_idx[i]  # the sampler's row of this request
        got = [t for t in got_of[bi] if t >= 0] if got_of is not None and bi < len(got_of) else None
        n = c
        if n_spec and regime == "target_verify":
            if got is not None:
                n = min(c, max(1, len(got)))  # accepted drafts + the bonus token
                spec.append((key, s, n_spec, min(max(len(got) - 1, 0), n_spec)))
            else:
                n = 1  # only the request's last token is certainly kept
        lim = step.limits[i]
        gots.append(got)
        counts.append(n)
        lims.append(lim if lim is not None else _NO_LIMIT)
        S.append(s)
        C.append(c)
    if S:
        _keep_rows(step, S, C, counts, lims, gots)
    st.dirty = True
    return spec


def commit_states(step: Step) -> None:
    """The second phase of :func:`commit`: the step's aux states and catalog stash on its kept rows."""
    st = STATE
    rec = st.rec
    if step.aux is not None and (step.rows >= 0).any():
        record_aux(step.aux, step.rows)
    for kind, b, value in step.stash:
        if kind.startswith("tap:"):   # TENSORDIFF_ZOOM (.zoom)
            from .zoom import record_zoom_tap

            record_zoom_tap(rec, kind, value, step.rows)
        elif kind == "final_norm":
            rec.final_norm(value, step.rows, values=st.cfg.wants_values("final_norm"))
        else:
            from ...vocab import boundary_label
            rec.boundary(b, value, step.rows, values=st.cfg.wants_values(boundary_label(b)))
    step.stash.clear()  # step.aux is kept for the drafter: draft_input may repeat its bits (drafter.py)


def commit_step_predictions(step: Step, spec: list, unseen: bool) -> None:
    """The last phase of :func:`commit`: the step's top-k tables and the verify segments' rows
    (``spec`` from :func:`commit_rows`); then it is the step the drafter reads."""
    commit_predictions(step, [v for v in spec if step.rows[v[1]] >= 0], unseen=unseen)
    STATE.last = step


def _keep_rows(step: Step, S: list, C: list, counts: list, lims: list, gots: list) -> None:
    """The kept rows of ``step`` (segment i keeps its first ``counts[i]`` rows, those at positions
    below ``lims[i]``) to the token table, and what the drafter and the RL records read of them."""
    import numpy as np

    st = STATE
    T = len(step.pos)
    seg_c = np.asarray(C, dtype=np.int64)
    first = np.asarray(S, dtype=np.int64)
    local = np.arange(T, dtype=np.int64) - np.repeat(first, seg_c)
    head = local < np.repeat(np.asarray(counts, dtype=np.int64), seg_c)
    within = step.pos < np.repeat(np.asarray(lims, dtype=np.int64), seg_c)  # rows past max_tokens go
    keep = head & within
    # rows past max_tokens among those kept: the sampled token is not at last + 1
    cut = np.add.reduceat(head & ~within, first).tolist()
    kept = np.add.reduceat(keep, first)
    idx = np.flatnonzero(keep)
    n_kept = len(idx)
    st.rows_dropped += T - n_kept
    if n_kept:
        out = _add_rows(step, idx, kept.tolist())
        step.rows[idx] = out
        st.rows_written += n_kept
        ends = np.cumsum(kept)
        last_row = np.where(kept > 0, idx[np.maximum(ends - 1, 0)], -1).tolist()
        last_pos = step.pos[np.maximum(last_row, 0)].tolist()
        for i, (key, _, _, _, _) in enumerate(step.segments):
            r = last_row[i]
            if r < 0:
                continue
            # the token after the last kept row (the drafter's shift check reads the kept rows' own
            # ids from the step): the next prompt token of a partial prefill, or the token the
            # target sampled
            last = last_pos[i] + 1
            acc = gots[i]
            if last < step.prompt_lens[i]:
                rs_tok = prompt_token(step, i, last)
                if rs_tok is not None:
                    step.next_tok[(key, last)] = rs_tok
            elif acc and not cut[i]:
                step.next_tok[(key, last)] = int(acc[-1])
                if step.regimes[i] != "target_verify":
                    step.sampled.append((i, int(step.rows[r]), int(acc[0])))


_NO_LIMIT = 1 << 62  # a request without max_tokens: no position is past it


def _add_rows(step: Step, idx, kept: list):
    """The token rows of the kept pass rows ``idx`` (``kept[i]`` of segment i, in order): one
    ``add_token_runs`` per run of segments of one regime. Returns their trace rows."""
    import numpy as np

    rec = STATE.rec
    pos, ids = step.pos[idx], step.ids[idx]
    outs = []
    a = off = 0
    m = len(kept)
    while a < m:
        z = a + 1
        while z < m and step.regimes[z] == step.regimes[a]:
            z += 1
        n = sum(kept[a:z])
        if n:
            outs.append(rec.add_token_runs([seg[0] for seg in step.segments[a:z]], kept[a:z], pos[off:off + n],
                                           ids[off:off + n], regime=step.regimes[a], step=step.step))
        off += n
        a = z
    return outs[0] if len(outs) == 1 else np.concatenate(outs)


def prompt_token(step: Step, i: int, p: int) -> int | None:
    ids = step.prompts.get(i)
    return int(ids[p]) if ids is not None and p < len(ids) else None


def record_aux(aux, rows) -> None:
    st = STATE
    h = st.model.get("hidden_size") or 0
    if aux.shape[-1] != len(st.labels) * h:
        st.warn_once("aux-width", "aux hidden states are %d wide, not %d slots x %d; not recorded",
                     aux.shape[-1], len(st.labels), h)
        return
    serving.packed(st.rec, AUX, aux, rows, labels=st.labels, raw_ids=st.raw_ids, convention=st.convention,
                  token_offset=0, role="aux", values=st.cfg.wants_values(AUX), remember=True,
                  private=True,  # the step's own torch.cat of the aux states: nobody writes it
                  attrs={"source": "target model aux_hidden_states (EagleModelMixin._maybe_add_hidden_state), "
                                   "packed in capture order"})
