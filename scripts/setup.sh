#!/usr/bin/env bash
# Creates .venv (when missing) and installs swift-mcore with its pinned requirements.
# Usage: bash scripts/setup.sh [base|dev]   (dev adds the test tools)
set -euo pipefail
cd "$(dirname "$0")/.."
set_name="${1:-base}"
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
stamp=".venv/.swift-mcore-$set_name"
# Reinstall only when a requirements file or pyproject.toml changed since the last install.
if [ ! -f "$stamp" ] || [ -n "$(find requirements pyproject.toml -newer "$stamp" 2>/dev/null)" ]; then
  .venv/bin/python -m pip install --quiet --upgrade pip
  # torch is pinned in requirements/base.txt: an unpinned torch would pull a CUDA build.
  .venv/bin/python -m pip install --quiet -r "requirements/$set_name.txt"
  if [ -f "requirements/$set_name-nodeps.txt" ]; then
    # references the tests compare against, installed beside our pins without theirs
    .venv/bin/python -m pip install --quiet --no-deps -r "requirements/$set_name-nodeps.txt"
  fi
  .venv/bin/python -m pip install --quiet --no-deps -e .
  touch "$stamp"
fi
