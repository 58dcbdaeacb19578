"""The bug catalog: each kind is injected on side B only, by an edit of its weights or config (in
float32, before the cast), a forward hook on its model, its packing step (wiring) or the token ids
and positions it is run on (tokens). Never by editing a trace the tool then reads.

A kind with a size knob (``knob=True``) takes a magnitude ``m``; the generator calibrates ``m`` to
a drawn size in noise units. A kind without one has the size it has (measured all the same).
Blends that end at a discrete bug (an activation, a missing residual, a norm before packing) cap
``m`` at 1: the full bug.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .catalog import CAPPED, FAMILIES, FAMILY, KINDS, KNOB, START
from .models import Injection, Model

__all__ = ["CAPPED", "FAMILIES", "FAMILY", "KINDS", "KNOB", "START", "Place", "draw_place", "inject"]



@dataclass(frozen=True)
class Place:
    layer: int = 0          # decoder layer
    op: str = ""            # its projection, where the kind has one
    slot: int = 0           # draft-input slot
    seq: int = 0            # sequence
    pos: int = 0            # first position affected
    seed: int = 0           # the noise of a noised weight


def draw_place(kind: str, m: Model, rng: np.random.Generator) -> Place:
    from .models import layer_ops

    ops = list(layer_ops(m))
    if kind == "tp_shard":
        ops = [o for o in ops if o in ("q_proj", "gate_proj", "up_proj")]
    if kind == "transposed":
        ops = ["o_proj", "q_proj"]
    return Place(layer=int(rng.integers(0, m.layers)), op=str(rng.choice(ops)), slot=int(rng.integers(0, len(m.aux_ids))),
                 seq=int(rng.integers(0, len(m.prompts))), pos=int(rng.integers(4, 24)), seed=int(rng.integers(0, 2**31)))


def _attn(net: Any, layer: int) -> Any:
    return net.model.layers[layer].self_attn


def _linear(net: Any, layer: int, op: str) -> Any:
    lay = net.model.layers[layer]
    return getattr(lay.self_attn, op) if hasattr(lay.self_attn, op) else getattr(lay.mlp, op)


def _noise(w: torch.Tensor, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(w.shape, generator=g, dtype=torch.float32) * w.float().std()


def _rms(x: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    return (xf / xf.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt()).to(x.dtype)


class _Blend(torch.nn.Module):
    """(1 - m) silu + m gelu(tanh): an activation that is partly the wrong one."""

    def __init__(self, act: torch.nn.Module, m: float):
        super().__init__()
        self.act, self.m = act, m

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = (1 - self.m) * self.act(x) + self.m * torch.nn.functional.gelu(x, approximate="tanh")
        return y


def _out_hook(module: Callable[[Any], Any],
              fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> Callable[[Any], Any]:
    """A forward hook on ``module(net)`` replacing its output y (a tensor or a tuple's first) by fn(input, y)."""
    def attach(net: Any) -> Any:
        def hook(mod: Any, args: Any, kwargs: Any, out: Any) -> Any:
            x = args[0] if args else kwargs.get("hidden_states")
            if isinstance(out, tuple):
                return (fn(x, out[0]),) + out[1:]
            return fn(x, out)
        return module(net).register_forward_hook(hook, with_kwargs=True)
    return attach


def inject(kind: str, m: Model, p: Place, mag: float) -> tuple[Callable[[Any], None] | None, Injection]:
    """(an edit of B's float32 weights and config, or None; what B does at recording time)."""
    edit: Callable[[Any], None] | None = None
    inj = Injection()
    k, op = p.layer, p.op
    if kind == "none":
        pass
    elif kind == "weight_scale":
        def edit(net: Any) -> None:
            _linear(net, k, op).weight.mul_(1 + mag)
    elif kind == "weight_noise":
        def edit(net: Any) -> None:
            w = _linear(net, k, op).weight
            w.add_(mag * _noise(w, p.seed))
    elif kind == "weight_stale":   # every linear weight one update behind: W + m std(W) N(0, 1)
        def edit(net: Any) -> None:
            for i, (name, w) in enumerate(sorted(net.model.layers.named_parameters())):
                if w.dim() == 2 and name.endswith("proj.weight"):
                    w.add_(mag * _noise(w, p.seed + i))
    elif kind == "tp_shard":       # one of two column-parallel shards of a projection noised
        def edit(net: Any) -> None:
            w = _linear(net, k, op).weight
            half = w.shape[0] // 2
            sh = w[half:] if p.seed % 2 else w[:half]
            sh.add_(mag * _noise(sh, p.seed))
    elif kind == "permuted_heads":  # two query heads of different kv groups swapped in q_proj only
        def edit(net: Any) -> None:
            a = _attn(net, k)
            hd = a.head_dim
            w = a.q_proj.weight
            h0, h1 = 0, a.num_key_value_groups
            tmp = w[h0 * hd:(h0 + 1) * hd].clone()
            w[h0 * hd:(h0 + 1) * hd] = w[h1 * hd:(h1 + 1) * hd]
            w[h1 * hd:(h1 + 1) * hd] = tmp
    elif kind == "transposed":
        def edit(net: Any) -> None:
            w = _linear(net, k, op).weight
            w.copy_(w.t().contiguous())
    elif kind == "rope_theta":     # theta * (1 + m): inv_freq_j = theta^(-2j/d)
        def edit(net: Any) -> None:
            r = net.model.rotary_emb
            theta = float(net.config.rope_parameters["rope_theta"])
            new = r.inv_freq.double() ** (np.log(theta * (1 + mag)) / np.log(theta))
            r.inv_freq.copy_(new.float())
            r.original_inv_freq.copy_(new.float())
    elif kind == "rotary_dims":    # partial rotary: the lowest quarter of the frequencies not rotated
        def edit(net: Any) -> None:
            r = net.model.rotary_emb
            n = r.inv_freq.numel()
            r.inv_freq[n - max(1, n // 4):] = 0
            r.original_inv_freq.copy_(r.inv_freq)
    elif kind == "norm_eps":
        def edit(net: Any) -> None:
            net.model.layers[k].input_layernorm.variance_epsilon = mag
    elif kind == "head_size":      # the scale of a head size twice the real one
        def edit(net: Any) -> None:
            a = _attn(net, k)
            a.scaling = (2 * a.head_dim) ** -0.5
    elif kind == "attn_scale":
        def edit(net: Any) -> None:
            _attn(net, k).scaling *= 1 + mag
    elif kind == "activation":     # silu -> (1 - m) silu + m gelu(tanh)
        def edit(net: Any) -> None:
            net.model.layers[k].mlp.act_fn = _Blend(net.model.layers[k].mlp.act_fn, mag)
    elif kind == "residual":       # the decoder layer's output loses m of its input (the residual)
        inj.hooks.append(_out_hook(lambda net: net.model.layers[k], lambda x, y: y - mag * x))
    elif kind == "norm_placement":  # the layer's output normalised (a post-norm), blended by m
        inj.hooks.append(_out_hook(lambda net: net.model.layers[k], lambda x, y: y + mag * (_rms(y) - y)))
    elif kind == "position_offset":  # sequence s: position ids jump by 1 + seed % 3 from position pos on
        d = 1 + p.seed % 3

        def mpos(i: int, T: int) -> np.ndarray:
            pos = np.arange(T)
            if i == p.seq:
                pos[p.pos:] += d
            return pos
        inj.model_positions = mpos
    elif kind == "mask_lost":      # layer k attends without its causal mask in one sequence (SDPA's is_causal)
        def unmask(net: Any, i: int) -> None:
            _attn(net, k).is_causal = i != p.seq
        inj.before_seq = unmask
    elif kind == "aux_ids":        # B reads the ids as "output of layer id" (one boundary later), honestly labelled
        inj.wiring = None          # handled by the plan: see scenario.record_b
    elif kind == "slot_order":     # two slots packed swapped, labelled in the plan's order
        s0, s1 = p.slot, (p.slot + 1) % len(m.aux_ids)

        def swap(parts: list[torch.Tensor], every: dict[str, torch.Tensor]) -> list[torch.Tensor]:
            parts = list(parts)
            parts[s0], parts[s1] = parts[s1], parts[s0]
            return parts
        inj.wiring = swap
    elif kind == "norm_before_pack":
        def normed(parts: list[torch.Tensor], every: dict[str, torch.Tensor]) -> list[torch.Tensor]:
            parts = list(parts)
            x = parts[p.slot]
            parts[p.slot] = x + mag * (_rms(x) - x)
            return parts
        inj.wiring = normed
    elif kind == "mixed_state":    # slot s holds its state + m (the next boundary - it)
        from tensordiff.vocab import boundary_label, parse_label

        def mixed(parts: list[torch.Tensor], every: dict[str, torch.Tensor]) -> list[torch.Tensor]:
            from .models import slot_labels
            parts = list(parts)
            b = parse_label(slot_labels(m)[p.slot])
            nxt = every[boundary_label(int(b) + 1)] if b is not None else parts[p.slot]
            parts[p.slot] = parts[p.slot] + mag * (nxt - parts[p.slot])
            return parts
        inj.wiring = mixed
    elif kind == "token_shift":    # B's token table one position later than it ran
        inj.table_positions = lambda i, T: np.arange(T) + 1
    elif kind == "missing_bos":    # B runs every sequence without its first token
        inj.ids = lambda i, ids: ids[1:]
    else:
        raise ValueError(f"unknown bug kind {kind!r}")
    return edit, inj
