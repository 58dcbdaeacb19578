"""Files the serving engines and NVIDIA's trainer write (layouts in docs/vllm.md):

* ``vllm-hidden-states``: vLLM's ``extract_hidden_states`` connector, ``<req_id>.safetensors`` with
  ``hidden_states`` [T, K, H] (slots in vLLM's capture order: the ids sorted) and ``token_ids`` [T]
  -> ``aux_hidden_states`` (role aux, token_offset 0), side ``serve``.
* ``trtllm``: TensorRT-LLM's saved hidden states, ``.pt`` lists of ``{id, input_ids, hidden_state
  [T, H], hidden_state_features [T, K*H]}`` -> ``aux_hidden_states`` (ids "output of layer id",
  sorted, ``-1`` = ``final_norm`` last), and ``hidden_state`` (always the last H columns) as the
  catalog state of the last slot; side ``serve``.
* ``modelopt``: Model-Optimizer's ``collect_hidden_states``, ``.pt`` dicts ``{input_ids,
  hidden_states [T, H] (post-norm), aux_hidden_states [T, K*H]}`` -> ``draft_input`` (role
  draft_input, token_offset 1: the trainer pairs row t with token t+1) and ``final_norm``; side
  ``train``. Ids are HF ``hidden_states`` indices, default ``sorted(set([2, N//2, N-3]))``.

``import_cli`` dispatches these formats to :func:`import_engine_files`.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from ... import conventions
from ...errors import SourceFileError, TensordiffError, UsageError
from ...vocab import boundary_label, parse_label
from ..core import Recorder, logical_dtype
from .common import ImportResult, as_2d, check_out_dir, discard, draft_rows, open_trace
from .files import expand, load_safetensors_file, load_torch_file, natural_key
from .layouts import CHECKED_AGAINST, check_keys
from .speculators import is_hs_file

#: Formats these importers add; ``import_cli`` dispatches them to :func:`import_engine_files`.
ENGINE_FORMATS = ("vllm-hidden-states", "trtllm", "modelopt")


def detect_engine_format(sources: Sequence[str | os.PathLike]) -> str | None:
    """``vllm-hidden-states`` (``.safetensors`` files), ``trtllm`` (a ``.pt`` holding a list of
    records with ``hidden_state_features``) or ``modelopt`` (a ``.pt`` dict with
    ``aux_hidden_states``); None when the sources are none of these."""
    first = Path(sources[0])
    if not first.exists():
        return None
    if first.is_dir():
        found = [q.name for q in first.rglob("*.safetensors")][:1000]
        if found and all(is_hs_file(n) for n in found):
            return None  # speculators 0.9.0's hs_<index>.safetensors: the speculators importer's
        if found:
            return "vllm-hidden-states"
        probe = next(iter(sorted(first.rglob("*.pt"), key=natural_key)), None)
        if probe is None:
            return None
    else:
        if first.name.endswith(".safetensors"):
            return None if is_hs_file(first.name) else "vllm-hidden-states"
        probe = first
    if not probe.name.endswith(".pt"):
        return None
    try:
        data = load_torch_file(probe)
    except TensordiffError:
        return None
    if isinstance(data, (list, tuple)) and data and isinstance(data[0], dict) and "hidden_state_features" in data[0]:
        return "trtllm"
    if isinstance(data, dict) and "aux_hidden_states" in data:
        return "modelopt"
    return None


def _engine_labels(fmt: str, k: int, *, ids, labels, num_layers, convention, path: str) -> tuple[list[str], str, list | None]:
    """(slot labels, convention, raw ids) of a K-slot capture."""
    if labels:
        labs = [boundary_label(int(x)) if str(x).lstrip("-").isdigit() else str(x) for x in labels]
        for lab in labs:
            try:
                parse_label(lab)
            except ValueError as e:
                raise UsageError(str(e)) from None
        if len(labs) != k:
            raise SourceFileError(f"--labels names {len(labs)} slots but the file holds {k}", path)
        return labs, "boundary", None
    conv = convention or {"vllm-hidden-states": "vllm", "trtllm": "trtllm", "modelopt": "modelopt"}[fmt]
    if ids is None and fmt == "vllm-hidden-states":
        raise UsageError("vLLM's extract_hidden_states files do not say which layers they hold: give --aux-ids "
                         "(the draft config's eagle_aux_hidden_state_layer_ids), --draft-config or --labels")
    if ids is None and num_layers is None:
        raise UsageError(f"{fmt} files do not say which layers they hold: give --aux-ids, --labels, or "
                         "--num-layers for the default ids")
    n = int(num_layers) if num_layers is not None else 10**6
    try:
        labs = conventions.resolve_labels(conv, list(ids) if ids is not None else None, n)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if len(labs) != k:
        raise SourceFileError(f"the file holds {k} slots, but {conv} ids {list(ids) if ids is not None else 'default'} "
                              f"select {len(labs)}: {labs}", path)
    return labs, conv, ([int(i) for i in ids] if ids is not None else None)


def _int_ids(t: Any, what: str, path: str) -> np.ndarray:
    if isinstance(t, (list, tuple)):
        t = torch.as_tensor(t)
    if not isinstance(t, torch.Tensor) or t.is_floating_point() or t.is_complex():
        raise SourceFileError(f"{what} is not an integer tensor", path)
    if t.ndim > 1:
        if sum(s != 1 for s in t.shape[:-1]):
            raise SourceFileError(f"{what} has shape {list(t.shape)}; one sequence expected", path)
        t = t.reshape(-1)
    if t.numel() == 0:
        raise SourceFileError(f"{what} is empty", path)
    return t.to(torch.int64).numpy()


def _records(fmt: str, files: list[Path], hidden_size: int | None) -> Any:
    """Yield (path, seq key, token ids [T], packed [T, K*H], K, extra) per sequence."""
    seen: set[str] = set()
    for p in files:
        path = str(p)
        stem = p.name
        for ext in (".safetensors", ".pt"):
            if stem.endswith(ext):
                stem = stem[: -len(ext)]
        if fmt == "vllm-hidden-states":
            d = load_safetensors_file(p)
            if "hidden_states" not in d or "token_ids" not in d:
                raise SourceFileError(f"not a vLLM extract_hidden_states file (needs hidden_states and token_ids; "
                                      f"found {sorted(d)[:6]})", path)
            ids = _int_ids(d["token_ids"], "token_ids", path)
            hs = d["hidden_states"]
            if not hs.is_floating_point():
                raise SourceFileError("hidden_states is not floating point", path)
            if hs.ndim == 3 and hs.shape[0] == len(ids):
                k = int(hs.shape[1])
                packed = hs.reshape(len(ids), -1)
            elif hs.ndim == 2 and hs.shape[0] == len(ids) and hidden_size and hs.shape[1] % int(hidden_size) == 0:
                k = int(hs.shape[1]) // int(hidden_size)
                packed = hs
            else:
                raise SourceFileError(f"hidden_states has shape {list(hs.shape)}, expected [T={len(ids)}, K, H]", path)
            m = re.match(r"^(.*)-[0-9a-f]{8}$", stem)  # vLLM's internal request id: <external id>-<8 hex>
            key = m.group(1) if m and m.group(1) and m.group(1) not in seen else stem
            seen.add(key)
            yield path, key, ids, packed, k, {}
        elif fmt == "trtllm":
            data = load_torch_file(p)
            if not isinstance(data, (list, tuple)):
                raise SourceFileError(f"not a TensorRT-LLM saved-hidden-states file (a {type(data).__name__}, "
                                      "expected a list of records)", path)
            for j, rec in enumerate(data):
                where = f"{path} [record {j}]"
                if not isinstance(rec, dict) or "hidden_state_features" not in rec or "input_ids" not in rec:
                    raise SourceFileError("a record without input_ids and hidden_state_features", where)
                ids = _int_ids(rec["input_ids"], "input_ids", where)
                feats = as_2d(rec["hidden_state_features"], "hidden_state_features", where, len(ids))
                last = rec.get("hidden_state")
                last = as_2d(last, "hidden_state", where, len(ids)) if last is not None else None
                H = int(last.shape[-1]) if last is not None else (int(hidden_size) if hidden_size else None)
                if H is None:
                    raise SourceFileError("no hidden_state to size the slots by: give --hidden-size", where)
                if feats.shape[-1] % H:
                    raise SourceFileError(f"hidden_state_features is {feats.shape[-1]} wide, not a multiple of {H}", where)
                rid = str(rec.get("id", j))
                key = rid if rid not in seen else f"{stem}/{rid}"
                seen.add(key)
                yield where, key, ids, feats, int(feats.shape[-1]) // H, {"last": last}
        else:  # modelopt
            d = load_torch_file(p)
            if not isinstance(d, dict) or "aux_hidden_states" not in d or "input_ids" not in d:
                raise SourceFileError("not a Model-Optimizer collect_hidden_states file (needs input_ids and "
                                      "aux_hidden_states)", path)
            check_keys("modelopt", d, path, "a Model-Optimizer hidden-state file")
            prenorm = d.get("hidden_states_prenorm", False)
            if not isinstance(prenorm, bool):
                raise SourceFileError(f"hidden_states_prenorm is a {type(prenorm).__name__}, not a bool", path)
            ids = _int_ids(d["input_ids"], "input_ids", path)
            aux = as_2d(d["aux_hidden_states"], "aux_hidden_states", path, len(ids))
            fin = d.get("hidden_states")
            fin = as_2d(fin, "hidden_states", path, len(ids)) if fin is not None else None
            H = int(fin.shape[-1]) if fin is not None else (int(hidden_size) if hidden_size else None)
            if H is None:
                raise SourceFileError("no hidden_states to size the slots by: give --hidden-size", path)
            if aux.shape[-1] % H:
                raise SourceFileError(f"aux_hidden_states is {aux.shape[-1]} wide, not a multiple of {H}", path)
            key = str(d.get("conversation_id", stem))
            key = key if key not in seen else stem
            seen.add(key)
            yield path, key, ids, aux, int(aux.shape[-1]) // H, {"final": fin, "prenorm": prenorm}


def import_engine_files(sources: Sequence[str | os.PathLike], out: str | os.PathLike, *, fmt: str,
                        side: str | None = None, aux_ids: Sequence[int] | None = None, convention: str | None = None,
                        num_layers: int | None = None, hidden_size: int | None = None,
                        labels: Sequence[str] | None = None, limit: int | None = None,
                        values: bool | Sequence[str] | None = None) -> ImportResult:
    """Import vLLM ``extract_hidden_states`` connector files, TensorRT-LLM saved hidden states or
    Model-Optimizer ``collect_hidden_states`` files into the trace ``out`` (layouts: the module's
    docstring)."""
    if fmt not in ENGINE_FORMATS:
        raise UsageError(f"unknown format {fmt!r}; one of {', '.join(ENGINE_FORMATS)}")
    if not sources:
        raise UsageError("nothing to import: give files or directories")
    check_out_dir(out, UsageError)
    pats = ("*.safetensors",) if fmt == "vllm-hidden-states" else ("*.pt",)
    files = expand(sources, pats)
    side = side or ("train" if fmt == "modelopt" else "serve")
    result = ImportResult(format=fmt, out=os.fspath(out))
    rec: Recorder | None = None
    lab: list[str] = []
    try:
        for path, key, ids, packed, k, extra in _records(fmt, files, hidden_size):
            if limit is not None and result.sequences >= limit:
                break
            H = int(packed.shape[-1]) // k
            if rec is None:
                if hidden_size and int(hidden_size) != H:
                    raise SourceFileError(f"the file's states are {H} wide, not --hidden-size {hidden_size}", path)
                lab, conv, raw = _engine_labels(fmt, k, ids=aux_ids, labels=labels, num_layers=num_layers,
                                                convention=convention, path=path)
                model = {"hidden_size": H, "dtype": logical_dtype(packed.dtype)}
                if num_layers is not None:
                    model["num_layers"] = int(num_layers)
                rec = open_trace(out, side=side, fmt=fmt, sources=sources, model=model,
                                 meta={"labels": lab, "convention": conv, "raw_ids": raw,
                                       "capture_order_note": conventions.capture_order_note(conv, raw, num_layers)},
                                 values=values, error=UsageError)
                result.plan = {"fed": lab, "convention": conv, "raw_ids": raw}
            elif int(packed.shape[-1]) != H * len(lab) or H != rec.model["hidden_size"]:
                raise SourceFileError(f"states are {packed.shape[-1]} wide; the first file's were "
                                      f"{rec.model['hidden_size'] * len(lab)}", path)
            rows = rec.add_tokens(key, None, ids, regime="prefill" if side == "serve" else "train")
            if fmt == "modelopt":
                rec.packed("draft_input", packed, draft_rows(rows), labels=lab, raw_ids=raw, convention=conv,
                           token_offset=1, role="draft_input",
                           attrs={"source_format": fmt, "checked_against": CHECKED_AGAINST[fmt]})
                if extra.get("final") is not None and extra.get("prenorm"):
                    # the dump says its hidden_states is the last layer's output before the final
                    # norm (modelopt's OfflineSupervisedDataset re-applies the norm for it)
                    if num_layers is None:
                        raise UsageError("this Model-Optimizer dump holds the pre-norm last state "
                                         "(hidden_states_prenorm): give --num-layers to name its boundary")
                    rec.boundary(int(num_layers), extra["final"], rows,
                                 attrs={"source_format": fmt, "source": "hidden_states (hidden_states_prenorm)"})
                elif extra.get("final") is not None:
                    rec.final_norm(extra["final"], rows, attrs={"source_format": fmt})
            else:
                rec.packed("aux_hidden_states", packed, rows, labels=lab, raw_ids=raw, convention=conv,
                           token_offset=0, role="aux", attrs={"source_format": fmt})
                last = extra.get("last")
                if last is not None:  # TensorRT-LLM: the last H columns of the features
                    b = parse_label(lab[-1])
                    if b is None:
                        rec.final_norm(last, rows, attrs={"source_format": fmt, "source": "hidden_state"})
                    else:
                        rec.boundary(b, last, rows, attrs={"source_format": fmt, "source": "hidden_state"})
            result.sequences += 1
            result.tokens += len(rows)
        result.files = len(files) if limit is None else min(len(files), result.sequences)
    except BaseException as e:
        if rec is not None:
            rec.close(e)
            discard(out)  # a failed import leaves no half-written trace behind
        raise
    if rec is None:
        raise SourceFileError("no records to import", str(sources[0]))
    result.tensors = rec.defined
    rec.close()
    return result
