"""Checkpoints compared parameter by parameter, and the weight fingerprint format.

``tensordiff weights A B``: A and B are safetensors checkpoints (a directory of ``*.safetensors``
files, or one file) in HF layout or an engine's fused layout (``qkv_proj``, ``gate_up_proj``,
split by :func:`tensordiff.names.split_widths`), or fingerprint files this module wrote. Each
parameter gets a key ``<canonical state>.<weight|bias>`` (``layer3.mlp_up.weight``: the parameter
that produces tap ``layer3.mlp_up``) when the table knows its module, else its own name, and the
keys are compared in forward order: the first that differs is named with its layer, op and
relative difference ``||B - A|| / ||A||``.

The fingerprint of one parameter (:func:`fingerprint`; format :data:`FINGERPRINT_FORMAT`):
``key``, ``name`` (as stored), ``dtype``, ``shape``, ``sha256`` of its bytes (little-endian, C
order, as stored), ``norm`` (L2 of its values in float64) and ``samples``: ``[index, value]``
pairs at :data:`SAMPLES` flat indices drawn from a generator seeded by the key's CRC-32, so two
sides sample the same places. Equal hashes: equal parameters. Different hashes: the norms and
samples estimate how different (a fingerprint holds no full values). The RL triage records and
compares the same thing.

Safetensors are read here with numpy (an 8-byte header length, a JSON header, raw bytes): no torch,
no pickle. Every offset and shape is checked against the file before anything is read.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import kernels, names
from .errors import SourceFileError, UsageError
from .safety import parse_json, read_json_file, read_regular_file_bounded
from .vocab import FINAL_NORM

FINGERPRINT_FORMAT = "tensordiff.weights.fingerprint/1"
SAMPLES = 8
MAX_HEADER = 100 << 20
MAX_FINGERPRINT_FILE = 1 << 30

_DTYPES = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "BF16": "<u2", "I64": "<i8", "I32": "<i4", "I16": "<i2",
           "I8": "i1", "U8": "u1", "BOOL": "?"}
_DTYPE_NAMES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
                "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}

_L = names._L
_PARAM_OPS: tuple[tuple[str, tuple[str, ...], str | None], ...] = (
    (r"(?:model\.)?embed_tokens", ("embed",), None),
    (r"(?:model\.)?norm", (FINAL_NORM,), None),
    (_L + r"\.input_layernorm", ("attn_norm",), None),
    (_L + r"\.self_attn\.q_proj", ("q",), None),
    (_L + r"\.self_attn\.k_proj", ("k",), None),
    (_L + r"\.self_attn\.v_proj", ("v",), None),
    (_L + r"\.self_attn\.qkv_proj", ("q", "k", "v"), "qkv"),
    (_L + r"\.self_attn\.o_proj", ("attn_out",), None),
    (_L + r"\.post_attention_layernorm", ("mlp_norm",), None),
    (_L + r"\." + names._MOE + r"\.gate", ("router",), None),
    (_L + r"\.mlp\.gate_proj", ("mlp_gate",), None),
    (_L + r"\.mlp\.up_proj", ("mlp_up",), None),
    (_L + r"\.mlp\.gate_up_proj", ("mlp_gate", "mlp_up"), "gate_up"),
    (_L + r"\.mlp\.down_proj", ("mlp_out",), None),
)


def _param_ops(name: str) -> tuple[tuple[str, ...], str | None, str] | None:
    module, _, suffix = name.rpartition(".")
    for pattern, ops, split in _PARAM_OPS:
        m = re.fullmatch(pattern, module)
        if m:
            b = m.groupdict().get("b")
            out = tuple(op if b is None else names.tap_name(int(b), op) for op in ops)
            return out, split, suffix
    return None


def param_key(name: str) -> tuple[str | None, str]:
    """(canonical state the parameter produces, or None; ``weight``/``bias``/...) of an unfused
    parameter name."""
    got = _param_ops(name)
    if got is None or got[1] is not None:
        return None, name.rpartition(".")[2]
    return got[0][0], got[2]


def _order(canon: str | None, num_layers: int | None) -> float:
    if canon is None:
        return float("inf")
    return names.parse_state(canon).order(num_layers)


# ----------------------------------------------------------------------------------------------
# Reading safetensors
# ----------------------------------------------------------------------------------------------


@dataclass
class Param:
    """One parameter (or one part of a fused one) of a checkpoint."""

    key: str
    name: str
    canon: str | None
    dtype: str
    values: np.ndarray | None     # stored values (bf16 as uint16 bits); None for a fingerprint
    fp: dict[str, Any] | None = None

    def fingerprint(self) -> dict[str, Any]:
        if self.fp is None:
            assert self.values is not None
            self.fp = fingerprint(self.key, self.name, self.dtype, self.values)
        return self.fp


def _floats(dtype: str, a: np.ndarray) -> np.ndarray:
    if dtype == "bfloat16":
        return (a.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return a.astype(np.float64)


def fingerprint(key: str, name: str, dtype: str, stored: np.ndarray) -> dict[str, Any]:
    """The fingerprint of one parameter (module docstring); ``stored``: its values as stored
    (bf16 as uint16 bits)."""
    flat = np.ascontiguousarray(stored).reshape(-1)
    vals = _exact_floats(dtype, flat)
    sq = np.zeros(1)
    if flat.size:
        kernels.row_dots(vals[None, :], vals[None, :], sq)   # float64 sums, no float64 copy of the values
    rng = np.random.default_rng(zlib.crc32(key.encode()))
    idx = np.sort(rng.choice(flat.size, size=min(SAMPLES, flat.size), replace=False)) if flat.size else np.array([], int)
    return {"key": key, "name": name, "dtype": dtype, "shape": list(stored.shape),
            "sha256": hashlib.sha256(flat.data.cast("B")).hexdigest(), "norm": float(np.sqrt(sq[0])),
            "samples": [[int(i), float(vals[i])] for i in idx]}


def _exact_floats(dtype: str, a: np.ndarray) -> np.ndarray:
    """The stored values widened exactly: half-precision floats (and bf16 bits) to float32, which
    holds them all; float32 and float64 as they are; anything else to float64."""
    if dtype == "bfloat16":
        return (a.astype(np.uint32) << 16).view(np.float32)
    if a.dtype.kind == "f" and a.itemsize <= 4:
        return a.astype(np.float32, copy=False)
    return a.astype(np.float64, copy=False)


def _files(path: str) -> list[str]:
    if os.path.isfile(path):
        return [path]
    if not os.path.isdir(path):
        raise UsageError("not found (give a safetensors checkpoint directory or file, or a fingerprint file)", path)
    root = os.path.realpath(path)
    out = []
    for f in sorted(os.listdir(path)):
        p = os.path.join(path, f)
        if f.endswith(".safetensors") and os.path.isfile(p):
            if os.path.commonpath([root, os.path.realpath(p)]) != root:
                continue  # never follow a link out of the input
            out.append(p)
    if not out:
        raise SourceFileError("holds no *.safetensors file", path)
    return out


def read_safetensors(path: str) -> Iterator[tuple[str, str, np.ndarray]]:
    """(name, dtype name, values as stored) of every tensor of one safetensors file, read one
    tensor at a time. Read, not memory-mapped: a file cut short while it is read (another process
    still writing or replacing it) is then a short read and one line, where a mapping would kill
    the process with SIGBUS at the first page past the new end."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise SourceFileError("not a safetensors file (shorter than its header length)", path)
        n = int.from_bytes(head, "little")
        if n < 2 or n > MAX_HEADER or 8 + n > size:
            raise SourceFileError("not a safetensors file (bad header length)", path)
        header = parse_json(f.read(n), "the safetensors header", path)
        if not isinstance(header, dict):
            raise SourceFileError("not a safetensors file (header is not an object)", path)
        avail = size - 8 - n
        for name, spec in header.items():
            if name == "__metadata__":
                continue
            try:
                dt, shape, (s, e) = spec["dtype"], [int(x) for x in spec["shape"]], spec["data_offsets"]
                s, e = int(s), int(e)
            except (KeyError, TypeError, ValueError):
                raise SourceFileError(f"tensor {name!r}: bad header entry", path) from None
            if dt not in _DTYPES:
                raise SourceFileError(f"tensor {name!r}: unsupported dtype {dt!r}", path)
            np_dt = np.dtype(_DTYPES[dt])
            count = math.prod(shape)   # exact: a crafted shape past 2**64 must not wrap
            if any(x < 0 for x in shape) or not 0 <= s <= e or e - s != count * np_dt.itemsize or e > avail:
                raise SourceFileError(f"tensor {name!r}: offsets or shape outside the file", path)
            raw = np.empty(e - s, np.uint8)
            f.seek(8 + n + s)
            got = f.readinto(raw.data) if e > s else 0
            if got != e - s:
                raise SourceFileError(f"tensor {name!r}: the file was cut short while it was read", path)
            yield name, _DTYPE_NAMES[dt], raw.view(np_dt).reshape(shape)


