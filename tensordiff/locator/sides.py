"""What each side of ``tensordiff locate`` is: an HF model directory, a user's ``module:`` port,
an engine serving a directory (``sglang:DIR``, ``vllm:DIR``) or an existing trace, resolved and
checked before anything is recorded (bad input: one line, exit 2).

Imports neither torch nor the diff: the checks read paths, a file's first bytes and a trace's
attributes only (an engine side: whether its engine's modules and python are there).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..errors import UsageError
from .engines import ENGINES, check_engine

__all__ = ["Side", "resolve_side", "check_prompts"]

_HDF5_MAGIC = b"\x89HDF\r\n\x1a\n"
#: the prompts file is read whole by the recording: a bound on it, checked before the read
MAX_PROMPTS_BYTES = 256 << 20


@dataclass(frozen=True)
class Side:
    """One side. ``trace``: an existing trace to use as it is (step 1 records nothing for it);
    ``model``: what ``record train --model`` takes to record it again (zoomed, grafted): a model
    directory or a ``module:`` spec, None where a trace names no model that is still there; for
    an engine side (kind ``sglang`` or ``vllm``) the directory the engine serves."""

    name: str            # "A" or "B"
    spec: str            # as the user gave it
    kind: str            # "hf", "module", "trace", or an engine: "sglang", "vllm"
    model: str | None
    dtype: str | None    # --dtype for record train (None: the checkpoint's)
    trace: str | None = None

    @property
    def where(self) -> str:
        return self.trace or self.model or self.spec


def resolve_side(name: str, spec: str, dtype: str | None) -> Side:
    from ..recorders import user_module

    for engine in ENGINES:
        if spec.startswith(f"{engine}:"):
            return _engine_side(name, spec, engine, dtype)
    if user_module.is_spec(spec):
        check_spec_form(name, spec)     # the form only: nothing is imported before the recording
        return Side(name, spec, "module", spec, dtype)
    if not os.path.exists(spec):
        raise UsageError(f"{name}: no such file or directory (an HF model directory, a trace, or "
                         f"{user_module.SPEC_FORM})", spec)
    if os.path.isdir(spec):
        if not os.path.isfile(os.path.join(spec, "config.json")):
            raise UsageError(f"{name}: a directory without config.json is not an HF model directory", spec)
        return Side(name, spec, "hf", os.path.abspath(spec), dtype)
    try:
        with open(spec, "rb") as f:
            magic = f.read(8)
    except OSError as e:
        raise UsageError(f"{name}: cannot read ({e.strerror or e})", spec) from None
    if magic != _HDF5_MAGIC:
        raise UsageError(f"{name}: neither a model directory nor a trace (.h5)", spec)
    if dtype is not None:
        raise UsageError(f"--dtype-{name.lower()}: {name} is a trace, recorded already")
    model, rec_dtype = _recorded_model(spec)
    return Side(name, spec, "trace", model, rec_dtype, trace=os.path.abspath(spec))


def _engine_side(name: str, spec: str, engine: str, dtype: str | None) -> Side:
    """``sglang:DIR`` / ``vllm:DIR``: the directory an HF model directory, the engine runnable."""
    d = spec[len(engine) + 1:]
    if not d:
        raise UsageError(f"{name}: {engine}:DIR names the model directory the engine serves", spec)
    if not os.path.isdir(d) or not os.path.isfile(os.path.join(d, "config.json")):
        raise UsageError(f"{name}: {engine}:DIR needs a local model directory with config.json", d)
    model = os.path.abspath(d)
    check_engine(name, engine, model)
    # as the HF sides: the checkpoint's dtype unless told (an engine's "auto" may serve a float32
    # checkpoint in float16, which is the engine's choice, not the port's)
    return Side(name, spec, engine, model, dtype or _checkpoint_dtype(model))


def _checkpoint_dtype(model: str) -> str | None:
    from ..errors import TensordiffError
    from ..safety import read_json_file

    try:
        cfg = read_json_file(os.path.join(model, "config.json"), "config.json")
    except TensordiffError:
        return None
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
    dt = text.get("dtype") or text.get("torch_dtype") or cfg.get("dtype") or cfg.get("torch_dtype")
    return dt if dt in ("float32", "bfloat16", "float16") else None


def check_spec_form(name: str, spec: str) -> None:
    """A ``module:`` spec's form (its length and parts first, then the pattern); imports nothing."""
    from ..recorders import user_module

    try:
        user_module.parse_spec(spec)
    except UsageError as e:
        raise UsageError(f"{name}: {e}") from None


def _recorded_model(path: str) -> tuple[str | None, str | None]:
    """The model a trace of ``record train`` says it was recorded from (``model.path``), when that
    is still a model directory or a module spec, and its dtype. Any other trace (an engine's, an
    import) names no model: recording it again in transformers would compare something else."""
    from ..trace import TraceReader

    try:
        with TraceReader(path) as r:
            model = dict(r.model)
            meta = r.user_meta
            # a graft or a serve run's sequences (--from-serve) are not what --prompts records again
            by_train = (isinstance(meta, dict) and meta.get("command") == "record train" and not meta.get("graft")
                        and not meta.get("from_serve"))
    except Exception as e:   # any reason the file does not open: one line
        raise UsageError(f"not a readable trace ({str(e).splitlines()[0] if str(e) else type(e).__name__})",
                         path) from None
    where = model.get("path")
    dtype = model.get("dtype")
    dt = dtype if dtype in ("float32", "bfloat16", "float16") else None
    if by_train and isinstance(where, str) and (_is_spec_of_form(where)
                                   or os.path.isfile(os.path.join(where, "config.json"))):
        return where, dt
    return None, dt


def _is_spec_of_form(where: str) -> bool:
    """A trace's ``model.path`` is a ``module:`` spec to record again only when it has the form:
    it comes from a file, and is printed and run as a command."""
    if not where.startswith("module:"):
        return False
    try:
        check_spec_form("model.path", where)
    except UsageError:
        return False
    return True


def check_prompts(path: str) -> int:
    """The prompts file as ``record train`` reads it (JSONL of token ids or text); the number of
    prompts. Text lines are checked for their form only (the tokenizer runs in the recording)."""
    from ..recorders.train_cli import load_prompts

    class _Shape:   # stands in for a tokenizer: the lines' form is what is checked here
        def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
            return {"input_ids": [0]}

    import stat

    try:
        st = os.stat(path)
    except OSError as e:
        raise UsageError(f"--prompts: {'no such file' if isinstance(e, FileNotFoundError) else e.strerror or e}",
                         path) from None
    if not stat.S_ISREG(st.st_mode):
        raise UsageError("--prompts: not a regular file (a directory, a FIFO or a device)", path)
    if st.st_size > MAX_PROMPTS_BYTES:
        raise UsageError(f"--prompts: {st.st_size} bytes, more than the {MAX_PROMPTS_BYTES} locate reads", path)
    return len(load_prompts(path, _Shape))
