#!/usr/bin/env python3
"""Regenerate the example trace pair in traces/ (deterministic: fixed seeds, greedy decoding, fp32).

It reproduces the founding bug on a tiny local Llama (8 layers, hidden 64, random weights, seed 0):

* traces/train.h5: the train side, recorded by ``tensordiff record train`` with the speculators
  legacy extractor that built ``[hs[0]] + [hs[id + 1] for id in ids]`` = ``[embed, layer3, layer5,
  layer7]`` for draft ids ``[2, 4, 6]`` and took ``[:-1]``: the draft was fed
  ``[embed, layer3, layer5]``;
* traces/serve.h5: the serve side, recorded by the tensordiff SGLang plugin inside real SGLang
  0.5.23 running EAGLE-3 with a tiny random draft whose config says ``[2, 4, 6]``; SGLang's llama
  ``+1`` convention captures ``[layer3, layer5, layer7]`` and feeds them to the draft.

Both sides see the same prompts (traces/prompts.jsonl). Then::

    $ .venv/bin/python -m tensordiff diff traces/train.h5 traces/serve.h5
    train feeds draft_input [embed, layer3, layer5], serve feeds [layer3, layer5, layer7]; the draft was trained on train's

The checkpoints go to traces/model and traces/draft (not committed: traces/.gitignore); the
prompts and both traces are committed. SGLang runs on this machine's CPU with the test-only
``sgl_kernel`` stand-in (tests/sglang_support.py), so run it after scripts/install-sglang-cpu.sh:

    .venv/bin/python scripts/make_example_traces.py [--out traces] [--check]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))

import sglang_support as sup  # noqa: E402

AUX_IDS = [2, 4, 6]
MAX_NEW_TOKENS = 4
SKETCH_DIM = 64  # both sides; smaller than the default 128 to keep the committed pair small
TOPK = 20        # both sides: target_topk and draft_topk, for the acceptance analysis
EXPECTED = ("train feeds draft_input [embed, layer3, layer5], serve feeds [layer3, layer5, layer7]; "
            "the draft was trained on train's")


def make_prompts(n: int = 4, seed: int = 7) -> list[dict]:
    import numpy as np

    rng = np.random.default_rng(seed)
    lengths = [12, 10, 14, 8][:n]
    return [{"id": f"p{i}", "input_ids": rng.integers(1, sup.TINY_LLAMA["vocab_size"], L).tolist()}
            for i, L in enumerate(lengths)]


def pick_draft_vocab(model_dir: Path, prompts: list[dict], n: int = 2) -> list[int]:
    """The target tokens the random draft may propose: the ones greedy decoding emits most, so that
    some drafts get accepted and the trace has accepted verify rows as well as rejected ones."""
    hf = sup.load_hf_model(model_dir)
    counts = collections.Counter(t for p in prompts for t in sup.hf_greedy(hf, p["input_ids"], MAX_NEW_TOKENS))
    return [t for t, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:n]]


def record_train(out: Path, model: Path, prompts: Path, draft: Path) -> None:
    # with the draft: its fc output and top-k predictions beside the target's (the acceptance analysis)
    cmd = [sys.executable, "-m", "tensordiff", "record", "train", "--model", str(model), "--prompts", str(prompts),
           "--draft", str(draft), "--topk", str(TOPK),
           "--aux-ids", *map(str, AUX_IDS), "--convention", "speculators-legacy", "--prepend-embed",
           "--dtype", "float32", "--device", "cpu", "--values", "none", "--sketch-dim", str(SKETCH_DIM),
           "--no-progress", "--force", "--out", str(out / "train.h5")]
    print("$", " ".join(os.path.relpath(c, REPO) if c.startswith(str(REPO)) else c for c in cmd[1:]), flush=True)
    subprocess.run(cmd, check=True, cwd=REPO)


def record_serve(out: Path, model: Path, draft: Path, prompts: Path) -> dict:
    from tensordiff.recorders import serve_cli

    argv = ["--model", str(model), "--draft", str(draft), "--prompts", str(prompts), "--out", str(out / "serve.h5"),
            "--catalog", "--values", "draft_input", "--sketch-dim", str(SKETCH_DIM),
            "--max-new-tokens", str(MAX_NEW_TOKENS), "--device", "cpu", "--dtype", "float32",
            "--attention-backend", "intel_amx", "--mem-fraction-static", "0.1", "--max-total-tokens", "2048",
            "--chunked-prefill-size", "256", "--topk", str(TOPK), "--outputs", str(out / "serve_outputs.jsonl")]
    print("$ tensordiff record serve", " ".join(os.path.relpath(a, REPO) if a.startswith(str(REPO)) else a
                                                for a in argv), flush=True)
    p = argparse.ArgumentParser()
    serve_cli.add_arguments(p)
    args = p.parse_args(argv)
    # the CPU stand-in for sgl_kernel, and the AMX override EAGLE needs on a CPU without AMX
    sup.prepare_cpu_env()
    os.environ["SGLANG_PLUGINS"] = "tensordiff"
    res = serve_cli.record(args, start_engine=sup.start_engine)
    serve_cli._print_summary(res)
    return res


def compact(path: Path) -> None:
    """Rewrite a trace with the same content, its datasets chunked to their length and gzipped.

    Storage layout (an ``h5repack``): every row and value is copied as it is, and every attribute,
    but for one change: the paths the recorders write (model, draft, prompts) are made relative to
    the repository (``traces/model``), so the committed pair names no directory of the machine that
    recorded it. The writer allocates chunks of up to 512 rows per dataset for streaming; for a
    trace of a few dozen rows that is mostly empty space, which the shipped example does not need."""
    import h5py

    tmp = path.with_suffix(".tmp.h5")
    root = str(REPO) + os.sep

    def rel(v):
        if isinstance(v, bytes) and root.encode() in v:
            return v.replace(root.encode(), b"")
        if isinstance(v, str) and root in v:
            return v.replace(root, "")
        return v

    def copy(src, dst) -> None:
        for k, v in src.attrs.items():
            dst.attrs[k] = rel(v)
        for name, obj in src.items():
            if isinstance(obj, h5py.Group):
                copy(obj, dst.create_group(name))
                continue
            data = obj[()]
            rows = max(1, min(int(obj.shape[0]), 4096)) if obj.shape else None
            kw = {}
            if obj.dtype.kind not in "OSU" and h5py.check_string_dtype(obj.dtype) is None and obj.shape:
                kw = {"compression": "gzip", "compression_opts": 9, "shuffle": True}
            ds = dst.create_dataset(name, data=data, dtype=obj.dtype, chunks=(rows,) + obj.shape[1:] if rows else None,
                                    maxshape=(None,) + obj.shape[1:] if rows else None, **kw)
            for k, v in obj.attrs.items():
                ds.attrs[k] = rel(v)

    with h5py.File(path, "r") as src, h5py.File(tmp, "w") as dst:
        copy(src, dst)
    os.replace(tmp, path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(REPO / "traces"), help="output directory (default traces/)")
    ap.add_argument("--check", action="store_true", help="only diff the existing pair and check the first line")
    args = ap.parse_args(argv)
    out = Path(args.out)
    if not args.check:
        out.mkdir(parents=True, exist_ok=True)
        model, draft = out / "model", out / "draft"
        if not (model / "config.json").exists():
            sup.make_tiny_llama(model, seed=0)
        prompts = make_prompts()
        ppath = out / "prompts.jsonl"
        ppath.write_text("".join(json.dumps(p) + "\n" for p in prompts))
        if not (draft / "config.json").exists():
            vocab = pick_draft_vocab(model, prompts)
            print(f"draft vocabulary (target ids): {vocab}")
            sup.make_tiny_eagle3_draft(draft, model, aux_layer_ids=AUX_IDS, seed=1, draft_vocab=vocab)
        record_train(out, model, ppath, draft)
        res = record_serve(out, model, draft, ppath)
        acc = [o.get("spec_accept_length") for o in res["outputs"]]
        print(f"serve: accept lengths per request {acc}")
        for name in ("train.h5", "serve.h5"):
            before = os.path.getsize(out / name)
            compact(out / name)
            print(f"{name}: {os.path.getsize(out / name) / 1e3:.0f} KB (as written: {before / 1e3:.0f} KB)")
    cmd = [sys.executable, "-m", "tensordiff", "diff", str(out / "train.h5"), str(out / "serve.h5")]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=dict(os.environ, COLUMNS="120"))
    print(proc.stdout)
    first = proc.stdout.splitlines()[0] if proc.stdout else ""
    if first != EXPECTED or proc.returncode != 1:
        print(f"UNEXPECTED: first line {first!r}, exit {proc.returncode}; stderr: {proc.stderr}", file=sys.stderr)
        return 1
    print(f"ok: first line is {EXPECTED!r}, exit 1")
    return 0


if __name__ == "__main__":
    sys.exit(main())
