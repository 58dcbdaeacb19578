"""``tensordiff record train``: run an HF transformers causal LM over prompts and record the train
side: the boundary catalog, ``final_norm`` and the packed draft input as a named convention builds it.

With ``--from-serve`` (an RL rollout), also what the RL triage compares: the trainer's log-prob of
each sampled token (``sampled_logprob``, at the serve run's temperature), the weight fingerprints
of the model it ran (``/weights/step_0``) and the ``sampling`` attribute (tensordiff.trace.rl).

No torch at import time (``tensordiff --help`` must work without it): torch and transformers are
imported inside :func:`run`.

Why one module of this size: the command's arguments, the readers of its three inputs (prompts,
a serve run's outputs or trace) and the recording loop are one command's; the recording itself
lives in :mod:`.hf` and :mod:`.hooks`.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .. import conventions
from ..errors import RecordingError, SourceFileError, TraceFileError, UsageError
from ..safety import parse_json, read_json_file, read_regular_file_bounded, read_regular_file_head

CONVENTION_CHOICES = conventions.planning_choices()
#: how ids become states where a draft input is recorded and --convention is not given
DEFAULT_CONVENTION = "specforge"
#: a prompts file or a serve run's outputs JSONL is read whole: a bound on it (locate's for its
#: prompts), and on one line of it (a prompt of a million token ids is about 8 MB of JSON)
MAX_JSONL_BYTES = 256 << 20
MAX_JSONL_LINE_CHARS = 16 << 20
_HDF5_MAGIC = b"\x89HDF\r\n\x1a\n"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, metavar="DIR",
                   help="local HF transformers model directory (config.json + weights; never downloaded), or "
                        "module:pkg.mod:factory, a callable returning a torch.nn.Module called as an HF causal LM "
                        "(its form is checked before anything is imported)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompts", metavar="FILE",
                   help="JSONL: one prompt per line, a list of token ids, {\"input_ids\": [...]}, or "
                        "{\"text\": \"...\"} / a JSON string when the model directory has a tokenizer; "
                        "an optional \"id\" names the sequence")
    src.add_argument("--from-serve", metavar="FILE",
                     help="record exactly the sequences a serve run saw (prompt + generated tokens): the --outputs "
                          "JSONL of `record serve`, or the serve trace itself (when it holds every position "
                          "from 0; a radix-cache hit leaves a prefix out)")
    p.add_argument("--out", "-o", required=True, metavar="T.h5", help="trace file to write (not one that exists, "
                                                                        "unless --force)")
    p.add_argument("--force", action="store_true", help="overwrite --out when it exists")
    p.add_argument("--temperature", type=float, metavar="T",
                   help="with --from-serve: the temperature the trainer divides the logits by for the sampled "
                        "tokens' log-probs (sampled_logprob; default: the serve trace's sampling attribute, else 1.0)")
    g = p.add_argument_group("draft input", "recorded only when one of these says what the draft reads "
                                            "(--aux-ids, --draft, --draft-config, --boundaries, --convention, "
                                            "--prepend-embed); without them, the catalog only")
    g.add_argument("--aux-ids", type=int, nargs="+", metavar="ID",
                   help="the draft's aux hidden-state layer ids as the pipeline configures them "
                        "(default: from --draft or --draft-config, else the convention's default)")
    g.add_argument("--convention", choices=CONVENTION_CHOICES,
                   help=f"how the pipeline turns ids into states ({DEFAULT_CONVENTION} where a draft input is "
                        "recorded and this is not given: boundary id+1; eagle: inputs of layers 2, N//2, N-3; "
                        "speculators-legacy: [hs[id+1] ...] + [last], packs [:-1]); alone, it records a draft "
                        "input of its default ids")
    g.add_argument("--prepend-embed", action="store_true",
                   help="model the speculators legacy extractor bug: the list was [hs[0]] + [hs[id+1] for id in ids] "
                        "and [:-1] fed [embed, ...] (with --convention speculators-legacy)")
    g.add_argument("--boundaries", nargs="+", metavar="B",
                   help="explicit draft slots instead of ids: boundaries (0..N) or labels (embed, layer3, final_norm)")
    g.add_argument("--hf-index-n-post-norm", action="store_true",
                   help="the pipeline indexes HF output_hidden_states directly, so id->index N is the post-norm "
                        "state (final_norm) in transformers 5.x (default only for --convention hf)")
    g.add_argument("--draft-config", metavar="FILE",
                   help="draft config.json: read eagle_config.eagle_aux_hidden_state_layer_ids when --aux-ids is absent")
    g.add_argument("--no-draft-input", action="store_true",
                   help="record the catalog only, whatever the flags above say (the default without them)")
    g = p.add_argument_group("predictions")
    g.add_argument("--draft", metavar="DIR",
                   help="an EAGLE-3 draft directory (SGLang's checkpoint layout): also record its fc output "
                        "(draft_fc_output) and its top-k predictions (draft_topk), teacher-forced on draft_input; "
                        "its eagle_config ids are the default --aux-ids")
    g.add_argument("--topk", type=int, default=20, metavar="K",
                   help="top-k ids + log-probs + logsumexp recorded per token for the target (target_topk) "
                        "and the draft (default 20; 0: none)")
    g = p.add_argument_group("what to record")
    g.add_argument("--values", default="slots", metavar="WHICH",
                   help="catalog states with full values: slots (default: the states the draft plan captures, "
                        "plus final_norm), all, none, or labels (embed,layer3,final_norm); sketches are kept for all")
    g.add_argument("--zoom", metavar="LAYER",
                   help="also record the sub-layer taps of this decoder layer (layer3: attn_norm, q, k, v, q_rope, "
                        "k_rope, attn_out, mlp_norm, mlp_gate, mlp_up, mlp_act, mlp_out; router for MoE) as "
                        "layer3.<tap>; HF Llama-family layouts (Llama, Mistral, Qwen2/3, Mixtral, DeepSeek), "
                        "others with --name-rule")
    g.add_argument("--name-rule", action="append", default=[], metavar="REGEX=TAP",
                   help="with --zoom: name a module the table does not know, e.g. 'transformer\\.h\\.(\\d+)\\.mlp=mlp_out' "
                        "(REGEX matches the whole module path, its first group is the layer; REGEX:input=TAP for "
                        "the module's input); repeatable")
    g.add_argument("--graft", metavar="OTHER.h5:STATE",
                   help="replace STATE (a boundary, layer3, or a tap, layer3.mlp_out) during the forward with its "
                        "full values recorded in OTHER.h5 on the same tokens, to confirm where a divergence starts: "
                        "the diff of this run against OTHER says whether anything after STATE still diverges")
    g.add_argument("--sample-every", type=int, default=1, metavar="K",
                   help="record token positions p with p %% K == 0 only (default 1: all)")
    g.add_argument("--positions", type=int, nargs="+", metavar="P", help="also (or with --sample-every 0: only) these positions")
    g.add_argument("--max-len", type=int, metavar="L", help="truncate every prompt to L tokens")
    g.add_argument("--limit", type=int, metavar="N", help="record the first N prompts only")
    g.add_argument("--sketch-dim", type=int, default=None, help="sketch width (default 128)")
    g.add_argument("--sketch-seed", type=int, default=None, help="sketch projection seed (both sides must agree)")
    g = p.add_argument_group("model")
    g.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                   help="load the model in this dtype (auto: the checkpoint's)")
    g.add_argument("--device", default="auto", help="cpu, cuda, cuda:1 ... (auto: cuda when available)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


# ----------------------------------------------------------------------------------------------


def _read_draft_ids(path: str) -> list[int] | None:
    cfg = read_json_file(path, "the draft config")
    if not isinstance(cfg, dict):
        raise SourceFileError("the draft config is not a JSON object", path)
    ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        ids = cfg.get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        return None
    if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
        raise SourceFileError("eagle_aux_hidden_state_layer_ids is not a list of integers", path)
    return ids


def _jsonl_lines(path: str, what: str, not_text: str) -> list[tuple[int, str]]:
    """(line number, line) of each non-blank line of a JSONL file, read through the bounded
    regular-file reader (a FIFO or a device is refused, not waited on or read without end), each
    line bounded before it is parsed."""
    raw = read_regular_file_bounded(path, MAX_JSONL_BYTES, what)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise SourceFileError(not_text, path) from None
    out = []
    for n, line in enumerate(text.split("\n"), 1):
        if len(line) > MAX_JSONL_LINE_CHARS:
            raise SourceFileError(f"line {n}: {len(line)} characters, more than the {MAX_JSONL_LINE_CHARS} "
                                  "a line may hold", path)
        if line.strip():
            out.append((n, line.strip()))
    return out


def _token_ids(ids: list[Any]) -> bool:
    """Whether every item is a token id a trace's int64 columns hold."""
    return all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < 1 << 63 for i in ids)


