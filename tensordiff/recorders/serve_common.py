"""What ``tensordiff record serve`` does the same way for either engine (serve_cli for SGLang,
vllm_serve for vLLM): ``--engine-arg`` parsing, the engine's plugin list, the environment its
processes inherit, and ``--outputs``. Standard library only."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from typing import Any

from ..errors import UsageError
from ..safety import parse_json

PLUGIN_NAME = "tensordiff"


def _parse_engine_args(items: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise UsageError(f"--engine-arg {item!r}: expected KEY=VALUE")
        k, v = item.split("=", 1)
        k = k.strip().replace("-", "_")
        if not k.isidentifier():
            raise UsageError(f"--engine-arg {item!r}: {k!r} is not an argument name")
        try:
            out[k] = parse_json(v, f"--engine-arg {k}", error=UsageError)
        except UsageError:
            out[k] = v   # not JSON (or nested past the bound): the text as it is
    return out


def add_plugin(env: dict[str, str], var: str) -> None:
    """Where ``var`` (``SGLANG_PLUGINS``, ``VLLM_PLUGINS``) restricts the engine's plugins and leaves
    tensordiff out, ``env`` gets the list with tensordiff added (unset: every plugin loads)."""
    plugins = os.environ.get(var, "").strip()
    if plugins and PLUGIN_NAME not in [x.strip() for x in plugins.split(",")]:
        env[var] = plugins + "," + PLUGIN_NAME


@contextlib.contextmanager
def engine_environ(env: dict[str, str]) -> Iterator[None]:
    """``os.environ`` with ``env`` set while the engine runs (its processes inherit the environment
    at spawn), each variable restored (or removed) afterwards."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def write_outputs(path: str | None, outputs: list[dict]) -> None:
    """``--outputs``: one JSON object per request and line (nothing when not asked for)."""
    if path:
        with open(path, "w", encoding="utf-8") as f:
            for o in outputs:
                f.write(json.dumps(o) + "\n")
