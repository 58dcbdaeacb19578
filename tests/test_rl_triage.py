"""`tensordiff triage TRAIN ROLLOUT`: each bug class named in the first sentence, correct pairs at
exit 0 in both orders. The trained tiny model; HF stands in for the engine (prefill + KV-cache
decode passes, the engine-side RL records: tests/rl_support.py) and the trainer is the real
`record train --from-serve` (or TrainerRecorder in a user's own forward)."""

from __future__ import annotations

import copy
import json

import pytest

torch = pytest.importorskip("torch")

import rl_support as rs
import trained

from tensordiff.cli import main
from tensordiff.rl.triage import triage

pytestmark = pytest.mark.torch

PROMPTS = 8
NEW = 12


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("rl")


@pytest.fixture(scope="module")
def fp32():
    return trained.load_target(torch.float32)


def _prompts():
    return trained.prompts()[:PROMPTS]


def _pair(work, name, engine, *, model_dir=None, **kw):
    r = rs.rollout(work / f"{name}.rollout.h5", engine, prompts=_prompts(), new_tokens=NEW, **kw)
    return rs.train_from_serve(work / f"{name}.train.h5", r, model_dir), r


def test_correct_pairs_exit_0_in_both_orders(work, fp32, capsys):
    """A bf16 engine against the fp32 trainer (and fp32 against fp32): no cause, exit 0, whichever
    trace comes first."""
    for name, engine in (("bf16", trained.load_target(torch.bfloat16)), ("fp32", fp32)):
        t, r = _pair(work, name, engine)
        for a, b in ((t, r), (r, t)):
            got = triage(str(a), str(b))
            assert got.cause == "agree", got.text()
            assert got.headline.startswith("no cause: weights, tokens and states agree")
            assert main(["triage", str(a), str(b)]) == 0
        out = capsys.readouterr().out
        assert "token_mult_prob_error = " in out and "verl rollout_probs_diff_mean" in out


def test_an_autocast_trainer_is_judged_at_its_compute_dtype(work, fp32):
    """The trainer's forward inside ``torch.autocast(dtype=torch.bfloat16)`` against an fp32
    rollout: its states are stored in float32 (the residual stream) but carry bf16 matmul rounding.
    The trace records the autocast region, the noise model allows bf16's rounding, and the correct
    pair agrees in both orders; bugs of known size on the engine, every weight untouched (its
    layer-3 MLP output x1.5, its logits x1.05), are still named in both orders."""
    from tensordiff.conventions import AUTOCAST_ATTR
    from tensordiff.trace import TraceReader

    ps = _prompts()
    r = work / "fp32.rollout.h5"       # the correct pair's rollout
    if not r.exists():
        r = rs.rollout(r, fp32, prompts=ps, new_tokens=NEW)
    t = rs.trainer(work / "autocast.train.h5", fp32, r, ps, autocast=torch.bfloat16)
    with TraceReader(str(t)) as tr:
        assert tr.tensors["layer4"].dtype == "float32"
        assert tr.tensors["layer4"].attrs[AUTOCAST_ATTR] == {"enabled": True, "dtype": "bfloat16", "device": "cpu"}
    for a, b in ((t, r), (r, t)):
        got = triage(str(a), str(b))
        assert got.cause == "agree", got.text()
        assert main(["triage", str(a), str(b)]) == 0
    for name, where, scale, cause, words in (
            ("mlp3", lambda m: m.model.layers[3].mlp, 1.5, "layer", "the first state out of the noise trend is layer4"),
            ("logits", lambda m: m.lm_head, 1.05, "logprobs", "log-probs differ beyond the noise")):
        engine = copy.deepcopy(fp32)
        rs.scaled_output(where(engine), scale)
        rb = rs.rollout(work / f"autocast-{name}.rollout.h5", engine, prompts=ps, new_tokens=NEW)
        tb = rs.trainer(work / f"autocast-{name}.train.h5", fp32, rb, ps, autocast=torch.bfloat16)
        for a, b in ((tb, rb), (rb, tb)):
            got = triage(str(a), str(b))
            assert got.cause == cause and words in got.headline, got.text()
            assert got.weights is not None and got.weights["differ"] is None