def load_prompts(path: str, tokenizer_loader) -> list[tuple[str, list[int]]]:
    """(key, token ids) per JSONL line; ``tokenizer_loader()`` returns a tokenizer for text lines."""
    out: list[tuple[str, list[int]]] = []
    tok = None
    for n, line in _jsonl_lines(path, "prompts file", "prompts file is not UTF-8 text"):
        obj = parse_json(line, f"line {n}", path)
        key = f"prompt-{len(out)}"
        text = None
        ids = None
        if isinstance(obj, list):
            ids = obj
        elif isinstance(obj, str):
            text = obj
        elif isinstance(obj, dict):
            if "id" in obj:
                key = str(obj["id"])
            for k in ("input_ids", "token_ids", "tokens"):
                if k in obj:
                    ids = obj[k]
                    break
            if ids is None:
                text = obj.get("text", obj.get("prompt"))
        if ids is not None:
            if not isinstance(ids, list) or not ids or not _token_ids(ids):
                raise SourceFileError(f"line {n}: token ids must be a non-empty list of non-negative integers "
                                      "(below 2^63)", path)
        elif isinstance(text, str):
            if tok is None:
                tok = tokenizer_loader()
            ids = list(tok(text, add_special_tokens=True)["input_ids"])
            if not ids:
                raise SourceFileError(f"line {n}: the text tokenizes to nothing", path)
        else:
            raise SourceFileError(f"line {n}: expected token ids, {{\"input_ids\": [...]}} or {{\"text\": \"...\"}}", path)
        out.append((key, ids))
    if not out:
        raise SourceFileError("no prompts in the file", path)
    keys = [k for k, _ in out]
    if len(set(keys)) != len(keys):
        raise SourceFileError("prompt ids repeat; every \"id\" must be unique", path)
    return out


