"""The RL records of the SGLang plugin: what an RL trainer compares with the rollout engine.

* ``sampled_logprob`` (:data:`tensordiff.conventions.SAMPLED_LOGPROB`): per generated token, the
  log-prob the engine returned for the token it sampled, read where the scheduler hands it to the
  request (AFTER ``Scheduler.process_batch_result``: ``req.logprob.output_token_logprobs_val``),
  so exactly what the user's framework receives. Only requests that ask for log-probs
  (``return_logprob``, as every RL framework does) have one. Row t is the row whose logits
  sampled token t+1: the request's row at position ``len(prompt) + j - 1`` for output token j.
* the file attribute ``sampling`` (:mod:`tensordiff.trace.rl`): temperature, top-p, top-k, min-p
  as the scheduler holds them, and the log-prob mode: SGLang returns ``log_softmax(logits / T)``
  (``processed``), or the raw ``log_softmax(logits)`` with ``SGLANG_RETURN_ORIGINAL_LOGPROB`` set
  and for greedy requests. Requests that differ from the first are listed in ``per_sequence``.
* weight fingerprints (:mod:`tensordiff.recorders.weights_fp`) of the rank's own shard:
  ``/weights/step_0`` when the trace opens, ``step_k`` after the k-th weight update the
  scheduler completes (``update_weights_from_disk`` / ``_from_ipc`` at once; ``_from_tensor`` /
  ``_from_distributed``, which run inside a ``begin_weight_update`` session, when the session
  ends: one step per sync, however many buckets it sent). ``forward_step`` is the id of the next
  forward pass (the token table's ``step``): passes from it on ran with these weights.
* ``/prefix_cache`` (:mod:`tensordiff.trace.prefix_cache`): per request, at its first result, the
  tokens it took from the radix cache (``req.cached_tokens``, the ``cached_tokens`` of its
  meta_info), the weight step their KV was computed under (tracked by
  :class:`tensordiff.recorders.prefix_cache.PrefixSteps` from the passes the recorder saw) and
  the weight step serving it; every flush of the cache (AFTER ``Scheduler.flush_cache``, which
  a weight update with ``flush_cache=True`` calls, as ``engine.flush_cache()`` does).
* a replay (``tensordiff record serve --replay``, :mod:`tensordiff.recorders.replay`): the
  ``replay`` attribute, and ``sampled_logprob`` rows from the prefill's input log-probs
  (``logprob_start_len`` 0) at the positions the rollout sampled, so decode and prefill are
  compared token by token.

Row lookup: a pass's rows are known only once the pass is recorded (on the CPU, when the queue of
captured passes is replayed), so log-probs are queued behind it (``State.later``) and matched by
(request, position) with the rows :func:`note_rows` kept: the last row of each request in a pass
(the row that samples), every row in a replay. A request's entries go when it finishes.

``TENSORDIFF_RL=0`` turns all of it off (the benchmark's switch).
"""

from __future__ import annotations

import json
import os
from typing import Any

from .. import serving
from .state import STATE, log

ENV_RL = "TENSORDIFF_RL"
_WEIGHT_EVENTS = ("update_weights_from_disk", "update_weights_from_tensor", "update_weights_from_distributed",
                  "update_weights_from_ipc")


class RLState:
    """The RL part of the plugin's state (kept apart from :class:`.state.State`)."""

    def __init__(self) -> None:
        self.enabled = (os.environ.get(ENV_RL) or "1").strip().lower() not in ("0", "false", "no", "off")
        self.runner: Any = None
        self.rows: dict[str, dict[int, int]] = {}   # request -> {position: trace row} of rows that sample
        self.seen: dict[str, int] = {}              # request -> output log-probs already taken
        self.sampling: dict[str, Any] | None = None  # file-wide parameters (the first request's)
        self.per_sequence: dict[str, dict[str, Any]] = {}
        self.weight_step = 0
        self.pending_event: str | None = None       # an update inside an open session, fingerprinted at its end
        self.replay: dict[str, Any] | None = None   # {"attr": ..., "from": {key: first sampled position}}
        self.raw = False
        self.fp_seconds = 0.0
        from ..prefix_cache import PrefixSteps

        self.prefix = PrefixSteps()
        self.radix: bool | None = None              # the engine's radix cache on (None: not seen yet)


RL = RLState()


def _on() -> bool:
    return RL.enabled and STATE.active


# -- start -------------------------------------------------------------------------------------


def start(runner) -> None:
    """At trace open (the recording rank's target runner): the replay attribute, and the weights
    the engine starts with as step 0."""
    if not RL.enabled or STATE.rec is None:
        return
    from sglang.srt.layers import sampler

    RL.runner = runner
    RL.raw = bool(getattr(sampler, "SGLANG_RETURN_ORIGINAL_LOGPROB", False))
    path = (os.environ.get("TENSORDIFF_REPLAY") or "").strip()
    if path:
        with open(path, encoding="utf-8") as f:
            RL.replay = json.load(f)
        from ..replay import REPLAY_ATTR

        STATE.rec.writer.set_attr(None, REPLAY_ATTR, RL.replay["attr"])
    fingerprint("start", runner)


