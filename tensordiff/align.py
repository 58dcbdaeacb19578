"""The aligner: pair the token tables of two traces (sequences by token ids, positions, small
shifts, gaps), pair their tensors (by name, boundary, role), and map each tensor's rows onto the
aligned tokens. What a slot holds (:mod:`tensordiff.identity`), the numerics
(:mod:`tensordiff.numerics`) and the diff itself (:mod:`tensordiff.diff`) build on these maps.

A is the reference (what was expected, usually the train side), B the side under test.
numpy only; reads traces through :class:`tensordiff.trace.TraceSource` (a file or a set).

Why one module of this size: token pairing, shifts, gaps and the row maps share one index of
the token tables (sorted codes per side); split apart, each part would rebuild or pass it around.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
from numpy.typing import NDArray

from .errors import IncompatibleTracesError
from .findings import Finding, Gap, Kind, MissingDetails, SeqPair, Severity, regime_a_where_named
from .tokens import POS_MASK, SEQ_BITS, token_code
from .trace import TensorInfo, TraceSource

MAX_SHIFT = 2
MAX_SHARED_GROUPS = 20000   # the same-tables check looks at this many shared 3-gram hashes at most
MIN_MATCH = 0.75   # a sequence pair needs this share of its overlapping positions with equal token ids

Codes = NDArray[np.int64]


# ----------------------------------------------------------------------------------------------
# Token alignment
# ----------------------------------------------------------------------------------------------


Side = Literal["a", "b"]


@dataclass(frozen=True)
class TokenMismatch:
    """Paired positions of a sequence pair whose token ids differ (the first ids of each side)."""

    seq: str
    seq_b: str
    positions: list[list[int]]
    count: int
    tokens_a: list[int]
    tokens_b: list[int]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class TokenAlignment:
    """The aligned tokens, in A's order: row i pairs A's code_a[i] with B's code_b[i]."""

    code_a: Codes           # [n] seq<<SEQ_BITS|pos on side A, sorted (this is the aligned order)
    code_b: Codes           # [n] matching code on side B
    token: Codes            # [n] token id (A's)
    regime_a: NDArray[np.uint8]
    regime_b: NDArray[np.uint8]
    seq_pairs: list[SeqPair]
    gaps: list[Gap]
    shifts: dict[int, int]  # shift -> number of sequence pairs
    mismatches: list[TokenMismatch] = field(default_factory=list)  # paired positions with other token ids
    path: str = field(default="general", compare=False)   # "same tables": :func:`_same_tables` held
    _b_order: Codes | None = field(default=None, repr=False)
    _b_sorted: Codes | None = field(default=None, repr=False)

    def __len__(self) -> int:
        return len(self.code_a)

    def index_a(self, codes: Codes) -> Codes:
        """Aligned index of each A code, -1 where not aligned."""
        return _lookup(self.code_a, codes)

    def index_b(self, codes: Codes) -> Codes:
        if self._b_sorted is None:
            cb = self.code_b
            if len(cb) < 2 or bool(np.all(cb[1:] > cb[:-1])):
                self._b_sorted = cb          # already in order (B's codes distinct): no sort, no order array
            else:
                self._b_order = np.argsort(cb, kind="stable")
                self._b_sorted = cb[self._b_order]
        pos = _lookup(self._b_sorted, codes)
        if self._b_order is None:
            return pos
        return np.where(pos >= 0, self._b_order[np.maximum(pos, 0)], -1)

    def places(self, idx: Codes) -> tuple[Codes, Codes, NDArray[np.uint8], NDArray[np.uint8]]:
        """(A's sequence index, A's position, B's regime code, A's regime code) of the aligned
        tokens ``idx``: what :meth:`entry` gives token by token, as arrays."""
        ca = self.code_a[idx]
        return ca >> SEQ_BITS, ca & POS_MASK, self.regime_b[idx], self.regime_a[idx]

    def entry(self, ti: int, seqs_a: Sequence[str], seqs_b: Sequence[str], regimes: tuple[str, ...]) -> dict[str, Any]:
        """Where aligned token ``ti`` is on both sides, as plain data."""
        ca, cb = int(self.code_a[ti]), int(self.code_b[ti])
        ra, rb = regimes[int(self.regime_a[ti])], regimes[int(self.regime_b[ti])]
        d: dict[str, Any] = {"seq": seqs_a[ca >> SEQ_BITS], "position": ca & POS_MASK,
                             "seq_b": seqs_b[cb >> SEQ_BITS], "position_b": cb & POS_MASK,
                             "token": int(self.token[ti]), "regime": rb}
        if regime_a_where_named(ra, rb) is not None:
            d["regime_a"] = ra
        d["token_index"] = ti
        return d


def _lookup(sorted_codes: Codes, codes: Codes) -> Codes:
    if len(sorted_codes) == 0:
        return np.full(len(codes), -1, dtype=np.int64)
    if len(codes) == len(sorted_codes) and np.array_equal(codes, sorted_codes):
        return np.arange(len(codes), dtype=np.int64)   # every code at its own index (the same tables)
    pos = np.searchsorted(sorted_codes, codes)
    pos_c = np.minimum(pos, len(sorted_codes) - 1)
    return np.where(sorted_codes[pos_c] == codes, pos_c, -1).astype(np.int64)