def load_serve_sequences(path: str) -> list[tuple[str, list[int]]]:
    """(request id, prompt + generated tokens) of every request a serve run saw: from the JSONL
    ``record serve --outputs`` writes, or from a serve trace's token table."""
    if read_regular_file_head(path, 8, "the serve run") == _HDF5_MAGIC:
        return _sequences_of_trace(path)
    out: list[tuple[str, list[int]]] = []
    for i, (n, line) in enumerate(_jsonl_lines(path, "the serve run", "neither a serve trace nor a JSONL outputs file")):
        o = parse_json(line, f"line {n}", path)
        ids, outs = (o.get("input_ids"), o.get("output_ids")) if isinstance(o, dict) else (None, None)
        if not all(isinstance(x, list) for x in (ids, outs)) or not ids:
            raise SourceFileError(f"line {n}: expected {{\"id\", \"input_ids\": [...], \"output_ids\": [...]}} "
                             "as record serve --outputs writes", path)
        if not (_token_ids(ids) and _token_ids(outs)):
            raise SourceFileError(f"line {n}: token ids must be integers from 0 to 2^63-1", path)
        out.append((str(o.get("id", f"request-{i}")), list(ids) + list(outs)))
    if not out:
        raise SourceFileError("no requests in the outputs file", path)
    if len({k for k, _ in out}) != len(out):
        raise SourceFileError("request ids repeat in the outputs file", path)
    return out


