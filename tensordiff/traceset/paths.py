"""Trace-set paths: which files a spec names, and the ranks a member's file name gives."""

from __future__ import annotations

import glob
import os
import re

from ..errors import UsageError

TRACE_EXTENSIONS = (".h5", ".hdf5")
AXES = ("dp", "pp", "tp")
_SUFFIX = re.compile(r"\.(dp|pp|tp)(\d{1,6})$")
_GLOB_CHARS = re.compile(r"[*?\[]")


def is_set_spec(spec: str) -> bool:
    """Whether ``spec`` names a trace set (a directory or a glob pattern), not one file."""
    spec = os.fspath(spec)
    return os.path.isdir(spec) or (not os.path.exists(spec) and bool(_GLOB_CHARS.search(spec)))


def set_paths(spec: str) -> list[str]:
    """The member files of a set spec, sorted; one line of error when there are none."""
    spec = os.fspath(spec)
    if os.path.isdir(spec):
        paths = [os.path.join(spec, n) for n in os.listdir(spec)
                 if n.lower().endswith(TRACE_EXTENSIONS) and os.path.isfile(os.path.join(spec, n))]
        top = os.path.realpath(spec)
        for p in paths:  # never follow a link out of the input
            if os.path.islink(p) and os.path.dirname(os.path.realpath(p)) != top:
                raise UsageError(f"{os.path.basename(p)} is a symbolic link out of the set's directory; "
                                 "copy the file in, or name it on its own", spec)
        if not paths:
            raise UsageError("no trace files (*.h5, *.hdf5) in this directory (empty trace set)", spec)
    else:
        paths = [p for p in glob.glob(spec) if os.path.isfile(p)]
        if not paths:
            raise UsageError("no such file or directory, and no file matches it as a pattern (empty trace set)", spec)
    return sorted(paths, key=member_sort_key)


def trace_paths(spec: str) -> list[str]:
    """Every file a trace spec stands for: the file itself, or the members of a set (for the probe)."""
    return set_paths(spec) if is_set_spec(spec) else [os.fspath(spec)]


def parse_ranks(path: str) -> tuple[str, dict[str, int]]:
    """``d/serve.dp1.pp0.tp1.h5`` -> (``d/serve``, {dp: 1, pp: 0, tp: 1}); the suffixes in any order."""
    root, ext = os.path.splitext(path)
    if ext.lower() not in TRACE_EXTENSIONS:
        root = path
    ranks: dict[str, int] = {}
    while True:
        m = _SUFFIX.search(root)
        if m is None:
            break
        axis = m.group(1)
        if axis in ranks:
            raise UsageError(f"the file name gives the {axis.upper()} rank twice", path)
        ranks[axis] = int(m.group(2))
        root = root[:m.start()]
    return root, ranks


def member_sort_key(path: str) -> tuple[str, int, int, int]:
    """Members in (base name, DP, PP, TP rank) order; a name with a doubled suffix sorts by its path."""
    try:
        base, ranks = parse_ranks(path)
    except UsageError:
        base, ranks = path, {}
    return (base, ranks.get("dp", -1), ranks.get("pp", -1), ranks.get("tp", -1))
