"""Zoom: record the sub-layer taps of one decoder layer (``layer3.attn_norm`` ... ``layer3.mlp_out``,
:mod:`tensordiff.names`) of an HF transformers model, so a diff that names boundary b+1 can name
the op inside layer b. Only that layer's modules are hooked: the cost is bounded by one layer.

The taps are module values mapped by the table of :mod:`tensordiff.names` (through a
:class:`~.hooks.ModuleHookRecorder` that records mapped values only), except ``q_rope`` and
``k_rope``: HF applies the rotary embedding as a function inside attention, not a module, so they
are recomputed from the recorded q and k (after the attention's ``q_norm``/``k_norm`` when it has
them), the ``position_embeddings`` (cos, sin) the model passed to that layer's attention, and the
``apply_rotary_pos_emb`` of the attention class's own modeling module. A port whose bug is in its
cos/sin (theta, scaling) or in its module's ``apply_rotary_pos_emb`` (interleaved vs half) shows
there; one that inlines another rotary inside ``forward`` does not (the recorded attributes say
``recomputed``).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from .. import names as canon
from .core import Recorder
from .hooks import ModuleHookRecorder

__all__ = ["ZoomRecorder"]


class ZoomRecorder:
    """The taps of decoder ``layer`` (0-based, the layer whose input is boundary ``layer``) of
    ``model`` whose decoder layers live at ``layers_path`` (e.g. ``model.layers``)."""

    def __init__(self, model: torch.nn.Module, recorder: Recorder, layer: int, layers_path: str,
                 num_layers: int, rules: Sequence[str | canon.Rule] = ()):
        if not 0 <= layer < num_layers:
            raise ValueError(f"--zoom layer{layer}: the model has decoder layers 0..{num_layers - 1}")
        self.layer = layer
        self.recorder = recorder
        prefix = f"{layers_path}.{layer}"
        self.info = layer_info(model, _get(model, prefix))
        self.hooks = ModuleHookRecorder(model, recorder, [f"{prefix}.*"], capture="both", canonical="hf",
                                        only_mapped=True, attach=False, rules=rules,
                                        define_kwargs=lambda name: {"attrs": dict(self.info)})
        mapped = [q for q in self.hooks.matched
                  if self.hooks.mapping(q, "output") is not None or self.hooks.mapping(q, "input") is not None]
        if not mapped:
            raise ValueError(f"--zoom: no module of {prefix} maps to a tap (not a layout the name table knows); "
                             "name its modules with --name-rule REGEX=TAP")
        self.attn = _get(model, f"{prefix}.self_attn")
        self.order = {t: canon.parse_state(canon.tap_name(layer, t)).order(num_layers) for t in canon.TAPS}
        self.rows: np.ndarray | None = None
        self._pe: Any = None
        self._q: torch.Tensor | None = None
        self._handles: list[Any] = []

    def attach(self) -> ZoomRecorder:
        if self._handles:
            return self
        self.hooks.attach()
        attn = self.attn
        if attn is not None and hasattr(attn, "q_proj") and hasattr(attn, "k_proj") and hasattr(attn, "head_dim"):
            self._handles.append(attn.register_forward_pre_hook(self._attn_pre, with_kwargs=True))
            self._handles.append(attn.q_proj.register_forward_hook(self._q_out))
            self._handles.append(attn.k_proj.register_forward_hook(self._k_out))
        return self

    def detach(self) -> None:
        self.hooks.detach()
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def set_rows(self, rows: np.ndarray | None) -> None:
        self.rows = rows
        self.hooks.set_rows(rows)
        self._pe = None
        self._q = None

    # -- rotary (recomputed: a function, not a module, in HF) -----------------------------

    def _attn_pre(self, mod, args, kwargs):
        self._pe = kwargs.get("position_embeddings")

    def _q_out(self, mod, args, out):
        self._q = out if isinstance(out, torch.Tensor) else None

    def _k_out(self, mod, args, out):
        q, pe, attn = self._q, self._pe, self.attn
        self._q = None
        if self.rows is None or q is None or pe is None or not isinstance(out, torch.Tensor):
            return
        fn = getattr(sys.modules.get(type(attn).__module__), "apply_rotary_pos_emb", None)
        if fn is None:
            return
        hd = int(attn.head_dim)
        lead = q.shape[:-1]
        qv, kv = q.view(*lead, -1, hd), out.view(*lead, -1, hd)
        if hasattr(attn, "q_norm") and hasattr(attn, "k_norm"):
            qv, kv = attn.q_norm(qv), attn.k_norm(kv)
        cos, sin = pe
        with torch.no_grad():
            qr, kr = fn(qv.transpose(1, 2), kv.transpose(1, 2), cos, sin)
        src = f"recomputed: {type(attn).__module__}.apply_rotary_pos_emb on q/k and the layer's position_embeddings"
        for tap, t in (("q_rope", qr), ("k_rope", kr)):
            name = canon.tap_name(self.layer, tap)
            self.recorder.record(name, t.transpose(1, 2).reshape(*lead, -1), self.rows, kind="other", role="tap",
                                 order=self.order[tap], attrs={"layer": self.layer, "tap": tap, "source": src, **self.info})


def layer_info(model: torch.nn.Module, layer: Any) -> dict[str, Any]:
    """What the diff's signatures fit with (:mod:`tensordiff.signatures`), recorded on every tap:
    the attention's heads, kv heads and head size, the norms' eps and the configured rope theta
    (each only where the model says it)."""
    cfg = getattr(model, "config", None)
    cfg = getattr(cfg, "get_text_config", lambda: cfg)() if cfg is not None else None
    attn = getattr(layer, "self_attn", None)
    out: dict[str, Any] = {}
    hd = getattr(attn, "head_dim", None) or getattr(cfg, "head_dim", None)
    heads = getattr(cfg, "num_attention_heads", None)
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    for key, v in (("heads", heads), ("kv_heads", kv), ("head_dim", hd)):
        if isinstance(v, int) and v > 0:
            out[key] = v
    norm = getattr(layer, "input_layernorm", None)
    eps = getattr(norm, "variance_epsilon", None) or getattr(norm, "eps", None)
    if isinstance(eps, float):
        out["eps"] = eps
    rp = getattr(cfg, "rope_parameters", None)
    theta = (rp.get("rope_theta") if isinstance(rp, dict) else None) or getattr(cfg, "rope_theta", None)
    if isinstance(theta, (int, float)):
        out["rope_theta"] = float(theta)
    return out


def _get(obj: Any, path: str) -> Any:
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj
