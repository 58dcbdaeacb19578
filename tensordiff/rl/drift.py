"""Drift over training steps: ``tensordiff drift DIR`` triages each step's trainer trace against
its rollout and says when the mismatch left the noise, with what cause, and how it grew.

A run whose mismatch grows over training (0.011 -> 0.036 mean |logprob diff| over 30 steps on one
stack, flat on another) shows it only step over step: each step's pair is triaged
(:func:`tensordiff.rl.triage.triage`, which the caller hands in: the triage sits above this module),
and the steps are read together:

- the frameworks' metrics per step (the sampled tokens' mean / median |logprob diff|,
  ``token_mult_prob_error``, ``kl_k3``, verl's ``rollout_probs_diff_mean``) and the noise each
  step's triage expects of an honest pair;
- the first step whose triage names a cause (out of the noise: its states or its log-probs);
- the cause that appears with the growth: the cause of that first step, or, where every step
  differs from the first one on, the first step whose cause changes and whose mismatch rises with
  it; the causes of the steps after it, where they change again;
- the shape of the growth: a **jump** (the first step out already carries at least half of the
  largest excess over the steps in the noise) or a **steady** rise (it keeps rising over the steps
  after), or one that rises and falls.

Layouts of DIR (:func:`discover`): per-step pairs (``step_<k>/train.h5`` + ``step_<k>/rollout.h5``,
or ``train_<k>.h5`` + ``rollout_<k>.h5``), or one engine trace over many weight updates
(``rollout.h5``, its ``/weights/step_<k>`` records) with one trainer trace per step
(``train_<k>.h5``): each trainer trace is triaged against the engine trace's sequences it ran, under
the engine weight step in force for them. A pair's roles come from the traces' ``side`` attribute,
as in ``triage``: a file named ``train`` that holds the rollout is taken as the rollout.

Exit codes: 0 every step within the noise, 1 a step out of the noise (a cause named), 2 bad input.
Pure: numpy and h5py through the triage, no torch.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import UsageError
from ..progress import Progress, Stage
from .logprobs import LEVEL

__all__ = ["Drift", "StepPair", "StepRow", "discover", "drift", "read_steps", "sparkline", "METRICS"]

#: the metrics of each step, in the table's order (the frameworks' names, tensordiff.rl.logprobs)
METRICS = ("mean_abs_logprob_diff", "median_abs_logprob_diff", "token_mult_prob_error", "kl_k3",
           "rollout_probs_diff_mean", "max_abs_logprob_diff")

#: the first step out of the noise is a jump when it carries at least this share of the largest
#: excess over the steps in the noise; a rise is steady when at least this share of the
#: step-to-step changes after it go up
JUMP_SHARE, STEADY_SHARE = 0.5, 2 / 3
#: where every step differs, a later step's mismatch has grown when it is over this multiple of the
#: first step's and the excess is over LEVEL x the noise the triage expects
GROW = 1.5

TRACE_EXT = (".h5", ".hdf5")
_STEP_DIR = re.compile(r"step[_.-]?([0-9]{1,9})")
_FLAT = re.compile(r"(train|rollout)[_.-]([0-9]{1,9})")
_NAMES = ("train", "rollout")
LAYOUT_HELP = ("step_<k>/train.h5 + step_<k>/rollout.h5, train_<k>.h5 + rollout_<k>.h5, or one rollout.h5 "
               "(the engine over every weight update) + train_<k>.h5")


@dataclass(frozen=True)
class StepPair:
    """One training step's trainer trace and rollout trace (the rollout may be one engine trace
    shared by every step)."""

    step: int
    train: str
    rollout: str


def _stem(name: str) -> str | None:
    low = name.lower()
    ext = next((e for e in TRACE_EXT if low.endswith(e)), None)
    return name[: -len(ext)] if ext else None


def discover(path: str) -> tuple[str, list[StepPair]]:
    """The layout of ``path`` (``"pairs"`` or ``"engine"``) and its steps in order. Bad input (no
    such directory, no step, half a pair, a trace name of no layout, two layouts at once, a step
    given twice, a gap in the step numbers, a single step) is a :class:`UsageError` naming it."""
    if not os.path.isdir(path):
        raise UsageError("not a directory (drift reads a directory of per-step traces: "
                         f"{LAYOUT_HELP})", path)
    names = sorted(os.listdir(path))
    dirs: dict[int, str] = {}
    flat: dict[str, dict[int, str]] = {"train": {}, "rollout": {}}
    engine: str | None = None
    for n in names:
        full = os.path.join(path, n)
        if os.path.isdir(full):
            m = _STEP_DIR.fullmatch(n)
            if m is not None:
                _once(dirs, int(m.group(1)), full, "step directory")
            continue
        stem = _stem(n)
        if stem is None or not os.path.isfile(full):
            continue      # notes, logs, configs beside the traces
        m = _FLAT.fullmatch(stem)
        if m is not None:
            _once(flat[m.group(1)], int(m.group(2)), full, f"{m.group(1)} trace")
        elif stem in ("rollout", "engine"):
            if engine is not None:
                raise UsageError(f"two engine traces ({os.path.basename(engine)} and {n}); give one", path)
            engine = full
        else:
            raise UsageError(f"{n} is a trace of no step (expected {LAYOUT_HELP})", path)
    kinds = [k for k, there in (("step directories", dirs), ("train_<k>/rollout_<k> files", flat["rollout"]),
                                ("one engine trace", engine)) if there]
    if len(kinds) > 1:
        raise UsageError(f"two layouts at once ({' and '.join(kinds)}); give one", path)
    if dirs:
        if flat["train"]:
            raise UsageError("step directories and train_<k> files at once; give one layout", path)
        pairs = [StepPair(k, *_dir_pair(d)) for k, d in sorted(dirs.items())]
        layout = "pairs"
    elif engine is not None:
        if not flat["train"]:
            raise UsageError(f"{os.path.basename(engine)} but no trainer trace train_<k>.h5 beside it", path)
        pairs = [StepPair(k, t, engine) for k, t in sorted(flat["train"].items())]
        layout = "engine"
    elif flat["train"] or flat["rollout"]:
        t, r = flat["train"], flat["rollout"]
        for k in sorted(set(t) ^ set(r)):
            have, miss = ("train", "rollout") if k in t else ("rollout", "train")
            raise UsageError(f"step {k} is half a pair: {os.path.basename((t if k in t else r)[k])} has no "
                             f"{miss}_{k} beside it (a {have} trace needs its {miss} trace)", path)
        pairs = [StepPair(k, t[k], r[k]) for k in sorted(t)]
        layout = "pairs"
    else:
        raise UsageError(f"no step traces here (expected {LAYOUT_HELP})", path)
    _contiguous([p.step for p in pairs], path)
    return layout, pairs


def _once(d: dict[int, str], k: int, full: str, what: str) -> None:
    if k in d:
        raise UsageError(f"step {k} given twice ({what}s {os.path.basename(d[k])} and {os.path.basename(full)})",
                         os.path.dirname(full))
    d[k] = full


def _dir_pair(d: str) -> tuple[str, str]:
    found: dict[str, str] = {}
    for n in sorted(os.listdir(d)):
        stem = _stem(n)
        if stem in _NAMES and os.path.isfile(os.path.join(d, n)):
            if stem in found:
                raise UsageError(f"two {stem} traces ({os.path.basename(found[stem])} and {n})", d)
            found[stem] = os.path.join(d, n)
    miss = [x for x in _NAMES if x not in found]
    if miss:
        raise UsageError(f"half a pair: no {miss[0]}.h5 (a step directory holds train.h5 and rollout.h5)"
                         if len(miss) == 1 else "no train.h5 and rollout.h5 in this step directory", d)
    return found["train"], found["rollout"]


def _contiguous(steps: list[int], path: str) -> None:
    if len(steps) < 2:
        raise UsageError(f"one step only (step {steps[0]}): a drift needs two or more; "
                         "`tensordiff triage TRAIN ROLLOUT` triages one pair", path)
    missing = [k for k in range(steps[0], steps[-1] + 1) if k not in set(steps)]
    if missing:
        shown = ", ".join(map(str, missing[:8])) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise UsageError(f"the step numbers have a gap: steps {steps[0]}-{steps[-1]} lack {shown}", path)


def check_engine_layout(pairs: list[StepPair]) -> None:
    """One engine trace: each trainer trace must have run sequences the engine trace holds (else
    its triage would compare nothing)."""
    from ..trace import TraceReader

    with TraceReader(pairs[0].rollout) as e:
        have = set(e.sequences)
    for p in pairs:
        with TraceReader(p.train) as t:
            if not have & set(t.sequences):
                raise UsageError(f"shares no sequence with {os.path.basename(p.rollout)} (step {p.step}'s "
                                 "trainer must run sequences the engine served)", p.train)


# ----------------------------------------------------------------------------------------------


@dataclass
class StepRow:
    """One step's triage, as the drift reads it."""

    step: int
    train: str
    rollout: str
    cause: str
    headline: str
    tokens: int = 0
    noise: float | None = None           # the median |logprob diff| an honest pair shows (expected)
    metrics: dict[str, float | None] = field(default_factory=dict)
    engine_steps: list[int] | None = None   # the engine weight steps these tokens ran under

    @property
    def out(self) -> bool:
        return self.cause != "agree"

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "train": self.train, "rollout": self.rollout, "cause": self.cause,
                "headline": self.headline, "out_of_noise": self.out, "tokens": self.tokens,
                "expected_median_abs_logprob_diff": self.noise, "engine_weight_steps": self.engine_steps,
                **self.metrics}


