"""Each real-engine run of the suite declared once, recorded once, and kept between sessions.

A :class:`Recording` names an engine run: its builder (a function of this module), the builder's
arguments and the recordings it starts from (a run starts from a model another recording wrote). The
session fixture ``recorded`` (registered by tests/conftest.py) serves one: the first worker to ask
records it under the cache directory, holding a file lock, while the other waits and reads it; a
later session with the same key reads what is there.

The key hashes everything the files depend on: the recorder sources and every module of the package
they import (the trace format among them), the test support files the builders use, the engine
versions, the run's own arguments and the keys of the recordings it starts from. An entry whose key
differs is never read: it sits in another directory.

The cache is ``.cache/recordings`` of the checkout, or ``TENSORDIFF_RECORDINGS_CACHE``. Tests read
the recorded files and never write into them: a test that edits a trace copies it to its own
``tmp_path`` first (an entry whose files changed after it was recorded is recorded again). Entries
of old keys are left where they are: another checkout sharing the cache may still read them.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

# ----------------------------------------------------------------------------------------------
# The registry's types, the key and the cache
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Recording:
    """One engine run: ``build`` (a function of this module) called with the recording's
    directory, the results of ``needs`` by name, and ``args``; it returns what the tests read (JSON:
    paths as strings inside the directory)."""

    name: str
    engine: str                       # "sglang", "vllm" or "hf": what the run starts
    build: str
    args: tuple[tuple[str, Any], ...] = ()
    needs: tuple[Recording, ...] = field(default=())


# The support files a builder may use: a change in any of them is a new key.
_SUPPORT = ("sglang_support.py", "vllm_support.py", "deepseek_support.py", "rl_support.py", "trained.py",
            "hf_traces.py", "recordings.py")


def cache_root() -> Path:
    return Path(os.environ.get("TENSORDIFF_RECORDINGS_CACHE") or REPO / ".cache" / "recordings")


def _recorder_modules() -> list[Path]:
    """The recorders' and the trace format's sources and every module of the package they import
    (their upstream in the import graph): what decides the bytes a run writes."""
    import grimp

    graph = grimp.build_graph("tensordiff")
    names = set()
    for package in ("tensordiff.recorders", "tensordiff.trace"):
        names |= graph.find_descendants(package) | {package}
        names |= graph.find_upstream_modules(package, as_package=True)
    names.add("tensordiff.__main__")
    files = []
    for name in names:
        base = REPO / Path(*name.split("."))
        files.append(base / "__init__.py" if base.is_dir() else base.with_suffix(".py"))
    return files


def _vllm_version() -> str:
    """vllm lives in its own venv: the version from its metadata there, without starting it."""
    import vllm_support as vsup

    venv = vsup.vllm_python().parent.parent
    found = sorted(venv.glob("lib/python*/site-packages/vllm*.dist-info"))
    return found[0].name if found else "absent"


@functools.lru_cache(maxsize=None)
def base_key() -> str:
    """What every recording's key shares: sources and engine versions."""
    h = hashlib.sha256()
    files = set(_recorder_modules())
    files |= {HERE / f for f in _SUPPORT}
    files |= set((HERE / "sgl_kernel_stub").rglob("*.py"))
    files.add(REPO / "scripts" / "train_tiny_models.py")     # the trained model's recipe
    for f in sorted(p for p in files if p.exists()):
        h.update(str(f.relative_to(REPO)).encode() + b"\0" + f.read_bytes() + b"\0")
    for dist in ("sglang", "torch", "transformers", "h5py", "numpy"):
        try:
            version = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            version = "absent"
        h.update(f"{dist}={version}\0".encode())
    h.update(f"vllm={_vllm_version()}\0python={sys.version_info[:2]}\0".encode())
    return h.hexdigest()


def key(rec: Recording) -> str:
    h = hashlib.sha256(base_key().encode())
    h.update(json.dumps([rec.name, rec.engine, rec.build, rec.args], sort_keys=True, default=str).encode())
    for need in rec.needs:
        h.update(key(need).encode())
    return h.hexdigest()[:20]


def serve(rec: Recording) -> dict:
    """The recording's result, recorded now if no complete entry of its key is in the cache. The
    lock makes the two workers of a run take turns: one records, the other waits and reads."""
    from filelock import FileLock

    needs = {n.name: serve(n) for n in rec.needs}
    k = key(rec)
    out = cache_root() / f"{rec.name}-{k}"
    done = out / "recording.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out) + ".lock"):
        if done.exists():
            doc = json.loads(done.read_text())
            if doc.get("key") == k and doc.get("dir") == str(out) and doc.get("files") == _manifest(out):
                return doc["result"]
        # an entry without its record of completion was cut off, and one whose files changed after it
        # was written was written into: either is recorded again from nothing
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir()
        # through JSON, as a later session reads it: the same types the first time and every time after
        result = json.loads(json.dumps(BUILDERS[rec.build](out, needs, **dict(rec.args))))
        tmp = out.parent / f"{out.name}.part"
        tmp.write_text(json.dumps({"key": k, "dir": str(out), "name": rec.name, "result": result,
                                   "files": _manifest(out)}, indent=1))
        os.replace(tmp, done)      # written last: the entry is complete
    return result


def _manifest(out: Path) -> dict[str, list[int]]:
    """Size and modification time of every file of an entry: a test that wrote into a recorded file
    changes them, and the entry is not read again."""
    got = {}
    for f in sorted(out.rglob("*")):
        if f.is_file() and f.name != "recording.json":
            st = f.stat()
            got[str(f.relative_to(out))] = [st.st_size, st.st_mtime_ns]
    return got


# ----------------------------------------------------------------------------------------------
# Builders
# ----------------------------------------------------------------------------------------------


def _run(argv: Sequence[str], out: Path, name: str, env: Mapping[str, str], timeout: float = 900) -> None:
    """Run one engine process, keep its stdout and stderr beside its files (some tests read what it
    printed), and fail with their tails where it failed."""
    proc = subprocess.run(list(argv), check=False, capture_output=True, text=True, env=dict(env), cwd=REPO,
                          timeout=timeout)
    (out / f"{name}.stdout").write_text(proc.stdout)
    (out / f"{name}.stderr").write_text(proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"{name}: exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")


