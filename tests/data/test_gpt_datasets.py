"""build_datasets on a one-rank gloo group: one epoch per split, blends, bad input, identity."""

import os
import shutil

import numpy as np
import pytest

from swift_mcore.errors import ArgumentError
from swift_mcore.data.gpt_datasets import (build_datasets, dataset_fingerprint,
                                       fingerprints_match, parse_blend, samples_per_split)

from data_helpers import make_args

pytestmark = pytest.mark.usefixtures("gloo_group")


def lengths(splits):
    return [0 if d is None else len(d) for d in splits]


def test_single_prefix_one_epoch_per_split(small_prefixes, tokenizer, tmp_path):
    args = make_args(tmp_path, data_path=[small_prefixes["b"]], split="80,20,0")
    train, valid, test = build_datasets(args, tokenizer)
    assert test is None
    assert [len(train), len(valid)] == samples_per_split(small_prefixes["b"], train.config)[:2]
    assert len(train) > 100 and len(valid) > 10
    sample = train[0]
    assert sample["tokens"].shape == (32,) and sample["tokens"].dtype.is_floating_point is False
    np.testing.assert_array_equal(sample["tokens"][1:], sample["labels"][:-1])
    assert sample["position_ids"].tolist() == list(range(32))
    assert "attention_mask" not in sample
    # One epoch of the train split holds every train token once (minus the last partial one).
    n_tokens = len(train) * 32
    assert n_tokens <= train._get_num_tokens_per_epoch() < n_tokens + 33
    cache = train.config.path_to_cache  # a folder per data content under output_dir/data_cache
    assert os.path.dirname(cache) == os.path.join(args.logging.output_dir, "data_cache")
    assert any(name.endswith("shuffle_index.npy") for name in os.listdir(cache))
    # Rebuilt (from the cache) it is the same data, and train_iters plays no part.
    again = build_datasets(make_args(tmp_path, data_path=[small_prefixes["b"]], split="80,20,0",
                                     train_iters=999), tokenizer)[0]
    assert len(again) == len(train)
    assert all(np.array_equal(again[i]["tokens"], train[i]["tokens"]) for i in range(0, 100, 7))


def test_default_corpus_is_the_fallback(tokenizer, tmp_path):
    args = make_args(tmp_path, seq_length=256)
    train, valid, test = build_datasets(args, tokenizer)
    assert len(train) > 3000 and valid is not None and len(valid) > 50
    assert tokenizer.decode(train[0]["tokens"]).strip()


def blend_counts(dataset):
    ids = np.asarray(dataset.dataset_index)
    return np.bincount(ids, minlength=2)


@pytest.mark.timeout(120)  # megatron's own builder loops forever on this input
def test_weighted_blend_follows_the_weights(small_prefixes, tokenizer, tmp_path):
    a, b = small_prefixes["a"], small_prefixes["b"]
    args = make_args(tmp_path, data_path=["0.6", a, "0.4", b])  # a is the smaller: upsampled
    train, valid, test = build_datasets(args, tokenizer)
    one_epoch = [samples_per_split(p, train.config) for p in (a, b)]
    assert one_epoch[0][2] == 0  # the case that hangs megatron: a has no test document
    assert len(train) == pytest.approx(one_epoch[0][0] + one_epoch[1][0], abs=2)
    counts = blend_counts(train)
    assert counts[0] / len(train) == pytest.approx(0.6, abs=0.01)
    assert counts[0] > one_epoch[0][0]  # the smaller prefix repeats to reach its share
    sample = train[0]
    assert set(sample) >= {"tokens", "labels", "loss_mask", "position_ids", "dataset_id"}
    # The test split is b's alone (a sits it out) instead of a hang.
    assert len(test) == one_epoch[1][2] > 0 and blend_counts(valid)[0] > 0


