"""Each benchmark script runs for a moment on a tiny size, so none of them can rot.

The cheap ones run with the suite; the ones that start several training processes are
marked ``benchmark`` and run with ``bash scripts/test.sh -m benchmark`` (the suite's own
tests already cover the behaviour they time). The tests check what a run writes: its keys,
shapes, byte counts and numerics. Times and rates are only checked to be numbers: on a busy
machine a tiny case's rate rounds to 0, and timing is what the benchmarks themselves report."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def run_script(script, *argv, timeout=300):
    """The last stdout line of ``benchmarks/SCRIPT`` as JSON, after a zero exit."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES}
    env["PYTHONWARNINGS"] = "ignore"
    proc = subprocess.run([sys.executable, os.path.join("benchmarks", script), *argv],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.strip().splitlines() if line.startswith("{")]


def measured(*values) -> bool:
    """Each value is a time, rate or ratio as the scripts print them: a finite number >= 0
    (rounded, so 0 where a loaded machine made a tiny case slow)."""
    return all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
               and v >= 0 for v in values)


def test_checkpoint_io_smoke():
    result = run_script("checkpoint_io.py", "--tiny", "--repeats", "1")[-1]
    assert measured(result["save_MB_per_s"], result["load_MB_per_s"])
    # The torch.save baseline holds the same state: weights and Adam moments, so about as
    # many bytes as the sharded checkpoint.
    assert 0.8 < result["torch_MB"] / result["checkpoint_MB"] < 1.25
    assert measured(result["save_time_ratio"], result["load_time_ratio"])


def test_optimizer_step_smoke():
    result = run_script("optimizer_step.py", "--tiny", "--steps", "2")[-1]
    assert set(result["step_s_median"]) == {"loop", "fused"}
    assert measured(*result["step_s_median"].values())


def test_preprocess_throughput_smoke():
    result = run_script("preprocess_throughput.py", "--mb", "0.3", "--repeats", "1")[-1]
    assert result["identical_output"] is True
    assert measured(result["tokens_per_s_w1"], result["tokens_per_s_w2"],
                    result["speedup_w2_over_w1"])
    assert result["corpus_mb"] >= 0.3


def test_data_fingerprint_smoke():
    result = run_script("data_fingerprint.py", "--gb", "0.08", "--repeats", "1")[-1]
    assert result["bin_bytes"] > result["sampled_MiB"] * 2 ** 20  # the sampled path runs
    assert measured(result["fingerprint_without_record_s"], result["fingerprint_with_record_s"],
                    result["full_sha256_GB_per_s"])


@pytest.mark.benchmark
def test_framework_overhead_smoke():
    result = run_script("framework_overhead.py", "--rounds", "1", "--iters", "8", "--tiny")[-1]
    assert measured(result["swift_mcore_tokens_per_s"], result["bare_megatron_tokens_per_s"],
                    result["ratio"])


@pytest.mark.benchmark
def test_throughput_smoke():
    # Every kind of contender once (swift-mcore through the CLI with its defaults, the bare
    # megatron loop, the HF Trainer); the local-attention CLI run is the same code path.
    result = run_script("throughput.py", "--tiny", "--rounds", "1", "--contenders",
                        "swift-mcore", "megatron-bare", "hf-trainer", timeout=600)[-1]
    case = result["cases"][0]
    assert case["parameters"] > 0 and case["flops_per_token"] > 6 * case["parameters"] * 0.5
    assert set(case["contenders"]) == {"swift-mcore", "megatron-bare", "hf-trainer"}
    for name, c in case["contenders"].items():
        assert c["rss_MB_median"] > 100, name  # a training process's memory, not a time
        assert measured(c["tokens_per_s_median"], c["utilisation_median"],
                        c["vs_bare_median"]), name
    assert case["contenders"]["megatron-bare"]["vs_bare_median"] == 1.0  # its own baseline
    assert measured(result["matmul_peak_tflops"])


@pytest.mark.benchmark
def test_resume_startup_smoke():
    # One count and one HF variant (the HF checkpoint is made on the plain rows): four
    # processes, each paying its imports.
    result = run_script("resume_startup.py", "--tiny", "--repeats", "1", "--consumed", "400",
                        "--hf_variants", "hf_streaming")[-1]
    assert set(result["median"]) == {"400"} and measured(result["median"]["400"]["total_s"])
    assert set(result["hf"]) == {"hf_streaming"}
    assert measured(*(r for per in result["hf_total_over_swift"].values() for r in per.values()))


@pytest.mark.benchmark
def test_profile_step_smoke():
    results = run_script("profile_step.py", "--tiny", "--steps", "1", "--contenders",
                         "megatron-local", "hf-sdpa")
    assert [r["contender"] for r in results] == ["megatron-local", "hf-sdpa"]
    for r in results:
        assert measured(r["micro_step_s"], r["by_kind_s"]["matmul"]) and r["top_ops"]


