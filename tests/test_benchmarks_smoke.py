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
    # Every kind of contender once (swift-mcore through the CLI with its defaults, the bare
    # megatron loop, the HF Trainer); the local-attention CLI run is the same code path.
    proc = subprocess.run(
        [sys.executable, "benchmarks/throughput.py", "--tiny", "--rounds", "1", "--contenders",
         "swift-mcore", "megatron-bare", "hf-trainer"],
        capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    case = result["cases"][0]
    assert case["parameters"] > 0 and case["flops_per_token"] > 6 * case["parameters"] * 0.5
    assert set(case["contenders"]) == {"swift-mcore", "megatron-bare", "hf-trainer"}
    for name, c in case["contenders"].items():
        assert c["tokens_per_s_median"] > 0 and c["rss_MB_median"] > 100, name
        assert 0 < c["utilisation_median"] and c["vs_bare_median"] > 0, name
    assert case["contenders"]["megatron-bare"]["vs_bare_median"] == 1.0
    assert result["matmul_peak_tflops"] > 0


def run_script(*argv, timeout=300):
    proc = subprocess.run([sys.executable, *argv], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_resume_startup_smoke():
    # One count and one HF variant (the HF checkpoint is made on the plain rows): four
    # processes, each paying its imports.
    result = run_script("benchmarks/resume_startup.py", "--tiny", "--repeats", "1",
                        "--consumed", "400", "--hf_variants", "hf_streaming")
    assert set(result["median"]) == {"400"} and result["median"]["400"]["total_s"] > 0
    assert set(result["hf"]) == {"hf_streaming"}
    assert all(r > 0 for per in result["hf_total_over_swift"].values() for r in per.values())


def test_checkpoint_io_smoke():
    result = run_script("benchmarks/checkpoint_io.py", "--tiny", "--repeats", "1")
    assert result["checkpoint_MB"] > 0 and result["torch_MB"] > 0
    assert result["save_MB_per_s"] > 0 and result["torch_load_MB_per_s"] > 0
    assert result["save_time_ratio"] > 0 and result["load_time_ratio"] > 0


def test_optimizer_step_smoke():
    result = run_script("benchmarks/optimizer_step.py", "--tiny", "--steps", "2")
    assert set(result["step_s_median"]) == {"loop", "fused"}
    assert all(v > 0 for v in result["step_s_median"].values())


def test_profile_step_smoke():
    proc = subprocess.run(
        [sys.executable, "benchmarks/profile_step.py", "--tiny", "--steps", "1", "--contenders",
         "megatron-local", "hf-sdpa"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [json.loads(line) for line in proc.stdout.strip().splitlines()]
    assert [r["contender"] for r in results] == ["megatron-local", "hf-sdpa"]
    for r in results:
        assert r["micro_step_s"] > 0 and r["by_kind_s"]["matmul"] > 0 and r["top_ops"]


def test_kill_resume_smoke():
    result = run_script("benchmarks/kill_resume.py", "--trials", "2", "--iters", "6")
    assert result["trials"] == 2 and result["ok"], result["problems"]


def test_activation_memory_smoke():
    proc = subprocess.run(
        [sys.executable, "benchmarks/activation_memory.py", "--tiny", "--contenders", "megatron",
         "hf"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ours, hf = [json.loads(line) for line in proc.stdout.strip().splitlines()]
    assert ours["parameters"] == hf["parameters"]
    for r in (ours, hf):
        assert r["saved_MB"]["layer 0: input_layernorm"] > 0 and r["peak_MB_above_weights"] > 0
    # The logits the loss keeps: the same for both (fp32, [tokens, vocab]).
    loss = "model (its own forward: the loss)"
    assert abs(ours["saved_MB"][loss] - hf["saved_MB"][loss]) < 0.01
