"""What a trace is: the schema version, the kinds and sides, the token-table layout, the records
the reader hands out (:class:`TensorInfo`, :class:`SlotSpec`) and the limits every reader enforces.

Layout (schema 1, and 2 where a tensor takes values by reference; docs/format.md)::

    /                         attrs: tensordiff_schema, side, producer, created, model (json),
                              versions (json), user_meta (json), sketch_seed, sketch_dim,
                              complete (bool: False until the writer closed cleanly),
                              flushed_tokens (rows committed by the last flush)
    /sequences                [S] utf-8 strings: sequence keys (request id, sample id...)
    /tokens                   [R] compound: seq (i4), position (i8), token (i8), regime (u1), step (i4)
    /tensors/<name>/rows      [n] i8: row of /tokens that each tensor row belongs to
    /tensors/<name>/values    [n, width] full values (bf16 as uint16 bits), optional
    /tensors/<name>/sketch    [n, slots*d] f4 seeded projection per slot, optional (absent with
                              values: the reader derives it, tensordiff/trace/reads.py DerivedSketch)
    /tensors/<name>/rms       [n, slots] f4 per-token RMS of each slot
    /tensors/<name>/values_ref  [n] i8, only with the values_source attribute (schema 2): per row, the
                              row of tensor values_source holding its values, or -1 (its own, the next
                              row of values, which then holds only those rows)
    /tensors/<name>           attrs: kind, dtype, width, slot_count, slot_width, slot_labels,
                              slot_boundaries, raw_ids, convention, order, token_offset, role,
                              flushed_rows, values_source, user.*

numpy only (no h5py): the writer, the reader and the importers share these definitions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..vocab import MAX_BOUNDARY as _MAX_BOUNDARY
from ..vocab import boundary_label, parse_label

SCHEMA_VERSION = 1      # what a trace says when it uses no later feature (what every schema-1 reader reads)
SCHEMA_REFS = 2         # a trace in which a tensor takes values by reference (values_source, values_ref)
SCHEMA_VERSIONS = (SCHEMA_VERSION, SCHEMA_REFS)   # the versions this reader reads
SIDES = ("train", "serve", "other")
KINDS = ("boundary", "final_norm", "packed", "other")
TOKEN_DTYPE = np.dtype([("seq", "<i4"), ("position", "<i8"), ("token", "<i8"),
                        ("regime", "u1"), ("step", "<i4")])
TOKEN_COLUMNS = ("seq", "position", "token", "regime", "step")

# -- sizes the writer uses ---------------------------------------------------------------------
CHUNK_BYTES = 1 << 20        # values are chunked in blocks of about this many bytes
# Rows that divide this evenly are chunked in exactly this many bytes, and the file places every
# allocation this large at a multiple of it: each chunk is then written as one aligned 2 MiB run,
# which the page cache keeps as one huge page where the file system caches large folios (ext4 on
# recent kernels), and a diff then maps it with one page fault instead of 512 (the kernel maps a
# 2 MiB-aligned huge page of a file whole). The gaps the alignment leaves are
# holes (no disk blocks), most filled by the file's small objects.
ALIGN_BYTES = 2 << 20
META_BLOCK_BYTES = 64 << 10  # metadata in blocks this large: few gaps between aligned chunks
# Chunk cache per open dataset. HDF5 2.0 defaults to 8 MiB each; a diff holds every tensor of both
# traces open and reads in whole-chunk blocks, so a cache mostly costs memory (8 MiB per open
# dataset, both sides' tensors at once). One chunk's worth keeps compressed scattered reads from re-inflating.
READ_CACHE_BYTES = 1 << 20

# -- limits every reader enforces (docs/robustness.md) -----------------------------------------
MAX_ATTR_CHARS = 1 << 20     # strings longer than this in a trace are refused, not parsed
MAX_ATTR_ELEMENTS = 64       # attributes are scalars (or tiny arrays), never bulk data
MAX_ATTRS = 4096             # attributes on one object
MAX_TENSORS = 100_000        # tensors in one trace
MAX_NAME_CHARS = 256         # a tensor name
MAX_KEY_CHARS = 4096         # a sequence key
MAX_SLOTS = 4096             # slots of one packed tensor
MAX_WIDTH = 1 << 24          # a tensor's width (and the model's hidden size)
MAX_SEQUENCES = 1 << 22      # the aligner keys a row as seq << 40 | position
MAX_POSITION = 1 << 40
MAX_BOUNDARY = _MAX_BOUNDARY   # the vocabulary's: a boundary attribute and a slot label share it
MAX_TOKEN_OFFSET = 1024
MAX_SKETCH_DIM = 65536
MAX_CHUNK_BYTES = 64 << 20   # one chunk is read whole to get one row
FILTER_EXPANSION = 1000      # a compressed dataset may be this much larger than the file


@dataclass
class SlotSpec:
    """What a packed tensor's slots are claimed to hold."""

    labels: list[str]
    raw_ids: list[int] | None = None
    convention: str | None = None

    @property
    def boundaries(self) -> list[int | None]:
        return [parse_label(lab) for lab in self.labels]


@dataclass
class TensorInfo:
    """A tensor as the reader sees it (attributes validated)."""

    name: str
    kind: str
    dtype: str
    width: int
    rows: int
    slot_count: int
    slot_width: int
    slot_labels: list[str] | None
    raw_ids: list[int] | None
    convention: str | None
    order: float
    token_offset: int
    role: str
    has_values: bool
    has_sketch: bool   # stored, or derivable from the values (``sketch_derived``)
    boundary: int | None = None
    attrs: dict[str, Any] = field(default_factory=dict)
    sketch_derived: bool = False   # no sketch stored: the reader computes it from the values
    values_source: str | None = None   # rows' values taken by reference from this tensor (values_ref)

    @property
    def stored_sketch(self) -> bool:
        """Whether the file holds a sketch dataset (not one the reader derives from the values)."""
        return self.has_sketch and not self.sketch_derived

    @property
    def label(self) -> str:
        if self.kind == "boundary" and self.boundary is not None:
            return boundary_label(self.boundary)
        if self.kind == "final_norm":
            return "final_norm"
        return self.name


def slot_rms(x: np.ndarray, slot_width: int) -> np.ndarray:
    """Per-row RMS of each slot of ``x`` [n, k*slot_width] -> [n, k] float32 (what ``rms`` holds)."""
    n = x.shape[0]
    k = x.shape[1] // slot_width
    x3 = x.reshape(n, k, slot_width)
    with np.errstate(over="ignore", invalid="ignore"):
        out: np.ndarray = np.sqrt(np.einsum("nkh,nkh->nk", x3, x3) / np.float32(slot_width))
    return out.astype(np.float32, copy=False)