def _config(path: str) -> dict[str, Any]:
    d = path if os.path.isdir(path) else os.path.dirname(path)
    p = os.path.join(d, "config.json")
    if not os.path.isfile(p):
        return {}
    cfg = read_json_file(p, "the checkpoint's config.json")
    if isinstance(cfg, dict) and isinstance(cfg.get("text_config"), dict):
        cfg = {**cfg, **cfg["text_config"]}
    return cfg if isinstance(cfg, dict) else {}


@dataclass
class Checkpoint:
    path: str
    params: dict[str, Param]
    num_layers: int | None
    fingerprints_only: bool = False


def load(path: str) -> Checkpoint:
    """A checkpoint (safetensors) or a fingerprint file, as parameters keyed canonically."""
    if os.path.exists(path) and not os.path.isdir(path) and not path.endswith(".safetensors"):
        return load_fingerprints(path)
    cfg = _config(path)
    n = cfg.get("num_hidden_layers") if isinstance(cfg.get("num_hidden_layers"), int) else None
    params: dict[str, Param] = {}
    for f in _files(path):
        for name, dtype, arr in read_safetensors(f):
            try:
                for p in params_of(name, dtype, arr, cfg):
                    params[p.key] = p
            except ValueError as e:
                raise SourceFileError(f"tensor {name!r}: {e} (config.json beside it gives the heads)", f) from None
    return Checkpoint(path, params, n)


