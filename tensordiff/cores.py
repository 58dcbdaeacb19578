"""How many cores this process may use (its CPU affinity, not the machine's count: a container or
``taskset`` gives it fewer), for the threads that overlap reads with compute."""

from __future__ import annotations

import os


def usable_cores() -> int:
    """The cores this process may run on (at least 1)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


__all__ = ["usable_cores"]
