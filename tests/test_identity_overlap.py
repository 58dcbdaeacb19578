"""The identity search of a disagreeing boundary scored in a thread while the numeric pass goes on
(tensordiff/diff/early.py, DiffOptions.overlap_identity): the same findings, byte for byte, as the search run
after the numeric pass in the diff's own thread, whichever pair diverges (one in the middle, the
last one, several), whatever the identity thread's timing; and a diff stopped with a search in
flight closes cleanly."""

from __future__ import annotations

import importlib
import json
import threading
import time

import numpy as np
import pytest

from tensordiff.catalog import IdentitySearch
from tensordiff.cli import jsonable
from tensordiff.diff import DiffOptions, RunCounters, diff_sources, diff_traces, open_pair

run = importlib.import_module("tensordiff.diff.run")   # the package exports names, not the module
from tensordiff.trace import TraceWriter

H = 64
LAYERS = 8
TOKENS = 96


def _states(seed: int = 0) -> list[np.ndarray]:
    """A trained-looking residual stream: consecutive boundaries at cos ~0.99."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((TOKENS, H)).astype(np.float32)
    out = [x.copy()]
    for _ in range(1, LAYERS):
        x = x + np.float32(0.12) * rng.standard_normal((TOKENS, H)).astype(np.float32)
        out.append(x.copy())
    return out


def _write(path: str, side: str, states: list[np.ndarray], noise: float, seed: int) -> None:
    rng = np.random.default_rng(seed)
    with TraceWriter(path, side=side, producer="tests/test_identity_overlap.py",
                     model={"num_layers": LAYERS, "hidden_size": H}) as w:
        for b in range(LAYERS):
            w.define_tensor(f"layer{b}", H, kind="boundary", boundary=b, role="catalog")
        rows = w.add_tokens("req-0", np.arange(TOKENS), np.random.default_rng(5).integers(3, 900, TOKENS),
                            "train" if side == "train" else "prefill")
        for b, x in enumerate(states):
            w.append(f"layer{b}", rows, x + np.float32(noise) * rng.standard_normal(x.shape).astype(np.float32))


def _pair(tmp_path, name: str, break_b) -> tuple[str, str]:
    """A and B of one stream; ``break_b(states)`` returns B's (some boundaries holding other data)."""
    a, b = str(tmp_path / f"{name}-a.h5"), str(tmp_path / f"{name}-b.h5")
    st = _states()
    _write(a, "train", st, 0.0, 1)
    _write(b, "serve", break_b([s.copy() for s in st]), 1e-5, 2)
    return a, b


def _shift(at: int):   # B's boundary ``at`` holds the state before it (a hook one layer early)
    def f(st):
        st[at] = st[at - 1].copy()
        return st
    return f


def _noise(*ats: int):   # B's boundaries ``ats`` hold no recorded state
    def f(st):
        rng = np.random.default_rng(7)
        for at in ats:
            st[at] = st[at] + np.float32(0.8) * rng.standard_normal(st[at].shape).astype(np.float32)
        return st
    return f


def _from_on(at: int):  # every boundary from ``at`` on holds the state before it
    def f(st):
        return st[:at] + [st[i - 1].copy() for i in range(at, LAYERS)]
    return f


def _diff(a: str, b: str, overlap: bool, **opts) -> tuple[str, int]:
    counters = RunCounters()
    with open_pair(a, b) as (ra, rb):
        res = diff_sources(ra, rb, DiffOptions(overlap_identity=overlap, **opts), counters=counters)
    return json.dumps(jsonable(res.to_dict()), sort_keys=True), counters.early_identities


CASES = {"middle_holds_previous": _shift(4), "last_holds_previous": _shift(LAYERS - 1),
         "middle_no_state": _noise(3), "several_no_state": _noise(2, 5, LAYERS - 1),
         "several_from_on": _from_on(3)}


@pytest.mark.parametrize("from_pass", [True, False], ids=["noise_from_pass", "noise_sample_first"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_overlapped_identity_gives_the_sequential_findings(tmp_path, case, from_pass):
    a, b = _pair(tmp_path, case, CASES[case])
    for x, y in ((a, b), (b, a)):
        seq, n_seq = _diff(x, y, False, noise_from_pass=from_pass)
        over, n_over = _diff(x, y, True, noise_from_pass=from_pass)
        assert n_seq == 0
        doc = json.loads(over)
        failing = [p for p in doc["tensors"] if p["compared"] and sum(p["failing"]) > 0]
        # with the noise measured from the pass, the searches start on the default tolerances,
        # for the first EARLY_GUESSES failing boundaries (the judge scores the rest itself)
        want = min(len(failing), run.EARLY_GUESSES) if from_pass else len(failing)
        assert failing and n_over == want, "the failing boundaries' searches came from the thread"
        assert over == seq
        assert over == _diff(x, y, True, noise_from_pass=not from_pass)[0]


def test_the_verdicts_of_the_cases(tmp_path):
    """What the cases above compare is a real verdict: the shifted boundary is named as holding
    the state before it (decided under the measured noise floors, which exist only after the
    numeric pass), the noisy one as holding none."""
    a, b = _pair(tmp_path, "holds", _shift(4))
    doc = json.loads(_diff(a, b, True)[0])
    ids = [f for f in doc["findings"] if f["kind"] == "slot_identity"]
    assert [(f["tensor"], f["details"]["held"], f["details"]["outcome"]) for f in ids] == [("layer4", "layer3", "holds")]
    a, b = _pair(tmp_path, "none", _noise(3))
    doc = json.loads(_diff(a, b, True)[0])
    assert not [f for f in doc["findings"] if f["kind"] == "slot_identity"]
    assert doc["first_divergence"]["tensor"] == "layer3"


def test_a_slow_identity_thread_changes_nothing(tmp_path, monkeypatch):
    """The search finishing long after the numeric pass (or long before) gives the same findings."""
    a, b = _pair(tmp_path, "slow", _from_on(2))
    seq, _ = _diff(a, b, False)
    real = IdentitySearch.score

    def slow(self, *args, **kw):
        if threading.current_thread().name.startswith("tensordiff-identity"):
            time.sleep(0.15)
        return real(self, *args, **kw)
    monkeypatch.setattr(IdentitySearch, "score", slow)
    over, n = _diff(a, b, True)
    assert n == min(LAYERS - 2, run.EARLY_GUESSES) and over == seq
    over, n = _diff(a, b, True, noise_from_pass=False)
    assert n == LAYERS - 2 and over == seq


def test_a_diff_stopped_with_a_search_in_flight_closes(tmp_path, monkeypatch):
    a, b = _pair(tmp_path, "stop", _shift(2))
    started = threading.Event()
    real = IdentitySearch.score

    def slow(self, *args, **kw):
        started.set()
        time.sleep(0.3)
        return real(self, *args, **kw)
    monkeypatch.setattr(IdentitySearch, "score", slow)

    class Stop(Exception):
        pass

    def progress(stage, done, total):
        if started.is_set():
            raise Stop

    before = {t.name for t in threading.enumerate()}
    t0 = time.perf_counter()
    with pytest.raises(Stop):
        diff_traces(a, b, DiffOptions(progress=progress))
    assert time.perf_counter() - t0 < 10
    left = {t.name for t in threading.enumerate()} - before
    assert not [n for n in left if n.startswith("tensordiff-identity")]
