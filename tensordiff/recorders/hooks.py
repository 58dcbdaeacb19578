"""Record the inputs or outputs of any ``torch.nn.Module``'s submodules, chosen by glob patterns on
their qualified names (``model.layers.*``, ``*.mlp``), through a :class:`~.core.Recorder`.

>>> with Recorder("run.h5", side="other", model={"hidden_size": 64}) as rec, \\
...         ModuleHookRecorder(model, rec, ["model.layers.*"], capture="output") as hooks:
...     hooks.tokens("sample-0", input_ids)          # token rows for the next forward
...     model(input_ids[None])

Each matched module records one tensor per direction. When the recorder knows the model (an HF
transformers, SGLang or vLLM model of a family in :data:`tensordiff.names.KNOWN_MODEL_TYPES`, or
user ``rules``), values the table of :mod:`tensordiff.names` maps get their canonical name
(``embed``, ``layer4``, ``final_norm`` as boundaries; ``layer3.q`` ... as sub-layer taps with their
forward order) and the module path as the ``module_path`` attribute, so the trace compares with
every other recorder's; fused values (``qkv_proj``, ``gate_up_proj``, a rotary ``(q, k)``) are
split. Everything else is named ``<qualified name>.input`` or ``<qualified name>.output`` (or
whatever ``name_fn`` returns, which turns canonical names off). From a tuple/list the first tensor
is taken, from a dict or ``ModelOutput`` ``last_hidden_state`` or the first tensor; for inputs
the first positional tensor, else the ``hidden_states`` keyword, else the first tensor keyword.
A tensor whose leading dims do not hold one row per current token row is skipped, once noted in
:attr:`ModuleHookRecorder.skipped` (and a warning), never an error inside the user's forward.
"""

from __future__ import annotations

import fnmatch
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from .. import names as canon
from ..conventions import AUTOCAST_ATTR
from .core import Recorder, autocast_attr, autocast_dtype

__all__ = ["ModuleHookRecorder", "batch_rows", "first_tensor"]


def first_tensor(obj: Any, prefer: str = "last_hidden_state") -> torch.Tensor | None:
    """The tensor a hook records from a module's input or output value."""
    if isinstance(obj, torch.Tensor):
        return obj
    if isinstance(obj, dict):  # includes transformers ModelOutput
        if isinstance(obj.get(prefer), torch.Tensor):
            return obj[prefer]
        for v in obj.values():
            t = first_tensor(v, prefer)
            if t is not None:
                return t
        return None
    if isinstance(obj, (tuple, list)):
        for v in obj:
            if isinstance(v, torch.Tensor):
                return v
        return None
    return None


def batch_rows(recorder: Recorder, seq_keys: Sequence[str], input_ids: torch.Tensor | np.ndarray,
               attention_mask: torch.Tensor | np.ndarray | None = None, *, regime: str = "train",
               step: int = 0) -> np.ndarray:
    """Add the tokens of a padded batch ``input_ids`` [B, L] (``attention_mask`` 1 = real token,
    left or right padding) and return token rows [B, L], -1 at padding. A sequence's positions
    count its real tokens from 0."""
    ids = input_ids.detach().cpu().numpy() if isinstance(input_ids, torch.Tensor) else np.asarray(input_ids)
    if ids.ndim == 1:
        ids = ids[None]
    if ids.ndim != 2:
        raise ValueError(f"input_ids must be [B, L], got shape {tuple(ids.shape)}")
    if attention_mask is None:
        mask = np.ones(ids.shape, dtype=bool)
    else:
        m = attention_mask.detach().cpu().numpy() if isinstance(attention_mask, torch.Tensor) else np.asarray(attention_mask)
        mask = m.reshape(ids.shape).astype(bool)
    if len(seq_keys) != ids.shape[0]:
        raise ValueError(f"{len(seq_keys)} sequence keys for a batch of {ids.shape[0]}")
    out = np.full(ids.shape, -1, dtype=np.int64)
    for b, key in enumerate(seq_keys):
        cols = np.flatnonzero(mask[b])
        if len(cols):
            out[b, cols] = recorder.add_tokens(str(key), np.arange(len(cols)), ids[b, cols], regime=regime, step=step)
    return out


