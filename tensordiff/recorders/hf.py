"""The train-side extractor recorder for HF transformers causal LMs.

For each token sequence it records, through a :class:`~.core.Recorder`:

* the catalog: every boundary ``embed``, ``layer1`` .. ``layerN`` (role ``catalog``; sketch + RMS
  for all, full values for the ones asked) and ``final_norm`` (the lm_head input);
* ``target_topk``: the target's top-k token ids, log-probabilities and logsumexp at every token
  (from the lm_head output; ``topk=0`` turns it off);
* with a ``draft`` (:class:`~.eagle3.Eagle3Draft`): ``draft_fc_output`` (what the draft's fc
  computes from the draft input) and ``draft_topk`` (its predictions), teacher-forced on the
  draft input as training runs it (names and layouts: :mod:`tensordiff.conventions`);
* with ``zoom=b``: the sub-layer taps of decoder layer b (``layer<b>.q`` ...,
  :mod:`~.zoom`);
* ``draft_input`` (role ``draft_input``): the packed ``[T, K*H]`` tensor the draft is fed, built
  as a named pipeline builds it (a :class:`~tensordiff.conventions.DraftPlan` from
  :func:`tensordiff.conventions.plan_draft_input`), with the slot labels of what it
  actually holds and the raw ids + convention beside, ``token_offset=1`` (draft row t holds the
  states at position t and is paired with token t+1; the last position has no row).

Boundaries are taken by forward hooks, not from ``output_hidden_states``: boundary b < N is the
input of decoder layer b (the same tensor HF returns as ``hidden_states[b]``), boundary N is the
input of the final norm (PRE-norm), and ``final_norm`` is that norm's output. transformers 5.x
returns the post-norm state as ``hidden_states[N]``; here it is ``final_norm``, never ``layerN``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

from .. import conventions, model_config
from ..vocab import FINAL_NORM, boundary_label, parse_label
from .core import Recorder, logical_dtype
from .hooks import batch_rows
from .structure import find_decoder

__all__ = [
    "DRAFT_CONVENTIONS",
    "DraftPlan",
    "HFExtractorRecorder",
    "draft_rows",
    "find_decoder",
    "model_info",
    "plan_draft_input",
]

# Planning lives in tensordiff.conventions; these names stay importable from here.
DraftPlan = conventions.DraftPlan
DRAFT_CONVENTIONS = conventions.DRAFT_CONVENTIONS
plan_draft_input = conventions.plan_draft_input
_label = conventions.as_label


# ----------------------------------------------------------------------------------------------
# Model structure
# ----------------------------------------------------------------------------------------------


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
    out = {"num_layers": n, "hidden_size": int(h), "dtype": logical_dtype(dtype), "architecture": archs[0],
           "model_type": getattr(cfg, "model_type", None), "vocab_size": getattr(cfg, "vocab_size", None)}
    config = model_config.from_config(getattr(model, "config", None), logical_dtype(dtype))
    config.update(rotary_freqs(model))
    if config:
        out["config"] = config
    # the directory it was loaded from, for the commands a diff prints (tensordiff weights DIR_A DIR_B)
    src = getattr(getattr(model, "config", None), "_name_or_path", None)
    if isinstance(src, str) and src and os.path.isdir(src):
        out["path"] = os.path.abspath(src)
    return out


def rotary_freqs(model: torch.nn.Module) -> dict:
    """``rope_freqs`` and ``rope_freqs_dtype`` of the module actually built (its first submodule
    with an ``inv_freq`` buffer: the frequencies it turns q and k by, whatever its config says),
    validated as the diff reads them; ``{}`` when it has none."""
    for mod in model.modules():
        inv = getattr(mod, "inv_freq", None)
        if isinstance(inv, torch.Tensor) and inv.dim() == 1 and inv.is_floating_point():
            out = {"rope_freqs": model_config.read({"config": {"rope_freqs": inv.detach().double().cpu().tolist()}})
                   .get("rope_freqs"), "rope_freqs_dtype": logical_dtype(inv.dtype)}
            return out if out["rope_freqs"] is not None else {}
    return {}


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
                 values: str | Iterable[str] = "slots", catalog: bool = True, draft_name: str = "draft_input",
                 topk: int = conventions.DEFAULT_TOPK, draft: Any = None, zoom: int | None = None,
                 name_rules: Sequence[str] = (), routing: bool = True):
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
        self.topk = int(topk)
        self.routing = bool(routing)  # MoE routers' top-k choices (models with an MoE router only)
        self.draft = draft
        if draft is not None and plan is None:
            raise ValueError("a draft needs the draft-input plan (what it is fed)")
        if draft is not None and draft.num_aux != len(plan.fed):
            raise ValueError(f"the draft's fc takes {draft.num_aux} states but the plan feeds {len(plan.fed)}")
        self.zoom = None
        if zoom is not None:
            from .zoom import ZoomRecorder
            self.zoom = ZoomRecorder(model, recorder, int(zoom), self.layers_path, self.num_layers, rules=name_rules)
        self._ids: torch.Tensor | None = None
        self._rows: np.ndarray | None = None
        self._held: dict[str, torch.Tensor] = {}
        self._handles: list = []

    # -- hooks -----------------------------------------------------------------------------

    def attach(self) -> HFExtractorRecorder:
        if self._handles:
            return self
        for b in range(self.num_layers):
            self._handles.append(self.layers[b].register_forward_pre_hook(self._layer_hook(b), with_kwargs=True))
        self._handles.append(self.norm.register_forward_pre_hook(self._layer_hook(self.num_layers), with_kwargs=True))
        self._handles.append(self.norm.register_forward_hook(self._norm_out_hook))
        if self.zoom is not None:
            self.zoom.attach()
        if self.routing:
            from .routing import hf_router_modules

            for i, gate in hf_router_modules(self.layers[:self.num_layers]).items():
                self._handles.append(gate.register_forward_hook(self._routing_hook(i, gate)))
        head = self.model.get_output_embeddings() if hasattr(self.model, "get_output_embeddings") else None
        if self.topk > 0 and isinstance(head, torch.nn.Module):
            self._handles.append(head.register_forward_hook(self._logits_hook))
        return self

    def detach(self) -> None:
        if self.zoom is not None:
            self.zoom.detach()
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
        return hook

    def _routing_hook(self, layer: int, gate: torch.nn.Module):
        """The MoE router of decoder layer ``layer``: its top-k expert ids and weights per token
        (``moe_routing_layer<i>``, :mod:`.routing`)."""
        from .routing import ids_and_weights, name_of, routing_attrs, routing_table

        def hook(mod, args, output):
            got = ids_and_weights(output) if self._rows is not None else None
            if got is None or got[0].shape[0] != self._rows.size:
                return
            table = routing_table(*got)
            k = table.shape[-1] // 2
            self.recorder.plain(name_of(layer), table, self._rows.reshape(-1), role=conventions.MOE_ROUTING,
                                order=layer + 0.5, attrs=routing_attrs(layer, k, getattr(gate, "num_experts", None),
                                                                      f"{type(gate).__name__} output (HF)"))
        return hook

    def _logits_hook(self, mod, args, output):
        if self._rows is None or not isinstance(output, torch.Tensor):
            return
        if output.shape[:-1] != self._rows.shape:
            import warnings
            warnings.warn(f"tensordiff: lm_head returned {tuple(output.shape)} for token rows {self._rows.shape}; "
                          "target_topk not recorded (compute the logits of every position, or topk=0)", stacklevel=2)
            return
        n = self.num_layers
        self.recorder.predictions(conventions.TARGET_TOPK, output, self._rows, k=self.topk, token_offset=0,
                                  order=n + 0.6, attrs={"source": "target lm_head output"})

    def _norm_out_hook(self, mod, args, output):
        x = output[0] if isinstance(output, (tuple, list)) else output
        self._on_state(FINAL_NORM, None, x)

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
            ids = (input_ids.detach().reshape(-1).cpu() if isinstance(input_ids, torch.Tensor)
                   else np.asarray(input_ids).reshape(-1))
            rows = self.recorder.add_tokens(seq, positions, ids, regime=regime, step=step)[None]
        else:
            if positions is not None:
                raise ValueError("positions are derived from attention_mask for a batch")
            rows = batch_rows(self.recorder, list(seq), input_ids, attention_mask, regime=regime, step=step)
        attached_here = not self._handles
        self.attach()
        self._rows = rows
        if self.zoom is not None:
            self.zoom.set_rows(rows)
        if isinstance(input_ids, torch.Tensor):
            self._ids = input_ids.detach().reshape(rows.shape).cpu()
        else:
            self._ids = torch.as_tensor(np.asarray(input_ids), dtype=torch.long).reshape(rows.shape)
        self._held = {}
        try:
            yield rows
            if self.plan is not None:
                self._record_draft(rows)
        finally:
            self._rows = None
            if self.zoom is not None:
                self.zoom.set_rows(None)
            self._ids = None
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
        if self.draft is not None:
            self._run_draft(torch.cat(parts, dim=-1), drows)

    def _run_draft(self, packed: torch.Tensor, drows: np.ndarray) -> None:
        """The draft teacher-forced on each sequence: row t = (draft input at t, token t+1)."""
        embed = self.model.get_input_embeddings()
        head = self.model.get_output_embeddings()
        n = self.num_layers
        packed = packed.reshape(*drows.shape, packed.shape[-1])
        for b in range(drows.shape[0]):
            cols = np.flatnonzero(drows[b] >= 0)
            if not len(cols):
                continue
            dev = packed.device
            idx = torch.from_numpy(cols).to(dev)
            nxt = self._ids[b, cols + 1].to(dev)
            pos = torch.from_numpy(self.recorder.positions_of(drows[b, cols])).to(dev)
            with torch.inference_mode():
                out = self.draft.forward(packed[b].index_select(0, idx), embed(nxt), pos,
                                         target_lm_head=getattr(head, "weight", None))
            r = drows[b, cols]
            self.recorder.record(conventions.DRAFT_FC, out.fc_output, r, kind="other", role=conventions.DRAFT_FC,
                                 token_offset=1, order=n + 0.8,
                                 attrs={"source": "draft fc output (tensordiff.recorders.eagle3)",
                                        "draft": getattr(self.draft, "path", "")})
            if self.topk > 0:
                self.recorder.predictions(conventions.DRAFT_TOPK, out.logits, r, k=self.topk, token_offset=1,
                                          id_map=out.id_map, order=n + 0.9,
                                          attrs={"source": "draft lm_head output, teacher-forced"})

    def run(self, seq: str, input_ids, *, regime: str = "train", step: int = 0) -> Any:
        """Run the model on one sequence ([L] token ids) and record it. Returns the model output."""
        ids = torch.as_tensor(np.asarray(input_ids.cpu() if isinstance(input_ids, torch.Tensor) else input_ids),
                              dtype=torch.long).reshape(1, -1)
        if ids.shape[1] == 0:
            raise ValueError(f"{seq}: empty token sequence")
        device = next(self.model.parameters()).device
        with self.capture(seq, ids[0], regime=regime, step=step), torch.inference_mode():
            return self.model(input_ids=ids.to(device), use_cache=False)
