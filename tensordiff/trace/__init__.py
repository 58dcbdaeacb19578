"""The trace format: one self-describing, versioned HDF5 file per side (numpy + h5py only).

One room per job (docs/format.md, docs/robustness.md):

- :mod:`~tensordiff.trace.schema`: version, sides, kinds, the token table, :class:`TensorInfo`,
  :class:`SlotSpec`, :func:`slot_rms` and the limits every reader enforces;
- :mod:`~tensordiff.trace.writer`: :class:`TraceWriter`, chunk-aligned appends and the two-phase
  flush that makes a killed recording readable;
- :mod:`~tensordiff.trace.reader`: :class:`TraceReader`, the validated open (:mod:`~tensordiff.trace.reads`:
  its row reads; :mod:`~tensordiff.trace.budget`: what an open may load);
- :mod:`~tensordiff.trace.validate`: the hostile-file guards the reader applies;
- :mod:`~tensordiff.trace.recover`: reading the committed rows of a trace that was not closed;
- :mod:`~tensordiff.trace.probe`: :func:`probe`, opening untrusted files in a child first.

Writers append in chunk-aligned blocks with bounded memory; readers read any row range or row
subset without loading whole datasets.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import h5py  # type: ignore[import-untyped, unused-ignore]  # noqa: F401 - benchmarks patch trace.h5py.File

from .probe import PROBE_SECONDS, probe
from .reader import TraceReader, trace_summary
from .reads import Pieces, block_rows, gather
from .runs import read_runs
from .source import (
    Replicated,
    ReplicaMismatch,
    ReplicaPartial,
    ReplicaTask,
    RowSegment,
    Sharded,
    TensorPart,
    TraceSource,
    hosts_of,
    segments_of,
)
from .schema import (
    CHUNK_BYTES,
    FILTER_EXPANSION,
    KINDS,
    MAX_ATTR_CHARS,
    MAX_ATTRS,
    MAX_CHUNK_BYTES,
    MAX_POSITION,
    MAX_SEQUENCES,
    MAX_SLOTS,
    MAX_TENSORS,
    READ_CACHE_BYTES,
    SCHEMA_REFS,
    SCHEMA_VERSION,
    SCHEMA_VERSIONS,
    SIDES,
    TOKEN_DTYPE,
    SlotSpec,
    TensorInfo,
    slot_rms,
)

if TYPE_CHECKING:
    from .writer import TraceWriter


def __getattr__(name: str) -> Any:
    """:class:`TraceWriter` on first use: reading (the diff, info, the TUI) never loads the writer."""
    if name == "TraceWriter":
        from .writer import TraceWriter

        return TraceWriter
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = [
    "Pieces",
    "block_rows",
    "gather",
    "read_runs",
    "CHUNK_BYTES",
    "FILTER_EXPANSION",
    "KINDS",
    "MAX_ATTRS",
    "MAX_ATTR_CHARS",
    "MAX_CHUNK_BYTES",
    "MAX_POSITION",
    "MAX_SEQUENCES",
    "MAX_SLOTS",
    "MAX_TENSORS",
    "PROBE_SECONDS",
    "READ_CACHE_BYTES",
    "Replicated",
    "ReplicaMismatch",
    "ReplicaPartial",
    "ReplicaTask",
    "RowSegment",
    "Sharded",
    "SCHEMA_REFS",
    "SCHEMA_VERSION",
    "SCHEMA_VERSIONS",
    "SIDES",
    "TOKEN_DTYPE",
    "SlotSpec",
    "TensorInfo",
    "TensorPart",
    "TraceReader",
    "TraceSource",
    "TraceWriter",
    "hosts_of",
    "probe",
    "segments_of",
    "slot_rms",
    "trace_summary",
]
