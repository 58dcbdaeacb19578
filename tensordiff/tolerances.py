"""Tolerances: what a token must meet to pass, where they come from (dtype defaults, ``--tol``
overrides, a calibration file) and how ``tensordiff calibrate`` derives them from a noise floor.

numpy-free. Rules by pattern (glob/regex) belong here too, as another source in
:class:`ToleranceBook`.
"""

from __future__ import annotations

import functools
import math
import os
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from .dtypes import EPS
from .errors import IncompatibleTracesError, SourceFileError, UsageError
from .findings import DiffResult, Finding, Severity
from .safety import parse_json, read_regular_file_bounded

#: the diff's noise model as a tolerance: (depth, dtype_a, dtype_b) -> what a token must meet there
NoiseTolerance = Callable[[float | None, str, str], "Tolerance"]

#: version of the calibration file written by ``tensordiff calibrate``
CALIBRATION_VERSION = 1


@dataclass(frozen=True)
class Tolerance:
    """A token passes when cos >= min_cos and rel <= max_rel (and it has no NaN/Inf that the
    reference lacks). ``rel`` = ||a - b|| / ||a||, cos = <a, b> / (||a|| ||b||)."""

    min_cos: float
    max_rel: float
    source: str = "default"
    #: the patterns of the ``--tol`` rules that matched the tensor or slot, the first the one that
    #: set it (a rule an earlier one shadows still matched: not a typo); not part of the JSON
    rules: tuple[str, ...] = field(default=(), compare=False)

    def to_dict(self) -> dict[str, Any]:
        return {"min_cos": self.min_cos, "max_rel": self.max_rel, "source": self.source}


# Defaults per the coarser dtype of the two sides, at depth 0: (1 - min_cos, max_rel). Honest
# rounding and kernel differences grow with depth (each layer adds its own and carries the earlier
# ones): both allowances grow with (1 + depth), up to a cap per dtype; when both sides round to the
# same low precision independently, by 1.5. Measured (bf16 vs fp32, worst token of 432): a
# random-weight 8-layer Llama reaches 1 - cos 0.042 and rel 0.29 at layer 8 (its errors grow
# fastest), a near-residual 61-layer one 4e-4 and 0.03 at layer 60; the defaults allow about twice
# the former. Wiring bugs are caught by the identity search, not by these bounds (consecutive
# states of a deep model differ by less); ``calibrate`` tightens them to a measured noise floor.
_BASE = {
    "float64": (1e-9, 1e-6),
    "float32": (1e-6, 2e-3),
    "float16": (0.004, 0.03),
    "bfloat16": (0.0095, 0.065),
}
_CAP = {"float64": (1e-7, 1e-4), "float32": (1e-4, 0.05), "float16": (0.05, 0.4), "bfloat16": (0.1, 0.6)}
_LOW_PRECISION = ("float16", "bfloat16")
#: calibration never sets a tolerance looser than this many times the default (it warns instead)
CALIBRATION_MAX_LOOSENING = 10.0


def coarser(a: str, b: str) -> str:
    """The dtype of the two with the larger rounding error."""
    return a if EPS.get(a, 0) >= EPS.get(b, 0) else b


def default_tolerance(dtype_a: str, dtype_b: str, depth: float | None = None) -> Tolerance:
    """The default for a dtype pair at a depth (boundary index; None: depth 0)."""
    d = coarser(dtype_a, dtype_b)
    one_minus, rel = _BASE.get(d, _BASE["float32"])
    cap_om, cap_rel = _CAP.get(d, _CAP["float32"])
    g = 1.0 + max(0.0, float(depth or 0))
    if dtype_a == dtype_b and d in _LOW_PRECISION:
        g *= 1.5
    om = float(f"{min(one_minus * g, cap_om):.3g}")   # 3 significant digits: readable
    r = float(f"{min(rel * g, cap_rel):.3g}")
    return Tolerance(max(-1.0, 1 - om), r)


def _valid(c: float, r: float) -> bool:
    return math.isfinite(c) and -1 <= c <= 1 and math.isfinite(r) and r >= 0


