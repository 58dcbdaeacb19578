"""Where an RL trainer and its rollout engine disagree: ``tensordiff triage TRAIN ROLLOUT [PREFILL]``.

The trainer's trace (``record train --from-serve``, or :class:`TrainerRecorder` in a user's own
forward) is the reference A; the rollout engine's trace is B. The evidence is read in this order,
and the first that explains the difference is named in the first sentence:

0. **sampling** (the ``sampling`` attribute of both traces): the temperature the trainer divides by
   against the one the rollout sampled at, where both record one and they differ (a recorded
   fact, named before any inference from the data);
1. **weights** (``/weights/step_<k>``, :mod:`tensordiff.trace.rl`): the trainer's weights against
   the engine's weight step in force for the rollout's tokens, parameter by parameter in forward
   order (a float32 trainer parameter and the engine's bf16/fp16 copy are equal when the copy is
   its exact cast: the trainer side records the cast's hash); a parameter the engine still holds
   from its previous step is called stale after that update;
2. **tokens and positions**: the aligner's findings (shifted, mismatched tokens), and sampled
   tokens that differ;
3. **routing** (:mod:`tensordiff.routing`): MoE expert choices that flip, when the states first
   leave the noise at or after the first flipping layer;
4. **the first state out of the noise trend** (the diff, :mod:`tensordiff.diff`, with its noise
   model), split by regime (prefill, decode), and what its error does along the positions (from
   position 0 growing: rope; from a later position at once: position ids); with PREFILL (the
   engine's re-run of the same tokens as prefill, ``record serve --replay``) the three-way table
   decode vs prefill vs trainer;
5. **logits and log-probs**: states agree but the raw logits (``target_topk``) do not (the head:
   lm_head dtype, softcap, scale); the logits agree but the sampled tokens' log-probs do not (a
   temperature applied on one side only, raw against processed log-probs: a systematic offset).

The frameworks' metrics are printed under their own names (:mod:`tensordiff.rl.logprobs`). Exit
codes as the diff's: 0 no cause found (everything within the noise), 1 a cause named, 2 bad input.
Pure: numpy and h5py, no torch.

Why one module of this size: the order of evidence is the product, and each step's test sits
beside the sentence that names its cause, so the order and the words change together.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import NDArray

from .. import routing as routing_mod
from .. import weights as wmod
from ..align import RowMaps, SideTokens, align_tokens
from ..conventions import SAMPLED_LOGPROB, TARGET_TOPK
from ..diff import DiffOptions, diff_sources, open_pair, plan_diff
from ..findings import DiffResult, Finding, Kind, Severity
from ..noise import UNIT, NoiseModel
from ..tokens import POS_MASK, SEQ_BITS
from ..trace import TraceSource
from ..trace.rl import WeightStep, read_sampling, read_weight_steps, sampling_for, weights_at
from ..vocab import REGIME_CODE, REGIMES
from . import cache as rl_cache
from . import logprobs as lpmod
from . import lora as rl_lora
from . import replay as rl_replay
from .drift import drift as steps_drift

__all__ = ["Triage", "triage", "triage_sources"]

CAUSES = ("sampling", "weights", "tokens", "prefix_cache", "routing", "layer", "logits", "logprobs", "agree",
          "incomplete")


@dataclass
class Triage:
    """The verdict: ``cause`` (one of :data:`CAUSES`), the first sentence naming it, the lines
    that follow, and the evidence behind each step."""

    train: str
    rollout: str
    cause: str
    headline: str
    lines: list[str] = field(default_factory=list)
    weights: dict[str, Any] | None = None
    logprobs: lpmod.LogprobComparison | None = None
    routing: dict[str, Any] | None = None
    layer: dict[str, Any] | None = None
    three_way: list[dict[str, Any]] | None = None
    noise_states: list[dict[str, Any]] = field(default_factory=list)   # per state: measured vs the trend
    curve: dict[str, list[Any]] = field(default_factory=dict)          # per sampled token: position, diff, regime
    diff: DiffResult | None = None

    @property
    def exit_code(self) -> int:
        return 0 if self.cause == "agree" else 1

    def text(self) -> str:
        return "\n".join([self.headline, *self.lines])

    def to_dict(self) -> dict[str, Any]:
        return {"train": self.train, "rollout": self.rollout, "cause": self.cause, "headline": self.headline,
                "lines": self.lines, "exit_code": self.exit_code, "weights": self.weights,
                "logprobs": self.logprobs.to_dict() if self.logprobs is not None else None,
                "routing": self.routing, "layer": self.layer, "three_way": self.three_way,
                "noise_states": self.noise_states,
                "diff_headline": self.diff.headline() if self.diff is not None else None}


def roles(a: TraceSource, b: TraceSource) -> bool:
    """Whether the two traces are given the other way round: the first says it is the engine's
    (side ``serve``) and the second the trainer's (side ``train``). Any other pair of sides (two
    engine traces, ``other``) keeps the order it was given in."""
    return a.side == "serve" and b.side == "train"


def triage(train: str, rollout: str, prefill: str | None = None) -> Triage:
    """Triage the trainer's trace against the rollout's (and the engine's prefill re-run). Each
    trace says which side it is: a rollout given first and a trainer second are taken by their
    roles, so the verdict does not depend on the order of the arguments."""
    with open_pair(train, rollout) as (a, b):
        swapped = roles(a, b)
        if not swapped:
            t = triage_sources(a, b)
    if swapped:
        train, rollout = rollout, train
        with open_pair(train, rollout) as (a, b):
            t = triage_sources(a, b)
        t.lines.insert(0, "  the first trace is the rollout's and the second the trainer's (their recorded sides): "
                          "taken as such")
    if prefill is not None:
        t.three_way = three_way(train, rollout, prefill)
        t.lines += _three_way_lines(t.three_way)
        tw = {(r["a"], r["b"]): r for r in t.three_way}
        dp, dt, pt = tw[("prefill", "decode")], tw[("trainer", "decode")], tw[("trainer", "prefill")]
        if t.cause != "weights" and not dp["agree"] and not dt["agree"] and pt["agree"]:
            t.lines.insert(0, t.headline)
            t.cause = "layer"
            t.headline = ("the engine's decode path: its decode passes disagree with its own prefill re-run of the "
                          f"same tokens ({_tw_evidence(dp)}) and with the trainer ({_tw_evidence(dt)}), while prefill "
                          f"and trainer agree ({_tw_evidence(pt)})")
    return t


def _tw_evidence(r: dict[str, Any]) -> str:
    """What a three-way row's verdict rests on, in a few words."""
    basis = r.get("basis", "log-probs")
    state = f"; {r['first_state']} out of the noise" if r.get("first_state") else ""
    if basis == "states":
        return str(r["note"]) + state
    raw = " on raw log-probs" if basis == "raw" else ""
    return f"token_mult_prob_error {_f(r['token_mult_prob_error'])}{raw}{state}"


def _f(x: float | None) -> str:
    return "n/a" if x is None or not math.isfinite(x) else f"{x:.4g}"


# ----------------------------------------------------------------------------------------------
# 1. weights
# ----------------------------------------------------------------------------------------------


def _steps(r: TraceSource) -> list[WeightStep]:
    return read_weight_steps(r) if hasattr(r, "f") else []


def _cast_equal(ea: dict[str, Any], eb: dict[str, Any]) -> bool | None:
    """Whether one entry is the exact cast of the other (None: no cast hash to tell)."""
    da, db = str(ea.get("dtype")), str(eb.get("dtype"))
    if da == db:
        return None
    for x, y in ((ea, eb), (eb, ea)):
        casts = x.get("cast_sha256")
        if isinstance(casts, dict) and str(y.get("dtype")) in casts:
            return bool(casts[str(y.get("dtype"))] == y.get("sha256"))
    return None


def compare_weights(trainer: dict[str, Any], engine: dict[str, Any]) -> list[wmod.ParamDiff]:
    """The parameters that differ between two fingerprint documents, in forward order. A pair
    of other dtypes is equal when one is the exact cast of the other (``cast_sha256``); without
    a cast hash, when its estimated relative difference is within one rounding of the coarser
    dtype."""
    ca, cb = wmod.checkpoint_from_doc(trainer, "trainer"), wmod.checkpoint_from_doc(engine, "engine")
    out = []
    for d in wmod.compare(ca, cb).diffs:
        ea, eb = ca.params[d.key].fp or {}, cb.params[d.key].fp or {}
        same = _cast_equal(ea, eb)
        if same is None and d.what == "dtype+values" and d.rel is not None:
            u = max(UNIT.get(str(ea.get("dtype")), 0.0), UNIT.get(str(eb.get("dtype")), 0.0))
            same = d.rel <= 2 * u
        if not same:
            out.append(d)
    return out


def weights_step(a: TraceSource, b: TraceSource) -> dict[str, Any] | None:
    """The trainer's weights (its last step) against each engine weight step in force for the
    rollout's tokens; None when either side recorded none."""
    sa, sb = _steps(a), _steps(b)
    if not sa or not sb:
        return {"recorded": False, "train": bool(sa), "rollout": bool(sb)}
    trainer = sa[-1]
    rows = b.tokens
    if len(rows):
        # only the passes that served the sequences the trainer ran: a warm-up request served under
        # older weights says nothing about the weights the compared tokens saw
        ran = set(a.sequences)
        keep = np.array([k in ran for k in b.sequences], dtype=bool)
        if keep.any():
            sel = keep[np.asarray(rows["seq"], dtype=np.int64)]
            rows = rows[sel] if sel.any() else rows
    fwd = np.unique(np.asarray(rows["step"], dtype=np.int64)) if len(rows) else np.zeros(0, np.int64)
    used: dict[int, WeightStep] = {}
    for f in fwd:
        s = weights_at(sb, int(f))
        if s is not None:
            used[s.step] = s
    out: dict[str, Any] = {"recorded": True, "steps": sorted(used), "differ": None}
    mixed = _mixed_versions(a, b, rows, sb, trainer, used)
    if mixed is not None:
        out["mixed"] = mixed
        return out
    for k in sorted(used, reverse=True):   # the latest weights the compared tokens ran with first
        s = used[k]
        diffs = compare_weights(trainer.doc, s.doc)
        if not diffs:
            continue
        d = diffs[0]
        prev = next((p for p in reversed(sb) if p.step < s.step), None)
        stale = False
        if prev is not None:
            pe = {str(e["key"]): e for e in prev.doc["parameters"]}
            se = {str(e["key"]): e for e in s.doc["parameters"]}
            stale = d.key in pe and d.key in se and pe[d.key].get("sha256") == se[d.key].get("sha256")
        out["differ"] = {"step": s.step, "event": s.event, "key": d.key, "where": d.where(), "name": d.name_b,
                         "rel": d.rel, "max_abs": d.max_abs, "estimated": d.estimated, "count": len(diffs),
                         "of": len(trainer.doc["parameters"]), "stale": stale,
                         "stale_since": prev.step if stale and prev is not None else None,
                         "then": [x.where() for x in diffs[1:6]], "behind": _behind(trainer, s, prev, sb),
                         "lora": rl_lora.classify(trainer.doc, s.doc, prev.doc if prev is not None else None,
                                                  [x.key for x in diffs], s.step, s.event,
                                                  prev.step if prev is not None else None)}
        break
    return out


def _mixed_versions(a: TraceSource, b: TraceSource, rows: Any, steps: list[WeightStep], trainer: WeightStep,
                    used: dict[int, WeightStep]) -> dict[str, Any] | None:
    """Sequences generated across a weight update (an in-flight update: their first positions
    under one weight step, the later ones under the next), where the trainer's weights are one of
    those steps: which positions ran which step, per sequence. None when no sequence spans two
    steps or the trainer's weights are none of them."""
    if len(used) < 2 or not len(rows):
        return None
    ours = [k for k in sorted(used) if not compare_weights(trainer.doc, used[k].doc)]
    if not ours:
        return None
    fwd = np.asarray(rows["step"], dtype=np.int64)
    wk = np.full(len(fwd), -1, dtype=np.int64)
    for f in np.unique(fwd):
        s = weights_at(steps, int(f))
        wk[fwd == f] = s.step if s is not None else -1
    seq, pos = np.asarray(rows["seq"], dtype=np.int64), np.asarray(rows["position"], dtype=np.int64)
    spans = []
    for q in np.unique(seq):
        m = seq == q
        ks = np.unique(wk[m])
        if len(ks) > 1:
            spans.append((str(b.sequences[int(q)]), [(int(k), _ranges_words(np.sort(pos[m & (wk == k)]))) for k in ks]))
    if not spans:
        return None
    k_ours = ours[-1]
    off = 0
    if SAMPLED_LOGPROB in b.tensors:    # the sampled tokens generated under weights other than the trainer's
        lr = np.asarray(b.token_rows(SAMPLED_LOGPROB), dtype=np.int64)
        sf = np.asarray(b.tokens["step"], dtype=np.int64)[lr]
        off = sum(int((sf == f).sum()) for f in np.unique(sf)
                  if (w := weights_at(steps, int(f))) is not None and w.step != k_ours)
        total = len(lr)
    else:
        total = 0
    return {"sequences": len(spans), "of": int(len(np.unique(seq))), "spans": spans[:3], "trainer_step": k_ours,
            "update": used[max(used)].event, "steps": sorted(used), "off_policy": off, "sampled": total,
            "differ": len(compare_weights(trainer.doc, used[min(used)].doc)), "params": len(trainer.doc["parameters"])}


def _mixed_sentence(m: dict[str, Any]) -> str:
    where = "; ".join(f"sequence {key} " + ", ".join(f"positions {r} under step {k}" for k, r in parts)
                      for key, parts in m["spans"])
    more = f" (and {m['sequences'] - len(m['spans'])} more)" if m["sequences"] > len(m["spans"]) else ""
    older = [k for k in m["steps"] if k != m["trainer_step"]]
    off = (f": {m['off_policy']} of the {m['sampled']} sampled tokens were generated under step "
           f"{', '.join(map(str, older))}, whose weights are not the trainer's ({m['differ']} of {m['params']} parameters "
           "differ)" if m["sampled"] else "")
    return (f"weights: mixed policy versions inside the sequences: {m['sequences']} of {m['of']} sequences were "
            f"generated across a weight update ({m['update']}, in flight): {where}{more}; the trainer's weights are "
            f"step {m['trainer_step']}'s{off}")


def _hashes(doc: dict[str, Any]) -> dict[str, Any]:
    return {str(e["key"]): e.get("sha256") for e in doc["parameters"]}


def _behind(trainer: WeightStep, s: WeightStep, prev: WeightStep | None, steps: list[WeightStep]) -> dict[str, Any] | None:
    """A whole step behind: the engine's step ``s`` holds every parameter of its previous step
    (the update never reached it), or the trainer's weights are exactly another recorded engine
    step (the tokens were generated before the engine received the trainer's weights, or after
    it moved on). None when neither."""
    hs = _hashes(s.doc)
    if prev is not None and None not in hs.values() and _hashes(prev.doc) == hs:
        return {"served": prev.step, "update": s.step, "event": s.event, "how": "update"}
    for o in steps:
        if o.step != s.step and not compare_weights(trainer.doc, o.doc):
            return {"served": s.step, "trainer": o.step, "event": o.event, "how": "other"}
    return None


def _weights_sentence(w: dict[str, Any]) -> str:
    d = w["differ"]
    b = d.get("behind")
    n = f"{d['count']} of {d['of']} parameters differ from the trainer's"
    if b is not None and b["how"] == "update":
        return (f"weights: the engine serves step {b['served']}'s weights: after weight update step {b['update']} "
                f"({b['event']}) every parameter still holds step {b['served']}'s values ({n}): the update did "
                "not reach the engine")
    if b is not None:
        when = "after" if b["trainer"] > b["served"] else "before"
        return (f"weights: the engine serves step {b['served']}'s weights: these tokens were generated under weight "
                f"step {b['served']}, and the trainer's weights are the engine's step {b['trainer']} ({b['event']}), "
                f"which it held only {when} them ({n})")
    rel = f"rel {d['rel']:.3g}" if d["rel"] is not None else "shapes differ"
    est = ", estimated from fingerprints" if d["estimated"] else ""
    where = f"{d['where']} ({d['name']})" if d["where"] != d["name"] else d["name"]
    if d["stale"]:
        return (f"weights: {where} is stale on the engine after weight update step {d['step']} ({d['event']}): it "
                f"still holds step {d['stale_since']}'s values, the trainer has others (hash differs, {rel}{est}); "
                f"the engine serves weights other than the trainer's ({d['count']} of {d['of']} parameters differ)")
    return (f"weights: {where} differs between trainer and engine at weight step {d['step']} (hash, {rel}{est}): the "
            f"engine serves weights other than the trainer's ({d['count']} of {d['of']} parameters differ)")


# ----------------------------------------------------------------------------------------------
# The steps on states and log-probs
# ----------------------------------------------------------------------------------------------


def _temperature(r: TraceSource) -> float | None:
    s = read_sampling(r) if hasattr(r, "f") else None
    t = (s or {}).get("temperature")
    return float(t) if isinstance(t, (int, float)) else None


def sampling_differs(a: TraceSource, b: TraceSource) -> dict[str, Any] | None:
    """Where both traces record the temperature each compared sequence was sampled (rollout) or
    divided by (trainer) at and they differ: the first such sequence's two temperatures and how
    many of the sequences both sides ran differ. None when they agree or either side records none."""
    sa = read_sampling(a) if hasattr(a, "f") else None
    sb = read_sampling(b) if hasattr(b, "f") else None
    if sa is None or sb is None:
        return None
    ran = set(a.sequences)
    both = [k for k in b.sequences if k in ran] or [""]
    differ = []
    for k in both:
        ta, tb = (sampling_for(sa, k) or {}).get("temperature"), (sampling_for(sb, k) or {}).get("temperature")
        if not (isinstance(ta, (int, float)) and isinstance(tb, (int, float))):
            continue
        # temperature 0 (greedy) leaves the logits undivided: the same log-probs as 1
        ta, tb = (float(ta) or 1.0), (float(tb) or 1.0)
        if not math.isclose(ta, tb, rel_tol=1e-6):
            differ.append((k, float(ta), float(tb)))
    if not differ:
        return None
    k, ta, tb = differ[0]
    return {"sequence": k, "train": ta, "rollout": tb, "count": len(differ), "of": len(both)}


def _sampling_sentence(d: dict[str, Any], c: lpmod.LogprobComparison | None, lt_b: float | None = None) -> str:
    seqs = "" if d["of"] == 1 and d["sequence"] == "" else f", {d['count']} of {d['of']} sequences"
    lp = (f"; the sampled tokens' log-probs differ by a median {c.q50:.3g} nats (expected {c.noise:.3g})"
          if c is not None and c.tokens else "")
    if d["train"] == 1.0 and lt_b is not None and math.isclose(lt_b, d["rollout"], rel_tol=1e-6):
        # the trainer divides by nothing and the rollout returned the distribution it sampled from
        return (f"sampling: the rollout's log-probs are processed, at temperature {_f(d['rollout'])} (of the "
                f"distribution it sampled from, its recorded logprobs_mode), while the trainer's are raw (it divides "
                f"the logits by no temperature: 1 recorded{seqs}){lp}; give the trainer the rollout's temperature")
    return (f"sampling: the trainer divides the logits by temperature {_f(d['train'])} while the rollout sampled at "
            f"{_f(d['rollout'])} (their recorded sampling{seqs}): the trainer's log-probs are of another "
            f"distribution than the one sampled from{lp}; give the trainer the rollout's temperature")


def _mode(r: TraceSource) -> str | None:
    s = read_sampling(r) if hasattr(r, "f") else None
    m = (sampling_for(s, "") or {}).get("logprobs_mode") if s else None
    return str(m) if m else None


def logprob_temperature(r: TraceSource) -> float | None:
    """The temperature a trace's recorded log-probs are of, from its ``sampling`` attribute: its
    temperature where they are processed (the trainer's ``log_softmax(logits / T)``, an engine's
    log-probs of the distribution it sampled from), 1 where they are raw (an engine's
    ``logprobs_mode`` raw, as vLLM V1 returns them and a prefill re-run records them); temperature 0
    (greedy) is 1. None when the trace records no sampling."""
    s = sampling_for(read_sampling(r), "") if hasattr(r, "f") else None
    if not s:
        return None
    t = s.get("temperature")
    t = float(t) if isinstance(t, (int, float)) and t > 0 else 1.0
    return 1.0 if s.get("logprobs_mode") == "raw" else t


def _modes_differ(la: float | None, lb: float | None) -> bool:
    return la is not None and lb is not None and not math.isclose(la, lb, rel_tol=1e-6)


def _final_q50(model: NoiseModel, num_layers: int | None) -> float:
    st = next((s for s in model.states if s.label == "final_norm"), None)
    if st is not None and st.clean:
        return st.level.q50
    return model.expected(float(num_layers or 0)).q50


def _token_rel(a: TraceSource, b: TraceSource, maps: RowMaps, name_a: str, name_b: str,
               n: int) -> tuple[NDArray[np.int64], NDArray[np.float64]]:
    """Aligned indices and per-token relative error ||b - a|| / ||a|| of a state recorded with
    values on both sides."""
    everything = np.arange(n)
    (ma,), (mb,) = maps.rows_at("a", name_a, [everything]), maps.rows_at("b", name_b, [everything])
    both = np.flatnonzero((ma >= 0) & (mb >= 0)).astype(np.int64)
    rel = np.zeros(len(both))
    for s in range(0, len(both), 1 << 14):
        blk = both[s:s + (1 << 14)]
        va = np.asarray(a.part(name_a, "values").take(ma[blk]), dtype=np.float64)
        vb = np.asarray(b.part(name_b, "values").take(mb[blk]), dtype=np.float64)
        na = np.linalg.norm(va, axis=1)
        rel[s:s + len(blk)] = np.linalg.norm(vb - va, axis=1) / np.where(na > 0, na, 1.0)
    return both, rel


def position_profile(a: TraceSource, b: TraceSource, maps: RowMaps, codes: NDArray[np.int64], name_a: str,
                     name_b: str, limit: float, regime_b: NDArray[np.uint8] | None = None) -> dict[str, Any] | None:
    """What a diverging state's error does along the positions: ``onset`` (the median over
    sequences of the first position out of ``limit``), ``clean_before`` (the share of the tokens
    before each sequence's onset within it), ``after`` (the share out after it) and the rank
    correlation of error with position. None when the state has no values on both sides."""
    if not (a.tensors[name_a].has_values and b.tensors[name_b].has_values):
        return None
    idx, rel = _token_rel(a, b, maps, name_a, name_b, len(codes))
    if len(idx) < 8:
        return None
    seq, pos = codes[idx] >> SEQ_BITS, codes[idx] & POS_MASK
    decode = REGIME_CODE["decode"]
    onsets, before, after = [], [], []
    at_decode = 0
    for s in np.unique(seq):
        m = seq == s
        p, e = pos[m], rel[m]
        out = np.flatnonzero(e > limit)
        if not len(out):
            continue
        f = int(p[out].min())
        onsets.append(f)
        if regime_b is not None:
            dec = p[regime_b[idx[m]] == decode]
            at_decode += int(len(dec) > 0 and int(dec.min()) == f)
        before.append(e[p < f])
        after.append(e[p >= f] > limit)
    if not onsets:
        return None
    pre = np.concatenate(before) if before else np.zeros(0)
    post = np.concatenate(after)
    rp = np.argsort(np.argsort(pos)).astype(np.float64)
    re = np.argsort(np.argsort(rel)).astype(np.float64)
    corr = float(np.corrcoef(rp, re)[0, 1]) if np.std(rp) > 0 and np.std(re) > 0 else 0.0
    return {"onset": int(np.median(onsets)), "at_decode_start": at_decode >= 0.9 * len(onsets),
            "clean_before": float((pre <= limit).mean()) if len(pre) else 1.0,
            "after": float(post.mean()), "corr": corr, "tokens": len(idx),
            "position0": float(np.median(rel[pos == 0])) if (pos == 0).any() else None}


def _position_words(p: dict[str, Any] | None) -> str | None:
    if p is None:
        return None
    if p["onset"] <= 2 and p["corr"] > 0.3 and (p["position0"] is None or p["position0"] < 1e-3):
        return ("its error is zero at position 0 and grows with position (rank correlation "
                f"{p['corr']:.2f}): a rotary embedding configuration difference (rope theta, scaling) is the usual cause")
    if p["onset"] > 2 and p["clean_before"] >= 0.95 and p["after"] >= 0.5 and p.get("at_decode_start"):
        return (f"every sequence agrees up to position {p['onset']} and diverges from there on, exactly where the "
                f"rollout's decode passes start ({p['after']:.0%} of the tokens after it out of the noise): the "
                "engine's decode path (attention kernel, KV cache), or position ids that restart with the response; "
                "a prefill re-run of the same tokens (record serve --replay, the third argument) tells them apart")
    if p["onset"] > 2 and p["clean_before"] >= 0.95 and p["after"] >= 0.5:
        return (f"every sequence agrees up to position {p['onset']} and diverges from there on at once "
                f"({p['after']:.0%} of the tokens after it out of the noise): position ids differ from there on "
                "(missing or restarted position_ids, packing) is the usual cause")
    return None


def _topk_shift(a: TraceSource, b: TraceSource, maps: RowMaps, n: int) -> float | None:
    """Median |raw log-prob of A's top-1 token, A - B| (the logits compared through the recorded
    top-k tables); None when either side has none."""
    if TARGET_TOPK not in a.tensors or TARGET_TOPK not in b.tensors:
        return None
    everything = np.arange(n)
    (ma,), (mb,) = maps.rows_at("a", TARGET_TOPK, [everything]), maps.rows_at("b", TARGET_TOPK, [everything])
    both = np.flatnonzero((ma >= 0) & (mb >= 0))[: 1 << 15]
    if len(both) < 8:
        return None
    p = np.asarray(a.part(TARGET_TOPK, "values").take(ma[both]), dtype=np.float64)
    q = np.asarray(b.part(TARGET_TOPK, "values").take(mb[both]), dtype=np.float64)
    k = (p.shape[1] - 1) // 2
    hit = q[:, :k] == p[:, :1]
    at = np.where(hit.any(1), np.where(hit, q[:, k:2 * k], -np.inf).max(1), np.nan)
    d = np.abs(at - p[:, k])
    d = d[np.isfinite(d)]
    return float(np.median(d)) if len(d) else None


def _metric_lines(c: lpmod.LogprobComparison) -> list[str]:
    m = c.metrics
    out = [f"  sampled tokens compared: {c.tokens} (in {c.sequences} sequences); expected median |logprob diff| of an "
           f"honest pair {c.noise:.3g}, measured {c.q50:.3g}"]
    for key, where in lpmod.FRAMEWORK_NAMES.items():
        out.append(f"  {key} = {_f(m.get(key))}    ({where})")
    for reg, rm in c.by_regime.items():
        out.append(f"  {reg}: {rm['tokens']} tokens, token_mult_prob_error {_f(rm['token_mult_prob_error'])}, "
                   f"mean_abs_logprob_diff {_f(rm['mean_abs_logprob_diff'])}")
    for o in c.outliers[:5]:
        out.append(f"  outlier sequence {o['seq']}: mean |logprob diff| {o['mean_abs_diff']:.3g} "
                   f"({_f(o['times_typical'])}x the typical sequence's)")
    return out


def triage_sources(a: TraceSource, b: TraceSource) -> Triage:
    """Triage two open traces: A the trainer (reference), B the rollout."""
    t = Triage(a.path, b.path, "agree", "")
    # 1. weights, before any activation is compared
    w = weights_step(a, b)
    t.weights = w
    opt = DiffOptions()
    plan = plan_diff(a, b, opt)
    al, maps = plan.alignment, plan.maps
    noise = lpmod.expected_noise(_final_q50(plan.noise, a.num_layers), plan.noise.dtype_a, plan.noise.dtype_b)
    ta, tb = _temperature(a), _temperature(b)
    c = lpmod.compare(a, b, al, maps, noise, ta, tb)
    t.logprobs = c
    t.noise_states = [{"label": st.label, "depth": st.depth, "q50": st.level.q50, "predicted": st.predicted,
                       "clean": st.clean} for st in plan.noise.states]
    if c is not None and c.tokens:
        t.curve = {"seq": [int(x) for x in al.code_a[c.index] >> SEQ_BITS],
                   "position": [int(x) for x in al.code_a[c.index] & POS_MASK],
                   "diff": [float(x) for x in c.diff], "regime": [REGIMES[int(x)] for x in c.regime_b]}
    res = diff_sources(a, b, DiffOptions())
    t.diff = res
    causes: list[tuple[str, str]] = []
    notes: list[str] = []
    # 0. the recorded sampling: a fact, not an inference from the data
    samp = sampling_differs(a, b)
    lt_a, lt_b = logprob_temperature(a), logprob_temperature(b)
    if samp is not None:
        causes.append(("sampling", _sampling_sentence(samp, c, lt_b)))
    elif _modes_differ(lt_a, lt_b) and c is not None and c.tokens and not c.agree:
        causes.append(("logprobs", _modes_sentence(lt_a, lt_b, c)))
    if w is not None and w.get("mixed"):
        causes.append(("weights", _mixed_sentence(w["mixed"])))
    elif w is not None and w.get("differ"):
        lv = w["differ"].get("lora")   # a LoRA adapter the engine applies otherwise (rl_lora)
        if lv and lv.get("kind") == "no_adapter" and res.first_divergence is None and (c is None or c.agree):
            notes.append("  " + rl_lora.unmerged_note(lv))
        else:
            causes.append(("weights", rl_lora.sentence(lv) if lv else _weights_sentence(w)))
    # 2. tokens and positions
    tok = [f for f in res.findings if f.kind in (Kind.TOKEN_SHIFT, Kind.TOKEN_MISMATCH)
           and f.severity == Severity.DIVERGENCE]
    if tok:
        causes.append(("tokens", f"tokens: {tok[0].message}"))
    elif c is not None and c.id_mismatch:
        causes.append(("tokens", f"tokens: {c.id_mismatch} sampled-token rows name another token on the two sides "
                                 "(the log-probs are of other tokens: a shift or a template difference)"))
    first = res.first_divergence
    first_numeric = first if first is not None and first.kind not in (Kind.TOKEN_SHIFT, Kind.TOKEN_MISMATCH) else None
    # 3. routing (a replay of the rollout's routing that recomputes its weights first: rl_replay)
    rd = routing_mod.compare(a, b, al, maps)
    rp = rl_replay.check(a, b, al, maps, {x["layer"]: x["flips"] for x in rd.layers} if rd is not None else None)
    replay_cause = rl_replay.sentence(rp) if rp is not None else None
    if rp is not None and replay_cause is None and (line := rl_replay.note(rp)):
        notes.append(line)
    if replay_cause is not None and rp is not None:
        at = min(x["layer"] for x in rp.weights_recomputed)
        fl = _layer_of(first_numeric)
        if first_numeric is None or fl is None or fl > at:
            causes.append(("routing", replay_cause))
        else:
            notes.append(f"  {replay_cause}")
    if rd is not None and rd.layers:
        t.routing = {"tokens": rd.tokens, "flips": rd.flips, "layers": rd.layers,
                     "replay": rp.to_dict() if rp is not None else None}
        flipping = [x for x in rd.layers if x["flips"]]
        if not flipping:
            notes.append(f"  routing agrees: the same experts for all {rd.tokens} token-layer choices "
                         f"({len(rd.layers)} MoE layers)")
        else:
            lay = flipping[0]
            seqs, flip_at = _tokens_flipping(a, b, al, maps)
            first_layer = _layer_of(first_numeric)
            explains = first_numeric is None or first_layer is None or first_layer > lay["layer"]
            # the flips at the layers before the first state out must carry its error: a bug in one
            # sequence (its mask) moves the router's input of that sequence too, and its flips come
            # with states out of the noise on tokens no flip reached
            states_word = None
            if explains and first_numeric is not None and first_layer is not None:
                states_word = _flips_carry_states(a, b, plan, res, first_numeric, first_layer, al, maps)
                explains = states_word is None
            lp_out = c is not None and not c.agree
            # with every state within the noise, the flips are the cause only where the log-prob gap sits on them
            gap_on_flips = lp_out and c is not None and c.tokens > 0 and _flips_carry(c, al.code_a, flip_at)
            if explains and (first_numeric is not None or gap_on_flips):
                f0 = lay["first"] or {}
                causes.append(("routing", f"routing: MoE router choices flip first at layer {lay['layer']} "
                                          f"({lay['flips']} of {lay['tokens']} tokens, first at sequence "
                                          f"{f0.get('seq')} position {f0.get('position')}); {seqs:.1%} of tokens "
                                          "flip at least one layer, and the states leave the noise only after it"))
                if c is not None and c.tokens:
                    notes.append("  " + _flips_explain(c, al.code_a, flip_at))
            elif states_word is not None:
                notes.append(f"  routing: MoE router choices flip at layer {lay['layer']} ({lay['flips']} of "
                             f"{lay['tokens']} tokens), but {states_word}: downstream of the states, not their cause")
    # 4. the first state out of the noise trend
    if first_numeric is not None:
        t.layer = _layer_info(a, b, plan, res, first_numeric)
        causes.append(("layer", t.layer["sentence"]))
    # 5. logits and log-probs: only where the states agree (else the gap is the states' doing)
    if c is not None and not c.agree and first_numeric is not None:
        notes.append(f"  the sampled tokens' log-probs differ too (median |diff| {c.q50:.3g}, expected {noise:.3g}): "
                     "downstream of the states")
    elif c is not None and not c.agree and not (samp is None and _modes_differ(lt_a, lt_b)):
        shift = _topk_shift(a, b, maps, len(al))
        if c.raw_match is not None:
            raw_side, other = ("rollout", "trainer") if c.raw_match == "b_raw" else ("trainer", "rollout")
            temps = {"trainer": ta, "rollout": tb}
            causes.append(("logprobs", f"log-probs: the {raw_side}'s log-probs are raw (the model's log-softmax, no "
                                       f"temperature) while the {other}'s are divided by the temperature "
                                       f"({_f(temps[other])}): the {raw_side}'s log-probs match the {other}'s raw ones "
                                       f"(median |diff| {_f(c.raw_match_q50)}); the offset (median {c.offset:+.3g} "
                                       f"nats) has one sign on {c.same_way:.0%} of the tokens out of the noise"))
        elif shift is not None and shift > lpmod.LEVEL * noise:
            causes.append(("logits", f"logits: the states agree but the logits do not (median |raw top-1 logprob "
                                     f"diff| {shift:.3g}, {shift / noise:.0f}x the noise the states predict): the "
                                     "head differs (lm_head dtype, e.g. bf16 against fp32; a logit softcap or scale)"))
        elif c.systematic and samp is None:
            causes.append(("logprobs", f"log-probs: the logits agree but the sampled tokens' log-probs do not: a "
                                       f"systematic offset on {c.same_way:.0%} of the tokens out of the noise (median "
                                       f"{c.offset:+.3g} nats): {_offset_causes(ta, tb, _mode(b))}"))
        elif samp is None:
            causes.append(("logprobs", f"log-probs: the sampled tokens' log-probs differ beyond the noise (median "
                                       f"|diff| {c.q50:.3g}, {c.q50 / max(noise, 1e-30):.0f}x the expected "
                                       f"{noise:.3g}) while the states agree"))
    pc = rl_cache.prefix_cache_step(a, b, plan, c)   # KV reused from other weights (tensordiff.rl.cache)
    if pc is not None:
        notes += pc["lines"]
        causes = rl_cache.place(pc, causes, t.layer)
    if causes:
        t.cause, t.headline = causes[0]
        t.lines += [f"  then {s}" for _, s in causes[1:]]
    else:
        what = (f"the sampled tokens' log-probs agree within the noise (median |diff| {c.q50:.3g}, expected "
                f"{c.noise:.3g})" if c is not None and c.tokens else "no sampled-token log-probs to compare")
        t.headline = f"no cause: weights, tokens and states agree ({res.headline()}); {what}"
        if w is not None and not w.get("recorded"):
            t.lines.append("  weights not compared: " + ", ".join(
                s for s, has in (("trainer", w.get("train")), ("rollout", w.get("rollout"))) if not has)
                + " recorded no /weights")
    t.lines += notes
    if c is not None:
        t.lines += _metric_lines(c)
    return t


def _modes_sentence(lt_a: float | None, lt_b: float | None, c: lpmod.LogprobComparison) -> str:
    """The trainer's and the rollout's recorded log-probs are of other temperatures (one raw, one
    processed; the sampling temperatures agree): named from the records, confirmed by the data
    where a side's raw top-k shows the other's log-probs are its raw ones."""
    raw_side, other = ("rollout", "trainer") if lt_b == 1.0 else ("trainer", "rollout")
    t = lt_a if raw_side == "rollout" else lt_b
    if lt_a != 1.0 and lt_b != 1.0:
        head = (f"log-probs: the trainer's log-probs are of temperature {_f(lt_a)} and the rollout's of {_f(lt_b)} "
                "(their recorded sampling)")
    else:
        head = (f"log-probs: the {raw_side}'s log-probs are raw (the model's log-softmax, no temperature) while the "
                f"{other}'s are divided by the temperature ({_f(t)})")
    if c.raw_match is not None:
        return (f"{head}: the {raw_side}'s log-probs match the {other}'s raw ones (median |diff| "
                f"{_f(c.raw_match_q50)}); the offset (median {c.offset:+.3g} nats) has one sign on {c.same_way:.0%} "
                "of the tokens out of the noise")
    return (f"{head}, as their recorded sampling says (logprobs_mode and temperature): their sampled tokens' "
            f"log-probs differ by a median {c.q50:.3g} nats (expected {c.noise:.3g}), offset {c.offset:+.3g}; "
            "compare like with like (the trainer at the rollout's temperature against processed log-probs, or "
            "raw against raw)")


def _offset_causes(ta: float | None, tb: float | None, mode_b: str | None) -> str:
    """What can put a systematic offset on log-probs whose logits agree, given what the traces
    record: a temperature on one side only is offered only where a temperature is not recorded on
    both sides (recorded ones that differ are named before this), raw against processed
    log-probs only where the rollout's mode is not recorded as processed."""
    temps = f"trainer temperature {_f(ta)}, rollout {_f(tb)}, rollout logprobs_mode {mode_b or 'unknown'}"
    offers = []
    if ta is None or tb is None:
        offers.append("a temperature applied on one side only")
    if mode_b != "processed":
        offers.append("raw against processed log-probs")
    if offers:
        return f"{', or '.join(offers)} ({temps})"
    return (f"the recorded sampling is the same on both sides ({temps}): the log-probs are computed another way on "
            "one side (the returned log-probs renormalised over a top-k / top-p set, or another logit scale)")


def _after_flips(c: lpmod.LogprobComparison, codes: NDArray[np.int64], flip_at: NDArray[np.bool_]) -> NDArray[np.bool_]:
    """Which sampled tokens come at or after a routing flip in their sequence."""
    seq, pos = codes >> SEQ_BITS, codes & POS_MASK
    first: dict[int, int] = {}
    for s_, p_ in zip(seq[flip_at], pos[flip_at]):
        first[int(s_)] = min(first.get(int(s_), int(p_)), int(p_))
    ls, lp = seq[c.index], pos[c.index]
    return np.array([int(p_) >= first.get(int(s_), 1 << 62) for s_, p_ in zip(ls, lp)], dtype=bool)


def _flips_carry(c: lpmod.LogprobComparison, codes: NDArray[np.int64], flip_at: NDArray[np.bool_]) -> bool:
    """Whether the log-prob gap sits on the tokens at or after a flip (as :func:`_flips_explain` says it)."""
    after = _after_flips(c, codes, flip_at)
    d = np.abs(c.diff)
    if not (~after).any():
        return bool(after.any())
    if not after.any() or d.sum() <= 0:
        return False
    return bool(d[after].sum() / d.sum() >= 0.5 and not float(d[~after].mean()) > float(d[after].mean()))


def _flips_explain(c: lpmod.LogprobComparison, codes: NDArray[np.int64], flip_at: NDArray[np.bool_]) -> str:
    """Whether the log-prob gap sits on the tokens at or after a routing flip in their sequence."""
    after = _after_flips(c, codes, flip_at)
    d = np.abs(c.diff)
    ma = float(d[after].mean()) if after.any() else float("nan")
    mb = float(d[~after].mean()) if (~after).any() else float("nan")
    share = float(d[after].sum() / d.sum()) if d.sum() > 0 else 0.0
    if not (~after).any():
        return (f"every sampled token comes at or after a flip in its sequence (mean |logprob diff| {_f(ma)}): the "
                "flips can explain the log-prob gap; no flip-free token to compare with")
    return (f"the flips explain the log-prob gap: {share:.0%} of the total |logprob diff| is on the "
            f"{int(after.sum())} sampled tokens at or after a flip in their sequence (mean {_f(ma)}, "
            f"elsewhere {_f(mb)})" if share >= 0.5 and not (mb > ma) else
            f"the flips do not explain the log-prob gap: {share:.0%} of the total |logprob diff| is on the "
            f"{int(after.sum())} sampled tokens at or after a flip (mean {_f(ma)}, elsewhere {_f(mb)})")


def _flips_by_layer(a: TraceSource, b: TraceSource, n: int,
                    maps: RowMaps) -> Iterator[tuple[int, NDArray[np.intp], NDArray[np.bool_]]]:
    """Per MoE layer both sides recorded, in order: the aligned tokens compared and which of them
    the two sides hand other experts."""
    la, lb = routing_mod.routing_layers(a), routing_mod.routing_layers(b)
    everything = np.arange(n)
    for layer in sorted(set(la) & set(lb)):
        ia, ib = la[layer], lb[layer]
        (ma,), (mb,) = maps.rows_at("a", ia.name, [everything]), maps.rows_at("b", ib.name, [everything])
        both = np.flatnonzero((ma >= 0) & (mb >= 0))
        if not len(both) or ia.width != ib.width:
            continue
        k = ia.width // 2
        va = np.asarray(a.part(ia.name, "values").take(ma[both]), dtype=np.float64)[:, :k]
        vb = np.asarray(b.part(ib.name, "values").take(mb[both]), dtype=np.float64)[:, :k]
        yield layer, both, (np.sort(va, 1) != np.sort(vb, 1)).any(1)


def _tokens_flipping(a: TraceSource, b: TraceSource, al: Any, maps: RowMaps) -> tuple[float, NDArray[np.bool_]]:
    """The share of aligned tokens whose experts flip in at least one MoE layer, and which."""
    n = len(al)
    any_flip = np.zeros(n, dtype=bool)
    seen = np.zeros(n, dtype=bool)
    for _, both, here in _flips_by_layer(a, b, n, maps):
        any_flip[both] |= here
        seen[both] = True
    return (float(any_flip[seen].mean()) if seen.any() else 0.0), any_flip


#: the flips explain a state's error when at least this share of its tokens out of the noise are
#: tokens the flips reach (flipped themselves, or after a flip in their sequence where a layer
#: between the flip and the state mixes positions)
FLIPS_CARRY = 0.75


def _flips_carry_states(a: TraceSource, b: TraceSource, plan: Any, res: DiffResult, f: Finding, depth: float,
                        al: Any, maps: RowMaps) -> str | None:
    """None where the routing flips before the first state out of the noise reach its tokens out
    of the noise; else what they leave unexplained, in words. A flip at MoE layer i moves boundary
    i + 1 only at the flipped token (the experts act per token); deeper, attention carries it to
    the later positions of its sequence."""
    pair = next((p for p in res.pairs if f.tensor in (p.name_a, p.name_b)), None)
    if pair is None or pair.name_a not in a.tensors or pair.name_b not in b.tensors:
        return None
    if not (a.tensors[pair.name_a].has_values and b.tensors[pair.name_b].has_values):
        return None
    from ..noise import tolerance

    d = next((x for x in pair.depth if x is not None), None)
    _, max_rel = tolerance(plan.noise, d, pair.dtype_a or None, pair.dtype_b or None)
    idx, rel = _token_rel(a, b, maps, pair.name_a, pair.name_b, len(al))
    out = rel > max_rel
    if not out.any():
        return None
    n = len(al)
    flipped = np.zeros(n, dtype=bool)
    first_flip_layer: int | None = None
    for layer, both, here in _flips_by_layer(a, b, n, maps):
        if layer + 1 > depth:
            break
        if here.any() and first_flip_layer is None:
            first_flip_layer = layer
        flipped[both] |= here
    if first_flip_layer is None:
        return None
    reach = flipped.copy()
    if depth > first_flip_layer + 1:     # a layer after the flip mixes positions: later tokens of its sequence
        codes = al.code_a
        seq, pos = codes >> SEQ_BITS, codes & POS_MASK
        first: dict[int, int] = {}
        for s_, p_ in zip(seq[flipped], pos[flipped]):
            first[int(s_)] = min(first.get(int(s_), int(p_)), int(p_))
        reach |= np.array([int(p_) >= first.get(int(s_), 1 << 62) for s_, p_ in zip(seq, pos)], dtype=bool)
    n_out = int(out.sum())
    carried = int((out & reach[idx]).sum())
    if carried >= FLIPS_CARRY * n_out:
        return None
    return (f"{n_out - carried} of the {n_out} tokens of {f.tensor} out of the noise are tokens no flip reaches "
            f"({carried} are)")


def _layer_of(f: Finding | None) -> float | None:
    if f is None:
        return None
    return f.order if f.order >= 0 else None


def _layer_info(a: TraceSource, b: TraceSource, plan: Any, res: DiffResult, f: Finding) -> dict[str, Any]:
    pair = next((p for p in res.pairs if f.tensor in (p.name_a, p.name_b)), None)
    regimes = dict(pair.by_regime) if pair is not None else {}
    split = "; ".join(f"{r}: {v['failing']} of {v['tokens']} tokens out of the noise" for r, v in regimes.items())
    prof = None
    words = None
    if f.tensor and pair is not None and f.tensor in a.tensors and pair.name_b in b.tensors:
        from ..noise import tolerance

        depth = next((d for d in pair.depth if d is not None), None)
        _, max_rel = tolerance(plan.noise, depth, pair.dtype_a or None, pair.dtype_b or None)
        few = few_sequences(a, b, plan.maps, plan.alignment.code_a, pair.name_a, pair.name_b, max_rel)
        if few is not None:
            sentence = f"sequences: {f.tensor} is the first state out of the noise, and {_few_words(few, max_rel)}"
            return {"tensor": f.tensor, "message": f.message, "by_regime": regimes, "positions": None,
                    "sequences": few, "sentence": sentence}
        prof = position_profile(a, b, plan.maps, plan.alignment.code_a, pair.name_a, pair.name_b, max_rel,
                                plan.alignment.regime_b)
        words = _position_words(prof)
    sentence = f"states: the first state out of the noise trend is {f.tensor}: {f.message}"
    if words:
        sentence = f"positions: {f.tensor} is the first state out of the noise, and {words}"
    elif regimes and len(regimes) > 1:
        sentence += f" (by regime: {split})"
    return {"tensor": f.tensor, "message": f.message, "by_regime": regimes, "positions": prof, "sentence": sentence}


#: the error of a state sits in a few sequences when at most this share of them carries this share
#: of its tokens out of the noise, and every other sequence has nearly all its tokens within
FEW_SEQUENCES, FEW_SHARE, OTHERS_CLEAN = 0.25, 0.9, 0.95


def few_sequences(a: TraceSource, b: TraceSource, maps: RowMaps, codes: NDArray[np.int64], name_a: str,
                  name_b: str, limit: float) -> list[dict[str, Any]] | None:
    """The sequences that carry a diverging state's error, when they are a few of many (a bug in
    one sequence of a batch: its attention mask, its padding, its inputs), each with the positions
    out of ``limit`` and its median relative error; None when the error is spread over the
    sequences or the state has no values on both sides."""
    if not (a.tensors[name_a].has_values and b.tensors[name_b].has_values):
        return None
    idx, rel = _token_rel(a, b, maps, name_a, name_b, len(codes))
    seq, pos = codes[idx] >> SEQ_BITS, codes[idx] & POS_MASK
    seqs = np.unique(seq)
    out = rel > limit
    if len(seqs) < 4 or not out.any():
        return None
    per = [(int(s), int(out[seq == s].sum())) for s in seqs]
    per.sort(key=lambda x: -x[1])
    k = max(1, int(FEW_SEQUENCES * len(seqs)))
    carry = [s for s, n in per[:k] if n]
    held = sum(n for s, n in per if s in carry)
    rest = ~np.isin(seq, carry)
    if held < FEW_SHARE * out.sum() or not rest.any() or float((~out[rest]).mean()) < OTHERS_CLEAN:
        return None
    keys = a.sequences
    res = []
    for s in carry:
        m = seq == s
        p = np.sort(pos[m & out])
        res.append({"seq": str(keys[s]), "positions": _ranges_words(p), "out": int(len(p)), "tokens": int(m.sum()),
                    "median_rel": float(np.median(rel[m]))})
    res.append({"others": int(len(seqs) - len(carry)), "within": float((~out[rest]).mean()),
                "median_rel": float(np.median(rel[rest]))})
    return res


def _ranges_words(p: NDArray[np.int64]) -> str:
    if not len(p):
        return "none"
    cuts = np.flatnonzero(np.diff(p) != 1) + 1
    runs = [(int(r[0]), int(r[-1])) for r in np.split(p, cuts)]
    words = [f"{x}-{y}" if y > x else str(x) for x, y in runs[:4]]
    return ", ".join(words) + (f" and {len(runs) - 4} more runs" if len(runs) > 4 else "")


def _few_words(few: list[dict[str, Any]], limit: float) -> str:
    *carry, rest = few
    one = len(carry) == 1
    whose = "that sequence's" if one else "those sequences'"
    what = "; ".join(f"sequence {c['seq']} positions {c['positions']} ({c['out']} of its {c['tokens']} tokens out "
                     f"of the noise, median rel err {c['median_rel']:.3g}, {c['median_rel'] / max(limit, 1e-30):.0f}x "
                     "the allowed)" for c in carry)
    return (f"its error sits in {'one sequence' if one else f'{len(carry)} sequences'}: {what}; the other "
            f"{rest['others']} sequences agree ({rest['within']:.0%} of their tokens within the noise): a difference "
            f"in {whose} own inputs (its attention mask or padding in the "
            "batch, its position ids), not in the weights or the model's code")


# ----------------------------------------------------------------------------------------------
# The three-way table: decode vs prefill vs trainer
# ----------------------------------------------------------------------------------------------


def three_way(train: str, rollout: str, prefill: str) -> list[dict[str, Any]]:
    """Each pair of the three traces: the sampled tokens' log-prob metrics and the diff's first
    divergence (what RL teams compute by hand to tell a decode-path bug from a trainer difference).

    Log-probs are compared like with like: where a pair's recorded log-probs are of other
    temperatures (a rollout's processed at T against a prefill re-run's raw ones, as SGLang's input
    log-probs are), the side divided by T is read raw from its ``target_topk``; where it has none,
    the pair's verdict is its states' (the diff's), and the row says so (``basis``)."""
    names = {"trainer": train, "decode": rollout, "prefill": prefill}
    out = []
    for x, y in (("prefill", "decode"), ("trainer", "decode"), ("trainer", "prefill")):
        with open_pair(names[x], names[y]) as (a, b):
            sides = (SideTokens(a), SideTokens(b))
            al = align_tokens(a, b, sides)
            maps = RowMaps(al, a, b, *sides)
            plan = plan_diff(a, b, DiffOptions())
            noise = lpmod.expected_noise(_final_q50(plan.noise, a.num_layers), plan.noise.dtype_a, plan.noise.dtype_b)
            la, lb = logprob_temperature(a), logprob_temperature(b)
            basis, note, raw = "log-probs", "", (False, False)
            if _modes_differ(la, lb):
                raw = (la != 1.0, lb != 1.0)
                hot = [(n, t) for n, t, r, flag in ((x, la, a, raw[0]), (y, lb, b, raw[1])) if flag]
                have = all(TARGET_TOPK in r.tensors for r, flag in ((a, raw[0]), (b, raw[1])) if flag)
                words = " and ".join(f"the {n}'s log-probs are at T {_f(t)}" for n, t in hot)
                basis, note = (("raw", f"compared raw: {words}, read raw from its top-k") if have else
                               ("states", f"by their states: {words}, with no top-k to read raw ones from"))
                if not have:
                    raw = (False, False)
            c = lpmod.compare(a, b, al, maps, noise, raw=raw)
            res = diff_sources(a, b, DiffOptions())
        m = c.metrics if c is not None else {}
        # a pair agrees where its log-probs and its states do: a decode-path error on a few of the
        # sampled tokens can leave their median |logprob diff| within the noise while the decode
        # rows' states leave it (what the states say is the sharper of the two)
        lp_ok = basis == "states" or c is None or not c.tokens or c.agree
        first = res.first_divergence
        out.append({"a": x, "b": y, "tokens": c.tokens if c is not None else 0,
                    "token_mult_prob_error": m.get("token_mult_prob_error"),
                    "mean_abs_logprob_diff": m.get("mean_abs_logprob_diff"),
                    "agree": bool(lp_ok and first is None), "logprobs_agree": bool(lp_ok), "basis": basis,
                    "note": note, "first_state": first.tensor if first is not None else None,
                    "first_divergence": res.headline()})
    return out


def _three_way_lines(rows: list[dict[str, Any]]) -> list[str]:
    out = ["  three-way (decode = the rollout, prefill = the engine's re-run of the same tokens):"]
    for r in rows:
        on = f" ({r['note']})" if r.get("note") else ""
        out.append(f"    {r['a']:>7} vs {r['b']:<7} token_mult_prob_error {_f(r['token_mult_prob_error']):>8}  "
                   f"mean_abs_logprob_diff {_f(r['mean_abs_logprob_diff']):>8}  "
                   f"{'agree' if r['agree'] else 'differ'}{on}; {r['first_divergence']}")
    return out


# ----------------------------------------------------------------------------------------------
# Drift over training steps
# ----------------------------------------------------------------------------------------------


def drift(steps: list[tuple[str, str]]) -> dict[str, Any]:
    """Triage each training step's pair ``(trainer trace, rollout trace)`` in order and read the
    steps together: :func:`tensordiff.rl.drift.drift` (``tensordiff drift DIR``), as a dict."""
    return steps_drift(steps, triage).to_dict()


__all__ += ["CAUSES", "compare_weights", "drift", "few_sequences", "position_profile", "roles", "sampling_differs", "three_way",
            "weights_step"]
