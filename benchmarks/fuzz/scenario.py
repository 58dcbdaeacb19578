"""One scenario, drawn from its seed alone: its recordings, its ground truth and the judge's outcome.

Ground truth comes from the generator only: B is recorded with and without the bug, and the first
tensor (in forward order; a packed tensor by slot) whose stored bytes differ is the injected place.
Its size is the bug's effect there, rms over tokens of |B_bug - B| / |A|, over the noise the
correct pair shows there, rms over tokens of |B - A| / |A| (the values, or the sketches where the
catalog keeps only sketches). MoE routing tables are left out of the place: the tool reports
routing as a note, never as a divergence.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from . import bugs
from . import models as M

SIZE_LO, SIZE_HI = 0.3, 30.0
NOISE_FLOOR = 2.0 ** -24            # a pair bit-identical at the place: float32's half-ulp, relative
TOKEN_KINDS = {"token_shift", "token_mismatch", "gap", "pairing"}
WIRING_CLAIMS = {"slot_identity", "label_mismatch", "pairing", "token_shift", "token_mismatch", "gap"}
NUMERIC_KINDS = {"numeric", "nonfinite", "signature"}
OUTCOMES = ("named", "found_elsewhere", "agree", "wrong", "false_alarm")


@dataclass(frozen=True)
class Scenario:
    seed: int
    model: str
    dtype_a: str
    dtype_b: str
    mode: str
    order: str              # "AB": `diff A B`; "BA": `diff B A`
    kind: str
    place: bugs.Place
    target: float           # the drawn size in noise units (knob kinds)

    def line(self) -> str:
        return (f"seed {self.seed}: {self.kind} on {self.model} {self.dtype_a}/{self.dtype_b} {self.mode} {self.order}, "
                f"layer {self.place.layer} {self.place.op} slot {self.place.slot} seq {self.place.seq} pos {self.place.pos}")


def draw(seed: int, kinds: tuple[str, ...] = bugs.KINDS, models: tuple[str, ...] = M.MODELS) -> Scenario:
    rng = np.random.default_rng(seed)
    kind = str(rng.choice(list(kinds)))
    allowed = [m for m in models if not (kind == "activation" and m == "mixtral")]
    model = str(rng.choice(allowed)) if allowed else models[0]
    da, db = M.DTYPE_PAIRS[int(rng.integers(0, len(M.DTYPE_PAIRS)))]
    mode = str(rng.choice(list(M.MODES)))
    order = str(rng.choice(["AB", "BA"]))
    place = bugs.draw_place(kind, M.model(model), rng)
    target = float(np.exp(rng.uniform(np.log(SIZE_LO), np.log(SIZE_HI))))
    return Scenario(seed, model, da, db, mode, order, kind, place, target)


# ----------------------------------------------------------------------------------------------
# Reading the recordings back


@dataclass
class Rec:
    """Every tensor of a trace as bytes (for the bit-exact comparison) and float rows (for sizes)."""
    order: list[tuple[float, str, int | None]]          # (forward key, tensor, slot)
    raw: dict[tuple[str, int | None], bytes]
    vals: dict[tuple[str, int | None], np.ndarray]
    labels: dict[int, str]
    tokens: bytes


def read(path: Path) -> Rec:
    import h5py

    from tensordiff.trace import TraceReader
    from tensordiff.vocab import state_order

    order: list[tuple[float, str, int | None]] = []
    raw: dict[tuple[str, int | None], bytes] = {}
    vals: dict[tuple[str, int | None], np.ndarray] = {}
    labels: dict[int, str] = {}
    with TraceReader(path) as r:
        n = r.num_layers or 0
        for name, info in r.tensors.items():
            if name.startswith("moe_routing"):
                continue
            if info.kind == "packed":
                labels = dict(enumerate(info.slot_labels or []))
                v = r.read_values(name)
                w = int(info.slot_width or info.width)
                for s, lab in labels.items():
                    order.append((state_order(lab, n) + 0.25, name, s))
                    vals[(name, s)] = v[:, s * w:(s + 1) * w]
                    raw[(name, s)] = np.ascontiguousarray(r.read_values(name, raw=True)[:, s * w:(s + 1) * w]).tobytes()
                continue
            if info.kind in ("boundary", "final_norm"):
                key = state_order(name, n)
                v = r.read_values(name) if info.has_values else r.read_sketch(name)
                vals[(name, None)] = v
            else:
                key = state_order("final_norm", n) + 0.5
            order.append((key, name, None))
    with h5py.File(path, "r") as f:
        for _, name, sl in order:
            if sl is None:
                g = f["tensors"][name]
                raw[(name, None)] = b"".join(np.ascontiguousarray(g[k][...]).tobytes() for k in sorted(g)
                                             if isinstance(g[k], h5py.Dataset))
        tokens = np.ascontiguousarray(f["tokens"][...]).tobytes()
    order.sort()
    return Rec(order, raw, vals, labels, tokens)


def rel_rms(err: np.ndarray, ref: np.ndarray) -> float:
    e = np.linalg.norm(err.astype(np.float64), axis=1)
    n = np.linalg.norm(ref.astype(np.float64), axis=1)
    ok = n > 0
    return float(np.sqrt(np.mean((e[ok] / n[ok]) ** 2))) if ok.any() else float("nan")


@dataclass
class Truth:
    tensor: str | None              # None: nothing changed; "tokens": the token table
    slots: list[int]                # changed slots of a packed tensor
    label: str | None               # the state the place is (a slot's label)
    key: float                      # forward-order key
    noise: float
    effect: float

    @property
    def x(self) -> float:
        return self.effect / max(self.noise, NOISE_FLOOR) if math.isfinite(self.effect) else float("nan")


def truth(a: Rec, bc: Rec, bb: Rec) -> Truth:
    """The first tensor B's bug changed, and its size at that place."""
    if bc.tokens != bb.tokens:
        return Truth("tokens", [], None, -1.0, float("nan"), float("inf"))
    for key, name, s in bc.order:
        if bc.raw.get((name, s)) != bb.raw.get((name, s)):
            slots = [t for (_, nm, t) in bc.order if nm == name and t is not None
                     and bc.raw[(nm, t)] != bb.raw.get((nm, t))] if s is not None else []
            lab = bc.labels.get(s) if s is not None else name
            va = a.vals.get((name, s))
            if va is None:
                return Truth(name, slots, lab, key, float("nan"), float("nan"))
            noise = rel_rms(bc.vals[(name, s)] - va, va)
            where: list[int | None] = list(slots) or [s]
            effect = max(rel_rms(bb.vals[(name, t)] - bc.vals[(name, t)], va) for t in where)
            return Truth(name, slots, lab, key, noise, effect)
    return Truth(None, [], None, math.inf, 0.0, 0.0)


