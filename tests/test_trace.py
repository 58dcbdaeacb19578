"""Round trips of the trace format: every dtype, shape, ragged append pattern and metadata
survive writing and reading; bf16 bit for bit."""

import json

import h5py
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tensordiff.dtypes import bf16_bits_to_f32, f32_to_bf16_bits, storage_dtype
from tensordiff.errors import TraceFileError
from tensordiff.sketch import sketch_np
from tensordiff.trace import SCHEMA_VERSION, SlotSpec, TraceReader, TraceWriter
from tensordiff.trace.schema import ALIGN_BYTES

DTYPES = ["bfloat16", "float16", "float32", "float64"]


def _random_stored(rng, n, width, dtype):
    if dtype == "bfloat16":
        bits = rng.integers(0, 2**16, size=(n, width), dtype=np.uint16)
        # keep NaN payloads too: bf16 must survive bit for bit, whatever the bits
        return bits
    return rng.standard_normal((n, width)).astype(storage_dtype(dtype))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(dtype=st.sampled_from(DTYPES), width=st.integers(1, 300),
       appends=st.lists(st.integers(0, 70), min_size=1, max_size=12),
       flush_rows=st.sampled_from([None, 1, 7, 64]))
def test_roundtrip_ragged_appends(tmp_path_factory, dtype, width, appends, flush_rows):
    path = tmp_path_factory.mktemp("rt") / "t.h5"
    rng = np.random.default_rng(width * 31 + len(appends))
    written, positions = [], []
    with TraceWriter(path, side="serve", model={"num_layers": 2, "hidden_size": width},
                     flush_rows=flush_rows, sketch_dim=8) as w:
        w.define_tensor("x", width, kind="other", dtype=dtype)
        pos = 0
        for step, n in enumerate(appends):
            rows = w.add_tokens(f"req-{step % 3}", np.arange(pos, pos + n), rng.integers(0, 1000, n),
                                "decode", step=step)
            pos += n
            block = _random_stored(rng, n, width, dtype)
            w.append("x", rows, block)
            written.append(block)
            positions.append(rows)
    r = TraceReader(path)
    total = sum(appends)
    assert r.complete and r.tensors["x"].rows == total and len(r.tokens) == total
    got = r.read_values("x", raw=True)
    want = np.concatenate(written) if total else np.empty((0, width), storage_dtype(dtype))
    assert got.dtype == storage_dtype(dtype)
    assert got.tobytes() == want.tobytes()  # bit for bit, NaN payloads included
    np.testing.assert_array_equal(r.token_rows("x"), np.arange(total))
    if total:
        idx = rng.permutation(total)[: min(total, 17)]
        assert r.read_values_at("x", idx, raw=True).tobytes() == want[idx].tobytes()
        assert r.read_values("x", 1, total - 1, raw=True).tobytes() == want[1:total - 1].tobytes()
    r.close()


def test_bf16_bits_exact_and_conversion(tmp_path):
    x = np.array([[0.0, -0.0, 1.0, -2.5, np.inf, -np.inf, np.nan, 3.140625, 1e-40, 65504.0]], np.float32)
    bits = f32_to_bf16_bits(x)
    back = bf16_bits_to_f32(bits)
    assert np.isnan(back[0, 6]) and np.isinf(back[0, 4]) and back[0, 4] > 0
    np.testing.assert_array_equal(back[0, [0, 1, 2, 3, 7]], [0.0, -0.0, 1.0, -2.5, 3.140625])
    with TraceWriter(tmp_path / "b.h5", model={"hidden_size": 10}) as w:
        w.define_tensor("t", 10, dtype="bfloat16")
        w.append("t", w.add_tokens("s", [0], [1], "train"), bits)
    with h5py.File(tmp_path / "b.h5") as f:  # what other tools see: uint16 + a dtype attribute
        ds = f["tensors/t/values"]
        assert ds.dtype == np.uint16 and ds.attrs["dtype"] == "bfloat16"
    with TraceReader(tmp_path / "b.h5") as r:
        assert r.read_values("t", raw=True).tobytes() == bits.tobytes()
        np.testing.assert_array_equal(np.isnan(r.read_values("t")), np.isnan(back))


