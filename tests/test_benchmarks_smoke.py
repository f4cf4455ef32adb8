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


def test_throughput_smoke():
    # Every kind of contender once (swift-mcore through the CLI with the sdpa flag, the bare
    # megatron loop, the HF Trainer); the local-attention CLI run is the same code path.
    proc = subprocess.run(
        [sys.executable, "benchmarks/throughput.py", "--tiny", "--rounds", "1", "--contenders",
         "swift-mcore-sdpa", "megatron-bare", "hf-trainer"],
        capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    case = result["cases"][0]
    assert case["parameters"] > 0 and case["flops_per_token"] > 6 * case["parameters"] * 0.5
    assert set(case["contenders"]) == {"swift-mcore-sdpa", "megatron-bare", "hf-trainer"}
    for name, c in case["contenders"].items():
        assert c["tokens_per_s_median"] > 0 and c["rss_MB_median"] > 100, name
        assert 0 < c["utilisation_median"] and c["vs_bare_median"] > 0, name
    assert case["contenders"]["megatron-bare"]["vs_bare_median"] == 1.0
    assert result["matmul_peak_tflops"] > 0
