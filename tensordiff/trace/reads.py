"""Reading rows of an open trace: values, sketches and RMS by row range or by row subset, without
loading whole datasets, through a bounded set of open datasets; runs of rows of plain chunked
datasets straight from the file (``os.preadv``, the GIL released), or mapped in place
(``mmap``: the page cache's own pages, no copy) for a caller that only reads them. :class:`RowReads` is the part of
:class:`~tensordiff.trace.TraceReader` that reads after the open has validated everything.

Why one module of this size: the bounded set of open datasets and every read path that shares it.
"""

from __future__ import annotations

import bisect
import mmap
import os
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import h5py  # type: ignore[import-untyped, unused-ignore]
import numpy as np
from h5py import h5i, h5o  # type: ignore[import-untyped, unused-ignore]

from ..dtypes import to_float32
from ..errors import TraceFileError
from ..sketch import sketch_rows
from .schema import TensorInfo, slot_rms
from .validate import short

_SPAN_BYTES = 4 << 20  # scattered reads: read a span this large whole, then pick rows
_RUN_BYTES = 256 << 10  # increasing rows in runs at least this long (on average) are read run by run
_FEW_RUNS = 8           # ... as are increasing rows in at most this many runs, however short
OPEN_DATASETS = 64     # datasets kept open at once (see RowReads._dataset)


_INNER = ("values_ref",)   # datasets the reader reads for a part, not parts themselves


class _Parts(Mapping[str, Any]):
    """A tensor's parts (``rows``, ``values``, ``sketch``, ``rms``) by name: its datasets, opened on
    use, and the parts the reader resolves (a sketch derived from the values: :class:`DerivedSketch`),
    made on first use. ``paths`` are the datasets in the file; ``virtual`` the resolved parts."""

    def __init__(self, reader: RowReads, paths: dict[str, str], virtual: Mapping[str, Callable[[], Any]] | None = None):
        self._reader = reader
        self._paths = paths
        self._virtual = dict(virtual or {})
        self._made: dict[str, Any] = {}

    def __getitem__(self, part: str) -> Any:
        make = self._virtual.get(part)
        if make is not None:
            got = self._made.get(part)
            if got is None:
                got = self._made[part] = make()
            return got
        if part in _INNER:
            raise KeyError(part)
        return self._reader._dataset(self._paths[part])

    def __iter__(self) -> Iterator[str]:
        return iter(dict.fromkeys([*(p for p in self._paths if p not in _INNER), *self._virtual]))

    def __len__(self) -> int:
        return len(list(iter(self)))

    def __contains__(self, part: object) -> bool:
        return (part in self._paths and part not in _INNER) or part in self._virtual

    def path(self, part: str) -> str | None:
        """The path of a part stored as a dataset (None: resolved by the reader, or absent)."""
        return self._paths.get(part) if part not in self._virtual else None

    def stored(self) -> dict[str, str]:
        """The parts that are datasets in the file, by part: their paths."""
        return dict(self._paths)


class LastDerived:
    """The last block of sketch rows a reader derived (one per reader, whatever the tensor): a
    scattered read of a derived sketch asks for the same block many times in a row."""

    def __init__(self) -> None:
        self._last: tuple[tuple[str, int, int, int], object, np.ndarray] | None = None

    def get(self, key: tuple[str, int, int, int], owner: object) -> np.ndarray | None:
        last = self._last
        if last is not None and last[0] == key and last[1] is owner:
            return last[2]
        return None

    def put(self, key: tuple[str, int, int, int], owner: object, rows: np.ndarray) -> None:
        self._last = (key, owner, rows)


_DERIVE_BYTES = 8 << 20   # a derived sketch is computed in blocks of at most this many float32 bytes (values or sketch)


