"""Per-rank traces from a real engine: vLLM's CPU backend at tensor parallelism 2 (its
multiprocessing executor, gloo), recorded by the real ``tensordiff record serve --engine vllm
--tp-size 2`` in the vLLM venv, read as one trace.

One engine start per layout, shared by the module: TP=2 and TP=1 of the same tiny Llama (4
layers, hidden 256, head_dim 64: vLLM's CPU attention refuses 16) with an EAGLE-3 draft (ids
[1, 2, 3] = boundaries layer1..layer3) and the catalog. Checked:

- every rank writes its own file (``serve.tp0.h5``, ``serve.tp1.h5``) with its rank facts, host
  and run; ``tensordiff info DIR`` shows them as one trace;
- the TP replicas agree bit for bit; a replica that differs is a ``replica`` divergence naming
  both files;
- ``target_topk`` exists at TP=2 (the vocab-sharded lm_head is gathered) and equals TP=1's;
  the acceptance analysis runs on the set;
- the set against the TP=1 file agrees; against the HF train side it names the founding bug as
  the single file does, and agrees on correct wiring, in both argument orders;
- faults of a multi-rank run: a rank's file missing, truncated, from another run, with other
  tokens, not closed cleanly: one line and exit code 2, never an "agree";
- the Ray backend on the set with the local two-node cluster gives the serial result.

The faults other than a missing file are made by editing copies of the real files (h5py), not by
killing a real rank: the set's checks read the same facts either way.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

import sglang_support as sup  # noqa: E402
import vllm_support as vsup  # noqa: E402
import recordings as recs  # noqa: E402

DRAFT_IDS = [1, 2, 3]
MAX_NEW = 6
_rng = np.random.default_rng(3)
PROMPTS = {"A": _rng.integers(1, 256, 40).tolist(), "B": _rng.integers(1, 256, 9).tolist()}
TINY = dict(vsup.TINY_LLAMA_VLLM, num_hidden_layers=4)
assert PROMPTS == recs.RANKS_PROMPTS    # what the recordings of this module were given

needs_vllm = pytest.mark.skipif(not vsup.vllm_available(), reason="the vLLM venv (.venv-vllm) is not set up")
pytestmark = [pytest.mark.vllm, pytest.mark.slow, needs_vllm]


def _run(argv, **kw):
    return subprocess.run(argv, capture_output=True, text=True, cwd=REPO, **kw)


def _td(*args):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TENSORDIFF_")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return _run([sys.executable, "-m", "tensordiff", *map(str, args)], env=env, timeout=600)


@pytest.fixture(scope="module")
def models(recorded):
    m = recorded(recs.VLLM_RANKS_MODELS)
    return {"target": Path(m["target"]), "draft": Path(m["draft"]), "refs": m["refs"], "prompts": Path(m["prompts"])}


def _load(run: dict) -> dict:
    jsonl = Path(run["jsonl"])
    outs = {o["id"]: o for o in map(json.loads, jsonl.read_text().splitlines())}
    return {"dir": Path(run["dir"]), "stdout": Path(run["stdout"]).read_text(), "outputs": outs, "jsonl": jsonl}


@pytest.fixture(scope="module")
def tp2(recorded):
    return _load(recorded(recs.VLLM_TP2))


@pytest.fixture(scope="module")
def tp1(recorded):
    r = _load(recorded(recs.VLLM_TP1))
    r["file"] = r["dir"] / "serve.h5"
    return r


def _train(models, tmp: Path, name: str, *args) -> Path:
    prompts = tmp / f"{name}-prompts.jsonl"
    full = {k: PROMPTS[k] + models["refs"][k][:MAX_NEW] for k in PROMPTS}
    prompts.write_text("".join(json.dumps({"id": k, "input_ids": v}) + "\n" for k, v in full.items()))
    out = tmp / f"{name}.h5"
    proc = _td("record", "train", "--model", models["target"], "--prompts", prompts, *args, "--dtype", "float32",
               "--device", "cpu", "--no-progress", "--out", out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def trains(models, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("train")
    # the founding bug: the trainer prepends the embedding and drops the last id
    bug = _train(models, tmp, "bug", "--aux-ids", "0", "1", "2", "--convention", "speculators-legacy", "--prepend-embed")
    ok = _train(models, tmp, "ok", "--draft-config", models["draft"] / "config.json", "--convention", "vllm")
    return {"bug": bug, "ok": ok}


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _one_line_exit_2(proc) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert not proc.stdout.startswith("no divergence")
    return lines[0]


# ----------------------------------------------------------------------------------------------
# The files and the set
# ----------------------------------------------------------------------------------------------


def test_every_tp_rank_writes_its_own_file_read_as_one_trace(tp2, tp1, models):
    from tensordiff.trace import TraceReader

    names = sorted(os.listdir(tp2["dir"]))
    assert names == ["serve.tp0.h5", "serve.tp1.h5"], names
    facts = []
    for n in names:
        with TraceReader(str(tp2["dir"] / n)) as r:
            assert r.complete, n
            facts.append(r.user_meta["ranks"])
    assert [f["tp_rank"] for f in facts] == [0, 1] and {f["tp_size"] for f in facts} == {2}
    assert {f["host"] for f in facts} == {socket.gethostname()}
    assert facts[0]["run"] and facts[0]["run"] == facts[1]["run"]  # one engine run
    for k in PROMPTS:  # vLLM at TP=2 generated what HF generates
        assert tp2["outputs"][k]["output_ids"] == models["refs"][k][:MAX_NEW], k
    assert "trace set: 2 files, 1 token shard (TP=2)" in tp2["stdout"], tp2["stdout"]
    proc = _td("info", tp2["dir"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "trace set: 2 files, 1 token shard (TP=2)" in proc.stdout
    assert f"hosts: {socket.gethostname()}" in proc.stdout
    for n in names:
        assert f"  {n}: ranks tp{n[-4]}, host {socket.gethostname()}" in proc.stdout, proc.stdout[-3000:]
    js = json.loads(_td("info", tp2["dir"], "--json").stdout)["set"]
    assert [f["bytes"] for f in js["files"]] == [os.path.getsize(tp2["dir"] / n) for n in names]
    assert js["layout"]["tp"] == 2 and js["replicas"]


def test_tp_replicas_agree_bit_for_bit(tp2):
    from tensordiff.traceset import TraceSet

    with TraceSet(str(tp2["dir"])) as s:
        assert s.check_replicas() == []
        reps = {r["tensor"] for r in s.index()["replicas"]}
        rows = s.replicated_rows
        toks = len(s.tokens) // 2
    # every tensor of rank 1 is a replica of rank 0's, every row of it
    assert {"aux_hidden_states", "draft_input", "target_topk", "embed", "layer3", "final_norm"} <= reps, reps
    assert rows >= toks * 8


def test_a_differing_replica_is_a_divergence_naming_both_files(tp2, trains, tmp_path):
    import h5py

    d = _copy(tp2["dir"], tmp_path / "rep")
    with h5py.File(d / "serve.tp1.h5", "r+") as f:
        v = f["tensors/aux_hidden_states/values"]
        row = v[3]
        row[5] += np.float32(1e-3) * max(1.0, abs(float(row[5])))
        v[3] = row
    for a, b in ((trains["ok"], d), (d, trains["ok"])):
        proc = _td("diff", a, b, "--json")
        assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
        rep = [f for f in json.loads(proc.stdout)["findings"] if f["kind"] == "replica"]
        # aux_hidden_states, and draft_input, whose rows refer to the aux rows they repeat
        assert rep and all("serve.tp1.h5 differs from serve.tp0.h5" in f["message"] for f in rep), rep
        assert any(f["message"].startswith("TP replicas of serve disagree: aux_hidden_states") for f in rep), rep


# ----------------------------------------------------------------------------------------------
# Verdicts on the set
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("order", ["train_serve", "serve_train"])
def test_the_set_names_the_founding_bug_as_the_single_rank_file_does(tp2, tp1, trains, order):
    firsts = []
    for serve in (tp1["file"], tp2["dir"]):
        a, b = (trains["bug"], serve) if order == "train_serve" else (serve, trains["bug"])
        proc = _td("diff", a, b)
        assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
        firsts.append(proc.stdout.splitlines()[0])
    assert firsts[0] == firsts[1], firsts
    if order == "train_serve":
        assert firsts[0] == ("train feeds draft_input [embed, layer1, layer2], serve feeds [layer1, layer2, layer3]; "
                             "the draft was trained on train's"), firsts
    else:
        assert firsts[0] == ("serve feeds draft_input [layer1, layer2, layer3], train feeds [embed, layer1, layer2]; "
                             "the draft was trained on train's"), firsts


@pytest.mark.parametrize("order", ["train_serve", "serve_train"])
def test_correct_wiring_and_the_tp1_run_agree_with_the_set(tp2, tp1, trains, order):
    for other in (trains["ok"], tp1["file"]):
        a, b = (other, tp2["dir"]) if order == "train_serve" else (tp2["dir"], other)
        proc = _td("diff", a, b)
        assert proc.returncode == 0, proc.stdout[:3000] + proc.stderr[-2000:]
        assert proc.stdout.startswith("no divergence"), proc.stdout[:500]


def test_target_topk_at_tp2_equals_tp1_and_the_acceptance_analysis_runs(tp2, tp1, models, tmp_path):
    from tensordiff.trace import TraceReader
    from tensordiff.traceset import TraceSet

    def table(r):
        rows = r.token_rows("target_topk")
        t = r.tokens[rows]
        keys = [(r.sequences[s], int(p)) for s, p in zip(t["seq"], t["position"])]
        return dict(zip(keys, r.read_values("target_topk")))

    with TraceReader(str(tp1["file"])) as r1, TraceSet(str(tp2["dir"])) as r2:
        one, two = table(r1), table(r2)
    assert one and set(one) == set(two)
    k = 20
    for key in one:  # the same ids in the same order; logits within float32 reduction noise
        np.testing.assert_array_equal(one[key][:k], two[key][:k])
        np.testing.assert_allclose(one[key][k:2 * k], two[key][k:2 * k], rtol=1e-4, atol=1e-4)
    # the acceptance analysis on the set (a train side recorded from the run's outputs)
    train = tmp_path / "train-from-serve.h5"
    proc = _td("record", "train", "--model", models["target"], "--from-serve", tp2["jsonl"], "--draft",
               models["draft"], "--convention", "vllm", "--dtype", "float32", "--device", "cpu", "--no-progress",
               "--out", train)
    assert proc.returncode == 0, proc.stderr[-2000:]
    proc = _td("diff", train, tp2["dir"], "--json")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    f = sup.acceptance_of(json.loads(proc.stdout))
    assert f["details"]["verdict"] == "agree" and f["details"]["cross"]["target_topk"]["top1"] == 1.0, f["message"]


# ----------------------------------------------------------------------------------------------
# Faults of a multi-rank run
# ----------------------------------------------------------------------------------------------


def _set_attr_json(path: Path, key: str, fn) -> None:
    import h5py

    with h5py.File(path, "r+") as f:
        um = json.loads(f.attrs["user_meta"])
        fn(um)
        f.attrs["user_meta"] = json.dumps(um)


def test_faults_of_a_multi_rank_run_are_one_line_exit_2(tp2, tp1, trains, tmp_path):
    import h5py

    cases = {}
    d = _copy(tp2["dir"], tmp_path / "missing")
    os.remove(d / "serve.tp1.h5")
    cases["missing"] = (d, "missing TP rank 1")
    d = _copy(tp2["dir"], tmp_path / "truncated")
    p = d / "serve.tp1.h5"
    with open(p, "r+b") as fh:
        fh.truncate(os.path.getsize(p) // 2)
    cases["truncated"] = (d, "serve.tp1.h5")
    d = _copy(tp2["dir"], tmp_path / "other-run")
    shutil.copy(tp1["file"], d / "serve.tp1.h5")  # the TP=1 run's file in rank 1's place
    cases["other run"] = (d, "mixes engine runs")
    d = _copy(tp2["dir"], tmp_path / "other-start")
    _set_attr_json(d / "serve.tp1.h5", "user_meta", lambda um: um["ranks"].update(run="1700000000000000000"))
    cases["other start"] = (d, "mixes engine runs")
    d = _copy(tp2["dir"], tmp_path / "other-model")
    with h5py.File(d / "serve.tp1.h5", "r+") as f:
        m = json.loads(f.attrs["model"])
        m["architecture"] = "MistralForCausalLM"
        f.attrs["model"] = json.dumps(m)
    cases["other model"] = (d, "mixes models")
    d = _copy(tp2["dir"], tmp_path / "other-tokens")
    with h5py.File(d / "serve.tp1.h5", "r+") as f:
        t = f["tokens"][()]
        t["token"][5] = (int(t["token"][5]) + 1) % 256
        f["tokens"][()] = t
    cases["other tokens"] = (d, "disagree on a token")
    d = _copy(tp2["dir"], tmp_path / "killed")
    with h5py.File(d / "serve.tp1.h5", "r+") as f:  # as a rank killed before its close leaves it
        f.attrs["complete"] = 0
    cases["killed"] = (d, "serve.tp1.h5 was not closed cleanly")
    for what, (d, want) in cases.items():
        for argv in (("diff", trains["ok"], d), ("diff", d, trains["ok"]), ("info", d)):
            line = _one_line_exit_2(_td(*argv))
            assert want in line, (what, argv[0], line)


# ----------------------------------------------------------------------------------------------
# The Ray backend on the engine's files
# ----------------------------------------------------------------------------------------------


def test_the_ray_backend_on_the_engines_files_equals_serial(tp2, trains):
    pytest.importorskip("ray")
    from test_ray_backend import local_cluster

    from tensordiff.cli import jsonable
    from tensordiff.diff import DiffOptions, diff_traces
    from tensordiff.ray_backend import RayBackend

    host = socket.gethostname()
    with local_cluster() as address:
        b = RayBackend(address=address, task_bytes=1)
        try:
            for a, bb in ((trains["bug"], tp2["dir"]), (tp2["dir"], trains["ok"])):
                b.placements.clear()
                serial = json.dumps(jsonable(diff_traces(str(a), str(bb), DiffOptions(block_rows=16)).to_dict()))
                got = json.dumps(jsonable(diff_traces(str(a), str(bb), DiffOptions(block_rows=16, backend=b)).to_dict()))
                assert got == serial
                # the engine's files name this host: every task asked for its node, softly
                assert b.placements and all(p.host == host and p.node is not None and p.soft for p in b.placements)
        finally:
            b.close()


# ----------------------------------------------------------------------------------------------
# Engine start failures: the engine's own cause in the one line
# ----------------------------------------------------------------------------------------------


def _leftovers(marker: str) -> list[str]:
    import psutil

    out = []
    for p in psutil.process_iter(["pid", "cmdline", "environ"]):
        try:
            if any(marker in a for a in (p.info["cmdline"] or [])) or marker in str((p.info["environ"] or {}).get(
                    "TENSORDIFF_TRACE", "")):
                out.append(f"{p.info['pid']} {' '.join(p.info['cmdline'] or [])[:200]}")
        except Exception:  # noqa: BLE001 - gone, or not ours to read
            pass
    return out


def _start_fails(models, tmp: Path, target: Path, tp: int, **env_extra) -> str:
    argv = [str(vsup.vllm_python()), "-m", "tensordiff", "record", "serve", "--engine", "vllm",
            "--model", str(target), "--prompts", str(models["prompts"]), "--out", str(tmp / "serve.h5"),
            "--max-new-tokens", "2", "--device", "cpu", "--dtype", "float32", "--tp-size", str(tp),
            "--log-level", "warning"]
    for a in vsup.CPU_ENGINE_ARGS:
        argv += ["--engine-arg", a]
    env = dict(vsup.vllm_env(), **env_extra)
    proc = _run(argv, env=env, timeout=900)
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    ours = [line for line in proc.stderr.splitlines() if line.startswith("tensordiff: error:")]
    assert len(ours) == 1 and "Traceback" not in ours[0], proc.stderr[-3000:]
    import time

    deadline = time.monotonic() + 30
    while _leftovers(str(tmp)) and time.monotonic() < deadline:
        time.sleep(1)
    assert not _leftovers(str(tmp)), _leftovers(str(tmp))  # no engine process left behind
    return ours[0]


def test_engine_start_failures_say_the_engines_own_cause(models, tmp_path):
    # vLLM's CPU attention refuses head_dim 16 (hidden 256, 16 heads)
    hd16 = sup.make_tiny_llama(tmp_path / "hd16", **dict(TINY, num_attention_heads=16, num_key_value_heads=4))
    (tmp_path / "a").mkdir()
    line = _start_fails(models, tmp_path / "a", hd16, 1)
    # vLLM refuses it at the first forward, after the start (the trace stays, not closed cleanly)
    assert line.startswith("tensordiff: error: the vLLM engine failed while recording: "), line
    assert "Unsupported CPU attention configuration" in line and "head_dim=16" in line, line
    # TP=2 with vLLM's automatic thread binding: one NUMA node per CPU worker, which this machine lacks
    (tmp_path / "b").mkdir()
    line = _start_fails(models, tmp_path / "b", models["target"], 2, VLLM_CPU_OMP_THREADS_BIND="auto")
    assert line.startswith("tensordiff: error: the vLLM engine could not start: AssertionError: Not enough allowed "
                           "NUMA nodes to bind threads of 2 local CPUWorkers"), line
    assert "VLLM_CPU_OMP_THREADS_BIND" in line.split(";", 1)[1], line
    assert not os.path.exists(tmp_path / "b" / "serve.h5")  # nothing recorded
