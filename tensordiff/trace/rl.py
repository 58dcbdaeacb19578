"""What an RL trainer/rollout comparison needs in a trace besides tensors: the sampling parameters
the engine sampled with (the file attribute ``sampling``) and weight fingerprints per weight-update
step (the group ``/weights``). docs/format.md ("RL records") describes both; the per-token
log-prob of the sampled token is a tensor (``tensordiff.conventions.SAMPLED_LOGPROB``).

Layout::

    /                             attrs: sampling (JSON object, optional)
    /weights/step_<k>             one group per weight step k (0: the weights at record start;
                                  k >= 1: after the k-th weight update the recorder saw)
        attrs: step (int), forward_step (int: the recorder's forward counter, /tokens `step`,
               from which on passes ran with these weights), event (str: start,
               update_weights_from_tensor, update_weights_from_disk, ...), rank (int, -1: none)
        fingerprints              [n] uint8: the UTF-8 JSON of a fingerprint document
                                  (tensordiff.weights.FINGERPRINT_FORMAT)

Pure: numpy and h5py, no torch. Writers take a :class:`~tensordiff.trace.TraceWriter` (its open
``h5py.File`` is ``writer.f``); readers take a :class:`~tensordiff.trace.TraceReader` and apply
the same hostile-file checks as the rest of the reader (links, storage, sizes).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

import h5py  # type: ignore[import-untyped, unused-ignore]
import numpy as np

from ..errors import TraceFileError
from ..safety import parse_json, quoted
from .validate import attr_int, attr_json, attr_str, follow

SAMPLING_ATTR = "sampling"
WEIGHTS_GROUP = "weights"
FINGERPRINTS = "fingerprints"
LOGPROBS_MODES = ("raw", "processed")
MAX_WEIGHT_STEPS = 100_000
MAX_FINGERPRINT_BYTES = 1 << 30
_STEP = re.compile(r"step_(0|[1-9][0-9]{0,8})")

__all__ = ["SAMPLING_ATTR", "WEIGHTS_GROUP", "LOGPROBS_MODES", "WeightStep", "sampling_params",
           "write_sampling", "read_sampling", "sampling_for", "write_weight_step", "read_weight_steps",
           "weights_at"]


# -- sampling parameters -----------------------------------------------------------------------


def sampling_params(*, temperature: float, top_p: float = 1.0, top_k: int = -1, min_p: float = 0.0,
                    logprobs_mode: str = "processed", engine: str = "", **extra: Any) -> dict[str, Any]:
    """The ``sampling`` object: what the engine sampled with and how it computed the log-prob it
    returned. ``logprobs_mode``: ``raw`` (log-softmax of the model's logits, no temperature or
    filtering: vLLM V1's default ``raw_logprobs``) or ``processed`` (after temperature and
    top-p/top-k, the distribution actually sampled from). ``top_k`` -1: no top-k. ``extra``:
    anything else the recorder knows (``per_sequence``: ``{sequence key: {...}}`` where requests
    differ; keys given there override the file-wide ones for that sequence)."""
    if logprobs_mode not in LOGPROBS_MODES:
        raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES}, got {logprobs_mode!r}")
    t = float(temperature)
    if not math.isfinite(t) or t < 0:
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
    out: dict[str, Any] = {"temperature": t, "top_p": float(top_p), "top_k": int(top_k), "min_p": float(min_p),
                           "logprobs_mode": logprobs_mode, "engine": str(engine)}
    out.update(extra)
    return out


def write_sampling(writer: Any, params: dict[str, Any]) -> None:
    """Set the file attribute ``sampling`` of an open :class:`TraceWriter` (or ``h5py.File``)."""
    f = getattr(writer, "f", writer)
    f.attrs[SAMPLING_ATTR] = json.dumps(params)


def read_sampling(reader: Any) -> dict[str, Any] | None:
    """The ``sampling`` object of an open :class:`TraceReader`, None when the trace has none.
    A malformed one is refused (:class:`TraceFileError`)."""
    attrs = reader.f.attrs
    if SAMPLING_ATTR not in attrs:
        return None
    v = attr_json(attrs, SAMPLING_ATTR, None, "the sampling attribute", budget=getattr(reader, "_budget", None))
    if not isinstance(v, dict):
        raise TraceFileError("the sampling attribute is not a JSON object")
    t = v.get("temperature")
    if t is not None and not _finite_non_negative(t):
        shown = (quoted(t) if isinstance(t, str) else repr(t) if isinstance(t, (int, float)) and len(repr(t)) <= 80
                 else f"a number of {len(repr(t))} digits" if isinstance(t, int) else f"a JSON {type(t).__name__}")
        raise TraceFileError(f"the sampling attribute's temperature is {shown}, expected a finite number >= 0")
    mode = v.get("logprobs_mode")
    if mode is not None and mode not in LOGPROBS_MODES:
        shown = quoted(mode) if isinstance(mode, str) else f"a JSON {type(mode).__name__}"
        raise TraceFileError(f"the sampling attribute's logprobs_mode is {shown}, expected one of {LOGPROBS_MODES}")
    per = v.get("per_sequence")
    if per is not None and not (isinstance(per, dict) and all(isinstance(x, dict) for x in per.values())):
        raise TraceFileError("the sampling attribute's per_sequence is not an object of objects")
    return v


def _finite_non_negative(v: Any) -> bool:
    """A number a float holds, finite and >= 0 (an integer of 400 digits is not one: ``float``
    of it overflows)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    try:
        f = float(v)
    except OverflowError:
        return False
    return math.isfinite(f) and f >= 0


