"""Rank plan: which process of a parallel server records, and into which file.

Every rank records its own file (``trace.tp<r>.h5`` where TP > 1): hidden states are replicated
across TP ranks, and a trace set checks the replicas bit for bit; with DP attention or context
parallelism each rank holds its own rows. The rank facts name the host that wrote the file
(``socket.gethostname()``): a trace set's index reads it, and the Ray backend places each task on
the node that holds its shard (:mod:`tensordiff.traceset`, :mod:`tensordiff.ray_backend`).
"""

from __future__ import annotations

import socket


def server_arg(runner, name: str, default=None):
    return getattr(getattr(runner, "server_args", None), name, default)


def _hostname() -> str | None:
    try:
        return socket.gethostname() or None
    except OSError:
        return None


def rank_plan(runner) -> tuple[bool, str, dict]:
    """(record on this process?, file suffix, rank facts)."""
    try:
        from sglang.srt.runtime_context import get_parallel
        par = get_parallel()
    except Exception:  # noqa: BLE001
        par = None

    def rank(name: str) -> int:
        try:
            v = getattr(par, name)
            return int(v) if v is not None else 0
        except Exception:  # noqa: BLE001
            return 0

    tp_size = int(server_arg(runner, "tp_size", 1) or 1)
    pp_size = int(server_arg(runner, "pp_size", 1) or 1)
    dp_size = int(server_arg(runner, "dp_size", 1) or 1)
    tp, pp, dp = rank("tp_rank"), rank("pp_rank"), rank("dp_rank")
    try:
        attn_dp = bool(getattr(par, "attn_dp_enabled", False))
    except Exception:  # noqa: BLE001
        attn_dp = False
    cp = 1
    for name in ("attn_cp_size", "context_parallel_size", "cp_size"):
        v = server_arg(runner, name, None)
        if isinstance(v, int) and v > 1:
            cp = v
    replicated = not attn_dp and cp == 1
    facts = {"tp_rank": tp, "tp_size": tp_size, "pp_rank": pp, "pp_size": pp_size, "dp_rank": dp,
             "dp_size": dp_size, "replicated": replicated, "host": _hostname()}
    suffix = ""
    if dp_size > 1 and not attn_dp:
        suffix += f".dp{dp}"
    if pp_size > 1:
        suffix += f".pp{pp}"
    # every TP rank records its own file: replicated ranks are compared bit for bit by the trace
    # set (a difference between them is a finding), DP-attention ranks hold their own tokens
    return True, suffix + (f".tp{tp}" if tp_size > 1 else ""), facts
