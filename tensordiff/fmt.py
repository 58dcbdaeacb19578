"""Small presentation helpers shared by the text report and the TUI (no rich, no textual): one
number format and one glyph per severity, so both say the same thing the same way."""

from __future__ import annotations

import math

#: severity -> (glyph, rich style); the TUI and the text report both use these
SEVERITY_GLYPH: dict[str, tuple[str, str]] = {"divergence": ("✗", "bold red"), "warning": ("!", "yellow"),
                                              "info": ("·", "blue")}
OK_GLYPH = ("✓", "green")


def number(x: object, nd: int = 4, sci: int = 2) -> str:
    """A metric for a person: ``-`` for None, ``nan``/``inf``, scientific (``sci`` digits) below
    1e-3 and from 1e4 on, else ``nd`` decimals. Anything that is not a number is shown as text."""
    if x is None:
        return "-"
    if isinstance(x, (bool, int, str)) or getattr(getattr(x, "dtype", None), "kind", "f") in "biu":
        return str(x)
    try:
        v = float(x)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return str(x)
    if math.isnan(v):
        return "nan"
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    if v != 0 and (abs(v) >= 1e4 or abs(v) < 1e-3):
        return f"{v:.{sci}e}"
    return f"{v:.{nd}f}"


def one_minus_cos(cos: object) -> str:
    """A cosine as the reports show it, ``1 - cos`` (one convention in every table and sentence:
    a cosine near 1 reads as its distance from 1, which a limit such as 7.6e-06 can be compared
    with); ``-`` for None."""
    if cos is None:
        return "-"
    try:
        v = float(cos)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return str(cos)
    if math.isnan(v):
        return "nan"
    d = max(0.0, 1.0 - v)
    return "0" if d == 0 else number(d)


def percent(x: object, nd: int = 1, missing: str = "-") -> str:
    """A fraction (0..1) as a percentage with ``nd`` decimals; ``missing`` for None."""
    return missing if x is None else f"{100 * float(x):.{nd}f}%"  # type: ignore[arg-type]


#: what a progress count of a diff stage counts (the CLI's bar and the TUI's label)
PROGRESS_UNITS = {"identifying slots": "candidates", "aligning tokens": "steps", "triage steps": "steps"}


def progress_unit(stage: str) -> str:
    return PROGRESS_UNITS.get(stage, "rows")
