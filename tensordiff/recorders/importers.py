"""Importers: turn files users already have into a trace.

* SpecForge offline hidden states (``scripts/prepare_hidden_states.py``): one ``.ckpt`` or
  ``.ckpt.gz`` torch dict per sample: ``input_ids`` [L], ``loss_mask`` [L], ``aux_hidden_state``
  [1, L, K*H] (slots in config order), ``hidden_state`` [1, L, H] (post-final-norm).
  -> ``draft_input`` (packed, role draft_input, token_offset 1) + ``final_norm`` (catalog).
* speculators data files (``.pt``): ``hidden_states`` a list of per-layer [L, H] tensors (legacy
  v1; the trainer packs ``list[:-1]`` and takes ``list[-1]`` as the verifier state) or a stacked
  [L, K, H] tensor (``[:, :-1]`` aux input, ``[:, -1]`` verifier state), or the v0 layout
  (``hidden_state`` [L, K*H] + ``target`` [L, H]).
  -> ``draft_input`` + ``verifier_last`` (role verifier_target, attr ``label``: what the ids say it is).
* SGLang dumper directories (``DUMPER_DIR[/<exp_name>]``): one ``.pt`` per tensor, tags
  ``key=value`` joined by ``___`` in the file name, holding ``{"value": tensor, "meta": {...}}``.
  Token ids, positions, sequence lengths and request ids come from the ``input_ids``,
  ``positions``, ``seq_lens`` and ``rids`` dumps of each step (the non-intrusive dumper writes them).
  -> one tensor per dump name (plus non-default tags: ``hidden_states@layer_id=20``); ``as_labels``
  maps such a name to a boundary label (``layer21``) or ``final_norm``, recorded as a catalog state.

Every file is read with ``torch.load(..., weights_only=True)`` only; a file that does not load or
does not hold what its format promises raises :class:`TraceError` with one line.
"""

from __future__ import annotations

import fnmatch
import gzip
import os
import pickle
import re
import stat
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

from .. import conventions
from ..errors import SourceFileError, TraceError
from ..safety import sanitize_for_terminal
from ..trace.schema import MAX_KEY_CHARS
from ..trace.validate import tensor_name_problem
from ..vocab import FINAL_NORM, boundary_label, parse_label
from .core import Recorder, Sampling, logical_dtype
from .hf import DraftPlan, plan_draft_input

__all__ = ["load_torch_file", "detect_format", "import_files", "ImportResult", "FORMATS",
           "parse_dump_filename", "natural_key"]

FORMATS = ("specforge", "speculators", "sglang-dump")
_SHORT = 200


def _short(e: BaseException) -> str:
    s = re.sub(r"\x1b\[[0-9;]*m", "", str(e)).strip().splitlines()
    s = s[0] if s else type(e).__name__
    return s[:_SHORT]


def natural_key(p: Path | str) -> list:
    """Sort key putting data_2 before data_10."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", str(p))]


def _looks_like_torch(head: bytes) -> bool:
    # torch.save writes a zip archive (PK..) or, in the legacy format, a pickle (protocol 2+: 0x80)
    return head[:2] == b"PK" or head[:1] == b"\x80"


#: a .gz may decompress to at most this many times its size (plus 64 MiB): hidden states compress
#: less than 2x, so more is a bomb (2 MB of gzip holding 2 GiB of zeros)
GZ_MAX_RATIO = 64
GZ_SLACK = 64 << 20


def _open_regular(path: str) -> int:
    """A descriptor of ``path`` after checking it is a regular file (opened without blocking, so a
    FIFO named like a dump cannot hang the import)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        kind = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file (a FIFO, device or socket)"
        raise SourceFileError(f"is {kind}, not a torch file", path)
    return fd


def _gunzip_bounded(fh: Any, path: str, size: int) -> Any:
    """The decompressed stream of a gzip file, checked to start like a torch file before anything
    else is decompressed, then spooled to a temporary file (never all in memory) up to a cap."""
    limit = size * GZ_MAX_RATIO + GZ_SLACK
    with gzip.GzipFile(fileobj=fh, mode="rb") as gz:
        head = gz.read(2)
        if not _looks_like_torch(head):
            raise SourceFileError("not a torch checkpoint (neither torch.save's zip format nor a pickle, gzipped)", path)
        out = tempfile.TemporaryFile()
        try:
            out.write(head)
            total = len(head)
            while True:
                chunk = gz.read(1 << 20)
                if not chunk:
                    break
                total += len(chunk)
                if total > limit:
                    raise SourceFileError(f"decompresses to more than {limit >> 20} MiB ({GZ_MAX_RATIO}x its size): "
                                          "not hidden states (a gzip bomb?)", path)
                out.write(chunk)
            out.seek(0)
            return out
        except BaseException:
            out.close()
            raise


