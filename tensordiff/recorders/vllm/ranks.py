"""Rank plan: which vLLM Worker records, and into which file.

Hidden states are replicated across TP ranks; the aux states and the drafter live on the last
pipeline stage; each DP replica serves its own requests. So TP rank 0 of the last PP stage
records, one file per DP replica (``trace.dp<r>.h5``).
"""

from __future__ import annotations


def rank_plan(runner) -> tuple[bool, str, dict]:
    """(record on this process?, file suffix, rank facts)."""
    pc = getattr(runner, "parallel_config", None) or getattr(runner.vllm_config, "parallel_config", None)
    tp_size = int(getattr(pc, "tensor_parallel_size", 1) or 1)
    pp_size = int(getattr(pc, "pipeline_parallel_size", 1) or 1)
    dp_size = int(getattr(pc, "data_parallel_size", 1) or 1)
    dp = int(getattr(pc, "data_parallel_rank", 0) or 0)
    tp, last_pp = 0, True
    try:
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group
        tp = int(get_tp_group().rank_in_group)
        last_pp = bool(get_pp_group().is_last_rank)
    except Exception:  # noqa: BLE001
        pass
    facts = {"tp_rank": tp, "tp_size": tp_size, "pp_size": pp_size, "pp_last_rank": last_pp,
             "dp_rank": dp, "dp_size": dp_size, "replicated": True}
    # hidden states are replicated across TP ranks; aux states and the drafter live on the last
    # PP stage; each DP replica serves its own requests
    return tp == 0 and last_pp, (f".dp{dp}" if dp_size > 1 else ""), facts
