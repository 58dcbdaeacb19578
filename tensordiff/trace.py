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

import json
import math
import os
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

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
MAX_ATTR_CHARS = 1 << 20  # strings longer than this in a trace are refused, not parsed
CHUNK_BYTES = 1 << 20


def _chunk_rows(row_bytes: int) -> int:
    rows = max(1, CHUNK_BYTES // max(row_bytes, 1))
    return max(16, 1 << int(math.log2(rows)))


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

    Crash safety: every ``flush_rows`` token rows or ``flush_seconds`` seconds (whichever comes
    first) all buffered rows are written and the file is flushed, so a process killed later loses
    at most what came after that flush (see docs/robustness.md).
    """

    def __init__(self, path: str | os.PathLike, side: str = "other", *, producer: str = "",
                 model: dict | None = None, meta: dict | None = None,
                 sketch_dim: int = DEFAULT_SKETCH_DIM, sketch_seed: int = DEFAULT_SKETCH_SEED,
                 flush_rows: int | None = 4096, flush_seconds: float | None = 10.0,
                 versions: dict | None = None):
        if side not in SIDES:
            raise ValueError(f"side must be one of {SIDES}, got {side!r}")
        self.path = os.fspath(path)
        self.f = h5py.File(self.path, "w")
        self.model = dict(model or {})
        self.sketch_dim = int(sketch_dim)
        self.sketch_seed = int(sketch_seed)
        self.flush_rows = flush_rows
        self.flush_seconds = flush_seconds
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
        self.f.create_dataset("sequences", shape=(0,), maxshape=(None,), chunks=(1024,),
                              dtype=h5py.string_dtype("utf-8"))
        tok = self.f.create_dataset("tokens", shape=(0,), maxshape=(None,), chunks=(8192,), dtype=TOKEN_DTYPE)
        tok.attrs["regimes"] = json.dumps(list(REGIMES))
        self.f.create_group("tensors")
        self._tokens = _Appender(tok)
        self._seq_index: dict[str, int] = {}
        self._tensors: dict[str, dict[str, _Appender]] = {}
        self._specs: dict[str, dict] = {}
        self._pending_rms: dict[str, list[np.ndarray]] = {}
        self._pending_rows: dict[str, int] = {}
        self._rows_since_flush = 0
        self._last_flush = time.monotonic()
        self._closed = False
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
        for key, val in (attrs or {}).items():
            ga[f"user.{key}"] = json.dumps(val)
        apps: dict[str, _Appender] = {}
        apps["rows"] = _Appender(g.create_dataset("rows", shape=(0,), maxshape=(None,), chunks=(8192,), dtype="<i8"))
        if values:
            sd = storage_dtype(dtype)
            cr = _chunk_rows(width * sd.itemsize)
            ds = g.create_dataset("values", shape=(0, width), maxshape=(None, width), chunks=(cr, width), dtype=sd)
            ds.attrs["dtype"] = dtype
            apps["values"] = _Appender(ds)
        if sketch:
            d = self.sketch_dim * k
            apps["sketch"] = _Appender(g.create_dataset("sketch", shape=(0, d), maxshape=(None, d),
                                                        chunks=(_chunk_rows(d * 4), d), dtype="<f4"))
        apps["rms"] = _Appender(g.create_dataset("rms", shape=(0, k), maxshape=(None, k),
                                                 chunks=(_chunk_rows(k * 4) * 4, k), dtype="<f4"))
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
        rec = np.empty(len(positions), dtype=TOKEN_DTYPE)
        rec["seq"] = self.sequence(str(seq))
        rec["position"] = positions
        rec["token"] = tokens
        rec["regime"] = regime_code(regime)
        rec["step"] = step
        start = self._tokens.rows
        self._tokens.append(rec)
        self._rows_since_flush += len(rec)
        self._maybe_flush()
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

    def _maybe_flush(self) -> None:
        due = self.flush_rows is not None and self._rows_since_flush >= self.flush_rows
        if not due and self.flush_seconds is not None:
            due = time.monotonic() - self._last_flush >= self.flush_seconds
        if due:
            self.flush()

    def flush(self) -> None:
        """Write every buffered row and flush the file: a crash after this loses nothing before it."""
        for name, apps in self._tensors.items():
            self._drain_rms(name)
            for app in apps.values():
                app.flush_partial()
        self._tokens.flush_partial()
        self.f.flush()
        self._rows_since_flush = 0
        self._last_flush = time.monotonic()

    def close(self) -> None:
        if self._closed:
            return
        self.flush()
        # trim to the rows written (a partial last chunk may have been over-allocated)
        for apps in self._tensors.values():
            for app in apps.values():
                if app.ds.shape[0] != app.rows:
                    app.ds.resize(app.rows, axis=0)
        if self._tokens.ds.shape[0] != self._tokens.rows:
            self._tokens.ds.resize(self._tokens.rows, axis=0)
        self.f.attrs["complete"] = True
        self.f.close()
        self._closed = True

    def __enter__(self) -> "TraceWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


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


def _attr_str(attrs, key: str, default: str | None = None, where: str = "") -> str:
    if key not in attrs:
        if default is not None:
            return default
        raise TraceError(f"missing attribute {key!r}{where}")
    v = attrs[key]
    if isinstance(v, bytes):
        v = v.decode("utf-8", "replace")
    if isinstance(v, np.ndarray) or not isinstance(v, str):
        raise TraceError(f"attribute {key!r}{where} is not a string")
    if len(v) > MAX_ATTR_CHARS:
        raise TraceError(f"attribute {key!r}{where} is longer than {MAX_ATTR_CHARS} characters")
    return v


def _attr_json(attrs, key: str, default: Any = None, where: str = "") -> Any:
    if key not in attrs:
        return default
    s = _attr_str(attrs, key, where=where)
    try:
        return json.loads(s)
    except ValueError:
        raise TraceError(f"attribute {key!r}{where} is not valid JSON") from None


def _attr_num(attrs, key: str, kind=int, default: Any = None, where: str = ""):
    if key not in attrs:
        if default is not None:
            return default
        raise TraceError(f"missing attribute {key!r}{where}")
    v = attrs[key]
    if isinstance(v, np.ndarray):
        if v.size != 1:
            raise TraceError(f"attribute {key!r}{where} is not a number")
        v = v.reshape(())[()]
    try:
        out = kind(v)
    except (TypeError, ValueError):
        raise TraceError(f"attribute {key!r}{where} is not a number") from None
    if kind is float and not math.isfinite(out):
        raise TraceError(f"attribute {key!r}{where} is not finite")
    return out


class TraceReader:
    """Open and validate a trace. Raises :class:`TraceError` with a one-line reason on bad input.

    Nothing is loaded but the token table and the per-tensor row indices; values, sketches and
    RMS are read by row range or row subset on demand.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        if not os.path.exists(self.path):
            raise TraceError("no such file", self.path)
        if os.path.isdir(self.path):
            raise TraceError("is a directory, not a trace file", self.path)
        try:
            if not h5py.is_hdf5(self.path):
                raise TraceError("not an HDF5 file (not a tensordiff trace)", self.path)
        except PermissionError:
            raise TraceError("permission denied", self.path) from None
        except OSError as e:
            raise TraceError(f"cannot read: {e.strerror or e}", self.path) from None
        try:
            self.f = h5py.File(self.path, "r", locking=False)
        except OSError as e:
            raise TraceError(f"cannot open as HDF5, the file is truncated or damaged ({_short(e)})", self.path) from None
        try:
            self._load()
        except TraceError as e:
            self.f.close()
            if e.path is None:
                raise TraceError(str(e), self.path) from None
            raise
        except (OSError, KeyError, ValueError, TypeError, RuntimeError) as e:
            self.f.close()
            raise TraceError(f"damaged trace ({_short(e)})", self.path) from None

    # -- validation ----------------------------------------------------------------------------

    def _link(self, group: h5py.Group, name: str, what: str):
        link = group.get(name, getlink=True)
        if link is None:
            return None
        if not isinstance(link, h5py.HardLink):
            raise TraceError(f"{what} is a {type(link).__name__}; links out of the file are not followed")
        obj = group[name]
        if isinstance(obj, h5py.Dataset) and obj.is_virtual:
            raise TraceError(f"{what} is a virtual dataset; datasets mapped from other files are not read")
        return obj

    def _load(self) -> None:
        f = self.f
        a = f.attrs
        if "tensordiff_schema" not in a:
            raise TraceError("an HDF5 file but not a tensordiff trace (no tensordiff_schema attribute)")
        schema = _attr_num(a, "tensordiff_schema")
        if schema != SCHEMA_VERSION:
            raise TraceError(f"unknown trace schema version {schema} (this tensordiff reads version {SCHEMA_VERSION}); "
                             "upgrade tensordiff or re-record")
        self.schema = schema
        self.side = _attr_str(a, "side", "other")
        self.producer = _attr_str(a, "producer", "")
        self.created = _attr_str(a, "created", "")
        self.model = _attr_json(a, "model", {})
        self.versions = _attr_json(a, "versions", {})
        self.user_meta = _attr_json(a, "user_meta", {})
        if not isinstance(self.model, dict) or not isinstance(self.versions, dict) or not isinstance(self.user_meta, dict):
            raise TraceError("attributes model/versions/user_meta must be JSON objects")
        self.sketch_seed = _attr_num(a, "sketch_seed", default=DEFAULT_SKETCH_SEED)
        self.sketch_dim = _attr_num(a, "sketch_dim", default=DEFAULT_SKETCH_DIM)
        if not 1 <= self.sketch_dim <= 65536:
            raise TraceError(f"sketch_dim {self.sketch_dim} out of range")
        self.complete = bool(_attr_num(a, "complete", default=0))

        tok = self._link(f, "tokens", "/tokens")
        if tok is None:
            raise TraceError("missing the /tokens table")
        if not isinstance(tok, h5py.Dataset) or tok.dtype.names is None or tok.ndim != 1:
            raise TraceError("/tokens is not a 1-D compound table")
        for col in ("seq", "position", "token", "regime"):
            if col not in tok.dtype.names:
                raise TraceError(f"/tokens lacks the column {col!r}")
        self.tokens = tok[()]
        seqs = self._link(f, "sequences", "/sequences")
        if seqs is None:
            raise TraceError("missing the /sequences list")
        if not isinstance(seqs, h5py.Dataset) or seqs.ndim != 1 or seqs.dtype.kind not in "OS":
            raise TraceError("/sequences is not a 1-D list of strings")
        raw = seqs.asstr(errors="replace")[()] if seqs.dtype.kind == "O" else seqs[()].astype(str)
        self.sequences = [str(s)[:4096] for s in raw]
        self.recovered_note = None
        n_tok = len(self.tokens)
        if n_tok:
            sq = self.tokens["seq"]
            bad = (sq < 0) | (sq >= len(self.sequences))
            if bad.any():
                if self.complete:
                    raise TraceError(f"/tokens has {int(bad.sum())} rows pointing outside /sequences")
                # unclean end: keep the consistent prefix
                n_tok = int(np.argmax(bad))
                self.tokens = self.tokens[:n_tok]
            if (self.tokens["regime"] >= len(REGIMES)).any():
                raise TraceError("/tokens has an unknown regime code")

        tg = self._link(f, "tensors", "/tensors")
        if tg is None or not isinstance(tg, h5py.Group):
            raise TraceError("missing the /tensors group")
        self.tensors: dict[str, TensorInfo] = {}
        self._rows: dict[str, np.ndarray] = {}
        self._ds: dict[str, dict[str, h5py.Dataset]] = {}
        recovered = []
        for name in tg:
            if len(name) > 256:
                raise TraceError("a tensor name is longer than 256 characters")
            self._load_tensor(tg, name, n_tok, recovered)
        if not self.complete:
            total = sum(t.rows for t in self.tensors.values())
            self.recovered_note = (f"trace was not closed cleanly (recording interrupted); recovered "
                                   f"{n_tok} token rows and {total} tensor rows up to the last flush")

    def _load_tensor(self, tg: h5py.Group, name: str, n_tok: int, recovered: list) -> None:
        where = f" of tensor {name!r}"
        g = self._link(tg, name, f"tensor {name!r}")
        if not isinstance(g, h5py.Group):
            raise TraceError(f"tensor {name!r} is not a group")
        ga = g.attrs
        kind = _attr_str(ga, "kind", where=where)
        if kind not in KINDS:
            raise TraceError(f"tensor {name!r} has unknown kind {kind!r}")
        dtype = _attr_str(ga, "dtype", where=where)
        if dtype not in LOGICAL_DTYPES:
            raise TraceError(f"tensor {name!r} has unsupported dtype {dtype!r}")
        width = _attr_num(ga, "width", where=where)
        k = _attr_num(ga, "slot_count", where=where)
        sw = _attr_num(ga, "slot_width", where=where)
        if width <= 0 or k <= 0 or sw <= 0 or k * sw != width or width > 1 << 24:
            raise TraceError(f"tensor {name!r}: width {width} is not slot_count {k} x slot_width {sw}")
        labels = _attr_json(ga, "slot_labels", None, where)
        if labels is not None:
            if not isinstance(labels, list) or len(labels) != k or not all(isinstance(x, str) for x in labels):
                raise TraceError(f"tensor {name!r}: slot_labels must be a list of {k} strings")
            for lab in labels:
                try:
                    parse_label(lab)
                except ValueError as e:
                    raise TraceError(f"tensor {name!r}: {e}") from None
        if kind == "packed" and labels is None:
            raise TraceError(f"packed tensor {name!r} has no slot_labels")
        raw_ids = _attr_json(ga, "raw_ids", None, where)
        if raw_ids is not None and (not isinstance(raw_ids, list) or not all(isinstance(x, int) for x in raw_ids)):
            raise TraceError(f"tensor {name!r}: raw_ids must be a list of integers")
        boundary = None
        if kind == "boundary":
            boundary = _attr_num(ga, "boundary", where=where)
            if boundary < 0 or boundary > 100000:
                raise TraceError(f"tensor {name!r}: boundary {boundary} out of range")
        rows_ds = self._link(g, "rows", f"{name}/rows")
        if not isinstance(rows_ds, h5py.Dataset) or rows_ds.ndim != 1 or rows_ds.dtype.kind not in "iu":
            raise TraceError(f"tensor {name!r} has no valid rows index")
        dsets = {"rows": rows_ds}
        n = rows_ds.shape[0]
        for part, shape2 in (("values", width), ("sketch", k * self.sketch_dim), ("rms", k)):
            ds = self._link(g, part, f"{name}/{part}")
            if ds is None:
                continue
            if not isinstance(ds, h5py.Dataset) or ds.ndim != 2 or ds.shape[1] != shape2:
                raise TraceError(f"tensor {name!r}: {part} has shape {getattr(ds, 'shape', None)}, expected (rows, {shape2})")
            if part == "values" and ds.dtype != storage_dtype(dtype):
                raise TraceError(f"tensor {name!r}: values stored as {ds.dtype}, expected {storage_dtype(dtype)} for {dtype}")
            if part != "values" and ds.dtype.kind != "f":
                raise TraceError(f"tensor {name!r}: {part} is not floating point")
            dsets[part] = ds
            n = min(n, ds.shape[0])
        if "values" not in dsets and "sketch" not in dsets:
            raise TraceError(f"tensor {name!r} has neither values nor a sketch")
        lengths = {p: d.shape[0] for p, d in dsets.items()}
        if len(set(lengths.values())) > 1 and self.complete:
            raise TraceError(f"tensor {name!r}: datasets disagree on the row count {lengths}")
        rows = rows_ds[:n].astype(np.int64, copy=False)
        if n and (rows.min() < 0 or rows.max() >= n_tok):
            if self.complete:
                raise TraceError(f"tensor {name!r}: row indices point outside the token table")
            good = (rows >= 0) & (rows < n_tok)
            n = int(np.argmin(good)) if not good.all() else n
            rows = rows[:n]
        self._rows[name] = rows
        self._ds[name] = dsets
        self.tensors[name] = TensorInfo(
            name=name, kind=kind, dtype=dtype, width=width, rows=n, slot_count=k, slot_width=sw,
            slot_labels=labels, raw_ids=raw_ids, convention=_attr_str(ga, "convention", "", where) or None,
            order=_attr_num(ga, "order", float, 0.0, where), token_offset=_attr_num(ga, "token_offset", default=0, where=where),
            role=_attr_str(ga, "role", "", where), has_values="values" in dsets, has_sketch="sketch" in dsets,
            boundary=boundary,
            attrs={k2[5:]: _attr_json(ga, k2, None, where) for k2 in ga if k2.startswith("user.")},
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

    def _read(self, name: str, part: str, sel) -> np.ndarray:
        try:
            ds = self._ds[name][part]
        except KeyError:
            raise TraceError(f"tensor {name!r} has no {part}", self.path) from None
        try:
            return ds[sel]
        except (OSError, ValueError, TypeError) as e:
            raise TraceError(f"cannot read {name}/{part}, the file is damaged ({_short(e)})", self.path) from None

    def read_values(self, name: str, start: int = 0, stop: int | None = None, *, raw: bool = False) -> np.ndarray:
        """Rows [start, stop) of a tensor's full values as float32 (``raw=True``: stored form)."""
        info = self.tensors[name]
        stop = info.rows if stop is None else min(stop, info.rows)
        block = self._read(name, "values", np.s_[start:stop])
        return block if raw else to_float32(block, info.dtype)

    def read_at(self, name: str, part: str, idx: np.ndarray) -> np.ndarray:
        """Rows of ``name/part`` (values in stored form, sketch or rms) at row indices in any order
        and with repeats; one contiguous read when the rows are dense, a point selection otherwise."""
        idx = np.asarray(idx, dtype=np.int64)
        ds = self._ds[name].get(part)
        if ds is None:
            raise TraceError(f"tensor {name!r} has no {part}", self.path)
        if len(idx) == 0:
            return np.empty((0,) + ds.shape[1:], ds.dtype)
        uniq, inv = np.unique(idx, return_inverse=True)
        lo, hi = int(uniq[0]), int(uniq[-1]) + 1
        if hi - lo <= 4 * len(uniq):
            block = self._read(name, part, np.s_[lo:hi])
            if len(uniq) != hi - lo:
                block = block[uniq - lo]
        else:
            block = self._read(name, part, uniq)
        return block if len(uniq) == len(idx) and np.array_equal(uniq, idx) else block[inv]

    def read_values_at(self, name: str, idx: np.ndarray, *, raw: bool = False) -> np.ndarray:
        """Tensor rows at the given row indices (any order), float32 (``raw=True``: stored form)."""
        block = self.read_at(name, "values", idx)
        return block if raw else to_float32(block, self.tensors[name].dtype)

    def read_sketch(self, name: str, start: int = 0, stop: int | None = None) -> np.ndarray:
        return np.asarray(self._read(name, "sketch", np.s_[start:stop]), dtype=np.float32)

    def read_rms(self, name: str, start: int = 0, stop: int | None = None) -> np.ndarray:
        if "rms" not in self._ds[name]:
            vals = self.read_values(name, start, stop)
            return slot_rms(vals, self.tensors[name].slot_width)
        return np.asarray(self._read(name, "rms", np.s_[start:stop]), dtype=np.float32)

    def iter_blocks(self, name: str, block_rows: int = 4096) -> Iterator[tuple[int, int]]:
        n = self.tensors[name].rows
        for s in range(0, n, block_rows):
            yield s, min(n, s + block_rows)

    def seq_tokens(self) -> dict[int, dict[int, int]]:
        """{sequence index: {position: token id}} over all rows (later rows win)."""
        out: dict[int, dict[int, int]] = {}
        t = self.tokens
        for s, p, k in zip(t["seq"].tolist(), t["position"].tolist(), t["token"].tolist()):
            out.setdefault(s, {})[p] = k
        return out

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

    def __enter__(self) -> "TraceReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _short(e: BaseException) -> str:
    s = str(e).splitlines()[0] if str(e) else type(e).__name__
    return s[:200]