def test_roles_come_from_the_traces_not_the_argument_order(work, fp32):
    """A bf16 engine that served these tokens under weight step 1 (the trainer's weights) and then
    received step 2 for later requests: the trainer's weights are compared with step 1 whichever
    trace is named first, and the correct pair exits 0 both ways."""
    w1 = rs.updated(fp32)
    w2 = rs.updated(w1, seed=1)
    md = rs.save(w1, work / "roles-w1")
    engine = copy.deepcopy(w1).to(torch.bfloat16)
    steps = [(fp32, "start"), (w1, "update_weights_from_tensor")]
    r = rs.rollout(work / "roles.rollout.h5", engine, prompts=_prompts()[:4], new_tokens=NEW, weight_steps=steps,
                   later=[(w2, "update_weights_from_tensor")])
    t = rs.train_from_serve(work / "roles.train.h5", r, md)
    for a, b in ((t, r), (r, t)):
        got = triage(str(a), str(b))
        assert got.cause == "agree" and got.exit_code == 0, got.text()
        assert got.weights is not None and got.weights["steps"] == [1] and got.weights["differ"] is None
        assert (got.train, got.rollout) == (str(t), str(r))


def test_temperature_not_applied(work, fp32):
    """The engine returns raw log-probs (vLLM V1's default) while the trainer divides by T."""
    t, r = _pair(work, "raw", fp32, logprobs_mode="raw", temperature=0.7)
    got = triage(str(t), str(r))
    assert got.cause == "logprobs", got.text()
    assert got.headline.startswith("log-probs: the rollout's log-probs are raw (the model's log-softmax, no "
                                   "temperature) while the trainer's are divided by the temperature (0.7)")
    assert got.logprobs is not None and got.logprobs.raw_match == "b_raw"
    assert "match the trainer's raw ones" in got.headline
    assert main(["triage", str(t), str(r)]) == 1


def test_recorded_temperatures_that_differ_come_first(work, fp32):
    """The engine sampled at T 0.7, the trainer divides by 0.8: both traces record their
    temperature, and the first sentence says so, in either order."""
    r = work / "fp32.rollout.h5"       # the correct pair's rollout, at T 0.7
    if not r.exists():
        r = rs.rollout(r, fp32, prompts=_prompts(), new_tokens=NEW, temperature=0.7)
    t = rs.train_from_serve(work / "temp.train.h5", r, None, "--temperature", "0.8")
    for a, b in ((t, r), (r, t)):
        got = triage(str(a), str(b))
        assert got.cause == "sampling" and got.exit_code == 1, got.text()
        assert got.headline.startswith("sampling: the trainer divides the logits by temperature 0.8 while the rollout "
                                       "sampled at 0.7 (their recorded sampling, 8 of 8 sequences)"), got.headline


def test_an_offset_with_equal_recorded_temperatures_offers_no_temperature(work, fp32):
    """The engine returns its log-probs renormalised over a top-5 it does not record, both sides
    at T 0.7: a systematic offset, and the sentence does not offer a temperature applied on one
    side only (the recorded temperatures are equal)."""
    t, r = _pair(work, "topk", fp32, top_k=5)
    got = triage(str(t), str(r))
    assert got.cause == "logprobs", got.text()
    assert "systematic offset" in got.headline and "temperature applied on one side" not in got.headline
    assert "the recorded sampling is the same on both sides (trainer temperature 0.7, rollout 0.7" in got.headline


def test_bf16_lm_head(work, fp32):
    """An fp32 engine whose lm_head runs in bf16 against the fp32 trainer: states identical, the
    gap appears at the logits. The head's bf16 weight is the exact cast of the trainer's: weights
    are not the cause."""
    t, r = _pair(work, "head", rs.bf16_head(copy.deepcopy(fp32)))
    got = triage(str(t), str(r))
    assert got.cause == "logits", got.text()
    assert got.headline.startswith("logits: the states agree but the logits do not")
    assert "lm_head dtype" in got.headline
    assert got.weights is not None and got.weights["differ"] is None


