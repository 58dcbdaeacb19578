"""Rows of a trace read as few contiguous runs: the identity search's sampled tokens and the
failing tokens a finding describes are scattered rows, a few runs at most, and a read of the span
between them costs more than the runs themselves on long traces."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from numpy.typing import NDArray

from .reads import gather
from .source import TensorPart, TraceSource

Codes = NDArray[np.int64]


def read_runs(r: TraceSource, name: str, part: str, rows: Codes, max_runs: int = 64) -> np.ndarray:
    """``r.part(name, part).take(rows)`` (the same rows, stored form) read as one contiguous read
    per run of consecutive rows: the sampled tokens are a few runs, and a read of the span between
    them (what a scattered read does when it is a few MB) costs more than the runs at 100k+ tokens."""
    p = r.part(name, part)
    if len(rows) == 0:
        return p.take(rows)
    step = np.diff(rows)
    ascending = bool((step > 0).all())
    if ascending:  # already sorted and unique (a candidate's union of rows): no sort
        uniq, inv, gaps = rows, None, step
    else:
        uniq, inv = np.unique(rows, return_inverse=True)
        gaps = np.diff(uniq)
    cuts = (np.flatnonzero(gaps != 1) + 1).tolist()
    if cuts:
        # many short runs: gathered from the span mapped in place (only the rows' pages are
        # touched), not read run by run
        lo = int(uniq[0])
        span = p.map(np.arange(lo, int(uniq[-1]) + 1))
        if span is not None:
            picked = gather(span, uniq - lo)
            return picked if inv is None else picked[inv.reshape(-1)]
    if len(cuts) + 1 > max_runs:
        return p.take(rows)
    starts, stops = [0] + cuts, cuts + [len(uniq)]
    read = _RUN_READERS[part]
    firsts = uniq[starts].tolist()  # the first row of each run
    parts = [read(p, f, f + (b - a)) for f, a, b in zip(firsts, starts, stops)]
    block = parts[0] if len(parts) == 1 else np.concatenate(parts)
    out: np.ndarray = block if inv is None else block[inv.reshape(-1)]
    return out


# one contiguous run of rows [a, b) of a part: values in stored form (what ``take`` returns),
# sketches and RMS as float32
_RUN_READERS: dict[str, Callable[[TensorPart, int, int], np.ndarray]] = {
    "values": lambda p, a, b: p.rows(a, b),
    "sketch": lambda p, a, b: np.asarray(p.rows(a, b), dtype=np.float32),
    "rms": lambda p, a, b: np.asarray(p.rows(a, b), dtype=np.float32),
}
