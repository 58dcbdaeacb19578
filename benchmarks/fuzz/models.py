"""The fuzzer's models and how a side is recorded.

Each model is built once per process in float32 (the master copy); a side is a deep copy, edited
(a weight or config bug) in float32, then cast to the side's dtype, so a small edit is not lost to
the rounding of bf16 weights before it is applied. Side A runs attention through the eager
implementation and side B through SDPA: B is a port of A, so even a float32/float32 pair has a
(small) measured noise.

Recording goes through the real train recorder (:class:`tensordiff.recorders.hf.HFExtractorRecorder`
over :class:`tensordiff.recorders.core.Recorder`), in this process, one forward per sequence, as
``tensordiff record train`` runs it. A wiring bug is the packing code of B doing something else
than its plan says: :class:`FuzzExtractor` applies it to the parts before they are packed, and the
labels stay those of the plan (what a buggy pipeline would claim).
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .catalog import DTYPE_PAIRS, MODELS, MODES

__all__ = ["DTYPE_PAIRS", "MODELS", "MODES", "Injection", "Model", "model", "record", "side_model", "slot_labels"]

REPO = Path(__file__).resolve().parents[2]
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
PROMPTS, LENGTH = 3, 32


@dataclass
class Model:
    name: str
    master: torch.nn.Module               # float32, never edited
    prompts: list[list[int]]
    layers: int
    aux_ids: tuple[int, ...]              # the draft's ids, sglang-llama convention (inputs of layers id+1)
    mlp_ops: tuple[str, ...]              # dense MLP projections (none on an MoE)


def _tiny(cls_name: str, cfg: dict[str, Any], seed: int) -> Any:
    import transformers

    torch.manual_seed(seed)
    cfg_cls = getattr(transformers, cls_name.replace("ForCausalLM", "Config"))
    return getattr(transformers, cls_name)(cfg_cls(**cfg)).eval()


def _random_prompts(seed: int, vocab: int = 256) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, vocab, LENGTH).tolist() for _ in range(PROMPTS)]


@lru_cache(maxsize=None)
def model(name: str) -> Model:
    """The model ``name`` (one of :data:`MODELS`), built once per process."""
    common = {"vocab_size": 256, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 256, "tie_word_embeddings": False}
    if name == "trained-llama":
        sys.path.insert(0, str(REPO / "tests"))
        import trained  # the cached trained tiny Llama (scripts/train_tiny_models.py)

        from transformers import LlamaForCausalLM
        m: Any = LlamaForCausalLM.from_pretrained(str(trained.target_dir()), dtype=torch.float32)
        m.eval()
        prompts = [p[:LENGTH] for p in trained.prompts()[:PROMPTS]]
        return Model(name, m, prompts, 8, (2, 4, 6), ("gate_proj", "up_proj", "down_proj"))
    if name == "random-llama":
        m = _tiny("LlamaForCausalLM", dict(common, intermediate_size=128, num_hidden_layers=4), 11)
        return Model(name, m, _random_prompts(1), 4, (0, 1, 2), ("gate_proj", "up_proj", "down_proj"))
    if name == "qwen3":
        m = _tiny("Qwen3ForCausalLM", dict(common, intermediate_size=128, num_hidden_layers=4, head_dim=16), 12)
        return Model(name, m, _random_prompts(2), 4, (0, 1, 2), ("gate_proj", "up_proj", "down_proj"))
    if name == "mixtral":
        m = _tiny("MixtralForCausalLM", dict(common, intermediate_size=64, num_hidden_layers=4, num_local_experts=4,
                                             num_experts_per_tok=2), 13)
        return Model(name, m, _random_prompts(3), 4, (0, 1, 2), ())
    raise ValueError(f"unknown model {name!r}")


def side_model(m: Model, dtype: str, attn: str, edit: Callable[[Any], None] | None = None) -> Any:
    """A copy of the master, ``edit`` applied in float32, cast to ``dtype``, attention ``attn``."""
    x: Any = copy.deepcopy(m.master)
    if edit is not None:
        with torch.no_grad():
            edit(x)
    x = x.to(TORCH_DTYPES[dtype])
    x.set_attn_implementation(attn)
    return x


# ----------------------------------------------------------------------------------------------
# Recording


@dataclass
class Injection:
    """What a bug does at recording time (besides edits of the weights and config)."""

    hooks: list[Callable[[Any], Any]] = field(default_factory=list)   # model -> handle
    wiring: Callable[[list[torch.Tensor], dict[str, torch.Tensor]], list[torch.Tensor]] | None = None
    ids: Callable[[int, list[int]], list[int]] | None = None                # (seq index, ids) -> ids fed
    table_positions: Callable[[int, int], np.ndarray] | None = None         # (seq, T) -> positions recorded
    model_positions: Callable[[int, int], np.ndarray] | None = None         # (seq, T) -> position_ids fed
    before_seq: Callable[[Any, int], None] | None = None                    # (model, seq) before its forward


def _extractor_class() -> type:
    from tensordiff.recorders.hf import HFExtractorRecorder

    class FuzzExtractor(HFExtractorRecorder):  # type: ignore[misc]
        """The train recorder whose packing step runs B's (possibly wrong) wiring."""

        wiring: Any = None
        every_state: dict[str, torch.Tensor]
        _held: dict[str, torch.Tensor]

        def _on_state(self, label: str, b: int | None, x: torch.Tensor) -> None:
            if self._rows is not None:
                self.every_state[label] = x
            super()._on_state(label, b, x)

        def _record_draft(self, rows: np.ndarray) -> None:
            if self.wiring is not None:
                held = dict(self._held)
                parts = self.wiring([held[lab] for lab in self.plan.fed], self.every_state)
                self._held = {**held, **dict(zip(self.plan.fed, parts))}
            super()._record_draft(rows)
    return FuzzExtractor


