"""Indexed .bin/.idx: exact round trip via megatron, atomic writes, cached corpora, raw files."""

import json
import os
import time

import numpy as np
import pytest
from megatron.core.datasets.indexed_dataset import IndexedDataset

from swift_mcore.arguments import ArgumentError
from swift_mcore.data import corpus, indexed

from data_helpers import make_documents


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
    assert sorted(os.listdir(tmp_path)) == ["data.bin", "data.idx"]


def test_failed_rewrite_keeps_the_old_pair(tokenizer, tmp_path):
    prefix = str(tmp_path / "data")
    indexed.write_indexed(["first version"], tokenizer, prefix)

    def broken():
        yield "a document"
        raise RuntimeError("the source died halfway")

    with pytest.raises(RuntimeError, match="halfway"):
        indexed.write_indexed(broken(), tokenizer, prefix)
    assert sorted(os.listdir(tmp_path)) == ["data.bin", "data.idx"]  # no temp files left
    ds = IndexedDataset(prefix)  # held: megatron's arrays are views that die with it (segfault)
    assert ds[0].tolist() == tokenizer.encode("first version") + [tokenizer.eod]


def test_nothing_to_write_is_an_error(tokenizer, tmp_path):
    with pytest.raises(ValueError, match="no non-empty documents"):
        indexed.write_indexed(["", ""], tokenizer, str(tmp_path / "empty"))


def test_default_corpus_is_tokenized_once(tokenizer, fresh_cache, monkeypatch):
    start = time.perf_counter()
    prefix = indexed.default_corpus_prefix(tokenizer)
    elapsed = time.perf_counter() - start
    assert elapsed < 30, f"tokenizing the embedded corpus took {elapsed:.1f}s"
    assert prefix.startswith(str(fresh_cache))
    info = json.loads(open(os.path.join(os.path.dirname(prefix), "info.json")).read())
    assert info["tokens"] > 500_000

    def no_write(*args, **kwargs):
        raise AssertionError("the cached corpus should have been used")

    monkeypatch.setattr(indexed, "write_indexed", no_write)
    assert indexed.default_corpus_prefix(tokenizer) == prefix
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
    files = indexed.expand_raw_files([str(tmp_path / "raw")])
    texts = [t for f in files for t in indexed.read_raw_documents(f)]
    assert texts == ["one", "two", "three", "four", "five, with comma", "six", "seven", "eight",
                     "nine", "ten"]
    prefix = indexed.raw_files_prefix([str(tmp_path / "raw" / "*")], "text", tokenizer)
    ds = IndexedDataset(prefix)
    assert [tokenizer.decode(ds[i][:-1]) for i in range(len(ds))] == texts
    assert indexed.raw_files_prefix([str(tmp_path / "raw")], "text", tokenizer) == prefix


def test_raw_file_errors_name_the_flag(tokenizer, tmp_path, fresh_cache):
    with pytest.raises(ArgumentError, match=r"--dataset .*missing.jsonl: no such file"):
        indexed.expand_raw_files([str(tmp_path / "missing.jsonl")])
    (tmp_path / "data.xml").write_text("<a/>")
    with pytest.raises(ArgumentError, match=r"--dataset .*data.xml: unsupported"):
        indexed.expand_raw_files([str(tmp_path / "data.xml")])
    (tmp_path / "data.jsonl").write_text('{"content": "x"}\n')
    with pytest.raises(ArgumentError, match=r"no 'text' field.*--text_key"):
        indexed.raw_files_prefix([str(tmp_path / "data.jsonl")], "text", tokenizer)
    assert indexed.raw_files_prefix([str(tmp_path / "data.jsonl")], "content", tokenizer)
