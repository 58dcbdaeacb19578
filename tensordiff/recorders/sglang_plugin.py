"""Alias of :mod:`tensordiff.recorders.sglang`, the SGLang plugin, for ``SGLANG_PLUGINS`` setups,
entry points and imports that name the old single-module path
(``tensordiff.recorders.sglang_plugin:register``). Everything lives in the package now."""

from __future__ import annotations

from .sglang import (
                     AUX,
                     DEFAULT_VALUES,
                     DRAFT,
                     DRAFT_IDS,
                     ENV_TRACE,
                     HOOK_TARGETS,
                     RPC_METHODS,
                     RPC_PREFIX,
                     Config,
                     hook_table,
                     rank_path,
                     register,
)

__all__ = [
                     "AUX",
                     "DEFAULT_VALUES",
                     "DRAFT",
                     "DRAFT_IDS",
                     "ENV_TRACE",
                     "HOOK_TARGETS",
                     "RPC_METHODS",
                     "RPC_PREFIX",
                     "Config",
                     "hook_table",
                     "rank_path",
                     "register",
]
