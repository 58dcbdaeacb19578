"""The writer's own sketch and RMS: computed once per values block (never per append), equal to
the per-row reference (RMS bit for bit, sketches within float32 rounding), the same bits whatever
the append and flush pattern, and committed by a flush like every other row."""

import os
import shutil

import numpy as np
import pytest

from tensordiff.dtypes import f32_to_bf16_bits, storage_dtype, to_float32
from tensordiff.sketch import sketch_np
from tensordiff.trace import SlotSpec, TraceReader, TraceWriter, slot_rms
from tensordiff.trace import writer as writer_mod
from tensordiff.vocab import REGIMES

DTYPES = ["bfloat16", "float16", "float32", "float64"]


def _stored(rng, n, width, dtype):
    x = rng.standard_normal((n, width), dtype=np.float32) * 3
    return f32_to_bf16_bits(x) if dtype == "bfloat16" else x.astype(storage_dtype(dtype))


def _write(path, data, pattern, *, dtype, width, slot_width=None, flush_rows=None, sketch_dim=16):
    """Append ``data`` in pieces of the sizes in ``pattern`` (cycled); no sketch/RMS given."""
    k = width // (slot_width or width)
    with TraceWriter(path, side="serve", model={"hidden_size": slot_width or width, "num_layers": 4},
                     flush_rows=flush_rows, flush_seconds=None, sketch_dim=sketch_dim) as w:
        if k > 1:
            w.define_tensor("p", width, kind="packed", dtype=dtype,
                            slots=SlotSpec(labels=[f"layer{i}" for i in range(k)]))
        else:
            w.define_tensor("p", width, kind="boundary", boundary=1, dtype=dtype)
        s, i = 0, 0
        while s < len(data):
            n = pattern[i % len(pattern)]
            i += 1
            blk = data[s:s + n]
            rows = w.add_tokens("r", np.arange(s, s + len(blk)), np.zeros(len(blk), np.int64), "decode", step=i)
            w.append("p", rows, blk)
            s += len(blk)


@pytest.mark.parametrize("dtype", DTYPES)
def test_writer_sketch_and_rms_match_the_per_row_reference(tmp_path, dtype):
    rng = np.random.default_rng(3)
    width = 96
    data = _stored(rng, 700, width, dtype)
    _write(tmp_path / "t.h5", data, [1, 4, 300, 2], dtype=dtype, width=width, flush_rows=50)
    x32 = to_float32(data, dtype)
    with TraceReader(tmp_path / "t.h5") as r:
        assert r.tensors["p"].rows == 700
        assert r.read_values("p", raw=True).tobytes() == data.tobytes()
        # RMS: the per-row reduction of today's writer, bit for bit
        np.testing.assert_array_equal(r.read_rms("p"), slot_rms(x32, width))
        # sketch: the same projection as sketch_np, one matmul per block (float32 rounding apart)
        ref = sketch_np(x32, width, r.sketch_dim, r.sketch_seed)
        got = r.read_sketch("p")
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * float(np.abs(ref).max()))
        assert not np.array_equal(got, np.zeros_like(got))


def test_packed_slots_get_their_own_sketch_and_rms(tmp_path):
    rng = np.random.default_rng(4)
    sw, k = 64, 3
    data = _stored(rng, 333, sw * k, "bfloat16")
    _write(tmp_path / "t.h5", data, [3, 1, 90], dtype="bfloat16", width=sw * k, slot_width=sw, flush_rows=40)
    x32 = to_float32(data, "bfloat16")
    with TraceReader(tmp_path / "t.h5") as r:
        np.testing.assert_array_equal(r.read_rms("p"), slot_rms(x32, sw))
        ref = sketch_np(x32, sw, r.sketch_dim, r.sketch_seed)
        np.testing.assert_allclose(r.read_sketch("p"), ref, rtol=1e-5, atol=1e-5 * float(np.abs(ref).max()))
        assert r.read_sketch("p").shape == (333, k * r.sketch_dim)


