"""The aligner: match two traces by token and by slot, find what each slot really holds, judge the
numerics, and order the findings so that the first one is the first divergence.

A is the reference (what was expected, usually the train side), B the side under test.
numpy only; reads traces through :class:`tensordiff.trace.TraceReader`, in blocks.
"""

from __future__ import annotations

import heapq
import itertools
from concurrent.futures import ThreadPoolExecutor
import os
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from .errors import TraceError
from .metrics import BlockMetrics, ToleranceBook, cosine_matrix, finite_or_zero, rms_agreement
from .summary import SummaryWriter
from .trace import TensorInfo, TraceReader
from .vocab import REGIMES

MAX_SHIFT = 2
SEQ_BITS = 40  # code = seq << SEQ_BITS | position
IDENTITY_SAMPLE = 256
CONFIDENT = 0.98       # an identity score at least this high names what a slot holds
MIN_MARGIN = 0.002     # ... and this far ahead of the runner-up
BLOCK_ROWS = 4096
WORST_TOKENS = 20


# ----------------------------------------------------------------------------------------------
# Results
# ----------------------------------------------------------------------------------------------


# at the same place in forward order, the explanation comes before its symptoms
_KIND_RANK = {"token_shift": 0, "pairing": 1, "gap": 2, "missing": 3, "nonfinite": 4, "slot_identity": 5,
              "label_mismatch": 6, "numeric": 7}


@dataclass
class Finding:
    """One conclusion of a diff. ``severity``: divergence (sets exit code 1), warning, info."""

    kind: str          # token_shift | slot_identity | label_mismatch | numeric | nonfinite | gap | missing | pairing
    severity: str
    message: str
    tensor: str | None = None
    slot: int | None = None
    order: float = -1.0
    seq: str | None = None
    position: int | None = None
    position_b: int | None = None
    token: int | None = None
    regime: str | None = None
    details: dict = field(default_factory=dict)
    inherited_from: int | None = None
    index: int = 0

    def sort_key(self) -> tuple:
        return (self.order, -1 if self.slot is None else self.slot, _KIND_RANK.get(self.kind, 9),
                self.details.get("_tok_index", -1))

    def to_dict(self) -> dict:
        d = {k: v for k, v in self.__dict__.items() if v is not None}
        d["details"] = {k: v for k, v in self.details.items() if not k.startswith("_")}
        return d


@dataclass
class SlotRow:
    """One row of the slot table: what a slot of a paired tensor holds on each side."""

    tensor: str
    slot: int
    claimed_a: str | None
    claimed_b: str | None
    held_a: str | None
    held_b: str | None
    score_b: float | None
    margin_b: float | None
    offset_b: int
    candidates_b: list
    expected: str | None
    cos_mean: float | None = None
    rel_max: float | None = None
    verdict: str = "ok"

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class PairStats:
    name_a: str
    name_b: str
    label: str
    order: float
    slots: int
    tokens: int = 0
    basis: str = "values"
    tolerance: list = field(default_factory=list)
    cos_min: list = field(default_factory=list)
    cos_mean: list = field(default_factory=list)
    rel_max: list = field(default_factory=list)
    maxabs: list = field(default_factory=list)
    failing: list = field(default_factory=list)
    nonfinite_a: list = field(default_factory=list)
    nonfinite_b: list = field(default_factory=list)
    by_regime: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class DiffResult:
    path_a: str
    path_b: str
    side_a: str
    side_b: str
    findings: list[Finding]
    slot_table: list[SlotRow]
    pairs: list[PairStats]
    sequences: list[dict]
    gaps: list[dict]
    shifts: dict
    tokens_aligned: int
    worst_tokens: list[dict]
    summary_path: str | None = None

    @property
    def divergences(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "divergence"]

    @property
    def first_divergence(self) -> Finding | None:
        d = self.divergences
        return d[0] if d else None

    @property
    def exit_code(self) -> int:
        return 1 if self.divergences else 0

    def headline(self) -> str:
        f = self.first_divergence
        if f is None:
            return (f"no divergence: {self.tokens_aligned} tokens in {len(self.pairs)} tensors agree within tolerance")
        return f.message

    def to_dict(self) -> dict:
        return {
            "a": {"path": self.path_a, "side": self.side_a},
            "b": {"path": self.path_b, "side": self.side_b},
            "verdict": "divergence" if self.divergences else "agree",
            "exit_code": self.exit_code,
            "headline": self.headline(),
            "first_divergence": self.first_divergence.to_dict() if self.first_divergence else None,
            "findings": [f.to_dict() for f in self.findings],
            "slot_table": [r.to_dict() for r in self.slot_table],
            "tensors": [p.to_dict() for p in self.pairs],
            "tokens_aligned": self.tokens_aligned,
            "sequences": self.sequences,
            "gaps": self.gaps,
            "shifts": self.shifts,
            "worst_tokens": self.worst_tokens,
            "summary_path": self.summary_path,
        }


# ----------------------------------------------------------------------------------------------
# Token alignment
# ----------------------------------------------------------------------------------------------


@dataclass
class TokenAlignment:
    code_a: np.ndarray      # [n] seq<<40|pos on side A, sorted (this is the aligned order)
    code_b: np.ndarray      # [n] matching code on side B
    token: np.ndarray       # [n] token id (A's)
    regime_a: np.ndarray
    regime_b: np.ndarray
    seq_pairs: list[dict]
    gaps: list[dict]
    shifts: dict[int, int]  # shift -> number of sequence pairs

    def __len__(self) -> int:
        return len(self.code_a)

    def index_a(self, codes: np.ndarray) -> np.ndarray:
        """Aligned index of each A code, -1 where not aligned."""
        return _lookup(self.code_a, codes)

    def index_b(self, codes: np.ndarray) -> np.ndarray:
        order = getattr(self, "_b_order", None)
        if order is None:
            order = np.argsort(self.code_b, kind="stable")
            self._b_order = order
            self._b_sorted = self.code_b[order]
        pos = _lookup(self._b_sorted, codes)
        return np.where(pos >= 0, order[np.maximum(pos, 0)], -1)


