"""`tensordiff import` for files other engines write: vLLM's extract_hidden_states connector
(``<req_id>.safetensors``), TensorRT-LLM's saved hidden states (``{prefix}_{iter}.pt`` lists) and
NVIDIA Model-Optimizer's collect_hidden_states (``{conversation_id}.pt``). The files are written
here in those layouts from known states, so every slot's identity is known exactly."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.torch
torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

H = 16
N = 8


def _states(T: int, seed: int) -> dict:
    """Fake boundaries 0..N and the post-norm state for T tokens, each distinct."""
    g = torch.Generator().manual_seed(seed)
    st = {b: torch.randn(T, H, generator=g) * (1 + b) for b in range(N + 1)}
    st["final_norm"] = torch.randn(T, H, generator=g)
    return st


class _Proc:
    def __init__(self, returncode, stdout, stderr):
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


@pytest.fixture
def _td(capsys):
    """`tensordiff ...` in this process (the CLI's own main: exit code, stdout, stderr)."""
    from tensordiff.cli import main

    def run(*args):
        capsys.readouterr()
        rc = main([str(a) for a in args])
        out = capsys.readouterr()
        return _Proc(rc, out.out, out.err)
    return run


def _reader(path):
    from tensordiff.trace import TraceReader
    return TraceReader(str(path))


def _write_vllm(d: Path, ids_cfg, seqs: dict) -> dict:
    from safetensors.torch import save_file

    d.mkdir(parents=True, exist_ok=True)
    states = {}
    for i, (rid, toks) in enumerate(seqs.items()):
        st = _states(len(toks), i)
        states[rid] = st
        hs = torch.stack([st[b] for b in sorted(set(ids_cfg))], dim=1)  # [T, K, H] in sorted layer order
        name = f"{rid}-{i:08x}"  # vLLM's internal request id: <external id>-<8 hex>
        save_file({"hidden_states": hs, "token_ids": torch.tensor(toks, dtype=torch.int64)}, str(d / f"{name}.safetensors"))
        (d / f"{name}.safetensors.lock").write_text("")
    return states


def test_import_vllm_extract_hidden_states(tmp_path, _td):
    seqs = {"req-a": [5, 6, 7, 8, 9], "req-b": [1, 2, 3]}
    states = _write_vllm(tmp_path / "hs", [5, 2, 7], seqs)
    out = tmp_path / "v.h5"
    proc = _td("import", "vllm-hidden-states", str(tmp_path / "hs"), "--aux-ids", "5", "2", "7", "--num-layers", "8",
               "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "imported 2 vllm-hidden-states file(s): 2 sequence(s), 8 token rows" in proc.stdout, proc.stdout
    with _reader(out) as r:
        assert r.side == "serve" and r.hidden_size == H and r.num_layers == N
        info = r.tensors["aux_hidden_states"]
        assert info.slot_labels == ["layer2", "layer5", "layer7"] and info.raw_ids == [5, 2, 7]
        assert (info.role, info.token_offset, info.convention) == ("aux", 0, "vllm")
        assert "slots permuted by sorting" in r.user_meta["capture_order_note"]
        assert sorted(r.sequences) == ["req-a", "req-b"]  # keyed by the external request id
        vals = r.read_values("aux_hidden_states")
        t = r.tokens
        rows = r.token_rows("aux_hidden_states")
        for j, row in enumerate(rows):
            seq, p = r.sequences[t["seq"][row]], int(t["position"][row])
            assert int(t["token"][row]) == seqs[seq][p]
            for k, b in enumerate([2, 5, 7]):
                np.testing.assert_array_equal(vals[j, k * H:(k + 1) * H], states[seq][b][p].numpy())
    # detected without naming the format; ids from a draft config (vLLM reads the top-level key first)
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [5, 2, 7]}}))
    proc = _td("import", str(tmp_path / "hs"), "--draft-config", str(cfg), "--out", str(tmp_path / "v2.h5"))
    assert proc.returncode == 0 and "vllm-hidden-states" in proc.stdout, proc.stderr