def _int64_column(t: NDArray[Any], name: str) -> Codes:
    """A column of a token table as int64: a view when it is stored so (TOKEN_DTYPE), else a copy."""
    col = t[name]
    return col if col.dtype == np.int64 else col.astype(np.int64)


class SideTokens:
    """Canonical token per (sequence, position) on one side: the last row wins (a verify pass that
    was later recomputed is superseded). Holds the sorted unique codes with their token and regime,
    one byte per token row (``row_valid``: the row holds its code's canonical token) and each
    sequence's (positions, tokens) as views; a row's code is recomputed from the token table when a
    row map needs it (no per-row code array is kept). In the usual layout (every row canonical, in
    code order) the codes are the rows' codes, and the positions and token ids are views of the
    token table's columns, not copies (the memory bound of docs/diff.md)."""

    def __init__(self, r: TraceSource):
        t = r.tokens
        self.reader = r
        codes = token_code(t["seq"], t["position"])
        if len(codes) and bool(np.all(codes[1:] > codes[:-1])):
            # the usual layout (each sequence's positions once, in order): every row is canonical
            uniq = codes
            self.in_order = True
            self.tok: Codes = _int64_column(t, "token")
            self.pos: Codes = _int64_column(t, "position")
            self.regime: NDArray[np.uint8] = np.ascontiguousarray(t["regime"])
            self.row_valid: NDArray[np.bool_] = np.ones(len(codes), bool)
        else:
            self.in_order = False
            rev = codes[::-1]
            uniq, first_rev = np.unique(rev, return_index=True)   # last occurrence of each code
            last_rows = len(codes) - 1 - first_rev
            del rev, first_rev
            self.tok = t["token"][last_rows].astype(np.int64)
            self.regime = t["regime"][last_rows]
            del last_rows
            self.row_valid = (t["token"].astype(np.int64) == self.tok[np.searchsorted(uniq, codes)]
                              if len(codes) else np.zeros(0, bool))
            del codes
            self.pos = uniq & POS_MASK                           # the positions of the codes
        self.codes: Codes = uniq                                 # sorted unique codes
        seq_of = uniq >> SEQ_BITS
        self.seqs: dict[int, tuple[Codes, Codes]] = {}
        if len(uniq):
            cuts = np.flatnonzero(seq_of[1:] != seq_of[:-1]) + 1
            starts = np.concatenate([[0], cuts]).tolist()
            ends = np.concatenate([cuts, [len(uniq)]]).tolist()
            seq_ids = seq_of[starts].tolist()
            del seq_of
            for q, s, e in zip(seq_ids, starts, ends):
                self.seqs[q] = (self.pos[s:e], self.tok[s:e])

    def row_codes(self, rows: Codes) -> Codes:
        """Code of each token-table row in ``rows``."""
        if self.in_order:
            return self.codes[rows]
        t = self.reader.tokens
        return token_code(t["seq"][rows], t["position"][rows])

    def key(self, seq: int) -> str:
        return str(self.reader.sequences[seq])


def _ngram_hashes(tok: Codes, n: int = 3, limit: int | None = None) -> Codes:
    if limit is not None:
        tok = tok[:limit]
    if len(tok) < n:
        return np.array([hash(tuple(tok.tolist()))], dtype=np.int64) if len(tok) else np.zeros(0, np.int64)
    t = tok.astype(np.int64)
    h: Codes = t[:-2] * 1000003 ^ t[1:-1] * 10007 ^ t[2:]
    return h


def _shift_matches(pa: Codes, ta: Codes, pb: Codes, tb: Codes, s: int) -> tuple[int, int]:
    """(overlap, matches) when B position = A position + s."""
    idx = np.searchsorted(pb, pa + s)
    idx_c = np.minimum(idx, len(pb) - 1)
    present = pb[idx_c] == pa + s
    return int(present.sum()), int((present & (tb[idx_c] == ta)).sum())


class _NgramIndex:
    """B's 3-gram hashes as sorted numpy arrays: each (hash, B sequence) once, as a set per hash
    would hold them; ``sets(h)`` gives the B sequences with hash ``h``."""

    def __init__(self, B: Any, flat: _Flat | None = None):
        self.order = list(B.seqs)   # B's sequences in table order
        if self.order:
            h, q = _all_hashes(flat if flat is not None else _Flat(B))
            ids = np.array(self.order, np.int64)
            sb = ids[q]
            if bool(np.all(ids[1:] > ids[:-1])):   # ids ascending: a stable sort by hash sorts by (hash, id)
                o = np.argsort(h, kind="stable")
            else:
                o = np.lexsort((sb, h))
            h, sb = h[o], sb[o]
        else:
            h = sb = np.zeros(0, np.int64)
        keep = np.ones(len(h), bool)
        keep[1:] = (h[1:] != h[:-1]) | (sb[1:] != sb[:-1])
        self.h: Codes = h[keep]
        self.sb: Codes = sb[keep]

    def votes(self, ha: Codes) -> tuple[Codes, Codes, Codes]:
        """(B sequence, votes, first voting position) for A's hashes ``ha``: a B sequence gets a vote
        at each position of A whose hash it has (as looking each position up in a set per hash)."""
        lo = np.searchsorted(self.h, ha, "left")
        hi = np.searchsorted(self.h, ha, "right")
        cnt = hi - lo
        total = int(cnt.sum())
        if total == 0:
            z = np.zeros(0, np.int64)
            return z, z, z
        p = np.repeat(np.arange(len(ha), dtype=np.int64), cnt)
        start = np.repeat(lo - np.concatenate([[0], np.cumsum(cnt)[:-1]]), cnt)
        sb = self.sb[start + np.arange(total, dtype=np.int64)]
        o = np.lexsort((p, sb))
        sb, p = sb[o], p[o]
        first = np.flatnonzero(np.concatenate([[True], sb[1:] != sb[:-1]]))
        votes = np.diff(np.concatenate([first, [len(sb)]]))
        return sb[first], votes, p[first]

    def set_order(self, h: int) -> list[int]:
        """The order a Python set of the B sequences with hash ``h`` iterates in, each added in
        B's table order (the order the dict of votes saw them first)."""
        lo, hi = int(np.searchsorted(self.h, h, "left")), int(np.searchsorted(self.h, h, "right"))
        members = set(self.sb[lo:hi].tolist())
        s: set[int] = set()
        for x in self.order:
            if x in members:
                s.add(x)
        return list(s)