# ----------------------------------------------------------------------------------------------
# Running a scenario


@dataclass
class Result:
    seed: int
    kind: str
    family: str
    model: str
    dtypes: str
    mode: str
    order: str
    layer: int
    x: float                        # size in noise units (nan: not sized, e.g. a token bug)
    magnitude: float
    truth: str
    outcome: str
    miss: bool
    rc: int
    first: str                      # the first divergence: tensor[slot] kind
    headline: str
    why: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


def run_diff(a: Path, b: Path) -> tuple[int, dict[str, Any]]:
    """``tensordiff diff A B --json`` in this process (the CLI's main, its stdout captured)."""
    from tensordiff.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["diff", str(a), str(b), "--json"])
    try:
        return rc, json.loads(out.getvalue())
    except ValueError:
        return rc, {"headline": (err.getvalue() or out.getvalue()).strip()[-300:]}


def _record_b(sc: Scenario, m: M.Model, path: Path, mag: float | None) -> Path:
    from tensordiff.conventions import plan_draft_input

    edit, inj = bugs.inject(sc.kind if mag is not None else "none", m, sc.place, mag or 0.0)
    net = M.side_model(m, sc.dtype_b, "sdpa", edit)
    plan = plan_draft_input("hf", list(m.aux_ids), m.layers) if mag is not None and sc.kind == "aux_ids" else None
    return M.record(m, net, path, sc.mode, inj, plan=plan)


_BASE: dict[tuple[str, str, str, str], tuple[Path, Rec, Path, Rec]] = {}
_BASE_DIR: list[tempfile.TemporaryDirectory[str]] = []


def _base(sc: Scenario, m: M.Model) -> tuple[Path, Rec, Path, Rec]:
    """A and B without the bug, recorded once per (model, dtypes, mode) in a process: deterministic
    on the CPU, so a second recording would be the same bytes."""
    key = (sc.model, sc.dtype_a, sc.dtype_b, sc.mode)
    if key not in _BASE:
        if not _BASE_DIR:
            _BASE_DIR.append(tempfile.TemporaryDirectory(prefix="fuzz-base-"))
        d = Path(_BASE_DIR[0].name) / "-".join(key)
        d.mkdir()
        pa = M.record(m, M.side_model(m, sc.dtype_a, "eager"), d / "a.h5", sc.mode)
        pc = _record_b(sc, m, d / "b-correct.h5", None)
        _BASE[key] = (pa, read(pa), pc, read(pc))
    return _BASE[key]


