"""The numeric pass of a diff split over worker processes (numpy + h5py only; Ray in ray_backend).

The coordinator keeps the plan (:class:`~tensordiff.diff.DiffPlan`: token alignment, tensor
pairing, row maps, one :class:`~tensordiff.diff.PairJob` per pair), all over the small token
tables. The heavy part of the numeric pass, reading every aligned row of both sides and computing
its per-token metrics (:class:`~tensordiff.numerics.BlockMetrics`), is cut into tasks of whole
diff blocks (``PairJob.block_rows``: about 8 MiB per side, at most ``block_rows`` aligned tokens,
the serial diff's blocks) of one tensor pair. A task is a function of picklable inputs only
(file paths, tensor names, member row indices, dtypes) and returns the per-token metrics of its
blocks (cos, rel, max abs, NaN/Inf counts: ~29 bytes per token and slot, against the kilobytes of
values it read). The diff's own loop then accumulates those blocks in block order, exactly as it
accumulates the blocks it computes itself: tolerances, first failures, the worst tokens, the
sinks and the progress are the serial code on the same numbers, so the result is the serial
diff's, byte for byte.

:class:`PoolBackend` is a :class:`~tensordiff.diff.NumericBackend` on a local process pool;
:class:`~tensordiff.ray_backend.RayBackend` the same on a Ray cluster; :mod:`tensordiff.backends`
picks one for ``--backend``.

Which rows a task reads is resolved on the coordinator, in member terms: for a
:class:`~tensordiff.traceset.TraceSet` each segment names the member file (and its host) that
holds the rows, so a worker opens only the files of its rows.
"""

from __future__ import annotations

import multiprocessing
import os
import socket
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from .diff import DiffPlan, PairJob
from .errors import UsageError
from .numerics import BlockMetrics, Metrics
from .progress import Progress, Stage
from .trace import (
    Replicated,
    ReplicaMismatch,
    ReplicaPartial,
    ReplicaTask,
    RowSegment,
    TraceReader,
    TraceSource,
    hosts_of,
    segments_of,
)
from .traceset import compare_replica_rows

TASK_BYTES = 32 << 20           # stored bytes (both sides) a task reads, rounded to whole blocks
MAX_OPEN_READERS = 64           # per worker process


# ----------------------------------------------------------------------------------------------
# Tasks and partial results (picklable)
# ----------------------------------------------------------------------------------------------


#: rows of one file that a task reads (the trace source says where its rows live)
Segment = RowSegment


@dataclass
class NumericTask:
    """The per-token metrics of one tensor pair over a range of its aligned tokens."""

    pair: int                   # index of the pair in the diff's forward order
    chunk: int                  # index of the range within the pair
    name_a: str
    name_b: str
    dtype_a: str
    dtype_b: str
    part: str                   # values | sketch
    slots: int
    width: int                  # slot width compared (hidden size, or the sketch dimension)
    a: list[RowSegment]
    b: list[RowSegment]
    blk: np.ndarray             # aligned token index of each row
    block_rows: int
    nbytes: int = 0
    host: str | None = None     # where most of its bytes live (for placement)


@dataclass
class NumericPartial:
    """The blocks of one task: (aligned indices, per-token metrics) each, in block order."""

    pair: int
    chunk: int
    blocks: list[tuple[np.ndarray, Metrics]]
    seconds: float = 0.0
    pid: int = 0
    host: str = ""
    node: str | None = None                 # the Ray node it ran on (Ray backend)


# ----------------------------------------------------------------------------------------------
# The worker side
# ----------------------------------------------------------------------------------------------


_READERS: dict[str, TraceReader] = {}


def open_member(path: str) -> TraceReader:
    """This process's reader of ``path`` (opened once, kept for later tasks)."""
    r = _READERS.get(path)
    if r is None:
        if len(_READERS) >= MAX_OPEN_READERS:
            old = next(iter(_READERS))
            _READERS.pop(old).close()
        r = _READERS[path] = TraceReader(path)
    return r


def _gather(segs: list[RowSegment], name: str, part: str, lo: int, hi: int,
            open_reader: Callable[[str], TraceReader]) -> np.ndarray:
    """Task rows [lo, hi) of ``name/part`` in stored form, each segment read from its own file."""
    pieces = []
    for seg in segs:
        if seg.pos is None:
            i0, i1 = lo, min(hi, len(seg.rows))
            if i1 > i0:
                pieces.append((np.arange(i0 - lo, i1 - lo), seg, seg.rows[i0:i1]))
        else:
            i0, i1 = np.searchsorted(seg.pos, [lo, hi])
            if i1 > i0:
                pieces.append((seg.pos[i0:i1] - lo, seg, seg.rows[i0:i1]))
    if len(pieces) == 1 and len(pieces[0][0]) == hi - lo:
        _, seg, rows = pieces[0]
        return open_reader(seg.path).read_at(name, part, rows)
    out: np.ndarray | None = None
    for at, seg, rows in pieces:
        block = open_reader(seg.path).read_at(name, part, rows)
        if out is None:
            out = np.empty((hi - lo,) + block.shape[1:], block.dtype)
        out[at] = block
    if out is None:
        raise ValueError(f"task rows {lo}..{hi} of {name} are in no segment")
    return out