def serve_rl_info(path: str) -> tuple[dict | None, dict[str, int]]:
    """What a serve run says about its sampling: the ``sampling`` attribute (None: none, or an
    outputs JSONL) and, per request, the position of its first generated token (the JSONL's prompt
    length; in a trace, one past the first row of its ``sampled_logprob``, else its first decode
    row)."""
    if read_regular_file_head(path, 8, "the serve run") != _HDF5_MAGIC:
        first: dict[str, int] = {}
        for i, (n, line) in enumerate(_jsonl_lines(path, "the serve run", "not a JSONL outputs file")):
            o = parse_json(line, f"line {n}", path)
            first[str(o.get("id", f"request-{i}"))] = len(o["input_ids"])
        return None, first
    import numpy as np

    from ..trace import TraceReader
    from ..trace.rl import read_sampling
    from ..vocab import REGIME_CODE

    with TraceReader(path) as r:
        sampling = read_sampling(r)
        t = r.tokens
        seq, pos, reg = (np.asarray(t[c]) for c in ("seq", "position", "regime"))
        seqs = list(r.sequences)
        if conventions.SAMPLED_LOGPROB in r.tensors:
            tr = r.token_rows(conventions.SAMPLED_LOGPROB)
            s_, p_ = seq[tr], pos[tr] + 1
        else:
            m = reg == REGIME_CODE["decode"]
            s_, p_ = seq[m], pos[m]
    first = {}
    for s in np.unique(s_):
        first[seqs[int(s)]] = int(p_[s_ == s].min())
    return sampling, first


def _sequences_of_trace(path: str) -> list[tuple[str, list[int]]]:
    import numpy as np

    from ..trace import TraceReader

    with TraceReader(path) as r:
        t = r.tokens
        seqs = list(r.sequences)
        seq, pos, tok = (np.asarray(t[c]) for c in ("seq", "position", "token"))
        # the last token an engine sampled is never fed back, so it has no row: its id is in
        # sampled_logprob, on the row that sampled it
        last: dict[int, tuple[int, int]] = {}
        if conventions.SAMPLED_LOGPROB in r.tensors:
            lrows = r.token_rows(conventions.SAMPLED_LOGPROB)
            ids = np.asarray(r.read_at(conventions.SAMPLED_LOGPROB, "values", np.arange(len(lrows))))[:, 0]
            for s_, p_, i_ in zip(seq[lrows], pos[lrows], ids):
                if int(s_) not in last or int(p_) > last[int(s_)][0]:
                    last[int(s_)] = (int(p_), int(i_))
    out = []
    for s in np.unique(seq):
        m = seq == s
        p, k = pos[m], tok[m]
        order = np.argsort(p, kind="stable")
        p, k = p[order], k[order]
        up, first = np.unique(p, return_index=True)
        key = seqs[int(s)]
        dup = np.diff(p) == 0
        if (k[1:][dup] != k[:-1][dup]).any():
            raise TraceFileError(f"sequence {key} holds two different tokens at one position", path)
        if up[0] != 0 or up[-1] != len(up) - 1:
            missing = 0 if up[0] != 0 else int(up[np.flatnonzero(np.diff(up) != 1)[0]] + 1)
            raise TraceFileError(f"sequence {key} has no row at position {missing} (a radix-cache hit computes no "
                             "prefix rows): give the --outputs file record serve wrote instead", path)
        ids_ = [int(x) for x in k[first]]
        if int(s) in last and last[int(s)][0] == len(ids_) - 1:
            ids_.append(last[int(s)][1])
        out.append((key, ids_))
    if not out:
        raise TraceFileError("the serve trace holds no tokens", path)
    return out


