"""The vectorised token alignment (SideTokens without per-row code arrays, every A
sequence's 3-gram votes and every pair's shifts counted at once) gives exactly the alignment of
the per-sequence implementation it replaced: pairs, shifts, gaps, mismatches, aligned codes,
tokens, regimes and row maps, on varied token tables (gaps, shifts, shared prefixes, many
sequences, rows out of order, re-recorded positions, short sequences)."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pytest

from tensordiff import align
from tensordiff.errors import IncompatibleTracesError
from tensordiff.findings import Gap, SeqPair
from tensordiff.tokens import POS_MASK, SEQ_BITS, token_code
from tensordiff.trace.schema import TOKEN_DTYPE

from test_align_index import _reference as _reference_candidates


class _Reader:
    """What the aligner reads of a trace: its token table, sequence keys, path, tensor rows."""

    def __init__(self, path, seq, pos, tok, regime, n_seqs):
        t = np.zeros(len(seq), TOKEN_DTYPE)
        t["seq"], t["position"], t["token"], t["regime"] = seq, pos, tok, regime
        self.tokens = t
        self.sequences = [f"req-{i}" for i in range(n_seqs)]
        self.path = path
        self.rows = {"all": np.arange(len(seq), dtype=np.int64),
                     "half": np.arange(0, len(seq), 2, dtype=np.int64)[::-1].copy()}

    def token_rows(self, name):
        return self.rows[name]


class _OldSide:
    """SideTokens as it was before the vectorised alignment (per-row code array kept)."""

    def __init__(self, r):
        t = r.tokens
        self.reader = r
        codes = token_code(t["seq"], t["position"])
        self.row_code = codes
        uniq, first_rev = np.unique(codes[::-1], return_index=True)
        last_rows = len(codes) - 1 - first_rev
        self.codes = uniq
        self.tok = t["token"][last_rows].astype(np.int64)
        self.regime = t["regime"][last_rows]
        self.row_valid = t["token"].astype(np.int64) == self.tok[np.searchsorted(uniq, codes)]
        seq_of = uniq >> SEQ_BITS
        self.seqs = {}
        cuts = np.flatnonzero(np.diff(seq_of)) + 1
        for s, e in zip(np.concatenate([[0], cuts]), np.concatenate([cuts, [len(uniq)]])):
            self.seqs[int(seq_of[s])] = (uniq[s:e] & POS_MASK, self.tok[s:e])

    def key(self, seq):
        return str(self.reader.sequences[seq])


def _old_align(ra, rb):
    """align_tokens before the vectorised alignment, on the per-sequence candidates of the dict-of-sets index."""
    A, B = _OldSide(ra), _OldSide(rb)
    cands = _reference_candidates(A, B)
    cands.sort(key=lambda c: (A.key(c[3]) != B.key(c[4]), -c[0], abs(c[2]), c[3], c[4]))   # same id first
    used_a, used_b = {}, set()
    for _m, _o, sh, sa, sb in cands:
        if sa not in used_a and sb not in used_b:
            used_a[sa] = (sb, sh)
            used_b.add(sb)
    seq_pairs, gaps, mismatches, shifts, parts_a, parts_b = [], [], [], defaultdict(int), [], []
    for sa, (pa, ta) in A.seqs.items():
        if sa not in used_a:
            gaps.append(Gap(A.key(sa), "a", align._ranges(pa), len(pa),
                                  "sequence only on A (no sequence of B has these token ids)"))
            continue
        sb, sh = used_a[sa]
        pb, tb = B.seqs[sb]
        idx_c = np.minimum(np.searchsorted(pb, pa + sh), len(pb) - 1)
        present = pb[idx_c] == pa + sh
        ok = present & (tb[idx_c] == ta)
        other = present & ~ok
        only_a = pa[~present]
        on_b = np.zeros(len(pb), bool)
        on_b[idx_c[present]] = True
        only_b = pb[~on_b]
        shifts[sh] += 1
        seq_pairs.append(SeqPair(A.key(sa), B.key(sb), sh, int(ok.sum()), len(only_a), len(only_b),
                                       int(other.sum())))
        if other.any():
            mismatches.append(align.TokenMismatch(A.key(sa), B.key(sb), align._ranges(pa[other]), int(other.sum()),
                                                  ta[other][:4].tolist(), tb[idx_c[other]][:4].tolist()))
        gaps += align._gaps(A.key(sa), "a", only_a, pa)
        gaps += align._gaps(B.key(sb), "b", only_b, pb)
        parts_a.append(token_code(sa, pa[ok]))
        parts_b.append(token_code(sb, pa[ok] + sh))
    for sb, (pb, _tb) in B.seqs.items():
        if sb not in used_b:
            gaps.append(Gap(B.key(sb), "b", align._ranges(pb), len(pb),
                                  "sequence only on B (no sequence of A has these token ids)"))
    code_a, code_b = np.concatenate(parts_a), np.concatenate(parts_b)
    order = np.argsort(code_a, kind="stable")
    code_a, code_b = code_a[order], code_b[order]
    ia, ib = np.searchsorted(A.codes, code_a), np.searchsorted(B.codes, code_b)
    al = align.TokenAlignment(code_a=code_a, code_b=code_b, token=A.tok[ia], regime_a=A.regime[ia],
                              regime_b=B.regime[ib], seq_pairs=seq_pairs, gaps=gaps, shifts=dict(shifts),
                              mismatches=mismatches)
    maps = {}
    for side, r, st, fn in (("a", ra, A, al.index_a), ("b", rb, B, al.index_b)):
        for name in r.rows:
            trow = r.token_rows(name)
            m = fn(st.row_code[trow])
            m[~st.row_valid[trow]] = -1
            maps[side, name] = m
    return al, maps


def _pair(rng, n_seq, length, vocab, prompt, layout):
    """Two token tables of ``n_seq`` sequences; B's differ from A's by the ``layout``."""
    pre = rng.integers(1, vocab, prompt)
    sides = [([], [], [], []), ([], [], [], [])]
    for s in range(n_seq):
        n = int(rng.integers(1, length + 1))
        t = np.concatenate([pre, rng.integers(1, vocab, n)])[:n]
        pos = np.arange(n)
        for col, v in zip(sides[0], (np.full(n, s), pos, t, np.zeros(n, np.uint8))):
            col.append(v)
        pb, tb = pos.copy(), t.copy()
        kind = layout if layout != "mixed" else ["same", "gap", "shift", "mismatch", "drop", "dup"][s % 6]
        if kind == "gap" and n > 3:                       # leading, middle and trailing gaps
            keep = np.ones(n, bool)
            keep[:int(rng.integers(0, n // 3 + 1))] = False
            keep[n // 2:n // 2 + 1] = False
            keep[n - int(rng.integers(0, 2)):] = False
            pb, tb = pb[keep], tb[keep]
        elif kind == "shift":
            pb = pb + int(rng.integers(-2, 3)) if n > 2 else pb
            pb = np.maximum(pb, 0) if pb.min() < 0 else pb
            if len(np.unique(pb)) != len(pb):
                pb = pos.copy()
        elif kind == "mismatch" and n > 1:
            tb[int(rng.integers(0, n))] += 1
        elif kind == "drop":
            continue                                      # only on A
        elif kind == "dup" and n > 1:                     # re-recorded positions: the last row wins
            k = int(rng.integers(1, n))
            pb = np.concatenate([pb, pb[:k]])
            tb = np.concatenate([tb, np.where(rng.random(k) < 0.5, tb[:k], tb[:k] + 7)])
        for col, v in zip(sides[1], (np.full(len(pb), s), pb, tb, np.ones(len(pb), np.uint8))):
            col.append(v)
    if layout == "mixed":                                 # sequences only on B, rows out of order
        for s in range(n_seq, n_seq + 3):
            n = int(rng.integers(1, length + 1))
            for col, v in zip(sides[1], (np.full(n, s), np.arange(n), rng.integers(1, vocab, n),
                                         np.ones(n, np.uint8))):
                col.append(v)
    readers = []
    for i, (sq, ps, tk, rg) in enumerate(sides):
        cols = [np.concatenate(c) for c in (sq, ps, tk, rg)]
        if layout == "mixed" and i == 1:
            perm = rng.permutation(len(cols[0]))   # both paths read the same shuffled table
            cols = [c[perm] for c in cols]
        readers.append(_Reader(f"{'ab'[i]}.h5", *cols, n_seqs=n_seq + 3))
    return readers


LAYOUTS = ["same", "gap", "shift", "mismatch", "dup", "mixed"]


def _new_equals_old(ra, rb, want, want_maps, dtypes: bool = False):
    """The new aligner's result on (ra, rb) against the frozen path's: every field and row map."""
    sa, sb = align.SideTokens(ra), align.SideTokens(rb)
    got = align.align_tokens(ra, rb, (sa, sb))
    for f in ("code_a", "code_b", "token", "regime_a", "regime_b"):
        np.testing.assert_array_equal(getattr(got, f), getattr(want, f), err_msg=f)
        if dtypes:
            assert getattr(got, f).dtype == getattr(want, f).dtype, f
    assert got.seq_pairs == want.seq_pairs
    assert got.gaps == want.gaps
    assert got.shifts == want.shifts
    assert got.mismatches == want.mismatches
    for side, r, st, fn in (("a", ra, sa, got.index_a), ("b", rb, sb, got.index_b)):
        for name in r.rows:
            np.testing.assert_array_equal(align.row_map(r, st, name, fn), want_maps[side, name])
    return got


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("shape", [(5, 40, 1000, 0), (30, 25, 50, 8), (80, 12, 6, 4), (70, 3, 4, 0)])
def test_alignment_pinned_against_the_per_sequence_path(seed, layout, shape):
    n_seq, length, vocab, prompt = shape
    rng = np.random.default_rng([seed, LAYOUTS.index(layout), n_seq])
    ra, rb = _pair(rng, n_seq, length, vocab, prompt, layout)
    try:
        want, want_maps = _old_align(ra, rb)
    except ValueError:      # nothing in common: the new path must say so too
        with pytest.raises(IncompatibleTracesError, match="no common tokens"):
            align.align_tokens(ra, rb)
        return
    _new_equals_old(ra, rb, want, want_maps)


def test_in_order_table_takes_the_fast_path_and_agrees():
    """A table in (sequence, position) order with each position once: no unique pass, same result."""
    rng = np.random.default_rng(3)
    ra, rb = _pair(rng, 20, 30, 100, 0, "same")
    st, old = align.SideTokens(ra), _OldSide(ra)
    assert np.all(np.diff(old.row_code) > 0)
    for f in ("codes", "tok", "regime", "row_valid"):
        np.testing.assert_array_equal(getattr(st, f), getattr(old, f))
    assert st.seqs.keys() == old.seqs.keys()
    for k in st.seqs:
        for x, y in zip(st.seqs[k], old.seqs[k]):
            np.testing.assert_array_equal(x, y)
    assert not hasattr(st, "row_code") and not hasattr(st, "last_rows")


# -- the same-tables path: exactly the general path's alignment, and only where it holds --


def _tables(seqs, regime=0):
    """Token-table columns of a list of (sequence index, positions, tokens)."""
    cols = [np.concatenate(c) for c in zip(*[(np.full(len(p), s), p, t, np.full(len(p), regime, np.uint8))
                                           for s, p, t in seqs])]
    return cols


def _same_pair(rng, n_seq, length, vocab, variant):
    """A pair whose tables describe the same sequences (B recorded from A's table), or one
    ``variant`` away from that."""
    a = []
    for s in range(n_seq):
        n = int(rng.integers(1, length + 1))
        a.append((s, np.arange(n), rng.integers(1, vocab, n)))
    if variant == "dup_seqs":                    # sequences with equal content (and prefixes of one another)
        a[1] = (1, a[0][1].copy(), a[0][2].copy())
        a[2] = (2, a[0][1][:max(1, len(a[0][1]) // 2)].copy(), a[0][2][:max(1, len(a[0][1]) // 2)].copy())
        a[3] = (3, a[0][1].copy(), a[0][2].copy())
    if variant in ("ten_copies", "eight_copies"):   # equal sequences (ten: the ranking cuts some partners)
        for s in range(1, 10 if variant == "ten_copies" else 8):
            a[s] = (s, a[0][1].copy(), a[0][2].copy())
    if variant in ("shared_by_8", "shared_by_9", "prompt_all"):   # a 4-token prompt opening 8, 9 or all
        pre = rng.integers(1, vocab, 4)
        for s in range({"shared_by_8": 8, "shared_by_9": 9}.get(variant, n_seq)):
            t = a[s][2]
            n = max(len(t), 5 if variant != "prompt_all" else 8)   # at least 1 (4) tokens of its own
            t = np.concatenate([pre, t, rng.integers(1, vocab, n)])[:n]
            a[s] = (s, np.arange(n), t)
    b = [(s, p.copy(), t.copy()) for s, p, t in a]
    k = n_seq // 2
    if variant == "one_token":
        b[k][2][len(b[k][2]) // 2] += 1
    elif variant == "reordered":                 # two sequences' indexes swapped on B
        b[k], b[k + 1] = (k, b[k + 1][1], b[k + 1][2]), (k + 1, b[k][1], b[k][2])
    elif variant == "shifted":                   # one sequence's positions one later on B
        b[k] = (k, b[k][1] + 1, b[k][2])
    elif variant == "one_more":                  # a token more at the end of one sequence
        b[k] = (k, np.arange(len(b[k][1]) + 1), np.concatenate([b[k][2], [5]]))
    elif variant == "one_less":                  # the last token of a sequence missing on B
        k = next(s for s in range(n_seq) if len(b[s][1]) > 1)
        b[k] = (k, b[k][1][:-1], b[k][2][:-1])
    elif variant == "extra_seq":                 # a sequence only on B
        b.append((n_seq, np.arange(4), rng.integers(1, vocab, 4)))
    readers = []
    for i, side in enumerate((a, b)):
        cols = _tables(side, regime=i)
        if variant == "rows_shuffled" and i == 1:   # same canonical tokens, rows in another order
            perm = rng.permutation(len(cols[0]))
            cols = [c[perm] for c in cols]
        readers.append(_Reader(f"{'ab'[i]}.h5", *cols, n_seqs=n_seq + 1))
    return readers


SAME = ["identical", "dup_seqs", "shared_by_8", "shared_by_9", "prompt_all", "eight_copies", "rows_shuffled"]   # the path holds
NEAR = ["one_token", "reordered", "shifted", "one_more", "one_less", "extra_seq", "ten_copies"]


def _check(ra, rb):
    want, want_maps = _old_align(ra, rb)
    return _new_equals_old(ra, rb, want, want_maps, dtypes=True)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("variant", SAME + NEAR)
@pytest.mark.parametrize("shape", [(12, 30, 1000), (90, 20, 5000), (70, 3, 50)])
def test_same_tables_path_pinned_and_taken_only_where_it_holds(seed, variant, shape):
    n_seq, length, vocab = shape
    rng = np.random.default_rng([seed, (SAME + NEAR).index(variant), n_seq])
    ra, rb = _same_pair(rng, n_seq, length, vocab, variant)
    got = _check(ra, rb)
    if variant in NEAR:
        assert got.path == "general", "the same-tables path taken on tables that differ"
    elif vocab >= 1000:    # few accidental 3-gram repeats: the condition holds
        assert got.path == "same tables"


def test_same_tables_path_against_the_general_path(monkeypatch):
    """On tables the same-tables path takes, the general path (forced) gives the same alignment."""
    rng = np.random.default_rng(11)
    for variant in SAME:
        ra, rb = _same_pair(rng, 100, 40, 30000, variant)
        fast = align.align_tokens(ra, rb)
        assert fast.path == "same tables", variant
        with monkeypatch.context() as m:
            m.setattr(align, "_same_tables", lambda *_a: False)
            slow = align.align_tokens(ra, rb)
        assert slow.path == "general"
        for f in ("code_a", "code_b", "token", "regime_a", "regime_b"):
            np.testing.assert_array_equal(getattr(fast, f), getattr(slow, f), err_msg=f)
        assert (fast.seq_pairs, fast.gaps, fast.shifts, fast.mismatches) == \
            (slow.seq_pairs, slow.gaps, slow.shifts, slow.mismatches)


def test_ten_copies_are_not_all_paired_by_the_general_path():
    """Why the condition counts sequences per 3-gram: with ten equal sequences (and more than 64,
    so no pair is tried beyond the ranking) the general path leaves two of them unpaired, where
    pairing by index would pair all ten."""
    rng = np.random.default_rng(2)
    ra, rb = _same_pair(rng, 90, 20, 5000, "ten_copies")
    got = _check(ra, rb)
    assert got.path == "general"
    assert sum(g.reason.startswith("sequence only on") for g in got.gaps) > 0


def test_same_tables_condition_refuses_what_breaks_the_proof(monkeypatch):
    """Ten equal sequences (no 3-gram of their own, shared by more than 8): the candidate ranking
    may cut a sequence's own partner, so the condition must not hold; eight copies, or nine
    sequences sharing a prompt but each with a 3-gram of its own: it holds. Past
    MAX_SHARED_GROUPS shared hashes to check it does not (the general path then, still exact)."""
    rng = np.random.default_rng(5)
    for variant, holds in (("shared_by_8", True), ("shared_by_9", True), ("eight_copies", True),
                           ("ten_copies", False), ("one_token", False)):
        ra, rb = _same_pair(rng, 100, 30, 30000, variant)
        A, B = align.SideTokens(ra), align.SideTokens(rb)
        assert align._same_tables(A, B, align._Flat(A)) is holds, variant
    monkeypatch.setattr(align, "MAX_SHARED_GROUPS", 0)
    ra, rb = _same_pair(rng, 100, 30, 30000, "eight_copies")
    assert _check(ra, rb).path == "general"


def test_in_order_side_holds_views_and_its_codes_are_the_row_codes():
    """The usual layout: positions and token ids are the token table's own columns (no copies, issue
    12's memory), with int64 values equal to the old side's, and a row's code is read from the codes."""
    rng = np.random.default_rng(8)
    ra, _rb = _pair(rng, 20, 30, 100, 0, "same")
    st, old = align.SideTokens(ra), _OldSide(ra)
    assert st.in_order
    for f in ("pos", "tok"):
        assert np.shares_memory(getattr(st, f), ra.tokens), f
        assert getattr(st, f).dtype == np.int64
    np.testing.assert_array_equal(st.pos, old.codes & POS_MASK)
    rows = rng.integers(0, len(ra.tokens), 500)
    np.testing.assert_array_equal(st.row_codes(rows), old.row_code[rows])
    # a table out of order: the old copies, and codes from the table
    ra2, rb2 = _pair(np.random.default_rng(9), 20, 30, 100, 0, "mixed")
    st2, old2 = align.SideTokens(rb2), _OldSide(rb2)
    assert not st2.in_order and not np.shares_memory(st2.tok, rb2.tokens)
    rows = np.arange(len(rb2.tokens))[::-1]
    np.testing.assert_array_equal(st2.row_codes(rows), old2.row_code[rows])


def test_same_tables_alignment_shares_the_sides_arrays():
    """No copies of the codes and tokens on the same-tables path (read only everywhere)."""
    ra, rb = _same_pair(np.random.default_rng(4), 100, 30, 30000, "identical")
    sa, sb = align.SideTokens(ra), align.SideTokens(rb)
    al = align.align_tokens(ra, rb, (sa, sb))
    assert al.path == "same tables"
    assert al.code_a is sa.codes and al.code_b is sb.codes and al.token is sa.tok
    np.testing.assert_array_equal(al.index_b(sb.codes), np.arange(len(sb.codes)))
    assert al._b_order is None      # B's codes already in order: no sort


@pytest.mark.parametrize("seed", range(4))
def test_member_is_isin(seed):
    """The same-tables check's membership test (a low-bits table, then binary search) is np.isin:
    negative hashes, values that share low bits with many others, none found, no values."""
    rng = np.random.default_rng(seed)
    h = rng.integers(-2**62, 2**62, 200_000, dtype=np.int64)
    h[::7] = h[::7] & 0xFFFF                            # many small values: low bits collide often
    values = np.unique(np.concatenate([rng.choice(h, 50), rng.integers(-2**62, 2**62, 50),
                                       (rng.integers(0, 4, 20) << 22) | 5]))   # equal low 22 bits
    h[:100] = (np.arange(100) << 22) | 5                 # low bits of a value, mostly not a value
    for v in (values, values[:1], values[:0], np.unique(h)):
        assert np.array_equal(align._member(h, v), np.isin(h, v))


def test_one_prompt_sampled_twice_pairs_by_request_id():
    """One prompt served in two batches (y, z) with near-equal responses; the engine's prefix
    cache left z without its prompt's rows but the last. The trainer holds batch z only: its z
    pairs with the engine's z (same request id, every overlapping token equal), not with y (more
    positions in common), in either order; the old rule's pairing was y."""
    rng = np.random.default_rng(5)
    prompt, resp = rng.integers(1, 1000, 12), rng.integers(1, 1000, 8)
    other = resp.copy()
    other[[2, 5]] += 1
    full_z, full_y = np.concatenate([prompt, resp]), np.concatenate([prompt, other])
    train = _Reader("train.h5", *_tables([(0, np.arange(20), full_z)]), n_seqs=1)
    train.sequences = ["z-p3"]
    engine = _Reader("engine.h5", *_tables([(0, np.arange(20), full_y), (1, np.arange(11, 20), full_z[11:])]),
                     n_seqs=2)
    engine.sequences = ["y-p3", "z-p3"]
    got = align.align_tokens(train, engine)
    assert [(p.a, p.b, p.tokens, p.mismatched) for p in got.seq_pairs] == [("z-p3", "z-p3", 9, 0)]
    back = align.align_tokens(engine, train)
    assert [(p.a, p.b, p.tokens, p.mismatched) for p in back.seq_pairs] == [("z-p3", "z-p3", 9, 0)]
    want, _ = _old_align(train, engine)      # the reference follows the same rule
    assert [(p.a, p.b) for p in want.seq_pairs] == [("z-p3", "z-p3")]
