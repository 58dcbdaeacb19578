"""What a diff is asked to do: :class:`DiffOptions` (tolerances, block size, identity sample,
progress, sinks, the numeric backend, identity overlap) and the sinks that receive every
compared block (:class:`DiffSink`; the summary file is one: :func:`summary_sink`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np
from numpy.typing import NDArray

from ..align import TokenAlignment
from ..numerics import Metrics
from ..progress import Progress
from ..tolerances import ToleranceBook
from ..trace import TensorInfo, TraceSource

if TYPE_CHECKING:  # pragma: no cover
    from .stream import NumericBackend

BLOCK_ROWS = 4096       # aligned tokens per block at most (blocks are also bounded in bytes)
IDENTITY_SAMPLE = 256   # sampled tokens of a packed tensor's identity search
BOUNDARY_SAMPLE = 64    # sampled tokens of a disagreeing boundary's identity search

Codes = NDArray[np.int64]


class DiffSink(Protocol):
    """Receives every compared block: ``m`` the per-token metrics [n, k] of tensor pair (ia, ib) at
    aligned indices ``blk``, ``bad`` the tokens that fail. The summary file is one."""

    def write(self, ia: TensorInfo, ib: TensorInfo, k: int, blk: Codes, m: Metrics,
              bad: NDArray[np.bool_]) -> None: ...

    def close(self) -> None: ...


#: makes a sink once the tokens are aligned
SinkFactory = Callable[[TokenAlignment, TraceSource, TraceSource], DiffSink]


def summary_sink(path: str) -> SinkFactory:
    """The sink that writes the per-token summary file the TUI reads."""
    def make(al: TokenAlignment, ra: TraceSource, rb: TraceSource) -> DiffSink:
        from ..summary import SummaryWriter
        return SummaryWriter(path, al, ra, rb)
    return make


@dataclass
class DiffOptions:
    tolerances: ToleranceBook = field(default_factory=ToleranceBook)
    block_rows: int = BLOCK_ROWS
    identity_sample: int = IDENTITY_SAMPLE
    summary_path: str | None = None       # shorthand for a summary_sink in ``sinks``
    progress: Progress | None = None      # (stage, done, total); may raise to cancel
    sinks: list[SinkFactory] = field(default_factory=list)
    #: runs the numeric pass (tensordiff.parallel: a process pool, Ray); None: this process
    backend: NumericBackend | None = None
    #: in this process, score the identity search of a disagreeing boundary in a thread while the
    #: numeric pass goes on (False: after it, in the diff's thread; the same verdicts either way)
    overlap_identity: bool = True
    #: measure the noise model from the numeric pass's metrics when they fit in memory and no
    #: sink watches the pass (False: from a sample read before the pass; the same result either way)
    noise_from_pass: bool = True
    #: the exit policy: an incomplete verdict (nothing diverges, but some pair was not compared)
    #: exits 0 (``--allow-incomplete``); the result carries it (``DiffResult.exit_code``)
    allow_incomplete: bool = False


__all__ = ["BLOCK_ROWS", "BOUNDARY_SAMPLE", "IDENTITY_SAMPLE", "DiffOptions", "DiffSink", "SinkFactory",
           "summary_sink"]