@pytest.mark.benchmark
def test_kill_resume_smoke():
    result = run_script("kill_resume.py", "--trials", "2", "--iters", "6")[-1]
    assert result["trials"] == 2 and result["ok"], result["problems"]


@pytest.mark.benchmark
def test_loader_throughput_smoke():
    result = run_script("loader_throughput.py", "--tiny", "--repeats", "1", "--seconds", "0.5",
                        "--iters", "3")[-1]
    assert measured(result["trainer_samples_per_s"], result["loader_samples_per_s_workers0"],
                    result["ratio_workers1"])


@pytest.mark.benchmark
def test_moe_throughput_smoke():
    result = run_script("moe_throughput.py", "--tiny", "--rounds", "1", "--phases")[-1]
    assert measured(result["moe_tokens_per_s_median"], result["moe_vs_dense_median"])
    for phases in result["phases_ms"].values():
        assert set(phases) == {"step", "forward_backward", "optimizer", "rest"}
        # rest: each iteration's step less its phases, so >= 0 unless the timers are wrong
        assert measured(phases["step"], phases["forward_backward"], phases["optimizer"],
                        phases["rest"])


@pytest.mark.benchmark  # three training processes
def test_hybrid_throughput_smoke():
    result = run_script("hybrid_throughput.py", "--tiny", "--rounds", "1", timeout=900)[-1]
    assert result["shape"]["delta_net_layers"] == 3
    assert set(result["parameters"]) == {"hybrid", "dense"}
    assert measured(result["hybrid_tokens_per_s_median"], result["dense_tokens_per_s_median"],
                    result["transformers_tokens_per_s_median"],
                    result["hybrid_vs_dense_median"], result["hybrid_vs_transformers_median"])


@pytest.mark.benchmark
def test_moe_profile_smoke():
    moe, dense, gemm, glu = run_script("moe_profile.py", "--tiny", "--steps", "1",
                                       "--warmup", "1")
    assert set(moe["moe_forward_phases_s"]) == {"router", "permute", "experts", "unpermute"}
    assert dense["model"] == "dense" and not dense["moe_forward_phases_s"]
    assert measured(gemm["experts_s"], gemm["dense_s"])
    assert set(glu["median_s"]) == {"swiglu", "megatron_glu"}


@pytest.mark.benchmark
def test_lora_vs_full_smoke():
    result = run_script("lora_vs_full.py", "--tiny", "--rounds", "1", "--iters", "2",
                        "--warmup", "1")[-1]
    assert result["lora"]["trainable"].startswith("--tuner_type lora: 16,384 of")
    assert 0 < result["lora_over_full"]["checkpoint_MB"] < 0.2
    assert measured(result["lora_over_full"]["tokens_per_s"])


@pytest.mark.benchmark
def test_lora_layer_cost_smoke():
    (result,) = run_script("lora_layer_cost.py", "--reps", "1", "--tokens", "64",
                           "--variants", "full,frozen,lora_0.05")
    assert set(result["layer_ms"]) == {"full", "frozen", "lora_0.05"}
    assert measured(*result["layer_ms"].values())


@pytest.mark.benchmark
def test_activation_memory_smoke():
    ours, hf = run_script("activation_memory.py", "--tiny", "--contenders", "megatron", "hf")
    assert ours["parameters"] == hf["parameters"]
    for r in (ours, hf):
        assert r["saved_MB"]["layer 0: input_layernorm"] > 0 and r["peak_MB_above_weights"] > 0
    # The logits the loss keeps: the same for both (fp32, [tokens, vocab]).
    loss = "model (its own forward: the loss)"
    assert abs(ours["saved_MB"][loss] - hf["saved_MB"][loss]) < 0.01


@pytest.mark.benchmark
def test_heap_phases_smoke():
    (result,) = run_script("heap_phases.py", "--size", "tiny", "--seq", "32", "--contenders",
                           "swift-mcore", "hf-trainer")
    for run in result["runs"]:
        phases = [p["phase"] for p in run["phases"]]
        # warm-up and timed step, 2 micro-batches each (BATCH[("cpu", "tiny")])
        assert phases.count("forward done") == 4 and phases.count("optimizer step done") == 2
        assert all(p["heap_in_use_MB"] > 0 and p["rss_MB"] <= run["peak_rss_MB"]
                   for p in run["phases"])


@pytest.mark.benchmark
def test_wgrad_accumulation_smoke():
    (result,) = run_script("wgrad_accumulation.py", "--tiny")
    assert result["fused_linears"] == 2 * 4 + 1  # qkv, proj, fc1, fc2 per layer; output
    assert all(len(times) == 2 and measured(*times) for times in result["step_s"].values())
    assert set(result["micro_step_memory"]) == {"fused", "unfused"}


