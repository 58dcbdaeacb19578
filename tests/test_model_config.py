"""The model configuration that changes numerics (tensordiff.model_config): taken from a real HF
config, stored in the trace's ``model`` attribute, read back as hostile input (wrong types, huge
numbers, deep or huge JSON, terminal escapes), and named first by the diff when a difference
explains the first divergence (both orders); a difference that cannot explain it is not named."""

from __future__ import annotations

import json

import h5py
import numpy as np
import pytest

from tensordiff import model_config
from tensordiff.diff import diff_traces
from tensordiff.sketch import sketch_np
from tensordiff.trace import TraceWriter
from tracegen import assert_clean_exit, run_isolated

H = 32


def _pair(d, config_a, config_b, *, bad_from=1, name="p", values=True):
    """Two traces of embed, layer1, layer2 on the same tokens: B's states from boundary
    ``bad_from`` on differ by 10% (``bad_from`` None: they agree to 1e-7); ``values`` False:
    sketches only."""
    rng = np.random.default_rng(0)
    states = [rng.standard_normal((3, 16, H)).astype(np.float32) for _ in range(3)]
    paths = []
    for side, cfg in (("train", config_a), ("serve", config_b)):
        p = str(d / f"{name}-{side}.h5")
        model = {"num_layers": 2, "hidden_size": H}
        if cfg is not None:
            model["config"] = cfg
        with TraceWriter(p, side=side, model=model, sketch_dim=8) as w:
            for b in range(3):
                w.define_tensor("embed" if b == 0 else f"layer{b}", H, kind="boundary", boundary=b, values=values)
            r = np.random.default_rng(1)
            for s in range(3):
                rows = w.add_tokens(f"s{s}", np.arange(16), np.arange(16) + 5 + s,
                                    "train" if side == "train" else "prefill")
                for b in range(3):
                    x = states[b][s]
                    if side == "serve":
                        bad = bad_from is not None and b >= bad_from
                        x = x * (1 + (0.1 if bad else 1e-7) * r.standard_normal(x.shape).astype(np.float32))
                    if values:
                        w.append("embed" if b == 0 else f"layer{b}", rows, x)
                    else:
                        w.append("embed" if b == 0 else f"layer{b}", rows, sketch=sketch_np(x, H, 8),
                                 rms=np.sqrt((x ** 2).mean(1)))
        paths.append(p)
    return paths


def test_an_hf_config_is_recorded_with_the_numerics_settings():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
                                   hidden_act="silu", rope_parameters={"rope_theta": 500000.0, "rope_type": "default"})
    got = model_config.from_config(cfg, "bfloat16")
    assert got == {"rope_theta": 500000.0, "rope_type": "default", "norm_eps": 1e-5, "heads": 4, "kv_heads": 2,
                   "head_dim": 16, "activation": "silu", "tie_word_embeddings": False, "dtype": "bfloat16"}, got
    # a config.json dict with the older rope_scaling: linear factor 4
    got = model_config.from_config({"rope_theta": 1e4, "rope_scaling": {"type": "linear", "factor": 4.0}})
    assert got["rope_type"] == "linear" and got["rope_factor"] == 4.0 and got["rope_theta"] == 1e4


@pytest.mark.parametrize("bad", [
    {"rope_theta": "1e4"}, {"rope_theta": True}, {"rope_theta": float("inf")}, {"rope_theta": 1e301},
    {"heads": 2.5}, {"heads": 1 << 62}, {"heads": -0.0}, {"activation": "\x1b[31msilu"}, {"activation": "x" * 65},
    {"activation": ["silu"]}, {"tie_word_embeddings": 1}, {"dtype": {"a": 1}}, {"norm_eps": None},
    {"rope_theta": 10 ** 400}, {"norm_eps": -(10 ** 4000)}, {"activation": "silu\u202e"},
])
def test_read_drops_each_hostile_value(bad):
    assert model_config.read({"config": {**bad, "unknown": 1}}) == {}
    assert model_config.read({"config": [bad]}) == {} and model_config.read("x") == {}


def test_a_config_difference_that_explains_the_first_divergence_leads(tmp_path):
    a, b = _pair(tmp_path, {"rope_theta": 500000.0, "norm_eps": 1e-5, "dtype": "float32"},
                 {"rope_theta": 10000.0, "norm_eps": 1e-5, "dtype": "bfloat16"})
    for x, y, words in ((a, b, "rope_theta is 500000 on A and 10000 on B"),
                        (b, a, "rope_theta is 10000 on A and 500000 on B")):
        res = diff_traces(x, y)
        assert res.exit_code == 1
        head = res.headline()
        assert head.startswith(words + ": the models' recorded configs differ"), head
        assert "dtype" not in head and "norm_eps" not in head, head   # not a cause / the same
        assert res.first_divergence.tensor == "layer1"
        assert res.first_divergence.details.params == {"config": {"rope_theta": [float(json.loads(words.split()[2])),
                                                                                 float(words.split()[6])]}}


