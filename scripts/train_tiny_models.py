"""Train a tiny Llama and its EAGLE-3 draft on CPU, from text shipped with Python's standard
library, so tests and benchmarks measure noise on a model that looks trained (random-weight models
blow their bf16 error up with depth; a trained one stays residual-dominated).

    python scripts/train_tiny_models.py [--out DIR] [--force]

Deterministic: a fixed list of stdlib source files (the corpus), a byte-level tokenizer (token id
= byte value, vocabulary 256: nothing to download or fit), fixed seeds, single-threaded float32
training. The result is cached under ``.cache/trained/<key>/`` (gitignored), where the key hashes
this script, the corpus bytes and the torch version, so a second call returns at once and an edit
of the script retrains. Writes:

- ``target/``: the Llama as ``save_pretrained`` writes it (config.json + model.safetensors),
- ``draft/``: its EAGLE-3 draft in SGLang's checkpoint layout (``midlayer.*``, ``fc``, ``norm``,
  ``lm_head``, ``d2t``, ``t2d``; aux ids 2, 4, 6 = boundaries layer3, layer5, layer7),
- ``prompts.jsonl``: held-out prompts (token ids, from a file the model was not trained on),
- ``stats.json``: training losses and the measurements docs/diff.md quotes.

No network, no hub; torch + transformers + safetensors only (the ``torch`` extra).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import sysconfig
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / ".cache" / "trained"

# The corpus: standard-library sources, in this order. Prose-heavy modules (docstrings, comments)
# give the model something learnable at byte level.
TRAIN_FILES = ("textwrap.py", "string.py", "fractions.py", "heapq.py", "bisect.py", "calendar.py",
               "difflib.py", "shlex.py", "fnmatch.py", "colorsys.py", "csv.py", "pprint.py",
               "statistics.py", "getopt.py", "queue.py", "sched.py", "glob.py", "imghdr.py", "locale.py")
HELD_OUT = ("numbers.py", "operator.py")   # the prompts come from text the model has not seen

CONFIG = {
    "vocab_size": 256, "hidden_size": 64, "intermediate_size": 192, "num_hidden_layers": 8,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "initializer_range": 0.02, "tie_word_embeddings": False,
}
AUX_IDS = (2, 4, 6)          # EAGLE-3 ids: capture hidden_states[id + 1] = layer3, layer5, layer7
SEQ, BATCH, STEPS, LR = 96, 16, 450, 3e-3
DRAFT_STEPS, DRAFT_LR = 150, 3e-3
N_PROMPTS, PROMPT_LEN = 12, 40
SEED = 20261203


def corpus_paths(names: tuple[str, ...]) -> list[Path]:
    lib = Path(sysconfig.get_paths()["stdlib"])
    return [lib / n for n in names if (lib / n).is_file()]


def corpus(names: tuple[str, ...]) -> bytes:
    return b"\n".join(p.read_bytes() for p in corpus_paths(names))


def cache_key() -> str:
    import torch

    h = hashlib.sha256(Path(__file__).read_bytes())
    h.update(corpus(TRAIN_FILES))
    h.update(corpus(HELD_OUT))
    h.update(torch.__version__.split("+")[0].encode())
    return h.hexdigest()[:16]


def _batches(data, gen, n: int):
    import torch

    starts = torch.randint(0, len(data) - SEQ - 1, (n, BATCH), generator=gen)
    for s in starts:
        yield torch.stack([data[i:i + SEQ + 1] for i in s.tolist()])


def _lr(step: int, total: int, peak: float) -> float:
    warm = max(1, total // 20)
    if step < warm:
        return peak * (step + 1) / warm
    return peak * 0.5 * (1 + math.cos(math.pi * (step - warm) / max(1, total - warm)))


def train_target(data, log):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    cfg = LlamaConfig(**CONFIG, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = LlamaForCausalLM(cfg).float().train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.01)
    gen = torch.Generator().manual_seed(SEED)
    losses = []
    for step, b in enumerate(_batches(data, gen, STEPS)):
        for g in opt.param_groups:
            g["lr"] = _lr(step, STEPS, LR)
        out = model(input_ids=b[:, :-1], labels=b[:, :-1], use_cache=False)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(float(out.loss.detach()))
        if step % 100 == 0 or step == STEPS - 1:
            log(f"target step {step}: loss {sum(losses[-20:]) / len(losses[-20:]):.3f}")
    return model.eval(), losses


class _Draft:
    """The EAGLE-3 draft's parameters, trained teacher-forced as tensordiff.recorders.eagle3 runs
    it: row t takes the aux states at t and the embedding of token t+1 and predicts token t+2."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, inter: int, vocab: int, k: int, gen):
        import torch

        hd = hidden // heads

        def p(*shape, std=0.02):
            return torch.nn.Parameter(torch.randn(*shape, generator=gen) * std)

        self.hidden, self.heads, self.kv_heads, self.hd = hidden, heads, kv_heads, hd
        self.w = {
            "midlayer.self_attn.q_proj.weight": p(heads * hd, 2 * hidden),
            "midlayer.self_attn.k_proj.weight": p(kv_heads * hd, 2 * hidden),
            "midlayer.self_attn.v_proj.weight": p(kv_heads * hd, 2 * hidden),
            "midlayer.self_attn.o_proj.weight": p(hidden, heads * hd),
            "midlayer.mlp.gate_proj.weight": p(inter, hidden),
            "midlayer.mlp.up_proj.weight": p(inter, hidden),
            "midlayer.mlp.down_proj.weight": p(hidden, inter),
            "midlayer.input_layernorm.weight": torch.nn.Parameter(torch.ones(hidden)),
            "midlayer.hidden_norm.weight": torch.nn.Parameter(torch.ones(hidden)),
            "midlayer.post_attention_layernorm.weight": torch.nn.Parameter(torch.ones(hidden)),
            "fc.weight": p(hidden, k * hidden),
            "norm.weight": torch.nn.Parameter(torch.ones(hidden)),
            "lm_head.weight": p(vocab, hidden),
        }

    def logits(self, packed, next_embeds, eps: float, theta: float):
        import torch
        import torch.nn.functional as F

        w = self.w

        def rms(x, g):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * g

        B, T, _ = packed.shape
        fc = packed @ w["fc.weight"].T
        h = torch.cat([rms(next_embeds, w["midlayer.input_layernorm.weight"]),
                       rms(fc, w["midlayer.hidden_norm.weight"])], -1)
        q = (h @ w["midlayer.self_attn.q_proj.weight"].T).view(B, T, self.heads, self.hd)
        k = (h @ w["midlayer.self_attn.k_proj.weight"].T).view(B, T, self.kv_heads, self.hd)
        v = (h @ w["midlayer.self_attn.v_proj.weight"].T).view(B, T, self.kv_heads, self.hd)
        half = self.hd // 2
        inv = 1.0 / (theta ** (torch.arange(0, half, dtype=torch.float32) * 2 / self.hd))
        ang = torch.arange(T, dtype=torch.float32)[:, None] * inv[None, :]
        cos, sin = torch.cat([ang.cos()] * 2, -1)[None, :, None], torch.cat([ang.sin()] * 2, -1)[None, :, None]

        def rope(x):
            return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin

        q, k = rope(q), rope(k)
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
        att = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        att = att.transpose(1, 2).reshape(B, T, self.heads * self.hd)
        res = att @ w["midlayer.self_attn.o_proj.weight"].T + fc
        x = rms(res, w["midlayer.post_attention_layernorm.weight"])
        x = (F.silu(x @ w["midlayer.mlp.gate_proj.weight"].T) * (x @ w["midlayer.mlp.up_proj.weight"].T)) \
            @ w["midlayer.mlp.down_proj.weight"].T
        return rms(x + res, w["norm.weight"]) @ w["lm_head.weight"].T


