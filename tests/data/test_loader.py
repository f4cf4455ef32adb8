"""Micro-batch iterators: contents, dtypes, resume, data-parallel split and worker independence."""

import itertools

import pytest
import torch

from swift_mcore.data.gpt_datasets import build_datasets
from swift_mcore.data.loader import build_data_iterator
from swift_mcore.data.sampler import GlobalOrder

from data_helpers import make_args

pytestmark = pytest.mark.usefixtures("gloo_group")
MBS, GBS = 2, 8


@pytest.fixture(scope="module")
def setup(small_prefixes, tokenizer, tmp_path_factory):
    args = make_args(tmp_path_factory.mktemp("loader"), data_path=[small_prefixes["a"]],
                     micro_batch_size=MBS, global_batch_size=GBS)
    train, valid, test = build_datasets(args, tokenizer)
    return args, train, valid


def take(iterator, n):
    return list(itertools.islice(iterator, n))


def test_batch_contents(setup):
    args, train, _ = setup
    order = GlobalOrder(len(train), args.training.seed)
    batches = take(build_data_iterator(train, 0, args), 6)
    for i, batch in enumerate(batches):
        assert batch["tokens"].shape == batch["labels"].shape == (MBS, 32)
        assert batch["position_ids"].shape == batch["loss_mask"].shape == (MBS, 32)
        assert [batch[k].dtype for k in ("tokens", "labels", "position_ids", "loss_mask",
                                         "sample_ids")] == [torch.int64] * 3 + [torch.float32,
                                                                                torch.int64]
        assert batch["sample_ids"].tolist() == [2 * i, 2 * i + 1]
        for row, position in enumerate(batch["sample_ids"].tolist()):
            expected = train[order[position]]
            assert torch.equal(batch["tokens"][row], expected["tokens"])
            assert torch.equal(batch["labels"][row], expected["labels"])


def test_resume_continues_the_stream(setup):
    args, train, _ = setup
    n_epoch_batches = len(train) // MBS + 3  # run past an epoch boundary
    full = take(build_data_iterator(train, 0, args), n_epoch_batches)
    k = 5
    resumed = take(build_data_iterator(train, k * GBS, args), n_epoch_batches - k * GBS // MBS)
    assert all(torch.equal(x["tokens"], y["tokens"]) and torch.equal(x["sample_ids"],
                                                                      y["sample_ids"])
               for x, y in zip(full[k * GBS // MBS:], resumed))
    ids = torch.cat([b["sample_ids"] for b in full])
    assert ids.tolist() == list(range(len(ids)))


def test_two_dp_ranks_read_the_same_global_batches(setup):
    args, train, _ = setup
    n_iters = 4
    single = take(build_data_iterator(train, 0, args, 0, 1), n_iters * GBS // MBS)
    ranks = [take(build_data_iterator(train, 0, args, r, 2), n_iters * GBS // (MBS * 2))
             for r in range(2)]
    per_iter = GBS // (MBS * 2)
    for it in range(n_iters):
        whole = single[2 * it * per_iter:2 * (it + 1) * per_iter]
        expected = torch.cat([b["tokens"] for b in whole])
        got = torch.cat([b["tokens"] for r in range(2)
                         for b in ranks[r][it * per_iter:(it + 1) * per_iter]])
        assert torch.equal(got, expected)


def test_workers_do_not_change_batches(setup, small_prefixes, tmp_path):
    args, train, _ = setup
    in_process = take(build_data_iterator(train, GBS, args), 10)
    assert args.data.num_workers == 0
    # The same run with two loader workers (a resolved config is read-only: resolve again).
    workers = make_args(tmp_path, data_path=[small_prefixes["a"]], micro_batch_size=MBS,
                        global_batch_size=GBS, num_workers=2)
    assert workers.data.num_workers == 2
    with_workers = take(build_data_iterator(train, GBS, workers), 10)
    for x, y in zip(in_process, with_workers):
        assert all(torch.equal(x[k], y[k]) for k in x)


def test_seed_offset_and_empty_splits(setup):
    args, train, valid = setup
    base = next(build_data_iterator(valid, 0, args))["tokens"]
    other = next(build_data_iterator(valid, 0, args, seed_offset=1))["tokens"]
    assert not torch.equal(base, other)
    assert build_data_iterator(None, 0, args) is None
    with pytest.raises(ValueError, match="multiple of global_batch_size"):
        build_data_iterator(train, GBS + 1, args)
