"""Layer-id conventions: how each pipeline turns a configured id into a boundary.

boundary b = residual stream entering decoder layer b (b=0: embedding output) = HF
``hidden_states[b]`` (but HF index N is post-norm in transformers 5.x; see docs/format.md).
Sources: shared notes/training.md and notes/sglang.md (SGLang 0.5.23 model files).
Pure Python: the recorders, the importers, the aligner and the report all use it.

Two parts: the id mappings (:data:`CONVENTIONS`, :func:`resolve`; one entry per pipeline, add new
ones to the table) and the planning of a draft input (:class:`DraftPlan`,
:func:`plan_draft_input`, :func:`plan_from_labels`): which states a pipeline captures, which of
them it feeds the draft, and which it splits off as the verifier target. The HF extractor, the
importers and `record train` all plan through here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

from .vocab import FINAL_NORM, boundary_label, parse_label


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



# ----------------------------------------------------------------------------------------------
# Planning: the draft input a pipeline builds, in boundary labels
# ----------------------------------------------------------------------------------------------

# conventions a draft input can be planned for besides the id mappings of CONVENTIONS (which all
# pack cat([boundary(id) for id in ids]))
DRAFT_CONVENTIONS = {
    "specforge": "SpecForge: ids are 'output of layer id' (hidden_states[id + 1]), slots in config order",
    "eagle": "SafeAILab/EAGLE: inputs of layers 2, N//2, N-3 (ids are not used)",
    "speculators-legacy": "speculators legacy: list [hs[id + 1] for id in ids] + [verifier last state], "
                          "the trainer packs list[:-1]",
    "boundary": "explicit boundaries: ids are boundaries (or give labels)",
}


def planning_choices() -> tuple[str, ...]:
    """Every convention a draft input can be planned for: the planning ones first, then the id
    mappings of :data:`CONVENTIONS` in table order."""
    return tuple(DRAFT_CONVENTIONS) + tuple(c for c in CONVENTIONS if c not in DRAFT_CONVENTIONS)


@dataclass(frozen=True)
class DraftPlan:
    """How a pipeline builds its draft input, in boundary labels.

    ``captured``: the extractor's list of states in order; ``fed``: the slots of the packed input
    the draft consumes (``captured`` or ``captured[:-1]``); ``verifier``: a state the trainer split
    off the end of the list (speculators), else None; ``intended``: what the ids select under the
    convention alone (differs from ``fed`` when the extractor has a bug such as ``prepend_embed``).
    """

    convention: str
    raw_ids: tuple[int, ...] | None
    captured: tuple[str, ...]
    fed: tuple[str, ...]
    verifier: str | None
    intended: tuple[str, ...]
    pipeline: str
    prepend_embed: bool = False

    def as_attrs(self) -> dict:
        d = asdict(self)
        d["raw_ids"] = list(self.raw_ids) if self.raw_ids is not None else None
        for k in ("captured", "fed", "intended"):
            d[k] = list(d[k])
        return d


def as_label(x: int | str) -> str:
    """A boundary (int, or digits) or a state label, as a validated label."""
    if isinstance(x, str):
        if x.lstrip("-").isdigit():
            x = int(x)
        else:
            parse_label(x)
            return x
    return boundary_label(int(x))


def plan_from_labels(states: Sequence[int | str], *, verifier_last: bool = False,
                     pipeline: str = "labels given on the command line") -> DraftPlan:
    """A plan stated outright. ``verifier_last``: the list ends with the verifier state, which the
    trainer splits off (speculators' ``[:-1]``)."""
    labs = tuple(as_label(x) for x in states)
    if not labs or (verifier_last and len(labs) < 2):
        raise ValueError("give at least one slot label" + (" and the verifier state" if verifier_last else ""))
    fed = labs[:-1] if verifier_last else labs
    return DraftPlan("boundary", None, labs, fed, labs[-1] if verifier_last else None, fed, pipeline)


def plan_draft_input(convention: str, ids: Sequence[int] | None, num_layers: int, *,
                     prepend_embed: bool = False, hf_index_n_post_norm: bool | None = None,
                     boundaries: Sequence[int | str] | None = None,
                     ids_name_verifier: bool = False) -> DraftPlan:
    """The draft input a pipeline builds for ``ids`` on an ``num_layers``-layer target.

    * ``specforge`` [1, 3, 5] -> [layer2, layer4, layer6]
    * ``eagle`` -> inputs of layers [2, N//2, N-3] (ids ignored)
    * ``speculators-legacy`` [2, 4, 6] -> list [layer3, layer5, layer7, layerN], fed
      [layer3, layer5, layer7]; with no ids the legacy generator's [2, N//2, N-3] (+ N-1).
      ``prepend_embed=True`` models the legacy extractor bug: the list was
      ``[hs[0]] + [hs[id + 1] for id in ids]``, so ``[:-1]`` fed [embed, layer3, layer5] and left
      layer7 as the "verifier" state. ``ids_name_verifier=True``: the last id names the verifier
      state's layer too (the legacy generator's ``[2, N//2, N-3, N-1]``).
    * ``boundary`` (or ``boundaries=[...]``, ints or labels incl. ``final_norm``): as given.
    * any other name of :data:`CONVENTIONS` (hf, vllm, sglang-llama, ...):
      ``cat([boundary(id) for id in ids])``.
    ``hf_index_n_post_norm``: the pipeline indexes HF ``output_hidden_states`` directly, whose
    index N is the post-norm state in transformers 5.x, so boundary N becomes ``final_norm``
    (default: only for the ``hf`` convention).
    """
    n = int(num_layers)
    ids_t = tuple(int(i) for i in ids) if ids is not None else None
    if prepend_embed and convention != "speculators-legacy":
        raise ValueError("prepend_embed models the speculators legacy extractor; use it with --convention speculators-legacy")
    if ids_name_verifier and (convention != "speculators-legacy" or prepend_embed or not ids_t or len(ids_t) < 2):
        raise ValueError("ids_name_verifier is for the speculators legacy generator's id list (aux ids + the verifier's)")
    verifier = None
    if boundaries is not None:
        given = tuple(as_label(b) for b in boundaries)
        if not given:
            raise ValueError("explicit boundaries: give at least one")
        for lab in given:
            b = parse_label(lab)
            if b is not None and b > n:
                raise ValueError(f"boundary {b} is outside 0..{n}")
        raw = tuple(parse_label(lab) for lab in given) if FINAL_NORM not in given else None
        return DraftPlan("boundary", raw, given, given, None, given, "cat(states at the given boundaries)")
    if convention == "eagle":
        captured = fed = intended = labels(default_eagle_boundaries(n))
        pipeline = "cat([input of layer i for i in (2, N//2, N-3)])"
    elif convention == "speculators-legacy":
        if ids_t is None:
            ids_t = (2, n // 2, n - 3)
        aux_ids = ids_t[:-1] if ids_name_verifier else ids_t
        intended = labels(resolve("speculators-legacy", aux_ids, n))
        if prepend_embed:
            captured = ["embed"] + intended
            pipeline = "list = [hs[0]] + [hs[id + 1] for id in ids]; draft = cat(list[:-1]); verifier = list[-1]"
        else:
            last = resolve("speculators-legacy", ids_t[-1:], n)[0] if ids_name_verifier else n
            captured = intended + [boundary_label(last)]
            pipeline = "list = [hs[id + 1] for id in ids] + [last state]; draft = cat(list[:-1]); verifier = list[-1]"
            if ids_name_verifier:
                pipeline = "list = [hs[id + 1] for id in ids]; draft = cat(list[:-1]); verifier = list[-1]"
        fed, verifier = captured[:-1], captured[-1]
    else:
        if convention not in CONVENTIONS and convention != "specforge":
            known = ", ".join(sorted(set(DRAFT_CONVENTIONS) | set(CONVENTIONS)))
            raise ValueError(f"unknown convention {convention!r}; known: {known}")
        captured = fed = intended = labels(resolve(convention, ids_t, n))
        pipeline = ("cat([hidden_states[id + 1] for id in ids])" if convention == "specforge"
                    else f"cat([boundary(id) for id in ids]) under {convention}")
        if ids_t is None:
            pipeline += " (no ids configured: default inputs of layers 2, N//2, N-3)"
    post = (convention == "hf") if hf_index_n_post_norm is None else bool(hf_index_n_post_norm)
    last = boundary_label(n)
    if post:
        captured = [FINAL_NORM if lab == last else lab for lab in captured]
        fed = [FINAL_NORM if lab == last else lab for lab in fed]
        verifier = FINAL_NORM if verifier == last else verifier
        pipeline += "; HF index N is the post-norm state"
    return DraftPlan(convention, ids_t, tuple(captured), tuple(fed), verifier, tuple(intended), pipeline,
                     prepend_embed)



def sglang_convention_for(architecture: str) -> str:
    """The SGLang 0.5.23 id convention of a target model architecture name."""
    a = architecture.lower()
    if "deepseek" in a or "kimi" in a:
        return "sglang-deepseek"
    if "gptoss" in a or "gpt_oss" in a:
        return "sglang-gpt-oss"
    return "sglang-llama"
