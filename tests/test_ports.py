"""An HF reference against an HF "port" with one bug each, on the trained tiny Llama
(tests/trained.py), recorded by the real `tensordiff record train`, the way a user finds it: the
plain diff names the first boundary out of the noise, the zoom into the layer before it names the
op, and the first sentence says what kind of difference that op shows. The correct bf16 port
agrees (exit 0), plain and zoomed."""

from __future__ import annotations

import json
import re

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import trained  # noqa: E402

from tensordiff.cli import main  # noqa: E402
from tensordiff.diff import diff_traces  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.slow]


def _variant(root, name, edit=None, config=None):
    return trained.edited_target(root, name, edit, config)


def _swap_gate_up(m):
    for layer in m.model.layers:
        g, u = layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight
        tmp = g.detach().clone()
        g.copy_(u)
        u.copy_(tmp)


def _interleaved_rotary(q, k, cos, sin, unsqueeze_dim=1):
    """A port that applies the rotary to interleaved pairs (2j, 2j+1) of HF's rotate-half weights."""
    half = cos.shape[-1] // 2
    c = cos[..., :half].repeat_interleave(2, -1).unsqueeze(unsqueeze_dim)
    s = sin[..., :half].repeat_interleave(2, -1).unsqueeze(unsqueeze_dim)

    def rot(x):
        return torch.stack((-x[..., 1::2], x[..., 0::2]), -1).flatten(-2)

    return q * c + rot(q) * s, k * c + rot(k) * s


