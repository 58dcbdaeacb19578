"""The serve-side recorder inside real SGLang 0.5.23 on the CPU, and the example trace pair.

Two engines, each run in its own process (start-up ~25-40 s), declared in tests/recordings.py and
recorded once per cache key:

* capture-only (target alone, ``enable_return_aux_hidden_states``), started by the real
  ``tensordiff record serve`` command line, with the per-boundary catalog on;
* EAGLE-3 speculative decoding with a tiny random draft (``intel_amx`` backend: needs the AMX
  override of tests/sglang_support.py, so it goes through ``serve_cli.record`` with that engine
  factory).

Both get the same three prompts, two at a time: A (longer than ``chunked_prefill_size``: several
prefill chunks) with B, then C, which shares A's first 56 tokens (a radix-cache hit), each with
decode steps. The traces are checked against HF transformers on the same tiny checkpoint.

The fast tests (no engine) check the plugin is inert without ``TENSORDIFF_TRACE``, that its modules
import neither torch nor sglang, the CLI's argument handling, and the committed example pair.
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

import recordings as recs
import sglang_support as sup

AUX_IDS = [2, 4, 6]
BOUNDARIES = [3, 5, 7]  # SGLang llama: draft id i captures the input of decoder layer i + 1
LABELS = ["layer3", "layer5", "layer7"]
CHUNK = 32
MAX_NEW = 6
COS_MIN = 0.9999

_rng = np.random.default_rng(5)
PROMPT_A = _rng.integers(1, 256, 80).tolist()          # 3 prefill chunks of <= 32
PROMPT_B = _rng.integers(1, 256, 9).tolist()
PROMPT_C = PROMPT_A[:56] + _rng.integers(1, 256, 5).tolist()  # shares 56 tokens with A
PROMPTS = {"A": PROMPT_A, "B": PROMPT_B, "C": PROMPT_C}
assert PROMPTS == recs.SGLANG_PROMPTS    # what the recordings of this module were given

needs_sglang = pytest.mark.skipif(not sup.sglang_available(), reason="real SGLang (and torch) not installed")
engine_test = [pytest.mark.sglang, pytest.mark.slow, needs_sglang]


def _env() -> dict:
    """The environment of an engine process: CPU mode, the sgl_kernel stand-in, only our plugin."""
    env = dict(os.environ)
    env["SGLANG_USE_CPU_ENGINE"] = "1"
    rest = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join([str(sup.STUB_DIR), str(REPO), *rest])
    env["SGLANG_PLUGINS"] = "tensordiff"
    for k in list(env):
        if k.startswith("TENSORDIFF_"):
            del env[k]
    return env


def _load_run(run: dict) -> dict:
    outs = [json.loads(line) for line in Path(run["outputs"]).read_text().splitlines()]
    return {"trace": run["trace"], "outputs": {o["id"]: o for o in outs},
            "full": {o["id"]: o["input_ids"] + o["output_ids"] for o in outs}}


# ----------------------------------------------------------------------------------------------
# Fixtures: one engine per mode
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def models(recorded):
    m = recorded(recs.SGLANG_MODELS)
    return {"target": Path(m["target"]), "draft": Path(m["draft"]), "hf": sup.load_hf_model(m["target"]),
            "refs": m["refs"]}


@pytest.fixture(scope="module")
def capture_run(recorded):
    """`tensordiff record serve` (the real command) in capture-only mode."""
    run = recorded(recs.SGLANG_CAPTURE)
    stdout = Path(run["stdout"]).read_text()
    assert "aux_hidden_states: slots [layer3, layer5, layer7] from draft ids [2, 4, 6]" in stdout, stdout
    return _load_run(run)


@pytest.fixture(scope="module")
def eagle_run(recorded):
    """EAGLE-3 with the tiny draft, through serve_cli.record (intel_amx needs the AMX override)."""
    return _load_run(recorded(recs.SGLANG_EAGLE))


# ----------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------


_Trace = sup.RecordedTrace


@pytest.fixture(scope="module")
def capture_trace(capture_run):
    t = _Trace(capture_run["trace"])
    yield t
    t.close()


@pytest.fixture(scope="module")
def eagle_trace(eagle_run):
    t = _Trace(eagle_run["trace"])
    yield t
    t.close()


@pytest.fixture(scope="module")
def hf_states(models, capture_run, eagle_run):
    for run in (capture_run, eagle_run):  # the engine generated what HF generates
        for k, o in run["outputs"].items():
            assert o["output_ids"] == models["refs"][k][:MAX_NEW], (k, o["output_ids"], models["refs"][k])
    return {k: sup.hf_boundary_states(models["hf"], full) for k, full in capture_run["full"].items()}


_cos = sup.row_cos


def _check_rows(run: dict, tr: _Trace) -> None:
    """Every recorded row's (request, position, token) is a token of that request's prompt + output,
    and every position the engine computed is there (from the cached prefix on)."""
    full = run["full"]
    assert set(tr.seq) == set(full), (set(tr.seq), set(full))
    for i in range(len(tr.pos)):
        seq = full[tr.seq[i]]
        assert 0 <= tr.pos[i] < len(seq), (tr.seq[i], tr.pos[i])
        assert seq[tr.pos[i]] == tr.tok[i], (tr.seq[i], tr.pos[i], tr.tok[i], seq[tr.pos[i]])
    for key, seq in full.items():
        cached = int(run["outputs"][key]["cached_tokens"] or 0)
        got = set(tr.pos[tr.seq == key].tolist())
        # positions before a cached prefix are not recomputed; the last output token is fed back only
        # when it was an accepted draft token (EAGLE: drafts are inputs of the verify that accepts them)
        need = set(range(cached, len(seq) - 1))
        assert need <= got <= need | {len(seq) - 1}, (key, sorted(need - got), sorted(got - need))


# ----------------------------------------------------------------------------------------------
# Capture-only engine
# ----------------------------------------------------------------------------------------------


@pytest.mark.sglang
@pytest.mark.slow
@needs_sglang
def test_capture_rows_cover_chunked_prefill_radix_hit_and_decode(capture_run, capture_trace):
    tr = capture_trace
    _check_rows(capture_run, tr)
    out = capture_run["outputs"]
    assert out["C"]["cached_tokens"] and out["C"]["cached_tokens"] >= 32, out["C"]  # radix-cache hit
    c_rows = tr.pos[tr.seq == "C"]
    assert c_rows.min() == out["C"]["cached_tokens"]  # keyed by absolute position, not from 0
    stats = json.loads(tr.r.f.attrs["tensordiff_sglang"])
    assert stats["layers_to_capture"] == BOUNDARIES and stats["draft_layer_ids"] == AUX_IDS
    assert stats["convention_expects"] == BOUNDARIES and stats["catalog_layers"] == 8
    a_prefill = (tr.seq == "A") & (tr.pos < len(PROMPT_A))
    assert len(np.unique(tr.step[a_prefill])) >= 3  # A's prompt came in chunks of <= 32 tokens
    from tensordiff.vocab import REGIMES
    regimes = {REGIMES[c] for c in np.unique(tr.regime)}
    assert {"prefill", "decode"} <= regimes, regimes


@pytest.mark.sglang
@pytest.mark.slow
@needs_sglang
def test_capture_aux_slots_equal_hf_boundaries(capture_trace, hf_states):
    tr = capture_trace
    info = tr.r.tensors["aux_hidden_states"]
    assert (info.kind, info.role, info.token_offset) == ("packed", "aux", 0)
    assert info.slot_labels == LABELS and info.raw_ids == AUX_IDS and info.convention == "sglang-llama"
    vals = tr.r.read_values("aux_hidden_states")
    _, seqs, pos = tr.rows("aux_hidden_states")
    assert len(vals) == len(tr.pos)  # one aux row per token row
    h = info.slot_width
    for k, b in enumerate(BOUNDARIES):
        ref = np.stack([hf_states[s][f"layer{b}"][p] for s, p in zip(seqs, pos)])
        cos = _cos(vals[:, k * h:(k + 1) * h], ref)
        assert cos.min() > COS_MIN, (b, cos.min())
        for other in (b - 1, b + 1):  # the neighbours do not match: the slot is exactly boundary b
            ref_o = np.stack([hf_states[s][f"layer{other}" if other else "embed"][p] for s, p in zip(seqs, pos)])
            assert np.median(_cos(vals[:, k * h:(k + 1) * h], ref_o)) < 0.999


@pytest.mark.sglang
@pytest.mark.slow
@needs_sglang
def test_capture_catalog_equals_hf(capture_trace, hf_states):
    from tensordiff.sketch import projection

    tr = capture_trace
    n = tr.r.num_layers
    assert n == 8
    r = tr.r
    proj = projection(r.hidden_size, r.sketch_dim, r.sketch_seed)
    for label in ["embed"] + [f"layer{b}" for b in range(1, n + 1)] + ["final_norm"]:
        info = r.tensors[label]
        assert info.role == "catalog" and info.has_sketch
        _, seqs, pos = tr.rows(label)
        ref = np.stack([hf_states[s][label][p] for s, p in zip(seqs, pos)])
        cos = _cos(r.read_sketch(label), ref @ proj)
        assert cos.min() > COS_MIN, (label, cos.min())
        rms = np.sqrt((ref.astype(np.float64) ** 2).mean(-1))
        np.testing.assert_allclose(r.read_rms(label)[:, 0], rms, rtol=1e-3)  # pre-norm vs post-norm


# ----------------------------------------------------------------------------------------------
# EAGLE-3 engine
# ----------------------------------------------------------------------------------------------


@pytest.mark.sglang
@pytest.mark.slow
@needs_sglang
def test_eagle_rows_match_prompt_and_output(eagle_run, eagle_trace):
    tr = eagle_trace
    _check_rows(eagle_run, tr)
    from tensordiff.vocab import REGIMES
    regimes = {REGIMES[c] for c in np.unique(tr.regime)}
    assert {"prefill", "target_verify"} <= regimes, regimes
    stats = json.loads(tr.r.f.attrs["tensordiff_sglang"])
    assert stats["rows_dropped"] > 0  # rejected draft tokens' verify rows were not recorded
    assert any(o["spec_accept_length"] and o["spec_accept_length"] > 1 for o in eagle_run["outputs"].values())
    # no position is claimed twice: verify rows of rejected tokens were dropped, not superseded
    keys = list(zip(tr.seq.tolist(), tr.pos.tolist()))
    assert len(keys) == len(set(keys))


@pytest.mark.sglang
@pytest.mark.slow
@needs_sglang
def test_eagle_aux_slots_equal_hf_boundaries(eagle_trace, hf_states):
    tr = eagle_trace
    info = tr.r.tensors["aux_hidden_states"]
    assert info.slot_labels == LABELS and info.raw_ids == AUX_IDS and info.convention == "sglang-llama"
    vals = tr.r.read_values("aux_hidden_states")
    _, seqs, pos = tr.rows("aux_hidden_states")
    h = info.slot_width
    for k, b in enumerate(BOUNDARIES):
        ref = np.stack([hf_states[s][f"layer{b}"][p] for s, p in zip(seqs, pos)])
        assert _cos(vals[:, k * h:(k + 1) * h], ref).min() > COS_MIN, b


@pytest.mark.sglang
@pytest.mark.slow
@needs_sglang
def test_eagle_draft_input_is_aux_with_ids_shifted_by_one(eagle_run, eagle_trace, hf_states, models):
    tr = eagle_trace
    r = tr.r
    d = r.tensors["draft_input"]
    assert (d.kind, d.role, d.token_offset) == ("packed", "draft_input", 1)
    assert d.slot_labels == LABELS and d.raw_ids == AUX_IDS and d.convention == "sglang-llama"
    drows, dseq, dpos = tr.rows("draft_input")
    dvals = r.read_values("draft_input")
    arows, _, _ = tr.rows("aux_hidden_states")
    avals = r.read_values("aux_hidden_states")
    by_row = {int(x): i for i, x in enumerate(arows)}
    # the draft consumed exactly the target's aux states of the same token (same row of the token table)
    assert all(int(x) in by_row for x in drows)
    np.testing.assert_array_equal(dvals, avals[[by_row[int(x)] for x in drows]])
    # stored once: every draft row refers to the aux row whose bits it repeats (the same tensor),
    # and neither stores a sketch (a reader derives it from the values)
    assert d.values_source == "aux_hidden_states"
    ref = r.f["tensors/draft_input/values_ref"][()]
    np.testing.assert_array_equal(ref, [by_row[int(x)] for x in drows])
    assert len(r.f["tensors/draft_input/values"]) == 0
    assert d.sketch_derived and r.tensors["aux_hidden_states"].sketch_derived
    np.testing.assert_allclose(r.read_sketch("draft_input"),
                               r.read_sketch("aux_hidden_states")[[by_row[int(x)] for x in drows]], rtol=1e-5, atol=1e-5)
    # ... paired with the id of the next token (row t ~ token t+1)
    irows, iseq, ipos = tr.rows("draft_input_ids")
    np.testing.assert_array_equal(irows, drows)
    ids = r.read_values("draft_input_ids")[:, 0].astype(np.int64)
    # the greedy continuation, one token past the output: an accepted draft token at the last output
    # position has a draft row too, paired with the next token the target chose (not emitted)
    full = {k: PROMPTS[k] + models["refs"][k] for k in PROMPTS}
    nxt = np.array([full[s][p + 1] for s, p in zip(iseq, ipos)])
    np.testing.assert_array_equal(ids, nxt)
    # prefill rows and decode rows (draft extend after verify, accepted rows only)
    prompt_len = np.array([len(PROMPTS[s]) for s in dseq])
    assert (dpos < prompt_len).any() and (dpos >= prompt_len).any()
    stats = json.loads(r.f.attrs["tensordiff_sglang"])
    assert stats["draft_shift_checked"] > 0 and stats["draft_shift_mismatched"] == 0
    # and it is the HF boundary the labels name
    h = d.slot_width
    ref = np.stack([hf_states[s]["layer3"][p] for s, p in zip(dseq, dpos)])
    assert _cos(dvals[:, :h], ref).min() > COS_MIN


@pytest.mark.sglang
@pytest.mark.slow
@needs_sglang
def test_eagle_trace_diffs_clean_against_a_correct_train_trace(eagle_run, models, tmp_path):
    """The serve trace against a train trace recorded with the SAME wiring (speculators legacy
    without the bug: [layer3, layer5, layer7]) agrees: SGLang's aux states are HF's boundaries."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": k, "input_ids": v}) + "\n" for k, v in eagle_run["full"].items()))
    train = tmp_path / "train.h5"
    subprocess.run([sys.executable, "-m", "tensordiff", "record", "train", "--model", str(models["target"]),
                    "--prompts", str(prompts), "--aux-ids", "2", "4", "6", "--convention", "speculators-legacy",
                    "--dtype", "float32", "--device", "cpu", "--no-progress", "--out", str(train)],
                   check=True, capture_output=True, cwd=REPO)
    proc = subprocess.run([sys.executable, "-m", "tensordiff", "diff", str(train), eagle_run["trace"]],
                          check=False, capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[:3000]
    assert proc.stdout.startswith("no divergence"), proc.stdout[:500]


@pytest.mark.sglang
@pytest.mark.slow
@needs_sglang
def test_draft_ids_out_of_order_are_claimed_in_the_order_the_engine_packs_them(recorded, models, tmp_path):
    """Draft ids [5, 1, 3]: SGLang captures the inputs of layers 6, 2 and 4 and its forward packs
    them in layer order, so the serve trace's slots claim [layer2, layer4, layer6] (not the config's
    order, layer6 first); a train trace wired [layer2, layer4, layer6] agrees with it, and the
    identity search finds each slot holding what it claims."""
    run = _load_run(recorded(recs.SGLANG_CAPTURE_UNSORTED))
    from tensordiff.trace import TraceReader

    with TraceReader(run["trace"]) as r:   # capture-only: the target's packed aux states
        assert r.tensors["aux_hidden_states"].slot_labels == ["layer2", "layer4", "layer6"]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": k, "input_ids": v}) + "\n" for k, v in run["full"].items()))
    train = tmp_path / "train.h5"
    subprocess.run([sys.executable, "-m", "tensordiff", "record", "train", "--model", str(models["target"]),
                    "--prompts", str(prompts), "--aux-ids", "1", "3", "5", "--convention", "speculators-legacy",
                    "--dtype", "float32", "--device", "cpu", "--no-progress", "--out", str(train)],
                   check=True, capture_output=True, cwd=REPO)
    for a, b in ((train, run["trace"]), (run["trace"], train)):
        code, doc, text = _diff_json(a, b)
        assert code == 0, text[:3000]
        rows = [s for s in doc["slot_table"] if s["tensor"] in ("draft_input", "aux_hidden_states")]
        want = ["layer2", "layer4", "layer6"]
        assert [(s["claimed_a"], s["claimed_b"]) for s in rows] == [(x, x) for x in want], rows
        assert [s["held_b"] for s in rows] == want and all(s["verdict"] == "ok" for s in rows), rows


# ----------------------------------------------------------------------------------------------
# Why is acceptance low: predictions, fc output, verify steps; record train --from-serve
# ----------------------------------------------------------------------------------------------


def _record_train_from_serve(models, source, out, draft) -> None:
    proc = subprocess.run([sys.executable, "-m", "tensordiff", "record", "train", "--model", str(models["target"]),
                           "--from-serve", str(source), "--draft", str(draft), "--convention", "sglang-llama",
                           "--dtype", "float32", "--device", "cpu", "--no-progress", "--out", str(out)],
                          check=False, capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "draft_input slots [layer3, layer5, layer7] from ids [2, 4, 6]" in proc.stdout, proc.stdout


def _diff_json(a, b) -> tuple[int, dict, str]:
    proc = subprocess.run([sys.executable, "-m", "tensordiff", "diff", str(a), str(b), "--json"],
                          check=False, capture_output=True, text=True, cwd=REPO)
    assert proc.returncode in (0, 1), proc.stderr[-2000:]
    text = subprocess.run([sys.executable, "-m", "tensordiff", "diff", str(a), str(b)], check=False,
                          capture_output=True, text=True, cwd=REPO).stdout
    return proc.returncode, json.loads(proc.stdout), text


@pytest.mark.sglang
@pytest.mark.slow
@needs_sglang
def test_eagle_records_predictions_fc_output_and_verify_steps(eagle_run, eagle_trace, models):
    """target_topk is the HF target's top-k at the same token; draft_fc_output / draft_topk sit on
    the draft_input rows; one spec_verify row per verify step of each request."""
    from tensordiff import conventions as cv

    tr = eagle_trace
    r = tr.r
    drows, sv = sup.assert_prediction_layouts(tr, draft_k=2)  # the draft's vocabulary has 2 tokens
    # the target's predictions equal HF's logits at every recorded row (prefill, verify, decode)
    sup.assert_target_topk_equals_hf(tr, models["hf"], eagle_run["full"])
    # verify steps: as many as SGLang counted, and their accepted tokens make the output
    _, sseq, _ = tr.rows(cv.SPEC_VERIFY)
    steps = r.read_values(cv.SPEC_VERIFY, raw=True)
    K = cv.spec_verify_drafts(sv.width)
    assert K == 2 and (steps[:, 1] == K).all()
    for key, o in eagle_run["outputs"].items():
        mine = steps[sseq == key]
        assert len(mine) == o["spec_verify_ct"]
        assert (1 + mine[:, 0]).sum() >= len(o["output_ids"]) - 1  # the prefill made the first token
        sup.assert_greedy_verify_steps(mine, K)
    stats = json.loads(r.f.attrs["tensordiff_sglang"])
    assert stats["verify_steps"] == len(steps)
    # spec_chain: the draft's distribution at each draft position proposed exactly the draft token
    # SGLang verified there (greedy), and the target rows are the verify rows' predictions
    sup.assert_chains_proposed_the_verified_tokens(r, steps, K, draft_k=2)


@pytest.fixture(scope="module")
def eagle_run_at_once(recorded):
    """The EAGLE-3 run again with TENSORDIFF_STAGE_MB=0: every pass recorded in its hooks, nothing
    copied, queued or staged (what the plugin does on an accelerator)."""
    return _load_run(recorded(recs.SGLANG_EAGLE_AT_ONCE))


@pytest.mark.sglang
@pytest.mark.slow
@needs_sglang
def test_queued_passes_record_what_passes_recorded_at_once_record(eagle_run, eagle_run_at_once):
    """The default on the CPU (passes snapshotted in the hooks, recorded later in a batch) and
    every pass recorded in its own hooks give the same trace, bit for bit: token table, rows of
    every tensor, values (through the reader: draft_input by reference in the first, stored in the
    second), top-k, verify and chain tables, RMS, counts. Only the sketch-only catalog states
    differ, by the float32 rounding of one sketch product over many passes."""
    import h5py

    from tensordiff.trace import TraceReader

    assert eagle_run["full"] == eagle_run_at_once["full"]
    with TraceReader(eagle_run["trace"]) as q, TraceReader(eagle_run_at_once["trace"]) as a:
        np.testing.assert_array_equal(q.tokens[()], a.tokens[()])
        assert list(q.sequences) == list(a.sequences)
        assert sorted(q.tensors) == sorted(a.tensors)
        for name, info in a.tensors.items():
            np.testing.assert_array_equal(q.token_rows(name), a.token_rows(name), err_msg=name)
            if not info.has_values:
                np.testing.assert_allclose(q.read_sketch(name), a.read_sketch(name), rtol=1e-5, atol=1e-5,
                                           err_msg=name)
                continue
            np.testing.assert_array_equal(q.read_values(name, raw=True), a.read_values(name, raw=True), err_msg=name)
            np.testing.assert_array_equal(q.read_rms(name), a.read_rms(name), err_msg=name)
        assert q.tensors["draft_input"].values_source == "aux_hidden_states"
        sq, sa = (json.loads(r.f.attrs["tensordiff_sglang"]) for r in (q, a))
        for key in ("draft_shift_checked", "draft_shift_mismatched", "rows_dropped", "verify_steps",
                    "draft_passes_unmatched", "passes_without_request_ids"):
            assert sq[key] == sa[key], key
    with h5py.File(eagle_run_at_once["trace"], "r") as f:  # recorded at once: no staging, no references
        assert "values_ref" not in f["tensors/draft_input"]


@pytest.mark.sglang
@pytest.mark.slow
@needs_sglang
def test_from_serve_pairs_every_serve_row_and_an_untrained_draft_is_training_quality(eagle_run, eagle_trace,
                                                                                     models, tmp_path):
    """record train --from-serve the outputs file: every serve row pairs; wiring, fc output and
    target predictions agree, and the (random) draft disagrees with the target."""
    train = tmp_path / "train.h5"
    _record_train_from_serve(models, Path(eagle_run["trace"]).with_suffix(".jsonl"), train, models["draft"])
    rc, d, text = _diff_json(train, eagle_run["trace"])
    assert rc == 0, text[:3000]
    serve_keys = set(zip(eagle_trace.seq.tolist(), eagle_trace.pos.tolist()))
    assert d["tokens_aligned"] == len(serve_keys)  # every serve row has its train row
    assert not [g for g in d["gaps"] if g["side"] == "b"]
    sup.assert_training_quality(d, text, sum(o["spec_verify_ct"] for o in eagle_run["outputs"].values()))
    (tmp_path / "report.txt").write_text(text)


@pytest.fixture(scope="module")
def norm_run(recorded):
    """EAGLE-3 with a draft whose config says norm_before_fc (sglang#32334): SGLang normalises the
    packed input before fc; the trainer of the same weights did not. Prompts A and B (no radix hit,
    so the serve trace itself holds every position)."""
    return _load_run(recorded(recs.SGLANG_NORM))


@pytest.mark.sglang
@pytest.mark.slow
@needs_sglang
def test_a_draft_normalising_its_fc_input_is_found_at_the_fc_output(norm_run, models, tmp_path):
    train = tmp_path / "train.h5"
    _record_train_from_serve(models, norm_run["trace"], train, models["draft"])  # from the serve trace itself
    rc, d, text = _diff_json(train, norm_run["trace"])
    sup.assert_found_at_fc_output(rc, d)
    (tmp_path / "report.txt").write_text(text)


# ----------------------------------------------------------------------------------------------
# Inert without TENSORDIFF_TRACE
# ----------------------------------------------------------------------------------------------

_LOAD_PLUGINS = """
import os, sys
os.environ["SGLANG_PLUGINS"] = "tensordiff"
os.environ.pop("TENSORDIFF_TRACE", None)
from sglang.srt.plugins import load_plugins
from sglang.srt.plugins.hook_registry import HookRegistry
from sglang.srt.model_executor.model_runner import ModelRunner
load_plugins()
print("INERT", dict(HookRegistry._hooks), hasattr(ModelRunner.forward, "__wrapped__"))
import sglang.srt.plugins as plugins
plugins._plugins_loaded = False
HookRegistry.reset()
os.environ["TENSORDIFF_TRACE"] = os.path.join({tmp!r}, "never.h5")
load_plugins()
from tensordiff.recorders import sglang as plugin
print("ACTIVE", sorted(HookRegistry._hooks) == sorted(plugin.HOOK_TARGETS + plugin.RL_HOOK_TARGETS),
      hasattr(ModelRunner.forward, "__wrapped__"), os.path.exists(os.environ["TENSORDIFF_TRACE"]))
"""


@pytest.mark.sglang
@pytest.mark.slow
@needs_sglang
def test_plugin_registers_no_hook_without_tensordiff_trace(tmp_path):
    """Through SGLang's own plugin loader: with TENSORDIFF_TRACE unset the entry point runs and
    registers nothing (ModelRunner.forward stays unwrapped); set, it registers its five hooks
    (and writes nothing until a model runs)."""
    proc = subprocess.run([sys.executable, "-c", _LOAD_PLUGINS.format(tmp=str(tmp_path))], check=False, capture_output=True,
                          text=True, env=_env(), cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = {ln.split(" ", 1)[0]: ln for ln in proc.stdout.splitlines() if ln.startswith(("INERT", "ACTIVE"))}
    assert lines["INERT"] == "INERT {} False", proc.stdout
    assert lines["ACTIVE"] == "ACTIVE True True False", proc.stdout


def test_register_without_env_imports_nothing():
    """Every module of the plugin package imports neither torch nor sglang; register() without
    TENSORDIFF_TRACE imports them neither."""
    code = ("import os, sys, pkgutil, importlib\nos.environ.pop('TENSORDIFF_TRACE', None)\n"
            "from tensordiff.recorders import sglang, serve_cli\n"
            "for m in pkgutil.iter_modules(sglang.__path__): importlib.import_module('tensordiff.recorders.sglang.' + m.name)\n"
            "assert sglang.register() is None\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'sglang', 'transformers')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO).stdout
    assert out.strip() == "[]", out


def test_the_entry_point_names_the_package():
    """The entry point names the package's register; the old single-module path is gone."""
    import importlib.util
    import tomllib

    from tensordiff.recorders import sglang

    with open(os.path.join(REPO, "pyproject.toml"), "rb") as fh:
        eps = tomllib.load(fh)["project"]["entry-points"]["sglang.srt.plugins"]
    assert eps == {"tensordiff": "tensordiff.recorders.sglang:register"}
    assert importlib.util.find_spec("tensordiff.recorders.sglang_plugin") is None
    table = sglang.hook_table()
    assert [t for t, _, _ in table] == list(sglang.HOOK_TARGETS)
    assert [k for _, _, k in table] == ["AROUND", "AROUND", "AFTER", "AFTER", "AROUND"]
    assert all(callable(fn) for _, fn, _ in table)


def test_plugin_config_from_env():
    from tensordiff.recorders.sglang import Config, rank_path

    assert Config.from_env({}) is None
    assert Config.from_env({"TENSORDIFF_TRACE": "  "}) is None
    c = Config.from_env({"TENSORDIFF_TRACE": "/x/s.h5"})
    assert c.path == "/x/s.h5" and not c.catalog and c.sample_every == 1
    assert c.wants_values("draft_input") and c.wants_values("aux_hidden_states") and not c.wants_values("layer3")
    c = Config.from_env({"TENSORDIFF_TRACE": "s.h5", "TENSORDIFF_CATALOG": "1", "TENSORDIFF_VALUES": "layer*,final_norm",
                         "TENSORDIFF_SAMPLE_EVERY": "4", "TENSORDIFF_COMPRESSION": "gzip"})
    assert c.catalog and c.sample_every == 4 and c.compression == "gzip"
    assert c.wants_values("layer3") and c.wants_values("final_norm") and not c.wants_values("draft_input")
    assert Config.from_env({"TENSORDIFF_TRACE": "s.h5", "TENSORDIFF_VALUES": "all"}).wants_values("embed")
    assert not Config.from_env({"TENSORDIFF_TRACE": "s.h5", "TENSORDIFF_VALUES": "none"}).wants_values("draft_input")
    for bad in ({"TENSORDIFF_CATALOG": "maybe"}, {"TENSORDIFF_SAMPLE_EVERY": "0"}, {"TENSORDIFF_SAMPLE_EVERY": "x"},
                {"TENSORDIFF_COMPRESSION": "zstd"}):
        with pytest.raises(ValueError):
            Config.from_env({"TENSORDIFF_TRACE": "s.h5", **bad})
    assert Config.from_env({"TENSORDIFF_TRACE": "s.h5"}).topk == 20
    assert Config.from_env({"TENSORDIFF_TRACE": "s.h5", "TENSORDIFF_TOPK": "0"}).topk == 0
    with pytest.raises(ValueError):
        Config.from_env({"TENSORDIFF_TRACE": "s.h5", "TENSORDIFF_TOPK": "-1"})
    assert c.wants_values("draft_fc_output") is False  # this c asked for layer*,final_norm only
    assert Config.from_env({"TENSORDIFF_TRACE": "s.h5"}).wants_values("draft_fc_output")
    assert rank_path("/t/serve.h5", "") == "/t/serve.h5"
    assert rank_path("/t/serve.h5", ".tp1") == "/t/serve.tp1.h5"
    assert rank_path("/t/serve", ".dp0") == "/t/serve.dp0"


# ----------------------------------------------------------------------------------------------
# The command line (no engine)
# ----------------------------------------------------------------------------------------------


def _serve_args(argv):
    import argparse

    from tensordiff.recorders import serve_cli

    p = argparse.ArgumentParser()
    serve_cli.add_arguments(p)
    return p.parse_args(argv)


def test_serve_engine_kwargs(tmp_path):
    from tensordiff.recorders.serve_cli import engine_kwargs, plugin_env

    base = ["--model", str(tmp_path), "--prompts", "p.jsonl", "--out", str(tmp_path / "s.h5")]
    kw = engine_kwargs(_serve_args(base + ["--draft", str(tmp_path / "d"), "--device", "cpu", "--tp-size", "2",
                                           "--engine-arg", "cuda_graph_max_bs=8", "--engine-arg", "foo=bar"]))
    assert kw["speculative_algorithm"] == "EAGLE3" and kw["speculative_draft_model_path"].endswith("/d")
    assert kw["speculative_num_steps"] == 2 and kw["speculative_eagle_topk"] == 1
    assert kw["speculative_num_draft_tokens"] == 3 and kw["tp_size"] == 2 and kw["skip_tokenizer_init"]
    assert kw["disable_cuda_graph"] and kw["cuda_graph_max_bs"] == 8 and kw["foo"] == "bar"
    kw = engine_kwargs(_serve_args(base + ["--aux-ids", "1", "3", "5"]))
    assert kw["enable_return_aux_hidden_states"] and kw["return_aux_hidden_state_layer_ids"] == [1, 3, 5]
    assert kw["speculative_algorithm"] == "EAGLE3" and "disable_cuda_graph" not in kw
    env = plugin_env(_serve_args(base + ["--catalog", "--values", "all", "--sample-every", "2", "--sketch-dim", "64",
                                         "--topk", "5"]))
    assert env["TENSORDIFF_TOPK"] == "5"
    assert env["TENSORDIFF_TRACE"] == str(tmp_path / "s.h5") and env["TENSORDIFF_CATALOG"] == "1"
    assert env["TENSORDIFF_VALUES"] == "all" and env["TENSORDIFF_SAMPLE_EVERY"] == "2"
    assert env["TENSORDIFF_SKETCH_DIM"] == "64"


@pytest.mark.parametrize("case", ["no-model", "bad-prompts", "no-outdir", "aux-with-draft"])
def test_serve_bad_input_is_one_line_exit_2(tmp_path, case):
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"vocab_size": 10}))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"input_ids": [1, 2]}\n')
    argv = ["--model", str(model), "--prompts", str(prompts), "--out", str(tmp_path / "s.h5")]
    if case == "no-model":
        argv[1] = str(tmp_path / "nope")
    elif case == "bad-prompts":
        prompts.write_text("not json\n")
    elif case == "no-outdir":
        argv[5] = str(tmp_path / "nodir" / "s.h5")
    elif case == "aux-with-draft":
        argv += ["--draft", str(model), "--aux-ids", "1"]
    proc = subprocess.run([sys.executable, "-m", "tensordiff", "record", "serve", *argv], check=False, capture_output=True,
                          text=True, cwd=REPO, env={k: v for k, v in os.environ.items() if not k.startswith("TENSORDIFF")})
    assert proc.returncode == 2, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert not (tmp_path / "s.h5").exists()


