"""Configuration of the vLLM plugin: the same ``TENSORDIFF_*`` environment as the SGLang plugin
(:class:`tensordiff.recorders.sglang.config.Config`, read by the Worker process; per-rank trace
paths by :func:`~tensordiff.recorders.sglang.config.rank_path`), and the names of the tensors
this plugin records.

Standard library only: this module is imported in every vLLM process that loads the plugin.
"""

from __future__ import annotations

from ..sglang.config import Config, rank_path

AUX = "aux_hidden_states"
DRAFT = "draft_input"
DRAFT_IDS = "draft_input_ids"

__all__ = ["AUX", "DRAFT", "DRAFT_IDS", "Config", "rank_path"]
