#!/usr/bin/env bash
# README command 2: set up (idempotent) and run the tests (unit + end to end on real SGLang).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# extra arguments go to pytest and replace the default selection (pyproject: testpaths = tests)
# --durations: the slowest tests in the output (CI has 90 minutes)
exec "${OASIS_VENV:-.venv}/bin/python" -m pytest -v -rs --durations=25 "$@"