def sampling_for(sampling: dict[str, Any] | None, sequence: str) -> dict[str, Any] | None:
    """The parameters one sequence was sampled with (file-wide ones, overridden by its
    ``per_sequence`` entry)."""
    if sampling is None:
        return None
    out = {k: v for k, v in sampling.items() if k != "per_sequence"}
    out.update((sampling.get("per_sequence") or {}).get(sequence, {}))
    return out


# -- weight fingerprints per weight step --------------------------------------------------------


@dataclass(frozen=True)
class WeightStep:
    """The weights a recorder ran from ``forward_step`` on (until the next step's)."""

    step: int
    forward_step: int
    event: str
    rank: int | None
    doc: dict[str, Any]

    def checkpoint(self) -> Any:
        """As a :class:`tensordiff.weights.Checkpoint` (fingerprints only), for
        :func:`tensordiff.weights.compare`."""
        from ..weights import checkpoint_from_doc

        return checkpoint_from_doc(self.doc, f"weights step {self.step}")


def write_weight_step(writer: Any, step: int, doc: dict[str, Any], *, forward_step: int, event: str,
                      rank: int | None = None) -> str:
    """Store ``doc`` (a fingerprint document, :func:`tensordiff.weights.fingerprints_doc` or
    :func:`tensordiff.recorders.weights_fp.model_fingerprints`) as ``/weights/step_<step>`` of an
    open :class:`TraceWriter`; returns the group's path. A step already written is replaced
    (a recorder that sees the same update twice keeps the last)."""
    from ..weights import FINGERPRINT_FORMAT

    step = int(step)
    if step < 0:
        raise ValueError(f"a weight step is >= 0, got {step}")
    if not isinstance(doc, dict) or doc.get("format") != FINGERPRINT_FORMAT:
        raise ValueError(f"not a fingerprint document (format {FINGERPRINT_FORMAT})")
    f = getattr(writer, "f", writer)
    g = f.require_group(WEIGHTS_GROUP)
    name = f"step_{step}"
    if name in g:
        del g[name]
    sg = g.create_group(name)
    sg.attrs["step"] = np.int64(step)
    sg.attrs["forward_step"] = np.int64(forward_step)
    sg.attrs["event"] = str(event)
    sg.attrs["rank"] = np.int64(-1 if rank is None else rank)
    raw = np.frombuffer(json.dumps(doc).encode("utf-8"), dtype=np.uint8)
    sg.create_dataset(FINGERPRINTS, data=raw, chunks=(min(max(raw.size, 1), 1 << 20),))
    return str(sg.name)


