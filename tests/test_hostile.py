"""Hostile and huge inputs (docs/robustness.md, "Hostile inputs"): files crafted to
exhaust memory, hang the CLI, inject terminal escapes or destroy an input. One test per class,
each bounded in time; memory is measured as the peak RSS of a fresh interpreter running the
command (and of its probe child) against a baseline run of the same command on a valid trace.

The files come from tests/hostile.py. Each test failed on the code before the fixes for its
class (checked by running this file against that commit) and passes after.
"""

from __future__ import annotations

import importlib
import os
import shutil
import signal
import time

import pytest

import hostile
from tracegen import assert_clean_exit, run_isolated, write_pair

# Headroom over the baseline run (same command, valid small trace, same imports). A crafted file
# may cost at most this much more: the documented working set of these files is a few MB.
RSS_HEADROOM_MIB = 150


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    d = tmp_path_factory.mktemp("good")
    a, b = write_pair(str(d))
    return {"dir": d, "a": a, "b": b}


@pytest.fixture(scope="module")
def baseline(good):
    """Peak RSS of `info` on a valid trace (MiB)."""
    rc, _, err, rss = hostile.peak_rss(["info", good["a"]])
    assert rc == 0 and rss > 0, err
    return rss


def bounded(argv, baseline, expect: str, **kw) -> str:
    rc, out, err, rss = hostile.peak_rss(argv, **kw)
    assert_clean_exit(rc, out, err, " ".join(argv))
    assert rss >= 0, err
    assert rss <= baseline + RSS_HEADROOM_MIB, f"{argv}: peak RSS {rss} MiB, baseline {baseline} MiB ({err[-300:]})"
    assert rc == 2 and expect in err, f"{argv}: rc={rc} {err[-500:]}"
    return err


def one_line(argv, expect: str, timeout: float = 60, env=None, rc_expected: int = 2, fresh: bool = False) -> str:
    """Run the command (forked, or in a fresh interpreter when ``fresh``: torch does not survive a
    fork of a process that has used it) and check it is one line on stderr, saying ``expect``."""
    if fresh:
        rc, out, err, _ = hostile.peak_rss([str(a) for a in argv], env=env, timeout=timeout + 60)
    else:
        rc, out, err = run_isolated([str(a) for a in argv], timeout=timeout, env=env)
    assert rc != 124, f"{argv}: did not finish in {timeout} s"
    assert_clean_exit(rc, out, err, " ".join(map(str, argv)))
    assert rc == rc_expected and expect in err, f"{argv}: rc={rc} {err[-500:]}"
    return err


# ----------------------------------------------------------------------------------------------
# memory: the budget comes from the bytes the file holds


@pytest.mark.parametrize("cmd", ["info", "diff"])
def test_sequence_keys_sharing_one_heap_string(tmp_path, baseline, good, cmd):
    """5000 keys pointing at one 100 KB string (a 0.5 MB file) decode to 500 MB: refused from the
    on-disk descriptors, before a string is decoded."""
    p = hostile.shared_heap_sequences(str(tmp_path / "t.h5"), entries=5000, string_bytes=100_000)
    assert os.path.getsize(p) < 2 << 20
    bounded(["info", p] if cmd == "info" else ["diff", good["a"], p, "-q"], baseline, "decode to more than twice")


def test_rows_index_linked_under_many_names(tmp_path, baseline):
    """Eight tensors whose datasets are hard links to one compressed rows index of 8M rows."""
    p = hostile.compressed_rows(str(tmp_path / "t.h5"), rows=8_000_000, tensors=8, linked=True)
    bounded(["info", p], baseline, "linked under 8 names")


def test_compressed_rows_indexes_capped_together(tmp_path, baseline):
    """Six compressed rows indexes of 16M rows each (128 MB each decoded): an absolute cap on what
    compressed tables may decode to at open, all of them together."""
    p = hostile.compressed_rows(str(tmp_path / "t.h5"), rows=16_000_000, tensors=6, linked=False)
    rc, out, err, rss = hostile.peak_rss(["info", p])
    assert_clean_exit(rc, out, err, "info")
    assert rc == 2 and "compressed tables are loaded at open" in err, err
    assert rss <= baseline + 2 * 128 + RSS_HEADROOM_MIB, f"peak RSS {rss} MiB, baseline {baseline} MiB"


