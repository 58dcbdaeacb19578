"""The generic recorder core and the module-hook recorder: real torch tensors, real HDF5 traces."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tensordiff.dtypes import bf16_bits_to_f32
from tensordiff.recorders.core import Recorder, Sampling
from tensordiff.recorders.hooks import ModuleHookRecorder
from tensordiff.sketch import sketch_np
from tensordiff.trace import TraceReader

pytestmark = pytest.mark.torch

H = 32


def _rec(path, **kw):
    return Recorder(path, side="train", model={"num_layers": 4, "hidden_size": H}, **kw)


def test_values_sketch_rms_match_the_numpy_reference(tmp_path):
    torch.manual_seed(0)
    x = torch.randn(10, H) * 3
    p = tmp_path / "t.h5"
    with _rec(p) as rec:
        rows = rec.add_tokens("s", None, list(range(10)))
        assert rec.boundary(2, x, rows) == 10
    with TraceReader(p) as r:
        info = r.tensors["layer2"]
        assert (info.kind, info.boundary, info.role, info.dtype) == ("boundary", 2, "catalog", "float32")
        np.testing.assert_array_equal(r.read_values("layer2"), x.numpy())
        # the device-side sketch is the same projection as the numpy one (float rounding aside)
        np.testing.assert_allclose(r.read_sketch("layer2"), sketch_np(x.numpy(), H, r.sketch_dim, r.sketch_seed),
                                   rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(r.read_rms("layer2")[:, 0], x.pow(2).mean(-1).sqrt().numpy(), rtol=1e-5)
        assert r.complete


def test_bfloat16_is_stored_bit_exact(tmp_path):
    torch.manual_seed(1)
    x = torch.randn(2, 5, H).to(torch.bfloat16)
    p = tmp_path / "t.h5"
    with _rec(p) as rec:
        rows = np.concatenate([rec.add_tokens(f"s{i}", None, [1, 2, 3, 4, 5]) for i in range(2)]).reshape(2, 5)
        rec.record("act", x, rows)
    with TraceReader(p) as r:
        assert r.tensors["act"].dtype == "bfloat16"
        bits = r.read_values("act", raw=True)
        np.testing.assert_array_equal(bits, x.reshape(10, H).view(torch.int16).numpy().view(np.uint16))
        np.testing.assert_array_equal(bf16_bits_to_f32(bits), x.float().reshape(10, H).numpy())


def test_sampling_by_position_and_padding_rows(tmp_path):
    p = tmp_path / "t.h5"
    x = torch.arange(12 * H, dtype=torch.float32).reshape(12, H)
    with _rec(p, sample=Sampling(every=4, positions={5})) as rec:
        rows = rec.add_tokens("s", range(12), range(100, 112))
        rows = rows.copy()
        rows[8] = -1  # padding: never recorded
        rec.record("act", x, rows)
    with TraceReader(p) as r:
        pos = r.tokens["position"][r.token_rows("act")]
        assert pos.tolist() == [0, 4, 5]
        np.testing.assert_array_equal(r.read_values("act"), x[[0, 4, 5]].numpy())
    assert Sampling(every=0, positions=[3]).mask(np.arange(6)).tolist() == [False, False, False, True, False, False]


def test_name_filters_and_sketch_only_values(tmp_path):
    p = tmp_path / "t.h5"
    x = torch.randn(4, H)
    with _rec(p, include=["layer*", "final_norm"], exclude=["layer3"], values=["final_norm"]) as rec:
        rows = rec.add_tokens("s", None, [1, 2, 3, 4])
        for b in (1, 2, 3):
            rec.boundary(b, x, rows)
        rec.final_norm(x, rows)
        assert rec.record("other", x, rows) == 0
    with TraceReader(p) as r:
        assert sorted(r.tensors) == ["final_norm", "layer1", "layer2"]
        assert not r.tensors["layer1"].has_values and r.tensors["layer1"].has_sketch
        assert r.tensors["final_norm"].has_values


def test_packed_from_parts_records_slots_and_provenance(tmp_path):
    torch.manual_seed(2)
    parts = [torch.randn(6, H) for _ in range(3)]
    p = tmp_path / "t.h5"
    with _rec(p) as rec:
        rows = rec.add_tokens("s", None, range(6))
        drows = rows.copy()
        drows[-1] = -1                       # row t pairs with token t+1: none for the last
        rec.packed("draft_input", parts, drows, labels=["embed", "layer2", "layer4"], raw_ids=[0, 1, 3],
                   convention="specforge")
        with pytest.raises(ValueError, match="slot width"):
            rec.packed("bad", torch.randn(6, 3 * 16), drows, labels=["embed", "layer1", "layer2"])
        for _ in range(2):   # a slot list that failed is not remembered as checked: it fails every time
            with pytest.raises(ValueError, match="not a state label"):
                rec.packed("bad2", parts, drows, labels=["embed", "layerX", "layer2"])
        with pytest.raises(ValueError, match="token rows"):
            rec.record("short", torch.randn(5, H), rows)
    with TraceReader(p) as r:
        i = r.tensors["draft_input"]
        assert (i.kind, i.role, i.slot_count, i.slot_width, i.token_offset) == ("packed", "draft_input", 3, H, 1)
        assert i.slot_labels == ["embed", "layer2", "layer4"]
        assert (i.raw_ids, i.convention) == ([0, 1, 3], "specforge")
        np.testing.assert_array_equal(r.read_values("draft_input"), torch.cat(parts, -1)[:5].numpy())
        assert r.read_sketch("draft_input").shape == (5, 3 * r.sketch_dim)
        assert r.read_rms("draft_input").shape == (5, 3)


def test_exception_inside_the_block_leaves_a_readable_trace(tmp_path):
    p = tmp_path / "t.h5"
    with pytest.raises(RuntimeError, match="boom"), _rec(p) as rec:
        rows = rec.add_tokens("s", None, [1, 2])
        rec.boundary(0, torch.ones(2, H), rows)
        raise RuntimeError("boom")
    with TraceReader(p) as r:
        assert r.tensors["embed"].rows == 2
        assert "boom" in r.f.attrs["recording_error"]
        assert not r.complete and "interrupted" in r.recovered_note


def _tiny_llama(layers=4, seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=97, hidden_size=H, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, initializer_range=0.3,
                      max_position_embeddings=128)
    return LlamaForCausalLM(cfg).eval()


def test_module_hooks_record_layer_outputs_and_inputs(tmp_path):
    model = _tiny_llama()
    ids = torch.randint(0, 97, (1, 9))
    p = tmp_path / "t.h5"
    with _rec(p) as rec:
        with ModuleHookRecorder(model, rec, ["model.layers.*"], capture="both",
                                exclude=["model.layers.*.*"]) as hooks:
            hooks.tokens("s", ids[0])
            with torch.no_grad():
                out = model(ids, output_hidden_states=True)
        assert hooks.matched == [f"model.layers.{i}" for i in range(4)]
    with TraceReader(p) as r:
        for i in range(4):
            np.testing.assert_array_equal(r.read_values(f"model.layers.{i}.input"), out.hidden_states[i][0].numpy())
        for i in range(3):  # HF index 4 = N is post-norm; the last layer's output is pre-norm
            np.testing.assert_array_equal(r.read_values(f"model.layers.{i}.output"), out.hidden_states[i + 1][0].numpy())
        assert not np.array_equal(r.read_values("model.layers.3.output"), out.hidden_states[4][0].numpy())


def test_module_hooks_padded_batch_and_skipped_shapes(tmp_path):
    model = _tiny_llama(layers=2)
    ids = torch.randint(1, 97, (2, 6))
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, 4:] = 0  # right padding on the second sequence
    p = tmp_path / "t.h5"
    with _rec(p) as rec:
        hooks = ModuleHookRecorder(model, rec, ["model.layers.0", "model.rotary_emb"], capture="output",
                                   name_fn=lambda q, d: q.replace(".", "_"))
        rows = hooks.batch(["a", "b"], ids, mask)
        assert rows[1, 4:].tolist() == [-1, -1]
        with torch.no_grad(), pytest.warns(UserWarning, match="model_rotary_emb"):
            out = model(ids, attention_mask=mask, output_hidden_states=True)
        hooks.detach()
        with torch.no_grad():
            model(ids)  # detached: records nothing more
    assert "model_rotary_emb" in hooks.skipped
    with TraceReader(p) as r:
        assert r.tensors["model_layers_0"].rows == 10
        v = r.read_values("model_layers_0")
        np.testing.assert_array_equal(v[:6], out.hidden_states[1][0].numpy())
        np.testing.assert_array_equal(v[6:], out.hidden_states[1][1, :4].numpy())
        assert "model_rotary_emb" not in r.tensors


def test_draft_rows_and_sampling_properties():
    """draft row t exists iff tokens t and t+1 of the same sequence exist; sampling keeps exactly the
    positions asked, whatever the padding."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from tensordiff.recorders.hf import draft_rows

    @settings(max_examples=60, deadline=None)
    @given(st.lists(st.tuples(st.integers(0, 6), st.integers(0, 6), st.booleans()), min_size=1, max_size=4),
           st.integers(0, 4), st.sets(st.integers(0, 8), max_size=3))
    def check(seqs, every, extra):
        L = max(a + b for a, b, _ in seqs) or 1
        rows = np.full((len(seqs), L), -1, dtype=np.int64)
        nxt = 0
        for i, (lead, n, _) in enumerate(seqs):  # `lead` pads on the left, the rest on the right
            n = min(n, L - lead)
            rows[i, lead:lead + n] = np.arange(nxt, nxt + n)
            nxt += n
        d = draft_rows(rows)
        for i in range(len(seqs)):
            for t in range(L):
                want = rows[i, t] if t + 1 < L and rows[i, t] >= 0 and rows[i, t + 1] >= 0 else -1
                assert d[i, t] == want
        pos = np.arange(12)
        keep = Sampling(every=every, positions=extra).mask(pos)
        assert set(pos[keep].tolist()) == {p for p in range(12) if (every and p % every == 0) or p in extra}

    check()