def train_draft(model, data, log):
    import torch
    import torch.nn.functional as F

    c = model.config
    gen = torch.Generator().manual_seed(SEED + 1)
    d = _Draft(c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.intermediate_size, c.vocab_size,
               len(AUX_IDS), gen)
    opt = torch.optim.AdamW(list(d.w.values()), lr=DRAFT_LR, betas=(0.9, 0.95), weight_decay=0.0)
    embed = model.get_input_embeddings()
    losses = []
    for step, b in enumerate(_batches(data, gen, DRAFT_STEPS)):
        for g in opt.param_groups:
            g["lr"] = _lr(step, DRAFT_STEPS, DRAFT_LR)
        with torch.no_grad():
            hs = model(input_ids=b[:, :-1], output_hidden_states=True, use_cache=False).hidden_states
            packed = torch.cat([hs[i + 1] for i in AUX_IDS], -1)[:, :-1]   # row t: states at t
            nxt = embed(b[:, 1:-1])                                         # token t+1
        logits = d.logits(packed, nxt, c.rms_norm_eps, 10000.0)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), b[:, 2:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        if step % 100 == 0 or step == DRAFT_STEPS - 1:
            log(f"draft step {step}: loss {sum(losses[-20:]) / len(losses[-20:]):.3f}")
    return d, losses


def save_draft(d: _Draft, model, path: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    c = model.config
    cfg = LlamaConfig(hidden_size=c.hidden_size, intermediate_size=c.intermediate_size, num_hidden_layers=1,
                      num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
                      vocab_size=c.vocab_size, max_position_embeddings=c.max_position_embeddings,
                      rms_norm_eps=c.rms_norm_eps, rope_theta=10000.0, tie_word_embeddings=False,
                      bos_token_id=None, eos_token_id=None, pad_token_id=None).to_dict()
    cfg.update(architectures=["LlamaForCausalLMEagle3"], model_type="llama", draft_vocab_size=c.vocab_size,
               target_hidden_size=c.hidden_size, torch_dtype="float32",
               eagle_config={"eagle_aux_hidden_state_layer_ids": list(AUX_IDS), "use_aux_hidden_state": True})
    t = {k: v.detach().float().contiguous() for k, v in d.w.items()}
    t["d2t"] = torch.zeros(c.vocab_size, dtype=torch.int64)
    t["t2d"] = torch.ones(c.vocab_size, dtype=torch.bool)
    path.mkdir(parents=True, exist_ok=True)
    save_file(t, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def held_out_prompts() -> list[list[int]]:
    text = corpus(HELD_OUT)
    # prose lines only (docstrings and comments read most like the training text), fixed stride
    step = max(1, (len(text) - PROMPT_LEN) // N_PROMPTS)
    return [list(text[i * step:i * step + PROMPT_LEN]) for i in range(N_PROMPTS)]


def build(out: Path, log=print) -> Path:
    """Train both models into ``out`` (a fresh directory); returns ``out``."""
    import torch

    torch.set_num_threads(1)   # the same sums whatever the machine: reproducible weights
    torch.use_deterministic_algorithms(True)
    data = torch.tensor(list(corpus(TRAIN_FILES)), dtype=torch.long)
    t0 = time.time()
    model, losses = train_target(data, log)
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():   # left by a build that was killed
        import shutil
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp / "target", safe_serialization=True)
    gen = tmp / "target" / "generation_config.json"
    if gen.exists():
        gen.unlink()
    d, dlosses = train_draft(model, data, log)
    save_draft(d, model, tmp / "draft")
    with open(tmp / "prompts.jsonl", "w") as f:
        for i, ids in enumerate(held_out_prompts()):
            f.write(json.dumps({"id": f"p{i}", "input_ids": ids}) + "\n")
    stats = {"corpus_bytes": int(len(data)), "steps": STEPS, "draft_steps": DRAFT_STEPS,
             "loss_first": losses[0], "loss_last20": sum(losses[-20:]) / 20,
             "draft_loss_last20": sum(dlosses[-20:]) / 20, "seconds": round(time.time() - t0, 1),
             "torch": torch.__version__, "python": sys.version.split()[0]}
    (tmp / "stats.json").write_text(json.dumps(stats, indent=2) + "\n")
    os.replace(tmp, out)
    return out


def trained_dir(force: bool = False, log=print) -> Path:
    """The cached directory (built on first use)."""
    import fcntl
    import shutil

    out = CACHE / cache_key()
    CACHE.mkdir(parents=True, exist_ok=True)
    # test workers run side by side (pytest-xdist): one trains, the others wait for its result
    # instead of training into the same temporary directory
    with open(CACHE / (out.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if force and out.exists():
            shutil.rmtree(out)
        if not (out / "stats.json").exists():
            build(out, log)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="write here instead of the cache")
    p.add_argument("--force", action="store_true", help="retrain even when cached")
    a = p.parse_args(argv)
    if a.out:
        build(Path(a.out))
        print(a.out)
    else:
        print(trained_dir(a.force))
    return 0


if __name__ == "__main__":
    sys.exit(main())
