"""A PEFT (LoRA) trainer's model seen through its adapter wrappers, so its trace lines up with an
engine serving the same model with the adapter merged in (or applied beside its linears).

PEFT wraps the base model twice (``PeftModel.base_model`` is a ``LoraModel`` whose ``model`` is the
HF model) and each adapted linear once (``q_proj`` becomes a ``LoraLayer`` holding the original as
``base_layer`` and the adapter as ``lora_A`` / ``lora_B``). The names therefore read
``base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight`` where a served model says
``model.layers.0.self_attn.q_proj.weight``. :func:`canonical` strips the wrappers;
:func:`unwrap` gives the HF model under them (the decoder is found there); :func:`effective_state`
is the state an engine serving the adapter computes with: each adapted linear's weight merged,
``W + scaling * B @ A`` in float32 (``scaling`` = ``lora_alpha / r``, or ``/ sqrt(r)`` with rsLoRA,
as PEFT applies it), under its canonical name, with what a triage needs to tell how an engine's
copy was merged (:func:`lora_entry`): ``r``, ``alpha``, ``scaling`` and the base weight and the
scaled delta at the fingerprint's sample indices.
"""

from __future__ import annotations

import collections
from typing import Any

import numpy as np
import torch

__all__ = ["canonical", "canonical_module", "effective_state", "is_peft", "lora_entry", "lora_fingerprints", "unwrap"]

_PREFIX = "base_model.model."


def is_peft(model: Any) -> bool:
    return callable(getattr(model, "get_base_model", None)) and hasattr(model, "peft_config")


def unwrap(model: Any) -> Any:
    """The HF model under a PEFT wrapper (the model itself when it is none)."""
    return model.get_base_model() if is_peft(model) else model


def canonical(name: str) -> str | None:
    """A parameter's or module's name as the served model spells it (``base_model.model.`` and
    ``.base_layer`` removed); None for the adapter's own parts (``lora_A``, ``lora_B``, dropout,
    embedding adapters), which a merged model does not have."""
    if name.startswith(_PREFIX):
        name = name[len(_PREFIX):]
    parts = name.split(".")
    if any(p.startswith(("lora_", "lora_dropout")) for p in parts):
        return None
    return ".".join(p for p in parts if p != "base_layer")


def canonical_module(qual: str) -> str | None:
    """A module's name as the served model spells it: :func:`canonical`, and None for a LoRA
    layer's ``base_layer`` (its output lacks the adapter's part; the LoRA layer around it, named
    as the served linear, is the one whose output a served model has)."""
    if qual.endswith(".base_layer") or qual == "base_layer":
        return None
    return canonical(qual)


def _adapted(model: Any) -> dict[str, Any]:
    """{canonical module name: PEFT LoRA layer} for the adapted linears of the active adapter."""
    out = {}
    for name, mod in model.named_modules():
        if hasattr(mod, "base_layer") and hasattr(mod, "lora_A") and hasattr(mod, "scaling"):
            key = canonical(name)
            if key is not None:
                out[key] = mod
    return out


def _delta(mod: Any) -> tuple[torch.Tensor, dict[str, Any]] | None:
    """The active adapter's ``scaling * B @ A`` of a LoRA linear (float32), and its settings."""
    names = [a for a in getattr(mod, "active_adapters", ["default"]) if a in mod.lora_A]
    if len(names) != 1:
        return None
    a = names[0]
    A, B = mod.lora_A[a].weight.detach().float(), mod.lora_B[a].weight.detach().float()
    s = float(mod.scaling[a])
    d = s * (B @ A)
    if getattr(mod, "fan_in_fan_out", False):
        d = d.T
    r = int(mod.r[a])
    alpha = float(mod.lora_alpha[a])
    return d, {"adapter": a, "r": r, "alpha": alpha, "scaling": s, "rslora": bool(getattr(mod, "use_rslora", {}).get(a,
                                                                                                         False))}


def effective_state(model: Any) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]]]:
    """(the state an engine serving the adapter computes with, {canonical parameter name: the
    adapter's settings and float32 delta}) of a PEFT model: canonical names, adapted weights merged
    (in their own dtype, from a float32 sum)."""
    adapted = _adapted(model)
    state: dict[str, torch.Tensor] = {}
    lora: dict[str, dict[str, Any]] = {}
    with torch.no_grad():
        for name, t in model.state_dict().items():
            key = canonical(name)
            if key is None or not isinstance(t, torch.Tensor):
                continue
            mod_name, _, leaf = key.rpartition(".")
            mod = adapted.get(mod_name)
            got = _delta(mod) if mod is not None and leaf == "weight" else None
            if got is not None and tuple(got[0].shape) == tuple(t.shape):
                delta, info = got
                state[key] = (t.detach().float() + delta).to(t.dtype)
                lora[key] = dict(info, base=t.detach().float(), delta=delta)
            else:
                state[key] = t
    return state, lora


def lora_entry(info: dict[str, Any], idx: np.ndarray) -> dict[str, Any]:
    """The fingerprint's ``lora`` entry of an adapted weight: its settings and, at the sample
    indices ``idx`` (flat), the base weight and the scaled delta (float32)."""
    base = info["base"].reshape(-1)[torch.as_tensor(idx, dtype=torch.long)]
    delta = info["delta"].reshape(-1)[torch.as_tensor(idx, dtype=torch.long)]
    return {"r": info["r"], "alpha": info["alpha"], "scaling": info["scaling"], "rslora": info["rslora"],
            "adapter": info["adapter"], "base_samples": [float(x) for x in base],
            "delta_samples": [float(x) for x in delta]}


def lora_fingerprints(model: Any, source: str = "") -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(the fingerprint document of :func:`effective_state`, with a ``lora`` entry on each adapted
    weight (:func:`lora_entry`), and that state): what a PEFT trainer's weights are to an engine
    serving its adapter."""
    from .. import weights
    from .weights_fp import _stored

    base = unwrap(model)
    cfg_obj = getattr(base, "config", None)
    cfg_obj = getattr(cfg_obj, "get_text_config", lambda: cfg_obj)() if cfg_obj is not None else None
    config = {k: getattr(cfg_obj, k) for k in ("num_attention_heads", "num_key_value_heads", "num_hidden_layers")
              if cfg_obj is not None and getattr(cfg_obj, k, None) is not None}
    state, lora = effective_state(model)
    params = []
    for name, t in state.items():
        dtype, arr = _stored(t)
        params.extend(weights.params_of(name, dtype, arr, config))
    doc = weights.fingerprints_doc(params, config.get("num_hidden_layers"), source or type(base).__name__ + "+LoRA")
    split = collections.Counter(str(e.get("name")) for e in doc["parameters"])
    for e in doc["parameters"]:
        info = lora.get(str(e.get("name")))
        if info is not None and split[str(e.get("name"))] == 1:   # a fused weight split by heads: not sampled whole
            e["lora"] = lora_entry(info, np.array([i for i, _ in e["samples"]], dtype=np.int64))
    return doc, state
