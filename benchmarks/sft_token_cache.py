"""sft start-up with the token cache: tokenizing every run (the old path) against a cold
build (1 and N processes) and a warm start that maps the cache.

    .venv/bin/python benchmarks/sft_token_cache.py --rows 100000 --num_proc 1 2

--rows random conversations (a 12-40-word question, a 20-120-word answer, ChatML) are
written to a jsonl file in a temporary folder, with a fresh $SWIFT_MCORE_CACHE per build.
Measured in this process: ``uncached``, reading and encoding in memory as every run did
before the cache; ``cold[N]``, build_sft_datasets into an empty cache with
--dataset_num_proc N; ``warm``, build_sft_datasets again (hash the file, map the arrays,
fit, pack; the file's hash is not remembered from
the cold builds); ``warm_folder``, from a `preprocess sft` folder (no file hashing). Prints one
JSON line (seconds, conversations/s, tokens).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time

import bench_common  # noqa: F401  (the checkout on sys.path)

WORDS = ("alpha beta gamma delta river stone cloud paper orange silver seven north table "
         "window garden music letter winter summer bridge").split()


def write_rows(path: str, count: int, seed: int = 0) -> None:
    rng = random.Random(seed)

    def text(lo, hi):
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))

    with open(path, "w", encoding="utf-8") as fh:
        for _ in range(count):
            fh.write(json.dumps({"messages": [
                {"role": "user", "content": text(12, 40)},
                {"role": "assistant", "content": text(20, 120)}]}) + "\n")


def timed(fn):
    start = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--num_proc", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--seq_length", type=int, default=512)
    parser.add_argument("--no_uncached", action="store_true",
                        help="skip tokenizing in memory (at 1M rows: minutes, and the whole "
                             "encoded set in memory)")
    cli = parser.parse_args()

    from swift_mcore.arguments import SftArguments
    from swift_mcore.data import default_tokenizer
    from swift_mcore.data.conversations import read_conversations
    from swift_mcore.data.sft_datasets import build_sft_datasets, encode_conversations
    from swift_mcore.data.sources import _content_fingerprint, expand_inputs
    from swift_mcore.data.templates import Template
    from swift_mcore.preprocess import preprocess_sft
    from swift_mcore.run_config import resolve

    tokenizer = default_tokenizer()
    out = {"rows": cli.rows, "cores": len(os.sched_getaffinity(0))}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "chats.jsonl")
        write_rows(path, cli.rows)

        def args(**flags):
            return resolve(SftArguments.from_flags(seq_length=cli.seq_length, template="chatml",
                                                   packing=True, **flags),
                           world_size=1, cuda=False)

        def uncached():
            convs = read_conversations(expand_inputs([path], "--dataset"), {})
            return encode_conversations(convs, Template("chatml", tokenizer), cli.seq_length,
                                        "drop", "all_turns")

        if not cli.no_uncached:
            encoded, out["uncached_s"] = timed(uncached)
            out["tokens"] = int(encoded.positions().sum() + len(encoded))
        for n in cli.num_proc:
            os.environ["SWIFT_MCORE_CACHE"] = os.path.join(tmp, f"cache{n}")
            _, out[f"cold_s[{n}]"] = timed(lambda: build_sft_datasets(
                args(dataset=[path], dataset_num_proc=n), tokenizer, log=lambda s: None))
        events = []
        _content_fingerprint.cache_clear()  # a new run hashes the file again
        _, out["warm_s"] = timed(lambda: build_sft_datasets(
            args(dataset=[path]), tokenizer, log=lambda s: None, on_cache=events.append))
        assert events[0] == "reused", events  # (then the packing plan's own event)
        folder = os.path.join(tmp, "prepared")
        preprocess_sft(resolve(SftArguments.from_flags(
            dataset=[path], template="chatml", output_dir=folder), world_size=1, cuda=False))
        _, out["warm_folder_s"] = timed(lambda: build_sft_datasets(
            args(cached_dataset=folder), tokenizer, log=lambda s: None))
    if "uncached_s" in out:
        out["uncached_conversations_per_s"] = cli.rows / out["uncached_s"]
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in out.items()}))


if __name__ == "__main__":
    main()
