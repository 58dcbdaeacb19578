"""The trained tiny Llama and its EAGLE-3 draft (scripts/train_tiny_models.py: trained on CPU from
Python's standard-library sources, cached under .cache/trained/), and traces of it recorded by the
real train recorder (``tensordiff record train``, the HF extractor) in float32 and bfloat16.

Random-weight models are not the reference for noise (their bf16 error explodes with depth); this
one looks trained: neighbouring boundaries at median cos 0.94-0.99 (embed -> layer1 0.40), bf16
error 0.16-0.8% relative, growing smoothly with depth (docs/diff.md, "The trained test model").

Not a test module. Traces are written once per directory and reused: pass a session-scoped
directory (``tmp_path_factory.mktemp``).
"""

from __future__ import annotations

import importlib.util
import json
from functools import lru_cache
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
AUX_IDS = (2, 4, 6)                          # the draft's ids: layer3, layer5, layer7
SLOTS = ("layer3", "layer5", "layer7")       # what draft_input holds, as recorded
N_LAYERS, HIDDEN = 8, 64


@lru_cache(maxsize=1)
def _script():
    spec = importlib.util.spec_from_file_location("train_tiny_models", ROOT / "scripts" / "train_tiny_models.py")
    mod = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(mod)
    return mod


@lru_cache(maxsize=1)
def model_dir() -> Path:
    """The cached directory with ``target/``, ``draft/``, ``prompts.jsonl`` (trained on first use)."""
    return Path(_script().trained_dir(log=lambda *a: None))


def target_dir() -> Path:
    return model_dir() / "target"


def draft_dir() -> Path:
    return model_dir() / "draft"


def prompts_path() -> Path:
    return model_dir() / "prompts.jsonl"


def prompts() -> list[list[int]]:
    with open(prompts_path()) as f:
        return [json.loads(line)["input_ids"] for line in f]


def load_target(dtype=None):
    import torch
    from transformers import LlamaForCausalLM
    return LlamaForCausalLM.from_pretrained(str(target_dir()), dtype=dtype or torch.float32).eval()


def record(out: str | Path, dtype: str = "float32", *extra: str, side_args: tuple[str, ...] = ()) -> Path:
    """``tensordiff record train`` on the trained model and its draft (full values of every
    catalog state, top-20 predictions), in ``dtype``; ``extra``: more CLI arguments."""
    from tensordiff.cli import main

    out = Path(out)
    argv = ["record", "train", "--model", str(target_dir()), "--prompts", str(prompts_path()),
            "--draft", str(draft_dir()), "--values", "all", "--dtype", dtype, "--no-progress",
            "--out", str(out), *side_args, *extra]
    rc = main(argv)
    if rc != 0:
        raise RuntimeError(f"record train exited {rc}: {' '.join(argv)}")
    return out


def traces(root: str | Path) -> dict[str, Path]:
    """{"float32": path, "bfloat16": path}: the trained model recorded once per dtype under ``root``."""
    root = Path(root)
    out = {}
    for dt in ("float32", "bfloat16"):
        p = root / f"trained-{dt}.h5"
        if not p.exists():
            record(root / f"trained-{dt}.tmp.h5", dt).rename(p)
        out[dt] = p
    return out


def boundary_states(dtype=None) -> dict[str, np.ndarray]:
    """{label: [sequences * positions, H] float64}: every boundary of the held-out prompts."""
    import torch

    m = load_target(dtype)
    ids = torch.tensor(prompts())
    with torch.no_grad():
        hs = m(ids, output_hidden_states=True).hidden_states
    out = {}
    for b, h in enumerate(hs):   # transformers 5: hidden_states[N] is after the final norm
        label = "embed" if b == 0 else "final_norm" if b == len(hs) - 1 else f"layer{b}"
        out[label] = h.double().reshape(-1, h.shape[-1]).numpy()
    return out