@dataclass
class Drift:
    """The steps' triages read together: ``first`` (the first step out of the noise, None when
    none), ``onset`` (the step where the cause that comes with the growth appears), ``shape``
    (flat, jump, steady, irregular, constant), the headline and the lines after it."""

    rows: list[StepRow]
    layout: str = "pairs"
    first: int | None = None
    onset: int | None = None
    onset_cause: str | None = None
    shape: str = "flat"
    headline: str = ""
    lines: list[str] = field(default_factory=list)
    changes: list[dict[str, Any]] = field(default_factory=list)   # runs of one cause: step range and cause

    @property
    def exit_code(self) -> int:
        return 1 if self.first is not None else 0

    def series(self, metric: str) -> list[float | None]:
        return [r.metrics.get(metric) for r in self.rows]

    def text(self) -> str:
        return "\n".join([self.headline, *self.lines])

    def to_dict(self) -> dict[str, Any]:
        return {"headline": self.headline, "lines": self.lines, "exit_code": self.exit_code, "layout": self.layout,
                "first": self.first, "onset": self.onset, "onset_cause": self.onset_cause, "shape": self.shape,
                "causes": self.changes, "steps": [r.to_dict() for r in self.rows]}


def _f(x: float | None) -> str:
    return "n/a" if x is None or not math.isfinite(x) else f"{x:.4g}"