@pytest.mark.parametrize("width", [1000, 4096])
def test_same_values_same_sketch_bits_whatever_the_pattern(tmp_path, width):
    """A flush or an append boundary does not change a row's sketch bits (a killed recording's
    rows must equal an unkilled run's bit for bit)."""
    rng = np.random.default_rng(5)
    data = _stored(rng, 300, width, "bfloat16")
    runs = []
    for i, (pattern, flush_rows) in enumerate([([1], 7), ([4], None), ([300], None), ([2, 5, 1, 61], 13)]):
        p = tmp_path / f"t{i}.h5"
        _write(p, data, pattern, dtype="bfloat16", width=width, flush_rows=flush_rows)
        with TraceReader(p) as r:
            runs.append((r.read_sketch("p"), r.read_rms("p")))
    for sk, rms in runs[1:]:
        assert sk.tobytes() == runs[0][0].tobytes()
        assert rms.tobytes() == runs[0][1].tobytes()


def test_sketch_and_rms_are_computed_once_per_block(tmp_path, monkeypatch):
    calls = {"sketch": [], "rms": []}
    real_sketch, real_rms = writer_mod.sketch_rows, writer_mod.slot_rms

    def count_sketch(x, *a, **k):
        calls["sketch"].append(len(x))
        return real_sketch(x, *a, **k)

    def count_rms(x, *a, **k):
        calls["rms"].append(len(x))
        return real_rms(x, *a, **k)

    monkeypatch.setattr(writer_mod, "sketch_rows", count_sketch)
    monkeypatch.setattr(writer_mod, "slot_rms", count_rms)
    rng = np.random.default_rng(6)
    data = _stored(rng, 600, 4096, "bfloat16")  # 256-row chunks at 4096 bf16 (2 MiB, aligned)
    _write(tmp_path / "t.h5", data, [1], dtype="bfloat16", width=4096)
    # 600 single-row appends: two full blocks and the rest at close, not 600 products
    assert calls["sketch"] == [256, 256, 256]  # always the whole block (rows past fill dropped)
    assert calls["rms"] == [256, 256, 88]


def test_supplied_and_computed_rows_interleave(tmp_path):
    """Appends that give sketch/RMS and appends that leave them to the writer, in any order: every
    row keeps what was given or gets what the writer computes, in row order."""
    rng = np.random.default_rng(7)
    width, n = 64, 260
    data = _stored(rng, n, width, "float32")
    given_sk = rng.standard_normal((n, 16), dtype=np.float32)
    given_rms = rng.random((n, 1), dtype=np.float32) + 5
    pattern = [(3, True, False), (1, False, True), (130, False, False), (7, True, True), (2, False, False),
               (90, True, False), (27, False, True)]
    gave_sk = np.zeros(n, bool)
    gave_rms = np.zeros(n, bool)
    with TraceWriter(tmp_path / "t.h5", model={"hidden_size": width}, sketch_dim=16, flush_rows=64,
                     flush_seconds=None) as w:
        w.define_tensor("x", width)
        s = 0
        for m, sk, rm in pattern:
            rows = w.add_tokens("r", np.arange(s, s + m), np.zeros(m, np.int64), "train", step=s)
            w.append("x", rows, data[s:s + m], sketch=given_sk[s:s + m] if sk else None,
                     rms=given_rms[s:s + m] if rm else None)
            gave_sk[s:s + m], gave_rms[s:s + m] = sk, rm
            s += m
    assert s == n
    with TraceReader(tmp_path / "t.h5") as r:
        sk, rms = r.read_sketch("x"), r.read_rms("x")
    ref_sk = sketch_np(data, width, 16, r.sketch_seed)
    np.testing.assert_array_equal(sk[gave_sk], given_sk[gave_sk])
    np.testing.assert_allclose(sk[~gave_sk], ref_sk[~gave_sk], rtol=1e-5, atol=1e-5 * float(np.abs(ref_sk).max()))
    np.testing.assert_array_equal(rms[gave_rms], given_rms[gave_rms])
    np.testing.assert_array_equal(rms[~gave_rms], slot_rms(data, width)[~gave_rms])


