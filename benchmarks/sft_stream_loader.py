"""sft loaders' throughput: the --streaming loader (read, shuffle, encode, pack on the fly)
against the token cache's loader (rows mapped from a warm cache), in the same run.

    .venv/bin/python benchmarks/sft_stream_loader.py --rows 20000 --batches 200 --repeats 3

--rows random ChatML conversations (a 12-40-word question, a 20-120-word answer, as
sft_token_cache.py writes them) in a jsonl file; --seq_length 512, --packing, micro-batch
4, global batch 16, one rank. Each loader is the trainer's own (build_stream_iterator,
build_data_iterator over build_sft_datasets' rows), in this process (--num_workers 0: one
worker's work), drained for --batches micro-batches; the rounds alternate. Real tokens
per second (padding not counted) and the streaming loader's ratio to the cached one; also
the ratio of the streaming rate to 50,000 tokens/s, the training rate of a 1B model on one
H200 the issue names (a figure, not measured here). Also the streaming loader's CPU
seconds (time.process_time, all threads) for the same batches when it tokenizes one drawn
row per call against streaming.ENCODE_ROWS rows per call, and their ratio (the rows are
the same either way: tests/sft/test_sft_streaming.py). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import bench_common  # noqa: F401  (the checkout on sys.path)
from sft_token_cache import write_rows

TRAINING_RATE_1B_H200 = 50_000  # tokens/s


def drain(iterator, batches: int) -> float:
    """Real tokens per second over ``batches`` micro-batches."""
    tokens = 0
    start = time.perf_counter()
    for _ in range(batches):
        tokens += int(next(iterator)["num_tokens"])
    return tokens / (time.perf_counter() - start)


def stream_cpu(stream, config, batches: int, encode_rows: int) -> float:
    """CPU seconds (time.process_time: every thread of this process, the tokenizer's
    included) the streaming loader spends on ``batches`` micro-batches when it tokenizes
    ``encode_rows`` drawn rows per call (streaming.ENCODE_ROWS)."""
    from swift_mcore.data import streaming

    saved, streaming.ENCODE_ROWS = streaming.ENCODE_ROWS, encode_rows
    try:
        iterator = streaming.build_stream_iterator(stream, 0, None, config)
        start = time.process_time()
        for _ in range(batches):
            next(iterator)
        return time.process_time() - start
    finally:
        streaming.ENCODE_ROWS = saved


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seq_length", type=int, default=512)
    parser.add_argument("--shuffle_buffer_size", type=int, default=1000)
    cli = parser.parse_args()

    from swift_mcore.arguments import SftArguments
    from swift_mcore.data import build_data_iterator, default_tokenizer
    from swift_mcore.data.sft_datasets import build_sft_datasets
    from swift_mcore.data.streaming import ENCODE_ROWS, build_stream_iterator
    from swift_mcore.run_config import resolve

    tokenizer = default_tokenizer()
    out = {"rows": cli.rows, "batches": cli.batches, "seq_length": cli.seq_length}
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["SWIFT_MCORE_CACHE"] = os.path.join(tmp, "cache")
        path = os.path.join(tmp, "chats.jsonl")
        write_rows(path, cli.rows)

        def config(**flags):
            return resolve(SftArguments.from_flags(
                dataset=[path], seq_length=cli.seq_length, template="chatml", packing=True,
                micro_batch_size=4, global_batch_size=16, num_workers=0, train_iters=100,
                **flags), world_size=1, cuda=False)

        cached_config = config()
        cached = build_sft_datasets(cached_config, tokenizer, log=lambda s: None)[0]
        streaming_config = config(streaming=True,
                                  shuffle_buffer_size=cli.shuffle_buffer_size)
        stream = build_sft_datasets(streaming_config, tokenizer, log=lambda s: None)[0]
        rates = {"streaming": [], "cached": []}
        cpu = {1: [], ENCODE_ROWS: []}
        for _ in range(cli.repeats):
            rates["streaming"].append(drain(
                build_stream_iterator(stream, 0, None, streaming_config), cli.batches))
            rates["cached"].append(drain(
                build_data_iterator(cached, 0, cached_config), cli.batches))
            for rows in cpu:
                cpu[rows].append(stream_cpu(stream, streaming_config, cli.batches, rows))
    for name, values in rates.items():
        out[f"{name}_tokens_per_s"] = [round(v) for v in values]
        out[f"{name}_median"] = round(statistics.median(values))
    out["streaming_vs_cached"] = round(out["streaming_median"] / out["cached_median"], 4)
    out["streaming_vs_1b_h200_training"] = round(
        out["streaming_median"] / TRAINING_RATE_1B_H200, 4)
    # tokenizing several drawn rows per call against one per call: CPU, not wall time
    out["stream_cpu_s_one_row_per_call"] = [round(v, 3) for v in cpu[1]]
    out[f"stream_cpu_s_{ENCODE_ROWS}_rows_per_call"] = [round(v, 3) for v in cpu[ENCODE_ROWS]]
    out["stream_cpu_batched_vs_one_row"] = round(
        statistics.median(cpu[ENCODE_ROWS]) / max(statistics.median(cpu[1]), 1e-9), 4)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
