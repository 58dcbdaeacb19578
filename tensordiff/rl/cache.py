"""Triage's step for the prefix cache kept across weight updates (:mod:`tensordiff.rl.triage`).

A rollout engine whose prefix cache survives a weight update serves later requests KV that the
old weights computed: the positions taken from the cache were never computed under the weights
that served the request, and every position after them attends to that KV. The rollout's
``/prefix_cache`` record (:mod:`tensordiff.trace.prefix_cache`) says, per request, which positions
came from the cache and the weight step their KV is from; the weight steps' fingerprints
(``/weights``) say whether that step's weights differ from the serving step's.

The measured side: the noise a correct pair shows is predicted from the states of the sequences
computed fresh only (the noise model measured on them, :func:`tensordiff.noise_io.measure`),
never from the whole pair, whose states the stale KV moved (measured on every sequence, the
model learns the stale KV's error as noise and calls the pair agreed). The sampled tokens'
log-probs are then split: the sequences that reused stale KV against the fresh ones.

:func:`prefix_cache_step` returns the evidence and its sentence; ``explains`` is true where the
stale sequences carry the excess and the fresh ones agree (triage names it before the states).
Pure: numpy and h5py, no torch.
"""

from __future__ import annotations

import re
from typing import Any, cast

import numpy as np
from numpy.typing import NDArray

from .. import noise_io
from ..align import RowMaps
from ..diff.plan import depth_of
from ..noise import NoiseModel
from ..tokens import SEQ_BITS
from ..trace import TraceSource
from ..trace.prefix_cache import read_prefix_cache
from ..trace.rl import WeightStep, read_weight_steps, weights_at
from . import logprobs as lpmod

__all__ = ["place", "prefix_cache_step", "stale_requests"]

#: causes a prefix cache that explains the excess is named before (inferences from the states and
#: log-probs); the recorded facts (sampling, weights, tokens) come first
_AFTER = ("routing", "layer", "logits", "logprobs")


class _Only:
    """Row maps that hide every aligned token outside ``keep`` (the noise model measured on the
    fresh sequences only)."""

    def __init__(self, maps: Any, keep: NDArray[np.bool_]) -> None:
        self.maps, self.keep = maps, keep

    def inverse(self, side: str, name: str) -> NDArray[np.int64]:
        m = np.array(self.maps.inverse(side, name), dtype=np.int64, copy=True)
        m[~self.keep[: len(m)]] = -1
        return m


def _hashes(s: WeightStep) -> dict[str, Any]:
    return {str(e["key"]): e.get("sha256") for e in s.doc["parameters"]}


#: parameters no layer's KV depends on (the head after the last layer): two steps that differ only
#: there computed the same KV
_AFTER_KV = re.compile(r"^(model\.)?(lm_head|output|norm|final_norm|final_layernorm)\.")


def _kv_params(s: WeightStep) -> int:
    return sum(1 for key in _hashes(s) if not _AFTER_KV.search(key))


def _differ(steps: dict[int, WeightStep], k: int, m: int) -> int | None:
    """How many parameters the KV depends on differ between weight steps ``k`` and ``m`` (None: a
    step not recorded)."""
    if k not in steps or m not in steps:
        return None
    hk, hm = _hashes(steps[k]), _hashes(steps[m])
    return sum(1 for key in hk.keys() | hm.keys()
               if not _AFTER_KV.search(key) and (hk.get(key) != hm.get(key) or hk.get(key) is None))


