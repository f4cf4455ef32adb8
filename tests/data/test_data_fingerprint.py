"""The data fingerprint covers the .bin tokens: the sha256 recorded while writing (trusted only
while the .bin's size and mtime match it), else sampled blocks at fixed offsets; two
fingerprints compare on the strongest part both have."""

import hashlib
import json
import logging
import os
import shutil

import numpy as np
import pytest

from swift_mcore.data import indexed
from swift_mcore.data.gpt_datasets import (dataset_fingerprint, fingerprints_match,
                                           index_cache_path, index_identity)

from data_helpers import make_args, make_documents
from run_helpers import replace_tokens


def sha256_file(path):
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


@pytest.fixture
def prefix(tokenizer, tmp_path):
    prefix = str(tmp_path / "data" / "corpus")
    indexed.write_indexed(make_documents(40, seed=3), tokenizer, prefix)
    return prefix


def test_the_writer_records_the_bin_sha256_as_it_writes(prefix):
    record = json.loads(open(prefix + indexed.HASH_SUFFIX).read())
    stat = os.stat(prefix + ".bin")
    assert record == {"file": "corpus.bin", "bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns,
                      "sha256": sha256_file(prefix + ".bin")}
    sampled, full = indexed.bin_content(prefix)
    assert full == record["sha256"]
    # A small .bin fits the sampled blocks: it is hashed whole, with its size.
    assert sampled == indexed.sampled_bin_hash(prefix + ".bin", stat.st_size) != full


def test_sampled_hash_reads_fixed_blocks(tmp_path):
    path = str(tmp_path / "x.bin")
    size, block, blocks = 64 * 1024, 1024, 5  # first, last and 3 evenly spaced blocks
    original = np.random.default_rng(0).bytes(size)

    def hashed(data):
        with open(path, "wb") as fh:
            fh.write(data)
        return indexed.sampled_bin_hash(path, len(data), block=block, blocks=blocks)

    base = hashed(original)
    assert hashed(original) == base

    def edited(offset):
        data = bytearray(original)
        data[offset] ^= 0xFF
        return hashed(bytes(data))

    starts = [i * (size - block) // (blocks - 1) for i in range(blocks)]
    assert starts[0] == 0 and starts[-1] == size - block
    for start in starts:  # the first and the last byte of each block
        assert edited(start) != base and edited(start + block - 1) != base, start
    assert edited(8000) == base  # between blocks: missed (docs/data.md says so)
    assert hashed(original + b"\0\0") != base  # another size
    assert indexed.sampled_bin_hash(path, size) != base  # other parameters


def test_a_stale_or_broken_record_is_not_trusted(prefix, caplog):
    recorded = indexed.bin_content(prefix)
    replace_tokens(prefix, in_place=True)  # another tool edits the .bin: mtime changes
    with caplog.at_level(logging.WARNING, logger="swift_mcore"):
        sampled, full = indexed.bin_content(prefix)
    assert full is None and sampled != recorded[0]
    assert "changed after" in caplog.text and prefix + indexed.HASH_SUFFIX in caplog.text
    # Re-recorded in one pass, it is trusted again.
    assert indexed.record_bin_hash(prefix) == sha256_file(prefix + ".bin")
    assert indexed.bin_content(prefix) == (sampled, sha256_file(prefix + ".bin"))
    for broken in ("{not json", json.dumps({"sha256": "abc"}), "[]"):
        with open(prefix + indexed.HASH_SUFFIX, "w") as fh:
            fh.write(broken)
        assert indexed.bin_content(prefix) == (sampled, None), broken


def parts(fingerprint):
    version, sampled, full, legacy = fingerprint.split(":")
    return sampled, None if full == "-" else full


def test_fingerprint_follows_the_tokens(prefix, tokenizer, tmp_path):
    args = make_args(tmp_path, data_path=[prefix])
    before = dataset_fingerprint(args, tokenizer)
    assert type(before) is str and parts(before)[1] is not None
    idx, size, cache = (open(prefix + ".idx", "rb").read(), os.path.getsize(prefix + ".bin"),
                        index_cache_path(args, [prefix]))

    replace_tokens(prefix)  # rewritten by the writer: same lengths, a new sha256 recorded
    assert open(prefix + ".idx", "rb").read() == idx and os.path.getsize(prefix + ".bin") == size
    after = dataset_fingerprint(args, tokenizer)
    assert parts(after)[1] is not None and parts(after)[1] != parts(before)[1]
    assert not fingerprints_match(before, after) and not fingerprints_match(after, before)
    assert index_cache_path(args, [prefix]) == cache  # the index arrays depend on lengths only

    # The same files elsewhere without their record: compared on the sampled part.
    copy = str(tmp_path / "copy" / "corpus")
    os.makedirs(os.path.dirname(copy))
    for suffix in (".bin", ".idx"):
        shutil.copy(prefix + suffix, copy + suffix)
    copied = dataset_fingerprint(make_args(tmp_path, data_path=[copy]), tokenizer)
    assert parts(copied)[1] is None
    assert fingerprints_match(after, copied) and fingerprints_match(copied, after)
    assert not fingerprints_match(before, copied)


def test_matching_compares_the_strongest_common_part():
    s, f, legacy = "s" * 32, "f" * 32, "l" * 32
    now = f"2:{s}:{f}:{legacy}"
    assert fingerprints_match(now, now)
    assert not fingerprints_match(f"2:{s}:{'e' * 32}:{legacy}", now)  # edit between samples
    assert fingerprints_match(f"2:{s}:-:{legacy}", now)  # saved without a record: sampled
    assert not fingerprints_match(f"2:{'t' * 32}:-:{legacy}", now)
    assert fingerprints_match(legacy + "0" * 32, now)  # saved by the version before
    for saved in ("m" * 64, None, 3, "2:x", f"3:{s}:-:{legacy}", f"2:{s}:-"):
        assert not fingerprints_match(saved, now), saved
    assert fingerprints_match(now, f"2:{s}:-:{legacy}")  # now without a record
    # Other fingerprints (finetuning data) must be equal.
    assert fingerprints_match("abc:train", "abc:train")
    assert not fingerprints_match("abc:train", "abd:train")


def test_legacy_part_is_the_fingerprint_of_the_version_before(prefix, tokenizer, tmp_path):
    """What swift-mcore computed before the .bin was covered, restated: a checkpoint saved
    by it resumes on the same .idx (it never recorded the tokens)."""
    from swift_mcore.data.gpt_datasets import gpt_config, resolve_blend

    args = make_args(tmp_path, data_path=["1", prefix, "3", prefix])
    fp = dataset_fingerprint(args, tokenizer)
    split = gpt_config(args, tokenizer, resolve_blend(args, tokenizer)).split_matrix
    identity = f"{sha256_file(prefix + '.idx')}:{os.path.getsize(prefix + '.bin')}"
    assert index_identity(prefix) == identity
    old = {"version": 1, "data": [identity, identity], "weights": [0.25, 0.75],
           "split": split, "tokenizer": tokenizer.fingerprint}
    saved_then = hashlib.sha256(json.dumps(old, sort_keys=True).encode()).hexdigest()
    assert fingerprints_match(saved_then, fp)
    replace_tokens(prefix)  # what the version before could not see
    assert fingerprints_match(saved_then, dataset_fingerprint(args, tokenizer))