def _top_voted(index: _NgramIndex, ha: Codes, limit: int = 8) -> tuple[list[int], set[int]]:
    """The ``limit`` B sequences with most votes (ties: the one voted for first), and every B
    sequence voted for. Exactly the ranking of a dict of votes filled position by position,
    set by set, and sorted by votes (stable)."""
    sb, votes, first_p = index.votes(ha)
    voted = set(sb.tolist())
    if len(sb) <= limit:
        return sb.tolist(), voted
    o = np.lexsort((first_p, -votes))
    sb, votes, first_p = sb[o], votes[o], first_p[o]
    kv, kp = votes[limit - 1], first_p[limit - 1]
    group = np.flatnonzero((votes == kv) & (first_p == kp))
    if group[-1] < limit:   # the tie at the cut lies inside the top: its order does not matter
        return sb[:limit].tolist(), voted
    # voted for first at the same position: the set of that position's hash decides
    rank = {x: i for i, x in enumerate(index.set_order(int(ha[kp])))}
    tied = sorted(sb[group].tolist(), key=lambda x: rank[x])
    head = sb[:group[0]].tolist()
    return head + tied[:limit - len(head)], voted


class _Flat:
    """One side's sequences as flat arrays, in table order: ``pos``/``tok`` concatenated, sequence
    ``i`` (its id ``ids[i]``) at ``start[i]:start[i] + length[i]``."""

    def __init__(self, side: Any):
        self.ids: list[int] = list(side.seqs)
        self.length = np.array([len(p) for p, _t in side.seqs.values()], np.int64)
        self.start = np.cumsum(self.length) - self.length
        if isinstance(side, SideTokens):   # its sequences are consecutive slices of these
            self.pos, self.tok = side.pos, side.tok
        else:
            self.pos = np.concatenate([p for p, _t in side.seqs.values()]).astype(np.int64, copy=False)
            self.tok = np.concatenate([t for _p, t in side.seqs.values()]).astype(np.int64, copy=False)
        self.ordinal = np.repeat(np.arange(len(self.ids), dtype=np.int64), self.length)


def _all_hashes(A: _Flat) -> tuple[Codes, Codes]:
    """(hash, sequence ordinal) of every 3-gram of every sequence of a side, sequence by sequence
    in order: what :func:`_ngram_hashes` gives each sequence."""
    n = len(A.tok)
    t = A.tok
    if n >= 3:
        h_all: Codes = t[:-2] * 1000003 ^ t[1:-1] * 10007 ^ t[2:]
        ok = np.ones(n - 2, bool)   # a window starting in a sequence's last two positions crosses its end
        for back in (1, 2):
            at = A.start + A.length - back
            ok[at[(at >= A.start) & (at < n - 2)]] = False
        h, q = h_all[ok], A.ordinal[:n - 2][ok]
        del h_all, ok
    else:
        h = q = np.zeros(0, np.int64)
    short = np.flatnonzero(A.length < 3)
    if len(short):   # shorter than a 3-gram: one hash of the whole sequence
        hs = np.array([int(_ngram_hashes(A.tok[A.start[i]:A.start[i] + A.length[i]])[0]) for i in short.tolist()],
                      np.int64)
        h, q = np.concatenate([h, hs]), np.concatenate([q, short])
        o = np.argsort(q, kind="stable")
        h, q = h[o], q[o]
    return h, q


