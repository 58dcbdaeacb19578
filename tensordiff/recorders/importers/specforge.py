"""SpecForge offline hidden states (``scripts/prepare_hidden_states.py``): one ``.ckpt`` or
``.ckpt.gz`` torch dict per sample: ``input_ids`` [L], ``loss_mask`` [L], ``aux_hidden_state``
[1, L, K*H] (slots in config order), ``hidden_state`` [1, L, H] (post-final-norm). Checked against
specforge 0.2.0 (its offline storage contract ``specforge_hidden_states_v1``), whose SGLang capture
of id ``i`` is ``hidden_states[i + 1]``.
-> ``draft_input`` (packed, role draft_input, token_offset 1) + ``final_norm`` (catalog), recorded
by :func:`tensordiff.recorders.importers.offline.import_hidden_state_files`.
"""

from __future__ import annotations

from typing import Any

from ...errors import SourceFileError
from .common import as_2d, token_ids
from .layouts import check_keys
from .offline import Sample

PATTERNS = ("*.ckpt", "*.ckpt.gz")


def specforge_sample(d: Any, path: str, key: str) -> Sample:
    if not isinstance(d, dict) or "aux_hidden_state" not in d:
        raise SourceFileError("not a SpecForge hidden-state file (no aux_hidden_state)", path)
    check_keys("specforge", d, path, "a SpecForge hidden-state file")
    ids = token_ids(d, path)
    aux = as_2d(d["aux_hidden_state"], "aux_hidden_state", path, len(ids))
    fn = d.get("hidden_state")
    fn = as_2d(fn, "hidden_state", path, len(ids)) if fn is not None else None
    return Sample(key, ids, aux, None, fn, 0)
