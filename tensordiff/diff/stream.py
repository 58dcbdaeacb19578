"""The numeric pass as a stream: :func:`stream` yields every compared block of every pair of a
:class:`~tensordiff.diff.plan.DiffPlan`, in forward order and aligned order within a pair, as a
:class:`BlockResult` (the block's aligned tokens and their per-token metrics). Who computes the
metrics is a :class:`NumericBackend`: :class:`SerialBackend` in this process, or a process pool or
Ray cluster (:mod:`tensordiff.parallel`, :mod:`tensordiff.ray_backend`). Every backend cuts the
same blocks (``PairJob.block_rows``) and the compiled kernel fixes the order of every addition,
so the metrics, and everything judged from them, are the same bits whichever computed them.

Nothing here judges: tolerances, identity and findings are :mod:`tensordiff.diff.judge`'s."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol, TypeVar

import numpy as np
from numpy.typing import NDArray

from ..cores import usable_cores
from ..numerics import BlockMetrics, Metrics
from ..progress import Progress
from ..trace import Pieces, Replicated, ReplicaMismatch, TensorPart
from .plan import DiffPlan, PairJob

Codes = NDArray[np.int64]
Rows = np.ndarray | Pieces   # a block's rows of one side: read, or mapped in place
T = TypeVar("T")
#: (pair index, aligned indices, rows of A, rows of B, last block of its pair), rows in stored form
_Block = tuple[int, Codes, Rows, Rows, bool, bool]   # (pair, aligned indices, A, B, last of its pair, mapped)
MAX_LANES = 4   # threads measuring one block at most (the reader thread takes a core of its own)


@dataclass(frozen=True, eq=False)
class BlockResult:
    """One compared block: the aligned tokens ``rows`` of pair ``job`` and their metrics [n, k]."""

    job: PairJob
    rows: Codes
    metrics: Metrics


class NumericBackend(Protocol):
    """Computes the per-token metrics of a plan's blocks. :meth:`start` is called once per diff
    with its plan, then :meth:`blocks` for each compared pair in forward order, then
    :meth:`stop` (also when the diff stops early); :meth:`close` when the backend is done with."""

    def start(self, plan: DiffPlan) -> None: ...

    def blocks(self, job: PairJob) -> Iterator[tuple[Codes, Metrics]]:
        """The pair's blocks in aligned order: (aligned indices, metrics), cut every ``job.block_rows``."""
        ...

    def stop(self) -> None: ...

    def check_replicas(self, source: Replicated, progress: Progress | None = None) -> list[ReplicaMismatch]:
        """Every replica comparison of a source (:meth:`~tensordiff.trace.Replicated.replica_tasks`)."""
        ...

    def close(self) -> None: ...


def stream(plan: DiffPlan, backend: NumericBackend) -> Generator[BlockResult, None, None]:
    """Every compared block of the plan, pair by pair in forward order."""
    backend.start(plan)
    try:
        for job in plan.compared:
            for rows, m in backend.blocks(job):
                yield BlockResult(job, rows, m)
    finally:
        backend.stop()


