"""Run vLLM 0.32.0's ``extract_hidden_states`` method on the CPU (with .venv-vllm's python) the way
speculators 0.9.0's data generation launches it, and write one ``<request>.safetensors`` per
prompt with vLLM's ``ExampleHiddenStatesConnector`` (test infrastructure, not a test module).

The one stand-in: the connector's ``_submit_async_write`` copies the states off the GPU through
CUDA streams, events and pinned memory, which a CPU build refuses (``RuntimeError: pin_memory=True
requires a CUDA or other accelerator backend; no pinned memory allocator is available on this
system``). :func:`cpu_write` replaces it with the same steps done synchronously on the CPU: vLLM's
own slot mapping and ``extract_from_kv_cache``, and the connector's own ``_write_tensors``
(safetensors ``hidden_states`` + ``token_ids``, the companion ``.lock`` released after the write).

usage: vllm_extract.py MODEL_DIR PROMPTS_JSON OUT_DIR LAYER_IDS_JSON
prints a JSON list of the files' paths (kv_transfer_params' hidden_states_path), one per prompt
"""

from __future__ import annotations

import json
import os
import sys


class _Done:
    """A copy event that has already completed (the CPU copy is synchronous)."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


def cpu_write(self, pending) -> None:
    import fcntl

    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1 import example_hidden_states_connector as m

    if not self._is_tp_rank_zero:
        return
    block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
    offsets = torch.arange(0, self._block_size, dtype=torch.long)
    slots = (offsets.reshape(1, -1) + block_ids.reshape(-1, 1) * self._block_size).flatten()
    n = pending.token_ids.shape[0]
    tensors = {"hidden_states": m.extract_from_kv_cache(self._kv_cache, slots, n).clone(),
               "token_ids": pending.token_ids.clone()}
    os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
    lock_fd = self._lock_fds.pop(pending.req_id, None)
    if lock_fd is None and self.use_lock:
        lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
        fcntl.flock(lock_fd, fcntl.LOCK_EX)
    self._write_tensors(tensors, _Done(), pending.filename, lock_fd)
    self._req_copy_events[pending.req_id] = _Done()


def main() -> None:
    model_dir, prompts_json, out_dir, layer_ids = sys.argv[1:5]
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process: the stand-in reaches it
    from vllm import LLM, SamplingParams
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
        ExampleHiddenStatesConnector,
    )

    ExampleHiddenStatesConnector._submit_async_write = cpu_write
    prompts = json.loads(open(prompts_json).read())
    llm = LLM(model=model_dir, skip_tokenizer_init=True, dtype="float32", enforce_eager=True, seed=0,
              distributed_executor_backend="uni", kv_cache_memory_bytes=268435456, block_size=32,
              max_model_len=512, max_num_seqs=8,
              speculative_config={"method": "extract_hidden_states", "num_speculative_tokens": 1,
                                  "draft_model_config": {"hf_config": {
                                      "eagle_aux_hidden_state_layer_ids": json.loads(layer_ids)}}},
              kv_transfer_config={"kv_connector": "ExampleHiddenStatesConnector", "kv_role": "kv_producer",
                                  "kv_connector_extra_config": {"shared_storage_path": out_dir}})
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=1, temperature=0))
    paths = [o.kv_transfer_params["hidden_states_path"] for o in outs]
    # a finished request's save reaches the worker with the next scheduler step: the offline
    # engine stops stepping when its last request finishes, a server keeps stepping
    for _ in range(20):
        if all(os.path.exists(p) for p in paths):
            break
        llm.llm_engine.step()
    print("PATHS " + json.dumps(paths), flush=True)


if __name__ == "__main__":
    main()
