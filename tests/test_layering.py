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
        "tensordiff.report.text", "tensordiff.report.html", "tensordiff.summary", "tensordiff.cli",
        "tensordiff.conventions", "tensordiff.sketch",
        "tensordiff.dtypes", "tensordiff.tui.data", "tensordiff.tui.text", "tensordiff.recorders",
        "tensordiff.recorders.cli", "tensordiff.locator", "tensordiff.locator.loop", "tensordiff.locator.cli"]


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


def test_a_new_module_is_under_the_contracts(tmp_path):
    """The contracts name packages, not lists of modules: a module added anywhere in a copy of the
    package is checked without editing pyproject.toml (an unlayered module, and one that imports
    torch, textual and the recorders from the reports, each break a contract)."""
    import shutil

    shutil.copy(os.path.join(REPO, "pyproject.toml"), tmp_path)
    shutil.copytree(os.path.join(REPO, "tensordiff"), tmp_path / "tensordiff",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    (tmp_path / "tensordiff" / "newmod.py").write_text("X = 1\n")
    (tmp_path / "tensordiff" / "report" / "extra.py").write_text(
        "import torch\nimport textual\nfrom tensordiff import recorders\n")
    exe = os.path.join(os.path.dirname(sys.executable), "lint-imports")
    r = subprocess.run([exe, "--no-cache"], capture_output=True, text=True, cwd=tmp_path,
                       env=dict(os.environ, PYTHONPATH=str(tmp_path)))
    assert r.returncode != 0, r.stdout[-4000:]
    for broken in ("- tensordiff.newmod", "- tensordiff.report.extra\n", "tensordiff.report.extra -> torch",
                   "tensordiff.report.extra -> textual", "tensordiff.report.extra -> tensordiff.recorders"):
        assert broken in r.stdout, (broken, r.stdout[-4000:])


def test_no_import_circle():
    """No two modules of the package import each other, directly or through others (lazy imports
    count: a circle is a circle in the design even where it does not fail at import time)."""
    import grimp

    g = grimp.build_graph("tensordiff")
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    circles: list[list[str]] = []

    def visit(v: str) -> None:   # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in g.find_modules_directly_imported_by(v):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(comp))

    for m in sorted(g.modules):
        if m not in index:
            visit(m)
    assert circles == [], circles
