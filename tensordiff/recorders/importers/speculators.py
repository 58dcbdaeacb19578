"""speculators data files (``.pt``): ``hidden_states`` a list of per-layer [L, H] tensors (legacy
v1; the trainer packs ``list[:-1]`` and takes ``list[-1]`` as the verifier state) or a stacked
[L, K, H] tensor (``[:, :-1]`` aux input, ``[:, -1]`` verifier state), or the v0 layout
(``hidden_state`` [L, K*H] + ``target`` [L, H]); or speculators 0.9.0's ``hs_<index>.safetensors``
(``generate-offline-data`` moves there the file vLLM's ``extract_hidden_states`` connector wrote:
``hidden_states`` [L, K, H] in vLLM's capture order, the sorted layer ids, the last of them the
verifier's; ``token_ids`` [L]; the trainer packs ``[:, :-1]`` and takes ``[:, -1]`` as the verifier
state).
-> ``draft_input`` + ``verifier_last`` (role verifier_target, attr ``label``: what the ids say it
is), recorded by :func:`tensordiff.recorders.importers.offline.import_hidden_state_files`.
"""

from __future__ import annotations

from typing import Any

import torch

from ...errors import SourceFileError
from .common import as_2d, token_ids
from .layouts import check_keys
from .offline import Sample

PATTERNS = ("*.pt", "*.pt.gz", "hs_*.safetensors")
#: the trainer's layout of speculators 0.9.0 (``hs_<index>.safetensors``, vLLM-written)
HS_LAYOUT = "speculators-hs"


def is_hs_file(name: str) -> bool:
    """``hs_<index>.safetensors``: the name speculators 0.9.0's generate-offline-data gives a file."""
    return name.startswith("hs_") and name.endswith(".safetensors") and name[3:-len(".safetensors")].isdigit()


def speculators_hs_sample(d: Any, path: str, key: str) -> Sample:
    """A speculators 0.9.0 ``hs_<index>.safetensors`` sample: the stacked [L, K, H] states in
    vLLM's capture order; ``[:, :-1]`` is what the trainer feeds, ``[:, -1]`` its verifier state."""
    check_keys(HS_LAYOUT, d, path, "a speculators hs_<index>.safetensors file")
    if "hidden_states" not in d or "token_ids" not in d:
        raise SourceFileError(f"not a speculators hs_<index>.safetensors file (needs hidden_states and token_ids; found "
                         f"{sorted(d)[:6]})", path)
    ids = token_ids({"input_ids": d["token_ids"]}, path)
    hs = d["hidden_states"]
    if hs.ndim != 3 or hs.shape[0] != len(ids) or hs.shape[1] < 2:
        raise SourceFileError(f"hidden_states has shape {list(hs.shape)}, expected [L={len(ids)}, K>=2, H] (the aux states "
                         "and the verifier state)", path)
    if not hs.is_floating_point():
        raise SourceFileError("hidden_states is not floating point", path)
    return Sample(key, ids, hs[:, :-1].flatten(1), hs[:, -1], None, int(hs.shape[1]) - 1, layout=HS_LAYOUT)


def speculators_sample(d: Any, path: str, key: str) -> Sample:
    if not isinstance(d, dict):
        raise SourceFileError(f"not a speculators data file (a {type(d).__name__}, not a dict)", path)
    if is_hs_file(path.rsplit("/", 1)[-1]):
        return speculators_hs_sample(d, path, key)
    check_keys("speculators", d, path, "a speculators data file")
    ids = token_ids(d, path)
    L = len(ids)
    if "hidden_states" in d:
        hs = d["hidden_states"]
        if isinstance(hs, torch.Tensor):
            while hs.ndim > 3 and hs.shape[0] == 1:
                hs = hs[0]
            if hs.ndim != 3 or hs.shape[0] != L:
                raise SourceFileError(f"hidden_states has shape {list(hs.shape)}, expected [L={L}, K, H] or a list of [L, H]",
                                      path)
            parts = [hs[:, i] for i in range(hs.shape[1])]
        elif isinstance(hs, (list, tuple)):
            parts = [as_2d(t, f"hidden_states[{i}]", path, L) for i, t in enumerate(hs)]
        else:
            raise SourceFileError(f"hidden_states is a {type(hs).__name__}, expected a list of tensors or [L, K, H]", path)
        if len(parts) < 2:
            raise SourceFileError(f"hidden_states holds {len(parts)} state(s); the trainer needs aux states + the "
                             "verifier state", path)
        widths = {int(p.shape[-1]) for p in parts}
        if len(widths) != 1:
            raise SourceFileError(f"hidden_states entries differ in width {sorted(widths)}", path)
        if not parts[0].is_floating_point():
            raise SourceFileError("hidden_states is not floating point", path)
        draft = torch.cat(parts[:-1], dim=-1)
        return Sample(key, ids, draft, parts[-1], None, len(parts) - 1)
    if "hidden_state" in d and "target" in d:  # v0
        draft = as_2d(d["hidden_state"], "hidden_state", path, L)
        tgt = as_2d(d["target"], "target", path, L)
        return Sample(key, ids, draft, tgt, None, 0)
    raise SourceFileError("not a speculators data file (no hidden_states)", path)
