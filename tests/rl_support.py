"""An RL rollout recorded with HF transformers standing in for the engine (no engine needed for
the trainer/rollout triage's logic): real prefill + KV-cache decode passes of the trained tiny
model, the engine-side records an RL plugin writes (``sampled_logprob`` as the engine returns it,
``sampling``, ``/weights/step_<k>``), and bugs injected where the real ones live. Not a test module.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import numpy as np
import torch

from tensordiff import conventions as cv
from tensordiff.recorders.core import Recorder
from tensordiff.recorders.hf import HFExtractorRecorder, model_info
from tensordiff.recorders.hooks import record_weights, trainer_logprobs
from tensordiff.trace.rl import sampling_params, write_sampling

import trained

NEW_TOKENS = 16


class Bf16Head(torch.nn.Linear):
    """An lm_head that holds its weight in bf16 and computes in bf16 (an engine's default head)."""

    def forward(self, x):
        return torch.nn.functional.linear(x.to(torch.bfloat16), self.weight).float()


def bf16_head(model):
    old = model.lm_head
    head = Bf16Head(old.in_features, old.out_features, bias=False)
    head.weight = torch.nn.Parameter(old.weight.detach().to(torch.bfloat16), requires_grad=False)
    model.lm_head = head
    return model


def updated(model, lr: float = 1e-3, seed: int = 0):
    """One Adam step of next-token loss on the prompts: the trainer's weights after an update."""
    import copy

    m = copy.deepcopy(model).train()
    opt = torch.optim.Adam(m.parameters(), lr=lr)
    ids = [torch.tensor(p) for p in trained.prompts()]
    loss = sum(m(input_ids=x[None], labels=x[None]).loss for x in ids) / len(ids)
    loss.backward()
    opt.step()
    return m.eval()


def save(model, out: Path) -> Path:
    model.save_pretrained(out, safe_serialization=True)
    return out


def with_config(out: Path, **changes) -> Path:
    """A copy of the trained target whose config.json has ``changes`` (rope_parameters merged)."""
    shutil.copytree(trained.target_dir(), out)
    cfg = json.loads((out / "config.json").read_text())
    for k, v in changes.items():
        if isinstance(v, dict) and isinstance(cfg.get(k), dict):
            cfg[k].update(v)
        else:
            cfg[k] = v
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def rollout(out: Path, model, *, temperature: float = 0.7, logprobs_mode: str = "processed", seed: int = 0,
            weight_steps=None, new_tokens: int = NEW_TOKENS, prompts=None, model_path=None,
            kv_dtype=None, later=(), top_k: int | None = None, keys=None, prefix_cache: bool = False) -> Path:
    """Generate ``new_tokens`` per prompt with ``model`` (prefill, then one decode pass per token
    with the KV cache), sampling at ``temperature`` with a seeded generator, and record it as a
    serve-side trace: the catalog with values, target_topk, the returned log-probs (``processed``:
    of the distribution sampled from; ``raw``: the model's log-softmax) and the weight steps
    ``weight_steps``: ``[(model or fingerprint doc, event)]``, step k in force from forward k;
    ``later``: weight steps the engine received after these tokens (in force from later forwards,
    serving requests the trainer does not see); ``top_k``: the engine samples from its top k tokens
    and returns the log-prob renormalised over them, while its sampling record says no top-k;
    ``keys``: the request ids (default ``p<i>``); ``prefix_cache``: a prompt served before reuses
    its KV but for the last prompt token (as a radix cache does): no rows for the cached positions."""
    from transformers import DynamicCache

    gen = torch.Generator().manual_seed(seed)
    info = model_info(model)
    info["path"] = str(model_path or trained.target_dir())
    steps = weight_steps if weight_steps is not None else [(model, "start")]
    with Recorder(str(out), side="serve", producer="tests.rl_support (HF as the engine)", model=info) as rec:
        write_sampling(rec.writer, sampling_params(temperature=temperature, logprobs_mode=logprobs_mode,
                                                   engine="hf-rollout"))
        for k, (m, event) in enumerate(steps):
            doc = m if isinstance(m, dict) else None
            record_weights(rec, model if doc is not None else m, k, forward_step=k, event=event, doc=doc)
        fwd = len(steps) - 1
        for j, (m, event) in enumerate(later):
            record_weights(rec, m, fwd + 1 + j, forward_step=fwd + 1 + j, event=event)
        hf = HFExtractorRecorder(model, rec, None, values="all", topk=20)
        cached: dict[tuple[int, ...], object] = {}
        for i, ids in enumerate(prompts or trained.prompts()):
            key = keys[i] if keys is not None else f"p{i}"
            cache = DynamicCache()
            toks = list(ids)
            feed, pos, regime = toks, list(range(len(toks))), "prefill"
            if prefix_cache and tuple(toks) in cached:
                cache = copy.deepcopy(cached[tuple(toks)])
                feed, pos = toks[-1:], [len(toks) - 1]
            for j in range(new_tokens):
                x = torch.tensor(feed)
                with hf.capture(key, x, positions=pos, regime=regime, step=fwd) as rows, torch.inference_mode():
                    o = model(input_ids=x[None], position_ids=torch.tensor(pos)[None], past_key_values=cache,
                              use_cache=True)
                cache = o.past_key_values
                if prefix_cache and j == 0 and tuple(toks) not in cached:
                    kept = copy.deepcopy(cache)
                    kept.crop(-1)   # all but the last prompt token
                    cached[tuple(toks)] = kept
                if kv_dtype is not None:   # a decode-path bug: the KV cache stored in a narrower dtype
                    for layer in cache.layers:
                        layer.keys = layer.keys.to(kv_dtype).float()
                        layer.values = layer.values.to(kv_dtype).float()
                z = o.logits[0, -1].float()
                t = temperature if temperature > 0 else 1.0
                if top_k is not None:
                    z = torch.where(z >= torch.topk(z, top_k).values[-1], z, torch.tensor(-torch.inf))
                nxt = int(torch.multinomial(torch.softmax(z / t, -1), 1, generator=gen)) if temperature > 0 \
                    else int(z.argmax())
                lp = trainer_logprobs(z[None], torch.tensor([nxt]), t if logprobs_mode == "processed" else 1.0)
                rec.plain(cv.SAMPLED_LOGPROB, np.array([[nxt, float(lp[0])]]), rows[0, -1:], role=cv.SAMPLED_LOGPROB)
                toks.append(nxt)
                feed, pos, regime = [nxt], [len(toks) - 1], "decode"
    return out


def scaled_output(module, scale: float):
    """A bug of known size that leaves every weight as it is (the fingerprints agree): ``module``'s
    output multiplied by ``scale`` (a kernel's wrong constant). Returns the hook's handle."""
    def hook(mod, args, out):
        return (out[0] * scale, *out[1:]) if isinstance(out, tuple) else out * scale
    return module.register_forward_hook(hook)


def trainer(out: Path, model, serve: Path, prompts, *, temperature: float = 0.7, autocast=None) -> Path:
    """A user's trainer forward over the rollout's sequences, one at a time (TrainerRecorder),
    inside ``torch.autocast("cpu", dtype=autocast)`` when given (as verl, OpenRLHF and NeMo-RL run
    it): the model's float32 weights, its matmuls in ``autocast``."""
    import contextlib

    from tensordiff.recorders.hooks import TrainerRecorder
    from tensordiff.recorders.train_cli import load_serve_sequences

    seqs = dict(load_serve_sequences(str(serve)))
    with Recorder(str(out), side="train", model=model_info(model)) as rec:
        tr = TrainerRecorder(model, rec, temperature=temperature)
        for i, p in enumerate(prompts):
            ids = torch.tensor(seqs[f"p{i}"])
            region = torch.autocast("cpu", dtype=autocast) if autocast is not None else contextlib.nullcontext()
            with tr.sequence(f"p{i}", ids, first_generated=len(p)), torch.no_grad(), region:
                model(input_ids=ids[None])
        tr.detach()
    return out


def inflight_rollout(out: Path, model, new_weights, *, update_at: int, prompts, temperature: float = 0.7,
                     new_tokens: int = NEW_TOKENS, seed: int = 0) -> Path:
    """Every sequence generated in lockstep (one decode pass of each per step, as a batch runs),
    and the engine's weights replaced by ``new_weights``'s in flight, before decode pass
    ``update_at``: each sequence's tokens up to there were generated under weight step 0, the rest
    under step 1 (its KV cache kept). Recorded as :func:`rollout` does (processed log-probs)."""
    from transformers import DynamicCache

    gen = torch.Generator().manual_seed(seed)
    info = model_info(model)
    info["path"] = str(trained.target_dir())
    with Recorder(str(out), side="serve", producer="tests.rl_support (HF as the engine, in-flight update)",
                  model=info) as rec:
        write_sampling(rec.writer, sampling_params(temperature=temperature, engine="hf-rollout"))
        record_weights(rec, model, 0, forward_step=0, event="start")
        hf = HFExtractorRecorder(model, rec, None, values="all", topk=20)
        state = {f"p{i}": {"toks": list(ids), "cache": DynamicCache(), "feed": list(ids),
                           "pos": list(range(len(ids))), "regime": "prefill"} for i, ids in enumerate(prompts)}
        step = 0
        for j in range(new_tokens):
            if j == update_at:
                with torch.no_grad():
                    model.load_state_dict(new_weights.state_dict())
                step = 1
                record_weights(rec, model, 1, forward_step=1, event="update_weights_from_tensor")
            for key, st in state.items():
                x = torch.tensor(st["feed"])
                with hf.capture(key, x, positions=st["pos"], regime=st["regime"], step=step) as rows, \
                        torch.inference_mode():
                    o = model(input_ids=x[None], position_ids=torch.tensor(st["pos"])[None],
                              past_key_values=st["cache"], use_cache=True)
                st["cache"] = o.past_key_values
                z = o.logits[0, -1].float()
                nxt = int(torch.multinomial(torch.softmax(z / temperature, -1), 1, generator=gen))
                lp = trainer_logprobs(z[None], torch.tensor([nxt]), temperature)
                rec.plain(cv.SAMPLED_LOGPROB, np.array([[nxt, float(lp[0])]]), rows[0, -1:], role=cv.SAMPLED_LOGPROB)
                st["toks"].append(nxt)
                st["feed"], st["pos"], st["regime"] = [nxt], [len(st["toks"]) - 1], "decode"
    return out


def train_from_serve(out: Path, serve: Path, model_dir: Path | None = None, *extra: str) -> Path:
    from tensordiff.cli import main

    argv = ["record", "train", "--model", str(model_dir or trained.target_dir()), "--from-serve", str(serve),
            "--values", "all", "--no-draft-input", "--no-progress", "--out", str(out), *extra]
    assert main(argv) == 0, argv
    return out


def replay(out: Path, model, serve: Path, *, temperature: float = 0.7, logprobs_mode: str = "processed") -> Path:
    """The engine's prefill re-run of a rollout (``record serve --replay``): each sequence's
    tokens in one prefill pass, the sampled tokens' log-probs as the engine returns them
    (``raw``: the model's log-softmax whatever the temperature, as SGLang's input log-probs are and
    its replay records them)."""
    from tensordiff.recorders.train_cli import load_serve_sequences, serve_rl_info

    _, first = serve_rl_info(str(serve))
    info = model_info(model)
    info["path"] = str(trained.target_dir())
    with Recorder(str(out), side="serve", producer="tests.rl_support (HF prefill replay)", model=info) as rec:
        write_sampling(rec.writer, sampling_params(temperature=temperature, logprobs_mode=logprobs_mode,
                                                   engine="hf-replay"))
        record_weights(rec, model, 0, event="start")
        hf = HFExtractorRecorder(model, rec, None, values="all", topk=20)
        for key, toks in load_serve_sequences(str(serve)):
            x = torch.tensor(toks)
            with hf.capture(key, x, regime="prefill") as rows, torch.inference_mode():
                o = model(input_ids=x[None], use_cache=False)
            from tensordiff.recorders.hooks import record_sampled_logprob
            record_sampled_logprob(rec, o.logits[0], rows[0], x, first_generated=first[key],
                                   temperature=temperature if logprobs_mode == "processed" else 1.0)
    return out
