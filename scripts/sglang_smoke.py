#!/usr/bin/env python3
"""Smoke test: real SGLang on CPU against HF transformers, with tiny random models.

For each engine mode it builds tiny local checkpoints (nothing is downloaded),
generates greedily for two token-id prompts and checks:

* capture-only (target alone, ``enable_return_aux_hidden_states``): output ids
  equal HF greedy generation token for token, and the returned aux hidden
  states equal HF ``output_hidden_states`` at the resolved boundaries
  (Llama: draft id i -> ``hidden_states[i + 1]``), every row cosine > 0.9999;
* EAGLE-3 (target + random draft, ``intel_amx`` backend): output ids equal HF
  greedy generation token for token, and some drafts were accepted.

First it runs the differential self-check of the ``sgl_kernel`` stand-in
(``python -m sgl_kernel._selfcheck``) unless ``--skip-stub-check``.

Run from the repository root after ``scripts/install-sglang-cpu.sh``:

    .venv/bin/python scripts/sglang_smoke.py            # both modes
    .venv/bin/python scripts/sglang_smoke.py --mode capture

Exit status 0 when every check passes. Uses the test-only ``sgl_kernel``
stand-in under ``tests/sgl_kernel_stub`` (see ``tests/sglang_support.py``).
"""

from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

import sglang_support as sup  # noqa: E402

PROMPTS = [[1, 2, 3, 4, 5], [100, 50, 25, 12, 6, 3]]
COSINE_MIN = 0.9999


class Timer:
    def __init__(self) -> None:
        self.rows: list[tuple[str, float]] = []

    def __call__(self, label: str):
        timer = self

        class _Span:
            def __enter__(self):
                self.t0 = time.perf_counter()
                return self

            def __exit__(self, *exc):
                dt = time.perf_counter() - self.t0
                timer.rows.append((label, dt))
                print(f"[time] {label}: {dt:.2f} s", flush=True)

        return _Span()


def check_ids(mode: str, outputs, refs) -> list[str]:
    failures = []
    for i, (out, ref) in enumerate(zip(outputs, refs)):
        got = list(out["output_ids"])
        status = "ok" if got == ref else "MISMATCH"
        print(f"[{mode}] prompt {i}: {status} sglang={got}")
        if got != ref:
            print(f"[{mode}] prompt {i}:          hf    ={ref}")
            failures.append(f"{mode}: prompt {i} output ids differ from HF greedy")
    return failures


def check_aux(outputs, refs, hf_model, aux_ids, hidden) -> list[str]:
    import torch

    failures = []
    boundaries = sup.resolved_capture_ids(aux_ids)
    for i, (out, ref) in enumerate(zip(outputs, refs)):
        got = sup.aux_hidden_states(out, hidden, len(aux_ids))
        # Rows cover every forwarded position: the prompt, then each generated
        # token except the last (which is never fed back).
        seq = PROMPTS[i] + ref[:-1]
        if got.shape[0] != len(seq):
            failures.append(
                f"capture: prompt {i}: {got.shape[0]} aux rows, expected {len(seq)}"
            )
            continue
        hs = sup.hf_hidden_states(hf_model, seq)
        for k, (draft_id, b) in enumerate(zip(aux_ids, boundaries)):
            want = hs[b]
            cos = torch.nn.functional.cosine_similarity(got[:, k], want, dim=-1)
            max_abs = (got[:, k] - want).abs().max().item()
            ok = bool((cos > COSINE_MIN).all())
            print(
                f"[capture] prompt {i}: draft id {draft_id} -> hidden_states[{b}]: "
                f"min cos {cos.min().item():.7f}, max |diff| {max_abs:.2e} "
                f"{'ok' if ok else 'FAIL'}"
            )
            if not ok:
                failures.append(
                    f"capture: prompt {i} aux {k} vs hidden_states[{b}]: "
                    f"min cosine {cos.min().item():.6f}"
                )
            # The neighbouring boundaries must NOT match (catches an off-by-one).
            for other in (b - 1, b + 1):
                if 0 <= other < len(hs) and other != b:
                    c = torch.nn.functional.cosine_similarity(got[:, k], hs[other], dim=-1)
                    if bool((c > COSINE_MIN).all()):
                        failures.append(
                            f"capture: prompt {i} aux {k} also matches hidden_states[{other}]"
                        )
    return failures