def test_stale_layer_after_weight_update(work, fp32):
    """The engine receives the trainer's update (weight step 1) but layer 3's down_proj stays at
    step 0's values."""
    w1 = rs.updated(fp32)
    engine = copy.deepcopy(w1)
    engine.model.layers[3].mlp.down_proj.weight.data.copy_(fp32.model.layers[3].mlp.down_proj.weight.data)
    model_dir = rs.save(w1, work / "w1")
    t, r = _pair(work, "stale", engine, model_dir=model_dir,
                 weight_steps=[(fp32, "start"), (engine, "update_weights_from_tensor")])
    got = triage(str(t), str(r))
    assert got.cause == "weights", got.text()
    assert got.headline.startswith("weights: layer3 mlp_out (model.layers.3.mlp.down_proj.weight) is stale on the "
                                   "engine after weight update step 1 (update_weights_from_tensor): it still holds "
                                   "step 0's values")
    assert "(1 of 75 parameters differ)" in got.headline
    assert triage(str(r), str(t)).headline == got.headline      # the rollout named first: the same sentence
    # the states confirm it: the first state out of the noise is the stale layer's output
    assert any("layer4" in line for line in got.lines)


def test_a_whole_step_behind(work, fp32):
    """Every parameter one weight step behind the trainer's: an update the engine recorded but
    never applied (its step 1 holds step 0's values), and tokens generated before the engine
    received the trainer's weights (step 1, recorded after them). Named as the step served, in
    both orders, not as the first parameter in forward order."""
    w1 = rs.updated(fp32)
    md = rs.save(w1, work / "behind-w1")
    t, r = _pair(work, "behind", fp32, model_dir=md, weight_steps=[(fp32, "start"), (fp32, "update_weights_from_tensor")])
    t2, r2 = _pair(work, "early", fp32, model_dir=md, later=[(w1, "update_weights_from_tensor")])
    for a, b in ((t, r), (r, t)):
        got = triage(str(a), str(b))
        assert got.cause == "weights", got.text()
        assert got.headline.startswith("weights: the engine serves step 0's weights: after weight update step 1 "
                                       "(update_weights_from_tensor) every parameter still holds step 0's values "
                                       "(75 of 75 parameters differ from the trainer's)"), got.headline
    for a, b in ((t2, r2), (r2, t2)):
        got = triage(str(a), str(b))
        assert got.cause == "weights", got.text()
        assert got.headline.startswith("weights: the engine serves step 0's weights: these tokens were generated under "
                                       "weight step 0, and the trainer's weights are the engine's step 1 "
                                       "(update_weights_from_tensor), which it held only after them"), got.headline


def test_mixed_policy_versions_inside_the_sequences(work, fp32):
    """An in-flight weight update: every sequence generated in lockstep, the engine's weights
    replaced by the trainer's before the 7th decode pass. The sentence says the sequences straddle
    the update and which positions ran which step, in both orders (not that the tokens were all
    generated under step 0)."""
    ps = _prompts()[:6]
    w1 = rs.updated(fp32)
    md = rs.save(w1, work / "inflight-w1")
    r = rs.inflight_rollout(work / "inflight.rollout.h5", copy.deepcopy(fp32), w1, update_at=6, prompts=ps,
                            new_tokens=NEW)
    t = rs.train_from_serve(work / "inflight.train.h5", r, md)
    n = len(ps[0]) + 5          # pass j feeds position len + j - 1: pass 6 is the first under step 1
    for a, b in ((t, r), (r, t)):
        got = triage(str(a), str(b))
        assert got.cause == "weights", got.text()
        assert got.headline.startswith("weights: mixed policy versions inside the sequences: 6 of 6 sequences were "
                                       "generated across a weight update (update_weights_from_tensor, in flight): "
                                       f"sequence p0 positions 0-{n - 1} under step 0, positions {n}-{len(ps[0]) + NEW - 2} "
                                       "under step 1"), got.headline
        assert "the trainer's weights are step 1's: 36 of the 72 sampled tokens were generated under step 0" in \
            got.headline


