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
