"""A preview of a diff: the per-token metrics of the first tokens of two traces, written as a
summary file (:mod:`tensordiff.summary`) while the whole diff is still opening and aligning.

What it computes is real: both traces read through :class:`~tensordiff.trace.TraceReader` with
``head`` (the first token rows and the tensor rows that point into them, without loading the
whole token tables), aligned, paired and measured by the diff's own plan and numeric pass. What
it does not have is a verdict: the noise model and the tolerances are the whole diff's, measured
over every token, so nothing here judges, and every cell's flag says only whether its values
were finite. Its alignment pairs the first sequences of each side among themselves; the whole
diff's alignment, which may pair a sequence with one recorded later, is the one that counts.

A is the reference (what was expected, usually the train side), B the side under test."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable

import numpy as np

from ..errors import TensordiffError
from ..progress import Stage
from ..trace import TraceReader
from .options import DiffOptions
from .plan import plan_diff
from .stream import SerialBackend, stream

#: token rows of each side the preview reads
PREVIEW_TOKENS = 4096


def preview_summary(path_a: str, path_b: str, out: str, tokens: int = PREVIEW_TOKENS,
                    check: Callable[[], None] | None = None) -> int:
    """Write the summary of the first ``tokens`` token rows of both traces to ``out``. Returns
    its aligned tokens; 0 (and no file) when there is no preview to show: a trace set (a
    directory or a glob), or heads that share no token or no tensor (the whole diff says why).
    ``check`` is called at every step and may raise to cancel."""
    if not (os.path.isfile(path_a) and os.path.isfile(path_b)):
        return 0
    from ..summary import SummaryWriter

    def progress(_stage: Stage, _done: int, _total: int) -> None:
        if check is not None:
            check()

    with contextlib.ExitStack() as stack:
        try:
            a = TraceReader(path_a, head=tokens)
            stack.callback(a.close)
            b = TraceReader(path_b, head=tokens)
            stack.callback(b.close)
            plan = plan_diff(a, b, DiffOptions(), progress)
        except TensordiffError:
            return 0
        backend = SerialBackend()
        stack.callback(backend.close)
        writer = SummaryWriter(out, plan.alignment, a, b)
        try:
            for block in stream(plan, backend):
                job, m = block.job, block.metrics
                # no verdict: flags say only what the values are (finite or not)
                no_verdict = np.zeros(m.nonfinite.shape, bool)
                writer.write(job.a, job.b, job.slots, block.rows, m, no_verdict)
                if check is not None:
                    check()
        except BaseException:
            writer.close()
            with contextlib.suppress(OSError):
                os.remove(out)
            raise
        writer.close()
        return len(plan.alignment)


__all__ = ["PREVIEW_TOKENS", "preview_summary"]
