"""`record serve --replay`: the plan read from a rollout trace (or its outputs JSONL), the positions
the rollout sampled, and bad input as one line, exit 2. No engine: the traces are written with the
trace writer as the plugin writes them (prefill rows, decode rows, sampled_logprob)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tensordiff import conventions as cv
from tensordiff.errors import SourceFileError, TraceFileError
from tensordiff.recorders.replay import REPLAY_ATTR, plan_replay, replay_attr, sampled_from
from tensordiff.trace import TraceWriter

REPO = Path(__file__).resolve().parent.parent
PROMPTS = {"a": [5, 6, 7, 8], "b": [9, 10, 11]}
GEN = {"a": [20, 21, 22], "b": [30, 31, 32]}


def _rollout(path: Path, *, side: str = "serve", cached: int = 0, sampled: bool = True, replay: bool = False) -> Path:
    """A serve trace as the plugin writes one: each prompt a prefill (``b`` from position
    ``cached`` on: a prefix-cache hit), each generated token but the last fed back as a decode row,
    and the sampled token's log-prob on the row that sampled it."""
    w = TraceWriter(path, side=side, producer="test", model={"num_layers": 2, "hidden_size": 4})
    rows_of = {}
    for key, prompt in PROMPTS.items():
        start = cached if key == "b" else 0
        pos = np.arange(start, len(prompt))
        r = w.add_tokens(key, pos, np.asarray(prompt[start:]), regime="prefill")
        rows_of[(key, len(prompt) - 1)] = int(r[-1])
        for j, t in enumerate(GEN[key][:-1]):
            p = len(prompt) + j
            rows_of[(key, p)] = int(w.add_tokens(key, np.asarray([p]), np.asarray([t]), regime="decode")[0])
    if sampled:
        w.define_tensor(cv.SAMPLED_LOGPROB, 2, dtype="float64", role=cv.SAMPLED_LOGPROB, sketch=False)
        rows, vals = [], []
        for key, prompt in PROMPTS.items():
            for j, t in enumerate(GEN[key]):
                rows.append(rows_of[(key, len(prompt) - 1 + j)])
                vals.append((t, -0.5))
        w.append(cv.SAMPLED_LOGPROB, np.asarray(rows), np.asarray(vals, dtype=np.float64))
    if replay:
        w.f.attrs[REPLAY_ATTR] = json.dumps({"rollout": "x"})
    w.close()
    return path


def _outputs(path: Path) -> Path:
    path.write_text("".join(json.dumps({"id": k, "input_ids": PROMPTS[k], "output_ids": GEN[k]}) + "\n"
                            for k in PROMPTS))
    return path


def test_plan_from_the_trace_replays_every_fed_token(tmp_path):
    plan = plan_replay(str(_rollout(tmp_path / "r.h5")))
    assert plan.source == "trace"
    assert plan.sequences == [("a", PROMPTS["a"] + GEN["a"][:-1]), ("b", PROMPTS["b"] + GEN["b"][:-1])]
    assert plan.sampled_from == {"a": 3, "b": 2}
    attr = replay_attr(plan, "sglang")
    assert (attr["regime"], attr["max_tokens"], attr["prefix_cache"], attr["tokens_from"]) == ("prefill", 1, False,
                                                                                                 "trace")
    assert attr["tokens"] == 6 + 5 and len(attr["tokens_sha256_16"]) == 16


def test_sampled_positions_without_sampled_logprob_come_from_the_decode_rows(tmp_path):
    assert sampled_from(str(_rollout(tmp_path / "r.h5", sampled=False))) == {"a": 3, "b": 2}


def test_a_prefix_cache_hit_needs_the_outputs_file(tmp_path):
    r = _rollout(tmp_path / "r.h5", cached=2)
    with pytest.raises(TraceFileError, match="no row at position 0.*--replay-outputs"):
        plan_replay(str(r))
    plan = plan_replay(str(r), str(_outputs(tmp_path / "o.jsonl")))
    assert plan.source == "outputs" and dict(plan.sequences) == {k: PROMPTS[k] + GEN[k] for k in PROMPTS}


def test_outputs_of_another_run_are_refused(tmp_path):
    r = _rollout(tmp_path / "r.h5")
    o = tmp_path / "o.jsonl"
    o.write_text(json.dumps({"id": "a", "input_ids": [5, 6, 99, 8], "output_ids": GEN["a"]}) + "\n"
                 + json.dumps({"id": "b", "input_ids": PROMPTS["b"], "output_ids": GEN["b"]}) + "\n")
    with pytest.raises(SourceFileError, match="sequence a position 2: token 7 in the rollout trace, 99"):
        plan_replay(str(r), str(o))


@pytest.mark.parametrize("case", ["prompts-too", "outputs-alone", "train-trace", "a-replay", "neither"])
def test_replay_bad_input_is_one_line_exit_2(tmp_path, case):
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"vocab_size": 64}))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"input_ids": [1, 2]}\n')
    rollout = _rollout(tmp_path / "r.h5", side="train" if case == "train-trace" else "serve", replay=case == "a-replay")
    argv = ["--model", str(model), "--out", str(tmp_path / "s.h5")]
    argv += {"prompts-too": ["--replay", str(rollout), "--prompts", str(prompts)],
             "outputs-alone": ["--prompts", str(prompts), "--replay-outputs", str(_outputs(tmp_path / "o.jsonl"))],
             "train-trace": ["--replay", str(rollout)], "a-replay": ["--replay", str(rollout)], "neither": []}[case]
    proc = subprocess.run([sys.executable, "-m", "tensordiff", "record", "serve", *argv], check=False, capture_output=True,
                          text=True, cwd=REPO, env={k: v for k, v in os.environ.items() if not k.startswith("TENSORDIFF")})
    assert proc.returncode == 2, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert not (tmp_path / "s.h5").exists()