# ----------------------------------------------------------------------------------------------
# Draft rows (token_offset 1) paired past the end of their sequence
# ----------------------------------------------------------------------------------------------


def test_a_draft_row_paired_past_the_sequence_end_is_refused(tmp_path):
    x = torch.randn(6, 3 * H)
    with _rec(tmp_path / "t.h5") as rec:
        rows = rec.add_tokens("s0", None, list(range(6)))
        with pytest.raises(ValueError, match=r"draft_input: 1 row paired past the end of its sequence \(sequence 's0', "
                                             r"position 5 pairs with position 6 .*draft_rows\[-1\] = -1"):
            rec.packed("draft_input", x, rows, labels=["layer1", "layer2", "layer3"])
        ok = rows.copy()
        ok[-1] = -1
        assert rec.packed("draft_input", x, ok, labels=["layer1", "layer2", "layer3"]) == 5
        # the same rule for the fc output and the draft's predictions, whatever token_offset a later call passes
        with pytest.raises(ValueError, match="draft_fc_output: 1 row paired past the end"):
            rec.record("draft_fc_output", x[:, :H], rows, role="draft_fc_output", token_offset=1)
        with pytest.raises(ValueError, match="draft_topk: 1 row paired past the end"):
            rec.predictions("draft_topk", torch.randn(6, 10), rows, k=3, token_offset=1)
        assert rec.predictions("draft_topk", torch.randn(6, 10), ok, k=3, token_offset=1) == 5
        with pytest.raises(ValueError, match="draft_input: 1 row paired past the end"):
            rec.packed("draft_input", x, rows, labels=["layer1", "layer2", "layer3"], token_offset=0)
        # a sequence recorded in chunks: its later tokens added first, then every row pairs
        r1 = rec.add_tokens("s1", range(4), [1, 2, 3, 4])
        r2 = rec.add_tokens("s1", range(4, 8), [5, 6, 7, 8])
        assert rec.packed("draft_input", x[:4], r1, labels=["layer1", "layer2", "layer3"]) == 4
        with pytest.raises(ValueError, match=r"'s1', position 7 pairs with position 8"):
            rec.packed("draft_input", x[:4], r2, labels=["layer1", "layer2", "layer3"])
        # serve regimes: the next token comes with a later step, not checked
        r3 = rec.add_tokens("req", [0], [9], regime="decode")
        assert rec.packed("draft_input", x[:1], r3, labels=["layer1", "layer2", "layer3"]) == 1
        # rows at offset 0 pair with their own token
        assert rec.boundary(1, x[:, :H], rows) == 6
    with TraceReader(tmp_path / "t.h5") as r:
        assert r.tensors["draft_input"].rows == 5 + 4 + 1


