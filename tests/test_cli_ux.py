"""What a new user meets at the command line: the verdict's exit code through a closed
pipe, help texts, usage errors that name the subcommand and suggest, the swapped-arguments hint,
tolerance rules (globs, regexes, TOML, first match wins, a rule that matches nothing is an error),
--allow-failed, the 80-column text report, all-NaN rows, `report`, `tui --screenshot`, token text.
"""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from tracegen import run_isolated, tokenizer_dir, write_verdict_pairs

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> dict[str, tuple[str, str]]:
    d = tmp_path_factory.mktemp("ux")
    return write_verdict_pairs(d)


def _cli(*args: str, env: dict | None = None, stdout=subprocess.PIPE) -> subprocess.Popen:
    e = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), **(env or {}))
    return subprocess.Popen([sys.executable, "-m", "tensordiff", *args], stdout=stdout, stderr=subprocess.PIPE,
                            text=True, env=e)


# ----------------------------------------------------------------------------------------------
# exit codes through a pipe
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("case", "want"), [("agree", 0), ("wrong", 1)])
@pytest.mark.parametrize("fmt", [[], ["--json"]])
def test_closed_pipe_keeps_the_verdict(pairs, case, want, fmt):
    """`tensordiff diff A B | head -1` under pipefail: the reader is gone before most of the report."""
    r, w = os.pipe()
    os.close(r)                                  # a reader that has already left
    p = _cli("diff", *pairs[case], *fmt, stdout=w)
    os.close(w)
    _, err = p.communicate(timeout=120)
    assert p.returncode == want, err
    assert "Traceback" not in err and "Exception ignored" not in err, err


def test_head_1_under_pipefail(pairs):
    if not shutil.which("bash") or not shutil.which("head"):
        pytest.fail("bash and head are part of the base image")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    for case, want in (("agree", 0), ("wrong", 1)):
        a, b = pairs[case]
        p = subprocess.run(["bash", "-c", f"set -o pipefail; {sys.executable} -m tensordiff diff {a} {b} | head -1"],
                           capture_output=True, text=True, env=env, timeout=120, check=False)
        assert p.returncode == want, p.stderr
        assert len(p.stdout.splitlines()) == 1


@pytest.mark.parametrize("case", ["agree", "wrong"])
def test_piped_report_lines_have_no_trailing_padding(pairs, case):
    """Off a terminal the text report is read by grep, diff and CI logs: rich pads every table
    row and wrapped line to the console's width, and none of that padding may reach the pipe."""
    p = _cli("diff", *pairs[case], env={"COLUMNS": "120"})
    out, err = p.communicate(timeout=120)
    assert p.returncode in (0, 1), err
    lines = out.splitlines()
    assert len(lines) > 5 and out.endswith("\n")
    assert any("\u2502" in line or "tensor" in line for line in lines)   # the tables were printed
    padded = [line for line in lines if line != line.rstrip()]
    assert not padded, padded[:3]


# ----------------------------------------------------------------------------------------------
# help, usage errors, hints
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cmd", ["diff", "tui", "report"])
def test_help_describes_positionals_and_exit_codes(cmd):
    rc, out, _ = run_isolated([cmd, "--help"])
    assert rc == 0
    text = " ".join(out.split())
    assert "reference trace" in text and "trace under test" in text
    # exit 0 means compared and agree: an incomplete comparison exits 1 unless --allow-incomplete
    assert "exit codes: 0 agree (every paired tensor compared, none diverges), 1 divergence found" in text
    assert ("0 with --allow-incomplete" in text) == (cmd != "tui")
    assert "2 bad input or nothing compared" in text
    assert "--require-complete" not in text   # removed: completeness is the default, nothing to ask for


# a fresh interpreter in which the named top-level modules are not found (as in a venv without
# the extra): every finder answers None for them, so `import` and `find_spec` both see them missing
_WITHOUT = """
import sys
BLOCK = set(sys.argv[1].split(","))
class Hide:
    def __init__(self, f):
        self.f = f
    def find_spec(self, name, path=None, target=None):
        return None if name.split(".")[0] in BLOCK else self.f.find_spec(name, path, target)
    def __getattr__(self, a):
        return getattr(self.f, a)
sys.meta_path[:] = [Hide(f) for f in sys.meta_path]
from tensordiff.cli import main
sys.exit(main(sys.argv[2:]))
"""