def _prompts_file(path: Path, prompts: Mapping[str, Sequence[int]]) -> str:
    path.write_text("".join(json.dumps({"id": k, "input_ids": list(map(int, v))}) + "\n" for k, v in prompts.items()))
    return str(path)


def _random_eagle_models(out: Path, needs: dict, *, prompts: dict, config: dict, aux_ids: list[int],
                         refs_new: int, vocab_by: str) -> dict:
    """A random-weight tiny Llama (sglang_support.make_tiny_llama, ``config``), HF's greedy
    continuations of ``prompts`` (``refs_new`` tokens) and a random EAGLE-3 draft (``aux_ids``)
    proposing two tokens the target emits (``vocab_by``: "count", the two it emits most; "sorted",
    the two smallest ids), so some drafts are accepted."""
    import sglang_support as sup

    target = sup.make_tiny_llama(out / "target", **config)
    hf = sup.load_hf_model(target)
    refs = {k: sup.hf_greedy(hf, p, refs_new) for k, p in prompts.items()}
    if vocab_by == "count":
        counts: dict[int, int] = {}
        for r in refs.values():
            for t in r:
                counts[t] = counts.get(t, 0) + 1
        vocab = [t for t, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:2]]
    else:
        vocab = sorted({t for r in refs.values() for t in r})[:2]
    draft = sup.make_tiny_eagle3_draft(out / "draft", target, aux_layer_ids=aux_ids, draft_vocab=vocab)
    return {"target": str(target), "draft": str(draft), "refs": refs, "vocab": vocab,
            "prompts": _prompts_file(out / "prompts.jsonl", prompts)}


def _sglang_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """An SGLang engine process: CPU mode, the sgl_kernel stand-in, only our plugin, no TENSORDIFF_*
    of the caller."""
    import sglang_support as sup

    env = {k: v for k, v in os.environ.items() if not k.startswith("TENSORDIFF_")}
    env["SGLANG_USE_CPU_ENGINE"] = "1"
    rest = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join([str(sup.STUB_DIR), str(REPO), *rest])
    env["SGLANG_PLUGINS"] = "tensordiff"
    env.update(extra or {})
    return env


def _sglang_llama_serve(out: Path, needs: dict, *, model: str, mode: str, prompts: dict, max_new: int, chunk: int,
                        aux_ids: list[int] = (), attention: str = "intel_amx", env: dict | None = None,
                        norm_before_fc: bool = False) -> dict:
    """SGLang on a model of ``needs[model]``: ``mode`` "capture" (the real ``record serve`` command,
    the target alone returning ``aux_ids``) or "eagle" (EAGLE-3 with the model's draft, through
    serve_cli.record: intel_amx needs the AMX override of sglang_support); float32, batches of 2,
    the catalog on. ``norm_before_fc``: the draft's config says so (a copy of the draft)."""
    import sglang_support as sup

    m = needs[model]
    argv = ["--model", m["target"], "--prompts", _prompts_file(out / "prompts.jsonl", prompts),
            "--out", str(out / "serve.h5"), "--outputs", str(out / "serve.jsonl"), "--catalog",
            "--max-new-tokens", str(max_new), "--batch-size", "2", "--device", "cpu", "--dtype", "float32",
            "--chunked-prefill-size", str(chunk), "--mem-fraction-static", "0.1", "--max-total-tokens", "2048",
            "--log-level", "error"]
    if mode == "capture":
        argv = [sys.executable, "-m", "tensordiff", "record", "serve", *argv, "--aux-ids", *map(str, aux_ids),
                "--attention-backend", attention]
    else:
        draft = m["draft"]
        if norm_before_fc:
            draft = str(sup.norm_before_fc_draft(Path(draft), out / "draft-norm"))
        argv = [sys.executable, "-c", sup.EAGLE_RUNNER.format(tests=str(HERE)), *argv, "--draft", draft,
                "--attention-backend", attention]
    _run(argv, out, "serve", _sglang_env(env), timeout=600)
    return {"trace": str(out / "serve.h5"), "outputs": str(out / "serve.jsonl"), "stdout": str(out / "serve.stdout")}


def _vllm_llama_serve(out: Path, needs: dict, *, model: str, prompts: dict, max_new: int, chunk: int,
                      norm_before_fc: bool = False, env: dict | None = None) -> dict:
    """`tensordiff record serve --engine vllm` in the vLLM venv on a model of ``needs[model]``:
    EAGLE-3 with 2 draft tokens, batches of 2, chunked prefill of ``chunk`` tokens, float32, the
    catalog on (``env``: more environment)."""
    import sglang_support as sup
    import vllm_support as vsup

    m = needs[model]
    draft = m["draft"]
    if norm_before_fc:
        draft = str(sup.norm_before_fc_draft(Path(draft), out / "draft-norm"))
    argv = [str(vsup.vllm_python()), "-m", "tensordiff", "record", "serve", "--engine", "vllm",
            "--model", m["target"], "--draft", draft, "--prompts", _prompts_file(out / "prompts.jsonl", prompts),
            "--out", str(out / "serve.h5"), "--outputs", str(out / "serve.jsonl"), "--catalog",
            "--max-new-tokens", str(max_new), "--batch-size", "2", "--device", "cpu", "--dtype", "float32",
            "--chunked-prefill-size", str(chunk), "--speculative-num-steps", "2", "--log-level", "warning"]
    for a in vsup.CPU_ENGINE_ARGS:
        argv += ["--engine-arg", a]
    _run(argv, out, "serve", {**vsup.vllm_env(), **(env or {})})
    return {"trace": str(out / "serve.h5"), "outputs": str(out / "serve.jsonl"), "stdout": str(out / "serve.stdout")}


