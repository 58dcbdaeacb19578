"""Catalog taps (``TENSORDIFF_CATALOG=1``, eager mode only: ``enforce_eager=True``).

Forward pre-hooks on every decoder layer record its input ``hidden_states + residual`` (boundary b
for layer b; b=0 the embedding), a pre-hook on the final norm records boundary N (its input,
pre-norm) and a forward hook its output (``final_norm``). The taps stash their tensors on the
running target step; :func:`tensordiff.recorders.vllm.verify.commit` writes them on the kept rows.
Under ``torch.compile`` or CUDA graphs module hooks do not run reliably, so :mod:`.startup`
refuses the catalog there (with a warning) and records the rest.
"""

from __future__ import annotations

import time

from .state import STATE


def install_catalog(model) -> None:
    from ..structure import find_decoder

    st = STATE
    try:
        layers, norm, _ = find_decoder(model)
    except ValueError as e:
        st.warn_once("catalog", "no catalog taps: %s", e)
        return
    n = st.model.get("num_layers") or len(layers)
    for b, layer in enumerate(layers):
        if b >= n or type(layer).__name__ == "PPMissingLayer":
            continue
        st.catalog_handles.append(layer.register_forward_pre_hook(layer_hook(b), with_kwargs=True))
    if type(norm).__name__ != "PPMissingLayer":
        st.catalog_handles.append(norm.register_forward_pre_hook(norm_pre_hook(n), with_kwargs=True))
        st.catalog_handles.append(norm.register_forward_hook(norm_hook))


def tap(kind: str, b: int | None, value) -> None:
    st = STATE
    step = st.ctx
    if step is None or not st.active or value is None:
        return
    t0 = time.perf_counter()
    try:
        T = len(step.pos)
        if value.shape[0] < T:
            st.warn_once(f"tap-rows-{b}", "catalog tap %s: %d rows for %d tokens; skipped",
                         kind if b is None else b, value.shape[0], T)
            return
        step.stash.append((kind, b, value[:T].detach().clone()))
    except Exception as e:  # noqa: BLE001
        st.fail("catalog tap", e)
    finally:
        st.add_seconds(time.perf_counter() - t0)


def _arg(args, kwargs, i: int, name: str):
    if name in kwargs:
        return kwargs[name]
    return args[i] if len(args) > i else None


def layer_hook(b: int):
    def pre_hook(module, args, kwargs):
        if STATE.ctx is None:
            return None
        hs = _arg(args, kwargs, 1, "hidden_states")   # (positions, hidden_states, residual)
        res = _arg(args, kwargs, 2, "residual")
        if hs is not None:
            tap("boundary", b, hs if res is None else hs + res)
        return None
    return pre_hook


def norm_pre_hook(n: int):
    def pre_hook(module, args, kwargs):
        if STATE.ctx is None:
            return None
        x = _arg(args, kwargs, 0, "x")
        res = _arg(args, kwargs, 1, "residual")
        if x is not None:  # before the norm: fused add-norm kernels update x and residual in place
            tap("boundary", n, x if res is None else x + res)
        return None
    return pre_hook


def norm_hook(module, args, output):
    if STATE.ctx is None:
        return None
    tap("final_norm", None, output[0] if isinstance(output, (tuple, list)) else output)
    return None
