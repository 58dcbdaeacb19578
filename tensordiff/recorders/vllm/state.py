"""The plugin's per-process state: one :class:`State` per vLLM process (only the recording Worker
ever gets past the first check of a hook), the target step held between hooks, and the sequence
key of each request.

Standard library only at import time.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import re
import threading
import time
from typing import Any

from ..serving import ServeState
from .config import Config

log = logging.getLogger("tensordiff.vllm")

QUEUE_STEPS = 16  # TENSORDIFF_VLLM_QUEUE: target steps whose records are made together (0 or 1: each in its hook)
QUEUE_BYTES = 32 << 20  # engine tensors the deferred records hold on to, at most (then they are made)
ENV_QUEUE = "TENSORDIFF_VLLM_QUEUE"
# the phases of a queued record (:meth:`State.run_queue`): a step's kept rows to the token table,
# then its states (and its draft pass's), then the predictions (the draft chains)
PHASES = 3
_INTERNAL_ID = re.compile(r"^(.*)-[0-9a-f]{8}$")  # vLLM's internal id: f"{external}-{random_uuid():.8}"


def queue_steps_from_env() -> int:
    """``TENSORDIFF_VLLM_QUEUE``: target steps whose records are made together (default
    :data:`QUEUE_STEPS`; 0 or 1: every record in its hook). A value that is not a whole number
    >= 0 is refused with a warning (the default then)."""
    import os

    v = (os.environ.get(ENV_QUEUE) or "").strip()
    if not v:
        return QUEUE_STEPS
    try:
        n = int(v)
        if n < 0:
            raise ValueError(v)
    except ValueError:
        log.warning("tensordiff: %s=%r is not a whole number of steps >= 0; using %d", ENV_QUEUE, v, QUEUE_STEPS)
        return QUEUE_STEPS
    return n


class Step:
    """One target forward: its rows, held until the sampling result says which rows to keep."""

    def __init__(self, step: int, segments: list, pos, ids, regimes: list, prompt_lens: list, limits: list):
        self.step = step
        self.segments = segments      # [(seq key, first row, count, n_spec)]
        self.pos = pos                # np.int64 [T]
        self.ids = ids                # np.int64 [T]
        self.regimes = regimes        # per segment
        self.prompt_lens = prompt_lens
        self.limits = limits          # per segment: positions >= limit are past max_tokens
        self.aux = None               # torch [T, K*H]
        self.stash: list = []         # catalog: [(kind, boundary, tensor [T, H])]
        self.rows = None              # np.int64 [T] trace rows, -1 dropped (after commit)
        self.next_tok: dict = {}      # (seq, pos) -> token after each request's last kept row (draft shift check)
        self.prompts: dict = {}       # segment -> prompt token ids (prefill segments)
        self.batch_idx: list = []     # per segment: the request's index in the batch (sampler row)
        self.num_reqs = 0             # requests in the batch, scheduled tokens or not
        self.hidden = None            # torch [>=T, H] the target's final hidden states (top-k predictions)
        self.logits = None            # a private copy of the logits vLLM computed for the rows it samples
        self.logit_rows = None        # np.int64: the pass row of each row of ``logits`` (-1: none), once sampled
        self.sampled: list = []       # [(segment, trace row, token)]: the rows that sampled a kept token (RL records)
        self.layout = None            # the segments as arrays, made once (drafter._same_layout)


class State(ServeState):
    log = log

    def __init__(self) -> None:
        self.cfg: Config | None = None
        self.rec = None
        self.role: str | None = None  # None: undecided; "record"; "off"
        self.path: str | None = None
        self.paused = False
        self.closed = False
        self.broken = False
        self.dirty = False
        self.last_flush = time.monotonic()
        self.last_activity = time.monotonic()
        self.lock = threading.RLock()  # the recording hooks and the idle flusher share the writer
        self.model: dict = {}
        self.labels: list[str] | None = None
        self.raw_ids: list[int] | None = None
        self.convention = "vllm"
        self.attrs: dict = {}
        self.step_no = 0
        self.sched = None             # the scheduler output of the running execute_model
        self.forwarded = False
        self.pending: Step | None = None
        # how the pending step is committed (verify.commit, handed over by forward with the step, so
        # that this module imports neither)
        self.commit_pending: Any = None
        self.last: Step | None = None  # the committed step the drafter reads
        self.ctx: Step | None = None   # the step whose forward the catalog taps see
        self.catalog_handles: list = []
        self.draft_ctx: dict | None = None
        self.keys: dict[str, str] = {}  # internal request id -> sequence key
        self.key_owner: dict[str, str] = {}
        self.warned: set[str] = set()
        self.rows_written = 0
        self.rows_dropped = 0
        self.shift_checked = 0
        self.shift_mismatched = 0
        self.draft_unmatched = 0
        self.seconds = 0.0
        # predictions (:mod:`.predictions`)
        self.target_head: tuple | None = None  # (lm_head weight, vocab, scale, cap) of the target
        self.draft_head: tuple | None = None
        self.draft_id_map = None        # torch int64 [draft vocab]: draft id -> target id
        self.draft_cols: tuple | None = None  # (draft_id_map, it as numpy, its largest id, it is every column in order)
        self.chain: dict = {}           # seq key -> [(top-k job, row)] per draft position, for its next verify
        self.chain_step: int | None = None  # the recorded step whose propose made ``chain``
        self.spec_k: int | None = None  # draft tokens per verify step (the spec_verify width)
        self.verify_steps = 0
        self.start_topk: int | None = None  # TENSORDIFF_TOPK at start-up (a resume may set 0 or it again)
        self.logits_reused = 0          # target top-k rows from vLLM's own logits (the rest: the plugin's product)
        # the records of the last steps, made in one go (:meth:`defer`): the hooks' own code runs
        # with the CPU's caches cold after each forward (a few times slower than the same code run
        # again at once), so the steps' records are made together, in order, every few steps
        self.queue: list = []
        self.queue_bytes = 0
        self.queue_steps = 0            # steps held at most (0: every record made in its hook)
        self.prediction_taps = 0        # of catalog_handles: the prediction hooks (removed at close with the catalog's)

    def add_seconds(self, dt: float) -> None:
        """Count ``dt`` seconds of the plugin's own time (the hooks' thread and the idle flusher's
        both add: under the lock)."""
        with self.lock:
            self.seconds += dt

    def fail(self, where: str, e: BaseException) -> None:
        """A recording error never reaches the engine: log it, stop recording, keep the trace."""
        log.exception("tensordiff: recording stopped (error in %s): %s", where, e)
        with self.lock:
            if self.broken:
                return
            self.broken = True
            self.pending = self.last = self.ctx = None
            self.chain = {}
            self.queue = []
            self.queue_bytes = 0
            if self.rec is not None and not self.closed:
                try:
                    self._write_stats()
                    self.rec.close(e)
                except Exception:  # noqa: BLE001
                    log.exception("tensordiff: closing the trace after the error failed")

    def _write_stats(self) -> None:
        self.rec.writer.set_attr(None, "tensordiff_vllm", {
            "rows": self.rows_written, "rows_dropped": self.rows_dropped,
            "draft_shift_checked": self.shift_checked, "draft_shift_mismatched": self.shift_mismatched,
            "draft_passes_unmatched": self.draft_unmatched, "catalog_taps": len(self.catalog_handles) - self.prediction_taps,
            "verify_steps": self.verify_steps, "topk_rows_from_vllm_logits": self.logits_reused,
            "topk": self.cfg.topk, "topk_at_start": self.start_topk
            if self.start_topk is not None else self.cfg.topk,
            "plugin_seconds": round(self.seconds, 6), "recorder_seconds": round(self.rec.stats.seconds, 6),
            **self.attrs,
        })

    def defer(self, fn, nbytes: int = 0, step: bool = False) -> None:
        """Make a record later, after the records deferred before it: ``fn()`` runs at the next
        :meth:`run_queue` (every :attr:`queue_steps` steps or ``QUEUE_BYTES`` of tensors held, a
        flush, a pause, the close). ``fn`` may be a record in phases instead, a tuple of
        :data:`PHASES` callables (None: nothing in that phase); a plain callable runs in the last
        phase. ``nbytes``: the engine tensors it holds on to; ``step``: it is a target step's
        record (the count that drains the queue)."""
        self.queue.append((fn if isinstance(fn, tuple) else (None,) * (PHASES - 1) + (fn,), step))
        self.queue_bytes += nbytes
        self.dirty = True

    def queue_full(self) -> bool:
        return bool(self.queue) and (self.queue_bytes >= QUEUE_BYTES
                                     or sum(1 for _, s in self.queue if s) >= self.queue_steps)

    def run_queue(self) -> None:
        """Make the deferred records, phase by phase: every queued record's first phase in order,
        then every second phase in order, and so on (the caller times it, under the lock). One
        kind of record after the other runs the same code many times while it is in the CPU's
        caches; each phase keeps the order of the records, so every tensor's rows, the token
        table and the draft chains come out as one record after the other would make them.
        The writer's flush triggers are held meanwhile: the first phase adds every queued step's
        token rows before any of their tensor rows, and a flush there would commit token rows
        without them. A trigger reached meanwhile flushes once the queue is made: whole steps."""
        with self.lock:
            held = self.rec.writer.flushes_held() if self.rec is not None else contextlib.nullcontext()
            with held:
                self._run_phases()
            if self.rec is not None and not self.broken and self.rec.writer.flush_triggered():
                self.rec.flush()

    def _run_phases(self) -> None:
        while self.queue and not self.broken:
            q, self.queue = self.queue, []
            self.queue_bytes = 0
            for phase in range(PHASES):
                for fns, _ in q:
                    if self.broken:
                        return
                    fn = fns[phase]
                    if fn is not None:
                        fn()

    def drain_queue(self) -> None:
        """:meth:`run_queue`, timed as the plugin's own."""
        if self.queue:
            t0 = time.perf_counter()
            self.run_queue()
            self.add_seconds(time.perf_counter() - t0)

    def flush(self, force: bool = False) -> None:
        """Write what is staged and flush the trace (when due, or ``force``); the time it takes is
        the plugin's own (``plugin_seconds``), from any caller: a hook, an RPC, the idle flusher."""
        with self.lock:
            if self.rec is None or self.closed or self.broken:
                return
            if force or (self.dirty and time.monotonic() - self.last_flush >= self.cfg.flush_seconds):
                t0 = time.perf_counter()
                self.run_queue()
                if self.broken:
                    return
                self.rec.write_staged()  # first: the statistics then count what it wrote
                self._write_stats()
                self.rec.flush()
                self.dirty = False
                self.last_flush = time.monotonic()
                self.seconds += time.perf_counter() - t0

    def close(self) -> None:
        with self.lock:
            self._close()

    def _close(self) -> None:
        if self.rec is None or self.closed:
            self.closed = True
            return
        if not self.broken and self.queue:
            try:
                self.run_queue()
            except Exception as e:  # noqa: BLE001
                self.fail("close", e)
        if not self.broken and self.pending is not None and self.commit_pending is not None:
            try:  # the held step, as if its sampling result said nothing
                self.commit_pending(self.pending, None)
            except Exception as e:  # noqa: BLE001
                self.fail("close", e)
        self.closed = True
        if self.broken:
            return
        self.close_trace()

    def seq_key(self, req_id: str) -> str:
        """The sequence key of a vLLM request: its external id (vLLM appends ``-<8 hex>`` to make
        the internal one), unless two live requests share that external id."""
        k = self.keys.get(req_id)
        if k is None:
            m = _INTERNAL_ID.match(req_id)
            k = m.group(1) if m and m.group(1) else req_id
            if self.key_owner.get(k, req_id) != req_id:
                k = req_id
            self.key_owner.setdefault(k, req_id)
            self.keys[req_id] = k
        return k


STATE = State()
atexit.register(STATE.close)
