"""--data_order megatron: the samples fed are Megatron-LM's, in its order. The reference is
built here the way Megatron-LM builds it (megatron-core's GPTDataset through the builder, for
its train/valid/test sample counts, in a cache folder of its own) and read by
MegatronPretrainingSampler's definition: from consumed_samples, in sequence, chunks of
MBS x DP of which data-parallel rank r takes the r-th micro-batch."""

import itertools

import pytest
import torch

from swift_mcore.data.gpt_datasets import build_datasets, megatron_num_samples
from swift_mcore.data.loader import build_data_iterator

from data_helpers import make_args

pytestmark = pytest.mark.usefixtures("gloo_group")
MBS, GBS, TRAIN_ITERS = 5, 20, 12
# Megatron-LM's defaults (swift-mcore's differ: a flag away).
MEGATRON = dict(seed=1234, split="969,30,1", micro_batch_size=MBS, global_batch_size=GBS,
                train_iters=TRAIN_ITERS, eval_steps=5, eval_iters=2, lr_warmup_iters=0)


def megatron_pretraining_sampler(total_samples, consumed_samples, micro_batch_size,
                                 dp_rank, dp_size):
    """MegatronPretrainingSampler.__iter__ (drop_last): the indices of each micro-batch."""
    batch = []
    for idx in range(consumed_samples, total_samples):
        batch.append(idx)
        if len(batch) == micro_batch_size * dp_size:
            start = dp_rank * micro_batch_size
            yield batch[start:start + micro_batch_size]
            batch = []


def megatron_lm_train_dataset(prefix, tokenizer, cache, sizes):
    """Megatron-LM's pretrain_gpt path: GPTDatasetConfig from the run's flags, the builder
    asked for (train, valid, test) samples; its train split."""
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder)
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    config = GPTDatasetConfig(random_seed=MEGATRON["seed"], sequence_length=32,
                              blend=([prefix], None), split=MEGATRON["split"],
                              path_to_cache=str(cache), tokenizer=tokenizer,
                              reset_position_ids=False, reset_attention_mask=False,
                              eod_mask_loss=False)
    return BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, config).build()[0]


@pytest.fixture(scope="module")
def built(small_prefixes, tokenizer, tmp_path_factory):
    base = tmp_path_factory.mktemp("data_order")
    prefix = small_prefixes["b"]
    args = make_args(base, data_path=[prefix], data_order="megatron", **MEGATRON)
    ours = build_datasets(args, tokenizer)[0]
    sizes = [TRAIN_ITERS * GBS, (TRAIN_ITERS // 5 + 1) * 2 * GBS, 2 * GBS]
    assert megatron_num_samples(args) == sizes
    reference = megatron_lm_train_dataset(prefix, tokenizer, base / "megatron_lm_cache", sizes)
    return args, ours, reference


def fed(args, dataset, consumed, dp_rank, dp_size, n_micro_batches):
    it = build_data_iterator(dataset, consumed, args, dp_rank=dp_rank, dp_size=dp_size)
    return [b["tokens"] for b in itertools.islice(it, n_micro_batches)]


def expected(reference, consumed, dp_rank, dp_size, n_micro_batches):
    batches = megatron_pretraining_sampler(len(reference), consumed, MBS, dp_rank, dp_size)
    return [torch.stack([torch.as_tensor(reference[i]["tokens"]) for i in idx]).long()
            for idx in itertools.islice(batches, n_micro_batches)]


@pytest.mark.parametrize("dp_size,consumed", [(1, 0), (2, 0), (1, 3 * GBS), (2, 3 * GBS)])
def test_first_50_samples_are_megatron_lms(built, dp_size, consumed):
    """50 samples (10 micro-batches of 5 over the ranks) from the start, and after a resume at
    iteration 3: on every data-parallel rank, the tokens MegatronPretrainingSampler feeds."""
    args, ours, reference = built
    assert len(ours) == len(reference) >= TRAIN_ITERS * GBS
    per_rank = 50 // (MBS * dp_size)  # 10 or 5 micro-batches of 5
    for rank in range(dp_size):
        got = fed(args, ours, consumed, rank, dp_size, per_rank)
        want = expected(reference, consumed, rank, dp_size, per_rank)
        assert len(got) == len(want) == per_rank
        for g, w in zip(got, want):
            assert torch.equal(g, w)


def test_megatron_order_is_not_the_resumable_one(built, small_prefixes, tokenizer,
                                                 tmp_path):
    """The default order permutes the one-epoch dataset again: other samples first."""
    args, ours, reference = built
    resumable = make_args(tmp_path, data_path=[small_prefixes["b"]], **MEGATRON)
    default = build_datasets(resumable, tokenizer)[0]
    got = torch.cat(fed(resumable, default, 0, 0, 1, 10))
    want = torch.cat(expected(reference, 0, 0, 1, 10))
    assert not torch.equal(got, want)


def test_resume_check_names_train_iters_under_megatron_order():
    from swift_mcore.checkpointing import compat

    saved = {"data": {"data_order": "megatron"}, "training": {"train_iters": 12},
             "logging": {"eval_steps": 5, "eval_iters": 2}}
    now = {"data": {"data_order": "megatron"}, "training": {"train_iters": 24},
           "logging": {"eval_steps": 5, "eval_iters": 2}}
    assert compat.resume_differences(saved, now, None, None) == [
        "--train_iters: checkpoint 12, now 24 (--data_order megatron: the sample order "
        "depends on it)"]
    for d in (saved, now):
        d["data"]["data_order"] = "resumable"
    assert compat.resume_differences(saved, now, None, None) == []
    now["data"]["data_order"] = "megatron"
    assert compat.resume_differences(saved, now, None, None) == [
        "--data_order: checkpoint 'resumable', now 'megatron'"]


def test_megatron_order_needs_train_iters(tmp_path):
    from swift_mcore.errors import ArgumentError

    with pytest.raises(ArgumentError, match="--data_order megatron sizes the data by "
                                            "--train_iters"):
        make_args(tmp_path, data_order="megatron", num_train_epochs=1.0)


def test_sft_keeps_the_resumable_order(tmp_path):
    from swift_mcore.arguments import SftArguments
    from swift_mcore.errors import ArgumentError
    from swift_mcore.run_config import resolve

    data = tmp_path / "chat.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    with pytest.raises(ArgumentError, match="--data_order megatron orders megatron's "
                                            "GPTDataset"):
        resolve(SftArguments.from_flags(dataset=[str(data)], data_order="megatron",
                                        output_dir=str(tmp_path / "out")), world_size=1)
