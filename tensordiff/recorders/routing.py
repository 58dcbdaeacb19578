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

import numpy as np
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


# -- a trainer's forward: what the experts are handed, and the router's own choice where it was replaced --

def router_own_name(layer: int) -> str:
    """The router's own choice in decoder layer ``layer``, recorded where the experts were handed
    another (a routing replay): same layout and role as ``moe_routing_layer<i>``
    (:mod:`tensordiff.rl.replay` reads it)."""
    return f"{conventions.MOE_ROUTER_OWN}{int(layer)}"


class ExpertRoutingTaps:
    """The routing an MoE's experts are handed in a trainer's forward, which a routing replay
    ("R3": the rollout's expert ids, and its weights, fed to the trainer's experts) makes other
    than its router's own choice. Two taps per MoE layer of an HF model:

    * a forward hook on ``mlp.experts`` (its arguments as it ran: ``(hidden, top_k_index,
      top_k_weights)``, after any pre-hook or a patched gate replaced them) writes
      ``moe_routing_layer<i>``: what the experts used, so the trainer's table is compared with the
      rollout's for what the forward computed;
    * a forward hook on ``mlp.gate`` put ahead of any other (``prepend``: it sees the router's own
      output before a user's replay hook rewrites it) keeps the router's own table; where the
      experts were handed another (ids or weights not bitwise the router's), it is written as
      ``moe_router_own_layer<i>``. A replay is thus seen in the trace, and so is whether its
      weights are the router's own (recomputed) or another's (replayed).

    ``rows``: the current forward's token rows (None outside a forward)."""

    def __init__(self, layers: torch.nn.ModuleList, recorder: Any, rows: Any):
        self.recorder = recorder
        self._rows = rows
        self._own: dict[int, torch.Tensor] = {}
        self.handles: list[Any] = []
        for i, gate in hf_router_modules(layers).items():
            experts = getattr(getattr(layers[i], "mlp", None), "experts", None)
            if not isinstance(experts, torch.nn.Module):
                continue
            self.handles.append(gate.register_forward_hook(self._gate_hook(i), prepend=True))
            self.handles.append(experts.register_forward_hook(self._experts_hook(i, gate), with_kwargs=True))

    @property
    def layers(self) -> int:
        return len(self.handles) // 2

    def _gate_hook(self, layer: int) -> Any:
        def hook(mod: torch.nn.Module, args: Any, output: Any) -> None:
            got = ids_and_weights(output)
            if got is not None:
                self._own[layer] = routing_table(got[0].detach(), got[1].detach())
        return hook

    def _experts_hook(self, layer: int, gate: torch.nn.Module) -> Any:
        def hook(mod: torch.nn.Module, args: Any, kwargs: Any, output: Any) -> None:
            own = self._own.pop(layer, None)
            rows = self._rows()
            got = ids_and_weights(tuple(args) + tuple(kwargs.values()))
            if rows is None or got is None or got[0].shape[0] != np.asarray(rows).size:
                return
            flat = np.asarray(rows).reshape(-1)
            table = routing_table(got[0].detach(), got[1].detach())
            k = table.shape[-1] // 2
            attrs = routing_attrs(layer, k, getattr(gate, "num_experts", None),
                                  f"{type(mod).__name__} input (HF, what the experts were handed)")
            self.recorder.plain(name_of(layer), table, flat, role=conventions.MOE_ROUTING, order=layer + 0.5,
                                attrs=attrs)
            if own is not None and own.shape == table.shape and not torch.equal(own, table):
                self.recorder.plain(router_own_name(layer), own, flat, role=conventions.MOE_ROUTING,
                                    order=layer + 0.5, attrs=routing_attrs(layer, k, getattr(gate, "num_experts", None),
                                                                           f"{type(gate).__name__} output (HF, the "
                                                                           "router's own choice, replaced)"))
        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
