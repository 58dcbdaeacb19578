"""Builds traces from a real tiny HF transformers Llama (fixed seed, no hub) for the aligner tests:
every boundary (pre-norm, including boundary N), final_norm, and a packed draft input whose slots
are chosen by the test. Written through the real TraceWriter.

Two kinds of model:

- :func:`tiny_llama`: random weights (``initializer_range`` 0.3). Consecutive boundaries are far
  apart (cos well below 0.99), so every state is easy to tell from its neighbours.
- :func:`near_residual_llama`: the same random model with every residual branch scaled down: the
  output projections of attention (``o_proj``) and of the MLP (``down_proj``) are multiplied by
  ``alpha`` (default 0.0015). Each decoder layer then adds a small update to the residual stream,
  ``h[b+1] = h[b] + alpha * f(h[b])``, as in a trained deep model, and consecutive boundaries reach
  cos 0.99-0.9999 (measured per token on one prompt: 8 layers 0.9948-0.9992, 32 layers
  0.9922-0.9995, 61 layers 0.9930-0.9995; with ``alpha=0.0003``, 32 layers 0.9997-0.99997, where
  the old fixed margin of mean scores (0.002) could not tell neighbouring layers apart). bf16
  rounding (1 - cos ~1e-5..4e-4 against fp32) stays smaller than the step between two layers.

Slot labels of :func:`write_trace` name what the draft input really holds: a boundary label,
``final_norm``, ``mid<b>`` (the residual inside layer b after attention, ``h[b] + attn_b``: a state
no catalog records) or ``norm(<label>)`` (the state RMS-normalised per token: the right state at
the wrong scale). ``claims`` are the labels the trace states (default: the same).
"""

from __future__ import annotations

import copy

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tensordiff.recorders.core import to_storage  # torch -> stored numpy (bf16 as bits)
from tensordiff.trace import SlotSpec, TraceWriter
from tensordiff.vocab import boundary_label

N_LAYERS, HIDDEN = 8, 64
NEAR_RESIDUAL_ALPHA = 0.0015


def tiny_llama(seed: int = 0, layers: int = N_LAYERS, hidden: int = HIDDEN) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=256, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      initializer_range=0.3, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg).eval()


@torch.no_grad()
def near_residual_llama(layers: int = N_LAYERS, seed: int = 0, hidden: int = HIDDEN,
                        alpha: float = NEAR_RESIDUAL_ALPHA) -> LlamaForCausalLM:
    """A tiny Llama that looks trained: residual branches scaled by ``alpha`` (module docstring)."""
    m = tiny_llama(seed, layers, hidden)
    for layer in m.model.layers:
        layer.self_attn.o_proj.weight.mul_(alpha)
        layer.mlp.down_proj.weight.mul_(alpha)
    return m


def n_layers(model) -> int:
    return int(model.config.num_hidden_layers)


def prompts(n: int = 3, length: int = 24, seed: int = 1) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 256, length).tolist() for _ in range(n)]


def shared_prefix_prompts(n: int = 3, prefix: int = 12, length: int = 24, seed: int = 3) -> list[list[int]]:
    """``n`` prompts that share their first ``prefix`` tokens (a system prompt)."""
    rng = np.random.default_rng(seed)
    head = rng.integers(1, 256, prefix).tolist()
    return [head + rng.integers(1, 256, length - prefix).tolist() for _ in range(n)]


@torch.no_grad()
def states(model, ids: list[int], dtype=torch.float32) -> dict:
    """{label: [T, H] tensor}: boundaries 0..N (N pre-norm, from the final norm's input), final_norm,
    and mid<b> (the residual after attention inside layer b) for every layer."""
    m = model if dtype == next(model.parameters()).dtype else copy.deepcopy(model).to(dtype)
    captured = {}
    hooks = [m.model.norm.register_forward_pre_hook(lambda mod, args: captured.__setitem__("pre", args[0][0])),
             m.model.norm.register_forward_hook(lambda mod, args, out: captured.__setitem__("post", out[0]))]
    for b, layer in enumerate(m.model.layers):
        hooks.append(layer.post_attention_layernorm.register_forward_pre_hook(
            lambda mod, args, b=b: captured.__setitem__(f"mid{b}", args[0][0])))
    try:
        out = m(torch.tensor([ids]), output_hidden_states=True)
    finally:
        for h in hooks:
            h.remove()
    L = n_layers(m)
    hs = out.hidden_states
    st = {boundary_label(b): hs[b][0] for b in range(L)}
    st[boundary_label(L)] = captured["pre"]
    st["final_norm"] = captured["post"]
    for b in range(L):
        st[f"mid{b}"] = captured[f"mid{b}"]
    return st