def _best_shifts(A: _Flat, B: _Flat, qa: Codes, qb: Codes) -> tuple[Codes, Codes, Codes]:
    """For each candidate pair (A ordinal ``qa[k]``, B ordinal ``qb[k]``): (matches, overlap, shift)
    at its best shift, as :func:`_shift_matches` over shifts 0, -1, 1, -2, 2 (most matches, the
    first such shift; matches 0: none). B's positions are keyed ``ordinal << SEQ_BITS | position``
    (sorted), so every pair's lookups are one ``searchsorted``, in chunks of pairs."""
    bkey = (B.ordinal << SEQ_BITS) | B.pos
    npair = len(qa)
    if len(bkey) == 0:
        z = np.zeros(npair, np.int64)
        return z, z, z
    best_m = np.zeros(npair, np.int64)
    best_o = np.zeros(npair, np.int64)
    best_s = np.zeros(npair, np.int64)
    la = A.length[qa]
    cap = np.minimum(la, B.length[qb])
    chunk_elems = 1 << 21
    todo = np.arange(npair, dtype=np.int64)
    for sh in sorted(range(-MAX_SHIFT, MAX_SHIFT + 1), key=abs):
        if sh != 0:   # a pair whose every position already matches cannot do better
            todo = todo[best_m[todo] < cap[todo]]
        if len(todo) == 0:
            break
        ends = np.cumsum(la[todo])
        lo = 0
        while lo < len(todo):
            hi = int(np.searchsorted(ends, (ends[lo - 1] if lo else 0) + chunk_elems, "right"))
            hi = max(hi, lo + 1)
            ks = todo[lo:hi]
            n_k = la[ks]
            first = np.cumsum(n_k) - n_k
            ia = np.repeat(A.start[qa[ks]] - first, n_k) + np.arange(int(n_k.sum()), dtype=np.int64)
            target = A.pos[ia] + sh
            inside = (target >= 0) & (target <= POS_MASK)
            q = (np.repeat(qb[ks], n_k) << SEQ_BITS) | np.where(inside, target, 0)
            idx = np.minimum(np.searchsorted(bkey, q), len(bkey) - 1)
            present = inside & (bkey[idx] == q)
            match = present & (B.tok[idx] == A.tok[ia])
            overlap = np.add.reduceat(present.astype(np.int64), first) if len(ks) else np.zeros(0, np.int64)
            matches = np.add.reduceat(match.astype(np.int64), first) if len(ks) else np.zeros(0, np.int64)
            upd = matches > best_m[ks]
            best_m[ks[upd]] = matches[upd]
            best_o[ks[upd]] = overlap[upd]
            best_s[ks[upd]] = sh
            lo = hi
    return best_m, best_o, best_s


def _pair_candidates(A: Any, B: Any, flats: tuple[_Flat, _Flat] | None = None) -> list[tuple[int, int, int, int, int]]:
    """Every plausible (matches, overlap, shift, seq a, seq b): B sequences that share 3-grams with
    an A sequence (up to 8 per A sequence; every B sequence when both traces are small), each at
    its best shift in -MAX_SHIFT..+MAX_SHIFT (most matching positions, then the smallest shift).
    The 3-gram index is sorted numpy arrays (no Python object per 3-gram); the votes of every A
    sequence are counted at once, and every pair's shifts are looked up at once."""
    fa, fb = flats if flats is not None else (_Flat(A), _Flat(B))
    index = _NgramIndex(B, fb)
    b_ord = {x: i for i, x in enumerate(fb.ids)}
    small = len(B.seqs) <= 64
    # votes: each (A 3-gram, B sequence having it); only the distinct (A sequence, B sequence)
    # pairs are kept (an A sequence with more than 8 is ranked by _top_voted below)
    ha, qa_h = _all_hashes(fa)
    o = np.argsort(ha)                        # sorted queries: searchsorted walks the index once
    ha = ha[o]
    qa_h = qa_h[o]
    del o
    lo = np.searchsorted(index.h, ha, "left")
    cnt = np.searchsorted(index.h, ha, "right")
    del ha
    cnt -= lo
    total = int(cnt.sum())
    if total == len(cnt) and bool(np.all(cnt == 1)):
        v_sb, v_qa = index.sb[lo], qa_h
    else:
        at = np.repeat(lo - (np.cumsum(cnt) - cnt), cnt) + np.arange(total, dtype=np.int64)
        v_sb, v_qa = index.sb[at], np.repeat(qa_h, cnt)
        del at
    del lo, cnt, qa_h
    nb = max(fb.ids) + 1 if fb.ids else 1
    key = v_qa * nb
    key += v_sb
    del v_qa, v_sb
    key = np.unique(key)                      # sorted: by A ordinal, then B id
    g_qa, g_sb = key // nb, key % nb
    del key
    bounds = np.searchsorted(g_qa, np.arange(len(fa.ids) + 1, dtype=np.int64))
    cand_a: list[int] = []
    cand_b: list[int] = []
    g_sb_l = g_sb.tolist()
    for i, sa in enumerate(fa.ids):
        s, e = int(bounds[i]), int(bounds[i + 1])
        if e - s <= 8:
            cands = g_sb_l[s:e]
            voted = set(cands)
        else:   # more than 8 voted: rank them (ties at the cut as the dict of votes did)
            cands, voted = _top_voted(index, _ngram_hashes(A.seqs[sa][1]))
        if small:
            cands = cands + [x for x in B.seqs if x not in voted]
        cand_a += [i] * len(cands)
        cand_b += [b_ord[x] for x in cands]
    qa = np.array(cand_a, np.int64)
    qb = np.array(cand_b, np.int64)
    m, ov, sh = _best_shifts(fa, fb, qa, qb)
    keep = (m > 0) & (m >= MIN_MATCH * ov)
    ids_a, ids_b = np.array(fa.ids, np.int64), np.array(fb.ids, np.int64)
    return list(zip(m[keep].tolist(), ov[keep].tolist(), sh[keep].tolist(), ids_a[qa[keep]].tolist(),
                    ids_b[qb[keep]].tolist()))