def _train_from_serve(out: Path, needs: dict, *, model: str, serve: str, source: str, convention: str,
                      dtype: str = "float32") -> dict:
    """`tensordiff record train --from-serve` of ``needs[serve]`` (``source``: its "outputs" JSONL
    or its "trace") on ``needs[model]``'s target and draft."""
    import sglang_support as sup

    m = needs[model]
    argv = [sys.executable, "-m", "tensordiff", "record", "train", "--model", m["target"],
            "--from-serve", needs[serve][source], "--draft", m["draft"], "--convention", convention,
            "--dtype", dtype, "--device", "cpu", "--no-progress", "--out", str(out / "train.h5")]
    _run(argv, out, "train", sup.tensordiff_env())
    return {"trace": str(out / "train.h5"), "stdout": str(out / "train.stdout")}


def _trained_models(out: Path, needs: dict, *, n_prompts: int) -> dict:
    """The trained tiny Llama and its draft (scripts/train_tiny_models.py; kept in .cache/trained),
    and its first ``n_prompts`` held-out prompts: nothing recorded here, only where they are."""
    import sglang_support as sup

    got = sup.trained_models(0)
    if got is None:
        raise RuntimeError("no trained model (scripts/train_tiny_models.py)")
    prompts = dict(list(got["prompts"].items())[:n_prompts])
    return {"target": str(got["target"]), "draft": str(got["draft"]), "prompts_by_id": prompts}


def _serve_pair(out: Path, needs: dict, *, engine: str, model: str, dtype: str, max_new: int,
                prompts: dict | None = None) -> dict:
    """A correctly wired pair: ``engine``'s EAGLE-3 serve in ``dtype`` and `record train
    --from-serve` its outputs in fp32 (sglang_support.sglang_serve_pair, vllm_support.vllm_serve_pair)."""
    import sglang_support as sup
    import vllm_support as vsup

    m = needs[model]
    chosen = prompts if prompts is not None else m["prompts_by_id"]
    pair = sup.sglang_serve_pair if engine == "sglang" else vsup.vllm_serve_pair
    got = pair(m["target"], m["draft"], chosen, out, dtype=dtype, max_new_tokens=max_new)
    return {"train": got["train"], "serve": got["serve"]}


def _rl_trained(out: Path, needs: dict, *, n_prompts: int) -> dict:
    """The trained tiny Llama (tests/trained.py) and its first ``n_prompts`` prompts as p0, p1, ...:
    nothing recorded here, only where they are."""
    import trained

    return {"target": str(trained.target_dir()), "prompts": {f"p{i}": p for i, p in enumerate(trained.prompts()[:n_prompts])}}


def _sglang_rl_serve(out: Path, needs: dict, *, model: str, max_new: int, replay_of: str | None = None) -> dict:
    """sglang_support.rl_serve: `record serve` in bf16 at temperature 1, the catalog with all values;
    with ``replay_of``, that recording's rollout computed again as prefill."""
    import sglang_support as sup

    m = needs[model]
    replay = Path(needs[replay_of]["trace"]) if replay_of else None
    return sup.rl_serve(m["target"], m["prompts"], out, "replay" if replay else "rollout", max_new=max_new,
                        replay=replay)


def _sglang_rl_perturbed(out: Path, needs: dict, *, model: str, layer: int, scale: float, max_new: int) -> dict:
    """sglang_support.rl_perturbed_pair: rollout and replay on an engine whose decode attention of
    decoder layer ``layer`` is scaled by ``scale``."""
    import sglang_support as sup

    m = needs[model]
    return sup.rl_perturbed_pair(m["target"], m["prompts"], out, layer=layer, scale=scale, max_new=max_new)


_RL_DRIVER = r'''
import json, sys
sys.path.insert(0, {tests!r})
import sglang_support as sup
sup.prepare_cpu_env()
import torch
from safetensors.torch import load_file
args = json.loads(sys.argv[1])
engine = sup.start_engine(**sup.engine_kwargs(args["model"], dtype="float32", mem_fraction_static=0.3,
                                              chunked_prefill_size=64))
out = {{}}
try:
    sp = {{"temperature": args["temperature"], "max_new_tokens": args["max_new"]}}
    def gen(key):
        o = engine.generate(input_ids=[args["prompts"][key]], sampling_params=sp, rid=[key], return_logprob=True)[0]
        out[key] = {{"id": key, "input_ids": args["prompts"][key], "output_ids": o["output_ids"],
                     "output_logprobs": [x[0] for x in o["meta_info"]["output_token_logprobs"]]}}
    for key in args["before"]:
        gen(key)
    if args.get("update"):
        sd = load_file(args["model"] + "/model.safetensors")
        named = [(n, sd[n] * args["update"]["scale"]) for n in args["update"]["names"]]
        ok = lambda r: r[0] if isinstance(r, tuple) else r.success  # (success, message)
        assert ok(engine.begin_weight_update())
        r = engine.update_weights_from_tensor(named)
        assert ok(r), r
        assert ok(engine.end_weight_update())
    for key in args["after"]:
        gen(key)
    engine.collective_rpc("tensordiff_close")
finally:
    engine.shutdown()
print("OUT", json.dumps(out))
'''


def _sglang_rl_drive(out: Path, needs: dict, *, model: str, temperature: float, max_new: int,
                     update: dict | None = None, extra_env: dict | None = None, before: tuple = ()) -> dict:
    """An fp32 engine driven through ``sglang.Engine`` at ``temperature``, generating ``before``,
    then (``update``) scaling some weights through update_weights_from_tensor, then p0 and p1;
    ``before``'s requests are left out of the outputs JSONL (the trainer sees p0 and p1 only)."""
    import sglang_support as sup

    m = needs[model]
    trace = out / "serve.h5"
    args = {"model": m["target"], "prompts": m["prompts"], "temperature": temperature, "max_new": max_new,
            "update": update, "before": list(before), "after": ["p0", "p1"]}
    env = sup.rl_engine_env({"TENSORDIFF_TRACE": str(trace), "TENSORDIFF_CATALOG": "1", "TENSORDIFF_VALUES": "all",
                             **(extra_env or {})})
    _run([sys.executable, "-c", _RL_DRIVER.format(tests=str(HERE)), json.dumps(args)], out, "serve", env)
    stdout = (out / "serve.stdout").read_text()
    outputs = json.loads(next(ln for ln in stdout.splitlines() if ln.startswith("OUT "))[4:])
    jsonl = out / "serve.jsonl"
    jsonl.write_text("".join(json.dumps(outputs[k]) + "\n" for k in ("p0", "p1")))
    return {"trace": str(trace), "outputs": {k: outputs[k] for k in ("p0", "p1")}, "jsonl": str(jsonl), "all": outputs}


