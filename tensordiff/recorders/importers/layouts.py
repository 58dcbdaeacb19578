"""The producer file layouts the importers know, and the producer versions they were checked
against (the tests have each producer's own code write or read these files). A file whose keys are
not all in its format's known layout is refused with one line naming the unknown keys, rather than
read by guessing what a new key changes: a producer that adds a key (such as Model-Optimizer's
``hidden_states_prenorm``) may change what an old key holds.
"""

from __future__ import annotations

from typing import Any

from ...errors import SourceFileError

#: format -> (the producer versions whose files the tests had their own code write or read, the
#: keys their files may hold)
LAYOUTS: dict[str, tuple[str, frozenset[str]]] = {
    # scripts/prepare_hidden_states.py; specforge 0.2.0's offline storage contract
    # "specforge_hidden_states_v1" (eagle3 OfflineCaptureLayout: input_ids, loss_mask,
    # aux_hidden_state, hidden_state)
    "specforge": ("specforge 0.2.0", frozenset({"input_ids", "loss_mask", "aux_hidden_state", "hidden_state"})),
    # the legacy data generator's .pt dicts (list or stacked hidden_states; v0 hidden_state + target)
    "speculators": ("speculators legacy (.pt)", frozenset({"input_ids", "loss_mask", "hidden_states",
                                                           "hidden_state", "target"})),
    # speculators 0.9.0 generate-offline-data: vLLM's extract_hidden_states file moved to
    # hs_<index>.safetensors
    "speculators-hs": ("speculators 0.9.0 with vLLM 0.32.0", frozenset({"hidden_states", "token_ids"})),
    # examples/speculative_decoding/collect_hidden_states and the keys nvidia-modelopt 0.47.0's
    # OfflineSupervisedDataset reads
    "modelopt": ("nvidia-modelopt 0.47.0", frozenset({"input_ids", "hidden_states", "aux_hidden_states",
                                                      "conversation_id", "loss_mask", "hidden_states_prenorm"})),
}

#: one line for the trace metadata and the docs: what each format was checked against
CHECKED_AGAINST = {fmt: v for fmt, (v, _) in LAYOUTS.items()}


def check_keys(fmt: str, d: Any, path: str, what: str) -> None:
    """Refuse a dict file holding a key the known layout of ``fmt`` does not have."""
    if not isinstance(d, dict):
        return
    version, known = LAYOUTS[fmt]
    unknown = sorted(str(k) for k in d if k not in known)
    if unknown:
        shown = ", ".join(repr(k)[:40] for k in unknown[:4]) + (", ..." if len(unknown) > 4 else "")
        raise SourceFileError(f"{what} with key(s) {shown} that the layout checked against ({version}) does not "
                              f"have: a layout tensordiff does not know; it refuses rather than guesses", path)