def test_compressed_values_refs_within_the_same_cap(tmp_path, baseline):
    """Three tensors with values by reference, each with a rows index and a values_ref of 16M rows
    (128 MB each decoded) in a few-MB file: values_ref is loaded at open like a rows index, and
    counted in the same cap."""
    p = hostile.compressed_refs(str(tmp_path / "t.h5"), rows=16_000_000, tensors=3)
    assert os.path.getsize(p) < 16 << 20
    rc, out, err, rss = hostile.peak_rss(["info", p])
    assert_clean_exit(rc, out, err, "info")
    assert rc == 2 and "compressed tables are loaded at open" in err, err
    assert rss <= baseline + 2 * 128 + RSS_HEADROOM_MIB, f"peak RSS {rss} MiB, baseline {baseline} MiB"


def test_compressed_token_table(tmp_path, baseline):
    """A gzip token table of 12M rows in a 2 MB file (350 MB decoded)."""
    p = hostile.compressed_token_table(str(tmp_path / "t.h5"), rows=12_000_000)
    bounded(["info", p], baseline, "compressed tables are loaded at open")


def test_many_tensors_do_not_cost_a_chunk_cache_each(tmp_path, baseline):
    """1500 small tensors: every dataset open at once cost ~100 KB of HDF5 chunk cache each
    (500 MB here, 40 GB at the 100k-tensor limit); the reader keeps a bounded set open."""
    p = hostile.many_tensors(str(tmp_path / "t.h5"), tensors=1500)
    rc, out, err, rss = hostile.peak_rss(["info", p], env={"TENSORDIFF_OPEN_TIMEOUT": "600"})
    assert rc == 0, err
    assert rss <= baseline + RSS_HEADROOM_MIB, f"peak RSS {rss} MiB, baseline {baseline} MiB"


# ----------------------------------------------------------------------------------------------
# structure


def test_negative_regime_code(tmp_path, good):
    p = hostile.negative_regime(str(tmp_path / "t.h5"))
    one_line(["info", p], "/tokens has an unknown regime code")
    one_line(["diff", good["a"], p, "-q"], "/tokens has an unknown regime code")


# ----------------------------------------------------------------------------------------------
# hangs: one file from the check to the read, regular files only, a guard no value disables


