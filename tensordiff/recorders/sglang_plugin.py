"""The serve-side recorder: an SGLang plugin that records what the engine computes, as it runs.

SGLang loads every ``sglang.srt.plugins`` entry point in each of its processes (``SGLANG_PLUGINS``
restricts which); tensordiff declares ``tensordiff = "tensordiff.recorders.sglang_plugin:register"``.
:func:`register` does nothing at all unless ``TENSORDIFF_TRACE`` names a trace file. Then it
registers these hooks through SGLang's ``HookRegistry`` (nothing else in SGLang is patched):

``ModelRunner.init_attention_backends`` (AROUND; SGLang calls ``model.set_eagle3_layers_to_capture``
    in there, once, before any CUDA graph is captured): after it, the target's resolved
    ``layers_to_capture`` (boundaries: capture id i = the input of decoder layer i) next to the raw
    draft ids SGLang read (``spec_aux_config.eagle_aux_hidden_state_layer_ids``), turned into slot
    labels, with the id convention of the model file (:func:`tensordiff.conventions.sglang_convention_for`)
    and what that convention says the ids should select. Opens the trace (one rank; see below) and,
    with ``TENSORDIFF_CATALOG=1``, installs the per-boundary catalog taps on the target model.
``ModelRunner.forward`` (AROUND), target runner: the token key of every row of the pass (request
    id, absolute position, token id, regime from the forward mode) and the packed aux hidden states
    the logits processor returns (``logits_output.hidden_states``) as ``aux_hidden_states``. Prefill
    chunks and radix-cache hits are keyed by the absolute positions SGLang computes
    (``forward_batch.positions``), so they need nothing special. Target-verify passes are held back
    until the verify result says how many rows each request accepted.
``ModelRunner.forward`` (AROUND), draft runner, draft-extend passes: the exact
    ``forward_batch.spec_info.hidden_states`` the draft's ``fc`` consumes, as ``draft_input``,
    keyed by the target rows it came from (draft row t holds the target's state at position t and is
    paired with the input id of token t+1: ``token_offset=1``), and those shifted input ids as
    ``draft_input_ids``. Rows past a request's accept length are filler and are dropped.
``EAGLEWorkerV2.verify`` (AFTER): commits the held target-verify rows of accepted tokens
    (``j < accept_lens[i]``) and drops those of rejected draft tokens, so a row never claims a
    token for a position that the request did not keep.
``Scheduler.on_idle`` (AFTER): flushes the trace when the scheduler has nothing to run.
``Scheduler.handle_rpc_request`` (AROUND): ``engine.collective_rpc("tensordiff_close")`` closes the
    trace (``tensordiff_flush`` flushes, ``tensordiff_pause`` / ``tensordiff_resume`` switch
    recording off and on); other RPCs pass through.

Catalog taps (``TENSORDIFF_CATALOG=1``): the residual stream entering every decoder layer (SGLang's
own capture callback, the one ``layers_to_capture`` uses, passed to each layer) and the final norm's
input and output, recorded as ``embed``, ``layer<b>``, ``final_norm`` (sketch + RMS; values with
``TENSORDIFF_VALUES``). They run in Python, so they see eager passes only: a CUDA-graph replay
runs none of them, and the plugin says so (once) when it happens.

Tensor parallelism: hidden states are replicated across TP ranks, so one rank (TP rank 0 of each
PP stage / DP replica) records; with DP attention or context parallelism each rank holds its own
rows and writes its own file (``trace.tp<r>.h5``).

Configuration (environment of the server process):

=========================== =====================================================================
``TENSORDIFF_TRACE``        trace path (required; unset = the plugin is inert)
``TENSORDIFF_CATALOG``      ``1``: record the per-boundary catalog on eager passes (default ``0``)
``TENSORDIFF_VALUES``       comma-separated globs of tensors that keep full values (default
                            ``aux_hidden_states,draft_input``; ``all``, ``none``); others keep
                            sketch + RMS
``TENSORDIFF_SAMPLE_EVERY`` record positions ``p % K == 0`` only (default 1: all)
``TENSORDIFF_SKETCH_DIM``, ``TENSORDIFF_SKETCH_SEED``  sketch projection (both sides must agree)
``TENSORDIFF_FLUSH_SECONDS`` flush at least this often while busy (default 10)
``TENSORDIFF_COMPRESSION``  ``gzip`` or ``lzf`` (default none)
=========================== =====================================================================

Importing this module imports neither torch nor sglang; :func:`register` imports sglang only when
``TENSORDIFF_TRACE`` is set.
"""

