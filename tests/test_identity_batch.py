"""The batched identity scoring: a batch of candidates at several offsets scored against
every slot at once must give the numbers that scoring each (candidate, slot) alone gives, to the
bit; and the search's read path (one read per run of a candidate's rows at every offset, scored in
batches, candidates visited in alternating directions) must decide exactly as before."""

from __future__ import annotations

import math

import numpy as np
import pytest

import tensordiff.catalog as catalog
from tensordiff.align import RowMaps, sample_indices
from tensordiff.catalog import IdentitySearch, read_runs
from tensordiff.identity import CandidateRows, NoiseFloor, SlotStack, Target, clean, row_norms, score, score_many
from test_identity_stream import _batch, open_pair


def _same(a, b):
    """Two _Scored equal to the bit: per-token arrays byte for byte, floats exactly."""
    assert a.cos_t.tobytes() == b.cos_t.tobytes()
    assert a.ratio_t.tobytes() == b.ratio_t.tobytes()
    assert a.cos == b.cos or (math.isnan(a.cos) and math.isnan(b.cos))
    assert a.record == b.record
    assert a.exact_rel == b.exact_rel
    assert (a.cand.label, a.cand.side, a.cand.offset, a.cand.basis, a.cand.exact_tol) == \
        (b.cand.label, b.cand.side, b.cand.offset, b.cand.basis, b.cand.exact_tol)
    assert np.array_equal(a.cand.ok, b.cand.ok)
    assert a.cand.data.size == 0 and b.cand.data.size == 0    # the rows are not kept


def _targets(rng, n, w, k):
    out = []
    for _ in range(k):
        x = rng.standard_normal((n, w)).astype(np.float32) * rng.lognormal(0, 1, (n, 1)).astype(np.float32)
        x[rng.random(n) < 0.05] = 0.0                                     # some all-zero rows
        rms = np.sqrt((x.astype(np.float64) ** 2).mean(axis=1)).astype(np.float32)
        rms[rng.random(n) < 0.03] = np.nan                                # a non-finite RMS now and then
        out.append(Target(clean(x), rms))
    return out


@pytest.mark.parametrize("w", [1, 3, 8, 64, 4096, 9000])
def test_score_many_equals_scoring_one_at_a_time(w):
    rng = np.random.default_rng(w)
    n = 96 if w > 1000 else 300
    targets = _targets(rng, n, w, 3)
    cands = []
    for j in range(7):
        ok = rng.random(n) < (1.0 if j % 3 == 0 else 0.8)
        m = int(ok.sum())
        base = targets[j % 3].data[ok]
        if j == 2:
            data = base.copy()                                             # the same data: exact
        elif j == 5:
            data = np.zeros((m, w), np.float32)                            # an all-zero state
        else:
            data = clean(base + rng.standard_normal((m, w)).astype(np.float32) * 0.05 * (j + 1))
        rms = (targets[j % 3].rms[ok] * rng.uniform(0.5, 2.0, m)).astype(np.float32)
        rms[rng.random(m) < 0.05] = 0.0
        tol = 3e-2 if j % 2 == 0 else None
        cands.append(CandidateRows(f"s{j}", "ab"[j % 2], (0, -1, 1, -2, 2, 0, 1)[j], "values", ok, data, rms, tol,
                                   row_norms(data) if j % 2 else None))
    stack = SlotStack(targets)
    # runs of equal-length segments (full masks) are reduced together: some groups have them
    # candidates sharing one mask array (one row map) are gathered once: some groups repeat one
    mask = cands[1].ok
    shared = [CandidateRows(c.label, c.side, c.offset, c.basis, mask, clean(targets[0].data[mask] * (1 + 0.01 * k)),
                            targets[0].rms[mask], c.exact_tol) for k, c in enumerate(cands[:3])]
    for group in (cands, cands[:1], cands[3:5], cands[::-1], [cands[0], cands[3], cands[6], cands[1], cands[0]],
                  shared, [cands[0]] + shared + [cands[2], cands[2]]):
        got = score_many(stack, group)
        for c, row in zip(group, got):
            for t, s in zip(targets, row):
                _same(s, score(t, c))
    assert any(s.exact_rel < math.inf for s in score_many(stack, [cands[2]])[0])  # the exact path ran