@pytest.mark.parametrize(("missing", "argv", "extra"), [
    ("torch", ["record", "train", "--model", "{m}", "--prompts", "{p}", "--out", "{o}"], "torch"),
    ("transformers", ["record", "train", "--model", "{m}", "--prompts", "{p}", "--out", "{o}"], "torch"),
    ("torch", ["import", "specforge", "{p}", "--out", "{o}"], "torch"),
    ("sglang", ["record", "serve", "--model", "{m}", "--prompts", "{p}", "--out", "{o}"], "sglang"),
    ("vllm", ["record", "serve", "--engine", "vllm", "--model", "{m}", "--prompts", "{p}", "--out", "{o}"], "vllm"),
    ("ray", ["diff", "{a}", "{b}", "--backend", "ray"], "ray"),
])
def test_a_missing_extra_is_one_line_naming_it(pairs, tmp_path, missing, argv, extra):
    """A command run where its extra is not installed: the user's set-up, one line naming the
    extra to install, exit 2 (not "unexpected ModuleNotFoundError", exit 3)."""
    m = tmp_path / "m"
    m.mkdir()
    (m / "config.json").write_text('{"vocab_size": 100, "num_hidden_layers": 2}')
    (tmp_path / "p.jsonl").write_text('{"input_ids": [1, 2, 3]}\n')
    names = {"m": str(m), "p": str(tmp_path / "p.jsonl"), "o": str(tmp_path / "o.h5"),
             "a": pairs["agree"][0], "b": pairs["agree"][1]}
    e = dict(os.environ, PYTHONPATH=str(ROOT))
    e.pop("TENSORDIFF_DEBUG", None)
    proc = subprocess.run([sys.executable, "-c", _WITHOUT, missing, *[x.format(**names) for x in argv]],
                          capture_output=True, text=True, env=e, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, (proc.returncode, proc.stderr[-2000:])
    assert f"pip install 'tensordiff[{extra}]'" in lines[0], lines
    assert not (tmp_path / "o.h5").exists()


@pytest.mark.parametrize("cmd", [[], ["info"], ["diff"], ["tui"], ["report"], ["calibrate"], ["weights"], ["triage"],
                                 ["record"], ["record", "train"], ["record", "serve"], ["import"]])
def test_every_help_points_at_the_glossary(cmd):
    """Each help ends with where its words are explained, and the glossary explains each of them."""
    rc, out, _ = run_isolated([*cmd, "--help"])
    assert rc == 0
    text = " ".join(out.split())
    assert text.endswith("convention, aux ids, ...): docs/glossary.md."), text[-300:]
    if cmd == ["weights"]:   # a description line, not only the usage
        assert "Compare checkpoint B against the reference A parameter by parameter" in text
    glossary = (ROOT / "docs" / "glossary.md").read_text()
    for term in ("boundary", "slot", "packed tensor", "catalog", "sketch", "regime", "noise trend", "convention",
                 "aux ids"):
        assert f"**{term}**" in glossary, term


def test_record_train_does_not_overwrite_a_trace(tmp_path):
    """`record train --out` onto an existing file: one line, exit 2, the file as it was (before
    the model is loaded); --force is the way to replace it."""
    out = tmp_path / "t.h5"
    out.write_bytes(b"an earlier trace")
    (tmp_path / "p.jsonl").write_text('{"input_ids": [1, 2, 3]}\n')
    rc, _, err = run_isolated(["record", "train", "--model", str(tmp_path / "nope"), "--prompts",
                               str(tmp_path / "p.jsonl"), "--out", str(out)])
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "exists; pass --force" in err, err
    assert out.read_bytes() == b"an earlier trace"
    rc, _, err = run_isolated(["record", "train", "--model", str(tmp_path / "nope"), "--prompts",
                               str(tmp_path / "p.jsonl"), "--out", str(out), "--force"])
    assert rc == 2 and "exists; pass --force" not in err and "nope" in err, err


def test_usage_errors_name_the_subcommand_and_suggest(pairs):
    rc, _, err = run_isolated(["diff", *pairs["agree"], "--tols", "x=1,0"])
    assert rc == 2 and len(err.strip().splitlines()) == 1
    assert "did you mean --tol?" in err and "see `tensordiff diff --help`" in err
    rc, _, err = run_isolated(["dif", *pairs["agree"]])
    assert rc == 2 and "did you mean 'diff'?" in err
    rc, _, err = run_isolated(["report", *pairs["agree"], "-o", "/tmp/x.html", "--tokeniser", "d"])
    assert rc == 2 and "did you mean --tokenizer?" in err and "tensordiff report --help" in err


@pytest.mark.parametrize("cmd", ["diff", "info", "weights", "triage", "report", "calibrate"])
@pytest.mark.parametrize(("flag", "hint"), [("--bogus", None), ("--jsn", "--json")])
def test_unknown_flag_is_one_clean_line(pairs, tmp_path, cmd, flag, hint):
    """An unknown flag: the word refused, a suggestion only where a flag is close, and the help
    pointer once at the end (the pointer's own words were read as refused flags)."""
    a, b = pairs["agree"]
    argv = {"info": ["info", a], "report": ["report", a, b, "-o", str(tmp_path / "r.html")],
            "calibrate": ["calibrate", a, b, "--out", str(tmp_path / "c.json")]}.get(cmd, [cmd, a, b])
    if cmd not in ("diff", "info", "triage"):   # no --json: nothing close to suggest
        hint = None
    rc, out, err = run_isolated([*argv, flag])
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1, err
    want = f"tensordiff: error: unrecognized arguments: {flag}" + (f"; did you mean {hint}?" if hint else "")
    assert lines[0] == want + f" (see `tensordiff {cmd} --help`)", lines[0]


def test_paths_print_as_they_are_not_as_emoji(pairs, tmp_path):
    """rich turns ``:smile:`` into an emoji unless told not to: a path is data, printed as it is."""
    d = tmp_path / ":smile:"
    d.mkdir()
    a, b = (str(shutil.copy(p, d / f"{side}.h5")) for side, p in zip("ab", pairs["wrong"]))
    for argv in (["diff", a, b], ["info", a]):
        rc, out, err = run_isolated(argv)
        assert rc in (0, 1), err
        assert f"{d}/" in out and "\N{SMILING FACE WITH OPEN MOUTH AND SMILING EYES}" not in out, out[:400]


def test_swapped_arguments_hint(pairs):
    a, b = pairs["agree"]
    rc, _, err = run_isolated(["diff", b, a, "-q"])
    assert rc == 0
    assert "hint: A is the serve trace and B the train trace" in err and f"tensordiff diff {a} {b}" in err
    rc, _, err = run_isolated(["diff", a, b, "-q"])
    assert "hint:" not in err


def test_progress_counts_candidates_not_rows():
    from tensordiff.fmt import progress_unit

    assert progress_unit("identifying slots") == "candidates"
    assert progress_unit("comparing tensors") == "rows"


# ----------------------------------------------------------------------------------------------
# tolerance rules and --allow-failed
# ----------------------------------------------------------------------------------------------


def test_tolerance_rules(pairs, tmp_path):
    a, noisy = pairs["noisy"]
    rc, _, _ = run_isolated(["diff", a, noisy, "-q"])
    assert rc == 1                                      # the default tolerances catch the noise
    assert run_isolated(["diff", a, noisy, "-q", "--tol", "*=0.9,0.5"])[0] == 0
    # globs and regexes, name[slot]; the first match wins
    loose = ["--tol", "layer*=0.9,0.5", "--tol", "re:(embed|final_norm)=0.9,0.5", "--tol", "draft_input[?]=0.9,0.5"]
    assert run_isolated(["diff", a, noisy, "-q", *loose])[0] == 0
    assert run_isolated(["diff", a, noisy, "-q", "--tol", "*=1,0", *loose])[0] == 1   # shadowed rules: no error
    # a rule that matches nothing is an error, never silently ignored
    rc, _, err = run_isolated(["diff", a, noisy, "-q", "--tol", "*=0.9,0.5", "--tol", "nonexistent=0.9,0.1"])
    assert rc == 2 and "'nonexistent' matches no compared tensor" in err and "layer1" in err
    # the same as a TOML file
    f = tmp_path / "tol.toml"
    f.write_text('[[rule]]\nmatch = "layer*"\nmin_cos = 0.9\nmax_rel = 0.5\n\n'
                 '[[rule]]\nmatch = "*"\nmin_cos = 0.9\nmax_rel = 0.5\n')
    rc, out, _ = run_isolated(["diff", a, noisy, "--tol", str(f)])
    assert rc == 0 and "rule:tol.toml" in out
    bad = tmp_path / "bad.toml"
    bad.write_text('[[rule]]\nmatch = "layer*"\nmin_cos = 2\nmax_rel = 0.5\n')
    rc, _, err = run_isolated(["diff", a, noisy, "--tol", str(bad)])
    assert rc == 2 and "min_cos must be in [-1, 1]" in err
    rc, _, err = run_isolated(["diff", a, noisy, "--tol", "re:(=0.9,0.1"])
    assert rc == 2 and "re:(" in err


def test_allow_failed(pairs, tmp_path):
    a, wrong = pairs["wrong"]
    rc, out, _ = run_isolated(["diff", a, wrong, "--allow-failed", "draft_input"])
    assert rc == 0
    assert out.splitlines()[0].startswith("no divergence outside the 2 allowed by --allow-failed")
    allowed = "allowed by --allow-failed 'draft_input': slot 0 of draft_input: train feeds layer1, serve feeds layer2"
    assert allowed in " ".join(out.split())
    assert run_isolated(["diff", a, wrong, "-q", "--allow-failed", "draft_input[0]"])[0] == 1   # slot 1 still fails
    rc, _, err = run_isolated(["diff", a, wrong, "-q", "--allow-failed", "draft_inptu"])
    assert rc == 2 and "matches no compared tensor" in err
    f = tmp_path / "ci.toml"
    f.write_text('allow_failed = ["draft_input"]\n')
    assert run_isolated(["diff", a, wrong, "-q", "--tol", str(f)])[0] == 0


# ----------------------------------------------------------------------------------------------
# the text report
# ----------------------------------------------------------------------------------------------


def test_text_report_at_80_columns(pairs):
    a, wrong = pairs["wrong"]
    rc, out, _ = run_isolated(["diff", a, wrong], env={"COLUMNS": "80"})
    assert rc == 1
    lines = out.splitlines()
    # into a pipe the headline is its first line whole (what `| head -1` reads); the rest fits
    assert lines[0] == "train feeds draft_input [layer1, layer2], serve feeds [layer2, layer3]; the draft was trained on train's"
    assert all(len(x.rstrip()) <= 80 for x in lines[1:]), [x for x in lines[1:] if len(x.rstrip()) > 80]
    assert "…" not in out                                   # nothing cut
    flat = " ".join(out.split())
    assert "train claims layer1, holds layer1; serve claims layer2, holds layer2 (serve score" in flat   # in full
    for f in ("slot 0 of draft_input: train feeds layer1, serve feeds layer2 (each holds what it claims; the draft was "
              "trained on train's)",):
        assert f in flat
    assert "gap: gap:" not in out
    # at 200 columns the slot table is a table, with side B's score and margin labelled as such
    rc, out, _ = run_isolated(["diff", a, wrong], env={"COLUMNS": "200"})
    assert "serve score" in out and "serve margin" in out and "…" not in out


def test_one_tensor_and_all_nan_row(tmp_path):
    import numpy as np

    from tensordiff.trace import TraceWriter

    paths = []
    for side, bad in (("train", False), ("serve", True)):
        p = str(tmp_path / f"{side}.h5")
        with TraceWriter(p, side=side, model={"hidden_size": 8, "num_layers": 1}) as w:
            w.define_tensor("embed", 8, kind="boundary", boundary=0)
            rows = w.add_tokens("s", np.arange(4), [5, 6, 7, 8], "train" if side == "train" else "prefill")
            x = np.ones((4, 8), np.float32) * np.arange(1, 5, dtype=np.float32)[:, None]
            if bad:
                x[2] = np.nan
            w.append("embed", rows, x)
        paths.append(p)
    from tensordiff.diff import DiffOptions, diff_traces
    from tensordiff.summary import SummaryReader

    res = diff_traces(*paths, DiffOptions(summary_path=str(tmp_path / "s.h5")))
    nan_row = next(w for w in res.worst_tokens if w["token"] == 7)
    assert np.isnan(nan_row["rel"]) and np.isnan(nan_row["cos"])       # not cos 1.0, rel 0
    s = SummaryReader(str(tmp_path / "s.h5"))
    try:
        cos, rel, maxabs, flags = s.cell(2, 0)
        assert np.isnan(cos) and np.isnan(rel) and np.isnan(maxabs) and int(flags) & 2
    finally:
        s.close()
    assert res.pairs[0].cos_min == [1.0] and res.pairs[0].cos_mean == [1.0]   # the measured rows only
    # an agreeing one-tensor pair says "1 tensor"
    same = diff_traces(paths[0], paths[0])
    assert same.headline() == "no divergence: 4 tokens in 1 tensor agree within tolerance"


# ----------------------------------------------------------------------------------------------
# report, tui --screenshot, token text
# ----------------------------------------------------------------------------------------------


def test_report_command(pairs, tmp_path):
    a, wrong = pairs["wrong"]
    out = tmp_path / "r.html"
    tok = tokenizer_dir(tmp_path / "tok")
    rc, stdout, _ = run_isolated(["report", a, wrong, "-o", str(out), "--tokenizer", tok], timeout=120)
    assert rc == 1 and f"wrote {out}" in stdout
    doc = out.read_text()
    assert "train feeds draft_input [layer1, layer2], serve feeds [layer2, layer3]" in doc and "data:image/png;base64," in doc
    assert "&#x27;w" in doc                                 # token text in the worst tokens
    rc, _, err = run_isolated(["report", a, wrong, "-o", a])
    assert rc == 2 and "overwrite an input" in err
    rc, _, err = run_isolated(["report", a, wrong, "-o", str(out), "--tokenizer", str(tmp_path / "nope")])
    assert rc == 2 and "not a directory" in err


def test_text_report_token_text(pairs, tmp_path):
    a, wrong = pairs["wrong"]
    tok = tokenizer_dir(tmp_path / "tok")
    rc, out, _ = run_isolated(["diff", a, wrong, "--tokenizer", tok])
    assert rc == 1
    head = out.split("worst tokens")[0]
    assert "first divergence at:" in head and "'w" in head    # the token as text next to its id
    assert "text" in out.split("worst tokens")[1].splitlines()[1]


@pytest.mark.parametrize("ext", ["svg", "png"])
def test_tui_screenshot_from_the_cli(pairs, tmp_path, ext):
    a, wrong = pairs["wrong"]
    out = tmp_path / f"shot.{ext}"
    rc, _, err = run_isolated(["tui", a, wrong, "--screenshot", str(out)], timeout=180)
    assert rc == 1, err                                      # the diff's verdict
    data = out.read_bytes()
    if ext == "svg":
        text = data.decode()
        assert text.startswith("<svg") and "draft_input" in text
    else:
        assert data[:8] == b"\x89PNG\r\n\x1a\n"
        w, h = struct.unpack(">II", data[16:24])
        assert w > 800 and h > 400


def test_sketch_based_numbers_are_marked(tmp_path):
    """A pair compared on sketches only: the finding's sentence and the report's numbers say so."""
    import numpy as np

    from tensordiff.sketch import sketch_np
    from tensordiff.trace import TraceWriter

    rng = np.random.default_rng(0)
    x = rng.standard_normal((6, 16)).astype(np.float32)
    paths = []
    for side, noise in (("train", 0.0), ("serve", 0.5)):
        p = str(tmp_path / f"{side}.h5")
        with TraceWriter(p, side=side, model={"hidden_size": 16, "num_layers": 1}, sketch_dim=8) as w:
            w.define_tensor("embed", 16, kind="boundary", boundary=0, values=False)
            rows = w.add_tokens("s", np.arange(6), np.arange(6) + 1, "train" if side == "train" else "prefill")
            y = x + noise * rng.standard_normal(x.shape).astype(np.float32)
            w.append("embed", rows, sketch=sketch_np(y, 16, 8), rms=np.sqrt((y ** 2).mean(1)))
        paths.append(p)
    rc, out, _ = run_isolated(["diff", *paths])
    assert rc == 1
    flat = " ".join(out.split())
    assert "(on sketches)" in flat                       # the numeric finding's sentence
    assert "≈" in out and "computed on the traces' sketches" in flat
