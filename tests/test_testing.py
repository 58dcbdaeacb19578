"""tensordiff.testing.assert_traces_agree and the pytest plugin (run on a pair in a subprocess)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from tracegen import write_verdict_pairs

from tensordiff.errors import TensordiffError, UsageError
from tensordiff.testing import TracesDisagree, assert_traces_agree
from tensordiff.tolerances import tolerance_book

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> dict[str, tuple[str, str]]:
    d = tmp_path_factory.mktemp("pairs")
    return write_verdict_pairs(d)


def test_agreeing_pair_passes(pairs):
    res = assert_traces_agree(*pairs["agree"])
    assert res.exit_code == 0 and res.tokens_aligned > 0


def test_divergence_message_is_headline_and_first_findings(pairs):
    with pytest.raises(TracesDisagree) as ei:
        assert_traces_agree(*pairs["wrong"], max_findings=1)
    res = ei.value.result
    lines = str(ei.value).splitlines()
    first = res.first_divergence
    assert lines[0] == f"traces disagree: {first.message}"
    assert f"✗ #{first.index} {first.kind}: {first.message}" in str(ei.value)
    assert f"... {len(res.divergences) - 1} more" in lines[-1]
    assert isinstance(ei.value, AssertionError)


def test_tolerance_and_allow(pairs):
    with pytest.raises(TracesDisagree):
        assert_traces_agree(*pairs["noisy"])
    # looser rules let the noise through; the first matching rule wins
    assert_traces_agree(*pairs["noisy"], tol={"*": (0.9, 0.5)})
    assert_traces_agree(*pairs["noisy"], tol=["*=0.9,0.5", "*=1,0"])
    with pytest.raises(TracesDisagree):
        assert_traces_agree(*pairs["noisy"], tol=["*=1,0", "*=0.9,0.5"])
    # allowing the failing tensors turns them into notes
    with pytest.raises(TracesDisagree) as ei:
        assert_traces_agree(*pairs["wrong"], allow=["layer*"])
    assert all(f.tensor == "draft_input" for f in ei.value.result.divergences)
    assert_traces_agree(*pairs["wrong"], allow="draft_*")
    assert_traces_agree(*pairs["wrong"], allow=["draft_input[0]", "re:draft_input\\[1\\]"])
    with pytest.raises(TracesDisagree):
        assert_traces_agree(*pairs["wrong"], allow=["draft_input[0]"])     # slot 1 still fails
    # a pattern that matches nothing is an error, never a silent pass
    with pytest.raises(UsageError, match="matches no compared tensor"):
        assert_traces_agree(*pairs["wrong"], allow=["draft_inptu"])
    with pytest.raises(TensordiffError, match="nonsense"):
        assert_traces_agree(*pairs["agree"], tol="nonsense")


def test_a_book_passed_in_is_never_written(pairs):
    """A ToleranceBook the caller passes (and may pass to the next diff) keeps its patterns: the
    --allow-failed patterns of one call do not leak into the next."""
    book = tolerance_book([])
    assert_traces_agree(*pairs["wrong"], tol=book, allow="draft_*")
    assert book.allow_failed == []
    with pytest.raises(TracesDisagree):
        assert_traces_agree(*pairs["wrong"], tol=book)


def test_bad_input_is_not_a_disagreement(tmp_path, pairs):
    bad = tmp_path / "bad.h5"
    bad.write_bytes(b"not hdf5")
    with pytest.raises(TensordiffError) as ei:
        assert_traces_agree(pairs["agree"][0], str(bad))
    assert not isinstance(ei.value, AssertionError)


def test_pytest_plugin_in_a_subprocess(tmp_path, pairs):
    a, same = pairs["agree"]
    _, wrong = pairs["wrong"]
    (tmp_path / "test_pipeline.py").write_text(textwrap.dedent(f"""
        def test_agree(assert_traces_agree):
            assert_traces_agree({a!r}, {same!r})

        def test_wrong_slots(assert_traces_agree):
            assert_traces_agree({a!r}, {wrong!r})

        def test_allowed_by_ini(assert_traces_agree):
            assert_traces_agree({a!r}, {wrong!r}, allow=[])
    """))
    (tmp_path / "pytest.ini").write_text("[pytest]\ntensordiff_tol =\n    *=0.999,0.01\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")   # only this plugin, loaded by name
    cmd = [sys.executable, "-m", "pytest", "-p", "tensordiff.pytest_plugin", "-q", "-p", "no:cacheprovider",
           str(tmp_path / "test_pipeline.py")]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300, check=False)
    out = p.stdout + p.stderr
    assert p.returncode == 1, out
    assert "1 passed, 2 failed" in out or "2 failed, 1 passed" in out, out
    assert ("traces disagree: slot 0 of draft_input: train feeds layer1, serve feeds layer2 (each holds what it claims; "
            "the draft was trained on train's)") in out, out
    assert "✗ #" in out and "slot_identity" in out
    assert "tensordiff/testing.py" not in out and "Traceback" not in out, "the failure is the diff, not a traceback"
    # the same with the failing tensor allowed from the command line
    p = subprocess.run(cmd + ["--tensordiff-allow-failed", "draft_input"], capture_output=True, text=True,
                       cwd=tmp_path, env=env, timeout=300, check=False)
    assert p.returncode == 0 and "3 passed" in p.stdout, p.stdout + p.stderr


def _incomplete_pair(d: Path) -> tuple[str, str]:
    """embed agrees on both sequences; layer1 has rows of sequence 0 on A and of 1 on B only, so it
    shares no token and cannot be compared: verdict incomplete."""
    import numpy as np

    from tensordiff.trace import TraceWriter

    paths = []
    for side, own in (("train", 0), ("serve", 1)):
        p = d / f"{side}.h5"
        w = TraceWriter(str(p), side=side, producer="tests/test_testing.py", model={"num_layers": 2, "hidden_size": 16})
        w.define_tensor("embed", 16, kind="boundary", boundary=0)
        w.define_tensor("layer1", 16, kind="boundary", boundary=1)
        rng = np.random.default_rng(0)
        for s in range(2):
            rows = w.add_tokens(f"req-{s}", np.arange(8), np.arange(8) + 10 * s + 1, "train" if side == "train" else "prefill")
            x = rng.standard_normal((8, 16)).astype(np.float32)
            w.append("embed", rows, x)
            if s == own:
                w.append("layer1", rows, x * 2)
        w.close()
        paths.append(str(p))
    return paths[0], paths[1]


def test_incomplete_is_not_agreement(tmp_path):
    a, b = _incomplete_pair(tmp_path)
    with pytest.raises(TracesDisagree) as ei:
        assert_traces_agree(a, b)
    msg = str(ei.value)
    assert msg.startswith("traces not fully compared: no divergence in the 1 of 2 tensors compared"), msg
    assert "? layer1:" in msg and "allow_incomplete=True" in msg
    res = assert_traces_agree(a, b, allow_incomplete=True)
    assert res.verdict == "incomplete" and res.exit_code == 0


def test_pytest_plugin_incomplete_fails_unless_the_ini_allows_it(tmp_path):
    d = tmp_path / "traces"
    d.mkdir()
    a, b = _incomplete_pair(d)
    (tmp_path / "test_cov.py").write_text(textwrap.dedent(f"""
        def test_cov(assert_traces_agree):
            assert_traces_agree({a!r}, {b!r})
    """))
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
    cmd = [sys.executable, "-m", "pytest", "-p", "tensordiff.pytest_plugin", "-q", "-p", "no:cacheprovider",
           str(tmp_path / "test_cov.py")]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300, check=False)
    out = p.stdout + p.stderr
    assert p.returncode == 1 and "traces not fully compared" in out and "Traceback" not in out, out
    (tmp_path / "pytest.ini").write_text("[pytest]\ntensordiff_allow_incomplete = true\n")
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300, check=False)
    assert p.returncode == 0 and "1 passed" in p.stdout, p.stdout + p.stderr
