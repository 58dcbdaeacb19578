"""Which token rows a recorder keeps: :class:`Sampling` by absolute position; and
:class:`SequenceEnds`, which refuses a draft row paired past its sequence's end (numpy only)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..vocab import REGIMES

__all__ = ["Sampling", "SequenceEnds"]


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


class SequenceEnds:
    """The last position of every train sequence a recorder added, to refuse rows of a
    ``token_offset`` > 0 tensor (the draft's: row t pairs with token t+1) paired past the end of
    their sequence: the token they pair with does not exist (a loop that forgot
    ``draft_rows[-1] = -1``). A train (teacher-forced) sequence holds every token the model saw;
    serve regimes are not checked, since there the next token is added by a later step."""

    def __init__(self) -> None:
        self.index: dict[str, int] = {}
        self.ends = np.empty(64, dtype=np.int64)       # per train sequence: its last position so far
        self.seq_of = np.empty(1024, dtype=np.int64)   # per token row: index into ends (-1: not train)

    def add(self, seq: str, start: int, end: int, positions: np.ndarray, regime: str | int) -> None:
        """Token rows ``start..end-1`` of ``seq`` at ``positions`` were added."""
        if end > len(self.seq_of):
            grown = np.empty(max(end, 2 * len(self.seq_of)), dtype=np.int64)
            grown[:start] = self.seq_of[:start]
            self.seq_of = grown
        train = regime == "train" or (not isinstance(regime, str) and int(regime) == REGIMES.index("train"))
        if not train or end == start:
            self.seq_of[start:end] = -1
            return
        last = int(positions.max())
        si = self.index.get(seq)
        if si is None:
            si = self.index[seq] = len(self.index)
            if si >= len(self.ends):
                grown = np.empty(2 * len(self.ends), dtype=np.int64)
                grown[:si] = self.ends[:si]
                self.ends = grown
            self.ends[si] = last
        else:
            self.ends[si] = max(int(self.ends[si]), last)
        self.seq_of[start:end] = si

    def check(self, name: str, rows: np.ndarray, positions: np.ndarray, token_offset: int) -> None:
        """Raise ValueError when a row of ``rows`` (recorded as ``name``) pairs past its train
        sequence's end; ``positions``: the position of every token row."""
        if token_offset <= 0 or not len(rows) or not self.index:
            return
        si = self.seq_of[rows]
        train = si >= 0
        want = positions[rows] + token_offset
        past = train & (want > self.ends[np.where(train, si, 0)])
        if not past.any():
            return
        i = int(np.flatnonzero(past)[0])
        seq = next(k for k, v in self.index.items() if v == int(si[i]))
        n = int(past.sum())
        raise ValueError(
            f"{name}: {n} row{'s' if n > 1 else ''} paired past the end of {'their sequences' if n > 1 else 'its sequence'} "
            f"(sequence {seq!r}, position {int(positions[rows[i]])} pairs with position {int(want[i])} "
            f"with token_offset={token_offset}, but the sequence ends at position {int(self.ends[si[i]])}): "
            f"set the last {token_offset} row{'s' if token_offset > 1 else ''} of each sequence to -1 "
            "(draft_rows[-1] = -1), or add the sequence's later tokens first")
