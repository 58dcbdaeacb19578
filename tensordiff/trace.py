"""The trace format: one self-describing, versioned HDF5 file per side (numpy + h5py only).

Layout (schema 1; documented for people in docs/format.md)::

    /                         attrs: tensordiff_schema, side, producer, created, model (json),
                              versions (json), user_meta (json), sketch_seed, sketch_dim,
                              complete (bool: False until the writer closed cleanly)
    /sequences                [S] utf-8 strings: sequence keys (request id, sample id...)
    /tokens                   [R] compound: seq (i4), position (i8), token (i8), regime (u1), step (i4)
    /tensors/<name>/rows      [n] i8: row of /tokens that each tensor row belongs to
    /tensors/<name>/values    [n, width] full values (bf16 as uint16 bits), optional
    /tensors/<name>/sketch    [n, slots*d] f4 seeded projection per slot, optional
    /tensors/<name>/rms       [n, slots] f4 per-token RMS of each slot
    /tensors/<name>           attrs: kind, dtype, width, slot_count, slot_width, slot_labels,
                              slot_boundaries, raw_ids, convention, order, token_offset, role, ...

Writers append in chunk-aligned blocks with bounded memory; readers read any row range or row
subset without loading whole datasets.
"""

from __future__ import annotations

import io
import json
import math
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import h5py
import numpy as np

from . import __version__
from .dtypes import LOGICAL_DTYPES, storage_dtype, to_float32
from .errors import TraceError
from .sketch import DEFAULT_SKETCH_DIM, DEFAULT_SKETCH_SEED, sketch_np
from .vocab import REGIMES, boundary_label, parse_label, regime_code

SCHEMA_VERSION = 1
SIDES = ("train", "serve", "other")
KINDS = ("boundary", "final_norm", "packed", "other")
TOKEN_DTYPE = np.dtype([("seq", "<i4"), ("position", "<i8"), ("token", "<i8"),
                        ("regime", "u1"), ("step", "<i4")])
_SPAN_BYTES = 4 << 20  # scattered reads: read a span this large whole, then pick rows
# Chunk cache per open dataset. HDF5 2.0 defaults to 8 MiB each; a diff holds every tensor of both
# traces open and reads in whole-chunk blocks, so a cache mostly costs memory (~580 MB for 64
# tensors measured). One chunk's worth keeps compressed scattered reads from re-inflating.
READ_CACHE_BYTES = 1 << 20
MAX_ATTR_CHARS = 1 << 20  # strings longer than this in a trace are refused, not parsed
CHUNK_BYTES = 1 << 20


