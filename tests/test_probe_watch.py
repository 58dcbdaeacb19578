"""The diff's watched run (tensordiff.trace.probe.run_watched): the diff runs in a forked worker
whose own opens this process watches, so each trace is opened once (the probe opened each twice)
and a file that hangs or kills the HDF5 library still ends in one line and exit code 2."""

from __future__ import annotations

import json
import os
import signal

import pytest

import hostile
from tensordiff.cli import main
from tensordiff.trace import TraceReader
from tracegen import assert_clean_exit, run_isolated, write_pair


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    d = tmp_path_factory.mktemp("watch")
    a, b = write_pair(str(d))
    return {"dir": d, "a": a, "b": b}


def test_diff_in_the_worker_is_the_diff_in_process(good, capsys):
    """Same JSON and exit code through the worker (real file descriptors) as in this process
    (capsys: stdout is not a descriptor, so the probe runs first and the diff here)."""
    rc_in = main(["diff", good["a"], good["b"], "--json", "-q"])
    out_in, err_in = capsys.readouterr()
    rc, out, err = run_isolated(["diff", good["a"], good["b"], "--json", "-q"], timeout=120)
    assert_clean_exit(rc, out, err, "diff")
    assert rc == rc_in and json.loads(out) == json.loads(out_in), err


def test_each_file_is_opened_once(good, tmp_path, monkeypatch):
    """Every TraceReader opened in the run (parent, worker, any child) appends its path to a log:
    each input once. (With a probe child first it was twice.)"""
    log = _count_opens(tmp_path, monkeypatch)
    rc, out, err = run_isolated(["diff", good["a"], good["b"], "--json", "-q"], timeout=120)
    assert_clean_exit(rc, out, err, "diff")
    opened = log.read_text().split()
    assert sorted(opened) == sorted([os.path.abspath(good["a"]), os.path.abspath(good["b"])]), opened


def test_looping_file_stops_the_worker(good, tmp_path):
    """A zeroed global-heap header makes HDF5 loop forever: the worker is killed after the stall
    timeout and the parent says which file, in one line."""
    p = hostile.looping_heap(str(tmp_path / "loop.h5"))
    rc, out, err = run_isolated(["diff", good["a"], p, "--json", "-q"], timeout=60,
                                env={"TENSORDIFF_OPEN_TIMEOUT": "3"})
    assert rc != 124, "the diff did not finish: the looping file was not caught"
    assert_clean_exit(rc, out, err, "diff")
    assert rc == 2 and "made no progress in 3 s: the file is damaged" in err and "loop.h5" in err, err
    # --json: the same line as a JSON error object on stdout, nothing else
    assert json.loads(out)["error"] == {"type": "TraceFileError", "message": err.strip().removeprefix("tensordiff: error: ")}


def test_worker_killed_while_opening_is_a_crash_of_that_file(good, monkeypatch):
    """A worker killed by a signal inside an open (as a crash in the HDF5 library would) gives
    the crash line naming the file, exit 2."""
    orig = TraceReader._load
    target = os.path.abspath(good["b"])

    def dying(self):
        if os.path.abspath(self.path) == target:
            os.kill(os.getpid(), signal.SIGKILL)
        orig(self)

    monkeypatch.setattr(TraceReader, "_load", dying)
    rc, out, err = run_isolated(["diff", good["a"], good["b"], "-q"], timeout=60)
    assert_clean_exit(rc, out, err, "diff")
    assert rc == 2 and "crashed reading this file (signal 9)" in err and "b.h5" in err, err


def test_errors_after_the_open_come_back_as_one_line(good, capsys):
    """An error the worker meets after its opens (a --tol rule matching no tensor) is raised in
    the parent as the same class: the same one line and exit 2 as in-process."""
    argv = ["diff", good["a"], good["b"], "-q", "--tol", "no_such_tensor=cos:0.5"]
    rc_in = main(argv)
    _, err_in = capsys.readouterr()
    rc, out, err = run_isolated(argv, timeout=120)
    assert_clean_exit(rc, out, err, "diff")
    assert rc == rc_in == 2 and err.strip() == err_in.strip(), (err, err_in)


