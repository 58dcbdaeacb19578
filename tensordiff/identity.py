"""What a slot holds: every recorded state (the catalog of either side) scored against the slot on
the same sampled tokens, and the rule that turns the scores into a verdict.

Pure numpy on arrays: the diff (:mod:`tensordiff.diff`) reads the rows, this module only scores
and decides, so it is tested on arrays without files.

Score of a candidate = mean per-token cosine x mean per-token RMS agreement (min/max ratio of the
two rows' RMS): the cosine tells directions apart, the RMS term separates a pre-norm boundary from
the post-norm ``final_norm`` output whose direction can be nearly the same.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from numpy.typing import NDArray

from .findings import Candidate
from .numerics import cosine_matrix, finite_or_zero, rms_agreement

CONFIDENT = 0.98       # an identity score at least this high names what a slot holds
MIN_MARGIN = 0.002     # ... and this far ahead of the runner-up
OFFSETS = (0, -1, 1, -2, 2)  # token offsets tried, the same token first

F32 = NDArray[np.float32]


@dataclass
class Target:
    """The slot's own rows at the sampled tokens, in one basis (full values or sketches)."""

    data: F32            # [n, w], NaN/Inf already zeroed
    rms: F32             # [n]


@dataclass
class CandidateRows:
    """One recorded state at the sampled tokens shifted by ``offset``: ``ok`` [n] marks the
    sampled tokens where it has a row; ``data``/``rms`` hold those rows only."""

    label: str
    side: str            # "a" or "b": whose catalog
    offset: int
    basis: str           # "values" or "sketch"
    ok: NDArray[np.bool_]
    data: F32
    rms: F32


@dataclass
class IdentityVerdict:
    """The decision for one slot. ``best`` is set only when it is confident; ``best_any`` is the
    top-scoring state either way."""

    best: str | None = None
    best_any: str | None = None
    score: float | None = None
    offset: int = 0
    margin: float | None = None
    runner_up: str | None = None
    runner_up_score: float | None = None
    candidates: list[Candidate] = field(default_factory=list)
    confident: bool = False
    reason: str | None = None


def clean(x: NDArray[np.float32]) -> F32:
    """Contiguous float32 with NaN/Inf zeroed (the form :func:`score` expects)."""
    out: F32 = finite_or_zero(np.ascontiguousarray(x, dtype=np.float32))
    return out


def score(target: Target, cand: CandidateRows) -> Candidate:
    """Score one candidate against the target on the tokens both have."""
    cos = float(cosine_matrix(target.data[cand.ok], cand.data[None], clean=False)[0])
    agree = float(rms_agreement(target.rms[cand.ok], cand.rms[None])[0])
    return Candidate(label=cand.label, offset=cand.offset, score=round(cos * agree, 6), cos=round(cos, 6),
                     rms_agreement=round(agree, 6), side=cand.side, basis=cand.basis)


def identify(target: Callable[[str], Target], candidates_at: Callable[[int], list[CandidateRows]],
             n_sample: int) -> IdentityVerdict:
    """Score the candidates at each offset in :data:`OFFSETS` (a candidate needs rows at a quarter
    of the sampled tokens at least), stopping after the same token when it already explains the
    slot, and decide. ``target(basis)``: the slot's rows in that basis (read on first use)."""
    scored: list[Candidate] = []
    for offset in OFFSETS:
        for cand in candidates_at(offset):
            if int(cand.ok.sum()) < max(1, n_sample // 4):
                continue
            scored.append(score(target(cand.basis), cand))
        if offset == 0 and scored and max(c.score for c in scored) >= CONFIDENT:
            break  # the same token explains it; no need to look at neighbours
    return decide(scored)


def decide(scored: list[Candidate]) -> IdentityVerdict:
    """The best candidate is named when its score is at least :data:`CONFIDENT` and at least
    :data:`MIN_MARGIN` ahead of the best other (label, offset)."""
    if not scored:
        return IdentityVerdict(reason="no catalog state shares these tokens")
    scored.sort(key=lambda c: (-c.score, abs(c.offset)))
    best = scored[0]
    runner = next((c for c in scored[1:] if (c.label, c.offset) != (best.label, best.offset)), None)
    margin = best.score - (runner.score if runner else 0.0)
    confident = best.score >= CONFIDENT and margin >= MIN_MARGIN
    return IdentityVerdict(best=best.label if confident else None, best_any=best.label, score=best.score,
                           offset=best.offset, margin=round(margin, 6), runner_up=runner.label if runner else None,
                           runner_up_score=runner.score if runner else None, candidates=scored[:5],
                           confident=confident)
