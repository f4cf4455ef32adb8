"""The GPU check: every GPU-only path of swift-mcore once, and the throughput and MFU of a ~1B
Llama at seq 4096 in bf16, on one GPU machine in under 8 minutes; one pass/fail table.

    bash benchmarks/gpu_check.sh                 # on a GPU machine (megatron-core, TE installed)
    bash benchmarks/gpu_check.sh --dry_run       # anywhere: what would run; every command's
                                                 # flags parsed and resolved as on a GPU with TE

Each path is one `swift-mcore` command in a child process (NPROC_PER_NODE ranks when it needs
more than one GPU; skipped when the machine has fewer). A path passes when the command exits
0, its metrics.jsonl has finite losses and its start-up line says what the path is about.
The table is printed as Markdown (for benchmarks/README.md) and the results as one JSON line.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A small model for the paths: seconds per command once CUDA and TE are up.
SMALL = ["--num_layers", "4", "--hidden_size", "256", "--num_attention_heads", "8",
         "--num_query_groups", "4", "--seq_length", "256", "--micro_batch_size", "2",
         "--global_batch_size", "8", "--lr_warmup_iters", "1", "--log_interval", "2",
         "--eval_steps", "0", "--progress_bar", "false", "--report_to", "none",
         "--plot", "false"]
# ~1.2B Llama (Llama-3.2-1B's shape, untied): 16 layers, hidden 2048, 32 heads, 8 KV groups,
# SwiGLU 8192, vocabulary 128,256; seq 4096, bf16 (--precision auto on CUDA).
LLAMA_1B = ["--num_layers", "16", "--hidden_size", "2048", "--ffn_hidden_size", "8192",
            "--num_attention_heads", "32", "--num_query_groups", "8", "--seq_length", "4096",
            "--vocab_size", "128256", "--rotary_base", "500000", "--micro_batch_size", "1",
            "--global_batch_size", "8", "--train_iters", "12", "--lr_warmup_iters", "2",
            "--log_interval", "4", "--eval_steps", "0", "--progress_bar", "false",
            "--report_to", "none", "--plot", "false", "--no_save"]

# Mixture of experts on its GPU path: 8 experts top-2 run as Transformer Engine's grouped
# GEMM (refused on CPU, where megatron's SequentialMLP runs them one after another).
MOE = ["--num_experts", "8", "--moe_router_topk", "2", "--moe_ffn_hidden_size", "256",
       "--moe_aux_loss_coeff", "0.01", "--moe_grouped_gemm"]


@dataclass
class Path:
    name: str
    command: str            # pt | sft
    flags: List[str]
    expect: List[str]       # what the start-up line must say
    gpus: int = 1
    output: str = ""        # output folder name (shared by a path that resumes another)
    decisions: dict = field(default_factory=dict)  # RunConfig attributes the dry run checks
    # filled by running
    status: str = "not run"
    seconds: float = 0.0
    note: str = ""
    metrics: dict = field(default_factory=dict)


def paths(work: str, gpus: int) -> List[Path]:
    data = os.path.join(work, "conversations.jsonl")
    te = "Transformer Engine layer spec and fused attention"
    dp = 2 if gpus >= 2 else 1
    return [
        Path("pt, TE spec, bf16, fused kernels", "pt",
             SMALL + ["--train_iters", "8", "--exit_interval", "4"],
             [te, "bf16 (--precision auto)", "RoPE fusion on"], output="pt_te",
             decisions={"layer_spec": "transformer_engine", "precision": "bf16",
                        "rope_fusion": True}),
        Path("pt, resume on the GPU", "pt", SMALL + ["--train_iters", "8", "--resume", "auto"],
             [te, "starting at iteration 4"], output="pt_te"),
        Path("sft --packing (THD rows), TE spec", "sft",
             SMALL + ["--train_iters", "4", "--no_save", "--dataset", data, "--template",
                      "plain", "--packing", "true", "--micro_batch_size", "1",
                      "--seq_length", "512"], [te], output="sft_thd",
             decisions={"packed_rows": "thd"}),
        Path("sft LoRA on the TE spec's linears, --packing", "sft",
             SMALL + ["--train_iters", "4", "--no_save", "--dataset", data, "--template",
                      "plain", "--packing", "true", "--micro_batch_size", "1",
                      "--seq_length", "512", "--tuner_type", "lora", "--lora_rank", "8",
                      "--lora_dropout", "0"],
             [te, "--tuner_type lora:"], output="sft_lora_te",
             decisions={"layer_spec": "transformer_engine", "packed_rows": "thd",
                        "base_model": "random initialization (--seed 42, PP 1, TP 1)"}),
        Path("fp16 with loss scaling", "pt", SMALL + ["--train_iters", "4", "--no_save",
                                                      "--precision", "fp16"], [te, "fp16"],
             output="fp16", decisions={"precision": "fp16"}),
        Path(f"--use_distributed_optimizer (DP {dp})", "pt",
             SMALL + ["--train_iters", "6", "--save_steps", "3", "--use_distributed_optimizer",
                      "--overlap_grad_reduce", "--num_buckets", "2"], [te], gpus=dp,
             output="distopt"),
        # FP8 GEMMs through TE (Hopper or newer; mxfp8 needs Blackwell, so not here).
        Path("FP8 (hybrid, tensorwise scaling), TE spec", "pt",
             SMALL + ["--train_iters", "4", "--no_save", "--fp8_format", "hybrid",
                      "--fp8_recipe", "tensorwise"], [te, "FP8 hybrid (tensorwise)"],
             output="fp8"),
        Path("--profile with a CUDA memory snapshot", "pt",
             SMALL + ["--train_iters", "4", "--no_save", "--profile", "--profile_step_start",
                      "2", "--profile_step_end", "3", "--record_memory_history"], [te],
             output="profile"),
        # The interleaved pipeline needs --pipeline_model_parallel_size > 1: with one GPU
        # there is no pipeline to interleave (refused), so it is measured on CPU only.
        Path("recompute full (uniform)", "pt",
             SMALL + ["--train_iters", "4", "--no_save", "--recompute_granularity", "full"],
             [te, "activation recompute full (uniform, 1 layer)"], output="recompute_full"),
        Path("recompute selective, local spec + sdpa", "pt",
             SMALL + ["--train_iters", "4", "--no_save", "--attention_backend", "sdpa",
                      "--recompute_granularity", "selective", "--recompute_modules",
                      "core_attn,layernorm,mlp"],
             ["torch scaled_dot_product_attention",
              "activation recompute selective (core_attn,layernorm,mlp)"],
             output="recompute_selective", decisions={"layer_spec": "local",
                                                      "attention": "sdpa"}),
        # Gemma 3's layers (windows and global layers, zero-centred norms) in bf16 with
        # packed rows: SDPA picked over TE on a TE machine, the window mask on the GPU
        Path("Gemma 3 layers, sliding windows, packed rows (SDPA)", "sft",
             SMALL + ["--train_iters", "4", "--no_save", "--dataset", data, "--template",
                      "plain", "--packing", "true", "--seq_length", "512", "--model_type",
                      "gemma3", "--window_size", "64", "--window_attn_skip_freq", "2",
                      "--rotary_base_local", "10000", "--rotary_base", "1000000",
                      "--softmax_scale", "0.1"],
             ["torch scaled_dot_product_attention", "bf16"], output="gemma3_windows",
             decisions={"layer_spec": "local", "attention": "sdpa",
                        "packed_rows": "block_causal_mask"}),
        Path("TP 2 + sequence parallel", "pt",
             SMALL + ["--train_iters", "4", "--no_save", "--tensor_model_parallel_size", "2",
                      "--sequence_parallel"], [te, "TP 2", "CUDA_DEVICE_MAX_CONNECTIONS=1"],
             gpus=2, output="tp2_sp"),
        Path("MoE, TE grouped GEMM experts, alltoall", "pt", SMALL + MOE + [
            "--train_iters", "4", "--no_save"], [te, "bf16"], output="moe_grouped_gemm",
             decisions={"layer_spec": "transformer_engine"}),
        Path("MoE, grouped GEMM, EP 2", "pt", SMALL + MOE + [
            "--train_iters", "4", "--no_save", "--expert_model_parallel_size", "2"], [te],
             gpus=2, output="moe_ep2"),
        # DeepSeek-V3's layers: multi-latent attention on TE's spec, sigmoid routing with
        # the expert bias, a shared expert, one dense first layer and one MTP layer.
        Path("DeepSeek-V3 layers: MLA + MTP, grouped GEMM", "pt", SMALL + MOE + [
            "--train_iters", "4", "--no_save", "--multi_latent_attention",
            "--q_lora_rank", "64", "--kv_lora_rank", "32", "--qk_head_dim", "32",
            "--qk_pos_emb_head_dim", "16", "--v_head_dim", "32",
            "--moe_router_score_function", "sigmoid", "--moe_router_enable_expert_bias",
            "--moe_shared_expert_intermediate_size", "256", "--moe_layer_freq",
            "[0]*1+[1]*3", "--mtp_num_layers", "1"], [te, "bf16"], output="mla_mtp",
             decisions={"layer_spec": "transformer_engine"}),
        # Context parallelism through TE's ring attention (p2p), the causal 2N-chunk split.
        Path("CP 2 through Transformer Engine (p2p)", "pt", SMALL + [
            "--train_iters", "4", "--no_save", "--context_parallel_size", "2",
            "--cp_comm_type", "p2p"], [te, "CP 2 x"], gpus=2, output="cp2",
             decisions={"layer_spec": "transformer_engine"}),
        Path("throughput: ~1B Llama, seq 4096, bf16", "pt", LLAMA_1B, [te, "bf16"],
             output="llama_1b"),
    ]


def write_conversations(path: str) -> None:
    import random

    rng = random.Random(0)
    words = "alpha beta gamma delta river stone cloud light north south garden".split()
    with open(path, "w", encoding="utf-8") as fh:
        for _ in range(64):
            messages = []
            for _ in range(rng.randint(1, 3)):
                for role in ("user", "assistant"):
                    text = " ".join(rng.choice(words) for _ in range(rng.randint(3, 40)))
                    messages.append({"role": role, "content": text})
            fh.write(json.dumps({"messages": messages}) + "\n")


def argv_of(path: Path, work: str) -> List[str]:
    return [path.command, *path.flags, "--output_dir", os.path.join(work, path.output)]


def dry_run(selected: List[Path], work: str) -> None:
    """Parses and resolves every command as a GPU machine with Transformer Engine would
    (cuda=True, transformer_engine=True), and checks the decisions each path is about."""
    from swift_mcore.arguments import RunArguments, SftArguments, parse_args
    from swift_mcore.run_config import resolve

    for path in selected:
        argv = argv_of(path, work)
        cls = SftArguments if path.command == "sft" else RunArguments
        start = time.perf_counter()
        try:
            config = resolve(parse_args(argv[1:], prog=f"swift-mcore {path.command}", cls=cls),
                             world_size=path.gpus, cuda=True, transformer_engine=True,
                             apex=False)
            line = config.describe()
            # what describe() leaves to other lines: resume, LoRA's count, the layout (TP, CP)
            wanted = [text for text in path.expect if "starting at" not in text
                      and "TP " not in text and "CP " not in text
                      and "--tuner_type" not in text]
            missing = [text for text in wanted if text not in line]
            missing += [f"{name}={value!r} (got {getattr(config, name)!r})"
                        for name, value in path.decisions.items()
                        if getattr(config, name) != value]
            path.status = "FAIL" if missing else "parses"
            path.note = f"start-up line lacks {missing}" if missing else line
        except Exception as err:  # an ArgumentError is the finding
            path.status, path.note = "FAIL", f"{type(err).__name__}: {err}"
        path.seconds = time.perf_counter() - start
        cmd = " ".join(["swift-mcore", *argv])
        if path.gpus > 1:
            cmd = f"NPROC_PER_NODE={path.gpus} {cmd}"
        print(f"would run: {cmd}", flush=True)


def gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:
        return 0


def run(path: Path, work: str, gpus: int, timeout: float) -> None:
    if path.gpus > gpus:
        path.status, path.note = "skipped", f"needs {path.gpus} GPUs, the machine has {gpus}"
        return
    argv = argv_of(path, work)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if path.gpus > 1:
        env["NPROC_PER_NODE"] = str(path.gpus)
    start = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-m", "swift_mcore", *argv], env=env, cwd=ROOT,
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        path.status, path.seconds = "FAIL", time.perf_counter() - start
        path.note = f"timed out after {timeout:.0f}s"
        return
    path.seconds = time.perf_counter() - start
    out_dir = argv[-1]
    with open(os.path.join(out_dir + ".log"), "w", encoding="utf-8") as fh:
        fh.write(proc.stdout + "\n--- stderr\n" + proc.stderr)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        path.status, path.note = "FAIL", f"exit {proc.returncode}: {last[:200]}"
        return
    missing = [text for text in path.expect if text not in proc.stdout]
    records = []
    try:
        with open(os.path.join(out_dir, "metrics.jsonl"), encoding="utf-8") as fh:
            records = [r for r in map(json.loads, fh) if r.get("split") == "train"]
    except OSError:
        pass
    losses = [r.get("loss") for r in records]
    if not records or not all(isinstance(x, float) and math.isfinite(x) for x in losses):
        path.status, path.note = "FAIL", f"losses {losses}"
    elif missing:
        path.status, path.note = "FAIL", f"start-up line lacks {missing}"
    else:
        last = records[-1]
        path.metrics = {k: last.get(k) for k in ("loss", "tokens_per_s", "tflops", "mfu_percent",
                                                 "peak_memory_gb", "load_balancing_loss")}
        path.status = "pass"
        path.note = (f"loss {last['loss']:.3f}, {last.get('tokens_per_s', 0):.0f} tokens/s, "
                     f"{last.get('tflops', 0):.1f} TFLOP/s, MFU {last.get('mfu_percent', 0):.1f}%, "
                     f"{last.get('peak_memory_gb', 0):.1f} GB")


def table(selected: List[Path]) -> str:
    rows = ["| path | result | seconds | what it showed |", "| --- | --- | --- | --- |"]
    for p in selected:
        rows.append(f"| {p.name} | {p.status} | {p.seconds:.1f} | {p.note} |")
    return "\n".join(rows)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry_run", action="store_true",
                        help="print the commands and check their flags; run nothing")
    parser.add_argument("--work_dir", default=None,
                        help="folder for the runs' outputs (default: a fresh temporary one)")
    parser.add_argument("--timeout", type=float, default=150.0, help="seconds per command")
    opts = parser.parse_args(argv)
    import tempfile

    work = opts.work_dir or tempfile.mkdtemp(prefix="swift_mcore_gpu_check_")
    os.makedirs(work, exist_ok=True)
    write_conversations(os.path.join(work, "conversations.jsonl"))
    gpus = 2 if opts.dry_run else gpu_count()
    selected = paths(work, gpus)
    if opts.dry_run:
        dry_run(selected, work)
    else:
        if gpus == 0:
            print("gpu_check: no CUDA device; use --dry_run on a machine without a GPU",
                  file=sys.stderr)
            return 2
        start = time.perf_counter()
        for path in selected:
            run(path, work, gpus, opts.timeout)
            print(f"{path.status:7} {path.seconds:6.1f}s  {path.name}: {path.note}", flush=True)
        print(f"total {time.perf_counter() - start:.0f}s on {gpus} GPU(s)")
    print(table(selected))
    print(json.dumps({"dry_run": opts.dry_run, "gpus": gpus, "paths": [
        {"name": p.name, "status": p.status, "seconds": round(p.seconds, 1), "note": p.note,
         "metrics": p.metrics} for p in selected]}))
    if not opts.work_dir and opts.dry_run:
        shutil.rmtree(work, ignore_errors=True)
    failed = [p for p in selected if p.status == "FAIL"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
