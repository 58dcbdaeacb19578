"""Registers the stand-in ops under ``torch.ops.sgl_kernel`` (test stand-in).

Only ops that SGLang reaches through ``torch.ops.sgl_kernel.<name>`` need
this; the rest are imported as plain Python functions.
"""

from __future__ import annotations

import torch

_SCHEMAS = {
    "decode_attention_cpu": (
        "decode_attention_cpu(Tensor query, Tensor(a!) k_cache, Tensor(b!) v_cache, "
        "float k_scale, float v_scale, Tensor(c!) output, Tensor? key, Tensor? value, "
        "Tensor loc, Tensor(d!) attn_logits, Tensor req_to_token, "
        "Tensor req_pool_indices, Tensor seq_lens, float sm_scale, float logit_cap, "
        "bool is_cross_attention, int sliding_window, Tensor? encoder_lens, "
        "Tensor? sinks) -> ()"
    ),
    "extend_attention_cpu": (
        "extend_attention_cpu(Tensor q_extend, Tensor? k_extend, Tensor? v_extend, "
        "Tensor(a!) o_extend, Tensor k_buffer, Tensor v_buffer, float k_scale, "
        "float v_scale, Tensor req_to_token, Tensor req_pool_indices, "
        "Tensor seq_lens, Tensor extend_seq_lens, Tensor extend_start_loc, "
        "int max_len_extend, float sm_scale, float logit_cap, "
        "bool is_cross_attention, int sliding_window, Tensor? encoder_lens, "
        "Tensor? sinks, Tensor? tree_mask, bool is_causal) -> ()"
    ),
    "build_draft_decode_metadata_cpu": (
        "build_draft_decode_metadata_cpu(Tensor req_to_token, "
        "Tensor req_pool_indices, Tensor seq_lens, int topk, int num_steps, "
        "int pool_len) -> Tensor"
    ),
}

_LIB = None  # keep the Library alive for the life of the process


def _already_defined(name: str) -> bool:
    try:
        getattr(torch.ops.sgl_kernel, name)
        return True
    except (AttributeError, RuntimeError):
        return False


def register_ops(*, decode_attention, extend_attention, build_draft_decode_metadata) -> None:
    global _LIB
    impls = {
        "decode_attention_cpu": decode_attention,
        "extend_attention_cpu": extend_attention,
        "build_draft_decode_metadata_cpu": build_draft_decode_metadata,
    }
    missing = [name for name in _SCHEMAS if not _already_defined(name)]
    if not missing:
        return
    if _LIB is None:
        _LIB = torch.library.Library("sgl_kernel", "FRAGMENT")
    for name in missing:
        _LIB.define(_SCHEMAS[name])
        _LIB.impl(name, impls[name], "CPU")