def test_unweighted_blend_takes_each_prefix_once(small_prefixes, tokenizer, tmp_path):
    a, b = small_prefixes["a"], small_prefixes["b"]
    train, valid, test = build_datasets(make_args(tmp_path, data_path=[a, b]), tokenizer)
    one_epoch = [samples_per_split(p, train.config) for p in (a, b)]
    assert blend_counts(train).tolist() == [one_epoch[0][0], one_epoch[1][0]]
    assert len(valid) == one_epoch[0][1] + one_epoch[1][1]


@pytest.mark.parametrize("data_path, message", [
    (["0.5", "x", "y"], r"--data_path '0.5 x y' does not parse"),
    (["x", "0.5", "y", "0.5"], r"--data_path .* does not parse"),
    (["-1", "x", "1", "y"], r"--data_path weights must be positive"),
])
def test_bad_blends(data_path, message, tokenizer, tmp_path):
    with pytest.raises(ArgumentError, match=message):
        build_datasets(make_args(tmp_path, data_path=data_path), tokenizer)


def test_missing_files_are_named(small_prefixes, tokenizer, tmp_path):
    with pytest.raises(ArgumentError, match=r"--data_path: .*nowhere\.bin does not exist"):
        build_datasets(make_args(tmp_path, data_path=[str(tmp_path / "nowhere")]), tokenizer)
    lonely = tmp_path / "lonely"
    shutil.copy(small_prefixes["a"] + ".bin", str(lonely) + ".bin")
    with pytest.raises(ArgumentError, match=r"lonely\.idx does not exist"):
        build_datasets(make_args(tmp_path, data_path=["1", small_prefixes["a"], "2",
                                                      str(lonely)]), tokenizer)


def test_other_bad_inputs(small_prefixes, tokenizer, tmp_path):
    a = small_prefixes["a"]
    with pytest.raises(ArgumentError, match="--split"):
        build_datasets(make_args(tmp_path, data_path=[a], split="abc"), tokenizer)
    with pytest.raises(ArgumentError, match="--split"):
        build_datasets(make_args(tmp_path, data_path=[a], split="0,1,0"), tokenizer)
    with pytest.raises(ArgumentError, match="--seq_length"):
        build_datasets(make_args(tmp_path, data_path=[a], seq_length=10**6), tokenizer)
    with pytest.raises(ArgumentError, match="--data_path and --dataset are exclusive"):
        build_datasets(make_args(tmp_path, data_path=[a], dataset=[a + ".bin"]), tokenizer)


def test_parse_blend():
    assert parse_blend(["a"]) == (["a"], None)
    assert parse_blend(["3", "a"]) == (["a"], None)  # one weighted prefix is just a prefix
    assert parse_blend(["a", "b"]) == (["a", "b"], None)
    assert parse_blend(["1", "a", "3", "b"]) == (["a", "b"], [1.0, 3.0])


def test_fingerprint_is_the_data_not_the_path(small_prefixes, tokenizer, tmp_path):
    a, b = small_prefixes["a"], small_prefixes["b"]
    args = make_args(tmp_path, data_path=["1", a, "3", b])
    train, valid, _ = build_datasets(args, tokenizer)
    fp = dataset_fingerprint(train)
    assert fp == dataset_fingerprint(valid) == dataset_fingerprint(args, tokenizer)
    moved = tmp_path / "moved"
    moved.mkdir()
    for suffix in (".bin", ".idx"):
        shutil.copy(a + suffix, str(moved / "a") + suffix)
    # Same files elsewhere (without a's hash record), same proportions: compared on the
    # sampled hash, which a copy shares.
    def matches(data_path, split="949,50,1"):
        args = make_args(tmp_path, data_path=data_path, split=split)
        return fingerprints_match(fp, dataset_fingerprint(args, tokenizer))

    assert matches(["2", str(moved / "a"), "6", b])
    for changed in (["1", a, "2", b], [a, b], ["1", b, "3", a], [b]):
        assert not matches(changed)
    assert not matches(["1", a, "3", b], split="90,10,0")