def test_writer_computed_rows_are_committed_by_a_flush(tmp_path):
    """A trace copied while its writer is still open (what a SIGKILL leaves) holds every row up to
    the last flush, with the sketch and RMS the writer computed for them, and nothing after."""
    rng = np.random.default_rng(8)
    width = 4096
    data = _stored(rng, 400, width, "bfloat16")
    p, crashed = tmp_path / "t.h5", tmp_path / "crashed.h5"
    w = TraceWriter(p, side="serve", model={"hidden_size": width}, flush_rows=None, flush_seconds=None, sketch_dim=16)
    w.define_tensor("x", width, dtype="bfloat16")
    for s in range(0, 200, 4):
        w.append("x", w.add_tokens("r", np.arange(s, s + 4), np.zeros(4, np.int64), "decode", step=s), data[s:s + 4])
    w.flush()  # 200 rows: one full block of 128 written at fill, 72 still buffered before the flush
    for s in range(200, 400, 4):  # past the flush: crosses another block, never committed
        w.append("x", w.add_tokens("r", np.arange(s, s + 4), np.zeros(4, np.int64), "decode", step=s), data[s:s + 4])
    shutil.copyfile(p, crashed)
    w.close()
    x32 = to_float32(data, "bfloat16")
    with TraceReader(crashed) as r, TraceReader(p) as full:
        assert not r.complete and "not closed cleanly" in (r.recovered_note or "")
        assert r.tensors["x"].rows == 200 and len(r.tokens) == 200
        assert r.read_values("x", raw=True).tobytes() == data[:200].tobytes()
        np.testing.assert_array_equal(r.read_rms("x"), slot_rms(x32[:200], width))
        assert r.read_sketch("x").tobytes() == full.read_sketch("x", 0, 200).tobytes()
        assert full.tensors["x"].rows == 400
        np.testing.assert_array_equal(full.read_rms("x"), slot_rms(x32, width))


def test_token_table_across_chunks_and_flushes(tmp_path):
    """Token rows are kept as columns plus one (seq, regime, step) run per call and filled into
    the record buffer when it is written: calls that cross the 2048-row chunk, flushes that split
    a chunk, and every column come back as given."""
    rng = np.random.default_rng(9)
    sizes = [1, 2047, 3, 2500, 0, 7, 4096, 1, 300]
    want = []
    with TraceWriter(tmp_path / "t.h5", model={"hidden_size": 4}, flush_rows=1000, flush_seconds=None) as w:
        w.define_tensor("x", 4)
        for i, n in enumerate(sizes):
            pos = rng.integers(0, 10**9, n)
            tok = rng.integers(-5, 2**40, n)
            seq, regime, step = f"s{i % 3}", ("prefill", "decode", "train")[i % 3], (-7, 0, 2**31 - 1)[i % 3]
            rows = w.add_tokens(seq, pos, tok, regime, step=step)
            w.append("x", rows, np.full((n, 4), i, np.float32))
            want += [(i % 3, p, t, ("prefill", "decode", "train")[i % 3], step) for p, t in zip(pos, tok)]
        with pytest.raises(ValueError, match="int32"):
            w.add_tokens("s0", [1], [1], "train", step=2**31)
    with TraceReader(tmp_path / "t.h5") as r:
        tab = r.tokens
        assert len(tab) == sum(sizes)
        np.testing.assert_array_equal(tab["seq"], [x[0] for x in want])
        np.testing.assert_array_equal(tab["position"], [x[1] for x in want])
        np.testing.assert_array_equal(tab["token"], [x[2] for x in want])
        np.testing.assert_array_equal(tab["step"], [x[4] for x in want])
        codes = {name: code for code, name in enumerate(REGIMES)}
        np.testing.assert_array_equal(tab["regime"], [codes[x[3]] for x in want])
        np.testing.assert_array_equal(r.read_values("x")[:, 0], np.repeat(np.arange(len(sizes)), sizes))


