"""The generic torch-side recorder: name filters, token sampling, sketches computed where the
tensor lives, host copies that do not stall the model, appends through :class:`TraceWriter`.
One class: its three record paths (states, non-state rows, predictions) share its row rules,
sampling and filters. What it records with lives beside it: :mod:`.storage` (trace dtype names,
the stored form of a tensor, top-k prediction rows) and :mod:`.sampling` (:class:`Sampling`);
both are re-exported here.

Every other recorder (module hooks, the HF extractor, the importers) records through
:class:`Recorder`, so a trace gets the same sketches (one matmul with the seeded projection of
:func:`tensordiff.sketch.projection`), the same per-slot RMS and the same sampling rules whoever
wrote it.

>>> with Recorder("train.h5", side="train", model={"num_layers": 8, "hidden_size": 64}) as rec:
...     rows = rec.add_tokens("sample-0", positions=range(L), tokens=input_ids)
...     rec.boundary(3, hidden_states[3], rows)                  # catalog entry "layer3"
...     rec.packed("draft_input", [h2, h4, h6], rows_shifted,     # what the draft is fed
...                labels=["layer2", "layer4", "layer6"], raw_ids=[1, 3, 5], convention="specforge")

Where the data lives on a GPU, the sketch and RMS are computed there and the rows are copied to
pinned host memory with ``non_blocking=True``; a CUDA event marks each copy, and the rows reach
the writer once their event has completed (checked at every later call, forced at ``flush``/
``close`` or when more than ``max_pending_bytes`` wait). On the CPU the rows go to the writer
directly (the writer copies them into its chunk buffer, nothing else is copied), or, with
``stage_bytes``, are staged and written in batches (:mod:`.staging`).

Why one module of this size: the three record paths share the row rules, sampling, filters and
staging of one Recorder; the parts that stand alone already live in the modules named above.
"""

from __future__ import annotations

import collections
import fnmatch
import math
import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import h5py
import numpy as np
import torch

from .. import conventions
from ..dtypes import to_float32
from ..sketch import DEFAULT_SKETCH_DIM, DEFAULT_SKETCH_SEED, projection
from ..trace import SlotSpec, TraceWriter
from ..vocab import FINAL_NORM, boundary_label, parse_label
from .sampling import Sampling, SequenceEnds
from .staging import Later, Staged, TopkJob, compute_jobs, host_f32
from .storage import TORCH_DTYPES, logical_dtype, to_storage, topk_rows

__all__ = ["Later", "Recorder", "Sampling", "TopkJob", "autocast_dtype", "logical_dtype", "to_storage", "topk_rows"]


def no_autocast(device_type: str) -> Any:
    """A context where the recorder's own arithmetic runs in the dtypes it asks for, whatever
    ``torch.autocast`` region the user's forward (and so each hook) runs in: autocast would run
    the sketch's float32 matmul in bf16 (another sketch, and a dtype numpy cannot hold)."""
    import contextlib

    try:
        return torch.autocast(device_type, enabled=False)
    except RuntimeError:    # a device type autocast does not know: nothing to turn off
        return contextlib.nullcontext()


def autocast_dtype(device_type: str) -> str | None:
    """The dtype ``torch.autocast`` computes in on ``device_type`` where a region is in effect in
    this thread (the user's forward, so each hook in it), else None."""
    try:
        if torch.is_autocast_enabled(device_type):
            return logical_dtype(torch.get_autocast_dtype(device_type))
    except (RuntimeError, TypeError, ValueError):   # a device type autocast does not know
        return None
    return None


def autocast_attr(device_type: str, dtype: str) -> dict[str, Any]:
    """The tensor attribute (:data:`tensordiff.conventions.AUTOCAST_ATTR`) saying a state was produced
    inside an autocast region of ``dtype``: the noise model allows that dtype's rounding."""
    return {"enabled": True, "dtype": dtype, "device": device_type}


#: coarser rounding last: a tensor recorded under several autocast dtypes records the coarsest
_COARSE = {"float64": 0, "float32": 1, "float16": 2, "bfloat16": 3}


@dataclass
class _Spec:
    name: str
    width: int
    slot_width: int
    slots: int
    dtype: str
    values: bool
    sketch: bool
    plain: bool = False  # rows that are not states (Recorder.plain): values only, RMS 0
    abs_rms: bool = False  # plain, one column: its RMS is the absolute value (not 0)
    source: str | None = None  # values_source: rows may take their values from this tensor's rows
    count: int = 0       # rows recorded so far (written or staged): the index of the next row
    autocast: str | None = None  # the coarsest autocast dtype in effect while its rows were produced


@dataclass
class _Pending:
    name: str
    rows: np.ndarray
    values: torch.Tensor | None
    sketch: torch.Tensor | None
    rms: torch.Tensor
    event: Any
    nbytes: int


@dataclass
class RecorderStats:
    """What a recorder did and what it cost (seconds of wall time spent inside its calls)."""

    calls: int = 0
    rows: int = 0
    bytes_values: int = 0
    skipped_names: set = field(default_factory=set)
    seconds: float = 0.0
    wait_seconds: float = 0.0  # of which: waiting for device copies to land
    sketch_products: int = 0   # sketch matmuls computed
    sketch_reused: int = 0     # record calls whose sketch was another call's, rewritten (``reuse=``)

    def as_dict(self) -> dict:
        return {"calls": self.calls, "rows": self.rows, "bytes_values": self.bytes_values,
                "seconds": self.seconds, "wait_seconds": self.wait_seconds,
                "sketch_products": self.sketch_products, "sketch_reused": self.sketch_reused,
                "skipped_names": sorted(self.skipped_names)}


@dataclass
class _Memo:
    """The sketch of one record call, kept for a later call on the same tensor
    (``_record(..., remember=True)`` / ``_record(..., reuse=NAME)``, the serve plugins' knobs). ``tensor`` is held so that
    its storage cannot be freed and reused by another tensor with the same address; ``bits`` is a
    private copy of the float32 slot rows the sketch was computed from, because an inference
    tensor has no version counter and an in-place write can keep every row's RMS (a sign flip, a
    permutation within a row, a change below float32 rounding of the sum)."""

    tensor: torch.Tensor
    key: tuple
    idx: np.ndarray | None   # the tensor rows kept (None: all)
    slots: tuple             # (slot rows, slot width, dtype the rows were sketched in)
    sketch: Any
    bits: np.ndarray | None  # the slot rows sketched [slot rows, slot width] float32, never shared
    staged: Staged | None = None  # staging: the staged call (its private copy is the bits compared)
    private: bool = False    # staging: the call's tensor was the caller's own snapshot (nobody writes it)


