"""Weight fingerprints of a live torch model, in the format of :mod:`tensordiff.weights` (the same
keys, hashes, norms and samples a checkpoint on disk gives), so a trainer or an engine can record
what its weights were and ``tensordiff weights`` compares them with a checkpoint or another run.

A tensor-parallel engine holds one shard per rank: fingerprint rank by rank, and compare shards
with shards (the fused splits hold per shard, the hashes are of the shard's bytes).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .. import weights

__all__ = ["model_fingerprints"]

_STORED = {torch.float32: ("float32", np.float32), torch.float16: ("float16", np.float16),
           torch.float64: ("float64", np.float64), torch.bfloat16: ("bfloat16", np.uint16)}


def _stored(t: torch.Tensor) -> tuple[str, np.ndarray]:
    t = t.detach().cpu().contiguous()
    if t.dtype in _STORED:
        name, _ = _STORED[t.dtype]
        if t.dtype == torch.bfloat16:
            return name, t.view(torch.int16).numpy().view(np.uint16)
        return name, t.numpy()
    return str(t.dtype).replace("torch.", ""), t.numpy()


def model_fingerprints(model: torch.nn.Module, source: str = "") -> dict[str, Any]:
    """The fingerprint document (:data:`tensordiff.weights.FINGERPRINT_FORMAT`) of ``model``'s
    parameters and persistent buffers, named as its ``state_dict`` names them."""
    cfg_obj = getattr(model, "config", None)
    cfg_obj = getattr(cfg_obj, "get_text_config", lambda: cfg_obj)() if cfg_obj is not None else None
    config = {k: getattr(cfg_obj, k) for k in ("num_attention_heads", "num_key_value_heads", "num_hidden_layers")
              if cfg_obj is not None and getattr(cfg_obj, k, None) is not None}
    params = []
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if not isinstance(t, torch.Tensor):
                continue
            dtype, arr = _stored(t)
            params.extend(weights.params_of(name, dtype, arr, config))
    return weights.fingerprints_doc(params, config.get("num_hidden_layers"), source or type(model).__name__)
