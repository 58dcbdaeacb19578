"""Sensitivity of the verdict: an ROC, not a timed benchmark.

Records traces of one model with the real recorders (``record train``'s HF extractor in fp32,
bf16 and fp16; with ``--engines``, EAGLE-3 serve runs in real SGLang and vLLM on the CPU against
``record train --from-serve`` in fp32), injects bugs of known size into copies of the bf16 trace
(benchmarks/trace_edit.py: the real reader and writer), re-records with one layer's weights
perturbed, and runs ``tensordiff diff --json`` on every pair in both argument orders:

    PYTHONPATH=. .venv/bin/python benchmarks/bench_sensitivity.py [--quick | --correct-only] [--engines sglang vllm]
        [--model DIR --draft DIR] [--prompts FILE] [--extra-model DIR ...] [--dir D] [--keep] [--json FILE]

Cases (the bug on the bf16 side; A = fp32 reference, B = bf16 with the bug):

- ``scale-const``: slot 2 of draft_input times (1 + m);
- ``scale-token``: slot 2 times exp(m g_t), g_t ~ N(0, 1) per token (an RMS log-ratio of m);
- ``mixed``: slot 0 (layer b) holds layer b + f (layer b+1 - layer b);
- ``norm``: slot 2 RMS-normalised per token before packing (no weight); ``norm-rms``: the same,
  times the mean RMS (only the per-token scale is wrong);
- ``partial``: a fraction p of the tokens get slot 1 + 0.1 rms_t noise;
- ``duplicate``: p of the tokens get a second draft_input row whose slot 0 holds layer b+1;
- ``weight``: decoder layer k's linear weights get eps std(W) noise, re-recorded in bf16;
  the first boundary it changes is layer k+1.

Correct pairs (every exit 1 is a false alarm): HF fp32/bf16/fp16 against each other, fp32
recorded twice, an equal duplicate, each engine's EAGLE-3 serve run in each ``--engine-dtypes``
(16 new tokens per prompt, every tensor with values on both sides) against ``record train
--from-serve`` in fp32 (tests/sglang_support.py ``sglang_serve_pair``, tests/vllm_support.py
``vllm_serve_pair``), and each ``--extra-model`` (another depth) in bf16 and fp16 against fp32;
all in both argument orders.

The model: ``--model``/``--draft``, else the trained tiny Llama of scripts/train_tiny_models.py
(its held-out prompts), else a random-weight one (said in the tables: not a reference for noise).

Magnitude: ``x noise`` is the injected error of the state, rms over tokens of |inj_t - b_t| / |a_t|,
over the noise floor of that state in the pair, rms over tokens of |b_t - a_t| / |a_t| (bf16 against
fp32). ``named``: the first sentence (the JSON headline) names the injected place (the slot, or the
boundary layer k+1 for a weight perturbation).

Prints the noise floor per state and dtype (and the fp32 neighbour-layer cosines), every case, the
detection rate per magnitude bin and the false-alarm count. ``--json FILE`` writes the figures
(benchmarks/benchjson.py). Exit 0 whatever the figures (2 when a recording fails).

``--upstream-sweep`` runs only the sweep that the noise model never learns from the bug: each kind
(the slot kinds applied to a catalog state, ``noise``: extra per-token error of 2x the pair's own,
``weight``: the decoder layer before it perturbed and re-recorded) injected into each boundary
layer k of the bf16 side, diffed against fp32 in both orders; no allowance of a state before depth
k may move by more than 10% against the correct pair's. Prints the worst move per kind; exit 1 on
a violation. ``--random`` takes the random-weight model even where the trained one exists.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO / "tests"))

from benchjson import Result  # noqa: E402
from trace_edit import Duplicates, as_float, copy_trace  # noqa: E402

DTYPES = ("float32", "bfloat16", "float16")
SHORT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
BINS = [(0.0, 1.0), (1.0, 3.0), (3.0, 10.0), (10.0, 100.0), (100.0, math.inf)]


# ----------------------------------------------------------------------------------------------
# Models and recordings
# ----------------------------------------------------------------------------------------------


@dataclass
class Model:
    target: Path
    draft: Path
    label: str          # what it is, for the table ("trained 8L", "random 8L")
    layers: int
    aux_ids: list[int]


def _trained(layers: int) -> tuple[Model, dict[str, list[int]]] | None:
    """The trained tiny Llama, its EAGLE-3 draft and held-out prompts (scripts/train_tiny_models.py,
    through tests/sglang_support.py), where that script exists and trains a model of this depth."""
    import sglang_support as sup

    got = sup.trained_models()
    if got is None or got["layers"] != layers:
        return None
    return _model(got["target"], got["draft"], f"trained {layers}L"), got["prompts"]


def _model(target: Path, draft: Path, label: str) -> Model:
    cfg = json.loads((target / "config.json").read_text())
    dcfg = json.loads((draft / "config.json").read_text())
    ids = [int(i) for i in dcfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]]
    return Model(target, draft, label, int(cfg["num_hidden_layers"]), ids)


def _random(root: Path, layers: int) -> Model:
    """Fallback: a random-weight Llama the serve engines take (head_dim 64 for vLLM's CPU
    attention) and a random draft restricted to 16 tokens. Not trained: its bf16 error grows
    far faster with depth than a trained model's."""
    import sglang_support as sup
    import vllm_support as vsup

    cfg = dict(vsup.TINY_LLAMA_VLLM, num_hidden_layers=layers)
    target = root / f"random-{layers}L"
    if not (target / "config.json").exists():
        sup.make_tiny_llama(target, **cfg)
    draft = root / f"random-{layers}L-eagle3"
    if not (draft / "config.json").exists():
        ids = [2, layers // 2, layers - 2]
        sup.make_tiny_eagle3_draft(draft, target, aux_layer_ids=ids, draft_vocab=list(range(1, 17)))
    return _model(target, draft, f"random {layers}L")


def default_prompts(n: int, length: int, vocab: int, seed: int = 7) -> dict[str, list[int]]:
    rng = np.random.default_rng(seed)
    return {f"p{i}": rng.integers(1, vocab, length).tolist() for i in range(n)}


def load_prompts(path: str) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for i, line in enumerate(Path(path).read_text().splitlines()):
        if line.strip():
            doc = json.loads(line)
            ids = doc["input_ids"] if isinstance(doc, dict) else doc
            out[str(doc.get("id", f"p{i}")) if isinstance(doc, dict) else f"p{i}"] = [int(t) for t in ids]
    return out


def record_hf(model: Model, prompts_file: Path, dtype: str, out: Path, target: Path | None = None) -> Path:
    """``tensordiff record train`` (in this process: torch is imported once): every catalog state
    with values, draft_input wired as SGLang wires it, the draft's fc output and top-k."""
    from tensordiff.recorders import train_cli

    p = argparse.ArgumentParser()
    train_cli.add_arguments(p)
    args = p.parse_args(["--model", str(target or model.target), "--prompts", str(prompts_file), "--out", str(out),
                         "--draft", str(model.draft), "--convention", "sglang-llama", "--values", "all",
                         "--dtype", dtype, "--device", "cpu", "--no-progress"])
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()):
        train_cli.run(args)
    return out


