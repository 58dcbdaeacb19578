"""The Ray backend (``tensordiff diff --backend ray``; extra ``tensordiff[ray]``).

Each numeric task of :mod:`tensordiff.parallel` becomes a Ray task that is asked to run on the
node holding most of its rows: the host a trace set's index records for each shard is matched
against the cluster's nodes (hostname or IP) and the task gets a soft
``NodeAffinitySchedulingStrategy`` for that node (soft: a busy or lost node does not stall the
diff; the task then runs elsewhere and reads the file over whatever the path reaches). Tasks
whose host is unknown are scheduled by Ray as it likes. The coordinator keeps the plan and merges
the partial results exactly as the pool backend does.

``ray`` is imported when this backend is built, never by ``tensordiff info`` or ``diff`` with
another backend. Every node must have tensordiff installed and see the trace files at the same
paths (docs/distributed.md).
"""

from __future__ import annotations

import os
from typing import Any

from .errors import UsageError
from .parallel import TASK_BYTES, NumericTask, Placement, PoolBackend, run_numeric_task, run_replica_task
from .trace import ReplicaTask


class _RayFuture:
    def __init__(self, ray: Any, ref: Any):
        self._ray, self.ref = ray, ref

    def result(self) -> Any:
        return self._ray.get(self.ref)

    def cancel(self) -> None:
        try:
            self._ray.cancel(self.ref)
        except Exception:  # noqa: BLE001 - finished or gone: nothing to cancel
            pass


HOST_RESOURCE = "host:"  # a node started with --resources '{"host:NAME": 1}' holds NAME's shards


def node_table(nodes: list[dict[str, Any]]) -> dict[str, str]:
    """host -> node id over the alive nodes: a ``host:NAME`` custom resource first (for clusters
    whose hostnames are not the ones recorded, e.g. containers), then the hostname and IP (the
    first node, by id, wins a name several nodes share)."""
    out: dict[str, str] = {}
    alive = sorted((n for n in nodes if n.get("Alive", n.get("alive", False))), key=lambda n: str(n.get("NodeID")))
    for n in alive:
        for res in n.get("Resources", {}) or {}:
            if isinstance(res, str) and res.startswith(HOST_RESOURCE) and len(res) > len(HOST_RESOURCE):
                out.setdefault(res[len(HOST_RESOURCE):], str(n["NodeID"]))
    for n in alive:
        for key in ("NodeManagerHostname", "NodeManagerAddress", "NodeName"):
            v = n.get(key)
            if isinstance(v, str) and v:
                out.setdefault(v, str(n["NodeID"]))
    return out


class RayBackend(PoolBackend):
    """Numeric tasks on a Ray cluster (``address``: ``auto``, ``host:port``, or None for a local one)."""

    name = "ray"

    def __init__(self, workers: int | None = None, *, address: str | None = None, task_bytes: int = TASK_BYTES,
                 init_kwargs: dict[str, Any] | None = None):
        try:
            import ray
        except ImportError:
            raise UsageError("--backend ray needs Ray: pip install 'tensordiff[ray]'") from None
        self._ray = ray
        self._owns = False
        if not ray.is_initialized():
            kw: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False}
            kw.update(init_kwargs or {})
            try:
                ray.init(address=address or os.environ.get("RAY_ADDRESS") or None, **kw)
            except (ConnectionError, ValueError, RuntimeError) as e:
                raise UsageError(f"cannot reach the Ray cluster at {address or 'a new local one'}: "
                                 f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
            self._owns = True
        cpus = int(ray.cluster_resources().get("CPU", 1) or 1)  # type: ignore[no-untyped-call, unused-ignore]
        super().__init__(workers or max(1, cpus), task_bytes=task_bytes)
        self.nodes = node_table(ray.nodes())  # type: ignore[no-untyped-call, unused-ignore]
        self._remote = ray.remote(num_cpus=1, max_retries=0)(run_numeric_task)
        self._remote_replica = ray.remote(num_cpus=1, max_retries=0)(run_replica_task)

    def strategy(self, host: str | None) -> tuple[Any, str | None]:
        """The scheduling strategy for a task whose rows live on ``host``: soft node affinity to
        that host's node, or None (Ray's default) when the host is unknown or not in the cluster."""
        node = self.nodes.get(host) if host else None
        if node is None:
            return None, None
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        return NodeAffinitySchedulingStrategy(node_id=node, soft=True), node

    def _options(self, remote: Any, host: str | None, pair: int, chunk: int) -> Any:
        strat, node = self.strategy(host)
        self.placements.append(Placement(pair, chunk, host, node, True))
        return remote.options(scheduling_strategy=strat) if strat is not None else remote

    def submit(self, task: NumericTask) -> _RayFuture:
        return _RayFuture(self._ray, self._options(self._remote, task.host, task.pair, task.chunk).remote(task))

    def submit_replica(self, task: ReplicaTask) -> _RayFuture:
        host = task.host
        return _RayFuture(self._ray, self._options(self._remote_replica, host, -1, -1).remote(task))

    def close(self) -> None:
        super().close()
        if self._owns and self._ray.is_initialized():
            self._ray.shutdown()
            self._owns = False