def _lookup(sorted_codes: np.ndarray, codes: np.ndarray) -> np.ndarray:
    if len(sorted_codes) == 0:
        return np.full(len(codes), -1, dtype=np.int64)
    pos = np.searchsorted(sorted_codes, codes)
    pos_c = np.minimum(pos, len(sorted_codes) - 1)
    return np.where(sorted_codes[pos_c] == codes, pos_c, -1).astype(np.int64)


class _SideTokens:
    """Canonical token per (sequence, position) on one side: the last row wins (a verify pass that
    was later recomputed is superseded)."""

    def __init__(self, r: TraceReader):
        t = r.tokens
        self.reader = r
        codes = (t["seq"].astype(np.int64) << SEQ_BITS) | t["position"].astype(np.int64)
        self.row_code = codes
        # last occurrence of each code
        rev = codes[::-1]
        uniq, first_rev = np.unique(rev, return_index=True)
        last_rows = len(codes) - 1 - first_rev
        self.codes = uniq                         # sorted unique codes
        self.tok = t["token"][last_rows].astype(np.int64)
        self.regime = t["regime"][last_rows]
        self.last_rows = last_rows
        self.row_valid = t["token"].astype(np.int64) == self.tok[np.searchsorted(uniq, codes)] if len(codes) else np.zeros(0, bool)
        seq_of = (uniq >> SEQ_BITS)
        self.seqs: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        if len(uniq):
            cuts = np.flatnonzero(np.diff(seq_of)) + 1
            starts = np.concatenate([[0], cuts])
            ends = np.concatenate([cuts, [len(uniq)]])
            for s, e in zip(starts, ends):
                self.seqs[int(seq_of[s])] = (uniq[s:e] & ((1 << SEQ_BITS) - 1), self.tok[s:e])

    def key(self, seq: int) -> str:
        return self.reader.sequences[seq]


def _ngram_hashes(tok: np.ndarray, n: int = 3, limit: int | None = None) -> np.ndarray:
    if limit is not None:
        tok = tok[:limit]
    if len(tok) < n:
        return np.array([hash(tuple(tok.tolist()))], dtype=np.int64) if len(tok) else np.zeros(0, np.int64)
    t = tok.astype(np.int64)
    h = t[:-2] * 1000003 ^ t[1:-1] * 10007 ^ t[2:]
    return h


def _shift_matches(pa: np.ndarray, ta: np.ndarray, pb: np.ndarray, tb: np.ndarray, s: int) -> tuple[int, int]:
    """(overlap, matches) when B position = A position + s."""
    idx = np.searchsorted(pb, pa + s)
    idx_c = np.minimum(idx, len(pb) - 1)
    present = pb[idx_c] == pa + s
    overlap = int(present.sum())
    matches = int((present & (tb[idx_c] == ta)).sum())
    return overlap, matches


def align_tokens(ra: TraceReader, rb: TraceReader, sides: tuple | None = None) -> TokenAlignment:
    """Pair sequences and positions of two traces. ``sides``: their :class:`_SideTokens`, when the
    caller already built them (the differ keeps them to map tensor rows)."""
    A, B = sides or (_SideTokens(ra), _SideTokens(rb))
    if not A.seqs:
        raise TraceError("the trace has no tokens (empty trace)", ra.path)
    if not B.seqs:
        raise TraceError("the trace has no tokens (empty trace)", rb.path)
    index: dict[int, set[int]] = defaultdict(set)
    for sb, (_pb, tb) in B.seqs.items():
        for h in _ngram_hashes(tb).tolist():
            index[h].add(sb)
    used_b: set[int] = set()
    seq_pairs, gaps = [], []
    shifts: dict[int, int] = defaultdict(int)
    parts_a, parts_b = [], []
    for sa, (pa, ta) in A.seqs.items():
        votes: dict[int, int] = defaultdict(int)
        for h in _ngram_hashes(ta, limit=256).tolist():
            for sb in index.get(h, ()):
                if sb not in used_b:
                    votes[sb] += 1
        cands = sorted(votes, key=lambda s: -votes[s])[:4]
        if not cands and len(B.seqs) <= 64:
            cands = [s for s in B.seqs if s not in used_b]
        best = None
        for sb in cands:
            pb, tb = B.seqs[sb]
            for s in sorted(range(-MAX_SHIFT, MAX_SHIFT + 1), key=abs):
                overlap, matches = _shift_matches(pa, ta, pb, tb, s)
                if matches == 0 or matches < 0.9 * overlap:
                    continue
                score = (matches, -abs(s))
                if best is None or score > best[0]:
                    best = (score, sb, s)
        if best is None:
            gaps.append({"seq": A.key(sa), "side": "a", "positions": _ranges(pa), "count": int(len(pa)),
                         "reason": "sequence only on A (no sequence of B has these token ids)"})
            continue
        _, sb, s = best
        used_b.add(sb)
        pb, tb = B.seqs[sb]
        idx = np.searchsorted(pb, pa + s)
        idx_c = np.minimum(idx, len(pb) - 1)
        ok = (pb[idx_c] == pa + s) & (tb[idx_c] == ta)
        only_a = pa[~ok]
        matched_b = np.zeros(len(pb), bool)
        matched_b[idx_c[ok]] = True
        only_b = pb[~matched_b]
        shifts[s] += 1
        seq_pairs.append({"a": A.key(sa), "b": B.key(sb), "shift": s, "tokens": int(ok.sum()),
                          "only_a": int(len(only_a)), "only_b": int(len(only_b))})
        if len(only_a):
            gaps.append({"seq": A.key(sa), "side": "a", "positions": _ranges(only_a), "count": int(len(only_a)),
                         "reason": _gap_reason(only_a, pa, "a")})
        if len(only_b):
            gaps.append({"seq": B.key(sb), "side": "b", "positions": _ranges(only_b), "count": int(len(only_b)),
                         "reason": _gap_reason(only_b, pb, "b")})
        parts_a.append((np.int64(sa) << SEQ_BITS) | pa[ok])
        parts_b.append((np.int64(sb) << SEQ_BITS) | (pa[ok] + s))
    for sb, (pb, _tb) in B.seqs.items():
        if sb not in used_b:
            gaps.append({"seq": B.key(sb), "side": "b", "positions": _ranges(pb), "count": int(len(pb)),
                         "reason": "sequence only on B (no sequence of A has these token ids)"})
    if not parts_a or sum(len(p) for p in parts_a) == 0:
        raise TraceError(f"no common tokens: no sequence of {os.path.basename(ra.path)} matches a sequence of "
                         f"{os.path.basename(rb.path)} by token ids (tried position shifts -{MAX_SHIFT}..+{MAX_SHIFT})")
    code_a = np.concatenate(parts_a)
    code_b = np.concatenate(parts_b)
    order = np.argsort(code_a, kind="stable")
    code_a, code_b = code_a[order], code_b[order]
    ia = np.searchsorted(A.codes, code_a)
    ib = np.searchsorted(B.codes, code_b)
    return TokenAlignment(code_a=code_a, code_b=code_b, token=A.tok[ia], regime_a=A.regime[ia],
                          regime_b=B.regime[ib], seq_pairs=seq_pairs, gaps=gaps, shifts=dict(shifts))


