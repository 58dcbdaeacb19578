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
_WU = "sglang.srt.managers.scheduler_components.weight_updater.SchedulerWeightUpdaterManager"
#: the RL records' hooks (:mod:`.rl`): the log-probs requests receive, the weight updates
RL_HOOK_TARGETS = (
    "sglang.srt.managers.scheduler.Scheduler.process_batch_result",
    *(f"{_WU}.{event}" for event in ("update_weights_from_disk", "update_weights_from_tensor",
                                     "update_weights_from_distributed", "update_weights_from_ipc")),
    f"{_WU}.end_weight_update",
    "sglang.srt.managers.scheduler.Scheduler.flush_cache",
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


def rl_hook_table() -> list[tuple[str, object, str]]:
    """The RL records' hooks (all AFTER), in the order of :data:`RL_HOOK_TARGETS`; none with
    ``TENSORDIFF_RL=0``."""
    from . import rl

    if not rl.RL.enabled:
        return []
    fns = (rl.hook_process_batch_result, *(rl.hook_weight_update(t.rpartition(".")[2]) for t in RL_HOOK_TARGETS[1:-2]),
           rl.hook_end_weight_update, rl.hook_flush_cache)
    return [(t, fn, "AFTER") for t, fn in zip(RL_HOOK_TARGETS, fns)]


def register() -> None:
    """The ``sglang.srt.plugins`` entry point. Inert unless ``TENSORDIFF_TRACE`` is set."""
    cfg = config_from_env(Config, log)
    if cfg is None:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    STATE.cfg = cfg
    STATE.start_topk = cfg.topk
    for target, fn, kind in hook_table() + rl_hook_table():
        HookRegistry.register(target, fn, getattr(HookType, kind))
