"""Catalog taps (``TENSORDIFF_CATALOG=1``): the residual stream entering every decoder layer of the
target and the final norm's input and output, recorded as ``embed``, ``layer<b>``, ``final_norm``
(sketch + RMS; values with ``TENSORDIFF_VALUES``).

A pre-hook on every decoder layer passes SGLang's own capture callback (``capture_output``, the one
``layers_to_capture`` uses) so the tap sees the same residual stream the aux capture sees (for
layers that take ``(positions, hidden_states, forward_batch, residual)``: ``hidden_states +
residual``); a forward hook on the final norm records its input and output. They run in Python, so
they see eager passes only: a CUDA-graph replay runs none of them (the forward hook says so once).
On a target-verify pass the tapped values are held until the verify result says which rows stay,
and on a snapshotted pass (:mod:`.capture`) until the pass is recorded.
"""

from __future__ import annotations

from .. import serving
from .state import STATE


def install_catalog(runner) -> None:
    import inspect

    from ..structure import find_decoder

    st = STATE
    try:
        layers, norm, _ = find_decoder(runner.model)
    except ValueError as e:
        st.warn_once("catalog", "no catalog taps: %s", e)
        return
    n = st.model.get("num_layers") or len(layers)
    for b, layer in enumerate(layers):
        if type(layer).__name__ == "PPMissingLayer" or b >= n:
            continue
        try:
            params = inspect.signature(layer.forward).parameters
        except (TypeError, ValueError):
            params = {}
        if "capture_output" in params:
            st.catalog_handles.append(layer.register_forward_pre_hook(_capture_hook(b), with_kwargs=True))
        elif "residual" in params:
            st.catalog_handles.append(layer.register_forward_pre_hook(_residual_hook(b), with_kwargs=True))
        else:
            st.warn_once("catalog-sig", "no catalog taps: %s.forward takes neither capture_output nor residual",
                         type(layer).__name__)
            for hd in st.catalog_handles:
                hd.remove()
            st.catalog_handles.clear()
            return
        st.catalog_layers += 1
    if type(norm).__name__ != "PPMissingLayer":
        st.catalog_handles.append(norm.register_forward_hook(_norm_hook(n)))


def install_routing(runner) -> int:
    """Forward hooks on each MoE layer's top-k module (``mlp.topk``): the router's expert ids and
    weights per token, recorded as ``moe_routing_layer<i>`` (:mod:`..routing`). Eager passes only,
    like the catalog. Returns how many layers got one."""
    from ..structure import find_decoder

    st = STATE
    try:
        layers, _, _ = find_decoder(runner.model)
    except ValueError:
        return 0
    text = getattr(getattr(getattr(runner, "model_config", None), "hf_config", None), "get_text_config", None)
    cfg = text() if text is not None else None
    experts = getattr(cfg, "n_routed_experts", None) or getattr(cfg, "num_experts", None)
    st.capture_attrs["moe_num_experts"] = int(experts) if experts else None
    n = 0
    for i, layer in enumerate(layers):
        topk = getattr(getattr(layer, "mlp", None), "topk", None)
        if topk is None or not callable(getattr(topk, "register_forward_hook", None)):
            continue
        st.catalog_handles.append(topk.register_forward_hook(_routing_hook(i)))
        n += 1
    return n


def _routing_hook(i: int):
    def hook(mod, args, output):
        if STATE.ctx_rows is None:
            return
        from ..routing import ids_and_weights, routing_table

        got = ids_and_weights(output)
        if got is not None:
            _tap("routing", i, routing_table(*got))
    return hook


def _tap(kind: str, b: int | None, value) -> None:
    st = STATE
    rows = st.ctx_rows
    if rows is None or not st.active:
        return
    t0 = st.begin()
    try:
        if value.shape[0] != len(rows):
            st.warn_once(f"tap-rows-{b}", "catalog tap %s: %d rows for %d tokens; skipped",
                         kind if b is None else b, value.shape[0], len(rows))
            return
        if st.ctx_stash is not None:  # kept until the pass's rows are known (its verify result, or its replay)
            from ..staging import host_copy

            st.ctx_stash.append((kind, b, host_copy(value) if value.device.type == "cpu" else value.detach().clone()))
            return
        record_catalog(kind, b, value, rows)
    except Exception as e:  # noqa: BLE001
        st.fail("catalog tap", e)
    finally:
        st.end(t0)


def record_catalog(kind: str, b: int | None, value, rows, private: bool = False) -> None:
    """A catalog state's rows (``private``: ``value`` is the tap's own copy, kept as it is)."""
    st = STATE
    if kind.startswith("tap:"):   # TENSORDIFF_ZOOM (.zoom)
        from .zoom import record_zoom_tap

        record_zoom_tap(st.rec, kind, value, rows, st.model.get("num_layers"), private)
        st.dirty = True
        return
    if kind == "routing":
        from ...conventions import MOE_ROUTING
        from ..routing import name_of, routing_attrs

        attrs = routing_attrs(b, value.shape[-1] // 2, st.capture_attrs.get("moe_num_experts"), "SGLang TopK output")
        st.rec.plain(name_of(b), value, rows, role=MOE_ROUTING, order=b + 0.5, attrs=attrs)
        st.dirty = True
        return
    if kind == "final_norm":
        serving.final_norm(st.rec, value, rows, values=st.cfg.wants_values("final_norm"), private=private)
    else:
        from ...vocab import boundary_label
        serving.boundary(st.rec, b, value, rows, values=st.cfg.wants_values(boundary_label(b)), private=private)
    st.dirty = True


def _capture_hook(b: int):
    def pre_hook(module, args, kwargs):
        if STATE.ctx_rows is None:
            return None
        prev = kwargs.get("capture_output")

        def capture(value, *, owned: bool = False):
            _tap("boundary", b, value)
            if prev is not None:
                return prev(value, owned=owned)
            return None

        kwargs = dict(kwargs)
        kwargs["capture_output"] = capture
        return args, kwargs
    return pre_hook


def _residual_hook(b: int):
    def pre_hook(module, args, kwargs):
        if STATE.ctx_rows is None:
            return
        hs = kwargs.get("hidden_states", args[1] if len(args) > 1 else None)
        res = kwargs.get("residual", args[3] if len(args) > 3 else None)
        if hs is not None:
            _tap("boundary", b, hs if res is None else hs + res)
        return
    return pre_hook


def _norm_hook(n: int):
    def hook(module, args, output):
        if STATE.ctx_rows is None:
            return
        if isinstance(output, (tuple, list)):
            normed = output[0]
            pre = output[1] if len(output) > 1 and output[1] is not None else args[0]
        else:
            normed = output
            pre = args[0] if args else None
        if pre is not None:
            _tap("boundary", n, pre)
        _tap("final_norm", None, normed)
        return
    return hook