def _mixed_recording(path, seed, calls):
    """A recording that mixes every kind of append: bf16 and float32 tensors, with and without a
    sketch dataset, sketch and RMS given or left to the writer, lists and arrays, empty calls,
    calls that cross chunks, several sequences and flushes; returns the errors the bad calls
    raised."""
    rng = np.random.default_rng(seed)
    errors = []
    with TraceWriter(path, side="serve", model={"hidden_size": 8, "num_layers": 4}, flush_rows=700,
                     flush_seconds=None, sketch_dim=4) as w:
        w.define_tensor("b", 8, kind="boundary", boundary=1, dtype="bfloat16", sketch=False)
        w.define_tensor("f", 16, kind="packed", dtype="float32", slots=SlotSpec(labels=["layer1", "layer2"]))
        w.define_tensor("s", 8, kind="other", dtype="float32", values=False)
        for c in range(calls):
            n = int(rng.choice([0, 1, 3, 4, 5, 130, 600]))
            pos = np.arange(c * 1000, c * 1000 + n, dtype=np.int64)
            tok = rng.integers(0, 1000, n)
            if c % 7 == 3:
                pos, tok = pos.tolist(), tok.tolist()
            rows = w.add_tokens(f"r{c % 3}", pos, tok, ("decode", "prefill", 2)[c % 3], step=c)
            x = rng.standard_normal((n, 8)).astype(np.float32)
            bits = f32_to_bf16_bits(x)
            w.append("b", rows if c % 5 else rows.tolist(), bits,
                     rms=slot_rms(x, 8) if c % 4 else None)
            y = rng.standard_normal((n, 16)).astype(np.float32)
            if c % 3 == 0:
                w.append("f", rows, y)  # the writer computes sketch and RMS
            else:
                w.append("f", rows, y, rms=slot_rms(y, 8),
                         sketch=rng.standard_normal((n, 8)).astype(np.float32 if c % 2 else np.float64))
            w.append("s", rows, None, sketch=rng.standard_normal((n, 4)).astype(np.float32),
                     rms=rng.random((n, 1)).astype(np.float32))
            if n and c % 6 == 1:
                r = slot_rms(x, 8)
                for bad_rows, bad_values in ((rows + 10**6, bits), (rows, bits[:, :4]), (rows, x)):
                    try:
                        w.append("b", bad_rows, bad_values, rms=r)
                    except ValueError as e:
                        errors.append(str(e))
    return errors


def test_the_compiled_appends_write_what_the_checked_path_writes(tmp_path, monkeypatch):
    """The writer's compiled appends (``put_rows``/``put_tokens``) and its checked Python path
    write the same file, dataset by dataset, and raise the same errors; the compiled path is the
    one a recorder's calls take."""
    taken = {"rows": 0, "tokens": 0}
    put_rows, put_tokens = writer_mod.put_rows, writer_mod.put_tokens

    def counting_rows(*a):
        ok = put_rows(*a)
        taken["rows"] += ok
        return ok

    def counting_tokens(*a):
        r = put_tokens(*a)
        taken["tokens"] += r >= 0
        return r

    monkeypatch.setattr(writer_mod, "put_rows", counting_rows)
    monkeypatch.setattr(writer_mod, "put_tokens", counting_tokens)
    fast_err = _mixed_recording(tmp_path / "fast.h5", 5, 60)
    assert taken["rows"] >= 15 and taken["tokens"] >= 15  # (the rest: lists, float64, empty or chunk-filling calls)
    monkeypatch.setattr(writer_mod, "put_rows", lambda *a: False)
    monkeypatch.setattr(writer_mod, "put_tokens", lambda *a: -1)
    slow_err = _mixed_recording(tmp_path / "slow.h5", 5, 60)
    assert fast_err == slow_err and fast_err
    with TraceReader(tmp_path / "fast.h5") as a, TraceReader(tmp_path / "slow.h5") as b:
        assert np.array_equal(a.tokens, b.tokens)
        for name in ("b", "f", "s"):
            assert a.tensors[name].rows == b.tensors[name].rows > 0
            np.testing.assert_array_equal(a.token_rows(name), b.token_rows(name))
            np.testing.assert_array_equal(a.read_rms(name).view(np.uint32), b.read_rms(name).view(np.uint32))
            if name != "b":
                np.testing.assert_array_equal(a.read_sketch(name).view(np.uint32), b.read_sketch(name).view(np.uint32))
            if name != "s":
                np.testing.assert_array_equal(a.read_values(name), b.read_values(name))


