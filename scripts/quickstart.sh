#!/usr/bin/env bash
# Sets everything up and trains the default model on the embedded corpus (a few minutes
# on 2 CPU cores). Extra flags are passed on: bash scripts/quickstart.sh --train_iters 50
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh base
exec .venv/bin/swift-mcore pt "$@"