def execute(sc: Scenario, work: Path | None = None) -> Result:
    tmp = tempfile.TemporaryDirectory(prefix="fuzz-", dir=work)
    d = Path(tmp.name)
    try:
        m = M.model(sc.model)
        pa, ra, pc, rc_ = _base(sc, m)
        mag = 0.0
        if sc.kind == "none":
            pb, tr = pc, Truth(None, [], None, math.inf, 0.0, 0.0)
        else:
            mag = bugs.START.get(sc.kind, 1e-2) if sc.kind in bugs.KNOB else 1.0
            pb = _record_b(sc, m, d / "b.h5", mag)
            tr = truth(ra, rc_, read(pb))
            if sc.kind in bugs.KNOB:
                for _ in range(2):     # scale the knob to the drawn size (the effect is near linear in it)
                    if tr.tensor is None or not math.isfinite(tr.x) or tr.x <= 0:
                        mag *= 30.0
                    elif abs(math.log(tr.x / sc.target)) < 0.15:
                        break
                    else:
                        mag *= sc.target / tr.x
                    if sc.kind in bugs.CAPPED:
                        mag = min(mag, 1.0)
                    pb = _record_b(sc, m, d / "b.h5", mag)
                    tr = truth(ra, rc_, read(pb))
        x_, y_ = (pa, pb) if sc.order == "AB" else (pb, pa)
        rc, doc = run_diff(x_, y_)
        return judge(sc, tr, mag, rc, doc, ra.labels)
    finally:
        tmp.cleanup()


# ----------------------------------------------------------------------------------------------
# The judge


def _first(doc: dict[str, Any]) -> dict[str, Any]:
    return doc.get("first_divergence") or {}


def judge(sc: Scenario, tr: Truth, mag: float, rc: int, doc: dict[str, Any], labels: dict[int, str]) -> Result:
    from tensordiff.vocab import state_order

    first = _first(doc)
    ftensor, fslot, fkind = first.get("tensor"), first.get("slot"), first.get("kind")
    outcome_b = (first.get("details") or {}).get("outcome")
    fam = bugs.FAMILY[sc.kind]
    desc = f"{ftensor or '-'}{'' if fslot is None else f'[{fslot}]'} {fkind or ''}{f' ({outcome_b})' if outcome_b else ''}"
    res = Result(sc.seed, sc.kind, fam, sc.model, f"{sc.dtype_a}/{sc.dtype_b}", sc.mode, sc.order, sc.place.layer,
                 tr.x, mag, _truth_str(tr), "", False, rc, desc.strip(), str(doc.get("headline", ""))[:240],
                 extra={"noise": tr.noise, "effect": tr.effect})
    if rc not in (0, 1):
        res.outcome, res.miss, res.why = "wrong", True, f"exit {rc}"
        return res
    if tr.tensor is None:            # a correct pair, or a bug that changed no recorded tensor
        if rc == 0:
            res.outcome = "agree"
        else:
            res.outcome, res.miss, res.why = "false_alarm", True, "a pair with no recorded difference exits 1"
        return res
    if rc == 0:
        res.outcome = "agree"
        big = tr.tensor == "tokens" or (math.isfinite(tr.x) and tr.x >= 3.0)   # a place with no values is not sized
        res.miss = big
        res.why = "agree at 3x the noise or more" if big else ""
        return res
    # where the first divergence is, in forward order
    n = M.model(sc.model).layers
    if tr.tensor == "tokens":
        if fkind in TOKEN_KINDS:
            res.outcome = "named"
        else:
            res.outcome = "found_elsewhere"
        return res
    if fkind in TOKEN_KINDS or ftensor is None:
        res.outcome, res.miss, res.why = "wrong", True, "a token-level cause for a bug in the values"
        return res
    if ftensor == "draft_input" and fslot is not None:
        flabel = labels.get(int(fslot), "")
        fkey = state_order(flabel, n) + 0.25
    elif ftensor in ("embed", "final_norm") or str(ftensor).startswith("layer"):
        flabel, fkey = str(ftensor), state_order(str(ftensor), n)
    else:
        flabel, fkey = str(ftensor), state_order("final_norm", n) + 0.5
    at_place = ((ftensor == tr.tensor and (not tr.slots or fslot in tr.slots))
                or (tr.tensor != "draft_input" and flabel == tr.label))
    if not at_place and fkey < tr.key:
        res.outcome, res.miss, res.why = "wrong", True, "the first divergence is upstream of the bug (bit-identical there)"
        return res
    if fam == "wiring":
        compatible = fkind in {"slot_identity", "label_mismatch", "pairing"} or (
            fkind in NUMERIC_KINDS and sc.kind in ("norm_before_pack", "mixed_state"))
        res.outcome = "named" if at_place and compatible else "found_elsewhere"
        return res
    # a numeric bug: weights, config, code
    if fkind in WIRING_CLAIMS:
        res.outcome, res.miss, res.why = "wrong", True, f"a wiring claim ({fkind}) for a numeric bug"
        return res
    res.outcome = "named" if at_place and fkind in NUMERIC_KINDS else "found_elsewhere"
    return res


def _truth_str(tr: Truth) -> str:
    if tr.tensor is None:
        return "-"
    if tr.tensor == "tokens":
        return "tokens"
    return f"{tr.tensor}{'' if not tr.slots else tr.slots}"


def as_dict(r: Result) -> dict[str, Any]:
    d = asdict(r)
    d["x"] = None if not math.isfinite(r.x) else round(r.x, 3)
    return d
