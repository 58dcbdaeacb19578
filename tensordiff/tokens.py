"""Token codes: one int64 per (sequence, position) of a trace, ``seq << SEQ_BITS | position``.

The one owner of the encoding: the aligner, the diff's summary file and the TUI's data layer all
use these helpers (numpy only, no other import from the package, so every layer may import it).
Sorting codes sorts by sequence, then position; a position shift inside a sequence is ``code + s``.
"""

from __future__ import annotations

import numpy as np

SEQ_BITS = 40
POS_MASK = (1 << SEQ_BITS) - 1


def token_code(seq: int | np.ndarray, position: int | np.ndarray) -> np.ndarray:
    """Code(s) of sequence index ``seq`` (into a trace's sequence table) at ``position``."""
    return (np.asarray(seq, dtype=np.int64) << SEQ_BITS) | np.asarray(position, dtype=np.int64)


def code_seq(code: int | np.ndarray) -> np.ndarray:
    """Sequence index of code(s)."""
    return np.asarray(code, dtype=np.int64) >> SEQ_BITS


def code_position(code: int | np.ndarray) -> np.ndarray:
    """Absolute position of code(s)."""
    return np.asarray(code, dtype=np.int64) & POS_MASK
