"""The RL records of the vLLM plugin (the same records as the SGLang plugin's, :mod:`..sglang.rl`).

* ``sampled_logprob``: per generated token, the log-prob vLLM's sampler returned for the token it
  sampled (``SamplerOutput.logprobs_tensors``, column 0: the sampled token's, what a request with
  ``SamplingParams(logprobs=k)`` receives first), on the row that sampled it: the last kept row of
  each request in the step (not a partial prefill chunk, not past ``max_tokens``). Requests that
  ask for no log-probs have none (vLLM computes none for them). Verify steps are left out.
* the ``sampling`` attribute: temperature, top-p, top-k, min-p of each request
  (``runner.requests[r].sampling_params``) and vLLM's ``logprobs_mode`` (``raw_logprobs``, the V1
  default: raw; ``processed_logprobs``: processed; the ``*_logits`` modes are kept as given in
  ``vllm_logprobs_mode``).
* weight fingerprints of the Worker's own shard: ``/weights/step_0`` when the trace opens; a call
  of the model's ``load_weights`` after that (how RL frameworks push new weights into a vLLM
  worker) marks the weights changed, and the next step first fingerprints them as the next
  weight step (however many buckets were loaded in between: one step per sync).

* a replay (``record serve --replay``): the ``replay`` attribute. Its rows are prefill rows of
  every rollout token, as with SGLang; unlike SGLang's, no ``sampled_logprob`` rows are taken
  from vLLM's prompt log-probs (those reach the front-end process, not the Worker).

``TENSORDIFF_RL=0`` turns all of it off.
"""

from __future__ import annotations

import os
from typing import Any

from .state import STATE, log

ENV_RL = "TENSORDIFF_RL"


class RLState:
    def __init__(self) -> None:
        self.enabled = (os.environ.get(ENV_RL) or "1").strip().lower() not in ("0", "false", "no", "off")
        self.runner: Any = None
        self.weight_step = 0
        self.changed: str | None = None
        self.sampling: dict[str, Any] | None = None
        self.per_sequence: dict[str, dict[str, Any]] = {}
        self.mode = "raw"
        self.vllm_mode = "raw_logprobs"


RL = RLState()


def start(runner) -> None:
    """At trace open: the weights as step 0; ``load_weights`` of the model watched."""
    if not RL.enabled or STATE.rec is None:
        return
    RL.runner = runner
    RL.vllm_mode = str(getattr(runner.model_config, "logprobs_mode", "raw_logprobs"))
    RL.mode = "processed" if RL.vllm_mode.startswith("processed") else "raw"
    path = (os.environ.get("TENSORDIFF_REPLAY") or "").strip()
    if path:  # a prefill re-run (record serve --replay): the trace says so
        import json

        from ..replay import REPLAY_ATTR

        with open(path, encoding="utf-8") as f:
            STATE.rec.writer.set_attr(None, REPLAY_ATTR, json.load(f)["attr"])
    fingerprint("start")
    model = runner.get_model()
    original = getattr(model, "load_weights", None)
    if original is None:
        return

    def load_weights(*args, **kwargs):
        out = original(*args, **kwargs)
        RL.changed = "load_weights"
        return out

    try:
        model.load_weights = load_weights   # this instance only: the loader's own first load is over
    except Exception:  # noqa: BLE001
        STATE.warn_once("rl-load-weights", "cannot watch the model's load_weights: weight updates are not fingerprinted")


def before_step() -> None:
    """At the start of a step: weights loaded since the last step are the next weight step."""
    if RL.changed is not None and RL.enabled and STATE.active:
        STATE.drain_queue()  # the steps before the new weights are recorded before their weight step
        event, RL.changed = RL.changed, None
        fingerprint(event)