def _forked(fn, timeout: float) -> tuple[int, str]:
    """Run ``fn()`` in a forked child; (exit status or 124 on timeout, what it returned or raised)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            msg, code = str(fn()), 0
        except BaseException as e:  # noqa: BLE001
            msg, code = f"{type(e).__name__}: {e}", 1
        os.write(w, msg.encode("utf-8", "replace")[:4000])
        os._exit(code)
    os.close(w)
    deadline = time.monotonic() + timeout
    while True:
        done, st = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            os.close(r)
            return 124, ""
        time.sleep(0.01)
    out = os.read(r, 8192).decode("utf-8", "replace")
    os.close(r)
    return os.waitstatus_to_exitcode(st), out


def test_file_swapped_after_the_probe_is_refused(tmp_path, good):
    """The probe checks a valid file; then a file that makes HDF5 loop is renamed over the path.
    The real open must see that it is not the file that was checked (it used to hang)."""
    from tensordiff.trace import TraceReader, probe

    p = str(tmp_path / "t.h5")
    shutil.copyfile(good["a"], p)
    evil = hostile.looping_heap(str(tmp_path / "evil.h5"))

    def run():
        probe([p], timeout=5)
        os.replace(evil, p)
        TraceReader(p).close()
        return "opened"

    code, out = _forked(run, timeout=30)
    assert code != 124, "the open of the swapped file hung"
    assert "TraceFileError" in out and "changed while it was being opened" in out, out


def test_fifo_is_not_read_as_a_trace(tmp_path):
    p = tmp_path / "pipe.h5"
    os.mkfifo(p)
    one_line(["info", p], "is a named pipe (FIFO), not a regular file", timeout=20)


def test_device_is_not_read_as_a_trace():
    one_line(["info", "/dev/zero"], "is a character device, not a regular file", timeout=20)


@pytest.mark.parametrize("value", ["abc", "nan", "inf", "-5", "0"])
def test_open_timeout_cannot_be_disabled(tmp_path, value):
    """TENSORDIFF_OPEN_TIMEOUT=nan used to switch the guard off (a looping file then hangs
    forever); abc was an "unexpected ValueError"."""
    p = hostile.looping_heap(str(tmp_path / "t.h5"))
    one_line(["info", p], f"TENSORDIFF_OPEN_TIMEOUT={value!r}: expected a number of seconds", timeout=20,
             env={"TENSORDIFF_OPEN_TIMEOUT": value})


def test_big_valid_trace_is_not_called_damaged(tmp_path):
    """A valid trace that takes longer to open than the stall timeout, but keeps making progress,
    opens (it used to be "did not finish in N s: the file is damaged")."""
    import subprocess
    import sys

    from tensordiff.trace.reader import TraceReader

    p = hostile.many_tensors(str(tmp_path / "t.h5"), tensors=2000)
    t0 = time.monotonic()
    with TraceReader(p) as r:   # what the watched open does: load every tensor, touch both ends
        r.touch()
    opened = time.monotonic() - t0
    assert opened > 1.5, f"the open took {opened:.2f} s: too fast to outlast the 1 s stall timeout"
    # a fresh process, as a user's shell starts it: a fork of this test process inherits its heap
    # (torch, both engines' modules), whose copy-on-write faults a user's run never pays
    env = {k: v for k, v in os.environ.items() if not k.startswith("TENSORDIFF_")}
    env.update(TENSORDIFF_OPEN_TIMEOUT="1", PYTHONPATH=hostile.ROOT)
    proc = subprocess.run([sys.executable, "-m", "tensordiff", "info", p], capture_output=True, text=True,
                          env=env, timeout=300, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert "layer1999" in proc.stdout, proc.stdout[-2000:]


def test_too_slow_to_open_names_the_file(tmp_path, good, monkeypatch):
    """Past its allowance a progressing open is "too slow to open", naming the file being read
    (the second of two), never "damaged"."""
    from tensordiff.errors import TraceFileError
    from tensordiff.trace import probe as probe_fn

    probe_mod = importlib.import_module("tensordiff.trace.probe")  # the module (the package's `probe` is the function)

    p = hostile.many_tensors(str(tmp_path / "big.h5"), tensors=1500)
    monkeypatch.setattr(probe_mod, "PER_TENSOR_SECONDS", 0.0, raising=False)
    monkeypatch.setattr(probe_mod, "READ_BYTES_PER_SECOND", 1e18, raising=False)
    with pytest.raises(TraceFileError) as e:
        probe_fn([good["a"], p], timeout=1)
    msg = str(e.value)
    assert msg.startswith(p + ": too slow to open") and "damaged" not in msg, msg


def test_trace_still_being_written_says_so(tmp_path, capsys):
    from tensordiff.cli import main
    from tracegen import write_trace

    p = str(tmp_path / "live.h5")
    w = write_trace(p, seqs=2, flush_rows=4, close=False)
    w.flush()
    try:
        rc = main(["info", p])
        out, err = capsys.readouterr()
        assert_clean_exit(rc, out, err, "info")
        assert rc == 2 and "is still being written" in err, (rc, err)
    finally:
        w.close()
    assert main(["info", p]) == 0


# ----------------------------------------------------------------------------------------------
# terminal escapes: text output escapes every control character from a file, JSON keeps them

_RAW = ("\x1b", "\x07", "\r", "\u202e", "\x9b")


def _no_raw_controls(text: str, what: str) -> None:
    for ch in _RAW:
        assert ch not in text, f"{what}: raw {ch!r} in the output: {text[:500]!r}"
    forged = [x for x in text.splitlines() if x.startswith("verdict: AGREE")]
    assert not forged, f"{what}: a key forged a verdict line: {forged}"


def test_escapes_in_strings_never_reach_the_terminal(tmp_path):
    a = hostile.escape_strings(str(tmp_path / "a.h5"), side="train")
    b = hostile.escape_strings(str(tmp_path / "b.h5"), side="serve", noise=0.5)
    rc, out, err = run_isolated(["info", a], timeout=60)
    assert rc == 0, err
    _no_raw_controls(out, "info")
    assert "\\x1b[2K" in out and "\\u202e" in out  # shown, escaped
    rc, out, err = run_isolated(["diff", a, b, "-q"], timeout=60)
    assert rc in (0, 1), err
    _no_raw_controls(out + err, "diff")
    rc, out, err = run_isolated(["info", "--json", a], timeout=60)
    assert rc == 0, err
    import json

    s = json.loads(out)
    assert s["producer"] == "evil" + hostile.ESCAPES  # the JSON keeps the real value
    assert any(hostile.ESCAPES in q["key"] for q in s["sequences"])


def test_error_lines_escape_what_they_quote(tmp_path):
    p = tmp_path / "x\x1b[2Jy.h5"
    err = one_line(["info", p], "no such file")
    assert "\x1b" not in err and "\\x1b[2J" in err


# ----------------------------------------------------------------------------------------------
# outputs: never an input, checked before any work


def test_calibrate_does_not_overwrite_its_input(tmp_path, good):
    a = tmp_path / "a.h5"
    shutil.copyfile(good["a"], a)
    before = a.read_bytes()
    one_line(["calibrate", a, good["b"], "--out", a], "would overwrite an input")
    assert a.read_bytes() == before


def test_summary_onto_an_input(tmp_path, good):
    b = tmp_path / "b.h5"
    shutil.copyfile(good["b"], b)
    before = b.read_bytes()
    one_line(["diff", good["a"], b, "-q", "--summary", b], "would overwrite an input")
    assert b.read_bytes() == before


@pytest.mark.parametrize("cmd", ["calibrate", "summary"])
def test_output_into_a_missing_directory(tmp_path, good, cmd):
    out = tmp_path / "no" / "such" / "x.json"
    argv = (["calibrate", good["a"], good["b"], "--out", out] if cmd == "calibrate"
            else ["diff", good["a"], good["b"], "-q", "--summary", out])
    one_line(argv, "does not exist")


def test_calibrate_with_nothing_comparable(tmp_path):
    """Two traces whose only tensor has rows for different sequences (was "unexpected IndexError")."""
    import numpy as np

    from tensordiff.trace import TraceWriter

    def make(p, side, rows_for):
        with TraceWriter(p, side=side, model={"hidden_size": 4, "num_layers": 1}, sketch_dim=4) as w:
            w.define_tensor("embed", 4, kind="boundary", boundary=0)
            for s in range(2):
                r = w.add_tokens(f"k{s}", range(5), [1 + s, 2, 3, 4, 5], "train")
                if s == rows_for:
                    w.append("embed", r, np.ones((5, 4), np.float32))

    make(str(tmp_path / "a.h5"), "train", 0)
    make(str(tmp_path / "b.h5"), "serve", 1)
    one_line(["calibrate", tmp_path / "a.h5", tmp_path / "b.h5", "--out", tmp_path / "c.json"],
             "nothing compared")


# ----------------------------------------------------------------------------------------------
# calibration files: regular, bounded, the right shape


def test_calibration_fifo_does_not_block(tmp_path, good):
    p = tmp_path / "cal.json"
    os.mkfifo(p)
    one_line(["diff", good["a"], good["b"], "-q", "--calibration", p], "is a named pipe (FIFO), not a regular file",
             timeout=20)


def test_calibration_device_is_not_read(good):
    one_line(["diff", good["a"], good["b"], "-q", "--calibration", "/dev/zero"], "is a character device", timeout=20)


@pytest.mark.parametrize("content,expect", [
    ('{"tolerances": [1, 2]}', "'tolerances' is a JSON list"),
    ('[]', "a JSON list, expected an object"),
    ('{"tolerances": {"embed": 3}}', "calibration entry 'embed' is a JSON int"),
    ('{"tolerances": {"embed": {"min_cos": "x", "max_rel": 1}}}', "min_cos is 'x', expected a finite number"),
])
def test_calibration_file_of_the_wrong_shape(tmp_path, good, content, expect):
    p = tmp_path / "cal.json"
    p.write_text(content)
    one_line(["diff", good["a"], good["b"], "-q", "--calibration", p], expect)


def test_calibration_file_nested_deep(tmp_path, good):
    p = tmp_path / "cal.json"
    p.write_bytes(hostile.deep_json())
    one_line(["diff", good["a"], good["b"], "-q", "--calibration", p], "nested deeper than 64 levels")


# ----------------------------------------------------------------------------------------------
# layer numbers from a file: in range where they are read


@pytest.mark.parametrize("label", ["layer999999999999999999999999999999", "layer100001"])
@pytest.mark.parametrize("cmd", ["info", "diff-ab", "diff-ba"])
def test_slot_label_past_any_depth(tmp_path, good, label, cmd):
    """A slot label claiming layer 10^33 overflowed the noise model's growth to that depth."""
    p = hostile.slot_label(str(tmp_path / "t.h5"), label)
    argv = {"info": ["info", p], "diff-ab": ["diff", good["a"], p, "-q"], "diff-ba": ["diff", p, good["a"], "-q"]}[cmd]
    one_line(argv, "layer number")