def run_numeric_task(task: NumericTask, open_reader: Callable[[str], TraceReader] | None = None) -> NumericPartial:
    """Read a task's rows block by block and compute their per-token metrics, as the serial diff does."""
    t0 = time.perf_counter()
    opener = open_reader or open_member
    k, sw = task.slots, task.width
    bm = BlockMetrics(k, sw)
    blocks = []
    n = len(task.blk)
    for s0 in range(0, n, task.block_rows):
        s1 = min(n, s0 + task.block_rows)
        a_raw = _gather(task.a, task.name_a, task.part, s0, s1, opener)
        b_raw = _gather(task.b, task.name_b, task.part, s0, s1, opener)
        if task.part == "values":
            m = bm.compute_stored(a_raw, task.dtype_a, b_raw, task.dtype_b)
        else:
            a = np.asarray(a_raw, np.float32)[:, :k * sw]
            b = np.asarray(b_raw, np.float32)[:, :k * sw]
            m = bm.compute(np.ascontiguousarray(a), np.ascontiguousarray(b))
        blocks.append((task.blk[s0:s1], m.copy()))  # own copies: buffers are reused
    return NumericPartial(task.pair, task.chunk, blocks, time.perf_counter() - t0, os.getpid(), socket.gethostname(),
                          _ray_node())


def _ray_node() -> str | None:
    """The Ray node this runs on, when it runs as a Ray task (ray is never imported here)."""
    ray = sys.modules.get("ray")
    if ray is None:
        return None
    try:
        ctx = ray.get_runtime_context()
        return str(ctx.get_node_id()) if ray.is_initialized() else None
    except Exception:  # noqa: BLE001 - not inside a Ray worker
        return None


def run_replica_task(task: ReplicaTask) -> ReplicaPartial:
    return compare_replica_rows(task, open_member)


# ----------------------------------------------------------------------------------------------
# The coordinator side
# ----------------------------------------------------------------------------------------------


class _Future(Protocol):
    def result(self) -> Any: ...

    def cancel(self) -> object: ...


@dataclass
class Placement:
    """Where a task was asked to run (the Ray backend records node affinity here)."""

    pair: int
    chunk: int
    host: str | None
    node: str | None
    soft: bool = True


@dataclass
class PoolStats:
    """What the workers did (tests and benchmarks read it)."""

    tasks: int = 0
    task_seconds: float = 0.0
    pids: set[tuple[str, int]] = field(default_factory=set)