class SerialBackend:
    """The numeric pass in this process. One read-ahead stream runs across all pairs (a reader
    thread reads the next block, the next pair's first one too, while this one is measured), and
    each block's sub-blocks are shared between the diff's thread and a helper thread per further
    core (:class:`~tensordiff.numerics.BlockMetrics`). ``read_lock`` is held around every read:
    an identity search scoring in another thread reads the same open files."""

    def __init__(self, read_lock: contextlib.AbstractContextManager[object] | None = None):
        self._lock = read_lock if read_lock is not None else contextlib.nullcontext()
        self._read_pool: ThreadPoolExecutor | None = None
        self._side_pool: ThreadPoolExecutor | None = None   # reads B's rows while the reader reads A's
        self._lane_pool: ThreadPoolExecutor | None = None
        self._lanes = 1
        self._shared: Generator[_Block, None, None] | None = None
        self._plan: DiffPlan | None = None

    def start(self, plan: DiffPlan) -> None:
        self.stop()
        self._plan = plan
        self._lanes = compute_lanes()
        if self._lanes > 1:
            self._lane_pool = ThreadPoolExecutor(self._lanes - 1, thread_name_prefix="tensordiff-metrics")
        jobs = plan.compared
        if jobs:
            if self._read_pool is None:
                self._read_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tensordiff-read")
            if self._side_pool is None and self._lanes > 1 and plan.a is not plan.b:
                self._side_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tensordiff-read-b")
            self._shared = _prefetch(self._read_all(plan, jobs), self._read_pool, ahead=lambda blk: not blk[5])

    def blocks(self, job: PairJob) -> Iterator[tuple[Codes, Metrics]]:
        if self._shared is None:
            raise RuntimeError("SerialBackend.blocks before start")
        bm = BlockMetrics(job.slots, job.width, pool=self._lane_pool, lanes=self._lanes)
        k, sw = job.slots, job.width
        for blk, a_raw, b_raw in _take_pair(self._shared, job.index, len(job.rows)):
            if job.basis == "values":  # stored form (bf16 bits); converted in cache-sized pieces
                m = bm.compute_stored(a_raw, job.a.dtype, b_raw, job.b.dtype)
            else:
                assert isinstance(a_raw, np.ndarray) and isinstance(b_raw, np.ndarray)   # sketches are read
                a = np.asarray(a_raw, np.float32)[:, :k * sw]
                b = np.asarray(b_raw, np.float32)[:, :k * sw]
                m = bm.compute(np.ascontiguousarray(a), np.ascontiguousarray(b))
            yield blk, m

    def stop(self) -> None:
        shared, self._shared = self._shared, None
        if shared is not None:
            shared.close()
        if self._lane_pool is not None:
            self._lane_pool.shutdown(wait=True)
        self._lane_pool, self._lanes = None, 1
        self._plan = None

    def check_replicas(self, source: Replicated, progress: Progress | None = None) -> list[ReplicaMismatch]:
        return source.check_replicas(progress)

    def close(self) -> None:
        self.stop()
        for pool in (self._read_pool, self._side_pool):
            if pool is not None:
                pool.shutdown(wait=True)
        self._read_pool = self._side_pool = None

    def _read_all(self, plan: DiffPlan, jobs: tuple[PairJob, ...]
                  ) -> Iterator[_Block]:
        """``(pair, aligned indices, rows of A, rows of B, last of its pair, mapped)``: the blocks of every
        job in order, in stored form. A block whose rows lie together in a plain file is mapped
        in place (the page cache's own pages: no copy, and the lanes take its page faults); any
        other is copied into one of two buffer sets of bytes that alternate (the block being
        compared is never the one being read), reused across pairs of any width; they grow only
        for a wider block. With a second core, B's rows are read in a second thread while this
        one reads A's: a copy from the page cache takes one core, and one core alone copies
        slower than the lanes measure."""
        a, b = plan.a, plan.b
        side = self._side_pool
        bufs: list[list[np.ndarray]] = [[np.empty(0, np.uint8), np.empty(0, np.uint8)] for _ in range(2)]
        i = 0
        for job in jobs:
            assert job.basis is not None
            part, n, idx = job.basis, job.block_rows, job.rows
            with self._lock:
                pa, pb = a.part(job.a.name, part), b.part(job.b.name, part)
            for s0 in range(0, len(idx), n):
                blk = idx[s0:s0 + n]
                pair_bufs = bufs[i % 2]
                i += 1
                rows_a, rows_b = job.rows_a[blk], job.rows_b[blk]
                with self._lock:
                    # values in place where both sides allow (sketches are narrow: read)
                    got_a = pa.map(rows_a) if part == "values" else None
                    got_b = pb.map(rows_b) if got_a is not None else None
                    mapped = got_a is not None and got_b is not None
                    if not mapped:   # read into the copy buffers
                        outs = [_typed(pair_bufs, j, len(blk), p) for j, p in ((0, pa), (1, pb))]
                        if side is not None:
                            fut = side.submit(pb.take, rows_b, out=outs[1])
                            try:
                                got_a = pa.take(rows_a, out=outs[0])
                            finally:
                                got_b = fut.result()   # waited for even when A's read failed: the buffer is in use
                        else:
                            got_a = pa.take(rows_a, out=outs[0])
                            got_b = pb.take(rows_b, out=outs[1])
                assert got_a is not None and got_b is not None
                yield (job.index, blk, got_a, got_b, s0 + n >= len(idx), mapped)


def compute_lanes() -> int:
    """Threads that measure each block: the cores this process may use, at most MAX_LANES."""
    return max(1, min(MAX_LANES, usable_cores()))


def _typed(bufs: list[np.ndarray], side: int, rows: int, part: TensorPart) -> np.ndarray:
    """A [rows, ...] array of ``part``'s dtype over the byte buffer of one side (grown if short)."""
    need = rows * part.row_bytes
    if bufs[side].size < need:
        bufs[side] = np.empty(need, np.uint8)
    return bufs[side][:need].view(part.dtype).reshape((rows,) + tuple(part.shape[1:]))


def _take_pair(shared: Iterator[_Block], pair: int, rows: int
               ) -> Iterator[tuple[Codes, Rows, Rows]]:
    """The blocks of pair ``pair`` from the stream shared by all pairs, up to its last one (the
    stream's next item is the next pair's and stays there)."""
    if rows == 0:
        return
    for j, blk, a, b, last, _mapped in shared:
        if j != pair:  # the stream and the pairs went out of step: a bug, never a wrong figure
            raise RuntimeError(f"block stream out of step: a block of pair {j} where pair {pair} was due")
        yield blk, a, b
        if last:
            return


def _prefetch(gen: Iterator[T], pool: ThreadPoolExecutor,
              ahead: Callable[[T], bool] = lambda item: True) -> Generator[T, None, None]:
    """Run a block generator one block ahead in a thread: HDF5 reads (which hold h5py's lock)
    overlap the numpy metrics of the previous block (which release the GIL) on a second core.
    After an item that ``ahead`` says needed no read (a block mapped in place: a few system
    calls), the next one is made in the caller's thread when it asks: a hand-off to the reader
    thread and back costs more than the mapping, in GIL switches while other threads run."""
    it = iter(gen)
    fut: Future[T | None] | None = pool.submit(next, it, None)
    while True:
        item = fut.result() if fut is not None else next(it, None)
        if item is None:
            return
        fut = pool.submit(next, it, None) if ahead(item) else None
        yield item


__all__ = ["MAX_LANES", "BlockResult", "NumericBackend", "SerialBackend", "compute_lanes", "stream"]
