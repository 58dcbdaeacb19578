"""The SGLang plugin's rank plan names the host that wrote each per-rank file, a trace set's index
reads it from the rank facts, and the Ray backend asks for the node of that host.

The files are written the way the plugin writes them: the name from ``rank_path(path, suffix)``
with the suffix :func:`rank_plan` gives, and the rank facts it returns stored as
``user_meta["ranks"]`` (``startup.setup_target``). The rank plan runs on a fake runner and a fake
``sglang.srt.runtime_context`` (no engine); the Ray backend runs its tasks inline through a fake
``ray`` module (no cluster: the strategy it builds is Ray's own class).
"""

from __future__ import annotations

import json
import socket
import sys
import types
from types import SimpleNamespace

import pytest
from setgen import make_recording, split_dp, write

from tensordiff.cli import jsonable
from tensordiff.diff import DiffOptions, diff_traces
from tensordiff.parallel import PoolBackend, run_numeric_task
from tensordiff.recorders.sglang import rank_path
from tensordiff.recorders.sglang.ranks import rank_plan
from tensordiff.traceset import TraceSet

HOSTS = ("gpu-node-0", "gpu-node-1")
NODES = ("ab" * 28, "cd" * 28)   # Ray node ids: 28 bytes in hex


def _plan(monkeypatch, host: str, *, dp: int = 0, tp: int = 0, dp_size: int = 1, tp_size: int = 1, attn_dp=False):
    par = SimpleNamespace(tp_rank=tp, pp_rank=0, dp_rank=dp, attn_dp_enabled=attn_dp)
    mods = {"sglang": types.ModuleType("sglang"), "sglang.srt": types.ModuleType("sglang.srt"),
            "sglang.srt.runtime_context": types.ModuleType("sglang.srt.runtime_context")}
    mods["sglang.srt.runtime_context"].get_parallel = lambda: par
    for k, v in mods.items():
        monkeypatch.setitem(sys.modules, k, v)
    monkeypatch.setattr(socket, "gethostname", lambda: host)
    runner = SimpleNamespace(server_args=SimpleNamespace(tp_size=tp_size, pp_size=1, dp_size=dp_size))
    return rank_plan(runner)


def test_rank_facts_name_the_host(monkeypatch):
    record, suffix, facts = _plan(monkeypatch, "node-x", dp=1, dp_size=2)
    assert (record, suffix) == (True, ".dp1")
    assert facts["host"] == "node-x" and facts["dp_rank"] == 1 and facts["dp_size"] == 2
    # a TP replica that does not record still says where it runs
    record, suffix, facts = _plan(monkeypatch, "node-y", tp=1, tp_size=2)
    assert not record and facts["host"] == "node-y"
    monkeypatch.undo()
    assert rank_plan(SimpleNamespace(server_args=None))[2]["host"] == socket.gethostname()


@pytest.fixture
def plugin_set(tmp_path, monkeypatch):
    """A DP=2 serve run written as the plugin writes it, DP rank k on HOSTS[k]."""
    rec = make_recording("serve", noise=1e-6, seed=1, drift=True)
    base = str(tmp_path / "set" / "serve.h5")
    (tmp_path / "set").mkdir()
    for k, keys in enumerate(split_dp(rec.keys, 2)):
        record, suffix, facts = _plan(monkeypatch, HOSTS[k], dp=k, dp_size=2)
        assert record
        write(rank_path(base, suffix), rec, keys=keys, meta={"command": "sglang plugin", "ranks": facts})
    monkeypatch.undo()
    train = write(str(tmp_path / "train.h5"), make_recording("train"))
    return train, str(tmp_path / "set")


def test_the_index_reads_the_host_from_the_rank_facts(plugin_set):
    _, d = plugin_set
    with TraceSet(d) as s:
        ix = s.index()
    assert [(f["file"], f["host"]) for f in ix["files"]] == [("serve.dp0.h5", HOSTS[0]), ("serve.dp1.h5", HOSTS[1])]
    assert ix["hosts"] == list(HOSTS)


class _Remote:
    def __init__(self, log: list):
        self.log = log

    def options(self, scheduling_strategy=None):
        self.log.append(scheduling_strategy)
        return self

    def remote(self, task):
        return run_numeric_task(task)


def _offline_ray_backend(nodes: list[dict]):
    from tensordiff.ray_backend import RayBackend, node_table

    class Offline(RayBackend):
        def __init__(self):  # no cluster: tasks run inline, the strategies are recorded
            PoolBackend.__init__(self, 2, task_bytes=1)
            self._ray = SimpleNamespace(get=lambda ref: ref, is_initialized=lambda: False)
            self._owns = False
            self.nodes = node_table(nodes)
            self.strategies: list = []
            self._remote = _Remote(self.strategies)
            self._remote_replica = _Remote(self.strategies)

    return Offline()


def test_the_ray_backend_asks_for_the_node_of_each_shards_host(plugin_set):
    pytest.importorskip("ray")
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    train, d = plugin_set
    nodes = [{"NodeID": NODES[k], "Alive": True, "NodeManagerHostname": h, "Resources": {"CPU": 1}}
             for k, h in enumerate(HOSTS)]
    b = _offline_ray_backend(nodes)
    serial = json.dumps(jsonable(diff_traces(train, d, DiffOptions(block_rows=16)).to_dict()))
    got = json.dumps(jsonable(diff_traces(train, d, DiffOptions(block_rows=16, backend=b)).to_dict()))
    assert got == serial
    assert b.placements and {p.host for p in b.placements} == set(HOSTS)
    assert all(p.node == NODES[HOSTS.index(p.host)] for p in b.placements)
    assert all(isinstance(s, NodeAffinitySchedulingStrategy) and s.soft for s in b.strategies)
    assert {s.node_id for s in b.strategies} == set(NODES)