from __future__ import annotations

import atexit
import fnmatch
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("tensordiff.sglang")

ENV_TRACE = "TENSORDIFF_TRACE"
RPC_PREFIX = "tensordiff_"

_MR = "sglang.srt.model_executor.model_runner.ModelRunner"
HOOK_TARGETS = (
    f"{_MR}.init_attention_backends",
    f"{_MR}.forward",
    "sglang.srt.speculative.eagle_worker_v2.EAGLEWorkerV2.verify",
    "sglang.srt.managers.scheduler.Scheduler.on_idle",
    "sglang.srt.managers.scheduler.Scheduler.handle_rpc_request",
)

AUX = "aux_hidden_states"
DRAFT = "draft_input"
DRAFT_IDS = "draft_input_ids"
DEFAULT_VALUES = (AUX, DRAFT)


# ----------------------------------------------------------------------------------------------
# Configuration
# ----------------------------------------------------------------------------------------------


@dataclass
class Config:
    path: str
    catalog: bool = False
    values: bool | list[str] = field(default_factory=lambda: list(DEFAULT_VALUES))
    sample_every: int = 1
    sketch_dim: int | None = None
    sketch_seed: int | None = None
    flush_seconds: float = 10.0
    compression: str | None = None

    @classmethod
    def from_env(cls, env: dict | None = None) -> "Config | None":
        """The configuration, or None when ``TENSORDIFF_TRACE`` is unset (the plugin is inert).
        Raises ValueError on a malformed variable."""
        env = os.environ if env is None else env
        path = (env.get(ENV_TRACE) or "").strip()
        if not path:
            return None

        def flag(name: str, default: bool) -> bool:
            v = (env.get(name) or "").strip().lower()
            if not v:
                return default
            if v in ("1", "true", "yes", "on"):
                return True
            if v in ("0", "false", "no", "off"):
                return False
            raise ValueError(f"{name}={v!r}: expected 1 or 0")

        def num(name: str, typ, default):
            v = (env.get(name) or "").strip()
            if not v:
                return default
            try:
                return typ(v)
            except ValueError:
                raise ValueError(f"{name}={v!r}: expected a number") from None

        vals_txt = (env.get("TENSORDIFF_VALUES") or "").strip()
        if not vals_txt:
            values: bool | list[str] = list(DEFAULT_VALUES)
        elif vals_txt.lower() == "all":
            values = True
        elif vals_txt.lower() == "none":
            values = False
        else:
            values = [v.strip() for v in vals_txt.split(",") if v.strip()]
        every = num("TENSORDIFF_SAMPLE_EVERY", int, 1)
        if every < 1:
            raise ValueError("TENSORDIFF_SAMPLE_EVERY must be >= 1")
        comp = (env.get("TENSORDIFF_COMPRESSION") or "").strip() or None
        if comp not in (None, "gzip", "lzf"):
            raise ValueError(f"TENSORDIFF_COMPRESSION={comp!r}: expected gzip or lzf")
        flush_s = num("TENSORDIFF_FLUSH_SECONDS", float, 10.0)
        if not flush_s > 0:
            raise ValueError("TENSORDIFF_FLUSH_SECONDS must be > 0")
        return cls(path=path, catalog=flag("TENSORDIFF_CATALOG", False), values=values, sample_every=every,
                   sketch_dim=num("TENSORDIFF_SKETCH_DIM", int, None),
                   sketch_seed=num("TENSORDIFF_SKETCH_SEED", int, None), flush_seconds=flush_s,
                   compression=comp)

    def wants_values(self, name: str) -> bool:
        if isinstance(self.values, bool):
            return self.values
        return any(fnmatch.fnmatchcase(name, p) for p in self.values)


def rank_path(path: str, suffix: str) -> str:
    """``serve.h5`` + ``.tp1`` -> ``serve.tp1.h5`` (the suffix goes before the extension)."""
    if not suffix:
        return path
    root, ext = os.path.splitext(path)
    if ext.lower() not in (".h5", ".hdf5"):
        return path + suffix
    return root + suffix + ext


# ----------------------------------------------------------------------------------------------
# Entry point
# ----------------------------------------------------------------------------------------------


