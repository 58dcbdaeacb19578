"""Every bad input gets exit code 2 and one line on stderr that names the problem, never a
traceback: the table in docs/robustness.md, as tests. Traces are written by the real
TraceWriter and then broken with h5py (no torch needed except by `record`/`import`)."""

from __future__ import annotations

import json
import os
import pty
import shutil
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from tensordiff.cli import main
from tracegen import assert_clean_exit, write_eagle, write_pair, write_trace

ROOT = Path(__file__).resolve().parents[1]


def cli(capsys, *argv) -> tuple[int, str]:
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert_clean_exit(rc, out, err, " ".join(map(str, argv)))
    return rc, err.strip()


def bad(capsys, expect: str, *argv) -> str:
    rc, err = cli(capsys, *argv)
    assert rc == 2, f"expected exit 2 for {argv}, got {rc}: {err}"
    assert expect.lower() in err.lower(), f"{argv}: {err!r} does not say {expect!r}"
    if os.environ.get("TENSORDIFF_SHOW_ERRORS"):  # to refresh the table in docs/robustness.md
        print(f"\nBAD {os.environ.get('PYTEST_CURRENT_TEST', '').split(' ')[0]} | {argv[0]} | {err}")
    return err


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    d = tmp_path_factory.mktemp("good")
    a, b = write_pair(str(d))
    return {"dir": d, "a": a, "b": b}


@pytest.fixture
def trace(good, tmp_path):
    """A fresh copy of a valid trace to break."""
    p = tmp_path / "t.h5"
    shutil.copyfile(good["a"], p)
    return p


# ----------------------------------------------------------------------------------------------
# files that are not traces


def test_info_no_such_file(capsys, tmp_path):
    bad(capsys, "no such file", "info", tmp_path / "missing.h5")


def test_info_directory(capsys, tmp_path):
    bad(capsys, "no trace files (*.h5, *.hdf5) in this directory", "info", tmp_path)  # a directory is a trace set


def test_info_not_hdf5(capsys, tmp_path):
    p = tmp_path / "notes.txt"
    p.write_text("hello\n")
    bad(capsys, "not an HDF5 file", "info", p)


def test_info_empty_file(capsys, tmp_path):
    p = tmp_path / "empty.h5"
    p.write_bytes(b"")
    bad(capsys, "empty file", "info", p)


