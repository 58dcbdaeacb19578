"""The model configuration that changes numerics, as a trace records it (``model.config``,
docs/format.md) and as the diff compares it.

Recorders take it from the model's (HF or engine) config with :func:`from_config`; the diff reads
it back with :func:`read`, which treats it as hostile input: only the keys of :data:`FIELDS`, each
of its type (a bool is no number), finite numbers within bounds, short printable strings; anything
else is dropped, never printed. :func:`differences` lists the keys both sides recorded that
differ, :func:`explains` says whether a difference can be the cause of a first divergence at a
state (a setting every decoder layer uses shows first inside layer 0 or at ``layer1``), and
:func:`sentence` says it (``rope_theta is 500000 on A and 10000 on B``).

Pure Python (no numpy, no torch): the recorders and the diff share it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from .names import maybe_state

__all__ = ["FIELDS", "differences", "explains", "from_config", "read", "sentence"]

#: key -> (type, what it is); every key is optional
FIELDS: dict[str, tuple[type, str]] = {
    "rope_theta": (float, "the rotary's base"),
    "rope_type": (str, "the rotary's scaling type (default, linear, dynamic, yarn, llama3, ...)"),
    "rope_factor": (float, "the rotary's scaling factor"),
    "partial_rotary_factor": (float, "the share of head_dim the rotary turns"),
    "rotary_dim": (int, "the channels of each head the rotary turns"),
    "norm_eps": (float, "the norms' eps"),
    "heads": (int, "attention heads"),
    "kv_heads": (int, "key/value heads"),
    "head_dim": (int, "the size of a head"),
    "activation": (str, "the MLP's activation"),
    "attn_scale": (float, "the attention's softmax scale, where the config sets one"),
    "tie_word_embeddings": (bool, "the lm_head shares the embedding's weights"),
    "dtype": (str, "the dtype the model ran in"),
    "rope_freqs": (list, "the rotary frequencies the built model turns by (its inv_freq), in order"),
    "rope_freqs_dtype": (str, "the dtype the rotary frequencies are held in (their rounding)"),
}
MAX_STR = 64
MAX_INT = 1 << 40
MAX_ABS = 1e300
MAX_FREQS = 4096
#: two correct implementations of theta^(-2j/d) in float32 agree far closer; a theta off by 1e-4 moves them ~1e-4
FREQ_REL = 1e-6
#: frequencies held in a coarser dtype are that dtype's rounding of the true ones: two correct sides
#: differ by at most one unit of its spacing: relative (2^-7 in bfloat16, 2^-10 in float16), and
#: absolute below float16's normal range (its subnormals' spacing 2^-24: a Mixtral's lowest
#: frequency, 5.6e-6, keeps 7 bits there)
_FREQ_SPACING = {"bfloat16": (2.0 ** -7, 0.0), "float16": (2.0 ** -10, 2.0 ** -24)}

#: the taps of a decoder layer each setting acts on first (a boundary after them shows it too)
_TAPS: dict[str, tuple[str, ...]] = {
    "rope_theta": ("q_rope", "k_rope"), "rope_type": ("q_rope", "k_rope"), "rope_factor": ("q_rope", "k_rope"),
    "partial_rotary_factor": ("q_rope", "k_rope"), "rotary_dim": ("q_rope", "k_rope"),
    "norm_eps": ("attn_norm", "mlp_norm"), "heads": ("q", "k", "v", "q_rope", "k_rope", "attn_out"),
    "kv_heads": ("k", "v", "k_rope", "attn_out"), "head_dim": ("q", "k", "v", "q_rope", "k_rope", "attn_out"),
    "activation": ("mlp_act",), "attn_scale": ("attn_out",), "rope_freqs": ("q_rope", "k_rope"),
}


def _clean(key: str, v: Any) -> Any:
    """``v`` as field ``key``'s type, or None (wrong type, not finite, out of bounds, unprintable)."""
    kind = FIELDS[key][0]
    if kind is list:
        if not isinstance(v, (list, tuple)) or not 0 < len(v) <= MAX_FREQS:
            return None
        out = [_clean("rope_theta", x) for x in v]   # each a finite float within bounds
        return None if any(x is None for x in out) else out
    if kind is bool:
        return v if isinstance(v, bool) else None
    if kind is str:
        if not isinstance(v, str) or not v or len(v) > MAX_STR or not v.isprintable():
            return None
        return v
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    if kind is int:
        if isinstance(v, float) and (not math.isfinite(v) or v != int(v)):
            return None
        return int(v) if 0 < abs(int(v)) <= MAX_INT else None
    if isinstance(v, int) and abs(v) > MAX_ABS:   # float() of an int past 1e308 raises
        return None
    f = float(v)
    return f if math.isfinite(f) and abs(f) <= MAX_ABS else None