def register() -> None:
    """The ``sglang.srt.plugins`` entry point. Inert unless ``TENSORDIFF_TRACE`` is set."""
    try:
        cfg = Config.from_env()
    except ValueError as e:
        log.error("tensordiff: not recording: %s", e)
        return
    if cfg is None:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    _STATE.cfg = cfg
    hooks = (
        (HOOK_TARGETS[0], _hook_init_attention_backends, HookType.AROUND),
        (HOOK_TARGETS[1], _hook_forward, HookType.AROUND),
        (HOOK_TARGETS[2], _hook_verify, HookType.AFTER),
        (HOOK_TARGETS[3], _hook_on_idle, HookType.AFTER),
        (HOOK_TARGETS[4], _hook_rpc, HookType.AROUND),
    )
    for target, fn, kind in hooks:
        HookRegistry.register(target, fn, kind)


# ----------------------------------------------------------------------------------------------
# State (one per process; only scheduler processes ever get past the first check of a hook)
# ----------------------------------------------------------------------------------------------


@dataclass
class _Pass:
    """One target pass: its aux tensor and the trace row of each of its rows (-1: not kept)."""

    hs: Any
    rows: Any  # np.ndarray[int64]
    keys: tuple  # (rids per row, positions, tokens) as numpy arrays / list
    segments: list  # [(rid, start, count)]
    step: int
    regime: str
    stash: list = field(default_factory=list)  # verify: [(kind, boundary, tensor)] of catalog taps
    committed: bool = False


class _State:
    def __init__(self) -> None:
        self.cfg: Config | None = None
        self.rec = None            # core.Recorder, in the recording process only
        self.role: str | None = None   # None: undecided; "record"; "off" (another rank records)
        self.paused = False
        self.closed = False
        self.broken = False
        self.dirty = False
        self.model: dict = {}
        self.labels: list[str] | None = None
        self.raw_ids: list[int] | None = None
        self.convention: str | None = None
        self.capture_attrs: dict = {}
        self.last_target: _Pass | None = None
        self.pending_verify: _Pass | None = None
        self.ctx_rows = None       # rows of the running target pass, for the catalog taps
        self.ctx_stash: list | None = None
        self.catalog_handles: list = []
        self.catalog_layers = 0
        self.graph_passes = 0
        self.warned: set[str] = set()
        self.shift_checked = 0
        self.shift_mismatched = 0
        self.dropped_rows = 0
        self.draft_unmatched = 0
        self.draft_ids_defined = False
        self.unkeyed_passes = 0
        self.seconds = 0.0         # wall time inside the plugin's recording code

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
        self.broken = True
        if self.rec is not None:
            try:
                self.rec.close(e)
            except Exception:  # noqa: BLE001
                log.exception("tensordiff: closing the trace after the error failed")

    def flush(self) -> None:
        if self.rec is not None and not self.closed and not self.broken and self.dirty:
            self._write_stats()
            self.rec.flush()
            self.dirty = False

    def _write_stats(self) -> None:
        w = self.rec.writer
        w.set_attr(None, "tensordiff_sglang", {
            "draft_shift_checked": self.shift_checked, "draft_shift_mismatched": self.shift_mismatched,
            "rows_dropped": self.dropped_rows,
            "cuda_graph_passes": self.graph_passes, "draft_passes_unmatched": self.draft_unmatched,
            "passes_without_request_ids": self.unkeyed_passes,
            "catalog_layers": self.catalog_layers, "plugin_seconds": round(self.seconds, 6),
            "recorder_seconds": round(self.rec.stats.seconds, 6), **self.capture_attrs,
        })

    def close(self) -> None:
        if self.rec is None or self.closed:
            self.closed = True
            return
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
        self.catalog_handles.clear()


_STATE = _State()


def _atexit_close() -> None:
    _STATE.close()


atexit.register(_atexit_close)


# ----------------------------------------------------------------------------------------------
# Start-up: resolved capture layers, rank plan, trace, catalog taps
# ----------------------------------------------------------------------------------------------


def _hook_init_attention_backends(original, runner, *args, **kwargs):
    result = original(runner, *args, **kwargs)
    st = _STATE
    if st.cfg is None or st.broken:
        return result
    try:
        if not getattr(runner, "is_draft_worker", False):
            _setup_target(runner)
    except Exception as e:  # noqa: BLE001
        st.fail("start-up", e)
    return result


def _server_arg(runner, name: str, default=None):
    return getattr(getattr(runner, "server_args", None), name, default)


