"""The prefix cache kept across a weight update, on real SGLang 0.5.23 (CPU) with its radix cache
on and the trained tiny Llama.

One engine run (declared here, recorded once per cache key through tests/recordings.py): a bf16
engine serves ``w0`` (the 40-token prefix P and a suffix) under the trained weights (step 0), then
takes the trainer's weights (one Adam step of the trained model at lr 4e-3; a second run at 1e-3) through
``update_weights_from_tensor(..., flush_cache=False)`` (step 1) and serves ``a0..a2`` (P and other
suffixes: 40 positions of KV from step 0) with ``f0, f1`` (prompts that share no prefix with
anything served before: computed fresh); then the same weights again with ``flush_cache=True``
(step 2) and the same prompts as ``b0..b2``, ``g0, g1``. The trainer (`record train --from-serve`
in fp32 on the new weights) runs each group of five.

What it shows: the recorder's ``/prefix_cache`` record says which positions came from the cache
and the weight step they were computed under; `tensordiff triage` names the stale KV in its first
sentence (exit 1) for the first group, in both argument orders, with the stale sequences out of the
noise the fresh ones measure (at 1e-3, within it: still named, as within the noise), and finds no
cause in the flushed group (exit 0), in both orders.
"""

from __future__ import annotations

import hashlib
import inspect
import json
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

needs_sglang = pytest.mark.skipif(not sup.sglang_available(), reason="real SGLang (and torch) not installed")


def engine(fn):
    """An engine test (the module's fast tests of the tracker and the record run without one)."""
    return pytest.mark.sglang(pytest.mark.slow(needs_sglang(fn)))


MAX_NEW = 8
PREFIX = 40
STALE, FRESH = ("a0", "a1", "a2"), ("f0", "f1")
FLUSHED, FLUSHED_FRESH = ("b0", "b1", "b2"), ("g0", "g1")

_DRIVER = r'''
import json, sys
sys.path.insert(0, {tests!r})
import sglang_support as sup
sup.prepare_cpu_env()
from safetensors.torch import load_file
args = json.loads(sys.argv[1])
engine = sup.start_engine(**sup.engine_kwargs(args["model"], dtype="bfloat16", mem_fraction_static=0.3,
                                              chunked_prefill_size=64))
out = {{}}
ok = lambda r: r[0] if isinstance(r, tuple) else r.success
try:
    sp = {{"temperature": args["temperature"], "max_new_tokens": args["max_new"]}}
    def gen(keys):
        res = engine.generate(input_ids=[args["prompts"][k] for k in keys], sampling_params=sp, rid=list(keys),
                              return_logprob=True)
        for k, o in zip(keys, res):
            out[k] = {{"id": k, "input_ids": args["prompts"][k], "output_ids": o["output_ids"],
                      "cached_tokens": o["meta_info"].get("cached_tokens"),
                      "output_logprobs": [x[0] for x in o["meta_info"]["output_token_logprobs"]]}}
    named = list(load_file(args["new"] + "/model.safetensors").items())
    gen(["w0"])
    def update(flush):
        assert ok(engine.begin_weight_update())
        r = engine.update_weights_from_tensor(named, flush_cache=flush)
        assert ok(r), r
        assert ok(engine.end_weight_update())
    update(False)
    gen(args["stale"])
    update(True)
    gen(args["flushed"])
    engine.collective_rpc("tensordiff_close")
finally:
    engine.shutdown()
print("OUT", json.dumps(out))
'''


def _prompts(trained: list[list[int]]) -> dict[str, list[int]]:
    """P = prompt 0; w0 = P + prompt 1's first 8 tokens; a0..a2 = P + 8 tokens of prompts 2, 4, 5
    (their first tokens differ from w0's suffix: exactly the 40 positions of P are cached);
    f0, f1 = prompts 8 and 9 (first tokens shared with nothing served before)."""
    p = trained
    got = {"w0": p[0] + p[1][:8]}
    for k, j in zip(STALE, (2, 4, 5)):
        got[k] = p[0] + p[j][:8]
    for k, j in zip(FRESH, (8, 9)):
        got[k] = list(p[j])
    got.update({b: got[a] for a, b in zip(STALE + FRESH, FLUSHED + FLUSHED_FRESH)})
    return got


