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
from tensordiff import noise, noise_io
from tensordiff.cli import jsonable
from tensordiff.diff import DiffOptions, diff_traces
from tensordiff.errors import TraceFileError
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


def _json(a, b, **kw):
    return json.dumps(jsonable(diff_traces(a, b, DiffOptions(block_rows=16, **kw)).to_dict()))


def _reader_threads(monkeypatch):
    names: set[str] = set()
    real = RowReads.read_at

    def spy(self, *args, **kw):
        names.add(threading.current_thread().name)
        return real(self, *args, **kw)

    monkeypatch.setattr(RowReads, "read_at", spy)
    return names


@pytest.mark.parametrize("pair", [("train", "bad"), ("bad", "train"), ("train", "bad_set"), ("bad_set", "train")])
def test_reading_b_beside_a_gives_the_same_diff(traces, monkeypatch, pair):
    a, b = traces[pair[0]], traces[pair[1]]
    monkeypatch.setattr(stream, "compute_lanes", lambda: 1)   # one core: one reader thread
    one = _json(a, b)
    monkeypatch.setattr(stream, "compute_lanes", lambda: 2)
    names = _reader_threads(monkeypatch)
    two = _json(a, b)
    assert two == one
    assert any(n.startswith("tensordiff-read-b") for n in names)


def test_a_failed_read_on_either_side_ends_the_diff_with_its_error(traces, monkeypatch):
    monkeypatch.setattr(stream, "compute_lanes", lambda: 2)
    real = RowReads.read_at

    def broken(self, name, part, idx, out=None, **kw):
        if threading.current_thread().name.startswith("tensordiff-read-b"):
            raise TraceFileError("cannot read layer1/values, the file is damaged (test)", self.path)
        return real(self, name, part, idx, out=out, **kw)

    monkeypatch.setattr(RowReads, "read_at", broken)
    with pytest.raises(TraceFileError, match="damaged"):
        diff_traces(traces["train"], traces["bad"], DiffOptions(block_rows=16))


@pytest.mark.parametrize("pair", [("train", "bad"), ("bad", "train"), ("train", "bad_set"), ("bad_set", "train")])
def test_reading_the_noise_sample_ahead_in_threads_gives_the_same_diff(traces, monkeypatch, pair):
    a, b = traces[pair[0]], traces[pair[1]]
    fitted = []
    real_fit = noise.fit

    def fit(*args, **kw):
        fitted.append(args[2])   # the measured states
        return real_fit(*args, **kw)

    monkeypatch.setattr(noise, "fit", fit)
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


@pytest.mark.parametrize("pair", [("train", "bad"), ("bad", "train"), ("train", "bad_set"), ("bad_set", "train")])
def test_the_noise_measured_from_the_pass_gives_the_diff_of_the_sample_read_first(traces, monkeypatch, pair):
    a, b = traces[pair[0]], traces[pair[1]]
    fitted = []
    real_fit = noise.fit

    def fit(*args, **kw):
        fitted.append(args[2])   # the measured states
        return real_fit(*args, **kw)

    monkeypatch.setattr(noise, "fit", fit)
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


@pytest.mark.parametrize("pair", [("train", "bad"), ("bad", "train"), ("train", "bad_set"), ("bad_set", "train")])
def test_blocks_mapped_in_place_give_the_diff_of_blocks_copied(traces, monkeypatch, pair):
    a, b = traces[pair[0]], traces[pair[1]]
    real = RowReads._mapped_rows
    mapped = []

    def spy(self, ds, lo, hi):
        got = real(self, ds, lo, hi)
        if got is not None:
            assert not got.flags.writeable, "an input's pages are never written"
            mapped.append(hi - lo)
        return got

    monkeypatch.setattr(RowReads, "_mapped_rows", spy)
    in_place = _json(a, b)
    assert mapped, "the blocks were mapped"
    monkeypatch.setattr(RowReads, "_mapped_rows", lambda self, ds, lo, hi: None)
    assert _json(a, b) == in_place


@pytest.mark.parametrize("mapped", [True, False], ids=["mapped", "read"])
def test_a_file_that_shrank_after_it_was_opened_is_an_error_never_zeros_nor_a_fault(traces, tmp_path, mapped):
    """Rows past the end of a file that shrank after it was opened: a mapping there would kill the
    process (SIGBUS), and HDF5 reads zeros there; both are the file's one-line error."""
    import shutil

    from tensordiff.trace import TraceReader

    path = str(tmp_path / "shrinks.h5")
    shutil.copy(traces["train"], path)
    with TraceReader(path) as r:
        names = [n for n, i in sorted(r.tensors.items(), key=lambda t: t[1].order) if i.has_values]
        whole = {n: np.array(r.read_at(n, "values", np.arange(r.tensors[n].rows), mapped=mapped)) for n in names}
        with open(path, "r+b") as fh:
            fh.truncate(r.file_size // 2)
        with pytest.raises(TraceFileError, match="damaged"):
            for n in names:   # the last tensors' rows now lie past the end
                got = r.read_at(n, "values", np.arange(r.tensors[n].rows), mapped=mapped)
                assert np.array_equal(got, whole[n])
