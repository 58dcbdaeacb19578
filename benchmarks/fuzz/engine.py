"""The slow tier: bugs injected on the engine side of a real SGLang run, judged against the HF
train side.

The serve side is EAGLE-3 in real SGLang on the CPU, set up as the engine tests set it up
(tests/sglang_support.py: ``SGLANG_USE_CPU_ENGINE=1``, the sgl_kernel stand-in, intel_amx, bf16),
on the trained tiny Llama and its draft; the train side is ``tensordiff record train --from-serve``
the engine's outputs, in float32, wired as SGLang wires the draft (sglang-llama). A bug is a change
of what the engine is given, never of a trace: a weight of the served checkpoint scaled or noised,
the served config's rope theta or RMS-norm eps, or the served draft's aux ids one lower (the
layer-id convention shifted: SGLang captures one boundary earlier than the trainer packed).

Ground truth comes from the generator: the engine run with and without the bug, aligned row by row
by (sequence, position, token), the first tensor in forward order that both sides record whose
values changed (by more than float32 reassociation: ``REASSOCIATION``), and the size there in
units of the noise the correct serve run shows against the train side (rms over rows of
|B_bug - B| / |A| over rms of |B - A| / |A|). Sizes are not calibrated (each try is an engine
start): the magnitude is drawn log-uniform over a range that spans about 0.3x to 30x of the bf16
noise, and the size reported is the one measured. The judge is the fast tier's
(benchmarks/fuzz/scenario.py ``judge``).
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from . import scenario as S
from .bugs import Place
from .catalog import ENGINE_KINDS

REPO = Path(__file__).resolve().parents[2]
MODEL = "trained-llama"
LAYERS = 8
DTYPE_A, DTYPE_B = "float32", "bfloat16"
MODES = ("full", "sketch")          # every tensor with values on both sides; each recorder's own choice
PROMPTS, LENGTH, MAX_NEW = 3, 32, 4
OPS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

KINDS = ENGINE_KINDS


@dataclass(frozen=True)
class EngineScenario:
    seed: int
    kind: str
    mode: str
    order: str
    layer: int
    op: str
    mag: float

    def as_scenario(self) -> S.Scenario:
        """The fast tier's scenario record, for its judge."""
        return S.Scenario(self.seed, MODEL, DTYPE_A, DTYPE_B, self.mode, self.order, self.kind,
                          Place(layer=self.layer, op=self.op), float("nan"))


def draw(seed: int, kinds: tuple[str, ...] = tuple(KINDS)) -> EngineScenario:
    rng = np.random.default_rng(seed)
    kind = str(rng.choice(list(kinds)))
    mode = str(rng.choice(list(MODES)))
    order = str(rng.choice(["AB", "BA"]))
    layer = int(rng.integers(0, LAYERS))
    op = str(rng.choice(list(OPS)))
    lo_hi = KINDS[kind]
    mag = float(np.exp(rng.uniform(np.log(lo_hi[0]), np.log(lo_hi[1])))) if lo_hi else 1.0
    if kind in ("rope_theta", "norm_eps", "aux_ids", "none"):
        layer = 0 if kind in ("rope_theta", "norm_eps") else layer   # every layer: the first is the place
    return EngineScenario(seed, kind, mode, order, layer, op, mag)


# ----------------------------------------------------------------------------------------------
# What the engine is given


def _tests() -> Any:
    if str(REPO / "tests") not in sys.path:
        sys.path.insert(0, str(REPO / "tests"))
    import sglang_support as sup
    return sup


def models() -> dict[str, Any]:
    """The trained tiny Llama, its draft and the first prompts (cut to LENGTH tokens)."""
    sup = _tests()
    got = sup.trained_models(0)
    if got is None:
        raise RuntimeError("no trained tiny model (scripts/train_tiny_models.py)")
    prompts = {k: v[:LENGTH] for k, v in list(got["prompts"].items())[:PROMPTS]}
    return {"target": Path(got["target"]), "draft": Path(got["draft"]), "prompts": prompts}