def test_slot_label_at_the_deepest_layer_is_judged(tmp_path, good):
    """The deepest layer number a label may hold is read, and the noise model's growth to it
    saturates instead of overflowing."""
    p = hostile.slot_label(str(tmp_path / "t.h5"), "layer100000")
    for argv in (["diff", good["a"], p, "-q"], ["diff", p, good["a"], "-q"]):
        rc, out, err = run_isolated(argv, timeout=60)
        assert_clean_exit(rc, out, err, " ".join(argv))
        assert rc in (0, 1), (argv, rc, err[-500:])


@pytest.mark.parametrize("model,expect", [
    ('{"num_layers": 1000000, "hidden_size": 16}', "model num_layers"),
    (None, "nested deeper than 64 levels"),
])
def test_model_attribute_out_of_range(tmp_path, good, model, expect):
    model = model if model is not None else hostile.deep_json(10_000).decode()
    p = hostile.model_attr(str(tmp_path / "t.h5"), model)
    one_line(["diff", good["a"], p, "-q"], expect)


# ----------------------------------------------------------------------------------------------
# weights: a checkpoint's header, config and fingerprint file are JSON from elsewhere


def test_weights_header_nested_deep(tmp_path):
    ok = hostile.safetensors_ok(str(tmp_path / "ok.safetensors"))
    deep = hostile.safetensors_file(str(tmp_path / "deep.safetensors"), hostile.deep_json())
    one_line(["weights", deep, ok], "nested deeper than 64 levels")
    one_line(["weights", ok, deep], "nested deeper than 64 levels")


