"""`TENSORDIFF_GRAFT=train.h5:STATE` in the SGLang plugin: the trained tiny Llama served by real
SGLang on the CPU (EAGLE-3, its draft) with one weight changed in the engine's copy (layer 3's up
projection x 1.05). HF's trace of the same sequences names layer4; with layer4 taken from HF in the
engine's forward nothing after it diverges (the cause is inside layer 3); with layer3 taken from
HF (before the cause) the divergence stays."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest

import recordings as recs
import sglang_support as sup

LAYER = 3


def _serve(target, draft, prompts, out_dir, name, graft=None):
    out_dir.mkdir(parents=True, exist_ok=True)
    pfile = sup.write_prompts(out_dir / f"{name}-prompts.jsonl", prompts)
    trace, outputs = out_dir / f"{name}.h5", out_dir / f"{name}.jsonl"
    argv = [sys.executable, "-c", sup.EAGLE_RUNNER.format(tests=str(sup.HERE)), "--model", str(target),
            "--draft", str(draft), "--prompts", str(pfile), "--out", str(trace), "--outputs", str(outputs),
            "--max-new-tokens", "4", "--batch-size", "2", "--device", "cpu", "--dtype", "float32",
            "--chunked-prefill-size", "32", "--mem-fraction-static", "0.3", "--max-total-tokens", "2048",
            "--log-level", "error", "--attention-backend", "intel_amx", "--catalog", "--values", "all"]
    env = sup.engine_env()
    if graft is not None:
        env["TENSORDIFF_GRAFT"] = graft
    proc = subprocess.run(argv, check=False, capture_output=True, text=True, env=env, cwd=sup.REPO, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"SGLang serve run failed ({proc.returncode}): {proc.stdout[-2000:]}{proc.stderr[-3000:]}")
    return sup.load_serve_run(trace, outputs)


@pytest.fixture(scope="module")
def runs(recorded):
    if sup.trained_models(0) is None:
        pytest.skip("no trained model (scripts/train_tiny_models.py)")
    m = recorded(recs.TRAINED_CHANGED)
    return SimpleNamespace(prompts=m["prompts_by_id"], changed=m["changed"], draft=m["draft"],
                           train=recorded(recs.GRAFT_TRAIN)["trace"], serve=recorded(recs.GRAFT_CHANGED)["trace"],
                           target=m["target"])


def _graft_note(doc):
    return next(f for f in doc["findings"] if f["kind"] == "signature" and f["details"]["signature"] == "graft")


@pytest.mark.slow
@pytest.mark.sglang
@pytest.mark.torch
@pytest.mark.skipif(not sup.sglang_available(), reason="SGLang not installed")
def test_graft_in_sglang_confirms_the_cause_is_inside_layer3(runs, recorded):
    rc, doc, err = sup.diff_json(runs.train, runs.serve)
    assert doc is not None, err
    print(doc["headline"])
    assert rc == 1 and doc["first_divergence"]["tensor"] == f"layer{LAYER + 1}", doc["headline"]

    after = recorded(recs.GRAFT_LAYER4)   # TENSORDIFF_GRAFT=train.h5:layer4
    from tensordiff.trace import TraceReader

    import h5py

    with TraceReader(after["trace"]) as r:
        assert r.user_meta["graft"]["state"] == f"layer{LAYER + 1}"
        rows = len(r.token_rows(f"layer{LAYER + 1}"))
    with h5py.File(after["trace"], "r") as f:
        stats = f.attrs["tensordiff_sglang"]
        stats = json.loads(stats) if isinstance(stats, (str, bytes)) else stats
    print("graft stats", stats["graft"], "recorded rows", rows)
    assert stats["graft"]["rows"] >= rows > 0   # every recorded row grafted (verify blocks graft more)
    rc, doc, err = sup.diff_json(runs.train, after["trace"])
    assert doc is not None, err
    note = _graft_note(doc)
    print(doc["headline"], "|", note["message"])
    assert "nothing after it diverges" in note["message"], note["message"]
    assert "inside decoder layer 3" in note["details"]["cause"], note
    assert rc == 0, doc["headline"]

    before = recorded(recs.GRAFT_LAYER3)   # TENSORDIFF_GRAFT=train.h5:layer3
    rc, doc, err = sup.diff_json(runs.train, before["trace"])
    assert doc is not None, err
    note = _graft_note(doc)
    print(doc["headline"], "|", note["message"])
    assert "still diverge" in note["message"], note["message"]
    assert rc == 1 and doc["first_divergence"]["tensor"] == f"layer{LAYER + 1}", doc["headline"]


@pytest.mark.slow
@pytest.mark.sglang
@pytest.mark.torch
@pytest.mark.skipif(not sup.sglang_available(), reason="SGLang not installed")
def test_bad_graft_is_one_line_before_the_engine_starts(runs, tmp_path):
    pfile = sup.write_prompts(tmp_path / "p.jsonl", runs.prompts)
    for spec, words in ((f"{runs.train}:layer{LAYER}.mlp_up", f"no tensor layer{LAYER}.mlp_up"),
                        (f"{tmp_path / 'none.h5'}:layer4", "cannot read"),
                        ("layer4", "OTHER.h5:STATE"),
                        (f"{runs.train}:embed", "SGLang grafts a boundary layer1..")):
        env = {**sup.tensordiff_env(), "TENSORDIFF_GRAFT": spec}
        proc = subprocess.run([sys.executable, "-m", "tensordiff", "record", "serve", "--model", str(runs.changed),
                               "--prompts", str(pfile), "--out", str(tmp_path / "x.h5"), "--device", "cpu"],
                              check=False, capture_output=True, text=True, env=env, cwd=sup.REPO, timeout=300)
        err = [ln for ln in proc.stderr.splitlines() if ln.strip()]
        assert proc.returncode == 2, (spec, proc.stdout[-2000:], proc.stderr[-2000:])
        assert len(err) == 1 and words in err[0] and "TENSORDIFF_GRAFT" in err[0], (spec, err)
        assert not (tmp_path / "x.h5").exists()


@pytest.mark.slow
@pytest.mark.sglang
@pytest.mark.torch
@pytest.mark.skipif(not sup.sglang_available(), reason="SGLang not installed")
def test_served_tokens_the_graft_lacks_stop_the_recording_in_one_line(runs, tmp_path):
    """The same request ids with other tokens: the first prefill row is refused, never served ungrafted
    into a trace that says it was grafted."""
    other = {k: list(reversed(v)) for k, v in runs.prompts.items()}
    with pytest.raises(RuntimeError) as e:
        _serve(runs.changed, runs.draft, other, tmp_path, "refused", graft=f"{runs.train}:layer{LAYER + 1}")
    msg = str(e.value)
    assert "recording_error" in msg and "ValueError: TENSORDIFF_GRAFT:" in msg and "has no row of layer4 for request" in msg, msg


class _Src:
    """A graft source of two sequences (p0: tokens 5 6 7 8, p1: 5 6 9) without a trace file."""

    path, state = "other.h5", "layer4"

    def __init__(self):
        rows = [("p0", 0, 5), ("p0", 1, 6), ("p0", 2, 7), ("p0", 3, 8), ("p1", 0, 5), ("p1", 1, 6), ("p1", 2, 9)]
        self.index = {(k, p): (i, t) for i, (k, p, t) in enumerate(rows)}


def _keys(segs, pos, ids, regime="extend"):
    return SimpleNamespace(segs=segs, pos=np.asarray(pos), ids=np.asarray(ids), regime=regime)


def test_rows_are_matched_by_the_requests_tokens():
    from tensordiff.recorders.sglang.graft import EngineGraft

    g = EngineGraft(_Src(), "layer", 8)
    # a request id the trace does not have: matched by its tokens (both sequences start 5 6)
    assert g.rows_of(_keys([("r", 0, 2)], [0, 1], [5, 6])) == ([0, 1], [0, 1])
    assert g.rows_of(_keys([("r", 0, 1)], [2], [9], "decode")) == ([0], [6])
    assert g.cands["r"] == {"p1"}
    # the trace's own request id; a verify block whose drafted 9 p0 lacks: those rows keep the engine's
    assert g.rows_of(_keys([("p0", 0, 3)], [1, 2, 3], [6, 9, 8], "target_verify")) == ([0], [1])
    assert g.kept_draft_rows == 2
    # a prefill or decode row that no sequence has: refused, never skipped
    with pytest.raises(ValueError, match="TENSORDIFF_GRAFT: other.h5 has no row of layer4 for request p0 position 2"):
        g.rows_of(_keys([("p0", 0, 1)], [2], [9], "decode"))
    with pytest.raises(ValueError, match="--disable-radix-cache"):
        g.rows_of(_keys([("q", 0, 1)], [3], [8]))


def test_graft_env_is_read():
    from tensordiff.recorders.sglang.config import Config

    cfg = Config.from_env({"TENSORDIFF_TRACE": "/tmp/x.h5", "TENSORDIFF_GRAFT": " a.h5:layer4 "})
    assert cfg is not None and cfg.graft == "a.h5:layer4"
