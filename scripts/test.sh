#!/usr/bin/env bash
# Set up everything the tests need (real SGLang on CPU included) and run the whole suite.
# Extra arguments go to pytest, e.g. scripts/test.sh -m "not slow" -x
# The suite runs on TENSORDIFF_TEST_WORKERS pytest-xdist workers (default 2; 0: in this process),
# each test module whole on one worker (tests/conftest.py): most of the suite's time is engines
# starting up, whose imports run on one core, so one module after another leaves the other core
# idle much of the time. Real-engine runs are recorded once into .cache/recordings (or
# TENSORDIFF_RECORDINGS_CACHE; tests/recordings.py) and read from there by later runs; -m "not engine"
# leaves out every test that reads one or starts an engine.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh full
workers=${TENSORDIFF_TEST_WORKERS:-2}
exec .venv/bin/python -m pytest -n "$workers" --dist loadgroup --no-loadscope-reorder "$@"
