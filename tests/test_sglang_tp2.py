"""SGLang with two TP ranks on the CPU, recorded by the real ``tensordiff record serve --tp-size 2``:
every rank writes its own file, the files read as one trace, the replicas are equal bit for bit,
and the set names the founding bug and agrees on correct wiring as a single file does.

Stand-ins, as in every SGLang test here: SGLang's CPU kernels (``sgl_kernel``) are the test-only
pure-torch package ``tests/sgl_kernel_stub``. And this venv's torch is a CUDA build that carries
NCCL, which SGLang's TP group would load for CPU tensors (``ValueError: Expected a cuda device, but
got: cpu``): ``SGLANG_NCCL_SO_PATH`` names no library, so SGLang runs its CPU all-reduce over gloo,
as it does with a CPU-only torch. One engine start; capture-only mode (ids [0, 1, 2] = boundaries
layer1..layer3 under SGLang's llama convention) with the catalog.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

import sglang_support as sup  # noqa: E402
import recordings as recs  # noqa: E402

MAX_NEW = 6
_rng = np.random.default_rng(3)
PROMPTS = {"A": _rng.integers(1, 256, 40).tolist(), "B": _rng.integers(1, 256, 9).tolist()}
assert PROMPTS == recs.RANKS_PROMPTS    # what the recording of this module was given

needs_sglang = pytest.mark.skipif(not sup.sglang_available(), reason="real SGLang (and torch) not installed")
pytestmark = [pytest.mark.sglang, pytest.mark.slow, needs_sglang]


def _td(*args, env=None):
    e = env or {k: v for k, v in os.environ.items() if not k.startswith("TENSORDIFF_")}
    e.setdefault("PYTHONPATH", str(REPO))
    return subprocess.run([sys.executable, "-m", "tensordiff", *map(str, args)], capture_output=True, text=True,
                          cwd=REPO, env=e, timeout=900)


@pytest.fixture(scope="module")
def run(recorded):
    """SGLang at TP=2 on the 4-layer head_dim-64 Llama of the vLLM rank tests, and train traces of
    the founding bug and the correct wiring (tests/recordings.py)."""
    got = recorded(recs.SGLANG_TP2)
    refs = recorded(recs.VLLM_RANKS_MODELS)["refs"]
    outs = {o["id"]: o for o in map(json.loads, Path(got["outputs"]).read_text().splitlines())}
    return {"dir": Path(got["dir"]), "stdout": Path(got["stdout"]).read_text(), "outputs": outs,
            "refs": {k: r[:MAX_NEW] for k, r in refs.items()}, "train": {k: Path(v) for k, v in got["train"].items()}}


def test_every_sglang_tp_rank_writes_its_own_file_and_the_replicas_are_equal(run):
    from tensordiff.traceset import TraceSet

    assert sorted(os.listdir(run["dir"])) == ["serve.tp0.h5", "serve.tp1.h5"]
    for k in PROMPTS:  # SGLang at TP=2 generated what HF generates
        assert run["outputs"][k]["output_ids"] == run["refs"][k], k
    assert "trace set: 2 files, 1 token shard (TP=2)" in run["stdout"], run["stdout"]
    with TraceSet(str(run["dir"])) as s:
        assert [f["ranks"]["tp"] for f in s.index()["files"]] == [0, 1]
        assert {m.host for m in s.members} == {socket.gethostname()}
        assert s.check_replicas() == []
        reps = {r["tensor"] for r in s.index()["replicas"]}
    assert {"aux_hidden_states", "embed", "layer3", "final_norm"} <= reps, reps


@pytest.mark.parametrize("order", ["train_serve", "serve_train"])
def test_the_sglang_set_names_the_founding_bug_and_agrees_on_correct_wiring(run, order):
    pair = (run["train"]["bug"], run["dir"]) if order == "train_serve" else (run["dir"], run["train"]["bug"])
    proc = _td("diff", *pair)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    first = proc.stdout.splitlines()[0]
    want = ("train feeds aux_hidden_states [embed, layer1, layer2], serve feeds [layer1, layer2, layer3]"
            if order == "train_serve"
            else "serve feeds draft_input [layer1, layer2, layer3], train feeds [embed, layer1, layer2]")
    assert first == f"{want}; the draft was trained on train's", proc.stdout[:800]
    pair = (run["train"]["ok"], run["dir"]) if order == "train_serve" else (run["dir"], run["train"]["ok"])
    proc = _td("diff", *pair)
    assert proc.returncode == 0 and proc.stdout.startswith("no divergence"), proc.stdout[:2000] + proc.stderr[-2000:]
