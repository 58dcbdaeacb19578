"""The streamed identity search: each candidate scored as it is read, row maps built
once per diff. It must decide exactly as the batch rule on every candidate's rows at once."""

from __future__ import annotations

import numpy as np
import pytest

from tensordiff.align import RowMaps, SideTokens, align_tokens, row_map, sample_indices
from tensordiff.catalog import IdentitySearch, slot_rms_at
from tensordiff.dtypes import EPS
from tensordiff.identity import (
    EXACT_EPS,
    MIN_TOKENS,
    OFFSETS,
    CandidateRows,
    NoiseFloor,
    Target,
    _surely_not_exact,
    clean,
    decide,
    per_token_cos,
)
from tensordiff.tolerances import coarser
from tensordiff.trace import SlotSpec, TraceReader, TraceWriter

H, L, SEQS, LEN = 32, 10, 4, 48


def _bits(x):
    u = np.ascontiguousarray(x, np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def _write(path, side, held, seed, noise):
    """A trained-looking residual stream: boundaries embed..layer9 at cos 0.99+ to their
    neighbours, bf16; B has +-1 ulp noise. A packed draft input holds the states ``held``."""
    rng = np.random.default_rng(11)
    nrng = np.random.default_rng(seed)
    with TraceWriter(path, side=side, model={"num_layers": L - 1, "hidden_size": H}, flush_rows=None,
                     flush_seconds=None) as w:
        for b in range(L):
            w.define_tensor("embed" if b == 0 else f"layer{b}", H, kind="boundary", boundary=b, dtype="bfloat16",
                            sketch=False)
        w.define_tensor("draft_input", H * len(held), kind="packed", dtype="bfloat16", slot_width=H,
                        slots=SlotSpec(list(held), convention="boundary"), sketch=False)
        for s in range(SEQS):
            rows = w.add_tokens(f"{side}-{s}", np.arange(LEN), rng.integers(3, 30000, LEN), "train")
            x = rng.standard_normal((LEN, H)).astype(np.float32) * rng.lognormal(0, 0.3, (LEN, 1)).astype(np.float32)
            states = {}
            for b in range(L):
                if b:
                    x = x + 0.1 * rng.standard_normal((LEN, H)).astype(np.float32)
                bits = _bits(x)
                if noise:
                    r = nrng.integers(0, 8, bits.shape)
                    bits = (bits.astype(np.int32) + (r == 0) - (r == 1)).astype(np.uint16)
                name = "embed" if b == 0 else f"layer{b}"
                states[name] = bits
                w.append(name, rows, bits)
            w.append("draft_input", rows, np.concatenate([states[h] for h in held], axis=1))


def open_pair(d):
    """The two traces of these tests (train slots embed/layer3/layer7, serve layer3/layer4/layer7
    with noise) written in ``d``, opened, with their sides and alignment."""
    a, b = str(d / "a.h5"), str(d / "b.h5")
    _write(a, "train", ["embed", "layer3", "layer7"], 0, False)
    _write(b, "serve", ["layer3", "layer4", "layer7"], 1, True)
    with TraceReader(a) as ra, TraceReader(b) as rb:
        sa, sb = SideTokens(ra), SideTokens(rb)
        yield ra, rb, sa, sb, align_tokens(ra, rb, (sa, sb))


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    yield from open_pair(tmp_path_factory.mktemp("stream"))


def _batch(search, side, info, slot, sample, floor):
    """The rule on every candidate's rows at once, gathered as the search did before it streamed."""
    r_self = search.ra if side == "a" else search.rb
    maps = search.maps
    (rows_self,) = maps.rows_at(side, info.name, [sample])
    use = rows_self >= 0
    sample, rows_self = sample[use], rows_self[use]
    w = info.slot_width
    x = r_self.read_values_at(info.name, rows_self)[:, slot * w:(slot + 1) * w]
    target = Target(clean(x), slot_rms_at(r_self, info, rows_self, slot))
    targets = [maps.offset_index(sample, o) for o in OFFSETS]
    cats = (search.cat_a, search.cat_b) if side == "a" else (search.cat_b, search.cat_a)
    cands = []
    for o_i, o in enumerate(OFFSETS):
        for cat in cats:
            for label, ci in cat.states.items():
                if cat.side == side and ci.name == info.name:
                    continue
                crows = maps.rows_at(cat.side, ci.name, targets)[o_i]
                ok = crows >= 0
                if not ok.any():
                    continue
                data = clean(cat.r.read_values_at(ci.name, crows[ok]))
                tol = EXACT_EPS * EPS[coarser(info.dtype, ci.dtype)] if cat.side == side else None
                cands.append(CandidateRows(label, cat.side, o, "values", ok, data,
                                           slot_rms_at(cat.r, ci, crows[ok], 0), tol))
    need = min(MIN_TOKENS, max(1, len(sample)))
    return decide(target, [c for c in cands if int(c.ok.sum()) >= need], floor, len(sample))


@pytest.mark.parametrize("side", ["a", "b"])
def test_streamed_scoring_decides_as_the_batch_rule(pair, side):
    ra, rb, sa, sb, al = pair
    maps = RowMaps(al, ra, rb, sa, sb)
    search = IdentitySearch(ra, rb, maps, lambda *_: None)
    search.floor_of = lambda _l: NoiseFloor(2e-5, 4e-3, "test")
    info = (ra if side == "a" else rb).tensors["draft_input"]
    everything = np.arange(len(al))
    both = (maps.rows_at("a", "draft_input", [everything])[0] >= 0) & (maps.rows_at("b", "draft_input", [everything])[0] >= 0)
    sample = sample_indices(both, 64)
    streamed = search.identify(side, info, [0, 1, 2], sample)
    held = ["embed", "layer3", "layer7"] if side == "a" else ["layer3", "layer4", "layer7"]
    for slot in range(3):
        batch = _batch(search, side, info, slot, sample, search.floor_of)
        assert streamed[slot] == batch          # every field: outcome, candidates, evidence, numbers
        assert streamed[slot].outcome == "holds" and streamed[slot].best == held[slot]
    # neighbours are close: the decision rested on the paired test or the exact rule, not on luck
    cos = [c.cos for c in streamed[1].candidates]
    assert cos[1] > 0.99


def test_row_maps_built_once_per_token_row_set(pair):
    ra, rb, sa, sb, al = pair
    maps = RowMaps(al, ra, rb, sa, sb)
    everything = np.arange(len(al))
    for side, r in (("a", ra), ("b", rb)):
        index_fn = al.index_a if side == "a" else al.index_b
        st = sa if side == "a" else sb
        for name in r.tensors:
            (got,) = maps.rows_at(side, name, [everything])
            rm = row_map(r, st, name, index_fn)   # the map as it was rebuilt per call before
            inv = np.full(len(al), -1, np.int64)
            inv[rm[rm >= 0]] = np.flatnonzero(rm >= 0)
            assert np.array_equal(got, inv)
    # boundaries and the packed tensor share their token rows: one map per side
    assert maps.built == 2
    assert ra.token_rows("layer1") is ra.token_rows("layer5")
    assert not ra.token_rows("layer1").flags.writeable


def test_row_map_cache_evicts_and_stays_right(pair, monkeypatch):
    ra, rb, sa, sb, al = pair
    maps = RowMaps(al, ra, rb, sa, sb, cache_bytes=1)   # room for no map: only the last of each side stays
    ix = np.arange(len(al))
    first = maps.rows_at("a", "layer1", [ix])[0]
    maps.rows_at("b", "layer1", [ix])
    again = maps.rows_at("a", "layer1", [ix])[0]
    # A's and B's maps asked in turn (what the plan does per pair) are built once each
    assert np.array_equal(first, again) and maps.built == 2
    real = ra.token_rows
    other = real("layer1")[:-1].copy()        # another set of token rows on side A
    monkeypatch.setattr(ra, "token_rows", lambda name: other if name == "layer2" else real(name))
    short = maps.rows_at("a", "layer2", [ix])[0]
    assert maps.built == 3 and (short >= 0).sum() == (first >= 0).sum() - 1
    maps.rows_at("b", "layer1", [ix])          # B's last map was kept
    assert maps.built == 3
    again = maps.rows_at("a", "layer1", [ix])[0]   # A's older one was evicted: rebuilt, the same
    assert np.array_equal(first, again) and maps.built == 4


def test_exact_precheck_never_rules_out_the_same_data():
    rng = np.random.default_rng(0)
    tol = EXACT_EPS * EPS["bfloat16"]
    c = rng.standard_normal((64, 4096)).astype(np.float32)
    same = c * (1 + rng.uniform(-tol / 4, tol / 4, (64, 1))).astype(np.float32)   # rel ~tol/4 per token
    assert not _surely_not_exact(per_token_cos(same, c), tol, 4096)
    near = c + 0.05 * rng.standard_normal(c.shape).astype(np.float32)            # cos ~0.999: not the same
    assert _surely_not_exact(per_token_cos(near, c), tol, 4096)
    tol32 = EXACT_EPS * EPS["float32"]
    assert not _surely_not_exact(per_token_cos(c, c.copy()), tol32, 4096)