def _tp(runner) -> tuple[int, int]:
    from .ranks import server_arg

    size = int(server_arg(runner, "tp_size", 1) or 1)
    rank = int(STATE.capture_attrs.get("ranks", {}).get("tp_rank", 0) or 0)
    return rank, size


def fingerprint(event: str, runner=None) -> None:
    """Record the weights the engine holds now as the next weight step (a failure stops the
    recording, as in a hook)."""
    from ...trace.rl import write_weight_step

    import time

    st = STATE
    runner = runner or RL.runner
    if runner is None or st.rec is None or st.closed or st.broken:
        return
    # timed on its own (rl_fingerprint_seconds), not in plugin_seconds: a cost per weight sync, not per pass
    t0 = time.perf_counter()
    try:
        rank, size = _tp(runner)
        doc = serving.engine_fingerprints(runner.model, size, f"sglang tp{rank}/{size}" if size > 1 else "sglang")
        step = RL.weight_step
        fwd = int(getattr(runner, "forward_pass_id", 0)) + 1  # the next pass runs with these weights
        write_weight_step(st.rec.writer, step, doc, forward_step=fwd, event=event, rank=rank if size > 1 else None)
        RL.weight_step += 1
        st.dirty = True
        log.info("tensordiff: weight step %d (%s): %d parameters fingerprinted", step, event, len(doc["parameters"]))
    except Exception as e:  # noqa: BLE001
        st.fail(f"weight fingerprints ({event})", e)
    RL.fp_seconds += time.perf_counter() - t0
    st.capture_attrs["rl"] = {"weight_steps": RL.weight_step, "fingerprint_seconds": round(RL.fp_seconds, 6)}


def hook_weight_update(event: str):
    """AFTER ``SchedulerWeightUpdaterManager.<event>``: a successful update is fingerprinted now,
    or when its session ends."""
    def hook(result, manager, *args, **kwargs):
        if not _on() or not bool(getattr(result, "success", False)):
            return
        if getattr(manager, "_session", None) is not None:
            RL.pending_event = event
            return
        fingerprint(event)
    hook.__name__ = f"hook_{event}"
    return hook


def hook_end_weight_update(result, manager, *args, **kwargs):
    if not _on() or RL.pending_event is None or not bool(getattr(result, "success", False)):
        return
    event, RL.pending_event = RL.pending_event, None
    fingerprint(event)


# -- rows that sample --------------------------------------------------------------------------


def note_rows(p) -> None:
    """A target pass's rows are known: keep the row that samples of each request (every row in a
    replay, whose input log-probs are read)."""
    if not RL.enabled or p.regime == "target_verify":
        return
    rows = p.rows
    pos = p.keys[1]
    for rid, s, c in p.segments:
        if not c:
            continue
        d = RL.rows.setdefault(rid, {})
        if RL.replay is not None:
            for i in range(s, s + c):
                d[int(pos[i])] = int(rows[i])
        else:
            d[int(pos[s + c - 1])] = int(rows[s + c - 1])


def _params(req) -> dict[str, Any]:
    sp = getattr(req, "sampling_params", None)
    t = float(getattr(sp, "temperature", 1.0))
    top_k = int(getattr(sp, "top_k", -1))
    greedy = top_k == 1
    top_k = -1 if top_k >= 1 << 30 else top_k   # SGLang's "whole vocabulary"
    return {"temperature": t, "top_p": float(getattr(sp, "top_p", 1.0)), "top_k": top_k,
            "min_p": float(getattr(sp, "min_p", 0.0)),
            # a replay's log-probs are SGLang's input log-probs: log_softmax of the logits, no temperature
            "logprobs_mode": "raw" if RL.raw or greedy or RL.replay is not None else "processed"}


def hook_process_batch_result(result, scheduler, batch, *args, **kwargs):
    """AFTER ``Scheduler.process_batch_result``: the log-probs each request received in this
    batch, queued behind the passes they belong to."""
    if not _on():
        return
    st = STATE
    t0 = st.begin()
    try:
        got = []
        done = []
        if RL.radix is None:
            RL.radix = not bool(getattr(getattr(scheduler, "server_args", None), "disable_radix_cache", False))
        cur = max(RL.weight_step - 1, 0)
        for req in getattr(batch, "reqs", None) or ():
            rid = str(req.rid)
            if RL.replay is None and RL.radix:   # without a radix cache nothing is reused
                _track_prefix(req, rid, cur)
            lp = getattr(req, "logprob", None)
            vals = getattr(lp, "output_token_logprobs_val", None) if lp is not None else None
            if vals is not None and getattr(req, "return_logprob", False) and RL.replay is None:
                n0 = RL.seen.get(rid, 0)
                if len(vals) > n0:
                    idx = lp.output_token_logprobs_idx
                    plen = len(req.origin_input_ids)
                    new = [(rid, plen + j - 1, int(idx[j]), float(vals[j])) for j in range(n0, len(vals))]
                    RL.seen[rid] = len(vals)
                    got.append((rid, new, _params(req)))
            fin = req.finished()
            if fin and RL.replay is not None and lp is not None:
                got.append((rid, _input_logprobs(req, lp), _params(req)))
            if fin:
                done.append(rid)
        lines = RL.prefix.take()
        if got or done or lines:
            st.later(_record, (got, done, lines), bool(st.queue))
    except Exception as e:  # noqa: BLE001
        st.fail("sampled log-probs", e)
    st.end(t0)