def _vllm_tp_serve(out: Path, needs: dict, *, model: str, tp: int, max_new: int, name: str) -> dict:
    """`record serve --engine vllm --tp-size TP` of ``needs[model]`` (its draft, its prompts), the
    catalog on: the rank files in ``out/name``, the outputs in ``out/name.jsonl``."""
    import vllm_support as vsup

    m = needs[model]
    d = out / name
    d.mkdir()
    argv = [str(vsup.vllm_python()), "-m", "tensordiff", "record", "serve", "--engine", "vllm",
            "--model", m["target"], "--draft", m["draft"], "--prompts", m["prompts"],
            "--out", str(d / "serve.h5"), "--outputs", str(out / f"{name}.jsonl"), "--catalog",
            "--max-new-tokens", str(max_new), "--device", "cpu", "--dtype", "float32", "--tp-size", str(tp),
            "--speculative-num-steps", "2", "--log-level", "warning"]
    for a in vsup.CPU_ENGINE_ARGS:
        argv += ["--engine-arg", a]
    env = vsup.vllm_env()
    env.pop("VLLM_CPU_OMP_THREADS_BIND", None)  # the command binds the CPU workers itself
    _run(argv, out, "serve", env)
    return {"dir": str(d), "jsonl": str(out / f"{name}.jsonl"), "stdout": str(out / "serve.stdout")}


def _vllm_rl_serve(out: Path, needs: dict, *, model: str, max_new: int, prompts: dict | None = None,
                   replay_of: str | None = None) -> dict:
    """`record serve --engine vllm` of ``needs[model]``'s target (no draft) in bfloat16: ``prompts``
    sampled at temperature 1 (seed 3), or the rollout ``replay_of`` computed again as prefill."""
    import sglang_support as sup
    import vllm_support as vsup

    name = "replay" if replay_of else "rollout"
    trace, outputs = out / f"{name}.h5", out / f"{name}.jsonl"
    argv = [str(vsup.vllm_python()), "-m", "tensordiff", "record", "serve", "--engine", "vllm",
            "--model", needs[model]["target"], "--out", str(trace), "--outputs", str(outputs),
            "--max-new-tokens", str(max_new), "--device", "cpu", "--dtype", "bfloat16", "--log-level", "warning"]
    if replay_of:
        argv += ["--replay", needs[replay_of]["trace"], "--replay-outputs", needs[replay_of]["outputs"]]
    else:
        argv += ["--prompts", _prompts_file(out / "prompts.jsonl", prompts), "--temperature", "1.0",
                 "--random-seed", "3"]
    for a in vsup.CPU_ENGINE_ARGS:
        argv += ["--engine-arg", a]
    _run(argv, out, name, vsup.vllm_env())
    return sup.load_serve_run(trace, outputs)


def _trained_changed(out: Path, needs: dict, *, n_prompts: int, key: str, factor: float) -> dict:
    """The trained tiny Llama, its draft, its first ``n_prompts`` prompts, and a copy of the target
    with the weight ``key`` scaled by ``factor`` (the engine's copy with one weight changed)."""
    import sglang_support as sup

    got = needs[TRAINED_MODELS.name]
    changed = sup.scaled_weight_copy(got["target"], out / "changed", key, factor)
    return {**got, "prompts_by_id": dict(list(got["prompts_by_id"].items())[:n_prompts]), "changed": str(changed)}


def _sglang_eagle_all_values(out: Path, needs: dict, *, model: str, target: str, env: dict | None = None,
                             graft_from: str | None = None, graft_state: str | None = None) -> dict:
    """EAGLE-3 in SGLang (serve_cli.record, intel_amx) of ``needs[model][target]`` with its draft
    and prompts: float32, 4 new tokens, the catalog with all values; ``env`` for the plugin
    (TENSORDIFF_ZOOM); ``graft_from``/``graft_state``: TENSORDIFF_GRAFT of that recording's train
    trace at that state."""
    import sglang_support as sup

    m = needs[model]
    env = dict(env or {})
    if graft_from:
        env["TENSORDIFF_GRAFT"] = f"{needs[graft_from]['trace']}:{graft_state}"
    argv = [sys.executable, "-c", sup.EAGLE_RUNNER.format(tests=str(HERE)), "--model", m[target],
            "--draft", m["draft"], "--prompts", _prompts_file(out / "prompts.jsonl", m["prompts_by_id"]),
            "--out", str(out / "serve.h5"), "--outputs", str(out / "serve.jsonl"),
            "--max-new-tokens", "4", "--batch-size", "2", "--device", "cpu", "--dtype", "float32",
            "--chunked-prefill-size", "32", "--mem-fraction-static", "0.3", "--max-total-tokens", "2048",
            "--log-level", "error", "--attention-backend", "intel_amx", "--catalog", "--values", "all"]
    _run(argv, out, "serve", {**sup.engine_env(), **env})
    return sup.load_serve_run(out / "serve.h5", out / "serve.jsonl")


def _train_all_values(out: Path, needs: dict, *, model: str, serve: str, extra: list[str] = (),
                      convention: str = "sglang-llama") -> dict:
    """`record train --from-serve` of ``needs[serve]``'s outputs through the (unchanged) target of
    ``needs[model]``, wired as ``convention`` says the engine wires the draft, all values (``extra``:
    more arguments)."""
    import sglang_support as sup

    m = needs[model]
    sup.record_train_from_serve(m["target"], needs[serve]["outputs"], out / "train.h5", m["draft"], convention,
                                extra=("--values", "all", *extra))
    return {"trace": str(out / "train.h5")}


