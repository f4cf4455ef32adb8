"""Indexed .bin/.idx: exact round trip via megatron, atomic writes, cached corpora, raw files."""

import json
import os

import numpy as np
import pytest
from megatron.core.datasets.indexed_dataset import IndexedDataset

from swift_mcore.errors import ArgumentError
from swift_mcore.data import corpus, indexed, token_cache, sources

from data_helpers import make_documents, raw_prefix


def test_round_trip_through_megatron(tokenizer, tmp_path):
    docs = make_documents(30, seed=7) + [""] + ["x = 1  # ✓ ünïcode\n"]
    prefix = str(tmp_path / "data")
    stats = indexed.write_indexed(docs, tokenizer, prefix)
    expected = [tokenizer.encode(d) + [tokenizer.eod] for d in docs if d]  # empty doc skipped
    assert stats == {"documents": len(expected), "tokens": sum(map(len, expected))}
    ds = IndexedDataset(prefix)
    assert len(ds) == len(expected)
    assert ds.index.dtype == np.uint16  # 4096 tokens fit in two bytes
    for i, ids in enumerate(expected):
        assert ds[i].tolist() == ids
    assert tokenizer.decode(ds[len(ds) - 1][:-1]) == docs[-1]
    assert sorted(os.listdir(tmp_path)) == ["data.bin", "data.hash.json", "data.idx"]


def test_failed_rewrite_keeps_the_old_pair(tokenizer, tmp_path):
    prefix = str(tmp_path / "data")
    indexed.write_indexed(["first version"], tokenizer, prefix)

    def broken():
        yield "a document"
        raise RuntimeError("the source died halfway")

    with pytest.raises(RuntimeError, match="halfway"):
        indexed.write_indexed(broken(), tokenizer, prefix)
    assert sorted(os.listdir(tmp_path)) == ["data.bin", "data.hash.json", "data.idx"]  # no temps
    ds = IndexedDataset(prefix)  # held: megatron's arrays are views that die with it (segfault)
    assert ds[0].tolist() == tokenizer.encode("first version") + [tokenizer.eod]


def test_nothing_to_write_is_an_error(tokenizer, tmp_path):
    with pytest.raises(ValueError, match="no non-empty documents"):
        indexed.write_indexed(["", ""], tokenizer, str(tmp_path / "empty"))


def test_default_corpus_is_tokenized_once(tokenizer, fresh_cache, monkeypatch):
    prefix = token_cache.default_corpus_prefix(tokenizer)
    assert prefix.startswith(str(fresh_cache))
    info = json.loads(open(os.path.join(os.path.dirname(prefix), "info.json")).read())
    assert info["tokens"] > 500_000

    def no_write(*args, **kwargs):
        raise AssertionError("the cached corpus should have been used")

    monkeypatch.setattr(indexed, "write_indexed", no_write)
    assert token_cache.default_corpus_prefix(tokenizer) == prefix
    ds = IndexedDataset(prefix)
    first = next(d for d in corpus.iter_documents() if d)
    assert ds[0].tolist() == tokenizer.encode(first) + [tokenizer.eod]


def write_raw(folder):
    folder.mkdir()
    (folder / "a.jsonl").write_text('{"text": "one"}\n\n{"text": "two", "id": 2}\n')
    (folder / "b.json").write_text(json.dumps([{"text": "three"}, {"text": "four"}]))
    (folder / "c.csv").write_text('text,other\n"five, with comma",x\nsix,y\n')
    (folder / "d.txt").write_text("seven\neight\n")
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["nine", "ten"]}), str(folder / "e.parquet"))


def test_raw_files_every_format(tokenizer, tmp_path, fresh_cache):
    write_raw(tmp_path / "raw")
    found = sources.expand_inputs([str(tmp_path / "raw")], flag="--dataset")
    assert [os.path.basename(s.path) for s in found] == ["a.jsonl", "b.json", "c.csv", "d.txt",
                                                         "e.parquet"]
    texts = [t for s in found for batch in sources.iter_texts(s, "text") for t in batch]
    assert texts == ["one", "two", "three", "four", "five, with comma", "six", "seven", "eight",
                     "nine", "ten"]
    prefix = raw_prefix([str(tmp_path / "raw" / "*")], "text", tokenizer)
    ds = IndexedDataset(prefix)
    assert [tokenizer.decode(ds[i][:-1]) for i in range(len(ds))] == texts
    assert raw_prefix([str(tmp_path / "raw")], "text", tokenizer) == prefix


