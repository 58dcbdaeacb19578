"""The recordings cache of tests/recordings.py, on a builder that writes a file and counts its calls:
one build per key, the two workers of a run taking turns on the lock, and an entry that was written
into or cut off is recorded again."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import recordings as recs

HERE = Path(__file__).resolve().parent


def _count(out: Path, needs: dict, *, text: str, calls: str) -> dict:
    with open(calls, "a") as f:
        f.write("x")
    (out / "run.txt").write_text(text + "".join(n["text"] for n in needs.values()))
    return {"text": text, "file": str(out / "run.txt")}


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TENSORDIFF_RECORDINGS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setitem(recs.BUILDERS, "count", _count)
    return tmp_path


def _rec(cache: Path, text: str, needs=()) -> recs.Recording:
    return recs.Recording(f"count-{text}", "hf", "count", recs._args(text=text, calls=str(cache / "calls")), needs)


def test_a_recording_is_built_once_and_read_after(cache):
    a = _rec(cache, "a")
    first = recs.serve(a)
    assert recs.serve(a) == first and Path(first["file"]).read_text() == "a"
    assert (cache / "calls").read_text() == "x"
    assert Path(first["file"]).parent == cache / "cache" / f"count-a-{recs.key(a)}"


def test_other_arguments_or_another_need_are_another_key(cache):
    a, b = _rec(cache, "a"), _rec(cache, "b")
    on_a, on_b = _rec(cache, "c", (a,)), _rec(cache, "c", (b,))
    assert len({recs.key(r) for r in (a, b, on_a, on_b)}) == 4
    assert Path(recs.serve(on_a)["file"]).read_text() == "ca"
    assert Path(recs.serve(on_b)["file"]).read_text() == "cb"


def test_an_entry_written_into_or_cut_off_is_recorded_again(cache):
    a = _rec(cache, "a")
    got = recs.serve(a)
    with open(got["file"], "a") as f:      # a test that wrote into a recorded file
        f.write("!")
    assert Path(recs.serve(a)["file"]).read_text() == "a"
    (Path(got["file"]).parent / "recording.json").unlink()   # a build that never finished
    recs.serve(a)
    assert (cache / "calls").read_text() == "xxx"


def test_the_two_workers_take_turns_and_build_once(cache):
    code = textwrap.dedent(f"""
        import json, sys, time
        sys.path.insert(0, {str(HERE)!r})
        import recordings as recs
        from pathlib import Path
        def slow(out, needs, *, text, calls):
            with open(calls, "a") as f:
                f.write("x")
            time.sleep(2)              # long enough for the other process to reach the lock
            (out / "run.txt").write_text(text)
            return {{"file": str(out / "run.txt")}}
        recs.BUILDERS["count"] = slow
        rec = recs.Recording("count-both", "hf", "count", recs._args(text="both", calls={str(cache / "calls")!r}))
        print(json.dumps(recs.serve(rec)))
    """)
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [json.loads(p.communicate(timeout=120)[0]) for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert outs[0] == outs[1] and Path(outs[0]["file"]).read_text() == "both"
    assert (cache / "calls").read_text() == "x"


def test_the_key_covers_the_recorders_the_trace_format_and_the_support_files():
    files = {str(f.relative_to(recs.REPO)) for f in recs._recorder_modules()}
    assert "tensordiff/recorders/sglang/__init__.py" in files and "tensordiff/recorders/serve_cli.py" in files
    assert "tensordiff/trace/writer.py" in files and "tensordiff/names.py" in files
    assert not any(f.startswith(("tensordiff/diff/", "tensordiff/report/", "tensordiff/tui/")) for f in files), files
    for f in recs._SUPPORT:
        assert (HERE / f).exists(), f
