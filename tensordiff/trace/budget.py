"""The memory budget of opening a trace, enforced from the bytes the file really holds.

Opening a trace loads its token table, every tensor's rows index, its sequence keys and its
attribute strings; everything else is read later in bounded blocks. A small crafted file can
claim far more than it holds: datasets hard-linked under several names, compressed tables that
inflate a thousandfold, thousands of string entries pointing at one heap string. So the reader
counts, per open, what it decodes, and refuses before it reads past:

- uncompressed tables loaded at open: together at most the file's size (each byte the writer
  stored is loaded once; a dataset linked twice is counted twice) plus 1 MiB;
- compressed tables loaded at open: together at most :data:`MAX_COMPRESSED_LOAD` decoded bytes
  (an absolute cap; TraceWriter never compresses them);
- streamed datasets (values, sketch, rms; read later in blocks): each at most the file's size
  uncompressed, or :data:`FILTER_EXPANSION` times the bytes the file stores for it compressed;
- decoded strings (sequence keys, attributes): together at most twice the file's size plus
  16 MiB, counted from the on-disk string descriptors before a string is decoded when they can
  be read raw.
"""

from __future__ import annotations

import math
from typing import Any

import h5py  # type: ignore[import-untyped, unused-ignore]
import numpy as np

from ..errors import TraceFileError
from .schema import FILTER_EXPANSION

SLACK = 1 << 20                   # allowance on top of the file's size (headers, rounding)
STRING_SLACK = 16 << 20
MAX_COMPRESSED_LOAD = 256 << 20   # decoded bytes of compressed tables loaded at open, all together


class Budget:
    """What one open of a file of ``file_size`` bytes may load (see the module docstring)."""

    def __init__(self, file_size: int):
        self.file_size = int(file_size)
        self.plain = 0
        self.packed = 0
        self.strings = 0

    def table(self, ds: Any, rows: int, what: str) -> None:
        """Account for loading ``rows`` rows of ``ds`` whole at open (token table, rows index)."""
        nbytes = rows * row_bytes(ds)
        if filters_of(ds):
            if self.packed + nbytes > MAX_COMPRESSED_LOAD:
                raise TraceFileError(f"{what} is compressed and claims {rows} rows ({nbytes} bytes decoded); at most "
                                     f"{MAX_COMPRESSED_LOAD >> 20} MiB of compressed tables are loaded at open (the "
                                     f"file has {self.file_size} bytes); the file is damaged or crafted")
            self.packed += nbytes
            return
        if nbytes > self.file_size + SLACK:
            raise TraceFileError(f"{what} claims {rows} rows ({nbytes} bytes) but the file has only "
                                 f"{self.file_size} bytes; the file is truncated or damaged")
        if self.plain + nbytes > self.file_size + SLACK:
            raise TraceFileError(f"{what} claims {rows} rows ({nbytes} bytes); with the tables read before it that "
                                 f"is more than the file's {self.file_size} bytes (datasets linked under several "
                                 "names, or a truncated or damaged file)")
        self.plain += nbytes

    def stream(self, ds: Any, rows: int, what: str) -> None:
        """Check a dataset read later in blocks: its ``rows`` must fit in what the file stores."""
        nbytes = rows * row_bytes(ds)
        if filters_of(ds):
            stored = stored_bytes(ds)
            if nbytes > stored * FILTER_EXPANSION + SLACK:
                raise TraceFileError(f"{what} claims {rows} rows ({nbytes} bytes decoded) but the file stores "
                                     f"{stored} compressed bytes of it (more than {FILTER_EXPANSION}x); the file is "
                                     "damaged or crafted")
        elif nbytes > self.file_size + SLACK:
            raise TraceFileError(f"{what} claims {rows} rows ({nbytes} bytes) but the file has only "
                                 f"{self.file_size} bytes; the file is truncated or damaged")

    def string_bytes(self, n: int, what: str) -> None:
        """Account for ``n`` decoded bytes of strings."""
        self.strings += int(n)
        if self.strings > 2 * self.file_size + STRING_SLACK:
            raise TraceFileError(f"{what}: the file's strings decode to more than twice the {self.file_size} bytes "
                                 "it holds (entries pointing at one heap string); the file is damaged or crafted")


def row_bytes(ds: Any) -> int:
    return int(ds.dtype.itemsize) * int(math.prod(ds.shape[1:]))


def filters_of(ds: Any) -> list[int]:
    """The HDF5 filter ids of a dataset's pipeline (empty: stored as is)."""
    plist = getattr(ds, "_dcpl", None)   # h5py's Dataset keeps its creation property list
    if plist is None:
        plist = ds.id.get_create_plist()
    return [int(plist.get_filter(i)[0]) for i in range(plist.get_nfilters())]


def stored_bytes(ds: Any) -> int:
    """Bytes the file allocates to a dataset's data (compressed size for compressed chunks)."""
    try:
        return int(ds.id.get_storage_size())
    except Exception:  # noqa: BLE001 - unknown: assume nothing is stored
        return 0


def vlen_string_bytes(ds: Any, n: int, addr_size: int) -> int | None:
    """Total decoded length of the first ``n`` entries of a 1-D variable-length string dataset,
    from the on-disk descriptors (length, heap collection address, index) without decoding a
    string; None when they cannot be read raw (compact or filtered storage)."""
    if n <= 0:
        return 0
    layout = ds.id.get_create_plist().get_layout()
    elem = 4 + addr_size + 4
    desc = np.dtype([("len", "<u4"), ("addr", f"V{addr_size}"), ("idx", "<u4")])
    if layout != h5py.h5d.CHUNKED or filters_of(ds) or ds.chunks is None:
        return None
    chunk = int(ds.chunks[0])
    total = 0
    for i in range(int(ds.id.get_num_chunks())):
        info = ds.id.get_chunk_info(i)
        start = int(info.chunk_offset[0])
        if start >= n:
            continue
        if info.size != chunk * elem:
            return None
        _, raw = ds.id.read_direct_chunk(info.chunk_offset)
        lengths = np.frombuffer(raw, dtype=desc, count=min(chunk, n - start))["len"]
        total += int(lengths.sum(dtype=np.int64))
    return total