def served(sc: EngineScenario, target: Path, draft: Path, work: Path) -> tuple[Path, Path]:
    """The (target, draft) directories the engine is given: copies carrying the bug."""
    if sc.kind == "none":
        return target, draft
    if sc.kind == "aux_ids":
        d = work / "draft"
        shutil.copytree(draft, d)
        cfg = json.loads((d / "config.json").read_text())
        ec = cfg["eagle_config"]
        ec["eagle_aux_hidden_state_layer_ids"] = [int(i) - 1 for i in ec["eagle_aux_hidden_state_layer_ids"]]
        (d / "config.json").write_text(json.dumps(cfg, indent=2))
        return target, d
    t = work / "target"
    shutil.copytree(target, t)
    if sc.kind in ("rope_theta", "norm_eps"):
        cfg = json.loads((t / "config.json").read_text())
        if sc.kind == "rope_theta":
            rp = cfg.get("rope_parameters") or {}
            theta = float(rp.get("rope_theta", cfg.get("rope_theta", 10000.0))) * (1 + sc.mag)
            if "rope_parameters" in cfg:
                cfg["rope_parameters"]["rope_theta"] = theta
            cfg["rope_theta"] = theta
        else:
            cfg["rms_norm_eps"] = sc.mag
        (t / "config.json").write_text(json.dumps(cfg, indent=2))
        return t, draft
    import torch
    from safetensors.torch import load_file, save_file

    part = "self_attn" if sc.op.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
    key = f"model.layers.{sc.layer}.{part}.{sc.op}.weight"
    for f in sorted(t.glob("*.safetensors")):
        sd = load_file(str(f))
        if key not in sd:
            continue
        w = sd[key].float()
        if sc.kind == "weight_scale":
            w = w * (1 + sc.mag)
        else:
            g = torch.Generator().manual_seed(sc.seed % 2**31)
            w = w + sc.mag * w.std() * torch.randn(w.shape, generator=g)
        sd[key] = w.to(sd[key].dtype).contiguous()
        save_file(sd, str(f), metadata={"format": "pt"})
        return t, draft
    raise RuntimeError(f"{key} is in no checkpoint file of {target}")


def serve(target: Path, draft: Path, prompts: dict[str, list[int]], out: Path, name: str, mode: str) -> dict:
    return _tests().record_eagle_serve(target, draft, prompts, out, name, dtype=DTYPE_B, max_new_tokens=MAX_NEW,
                                       values="all" if mode == "full" else None)


def train(target: Path, draft: Path, outputs: str, out: Path, mode: str) -> Path:
    """``tensordiff record train --from-serve`` in this process, the trainer's (correct) model and
    draft."""
    from tensordiff.cli import main

    argv = ["record", "train", "--model", str(target), "--from-serve", outputs, "--draft", str(draft),
            "--convention", "sglang-llama", "--dtype", DTYPE_A, "--device", "cpu", "--no-progress", "--out", str(out)]
    if mode == "full":
        argv += ["--values", "all"]
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        rc = main(argv)
    if rc != 0:
        raise RuntimeError(f"record train failed ({rc}): {err.getvalue()[-2000:]}")
    return out


# ----------------------------------------------------------------------------------------------
# Ground truth, row by row


@dataclass
class Rows:
    """A trace's tensors keyed by token row: (name, slot) -> {(seq, position, token): row vector}."""
    order: list[tuple[float, str, int | None]]
    vals: dict[tuple[str, int | None], dict[tuple[str, int, int], np.ndarray]]
    labels: dict[int, str]


def read_rows(path: str | Path, sketch: set[str] | None = None) -> Rows:
    """``sketch``: tensors read as sketches (where the other side keeps only sketches)."""
    from tensordiff.trace import TraceReader
    from tensordiff.vocab import state_order

    order: list[tuple[float, str, int | None]] = []
    vals: dict[tuple[str, int | None], dict[tuple[str, int, int], np.ndarray]] = {}
    labels: dict[int, str] = {}
    with TraceReader(path) as r:
        n = r.num_layers or LAYERS
        tok = r.tokens
        seqs = list(r.sequences)
        for name, info in r.tensors.items():
            if info.kind not in ("packed", "boundary", "final_norm") and name != "target_topk":
                continue
            if info.kind in ("boundary", "final_norm") and (not info.has_values or (sketch and name in sketch)):
                v = r.read_sketch(name)
            else:
                v = r.read_values(name)
            rows = r.token_rows(name)
            keys = [(seqs[int(tok["seq"][i])], int(tok["position"][i]), int(tok["token"][i])) for i in rows]
            if info.kind == "packed":
                if info.role != "draft_input":
                    continue
                labels = dict(enumerate(info.slot_labels or []))
                w = int(info.slot_width or info.width)
                for s, lab in labels.items():
                    order.append((state_order(lab, n) + 0.25, name, s))
                    vals[(name, s)] = dict(zip(keys, np.asarray(v[:, s * w:(s + 1) * w], dtype=np.float64)))
                continue
            key = state_order(name, n) if info.kind != "other" else state_order("final_norm", n) + 0.5
            order.append((key, name, None))
            vals[(name, None)] = dict(zip(keys, np.asarray(v, dtype=np.float64).reshape(len(rows), -1)))
    order.sort()
    return Rows(order, vals, labels)


def sketch_only(path: str | Path) -> set[str]:
    from tensordiff.trace import TraceReader

    with TraceReader(path) as r:
        return {n for n, i in r.tensors.items() if i.kind in ("boundary", "final_norm") and not i.has_values}


