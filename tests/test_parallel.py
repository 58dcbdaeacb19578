"""The parallel numeric pass gives exactly the serial diff: the full JSON, both argument orders,
on a pair with real divergences (drift, a wrong slot, NaN rows) and on an agreeing pair, for
single files and trace sets, with tasks of one block and of several."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import h5py
import numpy as np
import pytest

from setgen import make_recording, write, write_ranks
from tensordiff.cli import jsonable, main
from tensordiff.backends import AUTO_MIN_BYTES, make_backend
from tensordiff.diff import DiffOptions, SerialBackend, diff_traces, open_pair, plan_diff
from tensordiff.errors import UsageError
from tensordiff.parallel import PoolBackend


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    d = tmp_path_factory.mktemp("par")
    train = make_recording("train")
    bad = make_recording("serve", noise=1e-6, seed=1, drift=True, wrong_slot=True)
    ok = make_recording("serve", noise=1e-6, seed=2)
    out = {"train": write(str(d / "train.h5"), train),
           "bad": write(str(d / "bad.h5"), bad, tweak={("layer1", "s6", 2): np.float32(np.nan),
                                                          ("final_norm", "s1", 0): np.float32(np.inf)}),
           "ok": write(str(d / "ok.h5"), ok)}
    write_ranks(str(d / "bad_set"), bad, dp=2, pp=2)
    out["bad_set"] = str(d / "bad_set")
    return out


@pytest.fixture(scope="module")
def pool():
    with PoolBackend(2, task_bytes=1) as b:   # every task one block: the most merging
        yield b


def as_json(res) -> str:
    return json.dumps(jsonable(res.to_dict()), sort_keys=False)


def run(a, b, backend=None, block_rows=16, summary=None):
    return as_json(diff_traces(a, b, DiffOptions(block_rows=block_rows, backend=backend, summary_path=summary)))


@pytest.mark.parametrize("pair", [("train", "bad"), ("bad", "train"), ("train", "ok"), ("ok", "train"),
                                  ("train", "bad_set"), ("bad_set", "train")])
@pytest.mark.parametrize("block_rows", [16, 4096])
def test_pool_equals_serial(traces, pool, pair, block_rows):
    a, b = traces[pair[0]], traces[pair[1]]
    serial = run(a, b, None, block_rows)
    assert run(a, b, pool, block_rows) == serial
    d = json.loads(serial)
    if "ok" in pair:
        assert d["verdict"] == "agree"
    else:
        kinds = {f["kind"] for f in d["findings"] if f["severity"] == "divergence"}
        assert {"numeric", "slot_identity"} <= kinds
        if "bad" in pair:
            assert "nonfinite" in kinds


def test_pool_with_several_blocks_a_task(traces):
    with PoolBackend(2, task_bytes=3 * 16 * 128) as b:  # 3 blocks of 16 rows (64 + 64 bytes each) a task
        assert run(traces["train"], traces["bad"], b) == run(traces["train"], traces["bad"])
        assert b.stats.tasks > 0 and len(b.stats.pids) >= 1


def test_pool_summary_file_equals_serial(traces, pool, tmp_path):
    """The per-token metrics a sink writes arrive from the workers in block order."""
    s1, s2 = str(tmp_path / "s1.h5"), str(tmp_path / "s2.h5")
    assert run(traces["train"], traces["bad"], None, summary=s1).replace(s1, "S") == \
        run(traces["train"], traces["bad"], pool, summary=s2).replace(s2, "S")
    with h5py.File(s1, "r") as f1, h5py.File(s2, "r") as f2:
        names = []
        f1.visit(names.append)
        assert names
        for n in names:
            if isinstance(f1[n], h5py.Dataset):
                assert np.array_equal(f1[n][()], f2[n][()], equal_nan=f1[n].dtype.kind == "f"), n


def test_replicas_checked_on_the_pool(tmp_path, pool):
    d = str(tmp_path / "s")
    rec = make_recording("serve", noise=1e-6, seed=2)
    write_ranks(d, rec, dp=2, tp=2, tweak={".dp0.tp1": {("layer4", "s2", 7): np.float32(0.25)}})
    from tensordiff.traceset import TraceSet

    with TraceSet(d) as s:
        serial = s.check_replicas()
        assert [(m.tensor, m.seq, m.position) for m in serial] == [("layer4", "s2", 7)]
        assert pool.check_replicas(s) == serial


def test_backend_choice():
    assert make_backend("serial") is None
    assert make_backend("auto", compared_bytes=1000) is None          # too small to pay for a pool
    big = make_backend("auto", compared_bytes=AUTO_MIN_BYTES)
    assert isinstance(big, PoolBackend) == ((os.cpu_count() or 1) >= 2)
    if big is not None:
        assert big.workers == os.cpu_count()
        big.close()
    assert make_backend("auto", 1, compared_bytes=AUTO_MIN_BYTES) is None  # one worker: nothing to split
    b = make_backend("pool", 3)
    assert isinstance(b, PoolBackend) and b.workers == 3
    b.close()
    with pytest.raises(UsageError, match="--backend must be one of"):
        make_backend("dask")
    with pytest.raises(UsageError, match="--workers must be at least 1"):
        make_backend("pool", 0)


def test_cli_backends_agree(traces, capsys):
    outs = {}
    for backend in ("serial", "pool"):
        code = main(["diff", traces["train"], traces["bad_set"], "--json", "--backend", backend, "--workers", "2"])
        outs[backend] = (code, capsys.readouterr().out)
    assert outs["serial"] == outs["pool"] and outs["serial"][0] == 1
    assert main(["diff", traces["train"], traces["ok"], "--backend", "nope"]) == 2
    assert "--backend" in capsys.readouterr().err


def test_info_and_diff_do_not_import_ray(traces, tmp_path):
    code = ("import sys\n"
            "from tensordiff.cli import main\n"
            f"assert main(['info', {traces['bad_set']!r}]) == 0\n"
            f"assert main(['diff', {traces['train']!r}, {traces['bad_set']!r}, '-q']) == 1\n"
            f"assert main(['diff', {traces['train']!r}, {traces['ok']!r}, '-q', '--backend', 'pool']) == 0\n"
            "print('RAY' if any(m.split('.')[0] == 'ray' for m in sys.modules) else 'NORAY')")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    assert out.strip().endswith("NORAY"), out


def test_a_backend_runs_two_diffs_in_a_row(traces, pool):
    """One backend, two diffs in a row (the TUI re-runs): plans do not leak between them."""
    for pair in (("train", "bad"), ("train", "ok")):
        got = as_json(diff_traces(traces[pair[0]], traces[pair[1]], DiffOptions(block_rows=16, backend=pool)))
        assert got == run(traces[pair[0]], traces[pair[1]])


def test_worker_blocks_are_the_serial_blocks(traces):
    """Every block a worker returns holds the same aligned indices and bit-identical per-token
    metrics as the block the diff computes in-process, for every pair of the plan."""
    from tensordiff.numerics import METRIC_FIELDS

    opts = DiffOptions(block_rows=16)
    with open_pair(traces["train"], traces["bad_set"]) as (a, b):
        plan = plan_diff(a, b, opts)
        serial, pool = SerialBackend(), PoolBackend(1, task_bytes=1)
        try:
            seen = 0
            for backend in (serial, pool):
                backend.start(plan)
            for job in plan.compared:
                local, remote = list(serial.blocks(job)), list(pool.blocks(job))
                assert len(local) == len(remote) >= 1
                for (blk1, m1), (blk2, m2) in zip(local, remote):
                    assert np.array_equal(blk1, blk2)
                    for key in METRIC_FIELDS:
                        x, y = getattr(m1, key), getattr(m2, key)
                        assert x.dtype == y.dtype and np.array_equal(x, y, equal_nan=x.dtype.kind == "f"), key
                    seen += 1
            assert seen > 20
        finally:
            serial.close()
            pool.close()


def test_tasks_follow_the_shards_hosts(tmp_path):
    """Task ranges end where the host holding a block changes, and each task names its host."""
    rec = make_recording("serve", noise=1e-6, seed=1, drift=True)
    sd = str(tmp_path / "set")
    os.makedirs(sd)
    for k, keys in enumerate((rec.keys[:3], rec.keys[3:])):          # 30 and 50 tokens
        write(os.path.join(sd, f"serve.dp{k}.h5"), rec, keys=keys, meta={"ranks": {"dp_rank": k, "dp_size": 2},
                                                                         "host": f"h{k}"})
    a = write(str(tmp_path / "train.h5"), make_recording("train"))

    class Spy(PoolBackend):
        def __init__(self):
            super().__init__(1, task_bytes=1 << 30)   # no byte cap: only hosts cut the ranges
            self.tasks = []

        def submit(self, task):
            self.tasks.append(task)
            return super().submit(task)

    with Spy() as spy:
        assert run(a, sd, spy, block_rows=10) == run(a, sd, None, block_rows=10)
    layer = [t for t in spy.tasks if t.name_b == "layer1"]
    assert [(len(t.blk), t.host) for t in layer] == [(30, "h0"), (50, "h1")]
    assert all(len({s.host for s in t.b}) == 1 for t in layer)


def test_python_dash_m_with_a_pool(traces):
    """`python -m tensordiff` with worker processes (they import the main module again)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    outs = [subprocess.run([sys.executable, "-m", "tensordiff", "diff", traces["train"], traces["bad"], "--json",
                            "--backend", backend, "--workers", "2"], capture_output=True, text=True, env=env, timeout=300)
            for backend in ("serial", "pool")]
    assert outs[0].returncode == outs[1].returncode == 1, outs[1].stderr
    assert outs[0].stdout == outs[1].stdout and outs[1].stderr == ""


def test_a_cancelled_diff_leaves_the_backend_usable(traces, pool):
    """The TUI stops a diff by raising from the progress callback; the next diff is still exact."""
    class Stop(Exception):
        pass

    def stop(stage, done, total):
        if stage == "comparing tensors" and done:
            raise Stop

    with pytest.raises(Stop):
        diff_traces(traces["train"], traces["bad"], DiffOptions(block_rows=16, backend=pool, progress=stop))
    assert run(traces["train"], traces["bad"], pool) == run(traces["train"], traces["bad"])
