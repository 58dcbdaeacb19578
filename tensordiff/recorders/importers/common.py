"""What every importer shares: the :class:`ImportResult` it reports, the checks that a file's
tensors have the shape its format promises, and the trace-writing helpers (the output directory
checked first, one :class:`~tensordiff.recorders.core.Recorder` per import with where it came
from in the metadata, a failed import's half-written trace removed).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch

from ...errors import SourceFileError, TensordiffError, UsageError
from ...safety import sanitize_for_terminal
from ..core import Recorder, Sampling
from .files import short


@dataclass
class ImportResult:
    format: str
    out: str
    files: int = 0
    sequences: int = 0
    tokens: int = 0
    tensors: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    plan: dict | None = None

    def summary(self) -> str:
        s = (f"imported {self.files} {self.format} file(s): {self.sequences} sequence(s), {self.tokens} token rows, "
             f"tensors {', '.join(self.tensors) or 'none'} -> {self.out}")
        if self.plan:
            s += f"\n  draft_input slots {self.plan['fed']} (convention {self.plan['convention']}, ids {self.plan['raw_ids']})"
            if self.plan.get("verifier"):
                s += f"; verifier_last claimed {self.plan['verifier']}"
        if self.skipped:
            s += f"\n  skipped {len(self.skipped)}: " + "; ".join(f"{sanitize_for_terminal(k)} ({sanitize_for_terminal(v)})"
                                                     for k, v in list(self.skipped.items())[:5])
        return s


# ----------------------------------------------------------------------------------------------
# Shape checks
# ----------------------------------------------------------------------------------------------


def as_2d(t: Any, what: str, path: str, length: int | None = None) -> torch.Tensor:
    """``t`` as a floating-point [L, width] tensor (leading 1s dropped), ``length`` rows if given."""
    if not isinstance(t, torch.Tensor):
        raise SourceFileError(f"{what} is a {type(t).__name__}, not a tensor", path)
    while t.ndim > 2 and t.shape[0] == 1:
        t = t[0]
    if t.ndim != 2:
        raise SourceFileError(f"{what} has shape {list(t.shape)}, expected [L, width] (or [1, L, width])", path)
    if length is not None and t.shape[0] != length:
        raise SourceFileError(f"{what} has {t.shape[0]} rows but input_ids has {length} tokens", path)
    if not t.is_floating_point():
        raise SourceFileError(f"{what} has dtype {t.dtype}, expected floating point", path)
    return t


def token_ids(d: dict, path: str) -> np.ndarray:
    """The one sequence of ``input_ids`` a draft trainer's file holds, as int64."""
    t = d.get("input_ids")
    if t is None:
        raise SourceFileError("no input_ids in the file", path)
    if isinstance(t, (list, tuple)):
        t = torch.as_tensor(t)
    if not isinstance(t, torch.Tensor) or t.is_floating_point() or t.is_complex():
        raise SourceFileError("input_ids is not an integer tensor", path)
    if t.ndim > 1:
        if sum(s != 1 for s in t.shape[:-1]):
            raise SourceFileError(f"input_ids has shape {list(t.shape)}; one sequence per file expected", path)
        t = t.reshape(-1)
    if t.numel() == 0:
        raise SourceFileError("input_ids is empty", path)
    return t.to(torch.int64).numpy()


def draft_rows(rows: np.ndarray) -> np.ndarray:
    """The trace rows of a packed draft input (``token_offset=1``): the last token has no next
    token to pair with, so its row is dropped (-1)."""
    out = rows.copy()
    out[-1] = -1
    return out


# ----------------------------------------------------------------------------------------------
# Writing the trace
# ----------------------------------------------------------------------------------------------


def check_out_dir(out: str | os.PathLike, error: type[TensordiffError] = UsageError) -> None:
    """The directory the trace goes into must exist (checked before anything is read)."""
    out_dir = os.path.dirname(os.path.abspath(os.fspath(out)))
    if not os.path.isdir(out_dir):
        raise error("output directory does not exist", out_dir)


def open_trace(out: str | os.PathLike, *, side: str, fmt: str, sources: Sequence[str | os.PathLike], model: dict,
               meta: dict, sample: Sampling | None = None, values: bool | Sequence[str] | None = None,
               error: type[TensordiffError] = UsageError) -> Recorder:
    """The recorder of an import into ``out``: the producer names the format, the metadata where
    the data came from (``imported_from``, ``format``, then ``meta``). A trace that cannot be
    created raises ``error`` with one line."""
    try:
        return Recorder(out, side=side, producer=f"tensordiff import ({fmt})", model=model,
                        meta={"imported_from": [os.fspath(s) for s in sources][:50], "format": fmt, **meta},
                        sample=sample, values=values)
    except OSError as e:
        raise error(f"cannot create the trace file ({short(e)})", os.fspath(out)) from None


def discard(path: str | os.PathLike) -> None:
    """Remove the half-written trace of a failed import (gone already is fine)."""
    try:
        os.remove(os.fspath(path))
    except OSError:
        pass