def record(m: Model, net: Any, out: Path, mode: str, inj: Injection | None = None,
           side: str = "train", plan: Any = None) -> Path:
    """Record ``net`` (a side of model ``m``) on the model's prompts into ``out``; ``plan``: the
    draft-input plan B packs by (default: the sglang-llama convention on the model's ids)."""
    from tensordiff.conventions import plan_draft_input
    from tensordiff.recorders.core import Recorder
    from tensordiff.recorders.hf import model_info

    inj = inj or Injection()
    plan = plan or plan_draft_input("sglang-llama", list(m.aux_ids), m.layers)
    info = model_info(net)
    rec = Recorder(str(out), side=side, producer="benchmarks/fuzz", model=info,
                   meta={"draft_plan": plan.as_attrs(), "command": "benchmarks/fuzz_verdicts.py"})
    values = {"full": "all", "sketch": "none", "packed": "none"}[mode]
    hf = _extractor_class()(net, rec, plan, values=values, catalog=mode != "packed")
    hf.wiring = inj.wiring
    hf.every_state = {}
    handles = [h(net) for h in inj.hooks]
    try:
        for i, toks in enumerate(m.prompts):
            ids = list(inj.ids(i, toks)) if inj.ids else list(toks)
            T = len(ids)
            tpos = inj.table_positions(i, T) if inj.table_positions else np.arange(T)
            mpos = inj.model_positions(i, T) if inj.model_positions else np.arange(T)
            t = torch.tensor(ids, dtype=torch.long)
            if inj.before_seq:
                inj.before_seq(net, i)
            with hf.capture(f"p{i}", t, positions=np.asarray(tpos, dtype=np.int64)), torch.inference_mode():
                net(input_ids=t[None], position_ids=torch.as_tensor(np.asarray(mpos), dtype=torch.long)[None],
                    use_cache=False)
            hf.every_state = {}
    except BaseException as e:
        rec.close(e)
        raise
    finally:
        for h in handles:
            h.remove()
    rec.close()
    return out


def slot_labels(m: Model) -> list[str]:
    from tensordiff.conventions import plan_draft_input

    return list(plan_draft_input("sglang-llama", list(m.aux_ids), m.layers).fed)


def layer_ops(m: Model) -> Sequence[str]:
    return ("q_proj", "k_proj", "v_proj", "o_proj") + m.mlp_ops
