"""The TUI's data layer: what its panes show, read and looked up without textual.

Plain numpy over the diff summary and the two traces, so it is tested and reused without an app:
the heatmap's metrics and cell codes, the summary's columns and the column filter, the bounded
block cache over the summary, position and token-id lookup, the go-to parser, the cell reader of
the detail pane (:class:`VectorSource`), and a column's findings and slot row from the diff's
result. The text the panes show is made in :mod:`tensordiff.tui.text`, the widgets that draw it
are in :mod:`tensordiff.tui.widgets`, the app in :mod:`tensordiff.tui.app`.

Nothing here judges a tensor: verdicts, sentences and per-token flags are the diff's.

Why one module of this size: everything the panes read, without textual, in one testable place.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from .. import token_text
from ..align import SideTokens, row_map
from ..dtypes import to_float32
from ..findings import DiffResult, Finding, SlotRow
from ..summary import FLAG_BAD, FLAG_NONFINITE, Column, SummaryReader
from ..token_text import TokenText
from ..tokens import token_code

if TYPE_CHECKING:
    import h5py

    from ..align import TokenAlignment
    from ..numerics import Metrics
    from ..trace import TensorInfo, TraceSource

_T = TypeVar("_T")

# ----------------------------------------------------------------------------------------------
# Metrics shown by the heatmap, and the cell codes of a block
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Metric:
    key: str
    field: int        # column of the summary's [n, 4] rows: 0 cos, 1 rel, 2 maxabs, 3 flags
    title: str
    lo: float         # log10 of the value drawn as the lowest bar
    hi: float         # log10 of the value drawn as the highest bar


METRICS = (
    Metric("rel", 1, "relative error", -6.0, 1.0),
    Metric("cos", 0, "1 - cosine", -7.0, 0.3),
    Metric("maxabs", 2, "max abs error", -6.0, 2.0),
    Metric("verdict", 3, "aligner verdict (fails tolerance / NaN)", 0.0, 1.0),
)

BARS = "▁▂▃▄▅▆▇█"
N_LEVELS = len(BARS)

# cell codes: 0 absent; otherwise category * N_LEVELS + level (+1 keeps 0 free); PENDING: the
# diff has not compared that cell yet (only while it runs: never drawn like an agreeing cell)
CAT_OK, CAT_FAIL, CAT_NONFINITE = 0, 1, 2
PENDING = 1 + 3 * N_LEVELS
# a preview's cells (values the diff has no verdict on yet): UNJUDGED + level, never drawn in a
# verdict's colours
UNJUDGED = PENDING + 1


def cell_codes(values: np.ndarray, flags: np.ndarray, metric: Metric, judged: bool = True) -> np.ndarray:
    """uint8 code of every cell of a block: 0 where the tensor has no row for that token,
    otherwise 1 + category * N_LEVELS + level (category from the diff's flags). Not ``judged``
    (a preview): UNJUDGED + level, except non-finite values, which are a fact, not a verdict."""
    present = ~np.isnan(flags)
    fl = np.where(present, flags, 0).astype(np.int64)
    cat = np.where(fl & FLAG_NONFINITE, CAT_NONFINITE, np.where(fl & FLAG_BAD, CAT_FAIL, CAT_OK))
    if metric.key == "verdict":
        level = np.where(cat == CAT_OK, 0, N_LEVELS - 1)
    else:
        v = values.astype(np.float64)
        if metric.key == "cos":
            v = 1.0 - v
        with np.errstate(divide="ignore", invalid="ignore"):
            lg = np.log10(np.abs(v))
        frac = (lg - metric.lo) / (metric.hi - metric.lo)
        frac = np.where(np.isfinite(frac), frac, np.where(np.abs(v) > 0, 1.0, 0.0))
        frac = np.where(np.isnan(v), 1.0, frac)
        level = np.clip(np.floor(frac * N_LEVELS), 0, N_LEVELS - 1).astype(np.int64)
    codes = 1 + cat * N_LEVELS + level
    if not judged:
        codes = np.where(cat == CAT_NONFINITE, codes, UNJUDGED + np.where(metric.key == "verdict", 0, level))
    return np.where(present, codes, 0).astype(np.uint8)


def legend(metric: Metric) -> str:
    """One-line key of the heatmap's glyphs for a metric."""
    if metric.key == "verdict":
        return "··· ok  ███ fails"
    return f"{BARS[0]} {10 ** metric.lo:.0e} .. {BARS[-1]} {10 ** metric.hi:.0e}"


# ----------------------------------------------------------------------------------------------
# Columns of the summary (Column and read_columns: tensordiff.summary)
# ----------------------------------------------------------------------------------------------


def filter_columns(columns: list[Column], text: str) -> list[Column]:
    """Columns whose label or claimed slot label contains one of the comma-separated terms
    (case-blind); an empty filter keeps all."""
    terms = [t.strip().lower() for t in text.split(",") if t.strip()]
    if not terms:
        return list(columns)
    return [c for c in columns if any(t in c.label.lower() or t in (c.slot_label or "").lower() for t in terms)]


# ----------------------------------------------------------------------------------------------
# Bounded block cache over a summary, and lookups
# ----------------------------------------------------------------------------------------------


class BlockCache:
    """LRU cache of summary blocks: cell codes per (metric, block) and token rows per block.
    At most ``max_blocks`` blocks of each kind are held, whatever the trace size."""

    def __init__(self, summary: SummaryReader | LiveSummary, block_rows: int = 256, max_blocks: int = 24):
        self.summary = summary
        self.block_rows = block_rows
        self.max_blocks = max_blocks
        self._codes: OrderedDict[tuple[str, int], np.ndarray] = OrderedDict()
        self._tokens: OrderedDict[int, np.ndarray] = OrderedDict()
        self.reads = 0

    def __len__(self) -> int:
        return len(self._codes) + len(self._tokens)

    def _get(self, cache: OrderedDict[Any, _T], key: object, load: Callable[[], _T]) -> _T:
        hit = cache.get(key)
        if hit is not None:
            cache.move_to_end(key)
            return hit
        val = load()
        self.reads += 1
        cache[key] = val
        while len(cache) > self.max_blocks:
            cache.popitem(last=False)
        return val

    def codes(self, row: int, metric: Metric) -> tuple[np.ndarray, int]:
        """(codes block [rows, n_columns] uint8, row offset inside it)."""
        b, off = divmod(row, self.block_rows)
        start = b * self.block_rows

        def load() -> np.ndarray:
            stop = min(start + self.block_rows, self.summary.n)
            # a summary the diff is still writing: which cells it has compared, taken BEFORE the
            # values are read (rows written after that stay pending until the next poll)
            pending = self.summary.pending(start, stop) if isinstance(self.summary, LiveSummary) else None
            flags = self.summary.block(start, stop, 3)
            vals = flags if metric.field == 3 else self.summary.block(start, stop, metric.field)
            codes = cell_codes(vals, flags, metric, judged=getattr(self.summary, "judged", True))
            if pending is not None:
                codes[pending] = PENDING
            return codes

        return self._get(self._codes, (metric.key, b), load), off

    def token(self, row: int) -> np.void:
        """The summary's token row (``seq_a``, ``pos_a``, ``seq_b``, ``pos_b``, ``token``, ...)."""
        b, off = divmod(row, self.block_rows)
        start = b * self.block_rows
        blk = self._get(self._tokens, b, lambda: self.summary.tokens(start, min(start + self.block_rows, self.summary.n)))
        row_: np.void = blk[off]
        return row_

    def clear(self) -> None:
        self._codes.clear()
        self._tokens.clear()

    def invalidate(self, lo: int, hi: int) -> None:
        """Drop the cell codes of the blocks that hold rows lo..hi-1 (their cells changed)."""
        b0, b1 = lo // self.block_rows, (hi - 1) // self.block_rows
        for key in [k for k in self._codes if b0 <= k[1] <= b1]:
            del self._codes[key]


class PreviewSummary(SummaryReader):
    """The summary of a diff's preview (:func:`tensordiff.diff.preview.preview_summary`): the real
    metrics of the first tokens, with no verdict (``judged`` false: its cells are drawn without
    the diff's colours). ``tokens_a`` / ``tokens_b``: the token rows each whole trace holds."""

    judged = False


# ----------------------------------------------------------------------------------------------
# The summary while the diff writes it: what the heatmap shows before the diff ends
# ----------------------------------------------------------------------------------------------


def planned_columns(ra: TraceSource, rb: TraceSource) -> tuple[list[Column], list[int]]:
    """The summary columns the diff will write, in the order it streams them (index = that
    position), and the position of each one's tensor pair in the diff's order. From the
    aligner's own pairing (:func:`tensordiff.align.pair_tensors`, predictions left to the
    acceptance check, as :func:`tensordiff.diff.diff_traces` does); a column it ends up not writing
    stays pending until the diff ends."""
    from ..acceptance import is_prediction
    from ..align import pair_tensors
    from ..summary import column_label

    pairs, _ = pair_tensors(ra, rb)
    pairs = [(a, b) for a, b in pairs if not (is_prediction(a) or is_prediction(b))]
    cols: list[Column] = []
    pair_of: list[int] = []
    for p, (ia, ib) in enumerate(pairs):
        k = min(ia.slot_count, ib.slot_count)
        for slot in range(k):
            label = column_label(ia, slot, k)
            slot_label = ia.slot_labels[slot] if ia.slot_labels else None
            cols.append(Column(index=len(cols), label=label, tensor_a=ia.name, tensor_b=ib.name, slot=slot,
                               order=float(ia.order), slot_label=slot_label,
                               packed=label.endswith("]") and slot_label is not None))
            pair_of.append(p)
    return cols, pair_of


class LiveSummary:
    """The diff's summary file while the diff writes it, and a :class:`tensordiff.diff.DiffSink`
    that tracks how far it has got.

    In the diff thread, :meth:`write` sees every block before the summary file's own sink
    (:class:`tensordiff.summary.SummaryWriter`, the last sink of a diff) writes it; a block is
    *committed* (its rows shown as compared) only once that sink has written it: at the next
    block (any tensor), at the diff's next "comparing tensors" progress report (which
    :func:`tensordiff.diff.diff_traces` makes after every sink has the block; :meth:`commit`) or at
    :meth:`close`. Per column it keeps one number, the frontier: rows below it are compared (or
    have no row in that tensor: blank), rows at or above it are pending. A tensor pair is known to
    be done when a later pair streams (the diff goes pair by pair); the last pair's tail stays
    pending until the diff ends and the app opens the finished file. Its memory is a few numbers
    per column, whatever the trace size.

    On the UI thread it reads the file like a :class:`tensordiff.summary.SummaryReader`
    (``n``, ``seq_a``, :meth:`tokens`, :meth:`block`) through a second handle on the file the
    writer has open (HDF5 shares the open file within a process, so the reads see the writes),
    plus :meth:`pending` and :meth:`changes` for the heatmap's poll."""

    def __init__(self, path: str, n: int, columns: list[Column], pair_of: list[int]):
        self.path = path
        self.n = n
        self.columns = columns                       # index = position in the diff's order
        self._col = {(c.tensor_a, c.slot): c.index for c in columns}
        self._pair_of = np.asarray(pair_of, np.int64)
        self._lock = threading.Lock()
        m = len(columns)
        self._staged = np.zeros(m, np.int64)         # rows below: handed to the sinks
        self._committed = np.zeros(m, np.int64)      # rows below: in the file (what the UI shows)
        self._unordered = np.zeros(m, bool)          # a block came out of order: pending to the end
        self._pair = -1                              # the pair streaming now
        self._dirty: list[int] | None = None         # rows whose cells changed since changes()
        self.started = False                         # a block has been handed to the sinks
        self.blocks = 0                              # blocks committed
        self._f: h5py.File | None = None
        self._ds: dict[int, h5py.Dataset] = {}       # column index -> dataset of the file

    @classmethod
    def factory(cls, path: str, on_made: Callable[[LiveSummary], object]
                ) -> Callable[[TokenAlignment, TraceSource, TraceSource], LiveSummary]:
        """A sink factory (``DiffOptions.sinks``) that makes one, hands it to ``on_made``."""
        def make(al: TokenAlignment, ra: TraceSource, rb: TraceSource) -> LiveSummary:
            cols, pair_of = planned_columns(ra, rb)
            live = cls(path, len(al), cols, pair_of)
            on_made(live)
            return live
        return make

    # -- the diff thread (DiffSink) -------------------------------------------------------------

    def write(self, ia: TensorInfo, ib: TensorInfo, k: int, blk: np.ndarray, m: Metrics, bad: np.ndarray) -> None:
        if len(blk) == 0:
            return
        with self._lock:
            self._commit_locked()            # every earlier block is in the file by now
            lo, hi = int(blk[0]), int(blk[-1]) + 1
            for s in range(k):
                c = self._col.get((ia.name, s))
                if c is None:
                    continue                 # not planned: shown once the diff ends
                p = int(self._pair_of[c])
                if p > self._pair:
                    self._pair = p
                if lo < self._staged[c]:
                    self._unordered[c] = True
                self._staged[c] = max(int(self._staged[c]), hi)
            # the pairs before this one are done: their columns hold all they will
            self._staged[self._pair_of < self._pair] = self.n
            self.started = True

    def commit(self) -> None:
        """Every block handed to the sinks so far is in the file (the diff says so through its
        progress report after each block)."""
        with self._lock:
            self._commit_locked()

    def _commit_locked(self) -> None:
        changed = np.flatnonzero(self._staged != self._committed)
        if len(changed) == 0:
            return
        lo = int(self._committed[changed].min())
        hi = int(self._staged[changed].max())
        self._committed[changed] = self._staged[changed]
        self.blocks += 1
        if self._dirty is None:
            self._dirty = [lo, hi]
        else:
            self._dirty = [min(self._dirty[0], lo), max(self._dirty[1], hi)]

    def close(self) -> None:
        # after the diff's last block, or after it failed: only what was written is committed
        self.commit()

    # -- the UI thread ----------------------------------------------------------------------------

    def changes(self) -> tuple[int, int] | None:
        """Rows lo..hi-1 whose cells changed since the last call (None: nothing new)."""
        with self._lock:
            d, self._dirty = self._dirty, None
        return (d[0], d[1]) if d is not None else None

    def committed(self) -> np.ndarray:
        with self._lock:
            c = self._committed.copy()
            c[self._unordered] = 0
        return c

    @property
    def has_rows(self) -> bool:
        """Whether any cell has been compared (the heatmap shows real rows)."""
        return bool((self.committed() > 0).any())

    def columns_done(self) -> int:
        return int((self.committed() >= self.n).sum())

    def pending(self, start: int, stop: int) -> np.ndarray:
        """[rows, columns] bool: cells the diff has not compared yet."""
        rows = np.arange(start, min(stop, self.n))
        return rows[:, None] >= self.committed()[None, :]

    def _file(self) -> h5py.File:
        if self._f is None:
            import h5py

            # the flags the writer opened it with (HDF5 shares an open file only then)
            self._f = h5py.File(self.path, "r")
        return self._f

    @property
    def seq_a(self) -> list[str]:
        return list(self._file()["sequences_a"].asstr()[()])

    @property
    def tokens_ds(self) -> h5py.Dataset:
        return self._file()["tokens"]

    def tokens(self, start: int, stop: int) -> np.ndarray:
        rows: np.ndarray = self._file()["tokens"][start:stop]
        return rows

    def _dataset(self, c: int) -> h5py.Dataset | None:
        ds = self._ds.get(c)
        if ds is None:
            cols = self._file()["columns"]
            for j in range(len(cols)):
                d = cols[str(j)]
                try:
                    key = (str(d.attrs["tensor_a"]), int(d.attrs["slot"]))
                except KeyError:
                    continue          # being made by the writer: its rows are not committed yet
                if key in self._col:
                    self._ds[self._col[key]] = d
            ds = self._ds.get(c)
        return ds

    def block(self, start: int, stop: int, metric: int = 1) -> np.ndarray:
        """[stop-start, columns] of one metric; NaN where nothing is written (yet)."""
        stop = min(stop, self.n)
        out = np.full((max(0, stop - start), len(self.columns)), np.nan, np.float32)
        for c in np.flatnonzero(self.committed() > start):
            ds = self._dataset(int(c))
            if ds is not None:
                out[:, c] = ds[start:stop, metric]
        return out

    def close_reader(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None
            self._ds.clear()


def find_position(summary: SummaryReader, seq: int, pos: int) -> int:
    """Aligned index of (A sequence index, A position), or of the next aligned token after it
    (the summary's rows are sorted by A sequence, then position). Binary search: ~log2(n) reads."""
    lo, hi = 0, summary.n
    ds = summary.tokens_ds
    while lo < hi:
        mid = (lo + hi) // 2
        r = ds[mid]
        if (int(r["seq_a"]), int(r["pos_a"])) < (seq, pos):
            lo = mid + 1
        else:
            hi = mid
    return lo


def find_token_id(summary: SummaryReader, token: int, start: int, block: int = 65536) -> int | None:
    """First aligned index at or after ``start`` (wrapping) whose token id is ``token``."""
    n = summary.n
    for base in list(range(start, n, block)) + list(range(0, start, block)):
        stop = min(base + block, n if base >= start else start)
        hit = np.flatnonzero(summary.tokens_ds.fields("token")[base:stop] == token)
        if len(hit):
            return base + int(hit[0])
    return None


GOTO_FORMS = "#INDEX, SEQ:POS, POS or t=TOKEN_ID"


def resolve_goto(summary: SummaryReader, spec: str, cursor_row: int, current_seq: int,
                 side_a: str = "A") -> tuple[int | None, str | None]:
    """Where a go-to spec points: ``#INDEX`` (aligned row), ``SEQ:POS`` (sequence key and position
    on side A), ``POS`` (in ``current_seq``) or ``t=TOKEN_ID`` (next row after ``cursor_row`` with
    that token id). Returns (row, None), (row, note) when it went to the next aligned position
    after a gap, or (None, why not)."""
    s = spec.strip()
    n = summary.n
    try:
        if s.startswith("#"):
            row = int(s[1:])
            if not 0 <= row < n:
                return None, f"no aligned row {row} (0..{n - 1})"
            return row, None
        if s.lower().startswith("t="):
            tid = int(s[2:])
            found = find_token_id(summary, tid, (cursor_row + 1) % max(n, 1))
            if found is None:
                return None, f"token id {tid} is not among the aligned tokens"
            return found, None
        if ":" in s:
            seq_name, pos_txt = s.rsplit(":", 1)
            if seq_name not in summary.seq_a:
                return None, f"no sequence {seq_name!r} on {side_a}"
            seq = summary.seq_a.index(seq_name)
        else:
            pos_txt, seq = s, current_seq
        pos = int(pos_txt)
    except ValueError:
        return None, f"cannot read {spec!r}: use {GOTO_FORMS}"
    row = find_position(summary, seq, pos)
    tok = summary.tokens(row, row + 1) if row < n else None
    if tok is None or len(tok) == 0 or int(tok[0]["seq_a"]) != seq:
        return None, f"position {pos} is past the aligned tokens of that sequence"
    if int(tok[0]["pos_a"]) != pos:
        return row, f"position {pos} is not aligned (a gap); went to position {int(tok[0]['pos_a'])}"
    return row, None


# ----------------------------------------------------------------------------------------------
# Reading the two vectors of a cell (detail pane), off the UI thread
# ----------------------------------------------------------------------------------------------


class VectorSource:
    """Opens the two traces lazily (in the detail worker) and reads one slot of one token."""

    def __init__(self, path_a: str, path_b: str):
        self.paths = (path_a, path_b)
        self._readers: list[TraceSource | None] = [None, None]
        self._sides: list[SideTokens | None] = [None, None]   # the aligner's SideTokens of each trace, built once
        self._lock = threading.Lock()

    def reader(self, side: int) -> TraceSource:
        with self._lock:
            r = self._readers[side]
            if r is None:
                from ..traceset import open_trace

                r = self._readers[side] = open_trace(self.paths[side])  # a file or a trace set
            return r

    def side_tokens(self, side: int) -> SideTokens:
        r = self.reader(side)
        with self._lock:
            st = self._sides[side]
            if st is None:
                st = self._sides[side] = SideTokens(r)
            return st

    def row_of(self, side: int, name: str, seq: int, pos: int, token: int) -> int | None:
        """The tensor row the aligner compares for (sequence index, position) when its token is
        ``token``: the aligner's own rule (:class:`tensordiff.align.SideTokens` and
        :func:`tensordiff.align.row_map`: the last row of the canonical token wins), applied to
        one token code (:mod:`tensordiff.tokens`)."""
        st = self.side_tokens(side)
        code = int(token_code(seq, pos))
        i = int(np.searchsorted(st.codes, code))
        if i >= len(st.codes) or int(st.codes[i]) != code or int(st.tok[i]) != int(token):
            return None
        rows = row_map(self.reader(side), st, name, lambda c: np.where(c == code, 0, -1).astype(np.int64))
        hits = np.flatnonzero(rows == 0)
        return int(hits[-1]) if len(hits) else None

    def read(self, side: int, name: str, slot: int, seq: int, pos: int, token: int) -> tuple[np.ndarray | None, str]:
        r = self.reader(side)
        info = r.tensors.get(name)
        if info is None:
            return None, f"{name} not in the trace"
        if not info.has_values:
            return None, f"{name} has no full values (sketch only)"
        row = self.row_of(side, name, seq, pos, token)
        if row is None:
            return None, f"{name} has no row for this token"
        w = info.slot_width
        v = to_float32(r.part(name, "values").take(np.array([row])), info.dtype)[0, slot * w:(slot + 1) * w]
        return v, ""

    def cell_vectors(self, col: Column, seq_a: int, pos_a: int, seq_b: int, pos_b: int,
                     token: int) -> tuple[np.ndarray | None, np.ndarray | None, str]:
        """(A's vector, B's vector, a note on what could not be read) of one heatmap cell."""
        try:
            va, na = self.read(0, col.tensor_a, col.slot, seq_a, pos_a, token)
            vb, nb = self.read(1, col.tensor_b, col.slot, seq_b, pos_b, token)
        except Exception as e:  # noqa: BLE001 - a damaged trace must not take the UI down
            return None, None, f"cannot read the values: {' '.join(str(e).split())[:200]}"
        return va, vb, "; ".join(x for x in (na, nb) if x)

    def recorded_token_text(self) -> TokenText | None:
        """Token text from the model directory a trace records, when it has a tokenizer here."""
        dirs = []
        for side in (0, 1):
            try:
                dirs.append(self.reader(side).model.get("path"))
            except Exception:  # noqa: BLE001 - an unreadable trace: the detail pane says so itself
                dirs.append(None)
        return token_text.resolve(None, [d for d in dirs if isinstance(d, str)])

    def close(self) -> None:
        with self._lock:
            for r in self._readers:
                if r is not None:
                    r.close()
            self._readers = [None, None]
            self._sides = [None, None]


# ----------------------------------------------------------------------------------------------
# A column's findings and slot row, from the diff's result
# ----------------------------------------------------------------------------------------------

def column_findings(res: DiffResult | None, col: Column) -> list[Finding]:
    if res is None:
        return []
    return [f for f in res.findings if col.matches(f.tensor, f.slot)]


def slot_row(res: DiffResult | None, col: Column) -> SlotRow | None:
    if res is None:
        return None
    for r in res.slot_table:
        if r.tensor in (col.tensor_a, col.tensor_b) and r.slot == col.slot:
            return r
    return None
