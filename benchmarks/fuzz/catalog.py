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

#: the RL tier's kinds (benchmarks/fuzz/rl.py): a trainer/rollout pair judged on ``tensordiff triage``.
#: kind -> (family, the side the bug is on, the knob's range or None: as it is)
RL_KINDS: dict[str, tuple[str, str, tuple[float, float] | None]] = {
    "none": ("none", "-", None),
    "temperature": ("sampling", "trainer", (1e-3, 0.3)),      # the trainer divides by T (1 +- m)
    "top_p": ("sampling", "rollout", (0.5, 0.995)),           # processed log-probs of a top-p set, p
    "top_k": ("sampling", "rollout", (2.0, 64.0)),            # processed log-probs of a top-k set, k
    "stale_param": ("weights", "rollout", (1e-6, 1e-2)),      # one or every parameter one step behind; the step's lr
    "retokenized": ("tokens", "trainer", None),               # the trainer re-tokenises a response (a merge)
    "missing_bos": ("tokens", "trainer", None),               # the trainer's sequences lack the rollout's BOS
    "decode_kv_precision": ("engine", "rollout", None),       # K/V rounded to bf16 / fp8 where decode reads them
    "mask_lost_one_seq": ("trainer", "trainer", None),        # one sequence of a padded micro-batch unmasked
}
RL_FAMILY = {k: f"rl-{v[0]}" if k != "none" else "none" for k, v in RL_KINDS.items()}
RL_DTYPE_PAIRS = (("bfloat16", "float32"), ("float32", "float32"))   # rollout / trainer

#: The RL judge's table, written from docs/rl.md's order of evidence (not from the tool's output):
#: kind -> (the causes that name it, the causes that are true but less precise). A cause is
#: triage's JSON ``cause`` refined by its sentence (benchmarks/fuzz/rl.py ``cause_of``):
#: sampling, weights, tokens, routing, logits, incomplete; layer:decode (the engine's decode path,
#: or the onset exactly where the decode passes start), layer:positions (rope / position ids),
#: layer:sequences (a few sequences of a batch), layer:states (the first state out of the noise);
#: logprobs:modes (raw against processed, from the records), logprobs:offset (a systematic offset
#: with the logits agreeing), logprobs:beyond (log-probs out of the noise, the states agreeing).
#: Any other cause of an exit 1 is a wrong cause.
RL_ACCEPT: dict[str, tuple[frozenset[str], frozenset[str]]] = {
    "none": (frozenset(), frozenset()),
    # step 0: recorded temperatures that differ are a fact; an offset offering a one-sided temperature is true
    "temperature": (frozenset({"sampling"}), frozenset({"logprobs:offset", "logprobs:beyond"})),
    # step 5: the logits agree, the sampled tokens' log-probs carry an offset (renormalised over a set)
    "top_p": (frozenset({"logprobs:offset"}), frozenset({"logprobs:beyond"})),
    "top_k": (frozenset({"logprobs:offset"}), frozenset({"logprobs:beyond"})),
    # step 1: stale after update step k / the engine serves step k-1's weights; the states are downstream
    "stale_param": (frozenset({"weights"}), frozenset({"layer:states", "logprobs:beyond"})),
    # step 2: shifted or mismatched tokens
    "retokenized": (frozenset({"tokens"}), frozenset()),
    # a missing BOS shifts every token and position by one: tokens, or the positions from there on
    "missing_bos": (frozenset({"tokens"}), frozenset({"layer:positions"})),
    # step 4: onset where the decode passes start (the third trace tells the decode path apart)
    "decode_kv_precision": (frozenset({"layer:decode"}), frozenset({"layer:states", "logprobs:beyond"})),
    # step 4: the error sits in a few sequences (their attention mask or padding)
    "mask_lost_one_seq": (frozenset({"layer:sequences"}), frozenset({"layer:states"})),
}
