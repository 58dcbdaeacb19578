"""Which numeric backend ``tensordiff diff --backend NAME`` runs (docs/distributed.md):
``serial`` (the diff's own :class:`~tensordiff.diff.SerialBackend`), ``pool`` (a local process
pool, default sized to the cores: :class:`~tensordiff.parallel.PoolBackend`), ``ray``
(:class:`~tensordiff.ray_backend.RayBackend`, tasks placed on the node that holds each shard;
ray is imported only then), ``auto`` (the default: a pool when the input files hold at least
:data:`AUTO_MIN_BYTES` and there are two cores or more, else serial)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

from .errors import UsageError
from .traceset import trace_paths

if TYPE_CHECKING:
    from .parallel import PoolBackend

BACKENDS = ("auto", "serial", "pool", "ray")
# auto: a pool only when the diff is long against the pool's start-up (its processes and imports;
# docs/distributed.md has the figures): at 4 GiB the start-up is a small share; smaller diffs stay
# in this process
AUTO_MIN_BYTES = 4 << 30


def make_backend(name: str, workers: int | None = None, *, ray_address: str | None = None,
                 compared_bytes: int | None = None) -> PoolBackend | None:
    """The backend ``--backend NAME`` asks for; None means serial (the diff's own loop)."""
    if name not in BACKENDS:
        raise UsageError(f"--backend must be one of {', '.join(BACKENDS)}, got {name!r}")
    if workers is not None and workers < 1:
        raise UsageError(f"--workers must be at least 1, got {workers}")
    if name == "serial":
        return None
    if name == "auto":
        cores = os.cpu_count() or 1
        n = workers or cores
        if n < 2 or (compared_bytes is not None and compared_bytes < AUTO_MIN_BYTES):
            return None
        return _pool(n)
    if name == "pool":
        return _pool(workers)
    from .ray_backend import RayBackend  # imports ray only now

    return RayBackend(workers, address=ray_address)


def _pool(workers: int | None) -> PoolBackend:
    # the pool's module (multiprocessing, concurrent.futures) is imported only for a pool: a
    # serial diff's start-up is a share of its time that a short diff feels
    from .parallel import PoolBackend

    return PoolBackend(workers)


def compared_bytes(paths: Sequence[str]) -> int:
    """What ``auto`` sizes the work by: the bytes of the input files (sets: every member)."""
    total = 0
    for p in paths:
        for f in trace_paths(p):
            try:
                total += os.path.getsize(f)
            except OSError:
                pass
    return total


__all__ = ["AUTO_MIN_BYTES", "BACKENDS", "compared_bytes", "make_backend"]