def _at_next_position(apply):
    """A port whose query is rotated at position p+1 (its keys at p): ``apply`` is HF's own
    ``apply_rotary_pos_emb``, given the cos/sin of angle + one position's frequencies."""
    def rotated(q, k, cos, sin, unsqueeze_dim=1):
        hd = cos.shape[-1]
        inv = 1.0 / (10000.0 ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
        f = torch.cat((inv, inv)).to(cos.dtype)
        c1, s1 = cos * f.cos() - sin * f.sin(), sin * f.cos() + cos * f.sin()
        return apply(q, k, c1, s1, unsqueeze_dim)[0], apply(q, k, cos, sin, unsqueeze_dim)[1]
    return rotated


def _residual_after_norm(self, hidden_states, attention_mask=None, position_ids=None, past_key_values=None,
                         use_cache=False, position_embeddings=None, **kwargs):
    """A port that takes the residual after the input norm (HF: before it)."""
    hidden_states = self.input_layernorm(hidden_states)
    residual = hidden_states
    attn, _ = self.self_attn(hidden_states=hidden_states, attention_mask=attention_mask, position_ids=position_ids,
                             past_key_values=past_key_values, use_cache=use_cache,
                             position_embeddings=position_embeddings, **kwargs)
    hidden_states = residual + attn
    residual = hidden_states
    return residual + self.mlp(self.post_attention_layernorm(hidden_states))


def _scale_by_head_dim(model):
    for layer in model.model.layers:
        layer.self_attn.scaling = 1.0 / layer.self_attn.head_dim


def _tiled_kv(hidden, n_rep):
    """A port whose query head h reads key/value head h % kv_heads (HF: h // n_rep)."""
    return hidden if n_rep == 1 else hidden.repeat(1, n_rep, 1, 1)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("ports")


def _record(out, model, *extra, dtype="float32"):
    argv = ["record", "train", "--model", str(model), "--prompts", str(trained.prompts_path()), "--out", str(out),
            "--no-progress", "--topk", "0", "--values", "all", "--dtype", dtype, *extra]
    assert main(argv) == 0, argv
    return out


_REF: dict[tuple[str, ...], object] = {}


def _ref(root, *extra):
    if extra not in _REF:
        _REF[extra] = _record(root / f"ref{''.join(extra).replace('-', '_')}.h5", trained.target_dir(), *extra)
    return _REF[extra]


def _port(root, monkeypatch, name, case):
    """(plain diff, zoomed diff or None) of the port ``case``."""
    model = trained.target_dir()
    if case.get("weights") or case.get("config"):
        model = _variant(root, name, case.get("weights"), case.get("config"))
    refs = {layer: _ref(root, *(("--zoom", f"layer{layer}") if layer is not None else ())) for layer in (None, 0, 3)}
    for target, attr, value in case.get("patch", ()):   # the port's code bug: after the references are recorded
        monkeypatch.setattr(target, attr, value)
    if case.get("load"):
        from tensordiff.recorders import train_cli
        orig = train_cli._load_model

        def loaded(*a, **k):
            m = orig(*a, **k)
            case["load"](m)
            return m

        monkeypatch.setattr(train_cli, "_load_model", loaded)
    plain = diff_traces(str(refs[None]), str(_record(root / f"{name}.h5", model)))
    first = plain.first_divergence
    assert first is not None, f"{name}: the plain diff finds nothing"
    m = re.fullmatch(r"layer(\d+)", first.tensor or "")
    if not m:
        return plain, None
    b = int(m.group(1)) - 1
    zoomed = diff_traces(str(refs[b] if b in refs else _ref(root, "--zoom", f"layer{b}")),
                         str(_record(root / f"{name}-z{b}.h5", model, "--zoom", f"layer{b}")))
    return plain, zoomed


def _cases():
    from transformers.integrations import sdpa_attention
    from transformers.models.llama import modeling_llama

    def norm_skipped(model):
        model.model.norm = torch.nn.Identity()

    return {
        "rope_theta": dict(config={"rope_parameters": {"rope_theta": 20000.0, "rope_type": "default"}}),
        "rope_interleaved": dict(patch=[(modeling_llama, "apply_rotary_pos_emb", _interleaved_rotary)]),
        "norm_eps": dict(config={"rms_norm_eps": 1e-3}),
        "gqa_order": dict(patch=[(sdpa_attention, "use_gqa_in_sdpa", lambda *a, **k: False),
                                 (sdpa_attention, "repeat_kv", _tiled_kv), (modeling_llama, "repeat_kv", _tiled_kv)]),
        "mlp_scaled": dict(weights=lambda m: m.model.layers[3].mlp.down_proj.weight.mul_(1.05)),
        "gate_up_swapped": dict(weights=_swap_gate_up),
        "final_norm_skipped": dict(load=norm_skipped),
        "attn_scale": dict(load=_scale_by_head_dim),
        # look-alikes: a weight scaled after the attention is no softmax scale, a norm weight no add
        "o_proj_scaled": dict(weights=lambda m: m.model.layers[0].self_attn.o_proj.weight.mul_(1.05)),
        "mlp_norm_weight": dict(weights=lambda m: m.model.layers[0].post_attention_layernorm.weight.mul_(
            1 + 0.05 * torch.randn(m.model.layers[0].post_attention_layernorm.weight.shape,
                                   generator=torch.Generator().manual_seed(3)))),
        "activation": dict(config={"hidden_act": "gelu_pytorch_tanh"}),
        "residual_after_norm": dict(patch=[(modeling_llama.LlamaDecoderLayer, "forward", _residual_after_norm)]),
        "q_at_next_position": dict(patch=[(modeling_llama, "apply_rotary_pos_emb",
                                           _at_next_position(modeling_llama.apply_rotary_pos_emb))]),
    }


# what the first sentence of each port's diff must say (op, signature, parameter)
EXPECT = {
    "rope_theta": ("layer0.q_rope", "rotary", ["rope theta: A 1e+04, B 2e+04",
                                               "the models' configs: rope_theta is 10000 on A and 20000 on B"]),
    "rope_interleaved": ("layer0.q_rope", "rotary", ["layout", "interleaved"]),
    "norm_eps": ("layer0.attn_norm", "norm_eps", ["eps 0.001", "norm_eps is 1e-05 on A and 0.001 on B"]),
    "gqa_order": ("layer0.attn_out", "gqa", ["kv head h // rep", "h % kv_heads"]),
    "mlp_scaled": ("layer3.mlp_out", "scale", ["scaled by 1.05"]),
    "gate_up_swapped": ("layer0.mlp_gate", "swap", ["B's mlp_gate holds A's mlp_up"]),
    "final_norm_skipped": ("final_norm", None, ["final_norm on B holds layer8"]),
    "attn_scale": ("layer0.attn_out", "attn_scale", ["A 1/sqrt(head_dim) = 0.25, B 1/head_dim = 0.0625"]),
    "o_proj_scaled": ("layer0.attn_out", "scale", ["scaled by 1.05"]),
    "mlp_norm_weight": ("layer0.mlp_norm", "per_channel", ["per-channel ratio"]),
    "activation": ("layer0.mlp_act", "activation", ["A silu, B gelu_pytorch_tanh"]),
    "residual_after_norm": ("layer0.mlp_norm", "residual", ["B attn_norm + attn_out"]),
    "q_at_next_position": ("layer0.q_rope", "rope_offset", ["B's are offset by +1"]),
}
# the same ports diffed the other way round (the port as A): what the first sentence says then
REVERSED = {
    "attn_scale": ["A 1/head_dim = 0.0625, B 1/sqrt(head_dim) = 0.25"],
    "activation": ["A gelu_pytorch_tanh, B silu", "activation is gelu_pytorch_tanh on A and silu on B"],
    "q_at_next_position": ["B's are offset by -1"],
    "residual_after_norm": ["A normalises attn_norm + attn_out", "B embed + attn_out"],
}


@pytest.mark.parametrize("name", list(EXPECT))
def test_port_bug_is_named_by_op_and_signature(root, monkeypatch, name):
    case = _cases()[name]
    plain, zoomed = _port(root, monkeypatch, name, case)
    op, kind, words = EXPECT[name]
    res = zoomed or plain
    assert res.exit_code == 1
    f = res.first_divergence
    head = res.headline()
    assert f.tensor == op, head
    if kind is not None:
        assert f.kind == "signature" and f.details.signature == kind, head
    for w in words:
        assert w in head, head
    print(f"{name}: plain: {plain.headline()}\n  zoomed: {head}")
    if name in REVERSED:
        rev = diff_traces(zoomed.path_b, zoomed.path_a)
        assert rev.exit_code == 1 and rev.first_divergence.tensor == op, rev.headline()
        assert rev.first_divergence.details.signature == kind, rev.headline()
        for w in REVERSED[name]:
            assert w in rev.headline(), rev.headline()
        print(f"  reversed: {rev.headline()}")
    if name != "final_norm_skipped":
        # every layer of these ports computes something else: no boundary of B "holds" another
        # boundary of A (a spread that wide is the bug, not a noise floor to match within)
        assert plain.first_divergence.kind != "slot_identity", plain.headline()
    if zoomed is not None:
        d = json.loads(json.dumps(zoomed.to_dict()))
        assert d["first_divergence"]["kind"] == ("signature" if kind else d["first_divergence"]["kind"])
        # the op graph of the zoomed layer: the first op marked, what is before it agrees
        from tensordiff.report import opgraph
        from tensordiff.report.html import render_html
        layer, tap = int(op.split(".")[0][5:]), op.split(".")[1]
        assert opgraph.zoomed_layers(zoomed) == [layer]
        line = opgraph.line(zoomed, layer)
        assert f"{tap} ✗!" in line and f"layer {layer}: " in line, line
        before = line.split(f"{tap} ✗!")[0]
        assert "✗" not in before, line
        page = render_html(zoomed)
        assert f'class="op op-first" data-op="{op}"' in page
        from tensordiff.tui.text import op_graph_lines
        tui = op_graph_lines(zoomed, op)
        assert len(tui) == 1 and f"{tap} ✗!" in tui.pop().plain


def test_correct_bf16_port_agrees(root):
    """The same weights run in bfloat16 against the float32 reference: no divergence, plain and
    zoomed into a middle layer."""
    plain = diff_traces(str(_ref(root)), str(_record(root / "bf16.h5", trained.target_dir(), dtype="bfloat16")))
    assert plain.exit_code == 0, plain.headline()
    zoomed = diff_traces(str(_ref(root, "--zoom", "layer3")),
                         str(_record(root / "bf16-z3.h5", trained.target_dir(), "--zoom", "layer3", dtype="bfloat16")))
    assert zoomed.exit_code == 0, zoomed.headline()


def test_q_and_k_rotated_at_the_next_position_is_a_note(root, monkeypatch):
    """q and k both rotated at p+1: attention depends only on their distance, so attn_out and every
    later state agree. q_rope and k_rope differ, a note (exit 0), both orders."""
    from transformers.models.llama import modeling_llama

    ref = _ref(root, "--zoom", "layer0")
    orig = modeling_llama.LlamaRotaryEmbedding.forward
    monkeypatch.setattr(modeling_llama.LlamaRotaryEmbedding, "forward",
                        lambda self, x, position_ids: orig(self, x, position_ids + 1))
    port = _record(root / "qk-next-z0.h5", trained.target_dir(), "--zoom", "layer0")
    for a, b in ((ref, port), (port, ref)):
        res = diff_traces(str(a), str(b))
        assert res.exit_code == 0, res.headline()
        note = next(f for f in res.findings if f.kind == "signature")
        assert note.severity == "info" and note.tensor == "layer0.q_rope", note.message
        assert note.details.params["absorbed"] == "layer0.attn_out", note.message
        assert "nothing after it does" in note.message, note.message
        assert "q and k both rotated at positions offset by" in note.message, note.message
        assert {f.tensor for f in res.findings if f.kind == "numeric"} >= {"layer0.q_rope", "layer0.k_rope"}
        print(note.message)


def test_no_kind_fits_names_the_misses_and_a_weights_command_that_runs(root, capsys):
    """up_proj's weights of layer 0 perturbed elementwise: no kind fits mlp_up. The sentence lists
    each kind tried with its residual, and the weights command with the two traces' model
    directories, which runs as printed and names the parameter (both orders)."""
    import shlex

    g = torch.Generator().manual_seed(5)
    model = _variant(root, "up_noise", edit=lambda m: m.model.layers[0].mlp.up_proj.weight.mul_(
        1 + 0.01 * torch.randn(m.model.layers[0].mlp.up_proj.weight.shape, generator=g)))
    ref = _ref(root, "--zoom", "layer0")
    port = _record(root / "up_noise-z0.h5", model, "--zoom", "layer0")
    for a, b, dirs in ((ref, port, (trained.target_dir(), model)), (port, ref, (model, trained.target_dir()))):
        res = diff_traces(str(a), str(b))
        f = res.first_divergence
        assert res.exit_code == 1 and f.tensor == "layer0.mlp_up" and f.details.signature == "op", res.headline()
        tried = f.details.params["tried"]
        assert {"swap", "scale", "per_channel"} <= set(tried), tried
        head = res.headline()
        for k, v in tried.items():
            assert f"{k} {v:.3g}" in head and v > f.details.params["tolerance"], head
        cmd = f"tensordiff weights {shlex.quote(str(dirs[0]))} {shlex.quote(str(dirs[1]))}"
        assert f"compare the weights: {cmd}" in head, head
        print(head)
        capsys.readouterr()
        assert main(shlex.split(cmd)[1:]) == 1
        out = capsys.readouterr().out
        assert "first at layer0 mlp_up (model.layers.0.mlp.up_proj.weight)" in out.splitlines()[0], out


def test_a_port_of_the_same_weights_says_so_instead_of_a_weights_command():
    """A code bug (the weights are one directory): where no kind fits, the pointer says the
    weights are the same rather than printing a comparison that finds nothing."""
    from tensordiff.signatures import weights_command

    class Src:
        def __init__(self, path):
            self.model = {"path": path}

    d = str(trained.target_dir())
    assert "the weights are the same" in weights_command(Src(d), Src(d))
    # a recorded path is hostile input: escapes, wrong types, huge strings give no command
    for bad in ("\x1b[31m/x", 5, ["a"], "/x" * 5000, "", None):
        got = weights_command(Src(bad), Src(d))
        assert "A recorded no model directory" in got and "\x1b" not in got, got
    assert "not on this machine" in weights_command(Src("/nonexistent/m"), Src(d))


# ports whose bug is a config setting: the plain diff's first sentence names it, both orders
CONFIG = {
    "rope_theta": ("rope_theta is 10000 on A and 20000 on B", "rope_theta is 20000 on A and 10000 on B"),
    "norm_eps": ("norm_eps is 1e-05 on A and 0.001 on B", "norm_eps is 0.001 on A and 1e-05 on B"),
    "activation": ("activation is silu on A and gelu_pytorch_tanh on B", "activation is gelu_pytorch_tanh on A and silu on B"),
}


@pytest.mark.parametrize("name", list(CONFIG))
def test_a_config_port_names_the_setting_first(root, name):
    case = _cases()[name]
    port = root / f"{name}.h5"
    if not port.exists():
        _record(port, _variant(root, name, case.get("weights"), case.get("config")))
    ref = _ref(root)
    for (a, b), words in zip(((ref, port), (port, ref)), CONFIG[name]):
        res = diff_traces(str(a), str(b))
        assert res.exit_code == 1 and res.first_divergence.tensor == "layer1", res.headline()
        assert res.headline().startswith(words + ": the models' recorded configs differ"), res.headline()
        print(res.headline())
