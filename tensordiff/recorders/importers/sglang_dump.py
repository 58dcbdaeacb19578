"""SGLang dumper directories (``DUMPER_DIR[/<exp_name>]``): one ``.pt`` per tensor, tags
``key=value`` joined by ``___`` in the file name, holding ``{"value": tensor, "meta": {...}}``.

Token ids, positions, sequence lengths and request ids come from the ``input_ids``,
``positions``, ``seq_lens`` and ``rids`` dumps of each step (the non-intrusive dumper writes them).
-> one tensor per dump name (plus non-default tags: ``hidden_states@layer_id=20``); ``as_labels``
maps such a name to a boundary label (``layer21``) or ``final_norm``, recorded as a catalog state.
"""

from __future__ import annotations

import fnmatch
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

from ...errors import SourceFileError, UsageError
from ...trace.schema import MAX_KEY_CHARS
from ...trace.validate import tensor_name_problem
from ...vocab import FINAL_NORM, parse_label
from ..core import Recorder
from .common import ImportResult
from .files import inside, load_torch_file, natural_key

_CORE = ("input_ids", "positions", "seq_lens", "rids", "req_pool_indices")
_NOT_IN_NAME = {"step", "rank", "dump_index", "name", "recompute_status", "world_rank", "world_size"}


def parse_dump_filename(name: str) -> dict[str, str] | None:
    """Tags of an SGLang dumper file name (``step=0___rank=0___...___name=x.pt``), None if not one."""
    if not name.endswith(".pt"):
        return None
    stem = name[:-3]
    tags: dict[str, str] = {}
    for part in stem.split("___"):
        if "=" not in part:
            return None
        k, v = part.split("=", 1)
        if not k:
            return None
        tags[k] = v
    if "name" not in tags:
        return None
    return tags


def _dump_tensor_name(tags: dict[str, str]) -> str:
    extra = [(k, v) for k, v in tags.items() if k not in _NOT_IN_NAME and not k.endswith("_rank")
             and not k.endswith("_size")]
    name = tags["name"] + "".join(f"@{k}={v}" for k, v in extra)
    name = name.replace("/", "_")
    return name[:256]


def tags_name_only(tname: str) -> str:
    return tname.split("@", 1)[0]


def _split_segments(pos: np.ndarray, seq_lens: np.ndarray | None) -> list[tuple[int, int]]:
    T = len(pos)
    if seq_lens is not None and len(seq_lens):
        segs, start = [], 0
        for sl in seq_lens.tolist():
            if start >= T:
                break
            j = start
            while j < T and pos[j] != sl - 1:
                j += 1
            if j >= T:
                segs = None
                break
            segs.append((start, j + 1))
            start = j + 1
        if segs is not None and start == T:
            return segs
    cuts = [0] + [j for j in range(1, T) if pos[j] != pos[j - 1] + 1] + [T]
    return [(a, b) for a, b in zip(cuts[:-1], cuts[1:])]


def _to_np_int(v: Any) -> np.ndarray | None:
    if isinstance(v, torch.Tensor):
        if v.is_floating_point():
            return None
        return v.reshape(-1).to(torch.int64).numpy()
    if isinstance(v, (list, tuple)) and all(isinstance(x, int) for x in v):
        return np.asarray(v, dtype=np.int64)
    return None


