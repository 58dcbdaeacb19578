"""The TUI's data layer: what its panes show, read and looked up without textual.

Plain numpy over the diff summary and the two traces, so it is tested and reused without an app:
the heatmap's metrics and cell codes, the summary's columns and the column filter, the bounded
block cache over the summary, position and token-id lookup, the go-to parser, the cell reader of
the detail pane (:class:`VectorSource`), and a column's findings and slot row from the aligner's
result. The text the panes show is made in :mod:`tensordiff.tui_text`, the widgets that draw it
are in :mod:`tensordiff.tui_widgets`, the app in :mod:`tensordiff.tui`.

Nothing here judges a tensor: verdicts, sentences and per-token flags are the aligner's.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from . import token_text
from .align import SideTokens, row_map
from .findings import DiffResult, Finding, SlotRow
from .summary import FLAG_BAD, FLAG_NONFINITE, Column, SummaryReader
from .token_text import TokenText
from .tokens import token_code

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

# cell codes: 0 absent; otherwise category * N_LEVELS + level (+1 keeps 0 free)
CAT_OK, CAT_FAIL, CAT_NONFINITE = 0, 1, 2


def cell_codes(values: np.ndarray, flags: np.ndarray, metric: Metric) -> np.ndarray:
    """uint8 code of every cell of a block: 0 where the tensor has no row for that token,
    otherwise 1 + category * N_LEVELS + level (category from the aligner's flags)."""
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

    def __init__(self, summary: SummaryReader, block_rows: int = 256, max_blocks: int = 24):
        self.summary = summary
        self.block_rows = block_rows
        self.max_blocks = max_blocks
        self._codes: OrderedDict = OrderedDict()
        self._tokens: OrderedDict = OrderedDict()
        self.reads = 0

    def __len__(self) -> int:
        return len(self._codes) + len(self._tokens)

    def _get(self, cache: OrderedDict, key, load):
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

        def load():
            stop = min(start + self.block_rows, self.summary.n)
            flags = self.summary.block(start, stop, 3)
            vals = flags if metric.field == 3 else self.summary.block(start, stop, metric.field)
            return cell_codes(vals, flags, metric)

        return self._get(self._codes, (metric.key, b), load), off

    def token(self, row: int):
        b, off = divmod(row, self.block_rows)
        start = b * self.block_rows
        blk = self._get(self._tokens, b, lambda: self.summary.tokens(start, min(start + self.block_rows, self.summary.n)))
        return blk[off]

    def clear(self) -> None:
        self._codes.clear()
        self._tokens.clear()


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
        self._readers: list = [None, None]
        self._sides: list = [None, None]       # the aligner's SideTokens of each trace, built once
        self._lock = threading.Lock()

    def reader(self, side: int):
        with self._lock:
            if self._readers[side] is None:
                from .traceset import open_trace

                self._readers[side] = open_trace(self.paths[side])  # a file or a trace set
            return self._readers[side]

    def side_tokens(self, side: int) -> SideTokens:
        r = self.reader(side)
        with self._lock:
            if self._sides[side] is None:
                self._sides[side] = SideTokens(r)
            return self._sides[side]

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
        v = r.read_values_at(name, np.array([row]))[0, slot * w:(slot + 1) * w]
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
# A column's findings and slot row, from the aligner's result
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