def _rank_plan(runner) -> tuple[bool, str, dict]:
    """(record on this process?, file suffix, rank facts)."""
    try:
        from sglang.srt.runtime_context import get_parallel
        par = get_parallel()
    except Exception:  # noqa: BLE001
        par = None

    def rank(name: str) -> int:
        try:
            v = getattr(par, name)
            return int(v) if v is not None else 0
        except Exception:  # noqa: BLE001
            return 0

    tp_size = int(_server_arg(runner, "tp_size", 1) or 1)
    pp_size = int(_server_arg(runner, "pp_size", 1) or 1)
    dp_size = int(_server_arg(runner, "dp_size", 1) or 1)
    tp, pp, dp = rank("tp_rank"), rank("pp_rank"), rank("dp_rank")
    try:
        attn_dp = bool(getattr(par, "attn_dp_enabled", False))
    except Exception:  # noqa: BLE001
        attn_dp = False
    cp = 1
    for name in ("attn_cp_size", "context_parallel_size", "cp_size"):
        v = _server_arg(runner, name, None)
        if isinstance(v, int) and v > 1:
            cp = v
    replicated = not attn_dp and cp == 1
    facts = {"tp_rank": tp, "tp_size": tp_size, "pp_rank": pp, "pp_size": pp_size, "dp_rank": dp,
             "dp_size": dp_size, "replicated": replicated}
    suffix = ""
    if dp_size > 1 and not attn_dp:
        suffix += f".dp{dp}"
    if pp_size > 1:
        suffix += f".pp{pp}"
    if replicated:
        return tp == 0, suffix, facts
    return True, suffix + (f".tp{tp}" if tp_size > 1 else ""), facts


def _find_layers_to_capture(model) -> list[int] | None:
    for obj in (getattr(model, "model", None), model, getattr(getattr(model, "model", None), "model", None)):
        ltc = getattr(obj, "layers_to_capture", None) if obj is not None else None
        if ltc is not None and len(ltc):
            return [int(x) for x in ltc]
    return None


def _setup_target(runner) -> None:
    from .. import conventions
    from ..vocab import boundary_label

    st = _STATE
    cfg = st.cfg
    hf = getattr(getattr(runner, "model_config", None), "hf_config", None)
    text = getattr(hf, "get_text_config", lambda: hf)() if hf is not None else None
    n = int(getattr(text, "num_hidden_layers", 0) or 0)
    h = int(getattr(text, "hidden_size", 0) or 0)
    arch = (getattr(hf, "architectures", None) or [type(runner.model).__name__])[0]
    ltc = _find_layers_to_capture(runner.model)
    aux_cfg = getattr(runner, "spec_aux_config", None)
    raw = getattr(aux_cfg, "eagle_aux_hidden_state_layer_ids", None)
    raw = [int(i) for i in raw] if raw is not None else None
    convention = conventions.sglang_convention_for(arch)
    st.capture_attrs = {"layers_to_capture": ltc, "draft_layer_ids": raw, "convention": convention,
                        "speculative_algorithm": str(_server_arg(runner, "speculative_algorithm", None))}
    if ltc is not None:
        st.labels = [boundary_label(b) for b in ltc]
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
    if st.role is not None:  # a second init (weights reloaded...): keep the trace
        return
    record, suffix, facts = _rank_plan(runner)
    st.capture_attrs["ranks"] = facts
    if not record:
        st.role = "off"
        return
    st.role = "record"
    from .core import Recorder, Sampling

    import sglang
    import torch

    dtype = str(getattr(runner.model_config, "dtype", "")).replace("torch.", "")
    st.model = {"num_layers": n, "hidden_size": h, "architecture": arch, "dtype": dtype,
                "path": str(getattr(runner.model_config, "model_path", "") or _server_arg(runner, "model_path", ""))}
    meta = {"command": "sglang plugin", "layers_to_capture": ltc, "draft_layer_ids": raw,
            "convention": convention, "draft_model": _server_arg(runner, "speculative_draft_model_path", None),
            "cuda_graph": not bool(_server_arg(runner, "disable_cuda_graph", False)), "ranks": facts,
            "catalog": cfg.catalog}
    wkw: dict = {"flush_seconds": cfg.flush_seconds}
    if cfg.compression:
        wkw["compression"] = cfg.compression
    kw: dict = {}
    if cfg.sketch_dim is not None:
        kw["sketch_dim"] = cfg.sketch_dim
    if cfg.sketch_seed is not None:
        kw["sketch_seed"] = cfg.sketch_seed
    path = rank_path(cfg.path, suffix)
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    st.rec = Recorder(path, side="serve", producer=f"tensordiff sglang plugin (sglang {sglang.__version__})",
                      model=st.model, meta=meta, values=cfg.values, sample=Sampling(every=cfg.sample_every),
                      writer_kwargs=wkw, **kw)
    st.rec.writer.set_attr(None, "versions_serve", {"sglang": sglang.__version__, "torch": torch.__version__})
    log.info("tensordiff: recording to %s (slots %s from draft ids %s, %s)", path, st.labels, raw, convention)
    if ltc is None and not cfg.catalog:
        st.warn_once("nothing", "this engine captures no aux hidden states (no EAGLE-3 draft, no "
                     "--enable-return-aux-hidden-states) and TENSORDIFF_CATALOG is off: only token rows are recorded")
    if cfg.catalog:
        _install_catalog(runner)
        if not bool(_server_arg(runner, "disable_cuda_graph", False)):
            st.warn_once("graphs", "catalog taps run only on eager passes; CUDA-graph replays (decode, verify) "
                         "skip them. Start the server with --disable-cuda-graph to record the catalog at every "
                         "token (aux_hidden_states and draft_input are recorded either way).")


