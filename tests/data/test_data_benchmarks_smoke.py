"""The data benchmarks run for a moment on a tiny size, so neither can rot."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run(*argv):
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    proc = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=300,
                          cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_preprocess_throughput_smoke():
    result = run("benchmarks/preprocess_throughput.py", "--mb", "0.3", "--repeats", "1")
    assert result["identical_output"] is True
    assert result["tokens_per_s_w1"] > 0 and result["tokens_per_s_w2"] > 0
    assert result["speedup_w2_over_w1"] > 0 and result["corpus_mb"] >= 0.3


@pytest.mark.slow
def test_loader_throughput_smoke():
    result = run("benchmarks/loader_throughput.py", "--tiny", "--repeats", "1", "--seconds",
                 "0.5", "--iters", "3")
    assert result["trainer_samples_per_s"] > 0
    assert result["loader_samples_per_s_workers0"] > 0 and result["ratio_workers1"] > 0


@pytest.mark.slow
def test_data_fingerprint_smoke():
    result = run("benchmarks/data_fingerprint.py", "--gb", "0.08", "--repeats", "1")
    assert result["bin_bytes"] > result["sampled_MiB"] * 2 ** 20  # the sampled path runs
    assert result["fingerprint_without_record_s"] > 0 and result["fingerprint_with_record_s"] > 0
    assert result["full_sha256_GB_per_s"] > 0
