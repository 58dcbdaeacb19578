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
        if step.logits is not None:  # vLLM's logits of the step: which pass row each one is
            meta = kwargs.get("spec_decode_metadata", args[1] if len(args) > 1 else None)
            step.logit_rows = logit_rows(step, step.logits.shape[0], meta)
        with st.lock:
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


def to_numpy_2d(t):
    import torch

    if isinstance(t, torch.Tensor):
        x = t.detach().cpu().numpy()
        return x.reshape(x.shape[0], -1)
    return None


def commit(step: Step, sampled) -> None:
    """Write the rows of a step that the request keeps, then its held tensors. ``sampled``: the
    sampler's token ids per batch row (-1 padded), or None when the sampling result was not seen."""
    import numpy as np

    st = STATE
    rec = st.rec
    T = len(step.pos)
    step.rows = np.full(T, -1, dtype=np.int64)
    spec = []  # verify segments whose sampling was seen: (key, first row, K, accepted drafts)
    for i, ((key, s, c, n_spec, _), regime) in enumerate(zip(step.segments, step.regimes)):
        keep = np.arange(s, s + c)
        bi = step.batch_idx[i]  # the sampler's row of this request
        got = sampled[bi][sampled[bi] >= 0] if sampled is not None and bi < sampled.shape[0] else None
        acc = got
        if n_spec and regime == "target_verify":
            if got is not None:
                keep = keep[:max(1, len(got))]  # accepted drafts + the bonus token
                spec.append((key, s, n_spec, min(max(len(got) - 1, 0), n_spec)))
            else:
                keep = keep[:1]  # only the request's last token is certainly kept
        lim = step.limits[i]
        cut = False
        if lim is not None:
            within = step.pos[keep] < lim
            cut = not within.all()  # rows past max_tokens: the sampled token is not at last + 1
            keep = keep[within]
        st.rows_dropped += c - len(keep)
        if len(keep):
            step.rows[keep] = rec.add_tokens(key, step.pos[keep], step.ids[keep], regime=regime, step=step.step)
            st.rows_written += len(keep)
            # the token after the last kept row (the drafter's shift check reads the kept rows' own
            # ids from the step): the next prompt token of a partial prefill, or the token the target
            # sampled
            last = int(step.pos[keep[-1]]) + 1
            if last < step.prompt_lens[i]:
                rs_tok = prompt_token(step, i, last)
                if rs_tok is not None:
                    step.next_tok[(key, last)] = rs_tok
            elif acc is not None and len(acc) and not cut:
                step.next_tok[(key, last)] = int(acc[-1])
                if regime != "target_verify":
                    step.sampled.append((i, int(step.rows[keep[-1]]), int(acc[0])))
    st.dirty = True
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
    commit_predictions(step, [v for v in spec if step.rows[v[1]] >= 0], unseen=sampled is None)
    st.last = step


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
