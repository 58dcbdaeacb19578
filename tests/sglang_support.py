"""Helpers for running the real SGLang engine on a CPU-only machine in tests.

Not a test module. It builds tiny random checkpoints locally (nothing is ever
downloaded), starts ``sglang.Engine`` on CPU in two modes, and computes the
HF transformers references the engine output is checked against:

* capture-only: the target model alone, returning EAGLE-3 aux hidden states
  (``enable_return_aux_hidden_states=True``);
* EAGLE-3: the target plus a random EAGLE-3 draft, through the ``intel_amx``
  attention backend.

SGLang on CPU needs the pure-torch ``sgl_kernel`` stand-in under
``tests/sgl_kernel_stub`` (test infrastructure only); :func:`prepare_cpu_env`
puts it on ``sys.path`` and on ``PYTHONPATH`` so the scheduler process that
the engine spawns finds it too. Call it (or any ``start_*`` function, which
calls it) before the first ``import sglang``.

Engine start-up takes tens of seconds: share one engine per test session and
always ``engine.shutdown()`` it (or use :func:`running_engine`).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
STUB_DIR = HERE / "sgl_kernel_stub"

SGLANG_VERSION = "0.5.23"

# Tiny target: small enough for two CPU cores, deep enough for 3 aux layers.
TINY_LLAMA = {
    "num_hidden_layers": 8,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "max_position_embeddings": 512,
}
# Draft ids as written in the EAGLE-3 checkpoint. Llama captures id + 1
# ("input of decoder layer id + 1" = HF hidden_states[id + 1]).
DEFAULT_AUX_LAYER_IDS = (2, 4, 6)

# Engine kwargs that work on CPU (see the project's notes on SGLang).
CPU_ENGINE_KWARGS: dict[str, Any] = {
    "device": "cpu",
    "attention_backend": "torch_native",
    "skip_tokenizer_init": True,
    "disable_cuda_graph": True,
    "dtype": "float32",
    "mem_fraction_static": 0.1,
    "max_total_tokens": 2048,
    "chunked_prefill_size": 256,
    "sampling_backend": "pytorch",
    "disable_overlap_schedule": True,
    "random_seed": 0,
    "log_level": "error",
}
EAGLE3_ENGINE_KWARGS: dict[str, Any] = {
    "attention_backend": "intel_amx",
    "speculative_algorithm": "EAGLE3",
    "speculative_num_steps": 2,
    "speculative_eagle_topk": 1,
    "speculative_num_draft_tokens": 3,
}


# --------------------------------------------------------------------------- env


def sglang_available() -> bool:
    """True when the real sglang and torch are importable (does not import them)."""
    return all(importlib.util.find_spec(m) is not None for m in ("sglang", "torch", "transformers"))


def prepare_cpu_env() -> None:
    """Environment for SGLang on CPU, in this process and every child it spawns.

    Sets ``SGLANG_USE_CPU_ENGINE=1`` and puts the ``sgl_kernel`` stand-in first
    on ``sys.path`` and ``PYTHONPATH``. Idempotent. Must run before sglang is
    imported (sglang reads the variable once, at import).
    """
    if os.environ.get("SGLANG_USE_CPU_ENGINE") != "1" and "sglang.srt.utils" in sys.modules:
        raise RuntimeError(
            "sglang was imported before prepare_cpu_env(): it has already decided "
            "this is not a CPU engine. Call prepare_cpu_env() (or set "
            "SGLANG_USE_CPU_ENGINE=1) before the first `import sglang`."
        )
    os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
    stub = str(STUB_DIR)
    if stub not in sys.path:
        sys.path.insert(0, stub)
    parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if stub not in parts:
        os.environ["PYTHONPATH"] = os.pathsep.join([stub, *parts])


def resolved_capture_ids(draft_layer_ids: Sequence[int]) -> list[int]:
    """Llama's convention: draft id i captures the input of decoder layer i + 1,
    i.e. HF ``output_hidden_states[i + 1]``."""
    return [int(i) + 1 for i in draft_layer_ids]


# --------------------------------------------------------------------- checkpoints


def make_tiny_llama(
    path: str | os.PathLike,
    *,
    seed: int = 0,
    initializer_range: float = 0.3,
    **config_overrides: Any,
) -> Path:
    """Write a random float32 ``LlamaForCausalLM`` checkpoint to ``path``.

    Deterministic for a given seed. No tokenizer is written (engines run with
    ``skip_tokenizer_init=True``). ``eos_token_id`` is unset so greedy
    generation never stops early on either side.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(path)
    cfg = dict(TINY_LLAMA)
    cfg.update(config_overrides)
    config = LlamaConfig(
        **cfg,
        initializer_range=initializer_range,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    _drop_generation_config_ids(path)
    return path


def _drop_generation_config_ids(path: Path) -> None:
    gen = path / "generation_config.json"
    if gen.exists():
        data = json.loads(gen.read_text())
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            data.pop(key, None)
        gen.write_text(json.dumps(data, indent=2) + "\n")


def make_tiny_eagle3_draft(
    path: str | os.PathLike,
    target_path: str | os.PathLike,
    *,
    aux_layer_ids: Sequence[int] = DEFAULT_AUX_LAYER_IDS,
    seed: int = 1,
    initializer_range: float = 0.3,
    draft_vocab: Sequence[int] | None = None,
) -> Path:
    """Write a random one-layer EAGLE-3 draft for the target at ``target_path``.

    Layout as SGLang's ``LlamaForCausalLMEagle3`` loads it: ``midlayer.*``
    (q/k/v take ``2 * hidden`` inputs), ``hidden_norm``, ``fc`` (``K * hidden``
    -> hidden), ``norm``, its own ``lm_head`` and the ``d2t`` / ``t2d`` maps;
    ``embed_tokens`` comes from the target. The capture ids are explicit in
    ``eagle_config.eagle_aux_hidden_state_layer_ids`` (SGLang's default ids
    would collide on so shallow a target).

    ``draft_vocab``: the target token ids the draft may propose (its reduced
    vocabulary, mapped through ``d2t``); ``None`` = the full vocabulary. A
    random draft rarely guesses right; restricting it to tokens the target
    is known to emit makes some drafts get accepted, so tests exercise the
    acceptance path too.
    """
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    path, target_path = Path(path), Path(target_path)
    target = json.loads((target_path / "config.json").read_text())
    hidden = int(target["hidden_size"])
    heads = int(target["num_attention_heads"])
    kv_heads = int(target.get("num_key_value_heads") or heads)
    head_dim = int(target.get("head_dim") or hidden // heads)
    inter = int(target["intermediate_size"])
    vocab = int(target["vocab_size"])
    k = len(aux_layer_ids)
    hot = list(range(vocab)) if draft_vocab is None else [int(t) for t in draft_vocab]
    if not hot or len(set(hot)) != len(hot) or not all(0 <= t < vocab for t in hot):
        raise ValueError(f"draft_vocab must be distinct target ids in [0, {vocab})")
    draft_vocab_size = len(hot)

    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=1,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=vocab,
        max_position_embeddings=int(target.get("max_position_embeddings", 512)),
        rms_norm_eps=float(target.get("rms_norm_eps", 1e-6)),
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        torch_dtype="float32",
    )
    data = config.to_dict()
    data.update(
        architectures=["LlamaForCausalLMEagle3"],
        model_type="llama",
        draft_vocab_size=draft_vocab_size,
        target_hidden_size=hidden,
        eagle_config={
            "eagle_aux_hidden_state_layer_ids": [int(i) for i in aux_layer_ids],
            "use_aux_hidden_state": True,
        },
    )

    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float32) * initializer_range

    def norm_w(n: int) -> torch.Tensor:
        return torch.ones(n, dtype=torch.float32)

    tensors = {
        "midlayer.self_attn.q_proj.weight": rnd(heads * head_dim, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": rnd(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": rnd(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": rnd(hidden, heads * head_dim),
        "midlayer.mlp.gate_proj.weight": rnd(inter, hidden),
        "midlayer.mlp.up_proj.weight": rnd(inter, hidden),
        "midlayer.mlp.down_proj.weight": rnd(hidden, inter),
        "midlayer.input_layernorm.weight": norm_w(hidden),
        "midlayer.hidden_norm.weight": norm_w(hidden),
        "midlayer.post_attention_layernorm.weight": norm_w(hidden),
        "fc.weight": rnd(hidden, k * hidden),
        "norm.weight": norm_w(hidden),
        "lm_head.weight": rnd(draft_vocab_size, hidden),
        # draft id i -> target id i + d2t[i]
        "d2t": torch.tensor(hot, dtype=torch.int64) - torch.arange(draft_vocab_size),
        "t2d": torch.zeros(vocab, dtype=torch.bool).index_fill_(0, torch.tensor(hot), True),
    }
    path.mkdir(parents=True, exist_ok=True)
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    return path


def make_tiny_models(
    root: str | os.PathLike,
    *,
    aux_layer_ids: Sequence[int] = DEFAULT_AUX_LAYER_IDS,
    draft_vocab: Sequence[int] | None = None,
) -> tuple[Path, Path]:
    """``(target_dir, draft_dir)`` under ``root`` with the default seeds;
    reuses what is already there (delete the directory to rebuild)."""
    root = Path(root)
    target, draft = root / "tiny-llama", root / "tiny-llama-eagle3"
    if not (target / "config.json").exists():
        make_tiny_llama(target)
    if not (draft / "config.json").exists():
        make_tiny_eagle3_draft(
            draft, target, aux_layer_ids=aux_layer_ids, draft_vocab=draft_vocab
        )
    return target, draft


# -------------------------------------------------------------------------- engines


def engine_kwargs(model_path: str | os.PathLike, **overrides: Any) -> dict[str, Any]:
    """The plain CPU engine kwargs for ``model_path``, with ``overrides`` applied."""
    kwargs = dict(CPU_ENGINE_KWARGS, model_path=str(model_path))
    kwargs.update(overrides)
    return kwargs


def capture_engine_kwargs(
    model_path: str | os.PathLike,
    aux_layer_ids: Sequence[int] = DEFAULT_AUX_LAYER_IDS,
    **overrides: Any,
) -> dict[str, Any]:
    """Capture-only mode: target alone, EAGLE-3 id convention, aux states returned."""
    kwargs = engine_kwargs(
        model_path,
        speculative_algorithm="EAGLE3",
        enable_return_aux_hidden_states=True,
        return_aux_hidden_state_layer_ids=[int(i) for i in aux_layer_ids],
    )
    kwargs.update(overrides)
    return kwargs


def eagle3_engine_kwargs(
    model_path: str | os.PathLike, draft_path: str | os.PathLike, **overrides: Any
) -> dict[str, Any]:
    """EAGLE-3 speculative decoding: intel_amx backend, 2 steps, topk 1, 3 draft tokens."""
    kwargs = engine_kwargs(model_path, **EAGLE3_ENGINE_KWARGS)
    kwargs["speculative_draft_model_path"] = str(draft_path)
    kwargs.update(overrides)
    return kwargs


def start_engine(**kwargs: Any):
    """``sglang.Engine(**kwargs)`` after :func:`prepare_cpu_env`.

    With ``attention_backend="intel_amx"`` it tells SGLang this CPU has AMX
    (``override_platform(has_amx=True)``, installed only while the engine is
    constructed): without that the backend falls back to ``torch_native``,
    which EAGLE on CPU does not accept. The override does not reach the
    spawned scheduler, so layers there still take their native paths;
    attention runs in the ``sgl_kernel`` stand-in.
    """
    prepare_cpu_env()
    import sglang

    if kwargs.get("attention_backend") != "intel_amx":
        return sglang.Engine(**kwargs)
    from sglang.srt.runtime_context import override_platform

    # Scoped: the override is only needed while the engine resolves its
    # arguments; left installed it would also change later engines started
    # from this process.
    with override_platform(has_amx=True):
        return sglang.Engine(**kwargs)


def start_capture_engine(
    model_path: str | os.PathLike,
    aux_layer_ids: Sequence[int] = DEFAULT_AUX_LAYER_IDS,
    **overrides: Any,
):
    return start_engine(**capture_engine_kwargs(model_path, aux_layer_ids, **overrides))


def start_eagle3_engine(
    model_path: str | os.PathLike, draft_path: str | os.PathLike, **overrides: Any
):
    return start_engine(**eagle3_engine_kwargs(model_path, draft_path, **overrides))


@contextlib.contextmanager
def running_engine(**kwargs: Any) -> Iterator[Any]:
    """``with running_engine(**kw) as engine:`` -- always shut down on exit."""
    engine = start_engine(**kwargs)
    try:
        yield engine
    finally:
        engine.shutdown()


def greedy_generate(
    engine: Any,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    return_hidden_states: bool = False,
) -> list[dict[str, Any]]:
    """Greedy generation for a batch of token-id prompts; one output dict each
    (``output_ids``, ``meta_info``, ...)."""
    kwargs: dict[str, Any] = {}
    if return_hidden_states:
        kwargs["return_hidden_states"] = True
    out = engine.generate(
        input_ids=[list(map(int, p)) for p in prompts],
        sampling_params={"temperature": 0, "max_new_tokens": int(max_new_tokens)},
        **kwargs,
    )
    return out if isinstance(out, list) else [out]


def aux_hidden_states(output: dict[str, Any], hidden_size: int, num_aux: int):
    """The aux hidden states one output returned, as ``[tokens, num_aux, hidden]``.

    SGLang returns one entry per forward pass the request took part in
    (prefill: one row per prompt token; decode: one row each), every row the
    concatenation of the ``num_aux`` captured layers.
    """
    import torch

    chunks = output["meta_info"]["hidden_states"]
    rows = []
    for chunk in chunks:
        t = torch.as_tensor(chunk, dtype=torch.float32)
        rows.append(t.reshape(-1, num_aux * hidden_size))
    return torch.cat(rows, dim=0).reshape(-1, num_aux, hidden_size)


# -------------------------------------------------------------------- HF references


def load_hf_model(model_path: str | os.PathLike):
    import torch
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(str(model_path), dtype=torch.float32).eval()


def hf_greedy(model, prompt: Sequence[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation by full recomputation (no KV cache): the reference."""
    import torch

    ids = torch.tensor([list(map(int, prompt))], dtype=torch.long)
    new: list[int] = []
    with torch.no_grad():
        for _ in range(int(max_new_tokens)):
            logits = model(input_ids=ids, use_cache=False).logits[0, -1]
            tok = int(torch.argmax(logits).item())
            new.append(tok)
            ids = torch.cat([ids, torch.tensor([[tok]])], dim=1)
    return new


def hf_hidden_states(model, token_ids: Sequence[int]):
    """HF ``output_hidden_states`` for one sequence: a tuple of
    ``num_layers + 1`` tensors ``[tokens, hidden]`` (0 = embeddings)."""
    import torch

    ids = torch.tensor([list(map(int, token_ids))], dtype=torch.long)
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=False, output_hidden_states=True)
    return tuple(h[0] for h in out.hidden_states)


def hf_boundary_states(model, ids: Sequence[int]) -> dict:
    """{label: [T, H] numpy}: embed, layer1..layerN (N pre-norm: the final norm's input), final_norm
    of one sequence through the HF model, the reference both serve engines' states are checked against."""
    import torch

    cap = {}
    h1 = model.model.norm.register_forward_pre_hook(lambda m, a: cap.__setitem__("pre", a[0][0]))
    h2 = model.model.norm.register_forward_hook(lambda m, a, o: cap.__setitem__("post", o[0]))
    try:
        with torch.no_grad():
            out = model(input_ids=torch.tensor([list(ids)]), use_cache=False, output_hidden_states=True)
    finally:
        h1.remove()
        h2.remove()
    n = model.config.num_hidden_layers
    st = {("embed" if b == 0 else f"layer{b}"): out.hidden_states[b][0].numpy() for b in range(n)}
    st[f"layer{n}"] = cap["pre"].numpy()
    st["final_norm"] = cap["post"].numpy()
    return st


class RecordedTrace:
    """A recorded trace with each row resolved to (request id, position, token), as the engine
    tests of both serve plugins read it; ``stats_attr`` names the plugin's stats attribute."""

    def __init__(self, path: str, stats_attr: str | None = None):
        import numpy as np

        from tensordiff.trace import TraceReader

        self.r = TraceReader(path)
        t = self.r.tokens
        self.seq = np.array([self.r.sequences[s] for s in t["seq"]], dtype=object)
        self.pos = t["position"].astype(np.int64)
        self.tok = t["token"].astype(np.int64)
        self.regime = t["regime"]
        self.step = t["step"]
        self.stats = json.loads(self.r.f.attrs[stats_attr]) if stats_attr else None

    def rows(self, name: str):
        tr = self.r.token_rows(name)
        return tr, self.seq[tr], self.pos[tr]

    def close(self) -> None:
        self.r.close()


def row_cos(a, b):
    """Cosine of each row pair, in float64."""
    import numpy as np

    a = a.astype(np.float64)
    b = b.astype(np.float64)
    return (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)


# ----------------------------------------------------------------------------------------------
# The acceptance verdicts both engines' tests check (tensordiff diff --json of train vs serve)
# ----------------------------------------------------------------------------------------------


def acceptance_of(d: dict) -> dict:
    """The one ``acceptance`` finding of a diff's JSON."""
    found = [f for f in d["findings"] if f["kind"] == "acceptance"]
    assert len(found) == 1, [f["message"] for f in d["findings"]]
    return found[0]


def assert_training_quality(d: dict, text: str, steps: int) -> None:
    """Wiring, fc output and target predictions agree; the (random) draft disagrees with the
    target: a training-quality verdict over ``steps`` verify steps, in the JSON and the text."""
    f = acceptance_of(d)
    det = f["details"]
    assert det["verdict"] == "agree" and det["draft_disagrees"] and f["severity"] == "warning", f["message"]
    assert "training-quality problem, not wiring" in f["message"]
    assert det["cross"]["target_topk"]["top1"] == 1.0 and det["cross"]["draft_topk"]["top1"] == 1.0
    assert det["steps"] == steps
    assert "acceptance by draft position" in text and "teacher-forced" in text


def norm_before_fc_draft(draft: str | os.PathLike, dst: Path) -> Path:
    """A copy of the EAGLE-3 ``draft`` whose config says norm_before_fc (sglang#32334; both engines
    read it from eagle_config): the engine normalises the packed input before fc, while a trainer
    of the same weights did not."""
    import shutil

    shutil.copytree(draft, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["eagle_config"]["norm_before_fc"] = True
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def scaled_weight_copy(src: str | os.PathLike, dst: Path, key: str, factor: float) -> Path:
    """A copy of the checkpoint ``src`` at ``dst`` with parameter ``key`` multiplied by ``factor``
    (computed in float32, stored in its own dtype): an engine's copy with one weight changed."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    for f in Path(dst).glob("*.safetensors"):
        sd = load_file(str(f))
        if key in sd:
            sd[key] = (sd[key].to(torch.float32) * factor).to(sd[key].dtype).contiguous()
            save_file(sd, str(f), metadata={"format": "pt"})
    return Path(dst)


def assert_zoom_taps_agree(train: str | os.PathLike, serve: str | os.PathLike, layer: int, taps: Sequence[str]) -> dict:
    """An engine's zoomed trace holds every dense tap of ``layer`` in forward order (the shared
    rotary module's q_rope/k_rope too), and its diff against the train side's zoom agrees with
    the taps compared; returns the diff's JSON."""
    from tensordiff.trace import TraceReader

    with TraceReader(serve) as r:
        got = sorted((n for n in r.tensors if n.startswith(f"layer{layer}.")), key=lambda n: r.tensors[n].order)
    print("serve taps:", got)
    assert got == [f"layer{layer}.{t}" for t in taps if t != "router"], got
    rc, doc, err = diff_json(train, serve)
    assert doc is not None, err
    print(json.dumps(doc["headline"]))
    compared = {t["label"] for t in doc["tensors"]}
    assert {f"layer{layer}.q", f"layer{layer}.attn_out"} <= compared
    assert rc == 0, doc["headline"]
    return doc


def assert_found_at_fc_output(rc: int, d: dict) -> None:
    """A draft that normalises its fc input on one side only: the first divergence is
    draft_fc_output (the draft input agrees), and the acceptance finding names it upstream as a
    normalisation before fc."""
    assert rc == 1
    first = d["first_divergence"]
    assert first["kind"] == "numeric" and first["tensor"] == "draft_fc_output", first["message"]
    assert all(r["verdict"] == "ok" for r in d["slot_table"])  # the draft input itself agrees
    f = acceptance_of(d)
    assert f["details"]["verdict"] == "upstream"
    assert d["findings"][f["details"]["upstream_index"]]["message"] == first["message"]
    # the same direction at another per-token scale, named by the noise model's scale checks
    assert re.search(r"first divergence upstream: draft_fc_output (is rescaled per token|is scaled by)", f["message"])
    assert "normalisation before fc" in f["message"]


def assert_target_topk_equals_hf(tr: RecordedTrace, hf, full: dict, k: int = 20) -> None:
    """``target_topk`` of a serve trace equals HF's logits on the same sequences (``full``: key ->
    prompt + output ids) at every recorded row: the top-k ids, the logsumexp and the log-probs."""
    import numpy as np
    import torch

    from tensordiff import conventions as cv

    _, tseq, tpos = tr.rows(cv.TARGET_TOPK)
    vals = tr.r.read_values(cv.TARGET_TOPK, raw=True)
    for key, ids in full.items():
        with torch.no_grad():
            logits = hf(input_ids=torch.tensor([ids]), use_cache=False).logits[0].double()
        m = tseq == key
        top = torch.topk(logits[tpos[m]], k, dim=-1)
        assert (vals[m, :k] == top.indices.numpy()).mean() > 0.99, key
        lse = torch.logsumexp(logits[tpos[m]], -1)
        np.testing.assert_allclose(vals[m, 2 * k], lse.numpy(), rtol=1e-4)
        np.testing.assert_allclose(vals[m, k:2 * k], (top.values - lse[:, None]).numpy(), atol=2e-3)


def assert_greedy_verify_steps(steps, k: int) -> None:
    """``spec_verify`` rows of a greedy run: the first rejected position is the accepted count
    (-1 when all k were accepted), and a draft token is accepted exactly while it is the target's
    top-1."""
    rej = steps[:, 2]
    assert ((rej == -1) == (steps[:, 0] == k)).all() and (rej[rej >= 0] == steps[rej >= 0, 0]).all()
    for a, row in zip(steps[:, 0].astype(int), steps):
        agree = row[3:3 + k] == row[3 + k:3 + 2 * k]
        assert agree[:a].all() and (a == k or not agree[a]), row


def assert_chains_proposed_the_verified_tokens(r, steps, k: int, draft_k: int, target_k: int = 20):
    """``spec_chain``: one row per ``spec_verify`` row; the draft's top-1 at each draft position is
    the draft token verified there (greedy) and the target rows' top-1 the target's top-1 of
    ``spec_verify``. Returns (the table, draft width, target width)."""
    import numpy as np

    from tensordiff import conventions as cv

    ch = r.tensors[cv.SPEC_CHAIN]
    np.testing.assert_array_equal(r.token_rows(cv.SPEC_CHAIN), r.token_rows(cv.SPEC_VERIFY))
    dw, tw = ch.attrs["draft_width"], ch.attrs["target_width"]
    assert (ch.attrs["K"], dw, tw, ch.width) == (k, cv.topk_width(draft_k), cv.topk_width(target_k), k * (dw + tw))
    c = r.read_values(cv.SPEC_CHAIN, raw=True)
    for j in range(k):
        np.testing.assert_array_equal(c[:, j * dw], steps[:, 3 + j])
        np.testing.assert_array_equal(c[:, k * dw + j * tw], steps[:, 3 + k + j])
    return c, dw, tw


def assert_prediction_layouts(tr: RecordedTrace, draft_k: int, target_k: int = 20):
    """The prediction tensors' roles, offsets and widths; draft_fc_output and draft_topk on the
    draft_input rows. Returns (draft_input's rows, the spec_verify info)."""
    import numpy as np

    from tensordiff import conventions as cv

    r = tr.r
    t, d, fc, sv = (r.tensors[n] for n in (cv.TARGET_TOPK, cv.DRAFT_TOPK, cv.DRAFT_FC, cv.SPEC_VERIFY))
    assert (t.role, t.token_offset, d.role, d.token_offset, fc.role, fc.token_offset) == (
        cv.TARGET_TOPK, 0, cv.DRAFT_TOPK, 1, cv.DRAFT_FC, 1)
    assert t.width == cv.topk_width(target_k) and d.width == cv.topk_width(draft_k)
    drows, _, _ = tr.rows("draft_input")
    np.testing.assert_array_equal(tr.rows(cv.DRAFT_FC)[0], drows)
    np.testing.assert_array_equal(tr.rows(cv.DRAFT_TOPK)[0], drows)
    return drows, sv


# ----------------------------------------------------------------------------------------------
# Correctly wired serve / train pairs (the serve side in a real engine, in any dtype; the train
# side `record train --from-serve` in fp32): the pairs a noise model is judged on
# ----------------------------------------------------------------------------------------------

REPO = HERE.parent

# `serve_cli.record` with the AMX override the intel_amx backend needs (EAGLE-3 on CPU)
EAGLE_RUNNER = """
import sys
sys.path.insert(0, {tests!r})
import argparse, sglang_support as sup
from tensordiff.recorders import serve_cli
p = argparse.ArgumentParser(); serve_cli.add_arguments(p)
args = p.parse_args(sys.argv[1:])
sup.prepare_cpu_env()
res = serve_cli.record(args, start_engine=sup.start_engine)
print("SECONDS", res["seconds"])
"""


def engine_env() -> dict[str, str]:
    """The environment of an SGLang engine process: CPU mode, the sgl_kernel stand-in and this
    checkout first on the path, only our plugin, no TENSORDIFF_* left over from the caller."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TENSORDIFF_")}
    env["SGLANG_USE_CPU_ENGINE"] = "1"
    rest = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join([str(STUB_DIR), str(REPO), *rest])
    env["SGLANG_PLUGINS"] = "tensordiff"
    return env


def tensordiff_env() -> dict[str, str]:
    """The environment of a `python -m tensordiff` child: this checkout first on the path."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TENSORDIFF_")}
    rest = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *rest])
    return env


def write_prompts(path: Path, prompts: dict[str, Sequence[int]]) -> Path:
    path.write_text("".join(json.dumps({"id": k, "input_ids": list(map(int, v))}) + "\n" for k, v in prompts.items()))
    return path


def record_eagle_serve(target: str | os.PathLike, draft: str | os.PathLike, prompts: dict[str, Sequence[int]],
                       out_dir: Path, name: str, *, dtype: str = "bfloat16", max_new_tokens: int = 6,
                       chunk: int = 32, batch_size: int = 2, catalog: bool = True, values: str | None = None,
                       mem_fraction_static: float = 0.3, timeout: float = 900) -> dict:
    """EAGLE-3 in real SGLang on the CPU (``serve_cli.record``, intel_amx), the model in ``dtype``:
    ``{"trace", "outputs" (the --outputs JSONL), "full" (key -> prompt + output ids)}``. ``values``:
    the tensors that keep values (``--values``; default: the plugin's). ``mem_fraction_static``: on
    the CPU, SGLang sizes the KV cache from the machine memory still available after loading the
    weights, less (1 - this) of what was available before; other processes taking memory in
    between leave none at 0.1 (``max_total_tokens`` bounds the cache whatever the fraction)."""
    import subprocess

    out_dir.mkdir(parents=True, exist_ok=True)
    pfile = write_prompts(out_dir / f"{name}-prompts.jsonl", prompts)
    trace, outputs = out_dir / f"{name}.h5", out_dir / f"{name}.jsonl"
    argv = [sys.executable, "-c", EAGLE_RUNNER.format(tests=str(HERE)), "--model", str(target),
            "--draft", str(draft), "--prompts", str(pfile), "--out", str(trace), "--outputs", str(outputs),
            "--max-new-tokens", str(max_new_tokens), "--batch-size", str(batch_size), "--device", "cpu",
            "--dtype", dtype, "--chunked-prefill-size", str(chunk), "--mem-fraction-static", str(mem_fraction_static),
            "--max-total-tokens", "2048", "--log-level", "error", "--attention-backend", "intel_amx"]
    if catalog:
        argv.append("--catalog")
    if values:
        argv += ["--values", values]
    proc = subprocess.run(argv, check=False, capture_output=True, text=True, env=engine_env(), cwd=REPO,
                          timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"SGLang serve run failed ({proc.returncode}): {proc.stdout[-2000:]}{proc.stderr[-3000:]}")
    return load_serve_run(trace, outputs)


def load_serve_run(trace: Path, outputs: Path) -> dict:
    """The run's outputs and trace; a trace the plugin did not close cleanly (it stopped recording on
    an error: ``recording_error``) is an error here, not a shorter trace to compare."""
    import h5py

    with h5py.File(trace, "r") as f:
        if not bool(f.attrs.get("complete", False)):
            err = f.attrs.get("recording_error")
            raise RuntimeError(f"the serve trace {trace} was not closed cleanly"
                               + (f": recording_error {err}" if err is not None else ""))
    outs = [json.loads(line) for line in outputs.read_text().splitlines()]
    return {"trace": str(trace), "outputs": str(outputs), "by_id": {o["id"]: o for o in outs},
            "full": {o["id"]: o["input_ids"] + o["output_ids"] for o in outs}}


def record_train_from_serve(target: str | os.PathLike, source: str | os.PathLike, out: Path,
                            draft: str | os.PathLike, convention: str, *, dtype: str = "float32",
                            extra: Sequence[str] = ()) -> Path:
    """`tensordiff record train --from-serve SOURCE` (this venv): the sequences a serve run saw,
    through HF transformers in ``dtype``, wired as ``convention`` says the engine wires them."""
    import subprocess

    argv = [sys.executable, "-m", "tensordiff", "record", "train", "--model", str(target), "--from-serve", str(source),
            "--draft", str(draft), "--convention", convention, "--dtype", dtype, "--device", "cpu", "--no-progress",
            "--out", str(out), *extra]
    proc = subprocess.run(argv, check=False, capture_output=True, text=True, env=tensordiff_env(), cwd=REPO,
                          timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"record train failed ({proc.returncode}): {proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    return out


def sglang_serve_pair(target: str | os.PathLike, draft: str | os.PathLike, prompts: dict[str, Sequence[int]],
                      out_dir: Path, *, dtype: str = "bfloat16", train_dtype: str = "float32", all_values: bool = False,
                      **serve_kw: Any) -> dict:
    """A correctly wired pair: SGLang EAGLE-3 serve in ``dtype`` and `record train --from-serve` its
    outputs in ``train_dtype`` (sglang-llama: draft id i -> boundary i + 1, as SGLang captures).
    ``all_values``: every tensor on both sides keeps its values (default: each recorder's own
    choice, as a user records). ``{"train", "serve", "run"}``."""
    run = record_eagle_serve(target, draft, prompts, out_dir, f"sglang-{dtype}", dtype=dtype,
                             values="all" if all_values else None, **serve_kw)
    train = record_train_from_serve(target, run["outputs"], out_dir / f"sglang-{dtype}-train-{train_dtype}.h5",
                                    draft, "sglang-llama", dtype=train_dtype,
                                    extra=("--values", "all") if all_values else ())
    return {"train": str(train), "serve": run["trace"], "run": run}


def diff_json(a: str | os.PathLike, b: str | os.PathLike, *extra: str) -> tuple[int, dict | None, str]:
    """`tensordiff diff A B --json` (this venv): (exit code, the JSON or None, stderr)."""
    import subprocess

    proc = subprocess.run([sys.executable, "-m", "tensordiff", "diff", str(a), str(b), "--json", *extra], check=False,
                          capture_output=True, text=True, env=tensordiff_env(), cwd=REPO, timeout=900)
    try:
        doc = json.loads(proc.stdout)
    except ValueError:
        doc = None
    return proc.returncode, doc, proc.stderr


def trained_models(min_head_dim: int = 0) -> dict | None:
    """The trained tiny Llama, its EAGLE-3 draft and held-out prompts (scripts/train_tiny_models.py,
    built once and cached), as ``{"target", "draft", "prompts" (key -> ids), "layers"}``; None where
    the script is absent or its model's head_dim is below ``min_head_dim`` (vLLM's CPU attention
    needs 64)."""
    import importlib.util

    script = REPO / "scripts" / "train_tiny_models.py"
    if not script.exists():
        return None
    spec = importlib.util.spec_from_file_location("_train_tiny_models", script)
    if spec is None or spec.loader is None:
        return None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    cfg = dict(mod.CONFIG)
    head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
    if head_dim < min_head_dim:
        return None
    out = Path(mod.trained_dir(log=lambda *_: None))
    prompts: dict[str, list[int]] = {}
    if (out / "prompts.jsonl").exists():
        for i, line in enumerate((out / "prompts.jsonl").read_text().splitlines()):
            doc = json.loads(line)
            prompts[str(doc.get("id", f"p{i}"))] = [int(t) for t in doc["input_ids"]]
    return {"target": out / "target", "draft": out / "draft", "prompts": prompts,
            "layers": int(cfg["num_hidden_layers"])}


# ----------------------------------------------------------------------------------------------
# RL: rollout and replay of one engine, and a decode-only bug (tests/test_sglang_rl_engine.py,
# benchmarks/bench_rl_decode.py)
# ----------------------------------------------------------------------------------------------


def rl_engine_env(extra: dict | None = None, plugins: str = "tensordiff", path: Sequence[str] = ()) -> dict[str, str]:
    env = engine_env()
    env["SGLANG_PLUGINS"] = plugins
    if path:
        env["PYTHONPATH"] = os.pathsep.join([*path, env["PYTHONPATH"]])
    env.update(extra or {})
    return env


def rl_serve(target: str | os.PathLike, prompts: dict[str, Sequence[int]], tmp: Path, name: str, *extra: str,
             max_new: int, env: dict | None = None, replay: Path | None = None, seed: int = 7,
             temperature: float = 1.0) -> dict:
    """`tensordiff record serve` in bfloat16 with the catalog (all values), sampled at
    ``temperature`` with ``seed``; with ``replay``, that rollout computed again as prefill (at the
    rollout's temperature)."""
    import subprocess

    out, outputs = tmp / f"{name}.h5", tmp / f"{name}.jsonl"
    argv = [sys.executable, "-m", "tensordiff", "record", "serve", "--model", str(target), "--out", str(out),
            "--outputs", str(outputs), "--catalog", "--values", "all", "--max-new-tokens", str(max_new),
            "--batch-size", "2", "--device", "cpu", "--dtype", "bfloat16", "--chunked-prefill-size", "64",
            "--mem-fraction-static", "0.3", "--max-total-tokens", "2048", "--log-level", "error",
            "--attention-backend", "torch_native", *extra]
    if replay is None:
        argv += ["--prompts", str(write_prompts(tmp / f"{name}-prompts.jsonl", prompts)),
                 "--temperature", str(temperature), "--random-seed", str(seed)]
    else:
        # the rollout's own outputs: a prompt sharing a prefix with an earlier one hit the prefix cache, so
        # the rollout trace holds no rows for that prefix
        argv += ["--replay", str(replay), "--replay-outputs", str(replay.with_suffix(".jsonl"))]
    proc = subprocess.run(argv, check=False, capture_output=True, text=True, env=env or rl_engine_env(), cwd=REPO,
                          timeout=900)
    if proc.returncode != 0:
        raise AssertionError(proc.stdout[-3000:] + proc.stderr[-3000:])
    run = load_serve_run(out, outputs)
    run["stdout"] = proc.stdout
    return run


_PERTURB_PLUGIN = '''
import os


def register():
    """Scale the output of one decoder layer's attention on decode passes only (a decode-path bug)."""
    if not os.environ.get("TENSORDIFF_TRACE"):
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    def after(result, backend, q, k, v, layer, *args, **kwargs):
        if getattr(layer, "layer_id", None) == {layer}:
            return result * {scale}
        return None

    HookRegistry.register("sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend.forward_decode",
                          after, HookType.AFTER)
'''


def perturb_plugin(root: Path, layer: int, scale: float) -> Path:
    """A test-only SGLang plugin (``tdperturb``) that scales decoder layer ``layer``'s attention output
    on decode passes by ``scale``, installed the way any plugin is: a package and a dist-info whose
    entry point is in group ``sglang.srt.plugins``, on the engine's path."""
    (root / "tdperturb").mkdir(parents=True, exist_ok=True)
    (root / "tdperturb" / "__init__.py").write_text(
        _PERTURB_PLUGIN.replace("{layer}", str(layer)).replace("{scale}", repr(float(scale))))
    info = root / "tdperturb-0.0.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: tdperturb\nVersion: 0.0\n")
    (info / "entry_points.txt").write_text("[sglang.srt.plugins]\ntdperturb = tdperturb:register\n")
    return root


def rl_perturbed_pair(target: str | os.PathLike, prompts: dict[str, Sequence[int]], tmp: Path, *, layer: int,
                      scale: float, max_new: int, seed: int = 7, temperature: float = 1.0) -> dict:
    """Rollout and replay on an engine whose decode attention of decoder layer ``layer`` is scaled by
    ``scale`` (the replay is prefill only, so it never sees the bug)."""
    env = rl_engine_env(plugins="tensordiff,tdperturb", path=[str(perturb_plugin(tmp / "plugin", layer, scale))])
    ro = rl_serve(target, prompts, tmp, "rollout", max_new=max_new, env=env, seed=seed, temperature=temperature)
    rp = rl_serve(target, prompts, tmp, "replay", max_new=max_new, env=env, replay=Path(ro["trace"]))
    return {"rollout": ro, "replay": rp}
