"""Training tokens/s of a small mixture-of-experts model against the dense model with the same
active parameters, both through `swift-mcore pt`.

The MoE model routes each token to --topk of --experts experts of inner size --expert_ffn
(megatron's MoE layer: router, alltoall dispatcher, and on CPU its SequentialMLP's experts
run in one autograd function, runtime/cpu/grouped_experts.py); the dense model's
MLP has inner size topk x expert_ffn, so both do the same expert matmuls per token (the MoE
adds the router's). Each round runs both in their own process, in an order that alternates;
per run the tokens/s of the iterations after the first (warm-up). Reported: the median
per model and the median over rounds of MoE / dense within a round, so drifting load on a
shared machine hits both alike. Prints one JSON line.

--cpu_time adds the CPU seconds per iteration, which a loaded machine disturbs far less than
wall time: each run's CPU time (its process's rusage) less that of a one-iteration run of
the same model (start-up and the warm-up iteration), over --iters; MoE / dense as tokens per
CPU second. Use it with --threads 1 (idle OpenMP threads spin on CPU time).

  python benchmarks/moe_throughput.py                        # 4 layers, hidden 256, 8 experts top-2
  python benchmarks/moe_throughput.py --cpu_time --threads 1 --iters 8 --rounds 2
  python benchmarks/moe_throughput.py --tiny --rounds 1      # smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from bench_common import ROOT  # puts the checkout on sys.path


def run(kind: str, args, out: str, iters: int = 0):
    """One `pt` run of ``iters`` timed iterations after the warm-up one: its tokens/s over
    the timed iterations (None without any) and the CPU seconds its process used."""
    shape = ["--num_layers", str(args.layers), "--hidden_size", str(args.hidden),
             "--num_attention_heads", "4", "--num_query_groups", "2",
             "--seq_length", str(args.seq), "--micro_batch_size", "2",
             "--global_batch_size", "4", "--train_iters", str(iters + 1),
             "--log_interval", "1", "--eval_steps", "0", "--lr_warmup_iters", "0",
             "--progress_bar", "false", "--tensorboard", "false", "--plot", "false",
             "--no_save", "--attention_backend", "sdpa", "--num_workers", "0"]
    if kind == "moe":
        shape += ["--num_experts", str(args.experts), "--moe_router_topk", str(args.topk),
                  "--moe_ffn_hidden_size", str(args.expert_ffn), "--ffn_hidden_size",
                  str(args.expert_ffn), "--moe_aux_loss_coeff", "0.01"]
    else:
        shape += ["--ffn_hidden_size", str(args.topk * args.expert_ffn)]
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": str(args.threads)}
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen([sys.executable, "-m", "swift_mcore", "pt", *shape,
                                 "--output_dir", out], stdout=subprocess.DEVNULL,
                                stderr=err, env=env, cwd=ROOT)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode != 0:
            err.seek(0)
            raise SystemExit(f"{kind} run failed:\n{err.read().decode()[-3000:]}")
    cpu = usage.ru_utime + usage.ru_stime
    with open(os.path.join(out, "metrics.jsonl"), encoding="utf-8") as fh:
        records = [r for r in map(json.loads, fh) if r.get("split") == "train"]
    timed = records[1:]  # the first iteration warms up
    if not timed:
        return None, cpu
    return (sum(r["tokens"] for r in timed)
            / sum(r["tokens"] / r["tokens_per_s"] for r in timed)), cpu


def add_shape_arguments(parser) -> None:
    """The MoE model's shape and the dense model's derived from it (moe_profile.py too)."""
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--topk", type=int, default=2)
    parser.add_argument("--expert_ffn", type=int, default=256)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tiny", action="store_true")


def main() -> None:
    parser = argparse.ArgumentParser()
    add_shape_arguments(parser)
    parser.add_argument("--iters", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cpu_time", action="store_true",
                        help="also CPU seconds per iteration (see the module docstring)")
    args = parser.parse_args()
    if args.tiny:
        args.layers, args.hidden, args.expert_ffn, args.seq, args.iters = 2, 64, 32, 32, 2
    results = {"moe": [], "dense": []}
    cpu = {"moe": [], "dense": []}
    ratios, cpu_ratios = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            order = ("moe", "dense") if round_ % 2 == 0 else ("dense", "moe")
            measured, per_iter = {}, {}
            for kind in order:
                measured[kind], used = run(kind, args, os.path.join(tmp, f"{kind}{round_}"),
                                           args.iters)
                if args.cpu_time:
                    _, start_up = run(kind, args, os.path.join(tmp, f"{kind}{round_}s"))
                    per_iter[kind] = (used - start_up) / args.iters
                    cpu[kind].append(per_iter[kind])
            for kind, value in measured.items():
                results[kind].append(value)
            ratios.append(measured["moe"] / measured["dense"])
            if args.cpu_time:
                cpu_ratios.append(per_iter["dense"] / per_iter["moe"])
    report = {
        "shape": {"layers": args.layers, "hidden": args.hidden, "experts": args.experts,
                  "topk": args.topk, "expert_ffn": args.expert_ffn, "seq": args.seq},
        "moe_tokens_per_s_median": statistics.median(results["moe"]),
        "dense_tokens_per_s_median": statistics.median(results["dense"]),
        "moe_vs_dense_median": statistics.median(ratios),
        "rounds": args.rounds,
    }
    if args.cpu_time:
        report.update({
            "moe_cpu_s_per_iter_median": statistics.median(cpu["moe"]),
            "dense_cpu_s_per_iter_median": statistics.median(cpu["dense"]),
            "moe_vs_dense_tokens_per_cpu_s_median": statistics.median(cpu_ratios),
            "threads": args.threads})
    print(json.dumps(report))


if __name__ == "__main__":
    main()