BARS = "▁▂▃▄▅▆▇█"


def sparkline(values: list[float | None]) -> str:
    """One block per value, scaled from 0 to the largest (a flat run reads flat: min-max scaling
    would blow its noise up to the full height); a missing value is a space."""
    top = max((v for v in values if v is not None and math.isfinite(v)), default=0.0)
    out = []
    for v in values:
        if v is None or not math.isfinite(v):
            out.append(" ")
        else:
            out.append(BARS[min(len(BARS) - 1, int(v / top * (len(BARS) - 1) + 0.5))] if top > 0 else BARS[0])
    return "".join(out)


#: triage one pair: :func:`tensordiff.rl.triage.triage` (given by the caller: the triage sits above
#: this module, which reads its verdicts and never imports it)
TriagePair = Callable[[str, str], Any]


def _row(step: int, train: str, rollout: str, triage: TriagePair) -> StepRow:
    t = triage(train, rollout)
    c = t.logprobs
    m: dict[str, float | None] = dict(c.metrics) if c is not None else {}
    m["median_abs_logprob_diff"] = c.q50 if c is not None and c.tokens else None
    steps = (t.weights or {}).get("steps") if (t.weights or {}).get("recorded") else None
    return StepRow(step, t.train, t.rollout, t.cause, t.headline, tokens=c.tokens if c is not None else 0,
                   noise=c.noise if c is not None and c.tokens else None,
                   metrics={k: m.get(k) for k in METRICS}, engine_steps=list(steps) if steps is not None else None)


