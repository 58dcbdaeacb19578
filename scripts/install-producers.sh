#!/usr/bin/env bash
# Install the draft-training producers whose files `tensordiff import` reads, so the tests can have
# their own code write and read those files: specforge 0.2.0, speculators 0.9.0 (+ hs-connectors
# 0.9.0, its hidden-state transfer package) and nvidia-modelopt 0.47.0, into one venv,
# .venv-producers, layered on the project's .venv.
#
#   scripts/install-producers.sh        # after scripts/setup.sh full has built .venv (setup.sh full calls it)
#
# Why one small layered venv rather than each producer's full resolution:
# * specforge 0.2.0 pins torch==2.11.0, transformers==5.8.1 and sglang==0.5.14; that resolution is
#   a CUDA torch of several GB and an SGLang whose offline capture needs a GPU anyway (docs/recorders.md).
#   Its offline-feature code runs against .venv's torch 2.14.1, transformers 5.19.0 and SGLang 0.5.23.
# * speculators 0.9.0 (torch<=2.14.1, transformers<=5.19.0) and nvidia-modelopt 0.47.0 (torch>=2.8)
#   accept .venv's torch and transformers as they are.
# So .venv-producers holds only the producers and the few pure-Python packages .venv lacks, all
# pinned and installed --no-deps, and a .pth file that puts .venv's site-packages after its own.
# Idempotent: pip skips what is installed at the pinned version; the .pth is rewritten each run.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV=.venv-producers
BASE=.venv
log() { printf '[install-producers] %s\n' "$*"; }
start=$(date +%s)

[ -x "$BASE/bin/python" ] || { log "needs $BASE (run scripts/setup.sh full)"; exit 1; }
if [ ! -x "$VENV/bin/python" ]; then
    log "creating $VENV"
    "$BASE/bin/python" -m venv --without-pip "$VENV" 2>/dev/null || "$BASE/bin/python" -m venv "$VENV"
fi
site() { "$1" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'; }
VSITE=$(site "$VENV/bin/python")
BSITE=$(cd "$(site "$BASE/bin/python")" && pwd -P)
# .venv's packages (torch, transformers, sglang, datasets, ...) after the producers' own
printf '%s\n' "$BSITE" > "$VSITE/zz_tensordiff_base_venv.pth"

# pip from .venv, pointed at the producers' venv: no second copy of pip
pipv() { "$BASE/bin/python" -m pip --disable-pip-version-check --python "$VENV/bin/python" "$@" 2>&1 \
             | { grep -v -e 'is ignored: it is neither a file nor a directory' || true; }; }
log "installing the pinned producers (--no-deps)"
pipv install -q --no-deps \
    specforge==0.2.0 speculators==0.9.0 hs-connectors==0.9.0 nvidia-modelopt==0.47.0 \
    pydantic-settings==2.11.0 python-dotenv==1.1.1 omegaconf==2.3.0 antlr4-python3-runtime==4.9.3 \
    pulp==3.3.0 >/dev/null

log "checking that each producer's file code imports"
out=$(PYTHONWARNINGS=ignore "$VENV/bin/python" -c '
from importlib.metadata import version
import specforge.runtime.data_plane.feature_store, specforge.data.preprocessing  # noqa: F401
import speculators.data_generation.offline, speculators.train.data  # noqa: F401
import modelopt.torch.speculative.eagle.utils  # noqa: F401
print(" | ".join(f"{p} {version(p)}" for p in ("specforge", "speculators", "nvidia-modelopt", "torch")))
' 2>&1) || { printf '%s\n' "$out"; log "the check failed"; exit 1; }
printf '%s\n' "$out" | tail -1
log "done in $(( $(date +%s) - start )) s; venv size $(du -sh "$VENV" | cut -f1)"
