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
    assert "traces disagree: slot 0 of draft_input holds layer2 where layer1 was expected" in out, out
    assert "✗ #" in out and "slot_identity" in out
    assert "tensordiff/testing.py" not in out and "Traceback" not in out, "the failure is the diff, not a traceback"
    # the same with the failing tensor allowed from the command line
    p = subprocess.run(cmd + ["--tensordiff-allow-failed", "draft_input"], capture_output=True, text=True,
                       cwd=tmp_path, env=env, timeout=300, check=False)
    assert p.returncode == 0 and "3 passed" in p.stdout, p.stdout + p.stderr