def _ranges(pos: np.ndarray, limit: int = 8) -> list[list[int]]:
    if len(pos) == 0:
        return []
    cuts = np.flatnonzero(np.diff(pos) != 1) + 1
    out = [[int(p[0]), int(p[-1])] for p in np.split(pos, cuts)]
    return out[:limit]


def _gap_reason(missing: np.ndarray, have: np.ndarray, side: str) -> str:
    other = "B" if side == "a" else "A"
    if len(missing) and missing[0] == have[0] and np.all(np.diff(missing) == 1):
        return f"leading positions absent on {other} (prefix-cache hit, or truncation)"
    if len(missing) and missing[-1] == have[-1]:
        return f"trailing positions absent on {other} (truncation, or rows past a draft's accept length)"
    return f"positions absent on {other}"


# ----------------------------------------------------------------------------------------------
# Tensor pairing and row maps
# ----------------------------------------------------------------------------------------------


def pair_tensors(ra: TraceReader, rb: TraceReader) -> tuple[list[tuple[TensorInfo, TensorInfo]], list[Finding]]:
    ta, tb = dict(ra.tensors), dict(rb.tensors)
    pairs, notes = [], []
    for name in sorted(set(ta) & set(tb)):
        pairs.append((ta.pop(name), tb.pop(name)))

    def key(i: TensorInfo):
        if i.kind == "boundary":
            return ("boundary", i.boundary)
        if i.kind == "final_norm":
            return ("final_norm",)
        if i.kind == "packed":
            return ("packed", i.role or "")
        return None

    by_key_b: dict = defaultdict(list)
    for i in tb.values():
        by_key_b[key(i)].append(i)
    for name in sorted(ta):
        k = key(ta[name])
        if k is not None and len(by_key_b.get(k, [])) == 1:
            other = by_key_b.pop(k)[0]
            tb.pop(other.name)
            pairs.append((ta.pop(name), other))
    packed_a = [i for i in ta.values() if i.kind == "packed"]
    packed_b = [i for i in tb.values() if i.kind == "packed"]
    if len(packed_a) == 1 and len(packed_b) == 1:
        pairs.append((ta.pop(packed_a[0].name), tb.pop(packed_b[0].name)))
    for side, rest in (("A", ta), ("B", tb)):
        for i in rest.values():
            notes.append(Finding("missing", "info", f"{i.name} is recorded only on {side}; not compared",
                                 tensor=i.name, order=i.order))
    pairs.sort(key=lambda p: (p[0].order, p[0].name))
    return pairs, notes


def _row_map(r: TraceReader, side_tokens: _SideTokens, name: str, index_fn: Callable) -> np.ndarray:
    """aligned index -> tensor row (or -1), built from the tensor's token rows."""
    trow = r.token_rows(name)
    codes = side_tokens.row_code[trow]
    valid = side_tokens.row_valid[trow]
    aligned = index_fn(codes)
    aligned[~valid] = -1
    return aligned


# ----------------------------------------------------------------------------------------------
# The diff
# ----------------------------------------------------------------------------------------------


@dataclass
class DiffOptions:
    tolerances: ToleranceBook = field(default_factory=ToleranceBook)
    block_rows: int = BLOCK_ROWS
    identity_sample: int = IDENTITY_SAMPLE
    summary_path: str | None = None
    progress: Callable[[str, int, int], None] | None = None   # (stage, done, total)


class _Catalog:
    """Every boundary/final_norm state recorded on one side, by label."""

    def __init__(self, r: TraceReader, name: str):
        self.r = r
        self.side = name
        self.states: dict[str, TensorInfo] = {}
        for i in sorted(r.tensors.values(), key=lambda x: x.order):
            if i.kind in ("boundary", "final_norm") and i.label not in self.states:
                self.states[i.label] = i


