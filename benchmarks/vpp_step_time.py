"""Step time of the interleaved pipeline (PP=2 x 2 virtual stages per rank) against plain PP=2 at
the same layers, on 2 gloo ranks.

The interleaved schedule gives each rank two model chunks of half its layers and runs the
micro-batches through them in turn: the pipeline's warm-up and cool-down bubbles shrink by the
number of virtual stages, at the price of twice as many point-to-point exchanges. Whether that
pays on CPU and gloo is what this measures. Each contender is `swift-mcore pt` under its own
`torchrun --nproc_per_node 2`, the same model, data, seed, micro-batches and global batch; the
order of the two contenders rotates from round to round so that drifting load hits both alike.
A step's time is its global batch's tokens over the tokens/s metrics.jsonl records for it (rank
0's wall time of the whole step); the first --warmup steps are left out. Reported: per contender
the median steady-state step time of each round and over all rounds, and the ratio
vpp / plain of the medians (below 1: the interleaved schedule is faster). Prints one JSON line.

  python benchmarks/vpp_step_time.py                      # 8 layers, hidden 384, seq 512
  python benchmarks/vpp_step_time.py --tiny --rounds 1    # smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile

from bench_common import ROOT, child_env, flags  # puts the checkout on sys.path

CONTENDERS = {
    "pp2": ["--pipeline_model_parallel_size", "2"],
    "pp2_vpp2": ["--pipeline_model_parallel_size", "2",
                 "--num_virtual_stages_per_pipeline_rank", "2"],
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def model_flags(args) -> list:
    shape = flags(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=4,
                  num_query_groups=2, seq_length=args.seq, micro_batch_size=1,
                  global_batch_size=args.micro_batches)
    return [*shape, "--train_iters", str(args.warmup + args.iters), "--lr", "1e-4",
            "--lr_warmup_iters", "0", "--log_interval", "1", "--eval_steps", "0",
            "--progress_bar", "false", "--tensorboard", "false", "--plot", "false",
            "--no_save", "--num_workers", "0", "--hidden_dropout", "0",
            "--attention_dropout", "0"]


def step_times(name: str, args, out: str) -> list:
    """The steady-state step seconds of one run of contender ``name``."""
    env = child_env(PYTHONPATH=ROOT, PYTHONWARNINGS="ignore",
                    OMP_NUM_THREADS=str(args.threads))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           f"--master_port={free_port()}", "-m", "swift_mcore", "pt", *model_flags(args),
           *CONTENDERS[name], "--output_dir", out]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    with open(os.path.join(out, "metrics.jsonl"), encoding="utf-8") as fh:
        records = [r for r in map(json.loads, fh) if r.get("split") == "train"]
    if [r["iteration"] for r in records] != list(range(1, args.warmup + args.iters + 1)):
        raise SystemExit(f"{name}: metrics.jsonl holds iterations "
                         f"{[r['iteration'] for r in records]}")
    return [r["tokens"] / r["tokens_per_s"] for r in records[args.warmup:]]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=384)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--micro_batches", type=int, default=8,
                        help="micro-batches of one row per step (a multiple of 2)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--tiny", action="store_true")
    args = parser.parse_args()
    if args.tiny:
        args.layers, args.hidden, args.seq, args.micro_batches = 4, 64, 32, 4
        args.warmup, args.iters = 1, 2
    if args.layers % 4 or args.micro_batches % 2 or args.iters < 1:
        parser.error("--layers must be a multiple of 4 (2 ranks x 2 virtual stages), "
                     "--micro_batches of 2, --iters at least 1")
    names = list(CONTENDERS)
    per_round = {name: [] for name in names}
    every = {name: [] for name in names}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            order = names if round_ % 2 == 0 else names[::-1]
            for name in order:
                times = step_times(name, args, os.path.join(tmp, f"{name}{round_}"))
                per_round[name].append(round(statistics.median(times), 4))
                every[name] += times
    medians = {name: statistics.median(every[name]) for name in names}
    print(json.dumps({
        "shape": {"layers": args.layers, "hidden": args.hidden, "seq": args.seq,
                  "micro_batches": args.micro_batches, "threads_per_rank": args.threads},
        "rounds": args.rounds, "timed_steps_per_run": args.iters,
        "step_s_per_round": per_round,
        "step_s_median": {name: round(value, 4) for name, value in medians.items()},
        "vpp_vs_pp_step_time": round(medians["pp2_vpp2"] / medians["pp2"], 4),
    }))


if __name__ == "__main__":
    main()
