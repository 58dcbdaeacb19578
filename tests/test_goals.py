"""benchmarks/goals.py judges figures; a goal whose figure was not measured is a FAIL that says why."""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
BENCH = os.path.join(os.path.dirname(HERE), "benchmarks")


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", os.path.join(BENCH, f"{name}.py"))
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    sys.path.insert(0, BENCH)
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(BENCH)
    return mod


goals = _load("goals")
benchjson = _load("benchjson")


def test_every_goal_names_a_run_and_every_bench_script_exists():
    keys = {r.key for r in goals.RUNS}
    assert {g.run for g in goals.GOALS} <= keys
    for r in goals.RUNS:
        assert os.path.exists(os.path.join(BENCH, r.script)), r.script


@pytest.mark.parametrize("value, status", [(0.81, "PASS"), (0.8, "PASS"), (0.79, "FAIL")])
def test_judge_compares_against_the_target(value, status):
    g = goals.Goal("x", "diff-default", "inproc_vs_read", ">=", 0.8, "x")
    assert goals.judge(g, {"figures": {"inproc_vs_read": value}}, "")["status"] == status


@pytest.mark.parametrize("res", [None, {"figures": {}}, {"figures": {"rss_mb": None}}, {"figures": {"rss_mb": "big"}},
                                 {"figures": {"rss_mb": float("nan")}}])
def test_a_figure_not_measured_is_not_a_pass(res):
    g = goals.Goal("x", "memory", "rss_mb", "<=", 300, " MB")
    row = goals.judge(g, res, "exit 2")
    assert row["status"] == "FAIL" and not row["measured"] and row["why"].startswith("not measured: ")