def _slot_state(st: dict, label: str) -> torch.Tensor:
    if label.startswith("norm(") and label.endswith(")"):
        x = st[label[5:-1]]
        return (x.float() / x.float().pow(2).mean(-1, keepdim=True).add(1e-6).sqrt()).to(x.dtype)
    return st[label]


def write_trace(path, model, seqs, slots: list[str], *, side="train", dtype=torch.float32, shift=0, drop=0,
                nan_at=None, catalog=True, keys=None, regime=None, sketch_only=False,
                packed=("draft_input", "draft_input", 1), claims=None, catalog_positions=None,
                slot_shift=0, drop_tail=0, sketch_seed=None, catalog_dtype=None, packed_values=True,
                packed_seqs=None) -> None:
    """slots: what the draft input really holds (module docstring); claims: what the trace says.

    ``drop``: leading positions without rows (a prefix-cache hit), an int or one per sequence;
    ``drop_tail``: trailing positions without rows; ``catalog_positions``: only the first k
    positions of each sequence have catalog rows (a partial catalog); ``slot_shift``: the draft
    input row at token t holds the states of token t + slot_shift; ``catalog_dtype``: the catalog's
    dtype when it differs from the draft input's; ``packed_values=False``: the draft input keeps
    sketches only; ``packed_seqs``: indices of the sequences that have draft-input rows."""
    dt = {torch.float32: "float32", torch.bfloat16: "bfloat16"}[dtype]
    cdtype = catalog_dtype or dtype
    cdt = {torch.float32: "float32", torch.bfloat16: "bfloat16"}[cdtype]
    regime = regime or ("train" if side == "train" else "prefill")
    L = n_layers(model)
    extra = {} if sketch_seed is None else {"sketch_seed": sketch_seed}
    with TraceWriter(path, side=side, producer="tests/hf_traces.py",
                     model={"num_layers": L, "hidden_size": HIDDEN, "dtype": dt}, **extra) as w:
        defined = False
        for i, ids in enumerate(seqs):
            st = states(model, ids, dtype)
            cst = st if cdtype == dtype else states(model, ids, cdtype)
            T = len(ids)
            d0 = drop[i] if isinstance(drop, (list, tuple)) else drop
            d1 = T - drop_tail
            pos = np.arange(T) + shift
            rows = w.add_tokens((keys or [f"seq{i}"] * len(seqs))[i] if keys else f"{side}-{i}",
                                pos[d0:d1], ids[d0:d1], regime)
            if not defined:
                if catalog:
                    for b in range(L + 1):
                        w.define_tensor(boundary_label(b), HIDDEN, kind="boundary", boundary=b, dtype=cdt,
                                        role="catalog", values=not sketch_only)
                    w.define_tensor("final_norm", HIDDEN, kind="final_norm", dtype=cdt, role="catalog",
                                    values=not sketch_only)
                pname, prole, poff = packed  # (name, role, token_offset) of the packed tensor
                w.define_tensor(pname, HIDDEN * len(slots), kind="packed", dtype=dt,
                                slots=SlotSpec(list(claims or slots)), role=prole, token_offset=poff,
                                values=packed_values)
                defined = True
            if catalog:
                k = len(rows) if catalog_positions is None else min(len(rows), catalog_positions)
                for b in list(range(L + 1)) + [None]:
                    label = boundary_label(b)
                    v = to_storage(cst[label][d0:d1][:k])
                    if nan_at and nan_at[0] == label and nan_at[1] == i:
                        v = v.copy()
                        v[nan_at[2] - d0, 5] = np.uint16(0x7FC0) if cdt == "bfloat16" else np.nan
                    if sketch_only:
                        from tensordiff.dtypes import to_float32
                        from tensordiff.sketch import sketch_np
                        f = to_float32(v, cdt)
                        w.append(label, rows[:k], sketch=sketch_np(f, HIDDEN, w.sketch_dim, w.sketch_seed),
                                 rms=np.sqrt((f.astype(np.float64) ** 2).mean(1)).astype(np.float32))
                    else:
                        w.append(label, rows[:k], v)
            packed_t = torch.cat([_slot_state(st, s) for s in slots], dim=-1)[d0:d1]
            prow = rows
            if slot_shift:
                packed_t = packed_t[slot_shift:]
                prow = rows[:len(rows) - slot_shift]
            if packed_seqs is not None and i not in packed_seqs:
                continue
            if packed_values:
                w.append(packed[0], prow, to_storage(packed_t))
            else:
                from tensordiff.sketch import sketch_np
                f = packed_t.float().numpy()
                w.append(packed[0], prow, sketch=sketch_np(f, HIDDEN, w.sketch_dim, w.sketch_seed),
                         rms=np.sqrt((f.reshape(len(f), -1, HIDDEN).astype(np.float64) ** 2).mean(-1)).astype(np.float32))
