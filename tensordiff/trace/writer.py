"""Writing a trace: :class:`TraceWriter` appends rows in chunk-aligned blocks with bounded memory
and commits them with a two-phase flush, so a killed recorder leaves every row up to its last
flush readable (docs/robustness.md, "The flush policy"). numpy + h5py only.

Why one module of this size: the append paths and the two-phase flush share the writer's buffers,
extents and committed-row counts; a split would expose them between modules.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import h5py  # type: ignore[import-untyped, unused-ignore]
import numpy as np

from .. import __version__
from ..kernels import Rows, put_rows, put_tokens
from ..dtypes import LOGICAL_DTYPES, storage_dtype, to_float32
from ..sketch import DEFAULT_SKETCH_DIM, DEFAULT_SKETCH_SEED, sketch_rows
from ..vocab import REGIME_CODE, REGIMES, regime_code
from .schema import (
    ALIGN_BYTES,
    CHUNK_BYTES,
    KINDS,
    MAX_CHUNK_BYTES,
    MAX_KEY_CHARS,
    MAX_NAME_CHARS,
    META_BLOCK_BYTES,
    SCHEMA_REFS,
    SCHEMA_VERSION,
    SIDES,
    TOKEN_DTYPE,
    SlotSpec,
    slot_rms,
)
from .validate import tensor_name_problem

if TYPE_CHECKING:
    from typing_extensions import Self

_ND = np.ndarray


def _chunk_rows(row_bytes: int, cap: int = 512) -> int:
    """Rows per chunk: exactly :data:`ALIGN_BYTES` where 16 or more whole rows fill it (256 rows
    at H=4096 bf16: aligned in the file, a chunk maps as one huge page), else about 1 MiB. At
    least 16 rows (a wide vocabulary row must not cost a chunk, an HDF5 write and an index entry
    per row or two) unless 16 rows would pass what a reader reads whole (:data:`MAX_CHUNK_BYTES`),
    and at most ``cap`` rows so that narrow datasets (RMS, row indices, tiny models) do not
    allocate megabytes each."""
    if row_bytes > 0 and ALIGN_BYTES % row_bytes == 0 and 16 <= ALIGN_BYTES // row_bytes <= cap:
        return ALIGN_BYTES // row_bytes
    rows = max(1, CHUNK_BYTES // max(row_bytes, 1))
    rows = min(cap, max(16, 1 << int(math.log2(rows))))
    return int(max(1, min(rows, MAX_CHUNK_BYTES // max(row_bytes, 1))))


class _Appender:
    """Appends rows to one resizable 2-D (or 1-D) dataset in chunk-aligned blocks.

    Rows accumulate in a preallocated buffer of one chunk; a full buffer is written as one
    chunk (one HDF5 call, straight from the buffer). ``flush_partial`` writes the rows buffered so
    far (they stay buffered until their chunk fills, so the next full write rewrites the same
    chunk whole). ``on_full``, if set, runs just before a full buffer is written (the writer
    computes the sketch/RMS rows of the buffered values there: once per block, not per append).
    The buffer's fill and dirty flag live in ``rb``, a compiled :class:`tensordiff._kernels.Rows`:
    the writer's common appends copy rows into several buffers in one compiled call
    (``put_rows``), this class takes every other case."""

    __slots__ = ("ds", "chunk", "buf", "rb", "base", "alloc", "direct", "tail", "rest", "on_full")

    def __init__(self, ds: h5py.Dataset, on_full: Callable[[], None] | None = None):
        self.ds = ds
        self.chunk: int = int(ds.chunks[0])
        # zeros: rows past ``fill`` enter the writer's sketch products, never uninitialised memory
        self.buf = np.zeros((self.chunk,) + ds.shape[1:], dtype=ds.dtype)
        self.rb = self._rows_buffer()
        self.base: int = int(ds.shape[0])  # dataset row where buf[0] goes
        self.alloc: int = self.base        # the dataset's extent (kept here: h5py's shape is slow)
        # raw chunks written as they are: plain numbers, no filter (the buffer's bytes are the
        # chunk's; not a compound or variable-length type, whose file layout differs from memory)
        self.direct = (ds.compression is None and not ds.dtype.fields and ds.dtype.kind in "iuf"
                       and ds.ndim in (1, 2))
        self.tail = (0,) * (ds.ndim - 1)  # chunk offset past the row axis
        self.rest = tuple(ds.shape[1:])   # the extent past the row axis
        self.on_full = on_full

    def _rows_buffer(self) -> Rows:
        return Rows(self.buf)

    @property
    def fill(self) -> int:
        """Rows in buf."""
        return int(self.rb.fill)

    @fill.setter
    def fill(self, value: int) -> None:
        self.rb.fill = value

    @property
    def dirty(self) -> bool:
        """Buffered rows not yet on disk."""
        return bool(self.rb.dirty)

    @dirty.setter
    def dirty(self, value: bool) -> None:
        self.rb.dirty = value

    @property
    def rows(self) -> int:
        return self.base + self.fill

    def append(self, data: np.ndarray, direct: bool = False) -> None:
        """Rows ``data`` after the buffered ones. ``direct``: the caller owes ``on_full`` nothing
        for these rows (no sketch/RMS the writer derives from the buffer), so a whole chunk of them
        that starts at a chunk boundary is written from ``data`` itself, not copied into the buffer
        first (the same bytes in the file)."""
        n = len(data)
        i = 0
        fast = direct and self.direct and data.dtype == self.buf.dtype and data.flags.c_contiguous
        while i < n:
            fill = self.fill
            if fast and fill == 0 and n - i >= self.chunk and self.base % self.chunk == 0:
                self._write_chunk(data[i:i + self.chunk])
                i += self.chunk
                continue
            take = min(self.chunk - fill, n - i)
            self.buf[fill:fill + take] = data[i:i + take]
            self.fill = fill + take
            i += take
            self.dirty = True
            if fill + take == self.chunk:
                self._write_full()

    def _extend(self, end: int) -> None:
        """Grow the extent to ``end``, the rows written: it only ever grows, never past the rows
        written (the metadata reaches the file only at a flush, so the extent on disk is exact).
        Shrinking it would cost HDF5 a read and rewrite of the last chunk (it fills the part past
        the new extent), and h5py's ``resize`` costs several times the library call made here."""
        if self.alloc < end:
            self.ds.id.set_extent((end,) + self.rest)
            self.alloc = end

    def _prepare(self) -> None:
        """Complete ``buf[:fill]`` before it is written (see :class:`_TokenAppender`)."""

    def _write_chunk(self, block: np.ndarray) -> None:
        """A whole chunk of rows, C-contiguous in the dataset's dtype, at ``base`` (chunk-aligned,
        nothing buffered), straight from ``block``."""
        if self.on_full is not None:
            self.on_full()
        end = self.base + self.chunk
        self._extend(end)
        self.ds.id.write_direct_chunk((self.base,) + self.tail, block)
        self.base = end

    def _write_full(self) -> None:
        if self.on_full is not None:
            self.on_full()
        self._prepare()
        end = self.base + self.chunk
        self._extend(end)
        if self.direct and self.base % self.chunk == 0:
            self.ds.id.write_direct_chunk((self.base,) + self.tail, self.buf)  # from the buffer: no copy
        else:
            self.ds[self.base:end] = self.buf
        self.base = end
        self.fill = 0
        self.dirty = False

    def flush_partial(self) -> None:
        """The rows buffered so far to the file, and the extent set to exactly the rows written.
        A plain chunked dataset gets the whole buffer as its chunk (one direct write: rows past
        ``fill`` lie past the extent, unread, and the chunk is written whole again when it fills)."""
        end = self.base + self.fill
        if self.alloc > end:  # (an extent set past the rows elsewhere: back to them)
            self.ds.resize(end, axis=0)
            self.alloc = end
        self._extend(end)
        if not self.dirty:
            return
        self._prepare()
        if self.direct and self.base % self.chunk == 0:
            self.ds.id.write_direct_chunk((self.base,) + self.tail, self.buf)
        else:
            self.ds[self.base:end] = self.buf[:self.fill]
        self.dirty = False