def import_sglang_dump(sources, make_recorder: Callable[[dict], Recorder], result: ImportResult, *,
                       rank: int | None, names: Sequence[str] | None, as_labels: dict[str, str],
                       hidden_size: int | None, num_layers: int | None, include_recompute: bool,
                       limit: int | None) -> None:
    entries = []  # (tags, path)
    exps = set()
    for s in sources:
        p = Path(s)
        cand = ([p] if p.is_file() else [q for q in sorted(p.rglob("*.pt"), key=natural_key)
                                          if inside(q, p, result.skipped)] if p.is_dir() else None)
        if cand is None:
            raise SourceFileError("no such file or directory", str(p))
        for q in cand:
            tags = parse_dump_filename(q.name)
            if tags is None:
                result.skipped[q.name] = "not a dumper file name"
                continue
            entries.append((tags, q))
            exps.add(str(q.parent))
    if not entries:
        raise SourceFileError("no SGLang dumper files (step=..___rank=..___name=...pt) found", str(sources[0]))
    if len(exps) > 1:
        raise UsageError(f"dumps of {len(exps)} experiments (directories) found; import one: "
                         + ", ".join(sorted(exps)[:4]))

    def num(tags, k, default=0):
        try:
            return int(tags.get(k, default))
        except ValueError:
            raise SourceFileError(f"dump tag {k}={tags.get(k)!r} is not an integer") from None
    ranks = sorted({num(t, "rank") for t, _ in entries})
    use_rank = ranks[0] if rank is None else int(rank)
    if use_rank not in ranks:
        raise UsageError(f"no dumps of rank {use_rank}; ranks present: {ranks}")
    steps: dict[int, list] = {}
    for tags, q in entries:
        if num(tags, "rank") != use_rank:
            continue
        rs = tags.get("recompute_status", "disabled")
        if not include_recompute and rs not in ("disabled", "none", "None", ""):
            continue
        steps.setdefault(num(tags, "step"), []).append((num(tags, "dump_index"), tags, q))
    rec: Recorder | None = None
    try:
        for si, step in enumerate(sorted(steps)):
            if limit is not None and si >= limit:
                break
            items = sorted(steps[step], key=lambda x: x[0])
            core: dict[str, Any] = {}
            tensors = []
            for _, tags, q in items:
                obj = load_torch_file(q)
                if not isinstance(obj, dict) or "value" not in obj:
                    raise SourceFileError("not an SGLang dump (no 'value' entry)", str(q))
                result.files += 1
                nm = tags["name"]
                if nm in _CORE:
                    core.setdefault(nm, obj["value"])
                    continue
                tname = _dump_tensor_name(tags)
                problem = tensor_name_problem(tname)
                if problem:  # the reader would refuse the trace: refuse the name here, with the file
                    raise SourceFileError(f"dump name {tname[:80]!r} cannot name a tensor in a trace ({problem}); "
                                          "rename the file or leave it out with --names", str(q))
                if names and not any(fnmatch.fnmatchcase(tname, g) or fnmatch.fnmatchcase(nm, g) for g in names):
                    continue
                tensors.append((tname, obj["value"], str(q)))
            if not tensors:
                continue
            ids = _to_np_int(core.get("input_ids"))
            if ids is None:
                raise SourceFileError(f"step {step} has no input_ids dump: dump the forward batch's core fields "
                                 "(input_ids, positions, seq_lens, rids) with the tensors")
            T = len(ids)
            pos = _to_np_int(core.get("positions"))
            seq_lens = _to_np_int(core.get("seq_lens"))
            if pos is None:
                if seq_lens is not None and len(seq_lens) > 1:
                    raise SourceFileError(f"step {step} has {len(seq_lens)} sequences but no positions dump")
                pos = np.arange(T, dtype=np.int64)
            if len(pos) != T:
                raise SourceFileError(f"step {step}: {len(pos)} positions for {T} input_ids")
            segs = _split_segments(pos, seq_lens)
            rids = core.get("rids")
            rids = list(rids) if isinstance(rids, (list, tuple)) and len(rids) == len(segs) else None
            if rec is None:
                widths = [int(v.shape[-1]) for _, v, _ in tensors if isinstance(v, torch.Tensor) and v.ndim >= 1]
                hidden = int(hidden_size) if hidden_size else (max(set(widths), key=widths.count) if widths else None)
                rec = make_recorder({"num_layers": num_layers, "hidden_size": hidden, "dtype": None})
            rows = np.empty(T, dtype=np.int64)
            for i, (a, b) in enumerate(segs):
                key = str(rids[i]) if rids is not None else f"step{step}.seq{i}"
                if len(key) > MAX_KEY_CHARS:
                    raise SourceFileError(f"step {step}: a request id of {len(key)} characters; a trace keeps "
                                          f"sequence keys of at most {MAX_KEY_CHARS}")
                regime = "prefill" if b - a > 1 else "decode"
                rows[a:b] = rec.add_tokens(key, pos[a:b], ids[a:b], regime=regime, step=step)
                result.sequences += 1
            result.tokens += T
            for tname, v, _path in tensors:
                if isinstance(v, torch.Tensor) and (v.ndim == 0 or v.numel() == 0):
                    # refused (noted); a dump of nothing else is refused as a whole below
                    what = "a 0-d tensor (one number)" if v.ndim == 0 else f"an empty tensor {list(v.shape)}"
                    result.skipped[tname] = f"{what}, not a row per token"
                    continue
                if not isinstance(v, torch.Tensor) or not v.is_floating_point():
                    result.skipped[tname] = "not a floating-point tensor"
                    continue
                while v.ndim > 2 and v.shape[0] == 1 and v.shape[1] == T:
                    v = v[0]
                if v.ndim < 2 or v.shape[0] != T:
                    result.skipped[tname] = f"shape {list(v.shape)} has no row per token ({T})"
                    continue
                v = v.reshape(T, -1)
                label = as_labels.get(tname) or as_labels.get(tags_name_only(tname))
                if label:
                    b = parse_label(label)
                    if b is None:
                        rec.final_norm(v, rows, name=FINAL_NORM, attrs={"dump_name": tname})
                    else:
                        rec.boundary(b, v, rows, attrs={"dump_name": tname})
                else:
                    rec.record(tname, v, rows, kind="other", role="dump")
    except BaseException as e:
        if rec is not None:
            rec.close(e)
        raise
    if rec is None:
        raise SourceFileError("the dumps hold no tensors besides the forward batch's fields")
    if not rec.defined:
        rec.close()
        why = "; ".join(f"{k} ({v})" for k, v in list(result.skipped.items())[:3])
        raise SourceFileError(f"nothing imported: every tensor of the dumps was skipped: {why}")
    result.tensors = rec.defined
    rec.close()
