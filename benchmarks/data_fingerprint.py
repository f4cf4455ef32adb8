"""Data fingerprint cost: time to fingerprint one large prefix, with and without its hash record.

    .venv/bin/python benchmarks/data_fingerprint.py --gb 2 --repeats 5          # sparse .bin
    .venv/bin/python benchmarks/data_fingerprint.py --gb 2 --repeats 5 --real   # random bytes

Makes a valid .bin/.idx pair of --gb GB (uint16 tokens, documents of --doc_tokens tokens):
a sparse .bin by default (reads cost no disk I/O, so the figures are the hashing alone), or
one of random bytes with --real (read through the page cache after the first pass; cold
reads from a network file system cost more). Times, in this process with the caches
cleared before each round: the fingerprint of the prefix (`gpt_datasets.prefix_identity`:
the .idx hashed whole, 64 sampled MiB of the .bin, and the PREFIX.hash.json record if
present) without and with a record, and for comparison the full sha256 of the .bin that the
record saves reading at each start (`indexed.record_bin_hash`, what a prefix made elsewhere
pays once to get a record). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import numpy as np

import bench_common  # noqa: F401  (puts the checkout on sys.path


def make_pair(prefix: str, n_bytes: int, doc_tokens: int, real: bool) -> dict:
    from megatron.core.datasets.indexed_dataset import _IndexWriter

    n_tokens = n_bytes // 2 // doc_tokens * doc_tokens
    with open(prefix + ".bin", "wb") as fh:
        if real:
            rng = np.random.default_rng(0)
            left = n_tokens
            while left:
                step = min(left, 32 << 20)
                fh.write(rng.integers(0, 4096, step, dtype=np.uint16).tobytes())
                left -= step
        else:
            fh.truncate(n_tokens * 2)
    n_docs = n_tokens // doc_tokens
    with _IndexWriter(prefix + ".idx", np.uint16) as writer:
        writer.write([doc_tokens] * n_docs, None, list(range(n_docs + 1)))
    return {"bin_bytes": n_tokens * 2, "idx_bytes": os.path.getsize(prefix + ".idx"),
            "documents": n_docs}


def clear_caches() -> None:
    from swift_mcore.data import gpt_datasets, indexed

    for fn in (gpt_datasets._file_identity, indexed._bin_content, indexed._warn):
        fn.cache_clear()


def timed(fn) -> float:
    clear_caches()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gb", type=float, default=2.0)
    parser.add_argument("--doc_tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--real", action="store_true")
    parser.add_argument("--workdir", default=None)
    opts = parser.parse_args(argv)

    from swift_mcore.data import indexed
    from swift_mcore.data.gpt_datasets import index_identity, prefix_identity

    with tempfile.TemporaryDirectory(prefix="fingerprint_", dir=opts.workdir) as tmp:
        prefix = os.path.join(tmp, "big")
        info = make_pair(prefix, int(opts.gb * 1e9), opts.doc_tokens, opts.real)
        indexed.check_indexed(prefix)
        without, with_record, idx_only = [], [], []
        full = timed(lambda: indexed.record_bin_hash(prefix))  # also writes the record
        os.rename(prefix + indexed.HASH_SUFFIX, prefix + ".record")
        for _ in range(opts.repeats):  # alternating, so both see the same machine load
            without.append(timed(lambda: prefix_identity(prefix)))
            assert prefix_identity(prefix)[1] is None  # no record: the sampled part only
            os.rename(prefix + ".record", prefix + indexed.HASH_SUFFIX)
            with_record.append(timed(lambda: prefix_identity(prefix)))
            assert prefix_identity(prefix)[1] is not None  # the record was trusted
            os.rename(prefix + indexed.HASH_SUFFIX, prefix + ".record")
            idx_only.append(timed(lambda: index_identity(prefix)))
    result = {
        **info, "real": opts.real, "repeats": opts.repeats,
        "fingerprint_without_record_s": statistics.median(without),
        "fingerprint_with_record_s": statistics.median(with_record),
        "idx_part_only_s": statistics.median(idx_only),
        "full_sha256_once_s": full,
        "full_sha256_GB_per_s": info["bin_bytes"] / 1e9 / full,
        "sampled_MiB": min(info["bin_bytes"], indexed.SAMPLE_BLOCK * indexed.SAMPLE_BLOCKS)
        / 2 ** 20,
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
