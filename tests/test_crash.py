"""Recordings survive SIGKILL: a real recorder process (scripts/crash_recorder.py) is killed at
random points, and every trace it leaves opens in `tensordiff info` and `tensordiff diff`, with
every row up to its last flush intact (bit for bit against an unkilled reference run), the token
table consistent with the tensors, and at most one flush interval lost.

The recorder is a zygote: it builds the model once and forks one child per run, so a kill costs
a fork, not a torch import. The child prints ``FLUSH``/``STEP`` lines (see the script's
docstring); this test reads them, kills the child with SIGKILL at a random point of its progress, and checks
the trace against what the child had reported before it died.

* test_killed_writer_*: TraceWriter driven with seeded numpy rows (no torch; fast).
* test_killed_hf_recorder (slow): a tiny random LlamaForCausalLM on CPU recorded through the HF
  extractor recorder (tensordiff.recorders.hf), or through TraceWriter from
  ``output_hidden_states`` when that recorder is unavailable.
* test_kill_at_every_write (slow, needs strace): SIGKILL injected before each k-th pwrite of a
  run, i.e. inside flushes as well as between them.
"""

from __future__ import annotations

import importlib.util
import json
import os
import queue
import random
import shutil
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from tensordiff.errors import TraceFileError
from tensordiff.trace import TraceReader, TraceWriter
from tracegen import assert_clean_exit, run_isolated

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "crash_recorder.py")

_spec = importlib.util.spec_from_file_location("crash_recorder", SCRIPT)
crash_recorder = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(crash_recorder)


