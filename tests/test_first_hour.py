"""What a newcomer met in the first hour: the TUI without a terminal, bad input under --json and in
the pytest fixture, calibrate on identical traces, numpy warnings, and the small rough edges of the
text report and help texts."""

from __future__ import annotations

import json
import os
import pty
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tracegen import write_trace, write_verdict_pairs

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> dict[str, tuple[str, str]]:
    return write_verdict_pairs(tmp_path_factory.mktemp("firsthour"))


def _env(**extra: str) -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), **extra)


def _run(*args: str, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    kw.setdefault("stdout", subprocess.PIPE)
    kw.setdefault("stdin", subprocess.DEVNULL)
    kw.setdefault("env", _env())
    return subprocess.run([sys.executable, "-m", "tensordiff", *args], stderr=subprocess.PIPE, text=True,
                          timeout=timeout, check=False, **kw)


# ----------------------------------------------------------------------------------------------
# the TUI without a terminal
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cmd", [["tui"], ["diff", "--tui"]])
def test_tui_without_a_terminal_is_one_line_and_exit_2(pairs, cmd):
    """stdin and stdout not a terminal (a CI job): no escape codes, no hang."""
    t0 = time.monotonic()
    p = _run(*cmd, *pairs["wrong"], timeout=60)
    took = time.monotonic() - t0
    assert p.returncode == 2, p.stderr
    assert p.stdout == ""
    lines = p.stderr.splitlines()
    assert len(lines) == 1 and "terminal" in lines[0], p.stderr
    # the check comes before the traces are read or textual is imported; a loaded machine's
    # interpreter start-up is most of this
    assert took < 20, took


def test_tui_with_term_dumb_is_one_line_and_exit_2(pairs):
    """stdin and stdout are a terminal, but TERM=dumb cannot draw the app."""
    master, slave = pty.openpty()
    try:
        p = subprocess.run([sys.executable, "-m", "tensordiff", "tui", *pairs["wrong"]], stdin=slave, stdout=slave,
                           stderr=subprocess.PIPE, text=True, timeout=60, check=False, env=_env(TERM="dumb"))
    finally:
        os.close(slave)
        os.close(master)
    assert p.returncode == 2, p.stderr
    assert len(p.stderr.splitlines()) == 1 and "TERM" in p.stderr, p.stderr


# ----------------------------------------------------------------------------------------------
# the pytest fixture on bad input
# ----------------------------------------------------------------------------------------------


def test_pytest_fixture_bad_input_is_one_line(tmp_path, pairs):
    """A missing or damaged trace fails the test with the CLI's one line, not a traceback through
    the diff, reader and validator."""
    import textwrap

    a, _ = pairs["agree"]
    bad = tmp_path / "bad.h5"
    bad.write_bytes(b"not hdf5")
    (tmp_path / "test_pipeline.py").write_text(textwrap.dedent(f"""
        def test_missing(assert_traces_agree):
            assert_traces_agree({a!r}, {str(tmp_path / 'nope.h5')!r})

        def test_damaged(assert_traces_agree):
            assert_traces_agree({a!r}, {str(bad)!r})
    """))
    env = _env(PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
    p = subprocess.run([sys.executable, "-m", "pytest", "-p", "tensordiff.pytest_plugin", "-q", "-p", "no:cacheprovider",
                        str(tmp_path / "test_pipeline.py")], capture_output=True, text=True, cwd=tmp_path, env=env,
                       timeout=300, check=False)
    out = p.stdout + p.stderr
    assert p.returncode == 1 and "2 failed" in out, out
    assert "Traceback" not in out and "tensordiff/" not in out.replace(str(tmp_path), ""), out
    for name, words in (("test_missing", "nope.h5"), ("test_damaged", "not an HDF5 file")):
        block = out.split(f"_ {name} _", 1)[1].split("\n_", 1)[0].split("=====", 1)[0]
        lines = [x for x in block.splitlines() if x.strip(" _")]
        assert len(lines) == 1, block
        assert lines[0].startswith("test_pipeline.py:") and "tensordiff: error:" in lines[0] and words in lines[0], block


# ----------------------------------------------------------------------------------------------
# calibrate on a pair with no noise
# ----------------------------------------------------------------------------------------------


def test_calibrate_refuses_bit_identical_traces(pairs, tmp_path):
    """Tolerances of essentially zero from two copies of one run would fail every later diff."""
    import shutil

    a, _ = pairs["agree"]
    copy = tmp_path / "copy.h5"
    shutil.copyfile(a, copy)
    out = tmp_path / "tol.json"
    p = _run("calibrate", a, str(copy), "--out", str(out))
    assert p.returncode == 2, p.stdout + p.stderr
    lines = p.stderr.splitlines()
    assert len(lines) == 1 and "identical" in lines[0] and "no noise" in lines[0], p.stderr
    assert not out.exists()
    # an honest pair still calibrates
    p = _run("calibrate", *pairs["agree"], "--out", str(out))
    assert p.returncode == 0 and out.exists(), p.stderr
    assert "identical in all" not in p.stderr


# ----------------------------------------------------------------------------------------------
# diff --json on bad input
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["missing", "not_hdf5", "bad_flag", "incompatible"])
def test_diff_json_bad_input_is_a_json_error_object(pairs, tmp_path, case):
    """A CI step that parses the JSON gets an object saying what went wrong, not an empty stdout."""
    import jsonschema

    from tensordiff.report.text import diff_schema

    a, b = pairs["agree"]
    args = {"missing": [a, str(tmp_path / "nope.h5")], "not_hdf5": [a, str(tmp_path / "x.h5")],
            "bad_flag": [a, b, "--max-findingz", "3"], "incompatible": [a, str(tmp_path / "other.h5")]}[case]
    (tmp_path / "x.h5").write_text("hello")
    if case == "incompatible":
        write_trace(tmp_path / "other.h5", side="serve", hidden=24)
    p = _run("diff", *args, "--json")
    assert p.returncode == 2, p.stderr
    assert len(p.stderr.splitlines()) == 1, p.stderr   # the one line on stderr as before
    d = json.loads(p.stdout)
    assert d["schema_version"] == 1 and d["exit_code"] == 2
    assert d["error"]["message"] and d["error"]["message"] in p.stderr
    assert d["error"]["type"] in ("TraceFileError", "UsageError", "IncompatibleTracesError")
    jsonschema.Draft202012Validator(diff_schema()).validate(d)


# ----------------------------------------------------------------------------------------------
# small rough edges of the text report and the JSON
# ----------------------------------------------------------------------------------------------


def test_max_findings_zero_leaves_no_empty_header(pairs):
    p = _run("diff", *pairs["wrong"], "--max-findings", "0")
    assert p.returncode == 1, p.stderr
    lines = p.stdout.splitlines()
    assert not any(x.rstrip().endswith(":") and x.startswith("findings") for x in lines), p.stdout
    assert any(x.startswith("findings: 2 divergences, 0 warnings, 2 notes") and "--max-findings" in x for x in lines), \
        p.stdout


def test_no_gaps_says_none(pairs):
    p = _run("diff", *pairs["agree"])
    assert p.returncode == 0, p.stderr
    tokens = " ".join(x for x in p.stdout.splitlines() if x.startswith("tokens:") or x == "divergence")
    assert "0 tokens" not in tokens and "0 ranges" not in tokens and "gaps: none" in tokens, p.stdout


def test_json_identity_finding_names_what_its_side_claims(pairs):
    """`claimed` is the claim of the side the sentence is about, never null beside claimed_b."""
    p = _run("diff", *pairs["wrong"], "--json")
    d = json.loads(p.stdout)
    ids = [f for f in d["findings"] if f["kind"] == "slot_identity"]
    assert ids
    for f in ids:
        det = f["details"]
        assert det["claimed"] == det["claimed_b" if det["side"] == "b" else "claimed_a"] is not None, det


def test_interrupt_starts_its_own_line(monkeypatch, capsys):
    """Ctrl-C lands on the progress bar's line: the error must not be glued to `^C`."""
    from tensordiff import cli

    class Tty:
        def __init__(self):
            self.text = ""

        def write(self, s):
            self.text += s
            return len(s)

        def flush(self):
            pass

        def isatty(self):
            return True

    def interrupted(args):
        raise KeyboardInterrupt

    err = Tty()
    monkeypatch.setattr(sys, "stderr", err)
    monkeypatch.setattr(cli, "cmd_info", interrupted)
    parser = cli.build_parser("info")
    monkeypatch.setattr(cli, "build_parser", lambda command=None: parser)
    for a in parser._subparsers._group_actions[0].choices["info"]._actions:
        if a.dest == "func":
            a.default = interrupted
    parser._subparsers._group_actions[0].choices["info"].set_defaults(func=interrupted)
    assert cli.main(["info", "x.h5"]) == 130
    assert err.text.startswith("\r\x1b[2K") and err.text.endswith("tensordiff: error: interrupted\n"), repr(err.text)


# ----------------------------------------------------------------------------------------------
# finding numbers: in the order shown, the same in the text, the JSON and the HTML
# ----------------------------------------------------------------------------------------------

EXAMPLE = (str(ROOT / "traces" / "train.h5"), str(ROOT / "traces" / "serve.h5"))


def test_finding_numbers_follow_the_order_shown(tmp_path):
    import re

    p = _run("diff", *EXAMPLE, env=_env(COLUMNS="200"))
    assert p.returncode == 1, p.stderr
    block = p.stdout.split("\nfindings (", 1)[1].split("\ntokens:", 1)[0].split("\nacceptance by", 1)[0]
    shown = [int(m.group(1)) for m in re.finditer(r"^\s*[✗!·] #(\d+) ", block, re.M)]
    assert len(shown) >= 4 and shown == list(range(len(shown))), shown
    d = json.loads(_run("diff", *EXAMPLE, "--json").stdout)
    sev = [f["severity"] for f in d["findings"]]
    rank = {"divergence": 0, "warning": 1, "info": 2}
    assert sev == sorted(sev, key=rank.__getitem__), sev   # the JSON lists them in the same order
    kinds = re.findall(r"^\s*[✗!·] #\d+ +(\w+):", block, re.M)   # numbers padded to one width
    assert kinds == [f["kind"] for f in d["findings"]][:len(kinds)], kinds
    out = tmp_path / "r.html"
    assert _run("report", *EXAMPLE, "-o", str(out)).returncode == 1
    html = out.read_text()
    section = html.split("<h2>Findings", 1)[1].split("<h2>", 1)[0]
    nums = [int(x) for x in re.findall(r'class="sev-\w+">[^<]*</span></td><td>(\d+)</td>', section)]
    assert nums == list(range(len(d["findings"]))), nums


# ----------------------------------------------------------------------------------------------
# numpy's warnings never reach stderr: NaN/Inf and overflow are findings
# ----------------------------------------------------------------------------------------------


def _damage(src: str, dst: Path, case: str) -> str:
    import shutil

    import h5py
    import numpy as np

    shutil.copyfile(src, dst)
    rng = np.random.default_rng(0)
    with h5py.File(dst, "r+") as f:
        for name in ("embed", "layer1", "layer2", "layer3", "final_norm", "draft_input"):
            g = f[f"tensors/{name}"]
            if case == "inf_rms":      # rows whose RMS is Inf
                r = g["rms"][...]
                r[3:6] = np.inf
                g["rms"][...] = r
            elif case == "huge":       # finite values whose squares overflow
                v = g["values"][...]
                if v.dtype == np.float32:
                    v[2:5] = 3e38
                    g["values"][...] = v
                s = g["sketch"][...]
                s[2:5] = 3e38
                g["sketch"][...] = s
            else:                      # random bytes written over the data
                for k in ("values", "sketch", "rms"):
                    d = g[k]
                    raw = rng.integers(0, 256, d.size * d.dtype.itemsize, dtype=np.uint8)
                    d[...] = raw.view(d.dtype).reshape(d.shape)
    return str(dst)


@pytest.mark.parametrize("case", ["inf_rms", "huge", "garbage"])
def test_no_numpy_warnings_on_stderr(pairs, tmp_path, case):
    a, b = pairs["agree"]
    bad = _damage(b, tmp_path / f"{case}.h5", case)
    for args in (["diff", a, bad, "-q"], ["report", a, bad, "-o", str(tmp_path / "r.html")]):
        p = _run(*args)
        assert p.returncode in (0, 1), p.stderr
        assert "RuntimeWarning" not in p.stderr and p.stderr.strip() == "", p.stderr
    if case == "garbage":
        assert "nonfinite: NaN/Inf" in _run("diff", a, bad).stdout


def test_no_numpy_warnings_from_pool_workers(pairs, tmp_path):
    a, b = pairs["agree"]
    bad = _damage(b, tmp_path / "garbage.h5", "garbage")
    p = _run("diff", a, bad, "-q", "--backend", "pool", "--workers", "2", timeout=300)
    assert p.returncode == 1, p.stderr
    assert "RuntimeWarning" not in p.stderr and p.stderr.strip() == "", p.stderr


# ----------------------------------------------------------------------------------------------
# help texts and the CI recipe
# ----------------------------------------------------------------------------------------------


def test_calibrate_help_describes_itself_and_its_margin():
    p = _run("calibrate", "--help")
    assert p.returncode == 0
    text = " ".join(p.stdout.split())
    usage_end = text.index("positional arguments")
    assert "noise" in text[:usage_end].split("[--margin MARGIN]", 1)[-1], text   # a description under the usage
    assert "default 4" in text or "default: 4" in text, text


@pytest.mark.parametrize(("fmt", "words"), [("specforge", ".ckpt"), ("sglang-dump", "DUMPER_DIR"),
                                            ("vllm-hidden-states", ".safetensors")])
def test_import_format_help_is_that_formats(fmt, words):
    p = _run("import", fmt, "--help")
    assert p.returncode == 0, p.stderr
    head = "\n".join(p.stdout.splitlines()[:8])
    assert f"tensordiff import {fmt}" in head and words in head, p.stdout
    others = {"specforge", "speculators", "sglang-dump", "vllm-hidden-states", "trtllm", "modelopt"} - {fmt}
    assert not any(f"tensordiff import {o} " in p.stdout for o in others), p.stdout


def test_ci_recipe_gives_report_and_diff_the_same_rules():
    """The uploaded report and the log line must judge with the same tolerances."""
    import re
    import shlex

    text = (ROOT / "docs" / "ci.md").read_text()
    block = text.split("## A CI job", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    opts = {}
    for line in block.splitlines():
        m = re.match(r"\s*tensordiff (diff|report) (.*)", line)
        if m:
            words = shlex.split(m.group(2).split("|")[0].split("||")[0].split("#")[0])
            judged = [w for i, w in enumerate(words) if w.startswith("--") and w not in ("-o", "--out")]
            vals = [words[i + 1] for i, w in enumerate(words) if w in ("--tol", "--calibration", "--allow-failed")]
            opts[m.group(1)] = (sorted(judged), sorted(vals))
    assert set(opts) == {"diff", "report"}, block
    assert opts["diff"] == opts["report"], opts


# ----------------------------------------------------------------------------------------------
# two runs of the same side
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def same_side(tmp_path_factory) -> tuple[str, str]:
    """Two train runs (the everyday regression check); the second's draft input holds other layers."""
    d = tmp_path_factory.mktemp("runs")
    a, b = str(d / "run1.h5"), str(d / "run2.h5")
    write_trace(a, side="train")
    write_trace(b, side="train", seed=1, noise=1e-6, packed_labels=("layer2", "layer3"))
    return a, b


def _no_side_word(text: str, what: str) -> None:
    import re

    # the side named where a sentence or a header means one side (sequences here are named
    # train-0 and the regime is train: those are not side names)
    side = (r"\btrain(?:'s| claims| holds| labels| has| positions| pairs| score| margin| keeps|: )|\[train\]"
            r"|\bon train\b|\bbetween train\b|\btrain and train\b|\btrain vs\b|>train (claims|holds)")
    bad = [m.group(0) for m in re.finditer(side, text)]
    assert not bad, f"{what} names both sides 'train': {bad[:5]}\n{text[:3000]}"


def test_same_side_wording_in_text_json_and_html(same_side, tmp_path):
    p = _run("diff", *same_side, env=_env(COLUMNS="200"))
    assert p.returncode == 1, p.stderr
    _no_side_word(p.stdout, "the text report")
    assert "A claims ┃ A holds ┃ B claims ┃ B holds" in p.stdout, p.stdout
    d = json.loads(_run("diff", *same_side, "--json").stdout)
    _no_side_word(d["headline"] + "\n".join(f["message"] for f in d["findings"]), "the JSON's sentences")
    p80 = _run("diff", *same_side, env=_env(COLUMNS="80"))
    _no_side_word(p80.stdout, "the 80-column text report")
    assert "A claims layer1, holds layer1; B claims layer2," in p80.stdout, p80.stdout
    out = tmp_path / "r.html"
    assert _run("report", *same_side, "-o", str(out)).returncode == 1
    html = out.read_text()
    _no_side_word(html.split("<body", 1)[1], "the HTML report")
    assert "<th>A claims</th>" in html and "<th>B holds</th>" in html, html[:2000]


# ----------------------------------------------------------------------------------------------
# the README's first screen
# ----------------------------------------------------------------------------------------------

_COMMIT = r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b"


def test_readme_first_screen_is_what_a_user_needs():
    import re

    text = (ROOT / "README.md").read_text()
    first = "\n".join(text.splitlines()[:45])
    assert "differential tensor-tracing debugger" in first
    assert "scripts/setup.sh core && .venv/bin/tensordiff diff traces/train.h5 traces/serve.h5" in first
    assert "scripts/test.sh" in first
    assert "| what | what it costs" in first            # what it costs, in one table
    screen = text.splitlines()[:40]                      # the first screen: the output and the quickstart too
    assert any(x.startswith("train feeds draft_input [embed, layer3, layer5]") for x in screen), screen
    assert all(x in screen for x in _quickstart()), screen
    assert ("train feeds draft_input [embed, layer3, layer5], serve feeds [layer3, layer5, layer7]; "
            "the draft was trained on train's") in first
    # measurement history lives in docs/benchmarks.md, not in a user's README or the TUI's page
    for doc in ("README.md", "docs/tui.md"):
        body = (ROOT / doc).read_text()
        assert not re.findall(_COMMIT, body), (doc, re.findall(_COMMIT, body)[:5])
        assert not re.search(r"load( average)? \d|load \d|1-min load", body), doc
    bench = (ROOT / "docs" / "benchmarks.md").read_text()
    for figure in ("**31.1x**", "**1.74x**", "**0.43 s**", "**3.5-5.1%**", "**99.5 MB**", "### First paint, browsing, quit"):
        assert figure in bench, figure


# ----------------------------------------------------------------------------------------------
# the example pair shows acceptance
# ----------------------------------------------------------------------------------------------


def test_example_pair_has_predictions_and_shows_acceptance():
    import h5py

    with h5py.File(EXAMPLE[0], "r") as f:
        train = set(f["tensors"])
    with h5py.File(EXAMPLE[1], "r") as f:
        serve = set(f["tensors"])
    assert {"target_topk", "draft_topk", "draft_fc_output"} <= train, train
    assert {"target_topk", "draft_topk", "draft_fc_output"} <= serve and any("verify" in t for t in serve), serve
    assert sum(p.stat().st_size for p in (ROOT / "traces").glob("*") if p.is_file()) < 4_000_000
    p = _run("diff", *EXAMPLE, env=_env(COLUMNS="120"))
    assert p.returncode == 1, p.stderr
    lines = p.stdout.splitlines()
    assert lines[0] == ("train feeds draft_input [embed, layer3, layer5], serve feeds [layer3, layer5, layer7]; "
                        "the draft was trained on train's")   # the same first line
    acc = [x for x in lines if "acceptance:" in x]
    assert acc and "verify steps" in acc[0], p.stdout
    upstream = "first divergence upstream: slot 0 of draft_input: train feeds embed, serve feeds layer3"
    assert upstream in " ".join(p.stdout.split()), p.stdout
    assert any(x.startswith("acceptance by draft position") for x in lines), p.stdout
    readme = "\n".join((ROOT / "README.md").read_text().splitlines()[:45])
    assert "acceptance" in readme and "verify steps" in readme, readme


# ----------------------------------------------------------------------------------------------
# the README's "debug your own model", run as written
# ----------------------------------------------------------------------------------------------


def _quickstart() -> list[str]:
    text = (ROOT / "README.md").read_text()
    assert text.index("**Debug your own model**") < len("\n".join(text.splitlines()[:40])), "not on the first screen"
    block = text.split("**Debug your own model**", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    return [line for line in block.splitlines() if line.strip()]


@pytest.mark.slow
def test_readme_quickstart_runs_as_written_and_names_the_op(tmp_path):
    """The five lines under "Debug your own model", on the trained tiny Llama against a port of it
    whose rope theta is wrong: record both sides, diff (a state out of the noise), zoom the layer
    that makes it on both sides and diff again (the op and its cause)."""
    import shutil

    import trained

    lines = _quickstart()
    assert len(lines) == 5 and all(x.startswith(".venv/bin/tensordiff ") for x in lines), lines
    port = trained.variant_model(tmp_path, "port", {"rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"}})
    shutil.copy(trained.prompts_path(), tmp_path / "prompts.jsonl")
    (tmp_path / ".venv").symlink_to(ROOT / ".venv")
    env = _env()
    outs = []
    for line in lines:
        cmd = line.split("   #", 1)[0].replace("REF_DIR", str(trained.target_dir())).replace("PORT_DIR", str(port))
        p = subprocess.run(["bash", "-c", cmd], cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True, timeout=300, check=False)
        outs.append(p)
        assert p.returncode in (0, 1) and "Traceback" not in p.stderr, (cmd, p.stdout[-2000:], p.stderr[-2000:])
    diff, zoom = outs[2], outs[4]
    # the recorded configs differ in a way that explains the first divergence: that comes first
    head = diff.stdout.split("\n", 1)[0]
    assert diff.returncode == 1 and head.startswith("rope_theta is 10000 on A and 500000 on B: the models' recorded "
                                                    "configs differ"), diff.stdout[:600]
    assert "layer1 diverges from token 32" in head, diff.stdout[:600]
    assert zoom.returncode == 1, zoom.stdout[:600]
    diff_out = zoom.stdout[zoom.stdout.find("\n", zoom.stdout.index("catalog:")) + 1:]   # after record's lines
    first = " ".join(diff_out.split("\nverdict:", 1)[0].split())
    assert first.startswith("layer0.q_rope is the first op out of the noise in layer 0: a rotary difference"), first
    assert "look at the models' configs: rope_theta is 10000 on A and 500000 on B" in first, first
    assert "rope theta: A 1e+04, B 5e+05 (each reproduces its side" in first, first