def test_import_trtllm_saved_hidden_states(tmp_path, _td):
    d = tmp_path / "trt"
    d.mkdir()
    seqs = {7: [3, 4, 5, 6], 9: [8, 9]}
    ids_cfg = [-1, 3, 1]  # output of layers 1 and 3, and the final post-norm state (sorted, -1 last)
    records, states = [], {}
    for i, (rid, toks) in enumerate(seqs.items()):
        st = _states(len(toks), 10 + i)
        states[str(rid)] = st
        feats = torch.cat([st[2], st[4], st["final_norm"]], dim=-1)
        records.append({"id": rid, "input_ids": torch.tensor(toks), "hidden_state": feats[:, -H:].clone(),
                        "hidden_state_features": feats})
    torch.save(records, d / "data_0.pt")
    out = tmp_path / "t.h5"
    proc = _td("import", str(d), "--aux-ids", *map(str, ids_cfg), "--num-layers", "8", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "imported" in proc.stdout and "trtllm" in proc.stdout, proc.stdout
    with _reader(out) as r:
        info = r.tensors["aux_hidden_states"]
        assert info.slot_labels == ["layer2", "layer4", "final_norm"] and info.convention == "trtllm"
        assert "final_norm" in r.tensors  # hidden_state: the last H columns = the post-norm state here
        t = r.tokens
        rows = r.token_rows("aux_hidden_states")
        vals = r.read_values("aux_hidden_states")
        fn = r.read_values("final_norm")
        for j, row in enumerate(rows):
            seq, p = r.sequences[t["seq"][row]], int(t["position"][row])
            np.testing.assert_array_equal(vals[j, :H], states[seq][2][p].numpy())
            np.testing.assert_array_equal(fn[j], states[seq]["final_norm"][p].numpy())
    # without -1 the last column block is a boundary, and hidden_state is recorded as that boundary
    for rec in records:
        rec["hidden_state_features"] = rec["hidden_state_features"][:, :2 * H].clone()
        rec["hidden_state"] = rec["hidden_state_features"][:, -H:].clone()
    torch.save(records, d / "data_0.pt")
    proc = _td("import", "trtllm", str(d), "--aux-ids", "1", "3", "--num-layers", "8", "--out", str(tmp_path / "t2.h5"))
    assert proc.returncode == 0, proc.stderr
    with _reader(tmp_path / "t2.h5") as r:
        assert r.tensors["aux_hidden_states"].slot_labels == ["layer2", "layer4"] and "layer4" in r.tensors


def test_import_modelopt_collect_hidden_states(tmp_path, _td):
    d = tmp_path / "mo"
    d.mkdir()
    toks = [11, 12, 13, 14, 15, 16]
    st = _states(len(toks), 3)
    # HF boundaries sorted(set([2, N//2, N-3])) = [2, 4, 5]; hidden_states is the post-norm state
    torch.save({"conversation_id": "conv-1", "input_ids": torch.tensor([toks]),
                "hidden_states": st["final_norm"], "aux_hidden_states": torch.cat([st[2], st[4], st[5]], dim=-1)},
               d / "conv-1.pt")
    out = tmp_path / "m.h5"
    proc = _td("import", str(d), "--num-layers", "8", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    with _reader(out) as r:
        assert r.side == "train"
        info = r.tensors["draft_input"]
        assert info.slot_labels == ["layer2", "layer4", "layer5"] and info.convention == "modelopt"
        assert (info.role, info.token_offset) == ("draft_input", 1)
        rows = r.token_rows("draft_input")
        assert len(rows) == len(toks) - 1  # row t pairs with token t+1: none for the last
        np.testing.assert_array_equal(r.read_values("draft_input")[:, H:2 * H], st[4][:-1].numpy())
        np.testing.assert_array_equal(r.read_values("final_norm"), st["final_norm"].numpy())
        assert list(r.sequences) == ["conv-1"]


@pytest.mark.parametrize("case", ["no-ids", "wrong-count", "not-safetensors", "pickle", "bad-shape", "no-outdir"])
def test_engine_import_bad_input_is_one_line_exit_2(tmp_path, case, _td):
    d = tmp_path / "hs"
    _write_vllm(d, [2, 4], {"r": [1, 2, 3]})
    argv = ["import", "vllm-hidden-states", str(d), "--aux-ids", "2", "4", "--out", str(tmp_path / "o.h5")]
    if case == "no-ids":
        argv = argv[:3] + argv[6:]
    elif case == "wrong-count":
        argv[4:6] = ["1", "2", "3"]
    elif case == "not-safetensors":
        next(d.glob("*.safetensors")).write_bytes(b"\x00" * 3)
    elif case == "pickle":
        import datetime
        import pickle
        p = tmp_path / "trt"  # a pickled object: refused by torch.load(weights_only=True)
        p.mkdir()
        (p / "x.pt").write_bytes(pickle.dumps([{"hidden_state_features": datetime.date(2026, 1, 1)}], protocol=2))
        argv = ["import", "trtllm", str(p), "--aux-ids", "1", "--out", str(tmp_path / "o.h5")]
    elif case == "bad-shape":
        from safetensors.torch import save_file
        save_file({"hidden_states": torch.zeros(2, 2, H), "token_ids": torch.tensor([1, 2, 3])},
                  str(next(d.glob("*.safetensors"))))
    elif case == "no-outdir":
        argv[-1] = str(tmp_path / "nodir" / "o.h5")
    proc = _td(*argv)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    if case == "pickle":
        assert "weights_only" in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert not (tmp_path / "o.h5").exists()