def _same_tables(A: SideTokens, B: SideTokens, fa: _Flat) -> bool:
    """Whether the general path is known to pair every sequence with the same-numbered sequence of
    the other side at shift 0 (a train side recorded from the serve side's token table, say), so
    that :func:`_aligned_as_is` gives exactly its alignment. Holds when:

    1. both sides hold the same canonical tokens: equal sorted codes (sequence index and position)
       and equal token ids (regimes may differ); the sequence keys are equal index by index, or no
       key is on both sides (a key on both sides at other indexes would pair first, :func:`_rank`);
    2. ``(i, i)`` is among the candidates of every sequence ``i``, at shift 0 with ``len(i)``
       matches (the most any pair with ``i`` can have). Sure when ``i`` has a 3-gram hash (as
       :func:`_all_hashes` gives them) that no other sequence has: then B's ``i`` alone gets a vote
       at every position of A's ``i``, so it ranks first; or when ``i`` shares hashes with at most
       8 sequences, itself included: then every sequence voted for is a candidate (the ranking
       cuts at 8). Sequences sharing a system prompt pass by the first rule, copies by neither.

    Given both, the greedy assignment takes ``(i, i)`` for every ``i``: were ``(i, j)``, ``j != i``,
    the first other pair taken, both ``i`` and ``j`` would still be free on both sides, so
    ``(i, i)`` and ``(j, j)`` would sort after it; that needs ``len(i)`` matches at shift 0 and
    ``j < i`` for the first, ``len(j)`` matches and ``i < j`` for the second. Anything else goes
    the general way (tests/test_align_pinned.py checks both paths against the old one)."""
    if len(A.codes) != len(B.codes) or len(A.seqs) != len(B.seqs):
        return False
    if not (np.array_equal(A.codes, B.codes) and np.array_equal(A.tok, B.tok)):
        return False
    ka, kb = [A.key(i) for i in fa.ids], [B.key(i) for i in fa.ids]
    if ka != kb and set(ka) & set(kb):
        return False
    h, q = _all_hashes(fa)
    hs = np.sort(h)
    dup = hs[1:][hs[1:] == hs[:-1]]             # the values found more than once
    del hs
    if len(dup) == 0:
        return True          # no hash in two places: each sequence votes for itself alone
    shared = _member(h, np.unique(dup))
    has_own = np.zeros(len(fa.ids), bool)
    has_own[q[~shared]] = True                  # a hash found once in the whole side
    rest = np.flatnonzero(~has_own)
    if len(rest) == 0:
        return True
    # only the rows of repeated hashes from here (few, unless sequences share text)
    hd, qd = h[shared], q[shared]
    del h, q, shared
    o = np.argsort(hd, kind="stable")
    hs, qs = hd[o], qd[o]
    del o, hd, qd
    first = np.ones(len(hs), bool)
    first[1:] = hs[1:] != hs[:-1]
    starts = np.flatnonzero(first)
    count = np.diff(np.append(starts, len(hs)))
    # sequences without a hash of their own: the sequences sharing any of their hashes, at most 8
    at = np.flatnonzero(np.isin(qs, rest))      # rows of those sequences, in hash order
    groups = np.unique((np.cumsum(first) - 1)[at])   # the hash groups of those rows
    if len(groups) > MAX_SHARED_GROUPS:
        return False         # many shared hashes to look at: the general path is as quick
    share: dict[int, set[int]] = {}
    for g in groups.tolist():
        lo, hi = int(starts[g]), int(starts[g]) + int(count[g])
        members = set(qs[lo:hi].tolist())
        if len(members) > 8:
            return False     # nine sequences share a hash: each votes for all nine
        for x in members:
            if not has_own[x]:
                share.setdefault(x, set()).update(members)
                if len(share[x]) > 8:
                    return False
    return True


def _member(h: Codes, values: Codes) -> NDArray[np.bool_]:
    """``np.isin(h, values)`` for a few sorted distinct ``values`` among many ``h``, without sorting
    ``h``: a table of their low bits rules out nearly every element in one pass, and only the rest
    are looked up by binary search."""
    bits = 22
    table = np.zeros(1 << bits, bool)
    table[values & ((1 << bits) - 1)] = True
    maybe = np.flatnonzero(table[h & ((1 << bits) - 1)])
    out = np.zeros(len(h), bool)
    if len(maybe) and len(values):
        cand = h[maybe]
        at = np.minimum(np.searchsorted(values, cand), len(values) - 1)
        out[maybe[values[at] == cand]] = True
    return out


def _aligned_as_is(A: SideTokens, B: SideTokens) -> TokenAlignment:
    """The alignment of two sides whose tables :func:`_same_tables` found equal: sequence ``i`` with
    sequence ``i`` at shift 0, every position on both sides with the same token id (no gap, no
    mismatch), in the general path's order and form. The codes and tokens are the sides' own
    arrays (read only), not copies."""
    seq_pairs = [SeqPair(A.key(sa), B.key(sa), 0, len(pa), 0, 0, 0) for sa, (pa, _ta) in A.seqs.items()]
    return TokenAlignment(code_a=A.codes, code_b=B.codes, token=A.tok, regime_a=A.regime, regime_b=B.regime,
                          seq_pairs=seq_pairs, gaps=[], shifts={0: len(seq_pairs)}, mismatches=[],
                          path="same tables")