@dataclass
class ToleranceBook:
    """Default per-dtype tolerances, overridden per tensor (``--tol NAME=min_cos,max_rel``) or by a
    calibration file measured on a noise-floor pair (``tensordiff calibrate``). Lookup order:
    overrides, then calibration; in each ``name[slot]``, ``name``, ``*``; then the dtype default."""

    overrides: dict[str, Tolerance] = field(default_factory=dict)
    calibrated: dict[str, Tolerance] = field(default_factory=dict)
    rules: list[ToleranceRule] = field(default_factory=list)   # --tol / TOML rules: first match wins
    allow_failed: list[str] = field(default_factory=list)      # --allow-failed patterns

    def for_tensor(self, name: str, dtype_a: str, dtype_b: str, slot: int | None = None,
                   depth: float | None = None, noise: NoiseTolerance | None = None) -> Tolerance:
        """The tolerance of a tensor (or slot): the first rule that matches it (named on it, with
        every other that matches), else an override or calibration entry, else ``noise`` (the
        diff's noise model, :func:`tensordiff.noise_io.tolerance_fn`) where given, else the
        dtype default. Reads the book, never writes it."""
        key = f"{name}[{slot}]" if slot is not None else name
        hits = [r for r in self.rules if r.matches(name, key)]
        if hits:
            return replace(hits[0].tolerance, rules=tuple(r.pattern for r in hits))
        for book in (self.overrides, self.calibrated):
            for k in (key, name, "*"):
                if k in book:
                    return book[k]
        if noise is not None:
            return noise(depth, dtype_a, dtype_b)
        return default_tolerance(dtype_a, dtype_b, depth)

    @staticmethod
    def parse_override(text: str) -> tuple[str, Tolerance]:
        try:
            name, vals = text.split("=", 1)
            c, r = (float(x) for x in vals.split(","))
        except ValueError:
            raise UsageError(f"--tol {text!r}: expected NAME=MIN_COS,MAX_REL (NAME may be '*' or name[slot])") from None
        if not _valid(c, r):
            raise UsageError(f"--tol {text!r}: MIN_COS must be in [-1, 1] and MAX_REL >= 0")
        return name, Tolerance(c, r, "override")

    def add_rule(self, pattern: str, tol: Tolerance) -> None:
        """A rule after the others (the first rule that matches a tensor or slot wins)."""
        self.rules.append(ToleranceRule(pattern, tol))

    def load_rules(self, path: str) -> None:
        """Rules (and ``allow_failed`` patterns) from a TOML file, in file order::

            allow_failed = ["final_norm"]
            [[rule]]
            match = "layer*"          # a glob (* and ?; [ is literal: draft_input[0]) or re:REGEX
            min_cos = 0.99
            max_rel = 0.05
        """
        try:
            import tomllib
        except ImportError:  # Python 3.10
            try:
                import tomli as tomllib  # type: ignore[no-redef]
            except ImportError:
                raise UsageError(f"--tol {path}: reading TOML needs Python 3.11+ or the tomli package") from None
        raw = read_regular_file_bounded(path, CALIBRATION_MAX_BYTES, "tolerance rules")  # no FIFO, no /dev/zero
        try:
            data = tomllib.loads(raw.decode("utf-8"))
        except (OSError, ValueError) as e:
            raise SourceFileError(f"cannot read tolerance rules ({type(e).__name__}: {e})", path) from None
        unknown = sorted(set(data) - {"rule", "allow_failed"})
        rules, allow = data.get("rule", []), data.get("allow_failed", [])
        if unknown or not isinstance(rules, list) or not isinstance(allow, list):
            raise SourceFileError("tolerance rules: expected [[rule]] tables (match, min_cos, max_rel) and an "
                                  f"allow_failed list{f'; unknown keys {unknown}' if unknown else ''}", path)
        for i, r in enumerate(rules):
            try:
                pat, c, rel = str(r["match"]), float(r["min_cos"]), float(r["max_rel"])
            except (KeyError, TypeError, ValueError):
                raise SourceFileError(f"tolerance rule {i + 1}: needs match (a string), min_cos and max_rel "
                                      "(numbers)", path) from None
            if not _valid(c, rel) or set(r) - {"match", "min_cos", "max_rel"}:
                raise SourceFileError(f"tolerance rule {i + 1} ({pat!r}): min_cos must be in [-1, 1] and max_rel "
                                      ">= 0; keys are match, min_cos, max_rel", path)
            pattern_matcher(pat)   # a bad regex is an error now, not at the first tensor
            self.add_rule(pat, Tolerance(c, rel, f"rule:{os.path.basename(path)}"))
        self.allow_failed += [str(a) for a in allow]

    def check_rules_used(self, tolerances: Iterable[Tolerance], compared: list[str]) -> None:
        """A rule that matched no compared tensor is an error (a typo must not pass silently).
        ``tolerances``: those of every compared tensor and slot (each names the rules that matched it)."""
        used = {p for t in tolerances for p in t.rules}
        unused = [r.pattern for r in self.rules if r.pattern not in used]
        if unused:
            raise UsageError(f"--tol rule {unused[0]!r} matches no compared tensor or slot (compared: "
                             f"{', '.join(compared) or 'none'})")

    def load_calibration(self, path: str) -> None:
        """Read a calibration file, validated like ``--tol``: a regular file of bounded size (a FIFO
        or /dev/zero is one line, exit 2), a known schema version, every tolerance finite and in range."""
        raw = read_regular_file_bounded(path, CALIBRATION_MAX_BYTES, "calibration file")
        data = parse_json(raw, "the calibration file", path)
        entries = calibration_entries(data, path)  # first: an object with 'tolerances' at all
        version = data.get("schema_version", CALIBRATION_VERSION)
        if not isinstance(version, int) or isinstance(version, bool) or version > CALIBRATION_VERSION:
            raise SourceFileError(f"calibration file schema_version {repr(version)[:40]}: this tensordiff reads "
                                  f"{CALIBRATION_VERSION}", path)
        for k, v in entries.items():
            self.calibrated[k] = Tolerance(v[0], v[1], f"calibrated:{os.path.basename(path)}")