def params_of(name: str, dtype: str, arr: np.ndarray, config: dict[str, Any]) -> list[Param]:
    """One stored parameter as the keyed parameters it holds (a fused one split along its rows by
    the heads of ``config``): what a checkpoint and a recorder fingerprinting a live model share."""
    got = _param_ops(name)
    if got is None:
        parts: list[tuple[str | None, np.ndarray]] = [(None, arr)]
    elif got[1] is None:
        parts = [(got[0][0], arr)]
    else:
        if arr.ndim < 1:
            raise ValueError("a fused parameter with no rows")
        widths = names.split_widths(got[1], int(arr.shape[0]), config)
        cuts = np.cumsum(widths)[:-1]
        parts = list(zip(got[0], np.split(arr, cuts, axis=0)))
    out = []
    for canon, part in parts:
        key = f"{canon}.{name.rpartition('.')[2]}" if canon is not None else name
        out.append(Param(key, name, canon, dtype, part))
    return out


def fingerprints_doc(params: list[Param], num_layers: int | None, source: str) -> dict[str, Any]:
    """The fingerprint file's object: parameters in forward order."""
    ck = Checkpoint(source, {p.key: p for p in params}, num_layers)
    return {"format": FINGERPRINT_FORMAT, "source": source, "num_layers": num_layers,
            "parameters": [p.fingerprint() for p in _in_order(ck)]}


def save_fingerprints(ck: Checkpoint, out: str) -> int:
    doc = fingerprints_doc(list(ck.params.values()), ck.num_layers, os.path.basename(os.path.abspath(ck.path)))
    with open(out, "w", encoding="utf-8") as f:
        json.dump(doc, f)
    return len(doc["parameters"])


def load_fingerprints(path: str) -> Checkpoint:
    raw = read_regular_file_bounded(path, MAX_FINGERPRINT_FILE, "fingerprint file")
    try:
        doc = parse_json(raw, "it", path)
    except SourceFileError as e:
        raise SourceFileError(f"neither a safetensors checkpoint nor a fingerprint file ({e.reason})", path) from None
    if not isinstance(doc, dict) or doc.get("format") != FINGERPRINT_FORMAT or not isinstance(doc.get("parameters"), list):
        raise SourceFileError(f"not a fingerprint file (format {FINGERPRINT_FORMAT})", path)
    return checkpoint_from_doc(doc, path)


def checkpoint_from_doc(doc: dict[str, Any], source: str) -> Checkpoint:
    """A fingerprint document (a file's, or one stored in a trace's ``/weights``) as a checkpoint
    of fingerprints only."""
    params = {}
    for e in doc["parameters"]:
        if not isinstance(e, dict) or not all(k in e for k in ("key", "name", "dtype", "shape", "sha256", "norm")):
            raise SourceFileError("a fingerprint entry lacks key/name/dtype/shape/sha256/norm", source)
        key = str(e["key"])
        canon = key.rpartition(".")[0] if names.maybe_state(key.rpartition(".")[0]) else None
        params[key] = Param(key, str(e["name"]), canon, str(e["dtype"]), None, e)
    n = doc.get("num_layers")
    return Checkpoint(source, params, n if isinstance(n, int) else None, fingerprints_only=True)


def _in_order(ck: Checkpoint) -> list[Param]:
    return sorted(ck.params.values(), key=lambda p: (_order(p.canon, ck.num_layers), p.key))


# ----------------------------------------------------------------------------------------------
# Comparing
# ----------------------------------------------------------------------------------------------


@dataclass
class ParamDiff:
    key: str
    name_a: str
    name_b: str
    canon: str | None
    what: str            # "values", "shape", "dtype+values"
    rel: float | None
    max_abs: float | None
    estimated: bool      # from fingerprints (norms), not full values

    def where(self) -> str:
        if self.canon is None:
            return self.key
        st = names.parse_state(self.canon)
        return f"layer{st.layer} {st.tap}" if st.kind == "tap" else self.canon


