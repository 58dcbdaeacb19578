"""The one JSON result every benchmark writes with ``--json FILE`` (read by ``benchmarks/goals.py``).

    from benchjson import Result
    res = Result("bench_x", config={"tokens": n})   # notes the commit and the load at the start
    ...
    res.write(path, figures={"tokens_per_s": 1.2e6, "rss_mb": 210.0})   # adds the load at the end
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


class Result:
    def __init__(self, bench: str, config: dict[str, Any]):
        self.bench = bench
        self.config = dict(config)
        self.commit = _git("rev-parse", "--short", "HEAD") or "unknown"
        self.dirty = bool(_git("status", "--porcelain", "--untracked-files=no"))
        self.load_start = os.getloadavg()[0]

    def write(self, path: str | None, figures: dict[str, float | int | bool | None]) -> None:
        if not path:
            return
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in figures.items()}
        doc = {"bench": self.bench, "commit": self.commit, "dirty": self.dirty,
               "load": [round(self.load_start, 2), round(os.getloadavg()[0], 2)],
               "config": self.config, "figures": clean}
        with open(path, "w") as fh:
            json.dump(doc, fh, indent=1)
