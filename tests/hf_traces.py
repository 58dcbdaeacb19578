"""Builds traces from a real tiny HF transformers Llama (random weights, fixed seed, no hub) for
the aligner tests: every boundary (pre-norm, including boundary N), final_norm, and a packed
draft input whose slots are chosen by the test. Written through the real TraceWriter."""

from __future__ import annotations

import copy

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tensordiff.recorders.core import to_storage  # torch -> stored numpy (bf16 as bits)
from tensordiff.trace import SlotSpec, TraceWriter
from tensordiff.vocab import boundary_label

N_LAYERS, HIDDEN = 8, 64


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=256, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=N_LAYERS,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      initializer_range=0.3, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg).eval()


def prompts(n: int = 3, length: int = 24, seed: int = 1) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 256, length).tolist() for _ in range(n)]


@torch.no_grad()
def states(model, ids: list[int], dtype=torch.float32) -> dict:
    """{label: [T, H] tensor}: boundaries 0..N (N pre-norm, from the final norm's input) and final_norm."""
    m = model if dtype == next(model.parameters()).dtype else copy.deepcopy(model).to(dtype)
    captured = {}
    h = m.model.norm.register_forward_pre_hook(lambda mod, args: captured.__setitem__("pre", args[0][0]))
    h2 = m.model.norm.register_forward_hook(lambda mod, args, out: captured.__setitem__("post", out[0]))
    try:
        out = m(torch.tensor([ids]), output_hidden_states=True)
    finally:
        h.remove()
        h2.remove()
    hs = out.hidden_states
    st = {boundary_label(b): hs[b][0] for b in range(N_LAYERS)}
    st[boundary_label(N_LAYERS)] = captured["pre"]
    st["final_norm"] = captured["post"]
    return st


def write_trace(path, model, seqs, slots: list[str], *, side="train", dtype=torch.float32, shift=0, drop=0,
                nan_at=None, catalog=True, keys=None, regime=None, sketch_only=False,
                packed=("draft_input", "draft_input", 1)) -> None:
    """slots: labels of the states the draft input holds (what the pipeline really fed)."""
    dt = {torch.float32: "float32", torch.bfloat16: "bfloat16"}[dtype]
    regime = regime or ("train" if side == "train" else "prefill")
    with TraceWriter(path, side=side, producer="tests/hf_traces.py",
                     model={"num_layers": N_LAYERS, "hidden_size": HIDDEN, "dtype": dt}) as w:
        defined = False
        for i, ids in enumerate(seqs):
            st = states(model, ids, dtype)
            T = len(ids)
            pos = np.arange(T) + shift
            rows = w.add_tokens((keys or [f"seq{i}"] * len(seqs))[i] if keys else f"{side}-{i}",
                                pos[drop:], ids[drop:], regime)
            if not defined:
                if catalog:
                    for b in range(N_LAYERS + 1):
                        w.define_tensor(boundary_label(b), HIDDEN, kind="boundary", boundary=b, dtype=dt,
                                        role="catalog", values=not sketch_only)
                    w.define_tensor("final_norm", HIDDEN, kind="final_norm", dtype=dt, role="catalog",
                                    values=not sketch_only)
                pname, prole, poff = packed  # (name, role, token_offset) of the packed tensor
                w.define_tensor(pname, HIDDEN * len(slots), kind="packed", dtype=dt,
                                slots=SlotSpec(list(slots)), role=prole, token_offset=poff)
                defined = True
            if catalog:
                for label, t in st.items():
                    v = to_storage(t[drop:])
                    if nan_at and nan_at[0] == label and nan_at[1] == i:
                        v = v.copy()
                        v[nan_at[2] - drop, 5] = np.uint16(0x7FC0) if dt == "bfloat16" else np.nan
                    if sketch_only:
                        from tensordiff.sketch import sketch_np
                        from tensordiff.dtypes import to_float32
                        f = to_float32(v, dt)
                        w.append(label, rows, sketch=sketch_np(f, HIDDEN, w.sketch_dim, w.sketch_seed),
                                 rms=np.sqrt((f.astype(np.float64) ** 2).mean(1)).astype(np.float32))
                    else:
                        w.append(label, rows, v)
            packed_t = torch.cat([st[s] for s in slots], dim=-1)[drop:]
            w.append(packed[0], rows, to_storage(packed_t))
