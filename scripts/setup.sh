#!/usr/bin/env bash
# Set up the project virtualenv .venv (idempotent).
#   scripts/setup.sh core   tensordiff + numpy, h5py, rich, textual: enough for info / diff / tui
#   scripts/setup.sh full   + torch 2.14.1, transformers 5.19.0, the dev tools, Ray (the distributed
#                           backend), polars (the benchmarks' SGLang comparator), real SGLang 0.5.23 set
#                           up for CPU (scripts/install-sglang-cpu.sh) and Debian's chromium (the HTML
#                           report's browser test): what the tests need
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:-core}
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
fi
pipi() { .venv/bin/python -m pip install -q --disable-pip-version-check "$@"; }
case "$mode" in
  core)
    pipi -e . ;;
  full)
    pipi -e '.[torch,dev,ray,bench]'
    bash scripts/install-sglang-cpu.sh
    if ! command -v chromium >/dev/null 2>&1; then
      if [ "$(id -u)" = 0 ]; then
        echo "[setup] installing Debian's chromium (the HTML report's browser test)"
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
      else
        echo "[setup] warning: chromium is missing and this is not root: run 'apt-get install chromium'" >&2
      fi
    fi ;;
  *)
    echo "usage: scripts/setup.sh [core|full]" >&2; exit 2 ;;
esac