# ----------------------------------------------------------------------------------------------
# Catalog taps
# ----------------------------------------------------------------------------------------------


def _install_catalog(runner) -> None:
    import inspect

    from .hf import find_decoder

    st = _STATE
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


def _tap(kind: str, b: int | None, value) -> None:
    st = _STATE
    rows = st.ctx_rows
    if rows is None or not st.active:
        return
    t0 = time.perf_counter()
    try:
        if value.shape[0] != len(rows):
            st.warn_once(f"tap-rows-{b}", "catalog tap %s: %d rows for %d tokens; skipped",
                         kind if b is None else b, value.shape[0], len(rows))
            return
        if st.ctx_stash is not None:  # verify pass: keep until the accepted rows are known
            st.ctx_stash.append((kind, b, value.detach().clone()))
            return
        _record_catalog(kind, b, value, rows)
    except Exception as e:  # noqa: BLE001
        st.fail("catalog tap", e)
    finally:
        st.seconds += time.perf_counter() - t0


def _record_catalog(kind: str, b: int | None, value, rows) -> None:
    st = _STATE
    if kind == "final_norm":
        st.rec.final_norm(value, rows, values=st.cfg.wants_values("final_norm"))
    else:
        from ..vocab import boundary_label
        st.rec.boundary(b, value, rows, values=st.cfg.wants_values(boundary_label(b)))
    st.dirty = True


def _capture_hook(b: int):
    def pre_hook(module, args, kwargs):
        if _STATE.ctx_rows is None:
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
        if _STATE.ctx_rows is None:
            return None
        hs = kwargs.get("hidden_states", args[1] if len(args) > 1 else None)
        res = kwargs.get("residual", args[3] if len(args) > 3 else None)
        if hs is not None:
            _tap("boundary", b, hs if res is None else hs + res)
        return None
    return pre_hook


def _norm_hook(n: int):
    def hook(module, args, output):
        if _STATE.ctx_rows is None:
            return None
        if isinstance(output, (tuple, list)):
            normed = output[0]
            pre = output[1] if len(output) > 1 and output[1] is not None else args[0]
        else:
            normed = output
            pre = args[0] if args else None
        if pre is not None:
            _tap("boundary", n, pre)
        _tap("final_norm", None, normed)
        return None
    return hook


# ----------------------------------------------------------------------------------------------
# Forward passes
# ----------------------------------------------------------------------------------------------


def _np(t):
    import torch
    if isinstance(t, torch.Tensor):
        return t.detach().reshape(-1).cpu().numpy()
    import numpy as np
    return np.asarray(t).reshape(-1)