def test_from_dir_judges_saved_results_and_exits_1_on_a_missing_one(tmp_path, capsys):
    res = benchjson.Result("bench_identity", config={"tokens": 10})
    res.write(str(tmp_path / "identity.json"), figures={"seconds_100k": 0.4, "seconds_1m": float("inf")})
    doc = json.loads((tmp_path / "identity.json").read_text())
    assert doc["figures"]["seconds_1m"] is None and doc["commit"] and len(doc["load"]) == 2
    assert goals.main(["--only", "identity", "--from", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "| identity 100k tokens x 62 states x 3 slots | 0.40 s | <= 0.50 s | PASS |" in out
    assert "| not measured: seconds_1m missing from the result | <= 2.00 s | FAIL |" in out
    (tmp_path / "identity.json").write_text(json.dumps({**doc, "figures": {"seconds_100k": 0.4, "seconds_1m": 1.5}}))
    assert goals.main(["--only", "identity", "--from", str(tmp_path)]) == 0


def test_every_goal_of_the_machine_limits_issue_is_a_row():
    """The diff against the page-cache read rate and the CLI against the plain script at each size,
    the RSS, both plugins, the TUI at 1M and 10M tokens with its memory, record train --from-serve."""
    rows = [g for g in goals.GOALS if g.issue == 30]
    figures = {(g.run, g.figure): (g.op, g.target) for g in rows}
    assert {g.figure for g in rows if g.info} == {"numeric_vs_readinto"}
    for run in ("diff-default", "diff-64-layers", "diff-8k-tokens", "diff-100k-tokens"):
        assert figures[(run, "inproc_vs_readinto")] == (">=", 0.6)
        assert figures[(run, "numeric_vs_readinto")] == (">=", 0.6)   # that row's ceiling, beside it
        assert figures[(run, "cli_vs_script")] == (">=", 3.0)
        assert figures[(run, "rss_mb")] == ("<=", 300)
    assert figures[("vllm-eagle", "plugin_share")] == ("<=", 0.05)
    assert figures[("sglang-eagle", "plugin_share")] == ("<=", 0.05)
    assert figures[("tui-10m", "first_rows_s_1m")] == ("<=", 0.5)
    assert figures[("tui-10m", "first_rows_s_10m")] == ("<=", 1.0)
    assert ("tui-10m", "stream_rss_extra_mb_10m") in figures
    assert figures[("train-from-serve", "from_serve_vs_forward")] == (">=", 0.8)
    runs, selected = goals.select([], 30)
    assert selected == rows and {r.key for r in runs} == {g.run for g in rows}


def test_the_sglang_row_says_what_it_measures_until_the_rl_records_are_in(tmp_path, capsys):
    g = next(g for g in goals.GOALS if g.run == "sglang-eagle" and g.issue == 30)
    assert goals.judge(g, {"figures": {"plugin_share": 0.04}, "config": {}}, "")["note"] == goals.SGLANG_RL_NOTE
    assert "note" not in goals.judge(g, {"figures": {"plugin_share": 0.04}, "config": {"rl": "on"}}, "")
    assert goals.main(["--issue", "30", "--only", "sglang", "--from", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "not measured: not run (no sglang-eagle.json in the results)" in out and goals.SGLANG_RL_NOTE in out
    assert "FAIL" in out


@pytest.mark.parametrize("flags, simd", [("fpu sse2 avx avx2 avx512f avx512bw", "avx512"),
                                         ("fpu sse2 avx avx2 fma", "avx2"), ("fpu sse2", "none")])
def test_a_result_names_the_machine_it_was_measured_on(tmp_path, flags, simd):
    info = tmp_path / "cpuinfo"
    info.write_text(f"processor\t: 0\nmodel name\t: Some  CPU @ 2.0GHz\nflags\t\t: {flags}\n\n"
                    "processor\t: 1\nmodel name\t: Other CPU\nflags\t\t: fpu\n")
    m = benchjson.machine(str(info))
    assert m["cpu"] == "Some CPU @ 2.0GHz" and m["simd"] == simd and m["cores"] >= 1
    assert benchjson.machine(str(tmp_path / "absent")) == {"cpu": "unknown", "cores": m["cores"], "simd": "none"}
    res = benchjson.Result("bench_identity", config={})
    res.write(str(tmp_path / "identity.json"), figures={"seconds_100k": 0.4})
    assert json.loads((tmp_path / "identity.json").read_text())["machine"] == benchjson.machine()


def test_the_table_names_the_machine_and_each_one_when_results_came_from_several(tmp_path, capsys):
    def save(key, figures, machine):
        doc = {"bench": key, "commit": "abc1234", "dirty": False, "load": [0.1, 0.2], "config": {},
               "figures": figures}
        if machine is not None:
            doc["machine"] = machine
        (tmp_path / f"{key}.json").write_text(json.dumps(doc))

    epyc = {"cpu": "AMD EPYC", "cores": 2, "simd": "avx2"}
    save("identity", {"seconds_100k": 0.4, "seconds_1m": 1.5}, epyc)
    save("narrow", {"tokens_per_s": 1e9}, epyc)
    goals.main(["--only", "identity", "narrow", "--from", str(tmp_path)])
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("machine:")]
    assert lines == ["machine: AMD EPYC, 2 cores, avx2"]
    save("narrow", {"tokens_per_s": 1e9}, {"cpu": "Intel Xeon", "cores": 2, "simd": "avx512"})
    goals.main(["--only", "identity", "narrow", "--from", str(tmp_path)])
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("machine:")]
    assert sorted(lines) == ["machine: AMD EPYC, 2 cores, avx2 (identity)", "machine: Intel Xeon, 2 cores, avx512 (narrow)"]
    save("narrow", {"tokens_per_s": 1e9}, None)   # a result written before results named their machine
    goals.main(["--only", "identity", "narrow", "--from", str(tmp_path)])
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("machine:")]
    assert sorted(lines) == ["machine: AMD EPYC, 2 cores, avx2 (identity)", "machine: unknown machine (narrow)"]


def test_the_numeric_pass_alone_measures_every_element_of_both_traces(tmp_path):
    """bench_diff's ceiling of the in-process row: every tensor's values of both sides go through
    the diff's own per-row sums, on the diff's lanes (a pass over fewer would overstate it;
    ``elements`` counts the pairs of elements compared)."""
    bench = _load("bench_diff")
    cfg = {"dir": str(tmp_path), "layers": 3, "tokens": 300, "hidden": 256, "corrupt": 1, "seed": 0, "dumps": False}
    info = bench.prepare(cfg)
    got = bench.numeric_pass([info["trace_a"], info["trace_b"]])
    assert got["elements"] == 3 * 300 * 256
    assert got["lanes"] >= 1 and got["seconds"] > 0


def test_an_info_row_is_shown_against_its_target_and_never_counted(tmp_path, capsys):
    """The in-process row's ceiling: shown beside it and judged against the same target, but a
    ceiling under the target neither fails the run nor counts as a goal passed."""
    doc = {"bench": "bench_diff", "commit": "abc1234", "dirty": False, "load": [1.0, 1.0], "config": {},
           "figures": {"inproc_vs_readinto": 0.7, "numeric_vs_readinto": 0.5, "cli_vs_script": 3.2, "rss_mb": 120,
                       "names_corrupt": True, "inproc_vs_read": 1.2}}
    (tmp_path / "diff-default.json").write_text(json.dumps(doc))
    assert goals.main(["--only", "diff-default", "--from", str(tmp_path)]) == 1   # the probe share is missing
    out = capsys.readouterr().out
    assert "| 0.50x | >= 0.60x | info: misses the target |" in out
    assert "(1 info rows beside them, not counted)" in out
    doc["figures"]["probe_share"] = 0.01
    (tmp_path / "diff-default.json").write_text(json.dumps(doc))
    assert goals.main(["--only", "diff-default", "--from", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "6 of 6 goals passed (1 info rows" in out
    doc["figures"].pop("numeric_vs_readinto")
    (tmp_path / "diff-default.json").write_text(json.dumps(doc))
    assert goals.main(["--only", "diff-default", "--from", str(tmp_path)]) == 0
    assert "numeric_vs_readinto missing from the result | >= 0.60x | info |" in capsys.readouterr().out