# ----------------------------------------------------------------------------------------------
# The committed example pair (fast: no engine)
# ----------------------------------------------------------------------------------------------

TRACES = REPO / "traces"
EXAMPLE_FIRST_LINE = ("train feeds draft_input [embed, layer3, layer5], serve feeds [layer3, layer5, layer7]; "
                      "the draft was trained on train's")


def test_example_pair_first_line_and_exit_code():
    proc = subprocess.run([sys.executable, "-m", "tensordiff", "diff", "traces/train.h5", "traces/serve.h5"],
                          check=False, capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stdout.splitlines()[0] == EXAMPLE_FIRST_LINE


def test_example_pair_is_what_it_says():
    from tensordiff.trace import TraceReader

    with TraceReader(str(TRACES / "train.h5")) as t, TraceReader(str(TRACES / "serve.h5")) as s:
        assert t.side == "train" and s.side == "serve" and t.complete and s.complete
        assert t.model["num_layers"] == s.model["num_layers"] == 8
        assert t.model["hidden_size"] == s.model["hidden_size"] == 64
        td, sd = t.tensors["draft_input"], s.tensors["draft_input"]
        assert td.slot_labels == ["embed", "layer3", "layer5"] and td.convention == "speculators-legacy"
        assert td.raw_ids == sd.raw_ids == [2, 4, 6]
        assert sd.slot_labels == ["layer3", "layer5", "layer7"] and sd.convention == "sglang-llama"
        assert sd.role == "draft_input" and sd.token_offset == 1
        assert s.producer.startswith("tensordiff sglang plugin (sglang 0.5.23)")
        assert s.user_meta["layers_to_capture"] == [3, 5, 7] and s.user_meta["draft_model"]
        # both sides saw the same prompts
        tseqs = {k: [int(x) for x in v.values()] for k, v in _by_seq(t).items()}
        sseqs = _by_seq(s)
        for key, toks in tseqs.items():
            assert [sseqs[key][p] for p in range(len(toks))] == toks
    assert os.path.getsize(TRACES / "train.h5") + os.path.getsize(TRACES / "serve.h5") < 1_000_000


def _by_seq(r) -> dict:
    t = r.tokens
    out: dict = {}
    for s, p, k in zip(t["seq"], t["position"], t["token"]):
        out.setdefault(r.sequences[int(s)], {})[int(p)] = int(k)
    return {key: dict(sorted(v.items())) for key, v in out.items()}
