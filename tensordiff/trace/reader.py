"""Reading a trace: :class:`TraceReader` opens and validates a file (tensordiff/trace/validate.py),
keeps only the committed rows of one that was not closed cleanly (tensordiff/trace/recover.py),
and reads values, sketches and RMS by row range or row subset without loading whole datasets.

Why one module of this size: it is the one reader every tool opens; its checks live in validate.py,
its reads after the open in reads.py, and what is left is the open itself and the trace's tables.
"""

from __future__ import annotations

import contextlib
import os
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import h5py  # type: ignore[import-untyped, unused-ignore]
import numpy as np
from h5py import h5s  # type: ignore[import-untyped, unused-ignore]

from ..dtypes import storage_dtype
from ..errors import TensordiffError, TraceFileError
from ..sketch import DEFAULT_SKETCH_DIM, DEFAULT_SKETCH_SEED
from ..vocab import REGIMES
from . import recover
from .budget import Budget, vlen_string_bytes
from .reads import DerivedSketch, RefValues, RowReads, _Parts
from .schema import (
    MAX_ATTRS,
    MAX_CHUNK_BYTES,
    MAX_KEY_CHARS,
    MAX_SEQUENCES,
    MAX_SKETCH_DIM,
    MAX_TENSORS,
    MAX_BOUNDARY,
    MAX_WIDTH,
    READ_CACHE_BYTES,
    SCHEMA_REFS,
    SCHEMA_VERSION,
    SCHEMA_VERSIONS,
    TOKEN_DTYPE,
    TensorInfo,
)
from .source import TensorPart
from .summary_types import SequenceSpan, TensorEntry, TraceSummary
from .validate import (
    CHANGED,
    CHECKED,
    FileIdentity,
    attr_float,
    attr_int,
    attr_json,
    attr_str,
    check_path,
    check_sequences,
    check_tensor_name,
    check_token_table,
    check_token_values,
    check_values_ref,
    clean_text,
    encode_refs,
    follow,
    short,
    tensor_attrs,
    values_source_attr,
)

if TYPE_CHECKING:
    from typing_extensions import Self

# Chunk cache per open dataset (up to 64 stay open, per trace). Reads are whole-chunk blocks and
# one read per touched chunk, so a cache mostly costs memory: with narrow chunks a 1 MiB cache per
# dataset fills, and 64 datasets of it dominate the diff's memory; a small cache reads no slower
# (docs/benchmarks.md has the measurement).
CHUNK_CACHE_BYTES = min(READ_CACHE_BYTES, 64 << 10)

