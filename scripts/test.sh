#!/usr/bin/env bash
# Sets everything up and runs the test suite (CPU, gloo, world sizes 1 and 2).
# Extra arguments go to pytest: bash scripts/test.sh -k resume
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh dev
# Two workers (pytest-xdist): one process per test file keeps a core idle most of the time
# (imports, Python-bound tiny models); tests/conftest.py says what one worker runs together.
exec .venv/bin/python -m pytest -q -n 2 --no-loadscope-reorder "$@"
