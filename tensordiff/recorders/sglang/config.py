"""Configuration of the SGLang plugin: the ``TENSORDIFF_*`` environment of the server process,
the names of the tensors it records, and the per-rank trace path.

Standard library only: this module is imported in every SGLang process that loads the plugin.
"""

from __future__ import annotations

import fnmatch
import os
from dataclasses import dataclass, field

ENV_TRACE = "TENSORDIFF_TRACE"
RPC_PREFIX = "tensordiff_"

AUX = "aux_hidden_states"
DRAFT = "draft_input"
DRAFT_IDS = "draft_input_ids"
DRAFT_FC = "draft_fc_output"
DEFAULT_VALUES = (AUX, DRAFT, DRAFT_FC)


@dataclass
class Config:
    path: str
    catalog: bool = False
    values: bool | list[str] = field(default_factory=lambda: list(DEFAULT_VALUES))
    sample_every: int = 1
    sketch_dim: int | None = None
    sketch_seed: int | None = None
    flush_seconds: float = 10.0
    compression: str | None = None
    topk: int = 20
    profile: str | None = None  # TENSORDIFF_PROFILE: a cProfile stats file of the plugin's own code
    stage_mb: float = 64.0      # TENSORDIFF_STAGE_MB: CPU work staged and done in batches up to this (0: off)
    routing: bool = True        # TENSORDIFF_ROUTING: MoE routers' top-k expert ids and weights (MoE models only)
    zoom: int | None = None     # TENSORDIFF_ZOOM=layer<b>: that decoder layer's sub-layer taps (.zoom)
    graft: str | None = None    # TENSORDIFF_GRAFT=OTHER.h5:STATE: STATE replaced by OTHER's values (.graft)
    _wants: dict = field(default_factory=dict, repr=False, compare=False)  # wants_values by name

    @property
    def stage_bytes(self) -> int:
        return int(self.stage_mb * (1 << 20))

    @classmethod
    def from_env(cls, env: dict | None = None) -> Config | None:
        """The configuration, or None when ``TENSORDIFF_TRACE`` is unset (the plugin is inert).
        Raises ValueError on a malformed variable."""
        env = os.environ if env is None else env
        path = (env.get(ENV_TRACE) or "").strip()
        if not path:
            return None

        def flag(name: str, default: bool) -> bool:
            v = (env.get(name) or "").strip().lower()
            if not v:
                return default
            if v in ("1", "true", "yes", "on"):
                return True
            if v in ("0", "false", "no", "off"):
                return False
            raise ValueError(f"{name}={v!r}: expected 1 or 0")

        def num(name: str, typ, default):
            v = (env.get(name) or "").strip()
            if not v:
                return default
            try:
                return typ(v)
            except ValueError:
                raise ValueError(f"{name}={v!r}: expected a number") from None

        vals_txt = (env.get("TENSORDIFF_VALUES") or "").strip()
        if not vals_txt:
            values: bool | list[str] = list(DEFAULT_VALUES)
        elif vals_txt.lower() == "all":
            values = True
        elif vals_txt.lower() == "none":
            values = False
        else:
            values = [v.strip() for v in vals_txt.split(",") if v.strip()]
        every = num("TENSORDIFF_SAMPLE_EVERY", int, 1)
        if every < 1:
            raise ValueError("TENSORDIFF_SAMPLE_EVERY must be >= 1")
        comp = (env.get("TENSORDIFF_COMPRESSION") or "").strip() or None
        if comp not in (None, "gzip", "lzf"):
            raise ValueError(f"TENSORDIFF_COMPRESSION={comp!r}: expected gzip or lzf")
        flush_s = num("TENSORDIFF_FLUSH_SECONDS", float, 10.0)
        if not flush_s > 0:
            raise ValueError("TENSORDIFF_FLUSH_SECONDS must be > 0")
        topk = num("TENSORDIFF_TOPK", int, 20)
        if topk < 0:
            raise ValueError("TENSORDIFF_TOPK must be >= 0")
        stage_mb = num("TENSORDIFF_STAGE_MB", float, 64.0)
        if not 0 <= stage_mb <= 1 << 20:
            raise ValueError("TENSORDIFF_STAGE_MB must be between 0 and 1048576")
        return cls(path=path, topk=topk, catalog=flag("TENSORDIFF_CATALOG", False), values=values, sample_every=every,
                   sketch_dim=num("TENSORDIFF_SKETCH_DIM", int, None),
                   sketch_seed=num("TENSORDIFF_SKETCH_SEED", int, None), flush_seconds=flush_s,
                   compression=comp, profile=(env.get("TENSORDIFF_PROFILE") or "").strip() or None,
                   stage_mb=stage_mb, routing=flag("TENSORDIFF_ROUTING", True), zoom=_zoom(env),
                   graft=(env.get("TENSORDIFF_GRAFT") or "").strip() or None)

    def wants_values(self, name: str) -> bool:
        if isinstance(self.values, bool):
            return self.values
        got = self._wants.get(name)
        if got is None:  # once per name: the hooks ask on every pass
            got = self._wants[name] = any(fnmatch.fnmatchcase(name, p) for p in self.values)
        return got


def rank_path(path: str, suffix: str) -> str:
    """``serve.h5`` + ``.tp1`` -> ``serve.tp1.h5`` (the suffix goes before the extension)."""
    if not suffix:
        return path
    root, ext = os.path.splitext(path)
    if ext.lower() not in (".h5", ".hdf5"):
        return path + suffix
    return root + suffix + ext


def _zoom(env) -> int | None:
    """``TENSORDIFF_ZOOM=layer3`` (or ``3``): the decoder layer whose taps to record."""
    v = (env.get("TENSORDIFF_ZOOM") or "").strip()
    if not v:
        return None
    from ...names import parse_zoom

    try:
        return parse_zoom(v)
    except ValueError as e:
        from ...safety import quoted

        raise ValueError(f"TENSORDIFF_ZOOM={quoted(v)}: {e}") from None