def test_drift_over_training_steps(work, fp32):
    """Four training steps (one Adam update each); from step 2 on the engine's sync misses layer 3's
    down_proj, which stays at step 1's values while the trainer moves on: steps 0 and 1 agree, step
    2 is named as the first step out of the noise, with its cause (the stale parameter), and the
    mismatch grows from step 0 to the last."""
    from tensordiff.rl.triage import drift

    ps = _prompts()[:4]
    ws = [fp32]
    for k in range(3):
        ws.append(rs.updated(ws[-1], seed=k))
    pairs = []
    for k, w in enumerate(ws):
        engine = copy.deepcopy(w)
        if k >= 2:
            engine.model.layers[3].mlp.down_proj.weight.data.copy_(ws[1].model.layers[3].mlp.down_proj.weight.data)
        r = rs.rollout(work / f"drift{k}.rollout.h5", engine, prompts=ps, new_tokens=NEW)
        t = rs.trainer(work / f"drift{k}.train.h5", w, r, ps)
        pairs.append((str(t), str(r)))
    got = drift(pairs)
    assert got["first"] == 2, got
    assert [x["cause"] for x in got["steps"]] == ["agree", "agree", "weights", "weights"], got["steps"]
    assert got["headline"].startswith("drift: the pairs agree up to step 1 and leave the noise at step 2 (mean "
                                      "|logprob diff| "), got["headline"]
    assert "at step 2: weights: layer3 mlp_out" in got["headline"], got["headline"]
    lp = [x["mean_abs_logprob_diff"] for x in got["steps"]]
    assert lp[3] > lp[2] > 10 * lp[0], lp


def test_rope_theta_mismatch(work):
    """The engine's config says another rope theta: zero error at position 0, growing with position."""
    from transformers import LlamaForCausalLM

    md = rs.with_config(work / "rope", rope_parameters={"rope_theta": 500000.0})
    engine = LlamaForCausalLM.from_pretrained(str(md), dtype=torch.float32).eval()
    t, r = _pair(work, "rope", engine)
    got = triage(str(t), str(r))
    assert got.cause == "layer", got.text()
    assert got.headline.startswith("positions: layer1 is the first state out of the noise, and its error is zero at "
                                   "position 0 and grows with position")
    assert "rope theta" in got.headline


def test_missing_position_ids(work, fp32):
    """A user's trainer forward (TrainerRecorder) packs each prompt from two segments and restarts
    the position ids at the second (a packing bug): every sequence agrees up to there."""
    from tensordiff.recorders.core import Recorder
    from tensordiff.recorders.hf import model_info
    from tensordiff.recorders.hooks import TrainerRecorder
    from tensordiff.recorders.train_cli import load_serve_sequences

    r = rs.rollout(work / "pos.rollout.h5", fp32, prompts=_prompts(), new_tokens=NEW)
    seqs = dict(load_serve_sequences(str(r)))
    out = work / "pos.train.h5"
    with Recorder(str(out), side="train", model=model_info(fp32)) as rec:
        tr = TrainerRecorder(fp32, rec, temperature=0.7)
        for i, p in enumerate(_prompts()):
            ids = torch.tensor(seqs[f"p{i}"])
            cut = len(p) // 2
            pos = torch.cat([torch.arange(cut), torch.arange(len(ids) - cut)])
            with tr.sequence(f"p{i}", ids, first_generated=len(p)), torch.inference_mode():
                fp32(input_ids=ids[None], position_ids=pos[None])
        tr.detach()
    got = triage(str(out), str(r))
    assert got.cause == "layer", got.text()
    n = len(_prompts()[0]) // 2
    assert got.headline.startswith(f"positions: layer1 is the first state out of the noise, and every sequence "
                                   f"agrees up to position {n} and diverges from there on at once")
    assert "position_ids" in got.headline
    # and the same trainer forward with the right positions agrees
    ok = work / "pos.ok.h5"
    with Recorder(str(ok), side="train", model=model_info(fp32)) as rec:
        tr = TrainerRecorder(fp32, rec, temperature=0.7)
        for i, p in enumerate(_prompts()):
            ids = torch.tensor(seqs[f"p{i}"])
            with tr.sequence(f"p{i}", ids, first_generated=len(p)), torch.inference_mode():
                fp32(input_ids=ids[None])
        tr.detach()
    assert triage(str(ok), str(r)).cause == "agree"