def test_weights_config_and_fingerprints_nested_deep(tmp_path):
    ok = hostile.safetensors_ok(str(tmp_path / "ok.safetensors"))
    d = tmp_path / "ckpt"
    d.mkdir()
    hostile.safetensors_ok(str(d / "model.safetensors"))
    (d / "config.json").write_bytes(hostile.deep_json())
    one_line(["weights", ok, d], "config.json is JSON nested deeper than 64 levels")
    fp = tmp_path / "fp.json"
    fp.write_bytes(hostile.deep_json())
    one_line(["weights", fp, ok], "nested deeper than 64 levels")


# ----------------------------------------------------------------------------------------------
# importers: nothing read unbounded, nothing written the reader would refuse


@pytest.fixture(scope="module")
def torch_baseline(tmp_path_factory):
    """Peak RSS of `import` refusing a small text file (torch imported, nothing loaded), MiB."""
    pytest.importorskip("torch")
    d = tmp_path_factory.mktemp("tb")
    p = d / "hs.pt"
    p.write_text("plain text, not torch.save")
    rc, _, err, rss = hostile.peak_rss(["import", str(p), "--out", str(d / "o.h5")])
    assert rc == 2 and rss > 0, err
    return rss


def test_gzip_bomb_is_refused_before_decompressing(tmp_path, torch_baseline):
    """512 MiB of zeros in 0.5 MB of gzip: the header is checked first (it used to be gunzipped
    into memory, twice, before "not a torch checkpoint")."""
    p = hostile.gzip_bomb(str(tmp_path / "data_0.ckpt.gz"), mib=512)
    bounded(["import", p, "--out", str(tmp_path / "o.h5")], torch_baseline, "not a torch checkpoint")