def test_a_config_difference_leads_whatever_the_traces_recorded(tmp_path):
    """Sketches only (no full values: no op's signature can be read): the recorded config
    difference that explains the first divergence is still named first, in both orders."""
    a, b = _pair(tmp_path, {"rope_theta": 500000.0}, {"rope_theta": 10000.0}, name="sk", values=False)
    for x, y, words in ((a, b, "rope_theta is 500000 on A and 10000 on B"),
                        (b, a, "rope_theta is 10000 on A and 500000 on B")):
        res = diff_traces(x, y)
        assert res.exit_code == 1 and all(p.basis == "sketch" for p in res.pairs)
        assert res.headline().startswith(words + ": the models' recorded configs differ"), res.headline()
        assert res.first_divergence.kind == "signature" and res.first_divergence.tensor == "layer1"
        assert res.findings[1].inherited_from == 0   # the numeric divergence it explains follows it


def test_a_config_difference_is_not_named_where_it_cannot_be_the_cause(tmp_path):
    # the first divergence at layer2 (layer1 agrees): a setting every layer uses would show at layer1
    a, b = _pair(tmp_path, {"rope_theta": 500000.0}, {"rope_theta": 10000.0}, bad_from=2)
    res = diff_traces(a, b)
    assert res.exit_code == 1 and res.first_divergence.tensor == "layer2"
    assert "rope_theta" not in res.headline(), res.headline()


def test_a_config_difference_no_state_shows_is_still_a_divergence(tmp_path):
    """No compared state moved past its allowance, but the recorded configs differ in a setting
    every layer computes with: the two sides run different functions, and a difference spread
    over every layer can stay under an allowance nothing before it measured (a served rope theta
    1.6x the trainer's read "agree" at 10x the noise). Named at the first state it acts on, both
    orders; a dtype difference alone stays an agree (a correct pair may differ in it)."""
    a, b = _pair(tmp_path, {"rope_theta": 500000.0}, {"rope_theta": 10000.0}, bad_from=None, name="ok")
    for x, y, words in ((a, b, "rope_theta is 500000 on A and 10000 on B"),
                        (b, a, "rope_theta is 10000 on A and 500000 on B")):
        res = diff_traces(x, y)
        assert res.exit_code == 1, res.headline()
        assert res.headline().startswith(words + ": the models' recorded configs differ"), res.headline()
        assert "within its allowance" in res.headline() and res.first_divergence.tensor == "layer1"
    a, b = _pair(tmp_path, {"rope_theta": 10000.0}, {"rope_theta": 10000.0}, bad_from=None, name="same")
    assert diff_traces(a, b).exit_code == 0


def _set_model(path, text):
    with h5py.File(path, "r+") as f:
        f.attrs.modify("model", text)


@pytest.mark.parametrize("case", ["escapes", "huge_numbers", "huge_int_for_a_float", "deep", "huge", "wrong_type"])
def test_a_crafted_config_attribute_is_one_clean_answer(tmp_path, case):
    """The config as a crafted file carries it: the diff answers (exit 1 on the divergence, or
    one line and exit 2 where the reader refuses the attribute), never a traceback, never an
    escape on the terminal, and names no config value it could not validate."""
    a, b = _pair(tmp_path, {"rope_theta": 10000.0}, {"rope_theta": 10000.0})
    base = {"num_layers": 2, "hidden_size": H}
    text = {
        "escapes": json.dumps({**base, "config": {"activation": "\x1b]0;pwned\x07\x1b[2J", "rope_theta": 500000.0,
                                                  "\x1b[31mheads": 3}}),
        "huge_numbers": json.dumps({**base, "config": {"rope_theta": 1e308, "heads": 10 ** 400, "head_dim": -1}}),
        "huge_int_for_a_float": json.dumps({**base, "config": {"rope_theta": 10 ** 400, "norm_eps": -10 ** 4000}}),
        "deep": json.dumps(base)[:-1] + ', "config": ' + "[" * 100000 + "]" * 100000 + "}",
        "huge": json.dumps({**base, "config": {"activation": "s" * (64 << 20)}}),
        "wrong_type": json.dumps({**base, "config": "rope_theta=500000"}),
    }[case]
    _set_model(b, text)
    rc, out, err = run_isolated(["diff", a, b], timeout=120)
    assert_clean_exit(rc, out, err, case)
    assert "\x1b" not in out and "\x1b" not in err and "\x07" not in out
    assert rc in (1, 2), (rc, out[-500:], err[-500:])
    print(case, rc, (err.strip() or out.splitlines()[0])[:200])
    if rc == 2:
        assert len(err.strip().splitlines()) == 1, err
    else:
        first = [ln for ln in out.splitlines() if ln.strip()][0]
        assert "rope_theta" not in first or case == "escapes", first
        if case == "escapes":   # the valid value is named, the escaped ones are not
            assert "rope_theta is 10000 on A and 500000 on B" in out, out[:800]
            assert "pwned" not in out and "heads" not in first, out[:800]


