"""Faults a multi-rank recording produces, on files written as the vLLM plugin writes them (rank
facts with ``replicated``, ``host`` and ``run``; no engine): replicated TP ranks that hold
different tokens (a rank that stopped early), files of two runs, a rank not closed cleanly while
the others were. Each is one line and exit code 2, never a partial "agree". The same faults on a
real engine's files: tests/test_vllm_ranks.py."""

from __future__ import annotations

import os

import h5py
import pytest
from setgen import make_recording, write

from tensordiff.cli import main
from tensordiff.errors import IncompatibleTracesError
from tensordiff.traceset import TraceSet


def _ranks(tp: int, run: str = "1764790000000000000") -> dict:
    return {"ranks": {"tp_rank": tp, "tp_size": 2, "pp_rank": 0, "pp_size": 1, "dp_rank": 0, "dp_size": 1,
                      "replicated": True, "host": "node-a", "run": run}}


@pytest.fixture
def rec():
    return make_recording("serve", noise=1e-6, seed=1)


def _set(tmp_path, rec, keys1=None, run1=None) -> str:
    d = tmp_path / "set"
    d.mkdir()
    write(str(d / "serve.tp0.h5"), rec, meta=_ranks(0))
    write(str(d / "serve.tp1.h5"), rec, keys=keys1, meta=_ranks(1, run1) if run1 else _ranks(1))
    return str(d)


def _exit_2(capsys, argv, want: str) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and want in err[0], err


def test_one_runs_replicas_make_a_set(tmp_path, rec):
    with TraceSet(_set(tmp_path, rec)) as s:
        assert s.check_replicas() == [] and s.replicated_rows > 0


def test_a_replicated_rank_holding_fewer_tokens_is_refused(tmp_path, rec, capsys):
    d = _set(tmp_path, rec, keys1=rec.keys[:-1])
    with pytest.raises(IncompatibleTracesError, match=r"TP ranks of one recording hold different tokens: "
                       r"serve.tp1.h5 lacks \d+ of the \d+ tokens serve.tp0.h5 holds"):
        TraceSet(d)
    train = write(str(tmp_path / "train.h5"), make_recording("train"))
    for argv in (["diff", train, d], ["diff", d, train], ["info", d]):
        _exit_2(capsys, argv, "TP ranks of one recording hold different tokens")


def test_files_of_two_runs_are_refused(tmp_path, rec, capsys):
    d = _set(tmp_path, rec, run1="1764790099999999999")
    _exit_2(capsys, ["info", d], "trace set mixes engine runs")


def test_a_rank_not_closed_cleanly_beside_closed_ones_is_refused(tmp_path, rec, capsys):
    d = _set(tmp_path, rec)
    with h5py.File(os.path.join(d, "serve.tp1.h5"), "r+") as f:
        f.attrs["complete"] = 0
    _exit_2(capsys, ["info", d], "serve.tp1.h5 was not closed cleanly")
