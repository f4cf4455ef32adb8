#!/usr/bin/env bash
# The GPU check (benchmarks/gpu_check.py): every GPU-only path once and the ~1B Llama's
# throughput and MFU, one pass/fail table. --dry_run: what it would run, flags checked.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
python="${PYTHON:-python}"
exec "$python" "$here/gpu_check.py" "$@"