def read(model: Any) -> dict[str, Any]:
    """The validated config of a trace's ``model`` attribute (``{}`` when absent or not an object)."""
    cfg = model.get("config") if isinstance(model, Mapping) else None
    if not isinstance(cfg, Mapping):
        return {}
    out: dict[str, Any] = {}
    for key in FIELDS:
        if key in cfg:
            v = _clean(key, cfg[key])
            if v is not None:
                out[key] = v
    return out


def _get(cfg: Any, name: str) -> Any:
    if isinstance(cfg, Mapping):
        return cfg.get(name)
    try:
        return getattr(cfg, name, None)
    except Exception:  # noqa: BLE001 - a config property that raises is a setting not recorded
        return None


def from_config(cfg: Any, dtype: str | None = None) -> dict[str, Any]:
    """The numerics-changing settings of a model config (an HF ``PretrainedConfig``, an engine's
    text config or a ``config.json`` dict; its text config when it has one) and the dtype the
    model runs in: only what the config states, each validated as :func:`read` does."""
    text = _get(cfg, "get_text_config")
    if callable(text):
        try:
            cfg = text()
        except Exception:  # noqa: BLE001 - no text config: the config itself
            pass
    rp = _get(cfg, "rope_parameters")
    rs = _get(cfg, "rope_scaling")
    rope = rp if isinstance(rp, Mapping) else rs if isinstance(rs, Mapping) else {}
    heads = _get(cfg, "num_attention_heads")
    hidden = _get(cfg, "hidden_size")
    head_dim = _get(cfg, "head_dim")
    if head_dim is None and isinstance(heads, int) and isinstance(hidden, int) and heads > 0:
        head_dim = hidden // heads
    raw: dict[str, Any] = {
        "rope_theta": rope.get("rope_theta", _get(cfg, "rope_theta")),
        "rope_type": rope.get("rope_type", rope.get("type")),
        "rope_factor": rope.get("factor"),
        "partial_rotary_factor": rope.get("partial_rotary_factor", _get(cfg, "partial_rotary_factor")),
        "rotary_dim": _get(cfg, "rotary_dim") or _get(cfg, "qk_rope_head_dim"),
        "norm_eps": next((v for v in (_get(cfg, "rms_norm_eps"), _get(cfg, "layer_norm_eps"),
                                      _get(cfg, "layer_norm_epsilon")) if v is not None), None),
        "heads": heads,
        "kv_heads": _get(cfg, "num_key_value_heads") or heads,
        "head_dim": head_dim,
        "activation": _get(cfg, "hidden_act") or _get(cfg, "hidden_activation"),
        "attn_scale": _attn_scale(cfg),
        "tie_word_embeddings": _get(cfg, "tie_word_embeddings"),
        "dtype": dtype,
    }
    out: dict[str, Any] = {}
    for key, v in raw.items():
        c = _clean(key, v) if v is not None else None
        if c is not None:
            out[key] = c
    return out


def _attn_scale(cfg: Any) -> float | None:
    """A softmax scale the config sets: ``attention_multiplier`` (Granite) or
    ``query_pre_attn_scalar`` (Gemma 2/3: scores scaled by its inverse square root)."""
    m = _get(cfg, "attention_multiplier")
    if isinstance(m, (int, float)) and not isinstance(m, bool):
        return float(m)
    q = _get(cfg, "query_pre_attn_scalar")
    if isinstance(q, (int, float)) and not isinstance(q, bool) and q > 0:
        return float(q ** -0.5)
    return None


