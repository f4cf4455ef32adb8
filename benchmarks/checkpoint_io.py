"""Checkpoint save and load throughput (MB/s), with the time split into its parts.

Builds a model with Adam state (one real step), then saves it ``--repeats`` times through
``save_checkpoint`` (dist_checkpointing write, then the commit: CRC-32 + fsync of every
file, manifest, rename, tracker) and resumes from it as often through the checkpoint load
(``plan_load``: locate and check it; ``restore``: CRC verification, then the sharded load).
One process, one rank.
Loads read a checkpoint just written, so they run from the warm page cache.

The baseline, alternating with them: the same state (every model chunk's state_dict and
the optimizer's state_dict) through a plain ``torch.save`` into one file, flushed and
fsynced as the commit does, and a ``torch.load`` of it applied with ``load_state_dict`` to
the model and the optimizer. No checksums, no atomic rename, no sharding: the floor of what
a save and a load can cost here.

  python benchmarks/checkpoint_io.py                        # ~1 GB checkpoint
  python benchmarks/checkpoint_io.py --repeats 1 --profile  # where a save's time goes
  python benchmarks/checkpoint_io.py --tiny --repeats 1     # smoke test
"""

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

from bench_common import SHAPES  # puts the checkout on sys.path

BIG = SHAPES["100m"]
TINY = SHAPES["tiny"]