def test_timings_line_names_the_probe(good):
    rc, out, err = run_isolated(["diff", good["a"], good["b"], "-q"], timeout=120, env={"TENSORDIFF_TIMINGS": "1"})
    assert rc in (0, 1), err
    assert "tensordiff: timing: probe" in err and "one open per file" in err, err


def test_worker_killed_after_its_opens_is_not_blamed_on_a_file(good, monkeypatch):
    """Killed after both traces opened (out of memory, say): one line that says so, no file
    called damaged."""
    import tensordiff.diff as diff_mod

    def dying(*a, **kw):
        os.kill(os.getpid(), signal.SIGKILL)

    monkeypatch.setattr(diff_mod, "diff_sources", dying)
    rc, out, err = run_isolated(["diff", good["a"], good["b"], "-q"], timeout=60)
    assert_clean_exit(rc, out, err, "diff")
    assert rc == 2 and "killed (signal 9) after it had opened the traces" in err and "damaged" not in err, err


def _reporting_child(work: str, seconds: float) -> tuple[int, int]:
    """A forked child that reports a file, then ``work``s ("spin": burns CPU, as the HDF5 library
    looping on a damaged file; "wait": sleeps, as a child waiting for a core on a loaded machine)
    for ``seconds`` without a report, then reports once more and exits; (pid, read end)."""
    import time as _time

    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(rfd)
            os.write(wfd, b"P0 some.h5\nN200\n")   # 200 tensors: an allowance of 11 s
            end = _time.monotonic() + seconds
            while _time.monotonic() < end:
                if work == "wait":
                    _time.sleep(0.05)
            os.write(wfd, b"T3\n")
        finally:
            os._exit(0)
    os.close(wfd)
    return pid, rfd


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs /proc (Linux)")
@pytest.mark.parametrize("work,stuck", [("spin", True), ("wait", False)])
def test_stuck_means_cpu_spent_without_progress(work, stuck):
    """A child that burns a stall timeout of CPU without a report is stuck; one that goes as long
    without a report while using no CPU (descheduled on a loaded machine) is not: a valid big
    trace was called damaged under load (TENSORDIFF_OPEN_TIMEOUT=1, load 6)."""
    from tensordiff.trace.probe import _watch

    pid, rfd = _reporting_child(work, 2.5)
    try:
        status, state, lines = _watch(pid, rfd, 1.0)
    finally:
        os.close(rfd)
    assert (status == "stuck") is stuck, (status, lines)
    if not stuck:
        assert os.WIFEXITED(status) and lines[-1] == "T3"
    assert state is not None and state.path == "some.h5"