def load_torch_file(path: str | os.PathLike) -> Any:
    """``torch.load(weights_only=True)`` of a ``.pt``/``.ckpt`` file, or a gzip of one (``.gz``).
    Anything else, or a file holding objects other than tensors and plain containers, raises
    :class:`~tensordiff.errors.SourceFileError` with one line. The header is checked before
    anything is loaded or decompressed; a gzip is decompressed to a temporary file, bounded."""
    path = os.fspath(path)
    data: Any = None
    try:
        fd = _open_regular(path)
        with os.fdopen(fd, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            if path.endswith(".gz"):
                data = _gunzip_bounded(fh, path, size)
            else:
                if not _looks_like_torch(fh.read(2)):
                    raise SourceFileError("not a torch checkpoint (neither torch.save's zip format nor a pickle)", path)
                fh.seek(0)
                return torch.load(fh, map_location="cpu", weights_only=True)
        return torch.load(data, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise SourceFileError("no such file", path) from None
    except IsADirectoryError:
        raise SourceFileError("is a directory, not a torch file", path) from None
    except PermissionError:
        raise SourceFileError("permission denied", path) from None
    except pickle.UnpicklingError as e:
        m = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(e))
        what = f"it holds a {m.group(1)}" if m else _short(e)
        raise SourceFileError(f"refused to load under torch.load(weights_only=True): {what}; only tensors and plain "
                              "containers are read, never arbitrary pickled objects", path) from None
    except (RuntimeError, EOFError, OSError, zipfile.BadZipFile, ValueError, TypeError, AttributeError,
            KeyError, IndexError, UnicodeDecodeError, MemoryError, gzip.BadGzipFile) as e:
        raise SourceFileError(f"cannot load as a torch file, truncated or damaged ({_short(e)})", path) from None
    finally:
        if data is not None:
            data.close()


# ----------------------------------------------------------------------------------------------
# Sources and formats
# ----------------------------------------------------------------------------------------------

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


def _inside(q: Path, root: Path, skipped: dict[str, str] | None) -> bool:
    """Whether ``q`` (found under the directory ``root``) really lies inside it: a symbolic link
    pointing out of the directory is not followed (noted in ``skipped``)."""
    try:
        q.resolve().relative_to(root.resolve())
        return True
    except (ValueError, OSError, RuntimeError):
        if skipped is not None:
            skipped[q.name] = "a symbolic link out of the directory, not followed"
        return False


def _expand(sources: Sequence[str | os.PathLike], patterns: Sequence[str],
            skipped: dict[str, str] | None = None) -> list[Path]:
    files: list[Path] = []
    for s in sources:
        p = Path(s)
        if p.is_dir():
            found = [q for q in p.rglob("*") if q.is_file() and any(fnmatch.fnmatch(q.name, pat) for pat in patterns)
                     and _inside(q, p, skipped)]
            if not found:
                raise TraceError(f"no {' or '.join(patterns)} files in this directory", str(p))
            files.extend(sorted(found, key=natural_key))
        elif p.exists():
            files.append(p)
        else:
            raise TraceError("no such file or directory", str(p))
    return files


def detect_format(sources: Sequence[str | os.PathLike]) -> str:
    """``specforge``, ``speculators`` or ``sglang-dump``, from names and the first file's keys."""
    first = Path(sources[0])
    if not first.exists():
        raise TraceError("no such file or directory", str(first))
    if first.is_dir():
        names = [q.name for q in first.rglob("*.pt")][:1000]
        if any(parse_dump_filename(n) for n in names):
            return "sglang-dump"
        ckpts = next(iter(first.rglob("*.ckpt")), None) or next(iter(first.rglob("*.ckpt.gz")), None)
        probe = ckpts or next(iter(sorted(first.rglob("*.pt"), key=natural_key)), None)
        if probe is None:
            raise TraceError("no .ckpt, .ckpt.gz or .pt files in this directory", str(first))
    else:
        if parse_dump_filename(first.name):
            return "sglang-dump"
        probe = first
    data = load_torch_file(probe)
    if isinstance(data, dict):
        if "aux_hidden_state" in data:
            return "specforge"
        if "hidden_states" in data or ("hidden_state" in data and "target" in data):
            return "speculators"
        if "value" in data and "meta" in data:
            return "sglang-dump"
    keys = sorted(map(str, data.keys()))[:8] if isinstance(data, dict) else type(data).__name__
    raise TraceError(f"unrecognised file: neither SpecForge (aux_hidden_state), speculators (hidden_states) "
                     f"nor an SGLang dump (value, meta); found {keys}", str(probe))


# ----------------------------------------------------------------------------------------------
# Result
# ----------------------------------------------------------------------------------------------


@dataclass
class ImportResult:
    format: str
    out: str
    files: int = 0
    sequences: int = 0
    tokens: int = 0
    tensors: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    plan: dict | None = None

    def summary(self) -> str:
        s = (f"imported {self.files} {self.format} file(s): {self.sequences} sequence(s), {self.tokens} token rows, "
             f"tensors {', '.join(self.tensors) or 'none'} -> {self.out}")
        if self.plan:
            s += f"\n  draft_input slots {self.plan['fed']} (convention {self.plan['convention']}, ids {self.plan['raw_ids']})"
            if self.plan.get("verifier"):
                s += f"; verifier_last claimed {self.plan['verifier']}"
        if self.skipped:
            s += f"\n  skipped {len(self.skipped)}: " + "; ".join(f"{sanitize_for_terminal(k)} ({sanitize_for_terminal(v)})"
                                                     for k, v in list(self.skipped.items())[:5])
        return s


# ----------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------


def _as_2d(t: Any, what: str, path: str, length: int | None = None) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TraceError(f"{what} is a {type(t).__name__}, not a tensor", path)
    while t.ndim > 2 and t.shape[0] == 1:
        t = t[0]
    if t.ndim != 2:
        raise TraceError(f"{what} has shape {list(t.shape)}, expected [L, width] (or [1, L, width])", path)
    if length is not None and t.shape[0] != length:
        raise TraceError(f"{what} has {t.shape[0]} rows but input_ids has {length} tokens", path)
    if not t.is_floating_point():
        raise TraceError(f"{what} has dtype {t.dtype}, expected floating point", path)
    return t


def _ids(d: dict, path: str) -> np.ndarray:
    t = d.get("input_ids")
    if t is None:
        raise TraceError("no input_ids in the file", path)
    if isinstance(t, (list, tuple)):
        t = torch.as_tensor(t)
    if not isinstance(t, torch.Tensor) or t.is_floating_point() or t.is_complex():
        raise TraceError("input_ids is not an integer tensor", path)
    if t.ndim > 1:
        if sum(s != 1 for s in t.shape[:-1]):
            raise TraceError(f"input_ids has shape {list(t.shape)}; one sequence per file expected", path)
        t = t.reshape(-1)
    if t.numel() == 0:
        raise TraceError("input_ids is empty", path)
    return t.to(torch.int64).numpy()


def _seq_key(path: Path, root: Path | None) -> str:
    rel = path.relative_to(root) if root is not None and root in path.parents else Path(path.name)
    s = str(rel)
    for ext in (".ckpt.gz", ".pt.gz", ".ckpt", ".pt"):
        if s.endswith(ext):
            return s[: -len(ext)]
    return s


def _roots(sources) -> list[Path]:
    return [Path(s) for s in sources if Path(s).is_dir()]


def _root_of(p: Path, roots: list[Path]) -> Path | None:
    for r in roots:
        if r in p.parents:
            return r
    return None


def _draft_rows(rows: np.ndarray) -> np.ndarray:
    out = rows.copy()
    out[-1] = -1
    return out


# ----------------------------------------------------------------------------------------------
# SpecForge / speculators
# ----------------------------------------------------------------------------------------------


@dataclass
class _Sample:
    key: str
    ids: np.ndarray
    draft: torch.Tensor | None         # [L, K*H] what the trainer packs
    verifier: torch.Tensor | None      # [L, H]
    final_norm: torch.Tensor | None    # [L, H]
    slots: int


def _specforge_sample(d: Any, path: str, key: str) -> _Sample:
    if not isinstance(d, dict) or "aux_hidden_state" not in d:
        raise TraceError("not a SpecForge hidden-state file (no aux_hidden_state)", path)
    ids = _ids(d, path)
    aux = _as_2d(d["aux_hidden_state"], "aux_hidden_state", path, len(ids))
    fn = d.get("hidden_state")
    fn = _as_2d(fn, "hidden_state", path, len(ids)) if fn is not None else None
    return _Sample(key, ids, aux, None, fn, 0)


def _speculators_sample(d: Any, path: str, key: str) -> _Sample:
    if not isinstance(d, dict):
        raise TraceError(f"not a speculators data file (a {type(d).__name__}, not a dict)", path)
    ids = _ids(d, path)
    L = len(ids)
    if "hidden_states" in d:
        hs = d["hidden_states"]
        if isinstance(hs, torch.Tensor):
            while hs.ndim > 3 and hs.shape[0] == 1:
                hs = hs[0]
            if hs.ndim != 3 or hs.shape[0] != L:
                raise TraceError(f"hidden_states has shape {list(hs.shape)}, expected [L={L}, K, H] or a list of [L, H]", path)
            parts = [hs[:, i] for i in range(hs.shape[1])]
        elif isinstance(hs, (list, tuple)):
            parts = [_as_2d(t, f"hidden_states[{i}]", path, L) for i, t in enumerate(hs)]
        else:
            raise TraceError(f"hidden_states is a {type(hs).__name__}, expected a list of tensors or [L, K, H]", path)
        if len(parts) < 2:
            raise TraceError(f"hidden_states holds {len(parts)} state(s); the trainer needs aux states + the verifier state", path)
        widths = {int(p.shape[-1]) for p in parts}
        if len(widths) != 1:
            raise TraceError(f"hidden_states entries differ in width {sorted(widths)}", path)
        if not parts[0].is_floating_point():
            raise TraceError("hidden_states is not floating point", path)
        draft = torch.cat(parts[:-1], dim=-1)
        return _Sample(key, ids, draft, parts[-1], None, len(parts) - 1)
    if "hidden_state" in d and "target" in d:  # v0
        draft = _as_2d(d["hidden_state"], "hidden_state", path, L)
        tgt = _as_2d(d["target"], "target", path, L)
        return _Sample(key, ids, draft, tgt, None, 0)
    raise TraceError("not a speculators data file (no hidden_states)", path)


def _plan_for(fmt: str, *, slots: int, hidden: int, ids, convention, num_layers, labels, prepend_embed,
              path: str) -> DraftPlan:
    """The draft plan (slot labels) of a file's packed input with ``slots`` slots (planned by
    :mod:`tensordiff.conventions`)."""
    if labels:
        want = slots + 1 if fmt == "speculators" else slots
        if len(labels) != want:
            what = ("states but the file's list holds {} (the aux states and the verifier state)"
                    if fmt == "speculators" else "slots but the packed input holds {}")
            raise TraceError(f"--labels names {len(labels)} {what.format(want)}", path)
        try:
            return conventions.plan_from_labels(labels, verifier_last=fmt == "speculators")
        except ValueError as e:
            raise TraceError(str(e)) from None
    if num_layers is None and (ids is None or convention == "eagle"):
        raise TraceError("the file does not say which layers it holds: give --aux-ids (with --convention), "
                         "--labels, or --num-layers for the default ids", path)
    n = int(num_layers) if num_layers is not None else 10**6
    conv = convention or ("specforge" if fmt == "specforge" else "speculators-legacy")
    # the legacy generator's id list names the verifier's layer too ([2, N//2, N-3, N-1])
    names_verifier = (fmt == "speculators" and ids is not None and len(ids) == slots + 1
                      and conv == "speculators-legacy" and not prepend_embed)
    try:
        plan = plan_draft_input(conv, ids, n, prepend_embed=prepend_embed, ids_name_verifier=names_verifier)
    except ValueError as e:
        raise TraceError(str(e)) from None
    if num_layers is None and (plan.verifier == boundary_label(n)):
        raise TraceError("the verifier state's layer depends on the model depth: give --num-layers "
                         "(or the verifier's id as the last of --aux-ids, or --labels)", path)
    if len(plan.fed) != slots:
        raise TraceError(f"the packed input holds {slots} slots of {hidden}, but {conv} ids "
                         f"{list(ids) if ids is not None else 'default'} select {len(plan.fed)}: {list(plan.fed)}", path)
    return plan


def _import_hidden_state_files(fmt: str, files: list[Path], roots: list[Path], make_recorder: Callable[[dict], Recorder],
                               result: ImportResult, *, ids, convention, num_layers, hidden_size, labels,
                               prepend_embed, limit) -> None:
    rec: Recorder | None = None
    plan: DraftPlan | None = None
    try:
        for i, p in enumerate(files):
            if limit is not None and i >= limit:
                break
            path = str(p)
            d = load_torch_file(p)
            key = _seq_key(p, _root_of(p, roots))
            s = _specforge_sample(d, path, key) if fmt == "specforge" else _speculators_sample(d, path, key)
            if rec is None:
                if fmt == "speculators" and s.slots:
                    hidden = int(s.verifier.shape[-1])
                elif s.final_norm is not None:
                    hidden = int(s.final_norm.shape[-1])
                elif s.verifier is not None:
                    hidden = int(s.verifier.shape[-1])
                elif hidden_size:
                    hidden = int(hidden_size)
                else:
                    k = len(labels) if labels else (len(ids) if ids is not None else 3)
                    hidden = int(s.draft.shape[-1]) // k
                if hidden_size and int(hidden_size) != hidden:
                    raise TraceError(f"the file's states are {hidden} wide, not --hidden-size {hidden_size}", path)
                width = int(s.draft.shape[-1])
                if width % hidden:
                    raise TraceError(f"the packed input is {width} wide, not a multiple of the hidden size {hidden}", path)
                plan = _plan_for(fmt, slots=width // hidden, hidden=hidden, ids=ids, convention=convention,
                                 num_layers=num_layers, labels=labels, prepend_embed=prepend_embed, path=path)
                model = {"num_layers": int(num_layers) if num_layers is not None else None, "hidden_size": hidden,
                         "dtype": logical_dtype(s.draft.dtype)}
                rec = make_recorder(model)
                result.plan = plan.as_attrs()
            H = rec.model["hidden_size"]
            if s.draft.shape[-1] != H * len(plan.fed):
                raise TraceError(f"packed input is {s.draft.shape[-1]} wide; the first file's was {H * len(plan.fed)}", path)
            rows = rec.add_tokens(key, None, s.ids, regime="train")
            rec.packed("draft_input", s.draft, _draft_rows(rows), labels=list(plan.fed),
                       raw_ids=list(plan.raw_ids) if plan.raw_ids is not None else None,
                       convention=plan.convention, token_offset=1, role="draft_input",
                       attrs={"draft_plan": plan.as_attrs(), "source_format": fmt})
            if s.verifier is not None:
                if s.verifier.shape[-1] != H:
                    raise TraceError(f"verifier state is {s.verifier.shape[-1]} wide, expected {H}", path)
                rec.record("verifier_last", s.verifier, rows, kind="other", role="verifier_target",
                           attrs={"label": plan.verifier, "source_format": fmt})
            if s.final_norm is not None:
                if s.final_norm.shape[-1] != H:
                    raise TraceError(f"hidden_state is {s.final_norm.shape[-1]} wide, expected {H}", path)
                rec.final_norm(s.final_norm, rows, attrs={"source_format": fmt})
            result.files += 1
            result.sequences += 1
            result.tokens += len(rows)
    except BaseException as e:
        if rec is not None:
            rec.close(e)
        raise
    if rec is None:
        raise TraceError("no files to import")
    result.tensors = rec.defined
    rec.close()


# ----------------------------------------------------------------------------------------------
# SGLang dumper directories
# ----------------------------------------------------------------------------------------------

_CORE = ("input_ids", "positions", "seq_lens", "rids", "req_pool_indices")
_NOT_IN_NAME = {"step", "rank", "dump_index", "name", "recompute_status", "world_rank", "world_size"}


def _dump_tensor_name(tags: dict[str, str]) -> str:
    extra = [(k, v) for k, v in tags.items() if k not in _NOT_IN_NAME and not k.endswith("_rank")
             and not k.endswith("_size")]
    name = tags["name"] + "".join(f"@{k}={v}" for k, v in extra)
    name = name.replace("/", "_")
    return name[:256]


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


def _import_sglang_dump(sources, make_recorder: Callable[[dict], Recorder], result: ImportResult, *,
                        rank: int | None, names: Sequence[str] | None, as_labels: dict[str, str],
                        hidden_size: int | None, num_layers: int | None, include_recompute: bool,
                        limit: int | None) -> None:
    entries = []  # (tags, path)
    exps = set()
    for s in sources:
        p = Path(s)
        cand = ([p] if p.is_file() else [q for q in sorted(p.rglob("*.pt"), key=natural_key)
                                          if _inside(q, p, result.skipped)] if p.is_dir() else None)
        if cand is None:
            raise TraceError("no such file or directory", str(p))
        for q in cand:
            tags = parse_dump_filename(q.name)
            if tags is None:
                result.skipped[q.name] = "not a dumper file name"
                continue
            entries.append((tags, q))
            exps.add(str(q.parent))
    if not entries:
        raise TraceError("no SGLang dumper files (step=..___rank=..___name=...pt) found", str(sources[0]))
    if len(exps) > 1:
        raise TraceError(f"dumps of {len(exps)} experiments (directories) found; import one: "
                         + ", ".join(sorted(exps)[:4]))

    def num(tags, k, default=0):
        try:
            return int(tags.get(k, default))
        except ValueError:
            raise TraceError(f"dump tag {k}={tags.get(k)!r} is not an integer") from None
    ranks = sorted({num(t, "rank") for t, _ in entries})
    use_rank = ranks[0] if rank is None else int(rank)
    if use_rank not in ranks:
        raise TraceError(f"no dumps of rank {use_rank}; ranks present: {ranks}")
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
                    raise TraceError("not an SGLang dump (no 'value' entry)", str(q))
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
                raise TraceError(f"step {step} has no input_ids dump: dump the forward batch's core fields "
                                 "(input_ids, positions, seq_lens, rids) with the tensors")
            T = len(ids)
            pos = _to_np_int(core.get("positions"))
            seq_lens = _to_np_int(core.get("seq_lens"))
            if pos is None:
                if seq_lens is not None and len(seq_lens) > 1:
                    raise TraceError(f"step {step} has {len(seq_lens)} sequences but no positions dump")
                pos = np.arange(T, dtype=np.int64)
            if len(pos) != T:
                raise TraceError(f"step {step}: {len(pos)} positions for {T} input_ids")
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
            for tname, v, path in tensors:
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
        raise TraceError("the dumps hold no tensors besides the forward batch's fields")
    if not rec.defined:
        rec.close()
        why = "; ".join(f"{k} ({v})" for k, v in list(result.skipped.items())[:3])
        raise SourceFileError(f"nothing imported: every tensor of the dumps was skipped: {why}")
    result.tensors = rec.defined
    rec.close()


def tags_name_only(tname: str) -> str:
    return tname.split("@", 1)[0]


# ----------------------------------------------------------------------------------------------
# Entry point
# ----------------------------------------------------------------------------------------------


def import_files(sources: Sequence[str | os.PathLike], out: str | os.PathLike, *, fmt: str = "auto",
                 side: str | None = None, aux_ids: Sequence[int] | None = None, convention: str | None = None,
                 num_layers: int | None = None, hidden_size: int | None = None, labels: Sequence[str] | None = None,
                 prepend_embed: bool = False, rank: int | None = None, names: Sequence[str] | None = None,
                 as_labels: dict[str, str] | None = None, include_recompute: bool = False,
                 limit: int | None = None, sample: Sampling | None = None, values: bool | Sequence[str] | None = None,
                 meta: dict | None = None) -> ImportResult:
    """Convert ``sources`` (files or directories) of one format into the trace ``out``."""
    if not sources:
        raise TraceError("nothing to import: give files or directories")
    if fmt == "auto":
        fmt = detect_format(sources)
    if fmt not in FORMATS:
        raise TraceError(f"unknown format {fmt!r}; one of {', '.join(FORMATS)}")
    if as_labels:
        for lab in as_labels.values():
            try:
                parse_label(lab)
            except ValueError as e:
                raise TraceError(str(e)) from None
    side = side or ("serve" if fmt == "sglang-dump" else "train")
    result = ImportResult(format=fmt, out=os.fspath(out))
    out_dir = os.path.dirname(os.path.abspath(os.fspath(out)))
    if not os.path.isdir(out_dir):
        raise TraceError("output directory does not exist", out_dir)

    created = []

    def make_recorder(model: dict) -> Recorder:
        model = {k: v for k, v in model.items() if v is not None}
        try:
            rec = Recorder(out, side=side, producer=f"tensordiff import ({fmt})", model=model,
                           meta={"imported_from": [os.fspath(s) for s in sources][:50], "format": fmt, **(meta or {})},
                           sample=sample, values=values)
        except OSError as e:
            raise TraceError(f"cannot create the trace file ({_short(e)})", os.fspath(out)) from None
        created.append(os.fspath(out))
        return rec

    try:
        if fmt == "sglang-dump":
            _import_sglang_dump(sources, make_recorder, result, rank=rank, names=names, as_labels=as_labels or {},
                                hidden_size=hidden_size, num_layers=num_layers, include_recompute=include_recompute,
                                limit=limit)
        else:
            pats = ("*.ckpt", "*.ckpt.gz") if fmt == "specforge" else ("*.pt", "*.pt.gz")
            files = _expand(sources, pats, result.skipped)
            _import_hidden_state_files(fmt, files, _roots(sources), make_recorder, result,
                                       ids=list(aux_ids) if aux_ids is not None else None, convention=convention,
                                       num_layers=num_layers, hidden_size=hidden_size, labels=labels,
                                       prepend_embed=prepend_embed, limit=limit)
    except BaseException as e:
        for path in created:  # a failed import leaves no half-written trace behind
            try:
                os.remove(path)
            except OSError:
                pass
        if isinstance(e, ValueError):  # the trace writer refused something the checks above let through
            raise SourceFileError(f"cannot import: the trace writer refused it ({_short(e)})") from None
        raise
    return result


# ----------------------------------------------------------------------------------------------
# vLLM extract_hidden_states, TensorRT-LLM saved hidden states, NVIDIA Model-Optimizer
# (appended; layouts in shared notes/vllm.md and docs/vllm.md)
# ----------------------------------------------------------------------------------------------

#: Formats these importers add; ``import_cli`` dispatches them to :func:`import_engine_files`.
ENGINE_FORMATS = ("vllm-hidden-states", "trtllm", "modelopt")


def load_safetensors_file(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """``safetensors.torch.load_file`` (tensors only, never code); anything else raises
    :class:`SourceFileError` with one line."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from ..errors import SourceFileError

    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            head = f.read(8)
        if len(head) < 8 or int.from_bytes(head, "little") > os.path.getsize(path):
            raise SourceFileError("not a safetensors file (no header)", path)
        return load_file(path, device="cpu")
    except FileNotFoundError:
        raise SourceFileError("no such file", path) from None
    except IsADirectoryError:
        raise SourceFileError("is a directory, not a safetensors file", path) from None
    except PermissionError:
        raise SourceFileError("permission denied", path) from None
    except (SafetensorError, OSError, ValueError, RuntimeError, MemoryError) as e:
        raise SourceFileError(f"cannot load as a safetensors file, truncated or damaged ({_short(e)})", path) from None


def detect_engine_format(sources: Sequence[str | os.PathLike]) -> str | None:
    """``vllm-hidden-states`` (``.safetensors`` files), ``trtllm`` (a ``.pt`` holding a list of
    records with ``hidden_state_features``) or ``modelopt`` (a ``.pt`` dict with
    ``aux_hidden_states``); None when the sources are none of these."""
    first = Path(sources[0])
    if not first.exists():
        return None
    if first.is_dir():
        if next(iter(first.rglob("*.safetensors")), None) is not None:
            return "vllm-hidden-states"
        probe = next(iter(sorted(first.rglob("*.pt"), key=natural_key)), None)
        if probe is None:
            return None
    else:
        if first.name.endswith(".safetensors"):
            return "vllm-hidden-states"
        probe = first
    if not probe.name.endswith(".pt"):
        return None
    try:
        data = load_torch_file(probe)
    except TraceError:
        return None
    if isinstance(data, (list, tuple)) and data and isinstance(data[0], dict) and "hidden_state_features" in data[0]:
        return "trtllm"
    if isinstance(data, dict) and "aux_hidden_states" in data:
        return "modelopt"
    return None


def _engine_labels(fmt: str, k: int, *, ids, labels, num_layers, convention, path: str) -> tuple[list[str], str, list | None]:
    """(slot labels, convention, raw ids) of a K-slot capture."""
    from ..errors import SourceFileError, UsageError

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
    from ..errors import SourceFileError

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
    from ..errors import SourceFileError

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
                feats = _as_2d(rec["hidden_state_features"], "hidden_state_features", where, len(ids))
                last = rec.get("hidden_state")
                last = _as_2d(last, "hidden_state", where, len(ids)) if last is not None else None
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
            ids = _int_ids(d["input_ids"], "input_ids", path)
            aux = _as_2d(d["aux_hidden_states"], "aux_hidden_states", path, len(ids))
            fin = d.get("hidden_states")
            fin = _as_2d(fin, "hidden_states", path, len(ids)) if fin is not None else None
            H = int(fin.shape[-1]) if fin is not None else (int(hidden_size) if hidden_size else None)
            if H is None:
                raise SourceFileError("no hidden_states to size the slots by: give --hidden-size", path)
            if aux.shape[-1] % H:
                raise SourceFileError(f"aux_hidden_states is {aux.shape[-1]} wide, not a multiple of {H}", path)
            key = str(d.get("conversation_id", stem))
            key = key if key not in seen else stem
            seen.add(key)
            yield path, key, ids, aux, int(aux.shape[-1]) // H, {"final": fin}


def import_engine_files(sources: Sequence[str | os.PathLike], out: str | os.PathLike, *, fmt: str,
                        side: str | None = None, aux_ids: Sequence[int] | None = None, convention: str | None = None,
                        num_layers: int | None = None, hidden_size: int | None = None,
                        labels: Sequence[str] | None = None, limit: int | None = None,
                        values: bool | Sequence[str] | None = None) -> ImportResult:
    """Import vLLM ``extract_hidden_states`` connector files, TensorRT-LLM saved hidden states or
    Model-Optimizer ``collect_hidden_states`` files into the trace ``out``.

    * ``vllm-hidden-states``: ``<req_id>.safetensors`` with ``hidden_states`` [T, K, H] (slots in
      vLLM's capture order: the ids sorted) and ``token_ids`` [T] -> ``aux_hidden_states`` (role
      aux, token_offset 0), side ``serve``.
    * ``trtllm``: ``.pt`` lists of ``{id, input_ids, hidden_state [T, H], hidden_state_features
      [T, K*H]}`` -> ``aux_hidden_states`` (ids "output of layer id", sorted, ``-1`` =
      ``final_norm`` last), and ``hidden_state`` (always the last H columns) as the catalog state of
      the last slot; side ``serve``.
    * ``modelopt``: ``.pt`` dicts ``{input_ids, hidden_states [T, H] (post-norm),
      aux_hidden_states [T, K*H]}`` -> ``draft_input`` (role draft_input, token_offset 1: the
      trainer pairs row t with token t+1) and ``final_norm``; side ``train``. Ids are HF
      ``hidden_states`` indices, default ``sorted(set([2, N//2, N-3]))``.
    """
    from ..errors import SourceFileError, UsageError

    if fmt not in ENGINE_FORMATS:
        raise UsageError(f"unknown format {fmt!r}; one of {', '.join(ENGINE_FORMATS)}")
    if not sources:
        raise UsageError("nothing to import: give files or directories")
    out_dir = os.path.dirname(os.path.abspath(os.fspath(out)))
    if not os.path.isdir(out_dir):
        raise UsageError("output directory does not exist", out_dir)
    pats = ("*.safetensors",) if fmt == "vllm-hidden-states" else ("*.pt",)
    files = _expand(sources, pats)
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
                try:
                    rec = Recorder(out, side=side, producer=f"tensordiff import ({fmt})", model=model,
                                   meta={"imported_from": [os.fspath(s) for s in sources][:50], "format": fmt,
                                         "labels": lab, "convention": conv, "raw_ids": raw,
                                         "capture_order_note": conventions.capture_order_note(conv, raw, num_layers)},
                                   values=values)
                except OSError as e:
                    raise UsageError(f"cannot create the trace file ({_short(e)})", os.fspath(out)) from None
                result.plan = {"fed": lab, "convention": conv, "raw_ids": raw}
            elif int(packed.shape[-1]) != H * len(lab) or H != rec.model["hidden_size"]:
                raise SourceFileError(f"states are {packed.shape[-1]} wide; the first file's were "
                                      f"{rec.model['hidden_size'] * len(lab)}", path)
            rows = rec.add_tokens(key, None, ids, regime="prefill" if side == "serve" else "train")
            if fmt == "modelopt":
                rec.packed("draft_input", packed, _draft_rows(rows), labels=lab, raw_ids=raw, convention=conv,
                           token_offset=1, role="draft_input", attrs={"source_format": fmt})
                if extra.get("final") is not None:
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
            try:
                os.remove(os.fspath(out))  # a failed import leaves no half-written trace behind
            except OSError:
                pass
        raise
    if rec is None:
        raise SourceFileError("no records to import", str(sources[0]))
    result.tensors = rec.defined
    rec.close()
    return result
