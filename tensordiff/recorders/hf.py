"""The train-side extractor recorder for HF transformers causal LMs.

For each token sequence it records, through a :class:`~.core.Recorder`:

* the catalog: every boundary ``embed``, ``layer1`` .. ``layerN`` (role ``catalog``; sketch + RMS
  for all, full values for the ones asked) and ``final_norm`` (the lm_head input);
* ``draft_input`` (role ``draft_input``): the packed ``[T, K*H]`` tensor the draft is fed, built
  as a named pipeline builds it (:func:`plan_draft_input`), with the slot labels of what it
  actually holds and the raw ids + convention beside, ``token_offset=1`` (draft row t holds the
  states at position t and is paired with token t+1; the last position has no row).

Boundaries are taken by forward hooks, not from ``output_hidden_states``: boundary b < N is the
input of decoder layer b (the same tensor HF returns as ``hidden_states[b]``), boundary N is the
input of the final norm (PRE-norm), and ``final_norm`` is that norm's output. transformers 5.x
returns the post-norm state as ``hidden_states[N]``; here it is ``final_norm``, never ``layerN``.
"""

from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass
from typing import Any, Iterable, Iterator, Sequence

import numpy as np
import torch

from .. import conventions
from ..vocab import FINAL_NORM, boundary_label, parse_label
from .core import Recorder, logical_dtype
from .hooks import batch_rows

__all__ = ["DraftPlan", "plan_draft_input", "DRAFT_CONVENTIONS", "find_decoder", "model_info",
           "HFExtractorRecorder", "draft_rows"]

# conventions this recorder can build a draft input for (besides the id-mapping ones of
# tensordiff.conventions, which all pack cat([boundary(id) for id in ids]))
DRAFT_CONVENTIONS = {
    "specforge": "SpecForge: ids are 'output of layer id' (hidden_states[id + 1]), slots in config order",
    "eagle": "SafeAILab/EAGLE: inputs of layers 2, N//2, N-3 (ids are not used)",
    "speculators-legacy": "speculators legacy: list [hs[id + 1] for id in ids] + [verifier last state], "
                          "the trainer packs list[:-1]",
    "boundary": "explicit boundaries: ids are boundaries (or give labels)",
}


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


def _label(x: int | str) -> str:
    if isinstance(x, str):
        if x.lstrip("-").isdigit():
            x = int(x)
        else:
            parse_label(x)
            return x
    return boundary_label(int(x))