def _rank(A: SideTokens, B: SideTokens, c: tuple[int, int, int, int, int]) -> tuple[int, ...]:
    """The order the greedy assignment takes candidates (matches, overlap, shift, seq a, seq b) in:
    a pair whose two sides carry the same request / sample id first (the n samples of one prompt,
    or one prompt served in two batches, are told apart by it alone where a prefix cache left one
    of them without its prompt's rows), then the most matched positions, the smaller shift."""
    return (A.key(c[3]) != B.key(c[4]), -c[0], abs(c[2]), c[3], c[4])


def align_tokens(ra: TraceSource, rb: TraceSource,
                 sides: tuple[SideTokens, SideTokens] | None = None) -> TokenAlignment:
    """Pair sequences and positions of two traces. ``sides``: their :class:`SideTokens`, when the
    caller already built them (the differ keeps them to map tensor rows).

    Sequences pair by a global assignment over (sequence a, sequence b, shift), scored on matched
    tokens: all candidate pairs sorted by matched positions (then smaller shift), each taken when
    both of its sequences are still free. So a sequence goes to the partner it shares most tokens
    with, whatever the file order, and a shared system prompt cannot steal another's partner."""
    A, B = sides or (SideTokens(ra), SideTokens(rb))
    if not A.seqs:
        raise IncompatibleTracesError("the trace has no tokens (empty trace)", ra.path)
    if not B.seqs:
        raise IncompatibleTracesError("the trace has no tokens (empty trace)", rb.path)
    fa = _Flat(A)
    if _same_tables(A, B, fa):
        return _aligned_as_is(A, B)
    fb = _Flat(B)
    cands = _pair_candidates(A, B, (fa, fb))
    cands.sort(key=lambda c: _rank(A, B, c))
    used_a: dict[int, tuple[int, int]] = {}
    used_b: set[int] = set()
    for _m, _o, sh, sa, sb in cands:
        if sa not in used_a and sb not in used_b:
            used_a[sa] = (sb, sh)
            used_b.add(sb)
    # every paired sequence's positions looked up at once, in A's table order; B's positions are
    # keyed ordinal << SEQ_BITS | position (sorted)
    b_ord = {x: i for i, x in enumerate(fb.ids)}
    paired = [(i, sa) for i, sa in enumerate(fa.ids) if sa in used_a]
    qa = np.array([i for i, _sa in paired], np.int64)
    qb = np.array([b_ord[used_a[sa][0]] for _i, sa in paired], np.int64)
    shv = np.array([used_a[sa][1] for _i, sa in paired], np.int64)
    la = fa.length[qa]
    first = np.cumsum(la) - la
    ia = np.repeat(fa.start[qa] - first, la) + np.arange(int(la.sum()), dtype=np.int64)
    target = fa.pos[ia] + np.repeat(shv, la)
    inside = (target >= 0) & (target <= POS_MASK)
    bkey = (fb.ordinal << SEQ_BITS) | fb.pos
    q = (np.repeat(qb, la) << SEQ_BITS) | np.where(inside, target, 0)
    idx = np.minimum(np.searchsorted(bkey, q), len(bkey) - 1)
    present = inside & (bkey[idx] == q)
    del q, inside, target, bkey
    ok = present & (fb.tok[idx] == fa.tok[ia])
    other = present & ~ok                          # on both sides, with different token ids
    on_b = np.zeros(len(fb.pos), bool)
    on_b[idx[present]] = True
    if len(paired):
        n_ok = np.add.reduceat(ok.astype(np.int64), first).tolist()
        n_other = np.add.reduceat(other.astype(np.int64), first).tolist()
        n_present = np.add.reduceat(present.astype(np.int64), first).tolist()
    else:
        n_ok = n_other = n_present = []
    b_on = np.add.reduceat(on_b.astype(np.int64), fb.start).tolist()
    seq_pairs: list[SeqPair] = []
    gaps: list[Gap] = []
    mismatches: list[TokenMismatch] = []
    shifts: dict[int, int] = defaultdict(int)
    k = 0
    la_l, first_l, qb_l = la.tolist(), first.tolist(), qb.tolist()
    for sa, (pa, ta) in A.seqs.items():
        if sa not in used_a:
            gaps.append(Gap(A.key(sa), "a", _ranges(pa), len(pa),
                            "sequence only on A (no sequence of B has these token ids)"))
            continue
        sb, sh = used_a[sa]
        j, n_a, lo = qb_l[k], la_l[k], first_l[k]
        n_b = int(fb.length[j])
        only_a, only_b = n_a - n_present[k], n_b - b_on[j]
        shifts[sh] += 1
        seq_pairs.append(SeqPair(A.key(sa), B.key(sb), sh, n_ok[k], only_a, only_b, n_other[k]))
        if n_other[k]:
            oth = other[lo:lo + n_a]
            mismatches.append(TokenMismatch(A.key(sa), B.key(sb), _ranges(pa[oth]), n_other[k],
                                            ta[oth][:4].tolist(), fb.tok[idx[lo:lo + n_a][oth]][:4].tolist()))
        if only_a:
            gaps += _gaps(A.key(sa), "a", pa[~present[lo:lo + n_a]], pa)
        if only_b:
            pb = B.seqs[sb][0]
            sj = int(fb.start[j])
            gaps += _gaps(B.key(sb), "b", pb[~on_b[sj:sj + n_b]], pb)
        k += 1
    for sb, (pb, _tb) in B.seqs.items():
        if sb not in used_b:
            gaps.append(Gap(B.key(sb), "b", _ranges(pb), len(pb),
                            "sequence only on B (no sequence of A has these token ids)"))
    if not ok.any():
        raise IncompatibleTracesError(
            f"no common tokens: no sequence of {os.path.basename(ra.path)} matches a sequence of "
            f"{os.path.basename(rb.path)} by token ids (tried position shifts -{MAX_SHIFT}..+{MAX_SHIFT})")
    del other, present, on_b
    keep = np.flatnonzero(ok)
    del ok
    ids_a, ids_b = np.array(fa.ids, np.int64), np.array(fb.ids, np.int64)
    code_a = (ids_a[fa.ordinal[ia[keep]]] << SEQ_BITS) | fa.pos[ia[keep]]
    ub = idx[keep]            # B's code at each kept position (its sequence's, at position + shift)
    code_b = (ids_b[fb.ordinal[ub]] << SEQ_BITS) | fb.pos[ub]
    order = np.argsort(code_a, kind="stable")
    code_a, code_b = code_a[order], code_b[order]
    ua = ia[keep][order]      # SideTokens: the flat order is the order of its sorted codes
    ub = ub[order]
    return TokenAlignment(code_a=code_a, code_b=code_b, token=A.tok[ua], regime_a=A.regime[ua],
                          regime_b=B.regime[ub], seq_pairs=seq_pairs, gaps=gaps, shifts=dict(shifts),
                          mismatches=mismatches)


