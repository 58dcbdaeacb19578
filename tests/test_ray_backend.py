"""The Ray backend on a local two-node cluster that this module starts and stops itself: a head
and a second node process on this machine, loopback only, one CPU each, no dashboard. Each shard
is recorded as written by one node (``host``), and each node carries a ``host:NAME`` resource, so
the tasks must ask for soft node affinity to the node holding their rows; the findings must be
exactly the serial diff's."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

import numpy as np
import pytest

from setgen import make_recording, write, write_ranks
from tensordiff.cli import jsonable

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.slow

HOSTS = ("shard-host-0", "shard-host-1")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ray_start(args: list[str], env: dict, log: str) -> subprocess.Popen:
    exe = os.path.join(os.path.dirname(sys.executable), "ray")
    with open(log, "wb") as fh:
        return subprocess.Popen([exe, "start", "--block", *args], env=env, stdout=fh, stderr=subprocess.STDOUT,
                                start_new_session=True)  # its own process group: stopped as one, by id


def _stop(p: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
        if p.poll() is not None:
            break
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            break
        try:
            p.wait(wait)
        except subprocess.TimeoutExpired:
            continue
    # what the raylet started (workers, agents) shares the group: make sure nothing is left
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _wait_started(p: subprocess.Popen, log: str, timeout: float) -> None:
    """Until ``ray start --block`` says its runtime started (the machine may be loaded)."""
    deadline = time.monotonic() + timeout
    while True:
        text = open(log, errors="replace").read() if os.path.exists(log) else ""
        if "Ray runtime started" in text:
            return
        if p.poll() is not None:
            raise RuntimeError(f"ray start exited ({p.returncode}): {text[-2000:]}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"ray start did not finish in {timeout:.0f} s: {text[-2000:]}")
        time.sleep(0.5)


@pytest.fixture(scope="module")
def cluster():
    with local_cluster() as address:
        yield address


@contextlib.contextmanager
def local_cluster(hosts: tuple[str, ...] = HOSTS) -> Iterator[str]:
    """A head and a second node on loopback (node k carries the resource ``host:hosts[k]``),
    connected; both process groups stopped on the way out. Other test modules start it too."""
    tmp = tempfile.mkdtemp(prefix="/tmp/tdray")  # short: Ray's socket paths must fit 107 bytes
    port = _free_port()
    # loopback only: no token authentication (a token file another Ray session left in ~/.ray would
    # otherwise switch the head to token mode and lock the second node out)
    saved = {k: os.environ.get(k) for k in ("RAY_AUTH_MODE", "RAY_USAGE_STATS_ENABLED")}
    os.environ.update(RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    common = ["--node-ip-address", "127.0.0.1", "--num-cpus", "1", "--object-store-memory", str(80 << 20),
              "--disable-usage-stats"]
    procs = []
    try:
        procs.append(_ray_start(["--head", "--port", str(port), "--include-dashboard", "false", "--temp-dir", tmp,
                                 "--resources", json.dumps({f"host:{hosts[0]}": 1}), *common], env,
                                os.path.join(tmp, "head.log")))
        address = f"127.0.0.1:{port}"
        _wait_started(procs[0], os.path.join(tmp, "head.log"), 240)
        procs.append(_ray_start(["--address", address, "--resources", json.dumps({f"host:{hosts[1]}": 1}), *common],
                                env, os.path.join(tmp, "node.log")))
        _wait_started(procs[1], os.path.join(tmp, "node.log"), 240)
        if ray.is_initialized():   # a driver left connected by an earlier test of the same process
            ray.shutdown()
        ray.init(address=address, include_dashboard=False, log_to_driver=False)
        deadline = time.monotonic() + 120
        while len([n for n in ray.nodes() if n["Alive"]]) < 2:
            if time.monotonic() > deadline:
                raise RuntimeError("the second Ray node did not join in 120 s")
            time.sleep(1)
        yield address
    finally:
        if ray.is_initialized():
            ray.shutdown()
        for p in reversed(procs):
            _stop(p)
        shutil.rmtree(tmp, ignore_errors=True)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    d = tmp_path_factory.mktemp("ray")
    train = make_recording("train")
    bad = make_recording("serve", noise=1e-6, seed=1, drift=True, wrong_slot=True)
    out = {"train": write(str(d / "train.h5"), train), "ok": write(str(d / "ok.h5"), make_recording("serve", seed=2))}
    sd = str(d / "bad_set")
    # DP rank k written on shard-host-k
    for k, keys in enumerate((bad.keys[:4], bad.keys[4:])):
        os.makedirs(sd, exist_ok=True)
        write(os.path.join(sd, f"serve.dp{k}.h5"), bad, keys=keys,
              meta={"ranks": {"dp_rank": k, "dp_size": 2}, "host": HOSTS[k]})
    out["bad_set"] = sd
    rep = str(d / "rep_set")
    write_ranks(rep, bad, tp=2, host=HOSTS[1], tweak={".tp1": {("layer1", "s3", 1): np.float32(0.5)}})
    out["rep_set"] = rep
    return out


def _json(res) -> str:
    return json.dumps(jsonable(res.to_dict()))


def test_ray_equals_serial_with_node_affinity(cluster, traces):
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from tensordiff.diff import DiffOptions, diff_traces
    from tensordiff.ray_backend import RayBackend

    b = RayBackend(address=cluster, task_bytes=1)
    try:
        assert b.workers == 2 and set(HOSTS) <= set(b.nodes)
        nodes = {h: b.nodes[h] for h in HOSTS}
        assert nodes[HOSTS[0]] != nodes[HOSTS[1]]
        strat, node = b.strategy(HOSTS[1])
        assert isinstance(strat, NodeAffinitySchedulingStrategy) and strat.soft is True
        assert strat.node_id == nodes[HOSTS[1]] == node
        assert b.strategy("elsewhere") == (None, None) and b.strategy(None) == (None, None)
        for a, bb in (("train", "bad_set"), ("bad_set", "train"), ("train", "ok")):
            b.placements.clear()
            serial = _json(diff_traces(traces[a], traces[bb], DiffOptions(block_rows=16)))
            got = _json(diff_traces(traces[a], traces[bb], DiffOptions(block_rows=16, backend=b)))
            assert got == serial, (a, bb)
            if "bad_set" in (a, bb):
                # every task asked for its shard's node, softly; both nodes were asked for
                assert b.placements and all(p.soft and p.node == nodes[p.host] for p in b.placements)
                assert {p.host for p in b.placements} == set(HOSTS)
            else:
                assert all(p.host is None and p.node is None for p in b.placements)
        assert json.loads(serial)["verdict"] == "agree"
    finally:
        b.close()


def test_ray_replica_check_and_cli(cluster, traces, capsys):
    from tensordiff.cli import main

    serial_code = main(["diff", traces["train"], traces["rep_set"], "--json", "--backend", "serial"])
    serial = capsys.readouterr().out
    code = main(["diff", traces["train"], traces["rep_set"], "--json", "--backend", "ray", "--ray-address", cluster])
    out = capsys.readouterr().out
    assert (code, out) == (serial_code, serial) and code == 1
    kinds = [f["kind"] for f in json.loads(out)["findings"]]
    assert "replica" in kinds
