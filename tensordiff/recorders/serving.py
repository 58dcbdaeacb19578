"""What the serve-side plugins (:mod:`.sglang`, :mod:`.vllm`) share, engine-agnostic: reading the
``TENSORDIFF_*`` environment at the entry point, the per-process state's warning and activity
checks, opening the rank's trace, and the ``draft_input_ids`` column.

Standard library only at import time (every engine process that loads a plugin imports this);
numpy and the recorder core are imported inside the functions that need them.
"""

from __future__ import annotations

import logging
import os
from typing import Any


def config_from_env(config_cls, log: logging.Logger):
    """The entry point's configuration: ``config_cls.from_env()``; ``None`` when the plugin is inert
    (``TENSORDIFF_TRACE`` unset) or the environment is bad (logged as one error, never raised)."""
    try:
        return config_cls.from_env()
    except ValueError as e:
        log.error("tensordiff: not recording: %s", e)
        return None


class ServeState:
    """The part of a plugin's per-process state both engines share. A subclass sets :attr:`log` and
    the attributes ``rec``, ``paused``, ``closed``, ``broken``, ``warned`` (a set) and
    ``catalog_handles`` (a list), and defines ``_write_stats``."""

    log: logging.Logger
    rec: Any
    paused: bool
    closed: bool
    broken: bool
    warned: set
    catalog_handles: list

    def warn_once(self, key: str, msg: str, *args) -> None:
        if key not in self.warned:
            self.warned.add(key)
            self.log.warning("tensordiff: " + msg, *args)

    @property
    def active(self) -> bool:
        return self.rec is not None and not (self.paused or self.closed or self.broken)

    def close_trace(self) -> None:
        """The last step of a clean close: the stats attribute (``_write_stats``, the subclass's),
        the trace closed, the catalog taps removed. A failure is logged, never raised."""
        try:
            self.rec.write_staged()  # first: the statistics then count what it wrote
            self._write_stats()
            self.rec.close()
            self.log.info("tensordiff: trace closed: %s", self.rec.writer.path)
        except Exception as e:  # noqa: BLE001
            self.log.exception("tensordiff: closing the trace failed: %s", e)
        for h in self.catalog_handles:
            try:
                h.remove()
            except Exception:  # noqa: BLE001
                self.log.debug("tensordiff: removing a catalog tap failed", exc_info=True)
        self.catalog_handles.clear()


def model_facts(model_config, num_layers: int, hidden_size: int, architecture, path: str) -> dict:
    """The trace's ``model`` attribute: the engine model config's dtype without ``torch.``."""
    from .. import model_config as numerics_config

    dtype = str(getattr(model_config, "dtype", "")).replace("torch.", "")
    out = {"num_layers": num_layers, "hidden_size": hidden_size, "architecture": architecture, "dtype": dtype,
           "path": path}
    hf = getattr(model_config, "hf_text_config", None) or getattr(model_config, "hf_config", None)
    config = numerics_config.from_config(hf, dtype or None) if hf is not None else {}
    if config:
        out["config"] = config
    return out


def open_recorder(cfg, path: str, *, engine: str, version: str, torch_version: str, model: dict, meta: dict):
    """The recording rank's :class:`~tensordiff.recorders.core.Recorder` at ``path`` (its directory
    made), with the environment's flush interval, compression, sketch, sampling and staging, and the
    engine's and torch's versions in ``versions_serve``."""
    from .core import Recorder, Sampling

    wkw: dict = {"flush_seconds": cfg.flush_seconds}
    if cfg.compression:
        wkw["compression"] = cfg.compression
    kw: dict = {}
    if cfg.sketch_dim is not None:
        kw["sketch_dim"] = cfg.sketch_dim
    if cfg.sketch_seed is not None:
        kw["sketch_seed"] = cfg.sketch_seed
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    # sketch=False: tensors that keep full values store no sketch (a reader derives it from the
    # values); the catalog's sketch-only states keep theirs
    rec = Recorder(path, side="serve", producer=f"tensordiff {engine} plugin ({engine} {version})",
                   model=model, meta=meta, values=cfg.values, sample=Sampling(every=cfg.sample_every),
                   sketch=False, stage_bytes=cfg.stage_bytes, writer_kwargs=wkw, **kw)
    rec.writer.set_attr(None, "versions_serve", {engine: version, "torch": torch_version})
    return rec


