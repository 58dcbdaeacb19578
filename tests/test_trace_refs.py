"""Storage that the reader resolves (docs/format.md, "Derived sketches"): a tensor stored with
full values but no sketch reads as one with a sketch, computed from its values the way TraceWriter
computes the sketches it owes. Every read path (read_sketch, read_at in any order with and
without ``out=``, the dataset-like ``_ds[name]["sketch"]``, trace sets, the diff's serial and
pooled numerics, ``info``) is checked against a trace written the plain way, on real HDF5 files.
"""

from __future__ import annotations

import json
import os
import shutil

import h5py
import numpy as np
import pytest

from tensordiff.cli import jsonable, main
from tensordiff.diff import DiffOptions, diff_traces
from tensordiff.dtypes import f32_to_bf16_bits, to_float32
from tensordiff.sketch import sketch_np, sketch_rows
from tensordiff.trace import SlotSpec, TraceReader, TraceWriter, reads
from tensordiff.traceset import TraceSet
from tracegen import assert_clean_exit, run_isolated

H = 64
DIM = 8
SEQS = 6
LENGTH = 120
LABELS = ("layer1", "layer2")
DTYPES = {0: "float32", 1: "float32", 2: "bfloat16", 3: "float16"}


def _name(b: int) -> str:
    return f"layer{b}" if b else "embed"


def write_eagle(path, *, side="train", sketches=True, seed=0, noise=0.0, wrong=False, sketch_only=(),
                seqs=range(SEQS), flush_rows=None, close=True, meta=None):
    """An EAGLE-3-like trace: boundaries embed..layer3 (float32, bf16, float16), the target's packed
    ``aux_hidden_states`` (bf16) and the ``draft_input`` the draft consumed (the aux rows but the
    last of each sequence, a few of them changed in their last bit). ``sketches=False``: valued
    tensors are stored without a sketch. ``sketch_only``: tensors stored as sketch + RMS alone
    (the sketch computed per append, as the recorders do). ``wrong``: the aux's slot 1 holds
    layer3. ``seqs``: which sequences (a DP rank's share). ``close=False`` returns the writer."""
    base = np.random.default_rng(1234)
    rng = np.random.default_rng(seed)
    w = TraceWriter(path, side=side, producer="tests/test_trace_refs.py", model={"num_layers": 3, "hidden_size": H},
                    sketch_dim=DIM, flush_rows=flush_rows, flush_seconds=None, meta=meta)
    for b in range(4):
        only = _name(b) in sketch_only
        w.define_tensor(_name(b), H, kind="boundary", boundary=b, dtype=DTYPES[b], values=not only,
                        sketch=sketches or only)
    slots = SlotSpec(list(LABELS), raw_ids=[1, 2], convention="boundary")
    w.define_tensor("aux_hidden_states", 2 * H, kind="packed", slots=slots, slot_width=H, dtype="bfloat16",
                    role="aux", sketch=sketches)
    w.define_tensor("draft_input", 2 * H, kind="packed", slots=slots, slot_width=H, dtype="bfloat16",
                    role="draft_input", sketch=sketches)
    held = ("layer1", "layer3") if wrong else LABELS
    wanted = set(seqs)
    for s in range(SEQS):
        ids = base.integers(1, 500, LENGTH)
        st = {}
        for b in range(4):
            x = base.standard_normal((LENGTH, H)).astype(np.float32)
            x += noise * rng.standard_normal(x.shape).astype(np.float32)
            st[_name(b)] = x
        if s not in wanted:
            continue
        rows = w.add_tokens(f"seq-{s}", np.arange(LENGTH), ids, "train" if side == "train" else "prefill", step=s)
        for b in range(4):
            name, x = _name(b), st[_name(b)]
            if name in sketch_only:
                w.append(name, rows, sketch=sketch_np(x, H, DIM, w.sketch_seed), rms=np.sqrt((x * x).mean(1)))
            elif DTYPES[b] == "bfloat16":
                w.append(name, rows, f32_to_bf16_bits(x))
            else:
                w.append(name, rows, x.astype(DTYPES[b]))
        aux = f32_to_bf16_bits(np.concatenate([st[h] for h in held], axis=1))
        w.append("aux_hidden_states", rows, aux)
        draft = aux[:-1].copy()
        changed = np.arange(LENGTH - 1) % 6 == 5
        draft[changed] ^= np.uint16(1)
        w.append("draft_input", rows[:-1], draft)
    if not close:
        return w
    w.close()
    return path


