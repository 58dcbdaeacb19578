"""Zoom in SGLang (``TENSORDIFF_ZOOM=layer3``): the sub-layer taps of one decoder layer of the
target (``layer3.attn_norm`` ... ``layer3.mlp_out``, :mod:`tensordiff.names`), so a serve trace
compares op by op with a train trace zoomed into the same layer.

Only that layer's modules are hooked, through the engine rules of the name table (fused
``qkv_proj`` split ``heads : kv_heads : kv_heads`` per tensor-parallel shard, ``gate_up_proj`` in
halves, the rotary module's ``(q, k)``, a linear layer's ``(output, bias)`` and a norm's
``(normed, residual)`` read as their first tensor). The values go through the catalog's tap
(given by :mod:`.startup`): kept until a pass's rows are known, eager passes only. A module the
running model never calls (a fused kernel path) records nothing: the trace then lacks that tap."""

from __future__ import annotations

from typing import Any

from .state import STATE

KIND = "tap:"   # the catalog tap kind of a zoom value: "tap:layer3.q"


def install_zoom(runner, layer: int, tap) -> int:
    """Hooks on decoder ``layer``'s modules that the name table maps to taps; how many. ``tap``:
    the catalog's tap (:func:`.catalog._tap`), which keeps a value until its pass's rows are known."""
    from ..zoom import engine_zoom_layer

    st = STATE
    found = engine_zoom_layer(runner.model, layer, st.model.get("num_layers"),
                              lambda key, msg: st.warn_once(key, "%s", msg))
    if found is None:
        return 0
    layers, path, n = found
    cfg = _shard_config(runner)
    st.capture_attrs["zoom"] = {"layer": layer, **cfg}
    from ..zoom import install_engine_taps

    count = install_engine_taps(runner.model, layers, path, layer, n, "sglang", cfg,
                                lambda name, t: tap(KIND + name, layer, t), st.catalog_handles,
                                lambda: STATE.ctx_rows is not None and STATE.active,
                                lambda key, msg: st.warn_once(key, "%s", msg))
    if not count:
        st.warn_once("zoom", "no zoom taps: no module of %s.%d maps to a tap", path, layer)
    return count


def _shard_config(runner) -> dict[str, Any]:
    from ..zoom import engine_shard_config

    hf = getattr(getattr(runner, "model_config", None), "hf_config", None)
    text = getattr(hf, "get_text_config", lambda: hf)() if hf is not None else None
    return engine_shard_config(text, int(getattr(runner, "tp_size", 1) or 1))


def record_zoom_tap(rec: Any, kind: str, value: Any, rows: Any, n_layers: int | None, private: bool) -> None:
    """One zoom tap's rows (values kept: a zoom is for comparing op by op)."""
    from ... import names as canon

    name = kind[len(KIND):]
    st = canon.parse_state(name)
    attrs = {"layer": st.layer, "tap": st.tap, "module": "sglang", **STATE.capture_attrs.get("zoom", {})}
    attrs.pop("num_attention_heads", None)
    attrs.pop("num_key_value_heads", None)
    rec._record(name, value, rows, kind="other", role="tap", order=st.order(n_layers), values=True, attrs=attrs,
                private=private)