class Differ:
    def __init__(self, path_a: str, path_b: str, options: DiffOptions | None = None):
        self.opt = options or DiffOptions()
        self.ra = TraceReader(path_a)
        try:
            self.rb = TraceReader(path_b)
        except TraceError:
            self.ra.close()
            raise
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tensordiff-read")

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self.ra.close()
        self.rb.close()

    def __enter__(self) -> "Differ":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _progress(self, stage: str, done: int, total: int) -> None:
        if self.opt.progress:
            self.opt.progress(stage, done, total)

    # -- checks --------------------------------------------------------------------------------

    def _check_models(self) -> None:
        ha, hb = self.ra.hidden_size, self.rb.hidden_size
        if ha is not None and hb is not None and ha != hb:
            raise TraceError(f"traces of models with different hidden sizes ({ha} in {os.path.basename(self.ra.path)}, "
                             f"{hb} in {os.path.basename(self.rb.path)}): not the same model")
        na, nb = self.ra.num_layers, self.rb.num_layers
        if na is not None and nb is not None and na != nb:
            raise TraceError(f"traces of models with different layer counts ({na} vs {nb}): not the same model")
        for r in (self.ra, self.rb):
            h = r.hidden_size
            for i in r.tensors.values():
                if i.kind == "packed" and h:
                    if i.width % h:
                        raise TraceError(f"packed tensor {i.name!r} has width {i.width}, not a multiple of the "
                                         f"hidden size {h}", r.path)
                    if i.slot_width != h:
                        raise TraceError(f"packed tensor {i.name!r} has slot width {i.slot_width} but the hidden size is {h}",
                                         r.path)

    # -- main ----------------------------------------------------------------------------------

    def run(self) -> DiffResult:
        ra, rb = self.ra, self.rb
        self._check_models()
        self._progress("aligning tokens", 0, 1)
        self.sa, self.sb = _SideTokens(ra), _SideTokens(rb)
        al = align_tokens(ra, rb, (self.sa, self.sb))
        self._progress("aligning tokens", 1, 1)
        self.al = al
        pairs, findings = pair_tensors(ra, rb)
        for ia, ib in pairs:
            if ia.width != ib.width and not (ia.kind == ib.kind == "packed" and ia.slot_width == ib.slot_width):
                raise TraceError(f"tensor {ia.name}: width {ia.width} in A but {ib.width} in B (mismatched shapes)")
        if not pairs:
            raise TraceError("the traces share no tensor to compare (no common names, boundaries or packed inputs)")
        self.cat_a, self.cat_b = _Catalog(ra, "A"), _Catalog(rb, "B")

        findings += self._shift_findings(al)
        findings += [Finding("gap", "info", _gap_message(g, ra, rb), seq=g["seq"], order=-1.0, details=g)
                     for g in al.gaps]
        # a trace recovered from a killed recording: say so (its missing tail shows up as gaps)
        findings += [Finding("recovered", "info", f"{r.side} trace {os.path.basename(r.path)}: {r.recovered_note}",
                             order=-3.0, details={"side": r.side, "path": r.path})
                     for r in (ra, rb) if getattr(r, "recovered_note", None)]
        summary = SummaryWriter(self.opt.summary_path, al, ra, rb) if self.opt.summary_path else None
        slot_table: list[SlotRow] = []
        stats: list[PairStats] = []
        total_rows = sum(min(a.rows, b.rows, len(al)) for a, b in pairs)  # for the progress bar
        self._done = 0
        self._total = max(total_rows, 1)
        self._tiebreak = itertools.count()
        worst: list = []
        for ia, ib in pairs:
            st, fnd, rows = self._compare_pair(ia, ib, summary, worst)
            stats.append(st)
            findings += fnd
            slot_table += rows
        if summary is not None:
            summary.close()
        findings = _order_findings(findings)
        worst_tokens = [w[2] for w in sorted(worst, key=lambda w: (-w[0], w[2]["index"]))]
        return DiffResult(
            path_a=ra.path, path_b=rb.path, side_a=ra.side, side_b=rb.side, findings=findings,
            slot_table=slot_table, pairs=stats,
            sequences=al.seq_pairs, gaps=al.gaps, shifts={str(k): v for k, v in al.shifts.items()},
            tokens_aligned=len(al), worst_tokens=worst_tokens, summary_path=self.opt.summary_path,
        )

    def _shift_findings(self, al: TokenAlignment) -> list[Finding]:
        out = []
        nonzero = {s: n for s, n in al.shifts.items() if s != 0}
        if nonzero:
            s, n = max(nonzero.items(), key=lambda kv: kv[1])
            total = sum(al.shifts.values())
            pair = next(p for p in al.seq_pairs if p["shift"] == s)
            what = "a missing BOS or an off-by-one in positions" if abs(s) == 1 else "an offset in positions"
            sign = f"+{s}" if s > 0 else str(s)
            out.append(Finding(
                "token_shift", "divergence",
                f"token shift of {s}: {self.rb.side} positions are {self.ra.side} positions {sign} in {n} of {total} "
                f"sequences (token ids match only when shifted; {what})",
                seq=pair["a"], order=-2.0, details={"shift": s, "sequences": n, "of": total, "_tok_index": -1}))
        return out

    # -- identity ------------------------------------------------------------------------------

    def _sample(self, both: np.ndarray, k: int | None = None) -> np.ndarray:
        """Up to identity_sample aligned indices present on both sides, as a few runs of
        consecutive tokens spread over the trace: runs keep the reads to a few chunks per
        candidate and contain the neighbours that shifted candidates need."""
        idx = np.flatnonzero(both)
        k = k or self.opt.identity_sample
        if len(idx) <= k:
            return idx
        runs, run_len = 8, max(1, k // 8)
        starts = np.linspace(0, len(idx) - run_len, runs).astype(np.int64)
        pick = np.unique((starts[:, None] + np.arange(run_len)[None, :]).reshape(-1))
        return idx[pick]

    @staticmethod
    def _slot_data(r: TraceReader, info: TensorInfo, rows: np.ndarray, slot: int, basis: str):
        """One slot's rows (full values or sketch) and their per-token RMS."""
        if basis == "values":
            w = info.slot_width
            data = r.read_values_at(info.name, rows)[:, slot * w:(slot + 1) * w]
        else:
            d = r.sketch_dim
            data = np.asarray(r.read_at(info.name, "sketch", rows), np.float32)[:, slot * d:(slot + 1) * d]
        if "rms" in r._ds[info.name]:
            rms = np.asarray(r.read_at(info.name, "rms", rows), np.float32)[:, slot]
        else:
            w = info.slot_width
            vv = r.read_values_at(info.name, rows)[:, slot * w:(slot + 1) * w]
            rms = np.sqrt(np.mean(vv.astype(np.float64) ** 2, axis=1)).astype(np.float32)
        return data, rms

    def identify(self, side: str, info: TensorInfo, slots: list[int], sample: np.ndarray) -> dict[int, dict]:
        """Which recorded state does each slot of ``info`` (on ``side``) hold at the sampled aligned
        tokens? Candidates: every catalog state of both sides (own side first), at the same token
        and, when nothing matches there, at tokens shifted by up to two positions.

        Each candidate's row map is built once per call and dropped (memory stays O(tokens))."""
        r_self = self.ra if side == "a" else self.rb
        (rows_self,) = self._rows_at(side, info.name, [sample])
        use = rows_self >= 0
        sample, rows_self = sample[use], rows_self[use]
        if len(sample) == 0:
            return {s: {"best": None, "score": None, "reason": "no sampled token"} for s in slots}
        own_cat, other_cat = (self.cat_a, self.cat_b) if side == "a" else (self.cat_b, self.cat_a)
        candidates: list[tuple[str, str, TensorInfo, TraceReader]] = []
        seen = set()
        for cat, cside in ((own_cat, side), (other_cat, "b" if side == "a" else "a")):
            for label, ci in cat.states.items():
                if cside == side and ci.name == info.name:
                    continue  # never the tensor itself: it would always match, hiding what it holds
                if label not in seen:
                    seen.add(label)
                    candidates.append((label, cside, ci, cat.r))
        if not candidates:
            return {s: {"best": None, "score": None, "reason": "no catalog states recorded on either side"} for s in slots}
        offsets = (0, -1, 1, -2, 2)
        targets = [self._offset_index(sample, o) for o in offsets]
        cand_rows = {}
        for i, (label, cside, ci, _) in enumerate(candidates):
            # also a chance for a caller (the TUI's worker) to stop between candidates
            self._progress("identifying slots", i, len(candidates))
            cand_rows[label] = dict(zip(offsets, self._rows_at(cside, ci.name, targets)))
        cand_data: dict[tuple, tuple] = {}

        def candidate(label, ci, cr, offset, basis, ok):
            """A candidate's rows at one offset, read once for all offsets (their union)."""
            key = (label, basis)
            if key not in cand_data:
                union = np.unique(np.concatenate([r[r >= 0] for r in cand_rows[label].values()]))
                cand_data[key] = (union, *slot_data(cr, ci, union, 0, basis))
            union, data, rms = cand_data[key]
            pos = np.searchsorted(union, cand_rows[label][offset][ok])
            return data[pos], rms[pos]

        def slot_data(r, info_, rows, slot, basis):
            data, rms = self._slot_data(r, info_, rows, slot, basis)
            return finite_or_zero(np.ascontiguousarray(data)), rms

        x_cache: dict[tuple, tuple] = {}
        out = {}
        for slot in slots:
            scored = []
            for offset in offsets:
                for label, cside, ci, cr in candidates:
                    crows = cand_rows[label][offset]
                    ok = crows >= 0
                    if ok.sum() < max(1, len(sample) // 4):
                        continue
                    basis = "values" if (info.has_values and ci.has_values) else "sketch"
                    if basis == "sketch" and not (info.has_sketch and ci.has_sketch and cr.sketch_dim == r_self.sketch_dim
                                                  and cr.sketch_seed == r_self.sketch_seed):
                        continue
                    if basis == "values" and ci.width != info.slot_width:
                        continue
                    key = (basis, slot)
                    if key not in x_cache:
                        x_cache[key] = slot_data(r_self, info, rows_self, slot, basis)
                    xs, xr = x_cache[key]
                    cdata, crms = candidate(label, ci, cr, offset, basis, ok)
                    cos = float(cosine_matrix(xs[ok], cdata[None], clean=False)[0])
                    agree = float(rms_agreement(xr[ok], crms[None])[0])
                    scored.append({"label": label, "offset": offset, "score": round(cos * agree, 6), "cos": round(cos, 6),
                                   "rms_agreement": round(agree, 6), "side": cside, "basis": basis})
                if offset == 0 and scored and max(x["score"] for x in scored) >= CONFIDENT:
                    break  # the same token explains it; no need to look at neighbours
            out[slot] = _verdict(scored)
        return out

    def _rows_at(self, side: str, name: str, index_lists: list[np.ndarray]) -> list[np.ndarray]:
        """Tensor row for each aligned index in each array (-1: absent or index -1)."""
        if side == "a":
            rowmap = _row_map(self.ra, self.sa, name, self.al.index_a)
        else:
            rowmap = _row_map(self.rb, self.sb, name, self.al.index_b)
        inv = np.full(len(self.al), -1, dtype=np.int64)
        ok = rowmap >= 0
        inv[rowmap[ok]] = np.flatnonzero(ok)  # the last tensor row wins on duplicates
        return [np.where(ix >= 0, inv[np.maximum(ix, 0)], -1) for ix in index_lists]

    def _offset_index(self, sample: np.ndarray, offset: int) -> np.ndarray:
        if offset == 0:
            return sample
        codes = self.al.code_a[sample] + offset  # same sequence: position lives in the low bits
        return self.al.index_a(codes)

    # -- one tensor pair -----------------------------------------------------------------------

    def _compare_pair(self, ia: TensorInfo, ib: TensorInfo, summary, worst: list):
        everything = np.arange(len(self.al))
        (ma,), (mb,) = self._rows_at("a", ia.name, [everything]), self._rows_at("b", ib.name, [everything])
        both = (ma >= 0) & (mb >= 0)
        k = min(ia.slot_count, ib.slot_count)
        label = ia.label if ia.name == ib.name else f"{ia.name} ~ {ib.name}"
        st = PairStats(name_a=ia.name, name_b=ib.name, label=label, order=ia.order, slots=k)
        findings: list[Finding] = []
        rows_out: list[SlotRow] = []
        if ia.slot_count != ib.slot_count:
            findings.append(Finding("pairing", "divergence",
                                    f"{ia.name} has {ia.slot_count} slots on {self.ra.side} but {ib.slot_count} on {self.rb.side}",
                                    tensor=ia.name, order=ia.order, details={"_tok_index": -1}))
        # the token pairing of a draft's input matters only against another draft input: a target's
        # aux capture (role "aux", offset 0) holds the same states at row t as a draft input does
        if ia.token_offset != ib.token_offset and ia.role == ib.role:
            findings.append(Finding("pairing", "divergence",
                                    f"{ia.name}: {self.ra.side} pairs row t with token t+{ia.token_offset}, "
                                    f"{self.rb.side} with token t+{ib.token_offset}",
                                    tensor=ia.name, order=ia.order, details={"_tok_index": -1}))
        if not both.any():
            findings.append(Finding("missing", "warning", f"{label}: recorded on both sides but on no common token",
                                    tensor=ia.name, order=ia.order))
            return st, findings, rows_out
        basis = "values" if (ia.has_values and ib.has_values) else "sketch"
        if basis == "sketch" and not (ia.has_sketch and ib.has_sketch and self.ra.sketch_seed == self.rb.sketch_seed
                                      and self.ra.sketch_dim == self.rb.sketch_dim):
            findings.append(Finding("missing", "warning", f"{label}: no comparable values or sketches (different sketch seeds?)",
                                    tensor=ia.name, order=ia.order))
            return st, findings, rows_out
        st.basis = basis

        # identity of every packed slot, both sides
        identity_a, identity_b = {}, {}
        if ia.kind == "packed" or ib.kind == "packed":
            sample = self._sample(both)
            identity_a = self.identify("a", ia, list(range(k)), sample)
            identity_b = self.identify("b", ib, list(range(k)), sample)

        # numerics, streaming over aligned tokens in blocks
        idx = np.flatnonzero(both)
        sw = ia.slot_width if basis == "values" else self.ra.sketch_dim
        bm = BlockMetrics(k, sw)
        tols = [self.opt.tolerances.for_tensor(ia.name, ia.dtype, ib.dtype, s if k > 1 else None) for s in range(k)]
        n = len(idx)
        cos_min = np.full(k, np.inf)
        cos_sum = np.zeros(k)
        rel_max = np.zeros(k)
        maxabs = np.zeros(k)
        failing = np.zeros(k, dtype=np.int64)
        nf_a = np.zeros(k, dtype=np.int64)
        nf_b = np.zeros(k, dtype=np.int64)
        first_fail: list = [None] * k
        first_nf: list = [None] * k
        by_regime: dict = defaultdict(lambda: {"tokens": 0, "failing": 0, "rel_max": 0.0})
        for blk, a_raw, b_raw in _prefetch(self._block_reader(ia, ib, basis, idx, ma, mb), self._pool):
            if basis == "values":  # stored form (bf16 bits); converted in cache-sized pieces
                m = bm.compute_stored(a_raw, ia.dtype, b_raw, ib.dtype)
            else:
                a = np.asarray(a_raw, np.float32)[:, :k * sw]
                b = np.asarray(b_raw, np.float32)[:, :k * sw]
                m = bm.compute(np.ascontiguousarray(a), np.ascontiguousarray(b))
            off = np.zeros_like(m["nonfinite"])
            for s in range(k):
                off[:, s] = (m["cos"][:, s] < tols[s].min_cos) | (m["rel"][:, s] > tols[s].max_rel)
            bad = off | m["nonfinite"]
            cos_min = np.minimum(cos_min, m["cos"].min(axis=0))
            cos_sum += m["cos"].sum(axis=0, dtype=np.float64)
            rel_max = np.maximum(rel_max, np.where(np.isfinite(m["rel"]), m["rel"], 0).max(axis=0))
            maxabs = np.maximum(maxabs, m["maxabs"].max(axis=0))
            failing += off.sum(axis=0)
            nf_a += m["nonfinite_a"].sum(axis=0)
            nf_b += m["nonfinite_b"].sum(axis=0)
            for s in range(k):
                if first_fail[s] is None and off[:, s].any():
                    j = int(np.argmax(off[:, s]))
                    first_fail[s] = (int(blk[j]), {mk: float(m[mk][j, s]) for mk in ("cos", "rel", "maxabs")})
                if first_nf[s] is None and m["nonfinite"][:, s].any():
                    j = int(np.argmax(m["nonfinite"][:, s]))
                    first_nf[s] = (int(blk[j]), int(m["nonfinite_a"][j, s]), int(m["nonfinite_b"][j, s]))
            regs = self.al.regime_b[blk]
            for rc in np.unique(regs):
                sel = regs == rc
                e = by_regime[REGIMES[int(rc)]]
                e["tokens"] += int(sel.sum())
                e["failing"] += int(bad[sel].any(axis=1).sum())
                relsel = m["rel"][sel]
                e["rel_max"] = max(e["rel_max"], float(np.nanmax(np.where(np.isfinite(relsel), relsel, 0))))
            # worst tokens overall (by rel, finite)
            rel_tok = np.where(np.isfinite(m["rel"]), m["rel"], 0).max(axis=1)
            top = np.argpartition(-rel_tok, WORST_TOKENS)[:WORST_TOKENS] if len(rel_tok) > WORST_TOKENS \
                else np.arange(len(rel_tok))
            for j in top:  # only this block's candidates for the global top list, no full sort
                item = (float(rel_tok[j]), next(self._tiebreak), None)
                if len(worst) < WORST_TOKENS or item[0] > worst[0][0]:
                    entry = self._token_entry(int(blk[j]))
                    entry.update(tensor=ia.name, rel=float(rel_tok[j]),
                                 slot=int(np.argmax(np.where(np.isfinite(m["rel"][j]), m["rel"][j], 0))),
                                 cos=float(m["cos"][j].min()))
                    item = (item[0], item[1], entry)
                    if len(worst) < WORST_TOKENS:
                        heapq.heappush(worst, item)
                    else:
                        heapq.heapreplace(worst, item)
            if summary is not None:
                summary.write(ia, ib, k, blk, m, bad)
            self._done += len(blk)
            self._progress("comparing tensors", min(self._done, self._total), self._total)
        st.tokens = n
        st.tolerance = [t.to_dict() for t in tols]
        st.cos_min = [float(x) for x in cos_min]
        st.cos_mean = [float(x) for x in cos_sum / max(n, 1)]
        st.rel_max = [float(x) for x in rel_max]
        st.maxabs = [float(x) for x in maxabs]
        st.failing = [int(x) for x in failing]
        st.nonfinite_a = [int(x) for x in nf_a]
        st.nonfinite_b = [int(x) for x in nf_b]
        st.by_regime = dict(by_regime)

        sides = (self.ra.side, self.rb.side)
        for s in range(k):
            where = f"slot {s} of {ib.name}" if k > 1 or ib.kind == "packed" else ib.label
            slot_arg = s if (k > 1 or ib.kind == "packed") else None
            if first_nf[s] is not None:
                ti, na_, nb_ = first_nf[s]
                side_txt = (f"{sides[1]} has {nb_} NaN/Inf" if nb_ and not na_ else
                            f"{sides[0]} has {na_} NaN/Inf" if na_ and not nb_ else
                            f"both sides have NaN/Inf ({na_} / {nb_})")
                findings.append(self._token_finding(
                    "nonfinite", f"NaN/Inf in {where} at {self._where(ti)}: {side_txt} values in that row",
                    ia, slot_arg, ti, {"nonfinite_a": int(nf_a[s]), "nonfinite_b": int(nf_b[s])}))
            idb, ida = identity_b.get(s), identity_a.get(s)
            claimed_a = ia.slot_labels[s] if ia.slot_labels else (ia.label if ia.kind != "packed" else None)
            claimed_b = ib.slot_labels[s] if ib.slot_labels else (ib.label if ib.kind != "packed" else None)
            identity_finding = None
            if idb is not None:
                held_a = ida.get("best") if ida else None
                held_b = idb.get("best")
                expected = held_a or claimed_a
                row = SlotRow(tensor=ib.name, slot=s, claimed_a=claimed_a, claimed_b=claimed_b, held_a=held_a,
                              held_b=held_b, score_b=idb.get("score"), margin_b=idb.get("margin"),
                              offset_b=int(idb.get("offset") or 0), candidates_b=idb.get("candidates", []),
                              expected=expected, cos_mean=st.cos_mean[s], rel_max=st.rel_max[s])
                off = row.offset_b
                held_txt = held_b if not off else f"{held_b} of the token {abs(off)} position{'s' if abs(off) > 1 else ''} {'earlier' if off < 0 else 'later'}"
                if held_b is not None and expected is not None and (held_b != expected or off != 0):
                    row.verdict = "wrong state"
                    identity_finding = self._token_finding(
                        "slot_identity", f"slot {s} of {ib.name} holds {held_txt} where {expected} was expected",
                        ia, s, first_fail[s][0] if first_fail[s] else int(np.flatnonzero(both)[0]),
                        {"held": held_b, "expected": expected, "offset": off, "score": idb.get("score"),
                         "margin": idb.get("margin"), "runner_up": idb.get("runner_up"),
                         "claimed_a": claimed_a, "claimed_b": claimed_b, "held_a": held_a,
                         "candidates": idb.get("candidates", [])})
                elif failing[s] and held_b is None:
                    row.verdict = "unknown state"
                    best_any = idb.get("best_any")
                    hint = f" (closest: {best_any}, score {idb.get('score'):.3f})" if best_any else ""
                    identity_finding = self._token_finding(
                        "slot_identity", f"slot {s} of {ib.name} holds no recorded state{hint} where {expected} was expected",
                        ia, s, first_fail[s][0] if first_fail[s] else int(np.flatnonzero(both)[0]),
                        {"held": None, "expected": expected, "claimed_a": claimed_a, "claimed_b": claimed_b,
                         "candidates": idb.get("candidates", [])})
                elif failing[s]:
                    row.verdict = "numeric drift"
                rows_out.append(row)
                for side_name, claimed, held, r in ((sides[0], claimed_a, held_a, ia), (sides[1], claimed_b, held_b, ib)):
                    if claimed and held and claimed != held:
                        findings.append(Finding(
                            "label_mismatch", "warning",
                            f"{side_name} labels slot {s} of {r.name} as {claimed}, but it holds {held}",
                            tensor=r.name, slot=s, order=r.order, details={"claimed": claimed, "held": held, "side": side_name}))
            if identity_finding is not None:
                findings.append(identity_finding)
            if failing[s] and first_fail[s] is not None:
                ti, mvals = first_fail[s]
                f = self._token_finding(
                    "numeric",
                    f"{where} diverges at {self._where(ti)}: cos {mvals['cos']:.4f}, rel err {mvals['rel']:.3g} "
                    f"(tolerance cos >= {tols[s].min_cos:g}, rel <= {tols[s].max_rel:g}); {int(failing[s])} of {n} tokens fail",
                    ia, slot_arg, ti, {**mvals, "failing": int(failing[s]), "tokens": n, "tolerance": tols[s].to_dict(),
                                       "basis": basis})
                if identity_finding is not None:
                    f.severity = "info"
                    f.message += " (explained by the wrong state above)"
                elif ia.kind != "packed" and (ia.kind, ib.kind) != ("packed", "packed"):
                    # a boundary that disagrees: does it hold another boundary?
                    idt = self.identify("b", ib, [0], self._sample(both, 64))[0]
                    if idt.get("best") and idt["best"] != ia.label:
                        f = self._token_finding(
                            "slot_identity", f"{ib.name} on {self.rb.side} holds {idt['best']} where {ia.label} was expected",
                            ib, None, ti, {"held": idt["best"], "expected": ia.label, "score": idt.get("score"),
                                           "margin": idt.get("margin"), "candidates": idt.get("candidates", [])})
                findings.append(f)
        return st, findings, rows_out

    def _block_reader(self, ia: TensorInfo, ib: TensorInfo, basis: str, idx: np.ndarray,
                      ma: np.ndarray, mb: np.ndarray):
        """Blocks of aligned rows of both sides, in stored form. Two buffer sets alternate, so the
        block being compared is never the one being read."""
        part = "values" if basis == "values" else "sketch"
        rows = min(len(idx), self.opt.block_rows)
        bufs = []
        for _ in range(2):
            da, db = self.ra._ds[ia.name][part], self.rb._ds[ib.name][part]
            bufs.append((np.empty((rows,) + da.shape[1:], da.dtype), np.empty((rows,) + db.shape[1:], db.dtype)))
        for i, s0 in enumerate(range(0, len(idx), self.opt.block_rows)):
            blk = idx[s0:s0 + self.opt.block_rows]
            buf_a, buf_b = bufs[i % 2]
            yield (blk, self.ra.read_at(ia.name, part, ma[blk], out=buf_a),
                   self.rb.read_at(ib.name, part, mb[blk], out=buf_b))

    def _token_entry(self, ti: int) -> dict:
        ca, cb = int(self.al.code_a[ti]), int(self.al.code_b[ti])
        mask = (1 << SEQ_BITS) - 1
        return {"seq": self.ra.sequences[ca >> SEQ_BITS], "position": ca & mask,
                "seq_b": self.rb.sequences[cb >> SEQ_BITS], "position_b": cb & mask,
                "token": int(self.al.token[ti]), "regime": REGIMES[int(self.al.regime_b[ti])], "index": ti}

    def _where(self, ti: int) -> str:
        e = self._token_entry(ti)
        s = f"token {e['token']} (seq {e['seq']}, position {e['position']}"
        if e["position_b"] != e["position"]:
            s += f"; position {e['position_b']} on B"
        return s + f", {e['regime']})"

    def _token_finding(self, kind: str, msg: str, info: TensorInfo, slot, ti: int, details: dict) -> Finding:
        e = self._token_entry(ti)
        details = dict(details)
        details["_tok_index"] = ti
        details["token_index"] = ti
        return Finding(kind, "divergence", msg, tensor=info.name, slot=slot, order=info.order, seq=e["seq"],
                       position=e["position"], position_b=e["position_b"], token=e["token"], regime=e["regime"],
                       details=details)


def _prefetch(gen, pool: ThreadPoolExecutor):
    """Run a block generator one block ahead in a thread: HDF5 reads (which hold h5py's lock)
    overlap the numpy metrics of the previous block (which release the GIL) on a second core."""
    it = iter(gen)
    fut = pool.submit(next, it, None)
    while True:
        item = fut.result()
        if item is None:
            return
        fut = pool.submit(next, it, None)
        yield item


def _verdict(scored: list[dict]) -> dict:
    if not scored:
        return {"best": None, "score": None, "reason": "no catalog state shares these tokens"}
    scored.sort(key=lambda x: (-x["score"], abs(x["offset"])))
    best = scored[0]
    runner = next((x for x in scored[1:] if (x["label"], x["offset"]) != (best["label"], best["offset"])), None)
    margin = best["score"] - (runner["score"] if runner else 0.0)
    confident = best["score"] >= CONFIDENT and margin >= MIN_MARGIN
    return {"best": best["label"] if confident else None, "best_any": best["label"], "score": best["score"],
            "offset": best["offset"], "margin": round(margin, 6), "runner_up": runner["label"] if runner else None,
            "runner_up_score": runner["score"] if runner else None, "candidates": scored[:5], "confident": confident}


def _gap_message(g: dict, ra: TraceReader, rb: TraceReader) -> str:
    side = ra.side if g["side"] == "a" else rb.side
    rng = ", ".join(f"{a}-{b}" if a != b else str(a) for a, b in g["positions"])
    return f"gap: {g['count']} tokens of sequence {g['seq']} only on {side} (positions {rng}): {g['reason']}"


def _order_findings(findings: list[Finding]) -> list[Finding]:
    """Sort in forward order and mark which divergences are inherited from an earlier one."""
    findings.sort(key=lambda f: f.sort_key())
    divs: list[Finding] = []
    for i, f in enumerate(findings):
        f.index = i
        if f.severity != "divergence":
            continue
        for g in divs:
            if g.kind in ("token_shift", "pairing") or (
                    f.kind in ("numeric", "nonfinite") and g.kind in ("numeric", "nonfinite", "slot_identity")
                    and g.order < f.order and g.seq == f.seq and (g.position or 0) <= (f.position or 0)):
                f.inherited_from = g.index
                f.details["inherited"] = f"may be inherited from finding #{g.index} ({g.kind} in {g.tensor or 'tokens'})"
                break
        divs.append(f)
    return findings


def diff_traces(path_a: str, path_b: str, options: DiffOptions | None = None) -> DiffResult:
    """Diff two traces: A the reference, B under test."""
    with Differ(path_a, path_b, options) as d:
        return d.run()
