"""A tiny DeepSeek-V3 (MLA + MoE) built locally, for the DeepSeek engine tests. Not a test module.

The founding bug happened on a DeepSeek-V3-family model, so the serve-side recorder is checked
on one: :func:`make_tiny_deepseek` writes a random ``DeepseekV3ForCausalLM`` (transformers, fixed
seed, nothing downloaded) with every part of the architecture that SGLang's ``deepseek_v2.py``
runs differently from a Llama:

* multi-head latent attention with small ranks (q_lora_rank 48, kv_lora_rank 32, rope head 8,
  nope head 16, v head 16) and DeepSeek's YaRN rope (SGLang's CPU rope accepts only
  ``deepseek_yarn``);
* the first layer dense (``first_k_dense_replace=1``), the others MoE: 4 routed experts, top-2,
  sigmoid scores with the ``noaux_tc`` correction bias, one shared expert;
* ``moe_layer_freq`` / ``scoring_func`` / ``topk_method`` written into config.json as the real
  DeepSeek-V3 config has them (SGLang reads them; transformers keeps them as plain attributes).

The weights look "trained" in the one way that matters here (see the project's notes on
training): a large embedding (std 8) and output projections scaled by 0.5 make the residual
stream dominate, so neighbouring boundaries sit at cos 0.78-0.94 (a slot's identity is
unambiguous) while bf16 stays within about 1% of float32. A purely random init of this shape
drifts 3% by layer 4 in bf16 and flips many more router choices.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

NUM_LAYERS = 5
HIDDEN = 64
NUM_EXPERTS = 4
TOP_K = 2

TINY_DEEPSEEK: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": HIDDEN,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": NUM_LAYERS,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "n_shared_experts": 1,
    "n_routed_experts": NUM_EXPERTS,
    "num_experts_per_tok": TOP_K,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "kv_lora_rank": 32,
    "q_lora_rank": 48,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "routed_scaling_factor": 1.0,
    "norm_topk_prob": True,
    "max_position_embeddings": 512,
    "num_nextn_predict_layers": 0,
    "rope_interleave": True,
    "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                        "original_max_position_embeddings": 128, "beta_fast": 32.0, "beta_slow": 1.0,
                        "mscale": 1.0, "mscale_all_dim": 1.0},
    # read by SGLang's deepseek_v2.py, present in every real DeepSeek-V3 config.json
    "moe_layer_freq": 1,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "ep_size": 1,
}
# vLLM's MLA (every CPU backend) takes kv_lora_rank + qk_rope_head_dim of 320, 512 or 576 only,
# and its AMX MLA packs W_UK in blocks of 32 input features, in bfloat16 only: the vLLM variant
# widens the latent and the heads to fit (everything else as above).
VLLM_VARIANT: dict[str, Any] = {"kv_lora_rank": 256, "qk_rope_head_dim": 64, "qk_nope_head_dim": 32, "v_head_dim": 32}
EMBED_STD = 8.0
OUT_SCALE = 0.5


def make_tiny_deepseek(path: str | os.PathLike, *, seed: int = 0, **overrides: Any) -> Path:
    """Write the tiny float32 ``DeepseekV3ForCausalLM`` to ``path`` (deterministic per seed;
    ``overrides``: config keys, e.g. :data:`VLLM_VARIANT`)."""
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    from sglang_support import _drop_generation_config_ids

    path = Path(path)
    config = DeepseekV3Config(**{**TINY_DEEPSEEK, **overrides}, initializer_range=0.3, rms_norm_eps=1e-6,
                              tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(config).to(torch.float32).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0.0, EMBED_STD)
        for name, p in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj")):
                p.mul_(OUT_SCALE)
        for layer in model.model.layers[1:]:  # a non-zero correction bias: SGLang must apply it as HF does
            layer.mlp.gate.e_score_correction_bias.copy_(torch.linspace(-0.05, 0.05, NUM_EXPERTS))
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    _drop_generation_config_ids(path)
    return path


def load_hf_deepseek(path: str | os.PathLike, dtype: str = "float32"):
    import torch
    from transformers import DeepseekV3ForCausalLM

    return DeepseekV3ForCausalLM.from_pretrained(str(path), dtype=getattr(torch, dtype)).eval()


def record_hf(target: str | os.PathLike, out: str | os.PathLike, prompts: list[list[int]], ids: list[int], *,
              dtype: str = "float32", convention: str = "vllm", catalog: bool = True, prepend_embed: bool = False,
              side: str = "train") -> Path:
    """The tiny DeepSeek at ``target`` recorded by the real train recorder (the HF extractor, in
    this process, one forward per prompt) in ``dtype``: ``draft_input`` packed for draft ``ids``
    under ``convention``, with the catalog (``catalog``) or without it, as a serve engine that
    records the draft input only leaves its trace."""
    import torch

    from tensordiff.conventions import plan_draft_input
    from tensordiff.recorders.core import Recorder
    from tensordiff.recorders.hf import HFExtractorRecorder, model_info

    net = load_hf_deepseek(target, dtype)
    plan = plan_draft_input(convention, ids, NUM_LAYERS, prepend_embed=prepend_embed)
    rec = Recorder(str(out), side=side, producer="tests/deepseek_support.py", model=model_info(net),
                   meta={"draft_plan": plan.as_attrs()})
    hf = HFExtractorRecorder(net, rec, plan, values="slots", catalog=catalog)
    try:
        for i, toks in enumerate(prompts):
            t = torch.tensor(toks)
            with hf.capture(f"p{i}", t), torch.inference_mode():
                net(input_ids=t[None], use_cache=False)
    except BaseException as e:
        rec.close(e)
        raise
    rec.close()
    return Path(out)
