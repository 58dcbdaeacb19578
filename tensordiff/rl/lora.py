"""A LoRA trainer against an engine serving its adapter: how the engine applied the adapter, read
from the two sides' weight fingerprints.

A PEFT trainer's fingerprints (:func:`tensordiff.recorders.peft_names.lora_fingerprints`) hold each
adapted weight merged (``W + s * B @ A``, ``s`` = ``alpha / r``, or ``alpha / sqrt(r)`` with
rsLoRA) under the served model's name, and a ``lora`` entry: ``r``, ``alpha``, ``s`` and, at the
fingerprint's sample indices, the base weight ``W`` and the scaled delta ``s * B @ A``. An engine
serving the adapter merged records its weights as any engine does; the samples sit at the same
indices (drawn from the key). So where they differ, the engine's delta over the base
(``engine - W``) is fitted as ``c`` times the trainer's, pooled over every adapted weight that
differs:

* ``c`` is one of the scalings LoRA implementations use other than the trainer's (``alpha``
  against ``alpha / r``, ``alpha / sqrt(r)`` against ``alpha / r``): the engine scales the adapter
  otherwise;
* ``c`` is 0: the engine serves the base weights, no adapter;
* the engine's adapted weights are bitwise those of its previous weight step after an update:
  the engine serves the previous step's adapter (a sync that did not reach it).

A fit that explains the differences neither way names nothing here (the weights sentence stands).
Pure: the fingerprint documents only.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

__all__ = ["classify", "sentence", "unmerged_note"]

#: the relative rounding of a stored dtype (half an ulp): the noise of an engine's merged sample
HALF_ULP = {"bfloat16": 2.0 ** -9, "float16": 2.0 ** -11, "float32": 2.0 ** -24, "float64": 2.0 ** -53}
#: a fitted factor matches a candidate within this relative distance, or four standard errors
MATCH = 0.05


def _entries(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {str(e["key"]): e for e in doc.get("parameters", [])}


def _variants(r: int, alpha: float) -> dict[str, float]:
    """The scalings LoRA implementations apply, by the words that name them."""
    return {"alpha/r": alpha / r, "alpha": alpha, "alpha/sqrt(r)": alpha / math.sqrt(r)}


def _fit(pairs: list[tuple[dict[str, Any], dict[str, Any]]]) -> dict[str, float] | None:
    """c = sum((e - b) d) / sum(d^2) over the samples of the (trainer, engine) entries, with its
    standard error from the engine dtype's rounding and the fit's residual."""
    num = den = var = 0.0
    res: list[float] = []
    rows = []
    for t, e in pairs:
        lora = t["lora"]
        b, d = np.asarray(lora["base_samples"], float), np.asarray(lora["delta_samples"], float)
        idx_t = [int(i) for i, _ in t["samples"]]
        es = {int(i): float(v) for i, v in e.get("samples", [])}
        if len(b) != len(idx_t) or not all(i in es for i in idx_t):
            continue
        ev = np.array([es[i] for i in idx_t])
        u = HALF_ULP.get(str(e.get("dtype")), 2.0 ** -9)
        rows.append((ev - b, d, u * np.abs(ev)))
    for y, d, s in rows:
        num += float((y * d).sum())
        den += float((d * d).sum())
        var += float((s * s * d * d).sum())
    if den <= 0:
        return None
    c = num / den
    for y, d, _ in rows:
        res.extend((y - c * d).tolist())
    resid = float(np.sqrt(np.mean(np.square(res)))) if res else 0.0
    noise = float(np.sqrt(np.mean(np.concatenate([s * s for _, _, s in rows])))) if rows else 0.0
    se = math.sqrt(var) / den
    return {"c": c, "se": se, "resid": resid, "noise": noise, "samples": len(res)}


def classify(trainer: dict[str, Any], engine: dict[str, Any], prev: dict[str, Any] | None, differ: list[str],
             step: int, event: str, prev_step: int | None) -> dict[str, Any] | None:
    """How the engine applied the trainer's adapter, where the trainer's fingerprints carry LoRA
    entries and ``differ`` (the keys that differ, in forward order) are adapted weights. None:
    not a LoRA difference this can name."""
    te, ee = _entries(trainer), _entries(engine)
    lora_keys = [k for k in differ if "lora" in te.get(k, {})]
    if not lora_keys or len(lora_keys) < len(differ):
        return None
    n_adapted = sum(1 for e in te.values() if "lora" in e)
    first = te[lora_keys[0]]["lora"]
    r, alpha, s_t = int(first["r"]), float(first["alpha"]), float(first["scaling"])
    out: dict[str, Any] = {"keys": lora_keys, "adapted": n_adapted, "r": r, "alpha": alpha, "scaling": s_t,
                           "step": step, "event": event}
    if prev is not None:
        pe = _entries(prev)
        if all(k in pe and k in ee and pe[k].get("sha256") == ee[k].get("sha256") for k in lora_keys):
            out.update(kind="stale", prev_step=prev_step)
            return out
    fit = _fit([(te[k], ee[k]) for k in lora_keys if k in ee])
    if fit is None:
        return None
    out["fit"] = fit
    c, tol = fit["c"], fit["se"]
    # the fit explains the engine's weights when what is left is the engine's rounding
    if fit["resid"] > 4 * max(fit["noise"], 1e-30) + 1e-12:
        return None
    if abs(c) <= max(MATCH, 4 * tol):
        out["kind"] = "no_adapter"
        return out
    s_e = c * s_t
    for words, v in _variants(r, alpha).items():
        if abs(s_e - v) <= max(MATCH * abs(v), 4 * tol * abs(s_t)) and abs(c - 1) > max(MATCH, 4 * tol):
            t_words = next((w for w, x in _variants(r, alpha).items() if math.isclose(x, s_t, rel_tol=1e-6)),
                           f"{s_t:.4g}")
            out.update(kind="scaling", engine_words=words, trainer_words=t_words, engine_scaling=v)
            return out
    return None


def sentence(v: dict[str, Any]) -> str:
    """The first sentence of a LoRA verdict (:func:`classify`)."""
    n, of = len(v["keys"]), v["adapted"]
    if v["kind"] == "stale":
        names = ", ".join(v["keys"][:3]) + (", ..." if n > 3 else "")
        return (f"weights: the engine serves the previous step's LoRA adapter: after weight update step {v['step']} "
                f"({v['event']}) its {n} adapted weights (of {of}: {names}) still hold step {v['prev_step']}'s "
                "merged values, and the trainer's adapter has moved on; the adapter sync did not reach the engine")
    fit = v["fit"]
    if v["kind"] == "no_adapter":
        return (f"weights: the engine serves the base weights without the LoRA adapter: its {n} adapted weights (of "
                f"{of}) are the base weights (the adapter's delta fitted {fit['c']:.3g} times the trainer's over "
                f"{fit['samples']} samples)")
    return (f"weights: the engine scales the LoRA adapter by {v['engine_words']} ({v['engine_scaling']:.4g}) where "
            f"the trainer scales it by {v['trainer_words']} ({v['scaling']:.4g}; r {v['r']}, alpha {v['alpha']:g}): "
            f"its merged delta is {fit['c']:.4g} times the trainer's on all {n} adapted weights that differ (of {of}; "
            f"fitted over {fit['samples']} samples, residual at the engine's rounding)")


def unmerged_note(v: dict[str, Any]) -> str:
    """The engine's recorded weights are the base weights while its outputs agree with the
    trainer's: it applies the adapter beside its linears (unmerged), which a weight record of its
    linears does not show."""
    return (f"LoRA: the engine's recorded weights are the base weights ({len(v['keys'])} adapted weights of "
            f"{v['adapted']} hold no adapter), while its states and log-probs agree with the trainer's: it applies "
            "the adapter beside its linears (unmerged), which its weight record does not show; not a cause")
