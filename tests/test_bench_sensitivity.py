"""benchmarks/bench_sensitivity.py runs (``--quick``: HF recordings, short magnitude lists) and
prints its tables. Only that: the verdict's own assertions live with the verdict's tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_quick_sensitivity_run_prints_its_tables(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TENSORDIFF_")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]])
    out = tmp_path / "res.json"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_sensitivity.py"), "--quick",
                           "--dir", str(tmp_path / "work"), "--json", str(out)],
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = proc.stdout
    for head in ("## noise floor per state", "## cases", "## detection rate by magnitude", "## by kind"):
        assert head in text, text[-3000:]
    for kind in ("scale-const", "scale-token", "mixed", "norm", "partial", "duplicate", "weight", "correct"):
        assert f"| {kind} |" in text, kind
    assert "false alarms:" in text
    fig = json.loads(out.read_text())["figures"]
    assert fig["correct_runs"] >= 8 and fig["bug_runs"] > 0 and isinstance(fig["false_alarms"], int)
