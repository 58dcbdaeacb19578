"""The serve-side recorder: an SGLang plugin that records what the engine computes, as it runs.

SGLang loads every ``sglang.srt.plugins`` entry point in each of its processes (``SGLANG_PLUGINS``
restricts which); tensordiff declares ``tensordiff = "tensordiff.recorders.sglang:register"``
(an install whose entry point still names ``tensordiff.recorders.sglang_plugin`` is reinstalled
with ``pip install -e .``). :func:`register` does nothing at all unless ``TENSORDIFF_TRACE`` names a trace file.
Then it registers these hooks through SGLang's ``HookRegistry`` (nothing else in SGLang is patched);
one module per job:

=================== ===============================================================================
:mod:`.registry`    the entry point and the hook table (:data:`HOOK_TARGETS`)
:mod:`.config`      the ``TENSORDIFF_*`` environment, tensor names, per-rank trace paths
:mod:`.startup`     AROUND ``ModelRunner.init_attention_backends``: the resolved ``layers_to_capture``
                    next to the raw draft ids and the model file's id convention; opens the trace
:mod:`.ranks`       each rank's file (``.tp<r>`` where TP > 1) and rank facts
:mod:`.catalog`     per-boundary taps on the target model (``TENSORDIFF_CATALOG=1``, eager passes)
:mod:`.forward`     AROUND ``ModelRunner.forward``: token keys, ``aux_hidden_states`` (target),
                    ``draft_input`` + ``draft_input_ids`` (draft-extend passes)
:mod:`.capture`     what each hook takes from the engine: on the CPU a snapshot of the pass, queued
                    and recorded later in a batch (at idle, a flush, a bound), elsewhere at once
:mod:`.predictions` taps on the draft's ``fc`` and each model's logits processor: ``draft_fc_output``,
                    ``target_topk``, ``draft_topk`` (top-k ids, log-probs, logsumexp)
:mod:`.verify`      AFTER ``EAGLEWorkerV2.verify``: commits the accepted verify rows; ``spec_verify``
                    (accepted drafts, first rejected position, per draft position) per verify step
:mod:`.control`     AFTER ``Scheduler.on_idle`` (flush), AROUND ``Scheduler.handle_rpc_request``
                    (``tensordiff_close`` / ``_flush`` / ``_pause`` / ``_resume``)
:mod:`.rl`          AFTER ``Scheduler.process_batch_result`` and the scheduler's weight-update calls:
                    ``sampled_logprob``, the ``sampling`` attribute, weight fingerprints per
                    weight step, a replay's prefill log-probs (``TENSORDIFF_RL=0``: off)
:mod:`.state`       the per-process state shared by the hooks
=================== ===============================================================================

Configuration (environment of the server process):

=========================== =====================================================================
``TENSORDIFF_TRACE``        trace path (required; unset = the plugin is inert)
``TENSORDIFF_CATALOG``      ``1``: record the per-boundary catalog on eager passes (default ``0``)
``TENSORDIFF_VALUES``       comma-separated globs of tensors that keep full values (default
                            ``aux_hidden_states,draft_input,draft_fc_output``; ``all``, ``none``);
                            others keep sketch + RMS
``TENSORDIFF_SAMPLE_EVERY`` record positions ``p % K == 0`` only (default 1: all)
``TENSORDIFF_SKETCH_DIM``, ``TENSORDIFF_SKETCH_SEED``  sketch projection (both sides must agree)
``TENSORDIFF_FLUSH_SECONDS`` flush at least this often while busy (default 10)
``TENSORDIFF_COMPRESSION``  ``gzip`` or ``lzf`` (default none)
``TENSORDIFF_TOPK``         k of the recorded top-k predictions (default 20; 0: none)
``TENSORDIFF_PROFILE``      a file: write a cProfile stats file of the plugin's own code there at
                            close (per rank, like the trace; ``python -m pstats FILE``)
``TENSORDIFF_STAGE_MB``     CPU tensors: RMS, sketches, top-k tables and appends done for many
                            passes at once, up to this many MiB staged (default 64; 0: per pass)
=========================== =====================================================================

Importing this package imports neither torch nor sglang; :func:`register` imports sglang only when
``TENSORDIFF_TRACE`` is set. A recording error never reaches the engine: it is logged, recording
stops and the trace is closed with a ``recording_error`` attribute. See docs/sglang.md.
"""

from __future__ import annotations

from .config import (
           AUX,
           DEFAULT_VALUES,
           DRAFT,
           DRAFT_IDS,
           ENV_TRACE,
           RPC_PREFIX,
           Config,
           rank_path,
)
from .control import RPC_METHODS
from .registry import HOOK_TARGETS, RL_HOOK_TARGETS, hook_table, register

__all__ = [
           "AUX",
           "DEFAULT_VALUES",
           "DRAFT",
           "DRAFT_IDS",
           "ENV_TRACE",
           "HOOK_TARGETS",
           "RL_HOOK_TARGETS",
           "RPC_METHODS",
           "RPC_PREFIX",
           "Config",
           "hook_table",
           "rank_path",
           "register",
]
