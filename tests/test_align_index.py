"""The aligner's numpy 3-gram index gives exactly the candidates of the dict-of-sets index it
replaced, including which B sequences make the top 8 when votes tie at the cut."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pytest

from tensordiff import align
from tensordiff.align import MAX_SHIFT, MIN_MATCH, _ngram_hashes, _pair_candidates, _shift_matches


class _Side:
    def __init__(self, seqs):
        self.seqs = seqs


def _reference(A, B):
    """The index the numpy one replaced: a Python set of B sequences per 3-gram hash, a dict of votes."""
    index = defaultdict(set)
    for sb, (_pb, tb) in B.seqs.items():
        for h in _ngram_hashes(tb).tolist():
            index[h].add(sb)
    out = []
    small = len(B.seqs) <= 64
    for sa, (pa, ta) in A.seqs.items():
        votes = defaultdict(int)
        for h in _ngram_hashes(ta).tolist():
            for sb in index.get(h, ()):
                votes[sb] += 1
        cands = sorted(votes, key=lambda x: -votes[x])[:8]
        if small:
            cands += [x for x in B.seqs if x not in votes]
        for sb in cands:
            pb, tb = B.seqs[sb]
            best = None
            for sh in sorted(range(-MAX_SHIFT, MAX_SHIFT + 1), key=abs):
                overlap, matches = _shift_matches(pa, ta, pb, tb, sh)
                if matches and (best is None or matches > best[0]):
                    best = (matches, overlap, sh)
            if best is not None and best[0] >= MIN_MATCH * best[1]:
                out.append((best[0], best[1], best[2], sa, sb))
    return out


def _sides(rng, n_a, n_b, length, prompt, vocab, dup):
    """Sequences sharing a ``prompt``-token prefix, ids from a ``vocab``-sized vocabulary (small:
    many equal 3-grams), ``dup`` of B's sequences copies of others (equal votes everywhere)."""
    pre = rng.integers(1, vocab, prompt)

    def seq():
        n = int(rng.integers(1, length + 1))
        t = np.concatenate([pre, rng.integers(1, vocab, n)])[:n].astype(np.int64)
        return np.arange(n, dtype=np.int64), t
    a = {i: seq() for i in range(n_a)}
    b_list = [a[int(rng.integers(0, n_a))] if rng.random() < 0.5 else seq() for _ in range(n_b)]
    for _ in range(dup):
        b_list.append(b_list[int(rng.integers(0, len(b_list)))])
    perm = rng.permutation(3 * len(b_list))[:len(b_list)]  # B's sequence ids: sparse, unordered
    b = {int(k): v for k, v in zip(perm, b_list)}
    return _Side(a), _Side(b)


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("shape", [(20, 30, 12, 4, 6, 5), (40, 90, 20, 8, 5, 20), (10, 200, 9, 6, 3, 50),
                                   (30, 70, 2, 0, 4, 10)])
def test_numpy_index_gives_the_same_candidates(seed, shape):
    n_a, n_b, length, prompt, vocab, dup = shape
    A, B = _sides(np.random.default_rng(seed), n_a, n_b, length, prompt, vocab, dup)
    # align_tokens sorts them by (matches, shift, seq a, seq b), unique per pair: compare as sets
    assert sorted(_pair_candidates(A, B)) == sorted(_reference(A, B))


def test_ties_at_the_cut_follow_the_set_order():
    """Many B sequences with the same votes, first voted at the same position: the top 8 are the
    ones a set of that hash iterates first, not the smallest ids."""
    rng = np.random.default_rng(3)
    t = rng.integers(1, 50, 10).astype(np.int64)
    p = np.arange(10, dtype=np.int64)
    A = _Side({0: (p, t)})
    ids = list(range(1000, 1100))   # 100 copies of A's sequence; a set of them starts at 1024
    B = _Side({i: (p, t) for i in ids})
    got = _pair_candidates(A, B)
    assert sorted(got) == sorted(_reference(A, B))
    assert len(got) == 8 and sorted(x[4] for x in got) != sorted(ids)[:8]


def test_no_python_object_per_ngram():
    """The index is numpy arrays (the dict of sets cost ~100 bytes per 3-gram at 1M tokens)."""
    rng = np.random.default_rng(0)
    B = _Side({i: (np.arange(50, dtype=np.int64), rng.integers(1, 30000, 50).astype(np.int64)) for i in range(100)})
    idx = align._NgramIndex(B)
    assert isinstance(idx.h, np.ndarray) and isinstance(idx.sb, np.ndarray) and len(idx.h) == 100 * 48
