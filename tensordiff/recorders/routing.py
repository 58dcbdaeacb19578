"""MoE routing taps shared by the recorders: the router's top-k expert ids and weights per token.

Each MoE layer's choice is recorded as ``moe_routing_layer<i>`` (role ``moe_routing``, token offset
0; :func:`tensordiff.conventions.moe_routing_name`), one row per token: ``[expert ids (k) | their
weights (k)]``, float64, the k pairs sorted by expert id. The sort makes the row independent of
the order a kernel happens to return its top-k in (HF's DeepSeek router asks ``torch.topk`` for an
unsorted result), so two sides' rows compare element by element. The weights are what the router
hands the experts (after its normalisation; the routed scaling factor is in them where the engine
folds it in there), so :mod:`tensordiff.routing` compares expert sets and reports weights only
where the sets agree.

Where the taps sit:

* HF transformers (:func:`hf_router_modules`): a forward hook on each decoder layer's
  ``mlp.gate`` whose output is ``(router_logits, topk_weights, topk_ids)`` (DeepSeek-V3 and the
  other transformers 5.x routers that return that triple);
* SGLang (:mod:`.sglang.catalog`): a forward hook on each MoE's ``mlp.topk`` module (its
  ``TopKOutput`` holds ``topk_weights`` and ``topk_ids``). A path that calls the top-k op
  without the module (SGLang's flashinfer TRT-LLM bypass on GPUs) is not seen.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import conventions


def routing_table(ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``[T, 2k]`` float64 rows: the k expert ids ascending, then their weights in that order."""
    ids = ids.reshape(ids.shape[0], -1).to(torch.int64)
    weights = weights.reshape(ids.shape[0], -1).to(torch.float64)
    if ids.shape != weights.shape:
        raise ValueError(f"router ids {tuple(ids.shape)} and weights {tuple(weights.shape)} differ in shape")
    order = torch.argsort(ids, dim=-1)
    return torch.cat([torch.gather(ids, -1, order).to(torch.float64), torch.gather(weights, -1, order)], dim=-1)


def routing_attrs(layer: int, k: int, num_experts: int | None, source: str) -> dict[str, Any]:
    return {"layer": int(layer), "k": int(k), "num_experts": None if num_experts is None else int(num_experts),
            "layout": "expert ids ascending [0:k] | their router weights [k:2k]", "source": source}


def ids_and_weights(output: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(topk ids, topk weights) of a router's output: an object with ``topk_ids`` and
    ``topk_weights`` (SGLang's TopKOutput), or a tuple holding one integer tensor and a floating
    tensor of the same shape (HF's ``(router_logits, topk_weights, topk_ids)``). None: neither."""
    ids = getattr(output, "topk_ids", None)
    w = getattr(output, "topk_weights", None)
    if isinstance(ids, torch.Tensor) and isinstance(w, torch.Tensor):
        return ids, w
    if not isinstance(output, (tuple, list)):
        return None
    ints = [t for t in output if isinstance(t, torch.Tensor) and not t.is_floating_point()]
    if len(ints) != 1:
        return None
    floats = [t for t in output if isinstance(t, torch.Tensor) and t.is_floating_point() and t.shape == ints[0].shape]
    return (ints[0], floats[-1]) if floats else None


def hf_router_modules(layers: torch.nn.ModuleList) -> dict[int, torch.nn.Module]:
    """{decoder layer index: its router module} for the layers with an MoE router (``mlp.gate``
    with a ``top_k``: a dense MLP's ``gate_proj`` is not one)."""
    out = {}
    for i, layer in enumerate(layers):
        mlp = getattr(layer, "mlp", None)
        gate = getattr(mlp, "gate", None) if mlp is not None else None
        if isinstance(gate, torch.nn.Module) and getattr(gate, "top_k", None) is not None:
            out[i] = gate
    return out


def name_of(layer: int) -> str:
    return conventions.moe_routing_name(layer)