def perturbed_checkpoint(model: Model, layer: int, eps: float, out: Path, seed: int = 0) -> Path:
    """A copy of the target whose decoder layer ``layer`` has every linear weight W + eps std(W) N(0, 1)."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(model.target, out)
    files = sorted(out.glob("*.safetensors"))
    g = torch.Generator().manual_seed(seed)
    prefix = f"model.layers.{layer}."
    for f in files:
        sd = load_file(str(f))
        for k, w in sd.items():
            if k.startswith(prefix) and k.endswith("proj.weight"):
                sd[k] = w + eps * w.float().std() * torch.randn(w.shape, generator=g, dtype=torch.float32).to(w.dtype)
        save_file(sd, str(f), metadata={"format": "pt"})
    return out


# ----------------------------------------------------------------------------------------------
# States and noise
# ----------------------------------------------------------------------------------------------


def states(path: Path) -> dict[str, Any]:
    """{"rows": {name: token rows}, "x": {name: float32 values}} of every boundary, final_norm and
    draft_input of an HF trace (one row per token, the same token table on every dtype)."""
    from tensordiff.trace import TraceReader

    out: dict[str, Any] = {"rows": {}, "x": {}}
    with TraceReader(path) as r:
        for name, info in r.tensors.items():
            if info.kind in ("boundary", "final_norm", "packed") and info.has_values:
                out["rows"][name] = r.token_rows(name).copy()
                out["x"][name] = as_float(r.read_values(name, raw=True), info.dtype)
        out["keys"] = _keys(r)
        out["slots"] = list(r.tensors["draft_input"].slot_labels or []) if "draft_input" in r.tensors else []
        out["H"] = r.hidden_size
    return out


def _keys(r: Any) -> np.ndarray:
    """(sequence, position) of each token row as one string per row."""
    t = r.tokens
    seqs = np.array(r.sequences, dtype=object)
    return np.array([f"{s}\x00{p}" for s, p in zip(seqs[t["seq"]], t["position"])], dtype=object)


def rel_rms(err: np.ndarray, ref: np.ndarray) -> float:
    """rms over tokens of |err_t| / |ref_t|."""
    e = np.linalg.norm(err.astype(np.float64), axis=1)
    n = np.linalg.norm(ref.astype(np.float64), axis=1)
    ok = n > 0
    return float(np.sqrt(np.mean((e[ok] / n[ok]) ** 2))) if ok.any() else float("nan")


def one_minus_cos(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a.astype(np.float64)
    b = b.astype(np.float64)
    return np.asarray(1.0 - (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)))


def paired(sa: dict, sb: dict, name: str) -> tuple[np.ndarray, np.ndarray]:
    """Rows of ``name`` on both sides for the (sequence, position) keys both have (first row of each)."""
    ka = sa["keys"][sa["rows"][name]]
    kb = sb["keys"][sb["rows"][name]]
    ib: dict[str, int] = {}
    for i, k in enumerate(kb):
        ib.setdefault(k, i)
    ia, jb, seen = [], [], set()
    for i, k in enumerate(ka):
        if k in ib and k not in seen:
            seen.add(k)
            ia.append(i)
            jb.append(ib[k])
    return sa["x"][name][ia], sb["x"][name][jb]


def state_names(s: dict) -> list[str]:
    from tensordiff.vocab import state_order

    return sorted([n for n in s["x"] if n != "draft_input"], key=state_order)


def noise_rows(ref: dict, other: dict) -> dict[str, dict[str, float]]:
    """Per state: rms relative error, mean and max 1 - cos of ``other`` against ``ref``."""
    out = {}
    for n in state_names(ref):
        if n not in other["x"]:
            continue
        a, b = paired(ref, other, n)
        if not len(a):
            continue
        omc = one_minus_cos(a, b)
        out[n] = {"rel": rel_rms(b - a, a), "omc_mean": float(np.mean(omc)), "omc_max": float(np.max(omc)),
                  "tokens": len(a)}
    return out


def neighbour_cos(ref: dict) -> dict[str, tuple[float, float]]:
    """cos(layer b, layer b+1) per token of the fp32 trace: (mean, min) per boundary pair."""
    names = [n for n in state_names(ref) if n != "final_norm"]
    out = {}
    for u, v in zip(names, names[1:]):
        c = 1.0 - one_minus_cos(ref["x"][u], ref["x"][v])
        out[f"{u}-{v}"] = (float(np.mean(c)), float(np.min(c)))
    return out


# ----------------------------------------------------------------------------------------------
# Cases
# ----------------------------------------------------------------------------------------------


@dataclass
class Case:
    kind: str
    magnitude: float            # the case's own knob (m, f, p, eps)
    a: str                      # trace paths in the "A B" order
    b: str
    place: str = ""             # regex the headline must match to name the injected place
    x_noise: float = float("nan")
    correct: bool = False
    note: str = ""
    results: dict[str, dict[str, Any]] = field(default_factory=dict)  # order -> {rc, headline}
    tensor: str = ""            # the injected tensor (and slot): a divergence finding there is "found"
    slot: int | None = None


def _slot(x: np.ndarray, s: int, H: int) -> slice:
    return slice(s * H, (s + 1) * H)


def make_cases(d: Path, model: Model, base: dict[str, Path], st: dict[str, dict], quick: bool,
               prompts_file: Path, seed: int) -> list[Case]:
    """The injected cases on the bf16 trace ``base['bfloat16']`` (A: fp32)."""
    rng = np.random.default_rng(seed)
    a, b = st["float32"], st["bfloat16"]
    H = int(b["H"])
    slots = b["slots"]
    di_a, di_b = a["x"]["draft_input"], b["x"]["draft_input"]
    rows = b["rows"]["draft_input"]
    cases: list[Case] = []
    ref_path, bf_path = str(base["float32"]), str(base["bfloat16"])

    def noise_of(s: int) -> float:
        sl = _slot(di_b, s, H)
        return rel_rms(di_b[:, sl] - di_a[:, sl], di_a[:, sl])

    def injected(name: str, edit_slot: int, new: np.ndarray, kind: str, mag: float, place: str, note: str = "") -> None:
        sl = _slot(di_b, edit_slot, H)
        x = rel_rms(new - di_b[:, sl], di_a[:, sl]) / noise_of(edit_slot)
        path = d / f"{name}.h5"
        copy_trace(bf_path, str(path), _slot_edit(sl, new))
        cases.append(Case(kind, mag, ref_path, str(path), place, x, note=note, tensor="draft_input", slot=edit_slot))

    def slot_place(s: int) -> str:
        return rf"\bslot {s} of draft_input\b|\bdraft_input slot {s}\b"

    m_scale = [0.01, 0.05, 0.3] if quick else [0.005, 0.01, 0.02, 0.05, 0.1, 0.3]
    s2 = len(slots) - 1
    sl2 = _slot(di_b, s2, H)
    g = rng.standard_normal((len(rows), 1)).astype(np.float32)
    for m in m_scale:
        injected(f"scale-const-{m}", s2, di_b[:, sl2] * np.float32(1 + m), "scale-const", m, slot_place(s2))
        injected(f"scale-token-{m}", s2, di_b[:, sl2] * np.exp(np.float32(m) * g), "scale-token", m, slot_place(s2))
    # mixed: slot 0 holds its boundary plus part of the next one's step
    lab0 = slots[0]
    nxt = f"layer{int(lab0[5:]) + 1}" if lab0.startswith("layer") else None
    if nxt and nxt in b["x"]:
        bx = _by_rows(b, nxt, rows)
        sl0 = _slot(di_b, 0, H)
        for f in ([0.05, 0.2] if quick else [0.02, 0.05, 0.1, 0.2, 0.5]):
            new = di_b[:, sl0] + np.float32(f) * (bx - di_b[:, sl0])
            injected(f"mixed-{f}", 0, new, "mixed", f, slot_place(0), note=f"{lab0} + {f} ({nxt} - {lab0})")
    # a norm before packing
    x2 = di_b[:, sl2].astype(np.float64)
    rms = np.sqrt((x2 ** 2).mean(1, keepdims=True) + 1e-6)
    injected("norm", s2, (x2 / rms).astype(np.float32), "norm", float(np.mean(1 / rms)), slot_place(s2),
             note="RMSNorm, no weight")
    injected("norm-rms", s2, (x2 / rms * rms.mean()).astype(np.float32), "norm-rms",
             float(np.std(np.log(rms))), slot_place(s2), note="RMSNorm times the mean RMS")
    # partial corruption of a fraction of the tokens
    s1 = min(1, len(slots) - 1)
    sl1 = _slot(di_b, s1, H)
    x1 = di_b[:, sl1]
    r1 = np.sqrt((x1.astype(np.float64) ** 2).mean(1, keepdims=True)).astype(np.float32)
    for p in ([0.05, 0.5] if quick else [0.01, 0.05, 0.2, 0.5]):
        k = max(1, int(round(p * len(rows))))
        pick = rng.choice(len(rows), size=k, replace=False)
        new = x1.copy()
        new[pick] += np.float32(0.1) * r1[pick] * rng.standard_normal((k, H)).astype(np.float32)
        # the magnitude of the corrupted tokens themselves, not diluted by the clean ones
        sl = _slot(di_b, s1, H)
        xs = rel_rms(new[pick] - x1[pick], di_a[pick][:, sl]) / noise_of(s1)
        path = d / f"partial-{p}.h5"
        copy_trace(bf_path, str(path), _slot_edit(sl1, new))
        cases.append(Case("partial", p, ref_path, str(path), slot_place(s1), xs,
                          note=f"{k} of {len(rows)} tokens, rel 0.1 each", tensor="draft_input", slot=s1))
    # duplicates: a second draft_input row for some tokens
    if nxt and nxt in b["x"]:
        bx = _by_rows(b, nxt, rows)
        dups = [(p, True) for p in ([0.05] if quick else [0.01, 0.05])] + [(0.05, False)]
        for p, conflicting in dups:
            k = max(1, int(round(p * len(rows))))
            pick = np.sort(rng.choice(len(rows), size=k, replace=False))
            dup = di_b[pick].copy()
            if conflicting:
                dup[:, _slot(di_b, 0, H)] = bx[pick]
            path = d / f"duplicate-{'conflict' if conflicting else 'equal'}-{p}.h5"
            copy_trace(bf_path, str(path), duplicates=Duplicates(rows[pick], {"draft_input": dup}))
            if conflicting:
                sl0 = _slot(di_b, 0, H)
                xs = rel_rms(bx[pick] - di_b[pick][:, sl0], di_a[pick][:, sl0]) / noise_of(0)
                cases.append(Case("duplicate", p, ref_path, str(path), slot_place(0) + "|duplicate", xs,
                                  note=f"{k} tokens twice, slot 0 of the copy holds {nxt}", tensor="draft_input"))
            else:
                cases.append(Case("duplicate-equal", p, ref_path, str(path), correct=True,
                                  note=f"{k} tokens twice, equal rows"))
    # one layer's weights perturbed, re-recorded in bf16
    k_layer = max(0, model.layers // 2 - 1)
    first = f"layer{k_layer + 1}"
    for eps in ([0.01, 0.05] if quick else [0.001, 0.003, 0.01, 0.03, 0.05]):
        ck = perturbed_checkpoint(model, k_layer, eps, d / f"weights-{eps}")
        path = record_hf(model, prompts_file, "bfloat16", d / f"weight-{eps}.h5", target=ck)
        shutil.rmtree(ck, ignore_errors=True)
        pst = states(path)
        xa, xb, xp = a["x"][first], b["x"][first], pst["x"][first]
        xs = rel_rms(xp - xb, xa) / rel_rms(xb - xa, xa)
        cases.append(Case("weight", eps, ref_path, str(path), rf"\b{first}\b", xs,
                          note=f"decoder layer {k_layer} (boundary {first} first)", tensor=first))
    return cases


def _slot_edit(sl: slice, new: np.ndarray):
    def edit(tname: str, trows: np.ndarray, vals: np.ndarray) -> np.ndarray | None:
        if tname != "draft_input":
            return None
        vals[:, sl] = new
        return vals
    return edit


def _by_rows(s: dict, name: str, rows: np.ndarray) -> np.ndarray:
    """Values of ``name`` at the token rows ``rows`` (every token has one row in an HF trace)."""
    where = {int(t): i for i, t in enumerate(s["rows"][name])}
    return s["x"][name][[where[int(t)] for t in rows]]


# ----------------------------------------------------------------------------------------------
# Upstream sweep: the noise model never learns from the bug
# ----------------------------------------------------------------------------------------------

#: an allowance of a state before the bug may move this much (relative) against the correct pair
UPSTREAM_MOVE = 0.1
#: one magnitude per kind, each near the edge of detection (a bug inside the trend is the one that
#: could widen an allowance; a detected one leaves the trend)
SWEEP = {"scale-const": 0.02, "scale-token": 0.02, "mixed": 0.05, "norm-rms": 0.0, "partial": 0.2,
         "noise": 2.0, "weight": 0.01}


def allowances(res: Any) -> dict[str, tuple[float, float | None]]:
    """{state or packed slot: (its per-token rel allowance, its depth)} of a diff result."""
    out: dict[str, tuple[float, float | None]] = {}
    for p in res.pairs:
        if p.compared and p.tolerance:
            for s, t in enumerate(p.tolerance):
                out[p.label if p.slots == 1 else f"{p.label}[{s}]"] = (float(t["max_rel"]), p.depth[s])
    return out


def _state_edit(name: str, new: np.ndarray) -> Any:
    """A trace edit that writes ``new`` (float32, one row per token row) into state ``name``."""
    def edit(tname: str, trows: np.ndarray, vals: np.ndarray) -> np.ndarray | None:
        return new if tname == name else None
    return edit


def upstream_sweep(d: Path, model: Model, prompts_file: Path, base: dict[str, Path], st: dict[str, dict],
                   seed: int) -> int:
    """Each kind injected into each boundary layer k of the bf16 side (a state edited in the trace;
    ``weight``: decoder layer k-1's weights perturbed and re-recorded), diffed against fp32 in both
    orders: the allowance of every state before depth k (packed slots included) must stay within
    :data:`UPSTREAM_MOVE` of the correct pair's. Prints the worst move per kind; 1 on a violation."""
    from trace_edit import copy_trace

    from tensordiff.diff import diff_traces

    rng = np.random.default_rng(seed)
    a, b = st["float32"], st["bfloat16"]
    ref, bf = str(base["float32"]), str(base["bfloat16"])
    correct = {o: allowances(diff_traces(*((ref, bf) if o == "AB" else (bf, ref)))) for o in ("AB", "BA")}
    print(f"\n## upstream sweep: allowance moves of the states before the bug, {model.label} (bf16 vs fp32)\n")
    print(f"each kind at each depth, both orders; a move past {UPSTREAM_MOVE:.0%} is a violation\n")
    print("| kind | knob | bugs | found at their depth (runs) | worst move | where (bug at, state, order) |")
    print("|---|---|---|---|---|---|")
    violations = 0
    worst_all: dict[str, float] = {}
    for kind, m in SWEEP.items():
        worst, where, found, runs = 0.0, "-", 0, 0
        for k in range(1, model.layers + 1):
            name = f"layer{k}"
            if name not in b["x"]:
                continue
            x, xa = b["x"][name].astype(np.float64), _by_rows(a, name, b["rows"][name]).astype(np.float64)
            rms = np.sqrt((x ** 2).mean(1, keepdims=True))
            path = d / f"sweep-{kind}-{k}.h5"
            if kind == "weight":
                ck = perturbed_checkpoint(model, k - 1, m, d / f"sweep-weights-{k}")
                record_hf(model, prompts_file, "bfloat16", path, target=ck)
                shutil.rmtree(ck, ignore_errors=True)
            else:
                if kind == "scale-const":
                    new = x * (1 + m)
                elif kind == "scale-token":
                    new = x * np.exp(m * rng.standard_normal((len(x), 1)))
                elif kind == "mixed":
                    nxt = f"layer{k + 1}" if f"layer{k + 1}" in b["x"] else "final_norm"
                    new = x + m * (_by_rows(b, nxt, b["rows"][name]) - x)
                elif kind == "norm-rms":
                    new = x / rms * rms.mean()
                elif kind == "partial":
                    pick = rng.random(len(x)) < m
                    new = x.copy()
                    new[pick] += 0.1 * rms[pick] * rng.standard_normal((int(pick.sum()), x.shape[1]))
                else:   # noise: per-token error of m x the pair's own, on every token
                    e = rng.standard_normal(x.shape)
                    err = np.linalg.norm(x - xa, axis=1, keepdims=True)
                    new = x + m * err * e / np.linalg.norm(e, axis=1, keepdims=True)
                copy_trace(bf, str(path), _state_edit(name, new.astype(np.float32)))
            for order in ("AB", "BA"):
                res = diff_traces(*((ref, str(path)) if order == "AB" else (str(path), ref)))
                runs += 1
                found += any(f.severity == "divergence" and f.tensor == name for f in res.findings)
                got = allowances(res)
                for label, (v, dep) in correct[order].items():
                    if label in got and dep is not None and dep < k and v > 0:
                        move = abs(got[label][0] / v - 1)
                        if move > UPSTREAM_MOVE:
                            violations += 1
                        if move >= worst:
                            worst, where = move, f"{name}, {label}, {order}"
            path.unlink(missing_ok=True)
        worst_all[kind] = worst
        print(f"| {kind} | {m:g} | {model.layers} | {found} of {runs} | {worst:.1%} | {where} |", flush=True)
    print(f"\nupstream violations: {violations} (allowance moves past {UPSTREAM_MOVE:.0%})")
    return 1 if violations else 0


# ----------------------------------------------------------------------------------------------
# Running the diff
# ----------------------------------------------------------------------------------------------


def diff(a: str, b: str) -> dict[str, Any]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env = {k: v for k, v in env.items() if not k.startswith("TENSORDIFF_")}
    proc = subprocess.run([sys.executable, "-m", "tensordiff", "diff", a, b, "--json"], capture_output=True,
                          text=True, env=env, cwd=REPO, timeout=900)
    try:
        doc = json.loads(proc.stdout)
    except ValueError:
        doc = {}
    first = doc.get("first_divergence") or {}
    div = [(f.get("tensor"), f.get("slot"), f.get("kind")) for f in doc.get("findings", [])
           if f.get("severity") == "divergence"]
    return {"rc": proc.returncode, "headline": doc.get("headline") or proc.stderr.strip()[-200:],
            "first_tensor": first.get("tensor"), "first_kind": first.get("kind"), "verdict": doc.get("verdict"),
            "divergences": div}


def run_case(c: Case) -> None:
    for order, (x, y) in (("AB", (c.a, c.b)), ("BA", (c.b, c.a))):
        res = diff(x, y)
        res["named"] = bool(c.place) and res["rc"] == 1 and re.search(c.place, res["headline"] or "") is not None
        res["found"] = bool(c.tensor) and any(t == c.tensor and (c.slot is None or sl == c.slot)
                                              for t, sl, _ in res["divergences"])
        c.results[order] = res


# ----------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------


def fmt_x(x: float) -> str:
    if not math.isfinite(x):
        return "-"
    return f"{x:.1f}x" if x < 100 else f"{x:.0f}x"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a smoke test: fewer magnitudes, 2 short prompts, HF only")
    ap.add_argument("--model", help="target checkpoint directory (default: the trained tiny Llama, else random)")
    ap.add_argument("--draft", help="its EAGLE-3 draft directory (with --model)")
    ap.add_argument("--label", help="the model's name in the tables (with --model)")
    ap.add_argument("--layers", type=int, default=8, help="depth of the default model")
    ap.add_argument("--extra-model", nargs="*", default=[], metavar="DIR=DRAFT",
                    help="more models (other depths) for the correct pairs: TARGET_DIR=DRAFT_DIR")
    ap.add_argument("--prompts", help="JSONL prompts (default: seeded token ids)")
    ap.add_argument("--correct-only", action="store_true", help="no injected bugs: the noise table and correct pairs")
    ap.add_argument("--engines", nargs="*", default=[], choices=["sglang", "vllm"],
                    help="also record correct serve/train pairs in these real engines (CPU)")
    ap.add_argument("--engine-dtypes", nargs="*", default=["bfloat16", "float32"])
    ap.add_argument("--pair", nargs="*", default=[], metavar="NOTE=A.h5,B.h5",
                    help="more correct pairs recorded elsewhere (A: the fp32 reference side)")
    ap.add_argument("--dir", help="work directory (default: a temporary one)")
    ap.add_argument("--keep", action="store_true", help="keep the traces")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the figures here (benchmarks/benchjson.py)")
    ap.add_argument("--upstream-sweep", action="store_true",
                    help="only the sweep of each bug kind at each depth: no allowance before the bug may move")
    ap.add_argument("--random", action="store_true", help="the random-weight model, even where the trained one exists")
    a = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    res = Result("bench_sensitivity", config={"quick": a.quick, "engines": a.engines, "layers": a.layers})
    d = Path(a.dir or tempfile.mkdtemp(prefix="tensordiff-sensitivity-"))
    d.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    try:
        held_out: dict[str, list[int]] = {}
        if a.model:
            model = _model(Path(a.model), Path(a.draft), a.label or Path(a.model).name)
        else:
            got = None if a.random else _trained(a.layers)
            model, held_out = got if got is not None else (_random(d / "models", a.layers), {})
        vocab = int(json.loads((model.target / "config.json").read_text())["vocab_size"])
        if a.prompts or held_out:
            prompts = load_prompts(a.prompts) if a.prompts else held_out
            if a.quick:
                prompts = dict(list(prompts.items())[:3])
        else:
            prompts = default_prompts(2 if a.quick else 6, 32 if a.quick else 64, vocab)
        pfile = d / "prompts.jsonl"
        pfile.write_text("".join(json.dumps({"id": k, "input_ids": v}) + "\n" for k, v in prompts.items()))
        print(f"model: {model.label} ({model.target}), draft ids {model.aux_ids}; "
              f"{len(prompts)} prompts, {sum(map(len, prompts.values()))} tokens; load {os.getloadavg()[0]:.2f}",
              flush=True)
        base = {dt: record_hf(model, pfile, dt, d / f"hf-{SHORT[dt]}.h5")
                for dt in (DTYPES[:2] if a.upstream_sweep else DTYPES)}
        st = {dt: states(p) for dt, p in base.items()}
        if a.upstream_sweep:
            return upstream_sweep(d, model, pfile, base, st, a.seed)
        noise = {f"HF {SHORT[dt]}": noise_rows(st["float32"], st[dt]) for dt in DTYPES[1:]}
        neigh = neighbour_cos(st["float32"])
        cases = [] if a.correct_only else make_cases(d, model, base, st, a.quick, pfile, a.seed)
        # correct pairs
        for x, y in (("float32", "bfloat16"), ("float32", "float16"), ("bfloat16", "float16")):
            cases.append(Case("correct", 0, str(base[x]), str(base[y]), correct=True,
                              note=f"HF {SHORT[x]} vs {SHORT[y]}, {model.label}"))
        again = record_hf(model, pfile, "float32", d / "hf-fp32-again.h5")
        cases.append(Case("correct", 0, str(base["float32"]), str(again), correct=True,
                          note=f"HF fp32 vs fp32 recorded again, {model.label}"))
        for spec in a.extra_model:
            tdir, _, ddir = spec.partition("=")
            em = _model(Path(tdir), Path(ddir), Path(tdir).name)
            e32 = record_hf(em, pfile, "float32", d / f"extra-{em.layers}L-fp32.h5")
            est = states(e32)
            for dt in DTYPES[1:]:
                p = record_hf(em, pfile, dt, d / f"extra-{em.layers}L-{SHORT[dt]}.h5")
                noise[f"HF {SHORT[dt]} {em.label}"] = noise_rows(est, states(p))
                cases.append(Case("correct", 0, str(e32), str(p), correct=True, note=f"HF fp32 vs {SHORT[dt]}, {em.label}"))
        missing: list[str] = []
        for eng in a.engines:
            import sglang_support as sup
            import vllm_support as vsup

            fn = sup.sglang_serve_pair if eng == "sglang" else vsup.vllm_serve_pair
            for dt in a.engine_dtypes:
                try:
                    pair = fn(model.target, model.draft, prompts, d / eng, dtype=dt, all_values=True, max_new_tokens=16)
                except (RuntimeError, subprocess.SubprocessError) as e:
                    why = [ln for ln in str(e).splitlines() if "Error" in ln or "error" in ln][-3:]
                    print(f"{eng} {SHORT[dt]}: no recording: " + " / ".join(ln.strip()[:200] for ln in why), flush=True)
                    missing.append(f"{eng} {SHORT[dt]}")
                    continue
                noise[f"{eng} {SHORT[dt]}"] = noise_rows(states(Path(pair["train"])), states(Path(pair["serve"])))
                cases.append(Case("correct", 0, pair["train"], pair["serve"], correct=True,
                                  note=f"{eng} serve {SHORT[dt]} vs record train fp32, {model.label}"))
        for spec in a.pair:
            note, _, paths = spec.rpartition("=")
            pa, _, pb = paths.partition(",")
            if not note or not pb:
                raise ValueError(f"--pair takes NOTE=A.h5,B.h5, not {spec!r}")
            noise[note] = noise_rows(states(Path(pa)), states(Path(pb)))
            cases.append(Case("correct", 0, pa, pb, correct=True, note=note))
        for c in cases:
            run_case(c)
    except (OSError, RuntimeError, ValueError, KeyError) as e:
        print(f"bench_sensitivity: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    finally:
        if not a.keep and not a.dir:
            shutil.rmtree(d, ignore_errors=True)

    figures = report(model, noise, neigh, cases, time.monotonic() - t0)
    figures["engine_pairs_missing"] = len(missing)
    if missing:
        print(f"engine pairs not recorded: {', '.join(missing)}")
    res.write(a.json, figures)
    return 0


def _rate(runs: list[dict[str, Any]], key: str) -> str:
    n = sum(bool(r[key]) if key != "rc" else r["rc"] == 1 for r in runs)
    return f"{n} ({n / len(runs):.0%})" if runs else "-"


def report(model: Model, noise: dict, neigh: dict, cases: list[Case], seconds: float) -> dict[str, Any]:
    print(f"\n## noise floor per state: rms rel err / mean 1-cos against the fp32 side, {model.label}\n")
    names: list[str] = []
    for rows in noise.values():
        for n in rows:
            if n not in names:
                names.append(n)
    print("| state | fp32 cos with the state before (mean, min) | " + " | ".join(noise) + " |")
    print("|---|---|" + "---|" * len(noise))
    nb = {k.split("-")[1]: v for k, v in neigh.items()}
    for n in names:
        c = nb.get(n)
        cells = [f"{rows[n]['rel']:.2e} / {rows[n]['omc_mean']:.1e}" if n in rows else "-" for rows in noise.values()]
        print(f"| {n} | {f'{c[0]:.4f}, {c[1]:.4f}' if c else '-'} | " + " | ".join(cells) + " |")
    print("\n## cases (A = fp32 reference, B = bf16 with the bug; both argument orders)\n")
    print("exit: the diff's exit code; found: a divergence finding on the injected tensor (and slot); "
          "named: the first sentence names it\n")
    print("| case | knob | x noise | A B: exit, found, named | B A: exit, found, named | first sentence (A B) |")
    print("|---|---|---|---|---|---|")
    yn = {True: "yes", False: "no"}
    for c in cases:
        ab, ba = c.results["AB"], c.results["BA"]
        knob = c.note if c.kind == "correct" else f"{c.magnitude:g}"
        if c.correct:
            cells = [str(r["rc"]) for r in (ab, ba)]
        else:
            cells = [f"{r['rc']}, {yn[r['found']]}, {yn[r['named']]}" for r in (ab, ba)]
        head = (ab["headline"] or "")[:110].replace("|", "/")
        print(f"| {c.kind} | {knob} | {fmt_x(c.x_noise)} | {cells[0]} | {cells[1]} | {head} |")
    bugs = [c for c in cases if not c.correct]
    print("\n## detection rate by magnitude (both orders counted; x noise of the injected state)\n")
    print("| x noise | runs | exit 1 | found at the injected place | named in the first sentence |")
    print("|---|---|---|---|---|")
    for lo, hi in BINS:
        runs = [r for c in bugs if lo <= c.x_noise < hi for r in c.results.values()]
        if runs:
            label = f"{lo:g}-{hi:g}" if math.isfinite(hi) else f">= {lo:g}"
            print(f"| {label} | {len(runs)} | {_rate(runs, 'rc')} | {_rate(runs, 'found')} | {_rate(runs, 'named')} |")
    print("\n## by kind\n")
    print("| kind | runs | exit 1 | found | named | smallest x noise found in both orders |")
    print("|---|---|---|---|---|---|")
    for kind in dict.fromkeys(c.kind for c in bugs):
        ks = [c for c in bugs if c.kind == kind]
        runs = [r for c in ks for r in c.results.values()]
        both = [c.x_noise for c in ks if all(r["found"] for r in c.results.values())]
        print(f"| {kind} | {len(runs)} | {_rate(runs, 'rc')} | {_rate(runs, 'found')} | {_rate(runs, 'named')} | "
              f"{fmt_x(min(both)) if both else '-'} |")
    corr = [c for c in cases if c.correct]
    bad = [(c, o) for c in corr for o, r in c.results.items() if r["rc"] != 0]
    alarms = sum(c.results[o]["rc"] == 1 for c, o in bad)
    errors = sum(c.results[o]["rc"] not in (0, 1) for c, o in bad)
    print(f"\nfalse alarms: {alarms} of {2 * len(corr)} correct-pair runs exit 1"
          + (f"; {errors} exit 2 (no comparison)" if errors else ""))
    for c, o in bad:
        print(f"  {c.note} [{o}]: exit {c.results[o]['rc']}: {c.results[o]['headline'][:160]}")
    above = [r for c in bugs if c.x_noise >= 3 for r in c.results.values()]
    print(f"\nat or above 3x noise: {sum(r['rc'] == 1 for r in above)} of {len(above)} runs exit 1, "
          f"{sum(r['found'] for r in above)} found at the place, {sum(r['named'] for r in above)} named first; "
          f"{seconds:.0f} s, load {os.getloadavg()[0]:.2f}")
    return {"false_alarms": alarms, "correct_runs": 2 * len(corr), "no_comparison": errors,
            "detected_at_3x": (sum(r["found"] for r in above) / len(above)) if above else None,
            "named_at_3x": (sum(r["named"] for r in above) / len(above)) if above else None,
            "bug_runs": sum(len(c.results) for c in bugs), "model": model.label, "seconds": seconds}


if __name__ == "__main__":
    sys.exit(main())
