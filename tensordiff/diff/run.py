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
from typing import Any, cast

import numpy as np
from numpy.typing import NDArray

from .. import noise_io
from ..catalog import IdentitySearch
from ..errors import TensordiffError
from ..findings import DiffResult, Finding, display_names
from ..numerics import Metrics, WorstTokens
from ..progress import Progress, Stage
from ..trace import Replicated, TensorInfo, TraceSource
from ..traceset import open_trace
from .early import EarlyIdentity
from .judge import Tally, judge, replica_findings
from .options import DiffOptions, DiffSink, summary_sink
from .plan import DiffPlan, PairJob, depth_of, plan_diff
from .stream import BlockResult, NumericBackend, SerialBackend, stream


Codes = NDArray[np.int64]


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
    a, b = named(a, b)   # two traces of one side: "A" and "B" in every sentence

    def progress(stage: Stage, done: int, total: int) -> None:
        if opt.progress is not None:
            opt.progress(stage, done, total)

    from_pass = _noise_from_pass(a, b, opt)
    plan = plan_diff(a, b, opt, progress, measure_noise=not from_pass)
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
            if isinstance(r, Replicated):   # a set that holds rows twice; a file holds each once
                replicas += replica_findings(r, backend.check_replicas(r, progress))
        factories = list(opt.sinks) + ([summary_sink(opt.summary_path)] if opt.summary_path else [])
        sinks = [make(plan.alignment, a, b) for make in factories]
        worst = WorstTokens()
        try:  # numerics of every pair first: the agreeing boundaries give identity its noise floor
            if from_pass:
                plan, tally = _stream_then_noise(plan, opt, backend, worst, early, progress)
            else:
                tally = _stream(plan, backend, sinks, worst, early, progress)
        finally:
            for sink in sinks:
                sink.close()
        replicas += _duplicates(plan)
        result = judge(plan, tally, search, opt, replicas=replicas, worst=worst.items(), early=early)
    finally:
        if early is not None:
            early.close()
            if counters is not None:
                counters.early_identities += early.used
        if own:
            backend.close()
    return result


class _Named:
    """A trace seen under a display name (:func:`tensordiff.findings.display_names`): ``side`` is
    the name; everything else is the trace's own, read through. The trace is not changed."""

    def __init__(self, source: TraceSource, side: str):
        self._source = source
        self.side = side

    def __getattr__(self, name: str) -> Any:
        if name == "_source" or name.startswith("__"):   # a copy or pickle being made: not the trace's
            raise AttributeError(name)
        return getattr(self._source, name)


def named(a: TraceSource, b: TraceSource) -> tuple[TraceSource, TraceSource]:
    """The two traces as the diff names them: themselves, or views named ``A`` and ``B`` when
    both are traces of one side."""
    na, nb = display_names(a.side, b.side)
    if (na, nb) == (a.side, b.side):
        return a, b
    return cast(TraceSource, _Named(a, na)), cast(TraceSource, _Named(b, nb))


#: per-token metrics of a numeric pass kept for the noise model, at most (pair rows x slots)
PASS_KEEP = 1 << 20
#: boundaries whose identity search the default tolerances start early, at most
EARLY_GUESSES = 4


def _noise_from_pass(a: TraceSource, b: TraceSource, opt: DiffOptions) -> bool:
    """Whether the noise model is measured from the numeric pass's own metrics (kept until the
    pass ends, at most :data:`PASS_KEEP` token-slots, about 40 MB) rather than from a sample read
    before it: the sample is the pass's rows read and measured a second time (half of them at
    2048 tokens a state). Not for a diff with sinks."""
    rows = min(sum(i.rows * max(1, i.slot_count) for i in r.tensors.values()) for r in (a, b))
    # a sink (the TUI's live heatmap, the summary file) sees each block as it is measured,
    # judged against the final tolerances: its diff measures the noise first
    sinks = bool(opt.sinks or opt.summary_path)
    return opt.noise_from_pass and not sinks and rows <= PASS_KEEP