def blockwise_sketch(values: np.ndarray, dtype: str, slot_width: int, rows_per_block: int, seed: int) -> np.ndarray:
    """The reference: sketch_rows over blocks of ``rows_per_block`` rows aligned at multiples of it,
    the last zero-padded (what TraceWriter computes per values chunk)."""
    out = []
    for lo in range(0, len(values), rows_per_block):
        blk = np.zeros((rows_per_block, values.shape[1]), values.dtype)
        part = values[lo:lo + rows_per_block]
        blk[:len(part)] = part
        out.append(sketch_rows(to_float32(blk, dtype), slot_width, DIM, seed)[:len(part)])
    return np.concatenate(out) if out else np.zeros((0, values.shape[1] // slot_width * DIM), np.float32)


VALUED = ["embed", "layer1", "layer2", "layer3", "aux_hidden_states", "draft_input"]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """Side A written plain and with derived sketches; side B (serve) with layer3 as a sketch alone
    and the aux's slot 1 wired to the wrong layer, plain and with derived sketches."""
    d = tmp_path_factory.mktemp("derived")
    out = {"dir": d}
    out["plain"] = write_eagle(str(d / "plain.h5"))
    out["derived"] = write_eagle(str(d / "derived.h5"), sketches=False)
    out["serve"] = write_eagle(str(d / "serve.h5"), side="serve", seed=1, noise=1e-3, wrong=True, sketch_only=("layer3",))
    out["serve_derived"] = write_eagle(str(d / "serve_derived.h5"), side="serve", seed=1, noise=1e-3, wrong=True,
                                       sketch_only=("layer3",), sketches=False)
    return out


# ----------------------------------------------------------------------------------------------
# reads


def test_derived_sketch_is_the_writers_sketch(pair):
    with TraceReader(pair["plain"]) as p, TraceReader(pair["derived"]) as r:
        for name in VALUED:
            ip, info = p.tensors[name], r.tensors[name]
            assert (ip.has_sketch, ip.sketch_derived, ip.stored_sketch) == (True, False, True)
            assert (info.has_values, info.has_sketch, info.sketch_derived, info.stored_sketch) == (True, True, True, False)
            want = p.read_sketch(name)
            got = r.read_sketch(name)
            assert got.dtype == np.float32 and got.shape == (info.rows, info.slot_count * DIM)
            # bit for bit the sketch the writer stored in the plain trace
            assert np.array_equal(got, want), name
            raw = r.read_values(name, raw=True)
            assert np.array_equal(raw, p.read_values(name, raw=True))
            ds = r._ds[name]["sketch"]
            ref = blockwise_sketch(raw, info.dtype, info.slot_width, ds.chunks[0], r.sketch_seed)
            assert np.array_equal(got, ref), name
            # and sketch_rows of the values, up to the rounding of another product shape
            whole = sketch_rows(to_float32(raw, info.dtype), info.slot_width, DIM, r.sketch_seed)
            np.testing.assert_allclose(got, whole, rtol=1e-5, atol=1e-5)
            # ranges
            for lo, hi in ((0, 1), (5, 17), (500, 530), (info.rows - 3, None), (700, 10_000)):
                assert np.array_equal(r.read_sketch(name, lo, hi), want[lo:hi]), (name, lo, hi)


def test_derived_sketch_read_at_in_any_order_and_into_buffers(pair):
    rng = np.random.default_rng(5)
    with TraceReader(pair["plain"]) as p, TraceReader(pair["derived"]) as r:
        for name in VALUED:
            n = r.tensors[name].rows
            want = p.read_sketch(name)
            for idx in (np.array([3]), np.arange(100, 140), np.array([700, 3, 3, 512, 511, 0, 700]),
                        rng.integers(0, n, 300), np.sort(rng.integers(0, n, 50)), np.arange(n)[::-1],
                        np.zeros(0, np.int64)):
                got = r.read_at(name, "sketch", idx)
                assert got.dtype == np.float32 and np.array_equal(got, want[idx]), (name, idx[:5])
                buf = np.full(2 * n * want.shape[1], np.nan, np.float32)
                got = r.read_at(name, "sketch", idx, out=buf)
                assert np.array_equal(got, want[idx]), (name, idx[:5])
            # a run read into a typed buffer lands in that buffer (the diff's reuse)
            buf = np.empty((64, want.shape[1]), np.float32)
            got = r.read_at(name, "sketch", np.arange(200, 264), out=buf)
            assert np.shares_memory(got, buf) and np.array_equal(buf, want[200:264])


def test_derived_sketch_is_dataset_like(pair):
    with TraceReader(pair["plain"]) as p, TraceReader(pair["derived"]) as r:
        name = "aux_hidden_states"
        ds, st = r._ds[name]["sketch"], p._ds[name]["sketch"]
        assert (ds.shape, ds.dtype, ds.ndim) == (st.shape, st.dtype, st.ndim)
        assert ds.chunks[1] == st.shape[1] and ds.chunks[0] == r._ds[name]["values"].chunks[0]
        assert "sketch" in r._ds[name] and set(r._ds[name]) == {"rows", "values", "sketch", "rms"}
        assert "sketch" not in r._ds[name].stored()
        want = st[:]
        assert np.array_equal(ds[:], want) and np.array_equal(ds[10:700:7], want[10:700:7])
        assert np.array_equal(ds[-1], want[-1]) and np.array_equal(ds[5, 3:9], want[5, 3:9])
        assert np.array_equal(ds[[9, 2, 2]], want[[9, 2, 2]])
        assert np.array_equal(ds[np.arange(len(want)) % 5 == 1], want[np.arange(len(want)) % 5 == 1])
        dest = np.empty((40, ds.shape[1]), np.float32)
        ds.read_direct(dest, np.s_[600:640])
        assert np.array_equal(dest, want[600:640])
        with pytest.raises(IndexError):
            ds[len(want)]
        # no chunk table, no direct read: the reads go through the part's own methods
        assert r._chunk_table(ds) is None and not r._direct_rows(ds, 0, 4, np.empty((4, ds.shape[1]), np.float32))


def test_derived_sketch_reads_one_block_at_a_time(pair, monkeypatch):
    """A row read computes the sketch of that row's block only, never the whole tensor."""
    shapes = []
    real = reads.sketch_rows

    def spy(x, *a, **kw):
        shapes.append(x.shape[0])
        return real(x, *a, **kw)
    monkeypatch.setattr(reads, "sketch_rows", spy)
    with TraceReader(pair["derived"]) as r:
        name = "layer1"
        block = r._ds[name]["sketch"].block
        assert r.tensors[name].rows > block
        r.read_at(name, "sketch", np.array([700]))
        assert shapes == [block]
        r.read_at(name, "sketch", np.array([701, 699]))   # the same block: computed once, kept
        assert shapes == [block]
        r.read_sketch(name)
        assert all(s == block for s in shapes) and len(shapes) <= -(-r.tensors[name].rows // block) + 1


def test_derived_sketch_in_a_trace_set(pair, tmp_path):
    """Two DP rank files stored without sketches read as one trace: the same sketches as the rank
    files written plain, and those of the one-file trace up to float32 rounding."""
    sets = {}
    for kind, sk in (("plain", True), ("derived", False)):
        d = tmp_path / kind
        d.mkdir()
        write_eagle(str(d / "t.dp0.h5"), sketches=sk, seqs=range(0, 3))
        write_eagle(str(d / "t.dp1.h5"), sketches=sk, seqs=range(3, SEQS))
        sets[kind] = TraceSet(str(d))
    try:
        with TraceReader(pair["plain"]) as one:
            for name in VALUED:
                sp, sd = sets["plain"], sets["derived"]
                assert sd.tensors[name].has_sketch and sd.tensors[name].sketch_derived
                assert not sp.tensors[name].sketch_derived
                want = sp.read_sketch(name)
                assert np.array_equal(sd.read_sketch(name), want)
                np.testing.assert_allclose(want, one.read_sketch(name), rtol=1e-5, atol=1e-5)
                idx = np.array([400, 2, 2, 359, 360, 0, len(want) - 1])  # across both members, repeated
                buf = np.empty(len(idx) * want.shape[1], np.float32)
                assert np.array_equal(sd.read_at(name, "sketch", idx, out=buf), want[idx])
                assert np.array_equal(sd.read_values(name, raw=True), one.read_values(name, raw=True))
        info = sets["derived"].summary()["tensors"]
        assert all(e["sketch_derived"] and not e["sketch"] for e in info if e["name"] in VALUED)
    finally:
        for s in sets.values():
            s.close()


def test_info_says_what_is_stored(pair, capsys):
    assert main(["info", "--json", pair["derived"]]) == 0
    s = json.loads(capsys.readouterr().out)
    by = {e["name"]: e for e in s["tensors"]}
    assert by["layer1"]["values"] and not by["layer1"]["sketch"] and by["layer1"]["sketch_derived"]
    assert main(["info", "--json", pair["serve"]]) == 0
    by = {e["name"]: e for e in json.loads(capsys.readouterr().out)["tensors"]}
    assert by["layer1"]["sketch"] and "sketch_derived" not in by["layer1"]
    assert not by["layer3"]["values"] and by["layer3"]["sketch"]
    rc = main(["info", pair["derived"]])
    out = capsys.readouterr().out
    assert rc == 0 and "values (sketch derived)" in out


def test_a_sketch_too_wide_to_derive_is_not_offered(tmp_path):
    """A sketch one row of which would exceed a chunk's bound is not derived (has_sketch false)."""
    p = tmp_path / "wide.h5"
    with TraceWriter(p, model={"hidden_size": 4}, sketch_dim=65536) as w:
        w.define_tensor("p", 4 * 512, kind="packed", slots=SlotSpec(["embed"] * 512), slot_width=4, sketch=False)
        rows = w.add_tokens("s", [0], [1], "train")
        w.append("p", rows, np.ones((1, 2048), np.float32))
    with TraceReader(p) as r:
        info = r.tensors["p"]
        assert info.has_values and not info.has_sketch and not info.sketch_derived and "sketch" not in r._ds["p"]


# ----------------------------------------------------------------------------------------------
# the diff


def as_json(res, *paths) -> str:
    text = json.dumps(jsonable(res.to_dict()), sort_keys=False)
    for i, p in enumerate(paths):
        text = text.replace(json.dumps(str(p))[1:-1], f"PATH{i}")
    return text


def diff(a, b, backend=None) -> str:
    return as_json(diff_traces(a, b, DiffOptions(block_rows=64, numeric=backend)), a, b)


@pytest.mark.parametrize("order", ["ab", "ba"])
def test_diff_with_derived_sketches_equals_the_plain_diff(pair, order):
    """layer3 is a sketch alone on the serve side: against the train side's values it is compared on
    sketches, the train side's stored (plain) or derived from its values (the same bits)."""
    def run(a, b):
        return diff(a, b) if order == "ab" else diff(b, a)
    plain = run(pair["plain"], pair["serve"])
    d = json.loads(plain)
    basis = {t["name_a"]: t["basis"] for t in d["tensors"]}
    assert basis["layer3"] == "sketch" and basis["layer1"] == "values", basis
    kinds = {f["kind"] for f in d["findings"] if f["severity"] == "divergence"}
    assert "slot_identity" in kinds or "slot_label" in kinds or "numeric" in kinds, kinds
    assert run(pair["derived"], pair["serve"]) == plain
    assert run(pair["derived"], pair["serve_derived"]) == run(pair["plain"], pair["serve_derived"])
    assert run(pair["plain"], pair["serve_derived"]) == plain


def test_diff_with_derived_sketches_on_a_worker_pool(pair):
    from tensordiff.parallel import PoolBackend

    with PoolBackend(2, task_bytes=1) as pool:
        assert diff(pair["derived"], pair["serve"], pool) == diff(pair["plain"], pair["serve"])


def test_cli_diff_exit_code_with_derived_sketches(pair, capsys):
    for a, b in ((pair["plain"], pair["serve"]), (pair["derived"], pair["serve"])):
        rc = main(["diff", str(a), str(b), "-q"])
        out, err = capsys.readouterr()
        assert_clean_exit(rc, out, err)
        assert rc == 1


def test_derived_sketch_of_damaged_values_is_one_line(tmp_path):
    """The sketch derived from a values chunk that does not decompress: exit 2, one line."""
    rng = np.random.default_rng(0)
    paths = {}
    for side, values in (("train", True), ("serve", False)):
        p = paths[side] = str(tmp_path / f"{side}.h5")
        with TraceWriter(p, side=side, model={"hidden_size": H, "num_layers": 1}, sketch_dim=DIM,
                         compression="gzip") as w:
            w.define_tensor("layer1", H, kind="boundary", boundary=1, values=values, sketch=not values)
            rows = w.add_tokens("s", np.arange(1200), np.arange(1200), "train")
            x = rng.standard_normal((1200, H)).astype(np.float32)
            if values:
                w.append("layer1", rows, x)
            else:
                w.append("layer1", rows, sketch=sketch_np(x, H, DIM, w.sketch_seed), rms=np.ones(1200, np.float32))
    assert main(["diff", paths["train"], paths["serve"], "-q"]) in (0, 1)
    with h5py.File(paths["train"], "r") as f:
        # the middle chunk (rows 512..1023): the open's checks read the first and last rows only
        info = f["tensors/layer1/values"].id.get_chunk_info(1)
        at, size = info.byte_offset, info.size
    with open(paths["train"], "r+b") as fh:
        fh.seek(at + 8)
        fh.write(bytes(range(256)) * max(1, (size - 16) // 256))
    rc, out, err = run_isolated(["diff", paths["train"], paths["serve"], "-q"])
    assert_clean_exit(rc, out, err, "diff of a damaged derived sketch")
    assert rc == 2 and "layer1/values" in err and "damaged" in err, err


# ----------------------------------------------------------------------------------------------
# a recording that was not closed


def test_recovered_trace_derives_sketches_of_committed_rows_only(tmp_path):
    """A copy taken after a flush and more appends (what a kill leaves): the derived sketch covers
    exactly the committed rows, equal to those of the complete plain trace."""
    for sk in (True, False):
        p = tmp_path / f"live{int(sk)}.h5"
        w = write_eagle(str(p), sketches=sk, seqs=range(0, 3), close=False)
        w.flush()
        committed = {n: w.flushed["tensors"][n] for n in VALUED}
        more = np.random.default_rng(3).standard_normal((LENGTH, H)).astype(np.float32)
        rows = w.add_tokens("extra", np.arange(LENGTH), np.arange(LENGTH), "train")
        w.append("layer1", rows, more)
        w._write_buffered()   # rows past the commit reach the file, uncommitted
        shutil.copyfile(p, tmp_path / f"snap{int(sk)}.h5")
        w.close()
    with TraceReader(tmp_path / "snap0.h5") as r, TraceReader(tmp_path / "snap1.h5") as p:
        assert not r.complete and r.recovered_note
        for name in VALUED:
            assert r.tensors[name].rows == committed[name] and r.tensors[name].sketch_derived
            assert r._ds[name]["sketch"].shape[0] == committed[name]
            assert np.array_equal(r.read_sketch(name), p.read_sketch(name))
        assert os.path.getsize(tmp_path / "snap0.h5") > 0
