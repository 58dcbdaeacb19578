"""Trace sets: per-rank files (named as the SGLang plugin names them) read as one trace."""

from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest
from setgen import LENGTH, H, make_recording, write, write_ranks

from tensordiff.cli import jsonable, main
from tensordiff.diff import diff_traces
from tensordiff.errors import IncompatibleTracesError, TensordiffError, UsageError
from tensordiff.traceset import set_paths
from tensordiff.traceset import (
    TraceSet,
    is_set_spec,
    open_trace,
    parse_ranks,
    trace_paths,
)


def diff(a: str, b: str) -> dict:
    res = diff_traces(a, b)
    d = jsonable(res.to_dict())
    for side in ("a", "b"):
        d[side].pop("path")
    return d


@pytest.fixture(scope="module")
def recs():
    return {"train": make_recording("train"),
            "serve": make_recording("serve", noise=1e-6, seed=1, drift=True, wrong_slot=True),
            "serve_ok": make_recording("serve", noise=1e-6, seed=2)}


@pytest.fixture(scope="module")
def ref(tmp_path_factory, recs):
    d = tmp_path_factory.mktemp("ref")
    return {"train": write(str(d / "train.h5"), recs["train"]), "serve": write(str(d / "serve.h5"), recs["serve"]),
            "serve_ok": write(str(d / "serve_ok.h5"), recs["serve_ok"])}


def test_parse_ranks_and_specs(tmp_path):
    assert parse_ranks("d/serve.dp1.pp0.tp1.h5") == ("d/serve", {"dp": 1, "pp": 0, "tp": 1})
    assert parse_ranks("d/serve.tp3.dp0.hdf5") == ("d/serve", {"tp": 3, "dp": 0})
    assert parse_ranks("d/shard-0007.h5") == ("d/shard-0007", {})
    with pytest.raises(UsageError, match="TP rank twice"):
        parse_ranks("serve.tp0.tp1.h5")
    f = write(str(tmp_path / "one.h5"), make_recording("train"))
    assert not is_set_spec(f) and is_set_spec(str(tmp_path)) and is_set_spec(str(tmp_path / "*.h5"))
    assert trace_paths(f) == [f] and trace_paths(str(tmp_path)) == [f]
    with open_trace(f) as r:
        assert not isinstance(r, TraceSet)