def test_raw_file_errors_name_the_flag(tokenizer, tmp_path, fresh_cache):
    with pytest.raises(ArgumentError, match=r"--dataset .*missing.jsonl: no such file"):
        sources.expand_inputs([str(tmp_path / "missing.jsonl")], flag="--dataset")
    (tmp_path / "data.xml").write_text("<a/>")
    with pytest.raises(ArgumentError, match=r"--dataset .*data.xml: unsupported file type"):
        sources.expand_inputs([str(tmp_path / "data.xml")], flag="--dataset")
    (tmp_path / "data.jsonl").write_text('{"content": "x"}\n')
    with pytest.raises(ArgumentError, match=r"data.jsonl: no 'text' column.*--text_key"):
        raw_prefix([str(tmp_path / "data.jsonl")], "text", tokenizer)
    assert raw_prefix([str(tmp_path / "data.jsonl")], "content", tokenizer)
    # Refused when the run is resolved, before any process group or model exists.
    from swift_mcore.arguments import RunArguments
    from swift_mcore.run_config import resolve

    (tmp_path / "empty.jsonl").write_text("")
    for name, message in (("empty.jsonl", r"--dataset .*empty\.jsonl: is empty \(0 bytes\)"),
                          ("data.xml", r"--dataset .*data\.xml: unsupported file type")):
        args = RunArguments.from_flags(dataset=[str(tmp_path / name)])
        with pytest.raises(ArgumentError, match=message):
            resolve(args, world_size=1, cuda=False)


# ---- whole-pair checks ------------------------------------------------------------------

def corrupt(prefix, how):
    idx, bin_ = prefix + ".idx", prefix + ".bin"
    data = bytearray(open(idx, "rb").read())
    if how == "idx cut":
        data = data[:-8]
    elif how == "idx empty":
        data = b""
    elif how == "bad header":
        data[:7] = b"NOTIDX!"
    elif how == "version":
        data[9] = 2
    elif how == "pointers":
        n_seq = int.from_bytes(data[18:26], "little")
        at = 34 + 4 * n_seq + 8  # the second sequence pointer
        data[at:at + 8] = (10**6).to_bytes(8, "little")
    elif how == "bin cut":
        with open(bin_, "r+b") as fh:
            fh.truncate(os.path.getsize(bin_) - 2)
    elif how == "bin longer":
        with open(bin_, "ab") as fh:
            fh.write(b"\0\0")
    if how.startswith(("idx", "bad", "version", "pointers")):
        open(idx, "wb").write(bytes(data))


CORRUPTIONS = {
    "idx cut": r"data\.idx is truncated or corrupted: \d+ bytes, but its header describes",
    "idx empty": r"data\.idx is truncated: 0 bytes",
    "bad header": r"data\.idx is not a megatron index file",
    "version": r"data\.idx has format version 2",
    "pointers": r"data\.idx is corrupted: its sequence lengths and offsets disagree",
    "bin cut": r"data\.bin is truncated: \d+ bytes, but .*data\.idx describes",
    "bin longer": r"data\.bin is longer than its index says",
}


@pytest.mark.parametrize("how", sorted(CORRUPTIONS))
def test_corrupted_pairs_are_refused_at_validation(how, tokenizer, tmp_path):
    from swift_mcore.arguments import RunArguments
    from swift_mcore.run_config import resolve

    prefix = str(tmp_path / "data")
    indexed.write_indexed(make_documents(5, seed=2), tokenizer, prefix)
    assert indexed.check_indexed(prefix) == {"documents": 5, "sequences": 5, "dtype": "uint16",
                                             "tokens": len(np.fromfile(prefix + ".bin",
                                                                       np.uint16))}
    corrupt(prefix, how)
    with pytest.raises(ArgumentError, match=r"--data_path: .*" + CORRUPTIONS[how]):
        indexed.check_indexed(prefix)
    # resolve refuses it: before any process group or model exists.
    args = RunArguments.from_flags(data_path=["0.5", prefix, "0.5", prefix],
                                        output_dir=str(tmp_path / "out"))
    with pytest.raises(ArgumentError, match=CORRUPTIONS[how]):
        resolve(args, world_size=1, cuda=False)


def test_a_pair_without_documents_is_refused(tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = str(tmp_path / "none")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    builder.finalize(prefix + ".idx")
    with pytest.raises(ArgumentError, match=r"none\.idx holds no documents"):
        indexed.check_indexed(prefix)


def test_data_from_another_tokenizer_is_refused(tokenizer, tmp_path):
    prefix = str(tmp_path / "big_vocab")
    with indexed.IndexedWriter(prefix, np.int32) as writer:
        writer.add_documents(np.array([5, 70000, 3], dtype=np.int32), np.array([2, 1]))
        writer.commit()
    with pytest.raises(ArgumentError, match=r"big_vocab\.bin holds token id 70000, but the "
                                            r"tokenizer has only 4096 tokens.*--tokenizer"):
        indexed.check_token_range(prefix, tokenizer.vocab_size)
    # The sampled check of large files still sees ids spread through the data.
    big = str(tmp_path / "big")
    ids = np.arange(1 << 20, dtype=np.int32) % 5000
    with indexed.IndexedWriter(big, np.int32) as writer:
        writer.add_documents(ids, np.array([ids.size]))
        writer.commit()
    assert indexed.max_token_id(big, budget=1 << 16) >= 4096
    assert indexed.max_token_id(big) == 4999


def test_cli_refuses_a_truncated_pair_before_any_work(tokenizer, tmp_path):
    import subprocess
    import sys

    prefix = str(tmp_path / "data")
    indexed.write_indexed(make_documents(5, seed=2), tokenizer, prefix)
    corrupt(prefix, "bin cut")
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "swift_mcore", "pt", "--data_path", prefix, "--output_dir",
         str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert f"--data_path: {prefix}.bin is truncated" in proc.stderr
    assert not out.exists()
