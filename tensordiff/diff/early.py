"""The identity search of a boundary that disagrees, scored in a thread of its own while the
numeric pass goes on (numpy releases the GIL, and the numeric pass leaves part of a second core
idle). Only the scores are computed there; the decision waits for the noise floors, which need
every pair's numerics, so the verdict is the one the search run afterwards gives, whatever the
threads' timing. The judge asks for the scores (:meth:`EarlyIdentity.scores`) and decides."""

from __future__ import annotations

import contextlib
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures

import numpy as np
from numpy.typing import NDArray

from ..align import sample_indices
from ..catalog import IdentitySearch, SlotScores
from ..progress import Progress, Stage
from ..trace import TensorInfo
from .options import BOUNDARY_SAMPLE
from .plan import PairJob

Codes = NDArray[np.int64]


class _Stopped(Exception):
    """Raised in the identity thread when the diff has stopped (nothing waits for its result)."""


class EarlyIdentity:
    """Searches started early, by pair; ``used`` counts the scores the judge took from them."""

    def __init__(self, search: IdentitySearch, progress: Progress):
        self._search = search
        self._progress = progress
        self._pool: ThreadPoolExecutor | None = None
        self._started: dict[tuple[str, str], tuple[Codes, Future[SlotScores]]] = {}
        self._done = [0, 0]   # (candidates, of) the running search has laid out: for progress
        self._stopping = threading.Event()
        self.used = 0

    def start(self, job: PairJob) -> None:
        """Score, in the identity thread, the search the judge will run for this failing boundary pair."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tensordiff-identity")
        sample = sample_indices(job.both, BOUNDARY_SAMPLE)
        fut = self._pool.submit(self._search.score, "b", job.b, [0], sample, self._in_thread)
        self._started[(job.a.name, job.b.name)] = (sample, fut)

    def _in_thread(self, stage: Stage, done: int, total: int) -> None:
        """The progress of a search scored in the identity thread: counted for the diff's own
        progress (reported from its thread), and the point where a stopped diff stops it."""
        if self._stopping.is_set():
            raise _Stopped
        self._done[:] = [done, total]

    def scores(self, ia: TensorInfo, ib: TensorInfo, sample: Codes) -> SlotScores | None:
        """The scores :meth:`start` computed for this search (waited for, reporting progress, which
        may cancel), or None when none was started for these tokens."""
        hit = self._started.get((ia.name, ib.name))
        if hit is None or not np.array_equal(hit[0], sample):
            return None
        fut = hit[1]
        while not wait_futures([fut], timeout=0.05).done:
            done, total = self._done
            self._progress(Stage.IDENTIFYING, done, max(total, 1))
        found = fut.result()
        self.used += 1
        return found

    def drain(self) -> None:
        """Every search started has been used (or the diff failed); wait for any left."""
        for _, fut in self._started.values():
            with contextlib.suppress(Exception):
                fut.result()
        self._started.clear()

    def close(self) -> None:
        """Stop: a search still running (the diff stopped early) stops at its next candidate."""
        self._stopping.set()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
