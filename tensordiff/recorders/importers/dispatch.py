"""The draft trainers' and SGLang's formats (``specforge``, ``speculators``, ``sglang-dump``):
which one the sources are (:func:`detect_format`, from names and the first file's keys) and
:func:`import_files`, which checks the arguments, opens the trace and hands the sources to the
format's importer; a failed import leaves no half-written trace behind.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

from ...errors import SourceFileError, UsageError
from ...vocab import parse_label
from ..core import Recorder, Sampling
from . import specforge, speculators
from .common import ImportResult, check_out_dir, discard, open_trace
from .files import expand, load_torch_file, natural_key, short
from .offline import import_hidden_state_files, source_roots
from .sglang_dump import import_sglang_dump, parse_dump_filename

FORMATS = ("specforge", "speculators", "sglang-dump")


def detect_format(sources: Sequence[str | os.PathLike]) -> str:
    """``specforge``, ``speculators`` or ``sglang-dump``, from names and the first file's keys."""
    first = Path(sources[0])
    if not first.exists():
        raise SourceFileError("no such file or directory", str(first))
    if first.is_dir():
        if any(speculators.is_hs_file(q.name) for q in first.rglob("hs_*.safetensors")):
            return "speculators"
        names = [q.name for q in first.rglob("*.pt")][:1000]
        if any(parse_dump_filename(n) for n in names):
            return "sglang-dump"
        ckpts = next(iter(first.rglob("*.ckpt")), None) or next(iter(first.rglob("*.ckpt.gz")), None)
        probe = ckpts or next(iter(sorted(first.rglob("*.pt"), key=natural_key)), None)
        if probe is None:
            raise SourceFileError("no .ckpt, .ckpt.gz or .pt files in this directory", str(first))
    else:
        if parse_dump_filename(first.name):
            return "sglang-dump"
        if speculators.is_hs_file(first.name):
            return "speculators"
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
    raise SourceFileError(f"unrecognised file: neither SpecForge (aux_hidden_state), speculators (hidden_states) "
                     f"nor an SGLang dump (value, meta); found {keys}", str(probe))


def import_files(sources: Sequence[str | os.PathLike], out: str | os.PathLike, *, fmt: str = "auto",
                 side: str | None = None, aux_ids: Sequence[int] | None = None, convention: str | None = None,
                 num_layers: int | None = None, hidden_size: int | None = None, labels: Sequence[str] | None = None,
                 prepend_embed: bool = False, rank: int | None = None, names: Sequence[str] | None = None,
                 as_labels: dict[str, str] | None = None, include_recompute: bool = False,
                 limit: int | None = None, sample: Sampling | None = None, values: bool | Sequence[str] | None = None,
                 meta: dict | None = None) -> ImportResult:
    """Convert ``sources`` (files or directories) of one format into the trace ``out``."""
    if not sources:
        raise UsageError("nothing to import: give files or directories")
    if fmt == "auto":
        fmt = detect_format(sources)
    if fmt not in FORMATS:
        raise UsageError(f"unknown format {fmt!r}; one of {', '.join(FORMATS)}")
    if as_labels:
        for lab in as_labels.values():
            try:
                parse_label(lab)
            except ValueError as e:
                raise UsageError(str(e)) from None
    side = side or ("serve" if fmt == "sglang-dump" else "train")
    result = ImportResult(format=fmt, out=os.fspath(out))
    check_out_dir(out)

    created = []

    def make_recorder(model: dict) -> Recorder:
        model = {k: v for k, v in model.items() if v is not None}
        rec = open_trace(out, side=side, fmt=fmt, sources=sources, model=model, meta=meta or {}, sample=sample,
                         values=values)
        created.append(os.fspath(out))
        return rec

    try:
        if fmt == "sglang-dump":
            import_sglang_dump(sources, make_recorder, result, rank=rank, names=names, as_labels=as_labels or {},
                               hidden_size=hidden_size, num_layers=num_layers, include_recompute=include_recompute,
                               limit=limit)
        else:
            parse, pats = ((specforge.specforge_sample, specforge.PATTERNS) if fmt == "specforge"
                           else (speculators.speculators_sample, speculators.PATTERNS))
            files = expand(sources, pats, result.skipped)
            import_hidden_state_files(fmt, parse, files, source_roots(sources), make_recorder, result,
                                      ids=list(aux_ids) if aux_ids is not None else None, convention=convention,
                                      num_layers=num_layers, hidden_size=hidden_size, labels=labels,
                                      prepend_embed=prepend_embed, limit=limit)
    except BaseException as e:
        for path in created:  # a failed import leaves no half-written trace behind
            discard(path)
        if isinstance(e, ValueError):  # the trace writer refused something the checks above let through
            raise SourceFileError(f"cannot import: the trace writer refused it ({short(e)})") from None
        raise
    return result
