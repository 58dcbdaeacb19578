"""Pure-torch stand-in for the CPU build of ``sgl_kernel`` -- TEST INFRASTRUCTURE ONLY.

This package is test infrastructure. It stands in for the CPU build of
``sgl_kernel`` (SGLang's native kernel library), which PyPI does not ship: the
``sglang-kernel`` wheels on PyPI are CUDA builds that fail to import without
libcuda. It is NOT used in production and must never be installed into a real
serving environment; tensordiff does not import it.

Real SGLang 0.5.23 imports a handful of ``*_cpu`` ops from ``sgl_kernel`` at
module level when it runs with ``device="cpu"``, so the test suite puts
``tests/sgl_kernel_stub`` on ``sys.path`` / ``PYTHONPATH`` (the variable also
reaches SGLang's spawned scheduler process) to let the real engine start on a
CPU-only machine.

Every op here is written from the semantics of SGLang's own reference kernels
(the triton / torch versions under ``sglang/kernels/ops/`` and their callers),
in plain torch with Python loops: correct for tiny test batches, slow for
anything else.

Provided:

* plain forward: ``assign_req_to_token_pool_cpu``, ``copy_all_layer_kv_cache_cpu``
* speculative decoding: ``fill_bonus_tokens_cpu``, ``fill_accept_out_cache_loc_cpu``,
  ``assign_draft_cache_locs_contiguous_cpu``, ``assign_extend_cache_locs_cpu``,
  ``build_tree_kernel_efficient_cpu``, ``verify_tree_greedy_cpu``,
  ``rotate_input_ids_cpu``
* the ``intel_amx`` attention backend (used for EAGLE on CPU), registered with
  ``torch.library`` so that ``torch.ops.sgl_kernel.<name>`` resolves:
  ``decode_attention_cpu``, ``extend_attention_cpu``,
  ``build_draft_decode_metadata_cpu``; the attention ops also in the shapes DeepSeek's MLA gives
  them (a latent cache row with V a view of its first columns; MHA prefill with per-head K/V of
  another head size than the cache)

Not provided: the AMX ops (``convert_weight_packed``, ``weight_packed_linear``,
``fused_experts_cpu``, the ``*_topk_cpu`` routers, ...). Without ``convert_weight_packed`` SGLang
takes its native torch paths for linears and MoE.
"""

from __future__ import annotations

from ._attention import decode_attention_cpu as _decode_attention_impl
from ._attention import extend_attention_cpu as _extend_attention_impl
from ._memory import (
    assign_extend_cache_locs_cpu,
    assign_req_to_token_pool_cpu,
    build_draft_decode_metadata_cpu as _build_draft_decode_metadata_impl,
    copy_all_layer_kv_cache_cpu,
    assign_draft_cache_locs_contiguous_cpu,
)
from ._registry import register_ops as _register_ops
from ._speculative import (
    build_tree_kernel_efficient_cpu,
    fill_accept_out_cache_loc_cpu,
    fill_bonus_tokens_cpu,
    rotate_input_ids_cpu,
    verify_tree_greedy_cpu,
)

IS_TEST_STUB = True
__version__ = "0.0.0+tensordiff.test.stub"

_register_ops(
    decode_attention=_decode_attention_impl,
    extend_attention=_extend_attention_impl,
    build_draft_decode_metadata=_build_draft_decode_metadata_impl,
)


def build_draft_decode_metadata_cpu(
    req_to_token, req_pool_indices, seq_lens, topk, num_steps, pool_len
):
    """Python entry point; dispatches through ``torch.ops.sgl_kernel``."""
    import torch

    return torch.ops.sgl_kernel.build_draft_decode_metadata_cpu(
        req_to_token, req_pool_indices, seq_lens, int(topk), int(num_steps), int(pool_len)
    )


__all__ = [
    "IS_TEST_STUB",
    "assign_draft_cache_locs_contiguous_cpu",
    "assign_extend_cache_locs_cpu",
    "assign_req_to_token_pool_cpu",
    "build_draft_decode_metadata_cpu",
    "build_tree_kernel_efficient_cpu",
    "copy_all_layer_kv_cache_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
    "rotate_input_ids_cpu",
    "verify_tree_greedy_cpu",
]
