"""Frozen ``tensordiff diff --json`` outputs of a representative set of trace pairs, in both
argument orders: what a change to the diff's internals must leave byte for byte as it was.

Regenerate (a deliberate change of verdicts or numbers, reviewed in the diff of these files)::

    .venv/bin/python tests/golden/make_golden.py            # every case
    .venv/bin/python tests/golden/make_golden.py CASE ...   # some cases

Outputs that depend on the machine: the pairs written by torch models, and the sketches numpy
derives at diff time, carry the float32 rounding of the CPU's matrix products (OpenBLAS and torch
pick their kernels by CPU: AVX-512 and AVX2 machines round differently), so a few cases give other
numbers, and in bf16 another order of near-tied worst tokens, on another kind of machine. The
verdicts are the same. The files here are what the AVX-512 machines this project ran on give;
``variants/TAG/`` holds a case's outputs as another kind of machine gives them (only where they
differ; ``avx2``: an AMD EPYC with AVX2 and no AVX-512), each reviewed against the main file. The
``example`` case's files are an AMD EPYC's with AVX-512 whose OpenBLAS is held to its Haswell
kernels by ``OPENBLAS_CORETYPE`` (the machine CI now runs on); its ``avx2`` variant went with the
noise model's change of allowances, and is to be written again on such a machine::

    .venv/bin/python tests/golden/make_golden.py --variant TAG [CASE ...]   # TAG: e.g. avx2

``tests/test_golden.py`` writes each pair again and compares: the output must equal the main
file or one of its variants byte for byte. The pairs are the ones the test
suite writes (tests/tracegen.py, tests/setgen.py, tests/hf_traces.py, the acceptance and
identity-overlap tests' writers) and the committed ``traces/``; paths are normalised
(``<tmp>`` for the directory a pair is written to, ``<root>`` for the repository), so the files
do not depend on where they were made.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(HERE)
ROOT = os.path.dirname(TESTS)
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)

Pair = tuple[str, str]


@dataclass
class Case:
    name: str
    make: Callable[[str], Pair]       # writes the pair into a directory, returns (A, B)
    options: dict[str, Any] = field(default_factory=dict)   # DiffOptions fields
    torch: bool = False               # needs torch (tests/hf_traces.py)


# -- writers -----------------------------------------------------------------------------------


def _example(d: str) -> Pair:
    return os.path.join(ROOT, "traces", "train.h5"), os.path.join(ROOT, "traces", "serve.h5")


def _tracegen(which: str) -> Callable[[str], Pair]:
    def make(d: str) -> Pair:
        from tracegen import write_verdict_pairs
        return write_verdict_pairs(d)[which]
    return make


def _killed_writer(path: str) -> None:
    from tracegen import write_trace
    write_trace(path, side="serve", seed=1, noise=1e-6, flush_rows=8, close=False)
    os._exit(0)   # no close: the trace keeps what its last flush committed


def _recovered(d: str) -> Pair:
    from tracegen import write_trace
    a, b = os.path.join(d, "a.h5"), os.path.join(d, "b.h5")
    write_trace(a, side="train")
    p = multiprocessing.get_context("fork").Process(target=_killed_writer, args=(b,))
    p.start()
    p.join()
    return a, b


def _eagle(**kw_b: Any) -> Callable[[str], Pair]:
    def make(d: str) -> Pair:
        from tracegen import write_eagle
        a, b = os.path.join(d, "a.h5"), os.path.join(d, "b.h5")
        kw_a = {k: v for k, v in kw_b.items() if k in ("sketches", "refs", "sketch_only")}
        write_eagle(a, side="train", **kw_a)
        write_eagle(b, side="serve", seed=1, noise=1e-3, **kw_b)
        return a, b
    return make


def _set(layout: dict[str, Any], **rec_kw: Any) -> Callable[[str], Pair]:
    def make(d: str) -> Pair:
        import numpy as np
        from setgen import make_recording, write, write_ranks
        a = write(os.path.join(d, "train.h5"), make_recording("train"))
        lay = dict(layout)
        tweak = lay.pop("tweak", None)
        if tweak is not None:
            tweak = {k: {key: np.float32(v) for key, v in t.items()} for k, t in tweak.items()}
        write_ranks(os.path.join(d, "serve"), make_recording("serve", noise=1e-6, seed=1, **rec_kw), tweak=tweak,
                    **lay)
        return a, os.path.join(d, "serve")
    return make


def _overlap(at: int, kind: str) -> Callable[[str], Pair]:
    def make(d: str) -> Pair:
        import test_identity_overlap as t
        from pathlib import Path
        brk = {"shift": t._shift, "from_on": t._from_on}[kind](at) if kind != "noise" else t._noise(at)
        return t._pair(Path(d), kind, brk)
    return make


def _acceptance(**kw_b: Any) -> Callable[[str], Pair]:
    def make(d: str) -> Pair:
        import test_acceptance as t
        a = t._write(os.path.join(d, "a.h5"), side="train")
        b = t._write(os.path.join(d, "b.h5"), side="serve", steps=t.STEPS, **kw_b)
        return str(a), str(b)
    return make


TRAIN_SLOTS = ["embed", "layer3", "layer5"]


def _hf(slots_b: list[str] | None = None, *, seqs_b: Callable[[list[list[int]]], list[list[int]]] | None = None,
        **kw_b: Any) -> Callable[[str], Pair]:
    def make(d: str) -> Pair:
        import hf_traces as h
        model = h.near_residual_llama(8)
        seqs = h.prompts()
        a, b = os.path.join(d, "train.h5"), os.path.join(d, "serve.h5")
        h.write_trace(a, model, seqs, TRAIN_SLOTS, side="train")
        kw = dict(kw_b)
        if kw.get("dtype") == "bfloat16":
            kw["dtype"] = h.torch.bfloat16
        if slots_b is not None and "claims" not in kw:
            kw["claims"] = TRAIN_SLOTS
        h.write_trace(b, model, seqs_b(seqs) if seqs_b else seqs, slots_b or TRAIN_SLOTS, side="serve", **kw)
        return a, b
    return make


def _one_token_changed(seqs: list[list[int]]) -> list[list[int]]:
    out = [list(s) for s in seqs]
    out[1][7] = (out[1][7] + 1) % 100 + 1
    return out


CASES: list[Case] = [
    Case("example", _example),
    Case("tracegen_agree", _tracegen("agree")),
    Case("tracegen_wrong", _tracegen("wrong"), {"block_rows": 16}),
    Case("tracegen_noisy", _tracegen("noisy")),
    Case("recovered", _recovered),
    Case("eagle_wrong", _eagle(wrong=True), {"block_rows": 100}),
    Case("eagle_refs_derived", _eagle(sketches=False, refs=True)),
    Case("eagle_sketch_only", _eagle(sketch_only=("layer1",))),
    Case("set_dp2_pp2_tp2", _set({"dp": 2, "pp": 2, "tp": 2})),
    Case("set_replica", _set({"dp": 2, "tp": 2, "tweak": {".dp1.tp1": {("layer2", "s5", 3): 0.05}}})),
    Case("set_drift_wrong_slot", _set({"dp": 2, "tp": 2, "tp_replicated": False}, drift=True, wrong_slot=True)),
    Case("overlap_shift", _overlap(3, "shift")),
    Case("overlap_from_on", _overlap(5, "from_on")),
    Case("overlap_noise", _overlap(4, "noise")),
    Case("acceptance_agree", _acceptance()),
    Case("acceptance_fc", _acceptance(fc_scale=0.5)),
    Case("acceptance_target", _acceptance(target_noise=3.0)),
    Case("hf_bf16", _hf(dtype="bfloat16"), torch=True),
    Case("hf_wrong_slot", _hf(["embed", "layer4", "layer5"]), torch=True),
    Case("hf_mislabeled", _hf(["embed", "layer4", "layer5"], claims=["embed", "layer4", "layer6"]), torch=True),
    Case("hf_scaled", _hf(["embed", "norm(layer3)", "layer5"]), torch=True),
    Case("hf_slot_shift", _hf(slot_shift=1), torch=True),
    Case("hf_shift", _hf(shift=1), torch=True),
    Case("hf_gap", _hf(drop=3, drop_tail=2), torch=True),
    Case("hf_nonfinite", _hf(nan_at=("layer3", 1, 5)), torch=True),
    Case("hf_token_mismatch", _hf(seqs_b=_one_token_changed), torch=True),
    Case("hf_incomplete", _hf(packed_values=False, sketch_seed=123), torch=True),
    Case("hf_pairing_offset", _hf(packed=("draft_input", "draft_input", 0)), torch=True),
    Case("hf_slot_count", _hf(["embed", "layer3"], claims=["embed", "layer3"]), torch=True),
    Case("hf_partial_catalog", _hf(["embed", "layer4", "layer5"], catalog_positions=10), {"identity_sample": 32},
         torch=True),
]
CASES_BY_NAME = {c.name: c for c in CASES}
ORDERS = ("ab", "ba")


VARIANTS = os.path.join(HERE, "variants")


def golden_path(name: str, order: str) -> str:
    return os.path.join(HERE, f"{name}.{order}.json")


def variant_paths(name: str, order: str) -> list[str]:
    """The case's outputs as other kinds of machine give them (``variants/TAG/``), by tag."""
    if not os.path.isdir(VARIANTS):
        return []
    found = (os.path.join(VARIANTS, tag, f"{name}.{order}.json") for tag in sorted(os.listdir(VARIANTS)))
    return [p for p in found if os.path.isfile(p)]


