"""A user's own port as a model: ``module:pkg.mod:factory``, a callable that returns a
``torch.nn.Module`` (``record train --model module:...`` and ``tensordiff locate``).

The module is called as an HF causal LM is (``model(input_ids=..., use_cache=False)``) and keeps
its decoder layers where :func:`.structure.find_decoder` looks; modules the name table does not
know are named for ``--zoom`` with ``--name-rule``.

The spec's form is checked (:func:`parse_spec`) before anything is imported; torch is imported
only when the module is built.
"""

from __future__ import annotations

import importlib
import re
from typing import Any

from ..errors import UsageError

__all__ = ["PREFIX", "SPEC_FORM", "build", "config_dict", "is_spec", "parse_spec", "snapshot"]

PREFIX = "module:"
SPEC_FORM = "module:pkg.mod:factory"
_IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
_SPEC_RE = re.compile(rf"^module:({_IDENT}(?:\.{_IDENT})*):({_IDENT}(?:\.{_IDENT})*)$")
#: a spec longer than this, or with more dotted parts, is refused before the regular expression
#: runs (importing a module path thousands of packages deep exhausts the import machinery's
#: recursion, and the one error line would quote all of it)
MAX_SPEC_CHARS = 512
MAX_SPEC_PARTS = 64


def is_spec(s: str) -> bool:
    return s.startswith(PREFIX)


def parse_spec(spec: str) -> tuple[str, str]:
    """(module path, attribute path) of ``module:pkg.mod:factory``; a UsageError of one line
    otherwise. Imports nothing."""
    parts = spec.count(".") + spec.count(":")
    if len(spec) > MAX_SPEC_CHARS or parts > MAX_SPEC_PARTS:
        raise UsageError(f"a module: spec of {len(spec)} characters and {spec.count('.') + 1} dotted parts is not "
                         f"{SPEC_FORM} (at most {MAX_SPEC_CHARS} characters, {MAX_SPEC_PARTS} parts)")
    m = _SPEC_RE.match(spec)
    if m is None:
        raise UsageError(f"{spec!r} is not {SPEC_FORM} (a dotted module path, a colon, the name of a callable "
                         "that returns a torch.nn.Module)")
    return m.group(1), m.group(2)


def _factory(spec: str) -> Any:
    mod_name, attr = parse_spec(spec)
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise UsageError(f"{spec}: cannot import {mod_name} ({e}); is it on PYTHONPATH?") from None
    obj: Any = mod
    for part in attr.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise UsageError(f"{spec}: {mod_name} has no {attr}")
    if not callable(obj):
        raise UsageError(f"{spec}: {attr} is not callable")
    return obj


def build(spec: str, dtype: str = "auto", device: str = "auto") -> Any:
    """The module the factory returns, in ``dtype`` on ``device``, in eval mode."""
    import torch

    model = _factory(spec)()
    if not isinstance(model, torch.nn.Module):
        raise UsageError(f"{spec}: the factory returned {type(model).__name__}, not a torch.nn.Module")
    if dtype != "auto":
        model = model.to(getattr(torch, dtype))
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return model.to(device).eval()


def config_dict(model: Any) -> dict[str, Any]:
    """The model's config as a dict (an HF-style ``config`` attribute), else empty."""
    cfg = getattr(model, "config", None)
    to_dict = getattr(cfg, "to_dict", None)
    if callable(to_dict):
        d = to_dict()
        return d if isinstance(d, dict) else {}
    return dict(vars(cfg)) if cfg is not None and hasattr(cfg, "__dict__") else {}


def snapshot(spec: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(weight fingerprint document, config dict) of the module ``spec`` builds, as loaded."""
    from .weights_fp import model_fingerprints

    model = build(spec, "auto", "cpu")
    return model_fingerprints(model, source=spec), config_dict(model)