def test_info_truncated(capsys, trace):
    data = trace.read_bytes()
    trace.write_bytes(data[: len(data) // 3])
    bad(capsys, "truncated", "info", trace)


def test_info_hdf5_but_not_a_trace(capsys, tmp_path):
    p = tmp_path / "other.h5"
    with h5py.File(p, "w") as f:
        f["x"] = np.arange(3)
    bad(capsys, "not a tensordiff trace", "info", p)


def test_info_unknown_schema(capsys, trace):
    with h5py.File(trace, "r+") as f:
        f.attrs["tensordiff_schema"] = 99
    bad(capsys, "unknown trace schema version 99", "info", trace)


def test_info_missing_tokens(capsys, trace):
    with h5py.File(trace, "r+") as f:
        del f["tokens"]
    bad(capsys, "missing the /tokens table", "info", trace)


# ----------------------------------------------------------------------------------------------
# hostile structure: nothing outside the file is followed


def test_info_external_link_not_followed(capsys, trace, good):
    with h5py.File(trace, "r+") as f:
        del f["tokens"]
        f["tokens"] = h5py.ExternalLink(good["b"], "/tokens")
    bad(capsys, "external link", "info", trace)


def test_info_soft_link_not_followed(capsys, trace):
    with h5py.File(trace, "r+") as f:
        del f["tensors/embed/rows"]
        f["tensors/embed/rows"] = h5py.SoftLink("/tensors/layer1/rows")
    bad(capsys, "soft link", "info", trace)


def test_info_virtual_dataset_refused(capsys, trace, good):
    with h5py.File(trace, "r+") as f:
        shape = f["tensors/embed/values"].shape
        layout = h5py.VirtualLayout(shape=shape, dtype="<f4")
        layout[:] = h5py.VirtualSource(good["b"], "tensors/embed/values", shape=shape)
        del f["tensors/embed/values"]
        f.create_virtual_dataset("tensors/embed/values", layout)
    bad(capsys, "virtual dataset", "info", trace)


def test_info_external_raw_storage_refused(capsys, trace, tmp_path):
    ext = tmp_path / "outside.bin"
    ext.write_bytes(bytes(4 * 36 * 16))
    with h5py.File(trace, "r+") as f:
        del f["tensors/embed/values"]
        f.create_dataset("tensors/embed/values", shape=(36, 16), dtype="<f4", external=[(str(ext), 0, h5py.h5f.UNLIMITED)])
    bad(capsys, "external files", "info", trace)


# ----------------------------------------------------------------------------------------------
# attributes and sizes


def test_info_attribute_not_json(capsys, trace):
    with h5py.File(trace, "r+") as f:
        f.attrs["model"] = "{not json"
    bad(capsys, "attribute 'model' is not valid JSON", "info", trace)


def test_info_attribute_array_where_a_number_belongs(capsys, trace):
    with h5py.File(trace, "r+") as f:
        f["tensors/embed"].attrs["width"] = np.arange(1000)
    bad(capsys, "'width' of tensor 'embed' is an array of 1000 values", "info", trace)


def test_info_attribute_reference_type(capsys, trace):
    with h5py.File(trace, "r+") as f:
        f.attrs["side"] = f["tokens"].ref
    bad(capsys, "attribute 'side' holds references", "info", trace)


def test_info_string_attribute_too_long(capsys, trace):
    with h5py.File(trace, "r+") as f:
        f.attrs["producer"] = "x" * (2 << 20)
    bad(capsys, "'producer' is longer than", "info", trace)


def test_info_sketch_dim_out_of_range(capsys, trace):
    with h5py.File(trace, "r+") as f:
        f.attrs["sketch_dim"] = -4
    bad(capsys, "sketch_dim -4 out of range", "info", trace)


def test_info_table_larger_than_the_file(capsys, trace):
    """A token table that declares 2^33 rows is refused before a byte of it is read."""
    with h5py.File(trace, "r+") as f:
        f["tokens"].resize(2**33, axis=0)
        f.attrs["flushed_tokens"] = np.int64(2**33)
    bad(capsys, "/tokens claims 8589934592 rows", "info", trace)


def test_info_chunks_too_large(capsys, trace):
    with h5py.File(trace, "r+") as f:
        del f["tensors/embed/sketch"]
        f.create_dataset("tensors/embed/sketch", shape=(36, 8), maxshape=(None, 8), chunks=(2**22, 8), dtype="<f4")
    bad(capsys, "has chunks of", "info", trace)


def test_info_wrong_values_dtype(capsys, trace):
    with h5py.File(trace, "r+") as f:
        del f["tensors/layer2/values"]
        f["tensors/layer2/values"] = np.zeros((36, 16), np.float64)
    bad(capsys, "values stored as float64, expected uint16 for bfloat16", "info", trace)


def test_info_wrong_values_shape(capsys, trace):
    with h5py.File(trace, "r+") as f:
        del f["tensors/embed/values"]
        f["tensors/embed/values"] = np.zeros((36, 15), np.float32)
    bad(capsys, "values has shape (36, 15), expected (rows, 16)", "info", trace)


def test_info_heap_that_makes_hdf5_loop(capsys, trace, monkeypatch):
    """A zeroed object header in the global heap (where string attributes live) sends HDF5 into an
    endless loop; the CLI meets it in a child process and gives up after the open timeout."""
    data = bytearray(trace.read_bytes())
    g = data.find(b"GCOL")
    first = g + 16
    size = int.from_bytes(data[first + 8:first + 16], "little")
    second = first + 16 + (size + 7) // 8 * 8
    data[second:second + 16] = bytes(16)
    trace.write_bytes(bytes(data))
    monkeypatch.setenv("TENSORDIFF_OPEN_TIMEOUT", "3")
    bad(capsys, "made no progress in 3 s: the file is damaged", "info", trace)


def test_info_rows_outside_token_table(capsys, trace):
    with h5py.File(trace, "r+") as f:
        f["tensors/embed/rows"][3] = 10**6
    bad(capsys, "row indices point outside the token table", "info", trace)


def test_info_unknown_regime(capsys, trace):
    with h5py.File(trace, "r+") as f:
        t = f["tokens"][()]
        t["regime"][0] = 200
        f["tokens"][...] = t
    bad(capsys, "unknown regime code", "info", trace)


def test_info_closed_trace_modified_afterwards(capsys, trace):
    with h5py.File(trace, "r+") as f:
        f["tensors/embed/values"].resize(10, axis=0)
    bad(capsys, "datasets disagree on the row count", "info", trace)


# ----------------------------------------------------------------------------------------------
# values by reference (docs/format.md, "Values by reference"): the draft input of write_eagle takes
# its rows' values from aux_hidden_states; each break is one line naming it, never a traceback


@pytest.fixture(scope="module")
def refs_good(tmp_path_factory):
    return write_eagle(str(tmp_path_factory.mktemp("refs") / "refs.h5"), refs=True)


@pytest.fixture
def refs(refs_good, tmp_path):
    p = tmp_path / "refs.h5"
    shutil.copyfile(refs_good, p)
    return p


DRAFT = "tensors/draft_input"


def _copy_group(f, src: str, dst: str) -> None:
    f.copy(f[f"tensors/{src}"], f"tensors/{dst}")


def _set_source(f, value) -> None:
    f[DRAFT].attrs["values_source"] = value


def _chain(f) -> None:
    _copy_group(f, "draft_input", "draft_copy")
    f["tensors/draft_copy"].attrs["values_source"] = "draft_input"


def _other_dtype(f) -> None:
    _copy_group(f, "aux_hidden_states", "aux_f16")
    g = f["tensors/aux_f16"]
    g.attrs["dtype"] = "float16"
    shape = g["values"].shape
    del g["values"]
    g["values"] = np.zeros(shape, np.float16)
    _set_source(f, "aux_f16")


def _other_slots(f) -> None:
    _copy_group(f, "aux_hidden_states", "aux_flat")
    g = f["tensors/aux_flat"]
    n, w = g["values"].shape
    g.attrs.update({"kind": "other", "slot_count": 1, "slot_width": w})
    del g.attrs["slot_labels"], g["sketch"], g["rms"]
    g["rms"] = np.ones((n, 1), np.float32)
    _set_source(f, "aux_flat")


def _replace_ref(f, data) -> None:
    del f[f"{DRAFT}/values_ref"]
    f[f"{DRAFT}/values_ref"] = data


def _ref_entry(f, at: int | None, value: int) -> None:
    ref = f[f"{DRAFT}/values_ref"]
    arr = ref[()]
    i = int(np.flatnonzero(arr >= 0)[0]) if at is None else at
    ref[i] = value


def _own_count(f) -> None:
    ref = f[f"{DRAFT}/values_ref"]
    arr = ref[()]
    ref[int(np.flatnonzero(arr == -1)[0])] = 0   # one row fewer of its own than its values dataset holds


def _longer_ref(f) -> None:
    ref = f[f"{DRAFT}/values_ref"]
    ref.resize(ref.shape[0] + 1, axis=0)


def _ref_as_external_link(f, other) -> None:
    del f[f"{DRAFT}/values_ref"]
    f[f"{DRAFT}/values_ref"] = h5py.ExternalLink(other, f"{DRAFT}/values_ref")


REFS_BROKEN = {
    "source missing": (lambda f: f[DRAFT].attrs.__delitem__("values_source"),
                       "has a values_ref dataset but no values_source attribute"),
    "source not a string": (lambda f: _set_source(f, 5), "attribute 'values_source' of tensor 'draft_input' is not a string"),
    "source a path": (lambda f: _set_source(f, "../aux_hidden_states"), "values_source is not a tensor name"),
    "source not a tensor": (lambda f: _set_source(f, "nope"), "its values_source 'nope' is not a tensor of this trace"),
    "source itself": (lambda f: _set_source(f, "draft_input"), "takes its values by reference from itself"),
    "source refers too": (_chain, "its values_source 'draft_input' takes its values by reference too"),
    "source narrower": (lambda f: _set_source(f, "layer1"),
                        "is float32 of width 64 (1 x 64), not bfloat16 of width 128 (2 x 64)"),
    "source other dtype": (_other_dtype, "is float16 of width 128"),
    "source other slots": (_other_slots, "(1 x 128), not bfloat16 of width 128 (2 x 64)"),
    "values_ref missing": (lambda f: f[DRAFT].__delitem__("values_ref"), "has a values_source but no values_ref dataset"),
    "values_ref floats": (lambda f: _replace_ref(f, np.zeros(714, np.float64)), "values_ref is not a 1-D integer dataset"),
    "values_ref 2-D": (lambda f: _replace_ref(f, np.zeros((714, 2), np.int64)), "values_ref is not a 1-D integer dataset"),
    "values_ref longer": (_longer_ref, "datasets disagree on the row count"),
    "values_ref past the source": (lambda f: _ref_entry(f, None, 720), "values_ref points at row 720 of 'aux_hidden_states', "
                                   "which has 720 rows"),
    "values_ref huge": (lambda f: _ref_entry(f, None, 2**62), "values_ref points at row 4611686018427387904"),
    "values_ref below -1": (lambda f: _ref_entry(f, 3, -7), "values_ref holds -7, expected -1"),
    "own values miscounted": (_own_count, "rows of its own values (-1), but its values dataset holds"),
    "own values missing": (lambda f: f[DRAFT].__delitem__("values"), "has neither values nor a sketch"),
    "schema 1": (lambda f: f.attrs.__setitem__("tensordiff_schema", 1), "a schema 2 feature, but the trace says schema 1"),
}


@pytest.mark.parametrize("case", list(REFS_BROKEN))
def test_info_values_by_reference_broken(capsys, refs, case):
    mutate, expect = REFS_BROKEN[case]
    with h5py.File(refs, "r+") as f:
        mutate(f)
    bad(capsys, expect, "info", refs)


def test_diff_values_by_reference_broken(capsys, refs, refs_good):
    with h5py.File(refs, "r+") as f:
        _ref_entry(f, None, 10**9)
    bad(capsys, "values_ref points at row 1000000000", "diff", refs_good, refs, "-q")
    bad(capsys, "values_ref points at row 1000000000", "diff", refs, refs_good, "-q")


def test_info_values_ref_external_link_not_followed(capsys, refs, refs_good):
    with h5py.File(refs, "r+") as f:
        _ref_as_external_link(f, str(refs_good))
    bad(capsys, "external link", "info", refs)


def test_info_values_by_reference_in_an_unknown_schema(capsys, refs):
    with h5py.File(refs, "r+") as f:
        f.attrs["tensordiff_schema"] = 3
    bad(capsys, "unknown trace schema version 3 (this tensordiff reads versions 1 to 2)", "info", refs)


# ----------------------------------------------------------------------------------------------
# diff: checks of the pair (the aligner's) and of the options


def test_diff_empty_trace(capsys, good, tmp_path):
    p = tmp_path / "empty.h5"
    write_trace(str(p), seqs=0)
    bad(capsys, "no tokens (empty trace)", "diff", good["a"], p, "-q")


def test_diff_killed_before_first_flush(capsys, good, tmp_path):
    """What a recorder killed in its first seconds leaves: a trace that opens, with nothing in it."""
    p = tmp_path / "killed.h5"
    w = write_trace(str(p), seqs=2, close=False)
    shutil.copyfile(p, tmp_path / "snapshot.h5")  # never flushed: the file as a kill leaves it
    w.close()
    rc, err = cli(capsys, "info", tmp_path / "snapshot.h5")
    assert rc == 0
    bad(capsys, "no tokens (empty trace)", "diff", good["a"], tmp_path / "snapshot.h5", "-q")


def test_diff_no_common_tokens(capsys, good, tmp_path):
    p = tmp_path / "other.h5"
    write_trace(str(p), side="serve", tokens_offset=1000)
    bad(capsys, "no common tokens", "diff", good["a"], p, "-q")


def test_diff_packed_width_not_multiple_of_hidden(capsys, good, tmp_path):
    """Both traces say hidden size 12, but the packed draft input is 32 wide."""
    pair = []
    for side in ("a", "b"):
        p = tmp_path / f"{side}.h5"
        shutil.copyfile(good[side], p)
        with h5py.File(p, "r+") as f:
            f.attrs["model"] = json.dumps({"num_layers": 3, "hidden_size": 12})
        pair.append(p)
    bad(capsys, "has width 32, not a multiple of the hidden size 12", "diff", *pair, "-q")


def test_diff_different_hidden_sizes(capsys, good, tmp_path):
    p = tmp_path / "b32.h5"
    write_trace(str(p), side="serve", hidden=32)
    bad(capsys, "different hidden sizes", "diff", good["a"], p, "-q")


def test_diff_bad_tolerance(capsys, good):
    bad(capsys, "--tol 'embed=abc'", "diff", good["a"], good["b"], "--tol", "embed=abc", "-q")


def test_diff_unreadable_calibration(capsys, good, tmp_path):
    p = tmp_path / "cal.json"
    p.write_text("{broken")
    bad(capsys, "calibration", "diff", good["a"], good["b"], "--calibration", p, "-q")


def test_diff_bad_second_trace(capsys, good, tmp_path):
    p = tmp_path / "b.txt"
    p.write_text("not a trace")
    bad(capsys, "b.txt: not an HDF5 file", "diff", good["a"], p, "-q")


# ----------------------------------------------------------------------------------------------
# tui: bad traces are refused before the screen is taken over (forked, so a started app cannot hang the run)


@pytest.mark.parametrize("which,expect", [("missing", "no such file"), ("text", "not an HDF5 file")])
def test_tui_rejects_bad_trace_before_starting(good, tmp_path, which, expect):
    p = tmp_path / "x.h5"
    if which == "text":
        p.write_text("hello")
    # on a terminal (a pseudo-terminal): without one the TUI refuses before it reads any trace
    master, slave = pty.openpty()
    try:
        r = subprocess.run([sys.executable, "-m", "tensordiff", "tui", good["a"], str(p)], stdin=slave, stdout=slave,
                           stderr=subprocess.PIPE, text=True, timeout=60, check=False,
                           env=dict(os.environ, TERM="xterm-256color",
                                    PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")))
    finally:
        os.close(slave)
        os.close(master)
    assert_clean_exit(r.returncode, "", r.stderr, "tui")
    assert r.returncode == 2 and expect in r.stderr, r.stderr


# ----------------------------------------------------------------------------------------------
# import and record: inputs rejected before any heavy work


def test_import_missing_source(capsys, tmp_path):
    bad(capsys, "no such file or directory", "import", tmp_path / "nope.pt", "--out", tmp_path / "o.h5")


def test_import_not_a_checkpoint(capsys, tmp_path):
    p = tmp_path / "hs.pt"
    p.write_text("plain text, not torch.save")
    bad(capsys, "not a torch checkpoint", "import", p, "--out", tmp_path / "o.h5")


def test_import_empty_directory(capsys, tmp_path):
    d = tmp_path / "dump"
    d.mkdir()
    bad(capsys, "no .ckpt", "import", d, "--out", tmp_path / "o.h5")


def test_import_bad_argument(capsys, tmp_path):
    p = tmp_path / "hs.pt"
    p.write_text("x")
    bad(capsys, "expected NAME=LABEL", "import", p, "--out", tmp_path / "o.h5", "--as", "garbage")


def test_record_missing_model_dir(capsys, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('[1, 2, 3]\n')
    bad(capsys, "model directory not found", "record", "train", "--model", tmp_path / "nope", "--prompts", prompts,
        "--out", tmp_path / "o.h5")


def test_record_serve_missing_model_dir(capsys, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('[1, 2, 3]\n')
    bad(capsys, "model directory not found", "record", "serve", "--model", tmp_path / "nope", "--prompts", prompts,
        "--out", tmp_path / "o.h5")


def test_record_model_dir_without_config(capsys, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('[1, 2, 3]\n')
    (tmp_path / "m").mkdir()
    bad(capsys, "cannot read the model config", "record", "train", "--model", tmp_path / "m", "--prompts", prompts,
        "--out", tmp_path / "o.h5")


def test_record_bad_argument(capsys, tmp_path):
    bad(capsys, "--sample-every must be >= 0", "record", "train", "--model", tmp_path, "--prompts", tmp_path / "p",
        "--out", tmp_path / "o.h5", "--sample-every", "-1")


def test_record_output_directory_missing(capsys, tmp_path):
    bad(capsys, "output directory does not exist", "record", "train", "--model", tmp_path, "--prompts",
        tmp_path / "p", "--out", tmp_path / "no" / "such" / "o.h5")


def test_usage_error_is_one_line(capsys):
    bad(capsys, "the following arguments are required: b", "diff", "only-one.h5")