@pytest.mark.slow
def test_the_engine_plugins_record_the_engines_config():
    """The SGLang and vLLM plugins' model attribute (serving.model_facts) from SGLang's own
    ModelConfig of the trained model: the settings its HF config states, the engine's dtype."""
    pytest.importorskip("torch")
    mc_mod = pytest.importorskip("sglang.srt.configs.model_config")
    import trained

    from tensordiff.recorders.serving import model_facts

    mc = mc_mod.ModelConfig(model_path=str(trained.target_dir()))
    got = model_facts(mc, 8, 64, "LlamaForCausalLM", str(trained.target_dir()))
    dtype = str(mc.dtype).replace("torch.", "")
    assert got["config"] == {"rope_theta": 10000.0, "rope_type": "default", "norm_eps": 1e-5, "heads": 4, "kv_heads": 2,
                             "head_dim": 16, "activation": "silu", "tie_word_embeddings": False, "dtype": dtype}, got


# ----------------------------------------------------------------------------------------------
# The rotary frequencies the built model turns by


def _freqs(theta=10000.0, d=16):
    return [theta ** (-2 * j / d) for j in range(d // 2)]


def test_the_rotary_frequencies_compare_exactly_and_read_in_a_sentence():
    f = _freqs()
    a = model_config.read({"config": {"rope_freqs": f, "rope_freqs_dtype": "float32"}})
    assert a["rope_freqs"] == f
    # float32 rounding of a correct implementation is far under the tolerance
    same = [float(np.float32(x)) for x in f]
    assert model_config.differences(a, {"rope_freqs": same, "rope_freqs_dtype": "float32"}) == []
    # a theta off by 1e-3: the highest frequency index moves ~1e-3
    b = {"rope_freqs": _freqs(10000.0 * 1.001), "rope_freqs_dtype": "float32"}
    (key, va, vb), = model_config.differences(a, b)
    assert key == "rope_freqs" and va == f
    words = model_config.sentence([(key, va, vb)])
    assert words.startswith("the rotary frequencies differ (frequency 7 of 8: ") and "largest relative" in words
    assert len(words) < 140, words
    # the lowest quarter zeroed (partial rotary), a count that differs
    zeroed = f[:6] + [0.0, 0.0]
    assert model_config.differences(a, {"rope_freqs": zeroed})[0][0] == "rope_freqs"
    assert "8 on A, 4 on B" in model_config.sentence(model_config.differences(a, {"rope_freqs": f[:4]}))
    # held in bfloat16: its rounding is no difference; the dtype alone is never one
    bits = (np.asarray(f, np.float32).view(np.uint32) + np.uint32(0x8000)) & np.uint32(0xFFFF0000)
    bf = bits.view(np.float32).astype(np.float64).tolist()   # rounded to bfloat16
    assert model_config.differences(a, {"rope_freqs": bf, "rope_freqs_dtype": "bfloat16"}) == []
    # held in float16: a theta of 1e6 puts the lowest frequencies among its subnormals (few bits)
    big = _freqs(1e6)
    half = np.asarray(big, np.float16).astype(np.float64).tolist()
    assert half[-1] != big[-1] and abs(half[-1] - big[-1]) > 2.0 ** -10 * big[-1]
    assert model_config.differences({"rope_freqs": big}, {"rope_freqs": half, "rope_freqs_dtype": "float16"}) == []
    assert model_config.differences({"rope_freqs": big}, {"rope_freqs": np.asarray(_freqs(2e6), np.float16)
                                     .astype(np.float64).tolist(), "rope_freqs_dtype": "float16"}) != []
    assert model_config.explains("rope_freqs", "layer1") and not model_config.explains("rope_freqs_dtype", "layer1")


@pytest.mark.parametrize("bad", [[], [1.0, float("nan")], [1.0, "2"], [True], "1.0", [1e301], [1.0] * 4097])
def test_read_drops_hostile_rotary_frequencies(bad):
    assert model_config.read({"config": {"rope_freqs": bad}}) == {}


@pytest.fixture(scope="module")
def rope_traces(tmp_path_factory):
    """The trained tiny Llama recorded by the HF recorder: A (float32, eager), correct ports of it
    (float32 SDPA, bfloat16 SDPA) and B with its frequencies edited as the fuzzer does (theta
    1e-3 higher, the lowest quarter zeroed), config untouched."""
    pytest.importorskip("transformers")
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    from fuzz import bugs
    from fuzz import models as M

    d = tmp_path_factory.mktemp("rope")
    m = M.model("trained-llama")
    out = {}
    for name, dtype, attn, kind in (("a", "float32", "eager", None), ("sdpa", "float32", "sdpa", None),
                                    ("bf16", "bfloat16", "sdpa", None), ("theta", "float32", "sdpa", "rope_theta"),
                                    ("dims", "float32", "sdpa", "rotary_dims")):
        edit = bugs.inject(kind, m, bugs.Place(), 1e-3)[0] if kind else None
        out[name] = str(M.record(m, M.side_model(m, dtype, attn, edit), d / f"{name}.h5", "full"))
        if name in ("a", "theta"):   # the packed draft input alone, theta 1e-5 off: under every allowance
            small = bugs.inject(kind, m, bugs.Place(), 1e-5)[0] if kind else None
            out[f"{name}-packed"] = str(M.record(m, M.side_model(m, dtype, attn, small), d / f"{name}-p.h5", "packed"))
    return out


def test_edited_rotary_frequencies_are_named_first_in_both_orders(rope_traces):
    t = rope_traces
    for bug in ("theta", "dims"):
        for x, y in ((t["a"], t[bug]), (t[bug], t["a"])):
            res = diff_traces(x, y)
            head = res.headline()
            assert res.exit_code == 1, head
            assert head.startswith("the rotary frequencies differ (frequency "), head
            assert res.first_divergence.kind == "signature" and "rope_theta" not in head, head
    # only the packed draft input recorded, no state past its allowance: named at its shallowest slot, the
    # first compared state past layer 0
    for x, y in ((t["a-packed"], t["theta-packed"]), (t["theta-packed"], t["a-packed"])):
        res = diff_traces(x, y)
        head = res.headline()
        assert res.exit_code == 1 and head.startswith("the rotary frequencies differ (frequency "), head
        assert res.first_divergence.tensor == "draft_input" and res.first_divergence.slot == 0, head
        assert "slot 0 of draft_input moved" in head, head


def test_correct_ports_record_equal_rotary_frequencies(rope_traces):
    t = rope_traces
    fa = model_config.read(json.loads(h5py.File(t["a"], "r").attrs["model"]))
    assert len(fa["rope_freqs"]) == 8 and fa["rope_freqs_dtype"] == "float32"
    for other in ("sdpa", "bf16"):
        fb = model_config.read(json.loads(h5py.File(t[other], "r").attrs["model"]))
        assert [k for k, _, _ in model_config.differences(fa, fb) if k != "dtype"] == [], other
        for x, y in ((t["a"], t[other]), (t[other], t["a"])):
            res = diff_traces(x, y)
            assert res.exit_code == 0, res.headline()


def test_a_setting_named_differently_alone_is_no_divergence(tmp_path):
    """Engines spell the same rope or activation differently (SGLang's "deepseek_yarn" for HF's
    "yarn"): a label difference with every state inside its allowance is no divergence, in both
    orders; a measured setting beside it still is."""
    a, b = _pair(tmp_path, {"rope_type": "yarn"}, {"rope_type": "deepseek_yarn"}, bad_from=None, name="lbl")
    assert diff_traces(a, b).exit_code == 0 and diff_traces(b, a).exit_code == 0
    a, b = _pair(tmp_path, {"rope_type": "yarn", "norm_eps": 1e-6}, {"rope_type": "deepseek_yarn", "norm_eps": 1e-5},
                 bad_from=None, name="eps")
    for x, y in ((a, b), (b, a)):
        res = diff_traces(x, y)
        assert res.exit_code == 1 and "norm_eps" in res.headline() and "rope_type" not in res.headline(), res.headline()


def test_the_frequencies_are_not_named_beside_the_rope_setting_they_follow_from():
    from tensordiff import model_config as mc

    a = {"rope_theta": 10000.0, "rope_freqs": [1.0, 0.1]}
    b = {"rope_theta": 20000.0, "rope_freqs": [1.0, 0.07]}
    assert [k for k, _, _ in mc.differences(a, b)] == ["rope_theta"]
    assert [k for k, _, _ in mc.differences({"rope_freqs": [1.0, 0.1]}, {"rope_freqs": [1.0, 0.07]})] == ["rope_freqs"]
