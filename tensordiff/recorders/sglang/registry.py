"""Registration: the ``sglang.srt.plugins`` entry point and the table of hooks it registers
through SGLang's ``HookRegistry`` (nothing else in SGLang is patched)."""

from __future__ import annotations

from ..serving import config_from_env
from .config import Config
from .state import STATE, log

_MR = "sglang.srt.model_executor.model_runner.ModelRunner"
HOOK_TARGETS = (
    f"{_MR}.init_attention_backends",
    f"{_MR}.forward",
    "sglang.srt.speculative.eagle_worker_v2.EAGLEWorkerV2.verify",
    "sglang.srt.managers.scheduler.Scheduler.on_idle",
    "sglang.srt.managers.scheduler.Scheduler.handle_rpc_request",
)


def hook_table() -> list[tuple[str, object, str]]:
    """[(target, function, "AROUND" | "AFTER")] in the order of :data:`HOOK_TARGETS`."""
    from .control import hook_on_idle, hook_rpc
    from .forward import hook_forward
    from .startup import hook_init_attention_backends
    from .verify import hook_verify

    fns = ((hook_init_attention_backends, "AROUND"), (hook_forward, "AROUND"), (hook_verify, "AFTER"),
           (hook_on_idle, "AFTER"), (hook_rpc, "AROUND"))
    return [(t, fn, kind) for t, (fn, kind) in zip(HOOK_TARGETS, fns)]


def register() -> None:
    """The ``sglang.srt.plugins`` entry point. Inert unless ``TENSORDIFF_TRACE`` is set."""
    cfg = config_from_env(Config, log)
    if cfg is None:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    STATE.cfg = cfg
    STATE.start_topk = cfg.topk
    for target, fn, kind in hook_table():
        HookRegistry.register(target, fn, getattr(HookType, kind))
