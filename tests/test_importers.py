"""Importers (`tensordiff import`): SpecForge offline hidden states, speculators data files and SGLang
dumper directories, written here by the test in each tool's on-disk layout, then diffed."""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tensordiff.recorders.core import Recorder  # noqa: E402
from tensordiff.recorders.hf import HFExtractorRecorder, model_info, plan_draft_input  # noqa: E402
from tensordiff.recorders.importers import import_files, parse_dump_filename  # noqa: E402
from tensordiff.trace import TraceReader  # noqa: E402

pytestmark = pytest.mark.torch

N, H, V = 8, 64, 128


def _main(argv):
    from tensordiff.cli import main
    return main(argv)


@pytest.fixture(scope="module")
def run():
    """A tiny 8-layer Llama and its states on three sequences: HF hidden_states, pre-norm boundary N."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=128, num_hidden_layers=N,
                                   num_attention_heads=4, num_key_value_heads=2, initializer_range=0.3,
                                   max_position_embeddings=256)
    model = transformers.LlamaForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(7)
    seqs = {f"data_{i}": torch.randint(0, V, (10 + 3 * i,), generator=g) for i in range(3)}
    pre = []
    h = model.model.norm.register_forward_pre_hook(lambda m, a: pre.append(a[0]))
    states = {}
    with torch.no_grad():
        for k, ids in seqs.items():
            out = model(ids[None], output_hidden_states=True)
            hs = [t[0] for t in out.hidden_states[:N]] + [pre[-1][0]]  # boundaries 0..N, all pre-norm
            states[k] = {"ids": ids, "b": hs, "final_norm": out.hidden_states[N][0]}
    h.remove()
    return model, seqs, states


def _record(model, seqs, path, plan):
    with Recorder(path, side="train", model=model_info(model)) as rec:
        hf = HFExtractorRecorder(model, rec, plan, values="all")
        for k, ids in seqs.items():
            hf.run(k, ids)


def _write_specforge(d: Path, states, ids=(1, 3, 5), gz=False):
    d.mkdir(parents=True, exist_ok=True)
    for k, s in states.items():
        aux = torch.cat([s["b"][i + 1] for i in ids], -1)[None]  # SpecForge: hidden_states[id + 1], [1, L, 3H]
        obj = {"input_ids": s["ids"].clone(), "loss_mask": torch.ones_like(s["ids"]),
               "aux_hidden_state": aux.clone(), "hidden_state": s["final_norm"][None].clone()}
        if gz:
            with gzip.open(d / f"{k}.ckpt.gz", "wb") as f:
                torch.save(obj, f)
        else:
            torch.save(obj, d / f"{k}.ckpt")


def _write_speculators(d: Path, states, captured, stacked=False):
    d.mkdir(parents=True, exist_ok=True)
    for k, s in states.items():
        lst = [s["b"][b].clone() for b in captured]
        hs = torch.stack(lst, 1) if stacked else lst
        torch.save({"input_ids": s["ids"].clone(), "loss_mask": torch.ones_like(s["ids"]), "hidden_states": hs},
                   d / f"{k}.pt")


@pytest.mark.parametrize("gz", [False, True])
def test_specforge_import_matches_the_hf_recording_and_diff_agrees(tmp_path, run, gz):
    model, seqs, states = run
    src = tmp_path / "specforge"
    _write_specforge(src, states, gz=gz)
    imp = tmp_path / "imp.h5"
    rc = _main(["import", str(src), "--aux-ids", "1", "3", "5", "--num-layers", str(N), "--out", str(imp)])
    assert rc == 0
    with TraceReader(imp) as r:
        assert r.side == "train" and r.model["hidden_size"] == H and r.model["num_layers"] == N
        d = r.tensors["draft_input"]
        assert (d.slot_labels, d.raw_ids, d.convention, d.token_offset) == (["layer2", "layer4", "layer6"], [1, 3, 5],
                                                                           "specforge", 1)
        assert r.sequences == ["data_0", "data_1", "data_2"]
        s = states["data_1"]
        seq = r.sequences.index("data_1")
        rows = np.flatnonzero(r.tokens["seq"][r.token_rows("draft_input")] == seq)
        np.testing.assert_array_equal(r.read_values_at("draft_input", rows),
                                      torch.cat([s["b"][2], s["b"][4], s["b"][6]], -1)[:-1].numpy())
        assert r.tensors["final_norm"].kind == "final_norm" and r.tensors["final_norm"].rows == sum(
            len(x) for x in seqs.values())
    rec = tmp_path / "rec.h5"
    _record(model, seqs, rec, plan_draft_input("specforge", [1, 3, 5], N))
    assert _main(["diff", str(rec), str(imp), "-q"]) == 0


@pytest.mark.parametrize("stacked", [False, True])
def test_speculators_import_and_diff(tmp_path, run, stacked):
    model, seqs, states = run
    src = tmp_path / "spec"
    _write_speculators(src, states, captured=[2, 4, 6, N], stacked=stacked)  # ids [1,3,5] + the last state
    imp = tmp_path / "imp.h5"
    res = import_files([src], imp, aux_ids=[1, 3, 5], num_layers=N)
    assert res.format == "speculators" and res.files == 3
    with TraceReader(imp) as r:
        d = r.tensors["draft_input"]
        assert d.slot_labels == ["layer2", "layer4", "layer6"] and d.convention == "speculators-legacy"
        v = r.tensors["verifier_last"]
        assert (v.role, v.attrs["label"]) == ("verifier_target", f"layer{N}")
        s = states["data_0"]
        np.testing.assert_array_equal(r.read_values("draft_input", 0, 9),
                                      torch.cat([s["b"][2], s["b"][4], s["b"][6]], -1)[:-1].numpy())
        np.testing.assert_array_equal(r.read_values("verifier_last", 0, 10), s["b"][N].numpy())
    rec = tmp_path / "rec.h5"
    _record(model, seqs, rec, plan_draft_input("speculators-legacy", [1, 3, 5], N))
    assert _main(["diff", str(rec), str(imp), "-q"]) == 0


def test_speculators_legacy_embed_bug_import_is_labelled_and_diverges(tmp_path, run):
    """Files from the extractor whose list was [hs[0]] + [hs[id+1] ...]: labels say what was fed."""
    model, seqs, states = run
    src = tmp_path / "spec"
    _write_speculators(src, states, captured=[0, 3, 5, 7])
    imp = tmp_path / "imp.h5"
    assert _main(["import", "speculators", str(src), "--aux-ids", "2", "4", "6", "--prepend-embed",
                  "--out", str(imp)]) == 0
    with TraceReader(imp) as r:
        d = r.tensors["draft_input"]
        assert d.slot_labels == ["embed", "layer3", "layer5"] and d.raw_ids == [2, 4, 6]
        assert r.tensors["verifier_last"].attrs["label"] == "layer7"
    # against a correct recording (the ids' intended [layer3, layer5, layer7]) the diff finds the shift
    rec = tmp_path / "rec.h5"
    _record(model, seqs, rec, plan_draft_input("speculators-legacy", [2, 4, 6], N))
    assert _main(["diff", str(rec), str(imp), "-q"]) == 1
    # explicit labels of the whole list, and the generator's four ids, say the same
    imp2 = tmp_path / "imp2.h5"
    assert _main(["import", str(src), "--labels", "embed", "layer3", "layer5", "layer7", "--out", str(imp2)]) == 0
    with TraceReader(imp2) as r:
        assert r.tensors["draft_input"].slot_labels == ["embed", "layer3", "layer5"]
    src4 = tmp_path / "spec4"
    _write_speculators(src4, states, captured=[3, 5, 7, 8])
    res = import_files([src4], tmp_path / "imp3.h5", aux_ids=[2, 4, 6, 7])
    assert res.plan["fed"] == ["layer3", "layer5", "layer7"] and res.plan["verifier"] == "layer8"


def _dump(d: Path, idx: int, step: int, name: str, value, rank: int = 0, **tags):
    fname = "___".join(f"{k}={v}" for k, v in dict(step=step, rank=rank, dump_index=idx, name=name,
                                                     recompute_status="disabled", **tags).items()) + ".pt"
    torch.save({"value": value, "meta": {"step": step, "rank": rank, "dump_index": idx, "name": name, **tags}}, d / fname)
    return fname


def test_sglang_dump_directory(tmp_path, run):
    model, seqs, states = run
    exp = tmp_path / "dumps" / "exp_1"
    exp.mkdir(parents=True)
    a, b = states["data_0"], states["data_1"]
    La, Lb = len(a["ids"]), len(b["ids"])
    # step 0: prefill of two requests in one batch; step 1: one decode token of request A
    ids0 = torch.cat([a["ids"][:-1], b["ids"]])
    pos0 = torch.cat([torch.arange(La - 1), torch.arange(Lb)])
    i = 0
    for step, ids, pos, lens, rids, rows in [
            (0, ids0, pos0, torch.tensor([La - 1, Lb]), ["req-a", "req-b"],
             lambda t: torch.cat([t(a)[:-1], t(b)])),
            (1, a["ids"][-1:], torch.tensor([La - 1]), torch.tensor([La]), ["req-a"], lambda t: t(a)[-1:])]:
        for nm, val in (("input_ids", ids), ("positions", pos), ("seq_lens", lens), ("rids", rids)):
            i += 1
            _dump(exp, i, step, nm, val)
        for lid in (2, 5):
            i += 1
            fname = _dump(exp, i, step, "hidden_states", rows(lambda s, lid=lid: s["b"][lid + 1]).clone(), layer_id=lid)
        i += 1
        _dump(exp, i, step, "hidden_states", rows(lambda s: s["b"][1]).clone(), layer_id=0, rank=1)  # other rank
        i += 1
        _dump(exp, i, step, "logits_scalar", torch.tensor(1.0))
    assert parse_dump_filename(fname)["layer_id"] == "5"
    out = tmp_path / "serve.h5"
    assert _main(["import", str(tmp_path / "dumps"), "--as", "hidden_states@layer_id=2=layer3", "--out", str(out)]) == 0
    with TraceReader(out) as r:
        assert r.side == "serve"
        assert sorted(r.tensors) == ["hidden_states@layer_id=5", "layer3"]
        assert r.tensors["layer3"].kind == "boundary" and r.tensors["layer3"].boundary == 3
        assert sorted(r.sequences) == ["req-a", "req-b"]
        t = r.tokens
        ka = r.sequences.index("req-a")
        ta = t[t["seq"] == ka]
        assert ta["position"].tolist() == list(range(La))
        assert ta["token"].tolist() == a["ids"].tolist()
        assert ta["regime"].tolist()[-1] == 2 and ta["regime"].tolist()[0] == 1  # decode after prefill
        rows = r.token_rows("layer3")
        mine = np.flatnonzero(r.tokens["seq"][rows] == ka)
        np.testing.assert_array_equal(r.read_values_at("layer3", mine), a["b"][3].numpy())
    # the dump imports as the serve side against the train recording: paired by label, agreeing
    rec = tmp_path / "rec.h5"
    _record(model, {"data_0": seqs["data_0"], "data_1": seqs["data_1"]}, rec, None)
    assert _main(["diff", str(rec), str(out), "-q"]) in (0, 1)


@pytest.mark.parametrize("case", ["garbage", "truncated-gz", "pickle-object", "bad-shape", "id-count", "no-ids-no-n",
                                  "empty-dir", "missing", "not-dict", "dump-no-input-ids"])
def test_malformed_inputs_are_one_line_exit_2(tmp_path, run, capsys, case):
    _, _, states = run
    src = tmp_path / "src"
    src.mkdir()
    argv_extra = ["--aux-ids", "1", "3", "5"]
    target = str(src)
    if case == "garbage":
        (src / "data_0.ckpt").write_bytes(b"\x00not a checkpoint" * 10)
    elif case == "truncated-gz":
        _write_specforge(src, {"data_0": states["data_0"]}, gz=True)
        p = src / "data_0.ckpt.gz"
        p.write_bytes(p.read_bytes()[:200])
    elif case == "pickle-object":
        torch.save({"input_ids": torch.arange(3), "aux_hidden_state": Path("/etc/passwd")}, src / "data_0.ckpt")
    elif case == "bad-shape":
        s = states["data_0"]
        torch.save({"input_ids": s["ids"], "aux_hidden_state": torch.zeros(1, 3, 3 * H)}, src / "data_0.ckpt")
    elif case == "id-count":
        _write_specforge(src, {"data_0": states["data_0"]})
        argv_extra = ["--aux-ids", "1", "3"]
    elif case == "no-ids-no-n":
        _write_specforge(src, {"data_0": states["data_0"]})
        argv_extra = []
    elif case == "missing":
        target = str(tmp_path / "nope")
    elif case == "not-dict":
        torch.save([torch.zeros(2)], src / "data_0.pt")
        argv_extra = ["--format", "speculators"]
    elif case == "dump-no-input-ids":
        _dump(src, 1, 0, "hidden_states", torch.zeros(4, H), layer_id=1)
    out = tmp_path / "out.h5"
    rc = _main(["import", target, "--out", str(out), *argv_extra])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.startswith("tensordiff: error:") and err.count("\n") == 1 and "Traceback" not in err, err
    assert not out.exists()  # no half-written trace left behind
    if case == "pickle-object":
        assert "weights_only" in err