def test_one_prompt_in_two_batches_pairs_by_request_id(work, fp32, tmp_path):
    """Two prompts each served in three batches (x, y, z: n samples of one prompt), the engine's
    prefix cache reusing a prompt served before (no rows for its cached positions); the trainer
    holds batch z only (from its outputs JSONL). Each trainer sequence pairs with the engine's
    request of the same id, not with another sample of its prompt: a correct pair, exit 0 in both
    orders."""
    from tensordiff.traceset import open_trace

    ps = trained.prompts()
    prompts = [ps[3], ps[5]] * 3
    keys = ["y-p3", "y-p5", "z-p3", "z-p5", "x-p3", "x-p5"]
    r = rs.rollout(work / "grpo.rollout.h5", fp32, prompts=prompts, keys=keys, new_tokens=NEW, prefix_cache=True)
    tr = open_trace(str(r))
    try:
        rows = tr.tokens
        served = {k: (rows["position"][rows["seq"] == q], rows["token"][rows["seq"] == q])
                  for q, k in enumerate(tr.sequences)}
    finally:
        tr.close()
    assert served["z-p3"][0].min() == len(ps[3]) - 1      # the cached prompt has no rows but its last token
    # the generated tokens the engine fed back (the last sampled one has no row to compare)
    out = {k: served[k][1][served[k][0] >= len(prompts[keys.index(k)])].tolist() for k in ("z-p3", "z-p5")}
    jsonl = tmp_path / "z.jsonl"
    jsonl.write_text("".join(json.dumps({"id": k, "input_ids": prompts[keys.index(k)], "output_ids": out[k]}) + "\n"
                             for k in out))
    t = rs.train_from_serve(work / "grpo.train.h5", jsonl, None, "--temperature", "0.7")
    for a, b in ((t, r), (r, t)):
        got = triage(str(a), str(b))
        assert got.cause == "agree", got.text()
        assert main(["triage", str(a), str(b)]) == 0


def _padded_trainer(out, model, serve, prompts, *, unmasked=None):
    """The trainer's forward over one left-padded micro-batch of the rollout's sequences
    (TrainerRecorder.batch), position ids from the mask; ``unmasked``: the sequence whose
    attention mask the forward lost (it attends its padding)."""
    from tensordiff.recorders.core import Recorder
    from tensordiff.recorders.hf import model_info
    from tensordiff.recorders.hooks import TrainerRecorder
    from tensordiff.recorders.train_cli import load_serve_sequences

    seqs = dict(load_serve_sequences(str(serve)))
    keys = [f"p{i}" for i in range(len(prompts))]
    width = max(len(seqs[k]) for k in keys)
    ids = torch.zeros(len(keys), width, dtype=torch.long)
    mask = torch.zeros(len(keys), width, dtype=torch.long)
    for b, k in enumerate(keys):
        ids[b, width - len(seqs[k]):] = torch.tensor(seqs[k])
        mask[b, width - len(seqs[k]):] = 1
    seen = mask.clone()
    if unmasked is not None:
        seen[keys.index(unmasked)] = 1
    with Recorder(str(out), side="train", model=model_info(model)) as rec:
        tr = TrainerRecorder(model, rec, temperature=0.7)
        with tr.batch(keys, ids, mask, first_generated=[len(p) for p in prompts]), torch.no_grad():
            model(input_ids=ids, attention_mask=seen, position_ids=(mask.cumsum(-1) - 1).clamp(min=0))
        tr.detach()
    return out