def _segments(fb, n_rows: int) -> list[tuple[str, int, int]] | None:
    """[(rid, first row, row count)] of a target pass, in batch order."""
    rids = getattr(fb, "rids", None)
    if not rids:
        return None
    mode = fb.forward_mode
    bs = len(rids)
    if mode.is_decode():
        counts = [1] * bs
    elif mode.is_target_verify():
        if n_rows % bs:
            return None
        counts = [n_rows // bs] * bs
    else:
        counts = getattr(fb, "extend_seq_lens_cpu", None)
        if counts is None and getattr(fb, "extend_seq_lens", None) is not None:
            counts = _np(fb.extend_seq_lens).tolist()
        if counts is None:
            return None
        counts = [int(c) for c in counts]
    if sum(counts) != n_rows or len(counts) != bs:
        return None
    out, start = [], 0
    for rid, c in zip(rids, counts):
        out.append((str(rid), start, c))
        start += c
    return out


def _regime(mode) -> str:
    if mode.is_decode():
        return "decode"
    if mode.is_target_verify():
        return "target_verify"
    return "prefill"


def _hook_forward(original, runner, forward_batch, *args, **kwargs):
    st = _STATE
    if not st.active or forward_batch.forward_mode.is_idle():
        return original(runner, forward_batch, *args, **kwargs)
    if getattr(runner, "is_draft_worker", False):
        out = original(runner, forward_batch, *args, **kwargs)
        t0 = time.perf_counter()
        try:
            _record_draft(runner, forward_batch)
        except Exception as e:  # noqa: BLE001
            st.fail("draft pass", e)
        st.seconds += time.perf_counter() - t0
        return out
    t0 = time.perf_counter()
    try:
        pre = _before_target(runner, forward_batch)
    except Exception as e:  # noqa: BLE001
        st.fail("target pass", e)
        return original(runner, forward_batch, *args, **kwargs)
    st.seconds += time.perf_counter() - t0
    try:
        out = original(runner, forward_batch, *args, **kwargs)
    finally:
        st.ctx_rows = None
        st.ctx_stash = None
    t0 = time.perf_counter()
    if pre is not None and st.active:
        try:
            _after_target(runner, forward_batch, out, pre)
        except Exception as e:  # noqa: BLE001
            st.fail("target pass", e)
    st.seconds += time.perf_counter() - t0
    return out


def _before_target(runner, fb) -> dict | None:
    import numpy as np

    st = _STATE
    ids = _np(fb.input_ids).astype(np.int64)
    pos = _np(fb.positions).astype(np.int64) if fb.positions is not None else None
    n = len(ids)
    segs = _segments(fb, n)
    if segs is None or pos is None or len(pos) != n:
        st.unkeyed_passes += 1  # e.g. a warm-up pass without requests: nothing to key its rows by
        log.debug("tensordiff: a %s pass without request ids or row counts; not recorded", fb.forward_mode.name)
        return None
    regime = _regime(fb.forward_mode)
    step = int(getattr(runner, "forward_pass_id", 0)) + 1  # the id ModelRunner.forward is about to take
    rid_rows = np.empty(n, dtype=object)
    for rid, s, c in segs:
        rid_rows[s:s + c] = rid
    p = _Pass(hs=None, rows=np.full(n, -1, dtype=np.int64), keys=(rid_rows, pos, ids), segments=segs,
              step=step, regime=regime)
    if regime == "target_verify":
        st.ctx_stash = p.stash  # rows are committed once the verify result is known
        st.ctx_rows = p.rows
    else:
        for rid, s, c in segs:
            p.rows[s:s + c] = st.rec.add_tokens(rid, pos[s:s + c], ids[s:s + c], regime=regime, step=step)
        p.committed = True
        st.dirty = True
        st.ctx_rows = p.rows
    return {"pass": p}


def _after_target(runner, fb, out, pre: dict) -> None:
    st = _STATE
    p: _Pass = pre["pass"]
    if getattr(out, "can_run_graph", False):
        st.graph_passes += 1
        if st.cfg.catalog:
            st.warn_once("graph-pass", "a %s pass ran as a CUDA graph: the catalog taps did not see it "
                         "(aux_hidden_states and draft_input are still recorded)", fb.forward_mode.name)
    lo = getattr(out, "logits_output", None)
    hs = getattr(lo, "hidden_states", None) if lo is not None else None
    if st.labels is not None:
        if hs is None:
            st.warn_once("no-aux", "a %s pass returned no aux hidden states (was --return-hidden-states-mode "
                         "changed?); its rows have token keys only", fb.forward_mode.name)
        elif hs.shape[0] != len(p.rows):
            st.warn_once("aux-rows", "aux hidden states have %d rows for %d tokens; not recorded",
                         hs.shape[0], len(p.rows))
            hs = None
        else:
            p.hs = hs
    st.last_target = p
    if p.regime == "target_verify":
        st.pending_verify = p
        return
    if p.hs is not None:
        _record_aux(p.hs, p.rows)


def _record_aux(hs, rows) -> None:
    st = _STATE
    width = hs.shape[-1]
    k = len(st.labels)
    h = st.model.get("hidden_size") or 0
    if k * h != width:
        st.warn_once("aux-width", "aux hidden states are %d wide, not %d slots x %d; not recorded", width, k, h)
        return
    st.rec.packed(AUX, hs, rows, labels=st.labels, raw_ids=st.raw_ids, convention=st.convention,
                  token_offset=0, role="aux", values=st.cfg.wants_values(AUX),
                  attrs={"source": "logits_output.hidden_states (target, packed aux capture)"})
    st.dirty = True


def _hook_verify(result, worker, batch, *args, **kwargs):
    st = _STATE
    p = st.pending_verify
    st.pending_verify = None
    if p is None or not st.active:
        return None
    t0 = time.perf_counter()
    try:
        _commit_verify(p, result, batch)
    except Exception as e:  # noqa: BLE001
        st.fail("verify result", e)
    st.seconds += time.perf_counter() - t0
    return None


def _commit_verify(p: _Pass, result, batch) -> None:
    """Keep the verify rows of accepted tokens, drop the rest; then record the held tensors.

    ``result.accept_index`` holds, per request, the flat verify rows of the accepted path (with
    topk 1: the first ``accept_lens[i]`` rows of its block; with a tree: a path through it), -1
    padded. SGLang then moves that path to the front of each block of
    ``logits_output.hidden_states`` (an identity with topk 1), and the draft extend reads that
    tensor: the pass the draft is matched against is re-laid out the same way."""
    import numpy as np

    st = _STATE
    acc = _np(result.accept_lens).astype(np.int64)
    bs = len(p.segments)
    reqs = list(getattr(batch, "reqs", None) or [])
    if len(acc) != bs:
        st.warn_once("verify-bs", "verify result for %d requests, pass had %d; not recorded", len(acc), bs)
        return
    acc_index = getattr(result, "accept_index", None)
    if acc_index is not None:
        acc_index = _np(acc_index).astype(np.int64).reshape(bs, -1)
    rid_rows, pos, ids = p.keys
    n = len(p.rows)
    # the pass as the draft extend sees it: row s + j = the j-th accepted row of the request whose
    # segment starts at row s
    view_rows = np.full(n, -1, dtype=np.int64)
    view_ids = np.zeros(n, dtype=np.int64)
    view_pos = np.zeros(n, dtype=np.int64)
    any_kept = False
    for i, (rid, s, c) in enumerate(p.segments):
        a = int(min(max(acc[i], 0), c))
        if acc_index is not None:
            path = acc_index[i][acc_index[i] >= 0][:a]
            if len(path) != a or (len(path) and (path.min() < s or path.max() >= s + c)):
                st.warn_once("accept-index", "accept_index does not match accept_lens; using the first rows")
                path = np.arange(s, s + a)
        else:
            path = np.arange(s, s + a)
        sel = path
        req = reqs[i] if i < len(reqs) and str(getattr(reqs[i], "rid", rid)) == rid else None
        if req is not None:  # a request stops at max_new_tokens: accepted rows past it are not its tokens
            limit = _position_limit(req)
            if limit is not None:
                sel = sel[pos[sel] < limit]
        st.dropped_rows += c - len(sel)
        if len(sel):
            p.rows[sel] = st.rec.add_tokens(rid, pos[sel], ids[sel], regime="target_verify", step=p.step)
            any_kept = True
        view_rows[s:s + len(path)] = p.rows[path]
        view_ids[s:s + len(path)] = ids[path]
        view_pos[s:s + len(path)] = pos[path]
    p.committed = True
    st.dirty = True
    hs_after = getattr(getattr(result, "logits_output", None), "hidden_states", None)
    view = _Pass(hs=hs_after, rows=view_rows, keys=(rid_rows, view_pos, view_ids), segments=p.segments,
                 step=p.step, regime=p.regime, committed=True)
    st.last_target = view
    if not any_kept:
        p.stash.clear()
        return
    if p.hs is not None:
        _record_aux(p.hs, p.rows)
    for kind, b, value in p.stash:
        _record_catalog(kind, b, value, p.rows)
    p.stash.clear()


def _position_limit(req) -> int | None:
    try:
        prompt = len(req.origin_input_ids)
        m = req.sampling_params.max_new_tokens
        return prompt + int(m) if m is not None else None
    except Exception:  # noqa: BLE001
        return None


def _record_draft(runner, fb) -> None:
    import numpy as np

    st = _STATE
    mode = fb.forward_mode
    if not (mode.is_extend() or mode.is_draft_extend_v2()) or mode.is_target_verify():
        return  # draft decode steps feed the draft its own state, not the target's
    spec = getattr(fb, "spec_info", None)
    hs = getattr(spec, "hidden_states", None)
    if hs is None or st.labels is None:
        return
    h = st.model.get("hidden_size") or 0
    if hs.shape[-1] != len(st.labels) * h:
        return  # not the target's packed aux states
    p = st.last_target
    if p is None or p.hs is None or not _same_tensor(hs, p.hs) or not p.committed:
        st.draft_unmatched += 1
        st.warn_once("draft-unmatched", "a draft-extend pass whose hidden states are not the last target pass's; "
                     "not recorded")
        return
    rows = p.rows.copy()
    ids = _np(fb.input_ids).astype(np.int64)
    if len(ids) != len(rows):
        st.warn_once("draft-rows", "draft pass has %d input ids for %d hidden-state rows; not recorded", len(ids), len(rows))
        return
    n_acc = getattr(spec, "num_accept_tokens", None)
    if n_acc is not None and p.regime == "target_verify":
        acc = _np(n_acc).astype(np.int64)
        for i, (rid, s, c) in enumerate(p.segments):
            if i < len(acc):
                rows[s + int(min(max(acc[i], 0), c)):s + c] = -1  # filler past the accept length
    # the shift check: draft row t's input id is token t+1 of the same request (where the target
    # pass holds that token too)
    tok = p.keys[2]
    for rid, s, c in p.segments:
        seg = np.arange(s, s + c - 1)
        seg = seg[(rows[seg] >= 0) & (rows[seg + 1] >= 0)] if len(seg) else seg
        st.shift_checked += len(seg)
        bad = int(np.count_nonzero(ids[seg] != tok[seg + 1]))
        if bad:
            st.shift_mismatched += bad
            st.warn_once("shift", "draft input ids are not the target's tokens shifted by one (request %s)", rid)
    rec = st.rec
    n = rec.packed(DRAFT, hs, rows, labels=st.labels, raw_ids=st.raw_ids, convention=st.convention,
                   token_offset=1, role="draft_input", values=st.cfg.wants_values(DRAFT),
                   attrs={"source": "draft runner forward_batch.spec_info.hidden_states (the fc input)"})
    if n:
        _record_draft_ids(ids, rows)
    st.dirty = True


def _record_draft_ids(ids, rows) -> None:
    """The input id each draft row was paired with (token t+1), as a one-column float64 tensor."""
    import numpy as np

    rec = _STATE.rec
    keep = rows >= 0
    if not rec.sample.keeps_all:
        keep &= rec.sample.mask(rec.positions_of(np.where(keep, rows, 0)))
    if not keep.any():
        return
    w = rec.writer
    st = _STATE
    if not st.draft_ids_defined:
        st.draft_ids_defined = True
        w.define_tensor(DRAFT_IDS, 1, kind="other", dtype="float64", role="draft_input_ids", token_offset=1,
                        values=True, sketch=False,
                        attrs={"what": "the input token id paired with each draft_input row (token t+1)"})
    vals = ids[keep].astype(np.float64)[:, None]
    w.append(DRAFT_IDS, rows[keep], vals, rms=np.abs(vals).astype(np.float32))


def _same_tensor(a, b) -> bool:
    if a is b:
        return True
    try:
        return a.shape == b.shape and a.data_ptr() == b.data_ptr() and a.dtype == b.dtype
    except Exception:  # noqa: BLE001
        return False


# ----------------------------------------------------------------------------------------------
# Scheduler: idle flushes, RPC
# ----------------------------------------------------------------------------------------------


def _hook_on_idle(result, scheduler, *args, **kwargs):
    st = _STATE
    if st.dirty and st.rec is not None:
        t0 = time.perf_counter()
        try:
            st.flush()
        except Exception as e:  # noqa: BLE001
            st.fail("idle flush", e)
        st.seconds += time.perf_counter() - t0
    return None


RPC_METHODS = ("tensordiff_close", "tensordiff_flush", "tensordiff_pause", "tensordiff_resume")


def _hook_rpc(original, scheduler, recv_req, *args, **kwargs):
    method = getattr(recv_req, "method", "") or ""
    if not method.startswith(RPC_PREFIX):
        return original(scheduler, recv_req, *args, **kwargs)
    st = _STATE
    ok, msg = True, ""
    try:
        if method == "tensordiff_close":
            st.close()
        elif method == "tensordiff_flush":
            st.flush()
        elif method == "tensordiff_pause":
            st.flush()
            st.paused = True
            st.last_target = st.pending_verify = None
        elif method == "tensordiff_resume":
            st.paused = False
            st.last_target = st.pending_verify = None
        else:
            ok, msg = False, f"unknown tensordiff RPC {method!r}; known: {', '.join(RPC_METHODS)}"
    except Exception as e:  # noqa: BLE001
        ok, msg = False, f"{type(e).__name__}: {e}"
    group = getattr(getattr(scheduler, "tp_group", None), "cpu_group", None)
    if group is not None:  # as SGLang's own handler: every TP rank answers together
        try:
            from torch.distributed import barrier
            barrier(group=group)
        except Exception:  # noqa: BLE001
            pass
    from sglang.srt.managers.io_struct import RpcReqOutput
    return RpcReqOutput(success=ok, message=msg)
