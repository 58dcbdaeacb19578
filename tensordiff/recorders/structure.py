"""Where a causal LM keeps its decoder layers and final norm.

Its own module so that every recorder (the HF extractor, the zoom taps, the engine plugins) can
find the decoder without importing the others.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["find_decoder", "get_path"]

_LAYER_PATHS = ("model.layers", "model.decoder.layers", "transformer.h", "gpt_neox.layers",
                "model.language_model.layers", "layers", "transformer.layers", "decoder.layers")
_NORM_NAMES = ("norm", "final_layernorm", "ln_f", "final_norm", "norm_f")


def get_path(obj: Any, path: str) -> Any:
    """``obj.a.b.c`` for ``path`` ``a.b.c``; None where a part is missing."""
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def find_decoder(model: torch.nn.Module) -> tuple[torch.nn.ModuleList, torch.nn.Module, str]:
    """(decoder layers, final norm, dotted path of the layers) of a causal LM (under its PEFT
    adapter wrappers, where it has them)."""
    from .peft_names import unwrap

    model = unwrap(model)
    for path in _LAYER_PATHS:
        layers = get_path(model, path)
        if isinstance(layers, torch.nn.ModuleList) and len(layers):
            parent = get_path(model, path.rsplit(".", 1)[0]) if "." in path else model
            for nn_name in _NORM_NAMES:
                norm = getattr(parent, nn_name, None)
                if isinstance(norm, torch.nn.Module):
                    return layers, norm, path
            raise ValueError(f"found decoder layers at {path} but no final norm beside them")
    raise ValueError(f"cannot find the decoder layers of {type(model).__name__} (looked at {', '.join(_LAYER_PATHS)})")