def _track_prefix(req, rid: str, step: int) -> None:
    """The cached prefix of a request at its first result, its own positions as it runs (a
    chunk of a prefill that samples nothing yet is passed over)."""
    out = getattr(req, "output_ids", None) or []
    if not out:
        return
    prompt = req.origin_input_ids
    n = len(prompt)
    ps = RL.prefix
    if rid not in ps.live:
        ps.served(rid, list(prompt), int(getattr(req, "cached_tokens", 0) or 0), step)
    ps.progress(rid, n + len(out) - 1, step)   # no copy of the tokens per pass: only lengths
    if req.finished():
        ps.finished(rid, list(prompt) + list(out), n)


def hook_flush_cache(result, scheduler, *args, **kwargs):
    """AFTER ``Scheduler.flush_cache``: an emptied cache (it returns True) is a line of
    ``/prefix_cache``; the prefixes tracked so far are forgotten."""
    if not _on() or result is not True or RL.replay is not None:
        return
    st = STATE
    t0 = st.begin()
    try:
        fwd = int(getattr(RL.runner, "forward_pass_id", 0)) + 1 if RL.runner is not None else -1
        RL.prefix.flush(fwd, max(RL.weight_step - 1, 0))
        st.later(_record, ([], [], RL.prefix.take()), bool(st.queue))
    except Exception as e:  # noqa: BLE001
        st.fail("prefix cache flush", e)
    st.end(t0)


def _input_logprobs(req, lp) -> list[tuple[str, int, int, float]]:
    """A replayed request's input log-probs at the positions its rollout sampled: row p holds the
    log-prob of token p + 1 given the tokens up to p, computed in the prefill."""
    rid = str(req.rid)
    first = (RL.replay.get("from") or {}).get(rid)
    vals = getattr(lp, "input_token_logprobs_val", None)
    ids = list(req.origin_input_ids)
    if first is None or vals is None:
        return []
    start = int(getattr(req, "logprob_start_len", 0) or 0)
    out = []
    for p in range(max(int(first), start), len(ids) - 1):
        j = p + 1 - start   # entry j: the log-prob of input token start + j
        if 0 <= j < len(vals) and vals[j] is not None:
            out.append((rid, p, int(ids[p + 1]), float(vals[j])))
    return out


def _record(job) -> None:
    import numpy as np

    from ...conventions import SAMPLED_LOGPROB
    from ...trace.rl import sampling_params, write_sampling

    got, done, lines = job
    st = STATE
    if lines:
        from ...trace.prefix_cache import append_prefix_cache

        append_prefix_cache(st.rec.writer, lines, engine="sglang", radix_cache=RL.radix)
        st.dirty = True
    rows, vals = [], []
    changed = False
    for rid, entries, params in got:
        d = RL.rows.get(rid, {})
        for _, pos, tok, lp in entries:
            rows.append(d.pop(pos, -1))
            vals.append((tok, lp))
        if entries:
            last = entries[-1][1]   # entries come in position order
            for p in [p for p in d if p < last]:
                del d[p]   # rows that sampled nothing kept (a prefill chunk before the last)
        if RL.sampling is None:
            RL.sampling, changed = params, True
        elif params != RL.sampling and RL.per_sequence.get(rid) != params:
            RL.per_sequence[rid] = {k: v for k, v in params.items() if RL.sampling.get(k) != v}
            changed = True
    for rid in done:
        RL.rows.pop(rid, None)
        RL.seen.pop(rid, None)
    if rows:
        r = np.asarray(rows, dtype=np.int64)
        if (r < 0).any():
            st.warn_once("rl-rows", "%d sampled log-prob(s) without a recorded row (not recorded)", int((r < 0).sum()))
        st.rec.plain(SAMPLED_LOGPROB, np.asarray(vals, dtype=np.float64).reshape(-1, 2), r, role=SAMPLED_LOGPROB,
                     token_offset=0, attrs={"layout": "sampled token id | log-prob the engine returned",
                                            "source": "req.logprob.output_token_logprobs_val (as returned)"
                                            if RL.replay is None else
                                            "req.logprob.input_token_logprobs_val (prefill replay)"})
        st.dirty = True
    if changed:
        extra = {"per_sequence": RL.per_sequence} if RL.per_sequence else {}
        write_sampling(st.rec.writer, sampling_params(engine="sglang", **RL.sampling, **extra))
