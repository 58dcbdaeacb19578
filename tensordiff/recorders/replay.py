"""``tensordiff record serve --replay ROLLOUT.h5``: the sequences a rollout's engine served, to
resubmit to the same engine as prefills (``max_tokens`` 1, prefix cache off), so that every
position the rollout computed in its decode regime is computed again in the prefill regime.

A decode-path bug inside the engine (the prefill and decode paths disagree) then shows as decode vs
prefill, told from a trainer difference (prefill vs trainer) without touching the trainer: the
three-way table of a later triage.

The tokens come from the rollout trace's token table (every position from 0 of every sequence),
or, where the trace does not hold them all (a prefix-cache hit computes no prefix rows,
``--sample-every`` skips rows), from the rollout's ``--outputs`` JSONL given as ``--replay-outputs``,
checked against every row of the trace. The replay trace carries the file attribute
:data:`REPLAY_ATTR` (JSON: :func:`replay_attr`) so that it is known for what it is.

numpy and the trace reader only (no torch, no engine): the command's process reads the rollout
before the engine starts.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import SourceFileError, TraceFileError, UsageError

__all__ = ["ENV_REPLAY", "REPLAY_ATTR", "ReplayPlan", "plan_replay", "replay_attr", "rollout_file", "sampled_from",
           "write_plan_file"]

#: the file attribute of a replay trace (JSON object, see :func:`replay_attr`)
REPLAY_ATTR = "replay"
#: the environment variable that carries it from the command to the engine's recording process
ENV_REPLAY = "TENSORDIFF_REPLAY"


@dataclass
class ReplayPlan:
    """What to resubmit: ``sequences`` [(key, token ids)] in the rollout's order, and where they
    came from."""

    rollout: str
    source: str                                  # "trace" or "outputs"
    sequences: list[tuple[str, list[int]]]
    rollout_rows: int = 0                        # distinct (sequence, position) rows in the rollout
    beyond_rows: int = 0                         # replayed positions the rollout has no row for
    producer: str = ""
    model: dict[str, Any] = field(default_factory=dict)
    sampled_from: dict[str, int] = field(default_factory=dict)  # key -> first position that sampled a token


def rollout_file(path: str) -> str:
    """The rollout trace to read: ``path``, or the first of its per-rank files (``serve.tp0.h5``;
    every rank of a recording holds the same token rows)."""
    if os.path.isfile(path):
        return path
    from .vllm_serve import rank_files

    files = rank_files(path)
    if not files:
        raise UsageError("rollout trace not found", path)
    return files[0]


def _trace_rows(path: str) -> tuple[list[str], dict[str, tuple[np.ndarray, np.ndarray]], str, dict[str, Any], bool]:
    """Per sequence of the rollout: its distinct positions (sorted) and their tokens; the sequence
    order (first row); the producer and model attributes; whether it is itself a replay."""
    import h5py

    from ..trace import TraceReader

    with TraceReader(path) as r:
        side, producer, model = r.side, r.producer, dict(r.model)
        t = r.tokens
        seqs = list(r.sequences)
        seq, pos, tok = (np.asarray(t[c]) for c in ("seq", "position", "token"))
    if side != "serve":
        raise TraceFileError(f"a {side} trace, not a serve rollout: --replay takes the trace `record serve` wrote", path)
    with h5py.File(path, "r", locking=False) as f:  # the reader validated the file; one attribute more
        is_replay = REPLAY_ATTR in f.attrs
    if not len(seq):
        raise TraceFileError("the rollout trace holds no tokens", path)
    order: list[str] = []
    rows: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    _, first = np.unique(seq, return_index=True)
    for s in seq[np.sort(first)]:
        m = seq == s
        p, k = pos[m], tok[m]
        o = np.argsort(p, kind="stable")
        p, k = p[o], k[o]
        key = seqs[int(s)]
        dup = np.diff(p) == 0
        if (k[1:][dup] != k[:-1][dup]).any():
            raise TraceFileError(f"sequence {key} holds two different tokens at one position", path)
        up, i = np.unique(p, return_index=True)
        order.append(key)
        rows[key] = (up, k[i])
    return order, rows, producer, model, is_replay


def plan_replay(rollout: str, outputs: str | None = None) -> ReplayPlan:
    """The sequences to resubmit for ``rollout`` (a serve trace, or the stem of its per-rank files):
    from its token table, or from ``outputs`` (the rollout's ``record serve --outputs`` JSONL)
    checked against it. Bad input raises a :class:`~tensordiff.errors.TensordiffError`."""
    path = rollout_file(rollout)
    order, rows, producer, model, is_replay = _trace_rows(path)
    if is_replay:
        raise TraceFileError("already a replay (its prefill re-run): give the rollout it replayed", path)
    n_rows = sum(len(p) for p, _ in rows.values())
    if outputs is None:
        seqs = []
        for key in order:
            p, k = rows[key]
            if p[0] != 0 or p[-1] != len(p) - 1:
                missing = 0 if p[0] != 0 else int(p[np.flatnonzero(np.diff(p) != 1)[0]] + 1)
                raise TraceFileError(
                    f"sequence {key} has no row at position {missing} (a prefix-cache hit computes no prefix rows; "
                    "--sample-every skips rows): give the rollout's --outputs JSONL with --replay-outputs", path)
            seqs.append((key, [int(x) for x in k]))
        return ReplayPlan(os.path.abspath(path), "trace", seqs, n_rows, 0, producer, model, sampled_from(path))
    from .train_cli import load_serve_sequences

    full = dict(load_serve_sequences(outputs))
    seqs = []
    beyond = 0
    for key in order:
        ids = full.get(key)
        if ids is None:
            raise SourceFileError(f"sequence {key} of the rollout is not in the outputs file: not this rollout's "
                                  "--outputs", outputs)
        p, k = rows[key]
        if int(p[-1]) >= len(ids):
            raise SourceFileError(f"sequence {key}: the rollout has a row at position {int(p[-1])}, the outputs file "
                                  f"holds {len(ids)} tokens: not this rollout's --outputs", outputs)
        got = np.asarray(ids, dtype=np.int64)[p]
        bad = np.flatnonzero(got != k)
        if len(bad):
            i = int(bad[0])
            raise SourceFileError(f"sequence {key} position {int(p[i])}: token {int(k[i])} in the rollout trace, "
                                  f"{int(got[i])} in the outputs file: not this rollout's --outputs", outputs)
        beyond += len(ids) - len(p)
        seqs.append((key, [int(x) for x in ids]))
    return ReplayPlan(os.path.abspath(path), "outputs", seqs, n_rows, beyond, producer, model, sampled_from(path))


def _digest(sequences: list[tuple[str, list[int]]]) -> str:
    """A hash of the replayed tokens (sequence keys and ids), so a triage can tell this replay's
    tokens from another's without reading the rollout."""
    h = hashlib.sha256()
    for key, ids in sequences:
        h.update(key.encode("utf-8") + b"\0")
        h.update(np.asarray(ids, dtype="<i8").tobytes())
    return h.hexdigest()[:16]


def replay_attr(plan: ReplayPlan, engine: str) -> dict[str, Any]:
    """The :data:`REPLAY_ATTR` of the replay trace: the rollout it re-runs (path, producer), where
    its tokens came from, how many sequences and tokens, the settings that make every position a
    prefill (``max_tokens`` 1, prefix cache off) and a digest of the tokens."""
    return {"rollout": plan.rollout, "rollout_producer": plan.producer, "engine": engine,
            "tokens_from": plan.source, "sequences": len(plan.sequences),
            "tokens": sum(len(ids) for _, ids in plan.sequences), "rollout_rows": plan.rollout_rows,
            "positions_beyond_rollout_rows": plan.beyond_rows, "regime": "prefill", "max_tokens": 1,
            "prefix_cache": False, "tokens_sha256_16": _digest(plan.sequences)}


def encode(attr: dict[str, Any]) -> str:
    return json.dumps(attr, sort_keys=True)


def sampled_from(path: str) -> dict[str, int]:
    """Per sequence of a rollout trace, the first position whose row sampled a token: the first
    row of its ``sampled_logprob`` where it has one, else the row before its first decode row
    (the last prompt token's). A sequence that decoded nothing is left out."""
    from ..conventions import SAMPLED_LOGPROB
    from ..trace import TraceReader
    from ..vocab import REGIMES

    out: dict[str, int] = {}
    with TraceReader(path) as r:
        t = r.tokens
        seq, pos = np.asarray(t["seq"]), np.asarray(t["position"], dtype=np.int64)
        if SAMPLED_LOGPROB in r.tensors:
            rows = np.asarray(r.token_rows(SAMPLED_LOGPROB), dtype=np.int64)
            s, p = seq[rows], pos[rows]
        else:
            m = np.asarray(t["regime"]) == REGIMES.index("decode")
            s, p = seq[m], pos[m] - 1
        for k in np.unique(s):
            out[r.sequences[int(k)]] = int(p[s == k].min())
    return out


def write_plan_file(plan: ReplayPlan, engine: str, path: str) -> str:
    """The file the engine's recording process reads (:data:`ENV_REPLAY` names it): the replay
    attribute and the positions the rollout sampled."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"attr": replay_attr(plan, engine), "from": plan.sampled_from}, f)
    return path