def write_pair(case: Case, d: str) -> Pair:
    return case.make(d)


def normalise(text: str, d: str) -> str:
    """The JSON with the pair's directory as ``<tmp>`` and the repository as ``<root>``."""
    for real in {d, os.path.realpath(d)}:
        text = text.replace(json.dumps(real)[1:-1], "<tmp>")
    return text.replace(json.dumps(ROOT)[1:-1], "<root>")


def diff_json(a: str, b: str, options: dict[str, Any]) -> str:
    """What ``tensordiff diff A B --json`` prints (the CLI's own serialisation)."""
    from tensordiff.cli import jsonable
    from tensordiff.diff import DiffOptions, diff_traces
    res = diff_traces(a, b, DiffOptions(**options))
    return json.dumps(jsonable(res.to_dict()), indent=2) + "\n"


def outputs(case: Case) -> dict[str, str]:
    """The normalised JSON of a case's pair in both orders (written to a fresh directory)."""
    with tempfile.TemporaryDirectory(prefix="tensordiff-golden-") as d:
        a, b = write_pair(case, d)
        return {"ab": normalise(diff_json(a, b, case.options), d), "ba": normalise(diff_json(b, a, case.options), d)}


def main(argv: list[str]) -> int:
    variant = None
    if argv[:1] == ["--variant"]:
        if len(argv) < 2 or not argv[1].replace("-", "").isalnum():
            print("--variant needs a tag of letters, digits and dashes, e.g. avx2", file=sys.stderr)
            return 2
        variant, argv = argv[1], argv[2:]
    names = argv or [c.name for c in CASES]
    unknown = [n for n in names if n not in CASES_BY_NAME]
    if unknown:
        print(f"unknown case(s): {', '.join(unknown)}; cases: {', '.join(CASES_BY_NAME)}", file=sys.stderr)
        return 2
    for n in names:
        for order, text in outputs(CASES_BY_NAME[n]).items():
            path = golden_path(n, order)
            if variant is not None:
                # a variant holds only what differs from the main file
                with open(path, encoding="utf-8") as f:
                    same = f.read() == text
                path = os.path.join(VARIANTS, variant, os.path.basename(path))
                if same:
                    if os.path.exists(path):
                        os.remove(path)
                    print(f"{n} ({order}): as the main file")
                    continue
                os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
            print(f"{n} ({order}): written to {os.path.relpath(path, HERE)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
