"""The shared vocabulary: boundaries, state labels, regimes (see docs/format.md).

boundary b = the residual stream entering decoder layer b; b=0 is the embedding output
(HF ``hidden_states[b]``). The post-final-norm output is its own state, ``final_norm``.
"""

from __future__ import annotations

import re

FINAL_NORM = "final_norm"

# Regimes: which kind of forward computed a row. Stored as uint8 in the token table.
REGIMES = ("train", "prefill", "decode", "target_verify", "draft_extend", "other")
REGIME_CODE = {name: i for i, name in enumerate(REGIMES)}

LAYER_RE = re.compile(r"^layer([0-9]+)$")   # a boundary's name: layer<b>

#: the largest boundary (layer number) a trace, label or name may hold: models have a few hundred
#: layers; a number from a file past this is refused where it is read (the noise model grows its
#: expectation per layer, and a depth of 10^33 would overflow it)
MAX_BOUNDARY = 100_000


def layer_number(digits: str, what: str = "layer") -> int:
    """The layer number written as ``digits`` (ASCII), or ValueError when past :data:`MAX_BOUNDARY`."""
    if len(digits) > len(str(MAX_BOUNDARY)) or int(digits) > MAX_BOUNDARY:
        shown = digits if len(digits) <= 12 else digits[:12] + "..."
        raise ValueError(f"{what} number {shown} is out of range (at most {MAX_BOUNDARY})")
    return int(digits)


def boundary_label(b: int | None) -> str:
    """Display name of boundary ``b``: ``embed`` for 0, ``layer<b>`` otherwise; None is final_norm."""
    if b is None:
        return FINAL_NORM
    if b < 0:
        raise ValueError(f"boundary must be >= 0, got {b}")
    return "embed" if b == 0 else f"layer{b}"


def parse_label(label: str) -> int | None:
    """Inverse of :func:`boundary_label`; returns None for ``final_norm``; raises on anything else."""
    if label == "embed":
        return 0
    if label == FINAL_NORM:
        return None
    m = LAYER_RE.match(label)
    if not m:
        raise ValueError(f"not a state label: {label!r} (expected embed, layer<b> or final_norm)")
    return layer_number(m.group(1), "a state label's layer")


def state_order(label: str, num_layers: int | None = None) -> float:
    """Forward-order key of a state label: boundaries by index, final_norm after all of them."""
    b = parse_label(label)
    if b is None:
        return float(num_layers if num_layers is not None else 10**6) + 0.5
    return float(b)


def regime_code(regime: str | int) -> int:
    if isinstance(regime, int):
        if not 0 <= regime < len(REGIMES):
            raise ValueError(f"unknown regime code {regime}")
        return regime
    try:
        return REGIME_CODE[regime]
    except KeyError:
        raise ValueError(f"unknown regime {regime!r}; one of {', '.join(REGIMES)}") from None
