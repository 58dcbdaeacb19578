"""The serve-side recorder inside vLLM: a ``vllm.general_plugins`` entry point.

vLLM calls every ``vllm.general_plugins`` entry point in each of its processes (the caller, the
EngineCore, every Worker; ``VLLM_PLUGINS=a,b`` restricts which); tensordiff declares
``tensordiff = "tensordiff.recorders.vllm_plugin:register"``. :func:`register` does nothing at
all unless ``TENSORDIFF_TRACE`` names a trace file (the same variables as the SGLang plugin, see
:class:`tensordiff.recorders.sglang_plugin.Config`). Then it wraps these methods of vLLM's V1 model
runner and drafter (vLLM has no hook registry: a general plugin wraps methods, once per process).
Only a Worker process ever runs them, and only TP rank 0 of the last pipeline stage records:

``GPUModelRunner.execute_model`` (AROUND; ``CPUModelRunner`` inherits it): one recorded step per
    call that schedules tokens; opens the trace on the first one (the target is loaded and
    ``set_aux_hidden_state_layers`` has run by then).
``GPUModelRunner._model_forward`` (AROUND), the target's forward inside ``execute_model``: the
    token key of every row (request, absolute position, input id: ``input_batch.req_ids`` in batch
    order, ``num_scheduled_tokens`` rows each) and the aux states the model returns with
    ``use_aux_hidden_state_outputs`` (``(hidden_states, [aux_0, ..., aux_{K-1}])``), packed as
    ``aux_hidden_states`` in the order vLLM captured them (``model.aux_hidden_state_layers``,
    sorted). Held until the step's sampling result is known.
``GPUModelRunner._sample`` (AFTER): the sampled / accepted tokens. A verify segment (a request
    with scheduled draft tokens) keeps rows ``j < number of valid sampled tokens`` (its last token
    and the accepted drafts); rows of rejected drafts are dropped, as are rows past
    ``max_tokens``. Then the held rows are written.
``SpecDecodeBaseProposer.propose`` (AROUND) and ``set_inputs_first_pass`` (AFTER): the drafter's
    ``target_hidden_states`` (exactly what ``combine_hidden_states``, the draft's ``fc``,
    consumes) as ``draft_input``, keyed by the target rows of the same (request, position)
    (``token_offset=1``), and the input ids the drafter actually got (its ``input_ids`` buffer after
    the shift) as ``draft_input_ids``. Rows whose target row was dropped (rejected drafts in the
    padded drafter batch) are filler and are dropped.
``WorkerWrapperBase.shutdown`` (BEFORE) and ``atexit``: close the trace. ``collective_rpc(
    "tensordiff_close" | "tensordiff_flush" | "tensordiff_pause" | "tensordiff_resume")`` reach
    methods the plugin adds to ``WorkerBase``.

Catalog (``TENSORDIFF_CATALOG=1``, eager mode only: ``enforce_eager=True``): forward pre-hooks on
every decoder layer record its input ``hidden_states + residual`` (boundary b for layer b; b=0 the
embedding), a pre-hook on the final norm records boundary N (its input, pre-norm) and a forward
hook its output (``final_norm``). Under ``torch.compile`` or CUDA graphs module hooks do not run
reliably, so the plugin refuses the catalog there (with a warning) and records the rest.

Importing this module imports neither torch nor vllm.
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import re
import threading
import time

from .sglang_plugin import Config, rank_path

log = logging.getLogger("tensordiff.vllm")

AUX = "aux_hidden_states"
DRAFT = "draft_input"
DRAFT_IDS = "draft_input_ids"
RPC_METHODS = ("tensordiff_close", "tensordiff_flush", "tensordiff_pause", "tensordiff_resume")

_RUNNER = "vllm.v1.worker.gpu_model_runner.GPUModelRunner"
_PROPOSER = "vllm.v1.spec_decode.llm_base_proposer.SpecDecodeBaseProposer"
HOOK_TARGETS = (
    f"{_RUNNER}.execute_model",
    f"{_RUNNER}._model_forward",
    f"{_RUNNER}._sample",
    f"{_PROPOSER}.propose",
    f"{_PROPOSER}.set_inputs_first_pass",
    "vllm.v1.worker.worker_base.WorkerWrapperBase.shutdown",
    "vllm.v1.worker.worker_base.WorkerWrapperBase.init_device",
)
_WRAPPED = "__tensordiff_wrapped__"
_INTERNAL_ID = re.compile(r"^(.*)-[0-9a-f]{8}$")  # vLLM's internal id: f"{external}-{random_uuid():.8}"


# ----------------------------------------------------------------------------------------------
# Entry point
# ----------------------------------------------------------------------------------------------


def register() -> None:
    """The ``vllm.general_plugins`` entry point. Inert unless ``TENSORDIFF_TRACE`` is set."""
    try:
        cfg = Config.from_env()
    except ValueError as e:
        log.error("tensordiff: not recording: %s", e)
        return
    if cfg is None:
        return
    _STATE.cfg = cfg
    try:
        _install()
    except Exception as e:  # noqa: BLE001  (a vLLM without these methods: say so, never break serving)
        log.error("tensordiff: not recording: this vLLM lacks a method the recorder wraps (%s)", e)
        _STATE.broken = True


def _install() -> None:
    import importlib

    for target, kind, fn in (
        (HOOK_TARGETS[0], "around", _hook_execute_model),
        (HOOK_TARGETS[1], "around", _hook_model_forward),
        (HOOK_TARGETS[2], "after", _hook_sample),
        (HOOK_TARGETS[3], "around", _hook_propose),
        (HOOK_TARGETS[4], "after", _hook_set_inputs_first_pass),
        (HOOK_TARGETS[5], "before", _hook_shutdown),
        (HOOK_TARGETS[6], "after", _hook_init_device),
    ):
        mod_name, cls_name, meth = target.rsplit(".", 2)
        cls = getattr(importlib.import_module(mod_name), cls_name)
        original = getattr(cls, meth)
        if getattr(original, _WRAPPED, False):
            continue  # register() ran twice in this process
        setattr(cls, meth, _wrap(original, kind, fn))
    from vllm.v1.worker.worker_base import WorkerBase

    for name in RPC_METHODS:
        setattr(WorkerBase, name, _rpc_method(name))


def _wrap(original, kind: str, fn):
    if kind == "around":
        @functools.wraps(original)
        def wrapper(self, *args, **kwargs):
            return fn(original, self, *args, **kwargs)
    elif kind == "after":
        @functools.wraps(original)
        def wrapper(self, *args, **kwargs):
            out = original(self, *args, **kwargs)
            fn(out, self, *args, **kwargs)
            return out
    else:
        @functools.wraps(original)
        def wrapper(self, *args, **kwargs):
            fn(self, *args, **kwargs)
            return original(self, *args, **kwargs)
    setattr(wrapper, _WRAPPED, True)
    return wrapper


def _rpc_method(name: str):
    def method(worker, *args, **kwargs):
        st = _STATE
        if name == "tensordiff_close":
            st.close()
        elif name == "tensordiff_flush":
            st.flush(force=True)
        elif name == "tensordiff_pause":
            st.flush(force=True)
            st.paused = True
            st.pending = None
        elif name == "tensordiff_resume":
            st.paused = False
        return {"recording": st.role == "record", "path": st.path, "rows": st.rows_written}
    method.__name__ = name
    return method


# ----------------------------------------------------------------------------------------------
# State (one per process; only the recording Worker gets past the first check of a hook)
# ----------------------------------------------------------------------------------------------


class _Step:
    """One target forward: its rows, held until the sampling result says which rows to keep."""

    def __init__(self, step: int, segments: list, pos, ids, regimes: list, prompt_lens: list, limits: list):
        self.step = step
        self.segments = segments      # [(seq key, first row, count, n_spec)]
        self.pos = pos                # np.int64 [T]
        self.ids = ids                # np.int64 [T]
        self.regimes = regimes        # per segment
        self.prompt_lens = prompt_lens
        self.limits = limits          # per segment: positions >= limit are past max_tokens
        self.aux = None               # torch [T, K*H]
        self.stash: list = []         # catalog: [(kind, boundary, tensor [T, H])]
        self.rows = None              # np.int64 [T] trace rows, -1 dropped (after commit)
        self.next_tok: dict = {}      # (seq, pos) -> token, for the draft shift check
        self.prompts: dict = {}       # segment -> prompt token ids (prefill segments)
        self.batch_idx: list = []     # per segment: the request's index in the batch (sampler row)
        self.num_reqs = 0             # requests in the batch, scheduled tokens or not


class _State:
    def __init__(self) -> None:
        self.cfg: Config | None = None
        self.rec = None
        self.role: str | None = None  # None: undecided; "record"; "off"
        self.path: str | None = None
        self.paused = False
        self.closed = False
        self.broken = False
        self.dirty = False
        self.last_flush = time.monotonic()
        self.last_activity = time.monotonic()
        self.lock = threading.RLock()  # the recording hooks and the idle flusher share the writer
        self.model: dict = {}
        self.labels: list[str] | None = None
        self.raw_ids: list[int] | None = None
        self.convention = "vllm"
        self.attrs: dict = {}
        self.step_no = 0
        self.sched = None             # the scheduler output of the running execute_model
        self.forwarded = False
        self.pending: _Step | None = None
        self.last: _Step | None = None  # the committed step the drafter reads
        self.ctx: _Step | None = None   # the step whose forward the catalog taps see
        self.catalog_handles: list = []
        self.draft_ctx: dict | None = None
        self.draft_ids_defined = False
        self.keys: dict[str, str] = {}  # internal request id -> sequence key
        self.key_owner: dict[str, str] = {}
        self.warned: set[str] = set()
        self.rows_written = 0
        self.rows_dropped = 0
        self.shift_checked = 0
        self.shift_mismatched = 0
        self.draft_unmatched = 0
        self.seconds = 0.0

    def warn_once(self, key: str, msg: str, *args) -> None:
        if key not in self.warned:
            self.warned.add(key)
            log.warning("tensordiff: " + msg, *args)

    @property
    def active(self) -> bool:
        return self.rec is not None and not (self.paused or self.closed or self.broken)

    def fail(self, where: str, e: BaseException) -> None:
        """A recording error never reaches the engine: log it, stop recording, keep the trace."""
        log.exception("tensordiff: recording stopped (error in %s): %s", where, e)
        with self.lock:
            if self.broken:
                return
            self.broken = True
            self.pending = self.last = self.ctx = None
            if self.rec is not None and not self.closed:
                try:
                    self._write_stats()
                    self.rec.close(e)
                except Exception:  # noqa: BLE001
                    log.exception("tensordiff: closing the trace after the error failed")

    def _write_stats(self) -> None:
        self.rec.writer.set_attr(None, "tensordiff_vllm", {
            "rows": self.rows_written, "rows_dropped": self.rows_dropped,
            "draft_shift_checked": self.shift_checked, "draft_shift_mismatched": self.shift_mismatched,
            "draft_passes_unmatched": self.draft_unmatched, "catalog_taps": len(self.catalog_handles),
            "plugin_seconds": round(self.seconds, 6), "recorder_seconds": round(self.rec.stats.seconds, 6),
            **self.attrs,
        })

    def flush(self, force: bool = False) -> None:
        with self.lock:
            if self.rec is None or self.closed or self.broken:
                return
            if force or (self.dirty and time.monotonic() - self.last_flush >= self.cfg.flush_seconds):
                self._write_stats()
                self.rec.flush()
                self.dirty = False
                self.last_flush = time.monotonic()

    def close(self) -> None:
        with self.lock:
            self._close()

    def _close(self) -> None:
        if self.rec is None or self.closed:
            self.closed = True
            return
        if not self.broken and self.pending is not None:
            try:
                _commit(self.pending, None)
            except Exception as e:  # noqa: BLE001
                self.fail("close", e)
        self.closed = True
        if self.broken:
            return
        try:
            self._write_stats()
            self.rec.close()
            log.info("tensordiff: trace closed: %s", self.rec.writer.path)
        except Exception as e:  # noqa: BLE001
            log.exception("tensordiff: closing the trace failed: %s", e)
        for h in self.catalog_handles:
            try:
                h.remove()
            except Exception:  # noqa: BLE001
                pass

    def seq_key(self, req_id: str) -> str:
        """The sequence key of a vLLM request: its external id (vLLM appends ``-<8 hex>`` to make
        the internal one), unless two live requests share that external id."""
        k = self.keys.get(req_id)
        if k is None:
            m = _INTERNAL_ID.match(req_id)
            k = m.group(1) if m and m.group(1) else req_id
            if self.key_owner.get(k, req_id) != req_id:
                k = req_id
            self.key_owner.setdefault(k, req_id)
            self.keys[req_id] = k
        return k


_STATE = _State()
atexit.register(_STATE.close)


def _hook_shutdown(wrapper, *args, **kwargs) -> None:
    _STATE.close()


IDLE_FLUSH_SECONDS = 1.0


def _idle_flusher() -> None:
    """Flush the trace once the engine has been idle for a second (a server's Worker is killed when
    it stops, and vLLM runs no step, so no hook, while it waits for requests)."""
    st = _STATE
    while not (st.closed or st.broken):
        time.sleep(IDLE_FLUSH_SECONDS / 2)
        if st.dirty and time.monotonic() - st.last_activity >= IDLE_FLUSH_SECONDS:
            try:
                st.flush(force=True)
            except Exception as e:  # noqa: BLE001
                with st.lock:
                    st.fail("idle flush", e)


def _hook_init_device(out, wrapper, *args, **kwargs) -> None:
    """The Worker has made its model runner: say so when it is one the recorder does not tap."""
    runner = getattr(getattr(wrapper, "worker", None), "model_runner", None)
    mod = type(runner).__module__ if runner is not None else ""
    if mod.startswith("vllm.v1.worker.gpu."):  # the V2 model runner (vllm/v1/worker/gpu/model_runner.py)
        _STATE.broken = True
        log.error("tensordiff: not recording: vLLM runs its V2 model runner (%s), which this recorder does not "
                  "tap; start vLLM with VLLM_USE_V2_MODEL_RUNNER=0 to record", type(runner).__name__)


# ----------------------------------------------------------------------------------------------
# Start-up: resolved ids, rank plan, trace, catalog taps
# ----------------------------------------------------------------------------------------------


def _rank_plan(runner) -> tuple[bool, str, dict]:
    pc = getattr(runner, "parallel_config", None) or getattr(runner.vllm_config, "parallel_config", None)
    tp_size = int(getattr(pc, "tensor_parallel_size", 1) or 1)
    pp_size = int(getattr(pc, "pipeline_parallel_size", 1) or 1)
    dp_size = int(getattr(pc, "data_parallel_size", 1) or 1)
    dp = int(getattr(pc, "data_parallel_rank", 0) or 0)
    tp, last_pp = 0, True
    try:
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group
        tp = int(get_tp_group().rank_in_group)
        last_pp = bool(get_pp_group().is_last_rank)
    except Exception:  # noqa: BLE001
        pass
    facts = {"tp_rank": tp, "tp_size": tp_size, "pp_size": pp_size, "pp_last_rank": last_pp,
             "dp_rank": dp, "dp_size": dp_size, "replicated": True}
    # hidden states are replicated across TP ranks; aux states and the drafter live on the last
    # PP stage; each DP replica serves its own requests
    return tp == 0 and last_pp, (f".dp{dp}" if dp_size > 1 else ""), facts


def _draft_config_dict(runner) -> dict | None:
    sc = getattr(runner, "speculative_config", None)
    dmc = getattr(sc, "draft_model_config", None)
    hf = getattr(dmc, "hf_config", None)
    if hf is None:
        return None
    try:
        return hf.to_dict()
    except Exception:  # noqa: BLE001
        return None


def _setup(runner) -> None:
    from .. import conventions
    from ..vocab import boundary_label

    st = _STATE
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
    dcfg = _draft_config_dict(runner)
    if dcfg is not None:
        notes = conventions.draft_config_notes("vllm", dcfg, n) + conventions.draft_config_notes("vllm-v2", dcfg, n)
        if notes:
            st.attrs["draft_config_notes"] = notes
            for i, note in enumerate(notes):
                st.warn_once(f"draft-config-{i}", "%s", note)
    record, suffix, facts = _rank_plan(runner)
    st.attrs["ranks"] = facts
    if not record:
        st.role = "off"
        return
    st.role = "record"
    import torch
    import vllm

    from .core import Recorder, Sampling

    dtype = str(getattr(runner.model_config, "dtype", "")).replace("torch.", "")
    st.model = {"num_layers": n, "hidden_size": h, "architecture": arch, "dtype": dtype,
                "path": str(getattr(runner.model_config, "model", "") or "")}
    eager = _eager(runner)
    meta = {"command": "vllm plugin", "aux_hidden_state_layers": captured, "draft_layer_ids": raw,
            "convention": "vllm", "speculative_method": method,
            "draft_model": getattr(sc, "model", None), "num_speculative_tokens": getattr(sc, "num_speculative_tokens", None),
            "enforce_eager": eager, "ranks": facts, "catalog": cfg.catalog,
            **{k: st.attrs[k] for k in ("capture_order_note", "draft_config_notes") if k in st.attrs}}
    wkw: dict = {"flush_seconds": cfg.flush_seconds}
    if cfg.compression:
        wkw["compression"] = cfg.compression
    kw: dict = {}
    if cfg.sketch_dim is not None:
        kw["sketch_dim"] = cfg.sketch_dim
    if cfg.sketch_seed is not None:
        kw["sketch_seed"] = cfg.sketch_seed
    path = rank_path(cfg.path, suffix)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    st.path = path
    st.rec = Recorder(path, side="serve", producer=f"tensordiff vllm plugin (vllm {vllm.__version__})",
                      model=st.model, meta=meta, values=cfg.values, sample=Sampling(every=cfg.sample_every),
                      writer_kwargs=wkw, **kw)
    st.rec.writer.set_attr(None, "versions_serve", {"vllm": vllm.__version__, "torch": torch.__version__})
    log.info("tensordiff: recording to %s (slots %s from draft ids %s, vllm)", path, st.labels, raw)
    threading.Thread(target=_idle_flusher, name="tensordiff-idle-flush", daemon=True).start()
    if captured is None and not cfg.catalog:
        st.warn_once("nothing", "this engine captures no aux hidden states (no EAGLE-3 draft) and TENSORDIFF_CATALOG "
                     "is off: only token rows are recorded")
    if cfg.catalog:
        if eager:
            _install_catalog(model)
        else:
            st.warn_once("catalog-compiled", "the catalog needs eager mode (enforce_eager=True / --enforce-eager): "
                         "module hooks do not run inside torch.compile graphs or CUDA graphs; recording without it")


def _eager(runner) -> bool:
    if bool(getattr(runner.model_config, "enforce_eager", False)):
        return True
    cc = getattr(runner.vllm_config, "compilation_config", None)
    mode = getattr(cc, "mode", None)
    cg = getattr(cc, "cudagraph_mode", None)
    return getattr(mode, "name", str(mode)) == "NONE" and getattr(cg, "name", "NONE") == "NONE"


def _install_catalog(model) -> None:
    from .hf import find_decoder

    st = _STATE
    try:
        layers, norm, _ = find_decoder(model)
    except ValueError as e:
        st.warn_once("catalog", "no catalog taps: %s", e)
        return
    n = st.model.get("num_layers") or len(layers)
    for b, layer in enumerate(layers):
        if b >= n or type(layer).__name__ == "PPMissingLayer":
            continue
        st.catalog_handles.append(layer.register_forward_pre_hook(_layer_hook(b), with_kwargs=True))
    if type(norm).__name__ != "PPMissingLayer":
        st.catalog_handles.append(norm.register_forward_pre_hook(_norm_pre_hook(n), with_kwargs=True))
        st.catalog_handles.append(norm.register_forward_hook(_norm_hook))


def _tap(kind: str, b: int | None, value) -> None:
    st = _STATE
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
        st.seconds += time.perf_counter() - t0


def _arg(args, kwargs, i: int, name: str):
    if name in kwargs:
        return kwargs[name]
    return args[i] if len(args) > i else None


def _layer_hook(b: int):
    def pre_hook(module, args, kwargs):
        if _STATE.ctx is None:
            return None
        hs = _arg(args, kwargs, 1, "hidden_states")   # (positions, hidden_states, residual)
        res = _arg(args, kwargs, 2, "residual")
        if hs is not None:
            _tap("boundary", b, hs if res is None else hs + res)
        return None
    return pre_hook


def _norm_pre_hook(n: int):
    def pre_hook(module, args, kwargs):
        if _STATE.ctx is None:
            return None
        x = _arg(args, kwargs, 0, "x")
        res = _arg(args, kwargs, 1, "residual")
        if x is not None:  # before the norm: fused add-norm kernels update x and residual in place
            _tap("boundary", n, x if res is None else x + res)
        return None
    return pre_hook


def _norm_hook(module, args, output):
    if _STATE.ctx is None:
        return None
    _tap("final_norm", None, output[0] if isinstance(output, (tuple, list)) else output)
    return None


# ----------------------------------------------------------------------------------------------
# Target steps
# ----------------------------------------------------------------------------------------------


def _hook_execute_model(original, runner, scheduler_output, *args, **kwargs):
    st = _STATE
    if st.cfg is None or st.broken or st.closed:
        return original(runner, scheduler_output, *args, **kwargs)
    n = int(getattr(scheduler_output, "total_num_scheduled_tokens", 0) or 0)
    if st.role is None and n > 0:
        try:
            _setup(runner)
        except Exception as e:  # noqa: BLE001
            st.role = "off"
            st.fail("start-up", e)
    if not st.active or n == 0:
        return original(runner, scheduler_output, *args, **kwargs)
    st.last_activity = time.monotonic()
    if st.pending is not None:  # a step whose sampling we did not see: keep what is certain
        try:
            with st.lock:
                _commit(st.pending, None)
        except Exception as e:  # noqa: BLE001
            st.fail("target step", e)
    st.sched = scheduler_output
    st.forwarded = False
    try:
        return original(runner, scheduler_output, *args, **kwargs)
    finally:
        st.sched = None
        st.ctx = None


def _np(t):
    import numpy as np
    import torch

    if isinstance(t, torch.Tensor):
        return t.detach().reshape(-1).cpu().numpy()
    return np.asarray(t).reshape(-1)


def _hook_model_forward(original, runner, *args, **kwargs):
    st = _STATE
    if st.sched is None or st.forwarded or not st.active:
        return original(runner, *args, **kwargs)
    st.forwarded = True
    t0 = time.perf_counter()
    step = None
    try:
        step = _begin_step(runner, st.sched, kwargs.get("input_ids", args[0] if args else None),
                           kwargs.get("positions", args[1] if len(args) > 1 else None))
    except Exception as e:  # noqa: BLE001
        st.fail("target step", e)
    st.seconds += time.perf_counter() - t0
    st.ctx = step
    try:
        out = original(runner, *args, **kwargs)
    finally:
        st.ctx = None
    if step is None or not st.active:
        return out
    t0 = time.perf_counter()
    try:
        if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], (list, tuple)):
            aux = out[1]
            T = len(step.pos)
            if st.labels is not None and len(aux) == len(st.labels) and aux[0].shape[0] >= T:
                import torch
                step.aux = torch.cat([a[:T] for a in aux], dim=-1)
            elif st.labels is not None:
                st.warn_once("aux-shape", "the model returned %d aux states for %d slots; not recorded",
                             len(aux), len(st.labels))
        st.pending = step
    except Exception as e:  # noqa: BLE001
        st.fail("target step", e)
    st.seconds += time.perf_counter() - t0
    return out


def _begin_step(runner, sched, input_ids, positions) -> _Step | None:
    import numpy as np

    st = _STATE
    req_ids = list(runner.input_batch.req_ids)
    counts = [int(sched.num_scheduled_tokens.get(r, 0)) for r in req_ids]
    T = sum(counts)
    if input_ids is None:
        st.warn_once("no-ids", "a step ran from input embeddings (no input ids): not recorded")
        return None
    if positions is not None and getattr(positions, "ndim", 1) == 2:  # M-RoPE [3, T]: the text position
        positions = positions[0]
    ids = _np(input_ids[:T]).astype(np.int64)
    pos = _np(positions[:T]).astype(np.int64) if positions is not None else None
    if pos is None or len(ids) != T or len(pos) != T:
        st.warn_once("rows", "a step's input ids / positions do not match its %d scheduled tokens; not recorded", T)
        return None
    spec = getattr(sched, "scheduled_spec_decode_tokens", None) or {}
    segments, regimes, prompt_lens, limits = [], [], [], []
    start = 0
    batch_idx = []
    for bi, (r, c) in enumerate(zip(req_ids, counts)):
        if c == 0:
            continue
        rs = runner.requests.get(r)
        plen = len(getattr(rs, "prompt_token_ids", None) or []) if rs is not None else 0
        n_spec = len(spec.get(r) or ())
        if pos[start] < plen:
            regime = "prefill"
        elif n_spec:
            regime = "target_verify"
        else:
            regime = "decode"
        mt = getattr(getattr(rs, "sampling_params", None), "max_tokens", None)
        segments.append((st.seq_key(r), start, c, n_spec, r))
        batch_idx.append(bi)
        regimes.append(regime)
        prompt_lens.append(plen)
        limits.append(plen + int(mt) if mt is not None and plen else None)
        start += c
    st.step_no += 1
    step = _Step(st.step_no, segments, pos, ids, regimes, prompt_lens, limits)
    step.batch_idx = batch_idx
    step.num_reqs = len(req_ids)
    for i, ((_, _, _, _, r), regime) in enumerate(zip(segments, regimes)):
        if regime == "prefill":
            step.prompts[i] = getattr(runner.requests.get(r), "prompt_token_ids", None)
    return step


def _hook_sample(out, runner, *args, **kwargs) -> None:
    st = _STATE
    step = st.pending
    if step is None or not st.active:
        return
    st.pending = None
    t0 = time.perf_counter()
    try:
        sampled = getattr(out, "sampled_token_ids", None)
        sampled = _np_2d(sampled) if sampled is not None else None
        with st.lock:
            _commit(step, sampled)
        st.flush()
        st.last_activity = time.monotonic()
    except Exception as e:  # noqa: BLE001
        st.fail("target step", e)
    st.seconds += time.perf_counter() - t0


def _np_2d(t):
    import torch

    if isinstance(t, torch.Tensor):
        x = t.detach().cpu().numpy()
        return x.reshape(x.shape[0], -1)
    return None


def _commit(step: _Step, sampled) -> None:
    """Write the rows of a step that the request keeps, then its held tensors."""
    import numpy as np

    st = _STATE
    rec = st.rec
    T = len(step.pos)
    step.rows = np.full(T, -1, dtype=np.int64)
    for i, ((key, s, c, n_spec, _), regime) in enumerate(zip(step.segments, step.regimes)):
        keep = np.arange(s, s + c)
        bi = step.batch_idx[i]  # the sampler's row of this request
        got = sampled[bi][sampled[bi] >= 0] if sampled is not None and bi < sampled.shape[0] else None
        acc = got
        if n_spec and regime == "target_verify":
            if got is not None:
                keep = keep[:max(1, len(got))]  # accepted drafts + the bonus token
            else:
                keep = keep[:1]  # only the request's last token is certainly kept
        lim = step.limits[i]
        if lim is not None:
            keep = keep[step.pos[keep] < lim]
        st.rows_dropped += c - len(keep)
        if len(keep):
            step.rows[keep] = rec.add_tokens(key, step.pos[keep], step.ids[keep], regime=regime, step=step.step)
            st.rows_written += len(keep)
            for j in keep:
                step.next_tok[(key, int(step.pos[j]))] = int(step.ids[j])
            # the token after the last kept row: the next prompt token of a partial prefill, or the
            # token the target sampled
            last = int(step.pos[keep[-1]]) + 1
            if last < step.prompt_lens[i]:
                rs_tok = _prompt_token(step, i, last)
                if rs_tok is not None:
                    step.next_tok[(key, last)] = rs_tok
            elif acc is not None and len(acc):
                step.next_tok[(key, last)] = int(acc[-1])
    st.dirty = True
    if step.aux is not None and (step.rows >= 0).any():
        _record_aux(step.aux, step.rows)
    for kind, b, value in step.stash:
        if kind == "final_norm":
            rec.final_norm(value, step.rows, values=st.cfg.wants_values("final_norm"))
        else:
            from ..vocab import boundary_label
            rec.boundary(b, value, step.rows, values=st.cfg.wants_values(boundary_label(b)))
    step.stash.clear()
    step.aux = None
    st.last = step


def _prompt_token(step: _Step, i: int, p: int) -> int | None:
    ids = step.prompts.get(i)
    return int(ids[p]) if ids is not None and p < len(ids) else None


def _record_aux(aux, rows) -> None:
    st = _STATE
    h = st.model.get("hidden_size") or 0
    if aux.shape[-1] != len(st.labels) * h:
        st.warn_once("aux-width", "aux hidden states are %d wide, not %d slots x %d; not recorded",
                     aux.shape[-1], len(st.labels), h)
        return
    st.rec.packed(AUX, aux, rows, labels=st.labels, raw_ids=st.raw_ids, convention=st.convention,
                  token_offset=0, role="aux", values=st.cfg.wants_values(AUX),
                  attrs={"source": "target model aux_hidden_states (EagleModelMixin._maybe_add_hidden_state), "
                                   "packed in capture order"})


# ----------------------------------------------------------------------------------------------
# The drafter
# ----------------------------------------------------------------------------------------------

_PROPOSE_SIG: dict = {}


def _hook_propose(original, proposer, *args, **kwargs):
    st = _STATE
    if not st.active or st.last is None or st.labels is None:
        return original(proposer, *args, **kwargs)
    ctx = None
    try:
        import inspect

        sig = _PROPOSE_SIG.get(original)
        if sig is None:
            sig = _PROPOSE_SIG[original] = inspect.signature(original)
        b = sig.bind(proposer, *args, **kwargs).arguments
        hs = b.get("target_hidden_states")
        h = st.model.get("hidden_size") or 0
        if hs is not None and hs.shape[-1] == len(st.labels) * h:
            cad = b.get("common_attn_metadata")
            qsl = getattr(cad, "query_start_loc_cpu", None)
            if qsl is None:
                qsl = getattr(cad, "query_start_loc", None)
            ctx = {"hs": hs, "pos": b.get("target_positions"), "tok": b.get("target_token_ids"),
                   "qsl": qsl, "ids": None, "step": st.last}
    except Exception as e:  # noqa: BLE001
        st.fail("draft pass", e)
    st.draft_ctx = ctx
    try:
        return original(proposer, *args, **kwargs)
    finally:
        st.draft_ctx = None
        if ctx is not None and st.active:
            t0 = time.perf_counter()
            try:
                with st.lock:
                    _record_draft(ctx)
                st.last_activity = time.monotonic()
            except Exception as e:  # noqa: BLE001
                st.fail("draft pass", e)
            st.seconds += time.perf_counter() - t0


def _hook_set_inputs_first_pass(out, proposer, *args, **kwargs) -> None:
    ctx = _STATE.draft_ctx
    if ctx is None or ctx["ids"] is not None:
        return
    try:
        num_tokens = int(out[0])
        buf = getattr(proposer, "input_ids", None)
        if buf is not None and not getattr(proposer, "needs_extra_input_slots", False):
            ctx["ids"] = _np(buf[:num_tokens]).copy()
    except Exception:  # noqa: BLE001
        ctx["ids"] = None


def _record_draft(ctx: dict) -> None:
    import numpy as np

    st = _STATE
    step: _Step = ctx["step"]
    hs = ctx["hs"]
    n = hs.shape[0]
    pos_t = ctx["pos"]
    if pos_t is not None and getattr(pos_t, "ndim", 1) == 2:
        pos_t = pos_t[0]
    pos = _np(pos_t[:n]).astype(np.int64)
    qsl = _np(ctx["qsl"]).astype(np.int64)
    if len(qsl) - 1 != step.num_reqs or qsl[-1] > n:
        st.draft_unmatched += 1
        st.warn_once("draft-unmatched", "a drafter batch of %d requests does not match the target step's %d; "
                     "not recorded", len(qsl) - 1, step.num_reqs)
        return
    # draft row j -> the target row of the same (request, position) in the step the drafter reads
    by_key = {}
    for key, s, c, _, _ in step.segments:
        for j in range(s, s + c):
            by_key[(key, int(step.pos[j]))] = int(step.rows[j])
    rows = np.full(n, -1, dtype=np.int64)
    keys = [None] * n
    for seg, bi in zip(step.segments, step.batch_idx):
        key = seg[0]
        for j in range(int(qsl[bi]), int(qsl[bi + 1])):
            rows[j] = by_key.get((key, int(pos[j])), -1)
            keys[j] = key
    if not (rows >= 0).any():
        return
    ids = ctx["ids"]
    if ids is not None and len(ids) >= n:
        ids = ids[:n].astype(np.int64)
        for j in np.flatnonzero(rows >= 0):
            want = step.next_tok.get((keys[j], int(pos[j]) + 1))
            if want is None:
                continue
            st.shift_checked += 1
            if int(ids[j]) != want:
                st.shift_mismatched += 1
                st.warn_once("shift", "draft input ids are not the target's tokens shifted by one (request %s)", keys[j])
    else:
        ids = None
    got = st.rec.packed(DRAFT, hs[:n], rows, labels=st.labels, raw_ids=st.raw_ids, convention=st.convention,
                        token_offset=1, role="draft_input", values=st.cfg.wants_values(DRAFT),
                        attrs={"source": "drafter propose(target_hidden_states): the input of "
                                         "combine_hidden_states (the draft's fc)"})
    if got and ids is not None:
        _record_draft_ids(ids, rows)
    st.dirty = True


def _record_draft_ids(ids, rows) -> None:
    import numpy as np

    st = _STATE
    rec = st.rec
    keep = rows >= 0
    if not rec.sample.keeps_all:
        keep &= rec.sample.mask(rec.positions_of(np.where(keep, rows, 0)))
    if not keep.any():
        return
    w = rec.writer
    if not st.draft_ids_defined:
        st.draft_ids_defined = True
        w.define_tensor(DRAFT_IDS, 1, kind="other", dtype="float64", role="draft_input_ids", token_offset=1,
                        values=True, sketch=False,
                        attrs={"what": "the input token id the drafter paired with each draft_input row (token t+1)"})
    vals = ids[keep].astype(np.float64)[:, None]
    w.append(DRAFT_IDS, rows[keep], vals, rms=np.abs(vals).astype(np.float32))
