#!/usr/bin/env bash
# Sets everything up and runs the test suite (CPU, gloo, world sizes 1 and 2).
# Extra arguments go to pytest: bash scripts/test.sh -k resume
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh dev
exec .venv/bin/python -m pytest -q "$@"