@dataclass(frozen=True)
class ToleranceRule:
    """``--tol PATTERN=MIN_COS,MAX_REL``: PATTERN is matched against a tensor's name and against
    ``name[slot]`` (see :func:`pattern_matcher`)."""

    pattern: str
    tolerance: Tolerance

    def matches(self, name: str, key: str) -> bool:
        m = pattern_matcher(self.pattern)
        return m(name) or m(key)


@functools.lru_cache(maxsize=256)
def pattern_matcher(pattern: str) -> Callable[[str], bool]:
    """A whole-name matcher: ``re:REGEX`` is a regular expression; anything else a glob where
    ``*`` and ``?`` are the wildcards and ``[`` is literal (``draft_input[0]`` names slot 0)."""
    if pattern.startswith("re:"):
        try:
            rx = re.compile(pattern[3:])
        except re.error as e:
            raise UsageError(f"pattern {pattern!r}: {e}") from None
    else:
        rx = re.compile("".join(".*" if c == "*" else "." if c == "?" else re.escape(c) for c in pattern))
    return lambda name: rx.fullmatch(name) is not None


def allow_failed(findings: Sequence[Finding], pairs: Sequence[Any], patterns: Sequence[str]) -> list[Finding]:
    """``--allow-failed PATTERN``: divergences on a matching tensor (its name on either side, or
    ``name[slot]``) become warnings that say so; a pattern that matches no compared tensor is an
    error. Returns the findings, the allowed ones new (none given is changed)."""
    if not patterns:
        return list(findings)
    names: list[str] = []
    for p in pairs:
        names += [p.name_a, p.name_b] + ([f"{p.name_a}[{s}]" for s in range(p.slots)] if p.slots > 1 else [])
    for pat in patterns:
        if not any(pattern_matcher(pat)(n) for n in names):
            raise UsageError(f"--allow-failed {pat!r} matches no compared tensor or slot (compared: "
                             f"{', '.join(dict.fromkeys(names)) or 'none'})")
    out = []
    for f in findings:
        hit: str | None = None
        if f.severity == Severity.DIVERGENCE and f.tensor is not None:
            keys = [f.tensor] + ([f"{f.tensor}[{f.slot}]"] if f.slot is not None else [])
            hit = next((p for p in patterns if any(pattern_matcher(p)(k) for k in keys)), None)
        out.append(f if hit is None else replace(f, allowed_by=hit, severity=Severity.WARNING))
    return out