def test_gzip_bomb_with_a_torch_header_is_capped(tmp_path, torch_baseline):
    """'PK' and then 512 MiB of zeros: looks like torch.save's zip, decompression stops at the cap."""
    import zlib

    p = tmp_path / "data_0.ckpt.gz"
    comp = zlib.compressobj(1, zlib.DEFLATED, 31)
    with open(p, "wb") as fh:
        fh.write(comp.compress(b"PK"))
        for _ in range(512):
            fh.write(comp.compress(bytes(1 << 20)))
        fh.write(comp.flush())
    bounded(["import", str(p), "--out", str(tmp_path / "o.h5")], torch_baseline, "decompresses to more than")


@pytest.mark.parametrize("name,expect", [
    (".", "is a path, not a name"),
    ("evil\x1b[2Jname", "not printable"),
    ("line\nbreak", "not printable"),
])
def test_dump_names_the_reader_would_refuse(tmp_path, name, expect):
    torch = pytest.importorskip("torch")
    d = hostile.sglang_dump(str(tmp_path / "dump"), {name: torch.ones(4, 8), "ok": torch.ones(4, 8)})
    err = one_line(["import", d, "--out", tmp_path / "o.h5"], "cannot name a tensor in a trace", fresh=True)
    assert expect in err and "\x1b" not in err
    assert not (tmp_path / "o.h5").exists()


def test_dump_of_only_a_scalar_is_refused(tmp_path):
    """A 0-d tensor used to import as "tensors none", exit 0."""
    torch = pytest.importorskip("torch")
    d = hostile.sglang_dump(str(tmp_path / "dump"), {"loss": torch.tensor(1.5), "nothing": torch.ones(0, 8)})
    err = one_line(["import", d, "--out", tmp_path / "o.h5"], "nothing imported", fresh=True)
    assert "0-d tensor" in err and "empty tensor" in err
    assert not (tmp_path / "o.h5").exists()


def test_dump_request_id_too_long(tmp_path):
    """A 5000-character request id was an "unexpected ValueError"."""
    torch = pytest.importorskip("torch")
    d = hostile.sglang_dump(str(tmp_path / "dump"), {"h": torch.ones(4, 8)}, rids=("r" * 5000,))
    one_line(["import", d, "--out", tmp_path / "o.h5"], "a request id of 5000 characters", fresh=True)


def test_dump_symlink_out_of_the_directory_is_not_followed(tmp_path):
    torch = pytest.importorskip("torch")
    d = hostile.sglang_dump(str(tmp_path / "dump"), {"h": torch.ones(4, 8)})
    outside = tmp_path / "outside"
    hostile.sglang_dump(str(outside), {"secret": torch.full((4, 8), 7.0)})
    secret = next(p for p in os.listdir(outside) if "name=secret" in p)
    os.symlink(outside / secret, os.path.join(d, secret.replace("dump_index=5", "dump_index=9")))
    out = tmp_path / "o.h5"
    rc, stdout, err, _ = hostile.peak_rss(["import", d, "--out", str(out)], timeout=180)
    assert rc == 0, err
    assert "symbolic link out of the directory" in stdout
    from tensordiff.trace import TraceReader

    with TraceReader(out) as r:
        assert "secret" not in r.tensors and "h" in r.tensors


def test_import_does_not_overwrite_its_source(tmp_path):
    torch = pytest.importorskip("torch")
    p = tmp_path / "data_0.pt"
    torch.save({"input_ids": torch.arange(3)}, p)
    before = p.read_bytes()
    one_line(["import", p, "--out", p], "would overwrite an input", fresh=True)
    assert p.read_bytes() == before


# ----------------------------------------------------------------------------------------------
# record serve: an engine that cannot start is one line and exit 2, not a silent 137


def _serve_setup(tmp_path, monkeypatch, fake):
    import json as _json

    from tensordiff.recorders import serve_cli

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(_json.dumps({"vocab_size": 100}))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("[1, 2, 3]\n")
    monkeypatch.setattr(serve_cli, "_plugin_installed", lambda: True)
    monkeypatch.setattr(serve_cli, "_default_start_engine", fake)
    monkeypatch.setattr(serve_cli, "_check_sglang_cpu", lambda: None)   # as if SGLang's CPU kernels were there
    out = tmp_path / "s.h5"
    return ["record", "serve", "--model", str(model), "--prompts", str(prompts), "--out", str(out), "--device", "cpu"], out


