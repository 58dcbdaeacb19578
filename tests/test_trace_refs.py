"""Storage that the reader resolves (docs/format.md, "Derived sketches" and "Values by
reference"): a tensor stored with full values but no sketch reads as one with a sketch, computed
from its values the way TraceWriter computes the sketches it owes; a tensor whose rows take their
values from rows of another tensor (the EAGLE-3 draft input from the target's aux hidden states)
reads as one that stores them. Every read path (read_values, read_values_at, read_sketch, read_at
in any order with and without ``out=``, the dataset-like ``_ds[name][part]``, trace sets, the
diff's serial and pooled numerics, ``info``) is checked against a trace written the plain way, on
real HDF5 files written by the TraceWriter; then recovery of a trace that was not closed, and the
writer's refusals. The damaged and hostile files are in test_bad_inputs.py and test_hostile.py.
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
from tensordiff.dtypes import to_float32
from tensordiff.errors import TraceFileError
from tensordiff.sketch import sketch_np, sketch_rows
from tensordiff.trace import SCHEMA_REFS, SCHEMA_VERSION, SlotSpec, TraceReader, TraceWriter, reads, slot_rms
from tensordiff.traceset import TraceSet
from tracegen import DIM, assert_clean_exit, run_isolated, write_eagle
from tracegen import EAGLE_H as H
from tracegen import EAGLE_LENGTH as LENGTH
from tracegen import EAGLE_SEQS as SEQS

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
    """Side A written plain, with derived sketches and with the draft input by reference; side B
    (serve) with layer3 as a sketch alone and the aux's slot 1 wired to the wrong layer, in the
    same three ways."""
    d = tmp_path_factory.mktemp("derived")
    out = {"dir": d}
    out["plain"] = write_eagle(str(d / "plain.h5"))
    out["derived"] = write_eagle(str(d / "derived.h5"), sketches=False)
    out["serve"] = write_eagle(str(d / "serve.h5"), side="serve", seed=1, noise=1e-3, wrong=True, sketch_only=("layer3",))
    out["serve_derived"] = write_eagle(str(d / "serve_derived.h5"), side="serve", seed=1, noise=1e-3, wrong=True,
                                       sketch_only=("layer3",), sketches=False)
    out["refs"] = write_eagle(str(d / "refs.h5"), refs=True)
    out["serve_refs"] = write_eagle(str(d / "serve_refs.h5"), side="serve", seed=1, noise=1e-3, wrong=True,
                                    sketch_only=("layer3",), refs=True)
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
    return as_json(diff_traces(a, b, DiffOptions(block_rows=64, backend=backend)), a, b)


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


# ----------------------------------------------------------------------------------------------
# values by reference: reads


def test_refs_trace_is_smaller_and_says_schema_2(pair):
    with TraceReader(pair["plain"]) as p, TraceReader(pair["refs"]) as r:
        assert (p.schema, r.schema) == (SCHEMA_VERSION, SCHEMA_REFS)
        info = r.tensors["draft_input"]
        assert info.values_source == "aux_hidden_states" and p.tensors["draft_input"].values_source is None
        assert info.has_values and info.has_sketch and info.sketch_derived
        assert info.rows == p.tensors["draft_input"].rows == SEQS * (LENGTH - 1)
        assert r.tensors["aux_hidden_states"].values_source is None
        own = r._dataset(r._ds["draft_input"].stored()["values"])
        given = sum(LENGTH - 1 if s % 3 == 1 else (0 if s % 3 == 2 else (LENGTH - 1 + 0) // 6) for s in range(SEQS))
        assert own.shape == (given, 2 * H) and given < info.rows // 2
        assert set(r._ds["draft_input"].stored()) == {"rows", "values", "values_ref", "rms"}
    assert os.path.getsize(pair["refs"]) < os.path.getsize(pair["plain"])


def test_refs_values_read_back_bit_for_bit(pair):
    rng = np.random.default_rng(9)
    with TraceReader(pair["plain"]) as p, TraceReader(pair["refs"]) as r:
        name = "draft_input"
        n = r.tensors[name].rows
        want = p.read_values(name, raw=True)
        assert want.dtype == np.uint16 and np.array_equal(r.read_values(name, raw=True), want)
        assert np.array_equal(r.read_values(name), p.read_values(name))
        for lo, hi in ((0, 1), (118, 240), (600, None), (n - 1, n + 5)):
            assert np.array_equal(r.read_values(name, lo, hi, raw=True), want[lo:hi]), (lo, hi)
        # the RMS the writer computed (every row given) and the caller gave (values_ref): the same bits
        assert np.array_equal(r.read_rms(name), p.read_rms(name))
        # its derived sketch is the sketch the writer stored for the plain draft input
        assert np.array_equal(r.read_sketch(name), p.read_sketch(name))
        for idx in (np.array([7]), np.arange(110, 250), np.array([600, 5, 5, 119, 118, 0, 600, n - 1]),
                    rng.integers(0, n, 400), np.arange(n)[::-1], np.zeros(0, np.int64)):
            assert np.array_equal(r.read_at(name, "values", idx), want[idx])
            buf = np.empty(2 * n * 2 * H, np.uint16)
            assert np.array_equal(r.read_at(name, "values", idx, out=buf), want[idx])
            f32 = np.empty(2 * n * 2 * H, np.float32)
            assert np.array_equal(r.read_values_at(name, idx, out=f32), to_float32(want[idx], "bfloat16"))
            assert np.array_equal(r.read_values_at(name, idx, raw=True), want[idx])
            assert np.array_equal(r.read_at(name, "sketch", idx), p.read_sketch(name)[idx])
        # a run into a typed buffer lands in the buffer (the diff's reuse), own rows and references alike
        for lo, hi in ((0, 119), (238, 357), (100, 400)):   # mixed, all own, across sequences
            buf = np.empty((hi - lo, 2 * H), np.uint16)
            got = r.read_at(name, "values", np.arange(lo, hi), out=buf)
            assert np.shares_memory(got, buf) and np.array_equal(buf, want[lo:hi])


def test_refs_values_are_dataset_like(pair):
    with TraceReader(pair["plain"]) as p, TraceReader(pair["refs"]) as r:
        ds, st = r._ds["draft_input"]["values"], p._ds["draft_input"]["values"]
        assert (ds.shape, ds.dtype, ds.ndim, ds.chunks) == (st.shape, st.dtype, st.ndim, st.chunks)
        want = st[:]
        assert np.array_equal(ds[:], want) and np.array_equal(ds[3:500:11], want[3:500:11])
        assert np.array_equal(ds[-1], want[-1]) and np.array_equal(ds[4, :5], want[4, :5])
        assert np.array_equal(ds[[30, 2, 2]], want[[30, 2, 2]])
        dest = np.empty((50, 2 * H), np.uint16)
        ds.read_direct(dest, np.s_[200:250])
        assert np.array_equal(dest, want[200:250])
        assert r._chunk_table(ds) is None and not r._direct_rows(ds, 0, 2, dest[:2])
        with pytest.raises(IndexError):
            ds[len(want)]
        r.touch()   # the probe's walk over the datasets in the file


def test_refs_in_a_trace_set(pair, tmp_path):
    """Two DP rank files, each draft input by reference to its own file's aux rows."""
    d = tmp_path / "set"
    d.mkdir()
    write_eagle(str(d / "t.dp0.h5"), refs=True, seqs=range(0, 4))
    write_eagle(str(d / "t.dp1.h5"), refs=True, seqs=range(4, SEQS))
    with TraceSet(str(d)) as ts, TraceReader(pair["plain"]) as one:
        info = ts.tensors["draft_input"]
        assert info.values_source == "aux_hidden_states" and info.rows == one.tensors["draft_input"].rows
        want = one.read_values("draft_input", raw=True)
        assert np.array_equal(ts.read_values("draft_input", raw=True), want)
        idx = np.array([600, 2, 2, 475, 476, 0, len(want) - 1, 300])   # across both members, repeated
        buf = np.empty(len(idx) * 2 * H, np.uint16)
        assert np.array_equal(ts.read_at("draft_input", "values", idx, out=buf), want[idx])
        np.testing.assert_allclose(ts.read_sketch("draft_input"), one.read_sketch("draft_input"), rtol=1e-5, atol=1e-5)
        assert np.array_equal(ts.read_rms("draft_input"), one.read_rms("draft_input"))
        entry = {e["name"]: e for e in ts.summary()["tensors"]}["draft_input"]
        assert entry["values_source"] == "aux_hidden_states"