def _build(out: Path, needs: dict, *, model: str, max_new: int, temperature: float, lr: float, code: str) -> dict:
    """The trainer's weights (one Adam step at ``lr``), the engine run, and the trainer's trace
    of each group of five sequences."""
    import rl_support
    import trained

    new = out / "trainer-model"
    rl_support.save(rl_support.updated(trained.load_target(), lr=lr), new)
    prompts = _prompts(trained.prompts())
    trace = out / "serve.h5"
    args = {"model": needs[model]["target"], "new": str(new), "prompts": prompts, "temperature": temperature,
            "max_new": max_new, "stale": list(STALE + FRESH), "flushed": list(FLUSHED + FLUSHED_FRESH)}
    env = sup.rl_engine_env({"TENSORDIFF_TRACE": str(trace), "TENSORDIFF_CATALOG": "1", "TENSORDIFF_VALUES": "all"})
    recs._run([sys.executable, "-c", _DRIVER.format(tests=str(HERE)), json.dumps(args)], out, "serve", env)
    stdout = (out / "serve.stdout").read_text()
    outputs = json.loads(next(ln for ln in stdout.splitlines() if ln.startswith("OUT "))[4:])
    got: dict = {"trace": str(trace), "model": str(new), "outputs": outputs}
    for name, keys in (("stale", STALE + FRESH), ("flushed", FLUSHED + FLUSHED_FRESH)):
        jsonl = out / f"{name}.jsonl"
        jsonl.write_text("".join(json.dumps(outputs[k]) + "\n" for k in keys))
        train = out / f"train-{name}.h5"
        recs._run([sys.executable, "-m", "tensordiff", "record", "train", "--model", str(new), "--from-serve",
                   str(jsonl), "--no-draft-input", "--values", "all", "--dtype", "float32", "--device", "cpu",
                   "--temperature", str(temperature), "--no-progress", "--out", str(train)], out, f"train-{name}",
                  sup.tensordiff_env())
        got[name] = {"jsonl": str(jsonl), "train": str(train)}
    return got


def _code() -> str:
    return hashlib.sha256((inspect.getsource(_build) + inspect.getsource(_prompts) + _DRIVER).encode()).hexdigest()[:16]


recs.BUILDERS["sglang_rl_prefix_cache"] = _build


def _recording(lr: float) -> recs.Recording:
    return recs.Recording("sglang-rl-prefix-cache", "sglang", "sglang_rl_prefix_cache",
                          recs._args(model=recs.RL_MODEL.name, max_new=MAX_NEW, temperature=0.7, lr=lr, code=_code()),
                          (recs.RL_MODEL,))


# the trainer's update: one Adam step at 4e-3 moves the cached prefix's KV as far as several RL steps
# would (a cache kept across updates holds KV many steps old); at 1e-3 the stale sequences' log-probs
# stay within three times the noise
RL_PREFIX_CACHE, RL_PREFIX_CACHE_SMALL = _recording(4e-3), _recording(1e-3)


@pytest.fixture(scope="module")
def run(recorded):
    return recorded(RL_PREFIX_CACHE)


@pytest.fixture(scope="module")
def small(recorded):
    return recorded(RL_PREFIX_CACHE_SMALL)


def _triage(*paths) -> tuple[int, str]:
    proc = subprocess.run([sys.executable, "-m", "tensordiff", "triage", *map(str, paths)], check=False,
                          capture_output=True, text=True, env=sup.tensordiff_env(), cwd=REPO, timeout=900)
    return proc.returncode, proc.stdout + proc.stderr


# ----------------------------------------------------------------------------------------------


@engine
def test_the_record_says_which_positions_reused_kv_of_which_step(run):
    """The engine reports 40 cached tokens for a0..a2; the trace's /prefix_cache says positions
    0-39 of each were computed under weight step 0 while step 1 served them, f0 and f1 took
    nothing from the cache, the flush of the second update is there, and after it every cached
    prefix is of the weights that served it."""
    from tensordiff.trace import TraceReader
    from tensordiff.trace.prefix_cache import read_prefix_cache
    from tensordiff.trace.rl import read_weight_steps

    outs = run["outputs"]
    with TraceReader(run["trace"]) as r:
        rec = read_prefix_cache(r)
        steps = read_weight_steps(r)
    assert rec is not None and rec.engine == "sglang" and rec.radix_cache is True
    assert [(s.step, s.event) for s in steps] == [(0, "start"), (1, "update_weights_from_tensor"),
                                                  (2, "update_weights_from_tensor")]
    for k in STALE:
        assert outs[k]["cached_tokens"] == PREFIX, outs[k]
        assert rec.requests[k] == {"cached_tokens": PREFIX, "weight_step": 1, "kv_steps": [(0, PREFIX, 0)],
                                   "last_flush_forward_step": -1}, rec.requests[k]
    for k in FRESH:
        assert outs[k]["cached_tokens"] == 0 and rec.requests[k]["cached_tokens"] == 0
    assert len(rec.flushes) == 1 and rec.flushes[0]["forward_step"] == steps[2].forward_step, (rec.flushes, steps)
    for k in FLUSHED + FLUSHED_FRESH:
        e = rec.requests[k]
        assert e["weight_step"] == 2 and e["last_flush_forward_step"] == steps[2].forward_step, e
        assert all(s == 2 for _, _, s in e["kv_steps"]), e
        assert e["cached_tokens"] == outs[k]["cached_tokens"]


