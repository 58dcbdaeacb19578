"""The DP union: the members' token tables as one, with their sequence ids renumbered.

Token shards (DP ranks, or files without a rank suffix) must hold disjoint (sequence, position)
codes, and all the files must agree on the token id of every code they share (one recording)."""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

from ..errors import IncompatibleTracesError
from ..tokens import POS_MASK, SEQ_BITS
from ..trace import TOKEN_DTYPE
from .members import Member

_Canon = list[tuple[np.ndarray, np.ndarray, Member]]   # per member: sorted codes, their token ids, the member


def last_per_code(codes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sorted unique codes and, for each, the index of its last occurrence."""
    rev = codes[::-1]
    uniq, first_rev = np.unique(rev, return_index=True)
    return uniq, len(codes) - 1 - first_rev


def merge_tokens(members: Sequence[Member], path: str) -> tuple[list[str], np.ndarray]:
    """The set's sequence keys and token table; sets each member's ``seq_map``, ``codes`` and
    ``tok_offset``."""
    seq_index: dict[str, int] = {}
    sequences: list[str] = []
    parts = []
    offset = 0
    for m in members:
        r = m.reader
        smap = np.empty(len(r.sequences), np.int64)
        for i, key in enumerate(r.sequences):
            j = seq_index.get(key)
            if j is None:
                j = seq_index[key] = len(sequences)
                sequences.append(key)
            smap[i] = j
        m.seq_map = smap
        t = r.tokens
        tok = np.zeros(len(t), TOKEN_DTYPE)
        for col in TOKEN_DTYPE.names or ():
            tok[col] = t[col]
        if len(t):
            tok["seq"] = smap[t["seq"]]
        m.codes = (tok["seq"].astype(np.int64) << SEQ_BITS) | tok["position"].astype(np.int64)
        m.tok_offset = offset
        offset += len(t)
        parts.append(tok)
    if len(sequences) >= 1 << (62 - SEQ_BITS):
        raise IncompatibleTracesError(f"trace set has {len(sequences)} sequences; too many for one trace", path)
    tokens = np.concatenate(parts) if parts else np.empty(0, TOKEN_DTYPE)
    # canonical token of each code per member (the last row wins, as in one file)
    canon = []
    for m in members:
        if len(m.codes):
            uniq, last = last_per_code(m.codes)
            canon.append((uniq, m.reader.tokens["token"][last].astype(np.int64), m))
    _check_shards_disjoint(canon, sequences, path)
    _check_tokens_agree(canon, members, sequences, path)
    _check_replicas_complete(members, sequences, path)
    return sequences, tokens


def _check_replicas_complete(members: Sequence[Member], sequences: Sequence[str], path: str) -> None:
    """TP ranks whose recorder says their states are replicated (``ranks.replicated``) hold the
    same tokens: a rank that holds fewer stopped early or dropped rows, and the set would compare
    only what both hold (a partial check that reads as a whole one)."""
    groups: dict[tuple[str, int], list[Member]] = {}
    for m in members:
        facts = m.reader.user_meta.get("ranks")
        if "tp" in m.ranks and isinstance(facts, dict) and facts.get("replicated") is True:
            groups.setdefault((m.shard, m.ranks.get("pp", 0)), []).append(m)
    for group in groups.values():
        group.sort(key=lambda m: m.ranks["tp"])
        a = group[0]
        ua = np.unique(a.codes)
        for b in group[1:]:
            ub = np.unique(b.codes)
            if len(ua) == len(ub) and np.array_equal(ua, ub):
                continue
            only_a, only_b = np.setdiff1d(ua, ub), np.setdiff1d(ub, ua)
            x, holder, other = (only_a, a, b) if len(only_a) else (only_b, b, a)
            code = int(x[0])
            raise IncompatibleTracesError(
                f"TP ranks of one recording hold different tokens: {other.name} lacks {len(x)} of the "
                f"{len(ua) if holder is a else len(ub)} tokens {holder.name} holds (first: sequence "
                f"{sequences[code >> SEQ_BITS]} position {code & POS_MASK})"
                + (f", and holds {len(only_b)} that {a.name} lacks" if len(only_a) and len(only_b) else "")
                + "; replicated ranks record every token: a rank stopped early, or the files are not of one run", path)


def _check_shards_disjoint(canon: _Canon, sequences: Sequence[str], path: str) -> None:
    shards = sorted({m.shard for _, _, m in canon})
    if len(shards) < 2:
        return
    sid = {s: i for i, s in enumerate(shards)}
    codes, owner = [], []
    for s in shards:
        u = np.unique(np.concatenate([c for c, _, m in canon if m.shard == s]))
        codes.append(u)
        owner.append(np.full(len(u), sid[s], np.int64))
    c, o = np.concatenate(codes), np.concatenate(owner)
    order = np.argsort(c, kind="stable")
    c, o = c[order], o[order]
    dup = np.flatnonzero((c[1:] == c[:-1]) & (o[1:] != o[:-1]))
    if len(dup):
        j = int(dup[0])
        code = int(c[j])
        n = len(dup)
        a, b = shards[int(o[j])], shards[int(o[j + 1])]
        raise IncompatibleTracesError(
            f"duplicate tokens across DP ranks or shards: sequence {sequences[code >> SEQ_BITS]} position "
            f"{code & POS_MASK} is in {os.path.basename(a)} and {os.path.basename(b)} ({n} token"
            f"{'s' if n > 1 else ''} in two shards); the token tables of DP ranks must not overlap", path)


def _check_tokens_agree(canon: _Canon, members: Sequence[Member], sequences: Sequence[str], path: str) -> None:
    if len(canon) < 2:
        return
    c = np.concatenate([u for u, _, _ in canon])
    t = np.concatenate([tk for _, tk, _ in canon])
    who = np.concatenate([np.full(len(u), m.index, np.int64) for u, _, m in canon])
    order = np.lexsort((who, c))
    c, t, who = c[order], t[order], who[order]
    bad = np.flatnonzero((c[1:] == c[:-1]) & (t[1:] != t[:-1]))
    if len(bad):
        j = int(bad[0])
        code = int(c[j])
        ma, mb = members[int(who[j])], members[int(who[j + 1])]
        raise IncompatibleTracesError(
            f"files of the set disagree on a token: sequence {sequences[code >> SEQ_BITS]} position "
            f"{code & POS_MASK} is token {int(t[j])} in {ma.name} but {int(t[j + 1])} in {mb.name} "
            f"({len(bad)} such tokens): not one recording", path)

