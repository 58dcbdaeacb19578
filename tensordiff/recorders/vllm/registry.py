"""Registration: the ``vllm.general_plugins`` entry point and the table of vLLM methods it wraps.

vLLM has no hook registry: a general plugin wraps methods, once per process (a wrapped method
carries ``__tensordiff_wrapped__``, so a second :func:`register` in the same process changes
nothing), and adds the ``tensordiff_*`` RPC methods to ``WorkerBase``.
"""

from __future__ import annotations

import functools

from ..serving import config_from_env
from .config import Config
from .control import RPC_METHODS, rpc_method
from .state import STATE, log

_RUNNER = "vllm.v1.worker.gpu_model_runner.GPUModelRunner"
_PROPOSER = "vllm.v1.spec_decode.llm_base_proposer.SpecDecodeBaseProposer"
HOOK_TARGETS = (
    f"{_RUNNER}.execute_model",
    f"{_RUNNER}._model_forward",
    f"{_RUNNER}._sample",
    f"{_PROPOSER}.propose",
    f"{_PROPOSER}.set_inputs_first_pass",
    "vllm.v1.worker.worker_base.WorkerWrapperBase.shutdown",
    "vllm.v1.worker.worker_base.WorkerWrapperBase.init_device",
)
_WRAPPED = "__tensordiff_wrapped__"


def hook_table() -> list[tuple[str, str, object]]:
    """[(target, "around" | "after" | "before", function)] in the order of :data:`HOOK_TARGETS`."""
    from .control import hook_shutdown
    from .drafter import hook_propose, hook_set_inputs_first_pass
    from .forward import hook_execute_model, hook_model_forward
    from .startup import hook_init_device
    from .verify import hook_sample

    fns = (("around", hook_execute_model), ("around", hook_model_forward), ("after", hook_sample),
           ("around", hook_propose), ("after", hook_set_inputs_first_pass), ("before", hook_shutdown),
           ("after", hook_init_device))
    return [(t, kind, fn) for t, (kind, fn) in zip(HOOK_TARGETS, fns)]


def register() -> None:
    """The ``vllm.general_plugins`` entry point. Inert unless ``TENSORDIFF_TRACE`` is set."""
    cfg = config_from_env(Config, log)
    if cfg is None:
        return
    STATE.cfg = cfg
    try:
        install()
    except Exception as e:  # noqa: BLE001  (a vLLM without these methods: say so, never break serving)
        log.error("tensordiff: not recording: this vLLM lacks a method the recorder wraps (%s)", e)
        STATE.broken = True


def install() -> None:
    import importlib

    for target, kind, fn in hook_table():
        mod_name, cls_name, meth = target.rsplit(".", 2)
        cls = getattr(importlib.import_module(mod_name), cls_name)
        original = getattr(cls, meth)
        if getattr(original, _WRAPPED, False):
            continue  # register() ran twice in this process
        setattr(cls, meth, wrap(original, kind, fn))
    from vllm.v1.worker.worker_base import WorkerBase

    for name in RPC_METHODS:
        setattr(WorkerBase, name, rpc_method(name))


def wrap(original, kind: str, fn):
    if kind == "around":
        @functools.wraps(original)
        def wrapper(self, *args, **kwargs):
            return fn(original, self, *args, **kwargs)
    elif kind == "after":
        @functools.wraps(original)
        def wrapper(self, *args, **kwargs):
            out = original(self, *args, **kwargs)
            fn(out, self, *args, **kwargs)
            return out
    else:
        @functools.wraps(original)
        def wrapper(self, *args, **kwargs):
            fn(self, *args, **kwargs)
            return original(self, *args, **kwargs)
    setattr(wrapper, _WRAPPED, True)
    return wrapper
