"""The diff of two traces, along its data flow (docs/architecture.md):

- :mod:`.options`: :class:`DiffOptions`, the sinks that receive every compared block;
- :mod:`.plan`: :func:`plan_diff`, the frozen :class:`DiffPlan` (alignment, row maps, the token
  tables' findings, one :class:`PairJob` per paired tensor), made before any tensor row is read;
- :mod:`.stream`: :func:`stream`, the numeric pass as :class:`BlockResult` blocks from a
  :class:`NumericBackend` (:class:`SerialBackend` here; a pool or Ray in tensordiff.parallel);
- :mod:`.early`: identity searches of disagreeing boundaries scored while the stream runs;
- :mod:`.judge`: tolerances, noise floors, identity, slots, then each analysis in turn: the
  :class:`~tensordiff.findings.DiffResult`;
- :mod:`.analyses`: what runs after the verdicts (:class:`~.analyses.Analysis`: routing, the
  residual rule, the zoom/config signature, graft, acceptance);
- :mod:`.order`: the findings' order, made once;
- :mod:`.run`: :func:`diff_traces` / :func:`diff_sources`, the stages end to end, progress
  (:class:`~tensordiff.progress.Stage`) and cancel.

No stage writes into what it was given: the plan and the findings are frozen, and a stage that
changes a finding makes a new one.

A is the reference (what was expected, usually the train side), B the side under test."""

from __future__ import annotations

from ..progress import Progress, Stage
from .judge import Tally, judge
from .options import BLOCK_ROWS, BOUNDARY_SAMPLE, IDENTITY_SAMPLE, DiffOptions, DiffSink, SinkFactory, summary_sink
from .plan import Basis, DiffPlan, PairJob, plan_diff
from .run import RunCounters, diff_sources, diff_traces, open_pair
from .stream import BlockResult, NumericBackend, SerialBackend, stream

__all__ = [
    "BLOCK_ROWS",
    "BOUNDARY_SAMPLE",
    "IDENTITY_SAMPLE",
    "Basis",
    "BlockResult",
    "DiffOptions",
    "DiffPlan",
    "DiffSink",
    "NumericBackend",
    "PairJob",
    "Progress",
    "RunCounters",
    "SerialBackend",
    "SinkFactory",
    "Stage",
    "Tally",
    "diff_sources",
    "diff_traces",
    "judge",
    "open_pair",
    "plan_diff",
    "stream",
    "summary_sink",
]