def test_flush_triggers_follow_their_attributes_and_byte_keys_decode(tmp_path):
    """``flush_rows``/``flush_seconds`` set after the writer opened take effect on the next call
    (the compiled add_tokens path reads the triggers they set); a bytes sequence key is its UTF-8
    text, as HDF5 stores it."""
    with TraceWriter(tmp_path / "t.h5", model={"hidden_size": 4}, flush_rows=None, flush_seconds=None) as w:
        w.define_tensor("x", 4)
        for i in range(3):
            w.append("x", w.add_tokens("s", np.arange(i * 4, i * 4 + 4), np.zeros(4, np.int64), "decode", step=i),
                     np.zeros((4, 4), np.float32), rms=np.zeros((4, 1), np.float32))
        assert w.flush_count == 0
        w.flush_rows = 8
        w.add_tokens("s", np.arange(12, 16), np.zeros(4, np.int64), "decode", step=3)
        assert w.flush_count == 1 and w.flushed["tokens"] == 12
        assert w.sequence(b"s") == w.sequence("s") == 0
        with pytest.raises(ValueError, match="UTF-8"):
            w.sequence(b"\xff")


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_whole_chunks_given_with_their_rms_are_written_from_the_callers_array(tmp_path, monkeypatch, dtype):
    """Values given with their RMS (nothing for the writer to derive from its buffer): a chunk of
    them that starts at a chunk boundary goes to the file straight from the caller's array, not
    through the buffer; the file holds the same rows whatever the pieces, flushes and offsets, and
    rows whose RMS the writer owes still go through the buffer (its RMS is derived there)."""
    rng = np.random.default_rng(7)
    width = 64
    data = _stored(rng, 2000, width, dtype)
    rms = slot_rms(to_float32(data, dtype), width)
    through_buffer = []
    real = writer_mod._Appender._write_full

    def spy(self):
        if self.ds.name.endswith("/values"):
            through_buffer.append(self.base)
        return real(self)

    monkeypatch.setattr(writer_mod._Appender, "_write_full", spy)
    paths = []
    for case, pattern in enumerate([[2000], [3, 700, 1, 1100, 196], [513, 1487], [1] * 7 + [1993]]):
        path = tmp_path / f"t{case}.h5"
        paths.append(path)
        through_buffer.clear()
        with TraceWriter(path, side="serve", model={"hidden_size": width, "num_layers": 4}, flush_rows=None,
                         flush_seconds=None) as w:
            w.define_tensor("p", width, kind="boundary", boundary=1, dtype=dtype, sketch=False)
            chunk = w._tensors["p"]["values"].chunk
            s = 0
            for i, n in enumerate(pattern):
                rows = w.add_tokens("r", np.arange(s, s + n), np.zeros(n, np.int64), "decode", step=i)
                w.append("p", rows, data[s:s + n], rms=rms[s:s + n])
                s += n
                if i == 1:
                    w.flush()
        with TraceReader(path) as r:
            assert r.read_values("p", raw=True).tobytes() == data.tobytes()
            np.testing.assert_array_equal(r.read_rms("p"), rms)
        assert chunk < 1000
        if pattern == [2000]:  # every whole chunk from the array itself
            assert through_buffer == []
    # the writer's own RMS (none given): every chunk through the buffer, where it is derived
    through_buffer.clear()
    _write(tmp_path / "own.h5", data, [2000], dtype=dtype, width=width)
    with TraceReader(tmp_path / "own.h5") as r:
        assert r.read_values("p", raw=True).tobytes() == data.tobytes()
        np.testing.assert_array_equal(r.read_rms("p"), rms)
    assert len(through_buffer) == 2000 // chunk


def test_extents_only_grow_and_plain_1d_datasets_take_whole_chunk_writes(tmp_path, monkeypatch):
    """Between and at flushes an extent is set to the rows written and only ever grows: HDF5
    shrinking one rewrites its last chunk (it fills the part past the new extent), so no tensor
    dataset is ever shrunk; the row indices (1-D int64) are written as whole raw chunks like the
    values; what is read back is every row appended, whatever the flushes."""
    import h5py

    calls = []
    real = h5py.Dataset.resize

    def resize(self, size, axis=None):
        if "/tensors/" in self.name:
            calls.append((self.name, size))
        return real(self, size, axis)

    monkeypatch.setattr(h5py.Dataset, "resize", resize)
    rng = np.random.default_rng(11)
    width = 48
    data = _stored(rng, 3000, width, "float32")
    rms = slot_rms(data, width)
    path = tmp_path / "t.h5"
    with TraceWriter(path, side="serve", model={"hidden_size": width, "num_layers": 4}, flush_rows=None,
                     flush_seconds=None) as w:
        w.define_tensor("p", width, kind="boundary", boundary=1, dtype="float32", sketch=False)
        assert w._tensors["p"]["rows"].direct and w._tensors["p"]["values"].direct
        assert not w._tokens.direct  # a compound type: through h5py's conversion
        s = 0
        given = []
        for i, n in enumerate([5, 300, 1, 1100, 7, 1500, 87]):
            rows = w.add_tokens("r", np.arange(s, s + n), np.zeros(n, np.int64), "decode", step=i)
            given.append(rows[::-1].copy())
            w.append("p", given[-1], data[s:s + n], rms=rms[s:s + n])
            s += n
            if i % 2:
                w.flush()
                apps = w._tensors["p"]  # the extents after a flush: exactly the rows written
                assert apps["values"].ds.shape[0] == apps["rows"].ds.shape[0] == apps["rms"].ds.shape[0] == s
    assert calls == []
    with TraceReader(path) as r:
        assert r.read_values("p", raw=True).tobytes() == data.tobytes()
        np.testing.assert_array_equal(r.read_rms("p"), rms)
    with h5py.File(path, "r") as f:
        np.testing.assert_array_equal(f["tensors/p/rows"][()], np.concatenate(given))


