"""The numeric pass of a diff split over worker processes (numpy + h5py only; Ray in ray_backend).

The coordinator (the :class:`~tensordiff.diff.Differ`) keeps the plan: token alignment, tensor
pairing, row maps and the identity sample, all over the small token tables. The heavy part of the
numeric pass, reading every aligned row of both sides and computing its per-token metrics
(:class:`~tensordiff.numerics.BlockMetrics`), is cut into tasks of whole diff blocks
(``Differ.block_rows_of``: about 8 MiB per side, at most ``block_rows`` aligned tokens, the
serial diff's blocks) of one tensor pair. A task is a function of picklable inputs only
(file paths, tensor names, member row indices, dtypes) and returns the per-token metrics of its
blocks (cos, rel, max abs, NaN/Inf counts: ~29 bytes per token and slot, against the kilobytes of
values it read). The diff's own loop then accumulates those blocks in block order, exactly as it
accumulates the blocks it computes itself: tolerances, first failures, the worst tokens, the
sinks and the progress are the serial code on the same numbers, so the result is the serial
diff's, byte for byte.

Backends: ``serial`` (no workers: the diff's own loop), ``pool`` (a local process pool, default
sized to the cores), ``ray`` (:mod:`tensordiff.ray_backend`, tasks placed on the node that holds
each shard), ``auto`` (the default: a pool when the input files hold at least
:data:`AUTO_MIN_BYTES` and there are two cores or more, else serial).

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
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from .errors import UsageError
from .numerics import BlockMetrics
from .trace import TensorInfo, TraceReader

BACKENDS = ("auto", "serial", "pool", "ray")
# auto: a pool only when the diff is long against the pool's start-up (0.5-0.9 s measured here,
# ~10% of a serial diff of 4 GiB at ~0.75 GB/s); smaller diffs stay in this process
AUTO_MIN_BYTES = 4 << 30
TASK_BYTES = 32 << 20           # stored bytes (both sides) a task reads, rounded to whole blocks
MAX_OPEN_READERS = 64           # per worker process


# ----------------------------------------------------------------------------------------------
# Tasks and partial results (picklable)
# ----------------------------------------------------------------------------------------------


@dataclass
class Segment:
    """Rows of one file that a task reads: ``pos`` (ascending; None: all, in order) are the
    places in the task's rows, ``rows`` the file's own tensor rows."""

    path: str
    rows: np.ndarray
    pos: np.ndarray | None = None
    host: str | None = None


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
    a: list[Segment]
    b: list[Segment]
    blk: np.ndarray             # aligned token index of each row
    block_rows: int
    nbytes: int = 0
    host: str | None = None     # where most of its bytes live (for placement)


@dataclass
class NumericPartial:
    """The blocks of one task: (aligned indices, per-token metrics) each, in block order."""

    pair: int
    chunk: int
    blocks: list[tuple[np.ndarray, dict[str, np.ndarray]]]
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


def _gather(segs: list[Segment], name: str, part: str, lo: int, hi: int,
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
        blocks.append((task.blk[s0:s1], {key: np.array(v) for key, v in m.items()}))  # own copies: buffers are reused
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


def run_replica_task(task: Any) -> Any:
    from .traceset import compare_replica_rows

    return compare_replica_rows(task, open_member)


# ----------------------------------------------------------------------------------------------
# The coordinator side
# ----------------------------------------------------------------------------------------------


class _Future(Protocol):
    def result(self) -> Any: ...


def locate(reader: Any, name: str, rows: np.ndarray) -> list[Segment]:
    """Where tensor rows ``rows`` of ``reader`` (a TraceReader or a TraceSet) live, as segments."""
    loc = getattr(reader, "locate", None)
    if loc is None:
        return [Segment(reader.path, np.asarray(rows, np.int64))]
    out = []
    for mi, pos, mrows in loc(name, rows):
        m = reader.members[mi]
        out.append(Segment(m.path, mrows, None if len(pos) == len(rows) else pos, m.host))
    return out


@dataclass
class _PairPlan:
    index: int
    key: tuple[str, str]
    basis: str
    slots: int
    n: int
    checksum: int
    chunks: int = 0


@dataclass
class Placement:
    """Where a task was asked to run (the Ray backend records node affinity here)."""

    pair: int
    chunk: int
    host: str | None
    node: str | None
    soft: bool = True


class PoolBackend:
    """Runs numeric tasks on an executor; subclasses change the executor (:class:`RayBackend`)."""

    name = "pool"

    def __init__(self, workers: int | None = None, *, task_bytes: int = TASK_BYTES):
        if workers is not None and workers < 1:
            raise UsageError(f"--workers must be at least 1, got {workers}")
        self.workers = workers or max(1, os.cpu_count() or 1)
        self.task_bytes = int(task_bytes)
        self._executor: ProcessPoolExecutor | None = None
        self.placements: list[Placement] = []
        self.stats: dict[str, Any] = {"tasks": 0, "task_seconds": 0.0, "pids": set()}
        self._reset()

    def _reset(self) -> None:
        self._plans: dict[tuple[str, str], _PairPlan] = {}
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

    def submit_replica(self, task: Any) -> _Future:
        return self._ensure_executor().submit(run_replica_task, task)

    @property
    def window(self) -> int:
        return 2 * self.workers + 1

    def close(self) -> None:
        for fut in self._futures.values():
            cancel = getattr(fut, "cancel", None)
            if cancel is not None:
                cancel()
        self._futures.clear()
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None

    def __enter__(self) -> PoolBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the diff's hooks ----------------------------------------------------------------------

    def start(self, differ: Any, pairs: Sequence[tuple[TensorInfo, TensorInfo]]) -> None:
        """Plan every pair's tasks (lazily, a window ahead of the diff's loop)."""
        for fut in self._futures.values():  # a diff that stopped early (cancelled) left these
            cancel = getattr(fut, "cancel", None)
            if cancel is not None:
                cancel()
        self._reset()
        self._gen = self._tasks(differ, list(pairs))

    def _tasks(self, differ: Any, pairs: list[tuple[TensorInfo, TensorInfo]]) -> Iterator[NumericTask]:
        everything = np.arange(len(differ.al))
        ra, rb = differ.ra, differ.rb
        for i, (ia, ib) in enumerate(pairs):
            (ma,), (mb,) = differ.maps.rows_at("a", ia.name, [everything]), differ.maps.rows_at("b", ib.name, [everything])
            both = (ma >= 0) & (mb >= 0)
            if not both.any():
                continue
            basis = "values" if (ia.has_values and ib.has_values) else "sketch"
            if basis == "sketch" and not (ia.has_sketch and ib.has_sketch and ra.sketch_seed == rb.sketch_seed
                                          and ra.sketch_dim == rb.sketch_dim):
                continue
            idx = np.flatnonzero(both)
            plan = _PairPlan(i, (ia.name, ib.name), basis, min(ia.slot_count, ib.slot_count), len(idx), _checksum(idx))
            self._plans[plan.key] = plan
            yield from self._pair_tasks(differ, plan, ia, ib, idx, ma, mb)

    def _pair_tasks(self, differ: Any, plan: _PairPlan, ia: TensorInfo, ib: TensorInfo, idx: np.ndarray,
                    ma: np.ndarray, mb: np.ndarray) -> Iterator[NumericTask]:
        ra, rb = differ.ra, differ.rb
        part = "values" if plan.basis == "values" else "sketch"
        da, db = ra._ds[ia.name][part], rb._ds[ib.name][part]
        row_bytes = int(np.prod(da.shape[1:])) * da.dtype.itemsize + int(np.prod(db.shape[1:])) * db.dtype.itemsize
        br = int(differ.block_rows_of(ia, ib, part))   # the serial diff's blocks (bytes-sized)
        cap = max(1, self.task_bytes // max(1, br * row_bytes))
        sw = ia.slot_width if plan.basis == "values" else ra.sketch_dim
        for c, (s0, s1) in enumerate(self._ranges(ra, rb, ia, ib, idx, ma, mb, br, cap)):
            blk = idx[s0:s1]
            sa, sb = locate(ra, ia.name, ma[blk]), locate(rb, ib.name, mb[blk])
            plan.chunks = c + 1
            yield NumericTask(plan.index, c, ia.name, ib.name, ia.dtype, ib.dtype, part, plan.slots, sw, sa, sb, blk,
                              br, nbytes=len(blk) * row_bytes, host=_main_host(sa, sb, len(blk)))

    @staticmethod
    def _ranges(ra: Any, rb: Any, ia: TensorInfo, ib: TensorInfo, idx: np.ndarray, ma: np.ndarray, mb: np.ndarray,
                br: int, cap: int) -> Iterator[tuple[int, int]]:
        """Task ranges of whole blocks, at most ``cap`` blocks each; where shards record their
        hosts, a range also ends where the host holding most of a block changes (a task reads
        one node's files where it can)."""
        n = len(idx)
        hosted = any(getattr(m, "host", None) for r in (ra, rb) for m in getattr(r, "members", ()))
        if not hosted:
            step = br * cap
            yield from ((s0, min(n, s0 + step)) for s0 in range(0, n, step))
            return
        start, count, host = 0, 0, None
        for s0 in range(0, n, br):
            blk = idx[s0:s0 + br]
            h = _main_host(locate(ra, ia.name, ma[blk]), locate(rb, ib.name, mb[blk]), len(blk))
            if count and (count >= cap or h != host):
                yield start, s0
                start, count = s0, 0
            host = h
            count += 1
        if count:
            yield start, n

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
        self.stats["tasks"] += 1
        return True

    def _top_up(self) -> None:
        while len(self._futures) < self.window and self._submit_next():
            pass

    def blocks(self, differ: Any, ia: TensorInfo, ib: TensorInfo, basis: str, k: int, idx: np.ndarray,
               ma: np.ndarray, mb: np.ndarray) -> Iterator[tuple[np.ndarray, dict[str, np.ndarray]]]:
        """The per-token metrics of one pair's blocks, in block order, from the workers (the diff
        accumulates them exactly as it accumulates blocks it computes itself)."""
        key = (ia.name, ib.name)
        plan = self._plans.get(key)
        # submit until this pair's tasks are all out (its plan exists once its first task is)
        while (plan is None or self._gen is not None and self._submitted_pair <= plan.index) and self._submit_next():
            plan = self._plans.get(key)
        if plan is None or (plan.basis, plan.slots, plan.n, plan.checksum) != (basis, k, len(idx), _checksum(idx)):
            # the diff planned this pair differently: run it from the diff's own arguments
            self._drop(plan)
            plan = _PairPlan(-1, key, basis, k, len(idx), _checksum(idx))
            futs = [self.submit(t) for t in self._pair_tasks(differ, plan, ia, ib, idx, ma, mb)]
            partials: Iterator[NumericPartial] = (f.result() for f in futs)
        else:
            partials = self._collect(plan)
        for p in partials:
            self.stats["task_seconds"] += p.seconds
            self.stats["pids"].add((p.host, p.pid))
            yield from p.blocks
        self._top_up()

    def _collect(self, plan: _PairPlan) -> Iterator[NumericPartial]:
        for c in range(plan.chunks):
            key = (plan.index, c)
            part = self._futures[key].result()
            del self._futures[key]
            self._top_up()
            yield part

    def _drop(self, plan: _PairPlan | None) -> None:
        if plan is None or plan.index < 0:
            return
        for c in range(plan.chunks):
            fut = self._futures.pop((plan.index, c), None)
            if fut is not None and hasattr(fut, "cancel"):
                fut.cancel()

    def check_replicas(self, tset: Any, progress: Callable[[str, int, int], None] | None = None) -> list[Any]:
        """A trace set's replica comparisons on the workers."""
        tasks = tset.replica_tasks()
        futs = [self.submit_replica(t) for t in tasks]
        partials = []
        for i, f in enumerate(futs):
            if progress is not None:
                progress("checking replicas", i, len(futs))
            partials.append(f.result())
        return list(tset.replica_mismatches(partials))


def _checksum(idx: np.ndarray) -> int:
    if not len(idx):
        return 0
    return int(idx[0]) * 1_000_003 + int(idx[-1]) * 7919 + int(idx.sum() % (1 << 61))


def _main_host(sa: list[Segment], sb: list[Segment], n: int) -> str | None:
    """The host holding most of a task's rows (A's on a tie); None where hosts are not recorded."""
    count: dict[str, int] = {}
    for seg in list(sa) + list(sb):
        if seg.host:
            count[seg.host] = count.get(seg.host, 0) + len(seg.rows)
    if not count:
        return None
    return max(count, key=lambda h: count[h])


def make_backend(name: str, workers: int | None = None, *, ray_address: str | None = None,
                 compared_bytes: int | None = None) -> PoolBackend | None:
    """The backend ``--backend NAME`` asks for; None means serial (the diff's own loop)."""
    if name not in BACKENDS:
        raise UsageError(f"--backend must be one of {', '.join(BACKENDS)}, got {name!r}")
    if workers is not None and workers < 1:
        raise UsageError(f"--workers must be at least 1, got {workers}")
    if name == "serial":
        return None
    if name == "auto":
        cores = os.cpu_count() or 1
        n = workers or cores
        if n < 2 or (compared_bytes is not None and compared_bytes < AUTO_MIN_BYTES):
            return None
        return PoolBackend(n)
    if name == "pool":
        return PoolBackend(workers)
    from .ray_backend import RayBackend  # imports ray only now

    return RayBackend(workers, address=ray_address)


def compared_bytes(paths: Sequence[str]) -> int:
    """What ``auto`` sizes the work by: the bytes of the input files (sets: every member)."""
    from .traceset import trace_paths

    total = 0
    for p in paths:
        for f in trace_paths(p):
            try:
                total += os.path.getsize(f)
            except OSError:
                pass
    return total


__all__ = ["AUTO_MIN_BYTES", "BACKENDS", "NumericPartial", "NumericTask", "Placement", "PoolBackend", "Segment",
           "compared_bytes", "locate", "make_backend", "open_member", "run_numeric_task"]
