"""Alias of :mod:`tensordiff.recorders.vllm`, the vLLM plugin, for ``VLLM_PLUGINS`` setups, entry
points (an install made before the split names ``tensordiff.recorders.vllm_plugin:register``) and
imports that name the old single-module path. Everything lives in the package now."""

from __future__ import annotations

from .vllm import (
    AUX,
    DRAFT,
    DRAFT_IDS,
    HOOK_TARGETS,
    IDLE_FLUSH_SECONDS,
    RPC_METHODS,
    Config,
    hook_table,
    rank_path,
    register,
)

__all__ = [
    "AUX",
    "DRAFT",
    "DRAFT_IDS",
    "HOOK_TARGETS",
    "IDLE_FLUSH_SECONDS",
    "RPC_METHODS",
    "Config",
    "hook_table",
    "rank_path",
    "register",
]
