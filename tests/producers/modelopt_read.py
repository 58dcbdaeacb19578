"""Read Model-Optimizer hidden-state dumps with nvidia-modelopt 0.47.0's own offline dataset (run
with .venv-producers' python; test infrastructure, not a test module). The package ships no
writer: the collection scripts (``examples/speculative_decoding/collect_hidden_states/``) live in
its repository only, so the tests write the dumps in their layout and check here that modelopt's
``OfflineSupervisedDataset`` and ``EagleOfflineDataCollator`` take them, and what they hand the
draft: ``aux_hidden_states``, ``base_model_hidden_states`` and ``base_hidden_prenorm``.

usage: modelopt_read.py OUT_PT FILE.pt ...
"""

from __future__ import annotations

import json
import sys


def main() -> None:
    out, files = sys.argv[1], sys.argv[2:]
    import torch

    from modelopt.torch.speculative.eagle.utils import EagleOfflineDataCollator, OfflineSupervisedDataset

    ds = OfflineSupervisedDataset(files)
    view, prenorm = {}, []
    for i in range(len(ds)):
        item = ds[i]
        out_ = EagleOfflineDataCollator(train_len=int(item["input_ids"].shape[-1]))([item])["base_model_outputs"]
        view[f"{i}.aux_hidden_states"] = out_["aux_hidden_states"][0].clone()
        view[f"{i}.base_model_hidden_states"] = out_["base_model_hidden_states"][0].clone()
        prenorm.append(bool(out_.get("base_hidden_prenorm", False)))
    torch.save(view, out)
    print(json.dumps({"files": len(files), "base_hidden_prenorm": prenorm}))


if __name__ == "__main__":
    main()