def read_weight_steps(reader: Any) -> list[WeightStep]:
    """Every weight step of an open :class:`TraceReader`, by step. Empty when it has none. A
    damaged or crafted group is refused (:class:`TraceFileError`), except in a trace that was not
    closed cleanly, where an unreadable step is left out (written after the last flush)."""
    g = follow(reader.f, WEIGHTS_GROUP, "/weights")
    if g is None:
        return []
    if not isinstance(g, h5py.Group):
        raise TraceFileError("/weights is not a group")
    if len(g) > MAX_WEIGHT_STEPS:
        raise TraceFileError(f"/weights has {len(g)} members (at most {MAX_WEIGHT_STEPS})")
    out = []
    for name in g:
        try:
            out.append(_read_step(g, name))
        except TraceFileError:
            if getattr(reader, "complete", True):
                raise
    return sorted(out, key=lambda s: s.step)


def _read_step(g: Any, name: str) -> WeightStep:
    m = _STEP.fullmatch(name)
    if m is None:   # the name is the file's, of any length: quoted in part, the reason kept
        raise TraceFileError(f"/weights: a weight step is named step_<k> (k of at most 9 digits), not {quoted(name)}")
    where = f"/weights/{name}"
    sg = follow(g, name, where)
    if not isinstance(sg, h5py.Group):
        raise TraceFileError(f"{where} is not a group")
    step = attr_int(sg.attrs, "step", where=where)
    if step != int(m.group(1)):
        raise TraceFileError(f"{where}: its step attribute says {step}")
    fwd = attr_int(sg.attrs, "forward_step", default=0, where=where)
    event = attr_str(sg.attrs, "event", "", where=where)[:256]
    rank = attr_int(sg.attrs, "rank", default=-1, where=where)
    ds = follow(sg, FINGERPRINTS, f"{where}/{FINGERPRINTS}")
    if ds is None or not isinstance(ds, h5py.Dataset):
        raise TraceFileError(f"{where} has no {FINGERPRINTS} dataset")
    if ds.dtype != np.uint8 or len(ds.shape) != 1:
        raise TraceFileError(f"{where}/{FINGERPRINTS} is not a 1-D uint8 dataset")
    n = int(ds.shape[0])
    if n > MAX_FINGERPRINT_BYTES:
        raise TraceFileError(f"{where}/{FINGERPRINTS} has {n} bytes (at most {MAX_FINGERPRINT_BYTES})")
    try:
        raw = ds[:].tobytes()
    except OSError:
        raise TraceFileError(f"{where}/{FINGERPRINTS} cannot be read") from None
    doc = parse_json(raw, f"{where}/{FINGERPRINTS}", error=TraceFileError)
    _check_doc(doc, where)
    return WeightStep(step, fwd, event, None if rank < 0 else rank, doc)


def _check_doc(doc: Any, where: str) -> None:
    from ..weights import FINGERPRINT_FORMAT

    if not isinstance(doc, dict) or doc.get("format") != FINGERPRINT_FORMAT or not isinstance(doc.get("parameters"), list):
        raise TraceFileError(f"{where}: not a fingerprint document (format {FINGERPRINT_FORMAT})")
    for e in doc["parameters"]:
        if not isinstance(e, dict) or not all(k in e for k in ("key", "name", "dtype", "shape", "sha256", "norm")):
            raise TraceFileError(f"{where}: a fingerprint entry lacks key/name/dtype/shape/sha256/norm")


def weights_at(steps: list[WeightStep], forward_step: int) -> WeightStep | None:
    """The weight step a pass with recorder forward counter ``forward_step`` ran with: the last
    step whose ``forward_step`` is at or before it (None: before every recorded step)."""
    best = None
    for s in steps:
        if s.forward_step <= forward_step and (best is None or (s.forward_step, s.step) >= (best.forward_step, best.step)):
            best = s
    return best