def _ranges(pos: Codes, limit: int = 8) -> list[list[int]]:
    if len(pos) == 0:
        return []
    cuts = np.flatnonzero(np.diff(pos) != 1) + 1
    out = [[int(p[0]), int(p[-1])] for p in np.split(pos, cuts)]
    return out[:limit]


def _gaps(seq: str, side: Side, missing: Codes, have: Codes) -> list[Gap]:
    """Gap records of one sequence on one side, one per reason: the run that starts at the
    sequence's first position (a prefix-cache hit), the run that ends at its last (truncation,
    rows past an accept length, the last generated token), and any others in the middle."""
    if len(missing) == 0:
        return []
    other = "B" if side == "a" else "A"
    cuts = np.flatnonzero(np.diff(missing) != 1) + 1
    runs = np.split(missing, cuts)
    lead = [r for r in runs if r[0] == have[0]]
    tail = [r for r in runs if r[-1] == have[-1] and r[0] != have[0]]
    mid = [r for r in runs if r[0] != have[0] and r[-1] != have[-1]]
    out = []
    for group, reason in ((lead, f"leading positions absent on {other} (prefix-cache hit, or truncation)"),
                          (tail, (f"trailing positions absent on {other} (truncation, or rows past a draft's "
                                  "accept length)")),
                          (mid, f"positions absent on {other}")):
        if group:
            pos = np.concatenate(group)
            out.append(Gap(seq, side, _ranges(pos), len(pos), reason))
    return out


# ----------------------------------------------------------------------------------------------
# Tensor pairing and row maps
# ----------------------------------------------------------------------------------------------


def _pair_key(i: TensorInfo) -> tuple[Any, ...] | None:
    if i.kind == "boundary":
        return ("boundary", i.boundary)
    if i.kind == "final_norm":
        return ("final_norm",)
    if i.kind == "packed":
        return ("packed", i.role or "")
    return None


def pair_tensors(ra: TraceSource, rb: TraceSource) -> tuple[list[tuple[TensorInfo, TensorInfo]], list[Finding]]:
    """Pairs of tensors to compare: same name; else same boundary, final_norm or packed role
    (when unique); else the one packed tensor of each side. The rest are notes."""
    ta: dict[str, TensorInfo] = dict(ra.tensors)
    tb: dict[str, TensorInfo] = dict(rb.tensors)
    pairs: list[tuple[TensorInfo, TensorInfo]] = []
    for name in sorted(set(ta) & set(tb)):
        pairs.append((ta.pop(name), tb.pop(name)))
    by_key_b: dict[tuple[Any, ...] | None, list[TensorInfo]] = defaultdict(list)
    for i in tb.values():
        by_key_b[_pair_key(i)].append(i)
    for name in sorted(ta):
        k = _pair_key(ta[name])
        if k is not None and len(by_key_b.get(k, [])) == 1:
            other = by_key_b.pop(k)[0]
            tb.pop(other.name)
            pairs.append((ta.pop(name), other))
    packed_a = [i for i in ta.values() if i.kind == "packed"]
    packed_b = [i for i in tb.values() if i.kind == "packed"]
    if len(packed_a) == 1 and len(packed_b) == 1:
        pairs.append((ta.pop(packed_a[0].name), tb.pop(packed_b[0].name)))
    notes = [Finding(Kind.MISSING, Severity.INFO, tensor=i.name, order=i.order,
                     details=MissingDetails(reason="one_side", label=i.label, side=side))
             for side, rest in (("A", ta), ("B", tb)) for i in rest.values()]
    pairs.sort(key=lambda p: (p[0].order, p[0].name))
    return pairs, notes