def calibrated_tolerance(worst_cos: float, worst_rel: float, dtype: str, margin: float = 4.0) -> Tolerance:
    """Tolerance from a noise floor: allow ``margin`` times the observed error, never tighter
    than the dtype's rounding (no clamp: see :func:`calibrate_tolerance`)."""
    eps = EPS.get(dtype, EPS["float32"])
    rel = max(worst_rel * margin, 8 * eps)
    one_minus = max((1 - worst_cos) * margin * margin, eps * eps)
    return Tolerance(max(-1.0, 1 - one_minus), rel, "calibrated")


CALIBRATION_MAX_BYTES = 16 << 20


def calibration_entries(data: Any, path: str) -> dict[str, tuple[float, float]]:
    """The (min_cos, max_rel) per tensor key of a parsed calibration file, each entry checked."""
    if not isinstance(data, dict):
        raise SourceFileError(f"not a calibration file: a JSON {type(data).__name__}, expected an object "
                              "with 'tolerances'", path)
    tols = data.get("tolerances")
    if not isinstance(tols, dict):
        what = "missing" if tols is None else f"a JSON {type(tols).__name__}"
        raise SourceFileError(f"not a calibration file: 'tolerances' is {what}, expected an object of "
                              "NAME: {min_cos, max_rel}", path)
    out: dict[str, tuple[float, float]] = {}
    for k, v in tols.items():
        if not isinstance(v, dict):
            raise SourceFileError(f"calibration entry {str(k)[:80]!r} is a JSON {type(v).__name__}, expected "
                                  "{min_cos, max_rel}", path)
        vals = []
        for key in ("min_cos", "max_rel"):
            x = v.get(key)
            if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
                shown = f"{key} {x}" if isinstance(x, float) else f"{key} is {repr(x)[:40]}"
                raise SourceFileError(f"calibration entry {str(k)[:80]!r}: {shown}, expected a finite number", path)
            vals.append(float(x))
        if not (-1 <= vals[0] <= 1) or vals[1] < 0:
            raise SourceFileError(f"calibration entry {str(k)[:80]!r}: min_cos {vals[0]}, max_rel {vals[1]}; min_cos "
                                  "must be in [-1, 1] and max_rel >= 0", path)
        out[str(k)] = (vals[0], vals[1])
    return out


def calibrate_tolerance(name: str, worst_cos: float, worst_rel: float, dtype_a: str, dtype_b: str,
                        depth: float | None, margin: float = 4.0) -> tuple[Tolerance, str | None]:
    """:func:`calibrated_tolerance`, clamped to at most :data:`CALIBRATION_MAX_LOOSENING` times
    the default's allowance; returns the tolerance and a warning when the observed noise was not
    finite or was clamped (a "noise pair" that far apart is likely not the same wiring)."""
    default = default_tolerance(dtype_a, dtype_b, depth)
    if not (math.isfinite(worst_cos) and math.isfinite(worst_rel)):
        msg = (f"{name}: no finite noise measured (NaN/Inf in the data); kept the default "
               f"cos >= {default.min_cos:.6g}, rel <= {default.max_rel:.3g}")
        return Tolerance(default.min_cos, default.max_rel, "calibrated (default: no finite noise measured)"), msg
    t = calibrated_tolerance(worst_cos, worst_rel, coarser(dtype_a, dtype_b), margin)
    lim_one_minus = (1 - default.min_cos) * CALIBRATION_MAX_LOOSENING
    lim_rel = default.max_rel * CALIBRATION_MAX_LOOSENING
    if 1 - t.min_cos <= lim_one_minus and t.max_rel <= lim_rel:
        return t, None
    c = max(t.min_cos, 1 - lim_one_minus)
    r = min(t.max_rel, lim_rel)
    msg = (f"{name}: the observed noise (worst cos {worst_cos:.4g}, rel {worst_rel:.3g}) is more than "
           f"{CALIBRATION_MAX_LOOSENING:g}x what the defaults allow for {coarser(dtype_a, dtype_b)} at depth "
           f"{depth if depth is not None else 0:g} (cos >= {default.min_cos:.6g}, rel <= {default.max_rel:.3g}); "
           f"clamped to cos >= {c:.6g}, rel <= {r:.3g}. Are these two traces of the same wiring?")
    return Tolerance(c, r, "calibrated (clamped)"), msg


