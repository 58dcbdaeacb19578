#!/usr/bin/env python3
"""What one verify step of the SGLang plugin's bookkeeping costs, back to back and right after an
engine-like pass: why the plugin records captured passes in a batch instead of in its hooks.

No engine: the plugin's own functions (:func:`tensordiff.recorders.sglang.forward._target_predictions`
and :func:`tensordiff.recorders.sglang.verify.commit_verify`) on a real staged recorder, with the
stand-ins for SGLang's verify result and batch that tests/test_sglang_verify_batch.py uses. A verify
pass of ``--batch`` requests x ``--block`` rows, aux states ``3 x --hidden`` wide, ``--vocab``
logits. Each step is timed in two conditions, alternating in random order after a warm-up:

* ``back_to_back``: the steps follow each other (what recording a queue of captured passes is);
* ``after_pass``: a ``--matmul`` x ``--matmul`` float32 matmul on torch's thread pool runs before
  the step (a model's forward pass: it fills the caches and leaves OpenMP workers spinning).

Reported: the median microseconds per step of each and their ratio (``after_pass_ratio``).

    PYTHONPATH=. .venv/bin/python benchmarks/bench_sglang_hooks.py [--steps 400] [--batch 8] [--block 4]
        [--hidden 512] [--vocab 1024] [--matmul 512] [--seed 0] [--json FILE]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from types import SimpleNamespace

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from benchjson import Result  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=400, help="timed steps per condition")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--block", type=int, default=4, help="rows per request in a verify pass (draft tokens + 1)")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--matmul", type=int, default=512, help="size of the engine-like matmul before a step")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args(argv)
    result = Result("bench_sglang_hooks", vars(args) | {"json": None})
    try:
        import numpy as np
        import torch
    except ImportError:
        print("bench_sglang_hooks: torch is not installed; nothing measured", file=sys.stderr)
        return 2
    from tensordiff.recorders.core import Recorder
    from tensordiff.recorders.sglang import forward, verify
    from tensordiff.recorders.sglang.config import Config
    from tensordiff.recorders.sglang.state import STATE, Pass

    bs, c, h = args.batch, args.block, args.hidden
    n = bs * c
    rng = np.random.default_rng(args.seed)
    torch.manual_seed(args.seed)
    with tempfile.TemporaryDirectory(prefix="tensordiff-bench-hooks-") as tmp:
        rec = Recorder(os.path.join(tmp, "t.h5"), side="serve", model={"num_layers": 8, "hidden_size": h},
                       sketch=False, stage_bytes=64 << 20)
        STATE.rec, STATE.cfg = rec, Config(path="unused", topk=20)
        STATE.model = {"num_layers": 8, "hidden_size": h}
        STATE.labels, STATE.raw_ids, STATE.convention = ["layer3", "layer5", "layer7"], [2, 4, 6], "sglang-llama"
        STATE.spec_chain = True
        segs = [(f"r{i}", i * c, c) for i in range(bs)]
        for rid, _, _ in segs:
            rec.add_tokens(rid, np.arange(128), rng.integers(0, args.vocab, 128), regime="prefill")
        reqs = [SimpleNamespace(rid=rid, origin_input_ids=range(128),
                                sampling_params=SimpleNamespace(max_new_tokens=1 << 30)) for rid, _, _ in segs]
        keys0 = np.array([rid for rid, _, _ in segs for _ in range(c)], dtype=object)
        a = torch.randn(args.matmul, args.matmul)
        pos0 = [128]

        def step() -> float:
            pos = np.concatenate([np.arange(pos0[0], pos0[0] + c) for _ in range(bs)]).astype(np.int64)
            pos0[0] += c
            ids = rng.integers(0, args.vocab, n).astype(np.int64)
            hs = torch.randn(n, 3 * h)
            logits = torch.randn(n, args.vocab)
            acc = rng.integers(1, c + 1, bs)
            ai = np.full((bs, c), -1)
            for i in range(bs):
                ai[i, :acc[i]] = np.arange(i * c, i * c + acc[i])
            result = SimpleNamespace(accept_lens=torch.from_numpy(acc), accept_index=torch.from_numpy(ai),
                                     logits_output=SimpleNamespace(hidden_states=hs))
            p = Pass(hs=hs, rows=np.full(n, -1, dtype=np.int64), keys=(keys0, pos, ids), segments=segs, step=1,
                     regime="target_verify")
            STATE.target_logits = (None, None, None, SimpleNamespace(next_token_logits=logits))
            for rid, _, _ in segs:
                STATE.chain[rid] = []
            t0 = time.perf_counter()
            forward._target_predictions(p)
            verify.commit_verify(p, result, SimpleNamespace(reqs=reqs))
            return time.perf_counter() - t0

        conds = ["back_to_back", "after_pass"]
        times: dict[str, list[float]] = {k: [] for k in conds}
        for _ in range(20):  # warm-up
            step()
        pick = random.Random(args.seed)
        for _ in range(args.steps):
            order = list(conds)
            pick.shuffle(order)
            for cond in order:
                if cond == "after_pass":
                    a @ a
                times[cond].append(step())
            if len(rec._staged) and rec._staged_bytes > (48 << 20):
                rec.write_staged()  # outside the timed steps, as the idle flush would
        rec.close()
        STATE.rec, STATE.closed = None, True  # closed here: nothing left for the plugin's exit hook
    med = {k: statistics.median(v) * 1e6 for k, v in times.items()}
    figures = {"back_to_back_us": med["back_to_back"], "after_pass_us": med["after_pass"],
               "after_pass_ratio": med["after_pass"] / med["back_to_back"]}
    result.write(args.json, figures)
    print(f"SGLang plugin verify step ({bs} requests x {c} rows, aux {3 * h} wide, vocab {args.vocab}), "
          f"median of {args.steps}:")
    print(f"  back to back:                 {med['back_to_back']:8.1f} us")
    print(f"  after a {args.matmul}^2 matmul (a pass): {med['after_pass']:8.1f} us  "
          f"({figures['after_pass_ratio']:.2f}x)")
    print(f"torch threads {torch.get_num_threads()}; load average (1 min) {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