def _vllm_zoom_models(out: Path, needs: dict, *, layer: int, factor: float) -> dict:
    """vLLM's random tiny Llama (head_dim 64), a draft of ids [2, 4, 6] proposing tokens 1 and 2,
    prompts A (40) and B (24) of torch's generator seeded 3, and a copy of the target with layer
    ``layer``'s up projection scaled by ``factor``."""
    import sglang_support as sup
    import torch
    import vllm_support as vsup

    target = sup.make_tiny_llama(out / "target", **vsup.TINY_LLAMA_VLLM)
    draft = sup.make_tiny_eagle3_draft(out / "draft", target, aux_layer_ids=[2, 4, 6], draft_vocab=[1, 2])
    rng = torch.Generator().manual_seed(3)
    prompts = {k: torch.randint(1, 256, (n,), generator=rng).tolist() for k, n in (("A", 40), ("B", 24))}
    changed = sup.scaled_weight_copy(target, out / "changed", f"model.layers.{layer}.mlp.up_proj.weight", factor)
    return {"target": str(target), "draft": str(draft), "prompts_by_id": prompts, "changed": str(changed)}


def _vllm_eagle_all_values(out: Path, needs: dict, *, model: str, target: str, env: dict | None = None) -> dict:
    """EAGLE-3 in vLLM of ``needs[model][target]`` with its draft and prompts: float32, 4 new
    tokens, the catalog with all values; ``env`` for the plugin (TENSORDIFF_ZOOM)."""
    import sglang_support as sup
    import vllm_support as vsup

    m = needs[model]
    draft = vsup.full_vocab_draft(Path(m["draft"]), out / "draft")
    argv = [str(vsup.vllm_python()), "-m", "tensordiff", "record", "serve", "--engine", "vllm", "--model", m[target],
            "--draft", str(draft), "--prompts", _prompts_file(out / "prompts.jsonl", m["prompts_by_id"]),
            "--out", str(out / "serve.h5"), "--outputs", str(out / "serve.jsonl"),
            "--max-new-tokens", "4", "--batch-size", "2", "--device", "cpu", "--dtype", "float32",
            "--chunked-prefill-size", "32", "--speculative-num-steps", "2", "--log-level", "warning",
            "--catalog", "--values", "all"]
    for a in vsup.CPU_ENGINE_ARGS:
        argv += ["--engine-arg", a]
    _run(argv, out, "serve", {**vsup.vllm_env(), **(env or {})})
    return sup.load_serve_run(out / "serve.h5", out / "serve.jsonl")


def _sglang_tp2(out: Path, needs: dict, *, model: str, max_new: int) -> dict:
    """`record serve --tp-size 2` in SGLang of ``needs[model]``'s target alone (capture ids [0, 1,
    2], torch_native), no NCCL library (the CPU path must not need one), and two train traces of the
    prompts with HF's greedy continuations: the founding bug ("bug") and the correct wiring ("ok")."""
    import sglang_support as sup

    m = needs[model]
    d = out / "set"
    d.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TENSORDIFF_", "SGLANG_CPU_OMP"))}
    env.update(SGLANG_USE_CPU_ENGINE="1", SGLANG_PLUGINS="tensordiff", SGLANG_NCCL_SO_PATH=str(out / "no-nccl.so"))
    rest = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join([str(sup.STUB_DIR), str(REPO), *rest])
    argv = [sys.executable, "-m", "tensordiff", "record", "serve", "--model", m["target"], "--prompts", m["prompts"],
            "--out", str(d / "serve.h5"), "--outputs", str(out / "out.jsonl"), "--catalog",
            "--max-new-tokens", str(max_new), "--device", "cpu", "--dtype", "float32", "--chunked-prefill-size", "32",
            "--mem-fraction-static", "0.1", "--max-total-tokens", "2048", "--aux-ids", "0", "1", "2",
            "--attention-backend", "torch_native", "--log-level", "error", "--tp-size", "2"]
    _run(argv, out, "serve", env)
    prompts = {json.loads(line)["id"]: json.loads(line)["input_ids"] for line in Path(m["prompts"]).read_text().splitlines()}
    full = _prompts_file(out / "full.jsonl", {k: p + m["refs"][k][:max_new] for k, p in prompts.items()})
    trains = {}
    for name, args in (("bug", ["--aux-ids", "0", "1", "2", "--convention", "speculators-legacy", "--prepend-embed"]),
                       ("ok", ["--aux-ids", "1", "2", "3", "--convention", "boundary"])):
        trains[name] = str(out / f"train-{name}.h5")
        _run([sys.executable, "-m", "tensordiff", "record", "train", "--model", m["target"], "--prompts", full, *args,
              "--dtype", "float32", "--device", "cpu", "--no-progress", "--out", trains[name]], out, f"train-{name}",
             sup.tensordiff_env())
    return {"dir": str(d), "stdout": str(out / "serve.stdout"), "outputs": str(out / "out.jsonl"), "train": trains}


def _deepseek_models(out: Path, needs: dict, *, eagle_ids: list[int]) -> dict:
    """The tiny DeepSeek (deepseek_support.make_tiny_deepseek) and a random EAGLE-3 draft of
    ``eagle_ids`` for it."""
    import deepseek_support as ds
    import sglang_support as sup

    target = ds.make_tiny_deepseek(out / "tiny-deepseek")
    draft = sup.make_tiny_eagle3_draft(out / "tiny-deepseek-eagle3", target, aux_layer_ids=eagle_ids)
    return {"target": str(target), "draft": str(draft)}


_SUMMARY_RUNNER = """
import sys
sys.path.insert(0, {tests!r})
import argparse, sglang_support as sup
from tensordiff.recorders import serve_cli
if __name__ == "__main__":
    p = argparse.ArgumentParser(); serve_cli.add_arguments(p)
    args = p.parse_args(sys.argv[1:])
    sup.prepare_cpu_env()
    serve_cli._print_summary(serve_cli.record(args, start_engine=sup.start_engine))
"""


