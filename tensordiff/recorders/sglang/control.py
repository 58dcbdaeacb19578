"""Control: AFTER ``Scheduler.on_idle`` flushes the trace when the scheduler has nothing to run;
AROUND ``Scheduler.handle_rpc_request`` answers ``engine.collective_rpc("tensordiff_close")``
(``tensordiff_flush`` flushes, ``tensordiff_pause`` / ``tensordiff_resume`` switch recording off
and on; ``collective_rpc("tensordiff_resume", topk=0)`` resumes without the top-k predictions and
``topk=K``, K the start-up ``TENSORDIFF_TOPK``, with them again: what benchmarks/
bench_sglang_overhead.py uses to time both in one run); other RPCs pass through."""

from __future__ import annotations

from ..serving import resume_topk
from .config import RPC_PREFIX
from .state import STATE, log

RPC_METHODS = ("tensordiff_close", "tensordiff_flush", "tensordiff_pause", "tensordiff_resume")


def hook_on_idle(result, scheduler, *args, **kwargs):
    st = STATE
    if st.dirty and st.rec is not None:
        t0 = st.begin()
        try:
            st.flush()
        except Exception as e:  # noqa: BLE001
            st.fail("idle flush", e)
        st.end(t0)


def _timed_flush(st) -> None:
    """A flush asked for by an RPC, timed like the idle flush (its writes are the plugin's cost).
    A failure stops recording, as in a hook (the RPC's answer then says why)."""
    t0 = st.begin()
    try:
        st.flush()
    except Exception as e:
        st.fail("flush", e)
        raise
    finally:
        st.end(t0)


def set_topk(k) -> None:
    """Predictions off (0) or back on (the start-up k) for the passes that follow. Another k is
    refused: a trace's top-k tables keep one width, and with ``TENSORDIFF_TOPK=0`` at start-up the
    logits taps were never installed."""
    st = STATE
    st.cfg.topk = resume_topk(st, k)
    st.chain.clear()
    st.target_logits = st.draft_logits = None


def hook_rpc(original, scheduler, recv_req, *args, **kwargs):
    method = getattr(recv_req, "method", "") or ""
    if not method.startswith(RPC_PREFIX):
        return original(scheduler, recv_req, *args, **kwargs)
    st = STATE
    ok, msg = True, ""
    try:
        if method == "tensordiff_close":
            st.close()
        elif method == "tensordiff_flush":
            _timed_flush(st)
        elif method == "tensordiff_pause":
            _timed_flush(st)
            st.paused = True
            st.last_target = st.pending_verify = None
        elif method == "tensordiff_resume":
            params = getattr(recv_req, "parameters", None) or {}
            _timed_flush(st)  # the passes before are recorded (and timed) under their own k first
            if "topk" in params:
                set_topk(params["topk"])
            st.paused = False
            st.last_target = st.pending_verify = None
        else:
            ok, msg = False, f"unknown tensordiff RPC {method!r}; known: {', '.join(RPC_METHODS)}"
    except Exception as e:  # noqa: BLE001
        ok, msg = False, f"{type(e).__name__}: {e}"
    group = getattr(getattr(scheduler, "tp_group", None), "cpu_group", None)
    if group is not None:  # as SGLang's own handler: every TP rank answers together
        try:
            from torch.distributed import barrier
            barrier(group=group)
        except Exception:  # noqa: BLE001
            log.debug("tensordiff: RPC barrier failed", exc_info=True)
    from sglang.srt.managers.io_struct import RpcReqOutput
    return RpcReqOutput(success=ok, message=msg)
