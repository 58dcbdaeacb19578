"""An EAGLE-3 draft model in plain torch, for the train side: the draft's fc output and its
predictions on the same tokens and target states the serve side saw.

It loads the checkpoint layout SGLang's ``LlamaForCausalLMEagle3`` loads (``config.json`` with
``eagle_config``, ``model.safetensors`` with ``midlayer.*`` or ``layers.0.*``, ``fc``, ``norm``,
``lm_head``, ``d2t``; optional ``norm_before_fc`` / ``fc_norm`` norms) and runs the draft
teacher-forced over a whole sequence, as training does: row t consumes the packed target states at
position t and the embedding of token t+1 and predicts token t+2. One decoder layer (the EAGLE-3
shape); the embedding is the target's. Written from the model's definition (RMSNorm, rotary
position embedding in the rotate-half form, grouped-query causal attention, SiLU MLP).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ..safety import read_json_file

__all__ = ["DraftOutput", "Eagle3Draft", "load_eagle3_draft"]


@dataclass
class DraftOutput:
    fc_output: torch.Tensor   # [T, H]: what fc computed from the draft input
    logits: torch.Tensor      # [T, V_draft]
    id_map: torch.Tensor      # [V_draft]: draft column -> target token id


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * w.float()).to(x.dtype)


class Eagle3Draft:
    def __init__(self, config: dict, weights: dict[str, torch.Tensor], *, path: str = ""):
        self.config = config
        self.path = path
        n_layers = int(config.get("num_hidden_layers", 1))
        if n_layers != 1:
            raise ValueError(f"an EAGLE-3 draft has one decoder layer; this config says {n_layers}")
        self.hidden = int(config["hidden_size"])
        self.heads = int(config["num_attention_heads"])
        self.kv_heads = int(config.get("num_key_value_heads") or self.heads)
        self.head_dim = int(config.get("head_dim") or self.hidden // self.heads)
        self.eps = float(config.get("rms_norm_eps", 1e-6))
        self.theta = float(config.get("rope_theta") or (config.get("rope_parameters") or {}).get("rope_theta", 10000.0))
        eagle = config.get("eagle_config") or {}
        self.aux_ids = eagle.get("eagle_aux_hidden_state_layer_ids")
        self.norm_before_fc = bool(eagle.get("norm_before_fc", config.get("norm_before_fc", False)))
        self.fc_norm = bool(config.get("fc_norm") or config.get("use_aux_norm"))
        w = {}
        for name, t in weights.items():
            name = name.removeprefix("model.")
            w[name.replace("midlayer.", "layers.0.")] = t
        self.w = w
        need = ["fc.weight", "norm.weight"] + [f"layers.0.{m}.weight" for m in (
            "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
            "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]
        missing = [m for m in need if m not in w]
        if missing:
            raise ValueError(f"the draft checkpoint lacks {', '.join(missing)}")
        self.num_aux = w["fc.weight"].shape[1] // int(config.get("target_hidden_size") or self.hidden)
        ones = torch.ones(self.hidden, dtype=w["fc.weight"].dtype)
        for m in ("layers.0.input_layernorm", "layers.0.hidden_norm", "layers.0.post_attention_layernorm"):
            w.setdefault(f"{m}.weight", ones)  # SGLang keeps an absent norm weight at its init (ones)
        if self.norm_before_fc:
            w.setdefault("input_norm.weight", torch.ones(w["fc.weight"].shape[1], dtype=ones.dtype))
        d2t = w.get("d2t")
        self.lm_head = w.get("lm_head.weight")
        if self.lm_head is not None:
            v = self.lm_head.shape[0]
            self.id_map = (d2t.long() + torch.arange(v)) if d2t is not None else torch.arange(v)
        else:
            self.id_map = None  # the target's lm_head (full vocabulary), set by bind_target

    def to(self, device, dtype=None) -> Eagle3Draft:
        self.w = {k: (v.to(device, dtype) if dtype is not None and v.is_floating_point() else v.to(device))
                  for k, v in self.w.items()}
        if self.lm_head is not None:
            self.lm_head = self.w["lm_head.weight"]
        return self

    def _rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        half = self.head_dim // 2
        inv = 1.0 / (self.theta ** (torch.arange(0, half, device=x.device, dtype=torch.float32) * 2 / self.head_dim))
        ang = pos.float()[:, None] * inv[None, :]
        cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
        xf = x.float()
        rot = torch.cat([-xf[..., half:], xf[..., :half]], -1)
        return (xf * cos[:, None, :] + rot * sin[:, None, :]).to(x.dtype)

    @torch.inference_mode()
    def forward(self, draft_input: torch.Tensor, next_embeds: torch.Tensor, positions: torch.Tensor,
                target_lm_head: torch.Tensor | None = None) -> DraftOutput:
        """``draft_input`` [T, K*H] (row t: target states at position t), ``next_embeds`` [T, H]
        (the target's embedding of token t+1), ``positions`` [T] (t): causal over the T rows."""
        w, eps = self.w, self.eps
        x = draft_input
        if self.norm_before_fc:
            x = _rms(x, w["input_norm.weight"], eps)
        if self.fc_norm:
            parts = x.chunk(self.num_aux, dim=-1)
            x = torch.cat([_rms(c, w.get(f"fc_norm.{i}.weight", torch.ones(c.shape[-1], dtype=c.dtype, device=c.device)), eps)
                           for i, c in enumerate(parts)], -1)
        fc = x @ w["fc.weight"].T
        if "fc.bias" in w:
            fc = fc + w["fc.bias"]
        residual = fc
        h = torch.cat([_rms(next_embeds, w["layers.0.input_layernorm.weight"], eps),
                       _rms(fc, w["layers.0.hidden_norm.weight"], eps)], -1)
        T = h.shape[0]
        q = (h @ w["layers.0.self_attn.q_proj.weight"].T).view(T, self.heads, self.head_dim)
        k = (h @ w["layers.0.self_attn.k_proj.weight"].T).view(T, self.kv_heads, self.head_dim)
        v = (h @ w["layers.0.self_attn.v_proj.weight"].T).view(T, self.kv_heads, self.head_dim)
        q, k = self._rope(q, positions), self._rope(k, positions)
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        att = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], is_causal=True)
        att = att[0].transpose(0, 1).reshape(T, self.heads * self.head_dim)
        h = att @ w["layers.0.self_attn.o_proj.weight"].T
        residual = h + residual
        h = _rms(residual, w["layers.0.post_attention_layernorm.weight"], eps)
        h = (torch.nn.functional.silu(h @ w["layers.0.mlp.gate_proj.weight"].T) * (h @ w["layers.0.mlp.up_proj.weight"].T)) \
            @ w["layers.0.mlp.down_proj.weight"].T
        out = _rms(h + residual, w["norm.weight"], eps)
        head = self.lm_head if self.lm_head is not None else target_lm_head
        if head is None:
            raise ValueError("the draft has no lm_head and no target lm_head was given")
        id_map = self.id_map if self.id_map is not None else torch.arange(head.shape[0])
        return DraftOutput(fc_output=fc, logits=out @ head.T, id_map=id_map)


def load_eagle3_draft(path: str) -> Eagle3Draft:
    """Load an EAGLE-3 draft directory (config.json + *.safetensors), never from a hub."""
    from safetensors.torch import load_file

    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"{path}: not a draft directory (no config.json)")
    config = read_json_file(os.path.join(path, "config.json"), "the draft's config.json")
    files = sorted(p for p in os.listdir(path) if p.endswith(".safetensors"))
    if not files:
        raise ValueError(f"{path}: no .safetensors weights")
    weights: dict[str, torch.Tensor] = {}
    for fn in files:
        weights.update(load_file(os.path.join(path, fn)))
    return Eagle3Draft(config, weights, path=os.path.abspath(path))
