"""Write SpecForge offline hidden-state files with SpecForge 0.2.0's own code (run with
.venv-producers' python; test infrastructure, not a test module).

SpecForge 0.2.0 prepares offline features with a local SGLang target only
(``specforge.offline_capture.sglang_backend``): that backend imports SGLang 0.5.14 internals
(``from sglang.srt.distributed import get_pp_group`` fails on the SGLang 0.5.23 this project runs)
and asks for ``torch.cuda.current_device()``, so it cannot run on this CPU. What stands in for it is
the same capture it drives, ``set_eagle3_layers_to_capture(ids)`` on SGLang's llama, through
SGLang 0.5.23's CPU engine (``return_aux_hidden_state_layer_ids``): SGLang applies the ``+ 1``
itself. The final state SpecForge's backend takes from the logits processor (post-norm) comes from
the HF model, not from SGLang (the engine is started to return the aux states). Everything
else is SpecForge's: the capture ids (``resolve_eagle_capture_layers`` from the draft config), the
record (its eagle3 ``OfflineCaptureLayout.materialize``), the file name scheme of its preparation
script (``rows_<start>-<end>/data_<i>.ckpt``) and a read-back through its own offline normalizer.

usage: specforge_write.py MODEL_DIR PROMPTS_JSON OUT_DIR AUX_IDS_JSON|default
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))


def main() -> None:
    model_dir, prompts_json, out_dir, ids_arg = sys.argv[1:5]
    import sglang_support as ss

    ss.prepare_cpu_env()
    import torch
    from transformers import AutoConfig, LlamaForCausalLM

    from specforge.algorithms.eagle3.data import normalize_offline_sample
    from specforge.algorithms.eagle3.providers import algorithm_providers
    from specforge.algorithms.model_providers import resolve_eagle_capture_layers

    prompts = json.loads(Path(prompts_json).read_text())
    target_config = AutoConfig.from_pretrained(model_dir)
    draft_config = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": json.loads(ids_arg)}} if ids_arg != "default" else {}
    cfg = SimpleNamespace(model=SimpleNamespace(aux_hidden_state_layer_ids=None))
    ids = resolve_eagle_capture_layers(cfg, draft_config, target_config)
    layout = algorithm_providers().offline[0].capture_layout
    H = int(target_config.hidden_size)

    engine = ss.start_capture_engine(model_dir, ids)
    try:
        outs = ss.greedy_generate(engine, prompts, 1, return_hidden_states=True)
    finally:
        engine.shutdown()
    hf = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = Path(out_dir)
    for i, (p, o) in enumerate(zip(prompts, outs)):
        L = len(p)
        aux = ss.aux_hidden_states(o, H, len(ids))[:L].reshape(L, len(ids) * H)  # the prompt's rows
        with torch.no_grad():
            last = hf.model(torch.tensor([p])).last_hidden_state[0]  # post-norm
        ids_t = torch.tensor(p, dtype=torch.long)
        record = layout.materialize({"input_ids": ids_t, "loss_mask": torch.ones_like(ids_t),
                                     "aux_hidden_states": aux[None].clone(), "last_hidden_states": last[None].clone()})
        group = (i // 5000) * 5000
        f = out / f"rows_{group}-{group + 5000}" / f"data_{i}.ckpt"
        f.parent.mkdir(parents=True, exist_ok=True)
        torch.save(record, f)
        # SpecForge's own offline reader path accepts it
        back = normalize_offline_sample(torch.load(f, weights_only=True), 4096)
        assert back["hidden_state"].shape[-1] == len(ids) * H, back["hidden_state"].shape
    print(json.dumps({"capture_ids": ids, "keys": sorted(record), "files": len(prompts)}))


if __name__ == "__main__":
    main()
