#!/usr/bin/env bash
# README command 1: set up (idempotent) and run the main job on SmolLM2 (CPU when no GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec "${OASIS_VENV:-.venv}/bin/python" scripts/run_demo.py "$@"
