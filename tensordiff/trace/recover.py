"""Reading a trace whose recorder was killed: the committed rows, and nothing else.

TraceWriter commits rows at each flush and records how many (``flushed_tokens`` on the root,
``flushed_rows`` on each tensor). A trace not marked ``complete`` is read up to those counts; the
reader drops rows past them and says so in one note (:func:`recovered_note`).

A writer killed *inside* a flush can leave object headers that point past the end-of-allocation
address its superblock still records (HDF5 writes the superblock last): "addr overflow" on open.
Such a trace is read through :class:`PatchedView`, a read-only file object that overlays a raised
end-of-allocation address on the superblock (what ``h5clear --increment`` would write), without
writing to the file. Only traces that were not closed cleanly are read this way.
"""

from __future__ import annotations

import io
from typing import Any

_HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"


def eoa_patch(path: str, size: int) -> tuple[int, bytes] | None:
    """Where and what to overlay on a version 0/1 superblock so that its end-of-allocation
    address covers the whole file; None when it already does (or the superblock is another
    version: those carry a checksum and come from writers other than TraceWriter)."""
    try:
        with open(path, "rb") as fh:
            at = 0
            while at < size:
                fh.seek(at)
                head = fh.read(64)
                if head[:8] == _HDF5_SIGNATURE:
                    break
                at = 512 if at == 0 else at * 2
            else:
                return None
    except OSError:
        return None
    if len(head) < 64 or head[8] not in (0, 1) or head[13] not in (4, 8):
        return None
    o = head[13]
    off = 24 + (4 if head[8] == 1 else 0)
    base = int.from_bytes(head[off:off + o], "little")
    eoa_at = off + 2 * o
    eoa = int.from_bytes(head[eoa_at:eoa_at + o], "little")
    want = size - base
    if base > size or eoa >= want:
        return None
    return at + eoa_at, want.to_bytes(o, "little")


class PatchedView(io.RawIOBase):
    """A read-only file object over ``path`` with ``data`` overlaid at ``offset``."""

    def __init__(self, path: str, offset: int, data: bytes):
        super().__init__()
        self._fh = open(path, "rb", buffering=0)  # noqa: SIM115 - closed by close()
        self._off, self._data = offset, data

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = 0) -> int:
        return self._fh.seek(pos, whence)

    def tell(self) -> int:
        return self._fh.tell()

    def fileno(self) -> int:
        return self._fh.fileno()

    def readinto(self, b: Any) -> int:
        pos = self._fh.tell()
        n = self._fh.readinto(b)
        if n:
            lo, hi = max(pos, self._off), min(pos + n, self._off + len(self._data))
            if lo < hi:
                memoryview(b)[lo - pos:hi - pos] = self._data[lo - self._off:hi - self._off]
        return n or 0

    def close(self) -> None:
        self._fh.close()
        super().close()


NOTHING_COMMITTED = ("trace was not closed cleanly (recording interrupted) before its first flush "
                     "committed any rows: recovered 0 token rows")
INSIDE_A_FLUSH = " (it was killed inside a flush; read past the recorded end of file)"


def recovered_note(tokens: int, tensor_rows: int, tensors: int, *, committed: bool, dropped_tokens: int,
                   dropped_tensor_rows: int, skipped: list[str]) -> str:
    """What the reader kept of a trace that was not closed cleanly, in one sentence."""
    how = "up to its last flush" if committed else "by consistency checks (no flush record)"
    extra = ""
    if dropped_tokens or dropped_tensor_rows:
        extra = (f"; {dropped_tokens} token rows and {dropped_tensor_rows} tensor rows written after that flush "
                 "were dropped")
    if skipped:
        extra += f"; {len(skipped)} tensors defined after that flush were skipped ({', '.join(skipped[:5])})"
    return (f"trace was not closed cleanly (recording interrupted); recovered {tokens} token "
            f"rows and {tensor_rows} tensor rows in {tensors} tensors {how}{extra}")