def calibration_file(a: str, b: str, margin: float, tolerances: dict[str, Tolerance],
                     warnings: list[str] | None = None) -> dict[str, Any]:
    """The JSON object ``tensordiff calibrate`` writes (read back by :meth:`ToleranceBook.load_calibration`)."""
    return {"schema_version": CALIBRATION_VERSION, "a": a, "b": b, "margin": margin,
            "tolerances": {k: t.to_dict() for k, t in tolerances.items()}, "warnings": list(warnings or [])}


#: a rule as ``tolerance_book`` takes it: ``PATTERN=MIN_COS,MAX_REL``, a TOML file of rules, or
#: ``(pattern, (min_cos, max_rel))``
Rule = str | tuple[str, Sequence[float]]


def tolerance_book(rules: Iterable[Rule] = (), *, allow_failed: Iterable[str] = (),
                   calibration: str | os.PathLike[str] | None = None) -> ToleranceBook:
    """The book of ``tensordiff diff --tol ... --allow-failed ... --calibration F`` and of
    ``assert_traces_agree``: the rules in the order given (the first that matches a tensor wins),
    the patterns whose failures are allowed, then the calibration file."""
    book = ToleranceBook()
    for it in rules:
        if isinstance(it, str) and "=" not in it and it.endswith(".toml"):
            book.load_rules(it)
        elif isinstance(it, str):
            book.add_rule(*ToleranceBook.parse_override(it))
        else:
            name, (c, r) = it
            book.add_rule(*ToleranceBook.parse_override(f"{name}={float(c)},{float(r)}"))
    book.allow_failed += list(allow_failed)
    if calibration:
        book.load_calibration(os.fspath(calibration))
    return book


def measuring_book() -> ToleranceBook:
    """The book of a calibration run: every tensor passes, so the diff reports every pair's worst
    cosine and relative error instead of stopping at a tolerance."""
    return ToleranceBook(overrides={"*": Tolerance(-1.0, math.inf, "calibration")})


#: findings that say two traces are not two runs of the same wiring (no noise floor to measure)
_NOT_A_NOISE_PAIR = ("slot_identity", "token_shift", "pairing", "token_mismatch", "replica")


def calibrate(res: DiffResult, margin: float) -> tuple[dict[str, Tolerance], list[str]]:
    """The tolerances ``tensordiff calibrate`` writes from a diff under :func:`measuring_book`:
    one per compared tensor (per slot of a packed one), ``margin`` times its noise floor, and the
    warnings to print. A pair that is not the same wiring, or that compares nothing, is refused."""
    ids = [f for f in res.findings if f.kind in _NOT_A_NOISE_PAIR and f.severity == "divergence"]
    if ids:
        raise IncompatibleTracesError(f"not a noise-floor pair: {ids[0].message}; calibrate on two runs of the same wiring")
    tols: dict[str, Tolerance] = {}
    warnings: list[str] = []
    identical: list[str] = []
    compared = [p for p in res.pairs if p.compared]
    # a pair that is equal bit for bit measures no noise: its tolerances would be essentially zero
    # and fail every later diff of honest runs
    if compared and all(r == 0.0 for p in compared for r in p.rel_max[:p.slots]):
        raise IncompatibleTracesError(
            f"no noise measured: the two traces are identical in all {len(compared)} compared tensors; calibrate on "
            "two honest runs of the same wiring (another batch, kernel, engine or dtype), not on copies of one run")
    for p in res.pairs:
        if not p.compared:
            warnings.append(f"{p.label}: not compared ({p.not_compared}); no tolerance written")
            continue
        for s in range(p.slots):
            key = f"{p.name_a}[{s}]" if p.slots > 1 else p.name_a
            if p.rel_max[s] == 0.0:
                identical.append(key)
                continue
            tols[key], warn = calibrate_tolerance(key, p.cos_min[s], p.rel_max[s], p.dtype_a, p.dtype_b,
                                                  p.depth[s], margin)
            if warn:
                warnings.append(warn)
    if identical:
        warnings.append(f"no noise measured on {len(identical)} tensors, identical on both sides "
                        f"({', '.join(identical[:4])}{', ...' if len(identical) > 4 else ''}); no tolerance written "
                        "for them (the defaults apply)")
    if not tols:
        raise IncompatibleTracesError("nothing to calibrate on: no tensor was compared on both sides "
                                      f"({'; '.join(warnings[:3])})")
    return tols, warnings
