"""The plugin's per-process state: one :class:`State` per SGLang process (only scheduler processes
ever get past the first check of a hook), and the target pass held between hooks.

Standard library only at import time.
"""

from __future__ import annotations

import atexit
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from ..serving import ServeState
from .config import Config

log = logging.getLogger("tensordiff.sglang")


@dataclass
class Pass:
    """One target pass: its aux tensor and the trace row of each of its rows (-1: not kept)."""

    hs: Any
    rows: Any  # np.ndarray[int64]
    keys: tuple  # (rids per row, positions, tokens) as numpy arrays / list
    segments: list  # [(rid, start, count)]
    step: int
    regime: str
    stash: list = field(default_factory=list)  # [(kind, boundary, tensor)] of catalog taps held until the rows are known
    committed: bool = False
    private: bool = False   # hs is a snapshot's copy (:mod:`.capture`), not the engine's tensor
    seq: int = 0            # the capture's number of the pass (draft extends are matched with it)
    pred: Any = None        # the top-k rows of the target's predictions (predictions.PassTable), or None
    logit_next: Any = None  # verify: the target's logit of the next input token of each row (numpy)
    _bounds: Any = None

    def bounds(self):
        """(first row, row count) of every segment as int64 numpy arrays, in batch order."""
        if self._bounds is None:
            import numpy as np

            n = len(self.segments)
            self._bounds = (np.fromiter((s for _, s, _ in self.segments), np.int64, n),
                            np.fromiter((c for _, _, c in self.segments), np.int64, n))
        return self._bounds


