"""wrap_model: returns chunks in every case and builds the gradient buckets asked for."""

import math

import pytest
import torch

from swift_mcore.arguments import PretrainArguments
from swift_mcore.models.gpt import build_model
from swift_mcore.run_config import resolve
from swift_mcore.runtime.ddp import bucket_size_for, num_grad_buckets, wrap_model

TINY = dict(num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2,
            seq_length=32, vocab_size=256, lr_warmup_iters=1, train_iters=2)


def tiny_args(padded_vocab=256, **flags):
    """A complete RunConfig whose embedding has ``padded_vocab`` rows."""
    args = PretrainArguments.from_flags(**{**TINY, **flags})
    config = resolve(args, world_size=1, cuda=False)
    return config.complete(args.model.vocab_size, None, padded_vocab_size=padded_vocab)


def test_unwrapped_is_still_a_list(gloo_group):
    args = tiny_args()
    model = build_model(args)[0]
    chunks = wrap_model(args, model, wrap_with_ddp=False)
    assert chunks == [model]


def expected_buckets(params, bucket_size):
    """Megatron's rule, restated: walk parameters backwards (backprop order) and close a
    bucket once it holds at least bucket_size elements."""
    count, filled = 0, 0
    for p in reversed([p for p in params if p.requires_grad]):
        filled += p.numel()
        if filled >= bucket_size:
            count, filled = count + 1, 0
    return count + (1 if filled else 0)


@pytest.mark.parametrize("num_buckets", [1, 2, 3, 4, 5, 8])
def test_bucket_count_follows_num_buckets(gloo_group, num_buckets):
    args = tiny_args(num_buckets=num_buckets, overlap_grad_reduce=True, num_layers=8,
                     vocab_size=128, make_vocab_size_divisible_by=64, padded_vocab=128)
    models = build_model(args)
    params = list(models[0].parameters())
    trainable = sum(p.numel() for p in params if p.requires_grad)
    bucket_size = bucket_size_for(args, models)
    assert bucket_size == math.ceil(trainable / num_buckets)
    ddp = wrap_model(args, models)
    assert len(ddp) == 1
    built = num_grad_buckets(ddp[0])
    assert built == expected_buckets(params, bucket_size)
    if num_buckets <= 4:
        # parameters are small next to the buckets here: exactly the number asked for
        assert built == num_buckets
    else:
        # a bucket cannot split a parameter: never more than asked
        assert 1 <= built <= num_buckets


def test_bucket_size_wins_and_later_chunks_are_not_bucketed(gloo_group):
    args = tiny_args(bucket_size=5_000, overlap_grad_reduce=True, num_buckets=2)
    first, second = build_model(args)[0], build_model(args)[0]
    assert bucket_size_for(args, [first]) == 5_000
    ddp = wrap_model(args, [first, second])
    assert num_grad_buckets(ddp[0]) > 2
    assert num_grad_buckets(ddp[1]) == 1


def test_without_overlap_one_bucket(gloo_group):
    ddp = wrap_model(tiny_args(), build_model(tiny_args()))
    assert num_grad_buckets(ddp[0]) == 1
