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
The op kinds below are in the sweep too (decoder layer k-1 computes the op wrong; the last layer's
shows at final_norm); ``--kinds`` runs only the kinds named.

``--op-kinds`` runs only the op kinds, a port's bug inside one decoder layer k (L/2 - 1), each
re-recorded in bf16 with the loaded HF model edited (:data:`OP_KINDS`: the softmax scale times
(1 + s), the activation (1 - s) SiLU + s GELU-tanh, the attention output added times (1 + s), the
query rotated at p + s), at sizes up to the whole bug, recorded plain and zoomed into layer k and
diffed against fp32 in both orders: whether the plain diff leads with the boundary after layer k,
the zoom with the kind's tap and its signature (a difference nothing downstream shows: a note
naming it), and from which size in noise units each holds. Then the correct pairs (fp32, bf16,
fp16, fp32 recorded again, fp32 against bf16 zoomed into every layer), both orders: every exit 1
is a false alarm.
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


def record_hf(model: Model, prompts_file: Path, dtype: str, out: Path, target: Path | None = None,
              zoom: int | None = None) -> Path:
    """``tensordiff record train`` (in this process: torch is imported once): every catalog state
    with values, draft_input wired as SGLang wires it, the draft's fc output and top-k; with
    ``zoom``, the taps of that decoder layer too (``--zoom layer<zoom>``)."""
    from tensordiff.recorders import train_cli

    p = argparse.ArgumentParser()
    train_cli.add_arguments(p)
    args = p.parse_args(["--model", str(target or model.target), "--prompts", str(prompts_file), "--out", str(out),
                         "--draft", str(model.draft), "--convention", "sglang-llama", "--values", "all",
                         "--dtype", dtype, "--device", "cpu", "--no-progress",
                         *(["--zoom", f"layer{zoom}"] if zoom is not None else [])])
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
# Op-level bugs: one decoder layer of the HF model computes one op wrong (a port's bug)
# ----------------------------------------------------------------------------------------------

#: the op kinds: what decoder layer k computes with the knob s (1, or the value given, is the whole
#: bug a port makes), the tap the zoom into layer k must name first, and the signature it must fit
OP_KINDS: dict[str, tuple[str, str, str]] = {
    "attn-scale": ("the softmax scale times (1 + s) (1/head_dim for 1/sqrt(head_dim) at s = 1/sqrt(head_dim) - 1)",
                   "attn_out", "attn_scale"),
    "activation": ("act(g) = (1 - s) silu(g) + s gelu_tanh(g) (s = 1: GELU-tanh for SiLU)", "mlp_act", "activation"),
    "residual-add": ("the attention output added to the residual times (1 + s) (s = 1: added twice)",
                     "mlp_norm", "residual"),
    "rope-offset": ("the query rotated at position p + s, its keys at p (s = 1: a query at p+1)", "q_rope",
                    "rope_offset"),
}
#: each op kind's sizes for the detection limit (the last one the whole bug of OP_KINDS)
OP_SIZES: dict[str, list[float]] = {
    "attn-scale": [0.003, 0.01, 0.03, 0.1, 0.3, -0.75],
    "activation": [0.003, 0.01, 0.03, 0.1, 0.3, 1.0],
    "residual-add": [0.003, 0.01, 0.03, 0.1, 0.3, 1.0],
    "rope-offset": [0.003, 0.01, 0.03, 0.1, 0.3, 1.0],
}


def _break(m: Any, kind: str, layer: int, s: float, active: list[bool]) -> None:
    """Decoder layer ``layer`` of the loaded HF Llama ``m`` computes ``kind`` of size ``s``."""
    import types

    import torch
    import torch.nn.functional as F

    dec = m.model.layers[layer]
    if kind == "attn-scale":
        # 1/head_dim for 1/sqrt(head_dim) is a factor 1/sqrt(head_dim): s = 1/sqrt(head_dim) - 1
        dec.self_attn.scaling = dec.self_attn.scaling * (1.0 + s)
    elif kind == "activation":
        class Mixed(torch.nn.Module):
            def forward(self, g: torch.Tensor) -> torch.Tensor:
                tanh = F.gelu(g, approximate="tanh")
                return tanh if s == 1.0 else (1.0 - s) * F.silu(g) + s * tanh
        dec.mlp.act_fn = Mixed()
    elif kind == "residual-add":
        def forward(self: Any, hidden_states: Any, attention_mask: Any = None, position_ids: Any = None,
                    past_key_values: Any = None, use_cache: Any = False, position_embeddings: Any = None,
                    **kwargs: Any) -> Any:
            residual = hidden_states
            h, _ = self.self_attn(hidden_states=self.input_layernorm(hidden_states), attention_mask=attention_mask,
                                  position_ids=position_ids, past_key_values=past_key_values, use_cache=use_cache,
                                  position_embeddings=position_embeddings, **kwargs)
            h = residual + h * (1.0 + s)
            return h + self.mlp(self.post_attention_layernorm(h))
        dec.forward = types.MethodType(forward, dec)
    elif kind == "rope-offset":
        attn = dec.self_attn
        inner = attn.forward

        def flagged(*a: Any, **k: Any) -> Any:
            # the zoom recomputes q_rope inside this forward (k_proj's hook): it sees the same rotary
            active[0] = True
            try:
                return inner(*a, **k)
            finally:
                active[0] = False
        attn.forward = flagged
    else:
        raise ValueError(f"no op kind {kind!r}")