def _duplicates(plan: DiffPlan) -> list[Finding]:
    """Rows a side recorded twice for one token that differ past the noise."""
    a, b = plan.a, plan.b
    out: list[Finding] = []
    dup_a, dup_b = noise_io.Duplicates(a), noise_io.Duplicates(b)
    for job in plan.jobs:
        depth = max((d for d in job.depth if d is not None), default=None)
        out += noise_io.duplicate_findings(a, a.side, job.a, plan.noise, depth, a.sequences, dup_a)
        out += noise_io.duplicate_findings(b, b.side, job.b, plan.noise, depth, b.sequences, dup_b)
    return out


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


def _stream_then_noise(plan: DiffPlan, opt: DiffOptions, backend: NumericBackend, worst: WorstTokens,
                       early: EarlyIdentity | None, progress: Progress) -> tuple[DiffPlan, Tally]:
    """The numeric pass of a plan whose noise is not measured yet: every block's metrics kept,
    the noise model measured from them (:func:`tensordiff.noise_io.measure_from`), then the
    blocks go into the tally against the tolerances it sets, in the pass's order: the result is
    the one a sample read first gives. Never with sinks (:func:`_noise_from_pass`). The identity searches start early on the
    default tolerances (a guess: scores only, the judge decides), for the first few failing
    boundaries."""
    kept: list[tuple[int, Codes, Metrics]] = []
    total, done = plan.total_rows, 0
    started: set[int] = set()
    with contextlib.closing(stream(plan, backend)) as blocks:
        for block in blocks:
            job, m = block.job, block.metrics.copy()
            kept.append((job.index, block.rows, m))
            if (early is not None and len(started) < EARLY_GUESSES and job.index not in started
                    and job.a.kind != "packed" and job.b.kind != "packed" and _fails(job, m)):
                started.add(job.index)
                early.start(job)
            worst.offer(job.a.name, block.rows, m, plan.entry)
            done += len(block.rows)
            progress(Stage.COMPARING, min(done, total), total)
    by_job: dict[int, list[tuple[Codes, Metrics]]] = {}
    for ji, rows, m in kept:
        by_job.setdefault(ji, []).append((rows, m))
    jobs = {(j.a.name, j.b.name): j for j in plan.compared}

    def metrics_at(ia: TensorInfo, ib: TensorInfo, idx: Codes) -> Metrics | None:
        job = jobs.get((ia.name, ib.name))
        parts = by_job.get(job.index) if job is not None else None
        if job is None or not parts or job.slots != 1:
            return None
        rows = np.concatenate([r for r, _ in parts])
        pos = np.searchsorted(rows, idx)
        if len(rows) == 0 or (pos >= len(rows)).any() or not np.array_equal(rows[np.minimum(pos, len(rows) - 1)], idx):
            return None
        return _gather([m for _, m in parts], pos)

    model = noise_io.measure_from(plan.a, plan.b, plan.maps, [(j.a, j.b) for j in plan.jobs],
                                  lambda i, s: depth_of(plan.a, plan.b, i, s), metrics_at)
    plan = plan.with_noise(model, opt)
    tally = Tally(plan)
    final = {j.index: j for j in plan.jobs}
    for ji, rows, m in kept:
        tally.add(BlockResult(final[ji], rows, m))
    return plan, tally


def _fails(job: PairJob, m: Metrics) -> bool:
    """Whether a block has a token past one of its pair's (default) tolerances."""
    return any(bool(((m.cos[:, s] < t.min_cos) | (m.rel[:, s] > t.max_rel)).any())
               for s, t in enumerate(job.tolerances))


def _gather(parts: list[Metrics], pos: Codes) -> Metrics:
    """The rows ``pos`` of the metrics of consecutive blocks, as one."""
    def cat(name: str) -> np.ndarray:
        whole: np.ndarray = np.concatenate([getattr(m, name) for m in parts])
        return whole[pos]
    ratio = None if any(m.ratio is None for m in parts) else cat("ratio")
    return Metrics(cos=cat("cos"), rel=cat("rel"), maxabs=cat("maxabs"), nonfinite_a=cat("nonfinite_a"),
                   nonfinite_b=cat("nonfinite_b"), nonfinite=cat("nonfinite"), ratio=ratio)


__all__ = ["RunCounters", "diff_sources", "diff_traces", "open_pair"]