def _freq_tol(a: Mapping[str, Any], b: Mapping[str, Any]) -> tuple[float, float]:
    """(relative, absolute) difference two correct sides' frequencies can show: :data:`FREQ_REL`,
    or one unit of the coarser dtype either side holds them in."""
    units = [_FREQ_SPACING.get(str(c.get("rope_freqs_dtype")), (0.0, 0.0)) for c in (a, b)]
    return max([FREQ_REL] + [u[0] for u in units]), max(u[1] for u in units)


def _freqs_differ(va: list[float], vb: list[float], tol: tuple[float, float]) -> bool:
    return len(va) != len(vb) or any(abs(x - y) > tol[0] * max(abs(x), abs(y)) + tol[1] for x, y in zip(va, vb))


def _freq_worst(va: list[float], vb: list[float]) -> tuple[int, float]:
    """(index, relative difference) of the frequencies' largest relative difference."""
    rel = [abs(x - y) / max(abs(x), abs(y)) if x != y else 0.0 for x, y in zip(va, vb)]
    j = max(range(len(rel)), key=rel.__getitem__)
    return j, rel[j]


def differences(a: Mapping[str, Any], b: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
    """(key, A's value, B's value) for each key both sides recorded that differs, in
    :data:`FIELDS` order; floats differ beyond a relative 1e-9; the rotary frequencies when their
    counts differ or one differs beyond :func:`_freq_tol` (their dtype is how they are compared,
    never a difference of its own)."""
    out = []
    for key in FIELDS:
        if key not in a or key not in b or key == "rope_freqs_dtype":
            continue
        va, vb = a[key], b[key]
        if key == "rope_freqs":
            if not _freqs_differ(va, vb, _freq_tol(a, b)):
                continue
        elif isinstance(va, float) and isinstance(vb, float):
            if abs(va - vb) <= 1e-9 * max(abs(va), abs(vb)):
                continue
        elif va == vb:
            continue
        out.append((key, va, vb))
    # the frequencies follow from the rope settings: where one of those differs it is the cause to
    # name, and the frequencies' own difference says nothing more
    if any(k in _ROPE_SETTINGS for k, _, _ in out):
        out = [d for d in out if d[0] != "rope_freqs"]
    return out


_ROPE_SETTINGS = ("rope_theta", "rope_type", "rope_factor", "partial_rotary_factor", "rotary_dim")


def explains(key: str, state: str) -> bool:
    """Whether a difference of setting ``key`` can be the cause of a first divergence at
    ``state``: every decoder layer uses it, so it shows first in layer 0: at the taps it acts on
    (or a later tap of layer 0) or at boundary ``layer1``. ``tie_word_embeddings`` at the
    embedding; the dtype never (a correct pair may differ in it)."""
    st = maybe_state(state)
    if st is None or key == "dtype":
        return False
    if key == "tie_word_embeddings":
        return st.kind == "boundary" and st.layer == 0
    if key not in _TAPS:
        return False
    if st.kind == "boundary":
        return st.layer == 1
    if st.kind != "tap" or st.layer != 0 or st.tap is None:
        return False
    from .names import TAPS
    first = min(TAPS.index(t) for t in _TAPS[key])
    return TAPS.index(st.tap) >= first


def _say(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return f"{v:.6g}"
    return str(v)


def _say_freqs(va: list[float], vb: list[float]) -> str:
    if len(va) != len(vb):
        return f"the rotary frequencies differ ({len(va)} on A, {len(vb)} on B)"
    j, rel = _freq_worst(va, vb)
    return (f"the rotary frequencies differ (frequency {j} of {len(va)}: {va[j]:.3g} on A, {vb[j]:.3g} on B; "
            f"largest relative difference {rel:.2g})")


def sentence(diffs: list[tuple[str, Any, Any]]) -> str:
    """``rope_theta is 500000 on A and 10000 on B`` (each difference, joined by ``; ``); the
    rotary frequencies by their largest difference, never the whole list."""
    return "; ".join(_say_freqs(va, vb) if k == "rope_freqs" else f"{k} is {_say(va)} on A and {_say(vb)} on B"
                     for k, va, vb in diffs)
