"""Hostile values on the input surfaces beyond the trace format (docs/robustness.md, "Input
surfaces"): ``tensordiff locate``'s ``module:`` specs, ``--resume`` directories and prompts file.
Each run is the CLI in a forked child (nothing heavy imported: every case is refused before a
model is loaded) and must end in one line on stderr, exit 2, no traceback, no raw escape byte.
"""

from __future__ import annotations

import json
import os

import pytest

from tracegen import assert_clean_exit, run_isolated


def refused(argv, expect: str, last_line: bool = False) -> str:
    rc, out, err = run_isolated([str(a) for a in argv], timeout=60)
    assert rc != 124, f"{argv}: did not finish"
    assert "\x1b" not in err and "\x1b" not in out, err
    if last_line:   # locate prints each step's command on stderr before the step that fails
        assert rc == 2 and "Traceback" not in err, err
        err = err.splitlines()[-1]
        assert err.startswith("tensordiff: error: ") and "unexpected" not in err, err
    else:
        assert_clean_exit(rc, out, err, " ".join(map(str, argv))[:200])
        assert rc == 2, err
    assert expect in err, err
    return err


@pytest.fixture
def prompts(tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_text('{"input_ids": [1, 2, 3]}\n')
    return str(p)


@pytest.fixture
def model_dir(tmp_path):
    """A directory locate takes for an HF model (its form: config.json); never loaded here."""
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text("{}")
    return str(d)


@pytest.mark.parametrize("spec,expect", [
    ("module:pkg/mod:factory", "is not module:pkg.mod:factory"),
    ("module:../pkg:factory", "is not module:pkg.mod:factory"),
    ("module:pkg..mod:factory", "is not module:pkg.mod:factory"),
    ("module:.pkg:factory", "is not module:pkg.mod:factory"),
    ("module:pkg.:factory", "is not module:pkg.mod:factory"),
    ("module:pkg\x1b]52;c;aGk=\x07:factory", "is not module:pkg.mod:factory"),
    ("module:" + "a." * 50_000 + "a:f", "at most 512 characters"),      # imported, a RecursionError
    ("module:" + "a" * 100_000 + ":f", "at most 512 characters"),       # quoted whole in the line
], ids=["slash", "dotdot", "double_dot", "leading_dot", "trailing_dot", "osc52", "deep_dotted", "huge"])
def test_locate_module_spec_form_checked_before_any_import(tmp_path, prompts, spec, expect):
    err = refused(["locate", spec, "module:pkg:factory", "--prompts", prompts, "--out", tmp_path / "o"], expect)
    assert len(err) < 1000


@pytest.mark.parametrize("spec", ["module:" + "a." * 50_000 + "a:f", "module:" + "a" * 100_000 + ":f"],
                         ids=["deep_dotted", "huge"])
def test_record_train_module_spec_bounded(tmp_path, prompts, spec):
    err = refused(["record", "train", "--model", spec, "--prompts", prompts, "--out", tmp_path / "o.h5"],
                  "at most 512 characters")
    assert len(err) < 1000


@pytest.mark.parametrize("kind", ["fifo", "dev_zero", "directory", "missing"])
def test_locate_prompts_not_a_regular_file(tmp_path, kind):
    path = {"dev_zero": "/dev/zero", "directory": str(tmp_path), "missing": str(tmp_path / "nope")}.get(kind)
    if kind == "fifo":
        path = str(tmp_path / "fifo")
        os.mkfifo(path)
    refused(["locate", "module:a:f", "module:b:f", "--prompts", path, "--out", tmp_path / "o"],
            "no such file" if kind == "missing" else "not a regular file")


@pytest.mark.parametrize("line,expect", [
    ("[" * 100_000 + "]" * 100_000, "nested deeper than"),
    ('{"input_ids": [' + "9" * 100_000 + "]}", "not valid JSON"),
    ('{"input_ids": [1e999]}', "non-negative integers"),
    ('{"input_ids": "\\u001b[2J"}', "non-negative integers"),
    ('{"text": 5}', "expected token ids"),
    ('{"input_ids": [1], "\x1b[2J": 1', "not valid JSON"),
    ('{"input_ids": [-1]}', "non-negative integers"),
], ids=["deep", "huge_number", "inf", "escape_string", "wrong_type", "raw_escape", "negative"])
def test_locate_crafted_prompt_lines(tmp_path, line, expect):
    p = tmp_path / "p.jsonl"
    p.write_text(line + "\n")
    refused(["locate", "module:a:f", "module:b:f", "--prompts", p, "--out", tmp_path / "o"], expect)


@pytest.mark.parametrize("kind", ["directory", "symlink_out", "dangling"])
def test_locate_resume_directory_holding_what_no_run_wrote(tmp_path, prompts, model_dir, kind):
    d = tmp_path / "run"
    d.mkdir()
    if kind == "directory":
        (d / "a.h5").mkdir()
    else:
        os.symlink("/etc/passwd" if kind == "symlink_out" else str(tmp_path / "gone.h5"), d / "a.h5")
    refused(["locate", model_dir, model_dir, "--prompts", prompts, "--resume", d, "--no-progress"],
            "symbolic link" if kind != "directory" else "is not a file")


def test_locate_resume_is_a_file(tmp_path, prompts, model_dir):
    f = tmp_path / "run"
    f.write_text("x")
    refused(["locate", model_dir, model_dir, "--prompts", prompts, "--resume", f], "no such directory")


@pytest.mark.parametrize("kind", ["garbage", "truncated"])
def test_locate_resume_with_a_damaged_trace(tmp_path, prompts, model_dir, kind):
    from tracegen import write_pair

    d = tmp_path / "run"
    d.mkdir()
    if kind == "garbage":
        (d / "a.h5").write_bytes(b"\x1b[2J" + os.urandom(4000))
        (d / "b.h5").write_bytes((d / "a.h5").read_bytes())
    else:
        a, b = write_pair(str(tmp_path))
        raw = open(a, "rb").read()
        (d / "a.h5").write_bytes(raw[: len(raw) // 2])
        os.replace(b, d / "b.h5")
    refused(["locate", model_dir, model_dir, "--prompts", prompts, "--resume", d, "--no-progress"],
            str(d / "a.h5"), last_line=True)


def test_locate_trace_naming_a_crafted_module_spec(tmp_path):
    """A trace's model.path is a file's value: a ``module:`` spec without the form (an escape in
    it, a huge one) is not a model to record again, so it is never run nor printed as a command."""
    import h5py

    from tensordiff.locator.sides import resolve_side
    from tracegen import write_pair

    a, _ = write_pair(str(tmp_path))
    for spec in ("module:x\x1b]52;c;aGk=\x07:f", "module:" + "a." * 5000 + "a:f", "module:x:f"):
        with h5py.File(a, "r+") as f:
            model = json.loads(f.attrs["model"])
            model["path"] = spec
            f.attrs["model"] = json.dumps(model)
            meta = json.loads(f.attrs["user_meta"])
            meta["command"] = "record train"
            f.attrs["user_meta"] = json.dumps(meta)
        side = resolve_side("A", a, None)
        assert side.model == (spec if spec == "module:x:f" else None), spec[:80]


def test_locate_echo_and_report_escape_what_files_hold(tmp_path, prompts, model_dir, monkeypatch, capsys):
    """The step lines and the report quote paths, config keys and op names from files: escaped."""
    import argparse

    from tensordiff.locator import cli as locate_cli
    from tensordiff.locator import loop
    from tensordiff.locator.result import Evidence, LocateResult

    def fake(opts):
        opts.echo("[record A] $ tensordiff record train --model module:x\x1b[2J:f")
        return LocateResult(verdict="the configs differ: \x1b]52;c;aGk=\x07: A 1, B 2", exit_code=1, out_dir="o",
                            evidence=[Evidence("compare", "k\u202ey: A 1, B 2", ("$ x",))])

    monkeypatch.setattr(loop, "run_locate", fake)
    p = argparse.ArgumentParser()
    locate_cli.add_arguments(p)
    assert locate_cli.run(p.parse_args([model_dir, model_dir, "--prompts", prompts])) == 1
    out, err = capsys.readouterr()
    assert "\x1b" not in out + err and "\u202e" not in out and "\\x1b" in out and "\\x1b" in err
    assert out.count("\n") == 3   # the report's own line breaks kept


# ----------------------------------------------------------------------------------------------
# zoom and graft specs (--zoom, --graft, TENSORDIFF_ZOOM, TENSORDIFF_GRAFT): parsed without torch;
# record train turns the ValueError into its one line (tests/test_zoom_train.py, test_zoom_graft.py)


@pytest.mark.parametrize("spec", ["layer" + "9" * 5000, "9" * 40, "layer\u0663", "\u0663", "layer3\x1b[2J",
                                  "layer-1", "layer0x10", "layer1_000", "", "layer3.q"],
                         ids=["huge", "huge_bare", "arabic", "arabic_bare", "escape", "negative", "hex", "underscore",
                              "empty", "tap"])
def test_zoom_spec_crafted(spec):
    from tensordiff import names
    from tensordiff.recorders.sglang.config import _zoom

    for parse in (names.parse_zoom, lambda s: _zoom({"TENSORDIFF_ZOOM": s}) if s else names.parse_zoom(s)):
        with pytest.raises(ValueError) as e:
            parse(spec)
        assert "\n" not in str(e.value)


@pytest.mark.parametrize("spec", ["x" * 100_000, "layer" + "\x1b" * 100_000], ids=["huge", "huge_escapes"])
def test_zoom_spec_quoted_bounded(spec):
    """A huge --zoom or TENSORDIFF_ZOOM is quoted in part (its length said), not whole."""
    from tensordiff import names
    from tensordiff.recorders.sglang.config import _zoom

    for parse in (names.parse_zoom, lambda s: _zoom({"TENSORDIFF_ZOOM": s})):
        with pytest.raises(ValueError) as e:
            parse(spec)
        msg = str(e.value)
        assert len(msg) < 1500 and "characters)" in msg and "\x1b" not in msg, msg[:300]


def _graft_error(spec: str) -> str:
    from tensordiff.recorders.graft_source import open_graft_source

    with pytest.raises(ValueError) as e:
        open_graft_source(spec, "TENSORDIFF_GRAFT")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("TENSORDIFF_GRAFT"), msg
    return msg


@pytest.mark.parametrize("state", ["layer" + "9" * 5000, "a" * 100_000, "layer1\x1b]52;c;aGk=\x07", "layer\u0663"],
                         ids=["huge_layer", "huge", "osc52", "arabic"])
def test_graft_state_crafted(tmp_path, state):
    from tracegen import write_pair

    a, _ = write_pair(str(tmp_path))
    msg = _graft_error(f"{a}:{state}")
    assert "is not a state name" in msg and len(msg) < 400 and "\x1b" not in msg, msg[:300]


@pytest.mark.parametrize("kind", ["fifo", "dev_zero", "directory", "garbage", "truncated", "no_colon", "huge"])
def test_graft_source_crafted(tmp_path, kind):
    from tracegen import write_pair

    a, _ = write_pair(str(tmp_path))
    path = {"dev_zero": "/dev/zero", "directory": str(tmp_path)}.get(kind, str(tmp_path / "x.h5"))
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "garbage":
        open(path, "wb").write(b"\x1b[2J" + os.urandom(2000))
    elif kind == "truncated":
        raw = open(a, "rb").read()
        open(path, "wb").write(raw[: len(raw) // 2])
    spec = {"no_colon": a, "huge": "x" * 100_000}.get(kind, f"{path}:layer1")
    msg = _graft_error(spec)
    assert len(msg) < 1000, msg[:300]


def test_serve_checks_a_crafted_graft_before_the_engine(tmp_path):
    from tensordiff.errors import UsageError
    from tensordiff.recorders.serve_cli import _check_graft
    from tracegen import write_pair

    a, _ = write_pair(str(tmp_path))
    for spec in (f"{a}:layer" + "9" * 5000, f"{a}:embed", "/dev/zero:layer1", f"{a}:layer99"):
        with pytest.raises(UsageError) as e:
            _check_graft(spec, 4)
        assert "\n" not in str(e.value) and len(str(e.value)) < 1000


# ----------------------------------------------------------------------------------------------
# the fuzzer's inputs (benchmarks/fuzz_verdicts.py: --seed, --kinds, --report F)

FUZZ = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "fuzz_verdicts.py")
_SCENARIO = {"seed": 1, "kind": "mask_lost", "family": "wiring", "model": "trained-llama", "dtypes": "float32/float32",
             "mode": "prefill", "order": "AB", "layer": 1, "x": 3.0, "truth": "t", "outcome": "named", "miss": True,
             "first": "layer2[0] values", "why": "w"}


def _fuzz(*argv: str) -> tuple[int, str, str]:
    import subprocess
    import sys

    p = subprocess.run([sys.executable, FUZZ, *argv], capture_output=True, text=True, timeout=60)
    assert "Traceback" not in p.stderr and "\x1b" not in p.stdout + p.stderr, p.stderr[-2000:]
    return p.returncode, p.stdout, p.stderr


def _fuzz_refused(*argv: str, says: str) -> None:
    rc, _, err = _fuzz(*argv)
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and says in lines[0] and len(lines[0]) < 700, err[-1000:]


@pytest.mark.parametrize("doc,says", [
    ("[" * 100_000 + "]" * 100_000, "nested deeper than"),
    ('{"results": [' + "9" * 100_000 + "]}", "not valid JSON"),
    ('{"results": [1]}', "a scenario is int"),
    ('{"results": [{}]}', "seed is NoneType"),
    ('{"results": 5}', "not a non-empty list"),
    ("[]", "not a fuzz_verdicts --json file"),
    (json.dumps({"results": [{**_SCENARIO, "layer": 10**30}]}), "out of range"),
    (json.dumps({"results": [{**_SCENARIO, "kind": "\x1b[2J"}]}), "does not know"),
    (json.dumps({"results": [{**_SCENARIO, "miss": "yes"}]}), "miss is str"),
], ids=["deep", "huge_number", "int", "empty_object", "results_int", "list", "huge_layer", "escape_kind", "miss_str"])
def test_fuzz_report_file_crafted(tmp_path, doc, says):
    p = tmp_path / "r.json"
    p.write_text(doc)
    _fuzz_refused("--report", str(p), says=says)


@pytest.mark.parametrize("kind", ["fifo", "dev_zero", "directory"])
def test_fuzz_report_not_a_regular_file(tmp_path, kind):
    path = {"dev_zero": "/dev/zero", "directory": str(tmp_path)}.get(kind, str(tmp_path / "fifo"))
    if kind == "fifo":
        os.mkfifo(path)
    _fuzz_refused("--report", path, says="not a regular file")


def test_fuzz_report_values_escaped(tmp_path):
    p = tmp_path / "r.json"
    p.write_text(json.dumps({"seed": "\x1b[2J", "results": [{**_SCENARIO, "dtypes": "f32\x1b[2J",
                                                              "first": "\x1b]52;c;aGk=\x07"}]}))
    rc, out, _ = _fuzz("--report", str(p))
    assert rc == 0 and "\\x1b]52" in out and "f32\\x1b[2J" in out


@pytest.mark.parametrize("argv,says", [
    (["--kinds", "a\x1b[2J"], "unknown kind a\\x1b[2J"),
    (["--kinds", "x," * 30_000], "unknown kind x"),
    (["--seed", "9" * 5000], "invalid int value"),
    (["--seed", str(2**62)], "--seed must be"),
], ids=["escape", "huge", "huge_seed", "seed_2_62"])
def test_fuzz_arguments_crafted(argv, says):
    _fuzz_refused(*argv, says=says)


# ----------------------------------------------------------------------------------------------
# RL records in traces (the sampling attribute, /weights/step_<k>) as `tensordiff triage` reads them


def _fingerprints(sha: str, name: str = "model.layers.0.mlp.down_proj.weight") -> dict:
    from tensordiff.weights import FINGERPRINT_FORMAT

    return {"format": FINGERPRINT_FORMAT, "num_layers": 1, "source": "t",
            "parameters": [{"key": "layer0.mlp_out.weight", "name": name, "dtype": "float32", "shape": [2, 2],
                            "sha256": sha, "norm": 1.0, "samples": []}]}


@pytest.fixture(scope="module")
def rl_pair(tmp_path_factory):
    """A trainer trace and a rollout trace (small HF-made pair) with weight step 0 on both."""
    import h5py

    from tensordiff.trace.rl import write_sampling, write_weight_step
    from tracegen import write_pair

    d = tmp_path_factory.mktemp("rl")
    t, r = write_pair(str(d))
    with h5py.File(t, "r+") as f:
        write_weight_step(f, 0, _fingerprints("aa"), forward_step=0, event="start")
    with h5py.File(r, "r+") as f:
        write_sampling(f, {"temperature": 1.0})
        write_weight_step(f, 0, _fingerprints("aa"), forward_step=0, event="start")
    return t, r


def _rollout(tmp_path, rl_pair, edit) -> str:
    import shutil

    import h5py

    p = str(tmp_path / "rollout.h5")
    shutil.copy(rl_pair[1], p)
    with h5py.File(p, "r+") as f:
        edit(f)
    return p


def _triage(rl_pair, rollout) -> tuple[int, str, str]:
    rc, out, err = run_isolated(["triage", rl_pair[0], rollout], timeout=60)
    assert rc != 124, "did not finish"
    assert_clean_exit(rc, out, err, "triage")
    return rc, out, err


def _set_sampling(text: str):
    return lambda f: f.attrs.__setitem__("sampling", text)


@pytest.mark.parametrize("edit,says", [
    (_set_sampling("[" * 100_000 + "]" * 100_000), "nested deeper than"),
    (_set_sampling('{"temperature": ' + "9" * 100_000 + "}"), "sampling"),
    (_set_sampling(json.dumps({"temperature": "\x1b[2Jhot"})), "temperature is '\\x1b[2Jhot'"),
    (_set_sampling(json.dumps({"temperature": 1.0, "per_sequence": [1]})), "per_sequence"),
    (_set_sampling(json.dumps("temperature=1")), "not a JSON object"),
    (lambda f: f["weights/step_0"].attrs.__setitem__("step", 1e300), "step"),
    (lambda f: f["weights"].move("step_0", "step_" + "9" * 5000), "is named step_<k>"),
    (lambda f: (f["weights/step_0"].__delitem__("fingerprints"), f["weights/step_0"].create_dataset(
        "fingerprints", data=__import__("numpy").frombuffer(b"[" * 100_000, "uint8"))), "fingerprints"),
    (_set_sampling(json.dumps({"temperature": 1.0, "logprobs_mode": "x" * 100_000})), "100000 characters"),
], ids=["deep", "huge_number", "escape", "per_sequence_list", "not_object", "step_1e300", "huge_step_name",
        "deep_fingerprints", "huge_logprobs_mode"])
def test_triage_crafted_rl_records(tmp_path, rl_pair, edit, says):
    rc, out, err = _triage(rl_pair, _rollout(tmp_path, rl_pair, edit))
    assert rc == 2 and says in err and "\x1b" not in err and len(err) < 1000, err[:1000]


def test_triage_sampling_temperature_huge_int(tmp_path, rl_pair):
    rc, _, err = _triage(rl_pair, _rollout(tmp_path, rl_pair, _set_sampling('{"temperature": ' + "9" * 400 + "}")))
    assert rc == 2 and "temperature is a number of 400 digits" in err, err


def test_triage_escapes_names_from_fingerprints(tmp_path, rl_pair):
    from tensordiff.trace.rl import write_weight_step

    def edit(f):
        del f["weights/step_0"]
        write_weight_step(f, 0, _fingerprints("bb", "down\x1b]52;c;aGk=\x07"), forward_step=0, event="start")

    rc, out, _ = run_isolated(["triage", rl_pair[0], _rollout(tmp_path, rl_pair, edit)], timeout=60)
    assert rc == 1 and "\\x1b]52" in out, out
    assert "\x1b" not in out and "\x07" not in out, out


# ----------------------------------------------------------------------------------------------
# a rollout's outputs JSONL (its prefix-cache records: `record serve --replay-outputs`,
# `record train --from-serve`), read before any engine or model starts


def _outcome(fn, timeout: float = 3.0) -> str:
    """``fn()`` in a forked child: "ok", "clean: <one line>" (a TensordiffError), "unclean: <type>"
    or "timeout"."""
    import signal

    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:   # child
        os.close(r)
        signal.alarm(int(timeout))
        from tensordiff.errors import TensordiffError

        try:
            fn()
            msg = "ok"
        except TensordiffError as e:
            msg = "clean: " + str(e)
        except BaseException as e:  # noqa: BLE001 - what escaped is the answer
            msg = f"unclean: {type(e).__name__}: {e}"
        os.write(w, msg.encode("utf-8", "backslashreplace")[:4000])
        os._exit(0)
    os.close(w)
    _, status = os.waitpid(pid, 0)
    with os.fdopen(r, "rb") as f:
        got = f.read().decode("utf-8", "replace")
    return got if status == 0 else "timeout"


@pytest.fixture(scope="module")
def rollout(tmp_path_factory):
    from tensordiff.trace import TraceReader
    from tracegen import write_pair

    d = tmp_path_factory.mktemp("rollout")
    _, b = write_pair(str(d))
    with TraceReader(b) as r:
        return b, list(r.sequences)


def _outputs(tmp_path, keys, **entry) -> str:
    p = tmp_path / "outputs.jsonl"
    p.write_text("".join(json.dumps({"id": k, "input_ids": [1], "output_ids": [1], **entry}) + "\n" for k in keys))
    return str(p)


@pytest.mark.parametrize("kind", ["deep", "directory", "escape_id", "cached_tokens_garbage"])
def test_replay_outputs_crafted(tmp_path, rollout, kind):
    from tensordiff.recorders.replay import plan_replay

    path, keys = rollout
    p = {"deep": str(tmp_path / "d.jsonl"), "directory": str(tmp_path)}.get(kind)
    if kind == "deep":
        open(p, "w").write("[" * 100_000 + "]" * 100_000 + "\n")
    elif kind == "escape_id":
        p = _outputs(tmp_path, [k + "\x1b[2J" for k in keys])
    elif kind == "cached_tokens_garbage":
        p = _outputs(tmp_path, keys, cached_tokens="\x1b" * 100)
    got = _outcome(lambda: plan_replay(path, p))
    assert got.startswith("clean: ") and "\n" not in got, got


def test_replay_outputs_token_id_past_int64(tmp_path, rollout):
    from tensordiff.recorders.replay import plan_replay

    path, keys = rollout
    got = _outcome(lambda: plan_replay(path, _outputs(tmp_path, keys, input_ids=[2 ** 64], output_ids=[1] * 100)))
    assert got.startswith("clean: ") and "2^63" in got, got


@pytest.mark.parametrize("kind", ["fifo", "dev_zero", "huge_line"])
def test_record_train_prompts_bounded(tmp_path, kind):
    """``record train --prompts`` (and --from-serve's outputs file) read through the bounded
    regular-file reader, one line at most MAX_JSONL_LINE_CHARS before it is parsed."""
    from tensordiff.recorders.train_cli import MAX_JSONL_LINE_CHARS, load_prompts

    path = {"dev_zero": "/dev/zero"}.get(kind, str(tmp_path / kind))
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "huge_line":
        n = MAX_JSONL_LINE_CHARS // 3 + 1
        open(path, "w").write('{"input_ids": [1]}\n{"input_ids": [' + "1, " * n + "1]}\n")
    got = _outcome(lambda: load_prompts(path, lambda: None))
    assert got.startswith("clean: ") and ("not a regular file" if kind != "huge_line" else "line 2: ") in got, got[:300]


@pytest.mark.parametrize("kind", ["fifo", "dev_zero"])
def test_replay_outputs_fifo(tmp_path, rollout, kind):
    from tensordiff.recorders.replay import plan_replay

    path = "/dev/zero"
    if kind == "fifo":
        path = str(tmp_path / "fifo")
        os.mkfifo(path)
    got = _outcome(lambda: plan_replay(rollout[0], path))
    assert got.startswith("clean: ") and "not a regular file" in got, got


# ----------------------------------------------------------------------------------------------
# `tensordiff weights`: safetensors headers


def _safetensors(path, header: bytes, length: int | None = None, data: bytes = b"\0" * 16) -> str:
    with open(path, "wb") as f:
        f.write((len(header) if length is None else length).to_bytes(8, "little") + header + data)
    return str(path)


def _entry(**kw) -> bytes:
    e = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8], **kw}
    return json.dumps({"model.layers.0.mlp.down_proj.weight": e}).encode()


@pytest.mark.parametrize("kind,header,length,says", [
    ("length_2_62", _entry(), 1 << 62, "bad header length"),
    ("offsets_past_end", _entry(data_offsets=[0, 1 << 40], shape=[1 << 38]), None, "outside the file"),
    ("shape_2_90", _entry(shape=[1 << 45, 1 << 45]), None, "outside the file"),
    ("size_mismatch", _entry(shape=[3]), None, "outside the file"),
    ("unknown_dtype", _entry(dtype="\x1b[2JF99"), None, "unsupported dtype"),
    ("reversed_offsets", _entry(data_offsets=[8, 0]), None, "outside the file"),
    ("huge_number", b'{"x": {"dtype": "F32", "shape": [' + b"9" * 100_000 + b'], "data_offsets": [0, 8]}}', None,
     "not valid JSON"),
    ("not_object", b"[1, 2]", None, "not an object"),
    ("escape_name", json.dumps({"\x1b]52;c;aGk=\x07": 5}).encode(), None, "bad header entry"),
], ids=lambda x: x if isinstance(x, str) and x.isidentifier() else "")
def test_weights_crafted_safetensors_header(tmp_path, kind, header, length, says):
    p = _safetensors(tmp_path / "model.safetensors", header, length)
    rc, out, err = run_isolated(["weights", p, p], timeout=60)
    assert_clean_exit(rc, out, err, kind)
    assert rc == 2 and says in err and "\x1b" not in err, err


def test_weights_file_cut_short_while_it_is_read(tmp_path):
    """A checkpoint truncated between two tensors of one read (another process replacing it):
    the next tensor is a short read and one clean error, never SIGBUS (the file is read, not
    memory-mapped)."""
    from tensordiff.errors import SourceFileError
    from tensordiff.weights import read_safetensors

    header = json.dumps({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
                         "b": {"dtype": "F32", "shape": [4096], "data_offsets": [16, 16 + 4 * 4096]}}).encode()
    p = _safetensors(tmp_path / "model.safetensors", header, data=b"\1" * (16 + 4 * 4096))
    it = read_safetensors(p)
    name, _, first = next(it)
    assert name == "a" and first.shape == (4,)
    with open(p, "r+b") as f:   # cut inside the second tensor's bytes
        f.truncate(8 + len(header) + 16 + 100)
    with pytest.raises(SourceFileError, match="cut short while it was read"):
        next(it)