# slot rows up to this many bytes (float32; with staging, in their stored form) are remembered
# for reuse; larger calls (a long prefill) are sketched (and stored) again rather than held twice
REMEMBER_MAX_BYTES = 32 << 20

# a staged tensor's values joined at a drain (its RMS and its append read them) go to a buffer kept
# for the next drain, every tensor's together up to this many bytes; other joins (a long prefill,
# many tensors) are made fresh and freed
JOIN_KEEP_BYTES = 32 << 20


def _tensor_key(t: torch.Tensor) -> tuple:
    """What identifies a tensor: its storage address, layout, dtype, device and version counter
    (bumped by every in-place write; None for inference tensors, which have none)."""
    version = None if t.is_inference() else t._version
    return (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype, t.device, version)


def _plain_rms(spec: _Spec, vals: np.ndarray) -> np.ndarray:
    """The RMS column of rows that are not states: 0, or a one-column tensor's absolute value."""
    if spec.abs_rms:
        return np.abs(vals).astype(np.float32).reshape(len(vals), 1)
    return np.zeros((len(vals), 1), dtype=np.float32)


def _bits(a: np.ndarray) -> np.ndarray:
    """``a``'s elements as unsigned integers of the same size (compares bits, NaN included)."""
    return a.view(f"u{a.dtype.itemsize}")


