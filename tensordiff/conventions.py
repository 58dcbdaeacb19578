"""Layer-id conventions: how each pipeline turns a configured id into a boundary.

boundary b = residual stream entering decoder layer b (b=0: embedding output) = HF
``hidden_states[b]`` (but HF index N is post-norm in transformers 5.x; see docs/format.md).
Sources: shared notes/training.md and notes/sglang.md (SGLang 0.5.23 model files).
Pure Python: the recorders, the aligner and the report all use it.
"""

from __future__ import annotations

from typing import Callable, Sequence

from .vocab import boundary_label


def default_eagle_boundaries(num_layers: int) -> list[int]:
    """EAGLE-3's default capture: inputs of layers 2, N//2 and N-3."""
    n = num_layers
    return [2, n // 2, n - 3]


def _plus_one(ids: Sequence[int], n: int) -> list[int]:
    return [int(i) + 1 for i in ids]


def _as_is(ids: Sequence[int], n: int) -> list[int]:
    return [int(i) for i in ids]


def _sglang_deepseek(ids: Sequence[int], n: int) -> list[int]:
    # deepseek_v2 (and Kimi-K2.5) >= 0.5.13: +1 only when ids[0] == 1
    return _plus_one(ids, n) if ids and int(ids[0]) == 1 else _as_is(ids, n)


def _sglang_gpt_oss(ids: Sequence[int], n: int) -> list[int]:
    return _as_is(ids, n) if ids and max(int(i) for i in ids) == n else _plus_one(ids, n)


# name -> (ids, num_layers) -> boundaries ; and a one-line description
CONVENTIONS: dict[str, tuple[Callable[[Sequence[int], int], list[int]], str]] = {
    "boundary": (_as_is, "ids are boundaries already (HF output_hidden_states index, vLLM)"),
    "hf": (_as_is, "HF output_hidden_states index k is boundary k"),
    "vllm": (_as_is, "vLLM: id 0 is the embedding, no offset"),
    "specforge": (_plus_one, "SpecForge: id is 'output of layer id', boundary id+1"),
    "speculators-legacy": (_plus_one, "speculators legacy generator: captured after layer id, boundary id+1"),
    "sglang-llama": (_plus_one, "SGLang llama/qwen/glm4_moe/minimax: layers_to_capture = id+1"),
    "sglang-deepseek": (_sglang_deepseek, "SGLang deepseek_v2/kimi_k25 >= 0.5.13: +1 only if ids[0] == 1"),
    "sglang-deepseek-old": (_plus_one, "SGLang deepseek_v2 <= 0.5.12: always +1"),
    "sglang-gpt-oss": (_sglang_gpt_oss, "SGLang gpt_oss: as-is if max(ids) == N, else +1"),
}


def resolve(convention: str, ids: Sequence[int] | None, num_layers: int) -> list[int]:
    """Boundaries the given ids select under ``convention``. ``ids=None`` means "no ids configured":
    the EAGLE default inputs of layers [2, N//2, N-3], with no offset (every engine does this)."""
    if ids is None or convention == "eagle":
        return default_eagle_boundaries(num_layers)
    try:
        fn = CONVENTIONS[convention][0]
    except KeyError:
        known = ", ".join(sorted(list(CONVENTIONS) + ["eagle"]))
        raise ValueError(f"unknown layer-id convention {convention!r}; known: {known}") from None
    out = fn(ids, num_layers)
    for b in out:
        if not 0 <= b <= num_layers:
            raise ValueError(f"{convention}: id list {list(ids)} selects boundary {b}, outside 0..{num_layers}")
    return out


def labels(boundaries: Sequence[int]) -> list[str]:
    return [boundary_label(b) for b in boundaries]


def sglang_convention_for(architecture: str) -> str:
    """The SGLang 0.5.23 id convention of a target model architecture name."""
    a = architecture.lower()
    if "deepseek" in a or "kimi" in a:
        return "sglang-deepseek"
    if "gptoss" in a or "gpt_oss" in a:
        return "sglang-gpt-oss"
    return "sglang-llama"


# ----------------------------------------------------------------------------------------------
# vLLM, TensorRT-LLM, NVIDIA Model-Optimizer (appended; sources: shared notes/vllm.md, read from
# vLLM 0.32 `model_executor/models/interfaces.py`, `v1/worker/gpu_model_runner.py`,
# `v1/worker/gpu/spec_decode/eagle/eagle3_utils.py`)
# ----------------------------------------------------------------------------------------------

#: Conventions whose engine captures the ids in ascending order (de-duplicated), whatever order
#: the draft config lists them in.
SORTING_CONVENTIONS = ("vllm", "trtllm", "modelopt")

#: TensorRT-LLM's id for the final post-norm state (the lm_head input), not a boundary.
TRTLLM_FINAL = -1


def _vllm_sorted(ids: Sequence[int], n: int) -> list[int]:
    # EagleModelMixin._set_aux_hidden_state_layers: tuple(sorted(set(ids))); llama appends
    # hidden_states + residual after layer idx with index idx + 1, so id b = boundary b
    return sorted({int(i) for i in ids})


def _trtllm(ids: Sequence[int], n: int) -> list[int]:
    # "output of layer id" = boundary id + 1, captured in ascending order; -1 is final_norm
    if any(int(i) == TRTLLM_FINAL for i in ids):
        raise ValueError("TensorRT-LLM id -1 is the final post-norm state, not a boundary "
                         "(use conventions.resolve_labels)")
    return [i + 1 for i in sorted({int(i) for i in ids})]


CONVENTIONS["vllm"] = (_vllm_sorted, "vLLM: ids are boundaries (id 0 = embedding), captured sorted and de-duplicated")
CONVENTIONS["trtllm"] = (_trtllm, "TensorRT-LLM: id = output of layer id (boundary id+1), sorted; -1 = final post-norm, last")
CONVENTIONS["modelopt"] = (_vllm_sorted, "Model-Optimizer collect_hidden_states: HF hidden_states indices, sorted(set(...))")


def trtllm_default_ids(num_layers: int) -> list[int]:
    """TensorRT-LLM's default capture ids ``{1, N//2 - 1, N - 4}`` ("output of layer id")."""
    n = num_layers
    return sorted({1, n // 2 - 1, n - 4})


def resolve_labels(convention: str, ids: Sequence[int] | None, num_layers: int) -> list[str]:
    """State labels the ids select, in the order the engine captures them. Unlike
    :func:`resolve` it knows states that are not boundaries: TensorRT-LLM's ``-1`` is
    ``final_norm`` (sorted last)."""
    if convention == "trtllm":
        ids = trtllm_default_ids(num_layers) if ids is None else [int(i) for i in ids]
        rest = [i for i in ids if i != TRTLLM_FINAL]
        out = labels(resolve("trtllm", rest, num_layers)) if rest else []
        return out + (["final_norm"] if TRTLLM_FINAL in ids else [])
    if convention == "modelopt" and ids is None:
        ids = default_eagle_boundaries(num_layers)
    return labels(resolve(convention, ids, num_layers))


def capture_order_note(convention: str, ids: Sequence[int] | None, num_layers: int | None = None) -> str | None:
    """One line when the configured id order differs from the order the engine captures in
    ("slots permuted by sorting"), or when duplicates are dropped; None when they agree."""
    if ids is None or convention not in SORTING_CONVENTIONS:
        return None
    ids = [int(i) for i in ids]
    key = (lambda i: (i == TRTLLM_FINAL, i)) if convention == "trtllm" else (lambda i: i)
    captured = sorted(set(ids), key=key)
    if captured == ids:
        return None
    engine = {"vllm": "vLLM", "trtllm": "TensorRT-LLM", "modelopt": "Model-Optimizer"}[convention]
    parts = []
    if len(set(ids)) != len(ids):
        parts.append(f"duplicates dropped ({len(ids)} ids, {len(captured)} slots)")
    if sorted(ids, key=key) != ids:
        parts.append("slots permuted by sorting")
    msg = f"draft ids {ids} are captured by {engine} in the order {captured}: " + ", ".join(parts)
    if num_layers is not None:
        try:
            cfg_order = [resolve_labels(convention, [i], num_layers)[0] for i in ids]
            cap = resolve_labels(convention, captured, num_layers)
            msg += (f"; a pipeline that packs them in config order feeds [{', '.join(cfg_order)}] where "
                    f"{engine} feeds [{', '.join(cap)}]")
        except ValueError:
            pass
    return msg


def permutation_note(expected: Sequence[str], actual: Sequence[str]) -> str | None:
    """``"slots permuted by sorting"`` when ``actual`` is ``expected`` in another order and is the
    sorted one (by boundary, ``final_norm`` last): for a diff that has both sides' slot labels."""
    expected, actual = list(expected), list(actual)
    if expected == actual or sorted(expected) != sorted(actual):
        return None

    def rank(lab: str) -> tuple:
        from .vocab import parse_label
        b = parse_label(lab)
        return (b is None, b if b is not None else 0)
    if sorted(expected, key=rank) == actual:
        return f"slots permuted by sorting: [{', '.join(actual)}] is [{', '.join(expected)}] in ascending order"
    if sorted(actual, key=rank) == expected:
        return f"slots permuted by sorting: [{', '.join(expected)}] is [{', '.join(actual)}] in ascending order"
    return f"slots permuted: [{', '.join(actual)}] holds the states of [{', '.join(expected)}] in another order"


def draft_config_notes(engine: str, draft_config: dict, num_layers: int | None = None) -> list[str]:
    """Keys of an EAGLE-3 draft config that ``engine`` ignores, one line each.

    engine ``vllm`` (V1 model runner, 0.32 ``_get_eagle3_aux_layers_from_config``): reads the
    top-level ``eagle_aux_hidden_state_layer_ids``; only when it is missing, DFlash
    ``target_layer_ids`` (+1) and then the nested ``eagle_config.eagle_aux_hidden_state_layer_ids``
    (the nested key wins over DFlash). ``vllm-v2`` (V2 model runner,
    ``get_eagle3_aux_layers_from_config``): the top-level key, DFlash, then
    ``eagle_config.layer_ids``; it never reads the nested ``eagle_aux_hidden_state_layer_ids``.
    ``sglang`` (0.5.23): only the nested key; a top-level one is ignored for capture."""
    if not isinstance(draft_config, dict):
        return []
    key = "eagle_aux_hidden_state_layer_ids"
    top = draft_config.get(key) or None
    ec = draft_config.get("eagle_config") if isinstance(draft_config.get("eagle_config"), dict) else {}
    nested = ec.get(key) or None
    layer_ids = ec.get("layer_ids") or None
    df = draft_config.get("dflash_config") if isinstance(draft_config.get("dflash_config"), dict) else {}
    dflash = [int(i) + 1 for i in (df.get("target_layer_ids") or [])] or None
    default = f"the default {default_eagle_boundaries(num_layers)}" if num_layers else "the default (2, N//2, N-3)"
    notes: list[str] = []
    if engine == "vllm":
        if top is not None and nested is not None and list(top) != list(nested):
            notes.append(f"vLLM reads the top-level {key} {list(top)}; eagle_config.{key} {list(nested)} is ignored")
        if top is None and nested is not None and dflash is not None and list(nested) != dflash:
            notes.append(f"vLLM takes eagle_config.{key} {list(nested)} over DFlash target_layer_ids (+1: {dflash})")
        if layer_ids is not None and top is None and nested is None and dflash is None:
            notes.append(f"vLLM's V1 runner ignores eagle_config.layer_ids {list(layer_ids)} and captures {default}")
    elif engine == "vllm-v2":
        if nested is not None and top is None and dflash is None and layer_ids is None:
            notes.append(f"vLLM's V2 model runner ignores eagle_config.{key} {list(nested)} (it reads the top-level "
                         f"key, DFlash target_layer_ids and eagle_config.layer_ids) and captures {default}")
        elif nested is not None and layer_ids is not None and top is None and list(nested) != list(layer_ids):
            notes.append(f"vLLM's V2 model runner reads eagle_config.layer_ids {list(layer_ids)}; "
                         f"eagle_config.{key} {list(nested)} is ignored")
    elif engine == "sglang":
        if top is not None and nested is None:
            notes.append(f"SGLang reads only eagle_config.{key}; the top-level {key} {list(top)} is ignored for "
                         f"capture and it captures {default}")
        elif top is not None and nested is not None and list(top) != list(nested):
            notes.append(f"SGLang captures eagle_config.{key} {list(nested)}; the top-level {key} {list(top)} "
                         "is ignored for capture")
    return notes
