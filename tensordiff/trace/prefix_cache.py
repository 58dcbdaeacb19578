"""The prefix cache's record in a rollout trace: which positions of each request the engine took
from its prefix cache (KV computed by an earlier pass) and the weight step that KV was computed
under, next to the weight step that served the request; and every flush of the cache.

A cache kept across a weight update hands a request KV of the old weights: positions 0..n-1 of
it were never computed under the weights that served it, so its log-probs are off the policy
(the RL class "prefix cache kept across weight updates"). The record says so per request, from
what the engine reported (SGLang's ``cached_tokens``) and the weight steps the recorder
fingerprinted (``/weights/step_<k>``, :mod:`tensordiff.trace.rl`).

Layout::

    /prefix_cache            [n] uint8: UTF-8 JSON lines, appended as requests are served
        attrs: engine (str), radix_cache (bool: the engine's prefix cache was on)

Each line is one of:

* a request, at its first result (its prefill done):
  ``{"seq": key, "cached_tokens": n, "weight_step": m, "kv_steps": [[start, end, k], ...],
  "last_flush_forward_step": f}``: positions ``start..end-1`` (half-open, covering 0..n-1) reused
  KV computed under weight step ``k`` (-1: computed before the recorder could tell, e.g. before
  a tracking restart); ``m`` the weight step in force when it was served; ``f`` the forward step
  of the last flush of the cache before it (-1: none since the recorder started);
* a flush: ``{"flush": true, "forward_step": f, "weight_step": k}``: the cache emptied before
  forward pass ``f`` (``k``: the last weight step fingerprinted when it happened; a flush inside a
  weight update comes before that update's step is written, so ``forward_step`` is what places it);
* a restart of the recorder's tracking: ``{"restart": true, "forward_step": f}`` (its table of
  computed prefixes grew past its bound and was emptied: KV computed before it reads as step -1;
  ``f`` -1 where the recorder does not know the forward step).

A request line is written only where the engine's prefix cache is on (SGLang without
``--disable-radix-cache``); a trace without ``/prefix_cache`` says nothing about the cache.

Pure: numpy and h5py, no torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import h5py  # type: ignore[import-untyped, unused-ignore]
import numpy as np

from ..errors import TraceFileError
from ..safety import parse_json
from .validate import follow

PREFIX_CACHE = "prefix_cache"
MAX_PREFIX_CACHE_BYTES = 1 << 30

__all__ = ["PREFIX_CACHE", "PrefixCacheRecord", "append_prefix_cache", "read_prefix_cache"]


@dataclass
class PrefixCacheRecord:
    """What a trace's ``/prefix_cache`` says: per request (the last line of each key), the
    flushes and the tracking restarts, in order."""

    engine: str = ""
    radix_cache: bool | None = None
    requests: dict[str, dict[str, Any]] = field(default_factory=dict)
    flushes: list[dict[str, Any]] = field(default_factory=list)
    restarts: list[dict[str, Any]] = field(default_factory=list)


def append_prefix_cache(writer: Any, lines: list[dict[str, Any]], *, engine: str = "",
                        radix_cache: bool | None = None) -> None:
    """Append ``lines`` (JSON objects) to ``/prefix_cache`` of an open :class:`TraceWriter` (or
    ``h5py.File``), creating it on the first call."""
    f = getattr(writer, "f", writer)
    raw = np.frombuffer("".join(json.dumps(x, separators=(",", ":")) + "\n" for x in lines).encode("utf-8"),
                        dtype=np.uint8)
    if PREFIX_CACHE not in f:
        ds = f.create_dataset(PREFIX_CACHE, shape=(0,), maxshape=(None,), dtype=np.uint8, chunks=(1 << 16,))
        ds.attrs["engine"] = str(engine)
        if radix_cache is not None:
            ds.attrs["radix_cache"] = bool(radix_cache)
    ds = f[PREFIX_CACHE]
    if not raw.size:
        return
    n = int(ds.shape[0])
    ds.resize((n + raw.size,))
    ds[n:] = raw


def read_prefix_cache(reader: Any) -> PrefixCacheRecord | None:
    """The ``/prefix_cache`` record of an open :class:`TraceReader`; None when the trace has none.
    A damaged one is refused (:class:`TraceFileError`); in a trace not closed cleanly a cut last
    line is left out."""
    ds = follow(reader.f, PREFIX_CACHE, f"/{PREFIX_CACHE}")
    if ds is None:
        return None
    if not isinstance(ds, h5py.Dataset) or ds.dtype != np.uint8 or len(ds.shape) != 1:
        raise TraceFileError(f"/{PREFIX_CACHE} is not a 1-D uint8 dataset")
    n = int(ds.shape[0])
    if n > MAX_PREFIX_CACHE_BYTES:
        raise TraceFileError(f"/{PREFIX_CACHE} has {n} bytes (at most {MAX_PREFIX_CACHE_BYTES})")
    try:
        raw = ds[:].tobytes() if n else b""
        engine = ds.attrs.get("engine", "")
        radix = ds.attrs.get("radix_cache")
    except OSError:
        raise TraceFileError(f"/{PREFIX_CACHE} cannot be read") from None
    out = PrefixCacheRecord(engine=str(engine.decode() if isinstance(engine, bytes) else engine)[:64],
                            radix_cache=None if radix is None else bool(radix))
    lines = raw.split(b"\n")
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            doc = parse_json(line, f"/{PREFIX_CACHE} line {i + 1}", error=TraceFileError)
            _add(out, doc, i + 1)
        except TraceFileError:
            if i == len(lines) - 1 and not getattr(reader, "complete", True):
                break   # written in part before the recorder stopped
            raise
    return out


def _int(doc: dict[str, Any], key: str, where: str, default: int | None = None) -> int:
    v = doc.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or abs(v) > 1 << 62:
        raise TraceFileError(f"{where}: {key} is not an integer")
    return v


def _add(out: PrefixCacheRecord, doc: Any, line: int) -> None:
    where = f"/{PREFIX_CACHE} line {line}"
    if not isinstance(doc, dict):
        raise TraceFileError(f"{where} is not a JSON object")
    if doc.get("flush") is True:
        out.flushes.append({"forward_step": _int(doc, "forward_step", where),
                            "weight_step": _int(doc, "weight_step", where, -1)})
        return
    if doc.get("restart") is True:
        out.restarts.append({"forward_step": _int(doc, "forward_step", where)})
        return
    key = doc.get("seq")
    if not isinstance(key, str) or len(key) > 4096:
        raise TraceFileError(f"{where}: seq is not a request key")
    n = _int(doc, "cached_tokens", where, 0)
    if n < 0:
        raise TraceFileError(f"{where}: cached_tokens is negative")
    runs = doc.get("kv_steps", [])
    if not isinstance(runs, list) or len(runs) > 1 << 20:
        raise TraceFileError(f"{where}: kv_steps is not a list of [start, end, step]")
    clean = []
    for r in runs:
        if (not isinstance(r, list) or len(r) != 3 or any(isinstance(x, bool) or not isinstance(x, int) for x in r)
                or not 0 <= r[0] < r[1] <= n or abs(r[2]) > 1 << 62):
            raise TraceFileError(f"{where}: kv_steps is not a list of [start, end, step] within the cached tokens")
        clean.append((int(r[0]), int(r[1]), int(r[2])))
    out.requests[key] = {"cached_tokens": n, "weight_step": _int(doc, "weight_step", where, -1), "kv_steps": clean,
                         "last_flush_forward_step": _int(doc, "last_flush_forward_step", where, -1)}
