"""Forward capture: AROUND ``GPUModelRunner.execute_model`` and, inside it, AROUND
``GPUModelRunner._model_forward`` (the target's forward; ``CPUModelRunner`` inherits both).

``execute_model``: one recorded step per call that schedules tokens; opens the trace on the first
one (the target is loaded and ``set_aux_hidden_state_layers`` has run by then, see
:mod:`.startup`). ``_model_forward``: the token key of every row (request, absolute position, input
id: ``input_batch.req_ids`` in batch order, ``num_scheduled_tokens`` rows each) and the aux states
the model returns with ``use_aux_hidden_state_outputs`` (``(hidden_states, [aux_0, ...,
aux_{K-1}])``), packed in the order vLLM captured them (``model.aux_hidden_state_layers``, sorted).
The step is held until its sampling result is known (:mod:`.verify`).
"""

from __future__ import annotations

import time

from .rl import before_step
from .startup import setup
from .state import STATE, Step
from .verify import commit


def hook_execute_model(original, runner, scheduler_output, *args, **kwargs):
    st = STATE
    if st.cfg is None or st.broken or st.closed:
        return original(runner, scheduler_output, *args, **kwargs)
    n = int(getattr(scheduler_output, "total_num_scheduled_tokens", 0) or 0)
    if st.role is None and n > 0:
        try:
            setup(runner)
        except Exception as e:  # noqa: BLE001
            st.role = "off"
            st.fail("start-up", e)
    if not st.active or n == 0:
        return original(runner, scheduler_output, *args, **kwargs)
    st.last_activity = time.monotonic()
    if st.pending is not None:  # a step whose sampling we did not see: keep what is certain
        try:
            st.drain_queue()  # the records deferred before it first (timed there)
            t0 = time.perf_counter()
            with st.lock:
                commit(st.pending, None)
            st.add_seconds(time.perf_counter() - t0)
        except Exception as e:  # noqa: BLE001
            st.fail("target step", e)
    before_step()  # weights loaded since the last step: fingerprinted before it runs (timed there)
    st.sched = scheduler_output
    st.forwarded = False
    try:
        return original(runner, scheduler_output, *args, **kwargs)
    finally:
        st.sched = None
        st.ctx = None


def to_numpy(t):
    import numpy as np
    import torch

    if isinstance(t, torch.Tensor):
        t = t.detach()
        if t.device.type == "cpu":  # numpy's view and reshape: no torch op per call
            return t.numpy().reshape(-1)
        return t.reshape(-1).cpu().numpy()
    return np.asarray(t).reshape(-1)


def hook_model_forward(original, runner, *args, **kwargs):
    st = STATE
    if st.sched is None or st.forwarded or not st.active:
        return original(runner, *args, **kwargs)
    st.forwarded = True
    t0 = time.perf_counter()
    step = None
    try:
        step = begin_step(runner, st.sched, kwargs.get("input_ids", args[0] if args else None),
                          kwargs.get("positions", args[1] if len(args) > 1 else None))
    except Exception as e:  # noqa: BLE001
        st.fail("target step", e)
    st.add_seconds(time.perf_counter() - t0)
    st.ctx = step
    try:
        out = original(runner, *args, **kwargs)
    finally:
        st.ctx = None
    if step is None or not st.active:
        return out
    t0 = time.perf_counter()
    try:
        if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], (list, tuple)):
            aux = out[1]
            T = len(step.pos)
            if st.labels is not None and len(aux) == len(st.labels) and aux[0].shape[0] >= T:
                import torch
                step.aux = torch.cat([a[:T] for a in aux], dim=-1)
            elif st.labels is not None:
                st.warn_once("aux-shape", "the model returned %d aux states for %d slots; not recorded",
                             len(aux), len(st.labels))
            if st.target_head is not None and st.cfg.topk > 0:
                step.hidden = out[0]  # until the step is sampled (top-k of the rows it keeps)
        elif st.target_head is not None and st.cfg.topk > 0 and hasattr(out, "shape"):
            step.hidden = out
        st.pending, st.commit_pending = step, commit
    except Exception as e:  # noqa: BLE001
        st.fail("target step", e)
    st.add_seconds(time.perf_counter() - t0)
    return out


def begin_step(runner, sched, input_ids, positions) -> Step | None:
    import numpy as np

    st = STATE
    req_ids = list(runner.input_batch.req_ids)
    counts = [int(sched.num_scheduled_tokens.get(r, 0)) for r in req_ids]
    T = sum(counts)
    if input_ids is None:
        st.warn_once("no-ids", "a step ran from input embeddings (no input ids): not recorded")
        return None
    if positions is not None and getattr(positions, "ndim", 1) == 2:  # M-RoPE [3, T]: the text position
        positions = positions[0]
    ids = to_numpy(input_ids[:T]).astype(np.int64)
    pos = to_numpy(positions[:T]).astype(np.int64) if positions is not None else None
    if pos is None or len(ids) != T or len(pos) != T:
        st.warn_once("rows", "a step's input ids / positions do not match its %d scheduled tokens; not recorded", T)
        return None
    spec = getattr(sched, "scheduled_spec_decode_tokens", None) or {}
    segments, regimes, prompt_lens, limits = [], [], [], []
    start = 0
    batch_idx = []
    for bi, (r, c) in enumerate(zip(req_ids, counts)):
        if c == 0:
            continue
        rs = runner.requests.get(r)
        plen = len(getattr(rs, "prompt_token_ids", None) or []) if rs is not None else 0
        n_spec = len(spec.get(r) or ())
        if pos[start] < plen:
            regime = "prefill"
        elif n_spec:
            regime = "target_verify"
        else:
            regime = "decode"
        mt = getattr(getattr(rs, "sampling_params", None), "max_tokens", None)
        segments.append((st.seq_key(r), start, c, n_spec, r))
        batch_idx.append(bi)
        regimes.append(regime)
        prompt_lens.append(plen)
        limits.append(plen + int(mt) if mt is not None and plen else None)
        start += c
    st.step_no += 1
    step = Step(st.step_no, segments, pos, ids, regimes, prompt_lens, limits)
    step.batch_idx = batch_idx
    step.num_reqs = len(req_ids)
    for i, ((_, _, _, _, r), regime) in enumerate(zip(segments, regimes)):
        if regime == "prefill":
            step.prompts[i] = getattr(runner.requests.get(r), "prompt_token_ids", None)
    return step