@dataclass
class WeightsResult:
    compared: int
    diffs: list[ParamDiff]
    only_a: list[str]
    only_b: list[str]

    @property
    def exit_code(self) -> int:
        return 1 if self.diffs or self.only_a or self.only_b else 0

    def lines(self) -> list[str]:
        if not self.diffs and not self.only_a and not self.only_b:
            return [f"weights agree: {self.compared} parameters, every one equal"]
        out = []
        if self.diffs:
            d = self.diffs[0]
            names_ = d.name_a if d.name_a == d.name_b else f"{d.name_a} in A, {d.name_b} in B"
            if d.what == "shape":
                how = "shapes differ"
            else:
                how = (f"rel diff {d.rel:.3g}" + (f", max abs {d.max_abs:.3g}" if d.max_abs is not None else "")
                       + (" (estimated from fingerprint norms)" if d.estimated else "")
                       + ("; dtypes differ" if d.what == "dtype+values" else ""))
            out.append(f"weights differ: first at {d.where()} ({names_}): {how}; {len(self.diffs)} of {self.compared} "
                       "parameters differ")
            for d in self.diffs[1:6]:
                rel = f"rel diff {d.rel:.3g}" if d.rel is not None else "shapes differ"
                out.append(f"  then {d.where()} ({d.name_b}): {rel}")
            if len(self.diffs) > 6:
                out.append(f"  ... and {len(self.diffs) - 6} more")
        else:
            out.append(f"weights differ: parameters present on one side only; {self.compared} compared parameters equal")
        for side, keys in (("A", self.only_a), ("B", self.only_b)):
            if keys:
                out.append(f"  only in {side}: {', '.join(keys[:8])}" + (f" and {len(keys) - 8} more" if len(keys) > 8 else ""))
        return out


def compare(a: Checkpoint, b: Checkpoint) -> WeightsResult:
    """Every key of both, in forward order; the first in ``diffs`` is the first that differs."""
    diffs: list[ParamDiff] = []
    compared = 0
    for pa in _in_order(a):
        pb = b.params.get(pa.key)
        if pb is None:
            continue
        compared += 1
        d = _compare_one(pa, pb)
        if d is not None:
            diffs.append(d)
    only_a = [p.key for p in _in_order(a) if p.key not in b.params]
    only_b = [p.key for p in _in_order(b) if p.key not in a.params]
    return WeightsResult(compared, diffs, only_a, only_b)


def _compare_one(pa: Param, pb: Param) -> ParamDiff | None:
    fa = pa.fp if pa.values is None else None
    fb = pb.fp if pb.values is None else None
    shape_a = list(pa.values.shape) if pa.values is not None else list((fa or {}).get("shape", []))
    shape_b = list(pb.values.shape) if pb.values is not None else list((fb or {}).get("shape", []))
    what = "values" if pa.dtype == pb.dtype else "dtype+values"
    if shape_a != shape_b:
        return ParamDiff(pa.key, pa.name, pb.name, pa.canon, "shape", None, None, False)
    if pa.values is not None and pb.values is not None:
        if pa.dtype == pb.dtype and np.array_equal(pa.values, pb.values):
            return None
        va, vb = _floats(pa.dtype, pa.values), _floats(pb.dtype, pb.values)
        if np.array_equal(va, vb):
            return None
        na = float(np.linalg.norm(va))
        rel = float(np.linalg.norm(vb - va)) / na if na > 0 else float("inf")
        return ParamDiff(pa.key, pa.name, pb.name, pa.canon, what, rel, float(np.abs(vb - va).max()), False)
    ga, gb = pa.fingerprint(), pb.fingerprint()
    if ga["sha256"] == gb["sha256"] and pa.dtype == pb.dtype:
        return None
    na, nb = float(ga["norm"]), float(gb["norm"])
    sa = {int(i): float(v) for i, v in ga.get("samples", [])}
    sb = {int(i): float(v) for i, v in gb.get("samples", [])}
    common = sorted(set(sa) & set(sb))
    max_abs = max((abs(sb[i] - sa[i]) for i in common), default=None)
    rel = abs(nb - na) / na if na > 0 else float("inf")
    if common:   # the samples see a direction change the norms alone miss
        da = np.array([sa[i] for i in common])
        db = np.array([sb[i] for i in common])
        den = float(np.linalg.norm(da))
        if den > 0:
            rel = max(rel, float(np.linalg.norm(db - da)) / den)
    return ParamDiff(pa.key, pa.name, pb.name, pa.canon, what, rel, max_abs, True)
