"""Rank plan: every vLLM Worker records, each into its own file.

A run at TP > 1 or PP > 1 writes one file per rank, named with the suffixes a trace set reads
(``trace.dp<r>.pp<s>.tp<t>.h5``, each only where that size is > 1), so that ``tensordiff diff``
and ``info`` read the directory as one trace: PP stages joined (each stage records the boundaries
of its own layers; the aux states, the drafter and the predictions live on the last stage), TP
ranks checked bit for bit against each other (hidden states are replicated across TP ranks: a
difference between them is a finding, never hidden by recording one rank only), DP replicas
united.

The rank facts (``user_meta["ranks"]``) say which rank wrote a file, the host it ran on
(``socket.gethostname()``: the Ray backend places a shard's tasks on its node) and the run
(vLLM's ``instance_id``, one value for every process of one engine): a trace set refuses files
of different runs.
"""

from __future__ import annotations

import socket


def _hostname() -> str | None:
    try:
        return socket.gethostname() or None
    except OSError:
        return None


def rank_plan(runner) -> tuple[bool, str, dict]:
    """(record on this process?, file suffix, rank facts)."""
    vc = getattr(runner, "vllm_config", None)
    pc = getattr(runner, "parallel_config", None) or getattr(vc, "parallel_config", None)
    tp_size = int(getattr(pc, "tensor_parallel_size", 1) or 1)
    pp_size = int(getattr(pc, "pipeline_parallel_size", 1) or 1)
    dp_size = int(getattr(pc, "data_parallel_size", 1) or 1)
    dp = int(getattr(pc, "data_parallel_rank", 0) or 0)
    tp, pp, last_pp = 0, 0, True
    try:
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group
        tp = int(get_tp_group().rank_in_group)
        pp = int(get_pp_group().rank_in_group)
        last_pp = bool(get_pp_group().is_last_rank)
    except Exception:  # noqa: BLE001
        pass
    run = getattr(vc, "instance_id", None)
    facts = {"tp_rank": tp, "tp_size": tp_size, "pp_rank": pp, "pp_size": pp_size, "pp_last_rank": last_pp,
             "dp_rank": dp, "dp_size": dp_size, "replicated": True, "host": _hostname(),
             "run": str(run) if run else None}
    suffix = ""
    if dp_size > 1:
        suffix += f".dp{dp}"
    if pp_size > 1:
        suffix += f".pp{pp}"
    if tp_size > 1:
        suffix += f".tp{tp}"
    return True, suffix, facts