def _docs_loop() -> str:
    import re
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[1] / "docs" / "recorders.md").read_text()
    sec = doc[doc.index("## Python API: inside your own extractor loop"):]
    return re.search(r"```python\n(.*?)```", sec, re.DOTALL).group(1)


def test_the_docs_loop_records_every_boundary_and_refuses_a_forgotten_minus_one(tmp_path, monkeypatch):
    transformers = pytest.importorskip("transformers")
    from tensordiff.recorders.hf import HFExtractorRecorder, model_info

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=H, intermediate_size=64, num_hidden_layers=6,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(cfg).eval()
    loader = [("a", torch.randint(0, 64, (9,))), ("b", torch.randint(0, 64, (5,)))]
    code = _docs_loop()
    monkeypatch.chdir(tmp_path)
    with torch.no_grad():
        exec(compile(code, "docs/recorders.md", "exec"), {"model": model, "loader": loader})
    # the reference: the HF extractor recorder on the same model and tokens
    with Recorder(tmp_path / "ref.h5", side="train", model=model_info(model)) as rec:
        hf = HFExtractorRecorder(model, rec, None, values="all")
        for key, ids in loader:
            with hf.capture(key, ids), torch.no_grad():
                model(ids[None], output_hidden_states=True)
    with TraceReader(tmp_path / "train.h5") as r, TraceReader(tmp_path / "ref.h5") as ref:
        assert {f"layer{b}" for b in range(1, 7)} | {"embed", "final_norm", "draft_input"} <= set(r.tensors)
        for name in ["embed", *(f"layer{b}" for b in range(1, 7)), "final_norm"]:
            np.testing.assert_allclose(r.read_sketch(name), ref.read_sketch(name), rtol=1e-5, atol=1e-5, err_msg=name)
        assert r.tensors["draft_input"].rows == 8 + 4
    # the same loop without draft_rows[-1] = -1 is refused, with the fix in the message
    assert "draft_rows[-1] = -1" in code
    broken = code.replace("draft_rows[-1] = -1", "pass")
    with pytest.raises(ValueError, match=r"paired past the end of its sequence .*draft_rows\[-1\] = -1"), torch.no_grad():
        exec(compile(broken, "docs/recorders.md", "exec"), {"model": model, "loader": loader})