def _load_draft(path: str, model):
    from .eagle3 import load_eagle3_draft

    try:
        draft = load_eagle3_draft(path)
    except (ValueError, OSError, KeyError) as e:
        raise RecordingError(f"cannot load the draft ({_first_line(e)})", path) from None
    p = next(model.parameters())
    return draft.to(p.device, p.dtype)


def eagle3_draft_reason(cfg: dict) -> str | None:
    """Why a config.json is an EAGLE-3 draft (None when it looks like a causal LM): an
    ``Eagle3`` architecture or speculators model type, or the draft's own keys
    (``draft_vocab_size``, ``eagle_config``) with the draft's single decoder layer."""
    archs = cfg.get("architectures")
    archs = [a for a in archs if isinstance(a, str)] if isinstance(archs, list) else []
    eagle = [a for a in archs if "eagle" in a.lower()]
    if eagle:
        return f"architecture {eagle[0]}"
    smt = cfg.get("speculators_model_type")
    if isinstance(smt, str) and smt.lower().startswith("eagle"):
        return f"speculators_model_type {smt}"
    keys = [k for k in ("draft_vocab_size", "eagle_config") if k in cfg]
    layers = cfg.get("num_hidden_layers")
    if keys and (layers is None or layers == 1):
        return f"{keys[0]} and {'one decoder layer' if layers == 1 else 'no num_hidden_layers'}"
    return None


def refuse_draft_as_model(path: str) -> None:
    """One clear line before anything is loaded when ``--model`` is an EAGLE-3 draft directory."""
    p = os.path.join(path, "config.json")
    if not os.path.isfile(p):
        return  # no directory or no config: _load_config says so
    # read here with the bounds of every JSON input, before transformers parses it unbounded
    cfg = read_json_file(p, "the model's config.json")
    why = eagle3_draft_reason(cfg) if isinstance(cfg, dict) else None
    if why is not None:
        raise UsageError(f"is an EAGLE-3 draft ({why}); --model takes the target model, pass the draft with --draft",
                         path)


def _load_config(path: str):
    from transformers import AutoConfig

    if not os.path.isdir(path):
        raise UsageError("model directory not found (give a local directory; nothing is downloaded)", path)
    try:
        return AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise RecordingError(f"cannot read the model config ({_first_line(e)})", path) from None


def _load_model(path: str, dtype: str, device: str):
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # our own bar (or none off a terminal), not HF's
    kw: dict[str, Any] = {"local_files_only": True, "dtype": getattr(torch, dtype) if dtype != "auto" else "auto"}
    try:
        model = AutoModelForCausalLM.from_pretrained(path, **kw)
    except (OSError, ValueError, KeyError, TypeError, RuntimeError) as e:
        raise RecordingError(f"cannot load the model ({_first_line(e)})", path) from None
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        model = model.to(device).eval()
    except (RuntimeError, AssertionError) as e:
        raise RecordingError(f"cannot move the model to {device} ({_first_line(e)})") from None
    return model


def _first_line(e: BaseException) -> str:
    s = str(e).strip().splitlines()
    return (s[0] if s else type(e).__name__)[:200]


class _Progress:
    """A rich progress bar on stderr when it is a terminal; nothing otherwise (NO_COLOR respected)."""

    def __init__(self, total_tokens: int, n_prompts: int, enabled: bool):
        self.bar = None
        if not enabled or not sys.stderr.isatty():
            return
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )
        console = Console(stderr=True, no_color=bool(os.environ.get("NO_COLOR")) or None)
        self.bar = Progress(TextColumn("recording"), BarColumn(), MofNCompleteColumn(), TextColumn("tokens"),
                            TimeElapsedColumn(), TimeRemainingColumn(), console=console, transient=True)
        self.task = self.bar.add_task("record", total=total_tokens)

    def __enter__(self):
        if self.bar is not None:
            self.bar.start()
        return self

    def advance(self, n: int) -> None:
        if self.bar is not None:
            self.bar.advance(self.task, n)

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.stop()