def test_cpu_matmul_smoke():
    (result,) = run_script("cpu_matmul.py", "--tiny")
    # tiny: qkv (128, 64), proj (64, 64), fc1 (384, 64), fc2 (64, 192), output (4096, 64)
    assert [g["weight"] for g in result["gemms"]] == [[64, 64], [64, 192], [128, 64],
                                                      [384, 64], [4096, 64]]
    for g in result["gemms"]:
        assert measured(*(g[f"{product}_onednn_over_mkl_time"]
                          for product in ("forward", "dgrad", "wgrad"))), g
        assert measured(*(g[f"{name}_GFLOPs"] for name in (
            "forward_mkl", "forward_onednn", "dgrad_mkl", "dgrad_onednn", "wgrad_mkl_addmm",
            "wgrad_onednn_add"))), g
    assert set(result["step_s"]) == {"onednn", "mkl"}
    assert all(len(times) == 2 and measured(*times) for times in result["step_s"].values())
    assert measured(result["onednn_over_mkl_step_time_median"])
    # the two settings compute the same gradients to fp32 rounding
    assert result["largest_relative_gradient_difference"] < 1e-4


@pytest.mark.benchmark
def test_dpo_vs_trl_smoke():
    *runs, summary = run_script("dpo_vs_trl.py", "--size", "tiny", "--rounds", "1", "--iters",
                                "2", "--warmup", "1", "--pairs", "8", "--words", "8", "--seq",
                                "48", timeout=600)
    assert sorted(r["contender"] for r in runs) == ["lora-copy", "lora-implicit",
                                                    "swift-mcore", "trl"]
    # every swift-mcore run starts from the same reference as the policy: DPO's log 2
    assert all(abs(r["loss_first"] - math.log(2)) < 1e-6 for r in runs if "loss_first" in r)
    assert measured(summary["speed_ratio_vs_trl"], summary["memory_ratio_vs_trl"],
                    *(r["tokens_per_s"] for r in runs), *(r["peak_rss_MB"] for r in runs))


@pytest.mark.benchmark
def test_sft_vs_trl_smoke():
    *runs, summary = run_script("sft_vs_trl.py", "--size", "tiny", "--rounds", "1", "--iters",
                                "3", "--warmup", "1", "--rows", "40", "--words", "30", "--seq",
                                "64", timeout=900)
    assert sorted(r["contender"] for r in runs) == ["peft-lora", "swift-mcore",
                                                    "swift-mcore-lora", "trl"]
    assert all(r["steps_timed"] == 2 for r in runs)
    assert measured(summary["speed_ratio_vs_trl"], summary["lora_speed_ratio_vs_peft"],
                    *(r["tokens_per_s"] for r in runs))


@pytest.mark.benchmark
def test_optimizer_memory_smoke():
    lines = run_script("optimizer_memory.py", "--tiny", "--dp", "2", timeout=600)
    plain, sharded, ratios = lines
    # two Adam moments per parameter in float32, whole on each rank without sharding
    assert plain["state_bytes_per_rank"] == [8 * plain["parameters"]] * 2
    assert sum(sharded["state_bytes_per_rank"]) == 8 * sharded["parameters"]
    assert 0.5 <= ratios["distributed_over_plain_per_rank"]["2"] < 0.51


def test_sft_stream_loader_smoke():
    result = run_script("sft_stream_loader.py", "--rows", "300", "--batches", "4",
                        "--repeats", "1", "--shuffle_buffer_size", "16")[-1]
    assert len(result["streaming_tokens_per_s"]) == len(result["cached_tokens_per_s"]) == 1
    assert measured(result["streaming_median"], result["cached_median"],
                    result["streaming_vs_cached"], result["streaming_vs_1b_h200_training"],
                    result["stream_cpu_batched_vs_one_row"])


@pytest.mark.benchmark
def test_vpp_step_time_smoke():
    result = run_script("vpp_step_time.py", "--tiny", "--rounds", "2", timeout=900)[-1]
    assert result["shape"]["layers"] == 4 and result["timed_steps_per_run"] == 2
    assert {name: len(v) for name, v in result["step_s_per_round"].items()} == {
        "pp2": 2, "pp2_vpp2": 2}
    assert measured(*result["step_s_median"].values(), result["vpp_vs_pp_step_time"])


def test_sft_token_cache_smoke():
    """One row chunk is enough for every path: tokenizing in memory, cold builds in this
    process and in two workers, the warm start (the script asserts it reuses the cache) and
    the start from a `preprocess sft` folder."""
    result = run_script("sft_token_cache.py", "--rows", "8", "--num_proc", "1", "2")[-1]
    assert result["rows"] == 8 and result["tokens"] > 8
    assert measured(result["uncached_s"], result["cold_s[1]"], result["cold_s[2]"],
                    result["warm_s"], result["warm_folder_s"],
                    result["uncached_conversations_per_s"])