def op_bug(kind: str, layer: int, s: float) -> Any:
    """A context in which ``record_hf`` records the model with decoder layer ``layer`` computing
    ``kind`` of size ``s`` (the loaded model edited; the rotary through the modeling module's
    ``apply_rotary_pos_emb``, which the zoom's q_rope recomputation calls too)."""
    import contextlib

    @contextlib.contextmanager
    def ctx() -> Any:
        import torch
        from transformers.models.llama import modeling_llama as ml

        from tensordiff.recorders import train_cli

        load, rot = train_cli._load_model, ml.apply_rotary_pos_emb
        active = [False]
        inv: list[Any] = []

        def loaded(*a: Any, **k: Any) -> Any:
            m = load(*a, **k)
            _break(m, kind, layer, s, active)
            inv[:] = [m.model.rotary_emb.inv_freq.float()]
            return m

        def shifted(q: Any, k: Any, cos: Any, sin: Any, unsqueeze_dim: int = 1) -> Any:
            if not active[0]:
                return rot(q, k, cos, sin, unsqueeze_dim)
            f = torch.cat((inv[0], inv[0])) * s
            c, sn = cos.float(), sin.float()
            c1 = (c * f.cos() - sn * f.sin()).to(cos.dtype)
            s1 = (sn * f.cos() + c * f.sin()).to(sin.dtype)
            return rot(q, k, c1, s1, unsqueeze_dim)[0], rot(q, k, cos, sin, unsqueeze_dim)[1]

        train_cli._load_model = loaded
        if kind == "rope-offset":
            ml.apply_rotary_pos_emb = shifted
        try:
            yield
        finally:
            train_cli._load_model = load
            ml.apply_rotary_pos_emb = rot

    return ctx()


def record_op_bug(model: Model, prompts_file: Path, kind: str, layer: int, s: float, out: Path,
                  zoom: int | None = None, dtype: str = "bfloat16") -> Path:
    with op_bug(kind, layer, s):
        return record_hf(model, prompts_file, dtype, out, zoom=zoom)


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
         "noise": 2.0, "weight": 0.01,
         "attn-scale": 0.1, "activation": 1.0, "residual-add": 0.1, "rope-offset": 0.1}


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
                   seed: int, kinds: list[str] | None = None) -> int:
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
        if kinds and kind not in kinds:
            continue
        worst, where, found, runs = 0.0, "-", 0, 0
        for k in range(1, model.layers + 1):
            name = f"layer{k}"
            if name not in b["x"] and kind in OP_KINDS and k == model.layers:
                name = "final_norm"   # the last decoder layer's output, as HF records it
            if name not in b["x"]:
                continue
            x, xa = b["x"][name].astype(np.float64), _by_rows(a, name, b["rows"][name]).astype(np.float64)
            rms = np.sqrt((x ** 2).mean(1, keepdims=True))
            path = d / f"sweep-{kind}-{k}.h5"
            if kind == "weight":
                ck = perturbed_checkpoint(model, k - 1, m, d / f"sweep-weights-{k}")
                record_hf(model, prompts_file, "bfloat16", path, target=ck)
                shutil.rmtree(ck, ignore_errors=True)
            elif kind in OP_KINDS:   # decoder layer k-1 computes the op wrong: boundary k shows it first
                record_op_bug(model, prompts_file, kind, k - 1, m, path)
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
# Op kinds: detection limits (plain and zoomed) and the false alarms of correct pairs
# ----------------------------------------------------------------------------------------------