def pick_draft_vocab(refs, n: int = 2) -> list[int]:
    counts = collections.Counter(t for ref in refs for t in ref)
    return [t for t, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:n]]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=["all", "capture", "eagle3"], default="all")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--workdir", help="where to write the tiny checkpoints (default: a temp dir)")
    ap.add_argument("--log-level", default="error")
    ap.add_argument(
        "--skip-stub-check", action="store_true",
        help="skip the differential self-check of the sgl_kernel stand-in",
    )
    args = ap.parse_args(argv)

    sup.prepare_cpu_env()
    timer = Timer()
    failures: list[str] = []

    if not args.skip_stub_check:
        # Each stand-in op against SGLang's own triton kernel (run by triton's
        # interpreter) or a torch formulation. A separate process: the
        # interpreter must be switched on before triton is imported.
        with timer("sgl_kernel stand-in self-check"):
            rc = subprocess.call(
                [sys.executable, "-W", "ignore", "-m", "sgl_kernel._selfcheck"],
                env=dict(os.environ), cwd=str(REPO),
            )
        if rc != 0:
            failures.append("sgl_kernel stand-in self-check failed")
    aux_ids = list(sup.DEFAULT_AUX_LAYER_IDS)
    hidden = sup.TINY_LLAMA["hidden_size"]

    with tempfile.TemporaryDirectory(prefix="tensordiff-sglang-smoke-") as tmp:
        root = Path(args.workdir or tmp)
        with timer("build tiny target checkpoint"):
            target = sup.make_tiny_llama(root / "tiny-llama")
        with timer("HF reference (greedy + hidden states)"):
            hf_model = sup.load_hf_model(target)
            refs = [sup.hf_greedy(hf_model, p, args.max_new_tokens) for p in PROMPTS]

        if args.mode in ("all", "capture"):
            with timer("capture-only: engine start-up"):
                engine = sup.start_capture_engine(target, aux_ids, log_level=args.log_level)
            try:
                with timer("capture-only: generate"):
                    outs = sup.greedy_generate(
                        engine, PROMPTS, args.max_new_tokens, return_hidden_states=True
                    )
            finally:
                with timer("capture-only: shutdown"):
                    engine.shutdown()
            failures += check_ids("capture", outs, refs)
            failures += check_aux(outs, refs, hf_model, aux_ids, hidden)

        if args.mode in ("all", "eagle3"):
            draft_vocab = pick_draft_vocab(refs)
            with timer("build tiny EAGLE-3 draft checkpoint"):
                draft = sup.make_tiny_eagle3_draft(
                    root / "tiny-llama-eagle3", target, aux_layer_ids=aux_ids,
                    draft_vocab=draft_vocab,
                )
            print(f"[eagle3] draft vocabulary (target ids): {draft_vocab}")
            with timer("eagle3: engine start-up"):
                engine = sup.start_eagle3_engine(target, draft, log_level=args.log_level)
            try:
                with timer("eagle3: generate (first call, includes torch.compile)"):
                    outs = sup.greedy_generate(engine, PROMPTS, args.max_new_tokens)
                with timer("eagle3: generate (second call)"):
                    outs2 = sup.greedy_generate(engine, PROMPTS, args.max_new_tokens)
            finally:
                with timer("eagle3: shutdown"):
                    engine.shutdown()
            failures += check_ids("eagle3", outs, refs)
            failures += check_ids("eagle3 (2nd)", outs2, refs)
            accepted = sum(int(o["meta_info"].get("spec_num_correct_drafts", 0)) for o in outs)
            verifies = sum(int(o["meta_info"].get("spec_verify_ct", 0)) for o in outs)
            print(f"[eagle3] {verifies} verify passes, {accepted} draft tokens accepted")
            if verifies == 0:
                failures.append("eagle3: no speculative verify pass ran")
            if accepted == 0:
                failures.append("eagle3: no draft token was ever accepted")

    print("\n== timings ==")
    for label, dt in timer.rows:
        print(f"  {label:55s} {dt:7.2f} s")
    if failures:
        print("\n== FAILED ==")
        for f in failures:
            print("  - " + f)
        return 1
    print("\n== all checks passed ==")
    return 0


if __name__ == "__main__":
    sys.exit(main())
