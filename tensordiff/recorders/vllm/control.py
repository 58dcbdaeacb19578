"""Control: the methods the plugin adds to vLLM's ``WorkerBase`` so that ``collective_rpc(
"tensordiff_close" | "tensordiff_flush" | "tensordiff_pause" | "tensordiff_resume")`` reaches the
recording Worker (each returns the Worker's ``recording``, ``path``, ``rows``, ``plugin_seconds``
and ``topk``; ``tensordiff_resume`` takes ``topk=0`` or the start-up k: predictions off or on
again); BEFORE ``WorkerWrapperBase.shutdown`` (and ``atexit``, see :mod:`.state`) closes the trace;
and the idle flusher, a thread that flushes the trace once the engine has been idle for a second
(vLLM runs no step, so no hook, while it waits for requests).
"""

from __future__ import annotations

import time

from ..serving import resume_topk
from .state import STATE, State

RPC_METHODS = ("tensordiff_close", "tensordiff_flush", "tensordiff_pause", "tensordiff_resume")
IDLE_FLUSH_SECONDS = 1.0


def rpc_method(name: str):
    def method(worker, *args, **kwargs):
        st = STATE
        if name == "tensordiff_close":
            st.close()
        elif name == "tensordiff_flush":
            st.flush(force=True)
        elif name == "tensordiff_pause":
            st.flush(force=True)
            st.paused = True
            st.pending = None
            st.chain = {}  # drafted while recording; the verify steps after a resume were drafted later
        elif name == "tensordiff_resume":
            st.flush(force=True)  # what was recorded before is written (and timed) under its own k first
            if "topk" in kwargs:
                set_topk(kwargs["topk"])
            st.chain = {}
            st.paused = False
        return {"recording": st.role == "record", "path": st.path, "rows": st.rows_written,
                "plugin_seconds": round(st.seconds, 6), "topk": st.cfg.topk if st.cfg is not None else None}
    method.__name__ = name
    return method


def set_topk(k) -> None:
    """Predictions off (0) or back on (the start-up k) for the steps that follow
    (``collective_rpc("tensordiff_resume", kwargs={"topk": 0})``, which also drops the chains).
    Another k is refused: a trace's top-k tables keep one width."""
    st = STATE
    if st.cfg is None:
        return
    k = resume_topk(st, k)
    with st.lock:
        st.cfg.topk = k


def hook_shutdown(wrapper, *args, **kwargs) -> None:
    STATE.close()


def idle_flusher(st: State) -> None:
    """Flush the trace once the engine has been idle for a second (a server's Worker is killed when
    it stops, and vLLM runs no step, so no hook, while it waits for requests). Runs until ``st`` is
    closed or broken; :func:`tensordiff.recorders.vllm.startup.setup` starts it on ``STATE``."""
    while not (st.closed or st.broken):
        time.sleep(IDLE_FLUSH_SECONDS / 2)
        if st.dirty and time.monotonic() - st.last_activity >= IDLE_FLUSH_SECONDS:
            try:
                st.flush(force=True)
            except Exception as e:  # noqa: BLE001
                with st.lock:
                    st.fail("idle flush", e)
