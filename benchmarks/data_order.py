"""What --data_order megatron costs in resume guarantees: the samples still to come after a
resume when --train_iters is changed, megatron's order against the resumable one.

    .venv/bin/python benchmarks/data_order.py                          # the recorded numbers
    .venv/bin/python benchmarks/data_order.py --train_iters 40 --changed 60 --resume_at 10

On the embedded corpus and the default tokenizer (seq 64, global batch 8, split 969,30,1,
seed 1234), the training set is built for --train_iters and for each of --changed, each
order over it is read as the trainer reads it, and the samples at the positions a run
resumed at iteration --resume_at would still train (up to the shorter run's end) are
compared by their tokens. Also the time to build the index and its size. Prints one JSON
line: for each changed value and order, the share of those positions whose sample differs.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import bench_common  # noqa: F401  (puts the checkout on sys.path
GBS, MBS = 8, 8


def samples(order: str, train_iters: int, out: str, tokenizer):
    """(tokens of each position 0 .. train_iters x GBS, build seconds, dataset length)."""
    import itertools

    from swift_mcore.arguments import RunArguments
    from swift_mcore.data.gpt_datasets import build_datasets
    from swift_mcore.data.loader import build_data_iterator
    from swift_mcore.run_config import resolve

    config = resolve(RunArguments.from_flags(
        seq_length=64, micro_batch_size=MBS, global_batch_size=GBS, train_iters=train_iters,
        lr_warmup_iters=0, seed=1234, split="969,30,1", data_order=order, eval_steps=0,
        num_workers=0, output_dir=os.path.join(out, f"{order}_{train_iters}")), world_size=1)
    start = time.perf_counter()
    train = build_datasets(config, tokenizer)[0]
    seconds = time.perf_counter() - start
    batches = itertools.islice(build_data_iterator(train, 0, config), train_iters)
    rows = [tuple(row.tolist()) for b in batches for row in b["tokens"]]
    return rows, seconds, len(train)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser()
    parser.add_argument("--train_iters", type=int, default=400)
    parser.add_argument("--changed", type=int, nargs="+", default=[200, 600, 2000])
    parser.add_argument("--resume_at", type=int, default=100)
    a = parser.parse_args(argv)

    import torch.distributed as dist
    from megatron.core import parallel_state

    from swift_mcore.data.tokenizer import default_tokenizer

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    dist.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    tokenizer = default_tokenizer()
    result = {"global_batch_size": GBS, "seq_length": 64, "train_iters": a.train_iters,
              "resume_at": a.resume_at, "orders": {}}
    with tempfile.TemporaryDirectory() as out:
        for order in ("resumable", "megatron"):
            base, seconds, length = samples(order, a.train_iters, out, tokenizer)
            entry = {"dataset_len": length, "build_s": round(seconds, 3), "changed": {}}
            for changed in a.changed:
                other, seconds, length = samples(order, changed, out, tokenizer)
                first, last = a.resume_at * GBS, min(a.train_iters, changed) * GBS
                differ = sum(x != y for x, y in zip(base[first:last], other[first:last]))
                entry["changed"][str(changed)] = {
                    "positions_compared": last - first,
                    "share_differing": round(differ / max(1, last - first), 4),
                    "dataset_len": length, "build_s": round(seconds, 3)}
            result["orders"][order] = entry
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
