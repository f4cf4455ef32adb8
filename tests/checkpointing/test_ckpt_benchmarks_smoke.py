"""The checkpoint benchmarks run for a moment on a tiny size, so none of them can rot."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run(script, *args, timeout=300):
    proc = subprocess.run([sys.executable, os.path.join("benchmarks", script), *args],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_resume_startup_smoke():
    result = run("resume_startup.py", "--tiny", "--repeats", "1", "--consumed", "1000000",
                 "--hf_streaming_cap", "2000")
    assert set(result["median"]) == {"1000000"}
    assert result["median"]["1000000"]["load_checkpoint_s"] > 0
    # The HF peer: map-style datasets run at the count, the stream at the cap, extrapolated.
    hf = result["hf"]
    assert hf["hf_one_epoch"]["1000000"]["skip_and_first_batch_s"] > 0
    assert hf["hf_streaming"]["2000"]["skip_and_first_batch_s"] > 0
    assert hf["hf_streaming"]["1000000"]["extrapolated_from"] == 2000
    assert result["hf_total_over_swift"]["hf_same_data"]["1000000"] > 0


def test_checkpoint_io_smoke():
    result = run("checkpoint_io.py", "--tiny", "--repeats", "1")
    assert result["save_MB_per_s"] > 0 and result["load_MB_per_s"] > 0
    # The torch.save baseline holds the same state: weights and Adam moments, so about as
    # many bytes as the sharded checkpoint.
    assert 0.8 < result["torch_MB"] / result["checkpoint_MB"] < 1.25
    assert result["torch_save_MB_per_s"] > 0 and result["torch_load_MB_per_s"] > 0


@pytest.mark.slow
def test_kill_resume_smoke():
    result = run("kill_resume.py", "--trials", "1", "--iters", "4")
    assert result["ok"] and result["trials"] == 1
