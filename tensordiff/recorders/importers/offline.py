"""Draft trainers' offline hidden-state files (SpecForge, speculators): one sequence per file,
parsed by the format's module into a :class:`Sample`; this module plans the packed input's slot
labels (through :mod:`tensordiff.conventions`) and records every sample: ``draft_input`` (packed,
token_offset 1), ``verifier_last`` and ``final_norm`` where the file has them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from ... import conventions
from ...errors import SourceFileError, UsageError
from ...vocab import boundary_label
from ..core import Recorder, logical_dtype
from ..hf import DraftPlan, plan_draft_input
from .common import ImportResult, draft_rows
from .files import load_torch_file


@dataclass
class Sample:
    key: str
    ids: np.ndarray
    draft: torch.Tensor | None         # [L, K*H] what the trainer packs
    verifier: torch.Tensor | None      # [L, H]
    final_norm: torch.Tensor | None    # [L, H]
    slots: int


def seq_key(path: Path, root: Path | None) -> str:
    """A file's sequence key: its path under the directory it was found in, without extension."""
    rel = path.relative_to(root) if root is not None and root in path.parents else Path(path.name)
    s = str(rel)
    for ext in (".ckpt.gz", ".pt.gz", ".ckpt", ".pt"):
        if s.endswith(ext):
            return s[: -len(ext)]
    return s


def source_roots(sources) -> list[Path]:
    """The directories among ``sources`` (a sequence key is a path under one of them)."""
    return [Path(s) for s in sources if Path(s).is_dir()]


def _root_of(p: Path, roots: list[Path]) -> Path | None:
    for r in roots:
        if r in p.parents:
            return r
    return None


def plan_for(fmt: str, *, slots: int, hidden: int, ids, convention, num_layers, labels, prepend_embed,
             path: str) -> DraftPlan:
    """The draft plan (slot labels) of a file's packed input with ``slots`` slots (planned by
    :mod:`tensordiff.conventions`)."""
    if labels:
        want = slots + 1 if fmt == "speculators" else slots
        if len(labels) != want:
            what = ("states but the file's list holds {} (the aux states and the verifier state)"
                    if fmt == "speculators" else "slots but the packed input holds {}")
            raise UsageError(f"--labels names {len(labels)} {what.format(want)}", path)
        try:
            return conventions.plan_from_labels(labels, verifier_last=fmt == "speculators")
        except ValueError as e:
            raise UsageError(str(e)) from None
    if num_layers is None and (ids is None or convention == "eagle"):
        raise UsageError("the file does not say which layers it holds: give --aux-ids (with --convention), "
                         "--labels, or --num-layers for the default ids", path)
    n = int(num_layers) if num_layers is not None else 10**6
    conv = convention or ("specforge" if fmt == "specforge" else "speculators-legacy")
    # the legacy generator's id list names the verifier's layer too ([2, N//2, N-3, N-1])
    names_verifier = (fmt == "speculators" and ids is not None and len(ids) == slots + 1
                      and conv == "speculators-legacy" and not prepend_embed)
    try:
        plan = plan_draft_input(conv, ids, n, prepend_embed=prepend_embed, ids_name_verifier=names_verifier)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if num_layers is None and (plan.verifier == boundary_label(n)):
        raise UsageError("the verifier state's layer depends on the model depth: give --num-layers "
                         "(or the verifier's id as the last of --aux-ids, or --labels)", path)
    if len(plan.fed) != slots:
        raise UsageError(f"the packed input holds {slots} slots of {hidden}, but {conv} ids "
                         f"{list(ids) if ids is not None else 'default'} select {len(plan.fed)}: {list(plan.fed)}", path)
    return plan


def import_hidden_state_files(fmt: str, parse: Callable[[Any, str, str], Sample], files: list[Path], roots: list[Path],
                              make_recorder: Callable[[dict], Recorder], result: ImportResult, *, ids, convention,
                              num_layers, hidden_size, labels, prepend_embed, limit) -> None:
    """Record ``files`` of ``fmt``, each parsed by ``parse(data, path, key)``, into one trace."""
    rec: Recorder | None = None
    plan: DraftPlan | None = None
    try:
        for i, p in enumerate(files):
            if limit is not None and i >= limit:
                break
            path = str(p)
            d = load_torch_file(p)
            key = seq_key(p, _root_of(p, roots))
            s = parse(d, path, key)
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
                    raise SourceFileError(f"the file's states are {hidden} wide, not --hidden-size {hidden_size}", path)
                width = int(s.draft.shape[-1])
                if width % hidden:
                    raise SourceFileError(f"the packed input is {width} wide, not a multiple of the hidden size {hidden}", path)
                plan = plan_for(fmt, slots=width // hidden, hidden=hidden, ids=ids, convention=convention,
                                num_layers=num_layers, labels=labels, prepend_embed=prepend_embed, path=path)
                model = {"num_layers": int(num_layers) if num_layers is not None else None, "hidden_size": hidden,
                         "dtype": logical_dtype(s.draft.dtype)}
                rec = make_recorder(model)
                result.plan = plan.as_attrs()
            H = rec.model["hidden_size"]
            if s.draft.shape[-1] != H * len(plan.fed):
                raise SourceFileError(f"packed input is {s.draft.shape[-1]} wide; the first file's was {H * len(plan.fed)}", path)
            rows = rec.add_tokens(key, None, s.ids, regime="train")
            rec.packed("draft_input", s.draft, draft_rows(rows), labels=list(plan.fed),
                       raw_ids=list(plan.raw_ids) if plan.raw_ids is not None else None,
                       convention=plan.convention, token_offset=1, role="draft_input",
                       attrs={"draft_plan": plan.as_attrs(), "source_format": fmt})
            if s.verifier is not None:
                if s.verifier.shape[-1] != H:
                    raise SourceFileError(f"verifier state is {s.verifier.shape[-1]} wide, expected {H}", path)
                rec.record("verifier_last", s.verifier, rows, kind="other", role="verifier_target",
                           attrs={"label": plan.verifier, "source_format": fmt})
            if s.final_norm is not None:
                if s.final_norm.shape[-1] != H:
                    raise SourceFileError(f"hidden_state is {s.final_norm.shape[-1]} wide, expected {H}", path)
                rec.final_norm(s.final_norm, rows, attrs={"source_format": fmt})
            result.files += 1
            result.sequences += 1
            result.tokens += len(rows)
    except BaseException as e:
        if rec is not None:
            rec.close(e)
        raise
    if rec is None:
        raise UsageError("no files to import")
    result.tensors = rec.defined
    rec.close()