class Zygote:
    """The recorder process, its stdout read line by line on a thread (so a dead pipe never blocks)."""

    def __init__(self, prefix: str, runs: int, *extra: str, timeout: float = 300.0):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
        self.proc = subprocess.Popen([sys.executable, SCRIPT, prefix, "--runs", str(runs), *extra],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        self.lines: queue.Queue = queue.Queue()
        self.deadline = time.monotonic() + timeout
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def until(self, prefix: str, log: list) -> list[str]:
        """Read lines (appending them to ``log``) until one starts with ``prefix``; returns its fields."""
        while True:
            left = self.deadline - time.monotonic()
            if left <= 0:
                self.kill()
                raise AssertionError(f"recorder timed out waiting for {prefix!r}; last lines: {log[-5:]}")
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                continue
            if line is None:
                err = self.proc.stderr.read()
                raise AssertionError(f"recorder exited before {prefix!r}: {err[-2000:]}")
            log.append(line)
            if line.startswith("ERROR"):
                raise AssertionError(f"recorder failed: {line}")
            if line.startswith(prefix):
                return line.split(" ", 4)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def _last(log: list[str], kind: str):
    lines = [x for x in log if x.startswith(kind + " ")]
    return lines[-1].split(" ", 4) if lines else None


def kill_runs(tmp_path, kills: int, mode: str, seed: int, *, flush_rows: int, seq_len: int, steps: int,
              flush_seconds: float = 0.0, extra: tuple[str, ...] = ()) -> tuple[list[dict], str]:
    """A reference run, then ``kills`` runs each SIGKILLed at a random point; returns what each
    child had reported before it died, and the reference trace.

    A kill point is a time drawn over the reference's recording, taken as a place in its progress:
    the run is killed that long after it reports the last step the reference had completed by then.
    So the kills fall mid-recording however the machine's load changes between the reference and
    the killed runs (a wall-clock delay let runs that went faster finish before their kill)."""
    rnd = random.Random(seed)
    prefix = str(tmp_path / "run")
    z = Zygote(prefix, kills + 1, "--mode", mode, "--flush-rows", str(flush_rows), "--seq-len", str(seq_len),
               "--steps", str(steps), "--flush-seconds", str(flush_seconds), *extra)
    runs = []
    try:
        log: list[str] = []
        z.until("READY", log)
        _, _, _, ref = z.until("START 0 ", log)
        t0 = time.monotonic()
        step_at = [0.0]  # step_at[i + 1]: when the reference reported step i
        for i in range(steps):
            z.until(f"STEP 0 {i} ", log)
            step_at.append(time.monotonic() - t0)
        z.until("DONE 0", log)
        duration = time.monotonic() - t0
        z.until("END 0", log)
        for run in range(1, kills + 1):
            log = []
            _, _, pid, path = z.until(f"START {run} ", log)
            # uniform over the recording, plus a few kills in its first moments (before any flush)
            at = rnd.uniform(0, 0.15 * duration) if run % 4 == 1 else rnd.uniform(0, duration)
            done = max(i for i, t in enumerate(step_at) if t <= at)  # steps the reference had completed
            if done:
                z.until(f"STEP {run} {done - 1} ", log)
            delay = at - step_at[done]
            time.sleep(delay)
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:  # it finished (and was reaped) first
                pass
            end = z.until(f"END {run} ", log)
            flush = _last(log, "FLUSH")
            step = _last(log, "STEP")
            runs.append({
                "run": run, "path": path, "after_steps": done, "delay": delay, "status": int(end[2]),
                "flushed_tokens": int(flush[3]) if flush else 0,
                "flushed_tensors": json.loads(flush[4]) if flush else {},
                "added_tokens": int(step[3]) if step else 0,
                "done": any(x.startswith(f"DONE {run}") for x in log),
            })
    finally:
        z.kill()
    return runs, ref


def _recovered(r: dict, ref: str, ctx: str) -> dict | None:
    """check_recovered, or None for a recorder killed before its writer's first commit (no file, a
    0-byte file, a header cut short): then nothing was committed, and the CLI must say so in one line."""
    try:
        return crash_recorder.check_recovered(r["path"], ref)
    except TraceFileError as e:
        assert r["flushed_tokens"] == 0, f"{ctx}: {r['flushed_tokens']} token rows were flushed, yet: {e}"
        rc, out, err = run_isolated(["info", r["path"]], timeout=60)
        assert_clean_exit(rc, out, err, ctx)
        assert rc == 2, ctx
        return None


def check_runs(runs, ref, *, flush_rows: int, seq_len: int, seed: int) -> list[int]:
    """Every killed run: info and diff open it cleanly, every flushed row is there and equal to the
    reference, at most one flush interval is lost. Returns the token rows lost per kill."""
    lost = []
    for r in runs:
        ctx = f"seed {seed}, run {r['run']} killed {r['delay']:.3f} s after its step count reached {r['after_steps']}"
        if r["done"]:  # the kill came after the child finished; nothing to recover
            continue
        assert r["status"] == -signal.SIGKILL, ctx
        got = _recovered(r, ref, ctx)  # bit-for-bit prefix of the reference
        if got is None:
            lost.append(r["added_tokens"])
            continue
        assert got["tokens"] >= r["flushed_tokens"], f"{ctx}: {got['tokens']} token rows, {r['flushed_tokens']} were flushed"
        for name, n in r["flushed_tensors"].items():
            assert got["tensor_rows"].get(name, 0) >= n, f"{ctx}: {name} has {got['tensor_rows'].get(name)} rows, {n} flushed"
        interval = max(flush_rows, seq_len)
        assert r["added_tokens"] - got["tokens"] <= interval, f"{ctx}: lost more than one flush interval ({got})"
        lost.append(r["added_tokens"] - got["tokens"])
        rc, out, err = run_isolated(["info", "--json", r["path"]], timeout=60)
        assert_clean_exit(rc, out, err, ctx)
        assert rc == 0, f"{ctx}: {err}"
        s = json.loads(out)
        if not s["complete"]:  # (complete: killed in close() after everything reached the file)
            assert "not closed cleanly" in s["recovered"], ctx
            assert f"recovered {got['tokens']} token rows" in s["recovered"], ctx
        rc, out, err = run_isolated(["diff", ref, r["path"], "-q"], timeout=60)
        assert_clean_exit(rc, out, err, ctx)
        if got["tokens"]:
            assert rc == 0, f"{ctx}: the recovered rows must agree with the reference: {out[-1500:]} {err}"
        else:
            assert rc == 2 and "empty trace" in err, f"{ctx}: {err}"
    return lost


def test_killed_writer_keeps_every_flushed_row(tmp_path):
    seed = random.randrange(1 << 30)
    runs, ref = kill_runs(tmp_path, 6, "numpy", seed, flush_rows=96, seq_len=24, steps=80)
    lost = check_runs(runs, ref, flush_rows=96, seq_len=24, seed=seed)
    assert len(lost) >= 3, f"seed {seed}: too few runs were killed mid-recording ({runs})"
    print(f"token rows lost per kill (flush every 96 rows): {lost}")


def test_killed_writer_of_aligned_2mib_chunks_keeps_every_flushed_row(tmp_path):
    """The same at H=4096 bf16: rows fill 2 MiB chunks that the file places at multiples of 2 MiB,
    metadata in 64 KiB blocks; a kill anywhere leaves every flushed row, bit for bit."""
    from tensordiff.trace.schema import ALIGN_BYTES

    seed = random.randrange(1 << 30)
    runs, ref = kill_runs(tmp_path, 5, "numpy", seed, flush_rows=300, seq_len=64, steps=24, extra=("--hidden", "4096"))
    with TraceReader(ref) as r:
        assert r._stored("embed", "values").chunks == (ALIGN_BYTES // 8192, 4096)
    lost = check_runs(runs, ref, flush_rows=300, seq_len=64, seed=seed)
    assert len(lost) >= 2, f"seed {seed}: too few runs were killed mid-recording ({runs})"


def test_killed_writer_with_time_based_flush(tmp_path):
    """flush_seconds alone (no row trigger worth speaking of): still at most one interval lost."""
    seed = random.randrange(1 << 30)
    runs, ref = kill_runs(tmp_path, 3, "numpy", seed, flush_rows=100000, seq_len=24, steps=80, flush_seconds=0.05)
    for r in runs:
        if not r["done"]:
            got = _recovered(r, ref, f"seed {seed}, run {r['run']}")
            assert got is None or got["tokens"] >= r["flushed_tokens"], f"seed {seed}: {got} vs {r}"


@pytest.mark.slow
def test_killed_hf_recorder(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    seed = random.randrange(1 << 30)
    runs, ref = kill_runs(tmp_path, 5, "auto", seed, flush_rows=64, seq_len=16, steps=40)
    with TraceReader(ref) as r:
        assert r.complete and {"embed", "layer4", "draft_input"} <= set(r.tensors)
    lost = check_runs(runs, ref, flush_rows=64, seq_len=16, seed=seed)
    assert lost, f"seed {seed}: no run was killed mid-recording"
    print(f"HF recorder: token rows lost per kill (flush every 64 rows, 16 per step): {lost}")


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace to inject SIGKILL at a write")
def test_kill_at_every_write(tmp_path):
    """SIGKILL before the k-th pwrite of a run, for k across all of them (stride 7): inside the
    two phases of every flush, between flushes, in close. Each trace must check out."""
    proc = subprocess.run([sys.executable, SCRIPT, str(tmp_path / "sw"), "--mode", "numpy", "--steps", "24",
                           "--write-sweep", "7"], capture_output=True, text=True, timeout=1200,
                          env=dict(os.environ, PYTHONPATH=ROOT))
    summary = [x for x in proc.stdout.splitlines() if x.startswith("SUMMARY")]
    assert proc.returncode == 0 and summary and "failed=0" in summary[0], proc.stdout[-3000:] + proc.stderr[-2000:]


# ----------------------------------------------------------------------------------------------
# the policy itself, in process (a copy of the file taken mid-recording is what a kill leaves)


def test_flushes_fall_between_steps_and_commit_whole_steps(tmp_path):
    """Batched steps (several add_tokens, then the appends): a flush never splits a step, and a
    snapshot taken after a flush reads back exactly the committed rows."""
    path = tmp_path / "t.h5"
    commits = []
    w = TraceWriter(path, model={"hidden_size": 8, "num_layers": 1}, flush_rows=10, flush_seconds=None,
                    on_flush=lambda wr: commits.append(json.loads(json.dumps(wr.flushed))))
    w.define_tensor("embed", 8, kind="boundary", boundary=0)
    rng = np.random.default_rng(0)
    for step in range(5):
        rows = [w.add_tokens(f"s{step}-{b}", range(4), rng.integers(0, 9, 4), "train", step=step) for b in range(3)]
        w.append("embed", np.concatenate(rows), rng.standard_normal((12, 8)).astype(np.float32))
        if step == 2:
            shutil.copyfile(path, tmp_path / "snapshot.h5")
    w.close()
    assert [c["tokens"] for c in commits][:4] == [12, 24, 36, 48]
    assert all(c["tensors"]["embed"] == c["tokens"] for c in commits)
    with TraceReader(tmp_path / "snapshot.h5") as r, TraceReader(path) as full:
        assert not r.complete and full.complete
        assert len(r.tokens) == 24 and r.tensors["embed"].rows == 24  # step 2 was not yet committed
        assert np.array_equal(r.read_values("embed"), full.read_values("embed", 0, 24))
        assert "recovered 24 token rows and 24 tensor rows" in r.recovered_note


def test_no_trigger_fires_while_flushes_are_held_and_the_next_step_flushes(tmp_path):
    """Several steps' token rows added first and their tensor rows after (a queue made phase by
    phase), inside flushes_held: no flush there, not even with tokens alone twice past the
    trigger; the trigger reached fires at the next step's first token rows, committing whole
    steps."""
    commits = []
    w = TraceWriter(tmp_path / "t.h5", model={"hidden_size": 4, "num_layers": 1}, flush_rows=3, flush_seconds=None,
                    on_flush=lambda wr: commits.append(json.loads(json.dumps(wr.flushed))))
    w.define_tensor("x", 4)
    w.append("x", w.add_tokens("s0", range(2), [1, 2], "decode"), np.ones((2, 4), np.float32))
    with w.flushes_held():
        rows = [w.add_tokens(f"q{i}", range(4), [1, 2, 3, 4], "decode") for i in range(4)]   # 16 rows: 5x the trigger
        assert not w.flush_triggered(1)
        for r in rows:
            w.append("x", r, np.zeros((4, 4), np.float32))
    assert commits == [] and w.flush_triggered(1)
    w.add_tokens("next", [0], [5], "decode")
    assert commits == [{"tokens": 18, "tensors": {"x": 18}}]
    w.close()


def test_time_trigger_and_arguments(tmp_path):
    commits = []
    with TraceWriter(tmp_path / "t.h5", model={"hidden_size": 4}, flush_rows=None, flush_seconds=0.01,
                     on_flush=lambda wr: commits.append(wr.flushed["tokens"])) as w:
        w.define_tensor("x", 4)
        for step in range(4):
            rows = w.add_tokens("s", [step], [step], "decode", step=step)
            w.append("x", rows, np.ones((1, 4), np.float32))
            time.sleep(0.02)
    assert commits[:3] == [1, 2, 3]
    for bad in ({"flush_rows": 0}, {"flush_rows": -5}, {"flush_seconds": 0}, {"flush_seconds": float("nan")}):
        with pytest.raises(ValueError, match="flush_"):
            TraceWriter(tmp_path / "x.h5", **bad)