class _TokenAppender(_Appender):
    """The token table's appender. Each ``add_tokens`` call gives one sequence, regime and step
    for all its rows, so those are kept as one run per call, and the record buffer is filled only
    when it is written (once per chunk or flush), not with five column writes per call: ``pairs``
    holds each row's (position, token), ``runs`` each call's (rows, seq, regime, step), and
    ``fill`` counts the rows in ``pairs``."""

    __slots__ = ("pairs", "runs", "runs_rb")

    def _rows_buffer(self) -> Rows:
        self.pairs = np.zeros((self.chunk, 2), dtype=np.int64)
        self.runs = np.zeros((self.chunk, 4), dtype=np.int64)  # a run holds >= 1 row: at most chunk runs
        self.runs_rb = Rows(self.runs)
        return Rows(self.pairs)

    def add(self, positions: np.ndarray, tokens: np.ndarray, seq: int, regime: int, step: int) -> None:
        """Rows of one call (the path the compiled ``put_tokens`` leaves: empty calls, calls that
        fill the chunk, arrays it does not take)."""
        n = len(positions)
        i = 0
        while i < n:
            f = self.fill
            take = min(self.chunk - f, n - i)
            self.pairs[f:f + take, 0] = positions[i:i + take]
            self.pairs[f:f + take, 1] = tokens[i:i + take]
            r = int(self.runs_rb.fill)
            self.runs[r] = (take, seq, regime, step)
            self.runs_rb.fill = r + 1
            self.fill = f + take
            i += take
            self.dirty = True
            if f + take == self.chunk:
                self._write_full()

    def append(self, data: np.ndarray, direct: bool = False) -> None:
        raise TypeError("token rows are added with add()")

    def _prepare(self) -> None:
        fill = self.fill
        buf = self.buf
        buf["position"][:fill] = self.pairs[:fill, 0]
        buf["token"][:fill] = self.pairs[:fill, 1]
        runs = self.runs[:int(self.runs_rb.fill)]
        lens = runs[:, 0]
        for col, c in (("seq", 1), ("regime", 2), ("step", 3)):
            buf[col][:fill] = np.repeat(runs[:, c], lens)

    def _write_full(self) -> None:
        super()._write_full()
        self.runs_rb.fill = 0


class _Tensor:
    """One defined tensor: its appenders, shape, and the rows whose sketch/RMS the writer still
    owes. ``pend_sketch``/``pend_rms``: the first values row (dataset index) whose sketch/RMS the
    writer computes itself and has not computed yet, or None (the caller supplies them). Those rows
    are always in the values buffer: they are computed in one batch when that buffer fills, when
    the caller switches to supplying them, or at a flush."""

    __slots__ = ("values", "sketch", "rms", "rows", "width", "slot_width", "k", "dtype", "sd",
                 "sketch_width", "pend_sketch", "pend_rms", "ref", "own", "source", "source_name")

    def __init__(self, apps: dict[str, _Appender], width: int, slot_width: int, dtype: str, sketch_width: int):
        self.values = apps.get("values")
        self.sketch = apps.get("sketch")
        self.rms = apps["rms"]
        self.rows = apps["rows"]
        # a tensor whose values are by reference (values_source): ``ref`` appends its values_ref
        # rows, ``own`` the rows of values it holds itself (fewer than its rows), and ``values`` is
        # None, so that neither the compiled path nor the writer's own sketch/RMS take its appends
        self.ref = apps.get("values_ref")
        self.own: _Appender | None = None
        self.source: _Tensor | None = None
        self.source_name = ""
        if self.ref is not None:
            self.own, self.values = self.values, None
        self.width = width
        self.slot_width = slot_width
        self.k = width // slot_width
        self.dtype = dtype
        self.sd = storage_dtype(dtype)
        self.sketch_width = sketch_width
        self.pend_sketch: int | None = None
        self.pend_rms: int | None = None