class _Resolved:
    """A read-only part the reader computes (not a dataset in the file), with what the reads and the
    diff use of an h5py dataset: ``shape``, ``dtype``, ``chunks``, ``ndim``, ``[]`` with a slice, an
    integer or an index array (any order, repeats), ``read_direct``. Subclasses give
    :meth:`rows` (a run into a buffer) and :meth:`take` (any rows)."""

    derived = True
    name: str
    shape: tuple[int, int]
    dtype: np.dtype[Any]
    chunks: tuple[int, int]
    ndim = 2

    def __len__(self) -> int:
        return self.shape[0]

    def _dest(self, n: int, out: np.ndarray | None) -> np.ndarray:
        """``out`` as an [n, width] array of this part's dtype (a new one when it does not fit)."""
        size = n * self.shape[1]
        if out is not None and out.dtype == self.dtype and out.size >= size and out.flags.c_contiguous:
            return out.reshape(-1)[:size].reshape(n, self.shape[1])
        return np.empty((n, self.shape[1]), self.dtype)

    def rows(self, lo: int, hi: int, out: np.ndarray | None = None) -> np.ndarray:
        raise NotImplementedError

    def take(self, idx: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        raise NotImplementedError

    def _check(self, idx: np.ndarray) -> np.ndarray:
        idx = np.asarray(idx, dtype=np.int64).reshape(-1)
        if len(idx) and (int(idx.min()) < 0 or int(idx.max()) >= self.shape[0]):
            raise IndexError(f"rows out of range for {self.name} ({self.shape[0]} rows)")
        return idx

    def __getitem__(self, sel: Any) -> np.ndarray:
        rest: tuple[Any, ...] = ()
        if isinstance(sel, tuple):
            sel, rest = (sel[0], sel[1:]) if sel else (slice(None), ())
        n = self.shape[0]
        got: np.ndarray
        if isinstance(sel, slice):
            lo, hi, step = sel.indices(n)
            got = self.rows(lo, max(lo, hi)) if step == 1 else self.take(np.arange(lo, hi, step))
        elif isinstance(sel, (int, np.integer)):
            i = int(sel) + (n if int(sel) < 0 else 0)
            if not 0 <= i < n:
                raise IndexError(f"row {int(sel)} out of range for {self.name} ({n} rows)")
            got = self.rows(i, i + 1)[0]
        else:
            idx = np.asarray(sel)
            if idx.dtype == np.bool_:
                idx = np.flatnonzero(idx)
            got = self.take(self._check(idx))
        return got[rest] if rest else got

    def read_direct(self, dest: np.ndarray, source_sel: Any = None, dest_sel: Any = None) -> None:
        """Rows ``source_sel`` (a slice; all when None) into ``dest`` (h5py's ``read_direct``)."""
        sel = source_sel if source_sel is not None else slice(None)
        target = dest if dest_sel is None else dest[dest_sel]
        if isinstance(sel, slice) and sel.step in (None, 1) and target.flags.c_contiguous and target.dtype == self.dtype:
            lo, hi, _ = sel.indices(self.shape[0])
            got = self.rows(lo, max(lo, hi), target)
            if not np.may_share_memory(got, target):
                target[...] = got.reshape(target.shape)
            return
        target[...] = self[sel]


class DerivedSketch(_Resolved):
    """The sketch of a tensor stored with full values but no sketch, computed from the values as
    TraceWriter computes the sketches it owes: :func:`tensordiff.sketch.sketch_rows` of the float32
    values, one block of ``block`` rows at a time (the values' chunk rows, aligned at multiples of
    it, the last block zero-padded), so a row's sketch is the same whatever the read that asks for
    it, and equal to the one the writer would have stored. Memory: one block of values and of
    sketch at a time (the last block computed is kept, one per reader)."""

    def __init__(self, reader: RowReads, name: str, info: TensorInfo, dim: int, seed: int):
        values = reader._ds[name]["values"]
        self._reader, self._tensor, self._info = reader, name, info
        self._dim, self._seed = int(dim), int(seed)
        self._vdtype = np.dtype(values.dtype)
        kd = info.slot_count * self._dim
        cr = int(values.chunks[0]) if getattr(values, "chunks", None) else 128
        self.block = max(1, min(cr, _DERIVE_BYTES // (4 * max(info.width, kd))))
        self.name = f"{getattr(values, 'name', name)} (sketch derived)"
        self.shape = (int(info.rows), kd)
        self.dtype = np.dtype(np.float32)
        self.chunks = (self.block, kd)

    def _block(self, b: int) -> np.ndarray:
        """The sketch rows of block ``b`` (rows [b*block, ...) of the tensor)."""
        key = (self._tensor, self._dim, self._seed, b)
        hit = self._reader._derived.get(key, self)
        if hit is not None:
            return hit
        bs, info = self.block, self._info
        lo, hi = b * bs, min(self.shape[0], (b + 1) * bs)
        buf = np.zeros((bs, info.width), self._vdtype)
        self._reader._read_ds(self._reader._ds[self._tensor]["values"], np.s_[lo:hi], buf[:hi - lo],
                              f"{self._tensor}/values")
        sk = sketch_rows(to_float32(buf, info.dtype), info.slot_width, self._dim, self._seed)
        out = np.ascontiguousarray(sk[:hi - lo], dtype=np.float32)
        self._reader._derived.put(key, self, out)
        return out

    def rows(self, lo: int, hi: int, out: np.ndarray | None = None) -> np.ndarray:
        if lo < 0 or hi > self.shape[0]:
            raise IndexError(f"rows {lo}..{hi} out of range for {self.name} ({self.shape[0]} rows)")
        dest = self._dest(max(0, hi - lo), out)
        bs = self.block
        for b in range(lo // bs, (hi - 1) // bs + 1 if hi > lo else lo // bs):
            a0, a1 = max(lo, b * bs), min(hi, (b + 1) * bs)
            dest[a0 - lo:a1 - lo] = self._block(b)[a0 - b * bs:a1 - b * bs]
        return dest

    def take(self, idx: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        idx = self._check(idx)
        dest = self._dest(len(idx), out)
        if not len(idx):
            return dest
        blocks = idx // self.block
        order = np.argsort(blocks, kind="stable")
        sb = blocks[order]
        cuts = np.flatnonzero(np.diff(sb)) + 1
        for pos in np.split(order, cuts):
            b = int(blocks[pos[0]])
            dest[pos] = self._block(b)[idx[pos] - b * self.block]
        return dest


_PIECE_BYTES = 4 << 20   # values by reference are resolved in pieces of about this many bytes


class RefValues(_Resolved):
    """The values of a tensor that takes some rows' values by reference (``values_source``): a row
    whose ``values_ref`` is -1 reads the next row of its own values dataset, any other reads that
    row of the source tensor's values. ``enc`` (loaded and checked at open): per row, the source row,
    or ``-1 - i`` for the i-th row of its own values. Read in pieces of about 4 MiB, each piece's own
    rows and source rows read as the reader reads any rows (runs straight into the buffer)."""

    def __init__(self, reader: RowReads, name: str, own_path: str, source: str, enc: np.ndarray, width: int,
                 dtype: np.dtype[Any], chunks: tuple[int, ...] | None):
        self._reader, self._tensor, self._own, self._source, self._enc = reader, name, own_path, source, enc
        self.name = f"{own_path} (rows by reference to {source})"
        self.shape = (len(enc), int(width))
        self.dtype = np.dtype(dtype)
        self.chunks = (int(chunks[0]) if chunks else 128, int(width))

    def rows(self, lo: int, hi: int, out: np.ndarray | None = None) -> np.ndarray:
        if lo < 0 or hi > self.shape[0]:
            raise IndexError(f"rows {lo}..{hi} out of range for {self.name} ({self.shape[0]} rows)")
        return self.take(np.arange(lo, max(lo, hi), dtype=np.int64), out)

    def take(self, idx: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        idx = self._check(idx)
        dest = self._dest(len(idx), out)
        r = self._reader
        what = f"{self._tensor}/values"
        piece = max(1, _PIECE_BYTES // max(1, self.shape[1] * self.dtype.itemsize))
        for s0 in range(0, len(idx), piece):
            e = self._enc[idx[s0:s0 + piece]]
            d = dest[s0:s0 + len(e)]
            own = e < 0
            if own.all():
                got = r._take(r._dataset(self._own), -1 - e, d, what)
            elif not own.any():
                got = r._take(r._ds[self._source]["values"], e, d, f"{self._source}/values")
            else:
                d[own] = r._take(r._dataset(self._own), -1 - e[own], None, what)
                d[~own] = r._take(r._ds[self._source]["values"], e[~own], None, f"{self._source}/values")
                continue
            if not np.may_share_memory(got, d):
                d[...] = got
        return dest


class Pieces:
    """The rows of one block as consecutive arrays (runs of chunks mapped in place, each
    read-only): ``parts[i]`` holds rows ``starts[i]`` to ``starts[i + 1]``."""

    def __init__(self, parts: list[np.ndarray]):
        self.parts = parts
        self.starts: list[int] = [0]
        for p in parts:
            self.starts.append(self.starts[-1] + len(p))
        self.shape: tuple[int, ...] = (self.starts[-1],) + tuple(parts[0].shape[1:])
        self.dtype = parts[0].dtype

    def __len__(self) -> int:
        return self.starts[-1]

    @property
    def cuts(self) -> list[int]:
        """Where one array ends and the next begins (rows)."""
        return self.starts[1:-1]

    def rows(self, r0: int, r1: int) -> np.ndarray:
        """Rows [r0, r1): a view where one array holds them all, else a copy."""
        i = bisect.bisect_right(self.starts, r0) - 1
        if r1 <= self.starts[i + 1]:
            return self.parts[i][r0 - self.starts[i]:r1 - self.starts[i]]
        j = bisect.bisect_left(self.starts, r1)
        return np.concatenate([self.parts[k][max(r0, self.starts[k]) - self.starts[k]:min(r1, self.starts[k + 1])
                                             - self.starts[k]] for k in range(i, j)])


def block_rows(block: np.ndarray | Pieces, r0: int, r1: int) -> np.ndarray:
    """Rows [r0, r1) of an array or of :class:`Pieces`."""
    return block[r0:r1] if isinstance(block, np.ndarray) else block.rows(r0, r1)


def gather(block: np.ndarray | Pieces, idx: np.ndarray) -> np.ndarray:
    """Rows ``idx`` (ascending) of an array or of :class:`Pieces`, copied into one array."""
    if isinstance(block, np.ndarray):
        picked: np.ndarray = block[idx]
        return picked
    out = np.empty((len(idx),) + block.shape[1:], block.dtype)
    cuts = np.searchsorted(idx, block.starts)
    for k, part in enumerate(block.parts):
        i0, i1 = int(cuts[k]), int(cuts[k + 1])
        if i1 > i0:
            out[i0:i1] = part[idx[i0:i1] - block.starts[k]]
    return out


class RowReads:
    """Row reads of a validated trace (mixed into :class:`~tensordiff.trace.TraceReader`)."""

    f: Any
    path: str
    file_size: int
    tensors: dict[str, TensorInfo]
    _rows: dict[str, np.ndarray]
    _ds: dict[str, _Parts]
    _refs: dict[str, tuple[str, np.ndarray]]   # values by reference: (source, encoded values_ref) by tensor
    _open: OrderedDict[str, Any]
    _tick: Callable[[int, int], None]
    _derived: LastDerived                  # the last derived sketch block (DerivedSketch)
    _chunk_tables: dict[str, tuple[int, np.ndarray] | None]   # direct reads: by dataset path
    _geometry: dict[str, tuple[tuple[int, ...], np.dtype, int]]   # (row shape, dtype, row bytes) of those with a table
    _fd_direct: int | None | bool          # the file's descriptor for direct reads; False: not looked up yet

    def _reset_reads(self) -> None:
        """The reads' state of a freshly opened file."""
        self._derived = LastDerived()
        self._chunk_tables = {}
        self._geometry = {}
        self._fd_direct = False

    def _dataset(self, path: str) -> Any:
        """An open dataset by its path in the file. At most :data:`OPEN_DATASETS` stay open: HDF5
        gives each open chunked dataset its own chunk cache (~100 KB measured even before a read),
        so keeping 100k tensors' datasets open would cost gigabytes."""
        ds = self._open.get(path)
        if ds is None:
            try:   # h5py's f[path] without the File object it builds to learn the mode (read-only here)
                oid = h5o.open(self.f.id, path.encode("utf-8"))
                if h5i.get_type(oid) != h5i.DATASET:
                    raise TypeError("not a dataset")
                ds = h5py.Dataset(oid, readonly=True)
            except Exception as e:  # noqa: BLE001 - it opened at load time: the file changed or is damaged
                raise TraceFileError(f"cannot open {path}, the file is damaged ({short(e)})", self.path) from None
            self._keep_open(path, ds)
        else:
            self._open.move_to_end(path)
        return ds

    def _keep_open(self, path: str, ds: Any) -> None:
        """Keep ``ds`` open under ``path``, closing the least recently used beyond the bound."""
        self._open[path] = ds
        self._open.move_to_end(path)
        if len(self._open) > OPEN_DATASETS:
            self._open.popitem(last=False)

    # -- reads straight from the file ------------------------------------------------------------

    def _direct_rows(self, ds: Any, lo: int, hi: int, dest: np.ndarray) -> bool:
        """Rows [lo, hi) of ``ds`` into ``dest`` (C-contiguous) by ``os.preadv`` from the chunks'
        byte offsets, adjacent chunks in one call: h5py holds the GIL through a whole read, which
        stalls the threads measuring the previous block; a pread releases it. Only for plain
        files and datasets chunked by whole rows without filters whose chunks all lie inside the
        file at their full size (else False: the caller reads through h5py)."""
        if getattr(ds, "derived", False):
            return False   # a part the reader computes: no chunks in the file
        fd = self._direct_fd()
        table = self._chunk_table(ds) if fd is not None else None
        if fd is None or table is None or hi <= lo:
            return False
        cr, offs = table
        row_bytes = dest.nbytes // max(1, hi - lo)
        view = memoryview(dest.reshape(-1).view(np.uint8))  # type: ignore[arg-type]
        pos = 0
        c = lo // cr
        last = (hi - 1) // cr
        while c <= last:
            if offs[c] < 0:
                return False
            start = offs[c] + (max(lo, c * cr) - c * cr) * row_bytes
            c1 = c   # extend over chunks that follow each other in the file
            while c1 < last and offs[c1 + 1] == offs[c1] + cr * row_bytes:
                c1 += 1
            n = (min(hi, (c1 + 1) * cr) - max(lo, c * cr)) * row_bytes
            got = os.preadv(fd, [view[pos:pos + n]], int(start))
            if got != n:   # the chunk lay inside the file when it was opened: it shrank since
                raise self._shrank(ds, int(start) + got)
            pos += n
            c = c1 + 1
        return pos == dest.nbytes

    def _mapped_rows(self, ds: Any, lo: int, hi: int, path: str | None = None) -> np.ndarray | Pieces | None:
        """:meth:`map_rows` of rows [lo, hi) of one dataset: one mapping from the first of their
        chunks to the end of the last (the pages between them are never touched, so never read),
        viewed run of chunks by run of chunks. The caller's kernel reads the page cache in place
        and takes the page faults on its own core. Only where :meth:`_direct_rows` could read the
        rows, and only while the file still holds them: a file that shrank since it was opened is
        a :class:`TraceFileError` (a mapping past its end would kill the process with SIGBUS).
        The mapping lives as long as the arrays."""
        if getattr(ds, "derived", False) or hi <= lo:
            return None
        fd = self._direct_fd()
        table = self._chunk_table(ds, path) if fd is not None else None
        if fd is None or table is None:
            return None
        cr, offs = table
        shape, dtype, row_bytes = self._geometry[path or ds.name]
        c0 = lo // cr
        seg = offs[c0:(hi - 1) // cr + 1]
        if len(seg) == 0 or (seg < 0).any():
            return None
        # each chunk's rows [r0, r1) of the block and their bytes in the file
        runs: list[tuple[int, int, int]] = []   # (first row of the run, rows, file offset)
        for j, off in enumerate(seg.tolist()):
            r0, r1 = max(lo, (c0 + j) * cr), min(hi, (c0 + j + 1) * cr)
            at = off + (r0 - (c0 + j) * cr) * row_bytes
            if runs and runs[-1][2] + runs[-1][1] * row_bytes == at:
                runs[-1] = (runs[-1][0], runs[-1][1] + r1 - r0, runs[-1][2])
            else:
                runs.append((r0, r1 - r0, at))
        first = min(r[2] for r in runs)
        end = max(r[2] + r[1] * row_bytes for r in runs)
        base = first - first % mmap.ALLOCATIONGRANULARITY
        try:
            size = os.fstat(fd).st_size
            m = mmap.mmap(fd, end - base, access=mmap.ACCESS_READ, offset=base) if size >= end else None
        except (OSError, ValueError, OverflowError):
            return None
        if m is None:
            raise self._shrank(ds, size)
        whole = np.frombuffer(m, np.uint8)
        parts = [whole[at - base:at - base + n * row_bytes].view(dtype).reshape((n,) + shape) for _, n, at in runs]
        return parts[0] if len(parts) == 1 else Pieces(parts)

    def _shrank(self, ds: Any, end: int) -> TraceFileError:
        """The error of a read past the end of a file that was longer when it was opened (HDF5
        would read zeros there)."""
        return TraceFileError(f"cannot read {ds.name}, the file is damaged (it ends at byte {end}, it had "
                              f"{self.file_size} bytes when it was opened)", self.path)

    def _direct_fd(self) -> int | None:
        fd = self._fd_direct
        if fd is False:
            fd = None
            try:
                if getattr(self, "_view", None) is None and self.f.driver == "sec2":
                    fd = int(self.f.id.get_vfd_handle())
            except (OSError, TypeError, ValueError, AttributeError, RuntimeError):
                fd = None
            self._fd_direct = fd
        return fd if isinstance(fd, int) else None

    def _chunk_table(self, ds: Any, path: str | None = None) -> tuple[int, np.ndarray] | None:
        """(rows per chunk, byte offset of each chunk or -1) of a dataset fit for direct reads,
        by its ``path`` (asking the dataset for its name costs an HDF5 path search). The row's
        shape, dtype and bytes go into ``_geometry`` under the same key."""
        if not isinstance(ds, h5py.Dataset):
            return None   # a part the reader computes (DerivedSketch): read through its own methods
        cache = self._chunk_tables
        key = path or ds.name
        if key in cache:
            return cache[key]
        table = None
        try:
            chunks, shape, dtype = ds.chunks, ds.shape, ds.dtype
            if (chunks is not None and len(shape) >= 1 and tuple(chunks[1:]) == tuple(shape[1:]) and not ds._filters
                    and dtype.kind in "uif" and dtype.isnative and hasattr(ds.id, "chunk_iter")):
                cr = int(chunks[0])
                full = cr * int(np.prod(shape[1:], dtype=np.int64)) * dtype.itemsize
                offs = np.full(-(-int(shape[0]) // cr), -1, np.int64)
                size = self.file_size

                def visit(info: Any) -> None:
                    c = int(info.chunk_offset[0]) // cr
                    off = info.byte_offset
                    if (0 <= c < len(offs) and off is not None and info.size == full and info.filter_mask == 0
                            and 0 <= off and off + full <= size):
                        offs[c] = off

                ds.id.chunk_iter(visit)
                table = (cr, offs)
                self._geometry[key] = (tuple(shape[1:]), dtype, full // cr)
        except Exception:  # noqa: BLE001 - no table: the reads go through h5py, which reports damage
            table = None
        cache[key] = table
        return table

    def token_rows(self, name: str) -> np.ndarray:
        """Token-table row of every row of tensor ``name`` (int64, loaded at open)."""
        return self._rows[name]

    def _stored(self, name: str, part: str) -> Any:
        """Part ``part`` of tensor ``name``: an open dataset, or a part the reader computes (kept
        in here: what leaves the reader is a :class:`~tensordiff.trace.source.TensorPart`)."""
        try:
            return self._ds[name][part]
        except KeyError:
            raise TraceFileError(f"tensor {name!r} has no {part}", self.path) from None

    def has_part(self, name: str, part: str) -> bool:
        parts = self._ds.get(name)
        return parts is not None and part in parts

    def _read(self, name: str, part: str, sel: Any, out: np.ndarray | None = None) -> np.ndarray:
        try:
            ds = self._ds[name][part]
        except KeyError:
            raise TraceFileError(f"tensor {name!r} has no {part}", self.path) from None
        return self._read_ds(ds, sel, out, f"{name}/{part}")

    def _read_ds(self, ds: Any, sel: Any, out: np.ndarray | None, what: str) -> np.ndarray:
        """``ds[sel]`` (a dataset or a part the reader computes); a slice with ``out`` is read into
        ``out`` (its first rows, viewed in the dataset's row shape), straight from the file when it can."""
        try:
            if out is not None and isinstance(sel, slice):
                n = len(range(*sel.indices(ds.shape[0])))
                dest = out.reshape(-1)[:n * int(np.prod(ds.shape[1:], dtype=np.int64))].reshape((n,) + ds.shape[1:])
                start = sel.start or 0
                if not self._direct_rows(ds, start, start + n, dest):
                    ds.read_direct(dest, np.s_[start:start + n])  # no fresh allocation per block
                return dest
            if isinstance(sel, slice) and sel.step in (None, 1) and not getattr(ds, "derived", False):
                lo, hi, _ = sel.indices(ds.shape[0])
                if hi > lo:   # straight from the file into a fresh array when the dataset allows
                    dest = np.empty((hi - lo,) + tuple(ds.shape[1:]), ds.dtype)
                    if self._direct_rows(ds, lo, hi, dest):
                        return dest
            block: np.ndarray = ds[sel]
            return block
        except (OSError, ValueError, TypeError) as e:
            raise TraceFileError(f"cannot read {what}, the file is damaged ({short(e)})", self.path) from None

    def read_values(self, name: str, start: int = 0, stop: int | None = None, *, raw: bool = False) -> np.ndarray:
        """Rows [start, stop) of a tensor's full values as float32 (``raw=True``: stored form)."""
        info = self.tensors[name]
        stop = info.rows if stop is None else min(stop, info.rows)
        block = self._read(name, "values", np.s_[start:stop])
        return block if raw else to_float32(block, info.dtype)

    def read_at(self, name: str, part: str, idx: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """Rows of ``name/part`` (values in stored form, sketch or rms) at row indices in any order
        and with repeats. Never an HDF5 point selection (slow): one contiguous read when the span
        is small, else one read per touched chunk, then the rows are picked in memory."""
        idx = np.asarray(idx, dtype=np.int64)
        ds = self._ds[name].get(part)
        if ds is None:
            raise TraceFileError(f"tensor {name!r} has no {part}", self.path)
        return self._take(ds, idx, out, f"{name}/{part}")

    def read_range(self, name: str, part: str, lo: int, hi: int, out: np.ndarray | None = None) -> np.ndarray:
        """Rows [lo, hi) of ``name/part`` in stored form, in one read (into ``out`` when given)."""
        return self._read(name, part, np.s_[lo:hi], out)

    def map_rows(self, name: str, part: str, idx: np.ndarray) -> np.ndarray | Pieces | None:
        """A run of rows ``idx`` of ``name/part`` in place in the file's pages (``mmap``: no
        copy; read-only), for a caller that only reads them: one array where their chunks follow
        each other in the file, else :class:`Pieces` (one array per run of chunks that do; a
        trace recorded pass by pass interleaves its tensors' chunks). None where they cannot be
        mapped (not a run, a filtered or derived part, not a plain file): the caller reads them."""
        idx = np.asarray(idx, dtype=np.int64)
        ds = self._ds[name].get(part)
        if ds is None:
            raise TraceFileError(f"tensor {name!r} has no {part}", self.path)
        if len(idx) == 0:
            return None
        lo, hi = int(idx[0]), int(idx[-1]) + 1
        if hi - lo != len(idx) or (len(idx) > 1 and not np.all(np.diff(idx) == 1)):
            return None
        return self._mapped_rows(ds, lo, hi, self._ds[name].path(part))

    def _take(self, ds: Any, idx: np.ndarray, out: np.ndarray | None, what: str) -> np.ndarray:
        """:meth:`read_at` of one dataset (or part the reader computes)."""
        if len(idx) == 0:
            return np.empty((0,) + ds.shape[1:], ds.dtype)
        lo, hi = int(idx[0]), int(idx[-1]) + 1
        if hi - lo == len(idx) and (len(idx) == 1 or np.all(np.diff(idx) == 1)):
            # the common case: a run of rows, read straight into ``out`` (same dtype) when given
            return self._read_ds(ds, np.s_[lo:hi], out, what)
        if getattr(ds, "derived", False):   # computed block by block, in any order
            try:
                got: np.ndarray = ds.take(idx, out)
            except (IndexError, ValueError) as e:
                raise TraceFileError(f"cannot read {what} ({short(e)})", self.path) from None
            return got
        row_bytes = max(1, int(np.prod(ds.shape[1:], dtype=np.int64)) * ds.dtype.itemsize)
        # runs only where they come straight from the file: through h5py, a chunk shared by two
        # runs of a filtered dataset would be decompressed twice
        runs = _runs(idx, row_bytes) if self._direct_fd() is not None and self._chunk_table(ds) is not None else None
        if runs is not None:
            return self._take_runs(ds, idx, runs, out, what)
        uniq, inv = np.unique(idx, return_inverse=True)
        lo, hi = int(uniq[0]), int(uniq[-1]) + 1
        if (hi - lo) * row_bytes <= _SPAN_BYTES or hi - lo <= 4 * len(uniq):
            block = self._read_ds(ds, np.s_[lo:hi], None, what)[uniq - lo]
        else:
            cr = ds.chunks[0] if ds.chunks else max(1, _SPAN_BYTES // row_bytes)
            block = np.empty((len(uniq),) + ds.shape[1:], ds.dtype)
            cid = uniq // cr
            cuts = np.flatnonzero(np.diff(cid)) + 1
            for part_idx in np.split(np.arange(len(uniq)), cuts):
                u = uniq[part_idx]
                a0, a1 = int(u[0]), int(u[-1]) + 1
                block[part_idx] = self._read_ds(ds, np.s_[a0:a1], None, what)[u - a0]
        picked: np.ndarray = block[inv]
        return picked

    def _take_runs(self, ds: Any, idx: np.ndarray, cuts: np.ndarray, out: np.ndarray | None, what: str) -> np.ndarray:
        """Rows ``idx`` (increasing, runs of consecutive rows starting at ``cuts``) read run by run
        straight into the result (``out`` when it fits): only the rows asked for, no copy after."""
        shape = (len(idx),) + tuple(ds.shape[1:])
        size = int(np.prod(shape, dtype=np.int64))
        if out is not None and out.dtype == ds.dtype and out.flags.c_contiguous and out.size >= size:
            dest = out.reshape(-1)[:size].reshape(shape)
        else:
            dest = np.empty(shape, ds.dtype)
        bounds = [*cuts.tolist(), len(idx)]
        for p0, p1 in zip(bounds[:-1], bounds[1:]):
            lo = int(idx[p0])
            got = self._read_ds(ds, np.s_[lo:lo + p1 - p0], dest[p0:p1], what)
            if not np.may_share_memory(got, dest):
                dest[p0:p1] = got
        return dest

    def read_values_at(self, name: str, idx: np.ndarray, *, raw: bool = False,
                       out: np.ndarray | None = None) -> np.ndarray:
        """Tensor rows at the given row indices (any order), float32 (``raw=True``: stored form).
        ``out``: a reusable float32 buffer (see :func:`tensordiff.dtypes.to_float32`)."""
        block = self.read_at(name, "values", idx)
        return block if raw else to_float32(block, self.tensors[name].dtype, out)

    def read_sketch(self, name: str, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Rows [start, stop) of a tensor's sketch, stored or derived from its values (float32)."""
        rows = self.tensors[name].rows
        stop = rows if stop is None else min(stop, rows)
        return np.asarray(self._read(name, "sketch", np.s_[start:stop]), dtype=np.float32)

    def read_rms(self, name: str, start: int = 0, stop: int | None = None) -> np.ndarray:
        if "rms" not in self._ds[name]:
            vals = self.read_values(name, start, stop)
            return slot_rms(vals, self.tensors[name].slot_width)
        rows = self.tensors[name].rows
        stop = rows if stop is None else min(stop, rows)
        return np.asarray(self._read(name, "rms", np.s_[start:stop]), dtype=np.float32)

    def touch(self) -> None:
        """Walk each dataset's chunk index at both ends (what a damaged index makes the HDF5
        library loop or crash on): the first and last chunk's entry is looked up, without
        reading its data, for chunked datasets without filters; the first and last row are read
        for others (the filter pipeline runs on them too)."""
        total = len(self.tensors)
        refs = getattr(self, "_refs", {})
        for done, (name, info) in enumerate(self.tensors.items()):
            self._tick(done, total)
            if info.rows:
                for part, path in self._ds[name].stored().items():   # the datasets in the file
                    rows = info.rows
                    if part == "values" and name in refs:   # values by reference: its own rows only
                        rows = int(np.count_nonzero(refs[name][1] < 0))
                    if part != "rows" and rows:
                        self._touch_ends(f"{name}/{part}", self._dataset(path), rows)

    def _touch_ends(self, what: str, ds: Any, rows: int) -> None:
        chunks = ds.chunks
        lookup = getattr(ds.id, "get_chunk_info_by_coord", None)
        if chunks and lookup is not None and not ds._filters:
            zero = (0,) * (len(ds.shape) - 1)
            try:
                for r in (0, (rows - 1) // chunks[0] * chunks[0]):
                    lookup((r,) + zero)
                return
            except (OSError, ValueError, TypeError, RuntimeError, KeyError) as e:
                raise TraceFileError(f"cannot read {what}, the file is damaged ({short(e)})", self.path) from None
        self._read_ds(ds, np.s_[0:1], None, what)
        self._read_ds(ds, np.s_[rows - 1:rows], None, what)


def _runs(idx: np.ndarray, row_bytes: int) -> np.ndarray | None:
    """Where each run of consecutive rows starts in ``idx`` when the rows increase and come in
    runs worth a read of their own (few, or long on average); None otherwise (a span read and a
    pick serve scattered rows better)."""
    if len(idx) < 2:
        return None
    step = np.diff(idx)
    if not bool((step > 0).all()):
        return None
    cuts = np.concatenate(([0], np.flatnonzero(step != 1) + 1))
    if len(cuts) <= _FEW_RUNS or len(idx) * row_bytes >= len(cuts) * _RUN_BYTES:
        return cuts
    return None