def test_one_sequence_of_a_padded_batch_lost_its_mask(work, fp32):
    """A left-padded micro-batch of prompts of other lengths; one sequence's attention mask is
    lost (it attends 9 pad tokens): the sentence names that sequence and its positions, offers
    neither rope nor packing, in both orders; the same batch with its mask agrees in both."""
    prompts = [p[: len(p) - 3 * i] for i, p in enumerate(_prompts())]
    r = rs.rollout(work / "mask.rollout.h5", fp32, prompts=prompts, new_tokens=NEW)
    ok = _padded_trainer(work / "mask.ok.h5", fp32, r, prompts)
    bad = _padded_trainer(work / "mask.bad.h5", fp32, r, prompts, unmasked="p3")
    n = len(prompts[3]) + NEW - 1       # the rollout's rows of p3: all but the last sampled token
    for a, b in ((ok, r), (r, ok)):
        assert triage(str(a), str(b)).cause == "agree"
        assert main(["triage", str(a), str(b)]) == 0
    for a, b in ((bad, r), (r, bad)):
        got = triage(str(a), str(b))
        assert got.cause == "layer", got.text()
        assert got.headline.startswith(f"sequences: layer1 is the first state out of the noise, and its error sits in "
                                       f"one sequence: sequence p3 positions 0-{n - 1} ({n} of its {n} tokens out of "
                                       "the noise"), got.headline
        assert "the other 7 sequences agree (100% of their tokens within the noise)" in got.headline
        assert "rope" not in got.headline and "packing" not in got.headline