def test_metadata_slots_sketch_rms_roundtrip(tmp_path):
    H = 16
    meta = {"run": "nightly", "nested": {"a": [1, 2]}, "unicode": "αβ"}
    model = {"num_layers": 4, "hidden_size": H, "dtype": "float32", "architecture": "LlamaForCausalLM"}
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 3 * H)).astype(np.float32)
    with TraceWriter(tmp_path / "m.h5", side="train", producer="test", model=model, meta=meta,
                     sketch_dim=32, sketch_seed=7) as w:
        w.define_tensor("draft_input", 3 * H, kind="packed",
                        slots=SlotSpec(["embed", "layer3", "final_norm"], raw_ids=[2, 4, 6], convention="speculators-legacy"),
                        token_offset=1, role="draft_input", attrs={"note": "fed to fc"})
        w.define_tensor("layer2", H, kind="boundary", boundary=2, values=False, role="catalog")
        rows = w.add_tokens("sample-0", range(5), [1, 2, 3, 4, 5], "train")
        w.append("draft_input", rows, x)
        w.append("layer2", rows, sketch=sketch_np(x[:, :H], H, 32, 7), rms=np.ones(5, np.float32))
        w.set_attr(None, "capture", {"layers_to_capture": [3, 5, 7]})
    r = TraceReader(tmp_path / "m.h5")
    assert (r.side, r.producer, r.user_meta, r.model) == ("train", "test", meta, model)
    assert r.versions["tensordiff"] and r.versions["h5py"] == h5py.__version__
    d = r.tensors["draft_input"]
    assert (d.kind, d.slot_count, d.slot_width, d.slot_labels, d.raw_ids, d.convention, d.token_offset, d.role) == \
        ("packed", 3, H, ["embed", "layer3", "final_norm"], [2, 4, 6], "speculators-legacy", 1, "draft_input")
    assert d.attrs == {"note": "fed to fc"}
    assert r.tensors["layer2"].boundary == 2 and not r.tensors["layer2"].has_values
    np.testing.assert_allclose(r.read_sketch("draft_input")[:, :32], sketch_np(x[:, :H], H, 32, 7), rtol=1e-5)
    np.testing.assert_allclose(r.read_rms("draft_input")[:, 0], np.sqrt((x[:, :H] ** 2).mean(1)), rtol=1e-5)
    assert list(r.tokens["token"]) == [1, 2, 3, 4, 5] and r.sequences == ["sample-0"]
    s = r.summary()
    json.dumps(s)
    assert s["tensors"][0]["name"] == "layer2"  # forward order
    r.close()


def test_writer_rejects_bad_definitions(tmp_path):
    with TraceWriter(tmp_path / "x.h5", model={"hidden_size": 8}) as w:
        with pytest.raises(ValueError, match="not a multiple"):
            w.define_tensor("p", 12, kind="packed", slots=SlotSpec(["embed"]))
        with pytest.raises(ValueError, match="labels"):
            w.define_tensor("p", 16, kind="packed", slots=SlotSpec(["embed"]))
        with pytest.raises(ValueError, match="not a state label"):
            w.define_tensor("p", 8, kind="packed", slots=SlotSpec(["layerX"]))
        w.define_tensor("t", 8)
        rows = w.add_tokens("s", [0], [0], "train")
        with pytest.raises(ValueError, match="shape"):
            w.append("t", rows, np.zeros((1, 9), np.float32))
        with pytest.raises(ValueError, match="token table"):
            w.append("t", [5], np.zeros((1, 8), np.float32))


def test_reader_unknown_schema_and_not_a_trace(tmp_path):
    p = tmp_path / "t.h5"
    with TraceWriter(p, model={"hidden_size": 4}) as w:
        w.define_tensor("t", 4)
    with h5py.File(p, "a") as f:
        f.attrs["tensordiff_schema"] = SCHEMA_VERSION + 98
    with pytest.raises(TraceFileError, match="unknown trace schema version 99"):
        TraceReader(p)
    q = tmp_path / "plain.h5"
    with h5py.File(q, "w") as f:
        f["x"] = np.zeros(3)
    with pytest.raises(TraceFileError, match="not a tensordiff trace"):
        TraceReader(q)


def test_appends_keep_memory_bounded(tmp_path):
    """Decode-sized appends buffer at most one chunk per dataset."""
    with TraceWriter(tmp_path / "c.h5", model={"hidden_size": 4096}, sketch_dim=16) as w:
        w.define_tensor("h", 4096, dtype="bfloat16", sketch=False)
        rng = np.random.default_rng(1)
        for step in range(300):
            rows = w.add_tokens("r", [step], [step], "decode", step=step)
            w.append("h", rows, rng.integers(0, 2**16, (1, 4096), dtype=np.uint16))
        app = w._tensors["h"]["values"]
        assert app.buf.nbytes == app.chunk * 4096 * 2 <= ALIGN_BYTES and app.fill < app.chunk   # one chunk
    with TraceReader(tmp_path / "c.h5") as r:
        assert r.tensors["h"].rows == 300