def record_draft_ids(st, name: str, ids, rows, what: str) -> None:
    """The input id each draft row was paired with (token t+1), as the one-column float64 tensor
    ``name`` (RMS: the id's absolute value): rows ``-1`` (not kept) and positions the sampling
    skips are dropped; ``what`` describes it."""
    import numpy as np

    st.rec.plain(name, np.asarray(ids, dtype=np.float64).reshape(-1, 1), rows, role="draft_input_ids",
                 token_offset=1, attrs={"what": what}, rms="abs")


def resume_topk(st: Any, k: Any) -> int:
    """The top-k a ``tensordiff_resume`` asks for, checked: 0 (predictions off) or the start-up
    ``TENSORDIFF_TOPK`` (on again); another k is refused, since a trace's top-k tables keep one
    width. ``st``: the plugin's state (its ``cfg`` and ``start_topk``)."""
    if st.start_topk is None:
        st.start_topk = st.cfg.topk
    k = int(k)
    if k not in (0, st.start_topk):
        raise ValueError(f"topk={k}: only 0 or the start-up TENSORDIFF_TOPK ({st.start_topk}) can be set")
    return k


# -- the recorder's speed knobs (the serve plugins' only) ---------------------------------------
# A serve plugin records the same states many times a second: ``remember`` / ``reuse`` let the
# draft's input reuse the sketch of the aux states it was made from, and ``private`` says a tensor
# is the plugin's own snapshot (staging keeps it instead of copying it again). They change how
# fast, never what is written, so they are not part of the public Recorder API (docs/recorders.md).


def record(rec: Any, name: str, tensor: Any, rows: Any, *, remember: bool = False, reuse: str | None = None,
           private: bool = False, **kw: Any) -> int:
    """``rec.record(name, tensor, rows, **kw)`` with the speed knobs (see ``Recorder._record``)."""
    return int(rec._record(name, tensor, rows, remember=remember, reuse=reuse, private=private, **kw))


def packed(rec: Any, name: str, parts: Any, rows: Any, *, remember: bool = False, reuse: str | None = None,
           private: bool = False, **kw: Any) -> int:
    """``rec.packed(name, parts, rows, **kw)`` with the speed knobs."""
    return int(rec._packed(name, parts, rows, remember=remember, reuse=reuse, private=private, **kw))


def boundary(rec: Any, b: int, tensor: Any, rows: Any, *, private: bool = False, values: bool | None = None) -> int:
    """``rec.boundary(b, tensor, rows, values=values)``, ``private`` as in :func:`record`."""
    from ..vocab import boundary_label

    return int(rec._record(boundary_label(b), tensor, rows, kind="boundary", boundary=int(b), role="catalog",
                           values=values, private=private))


def final_norm(rec: Any, tensor: Any, rows: Any, *, private: bool = False, values: bool | None = None) -> int:
    """``rec.final_norm(tensor, rows, values=values)``, ``private`` as in :func:`record`."""
    from ..vocab import FINAL_NORM

    return int(rec._record(FINAL_NORM, tensor, rows, kind="final_norm", role="catalog", values=values,
                           private=private))


# -- the RL records' weight fingerprints (both plugins) ---------------------------------------


def engine_fingerprints(model, tp_size: int, source: str) -> dict:
    """The fingerprint document of a live engine model's (shard's) parameters: fused ``qkv_proj``
    split by the heads this shard holds (the model config's heads / TP size). A parameter the
    engine emptied after loading (its kernel keeps a packed copy of its own: vLLM's CPU GEMMs) has
    no bytes to hash: it is listed under ``unreadable`` instead."""
    import torch

    from .. import weights
    from .weights_fp import _stored

    cfg_obj = getattr(model, "config", None)
    cfg_obj = getattr(cfg_obj, "get_text_config", lambda: cfg_obj)() if cfg_obj is not None else None
    config: dict[str, Any] = {}
    for k in ("num_attention_heads", "num_key_value_heads", "num_hidden_layers"):
        v = getattr(cfg_obj, k, None) if cfg_obj is not None else None
        if v is not None:
            config[k] = int(v)
    if tp_size > 1:  # a shard holds heads / tp (key/value heads replicated where fewer than ranks)
        for k in ("num_attention_heads", "num_key_value_heads"):
            if k in config:
                config[k] = max(1, config[k] // tp_size)
    params = []
    unreadable = []
    with torch.no_grad():
        for name, t in model.named_parameters():
            if t.numel() == 0:  # moved into a kernel's own packed copy (vLLM's CPU GEMMs): no bytes to hash here
                unreadable.append(name)
                continue
            dtype, arr = _stored(t)
            params.extend(weights.params_of(name, dtype, arr, config))
    doc = weights.fingerprints_doc(params, config.get("num_hidden_layers"), source)
    if unreadable:
        doc["unreadable"] = unreadable
    return doc
