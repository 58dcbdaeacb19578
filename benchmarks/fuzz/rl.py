"""The RL tier: a trainer/rollout pair drawn from its seed, recorded as an RL framework records it,
judged on ``tensordiff triage --json`` against the generator's own ground truth.

The rollout: an HF model standing in for the engine (tests/rl_support.py's way: a prefill pass,
then one KV-cache decode pass per token), sampling at temperature T with a seeded generator, the
engine-side RL records (``sampled_logprob`` as the engine returns it, ``sampling``,
``/weights/step_<k>``). The trainer: the same tokens re-scored by ``TrainerRecorder`` (one
sequence per forward, or one left-padded micro-batch) or by ``tensordiff record train
--from-serve``, always float32. The bug is injected on the side where it lives (catalog.RL_KINDS).

Ground truth is the bug's effect on the sampled tokens' log-probs: each side computed with and
without the bug on the rollout's own tokens (a rollout bug: the correct engine teacher-forced on
the buggy engine's tokens, same prefill/decode passes), the effect the median |logprob with -
without| over the sampled tokens (mask_lost_one_seq: over its sequence's), the noise the median
|rollout - trainer| of the correct pair on the same tokens. A token bug (retokenized, missing_bos) is not sized and must be found.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import math
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch

from . import models as M
from .catalog import RL_ACCEPT, RL_DTYPE_PAIRS, RL_FAMILY, RL_KINDS

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))

import rl_support as rs  # noqa: E402  (the RL test helpers: the weight update, the prefill re-run)

RL_MODELS = M.MODELS
SEQS, NEW_TOKENS, BOS = 6, 8, 1
LEN_LO, LEN_HI = 12, 32          # prompt lengths (before the BOS), drawn per scenario: the batch's padding
NOISE_FLOOR = 2.0 ** -24
TRAINERS = ("sequence", "batch", "from-serve")   # TrainerRecorder per sequence / padded batch; record train
UPDATE = "update_weights_from_tensor"


@dataclass(frozen=True)
class Scenario:
    seed: int
    model: str
    dtype_rollout: str
    kind: str
    order: str                  # "TR": `triage TRAIN ROLLOUT`; "RT": `triage ROLLOUT TRAIN`
    trainer: str                # one of TRAINERS
    replay: bool                # the engine's prefill re-run given as the third trace
    temperature: float          # the rollout's sampling temperature
    lengths: tuple[int, ...]    # prompt lengths
    knob: float                 # the kind's magnitude (see catalog.RL_KINDS); 0 where none
    variant: str                # stale_param: "one" / "all"; decode_kv_precision: the K/V dtype
    target: int                 # the sequence (mask_lost_one_seq, retokenized) or parameter index (stale_param)

    def line(self) -> str:
        return (f"seed {self.seed}: {self.kind} on {self.model} rollout {self.dtype_rollout} T {self.temperature} "
                f"trainer {self.trainer}{' +replay' if self.replay else ''} {self.order} knob {self.knob:.3g} "
                f"{self.variant}")


def draw(seed: int, kinds: tuple[str, ...] = tuple(RL_KINDS), models: tuple[str, ...] = RL_MODELS) -> Scenario:
    rng = np.random.default_rng(seed)
    kind = str(rng.choice(list(kinds)))
    model = str(rng.choice(list(models)))
    dr = RL_DTYPE_PAIRS[int(rng.integers(0, len(RL_DTYPE_PAIRS)))][0]
    order = str(rng.choice(["TR", "RT"]))
    trainer = {"mask_lost_one_seq": "batch", "retokenized": "sequence",
               "missing_bos": "sequence"}.get(kind) or str(rng.choice(list(TRAINERS)))
    replay = kind in ("none", "decode_kv_precision") and bool(rng.integers(0, 2))
    temperature = float(rng.choice([0.6, 0.7, 1.0]))
    lengths = tuple(int(x) for x in rng.integers(LEN_LO, LEN_HI + 1, SEQS))
    if kind == "mask_lost_one_seq" and len(set(lengths)) == 1:
        lengths = (LEN_LO,) + lengths[1:]
    rng_knob = RL_KINDS[kind][2]
    knob = float(np.exp(rng.uniform(np.log(rng_knob[0]), np.log(rng_knob[1])))) if rng_knob else 0.0
    if kind == "top_k":
        knob = float(round(knob))
    if kind == "temperature":
        knob = knob if rng.integers(0, 2) else -knob
    variant = {"stale_param": str(rng.choice(["one", "all"])),
               "decode_kv_precision": str(rng.choice(["bfloat16", "float8_e4m3fn"]))}.get(kind, "")
    if kind == "mask_lost_one_seq":     # a sequence with padding (shorter than the longest)
        target = int(rng.choice([i for i, n in enumerate(lengths) if n < max(lengths)]))
    else:
        target = int(rng.integers(0, 1 << 30))
    return Scenario(seed, model, dr, kind, order, trainer, replay, temperature, lengths, knob, variant, target)


# ----------------------------------------------------------------------------------------------
# The sides


@lru_cache(maxsize=None)
def _base_prompts(name: str) -> tuple[tuple[int, ...], ...]:
    if name == "trained-llama":
        import trained

        return tuple(tuple(p) for p in trained.prompts()[:SEQS])
    rng = np.random.default_rng(100 + M.MODELS.index(name))
    return tuple(tuple(int(x) for x in rng.integers(2, 256, LEN_HI)) for _ in range(SEQS))


def prompts(sc: Scenario) -> list[list[int]]:
    """Each prompt cut to its drawn length, after a BOS (as an engine's tokenizer adds one)."""
    return [[BOS, *p[:n]] for p, n in zip(_base_prompts(sc.model), sc.lengths)]


_DIRS: list[tempfile.TemporaryDirectory[str]] = []


def _workdir() -> Path:
    if not _DIRS:
        _DIRS.append(tempfile.TemporaryDirectory(prefix="fuzz-rl-"))
    return Path(_DIRS[0].name)


@lru_cache(maxsize=None)
def model_dir(name: str) -> Path:
    """A checkpoint of the model's float32 master (``record train --model``)."""
    if name == "trained-llama":
        import trained

        return Path(trained.target_dir())
    return rs.save(M.model(name).master, _workdir() / f"{name}-master")


def _cast(net: Any, dtype: str) -> Any:
    x = copy.deepcopy(net).to(M.TORCH_DTYPES[dtype]).eval()
    x.set_attn_implementation("sdpa")
    return x


def _processed(z: torch.Tensor, t: float, top_p: float, top_k: int) -> torch.Tensor:
    """The logits the engine samples from at temperature ``t`` after its top-k / top-p filter."""
    z = z / t
    if top_k > 0:
        z = torch.where(z >= torch.topk(z, top_k).values[-1], z, torch.tensor(-torch.inf))
    if top_p < 1.0:
        p, idx = torch.sort(torch.softmax(z, -1), descending=True)
        keep = torch.cumsum(p, -1) - p < top_p      # the smallest set whose mass reaches top_p
        cut = torch.full_like(z, -torch.inf)
        cut[idx[keep]] = z[idx[keep]]
        z = cut
    return z


def generate(net: Any, prompt_ids: list[list[int]], *, temperature: float, seed: int, top_p: float = 1.0,
             top_k: int = -1, kv_dtype: torch.dtype | None = None, forced: list[list[int]] | None = None,
             out: Path | None = None, weight_steps: list[tuple[Any, str]] | None = None,
             path: Path | None = None) -> tuple[list[list[int]], list[list[float]], list[list[float]]]:
    """The engine: per prompt a prefill pass, then one KV-cache decode pass per token, sampling
    from the processed distribution (``forced``: the tokens to feed instead, teacher-forced);
    ``kv_dtype``: the cache rounded to it after each pass, so only the decode passes read it
    rounded. Recorded into ``out`` as tests/rl_support.rollout records (the log-prob returned:
    processed). Returns per sequence the new tokens, their processed and their plain
    (``log_softmax(z / T)``) log-probs."""
    from transformers import DynamicCache

    from tensordiff import conventions as cv
    from tensordiff.recorders.core import Recorder
    from tensordiff.recorders.hf import HFExtractorRecorder, model_info
    from tensordiff.recorders.hooks import record_weights
    from tensordiff.trace.rl import sampling_params, write_sampling

    gen = torch.Generator().manual_seed(seed)
    toks_out: list[list[int]] = []
    lp_proc: list[list[float]] = []
    lp_plain: list[list[float]] = []
    rec = hf = None
    stack = contextlib.ExitStack()
    with stack:
        if out is not None:
            info = model_info(net)
            info["path"] = str(path or "")
            rec = stack.enter_context(Recorder(str(out), side="serve", producer="benchmarks/fuzz/rl.py (HF as the "
                                               "engine)", model=info))
            write_sampling(rec.writer, sampling_params(temperature=temperature, top_p=top_p, top_k=top_k,
                                                       logprobs_mode="processed", engine="hf-rollout"))
            steps = weight_steps or [(net, "start")]
            for k, (m, event) in enumerate(steps):
                record_weights(rec, m, k, forward_step=k, event=event)
            hf = HFExtractorRecorder(net, rec, None, values="all", topk=20)
        fwd = len(weight_steps or [None]) - 1
        for i, ids in enumerate(prompt_ids):
            cache = DynamicCache()
            toks = list(ids)
            feed, pos, regime = toks, list(range(len(toks))), "prefill"
            new: list[int] = []
            lpp: list[float] = []
            lpl: list[float] = []
            for j in range(NEW_TOKENS):
                x = torch.tensor(feed)
                cap = hf.capture(f"p{i}", x, positions=pos, regime=regime, step=fwd) if hf is not None else \
                    contextlib.nullcontext(None)
                with cap as rows, torch.inference_mode():
                    o = net(input_ids=x[None], position_ids=torch.tensor(pos)[None], past_key_values=cache,
                            use_cache=True)
                cache = o.past_key_values
                if kv_dtype is not None:
                    for layer in cache.layers:
                        layer.keys = layer.keys.to(kv_dtype).to(layer.keys.dtype)
                        layer.values = layer.values.to(kv_dtype).to(layer.values.dtype)
                z = o.logits[0, -1].float()
                zp = _processed(z, temperature, top_p, top_k)
                nxt = forced[i][j] if forced is not None else \
                    int(torch.multinomial(torch.softmax(zp, -1), 1, generator=gen))
                lp = float(torch.log_softmax(zp, -1)[nxt])
                lpp.append(lp)
                lpl.append(float(torch.log_softmax(z / temperature, -1)[nxt]))
                if rec is not None:
                    rec.plain(cv.SAMPLED_LOGPROB, np.array([[nxt, lp]]), rows[0, -1:], role=cv.SAMPLED_LOGPROB)
                new.append(nxt)
                toks.append(nxt)
                feed, pos, regime = [nxt], [len(toks) - 1], "decode"
            toks_out.append(new)
            lp_proc.append(lpp)
            lp_plain.append(lpl)
    return toks_out, lp_proc, lp_plain


def trainer_lps(net: Any, seqs: list[list[int]], firsts: list[int], temperature: float,
                unmasked: int | None = None) -> list[list[float]]:
    """The trainer's ``log_softmax(logits / T)`` of each sequence's generated tokens (the answer,
    not a recording); ``unmasked``: as the padded batch with that sequence's mask lost computes it."""
    if unmasked is not None:
        ids, mask, seen = _batch(seqs, unmasked)
        with torch.no_grad():
            z = net(input_ids=ids, attention_mask=seen, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits.float()
        width = ids.shape[1]
        out = []
        for b, (s, f) in enumerate(zip(seqs, firsts)):
            off = width - len(s)
            lp = torch.log_softmax(z[b, off:] / temperature, -1)
            out.append([float(lp[p - 1, s[p]]) for p in range(f, len(s))])
        return out
    out = []
    for s, f in zip(seqs, firsts):
        with torch.no_grad():
            z = net(input_ids=torch.tensor(s)[None]).logits[0].float()
        lp = torch.log_softmax(z / temperature, -1)
        out.append([float(lp[p - 1, s[p]]) for p in range(f, len(s))])
    return out


def _batch(seqs: list[list[int]], unmasked: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for b, s in enumerate(seqs):
        ids[b, width - len(s):] = torch.tensor(s)
        mask[b, width - len(s):] = 1
    seen = mask.clone()
    if unmasked is not None:
        seen[unmasked] = 1
    return ids, mask, seen


def record_trainer(out: Path, net: Any, seqs: list[list[int]], firsts: list[int], temperature: float, how: str,
                   unmasked: int | None = None) -> Path:
    """A user's trainer forward over the sequences (TrainerRecorder), each its own (``sequence``)
    or one left-padded micro-batch, position ids from the mask (``batch``)."""
    from tensordiff.recorders.core import Recorder
    from tensordiff.recorders.hf import model_info
    from tensordiff.recorders.hooks import TrainerRecorder

    keys = [f"p{i}" for i in range(len(seqs))]
    with Recorder(str(out), side="train", model=model_info(net)) as rec:
        tr = TrainerRecorder(net, rec, temperature=temperature)
        if how == "batch":
            ids, mask, seen = _batch(seqs, unmasked)
            with tr.batch(keys, ids, mask, first_generated=firsts), torch.no_grad():
                net(input_ids=ids, attention_mask=seen, position_ids=(mask.cumsum(-1) - 1).clamp(min=0))
        else:
            for k, s, f in zip(keys, seqs, firsts):
                with tr.sequence(k, torch.tensor(s), first_generated=f), torch.no_grad():
                    net(input_ids=torch.tensor(s)[None])
        tr.detach()
    return out


def _from_serve(out: Path, serve: Path, mdir: Path, temperature: float) -> Path:
    from tensordiff.cli import main

    argv = ["record", "train", "--model", str(mdir), "--from-serve", str(serve), "--values", "all",
            "--no-draft-input", "--no-progress", "--dtype", "float32", "--device", "cpu",
            "--temperature", repr(temperature), "--out", str(out)]
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        rc = main(argv)
    if rc != 0:
        raise RuntimeError(f"record train --from-serve exited {rc}")
    return out


def _merge(seq: list[int], first: int, rng: np.random.Generator) -> list[int]:
    """A re-tokenised response: two adjacent response tokens become one other token (a BPE merge
    the engine's sampling never produced), the rest one position earlier."""
    j = int(rng.integers(first, len(seq) - 1))
    a, b = seq[j], seq[j + 1]
    m = (a * 31 + b * 7 + 3) % 254 + 2
    while m in (a, b):
        m = (m + 1) % 254 + 2
    return seq[:j] + [m] + seq[j + 2:]


# ----------------------------------------------------------------------------------------------
# Running and judging


@dataclass
class Result:
    seed: int
    kind: str
    family: str
    model: str
    dtypes: str                     # rollout / trainer
    mode: str                       # the trainer's recorder (+replay: the prefill re-run given)
    order: str                      # "TR" / "RT": the order of the arguments
    layer: int
    x: float
    magnitude: float
    truth: str
    outcome: str
    miss: bool
    rc: int
    first: str                      # triage's cause, refined by its sentence
    headline: str
    why: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


def cause_of(doc: dict[str, Any]) -> str:
    """triage's JSON cause refined by the first words of its sentence (catalog.RL_ACCEPT)."""
    c, h = str(doc.get("cause", "")), str(doc.get("headline", ""))
    if c == "layer":
        if h.startswith("the engine's decode path") or "where the rollout's decode passes start" in h:
            return "layer:decode"
        for p in ("positions", "sequences", "states"):
            if h.startswith(p + ":"):
                return f"layer:{p}"
        return "layer:?"
    if c == "logprobs":
        if "systematic offset" in h:
            return "logprobs:offset"
        if "differ beyond the noise" in h:
            return "logprobs:beyond"
        return "logprobs:modes"
    return c


def run_triage(paths: list[Path]) -> tuple[int, dict[str, Any]]:
    from tensordiff.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["triage", *map(str, paths), "--json"])
    try:
        return rc, json.loads(out.getvalue())
    except ValueError:
        return rc, {"headline": (err.getvalue() or out.getvalue()).strip()[-300:]}


def _effect(a: list[list[float]], b: list[list[float]], seq: int | None = None) -> float:
    """The median |a - b| over every sampled token, as the noise is measured; ``seq``: over that
    sequence's tokens only (a bug in one sequence of a batch is sized where it is)."""
    if seq is not None:
        return float(np.median(np.abs(np.subtract(a[seq], b[seq]))))
    return float(np.median(np.abs(np.concatenate([np.subtract(x, y) for x, y in zip(a, b)]))))


def execute(sc: Scenario) -> Result:
    tmp = tempfile.TemporaryDirectory(prefix="fuzz-rl-", dir=_workdir())
    d = Path(tmp.name)
    try:
        return _execute(sc, d)
    finally:
        tmp.cleanup()


def _execute(sc: Scenario, d: Path) -> Result:
    m = M.model(sc.model)
    rng = np.random.default_rng([sc.seed, 7])
    ps = prompts(sc)
    firsts = [len(p) for p in ps]
    T = sc.temperature
    master = m.master
    trainer_net = master
    mdir = model_dir(sc.model)
    engine = _cast(master, sc.dtype_rollout)
    steps: list[tuple[Any, str]] | None = None
    layer = 0
    kw: dict[str, Any] = {}
    if sc.kind == "top_p":
        kw["top_p"] = sc.knob
    elif sc.kind == "top_k":
        kw["top_k"] = int(sc.knob)
    elif sc.kind == "decode_kv_precision":
        kw["kv_dtype"] = getattr(torch, sc.variant)
    elif sc.kind == "stale_param":
        with _prompts_as(ps):
            w1 = rs.updated(master, lr=sc.knob)
        trainer_net = w1
        mdir = rs.save(w1, d / "w1") if sc.trainer == "from-serve" else mdir
        names = [n for n, _ in w1.named_parameters()]
        stale = [names[sc.target % len(names)]] if sc.variant == "one" else names
        served = copy.deepcopy(w1)
        old = dict(master.named_parameters())
        with torch.no_grad():
            for n, p in served.named_parameters():
                if n in stale:
                    p.copy_(old[n])
        if sc.variant == "one":
            layer = next((int(t) for t in stale[0].split(".") if t.isdigit()), 0)
        engine = _cast(served, sc.dtype_rollout)
        steps = [(_cast(master, sc.dtype_rollout), "start"), (engine, UPDATE)]
    gen_seed = int(rng.integers(0, 1 << 31))
    toks, lp_roll, _ = generate(engine, ps, temperature=T, seed=gen_seed, out=d / "rollout.h5", weight_steps=steps,
                                path=mdir, **kw)
    seqs = [p + t for p, t in zip(ps, toks)]
    # the correct engine on the same tokens, and the correct trainer
    good_engine = engine if sc.kind in ("none",) or RL_KINDS[sc.kind][1] == "trainer" else \
        _cast(trainer_net, sc.dtype_rollout)
    if good_engine is engine and not kw:
        lp_roll_ok = lp_roll
    else:
        _, lp_roll_ok, _ = generate(good_engine, ps, temperature=T, seed=0, forced=toks)
    lp_train_ok = trainer_lps(trainer_net, seqs, firsts, T)
    noise = float(np.median(np.abs(np.subtract(lp_roll_ok, lp_train_ok))))
    truth, effect = "logprobs", 0.0
    # the trainer's side, with its bug
    t_seqs, t_firsts, t_temp, unmasked = seqs, firsts, T, None
    if sc.kind == "temperature":
        t_temp = T * (1 + sc.knob)
        effect = _effect(trainer_lps(trainer_net, seqs, firsts, t_temp), lp_train_ok)
    elif sc.kind == "mask_lost_one_seq":
        unmasked = sc.target
        effect = _effect(trainer_lps(trainer_net, seqs, firsts, T, unmasked=unmasked), lp_train_ok, unmasked)
    elif sc.kind == "missing_bos":
        t_seqs, t_firsts, truth = [s[1:] for s in seqs], [f - 1 for f in firsts], "tokens"
    elif sc.kind == "retokenized":
        hit = sorted({sc.target % SEQS} | {i for i in range(SEQS) if rng.integers(0, 3) == 0})
        t_seqs = [(_merge(s, f, rng) if i in hit else s) for i, (s, f) in enumerate(zip(seqs, firsts))]
        truth = "tokens"
    elif sc.kind != "none":
        effect = _effect(lp_roll, lp_roll_ok)
    if sc.kind == "none":
        truth = "-"
    if sc.kind == "stale_param":
        truth = "weights"
    rollout = d / "rollout.h5"
    train = d / "train.h5"
    if sc.trainer == "from-serve":
        _from_serve(train, rollout, mdir, t_temp)
    else:
        record_trainer(train, trainer_net, t_seqs, t_firsts, t_temp, sc.trainer, unmasked)
    paths = [train, rollout] if sc.order == "TR" else [rollout, train]
    if sc.replay:
        paths.append(rs.replay(d / "replay.h5", _cast(trainer_net, sc.dtype_rollout), rollout, temperature=T,
                               logprobs_mode="raw"))
    rc, doc = run_triage(paths)
    x = effect / max(noise, NOISE_FLOOR) if truth not in ("tokens", "-") else float("nan")
    return judge(sc, truth, x, layer, rc, doc, noise, effect)


@contextlib.contextmanager
def _prompts_as(ps: list[list[int]]) -> Any:
    """rl_support.updated trains on tests/trained.prompts(): the scenario's prompts instead."""
    import trained

    old = trained.prompts
    trained.prompts = lambda: ps   # type: ignore[assignment]
    try:
        yield
    finally:
        trained.prompts = old   # type: ignore[assignment]


def judge(sc: Scenario, truth: str, x: float, layer: int, rc: int, doc: dict[str, Any], noise: float,
          effect: float) -> Result:
    cause = cause_of(doc) if rc in (0, 1) else ""
    res = Result(sc.seed, sc.kind, RL_FAMILY[sc.kind], sc.model, f"{sc.dtype_rollout}/float32",
                 sc.trainer + ("+replay" if sc.replay else ""), sc.order, layer, x, sc.knob, truth, "", False, rc,
                 cause, str(doc.get("headline", ""))[:400],
                 extra={"noise": noise, "effect": effect, "temperature": sc.temperature, "variant": sc.variant,
                        "lengths": list(sc.lengths)})
    if rc not in (0, 1):
        res.outcome, res.miss, res.why = "wrong", True, f"exit {rc}"
        return res
    if sc.kind == "none":
        if rc == 0:
            res.outcome = "agree"
        else:
            res.outcome, res.miss, res.why = "false_alarm", True, "a correct pair exits 1"
        return res
    if rc == 0:
        res.outcome = "agree"
        big = truth in ("tokens", "weights") and not math.isfinite(x) or (math.isfinite(x) and x >= 3.0)
        res.miss = bool(big)
        res.why = "agree at 3x the noise or more" if big else ""
        return res
    named, found = RL_ACCEPT[sc.kind]
    if cause in named:
        res.outcome = "named"
    elif cause in found:
        res.outcome = "found_elsewhere"
    else:
        res.outcome, res.miss, res.why = "wrong", True, f"cause {cause} for {sc.kind}"
    return res


def as_dict(r: Result) -> dict[str, Any]:
    d = asdict(r)
    d["x"] = None if not math.isfinite(r.x) else round(r.x, 3)
    return d