@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("w", [8, 4096])
def test_candidates_scored_in_place_at_several_offsets_give_the_bits_of_one_at_a_time(bf16, w):
    """States whose rows lie in one stored array, picked by index at each offset (scored in
    place, bfloat16 bits or float32), batched with each other and with gathered candidates: each
    number is the one scoring that candidate alone gives."""
    from tensordiff.dtypes import bf16_bits_to_f32

    rng = np.random.default_rng(w + bf16)
    n = 64
    targets = _targets(rng, n, w, 2)
    cands = []
    for state in range(3):
        stored = (rng.standard_normal((n + 40, w)) * rng.lognormal(0, 1, (n + 40, 1))).astype(np.float32)
        stored[rng.random(n + 40) < 0.05] = 0.0
        if bf16:
            stored = (stored.view(np.uint32) >> 16).astype(np.uint16)
        rows32 = bf16_bits_to_f32(stored) if bf16 else stored
        for offset in (0, -1, 1, -2, 2):
            ok = rng.random(n) < (1.0 if offset == 0 else 0.85)
            at = np.sort(rng.choice(n + 40, int(ok.sum()), replace=False)) if state != 1 else \
                rng.integers(0, n + 40, int(ok.sum()))                     # unsorted, repeated rows
            rms = (targets[0].rms[ok] * rng.uniform(0.5, 2.0, len(at))).astype(np.float32)
            tol = 3e-2 if state == 0 else None
            cands.append(CandidateRows(f"s{state}", "ab"[state % 2], offset, "values", ok, stored, rms, tol,
                                       row_norms(rows32[at]), at, bf16))
    gathered = CandidateRows("g", "a", 0, "values", cands[3].ok, cands[3].rows().copy(), cands[3].rms, None)
    stack = SlotStack(targets)
    for group in (cands, cands[::-1], [cands[0], gathered, cands[7], cands[1]], cands[5:10]):
        got = score_many(stack, group)
        for c, row in zip(group, got):
            for t, s in zip(targets, row):
                _same(s, score(t, c))


def test_score_many_falls_back_on_a_candidate_without_rows():
    rng = np.random.default_rng(3)
    targets = _targets(rng, 40, 8, 2)
    none = CandidateRows("x", "a", 0, "values", np.zeros(40, bool), np.zeros((0, 8), np.float32),
                         np.zeros(0, np.float32))
    ok = np.ones(40, bool)
    some = CandidateRows("y", "b", 1, "values", ok, targets[0].data.copy(), targets[0].rms.copy())
    got = score_many(SlotStack(targets), [none, some])
    for c, row in zip([none, some], got):
        for t, s in zip(targets, row):
            _same(s, score(t, c))


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    yield from open_pair(tmp_path_factory.mktemp("batch"))


def test_read_runs_reads_what_read_at_reads(pair):
    ra = pair[0]
    n = ra.tensors["layer2"].rows
    rng = np.random.default_rng(0)
    union = np.unique(np.concatenate([np.arange(s, min(n, s + 9)) for s in rng.integers(0, n, 6)]))
    for rows in (union, union[::-1].copy(), np.concatenate([union, union[:5]]), union[:1]):
        for part in ("values", "rms"):
            got, want = read_runs(ra, "layer2", part, rows), ra.read_at("layer2", part, rows)
            assert got.dtype == want.dtype and got.tobytes() == want.tobytes()


@pytest.mark.parametrize("batch_bytes", [1, 4 << 20])
def test_search_decides_as_the_batch_rule_in_either_direction(pair, monkeypatch, batch_bytes):
    """One candidate per batch or all at once, visited forwards or backwards (the search
    alternates), the verdicts are those of the rule on every candidate's rows at once."""
    ra, rb, sa, sb, al = pair
    monkeypatch.setattr(catalog, "BATCH_BYTES", batch_bytes)
    maps = RowMaps(al, ra, rb, sa, sb)
    search = IdentitySearch(ra, rb, maps, lambda *_: None)
    search.floor_of = lambda _l: NoiseFloor(2e-5, 4e-3, "test")
    everything = np.arange(len(al))
    both = (maps.rows_at("a", "draft_input", [everything])[0] >= 0) & \
        (maps.rows_at("b", "draft_input", [everything])[0] >= 0)
    sample = sample_indices(both, 64)
    for side in ("a", "b"):
        info = (ra if side == "a" else rb).tensors["draft_input"]
        backwards = search._backwards
        first = search.identify(side, info, [0, 1, 2], sample)
        assert search._backwards != backwards            # the next search runs the other way
        second = search.identify(side, info, [0, 1, 2], sample)
        for slot in range(3):
            want = _batch(search, side, info, slot, sample, search.floor_of)
            assert first[slot] == want and second[slot] == want
