"""The layering rule: the trace format, aligner, identity, numerics, findings, diff, report and CLI
import neither torch nor textual; only the TUI app and widgets import textual; data flows one way.

Two checks: the import-linter contracts in pyproject.toml (static: every import, lazy ones too,
against the layers), and a fresh interpreter per module (what really gets loaded at run time)."""

import os

import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORE = ["tensordiff", "tensordiff.trace", "tensordiff.align", "tensordiff.identity", "tensordiff.catalog", "tensordiff.slots",
        "tensordiff.numerics", "tensordiff.tolerances", "tensordiff.findings", "tensordiff.diff",
        "tensordiff.report", "tensordiff.summary", "tensordiff.cli", "tensordiff.conventions", "tensordiff.sketch",
        "tensordiff.dtypes", "tensordiff.tui_data", "tensordiff.tui_text", "tensordiff.recorders",
        "tensordiff.recorders.cli"]


def test_import_contracts():
    """import-linter: the layers and forbidden imports declared in pyproject.toml."""
    exe = os.path.join(os.path.dirname(sys.executable), "lint-imports")
    r = subprocess.run([exe, "--no-cache"], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "0 broken" in r.stdout


@pytest.mark.parametrize("module", CORE)
def test_core_imports_neither_torch_nor_textual(module):
    code = (f"import sys, {module}\n"
            "from tensordiff.cli import build_parser; build_parser()\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'textual', 'transformers', 'sglang'))\n"
            "print(','.join(bad))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "", f"{module} pulled in: {out}"


def test_cli_diff_runs_without_torch_or_textual(tmp_path):
    """A full `info` + `diff` imports neither (the TUI is only imported for `tui`)."""
    code = ("import sys, numpy as np\n"
            "from tensordiff.trace import TraceWriter\n"
            "from tensordiff.cli import main\n"
            f"p = {str(tmp_path / 't.h5')!r}\n"
            "w = TraceWriter(p, model={'hidden_size': 4}); w.define_tensor('embed', 4, kind='boundary', boundary=0)\n"
            "w.append('embed', w.add_tokens('s', range(3), [1, 2, 3], 'train'), np.ones((3, 4), np.float32)); w.close()\n"
            "assert main(['info', p]) == 0 and main(['diff', p, p, '-q']) == 0\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'textual'))\n"
            "print('BAD:' + ','.join(bad))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().endswith("BAD:"), out


def test_every_core_module_is_under_the_contracts():
    """A new module escapes the forbidden-import contracts unless it is listed: fail until it is."""
    import tomllib

    with open(os.path.join(REPO, "pyproject.toml"), "rb") as fh:
        contracts = tomllib.load(fh)["tool"]["importlinter"]["contracts"]
    pkg = os.path.join(REPO, "tensordiff")
    core = {"tensordiff." + (n[:-3] if n.endswith(".py") else n) for n in os.listdir(pkg)
            if not n.startswith("__") and (n.endswith(".py") or os.path.isfile(os.path.join(pkg, n, "__init__.py")))
            and n != "recorders"}
    layers = " ".join(next(c for c in contracts if c["type"] == "layers")["layers"])
    unlayered = sorted(m for m in core if not any(tok.strip("()") == m for tok in layers.split()))
    assert not unlayered, f"modules in no layer of the layers contract: {unlayered}"
    torch = next(c for c in contracts if "torch" in c.get("forbidden_modules", []))
    textual = next(c for c in contracts if "textual" in c.get("forbidden_modules", []) and "tensordiff.recorders" not in
                   c["source_modules"])
    tui = {"tensordiff.tui", "tensordiff.tui_widgets", "tensordiff.tui_diff"}
    assert sorted(core - set(torch["source_modules"])) == [], "not checked for torch imports"
    assert sorted(core - tui - set(textual["source_modules"])) == [], "not checked for textual imports"
