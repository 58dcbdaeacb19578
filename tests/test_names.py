"""Canonical state names (boundaries and sub-layer taps) and the module-path table of HF, SGLang and
vLLM (pure: no torch)."""

from __future__ import annotations

import pytest

from tensordiff import names
from tensordiff.names import canonical, parse_state, parse_user_rule, split_widths


def test_taps_sit_between_their_boundaries_in_forward_order():
    seq = ["embed", "layer1", *names.layer_taps(1), "layer2", *names.layer_taps(3), "layer4", "final_norm"]
    orders = [parse_state(s).order(num_layers=4) for s in seq]
    assert orders == sorted(orders) and len(set(orders)) == len(orders)
    st = parse_state("layer3.q_rope")
    assert st.kind == "tap" and st.layer == 3 and st.tap == "q_rope"
    assert 3 < st.depth(8) < 4
    assert parse_state("final_norm").depth(8) == 8.0
    assert parse_state("layer3").depth() == 3.0
    for bad in ("layer3.qq", "layer.q", "model.layers.3.output", "layer3.q.x"):
        with pytest.raises(ValueError):
            parse_state(bad)


def test_zoom_spec():
    assert names.parse_zoom("layer3") == 3 and names.parse_zoom("5") == 5
    with pytest.raises(ValueError):
        names.parse_zoom("embed")


HF = {
    ("model.embed_tokens", "output"): ("embed",),
    ("model.layers.0", "input"): ("embed",),
    ("model.layers.2", "input"): ("layer2",),
    ("model.layers.3", "output"): ("layer4",),
    ("model.norm", "input"): ("layer8",),
    ("model.norm", "output"): ("final_norm",),
    ("model.layers.3.input_layernorm", "output"): ("layer3.attn_norm",),
    ("model.layers.3.self_attn.q_proj", "output"): ("layer3.q",),
    ("model.layers.3.self_attn.k_proj", "output"): ("layer3.k",),
    ("model.layers.3.self_attn.v_proj", "output"): ("layer3.v",),
    ("model.layers.3.self_attn", "output"): ("layer3.attn_out",),
    ("model.layers.3.post_attention_layernorm", "output"): ("layer3.mlp_norm",),
    ("model.layers.3.mlp.gate_proj", "output"): ("layer3.mlp_gate",),
    ("model.layers.3.mlp.up_proj", "output"): ("layer3.mlp_up",),
    ("model.layers.3.mlp.down_proj", "input"): ("layer3.mlp_act",),
    ("model.layers.3.mlp", "output"): ("layer3.mlp_out",),
    ("model.layers.3.mlp.gate", "output"): ("layer3.router",),          # Mixtral / Qwen-MoE / DeepSeek
}

ENGINE = {
    ("model.embed_tokens", "output"): ("embed",),
    ("model.layers.3", "output"): ("layer4",),
    ("model.norm", "output"): ("final_norm",),
    ("model.layers.3.self_attn.qkv_proj", "output"): ("layer3.q", "layer3.k", "layer3.v"),
    ("model.layers.3.self_attn.rotary_emb", "output"): ("layer3.q_rope", "layer3.k_rope"),
    ("model.layers.3.mlp.gate_up_proj", "output"): ("layer3.mlp_gate", "layer3.mlp_up"),
    ("model.layers.3.block_sparse_moe.gate", "output"): ("layer3.router",),   # Mixtral in SGLang / vLLM
    ("model.layers.3.block_sparse_moe", "output"): ("layer3.mlp_out",),
    ("model.layers.3.mlp.down_proj", "input"): ("layer3.mlp_act",),
}


@pytest.mark.parametrize("impl,table", [("hf", HF), ("sglang", ENGINE), ("vllm", ENGINE)])
def test_the_table_maps_each_implementation(impl, table):
    for (path, direction), want in table.items():
        m = canonical(path, direction, impl, num_layers=8)
        assert m is not None and m.names == want, (impl, path, direction, m)
    # experts, shared experts and the layer's own input in an engine (positions come first) map to nothing
    for path, direction in [("model.layers.3.mlp.experts.0.gate_proj", "output"),
                            ("model.layers.3.mlp.shared_expert.gate_proj", "output"),
                            ("model.layers.3.mlp.shared_expert_gate", "output"), ("lm_head", "output")]:
        assert canonical(path, direction, impl, num_layers=8) is None
    assert canonical("model.layers.3", "output", "sglang", 8).split == "sum"
    assert canonical("model.layers.3", "input", "sglang", 8) is None


def test_fused_splits_follow_the_known_layouts():
    cfg = {"num_attention_heads": 32, "num_key_value_heads": 8}
    assert split_widths("qkv", (32 + 16) * 128, cfg) == [4096, 1024, 1024]
    assert split_widths("qkv", (8 + 4) * 128, cfg) == [1024, 256, 256]      # one of 4 tensor-parallel shards
    assert split_widths("gate_up", 2 * 11008, cfg) == [11008, 11008]
    with pytest.raises(ValueError):
        split_widths("qkv", 1000, cfg)


def test_user_rules_cover_other_models():
    r = parse_user_rule(r"blocks\.(\d+)\.attn\.wq=q")
    assert canonical("blocks.2.attn.wq", "output", "hf", 4, rules=[r]).names == ("layer2.q",)
    r2 = parse_user_rule(r"blocks\.(?P<b>\d+):input=layer{b}")
    assert canonical("blocks.2", "input", "hf", 4, rules=[r2]).names == ("layer2",)
    for bad in ("no-equals", r"blocks\.\d+\.wq=q", r"(x=layer{b}.nope", r"blocks\.(\d+)=mlp_outt"):
        with pytest.raises(ValueError):
            parse_user_rule(bad)