def _chunk_rows(row_bytes: int, cap: int = 512) -> int:
    """Rows per chunk: about 1 MiB (128 rows at H=4096 bf16), never (1, H), and at most ``cap``
    rows so that narrow datasets (RMS, row indices, tiny models) do not allocate megabytes each."""
    rows = max(1, CHUNK_BYTES // max(row_bytes, 1))
    return int(min(cap, max(16, 1 << int(math.log2(rows)))))


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
    has_sketch: bool
    boundary: int | None = None
    attrs: dict[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        if self.kind == "boundary" and self.boundary is not None:
            return boundary_label(self.boundary)
        if self.kind == "final_norm":
            return "final_norm"
        return self.name


# ----------------------------------------------------------------------------------------------
# Writer
# ----------------------------------------------------------------------------------------------


class _Appender:
    """Appends rows to one resizable 2-D (or 1-D) dataset in chunk-aligned blocks.

    Rows accumulate in a preallocated buffer of one chunk; a full buffer is written as one
    chunk. ``flush_partial`` writes the rows buffered so far (they stay buffered until their chunk
    fills, so the next full write rewrites the same chunk whole)."""

    def __init__(self, ds: h5py.Dataset):
        self.ds = ds
        self.chunk = ds.chunks[0]
        self.buf = np.empty((self.chunk,) + ds.shape[1:], dtype=ds.dtype)
        self.fill = 0          # rows in buf
        self.base = ds.shape[0]  # dataset row where buf[0] goes
        self.dirty = False     # buffered rows not yet on disk
        self.direct = ds.compression is None and not ds.dtype.fields and ds.ndim == 2

    @property
    def rows(self) -> int:
        return self.base + self.fill

    def append(self, data: np.ndarray) -> None:
        n = len(data)
        i = 0
        while i < n:
            take = min(self.chunk - self.fill, n - i)
            self.buf[self.fill:self.fill + take] = data[i:i + take]
            self.fill += take
            i += take
            self.dirty = True
            if self.fill == self.chunk:
                self._write_full()

    def _write_full(self) -> None:
        end = self.base + self.chunk
        if self.ds.shape[0] < end:
            self.ds.resize(end, axis=0)
        if self.direct and self.base % self.chunk == 0:
            self.ds.id.write_direct_chunk((self.base,) + (0,) * (self.ds.ndim - 1), self.buf.tobytes())
        else:
            self.ds[self.base:end] = self.buf
        self.base = end
        self.fill = 0
        self.dirty = False

    def flush_partial(self) -> None:
        if not self.dirty:
            return
        end = self.base + self.fill
        if self.ds.shape[0] < end:
            self.ds.resize(end, axis=0)
        self.ds[self.base:end] = self.buf[:self.fill]
        self.dirty = False


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
    called after each commit (``writer.flushed`` then says what is on disk).
    """

    def __init__(self, path: str | os.PathLike, side: str = "other", *, producer: str = "",
                 model: dict | None = None, meta: dict | None = None,
                 sketch_dim: int = DEFAULT_SKETCH_DIM, sketch_seed: int = DEFAULT_SKETCH_SEED,
                 flush_rows: int | None = 4096, flush_seconds: float | None = 10.0,
                 versions: dict | None = None, on_flush: Callable[["TraceWriter"], None] | None = None,
                 compression: str | None = None):
        if side not in SIDES:
            raise ValueError(f"side must be one of {SIDES}, got {side!r}")
        if flush_rows is not None and (isinstance(flush_rows, bool) or int(flush_rows) < 1):
            raise ValueError(f"flush_rows must be a positive number of token rows or None, got {flush_rows!r}")
        if flush_seconds is not None and not (float(flush_seconds) > 0 and math.isfinite(float(flush_seconds))):
            raise ValueError(f"flush_seconds must be a positive number of seconds or None, got {flush_seconds!r}")
        self.path = os.fspath(path)
        self.f = h5py.File(self.path, "w")
        _pin_metadata(self.f)
        self.model = dict(model or {})
        if compression not in (None, "gzip", "lzf"):
            raise ValueError(f"compression must be None, 'gzip' or 'lzf', got {compression!r}")
        # opt-in (the disk is faster than every compressor); worth it for small shipped traces
        self._comp = {"compression": compression, "shuffle": True} if compression else {}
        self.sketch_dim = int(sketch_dim)
        self.sketch_seed = int(sketch_seed)
        self.flush_rows = None if flush_rows is None else int(flush_rows)
        self.flush_seconds = None if flush_seconds is None else float(flush_seconds)
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
        self._tokens = _Appender(tok)
        self._seq_index: dict[str, int] = {}
        self._tensors: dict[str, dict[str, _Appender]] = {}
        self._specs: dict[str, dict] = {}
        self._pending_rms: dict[str, list[np.ndarray]] = {}
        self._pending_rows: dict[str, int] = {}
        self._rows_since_flush = 0
        self._dirty = False
        self._appended = False
        self._last_flush = time.monotonic()
        self._closed = False
        self.flush_count = 0
        self.flushed: dict = {"tokens": 0, "tensors": {}}
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
                      sketch: bool = True, attrs: dict | None = None) -> None:
        """Declare a tensor before appending to it.

        kind: ``boundary`` (give ``boundary``), ``final_norm``, ``packed`` (give ``slots``; the
        slot width defaults to the model's hidden size) or ``other``. ``values=False`` keeps only
        the sketch and RMS (a cheap catalog entry). ``token_offset=1`` says row t was paired with
        token t+1 (a draft's input).
        """
        if not name or "/" in name or len(name) > 256:
            raise ValueError(f"bad tensor name {name!r}: non-empty, no '/', at most 256 characters")
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
            slots.boundaries  # validates the labels
        else:
            sw = width
        k = width // sw
        if kind == "boundary":
            if boundary is None or boundary < 0:
                raise ValueError("a boundary tensor needs boundary >= 0")
        if order is None:
            n = self.model.get("num_layers")
            if kind == "boundary":
                order = float(boundary)
            elif kind == "final_norm":
                order = float(n if n is not None else 10**6) + 0.5
            elif kind == "packed":
                # a packed tensor is consumed after all the states it holds
                bs = [b if b is not None else (n or 10**6) + 0.5 for b in slots.boundaries]
                order = float(max(bs)) + 0.75
            else:
                order = float(len(self._specs))
        g = self.f["tensors"].create_group(name)
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
        self._pending_rms[name] = []
        self._pending_rows[name] = 0
        self._specs[name] = {"width": width, "slot_width": sw, "k": k, "dtype": dtype}

    # -- rows ----------------------------------------------------------------------------------

    def sequence(self, key: str) -> int:
        """Index of a sequence key, added on first use."""
        idx = self._seq_index.get(key)
        if idx is None:
            if len(key) > 4096:
                raise ValueError("sequence key longer than 4096 characters")
            idx = len(self._seq_index)
            self._seq_index[key] = idx
            ds = self.f["sequences"]
            ds.resize(idx + 1, axis=0)
            ds[idx] = key
        return idx

    def add_tokens(self, seq: str, positions: Sequence[int] | np.ndarray, tokens: Sequence[int] | np.ndarray,
                   regime: str | int, step: int = 0) -> np.ndarray:
        """Add token-table rows for one sequence; returns their row indices (for :meth:`append`)."""
        positions = np.asarray(positions, dtype=np.int64).reshape(-1)
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if positions.shape != tokens.shape:
            raise ValueError(f"{len(positions)} positions but {len(tokens)} tokens")
        if self._flush_due(len(positions)):
            self.flush()  # between steps: what is on disk is whole steps
        rec = np.empty(len(positions), dtype=TOKEN_DTYPE)
        rec["seq"] = self.sequence(str(seq))
        rec["position"] = positions
        rec["token"] = tokens
        rec["regime"] = regime_code(regime)
        rec["step"] = step
        start = self._tokens.rows
        self._tokens.append(rec)
        self._rows_since_flush += len(rec)
        self._dirty = True
        self._appended = False
        return np.arange(start, start + len(rec), dtype=np.int64)

    def append(self, name: str, rows: np.ndarray | Sequence[int], values: np.ndarray | None = None, *,
               sketch: np.ndarray | None = None, rms: np.ndarray | None = None) -> None:
        """Append tensor rows. ``values`` [n, width] in the tensor's storage form (bf16 as uint16
        bits) or float; ``sketch``/``rms`` are computed here from ``values`` when not given."""
        try:
            apps = self._tensors[name]
        except KeyError:
            raise ValueError(f"tensor {name!r} not defined; call define_tensor first") from None
        spec = self._specs[name]
        rows = np.asarray(rows, dtype=np.int64).reshape(-1)
        n = len(rows)
        if n and (rows.min() < 0 or rows.max() >= self._tokens.rows):
            raise ValueError(f"{name}: row indices must point into the token table (0..{self._tokens.rows - 1})")
        f32 = None
        if values is not None:
            if "values" not in apps:
                raise ValueError(f"{name} was defined with values=False")
            values = np.asarray(values)
            if values.shape != (n, spec["width"]):
                raise ValueError(f"{name}: values shape {values.shape}, expected {(n, spec['width'])}")
            sd = storage_dtype(spec["dtype"])
            if spec["dtype"] == "bfloat16" and values.dtype != np.uint16:
                raise ValueError(f"{name}: bfloat16 values must be given as their uint16 bits")
            stored = values.astype(sd, copy=False)
            apps["values"].append(stored)
            if sketch is None and "sketch" in apps:
                f32 = to_float32(stored, spec["dtype"])
        elif "values" in apps:
            raise ValueError(f"{name}: values are required (defined with values=True)")
        if "sketch" in apps:
            if sketch is None:
                if f32 is None:
                    raise ValueError(f"{name}: give sketch= when values are not recorded")
                sketch = sketch_np(f32, spec["slot_width"], self.sketch_dim, self.sketch_seed)
            sketch = np.asarray(sketch, dtype=np.float32)
            if sketch.shape != (n, self.sketch_dim * spec["k"]):
                raise ValueError(f"{name}: sketch shape {sketch.shape}, expected {(n, self.sketch_dim * spec['k'])}")
            apps["sketch"].append(sketch)
        pending = self._pending_rms[name]
        if rms is None:
            if f32 is not None:
                self._drain_rms(name)
                apps["rms"].append(slot_rms(f32, spec["slot_width"]))
            elif values is not None:
                # computed in batches: one conversion per ~512 rows instead of one per decode step
                pending.append(stored.copy())
                self._pending_rows[name] += n
                if self._pending_rows[name] >= 512:
                    self._drain_rms(name)
            else:
                raise ValueError(f"{name}: give rms= when values are not recorded")
        else:
            self._drain_rms(name)
            apps["rms"].append(np.asarray(rms, dtype=np.float32).reshape(n, spec["k"]))
        apps["rows"].append(rows)
        self._dirty = True
        self._appended = True

    def _drain_rms(self, name: str) -> None:
        pending = self._pending_rms[name]
        if pending:
            spec = self._specs[name]
            block = np.concatenate(pending) if len(pending) > 1 else pending[0]
            self._tensors[name]["rms"].append(slot_rms(to_float32(block, spec["dtype"]), spec["slot_width"]))
            pending.clear()
            self._pending_rows[name] = 0

    def set_attr(self, name: str | None, key: str, value: Any) -> None:
        """Set a json attribute on the file (name None) or a tensor, e.g. resolved capture ids."""
        obj = self.f if name is None else self.f["tensors"][name]
        obj.attrs[key if name is None else f"user.{key}"] = json.dumps(value)

    # -- flushing ------------------------------------------------------------------------------

    def _flush_due(self, incoming: int) -> bool:
        """Whether to flush before adding ``incoming`` token rows (see the class docstring)."""
        if not self._dirty:
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
            n = min(app.rows for app in apps.values())
            counts[name] = n
            if self.flushed["tensors"].get(name) != n:
                self.f["tensors"][name].attrs.modify("flushed_rows", np.int64(n))
        n_tok = self._tokens.rows
        if n_tok != self.flushed["tokens"]:
            self.f.attrs.modify("flushed_tokens", np.int64(n_tok))
        self.f.flush()
        self.flushed = {"tokens": n_tok, "tensors": counts}
        self._flushed_now()
        if self.on_flush is not None:
            self.on_flush(self)

    def _write_buffered(self) -> None:
        """Phase 1 of a flush: every buffered row (and pending RMS) to the file, then ``H5Fflush``."""
        for name, apps in self._tensors.items():
            self._drain_rms(name)
            for app in apps.values():
                app.flush_partial()
        self._tokens.flush_partial()
        self.f.flush()

    def _flushed_now(self) -> None:
        self.flush_count += 1
        self._rows_since_flush = 0
        self._dirty = False
        self._last_flush = time.monotonic()

    def close(self) -> None:
        if self._closed:
            return
        self.flush()
        _unpin_metadata(self.f)
        # trim to the rows written (a partial last chunk may have been over-allocated)
        for apps in self._tensors.values():
            for app in apps.values():
                if app.ds.shape[0] != app.rows:
                    app.ds.resize(app.rows, axis=0)
        if self._tokens.ds.shape[0] != self._tokens.rows:
            self._tokens.ds.resize(self._tokens.rows, axis=0)
        self.f.attrs.modify("complete", True)  # in place: the last flush rewrites one object header
        self.f.close()
        self._closed = True

    def __enter__(self) -> "TraceWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _pin_metadata(f: h5py.File) -> None:
    """Keep every piece of HDF5 metadata in memory until the next flush.

    HDF5's metadata cache normally writes dirty entries (chunk index nodes, object headers with
    new extents) whenever it needs room, so a process killed between flushes can leave a B-tree
    node on disk that points at a chunk or node that never got there. With evictions off (which
    needs adaptive resizing off too) nothing but raw chunks reaches the file between flushes. The
    cache then holds all metadata of the file (clean after each flush): about 0.01% of the rows
    written, ~10 MiB of chunk index for 100 GiB."""
    try:
        cfg = f.id.get_mdc_config()
        cfg.incr_mode = 0          # H5C_incr__off
        cfg.flash_incr_mode = 0    # H5C_flash_incr__off
        cfg.decr_mode = 0          # H5C_decr__off
        cfg.evictions_enabled = False
        f.id.set_mdc_config(cfg)
    except Exception:  # noqa: BLE001 - an HDF5 build without this control still writes valid traces
        pass


def _unpin_metadata(f: h5py.File) -> None:
    try:
        cfg = f.id.get_mdc_config()
        cfg.evictions_enabled = True
        f.id.set_mdc_config(cfg)
    except Exception:  # noqa: BLE001
        pass


def slot_rms(x: np.ndarray, slot_width: int) -> np.ndarray:
    """Per-row RMS of each slot of ``x`` [n, k*slot_width] -> [n, k] float32."""
    n = x.shape[0]
    k = x.shape[1] // slot_width
    x3 = x.reshape(n, k, slot_width)
    with np.errstate(over="ignore", invalid="ignore"):
        return np.sqrt(np.einsum("nkh,nkh->nk", x3, x3) / np.float32(slot_width)).astype(np.float32, copy=False)


# ----------------------------------------------------------------------------------------------
# Reader
# ----------------------------------------------------------------------------------------------


_MISSING = object()
MAX_TENSORS = 100_000        # tensors in one trace
MAX_ATTRS = 4096             # attributes on one object
MAX_SLOTS = 4096             # slots of one packed tensor
MAX_SEQUENCES = 1 << 22      # the aligner keys a row as seq << 40 | position
MAX_POSITION = 1 << 40
MAX_CHUNK_BYTES = 64 << 20   # one chunk is read whole to get one row
MAX_ATTR_ELEMENTS = 64       # attributes are scalars (or tiny arrays), never bulk data
FILTER_EXPANSION = 1000      # a compressed dataset may be this much larger than the file


def _attr_get(attrs, key: str, where: str = ""):
    """An attribute's value after checking its shape and type (nothing large is read)."""
    if key not in attrs:
        return _MISSING
    aid = attrs.get_id(key)
    shape = aid.shape
    if shape is None:  # null dataspace
        raise TraceError(f"attribute {key!r}{where} is empty")
    if math.prod(shape) > MAX_ATTR_ELEMENTS:
        raise TraceError(f"attribute {key!r}{where} is an array of {math.prod(shape)} values, expected one")
    dt = aid.dtype
    if dt.names is not None or dt.subdtype is not None:
        raise TraceError(f"attribute {key!r}{where} has a compound or array type")
    if dt.kind == "O":
        if h5py.check_string_dtype(dt) is None:
            raise TraceError(f"attribute {key!r}{where} holds references or variable-length data, not a value")
    elif dt.kind == "S":
        if dt.itemsize > MAX_ATTR_CHARS:
            raise TraceError(f"attribute {key!r}{where} is longer than {MAX_ATTR_CHARS} characters")
    elif dt.kind not in "biuf":
        raise TraceError(f"attribute {key!r}{where} has an unsupported type ({dt})")
    return attrs[key]


def _clean(s: str) -> str:
    """A string from a file as printable text: invalid UTF-8 (which h5py hands over as lone
    surrogates, as does JSON's ``\\udcxx``) becomes U+FFFD instead of failing when printed."""
    try:
        s.encode("utf-8")
        return s
    except UnicodeEncodeError:
        return s.encode("utf-8", "surrogatepass").decode("utf-8", "replace")


def _clean_json(v: Any) -> Any:
    if isinstance(v, str):
        return _clean(v)
    if isinstance(v, list):
        return [_clean_json(x) for x in v]
    if isinstance(v, dict):
        return {_clean(str(k)): _clean_json(x) for k, x in v.items()}
    return v


def _attr_str(attrs, key: str, default: str | None = None, where: str = "") -> str:
    v = _attr_get(attrs, key, where)
    if v is _MISSING:
        if default is not None:
            return default
        raise TraceError(f"missing attribute {key!r}{where}")
    if isinstance(v, np.ndarray) and v.shape == () :
        v = v[()]
    if isinstance(v, bytes):
        v = v.decode("utf-8", "replace")
    if not isinstance(v, str):
        raise TraceError(f"attribute {key!r}{where} is not a string")
    if len(v) > MAX_ATTR_CHARS:
        raise TraceError(f"attribute {key!r}{where} is longer than {MAX_ATTR_CHARS} characters")
    return _clean(v)


def _attr_json(attrs, key: str, default: Any = None, where: str = "") -> Any:
    if key not in attrs:
        return default
    s = _attr_str(attrs, key, where=where)
    try:
        return _clean_json(json.loads(s))
    except (ValueError, RecursionError):
        raise TraceError(f"attribute {key!r}{where} is not valid JSON") from None


def _attr_num(attrs, key: str, kind=int, default: Any = None, where: str = ""):
    v = _attr_get(attrs, key, where)
    if v is _MISSING:
        if default is not None:
            return default
        raise TraceError(f"missing attribute {key!r}{where}")
    if isinstance(v, np.ndarray):
        if v.size != 1:
            raise TraceError(f"attribute {key!r}{where} is not a number")
        v = v.reshape(())[()]
    if not isinstance(v, (int, float, bool, np.number, np.bool_)):
        raise TraceError(f"attribute {key!r}{where} is not a number")
    f = float(v)
    if not math.isfinite(f):
        raise TraceError(f"attribute {key!r}{where} is not finite")
    if kind is int:
        if f != int(f):
            raise TraceError(f"attribute {key!r}{where} is not an integer ({f:g})")
        if abs(f) > 2.0**62:
            raise TraceError(f"attribute {key!r}{where} is out of range")
        return int(v)
    return kind(v)


def _filters(ds: h5py.Dataset) -> list[int]:
    plist = ds.id.get_create_plist()
    return [plist.get_filter(i)[0] for i in range(plist.get_nfilters())]


_HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"


def _eoa_patch(path: str, size: int) -> tuple[int, bytes] | None:
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


class _PatchedView(io.RawIOBase):
    """A read-only file object over ``path`` with ``data`` overlaid at ``offset``."""

    def __init__(self, path: str, offset: int, data: bytes):
        super().__init__()
        self._fh = open(path, "rb", buffering=0)
        self._off, self._data = offset, data

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = 0) -> int:
        return self._fh.seek(pos, whence)

    def tell(self) -> int:
        return self._fh.tell()

    def readinto(self, b) -> int:
        pos = self._fh.tell()
        n = self._fh.readinto(b)
        if n:
            lo, hi = max(pos, self._off), min(pos + n, self._off + len(self._data))
            if lo < hi:
                memoryview(b)[lo - pos:hi - pos] = self._data[lo - self._off:hi - self._off]
        return n

    def close(self) -> None:
        self._fh.close()
        super().close()


class TraceReader:
    """Open and validate a trace. Raises :class:`TraceError` with a one-line reason on bad input.

    Nothing is loaded but the token table and the per-tensor row indices; values, sketches and
    RMS are read by row range or row subset on demand.

    Hostile files (docs/robustness.md): links other than hard links, virtual datasets and
    external raw storage are refused (nothing outside the file is ever opened); attributes are
    checked for shape and type before they are read and strings are bounded; every dataset's
    declared size is checked against the file size, chunk size and the token table before a
    byte of it is read. A trace that was not closed cleanly (``complete`` false) is read up to
    the rows its writer committed at its last flush, and ``recovered_note`` says how many.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        if not os.path.exists(self.path):
            raise TraceError("no such file", self.path)
        if os.path.isdir(self.path):
            raise TraceError("is a directory, not a trace file", self.path)
        try:
            self.file_size = os.path.getsize(self.path)
            if self.file_size == 0:
                raise TraceError("empty file (a recording killed before its first flush leaves nothing)", self.path)
            if not h5py.is_hdf5(self.path):
                raise TraceError("not an HDF5 file (not a tensordiff trace)", self.path)
        except PermissionError:
            raise TraceError("permission denied", self.path) from None
        except OSError as e:
            raise TraceError(f"cannot read: {e.strerror or e}", self.path) from None
        # A writer killed inside a flush can leave metadata that points past the end-of-allocation
        # address its superblock still records (HDF5 writes the superblock last). Such a trace is
        # read through a view that raises that address to the file size, as `h5clear --increment`
        # would, without writing to the file; only interrupted recordings are read this way.
        self.repaired = False
        patch = None
        try:
            self._open_and_load(None)
        except TraceError as first:
            patch = _eoa_patch(self.path, self.file_size)
            if patch is None:
                raise
            try:
                self._open_and_load(patch)
            except TraceError:
                raise first from None
            if self.complete:
                self.close()
                raise first from None
            self.repaired = True
        else:
            if not self.complete:
                patch = _eoa_patch(self.path, self.file_size)
                if patch is not None:
                    # the file's end lies past that address after any kill (chunks written since
                    # the last flush); reading through the view also reaches metadata a kill
                    # inside a flush left there, which the plain open may only meet later
                    plain = (self.f, self.__dict__.copy())
                    try:
                        self._open_and_load(patch)
                        plain[0].close()
                    except TraceError:
                        self.__dict__.update(plain[1])
        if self.repaired and self.recovered_note:
            self.recovered_note += " (it was killed inside a flush; read past the recorded end of file)"

    def _open_and_load(self, patch) -> None:
        self._view = None
        try:
            if patch is None:
                self.f = h5py.File(self.path, "r", locking=False, rdcc_nbytes=READ_CACHE_BYTES)
            else:
                self._view = _PatchedView(self.path, *patch)
                self.f = h5py.File(self._view, "r", rdcc_nbytes=READ_CACHE_BYTES)
        except OSError as e:
            self._close_view()
            raise TraceError(f"cannot open as HDF5, the file is truncated or damaged ({_short(e)})", self.path) from None
        except Exception as e:  # noqa: BLE001 - whatever a damaged superblock makes h5py raise
            self._close_view()
            raise TraceError(f"cannot open as HDF5, the file is damaged ({_short(e)})", self.path) from None
        try:
            self._load()
        except TraceError as e:
            self.close()
            if e.path is None:
                raise TraceError(str(e), self.path) from None
            raise
        except MemoryError:
            self.close()
            raise TraceError("damaged trace (a table is too large to load)", self.path) from None
        except Exception as e:  # noqa: BLE001 - OSError, KeyError, ValueError, TypeError, RuntimeError...
            self.close()
            raise TraceError(f"damaged trace ({_short(e)})", self.path) from None

    def _close_view(self) -> None:
        if getattr(self, "_view", None) is not None:
            try:
                self._view.close()
            except Exception:  # noqa: BLE001
                pass
            self._view = None

    # -- validation ----------------------------------------------------------------------------

    def _link(self, group: h5py.Group, name: str, what: str):
        link = group.get(name, getlink=True)
        if link is None:
            return None
        if not isinstance(link, h5py.HardLink):
            kind = "an external link" if isinstance(link, h5py.ExternalLink) else "a soft link"
            raise TraceError(f"{what} is {kind}; links are not followed (a trace is one self-contained file)")
        obj = group[name]
        if isinstance(obj, h5py.Dataset):
            self._check_dataset(obj, what)
        return obj

    def _check_dataset(self, ds: h5py.Dataset, what: str) -> None:
        if ds.is_virtual:
            raise TraceError(f"{what} is a virtual dataset; datasets mapped from other files are not read")
        if ds.external:
            raise TraceError(f"{what} keeps its data in external files; they are not read")
        if ds.shape is None:
            raise TraceError(f"{what} is an empty (null) dataset")
        dt = ds.dtype
        if dt.itemsize == 0 or dt.itemsize > 1 << 16:
            raise TraceError(f"{what} has an element size of {dt.itemsize} bytes")
        if ds.chunks is not None and math.prod(ds.chunks) * dt.itemsize > MAX_CHUNK_BYTES:
            raise TraceError(f"{what} has chunks of {math.prod(ds.chunks) * dt.itemsize} bytes "
                             f"(more than {MAX_CHUNK_BYTES >> 20} MiB)")
        missing = []
        for fid in _filters(ds):
            if not h5py.h5z.filter_avail(fid):
                try:
                    import hdf5plugin  # noqa: F401 - registers the common compression filters
                except ImportError:
                    pass
                if not h5py.h5z.filter_avail(fid):
                    missing.append(fid)
        if missing:
            raise TraceError(f"{what} is compressed with HDF5 filter {missing[0]}, which this install cannot decode "
                             "(pip install hdf5plugin)")

    def _check_bytes(self, ds: h5py.Dataset, rows: int, what: str) -> None:
        """Refuse to read ``rows`` rows of ``ds`` when they could not fit in the file."""
        row_bytes = ds.dtype.itemsize * math.prod(ds.shape[1:])
        limit = self.file_size * (FILTER_EXPANSION if _filters(ds) else 1) + (1 << 20)
        if rows * row_bytes > limit:
            raise TraceError(f"{what} claims {rows} rows ({rows * row_bytes} bytes) but the file has only "
                             f"{self.file_size} bytes; the file is truncated or damaged")

    def _load(self) -> None:
        f = self.f
        a = f.attrs
        if len(a) > MAX_ATTRS:
            raise TraceError(f"the root group has {len(a)} attributes; not a tensordiff trace")
        if "tensordiff_schema" not in a:
            raise TraceError("an HDF5 file but not a tensordiff trace (no tensordiff_schema attribute)")
        schema = _attr_num(a, "tensordiff_schema")
        if schema != SCHEMA_VERSION:
            raise TraceError(f"unknown trace schema version {schema} (this tensordiff reads version {SCHEMA_VERSION}); "
                             "upgrade tensordiff or re-record")
        self.schema = schema
        self.side = _attr_str(a, "side", "other")
        self.producer = _attr_str(a, "producer", "")[:4096]
        self.created = _attr_str(a, "created", "")[:64]
        self.model = _attr_json(a, "model", {})
        self.versions = _attr_json(a, "versions", {})
        self.user_meta = _attr_json(a, "user_meta", {})
        if not isinstance(self.model, dict) or not isinstance(self.versions, dict) or not isinstance(self.user_meta, dict):
            raise TraceError("attributes model/versions/user_meta must be JSON objects")
        for key in ("hidden_size", "num_layers"):
            v = self.model.get(key)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 0 < v <= 1 << 24):
                raise TraceError(f"model {key} is {v!r}, expected a positive integer")
        self.sketch_seed = _attr_num(a, "sketch_seed", default=DEFAULT_SKETCH_SEED)
        self.sketch_dim = _attr_num(a, "sketch_dim", default=DEFAULT_SKETCH_DIM)
        if not 1 <= self.sketch_dim <= 65536:
            raise TraceError(f"sketch_dim {self.sketch_dim} out of range")
        self.complete = bool(_attr_num(a, "complete", default=0))
        # rows the writer committed at its last flush (absent in traces of other writers)
        committed = _attr_num(a, "flushed_tokens", default=-1)
        self._committed = committed >= 0
        self.recovered_note = None
        self.skipped: list[str] = []
        try:
            self._load_tables(committed)
        except Exception:
            if self.complete or committed != 0:
                raise
            # killed before its first commit (typically inside the first flush): nothing was
            # committed, so nothing is lost, whatever state the rest of the file is in
            self.tokens = np.empty(0, TOKEN_DTYPE)
            self.sequences = []
            self.tensors, self._rows, self._ds = {}, {}, {}
            self.recovered = {"tokens": 0, "tensor_rows": {}, "dropped_tokens": 0, "dropped_tensor_rows": 0}
            self.recovered_note = ("trace was not closed cleanly (recording interrupted) before its first flush "
                                   "committed any rows: recovered 0 token rows")

    def _load_tables(self, committed: int) -> None:
        f = self.f
        tok = self._link(f, "tokens", "/tokens")
        if tok is None:
            raise TraceError("missing the /tokens table")
        if not isinstance(tok, h5py.Dataset) or tok.dtype.names is None or tok.ndim != 1:
            raise TraceError("/tokens is not a 1-D compound table")
        for col in ("seq", "position", "token", "regime", "step"):
            if col not in tok.dtype.names:
                if col == "step":
                    continue
                raise TraceError(f"/tokens lacks the column {col!r}")
            ct = tok.dtype.fields[col][0]
            if ct.kind not in "iu" or ct.itemsize > 8:
                raise TraceError(f"/tokens column {col!r} is {ct}, expected an integer")
        n_tok = tok.shape[0]
        on_disk_tok = n_tok
        if self.complete and self._committed and committed != n_tok:
            raise TraceError(f"/tokens has {n_tok} rows but its writer committed {committed}; the file was "
                             "truncated or modified after it was closed")
        if not self.complete and self._committed:
            n_tok = min(n_tok, committed)
        self._check_bytes(tok, n_tok, "/tokens")
        self.tokens = tok[:n_tok] if n_tok else np.empty(0, tok.dtype)
        seqs = self._link(f, "sequences", "/sequences")
        if seqs is None:
            raise TraceError("missing the /sequences list")
        if (not isinstance(seqs, h5py.Dataset) or seqs.ndim != 1
                or not (h5py.check_string_dtype(seqs.dtype) is not None or seqs.dtype.kind == "S")):
            raise TraceError("/sequences is not a 1-D list of strings")
        if seqs.shape[0] > MAX_SEQUENCES:
            raise TraceError(f"/sequences has {seqs.shape[0]} entries (at most {MAX_SEQUENCES} are supported)")
        n_seq = seqs.shape[0]
        if not self.complete and self._committed and n_tok:
            # only the keys the committed rows use: a kill inside a flush can leave later keys
            # pointing into a heap block that never reached the file
            n_seq = min(n_seq, max(int(self.tokens["seq"].max()), -1) + 1)
        elif not self.complete and self._committed:
            n_seq = 0
        self._check_bytes(seqs, n_seq, "/sequences")
        if n_seq:
            raw = (seqs.asstr(errors="replace")[:n_seq] if seqs.dtype.kind == "O"
                   else [bytes(b).decode("utf-8", "replace") for b in seqs[:n_seq]])
        else:
            raw = []
        self.sequences = [_clean(str(s))[:4096] for s in raw]
        if n_tok:
            sq = self.tokens["seq"]
            bad = (sq < 0) | (sq >= len(self.sequences))
            if bad.any():
                if self.complete or self._committed:
                    raise TraceError(f"/tokens has {int(bad.sum())} rows pointing outside /sequences")
                # unclean end of a writer that records no commit: keep the consistent prefix
                n_tok = int(np.argmax(bad))
                self.tokens = self.tokens[:n_tok]
            t = self.tokens
            if (t["regime"] >= len(REGIMES)).any():
                raise TraceError("/tokens has an unknown regime code")
            if ((t["position"] < 0) | (t["position"] >= MAX_POSITION)).any():
                raise TraceError("/tokens has a position outside 0..2^40")
        if self.tokens.dtype != TOKEN_DTYPE:  # other tools' layouts: normalise (step defaults to 0)
            norm = np.zeros(len(self.tokens), TOKEN_DTYPE)
            for col in TOKEN_DTYPE.names:
                if col in self.tokens.dtype.names:
                    norm[col] = self.tokens[col]
            self.tokens = norm

        tg = self._link(f, "tensors", "/tensors")
        if tg is None or not isinstance(tg, h5py.Group):
            raise TraceError("missing the /tensors group")
        if len(tg) > MAX_TENSORS:
            raise TraceError(f"/tensors has {len(tg)} members (at most {MAX_TENSORS})")
        self.tensors: dict[str, TensorInfo] = {}
        self._rows: dict[str, np.ndarray] = {}
        self._ds: dict[str, dict[str, h5py.Dataset]] = {}
        dropped = [on_disk_tok - n_tok, 0]
        for name in tg:
            if len(name) > 256:
                raise TraceError("a tensor name is longer than 256 characters")
            if _clean(name) != name or not name.isprintable():
                raise TraceError(f"a tensor name is not valid UTF-8 text ({_clean(name)[:40]!r})")
            try:
                self._load_tensor(tg, name, n_tok, dropped)
            except Exception as e:
                if self.complete or not self._committed or self._tensor_committed(tg, name):
                    raise
                # defined after the last commit and left unreadable by the kill: nothing of it was committed
                self.skipped.append(name)
                for d in (self.tensors, self._rows, self._ds):
                    d.pop(name, None)
                del e
        if not self.complete:
            total = sum(t.rows for t in self.tensors.values())
            how = "up to its last flush" if self._committed else "by consistency checks (no flush record)"
            extra = ""
            if dropped[0] or dropped[1]:
                extra = (f"; {dropped[0]} token rows and {dropped[1]} tensor rows written after that flush "
                         "were dropped")
            if self.skipped:
                extra += (f"; {len(self.skipped)} tensors defined after that flush were skipped "
                          f"({', '.join(self.skipped[:5])})")
            self.recovered_note = (f"trace was not closed cleanly (recording interrupted); recovered {n_tok} token "
                                   f"rows and {total} tensor rows in {len(self.tensors)} tensors {how}{extra}")
        self.recovered = {"tokens": n_tok, "tensor_rows": {n: t.rows for n, t in self.tensors.items()},
                          "dropped_tokens": dropped[0], "dropped_tensor_rows": dropped[1]}

    @staticmethod
    def _tensor_committed(tg: h5py.Group, name: str) -> bool:
        """Whether a tensor that failed to load had rows committed (then its loss is an error)."""
        try:
            return _attr_num(tg[name].attrs, "flushed_rows", default=0) > 0
        except Exception:  # noqa: BLE001 - an unreadable header was never committed (see _load)
            return False

    def _load_tensor(self, tg: h5py.Group, name: str, n_tok: int, dropped: list) -> None:
        where = f" of tensor {name!r}"
        g = self._link(tg, name, f"tensor {name!r}")
        if not isinstance(g, h5py.Group):
            raise TraceError(f"tensor {name!r} is not a group")
        ga = g.attrs
        if len(ga) > MAX_ATTRS:
            raise TraceError(f"tensor {name!r} has {len(ga)} attributes (at most {MAX_ATTRS})")
        kind = _attr_str(ga, "kind", where=where)
        if kind not in KINDS:
            raise TraceError(f"tensor {name!r} has unknown kind {kind[:40]!r}")
        dtype = _attr_str(ga, "dtype", where=where)
        if dtype not in LOGICAL_DTYPES:
            raise TraceError(f"tensor {name!r} has unsupported dtype {dtype[:40]!r}")
        width = _attr_num(ga, "width", where=where)
        k = _attr_num(ga, "slot_count", where=where)
        sw = _attr_num(ga, "slot_width", where=where)
        if width <= 0 or k <= 0 or sw <= 0 or k * sw != width or width > 1 << 24 or k > MAX_SLOTS:
            raise TraceError(f"tensor {name!r}: width {width} is not slot_count {k} x slot_width {sw}")
        labels = _attr_json(ga, "slot_labels", None, where)
        if labels is not None:
            if not isinstance(labels, list) or len(labels) != k or not all(isinstance(x, str) for x in labels):
                raise TraceError(f"tensor {name!r}: slot_labels must be a list of {k} strings")
            for lab in labels:
                try:
                    parse_label(lab)
                except ValueError as e:
                    raise TraceError(f"tensor {name!r}: {_short(e)}") from None
        if kind == "packed" and labels is None:
            raise TraceError(f"packed tensor {name!r} has no slot_labels")
        raw_ids = _attr_json(ga, "raw_ids", None, where)
        if raw_ids is not None and (not isinstance(raw_ids, list) or not all(
                isinstance(x, int) and not isinstance(x, bool) for x in raw_ids)):
            raise TraceError(f"tensor {name!r}: raw_ids must be a list of integers")
        boundary = None
        if kind == "boundary":
            boundary = _attr_num(ga, "boundary", where=where)
            if boundary < 0 or boundary > 100000:
                raise TraceError(f"tensor {name!r}: boundary {boundary} out of range")
        token_offset = _attr_num(ga, "token_offset", default=0, where=where)
        if abs(token_offset) > 1024:
            raise TraceError(f"tensor {name!r}: token_offset {token_offset} out of range")
        rows_ds = self._link(g, "rows", f"{name}/rows")
        if not isinstance(rows_ds, h5py.Dataset) or rows_ds.ndim != 1 or rows_ds.dtype.kind not in "iu":
            raise TraceError(f"tensor {name!r} has no valid rows index")
        dsets = {"rows": rows_ds}
        for part, shape2 in (("values", width), ("sketch", k * self.sketch_dim), ("rms", k)):
            ds = self._link(g, part, f"{name}/{part}")
            if ds is None:
                continue
            if not isinstance(ds, h5py.Dataset) or ds.ndim != 2 or ds.shape[1] != shape2:
                raise TraceError(f"tensor {name!r}: {part} has shape {getattr(ds, 'shape', None)}, expected (rows, {shape2})")
            if part == "values" and ds.dtype != storage_dtype(dtype):
                raise TraceError(f"tensor {name!r}: values stored as {ds.dtype}, expected {storage_dtype(dtype)} for {dtype}")
            if part != "values" and (ds.dtype.kind != "f" or ds.dtype.itemsize > 8):
                raise TraceError(f"tensor {name!r}: {part} is not floating point")
            dsets[part] = ds
        if "values" not in dsets and "sketch" not in dsets:
            raise TraceError(f"tensor {name!r} has neither values nor a sketch")
        lengths = {p: d.shape[0] for p, d in dsets.items()}
        n = min(lengths.values())
        on_disk = max(lengths.values())
        committed = _attr_num(ga, "flushed_rows", default=-1, where=where) if self._committed else -1
        if self.complete:
            if len(set(lengths.values())) > 1:
                raise TraceError(f"tensor {name!r}: datasets disagree on the row count {lengths}")
            if committed >= 0 and committed != n:
                raise TraceError(f"tensor {name!r} has {n} rows but its writer committed {committed}; the file "
                                 "was truncated or modified after it was closed")
        elif committed >= 0:
            n = min(n, committed)
        elif self._committed:
            n = 0  # defined after the last flush: nothing of it was committed
        for part, ds in dsets.items():
            self._check_bytes(ds, n, f"{name}/{part}")
        rows = rows_ds[:n].astype(np.int64, copy=False) if n else np.empty(0, np.int64)
        if n and (rows.min() < 0 or rows.max() >= n_tok):
            if self.complete:
                raise TraceError(f"tensor {name!r}: row indices point outside the token table")
            good = (rows >= 0) & (rows < n_tok)
            n = int(np.argmin(good)) if not good.all() else n
            rows = rows[:n]
        dropped[1] += on_disk - n
        self._rows[name] = rows
        self._ds[name] = dsets
        user_attrs = {}
        for k2 in ga:
            if k2.startswith("user."):
                user_attrs[_clean(k2[5:])] = _attr_json(ga, k2, None, where)
        self.tensors[name] = TensorInfo(
            name=name, kind=kind, dtype=dtype, width=width, rows=n, slot_count=k, slot_width=sw,
            slot_labels=labels, raw_ids=raw_ids, convention=_attr_str(ga, "convention", "", where)[:256] or None,
            order=_attr_num(ga, "order", float, 0.0, where), token_offset=token_offset,
            role=_attr_str(ga, "role", "", where)[:256], has_values="values" in dsets, has_sketch="sketch" in dsets,
            boundary=boundary, attrs=user_attrs,
        )

    # -- accessors -----------------------------------------------------------------------------

    @property
    def hidden_size(self) -> int | None:
        h = self.model.get("hidden_size")
        return int(h) if isinstance(h, (int, float)) else None

    @property
    def num_layers(self) -> int | None:
        n = self.model.get("num_layers")
        return int(n) if isinstance(n, (int, float)) else None

    def token_rows(self, name: str) -> np.ndarray:
        """Token-table row of every row of tensor ``name`` (int64, loaded at open)."""
        return self._rows[name]

    def _read(self, name: str, part: str, sel, out: np.ndarray | None = None) -> np.ndarray:
        try:
            ds = self._ds[name][part]
        except KeyError:
            raise TraceError(f"tensor {name!r} has no {part}", self.path) from None
        try:
            if out is not None and isinstance(sel, slice):
                n = len(range(*sel.indices(ds.shape[0])))
                dest = out.reshape(-1)[:n * int(np.prod(ds.shape[1:], dtype=np.int64))].reshape((n,) + ds.shape[1:])
                ds.read_direct(dest, np.s_[sel.start:sel.start + n])  # no fresh allocation per block
                return dest
            return ds[sel]
        except (OSError, ValueError, TypeError) as e:
            raise TraceError(f"cannot read {name}/{part}, the file is damaged ({_short(e)})", self.path) from None

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
            raise TraceError(f"tensor {name!r} has no {part}", self.path)
        if len(idx) == 0:
            return np.empty((0,) + ds.shape[1:], ds.dtype)
        lo, hi = int(idx[0]), int(idx[-1]) + 1
        if hi - lo == len(idx) and (len(idx) == 1 or np.all(np.diff(idx) == 1)):
            # the common case: a run of rows, read straight into ``out`` (same dtype) when given
            return self._read(name, part, np.s_[lo:hi], out)
        uniq, inv = np.unique(idx, return_inverse=True)
        lo, hi = int(uniq[0]), int(uniq[-1]) + 1
        row_bytes = max(1, int(np.prod(ds.shape[1:], dtype=np.int64)) * ds.dtype.itemsize)
        if (hi - lo) * row_bytes <= _SPAN_BYTES or hi - lo <= 4 * len(uniq):
            block = self._read(name, part, np.s_[lo:hi])[uniq - lo]
        else:
            cr = ds.chunks[0] if ds.chunks else max(1, _SPAN_BYTES // row_bytes)
            block = np.empty((len(uniq),) + ds.shape[1:], ds.dtype)
            cid = uniq // cr
            cuts = np.flatnonzero(np.diff(cid)) + 1
            for part_idx in np.split(np.arange(len(uniq)), cuts):
                u = uniq[part_idx]
                a0, a1 = int(u[0]), int(u[-1]) + 1
                block[part_idx] = self._read(name, part, np.s_[a0:a1])[u - a0]
        return block[inv]

    def read_values_at(self, name: str, idx: np.ndarray, *, raw: bool = False,
                       out: np.ndarray | None = None) -> np.ndarray:
        """Tensor rows at the given row indices (any order), float32 (``raw=True``: stored form).
        ``out``: a reusable float32 buffer (see :func:`tensordiff.dtypes.to_float32`)."""
        block = self.read_at(name, "values", idx)
        return block if raw else to_float32(block, self.tensors[name].dtype, out)

    def read_sketch(self, name: str, start: int = 0, stop: int | None = None) -> np.ndarray:
        return np.asarray(self._read(name, "sketch", np.s_[start:stop]), dtype=np.float32)

    def read_rms(self, name: str, start: int = 0, stop: int | None = None) -> np.ndarray:
        if "rms" not in self._ds[name]:
            vals = self.read_values(name, start, stop)
            return slot_rms(vals, self.tensors[name].slot_width)
        return np.asarray(self._read(name, "rms", np.s_[start:stop]), dtype=np.float32)

    def _touch(self) -> None:
        """Read the first and last row of every dataset (walks each chunk index at both ends)."""
        for name, info in self.tensors.items():
            if info.rows:
                for part in self._ds[name]:
                    if part != "rows":
                        self._read(name, part, np.s_[0:1])
                        self._read(name, part, np.s_[info.rows - 1:info.rows])

    def summary(self) -> dict:
        """Everything ``tensordiff info`` shows, as plain data."""
        t = self.tokens
        regimes = {REGIMES[c]: int(n) for c, n in zip(*np.unique(t["regime"], return_counts=True))} if len(t) else {}
        seqs = []
        if len(t):
            order = np.argsort(t["seq"], kind="stable")
            sq = t["seq"][order]
            cuts = np.flatnonzero(np.diff(sq)) + 1
            for part in np.split(order, cuts):
                pos = t["position"][part]
                seqs.append({"key": self.sequences[int(t["seq"][part[0]])], "rows": int(len(part)),
                             "positions": [int(pos.min()), int(pos.max())]})
        tensors = []
        for info in sorted(self.tensors.values(), key=lambda i: (i.order, i.name)):
            entry = {"name": info.name, "kind": info.kind, "label": info.label, "dtype": info.dtype,
                     "shape": [info.rows, info.width], "order": info.order, "values": info.has_values,
                     "sketch": info.has_sketch, "role": info.role}
            if info.slot_count > 1 or info.slot_labels:
                entry.update(slots=info.slot_count, slot_width=info.slot_width, slot_labels=info.slot_labels,
                             raw_ids=info.raw_ids, convention=info.convention)
            if info.token_offset:
                entry["token_offset"] = info.token_offset
            if info.attrs:
                entry["attrs"] = info.attrs
            tensors.append(entry)
        return {
            "path": self.path, "schema": self.schema, "side": self.side, "producer": self.producer,
            "created": self.created, "complete": self.complete, "recovered": self.recovered_note,
            "model": self.model, "versions": self.versions, "user_meta": self.user_meta,
            "sketch": {"seed": self.sketch_seed, "dim": self.sketch_dim},
            "tokens": {"rows": int(len(t)), "sequences": len(self.sequences), "regimes": regimes},
            "sequences": seqs[:1000], "tensors": tensors,
        }

    def close(self) -> None:
        try:
            self.f.close()
        except Exception:  # noqa: BLE001 - closing a damaged file must not mask the real error
            pass
        self._close_view()

    def __enter__(self) -> "TraceReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _short(e: BaseException) -> str:
    s = str(e).splitlines()[0] if str(e) else type(e).__name__
    return s[:200]


# ----------------------------------------------------------------------------------------------
# Opening untrusted files: a guard against the HDF5 library itself
# ----------------------------------------------------------------------------------------------

PROBE_SECONDS = 60.0  # plus the time to read the whole file at 200 MB/s; TENSORDIFF_OPEN_TIMEOUT overrides


def probe(paths: Sequence[str], timeout: float | None = None) -> None:
    """Open and validate each trace in a forked child process first, and raise :class:`TraceError`
    if that child crashes or does not finish in time.

    Some damaged files make the HDF5 library loop forever or crash (a corrupted global heap sends
    a variable-length string read into an endless loop, for one), deep in C code where no Python
    timeout or exception handler can reach. The child meets such a file instead of the caller;
    the CLI runs this before it opens its inputs (``info``, ``diff``, ``tui``, ``calibrate``). It
    costs one extra open per trace. Without ``os.fork`` (or with TENSORDIFF_NO_PROBE=1) it does
    nothing."""
    if not hasattr(os, "fork") or os.environ.get("TENSORDIFF_NO_PROBE"):
        return
    paths = [os.fspath(p) for p in paths]
    if timeout is None:
        env = os.environ.get("TENSORDIFF_OPEN_TIMEOUT")
        if env:
            timeout = float(env)
        else:
            size = sum(os.path.getsize(p) for p in paths if os.path.isfile(p))
            timeout = PROBE_SECONDS + size / 200e6
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: never returns
        code = 3
        try:
            os.close(rfd)
            code = 0
            for p in paths:
                os.write(wfd, b"P" + p.encode("utf-8", "surrogateescape").replace(b"\n", b" ") + b"\n")
                try:
                    with TraceReader(p) as r:
                        r._touch()
                except TraceError as e:
                    os.write(wfd, b"E" + " ".join(str(e).split()).encode("utf-8", "replace")[:4000] + b"\n")
                    code = 2
                    break
        except BaseException:  # noqa: BLE001 - the caller's own open will meet and report it
            code = 3
        finally:
            os._exit(code)
    os.close(wfd)
    buf = b""
    deadline = time.monotonic() + timeout
    status = None
    try:
        while True:
            done, st = os.waitpid(pid, os.WNOHANG)
            buf += _drain_fd(rfd)
            if done:
                status = st
                break
            if time.monotonic() > deadline:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                break
            time.sleep(0.002 if time.monotonic() - deadline + timeout < 0.2 else 0.02)
        buf += _drain_fd(rfd)
    finally:
        os.close(rfd)
    lines = buf.decode("utf-8", "replace").splitlines()
    last = next((x[1:] for x in reversed(lines) if x.startswith("P")), paths[0] if paths else "")
    err = next((x[1:] for x in lines if x.startswith("E")), None)
    if status is None:
        raise TraceError(f"reading the file's structure did not finish in {timeout:.0f} s: the file is damaged "
                         "(the HDF5 library loops on some damaged structures)", last)
    if os.WIFSIGNALED(status):
        raise TraceError(f"the HDF5 library crashed reading this file (signal {os.WTERMSIG(status)}): "
                         "the file is damaged", last)
    code = os.WEXITSTATUS(status)
    if code == 2 and err:
        raise TraceError(err)


def _drain_fd(fd: int) -> bytes:
    import select

    out = b""
    while select.select([fd], [], [], 0)[0]:
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        out += chunk
    return out