def read_states(path: Path, names: list[str]) -> dict[str, Any]:
    """:func:`states`' layout for the tensors ``names`` (taps included) of an HF trace."""
    from tensordiff.trace import TraceReader

    out: dict[str, Any] = {"rows": {}, "x": {}}
    with TraceReader(path) as r:
        for name in names:
            info = r.tensors[name]
            out["rows"][name] = r.token_rows(name).copy()
            out["x"][name] = as_float(r.read_values(name, raw=True), info.dtype)
        out["keys"] = _keys(r)
    return out


def x_noise(ref: Path, ok: Path, bug: Path, name: str) -> float:
    """The bug's error of ``name`` (``bug`` against ``ok``, both bf16) over the pair's own noise
    (``ok`` against the fp32 ``ref``), each rms over tokens of |err_t| / |ref_t|."""
    sr, so, sb = (read_states(p, [name]) for p in (ref, ok, bug))
    a, b = paired(sr, so, name)
    _, x = paired(sr, sb, name)
    return rel_rms(x - b, a) / rel_rms(b - a, a)


def _judge(a: str, b: str) -> dict[str, Any]:
    """One in-process diff: exit code, first divergence (tensor, signature) and headline."""
    from tensordiff.diff import diff_traces

    res = diff_traces(a, b)
    f = res.first_divergence
    det = getattr(f, "details", None) if f is not None else None
    return {"rc": res.exit_code, "first": f.tensor if f is not None else None,
            "signature": getattr(det, "signature", None) if f is not None and f.kind == "signature" else None,
            "divergent": {g.tensor for g in res.findings if g.severity == "divergence"},
            "notes": [(g.tensor, getattr(g.details, "signature", None)) for g in res.findings
                      if g.kind == "signature" and g.severity != "divergence"],
            "headline": res.headline()}


def op_case(d: Path, model: Model, prompts_file: Path, refs: dict[str, Path], kind: str, k: int, s: float,
            ) -> dict[str, Any]:
    """``kind`` of size ``s`` in decoder layer ``k`` of the bf16 side, recorded plain and zoomed
    into layer k, each diffed against the fp32 reference (``refs``: ``fp32``/``bf16`` plain,
    ``fp32-z``/``bf16-z`` zoomed into layer k) in both orders. ``found``/``named``: the plain diff
    has a divergence at / leads with the boundary after layer k; ``op``: the zoomed diff leads with
    the kind's tap; ``sig``: ... and its signature is the kind's."""
    _, tap, sig = OP_KINDS[kind]
    nxt = f"layer{k + 1}" if k + 1 < model.layers else "final_norm"
    op = f"layer{k}.{tap}"
    plain = record_op_bug(model, prompts_file, kind, k, s, d / f"op-{kind}-{k}-{s:g}.h5")
    zoomed = record_op_bug(model, prompts_file, kind, k, s, d / f"op-{kind}-{k}-{s:g}-z.h5", zoom=k)
    out: dict[str, Any] = {"kind": kind, "layer": k, "s": s, "state": nxt, "op": op,
                           "x": x_noise(refs["fp32"], refs["bf16"], plain, nxt),
                           "x_op": x_noise(refs["fp32-z"], refs["bf16-z"], zoomed, op)}
    for order in ("AB", "BA"):
        pa, pb = (refs["fp32"], plain) if order == "AB" else (plain, refs["fp32"])
        za, zb = (refs["fp32-z"], zoomed) if order == "AB" else (zoomed, refs["fp32-z"])
        p, z = _judge(str(pa), str(pb)), _judge(str(za), str(zb))
        out[order] = {"rc": p["rc"], "found": nxt in p["divergent"], "named": p["rc"] == 1 and p["first"] == nxt,
                      "zrc": z["rc"], "op": z["rc"] == 1 and z["first"] == op,
                      "sig": z["rc"] == 1 and z["first"] == op and z["signature"] == sig,
                      "note": (op, sig) in z["notes"],
                      "headline": p["headline"], "zheadline": z["headline"]}
    plain.unlink(missing_ok=True)
    zoomed.unlink(missing_ok=True)
    return out


def zoomed(model: Model, prompts_file: Path, dtype: str, d: Path, k: int) -> Path:
    """The correct trace of ``dtype`` zoomed into decoder layer ``k`` (recorded once per directory)."""
    out = d / f"z{k}-{SHORT[dtype]}.h5"
    return out if out.exists() else record_hf(model, prompts_file, dtype, out, zoom=k)