class State(ServeState):
    log = log

    def __init__(self) -> None:
        self.cfg: Config | None = None
        self.rec = None            # core.Recorder, in the recording process only
        self.role: str | None = None   # None: undecided; "record"; "off" (another rank records)
        self.paused = False
        self.closed = False
        self.broken = False
        self.dirty = False
        self.model: dict = {}
        self.labels: list[str] | None = None
        self.raw_ids: list[int] | None = None
        self.convention: str | None = None
        self.capture_attrs: dict = {}
        self.last_target: Pass | None = None
        self.pending_verify: Pass | None = None
        self.ctx_rows = None       # rows of the running target pass, for the catalog taps
        self.ctx_stash: list | None = None
        self.ctx_keys = None       # keys (capture.Keys) of the running target pass, for the graft (.graft)
        self.graft = None          # graft.EngineGraft (TENSORDIFF_GRAFT), installed before any other tap
        self.catalog_handles: list = []
        self.catalog_layers = 0
        self.graph_passes = 0
        self.warned: set[str] = set()
        self.shift_checked = 0
        self.shift_mismatched = 0
        self.dropped_rows = 0
        self.draft_unmatched = 0
        self.unkeyed_passes = 0
        self.seconds = 0.0         # wall time inside the plugin's recording code
        self.seconds_by_topk: dict[int, float] = {}  # of which, by the top-k in force (tensordiff_resume topk=)
        self.start_topk: int | None = None  # TENSORDIFF_TOPK at start-up
        self.profiler = None       # cProfile.Profile of that code (TENSORDIFF_PROFILE), enabled in it only
        self.profile_path: str | None = None
        self.fc_out = None         # the draft fc's output of the running draft pass
        self.target_logits = None  # (logits processor, hidden, lm_head, output) of the running pass
        self.draft_logits = None
        self.draft_id_map = None   # the draft's hot-token map (draft column -> target id)
        self.spec_chain = True     # topk 1: a verify block is a chain of draft positions
        self.verify_steps = 0
        self.chain: dict[str, list] = {}  # request -> the draft's top-k rows at draft positions 0, 1, ...
        self.spec_k: int | None = None  # draft tokens per verify step (the spec_verify width)
        # capture (:mod:`.capture`): the aux tensor a draft extend is matched against (the engine's
        # tensor, the snapshot's), and the passes captured but not recorded yet
        self.cap_aux: tuple = (None, None, None)  # (engine's tensor, snapshot's, the pass's number)
        self.cap_seq = 0                # target passes captured so far
        self.cap_verify_seq: int | None = None  # a captured verify pass waiting for its verify result
        self.queue: list = []
        self.queue_bytes = 0
        self.queue_since = 0.0

    def begin(self) -> float:
        """Start of a section of the plugin's own code (counted in ``plugin_seconds``)."""
        if self.profiler is not None:
            self.profiler.enable()
        return time.perf_counter()

    def end(self, t0: float) -> None:
        """End of the section :meth:`begin` started."""
        dt = time.perf_counter() - t0
        self.seconds += dt
        k = self.cfg.topk if self.cfg is not None else 0
        self.seconds_by_topk[k] = self.seconds_by_topk.get(k, 0.0) + dt
        if self.profiler is not None:
            self.profiler.disable()

    def start_profile(self, path: str | None) -> None:
        if path:
            import cProfile

            self.profiler = cProfile.Profile()
            self.profile_path = path

    def dump_profile(self) -> None:
        if self.profiler is None:
            return
        try:
            self.profiler.dump_stats(self.profile_path)
            log.info("tensordiff: profile of the plugin's own code written to %s", self.profile_path)
        except Exception:  # noqa: BLE001
            log.exception("tensordiff: writing the profile failed")

    def later(self, fn, snap, queue: bool) -> None:
        """Record a captured pass: ``fn(snap)`` now (``queue`` False: nothing was copied), or once
        the queue is replayed (:meth:`replay`): at a flush, when the queue holds half of
        ``TENSORDIFF_STAGE_MB``, or when its first pass is older than ``TENSORDIFF_FLUSH_SECONDS``
        (then the trace is flushed too: a server killed while busy loses about one flush interval,
        as before the queue). Passes are recorded in the order they were captured."""
        self.queue.append((fn, snap))
        self.dirty = True
        if not queue:
            self.replay()
            return
        now = time.monotonic()
        if len(self.queue) == 1:
            self.queue_since = now
        self.queue_bytes += getattr(snap, "nbytes", 0)
        if now - self.queue_since >= self.cfg.flush_seconds:
            self.flush()
        elif self.queue_bytes > self.cfg.stage_bytes // 2:
            self.replay()

    def replay(self) -> None:
        """Record every queued pass, in order (an error stops recording, as in a hook)."""
        q, self.queue, self.queue_bytes = self.queue, [], 0
        for fn, snap in q:
            if self.rec is None or self.closed or self.broken:
                return
            try:
                fn(snap)
            except Exception as e:  # noqa: BLE001
                self.fail(f"recording a captured pass ({getattr(fn, '__name__', fn)})", e)
                return

    def fail(self, where: str, e: BaseException) -> None:
        """A recording error never reaches the engine: log it, stop recording, keep the trace."""
        log.exception("tensordiff: recording stopped (error in %s): %s", where, e)
        self.broken = True
        if self.rec is not None:
            try:
                self.rec.close(e)
            except Exception:
                log.exception("tensordiff: closing the trace after the error failed")

    def flush(self) -> None:
        """Write what is staged, then the statistics, and flush the trace (the caller times it:
        see :func:`.control.hook_on_idle` and :func:`.control.hook_rpc`)."""
        if self.queue:
            self.replay()
        if self.rec is not None and not self.closed and not self.broken and self.dirty:
            self.rec.write_staged()
            self._write_stats()
            self.rec.flush()
            self.dirty = False

    def _write_stats(self) -> None:
        w = self.rec.writer
        w.set_attr(None, "tensordiff_sglang", {
            "draft_shift_checked": self.shift_checked, "draft_shift_mismatched": self.shift_mismatched,
            "rows_dropped": self.dropped_rows,
            "cuda_graph_passes": self.graph_passes, "draft_passes_unmatched": self.draft_unmatched,
            "passes_without_request_ids": self.unkeyed_passes,
            "catalog_layers": self.catalog_layers, "verify_steps": self.verify_steps, "plugin_seconds": round(self.seconds, 6),
            "plugin_seconds_by_topk": {str(k): round(v, 6) for k, v in sorted(self.seconds_by_topk.items())},
            "recorder_seconds": round(self.rec.stats.seconds, 6),
            "sketch_products": self.rec.stats.sketch_products, "sketch_reused": self.rec.stats.sketch_reused,
            **self.capture_attrs,
        })

    def close(self) -> None:
        if self.rec is None or self.closed:
            self.closed = True
            return
        if not self.broken:  # what is queued and staged is written in a timed section: plugin_seconds counts it
            t0 = self.begin()
            try:
                self.replay()
                if not self.broken:
                    self.rec.flush()
            except Exception as e:  # noqa: BLE001
                self.fail("close", e)
            self.end(t0)
        self.closed = True
        self.dump_profile()
        if self.broken:
            return
        self.close_trace()


STATE = State()


def _atexit_close() -> None:
    STATE.close()


atexit.register(_atexit_close)
