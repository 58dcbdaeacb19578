"""benchmarks/bench_rl_decode.py judges recorded pairs (``--rediff``) and prints its table. The
pairs here are the HF stand-ins of tests/rl_support.py (HF as the engine, not SGLang): a correct
rollout and its prefill replay, and a rollout whose decode passes read a KV cache stored in bf16
(a decode-path bug from layer1 on). The real-engine sweep is the bench itself (docs/benchmarks.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

import rl_support as rs  # noqa: E402
import trained  # noqa: E402

pytestmark = pytest.mark.torch


def test_rediff_counts_false_alarms_and_finds_the_bug_at_its_layer(tmp_path):
    fp32 = trained.load_target(torch.float32)
    prompts = trained.prompts()[:4]
    pairs = []
    for name, kw in (("correct", {}), ("kv", {"kv_dtype": torch.bfloat16})):
        r = rs.rollout(tmp_path / f"{name}.rollout.h5", fp32, prompts=prompts, new_tokens=6, **kw)
        p = rs.replay(tmp_path / f"{name}.replay.h5", fp32, r)
        pairs.append({"name": f"{name} (HF stand-in)", "rollout": str(r), "replay": str(p),
                      "bug": {"layer": 0, "scale": 1.0} if kw else None})
    (tmp_path / "pairs.json").write_text(json.dumps(pairs))
    env = {k: v for k, v in os.environ.items() if not k.startswith("TENSORDIFF_")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]])
    out = tmp_path / "res.json"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_rl_decode.py"), "--rediff", str(tmp_path),
                           "--json", str(out)], capture_output=True, text=True, env=env, cwd=REPO, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "correct pairs: 0 false alarms in 2 diffs; bugs: 2 of 2 found at their layer" in proc.stdout, proc.stdout
    fig = json.loads(out.read_text())["figures"]
    assert fig["false_alarms"] == 0 and fig["correct_diffs"] == 2 and fig["found"] == 2 and fig["bug_diffs"] == 2
    assert fig["l0_x1_rollout_vs_replay_found"] is True and fig["l0_x1_replay_vs_rollout_found"] is True
    assert fig["l0_x1_rollout_vs_replay_x_noise"] > 1
