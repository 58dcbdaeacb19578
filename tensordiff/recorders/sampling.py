"""Which token rows a recorder keeps: :class:`Sampling` by absolute position (numpy only)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["Sampling"]


@dataclass(frozen=True)
class Sampling:
    """Which token rows to record, by absolute position (so both sides pick the same tokens even
    when one side skipped a cached prefix): positions ``p`` with ``p % every == offset``, plus every
    position in ``positions``. ``Sampling()`` keeps everything; ``Sampling(every=0,
    positions={0, 5})`` keeps exactly those positions."""

    every: int = 1
    offset: int = 0
    positions: frozenset[int] | None = None

    def __post_init__(self):
        if self.every < 0:
            raise ValueError("Sampling.every must be >= 0 (0: only the listed positions)")
        if self.positions is not None and not isinstance(self.positions, frozenset):
            object.__setattr__(self, "positions", frozenset(int(p) for p in self.positions))

    @property
    def keeps_all(self) -> bool:
        return self.every == 1 and self.offset == 0

    def mask(self, positions: np.ndarray) -> np.ndarray:
        positions = np.asarray(positions, dtype=np.int64)
        if self.every > 0:
            keep = (positions % self.every) == (self.offset % self.every)
        else:
            keep = np.zeros(positions.shape, dtype=bool)
        if self.positions:
            keep |= np.isin(positions, np.fromiter(self.positions, dtype=np.int64, count=len(self.positions)))
        return keep
