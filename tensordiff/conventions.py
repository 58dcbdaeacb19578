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
from typing import Any

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

    def as_attrs(self) -> dict[str, object]:
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
        raw = tuple(int(parse_label(lab) or 0) for lab in given) if FINAL_NORM not in given else None
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
    last_label = boundary_label(n)
    if post:
        captured = [FINAL_NORM if lab == last_label else lab for lab in captured]
        fed = [FINAL_NORM if lab == last_label else lab for lab in fed]
        verifier = FINAL_NORM if verifier == last_label else verifier
        pipeline += "; HF index N is the post-norm state"
    return DraftPlan(convention, ids_t, tuple(captured), tuple(fed), verifier, tuple(intended), pipeline,
                     prepend_embed)



def collision_note(plan: DraftPlan) -> str | None:
    """One line when the draft input's slots repeat a state (the default ids ``[2, N//2, N-3]``
    collide on models of fewer than 8 layers: 6 layers give ``[layer2, layer3, layer3]``), saying
    which ids were used; None when every slot holds a different state."""
    fed = list(plan.fed)
    dup = sorted({lab for lab in fed if fed.count(lab) > 1}, key=fed.index)
    if not dup:
        return None
    if plan.raw_ids is None:
        bs = [parse_label(lab) for lab in fed]
        ids = f"the default ids [2, N//2, N-3] = {bs}" if None not in bs else "the given states"
    else:
        ids = f"ids {list(plan.raw_ids)} under {plan.convention}"
    return (f"draft input slots collide: {ids} select [{', '.join(fed)}], {', '.join(dup)} more than once; "
            "give --aux-ids (or --boundaries) that name different states")


# ----------------------------------------------------------------------------------------------
# Prediction tensors: what the draft computes and what the target accepts (acceptance analysis)
# ----------------------------------------------------------------------------------------------
# Every recorder writes them under these names and roles (kind "other", see docs/recorders.md);
# tensordiff.acceptance reads them. Top-k rows are [ids (k) | log-probabilities (k) | logsumexp],
# float64 (ids exact), best first; ids are the TARGET vocabulary's (a draft's reduced vocabulary
# is mapped through its d2t table). k = min(requested k, vocabulary size).

DEFAULT_TOPK = 20
TARGET_TOPK = "target_topk"        # token_offset 0: row t = the target's prediction of token t+1
DRAFT_TOPK = "draft_topk"          # token_offset 1: row t (states at t, token t+1) predicts token t+2
DRAFT_FC = "draft_fc_output"       # token_offset 1: the draft's fc output [T, H] (a state: compared numerically)
SPEC_VERIFY = "spec_verify"        # serve only, one row per verify step (on the step's first row):
#   [accepted drafts a, proposed drafts K, first rejected draft position (-1: none),
#    draft token j (K), target top-1 at draft position j (K), target log-prob of draft token j (K)]
SPEC_CHAIN = "spec_chain"          # serve only, on the spec_verify row: the draft's top-k rows at draft positions
#   0..K-1 (position 0 from the draft extend, later ones from its decode steps), then the target's top-k rows at the
#   step's verify rows 0..K-1 (user attrs K, draft_width, target_width)
MOE_ROUTING = "moe_routing"        # token_offset 0, one tensor per MoE layer, named moe_routing_layer<i> (i: the
#   decoder layer, 0-based; its input is boundary i): [expert ids (k, ascending) | their router weights (k)], float64
#   (tensordiff.routing compares them: routing flips per layer)
# a trainer's router's own choice, named moe_router_own_layer<i>, role moe_routing, same layout: written
#   where its experts were handed another (a routing replay; tensordiff.rl.replay reads both)
MOE_ROUTER_OWN = "moe_router_own_layer"
SAMPLED_LOGPROB = "sampled_logprob"  # token_offset 0, one row per generated token: row t is the row whose logits
#   sampled token t+1 (the last prompt token's row for the first generated token), [sampled token id, log-prob],
#   float64. Engine side: the log-prob the engine returned for it, as the RL framework receives it (raw or
#   processed: the file attribute `sampling` says which, with the temperature, top-p, top-k;
#   tensordiff.trace.rl). Trainer side (`record train --from-serve`): the trainer's log-prob of the same token,
#   computed as an RL trainer does (log_softmax(logits / temperature)). Same name on both sides: the RL triage
#   (tensordiff.rl.logprobs, tensordiff.rl.triage) compares them row by row.
SAMPLED_LOGPROB_WIDTH = 2
# A tensor attribute, written by the recorders where a state was produced inside a torch.autocast region:
# {"enabled": true, "dtype": "bfloat16", "device": "cpu"}. Its stored dtype says how it is kept, this how it was
# computed (a float32 residual stream carries the bf16 rounding of the matmuls that fed it): tensordiff.noise
# allows the coarser of the two.
AUTOCAST_ATTR = "autocast"
PREDICTION_ROLES = (TARGET_TOPK, DRAFT_TOPK, SPEC_VERIFY, SPEC_CHAIN, MOE_ROUTING,
                    SAMPLED_LOGPROB)  # not states: the numerics skip them


