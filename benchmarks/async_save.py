"""Step time around a checkpoint save: --async_save against the synchronous save.

One process trains ``--iters`` iterations with a save every ``--save_steps``, once with the
synchronous save and once with --async_save, alternating over ``--rounds`` rounds (each run
in its own process). An iteration's time is from the start of its step to the start of the
next one, so a save iteration includes the save (for --async_save: scheduling it, and
waiting for the previous background save if that is still running). Reported, per mode:
the median plain iteration, the median save iteration, the median of the iterations right
after a save (where the background writer competes for the cores), and the whole run's
wall time; then the async / sync ratios of the same run pairs.

  python benchmarks/async_save.py                    # ~35M-parameter model (~0.4 GB saved)
  python benchmarks/async_save.py --tiny --rounds 1  # smoke test
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from bench_common import ROOT, SHAPES, on_path  # puts the checkout on sys.path

on_path("tests", "checkpointing")

BIG = dict(num_layers=4, hidden_size=768, num_attention_heads=12, num_query_groups=4,
           seq_length=128, micro_batch_size=2, global_batch_size=4)
TINY = dict(SHAPES["tiny"], seq_length=32, micro_batch_size=2, global_batch_size=4)


def child(spec_path):
    """One run: train, then print the per-iteration times as JSON."""
    with open(spec_path, encoding="utf-8") as fh:
        spec = json.load(fh)
    from swift_mcore.arguments import RunArguments
    from swift_mcore.runtime import distributed
    from swift_mcore.training.trainer import Trainer

    starts = []

    class Timed(Trainer):
        def train_step(self):
            starts.append(time.perf_counter())
            return super().train_step()

    began = time.perf_counter()
    Timed(RunArguments.from_flags(**spec["flags"])).train()
    ended = time.perf_counter()
    starts.append(ended)  # the last iteration ends with the final save's commit
    print(json.dumps({"durations": [b - a for a, b in zip(starts, starts[1:])],
                      "wall_s": ended - began}), flush=True)
    distributed.exit_process(0)


def run_once(workdir, flags, async_save, tag):
    out = os.path.join(workdir, tag)
    spec = os.path.join(workdir, f"{tag}.json")
    with open(spec, "w", encoding="utf-8") as fh:
        json.dump({"flags": {**flags, "async_save": async_save, "output_dir": out}}, fh)
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "PYTHONPATH": ROOT}
    proc = subprocess.run([sys.executable, __file__, "--child", spec], capture_output=True,
                          text=True, env=env, cwd=ROOT, timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"run {tag} failed:\n{proc.stderr[-3000:]}")
    shutil.rmtree(out, ignore_errors=True)  # the disk holds one run's checkpoints at a time
    return json.loads(proc.stdout.strip().splitlines()[-1])


def summarize(result, save_steps, iters):
    d = result["durations"]
    saves = [i for i in range(1, iters + 1) if i % save_steps == 0 and i < iters]
    after = [i + 1 for i in saves if i + 1 < iters]
    plain = [i for i in range(2, iters) if i not in saves and i not in after]  # 1: warm-up
    pick = lambda its: statistics.median(d[i - 1] for i in its) if its else None  # noqa: E731
    return {"plain_iteration_s": pick(plain), "save_iteration_s": pick(saves),
            "after_save_iteration_s": pick(after), "wall_s": result["wall_s"]}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iters", type=int, default=16)
    parser.add_argument("--save_steps", type=int, default=4)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--child")
    opts = parser.parse_args()
    if opts.child:
        return child(opts.child)

    import ckpt_harness as H

    workdir = tempfile.mkdtemp(prefix="async_save_")
    try:
        corpus = H.write_corpus(os.path.join(workdir, "corpus.jsonl"), n_docs=200, words=200)
        flags = {**(TINY if opts.tiny else BIG), "dataset": [corpus], "split": "100,0,0",
                 "train_iters": opts.iters, "save_steps": opts.save_steps,
                 "lr_warmup_iters": 0, "lr_decay_style": "constant", "log_interval": 1000,
                 "eval_steps": 0, "tensorboard": False, "plot": False,
                 "progress_bar": False, "num_workers": 0}
        runs = {"sync": [], "async": []}
        for r in range(opts.rounds):
            order = ("sync", "async") if r % 2 == 0 else ("async", "sync")
            for mode in order:
                res = run_once(workdir, flags, mode == "async", f"{mode}{r}")
                runs[mode].append(summarize(res, opts.save_steps, opts.iters))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    med = {mode: {k: statistics.median(x[k] for x in rs) for k in rs[0]}
           for mode, rs in runs.items()}
    ratios = {k: statistics.median(a[k] / s[k] for a, s in zip(runs["async"], runs["sync"]))
              for k in runs["sync"][0]}
    print(json.dumps({"rounds": opts.rounds, "iters": opts.iters, "save_steps": opts.save_steps,
                      "model": "tiny" if opts.tiny else "big", "median": med,
                      "async_over_sync": ratios, "runs": runs}))


if __name__ == "__main__":
    main()