class PoolBackend:
    """A :class:`~tensordiff.diff.NumericBackend` that runs numeric tasks on an executor, a window
    of tasks ahead of the diff's loop; subclasses change the executor (:class:`RayBackend`)."""

    name = "pool"

    def __init__(self, workers: int | None = None, *, task_bytes: int = TASK_BYTES):
        if workers is not None and workers < 1:
            raise UsageError(f"--workers must be at least 1, got {workers}")
        self.workers = workers or max(1, os.cpu_count() or 1)
        self.task_bytes = int(task_bytes)
        self._executor: ProcessPoolExecutor | None = None
        self.placements: list[Placement] = []
        self.stats = PoolStats()
        self._reset()

    def _reset(self) -> None:
        self._chunks: dict[int, int] = {}      # pair index -> its tasks so far
        self._gen: Iterator[NumericTask] | None = None
        self._futures: dict[tuple[int, int], _Future] = {}
        self._queue: deque[tuple[int, int]] = deque()
        self._submitted_pair = -1

    # -- executor ------------------------------------------------------------------------------

    def _ensure_executor(self) -> ProcessPoolExecutor:
        if self._executor is None:
            methods = multiprocessing.get_all_start_methods()
            ctx = multiprocessing.get_context("forkserver" if "forkserver" in methods else "spawn")
            if ctx.get_start_method() == "forkserver":
                ctx.set_forkserver_preload(["tensordiff.parallel"])
            self._executor = ProcessPoolExecutor(max_workers=self.workers, mp_context=ctx)
        return self._executor

    def submit(self, task: NumericTask) -> _Future:
        return self._ensure_executor().submit(run_numeric_task, task)

    def submit_replica(self, task: ReplicaTask) -> _Future:
        return self._ensure_executor().submit(run_replica_task, task)

    @property
    def window(self) -> int:
        return 2 * self.workers + 1

    def close(self) -> None:
        self.stop()
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None

    def __enter__(self) -> PoolBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the numeric backend -------------------------------------------------------------------

    def start(self, plan: DiffPlan) -> None:
        """Plan every pair's tasks (lazily, a window ahead of the diff's loop)."""
        self.stop()
        self._gen = self._tasks(plan)

    def stop(self) -> None:
        """Cancel what a diff that stopped early (cancelled) left running."""
        for fut in self._futures.values():
            fut.cancel()
        self._reset()

    def _tasks(self, plan: DiffPlan) -> Iterator[NumericTask]:
        for job in plan.compared:
            self._chunks[job.index] = 0
            yield from self._pair_tasks(plan.a, plan.b, job)

    def _pair_tasks(self, ra: TraceSource, rb: TraceSource, job: PairJob) -> Iterator[NumericTask]:
        assert job.basis is not None
        part, ia, ib, idx = job.basis, job.a, job.b, job.rows
        row_bytes = ra.part(ia.name, part).row_bytes + rb.part(ib.name, part).row_bytes
        br = job.block_rows   # the serial diff's blocks (bytes-sized)
        cap = max(1, self.task_bytes // max(1, br * row_bytes))
        hosted = bool(hosts_of(ra) or hosts_of(rb))
        for c, (s0, s1) in enumerate(_ranges(ra, rb, job, br, cap, hosted)):
            blk = idx[s0:s1]
            sa, sb = segments_of(ra, ia.name, job.rows_a[blk]), segments_of(rb, ib.name, job.rows_b[blk])
            self._chunks[job.index] = c + 1
            yield NumericTask(job.index, c, ia.name, ib.name, ia.dtype, ib.dtype, part, job.slots, job.width, sa, sb,
                              blk, br, nbytes=len(blk) * row_bytes, host=_main_host(sa, sb, len(blk)))

    def _submit_next(self) -> bool:
        if self._gen is None:
            return False
        task = next(self._gen, None)
        if task is None:
            self._gen = None
            return False
        key = (task.pair, task.chunk)
        self._futures[key] = self.submit(task)
        self._queue.append(key)
        self._submitted_pair = task.pair
        self.stats.tasks += 1
        return True

    def _top_up(self) -> None:
        while len(self._futures) < self.window and self._submit_next():
            pass

    def blocks(self, job: PairJob) -> Iterator[tuple[np.ndarray, Metrics]]:
        """The per-token metrics of one pair's blocks, in block order, from the workers (the diff
        accumulates them exactly as it accumulates blocks it computes itself)."""
        # submit until this pair's tasks are all out (a later pair's first task, or the end)
        while (self._gen is not None and self._submitted_pair <= job.index) and self._submit_next():
            pass
        if job.index not in self._chunks:
            raise RuntimeError(f"pair {job.index} ({job.label}) is not in the plan this backend started with")
        for c in range(self._chunks[job.index]):
            key = (job.index, c)
            part: NumericPartial = self._futures[key].result()
            del self._futures[key]
            self._top_up()
            self.stats.task_seconds += part.seconds
            self.stats.pids.add((part.host, part.pid))
            yield from part.blocks
        self._top_up()

    def check_replicas(self, source: Replicated, progress: Progress | None = None) -> list[ReplicaMismatch]:
        """A trace source's replica comparisons on the workers."""
        tasks = source.replica_tasks()
        futs = [self.submit_replica(t) for t in tasks]
        partials = []
        for i, f in enumerate(futs):
            if progress is not None:
                progress(Stage.CHECKING_REPLICAS, i, len(futs))
            partials.append(f.result())
        return source.replica_mismatches(partials)


def _ranges(ra: TraceSource, rb: TraceSource, job: PairJob, br: int, cap: int, hosted: bool
            ) -> Iterator[tuple[int, int]]:
    """Task ranges of whole blocks, at most ``cap`` blocks each; where shards record their
    hosts, a range also ends where the host holding most of a block changes (a task reads
    one node's files where it can)."""
    idx = job.rows
    n = len(idx)
    if not hosted:
        step = br * cap
        yield from ((s0, min(n, s0 + step)) for s0 in range(0, n, step))
        return
    start, count, host = 0, 0, None
    for s0 in range(0, n, br):
        blk = idx[s0:s0 + br]
        h = _main_host(segments_of(ra, job.a.name, job.rows_a[blk]), segments_of(rb, job.b.name, job.rows_b[blk]),
                       len(blk))
        if count and (count >= cap or h != host):
            yield start, s0
            start, count = s0, 0
        host = h
        count += 1
    if count:
        yield start, n


def _main_host(sa: list[RowSegment], sb: list[RowSegment], n: int) -> str | None:
    """The host holding most of a task's rows (A's on a tie); None where hosts are not recorded."""
    count: dict[str, int] = {}
    for seg in list(sa) + list(sb):
        if seg.host:
            count[seg.host] = count.get(seg.host, 0) + len(seg.rows)
    if not count:
        return None
    return max(count, key=lambda h: count[h])


__all__ = ["NumericPartial", "NumericTask", "Placement", "PoolBackend", "PoolStats", "Segment", "open_member",
           "run_numeric_task", "run_replica_task"]