def moe_routing_name(layer: int) -> str:
    """The routing tensor of the MoE in decoder layer ``layer`` (0-based)."""
    return f"{MOE_ROUTING}_layer{int(layer)}"


def moe_routing_layer(name: str) -> int | None:
    """The decoder layer of a routing tensor's name (None: not one)."""
    head = f"{MOE_ROUTING}_layer"
    tail = name[len(head):] if name.startswith(head) else ""
    return int(tail) if tail.isdigit() else None


def topk_width(k: int) -> int:
    return 2 * int(k) + 1


def topk_k(width: int) -> int:
    """k of a top-k row of this width (ids, log-probabilities, logsumexp)."""
    if width < 3 or (width - 1) % 2:
        raise ValueError(f"a top-k row is 2k+1 wide, not {width}")
    return (width - 1) // 2


def spec_verify_width(num_drafts: int) -> int:
    return 3 + 3 * int(num_drafts)


def spec_verify_drafts(width: int) -> int:
    if width < 6 or (width - 3) % 3:
        raise ValueError(f"a spec_verify row is 3 + 3K wide, not {width}")
    return (width - 3) // 3


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

    def rank(lab: str) -> tuple[bool, int]:
        from .vocab import parse_label
        b = parse_label(lab)
        return (b is None, b if b is not None else 0)
    if sorted(expected, key=rank) == actual:
        return f"slots permuted by sorting: [{', '.join(actual)}] is [{', '.join(expected)}] in ascending order"
    if sorted(actual, key=rank) == expected:
        return f"slots permuted by sorting: [{', '.join(expected)}] is [{', '.join(actual)}] in ascending order"
    return f"slots permuted: [{', '.join(actual)}] holds the states of [{', '.join(expected)}] in another order"


def draft_config_notes(engine: str, draft_config: dict[str, Any], num_layers: int | None = None) -> list[str]:
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
    ec = draft_config.get("eagle_config")
    if not isinstance(ec, dict):
        ec = {}
    nested = ec.get(key) or None
    layer_ids = ec.get("layer_ids") or None
    df = draft_config.get("dflash_config")
    if not isinstance(df, dict):
        df = {}
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


# What SGLang 0.5.23's DeepSeek forward loop (deepseek_v2.py, Kimi-K2.5 delegates to it) does with
# capture ids, seen by running it on a tiny DeepseekV3ForCausalLM: layers_to_capture = i captures
# the input of decoder layer i inside its `for i in range(start_layer, end_layer)` loop, so only
# 0..N-1 exist; 0 is the embedding (the layer-boundary capture takes it since the old
# `hidden_states + residual` crash at residual=None was fixed). An entry that is no layer is never
# captured, and the packer then raises on the first forward pass.
SGLANG_DEEPSEEK_CRASH = "RuntimeError: captured {got} of {want} aux hidden states"


def sglang_deepseek_capture_note(ids: Sequence[int] | None, num_layers: int) -> tuple[str, bool] | None:
    """(one sentence, fatal) on what SGLang's DeepSeek loop does with these draft ids when they
    ask for the embedding or for a state the loop cannot capture; None: nothing to say.
    ``fatal``: SGLang fails the first forward pass with these ids."""
    if ids is None or not len(ids):
        return None
    ids = [int(i) for i in ids]
    ltc = _sglang_deepseek(ids, num_layers)
    bad = [b for b in ltc if not 0 <= b < num_layers]
    if bad:
        crash = SGLANG_DEEPSEEK_CRASH.format(got=len(ltc) - len(bad), want=len(ltc))
        return (f"draft ids {ids} become layers_to_capture {ltc} in SGLang's DeepSeek loop, which captures the input "
                f"of decoder layers 0..{num_layers - 1} only: {', '.join(map(str, bad))} "
                f"{'is' if len(bad) == 1 else 'are'} never captured, and SGLang 0.5.23 fails the first forward pass "
                f"({crash})"), True
    if 0 in ltc:
        k = ltc.index(0)
        return (f"draft ids {ids} become layers_to_capture {ltc} in SGLang's DeepSeek loop (ids[0] != 1: taken as "
                f"they are); 0 is the input of decoder layer 0, so slot {k} holds the embedding"), False
    return None
