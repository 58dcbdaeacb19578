"""The diff end to end: open two traces, plan (:mod:`.plan`), check replicas, stream the numeric
pass (:mod:`.stream`) into the tally, the sinks and the worst tokens, then judge (:mod:`.judge`).
Progress goes to ``DiffOptions.progress`` as ``(Stage, done, total)``; the callback may raise to
cancel, and everything started (threads, sinks, the identity thread) is stopped on the way out.

A is the reference (what was expected, usually the train side), B the side under test."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass

from .. import noise_io
from ..catalog import IdentitySearch
from ..errors import TensordiffError
from ..findings import DiffResult, Finding, name_sides_apart
from ..numerics import WorstTokens
from ..progress import Progress, Stage
from ..trace import TraceSource
from ..traceset import open_trace
from .early import EarlyIdentity
from .judge import Tally, judge, replica_findings
from .options import DiffOptions, DiffSink, summary_sink
from .plan import DiffPlan, plan_diff
from .stream import NumericBackend, SerialBackend, stream


@dataclass
class RunCounters:
    """What a run did that its result does not say (tests and benchmarks read it)."""

    early_identities: int = 0   # boundary searches whose scores came from the identity thread


def diff_traces(path_a: str, path_b: str, options: DiffOptions | None = None) -> DiffResult:
    """Diff two traces (files, or trace sets: a directory or a glob): A the reference, B under test."""
    with open_pair(path_a, path_b) as (a, b):
        return diff_sources(a, b, options)


@contextlib.contextmanager
def open_pair(path_a: str, path_b: str) -> Iterator[tuple[TraceSource, TraceSource]]:
    """Both traces open (each a file or a set), closed on the way out."""
    a = open_trace(path_a)
    try:
        b = open_trace(path_b)
    except TensordiffError:
        a.close()
        raise
    try:
        yield a, b
    finally:
        a.close()
        b.close()


def diff_sources(a: TraceSource, b: TraceSource, options: DiffOptions | None = None, *,
                 counters: RunCounters | None = None) -> DiffResult:
    """Diff two open traces: plan, replicas, stream, judge."""
    opt = options or DiffOptions()
    name_sides_apart(a, b)   # two traces of one side: "A" and "B" in every sentence

    def progress(stage: Stage, done: int, total: int) -> None:
        if opt.progress is not None:
            opt.progress(stage, done, total)

    plan = plan_diff(a, b, opt, progress)
    search = IdentitySearch(a, b, plan.maps, progress)
    own = opt.backend is None
    overlap = own and opt.overlap_identity
    lock = threading.Lock() if overlap else None
    if lock is not None:   # the identity thread and the block reader share the open files
        search.read_lock = lock
    backend: NumericBackend = opt.backend if opt.backend is not None else SerialBackend(lock)
    early = EarlyIdentity(search, progress) if overlap else None
    try:
        replicas: list[Finding] = []
        for r in (a, b):
            replicas += replica_findings(r, backend.check_replicas(r, progress))
        dup_a, dup_b = noise_io.Duplicates(a), noise_io.Duplicates(b)
        for job in plan.jobs:   # rows a side recorded twice for one token
            depth = max((d for d in job.depth if d is not None), default=None)
            replicas += noise_io.duplicate_findings(a, a.side, job.a, plan.noise, depth, a.sequences, dup_a)
            replicas += noise_io.duplicate_findings(b, b.side, job.b, plan.noise, depth, b.sequences, dup_b)
        del dup_a, dup_b   # their keys are a token table's size
        factories = list(opt.sinks) + ([summary_sink(opt.summary_path)] if opt.summary_path else [])
        sinks = [make(plan.alignment, a, b) for make in factories]
        worst = WorstTokens()
        try:  # numerics of every pair first: the agreeing boundaries give identity its noise floor
            tally = _stream(plan, backend, sinks, worst, early, progress)
        finally:
            for sink in sinks:
                sink.close()
        result = judge(plan, tally, search, opt, replicas=replicas, worst=worst.items(), early=early)
    finally:
        if early is not None:
            early.close()
            if counters is not None:
                counters.early_identities += early.used
        if own:
            backend.close()
    return result


def _stream(plan: DiffPlan, backend: NumericBackend, sinks: list[DiffSink], worst: WorstTokens,
            early: EarlyIdentity | None, progress: Progress) -> Tally:
    """The numeric pass: every block into the tally, the worst tokens and the sinks, with progress.
    A boundary pair that starts failing has its identity search started in the identity thread
    (``early``), where the judge will find its scores."""
    tally = Tally(plan)
    total, done = plan.total_rows, 0
    started: set[int] = set()
    with contextlib.closing(stream(plan, backend)) as blocks:
        for block in blocks:
            job = block.job
            bad = tally.add(block)
            if (early is not None and job.index not in started and job.a.kind != "packed" and job.b.kind != "packed"
                    and tally.failing(job)):
                started.add(job.index)
                early.start(job)   # a slot fails: the judge will ask what B's boundary holds
            worst.offer(job.a.name, block.rows, block.metrics, plan.entry)
            for sink in sinks:
                sink.write(job.a, job.b, job.slots, block.rows, block.metrics, bad)
            done += len(block.rows)
            progress(Stage.COMPARING, min(done, total), total)
    return tally


__all__ = ["RunCounters", "diff_sources", "diff_traces", "open_pair"]
