"""``tensordiff import``: convert SpecForge offline hidden states, speculators data files or an
SGLang dumper directory into a trace. torch is imported inside :func:`run` only."""

from __future__ import annotations

import argparse
import os

from ..errors import UsageError

FORMAT_CHOICES = ("auto", "specforge", "speculators", "sglang-dump", "vllm-hidden-states", "trtllm", "modelopt")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("sources", nargs="+", metavar="SRC",
                   help="[FORMAT] files or directories: SpecForge .ckpt/.ckpt.gz, speculators .pt or "
                        "hs_<index>.safetensors, an SGLang "
                        "DUMPER_DIR (or its <exp_name> subdirectory), vLLM extract_hidden_states .safetensors, "
                        "TensorRT-LLM saved hidden states .pt, Model-Optimizer collect_hidden_states .pt; a leading "
                        "format name (specforge, speculators, sglang-dump, vllm-hidden-states, trtllm, modelopt) "
                        "names the format like --format. Checked against specforge 0.2.0, speculators 0.9.0 "
                        "(vLLM 0.32.0) and nvidia-modelopt 0.47.0; a file with keys their layouts lack is refused")
    p.add_argument("--out", "-o", required=True, metavar="T.h5", help="trace file to write")
    p.add_argument("--format", default="auto", choices=FORMAT_CHOICES, help="input format (default: detected)")
    p.add_argument("--side", choices=("train", "serve", "other"),
                   help="side of the comparison (default: train for SpecForge/speculators, serve for SGLang dumps)")
    g = p.add_argument_group("what the hidden-state files hold (SpecForge, speculators)")
    g.add_argument("--aux-ids", type=int, nargs="+", metavar="ID",
                   help="the draft's aux layer ids the files were extracted with")
    g.add_argument("--convention", default=None,
                   help="how those ids map to states (default: specforge for SpecForge files, speculators-legacy "
                        "for speculators files; also boundary, hf, vllm, sglang-llama, ...)")
    g.add_argument("--prepend-embed", action="store_true",
                   help="speculators files from the legacy extractor whose list was [hs[0]] + [hs[id+1] ...]")
    g.add_argument("--labels", nargs="+", metavar="LABEL",
                   help="state labels of the packed slots (SpecForge) or of the whole list incl. the verifier "
                        "state (speculators), e.g. embed layer3 layer5 layer7; overrides --aux-ids")
    g.add_argument("--draft-config", metavar="FILE",
                   help="draft config.json: eagle_config.eagle_aux_hidden_state_layer_ids when --aux-ids is absent")
    g.add_argument("--num-layers", type=int, metavar="N", help="target model depth (for default ids and range checks)")
    g.add_argument("--hidden-size", type=int, metavar="H", help="target hidden size (checked against the files)")
    g = p.add_argument_group("SGLang dumps")
    g.add_argument("--rank", type=int, help="which rank's dumps (default: the lowest)")
    g.add_argument("--names", nargs="+", metavar="GLOB", help="import only dump names matching these globs")
    g.add_argument("--as", dest="as_labels", action="append", default=[], metavar="NAME=LABEL",
                   help="record dump NAME (as the trace would name it, e.g. hidden_states@layer_id=20) as the "
                        "state LABEL (layer21, final_norm): a catalog entry; repeatable")
    g.add_argument("--include-recompute", action="store_true", help="also import recompute-pass dumps")
    p.add_argument("--limit", type=int, metavar="N", help="import the first N files (steps for dumps) only")
    p.add_argument("--no-values", action="store_true", help="keep sketches + RMS only, no full values")


def run(args: argparse.Namespace) -> int:
    from ..safety import check_output_path, sanitize_for_terminal
    from .importers import import_files
    from .train_cli import _read_draft_ids

    as_labels = {}
    for item in args.as_labels or []:
        if "=" not in item:
            raise UsageError(f"--as {item!r}: expected NAME=LABEL")
        name, label = item.rsplit("=", 1)
        as_labels[name] = label
    ids = args.aux_ids
    if ids is None and args.draft_config:
        ids = _read_draft_ids(args.draft_config)
    sources = list(args.sources)
    fmt = args.format
    if sources and sources[0] in FORMAT_CHOICES[1:] and not os.path.exists(sources[0]):
        if fmt != "auto" and fmt != sources[0]:
            raise UsageError(f"format given twice: {sources[0]} and --format {fmt}")
        fmt = sources.pop(0)
        if not sources:
            raise UsageError(f"import {fmt}: give the files or directories to import")
    check_output_path(args.out, sources, "--out")
    from .importers import ENGINE_FORMATS, detect_engine_format, import_engine_files

    if fmt == "auto":
        fmt = detect_engine_format(sources) or "auto"
    if fmt in ENGINE_FORMATS:  # vLLM extract_hidden_states, TensorRT-LLM, Model-Optimizer
        res = import_engine_files(sources, args.out, fmt=fmt, side=args.side, aux_ids=ids, convention=args.convention,
                                  num_layers=args.num_layers, hidden_size=args.hidden_size, labels=args.labels,
                                  limit=args.limit, values=False if args.no_values else None)
        print(sanitize_for_terminal(res.summary(), keep="\n"))  # request ids come from the files
        return 0
    res = import_files(sources, args.out, fmt=fmt, side=args.side, aux_ids=ids,
                       convention=args.convention, num_layers=args.num_layers, hidden_size=args.hidden_size,
                       labels=args.labels, prepend_embed=args.prepend_embed, rank=args.rank, names=args.names,
                       as_labels=as_labels, include_recompute=args.include_recompute, limit=args.limit,
                       values=False if args.no_values else None)
    print(sanitize_for_terminal(res.summary(), keep="\n"))  # file and dump names are from the filesystem
    return 0