def plan_draft_input(convention: str, ids: Sequence[int] | None, num_layers: int, *,
                     prepend_embed: bool = False, hf_index_n_post_norm: bool | None = None,
                     boundaries: Sequence[int | str] | None = None) -> DraftPlan:
    """The draft input a pipeline builds for ``ids`` on an ``num_layers``-layer target.

    * ``specforge`` [1, 3, 5] -> [layer2, layer4, layer6]
    * ``eagle`` -> inputs of layers [2, N//2, N-3] (ids ignored)
    * ``speculators-legacy`` [2, 4, 6] -> list [layer3, layer5, layer7, layerN], fed
      [layer3, layer5, layer7]; with no ids the legacy generator's [2, N//2, N-3] (+ N-1).
      ``prepend_embed=True`` models the legacy extractor bug: the list was
      ``[hs[0]] + [hs[id + 1] for id in ids]``, so ``[:-1]`` fed [embed, layer3, layer5] and left
      layer7 as the "verifier" state.
    * ``boundary`` (or ``boundaries=[...]``, ints or labels incl. ``final_norm``): as given.
    * any other name of :data:`tensordiff.conventions.CONVENTIONS` (hf, vllm, sglang-llama, ...):
      ``cat([boundary(id) for id in ids])``.
    ``hf_index_n_post_norm``: the pipeline indexes HF ``output_hidden_states`` directly, whose
    index N is the post-norm state in transformers 5.x, so boundary N becomes ``final_norm``
    (default: only for the ``hf`` convention).
    """
    n = int(num_layers)
    ids_t = tuple(int(i) for i in ids) if ids is not None else None
    if prepend_embed and convention != "speculators-legacy":
        raise ValueError("prepend_embed models the speculators legacy extractor; use it with --convention speculators-legacy")
    verifier = None
    if boundaries is not None:
        labels = [_label(b) for b in boundaries]
        if not labels:
            raise ValueError("explicit boundaries: give at least one")
        for lab in labels:
            b = parse_label(lab)
            if b is not None and b > n:
                raise ValueError(f"boundary {b} is outside 0..{n}")
        raw = tuple(parse_label(lab) for lab in labels) if FINAL_NORM not in labels else None
        captured = fed = intended = labels
        return DraftPlan("boundary", raw, tuple(captured), tuple(fed), None, tuple(intended),
                         "cat(states at the given boundaries)")
    if convention == "eagle":
        bs = conventions.default_eagle_boundaries(n)
        captured = fed = intended = conventions.labels(bs)
        pipeline = "cat([input of layer i for i in (2, N//2, N-3)])"
    elif convention == "speculators-legacy":
        if ids_t is None:
            ids_t = (2, n // 2, n - 3)
        intended = conventions.labels(conventions.resolve("speculators-legacy", ids_t, n))
        if prepend_embed:
            captured = ["embed"] + intended
            pipeline = "list = [hs[0]] + [hs[id + 1] for id in ids]; draft = cat(list[:-1]); verifier = list[-1]"
        else:
            captured = intended + [boundary_label(n)]
            pipeline = "list = [hs[id + 1] for id in ids] + [last state]; draft = cat(list[:-1]); verifier = list[-1]"
        fed, verifier = captured[:-1], captured[-1]
    else:
        if convention not in conventions.CONVENTIONS and convention != "specforge":
            known = ", ".join(sorted(set(DRAFT_CONVENTIONS) | set(conventions.CONVENTIONS)))
            raise ValueError(f"unknown convention {convention!r}; known: {known}")
        bs = conventions.resolve(convention, ids_t, n)
        captured = fed = intended = conventions.labels(bs)
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


# ----------------------------------------------------------------------------------------------
# Model structure
# ----------------------------------------------------------------------------------------------

_LAYER_PATHS = ("model.layers", "model.decoder.layers", "transformer.h", "gpt_neox.layers",
                "model.language_model.layers", "layers", "transformer.layers", "decoder.layers")
_NORM_NAMES = ("norm", "final_layernorm", "ln_f", "final_norm", "norm_f")


def _get(obj, path: str):
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def find_decoder(model: torch.nn.Module) -> tuple[torch.nn.ModuleList, torch.nn.Module, str]:
    """(decoder layers, final norm, dotted path of the layers) of a causal LM."""
    for path in _LAYER_PATHS:
        layers = _get(model, path)
        if isinstance(layers, torch.nn.ModuleList) and len(layers):
            parent = _get(model, path.rsplit(".", 1)[0]) if "." in path else model
            for nn_name in _NORM_NAMES:
                norm = getattr(parent, nn_name, None)
                if isinstance(norm, torch.nn.Module):
                    return layers, norm, path
            raise ValueError(f"found decoder layers at {path} but no final norm beside them")
    raise ValueError(f"cannot find the decoder layers of {type(model).__name__} (looked at {', '.join(_LAYER_PATHS)})")


def model_info(model: torch.nn.Module) -> dict:
    """The trace ``model`` attributes of an HF model: num_layers, hidden_size, dtype, architecture."""
    cfg = getattr(model, "config", None)
    cfg = getattr(cfg, "get_text_config", lambda: cfg)() if cfg is not None else None
    layers, _, _ = find_decoder(model)
    n = int(getattr(cfg, "num_hidden_layers", len(layers)) or len(layers))
    h = getattr(cfg, "hidden_size", None)
    if h is None:
        h = next(p for p in model.parameters()).shape[-1]
    archs = getattr(getattr(model, "config", None), "architectures", None) or [type(model).__name__]
    dtype = next(model.parameters()).dtype
    return {"num_layers": n, "hidden_size": int(h), "dtype": logical_dtype(dtype), "architecture": archs[0],
            "model_type": getattr(cfg, "model_type", None), "vocab_size": getattr(cfg, "vocab_size", None)}


def draft_rows(rows: np.ndarray) -> np.ndarray:
    """Token rows of the draft input: row t exists where token t+1 of the same sequence exists
    (``rows`` [B, L] with -1 at padding; positions contiguous along L)."""
    rows = np.asarray(rows, dtype=np.int64)
    if rows.ndim == 1:
        rows = rows[None]
    out = np.full(rows.shape, -1, dtype=np.int64)
    ok = (rows[:, :-1] >= 0) & (rows[:, 1:] >= 0)
    out[:, :-1] = np.where(ok, rows[:, :-1], -1)
    return out


# ----------------------------------------------------------------------------------------------
# Recorder
# ----------------------------------------------------------------------------------------------


class HFExtractorRecorder:
    """Record what an HF causal LM's extractor computes and what the draft is fed.

    ``plan``: a :class:`DraftPlan` (None: record the catalog only). ``values``: which catalog
    states keep full values: ``"slots"`` (default: every state the plan captures, plus
    ``final_norm``), ``"all"``, ``"none"`` or a list of labels. Sketches and RMS are kept for all.
    The draft input always keeps full values (unless the recorder's own ``values`` policy says
    otherwise).

    Use :meth:`run` to let it call the model, or :meth:`capture` around your own call::

        with hfrec.capture("sample-0", input_ids):
            out = model(input_ids[None])
    """

    def __init__(self, model: torch.nn.Module, recorder: Recorder, plan: DraftPlan | None = None, *,
                 values: str | Iterable[str] = "slots", catalog: bool = True, draft_name: str = "draft_input"):
        self.model = model
        self.recorder = recorder
        self.plan = plan
        self.layers, self.norm, self.layers_path = find_decoder(model)
        info = model_info(model)
        self.num_layers = info["num_layers"]
        self.hidden_size = info["hidden_size"]
        if len(self.layers) < self.num_layers:
            raise ValueError(f"config says {self.num_layers} layers but the model has {len(self.layers)}")
        self.catalog = catalog
        self.draft_name = draft_name
        self.labels = [boundary_label(b) for b in range(self.num_layers + 1)] + [FINAL_NORM]
        if plan is not None:
            for lab in plan.captured:
                b = parse_label(lab)
                if b is not None and b > self.num_layers:
                    raise ValueError(f"the draft plan needs {lab}, but the model has {self.num_layers} layers")
        if isinstance(values, str):
            if values == "all":
                self.value_labels = set(self.labels)
            elif values == "none":
                self.value_labels = set()
            elif values == "slots":
                self.value_labels = set(plan.captured if plan else ()) | {FINAL_NORM}
            else:
                self.value_labels = {_label(v) for v in values.split(",") if v.strip()}
        else:
            self.value_labels = {_label(v) for v in values}
        self._need = set(plan.fed) if plan is not None else set()
        self._rows: np.ndarray | None = None
        self._held: dict[str, torch.Tensor] = {}
        self._handles: list = []

    # -- hooks -----------------------------------------------------------------------------

    def attach(self) -> "HFExtractorRecorder":
        if self._handles:
            return self
        for b in range(self.num_layers):
            self._handles.append(self.layers[b].register_forward_pre_hook(self._layer_hook(b), with_kwargs=True))
        self._handles.append(self.norm.register_forward_pre_hook(self._layer_hook(self.num_layers), with_kwargs=True))
        self._handles.append(self.norm.register_forward_hook(self._norm_out_hook))
        return self

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _layer_hook(self, b: int):
        label = boundary_label(b)

        def hook(mod, args, kwargs):
            x = args[0] if args and isinstance(args[0], torch.Tensor) else kwargs.get("hidden_states")
            if x is None:
                raise RuntimeError(f"tensordiff: cannot find the hidden states entering {label}")
            self._on_state(label, b, x)
            return None
        return hook

    def _norm_out_hook(self, mod, args, output):
        x = output[0] if isinstance(output, (tuple, list)) else output
        self._on_state(FINAL_NORM, None, x)
        return None

    def _on_state(self, label: str, b: int | None, x: torch.Tensor) -> None:
        if self._rows is None:
            return
        if label in self._held and label in self._need:
            raise RuntimeError(f"tensordiff: {label} was computed twice in one forward; "
                               "record one forward per capture()")
        if self.catalog:
            vals = label in self.value_labels
            if b is None:
                self.recorder.final_norm(x, self._rows, values=vals)
            else:
                self.recorder.boundary(b, x, self._rows, values=vals)
        if label in self._need:
            self._held[label] = x

    # -- capture ---------------------------------------------------------------------------

    @contextlib.contextmanager
    def capture(self, seq: str | Sequence[str], input_ids, attention_mask=None, *, positions=None,
                regime: str = "train", step: int = 0) -> Iterator[np.ndarray]:
        """Record the model forward(s) run inside this block for these tokens. ``seq``/``input_ids``:
        one key and [L] ids, or B keys and [B, L] ids (``attention_mask`` marks real tokens).
        Yields the token rows. The draft input is built and recorded when the block ends."""
        if isinstance(seq, str):
            ids = input_ids.detach().reshape(-1).cpu() if isinstance(input_ids, torch.Tensor) else np.asarray(input_ids).reshape(-1)
            rows = self.recorder.add_tokens(seq, positions, ids, regime=regime, step=step)[None]
        else:
            if positions is not None:
                raise ValueError("positions are derived from attention_mask for a batch")
            rows = batch_rows(self.recorder, list(seq), input_ids, attention_mask, regime=regime, step=step)
        attached_here = not self._handles
        self.attach()
        self._rows = rows
        self._held = {}
        try:
            yield rows
            if self.plan is not None:
                self._record_draft(rows)
        finally:
            self._rows = None
            self._held = {}
            if attached_here:
                self.detach()

    def _record_draft(self, rows: np.ndarray) -> None:
        plan = self.plan
        missing = [lab for lab in plan.fed if lab not in self._held]
        if missing:
            raise RuntimeError(f"tensordiff: the forward did not compute {', '.join(missing)}")
        parts = [self._held[lab] for lab in plan.fed]
        drows = draft_rows(rows)
        self.recorder.packed(self.draft_name, parts, drows, labels=list(plan.fed),
                             raw_ids=list(plan.raw_ids) if plan.raw_ids is not None else None,
                             convention=plan.convention, token_offset=1, role="draft_input",
                             attrs={"draft_plan": plan.as_attrs()})

    def run(self, seq: str, input_ids, *, regime: str = "train", step: int = 0) -> Any:
        """Run the model on one sequence ([L] token ids) and record it. Returns the model output."""
        ids = torch.as_tensor(np.asarray(input_ids.cpu() if isinstance(input_ids, torch.Tensor) else input_ids),
                              dtype=torch.long).reshape(1, -1)
        if ids.shape[1] == 0:
            raise ValueError(f"{seq}: empty token sequence")
        device = next(self.model.parameters()).device
        with self.capture(seq, ids[0], regime=regime, step=step):
            with torch.inference_mode():
                return self.model(input_ids=ids.to(device), use_cache=False)
