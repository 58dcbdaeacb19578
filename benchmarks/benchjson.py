"""The one JSON result every benchmark writes with ``--json FILE`` (read by ``benchmarks/goals.py``).

    from benchjson import Result
    res = Result("bench_x", config={"tokens": n})   # notes the commit and the load at the start
    ...
    res.write(path, figures={"tokens_per_s": 1.2e6, "rss_mb": 210.0})   # adds the load at the end

Each result also names the machine (CPU model, cores, widest vector extension): the figures of a
2-core machine with AVX-512 and of one with AVX2 only are not the same figures, and the project's
machines are drawn from both kinds.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def machine(cpuinfo: str = "/proc/cpuinfo") -> dict[str, Any]:
    """The CPU this process runs on: ``cpu`` (the model name), ``cores`` (those this process may
    use) and ``simd`` (avx512, avx2 or none: what the kernel's vector paths can use)."""
    model, flags = "unknown", set()
    try:
        with open(cpuinfo, errors="replace") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and model == "unknown":
                    model = " ".join(value.split()) or "unknown"
                elif key == "flags" and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    simd = "avx512" if "avx512f" in flags else "avx2" if "avx2" in flags else "none"
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 0
    return {"cpu": model, "cores": cores, "simd": simd}


def machine_text(m: dict[str, Any] | None) -> str:
    """One line for a table's header: ``AMD EPYC, 2 cores, avx2``; ``unknown machine`` for a
    result written before results named their machine."""
    if not m:
        return "unknown machine"
    return f"{m.get('cpu', 'unknown')}, {m.get('cores', '?')} cores, {m.get('simd', '?')}"


class Result:
    def __init__(self, bench: str, config: dict[str, Any]):
        self.bench = bench
        self.config = dict(config)
        self.commit = _git("rev-parse", "--short", "HEAD") or "unknown"
        self.dirty = bool(_git("status", "--porcelain", "--untracked-files=no"))
        self.load_start = os.getloadavg()[0]
        self.machine = machine()

    def write(self, path: str | None, figures: dict[str, float | int | bool | None]) -> None:
        if not path:
            return
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in figures.items()}
        doc = {"bench": self.bench, "commit": self.commit, "dirty": self.dirty,
               "load": [round(self.load_start, 2), round(os.getloadavg()[0], 2)], "machine": self.machine,
               "config": self.config, "figures": clean}
        with open(path, "w") as fh:
            json.dump(doc, fh, indent=1)
