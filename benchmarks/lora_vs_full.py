"""LoRA against full finetuning on the same model: step time, peak memory, checkpoint size.

Each round runs `swift-mcore pt` once with --tuner_type full and once with --tuner_type
lora (the order alternating per round), each in its own process, on the same random-init
Llama-shaped model, data and batch. Step time is the median of the timed iterations'
tokens/s (the first --warmup iterations left out); peak memory is the run's maximum RSS;
the checkpoint is the last one's size on disk. Prints one JSON line; ratios are LoRA over
full, measured in the same run.

    .venv/bin/python benchmarks/lora_vs_full.py                # ~10M parameters
    .venv/bin/python benchmarks/lora_vs_full.py --tiny --rounds 1
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

ROOT = Path(__file__).resolve().parents[1]
SIZES = {
    "10m": ["--num_layers", "4", "--hidden_size", "384", "--num_attention_heads", "6",
            "--num_query_groups", "2", "--seq_length", "256"],
    "tiny": ["--num_layers", "2", "--hidden_size", "64", "--num_attention_heads", "4",
             "--num_query_groups", "2", "--seq_length", "32"],
}
LORA = ["--tuner_type", "lora", "--lora_rank", "8", "--lora_alpha", "32"]


def child(kind: str, shape, iters: int, out: str) -> None:
    """Runs one training in a subprocess; prints its peak RSS (this process's children)."""
    cmd = [sys.executable, "-m", "swift_mcore", "pt", *shape, "--micro_batch_size", "2",
           "--global_batch_size", "8", "--train_iters", str(iters), "--lr", "1e-4",
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
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--child")
    parser.add_argument("--shape")
    parser.add_argument("--out")
    opts = parser.parse_args()
    if opts.child:
        return child(opts.child, json.loads(opts.shape), opts.iters, opts.out)
    shape = SIZES["tiny" if opts.tiny else "10m"]
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
    print(json.dumps({"size": "tiny" if opts.tiny else "10m", "rounds": opts.rounds,
                      "iters": opts.iters, "full": summary["full"], "lora": summary["lora"],
                      "lora_over_full": ratios}))


if __name__ == "__main__":
    main()
