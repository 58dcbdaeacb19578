"""The bug fuzzer's fast tier (benchmarks/fuzz_verdicts.py): fixed seeds on tiny HF models, every
scenario judged against the generator's own ground truth. A miss (a confident wrong cause, a false
alarm, or "agree" on a bug at 3x the noise or more) fails unless benchmarks/fuzz_known_limits.json
lists its seed with a reason; a listed seed that no longer misses fails too (the file shrinks when
the tool improves), and the number of listed limits is pinned (it never grows silently)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

SEED, N = 1010, 30
KNOWN = REPO / "benchmarks" / "fuzz_known_limits.json"
PINNED = 1     # entries in the known-limits file: change only with a reviewed entry added or removed


def _known() -> dict[int, dict]:
    return {int(e["seed"]): e for e in json.loads(KNOWN.read_text())["limits"]}


def test_known_limits_are_reviewed_and_pinned():
    known = _known()
    assert len(known) == PINNED, f"{KNOWN.name} has {len(known)} entries, the test pins {PINNED}"
    for seed, e in known.items():
        assert SEED <= seed < SEED + N, f"seed {seed} is not a fast-tier seed"
        assert len(e.get("reason", "")) > 40 and e.get("x") is not None and e.get("kind"), e


@pytest.mark.slow
def test_fast_tier_misses_only_known_limits(tmp_path, capsys):
    import fuzz_verdicts

    doc = fuzz_verdicts.run(fuzz_verdicts.parse(["--seed", str(SEED), "--n", str(N), "--no-progress",
                                                 "--json", str(tmp_path / "fuzz.json")]))
    capsys.readouterr()
    known = _known()
    misses = {r["seed"]: r for r in doc["results"] if r["miss"]}
    new = [f"seed {s}: {r['outcome']} ({r['why']}) {r['kind']} x {r['x']}: {r['headline'][:160]}"
           for s, r in misses.items() if s not in known]
    assert not new, "misses not in the known-limits file:\n" + "\n".join(new)
    fixed = [s for s in known if s not in misses]
    assert not fixed, f"listed limits that no longer miss (remove them from {KNOWN.name}): {fixed}"
    for s, r in misses.items():
        assert r["kind"] == known[s]["kind"] and r["outcome"] == known[s]["outcome"], (r, known[s])
    assert doc["scenarios"] == N and set(json.loads((tmp_path / "fuzz.json").read_text())) >= {
        "scenarios", "named", "found_elsewhere", "agree", "wrong", "false_alarms", "named_rate_at_3x", "per_kind"}


@pytest.mark.parametrize("argv, says", [
    (["--seed", "-1"], "--seed must be"),
    (["--seed", "x"], "invalid int value"),
    (["--kinds", "weight_scale,nope"], "unknown kind nope"),
    (["--models", "gpt5"], "unknown model gpt5"),
    (["--n", "0"], "--n must be at least 1"),
    (["--tier", "slow", "--kinds", "mask_lost"], "--tier slow injects"),
    (["--tier", "slow", "--models", "qwen3"], "trained tiny Llama only"),
    (["--json", "/nonexistent/dir/f.json"], "does not exist"),
    (["--report", "/nonexistent.json"], "not a fuzz_verdicts --json file"),
])
def test_bad_input_is_one_line_and_exit_2(argv, says):
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "fuzz_verdicts.py"), *argv],
                          capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0] and "Traceback" not in proc.stderr, proc.stderr