class ModuleHookRecorder:
    """Forward hooks on the submodules of ``module`` whose qualified names match ``patterns``.

    capture: ``"output"``, ``"input"`` or ``"both"``. ``exclude``: globs of names never hooked.
    ``name_fn(qualified_name, direction) -> str`` names the recorded tensor. ``define_kwargs(name)``
    may return extra :meth:`Recorder.record` keywords (kind/boundary/role/values) per tensor.
    Token rows: call :meth:`tokens` (one sequence) or :meth:`batch` (padded batch), or
    :meth:`set_rows` with rows you added yourself; a forward with no rows set records nothing.

    ``canonical``: True (default) names what the table maps when the model is known; an
    implementation name (``hf``, ``sglang``, ``vllm``) forces that table; False keeps module
    paths. ``rules``: user rules (``REGEX=NAME`` strings or :class:`tensordiff.names.Rule`), tried
    first, for models the table does not know. :attr:`implementation` says which table was used.
    ``only_mapped``: hook only the values that get a canonical name (a zoom's bounded set).
    """

    def __init__(self, module: torch.nn.Module, recorder: Recorder, patterns: Sequence[str] = ("*",), *,
                 capture: str = "output", exclude: Sequence[str] = (),
                 name_fn: Callable[[str, str], str] | None = None,
                 define_kwargs: Callable[[str], dict] | None = None, attach: bool = True,
                 canonical: bool | str = True, rules: Sequence[str | canon.Rule] = (), only_mapped: bool = False):
        if capture not in ("output", "input", "both"):
            raise ValueError("capture must be 'output', 'input' or 'both'")
        if isinstance(patterns, str):
            patterns = [patterns]
        self.module = module
        self.recorder = recorder
        self.patterns = list(patterns)
        self.exclude = list(exclude)
        self.capture = capture
        self.name_fn = name_fn or (lambda qual, direction: f"{qual or 'root'}.{direction}")
        self.define_kwargs = define_kwargs or (lambda name: {})
        self.only_mapped = only_mapped
        self.rules = [r if isinstance(r, canon.Rule) else canon.parse_user_rule(r) for r in rules]
        self.config = _model_config(module)
        self.num_layers: int | None = self.config.get("num_hidden_layers")
        self.implementation: str | None = None
        if name_fn is None and canonical:
            self.implementation = (canonical if isinstance(canonical, str) else _known_implementation(module, self.config))
            if self.implementation is not None and self.implementation not in canon.RULES:
                raise ValueError(f"canonical: unknown implementation {self.implementation!r}")
        self._canon_on = name_fn is None and bool(canonical) and (self.implementation is not None or bool(self.rules))
        self.rows: np.ndarray | None = None
        self.skipped: dict[str, str] = {}
        self._handles: list = []
        self.matched: list[str] = [q for q, _ in module.named_modules() if self._selected(q)]
        if not self.matched:
            raise ValueError(f"no submodule matches {self.patterns}")
        if attach:
            self.attach()

    def _selected(self, qual: str) -> bool:
        return (any(fnmatch.fnmatchcase(qual, p) for p in self.patterns)
                and not any(fnmatch.fnmatchcase(qual, p) for p in self.exclude))

    # -- token rows ------------------------------------------------------------------------

    def set_rows(self, rows: np.ndarray | Sequence[int] | None) -> None:
        self.rows = None if rows is None else np.asarray(rows, dtype=np.int64)

    def tokens(self, seq: str, input_ids, positions=None, *, regime: str = "train", step: int = 0) -> np.ndarray:
        """Add one sequence's tokens and make them the rows of the next forward."""
        rows = self.recorder.add_tokens(seq, positions, input_ids, regime=regime, step=step)
        self.set_rows(rows)
        return rows

    def batch(self, seq_keys: Sequence[str], input_ids, attention_mask=None, *, regime: str = "train",
              step: int = 0) -> np.ndarray:
        """Add a padded batch's tokens ([B, L]) and make them the rows of the next forward."""
        rows = batch_rows(self.recorder, seq_keys, input_ids, attention_mask, regime=regime, step=step)
        self.set_rows(rows)
        return rows

    # -- hooks -----------------------------------------------------------------------------

    def mapping(self, qual: str, direction: str) -> canon.Mapped | None:
        """The canonical names this module's value records under (None: its module path)."""
        if not self._canon_on:
            return None
        from .peft_names import canonical_module

        q = canonical_module(qual)   # through PEFT's adapter wrappers; None: the adapter's own parts
        return None if q is None else canon.canonical(q, direction, self.implementation, self.num_layers, self.rules)

    def attach(self) -> ModuleHookRecorder:
        if self._handles:
            return self
        matched = set(self.matched)
        claimed: set[str] = set()
        for qual, mod in self.module.named_modules():
            if qual not in matched:
                continue
            for direction in ("output", "input"):
                if self.capture not in (direction, "both"):
                    continue
                m = self.mapping(qual, direction)
                if m is not None and claimed & set(m.names):
                    continue  # the same state again (layer b's output is layer b+1's input): recorded once
                if m is not None:
                    claimed |= set(m.names)
                elif self.only_mapped:
                    continue
                if direction == "input":
                    self._handles.append(mod.register_forward_pre_hook(self._pre_hook(qual, m), with_kwargs=True))
                else:
                    self._handles.append(mod.register_forward_hook(self._post_hook(qual, m)))
        return self

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _pre_hook(self, qual: str, mapped: canon.Mapped | None = None):
        name = self.name_fn(qual, "input")

        def hook(mod, args, kwargs):
            if mapped is not None and mapped.split is not None:
                self._record_mapped(mapped, (*args, *kwargs.values()))
                return
            t = first_tensor(args)
            if t is None:
                t = kwargs.get("hidden_states") if isinstance(kwargs.get("hidden_states"), torch.Tensor) else None
            if t is None:
                t = first_tensor(kwargs)
            if mapped is not None:
                self._record_mapped(mapped, t)
            else:
                self._record(name, t)
        return hook

    def _post_hook(self, qual: str, mapped: canon.Mapped | None = None):
        name = self.name_fn(qual, "output")

        def hook(mod, args, output):
            if mapped is not None:
                self._record_mapped(mapped, output if mapped.split in ("sum", "tuple") else first_tensor(output))
            else:
                self._record(name, first_tensor(output))
        return hook

    def _record_mapped(self, m: canon.Mapped, value: Any) -> None:
        if self.rows is None:
            return
        key = f"{m.path}.{m.direction}"
        if key in self.skipped:
            return
        parts: list[torch.Tensor | None]
        if m.split in ("sum", "tuple"):
            ts = [v for v in value if isinstance(v, torch.Tensor)] if isinstance(value, (tuple, list)) else [value]
            if m.split == "sum":
                parts = [ts[0] + ts[1] if len(ts) >= 2 and ts[1].shape == ts[0].shape else (ts[0] if ts else None)]
            else:
                parts = list(ts[: len(m.names)])
                if len(parts) != len(m.names):
                    self._skip(key, f"holds {len(parts)} tensors, not {len(m.names)} ({', '.join(m.names)})")
                    return
        elif m.split is not None:
            t = value if isinstance(value, torch.Tensor) else None
            if t is None:
                self._skip(key, "no tensor in the value")
                return
            try:
                widths = canon.split_widths(m.split, int(t.shape[-1]), self.config)
            except ValueError as e:
                self._skip(key, str(e))
                return
            parts = list(torch.split(t, widths, dim=-1))
        else:
            parts = [value]
        for name, t in zip(m.names, parts):
            st = canon.parse_state(name)
            attrs = {"module_path": key}
            kw: dict[str, Any]
            if st.kind == "boundary":
                kw = {"kind": "boundary", "boundary": st.layer, "role": "catalog"}
            elif st.kind == "final_norm":
                kw = {"kind": "final_norm", "role": "catalog"}
            else:
                kw = {"kind": "other", "order": st.order(self.num_layers), "role": "tap"}
                attrs.update(layer=st.layer, tap=st.tap)
            kw.update(self.define_kwargs(name))
            kw["attrs"] = {**attrs, **(kw.get("attrs") or {})}
            self._record(name, t, **kw)

    def _record(self, name: str, t: torch.Tensor | None, **kw: Any) -> None:
        if self.rows is None or name in self.skipped:
            return
        if t is None:
            self._skip(name, "no tensor in the value")
            return
        if not t.is_floating_point():
            self._skip(name, f"dtype {t.dtype} is not floating point")
            return
        n = self.rows.size
        lead = t.numel() // t.shape[-1] if t.ndim else 0
        if t.ndim < 2 or lead != n:
            self._skip(name, f"shape {tuple(t.shape)} does not hold one row per token ({n} rows)")
            return
        self.recorder.record(name, t, self.rows, **(kw or self.define_kwargs(name)))

    def _skip(self, name: str, why: str) -> None:
        self.skipped[name] = why
        warnings.warn(f"tensordiff: not recording {name}: {why}", stacklevel=3)

    def __enter__(self) -> ModuleHookRecorder:  # noqa: PYI034 (Self needs Python 3.11)
        return self.attach()

    def __exit__(self, *exc) -> None:
        self.detach()