def wants_draft_input(args: argparse.Namespace) -> bool:
    """A draft input is recorded only where the command says what the draft reads: a recording
    of a model's own states (a port, a 2-layer model) gets no slots nobody asked for, and no
    default ids that do not fit it."""
    if args.no_draft_input:
        return False
    return bool(args.aux_ids or args.draft or args.draft_config or args.boundaries or args.convention
                or args.prepend_embed or args.hf_index_n_post_norm)


def run(args: argparse.Namespace) -> int:
    from . import user_module

    module_spec = user_module.is_spec(args.model)
    if module_spec:
        user_module.parse_spec(args.model)   # its form, before anything is imported
    if os.path.lexists(args.out) and not args.force:
        from ..safety import check_output_path

        # one of the inputs, or a directory: said as such first
        check_output_path(args.out, [args.prompts, getattr(args, "from_serve", None)], "--out")
        # a trace is evidence: never replaced silently (diff, likewise, never writes over an input)
        raise UsageError("exists; pass --force to overwrite it, or choose another --out", args.out)
    if not module_spec:
        refuse_draft_as_model(args.model)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import torch

    from ..safety import check_output_path
    from .core import Recorder, Sampling
    from .hf import HFExtractorRecorder, find_decoder, model_info, plan_draft_input

    out_dir = os.path.dirname(os.path.abspath(args.out))
    if not os.path.isdir(out_dir):
        raise UsageError("output directory does not exist", out_dir)
    # never overwrite an input (the prompts, the serve trace or outputs file it replays)
    check_output_path(args.out, [args.prompts, getattr(args, "from_serve", None)], "--out")
    if args.sample_every is not None and args.sample_every < 0:
        raise UsageError("--sample-every must be >= 0")
    if args.sample_every == 0 and not args.positions:
        raise UsageError("--sample-every 0 records only --positions: give some")
    zoom = None
    if getattr(args, "zoom", None) is not None:
        from ..names import parse_zoom
        try:
            zoom = parse_zoom(args.zoom)
        except ValueError as e:
            raise UsageError(str(e)) from None
    name_rules = list(getattr(args, "name_rule", None) or [])
    if name_rules:
        if zoom is None:
            raise UsageError("--name-rule names the modules of a --zoom: give --zoom too")
        from ..names import parse_user_rule
        for r in name_rules:
            try:
                parse_user_rule(r)
            except ValueError as e:
                raise UsageError(f"--name-rule: {e}") from None
    ids = args.aux_ids
    if args.topk is not None and args.topk < 0:
        raise UsageError("--topk must be >= 0")
    if args.draft and args.no_draft_input:
        raise UsageError("--draft runs the draft on draft_input: drop --no-draft-input")
    if args.draft and not os.path.isfile(os.path.join(args.draft, "config.json")):
        raise UsageError("draft directory not found or has no config.json", args.draft)
    if ids is None and (args.draft_config or args.draft):
        ids = _read_draft_ids(args.draft_config or os.path.join(args.draft, "config.json"))

    def tokenizer_loader():
        if module_spec:
            raise UsageError("a module: model has no tokenizer: give the prompts as token ids", args.prompts)
        from transformers import AutoTokenizer
        try:
            return AutoTokenizer.from_pretrained(args.model, local_files_only=True)
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise UsageError(f"text prompts need a tokenizer in the model directory ({_first_line(e)})",
                             args.model) from None

    cfg = None if module_spec else _load_config(args.model)
    prompts = (load_serve_sequences(args.from_serve) if args.from_serve
               else load_prompts(args.prompts, tokenizer_loader))
    if args.limit is not None:
        prompts = prompts[: max(0, args.limit)]
    if args.max_len is not None:
        if args.max_len < 1:
            raise UsageError("--max-len must be >= 1")
        prompts = [(k, v[: args.max_len]) for k, v in prompts]
    model = None
    if module_spec:   # a user's port: its config (when it has one) is the module's own
        model = user_module.build(args.model, args.dtype, args.device)
        cfg = getattr(model, "config", None)
    text_cfg = getattr(cfg, "get_text_config", lambda: cfg)()
    vocab = getattr(text_cfg, "vocab_size", None)
    for k, v in prompts:
        if vocab and max(v) >= vocab:
            raise SourceFileError(f"prompt {k} has token id {max(v)}, outside the model's vocabulary of {vocab}", args.prompts)

    rl = None   # --from-serve: (temperature, first generated position per request, per-request temperatures)
    if args.from_serve:
        from ..trace.rl import sampling_for
        sampling, first = serve_rl_info(args.from_serve)
        if args.temperature is not None and not (math.isfinite(args.temperature) and args.temperature >= 0):
            raise UsageError("--temperature must be a finite number >= 0")
        temp = args.temperature if args.temperature is not None else float((sampling or {}).get("temperature", 1.0))
        per = {} if args.temperature is not None or not sampling else {
            k: {"temperature": float(sampling_for(sampling, k).get("temperature", temp))}
            for k in (sampling.get("per_sequence") or {})}
        rl = (temp, first, per)
    elif getattr(args, "temperature", None) is not None:
        raise UsageError("--temperature is for --from-serve (the sampled tokens' log-probs)")
    if model is None:
        model = _load_model(args.model, args.dtype, args.device)
    try:
        info = model_info(model)
    except ValueError as e:
        raise RecordingError(str(e), args.model) from None
    n_layers = info["num_layers"]
    if zoom is not None and not 0 <= zoom < n_layers:
        raise UsageError(f"--zoom layer{zoom}: the model has decoder layers 0..{n_layers - 1}")
    plan = None
    if wants_draft_input(args):
        try:
            plan = plan_draft_input(args.convention or DEFAULT_CONVENTION, ids, n_layers, prepend_embed=args.prepend_embed,
                                    hf_index_n_post_norm=True if args.hf_index_n_post_norm else None,
                                    boundaries=args.boundaries)
        except ValueError as e:
            raise UsageError(str(e)) from None
        note = conventions.collision_note(plan)
        if note is not None:
            print(f"tensordiff: warning: {note}", file=sys.stderr)
    graft = None
    if getattr(args, "graft", None):
        from .zoom import Graft
        try:
            graft = Graft(model, args.graft, find_decoder(model)[2], n_layers)
        except ValueError as e:
            raise UsageError(str(e)) from None
        check_output_path(args.out, [graft.path], "--out")
    info["path"] = args.model if module_spec else os.path.abspath(args.model)
    sample = Sampling(every=args.sample_every, positions=frozenset(args.positions) if args.positions else None)
    meta = {"prompts": os.path.abspath(args.prompts or args.from_serve), "command": "record train",
            "from_serve": os.path.abspath(args.from_serve) if args.from_serve else None,
            "draft_plan": plan.as_attrs() if plan else None,
            "graft": {"from": graft.path, "state": graft.state} if graft is not None else None}
    wkw = {}
    if args.sketch_dim is not None:
        wkw["sketch_dim"] = args.sketch_dim
    if args.sketch_seed is not None:
        wkw["sketch_seed"] = args.sketch_seed
    import transformers
    try:
        rec = Recorder(args.out, side="train", producer=f"tensordiff record train (transformers {transformers.__version__})",
                       model=info, meta=meta, sample=sample, **wkw)
    except OSError as e:
        if graft is not None:
            graft.close()
        raise UsageError(f"cannot create the trace file ({_first_line(e)})", args.out) from None
    t0 = time.perf_counter()
    total = sum(len(v) for _, v in prompts)
    weights_doc = None
    try:
        if graft is not None:   # before the recorder's hooks: what they record is the grafted value
            graft.attach()
        try:
            draft = _load_draft(args.draft, model) if args.draft else None
            hf = HFExtractorRecorder(model, rec, plan, values=args.values, topk=args.topk, draft=draft, zoom=zoom,
                                     name_rules=name_rules)
        except ValueError as e:
            if str(e).startswith("--zoom"):
                raise UsageError(str(e)) from None
            raise RecordingError(str(e)) from None
        if rl is not None:
            from ..trace.rl import sampling_params, write_sampling
            from .hooks import weight_fingerprints
            write_sampling(rec.writer, sampling_params(temperature=rl[0], engine="trainer (transformers)",
                                                       per_sequence=rl[2] or None))
            # the weights stay as loaded for the whole recording, so their fingerprints (hashes
            # that release the GIL) are taken in a thread beside the forward passes and written
            # once the passes are done
            fp_pool = ThreadPoolExecutor(1, "tensordiff-weights")
            weights_doc = fp_pool.submit(weight_fingerprints, model)
            fp_pool.shutdown(wait=False)
        device = next(model.parameters()).device
        with _Progress(total, n_prompts=len(prompts), enabled=not args.no_progress) as bar:
            for key, toks in prompts:
                if graft is not None:
                    graft.set_sequence(key, toks)
                ids = torch.tensor(toks, dtype=torch.long)
                try:
                    if rl is None:
                        hf.run(key, ids)
                    else:
                        from .hooks import record_sampled_logprob
                        with hf.capture(key, ids) as rows, torch.inference_mode():
                            out = model(input_ids=ids[None].to(device), use_cache=False)
                        t = rl[2].get(key, {}).get("temperature", rl[0])
                        record_sampled_logprob(rec, out.logits[0], rows[0], ids, temperature=t,
                                               first_generated=rl[1].get(key))
                except ValueError as e:
                    if graft is None or not str(e).startswith("--graft"):
                        raise
                    raise UsageError(str(e)) from None
                bar.advance(len(toks))
        if weights_doc is not None:
            from .hooks import record_weights
            record_weights(rec, model, 0, event="train", doc=weights_doc.result())
    except BaseException as e:
        if weights_doc is not None and not weights_doc.cancel():
            weights_doc.exception()   # the thread reads the model: it ends before the recording does
        rec.close(e)
        raise
    finally:
        if graft is not None:
            graft.close()
    rec.close()
    dt = time.perf_counter() - t0
    size = os.path.getsize(args.out)
    print(f"recorded {len(prompts)} sequence(s), {total} tokens, {len(rec.defined)} tensors -> {args.out} "
          f"({size / 1e6:.1f} MB, {dt:.1f} s)")
    if plan is not None:
        line = (f"  draft_input slots [{', '.join(plan.fed)}] from ids {list(plan.raw_ids) if plan.raw_ids else 'default'} "
                f"under {plan.convention}")
        if plan.verifier:
            line += f"; extractor list [{', '.join(plan.captured)}], [:-1] leaves {plan.verifier} as the verifier state"
        if list(plan.fed) != list(plan.intended):
            line += f" (the ids alone select [{', '.join(plan.intended)}])"
        print(line)
    if graft is not None:
        print(f"  grafted {graft.state} from {graft.path} ({graft.grafted} token rows)")
    print(f"  catalog: embed..layer{n_layers} + final_norm (sketch + RMS; full values: "
          f"{', '.join(sorted(hf.value_labels, key=_order)) or 'none'})")
    return 0


def _order(label: str) -> float:
    from ..vocab import state_order
    return state_order(label)