def test_a_child_without_reports_is_stuck_by_the_wall_clock_at_last(monkeypatch):
    """However little CPU it uses, a child that reports nothing for WALL_FACTOR stall timeouts is stuck
    (a hang outside the CPU, in a read that never returns, ends too)."""
    import importlib

    probe_mod = importlib.import_module("tensordiff.trace.probe")   # (tensordiff.trace.probe is also a function)
    monkeypatch.setattr(probe_mod, "WALL_FACTOR", 2.0)
    pid, rfd = _reporting_child("wait", 8.0)
    try:
        status, _state, lines = probe_mod._watch(pid, rfd, 1.0)
    finally:
        os.close(rfd)
    assert status == "stuck", lines


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs /proc (Linux)")
def test_a_watcher_descheduled_after_its_select_does_not_call_a_reporting_child_stuck(monkeypatch):
    """The watcher's select finds the pipe empty, then the watcher loses its core for longer than
    the stall timeout while the child works and reports: the child's CPU clock then says "stuck",
    but its reports wait in the pipe. That is progress (CI called a valid trace damaged this way,
    TENSORDIFF_OPEN_TIMEOUT=1, on a loaded 2-core machine)."""
    import importlib
    import select as select_mod
    import time as _time

    probe_mod = importlib.import_module("tensordiff.trace.probe")
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:   # reports every 20 ms while it burns CPU, for 3 s
        try:
            os.close(rfd)
            os.write(wfd, b"P0 some.h5\nN200\n")
            end = _time.monotonic() + 3.0
            last = 0.0
            while (now := _time.monotonic()) < end:
                if now - last > 0.02:
                    last = now
                    os.write(wfd, b"T1\n")
        finally:
            os._exit(0)
    os.close(wfd)
    calls = [0]

    class Descheduled:
        """select.select, but its third wait returns nothing after 1.5 s (the watcher lost its
        core right after the select found the pipe empty)."""

        @staticmethod
        def select(r, w, x, timeout=None):
            if timeout:
                calls[0] += 1
                if calls[0] == 3:
                    _time.sleep(1.5)
                    return [], [], []
            return select_mod.select(r, w, x, timeout)

    monkeypatch.setattr(probe_mod, "select", Descheduled)
    try:
        status, state, lines = probe_mod._watch(pid, rfd, 1.0)
    finally:
        os.close(rfd)
    assert status != "stuck" and os.WIFEXITED(status), (status, lines[-3:])
    assert calls[0] > 3
    assert state is not None and state.path == "some.h5"


def _count_opens(tmp_path, monkeypatch):
    log = tmp_path / "opens.log"
    orig = TraceReader.__init__

    def counting(self, path, **kw):
        with open(log, "a") as fh:
            fh.write(os.path.abspath(os.fspath(path)) + "\n")
        orig(self, path, **kw)

    monkeypatch.setattr(TraceReader, "__init__", counting)
    return log


def test_calibrate_opens_each_input_once(good, tmp_path, monkeypatch):
    """calibrate runs in the watched worker too: A and B opened once each (the probe's child
    opened both before the command opened them again)."""
    log = _count_opens(tmp_path, monkeypatch)
    out_json = tmp_path / "tol.json"
    rc, out, err = run_isolated(["calibrate", good["a"], good["b"], "--out", str(out_json)], timeout=120)
    assert rc == 0, err
    assert json.loads(out_json.read_text())["tolerances"], out_json.read_text()[:200]
    assert sorted(log.read_text().split()) == sorted([os.path.abspath(good["a"]), os.path.abspath(good["b"])])


def test_report_errors_come_back_from_the_worker(good, tmp_path):
    """report in the watched worker: a bad input is still one line and exit 2, nothing written."""
    html = tmp_path / "r.html"
    rc, out, err = run_isolated(["report", good["a"], str(tmp_path / "missing.h5"), "-o", str(html)], timeout=120)
    assert rc == 2 and err.count("\n") == 1 and "no such file" in err, err
    assert not html.exists()
    rc, out, err = run_isolated(["report", good["a"], good["b"], "-o", str(html)], timeout=120)
    assert rc in (0, 1) and html.read_text().startswith("<!"), err
    assert out.startswith(f"wrote {html}"), out


def test_python_m_diff_exits_at_once_with_all_its_output(good):
    """`python -m tensordiff diff` ends without the interpreter's teardown once the worker has
    ended: the whole report still arrives, with the diff's exit code (and an error its line)."""
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=repo + os.pathsep + os.environ.get("PYTHONPATH", ""))
    run = [sys.executable, "-m", "tensordiff", "diff"]
    ref = main(["diff", good["a"], good["b"], "--json", "-q"])
    p = subprocess.run([*run, good["a"], good["b"], "--json", "-q"], capture_output=True, text=True, env=env,
                       timeout=120)
    assert p.returncode == ref and json.loads(p.stdout)["headline"], p.stderr
    p = subprocess.run([*run, good["a"], good["b"]], capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == ref and "verdict:" in p.stdout, p.stderr
    p = subprocess.run([*run, good["a"], "missing.h5"], capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 2 and p.stdout == "" and p.stderr.startswith("tensordiff: error: missing.h5"), p.stderr
