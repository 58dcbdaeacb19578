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
from .files import load_safetensors_file, load_torch_file
from .layouts import CHECKED_AGAINST


@dataclass
class Sample:
    key: str
    ids: np.ndarray
    draft: torch.Tensor | None         # [L, K*H] what the trainer packs
    verifier: torch.Tensor | None      # [L, H]
    final_norm: torch.Tensor | None    # [L, H]
    slots: int
    layout: str = ""                   # a layout other than the format's first (speculators-hs)


def seq_key(path: Path, root: Path | None) -> str:
    """A file's sequence key: its path under the directory it was found in, without extension."""
    rel = path.relative_to(root) if root is not None and root in path.parents else Path(path.name)
    s = str(rel)
    for ext in (".ckpt.gz", ".pt.gz", ".ckpt", ".pt", ".safetensors"):
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


def plan_for_hs(*, slots: int, ids, convention, num_layers, prepend_embed, path: str) -> DraftPlan:
    """The plan of a speculators 0.9.0 ``hs_<index>.safetensors`` file: vLLM captured boundary
    ``id`` for each id the server was launched with (id 0 = embedding, id N = the last decoder
    layer's output, pre-norm), in sorted order, and the trainer splits the last one off as the
    verifier state. ``ids``: that launch list (aux ids + the verifier's), or only the draft's aux
    ids (the verifier's is then N, ``--include-last-layer``); none: speculators' default
    ``[2, N//2, N-3]`` + N."""
    if prepend_embed:
        raise UsageError("--prepend-embed models the legacy extractor's .pt lists; hs_<index>.safetensors files were "
                         "written by vLLM", path)
    if convention not in (None, "vllm", "speculators"):
        raise UsageError(f"hs_<index>.safetensors files hold vLLM's capture: --convention {convention} does not apply "
                         "(give --labels to name the states outright)", path)
    given = [int(i) for i in ids] if ids is not None else None
    if given is None or len(given) == slots:
        if num_layers is None:
            raise UsageError("the verifier state is the last layer's output: give --num-layers (or the launch list "
                             "with the verifier's id as the last of --aux-ids, or --labels)", path)
        n = int(num_layers)
        aux = given if given is not None else [2, n // 2, n - 3]
        launch = [*aux, n]
    else:
        launch = given
    for i in launch:
        if i < 0 or (num_layers is not None and i > int(num_layers)):
            raise UsageError(f"layer id {i} is outside 0..{num_layers if num_layers is not None else 'N'}", path)
    captured = tuple(boundary_label(b) for b in sorted(set(launch)))
    if len(captured) != slots + 1:
        raise UsageError(f"the file holds {slots} aux state(s) and the verifier state, but the ids {launch} select "
                         f"{len(captured)} distinct layers: {list(captured)}", path)
    fed = captured[:-1]
    return DraftPlan("vllm", tuple(given) if given is not None else None, captured, fed, captured[-1], fed,
                     "speculators 0.9.0 through vLLM extract_hidden_states: hidden_states[:, k] = boundary "
                     "sorted(ids)[k]; draft = hidden_states[:, :-1]; verifier = hidden_states[:, -1]")


def plan_for(fmt: str, *, slots: int, hidden: int, ids, convention, num_layers, labels, prepend_embed,
             path: str, layout: str = "") -> DraftPlan:
    """The draft plan (slot labels) of a file's packed input with ``slots`` slots (planned by
    :mod:`tensordiff.conventions`)."""
    if layout == "speculators-hs" and not labels:
        return plan_for_hs(slots=slots, ids=ids, convention=convention, num_layers=num_layers,
                           prepend_embed=prepend_embed, path=path)
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
    layout = ""
    try:
        for i, p in enumerate(files):
            if limit is not None and i >= limit:
                break
            path = str(p)
            d = load_safetensors_file(p) if p.name.endswith(".safetensors") else load_torch_file(p)
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
                                num_layers=num_layers, labels=labels, prepend_embed=prepend_embed, path=path,
                                layout=s.layout)
                layout = s.layout
                model = {"num_layers": int(num_layers) if num_layers is not None else None, "hidden_size": hidden,
                         "dtype": logical_dtype(s.draft.dtype)}
                rec = make_recorder(model)
                result.plan = plan.as_attrs()
            H = rec.model["hidden_size"]
            if s.layout != layout:
                raise SourceFileError("files of two layouts in one import (hs_<index>.safetensors and .pt): import them "
                                 "separately", path)
            if s.draft.shape[-1] != H * len(plan.fed):
                raise SourceFileError(f"packed input is {s.draft.shape[-1]} wide; the first file's was {H * len(plan.fed)}", path)
            rows = rec.add_tokens(key, None, s.ids, regime="train")
            rec.packed("draft_input", s.draft, draft_rows(rows), labels=list(plan.fed),
                       raw_ids=list(plan.raw_ids) if plan.raw_ids is not None else None,
                       convention=plan.convention, token_offset=1, role="draft_input",
                       attrs={"draft_plan": plan.as_attrs(), "source_format": fmt,
                              "checked_against": CHECKED_AGAINST[layout or fmt]})
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
