"""`record train --from-serve` throughput against a plain HF forward over the same tokens, one run.

A serve run's outputs (``record serve --outputs`` JSONL: prompt + generated ids per request) are
written for ``--requests`` requests of ``--prompt-len`` + ``--new-tokens`` tokens; an 8-layer
Llama with random weights (built here, saved as a local checkpoint, never downloaded) is what
both sides load. Two tasks, each in this process (imports done once), interleaved in a random
order per round after one untimed warm-up of each:

1. ``plain forward``: the checkpoint loaded with ``AutoModelForCausalLM.from_pretrained``, then
   one forward per request over its tokens (batch 1: the batch ``record train`` runs), under
   ``torch.inference_mode``: what a user's script costs;
2. ``record train``: ``tensordiff record train --model DIR --from-serve OUTPUTS.jsonl --out T.h5``
   through the CLI's ``main`` (model load, the catalog with sketches and RMS, draft_input, the
   target's top-k log-probs (``--topk``, default 20), the trace's close), timed around the call.

Figure: ``from_serve_vs_forward`` = plain s / record s (tokens/s ratio; both include the
checkpoint load). Medians over ``--rounds``.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_train_from_serve.py [--requests 8] [--prompt-len 64]
        [--new-tokens 64] [--hidden 512] [--layers 8] [--rounds 5] [--threads 1] [--json FILE]

Exit 2 when torch/transformers are missing (nothing measured, and it says so).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from benchjson import Result  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--topk", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads (default 1: on a shared 2-core machine spinning OpenMP threads "
                         "measure the neighbours' load; 0: torch's default)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", metavar="FILE")
    a = ap.parse_args(argv)
    if min(a.requests, a.prompt_len, a.new_tokens, a.rounds) < 1 or a.layers < 8:
        print("bench_train_from_serve: counts must be positive, --layers >= 8", file=sys.stderr)
        return 2
    try:
        import torch
        from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
        from transformers.utils import logging as hf_logging
    except ImportError as e:
        print(f"bench_train_from_serve: needs torch + transformers: {e}", file=sys.stderr)
        return 2
    from tensordiff.cli import main as cli_main

    hf_logging.disable_progress_bar()
    if a.threads:
        torch.set_num_threads(a.threads)
    res = Result("bench_train_from_serve", {k: getattr(a, k) for k in (
        "requests", "prompt_len", "new_tokens", "hidden", "layers", "rounds", "topk", "threads", "seed")})
    work = tempfile.mkdtemp(prefix="td-from-serve-")
    try:
        torch.manual_seed(0)
        h = a.hidden
        cfg = LlamaConfig(vocab_size=4096, hidden_size=h, intermediate_size=int(h * 2.75) // 64 * 64,
                          num_hidden_layers=a.layers, num_attention_heads=max(1, h // 64),
                          num_key_value_heads=max(1, h // 256), initializer_range=0.3,
                          max_position_embeddings=max(4096, a.prompt_len + a.new_tokens))
        model_dir = os.path.join(work, "model")
        LlamaForCausalLM(cfg).eval().save_pretrained(model_dir)
        rng = random.Random(1)
        reqs = [(f"req-{i}", [rng.randrange(3, 4096) for _ in range(a.prompt_len)],
                 [rng.randrange(3, 4096) for _ in range(a.new_tokens)]) for i in range(a.requests)]
        outputs = os.path.join(work, "outputs.jsonl")
        with open(outputs, "w") as fh:
            for rid, ids, outs in reqs:
                fh.write(json.dumps({"id": rid, "input_ids": ids, "output_ids": outs}) + "\n")
        tokens = sum(len(i) + len(o) for _, i, o in reqs)

        def plain() -> float:
            t0 = time.perf_counter()
            m = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype="auto").eval()
            with torch.inference_mode():
                for _, ids, outs in reqs:
                    m(input_ids=torch.tensor(ids + outs, dtype=torch.long)[None], use_cache=False)
            return time.perf_counter() - t0

        def record() -> float:
            out = os.path.join(work, "t.h5")
            if os.path.exists(out):
                os.remove(out)
            t0 = time.perf_counter()
            with contextlib.redirect_stdout(io.StringIO()):
                # --convention: the draft input of its default ids, the workload this goal was measured
                # on (record train records one only where a draft flag is given)
                rc = cli_main(["record", "train", "--model", model_dir, "--from-serve", outputs, "--out", out,
                               "--no-progress", "--topk", str(a.topk), "--convention", "specforge"])
            dt = time.perf_counter() - t0
            if rc != 0:
                raise RuntimeError(f"record train exited {rc}")
            return dt

        tasks = {"plain forward": plain, "record train --from-serve": record}
        for f in tasks.values():   # warm-up: imports, the checkpoint in the page cache
            f()
        runs: dict[str, list[float]] = {k: [] for k in tasks}
        order = random.Random(a.seed)
        for r in range(a.rounds):
            names = list(tasks)
            order.shuffle(names)
            for n in names:
                runs[n].append(tasks[n]())
                print(f"  round {r + 1}: {n:28s} {runs[n][-1]:6.2f} s  load {os.getloadavg()[0]:.2f}", flush=True)
        pm, rm = statistics.median(runs["plain forward"]), statistics.median(runs["record train --from-serve"])
        ratios = [p / q for p, q in zip(runs["plain forward"], runs["record train --from-serve"])]
        print(f"\n{a.requests} requests, {tokens} tokens, {a.layers} layers x {a.hidden}, batch 1 per request")
        print(f"plain forward: {pm:.2f} s ({tokens / pm:.0f} tok/s); record train --from-serve: {rm:.2f} s "
              f"({tokens / rm:.0f} tok/s); ratio {pm / rm:.2f} (per-round median {statistics.median(ratios):.2f}; "
              "goal >= 0.8)")
        res.write(a.json, {"from_serve_vs_forward": pm / rm, "round_ratio_median": statistics.median(ratios),
                           "plain_s": pm, "record_s": rm, "tokens": tokens})
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