def _chunk_offsets(path, name):
    import h5py

    with h5py.File(path, "r") as f:
        ds = f[f"tensors/{name}/values"]
        got = []
        ds.id.chunk_iter(lambda info: got.append((info.byte_offset, info.size)))
        return ds.chunks, got


def test_rows_that_divide_2_mib_get_2_mib_chunks_at_multiples_of_2_mib(tmp_path):
    """Values rows that fill 2 MiB exactly (H=4096 bf16: 256 rows) are chunked in 2 MiB and every
    chunk starts at a multiple of 2 MiB, also when tensors interleave (the page cache holds each as
    one huge page; a diff maps it with one fault). The alignment leaves few gaps: the file stays
    within 2% of its payload. Rows that do not divide 2 MiB keep chunks of about 1 MiB, placed as
    before, and a tiny trace stays small."""
    from tensordiff.trace.schema import ALIGN_BYTES

    rng = np.random.default_rng(8)
    p = tmp_path / "wide.h5"
    n, tensors = 1024, 6
    with TraceWriter(p, side="train", model={"hidden_size": 4096, "num_layers": tensors},
                     flush_rows=128, flush_seconds=None) as w:
        for b in range(tensors):
            w.define_tensor(f"layer{b}", 4096, kind="boundary", boundary=b, dtype="bfloat16", sketch=False)
        w.define_tensor("odd", 7168, kind="other", dtype="bfloat16", sketch=False)
        for s in range(0, n, 64):   # recorded batch by batch: the tensors' chunks interleave
            rows = w.add_tokens("r", np.arange(s, s + 64), np.zeros(64, np.int64), "train")
            for b in range(tensors):
                w.append(f"layer{b}", rows, f32_to_bf16_bits(rng.standard_normal((64, 4096), dtype=np.float32)))
            w.append("odd", rows, f32_to_bf16_bits(rng.standard_normal((64, 7168), dtype=np.float32)))
    for b in range(tensors):
        chunks, offs = _chunk_offsets(p, f"layer{b}")
        assert chunks == (256, 4096) and len(offs) == 4
        assert all(o % ALIGN_BYTES == 0 and size == ALIGN_BYTES for o, size in offs), offs
    chunks, offs = _chunk_offsets(p, "odd")
    assert chunks == (64, 7168) and len(offs) == 16   # 896 KiB: not aligned
    payload = n * (tensors * 4096 + 7168) * 2
    assert os.path.getsize(p) <= 1.02 * payload + (1 << 20), (os.path.getsize(p), payload)
    with TraceReader(p) as r:
        assert r.read_values("layer3", 250, 260, raw=True).shape == (10, 4096)
    tiny = tmp_path / "tiny.h5"
    _write(tiny, _stored(rng, 16, 64, "bfloat16"), [4], dtype="bfloat16", width=64)
    assert os.path.getsize(tiny) < 512 << 10


@pytest.mark.parametrize("row_bytes, rows", [
    (4 << 10, 512), (8 << 10, 256), (32 << 10, 64), (128 << 10, 16),   # 2 MiB chunks, aligned
    (256 << 10, 16), (1 << 20, 16), (2 << 20, 16), (4 << 20, 16),       # at least 16 rows
    (8 << 20, 8), (64 << 20, 1),                                        # within what a reader reads whole
    (3 * 1024, 256), (28 << 10, 32), (64, 512), (4, 512),
])
def test_chunks_hold_2mib_where_rows_fill_it_else_about_1mib_and_16_rows_or_more(row_bytes, rows):
    from tensordiff.trace.schema import MAX_CHUNK_BYTES

    got = writer_mod._chunk_rows(row_bytes)
    assert got == rows
    assert got * row_bytes <= MAX_CHUNK_BYTES
