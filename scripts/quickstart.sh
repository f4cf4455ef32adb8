#!/usr/bin/env bash
# Sets everything up and trains the default model on the embedded corpus (about 4 minutes
# on 2 CPU cores). Each run writes to a new folder output/quickstart-<time> unless
# --output_dir is given. Extra flags are passed on: bash scripts/quickstart.sh --train_iters 50
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh base
case " $* " in
  *" --output_dir"*) exec .venv/bin/swift-mcore pt "$@" ;;
  *) exec .venv/bin/swift-mcore pt --output_dir "output/quickstart-$(date +%Y%m%d-%H%M%S)" "$@" ;;
esac