#: a change smaller than this (rms over rows, relative to A) is not the bug's: a sketch the engine
#: computes over a batch of another shape (the bug changes which rows are batched together) differs
#: in float32 rounding, about 1e-8 relative, where the bf16 serve noise is about 4e-3
REASSOCIATION = 1e-6


def _changed(c: dict[tuple[str, int, int], np.ndarray], b: dict[tuple[str, int, int], np.ndarray],
             ref: dict[tuple[str, int, int], np.ndarray]) -> bool:
    common = [k for k in c if k in b]
    diff = [k for k in common if not np.array_equal(c[k], b[k])]
    if not diff:
        return False
    rows = [k for k in common if k in ref]
    if not rows:
        return True
    va = np.stack([ref[k] for k in rows])
    return S.rel_rms(np.stack([b[k] for k in rows]) - np.stack([c[k] for k in rows]), va) > REASSOCIATION


def truth(a: Rows, bc: Rows, bb: Rows) -> S.Truth:
    """The first tensor both sides record whose values the bug changed, on the rows both engine
    runs computed (a bug that changes a generated token changes which rows follow it), and its size."""
    for key, name, s in bc.order:
        if (name, s) not in a.vals or (name, s) not in bb.vals:
            continue
        ref = a.vals[(name, s)]
        if not _changed(bc.vals[(name, s)], bb.vals[(name, s)], ref):
            continue
        slots = []
        if s is not None:
            slots = [t for (_, nm, t) in bc.order if nm == name and t is not None and (nm, t) in bb.vals
                     and _changed(bc.vals[(nm, t)], bb.vals[(nm, t)], a.vals.get((nm, t), {}))]
        lab = bc.labels.get(s) if s is not None else name
        c = bc.vals[(name, s)]
        rows = [k for k in c if k in bb.vals[(name, s)] and k in ref]
        if not rows:
            return S.Truth(name, slots, lab, key, float("nan"), float("nan"))
        va = np.stack([ref[k] for k in rows])
        noise = S.rel_rms(np.stack([c[k] for k in rows]) - va, va)
        effect = max(S.rel_rms(np.stack([bb.vals[(name, t)][k] for k in rows])
                               - np.stack([bc.vals[(name, t)][k] for k in rows]), va)
                     for t in (slots or [s]))
        return S.Truth(name, slots, lab, key, noise, effect)
    return S.Truth(None, [], None, math.inf, 0.0, 0.0)


# ----------------------------------------------------------------------------------------------
# Running a scenario


class Engine:
    """One process's engine tier: the models, and the correct serve run and its train side, recorded
    once per mode."""

    def __init__(self, work: Path | None = None) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="fuzz-engine-", dir=work)
        self.root = Path(self._tmp.name)
        self.m = models()
        self.base: dict[str, dict[str, Any]] = {}
        self.engine_runs = 0

    def close(self) -> None:
        self._tmp.cleanup()

    def _base(self, mode: str) -> dict[str, Any]:
        if mode not in self.base:
            d = self.root / f"base-{mode}"
            run = serve(self.m["target"], self.m["draft"], self.m["prompts"], d, "serve", mode)
            self.engine_runs += 1
            a = train(self.m["target"], self.m["draft"], run["outputs"], d / "train.h5", mode)
            sk = sketch_only(run["trace"])
            self.base[mode] = {"serve": run["trace"], "train": str(a), "sketch": sk,
                               "rb": read_rows(run["trace"]), "ra": read_rows(a, sk)}
        return self.base[mode]

    def execute(self, sc: EngineScenario) -> S.Result:
        base = self._base(sc.mode)
        d = self.root / f"s{sc.seed}"
        d.mkdir()
        try:
            if sc.kind == "none":
                pa, pb, tr = base["train"], base["serve"], S.Truth(None, [], None, math.inf, 0.0, 0.0)
            else:
                target, draft = served(sc, self.m["target"], self.m["draft"], d)
                run = serve(target, draft, self.m["prompts"], d, "serve", sc.mode)
                self.engine_runs += 1
                pa = str(train(self.m["target"], self.m["draft"], run["outputs"], d / "train.h5", sc.mode))
                pb = run["trace"]
                tr = truth(base["ra"], base["rb"], read_rows(pb))
            x_, y_ = (pa, pb) if sc.order == "AB" else (pb, pa)
            rc, doc = S.run_diff(Path(x_), Path(y_))
            if sc.kind == "none" and rc == 0:   # a correct pair costs no engine start: both orders
                rc, doc = S.run_diff(Path(y_), Path(x_))
            res = S.judge(sc.as_scenario(), tr, sc.mag, rc, doc, base["ra"].labels)
            res.extra["tier"] = "slow"
            return res
        finally:
            shutil.rmtree(d, ignore_errors=True)
