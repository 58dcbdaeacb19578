"""Zoom in SGLang (``TENSORDIFF_ZOOM=layer3``): the sub-layer taps of one decoder layer of the
target (``layer3.attn_norm`` ... ``layer3.mlp_out``, :mod:`tensordiff.names`), so a serve trace
compares op by op with a train trace zoomed into the same layer.

Only that layer's modules are hooked, through the engine rules of the name table (fused
``qkv_proj`` split ``heads : kv_heads : kv_heads`` per tensor-parallel shard, ``gate_up_proj`` in
halves, the rotary module's ``(q, k)``, a linear layer's ``(output, bias)`` and a norm's
``(normed, residual)`` read as their first tensor). The values go through the catalog's tap
(:func:`.catalog._tap`): kept until a pass's rows are known, eager passes only. A module the
running model never calls (a fused kernel path) records nothing: the trace then lacks that tap."""

from __future__ import annotations

from typing import Any

from .state import STATE

KIND = "tap:"   # the catalog tap kind of a zoom value: "tap:layer3.q"


def install_zoom(runner, layer: int) -> int:
    """Hooks on decoder ``layer``'s modules that the name table maps to taps; how many."""
    from ... import names as canon
    from ..hf import find_decoder

    st = STATE
    try:
        layers, _, path = find_decoder(runner.model)
    except ValueError as e:
        st.warn_once("zoom", "no zoom taps: %s", e)
        return 0
    n = int(st.model.get("num_layers") or len(layers))
    if not 0 <= layer < n:
        st.warn_once("zoom", "no zoom taps: TENSORDIFF_ZOOM=layer%d but the model has layers 0..%d", layer, n - 1)
        return 0
    cfg = _shard_config(runner)
    st.capture_attrs["zoom"] = {"layer": layer, **cfg}
    prefix = f"{path}.{layer}."
    count = 0
    for name, mod in runner.model.named_modules():
        if not name.startswith(prefix):
            continue
        for direction in ("output", "input"):
            m = canon.canonical(name, direction, "sglang", n)
            if m is None or any(canon.parse_state(x).kind != "tap" for x in m.names):
                continue
            hook = _hook(m.names, m.split, cfg, layer, direction)
            if direction == "output":
                st.catalog_handles.append(mod.register_forward_hook(hook))
            else:
                st.catalog_handles.append(mod.register_forward_pre_hook(hook))
            count += 1
    if not count:
        st.warn_once("zoom", "no zoom taps: no module of %s maps to a tap", prefix.rstrip("."))
    return count


def _shard_config(runner) -> dict[str, Any]:
    """Heads, kv heads and head size of this rank's shard (what a fused qkv value holds), the
    norms' eps and rope theta: the attributes the diff's signatures fit with."""
    hf = getattr(getattr(runner, "model_config", None), "hf_config", None)
    text = getattr(hf, "get_text_config", lambda: hf)() if hf is not None else None
    tp = int(getattr(runner, "tp_size", 1) or 1)
    out: dict[str, Any] = {}
    heads = getattr(text, "num_attention_heads", None)
    kv = getattr(text, "num_key_value_heads", None) or heads
    hidden = getattr(text, "hidden_size", None)
    hd = getattr(text, "head_dim", None) or (hidden // heads if hidden and heads else None)
    if heads:
        out["heads"] = max(int(heads) // tp, 1)
        out["num_attention_heads"] = out["heads"]
    if kv:
        out["kv_heads"] = max(int(kv) // tp, 1)
        out["num_key_value_heads"] = out["kv_heads"]
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


def _hook(names: tuple[str, ...], split: str | None, cfg: dict[str, Any], layer: int, direction: str):
    from ... import names as canon
    from .catalog import _tap

    def parts(value: Any) -> list[Any]:
        import torch

        if split == "tuple":
            ts = [v for v in value if isinstance(v, torch.Tensor)] if isinstance(value, (tuple, list)) else []
            return ts[: len(names)] if len(ts) >= len(names) else []
        t = value
        while isinstance(t, (tuple, list)) and t:
            t = t[0]
        if not isinstance(t, torch.Tensor):
            return []
        if split is None:
            return [t]
        widths = canon.split_widths(split, int(t.shape[-1]), cfg)
        return list(torch.split(t, widths, dim=-1))

    def record(value: Any) -> None:
        if STATE.ctx_rows is None or not STATE.active:
            return
        try:
            got = parts(value)
        except ValueError as e:
            STATE.warn_once(f"zoom-{names[0]}", "zoom tap %s: %s", names[0], e)
            return
        for name, t in zip(names, got):
            _tap(KIND + name, layer, t.reshape(-1, t.shape[-1]) if t.dim() > 2 else t)

    if direction == "output":
        def post(module, args, output):
            record(output)
        return post

    def pre(module, args):
        if args:
            record(args[0])
    return pre


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
