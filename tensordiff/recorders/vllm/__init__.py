"""The serve-side recorder inside vLLM: a ``vllm.general_plugins`` entry point.

vLLM calls every ``vllm.general_plugins`` entry point in each of its processes (the caller, the
EngineCore, every Worker; ``VLLM_PLUGINS=a,b`` restricts which); tensordiff declares
``tensordiff = "tensordiff.recorders.vllm:register"`` (an install whose entry point still names
``tensordiff.recorders.vllm_plugin`` is reinstalled with ``pip install -e .``). :func:`register` does nothing at all unless
``TENSORDIFF_TRACE`` names a trace file (the same variables as the SGLang plugin, see
:class:`tensordiff.recorders.sglang.config.Config`). Then it wraps methods of vLLM's V1 model
runner and drafter (vLLM has no hook registry: a general plugin wraps methods, once per process).
Only a Worker process ever runs them, and only TP rank 0 of the last pipeline stage records. One
module per job:

=================== ===============================================================================
:mod:`.registry`    the entry point and the table of wrapped methods (:data:`HOOK_TARGETS`)
:mod:`.config`      the ``TENSORDIFF_*`` environment (shared with the SGLang plugin), tensor names
:mod:`.startup`     on the first step: the resolved ``aux_hidden_state_layers`` next to the raw
                    draft ids and the ``vllm`` convention, opens the trace; AFTER
                    ``WorkerWrapperBase.init_device``: refuses vLLM's V2 model runner
:mod:`.ranks`       which Worker records (TP rank 0 of the last PP stage, one file per DP replica)
:mod:`.catalog`     per-boundary taps on the target model (``TENSORDIFF_CATALOG=1``, eager mode)
:mod:`.forward`     AROUND ``GPUModelRunner.execute_model`` and ``_model_forward``: token keys and
                    ``aux_hidden_states`` of each target step, held until it is sampled
:mod:`.verify`      AFTER ``GPUModelRunner._sample``: keeps the rows of accepted tokens (verify
                    segments), drops rejected drafts and rows past ``max_tokens``, writes the step
:mod:`.drafter`     AROUND ``SpecDecodeBaseProposer.propose``, AFTER ``set_inputs_first_pass``:
                    ``draft_input`` and ``draft_input_ids``, with the shift-by-one check
:mod:`.control`     ``collective_rpc("tensordiff_close" | "_flush" | "_pause" | "_resume")``, BEFORE
                    ``WorkerWrapperBase.shutdown`` (close), the idle flusher thread
:mod:`.state`       the per-process state shared by the hooks, request id -> sequence key
=================== ===============================================================================

Importing this package imports neither torch nor vllm. A recording error never reaches the engine:
it is logged, recording stops and the trace is closed with a ``recording_error`` attribute. See
docs/vllm.md.
"""

from __future__ import annotations

from .config import AUX, DRAFT, DRAFT_IDS, Config, rank_path
from .control import IDLE_FLUSH_SECONDS, RPC_METHODS
from .registry import HOOK_TARGETS, hook_table, register

__all__ = [
    "AUX",
    "DRAFT",
    "DRAFT_IDS",
    "HOOK_TARGETS",
    "IDLE_FLUSH_SECONDS",
    "RPC_METHODS",
    "Config",
    "hook_table",
    "rank_path",
    "register",
]
