"""Alias of :mod:`tensordiff.recorders.sglang`, the SGLang plugin, for ``SGLANG_PLUGINS`` setups,
entry points and imports that name the old single-module path
(``tensordiff.recorders.sglang_plugin:register``). Everything lives in the package now; this
module re-exports exactly the package's ``__all__``, so the two cannot drift."""

from __future__ import annotations

from .sglang import *  # noqa: F403
from .sglang import __all__  # noqa: F401