def correct_op_pairs(d: Path, model: Model, prompts_file: Path, base: dict[str, Path]) -> list[dict[str, Any]]:
    """The correct pairs the op kinds are judged beside, each in both orders: HF fp32/bf16/fp16
    against each other, fp32 recorded twice, and fp32 against bf16 zoomed into every decoder layer
    (every signature tried on honest noise). Each: {note, order, rc, headline}."""
    pairs = [(f"HF {SHORT[x]} vs {SHORT[y]}", base[x], base[y])
             for x, y in (("float32", "bfloat16"), ("float32", "float16"), ("bfloat16", "float16")) if x in base and y in base]
    pairs.append(("HF fp32 vs fp32 recorded again", base["float32"],
                  record_hf(model, prompts_file, "float32", d / "hf-fp32-again.h5")))
    for k in range(model.layers):
        pairs.append((f"HF fp32 vs bf16, zoomed into layer {k}", zoomed(model, prompts_file, "float32", d, k),
                      zoomed(model, prompts_file, "bfloat16", d, k)))
    out = []
    for note, a, b in pairs:
        for order in ("AB", "BA"):
            r = _judge(*((str(a), str(b)) if order == "AB" else (str(b), str(a))))
            out.append({"note": f"{note}, {model.label}", "order": order, "rc": r["rc"], "headline": r["headline"]})
    return out


def _from(rows: list[dict[str, Any]], key: str, x: str) -> str:
    """The smallest ``x`` from which every larger size is ``key`` in both orders ("-": none is)."""
    rows = sorted(rows, key=lambda r: r[x])
    ok = [all(r[o][key] for o in ("AB", "BA")) for r in rows]
    for i in range(len(rows)):
        if all(ok[i:]):
            return fmt_x(rows[i][x])
    return "-"


