#!/usr/bin/env bash
# Set up everything the tests need (real SGLang on CPU included) and run the whole suite.
# Extra arguments go to pytest, e.g. scripts/test.sh -m "not slow" -x
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh full
exec .venv/bin/python -m pytest "$@"
