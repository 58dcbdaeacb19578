"""Zoom in vLLM (``TENSORDIFF_ZOOM=layer3``, eager mode only, like the catalog): the sub-layer taps
of one decoder layer of the target, through the engine rules of the name table
(:func:`tensordiff.recorders.zoom.install_engine_taps`); the values are stashed on the running
step like the catalog's and written on its kept rows (:mod:`.verify`)."""

from __future__ import annotations

from typing import Any

from .state import STATE

KIND = "tap:"   # the stash kind of a zoom value: "tap:layer3.q"
#: the zoomed layer's shard facts (heads, head size, eps, rope theta), recorded on every tap
FACTS: dict[str, Any] = {}


def install_zoom(model, layer: int) -> int:
    """Hooks on decoder ``layer``'s modules that the name table maps to taps; how many."""
    from ..zoom import engine_shard_config, engine_zoom_layer, install_engine_taps
    from .catalog import tap

    st = STATE
    found = engine_zoom_layer(model, layer, st.model.get("num_layers"), lambda key, msg: st.warn_once(key, "%s", msg))
    if found is None:
        return 0
    layers, path, n = found
    try:
        from vllm.distributed import get_tensor_model_parallel_world_size
        tp = int(get_tensor_model_parallel_world_size())
    except Exception:  # noqa: BLE001  (no parallel state: one rank)
        tp = 1
    cfg = getattr(model, "config", None)
    text = getattr(cfg, "get_text_config", lambda: cfg)() if cfg is not None else None
    shard = engine_shard_config(text, tp)
    FACTS.clear()
    FACTS.update({k: v for k, v in shard.items() if k not in ("num_attention_heads", "num_key_value_heads")})
    count = install_engine_taps(model, layers, path, layer, n, "vllm", shard,
                                lambda name, t: tap(KIND + name, layer, t), st.catalog_handles,
                                lambda: STATE.ctx is not None and STATE.active,
                                lambda key, msg: st.warn_once(key, "%s", msg))
    if not count:
        st.warn_once("zoom", "no zoom taps: no module of %s.%d maps to a tap", path, layer)
    return count


def record_zoom_tap(rec: Any, kind: str, value: Any, rows: Any) -> None:
    """One zoom tap's rows (values kept: a zoom is for comparing op by op)."""
    from ... import names as canon

    name = kind[len(KIND):]
    st = canon.parse_state(name)
    attrs = {"layer": st.layer, "tap": st.tap, "module": "vllm", **FACTS}
    rec._record(name, value, rows, kind="other", role="tap", order=st.order(STATE.model.get("num_layers")),
                values=True, attrs=attrs)