def test_cli_json_and_bad_input(work, fp32, capsys, tmp_path):
    t, r = work / "fp32.train.h5", work / "fp32.rollout.h5"
    if not t.exists():
        t, r = _pair(work, "fp32", fp32)
    capsys.readouterr()
    assert main(["triage", str(t), str(r), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["cause"] == "agree" and d["exit_code"] == 0 and d["logprobs"]["metrics"]["token_mult_prob_error"] >= 1.0
    page = tmp_path / "triage.html"
    assert main(["triage", str(t), str(r), "--html", str(page)]) == 0
    text = page.read_text()
    assert text.startswith("<!DOCTYPE html>") and "no cause: weights, tokens and states agree" in text
    assert text.count("<svg") == 2 and "<script" not in text and "http" not in text.replace(
        'xmlns="http://www.w3.org/2000/svg"', "")
    assert main(["triage", str(t), str(r), "--html", str(t)]) == 2   # never overwrite an input
    assert "would overwrite an input" in capsys.readouterr().err
    assert main(["triage", str(t), str(tmp_path / "missing.h5")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "missing.h5" in err[0]
    # a trace of another model: one line, exit 2
    import numpy as np

    from tensordiff.trace import TraceWriter

    w = TraceWriter(str(tmp_path / "other.h5"), side="serve", producer="test", model={"num_layers": 3, "hidden_size": 8})
    w.add_tokens("p0", np.arange(4), np.arange(4), regime="decode")
    w.close()
    assert main(["triage", str(t), str(tmp_path / "other.h5")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert main(["triage", str(t)]) == 2
    assert "rollout" in capsys.readouterr().err.lower()


def test_routing_flips(work):
    """HF MoE on both sides (no CPU engine runs a trained MoE here: a tiny random DeepSeek-V3,
    tests/deepseek_support.py) with the routing recorder; the engine's router of layer 2 leaves
    out its score correction bias when it chooses (the weights hold it: fingerprints agree):
    choices flip where the bias decides, and the states leave the noise after it."""
    import deepseek_support as ds

    md = ds.make_tiny_deepseek(work / "moe")
    trainer_model, engine = ds.load_hf_deepseek(md), ds.load_hf_deepseek(md)
    gate = engine.model.layers[2].mlp.gate
    kept = gate.e_score_correction_bias.detach().clone()

    def drop_bias(mod, args):
        mod.e_score_correction_bias.zero_()

    def restore_bias(mod, args, out):
        mod.e_score_correction_bias.copy_(kept)

    gate.register_forward_pre_hook(drop_bias)
    gate.register_forward_hook(restore_bias)
    r = rs.rollout(work / "moe.rollout.h5", engine, prompts=_prompts(), new_tokens=NEW, model_path=md)
    t = rs.train_from_serve(work / "moe.train.h5", r, md)
    del trainer_model
    got = triage(str(t), str(r))
    assert got.cause == "routing", got.text()
    assert got.headline.startswith("routing: MoE router choices flip first at layer 2 (")
    assert "of tokens flip at least one layer, and the states leave the noise only after it" in got.headline
    assert got.routing is not None and got.routing["flips"] > 0
    assert any(line.startswith(("  the flips explain the log-prob gap: ", "  every sampled token comes at or after a flip"))
               for line in got.lines), got.text()


def test_decode_path_with_the_three_way_table(work, fp32):
    """The engine's decode passes read a KV cache stored in bf16 (its prefill computes attention
    from fresh keys and values): the prefill re-run agrees with the trainer, decode disagrees with
    both, and the three-way table says so."""
    r = rs.rollout(work / "kv.rollout.h5", fp32, prompts=_prompts(), new_tokens=NEW, kv_dtype=torch.bfloat16)
    t = rs.train_from_serve(work / "kv.train.h5", r)
    p = rs.replay(work / "kv.prefill.h5", fp32, r)
    alone = triage(str(t), str(r))   # without the re-run: two explanations, and how to tell them apart
    assert alone.cause == "layer", alone.text()
    assert "exactly where the rollout's decode passes start" in alone.headline
    assert "a prefill re-run of the same tokens (record serve --replay, the third argument)" in alone.headline
    got = triage(str(t), str(r), str(p))
    assert got.cause == "layer", got.text()
    assert got.headline.startswith("the engine's decode path: its decode passes disagree with its own prefill "
                                   "re-run of the same tokens")
    rows = {(x["a"], x["b"]): x for x in got.three_way}
    assert rows[("trainer", "prefill")]["agree"] and not rows[("trainer", "decode")]["agree"]
    assert any(line.startswith("  three-way") for line in got.lines)
    assert main(["triage", str(t), str(r), str(p)]) == 1


def test_processed_rollout_against_raw_log_probs_both_ways(work, fp32):
    """At T 0.7, each side's log-probs of another temperature: a rollout that returns processed
    log-probs against a trainer that divides by nothing (temperature 1 recorded), and a rollout
    that returns raw ones against a trainer at the rollout's temperature that records no top-k
    (TrainerRecorder): each named from the recorded sampling, in both orders."""
    ps = _prompts()
    r = work / "fp32.rollout.h5"       # processed at T 0.7
    if not r.exists():
        r = rs.rollout(r, fp32, prompts=ps, new_tokens=NEW)
    t1 = rs.trainer(work / "raw-trainer.train.h5", fp32, r, ps, temperature=1.0)
    raw = rs.rollout(work / "rawmode.rollout.h5", fp32, prompts=ps, new_tokens=NEW, logprobs_mode="raw")
    t07 = rs.trainer(work / "rawmode.train.h5", fp32, raw, ps, temperature=0.7)
    for a, b in ((t1, r), (r, t1)):
        got = triage(str(a), str(b))
        assert got.cause == "sampling", got.text()
        assert got.headline.startswith("sampling: the rollout's log-probs are processed, at temperature 0.7 (of the "
                                       "distribution it sampled from, its recorded logprobs_mode), while the "
                                       "trainer's are raw"), got.headline
    for a, b in ((t07, raw), (raw, t07)):
        got = triage(str(a), str(b))
        assert got.cause == "logprobs", got.text()
        assert got.headline.startswith("log-probs: the rollout's log-probs are raw (the model's log-softmax, no "
                                       "temperature) while the trainer's are divided by the temperature (0.7), as "
                                       "their recorded sampling says"), got.headline


def test_decode_path_at_temperature_against_a_raw_prefill_rerun(work, fp32):
    """The rollout at T 0.7 returns processed log-probs; its prefill re-run records raw ones (as
    SGLang's input log-probs are). The three-way table compares like with like (raw, from the
    top-k; by the states where a trainer records no top-k): a decode-only KV-cache bug is named as
    the engine's decode path in both orders, and the correct engine's pair exits 0 in both."""
    ps = _prompts()
    ok = work / "fp32.rollout.h5"
    if not ok.exists():
        ok = rs.rollout(ok, fp32, prompts=ps, new_tokens=NEW)
    kv = rs.rollout(work / "kvraw.rollout.h5", fp32, prompts=ps, new_tokens=NEW, kv_dtype=torch.bfloat16)
    for name, r in (("ok", ok), ("kv", kv)):
        p = rs.replay(work / f"{name}raw.prefill.h5", fp32, r, logprobs_mode="raw")
        trainers = [rs.train_from_serve(work / f"{name}raw.train.h5", r)]
        if name == "kv":
            trainers.append(rs.trainer(work / f"{name}raw.own.h5", fp32, r, ps))   # no top-k
        for t in trainers:
            for a, b in ((t, r), (r, t)):
                got = triage(str(a), str(b), str(p))
                rows = {(x["a"], x["b"]): x for x in got.three_way}
                if name == "ok":
                    assert got.cause == "agree" and all(x["agree"] for x in got.three_way), got.text()
                    assert main(["triage", str(a), str(b), str(p)]) == 0
                    continue
                assert got.cause == "layer", got.text()
                assert got.headline.startswith("the engine's decode path: its decode passes disagree with its own "
                                               "prefill re-run of the same tokens (token_mult_prob_error "), got.headline
                assert rows[("trainer", "prefill")]["agree"] and not rows[("prefill", "decode")]["agree"]
                assert rows[("prefill", "decode")]["basis"] == "raw", got.text()
                assert rows[("trainer", "prefill")]["basis"] == ("raw" if t == trainers[0] else "states")


def test_a_token_both_engines_computed_in_other_regimes_names_both(work, fp32):
    """Rollout against its prefill replay: the failing rows are decode rows of the rollout that the
    replay recomputed as prefill. The sentence and the JSON name both regimes, in either order;
    against the trainer (no engine regime) they name the engine's alone, as before."""
    from tensordiff.diff import DiffOptions, diff_traces

    r = rs.rollout(work / "kvr.rollout.h5", fp32, prompts=_prompts(), new_tokens=NEW, kv_dtype=torch.bfloat16)
    p = rs.replay(work / "kvr.prefill.h5", fp32, r)
    t = rs.train_from_serve(work / "kvr.train.h5", r)
    for a, b, words in ((r, p, "decode on A, prefill on B"), (p, r, "prefill on A, decode on B")):
        res = diff_traces(str(a), str(b), DiffOptions())
        first = res.first_divergence
        assert first is not None and first.token is not None, [f.message for f in res.findings]
        assert f", {words})" in first.message, first.message
        d = first.to_dict()
        assert (d["regime_a"], d["regime"]) == tuple(words.replace(" on A", "").replace(" on B", "").split(", "))
        worst = res.to_dict()["worst_tokens"][0]
        assert {worst["regime"], worst["regime_a"]} == {"decode", "prefill"}
    for a, b in ((t, r), (r, t)):
        res = diff_traces(str(a), str(b), DiffOptions())
        assert all("regime_a" not in f.to_dict() for f in res.findings)
        assert all("regime_a" not in w for w in res.to_dict()["worst_tokens"])
        assert " on A" not in res.first_divergence.message and " on B)" not in res.first_divergence.message