def _sglang_deepseek_serve(out: Path, needs: dict, *, model: str, prompts: dict, max_new: int, chunk: int,
                           dtype: str, extra: list[str]) -> dict:
    """SGLang (serve_cli.record with the AMX override, intel_amx, the command's summary printed) of
    ``needs[model]``'s DeepSeek in ``dtype``; ``extra``: --draft or --aux-ids."""
    m = needs[model]
    runner = out / "runner.py"
    runner.write_text(_SUMMARY_RUNNER.format(tests=str(HERE)))
    extra = [m["draft"] if a == "{draft}" else a for a in extra]
    argv = [sys.executable, str(runner), "--model", m["target"], "--prompts", _prompts_file(out / "prompts.jsonl", prompts),
            "--out", str(out / "serve.h5"), "--outputs", str(out / "serve.jsonl"), "--max-new-tokens", str(max_new),
            "--batch-size", "2", "--device", "cpu", "--dtype", dtype, "--attention-backend", "intel_amx",
            "--chunked-prefill-size", str(chunk), "--mem-fraction-static", "0.1", "--max-total-tokens", "2048",
            "--log-level", "error", *extra]
    _run(argv, out, "serve", _sglang_env())
    return {"trace": str(out / "serve.h5"), "outputs": str(out / "serve.jsonl"), "stdout": str(out / "serve.stdout")}


BUILDERS: dict[str, Callable[..., dict]] = {
    "random_eagle_models": _random_eagle_models,
    "sglang_llama_serve": _sglang_llama_serve,
    "vllm_llama_serve": _vllm_llama_serve,
    "train_from_serve": _train_from_serve,
    "trained_models": _trained_models,
    "serve_pair": _serve_pair,
    "rl_trained": _rl_trained,
    "sglang_rl_serve": _sglang_rl_serve,
    "sglang_rl_perturbed": _sglang_rl_perturbed,
    "sglang_rl_drive": _sglang_rl_drive,
    "vllm_tp_serve": _vllm_tp_serve,
    "vllm_rl_serve": _vllm_rl_serve,
    "trained_changed": _trained_changed,
    "sglang_eagle_all_values": _sglang_eagle_all_values,
    "train_all_values": _train_all_values,
    "vllm_zoom_models": _vllm_zoom_models,
    "vllm_eagle_all_values": _vllm_eagle_all_values,
    "sglang_tp2": _sglang_tp2,
    "deepseek_models": _deepseek_models,
    "sglang_deepseek_serve": _sglang_deepseek_serve,
}


def _args(**kw: Any) -> tuple[tuple[str, Any], ...]:
    return tuple(sorted(kw.items()))


def _ab(seed: int, a: int, b: int) -> dict[str, list[int]]:
    import numpy as np

    rng = np.random.default_rng(seed)
    return {"A": rng.integers(1, 256, a).tolist(), "B": rng.integers(1, 256, b).tolist()}


