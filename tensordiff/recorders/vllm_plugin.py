"""Alias of :mod:`tensordiff.recorders.vllm`, the vLLM plugin, for ``VLLM_PLUGINS`` setups, entry
points (an install made before the split names ``tensordiff.recorders.vllm_plugin:register``) and
imports that name the old single-module path. Everything lives in the package now; this module
re-exports exactly the package's ``__all__``, so the two cannot drift."""

from __future__ import annotations

from .vllm import *  # noqa: F403
from .vllm import __all__  # noqa: F401
