"""Start-up: the capture layers SGLang resolved, the id convention they follow, and the trace.

AROUND ``ModelRunner.init_attention_backends``: SGLang calls ``model.set_eagle3_layers_to_capture``
in there, once, before any CUDA graph is captured. After it the target's resolved
``layers_to_capture`` (capture id i = the input of decoder layer i = boundary i) is read next to the
raw draft ids SGLang read (``spec_aux_config.eagle_aux_hidden_state_layer_ids``), turned into slot
labels, with the id convention of the model file (:func:`tensordiff.conventions.sglang_convention_for`)
and what that convention says the ids should select. The trace is opened on the recording rank
(:mod:`.ranks`) and, with ``TENSORDIFF_CATALOG=1``, the catalog taps are installed (:mod:`.catalog`).
"""

from __future__ import annotations

from ..serving import model_facts, open_recorder
from .config import rank_path
from .graft import install_graft
from .ranks import rank_plan, server_arg
from .state import STATE, log


def hook_init_attention_backends(original, runner, *args, **kwargs):
    result = original(runner, *args, **kwargs)
    st = STATE
    if st.cfg is None or st.broken:
        return result
    try:
        if not getattr(runner, "is_draft_worker", False):
            setup_target(runner)
        elif st.role == "record":
            from .predictions import install_prediction_taps

            install_prediction_taps(runner, draft=True)
    except Exception as e:  # noqa: BLE001
        st.fail("start-up", e)
    return result


def find_layers_to_capture(model) -> list[int] | None:
    for obj in (getattr(model, "model", None), model, getattr(getattr(model, "model", None), "model", None)):
        ltc = getattr(obj, "layers_to_capture", None) if obj is not None else None
        if ltc is not None and len(ltc):
            return [int(x) for x in ltc]
    return None


def resolve_capture(runner) -> tuple[int, int, str]:
    """Read what SGLang resolved into the state: slot labels, raw ids, convention, what the
    convention expects. Returns (num_layers, hidden_size, architecture)."""
    from ... import conventions
    from ...vocab import boundary_label

    st = STATE
    hf = getattr(getattr(runner, "model_config", None), "hf_config", None)
    text = getattr(hf, "get_text_config", lambda: hf)() if hf is not None else None
    n = int(getattr(text, "num_hidden_layers", 0) or 0)
    h = int(getattr(text, "hidden_size", 0) or 0)
    arch = (getattr(hf, "architectures", None) or [type(runner.model).__name__])[0]
    ltc = find_layers_to_capture(runner.model)
    aux_cfg = getattr(runner, "spec_aux_config", None)
    raw = getattr(aux_cfg, "eagle_aux_hidden_state_layer_ids", None)
    raw = [int(i) for i in raw] if raw is not None else None
    convention = conventions.sglang_convention_for(arch)
    st.capture_attrs = {"layers_to_capture": ltc, "draft_layer_ids": raw, "convention": convention,
                        "speculative_algorithm": str(server_arg(runner, "speculative_algorithm", None))}
    note = conventions.sglang_deepseek_capture_note(raw, n) if convention == "sglang-deepseek" and ltc else None
    if note is not None:
        st.capture_attrs["capture_note"] = note[0]
        st.warn_once("capture-note", "tensordiff: %s", note[0])
        if note[1]:  # nothing the packed states could be labelled with: SGLang fails before any
            ltc = None
    if ltc is not None:
        # the claims are the order the engine packs: its forward appends one aux state per decoder
        # layer it runs whose index is in layers_to_capture, in layer order, so slot i holds the
        # i-th captured boundary by depth whatever order the draft's config lists its ids in
        st.labels = [boundary_label(b) for b in sorted(set(ltc))]
        st.raw_ids = raw
        st.convention = convention
        try:
            expected = conventions.resolve(convention, raw, n)
        except ValueError as e:
            expected = None
            st.capture_attrs["convention_error"] = str(e)
        st.capture_attrs["convention_expects"] = expected
        if expected is not None and list(expected) != ltc:
            st.warn_once("convention", "SGLang captures boundaries %s for draft ids %s, but the %s convention says %s",
                         ltc, raw, convention, expected)
    return n, h, arch


def setup_target(runner) -> None:
    st = STATE
    cfg = st.cfg
    n, h, arch = resolve_capture(runner)
    ltc = st.capture_attrs["layers_to_capture"]
    raw = st.capture_attrs["draft_layer_ids"]
    convention = st.capture_attrs["convention"]
    if st.role is not None:  # a second init (weights reloaded...): keep the trace
        return
    record, suffix, facts = rank_plan(runner)
    st.capture_attrs["ranks"] = facts
    if not record:
        st.role = "off"
        return
    st.role = "record"
    import sglang
    import torch

    st.model = model_facts(runner.model_config, n, h, arch,
                           str(getattr(runner.model_config, "model_path", "") or server_arg(runner, "model_path", "")))
    meta = {"command": "sglang plugin", "layers_to_capture": st.capture_attrs["layers_to_capture"], "draft_layer_ids": raw,
            "capture_note": st.capture_attrs.get("capture_note"),
            "convention": convention, "draft_model": server_arg(runner, "speculative_draft_model_path", None),
            "cuda_graph": not bool(server_arg(runner, "disable_cuda_graph", False)), "ranks": facts,
            "catalog": cfg.catalog}
    meta["graft"] = install_graft(runner) if cfg.graft else None
    path = rank_path(cfg.path, suffix)
    st.start_profile(rank_path(cfg.profile, suffix) if cfg.profile else None)
    st.rec = open_recorder(cfg, path, engine="sglang", version=sglang.__version__, torch_version=torch.__version__,
                           model=st.model, meta=meta)
    log.info("tensordiff: recording to %s (slots %s from draft ids %s, %s)", path, st.labels, raw, convention)
    if ltc is None and not cfg.catalog:
        st.warn_once("nothing", "this engine captures no aux hidden states (no EAGLE-3 draft, no "
                     "--enable-return-aux-hidden-states) and TENSORDIFF_CATALOG is off: only token rows are recorded")
    st.spec_chain = int(server_arg(runner, "speculative_eagle_topk", 1) or 1) == 1
    from .predictions import install_prediction_taps

    install_prediction_taps(runner, draft=False)
    from . import rl

    rl.start(runner)
    if cfg.routing:
        from .catalog import install_routing

        st.capture_attrs["moe_routing_layers"] = install_routing(runner)
    if cfg.zoom is not None:
        from .catalog import _tap
        from .zoom import install_zoom

        st.capture_attrs["zoom_hooks"] = install_zoom(runner, cfg.zoom, _tap)
    if cfg.catalog:
        from .catalog import install_catalog

        install_catalog(runner)
        if not bool(server_arg(runner, "disable_cuda_graph", False)):
            st.warn_once("graphs", "catalog taps run only on eager passes; CUDA-graph replays (decode, verify) "
                         "skip them. Start the server with --disable-cuda-graph to record the catalog at every "
                         "token (aux_hidden_states and draft_input are recorded either way).")
