"""The suite's own tooling: tests/conftest.py on two pytest-xdist workers keeps each module on one
worker and, with TENSORDIFF_TEST_TIMELINE set, writes one line per test that
scripts/test_timeline.py reads back (run here on two small modules, in a subprocess)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODULES = ("tests/test_names.py", "tests/test_rl_records.py")


def test_two_workers_write_the_timeline_and_keep_each_module_on_one_worker(tmp_path):
    timeline = tmp_path / "timeline.jsonl"
    env = dict(os.environ, TENSORDIFF_TEST_TIMELINE=str(timeline))
    for key in [k for k in env if k.startswith("PYTEST_XDIST")]:   # this test may itself run on a worker
        env.pop(key)
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2",
                          "--dist", "loadgroup", "--no-loadscope-reorder", f"--basetemp={tmp_path / 'bt'}",
                          *MODULES], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    passed = int(run.stdout.strip().splitlines()[-1].split()[0])
    rows = [json.loads(line) for line in timeline.read_text().splitlines()]
    assert len(rows) == passed > 2
    assert all(r["end"] >= r["start"] for r in rows)
    workers = {}
    for r in rows:
        workers.setdefault(r["test"].split("::")[0], set()).add(r["worker"])
    assert set(workers) == set(MODULES)
    assert all(len(w) == 1 and next(iter(w)).startswith("gw") for w in workers.values()), workers

    out = subprocess.run([sys.executable, "scripts/test_timeline.py", str(timeline)], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert f"{passed} tests" in out.stdout.splitlines()[0]
    for m in MODULES:
        assert Path(m).stem in out.stdout


def test_the_timeline_reader_refuses_an_empty_file_in_one_line(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    out = subprocess.run([sys.executable, "scripts/test_timeline.py", str(empty)], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and out.stderr.strip() == "no tests in the timeline"
