"""Packed slots measure each other's noise where the two traces share no catalog state.

The case: a bf16 serve engine records the draft input only (no catalog), the train side records
float32. Nothing both sides share measures the noise, so the shallowest slot is judged against the
physical default; each deeper slot against the default scaled by how far the clean slots before it
sit above the default at their own depth (tensordiff/noise.py, "Packed slots"). The model is the
tiny DeepSeek-V3 of the vLLM tests (``VLLM_VARIANT``, random weights, latent 320) recorded by the
real train recorder in this process: float32 with its catalog on one side, bfloat16 with
``draft_input`` only on the other (what ``record serve --engine vllm`` writes without
``--catalog``; vLLM itself runs this model only on a CPU with AMX tiles, tests/test_vllm_deepseek.py).
Its bf16 error sits 2.2x the default at layer1 and 3.5x at layer3: the deeper slots read as a
divergence against the default alone. Every case in both argument orders.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import trained

import deepseek_support as ds
from tensordiff.diff import diff_traces
from tensordiff.trace import TraceReader

pytestmark = pytest.mark.torch

IDS = [1, 2, 3]
_rng = np.random.default_rng(7)
PROMPTS = [_rng.integers(1, 256, 44).tolist(), _rng.integers(1, 256, 13).tolist()]
TRAIN, SERVE = "[embed, layer1, layer2]", "[layer1, layer2, layer3]"
FOUNDING = {"train-serve": f"train feeds draft_input {TRAIN}, serve feeds {SERVE}; the draft was trained on train's",
            "serve-train": f"serve feeds draft_input {SERVE}, train feeds {TRAIN}; the draft was trained on train's"}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("noise-slots")
    target = ds.make_tiny_deepseek(tmp / "tiny-deepseek-v", **ds.VLLM_VARIANT)
    return {
        "tmp": tmp,
        "ok": ds.record_hf(target, tmp / "train-ok.h5", PROMPTS, IDS),
        "bug": ds.record_hf(target, tmp / "train-bug.h5", PROMPTS, [0, 1, 2], convention="speculators-legacy",
                            prepend_embed=True),
        "serve": ds.record_hf(target, tmp / "serve.h5", PROMPTS, IDS, dtype="bfloat16", catalog=False,
                              side="serve"),
    }


def _orders(a, b):
    """(result, which argument B's trace is) for both argument orders."""
    return [(diff_traces(str(a), str(b)), "b"), (diff_traces(str(b), str(a)), "a")]


def _slots(path):
    with TraceReader(path) as r:
        info = r.tensors["draft_input"]
        return r.read_values("draft_input").astype(np.float64), int(info.slot_width)


def _tolerances(res):
    (p,) = [p for p in res.pairs if p.label == "draft_input"]
    return [(t["min_cos"], t["max_rel"]) for t in p.tolerance]


def test_correct_wiring_agrees_without_a_shared_catalog(run):
    """bf16 draft input only against float32: every slot holds what the other side holds and no
    slot is a divergence. Against the physical default alone slots 1 and 2 read "numeric drift"
    (median rel err 0.02 > 0.019, 0.028 > 0.023)."""
    for res, _ in _orders(run["ok"], run["serve"]):
        assert res.exit_code == 0, res.headline()
        assert [r.verdict for r in res.slot_table] == ["ok"] * 3, res.headline()
        (p,) = [p for p in res.pairs if p.label == "draft_input"]
        assert all(t["source"].endswith("scaled to the slots before it") for t in p.tolerance), p.tolerance


def test_founding_bug_still_named(run):
    """The off-by-one wiring (train feeds [embed, layer1, layer2]): named in the first line. Its
    slot 0 (embed against layer1) is far out of the default, so no slot measures a trend."""
    for order, (a, b) in (("train-serve", (run["bug"], run["serve"])), ("serve-train", (run["serve"], run["bug"]))):
        p = subprocess.run([sys.executable, "-m", "tensordiff", "diff", str(a), str(b)], capture_output=True,
                           text=True, timeout=600)
        assert p.returncode == 1 and p.stdout.splitlines()[0] == FOUNDING[order], p.stdout[:800] + p.stderr[-800:]


@pytest.mark.parametrize("slot", [0, 1, 2])
def test_a_state_moved_toward_its_neighbour_is_named_at_that_slot(run, slot):
    """B's slot moved toward a neighbouring slot's state (a wrong state close to the claimed one)
    by 2, 3 and 6 times the median error the correct pair shows there: a divergence at that slot,
    never an agree, and the slots before it keep the allowance the correct pair gives them (a
    bug never widens an allowance before it)."""
    a, H = _slots(run["ok"])
    b, _ = _slots(run["serve"])
    x, y = a[:, slot * H:(slot + 1) * H], b[:, slot * H:(slot + 1) * H]
    noise = np.median(np.linalg.norm(y - x, axis=1) / np.linalg.norm(x, axis=1))
    other = 1 if slot == 0 else slot - 1
    d = b[:, other * H:(other + 1) * H] - y
    toward = d / np.linalg.norm(d, axis=1, keepdims=True) * np.linalg.norm(y, axis=1, keepdims=True)
    clean = {side: _tolerances(res) for res, side in _orders(run["ok"], run["serve"])}
    for size in (2.0, 3.0, 6.0):
        def move(v, seq, pos, size=size):
            v[:, slot * H:(slot + 1) * H] += (size * noise * toward).astype(np.float32)
            return v

        bug = trained.edit(run["serve"], run["tmp"] / f"moved-{slot}-{size:g}.h5", "draft_input", move)
        for res, side in _orders(run["ok"], bug):
            f = res.first_divergence
            assert res.exit_code == 1 and f is not None, (size, side, res.headline())
            assert (f.tensor, f.slot) == ("draft_input", slot), (size, side, f.message)
            assert _tolerances(res)[:slot] == clean[side][:slot], (size, side)