def _model_config(module: torch.nn.Module) -> dict:
    """The (text) config of an HF, SGLang or vLLM model as a dict ({} when it has none)."""
    cfg = getattr(module, "config", None)
    if cfg is None:
        inner = getattr(module, "model", None)
        cfg = getattr(inner, "config", None)
    if cfg is None:
        return {}
    cfg = getattr(cfg, "get_text_config", lambda: cfg)()
    out = {}
    for k in ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "model_type", "hidden_size"):
        v = getattr(cfg, k, None)
        if v is not None:
            out[k] = v
    return out


def _known_implementation(module: torch.nn.Module, config: dict) -> str | None:
    """``hf``/``sglang``/``vllm`` when the model's class comes from there and its family is in the
    table (:data:`tensordiff.names.KNOWN_MODEL_TYPES`); None otherwise."""
    from .peft_names import unwrap

    impl = canon.implementation_of(type(unwrap(module)).__module__)   # a PEFT model: the one it wraps
    if impl is None or config.get("model_type") not in canon.KNOWN_MODEL_TYPES:
        return None
    return impl


# ----------------------------------------------------------------------------------------------
# RL: the trainer's log-prob of each sampled token, and the weights it ran
# ----------------------------------------------------------------------------------------------


def trainer_logprobs(logits: torch.Tensor, next_ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """The log-prob of each next token as an RL trainer computes it: ``log_softmax(logits /
    temperature)`` in float32, gathered at ``next_ids`` (``logits`` [..., V], ``next_ids`` [...]).
    Temperature 0 (greedy sampling) is taken as 1: a greedy engine returns the model's own
    distribution, and so do the frameworks' trainers."""
    t = float(temperature) if temperature and temperature > 0 else 1.0
    lp = torch.log_softmax(logits.float() / t, dim=-1)
    return lp.gather(-1, next_ids.to(lp.device).long().unsqueeze(-1)).squeeze(-1)


def record_sampled_logprob(recorder: Recorder, logits: torch.Tensor, rows: np.ndarray | Sequence[int],
                           token_ids: torch.Tensor | np.ndarray | Sequence[int], *, temperature: float = 1.0,
                           first_generated: int | None = None) -> int:
    """Record ``sampled_logprob`` (:data:`tensordiff.conventions.SAMPLED_LOGPROB`) of one sequence's
    forward: ``logits`` [L, V] (or [1, L, V]) of its token rows ``rows`` [L] and its ``token_ids``
    [L]. Row t gets ``[token t+1, log-prob of it]`` (:func:`trainer_logprobs`); rows whose next token
    is a prompt token are left out when ``first_generated`` (the position of the first generated
    token) is given. Returns the rows recorded."""
    from .. import conventions

    rows = np.asarray(rows, dtype=np.int64).reshape(-1)
    ids = token_ids.detach().cpu() if isinstance(token_ids, torch.Tensor) else torch.as_tensor(np.asarray(token_ids))
    ids = ids.reshape(-1).long()
    x = logits.reshape(-1, logits.shape[-1])
    if x.shape[0] != len(rows) or len(ids) != len(rows):
        raise ValueError(f"sampled_logprob: {x.shape[0]} logit rows, {len(ids)} token ids, {len(rows)} token rows")
    if len(rows) < 2:
        return 0
    keep = rows[:-1] >= 0
    if first_generated is not None:
        keep &= recorder.positions_of(np.where(rows[:-1] >= 0, rows[:-1], 0)) >= int(first_generated) - 1
    if not keep.any():
        return 0
    nxt = ids[1:]
    lp = trainer_logprobs(x[:-1], nxt, temperature).double().cpu()
    table = torch.stack([nxt.double(), lp], dim=-1).numpy()
    attrs: dict[str, Any] = {"source": "trainer log_softmax(logits / temperature) at the sampled token",
                             "temperature": float(temperature)}
    ac = autocast_dtype(logits.device.type)
    if ac is not None:   # the head ran inside the forward's autocast region
        attrs[AUTOCAST_ATTR] = autocast_attr(logits.device.type, ac)
    return recorder.plain(conventions.SAMPLED_LOGPROB, table[keep], rows[:-1][keep], role=conventions.SAMPLED_LOGPROB,
                          order=float(recorder.model.get("num_layers") or 0) + 0.7, attrs=attrs)


#: the dtypes an engine commonly holds a trainer's float32 weights in: each float32 parameter's
#: fingerprint also carries the hash of its bytes cast to them, so a bf16 engine's copy is told
#: equal (a cast) or not (another value) exactly, however small an update was
CAST_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def weight_fingerprints(model: torch.nn.Module, source: str = "") -> dict[str, Any]:
    """:func:`tensordiff.recorders.weights_fp.model_fingerprints` with, per float32 parameter,
    ``cast_sha256``: ``{dtype: sha256 of its bytes cast to dtype}`` (:data:`CAST_DTYPES`)."""
    import hashlib

    from .peft_names import is_peft, lora_fingerprints
    from .weights_fp import model_fingerprints

    if is_peft(model):   # the merged weights, named as the served model names them
        doc, state = lora_fingerprints(model, source)
    else:
        doc, state = model_fingerprints(model, source), model.state_dict()
    with torch.no_grad():
        for e in doc["parameters"]:
            t = state.get(e.get("name"))
            if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or list(t.shape) != list(e.get("shape", [])):
                continue
            casts = {}
            for name, dt in CAST_DTYPES.items():
                c = t.detach().to(dt).cpu().contiguous()
                casts[name] = hashlib.sha256(memoryview(c.view(torch.int16).numpy()).cast("B")).hexdigest()
            e["cast_sha256"] = casts
    return doc


def record_weights(recorder: Recorder, model: torch.nn.Module, step: int = 0, *, forward_step: int = 0,
                   event: str = "start", rank: int | None = None, doc: dict[str, Any] | None = None) -> str:
    """Store ``model``'s weight fingerprints (:func:`weight_fingerprints`, or ``doc``) as
    ``/weights/step_<step>`` of the recorder's trace (:mod:`tensordiff.trace.rl`)."""
    from ..trace.rl import write_weight_step

    return write_weight_step(recorder.writer, step, doc if doc is not None else weight_fingerprints(model),
                             forward_step=forward_step, event=event, rank=rank)


class TrainerRecorder:
    """The one call for a user's own trainer forward: the model's boundaries (``embed``,
    ``layer<i>``, ``final_norm``, named by :class:`ModuleHookRecorder`'s table or ``rules``), the
    log-prob of each sampled token from the lm_head's output (:func:`record_sampled_logprob`,
    at ``temperature``), the weight fingerprints at construction (``/weights/step_0``) and the
    ``sampling`` attribute (the temperature divided by)::

        with Recorder("train.h5", side="train", model=info) as rec:
            tr = TrainerRecorder(model, rec, temperature=0.7)
            for key, ids, prompt_len in rollouts:
                with tr.sequence(key, ids, first_generated=prompt_len):
                    model(ids[None], position_ids=...)       # your forward, as your trainer runs it
            tr.detach()

    ``patterns`` / ``exclude``: which modules' outputs are the boundaries (default: an HF-style
    decoder: ``*embed_tokens``, ``*layers.<i>``, ``*.norm``). ``head``: the module whose output is
    the logits (default ``model.get_output_embeddings()``)."""

    def __init__(self, model: torch.nn.Module, recorder: Recorder, *, temperature: float = 1.0,
                 patterns: Sequence[str] = ("*embed_tokens", "*layers.*", "*.norm"),
                 exclude: Sequence[str] = ("*layers.*.*",), rules: Sequence[str | canon.Rule] = (),
                 head: torch.nn.Module | None = None, weights: bool = True, routing: bool = True):
        from ..trace.rl import sampling_params, write_sampling

        self.recorder = recorder
        self.temperature = float(temperature)
        self.hooks = ModuleHookRecorder(model, recorder, patterns, exclude=exclude, rules=rules, only_mapped=True)
        if head is None and hasattr(model, "get_output_embeddings"):
            head = model.get_output_embeddings()
        if not isinstance(head, torch.nn.Module):
            raise ValueError("no lm_head: pass head= (the module whose output is the logits)")
        self._head = head.register_forward_hook(self._on_logits)
        self._routing = None
        if routing:   # an HF MoE's routing as its experts are handed it (a routing replay shows)
            from .routing import ExpertRoutingTaps
            from .structure import find_decoder

            try:
                layers = find_decoder(model)[0]
            except (ValueError, AttributeError):
                layers = None
            if layers is not None:
                self._routing = ExpertRoutingTaps(layers, recorder, lambda: self.hooks.rows)
        self._ids: torch.Tensor | None = None
        self._first: int | None = None
        self._firsts: list[int] | None = None
        write_sampling(recorder.writer, sampling_params(temperature=self.temperature, engine="trainer"))
        if weights:
            record_weights(recorder, model, 0, event="train")

    def _on_logits(self, mod, args, output) -> None:
        rows = self.hooks.rows
        x = first_tensor(output, "logits")
        if rows is None or self._ids is None or x is None:
            return
        if self._ids.ndim == 2:     # a padded batch: each sequence's real tokens
            x = x.detach().reshape(*rows.shape, x.shape[-1])
            for b in range(rows.shape[0]):
                real = np.flatnonzero(rows[b] >= 0)
                if len(real):
                    at = torch.from_numpy(real)
                    record_sampled_logprob(self.recorder, x[b].index_select(0, at.to(x.device)), rows[b, real],
                                           self._ids[b, at], temperature=self.temperature,
                                           first_generated=self._firsts[b] if self._firsts else None)
            return
        record_sampled_logprob(self.recorder, x.detach(), rows.reshape(-1), self._ids, temperature=self.temperature,
                               first_generated=self._first)

    def sequence(self, seq: str, input_ids, *, first_generated: int | None = None, positions=None, step: int = 0):
        """A context for one sequence's forward: its token rows are added (``positions``: the
        recorded positions, default 0..L-1, whatever position ids the forward itself is given)."""
        import contextlib

        @contextlib.contextmanager
        def ctx():
            ids = input_ids.detach().reshape(-1).cpu() if isinstance(input_ids, torch.Tensor) else \
                torch.as_tensor(np.asarray(input_ids)).reshape(-1)
            self.hooks.tokens(seq, ids, positions, regime="train", step=step)
            self._ids, self._first = ids, first_generated
            try:
                yield self.hooks.rows
            finally:
                self.hooks.set_rows(None)
                self._ids = self._first = None
        return ctx()

    def batch(self, seq_keys: Sequence[str], input_ids, attention_mask=None, *,
              first_generated: Sequence[int] | None = None, step: int = 0):
        """A context for one padded micro-batch's forward: ``input_ids`` [B, L], ``attention_mask``
        [B, L] (1 = a real token; left or right padding), ``first_generated`` the position of each
        sequence's first generated token (counted over its real tokens). Padding is not recorded."""
        import contextlib

        @contextlib.contextmanager
        def ctx():
            ids = input_ids.detach().cpu() if isinstance(input_ids, torch.Tensor) else \
                torch.as_tensor(np.asarray(input_ids))
            rows = self.hooks.batch(seq_keys, ids, attention_mask, regime="train", step=step)
            self._ids = ids.reshape(rows.shape).long()
            self._firsts = [int(f) for f in first_generated] if first_generated is not None else None
            try:
                yield rows
            finally:
                self.hooks.set_rows(None)
                self._ids = self._firsts = None
        return ctx()

    def detach(self) -> None:
        self.hooks.detach()
        self._head.remove()
        if self._routing is not None:
            self._routing.remove()