class Clock:
    """Accumulates the time spent in chosen module functions."""

    def __init__(self):
        self.spent = {}

    def wrap(self, module, name, label):
        original = getattr(module, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.spent[label] = self.spent.get(label, 0.0) + time.perf_counter() - start

        setattr(module, name, timed)

    def take(self):
        spent, self.spent = self.spent, {}
        return spent


def folder_bytes(folder):
    return sum(os.path.getsize(os.path.join(base, f))
               for base, _, files in os.walk(folder) for f in files)


def torch_save(trainer, path):
    """The trainer's model and optimizer state in one torch.save file, fsynced."""
    import torch

    start = time.perf_counter()
    state = {"model": [chunk.state_dict() for chunk in trainer.model],
             "optimizer": trainer.optimizer.state_dict()}
    with open(path, "wb") as fh:
        torch.save(state, fh)
        written = time.perf_counter()
        fh.flush()
        os.fsync(fh.fileno())
    end = time.perf_counter()
    return {"total_s": end - start, "torch_save_s": written - start, "fsync_s": end - written}


def torch_load(trainer, path):
    """Reads the file and applies it to the trainer's model and optimizer."""
    import torch

    start = time.perf_counter()
    state = torch.load(path, weights_only=True)
    read = time.perf_counter()
    for chunk, chunk_state in zip(trainer.model, state["model"]):
        chunk.load_state_dict(chunk_state)
    trainer.optimizer.load_state_dict(state["optimizer"])
    end = time.perf_counter()
    return {"total_s": end - start, "torch_load_s": read - start, "apply_s": end - read}


def profile_saves(trainer, path, plain):
    """Where a save's time goes: cumulative time of the top functions, swift-mcore's save
    then torch.save, to stderr."""
    import cProfile
    import pstats

    shutil.rmtree(path)
    os.remove(plain)
    for label, call in (("save_checkpoint", trainer.save_checkpoint),
                        ("torch_save", lambda: torch_save(trainer, plain))):
        trainer.checkpoints.last_saved_iteration = None  # the same iteration again
        profiler = cProfile.Profile()
        profiler.runcall(call)
        print(f"---- {label}", file=sys.stderr)
        pstats.Stats(profiler, stream=sys.stderr).sort_stats("cumulative").print_stats(30)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--dir", help="where to write (default: a temporary folder)")
    parser.add_argument("--profile", action="store_true",
                        help="cProfile one more save and one torch.save; top functions to "
                             "stderr")
    opts = parser.parse_args()

    from swift_mcore.arguments import RunArguments
    from swift_mcore.checkpointing import load, save
    from swift_mcore.training.trainer import Trainer

    clock = Clock()
    clock.wrap(save.io, "save", "dist_checkpointing_save_s")
    clock.wrap(save.commit, "seal", "seal_crc_fsync_s")
    clock.wrap(load, "verify", "verify_crc_s")
    clock.wrap(load, "_load", "dist_checkpointing_load_s")
    # The whole load: locate and check (before the data), then restore.
    clock.wrap(load, "plan_load", "plan_load_s")
    clock.wrap(load, "restore", "restore_s")

    workdir = opts.dir or tempfile.mkdtemp(prefix="ckpt_io_")
    flags = {**(TINY if opts.tiny else BIG), "seq_length": 32, "micro_batch_size": 2,
             "global_batch_size": 2, "train_iters": 1000, "lr_warmup_iters": 1,
             "eval_steps": 0, "tensorboard": False, "progress_bar": False,
             "num_workers": 0, "output_dir": os.path.join(workdir, "run")}
    try:
        trainer = Trainer(RunArguments.from_flags(**flags))
        trainer.setup()
        trainer.train_step()
        trainer.state.iteration = 1
        trainer.state.consumed_train_samples = flags["global_batch_size"]
        saves, loads, plain_saves, plain_loads = [], [], [], []
        plain = os.path.join(workdir, "plain.pt")
        path = None
        for _ in range(opts.repeats):  # alternating with the baseline
            # Each save writes the same iteration again: remove the last one first (untimed),
            # as a run's save writes a new folder (and the baseline a new file) rather than
            # replacing and deleting a 1 GB one.
            if path:
                shutil.rmtree(path)
            if os.path.exists(plain):
                os.remove(plain)
            clock.take()
            start = time.perf_counter()
            path = trainer.save_checkpoint()
            total = time.perf_counter() - start
            # allow saving the same iteration again
            trainer.checkpoints.last_saved_iteration = None
            saves.append({"total_s": total, **clock.take()})
            plain_saves.append(torch_save(trainer, plain))
        size = folder_bytes(path)
        if opts.profile:
            profile_saves(trainer, path, plain)
        for _ in range(opts.repeats):
            resumed = Trainer(RunArguments.from_flags(**flags, resume="auto"))
            clock.take()
            resumed.setup()
            spent = clock.take()
            if "restore_s" not in spent:
                raise SystemExit("the resumed trainer restored no checkpoint")
            loads.append({"total_s": spent["plan_load_s"] + spent["restore_s"], **spent})
            plain_loads.append(torch_load(resumed, plain))
            resumed.writer.close()
        plain_mb = os.path.getsize(plain) / 1e6
        trainer.writer.close()
    finally:
        if not opts.dir:
            shutil.rmtree(workdir, ignore_errors=True)

    def med(rows):
        return {k: round(statistics.median(r[k] for r in rows), 4) for k in rows[0]}

    mb = size / 1e6
    s, l = med(saves), med(loads)
    ps, pl = med(plain_saves), med(plain_loads)
    print(json.dumps({
        "parameters_M": round(trainer.num_parameters / 1e6, 2), "checkpoint_MB": round(mb, 1),
        "repeats": opts.repeats, "save": s, "load": l,
        "save_MB_per_s": round(mb / s["total_s"], 1), "load_MB_per_s": round(mb / l["total_s"], 1),
        "torch_MB": round(plain_mb, 1), "torch_save": ps, "torch_load": pl,
        "torch_save_MB_per_s": round(plain_mb / ps["total_s"], 1),
        "torch_load_MB_per_s": round(plain_mb / pl["total_s"], 1),
        # swift-mcore's time over the baseline's, for the same state.
        "save_time_ratio": round(s["total_s"] / ps["total_s"], 3),
        "load_time_ratio": round(l["total_s"] / pl["total_s"], 3),
    }))
    os._exit(0)


if __name__ == "__main__":
    main()