@engine
def test_stale_kv_is_named_in_the_first_sentence_both_orders(run):
    """Triage of the trainer on the new weights against the rollout that reused step 0's KV: the
    first sentence names the cached positions, the step their KV is from and the step that served
    them, says the fresh positions agree and what to do; exit 1, either order."""
    lines = {}
    for a, b in ((run["stale"]["train"], run["trace"]), (run["trace"], run["stale"]["train"])):
        rc, out = _triage(a, b)
        first = out.splitlines()[0]
        assert rc == 1, out[-4000:]
        assert first.startswith(f"prefix cache: positions 0-{PREFIX - 1} of sequences a0, a1, a2 reuse KV from "
                                "weight step 0 (served under step 1"), out[-4000:]
        assert "fresh positions agree" in first and first.endswith("flush the prefix cache after each weight update"), \
            first
        lines[a == run["trace"]] = first
    assert lines[True] == lines[False]


@engine
def test_stale_kv_within_the_noise_is_still_named(small):
    """A smaller update: the stale sequences' log-probs stay within three times the noise (the
    triage before the prefix cache's record said "no cause", exit 0); the record says their KV is of
    other weights, so it is still the cause, worded as within the noise; exit 1, either order."""
    for a, b in ((small["stale"]["train"], small["trace"]), (small["trace"], small["stale"]["train"])):
        rc, out = _triage(a, b)
        first = out.splitlines()[0]
        assert rc == 1 and first.startswith(f"prefix cache: positions 0-{PREFIX - 1} of sequences a0, a1, a2 reuse KV "
                                            "from weight step 0 (served under step 1)"), out[-4000:]
        assert "within the noise here" in first and first.endswith("flush the prefix cache after each weight update")
    for a, b in ((small["flushed"]["train"], small["trace"]), (small["trace"], small["flushed"]["train"])):
        rc, out = _triage(a, b)
        assert rc == 0 and out.startswith("no cause"), out[-4000:]


@engine
def test_flushed_cache_is_a_correct_pair_both_orders(run):
    """The same prompts after an update that flushed the cache: no cause, exit 0, either order."""
    for a, b in ((run["flushed"]["train"], run["trace"]), (run["trace"], run["flushed"]["train"])):
        rc, out = _triage(a, b)
        assert rc == 0 and out.startswith("no cause"), out[-4000:]
        assert "prefix cache" not in out.splitlines()[0]


@engine
def test_the_stale_sequences_carry_the_excess(run):
    """What the sentence rests on, from the two recordings: the stale sequences' log-probs are far
    from the trainer's, the flushed run's same prompts are not."""
    def gap(name: str, keys) -> float:
        from tensordiff import conventions as cv
        from tensordiff.trace import TraceReader

        with TraceReader(run[name]["train"]) as r:
            seqs = list(r.sequences)
            rows = r.token_rows(cv.SAMPLED_LOGPROB)
            vals = np.asarray(r.read_values(cv.SAMPLED_LOGPROB))
            codes = np.asarray(r.tokens["seq"])[rows]
        lp = {seqs[int(s)]: [] for s in np.unique(codes)}
        for s, v in zip(codes, vals):
            lp[seqs[int(s)]].append(float(v[1]))
        d = []
        for k in keys:
            d += [abs(x - y) for x, y in zip(lp[k], run["outputs"][k]["output_logprobs"])]
        return float(np.median(d))

    stale, flushed = gap("stale", STALE), gap("flushed", FLUSHED)
    assert stale > 3 * flushed, (stale, flushed)


# ----------------------------------------------------------------------------------------------
# the recorder's tracking and the record, without an engine
# ----------------------------------------------------------------------------------------------


def test_tracker_gives_the_step_that_computed_each_cached_position():
    """A prefix written under step 0 and reused after an update to step 1 reads as step 0; the
    positions a request computed itself, as the step it ran under (a split edge keeps both); a
    flush forgets everything and is a line; a request served after it reads its own step."""
    from tensordiff.recorders.prefix_cache import PrefixSteps

    P = list(range(100, 140))
    ps = PrefixSteps()
    ps.served("w0", P + [1, 2], 0, 0)
    ps.progress("w0", 43, 0)
    ps.finished("w0", P + [1, 2, 3, 4], 42)
    ps.served("a0", P + [7, 8], 40, 1)          # P from w0's pass, under step 0
    ps.progress("a0", 43, 2)                    # an update in flight: its first decode position under step 2
    ps.finished("a0", P + [7, 8, 9, 5], 42)
    ps.served("a1", P + [7, 8, 9, 6], 43, 2)
    ps.flush(17, 2)
    ps.served("b0", P + [7], 0, 2)
    ps.served("b1", P + [1], 40, 2)
    lines = ps.take()
    by = {x.get("seq", "flush"): x for x in lines}
    assert by["w0"]["kv_steps"] == [] and by["w0"]["cached_tokens"] == 0
    assert by["a0"]["kv_steps"] == [[0, 40, 0]] and by["a0"]["weight_step"] == 1
    assert by["a1"]["kv_steps"] == [[0, 40, 0], [40, 42, 1], [42, 43, 2]], by["a1"]
    assert by["flush"] == {"flush": True, "forward_step": 17, "weight_step": 2}
    assert by["b1"]["kv_steps"] == [[0, 40, 2]] and by["b1"]["last_flush_forward_step"] == 17
    assert ps.take() == []


