"""A seeded pair of traces that looks like a trained model's residual stream, for the memory,
identity and narrow-tensor benchmarks (bench_memory.py, bench_identity.py, bench_narrow.py). Not
a benchmark itself.

Side A: boundaries ``embed``, ``layer1`` .. ``layer{B-1}`` (``x[b+1] = x[b] + step * noise``
with per-token log-normal and per-channel scales, so consecutive boundaries sit at cos 0.99+),
optionally ``final_norm`` (the last boundary RMS-normalised, times a per-channel weight) and a
packed tensor whose slots hold some of those states. Side B: the same bf16 bits with +-1 ulp in
1/4 of the elements (honest kernel noise), one boundary optionally corrupted, and its own packed
slots (which may hold other states than A's: the founding EAGLE-3 case).

Tokens come in sequences of ``seq_len`` positions with seeded ids (3-grams unique in practice),
one ``add_tokens`` per sequence, as a recorder writes them. Everything is bf16; sketches off.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import numpy as np


def label(b: int) -> str:
    return "embed" if b == 0 else f"layer{b}"


def _bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bits, round to nearest even."""
    u = x.view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def _ulp_noise(bits: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """+-1 ulp in 1/8 of the elements each way (zeros left alone)."""
    r = np.frombuffer(rng.bytes(bits.size), np.uint8).reshape(bits.shape)
    step = (r < 32).view(np.int8) - (r >= 224).view(np.int8)
    step[(bits & 0x7FFF) == 0] = 0
    out: np.ndarray = bits + step.astype(np.int16).view(np.uint16)
    return out


@dataclass
class PairSpec:
    boundaries: int = 32             # boundary tensors embed, layer1, ... layer{boundaries-1}
    tokens: int = 2048
    hidden: int = 4096
    seq_len: int = 2048              # positions per sequence (the last one may be shorter)
    num_layers: int | None = None    # the model's layer count (default: boundaries)
    final_norm: bool = False
    packed_a: list[str] = field(default_factory=list)   # slot labels of A's packed tensor (none: no tensor)
    packed_b: list[str] = field(default_factory=list)   # what B's slots hold (default: A's)
    claimed_b: list[str] | None = None                   # B's slot labels (default: what they hold)
    corrupt: int | None = None       # boundary of B replaced by x + 0.5 * rms * noise
    step: float = 0.1
    shared_prefix: int = 0           # every sequence starts with the same ids (a system prompt)
    seed: int = 0


def write_pair(d: str, spec: PairSpec) -> tuple[str, str, dict[str, float]]:
    """Write ``a.h5`` and ``b.h5`` in ``d``; returns their paths and {seconds, bytes}."""
    from tensordiff.trace import SlotSpec, TraceWriter

    t0 = time.perf_counter()
    T, H = spec.tokens, spec.hidden
    L = spec.num_layers if spec.num_layers is not None else spec.boundaries
    pa = list(spec.packed_a)
    pb = list(spec.packed_b) or pa
    cb = list(spec.claimed_b) if spec.claimed_b is not None else pb
    wanted = set(pa) | set(pb)
    model = {"num_layers": L, "hidden_size": H}
    paths = os.path.join(d, "a.h5"), os.path.join(d, "b.h5")
    rng = np.random.default_rng(spec.seed)
    ids = rng.integers(3, 32000, size=T)
    if spec.shared_prefix:
        prompt = rng.integers(3, 32000, size=spec.shared_prefix)
        for s0 in range(0, T, spec.seq_len):
            n = min(spec.shared_prefix, spec.seq_len, T - s0)
            ids[s0:s0 + n] = prompt[:n]
    writers = [TraceWriter(paths[0], side="train", producer="benchmarks/model_pair.py", model=model,
                           flush_rows=None, flush_seconds=None),
               TraceWriter(paths[1], side="serve", producer="benchmarks/model_pair.py", model=model,
                           flush_rows=None, flush_seconds=None)]
    try:
        names = [label(b) for b in range(spec.boundaries)] + (["final_norm"] if spec.final_norm else [])
        for w, labels, claimed in ((writers[0], pa, pa), (writers[1], pb, cb)):
            for b in range(spec.boundaries):
                w.define_tensor(label(b), H, kind="boundary", boundary=b, dtype="bfloat16", role="catalog",
                                sketch=False)
            if spec.final_norm:
                w.define_tensor("final_norm", H, kind="final_norm", dtype="bfloat16", role="catalog", sketch=False)
            if labels:
                w.define_tensor("draft_input", H * len(labels), kind="packed", dtype="bfloat16",
                                slots=SlotSpec(list(claimed), convention="boundary"), slot_width=H,
                                role="draft_input", sketch=False)
        rows: list[np.ndarray] = [np.empty(0, np.int64), np.empty(0, np.int64)]
        parts: list[list[np.ndarray]] = [[], []]
        for s0 in range(0, T, spec.seq_len):
            n = min(spec.seq_len, T - s0)
            for side, (w, regime) in enumerate(((writers[0], "train"), (writers[1], "prefill"))):
                parts[side].append(w.add_tokens(f"req-{s0 // spec.seq_len}", np.arange(n), ids[s0:s0 + n], regime))
        rows = [np.concatenate(p) for p in parts]
        tok_scale = rng.lognormal(0.0, 0.3, size=(T, 1)).astype(np.float32)
        ch_scale = np.ones((1, H), np.float32)
        ch_scale[0, rng.choice(H, size=min(4, H), replace=False)] = 4.0
        x = rng.standard_normal((T, H), dtype=np.float32)
        x *= tok_scale
        x *= ch_scale
        delta = np.empty_like(x)
        kept: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        for i, name in enumerate(names):
            if name == "final_norm":
                rms = np.sqrt(np.einsum("th,th->t", x, x) / H)[:, None].astype(np.float32)
                gamma = rng.uniform(0.5, 1.5, size=(1, H)).astype(np.float32)
                state = x / np.maximum(rms, 1e-12) * gamma
            else:
                if i:
                    rng.standard_normal(out=delta, dtype=np.float32)
                    delta *= tok_scale
                    delta *= ch_scale
                    delta *= np.float32(spec.step)
                    x += delta
                state = x
            bits_a = _bf16(np.ascontiguousarray(state, np.float32))
            if name != "final_norm" and i == spec.corrupt:
                rms = np.sqrt(np.einsum("th,th->t", state, state) / H)[:, None].astype(np.float32)
                bad = state + np.float32(0.5) * rms * rng.standard_normal((T, H), dtype=np.float32)
                bits_b = _bf16(np.ascontiguousarray(bad, np.float32))
            else:
                bits_b = _ulp_noise(bits_a, rng)
            writers[0].append(name, rows[0], bits_a)
            writers[1].append(name, rows[1], bits_b)
            if name in wanted:
                kept[name] = (bits_a, bits_b)
        for side, labels in ((0, pa), (1, pb)):
            if labels:
                writers[side].append("draft_input", rows[side], np.concatenate([kept[lb][side] for lb in labels], axis=1))
    finally:
        for w in writers:
            w.close()
    return paths[0], paths[1], {"seconds": time.perf_counter() - t0,
                                "bytes": float(sum(os.path.getsize(p) for p in paths))}


# A small launcher forks and execs the measured command and reports its os.wait4 rusage. Not
# the benchmark itself: Linux counts the memory a process had before exec into its ru_maxrss, and
# subprocess forks (vforks) from the benchmark, which holds the generated data; the launcher
# holds ~10 MB.
_LAUNCH = """
import json, os, sys, time
t0 = time.perf_counter()
pid = os.fork()
if pid == 0:
    os.execv(sys.argv[2], sys.argv[2:])
_, status, ru = os.wait4(pid, 0)
with open(sys.argv[1], "w") as fh:
    json.dump({"rc": os.waitstatus_to_exitcode(status), "wall": time.perf_counter() - t0,
               "maxrss_kb": ru.ru_maxrss}, fh)
"""


def child_rss(argv: list[str], env: dict[str, str] | None = None) -> tuple[int, float, float, str]:
    """Run ``argv`` in a fresh process: (exit code, wall seconds, peak RSS in MB from
    ``os.wait4``'s ru_maxrss, stdout)."""
    import json
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryFile() as out, tempfile.NamedTemporaryFile("r", suffix=".json") as rep:
        subprocess.run([sys.executable, "-c", _LAUNCH, rep.name, *argv], stdout=out, stderr=subprocess.DEVNULL,
                       env=env, check=False)
        with open(rep.name) as fh:
            doc = json.load(fh)
        out.seek(0)
        text = out.read().decode("utf-8", "replace")
    return int(doc["rc"]), float(doc["wall"]), doc["maxrss_kb"] / 1024.0, text


def tensordiff_env() -> dict[str, str]:
    """The environment a child ``python -m tensordiff`` needs to import this checkout."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = repo + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env
