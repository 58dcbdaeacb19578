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


def record(out: str | Path, dtype: str = "float32", *extra: str, model: str | Path | None = None) -> Path:
    """``tensordiff record train`` on the trained model and its draft (full values of every
    catalog state, top-20 predictions), in ``dtype``; ``extra``: more CLI arguments."""
    from tensordiff.cli import main

    out = Path(out)
    argv = ["record", "train", "--model", str(model or target_dir()), "--prompts", str(prompts_path()),
            "--draft", str(draft_dir()), "--values", "all", "--dtype", dtype, "--no-progress",
            "--out", str(out), "--force", *extra]
    rc = main(argv)
    if rc != 0:
        raise RuntimeError(f"record train exited {rc}: {' '.join(argv)}")
    return out


def traces(root: str | Path) -> dict[str, Path]:
    """{"float32": path, "bfloat16": path}: the trained model recorded once per dtype under ``root``."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
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


# ----------------------------------------------------------------------------------------------
# Bugs of known shape: a model variant recorded by the real recorder, or a recorded trace edited
# (values, sketches and RMS rewritten together, as the writer would have written them)


def variant_model(root: str | Path, name: str, config: dict | None = None, perturb: tuple[int, float] | None = None,
                  seed: int = 0, lm_head: float | None = None, unit_norm: bool = False) -> Path:
    """A copy of the trained target under ``root/name`` with ``config`` entries changed and/or the
    weights of decoder layer ``perturb[0]`` multiplied by (1 + perturb[1] * N(0, 1)) elementwise,
    and/or the lm_head's weights multiplied by ``lm_head`` (a logit scale: a temperature), and/or
    the final norm's weights set to one (``unit_norm``: final_norm is then the last layer rescaled
    per token)."""
    import shutil

    import torch

    out = Path(root) / name
    if (out / "config.json").exists():
        return out
    tmp = Path(root) / (name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(target_dir(), tmp)
    if config:
        cfg = json.loads((tmp / "config.json").read_text())
        cfg.update(config)
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    if perturb is not None or lm_head is not None or unit_norm:
        m = load_target()
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in (m.model.layers[perturb[0]].parameters() if perturb is not None else ()):
                if p.dim() == 2:
                    p.mul_(1 + perturb[1] * torch.randn(p.shape, generator=g))
            if lm_head is not None:
                m.lm_head.weight.mul_(lm_head)
            if unit_norm:
                m.model.norm.weight.fill_(1.0)
        m.save_pretrained(tmp, safe_serialization=True)
        gen = tmp / "generation_config.json"
        if gen.exists():
            gen.unlink()
    tmp.rename(out)
    return out


def _copy(src: Path, dst: Path) -> Path:
    import shutil
    shutil.copyfile(src, dst)
    return Path(dst)


def _store(values: np.ndarray, dtype: str) -> np.ndarray:
    from tensordiff.dtypes import f32_to_bf16_bits
    v = np.ascontiguousarray(values, np.float32)
    return f32_to_bf16_bits(v) if dtype == "bfloat16" else v


def _rewrite(g, dtype: str, slot_width: int, values: np.ndarray, sketch_dim: int, sketch_seed: int) -> None:
    """values (float32, [n, k*w]) into group ``g`` with its sketch and per-slot RMS."""
    from tensordiff.dtypes import to_float32
    from tensordiff.sketch import sketch_np
    stored = _store(values, dtype)
    f = to_float32(stored, dtype)
    n, width = f.shape
    for ds, data in (("values", stored), ("sketch", sketch_np(f, slot_width, sketch_dim, sketch_seed)),
                     ("rms", np.sqrt((f.reshape(n, -1, slot_width).astype(np.float64) ** 2).mean(-1)).astype(np.float32))):
        if ds in g:
            g[ds].resize((n,) + g[ds].shape[1:])
            g[ds][...] = data


def token_keys(path: str | Path, name: str) -> tuple[np.ndarray, np.ndarray]:
    """(sequence index, position) of each row of tensor ``name``."""
    import h5py
    with h5py.File(path, "r") as f:
        rows = f["tensors"][name]["rows"][...]
        tok = f["tokens"][...]
    return tok["seq"][rows], tok["position"][rows]


def edit(src: str | Path, dst: str | Path, name: str, fn) -> Path:
    """A copy of trace ``src`` whose tensor ``name`` holds ``fn(values, seq, position)`` (float32
    [n, width] in, float32 out), its sketches and RMS recomputed."""
    import h5py

    from tensordiff.dtypes import to_float32
    dst = _copy(Path(src), Path(dst))
    seq, pos = token_keys(dst, name)
    with h5py.File(dst, "r+") as f:
        g = f["tensors"][name]
        dt = str(g.attrs["dtype"])
        sw = int(g.attrs.get("slot_width", g["values"].shape[1]))
        v = to_float32(g["values"][...], dt).copy()
        _rewrite(g, dt, sw, fn(v, seq, pos), int(f.attrs["sketch_dim"]), int(f.attrs["sketch_seed"]))
    return dst


def duplicate(src: str | Path, dst: str | Path, name: str, which: np.ndarray, fn) -> Path:
    """A copy of trace ``src`` where the rows ``which`` of tensor ``name`` are recorded twice: a
    second token row for the same (sequence, position, regime) and a second tensor row holding
    ``fn(values of those rows, seq, position)``."""
    import h5py

    from tensordiff.dtypes import to_float32
    dst = _copy(Path(src), Path(dst))
    seq, pos = token_keys(dst, name)
    with h5py.File(dst, "r+") as f:
        g = f["tensors"][name]
        tok = f["tokens"]
        rows = g["rows"][...]
        n_tok = tok.shape[0]
        extra = tok[...][rows[which]]
        tok.resize((n_tok + len(extra),))
        tok[n_tok:] = extra
        f.attrs.modify("flushed_tokens", np.int64(n_tok + len(extra)))
        dt = str(g.attrs["dtype"])
        sw = int(g.attrs.get("slot_width", g["values"].shape[1]))
        v = to_float32(g["values"][...], dt)
        new = np.concatenate([v, fn(v[which].copy(), seq[which], pos[which])])
        new_rows = np.concatenate([rows, n_tok + np.arange(len(extra))])
        g["rows"].resize((len(new_rows),))
        g["rows"][...] = new_rows
        _rewrite(g, dt, sw, new, int(f.attrs["sketch_dim"]), int(f.attrs["sketch_seed"]))
        g.attrs.modify("flushed_rows", np.int64(len(new_rows)))
    return dst


def keep_rows(src: str | Path, dst: str | Path, name: str, keep: np.ndarray) -> Path:
    """A copy of trace ``src`` where tensor ``name`` keeps only the rows of mask ``keep``."""
    import h5py
    dst = _copy(Path(src), Path(dst))
    with h5py.File(dst, "r+") as f:
        g = f["tensors"][name]
        for ds in ("rows", "values", "sketch", "rms"):
            if ds in g:
                data = g[ds][...][keep]
                g[ds].resize((len(data),) + g[ds].shape[1:])
                g[ds][...] = data
        g.attrs.modify("flushed_rows", np.int64(int(keep.sum())))
    return dst


def mid_states(dtype=None) -> dict[str, np.ndarray]:
    """{f"attn{b}": [tokens, H]}: the output of decoder layer b's attention (o_proj), in the
    token order of :func:`boundary_states` and of the recorded traces."""
    import torch

    m = load_target(dtype)
    got: dict[str, torch.Tensor] = {}
    hooks = [layer.self_attn.o_proj.register_forward_hook(
        lambda mod, args, out, b=b: got.__setitem__(f"attn{b}", out)) for b, layer in enumerate(m.model.layers)]
    try:
        with torch.no_grad():
            m(torch.tensor(prompts()))
    finally:
        for h in hooks:
            h.remove()
    return {k: v.double().reshape(-1, v.shape[-1]).numpy() for k, v in got.items()}


def edited_target(root: str | Path, name: str, edit=None, config: dict | None = None) -> Path:
    """A copy of the trained target under ``root/name`` with ``edit(model)`` applied to its weights
    (under no_grad) and/or ``config`` attributes set on its config, saved as an HF directory."""
    import torch

    out = Path(root) / name
    if out.exists():
        return out
    m = load_target()
    if edit is not None:
        with torch.no_grad():
            edit(m)
    for k, v in (config or {}).items():
        setattr(m.config, k, v)
    m.save_pretrained(out)
    (out / "generation_config.json").unlink(missing_ok=True)
    return out
