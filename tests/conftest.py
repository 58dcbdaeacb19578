"""Under CI (CI=true) a skipped test is a failure: CI installs torch, transformers and real
SGLang, so an import-skip there would only hide a broken install step."""

import json
import os
import time

import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if os.environ.get("CI") and report.skipped and not hasattr(report, "wasxfail"):
        report.outcome = "failed"
        report.longrepr = f"skipped under CI, which must run every test: {report.longrepr}"


@pytest.fixture(params=["compiled", "numpy"])
def kernel_path(request):
    """Run a test on the compiled kernels and on their numpy versions (tensordiff.kernels): an
    install without a C compiler takes the numpy path, and it must give the same results."""
    from tensordiff import kernels

    if request.param == "compiled" and not kernels.BUILT:
        pytest.skip("the compiled kernels are not built")
    was = kernels.use_numpy(request.param == "numpy")
    yield request.param
    kernels.use_numpy(was)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """With TENSORDIFF_TEST_TIMELINE=FILE, each test appends one JSON line (worker, test, start,
    end: its setup, call and teardown) to FILE: where the suite's time goes, per worker
    (scripts/test_timeline.py reads it)."""
    path = os.environ.get("TENSORDIFF_TEST_TIMELINE")
    start = time.time()
    yield
    if path:
        line = json.dumps({"worker": os.environ.get("PYTEST_XDIST_WORKER", "main"), "test": item.nodeid,
                           "start": start, "end": time.time()})
        with open(path, "a") as f:   # one short append per line: whole lines from both workers
            f.write(line + "\n")


def pytest_configure(config):
    """A pytest-xdist worker starts with COLUMNS=80 in its environment where the run had none; the
    text report reads COLUMNS (else 120 columns off a terminal), so the worker restores the run's."""
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        os.environ["PYTEST_RUN_COLUMNS_OF_TENSORDIFF"] = os.environ.get("COLUMNS", "")
    elif "PYTEST_RUN_COLUMNS_OF_TENSORDIFF" in os.environ:
        if os.environ["PYTEST_RUN_COLUMNS_OF_TENSORDIFF"]:
            os.environ["COLUMNS"] = os.environ["PYTEST_RUN_COLUMNS_OF_TENSORDIFF"]
        else:
            os.environ.pop("COLUMNS", None)


# Modules that start a local Ray cluster: one at a time, whichever worker runs them.
_RAY_MODULES = frozenset({"test_ray_backend", "test_vllm_ranks"})
# SGLang on a CPU sizes its KV cache from the memory free while its ranks load: two ranks of TP2
# loading while locate's engine child takes its cache found too little free and refused to start,
# and the graft's engine (--mem-fraction-static 0.3) while the prefix-cache module's RL engine
# grew. One at a time, whichever worker runs them.
_SGLANG_MEMORY_MODULES = frozenset({"test_sglang_tp2", "test_locate_engines", "test_graft_sglang",
                                    "test_rl_prefix_cache"})


@pytest.hookimpl(tryfirst=True)   # before xdist's own hook reads the groups into the test ids
def pytest_collection_modifyitems(config, items):
    """Order modules with the most slow tests first, and, where pytest-xdist runs the suite on
    several workers (scripts/test.sh: ``--dist loadgroup``), keep each module on one worker.

    The slow modules start real engines in module-scoped fixtures: split across workers, every
    worker would start them again. Sending the longest modules first keeps one worker from
    starting a long module while the other has nothing left to do (the scheduler hands out
    whole modules in this order when run with ``--no-loadscope-reorder``)."""
    def module(item) -> str:
        return os.path.splitext(os.path.basename(item.nodeid.split("::")[0]))[0]

    slow: dict[str, int] = {}
    for item in items:
        slow.setdefault(module(item), 0)
        if item.get_closest_marker("slow") is not None:
            slow[module(item)] += 1
    rank = {name: i for i, name in enumerate(slow)}   # collection order breaks ties
    items.sort(key=lambda it: (-slow[module(it)], rank[module(it)]))
    for item in items:
        if _uses_an_engine(item):
            item.add_marker(pytest.mark.engine)
    if config.pluginmanager.hasplugin("xdist"):
        for item in items:
            name = module(item)
            group = "ray" if name in _RAY_MODULES else "sglang-memory" if name in _SGLANG_MEMORY_MODULES else name
            item.add_marker(pytest.mark.xdist_group(group))


def _uses_an_engine(item) -> bool:
    """A test that reads a real-engine recording, or starts SGLang or vLLM: ``-m "not engine"``
    leaves the fast loop."""
    return ("recorded" in getattr(item, "fixturenames", ()) or item.get_closest_marker("sglang") is not None
            or item.get_closest_marker("vllm") is not None)


@pytest.fixture(scope="session")
def recorded():
    """``recorded(recordings.X)``: the files of one engine run of tests/recordings.py, recorded once
    per cache key (the workers take turns on a file lock) and read from the cache after that."""
    import recordings

    return recordings.serve