@pytest.mark.parametrize("regime", ["train", "decode"])
def test_add_token_runs_is_add_tokens_one_sequence_at_a_time(tmp_path, regime):
    """The serve plugins add a pass's rows with one call: the same rows, token table and sequence
    ends (a train run's draft row paired past its end is still refused) as one call per sequence."""
    seqs, counts = ["a", "b", "c", "b"], [3, 0, 2, 4]
    pos = np.array([0, 1, 2, 5, 6, 3, 4, 5, 6])
    tok = np.arange(9) * 11
    tables = []
    for i, batched in enumerate((False, True)):
        with _rec(tmp_path / f"t{i}.h5") as rec:
            rec.add_tokens("a", [7], [1], regime=regime)
            if batched:
                rows = rec.add_token_runs(seqs, counts, pos, tok, regime=regime, step=4)
            else:
                off, parts = 0, []
                for s, c in zip(seqs, counts):
                    if c:
                        parts.append(rec.add_tokens(s, pos[off:off + c], tok[off:off + c], regime=regime, step=4))
                    off += c
                rows = np.concatenate(parts)
            np.testing.assert_array_equal(rows, np.arange(1, 10))
            np.testing.assert_array_equal(rec.positions_of(rows), pos)
            if regime == "train":  # "c" ends at position 6: its last row cannot pair with a token t+1
                with pytest.raises(ValueError, match="'c', position 6 pairs with position 7"):
                    rec.record("draft_fc_output", torch.randn(2, H), rows[3:5], token_offset=1)
            with pytest.raises(ValueError, match="counted rows"):
                rec.add_token_runs(["a"], [2], pos[:3], tok[:3], regime=regime)
        with TraceReader(tmp_path / f"t{i}.h5") as r:
            tables.append((r.tokens[()], list(r.sequences)))
    np.testing.assert_array_equal(tables[0][0], tables[1][0])
    assert tables[0][1] == tables[1][1]


def test_the_public_recorder_api_has_no_speed_knobs():
    """remember / reuse / private are the serve plugins' (tensordiff.recorders.serving), not the
    public Recorder API that docs/recorders.md shows."""
    import inspect

    from tensordiff.recorders import serving
    from tensordiff.recorders.core import Recorder

    for meth in (Recorder.record, Recorder.packed, Recorder.boundary, Recorder.final_norm):
        assert not {"remember", "reuse", "private"} & set(inspect.signature(meth).parameters), meth.__name__
    for fn in (serving.record, serving.packed, serving.boundary, serving.final_norm):
        assert "private" in inspect.signature(fn).parameters