def _partial_trace():
    with open(os.environ["TENSORDIFF_TRACE"], "wb") as fh:  # what the plugin leaves when it started first
        fh.write(b"\x89HDF\r\n\x1a\n" + bytes(100))


def test_record_serve_engine_child_fails_at_start(tmp_path, monkeypatch, capsys):
    """The scheduler logs its exception and sends SIGQUIT (SGLang's handler would then kill the
    whole process tree, exit 137): one line with the cause and a hint, the partial trace removed."""
    from tensordiff.cli import main

    def fake(**kw):
        _partial_trace()
        os.write(2, b"[scheduler] Scheduler hit an exception: Traceback (most recent call last):\n"
                    b'  File "draft_utils.py", line 118, in create\n'
                    b"ValueError: EAGLE is not supported in decode attention backend torch_native\n"
                    # what the teardown raises after it (the plugin's half-written trace): not the cause
                    b"TypeError: Operation not defined for data type class\n")
        signal.signal(signal.SIGQUIT, lambda *a: os._exit(137))  # what SGLang's Engine installs
        os.kill(os.getpid(), signal.SIGQUIT)
        time.sleep(30)

    argv, out = _serve_setup(tmp_path, monkeypatch, fake)
    rc = main(argv)
    o, err = capsys.readouterr()
    assert_clean_exit(rc, o, err, "record serve")
    assert rc == 2 and "EAGLE is not supported in decode attention backend torch_native" in err, err
    assert "--attention-backend" in err and not out.exists()
    assert signal.getsignal(signal.SIGQUIT) is not None and signal.signal is not None


def test_record_serve_engine_kernels_missing(tmp_path, monkeypatch, capsys):
    """Kernels found but failing in the engine (a CUDA build on a CPU): the guard's line says what
    to run instead on either machine."""
    from tensordiff.cli import main

    def fake(**kw):
        _partial_trace()
        raise ModuleNotFoundError("No module named 'sgl_kernel'", name="sgl_kernel")

    argv, out = _serve_setup(tmp_path, monkeypatch, fake)
    rc = main(argv)
    o, err = capsys.readouterr()
    assert_clean_exit(rc, o, err, "record serve")
    assert rc == 2 and "the module 'sgl_kernel' is not installed" in err and "--engine vllm" in err, err
    assert not out.exists()


def test_record_serve_on_a_cpu_without_sglangs_kernels(tmp_path, monkeypatch, capsys):
    """SGLang on a CPU without its CPU kernels (not on PyPI): one line, before the engine starts,
    saying what a CPU user can run instead; the command it names is the one docs/sglang.md gives,
    and its words reach vLLM's recorder (here, without vLLM: the line to run it with vLLM's venv)."""
    import importlib.util
    import re
    import shlex

    from tensordiff.cli import main
    from tensordiff.recorders import serve_cli

    started = []
    argv, out = _serve_setup(tmp_path, monkeypatch, lambda **kw: started.append(kw))
    monkeypatch.undo()   # the real check this time; sgl_kernel hidden as on a machine without it
    monkeypatch.setattr(serve_cli, "_plugin_installed", lambda: True)
    monkeypatch.setattr(serve_cli, "_default_start_engine", lambda **kw: started.append(kw))
    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "sgl_kernel" else find(n, *a))
    rc = main(argv)
    o, err = capsys.readouterr()
    assert_clean_exit(rc, o, err, "record serve --device cpu")
    assert rc == 2 and not started and not out.exists(), err
    line = err.strip()
    assert line.startswith("tensordiff: error: SGLang cannot record on this CPU: its CPU kernels"), line
    # the docs say the same, and give the command the line names
    doc = open(os.path.join(hostile.ROOT, "docs", "sglang.md"), encoding="utf-8").read()
    section = doc.split("### On a CPU-only machine", 1)[1].split("\n## ", 1)[0]
    assert line.split(": ", 2)[2].split(", ...")[0][:60] in section
    (cmd,) = re.findall(r"^\.venv-vllm/bin/python -m tensordiff (record serve .*)$", section, re.M)
    assert cmd.split(" --model")[0] in line, (cmd, line)
    words = shlex.split(cmd.replace("--model ...", f"--model {argv[3]}").replace("--prompts ...", f"--prompts {argv[5]}")
                        .replace("serve.h5", str(out)))
    rc = main(words)
    o, err = capsys.readouterr()
    if importlib.util.find_spec("vllm") is None:   # the core venv: the line that sends it to .venv-vllm
        assert rc == 2 and "run this command with the vLLM venv's python" in err, err


