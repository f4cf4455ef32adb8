"""LoRA against full finetuning on the same model: step time, peak memory, checkpoint size.

Each round runs `swift-mcore pt` once with --tuner_type full and once with --tuner_type
lora (the order alternating per round), each in its own process, on the same random-init
Llama-shaped model, data and batch. Step time is the median of the timed iterations'
tokens/s (the first --warmup iterations left out); peak memory is the run's maximum RSS;
the checkpoint is the last one's size on disk. Prints one JSON line; ratios are LoRA over
full, measured in the same run.

    .venv/bin/python benchmarks/lora_vs_full.py                # ~10M parameters
    .venv/bin/python benchmarks/lora_vs_full.py --tiny --rounds 1

With --profile, each kind instead runs in-process (its own process still) through the
Trainer: after --warmup steps it times whole optimizer steps (Trainer.train_step), split
into megatron's forward/backward schedule and the optimizer step (megatron's DDP gradient
sync included in the former), then profiles --iters more steps under torch.profiler and
sums self CPU time by kind of operator: the matmuls (with their call counts: a frozen
base weight skips its weight-gradient matmul), the optimizer's kernels, the rest.

    .venv/bin/python benchmarks/lora_vs_full.py --profile --rounds 2 --iters 3
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench_common import LLAMA, ROOT, SIZES as SHAPE_FLAGS, child_env  # puts the checkout on sys.path

# Each size's model flags and micro/global batch: 10m and tiny at seq 256/32 with 2 rows a
# micro-batch, 8 a step; 100m as benchmarks/sft_vs_trl.py's rows (a Llama, seq 512, one
# micro-batch of 4 rows a step: 2,048 tokens).
SMALL_BATCH = ["--micro_batch_size", "2", "--global_batch_size", "8"]
SIZES = {"10m": [*SHAPE_FLAGS["10m"], "--seq_length", "256", *SMALL_BATCH],
         "tiny": [*SHAPE_FLAGS["tiny"], "--seq_length", "32", *SMALL_BATCH],
         "100m": [*SHAPE_FLAGS["100m"], *LLAMA, "--seq_length", "512",
                  "--micro_batch_size", "4", "--global_batch_size", "4"]}
LORA = ["--tuner_type", "lora", "--lora_rank", "8", "--lora_alpha", "32"]


def child(kind: str, shape, iters: int, out: str) -> None:
    """Runs one training in a subprocess; prints its peak RSS (this process's children)."""
    cmd = [sys.executable, "-m", "swift_mcore", "pt", *shape, "--train_iters", str(iters), "--lr", "1e-4",
           "--lr_warmup_iters", "0", "--lr_decay_style", "constant", "--min_lr", "1e-4",
           "--log_interval", "1", "--eval_steps", "0", "--progress_bar", "false",
           "--report_to", "none", "--plot", "false", "--num_workers", "0",
           "--attention_backend", "sdpa", "--output_dir", out, *(LORA if kind == "lora" else [])]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
    if proc.returncode != 0:
        sys.exit(proc.stderr[-3000:])
    rss_kb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    print(json.dumps({"rss_MB": rss_kb / 1024, "stdout": proc.stdout[-2000:]}))


MATMUL = {"aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm", "aten::baddbmm",
          "aten::matmul", "aten::linear", "mkldnn::_linear_pointwise"}


def profile_child(kind: str, shape, iters: int, warmup: int) -> None:
    """One kind's steps timed and profiled in this process; prints one JSON line."""
    import tempfile
    import time

    import torch
    from torch.profiler import ProfilerActivity, profile

    from swift_mcore._quiet import quiet_third_party

    quiet_third_party()
    from swift_mcore.arguments import parse_args
    from swift_mcore.run_config import resolve
    from swift_mcore.training.trainer import Trainer

    flags = [*shape, "--train_iters", str(warmup + 2 * iters), "--lr", "1e-4", "--lr_warmup_iters", "0",
             "--lr_decay_style", "constant", "--min_lr", "1e-4", "--eval_steps", "0",
             "--progress_bar", "false", "--report_to", "none", "--plot", "false",
             "--num_workers", "0", "--attention_backend", "sdpa", "--no_save",
             "--output_dir", tempfile.mkdtemp(prefix=f"lora_{kind}_"),
             *(LORA if kind == "lora" else [])]
    trainer = Trainer(resolve(parse_args(flags)))
    trainer.setup()
    for _ in range(warmup):
        trainer.train_step()
    spent = {"forward_backward": 0.0, "optimizer_step": 0.0}

    def timed(name, function):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                spent[name] += time.perf_counter() - start
        return wrapper

    trainer.forward_backward = timed("forward_backward", trainer.forward_backward)
    trainer.optimizer_step = timed("optimizer_step", trainer.optimizer_step)
    # CPU seconds this process used (all threads): the work of a step, which a loaded
    # machine stretches in wall time but does not change
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(iters):
        trainer.train_step()
    step_s = (time.perf_counter() - start) / iters
    step_cpu_s = (time.process_time() - cpu) / iters
    split = {name: round(value / iters, 4) for name, value in spent.items()}
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(iters):
            trainer.train_step()
    kinds, ops = {}, []
    for event in prof.key_averages():
        self_s = event.self_cpu_time_total / 1e6 / iters
        what = ("matmul" if event.key in MATMUL else
                "optimizer" if "adam" in event.key.lower() else "other")
        total, calls = kinds.get(what, (0.0, 0))
        kinds[what] = (total + self_s, calls + event.count // iters)
        ops.append((self_s, event.key, event.count // iters))
    ops.sort(reverse=True)
    trainable, total = (sum(p.numel() for p in trainer.model[0].parameters()
                            if p.requires_grad),
                        sum(p.numel() for p in trainer.model[0].parameters()))
    print(json.dumps({
        "kind": kind, "torch_threads": torch.get_num_threads(), "step_s": round(step_s, 4),
        "step_cpu_s": round(step_cpu_s, 4),
        "split_s": split, "trainable": trainable, "parameters": total,
        "profiled_self_s": {k: round(v, 4) for k, (v, _) in sorted(kinds.items())},
        "calls_per_step": {k: c for k, (_, c) in sorted(kinds.items())},
        "optimized": sum(p.numel() for group in trainer.optimizer.param_groups
                         for p in group["params"]),
        "top_ops": [{"op": n, "self_s": round(s, 4), "calls": c} for s, n, c in ops[:14]],
    }), flush=True)


def profile_round(kind: str, shape, iters: int, warmup: int) -> dict:
    env = child_env(OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"),
                    PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, __file__, "--child", kind, "--profile", "--shape",
                           json.dumps(shape), "--iters", str(iters), "--warmup", str(warmup)],
                          capture_output=True, text=True, cwd=ROOT, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"{kind} failed: {proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def measure(kind: str, shape, iters: int, warmup: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, kind)
        proc = subprocess.run([sys.executable, __file__, "--child", kind, "--shape",
                               json.dumps(shape), "--iters", str(iters), "--out", out],
                              capture_output=True, text=True, cwd=ROOT)
        if proc.returncode != 0:
            raise SystemExit(f"{kind} failed: {proc.stderr[-3000:]}")
        reported = json.loads(proc.stdout.strip().splitlines()[-1])
        records = [json.loads(line) for line in Path(out, "metrics.jsonl").read_text()
                   .splitlines()]
        speeds = [r["tokens_per_s"] for r in records
                  if r.get("split") == "train" and r["iteration"] > warmup]
        folder = Path(out, "checkpoint", f"iter_{iters:07d}")
        size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
        trainable = next((line for line in reported["stdout"].splitlines()
                          if line.startswith("--tuner_type lora:")), None)
    return {"tokens_per_s": statistics.median(speeds), "rss_MB": reported["rss_MB"],
            "checkpoint_MB": size / 1e6, "log": trainable}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iters", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--tiny", action="store_true", help="--size tiny")
    parser.add_argument("--size", choices=sorted(SIZES), default="10m")
    parser.add_argument("--child")
    parser.add_argument("--shape")
    parser.add_argument("--out")
    parser.add_argument("--profile", action="store_true")
    opts = parser.parse_args()
    if opts.child and opts.profile:
        return profile_child(opts.child, json.loads(opts.shape), opts.iters, opts.warmup)
    if opts.child:
        return child(opts.child, json.loads(opts.shape), opts.iters, opts.out)
    size = "tiny" if opts.tiny else opts.size
    shape = SIZES[size]
    if opts.profile:
        for r in range(opts.rounds):
            for kind in (("full", "lora") if r % 2 == 0 else ("lora", "full")):
                print(json.dumps({"round": r, **profile_round(kind, shape, opts.iters,
                                                              opts.warmup)}), flush=True)
        return
    runs = {"full": [], "lora": []}
    for r in range(opts.rounds):
        for kind in (("full", "lora") if r % 2 == 0 else ("lora", "full")):
            runs[kind].append(measure(kind, shape, opts.iters, opts.warmup))
    summary = {}
    for kind, results in runs.items():
        summary[kind] = {key: statistics.median(x[key] for x in results)
                         for key in ("tokens_per_s", "rss_MB", "checkpoint_MB")}
    summary["lora"]["trainable"] = runs["lora"][0]["log"]
    ratios = {key: summary["lora"][key] / summary["full"][key]
              for key in ("tokens_per_s", "rss_MB", "checkpoint_MB")}
    print(json.dumps({"size": size, "rounds": opts.rounds,
                      "iters": opts.iters, "full": summary["full"], "lora": summary["lora"],
                      "lora_over_full": ratios}))


if __name__ == "__main__":
    main()
