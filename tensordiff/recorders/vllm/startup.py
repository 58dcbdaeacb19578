"""Start-up: on the first ``execute_model`` that schedules tokens (the target is loaded and
``set_aux_hidden_state_layers`` has run by then), :func:`setup` reads the boundaries vLLM resolved
(``model.aux_hidden_state_layers``) next to the raw draft ids and what the ``vllm`` convention
expects of them, notes how the draft's config would be read, decides by the rank plan whether this
Worker records, opens the trace, starts the idle flusher and installs the catalog taps.

AFTER ``WorkerWrapperBase.init_device``: :func:`hook_init_device` says so when the Worker made
vLLM's V2 model runner, which this recorder does not tap (then nothing is recorded).
"""

from __future__ import annotations

import threading

from ..serving import model_facts, open_recorder
from .catalog import install_catalog
from .config import rank_path
from .control import idle_flusher
from .ranks import rank_plan
from .state import STATE, log


def hook_init_device(out, wrapper, *args, **kwargs) -> None:
    """The Worker has made its model runner: say so when it is one the recorder does not tap."""
    runner = getattr(getattr(wrapper, "worker", None), "model_runner", None)
    mod = type(runner).__module__ if runner is not None else ""
    if mod.startswith("vllm.v1.worker.gpu."):  # the V2 model runner (vllm/v1/worker/gpu/model_runner.py)
        STATE.broken = True
        log.error("tensordiff: not recording: vLLM runs its V2 model runner (%s), which this recorder does not "
                  "tap; start vLLM with VLLM_USE_V2_MODEL_RUNNER=0 to record", type(runner).__name__)


def draft_config_dict(runner) -> dict | None:
    sc = getattr(runner, "speculative_config", None)
    dmc = getattr(sc, "draft_model_config", None)
    hf = getattr(dmc, "hf_config", None)
    if hf is None:
        return None
    try:
        return hf.to_dict()
    except Exception:  # noqa: BLE001
        return None


def setup(runner) -> None:
    from ... import conventions
    from ...vocab import boundary_label

    st = STATE
    cfg = st.cfg
    model = runner.get_model()
    hf = runner.model_config.hf_config
    text = getattr(hf, "get_text_config", lambda: hf)()
    n = int(getattr(text, "num_hidden_layers", 0) or 0)
    h = int(getattr(text, "hidden_size", 0) or 0)
    arch = (getattr(hf, "architectures", None) or [type(model).__name__])[0]
    sc = getattr(runner, "speculative_config", None)
    method = getattr(sc, "method", None)
    captured = None
    if getattr(runner, "use_aux_hidden_state_outputs", False):
        layers = getattr(model, "aux_hidden_state_layers", None)
        if layers is None:
            layers = getattr(getattr(model, "model", None), "aux_hidden_state_layers", None)
        captured = [int(b) for b in layers] if layers else None
    raw = None
    try:
        got = runner._get_eagle3_aux_layers_from_config()
        raw = [int(i) for i in got] if got else None
    except Exception:  # noqa: BLE001
        pass
    st.attrs = {"aux_hidden_state_layers": captured, "draft_layer_ids": raw, "convention": "vllm",
                "speculative_method": method, "model_runner": type(runner).__name__}
    if captured is not None:
        st.labels = [boundary_label(b) for b in captured]
        st.raw_ids = raw
        try:
            expected = conventions.resolve("vllm", raw, n) if raw is not None else None
        except ValueError as e:
            expected = None
            st.attrs["convention_error"] = str(e)
        st.attrs["convention_expects"] = expected
        if raw is None:
            st.attrs["draft_layer_ids_source"] = "model default (get_eagle3_default_aux_hidden_state_layers)"
        elif expected is not None and expected != captured:
            st.warn_once("convention", "vLLM captures boundaries %s for draft ids %s, but the vllm convention says %s",
                         captured, raw, expected)
        note = conventions.capture_order_note("vllm", raw, n)
        if note:
            st.attrs["capture_order_note"] = note
            st.warn_once("order", "%s", note)
    dcfg = draft_config_dict(runner)
    if dcfg is not None:
        notes = conventions.draft_config_notes("vllm", dcfg, n) + conventions.draft_config_notes("vllm-v2", dcfg, n)
        if notes:
            st.attrs["draft_config_notes"] = notes
            for i, note in enumerate(notes):
                st.warn_once(f"draft-config-{i}", "%s", note)
    record, suffix, facts = rank_plan(runner)
    st.attrs["ranks"] = facts
    if not record:
        st.role = "off"
        return
    st.role = "record"
    import torch
    import vllm

    st.model = model_facts(runner.model_config, n, h, arch, str(getattr(runner.model_config, "model", "") or ""))
    eager = is_eager(runner)
    meta = {"command": "vllm plugin", "aux_hidden_state_layers": captured, "draft_layer_ids": raw,
            "convention": "vllm", "speculative_method": method,
            "draft_model": getattr(sc, "model", None), "num_speculative_tokens": getattr(sc, "num_speculative_tokens", None),
            "enforce_eager": eager, "ranks": facts, "catalog": cfg.catalog,
            **{k: st.attrs[k] for k in ("capture_order_note", "draft_config_notes") if k in st.attrs}}
    path = rank_path(cfg.path, suffix)
    st.path = path
    st.rec = open_recorder(cfg, path, engine="vllm", version=vllm.__version__, torch_version=torch.__version__,
                           model=st.model, meta=meta)
    log.info("tensordiff: recording to %s (slots %s from draft ids %s, vllm)", path, st.labels, raw)
    from .state import queue_steps_from_env

    st.queue_steps = queue_steps_from_env()
    threading.Thread(target=idle_flusher, args=(st,), name="tensordiff-idle-flush", daemon=True).start()
    from .predictions import install_prediction_taps

    install_prediction_taps(runner, model)
    from .rl import start

    start(runner)
    if captured is None and not cfg.catalog:
        st.warn_once("nothing", "this engine captures no aux hidden states (no EAGLE-3 draft) and TENSORDIFF_CATALOG "
                     "is off: only token rows are recorded")
    if cfg.zoom is not None:
        if eager:
            from .zoom import install_zoom

            install_zoom(model, cfg.zoom)
        else:
            st.warn_once("zoom-compiled", "TENSORDIFF_ZOOM needs eager mode (enforce_eager=True / --enforce-eager): "
                         "module hooks do not run inside torch.compile graphs or CUDA graphs; no zoom taps")
    if cfg.catalog:
        if eager:
            install_catalog(model)
        else:
            st.warn_once("catalog-compiled", "the catalog needs eager mode (enforce_eager=True / --enforce-eager): "
                         "module hooks do not run inside torch.compile graphs or CUDA graphs; recording without it")


def is_eager(runner) -> bool:
    if bool(getattr(runner.model_config, "enforce_eager", False)):
        return True
    cc = getattr(runner.vllm_config, "compilation_config", None)
    mode = getattr(cc, "mode", None)
    cg = getattr(cc, "cudagraph_mode", None)
    return getattr(mode, "name", str(mode)) == "NONE" and getattr(cg, "name", "NONE") == "NONE"
