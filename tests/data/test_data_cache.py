"""Caches: --dataset files are tokenized once per content, megatron's index files are reused
until the data changes, and the sample order is a function of (data, seed) alone."""

import itertools
import json
import os
import shutil

import pytest
import torch

from swift_mcore.data import encoding, indexed
from swift_mcore.data.gpt_datasets import build_datasets
from swift_mcore.data.loader import build_data_iterator

from data_helpers import make_args, make_documents, raw_prefix
from run_helpers import read_documents


def write_jsonl(path, texts):
    with open(path, "w", encoding="utf-8") as fh:
        fh.writelines(json.dumps({"text": t}) + "\n" for t in texts)
    return str(path)


def test_dataset_files_are_tokenized_once_per_content(tokenizer, tmp_path, fresh_cache,
                                                      monkeypatch):
    path = write_jsonl(tmp_path / "a.jsonl", ["first document", "second one"])
    prefix = raw_prefix([path], "text", tokenizer)
    info = json.loads(open(os.path.join(os.path.dirname(prefix), "info.json")).read())
    assert info["documents"] == 2 and info["sources"] == [path]

    def no_tokenizing(*args, **kwargs):
        raise AssertionError("the cached tokens should have been used")

    with monkeypatch.context() as m:
        m.setattr(encoding, "encode_sources", no_tokenizing)
        assert raw_prefix([path], "text", tokenizer) == prefix
        os.utime(path, (1, 1))  # a new timestamp, same bytes
        assert raw_prefix([path], "text", tokenizer) == prefix
        copy = shutil.copy(path, tmp_path / "copy.jsonl")  # same bytes elsewhere
        assert raw_prefix([copy], "text", tokenizer) == prefix
    write_jsonl(path, ["first document", "an edited second one"])
    edited = raw_prefix([path], "text", tokenizer)
    assert edited != prefix
    assert [tokenizer.decode(d[:-1]) for d in read_documents(edited)] == [
        "first document", "an edited second one"]
    # Another column or tokenizer of the same files is another cache entry too.
    write_jsonl(path, [""])
    with pytest.raises(Exception, match="holds no text"):
        raw_prefix([path], "text", tokenizer)
    assert sorted(p.name for p in (fresh_cache / "datasets").iterdir()
                  for p in p.iterdir() if ".tmp-" in p.name) == []


def samples(dataset, n=40):
    return torch.stack([torch.as_tensor(dataset[i]["tokens"]) for i in range(n)])


def index_files(folder):
    return {name: os.stat(os.path.join(folder, name)).st_mtime_ns
            for name in os.listdir(folder) if name.endswith(".npy")}


@pytest.mark.usefixtures("gloo_group")
def test_index_cache_is_reused_and_follows_the_data(tokenizer, tmp_path):
    prefix = str(tmp_path / "data")
    indexed.write_indexed(make_documents(300, seed=1), tokenizer, prefix)
    args = make_args(tmp_path, data_path=[prefix], split="90,10,0")
    train = build_datasets(args, tokenizer)[0]
    folder = train.config.path_to_cache
    built = index_files(folder)
    assert len(built) == 3 * 2  # document, sample and shuffle index of train and valid
    first = samples(train)
    again = build_datasets(args, tokenizer)[0]
    assert again.config.path_to_cache == folder and index_files(folder) == built  # not rebuilt
    assert torch.equal(samples(again), first)

    # The same prefix rewritten in place with other documents: megatron's own cache key
    # (the path, split, seed, length) is unchanged, ours is not.
    indexed.write_indexed(make_documents(260, seed=2), tokenizer, prefix)
    changed = build_datasets(args, tokenizer)[0]
    fresh = build_datasets(make_args(tmp_path / "elsewhere", data_path=[prefix],
                                     split="90,10,0"), tokenizer)[0]
    assert len(changed) == len(fresh) != len(train)
    assert torch.equal(samples(changed), samples(fresh))
    assert changed.config.path_to_cache != folder


@pytest.mark.usefixtures("gloo_group")
def test_sample_order_depends_on_the_seed_only(small_prefixes, tokenizer, tmp_path):
    blend = ["0.7", small_prefixes["a"], "0.3", small_prefixes["b"]]

    def stream(out, seed):
        args = make_args(tmp_path / out, data_path=blend, seed=seed)
        train = build_datasets(args, tokenizer)[0]
        batches = itertools.islice(build_data_iterator(train, 0, args), 30)
        return torch.cat([b["tokens"] for b in batches])

    first = stream("one", 1234)
    assert torch.equal(stream("two", 1234), first)  # a separate cache, the same order
    assert not torch.equal(stream("three", 99), first)


@pytest.mark.parametrize("plant", ["symlink", "fifo"])
def test_a_link_planted_as_the_cache_lock_is_refused_and_its_target_kept(tmp_path, plant):
    from swift_mcore.cache import locked
    from swift_mcore.errors import OutputError

    folder = tmp_path / "shared_cache"
    folder.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    if plant == "symlink":
        os.symlink(victim, folder / ".lock")
    else:
        os.mkfifo(folder / ".lock")
    with pytest.raises(OutputError, match=r"\.lock: .*(remove it)"):
        with locked(str(folder)):
            pytest.fail("the lock was taken through the planted file")
    assert victim.read_text() == "keep me"