def test_record_serve_does_not_overwrite_its_prompts(tmp_path, monkeypatch, capsys):
    from tensordiff.cli import main

    argv, _ = _serve_setup(tmp_path, monkeypatch, lambda **kw: None)
    prompts = argv[argv.index("--prompts") + 1]
    argv[argv.index("--out") + 1] = prompts
    rc = main(argv)
    _, err = capsys.readouterr()
    assert rc == 2 and "would overwrite an input" in err, err
    assert open(prompts).read() == "[1, 2, 3]\n"


def test_inf_rms_prints_no_numpy_warning(tmp_path, good):
    """Inf in the stored RMS and values of the trace under test: a finding, and nothing on stderr
    (a numpy RuntimeWarning used to leak; the numerics now run under errstate)."""
    import h5py
    import numpy as np

    p = tmp_path / "b.h5"
    shutil.copyfile(good["b"], p)
    with h5py.File(p, "r+") as f:
        for part in ("values", "rms"):
            ds = f[f"tensors/layer1/{part}"]
            v = ds[()]
            v[0] = np.inf
            ds[...] = v
    rc, out, err = run_isolated(["diff", good["a"], str(p), "-q"], timeout=60)
    assert rc in (0, 1) and err.strip() == "", err


@pytest.mark.slow
@pytest.mark.sglang
def test_record_serve_eagle_on_torch_native_real_engine(tmp_path):
    """The report's case with the real engine on CPU: EAGLE-3 with --attention-backend torch_native
    (SGLang: "EAGLE is not supported in decode attention backend torch_native"). It used to be
    killed (exit 137) with no tensordiff message and a partial trace."""
    import json as _json
    import subprocess
    import sys

    import sglang_support as sup

    if not sup.sglang_available():
        pytest.skip("real SGLang (and torch) not installed")
    target, draft = sup.make_tiny_models(tmp_path / "models")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(_json.dumps({"id": "a", "input_ids": [1, 2, 3, 4]}) + "\n")
    out = tmp_path / "s.h5"
    env = dict(os.environ, SGLANG_USE_CPU_ENGINE="1", SGLANG_PLUGINS="tensordiff",
               PYTHONPATH=os.pathsep.join([str(sup.STUB_DIR), hostile.ROOT]))
    for k in [k for k in env if k.startswith("TENSORDIFF_")]:
        del env[k]
    # SGLang reads CI=true as its own test mode and then fails earlier for another reason; the
    # engine here must see what a user's shell gives it
    env.pop("CI", None)
    argv = [sys.executable, "-m", "tensordiff", "record", "serve", "--model", str(target), "--draft", str(draft),
            "--prompts", str(prompts), "--out", str(out), "--device", "cpu", "--dtype", "float32",
            "--attention-backend", "torch_native", "--mem-fraction-static", "0.1", "--max-total-tokens", "2048",
            "--max-new-tokens", "2"]
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=600, cwd=hostile.ROOT)
    last = [x for x in proc.stderr.splitlines() if x.strip()][-1:]
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    assert last and last[0].startswith("tensordiff: error: the SGLang engine could not start"), proc.stderr[-3000:]
    assert "EAGLE is not supported" in last[0] and "--attention-backend" in last[0], last
    assert not out.exists()


def test_html_report_does_not_overwrite_its_input(tmp_path, good):
    a = tmp_path / "a.h5"
    shutil.copyfile(good["a"], a)
    before = a.read_bytes()
    one_line(["report", a, good["b"], "-o", a], "would overwrite an input")
    assert a.read_bytes() == before


def test_tolerance_rules_fifo_does_not_block(tmp_path, good):
    p = tmp_path / "rules.toml"
    os.mkfifo(p)
    one_line(["diff", good["a"], good["b"], "-q", "--tol", p], "is a named pipe (FIFO), not a regular file", timeout=20)