class TraceWriter:
    """Write one trace. Use as a context manager; ``close()`` marks the trace complete.

    >>> with TraceWriter("t.h5", side="train", model={"num_layers": 8, "hidden_size": 64}) as w:
    ...     w.define_tensor("layer3", width=64, kind="boundary", boundary=3)
    ...     rows = w.add_tokens("sample-0", positions=range(4), tokens=[1, 5, 9, 2], regime="train")
    ...     w.append("layer3", rows, values)

    Crash safety (docs/robustness.md): the file on disk changes in one place only, ``flush``.
    Between flushes HDF5's metadata cache is pinned (no evictions), so a process killed at any
    point leaves the metadata of the last flush; the flush then records, per tensor and for the
    token table, how many rows it committed (attributes ``flushed_rows`` / ``flushed_tokens``,
    written after the rows themselves are on disk). A reader of a trace that was not closed
    cleanly keeps exactly those rows.

    Policy: ``add_tokens`` flushes *before* adding its rows when the token rows added since the
    last flush plus these would exceed ``flush_rows``, or when ``flush_seconds`` have passed since
    the last flush -- and only at the start of a step, i.e. when tensor rows were appended since the
    previous ``add_tokens`` (a batch adds each sequence's tokens before any tensor rows, so no flush
    splits it). What is on disk is whole steps: token rows with all their tensor rows. A kill loses
    at most ``flush_rows`` plus one step of token rows (max(``flush_rows``, one step) when a step is
    one ``add_tokens`` call), or the rows of the last ``flush_seconds`` plus one step. ``None``
    turns a trigger off (both ``None``: only ``flush()``/``close()`` write). ``on_flush(writer)`` is
    called after each commit (``writer.flushed`` then says what is on disk). A recorder that adds
    several steps' token rows before their tensor rows holds the triggers meanwhile
    (:meth:`flushes_held`).
    """

    def __init__(self, path: str | os.PathLike[str], side: str = "other", *, producer: str = "",
                 model: dict[str, Any] | None = None, meta: dict[str, Any] | None = None,
                 sketch_dim: int = DEFAULT_SKETCH_DIM, sketch_seed: int = DEFAULT_SKETCH_SEED,
                 flush_rows: int | None = 4096, flush_seconds: float | None = 10.0,
                 versions: dict[str, Any] | None = None, on_flush: Callable[[TraceWriter], None] | None = None,
                 compression: str | None = None):
        if side not in SIDES:
            raise ValueError(f"side must be one of {SIDES}, got {side!r}")
        if flush_rows is not None and (isinstance(flush_rows, bool) or int(flush_rows) < 1):
            raise ValueError(f"flush_rows must be a positive number of token rows or None, got {flush_rows!r}")
        if flush_seconds is not None and not (float(flush_seconds) > 0 and math.isfinite(float(flush_seconds))):
            raise ValueError(f"flush_seconds must be a positive number of seconds or None, got {flush_seconds!r}")
        self.path = os.fspath(path)
        # chunks of ALIGN_BYTES start at multiples of it (smaller objects are packed as before)
        self.f = h5py.File(self.path, "w", alignment_threshold=ALIGN_BYTES, alignment_interval=ALIGN_BYTES,
                           meta_block_size=META_BLOCK_BYTES)
        _pin_metadata(self.f)
        self.model = dict(model or {})
        if compression not in (None, "gzip", "lzf"):
            raise ValueError(f"compression must be None, 'gzip' or 'lzf', got {compression!r}")
        # opt-in (the disk is faster than every compressor); worth it for small shipped traces
        self._comp = {"compression": compression, "shuffle": True} if compression else {}
        self.sketch_dim = int(sketch_dim)
        self.sketch_seed = int(sketch_seed)
        self._flush_rows = None if flush_rows is None else int(flush_rows)
        self._flush_seconds = None if flush_seconds is None else float(flush_seconds)
        self.on_flush = on_flush
        a = self.f.attrs
        a["tensordiff_schema"] = SCHEMA_VERSION
        a["side"] = side
        a["producer"] = producer
        a["created"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        a["model"] = json.dumps(self.model)
        vers = {"tensordiff": __version__, "h5py": h5py.__version__, "hdf5": h5py.version.hdf5_version,
                "numpy": np.__version__}
        vers.update(versions or {})
        a["versions"] = json.dumps(vers)
        a["user_meta"] = json.dumps(meta or {})
        a["sketch_seed"] = self.sketch_seed
        a["sketch_dim"] = self.sketch_dim
        a["complete"] = False
        a["flushed_tokens"] = np.int64(0)
        self.f.create_dataset("sequences", shape=(0,), maxshape=(None,), chunks=(1024,),
                              dtype=h5py.string_dtype("utf-8"))
        tok = self.f.create_dataset("tokens", shape=(0,), maxshape=(None,), chunks=(2048,), dtype=TOKEN_DTYPE)
        tok.attrs["regimes"] = json.dumps(list(REGIMES))
        self.f.create_group("tensors")
        self._tokens = _TokenAppender(tok)
        self._seq_index: dict[str, int] = {}
        self._seq_new: list[str] = []  # keys not in the file yet
        self._tensors: dict[str, dict[str, _Appender]] = {}
        self._groups: dict[str, h5py.Group] = {}
        self._specs: dict[str, dict[str, Any]] = {}
        self._state: dict[str, _Tensor] = {}
        self._scratch = np.empty(0, dtype=np.float32)  # float32 copy of one values block (writer-computed sketch/RMS)
        self._rows_since_flush = 0
        self._dirty = False
        self._appended = False
        self._held = 0   # flushes_held depth: no trigger fires while it is above 0
        self._last_flush = time.monotonic()
        self._set_triggers()
        self._closed = False
        self.flush_count = 0
        self.flushed: dict[str, Any] = {"tokens": 0, "tensors": {}}
        self.f.flush()  # header on disk early: a crash before the first flush still leaves a file

    # -- definitions ---------------------------------------------------------------------------

    @property
    def hidden_size(self) -> int | None:
        h = self.model.get("hidden_size")
        return int(h) if h is not None else None

    def define_tensor(self, name: str, width: int, *, kind: str = "other", dtype: str = "float32",
                      boundary: int | None = None, slots: SlotSpec | None = None,
                      slot_width: int | None = None, order: float | None = None,
                      token_offset: int = 0, role: str = "", values: bool = True,
                      sketch: bool = True, attrs: dict[str, Any] | None = None,
                      values_source: str | None = None) -> None:
        """Declare a tensor before appending to it.

        kind: ``boundary`` (give ``boundary``), ``final_norm``, ``packed`` (give ``slots``; the
        slot width defaults to the model's hidden size) or ``other``. ``values=False`` keeps only
        the sketch and RMS (a cheap catalog entry); ``sketch=False`` with values keeps no sketch
        (the reader derives it from the values). ``token_offset=1`` says row t was paired with
        token t+1 (a draft's input).

        ``values_source``: a tensor defined before this one, holding values itself (not by
        reference), of the same width, dtype, slot count and slot width. Rows of this tensor may
        then take their values from rows of that one instead of storing them again (``append``'s
        ``values_ref``); the trace says schema 2 (docs/format.md, "Values by reference").
        """
        problem = tensor_name_problem(name) if isinstance(name, str) else "a tensor name must be a string"
        if problem:
            raise ValueError(f"bad tensor name {name!r}: {problem} (names are 1..{MAX_NAME_CHARS} printable "
                             "characters, no '/')")
        if name in self._specs:
            raise ValueError(f"tensor {name!r} already defined")
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        if dtype not in LOGICAL_DTYPES:
            raise ValueError(f"dtype must be one of {LOGICAL_DTYPES}, got {dtype!r}")
        width = int(width)
        if kind == "packed":
            if slots is None:
                raise ValueError("a packed tensor needs slots=SlotSpec(labels=[...])")
            sw = int(slot_width or self.hidden_size or 0)
            if sw <= 0 or width % sw:
                raise ValueError(f"packed width {width} is not a multiple of the slot width {sw}")
            if width // sw != len(slots.labels):
                raise ValueError(f"packed width {width} holds {width // sw} slots of {sw}, "
                                 f"but {len(slots.labels)} labels were given")
            _ = slots.boundaries  # validates the labels
        else:
            sw = width
        k = width // sw
        if kind == "boundary" and (boundary is None or boundary < 0):
            raise ValueError("a boundary tensor needs boundary >= 0")
        src = self._values_source(name, values_source, values, width, dtype, k, sw)
        if order is None:
            n = self.model.get("num_layers")
            if kind == "boundary" and boundary is not None:
                order = float(boundary)
            elif kind == "final_norm":
                order = float(n if n is not None else 10**6) + 0.5
            elif kind == "packed" and slots is not None:
                # a packed tensor is consumed after all the states it holds
                bs = [b if b is not None else (n or 10**6) + 0.5 for b in slots.boundaries]
                order = float(max(bs)) + 0.75
            else:
                order = float(len(self._specs))
        g = self.f["tensors"].create_group(name)
        self._groups[name] = g  # (each flush sets its flushed_rows: no lookup by path then)
        ga = g.attrs
        ga["kind"] = kind
        ga["dtype"] = dtype
        ga["width"] = width
        ga["slot_count"] = k
        ga["slot_width"] = sw
        ga["order"] = float(order)
        ga["token_offset"] = int(token_offset)
        ga["role"] = role
        if boundary is not None:
            ga["boundary"] = int(boundary)
        if slots is not None:
            ga["slot_labels"] = json.dumps(list(slots.labels))
            ga["slot_boundaries"] = json.dumps(slots.boundaries)
            ga["raw_ids"] = json.dumps(slots.raw_ids)
            ga["convention"] = slots.convention or ""
        ga["flushed_rows"] = np.int64(0)
        for key, val in (attrs or {}).items():
            ga[f"user.{key}"] = json.dumps(val)
        apps: dict[str, _Appender] = {}
        apps["rows"] = _Appender(g.create_dataset("rows", shape=(0,), maxshape=(None,), chunks=(4096,), dtype="<i8"))
        if src is not None:
            ga["values_source"] = values_source
            apps["values_ref"] = _Appender(g.create_dataset("values_ref", shape=(0,), maxshape=(None,), chunks=(4096,),
                                                            dtype="<i8"))
            if self.f.attrs["tensordiff_schema"] != SCHEMA_REFS:
                self.f.attrs.modify("tensordiff_schema", SCHEMA_REFS)   # a schema-1 reader must refuse it
        if values:
            sd = storage_dtype(dtype)
            cr = _chunk_rows(width * sd.itemsize)
            ds = g.create_dataset("values", shape=(0, width), maxshape=(None, width), chunks=(cr, width), dtype=sd, **self._comp)
            ds.attrs["dtype"] = dtype
            apps["values"] = _Appender(ds)
        if sketch:
            d = self.sketch_dim * k
            apps["sketch"] = _Appender(g.create_dataset("sketch", shape=(0, d), maxshape=(None, d),
                                                        chunks=(_chunk_rows(d * 4), d), dtype="<f4", **self._comp))
        apps["rms"] = _Appender(g.create_dataset("rms", shape=(0, k), maxshape=(None, k),
                                                 chunks=(_chunk_rows(k * 4, 4096), k), dtype="<f4", **self._comp))
        self._tensors[name] = apps
        t = _Tensor(apps, width, sw, dtype, self.sketch_dim * k)
        if t.values is not None:
            t.values.on_full = lambda: self._derive(t)
        if src is not None:
            t.source, t.source_name = src, str(values_source)
        self._state[name] = t
        self._specs[name] = {"width": width, "slot_width": sw, "k": k, "dtype": dtype}

    def _values_source(self, name: str, source: str | None, values: bool, width: int, dtype: str, k: int,
                       sw: int) -> _Tensor | None:
        """The state of ``define_tensor``'s ``values_source`` after checking it can be one (None: none)."""
        if source is None:
            return None
        src = self._state.get(source) if isinstance(source, str) else None
        if src is None:
            raise ValueError(f"{name}: values_source {source!r} is not a tensor defined before it")
        if not values:
            raise ValueError(f"{name}: values_source needs values=True (rows not taken from {source!r} are stored)")
        if src.ref is not None:
            raise ValueError(f"{name}: values_source {source!r} takes its values by reference itself; a source must "
                             "hold its values")
        if src.values is None:
            raise ValueError(f"{name}: values_source {source!r} was defined with values=False")
        if (src.width, src.dtype, src.k, src.slot_width) != (width, dtype, k, sw):
            raise ValueError(f"{name}: values_source {source!r} is {src.dtype} of width {src.width} ({src.k} x "
                             f"{src.slot_width} slots), not {dtype} of width {width} ({k} x {sw} slots)")
        return src

    # -- rows ----------------------------------------------------------------------------------

    def sequence(self, key: str) -> int:
        """Index of a sequence key, added on first use."""
        if isinstance(key, bytes):
            try:
                key = key.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"a sequence key must be valid UTF-8 text: {e.reason}") from None
        elif not isinstance(key, str):
            key = str(key)
        idx = self._seq_index.get(key)
        if idx is None:
            if len(key) > MAX_KEY_CHARS:
                raise ValueError(f"sequence key longer than {MAX_KEY_CHARS} characters")
            # what HDF5's UTF-8 strings refuse, refused here (the key is written at the next flush)
            if "\x00" in key:
                raise ValueError("a sequence key cannot hold a NUL character")
            try:
                key.encode("utf-8")
            except UnicodeEncodeError as e:
                raise ValueError(f"a sequence key must be valid UTF-8 text: {e.reason}") from None
            idx = len(self._seq_index)
            self._seq_index[key] = idx
            self._seq_new.append(key)  # written with the rows, at the next flush (one HDF5 write for all)
        return idx

    def _write_sequences(self) -> None:
        """The sequence keys added since the last flush (phase 1 of a flush: before the token rows
        that name them are committed)."""
        if not self._seq_new:
            return
        ds = self.f["sequences"]
        n0 = len(self._seq_index) - len(self._seq_new)
        ds.resize(len(self._seq_index), axis=0)
        ds[n0:] = np.array(self._seq_new, dtype=object)
        self._seq_new.clear()

    def add_tokens(self, seq: str, positions: Sequence[int] | np.ndarray, tokens: Sequence[int] | np.ndarray,
                   regime: str | int, step: int = 0) -> np.ndarray:
        """Add token-table rows for one sequence; returns their row indices (for :meth:`append`)."""
        # the common call (a known sequence and regime, int64 rows, no flush due) in one compiled
        # copy; put_tokens takes it only whole (contiguous int64 1-D arrays of one length, room left
        # in the chunk) and otherwise changes nothing: the checked path below does the rest
        seq_idx = self._seq_index.get(seq) if type(seq) is str else None
        if (seq_idx is not None and type(positions) is _ND and positions.ndim == 1 and type(step) is int
                and -(1 << 31) <= step < (1 << 31)):
            code = REGIME_CODE.get(regime) if type(regime) is str else None
            n = len(positions)
            if code is not None and not (self._dirty and (self._rows_since_flush + n > self._row_trigger
                                                          or time.monotonic() >= self._time_trigger)):
                tok = self._tokens
                before = put_tokens(tok.rb, tok.runs_rb, positions, tokens, seq_idx, code, step)
                if before >= 0:
                    self._rows_since_flush += n
                    self._dirty = True
                    self._appended = False
                    start = tok.base + before
                    return np.arange(start, start + n, dtype=np.int64)
        return self._add_tokens(seq, positions, tokens, regime, step)

    def _add_tokens(self, seq: str, positions: Sequence[int] | np.ndarray, tokens: Sequence[int] | np.ndarray,
                    regime: str | int, step: int) -> np.ndarray:
        if not (type(positions) is np.ndarray and positions.dtype == np.int64 and positions.ndim == 1):
            positions = np.asarray(positions, dtype=np.int64).reshape(-1)
        if not (type(tokens) is np.ndarray and tokens.dtype == np.int64 and tokens.ndim == 1):
            tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        n = len(positions)
        if len(tokens) != n:
            raise ValueError(f"{n} positions but {len(tokens)} tokens")
        if self._dirty and self._flush_due(n):
            self.flush()  # between steps: what is on disk is whole steps
        seq_idx = self._seq_index.get(seq) if type(seq) is str else None
        if seq_idx is None:
            seq_idx = self.sequence(str(seq))
        code = REGIME_CODE.get(regime) if type(regime) is str else None
        if code is None:
            code = regime_code(regime)
        if type(step) is not int:
            step = int(step)
        if not -(1 << 31) <= step < (1 << 31):
            raise ValueError(f"step {step} does not fit the token table's int32 column")
        tok = self._tokens
        start = tok.base + tok.fill
        tok.add(positions, tokens, seq_idx, code, step)
        self._rows_since_flush += n
        self._dirty = True
        self._appended = False
        return np.arange(start, start + n, dtype=np.int64)

    def append(self, name: str, rows: np.ndarray | Sequence[int], values: np.ndarray | None = None, *,
               values_ref: np.ndarray | Sequence[int] | None = None, sketch: np.ndarray | None = None,
               rms: np.ndarray | None = None) -> None:
        """Append tensor rows. ``values`` [n, width] in the tensor's storage form (bf16 as uint16
        bits) or float; ``sketch``/``rms`` are computed by the writer from ``values`` when not
        given, in batches of one values chunk (when the chunk fills, or at a flush), from the same
        float32 conversion of the stored values.

        ``values_ref`` (a tensor defined with ``values_source`` only): one int per row, the row of
        the source tensor (0-based, in the order its rows were appended, already appended) whose
        values this row has, or -1 for a row whose values are given: ``values`` then holds exactly
        the -1 rows, in order ([count, width]; None when every row refers). With ``values_ref``,
        ``rms`` is required for all n rows, and ``sketch`` is when the tensor stores one (the
        writer computes neither for rows it does not hold). Without it every row is given."""
        t = self._state.get(name)
        # the recorders' call (values, RMS and, where the tensor has one, the sketch given, none
        # owed by the writer) in one compiled copy into every buffer; put_rows takes it only whole
        # (every array in its buffer's form, row indices in the token table, room left in every
        # chunk) and otherwise changes nothing: the checked path below does the rest (a tensor
        # with values by reference has ``values`` None: always the checked path)
        if (values_ref is None and t is not None and values is not None and rms is not None and t.pend_rms is None
                and t.values is not None):
            tok = self._tokens
            limit = tok.base + tok.rb.fill
            sapp = t.sketch
            if sapp is None:
                done = sketch is None and put_rows(limit, t.rows.rb, rows, t.values.rb, values, t.rms.rb, rms)
            else:
                done = (sketch is not None and t.pend_sketch is None
                        and put_rows(limit, t.rows.rb, rows, t.values.rb, values, t.rms.rb, rms, sapp.rb, sketch))
            if done:
                self._dirty = True
                self._appended = True
                return
        if t is None:
            raise ValueError(f"tensor {name!r} not defined; call define_tensor first")
        if not (type(rows) is np.ndarray and rows.dtype == np.int64 and rows.ndim == 1):
            rows = np.asarray(rows, dtype=np.int64).reshape(-1)
        n = len(rows)
        if n:
            n_tok = self._tokens.base + self._tokens.fill
            if n <= 64:  # a decode step's few rows: Python's min/max beat two numpy reductions
                lst = rows.tolist()
                bad = min(lst) < 0 or max(lst) >= n_tok
            else:  # one reduction checks both ends: negative indices wrap to huge unsigned ones
                bad = int(rows.view(np.uint64).max()) >= n_tok
            if bad:
                raise ValueError(f"{name}: row indices must point into the token table (0..{n_tok - 1})")
        if t.ref is not None:
            self._append_ref(name, t, rows, values, values_ref, sketch, rms)
            return
        if values_ref is not None:
            raise ValueError(f"{name}: values_ref given, but {name} was defined without values_source")
        vapp = t.values
        nxt = -1  # the values row these rows start at
        if values is not None:
            if vapp is None:
                raise ValueError(f"{name} was defined with values=False")
            nxt = vapp.base + vapp.fill
            if type(values) is not np.ndarray:
                values = np.asarray(values)
            if values.shape != (n, t.width):
                raise ValueError(f"{name}: values shape {values.shape}, expected {(n, t.width)}")
            if values.dtype != t.sd:
                if t.dtype == "bfloat16":
                    raise ValueError(f"{name}: bfloat16 values must be given as their uint16 bits")
                values = values.astype(t.sd)
        elif vapp is not None:
            raise ValueError(f"{name}: values are required (defined with values=True)")
        sapp = t.sketch
        if sapp is not None and sketch is not None:
            sketch = np.asarray(sketch, dtype=np.float32)
            if sketch.shape != (n, t.sketch_width):
                raise ValueError(f"{name}: sketch shape {sketch.shape}, expected {(n, t.sketch_width)}")
        elif sapp is not None and values is None:
            raise ValueError(f"{name}: give sketch= when values are not recorded")
        if rms is not None:
            if not (type(rms) is np.ndarray and rms.dtype == np.float32):
                rms = np.asarray(rms, dtype=np.float32)
            if rms.shape != (n, t.k):
                rms = rms.reshape(n, t.k)
        elif values is None:
            raise ValueError(f"{name}: give rms= when values are not recorded")
        # validated: now every dataset gets its n rows
        if sapp is not None:
            if sketch is None:
                if t.pend_sketch is None:
                    t.pend_sketch = nxt  # (values given: checked above)
            else:
                if t.pend_sketch is not None:  # rows before these were the writer's to sketch
                    self._derive(t)
                    t.pend_sketch = None
                sapp.append(sketch)
        if rms is None:
            if t.pend_rms is None:
                t.pend_rms = nxt  # (values given: checked above)
        else:
            if t.pend_rms is not None:
                self._derive(t)
                t.pend_rms = None
            t.rms.append(rms)
        if values is not None and vapp is not None:
            # nothing pending: the writer derives no sketch/RMS from these rows in the buffer
            vapp.append(values, direct=t.pend_sketch is None and t.pend_rms is None)
        t.rows.append(rows)
        self._dirty = True
        self._appended = True

    def _append_ref(self, name: str, t: _Tensor, rows: np.ndarray, values: np.ndarray | None,
                    values_ref: np.ndarray | Sequence[int] | None, sketch: np.ndarray | None,
                    rms: np.ndarray | None) -> None:
        """:meth:`append` to a tensor with values by reference (``rows`` checked): every array is
        checked before any dataset gets a row."""
        n = len(rows)
        src = t.source
        own_app, ref_app = t.own, t.ref
        assert src is not None and own_app is not None and ref_app is not None
        if values_ref is None:
            ref = np.full(n, -1, np.int64)
        else:
            arr = np.asarray(values_ref)
            if arr.shape != (n,):
                raise ValueError(f"{name}: values_ref has shape {arr.shape}, expected ({n},): one entry per row")
            if arr.dtype.kind not in "iu":
                raise ValueError(f"{name}: values_ref must be integers (rows of {t.source_name!r}, or -1), got {arr.dtype}")
            n_src = src.rows.rows
            if n and (int(arr.min()) < -1 or int(arr.max()) >= n_src):
                raise ValueError(f"{name}: values_ref entries must be -1 (values given) or a row of {t.source_name!r} "
                                 f"appended before (0..{n_src - 1}); got {int(arr.min())}..{int(arr.max())}")
            ref = arr.astype(np.int64)
        m = int(np.count_nonzero(ref == -1))
        if values is None:
            if m:
                raise ValueError(f"{name}: {m} rows have values_ref -1: give their values")
            values = np.empty((0, t.width), t.sd)
        else:
            values = np.asarray(values)
            if values.shape != (m, t.width):
                raise ValueError(f"{name}: values shape {values.shape}, expected {(m, t.width)} (the rows whose "
                                 "values_ref is -1)")
            if values.dtype != t.sd:
                if t.dtype == "bfloat16":
                    raise ValueError(f"{name}: bfloat16 values must be given as their uint16 bits")
                values = values.astype(t.sd)
        if rms is None:
            if values_ref is not None:
                raise ValueError(f"{name}: give rms= for all {n} rows with values_ref (the writer does not hold "
                                 "the referenced rows)")
            rms = slot_rms(to_float32(values, t.dtype), t.slot_width)   # every row given: as the writer's own
        else:
            rms = np.asarray(rms, dtype=np.float32)
            if rms.size != n * t.k:
                raise ValueError(f"{name}: rms shape {rms.shape}, expected {(n, t.k)}")
            rms = rms.reshape(n, t.k)
        sapp = t.sketch
        if sapp is not None:
            if sketch is None:
                raise ValueError(f"{name}: give sketch= (a tensor with values by reference that stores a sketch gets "
                                 "it from the caller; defined with sketch=False, the reader derives it)")
            sketch = np.asarray(sketch, dtype=np.float32)
            if sketch.shape != (n, t.sketch_width):
                raise ValueError(f"{name}: sketch shape {sketch.shape}, expected {(n, t.sketch_width)}")
            sapp.append(sketch)
        t.rms.append(rms)
        if m:
            own_app.append(values)
        ref_app.append(ref)
        t.rows.append(rows)
        self._dirty = True
        self._appended = True

    def _derive(self, t: _Tensor) -> None:
        """The sketch/RMS rows the writer owes for ``t``: every values row from the first pending
        one to the end of the values buffer, from one float32 conversion.

        A sketch is always computed over the whole buffer (one matmul of ``chunk`` rows; rows past
        ``fill`` are stale and dropped): a BLAS may round a row differently with the row count of the
        product, and this way row r of a tensor is always row ``r % chunk`` of a ``chunk``-row product,
        so the same values get the same sketch bits whatever the append and flush pattern (a killed
        recording's rows equal an unkilled run's). RMS is a per-row reduction, the same in any batch."""
        ps, pr = t.pend_sketch, t.pend_rms
        if ps is None and pr is None:
            return
        v = t.values
        assert v is not None  # pending rows exist only for tensors with values
        end = v.base + v.fill
        x = None
        if ps is not None and ps < end:
            x = self._f32(v.buf, t.dtype)
            sapp = t.sketch
            assert sapp is not None  # a sketch is pending only for tensors with one
            sapp.append(sketch_rows(x, t.slot_width, self.sketch_dim, self.sketch_seed)[ps - v.base:v.fill])
        if pr is not None and pr < end:
            lo = pr - v.base
            xr = x[lo:v.fill] if x is not None else self._f32(v.buf[lo:v.fill], t.dtype)
            t.rms.append(slot_rms(xr, t.slot_width))
        if ps is not None:
            t.pend_sketch = end
        if pr is not None:
            t.pend_rms = end

    def _f32(self, block: np.ndarray, dtype: str) -> np.ndarray:
        """``block`` of stored values as float32, in the writer's scratch buffer (no new memory per block)."""
        if dtype == "float32":
            return block
        if self._scratch.size < block.size:
            self._scratch = np.empty(block.size, dtype=np.float32)
        return to_float32(block, dtype, out=self._scratch)

    def set_attr(self, name: str | None, key: str, value: Any) -> None:
        """Set a json attribute on the file (name None) or a tensor, e.g. resolved capture ids."""
        obj = self.f if name is None else self.f["tensors"][name]
        obj.attrs[key if name is None else f"user.{key}"] = json.dumps(value)

    # -- flushing ------------------------------------------------------------------------------

    def flush_triggered(self, incoming: int = 0) -> bool:
        """Whether a flush trigger (``flush_rows`` counting ``incoming`` more token rows, or
        ``flush_seconds``) has been reached with rows not yet flushed. A recorder that holds
        tensor rows back (staging) appends them when this says so, before its next
        ``add_tokens``, so that the flush this triggers holds whole steps. Never while flushes are
        held (:meth:`flushes_held`)."""
        return self._dirty and not self._held and (self._rows_since_flush + incoming > self._row_trigger
                                                   or time.monotonic() >= self._time_trigger)

    @property
    def tensor_rows_since_tokens(self) -> bool:
        """Whether tensor rows were appended since the last token rows: the next token rows then
        start a step (where a flush may fall)."""
        return self._appended

    @contextlib.contextmanager
    def flushes_held(self) -> Iterator[None]:
        """No flush trigger fires inside: for a caller that adds the token rows of several steps
        before any of their tensor rows (a queue of steps made phase by phase), where a flush
        would commit token rows without their tensor rows. A trigger reached meanwhile fires at
        the first ``add_tokens`` after, at the start of the next step, as usual."""
        self._held += 1
        try:
            yield
        finally:
            self._held -= 1

    def _flush_due(self, incoming: int) -> bool:
        """Whether to flush before adding ``incoming`` token rows (see the class docstring)."""
        if not self._dirty or self._held:
            return False
        waited = time.monotonic() - self._last_flush
        rows_due = self.flush_rows is not None and self._rows_since_flush + incoming > self.flush_rows
        time_due = self.flush_seconds is not None and waited >= self.flush_seconds
        if not (rows_due or time_due):
            return False
        # Only between steps: tensor rows were appended since the last add_tokens (a batch adds
        # each sequence's tokens before appending any tensor, so no flush falls inside it) --
        # unless tokens alone keep coming, twice past a trigger.
        return (self._appended
                or (self.flush_rows is not None and self._rows_since_flush >= 2 * self.flush_rows)
                or (self.flush_seconds is not None and waited >= 2 * self.flush_seconds))

    def flush(self) -> None:
        """Write every buffered row and commit it: a process killed after this loses nothing before it.

        Two phases. 1: the buffered rows and all metadata are written (``H5Fflush``). 2: the
        ``flushed_rows``/``flushed_tokens`` attributes are set to the row counts of phase 1 and
        flushed again; a kill during phase 1 leaves the previous counts, which a reader trusts."""
        if self._closed:
            return
        self._write_buffered()
        counts = {}
        for name, apps in self._tensors.items():
            own = self._state[name].own   # (values by reference: its own values are fewer rows)
            n = min(app.rows for app in apps.values() if app is not own)
            counts[name] = n
            if self.flushed["tensors"].get(name) != n:
                self._groups[name].attrs.modify("flushed_rows", np.int64(n))
        n_tok = self._tokens.rows
        if n_tok != self.flushed["tokens"]:
            self.f.attrs.modify("flushed_tokens", np.int64(n_tok))
        self.f.flush()
        self.flushed = {"tokens": n_tok, "tensors": counts}
        self._flushed_now()
        if self.on_flush is not None:
            self.on_flush(self)

    def _write_buffered(self) -> None:
        """Phase 1 of a flush: every buffered row (and the sketch/RMS rows the writer still owes)
        to the file, then ``H5Fflush``."""
        for name, apps in self._tensors.items():
            self._derive(self._state[name])
            for app in apps.values():
                app.flush_partial()
        self._write_sequences()
        self._tokens.flush_partial()
        self.f.flush()

    def _flushed_now(self) -> None:
        self.flush_count += 1
        self._rows_since_flush = 0
        self._dirty = False
        self._last_flush = time.monotonic()
        self._set_triggers()

    @property
    def flush_rows(self) -> int | None:
        """Token rows after which ``add_tokens`` flushes (None: no row trigger)."""
        return self._flush_rows

    @flush_rows.setter
    def flush_rows(self, value: int | None) -> None:
        self._flush_rows = None if value is None else int(value)
        self._set_triggers()

    @property
    def flush_seconds(self) -> float | None:
        """Seconds after which ``add_tokens`` flushes (None: no time trigger)."""
        return self._flush_seconds

    @flush_seconds.setter
    def flush_seconds(self, value: float | None) -> None:
        self._flush_seconds = None if value is None else float(value)
        self._set_triggers()

    def _set_triggers(self) -> None:
        """The cheap test ``add_tokens`` makes before :meth:`_flush_due`: a flush can be due only
        past ``_row_trigger`` token rows since the last flush or after the monotonic time
        ``_time_trigger``."""
        self._row_trigger = self.flush_rows if self.flush_rows is not None else math.inf
        self._time_trigger = (self._last_flush + self.flush_seconds if self.flush_seconds is not None
                              else math.inf)

    def close(self) -> None:
        if self._closed:
            return
        self.flush()  # (sets every extent to the rows written)
        _unpin_metadata(self.f)
        self.f.attrs.modify("complete", True)  # in place: the last flush rewrites one object header
        self.f.close()
        self._closed = True

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _pin_metadata(f: h5py.File) -> None:
    """Keep every piece of HDF5 metadata in memory until the next flush.

    HDF5's metadata cache normally writes dirty entries (chunk index nodes, object headers with
    new extents) whenever it needs room, so a process killed between flushes can leave a B-tree
    node on disk that points at a chunk or node that never got there. With evictions off (which
    needs adaptive resizing off too) nothing but raw chunks reaches the file between flushes. The
    cache then holds all metadata of the file (clean after each flush): about 0.01% of the rows
    written, ~10 MiB of chunk index for 100 GiB."""
    with contextlib.suppress(Exception):  # an HDF5 build without this control still writes valid traces
        cfg = f.id.get_mdc_config()
        cfg.incr_mode = 0          # H5C_incr__off
        cfg.flash_incr_mode = 0    # H5C_flash_incr__off
        cfg.decr_mode = 0          # H5C_decr__off
        cfg.evictions_enabled = False
        f.id.set_mdc_config(cfg)


def _unpin_metadata(f: h5py.File) -> None:
    with contextlib.suppress(Exception):
        cfg = f.id.get_mdc_config()
        cfg.evictions_enabled = True
        f.id.set_mdc_config(cfg)