def stale_requests(a: TraceSource, b: TraceSource) -> dict[str, Any] | None:
    """The sequences the trainer ran whose rollout request reused KV computed under a weight step
    other than the one serving it, with weights that differ: ``{key: {"runs": [(start, end,
    step)], "served": m, "differ": n, "cached": c, "last_flush": f}}`` plus the record; None when
    the rollout has no ``/prefix_cache`` record."""
    if not hasattr(b, "f"):
        return None
    rec = read_prefix_cache(b)
    if rec is None:
        return None
    steps = {s.step: s for s in read_weight_steps(b)}
    ran = set(a.sequences)
    stale: dict[str, dict[str, Any]] = {}
    fresh: list[str] = []
    for key, e in rec.requests.items():
        if key not in ran:
            continue
        m = int(e["weight_step"])
        runs = []
        for s0, s1, k in e["kv_steps"]:
            n = _differ(steps, k, m) if k >= 0 and k != m else 0
            if n:
                runs.append((s0, s1, k, n))
        if runs:
            stale[key] = {"runs": [(s0, s1, k) for s0, s1, k, _ in runs], "served": m, "differ": max(r[3] for r in runs),
                          "params": _kv_params(steps[m]) if m in steps else None,
                          "cached": int(e["cached_tokens"]), "last_flush": int(e["last_flush_forward_step"])}
        else:
            fresh.append(key)
    return {"stale": stale, "fresh": fresh, "flushes": rec.flushes, "steps": steps}


def _final_q50(model: NoiseModel, num_layers: int | None) -> float:
    st = next((s for s in model.states if s.label == "final_norm"), None)
    if st is not None and st.clean:
        return st.level.q50
    return model.expected(float(num_layers or 0)).q50


def _words(p0: int, p1: int) -> str:
    return f"{p0}-{p1 - 1}" if p1 - 1 > p0 else str(p0)


def _where(stale: dict[str, dict[str, Any]]) -> str:
    """'positions 0-39 of sequences a0, a1 reuse KV from weight step 0 (served under step 1)',
    grouped by the same positions and steps."""
    groups: dict[tuple[str, str, int], list[str]] = {}
    for key, s in sorted(stale.items()):
        pos = ", ".join(_words(r[0], r[1]) for r in s["runs"][:4])
        kv = sorted({r[2] for r in s["runs"]})
        groups.setdefault((pos, ", ".join(map(str, kv)), s["served"]), []).append(key)
    parts = []
    for (pos, ks, m), keys in list(groups.items())[:3]:
        names = ", ".join(keys[:6]) + (f" and {len(keys) - 6} more" if len(keys) > 6 else "")
        one = len(keys) == 1
        parts.append(f"positions {pos} of sequence{'' if one else 's'} {names} reuse{'s' if one else ''} KV from "
                     f"weight step {ks} (served under step {m}")
    more = len(groups) - 3
    return "); ".join(parts) + ")" + (f"; and {more} more groups" if more > 0 else "")


def _flush_words(info: dict[str, Any]) -> str:
    stale = info["stale"]
    never = all(s["last_flush"] < 0 for s in stale.values())
    if never:
        return "the cache not flushed since the recording started"
    last = max(s["last_flush"] for s in stale.values())
    w = weights_at(list(info["steps"].values()), last)
    return f"the cache last flushed at forward step {last} (weight step {w.step if w else 'unknown'})"