def test_record_round_trip_and_damaged_record(tmp_path):
    """/prefix_cache as written is read back line by line; a line that is not what the format says
    is one clear error."""
    import h5py

    from tensordiff.errors import TraceFileError
    from tensordiff.trace.prefix_cache import append_prefix_cache, read_prefix_cache

    class R:
        def __init__(self, f):
            self.f, self.complete = f, True

    path = tmp_path / "t.h5"
    with h5py.File(path, "w") as f:
        append_prefix_cache(f, [{"seq": "a0", "cached_tokens": 40, "weight_step": 1, "kv_steps": [[0, 40, 0]],
                                 "last_flush_forward_step": -1}], engine="sglang", radix_cache=True)
        append_prefix_cache(f, [{"flush": True, "forward_step": 9, "weight_step": 1}])
    with h5py.File(path, "r") as f:
        rec = read_prefix_cache(R(f))
    assert rec.engine == "sglang" and rec.radix_cache is True
    assert rec.requests == {"a0": {"cached_tokens": 40, "weight_step": 1, "kv_steps": [(0, 40, 0)],
                                   "last_flush_forward_step": -1}}
    assert rec.flushes == [{"forward_step": 9, "weight_step": 1}]
    for bad in ({"seq": "a0", "cached_tokens": 4, "kv_steps": [[0, 40, 0]]}, {"seq": 3}, [1, 2],
                {"seq": "a0", "cached_tokens": "40"}):
        with h5py.File(path, "w") as f:
            append_prefix_cache(f, [bad])
        with h5py.File(path, "r") as f, pytest.raises(TraceFileError, match="/prefix_cache line 1"):
            read_prefix_cache(R(f))


def test_a_step_that_changed_only_the_head_left_the_kv_as_it_was(tmp_path):
    """Reused KV of step 0 served under step 1 is stale where a parameter the KV depends on
    changed; where only the head after the last layer (lm_head, the final norm) did, the KV is
    the one step 1 computes, and nothing is named."""
    import h5py

    from tensordiff.rl.cache import stale_requests
    from tensordiff.trace.prefix_cache import append_prefix_cache
    from tensordiff.trace.rl import write_weight_step
    from tensordiff.weights import FINGERPRINT_FORMAT

    def doc(changed):
        keys = ["model.embed_tokens.weight", "model.layers.0.self_attn.k_proj.weight", "model.norm.weight",
                "lm_head.weight"]
        return {"format": FINGERPRINT_FORMAT, "parameters": [
            {"key": k, "name": k, "dtype": "float32", "shape": [4, 4], "norm": 1.0,
             "sha256": ("new-" if k in changed else "old-") + k} for k in keys]}

    class Side:
        def __init__(self, f=None):
            self.sequences, self.complete = ["a0", "f0"], True
            if f is not None:
                self.f = f

    got = {}
    for name, changed in (("head", {"lm_head.weight", "model.norm.weight"}),
                          ("layer", {"model.layers.0.self_attn.k_proj.weight"})):
        path = tmp_path / f"{name}.h5"
        with h5py.File(path, "w") as f:
            write_weight_step(f, 0, doc(set()), forward_step=0, event="start")
            write_weight_step(f, 1, doc(changed), forward_step=5, event="update_weights_from_tensor")
            append_prefix_cache(f, [{"seq": "a0", "cached_tokens": 40, "weight_step": 1, "kv_steps": [[0, 40, 0]],
                                     "last_flush_forward_step": -1},
                                    {"seq": "f0", "cached_tokens": 0, "weight_step": 1, "kv_steps": []}],
                                engine="sglang", radix_cache=True)
        with h5py.File(path, "r") as f:
            got[name] = stale_requests(Side(), Side(f))
    assert got["head"]["stale"] == {} and sorted(got["head"]["fresh"]) == ["a0", "f0"]
    assert list(got["layer"]["stale"]) == ["a0"] and got["layer"]["fresh"] == ["f0"]
    a0 = got["layer"]["stale"]["a0"]
    assert (a0["runs"], a0["served"], a0["differ"], a0["params"]) == ([(0, 40, 0)], 1, 1, 2)
