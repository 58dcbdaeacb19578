"""Per-rank trace files for the trace-set tests, written through the real TraceWriter and named the
way the SGLang plugin names them (``rank_path``: ``.dp<k>``, ``.pp<k>``, ``.tp<k>`` before the
extension). Not a test module.

One recording's data (``Recording``) can be written as one file or split over ranks:
DP ranks take whole sequences, PP stages take layers, TP ranks take copies (replicated TP) or
sequences (DP attention). A diff of the split files must equal the diff of the one file.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np

from tensordiff.recorders.sglang import rank_path
from tensordiff.trace import SlotSpec, TraceWriter

H = 16
LAYERS = 4
SEQS = 8
LENGTH = 10
STATES = ["embed", "layer1", "layer2", "layer3", "layer4"]
STAGES = {0: ["embed", "layer1", "layer2"], 1: ["layer3", "layer4", "final_norm", "aux"]}


@dataclass
class Recording:
    """Everything one side recorded, by sequence."""

    side: str
    keys: list[str]
    tokens: dict[str, np.ndarray]
    states: dict[str, dict[str, np.ndarray]]        # key -> state -> [T, H] float32
    aux_labels: tuple[str, ...] = ("layer1", "layer3")
    aux_held: dict[str, tuple[str, ...]] = field(default_factory=dict)  # key -> what the aux slots really hold


def make_recording(side: str, *, noise: float = 0.0, seed: int = 0, drift: bool = False, wrong_slot: bool = False,
                   model_seed: int = 7) -> Recording:
    """``drift``: layer3 of sequence s5 drifts from position 4 on; ``wrong_slot``: the aux tensor's
    slot 1 holds layer4 where layer3 is claimed (the EAGLE-3 wiring bug)."""
    base = np.random.default_rng(model_seed)
    rng = np.random.default_rng(seed)
    keys = [f"s{i}" for i in range(SEQS)]
    tokens, states, held = {}, {}, {}
    for k in keys:
        tokens[k] = base.integers(1, 1000, LENGTH)
        st = {}
        for name in STATES + ["final_norm"]:
            x = base.standard_normal((LENGTH, H)).astype(np.float32)
            if noise:
                x = x + noise * rng.standard_normal(x.shape).astype(np.float32)
            st[name] = x
        if drift and k == "s5":
            st["layer3"] = st["layer3"].copy()
            # its own generator: the recording's other sequences stay those of the reference
            st["layer3"][4:] += 0.5 * np.random.default_rng(99).standard_normal((LENGTH - 4, H)).astype(np.float32)
        states[k] = st
        held[k] = ("layer1", "layer4") if wrong_slot else ("layer1", "layer3")
    return Recording(side, keys, tokens, states, aux_held=held)


def bf16_bits(x: np.ndarray) -> np.ndarray:
    return (x.view(np.uint32) >> 16).astype(np.uint16)


def write(path: str, rec: Recording, *, keys: list[str] | None = None, tensors: list[str] | None = None,
          meta: dict | None = None, tweak: dict | None = None, model: dict | None = None) -> str:
    """Write the sequences ``keys`` and the tensors ``tensors`` of ``rec`` to one file.
    ``tweak``: {(tensor, key, position): delta} added to the stored values (a replica that differs)."""
    keys = rec.keys if keys is None else keys
    tensors = STATES + ["final_norm", "aux"] if tensors is None else tensors
    w = TraceWriter(path, side=rec.side, producer="tests/setgen.py",
                    model=model or {"num_layers": LAYERS, "hidden_size": H, "architecture": "Tiny"},
                    meta=meta or {}, sketch_dim=8, flush_rows=None, flush_seconds=None)
    for b, name in enumerate(STATES):
        if name in tensors:
            w.define_tensor(name, H, kind="boundary", boundary=b, dtype="bfloat16" if name == "layer2" else "float32")
    if "final_norm" in tensors:
        w.define_tensor("final_norm", H, kind="final_norm")
    if "aux" in tensors:
        w.define_tensor("aux", 2 * H, kind="packed", slots=SlotSpec(list(rec.aux_labels), raw_ids=[1, 3],
                        convention="boundary"), slot_width=H, role="aux")
    tweak = tweak or {}
    for step, k in enumerate(keys):
        rows = w.add_tokens(k, np.arange(LENGTH), rec.tokens[k], "train" if rec.side == "train" else "prefill",
                            step=step)
        st = rec.states[k]
        for name in [t for t in STATES + ["final_norm"] if t in tensors]:
            x = st[name].copy()
            for (tn, tk, pos), delta in tweak.items():
                if tn == name and tk == k:
                    x[pos] += delta
            w.append(name, rows, bf16_bits(x) if name == "layer2" else x)
        if "aux" in tensors:
            w.append("aux", rows, np.concatenate([st[s] for s in rec.aux_held[k]], axis=1))
    w.close()
    return path


def split_dp(keys: list[str], dp: int) -> list[list[str]]:
    """DP ranks take contiguous runs of sequences (the one file's order is the set's order)."""
    per = -(-len(keys) // dp)
    return [keys[i * per:(i + 1) * per] for i in range(dp)]


def write_ranks(d: str, rec: Recording, *, dp: int = 1, pp: int = 1, tp: int = 1, tp_replicated: bool = True,
                name: str = "serve.h5", host: str | None = None, tweak: dict | None = None,
                skip: set[str] | None = None) -> list[str]:
    """Write ``rec`` as the per-rank files of a DP x PP x TP run into ``d``. With
    ``tp_replicated`` every TP rank holds a copy of its DP rank's sequences; without (DP
    attention), TP ranks split them. ``tweak``: {suffix: tweak} perturbs one file. ``skip``: the
    suffixes not to write (a missing rank)."""
    os.makedirs(d, exist_ok=True)
    paths = []
    for di, keys in enumerate(split_dp(rec.keys, dp)):
        for pi in range(pp):
            tensors = STATES + ["final_norm", "aux"] if pp == 1 else STAGES[pi]
            for ti in range(tp):
                suffix = (f".dp{di}" if dp > 1 else "") + (f".pp{pi}" if pp > 1 else "") + (f".tp{ti}" if tp > 1 else "")
                if skip and suffix in skip:
                    continue
                mine = keys if tp_replicated else split_dp(keys, tp)[ti]
                ranks = {"tp_rank": ti, "tp_size": tp, "pp_rank": pi, "pp_size": pp, "dp_rank": di, "dp_size": dp,
                         "replicated": tp_replicated}
                meta = {"ranks": ranks, **({"host": host} if host else {})}
                p = rank_path(os.path.join(d, name), suffix)
                write(p, rec, keys=mine, tensors=tensors, meta=meta, tweak=(tweak or {}).get(suffix))
                paths.append(p)
    return paths