def prefix_cache_step(a: TraceSource, b: TraceSource, plan: Any, c: lpmod.LogprobComparison | None
                      ) -> dict[str, Any] | None:
    """The stale-KV evidence of a trainer/rollout pair and its sentence, or None when the rollout
    records no request that reused KV of other weights among the sequences the trainer ran."""
    info = stale_requests(a, b)
    if info is None or not info["stale"]:
        return None
    stale = info["stale"]
    al = plan.alignment
    names = np.asarray(a.sequences, dtype=object)
    seq_of = (al.code_a >> np.int64(SEQ_BITS)).astype(np.int64)
    is_stale = np.isin(names[seq_of], list(stale)) if len(names) else np.zeros(len(al), dtype=bool)
    pairs = [(j.a, j.b) for j in plan.jobs]
    fresh_maps = cast(RowMaps, _Only(plan.maps, ~is_stale))   # the noise model reads a map's inverse only
    model = noise_io.measure(a, b, fresh_maps, pairs, lambda i, s: depth_of(a, b, i, s))
    expected = lpmod.expected_noise(_final_q50(model, a.num_layers), model.dtype_a, model.dtype_b)
    n_fresh = len(info["fresh"])
    measured_on = (f"from the {n_fresh} sequence{'s' if n_fresh != 1 else ''} computed fresh" if model.measured
                   else "the dtypes' default: no sequence computed fresh to measure it on")
    out: dict[str, Any] = {"sequences": {k: {**v, "runs": [list(r) for r in v["runs"]]} for k, v in stale.items()},
                           "fresh": info["fresh"], "expected": expected, "explains": False}
    where = _where(stale)
    d = sorted({s["differ"] for s in stale.values()})
    params = next((s["params"] for s in stale.values() if s["params"]), None)
    differ = (f"{d[-1]} of the {params} parameters the KV depends on differing" if params else
              f"{d[-1]} parameters the KV depends on differing")
    facts = f"{where}, {differ}, {_flush_words(info)}"
    if c is None or not c.tokens:
        out["sentence"] = (f"prefix cache: {facts}: no sampled-token log-probs to measure what it did: flush the "
                           "prefix cache after each weight update")
        out["lines"] = []
        return out
    on = is_stale[c.index]
    d_abs = np.abs(c.diff)
    q_stale = float(np.median(d_abs[on])) if on.any() else None
    q_fresh = float(np.median(d_abs[~on])) if (~on).any() else None
    limit = lpmod.LEVEL * expected
    out.update(stale_median=q_stale, fresh_median=q_fresh, stale_tokens=int(on.sum()), fresh_tokens=int((~on).sum()))
    excess = q_stale is not None and q_stale > limit
    fresh_ok = q_fresh is None or q_fresh <= limit
    lp = (f"their log-probs differ from the trainer's by a median {q_stale:.3g} nats, "
          f"{q_stale / max(expected, 1e-30):.1f}x the {expected:.3g} expected ({measured_on})" if q_stale is not None
          else "none of their sampled tokens is compared")
    if excess and fresh_ok:
        out["explains"] = True
        fresh = (f"fresh positions agree (median {q_fresh:.3g})" if q_fresh is not None else
                 "fresh positions agree (no sequence was computed fresh to compare with)")
        out["sentence"] = f"prefix cache: {facts}: {lp}; {fresh}: flush the prefix cache after each weight update"
    elif excess:
        out["sentence"] = (f"prefix cache: {facts}: {lp}; but the sequences computed fresh differ too (median "
                           f"{q_fresh:.3g}): the stale KV is not the only cause; flush the prefix cache after each "
                           "weight update")
    else:
        out["sentence"] = (f"prefix cache: {facts}: {lp}: within the noise here, but computed under other weights than "
                           "the ones that served them: flush the prefix cache after each weight update")
    out["lines"] = [f"  prefix cache: expected median |logprob diff| of an honest pair {expected:.3g} ({measured_on}, "
                    "not from the states the stale KV moved): "
                    f"stale sequences {_f(q_stale)} on {int(on.sum())} tokens, fresh {_f(q_fresh)} on "
                    f"{int((~on).sum())} tokens"]
    return out


def _f(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.4g}"


def place(pc: dict[str, Any], causes: list[tuple[str, str]], layer: dict[str, Any] | None) -> list[tuple[str, str]]:
    """Triage's causes with the prefix cache's: where it explains the excess, before the
    inferences from the states and log-probs, and a state that leaves the noise at a position
    where the cached prefix ends read as what it is (the positions after it attend to the stale
    KV, not position ids that differ); elsewhere after every other cause."""
    out = list(causes)
    if not pc["explains"]:
        return out + [("prefix_cache", pc["sentence"])]
    ends = {r[1] for v in pc["sequences"].values() for r in v["runs"]}
    prof = (layer or {}).get("positions") or {}
    for i, (kind, _) in enumerate(out):
        if kind == "layer" and layer is not None and prof.get("onset") in ends:
            out[i] = (kind, f"states: {layer['tensor']} is the first state out of the noise, from position "
                            f"{prof['onset']} on, where the cached prefix ends: the positions after it attend to the "
                            "stale KV")
    at = next((i for i, (kind, _) in enumerate(out) if kind in _AFTER), len(out))
    return out[:at] + [("prefix_cache", pc["sentence"])] + out[at:]
