"""The model and batch both serve plugins' overhead benchmarks (bench_sglang_overhead.py,
bench_vllm_overhead.py) run: a random Llama target (tests/sglang_support.py, nothing downloaded),
a tiny EAGLE-3 draft whose vocabulary holds the tokens the target emits most on the first two
prompts, and seeded prompts. Not a benchmark itself.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def add_model_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=8, help="prompts per generate call")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=32)


def build(root: Path, args: argparse.Namespace, draft: bool = True) -> dict:
    """{"target", "draft" (None without one), "prompts", "ids"} under ``root``: the target (head_dim
    64), ``args.batch`` prompts of ``args.prompt_len`` seeded token ids, the draft's aux ids
    ``[2, L // 2, L - 3]``."""
    import numpy as np
    import sglang_support as sup

    heads = max(1, args.hidden // 64)
    target = sup.make_tiny_llama(root / "target", hidden_size=args.hidden, num_hidden_layers=args.layers,
                                 intermediate_size=args.hidden * 2, num_attention_heads=heads,
                                 num_key_value_heads=max(1, heads // 2), vocab_size=args.vocab,
                                 max_position_embeddings=max(512, 2 * (args.prompt_len + args.new_tokens)))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, args.vocab, args.prompt_len).tolist() for _ in range(args.batch)]
    ids = [2, args.layers // 2, args.layers - 3]
    path = None
    if draft:
        hf = sup.load_hf_model(target)
        counts: dict[int, int] = {}
        for p in prompts[:2]:
            for t in sup.hf_greedy(hf, p, 8):
                counts[t] = counts.get(t, 0) + 1
        vocab = sorted(counts, key=lambda t: -counts[t])[:4]
        path = sup.make_tiny_eagle3_draft(root / "draft", target, aux_layer_ids=ids, draft_vocab=vocab)
    return {"target": target, "draft": path, "prompts": prompts, "ids": ids}
