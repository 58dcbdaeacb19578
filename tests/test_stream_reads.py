"""The serial backend reads B's rows in a second thread while its reader reads A's, and the noise
model reads its sample of each catalog state one state ahead, A's rows and B's rows in a thread
each (with a second core): the diff is the same bytes as with the reads in line, on pairs with
real divergences, for single files and trace sets, in both orders; a failed read on either side
still ends the diff with the file's error, and no reading thread outlives the diff."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest

import importlib
from setgen import make_recording, write, write_ranks
from tensordiff import catalog, noise, noise_io
from tensordiff.cli import jsonable
from tensordiff.diff import DiffOptions, diff_traces
from tensordiff.errors import TraceFileError
from tensordiff.trace import runs
from tensordiff.trace.reads import RowReads

stream = importlib.import_module("tensordiff.diff.stream")   # the package exports a function of that name


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    d = tmp_path_factory.mktemp("side")
    train = make_recording("train")
    bad = make_recording("serve", noise=1e-6, seed=1, drift=True, wrong_slot=True)
    out = {"train": write(str(d / "train.h5"), train),
           "bad": write(str(d / "bad.h5"), bad, tweak={("layer1", "s6", 2): np.float32(np.nan)})}
    write_ranks(str(d / "bad_set"), bad, dp=2, pp=2)
    out["bad_set"] = str(d / "bad_set")
    return out


PAIRS = [("train", "bad"), ("bad", "train"), ("train", "bad_set"), ("bad_set", "train")]


def _json(a, b, **kw):
    kw.setdefault("block_rows", 16)
    return json.dumps(jsonable(diff_traces(a, b, DiffOptions(**kw)).to_dict()))


def _fit_spy(monkeypatch):
    """The states each noise fit measured, fit by fit."""
    fitted = []
    real_fit = noise.fit

    def fit(*args, **kw):
        fitted.append(args[2])
        return real_fit(*args, **kw)

    monkeypatch.setattr(noise, "fit", fit)
    return fitted


def _reader_threads(monkeypatch):
    names: set[str] = set()
    real = RowReads.read_at

    def spy(self, *args, **kw):
        names.add(threading.current_thread().name)
        return real(self, *args, **kw)

    monkeypatch.setattr(RowReads, "read_at", spy)
    return names


@pytest.mark.parametrize("pair", PAIRS)
def test_reading_b_beside_a_gives_the_same_diff(traces, monkeypatch, pair):
    a, b = traces[pair[0]], traces[pair[1]]
    monkeypatch.setattr(RowReads, "_mapped_rows", lambda self, ds, lo, hi, path=None: None)   # blocks copied, not mapped
    monkeypatch.setattr(stream, "compute_lanes", lambda: 1)   # one core: one reader thread
    one = _json(a, b)
    monkeypatch.setattr(stream, "compute_lanes", lambda: 2)
    names = _reader_threads(monkeypatch)
    two = _json(a, b)
    assert two == one
    assert any(n.startswith("tensordiff-read-b") for n in names)


def test_a_failed_read_on_either_side_ends_the_diff_with_its_error(traces, monkeypatch):
    monkeypatch.setattr(RowReads, "_mapped_rows", lambda self, ds, lo, hi, path=None: None)   # blocks copied, not mapped
    monkeypatch.setattr(stream, "compute_lanes", lambda: 2)
    real = RowReads.read_at

    def broken(self, name, part, idx, out=None, **kw):
        if threading.current_thread().name.startswith("tensordiff-read-b"):
            raise TraceFileError("cannot read layer1/values, the file is damaged (test)", self.path)
        return real(self, name, part, idx, out=out, **kw)

    monkeypatch.setattr(RowReads, "read_at", broken)
    with pytest.raises(TraceFileError, match="damaged"):
        diff_traces(traces["train"], traces["bad"], DiffOptions(block_rows=16))


@pytest.mark.parametrize("pair", PAIRS)
def test_reading_the_noise_sample_ahead_in_threads_gives_the_same_diff(traces, monkeypatch, pair):
    a, b = traces[pair[0]], traces[pair[1]]
    fitted = _fit_spy(monkeypatch)
    monkeypatch.setattr(noise_io, "usable_cores", lambda: 1)
    names = _reader_threads(monkeypatch)
    one = _json(a, b, noise_from_pass=False)   # the sample read before the pass (traces too large to keep its metrics)
    assert not any(n.startswith("tensordiff-noise") for n in names)
    monkeypatch.setattr(noise_io, "usable_cores", lambda: 2)
    names.clear()
    two = _json(a, b, noise_from_pass=False)
    assert two == one
    assert any(n.startswith("tensordiff-noise-a") for n in names)
    assert any(n.startswith("tensordiff-noise-b") for n in names)
    assert len(fitted) == 2 and len(fitted[0]) >= 3, "the pair has measured catalog states"
    assert fitted[1] == fitted[0]
    assert not [t.name for t in threading.enumerate() if t.name.startswith("tensordiff-noise")]


@pytest.mark.parametrize("side", ["a", "b"])
def test_a_failed_sample_read_on_either_side_ends_the_diff_with_its_error(traces, monkeypatch, side):
    monkeypatch.setattr(noise_io, "usable_cores", lambda: 2)
    real = RowReads.read_at
    calls = []

    def broken(self, name, part, idx, out=None, **kw):
        if threading.current_thread().name.startswith(f"tensordiff-noise-{side}"):
            calls.append(name)
            if len(calls) == 2:   # the second state's read: one state was already read ahead
                raise TraceFileError(f"cannot read {name}/{part}, the file is damaged (test)", self.path)
        return real(self, name, part, idx, out=out, **kw)

    monkeypatch.setattr(RowReads, "read_at", broken)
    with pytest.raises(TraceFileError, match="damaged"):
        diff_traces(traces["train"], traces["bad"], DiffOptions(block_rows=16, noise_from_pass=False))
    assert not [t.name for t in threading.enumerate() if t.name.startswith("tensordiff-noise")]


run = importlib.import_module("tensordiff.diff.run")   # the package exports names, not the module


def _sample_reads_spy(monkeypatch):
    calls = []
    real = noise_io._sample_reads

    def spy(*args, **kw):
        calls.append(1)
        return real(*args, **kw)

    monkeypatch.setattr(noise_io, "_sample_reads", spy)
    return calls


@pytest.mark.parametrize("pair", PAIRS)
def test_the_noise_measured_from_the_pass_gives_the_diff_of_the_sample_read_first(traces, monkeypatch, pair):
    a, b = traces[pair[0]], traces[pair[1]]
    fitted = _fit_spy(monkeypatch)
    reads = _sample_reads_spy(monkeypatch)
    first = _json(a, b, noise_from_pass=False)
    assert reads == [1]
    reads.clear()
    from_pass = _json(a, b)
    assert reads == [], "no row is read a second time for the noise"
    assert from_pass == first
    assert len(fitted) == 2 and len(fitted[0]) >= 3, "the pair has measured catalog states"
    assert fitted[1] == fitted[0]


def test_a_pass_too_large_to_keep_reads_the_sample_first(traces, monkeypatch):
    reads = _sample_reads_spy(monkeypatch)
    kept = _json(traces["train"], traces["bad"])
    assert reads == []
    monkeypatch.setattr(run, "PASS_KEEP", 10)
    assert _json(traces["train"], traces["bad"]) == kept
    assert reads == [1]


def test_a_diff_with_a_sink_reads_the_sample_first(traces, monkeypatch):
    """A sink sees every block as it is measured, judged against the final tolerances."""
    reads = _sample_reads_spy(monkeypatch)
    seen = []

    class Sink:
        def write(self, ia, ib, k, blk, m, bad):
            seen.append(int(bad.sum()))

        def close(self):
            pass

    diff_traces(traces["train"], traces["bad"], DiffOptions(block_rows=16, sinks=[lambda al, ra, rb: Sink()]))
    assert reads == [1] and seen and sum(seen) > 0


@pytest.mark.parametrize("pair", PAIRS)
def test_blocks_mapped_in_place_give_the_diff_of_blocks_copied(traces, monkeypatch, pair):
    a, b = traces[pair[0]], traces[pair[1]]
    real = RowReads._mapped_rows
    mapped = []

    def spy(self, ds, lo, hi, path=None):
        got = real(self, ds, lo, hi, path)
        if got is not None:
            assert not got.flags.writeable, "an input's pages are never written"
            mapped.append(hi - lo)
        return got

    monkeypatch.setattr(RowReads, "_mapped_rows", spy)
    gathered = []
    real_gather = runs.gather
    monkeypatch.setattr(runs, "gather", lambda block, idx: gathered.append(len(idx)) or real_gather(block, idx))
    in_place = _json(a, b)
    assert mapped, "the blocks were mapped"
    if "bad_set" not in pair:   # a set's rows span its members: read, not mapped
        assert gathered, "the identity search gathered its scattered rows from the mapped span"
    monkeypatch.setattr(RowReads, "_mapped_rows", lambda self, ds, lo, hi, path=None: None)
    assert _json(a, b) == in_place


@pytest.mark.parametrize("mapped", [True, False], ids=["mapped", "read"])
def test_a_file_that_shrank_after_it_was_opened_is_an_error_never_zeros_nor_a_fault(traces, tmp_path, mapped):
    """Rows past the end of a file that shrank after it was opened: a mapping there would kill the
    process (SIGBUS), and HDF5 reads zeros there; both are the file's one-line error."""
    import shutil

    from tensordiff.trace import TraceReader

    path = str(tmp_path / "shrinks.h5")
    shutil.copy(traces["train"], path)

    def rows(r, n):
        idx = np.arange(r.tensors[n].rows)
        if mapped:
            got = r.map_rows(n, "values", idx)
            assert got is not None
            return got
        return r.read_at(n, "values", idx)

    with TraceReader(path) as r:
        names = [n for n, i in sorted(r.tensors.items(), key=lambda t: t[1].order) if i.has_values]
        whole = {n: np.array(rows(r, n)) for n in names}
        with open(path, "r+b") as fh:
            fh.truncate(r.file_size // 2)
        with pytest.raises(TraceFileError, match="damaged"):
            for n in names:   # the last tensors' rows now lie past the end
                assert np.array_equal(np.array(rows(r, n)), whole[n])


H_WIDE, LAYERS_WIDE, TOKENS_WIDE = 1024, 4, 640   # 4 KB rows: 256 rows a chunk, a block spans chunks


def _wide_pair(tmp_path, nan_layer: int | None = None):
    """A written layer by layer (each tensor's chunks follow each other in the file) and B pass by
    pass (the tensors' chunks interleave, as an engine's recording does); B's layer2 is off.
    ``nan_layer``: that layer of A holds a NaN in every row."""
    from tensordiff.dtypes import f32_to_bf16_bits
    from tensordiff.trace import TraceWriter

    rng = np.random.default_rng(3)
    x = rng.standard_normal((TOKENS_WIDE, H_WIDE)).astype(np.float32)
    states = [x]
    for _ in range(1, LAYERS_WIDE):
        states.append(states[-1] + np.float32(0.1) * rng.standard_normal(x.shape).astype(np.float32))
    paths = {}
    for side, by_pass in (("train", False), ("serve", True)):
        path = str(tmp_path / f"{side}.h5")
        with TraceWriter(path, side=side, producer="tests", model={"num_layers": LAYERS_WIDE, "hidden_size": H_WIDE}) as w:
            for b in range(LAYERS_WIDE):
                w.define_tensor(f"layer{b}", H_WIDE, kind="boundary", boundary=b, role="catalog", dtype="bfloat16")
            rows = w.add_tokens("req-0", np.arange(TOKENS_WIDE), np.arange(TOKENS_WIDE) % 500 + 3,
                                "train" if side == "train" else "prefill")
            got = [s.copy() for s in states]
            if nan_layer is not None and not by_pass:
                got[nan_layer][:, 5] = np.nan
            if by_pass:
                got[2] = got[2] + np.float32(0.5) * rng.standard_normal(x.shape).astype(np.float32)
                for p0 in range(0, TOKENS_WIDE, 32):
                    for b in range(LAYERS_WIDE):
                        w.append(f"layer{b}", rows[p0:p0 + 32], f32_to_bf16_bits(got[b][p0:p0 + 32]))
            else:
                for b in range(LAYERS_WIDE):
                    w.append(f"layer{b}", rows, f32_to_bf16_bits(got[b]))
        paths[side] = path
    return paths["train"], paths["serve"]


def test_blocks_whose_chunks_interleave_are_mapped_in_pieces_and_give_the_copied_diff(tmp_path, monkeypatch):
    from tensordiff.trace import Pieces

    a, b = _wide_pair(tmp_path)
    real = RowReads._mapped_rows
    kinds = []

    def spy(self, ds, lo, hi, path=None):
        got = real(self, ds, lo, hi, path)
        kinds.append(type(got).__name__)
        if isinstance(got, Pieces):
            assert len(got.parts) > 1 and all(not p.flags.writeable for p in got.parts)
        return got

    monkeypatch.setattr(RowReads, "_mapped_rows", spy)
    # blocks of the default size: each spans both chunks of a tensor
    in_place = [_json(x, y, noise_from_pass=f, block_rows=4096) for x, y in ((a, b), (b, a)) for f in (True, False)]
    assert "Pieces" in kinds, kinds
    doc = json.loads(in_place[0])
    assert doc["first_divergence"]["tensor"] == "layer2"
    monkeypatch.setattr(RowReads, "_mapped_rows", lambda self, ds, lo, hi, path=None: None)
    kinds.clear()
    assert [_json(x, y, noise_from_pass=f, block_rows=4096) for x, y in ((a, b), (b, a)) for f in (True, False)] == in_place


def _candidate_spy(monkeypatch):
    """(tensor, scored in place as stored bfloat16 bits) of every candidate the searches read."""
    seen = []
    real = catalog.IdentitySearch._candidate

    def spy(self, r, info, rows, basis):
        got = real(self, r, info, rows, basis)
        seen.append((info.name, got.bf16))
        return got

    monkeypatch.setattr(catalog.IdentitySearch, "_candidate", spy)
    return seen


@pytest.mark.parametrize("pair", PAIRS)
def test_candidates_scored_where_they_lie_give_the_diff_of_candidates_converted(traces, monkeypatch, pair):
    """The identity search scores a bfloat16 candidate's stored bits where they lie (mapped, or
    gathered from a set's members) rather than a float32 copy: the same JSON, both orders."""
    a, b = traces[pair[0]], traces[pair[1]]
    seen = _candidate_spy(monkeypatch)
    in_place = _json(a, b)
    assert any(bits for _, bits in seen), seen
    monkeypatch.setattr(catalog, "_IN_PLACE", {})   # every candidate converted to float32, as before
    seen.clear()
    assert _json(a, b) == in_place
    assert seen and not any(bits for _, bits in seen)


def test_candidates_in_pieces_or_with_a_nan_score_as_converted(tmp_path, monkeypatch):
    """Interleaved chunks (Pieces: gathered in their stored form) and a candidate with a NaN in
    every row (zeroed on the float32 copy: the converted path) give the converted diff."""
    a, b = _wide_pair(tmp_path, nan_layer=1)
    seen = _candidate_spy(monkeypatch)
    in_place = [_json(x, y, block_rows=4096) for x, y in ((a, b), (b, a))]
    assert json.loads(in_place[0])["first_divergence"]["tensor"] == "layer1"   # A's NaNs come first
    assert ("layer1", False) in seen and ("layer0", True) in seen, seen
    monkeypatch.setattr(catalog, "_IN_PLACE", {})
    assert [_json(x, y, block_rows=4096) for x, y in ((a, b), (b, a))] == in_place


def test_mapped_blocks_are_made_in_the_diffs_thread_and_copied_ones_ahead_in_the_readers(traces, monkeypatch):
    """A block both sides map in place is made when the pass asks for it, in its own thread (a
    hand-off to the reader costs more than the mapping); copied blocks are read one ahead in the
    reader thread. The same JSON either way."""
    a, b = traces["train"], traces["bad"]
    made: list[tuple[str, bool]] = []
    real = RowReads._mapped_rows

    def spy(self, ds, lo, hi, path=None):
        got = real(self, ds, lo, hi, path)
        made.append((threading.current_thread().name, got is not None))
        return got

    monkeypatch.setattr(RowReads, "_mapped_rows", spy)
    mapped = _json(a, b)
    pass_maps = [name for name, ok in made if ok and not name.startswith("tensordiff-identity")]
    # the first block (both sides) is made ahead, before the pass knows its blocks are mapped
    assert pass_maps[:2] == ["tensordiff-read_0"] * 2 and set(pass_maps[2:]) == {"MainThread"}, made
    names = _reader_threads(monkeypatch)
    monkeypatch.setattr(RowReads, "_mapped_rows", lambda self, ds, lo, hi, path=None: None)
    assert _json(a, b) == mapped
    assert any(n.startswith("tensordiff-read") for n in names)


def test_tensors_of_several_widths_and_dtypes_map_their_own_rows(tmp_path):
    """Row geometry and chunk tables are kept per dataset path: tensors of different widths and
    dtypes whose chunks interleave in one file (2 MiB aligned, ~1 MiB and narrow chunks) each
    map exactly their own stored rows, whatever was mapped before."""
    from tensordiff.dtypes import f32_to_bf16_bits
    from tensordiff.trace import TraceReader, TraceWriter
    from tensordiff.trace.reads import Pieces

    path = tmp_path / "mixed.h5"
    rng = np.random.default_rng(3)
    widths = {"wide": (4096, "bfloat16"), "odd": (1000, "float32"), "narrow": (24, "float32"), "mid": (2048, "float32")}
    with TraceWriter(path, model={"hidden_size": 4096, "num_layers": 4}) as w:
        for name, (h, dt) in widths.items():
            w.define_tensor(name, h, dtype=dt)
        for step in range(40):
            rows = w.add_tokens(f"s{step}", np.arange(37), rng.integers(0, 99, 37), "decode", step=step)
            for name, (h, dt) in widths.items():
                x = rng.standard_normal((37, h)).astype(np.float32)
                w.append(name, rows, f32_to_bf16_bits(x) if dt == "bfloat16" else x)
    mapped = set()
    with TraceReader(path) as r:
        want = {name: r.read_values(name, raw=True) for name in widths}
        for _ in range(3):
            for name in rng.permutation(list(widths)):
                lo = int(rng.integers(0, 1400))
                hi = int(rng.integers(lo + 1, 1481))
                got = r.map_rows(name, "values", np.arange(lo, hi))
                if got is None:
                    continue
                got = np.concatenate(got.parts) if isinstance(got, Pieces) else got
                assert got.shape == want[name][lo:hi].shape and got.tobytes() == want[name][lo:hi].tobytes(), name
                mapped.add(name)
    assert mapped == set(widths)
