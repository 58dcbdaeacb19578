"""What ``tensordiff info`` says about a set beyond one trace's summary: which file holds what (the
index) and the index as text lines. The merged trace's sequences and tensors are summarised by
:func:`tensordiff.trace.trace_summary`, as for one file."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from .join import VirtualTensor
from .members import Member
from .paths import AXES


def set_index(members: Sequence[Member], vts: Mapping[str, VirtualTensor], tokens: np.ndarray) -> dict[str, Any]:
    """Which file holds which sequences, tensors, ranks, and the host that wrote it."""
    layout = {a: len({m.ranks[a] for m in members if a in m.ranks}) for a in AXES}
    files = []
    for m in members:
        r = m.reader
        keys = [r.sequences[i] for i in np.unique(r.tokens["seq"])] if len(r.tokens) else []
        files.append({
            "path": m.path, "file": m.name, "ranks": dict(m.ranks), "shard": os.path.basename(m.shard),
            "host": m.host, "bytes": int(r.file_size), "complete": bool(r.complete),
            "token_rows": len(r.tokens), "sequences": len(keys), "sequence_keys": keys[:1000],
            "tensors": sorted(r.tensors, key=lambda n: (r.tensors[n].order, n)),
        })
    replicas = []
    for name, vt in vts.items():
        for rp in vt.replicated:
            replicas.append({"tensor": name, "axis": rp.axis, "primary": members[rp.primary].name,
                             "replica": members[rp.replica].name, "rows": len(rp.rows_primary)})
    distinct = len(np.unique(np.concatenate([m.codes for m in members]))) if len(tokens) else 0
    return {"files": files, "layout": layout, "shards": len({m.shard for m in members}),
            "token_rows": len(tokens), "distinct_tokens": distinct,
            "hosts": sorted({m.host for m in members if m.host}), "replicas": replicas,
            "replica_check": ("every replicated row is compared bit for bit by `tensordiff diff`"
                              if replicas else "no replicated rows")}


def index_lines(index: dict[str, Any]) -> Iterator[str]:
    """The index of a set as plain text lines (``tensordiff info`` prints them after the summary)."""
    lay = index["layout"]
    shape = ", ".join(f"{a.upper()}={n}" for a, n in lay.items() if n) or "no rank suffixes"
    hosts = index["hosts"]
    yield (f"trace set: {len(index['files'])} files, {index['shards']} token shard{'s' if index['shards'] != 1 else ''}"
           f" ({shape}), {index['distinct_tokens']} distinct tokens in {index['token_rows']} token rows; hosts: "
           f"{', '.join(hosts) if hosts else 'not recorded'}")
    for f in index["files"]:
        keys = f["sequence_keys"]
        shown = ", ".join(keys[:3]) + (f" +{f['sequences'] - 3} more" if f["sequences"] > 3 else "")
        tens = f["tensors"]
        tshown = ", ".join(tens[:4]) + (f" +{len(tens) - 4} more" if len(tens) > 4 else "")
        ranks = " ".join(f"{a}{f['ranks'][a]}" for a in AXES if a in f["ranks"]) or "-"
        yield (f"  {f['file']}: ranks {ranks}, host {f['host'] or '-'}, {f['token_rows']} token rows in "
               f"{f['sequences']} sequences ({shown or '-'}); tensors {tshown or '-'}"
               + ("" if f["complete"] else "; NOT closed cleanly"))
    reps = index["replicas"]
    if reps:
        rows = sum(r["rows"] for r in reps)
        yield (f"  replicas: {len(reps)} (tensor, file) pairs, {rows} rows held twice; {index['replica_check']}")
