"""Data-loader throughput (samples/s) against the rate at which the trainer consumes samples.

    .venv/bin/python benchmarks/loader_throughput.py --repeats 3          # the default model
    .venv/bin/python benchmarks/loader_throughput.py --tiny --repeats 1 --seconds 1   # smoke

The trainer's rate: `swift-mcore pt` on the default model and data (no flags but a short
run), samples/s = tokens/s / seq_length from metrics.jsonl, median over the log windows
after the first. The loader's rate: the same datasets and loader the trainer builds
(`build_datasets`, `build_data_iterator`, --num_workers 0 and 1), read as fast as possible
for --seconds after its first batch, on one rank, median of --repeats. The ratio says how
many times faster than training the data arrives. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from bench_common import ROOT, SIZES, child_env  # puts the checkout on sys.path

TINY = [*SIZES["tiny"], "--seq_length", "32", "--micro_batch_size", "2",
        "--global_batch_size", "8"]


def trainer_samples_per_s(model_flags, iters: int, window: int, out: str) -> float:
    # Not this process's one-rank group: the run makes its own.
    env = child_env()
    proc = subprocess.run(
        [sys.executable, "-m", "swift_mcore", "pt", *model_flags, "--train_iters", str(iters),
         "--lr_warmup_iters", "1", "--log_interval", str(window), "--eval_steps", "0",
         "--no_save", "--progress_bar", "false", "--output_dir", out],
        capture_output=True, text=True, cwd=ROOT, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"swift-mcore pt failed:\n{proc.stderr[-3000:]}")
    from swift_mcore.arguments import parse_args

    seq = parse_args(model_flags).model.seq_length
    with open(os.path.join(out, "metrics.jsonl"), encoding="utf-8") as fh:
        records = [json.loads(line) for line in fh if line.strip()]
    rates = [r["tokens_per_s"] for r in records if r["split"] == "train"][1:] or \
        [r["tokens_per_s"] for r in records if r["split"] == "train"]
    return statistics.median(rates) / seq


def loader_samples_per_s(config, dataset, seconds: float) -> float:
    """The loader of ``config`` (its --num_workers) over ``dataset``."""
    from swift_mcore.data import build_data_iterator

    iterator = build_data_iterator(dataset, 0, config)
    next(iterator)  # worker start-up and the first batch are not steady state
    samples, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        samples += next(iterator)["tokens"].shape[0]
    return samples / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=5.0, help="loader read time per run")
    parser.add_argument("--iters", type=int, default=20, help="trainer iterations per run")
    parser.add_argument("--tiny", action="store_true", help="a tiny model (smoke test)")
    opts = parser.parse_args()
    model_flags = TINY if opts.tiny else []
    window = max(opts.iters // 4, 1)

    from swift_mcore._quiet import quiet_third_party

    quiet_third_party()  # before megatron is imported: its import warns
    from swift_mcore.arguments import parse_args
    from swift_mcore.data import build_datasets, build_tokenizer
    from swift_mcore.run_config import resolve
    from swift_mcore.runtime import distributed

    with tempfile.TemporaryDirectory(prefix="loader_bench_") as out:
        loader = {0: [], 1: []}
        # One resolved run per --num_workers (a RunConfig is read-only); the same datasets.
        configs = {workers: resolve(parse_args([*model_flags, "--output_dir", out,
                                                "--num_workers", str(workers)]))
                   for workers in loader}
        args = configs[0]
        distributed.initialize(args)
        train, _, _ = build_datasets(args, build_tokenizer(args))
        trainer = []
        for r in range(opts.repeats):  # alternated, so drifting machine load hits all alike
            for workers in loader:
                loader[workers].append(loader_samples_per_s(configs[workers], train,
                                                            opts.seconds))
            trainer.append(trainer_samples_per_s(model_flags, opts.iters, window,
                                                 os.path.join(out, f"train{r}")))
        distributed.shutdown()
    consume = statistics.median(trainer)
    result = {
        "model": "tiny" if opts.tiny else "default",
        "global_batch_size": args.training.global_batch_size,
        "seq_length": args.model.seq_length,
        "trainer_samples_per_s": round(consume, 2),
        "repeats": opts.repeats,
    }
    for workers, rates in loader.items():
        result[f"loader_samples_per_s_workers{workers}"] = round(statistics.median(rates), 1)
        result[f"ratio_workers{workers}"] = round(statistics.median(rates) / consume, 1)
        result[f"all_loader_workers{workers}"] = [round(x) for x in rates]
    result["all_trainer"] = [round(x, 2) for x in trainer]
    # Noise only slows a run down: the loader's slowest run against the trainer's fastest is
    # the most conservative ratio.
    result["worst_case_ratio_workers1"] = round(min(loader[1]) / max(trainer), 1)
    print(json.dumps(result))
    sys.stdout.flush()
    os._exit(0)  # gloo may abort during interpreter teardown (DESIGN.md); all is printed


if __name__ == "__main__":
    main()
