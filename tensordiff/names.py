"""Canonical state names for any decoder model, and the table that maps module paths to them.

Boundaries (see :mod:`tensordiff.vocab`): ``embed``, ``layer<b>``, ``final_norm``. Sub-layer taps
of decoder layer b sit between boundary b (its input) and boundary b+1 (its output), in forward
order :data:`TAPS`: ``layer3.attn_norm``, ``layer3.q`` ... ``layer3.mlp_out``. Their depth (for
the default tolerance) and order (for the first divergence) are ``b + fraction``.

Tap meanings, the same in every implementation:

* ``attn_norm`` / ``mlp_norm``: the normalised input of attention / the MLP (the norms' output);
* ``q`` / ``k`` / ``v``: the projections' outputs [T, heads*head_dim], before any q/k norm and rope;
* ``q_rope`` / ``k_rope``: query and key after the rotary embedding, [T, heads*head_dim];
* ``attn_out``: the attention block's output after ``o_proj`` (before the residual add);
* ``router``: the MoE router logits [T, experts];
* ``mlp_gate`` / ``mlp_up``: the gate and up projections' outputs;
* ``mlp_act``: the down projection's input (``act(gate) * up``);
* ``mlp_out``: the MLP (or MoE block) output, before the residual add.

Module paths map to names through :data:`RULES` (one rule list per implementation: ``hf``
transformers, ``sglang``, ``vllm``; checked against transformers 5.19, SGLang 0.5.23 and vLLM 0.32
model files of Llama, Mistral, Qwen2/3, Qwen3-MoE, Mixtral and DeepSeek-V2/V3). Fused projections
are split by their known layouts: ``qkv_proj`` is ``[q | k | v]`` with widths in the ratio
``heads : kv_heads : kv_heads`` (also per tensor-parallel shard), ``gate_up_proj`` is
``[gate | up]`` in halves; a rotary module's output ``(q, k)`` gives both rope taps. Engine
decoder layers return ``(hidden, residual)``: the boundary is their sum. A user rule
(``REGEX=NAME``, :func:`parse_user_rule`) covers any other model.

Pure Python (no torch, no numpy): the diff, the recorders and the weights comparison share it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from .vocab import FINAL_NORM, LAYER_RE, boundary_label, layer_number

TAPS = ("attn_norm", "q", "k", "v", "q_rope", "k_rope", "attn_out",
        "mlp_norm", "router", "mlp_gate", "mlp_up", "mlp_act", "mlp_out")
_TAP_FRACTION = {t: (i + 1) / (len(TAPS) + 1) for i, t in enumerate(TAPS)}
_TAP_RE = re.compile(r"^layer([0-9]+)\.([a-z_]+)$")

IMPLEMENTATIONS = ("hf", "sglang", "vllm")
#: model types whose module layout the table knows (HF ``config.model_type``)
KNOWN_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "mixtral",
                               "deepseek_v2", "deepseek_v3"})


@dataclass(frozen=True)
class State:
    """A parsed canonical name. ``kind``: ``boundary``, ``final_norm`` or ``tap``; ``layer``: the
    boundary index, or the decoder layer a tap is inside."""

    name: str
    kind: str
    layer: int | None
    tap: str | None = None

    def depth(self, num_layers: int | None = None) -> float | None:
        """Forward depth in layers: a boundary's index, ``b + fraction`` for a tap of layer b, the
        layer count for ``final_norm`` (None when unknown)."""
        if self.kind == "final_norm":
            return float(num_layers) if num_layers is not None else None
        assert self.layer is not None
        if self.kind == "tap":
            assert self.tap is not None
            return self.layer + _TAP_FRACTION[self.tap]
        return float(self.layer)

    def order(self, num_layers: int | None = None) -> float:
        """Forward-order key: boundaries by index, a tap of layer b between b and b+1, final_norm
        after boundary N (the writer's convention: N + 0.5)."""
        if self.kind == "final_norm":
            return float(num_layers if num_layers is not None else 10**6) + 0.5
        d = self.depth(num_layers)
        assert d is not None
        return d


def parse_state(name: str) -> State:
    """``embed``, ``layer<b>``, ``final_norm`` or ``layer<b>.<tap>``; ValueError otherwise."""
    if name == "embed":
        return State(name, "boundary", 0)
    if name == FINAL_NORM:
        return State(name, "final_norm", None)
    m = LAYER_RE.match(name)
    if m:
        return State(name, "boundary", layer_number(m.group(1)))
    m = _TAP_RE.match(name)
    if m and m.group(2) in _TAP_FRACTION:
        return State(name, "tap", layer_number(m.group(1)), m.group(2))
    raise ValueError(f"not a canonical state name: {name!r} (embed, layer<b>, final_norm or "
                     f"layer<b>.<tap> with tap one of {', '.join(TAPS)})")


def maybe_state(name: str) -> State | None:
    try:
        return parse_state(name)
    except ValueError:
        return None


def tap_name(layer: int, tap: str) -> str:
    if tap not in _TAP_FRACTION:
        raise ValueError(f"unknown tap {tap!r}; one of {', '.join(TAPS)}")
    if layer < 0:
        raise ValueError(f"layer must be >= 0, got {layer}")
    return f"layer{int(layer)}.{tap}"


def layer_taps(layer: int, taps: Iterable[str] = TAPS) -> list[str]:
    return [tap_name(layer, t) for t in taps]


def parse_zoom(spec: str) -> int:
    """``--zoom layer3`` (or ``3``): the decoder layer whose taps to record."""
    s = spec.strip()
    m = LAYER_RE.match(s)
    if m:
        return layer_number(m.group(1), "--zoom layer")
    if s.isascii() and s.isdigit():
        return layer_number(s, "--zoom layer")
    from .safety import quoted

    raise ValueError(f"--zoom takes a decoder layer: layer<b> or <b>, not {quoted(spec)}")


# ----------------------------------------------------------------------------------------------
# The table: module path -> canonical names
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Rule:
    """One module of one implementation. ``pattern`` matches the whole qualified module path, its
    group ``b`` is the decoder layer; ``direction``: which value of the module (``input`` or
    ``output``); ``targets``: canonical templates (``{b}``, ``{b1}`` = b+1, ``{N}`` = the layer
    count); ``split``: how one value holds several targets (None: one tensor; ``qkv``, ``gate_up``:
    fused widths; ``tuple``: one tensor of the value per target; ``sum``: the sum of the value's
    first two tensors, an engine layer's ``(hidden, residual)``)."""

    pattern: str
    direction: str
    targets: tuple[str, ...]
    split: str | None = None


_L = r"(?:model\.)?layers\.(?P<b>\d+)"
_MOE = r"(?:mlp|block_sparse_moe)"

_HF = (
    Rule(r"(?:model\.)?embed_tokens", "output", ("embed",)),
    Rule(_L, "input", ("layer{b}",)),
    Rule(_L, "output", ("layer{b1}",)),
    Rule(r"(?:model\.)?norm", "input", ("layer{N}",)),
    Rule(r"(?:model\.)?norm", "output", (FINAL_NORM,)),
    Rule(_L + r"\.input_layernorm", "output", ("layer{b}.attn_norm",)),
    Rule(_L + r"\.self_attn\.q_proj", "output", ("layer{b}.q",)),
    Rule(_L + r"\.self_attn\.k_proj", "output", ("layer{b}.k",)),
    Rule(_L + r"\.self_attn\.v_proj", "output", ("layer{b}.v",)),
    Rule(_L + r"\.self_attn", "output", ("layer{b}.attn_out",)),
    Rule(_L + r"\.post_attention_layernorm", "output", ("layer{b}.mlp_norm",)),
    Rule(_L + r"\." + _MOE + r"\.gate", "output", ("layer{b}.router",)),
    Rule(_L + r"\.mlp\.gate_proj", "output", ("layer{b}.mlp_gate",)),
    Rule(_L + r"\.mlp\.up_proj", "output", ("layer{b}.mlp_up",)),
    Rule(_L + r"\.mlp\.down_proj", "input", ("layer{b}.mlp_act",)),
    Rule(_L + r"\." + _MOE, "output", ("layer{b}.mlp_out",)),
)

# SGLang and vLLM share the layout of these families (QKVParallelLinear, MergedColumnParallelLinear,
# a rotary module called with (positions, q, k) returning (q, k), RMSNorm returning
# (normed, residual) when given a residual, layers returning (hidden, residual)).
_ENGINE = (
    Rule(r"(?:model\.)?embed_tokens", "output", ("embed",)),
    Rule(_L, "output", ("layer{b1}",), "sum"),
    Rule(r"(?:model\.)?norm", "output", (FINAL_NORM,)),
    Rule(_L + r"\.input_layernorm", "output", ("layer{b}.attn_norm",)),
    Rule(_L + r"\.self_attn\.qkv_proj", "output", ("layer{b}.q", "layer{b}.k", "layer{b}.v"), "qkv"),
    Rule(_L + r"\.self_attn\.rotary_emb", "output", ("layer{b}.q_rope", "layer{b}.k_rope"), "tuple"),
    Rule(_L + r"\.self_attn", "output", ("layer{b}.attn_out",)),
    Rule(_L + r"\.post_attention_layernorm", "output", ("layer{b}.mlp_norm",)),
    Rule(_L + r"\." + _MOE + r"\.gate", "output", ("layer{b}.router",)),
    Rule(_L + r"\.mlp\.gate_up_proj", "output", ("layer{b}.mlp_gate", "layer{b}.mlp_up"), "gate_up"),
    Rule(_L + r"\.mlp\.down_proj", "input", ("layer{b}.mlp_act",)),
    Rule(_L + r"\." + _MOE, "output", ("layer{b}.mlp_out",)),
)

RULES: dict[str, tuple[Rule, ...]] = {"hf": _HF, "sglang": _ENGINE, "vllm": _ENGINE}


@dataclass(frozen=True)
class Mapped:
    """What one module value records: canonical ``names`` (several for a split), how to split."""

    path: str
    direction: str
    names: tuple[str, ...]
    split: str | None


def implementation_of(module_name: str) -> str | None:
    """``hf``, ``sglang`` or ``vllm`` from a model class's ``__module__``; None when unknown."""
    top = module_name.split(".", 1)[0]
    return {"transformers": "hf", "sglang": "sglang", "vllm": "vllm"}.get(top)


def _fill(template: str, b: int | None, num_layers: int | None) -> str | None:
    if "{N}" in template:
        if num_layers is None:
            return None
        return template.replace("{N}", str(int(num_layers)))
    if b is None:
        return template
    return template.replace("{b1}", str(b + 1)).replace("{b}", str(b))


def _apply(rule: Rule, m: re.Match[str], path: str, num_layers: int | None) -> Mapped | None:
    b = int(m.group("b")) if "b" in m.groupdict() and m.group("b") is not None else None
    names = []
    for t in rule.targets:
        n = _fill(t, b, num_layers)
        if n is None:
            return None
        st = parse_state(n)
        names.append(boundary_label(st.layer) if st.kind == "boundary" else n)  # boundary 0 is embed
    return Mapped(path, rule.direction, tuple(names), rule.split)


def canonical(path: str, direction: str, impl: str | None, num_layers: int | None = None,
              rules: Sequence[Rule] = ()) -> Mapped | None:
    """The canonical names of module ``path``'s ``direction`` value under implementation ``impl``
    (user ``rules`` first; ``impl`` None: the user rules only); None when nothing maps it. A boundary past ``num_layers`` maps to
    nothing (a layer output beyond the last is the final norm's input)."""
    if impl is not None and impl not in RULES:
        raise ValueError(f"unknown implementation {impl!r}; one of {', '.join(IMPLEMENTATIONS)}")
    for rule in (*rules, *(RULES[impl] if impl is not None else ())):
        if rule.direction != direction:
            continue
        m = re.fullmatch(rule.pattern, path)
        if m:
            out = _apply(rule, m, path, num_layers)
            if out is None:
                return None
            for n in out.names:
                st = parse_state(n)
                if num_layers is not None and st.kind == "boundary" and st.layer is not None and st.layer > num_layers:
                    return None
            return out
    return None


def parse_user_rule(spec: str) -> Rule:
    """A user rule ``REGEX=NAME`` (``REGEX:input=NAME`` for a module's input): REGEX matches the
    whole module path, a named group ``b`` (or the first group) is the decoder layer; NAME is a tap
    (``q``), a template (``layer{b}.q``, ``layer{b1}``) or a fixed state (``embed``)."""
    if "=" not in spec:
        raise ValueError(f"a name rule is REGEX=NAME, not {spec!r}")
    pattern, target = spec.rsplit("=", 1)
    direction = "output"
    if pattern.endswith(":input") or pattern.endswith(":output"):
        pattern, direction = pattern.rsplit(":", 1)
    try:
        rx = re.compile(pattern)
    except re.error as e:
        raise ValueError(f"name rule {spec!r}: bad regex ({e})") from None
    if "b" not in rx.groupindex:
        if rx.groups >= 1:
            pattern = re.sub(r"\((?!\?)", "(?P<b>", pattern, count=1)
        elif "{b" in target or target in _TAP_FRACTION:
            raise ValueError(f"name rule {spec!r}: the regex needs a group for the layer index")
    target = target.strip()
    if target in _TAP_FRACTION:
        target = "layer{b}." + target
    probe = target.replace("{b1}", "1").replace("{b}", "0").replace("{N}", "1")
    parse_state(probe)
    return Rule(pattern, direction, (target,))


def split_widths(split: str, width: int, config: dict[str, Any]) -> list[int]:
    """Widths of the parts of a fused value (``qkv``: heads : kv_heads : kv_heads, also per
    tensor-parallel shard; ``gate_up``: halves)."""
    if split == "gate_up":
        if width % 2:
            raise ValueError(f"a gate_up value of width {width} does not split in halves")
        return [width // 2, width // 2]
    if split == "qkv":
        nh = int(config.get("num_attention_heads") or 0)
        nkv = int(config.get("num_key_value_heads") or nh)
        total = nh + 2 * nkv
        if not nh or width % total:
            raise ValueError(f"a qkv value of width {width} does not split as {nh}:{nkv}:{nkv} heads")
        unit = width // total
        return [nh * unit, nkv * unit, nkv * unit]
    raise ValueError(f"not a width split: {split!r}")