def row_map(r: TraceSource, side_tokens: SideTokens, name: str, index_fn: Callable[[Codes], Codes]) -> Codes:
    """Tensor row -> aligned index (or -1), built from the tensor's token rows."""
    trow = r.token_rows(name)
    codes = side_tokens.row_codes(trow)
    valid = side_tokens.row_valid[trow]
    aligned = index_fn(codes)
    aligned[~valid] = -1
    return aligned


MAP_CACHE_BYTES = 64 << 20   # row maps kept per diff (LRU, the last of each side always); 8 bytes per aligned token each


class RowMaps:
    """Aligned token index -> tensor row, per side and tensor. Built once per distinct set of
    token rows and kept (the tensors of one trace usually share theirs: the trace reader holds one
    array for equal row indexes, and equal arrays are recognised here too), least recently used
    dropped past :data:`MAP_CACHE_BYTES`; a lookup at sampled tokens is then a gather."""

    def __init__(self, al: TokenAlignment, ra: TraceSource, rb: TraceSource, sa: SideTokens, sb: SideTokens,
                 cache_bytes: int = MAP_CACHE_BYTES):
        self.al, self.ra, self.rb, self.sa, self.sb = al, ra, rb, sa, sb
        self.cache_bytes = cache_bytes
        # (side, id of a token-rows array) -> key; key -> (that array, the inverse map)
        self._alias: dict[tuple[str, int], tuple[str, int, int, bytes]] = {}
        self._maps: OrderedDict[tuple[str, int, int, bytes], tuple[Codes, Codes]] = OrderedDict()
        self.built = 0   # maps built (for tests and benchmarks)
        self._lock = threading.Lock()

    def inverse(self, side: str, name: str) -> Codes:
        """[len(alignment)] tensor row of each aligned token (-1: none); the last tensor row wins
        on duplicates. Shared: never modify it."""
        with self._lock:
            return self._inverse(side, name)

    def _inverse(self, side: str, name: str) -> Codes:
        r, st, fn = (self.ra, self.sa, self.al.index_a) if side == "a" else (self.rb, self.sb, self.al.index_b)
        trow = r.token_rows(name)
        key = self._alias.get((side, id(trow)))
        hit = self._maps.get(key) if key is not None else None
        if hit is None or hit[0] is not trow:
            step = max(1, len(trow) // 64)
            key = (side, len(trow), int(trow.sum()) if len(trow) else 0, trow[::step].tobytes())
            hit = self._maps.get(key)
            if hit is None or not np.array_equal(hit[0], trow):
                rowmap = row_map(r, st, name, fn)
                inv = np.full(len(self.al), -1, dtype=np.int64)
                ok = rowmap >= 0
                inv[rowmap[ok]] = np.flatnonzero(ok)  # the last tensor row wins on duplicates
                self.built += 1
                hit = self._maps[key] = (trow, inv)
                self._evict(key)
            self._alias[(side, id(trow))] = key
        assert key is not None
        self._maps.move_to_end(key)
        return hit[1]

    def _evict(self, keep: tuple[str, int, int, bytes]) -> None:
        """Least recently used maps out past the bound, but never the last one of either side: the
        plan asks A's and B's map of each pair in turn, and where one map alone passes the bound
        (8 bytes per aligned token: 10M tokens) evicting the other side's would rebuild both for
        every pair."""
        total = sum(inv.nbytes for _, inv in self._maps.values())
        last = {k[0]: k for k in self._maps}   # the most recently used key of each side
        kept = set(last.values()) | {keep}
        for k in [k for k in self._maps if k not in kept]:
            if total <= self.cache_bytes:
                break
            total -= self._maps.pop(k)[1].nbytes
            self._alias = {a: v for a, v in self._alias.items() if v != k}

    def rows_at(self, side: str, name: str, index_lists: list[Codes]) -> list[Codes]:
        """Tensor row for each aligned index in each array (-1: absent or index -1)."""
        inv = self.inverse(side, name)
        return [np.where(ix >= 0, inv[np.maximum(ix, 0)], -1) for ix in index_lists]

    def offset_index(self, sample: Codes, offset: int) -> Codes:
        """Aligned index of the token ``offset`` positions after each sampled one (-1: none)."""
        if offset == 0:
            return sample
        codes = self.al.code_a[sample] + offset  # same sequence: position lives in the low bits
        return self.al.index_a(codes)


def sample_indices(both: NDArray[np.bool_], k: int) -> Codes:
    """Up to ``k`` aligned indices present on both sides, as a few runs of consecutive tokens
    spread over the trace: runs keep the reads to a few chunks per candidate and contain the
    neighbours that shifted candidates need."""
    idx = np.flatnonzero(both)
    if len(idx) <= k:
        return idx
    runs, run_len = 8, max(1, k // 8)
    starts = np.linspace(0, len(idx) - run_len, runs).astype(np.int64)
    pick = np.unique((starts[:, None] + np.arange(run_len)[None, :]).reshape(-1))
    out: Codes = idx[pick]
    return out