LAYOUTS = {
    "tp2_dp2": {"dp": 2, "tp": 2},
    "pp2_dp2": {"dp": 2, "pp": 2},
    "pp2_dp2_tp2": {"dp": 2, "pp": 2, "tp": 2},
    "attn_dp_tp2": {"tp": 2, "tp_replicated": False},
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_set_diffs_as_one_trace(tmp_path, recs, ref, layout):
    """The set of per-rank files gives exactly the diff of the same data in one file, with a real
    divergence (a drifting layer and a slot holding the wrong state) and on an agreeing pair."""
    for which in ("serve", "serve_ok"):
        d = str(tmp_path / which)
        paths = write_ranks(d, recs[which], **LAYOUTS[layout])
        assert len(paths) == np.prod([LAYOUTS[layout].get(a, 1) for a in ("dp", "pp", "tp")])
        one = diff(ref["train"], ref[which])
        for spec in (d, os.path.join(d, "serve.*.h5")):
            got = diff(ref["train"], spec)
            assert got == one, layout
            # and the other argument order: the set as the reference
            assert diff(spec, ref["train"]) == diff(ref[which], ref["train"])
        if which == "serve":
            kinds = {f["kind"] for f in one["findings"] if f["severity"] == "divergence"}
            assert {"numeric", "slot_identity"} <= kinds
        else:
            assert one["verdict"] == "agree"


def test_set_reads_like_the_one_file(tmp_path, recs, ref):
    d = str(tmp_path / "s")
    write_ranks(d, recs["serve"], dp=2, pp=2, tp=2)
    from tensordiff.trace import TraceReader

    with TraceSet(d) as s, TraceReader(ref["serve"]) as r:
        assert s.sequences == r.sequences
        assert set(s.tensors) == set(r.tensors)
        for name, info in r.tensors.items():
            si = s.tensors[name]
            assert si.rows == info.rows and si.width == info.width and si.dtype == info.dtype
            # the same (seq, position) for every tensor row, and the same stored values
            tok_s = s.tokens[s.token_rows(name)]
            tok_r = r.tokens[r.token_rows(name)]
            for col in ("seq", "position", "token"):
                assert np.array_equal(tok_s[col], tok_r[col])
            idx = np.array([info.rows - 1, 0, 3, 3, info.rows // 2])
            assert np.array_equal(s.read_at(name, "values", idx), r.read_at(name, "values", idx))
            assert np.array_equal(s.read_values(name), r.read_values(name))
            assert np.array_equal(s.read_rms(name, 2, 7), r.read_rms(name, 2, 7))
        assert s.check_replicas() == []
        assert s.replicated_rows == sum(i.rows for i in r.tensors.values())


def test_a_tensor_part_reads_alike_from_a_set_and_its_file_and_holds_no_hdf5_object(tmp_path, recs, ref):
    """``part(name, kind)``: plain shape and dtype, rows by index, by range and in place, the same
    from a set as from the one file; the replica checks and the files rows lie in are a set's alone
    (a file holds each row once, all of them)."""
    import h5py

    from tensordiff.errors import TensordiffError
    from tensordiff.trace import Replicated, Sharded, TensorPart, TraceReader, segments_of

    d = str(tmp_path / "s")
    write_ranks(d, recs["serve"], dp=2, pp=2, tp=2)
    with TraceSet(d) as s, TraceReader(ref["serve"]) as r:
        assert isinstance(s, Replicated) and not isinstance(r, Replicated)
        assert isinstance(s, Sharded) and not isinstance(r, Sharded)
        assert not hasattr(r, "check_replicas") and not hasattr(r, "dataset") and not hasattr(s, "dataset")
        rows = np.arange(4, dtype=np.int64)
        (one,) = segments_of(r, "layer2", rows)
        assert one.path == r.path and np.array_equal(one.rows, rows) and one.pos is None
        assert {g.path for g in segments_of(s, "layer2", rows)} <= {m.path for m in s.members}
        for name, info in r.tensors.items():
            for kind in ("values", "sketch", "rms"):
                if not r.has_part(name, kind):
                    with pytest.raises(TensordiffError, match=f"has no {kind}"):
                        r.part(name, kind)
                    continue
                ps, pr = s.part(name, kind), r.part(name, kind)
                for p in (ps, pr):
                    assert isinstance(p, TensorPart) and type(p.shape) is tuple and isinstance(p.dtype, np.dtype)
                    assert not any(isinstance(v, (h5py.Dataset, h5py.Group, h5py.File)) for v in vars(p).values())
                assert ps.shape == pr.shape and ps.dtype == pr.dtype and pr.shape[0] == info.rows
                assert pr.row_bytes == int(np.prod(pr.shape[1:])) * pr.dtype.itemsize
                idx = np.array([info.rows - 1, 0, 3, 3, info.rows // 2])
                assert np.array_equal(ps.take(idx), pr.take(idx))
                assert np.array_equal(ps.rows(2, 7), pr.rows(2, 7)) and len(pr.rows(2, 7)) == 5
                assert np.array_equal(pr.rows(), pr.take(np.arange(info.rows)))
                run = np.arange(1, 4)
                for p in (ps, pr):
                    got = p.map(run)
                    if got is not None:   # in place where the file allows: the same rows
                        assert np.array_equal(np.concatenate(got.parts) if hasattr(got, "parts") else got, pr.take(run))


def test_replica_that_differs_is_reported(tmp_path, recs):
    """A TP replica with one row off by one bf16 ulp is a mismatch naming the tensor, the file and
    the first token; the lowest rank's rows are the ones read."""
    d = str(tmp_path / "s")
    # s5 lives on dp1; position 3 of layer2 (bf16) in the tp1 copy
    tweak = {".dp1.tp1": {("layer2", "s5", 3): np.float32(0.05)}}
    write_ranks(d, recs["serve"], dp=2, tp=2, tweak=tweak)
    with TraceSet(d) as s:
        mm = s.check_replicas()
        assert len(mm) == 1
        m = mm[0]
        assert (m.tensor, m.axis, m.seq, m.position, m.differing) == ("layer2", "tp", "s5", 3, 1)
        assert os.path.basename(m.replica) == "serve.dp1.tp1.h5" and os.path.basename(m.primary) == "serve.dp1.tp0.h5"
        assert m.rows == 4 * LENGTH and m.max_abs > 0.01 and m.token == int(recs["serve"].tokens["s5"][3])
        assert "TP replicas of serve disagree: layer2 in serve.dp1.tp1.h5" in m.sentence("serve")
        json.dumps(m.to_dict())


def test_replica_mismatch_is_a_divergence_of_the_diff(tmp_path, recs, ref):
    """An otherwise agreeing pair: the differing replica alone makes the verdict a divergence."""
    d = str(tmp_path / "s")
    write_ranks(d, recs["serve_ok"], dp=2, tp=2, tweak={".dp1.tp1": {("layer2", "s5", 3): np.float32(0.05)}})
    got = diff(ref["train"], d)
    assert got["verdict"] == "divergence" and got["exit_code"] == 1
    (f,) = [f for f in got["findings"] if f["severity"] == "divergence"]
    assert f["kind"] == "replica" and f["tensor"] == "layer2" and (f["seq"], f["position"]) == ("s5", 3)
    assert f["message"].startswith("TP replicas of serve disagree: layer2 in serve.dp1.tp1.h5 differs from "
                                   "serve.dp1.tp0.h5 (the one compared) in 1 of 40 replicated rows")
    assert got["headline"] == f["message"]
    # the same set as the reference side, and the JSON keeps its schema
    rev = diff(d, ref["train"])
    assert [x["kind"] for x in rev["findings"] if x["severity"] == "divergence"] == ["replica"]
    jsonschema = pytest.importorskip("jsonschema")
    from tensordiff.report.text import diff_schema

    jsonschema.validate(jsonable(diff_traces(ref["train"], d).to_dict()), diff_schema())


def test_cli_info_and_diff_on_sets(tmp_path, recs, ref, capsys):
    d = str(tmp_path / "s")
    write_ranks(d, recs["serve"], dp=2, pp=2, host="node-3")
    assert main(["info", d]) == 0
    out = capsys.readouterr().out
    assert "trace set: 4 files, 2 token shards (DP=2, PP=2)" in out and "serve.dp1.pp1.h5: ranks dp1 pp1, host node-3" in out
    assert main(["info", d, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["set"]["layout"] == {"dp": 2, "pp": 2, "tp": 0}
    assert main(["diff", ref["train"], d, "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["findings"] == diff(ref["train"], ref["serve"])["findings"]


@pytest.mark.parametrize("kind", ["mixed_models", "duplicate_dp", "missing_stage", "empty_dir"])
def test_cli_bad_sets_one_line_exit_2(tmp_path, recs, ref, capsys, kind):
    d = _bad(tmp_path, recs, kind)
    for argv in (["diff", ref["train"], d], ["diff", d, ref["train"]], ["info", d]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("tensordiff: error: ")
        assert re.search(BAD[kind][1], err), err


def test_pp_overlap_is_checked_like_a_replica(tmp_path, recs):
    """Two stages that both recorded the boundary between them: compared, the first stage's used."""
    d = str(tmp_path / "s")
    rec = recs["serve_ok"]
    os.makedirs(d)
    write(os.path.join(d, "serve.pp0.h5"), rec, tensors=["embed", "layer1", "layer2"])
    write(os.path.join(d, "serve.pp1.h5"), rec, tensors=["layer2", "layer3", "layer4", "final_norm"],
          tweak={("layer2", "s0", 0): np.float32(1.0)})
    with TraceSet(d) as s:
        assert s.tensors["layer2"].rows == len(rec.keys) * LENGTH
        (m,) = s.check_replicas()
        assert (m.tensor, m.axis, m.seq, m.position) == ("layer2", "pp", "s0", 0)
        assert "PP stages of serve disagree" in m.sentence("serve")


def test_index_says_which_file_holds_what(tmp_path, recs):
    d = str(tmp_path / "s")
    write_ranks(d, recs["serve"], dp=2, pp=2, host="node-7")
    with TraceSet(d) as s:
        ix = s.index()
        summ = s.summary()
    assert ix["layout"] == {"dp": 2, "pp": 2, "tp": 0} and ix["shards"] == 2 and ix["hosts"] == ["node-7"]
    f0 = ix["files"][0]
    assert f0["file"] == "serve.dp0.pp0.h5" and f0["ranks"] == {"dp": 0, "pp": 0} and f0["host"] == "node-7"
    assert f0["sequence_keys"] == ["s0", "s1", "s2", "s3"] and f0["tensors"] == ["embed", "layer1", "layer2"]
    assert ix["files"][3]["tensors"] == ["layer3", "aux", "layer4", "final_norm"]  # forward order
    assert summ["tokens"]["sequences"] == 8 and summ["set"] == ix
    assert {t["name"]: t["shape"][0] for t in summ["tensors"]}["layer3"] == 8 * LENGTH


# -- bad sets: one line, IncompatibleTracesError / UsageError ----------------------------------------


def _bad(tmp_path, recs, kind: str) -> str:
    d = str(tmp_path / kind)
    rec = recs["serve_ok"]
    if kind == "mixed_models":
        write_ranks(d, rec, dp=2)
        write(os.path.join(d, "serve.dp1.h5"), rec, keys=rec.keys[4:], model={"num_layers": 4, "hidden_size": H,
                                                                               "architecture": "Other"})
    elif kind == "duplicate_dp":
        write_ranks(d, rec, dp=2)
        write(os.path.join(d, "serve.dp1.h5"), rec, keys=rec.keys[3:])  # s3 on both ranks
    elif kind == "missing_stage":
        write_ranks(d, rec, dp=2, pp=2, skip={".dp1.pp1"})
    elif kind == "missing_stage_size":
        write_ranks(d, rec, pp=2, skip={".pp1"})
    elif kind == "missing_dp":
        os.makedirs(d)
        write(os.path.join(d, "serve.dp0.h5"), rec, keys=rec.keys[:2], meta={"ranks": {"dp_rank": 0, "dp_size": 3}})
        write(os.path.join(d, "serve.dp2.h5"), rec, keys=rec.keys[2:4], meta={"ranks": {"dp_rank": 2, "dp_size": 3}})
    elif kind == "empty_dir":
        os.makedirs(d)
        open(os.path.join(d, "notes.txt"), "w").close()
    elif kind == "mixed_sides":
        write_ranks(d, rec, dp=2)
        write(os.path.join(d, "serve.dp1.h5"), make_recording("train"), keys=rec.keys[4:])
    elif kind == "token_disagrees":
        write_ranks(d, rec, tp=2)
        other = make_recording("serve", model_seed=99)
        write(os.path.join(d, "serve.tp1.h5"), other)
    elif kind == "renamed":
        write_ranks(d, rec, dp=2)
        os.rename(os.path.join(d, "serve.dp1.h5"), os.path.join(d, "serve.dp2.h5"))
    return d


BAD = {
    "mixed_models": (IncompatibleTracesError, "mixes models: serve.dp1.h5 has architecture 'Other'"),
    "duplicate_dp": (IncompatibleTracesError, "duplicate tokens across DP ranks or shards: sequence s3 position 0"),
    "missing_stage": (IncompatibleTracesError, "missing PP stage 1 of serve.dp1"),
    "missing_stage_size": (IncompatibleTracesError, "missing PP stage 1 of serve .has stage 0; expected 0..1"),
    "missing_dp": (IncompatibleTracesError, "missing DP rank 1 of serve"),
    "empty_dir": (UsageError, "no trace files"),
    "mixed_sides": (IncompatibleTracesError, "mixes sides"),
    "token_disagrees": (IncompatibleTracesError, "disagree on a token"),
    "renamed": (IncompatibleTracesError, "missing DP rank 1|says dp2 but its recorder wrote dp_rank 1"),
}


@pytest.mark.parametrize("kind", sorted(BAD))
def test_bad_sets_are_refused(tmp_path, recs, kind):
    d = _bad(tmp_path, recs, kind)
    err, msg = BAD[kind]
    with pytest.raises(err, match=msg) as ei:
        TraceSet(d).close()
    assert "\n" not in str(ei.value) and isinstance(ei.value, TensordiffError)


def test_glob_without_matches(tmp_path):
    with pytest.raises(UsageError, match="no file matches"):
        TraceSet(str(tmp_path / "nothing*.h5"))


def test_tui_vectors_read_from_a_set(tmp_path, recs, ref):
    """The TUI's vector pane reads a row of a set like a row of the one file."""
    from tensordiff.tui.data import VectorSource

    d = str(tmp_path / "s")
    write_ranks(d, recs["serve"], dp=2, pp=2)
    one, many = VectorSource(ref["train"], ref["serve"]), VectorSource(ref["train"], d)
    try:
        r1, r2 = one.reader(1), many.reader(1)
        assert r1.sequences == r2.sequences and set(r1.tensors) == set(r2.tensors)
        tok = int(recs["serve"].tokens["s5"][7])
        row1 = one.row_of(1, "layer3", r1.sequences.index("s5"), 7, tok)
        row2 = many.row_of(1, "layer3", r2.sequences.index("s5"), 7, tok)
        assert row1 is not None and row2 is not None
        assert np.array_equal(r1.read_values_at("layer3", np.array([row1])), r2.read_values_at("layer3", np.array([row2])))
    finally:
        one.close()
        many.close()


def test_a_set_directory_never_follows_a_link_out_of_it(tmp_path):
    """A member that is a symbolic link to a file elsewhere is refused with one line, not read."""
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    real = outside / "serve.tp0.h5"
    real.write_bytes(b"not read")
    d = tmp_path / "set"
    d.mkdir()
    (d / "serve.tp0.h5").symlink_to(real)
    with pytest.raises(UsageError, match="symbolic link out of the set"):
        set_paths(str(d))