def _same_memory(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two arrays view the very same elements (address, shape, strides, dtype)."""
    return (a.__array_interface__["data"][0] == b.__array_interface__["data"][0] and a.shape == b.shape
            and a.strides == b.strides and a.dtype == b.dtype)


def _match(name: str, patterns: Iterable[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


class Recorder:
    """Record named torch tensors into a trace.

    trace: a path (a new :class:`TraceWriter` is opened and closed by the recorder) or an open
    ``TraceWriter`` (the caller closes it). The other arguments of the writer (``side``,
    ``producer``, ``model``, ``meta``, ``sketch_dim``, ``sketch_seed`` and anything in
    ``writer_kwargs``) apply only when a path is given. ``model`` should carry ``num_layers`` and
    ``hidden_size``: the aligner splits packed tensors by that hidden size.

    Filters, all by tensor name (``fnmatch`` globs):
      * ``include`` / ``exclude``: which tensors are recorded at all (default: all).
      * ``values``: ``None`` lets each call decide (default: full values); ``True``/``False``
        forces full values on/off for every tensor; a list of globs gives full values to the
        matching names and sketch + RMS only to the rest.
    ``sample``: a :class:`Sampling` of token positions applied to every tensor (rows must come from
    :meth:`add_tokens` of this recorder so their positions are known).
    ``sketch``: record the seeded sketch of every tensor (default True); False: only of the tensors
    that keep no full values (they need one for the identity search), since a reader derives the
    sketch of the others from their values (docs/format.md).
    ``stage_bytes``: 0 (default) computes and appends every call's rows at once. Above 0, calls on
    CPU tensors and :meth:`plain` calls are staged (checked, keyed and copied now; RMS, sketches,
    top-k jobs and appends done for all staged calls at once, :mod:`.staging`) until this many
    bytes are staged, a flush trigger of the writer is reached, or at :meth:`flush`/:meth:`close`.
    For engines that call the recorder on many small passes (the serve plugins).
    """

    def __init__(self, trace: str | os.PathLike | TraceWriter, *, side: str = "train",
                 producer: str = "tensordiff.recorders", model: dict | None = None, meta: dict | None = None,
                 include: Sequence[str] | None = None, exclude: Sequence[str] | None = None,
                 values: bool | Sequence[str] | None = None, sample: Sampling | None = None,
                 sketch: bool = True, sketch_dim: int = DEFAULT_SKETCH_DIM,
                 sketch_seed: int = DEFAULT_SKETCH_SEED, max_pending_bytes: int = 1 << 30,
                 stage_bytes: int = 0, writer_kwargs: dict | None = None):
        if isinstance(trace, TraceWriter):
            self.writer = trace
            self._owns_writer = False
        else:
            versions = {"torch": torch.__version__}
            self.writer = TraceWriter(trace, side=side, producer=producer, model=model, meta=meta,
                                      sketch_dim=sketch_dim, sketch_seed=sketch_seed, versions=versions,
                                      **(writer_kwargs or {}))
            self._owns_writer = True
        self.include = list(include) if include else None
        self.exclude = list(exclude) if exclude else []
        self.values_policy = values if isinstance(values, (bool, type(None))) else list(values)
        self.sample = sample if sample is not None else Sampling()
        self.sketch_enabled = bool(sketch)
        self.max_pending_bytes = int(max_pending_bytes)
        self.stats = RecorderStats()
        self._specs: dict[str, _Spec] = {}
        self._proj: dict[tuple, torch.Tensor] = {}
        self._memo: dict[str, _Memo] = {}                # record(remember=True) results, by name
        self._join_bufs: dict[str, np.ndarray] = {}      # staging: each tensor's drain join buffer (_join)
        self._pending: collections.deque[_Pending] = collections.deque()
        self._pending_bytes = 0
        self._positions = np.empty(1024, dtype=np.int64)
        self._ends = SequenceEnds()                      # refuses draft rows paired past a sequence's end
        self._offsets: dict[str, int] = {}               # token_offset of each defined tensor
        self._n_rows = 0
        self._closed = False
        self._labels_ok: set[tuple] = set()              # slot label lists packed() has checked
        if int(stage_bytes) < 0:
            raise ValueError("stage_bytes must be >= 0")
        self.stage_bytes = int(stage_bytes)
        self._failed: str | None = None                  # a staged batch failed to be written: refuse further calls
        self._staged: dict[str, list[Staged]] = {}       # staged calls per tensor, in call order
        self._staged_bytes = 0
        self._jobs: list[TopkJob] = []                   # top-k jobs not computed yet
        # staged rows and jobs made so far, and that count at the last token rows added: a step's
        # token rows come before its tensor rows, so token rows added with nothing staged since
        # the last ones are more rows of the same step (another regime of its batch), and the
        # staged rows of the steps before must not go out then (a flush would split this step)
        self._stage_mark = 0
        self._mark_at_tokens = 0

    # -- filters ---------------------------------------------------------------------------

    def wants(self, name: str) -> bool:
        """Whether tensor ``name`` passes the include/exclude filters."""
        if self.include is not None and not _match(name, self.include):
            return False
        return not _match(name, self.exclude)

    def _values_for(self, name: str, requested: bool | None) -> bool:
        pol = self.values_policy
        if pol is None:
            return True if requested is None else bool(requested)
        if isinstance(pol, bool):
            return pol
        return _match(name, pol)

    @property
    def model(self) -> dict:
        return self.writer.model

    @property
    def defined(self) -> list[str]:
        return list(self._specs)

    # -- tokens ----------------------------------------------------------------------------

    def add_tokens(self, seq: str, positions: Sequence[int] | np.ndarray | None = None,
                   tokens: Sequence[int] | np.ndarray | torch.Tensor | None = None,
                   regime: str | int = "train", step: int = 0) -> np.ndarray:
        """Add one sequence's token rows; returns their row indices for :meth:`record`.
        ``positions`` defaults to ``0..len(tokens)-1``."""
        self._check_failed()
        if isinstance(tokens, torch.Tensor):
            tokens = tokens.detach().reshape(-1).cpu().numpy()
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if positions is None:
            positions = np.arange(len(tokens), dtype=np.int64)
        elif isinstance(positions, torch.Tensor):
            positions = positions.detach().reshape(-1).cpu().numpy()
        positions = np.asarray(positions, dtype=np.int64).reshape(-1)
        if self._step_start() and (self._staged or self._jobs) and self.writer.flush_triggered(len(positions)):
            self.write_staged()  # the flush this add triggers then holds the staged steps whole
        rows = self.writer.add_tokens(seq, positions, tokens, regime=regime, step=step)
        end = self._n_rows + len(rows)
        if end > len(self._positions):
            grown = np.empty(max(end, 2 * len(self._positions)), dtype=np.int64)
            grown[:self._n_rows] = self._positions[:self._n_rows]
            self._positions = grown
        if len(rows) and int(rows[0]) != self._n_rows:
            raise RuntimeError("token rows were added to the writer outside this recorder; "
                               "add every token through Recorder.add_tokens")
        self._positions[self._n_rows:end] = positions
        self._ends.add(seq, self._n_rows, end, positions, regime)
        self._n_rows = end
        return rows

    def add_token_runs(self, seqs: Sequence[str], counts: Sequence[int] | np.ndarray, positions: np.ndarray,
                       tokens: np.ndarray, regime: str | int, step: int = 0) -> np.ndarray:
        """:meth:`add_tokens` for several sequences of one step at once: ``counts[i]`` rows of
        ``seqs[i]``, in order, from the concatenated ``positions`` and ``tokens``; returns every
        row index (what the calls one by one return, concatenated). One call per engine pass
        instead of one per request."""
        self._check_failed()
        positions = np.asarray(positions, dtype=np.int64).reshape(-1)
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        n = len(positions)
        if len(tokens) != n or int(np.sum(counts)) != n:
            raise ValueError(f"{n} positions, {len(tokens)} tokens and {int(np.sum(counts))} counted rows")
        if self._step_start() and (self._staged or self._jobs) and self.writer.flush_triggered(n):
            self.write_staged()  # the flush these adds may trigger then holds the staged steps whole
        start = self._n_rows
        out = np.empty(n, dtype=np.int64)
        add = self.writer.add_tokens
        off = 0
        for seq, c in zip(seqs, counts):
            c = int(c)
            if c:
                out[off:off + c] = add(seq, positions[off:off + c], tokens[off:off + c], regime=regime, step=step)
                off += c
        end = start + n
        if n and (int(out[0]) != start or int(out[-1]) != end - 1):
            raise RuntimeError("token rows were added to the writer outside this recorder; "
                               "add every token through Recorder.add_tokens")
        if end > len(self._positions):
            grown = np.empty(max(end, 2 * len(self._positions)), dtype=np.int64)
            grown[:start] = self._positions[:start]
            self._positions = grown
        self._positions[start:end] = positions
        if regime == "train" or not isinstance(regime, str):  # train rows: each sequence's end is kept
            off = 0
            for seq, c in zip(seqs, counts):
                c = int(c)
                self._ends.add(seq, start + off, start + off + c, positions[off:off + c], regime)
                off += c
        else:
            self._ends.add("", start, end, positions, regime)
        self._n_rows = end
        return out

    def _check_pairs(self, name: str, rows: np.ndarray, keep: np.ndarray, token_offset: int) -> None:
        """Refuse rows ``rows[keep]`` paired past their train sequence's end (:class:`SequenceEnds`);
        nothing to check at offset 0 or before any train sequence was added."""
        if token_offset <= 0 or not self._ends.index:
            return
        rows = rows[keep]
        if rows.size and int(rows.max()) < self._n_rows:
            self._ends.check(name, rows, self._positions, token_offset)

    def positions_of(self, rows: np.ndarray) -> np.ndarray:
        rows = np.asarray(rows, dtype=np.int64)
        if rows.size and rows.max() >= self._n_rows:
            raise ValueError("rows were not added through this recorder's add_tokens; positions unknown")
        return self._positions[rows]

    # -- definitions -----------------------------------------------------------------------

    def define(self, name: str, width: int, *, dtype: str = "float32", kind: str = "other",
               boundary: int | None = None, slots: SlotSpec | None = None, slot_width: int | None = None,
               token_offset: int = 0, role: str = "", values: bool | None = None,
               order: float | None = None, attrs: dict | None = None, values_source: str | None = None) -> bool:
        """Declare a tensor (``record`` does it on first use). Returns False when filtered out.
        ``values_source``: a tensor whose rows this one's rows may take their values from
        (:meth:`_record`'s ``reuse``, with staging; the writer's ``values_source``)."""
        if name in self._specs:
            return True
        if not self.wants(name):
            self.stats.skipped_names.add(name)
            return False
        vals = self._values_for(name, values)
        sk = self.sketch_enabled or not vals
        if kind == "packed":
            sw = int(slot_width or self.writer.hidden_size or 0)
        else:
            sw = int(width)
        src = self._specs.get(values_source) if values_source is not None else None
        if src is None or not (vals and src.values and src.source is None and not src.plain
                               and (src.width, src.dtype, src.slot_width) == (int(width), dtype, sw)):
            values_source = None  # nothing to take values from: every row stores its own
        self.writer.define_tensor(name, width, kind=kind, dtype=dtype, boundary=boundary, slots=slots,
                                  slot_width=sw if kind == "packed" else None, order=order,
                                  token_offset=token_offset, role=role, values=vals, sketch=sk, attrs=attrs,
                                  values_source=values_source)
        self._specs[name] = _Spec(name, int(width), sw, int(width) // sw, dtype, vals, sk, source=values_source)
        self._offsets[name] = int(token_offset)
        return True

    # -- recording -------------------------------------------------------------------------

    def _projection(self, width: int, device: torch.device) -> torch.Tensor:
        key = (width, str(device))
        r = self._proj.get(key)
        if r is None:
            r = torch.from_numpy(np.array(projection(width, self.writer.sketch_dim, self.writer.sketch_seed)))
            r = r.to(device)
            self._proj[key] = r
        return r

    def record(self, name: str, tensor: torch.Tensor, rows: np.ndarray | Sequence[int], *,
               kind: str = "other", boundary: int | None = None, slots: SlotSpec | None = None,
               slot_width: int | None = None, token_offset: int = 0, role: str = "",
               values: bool | None = None, order: float | None = None, attrs: dict | None = None) -> int:
        """Record ``tensor`` [..., width] whose leading dims flatten to one row per entry of
        ``rows`` (same shape as the leading dims; a row of -1 is padding and is skipped).
        The first call defines the tensor with the given kind/slots/role. Returns rows recorded."""
        return self._record(name, tensor, rows, kind=kind, boundary=boundary, slots=slots, slot_width=slot_width,
                            token_offset=token_offset, role=role, values=values, order=order, attrs=attrs)

    def _record(self, name: str, tensor: torch.Tensor, rows: np.ndarray | Sequence[int], *,
                kind: str = "other", boundary: int | None = None, slots: SlotSpec | None = None,
                slot_width: int | None = None, token_offset: int = 0, role: str = "",
                values: bool | None = None, order: float | None = None, attrs: dict | None = None,
                remember: bool = False, reuse: str | None = None, private: bool = False) -> int:
        """:meth:`record` with the serve plugins' speed knobs, which only they use (through
        :mod:`tensordiff.recorders.serving`); what is written is the same with or without them.

        ``remember=True`` (CPU tensors, slot rows up to :data:`REMEMBER_MAX_BYTES`) keeps this
        call's sketch, a private copy of the rows it sketched and a reference to ``tensor`` until
        the next call that names it in ``reuse`` or remembers under the same name again.
        ``reuse=NAME``: when ``tensor`` is the very tensor last remembered under NAME (same
        storage, layout, dtype and version counter), the same tensor rows are kept, sliced into the
        same slots, and every bit of those rows equals the remembered copy, that call's sketch is
        written again instead of being computed again (the same bits: the same product of the same
        rows); otherwise it is computed. Values are always written.

        ``private=True``: ``tensor`` is the caller's own copy, which nobody writes to any more (a
        snapshot): staging keeps it as it is instead of copying it again."""
        if not self._accepts(name):
            return 0
        t0 = time.perf_counter()
        memo = self._memo.pop(reuse, None) if reuse is not None else None
        if remember:
            self._memo.pop(name, None)
        src = tensor
        x = tensor.detach()
        if x.ndim == 0:
            raise ValueError(f"{name}: a scalar is not a recordable state")
        width = int(x.shape[-1])
        x = x.reshape(-1, width)
        rows = np.asarray(rows, dtype=np.int64).reshape(-1)
        if len(rows) != x.shape[0]:
            raise ValueError(f"{name}: {x.shape[0]} tensor rows but {len(rows)} token rows")
        keep = rows >= 0
        self._check_pairs(name, rows, keep, self._offsets.get(name, token_offset))
        if not self.sample.keeps_all:
            keep &= self.sample.mask(self.positions_of(np.where(keep, rows, 0)))
        staged = self.stage_bytes > 0 and x.device.type == "cpu"
        # the forward's autocast region, read here in its own thread before the recorder's own
        # arithmetic turns it off: the stored dtype says how a state is kept, not how it was computed
        ac = autocast_dtype(x.device.type)
        new = name not in self._specs
        if new and not self.define(
                name, width, dtype=logical_dtype(x.dtype), kind=kind, boundary=boundary, slots=slots,
                slot_width=slot_width, token_offset=token_offset, role=role, values=values, order=order,
                attrs=attrs if ac is None else {**(attrs or {}), conventions.AUTOCAST_ATTR: autocast_attr(x.device.type, ac)},
                values_source=reuse if staged else None):
            return 0
        spec = self._specs[name]
        if width != spec.width:
            raise ValueError(f"{name}: width {width}, but it was defined with width {spec.width}")
        if ac is not None and ac != spec.autocast:
            self._note_autocast(name, spec, x.device.type, ac, written=new)
        if staged:
            n = self._stage(name, spec, src, x, rows, keep, memo, remember, reuse, private)
            if n:
                self.stats.calls += 1
                self.stats.rows += n
                self.stats.bytes_values += n * width * TORCH_DTYPES[spec.dtype].itemsize if spec.values else 0
            self.stats.seconds += time.perf_counter() - t0
            return n
        idx = None
        private = False    # x no longer shares memory with ``tensor``
        if not keep.all():
            idx = np.flatnonzero(keep)
            rows = rows[idx]
            x = x.index_select(0, torch.from_numpy(idx).to(x.device))
            private = True
        n = len(rows)
        if n == 0:
            self.stats.seconds += time.perf_counter() - t0
            return 0
        want_dtype = TORCH_DTYPES[spec.dtype]
        if x.dtype != want_dtype:
            x = x.to(want_dtype)
            private = True
        xf = x if x.dtype == torch.float32 else x.float()
        private = private or xf is not x
        x2 = xf.reshape(n * spec.slots, spec.slot_width)  # one row per (token, slot)
        slots = (n * spec.slots, spec.slot_width, want_dtype)
        cpu = x.device.type == "cpu"
        key = _tensor_key(src) if cpu and (memo is not None or remember) else None
        rms = None
        if cpu:
            xn = x2.numpy()
            rms = np.sqrt(np.einsum("ij,ij->i", xn, xn) / np.float32(spec.slot_width)).reshape(n, -1)
        # the sketch of the remembered call, when this is the same tensor, the same rows of it and
        # the same bits in them (compared with the remembered copy: inference tensors have no
        # version counter, and numpy views or kernels write without bumping one)
        same = (memo is not None and key is not None and memo.key == key and memo.slots == slots
                and memo.sketch is not None
                and (memo.idx is None if idx is None else memo.idx is not None and np.array_equal(memo.idx, idx))
                and np.array_equal(memo.bits.view(np.uint32), xn.view(np.uint32)))
        sk = None
        if same and spec.sketch:
            sk = memo.sketch
            self.stats.sketch_reused += 1
        elif spec.sketch:  # one matmul with the seeded projection, where the data lives
            with no_autocast(x.device.type):
                sk = torch.mm(x2, self._projection(spec.slot_width, x.device)).reshape(n, -1)
            self.stats.sketch_products += 1
        vals = x if spec.values else None
        nbytes = (n * width * x.element_size() if vals is not None else 0)
        if x.device.type == "cuda":
            rms = torch.linalg.vector_norm(x2, dim=-1).mul_(1.0 / math.sqrt(spec.slot_width)).reshape(n, -1)
            self._submit_async(name, rows, vals, sk, rms, x.device, nbytes)
        else:
            if not cpu:  # other accelerators: a plain synchronous copy
                x2, sk = x2.cpu(), (sk.cpu() if sk is not None else None)
                vals = vals.cpu() if vals is not None else None
                xn = x2.numpy()
                rms = np.sqrt(np.einsum("ij,ij->i", xn, xn) / np.float32(spec.slot_width)).reshape(n, -1)
            self.writer.append(name, rows, to_storage(vals) if vals is not None else None,
                               sketch=sk.numpy() if sk is not None else None, rms=rms)
        if remember and key is not None and sk is not None and xn.nbytes <= REMEMBER_MAX_BYTES:
            self._memo[name] = _Memo(src, key, idx, slots, sk, xn if private else xn.copy())
        spec.count += n
        self.stats.calls += 1
        self.stats.rows += n
        self.stats.bytes_values += nbytes
        self.stats.seconds += time.perf_counter() - t0
        return n

    def _note_autocast(self, name: str, spec: _Spec, device_type: str, dtype: str, *, written: bool) -> None:
        """Keep the coarsest autocast dtype a tensor's rows were produced under in its attribute
        (``written``: the definition just wrote it; a later forward may run in another region)."""
        if spec.autocast is not None and _COARSE.get(dtype, 0) <= _COARSE.get(spec.autocast, 0):
            return
        spec.autocast = dtype
        if not written:
            self.writer.set_attr(name, conventions.AUTOCAST_ATTR, autocast_attr(device_type, dtype))

    # -- staging (stage_bytes > 0) -----------------------------------------------------------

    def _stage(self, name: str, spec: _Spec, src: torch.Tensor, x: torch.Tensor, rows: np.ndarray,
               keep: np.ndarray, memo: _Memo | None, remember: bool, reuse: str | None, private: bool) -> int:
        """Stage the kept rows (``keep``) of one record call's CPU tensor ``x`` [n, width]: a
        private copy in the stored form (rows picked with numpy: no torch op, no thread pool), or,
        when they are the very bits of the remembered call ``memo`` (same tensor, same rows, every
        bit equal), that call's copy, whose RMS and sketch are reused, and whose rows this call's
        rows take their values from where the tensor was defined with that call's tensor as its
        ``values_source`` (the trace stores them once). Returns the rows staged."""
        want = TORCH_DTYPES[spec.dtype]
        owned = private  # data shares no memory with a tensor the engine may still write
        if x.dtype != want:
            x = x.to(want)
            owned = True
        elif not x.is_contiguous():
            x = x.contiguous()
            owned = True
        data = to_storage(x)  # a view of x
        idx = None
        if not keep.all():
            idx = np.flatnonzero(keep)
            rows = rows[idx]
        else:
            rows = rows.copy()  # the caller's array: it may change before the rows are written
        if not len(rows):
            return 0
        key = _tensor_key(src) if memo is not None or remember else None
        layout = (spec.slots, spec.slot_width, spec.dtype)
        same = None
        if memo is not None and memo.staged is not None and memo.key == key and memo.slots == layout:
            old = memo.staged.data
            if (old is not None and old.dtype == data.dtype
                    and (memo.idx is None if idx is None else memo.idx is not None and np.array_equal(memo.idx, idx))):
                if memo.private and private and memo.tensor is src and old.shape == (len(rows),) + data.shape[1:]:
                    # the very snapshot the remembered call staged these rows of (the same object,
                    # which nobody writes: both callers said so), in the same stored form: the same
                    # bits, with no copy to compare
                    same = memo.staged
                else:
                    picked = data[idx] if idx is not None else data
                    if old.shape == picked.shape and (
                            # the staged copy itself (a private snapshot, kept as it is: nobody writes
                            # it), or every bit equal
                            _same_memory(old, picked) or np.array_equal(_bits(old), _bits(picked))):
                        same = memo.staged
        if same is None and idx is not None:
            data = data[idx]
            owned = True
        if same is not None:
            entry = Staged(rows, data=same.data, same=same)
            if spec.source is not None and spec.source == reuse:
                entry.ref = np.arange(same.first, same.first + len(rows), dtype=np.int64)
        else:
            entry = Staged(rows, data=data if owned else data.copy())
        entry.first = spec.count
        spec.count += len(rows)
        if remember and entry.data is not None and entry.data.nbytes <= REMEMBER_MAX_BYTES:
            self._memo[name] = _Memo(src, key or _tensor_key(src), idx, layout, None, None, staged=entry,
                                     private=private)
        self._stage_entry(name, entry)
        return len(rows)

    def _step_start(self) -> bool:
        """Whether token rows added now start a step: tensor rows were staged or written since
        the last ones."""
        start = self._stage_mark != self._mark_at_tokens or self.writer.tensor_rows_since_tokens
        self._mark_at_tokens = self._stage_mark
        return start

    def _stage_entry(self, name: str, entry: Staged) -> None:
        self._stage_mark += 1
        self._staged.setdefault(name, []).append(entry)
        self._staged_bytes += entry.nbytes
        if self._staged_bytes > self.stage_bytes:
            self._drain_staged()

    def _drain_staged(self) -> None:
        """Everything staged to the writer: the pending top-k jobs (one batch per group), the
        RMS and sketch of every staged state (one product per tensor; a call that repeats a
        remembered call's bits takes that call's), then one append per tensor. A failure leaves
        the recorder refusing further calls (rows counted as staged were not written)."""
        self._check_failed()
        try:
            self._write_staged_batch()
        except BaseException as e:
            self._failed = f"{type(e).__name__}: {e}"[:300]
            self._staged.clear()
            self._jobs.clear()
            self._memo.clear()
            raise

    def _write_staged_batch(self) -> None:
        if self._jobs:
            compute_jobs(self._jobs)
        staged, self._staged = self._staged, {}
        self._staged_bytes = 0
        if not staged:
            return
        joined: dict[str, np.ndarray] = {}  # a tensor's values, every entry's, joined once for the RMS and the append
        for name, entries in staged.items():  # states with bits of their own
            spec = self._specs[name]
            if not spec.plain:
                fresh = [e for e in entries if e.same is None]
                data = self._derive(spec, fresh)
                if data is not None and len(fresh) == len(entries):
                    joined[name] = data
        for name, entries in staged.items():  # states that repeat a remembered call's bits
            spec = self._specs[name]
            if spec.plain:
                continue
            again = []
            for e in entries:
                if e.same is None:
                    continue
                src = e.same
                while src.rms is None and src.same is not None:
                    src = src.same
                if src.rms is None or (spec.sketch and src.sketch is None):
                    again.append(e)
                    continue
                e.rms = src.rms
                if spec.sketch:
                    e.sketch = src.sketch
                    self.stats.sketch_reused += 1
            self._derive(spec, again)
        # a tensor whose rows refer to a source tensor's rows is appended after that source: the
        # batch may have staged the referring rows first (a drafter pass between two target steps)
        for name, entries in sorted(staged.items(), key=lambda kv: self._specs[kv[0]].source is not None):
            self._append_staged(name, self._specs[name], entries, joined.get(name))

    def _derive(self, spec: _Spec, entries: list[Staged]) -> np.ndarray | None:
        """RMS (and the sketch, where the tensor has one) of staged states, one product for all.
        Returns their values joined in order (None: no entries), which the append takes as they are
        (no second copy of a drain's values)."""
        if not entries:
            return None
        data = entries[0].data if len(entries) == 1 else self._join(spec.name, [e.data for e in entries])  # type: ignore[misc]
        assert data is not None
        n = len(data)
        x2 = to_float32(data, spec.dtype).reshape(n * spec.slots, spec.slot_width)
        rms = np.sqrt(np.einsum("ij,ij->i", x2, x2) / np.float32(spec.slot_width)).reshape(n, -1)
        sk = None
        if spec.sketch:
            if not x2.flags.writeable:
                x2 = x2.copy()
            with no_autocast("cpu"):
                sk = torch.mm(torch.from_numpy(x2), self._projection(spec.slot_width, torch.device("cpu"))).numpy()
            sk = sk.reshape(n, -1)
            self.stats.sketch_products += 1
        start = 0
        for e in entries:
            m = len(e.rows)
            e.rms = rms[start:start + m]
            e.sketch = sk[start:start + m] if sk is not None else None
            start += m
        return data

    def _join(self, name: str, parts: list[np.ndarray]) -> np.ndarray:
        """``parts`` joined in order, in a buffer of the tensor's kept from one drain to the next
        (every tensor's together up to :data:`JOIN_KEEP_BYTES`): a fresh array of that size costs
        the kernel a page fault and a zeroed page per 4 KB, several times the copy itself. What a
        drain joins is read by its RMS and its append only (the writer copies the rows or writes
        them out before the append returns), so the next drain may write over it."""
        dtype = parts[0].dtype
        if any(p.dtype != dtype for p in parts):
            return np.concatenate(parts)
        n = sum(len(p) for p in parts)
        shape = (n,) + parts[0].shape[1:]
        buf = self._join_bufs.get(name)
        if buf is None or buf.dtype != dtype or buf.shape[1:] != shape[1:] or len(buf) < n:
            kept = sum(b.nbytes for k, b in self._join_bufs.items() if k != name)
            row = dtype.itemsize * int(np.prod(shape[1:], dtype=np.int64))
            grown = max(n, 2 * len(buf)) if buf is not None and buf.shape[1:] == shape[1:] else n
            self._join_bufs.pop(name, None)
            if kept + grown * row > JOIN_KEEP_BYTES:
                grown = n
            if kept + grown * row > JOIN_KEEP_BYTES:  # every tensor's buffers together stay within the bound
                return np.concatenate(parts)
            buf = self._join_bufs[name] = np.empty((grown,) + shape[1:], dtype=dtype)
        return np.concatenate(parts, out=buf[:n])

    def _append_staged(self, name: str, spec: _Spec, entries: list[Staged], joined: np.ndarray | None = None) -> None:
        """One append of a tensor's staged entries; ``joined``: their values already joined in
        order (:meth:`_derive`'s), or None."""
        rows = entries[0].rows if len(entries) == 1 else np.concatenate([e.rows for e in entries])

        def cat(parts: list[np.ndarray]) -> np.ndarray:
            return parts[0] if len(parts) == 1 else np.concatenate(parts)

        if spec.plain:
            vals = cat([e.plain.value()[e.keep] if e.keep is not None else e.plain.value()
                        if isinstance(e.plain, Later) else e.plain for e in entries])
            if vals.shape != (len(rows), spec.width):
                raise ValueError(f"{name}: a staged table of shape {vals.shape} for {len(rows)} rows of width {spec.width}")
            self.writer.append(name, rows, vals.astype(np.float32 if spec.dtype == "float32" else np.float64, copy=False),
                               rms=_plain_rms(spec, vals))
            return
        sk = cat([e.sketch for e in entries]) if spec.sketch else None  # type: ignore[misc]
        rms = cat([e.rms for e in entries])  # type: ignore[misc]
        if spec.source is not None:  # rows that repeat a source row's bits refer to it; the others hold theirs
            own = [e.data for e in entries if e.ref is None]
            ref = cat([e.ref if e.ref is not None else np.full(len(e.rows), -1, dtype=np.int64) for e in entries])
            self.writer.append(name, rows, cat(own) if own else None, values_ref=ref,  # type: ignore[arg-type]
                               sketch=sk, rms=rms)
            return
        vals = (joined if joined is not None else cat([e.data for e in entries])) if spec.values else None  # type: ignore[misc]
        self.writer.append(name, rows, vals, sketch=sk, rms=rms)

    def topk_job(self, k: int, *, logits: torch.Tensor | None = None, hidden: torch.Tensor | None = None,
                 head: tuple | None = None, id_map: torch.Tensor | None = None,
                 rows: np.ndarray | None = None, private: bool = False) -> TopkJob:
        """A :class:`~tensordiff.recorders.staging.TopkJob` for the rows ``rows`` (None: all) of
        ``logits`` [n, V] (or of ``hidden`` [n, H] times ``head``): with staging on and the data
        on the CPU, the table is computed with every other pending job of its group at the next
        drain (or when first read), from a private float32 copy (the engine may reuse or overwrite
        its own tensor before that; ``private=True``: the caller's own float32 copy, kept as it
        is); otherwise it is computed now."""
        self._check_failed()
        src = logits if logits is not None else hidden
        if src is None:
            raise ValueError("topk_job needs logits or hidden")
        x = src.detach().reshape(-1, src.shape[-1])
        later = self.stage_bytes > 0 and x.device.type == "cpu"
        if later and not (private and rows is None and x.dtype == torch.float32 and x.is_contiguous()):
            x = host_f32(x, rows)
        elif rows is not None:
            x = x.index_select(0, torch.from_numpy(np.asarray(rows, dtype=np.int64)).to(x.device))
        job = TopkJob(k, logits=x if logits is not None else None, hidden=x if logits is None else None, head=head,
                      id_map=id_map, pending=self._jobs if later else None)
        if not later:
            _ = job.table  # computed now
        else:
            self._stage_mark += 1
            self._staged_bytes += job.nbytes
            if self._staged_bytes > self.stage_bytes:
                self.write_staged()
        return job

    def _submit_async(self, name, rows, vals, sk, rms, device, nbytes) -> None:
        def host(t):
            if t is None:
                return None
            h = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
            h.copy_(t, non_blocking=True)
            return h
        hv, hs, hr = host(vals), host(sk), host(rms)
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(device))
        self._pending.append(_Pending(name, rows, hv, hs, hr, ev, nbytes + rms.numel() * 4))
        self._pending_bytes += self._pending[-1].nbytes
        if self._pending_bytes > self.max_pending_bytes:
            self._drain(until_bytes=self.max_pending_bytes // 2)
        else:
            self._drain()

    def _drain(self, until_bytes: int | None = None) -> None:
        """Hand finished device copies to the writer, in order. ``until_bytes``: also wait for
        copies still in flight until at most that many bytes are pending (0: all)."""
        while self._pending:
            p = self._pending[0]
            if not p.event.query():
                if until_bytes is None or self._pending_bytes <= until_bytes:
                    return
                t0 = time.perf_counter()
                p.event.synchronize()
                self.stats.wait_seconds += time.perf_counter() - t0
            self._pending.popleft()
            self._pending_bytes -= p.nbytes
            self.writer.append(p.name, p.rows, to_storage(p.values) if p.values is not None else None,
                               sketch=p.sketch.numpy() if p.sketch is not None else None, rms=p.rms.numpy())

    # -- vocabulary helpers ----------------------------------------------------------------

    def boundary(self, b: int, tensor: torch.Tensor, rows, *, role: str = "catalog",
                 values: bool | None = None, name: str | None = None, attrs: dict | None = None) -> int:
        """Record boundary ``b`` (the residual stream entering decoder layer b, PRE-norm even for
        b = N) under its label (``embed``, ``layer<b>``)."""
        return self.record(name or boundary_label(b), tensor, rows, kind="boundary", boundary=int(b),
                           role=role, values=values, attrs=attrs)

    def final_norm(self, tensor: torch.Tensor, rows, *, role: str = "catalog", values: bool | None = None,
                   name: str = FINAL_NORM, attrs: dict | None = None) -> int:
        """Record the post-final-norm state (the lm_head input) as ``final_norm``."""
        return self.record(name, tensor, rows, kind="final_norm", role=role, values=values, attrs=attrs)

    def packed(self, name: str, parts: torch.Tensor | Sequence[torch.Tensor], rows, *, labels: Sequence[str],
               raw_ids: Sequence[int] | None = None, convention: str | None = None, token_offset: int = 1,
               role: str = "draft_input", values: bool | None = None, attrs: dict | None = None) -> int:
        """Record a packed tensor: either the list of states a pipeline passes to its
        ``torch.cat(..., dim=-1)`` or the concatenated tensor itself. ``labels`` state what each slot
        holds (``embed``, ``layer<b>``, ``final_norm``); ``raw_ids`` and ``convention`` are the
        configured ids and the convention that turned them into those labels. ``token_offset=1``:
        row t (state at position t) is paired with token t+1, as a draft's input is."""
        return self._packed(name, parts, rows, labels=labels, raw_ids=raw_ids, convention=convention,
                            token_offset=token_offset, role=role, values=values, attrs=attrs)

    def _packed(self, name: str, parts: torch.Tensor | Sequence[torch.Tensor], rows, *, labels: Sequence[str],
                raw_ids: Sequence[int] | None = None, convention: str | None = None, token_offset: int = 1,
                role: str = "draft_input", values: bool | None = None, attrs: dict | None = None,
                remember: bool = False, reuse: str | None = None, private: bool = False) -> int:
        """:meth:`packed` with the speed knobs of :meth:`_record`."""
        labels = [str(x) for x in labels]
        if tuple(labels) not in self._labels_ok:  # each distinct slot list is checked once
            for lab in labels:
                parse_label(lab)
            self._labels_ok.add(tuple(labels))
        if isinstance(parts, torch.Tensor):
            x = parts
        else:
            parts = list(parts)
            if len(parts) != len(labels):
                raise ValueError(f"{name}: {len(parts)} parts but {len(labels)} labels")
            x = torch.cat(parts, dim=-1)
        width = int(x.shape[-1])
        if width % len(labels):
            raise ValueError(f"{name}: width {width} does not split into {len(labels)} slots")
        sw = width // len(labels)
        if self.writer.hidden_size and sw != self.writer.hidden_size:
            raise ValueError(f"{name}: slot width {sw} differs from the model's hidden size {self.writer.hidden_size}")
        slots = SlotSpec(labels=labels, raw_ids=[int(i) for i in raw_ids] if raw_ids is not None else None,
                         convention=convention)
        return self._record(name, x, rows, kind="packed", slots=slots, slot_width=sw, token_offset=token_offset,
                            role=role, values=values, attrs=attrs, remember=remember, reuse=reuse,
                            private=private and isinstance(parts, torch.Tensor))

    def _check_failed(self) -> None:
        if self._failed is not None:
            # the rows staged before the failure are lost, so row indices counted since would be wrong
            raise RuntimeError(f"recorder stopped: writing staged rows failed ({self._failed})")

    def _accepts(self, name: str) -> bool:
        """Whether a record call for ``name`` goes ahead: the recorder is open and the name is
        defined or wanted (a skipped name is counted in the stats)."""
        if self._closed:
            raise RuntimeError("recorder is closed")
        self._check_failed()
        if name not in self._specs and not self.wants(name):
            self.stats.skipped_names.add(name)
            return False
        return True

    def plain(self, name: str, values: np.ndarray | torch.Tensor | Later, rows, *, role: str, token_offset: int = 0,
              dtype: str = "float64", order: float | None = None, attrs: dict | None = None,
              rms: str = "zero") -> int:
        """Record rows that are not states (token ids, top-k tables, verify counts): full values
        only, no sketch, RMS 0 (``rms="abs"``: a one-column tensor's RMS, its absolute value). Same
        row rules as :meth:`record` (-1 skipped, sampling applied). ``values``: [len(rows), width],
        or a :class:`~tensordiff.recorders.staging.Later` giving that table when it is written
        (staging) or now."""
        if not self._accepts(name):
            return 0
        t0 = time.perf_counter()
        later = values if isinstance(values, Later) else None
        rows = np.asarray(rows, dtype=np.int64).reshape(-1)
        if later is None:
            if isinstance(values, torch.Tensor):
                values = values.detach().cpu().numpy()
            vals = np.asarray(values, dtype=np.float64)
            vals = vals.reshape(-1, vals.shape[-1])
            if len(rows) != len(vals):
                raise ValueError(f"{name}: {len(vals)} value rows but {len(rows)} token rows")
        else:
            vals = None  # computed at the drain (staging) or below
        keep = rows >= 0
        self._check_pairs(name, rows, keep, self._offsets.get(name, token_offset))
        if not self.sample.keeps_all:
            keep &= self.sample.mask(self.positions_of(np.where(keep, rows, 0)))
        if name not in self._specs:
            self._offsets[name] = int(token_offset)
            width = int(vals.shape[-1]) if later is None else later.width
            self.writer.define_tensor(name, width, kind="other", dtype=dtype, role=role, token_offset=token_offset,
                                      values=True, sketch=False, order=order, attrs=attrs)
            if rms == "abs" and width != 1:
                raise ValueError(f"{name}: rms='abs' is for one-column tensors, not width {width}")
            self._specs[name] = _Spec(name, width, width, 1, dtype, True, False, plain=True, abs_rms=rms == "abs")
        spec = self._specs[name]
        got = int(vals.shape[-1]) if later is None else later.width
        if got != spec.width:
            raise ValueError(f"{name}: width {got}, but it was defined with width {spec.width}")
        n = int(keep.sum())
        if n and self.stage_bytes:
            all_kept = n == len(keep)
            if later is not None:
                entry = Staged(rows[keep] if not all_kept else rows.copy(), plain=later, keep=None if all_kept else keep)
            else:
                entry = Staged(rows[keep] if not all_kept else rows.copy(), plain=vals[keep] if not all_kept else vals.copy())
            self._stage_entry(name, entry)
            self.stats.calls += 1
            self.stats.rows += n
        elif n:
            if later is not None:
                vals = later.value()
                if vals.shape != (len(rows), spec.width):
                    raise ValueError(f"{name}: a table of shape {vals.shape} for {len(rows)} rows of width {spec.width}")
            if n < len(keep):  # a copy of the kept rows only where some are dropped
                rows, vals = rows[keep], vals[keep]
            self.writer.append(name, rows, vals.astype(np.float32 if spec.dtype == "float32" else np.float64, copy=False),
                               rms=_plain_rms(spec, vals))
            self.stats.calls += 1
            self.stats.rows += n
        self.stats.seconds += time.perf_counter() - t0
        return n

    def predictions(self, name: str, logits: torch.Tensor, rows, *, k: int = conventions.DEFAULT_TOPK,
                    role: str | None = None, token_offset: int = 0, id_map: torch.Tensor | None = None,
                    order: float | None = None, attrs: dict | None = None) -> int:
        """Record a predictor's top-k ids, log-probabilities and logsumexp per token row
        (:func:`topk_rows`) from its logits [..., V]: ``target_topk`` (token_offset 0) or
        ``draft_topk`` (token_offset 1) in the names of :mod:`tensordiff.conventions`."""
        rows = np.asarray(rows, dtype=np.int64).reshape(-1)
        x = logits.reshape(-1, logits.shape[-1])
        if len(rows) != x.shape[0]:
            raise ValueError(f"{name}: {x.shape[0]} logit rows but {len(rows)} token rows")
        keep = np.flatnonzero(rows >= 0)
        if len(keep) < len(rows):
            x = x.index_select(0, torch.from_numpy(keep).to(x.device))
            rows = rows[keep]
        if not len(rows):
            return 0
        meta = {"layout": "ids[0:k] | logprobs[k:2k] | logsumexp[2k]", "k": min(int(k), int(x.shape[-1])),
                "vocab": int(x.shape[-1]), **(attrs or {})}
        return self.plain(name, topk_rows(x, k, id_map), rows, role=role or name, token_offset=token_offset,
                          order=order, attrs=meta)

    # -- lifecycle -------------------------------------------------------------------------

    def write_staged(self) -> None:
        """Hand everything staged to the writer now (:meth:`flush` does it too), e.g. so that its
        cost falls in a section the caller times before it writes its own statistics."""
        t0 = time.perf_counter()
        self._drain_staged()
        self.stats.seconds += time.perf_counter() - t0

    def flush(self) -> None:
        """Write what is staged, wait for device copies in flight, write every buffered row, flush
        the file."""
        t0 = time.perf_counter()
        self._drain_staged()
        self._drain(until_bytes=0)
        self.writer.flush()
        self.stats.seconds += time.perf_counter() - t0

    def close(self, error: BaseException | None = None) -> None:
        if self._closed:
            return
        t0 = time.perf_counter()
        given, failed = error, None
        try:
            try:
                if self._failed is None:
                    self._drain_staged()
            except Exception as e:  # noqa: BLE001 - the rows written before stay readable
                failed = e
                error = error or e
            self._drain(until_bytes=0)
            if error is not None:
                self.writer.set_attr(None, "recording_error", f"{type(error).__name__}: {error}"[:500])
            if self._owns_writer:
                self.writer.close()
                if error is not None:
                    # what was recorded is consistent and readable, but the recording did not finish:
                    # say so the way an interrupted trace says it (the reader reports it as recovered)
                    with h5py.File(self.writer.path, "r+") as f:
                        f.attrs["complete"] = False
            else:
                self.writer.flush()
        finally:
            self._closed = True
            self.stats.seconds += time.perf_counter() - t0
        if failed is not None and given is None:
            raise failed

    def __enter__(self) -> Recorder:  # noqa: PYI034 (Self needs Python 3.11)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(exc)