def drift(steps: Sequence[tuple[str, str] | StepPair], triage: TriagePair, *, layout: str = "pairs",
          progress: Progress | None = None) -> Drift:
    """Triage each training step's pair ``(trainer trace, rollout trace)`` in order (or
    :class:`StepPair` with their step numbers; plain pairs are steps 0, 1, ...) with ``triage``
    and read the steps together (the module's docstring)."""
    pairs = [p if isinstance(p, StepPair) else StepPair(i, str(p[0]), str(p[1])) for i, p in enumerate(steps)]
    rows = []
    for i, p in enumerate(pairs):
        if progress is not None:
            progress(Stage.TRIAGING_STEPS, i, len(pairs))
        rows.append(_row(p.step, p.train, p.rollout, triage))
    if progress is not None:
        progress(Stage.TRIAGING_STEPS, len(pairs), len(pairs))
    return read_steps(rows, layout)


def _runs(rows: list[StepRow]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for r in rows:
        if out and out[-1]["cause"] == r.cause:
            out[-1]["to"] = r.step
        else:
            out.append({"from": r.step, "to": r.step, "cause": r.cause, "headline": r.headline})
    return out


def _span(a: int, b: int) -> str:
    return f"step {a}" if a == b else f"steps {a}-{b}"


def _shape(m: list[float | None], start: int, base: float) -> tuple[str, str]:
    """Jump, steady or irregular, with its words, for the series ``m`` from index ``start`` on
    against the level ``base`` before it."""
    tail = [x for x in m[start:] if x is not None]
    if not tail:
        return "irregular", "no sampled-token log-probs to follow"
    ex = [x - base for x in tail]
    top = max(ex)
    n = len(tail)
    if top <= 0:
        return "irregular", "no rise of the mean |logprob diff| over the steps before"
    ups = [b > a for a, b in zip(tail, tail[1:])]
    if ex[0] >= JUMP_SHARE * top:
        after = ""
        if n > 1:
            after = (", then it keeps rising" if tail[-1] > GROW * tail[0] else
                     ", then it stays near that level" if tail[-1] >= tail[0] / GROW else ", then it falls back")
        return "jump", f"a jump at its first step out, {_f(base)} -> {_f(tail[0])}{after}"
    if not ups or sum(ups) / len(ups) >= STEADY_SHARE:
        return "steady", f"a steady rise over {n} steps from {_f(base)} before: {_f(tail[0])} -> {_f(tail[-1])}"
    return "irregular", f"it rises and falls over {n} steps, between {_f(min(tail))} and {_f(max(tail))}"


def read_steps(rows: list[StepRow], layout: str = "pairs") -> Drift:
    """The drift of triaged steps."""
    d = Drift(rows, layout=layout, changes=_runs(rows))
    if not rows:
        d.headline = "no steps"
        return d
    m = d.series("mean_abs_logprob_diff")
    s0, sn = rows[0].step, rows[-1].step
    have = [(r.step, x) for r, x in zip(rows, m) if x is not None]
    growth = (f"mean |logprob diff| {_f(have[0][1])} at step {have[0][0]} -> {_f(have[-1][1])} at step {have[-1][0]}"
              if have else "no sampled-token log-probs to compare")
    i_first = next((i for i, r in enumerate(rows) if r.out), None)
    if i_first is None:
        vals = [x for _, x in have]
        spread = f", between {_f(min(vals))} and {_f(max(vals))}" if vals else ""
        d.headline = (f"no drift: every step's pair agrees within the noise, steps {s0}-{sn} ({growth}{spread})")
    elif i_first > 0:
        f = rows[i_first]
        d.first = d.onset = f.step
        d.onset_cause = f.cause
        base_vals = [x for x in m[:i_first] if x is not None]
        base = sorted(base_vals)[len(base_vals) // 2] if base_vals else 0.0
        d.shape, words = _shape(m, i_first, base)
        d.headline = (f"drift: the pairs agree up to step {f.step - 1} and leave the noise at step {f.step} "
                      f"({growth}: {words}); at step {f.step}: {f.headline}")
    else:
        f = rows[0]
        d.first = f.step
        j = _grows_with_new_cause(rows, m)
        if j is None:
            x0, xs = m[0], [x for x in m if x is not None]
            rising = x0 is not None and xs and xs[-1] > GROW * x0 and \
                xs[-1] - x0 > LEVEL * (rows[-1].noise or 0.0)
            d.onset, d.onset_cause = f.step, f.cause
            if rising and x0 is not None:
                d.shape, words = _shape(m, 1, x0)
                d.headline = (f"drift: the pairs differ from step {f.step} on and the mismatch grows ({growth}: "
                              f"{words}); at step {f.step}: {f.headline}")
            else:
                d.shape = "constant"
                d.headline = (f"no growth, but every step differs from step {f.step} on ({growth}): at step "
                              f"{f.step}: {f.headline}")
        else:
            g = rows[j]
            d.onset, d.onset_cause = g.step, g.cause
            prev = m[j - 1]
            d.shape, words = _shape(m, j, prev if prev is not None else 0.0)
            d.headline = (f"drift: the pairs differ from step {f.step} on ({f.cause}), and the mismatch grows from "
                          f"step {g.step} with a new cause ({growth}: {words}); at step {g.step}: {g.headline}")
    d.lines = _lines(d)
    return d


def _grows_with_new_cause(rows: list[StepRow], m: list[float | None]) -> int | None:
    """Where every step differs from the first on: the first later step whose cause is another than
    the steps before it and whose mismatch has grown past the first step's."""
    x0 = m[0]
    for j in range(1, len(rows)):
        if rows[j].cause in ("agree", rows[j - 1].cause):
            continue
        x = m[j]
        if x0 is None or x is None:
            return j
        if x > GROW * x0 and x - x0 > LEVEL * (rows[j].noise or 0.0):
            return j
    return None


def _lines(d: Drift) -> list[str]:
    rows = d.rows
    tme = [None if x is None else x - 1.0 for x in d.series("token_mult_prob_error")]
    out = [f"  {'mean |logprob diff|':<22}{sparkline(d.series('mean_abs_logprob_diff'))}   steps "
           f"{rows[0].step}-{rows[-1].step}",
           f"  {'token_mult_prob_error':<22}{sparkline(tme)}   (its excess over 1)"]
    if len(d.changes) > 1 or d.changes[0]["cause"] != "agree":
        out.append("  cause by step: " + "; ".join(f"{_span(c['from'], c['to'])} {c['cause']}" for c in d.changes))
    later = [c for c in d.changes if d.onset is not None and c["from"] > d.onset and c["cause"] != "agree"]
    for c in later:
        out.append(f"  from step {c['from']}: {c['headline']}")
    back = [c for c in d.changes if d.first is not None and c["from"] > d.first and c["cause"] == "agree"]
    for c in back:
        out.append(f"  back within the noise at {_span(c['from'], c['to'])}")
    eng = d.layout == "engine" and any(r.engine_steps is not None for r in rows)
    head = (f"  {'step':>5} {'tokens':>6} {'mean|d|':>9} {'median|d|':>9} {'noise':>9} {'TME':>8} {'kl_k3':>9} "
            f"{'probs_diff':>10}" + (f" {'engine':>7}" if eng else "") + "  cause")
    out += ["", head]
    for r in rows:
        x = r.metrics
        ws = ",".join(map(str, r.engine_steps)) if r.engine_steps else "-"
        out.append(f"  {r.step:>5} {r.tokens:>6} {_f(x.get('mean_abs_logprob_diff')):>9} "
                   f"{_f(x.get('median_abs_logprob_diff')):>9} {_f(r.noise):>9} {_f(x.get('token_mult_prob_error')):>8} "
                   f"{_f(x.get('kl_k3')):>9} {_f(x.get('rollout_probs_diff_mean')):>10}"
                   + (f" {ws:>7}" if eng else "") + f"  {r.cause}{'  <- first out of the noise' if r.step == d.first else ''}")
    out.append("  (mean|d|, median|d|: the sampled tokens' |logprob diff| (slime/miles train_rollout_logprob_abs_diff, "
               "SkyRL, TRL); noise: the median an honest pair shows, out of the noise above "
               f"{LEVEL:g}x; TME: NeMo-RL token_mult_prob_error; kl_k3: slime/miles train_rollout_kl; probs_diff: verl "
               "rollout_probs_diff_mean" + ("; engine: the engine weight steps the tokens ran under" if eng else "")
               + ")")
    return out
