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
from .structure import find_decoder, get_path

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
        self.info = layer_info(model, get_path(model, prefix))
        self.hooks = ModuleHookRecorder(model, recorder, [f"{prefix}.*"], capture="both", canonical="hf",
                                        only_mapped=True, attach=False, rules=rules,
                                        define_kwargs=lambda name: {"attrs": dict(self.info)})
        mapped = [q for q in self.hooks.matched
                  if self.hooks.mapping(q, "output") is not None or self.hooks.mapping(q, "input") is not None]
        if not mapped:
            raise ValueError(f"--zoom: no module of {prefix} maps to a tap (not a layout the name table knows); "
                             "name its modules with --name-rule REGEX=TAP")
        self.attn = get_path(model, f"{prefix}.self_attn")
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


# ----------------------------------------------------------------------------------------------
# Graft: one state replaced by another trace's recorded values during the forward
# ----------------------------------------------------------------------------------------------


class Graft:
    """``--graft OTHER.h5:STATE``: during the forward of each sequence, the module value that is
    STATE (a boundary ``embed``/``layer<b>``/``final_norm`` or a tap of the name table) is replaced
    by OTHER's recorded full values of STATE at the same sequence and positions, so whatever runs
    after it starts from the other side's state. The sequence's tokens must equal OTHER's.

    ``q_rope``/``k_rope`` are not modules in HF (the rotary is a function inside attention) and
    cannot be grafted; a fused or split value neither."""

    def __init__(self, model: torch.nn.Module, spec: str, layers_path: str, num_layers: int):
        from .graft_source import open_graft_source

        st = canon.maybe_state(spec.rpartition(":")[2])
        if st is not None and st.kind == "tap" and st.tap in ("q_rope", "k_rope"):
            raise ValueError(f"--graft {st.name}: the rotary is a function inside HF's attention, not a module: "
                             f"graft layer{st.layer}.q/k or a boundary")
        src = open_graft_source(spec, "--graft")
        self.reader = src.reader
        self.path, self.state, self.layer, self.index = src.path, src.state, src.st, src.index
        try:
            self.module, self.direction = _graft_site(model, st or src.st, layers_path, num_layers)
        except ValueError:
            src.close()
            raise
        self.key: str | None = None
        self.ids: list[int] = []
        self.grafted = 0
        self._handle: Any = None

    def attach(self) -> Graft:
        if self.direction == "input":
            self._handle = self.module.register_forward_pre_hook(self._pre)
        else:
            self._handle = self.module.register_forward_hook(self._post)
        return self

    def close(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        self.reader.close()

    def set_sequence(self, key: str, ids: Sequence[int]) -> None:
        self.key, self.ids = key, [int(x) for x in ids]

    def _values(self, like: torch.Tensor) -> torch.Tensor:
        rows = []
        for p, t in enumerate(self.ids):
            got = self.index.get((str(self.key), p))
            if got is None:
                raise ValueError(f"--graft: {self.path} has no row of {self.state} for sequence {self.key} position {p}")
            if got[1] != t:
                raise ValueError(f"--graft: {self.path} has token {got[1]} at sequence {self.key} position {p}, "
                                 f"this run {t}: not the same tokens")
            rows.append(got[0])
        v = self.reader.read_values_at(self.state, np.asarray(rows, dtype=np.int64))
        if like.shape[-1] != v.shape[-1] or like.numel() != v.size:
            raise ValueError(f"--graft: {self.state} is {tuple(like.shape)} here and [{v.shape[0]}, {v.shape[1]}] "
                             f"in {self.path}")
        self.grafted += len(rows)
        return torch.from_numpy(np.ascontiguousarray(v)).to(device=like.device, dtype=like.dtype).reshape(like.shape)

    def _post(self, mod: Any, args: Any, out: Any) -> Any:
        if self.key is None:
            return None
        if isinstance(out, torch.Tensor):
            return self._values(out)
        if isinstance(out, tuple) and out and isinstance(out[0], torch.Tensor):
            return (self._values(out[0]), *out[1:])
        return None

    def _pre(self, mod: Any, args: Any) -> Any:
        if self.key is None or not args or not isinstance(args[0], torch.Tensor):
            return None
        return (self._values(args[0]), *args[1:])


def _graft_site(model: torch.nn.Module, st: canon.State, layers_path: str, num_layers: int) -> tuple[Any, str]:
    """The module (and which of its values) that is state ``st`` in an HF decoder model."""
    if st.kind == "boundary" and st.layer == 0:
        emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        if emb is None:
            raise ValueError("--graft embed: the model has no input embedding module")
        return emb, "output"
    if st.kind == "boundary":
        assert st.layer is not None
        if not 1 <= st.layer <= num_layers:
            raise ValueError(f"--graft layer{st.layer}: the model has boundaries layer1..layer{num_layers}")
        return get_path(model, f"{layers_path}.{st.layer - 1}"), "output"
    wanted = st.name
    for path, mod in model.named_modules():
        if st.kind == "final_norm" and path.endswith("norm") and "layers" not in path:
            m = canon.canonical(path, "output", "hf", num_layers)
            if m is not None and m.names == (wanted,):
                return mod, "output"
        if st.kind == "tap" and path.startswith(f"{layers_path}.{st.layer}."):
            for direction in ("output", "input"):
                m = canon.canonical(path, direction, "hf", num_layers)
                if m is not None and m.names == (wanted,) and m.split is None:
                    return mod, direction
    raise ValueError(f"--graft {wanted}: no module of this model is {wanted} (not a layout the name table knows)")


# ----------------------------------------------------------------------------------------------
# Engine zoom: the hooks both serving plugins install (TENSORDIFF_ZOOM)
# ----------------------------------------------------------------------------------------------


def engine_zoom_layer(model: Any, layer: int, declared_layers: Any, warn: Any) -> tuple[Any, str, int] | None:
    """The decoder layers of an engine's model, their path and count, for a zoom into ``layer``
    (``declared_layers``: the count the engine states, else the decoder's); None, after one
    ``warn(key, message)``, when the model has no decoder the name table knows or no such layer."""
    try:
        layers, _, path = find_decoder(model)
    except ValueError as e:
        warn("zoom", f"no zoom taps: {e}")
        return None
    n = int(declared_layers or len(layers))
    if not 0 <= layer < n:
        warn("zoom", f"no zoom taps: TENSORDIFF_ZOOM=layer{layer} but the model has layers 0..{n - 1}")
        return None
    return layers, path, n


def install_engine_taps(model: torch.nn.Module, layers: Any, layers_path: str, layer: int, num_layers: int,
                        impl: str, config: dict[str, Any], tap: Any, handles: list[Any], recording: Any,
                        warn: Any) -> int:
    """Hooks on decoder ``layer``'s modules of an engine model (``impl``: ``sglang`` or ``vllm``)
    that the name table maps to taps; each value (split by the table's layout with the shard's
    ``config``) goes to ``tap(name, tensor)`` while ``recording()`` holds. Returns how many hooks.

    The engines share one rotary module between the layers (named once, under layer 0): every
    module is walked under every path it has, and the hooks record only while this layer runs."""
    inside = [False]

    def enter(module: Any, args: Any) -> None:
        inside[0] = True

    def leave(module: Any, args: Any, output: Any) -> None:
        inside[0] = False

    handles.append(layers[layer].register_forward_pre_hook(enter))
    handles.append(layers[layer].register_forward_hook(leave))
    prefix = f"{layers_path}.{layer}."
    count = 0
    hooked: set[tuple[int, str]] = set()
    for name, mod in model.named_modules(remove_duplicate=False):
        if not name.startswith(prefix):
            continue
        for direction in ("output", "input"):
            m = canon.canonical(name, direction, impl, num_layers)
            if m is None or any(canon.parse_state(x).kind != "tap" for x in m.names) or (id(mod), direction) in hooked:
                continue
            hooked.add((id(mod), direction))
            hook = _engine_hook(m.names, m.split, config, direction, inside, tap, recording, warn)
            if direction == "output":
                handles.append(mod.register_forward_hook(hook))
            else:
                handles.append(mod.register_forward_pre_hook(hook))
            count += 1
    return count


def _engine_hook(names: tuple[str, ...], split: str | None, config: dict[str, Any], direction: str,
                 inside: list[bool], tap: Any, recording: Any, warn: Any) -> Any:
    def parts(value: Any) -> list[torch.Tensor]:
        if split == "tuple":   # a rotary module's (q, k)
            ts = [v for v in value if isinstance(v, torch.Tensor)] if isinstance(value, (tuple, list)) else []
            return ts[: len(names)] if len(ts) >= len(names) else []
        t = value
        while isinstance(t, (tuple, list)) and t:   # a linear's (output, bias), a norm's (normed, residual)
            t = t[0]
        if not isinstance(t, torch.Tensor):
            return []
        if split is None:
            return [t]
        return list(torch.split(t, canon.split_widths(split, int(t.shape[-1]), config), dim=-1))

    def record(value: Any) -> None:
        if not inside[0] or not recording():
            return
        try:
            got = parts(value)
        except ValueError as e:
            warn(f"zoom-{names[0]}", f"zoom tap {names[0]}: {e}")
            return
        for name, t in zip(names, got):
            tap(name, t.reshape(-1, t.shape[-1]) if t.dim() > 2 else t)

    if direction == "output":
        def post(module: Any, args: Any, output: Any) -> None:
            record(output)
        return post

    def pre(module: Any, args: Any) -> None:
        if args:
            record(args[0])
    return pre


def engine_shard_config(text: Any, tp: int) -> dict[str, Any]:
    """Heads, kv heads and head size of one tensor-parallel shard (what a fused qkv value holds,
    also under the names :func:`tensordiff.names.split_widths` reads), the norms' eps and the rope
    theta of an engine's (text) config: the attributes the diff's signatures fit with."""
    out: dict[str, Any] = {}
    heads = getattr(text, "num_attention_heads", None)
    kv = getattr(text, "num_key_value_heads", None) or heads
    hidden = getattr(text, "hidden_size", None)
    hd = getattr(text, "head_dim", None) or (hidden // heads if hidden and heads else None)
    tp = max(int(tp), 1)
    if heads:
        out["heads"] = out["num_attention_heads"] = max(int(heads) // tp, 1)
    if kv:
        out["kv_heads"] = out["num_key_value_heads"] = max(int(kv) // tp, 1)
    if hd:
        out["head_dim"] = int(hd)
    eps = getattr(text, "rms_norm_eps", None)
    if isinstance(eps, float):
        out["eps"] = eps
    rp = getattr(text, "rope_parameters", None)
    theta = (rp.get("rope_theta") if isinstance(rp, dict) else None) or getattr(text, "rope_theta", None)
    if isinstance(theta, (int, float)):
        out["rope_theta"] = float(theta)
    return out
