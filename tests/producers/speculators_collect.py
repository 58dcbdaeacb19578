"""Finish speculators 0.9.0's offline data generation with its own code (run with
.venv-producers' python; test infrastructure, not a test module): for each file vLLM's
``extract_hidden_states`` connector wrote (``vllm_extract.py``), what generate-offline-data's worker
does with a response's ``hidden_states_path``: wait for the connector's lock
(``wait_for_lock``), move the file to ``hs_<index>.safetensors`` and validate it
(``check_hidden_states``); then the trainer's own dataset (``ArrowDataset`` over the saved token
dataset, ``FileTransfer``) reads every sample back, and what it would train on is written to
``trainer_view.pt`` (``hidden_states`` = the packed aux input, ``verifier_last_hidden_states``).

usage: speculators_collect.py PATHS_JSON PROMPTS_JSON DATA_DIR
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path


def main() -> None:
    paths_json, prompts_json, data_dir = sys.argv[1:4]
    import torch
    from datasets import Dataset
    from safetensors.torch import load_file

    from speculators.data_generation.offline import check_hidden_states, get_existing_hidden_state_indices
    from speculators.data_generation.vllm_client import wait_for_lock
    from speculators.train.data import ArrowDataset

    paths = json.loads(Path(paths_json).read_text())
    prompts = json.loads(Path(prompts_json).read_text())
    data = Path(data_dir)
    hs_dir = data / "hidden_states"
    hs_dir.mkdir(parents=True, exist_ok=True)
    for idx, (src, toks) in enumerate(zip(paths, prompts)):
        if Path(src + ".lock").exists():
            wait_for_lock(src + ".lock")
        dst = hs_dir / f"hs_{idx}.safetensors"
        shutil.move(src, dst)
        check_hidden_states(load_file(dst), toks)
    assert get_existing_hidden_state_indices(hs_dir) == list(range(len(prompts)))

    # the token dataset the trainer pairs the files with (prepare-data's columns it reads)
    Dataset.from_dict({"input_ids": prompts, "loss_mask": [[1] * len(p) for p in prompts],
                       "seq_len": [len(p) for p in prompts]}).with_format("torch").save_to_disk(str(data / "tokens"))
    shutil.move(str(hs_dir), str(data / "tokens" / "hidden_states"))
    ds = ArrowDataset(max_len=4096, datapath=str(data / "tokens"), on_missing="raise", hidden_states_dtype=torch.float32)
    view = {}
    for i in range(len(ds)):
        raw = ds._get_raw_data(i)
        view[f"{i}.hidden_states"] = raw["hidden_states"].clone()
        view[f"{i}.verifier_last_hidden_states"] = raw["verifier_last_hidden_states"].clone()
    torch.save(view, data / "trainer_view.pt")
    print(json.dumps({"files": len(prompts), "hs_dir": str(data / "tokens" / "hidden_states")}))


if __name__ == "__main__":
    main()