def test_info_names_the_source(pair, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")
    assert main(["info", "--json", pair["refs"]]) == 0
    s = json.loads(capsys.readouterr().out)
    entry = {e["name"]: e for e in s["tensors"]}["draft_input"]
    assert s["schema"] == SCHEMA_REFS and entry["values"] and entry["values_source"] == "aux_hidden_states"
    assert main(["info", pair["refs"]]) == 0
    assert "values (by reference to aux_hidden_states) (sketch derived)" in capsys.readouterr().out


# ----------------------------------------------------------------------------------------------
# values by reference: the diff


@pytest.mark.parametrize("order", ["ab", "ba"])
def test_diff_with_refs_equals_the_plain_diff(pair, order):
    def run(a, b):
        return diff(a, b) if order == "ab" else diff(b, a)
    plain = run(pair["plain"], pair["serve"])
    d = json.loads(plain)
    assert {t["name_a"] for t in d["tensors"]} >= {"draft_input", "aux_hidden_states"}
    assert run(pair["refs"], pair["serve"]) == plain
    assert run(pair["plain"], pair["serve_refs"]) == plain
    assert run(pair["refs"], pair["serve_refs"]) == plain


def test_diff_with_refs_on_a_worker_pool(pair):
    from tensordiff.parallel import PoolBackend

    with PoolBackend(2, task_bytes=1) as pool:
        assert diff(pair["refs"], pair["serve_refs"], pool) == diff(pair["plain"], pair["serve"])


def test_cli_diff_of_refs_against_plain_agrees(pair):
    """Rows by reference are the source's bits: the refs trace and the plain one hold the same data."""
    rc = main(["diff", str(pair["refs"]), str(pair["plain"]), "-q"])
    assert rc == 0


# ----------------------------------------------------------------------------------------------
# values by reference: a recording that was not closed


def _killed_child(path: str, flush_after: int) -> None:
    """Record with refs in a forked child, flush after ``flush_after`` sequences, append more (also
    by reference), reach the file with them uncommitted, and die without close()."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            w = write_eagle(path, refs=True, seqs=range(0, flush_after), close=False)
            w.flush()
            with open(path + ".committed", "w") as fh:
                json.dump(w.flushed, fh)
            h = H
            rows = w.add_tokens("late", np.arange(10), np.arange(10), "train")
            for name in ("embed", "layer1", "layer3"):
                w.append(name, rows, np.ones((10, h), np.float32))
            w.append("layer2", rows, np.ones((10, h), np.uint16))
            n_aux = w._state["aux_hidden_states"].rows.rows
            w.append("aux_hidden_states", rows, np.full((10, 2 * h), 7, np.uint16))
            ref = np.arange(n_aux, n_aux + 10)
            ref[::3] = -1
            w.append("draft_input", rows, np.full((4, 2 * h), 9, np.uint16), values_ref=ref,
                     rms=np.ones((10, 2), np.float32))
            w._write_buffered()   # on disk, not committed
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_recovered_refs_trace_keeps_committed_rows_that_resolve(pair, tmp_path):
    p = str(tmp_path / "killed.h5")
    _killed_child(p, 3)
    committed = json.load(open(p + ".committed"))
    with TraceReader(p) as r, TraceReader(pair["plain"]) as full:
        assert not r.complete and "not closed cleanly" in r.recovered_note
        n = committed["tensors"]["draft_input"]
        assert n == 3 * (LENGTH - 1) and r.tensors["draft_input"].rows == n
        assert r.tensors["aux_hidden_states"].rows == committed["tensors"]["aux_hidden_states"] == 3 * LENGTH
        assert np.array_equal(r.read_values("draft_input", raw=True), full.read_values("draft_input", 0, n, raw=True))
        assert np.array_equal(r.read_sketch("draft_input"), full.read_sketch("draft_input", 0, n))
    rc, out, err = run_isolated(["info", p])
    assert_clean_exit(rc, out, err, "info of a killed refs recording")
    assert rc == 0
    rc, out, err = run_isolated(["diff", str(pair["plain"]), p, "-q"])
    assert_clean_exit(rc, out, err, "diff against a killed refs recording")
    assert rc == 0, out[-2000:]


def test_recovered_refs_past_the_sources_committed_rows_are_dropped(tmp_path):
    """A committed reference beyond the source's committed rows (what a writer that appended the
    source second could leave, or a crafted file): the recovered trace keeps the rows before it,
    a complete one is refused."""
    p = str(tmp_path / "killed.h5")
    _killed_child(p, 3)
    with h5py.File(p, "r+") as f:
        ref = f["tensors/draft_input/values_ref"]
        assert ref[300] >= 0   # (the third sequence: every row a reference)
        ref[300] = 3 * LENGTH   # one past the source's committed rows (its rows on disk go further)
    with TraceReader(p) as r:
        assert r.tensors["draft_input"].rows == 300 and len(r.token_rows("draft_input")) == 300
        assert "tensor rows written after that flush were dropped" in r.recovered_note
        assert r.read_values("draft_input", raw=True).shape == (300, 2 * H)
        assert r._ds["draft_input"]["sketch"].shape[0] == 300
    with h5py.File(p, "r+") as f:
        f["tensors/draft_input/values_ref"][300] = 10**6   # past the source's rows on disk too
        f.attrs["complete"] = True
        f.attrs.modify("flushed_tokens", np.int64(f["tokens"].shape[0]))
        for g in f["tensors"].values():
            g.attrs.modify("flushed_rows", np.int64(g["rows"].shape[0]))
    with pytest.raises(TraceFileError, match="values_ref points at row"):
        TraceReader(p)


# ----------------------------------------------------------------------------------------------
# values by reference: the writer


def test_writer_refuses_bad_references(tmp_path):
    with TraceWriter(tmp_path / "w.h5", model={"hidden_size": 4}, sketch_dim=4) as w:
        w.define_tensor("src", 8, kind="packed", slots=SlotSpec(["layer1", "layer2"]), slot_width=4, dtype="bfloat16")
        w.define_tensor("flat", 8, dtype="bfloat16")
        w.define_tensor("f32", 8, kind="packed", slots=SlotSpec(["layer1", "layer2"]), slot_width=4)
        w.define_tensor("cat", 8, kind="packed", slots=SlotSpec(["layer1", "layer2"]), slot_width=4, dtype="bfloat16",
                        values=False)
        packed = {"kind": "packed", "slots": SlotSpec(["layer1", "layer2"]), "slot_width": 4, "dtype": "bfloat16"}
        for source, kw, msg in (("nope", packed, "not a tensor defined before"), ("flat", packed, r"\(1 x 8 slots\)"),
                                ("f32", packed, "float32 of width 8"), ("cat", packed, "values=False"),
                                ("src", {**packed, "values": False}, "needs values=True"),
                                ("self", packed, "not a tensor defined before")):
            with pytest.raises(ValueError, match=msg):
                w.define_tensor("self", 8, values_source=source, **kw)
        w.define_tensor("ref", 8, values_source="src", sketch=False, **{k: v for k, v in packed.items()})
        with pytest.raises(ValueError, match="takes its values by reference itself"):
            w.define_tensor("chain", 8, values_source="ref", **packed)
        w.define_tensor("ref_sk", 8, values_source="src", **packed)
        rows = w.add_tokens("s", np.arange(4), np.arange(4), "train")
        bits = np.arange(32, dtype=np.uint16).reshape(4, 8)
        rms = np.ones((4, 2), np.float32)
        with pytest.raises(ValueError, match=r"appended before \(0\.\.-1\)"):
            w.append("ref", rows, None, values_ref=[0, 1, 2, 3], rms=rms)   # the source has no rows yet
        w.append("src", rows, bits)
        for args, kw, msg in (
                ((None,), {"values_ref": [0, 1, 2], "rms": rms}, "one entry per row"),
                ((None,), {"values_ref": [0.0, 1, 2, 3], "rms": rms}, "must be integers"),
                ((None,), {"values_ref": [0, 1, 2, 4], "rms": rms}, r"0\.\.3"),
                ((None,), {"values_ref": [0, 1, -2, 3], "rms": rms}, "must be -1"),
                ((None,), {"values_ref": [0, -1, 2, 3], "rms": rms}, "give their values"),
                ((bits[:2],), {"values_ref": [0, -1, 2, 3], "rms": rms}, r"expected \(1, 8\)"),
                ((None,), {"values_ref": [0, 1, 2, 3]}, "give rms="),
                ((bits[:1].astype(np.float32),), {"values_ref": [0, -1, 2, 3], "rms": rms}, "uint16 bits")):
            with pytest.raises(ValueError, match=msg):
                w.append("ref", rows, *args, **kw)
        with pytest.raises(ValueError, match="give sketch="):
            w.append("ref_sk", rows, None, values_ref=[0, 1, 2, 3], rms=rms)
        with pytest.raises(ValueError, match="defined without values_source"):
            w.append("src", rows, bits, values_ref=[-1, -1, -1, -1])
        # nothing refused reached a dataset: the rows that follow are the first
        w.append("ref", rows, bits[1:2], values_ref=[0, -1, 2, 3], rms=rms)
        w.append("ref", rows, bits)   # all given, no values_ref: the writer computes the RMS
        w.append("ref_sk", rows, None, values_ref=[3, 2, 1, 0], rms=rms, sketch=np.zeros((4, 8), np.float32))
    with TraceReader(tmp_path / "w.h5") as r:
        assert r.tensors["ref"].rows == 8 and r.tensors["ref_sk"].rows == 4
        assert np.array_equal(r.read_values("ref", raw=True), np.concatenate([bits, bits]))
        assert np.array_equal(r.read_values("ref_sk", raw=True), bits[::-1])
        assert np.array_equal(r.read_rms("ref")[4:], slot_rms(to_float32(bits, "bfloat16"), 4))
        assert r.tensors["ref_sk"].stored_sketch and np.array_equal(r.read_sketch("ref_sk"), np.zeros((4, 8)))
        assert r._dataset(r._ds["ref"].stored()["values"]).shape == (5, 8)


def test_plain_appends_keep_the_compiled_path(tmp_path, monkeypatch):
    """A tensor without values_source still takes put_rows; one with it never does."""
    from tensordiff.trace import writer as wmod

    calls = []
    real = wmod.put_rows

    def spy(*a):
        calls.append(a[0])
        return real(*a)
    monkeypatch.setattr(wmod, "put_rows", spy)
    with TraceWriter(tmp_path / "c.h5", model={"hidden_size": 4}, sketch_dim=4) as w:
        w.define_tensor("src", 4, sketch=False)
        w.define_tensor("ref", 4, sketch=False, values_source="src")
        rows = w.add_tokens("s", np.arange(3), np.arange(3), "train")
        x = np.ones((3, 4), np.float32)
        rms = np.ones((3, 1), np.float32)
        w.append("src", rows, x, rms=rms)
        assert len(calls) == 1
        w.append("ref", rows, x, rms=rms)
        w.append("ref", rows, None, values_ref=np.arange(3), rms=rms)
        assert len(calls) == 1