def fingerprint(event: str) -> None:
    import time

    from ...trace.rl import write_weight_step
    from ..serving import engine_fingerprints

    st = STATE
    runner = RL.runner
    if runner is None or st.rec is None:
        return
    t0 = time.perf_counter()
    try:
        facts = st.attrs.get("ranks") or {}
        size = int(facts.get("tp_size", 1) or 1)
        rank = int(facts.get("tp_rank", 0) or 0)
        doc = engine_fingerprints(runner.get_model(), size, f"vllm tp{rank}/{size}" if size > 1 else "vllm")
        with st.lock:
            write_weight_step(st.rec.writer, RL.weight_step, doc, forward_step=st.step_no + 1, event=event,
                              rank=rank if size > 1 else None)
        log.info("tensordiff: weight step %d (%s): %d parameters fingerprinted", RL.weight_step, event,
                 len(doc["parameters"]))
        if doc.get("unreadable"):
            st.warn_once("rl-unreadable", "%d weights were moved into vLLM's packed CPU GEMM kernels (the parameters "
                         "are empty): their fingerprints are not recorded (e.g. %s)", len(doc["unreadable"]),
                         doc["unreadable"][0])
        RL.weight_step += 1
        st.dirty = True
    except Exception as e:  # noqa: BLE001
        st.fail(f"weight fingerprints ({event})", e)
    st.add_seconds(time.perf_counter() - t0)


def _params(sp) -> dict[str, Any]:
    t = float(getattr(sp, "temperature", 1.0))
    top_k = getattr(sp, "top_k", None)
    top_k = -1 if top_k is None or int(top_k) <= 0 else int(top_k)
    return {"temperature": t, "top_p": float(getattr(sp, "top_p", 1.0)), "top_k": top_k,
            "min_p": float(getattr(sp, "min_p", 0.0)), "logprobs_mode": RL.mode, "vllm_logprobs_mode": RL.vllm_mode}


def record_sampled(step, out, runner) -> None:
    """After a step is committed (:func:`.verify.commit`, which lists ``step.sampled``): the
    sampled token's log-prob of each request that asked for log-probs."""
    if not RL.enabled or not STATE.active or not step.sampled:
        return
    lt = getattr(out, "logprobs_tensors", None)
    if lt is None:
        return
    import numpy as np

    from ...conventions import SAMPLED_LOGPROB
    from ...trace.rl import sampling_params, write_sampling

    st = STATE
    lps = lt.logprobs
    ids = lt.logprob_token_ids
    lps = lps.detach().float().cpu().numpy() if hasattr(lps, "detach") else np.asarray(lps)
    ids = ids.detach().cpu().numpy() if hasattr(ids, "detach") else np.asarray(ids)
    rows, vals = [], []
    changed = False
    for i, row, tok in step.sampled:
        key, _, _, _, r = step.segments[i]
        bi = step.batch_idx[i]
        rs = runner.requests.get(r)
        sp = getattr(rs, "sampling_params", None)
        if sp is None or getattr(sp, "logprobs", None) is None or bi >= lps.shape[0] or int(ids[bi, 0]) != tok:
            continue
        rows.append(row)
        vals.append((tok, float(lps[bi, 0])))
        params = _params(sp)
        if RL.sampling is None:
            RL.sampling, changed = params, True
        elif params != RL.sampling and RL.per_sequence.get(key) is None:
            RL.per_sequence[key] = {k: v for k, v in params.items() if RL.sampling.get(k) != v}
            changed = True
    if rows:
        st.rec.plain(SAMPLED_LOGPROB, np.asarray(vals, dtype=np.float64), np.asarray(rows, dtype=np.int64),
                     role=SAMPLED_LOGPROB, token_offset=0,
                     attrs={"layout": "sampled token id | log-prob the engine returned",
                            "source": "SamplerOutput.logprobs_tensors column 0 (as returned)"})
    if changed:
        extra = {"per_sequence": RL.per_sequence} if RL.per_sequence else {}
        write_sampling(st.rec.writer, sampling_params(engine="vllm", **RL.sampling, **extra))
