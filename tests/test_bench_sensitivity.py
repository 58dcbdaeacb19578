"""benchmarks/bench_sensitivity.py runs (``--quick``: HF recordings, short magnitude lists) and
prints its tables. Only that: the verdict's own assertions live with the verdict's tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_quick_sensitivity_run_prints_its_tables(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TENSORDIFF_")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]])
    out = tmp_path / "res.json"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_sensitivity.py"), "--quick",
                           "--dir", str(tmp_path / "work"), "--json", str(out)],
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = proc.stdout
    for head in ("## noise floor per state", "## cases", "## detection rate by magnitude", "## by kind"):
        assert head in text, text[-3000:]
    for kind in ("scale-const", "scale-token", "mixed", "norm", "partial", "duplicate", "weight", "correct"):
        assert f"| {kind} |" in text, kind
    assert "false alarms:" in text
    fig = json.loads(out.read_text())["figures"]
    assert fig["correct_runs"] >= 8 and fig["bug_runs"] > 0 and isinstance(fig["false_alarms"], int)


def _bench():
    import importlib

    sys.path.insert(0, str(REPO / "benchmarks"))
    return importlib.import_module("bench_sensitivity")


@pytest.mark.slow
def test_each_op_kind_at_one_depth_is_named_by_its_signature(tmp_path):
    """One bug of each op kind in decoder layer 3 of the trained model (bf16, against fp32), the
    whole bug of each: the zoom into layer 3 leads with the kind's tap and signature in both
    orders, and the plain diff with the boundary after it; the activation swap, whose effect on
    mlp_out and after stays inside the bf16 noise, is a note naming the activations (exit 0). The
    correct pair zoomed into the same layer agrees in both orders."""
    bs = _bench()
    got = bs._trained(8)
    if got is None:
        pytest.skip("no trained tiny model")
    model, prompts = got
    pfile = tmp_path / "prompts.jsonl"
    pfile.write_text("".join(json.dumps({"id": k, "input_ids": v}) + "\n" for k, v in prompts.items()))
    k = 3
    refs = {"fp32": bs.record_hf(model, pfile, "float32", tmp_path / "fp32.h5"),
            "bf16": bs.record_hf(model, pfile, "bfloat16", tmp_path / "bf16.h5"),
            "fp32-z": bs.zoomed(model, pfile, "float32", tmp_path, k),
            "bf16-z": bs.zoomed(model, pfile, "bfloat16", tmp_path, k)}
    for order in ((refs["fp32-z"], refs["bf16-z"]), (refs["bf16-z"], refs["fp32-z"])):
        r = bs._judge(*map(str, order))
        assert r["rc"] == 0, r["headline"]
    for kind in bs.OP_KINDS:
        r = bs.op_case(tmp_path, model, pfile, refs, kind, k, bs.OP_SIZES[kind][-1])
        for o in ("AB", "BA"):
            if kind == "activation":
                assert r[o]["zrc"] == 0 and r[o]["note"], (kind, o, r[o]["zheadline"])
                assert "silu" in r[o]["zheadline"] and "gelu_pytorch_tanh" in r[o]["zheadline"], r[o]["zheadline"]
            else:
                assert r[o]["named"], (kind, o, r[o]["headline"])
                assert r[o]["sig"], (kind, o, r[o]["zheadline"])
