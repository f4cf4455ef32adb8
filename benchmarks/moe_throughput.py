"""Training tokens/s of a small mixture-of-experts model against the dense model with the same
active parameters, both through `swift-mcore pt`.

The MoE model routes each token to --topk of --experts experts of inner size --expert_ffn
(megatron's MoE layer: router, alltoall dispatcher, and on CPU its SequentialMLP's experts
in one autograd function, runtime/cpu/grouped_experts.py, and the dispatcher without its
cross-rank steps at EP=1, runtime/cpu/local_dispatch.py); the dense model's MLP has inner
size topk x expert_ffn, so both do the same expert matmuls per token (the MoE
adds the router's). Each round runs both in their own process, in an order that alternates;
per run the tokens/s of the iterations after the first (warm-up). Reported: the median
per model and the median over rounds of MoE / dense within a round, so drifting load on a
shared machine hits both alike. Prints one JSON line.

--cpu_time adds the CPU seconds of each training iteration (the Trainer's train_step, timed
with time.process_time inside the run), which a loaded machine disturbs far less than wall
time: per run the median over the iterations after the first; MoE / dense as tokens per
CPU second, the median over rounds. Use it with --threads 1 (idle OpenMP threads spin on
CPU time).

--phases adds where each model's iteration goes, in wall milliseconds (median over the
iterations after the first, then over rounds): the forward and backward passes of its
micro-batches (the Trainer's forward_backward), the optimizer step (gradient norm, clipping,
AdamW) and the rest of train_step (zeroing the gradient buffers, the losses' reduction).

  python benchmarks/moe_throughput.py                        # 4 layers, hidden 256, 8 experts top-2
  python benchmarks/moe_throughput.py --cpu_time --threads 1 --iters 8 --rounds 2
  python benchmarks/moe_throughput.py --phases --iters 12 --rounds 4
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


def run(kind: str, args, out: str):
    """One `pt` run: its tokens/s over the iterations after the first, and with --cpu_time
    or --phases what the child timed in those iterations (pt_child), else None."""
    shape = ["--num_layers", str(args.layers), "--hidden_size", str(args.hidden),
             "--num_attention_heads", "4", "--num_query_groups", "2",
             "--seq_length", str(args.seq), "--micro_batch_size", "2",
             "--global_batch_size", "4", "--train_iters", str(args.iters + 1),
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
    cpu_file = f"{out}.cpu.json"
    timed = args.cpu_time or args.phases
    launcher = ([os.path.abspath(__file__), "--pt_child", cpu_file] if timed
                else ["-m", "swift_mcore"])
    proc = subprocess.run([sys.executable, *launcher, "pt", *shape,
                           "--output_dir", out], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"{kind} run failed:\n{proc.stderr[-3000:]}")
    with open(os.path.join(out, "metrics.jsonl"), encoding="utf-8") as fh:
        records = [r for r in map(json.loads, fh) if r.get("split") == "train"]
    after = records[1:]  # the first iteration warms up
    tokens_per_s = (sum(r["tokens"] for r in after)
                    / sum(r["tokens"] / r["tokens_per_s"] for r in after))
    if not timed:
        return tokens_per_s, None
    with open(cpu_file, encoding="utf-8") as fh:
        times = json.load(fh)
    return tokens_per_s, {name: statistics.median(values[1:]) for name, values in times.items()}


def pt_child(cpu_file: str, argv) -> int:
    """`swift-mcore pt argv` in this process; per train_step its CPU seconds ("cpu") and the
    wall seconds of the step and its phases written to ``cpu_file`` as JSON lists."""
    import time

    from swift_mcore import cli
    from swift_mcore.training import trainer

    times = {"cpu": [], "step": [], "forward_backward": [], "optimizer": []}

    def timed(method, name):
        def call(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                times[name].append(time.perf_counter() - start)
        return call

    step = timed(trainer.Trainer.train_step, "step")

    def timed_step(self):
        start = time.process_time()
        try:
            return step(self)
        finally:
            times["cpu"].append(time.process_time() - start)

    trainer.Trainer.train_step = timed_step
    trainer.Trainer.forward_backward = timed(trainer.Trainer.forward_backward,
                                             "forward_backward")
    trainer.Trainer.optimizer_step = timed(trainer.Trainer.optimizer_step, "optimizer")
    code = cli.main(argv)
    with open(cpu_file, "w", encoding="utf-8") as fh:
        json.dump(times, fh)
    return code


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


def phases_ms(rounds) -> dict:
    """Per phase the median over rounds of each run's median, in milliseconds; "rest" is
    train_step less its forward_backward and optimizer step."""
    def median(name):
        return 1e3 * statistics.median(t[name] for t in rounds)
    phases = {name: median(name) for name in ("step", "forward_backward", "optimizer")}
    phases["rest"] = 1e3 * statistics.median(
        t["step"] - t["forward_backward"] - t["optimizer"] for t in rounds)
    return {name: round(value, 2) for name, value in phases.items()}


def main() -> None:
    if sys.argv[1:2] == ["--pt_child"]:
        raise SystemExit(pt_child(sys.argv[2], sys.argv[3:]))
    parser = argparse.ArgumentParser()
    add_shape_arguments(parser)
    parser.add_argument("--iters", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cpu_time", action="store_true",
                        help="also the CPU seconds per iteration (module docstring)")
    parser.add_argument("--phases", action="store_true",
                        help="also where the iteration's wall time goes (module docstring)")
    args = parser.parse_args()
    if args.tiny:
        args.layers, args.hidden, args.expert_ffn, args.seq, args.iters = 2, 64, 32, 32, 2
    results = {"moe": [], "dense": []}
    timed = {"moe": [], "dense": []}
    ratios, cpu_ratios = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            order = ("moe", "dense") if round_ % 2 == 0 else ("dense", "moe")
            measured = {kind: run(kind, args, os.path.join(tmp, f"{kind}{round_}"))
                        for kind in order}
            for kind, (value, times) in measured.items():
                results[kind].append(value)
                timed[kind].append(times)
            ratios.append(measured["moe"][0] / measured["dense"][0])
            if args.cpu_time:
                cpu_ratios.append(measured["dense"][1]["cpu"] / measured["moe"][1]["cpu"])
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
            "moe_cpu_s_per_iteration_median": statistics.median(t["cpu"] for t in timed["moe"]),
            "dense_cpu_s_per_iteration_median": statistics.median(
                t["cpu"] for t in timed["dense"]),
            "moe_vs_dense_tokens_per_cpu_s_median": statistics.median(cpu_ratios),
            "threads": args.threads})
    if args.phases:
        report["phases_ms"] = {kind: phases_ms(timed[kind]) for kind in ("moe", "dense")}
    print(json.dumps(report))


if __name__ == "__main__":
    main()