def _ab_c(seed: int, shared: int) -> dict[str, list[int]]:
    """The engine tests' three prompts: A (80 tokens, several prefill chunks), B (9), and C, which
    shares A's first ``shared`` tokens (a prefix-cache hit)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    a = rng.integers(1, 256, 80).tolist()
    b = rng.integers(1, 256, 9).tolist()
    return {"A": a, "B": b, "C": a[:shared] + rng.integers(1, 256, 5).tolist()}


# ----------------------------------------------------------------------------------------------
# The registry
# ----------------------------------------------------------------------------------------------

# SGLang's random tiny Llama (tests/test_sglang_serve.py; the random case of test_engine_noise):
# draft ids [2, 4, 6], the two tokens the target emits most in 7 greedy tokens of each prompt.
SGLANG_PROMPTS = _ab_c(5, 56)
SGLANG_MODELS = Recording("sglang-random-models", "hf", "random_eagle_models",
                          _args(prompts=SGLANG_PROMPTS, config={}, aux_ids=[2, 4, 6], refs_new=7, vocab_by="count"))
_SGLANG_SERVE = dict(model=SGLANG_MODELS.name, prompts=SGLANG_PROMPTS, max_new=6, chunk=32)
SGLANG_CAPTURE = Recording("sglang-capture", "sglang", "sglang_llama_serve",
                           _args(**_SGLANG_SERVE, mode="capture", aux_ids=[2, 4, 6], attention="torch_native"),
                           (SGLANG_MODELS,))
# the draft's ids out of order ([5, 1, 3]): SGLang captures layers [6, 2, 4] and packs them in layer order
SGLANG_CAPTURE_UNSORTED = Recording("sglang-capture-unsorted", "sglang", "sglang_llama_serve",
                                    _args(**{**_SGLANG_SERVE, "prompts": {k: SGLANG_PROMPTS[k] for k in "AB"}},
                                          mode="capture", aux_ids=[5, 1, 3], attention="torch_native"),
                                    (SGLANG_MODELS,))
SGLANG_EAGLE = Recording("sglang-eagle", "sglang", "sglang_llama_serve", _args(**_SGLANG_SERVE, mode="eagle"),
                         (SGLANG_MODELS,))
# the same EAGLE-3 run with every pass recorded in its hooks (nothing staged): compared to the one above
SGLANG_EAGLE_AT_ONCE = Recording("sglang-eagle-at-once", "sglang", "sglang_llama_serve",
                                 _args(**_SGLANG_SERVE, mode="eagle", env={"TENSORDIFF_STAGE_MB": "0"}),
                                 (SGLANG_MODELS,))
SGLANG_NORM = Recording("sglang-eagle-norm-before-fc", "sglang", "sglang_llama_serve",
                        _args(**{**_SGLANG_SERVE, "prompts": {k: SGLANG_PROMPTS[k] for k in "AB"}}, mode="eagle",
                              norm_before_fc=True),
                        (SGLANG_MODELS,))

# vLLM's random tiny Llama (tests/test_vllm_serve.py): head_dim 64, draft ids [5, 3, 7] (not sorted)
VLLM_PROMPTS = _ab_c(11, 64)


def _vllm_config() -> dict:
    import vllm_support as vsup

    return dict(vsup.TINY_LLAMA_VLLM)


VLLM_MODELS = Recording("vllm-random-models", "hf", "random_eagle_models",
                        _args(prompts=VLLM_PROMPTS, config=_vllm_config(), aux_ids=[5, 3, 7], refs_new=7,
                              vocab_by="count"))
_VLLM_SERVE = dict(model=VLLM_MODELS.name, max_new=6, chunk=32)
VLLM_EAGLE = Recording("vllm-eagle", "vllm", "vllm_llama_serve", _args(**_VLLM_SERVE, prompts=VLLM_PROMPTS),
                       (VLLM_MODELS,))
VLLM_EAGLE_TRAIN = Recording("vllm-eagle-train", "hf", "train_from_serve",
                             _args(model=VLLM_MODELS.name, serve=VLLM_EAGLE.name, source="outputs", convention="vllm"),
                             (VLLM_MODELS, VLLM_EAGLE))
# the same run with the plugin computing every top-k row itself (as where vLLM's logits cannot be used)
VLLM_EAGLE_RECOMPUTED = Recording("vllm-eagle-recomputed-logits", "vllm", "vllm_llama_serve",
                                  _args(**_VLLM_SERVE, prompts=VLLM_PROMPTS, env={"TENSORDIFF_REUSE_LOGITS": "0"}),
                                  (VLLM_MODELS,))
VLLM_NORM = Recording("vllm-eagle-norm-before-fc", "vllm", "vllm_llama_serve",
                      _args(**_VLLM_SERVE, prompts={k: VLLM_PROMPTS[k] for k in "AB"}, norm_before_fc=True),
                      (VLLM_MODELS,))
VLLM_NORM_TRAIN = Recording("vllm-eagle-norm-before-fc-train", "hf", "train_from_serve",
                            _args(model=VLLM_MODELS.name, serve=VLLM_NORM.name, source="trace", convention="vllm"),
                            (VLLM_MODELS, VLLM_NORM))
# the same model and prompts through SGLang, capture-only (ids [2, 4, 6] = boundaries 3, 5, 7)
VLLM_MODEL_IN_SGLANG = Recording("vllm-model-sglang-capture", "sglang", "sglang_llama_serve",
                                 _args(model=VLLM_MODELS.name, prompts=VLLM_PROMPTS, max_new=6, chunk=32,
                                       mode="capture", aux_ids=[2, 4, 6], attention="torch_native"),
                                 (VLLM_MODELS,))

# Correctly wired bf16 serve / fp32 train pairs, 16 new tokens (tests/test_engine_noise.py)
TRAINED_MODELS = Recording("trained-models", "hf", "trained_models", _args(n_prompts=6))
NOISE_SGLANG_TRAINED = Recording("noise-sglang-trained", "sglang", "serve_pair",
                                 _args(engine="sglang", model=TRAINED_MODELS.name, dtype="bfloat16", max_new=16),
                                 (TRAINED_MODELS,))
NOISE_SGLANG_RANDOM = Recording("noise-sglang-random", "sglang", "serve_pair",
                                _args(engine="sglang", model=SGLANG_MODELS.name, dtype="bfloat16", max_new=16,
                                      prompts=SGLANG_PROMPTS),
                                (SGLANG_MODELS,))
# vLLM's random model of the noise test: the SGLang recipe (prompts of seed 5) at vLLM's head_dim
NOISE_VLLM_MODELS = Recording("noise-vllm-random-models", "hf", "random_eagle_models",
                              _args(prompts=SGLANG_PROMPTS, config=_vllm_config(), aux_ids=[2, 4, 6], refs_new=7,
                                    vocab_by="count"))
NOISE_VLLM_RANDOM = Recording("noise-vllm-random", "vllm", "serve_pair",
                              _args(engine="vllm", model=NOISE_VLLM_MODELS.name, dtype="bfloat16", max_new=16,
                                    prompts=SGLANG_PROMPTS),
                              (NOISE_VLLM_MODELS,))

# The RL records of the SGLang plugin on the trained tiny Llama (tests/test_sglang_rl_engine.py)
RL_MODEL = Recording("rl-trained", "hf", "rl_trained", _args(n_prompts=4))
RL_ROLLOUT = Recording("sglang-rl-rollout", "sglang", "sglang_rl_serve", _args(model=RL_MODEL.name, max_new=8),
                       (RL_MODEL,))
RL_REPLAY = Recording("sglang-rl-replay", "sglang", "sglang_rl_serve",
                      _args(model=RL_MODEL.name, max_new=8, replay_of=RL_ROLLOUT.name), (RL_MODEL, RL_ROLLOUT))
RL_PERTURBED = Recording("sglang-rl-perturbed", "sglang", "sglang_rl_perturbed",
                         _args(model=RL_MODEL.name, layer=3, scale=1.5, max_new=8), (RL_MODEL,))
# a weight update that syncs layer 5's down_proj (x 1.25) but not layer 3's, p3 served before it
RL_UPDATED = Recording("sglang-rl-updated", "sglang", "sglang_rl_drive",
                       _args(model=RL_MODEL.name, temperature=0.7, max_new=8, before=["p3"],
                             update={"names": ["model.layers.5.mlp.down_proj.weight"], "scale": 1.25}),
                       (RL_MODEL,))
RL_RAW = Recording("sglang-rl-raw", "sglang", "sglang_rl_drive",
                   _args(model=RL_MODEL.name, temperature=0.7, max_new=8,
                         extra_env={"SGLANG_RETURN_ORIGINAL_LOGPROB": "1"}),
                   (RL_MODEL,))

# vLLM at TP=2 and TP=1 (tests/test_vllm_ranks.py): a 4-layer model, draft ids [1, 2, 3]
RANKS_PROMPTS = _ab(3, 40, 9)
VLLM_RANKS_MODELS = Recording("vllm-ranks-models", "hf", "random_eagle_models",
                              _args(prompts=RANKS_PROMPTS, config={**_vllm_config(), "num_hidden_layers": 4},
                                    aux_ids=[1, 2, 3], refs_new=7, vocab_by="sorted"))
VLLM_TP2 = Recording("vllm-tp2", "vllm", "vllm_tp_serve", _args(model=VLLM_RANKS_MODELS.name, tp=2, max_new=6, name="set"),
                     (VLLM_RANKS_MODELS,))
VLLM_TP1 = Recording("vllm-tp1", "vllm", "vllm_tp_serve", _args(model=VLLM_RANKS_MODELS.name, tp=1, max_new=6, name="one"),
                     (VLLM_RANKS_MODELS,))

# The RL records of the vLLM plugin (tests/test_vllm_rl_engine.py): VLLM_MODELS's target, no draft
VLLM_RL_PROMPTS = {"a": list(range(3, 40)), "b": [7, 9, 11, 200, 13, 17, 19, 23, 29, 31], "c": list(range(100, 120))}
VLLM_RL_ROLLOUT = Recording("vllm-rl-rollout", "vllm", "vllm_rl_serve",
                            _args(model=VLLM_MODELS.name, max_new=6, prompts=VLLM_RL_PROMPTS), (VLLM_MODELS,))
VLLM_RL_REPLAY = Recording("vllm-rl-replay", "vllm", "vllm_rl_serve",
                           _args(model=VLLM_MODELS.name, max_new=6, replay_of=VLLM_RL_ROLLOUT.name),
                           (VLLM_MODELS, VLLM_RL_ROLLOUT))

# The trained tiny Llama with layer 3's up projection x 1.05 in the engine's copy, 4 prompts
# (tests/test_zoom_sglang.py, tests/test_graft_sglang.py)
TRAINED_CHANGED = Recording("trained-changed-up3", "hf", "trained_changed",
                            _args(n_prompts=4, key="model.layers.3.mlp.up_proj.weight", factor=1.05), (TRAINED_MODELS,))


def _zoom_pair(name: str, target: str) -> tuple[Recording, Recording]:
    zoom = {"TENSORDIFF_ZOOM": "layer3"}
    serve = Recording(f"sglang-zoom3-{name}", "sglang", "sglang_eagle_all_values",
                      _args(model=TRAINED_CHANGED.name, target=target, env=zoom), (TRAINED_CHANGED,))
    train = Recording(f"sglang-zoom3-{name}-train", "hf", "train_all_values",
                      _args(model=TRAINED_CHANGED.name, serve=serve.name, extra=["--zoom", "layer3"]),
                      (TRAINED_CHANGED, serve))
    return serve, train


ZOOM_SAME, ZOOM_SAME_TRAIN = _zoom_pair("same", "target")
ZOOM_CHANGED, ZOOM_CHANGED_TRAIN = _zoom_pair("changed", "changed")
GRAFT_CHANGED = Recording("sglang-changed-up3", "sglang", "sglang_eagle_all_values",
                          _args(model=TRAINED_CHANGED.name, target="changed"), (TRAINED_CHANGED,))
GRAFT_TRAIN = Recording("sglang-changed-up3-train", "hf", "train_all_values",
                        _args(model=TRAINED_CHANGED.name, serve=GRAFT_CHANGED.name), (TRAINED_CHANGED, GRAFT_CHANGED))


def _grafted(state: str) -> Recording:
    return Recording(f"sglang-changed-up3-graft-{state}", "sglang", "sglang_eagle_all_values",
                     _args(model=TRAINED_CHANGED.name, target="changed", graft_from=GRAFT_TRAIN.name, graft_state=state),
                     (TRAINED_CHANGED, GRAFT_TRAIN))


GRAFT_LAYER4, GRAFT_LAYER3 = _grafted("layer4"), _grafted("layer3")

# TENSORDIFF_ZOOM=layer3 in vLLM (tests/test_zoom_vllm.py)
VLLM_ZOOM_MODELS = Recording("vllm-zoom-models", "hf", "vllm_zoom_models", _args(layer=3, factor=1.05))


def _vllm_zoom_pair(name: str, target: str) -> tuple[Recording, Recording]:
    serve = Recording(f"vllm-zoom3-{name}", "vllm", "vllm_eagle_all_values",
                      _args(model=VLLM_ZOOM_MODELS.name, target=target, env={"TENSORDIFF_ZOOM": "layer3"}),
                      (VLLM_ZOOM_MODELS,))
    train = Recording(f"vllm-zoom3-{name}-train", "hf", "train_all_values",
                      _args(model=VLLM_ZOOM_MODELS.name, serve=serve.name, extra=["--zoom", "layer3"], convention="vllm"),
                      (VLLM_ZOOM_MODELS, serve))
    return serve, train


VLLM_ZOOM_SAME, VLLM_ZOOM_SAME_TRAIN = _vllm_zoom_pair("same", "target")
VLLM_ZOOM_CHANGED, VLLM_ZOOM_CHANGED_TRAIN = _vllm_zoom_pair("changed", "changed")

# SGLang at TP=2 (tests/test_sglang_tp2.py) on the target and prompts of the vLLM rank tests
SGLANG_TP2 = Recording("sglang-tp2", "sglang", "sglang_tp2", _args(model=VLLM_RANKS_MODELS.name, max_new=6),
                       (VLLM_RANKS_MODELS,))

# The tiny DeepSeek in SGLang (tests/test_sglang_deepseek.py): EAGLE-3 in bf16 (draft ids [1, 2, 3]),
# capture-only in fp32 (ids [0, 2, 3])
DEEPSEEK_PROMPTS = _ab(7, 40, 9)
DEEPSEEK_MODELS = Recording("deepseek-models", "hf", "deepseek_models", _args(eagle_ids=[1, 2, 3]))
_DEEPSEEK_SERVE = dict(model=DEEPSEEK_MODELS.name, prompts=DEEPSEEK_PROMPTS, max_new=4, chunk=32)
DEEPSEEK_EAGLE = Recording("sglang-deepseek-eagle", "sglang", "sglang_deepseek_serve",
                           _args(**_DEEPSEEK_SERVE, dtype="bfloat16", extra=["--draft", "{draft}"]), (DEEPSEEK_MODELS,))
DEEPSEEK_CAPTURE = Recording("sglang-deepseek-capture", "sglang", "sglang_deepseek_serve",
                             _args(**_DEEPSEEK_SERVE, dtype="float32", extra=["--aux-ids", "0", "2", "3"]),
                             (DEEPSEEK_MODELS,))
