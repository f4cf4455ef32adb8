"""SIGKILL at random moments, many times over: resume always starts from the newest
complete checkpoint, the committed history trains every sample exactly once, and the
final losses equal an uninterrupted run's bit for bit.

Each trial starts a training segment with --resume and --save_steps 1 (so a save is
nearly always in flight) and SIGKILLs its process group: as soon as a save is being
written ('mid-save'), at a random moment once training runs ('random'), or at a random
moment from the launch, start-up and checkpoint loading included ('launch'). A last
segment then trains to the end.

  python benchmarks/kill_resume.py                     # 12 trials, one rank
  python benchmarks/kill_resume.py --trials 12 --world_size 2
  python benchmarks/kill_resume.py --trials 2 --iters 6   # smoke test
"""

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import time

from bench_common import on_path  # puts the checkout on sys.path

# ckpt_harness imports the tests' run_helpers
on_path("tests")
on_path("tests", "checkpointing")

import ckpt_harness as H  # noqa: E402

MODES = ("mid-save", "random", "launch")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=12)
    parser.add_argument("--iters", type=int, default=40)
    parser.add_argument("--world_size", type=int, default=1, choices=(1, 2))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep", help="keep the run folders here")
    opts = parser.parse_args()

    rnd = random.Random(opts.seed)
    workdir = opts.keep or tempfile.mkdtemp(prefix="kill_resume_")
    os.environ.setdefault("SWIFT_MCORE_CACHE", os.path.join(workdir, "cache"))
    started = time.time()
    try:
        corpus = H.write_corpus(os.path.join(workdir, "corpus.jsonl"), n_docs=20)
        flags = {**H.TINY, "dataset": [corpus], "split": "90,10,0",
                 "train_iters": opts.iters}
        straight = os.path.join(workdir, "straight")
        H.run(straight, flags, opts.world_size)
        out = os.path.join(workdir, "killed")
        kflags = {**flags, "save_steps": 1, "save_total_limit": 2, "resume": "auto"}
        trials = [H.kill_trial(out, kflags, MODES[i % len(MODES)], rnd, opts.world_size)
                  for i in range(opts.trials)]
        H.run(out, kflags, opts.world_size, tag="final")

        problems = []
        for i, t in enumerate(trials):
            if t["started_at"] is not None and t["started_at"] != t["newest_complete_before"]:
                problems.append(f"trial {i}: started at {t['started_at']}, newest complete "
                                f"was {t['newest_complete_before']}")
        gbs = flags["global_batch_size"]
        committed = H.committed_history(out)
        ids = [i for it in committed for i in committed[it]]
        if list(committed) != list(range(1, opts.iters + 1)):
            problems.append(f"committed iterations {list(committed)}")
        if ids != list(range(opts.iters * gbs)):
            problems.append("committed samples are not each position exactly once")
        a, b = H.trace(straight, opts.world_size), H.trace(out, opts.world_size)
        unequal = [it for it in a if b.get(it, {}).get("loss") != a[it]["loss"]]
        if unequal:
            problems.append(f"losses differ from the straight run at iterations {unequal}")
        summary = {
            "trials": len(trials), "world_size": opts.world_size, "iters": opts.iters,
            "mid_save_kills": sum(t["mid_save"] for t in trials),
            "killed_before_setup": sum(t["started_at"] is None for t in trials),
            "resume_starts": [t["started_at"] for t in trials],
            "finished_before_kill": sum(t["finished_before_kill"] for t in trials),
            "iterations_redone_after_kills": len(H.records(out, "trace", 0)) - opts.iters,
            "losses_bit_equal": not unequal, "ok": not problems, "problems": problems,
            "seconds": round(time.time() - started, 1),
        }
    finally:
        if not opts.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    print(json.dumps(summary))
    sys.exit(0 if summary["ok"] else 1)


if __name__ == "__main__":
    main()