class TraceReader(RowReads):
    """Open and validate a trace. Raises :class:`~tensordiff.errors.TraceFileError` with a one-line
    reason on bad input.

    Nothing is loaded but the token table and the per-tensor row indices; values, sketches and
    RMS are read by row range or row subset on demand.

    Hostile files (docs/robustness.md): links other than hard links, virtual datasets and
    external raw storage are refused (nothing outside the file is ever opened); attributes are
    checked for shape and type before they are read and strings are bounded; every dataset's
    declared size is checked against the file size, chunk size and the token table before a
    byte of it is read. A trace that was not closed cleanly (``complete`` false) is read up to
    the rows its writer committed at its last flush, and ``recovered_note`` says how many.

    ``head``: read only the first ``head`` token rows, and of each tensor the first rows up to
    the first that points past them (a preview of a large trace: what it holds is what the
    whole trace holds for those rows, read without loading the whole token table).
    """

    f: Any
    tokens: np.ndarray
    sequences: list[str]
    tensors: dict[str, TensorInfo]
    recovered_note: str | None
    recovered: dict[str, Any]
    _rows: dict[str, np.ndarray]
    _ds: dict[str, _Parts]

    def __init__(self, path: str | os.PathLike[str], *, progress: Callable[[int, int], None] | None = None,
                 head: int | None = None):
        self.path = os.fspath(path)
        self._progress = progress
        self._head = head
        self.identity = check_path(self.path)
        self.file_size = self.identity.size
        checked = CHECKED.get(os.path.abspath(self.path))
        if checked is not None and checked != self.identity:
            raise TraceFileError(CHANGED, self.path)
        # A writer killed inside a flush can leave metadata that points past the end-of-allocation
        # address its superblock still records (HDF5 writes the superblock last). Such a trace is
        # read through a view that raises that address to the file size, as `h5clear --increment`
        # would, without writing to the file; only interrupted recordings are read this way.
        self.repaired = False
        patch = None
        try:
            self._open_and_load(None)
        except TraceFileError as first:
            patch = recover.eoa_patch(self.path, self.file_size)
            if patch is None:
                raise
            try:
                self._open_and_load(patch)
            except TraceFileError:
                raise first from None
            if self.complete:
                self.close()
                raise first from None
            self.repaired = True
        else:
            if not self.complete:
                patch = recover.eoa_patch(self.path, self.file_size)
                if patch is not None:
                    # the file's end lies past that address after any kill (chunks written since
                    # the last flush); reading through the view also reaches metadata a kill
                    # inside a flush left there, which the plain open may only meet later
                    plain = (self.f, self.__dict__.copy())
                    try:
                        self._open_and_load(patch)
                        plain[0].close()
                    except TraceFileError:
                        self.__dict__.update(plain[1])
        if self.repaired and self.recovered_note:
            self.recovered_note += recover.INSIDE_A_FLUSH

    def _open_and_load(self, patch: tuple[int, bytes] | None) -> None:
        self._view: recover.PatchedView | None = None
        self._open: OrderedDict[str, Any] = OrderedDict()
        self._reset_reads()
        self._budget = Budget(self.file_size)
        try:
            if patch is None:
                self.f = h5py.File(self.path, "r", locking=False, rdcc_nbytes=CHUNK_CACHE_BYTES)
            else:
                self._view = recover.PatchedView(self.path, *patch)
                self.f = h5py.File(self._view, "r", rdcc_nbytes=CHUNK_CACHE_BYTES)
        except OSError as e:
            self._close_view()
            raise TraceFileError(f"cannot open as HDF5, the file is truncated or damaged ({short(e)})",
                                 self.path) from None
        except Exception as e:  # noqa: BLE001 - whatever a damaged superblock makes h5py raise
            self._close_view()
            raise TraceFileError(f"cannot open as HDF5, the file is damaged ({short(e)})", self.path) from None
        if self._head is not None:
            # a head's reads are few rows: through h5py, without the direct reads' table of every
            # chunk of each dataset (a walk over the whole trace)
            self._fd_direct = None
        try:
            self._same_file()
            self._load()
        except TensordiffError as e:
            self.close()
            if e.path is None:
                raise type(e)(e.reason, self.path) from None
            raise
        except MemoryError:
            self.close()
            raise TraceFileError("damaged trace (a table is too large to load)", self.path) from None
        except Exception as e:  # noqa: BLE001 - OSError, KeyError, ValueError, TypeError, RuntimeError...
            self.close()
            raise TraceFileError(f"damaged trace ({short(e)})", self.path) from None

    def _close_view(self) -> None:
        if getattr(self, "_view", None) is not None:
            with contextlib.suppress(Exception):
                self._view.close()  # type: ignore[union-attr]
            self._view = None

    def _same_file(self) -> None:
        """The file HDF5 opened is the one :func:`check_path` checked (not one renamed over the path
        since), unchanged: one file from the check to the last read."""
        try:
            fd = self._view.fileno() if self._view is not None else int(self.f.id.get_vfd_handle())
            now = FileIdentity.of(os.fstat(fd))
        except (OSError, TypeError, ValueError, AttributeError):
            return  # a driver without a descriptor: the path check stands alone
        if now != self.identity:
            raise TraceFileError(CHANGED)

    # -- loading -------------------------------------------------------------------------------

    def _load(self) -> None:
        a = self.f.attrs
        if len(a) > MAX_ATTRS:
            raise TraceFileError(f"the root group has {len(a)} attributes; not a tensordiff trace")
        if "tensordiff_schema" not in a:
            raise TraceFileError("an HDF5 file but not a tensordiff trace (no tensordiff_schema attribute)")
        schema = attr_int(a, "tensordiff_schema")
        if schema not in SCHEMA_VERSIONS:
            raise TraceFileError(f"unknown trace schema version {schema} (this tensordiff reads versions "
                                 f"{SCHEMA_VERSION} to {SCHEMA_VERSIONS[-1]}); upgrade tensordiff or re-record")
        self.schema = schema
        self.side = attr_str(a, "side", "other", budget=self._budget)
        self.producer = attr_str(a, "producer", "", budget=self._budget)[:4096]
        self.created = attr_str(a, "created", "", budget=self._budget)[:64]
        self.model = attr_json(a, "model", {}, budget=self._budget)
        self.versions = attr_json(a, "versions", {}, budget=self._budget)
        self.user_meta = attr_json(a, "user_meta", {}, budget=self._budget)
        if not isinstance(self.model, dict) or not isinstance(self.versions, dict) or not isinstance(self.user_meta, dict):
            raise TraceFileError("attributes model/versions/user_meta must be JSON objects")
        for key, most in (("hidden_size", MAX_WIDTH), ("num_layers", MAX_BOUNDARY)):
            v = self.model.get(key)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 0 < v <= most):
                raise TraceFileError(f"model {key} is {v!r}, expected a positive integer")
        self.sketch_seed = attr_int(a, "sketch_seed", default=DEFAULT_SKETCH_SEED)
        self.sketch_dim = attr_int(a, "sketch_dim", default=DEFAULT_SKETCH_DIM)
        if not 1 <= self.sketch_dim <= MAX_SKETCH_DIM:
            raise TraceFileError(f"sketch_dim {self.sketch_dim} out of range")
        self.complete = bool(attr_int(a, "complete", default=0))
        # rows the writer committed at its last flush (absent in traces of other writers)
        committed = attr_int(a, "flushed_tokens", default=-1)
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
            self.tensors, self._rows, self._ds, self._refs = {}, {}, {}, {}
            self.recovered = {"tokens": 0, "tensor_rows": {}, "dropped_tokens": 0, "dropped_tensor_rows": 0}
            self.recovered_note = recover.NOTHING_COMMITTED

    def _load_tables(self, committed: int) -> None:
        f = self.f
        tok = follow(f, "tokens", "/tokens")
        if tok is None:
            raise TraceFileError("missing the /tokens table")
        check_token_table(tok)
        n_tok = int(tok.shape[0])
        on_disk_tok = n_tok
        if self.complete and self._committed and committed != n_tok:
            raise TraceFileError(f"/tokens has {n_tok} rows but its writer committed {committed}; the file was "
                                 "truncated or modified after it was closed")
        if not self.complete and self._committed:
            n_tok = min(n_tok, committed)
        if self._head is not None:
            n_tok = min(n_tok, self._head)
        self._budget.table(tok, n_tok, "/tokens")
        self.tokens = tok[:n_tok] if n_tok else np.empty(0, tok.dtype)
        seqs = follow(f, "sequences", "/sequences")
        if seqs is None:
            raise TraceFileError("missing the /sequences list")
        check_sequences(seqs)
        if seqs.shape[0] > MAX_SEQUENCES:
            raise TraceFileError(f"/sequences has {seqs.shape[0]} entries (at most {MAX_SEQUENCES} are supported)")
        n_seq = int(seqs.shape[0])
        if not self.complete and self._committed and n_tok:
            # only the keys the committed rows use: a kill inside a flush can leave later keys
            # pointing into a heap block that never reached the file
            n_seq = min(n_seq, max(int(self.tokens["seq"].max()), -1) + 1)
        elif not self.complete and self._committed:
            n_seq = 0
        if self._head is not None:   # only the keys the head's rows use
            n_seq = min(n_seq, int(self.tokens["seq"].max()) + 1 if n_tok else 0)
        self.sequences = self._read_sequences(seqs, n_seq)
        if n_tok:
            sq = self.tokens["seq"]
            bad = (sq < 0) | (sq >= len(self.sequences))
            if bad.any():
                if self.complete or self._committed:
                    raise TraceFileError(f"/tokens has {int(bad.sum())} rows pointing outside /sequences")
                # unclean end of a writer that records no commit: keep the consistent prefix
                n_tok = int(np.argmax(bad))
                self.tokens = self.tokens[:n_tok]
            check_token_values(self.tokens)
        if self.tokens.dtype != TOKEN_DTYPE:  # other tools' layouts: normalise (step defaults to 0)
            norm = np.zeros(len(self.tokens), TOKEN_DTYPE)
            for col in TOKEN_DTYPE.names or ():
                if col in (self.tokens.dtype.names or ()):
                    norm[col] = self.tokens[col]
            self.tokens = norm

        tg = follow(f, "tensors", "/tensors")
        if tg is None or not isinstance(tg, h5py.Group):
            raise TraceFileError("missing the /tensors group")
        if len(tg) > MAX_TENSORS:
            raise TraceFileError(f"/tensors has {len(tg)} members (at most {MAX_TENSORS})")
        self._tensors_path = tg.name
        self.tensors = {}
        self._rows = {}
        self._rows_seen: dict[tuple[int, int, int, int], np.ndarray] = {}
        self._ds = {}
        self._refs = {}
        dropped = [on_disk_tok - n_tok, 0]
        total = len(tg)
        self._tick(0, total)
        for done, name in enumerate(tg):
            self._tick(done, total)
            check_tensor_name(name)
            try:
                self._load_tensor(tg, name, n_tok, dropped)
            except Exception:
                if self.complete or not self._committed or self._tensor_committed(tg, name):
                    raise
                # defined after the last commit and left unreadable by the kill: nothing of it was committed
                self.skipped.append(name)
                for d in (self.tensors, self._rows, self._ds, self._refs):
                    d.pop(name, None)
        self._resolve_refs(tg, dropped)
        if not self.complete:
            self.recovered_note = recover.recovered_note(
                n_tok, sum(t.rows for t in self.tensors.values()), len(self.tensors), committed=self._committed,
                dropped_tokens=dropped[0], dropped_tensor_rows=dropped[1], skipped=self.skipped)
        self.recovered = {"tokens": n_tok, "tensor_rows": {n: t.rows for n, t in self.tensors.items()},
                          "dropped_tokens": dropped[0], "dropped_tensor_rows": dropped[1]}

    def _tick(self, done: int, total: int) -> None:
        if self._progress is not None:
            self._progress(done, total)

    def _read_sequences(self, seqs: Any, n: int) -> list[str]:
        """The first ``n`` sequence keys, decoded only after their total length is known to fit the
        budget (from the on-disk descriptors), or in small blocks when those cannot be read."""
        if n == 0:
            return []
        if seqs.dtype.kind != "O":  # fixed-length strings: the size is the declared one
            self._budget.table(seqs, n, "/sequences")
            return [clean_text(bytes(b).decode("utf-8", "replace"))[:MAX_KEY_CHARS] for b in seqs[:n]]
        self._budget.table(seqs, n, "/sequences")  # the descriptors themselves
        total = vlen_string_bytes(seqs, n, int(self.f.id.get_create_plist().get_sizes()[0]))
        if total is not None:
            self._budget.string_bytes(total, "/sequences")
        out: list[str] = []
        block = n if total is not None else 16
        text = seqs.asstr(errors="replace")
        for start in range(0, n, block):
            part = text[start:min(n, start + block)]
            if total is None:
                self._budget.string_bytes(sum(len(x) for x in part), "/sequences")
            out.extend(clean_text(str(x))[:MAX_KEY_CHARS] for x in part)
        return out

    @staticmethod
    def _tensor_committed(tg: Any, name: str) -> bool:
        """Whether a tensor that failed to load had rows committed (then its loss is an error)."""
        try:
            return attr_int(tg[name].attrs, "flushed_rows", default=0) > 0
        except Exception:  # noqa: BLE001 - an unreadable header was never committed (see _load)
            return False

    def _load_tensor(self, tg: Any, name: str, n_tok: int, dropped: list[int]) -> None:
        where = f" of tensor {name!r}"
        g = follow(tg, name, f"tensor {name!r}")
        if not isinstance(g, h5py.Group):
            raise TraceFileError(f"tensor {name!r} is not a group")
        ga = g.attrs
        if len(ga) > MAX_ATTRS:
            raise TraceFileError(f"tensor {name!r} has {len(ga)} attributes (at most {MAX_ATTRS})")
        ta = tensor_attrs(ga, name, self._budget)
        rows_ds = follow(g, "rows", f"{name}/rows")
        if not isinstance(rows_ds, h5py.Dataset) or len(rows_ds.shape) != 1 or rows_ds.dtype.kind not in "iu":
            raise TraceFileError(f"tensor {name!r} has no valid rows index")
        dsets: dict[str, Any] = {"rows": rows_ds}
        for part, shape2 in (("values", ta.width), ("sketch", ta.slot_count * self.sketch_dim),
                             ("rms", ta.slot_count)):
            ds = follow(g, part, f"{name}/{part}")
            if ds is None:
                continue
            if not isinstance(ds, h5py.Dataset) or len(ds.shape) != 2 or ds.shape[1] != shape2:
                raise TraceFileError(f"tensor {name!r}: {part} has shape {getattr(ds, 'shape', None)}, "
                                     f"expected (rows, {shape2})")
            dt = ds.dtype
            if part == "values" and dt != storage_dtype(ta.dtype):
                raise TraceFileError(f"tensor {name!r}: values stored as {dt}, expected "
                                     f"{storage_dtype(ta.dtype)} for {ta.dtype}")
            if part != "values" and (dt.kind != "f" or dt.itemsize > 8):
                raise TraceFileError(f"tensor {name!r}: {part} is not floating point")
            dsets[part] = ds
        if "values" not in dsets and "sketch" not in dsets:
            raise TraceFileError(f"tensor {name!r} has neither values nor a sketch")
        # values by reference (schema 2): per row a source row or -1, the values dataset holds the -1 rows
        source = values_source_attr(ga, name, self._budget)
        ref_ds = follow(g, "values_ref", f"{name}/values_ref")
        if ref_ds is not None and source is None:
            raise TraceFileError(f"tensor {name!r} has a values_ref dataset but no values_source attribute")
        if source is not None:
            if self.schema < SCHEMA_REFS:
                raise TraceFileError(f"tensor {name!r} takes values by reference (values_source), a schema "
                                     f"{SCHEMA_REFS} feature, but the trace says schema {self.schema}")
            if ref_ds is None:
                raise TraceFileError(f"tensor {name!r} has a values_source but no values_ref dataset")
            check_values_ref(ref_ds, name)
            if "values" not in dsets:
                raise TraceFileError(f"tensor {name!r} takes values by reference but has no values dataset (the "
                                     "values of its own rows)")
        lengths = {p: int(d.shape[0]) for p, d in dsets.items() if not (source is not None and p == "values")}
        if ref_ds is not None:
            lengths["values_ref"] = int(ref_ds.shape[0])
        n = min(lengths.values())
        on_disk = max(lengths.values())
        committed = attr_int(ga, "flushed_rows", default=-1, where=where) if self._committed else -1
        if self.complete:
            if len(set(lengths.values())) > 1:
                raise TraceFileError(f"tensor {name!r}: datasets disagree on the row count {lengths}")
            if committed >= 0 and committed != n:
                raise TraceFileError(f"tensor {name!r} has {n} rows but its writer committed {committed}; the file "
                                     "was truncated or modified after it was closed")
        elif committed >= 0:
            n = min(n, committed)
        elif self._committed:
            n = 0  # defined after the last flush: nothing of it was committed
        if self._head is not None:
            n = min(n, self._head)
        for part, ds in dsets.items():
            if part == "rows":
                self._budget.table(ds, n, f"{name}/rows")
            else:
                self._budget.stream(ds, min(n, int(ds.shape[0])), f"{name}/{part}")
        if ref_ds is not None:
            self._budget.table(ref_ds, n, f"{name}/values_ref")
        rows = np.empty(n, np.int64)
        if n and n == lengths["rows"]:   # the whole index, converted by HDF5 into one int64 buffer
            rows_ds.id.read(h5s.ALL, h5s.ALL, rows, dxpl=rows_ds._dxpl)
        elif n:
            rows_ds.read_direct(rows, np.s_[0:n])
        if n and (rows.min() < 0 or rows.max() >= n_tok):
            if self.complete and self._head is None:
                raise TraceFileError(f"tensor {name!r}: row indices point outside the token table")
            good = (rows >= 0) & (rows < n_tok)
            n = int(np.argmin(good)) if not good.all() else n
            rows = rows[:n]
        if ref_ds is not None:
            assert source is not None
            ref = np.empty(n, np.int64)
            if n:
                ref_ds.read_direct(ref, np.s_[0:n])
            enc = encode_refs(ref, int(dsets["values"].shape[0]), name, exact=self.complete and self._head is None)
            n = len(enc)
            rows = rows[:n]
            self._refs[name] = (source, enc)
        dropped[1] += on_disk - n
        self._rows[name] = self._shared_rows(rows)
        # each object has one name (follow checked): its path is the one it was opened by
        prefix = f"{self._tensors_path}/{name}/"
        paths = {part: prefix + part for part in dsets}
        if ref_ds is not None:
            paths["values_ref"] = prefix + "values_ref"   # (loaded at open; listed for the probe's walk)
        # a tensor with values but no sketch: its sketch is derived from the values on read (one row
        # of it must fit a chunk's bound, as a stored sketch's must)
        derived = ("values" in dsets and "sketch" not in dsets
                   and ta.slot_count * self.sketch_dim * 4 <= MAX_CHUNK_BYTES)
        virtual: dict[str, Callable[[], Any]] = {}
        if derived:
            virtual["sketch"] = lambda: DerivedSketch(self, name, self.tensors[name], self.sketch_dim, self.sketch_seed)
        if source is not None:
            virtual["values"] = lambda: self._ref_values(name)
        self._ds[name] = _Parts(self, paths, virtual)
        user_attrs = {}
        for k2 in ga:
            if k2.startswith("user."):
                user_attrs[clean_text(k2[5:])] = attr_json(ga, k2, None, where, self._budget)
        self.tensors[name] = TensorInfo(
            name=name, kind=ta.kind, dtype=ta.dtype, width=ta.width, rows=n, slot_count=ta.slot_count,
            slot_width=ta.slot_width, slot_labels=ta.slot_labels, raw_ids=ta.raw_ids,
            convention=attr_str(ga, "convention", "", where, self._budget)[:256] or None,
            order=attr_float(ga, "order", 0.0, where), token_offset=ta.token_offset,
            role=attr_str(ga, "role", "", where, self._budget)[:256], has_values="values" in dsets,
            has_sketch="sketch" in dsets or derived, boundary=ta.boundary, attrs=user_attrs, sketch_derived=derived,
            values_source=source,
        )
        for part, ds in dsets.items():   # open for the reads that follow (at most OPEN_DATASETS stay open)
            if part != "rows":
                self._keep_open(paths[part], ds)

    def _resolve_refs(self, tg: Any, dropped: list[int]) -> None:
        """Check every tensor with values by reference against its source, once all are loaded: the
        source is a tensor of this trace that holds its values (no chains), of the same width, dtype
        and slots, and every reference is one of its rows. A complete trace with a reference past
        the source's rows is refused; a recovered one keeps the rows up to the first such."""
        for name, (source, enc) in list(self._refs.items()):
            info = self.tensors.get(name)
            if info is None:
                continue
            try:
                src = self.tensors.get(source)
                n_src = 0
                if src is None:
                    if self.complete and self._head is None:
                        raise TraceFileError(f"tensor {name!r}: its values_source {source!r} is not a tensor of this trace")
                else:
                    if source in self._refs:
                        raise TraceFileError(f"tensor {name!r}: its values_source {source!r} takes its values by reference "
                                             "too; a source must hold its values")
                    if not src.has_values:
                        raise TraceFileError(f"tensor {name!r}: its values_source {source!r} has no values")
                    if (src.width, src.dtype, src.slot_count, src.slot_width) != (
                            info.width, info.dtype, info.slot_count, info.slot_width):
                        raise TraceFileError(
                            f"tensor {name!r}: its values_source {source!r} is {src.dtype} of width {src.width} "
                            f"({src.slot_count} x {src.slot_width}), not {info.dtype} of width {info.width} "
                            f"({info.slot_count} x {info.slot_width}) like it")
                    n_src = src.rows
            except TraceFileError:
                if self.complete or not self._committed or self._tensor_committed(tg, name):
                    raise
                self.skipped.append(name)   # defined after the last commit: nothing of it was committed
                for d in (self.tensors, self._rows, self._ds, self._refs):
                    d.pop(name, None)
                continue
            past = enc >= n_src
            if past.any():
                if self.complete and self._head is None:
                    raise TraceFileError(f"tensor {name!r}: values_ref points at row {int(enc[past][0])} of {source!r}, "
                                         f"which has {n_src} rows")
                n = int(np.argmax(past))   # recovered: the rows whose references resolve
                dropped[1] += info.rows - n
                info.rows = n
                self._rows[name] = self._rows[name][:n]
                self._refs[name] = (source, enc[:n])

    def _ref_values(self, name: str) -> RefValues:
        """The values part of a tensor with values by reference (made on first use)."""
        source, enc = self._refs[name]
        own = self._ds[name].stored()["values"]
        ds = self._dataset(own)
        return RefValues(self, name, own, source, enc, ds.shape[1], ds.dtype, ds.chunks)

    def _shared_rows(self, rows: np.ndarray) -> np.ndarray:
        """One array for equal row indexes: the tensors of a trace usually cover the same token
        rows, and 8 bytes per row per tensor would make memory grow with the tensor count."""
        seen = self._rows_seen
        n = len(rows)
        key = (n, int(rows[0]) if n else -1, int(rows[-1]) if n else -1, int(rows[n // 2]) if n else -1)
        prev = seen.get(key)
        if prev is not None and np.array_equal(prev, rows):
            return prev
        rows.flags.writeable = False
        seen[key] = rows
        return rows

    # -- accessors -----------------------------------------------------------------------------

    @property
    def hidden_size(self) -> int | None:
        h = self.model.get("hidden_size")
        return int(h) if isinstance(h, (int, float)) else None

    @property
    def num_layers(self) -> int | None:
        n = self.model.get("num_layers")
        return int(n) if isinstance(n, (int, float)) else None

    def summary(self) -> TraceSummary:
        """Everything ``tensordiff info`` shows, as plain data."""
        return trace_summary(self)

    def part(self, name: str, kind: str) -> TensorPart:
        """Part ``kind`` of tensor ``name``: its shape (the rows this trace reads of it: a recovered
        trace's committed ones), dtype and reads."""
        ds = self._stored(name, kind)
        rows = self.tensors[name].rows
        return TensorPart(name, kind, (rows, *(int(x) for x in ds.shape[1:])), np.dtype(ds.dtype), self)

    def close(self) -> None:
        with contextlib.suppress(Exception):  # closing a damaged file must not mask the real error
            self.f.close()
        self._open = OrderedDict()
        self._close_view()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def trace_summary(trace: Any) -> TraceSummary:
    """What ``tensordiff info`` shows of an open trace, as plain data: of a :class:`TraceReader`, or
    of anything with the same attributes (a trace set's merged view)."""
    t = trace.tokens
    regimes, seqs = token_summary(t, trace.sequences)
    return {
        "path": trace.path, "schema": trace.schema, "side": trace.side, "producer": trace.producer,
        "created": trace.created, "complete": trace.complete, "recovered": trace.recovered_note,
        "model": trace.model, "versions": trace.versions, "user_meta": trace.user_meta,
        "sketch": {"seed": trace.sketch_seed, "dim": trace.sketch_dim},
        "tokens": {"rows": len(t), "sequences": len(trace.sequences), "regimes": regimes},
        "sequences": seqs, "tensors": tensor_entries(trace.tensors),
    }


def token_summary(tokens: np.ndarray, sequences: Sequence[str]) -> tuple[dict[str, int], list[SequenceSpan]]:
    """Token rows per regime, and each sequence's rows and position range (the first 1000)."""
    t = tokens
    regimes = {REGIMES[c]: int(n) for c, n in zip(*np.unique(t["regime"], return_counts=True))} if len(t) else {}
    seqs: list[SequenceSpan] = []
    if len(t):
        order = np.argsort(t["seq"], kind="stable")
        sq = t["seq"][order]
        cuts = np.flatnonzero(np.diff(sq)) + 1
        for part in np.split(order, cuts)[:1000]:
            pos = t["position"][part]
            seqs.append({"key": sequences[int(t["seq"][part[0]])], "rows": len(part),
                         "positions": [int(pos.min()), int(pos.max())]})
    return regimes, seqs


def tensor_entries(tensors: Mapping[str, TensorInfo]) -> list[TensorEntry]:
    """The tensors as ``info`` lists them, in forward order."""
    out: list[TensorEntry] = []
    for info in sorted(tensors.values(), key=lambda i: (i.order, i.name)):
        # "values"/"sketch": what the file stores; a sketch the reader derives from the values is
        # "sketch_derived" (it reads like a stored one)
        entry: TensorEntry = {"name": info.name, "kind": info.kind, "label": info.label, "dtype": info.dtype,
                                 "shape": [info.rows, info.width], "order": info.order, "values": info.has_values,
                                 "sketch": info.stored_sketch, "role": info.role}
        if info.sketch_derived:
            entry["sketch_derived"] = True
        if info.values_source:
            entry["values_source"] = info.values_source   # rows' values by reference to that tensor
        if info.slot_count > 1 or info.slot_labels:
            entry.update({"slots": info.slot_count, "slot_width": info.slot_width, "slot_labels": info.slot_labels,
                          "raw_ids": info.raw_ids, "convention": info.convention})
        if info.token_offset:
            entry["token_offset"] = info.token_offset
        if info.attrs:
            entry["attrs"] = info.attrs
        out.append(entry)
    return out
