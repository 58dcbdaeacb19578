"""What the fuzzer draws from, as data (no torch: the CLI checks its arguments against it)."""

from __future__ import annotations

MODELS = ("trained-llama", "random-llama", "qwen3", "mixtral")
DTYPE_PAIRS = (("float32", "float32"), ("bfloat16", "float32"), ("bfloat16", "bfloat16"), ("float16", "float32"))
MODES = ("full", "sketch", "packed")   # catalog values, catalog as sketches, packed draft input only

FAMILIES = {
    "weights": ("weight_scale", "weight_noise", "weight_stale", "permuted_heads", "transposed", "tp_shard"),
    "config": ("rope_theta", "rotary_dims", "norm_eps", "head_size", "attn_scale", "activation"),
    "code": ("residual", "norm_placement", "position_offset", "mask_lost"),
    "wiring": ("aux_ids", "slot_order", "norm_before_pack", "mixed_state"),
    "tokens": ("token_shift", "missing_bos"),
    "none": ("none",),
}
KINDS = tuple(k for ks in FAMILIES.values() for k in ks)
FAMILY = {k: f for f, ks in FAMILIES.items() for k in ks}
KNOB = {"weight_scale", "weight_noise", "weight_stale", "tp_shard", "rope_theta", "norm_eps", "attn_scale",
        "activation", "residual", "norm_placement", "norm_before_pack", "mixed_state"}
CAPPED = {"activation", "residual", "norm_placement", "norm_before_pack", "mixed_state"}
START = {"norm_eps": 1e-3, "rope_theta": 1e-2}   # the first magnitude tried (default 1e-2)

#: the slow tier's kinds (benchmarks/fuzz/engine.py), injected on the engine side of a real SGLang run:
#: kind -> the log-uniform range of its magnitude (None: as it is)
ENGINE_KINDS: dict[str, tuple[float, float] | None] = {
    "none": None,
    "weight_scale": (3e-3, 0.5),     # one projection of layer k of the served checkpoint times (1 + m)
    "weight_noise": (3e-3, 0.5),     # one projection + m std(W) N(0, 1)
    "rope_theta": (1e-3, 1.0),       # theta (1 + m) in the served config
    "norm_eps": (1e-4, 0.3),         # rms_norm_eps = m in the served config (every norm)
    "aux_ids": None,                 # the served draft's aux ids one lower: one boundary earlier
}
