"""Each benchmark script runs for a moment on a tiny size, so none of them can rot."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_framework_overhead_smoke():
    proc = subprocess.run(
        [sys.executable, "benchmarks/framework_overhead.py", "--rounds", "1", "--iters", "8",
         "--tiny"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["swift_mcore_tokens_per_s"] > 0 and result["bare_megatron_tokens_per_s"] > 0
    assert result["ratio"] > 0