def op_kinds(d: Path, model: Model, prompts_file: Path, base: dict[str, Path], quick: bool,
             kinds: list[str] | None = None, correct: bool = True) -> dict[str, Any]:
    """The op kinds' detection limits at one depth (decoder layer L/2 - 1) and the correct pairs'
    false alarms; prints the tables, returns the figures."""
    k = max(0, model.layers // 2 - 1)
    t0 = time.monotonic()
    refs = {"fp32": base["float32"], "bf16": base["bfloat16"],
            "fp32-z": zoomed(model, prompts_file, "float32", d, k), "bf16-z": zoomed(model, prompts_file, "bfloat16", d, k)}
    print(f"\n## op kinds: detection limits, decoder layer {k} of {model.label} (bf16 with the bug vs fp32)\n")
    print("plain: the diff of the boundary traces (found: a divergence at the boundary after the layer; named: "
          "the first sentence leads with it); zoom: the diff of traces zoomed into the layer (op: it leads with "
          "the kind's tap; signature: ... and names the kind). x noise: the bug's error of that state (or tap) "
          "over the bf16 pair's own.\n")
    print("| kind | s | x noise (boundary) | plain A B: exit, found, named | plain B A | x noise (tap) | "
          "zoom A B: exit, op, signature | zoom B A | first sentence, zoomed A B |")
    print("|---|---|---|---|---|---|---|---|---|")
    yn = {True: "yes", False: "no"}
    rows: list[dict[str, Any]] = []
    for kind in kinds or list(OP_KINDS):
        sizes = OP_SIZES[kind] if not quick else OP_SIZES[kind][-1:]
        for s in sizes:
            r = op_case(d, model, prompts_file, refs, kind, k, s)
            rows.append(r)
            cells = [f"{r[o]['rc']}, {yn[r[o]['found']]}, {yn[r[o]['named']]}" for o in ("AB", "BA")]
            zc = [f"{r[o]['zrc']}, {yn[r[o]['op']]}, {yn[r[o]['sig']]}" for o in ("AB", "BA")]
            print(f"| {kind} | {s:g} | {fmt_x(r['x'])} | {cells[0]} | {cells[1]} | {fmt_x(r['x_op'])} | {zc[0]} | "
                  f"{zc[1]} | {r['AB']['zheadline'][:160].replace('|', '/')} |", flush=True)
    print(f"\n## op kinds: detection limit per kind, {model.label} (each from the smallest size at which it and every "
          "larger one is named in both orders)\n")
    print("| kind | bug | tap | boundary named from (x noise) | op named from (x noise of the tap) | "
          "signature named from (x noise of the tap) | the whole bug: x noise (boundary, tap), named |")
    print("|---|---|---|---|---|---|---|")
    limits: dict[str, dict[str, str]] = {}
    for kind in dict.fromkeys(r["kind"] for r in rows):
        ks = [r for r in rows if r["kind"] == kind]
        whole = ks[-1]
        w = ", ".join(n for n, key in (("boundary", "named"), ("op", "op"), ("signature", "sig"),
                                       ("a note with the signature (exit 0)", "note"))
                      if all(whole[o][key] for o in ("AB", "BA"))) or "nothing"
        if not all(whole[o]["sig"] or whole[o]["note"] for o in ("AB", "BA")):
            w += "; the signature in " + (", ".join(o for o in ("AB", "BA") if whole[o]["sig"] or whole[o]["note"])
                                          or "neither order")
        limits[kind] = {"boundary": _from(ks, "named", "x"), "op": _from(ks, "op", "x_op"),
                        "signature": _from(ks, "sig", "x_op")}
        print(f"| {kind} | {OP_KINDS[kind][0]} | {OP_KINDS[kind][1]} | {limits[kind]['boundary']} | "
              f"{limits[kind]['op']} | {limits[kind]['signature']} | s = {whole['s']:g}: {fmt_x(whole['x'])}, "
              f"{fmt_x(whole['x_op'])}; {w} |")
    corr = correct_op_pairs(d, model, prompts_file, base) if correct else []
    bad = [c for c in corr if c["rc"] != 0]
    print(f"\nfalse alarms ({model.label}): {sum(c['rc'] == 1 for c in bad)} of {len(corr)} correct-pair runs exit 1 "
          f"({len(corr) // 2} pairs, both orders); {time.monotonic() - t0:.0f} s, load {os.getloadavg()[0]:.2f}")
    for c in bad:
        print(f"  {c['note']} [{c['order']}]: exit {c['rc']}: {c['headline'][:200]}")
    return {"model": model.label, "layer": k, "false_alarms": sum(c["rc"] == 1 for c in bad),
            "no_comparison": sum(c["rc"] not in (0, 1) for c in bad), "correct_runs": len(corr), "limits": limits,
            "cases": [{key: v for key, v in r.items()} for r in rows]}


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
    ap.add_argument("--op-kinds", action="store_true",
                    help="only the op kinds (a bug inside one decoder layer): detection limits plain and zoomed, "
                         "and the false alarms of the correct pairs (plain and zoomed into every layer)")
    ap.add_argument("--kinds", nargs="*", default=[], help="only these kinds (--upstream-sweep, --op-kinds)")
    ap.add_argument("--no-correct", action="store_true", help="--op-kinds without the correct pairs")
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
            if a.quick and not a.op_kinds:   # the attention's fits need 2 x heads x head_dim tokens
                prompts = dict(list(prompts.items())[:3])
        elif a.op_kinds:   # the attention's fits need 2 x heads x head_dim tokens (512 on the random model)
            prompts = default_prompts(10, 64, vocab)
        else:
            prompts = default_prompts(2 if a.quick else 6, 32 if a.quick else 64, vocab)
        pfile = d / "prompts.jsonl"
        pfile.write_text("".join(json.dumps({"id": k, "input_ids": v}) + "\n" for k, v in prompts.items()))
        print(f"model: {model.label} ({model.target}), draft ids {model.aux_ids}; "
              f"{len(prompts)} prompts, {sum(map(len, prompts.values()))} tokens; load {os.getloadavg()[0]:.2f}",
              flush=True)
        unknown = [k for k in a.kinds if k not in SWEEP and k not in OP_KINDS]
        if unknown:
            raise ValueError(f"--kinds: no kind {', '.join(unknown)} (sweep: {', '.join(SWEEP)})")
        base = {dt: record_hf(model, pfile, dt, d / f"hf-{SHORT[dt]}.h5")
                for dt in (DTYPES[:2] if a.upstream_sweep else DTYPES)}
        st = {dt: states(p) for dt, p in base.items()}
        if a.upstream_sweep:
            return upstream_sweep(d, model, pfile, base, st, a.seed, a.kinds)
        if a.op_kinds:
            figures = op_kinds(d, model, pfile, base, a.quick, [k for k in a.kinds if k in OP_KINDS] or None,
                               correct=not a.no_correct)
            res.write(a.json, figures)
            return 0
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
